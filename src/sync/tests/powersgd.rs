//! PowerSGD layers in the engine: the same bits on every rank, the
//! multi-rank algorithm of `crate::powersgd` run by hand as the reference,
//! dense before `start`, layers it leaves dense, snapshots, rank-deficient
//! and all-zero layers, a NaN on one rank, and parameter checks.

use super::*;
use crate::powersgd::{PowerSgd, PowerSgdConfig};

/// The test table: two matrices PowerSGD compresses, a bias and a small
/// matrix it leaves dense (factors not twice smaller).
const TABLE: [(&str, &[usize]); 4] = [
    ("conv", &[16, 3, 3, 3]),
    ("bias", &[16]),
    ("fc", &[40, 30]),
    ("tiny", &[2, 2]),
];

fn spec() -> &'static str {
    "powersgd:rank=2,start=2,seed=7"
}

fn psg_cfg() -> PowerSgdConfig {
    match Strategy::parse(spec()).expect("spec") {
        Strategy::Powersgd(c) => c,
        s => panic!("{s:?}"),
    }
}

fn elems(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Layer `l`'s gradient at `rank` and `step`.
fn psg_grad(rank: usize, step: u64, l: usize, shape: &[usize]) -> Vec<f32> {
    grad(rank, step, l, elems(shape))
}

/// A test's gradient of (rank, step, layer, shape).
type GradFn = dyn Fn(usize, u64, usize, &[usize]) -> Vec<f32>;

/// Steps `from..to` of an engine with `table`; per step, every layer's
/// result and strategy label.
fn steps(
    s: &mut GradSync<LocalComm>,
    rank: usize,
    table: &[(&str, &[usize])],
    from: u64,
    to: u64,
    g: &GradFn,
) -> Vec<Vec<(Vec<f32>, String)>> {
    (from..to)
        .map(|t| {
            let mut gs: Vec<Vec<f32>> = table
                .iter()
                .enumerate()
                .map(|(l, (_, sh))| g(rank, t, l, sh))
                .collect();
            let mut v: Vec<&mut [f32]> = gs.iter_mut().map(|x| &mut x[..]).collect();
            let st = s.sync(&mut v).expect("sync").clone();
            for (ls, (name, sh)) in st.layers.iter().zip(table) {
                if ls.strategy == "powersgd" {
                    // Its traffic is P and Q, (rows + cols)·r floats.
                    let (rows, n) = (sh[0], sh.iter().product::<usize>());
                    let per_rank = 4 * (rows + n / rows);
                    assert!(
                        ls.bytes_sent < 4 * n && ls.bytes_sent % per_rank == 0,
                        "{name}: {} bytes sent",
                        ls.bytes_sent
                    );
                }
            }
            gs.into_iter()
                .zip(&st.layers)
                .map(|(x, ls)| (x, ls.strategy.clone()))
                .collect()
        })
        .collect()
}

fn engine(c: LocalComm, table: &[(&str, &[usize])], spec: &str) -> GradSync<LocalComm> {
    let mut s = GradSync::with_transport(c, cfg()).expect("engine");
    for (name, shape) in table {
        s.register_spec(name, shape, spec).expect("register");
    }
    s
}

/// PowerSGD over `p` ranks by hand (`crate::powersgd`'s phases, the sums
/// in rank order): every rank's states and each step's result.
fn reference(p: usize, grads: &[Vec<f32>], states: &mut [PowerSgd]) -> Vec<f32> {
    let (np, nq) = states[0].factor_lens();
    let mut psum = vec![0.0f32; np];
    for (st, g) in states.iter_mut().zip(grads) {
        let mut pr = vec![0.0f32; np];
        st.begin(g, &mut pr).expect("begin");
        for (a, b) in psum.iter_mut().zip(&pr) {
            *a += b;
        }
    }
    let mut qsum = vec![0.0f32; nq];
    for st in states.iter_mut() {
        let mut qr = vec![0.0f32; nq];
        st.after_p(&psum, &mut qr).expect("after_p");
        for (a, b) in qsum.iter_mut().zip(&qr) {
            *a += b;
        }
    }
    let mut out = vec![0.0f32; grads[0].len()];
    for st in states.iter_mut() {
        st.after_q(&qsum, p, &mut out).expect("after_q");
    }
    out
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The engine's PowerSGD at p = 1..4: the same bits on every rank every
/// step; dense averages before `start` and for the layers it leaves
/// dense; from `start` on the by-hand algorithm's result within float32
/// rounding of the sums' order.
#[test]
#[allow(clippy::needless_range_loop)] // steps and layers index several ranks' runs
fn powersgd_layers_equal_the_reference_on_every_rank() {
    let c = psg_cfg();
    for p in 1..=4 {
        let runs = LocalComm::run(p, |comm| {
            let rank = comm.rank();
            let mut s = engine(comm, &TABLE, spec());
            steps(&mut s, rank, &TABLE, 0, 7, &psg_grad)
        });
        for t in 0..7usize {
            for r in 1..p {
                for l in 0..TABLE.len() {
                    let (a, b) = (&runs[r][t][l].0, &runs[0][t][l].0);
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "p = {p}, step {t}, layer {l}: rank {r} differs from rank 0"
                    );
                }
            }
        }
        for (l, (name, shape)) in TABLE.iter().enumerate() {
            let mut states: Option<Vec<PowerSgd>> = c
                .layer_state(shape, l)
                .expect("state")
                .map(|s0| vec![s0; p]);
            for t in 0..7u64 {
                let grads: Vec<Vec<f32>> = (0..p).map(|r| psg_grad(r, t, l, shape)).collect();
                let (got, label) = &runs[0][t as usize][l];
                let want = match states.as_mut().filter(|_| t >= c.start) {
                    Some(st) => {
                        assert_eq!(label, "powersgd", "p = {p} {name} step {t}");
                        reference(p, &grads, st)
                    }
                    None => {
                        assert_eq!(label, "dense", "p = {p} {name} step {t}");
                        (0..grads[0].len())
                            .map(|i| grads.iter().map(|g| g[i]).sum::<f32>() / p as f32)
                            .collect()
                    }
                };
                let tol = 1e-5 * max_abs(&want).max(1e-3);
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= tol,
                    "p = {p} {name} step {t}: {worst} from the reference (bound {tol})"
                );
            }
        }
        // The compressed layers are an approximation, not the average: at
        // rank 2 of a random 16 x 27 matrix most of it is in the error.
        let avg: Vec<f32> = (0..432)
            .map(|i| {
                (0..p)
                    .map(|r| psg_grad(r, 6, 0, TABLE[0].1)[i])
                    .sum::<f32>()
                    / p as f32
            })
            .collect();
        assert_ne!(runs[0][6][0].0, avg, "p = {p}");
    }
}

