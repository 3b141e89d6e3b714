//! Contract tests shared by every codec: round trips within each codec's
//! bound, hostile bytes never panic, config strings round-trip.
#![allow(clippy::needless_range_loop)]

use super::*;
use proptest::prelude::*;

/// Per-codec bound on |x - decode(encode(x))| for element i, given the input.
pub(crate) fn bound(cfg: &CodecConfig, x: &[f32], i: usize) -> f32 {
    let maxabs = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    match cfg {
        CodecConfig::None => 0.0,
        CodecConfig::Fp16 => x[i].abs() * 2f32.powi(-11) + 6.0e-8,
        CodecConfig::Int8 => maxabs / 254.0 * 1.0001 + f32::MIN_POSITIVE,
        CodecConfig::Qsgd { bits, bucket, .. } => {
            // The norm of the bucket holding element i.
            let b = if *bucket == 0 {
                x.len().max(1)
            } else {
                *bucket
            };
            let chunk = &x[i / b * b..((i / b + 1) * b).min(x.len())];
            let norm = chunk
                .iter()
                .map(|v| (*v as f64).powi(2))
                .sum::<f64>()
                .sqrt() as f32;
            norm / ((1u32 << (bits - 1)) - 1) as f32 * 1.0001 + f32::MIN_POSITIVE
        }
        // Top-k binarization: no per-element bound (dedicated tests in sbc.rs).
        CodecConfig::Sbc { .. } => f32::INFINITY,
        // Sparse: no per-element bound (dropped elements decode to 0); see
        // the dedicated tests in rgc/tests.rs.
        CodecConfig::Rgc { .. } | CodecConfig::RgcQuant { .. } => f32::INFINITY,
        // Sparse: dropped elements have no per-element bound; dedicated tests
        // in fastsgd.rs pin |x|/b ≤ |decoded| ≤ |x| for kept ones.
        CodecConfig::Fastsgd { .. } => f32::INFINITY,
        // §3.1: |x − q·M| ≤ M/2 with M = max|x|·s (saturated to f32::MAX).
        CodecConfig::ThreeLc { s, .. } => (maxabs * s).min(f32::MAX) / 2.0 + f32::from_bits(1),
    }
}

/// Every codec with its defaults, plus the variants the defaults do not
/// exercise (bucketed QSGD).
fn contract_configs() -> Vec<CodecConfig> {
    let mut v = CodecConfig::all_defaults();
    v.push("qsgd:bucket=16".parse().expect("bucketed qsgd"));
    v
}

fn roundtrip(cfg: &CodecConfig, x: &[f32]) -> Vec<f32> {
    let mut c = cfg.build().expect("test");
    let mut msg = Vec::new();
    c.encode(x, &mut msg).expect("test");
    let (id, n) = read_header(&msg).expect("test");
    assert_eq!((id, n), (c.id(), x.len()));
    let mut out = vec![7.0; x.len()];
    c.decode(&msg, &mut out).expect("test");
    // decode_add adds the same values.
    let mut acc = vec![1.0; x.len()];
    c.decode_add(&msg, &mut acc).expect("test");
    for i in 0..x.len() {
        assert!((acc[i] - 1.0 - out[i]).abs() <= 1e-6 * (1.0 + out[i].abs()));
    }
    out
}

#[test]
fn config_strings_parse_and_print() {
    for s in [
        "none",
        "fp16",
        "int8",
        "qsgd",
        "qsgd:bits=8,seed=3",
        "sbc",
        "3lc",
        "3lc:s=1.5,stage=quartic",
    ] {
        let c: CodecConfig = s.parse().expect("test");
        assert_eq!(c.name(), s.split(':').next().expect("test"));
        let json = serde_json::to_string(&c).expect("test");
        assert_eq!(serde_json::from_str::<CodecConfig>(&json).expect("test"), c);
    }
    assert!("bogus".parse::<CodecConfig>().is_err());
    assert!("int8:x=1".parse::<CodecConfig>().is_err());
    assert!("int8:novalue".parse::<CodecConfig>().is_err());
}

#[test]
fn header_rejects_garbage() {
    assert!(read_header(&[]).is_err());
    assert!(read_header(b"XX\x01\x00\0\0\0\0\0\0\0\0").is_err());
    assert!(read_header(b"GS\x09\x00\0\0\0\0\0\0\0\0").is_err());
    assert!(read_header(b"GS\x01\xff\0\0\0\0\0\0\0\0").is_err());
    let mut m = Vec::new();
    write_header(&mut m, CodecId::Int8, 5);
    assert_eq!(read_header(&m).expect("test"), (CodecId::Int8, 5));
    assert!(check_header(&m, CodecId::Int8, 4).is_err());
    assert!(check_header(&m, CodecId::Fp16, 5).is_err());
}

