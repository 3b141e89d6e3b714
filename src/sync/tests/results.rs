//! What a synced step computes: each codec's result against the decoded units,
//! mixed and empty tables, warm-up, communication delay and the per-step plan.

use super::*;

/// The engine's sparse result equals the average of every rank's decoded
/// unit, summed in rank order (the reference an MPI test compares against).
fn check_codec(codec: &str, p: usize, overlap: bool) {
    let codec: CodecConfig = codec.parse().expect("codec parses");
    let n = [1000usize, 37, 0];
    let res = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, Config { overlap, ..cfg() }).expect("engine");
        let ids: Vec<_> = n
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                s.register_with(
                    &format!("l{i}"),
                    &[n],
                    Strategy::Sparse {
                        codec: codec.clone(),
                        density: None,
                    },
                )
                .expect("register")
            })
            .collect();
        let mut runs = Vec::new();
        for step in 0..3u64 {
            let mut g: Vec<Vec<f32>> = n
                .iter()
                .enumerate()
                .map(|(i, &n)| grad(rank, step, i, n))
                .collect();
            let mut views: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
            s.sync(&mut views).expect("sync");
            let units: Vec<Vec<u8>> = ids.iter().map(|&id| s.last_unit(id).to_vec()).collect();
            runs.push((g, units));
        }
        runs
    });
    let dec = codec.build().expect("codec");
    for step in 0..3 {
        for (li, &len) in n.iter().enumerate() {
            // Sparse codecs add (1/p)·v per element, dense ones scale the sum.
            let (inv, mut want, mut dense) = (1.0 / p as f32, vec![0f32; len], false);
            for r in res.iter() {
                let unit = &r[step].1[li];
                let sparse = dec
                    .for_each_sent(unit, len, &mut |i, v| want[i] += inv * v)
                    .expect("decode");
                if !sparse {
                    dense = true;
                    dec.decode_add(unit, &mut want).expect("decode");
                }
            }
            if dense {
                for x in &mut want {
                    *x *= inv;
                }
            }
            for (r, rr) in res.iter().enumerate() {
                assert_eq!(
                    rr[step].0[li], want,
                    "codec {codec:?} p={p} step {step} layer {li} rank {r}"
                );
            }
        }
    }
}

#[test]
fn sparse_sync_equals_sum_of_decoded_units_for_every_codec() {
    for codec in [
        "rgc:density=0.01",
        "rgc:density=0.01,method=threshold",
        "rgc:density=0.01,method=sampled",
        "rgc-quant:density=0.02",
        "sbc:p=0.01",
        "3lc",
        "fastsgd:tau=40",
        "qsgd",
        "fp16",
        "none",
    ] {
        for p in [1, 2, 3, 4, 5] {
            check_codec(codec, p, false);
        }
    }
}

#[test]
fn overlapped_start_wait_gives_the_same_result() {
    for p in [1, 2, 4] {
        check_codec("rgc:density=0.05", p, true);
    }
}

#[test]
fn mixed_table_dense_layers_equal_the_average() {
    let p = 3;
    let res = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("small", &[10]).expect("dense by size");
        s.register_with("big", &[5000], Strategy::rgc(0.001))
            .expect("sparse");
        s.register("empty", &[0]).expect("empty");
        assert_eq!(s.layer(LayerId(0)).expect("layer").2, &Strategy::Dense);
        let mut a = vec![rank as f32 + 1.0; 10];
        let mut b = vec![0.0f32; 5000];
        b[rank * 7] = 5.0; // each rank's single big value
        let mut e: Vec<f32> = vec![];
        let st = s
            .sync(&mut [&mut a[..], &mut b[..], &mut e[..]])
            .expect("sync")
            .clone();
        (a, b, st)
    });
    for (a, b, st) in &res {
        assert!(a.iter().all(|&x| x == 2.0), "average of 1, 2, 3");
        for r in 0..p {
            assert_eq!(b[r * 7], 5.0 * (1.0 / 3.0f32));
        }
        assert_eq!(st.layers[0].strategy, "dense");
        assert_eq!(st.layers[1].strategy, "sparse");
        assert_eq!(st.layers[1].codec, "rgc");
        assert_eq!(st.layers[1].bytes_sent, 12 + 4 + 8 * 5);
        assert!(st.fused_bytes > 0 && st.dense_bytes == 40);
    }
}

