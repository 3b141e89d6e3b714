use super::*;
use crate::codec::{read_header, HEADER_LEN};
use proptest::prelude::*;

fn enc(c: &mut FastSgd, x: &[f32]) -> Vec<u8> {
    let mut m = Vec::new();
    c.encode(x, &mut m).expect("encode");
    m
}

fn dec(c: &FastSgd, m: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut y = vec![0f32; n];
    c.decode(m, &mut y)?;
    Ok(y)
}

fn bits_of(bytes: &[u8], nbits: usize) -> String {
    (0..nbits)
        .map(|i| {
            if bytes[i / 8] >> (7 - i % 8) & 1 == 1 {
                '1'
            } else {
                '0'
            }
        })
        .collect()
}

/// Fig. 3: l = 2, max delta 232 → M = 8, flag ranges [0,4), [4,16),
/// [16,64), [64,256); delta 3 (key 578) → `0011`.
/// `level` by linear scan: the smallest `L ≤ τ` with `sum·p[L] ≤ a`.
fn level_scan(sum: f64, a: f64, p: &[f64; TABLE], tau: usize) -> usize {
    (0..=tau).find(|&l| sum * p[l] <= a).unwrap_or(tau)
}

#[test]
fn level_is_exact_from_any_estimate() {
    for b in [1.001, 1.1, 1.5, 2.0, 10.0] {
        let p = inv_powers(b);
        let mut s = 1u64;
        for _ in 0..20_000 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let sum = f64::from_bits(0x3ff0_0000_0000_0000 | (s >> 12)) * 1e3;
            let a = sum * p[(s >> 57) as usize % 129] * (1.0 + ((s >> 20) & 0xff) as f64 / 4096.0);
            for tau in [128, 17] {
                if sum * p[tau] <= a {
                    let want = level_scan(sum, a, &p, tau);
                    assert_eq!(
                        level(sum, a, &p, tau, b.ln()),
                        want,
                        "b={b} sum={sum} a={a}"
                    );
                    let lv = Levels::new(sum, &p, tau, b.ln());
                    assert_eq!(lv.of(a), want, "table: b={b} sum={sum} a={a}");
                }
            }
            // Exactly on a boundary.
            let a = sum * p[(s >> 40) as usize % 129];
            let want = level_scan(sum, a, &p, 128);
            assert_eq!(level(sum, a, &p, 128, b.ln()), want);
            assert_eq!(Levels::new(sum, &p, 128, b.ln()).of(a), want);
        }
    }
}

/// The reference sum as computed before the sampled estimate: per-level
/// sums over every element at or above the floor.
fn reference_sum_full(x: &[f32], st: &Stats, p: &[f64; TABLE], tau: usize) -> f64 {
    let (sum, min, max) = (st.sum, st.min, st.max);
    if max == 0.0 || sum * p[tau] <= min {
        return sum;
    }
    let mut bucket = [0f64; TABLE];
    for &v in x {
        let a = v.abs() as f64;
        if a >= max * p[tau] {
            bucket[level_scan(max, a, p, tau)] += a;
        }
    }
    let (mut cum, mut best) = (0.0, None);
    for (j, b) in bucket.iter().enumerate() {
        cum += b;
        if cum * p[tau] > max * p[j] {
            break;
        }
        best = Some(cum);
    }
    best.unwrap_or_else(|| {
        let mut s = max / p[tau];
        while s * p[tau] > max {
            s = f64::from_bits(s.to_bits() - 1);
        }
        s
    })
}

