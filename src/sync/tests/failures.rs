//! Collective failures: a step that fails on one rank fails on every rank alike,
//! loses nothing, and the next step runs (delayed steps included).

use super::*;

/// With weight decay, one rank that calls `start` without weights fails
/// the step on every rank (it used to return at once, and its peers,
/// which had passed theirs, waited in the step's collectives for ever);
/// the next step runs normally everywhere.
#[test]
fn a_rank_without_weights_fails_the_step_everywhere() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                weight_decay: 0.1,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("a", &[4]).expect("register");
        let (g, w) = ([1.0f32; 4], [1.0f32; 4]);
        let mut out = [0.0f32; 4];
        if rank == 1 {
            s.start(&[&g[..]]).expect("started");
        } else {
            s.start_with_weights(&[&g[..]], &[&w[..]]).expect("started");
        }
        let first = s
            .wait(&mut [&mut out[..]])
            .map(|_| ())
            .map_err(|e| e.to_string());
        s.start_with_weights(&[&g[..]], &[&w[..]]).expect("started");
        let second = s.wait(&mut [&mut out[..]]).map(|_| ());
        (first, second.is_ok())
    });
    for (r, (first, second)) in res.into_iter().enumerate() {
        let e = first.expect_err("the step fails on every rank");
        assert!(
            e.contains("rank 1") && e.contains("no weights were given"),
            "rank {r}: {e}"
        );
        assert!(second, "rank {r}: the next step runs");
    }
}

/// A rank that fails inside a step (here a gradient of the wrong
/// length on rank 1) makes every rank return the same `RankFailed` in that
/// step; nothing is applied, every rank's residual again holds its
/// gradient (what it had encoded is put back), and the next step runs.
#[test]
fn a_failed_step_fails_every_rank_alike_and_loses_nothing() {
    for overlap in [false, true] {
        let out = LocalComm::run(3, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, Config { overlap, ..cfg() }).expect("engine");
            let sp = s.register_with("w", &[1000], Strategy::rgc(0.01)).unwrap();
            s.register_with("b", &[10], Strategy::Dense).unwrap();
            let g = |step: usize| -> Vec<f32> {
                (0..1000)
                    .map(|i| ((i * 31 + rank * 7 + step) % 101) as f32 - 50.0)
                    .collect()
            };
            let (mut w, mut b) = (g(0), vec![1.0f32; 10]);
            s.sync(&mut [&mut w[..], &mut b[..]]).expect("step 0");
            let before: Vec<f32> = s.residual(sp).unwrap().to_vec();
            let g1 = g(1);
            let mut w = g1.clone();
            let mut b = vec![1.0f32; if rank == 1 { 11 } else { 10 }];
            let err = s
                .sync(&mut [&mut w[..], &mut b[..]])
                .unwrap_err()
                .to_string();
            let after: Vec<f32> = s.residual(sp).unwrap().to_vec();
            // Ranks that encoded get their unit back (V = V₀ + g); rank 1
            // failed its validation before touching anything (V = V₀).
            let kept = before.iter().zip(&g1).zip(&after).all(|((v, g), a)| {
                let want = if rank == 1 { *v } else { v + g };
                (want - a).abs() <= 1e-4 * want.abs().max(1.0)
            });
            let (mut w, mut b) = (g(2), vec![1.0f32; 10]);
            let next = s.sync(&mut [&mut w[..], &mut b[..]]).map(|_| b[0]);
            (err, kept, next.ok(), s.step())
        });
        for (err, kept, next, step) in &out {
            assert_eq!(err, &out[0].0, "same error on every rank");
            assert!(
                err.starts_with("rank 1 failed in step 1: ")
                    && err.contains("layer \"b\": gradient has 11 elements"),
                "{err}"
            );
            assert!(kept, "the residual holds the failed step's gradient");
            assert_eq!(*next, Some(1.0), "the next step runs");
            assert_eq!(*step, 3);
        }
    }
}

