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
        CodecConfig::Fp16 | CodecConfig::Int8 => baseline_bound(cfg, x[i], maxabs) as f32,
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

/// The documented bounds of the baselines (src/codec/baseline.rs), in f64.
fn baseline_bound(cfg: &CodecConfig, x: f32, maxabs: f32) -> f64 {
    let (x, m) = (f64::from(x), f64::from(maxabs));
    match cfg {
        CodecConfig::None => 0.0,
        CodecConfig::Fp16 => x.abs() * 2f64.powi(-11) + m * 2f64.powi(-39),
        CodecConfig::Int8 => (1.0 + 2f64.powi(-15)) * m / 254.0 + 2f64.powi(-149),
        _ => unreachable!("not a baseline"),
    }
}

/// Round-trip `x` through a baseline and check every element against its
/// documented bound, in f64 (no rounding in the comparison).
fn check_baseline(cfg: &CodecConfig, x: &[f32]) -> std::result::Result<(), String> {
    let y = roundtrip(cfg, x);
    let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    for i in 0..x.len() {
        let err = (f64::from(x[i]) - f64::from(y[i])).abs();
        let b = baseline_bound(cfg, x[i], m);
        if !y[i].is_finite() || err > b {
            return Err(format!(
                "{} element {i} of {}: {:e} decoded as {:e} (error {err:e} > bound {b:e}, max|x| {m:e})",
                cfg.name(),
                x.len(),
                x[i],
                y[i]
            ));
        }
    }
    Ok(())
}

fn baseline_configs() -> [CodecConfig; 3] {
    [CodecConfig::None, CodecConfig::Fp16, CodecConfig::Int8]
}