/// Above the sampling size the estimate-and-filter path gives the very
/// same `S` (bit for bit) as the full per-level pass, and the kept set
/// is exactly `|x_i| ≥ S·b^-τ`, also on data that fools the stride.
#[test]
fn sampled_reference_sum_is_exact() {
    let n = 4 * SAMPLE + 777;
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let lap: Vec<f32> = (0..n)
        .map(|_| (next() - 0.5).signum() * -(next() + 1e-7).ln() * 1e-3)
        .collect();
    let uni: Vec<f32> = (0..n).map(|_| next() - 0.5).collect();
    let coarse: Vec<f32> = lap.iter().map(|v| (v * 4e3).round()).collect();
    let stride = n / SAMPLE;
    let fool: Vec<f32> = lap
        .iter()
        .enumerate()
        .map(|(i, v)| if i % stride == 1 { v * 30.0 } else { *v })
        .collect();
    for (name, x) in [
        ("laplace", &lap),
        ("uniform", &uni),
        ("coarse", &coarse),
        ("fool", &fool),
    ] {
        for (b, tau) in [(1.1, 128), (1.5, 40), (2.0, 20)] {
            let p = inv_powers(b);
            let st = abs_stats(x);
            let mut cand = Vec::new();
            let (got, from) = reference_sum(x, &st, &p, tau, f64::ln(b), &mut cand);
            let want = reference_sum_full(x, &st, &p, tau);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{name} b={b}: {got} vs {want}"
            );
            if from.is_finite() {
                let t = f32_at_least(from);
                let all: Vec<u32> = (0..n as u32)
                    .filter(|&i| x[i as usize].abs() >= t)
                    .collect();
                assert_eq!(cand.iter().map(|c| c.0).collect::<Vec<_>>(), all, "{name}");
            }
            let mut c = FastSgd::new(b, tau as u32, 2).expect("params");
            let m = enc(&mut c, x);
            let y = dec(&c, &m, n).expect("decode");
            let tau_e = got * p[tau];
            for (i, (v, w)) in x.iter().zip(&y).enumerate() {
                let kept = *v != 0.0 && f64::from(v.abs()) >= tau_e;
                assert_eq!(*w != 0.0, kept, "{name} b={b} element {i}: {v} -> {w}");
            }
        }
    }
}

#[test]
fn fig3_adaptive_binary_encoding() {
    assert_eq!(bit_len(232), 8);
    let w = widths(8, 2);
    assert_eq!(&w[..4], &[2, 4, 6, 8]);
    let mut out = Vec::new();
    let mut bw = BitWriter::new(&mut out);
    write_delta(&mut bw, 3, 2, &w);
    assert_eq!(bw.n, 4);
    bw.finish();
    assert_eq!(out, vec![0b0011_0000]);
    assert_eq!(bits_of(&out, 4), "0011");
    // Range boundaries select the flags of Fig. 3.
    for (delta, flag) in [
        (0u64, 0u8),
        (3, 0),
        (4, 1),
        (15, 1),
        (16, 2),
        (63, 2),
        (64, 3),
        (232, 3),
        (255, 3),
    ] {
        let mut out = Vec::new();
        let mut bw = BitWriter::new(&mut out);
        write_delta(&mut bw, delta, 2, &w);
        bw.finish();
        assert_eq!(out[0] >> 6, flag, "delta {delta}");
        let mut br = BitReader::new(&out);
        assert_eq!(read_delta(&mut br, 2, &w).expect("read"), delta);
    }
}

/// Corrected Algorithm 2: M is the bit length (256 needs 9 bits, ceil(log2 256) = 8).
#[test]
fn delta_width_is_the_bit_length() {
    assert_eq!(bit_len(256), 9);
    assert_eq!(bit_len(255), 8);
    assert_eq!(bit_len(1), 1);
    assert_eq!(bit_len(0), 0);
    assert_eq!(&widths(9, 2)[..4], &[3, 5, 7, 9]);
    assert_eq!(&widths(8, 1)[..2], &[4, 8]);
    assert_eq!(&widths(1, 2)[..4], &[1, 1, 1, 1]);
    assert_eq!(&widths(64, 4)[..16].last(), &Some(&64));
}

