//! The device step's policy and exchange on [`HostOps`], against the host
//! engine (in process; `tests/gpu.rs` runs the same under `mpirun`, and
//! on CUDA where there is a GPU).

use super::*;
use crate::codec::{CodecConfig, RgcMethod};
use crate::comm::LocalComm;
use crate::sync::{Config, GradSync, Strategy};

/// Deterministic gradients: integers in [-40, 40], or reals in [-1, 1).
pub(crate) fn grad(rank: usize, step: usize, n: usize, integer: bool) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut h = (i as u64 + 1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add((rank as u64 + 1) << 40)
                .wrapping_add((step as u64 + 1) << 20);
            h ^= h >> 29;
            h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h ^= h >> 32;
            if integer {
                (h % 81) as f32 - 40.0
            } else {
                (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            }
        })
        .collect()
}

struct Case {
    p: usize,
    sizes: Vec<usize>,
    method: RgcMethod,
    density: f64,
    momentum: f32,
    nesterov: bool,
    integer: bool,
    steps: usize,
    /// The same gradient every step (a reused threshold then passes
    /// more and more: the search runs again).
    repeat: bool,
}

/// Every step's result of the host engine and of the device step on
/// `HostOps`, per rank: (host, device).
fn run(case: &Case) -> Vec<Vec<(Vec<f32>, Vec<f32>)>> {
    let Case {
        p,
        ref sizes,
        method,
        density,
        momentum,
        nesterov,
        integer,
        steps,
        repeat,
    } = *case;
    let sizes = &sizes;
    let pairs: Vec<(LocalComm, LocalComm)> = LocalComm::create(p)
        .into_iter()
        .zip(LocalComm::create(p))
        .collect();
    let body = move |(e, c): (LocalComm, LocalComm)| {
        let cfg = Config {
            momentum,
            nesterov,
            ..Config::default()
        };
        let mut host = GradSync::with_transport(e, cfg).unwrap();
        for (l, &n) in sizes.iter().enumerate() {
            let s = Strategy::Sparse {
                codec: CodecConfig::Rgc { density, method },
                density: None,
            };
            host.register_with(&format!("l{l}"), &[n], s).unwrap();
        }
        let dcfg = DeviceSparseConfig {
            density,
            method: Method::from_rgc(method).unwrap(),
            momentum,
            nesterov,
        };
        let mut dev = DeviceSparse::new(HostOps::new(sizes), dcfg).unwrap();
        let mut out = Vec::new();
        for step in 0..steps {
            let mut gs: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(l, &n)| grad(c.rank(), if repeat { l } else { step * 31 + l }, n, integer))
                .collect();
            dev.ops().grads = gs.concat();
            let mut view: Vec<&mut [f32]> = gs.iter_mut().map(|g| &mut g[..]).collect();
            host.sync(&mut view).unwrap();
            dev.step(&c).unwrap();
            out.push((gs.concat(), dev.ops().grads.clone()));
        }
        out
    };
    std::thread::scope(|sc| {
        let hs: Vec<_> = pairs
            .into_iter()
            .map(|pc| sc.spawn(move || body(pc)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn equals_the_host_engine_bit_for_bit_on_integer_gradients() {
    for (p, method, momentum, nesterov) in [
        (1, RgcMethod::Trimmed, 0.0, false),
        (2, RgcMethod::Trimmed, 0.5, false),
        (3, RgcMethod::Threshold, 0.5, true),
        (4, RgcMethod::Threshold, 0.0, false),
        (3, RgcMethod::Exact, 0.25, false),
        (2, RgcMethod::Threshold, 0.5, false),
    ] {
        let case = Case {
            p,
            sizes: vec![3000, 1, 0, 517, 20000],
            method,
            density: 0.01,
            momentum,
            nesterov,
            integer: true,
            steps: 8,
            repeat: false,
        };
        for (r, steps) in run(&case).iter().enumerate() {
            for (s, (h, d)) in steps.iter().enumerate() {
                assert!(
                    bits(h) == bits(d),
                    "p {p} {method:?} m {momentum} rank {r} step {s}: first difference at {:?}",
                    h.iter()
                        .zip(d)
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                );
                assert!(h.iter().any(|&v| v != 0.0), "step {s} sent nothing");
            }
        }
    }
}

#[test]
fn a_reused_threshold_that_passes_too_many_searches_again_as_the_host_does() {
    for p in [1, 2] {
        let case = Case {
            p,
            sizes: vec![5000, 40000],
            method: RgcMethod::Threshold,
            density: 0.001,
            momentum: 0.0,
            nesterov: false,
            integer: true,
            steps: 12,
            repeat: true,
        };
        for steps in run(&case) {
            for (s, (h, d)) in steps.iter().enumerate() {
                assert!(bits(h) == bits(d), "p {p} step {s}");
            }
        }
    }
    // And the device policy did search again: with one gradient repeated,
    // the residual grows, the reused threshold passes more than 2k.
    let mut ops = HostOps::new(&[40000]);
    let m = Method::from_rgc(RgcMethod::Threshold).unwrap();
    let mut layers = vec![LayerState::new(40000, 40, m)];
    let g = grad(0, 3, 40000, true);
    for _ in 0..6 {
        ops.grads = g.clone();
        ops.accumulate(0.0, false).unwrap();
        let s = policy::select(&mut ops, &mut layers).unwrap();
        let gidx: Vec<u64> = s.entries.idx.iter().map(|&i| u64::from(i)).collect();
        ops.clear_sent(&gidx).unwrap();
    }
    assert!(
        layers[0].searches > 1,
        "searched {} times",
        layers[0].searches
    );
}

#[test]
fn real_gradients_stay_close_to_the_host_engine() {
    // The statistics sum in another order: thresholds may move in their
    // last bits. Over 6 steps of 30k reals the results still agree on all
    // but a few elements.
    for method in [RgcMethod::Trimmed, RgcMethod::Threshold] {
        let case = Case {
            p: 2,
            sizes: vec![30000, 700],
            method,
            density: 0.005,
            momentum: 0.9,
            nesterov: false,
            integer: false,
            steps: 6,
            repeat: false,
        };
        for steps in run(&case) {
            for (h, d) in steps {
                let differ = h
                    .iter()
                    .zip(&d)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert!(differ <= 8, "{method:?}: {differ} elements differ");
            }
        }
    }
}

#[test]
fn a_nonfinite_gradient_fails_every_rank_and_changes_nothing() {
    let res = LocalComm::run(3, |c| {
        let sizes = [100, 50];
        let mut dev =
            DeviceSparse::new(HostOps::new(&sizes), DeviceSparseConfig::default()).unwrap();
        dev.ops().grads = grad(c.rank(), 0, 150, true);
        if c.rank() == 2 {
            dev.ops().grads[120] = f32::NAN;
        }
        let err = dev.step(&c).unwrap_err().to_string();
        let untouched = dev.ops().v.iter().all(|&v| v == 0.0) && dev.steps() == 0;
        // The next step, finite everywhere, runs.
        dev.ops().grads = grad(c.rank(), 1, 150, true);
        let next = dev.step(&c).is_ok();
        (err, untouched, next)
    });
    for (err, untouched, next) in res {
        assert!(err.contains("rank 2"), "{err}");
        assert!(untouched && next);
    }
}

#[test]
fn search_rounds_count_five_levels_per_pass_and_reuse_counts_none() {
    // A 2^16 layer at density 0.001 searches once (at most 3 passes for the
    // 14 levels of ε = 1e-4), then reuses its threshold (1 pass).
    let mut ops = HostOps::new(&[1 << 16]);
    ops.grads = grad(0, 0, 1 << 16, false);
    ops.accumulate(0.0, false).unwrap();
    let m = Method::from_rgc(RgcMethod::Threshold).unwrap();
    let mut layers = vec![LayerState::new(1 << 16, 66, m)];
    let s = policy::select(&mut ops, &mut layers).unwrap();
    assert!((1..=3).contains(&s.count_passes), "{}", s.count_passes);
    assert!((66..=132).contains(&s.entries.idx.len()));
    assert_eq!(layers[0].searches, 1);
    // The reused threshold goes straight to the compaction.
    let s = policy::select(&mut ops, &mut layers).unwrap();
    assert_eq!(s.count_passes, 0);
    assert_eq!(layers[0].searches, 1);
}

#[test]
fn topk_of_candidates_keeps_ties_to_the_lower_index() {
    let mut idx = vec![0, 2, 5, 7, 9];
    let mut val = vec![1.0, -3.0, 3.0, 2.0, -3.0];
    crate::select::topk_of_candidates(2, &mut idx, &mut val, &mut Vec::new());
    assert_eq!(idx, vec![2, 5]);
    assert_eq!(val, vec![-3.0, 3.0]);
}

#[test]
fn an_overflowed_residual_fails_the_step_everywhere_as_the_host_engine_does() {
    let sizes = vec![3000usize, 2000];
    let pairs: Vec<(LocalComm, LocalComm)> = LocalComm::create(2)
        .into_iter()
        .zip(LocalComm::create(2))
        .collect();
    let body = |(e, c): (LocalComm, LocalComm)| {
        let mut host = GradSync::with_transport(e, Config::default()).unwrap();
        for (l, &n) in sizes.iter().enumerate() {
            host.register_with(&format!("{l}"), &[n], Strategy::rgc(0.01))
                .unwrap();
        }
        let mut dev = DeviceSparse::new(
            HostOps::new(&sizes),
            DeviceSparseConfig {
                density: 0.01,
                ..Default::default()
            },
        )
        .unwrap();
        let mut outcomes = Vec::new();
        for step in 0..3 {
            let mut gs: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(l, &n)| grad(c.rank(), step * 31 + l, n, true))
                .collect();
            if c.rank() == 1 && step < 2 {
                // Finite, but two of them overflow f32 in the residual.
                gs[1].iter_mut().for_each(|g| *g = 3e38);
            }
            dev.ops().grads = gs.concat();
            let mut view: Vec<&mut [f32]> = gs.iter_mut().map(|g| &mut g[..]).collect();
            let h = host.sync(&mut view).map(|_| ()).map_err(|e| e.to_string());
            let d = dev.step(&c).map(|_| ()).map_err(|e| e.to_string());
            outcomes.push((h, d, bits(&gs.concat()) == bits(&dev.ops().grads)));
        }
        outcomes
    };
    let got: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = pairs
            .into_iter()
            .map(|pc| sc.spawn(move || body(pc)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, steps) in got.iter().enumerate() {
        for (s, (h, d, same)) in steps.iter().enumerate() {
            assert_eq!(
                h.is_err(),
                d.is_err(),
                "rank {r} step {s}: host {h:?} device {d:?}"
            );
            assert!(*same, "rank {r} step {s}: results differ");
            if let (Err(h), Err(d)) = (h, d) {
                assert_eq!(s, 1, "the residual overflows at the second step");
                for e in [h, d] {
                    assert!(e.contains("rank 1") && e.contains('1'), "{e}");
                }
            }
        }
        assert!(
            steps[1].0.is_err(),
            "rank {r}: the overflow was not an error"
        );
    }
}
