//! Engine tests on the in-process transport; the same scenarios run on real
//! MPI ranks in `tests/mpi.rs` (through `examples/engine_check.rs`).

use super::*;
use crate::codec::CodecConfig;
use crate::comm::LocalComm;
use crate::dense::AllgathervAlgo;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn grad(rank: usize, step: u64, layer: usize, n: usize) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64((rank as u64) << 40 ^ step << 20 ^ layer as u64);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// The error `GradSync::with_transport` gives every one of `p` ranks
/// created with `cfg` (which must fail).
fn creation_errors(p: usize, cfg: Config) -> Vec<String> {
    LocalComm::run(p, |c| {
        GradSync::with_transport(c, cfg.clone())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
}

fn cfg() -> Config {
    Config {
        overlap: false,
        ..Config::default()
    }
}

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
fn mismatched_layer_tables_fail_on_every_rank() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("a", &[100]).expect("same on all ranks");
        let shape = if rank == 1 { [101] } else { [100] };
        s.register("b", &shape)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for r in &res {
        let e = r.as_ref().expect_err("every rank fails");
        // Every rank names both sides: rank 0's layer and rank 1's.
        assert!(
            e.contains("not the same on every rank: rank 0 has layer #1 \"b\" of shape [100]"),
            "{e}"
        );
        assert!(
            e.contains("rank 1 has layer #1 \"b\" of shape [101]"),
            "{e}"
        );
    }
    // Different numbers of layers: caught before the first step.
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("a", &[10]).expect("register");
        let mut g = vec![vec![1.0f32; 10]; 1 + rank];
        if rank == 1 {
            if let Err(e) = s.register("b", &[10]) {
                return e.to_string();
            }
        }
        let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
        s.sync(&mut v)
            .map(|_| String::new())
            .unwrap_or_else(|e| e.to_string())
    });
    assert!(res.iter().all(|e| e.contains("differs")), "{res:?}");
    // Different options.
    let res = LocalComm::run(2, |c| {
        let m = if c.rank() == 0 { 0.9 } else { 0.0 };
        GradSync::with_transport(
            c,
            Config {
                momentum: m,
                ..cfg()
            },
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    });
    assert!(res.iter().all(|r| r.is_err()));
}

fn full_cfg() -> Config {
    Config {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-4,
        clip_norm: Some(5.0),
        warmup: Warmup::Density {
            schedule: vec![0.25, 0.0625],
            steps_per_stage: 1,
        },
        ..cfg()
    }
}

fn register_full(s: &mut GradSync<LocalComm>) {
    s.register("dense", &[64]).expect("register");
    s.register_with(
        "thr",
        &[3000],
        Strategy::Sparse {
            codec: "rgc:method=threshold".parse().expect("codec"),
            density: Some(0.01),
        },
    )
    .expect("register");
    s.register_with(
        "quant",
        &[2000],
        Strategy::Sparse {
            codec: "rgc-quant".parse().expect("codec"),
            density: Some(0.01),
        },
    )
    .expect("register");
    s.register_with(
        "qsgd",
        &[500],
        Strategy::Sparse {
            codec: "qsgd".parse().expect("codec"),
            density: None,
        },
    )
    .expect("register");
}

/// Run steps `from..to`, returning every step's outputs.
fn steps(s: &mut GradSync<LocalComm>, rank: usize, from: u64, to: u64) -> Vec<Vec<Vec<f32>>> {
    let n = [64usize, 3000, 2000, 500];
    let w: Vec<Vec<f32>> = n.iter().map(|&n| vec![0.5; n]).collect();
    let wv: Vec<&[f32]> = w.iter().map(|x| &x[..]).collect();
    (from..to)
        .map(|t| {
            let mut g: Vec<Vec<f32>> = n
                .iter()
                .enumerate()
                .map(|(i, &n)| grad(rank, t, i, n))
                .collect();
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            s.sync_with_weights(&mut v, &wv).expect("sync");
            g
        })
        .collect()
}

