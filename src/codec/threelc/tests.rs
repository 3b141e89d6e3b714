#![allow(clippy::needless_range_loop)]
use super::*;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

fn enc(c: &mut ThreeLc, x: &[f32]) -> Vec<u8> {
    let mut m = Vec::new();
    c.encode(x, &mut m).expect("test");
    m
}

fn payload(msg: &[u8]) -> &[u8] {
    &msg[super::super::HEADER_LEN + 5..]
}

fn full() -> ThreeLc {
    ThreeLc::new(1.0, ThreeLcStage::Full).expect("test")
}

fn quartic() -> ThreeLc {
    ThreeLc::new(1.0, ThreeLcStage::Quartic).expect("test")
}

#[test]
fn five_zeros_encode_to_121() {
    let m = enc(&mut quartic(), &[0.0; 5]);
    assert_eq!(payload(&m), &[121]);
    let m = enc(&mut full(), &[0.0; 5]);
    assert_eq!(payload(&m), &[121]);
    // Scale is zero, no NaN anywhere.
    let mut out = [9.0f32; 5];
    full().decode(&m, &mut out).expect("test");
    assert_eq!(out, [0.0; 5]);
}

#[test]
fn quartic_digits_follow_the_paper() {
    // n = 5: each partition holds one element, byte = Σ p_k·3^(4−k).
    let x = [1.0, -1.0, 0.0, 1.0, -1.0];
    let m = enc(&mut quartic(), &x);
    assert_eq!(payload(&m), &[2 * 81 + 9 + 2 * 3]);
    // n = 10: partitions are contiguous, p_0 = x[0..2], p_1 = x[2..4], ...
    let mut x = [0.0f32; 10];
    x[1] = 1.0; // p_0[1]
    x[8] = -1.0; // p_4[0]
    let m = enc(&mut quartic(), &x);
    assert_eq!(payload(&m), &[121 - 1, 121 + 81]);
}