/// A snapshot holds PowerSGD's `Q`, error and draws: a run stopped and
/// restored continues bitwise (warm start and fresh draws alike), and a
/// snapshot of a table that leaves the layer dense is refused.
#[test]
fn powersgd_state_survives_a_snapshot_bitwise() {
    for spec in [
        "powersgd:rank=2,start=1,seed=3",
        "powersgd:rank=3,start=0,warm_start=false",
    ] {
        let p = 3;
        let straight = LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = engine(c, &TABLE, spec);
            steps(&mut s, rank, &TABLE, 0, 8, &psg_grad)
        });
        let dir = std::env::temp_dir().join(format!(
            "gradsync-psg-snap-{}-{}",
            std::process::id(),
            spec.len()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let paths = LocalComm::run(p, |c| {
            let rank = c.rank();
            let path = dir.join(format!("r{rank}.snap"));
            let mut s = engine(c, &TABLE, spec);
            steps(&mut s, rank, &TABLE, 0, 4, &psg_grad);
            s.save_snapshot(&path).expect("save");
            path
        });
        let resumed = LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = engine(c, &TABLE, spec);
            s.load_snapshot(&paths[rank]).expect("load");
            steps(&mut s, rank, &TABLE, 4, 8, &psg_grad)
        });
        for r in 0..p {
            for t in 4..8 {
                for l in 0..TABLE.len() {
                    let (a, b) = (&straight[r][t][l].0, &resumed[r][t - 4][l].0);
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{spec}: rank {r} step {t} layer {l}"
                    );
                }
            }
        }
        // A fresh engine (Q drawn again, no error) differs from the
        // restored one: the snapshot carried the state.
        let fresh = LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = engine(c, &TABLE, spec);
            steps(&mut s, rank, &TABLE, 4, 5, &psg_grad)
        });
        assert_ne!(fresh[0][0][0].0, resumed[0][0][0].0, "{spec}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Hostile snapshot bytes with PowerSGD state never panic; a refused
/// restore leaves the engine as it was; a PowerSGD state for a layer
/// without one is refused.
#[test]
fn mutated_powersgd_snapshots_never_panic() {
    let good = LocalComm::run(1, |c| {
        let mut s = engine(c, &TABLE, "powersgd:rank=2,start=0");
        steps(&mut s, 0, &TABLE, 0, 3, &psg_grad);
        let good = s.snapshot_bytes().expect("snapshot");
        hostile_restores(&mut s, &good, 11, 300);
        steps(&mut s, 0, &TABLE, 3, 5, &psg_grad);
        good
    })
    .pop()
    .expect("one rank");
    // The same table registered dense is another table: refused.
    LocalComm::run(1, |c| {
        let mut d = engine(c, &TABLE, "dense");
        let e = d.restore_bytes(&good).expect_err("refused");
        assert!(e.to_string().contains("layer table"), "{e}");
    });
}

/// An all-zero layer and a rank-1 gradient at rank 4 (P rank-deficient:
/// its dependent columns zeroed, not divided by rounding): finite results,
/// zero for zero, the rank-1 average itself for rank 1 (summed over
/// ranks, still rank 1).
#[test]
fn rank_deficient_and_all_zero_layers_are_handled() {
    let table: [(&str, &[usize]); 2] = [("zero", &[24, 20]), ("rank1", &[24, 20])];
    let g = |rank: usize, step: u64, l: usize, sh: &[usize]| -> Vec<f32> {
        if l == 0 {
            return vec![0.0; elems(sh)];
        }
        let u: Vec<f32> = (0..sh[0]).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = (0..sh[1]).map(|j| (j as f32 * 0.11).cos()).collect();
        let a = 1.0 + rank as f32 + step as f32 * 0.5;
        u.iter()
            .flat_map(|x| v.iter().map(move |y| a * x * y))
            .collect()
    };
    for p in [1, 2, 3] {
        let runs = LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = engine(c, &table, "powersgd:rank=4,start=0");
            steps(&mut s, rank, &table, 0, 4, &g)
        });
        for t in 0..4u64 {
            let zero = &runs[0][t as usize][0].0;
            assert!(
                zero.iter().all(|&x| x == 0.0),
                "p = {p} step {t}: zero stays zero"
            );
            let got = &runs[0][t as usize][1].0;
            assert!(got.iter().all(|x| x.is_finite()), "p = {p} step {t}");
            let want: Vec<f32> = (0..480)
                .map(|i| (0..p).map(|r| g(r, t, 1, &[24, 20])[i]).sum::<f32>() / p as f32)
                .collect();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= 1e-4 * max_abs(&want),
                "p = {p} step {t}: a rank-1 average within {worst}"
            );
        }
    }
}