/// Fig. 2: b = 2, R = 6.1 → L = ceil(log2 6.1) = 3.
#[test]
fn fig2_logarithm_quantization() {
    let p = inv_powers(2.0);
    assert_eq!(level(6.1, 1.0, &p, 128, 2f64.ln()), 3);
    // Exact powers: R = 8 → 3, R = 1 → 0.
    assert_eq!(level(8.0, 1.0, &p, 128, 2f64.ln()), 3);
    assert_eq!(level(1.0, 1.0, &p, 128, 2f64.ln()), 0);
    assert_eq!(level(8.0000001, 1.0, &p, 128, 2f64.ln()), 4);
}

/// A hand-worked message: x = [4, -2, 1, 1], b = 2, τ = 2, l = 2.
/// sum = 8, R = 2, 4, 8, 8 → L = 1, 2, 3, 3; L = 3 > τ is dropped.
#[test]
fn exact_small_message() {
    let mut c = FastSgd::new(2.0, 2, 2)
        .expect("params")
        .with_paper_threshold(true);
    let x = [4.0, -2.0, 1.0, 1.0];
    let m = enc(&mut c, &x);
    let mut want = Vec::new();
    write_header(&mut want, CodecId::FastSgd, 4);
    want.extend_from_slice(&8f64.to_le_bytes());
    want.extend_from_slice(&2f64.to_le_bytes());
    want.extend_from_slice(&[2, 2, 1]); // τ, l, M = bit_len(1)
    want.extend_from_slice(&2u64.to_le_bytes());
    want.extend_from_slice(&[0x00, 0x81]); // L=1 (+), L=2 (−)
                                           // keys 0, 1 → deltas 0, 1; widths 1,1,1,1 → "00 0" "00 1" → 0b0000_0100
    want.push(0b0000_0100);
    assert_eq!(m, want);
    assert_eq!(dec(&c, &m, 4).expect("decode"), vec![4.0, -2.0, 0.0, 0.0]);
    // The default drops nonzeros here, so it uses the reference sum of
    // the set near the maximum: relative to max = 4 the levels are
    // 0, 1, 2, 2; {4} (sum 4) and {4, −2} (sum 6: 6/4 ≤ 4/2) pass their
    // own threshold, {4, −2, 1, 1} (8/4 > 4/4) does not: S = 6, the same
    // two keys, levels ceil(log2 1.5) = 1 and ceil(log2 3) = 2.
    let mut d = FastSgd::new(2.0, 2, 2).expect("params");
    let md = enc(&mut d, &x);
    assert_eq!(md[HEADER_LEN..HEADER_LEN + 8], 6f64.to_le_bytes());
    assert_eq!(md[HEADER_LEN + 8..], m[HEADER_LEN + 8..]);
    assert_eq!(dec(&d, &md, 4).expect("decode"), vec![3.0, -1.5, 0.0, 0.0]);
    // With τ = 3 everything is kept and exact (powers of two), and both
    // rules are the paper's.
    for paper in [true, false] {
        let mut c = FastSgd::new(2.0, 3, 2)
            .expect("params")
            .with_paper_threshold(paper);
        let m = enc(&mut c, &x);
        assert_eq!(dec(&c, &m, 4).expect("decode"), x.to_vec());
    }
}