#[test]
fn snapshot_restore_continues_bitwise() {
    let p = 3;
    let straight = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        steps(&mut s, rank, 0, 8)
    });
    let dir = std::env::temp_dir().join(format!("gradsync-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let resumed = LocalComm::run(p, |c| {
        let rank = c.rank();
        let path = dir.join(format!("rank{rank}.snap"));
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        steps(&mut s, rank, 0, 4);
        s.save_snapshot(&path).expect("save");
        drop(s);
        // A fresh engine (as after a restart) on a fresh transport is built
        // below; here only the file survives.
        path
    });
    let after = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        s.load_snapshot(&resumed[rank]).expect("load");
        assert_eq!(s.step(), 4);
        steps(&mut s, rank, 4, 8)
    });
    for r in 0..p {
        for t in 0..4 {
            let (a, b) = (&straight[r][4 + t], &after[r][t]);
            for (x, y) in a.iter().zip(b) {
                let (xb, yb): (Vec<u32>, Vec<u32>) = (
                    x.iter().map(|v| v.to_bits()).collect(),
                    y.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(xb, yb, "rank {r} step {}", 4 + t);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corrupt_or_foreign_snapshots_are_rejected_and_change_nothing() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        steps(&mut s, 0, 0, 2);
        let good = s.snapshot_bytes().expect("snapshot");
        let residual = s.residual(LayerId(1)).expect("sparse").to_vec();
        for cut in [0, 7, 20, good.len() / 2, good.len() - 1] {
            assert!(s.restore_bytes(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut bad = good.clone();
        bad[9] ^= 1; // version
        assert!(s.restore_bytes(&bad).is_err());
        let mut bad = good.clone();
        bad[30] ^= 0x40; // table hash
        assert!(s.restore_bytes(&bad).is_err());
        assert_eq!(s.residual(LayerId(1)).expect("sparse"), &residual[..]);
        assert_eq!(s.step(), 2);
        s.restore_bytes(&good).expect("restores");
    });
}

/// A snapshot of other options is refused; under the default
/// `"allgather": "auto"` the error says how a snapshot written under the
/// earlier default (`recdbl`) loads, and it does load that way.
#[test]
fn a_snapshot_of_the_earlier_allgather_default_names_the_option() {
    LocalComm::run(1, |c| {
        let old = Config {
            allgather: AllgathervAlgo::RecursiveDoubling,
            ..full_cfg()
        };
        let mut s = GradSync::with_transport(c, old).expect("engine");
        register_full(&mut s);
        steps(&mut s, 0, 0, 2);
        let snap = s.snapshot_bytes().expect("snapshot");
        drop(s);
        let c = LocalComm::create(1).pop().expect("one rank");
        assert_eq!(full_cfg().allgather, AllgathervAlgo::Auto);
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        let e = s.restore_bytes(&snap).unwrap_err().to_string();
        assert!(e.contains("another layer table or other options"), "{e}");
        assert!(e.contains("\"allgather\": \"recdbl\""), "{e}");
        let c = LocalComm::create(1).pop().expect("one rank");
        let old = Config {
            allgather: AllgathervAlgo::RecursiveDoubling,
            ..full_cfg()
        };
        let mut s = GradSync::with_transport(c, old).expect("engine");
        register_full(&mut s);
        s.restore_bytes(&snap)
            .expect("restores with the earlier default");
    });
}

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

/// `bytes_sent` of an rgc-quant layer: its unit in the fused allgatherv
/// (indices and one mean, 4 bytes a pair), 8 bytes a pair it puts into the
/// sparse allreduce.
#[test]
fn reduced_layers_report_the_pairs_they_send() {
    for exchange in [SparseExchange::Allgather, SparseExchange::Allreduce] {
        let res = LocalComm::run(2, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(
                c,
                Config {
                    sparse_exchange: exchange,
                    ..cfg()
                },
            )
            .expect("engine");
            let codec = CodecConfig::RgcQuant { density: 0.01 };
            s.register_with(
                "q",
                &[1000],
                Strategy::Sparse {
                    codec,
                    density: None,
                },
            )
            .expect("sparse");
            let mut g = grad(rank, 0, 1, 1000);
            let sent = s.sync(&mut [&mut g[..]]).expect("step").layers[0].bytes_sent;
            let unit = s.last_unit(LayerId(0)).to_vec();
            let mut d = vec![0f32; 1000];
            s.decode_unit(LayerId(0), &unit, &mut d).expect("decode");
            let pairs = d.iter().filter(|x| **x != 0.0).count();
            (sent, unit.len(), pairs)
        });
        for (sent, unit, pairs) in res {
            assert!(
                pairs > 0 && unit < 8 * pairs,
                "{exchange:?}: {unit} bytes, {pairs} pairs"
            );
            let want = match exchange {
                SparseExchange::Allgather => unit,
                _ => 8 * pairs,
            };
            assert_eq!(sent, want, "{exchange:?}");
        }
    }
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
            let st = s.sync(&mut [&mut a[..], &mut b[..]]).expect("sync").clone();
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
        let l = &s.layers[0];
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

#[test]
fn bad_calls_are_errors() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(
            c,
            Config {
                weight_decay: 0.1,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("a", &[4]).expect("register");
        let mut g = [0.0f32; 3];
        assert!(s.sync(&mut [&mut g[..]]).is_err(), "wrong length");
        let g = [0.0f32; 4];
        let mut out = [0.0f32; 4];
        // Weight decay needs the weights: the step fails (in `wait`).
        s.start(&[&g[..]]).expect("a failing step is still started");
        let e = s
            .wait(&mut [&mut out[..]])
            .expect_err("weight decay needs weights");
        assert!(e.to_string().contains("no weights were given"), "{e}");
        assert!(s.wait(&mut [&mut out[..]]).is_err(), "wait without start");
        s.start_with_weights(&[&g[..]], &[&g[..]]).expect("start");
        assert!(s.start_with_weights(&[&g[..]], &[&g[..]]).is_err(), "twice");
        s.wait(&mut [&mut out[..]]).expect("wait");
        assert!(s.register("late", &[4]).is_err(), "register after a step");
    });
    for delay in [0, config::MAX_DELAY + 1, u64::MAX] {
        let bad = Config { delay, ..cfg() };
        LocalComm::run(1, |c| {
            let e = GradSync::with_transport(c, bad.clone())
                .err()
                .expect("refused");
            assert!(e.to_string().contains(&format!("delay {delay}")), "{e}");
        });
    }
    let auto_density = [0.0, -1.0, 5.0, f64::NAN].map(|auto_density| Config {
        auto_density,
        ..cfg()
    });
    let weight_decay = [-0.1, f32::NAN, f32::INFINITY].map(|weight_decay| Config {
        weight_decay,
        ..cfg()
    });
    for (bad, needle) in auto_density
        .into_iter()
        .map(|c| (c, "auto_density"))
        .chain(weight_decay.into_iter().map(|c| (c, "weight_decay")))
    {
        LocalComm::run(1, |c| {
            let e = GradSync::with_transport(c, bad.clone())
                .err()
                .expect("refused");
            assert!(e.to_string().contains(needle), "{e}");
        });
    }
    let ok = Config {
        delay: config::MAX_DELAY,
        ..cfg()
    };
    LocalComm::run(1, |c| {
        assert!(GradSync::with_transport(c, ok.clone()).is_ok())
    });
}

/// RedSync's §5.4 rules come out of the model: with its 3.5 GB/s network,
/// p = 8 and a GPU-like selection cost (60 µs per layer + 0.2 ns per
/// element), Auto keeps layers below ~100 KB dense and compresses larger ones.
#[test]
fn auto_follows_the_cost_model() {
    let mut prof = crate::cost::Profile::from_network(5e-6, 3.5e9, 0.0, 0.0).expect("profile");
    prof.select.insert(
        "trimmed".into(),
        crate::cost::LinearFit { a: 6e-5, b: 2e-10 },
    );
    let res = LocalComm::run(8, |c| {
        let mut s = GradSync::with_transport(
            c,
            Config {
                profile: Some(prof.clone()),
                ..cfg()
            },
        )
        .expect("engine");
        let small = s.register("small", &[16 * 1024]).expect("64 KB");
        let big = s.register("big", &[256 * 1024]).expect("1 MB");
        let explicit = s
            .register_with("explicit", &[64], Strategy::Dense)
            .expect("explicit");
        let mut g = [
            vec![1.0f32; 16 * 1024],
            vec![1.0f32; 256 * 1024],
            vec![1.0f32; 64],
        ];
        let [a, b, e] = &mut g;
        let st = s
            .sync(&mut [&mut a[..], &mut b[..], &mut e[..]])
            .expect("sync")
            .clone();
        (
            s.layer(small).expect("l").2.clone(),
            s.layer(big).expect("l").2.clone(),
            s.layer(explicit).expect("l").2.clone(),
            st.layers.iter().map(|l| l.auto).collect::<Vec<_>>(),
            st.layers[1].strategy.clone(),
        )
    });
    for (small, big, explicit, auto, kind) in res {
        assert_eq!(small, Strategy::Dense);
        assert_eq!(big.label(), "rgc");
        assert_eq!(explicit, Strategy::Dense);
        assert_eq!(auto, [true, true, false]);
        assert_eq!(kind, "sparse");
    }
    // Auto without a profile is an error.
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        assert!(s.register_with("x", &[10], Strategy::Auto).is_err());
    });
}

fn gvq_cfg() -> crate::gradiveq::schedule::ScheduleConfig {
    crate::gradiveq::schedule::ScheduleConfig {
        k: 32,
        dim: crate::gradiveq::Dim::Fixed(4),
        reuse: None,
        warmup: 1,
        lt: 6,
        lc: 1000,
        loss_threshold: 0.5,
        qsgd_bits: 8,
        qsgd_bucket: 0,
    }
}

/// Gradients in a 4-dimensional subspace of each 32-element slice.
fn gvq_grad(rank: usize, step: u64) -> Vec<f32> {
    let mut basis = SmallRng::seed_from_u64(77);
    let b: Vec<f32> = (0..32 * 4).map(|_| basis.gen_range(-1.0f32..1.0)).collect();
    let mut r = SmallRng::seed_from_u64((rank as u64) << 32 ^ step);
    let mut v = Vec::with_capacity(256);
    for _ in 0..8 {
        let c: Vec<f32> = (0..4).map(|_| r.gen_range(-1.0f32..1.0)).collect();
        for i in 0..32 {
            v.push((0..4).map(|j| b[i * 4 + j] * c[j]).sum());
        }
    }
    v
}

fn gvq_steps(
    s: &mut GradSync<LocalComm>,
    rank: usize,
    from: u64,
    to: u64,
) -> Vec<(Vec<f32>, Vec<f32>, String)> {
    (from..to)
        .map(|t| {
            let mut g = gvq_grad(rank, t);
            let mut d = vec![rank as f32; 8];
            let st = s.sync(&mut [&mut g[..], &mut d[..]]).expect("sync").clone();
            (g, d, st.layers[0].strategy.clone())
        })
        .collect()
}

/// GradiVeQ as an engine strategy: every rank gets the same result, which
/// approximates the average once compressed; its schedule and compressors
/// go into the snapshot, and a restored run continues bitwise.
#[test]
#[allow(clippy::needless_range_loop)] // steps index several per-rank histories
fn gradiveq_layers_in_the_engine_and_their_snapshot() {
    let p = 3;
    let register = |s: &mut GradSync<LocalComm>| {
        s.register_with("conv", &[256], Strategy::Gradiveq(gvq_cfg()))
            .expect("gvq");
        s.register("bias", &[8]).expect("dense");
    };
    let straight = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        register(&mut s);
        gvq_steps(&mut s, rank, 0, 12)
    });
    for t in 0..12 {
        for r in 1..p {
            assert_eq!(
                straight[r][t].0, straight[0][t].0,
                "step {t}: same on every rank"
            );
        }
        assert_eq!(straight[0][t].2, "gradiveq");
        assert!(
            straight[0][t].1.iter().all(|&x| x == 1.0),
            "dense layer averaged"
        );
    }
    // Steps 7.. are compressed (1 warm-up + 6 samples): close to the average.
    for t in 7..12u64 {
        let want: Vec<f32> = (0..256)
            .map(|i| (0..p).map(|r| gvq_grad(r, t)[i]).sum::<f32>() / p as f32)
            .collect();
        let got = &straight[0][t as usize].0;
        let err: f32 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f32>()
            .sqrt()
            / want.iter().map(|b| b * b).sum::<f32>().sqrt();
        // Six QSGD-aggregated samples: the quantization noise in them tilts
        // the fitted subspace a little.
        assert!(err < 0.2, "step {t}: rel error {err}");
    }
    let dir = std::env::temp_dir().join(format!("gradsync-gvq-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let paths = LocalComm::run(p, |c| {
        let rank = c.rank();
        let path = dir.join(format!("r{rank}.snap"));
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        register(&mut s);
        gvq_steps(&mut s, rank, 0, 5); // stopped while collecting samples
        s.save_snapshot(&path).expect("save");
        path
    });
    let resumed = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        register(&mut s);
        s.load_snapshot(&paths[rank]).expect("load");
        gvq_steps(&mut s, rank, 5, 12)
    });
    for r in 0..p {
        for t in 5..12 {
            let (a, b) = (&straight[r][t].0, &resumed[r][t - 5].0);
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "rank {r} step {t}"
            );
        }
    }
    // A snapshot of another layer table is refused.
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("conv", &[256]).expect("dense this time");
        s.register("bias", &[8]).expect("dense");
        assert!(s.load_snapshot(&paths[0]).is_err());
    });
    std::fs::remove_dir_all(&dir).ok();
}

/// Hostile snapshot bytes (mutated or truncated, GradiVeQ state included)
/// never panic; a refused restore leaves the engine as it was.
#[test]
fn mutated_snapshots_with_gradiveq_state_never_panic() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register_with("conv", &[256], Strategy::Gradiveq(gvq_cfg()))
            .expect("gvq");
        s.register_with("fc", &[500], Strategy::rgc(0.02))
            .expect("rgc");
        gvq_steps_one(&mut s, 0, 9);
        let good = s.snapshot_bytes().expect("snapshot");
        let mut rng = SmallRng::seed_from_u64(5);
        for trial in 0..400 {
            let mut bad = good.clone();
            for _ in 0..1 + trial % 4 {
                let i = rng.gen_range(0..bad.len());
                bad[i] ^= 1 << rng.gen_range(0..8);
            }
            if trial % 5 == 0 {
                bad.truncate(rng.gen_range(0..bad.len()));
            }
            let before = s.snapshot_bytes().expect("snapshot");
            if s.restore_bytes(&bad).is_err() {
                assert_eq!(
                    s.snapshot_bytes().expect("snapshot"),
                    before,
                    "trial {trial}"
                );
            } else {
                // A mutation that still parses (a flipped float bit): put the
                // good state back for the next trial.
                s.restore_bytes(&good).expect("restore");
            }
        }
        // The restored engine still runs.
        gvq_steps_one(&mut s, 9, 11);
    });
}

fn gvq_steps_one(s: &mut GradSync<LocalComm>, from: u64, to: u64) {
    for t in from..to {
        let mut g = gvq_grad(0, t);
        let mut f = grad(0, t, 1, 500);
        s.sync(&mut [&mut g[..], &mut f[..]]).expect("sync");
    }
}

/// Issue #11: a rank that fails inside a step (here a gradient of the wrong
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

/// Issue #12: a binding that finds a bad argument before it can hand over
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