/// A NaN in one rank's PowerSGD layer fails the step on every rank alike,
/// naming that rank and layer; the states go back to their layers and the
/// next step runs.
#[test]
fn a_nan_in_one_ranks_powersgd_layer_fails_every_rank() {
    for p in [1, 3] {
        let errs = LocalComm::run(p, |c| {
            let rank = c.rank();
            let mut s = engine(c, &TABLE, "powersgd:rank=2,start=0");
            steps(&mut s, rank, &TABLE, 0, 2, &psg_grad);
            let mut gs: Vec<Vec<f32>> = TABLE
                .iter()
                .enumerate()
                .map(|(l, (_, sh))| psg_grad(rank, 2, l, sh))
                .collect();
            if rank == p - 1 {
                gs[2][5] = f32::NAN;
            }
            let mut v: Vec<&mut [f32]> = gs.iter_mut().map(|x| &mut x[..]).collect();
            let e = s.sync(&mut v).map(|_| ()).expect_err("a NaN step fails");
            // The states went back to their layers: the next step runs.
            steps(&mut s, rank, &TABLE, 3, 4, &psg_grad);
            e.to_string()
        });
        for e in &errs {
            assert_eq!(e, &errs[0], "p = {p}: the same error everywhere");
            assert!(
                e.contains("fc") && e.contains(&format!("{}", p - 1)),
                "p = {p}: {e}"
            );
        }
    }
}

/// Bad parameters are refused when parsed; `delay > 1` at registration.
#[test]
fn bad_powersgd_parameters_are_refused() {
    for (spec, needle) in [
        ("powersgd:rank=0", "rank must be at least 1"),
        ("powersgd:rank=2,rank=3", "given twice"),
        ("powersgd:warm_start=1", "true or false"),
        ("powersgd:rank=true", "not a number"),
        ("powersgd:min_rate=0.5", "min_rate"),
        ("powersgd:k=3", "unknown parameter"),
        ("powersgd:rank", "not key=value"),
        ("powersgd:rank=1.5", "rank"),
    ] {
        let e = Strategy::parse(spec).expect_err(spec).to_string();
        assert!(e.contains(needle), "{spec}: {e}");
    }
    let ok = Strategy::parse("powersgd").expect("defaults");
    assert_eq!(ok, Strategy::Powersgd(PowerSgdConfig::default()));
    let json = serde_json::to_string(&ok).expect("json");
    assert_eq!(Strategy::parse(&json).expect("round trip"), ok);
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, Config { delay: 2, ..cfg() }).expect("engine");
        let e = s
            .register_spec("fc", &[40, 30], "powersgd")
            .expect_err("delay")
            .to_string();
        assert!(e.contains("delay > 1"), "{e}");
    });
}