/// On a dense tensor whose Σ|x| exceeds b^τ·max|x| the paper's
/// filter keeps nothing; the default keeps the maximum and a set near it.
#[test]
fn dense_tensor_beyond_b_tau_still_sends() {
    // b = 2, τ = 3: 100 equal ones have Σ = 100 > 8·max.
    let x = vec![1.0f32; 100];
    let mut paper = FastSgd::new(2.0, 3, 2)
        .expect("params")
        .with_paper_threshold(true);
    let m = enc(&mut paper, &x);
    assert_eq!(m[HEADER_LEN + 19..HEADER_LEN + 27], 0u64.to_le_bytes());
    // No level j qualifies (100 elements at level 0 > b^τ): S = max·b^τ
    // = 8 keeps every element at level τ = 3, decoded 8/8 = 1.
    let mut c = FastSgd::new(2.0, 3, 2).expect("params");
    let m = enc(&mut c, &x);
    assert_eq!(m[HEADER_LEN..HEADER_LEN + 8], 8f64.to_le_bytes());
    assert_eq!(dec(&c, &m, 100).expect("decode"), x);
    // A ramp: the maximum is always kept.
    let x: Vec<f32> = (1..=5000).map(|i| i as f32 * 1e-3).collect();
    let m = enc(&mut paper, &x);
    assert_eq!(m[HEADER_LEN + 19..HEADER_LEN + 27], 0u64.to_le_bytes());
    let m = enc(&mut c, &x);
    let y = dec(&c, &m, x.len()).expect("decode");
    assert!(y[4999] > 0.0);
    let sent = y.iter().filter(|v| **v != 0.0).count();
    assert!(sent >= 1, "{sent}");
}

/// L = 0 (one element holds all the mass) is folded into L = 1.
#[test]
fn level_zero_folds_into_one() {
    let mut c = FastSgd::new(2.0, 128, 2).expect("params");
    let m = enc(&mut c, &[0.0, 0.0, -5.0, 0.0]);
    assert_eq!(m[HEADER_LEN + 19..HEADER_LEN + 27], 1u64.to_le_bytes());
    assert_eq!(m[HEADER_LEN + 27], 0x80);
    assert_eq!(dec(&c, &m, 4).expect("decode"), vec![0.0, 0.0, -2.5, 0.0]);
    // τ = 0 keeps exactly such an element.
    let mut c = FastSgd::new(2.0, 0, 2).expect("params");
    let m = enc(&mut c, &[0.0, 3.0]);
    assert_eq!(dec(&c, &m, 2).expect("decode"), vec![0.0, 1.5]);
    let m = enc(&mut c, &[1.0, 3.0]);
    assert_eq!(dec(&c, &m, 2).expect("decode"), vec![0.0, 1.5]);
    // The paper's threshold (Σ = 4 > 3) keeps nothing.
    let mut c = c.with_paper_threshold(true);
    let m = enc(&mut c, &[1.0, 3.0]);
    assert_eq!(dec(&c, &m, 2).expect("decode"), vec![0.0, 0.0]);
}

#[test]
fn zero_and_empty_tensors_send_nothing() {
    let mut c = FastSgd::new(1.1, 128, 2).expect("params");
    for n in [0usize, 1, 1000] {
        let m = enc(&mut c, &vec![0.0; n]);
        assert_eq!(m.len(), HEADER_LEN + 27);
        assert_eq!(read_header(&m).expect("header"), (CodecId::FastSgd, n));
        assert_eq!(m[HEADER_LEN..HEADER_LEN + 8], 0f64.to_le_bytes());
        assert_eq!(dec(&c, &m, n).expect("decode"), vec![0.0; n]);
    }
}

#[test]
fn rejects_non_finite_input_and_bad_params() {
    let mut c = FastSgd::new(1.1, 128, 2).expect("params");
    let mut m = Vec::new();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(
            c.encode(&[1.0, bad], &mut m),
            Err(Error::InvalidArgument(_))
        ));
    }
    for s in [
        "fastsgd:b=1",
        "fastsgd:b=0.5",
        "fastsgd:b=-2",
        "fastsgd:l=0",
        "fastsgd:l=5",
        "fastsgd:tau=129",
    ] {
        let cfg: CodecConfig = s.parse().expect("parses");
        assert!(matches!(cfg.build(), Err(Error::InvalidArgument(_))), "{s}");
    }
    assert!(FastSgd::new(f64::NAN, 128, 2).is_err());
    assert!(FastSgd::new(f64::INFINITY, 128, 2).is_err());
}

