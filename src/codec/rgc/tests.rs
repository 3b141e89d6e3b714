#![allow(clippy::needless_range_loop)]

use super::*;
use crate::codec::{read_header, ErrorFeedback, HEADER_LEN};
use crate::select::ThresholdSearch;
use proptest::prelude::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.gen_range(-1.0f32..1.0) * rng.gen_range(0.0f32..1.0).powi(3))
        .collect()
}

const METHODS: [RgcMethod; 4] = [
    RgcMethod::Exact,
    RgcMethod::Trimmed,
    RgcMethod::Threshold,
    RgcMethod::Sampled,
];

/// Sent (index, value) pairs of an `rgc` message.
fn entries(msg: &[u8]) -> (Vec<u32>, Vec<f32>) {
    let p = &msg[HEADER_LEN..];
    let len = u32::from_le_bytes(p[0..4].try_into().expect("test")) as usize;
    assert_eq!(p.len(), 4 + 8 * len);
    let idx = (0..len)
        .map(|j| u32::from_le_bytes(p[4 + 4 * j..8 + 4 * j].try_into().expect("test")))
        .collect();
    let val = (0..len)
        .map(|j| {
            let o = 4 + 4 * len + 4 * j;
            f32::from_le_bytes(p[o..o + 4].try_into().expect("test"))
        })
        .collect();
    (idx, val)
}

#[test]
fn configs_parse_with_defaults_and_validate() {
    let c: CodecConfig = "rgc".parse().expect("test");
    assert_eq!(
        c,
        CodecConfig::Rgc {
            density: 0.001,
            method: RgcMethod::Trimmed
        }
    );
    assert_eq!(c.name(), "rgc");
    let c: CodecConfig = "rgc-quant".parse().expect("test");
    assert_eq!(c, CodecConfig::RgcQuant { density: 0.001 });
    assert_eq!(c.name(), "rgc-quant");
    for (s, m) in [
        ("exact", RgcMethod::Exact),
        ("trimmed", RgcMethod::Trimmed),
        ("threshold", RgcMethod::Threshold),
        ("sampled", RgcMethod::Sampled),
    ] {
        let c: CodecConfig = format!("rgc:density=0.01,method={s}")
            .parse()
            .expect("test");
        assert_eq!(
            c,
            CodecConfig::Rgc {
                density: 0.01,
                method: m
            }
        );
        let back: CodecConfig = format!("{}:{}", c.name(), c.params())
            .parse()
            .expect("test");
        assert_eq!(back, c);
        let json = serde_json::to_string(&c).expect("test");
        assert_eq!(serde_json::from_str::<CodecConfig>(&json).expect("test"), c);
        assert_eq!(c.build().expect("test").config(), c);
    }
    assert!("rgc:method=radix".parse::<CodecConfig>().is_err());
    assert!("rgc-quant:method=exact".parse::<CodecConfig>().is_err());
    assert!("rgc:k=3".parse::<CodecConfig>().is_err());
    for bad in ["0", "-0.1", "1.5", "NaN"] {
        for name in ["rgc", "rgc-quant"] {
            if let Ok(c) = format!("{name}:density={bad}").parse::<CodecConfig>() {
                assert!(c.build().is_err(), "{name} density {bad}");
            }
        }
    }
    let q: CodecConfig = "rgc-quant:density=1".parse().expect("test");
    assert_eq!(q.build().expect("test").config(), q);
}

#[test]
fn k_is_max_1_ceil_density_n() {
    assert_eq!(rgc_k(0.001, 1000), 1);
    assert_eq!(rgc_k(0.001, 1001), 2);
    assert_eq!(rgc_k(0.001, 5), 1);
    assert_eq!(rgc_k(0.001, 1_000_000), 1000);
    assert_eq!(rgc_k(0.25, 7), 2);
    assert_eq!(rgc_k(1.0, 10), 10);
    assert_eq!(rgc_k(0.5, 1), 1);
    assert_eq!(rgc_k(0.5, 0), 0);
}