/// Layer names tell layers apart in errors, stats and snapshots: an empty
/// name, a control character or a name already registered fails the
/// registration on every rank (naming the rank, the layer and why), and
/// registers nothing anywhere.
#[test]
fn layer_names_must_be_unique_and_printable() {
    let out = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("w", &[8]).expect("first w");
        let mut errs = Vec::new();
        for bad in ["w", "", "a\0b", "x\ny"] {
            // Only the last rank passes the bad name; the others a good one.
            let name = if rank == 2 { bad } else { "fine" };
            errs.push(s.register(name, &[4]).unwrap_err().to_string());
        }
        s.register("b", &[4]).expect("the table goes on");
        (errs, s.num_layers())
    });
    for (errs, n) in &out {
        assert_eq!(errs, &out[0].0, "the same errors on every rank");
        assert_eq!(*n, 2, "nothing registered by the failed calls");
    }
    let e = &out[0].0;
    assert!(
        e[0].contains("rank 2 failed") && e[0].contains("layer #0 has the same name"),
        "{}",
        e[0]
    );
    assert!(e[1].contains("a layer needs a name"), "{}", e[1]);
    assert!(
        e[2].contains("control character") && e[3].contains("control character"),
        "{e:?}"
    );
}

/// Issue #11 class 5: snapshots are checked (CRC-32 over the file, finite
/// floats) and loading is collective: bad bytes on one rank fail every rank
/// with the same error and leave every engine unchanged.
#[test]
fn bad_snapshots_fail_every_rank_and_change_nothing() {
    let dir = std::env::temp_dir().join(format!("gradsync-snap-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .unwrap();
        let sp = s.register_with("w", &[1000], Strategy::rgc(0.01)).unwrap();
        s.register_with("b", &[8], Strategy::Dense).unwrap();
        let step = |s: &mut GradSync<LocalComm>, k: usize| {
            // Element 7 is never selected: its residual is a known value.
            let mut w: Vec<f32> = (0..1000)
                .map(|i| {
                    if i == 7 {
                        0.123
                    } else {
                        ((i * 13 + k + rank) % 97) as f32
                    }
                })
                .collect();
            let mut b = [1.0f32; 8];
            s.sync(&mut [&mut w[..], &mut b[..]]).unwrap();
        };
        step(&mut s, 0);
        let good = s.snapshot_bytes().unwrap();
        step(&mut s, 1);
        let residual = s.residual(sp).unwrap().to_vec();
        let mut results = Vec::new();
        // 1. One flipped bit on rank 2 only.
        let mut flipped = good.clone();
        if rank == 2 {
            let mid = flipped.len() / 2;
            flipped[mid] ^= 0x04;
        }
        results.push(s.restore_bytes(&flipped).unwrap_err().to_string());
        // 2. A missing file on rank 1 only.
        let path = dir.join(format!("r{rank}.snap"));
        std::fs::write(&path, &good).unwrap();
        if rank == 1 {
            std::fs::remove_file(&path).unwrap();
        }
        results.push(s.load_snapshot(&path).unwrap_err().to_string());
        // 3. A device on rank 0 only (it never ends; a FIFO would block).
        let zero = if rank == 0 {
            std::path::PathBuf::from("/dev/zero")
        } else {
            dir.join(format!("r{rank}.snap"))
        };
        std::fs::write(dir.join(format!("r{rank}.snap")), &good).unwrap();
        results.push(s.load_snapshot(&zero).unwrap_err().to_string());
        // 4. A step counter past any run (the CRC made valid): stepping on
        // from it would wrap.
        let mut wrapped = good.clone();
        wrapped[36..44].copy_from_slice(&u64::MAX.to_le_bytes());
        let body = wrapped.len() - 4;
        let crc = crc32fast::hash(&wrapped[..body]);
        wrapped[body..].copy_from_slice(&crc.to_le_bytes());
        results.push(s.restore_bytes(&wrapped).unwrap_err().to_string());
        // 5. The first layer's name length past the data (CRC valid):
        // bincode's own message for it is empty.
        let mut long = good.clone();
        long[52..60].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let body = long.len() - 4;
        let crc = crc32fast::hash(&long[..body]);
        long[body..].copy_from_slice(&crc.to_le_bytes());
        results.push(s.restore_bytes(&long).unwrap_err().to_string());
        let unchanged = s.step() == 2 && s.residual(sp).unwrap() == &residual[..];
        // The good snapshot still loads everywhere afterwards.
        let reload = s.restore_bytes(&good).map(|_| s.step());
        (results, unchanged, reload.ok())
    });
    std::fs::remove_dir_all(&dir).ok();
    for (results, unchanged, reload) in &out {
        assert_eq!(results, &out[0].0, "same errors on every rank");
        assert!(
            results[0].starts_with("rank 2 failed: ") && results[0].contains("checksum mismatch"),
            "{}",
            results[0]
        );
        assert!(
            results[1].starts_with("rank 1 failed: ") && results[1].contains("r1.snap"),
            "{}",
            results[1]
        );
        assert!(
            results[2].starts_with("rank 0 failed: ") && results[2].contains("not a regular file"),
            "{}",
            results[2]
        );
        assert!(
            results[3].contains(&format!("step {} is past any run", u64::MAX)),
            "{}",
            results[3]
        );
        assert!(
            results[4].contains("a length field runs past the end of the data"),
            "{}",
            results[4]
        );
        assert!(unchanged, "a failed load changes no engine");
        assert_eq!(*reload, Some(1));
    }
}

/// A snapshot whose checksum is right but which holds a NaN residual is
/// refused, naming the layer and the element.
#[test]
fn a_snapshot_with_a_nan_residual_is_refused() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).unwrap();
        s.register_with("w", &[1000], Strategy::rgc(0.01)).unwrap();
        let mut w: Vec<f32> = (0..1000)
            .map(|i| if i == 7 { 0.123 } else { (i % 97) as f32 })
            .collect();
        s.sync(&mut [&mut w[..]]).unwrap();
        let mut bytes = s.snapshot_bytes().unwrap();
        let payload = bytes.len() - 4;
        let at = bytes[..payload]
            .windows(4)
            .position(|x| x == 0.123f32.to_le_bytes())
            .expect("the residual value is in the file");
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..payload]);
        bytes[payload..].copy_from_slice(&crc.to_le_bytes());
        let e = s.restore_bytes(&bytes).unwrap_err().to_string();
        assert!(e.contains("layer \"w\": residual[7] is NaN"), "{e}");
    });
}

/// Found by the `snapshot` fuzz target: an accepted snapshot whose residual
/// is near `f32::MAX` overflows in the next step, and the engine then wrote
/// a snapshot it could never load (`snapshot_bytes` now also refuses one,
/// naming the layer and the element). The overflow itself now fails its
/// step as a non-finite input and clears the residual, so the state stays
/// finite and the snapshot loads.
#[test]
fn fuzz_non_finite_state_is_never_written() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).unwrap();
        s.register_with("w", &[100], Strategy::rgc(0.01)).unwrap();
        let mut g = vec![3.0e38f32; 100];
        s.sync(&mut [&mut g[..]]).expect("3e38 is finite");
        let mut g = vec![3.0e38f32; 100];
        let e = s.sync(&mut [&mut g[..]]).map(|_| ()).expect_err("overflow");
        assert!(matches!(e, Error::NonFinite { .. }), "{e}");
        assert!(s.residual(LayerId(0)).unwrap().iter().all(|x| *x == 0.0));
        let bytes = s.snapshot_bytes().expect("a finite state is written");
        s.restore_bytes(&bytes).expect("and loads");
    });
}

/// `gradsync predict`/`plan`'s arguments with the network from a profile
/// given in code and `strategies` as the candidates.
#[cfg(feature = "cli")]
fn model_args(strategies: String) -> crate::cost::records::ModelArgs {
    crate::cost::records::ModelArgs {
        profile: None,
        alpha: None,
        bandwidth: None,
        gamma_reduce: None,
        gamma_unpack: None,
        select_cost: None,
        select_fixed: None,
        select_method: "trimmed".into(),
        gradiveq_ratio: 8.0,
        strategies,
        ranks_per_node: None,
        inter_alpha: None,
        inter_bandwidth: None,
        fill: None,
        compress_threshold: 0,
    }
}

/// Issue #13: `Strategy::Auto`, `gradsync predict`'s choice and `plan`
/// decide through the one table (`cost::choose`): for the same layer,
/// profile and candidates they agree.
#[cfg(feature = "cli")]
#[test]
fn auto_predict_and_plan_make_the_same_choice() {
    use crate::cost::{LinearFit, Profile};
    let mut prof = Profile::from_network(5e-6, 1.25e9, 0.0, 0.0).unwrap();
    let fit = LinearFit { a: 6e-5, b: 2e-10 };
    prof.select.insert("trimmed".into(), fit);
    prof.select.insert("quant".into(), fit);
    for quant in [false, true] {
        let prof2 = prof.clone();
        let out = LocalComm::run(4, move |c| {
            let cfg = Config {
                profile: Some(prof2.clone()),
                auto_quant: quant,
                ..cfg()
            };
            let s = GradSync::with_transport(c, cfg).unwrap();
            [64usize, 9408, 32768, 1 << 20, 1 << 24]
                .iter()
                .map(|&n| s.auto_choice(n).unwrap().0)
                .collect::<Vec<_>>()
        });
        let m = model_args(
            crate::cost::engine_candidates(
                crate::dense::AllreduceAlgo::Rabenseifner,
                SparseExchange::Allgather,
                quant,
                false,
            )
            .iter()
            .map(|id| id.name())
            .collect::<Vec<_>>()
            .join(","),
        );
        let mut kinds = std::collections::BTreeSet::new();
        for (i, &n) in [64usize, 9408, 32768, 1 << 20, 1 << 24].iter().enumerate() {
            let rec = crate::cost::records::predict_record(&prof, &m, n, 4, 0.001).unwrap();
            let id: crate::cost::StrategyId = rec.choice.parse().unwrap();
            let want = id
                .engine_strategy(0.001, crate::codec::RgcMethod::Trimmed)
                .unwrap();
            for (r, choices) in out.iter().enumerate() {
                assert_eq!(choices[i], want, "n={n} rank {r} quant={quant}");
            }
            kinds.insert(rec.choice);
        }
        assert!(kinds.len() >= 2, "the sizes span a crossover: {kinds:?}");
    }
}