/// A binding that finds a bad argument before it can hand over
/// the gradients (`fail_step`) still takes part in the step: every rank
/// returns the same `RankFailed`, and the next step runs. Also the text
/// strategies of `register_spec`: a spec that does not parse on one rank
/// fails the registration on every rank.
#[test]
fn fail_step_and_register_spec_are_collective() {
    for overlap in [false, true] {
        let out = LocalComm::run(3, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, Config { overlap, ..cfg() }).expect("engine");
            let reg = s
                .register_spec("x", &[4], if rank == 2 { "rgc:density=2" } else { "dense" })
                .unwrap_err()
                .to_string();
            // The failed registration added nothing anywhere: go on.
            s.register_spec("w", &[1000], "rgc:density=0.01").unwrap();
            s.register_spec("b", &[10], "auto").unwrap();
            let (mut w, mut b) = (vec![1.0f32; 1000], vec![1.0f32; 10]);
            let step = if rank == 0 {
                s.fail_step(Error::InvalidArgument("array 1 is float64".into()))
                    .to_string()
            } else {
                s.sync(&mut [&mut w[..], &mut b[..]])
                    .unwrap_err()
                    .to_string()
            };
            let (mut w, mut b) = (vec![1.0f32; 1000], vec![rank as f32; 10]);
            let next = s.sync(&mut [&mut w[..], &mut b[..]]).map(|_| b[0]);
            (
                reg,
                step,
                next.ok(),
                s.layer(LayerId(1)).map(|l| l.2.clone()),
            )
        });
        for (reg, step, next, strat) in &out {
            assert_eq!(reg, &out[0].0);
            assert!(
                reg.contains("rank 2 failed") && reg.contains("\"x\""),
                "{reg}"
            );
            assert_eq!(step, &out[0].1);
            assert!(
                step.starts_with("rank 0 failed in step 0: ") && step.contains("float64"),
                "{step}"
            );
            assert_eq!(*next, Some(1.0), "the next step runs (mean of 0, 1, 2)");
            assert_eq!(
                strat.as_ref(),
                Some(&Strategy::Dense),
                "auto without a profile: by size"
            );
        }
    }
}

/// A table with nothing to exchange (no layers, or only empty dense ones)
/// still carries a failure on one rank to every rank in that step.
#[test]
fn a_failure_with_nothing_to_exchange_still_reaches_every_rank() {
    for empty_layer in [false, true] {
        let res = LocalComm::run(3, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            if empty_layer {
                s.register("e", &[0]).expect("register");
            }
            let mut out = Vec::new();
            for step in 0..3u64 {
                let r = if step == 1 && rank == 1 {
                    Err(s.fail_step(Error::InvalidArgument("no batch".into())))
                } else if empty_layer {
                    let mut g: Vec<f32> = Vec::new();
                    s.sync(&mut [&mut g[..]]).map(|_| ())
                } else {
                    s.sync(&mut []).map(|_| ())
                };
                out.push(r.map_err(|e| e.to_string()));
            }
            out
        });
        for (r, out) in res.iter().enumerate() {
            assert!(out[0].is_ok() && out[2].is_ok(), "rank {r}: {out:?}");
            let e = out[1].as_ref().expect_err("step 1 fails everywhere");
            assert!(e.contains("rank 1 failed in step 1"), "rank {r}: {e}");
        }
    }
}

/// With `delay > 1`, a step that fails on one rank (a communicating step,
/// or a local one) leaves every rank's weights where the others' are: after
/// the next communicating step the ranks agree again, and every rank saw
/// the failure in the step it happened.
#[test]
fn delayed_steps_fail_together_and_resynchronize() {
    let (p, t, lr) = (3, 2u64, 0.5f32);
    for fail_at in [1u64, 2] {
        for momentum in [0.0f32, 0.9] {
            let res = LocalComm::run(p, |c| {
                let rank = c.rank();
                let mut s = GradSync::with_transport(
                    c,
                    Config {
                        delay: t,
                        momentum,
                        ..cfg()
                    },
                )
                .expect("engine");
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
                let mut errs = Vec::new();
                for step in 0..6 {
                    let mut g = [grad(rank, step, 0, 64), grad(rank, step, 1, 16)];
                    let r = if step == fail_at && rank == 1 {
                        Err(s.fail_step(Error::InvalidArgument("bad array".into())))
                    } else {
                        let [a, b] = &mut g;
                        let [wa, wb] = &mut w;
                        s.sync_with_weights_mut(
                            &mut [&mut a[..], &mut b[..]],
                            &mut [&mut wa[..], &mut wb[..]],
                        )
                        .map(|_| ())
                    };
                    match r {
                        Ok(()) => {
                            for (wi, gi) in w.iter_mut().zip(&g) {
                                for (x, d) in wi.iter_mut().zip(gi) {
                                    *x -= lr * d;
                                }
                            }
                        }
                        Err(e) => errs.push((step, e.to_string())),
                    }
                }
                (w, errs)
            });
            for (r, (w, errs)) in res.iter().enumerate() {
                assert_eq!(
                    errs.len(),
                    1,
                    "fail at {fail_at}, m {momentum}, rank {r}: {errs:?}"
                );
                assert_eq!(errs[0].0, fail_at, "rank {r}: {errs:?}");
                assert!(errs[0].1.contains("rank 1"), "rank {r}: {errs:?}");
                // After the last communicating step (5): bit for bit.
                assert_eq!(w, &res[0].0, "fail at {fail_at}, m {momentum}: rank {r}");
            }
        }
    }
}