/// `auto` with `auto_powersgd`: on a slow link the plan gives the
/// matrices PowerSGD at that rank, the small one below `compress_threshold`
/// too (the vector stays dense), the engine then runs it (the same bits on every rank, PowerSGD
/// state in the snapshot); without `auto_powersgd` no layer gets it.
#[test]
fn auto_chooses_powersgd_where_the_profile_prices_it() {
    let mut prof = psg_profile(1e7);
    prof.dense_local = crate::cost::LinearFit { a: 0.0, b: 1e-9 };
    // A selection dearer than PowerSGD's products (10 ms for `fc`).
    prof.select
        .insert("trimmed".into(), crate::cost::LinearFit { a: 0.0, b: 2e-8 });
    let table: [(&str, &[usize]); 3] = [
        ("fc", &[512, 1024]),
        ("bias", &[512]),
        ("conv", &[64, 3, 3, 3]),
    ];
    let run = |rank: usize| {
        let prof = prof.clone();
        LocalComm::run(3, move |c| {
            let r = c.rank();
            let mut s = GradSync::with_transport(
                c,
                Config {
                    profile: Some(prof.clone()),
                    auto_powersgd: rank,
                    ..cfg()
                },
            )
            .expect("engine");
            for (name, shape) in table {
                s.register(name, shape).expect("register");
            }
            let out = steps(&mut s, r, &table, 0, 3, &psg_grad);
            let strategies: Vec<Strategy> = (0..table.len())
                .map(|i| s.layer(LayerId(i)).expect("layer").2.clone())
                .collect();
            let snap = s.snapshot_bytes().expect("snapshot");
            (out, strategies, snap.len())
        })
    };
    let with = run(2);
    for (out, strategies, _) in &with {
        match &strategies[0] {
            Strategy::Powersgd(c) => assert_eq!((c.rank, c.start), (2, 0)),
            s => panic!("fc got {s:?}"),
        }
        assert_eq!(strategies[1], Strategy::Dense, "a vector stays dense");
        // Below compress_threshold but a matrix PowerSGD shrinks: the
        // threshold keeps small layers from top-k, not from PowerSGD.
        assert!(
            matches!(&strategies[2], Strategy::Powersgd(c) if c.rank == 2),
            "conv got {:?}",
            strategies[2]
        );
        assert_eq!(out[2][0].1, "powersgd");
        for (mine, first) in out.iter().zip(&with[0].0) {
            assert_eq!(mine[0].0, first[0].0, "the same bits on every rank");
        }
    }
    let without = run(0);
    assert!(without[0]
        .1
        .iter()
        .all(|s| !matches!(s, Strategy::Powersgd(_))));
    // Without PowerSGD the small layer stays dense, never sparsified.
    assert_eq!(without[0].1[2], Strategy::Dense, "below compress_threshold");
    // The PowerSGD state is in the snapshot (Q and the error: more bytes).
    assert!(with[0].2 > without[0].2);
}

/// A `powersgd` layer PowerSGD leaves dense (a vector) beside `auto`
/// layers under a forced ring allreduce: the plan prices it in the ring's
/// dense group (it used to force Rabenseifner there, and no `auto` layer's
/// dense option fit), and the steps run.
#[test]
fn a_powersgd_vector_beside_auto_layers_under_the_ring() {
    let prof = psg_profile(1e9);
    let table: [(&str, &[usize]); 2] = [("bias", &[512]), ("fc", &[512, 1024])];
    let out = LocalComm::run(3, |c| {
        let r = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                profile: Some(prof.clone()),
                allreduce: Pick::Fixed(crate::dense::AllreduceAlgo::Ring),
                auto_powersgd: 1,
                ..cfg()
            },
        )
        .expect("engine");
        s.register_spec("bias", &[512], "powersgd").expect("bias");
        s.register("fc", &[512, 1024]).expect("fc");
        let out = steps(&mut s, r, &table, 0, 2, &psg_grad);
        let plan = s.auto_plan().expect("planned").clone();
        (out, plan)
    });
    let plan = &out[0].1;
    assert_eq!(plan.layers[0].choice, crate::cost::StrategyId::DenseRing);
    assert_eq!(out[0].0[1][0].1, "dense", "the vector runs dense");
}

/// A profile of `bandwidth` bytes/s (α 5 µs) that prices PowerSGD.
fn psg_profile(bandwidth: f64) -> crate::cost::Profile {
    let mut prof = crate::cost::Profile::from_network(5e-6, bandwidth, 0.0, 0.0).expect("profile");
    prof.powersgd = crate::cost::PowerSgdFit {
        a: 0.0,
        per_elem: 5e-10,
        per_elem_rank: 1e-9,
        ..crate::cost::PowerSgdFit::default()
    };
    prof
}