#[test]
fn rgc_wire_format_pinned() {
    let mut c = Rgc::new(0.5, RgcMethod::Exact).expect("test");
    let mut msg = Vec::new();
    c.encode(&[0.0, -3.0, 1.0, 2.0], &mut msg).expect("test");
    let mut want = Vec::new();
    write_header(&mut want, CodecId::Rgc, 4);
    for w in [2u32, 1, 3] {
        want.extend_from_slice(&w.to_le_bytes());
    }
    for v in [-3.0f32, 2.0] {
        want.extend_from_slice(&v.to_le_bytes());
    }
    assert_eq!(msg, want);
    let mut out = vec![9.0; 4];
    c.decode(&msg, &mut out).expect("test");
    assert_eq!(out, [0.0, -3.0, 0.0, 2.0]);
}

#[test]
fn rgc_round_trip_is_exactly_the_selection() {
    let mut msg = Vec::new();
    for method in METHODS {
        for (n, density) in [
            (1, 0.001),
            (10, 0.3),
            (1000, 0.01),
            (20_000, 0.001),
            (5000, 1.0),
        ] {
            let mut c = Rgc::new(density, method).expect("test");
            let k = rgc_k(density, n);
            for step in 0..8u64 {
                let x = data(n, step * 31 + n as u64);
                c.encode(&x, &mut msg).expect("test");
                assert_eq!(read_header(&msg).expect("test"), (CodecId::Rgc, n));
                let (idx, val) = entries(&msg);
                assert!(idx.windows(2).all(|w| w[0] < w[1]));
                let mut out = vec![5.0; n];
                c.decode(&msg, &mut out).expect("test");
                let mut acc = vec![1.0; n];
                c.decode_add(&msg, &mut acc).expect("test");
                let mut sent = vec![false; n];
                for (&i, &v) in idx.iter().zip(&val) {
                    sent[i as usize] = true;
                    assert_eq!(v.to_bits(), x[i as usize].to_bits());
                }
                for i in 0..n {
                    let want = if sent[i] { x[i] } else { 0.0 };
                    assert_eq!(out[i], want, "{method:?} n {n} i {i}");
                    assert_eq!(acc[i], 1.0 + want);
                }
                // The set itself.
                let (mut ei, mut ev) = (Vec::new(), Vec::new());
                exact_topk(&x, k, &mut ei, &mut ev).expect("test");
                match method {
                    RgcMethod::Exact | RgcMethod::Trimmed => assert_eq!(idx, ei),
                    // Fresh search (every 6th call) or reuse.
                    RgcMethod::Threshold | RgcMethod::Sampled => {
                        if step % 6 == 0 {
                            assert!(idx.len() >= k, "{method:?} {} < {k}", idx.len());
                            let kth = ev.iter().map(|v| v.abs()).fold(f32::INFINITY, f32::min);
                            for (&i, &v) in ei.iter().zip(&ev) {
                                assert!(sent[i as usize] || v.abs() == kth);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn rgc_threshold_reuses_for_five_calls() {
    let n = 10_000;
    let mut c = Rgc::new(0.01, RgcMethod::Threshold).expect("test");
    let mut s = ThresholdSearch::new();
    let (mut idx, mut val, mut msg) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..12u64 {
        let x = data(n, 100 + step);
        c.encode(&x, &mut msg).expect("test");
        s.select(&x, 100, &mut idx, &mut val).expect("test");
        assert_eq!(entries(&msg), (idx.clone(), val.clone()), "step {step}");
    }
    assert_eq!(s.searches(), 2);
}

#[test]
fn rgc_quant_alternates_signs_and_sends_the_mean() {
    let x = [3.0f32, -1.0, 2.0, -5.0, 0.5, -4.0, 1.0];
    let mut c = RgcQuant::new(0.25).expect("test"); // k = ceil(1.75) = 2
    let mut msg = Vec::new();
    let expect = [
        (true, vec![0u32, 2], 2.5f32),
        (false, vec![3, 5], -4.5),
        (true, vec![0, 2], 2.5),
        (false, vec![3, 5], -4.5),
    ];
    for (pos, idx, mean) in expect {
        assert_eq!(c.next_is_positive(), pos);
        c.encode(&x, &mut msg).expect("test");
        let mut want = Vec::new();
        write_header(&mut want, CodecId::RgcQuant, 7);
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice(&mean.to_le_bytes());
        for i in &idx {
            want.extend_from_slice(&i.to_le_bytes());
        }
        assert_eq!(msg, want);
        let mut out = vec![9.0; 7];
        c.decode(&msg, &mut out).expect("test");
        for i in 0..7 {
            let w = if idx.contains(&(i as u32)) { mean } else { 0.0 };
            assert_eq!(out[i], w);
        }
    }
    // Fewer values of the turn's sign than k: send those; none: the other
    // sign's set (a residual of one sign is never left unsent).
    let mut c = RgcQuant::new(0.5).expect("test"); // k = 3 of 6
    let y = [-1.0f32, -2.0, 4.0, -3.0, 0.0, -0.5];
    c.encode(&y, &mut msg).expect("test");
    assert_eq!(msg.len(), HEADER_LEN + 8 + 4);
    let mut out = vec![0.0; 6];
    c.decode(&msg, &mut out).expect("test");
    assert_eq!(out, [0.0, 0.0, 4.0, 0.0, 0.0, 0.0]);
    c.encode(&y, &mut msg).expect("test");
    c.decode(&msg, &mut out).expect("test");
    // Bottom 3 of -1, -2, -3, -0.5: indices 0, 1, 3, mean -2.
    assert_eq!(out, [-2.0, -2.0, 0.0, -2.0, 0.0, 0.0]);
    let neg = [-1.0f32, -2.0];
    let mut c = RgcQuant::new(0.5).expect("test");
    for turn in 0..2 {
        // The positive turn has no positive value: the negative set goes.
        c.encode(&neg, &mut msg).expect("test");
        c.decode(&msg, &mut out[..2]).expect("test");
        assert_eq!(&out[..2], &[0.0, -2.0], "turn {turn}");
        assert_eq!(c.next_is_positive(), turn == 1);
    }
    // Nothing of either sign: len 0, mean 0.
    c.encode(&[0.0, 0.0], &mut msg).expect("test");
    assert_eq!(&msg[HEADER_LEN..], &[0u8; 8][..]);
    // Empty tensor.
    c.encode(&[], &mut msg).expect("test");
    c.decode(&msg, &mut []).expect("test");
}

#[test]
fn non_finite_inputs_are_rejected() {
    let mut msg = Vec::new();
    for cfg in ["rgc", "rgc:method=threshold", "rgc-quant"] {
        let mut c = cfg
            .parse::<CodecConfig>()
            .expect("test")
            .build()
            .expect("test");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let r = c.encode(&[1.0, bad, 2.0], &mut msg);
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{cfg}");
        }
        c.encode(&[], &mut msg).expect("test");
        c.decode(&msg, &mut []).expect("test");
    }
}

#[test]
fn decoders_reject_bad_payloads_without_writing() {
    let n = 8;
    let rgc = Rgc::new(0.5, RgcMethod::Exact).expect("test");
    let q = RgcQuant::new(0.5).expect("test");
    let rgc_msg = |len: u32, idx: &[u32], val: &[f32]| {
        let mut m = Vec::new();
        write_header(&mut m, CodecId::Rgc, n);
        m.extend_from_slice(&len.to_le_bytes());
        idx.iter()
            .for_each(|i| m.extend_from_slice(&i.to_le_bytes()));
        val.iter()
            .for_each(|v| m.extend_from_slice(&v.to_le_bytes()));
        m
    };
    let q_msg = |len: u32, mean: f32, idx: &[u32]| {
        let mut m = Vec::new();
        write_header(&mut m, CodecId::RgcQuant, n);
        m.extend_from_slice(&len.to_le_bytes());
        m.extend_from_slice(&mean.to_le_bytes());
        idx.iter()
            .for_each(|i| m.extend_from_slice(&i.to_le_bytes()));
        m
    };
    let init: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let bad_rgc = [
        rgc_msg(2, &[1, 8], &[1.0, 2.0]),        // index out of range (last)
        rgc_msg(2, &[u32::MAX, 0], &[1.0, 2.0]), // index out of range (first)
        rgc_msg(2, &[1, 2], &[1.0, f32::NAN]),   // non-finite value
        rgc_msg(2, &[1, 2], &[f32::INFINITY, 1.0]),
        rgc_msg(3, &[1, 2], &[1.0, 2.0]), // len disagrees with payload
        rgc_msg(9, &[0; 9], &[0.0; 9]),   // len > n
        rgc_msg(u32::MAX, &[], &[]),
        rgc_msg(1, &[1], &[1.0, 2.0]), // trailing bytes
    ];
    for m in &bad_rgc {
        let mut acc = init.clone();
        assert!(matches!(rgc.decode_add(m, &mut acc), Err(Error::Decode(_))));
        assert_eq!(acc, init, "acc untouched");
    }
    let bad_q = [
        q_msg(2, 1.0, &[3, 8]),
        q_msg(1, f32::NAN, &[3]),
        q_msg(1, f32::NEG_INFINITY, &[3]),
        q_msg(2, 1.0, &[3]),
        q_msg(9, 1.0, &[0; 9]),
        q_msg(u32::MAX, 1.0, &[]),
        q_msg(1, 1.0, &[3, 4]),
    ];
    for m in &bad_q {
        let mut acc = init.clone();
        assert!(matches!(q.decode_add(m, &mut acc), Err(Error::Decode(_))));
        assert_eq!(acc, init, "acc untouched");
    }
    // Cross-codec and wrong length.
    let good = rgc_msg(1, &[7], &[1.5]);
    assert!(q.decode_add(&good, &mut init.clone()).is_err());
    assert!(rgc.decode_add(&good, &mut [0.0; 7]).is_err());
    // Unordered and repeated indices: the encoders send them strictly
    // ascending, so either is a corrupt message (a repeat would add one
    // entry twice), named by its entry, the accumulator untouched.
    for (m, want) in [
        (
            rgc_msg(3, &[5, 2, 6], &[1.0, 2.0, 3.0]),
            "entry 1: index 2 after 5",
        ),
        (
            rgc_msg(3, &[1, 5, 5], &[1.0, 2.0, 3.0]),
            "entry 2: index 5 after 5",
        ),
    ] {
        let mut acc = init.clone();
        let e = rgc.decode_add(&m, &mut acc).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        assert_eq!(acc, init, "acc untouched");
    }
    let mut acc = init.clone();
    let e = q
        .decode_add(&q_msg(3, -1.5, &[0, 6, 6]), &mut acc)
        .unwrap_err()
        .to_string();
    assert!(e.contains("entry 2: index 6 after 6"), "{e}");
    assert_eq!(acc, init, "acc untouched");
}

#[test]
fn error_feedback_sends_everything_eventually() {
    let n = 500;
    for cfg in [
        "rgc:density=0.05",
        "rgc:density=0.05,method=threshold",
        "rgc-quant:density=0.05",
    ] {
        let mut c = cfg
            .parse::<CodecConfig>()
            .expect("test")
            .build()
            .expect("test");
        let mut ef = ErrorFeedback::new(n);
        let (mut msg, mut sent, mut total) = (Vec::new(), vec![0f32; n], vec![0f32; n]);
        for step in 0..300 {
            let g = data(n, 7000 + step);
            ef.step(c.as_mut(), &g, &mut msg).expect("test");
            c.decode_add(&msg, &mut sent).expect("test");
            for i in 0..n {
                total[i] += g[i];
            }
        }
        for i in 0..n {
            assert!(
                (total[i] - sent[i] - ef.residual()[i]).abs() < 1e-3,
                "{cfg}"
            );
        }
        let res = ef.residual().iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(res < 5.0, "{cfg}: residual grows to {res}");
    }
}

#[test]
fn encode_reuses_the_output_buffer() {
    let x = data(50_000, 3);
    for method in [RgcMethod::Exact, RgcMethod::Trimmed] {
        let mut c = Rgc::new(0.01, method).expect("test");
        let mut msg = Vec::new();
        c.encode(&x, &mut msg).expect("test");
        let p = msg.as_ptr();
        for _ in 0..5 {
            c.encode(&x, &mut msg).expect("test");
        }
        assert_eq!(msg.as_ptr(), p);
    }
}

fn codecs() -> Vec<Box<dyn Codec>> {
    ["rgc", "rgc:method=threshold", "rgc-quant"]
        .iter()
        .map(|s| {
            s.parse::<CodecConfig>()
                .expect("test")
                .build()
                .expect("test")
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn prop_rgc_round_trip(x in proptest::collection::vec(-1e3f32..1e3, 0..800),
                           density in 0.001f64..1.0, m in 0usize..4) {
        let method = METHODS[m];
        let mut c = Rgc::new(density, method).expect("test");
        let mut msg = Vec::new();
        c.encode(&x, &mut msg).expect("test");
        let (idx, val) = entries(&msg);
        let k = if x.is_empty() { 0 } else { rgc_k(density, x.len()) };
        prop_assert!(idx.len() >= k);
        if matches!(method, RgcMethod::Exact | RgcMethod::Trimmed) {
            prop_assert_eq!(idx.len(), k);
        }
        let mut out = vec![1.0; x.len()];
        c.decode(&msg, &mut out).expect("test");
        let mut want = vec![0.0; x.len()];
        for (&i, &v) in idx.iter().zip(&val) {
            want[i as usize] = v;
            prop_assert_eq!(v, x[i as usize]);
        }
        prop_assert_eq!(out, want);
    }

    #[test]
    fn prop_hostile_payloads_never_panic(n in 0usize..64, payload in proptest::collection::vec(any::<u8>(), 0..200)) {
        for c in codecs() {
            let mut m = Vec::new();
            write_header(&mut m, c.id(), n);
            m.extend_from_slice(&payload);
            let init: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let mut acc = init.clone();
            if c.decode_add(&m, &mut acc).is_err() {
                prop_assert_eq!(&acc, &init);
            }
            let _ = c.decode(&m, &mut acc);
        }
    }

    #[test]
    fn prop_mutated_messages_never_panic_or_half_write(
            x in proptest::collection::vec(-10f32..10.0, 1..300),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
            bad in any::<u32>(), which in any::<usize>(), cut in any::<usize>()) {
        let n = x.len();
        for mut c in codecs() {
            let mut msg = Vec::new();
            c.encode(&x, &mut msg).expect("test");
            let init: Vec<f32> = (0..n).map(|i| i as f32).collect();
            // An out-of-range index: Err, acc untouched.
            let len = u32::from_le_bytes(msg[HEADER_LEN..HEADER_LEN + 4].try_into().expect("test")) as usize;
            if len > 0 {
                let first = HEADER_LEN + 4 + if c.id() == CodecId::RgcQuant { 4 } else { 0 };
                let at = first + 4 * (which % len);
                let mut m = msg.clone();
                let big = (n as u32).saturating_add(bad % 1000);
                m[at..at + 4].copy_from_slice(&big.to_le_bytes());
                let mut acc = init.clone();
                prop_assert!(c.decode_add(&m, &mut acc).is_err());
                prop_assert_eq!(&acc, &init);
            }
            // Random flips: Ok or Err, and Err leaves acc untouched.
            let mut m = msg.clone();
            for &(pos, b) in &flips {
                let l = m.len();
                m[pos % l] ^= b;
            }
            let mut acc = init.clone();
            if c.decode_add(&m, &mut acc).is_err() {
                prop_assert_eq!(&acc, &init);
            }
            // Truncation always fails.
            let cut = cut % msg.len();
            prop_assert!(c.decode_add(&msg[..cut], &mut acc).is_err());
        }
    }
}