/// With `delay > 1`, a NaN on one rank, in a step with or without
/// communication, voids that step on every rank: the same `NonFinite`
/// naming the rank (`Error`) or NaN in every layer (`Propagate`), nothing
/// accumulated or exchanged; a caller that skips the step everywhere keeps
/// the ranks in step.
#[test]
fn a_nan_in_a_delayed_step_voids_it_on_every_rank() {
    let (p, t, lr) = (3, 2u64, 0.5f32);
    // Step 1 communicates, step 2 does not.
    for (nan_step, policy) in [1, 2]
        .into_iter()
        .flat_map(|s| [(s, NonFinitePolicy::Error), (s, NonFinitePolicy::Propagate)])
    {
        let res = LocalComm::run(p, |c| {
            let rank = c.rank();
            let cfg = Config {
                delay: t,
                momentum: 0.9,
                non_finite: policy,
                ..cfg()
            };
            let mut s = GradSync::with_transport(c, cfg).expect("engine");
            s.register_with("l", &[64], Strategy::rgc(0.1))
                .expect("register");
            s.register("d", &[16]).expect("dense");
            let mut w = [vec![0.0f32; 64], vec![0.0f32; 16]];
            let mut seen = Vec::new();
            for step in 0..4 {
                let mut g = [grad(rank, step, 0, 64), grad(rank, step, 1, 16)];
                if step == nan_step && rank == 2 {
                    g[1][3] = f32::NAN;
                }
                let [a, b] = &mut g;
                let [wa, wb] = &mut w;
                let r = s
                    .sync_with_weights_mut(
                        &mut [&mut a[..], &mut b[..]],
                        &mut [&mut wa[..], &mut wb[..]],
                    )
                    .map(|_| ());
                let nan = g.iter().any(|x| x.iter().any(|v| v.is_nan()));
                match r {
                    Ok(()) if !nan => {
                        for (wi, gi) in w.iter_mut().zip(&g) {
                            for (x, d) in wi.iter_mut().zip(gi) {
                                *x -= lr * d;
                            }
                        }
                    }
                    Ok(()) => seen.push((step, "nan".to_string())),
                    Err(e) => seen.push((step, e.to_string())),
                }
            }
            (w, seen)
        });
        for (r, (w, seen)) in res.iter().enumerate() {
            assert_eq!(seen.len(), 1, "{policy:?} rank {r}: {seen:?}");
            assert_eq!(seen[0].0, nan_step, "{policy:?} rank {r}: {seen:?}");
            if policy == NonFinitePolicy::Error {
                assert!(
                    seen[0].1.contains("rank 2") && seen[0].1.contains("\"d\""),
                    "rank {r}: {seen:?}"
                );
            }
            // After the last communicating step (3): bit for bit.
            assert_eq!(w, &res[0].0, "{policy:?}: rank {r}");
        }
    }
}

/// A failed step puts back what the stateful codecs' encoders kept (QSGD's
/// and RGC-quant's call counters, RGC's threshold search) on the ranks
/// that encoded before the failure: every rank's codec state after the
/// failed step is its state before it, so the later steps encode as if the
/// failed one never ran. Without the rollback ranks 0 and 2, which encoded,
/// would be one call ahead of rank 1, which failed first.
#[test]
fn a_failed_step_puts_the_codecs_state_back() {
    let out = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        let ids: Vec<_> = [
            ("q", "qsgd"),
            ("r", "rgc:density=0.01"),
            ("rq", "rgc-quant:density=0.01"),
        ]
        .iter()
        .map(|(name, spec)| s.register_spec(name, &[4000], spec).expect(name))
        .collect();
        s.register_with("b", &[10], Strategy::Dense).unwrap();
        let g = |step: usize, l: usize| -> Vec<f32> {
            (0..4000)
                .map(|i| (((i * 31 + rank * 7 + step * 13 + l) % 101) as f32 - 50.0) * 0.01)
                .collect()
        };
        let states = |s: &GradSync<LocalComm>| -> Vec<Vec<u8>> {
            ids.iter()
                .map(|id| s.reg.layers[id.0].codec.as_ref().expect("codec").state())
                .collect()
        };
        let run = |s: &mut GradSync<LocalComm>, step: usize, b_len: usize| {
            let (mut q, mut r, mut rq) = (g(step, 0), g(step, 1), g(step, 2));
            let mut b = vec![1.0f32; b_len];
            s.sync(&mut [&mut q[..], &mut r[..], &mut rq[..], &mut b[..]])
                .map(|_| ())
        };
        run(&mut s, 0, 10).expect("step 0");
        let before = states(&s);
        let failed = run(&mut s, 1, if rank == 1 { 11 } else { 10 }).is_err();
        let after = states(&s);
        run(&mut s, 2, 10).expect("step 2");
        (failed, before, after, states(&s))
    });
    for (r, (failed, before, after, next)) in out.iter().enumerate() {
        assert!(failed, "rank {r}: step 1 fails");
        assert!(
            before.iter().all(|x| !x.is_empty()),
            "rank {r}: stateful codecs"
        );
        assert_eq!(
            after, before,
            "rank {r}: the failed step left the codecs' state"
        );
        assert_ne!(next, before, "rank {r}: a step that succeeds moves it");
        assert_eq!(next, &out[0].3, "rank {r}: every rank's codecs in step");
    }
}