#[test]
fn config_defaults_and_round_trip() {
    let cfg: CodecConfig = "fastsgd".parse().expect("parses");
    assert_eq!(
        cfg,
        CodecConfig::Fastsgd {
            b: 1.1,
            tau: 128,
            l: 2,
            paper: false
        }
    );
    assert_eq!(cfg.name(), "fastsgd");
    let cfg: CodecConfig = "fastsgd:b=1.05,tau=64,l=3".parse().expect("parses");
    let c = cfg.build().expect("builds");
    assert_eq!(c.config(), cfg);
    assert_eq!(c.id(), CodecId::FastSgd);
    let json = serde_json::to_string(&cfg).expect("json");
    assert_eq!(
        serde_json::from_str::<CodecConfig>(&json).expect("json"),
        cfg
    );
}

/// Hand-made corruptions of a valid message are all rejected.
#[test]
fn decoder_rejects_inconsistent_messages() {
    let mut c = FastSgd::new(2.0, 2, 2).expect("params");
    let good = enc(&mut c, &[4.0, -2.0, 1.0, 1.0]);
    assert!(dec(&c, &good, 4).is_ok());
    let p = HEADER_LEN;
    let mutate = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut m = good.clone();
        f(&mut m);
        dec(&c, &m, 4)
    };
    type Mutation<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;
    let cases: Vec<(&str, Mutation<'_>)> = vec![
        ("negative sum", Box::new(|m| m[p + 7] |= 0x80)),
        (
            "nan sum",
            Box::new(|m| m[p..p + 8].copy_from_slice(&f64::NAN.to_le_bytes())),
        ),
        (
            "b = 1",
            Box::new(|m| m[p + 8..p + 16].copy_from_slice(&1f64.to_le_bytes())),
        ),
        ("tau > 128", Box::new(|m| m[p + 16] = 129)),
        ("l = 0", Box::new(|m| m[p + 17] = 0)),
        ("l = 5", Box::new(|m| m[p + 17] = 5)),
        ("M too large", Box::new(|m| m[p + 18] = 2)),
        ("M = 65", Box::new(|m| m[p + 18] = 65)),
        ("d > n", Box::new(|m| m[p + 19] = 5)),
        ("level > tau", Box::new(|m| m[p + 27] = 2)),
        ("trailing byte", Box::new(|m| m.push(0))),
        (
            "nonzero padding",
            Box::new(|m| *m.last_mut().expect("byte") |= 1),
        ),
        // deltas 0, 0: not strictly increasing
        (
            "repeated key",
            Box::new(|m| *m.last_mut().expect("byte") = 0),
        ),
        // deltas 0, 1 with flag 01 for delta 1: not the smallest flag
        (
            "non-canonical flag",
            Box::new(|m| *m.last_mut().expect("byte") = 0b0000_1100),
        ),
        (
            "truncated",
            Box::new(|m| {
                m.pop();
            }),
        ),
    ];
    for (what, f) in cases {
        assert!(matches!(mutate(&*f), Err(Error::Decode(_))), "{what}");
    }
    // Keys ≥ n.
    let mut big = FastSgd::new(2.0, 2, 2).expect("params");
    let m = enc(&mut big, &[0.0, 0.0, 0.0, 0.0, 4.0, -2.0]);
    assert!(dec(&c, &m, 4).is_err());
    let mut m2 = m.clone();
    m2[4..12].copy_from_slice(&5u64.to_le_bytes());
    assert!(matches!(dec(&c, &m2, 5), Err(Error::Decode(_))));
    assert!(dec(&c, &m, 6).is_ok());
}

/// Sparse vectors: an independent oracle of `(index, value)` pairs.
fn sparse() -> impl Strategy<Value = (usize, Vec<(usize, f32)>)> {
    (1usize..200_000).prop_flat_map(|n| {
        (
            Just(n),
            proptest::collection::vec((0..n, 0.5f32..2.0, any::<bool>()), 0..200).prop_map(|v| {
                v.into_iter()
                    .map(|(i, a, neg)| (i, if neg { -a } else { a }))
                    .collect()
            }),
        )
    })
}