#[test]
fn fourteen_zero_groups_are_one_byte_255() {
    let m = enc(&mut full(), &[0.0; 70]);
    assert_eq!(payload(&m), &[255]);
    let m = enc(&mut full(), &[0.0; 75]);
    assert_eq!(payload(&m), &[255, 121]);
    let m = enc(&mut full(), &[0.0; 10]);
    assert_eq!(payload(&m), &[243]);
    let m = enc(&mut full(), &[0.0; 80]);
    assert_eq!(payload(&m), &[255, 243]);
    for n in [70, 75, 80] {
        let msg = enc(&mut full(), &vec![0.0; n]);
        let mut out = vec![1.0; n];
        full().decode(&msg, &mut out).expect("test");
        assert!(out.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn zre_splits_runs_and_keeps_single_121() {
    let mut b = vec![1, 121, 2, 121, 121, 3];
    let w = zre_in_place(&mut b);
    assert_eq!(&b[..w], &[1, 121, 2, 243, 3]);
    let mut b = vec![121; 29];
    let w = zre_in_place(&mut b);
    assert_eq!(&b[..w], &[255, 255, 121]);
    let mut b = vec![121; 30];
    let w = zre_in_place(&mut b);
    assert_eq!(&b[..w], &[255, 255, 243]);
    assert_eq!(
        zre_decode(&[255, 255, 243], 30).expect("test"),
        vec![121; 30]
    );
    assert!(zre_decode(&[255, 255, 243], 29).is_err());
}

#[test]
fn all_zero_million_compresses_over_270x() {
    let n = 1_000_000;
    let x = vec![0.0f32; n];
    let m = enc(&mut full(), &x);
    let ratio = (4 * n) as f64 / m.len() as f64;
    // 200000 quartic bytes → ⌈200000/14⌉ = 14286 bytes + 17 header bytes.
    assert_eq!(m.len(), 17 + 14286);
    assert!(ratio >= 270.0, "ratio {ratio}");
}

#[test]
fn quartic_stage_is_1_6_bits_per_value() {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    for n in [5usize, 100, 12345 * 5] {
        let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let m = enc(&mut quartic(), &x);
        assert_eq!(payload(&m).len(), n / 5);
        assert_eq!(payload(&m).len() as f64 * 8.0 / n as f64, 1.6);
        assert!(payload(&m).iter().all(|&b| b <= MAX_QUARTIC));
    }
    // Quant stage: one byte per value.
    let mut q = ThreeLc::new(1.0, ThreeLcStage::Quant).expect("test");
    let m = enc(&mut q, &[0.5, -0.2, 0.1, -1.0]);
    assert_eq!(payload(&m), &[0, 0, 0, 0xff]);
    assert_eq!(f32::from_le_bytes(m[12..16].try_into().expect("test")), 1.0);
    assert_eq!(m[16], 0);
}

#[test]
fn larger_s_is_sparser() {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let x: Vec<f32> = (0..100_000)
        .map(|_| {
            let g: f32 = rng.gen_range(-1.0f32..1.0);
            g * g * g
        })
        .collect();
    let zeros = |s: f32| {
        let mut c = ThreeLc::new(s, ThreeLcStage::Quant).expect("test");
        let m = enc(&mut c, &x);
        payload(&m).iter().filter(|&&b| b == 0).count()
    };
    let size = |s: f32| enc(&mut ThreeLc::new(s, ThreeLcStage::Full).expect("test"), &x).len();
    let (z1, z19) = (zeros(1.0), zeros(1.9));
    assert!(z19 > z1, "{z1} {z19}");
    assert!(size(1.9) < size(1.0));
}

#[test]
fn ties_and_extremes() {
    // |x| = M/2 exactly rounds to 0 (half to even); just above rounds to 1.
    let mut c = ThreeLc::new(1.0, ThreeLcStage::Quant).expect("test");
    let m = enc(&mut c, &[2.0, 1.0, -1.0, 1.0000001, 0.0]);
    assert_eq!(payload(&m), &[1, 0, 0, 1, 0]);
    // Overflowing max·s saturates M to f32::MAX, still within M/2.
    let mut c = ThreeLc::new(1.9, ThreeLcStage::Full).expect("test");
    let x = [f32::MAX, -f32::MAX * 0.6, 1.0];
    let m = enc(&mut c, &x);
    let mut y = [0.0; 3];
    c.decode(&m, &mut y).expect("test");
    assert_eq!(y, [f32::MAX, -f32::MAX, 0.0]);
    // Subnormals.
    let x = [f32::from_bits(1), -f32::from_bits(3), 0.0];
    let mut c = full();
    let m = enc(&mut c, &x);
    let mut y = [0.0; 3];
    c.decode(&m, &mut y).expect("test");
    for i in 0..3 {
        assert!((x[i] as f64 - y[i] as f64).abs() <= 3.0 * f32::from_bits(1) as f64 / 2.0);
    }
}

#[test]
fn invalid_s_and_nan_are_rejected() {
    for s in [0.0, 0.99, 2.0, 2.5, f32::NAN, f32::INFINITY, -1.0] {
        let cfg = CodecConfig::ThreeLc {
            s,
            stage: ThreeLcStage::Full,
        };
        assert!(matches!(cfg.build(), Err(Error::InvalidArgument(_))), "{s}");
    }
    assert!("3lc:s=2"
        .parse::<CodecConfig>()
        .expect("test")
        .build()
        .is_err());
    let mut c = full();
    let mut m = Vec::new();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(
            c.encode(&[1.0, bad], &mut m),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn config_strings() {
    let c: CodecConfig = "3lc".parse().expect("test");
    assert_eq!(
        c,
        CodecConfig::ThreeLc {
            s: 1.0,
            stage: ThreeLcStage::Full
        }
    );
    assert_eq!(c.name(), "3lc");
    let c: CodecConfig = "3lc:s=1.75,stage=quartic".parse().expect("test");
    assert_eq!(
        c,
        CodecConfig::ThreeLc {
            s: 1.75,
            stage: ThreeLcStage::Quartic
        }
    );
    assert_eq!(c.build().expect("test").config(), c);
    let json = serde_json::to_string(&c).expect("test");
    assert_eq!(serde_json::from_str::<CodecConfig>(&json).expect("test"), c);
    assert!("3lc:stage=bogus".parse::<CodecConfig>().is_err());
    assert!("3lc:k=1".parse::<CodecConfig>().is_err());
}

#[test]
fn decoder_rejects_non_canonical_messages() {
    let x: Vec<f32> = (0..12).map(|i| i as f32 - 6.0).collect();
    let good = enc(&mut quartic(), &x);
    let mut out = vec![0.0; 12];
    quartic().decode(&good, &mut out).expect("test");
    // Byte > 242 in the quartic stage.
    let mut bad = good.clone();
    bad[17] = 243;
    assert!(quartic().decode(&bad, &mut out).is_err());
    // Non-zero padding trit: n = 12, L = 3, byte 2 holds elements 2, 5, 8, 11
    // and one padding digit (the last).
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] = (bad[last] / 3) * 3 + 2;
    assert!(quartic().decode(&bad, &mut out).is_err());
    // Unknown stage, negative scale, trailing bytes.
    let mut bad = good.clone();
    bad[16] = 3;
    assert!(quartic().decode(&bad, &mut out).is_err());
    let mut bad = good.clone();
    bad[12..16].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert!(quartic().decode(&bad, &mut out).is_err());
    let mut bad = good.clone();
    bad.push(121);
    assert!(quartic().decode(&bad, &mut out).is_err());
    // Full stage: runs that overshoot, or fall short.
    let z = enc(&mut full(), &[0.0; 70]);
    let mut out = vec![0.0; 65];
    let mut m65 = Vec::new();
    write_header(&mut m65, CodecId::ThreeLc, 65);
    m65.extend_from_slice(&z[12..]);
    assert!(full().decode(&m65, &mut out).is_err());
    let mut out = vec![0.0; 75];
    let mut m75 = Vec::new();
    write_header(&mut m75, CodecId::ThreeLc, 75);
    m75.extend_from_slice(&z[12..]);
    assert!(full().decode(&m75, &mut out).is_err());
    // Quant stage: trit 2.
    let mut q = ThreeLc::new(1.0, ThreeLcStage::Quant).expect("test");
    let mut bad = enc(&mut q, &[1.0, 0.0]);
    bad[17] = 2;
    assert!(q.decode(&bad, &mut [0.0; 2]).is_err());
}

#[test]
fn all_stages_decode_to_the_same_values() {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    for n in [0usize, 1, 2, 3, 4, 5, 6, 9, 11, 16, 21, 69, 70, 71, 1001] {
        let x: Vec<f32> = (0..n)
            .map(|_| {
                if rng.gen_bool(0.7) {
                    0.0
                } else {
                    rng.gen_range(-3.0..3.0)
                }
            })
            .collect();
        let mut ys = Vec::new();
        for stage in [
            ThreeLcStage::Quant,
            ThreeLcStage::Quartic,
            ThreeLcStage::Full,
        ] {
            let mut c = ThreeLc::new(1.3, stage).expect("test");
            let m = enc(&mut c, &x);
            let mut y = vec![0.0; n];
            // Any 3LC decoder reads any stage.
            full().decode(&m, &mut y).expect("test");
            ys.push(y);
        }
        assert_eq!(ys[0], ys[1], "n={n}");
        assert_eq!(ys[1], ys[2], "n={n}");
    }
}

/// Throughput smoke check (release builds only; timing on shared CI is
/// noisy, so this only prints). Run with `--nocapture` to see it.
#[test]
fn encode_throughput_report() {
    let n = 1 << 22;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    let x: Vec<f32> = (0..n)
        .map(|_| rng.gen_range(-1.0f32..1.0).powi(3))
        .collect();
    let mut c = full();
    let mut m = Vec::with_capacity(n);
    c.encode(&x, &mut m).expect("test");
    let reps = 10;
    let t = std::time::Instant::now();
    for _ in 0..reps {
        c.encode(&x, &mut m).expect("test");
    }
    let enc_s = t.elapsed().as_secs_f64() / reps as f64;
    let mut acc = vec![0.0f32; n];
    let t = std::time::Instant::now();
    for _ in 0..reps {
        c.decode_add(&m, &mut acc).expect("test");
    }
    let dec_s = t.elapsed().as_secs_f64() / reps as f64;
    eprintln!(
        "3lc full: encode {:.2} GB/s, decode_add {:.2} GB/s of f32 ({} -> {} bytes)",
        (4 * n) as f64 / enc_s / 1e9,
        (4 * n) as f64 / dec_s / 1e9,
        4 * n,
        m.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn prop_error_within_half_m(x in proptest::collection::vec(
            prop_oneof![Just(0.0f32), -1e6f32..1e6, -1e-30f32..1e-30], 0..600),
            s in 1.0f32..1.9999, st in 0u8..3) {
        let stage = ThreeLcStage::from_u8(st).expect("test");
        let mut c = ThreeLc::new(s, stage).expect("test");
        let msg = enc(&mut c, &x);
        let m = c.scale(&x).expect("test");
        let mut y = vec![0.0; x.len()];
        c.decode(&msg, &mut y).expect("test");
        let mut acc = vec![0.0; x.len()];
        c.decode_add(&msg, &mut acc).expect("test");
        prop_assert_eq!(&acc, &y);
        for i in 0..x.len() {
            let e = (x[i] as f64 - y[i] as f64).abs();
            prop_assert!(e <= m as f64 / 2.0, "i={} x={} y={} M={}", i, x[i], y[i], m);
            prop_assert!(y[i] == 0.0 || y[i].abs() == m);
        }
        // Reference: q = round_half_even(x / M) evaluated in f64.
        for i in 0..x.len() {
            let q = if m == 0.0 { 0.0 } else { (x[i] as f64 / m as f64).round_ties_even() };
            prop_assert_eq!(q * m as f64, y[i] as f64);
        }
    }

    #[test]
    fn prop_hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200),
                                      n in 0usize..300, st in 0u8..3, mlen in 0usize..4) {
        let c = full();
        let mut out = vec![0f32; n];
        let _ = c.decode(&bytes, &mut out);
        // A valid header in front of random bytes reaches the payload checks.
        let mut msg = Vec::new();
        write_header(&mut msg, CodecId::ThreeLc, n);
        msg.extend_from_slice(&[0.5f32, 1.0, 0.0, 2.0][mlen].to_le_bytes());
        msg.push(st);
        msg.extend_from_slice(&bytes);
        let before = out.clone();
        if c.decode_add(&msg, &mut out).is_err() {
            prop_assert_eq!(before, out);
        }
    }

    #[test]
    fn prop_mutated_messages(x in proptest::collection::vec(prop_oneof![Just(0.0f32), -10f32..10.0], 0..400),
                             flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
                             cut in any::<usize>(), st in 0u8..3) {
        let mut c = ThreeLc::new(1.5, ThreeLcStage::from_u8(st).expect("test")).expect("test");
        let mut msg = enc(&mut c, &x);
        let cut = cut % (msg.len() + 1);
        let mut out = vec![0f32; x.len()];
        prop_assert!(c.decode(&msg[..cut], &mut out).is_err() || cut == msg.len());
        for &(pos, b) in &flips {
            let l = msg.len();
            msg[pos % l] ^= b;
        }
        let before = out.clone();
        if c.decode_add(&msg, &mut out).is_err() {
            prop_assert_eq!(before, out);
        }
    }
}