#[test]
fn empty_selections_and_all_zero_gradients_work() {
    // fastsgd keeps nothing of an all-zero gradient: an empty unit.
    let res = LocalComm::run(4, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        let codec: CodecConfig = "fastsgd".parse().expect("codec");
        s.register_with(
            "l",
            &[256],
            Strategy::Sparse {
                codec,
                density: None,
            },
        )
        .expect("register");
        let mut g = if rank % 2 == 0 {
            vec![0.0f32; 256]
        } else {
            grad(rank, 0, 0, 256)
        };
        s.sync(&mut [&mut g[..]]).expect("sync");
        g
    });
    assert!(res.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn communication_delay_resynchronizes_weights_exactly() {
    // Codec `none`: every T-th step the weights equal those of T dense steps
    // on the summed local directions.
    let (p, t, lr) = (3, 4u64, 0.5f32);
    let res = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, Config { delay: t, ..cfg() }).expect("engine");
        s.register_with(
            "l",
            &[64],
            Strategy::Sparse {
                codec: CodecConfig::None,
                density: None,
            },
        )
        .expect("register");
        s.register("d", &[16]).expect("dense");
        let mut w = [vec![0.0f32; 64], vec![0.0f32; 16]];
        let mut hist = Vec::new();
        for step in 0..2 * t {
            let mut g = [grad(rank, step, 0, 64), grad(rank, step, 1, 16)];
            let [a, b] = &mut g;
            let [wa, wb] = &mut w;
            let st = s
                .sync_with_weights_mut(
                    &mut [&mut a[..], &mut b[..]],
                    &mut [&mut wa[..], &mut wb[..]],
                )
                .expect("sync")
                .clone();
            assert_eq!(st.communicated, (step + 1) % t == 0);
            for (wi, gi) in w.iter_mut().zip(&g) {
                for (x, d) in wi.iter_mut().zip(gi) {
                    *x -= lr * d;
                }
            }
            hist.push(w.clone());
        }
        hist
    });
    for step in [t - 1, 2 * t - 1] {
        let want: Vec<Vec<f32>> = [64usize, 16]
            .iter()
            .enumerate()
            .map(|(li, &n)| {
                (0..n)
                    .map(|i| {
                        let s: f64 = (0..=step)
                            .flat_map(|st| (0..p).map(move |r| f64::from(grad(r, st, li, n)[i])))
                            .sum();
                        -(f64::from(lr) * s / p as f64) as f32
                    })
                    .collect()
            })
            .collect();
        for h in &res {
            // Bit for bit the same weights on every rank.
            assert_eq!(h[step as usize], res[0][step as usize], "step {step}");
            for (a, b) in h[step as usize].iter().zip(&want) {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() < 1e-4, "step {step}: {x} vs {y}");
                }
            }
        }
        // Ranks agree up to the rounding of their different local paths.
        for h in &res[1..] {
            for (a, b) in h[step as usize].iter().zip(&res[0][step as usize]) {
                assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5));
            }
        }
    }
}

#[test]
fn dense_warmup_then_sparse_and_momentum_masking() {
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                warmup: Warmup::Dense { steps: 2 },
                ..cfg()
            },
        )
        .expect("engine");
        let id = s
            .register_with("l", &[1000], Strategy::rgc(0.01))
            .expect("register");
        let mut kinds = Vec::new();
        for step in 0..4 {
            let mut g = grad(rank, step, 0, 1000);
            let st = s.sync(&mut [&mut g[..]]).expect("sync");
            kinds.push(st.layers[0].strategy.clone());
        }
        let unit = s.last_unit(id).to_vec();
        let mut sent = vec![0.0; 1000];
        s.decode_unit(id, &unit, &mut sent).expect("decode");
        let l = &s.reg.layers[0];
        // Momentum factor masking: U is zero wherever this rank sent.
        let masked = sent.iter().zip(&l.u).all(|(&x, &u)| x == 0.0 || u == 0.0);
        let exact = sent.iter().zip(&l.v).all(|(&x, &v)| x == 0.0 || v == 0.0);
        (kinds, masked, exact)
    });
    for (kinds, masked, exact) in res {
        assert_eq!(kinds, ["dense", "dense", "sparse", "sparse"]);
        assert!(masked && exact);
    }
}