/// Issue #13: a table of `Auto` layers is planned as a whole, by the step
/// model: after the first step the engine runs exactly `gradsync plan`'s
/// per-layer choice for the same table and profile (ResNet-50's table at
/// p = 4 on a 1.25 GB/s network with a per-layer selection cost, where the
/// small vectors join the dense group and the rest the sparse one), and a
/// layer table mixing fixed and `Auto` layers keeps the fixed ones.
#[cfg(feature = "cli")]
#[test]
fn auto_layers_run_the_plan_of_the_whole_table() {
    use crate::cost::{LinearFit, Profile};
    let mut prof = Profile::from_network(5e-6, 1.25e9, 0.0, 0.0).unwrap();
    prof.select
        .insert("trimmed".into(), LinearFit { a: 2e-5, b: 1e-9 });
    let file =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/layers/resnet50.json");
    let layers = crate::cost::records::read_layers(&file).unwrap();
    // Only the first 40 layers: the test allocates them on 4 in-process ranks.
    let layers: Vec<_> = layers.into_iter().take(40).collect();
    let mut m = model_args("dense-rabenseifner,sparse-allgather".into());
    // The engine's threshold: the small layers stay dense in both.
    m.compress_threshold = cfg().compress_threshold;
    let rec = crate::cost::records::plan_record(&prof, &m, &layers, 4, 0.001).unwrap();
    let want: Vec<Strategy> = rec
        .layers
        .iter()
        .map(|l| {
            l.choice
                .parse::<crate::cost::StrategyId>()
                .unwrap()
                .engine_strategy(0.001, crate::codec::RgcMethod::Trimmed)
                .unwrap()
        })
        .collect();
    assert!(want.contains(&Strategy::Dense) && want.iter().any(|s| s != &Strategy::Dense));
    let (prof2, layers2) = (prof.clone(), layers.clone());
    let out = LocalComm::run(4, move |c| {
        let cfg = Config {
            profile: Some(prof2.clone()),
            ..cfg()
        };
        let mut s = GradSync::with_transport(c, cfg).unwrap();
        // One layer fixed sparse, one fixed dense, the rest Auto.
        for (i, l) in layers2.iter().enumerate() {
            let st = match i {
                1 => Strategy::rgc(0.01),
                3 => Strategy::Dense,
                _ => Strategy::Auto,
            };
            s.register_with(&l.name, &[l.elements], st).unwrap();
        }
        assert_eq!(s.layer(LayerId(0)).unwrap().2, &Strategy::Auto);
        let mut g: Vec<Vec<f32>> = layers2.iter().map(|l| vec![0.01; l.elements]).collect();
        let mut views: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
        s.sync(&mut views).unwrap();
        let plan = s.auto_plan().expect("a plan").clone();
        let got: Vec<Strategy> = (0..layers2.len())
            .map(|i| s.layer(LayerId(i)).unwrap().2.clone())
            .collect();
        (got, plan)
    });
    for (r, (got, plan)) in out.iter().enumerate() {
        assert_eq!(got[1], Strategy::rgc(0.01), "rank {r}");
        assert_eq!(got[3], Strategy::Dense, "rank {r}");
        assert!(!plan.layers[1].auto && !plan.layers[3].auto);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if i != 1 && i != 3 {
                assert_eq!(g, w, "rank {r} layer {i} ({})", layers[i].name);
            }
        }
        assert_eq!(plan, &out[0].1, "every rank has the same plan");
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
            for step in 0..9u64 {
                let mut a = grad(rank, step, 0, 10);
                let mut b = grad(rank, step, 1, 1000);
                let st = s.sync(&mut [&mut a[..], &mut b[..]]).expect("sync").clone();
                let plan = plan::plan_step(step, &c, p, &s.table);
                assert_eq!(s.plan, plan, "step {step}");
                assert_eq!(st.communicated, plan.communicates, "step {step}");
                for (l, lp) in st.layers.iter().zip(&plan.layers) {
                    let want = match lp.mode {
                        Mode::Dense => "dense",
                        Mode::Sparse => "sparse",
                        Mode::Local => "local",
                        Mode::Gradiveq => "gradiveq",
                        Mode::Other => unreachable!("a whole step plans every layer"),
                    };
                    assert_eq!(l.strategy, want, "step {step} layer {}", l.name);
                }
                if plan.layers[1].mode == Mode::Sparse {
                    let d = plan.layers[1].density.expect("rgc has a density");
                    assert_eq!(s.layers[1].cur_density, Some(d), "step {step}");
                    // Trimmed top-k sends about that fraction.
                    let sent = st.layers[1].density;
                    assert!(sent > 0.0 && sent <= 1.5 * d, "step {step}: {sent} vs {d}");
                }
            }
        });
    }
}

/// Issue #15: the table of the sparse-exchange tests: a dense layer, RGC
/// (trimmed and threshold) and quantized RGC layers (reduced with
/// `sparse_exchange = allreduce`), an fp16 layer (always in the fused
/// message), an empty layer, a layer whose gradient is zero on every rank
/// (empty or all-zero selections) and one zero on even ranks.
fn exchange_table() -> Vec<(&'static str, usize, Strategy)> {
    let sp = |c: &str| Strategy::Sparse {
        codec: c.parse().expect("codec"),
        density: None,
    };
    vec![
        ("bias", 10, Strategy::Dense),
        ("rgc", 1000, Strategy::rgc(0.05)),
        ("quant", 700, sp("rgc-quant:density=0.05")),
        ("fp16", 300, sp("fp16")),
        ("zero", 400, Strategy::rgc(0.05)),
        ("empty", 0, Strategy::rgc(0.05)),
        ("thr", 2000, sp("rgc:density=0.01,method=threshold")),
        ("zero-on-even", 300, Strategy::rgc(0.1)),
    ]
}

/// Layer `l`'s gradient: small integers (exact sums in any order) or
/// uniform floats.
fn exchange_grad(int: bool, rank: usize, step: u64, l: usize, name: &str, n: usize) -> Vec<f32> {
    if name == "zero" || (name == "zero-on-even" && rank % 2 == 0) {
        return vec![0.0; n];
    }
    if !int {
        return grad(rank, step, l, n);
    }
    (0..n)
        .map(|i| ((i * 31 + rank * 17 + step as usize * 7 + l * 3) % 23) as f32 - 11.0)
        .collect()
}

/// One rank's record of a step: output bits, per layer (reduced this
/// step, indices of this rank's unit), the step's stats.
type ExchangeStep = (Vec<Vec<u32>>, Vec<(bool, Vec<usize>)>, StepStats);

/// `steps` steps of the exchange table at `p` ranks; per rank every step's
/// record and the residuals' bits at the end.
fn run_exchange(
    p: usize,
    cfg: &Config,
    int: bool,
    steps: u64,
) -> Vec<(Vec<ExchangeStep>, Vec<Vec<u32>>)> {
    run_exchange_table(p, cfg, int, steps, &exchange_table())
}

/// [`run_exchange`] of another table.
fn run_exchange_table(
    p: usize,
    cfg: &Config,
    int: bool,
    steps: u64,
    table: &[(&'static str, usize, Strategy)],
) -> Vec<(Vec<ExchangeStep>, Vec<Vec<u32>>)> {
    LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg.clone()).expect("engine");
        let ids: Vec<LayerId> = table
            .iter()
            .map(|(n, len, st)| s.register_with(n, &[*len], st.clone()).expect("register"))
            .collect();
        let mut rec = Vec::new();
        for step in 0..steps {
            let mut g: Vec<Vec<f32>> = table
                .iter()
                .enumerate()
                .map(|(l, (name, n, _))| exchange_grad(int, rank, step, l, name, *n))
                .collect();
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            let st = s.sync(&mut v).expect("sync").clone();
            let units = ids
                .iter()
                .map(|&id| {
                    let l = &s.layers[id.0];
                    let mut idx = Vec::new();
                    let unit = s.last_unit(id);
                    if let Some(c) = l.codec.as_deref().filter(|_| !unit.is_empty()) {
                        c.for_each_sent(unit, l.n, &mut |i, _| idx.push(i))
                            .expect("own unit");
                    }
                    (s.plan.layers[id.0].reduced, idx)
                })
                .collect();
            let bits = g
                .iter()
                .map(|x| x.iter().map(|v| v.to_bits()).collect())
                .collect();
            rec.push((bits, units, st));
        }
        let res = ids
            .iter()
            .map(|&id| {
                s.residual(id)
                    .map_or_else(Vec::new, |r| r.iter().map(|v| v.to_bits()).collect())
            })
            .collect();
        (rec, res)
    })
}

