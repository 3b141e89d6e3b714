//! SBC's communication delay without drift (`delay.rs`): the ranks'
//! weights are bit for bit the same after every communicating step,
//! whatever the learning-rate schedule; a delayed run without writable
//! weights fails on every rank; a restore in the middle of a window goes
//! on as the run would have.

use super::*;

/// One rank's record of a delayed run: after each step, whether it
/// communicated and the weights' bits; then its snapshot and weights.
type Record = (Vec<(bool, Vec<Vec<u32>>)>, Vec<u8>, Vec<Vec<f32>>);

/// Steps `from..to` of a delayed run with a per-step learning rate
/// (`w -= lr_t · r`) on every rank, from fresh weights or from each rank's
/// snapshot and weights in `resume`.
fn delayed_run(
    p: usize,
    cfg: &Config,
    (from, to): (u64, u64),
    resume: Option<&[Record]>,
) -> Vec<Record> {
    LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg.clone()).expect("engine");
        s.register("bias", &[16]).expect("dense");
        s.register_with("fc", &[1000], Strategy::rgc(0.05))
            .expect("rgc");
        s.register_with(
            "emb",
            &[300],
            Strategy::Sparse {
                codec: CodecConfig::None,
                density: None,
            },
        )
        .expect("sparse");
        let mut w: Vec<Vec<f32>> = [16, 1000, 300].iter().map(|&n| vec![0.5f32; n]).collect();
        if let Some(r) = resume {
            s.restore_bytes(&r[rank].1).expect("restore");
            w = r[rank].2.clone();
        }
        let mut hist = Vec::new();
        for step in from..to {
            // A warm-up then a decay: a different rate every step.
            let lr = 0.05 * (1.0 + step as f32).min(4.0) / (1.0 + 0.1 * step as f32);
            let mut g: Vec<Vec<f32>> = [16, 1000, 300]
                .iter()
                .enumerate()
                .map(|(l, &n)| grad(rank, step, l, n))
                .collect();
            let mut gv: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            let mut wv: Vec<&mut [f32]> = w.iter_mut().map(|x| &mut x[..]).collect();
            let st = s
                .sync_with_weights_mut(&mut gv, &mut wv)
                .expect("sync")
                .clone();
            for (wi, gi) in w.iter_mut().zip(&g) {
                wi.iter_mut().zip(gi).for_each(|(x, d)| *x -= lr * d);
            }
            let bits = w
                .iter()
                .map(|x| x.iter().map(|v| v.to_bits()).collect())
                .collect();
            hist.push((st.communicated, bits));
        }
        (hist, s.snapshot_bytes().expect("snapshot"), w)
    })
}

#[test]
fn delayed_weights_are_bitwise_equal_at_every_communicating_step() {
    for p in [2, 3] {
        for momentum in [0.0, 0.9] {
            let cfg = Config {
                delay: 3,
                momentum,
                ..cfg()
            };
            let res: Vec<_> = delayed_run(p, &cfg, (0, 12), None)
                .into_iter()
                .map(|r| r.0)
                .collect();
            let mut communicated = 0;
            let mut apart = 0;
            for t in 0..12 {
                let (comm, w0) = &res[0][t];
                assert_eq!(*comm, t % 3 == 2, "p {p} step {t}");
                if *comm {
                    communicated += 1;
                    for (r, h) in res.iter().enumerate() {
                        assert!(&h[t].1 == w0, "p {p} m {momentum}: rank {r} step {t}");
                    }
                } else if res.iter().any(|h| &h[t].1 != w0) {
                    apart += 1;
                }
            }
            assert_eq!(communicated, 4);
            // Between communications each rank takes its own steps: the
            // test could see a difference.
            assert!(apart >= 4, "p {p}: local steps never differed");
        }
    }
}

#[test]
fn a_restore_inside_a_delay_window_goes_on_as_the_run() {
    let cfg = Config {
        delay: 3,
        momentum: 0.9,
        ..cfg()
    };
    let whole = delayed_run(2, &cfg, (0, 9), None);
    // Stopped after step 2 (a window ends), 3 (one starts) or 4 (inside).
    for cut in [3, 4, 5] {
        let first = delayed_run(2, &cfg, (0, cut), None);
        let rest = delayed_run(2, &cfg, (cut, 9), Some(&first));
        for r in 0..2 {
            let mut h = first[r].0.clone();
            h.extend(rest[r].0.iter().cloned());
            assert!(h == whole[r].0, "rank {r}: restored after step {}", cut - 1);
        }
    }
}

#[test]
fn a_delay_without_writable_weights_fails_on_every_rank() {
    let res = LocalComm::run(3, |c| {
        let mut s = GradSync::with_transport(c, Config { delay: 2, ..cfg() }).expect("engine");
        s.register("w", &[8]).expect("register");
        let (mut g, mut w) = (vec![1.0f32; 8], vec![0.0f32; 8]);
        let plain = s
            .sync(&mut [&mut g[..]])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        let read = s
            .sync_with_weights(&mut [&mut g[..]], &[&w[..]])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        // The run goes on with the weights.
        for _ in 0..2 {
            s.sync_with_weights_mut(&mut [&mut g[..]], &mut [&mut w[..]])
                .expect("with weights");
        }
        (plain, read, s.step())
    });
    for (r, (plain, read, step)) in res.iter().enumerate() {
        for e in [plain, read] {
            assert!(
                e.contains("failed in step") && e.contains("delay > 1 needs the weights"),
                "rank {r}: {e}"
            );
        }
        assert_eq!(*step, 4, "rank {r}");
    }
}

/// A communicating step's result lost on one rank after the weights were
/// written back (its `wait` failed on a bad output, or the binding threw
/// the step away with `discard_pending`): that rank's weights differ from
/// its peers' for good, so every later step fails on every rank saying so,
/// until a restore.
#[test]
fn a_lost_delayed_result_fails_every_later_step_until_a_restore() {
    for discard in [false, true] {
        let res = LocalComm::run(2, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, Config { delay: 2, ..cfg() }).expect("engine");
            s.register("w", &[8]).expect("register");
            let mut w = [0.5f32; 8];
            let mut g = [1.0f32; 8];
            s.sync_with_weights_mut(&mut [&mut g[..]], &mut [&mut w[..]])
                .expect("step 0");
            let snap = s.snapshot_bytes().expect("snapshot");
            // Step 1 communicates.
            let mut g = [1.0f32; 8];
            if rank == 1 {
                s.start_with_weights_mut(&[&g[..]], &mut [&mut w[..]])
                    .expect("start");
                if discard {
                    assert!(s.discard_pending().expect("discarded"));
                } else {
                    let mut short = [0.0f32; 7];
                    s.wait(&mut [&mut short[..]]).expect_err("a short output");
                }
            } else {
                s.sync_with_weights_mut(&mut [&mut g[..]], &mut [&mut w[..]])
                    .expect("step 1");
            }
            let mut g = [1.0f32; 8];
            let e = s
                .sync_with_weights_mut(&mut [&mut g[..]], &mut [&mut w[..]])
                .map(|_| ())
                .unwrap_err()
                .to_string();
            s.restore_bytes(&snap).expect("restore");
            let mut g = [1.0f32; 8];
            s.sync_with_weights_mut(&mut [&mut g[..]], &mut [&mut w[..]])
                .expect("the run goes on after the restore");
            e
        });
        for (r, e) in res.iter().enumerate() {
            assert!(
                e.contains("rank 1 failed") && e.contains("was discarded on rank 1"),
                "discard {discard}, rank {r}: {e}"
            );
        }
    }
}