/// The engine does what the planner says, step by step: each layer's
/// reported strategy is its planned mode, the step communicates when the
/// plan does, and the sparse layer's codec runs at the planned density.
#[test]
fn the_engine_executes_the_plan() {
    let configs = [
        Config {
            delay: 3,
            warmup: Warmup::Dense { steps: 4 },
            momentum: 0.9,
            ..cfg()
        },
        Config {
            warmup: Warmup::Density {
                schedule: vec![0.5, 0.1],
                steps_per_stage: 2,
            },
            ..cfg()
        },
    ];
    for c in configs {
        let p = 2;
        LocalComm::run(p, |comm| {
            let rank = comm.rank();
            let mut s = GradSync::with_transport(comm, c.clone()).expect("engine");
            s.register("bias", &[10]).expect("dense");
            s.register_with("w", &[1000], Strategy::rgc(0.01))
                .expect("sparse");
            let (mut wa, mut wb) = (vec![0.0f32; 10], vec![0.0f32; 1000]);
            for step in 0..9u64 {
                let mut a = grad(rank, step, 0, 10);
                let mut b = grad(rank, step, 1, 1000);
                let st = s
                    .sync_with_weights_mut(
                        &mut [&mut a[..], &mut b[..]],
                        &mut [&mut wa[..], &mut wb[..]],
                    )
                    .expect("sync")
                    .clone();
                let plan = plan::script_step(step, &c, p, &s.reg.table);
                assert_eq!(s.plan, plan, "step {step}");
                assert_eq!(st.communicated, plan.communicates, "step {step}");
                for (l, lp) in st.layers.iter().zip(&plan.layers) {
                    let want = match lp.mode {
                        Mode::Dense => "dense",
                        Mode::Sparse => "sparse",
                        Mode::Local => "local",
                        Mode::Gradiveq => "gradiveq",
                        Mode::Powersgd => "powersgd",
                        Mode::Other => unreachable!("a whole step plans every layer"),
                    };
                    assert_eq!(l.strategy, want, "step {step} layer {}", l.name);
                }
                if plan.layers[1].mode == Mode::Sparse {
                    let d = plan.layers[1].density.expect("rgc has a density");
                    assert_eq!(s.reg.layers[1].cur_density, Some(d), "step {step}");
                    // Trimmed top-k sends about that fraction.
                    let sent = st.layers[1].density;
                    assert!(sent > 0.0 && sent <= 1.5 * d, "step {step}: {sent} vs {d}");
                }
            }
        });
    }
}

/// `rgc-quant` on a residual of one sign (here every value ties): every
/// step sends, the turns of the other sign included; before, every other
/// step sent nothing and no single step counted as starved.
#[test]
fn rgc_quant_sends_every_step_on_a_residual_of_one_sign() {
    let res = LocalComm::run(2, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register_spec("w", &[1000], "rgc-quant:density=0.01")
            .expect("register");
        (0..6)
            .map(|_| {
                let mut g = vec![0.5f32; 1000];
                let st = s.sync(&mut [&mut g[..]]).expect("sync");
                (
                    st.layers[0].density,
                    g.iter().filter(|&&x| x != 0.0).count(),
                )
            })
            .collect::<Vec<_>>()
    });
    for (r, steps) in res.iter().enumerate() {
        for (t, &(density, nonzero)) in steps.iter().enumerate() {
            assert!(
                density > 0.0 && nonzero >= 10,
                "rank {r} step {t}: {density} {nonzero}"
            );
        }
    }
}
