//! A step in buckets equals the same step submitted whole, bit for bit,
//! for every strategy and per-step policy; ranks that cut a step
//! differently fail alike; misuse is refused locally.

use super::{Config, GradSync, LayerId, SparseExchange, Warmup};

use crate::comm::LocalComm;
use crate::dense::AllreduceAlgo;
use crate::strategy::Pick;
use crate::Error;
use rand::rngs::SmallRng as StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The table: every kind of layer (sizes small enough for a quick test,
/// large enough for the codecs to select).
const TABLE: &[(&str, usize, &str)] = &[
    ("conv1", 3000, "rgc:density=0.05"),
    ("bias1", 40, "dense"),
    ("conv2", 2048, "sbc"),
    ("fc1", 5000, "rgc-quant:density=0.05"),
    ("fc2", 1200, "qsgd"),
    ("bias2", 7, "dense"),
    ("fc3", 3000, "3lc"),
    ("fc4", 2500, "fastsgd"),
    ("emb", 6000, "auto"),
    ("head", 300, "dense"),
    ("empty", 0, "dense"),
];

fn grad(rank: usize, step: u64, layer: usize, n: usize) -> Vec<f32> {
    let mut r = StdRng::seed_from_u64((rank as u64) << 40 ^ step << 20 ^ layer as u64);
    (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect()
}

/// `steps` steps of every rank; `cut(step)` is the step's buckets (layer
/// ids, in submission order) or `None` for a whole step. Every rank's
/// outputs (and weights' updates) as bits.
fn run(
    p: usize,
    cfg: &Config,
    table: &[(&str, usize, &str)],
    steps: u64,
    cut: &(dyn Fn(u64) -> Option<Vec<Vec<usize>>> + Sync),
) -> Vec<Vec<Vec<u32>>> {
    LocalComm::run(p, |c| {
        let rank = crate::comm::Transport::rank(&c);
        let mut s = GradSync::with_transport(c, cfg.clone()).expect("engine");
        for (name, n, spec) in table {
            // PowerSGD sees matrices: 32 columns.
            let shape = if spec.starts_with("powersgd") {
                vec![n / 32, 32]
            } else {
                vec![*n]
            };
            s.register_spec(name, &shape, spec).expect("register");
        }
        // With a delay the engine writes the weights back: kept apart per
        // step, as a caller's would be.
        let mut weights: Vec<Vec<f32>> = table.iter().map(|t| vec![0.25; t.1]).collect();
        let delayed = cfg.delay > 1;
        let mut seen = Vec::new();
        for step in 0..steps {
            let g: Vec<Vec<f32>> = (0..table.len())
                .map(|l| grad(rank, step, l, table[l].1))
                .collect();
            let mut out: Vec<Vec<f32>> = table.iter().map(|t| vec![f32::NAN; t.1]).collect();
            let mut ov: Vec<&mut [f32]> = out.iter_mut().map(|o| &mut o[..]).collect();
            let wd = cfg.weight_decay != 0.0;
            match cut(step) {
                None if delayed => {
                    let gv: Vec<&[f32]> = g.iter().map(|x| &x[..]).collect();
                    let mut wm: Vec<&mut [f32]> = weights.iter_mut().map(|w| &mut w[..]).collect();
                    s.start_with_weights_mut(&gv, &mut wm).expect("start");
                }
                None => {
                    let wv: Vec<&[f32]> = weights.iter().map(|w| &w[..]).collect();
                    let gv: Vec<&[f32]> = g.iter().map(|x| &x[..]).collect();
                    if wd {
                        s.start_with_weights(&gv, &wv).expect("start");
                    } else {
                        s.start(&gv).expect("start");
                    }
                }
                Some(buckets) => {
                    for mut b in buckets {
                        b.sort_unstable();
                        let ids: Vec<LayerId> = b.iter().map(|&i| LayerId(i)).collect();
                        let gv: Vec<&[f32]> = b.iter().map(|&i| &g[i][..]).collect();
                        let wv: Vec<&[f32]> = weights.iter().map(|w| &w[..]).collect();
                        if delayed {
                            drop(wv);
                            let mut wm: Vec<&mut [f32]> = weights
                                .iter_mut()
                                .enumerate()
                                .filter(|(i, _)| b.contains(i))
                                .map(|(_, w)| &mut w[..])
                                .collect();
                            s.submit_bucket_with_weights_mut(&ids, &gv, &mut wm)
                                .expect("submit");
                        } else if wd {
                            let w: Vec<&[f32]> = b.iter().map(|&i| wv[i]).collect();
                            s.submit_bucket_with_weights(&ids, &gv, &w).expect("submit");
                        } else {
                            s.submit_bucket(&ids, &gv).expect("submit");
                        }
                    }
                }
            }
            let st = s.finish_step(&mut ov).expect("finish").clone();
            if let Some(b) = cut(step) {
                let staged = cfg.clip_norm.is_some()
                    || !cfg.allreduce.is(AllreduceAlgo::Rabenseifner)
                    || table.iter().any(|t| t.2.starts_with("gradiveq"));
                assert_eq!(st.buckets, if staged { 1 } else { b.len() }, "step {step}");
            }
            seen.push(
                out.iter()
                    .flat_map(|o| o.iter().map(|x| x.to_bits()))
                    .collect(),
            );
            if delayed {
                // The caller's update, and the weights the engine wrote
                // back, compared too.
                for (w, o) in weights.iter_mut().zip(&out) {
                    w.iter_mut().zip(o).for_each(|(w, d)| *w -= 0.1 * d);
                }
                seen.push(
                    weights
                        .iter()
                        .flat_map(|w| w.iter().map(|x| x.to_bits()))
                        .collect(),
                );
            }
        }
        seen
    })
}

/// Random cuts of the table into buckets, in backward order (last layer
/// first) or shuffled, the same on every rank (the seed).
fn cuts(seed: u64, n: usize) -> impl Fn(u64) -> Option<Vec<Vec<usize>>> + Sync {
    move |step| {
        let mut r = StdRng::seed_from_u64(seed ^ step);
        let mut ids: Vec<usize> = (0..n).rev().collect();
        if r.gen_bool(0.3) {
            ids.shuffle(&mut r);
        }
        let mut out = Vec::new();
        while !ids.is_empty() {
            let k = r.gen_range(1..=ids.len().min(4));
            out.push(ids.drain(..k).collect());
        }
        if r.gen_bool(0.2) {
            // Not last: once every layer is in, the step is complete.
            out.insert(r.gen_range(0..out.len()), Vec::new());
        }
        Some(out)
    }
}

#[test]
fn buckets_equal_the_whole_step_bit_for_bit() {
    let base = Config {
        momentum: 0.9,
        ..Config::default()
    };
    let configs: Vec<(&str, Config)> = vec![
        ("momentum", base.clone()),
        (
            "nesterov+wd",
            Config {
                nesterov: true,
                weight_decay: 1e-3,
                ..base.clone()
            },
        ),
        (
            "sparse allreduce",
            Config {
                sparse_exchange: Pick::Fixed(SparseExchange::Allreduce),
                ..base.clone()
            },
        ),
        (
            "dense warm-up",
            Config {
                warmup: Warmup::Dense { steps: 2 },
                ..base.clone()
            },
        ),
        (
            "density warm-up",
            Config {
                warmup: Warmup::Density {
                    schedule: vec![0.25, 0.0625],
                    steps_per_stage: 1,
                },
                ..base.clone()
            },
        ),
        (
            "no overlap",
            Config {
                overlap: false,
                ..base.clone()
            },
        ),
        // Staged: the step runs whole when its last bucket arrives.
        (
            "clip (staged)",
            Config {
                clip_norm: Some(0.5),
                ..base.clone()
            },
        ),
        (
            "ring (staged)",
            Config {
                allreduce: Pick::Fixed(AllreduceAlgo::Ring),
                ..base.clone()
            },
        ),
    ];
    for (what, cfg) in &configs {
        for p in [1, 2, 3, 4] {
            let whole = run(p, cfg, TABLE, 4, &|_| None);
            let cut = run(p, cfg, TABLE, 4, &cuts(p as u64, TABLE.len()));
            assert_eq!(whole, cut, "{what}, p = {p}");
            // Every rank holds the same directions.
            assert!(whole.iter().all(|r| r == &whole[0]), "{what}, p = {p}");
        }
    }
}

#[test]
fn gradiveq_tables_are_staged_and_equal_the_whole_step() {
    let mut table = TABLE.to_vec();
    table.insert(
        3,
        ("gvq", 4096, "gradiveq:k=64,lt=2,d=64,reuse=64,qsgd_bits=8"),
    );
    let cfg = Config {
        momentum: 0.9,
        ..Config::default()
    };
    for p in [1, 2, 3] {
        let whole = run(p, &cfg, &table, 4, &|_| None);
        let cut = run(p, &cfg, &table, 4, &cuts(p as u64, table.len()));
        assert_eq!(whole, cut, "p = {p}");
    }
}

#[test]
fn powersgd_tables_run_in_buckets_and_equal_the_whole_step() {
    let mut table = TABLE.to_vec();
    table.insert(2, ("psg", 4096, "powersgd:rank=2,start=1"));
    table.push(("psg2", 2048, "powersgd:rank=1,start=0"));
    let cfg = Config {
        momentum: 0.9,
        ..Config::default()
    };
    for p in [1, 2, 3, 4] {
        let whole = run(p, &cfg, &table, 4, &|_| None);
        let cut = run(p, &cfg, &table, 4, &cuts(p as u64, table.len()));
        assert_eq!(whole, cut, "p = {p}");
        assert!(whole.iter().all(|r| r == &whole[0]), "p = {p}");
    }
    // Factors summed by an order that depends on the place: staged, and
    // still equal.
    let ring = Config {
        allreduce: Pick::Fixed(AllreduceAlgo::Ring),
        ..cfg
    };
    let whole = run(3, &ring, &table, 3, &|_| None);
    let cut = run(3, &ring, &table, 3, &cuts(3, table.len()));
    assert_eq!(whole, cut, "ring");
}

/// Four steps of a PowerSGD layer and an RGC one on three ranks; step 1
/// fails (rank 1's RGC gradient is short). `bucketed`: steps 0 and 1 in
/// two buckets, PowerSGD's first (it runs, then the step fails); else
/// whole. Every rank's outputs of the steps that succeed, as bits, and
/// each step's bucket count.
fn failed_after_powersgd(bucketed: bool) -> Vec<(Vec<Vec<u32>>, Vec<usize>)> {
    LocalComm::run(3, |c| {
        let rank = crate::comm::Transport::rank(&c);
        let cfg = Config {
            momentum: 0.9,
            ..Config::default()
        };
        let mut s = GradSync::with_transport(c, cfg).expect("engine");
        let a = s
            .register_spec("psg", &[64, 32], "powersgd:rank=2,start=0")
            .expect("psg");
        let b = s
            .register_spec("b", &[4000], "rgc:density=0.01")
            .expect("b");
        let short = [0.5f32; 10];
        let (mut seen, mut buckets) = (Vec::new(), Vec::new());
        for step in 0..4u64 {
            let ga = grad(rank, step, 0, 2048);
            let gb = grad(rank, step, 1, 4000);
            let gb: &[f32] = if step == 1 && rank == 1 { &short } else { &gb };
            let (mut oa, mut ob) = (vec![0.0f32; 2048], vec![0.0f32; 4000]);
            if bucketed && step < 2 {
                s.submit_bucket(&[a], &[&ga[..]]).expect("psg");
                s.submit_bucket(&[b], &[gb]).expect("b is carried");
            } else {
                s.start(&[&ga[..], gb])
                    .expect("start (a short input is carried)");
            }
            let r = s.finish_step(&mut [&mut oa[..], &mut ob[..]]);
            if step == 1 {
                assert!(r.is_err(), "rank {rank}: step 1 fails");
                continue;
            }
            buckets.push(r.expect("step").buckets);
            seen.push(oa.iter().chain(&ob).map(|x| x.to_bits()).collect());
        }
        (seen, buckets)
    })
}

#[test]
fn a_powersgd_bucket_before_a_failed_one_leaves_no_trace() {
    let cut = failed_after_powersgd(true);
    let whole = failed_after_powersgd(false);
    for (r, ((cs, cb), (ws, _))) in cut.iter().zip(&whole).enumerate() {
        assert_eq!(cb[0], 2, "rank {r}: PowerSGD's step ran in two buckets");
        assert_eq!(cs, ws, "rank {r}: the later steps as if step 1 never ran");
    }
    assert!(cut.iter().all(|x| x.0 == cut[0].0));
}

#[test]
fn buckets_with_delay_equal_the_whole_step() {
    let table = TABLE.to_vec();
    let cfg = Config {
        delay: 3,
        momentum: 0.9,
        ..Config::default()
    };
    for p in [1, 2, 3] {
        let whole = run(p, &cfg, &table, 7, &|_| None);
        let cut = run(p, &cfg, &table, 7, &cuts(7, table.len()));
        assert_eq!(whole, cut, "p = {p}");
    }
}

/// Every rank's outcome of one step cut by `cut(rank)` (finished with
/// `finish_step`), then of a whole second step, which must succeed.
fn differing(p: usize, cut: &(dyn Fn(usize) -> Vec<Vec<usize>> + Sync)) -> Vec<String> {
    LocalComm::run(p, |c| {
        let rank = crate::comm::Transport::rank(&c);
        let mut s = GradSync::with_transport(c, Config::default()).expect("engine");
        for (name, n, spec) in TABLE {
            s.register_spec(name, &[*n], spec).expect("register");
        }
        let g: Vec<Vec<f32>> = TABLE
            .iter()
            .enumerate()
            .map(|(l, t)| grad(rank, 0, l, t.1))
            .collect();
        let mut out: Vec<Vec<f32>> = TABLE.iter().map(|t| vec![0.0; t.1]).collect();
        let mut ov: Vec<&mut [f32]> = out.iter_mut().map(|o| &mut o[..]).collect();
        for b in cut(rank) {
            let ids: Vec<LayerId> = b.iter().map(|&i| LayerId(i)).collect();
            let gv: Vec<&[f32]> = b.iter().map(|&i| &g[i][..]).collect();
            s.submit_bucket(&ids, &gv).expect("submit");
        }
        let e = s
            .finish_step(&mut ov)
            .map(|_| ())
            .expect_err("a differing cut fails");
        // The next step runs normally on every rank.
        let gv: Vec<&[f32]> = g.iter().map(|x| &x[..]).collect();
        s.start(&gv).expect("start");
        s.wait(&mut ov).expect("the next step");
        assert_eq!(s.step(), 2);
        e.to_string()
    })
}

#[test]
fn a_cut_that_differs_on_one_rank_fails_every_rank() {
    let n = TABLE.len();
    let all: Vec<usize> = (0..n).collect();
    let (front, back) = (all[..5].to_vec(), all[5..].to_vec());
    type Cut = Box<dyn Fn(usize) -> Vec<Vec<usize>> + Sync>;
    let cases: Vec<(&str, Cut)> = vec![
        (
            "another split",
            Box::new({
                let (f, b) = (front.clone(), back.clone());
                move |r| {
                    if r == 1 {
                        vec![all[..4].to_vec(), all[4..].to_vec()]
                    } else {
                        vec![f.clone(), b.clone()]
                    }
                }
            }),
        ),
        (
            "another order",
            Box::new({
                let (f, b) = (front.clone(), back.clone());
                move |r| {
                    if r == 1 {
                        vec![b.clone(), f.clone()]
                    } else {
                        vec![f.clone(), b.clone()]
                    }
                }
            }),
        ),
        (
            "one more bucket",
            Box::new({
                let (f, b) = (front.clone(), back.clone());
                move |r| {
                    if r == 0 {
                        vec![f.clone(), Vec::new(), b.clone()]
                    } else {
                        vec![f.clone(), b.clone()]
                    }
                }
            }),
        ),
        (
            "finished early",
            Box::new({
                let (f, b) = (front.clone(), back.clone());
                move |r| {
                    if r == 1 {
                        vec![f.clone()]
                    } else {
                        vec![f.clone(), b.clone()]
                    }
                }
            }),
        ),
        (
            "whole against buckets",
            Box::new({
                let (f, b) = (front.clone(), back.clone());
                move |r| {
                    if r == 0 {
                        vec![(0..11).collect()]
                    } else {
                        vec![f.clone(), b.clone()]
                    }
                }
            }),
        ),
    ];
    for (what, cut) in &cases {
        for p in [2, 3] {
            let errs = differing(p, cut.as_ref());
            assert!(
                errs.iter().all(|e| e == &errs[0]),
                "{what}, p = {p}: {errs:?}"
            );
            assert!(
                errs[0].contains("differ between ranks") || errs[0].contains("finished before"),
                "{what}: {}",
                errs[0]
            );
        }
    }
}

#[test]
fn misuse_is_refused_locally_and_the_step_goes_on() {
    let out = LocalComm::run(2, |c| {
        let mut s = GradSync::with_transport(c, Config::default()).expect("engine");
        let a = s.register("a", &[100]).expect("a");
        let b = s
            .register_spec("b", &[4000], "rgc:density=0.01")
            .expect("b");
        let (ga, gb) = (vec![1.0f32; 100], vec![0.5f32; 4000]);
        let mut errs = Vec::new();
        // Only rank 0 misuses; nothing is entered, so no peer waits.
        if s.rank() == 0 {
            for (ids, g) in [
                (vec![LayerId(5)], vec![&ga[..]]),
                (vec![a, a], vec![&ga[..], &ga[..]]),
            ] {
                errs.push(s.submit_bucket(&ids, &g).expect_err("misuse").to_string());
            }
        }
        s.submit_bucket(&[a], &[&ga[..]]).expect("a");
        if s.rank() == 0 {
            let e = s.submit_bucket(&[a], &[&ga[..]]).expect_err("twice");
            errs.push(e.to_string());
        }
        s.submit_bucket(&[b], &[&gb[..]]).expect("b");
        let (mut oa, mut ob) = (vec![0.0f32; 100], vec![0.0f32; 4000]);
        s.finish_step(&mut [&mut oa[..], &mut ob[..]])
            .expect("finish");
        (errs, oa[0])
    });
    assert_eq!(out[0].1, 1.0);
    assert_eq!(out[1].1, 1.0);
    let e = &out[0].0;
    assert!(e[0].contains("layer 5"), "{e:?}");
    assert!(e[1].contains("twice"), "{e:?}");
    assert!(e[2].contains("already submitted"), "{e:?}");
}

#[test]
fn a_bad_bucket_on_one_rank_fails_the_step_on_every_rank() {
    let out = LocalComm::run(3, |c| {
        let rank = crate::comm::Transport::rank(&c);
        let mut s = GradSync::with_transport(c, Config::default()).expect("engine");
        let a = s.register("a", &[100]).expect("a");
        let b = s
            .register_spec("b", &[4000], "rgc:density=0.01")
            .expect("b");
        let (ga, gb) = (vec![1.0f32; 100], vec![0.5f32; 4000]);
        let short = [0.5f32; 10];
        s.submit_bucket(&[a], &[&ga[..]]).expect("a");
        let g = if rank == 1 { &short[..] } else { &gb[..] };
        s.submit_bucket(&[b], &[g]).expect("b is carried");
        let (mut oa, mut ob) = (vec![7.0f32; 100], vec![7.0f32; 4000]);
        let e = s
            .finish_step(&mut [&mut oa[..], &mut ob[..]])
            .map(|_| ())
            .expect_err("rank 1's bucket fails the step");
        // Nothing applied; the residual holds the whole gradient again.
        let kept = s.residual(b).expect("sparse").to_vec();
        (e, oa[0], kept)
    });
    for (r, (e, oa, kept)) in out.iter().enumerate() {
        match e {
            Error::RankFailed { rank, .. } => assert_eq!(*rank, 1, "rank {r}: {e}"),
            other => panic!("rank {r}: {other}"),
        }
        assert!(e.to_string().contains("4000"), "{e}");
        assert_eq!(*oa, 7.0, "rank {r}: nothing written");
        if r != 1 {
            assert!(kept.iter().all(|&v| v == 0.5), "rank {r}: residual");
        }
    }
}

#[test]
fn a_refused_first_bucket_then_finish_fails_every_rank_without_a_hang() {
    let out = LocalComm::run(3, |c| {
        let rank = crate::comm::Transport::rank(&c);
        let mut s = GradSync::with_transport(c, Config::default()).expect("engine");
        let a = s.register("a", &[100]).expect("a");
        let b = s
            .register_spec("b", &[4000], "rgc:density=0.01")
            .expect("b");
        let (ga, gb) = (vec![1.0f32; 100], vec![0.5f32; 4000]);
        if rank == 1 {
            // Refused here, and this rank gives up on the step.
            assert!(s.submit_bucket(&[LayerId(9)], &[&ga[..]]).is_err());
        } else {
            s.submit_bucket(&[b], &[&gb[..]]).expect("b");
            s.submit_bucket(&[a], &[&ga[..]]).expect("a");
        }
        let (mut oa, mut ob) = (vec![0.0f32; 100], vec![0.0f32; 4000]);
        let e = s
            .finish_step(&mut [&mut oa[..], &mut ob[..]])
            .map(|_| ())
            .expect_err("the step fails everywhere");
        // The next step, whole, runs on every rank.
        s.sync(&mut [&mut oa[..], &mut ob[..]]).expect("next step");
        e.to_string()
    });
    assert!(out.iter().all(|e| e == &out[0]), "{out:?}");
}

#[test]
fn a_restored_step_after_a_failed_one_runs() {
    let dir = std::env::temp_dir().join(format!("gs-bucket-restore-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let out = LocalComm::run(2, |c| {
        let rank = crate::comm::Transport::rank(&c);
        let path = dir.join(format!("r{rank}.snap"));
        let mut s = GradSync::with_transport(c, Config::default()).expect("engine");
        let a = s.register("a", &[100]).expect("a");
        let b = s.register("b", &[100]).expect("b");
        let g = vec![1.0f32; 100];
        let (mut oa, mut ob) = (vec![0.0f32; 100], vec![0.0f32; 100]);
        s.save_snapshot(&path).expect("save");
        // Step 0 fails: the ranks cut it differently.
        let cut: &[LayerId] = if rank == 0 { &[a] } else { &[b] };
        s.submit_bucket(cut, &[&g[..]]).expect("submit");
        let rest: &[LayerId] = if rank == 0 { &[b] } else { &[a] };
        s.submit_bucket(rest, &[&g[..]]).expect("submit");
        assert!(s.finish_step(&mut [&mut oa[..], &mut ob[..]]).is_err());
        // Restored to step 0, the same step number runs.
        s.load_snapshot(&path).expect("load");
        assert_eq!(s.step(), 0);
        s.submit_bucket(&[b], &[&g[..]]).expect("b");
        s.submit_bucket(&[a], &[&g[..]]).expect("a");
        s.finish_step(&mut [&mut oa[..], &mut ob[..]])
            .map(|st| st.buckets)
            .expect("step 0 again")
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out, vec![2, 2]);
}