/// Regression: int8 returned ±max|x| everywhere when max|x| < 3.7e-37
/// (`127/scale` overflowed in f32) and inf for ±f32::MAX; fp16 rejected
/// values beyond ±65504 and flushed tiny tensors to zero.
#[test]
fn baselines_cover_the_whole_finite_range() {
    let tiny = f32::from_bits(1);
    let cases: Vec<Vec<f32>> = vec![
        vec![1e-38, -5e-39, 2.5e-39, 0.0],
        vec![3e-37, -1e-37, 7e-38],
        vec![tiny, -tiny, 0.0, f32::from_bits(3)],
        vec![f32::from_bits(0x007f_ffff), -1e-40, 1e-45],
        vec![f32::MAX, -f32::MAX, 1.0, -3e38, 1e30],
        vec![f32::MAX; 5],
        vec![-f32::MAX],
        vec![1e6, -7e4, 65504.0, 65520.0, 3.0, -1e-3],
        vec![1e-10, -3e-9, 1e-40, 2e-12],
        vec![f32::MAX, tiny, -tiny, 1e-30],
        vec![0.0; 9],
        vec![-0.0, 0.0],
        vec![5e-8],
    ];
    for cfg in baseline_configs() {
        for x in &cases {
            check_baseline(&cfg, x).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    // The specific failures of the report.
    let y = roundtrip(&CodecConfig::Int8, &[1e-38, 2.5e-39]);
    assert!((y[1] - 2.5e-39).abs() < 1e-40, "{y:?}");
    let y = roundtrip(&CodecConfig::Int8, &[f32::MAX, -f32::MAX]);
    assert_eq!(y, vec![f32::MAX, -f32::MAX]);
    let y = roundtrip(&CodecConfig::Fp16, &[1e6, -3.0]);
    assert!((y[0] - 1e6).abs() <= 1e6 / 2048.0 && y[1] == -3.0, "{y:?}");
    let y = roundtrip(&CodecConfig::Fp16, &[1e-10, -3e-9]);
    assert!((y[0] - 1e-10).abs() <= 1e-10 / 2048.0, "{y:?}");
}

#[test]
fn baseline_decoders_reject_bad_parameters() {
    let mut msg = Vec::new();
    Fp16.encode(&[1.0, 2.0], &mut msg).expect("test");
    let mut out = [0f32; 2];
    for k in [-164i16, 114, i16::MIN, i16::MAX] {
        msg[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&k.to_le_bytes());
        assert!(Fp16.decode(&msg, &mut out).is_err(), "k = {k}");
    }
    // The extreme exponents decode to finite values.
    for k in [-163i16, 113] {
        msg[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&k.to_le_bytes());
        let mut m2 = msg.clone();
        m2[HEADER_LEN + 2..].copy_from_slice(&[0xff, 0x7b, 0xff, 0xfb]); // ±65504
        Fp16.decode(&m2, &mut out).expect("finite");
        assert!(out.iter().all(|v| v.is_finite()), "{out:?}");
    }
    Int8.encode(&[1.0, -2.0], &mut msg).expect("test");
    msg[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&(-2f32).to_le_bytes());
    assert!(Int8.decode(&msg, &mut out).is_err());
    msg[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&f32::MAX.to_le_bytes());
    Int8.decode(&msg, &mut out).expect("f32::MAX scale");
    assert!(out.iter().all(|v| v.is_finite()), "{out:?}");
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
    // A codec error after the add is rolled back as well.
    struct Failing;
    impl Codec for Failing {
        fn id(&self) -> CodecId {
            CodecId::None
        }
        fn config(&self) -> CodecConfig {
            CodecConfig::None
        }
        fn encode(&mut self, _: &[f32], _: &mut Vec<u8>) -> Result<()> {
            Err(Error::InvalidArgument("always fails".into()))
        }
        fn decode_add(&self, _: &[u8], _: &mut [f32]) -> Result<()> {
            Ok(())
        }
    }
    assert!(ef.step(&mut Failing, &vec![1e6f32; n], &mut msg).is_err());
    assert_eq!(ef.residual(), &before[..]);
}

/// Fuzz finding (fuzz target `codec_decode`, set_state path): a restored
/// call counter at `u64::MAX` made the next `encode` overflow (a panic in
/// builds with overflow checks). The counters wrap; RGC-quant's sign still
/// alternates (MAX is odd, 0 even) and QSGD still draws a fresh stream.
#[test]
fn fuzz_call_counter_at_max_wraps() {
    let x: Vec<f32> = (0..100).map(|i| (i as f32 - 49.5) * 0.01).collect();
    for name in ["rgc-quant", "qsgd"] {
        let cfg: CodecConfig = name.parse().expect("test");
        let mut c = cfg.build().expect("test");
        c.set_state(&u64::MAX.to_le_bytes())
            .expect("8 bytes of state");
        let mut msg = Vec::new();
        c.encode(&x, &mut msg).expect("encode at the counter's end");
        assert_eq!(c.state(), 0u64.to_le_bytes().to_vec(), "{name}: wrapped");
        let mut out = vec![0f32; x.len()];
        c.decode(&msg, &mut out).expect("decodes");
        if name == "rgc-quant" {
            // Counter MAX (odd) sent the negative set, 0 sends the positive one.
            assert!(out.iter().all(|&v| v <= 0.0) && out.iter().any(|&v| v < 0.0));
            c.encode(&x, &mut msg).expect("encode");
            c.decode(&msg, &mut out).expect("decodes");
            assert!(out.iter().all(|&v| v >= 0.0) && out.iter().any(|&v| v > 0.0));
        }
    }
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

    /// The baselines' documented bounds over every finite magnitude: a
    /// tensor at scale 2^`mag` (subnormal to f32::MAX) whose elements spread
    /// over up to 2^-60 of it, with zeros, ±f32::MAX, the smallest
    /// subnormal, single elements and all-zero tensors mixed in.
    #[test]
    fn prop_baselines_within_bound_at_every_magnitude(
        mag in -149i32..=128,
        els in proptest::collection::vec((-1f64..=1.0, 0i32..60), 1..300),
        special in 0u8..8,
    ) {
        let mut x: Vec<f32> = els
            .iter()
            .map(|&(u, d)| (u * 2f64.powi(mag - d)).clamp(-f64::from(f32::MAX), f64::from(f32::MAX)) as f32)
            .collect();
        match special {
            1 => x[0] = f32::MAX,
            2 => x[0] = -f32::MAX,
            3 => x.iter_mut().for_each(|v| *v = 0.0),
            4 => x.truncate(1),
            5 => x[0] = f32::from_bits(1),
            6 => x[0] = 0.0,
            _ => {}
        }
        for cfg in baseline_configs() {
            if let Err(e) = check_baseline(&cfg, &x) {
                prop_assert!(false, "{}", e);
            }
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

/// Encoders that check finiteness inside their own passes (fused with a
/// max, a norm, a selection) reject NaN/±∞ anywhere, also in tensors long
/// enough for their sampled and blocked paths.
#[test]
fn every_codec_rejects_non_finite_in_long_tensors() {
    let n = 300_007;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 1e-3)
        .collect();
    for cfg in CodecConfig::all_defaults() {
        let mut c = cfg.build().expect("codec");
        let mut msg = Vec::new();
        c.encode(&x, &mut msg).expect("finite input");
        for at in [0, n / 2, n - 1] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut y = x.clone();
                y[at] = bad;
                let r = c.encode(&y, &mut msg);
                assert!(
                    matches!(r, Err(crate::Error::InvalidArgument(_))),
                    "{}: {bad} at {at} gave {r:?}",
                    cfg.name()
                );
            }
        }
    }
}

/// The fp16 decoder (blocks through `half`'s slice conversion) adds exactly
/// what the per-element definition says, `f16 · 2^k` clamped to f32, for
/// every 16-bit pattern that is finite, at the extreme scale exponents,
/// into a nonzero accumulator, and over a length that is not a multiple of
/// the block.
#[test]
fn fp16_decode_is_the_per_element_definition() {
    let finite: Vec<u16> = (0..=u16::MAX).filter(|b| b & 0x7c00 != 0x7c00).collect();
    let n = finite.len() + 4097;
    let bits: Vec<u16> = (0..n).map(|i| finite[(i * 7919) % finite.len()]).collect();
    for k in [-163i16, -24, 0, 15, 113] {
        let mut msg = Vec::new();
        write_header(&mut msg, CodecId::Fp16, n);
        msg.extend_from_slice(&k.to_le_bytes());
        for b in &bits {
            msg.extend_from_slice(&b.to_le_bytes());
        }
        let start: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
        let mut got = start.clone();
        Fp16.decode_add(&msg, &mut got)
            .expect("finite halves decode");
        let (scale, max) = (2f64.powi(i32::from(k)), f64::from(f32::MAX));
        for i in 0..n {
            let v = f64::from(half::f16::from_bits(bits[i]).to_f32());
            let want = start[i] + (v * scale).clamp(-max, max) as f32;
            assert_eq!(got[i].to_bits(), want.to_bits(), "k = {k}, element {i}");
        }
    }
}