/// The decoded `y` of `x` is FastSGD's with reference sum `sum`.
fn value_bound_holds(
    x: &[f32],
    y: &[f32],
    b: f64,
    tau: u32,
    sum: f64,
) -> std::result::Result<(), String> {
    for i in 0..x.len() {
        let (xi, yi) = (x[i], y[i]);
        if xi == 0.0 {
            if yi != 0.0 {
                return Err(format!("i={i}: zero decoded as {yi}"));
            }
            continue;
        }
        let lhat = (sum / xi.abs() as f64).ln() / b.ln();
        if yi == 0.0 {
            // Dropped: L = ceil(lhat) > τ.
            if lhat <= tau as f64 - 1e-9 {
                return Err(format!("i={i}: {xi} dropped with log_b R = {lhat}"));
            }
            continue;
        }
        if lhat > tau as f64 + 1e-9 {
            return Err(format!("i={i}: {xi} kept with log_b R = {lhat}"));
        }
        let ratio = yi as f64 / xi as f64;
        if !(ratio <= 1.0 && ratio >= (1.0 / b) * (1.0 - 2e-7)) {
            return Err(format!("i={i}: {xi} decoded as {yi}, ratio {ratio}"));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// All nonzeros of these inputs have R ≤ 200·2/0.5 = 800 < 1.1^128, so
    /// L ≤ 128 and every key must come back exactly, with its sign, within the quantization bound.
    #[test]
    fn prop_sparse_keys_recovered_exactly((n, pairs) in sparse(), b in 1.1f64..2.0, l in 1u32..=4) {
        let mut x = vec![0f32; n];
        for &(i, v) in &pairs {
            x[i] = v;
        }
        let mut c = FastSgd::new(b, 128, l).expect("params");
        let m = enc(&mut c, &x);
        let y = dec(&c, &m, n).expect("decode");
        let got: Vec<usize> = (0..n).filter(|&i| y[i] != 0.0).collect();
        let want: Vec<usize> = (0..n).filter(|&i| x[i] != 0.0).collect();
        prop_assert_eq!(got, want);
        let sum: f64 = x.iter().map(|v| v.abs() as f64).sum();
        prop_assert_eq!(value_bound_holds(&x, &y, b, 128, sum), Ok(()));
        // decode_add adds the same values.
        let mut acc = vec![1f32; n];
        c.decode_add(&m, &mut acc).expect("decode_add");
        for i in 0..n {
            prop_assert!((acc[i] - 1.0 - y[i]).abs() <= 1e-6 * (1.0 + y[i].abs()));
        }
    }

    /// Wide dynamic range: some elements are dropped (L > τ), the kept ones
    /// satisfy |x|/b ≤ |decoded| ≤ |x|.
    #[test]
    fn prop_threshold_filter_and_value_bound(
        x in proptest::collection::vec(prop_oneof![
            Just(0f32),
            (-8f32..3.0, any::<bool>()).prop_map(|(e, neg)| {
                let v = 10f32.powf(e);
                if neg { -v } else { v }
            }),
        ], 0..3000),
        b in 1.02f64..2.0,
        tau in 0u32..=128,
        l in 1u32..=4,
    ) {
        let sum: f64 = x.iter().map(|v| v.abs() as f64).sum();
        let mut c = FastSgd::new(b, tau, l).expect("params").with_paper_threshold(true);
        let m = enc(&mut c, &x);
        let y = dec(&c, &m, x.len()).expect("decode");
        prop_assert_eq!(value_bound_holds(&x, &y, b, tau, sum), Ok(()));
        // The default: the same bound against its reference sum S ≤ Σ,
        // a superset of the paper's keys, the maximum always kept.
        let mut c = FastSgd::new(b, tau, l).expect("params");
        let m = enc(&mut c, &x);
        let s = f64::from_le_bytes(m[HEADER_LEN..HEADER_LEN + 8].try_into().expect("8"));
        // The encoder sums in eight lanes (another order): equal up to
        // rounding where S is the whole sum.
        prop_assert!(s <= sum * (1.0 + 1e-12));
        let yd = dec(&c, &m, x.len()).expect("decode");
        prop_assert_eq!(value_bound_holds(&x, &yd, b, tau, s), Ok(()));
        for i in 0..x.len() {
            prop_assert!(y[i] == 0.0 || yd[i] != 0.0, "paper keeps {} but not the default", i);
        }
        if let Some(im) = (0..x.len()).max_by(|&i, &j| x[i].abs().total_cmp(&x[j].abs())) {
            prop_assert!(x[im] == 0.0 || yd[im] != 0.0, "maximum dropped");
        }
    }

    /// Bit-level round trip of the adaptive binary encoding, up to 64-bit
    /// deltas and every flag size.
    #[test]
    fn prop_adaptive_binary_round_trip(raw in proptest::collection::vec(any::<u64>(), 1..100),
                                       shift in 0u32..64, l in 1u32..=4) {
        let deltas: Vec<u64> = raw.iter().map(|&v| v >> shift).collect();
        let m = bit_len(deltas.iter().copied().max().unwrap_or(0));
        let w = widths(m, l);
        prop_assert_eq!(w[(1usize << l) - 1], m);
        let mut out = Vec::new();
        let mut bw = BitWriter::new(&mut out);
        let mut nbits = 0usize;
        for &dl in &deltas {
            write_delta(&mut bw, dl, l, &w);
            let f = w.iter().position(|&wf| bit_len(dl) <= wf).unwrap_or(0);
            nbits += (l + w[f]) as usize;
        }
        bw.finish();
        prop_assert_eq!(out.len(), nbits.div_ceil(8));
        let mut br = BitReader::new(&out);
        for &dl in &deltas {
            prop_assert_eq!(read_delta(&mut br, l, &w).expect("read"), dl);
        }
        prop_assert!(br.finish().is_ok());
    }

    #[test]
    fn prop_hostile_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..200), n in 0usize..64) {
        let c = FastSgd::new(1.1, 128, 2).expect("params");
        let mut m = Vec::new();
        write_header(&mut m, CodecId::FastSgd, n);
        m.extend_from_slice(&tail);
        let mut out = vec![0f32; n];
        let _ = c.decode(&m, &mut out);
        let _ = c.decode_add(&m, &mut out);
        // Plausible parameters, random payload.
        let mut m = Vec::new();
        write_header(&mut m, CodecId::FastSgd, n);
        m.extend_from_slice(&3.0f64.to_le_bytes());
        m.extend_from_slice(&1.1f64.to_le_bytes());
        m.extend_from_slice(&[128, 1 + (n % 4) as u8, (n % 8) as u8]);
        m.extend_from_slice(&((tail.len() / 3) as u64).to_le_bytes());
        m.extend_from_slice(&tail);
        let _ = c.decode(&m, &mut out);
        let _ = c.decode_add(&m, &mut out);
    }

    #[test]
    fn prop_mutated_and_truncated_messages(
        x in proptest::collection::vec(prop_oneof![Just(0f32), -10f32..10.0], 0..300),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
        l in 1u32..=4,
    ) {
        let mut c = FastSgd::new(1.1, 128, l).expect("params");
        let good = enc(&mut c, &x);
        let cut = cut % good.len();
        prop_assert!(dec(&c, &good[..cut], x.len()).is_err());
        let mut m = good.clone();
        for &(pos, b) in &flips {
            let len = m.len();
            m[pos % len] ^= b;
        }
        let mut out = vec![0f32; x.len()];
        let _ = c.decode(&m, &mut out);
        let _ = c.decode_add(&m, &mut out);
    }
}