/// Issue #15: `sparse_exchange = allreduce` gives bitwise the outputs and
/// residuals of the fused allgatherv, for RGC / quantized RGC / fp16 /
/// dense layers together, empty selections, momentum (plain, Nesterov),
/// communication delay and both warm-ups, at p = 1, 2, 3, 5, with the
/// step overlapped or not; the stats report the sparse allreduce's
/// distinct indices (the union of every rank's selections) and leave the
/// reduced layers out of the fused message.
#[test]
fn allreduce_exchange_equals_the_allgather_bitwise() {
    let configs = [
        Config {
            momentum: 0.5,
            ..cfg()
        },
        Config {
            momentum: 0.9,
            nesterov: true,
            warmup: Warmup::Density {
                schedule: vec![0.25, 0.1],
                steps_per_stage: 1,
            },
            overlap: true,
            ..cfg()
        },
        Config {
            delay: 2,
            momentum: 0.5,
            warmup: Warmup::Dense { steps: 2 },
            ..cfg()
        },
    ];
    let table = exchange_table();
    for (ci, base) in configs.iter().enumerate() {
        for p in [1, 2, 3, 4, 5] {
            // Integers as the issue asks; uniform floats too (the pairs are
            // scaled before the sum, which adds in rank order: equal bits).
            for int in [true, false] {
                let steps = 5;
                let gather = run_exchange(p, base, int, steps);
                let reduce_cfg = Config {
                    sparse_exchange: SparseExchange::Allreduce,
                    ..base.clone()
                };
                let reduce = run_exchange(p, &reduce_cfg, int, steps);
                let at =
                    |r: usize, t: usize| format!("config {ci} p={p} int={int} rank {r} step {t}");
                let mut reduced_steps = 0;
                for r in 0..p {
                    let ((ga, gres), (ra, rres)) = (&gather[r], &reduce[r]);
                    for t in 0..steps as usize {
                        for (l, (name, _, _)) in table.iter().enumerate() {
                            assert!(ga[t].0[l] == ra[t].0[l], "{} layer {name}", at(r, t));
                        }
                        let (gs, rs) = (&ga[t].2, &ra[t].2);
                        assert_eq!((gs.sparse_reduce_nnz, gs.sparse_reduce_s), (0, 0.0));
                        assert_eq!(gs.communicated, rs.communicated);
                        // Every rank's union of the reduced layers' indices.
                        let want: usize = table
                            .iter()
                            .enumerate()
                            .filter(|(l, _)| ra[t].1[*l].0)
                            .map(|(l, _)| {
                                let mut all: Vec<usize> =
                                    reduce.iter().flat_map(|x| x.0[t].1[l].1.clone()).collect();
                                all.sort_unstable();
                                all.dedup();
                                all.len()
                            })
                            .sum();
                        assert_eq!(rs.sparse_reduce_nnz, want, "{}", at(r, t));
                        let reduced = ra[t].1.iter().filter(|u| u.0).count();
                        if reduced > 0 {
                            reduced_steps += 1;
                            // 6 reduced layers; the fused message holds fp16 only.
                            assert_eq!(reduced, 6, "{}", at(r, t));
                            assert!(want > 0, "{}", at(r, t));
                            assert!(rs.fused_bytes < gs.fused_bytes, "{}", at(r, t));
                        } else {
                            assert_eq!(rs.fused_bytes, gs.fused_bytes, "{}", at(r, t));
                        }
                        assert_eq!(gs.dense_bytes, rs.dense_bytes);
                    }
                    assert_eq!(
                        gres, rres,
                        "config {ci} p={p} int={int} rank {r}: residuals"
                    );
                }
                assert!(reduced_steps > 0, "config {ci}: some step reduces");
            }
        }
    }
}

/// Issue #15: NaN/Inf in a reduced layer on some ranks behaves as in the
/// fused allgatherv: the same error naming the lowest such rank (or NaN
/// with `Propagate`), the other layers written, residuals not poisoned,
/// bitwise the same outputs, and the next step runs — with and without
/// dense and fused layers beside it (the status allreduce carries the
/// marker either way).
#[test]
fn non_finite_reduced_layers_behave_as_in_the_allgather() {
    let run = |p: usize, cfg: Config, with_others: bool| {
        LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, cfg.clone()).expect("engine");
            let mut table = vec![
                ("a", 400, Strategy::rgc(0.05)),
                (
                    "q",
                    300,
                    Strategy::Sparse {
                        codec: "rgc-quant:density=0.05".parse().expect("codec"),
                        density: None,
                    },
                ),
            ];
            if with_others {
                table.push(("d", 8, Strategy::Dense));
                table.push((
                    "h",
                    50,
                    Strategy::Sparse {
                        codec: "fp16".parse().expect("codec"),
                        density: None,
                    },
                ));
            }
            for (n, len, st) in &table {
                s.register_with(n, &[*len], st.clone()).expect("register");
            }
            let mut out = Vec::new();
            for step in 0..2u64 {
                let mut g: Vec<Vec<f32>> = table
                    .iter()
                    .enumerate()
                    .map(|(l, t)| exchange_grad(true, rank, step, l, t.0, t.1))
                    .collect();
                if step == 0 {
                    // Layer "q" non-finite on ranks 1 and 3 (when present).
                    if rank == 1 {
                        g[1][5] = f32::NAN;
                    }
                    if rank == 3 {
                        g[1][0] = f32::INFINITY;
                    }
                }
                let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
                let r = s.sync(&mut v).map(|_| ()).map_err(|e| e.to_string());
                let finite = (0..2).all(|l| {
                    s.residual(LayerId(l))
                        .expect("sparse")
                        .iter()
                        .all(|x| x.is_finite())
                });
                let bits: Vec<Vec<u32>> = g
                    .iter()
                    .map(|x| x.iter().map(|v| v.to_bits()).collect())
                    .collect();
                out.push((r, bits, finite));
            }
            out
        })
    };
    for policy in [NonFinitePolicy::Error, NonFinitePolicy::Propagate] {
        for with_others in [true, false] {
            for p in [2, 4] {
                let base = Config {
                    non_finite: policy,
                    momentum: 0.5,
                    ..cfg()
                };
                let gather = run(p, base.clone(), with_others);
                let reduce = run(
                    p,
                    Config {
                        sparse_exchange: SparseExchange::Allreduce,
                        ..base
                    },
                    with_others,
                );
                let at = format!("{policy:?} others={with_others} p={p}");
                assert_eq!(gather, reduce, "{at}");
                for rank_out in &reduce {
                    let (r, bits, finite) = &rank_out[0];
                    assert!(finite, "{at}: residual not poisoned");
                    match policy {
                        NonFinitePolicy::Error => {
                            let e = r.as_ref().expect_err("every rank fails");
                            assert!(e.contains("\"q\"") && e.contains("rank 1"), "{at}: {e}");
                        }
                        NonFinitePolicy::Propagate => {
                            r.as_ref().expect("no error");
                            assert!(bits[1].iter().all(|&x| f32::from_bits(x).is_nan()));
                            assert!(bits[0].iter().all(|&x| f32::from_bits(x).is_finite()));
                        }
                    }
                    // The next step runs normally.
                    let (r, bits, _) = &rank_out[1];
                    assert!(r.is_ok(), "{at}: {r:?}");
                    assert!(bits
                        .iter()
                        .flatten()
                        .all(|&x| f32::from_bits(x).is_finite()));
                }
            }
        }
    }
}

/// Issue #15: a local-phase failure on one rank (a gradient of the wrong
/// length) is the same `RankFailed` on every rank with the sparse
/// allreduce as with the allgather, before the sparse allreduce (no rank
/// enters it alone); nothing is lost and the next step runs.
#[test]
fn a_local_failure_fails_every_rank_before_the_sparse_allreduce() {
    for overlap in [false, true] {
        for with_dense in [false, true] {
            let run = |exchange: SparseExchange| {
                LocalComm::run(3, |c| {
                    let rank = c.rank();
                    let cfg = Config {
                        overlap,
                        sparse_exchange: exchange,
                        ..cfg()
                    };
                    let mut s = GradSync::with_transport(c, cfg).expect("engine");
                    let sp = s.register_with("w", &[1000], Strategy::rgc(0.01)).unwrap();
                    s.register_with("v", &[500], Strategy::rgc(0.02)).unwrap();
                    if with_dense {
                        s.register_with("b", &[10], Strategy::Dense).unwrap();
                    }
                    let g = |step: usize, n: usize| -> Vec<f32> {
                        (0..n)
                            .map(|i| ((i * 31 + rank * 7 + step) % 101) as f32 - 50.0)
                            .collect()
                    };
                    let mut steps = Vec::new();
                    for step in 0..3 {
                        let bad = step == 1 && rank == 1;
                        let mut w = g(step, if bad { 999 } else { 1000 });
                        let mut v = g(step + 5, 500);
                        let mut b = [1.0f32; 10];
                        let mut views: Vec<&mut [f32]> = vec![&mut w[..], &mut v[..]];
                        if with_dense {
                            views.push(&mut b[..]);
                        }
                        let r = s.sync(&mut views).map(|_| ()).map_err(|e| e.to_string());
                        steps.push((r, w, v, s.residual(sp).unwrap().to_vec()));
                    }
                    steps
                })
            };
            let gather = run(SparseExchange::Allgather);
            let reduce = run(SparseExchange::Allreduce);
            assert_eq!(gather, reduce, "overlap={overlap} dense={with_dense}");
            for r in &reduce {
                let e = r[1].0.as_ref().expect_err("every rank fails");
                assert!(
                    e.starts_with("rank 1 failed in step 1: ") && e.contains("999 elements"),
                    "{e}"
                );
                assert!(r[0].0.is_ok() && r[2].0.is_ok(), "the other steps run");
            }
        }
    }
}