#[test]
fn baselines_round_trip_edge_cases() {
    for cfg in contract_configs() {
        for x in [
            vec![],
            vec![0.0; 17],
            vec![1.0, -2.0, 3.5],
            (0..1000).map(|i| (i as f32 * 0.37).sin()).collect(),
        ] {
            let y = roundtrip(&cfg, &x);
            for i in 0..x.len() {
                assert!(
                    (x[i] - y[i]).abs() <= bound(&cfg, &x, i),
                    "{cfg:?} i={i} {} vs {}",
                    x[i],
                    y[i]
                );
            }
        }
    }
}

#[test]
fn int8_rejects_nan_and_size_mismatch() {
    let mut c = Int8;
    let mut m = Vec::new();
    assert!(c.encode(&[1.0, f32::NAN], &mut m).is_err());
    c.encode(&[1.0, 2.0], &mut m).expect("test");
    assert!(c.decode(&m, &mut [0.0; 3]).is_err());
    assert!(c.decode(&m[..m.len() - 1], &mut [0.0; 2]).is_err());
}

#[test]
fn error_feedback_tracks_the_running_sum() {
    let n = 64;
    let mut ef = ErrorFeedback::new(n);
    let mut c = Int8;
    let mut msg = Vec::new();
    let mut sent = vec![0f32; n];
    let mut total = vec![0f32; n];
    for step in 0..200 {
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 7 + step * 13) % 23) as f32 / 23.0 - 0.4)
            .collect();
        ef.step(&mut c, &g, &mut msg).expect("test");
        c.decode_add(&msg, &mut sent).expect("test");
        for i in 0..n {
            total[i] += g[i];
        }
    }
    for i in 0..n {
        // sum(decoded) = sum(grad) − residual, and the residual stays bounded.
        assert!((total[i] - sent[i] - ef.residual()[i]).abs() < 1e-2);
        assert!(ef.residual()[i].abs() < 0.05);
    }
    assert!(ef.step(&mut c, &[0.0; 3], &mut msg).is_err());
    // A NaN gradient is refused and leaves the residual untouched.
    let before = ef.residual().to_vec();
    let mut bad = vec![0.0f32; n];
    bad[3] = f32::NAN;
    assert!(ef.step(&mut c, &bad, &mut msg).is_err());
    assert_eq!(ef.residual(), &before[..]);
    // A codec error (fp16 range) after the add is rolled back as well.
    let mut h = Fp16;
    assert!(ef.step(&mut h, &vec![1e6f32; n], &mut msg).is_err());
    assert_eq!(ef.residual(), &before[..]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn prop_round_trip_within_bound(x in proptest::collection::vec(-1e3f32..1e3, 0..2000), which in 0usize..16) {
        let all = contract_configs();
        let cfg = &all[which % all.len()];
        let y = roundtrip(cfg, &x);
        for i in 0..x.len() {
            prop_assert!((x[i] - y[i]).abs() <= bound(cfg, &x, i), "{:?} i={} {} vs {}", cfg, i, x[i], y[i]);
        }
    }

    #[test]
    fn prop_decoders_survive_hostile_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300), n in 0usize..100) {
        for cfg in contract_configs() {
            let c = cfg.build().expect("test");
            let mut out = vec![0f32; n];
            let _ = c.decode(&bytes, &mut out);
            let _ = c.decode_add(&bytes, &mut out);
        }
    }

    #[test]
    fn prop_decoders_survive_mutated_messages(x in proptest::collection::vec(-10f32..10.0, 0..200),
                                              flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
                                              cut in any::<usize>()) {
        for cfg in contract_configs() {
            let mut c = cfg.build().expect("test");
            let mut msg = Vec::new();
            c.encode(&x, &mut msg).expect("test");
            let mut out = vec![0f32; x.len()];
            // A truncated (unmutated) message is always an error.
            let cut = cut % (msg.len() + 1);
            prop_assert!(c.decode(&msg[..cut], &mut out).is_err() || cut == msg.len(), "{:?} cut {}", cfg, cut);
            // A mutated one, whole or truncated, must not panic (it may decode:
            // a flipped value bit is still a valid message).
            for &(pos, b) in &flips {
                let l = msg.len();
                msg[pos % l] ^= b;
            }
            let _ = c.decode(&msg, &mut out);
            let _ = c.decode(&msg[..cut], &mut out);
        }
    }
}
