use super::ring::{gradiveq_ring_allreduce, qsgd_ring_allreduce, segments, RingWorkspace};
use super::*;
use crate::comm::{LocalComm, Transport};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Samples `μ0 + B·c (+ noise)` in a `d0`-dimensional affine subspace of
/// R^k, `reps` slices side by side (the same subspace for every slice).
struct LowRank {
    k: usize,
    d0: usize,
    basis: Vec<f32>,
    mu0: Vec<f32>,
}

impl LowRank {
    fn new(k: usize, d0: usize, seed: u64) -> Self {
        let mut r = SmallRng::seed_from_u64(seed);
        LowRank {
            k,
            d0,
            basis: (0..k * d0).map(|_| r.gen_range(-1.0f32..1.0)).collect(),
            mu0: (0..k).map(|_| r.gen_range(-0.1f32..0.1)).collect(),
        }
    }
    fn sample(&self, slices: usize, noise: f32, seed: u64) -> Vec<f32> {
        let mut r = SmallRng::seed_from_u64(seed);
        let mut v = Vec::with_capacity(slices * self.k);
        for _ in 0..slices {
            let c: Vec<f32> = (0..self.d0).map(|_| r.gen_range(-1.0f32..1.0)).collect();
            for i in 0..self.k {
                let x: f32 = (0..self.d0)
                    .map(|j| self.basis[i * self.d0 + j] * c[j])
                    .sum();
                v.push(self.mu0[i] + x + noise * r.gen_range(-1.0f32..1.0));
            }
        }
        v
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn flattening_puts_collocated_filter_gradients_together() {
    // (F, D, H, W) = (2, 3, 2, 2): element value encodes its indices.
    let (f, d, h, w) = (2, 3, 2, 2);
    let g: Vec<f32> = (0..f * d * h * w).map(|i| i as f32).collect();
    let mut out = Vec::new();
    flatten_conv_from_fdhw(&g, [f, d, h, w], &mut out).expect("flatten");
    // Position 0: h=0, w=0, depth 0, filters 0 and 1.
    assert_eq!(&out[..2], &[g[0], g[d * h * w]]);
    // Next: depth 1 at the same (h, w) (depth first, then width, then height).
    assert_eq!(&out[2..4], &[g[h * w], g[d * h * w + h * w]]);
    // After all depths: width 1.
    assert_eq!(out[f * d], g[1]);
    // After a whole row of widths: height 1.
    assert_eq!(out[f * d * w], g[w]);
    assert!(flatten_conv_from_fdhw(&g[1..], [f, d, h, w], &mut out).is_err());
    assert_eq!(default_slice_size(3, 16, 16), 768);
}

#[test]
fn exact_subspace_gives_ratio_k_over_d_and_no_error() {
    let (k, d0) = (64, 8);
    let lr = LowRank::new(k, d0, 1);
    let samples: Vec<Vec<f32>> = (0..40).map(|t| lr.sample(1, 0.0, 100 + t)).collect();
    let refs: Vec<&[f32]> = samples.iter().map(|s| &s[..]).collect();
    let c = Compressor::fit(&refs, Dim::Lambda(0.01)).expect("fit");
    assert_eq!(c.d(), d0, "eigenvalues {:?}", &c.eigenvalues()[..12]);
    assert!(c.retained_energy() > 0.999_999);
    // New data in the same subspace round-trips.
    let x = lr.sample(1, 0.0, 7);
    let mut z = vec![0f32; d0];
    let mut y = vec![0f32; k];
    c.compress(&x, 1, &mut z);
    c.decompress(&z, &mut y);
    assert!(rel_l2(&y, &x) < 1e-4, "{}", rel_l2(&y, &x));
    // A layer of 10 slices plus a 5-element tail, one compressor (s = ∞).
    let samples: Vec<Vec<f32>> = (0..40)
        .map(|t| {
            let mut v = lr.sample(10, 0.0, 200 + t);
            v.extend_from_slice(&[0.5; 5]);
            v
        })
        .collect();
    let refs: Vec<&[f32]> = samples.iter().map(|s| &s[..]).collect();
    let lc = LayerCompressor::fit(&refs, k, None, Dim::Lambda(0.01)).expect("fit");
    assert_eq!(lc.groups().len(), 1);
    assert_eq!(lc.compressed_len(0, 10, true), 10 * d0 + 5);
    assert!((lc.ratio() - 645.0 / 85.0).abs() < 1e-12);
    let mut x = lr.sample(10, 0.0, 9);
    x.extend_from_slice(&[0.25; 5]);
    let mut y = vec![0f32; x.len()];
    lc.round_trip(&x, &mut y);
    assert!(rel_l2(&y, &x) < 1e-4);
    // Fixed d, and the reuse factor: groups of 3 slices.
    let lc = LayerCompressor::fit(&refs, k, Some(3), Dim::Fixed(4)).expect("fit");
    assert_eq!(lc.groups().len(), 4);
    assert_eq!(lc.groups()[0].d(), 4);
}

#[test]
fn compression_commutes_with_summation() {
    let (k, n_ranks) = (48, 5);
    let lr = LowRank::new(k, 6, 3);
    let samples: Vec<Vec<f32>> = (0..30).map(|t| lr.sample(1, 0.05, t)).collect();
    let refs: Vec<&[f32]> = samples.iter().map(|s| &s[..]).collect();
    let c = Compressor::fit(&refs, Dim::Lambda(0.05)).expect("fit");
    let grads: Vec<Vec<f32>> = (0..n_ranks).map(|r| lr.sample(1, 0.05, 1000 + r)).collect();
    let mut sum_of_q = vec![0f32; c.d()];
    let mut q = vec![0f32; c.d()];
    for g in &grads {
        c.compress(g, n_ranks as usize, &mut q);
        for (s, v) in sum_of_q.iter_mut().zip(&q) {
            *s += v;
        }
    }
    let total: Vec<f32> = (0..k).map(|i| grads.iter().map(|g| g[i]).sum()).collect();
    let mut q_of_sum = vec![0f32; c.d()];
    c.compress(&total, 1, &mut q_of_sum);
    for (a, b) in sum_of_q.iter().zip(&q_of_sum) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

#[test]
fn fitting_is_deterministic_and_rejects_bad_samples() {
    let lr = LowRank::new(32, 4, 5);
    let samples: Vec<Vec<f32>> = (0..20).map(|t| lr.sample(1, 0.01, t)).collect();
    let refs: Vec<&[f32]> = samples.iter().map(|s| &s[..]).collect();
    let a = Compressor::fit(&refs, Dim::Lambda(0.01)).expect("fit");
    let b = Compressor::fit(&refs, Dim::Lambda(0.01)).expect("fit");
    assert_eq!(a.hash(), b.hash());
    assert_eq!(a, b);
    assert!(Compressor::fit(&refs[..1], Dim::Lambda(0.01)).is_err());
    let mut bad = samples[0].clone();
    bad[3] = f32::NAN;
    let mut refs2 = refs.clone();
    refs2[0] = &bad;
    assert!(Compressor::fit(&refs2, Dim::Lambda(0.01)).is_err());
    assert!(Compressor::fit(&refs, Dim::Lambda(1.0)).is_err());
    let short = vec![0f32; 31];
    let mut refs3 = refs.clone();
    refs3[1] = &short;
    assert!(Compressor::fit(&refs3, Dim::Lambda(0.01)).is_err());
    assert_eq!(select_d(&[4.0, 3.0, 2.0, 1.0], 0.35), 2);
    assert_eq!(select_d(&[0.0, 0.0], 0.1), 1);
}

#[test]
fn segments_cover_the_slices() {
    for (slices, p) in [(10, 3), (2, 5), (0, 1), (7, 7)] {
        let s = segments(slices, p);
        assert_eq!(s.len(), p);
        assert_eq!(s[0].0, 0);
        assert_eq!(s[p - 1].1, slices);
        assert!(s.windows(2).all(|w| w[0].1 == w[1].0));
    }
}

/// Algorithm 1 equals the centralized `U(Uᵀ(Σg − μ)) + μ` on every rank,
/// bit-identically across ranks, for p = 1..5 (also fewer slices than
/// ranks, and a tail).
#[test]
fn ring_equals_the_centralized_round_trip() {
    let k = 32;
    let lr = LowRank::new(k, 4, 11);
    for (slices, tail) in [(9usize, 3usize), (2, 0), (5, 7)] {
        let n = slices * k + tail;
        let samples: Vec<Vec<f32>> = (0..24)
            .map(|t| {
                let mut v = lr.sample(slices, 0.01, 500 + t);
                v.extend((0..tail).map(|i| i as f32 * 0.1));
                v
            })
            .collect();
        let refs: Vec<&[f32]> = samples.iter().map(|s| &s[..]).collect();
        let lc = LayerCompressor::fit(&refs, k, None, Dim::Lambda(0.01)).expect("fit");
        for p in 1..=5usize {
            let grads: Vec<Vec<f32>> = (0..p)
                .map(|r| {
                    let mut v = lr.sample(slices, 0.01, 9000 + r as u64);
                    v.extend((0..tail).map(|i| (i + r) as f32));
                    v
                })
                .collect();
            let out = LocalComm::run(p, |c| {
                let mut o = vec![0f32; n];
                let mut ws = RingWorkspace::default();
                gradiveq_ring_allreduce(&c, &lc, &grads[c.rank()], &mut o, &mut ws).expect("ring");
                o
            });
            let total: Vec<f32> = (0..n).map(|i| grads.iter().map(|g| g[i]).sum()).collect();
            let mut want = vec![0f32; n];
            lc.round_trip(&total, &mut want);
            for o in &out {
                assert_eq!(o, &out[0], "identical on every rank (p={p})");
            }
            let err = rel_l2(&out[0], &want);
            assert!(err < 1e-4, "p={p} slices={slices}: {err}");
        }
    }
}

#[test]
fn qsgd_ring_is_identical_on_all_ranks_and_sharper_with_more_bits() {
    for p in 1..=4usize {
        let n = 1000;
        let grads: Vec<Vec<f32>> = (0..p)
            .map(|r| {
                let mut rng = SmallRng::seed_from_u64(r as u64);
                (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
            })
            .collect();
        let total: Vec<f32> = (0..n).map(|i| grads.iter().map(|g| g[i]).sum()).collect();
        let mut errs = Vec::new();
        for bits in [4u32, 8] {
            let out = LocalComm::run(p, |c| {
                let mut o = vec![0f32; n];
                qsgd_ring_allreduce(
                    &c,
                    &grads[c.rank()],
                    &mut o,
                    bits,
                    0,
                    7,
                    &mut RingWorkspace::default(),
                )
                .expect("ring");
                o
            });
            for o in &out {
                assert_eq!(o, &out[0], "identical on every rank");
                assert!(o.iter().all(|x| x.is_finite()));
            }
            errs.push(rel_l2(&out[0], &total));
        }
        // One norm per segment and a re-encoding per hop: 4 bits is noisy
        // (QSGD without buckets), 8 bits much less so.
        assert!(errs[1] < errs[0] && errs[1] < 0.5, "p={p}: {errs:?}");
    }
}

/// The schedule: warm-up, L_t QSGD-aggregated samples, compressed steps
/// with small eq.-7 loss, then the data's subspace changes: every rank's
/// loss jumps, the majority vote rebuilds the compressor from new samples,
/// and the loss is small again. Compressors are identical on every rank.
#[test]
fn loss_monitor_rebuilds_when_the_subspace_changes() {
    use super::schedule::{GradiveqLayer, ScheduleConfig, StepKind};
    let (k, slices, p) = (32usize, 6usize, 3usize);
    let n = k * slices;
    let (a, b) = (LowRank::new(k, 4, 21), LowRank::new(k, 4, 22));
    let cfg = ScheduleConfig {
        k,
        dim: Dim::Fixed(4),
        reuse: None,
        warmup: 2,
        lt: 12,
        lc: 1000,
        loss_threshold: 0.05,
        qsgd_bits: 8,
        qsgd_bucket: 0,
    };
    let res = LocalComm::run(p, |c| {
        let r = c.rank();
        let mut layer = GradiveqLayer::new(n, cfg.clone()).expect("layer");
        let mut kinds = Vec::new();
        let mut hashes = Vec::new();
        for step in 0..60u64 {
            let src = if step < 30 { &a } else { &b };
            let g = src.sample(slices, 0.001, step * 10 + r as u64);
            let mut out = vec![0f32; n];
            let kind = layer.step(&c, &g, &mut out).expect("step");
            kinds.push(kind);
            hashes.push(layer.compressor_hash());
        }
        (kinds, hashes, layer.rebuilds())
    });
    for (kinds, hashes, rebuilds) in &res {
        assert_eq!(kinds[0], StepKind::Warmup);
        assert_eq!(kinds[2], StepKind::Collect(0));
        assert_eq!(kinds[13], StepKind::Collect(11));
        // Compressed on subspace A: small loss, no votes.
        for kd in &kinds[14..30] {
            match kd {
                StepKind::Compressed { loss, votes } => {
                    assert!(*loss < 0.05 && *votes == 0, "{kd:?}");
                }
                other => panic!("expected compressed, got {other:?}"),
            }
        }
        // The switch: all three ranks vote, the layer collects again.
        match kinds[30] {
            StepKind::Compressed { loss, votes } => {
                assert!(loss > 0.05 && votes == 3, "{:?}", kinds[30])
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(kinds[31], StepKind::Collect(0));
        assert_eq!(kinds[42], StepKind::Collect(11));
        match kinds[50] {
            StepKind::Compressed { loss, .. } => assert!(loss < 0.05, "{:?}", kinds[50]),
            other => panic!("{other:?}"),
        }
        assert_eq!(*rebuilds, 2);
        assert_ne!(hashes[20], hashes[50]);
    }
    // Bit-identical compressors on every rank at every step.
    for r in 1..p {
        assert_eq!(res[r].1, res[0].1);
    }
}

/// Fuzz findings (fuzz target `snapshot`): restored GradiVeQ state with a
/// NaN sample was accepted and the next step's PCA fit failed inside the
/// step, aborting the job; a NaN compressor was accepted alike; a step
/// counter at `u64::MAX` overflowed in the next step. `validate` now
/// refuses non-finite samples and compressors, and the counters saturate.
#[test]
fn fuzz_hostile_gradiveq_state_is_refused_or_steps() {
    use super::schedule::{GradiveqLayer, ScheduleConfig};
    let cfg = ScheduleConfig {
        k: 16,
        dim: Dim::Fixed(2),
        reuse: None,
        warmup: 0,
        lt: 4,
        lc: 1000,
        loss_threshold: 0.5,
        qsgd_bits: 8,
        qsgd_bucket: 0,
    };
    let n = 64;
    let patch = |bytes: &mut [u8], from: &[u8], to: &[u8]| {
        let at = bytes
            .windows(from.len())
            .position(|w| w == from)
            .expect("value in the serialized state");
        bytes[at..at + to.len()].copy_from_slice(to);
    };
    let c = LocalComm::create(1).pop().expect("rank");
    let mut layer = GradiveqLayer::new(n, cfg.clone()).expect("layer");
    let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0f32; n];
    layer.step(&c, &g, &mut out).expect("collect");
    let good = bincode::serialize(&layer).expect("serialize");
    let back: GradiveqLayer = bincode::deserialize(&good).expect("deserialize");
    back.validate(n, &cfg).expect("a good state validates");
    // A NaN in the collected sample (its first K values are out's).
    let mut bad = good.clone();
    let sample: Vec<u8> = out[..16].iter().flat_map(|v| v.to_le_bytes()).collect();
    patch(&mut bad, &sample, &f32::NAN.to_le_bytes());
    let bad: GradiveqLayer = bincode::deserialize(&bad).expect("still parses");
    assert!(bad.validate(n, &cfg).is_err(), "NaN sample accepted");
    // A NaN in a compressor's mean (every sample's first value is 0.75).
    let samples: Vec<Vec<f32>> = (0..4)
        .map(|s| {
            (0..16)
                .map(|i| {
                    if i == 0 {
                        0.75
                    } else {
                        ((s * 16 + i) as f32).cos()
                    }
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = samples.iter().map(|s| &s[..]).collect();
    let comp = Compressor::fit(&refs, Dim::Fixed(2)).expect("fit");
    comp.validate().expect("a fitted compressor validates");
    let mut bytes = bincode::serialize(&comp).expect("serialize");
    patch(
        &mut bytes,
        &0.75f32.to_le_bytes(),
        &f32::INFINITY.to_le_bytes(),
    );
    let bad: Compressor = bincode::deserialize(&bytes).expect("still parses");
    assert!(bad.validate().is_err(), "Inf compressor accepted");
    // A step counter at its maximum (right after the config and `n`).
    let at = bincode::serialize(&cfg).expect("cfg").len() + 8;
    let mut bytes = good.clone();
    bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut layer: GradiveqLayer = bincode::deserialize(&bytes).expect("parses");
    layer.validate(n, &cfg).expect("validates");
    layer
        .step(&c, &g, &mut out)
        .expect("steps at the counter's end");
}