/// Issue #15: `sparse_exchange = auto` chooses the exchange every step by
/// the cost model: bitwise the allgather engine's outputs and residuals
/// whatever it picks (the in-process transport has no nodes, so never the
/// node-aware one); the allgatherv at 1 to 3 ranks, the sparse allreduce
/// from 4 ranks on (a layer at density 0.5 whose sum is nearly dense); the
/// stats name the exchange of every step and carry the fill estimate
/// (the moving average of `nnz/(p·k)`, `k` the nominal pairs) from the
/// first step on, whichever exchange ran it (the allgatherv's steps count
/// the group's nonzero results).
#[test]
fn auto_exchange_equals_the_allgather_bitwise_and_reports_its_choice() {
    let sp = |c: &str| Strategy::Sparse {
        codec: c.parse().expect("codec"),
        density: None,
    };
    let table = vec![
        ("bias", 10, Strategy::Dense),
        ("a", 2500, Strategy::rgc(0.5)),
        ("q", 500, sp("rgc-quant:density=0.2")),
        ("h", 300, sp("fp16")),
        ("e", 0, Strategy::rgc(0.3)),
    ];
    // Nominal pairs per rank: 1250 + 100 + 0.
    let k = 1350.0;
    let prof = crate::cost::Profile::from_network(1e-9, 1e9, 0.0, 0.0).expect("profile");
    let base = Config {
        momentum: 0.5,
        profile: Some(prof),
        ..cfg()
    };
    let auto = Config {
        sparse_exchange: SparseExchange::Auto,
        ..base.clone()
    };
    let steps = 4;
    for p in [1, 2, 3, 4, 5] {
        for int in [true, false] {
            let gather = run_exchange_table(p, &base, int, steps, &table);
            let chosen = run_exchange_table(p, &auto, int, steps, &table);
            for r in 0..p {
                let ((ga, gres), (ca, cres)) = (&gather[r], &chosen[r]);
                let mut fill: Option<f64> = None;
                for t in 0..steps as usize {
                    let at = format!("p={p} int={int} rank {r} step {t}");
                    assert_eq!(ga[t].0, ca[t].0, "{at}: outputs");
                    let (gs, cs) = (&ga[t].2, &ca[t].2);
                    assert_eq!(gs.sparse_exchange, "allgather", "{at}");
                    assert_eq!(gs.fill_estimate, None, "{at}");
                    // The first step prices independent selections; later
                    // ones the measured fill (random data: about the same).
                    let want = if p >= 3 { "allreduce" } else { "allgather" };
                    assert_eq!(cs.sparse_exchange, want, "{at}");
                    let red = cs.sparse_exchange == "allreduce";
                    let reduced: Vec<bool> = ca[t].1.iter().map(|u| u.0).collect();
                    assert_eq!(
                        reduced,
                        [false, red, red, false, red],
                        "{at}: reduced layers"
                    );
                    if red {
                        assert!(cs.sparse_reduce_nnz > 0, "{at}");
                        assert!(cs.fused_bytes < gs.fused_bytes, "{at}");
                    } else {
                        assert_eq!((cs.sparse_reduce_nnz, cs.fused_bytes), (0, gs.fused_bytes));
                    }
                    // Every step measures the fill: the sparse allreduce's
                    // distinct indices, or the allgatherv's nonzero results
                    // of the group (random data: no sum is exactly zero).
                    let nnz = if red {
                        cs.sparse_reduce_nnz
                    } else {
                        [1, 2, 4]
                            .iter()
                            .map(|&l| {
                                ca[t].0[l]
                                    .iter()
                                    .filter(|&&b| f32::from_bits(b) != 0.0)
                                    .count()
                            })
                            .sum()
                    };
                    assert!(nnz > 0, "{at}");
                    let pf = p as f64;
                    let rho = (nnz as f64 / (pf * k)).clamp(1.0 / pf, 1.0);
                    fill = Some(fill.map_or(rho, |f| 0.5 * f + 0.5 * rho));
                    assert_eq!(cs.fill_estimate, fill, "{at}");
                    // Every rank made the same choice and estimate.
                    let r0 = &chosen[0].0[t].2;
                    assert_eq!(
                        (&r0.sparse_exchange, r0.fill_estimate),
                        (&cs.sparse_exchange, cs.fill_estimate),
                        "{at}"
                    );
                }
                assert_eq!(gres, cres, "p={p} int={int} rank {r}: residuals");
            }
        }
    }
}

/// Issue #15: the fill is learned on the allgatherv's steps too. Every
/// rank selects the same pairs (ρ = 1/p): before any measurement `auto`
/// prices independent selections and runs the allgatherv; that step's
/// unpacking counts `k` distinct results, and from then on the sparse
/// allreduce, whose traffic shrinks with the overlap, is chosen. Before,
/// a job that started on the allgatherv never measured the fill and
/// stayed there. Every rank chooses alike, with outputs bitwise the
/// configured allgatherv's.
#[test]
fn auto_exchange_learns_overlap_on_allgatherv_steps() {
    let (p, n, d) = (4, 30_000, 0.01);
    let k = crate::codec::rgc_k(d, n) as f64;
    let prof = crate::cost::Profile::from_network(1e-9, 1e9, 0.0, 0.0).expect("profile");
    let run = |exchange| {
        let cfg = Config {
            profile: Some(prof.clone()),
            sparse_exchange: exchange,
            ..cfg()
        };
        LocalComm::run(p, move |c| {
            let mut s = GradSync::with_transport(c, cfg.clone()).expect("engine");
            s.register_with("w", &[n], Strategy::rgc(d))
                .expect("register");
            (0..4u64)
                .map(|step| {
                    // The same gradient on every rank: the same selection.
                    let mut g: Vec<f32> = (0..n)
                        .map(|i| ((i as u64 * 7919 + step * 104_729) % 1000) as f32 - 500.0)
                        .collect();
                    let st = s.sync(&mut [&mut g[..]]).expect("sync").clone();
                    (g, st.sparse_exchange, st.fill_estimate)
                })
                .collect::<Vec<_>>()
        })
    };
    let fixed = run(SparseExchange::Allgather);
    let auto = run(SparseExchange::Auto);
    let pf = p as f64;
    for r in 0..p {
        let names: Vec<&str> = auto[r].iter().map(|x| x.1.as_str()).collect();
        assert_eq!(
            names,
            ["allgather", "allreduce", "allreduce", "allreduce"],
            "rank {r}"
        );
        let first = auto[r][0]
            .2
            .expect("the allgatherv's step measures the fill");
        let nnz = auto[r][0].0.iter().filter(|&&x| x != 0.0).count() as f64;
        assert_eq!(first, (nnz / (pf * k)).clamp(1.0 / pf, 1.0), "rank {r}");
        assert!((first - 1.0 / pf).abs() < 0.01, "rank {r}: fill {first}");
        for t in 0..4 {
            assert_eq!(auto[r][t].0, fixed[r][t].0, "rank {r} step {t}: outputs");
            assert_eq!(auto[r][t].2, auto[0][t].2, "rank {r} step {t}: estimate");
        }
    }
}

/// Issue #15: `allreduce = "auto"` runs, every step, the dense algorithm
/// the cost model finds fastest for the step's dense group (here the ring
/// where Rabenseifner pays its fold, at 3 and 5 ranks, and Rabenseifner at
/// powers of two), with results bitwise the configured Rabenseifner's on
/// integer gradients; the stats name the algorithm; without a profile it
/// is the same error on every rank.
#[test]
fn auto_allreduce_follows_the_model_and_sums_alike() {
    let table = vec![
        ("w", 4000, Strategy::Dense),
        ("bias", 10, Strategy::Dense),
        ("a", 2500, Strategy::rgc(0.1)),
    ];
    let prof = crate::cost::Profile::from_network(1e-9, 1e9, 0.0, 0.0).expect("profile");
    let base = Config {
        momentum: 0.5,
        profile: Some(prof.clone()),
        ..cfg()
    };
    let auto = Config {
        allreduce: crate::dense::AllreduceAlgo::Auto,
        ..base.clone()
    };
    for p in [1, 2, 3, 4, 5] {
        let fixed = run_exchange_table(p, &base, true, 3, &table);
        let chosen = run_exchange_table(p, &auto, true, 3, &table);
        let want = match crate::cost::choose_dense_allreduce(&prof, 4.0 * 4010.0, p, None)
            .expect("choice")
            .id
        {
            crate::cost::StrategyId::DenseRing => "ring",
            _ => "rabenseifner",
        };
        if p == 3 || p == 5 {
            assert_eq!(want, "ring", "p={p}: the fold makes the ring cheaper");
        }
        for r in 0..p {
            for t in 0..3 {
                let at = format!("p={p} rank {r} step {t}");
                assert_eq!(fixed[r].0[t].0, chosen[r].0[t].0, "{at}: outputs");
                assert_eq!(fixed[r].0[t].2.allreduce, "rabenseifner", "{at}");
                assert_eq!(chosen[r].0[t].2.allreduce, want, "{at}");
            }
        }
    }
    let res = creation_errors(
        2,
        Config {
            allreduce: crate::dense::AllreduceAlgo::Auto,
            ..cfg()
        },
    );
    for e in &res {
        assert!(
            e.contains("allreduce \"auto\"") && e.contains("profile"),
            "{e}"
        );
    }
    assert_eq!(
        "auto".parse::<crate::dense::AllreduceAlgo>().unwrap(),
        crate::dense::AllreduceAlgo::Auto
    );
    // The library's allreduce refuses it (every rank alike, no traffic).
    let e = LocalComm::run(2, |c| {
        let mut x = vec![1f32; 4];
        crate::dense::allreduce(
            &c,
            &mut x,
            crate::dense::AllreduceAlgo::Auto,
            &crate::dense::AllreduceOptions::default(),
        )
        .unwrap_err()
        .to_string()
    });
    assert!(e.iter().all(|e| e.contains("per-step choice")), "{e:?}");
}

/// Issue #15: `auto` needs a profile: without one, the same error on
/// every rank at creation; with one, the in-process transport (no nodes)
/// is accepted (auto then never picks the node-aware exchange).
#[test]
fn auto_exchange_needs_a_profile_on_every_rank() {
    let res = creation_errors(
        3,
        Config {
            sparse_exchange: SparseExchange::Auto,
            ..cfg()
        },
    );
    for e in &res {
        assert!(e.contains("\"auto\"") && e.contains("profile"), "{e}");
    }
    let ok = LocalComm::run(2, |c| {
        let cfg = Config {
            sparse_exchange: SparseExchange::Auto,
            profile: Some(crate::cost::Profile::from_network(1e-6, 1e9, 0.0, 0.0).unwrap()),
            ..cfg()
        };
        GradSync::with_transport(c, cfg).map(|s| s.fill_estimate())
    });
    for r in ok {
        assert_eq!(r.expect("created"), None);
    }
}

