//! Non-finite inputs and overflows: NaN/Inf gradients and weights, overflowing
//! residuals and sums, under the `non_finite` policy.

use super::*;

#[test]
fn non_finite_gradients_follow_the_policy() {
    for policy in [NonFinitePolicy::Error, NonFinitePolicy::Propagate] {
        let res = LocalComm::run(3, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(
                c,
                Config {
                    non_finite: policy,
                    ..cfg()
                },
            )
            .expect("engine");
            s.register("d", &[8]).expect("dense");
            let id = s
                .register_with("s", &[400], Strategy::rgc(0.01))
                .expect("sparse");
            let mut d = vec![1.0f32; 8];
            let mut g = grad(rank, 0, 1, 400);
            if rank == 2 {
                g[17] = f32::NAN;
            }
            let r = s.sync(&mut [&mut d[..], &mut g[..]]).map(|_| ());
            let res_ok = s
                .residual(id)
                .expect("sparse")
                .iter()
                .all(|x| x.is_finite());
            (r.map_err(|e| e.to_string()), g, d, res_ok)
        });
        for (r, g, d, res_ok) in &res {
            assert!(res_ok, "residual not poisoned");
            assert!(d.iter().all(|&x| x == 1.0), "other layers are written");
            match policy {
                NonFinitePolicy::Error => {
                    let e = r.as_ref().expect_err("every rank fails");
                    assert!(e.contains("\"s\"") && e.contains("rank 2"), "{e}");
                }
                NonFinitePolicy::Propagate => {
                    r.as_ref().expect("no error");
                    assert!(g.iter().all(|x| x.is_nan()));
                }
            }
        }
    }
}

/// Weights are input only where weight decay reads them: NaN weights
/// change nothing without it (the step equals one without weights), and
/// with it they void the step on every rank like a NaN gradient, naming
/// the layer and the rank.
#[test]
fn non_finite_weights_matter_only_with_weight_decay() {
    for wd in [0.0f32, 0.1] {
        let res = LocalComm::run(3, |c| {
            let rank = c.rank();
            let config = Config {
                weight_decay: wd,
                ..cfg()
            };
            let mut s = GradSync::with_transport(c, config).expect("engine");
            s.register("d", &[8]).expect("dense");
            s.register_with("s", &[400], Strategy::rgc(0.05))
                .expect("sparse");
            let mut d = grad(rank, 0, 0, 8);
            let mut g = grad(rank, 0, 1, 400);
            let wd_ = [0.5f32; 8];
            let mut ws = vec![0.5f32; 400];
            if rank == 1 {
                ws[7] = f32::NAN;
            }
            let r = s
                .sync_with_weights(&mut [&mut d[..], &mut g[..]], &[&wd_[..], &ws[..]])
                .map(|_| ())
                .map_err(|e| e.to_string());
            (r, d, g)
        });
        let plain = LocalComm::run(3, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            s.register("d", &[8]).expect("dense");
            s.register_with("s", &[400], Strategy::rgc(0.05))
                .expect("sparse");
            let mut d = grad(rank, 0, 0, 8);
            let mut g = grad(rank, 0, 1, 400);
            s.sync(&mut [&mut d[..], &mut g[..]]).expect("step");
            (d, g)
        });
        for ((r, d, g), (pd, pg)) in res.iter().zip(&plain) {
            if wd == 0.0 {
                r.as_ref().expect("unused NaN weights are no error");
                assert_eq!((d, g), (pd, pg), "the same step as without weights");
            } else {
                let e = r.as_ref().expect_err("every rank fails");
                assert!(e.contains("\"s\"") && e.contains("rank 1"), "{e}");
            }
        }
    }
}

/// A dense layer's NaN/Inf makes its sum non-finite on every rank; the
/// status words name the lowest rank whose input was non-finite (one rank:
/// itself), and a sum that overflowed from finite inputs names none.
#[test]
fn non_finite_dense_layers_name_the_rank() {
    for p in [1, 3] {
        let bad = p - 1;
        let res = LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            s.register("a", &[8]).expect("dense");
            s.register("b", &[16]).expect("dense");
            let mut a = [1.0f32; 8];
            let mut b = [2.0f32; 16];
            if rank == bad {
                b[3] = f32::INFINITY;
            }
            let e = s
                .sync(&mut [&mut a[..], &mut b[..]])
                .map(|_| ())
                .expect_err("every rank fails");
            // Next step: finite inputs whose sum overflows f32.
            let mut a = vec![1.0f32; 8];
            let mut b = [f32::MAX; 16];
            let o = s
                .sync(&mut [&mut a[..], &mut b[..]])
                .map(|_| ())
                .map_err(|e| e.to_string());
            (e, a, o)
        });
        for (e, a, o) in &res {
            assert!(
                matches!(e, Error::NonFinite { rank: Some(r), layer } if *r == bad && layer == "b"),
                "p = {p}: {e}"
            );
            assert!(e.to_string().contains(&format!("from rank {bad}")), "{e}");
            assert!(a.iter().all(|&x| x == 1.0), "the other layer is written");
            if p > 1 {
                let o = o.as_ref().expect_err("the sum overflows");
                assert!(
                    o.contains("every rank's gradient was finite, their sum overflowed f32"),
                    "p = {p}: {o}"
                );
            }
        }
    }
}

/// A finite but huge gradient on one rank overflows its residual a step
/// later (momentum 0.9: 3e38 + 0.9·3e38 > f32::MAX). That step fails on
/// every rank as a non-finite input of that rank and layer (the
/// `non_finite` policy), the overflowed residual is cleared, and the steps
/// after it run normally (before, the residual stayed infinite and every
/// later step failed to encode it).
#[test]
fn an_overflowing_residual_fails_one_step_then_recovers() {
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .expect("engine");
        s.register_with("w", &[4096], Strategy::rgc(0.01))
            .expect("register");
        (0..6)
            .map(|step| {
                let mut g = vec![1.0f32; 4096];
                if rank == 1 && step == 1 {
                    g.fill(3e38);
                }
                let r = s.sync(&mut [&mut g[..]]).map(|_| ());
                r.map_err(|e| e.to_string())
            })
            .collect::<Vec<_>>()
    });
    for (r, steps) in res.iter().enumerate() {
        assert!(steps[0].is_ok() && steps[1].is_ok(), "rank {r}: {steps:?}");
        let e = steps[2].as_ref().expect_err("the overflow fails step 2");
        assert!(e.contains("rank 1") && e.contains("\"w\""), "rank {r}: {e}");
        for (t, st) in steps.iter().enumerate().skip(3) {
            assert!(st.is_ok(), "rank {r} step {t}: {st:?}");
        }
    }
}

/// A dense codec's messages are summed before they are scaled: finite
/// gradients whose sum overflows f32 are a `NonFinite` error on every
/// rank (naming no rank), as the dense allreduce's are, not Inf with `Ok`.
#[test]
fn an_overflowing_sum_of_finite_messages_is_an_error_everywhere() {
    for codec in ["none", "int8"] {
        let res = LocalComm::run(3, |c| {
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            s.register_with(
                "w",
                &[4],
                Strategy::Sparse {
                    codec: codec.parse().expect("codec"),
                    density: None,
                },
            )
            .expect("register");
            let mut g = [3e38f32; 4];
            s.sync(&mut [&mut g[..]])
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        for (r, x) in res.iter().enumerate() {
            let e = x.as_ref().expect_err("overflow");
            assert!(
                e.contains("non-finite") && e.contains("\"w\""),
                "{codec} rank {r}: {e}"
            );
        }
    }
}