/// Issue #15: the option as JSON and text; `hierarchical` is refused on
/// every rank until the node-aware sparse allreduce is built in.
#[test]
fn sparse_exchange_option_parses_and_hierarchical_needs_nodes() {
    for (name, want) in [
        ("allgather", SparseExchange::Allgather),
        ("allreduce", SparseExchange::Allreduce),
        ("hierarchical", SparseExchange::Hierarchical),
        ("auto", SparseExchange::Auto),
    ] {
        assert_eq!(name.parse::<SparseExchange>().unwrap(), want);
        assert_eq!(want.name(), name);
        let c = Config::from_options_json(&format!(r#"{{"sparse_exchange": "{name}"}}"#)).unwrap();
        assert_eq!(c.sparse_exchange, want);
        // JSON round trip.
        let back: Config = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
    let e = "ring".parse::<SparseExchange>().unwrap_err().to_string();
    assert!(e.contains("auto"), "the error lists every exchange: {e}");
    let e = Config::from_options_json(r#"{"sparse_exchange": "tree"}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"sparse_exchange\""), "{e}");
    // The default is left out of the JSON: the options hash (and the
    // snapshots that record it) are what they were before the option.
    let json = serde_json::to_string(&Config::default()).unwrap();
    assert!(!json.contains("sparse_exchange"), "{json}");
    // Hierarchical needs the ranks' nodes, which the in-process transport
    // does not have: the same error on every rank, at creation.
    let res = creation_errors(
        2,
        Config {
            sparse_exchange: SparseExchange::Hierarchical,
            ..cfg()
        },
    );
    for e in &res {
        assert!(
            e.contains("\"hierarchical\"") && e.contains("needs the ranks' nodes"),
            "{e}"
        );
    }
    // Different exchanges on different ranks: the options differ.
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let cfg = Config {
            sparse_exchange: if rank == 0 {
                SparseExchange::Allgather
            } else {
                SparseExchange::Allreduce
            },
            ..cfg()
        };
        GradSync::with_transport(c, cfg)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(
        res.iter().all(|r| r.as_ref().is_err_and(
            |e| e.contains("arguments differ across ranks: engine options (every rank must pass the same): rank 1 has sparse_exchange = \"allreduce\" (rank 0: default)")
        )),
        "{res:?}"
    );
    // On 3 ranks, the last one's threshold and profile: both named (the
    // profile by name only), the same text on every rank.
    let res = LocalComm::run(3, |c| {
        let last = c.rank() == 2;
        let cfg = Config {
            compress_threshold: if last { 7 } else { 9 },
            profile: last
                .then(|| crate::cost::Profile::from_network(1e-6, 1e9, 0.0, 0.0).expect("profile")),
            ..cfg()
        };
        GradSync::with_transport(c, cfg)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let e = res[0].clone().expect_err("options differ");
    assert!(
        e.contains("rank 2 has compress_threshold = 7 (rank 0: 9), a different profile"),
        "{e}"
    );
    assert!(res.iter().all(|r| r.as_ref().err() == Some(&e)), "{res:?}");
}

/// The in-process transport with a node map, ranks in blocks of `per`
/// (what `MpiComm::node_ids` reports on a multi-node job).
struct Noded {
    inner: LocalComm,
    per: usize,
}

impl crate::comm::Transport for Noded {
    type Request = <LocalComm as crate::comm::Transport>::Request;
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send<T: crate::comm::Elem>(
        &self,
        buf: &[T],
        dest: usize,
        tag: crate::comm::Tag,
    ) -> Result<()> {
        self.inner.send(buf, dest, tag)
    }
    fn recv<T: crate::comm::Elem>(
        &self,
        buf: &mut [T],
        src: usize,
        tag: crate::comm::Tag,
    ) -> Result<()> {
        self.inner.recv(buf, src, tag)
    }
    fn sendrecv<T: crate::comm::Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: crate::comm::Tag,
    ) -> Result<()> {
        self.inner.sendrecv(send, dest, recv, src, tag)
    }
    unsafe fn isend<T: crate::comm::Elem>(
        &self,
        buf: &[T],
        dest: usize,
        tag: crate::comm::Tag,
    ) -> Result<Self::Request> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.isend(buf, dest, tag) }
    }
    unsafe fn irecv<T: crate::comm::Elem>(
        &self,
        buf: &mut [T],
        src: usize,
        tag: crate::comm::Tag,
    ) -> Result<Self::Request> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.irecv(buf, src, tag) }
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn abort(&self, code: i32, msg: &str) -> ! {
        self.inner.abort(code, msg)
    }
    fn node_ids(&self) -> Option<Vec<usize>> {
        Some((0..self.size()).map(|r| r / self.per).collect())
    }
}

/// A two-level profile: shared memory at 3 µs and 2.5 GB/s inside a node,
/// a 1 Gbit/s link at 30 µs between nodes.
fn slow_link_profile() -> crate::cost::Profile {
    let mut prof = crate::cost::Profile::from_network(3e-6, 2.5e9, 0.0, 0.0).expect("profile");
    prof.inter_node = Some(crate::cost::NetLevel {
        alpha: 3e-5,
        beta: 1.0 / 1.25e8,
        beta_curve: Vec::new(),
        oneway_curve: Vec::new(),
        burst: None,
    });
    prof
}

/// `steps` synced steps of `table` under `cfg` on `p` in-process ranks
/// placed `per` a node ([`Noded`]; `exchange_grad` gradients, integers
/// with `int`): each rank's gradients after each step and its stats.
fn run_on_nodes(
    p: usize,
    per: usize,
    cfg: &Config,
    table: &[(&'static str, usize, Strategy)],
    steps: u64,
    int: bool,
) -> Vec<Vec<(Vec<Vec<f32>>, StepStats)>> {
    LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(Noded { inner: c, per }, cfg.clone()).expect("engine");
        for (n, len, st) in table {
            s.register_with(n, &[*len], st.clone()).expect("register");
        }
        let mut out = Vec::new();
        for step in 0..steps {
            let mut g: Vec<Vec<f32>> = table
                .iter()
                .enumerate()
                .map(|(l, (name, n, _))| exchange_grad(int, rank, step, l, name, *n))
                .collect();
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            let st = s.sync(&mut v).expect("sync").clone();
            out.push((g, st));
        }
        out
    })
}

/// Issue #15: with the ranks' nodes known and a two-level profile whose
/// link between nodes is slow, `auto` runs the node-aware sparse
/// allreduce (2 nodes of 2 ranks): the same results as the allgather
/// engine (exactly, for integer gradients: the node-by-node sum is exact),
/// the stats name it and measure the fill; on one node it never does.
#[test]
fn auto_exchange_goes_node_aware_across_slow_nodes() {
    let prof = slow_link_profile();
    let table = vec![
        ("bias", 10, Strategy::Dense),
        ("a", 20_000, Strategy::rgc(0.2)),
        ("b", 5000, Strategy::rgc(0.2)),
    ];
    let run = |exchange: SparseExchange, per: usize| {
        let cfg = Config {
            sparse_exchange: exchange,
            profile: Some(prof.clone()),
            ..cfg()
        };
        run_on_nodes(4, per, &cfg, &table, 3, true)
    };
    let gather = run(SparseExchange::Allgather, 2);
    let nodes = run(SparseExchange::Auto, 2);
    let one = run(SparseExchange::Auto, 4);
    for r in 0..4 {
        for t in 0..3 {
            let at = format!("rank {r} step {t}");
            let (g, _) = &gather[r][t];
            let (a, st) = &nodes[r][t];
            assert_eq!(g, a, "{at}: results");
            // Node-aware: the sparse allreduce, or the fused allgatherv
            // (`allgather = "auto"`) with its node blocks.
            assert!(
                st.sparse_exchange == "hierarchical"
                    || (st.sparse_exchange == "allgather" && st.allgather == "node"),
                "{at}: {} / {}",
                st.sparse_exchange,
                st.allgather
            );
            // The fill is measured either way (the allgatherv's unpacking
            // counts it); a sparse allreduce reports its result's indices.
            assert!(st.fill_estimate.is_some(), "{at}");
            assert!(
                st.sparse_reduce_nnz > 0 || st.sparse_exchange == "allgather",
                "{at}"
            );
            let (o, st1) = &one[r][t];
            assert_eq!(g, o, "{at}: one node");
            assert_ne!(st1.sparse_exchange, "hierarchical", "{at}: one node");
            assert_ne!(st1.allgather, "node", "{at}: one node");
        }
    }
}

/// Issue #15: `Strategy::Auto` layers under `sparse_exchange = auto` are
/// planned among the dense group, the allgatherv and the sparse allreduce
/// (never the node-aware one without nodes), run, and report their
/// exchange every step.
#[test]
fn auto_layers_with_auto_exchange_plan_and_run() {
    let prof = crate::cost::Profile::from_network(1e-9, 1e9, 0.0, 0.0).expect("profile");
    let res = LocalComm::run(4, |c| {
        let rank = c.rank();
        let cfg = Config {
            sparse_exchange: SparseExchange::Auto,
            profile: Some(prof.clone()),
            auto_density: 0.5,
            ..cfg()
        };
        let mut s = GradSync::with_transport(c, cfg).expect("engine");
        s.register("w", &[4000]).expect("register");
        s.register("b", &[8]).expect("register");
        let mut seen = Vec::new();
        for step in 0..3 {
            let mut w = grad(rank, step, 0, 4000);
            let mut b = grad(rank, step, 1, 8);
            let st = s.sync(&mut [&mut w[..], &mut b[..]]).expect("sync");
            seen.push(st.sparse_exchange.clone());
        }
        let plan = s.auto_plan().expect("planned").clone();
        (seen, plan.choices().map(|(_, id)| id).collect::<Vec<_>>())
    });
    for (seen, choices) in &res {
        assert_eq!(
            (seen, choices),
            (&res[0].0, &res[0].1),
            "alike on every rank"
        );
        assert!(
            !choices.contains(&crate::cost::StrategyId::SparseHierarchical),
            "{choices:?}"
        );
        assert!(
            seen.iter().all(|e| e == "allgather" || e == "allreduce"),
            "{seen:?}"
        );
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
                        s.sync(&mut [&mut a[..], &mut b[..]]).map(|_| ())
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
                for (a, b) in w.iter().zip(&res[0].0) {
                    for (x, y) in a.iter().zip(b) {
                        assert!(
                            (x - y).abs() < 1e-4,
                            "fail at {fail_at}, m {momentum}: rank {r} {x} vs rank 0 {y}"
                        );
                    }
                }
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
                let r = s.sync(&mut [&mut a[..], &mut b[..]]).map(|_| ());
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
            for (a, b) in w.iter().zip(&res[0].0) {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() < 1e-4, "{policy:?}: rank {r} {x} vs {y}");
                }
            }
        }
    }
}

/// Snapshots from different steps on different ranks (one stale file) are
/// refused on every rank, naming the file, and change no engine: restored
/// as they were, dense layers would drift apart with no error at all.
#[test]
fn snapshots_from_different_steps_are_refused_everywhere() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("d", &[16]).expect("dense");
        let mut snaps = Vec::new();
        for step in 0..3 {
            snaps.push(s.snapshot_bytes().expect("snapshot"));
            let mut g = grad(rank, step, 0, 16);
            s.sync(&mut [&mut g[..]]).expect("sync");
        }
        let before = s.snapshot_bytes().expect("snapshot");
        let pick = if rank == 2 { &snaps[1] } else { &snaps[2] };
        let e = s.restore_bytes(pick).expect_err("steps differ").to_string();
        let unchanged = s.snapshot_bytes().expect("snapshot") == before;
        // The same step everywhere restores.
        s.restore_bytes(&snaps[1]).expect("same step");
        (e, unchanged, s.step)
    });
    for (r, (e, unchanged, step)) in res.iter().enumerate() {
        assert!(
            e.contains("snapshots from different steps") && e.contains("the snapshot"),
            "rank {r}: {e}"
        );
        assert!(unchanged, "rank {r}: the engine changed");
        assert_eq!(*step, 1, "rank {r}");
    }
}

/// Snapshots of two runs at the same step (rank 1's from another job)
/// passed every check, and the dense layers' momentum drifted apart with no
/// error: the run's identity, agreed at creation and kept in the file, is
/// compared with the step. A restore starts a branch of the loaded run
/// (its identity mixed with the restoring job's), so two jobs restored
/// from the same files write different identities.
#[test]
fn snapshots_of_different_runs_are_refused_everywhere() {
    fn engine(c: LocalComm) -> GradSync<LocalComm> {
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("d", &[16]).expect("dense");
        s
    }
    let run = |seed: usize| {
        LocalComm::run(2, move |c| {
            let rank = c.rank();
            let mut s = engine(c);
            for step in 0..2 {
                let mut g = grad(rank + seed, step, 0, 16);
                s.sync(&mut [&mut g[..]]).expect("sync");
            }
            s.snapshot_bytes().expect("snapshot")
        })
    };
    let (a, b) = (run(0), run(7));
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = engine(c);
        let mixed = if rank == 0 { &a[0] } else { &b[1] };
        s.restore_bytes(mixed).expect_err("runs differ").to_string()
    });
    for (r, e) in res.iter().enumerate() {
        assert!(
            e.contains("snapshots from different steps or runs"),
            "rank {r}: {e}"
        );
    }
    // Two jobs restored from the same files, one step each: their step-3
    // snapshots are of different runs (each job is a branch of its own).
    let branch = || {
        LocalComm::run(2, |c| {
            let rank = c.rank();
            let mut s = engine(c);
            s.restore_bytes(&a[rank]).expect("one run");
            let mut g = grad(rank, 2, 0, 16);
            s.sync(&mut [&mut g[..]]).expect("sync");
            s.snapshot_bytes().expect("snapshot")
        })
    };
    let (x, y) = (branch(), branch());
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = engine(c);
        let mixed = if rank == 0 { &x[0] } else { &y[1] };
        let e = s
            .restore_bytes(mixed)
            .expect_err("branches differ")
            .to_string();
        // One branch's own snapshots restore together.
        s.restore_bytes(&x[rank]).map(|()| (e, s.step))
    });
    for (r, got) in res.into_iter().enumerate() {
        let (e, step) = got.expect("one branch restores");
        assert!(
            e.contains("snapshots from different steps or runs"),
            "rank {r}: {e}"
        );
        assert_eq!(step, 3, "rank {r}");
    }
    // A format-3 file (no run identity; a valid checksum) is named by its
    // version, not reported as truncated.
    let mut old = a[0][..a[0].len() - 4 - 8].to_vec();
    old[8..12].copy_from_slice(&3u32.to_le_bytes());
    let crc = crc32fast::hash(&old);
    old.extend_from_slice(&crc.to_le_bytes());
    let res = LocalComm::run(1, |c| {
        engine(c)
            .restore_bytes(&old)
            .expect_err("format 3")
            .to_string()
    });
    assert!(
        res[0].contains("format version 3 (this build reads 4)"),
        "{}",
        res[0]
    );
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

/// `register` between `start` and `wait` (no progress thread) is a local
/// error on the rank that calls it; the step then finishes everywhere.
#[test]
fn register_inside_a_step_is_refused_locally() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                overlap: false,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("d", &[8]).expect("register");
        let mut g = grad(rank, 0, 0, 8);
        s.start(&[&g[..]]).expect("start");
        let late = if rank == 1 {
            Some(
                s.register("late", &[4])
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            )
        } else {
            None
        };
        s.wait(&mut [&mut g[..]]).expect("wait");
        let mut g = grad(rank, 1, 0, 8);
        s.sync(&mut [&mut g[..]]).expect("the next step");
        late
    });
    let e = res[1]
        .clone()
        .expect("rank 1 registered")
        .expect_err("refused");
    assert!(e.contains("before the first step"), "{e}");
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

/// GradiVeQ parameters and codec strings are checked whole at
/// registration, on every rank: a bad QSGD width or λ used to pass and
/// abort the job at the step that first used it (λ: `L_t` steps in), `d`
/// and `reuse` were clamped, and a parameter given twice kept the last.
#[test]
fn bad_gradiveq_parameters_and_repeated_keys_fail_registration() {
    for (spec, needle) in [
        ("gradiveq:k=64,lt=2,qsgd_bits=0", "qsgd_bits = 0"),
        ("gradiveq:k=64,lt=2,qsgd_bits=99", "qsgd_bits = 99"),
        ("gradiveq:k=64,lt=2,lambda=2", "lambda = 2"),
        ("gradiveq:k=64,lt=2,lambda=-1", "lambda = -1"),
        ("gradiveq:k=64,lt=2,d=0", "d = 0"),
        ("gradiveq:k=64,lt=2,d=100000", "d = 100000"),
        ("gradiveq:k=64,lt=2,reuse=0", "reuse = 0"),
        ("gradiveq:k=64,lt=2,reuse=1000000", "reuse = 1000000"),
        ("gradiveq:k=64,lt=2,lc=0", "lc = 0"),
        (
            "gradiveq:k=64,lt=2,loss_threshold=-5",
            "loss_threshold = -5",
        ),
        ("gradiveq:k=64,lt=2,k=32", "given twice"),
        ("gradiveq:k=64,d=4,lambda=0.1", "given twice"),
        ("rgc:density=0.1,density=0.5", "given twice"),
    ] {
        let res = LocalComm::run(2, |c| {
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            s.register_spec("L", &[4096], spec)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        for r in res {
            let e = r.expect_err(spec);
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }
    // The bounds themselves are accepted.
    let res = LocalComm::run(2, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register_spec("L", &[4096], "gradiveq:k=64,lt=2,d=64,reuse=64,qsgd_bits=8")
            .map(|_| ())
    });
    assert!(res.iter().all(Result::is_ok), "{res:?}");
}

/// [`first_overlap`]: a written buffer meets any other, a read one only a
/// written one, through a buffer that reaches past its neighbours too;
/// empty buffers and touching ends never overlap.
#[test]
fn first_overlap_finds_written_pairs_only() {
    // A long read buffer holds a short read one, then a written one.
    let spans = [(0, 100, false), (10, 10, false), (50, 10, true)];
    assert_eq!(first_overlap(&spans), Some((0, 2)));
    // Only read buffers, nested: fine.
    assert_eq!(first_overlap(&spans[..2]), None);
    // Written buffers that touch end to start, and an empty one inside.
    let spans = [(0, 8, true), (8, 8, true), (4, 0, true)];
    assert_eq!(first_overlap(&spans), None);
    // The same buffer twice, written: found, indices in order.
    assert_eq!(
        first_overlap(&[(64, 8, true), (0, 8, true), (64, 8, true)]),
        Some((0, 2))
    );
    assert_eq!(first_overlap(&[]), None);
}

/// Issue #15: `allgather = "auto"` (the default) runs the node-aware
/// allgatherv for the fused message where the cost model prices it below
/// the flat one (2 nodes of 3 ranks, a slow link; QSGD layers, which only
/// the fused allgatherv carries), with bitwise the results of `recdbl`;
/// on one node, and without a profile, it is `recdbl`.
#[test]
fn auto_allgather_goes_node_aware_across_slow_nodes() {
    let prof = slow_link_profile();
    let qsgd = || Strategy::Sparse {
        codec: "qsgd:bits=4".parse().expect("codec"),
        density: None,
    };
    let table = vec![
        ("bias", 10, Strategy::Dense),
        ("w", 60_000, qsgd()),
        ("v", 7, qsgd()),
    ];
    let run = |allgather: AllgathervAlgo, per: usize, profile: bool| {
        let cfg = Config {
            allgather,
            profile: profile.then(|| prof.clone()),
            ..cfg()
        };
        run_on_nodes(6, per, &cfg, &table, 2, false)
            .into_iter()
            .map(|rank| {
                rank.into_iter()
                    .map(|(g, st)| (g, st.allgather))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    let flat = run(AllgathervAlgo::RecursiveDoubling, 3, true);
    let auto = run(AllgathervAlgo::Auto, 3, true);
    let one = run(AllgathervAlgo::Auto, 6, true);
    let bare = run(AllgathervAlgo::Auto, 3, false);
    for r in 0..6 {
        for t in 0..2 {
            let at = format!("rank {r} step {t}");
            assert_eq!(flat[r][t].1, "recdbl", "{at}");
            assert_eq!(auto[r][t].1, "node", "{at}");
            assert_eq!(one[r][t].1, "recdbl", "{at}: one node");
            assert_eq!(bare[r][t].1, "recdbl", "{at}: no profile");
            for other in [&auto, &one, &bare] {
                assert_eq!(flat[r][t].0, other[r][t].0, "{at}: results");
            }
        }
    }
}
