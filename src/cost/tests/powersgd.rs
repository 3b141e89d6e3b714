//! PowerSGD in the step model: its group's two allreduces and local
//! products priced as written, the planner choosing it where it pays and
//! never where it cannot run, and a table mixing it with dense and sparse
//! groups.

use super::*;
use crate::cost::step::alone;

fn psg_prof() -> Profile {
    let mut p = prof();
    p.powersgd = PowerSgdFit {
        a: 1e-5,
        per_elem: 2e-9,
        per_elem_rank: 1e-9,
        ..PowerSgdFit::default()
    };
    p
}

fn layer(name: &str, rows: usize, cols: usize, kind: LayerKind) -> StepLayer {
    StepLayer {
        name: name.into(),
        n: rows * cols,
        kind,
        matrix: Some((rows, cols)),
    }
}

/// The Rabenseifner allreduce of `bytes` at `p` ranks, written out.
fn raben(pr: &Profile, p: usize, bytes: f64) -> f64 {
    let (pf, lg) = (p as f64, (p as f64).log2().ceil());
    let f = (pf - 1.0) / pf;
    let mut t = 2.0 * lg * pr.alpha + 2.0 * f * bytes * pr.beta + f * bytes * pr.gamma_reduce;
    if !p.is_power_of_two() {
        t += pr.alpha + 2.0 * bytes * pr.beta + 0.5 * bytes * pr.gamma_reduce;
    }
    t
}

#[test]
fn a_fixed_powersgd_layer_is_its_products_and_two_allreduces() {
    let pr = psg_prof();
    for p in [2usize, 3, 4, 8] {
        for (rows, cols, r) in [(512usize, 4608usize, 1usize), (1024, 1024, 4), (64, 27, 2)] {
            let l = layer(
                "w",
                rows,
                cols,
                LayerKind::Fixed(StrategyId::Powersgd, r as f64),
            );
            let plan = plan_step(&pr, &sq(p, &[]), &[l]).expect("plan");
            let lp = &plan.layers[0];
            assert_eq!(lp.choice, StrategyId::Powersgd, "p={p}");
            assert_eq!(lp.group, GroupKind::Lowrank);
            let n = (rows * cols) as f64;
            let local = 1e-5 + 2e-9 * n + 1e-9 * n * r as f64;
            let comm =
                raben(&pr, p, 4.0 * (rows * r) as f64) + raben(&pr, p, 4.0 * (cols * r) as f64);
            assert!(
                rel(plan.seconds, local + comm) < 1e-9,
                "p={p}: {} vs {}",
                plan.seconds,
                local + comm
            );
            let g = plan
                .groups
                .iter()
                .find(|g| g.kind == GroupKind::Lowrank)
                .expect("group");
            assert!(rel(g.comm_s, comm) < 1e-9);
            assert!(rel(lp.alone_s, local + comm) < 1e-9);
            assert_eq!(g.message_bytes, 4.0 * ((rows + cols) * r) as f64);
        }
    }
}

#[test]
fn a_layer_powersgd_would_not_shrink_is_priced_dense() {
    let pr = psg_prof();
    // A fixed PowerSGD layer the engine leaves dense has no matrix (a
    // vector, or factors not `min_rate` times smaller: `Layer::matrix`):
    // priced in the dense group.
    let v = StepLayer {
        name: "bias".into(),
        n: 512,
        kind: LayerKind::Fixed(StrategyId::Powersgd, 2.0),
        matrix: None,
    };
    let plan = plan_step(&pr, &sq(4, &[]), &[v]).expect("plan");
    assert_eq!(plan.layers[0].choice, StrategyId::DenseRabenseifner);
    assert_eq!(plan.layers[0].group, GroupKind::Dense);
    // A free 4 x 4 matrix at rank 2 (factors 16 of 16 elements): never
    // PowerSGD, whatever the network.
    let mut slow = psg_prof();
    slow.beta = 1e-6;
    let tiny = layer("tiny", 4, 4, LayerKind::Auto);
    let mut q = sq(4, &[StrategyId::DenseRabenseifner, StrategyId::Powersgd]);
    q.powersgd_rank = 2;
    let plan = plan_step(&slow, &q, &[tiny]).expect("plan");
    assert_eq!(plan.layers[0].choice, StrategyId::DenseRabenseifner);
}

#[test]
fn the_planner_chooses_powersgd_where_it_pays_and_never_without_a_matrix() {
    let mut pr = psg_prof();
    // A slow link: 100 MB/s.
    pr.beta = 1e-8;
    // Against dense (RGC's selection at these fits is cheaper than
    // these products: it wins when it is a candidate, checked below).
    let cands = [StrategyId::DenseRabenseifner, StrategyId::Powersgd];
    let big = layer("fc", 2048, 4096, LayerKind::Auto);
    let mut vector = table(&[2048 * 4096]);
    vector[0].name = "flat".into();
    let bias = table(&[64]).remove(0);
    let layers = vec![big, vector.remove(0), bias];
    let mut q = sq(16, &cands);
    q.powersgd_rank = 2;
    let plan = plan_step(&pr, &q, &layers).expect("plan");
    assert_eq!(plan.layers[0].choice, StrategyId::Powersgd, "{plan:?}");
    assert_ne!(plan.layers[1].choice, StrategyId::Powersgd, "no matrix");
    assert_eq!(plan.layers[2].group, GroupKind::Dense);
    // The step is the sum of its groups, each paid once.
    let sum: f64 = plan.groups.iter().map(|g| g.comm_s + g.local_s).sum();
    assert!(rel(plan.seconds, sum) < 1e-12);
    assert!(plan.groups.iter().any(|g| g.kind == GroupKind::Lowrank));
    // predict_step of the same choices prices the same step.
    let choice: Vec<StrategyId> = plan.layers.iter().map(|l| l.choice).collect();
    let again = predict_step(&pr, &q, &layers, &choice).expect("predict");
    assert!(rel(again.seconds, plan.seconds) < 1e-12);
    // With RGC among the candidates, the cheaper of the two per layer.
    let mut q3 = sq(
        16,
        &[
            StrategyId::DenseRabenseifner,
            StrategyId::SparseAllgather,
            StrategyId::Powersgd,
        ],
    );
    q3.powersgd_rank = 2;
    let plan3 = plan_step(&pr, &q3, &layers[..1]).expect("plan");
    let psg = alone(
        &pr,
        &q3,
        (layers[0].n, layers[0].matrix),
        StrategyId::Powersgd,
        2.0,
    )
    .seconds;
    let rgc = alone(
        &pr,
        &q3,
        (layers[0].n, None),
        StrategyId::SparseAllgather,
        0.001,
    )
    .seconds;
    let want = if psg < rgc {
        StrategyId::Powersgd
    } else {
        StrategyId::SparseAllgather
    };
    assert_eq!(
        plan3.layers[0].choice, want,
        "powersgd {psg} s, rgc {rgc} s"
    );
    // A fast link: two allreduces' α and the products cost more than the
    // dense bytes save on a small matrix; not chosen.
    let mut fast = psg_prof();
    fast.beta = 1e-12;
    let small = layer("conv", 64, 576, LayerKind::Auto);
    let plan = plan_step(&fast, &q, &[small]).expect("plan");
    assert_ne!(plan.layers[0].choice, StrategyId::Powersgd, "{plan:?}");
    // Without the profile's fit, not a default candidate.
    assert!(!default_candidates(&prof()).contains(&StrategyId::Powersgd));
    assert!(default_candidates(&pr).contains(&StrategyId::Powersgd));
}

#[test]
fn a_table_mixing_powersgd_sparse_and_dense_prices_every_group_once() {
    let pr = psg_prof();
    let layers = vec![
        layer(
            "conv",
            256,
            2304,
            LayerKind::Fixed(StrategyId::Powersgd, 1.0),
        ),
        layer(
            "conv2",
            512,
            4608,
            LayerKind::Fixed(StrategyId::Powersgd, 1.0),
        ),
        StepLayer {
            name: "fc".into(),
            n: 1 << 20,
            kind: LayerKind::Fixed(StrategyId::SparseAllgather, 0.01),
            matrix: None,
        },
        StepLayer {
            name: "bias".into(),
            n: 1000,
            kind: LayerKind::Fixed(StrategyId::DenseRabenseifner, 1.0),
            matrix: None,
        },
    ];
    let p = 4;
    let plan = plan_step(&pr, &sq(p, &[]), &layers).expect("plan");
    let kinds: Vec<GroupKind> = plan.groups.iter().map(|g| g.kind).collect();
    assert_eq!(
        kinds,
        [GroupKind::Dense, GroupKind::Sparse, GroupKind::Lowrank]
    );
    let lr = &plan.groups[2];
    // One pair of allreduces for both layers: P = 4·(256 + 512), Q = 4·(2304 + 4608).
    let comm = raben(&pr, p, 4.0 * 768.0) + raben(&pr, p, 4.0 * 6912.0);
    assert!(rel(lr.comm_s, comm) < 1e-9, "{} vs {comm}", lr.comm_s);
    assert_eq!(lr.layers, 2);
    let local: f64 = [(256.0 * 2304.0), (512.0 * 4608.0)]
        .iter()
        .map(|n| 1e-5 + 3e-9 * n)
        .sum();
    assert!(rel(lr.local_s, local) < 1e-9);
}

fn query(p: usize, n: usize) -> Query {
    Query {
        at: crate::cost::Placement {
            p,
            ..crate::cost::Placement::default()
        },
        n,
        density: 0.001,
        gradiveq_ratio: 8.0,
    }
}

#[test]
fn predict_lists_powersgd_on_the_layers_matrix_where_the_profile_prices_it() {
    let (rows, cols) = (512usize, 4608usize);
    let q = query(8, rows * cols);
    // No PowerSGD fit in the profile: not listed.
    let none = predict_matrix(&prof(), &q, "trimmed", (rows, cols), 2).expect("predict");
    assert!(none.iter().all(|x| x.id != StrategyId::Powersgd));
    assert_eq!(none, predict(&prof(), &q, "trimmed").expect("predict"));
    // With one: every strategy, in STRATEGIES order, PowerSGD priced as
    // the planner prices that layer fixed at the same rank alone.
    let pr = psg_prof();
    let v = predict_matrix(&pr, &q, "trimmed", (rows, cols), 2).expect("predict");
    let ids: Vec<StrategyId> = v.iter().map(|x| x.id).collect();
    assert_eq!(ids, StrategyId::ALL.to_vec());
    let x = v
        .iter()
        .find(|x| x.id == StrategyId::Powersgd)
        .expect("listed");
    let l = layer("w", rows, cols, LayerKind::Fixed(StrategyId::Powersgd, 2.0));
    let plan = plan_step(&pr, &sq(8, &[]), &[l]).expect("plan");
    assert!(
        rel(x.seconds, plan.seconds) < 1e-9,
        "{} vs {}",
        x.seconds,
        plan.seconds
    );
    assert_eq!(x.wire_bytes, plan.wire_bytes);
    // A higher rank costs more.
    let r4 = predict_matrix(&pr, &q, "trimmed", (rows, cols), 4).expect("predict");
    assert!(r4[StrategyId::Powersgd as usize].seconds > x.seconds);
    // A vector (one row) is not compressed: priced dense, as it runs.
    let vq = query(8, 4608);
    let d = predict_matrix(&pr, &vq, "trimmed", (1, 4608), 2).expect("predict");
    assert_eq!(
        d[StrategyId::Powersgd as usize].seconds,
        d[StrategyId::DenseRabenseifner as usize].seconds
    );
    // A matrix that cannot hold the layer, or rank 0: errors.
    assert!(predict_matrix(&pr, &q, "trimmed", (2, 3), 2).is_err());
    assert!(predict_matrix(&pr, &q, "trimmed", (0, rows * cols), 2).is_err());
    assert!(predict_matrix(&pr, &q, "trimmed", (rows, cols), 0).is_err());
}

#[test]
fn square_view_holds_the_layer_in_a_nearly_square_matrix() {
    for n in [
        1usize,
        2,
        3,
        7,
        16,
        17,
        1000,
        9408,
        1 << 20,
        (1 << 20) + 1,
        usize::MAX,
    ] {
        let (r, c) = square_view(n);
        assert!(r >= 1 && c >= 1, "n={n}");
        let cells = r as u128 * c as u128;
        assert!(
            cells >= n as u128 && cells - (n as u128) < r as u128,
            "n={n}: {r} x {c}"
        );
        assert!(r <= c && c <= r + 3, "n={n}: {r} x {c}");
    }
    assert_eq!(square_view(1 << 20), (1024, 1024));
}

#[test]
fn crossover_prices_powersgd_on_square_views_and_needs_its_fit() {
    let base = query(8, 1);
    let pair = ("powersgd", "dense-rabenseifner");
    let e = crossover(&prof(), &base, "trimmed", pair, 1 << 26, 1).expect_err("no fit");
    assert!(e.to_string().contains("does not price PowerSGD"), "{e}");
    let pr = psg_prof();
    let x = crossover(&pr, &base, "trimmed", pair, 1 << 26, 1)
        .expect("crossover")
        .expect("PowerSGD wins on large layers");
    let d = |n: usize| {
        let v = predict_matrix(&pr, &query(8, n), "trimmed", square_view(n), 1).expect("p");
        v[StrategyId::Powersgd as usize].seconds - v[StrategyId::DenseRabenseifner as usize].seconds
    };
    assert!(d(x) < 0.0 && d(2 * x) < 0.0 && d(1 << 26) < 0.0, "x={x}");
    assert!(
        powersgd_compresses(x, 1),
        "x={x}: a size PowerSGD compresses"
    );
    // Against the ring: sizes PowerSGD leaves dense (priced as
    // Rabenseifner there) are never counted as its wins.
    let ring = crossover(
        &pr,
        &base,
        "trimmed",
        ("powersgd", "dense-ring"),
        1 << 26,
        1,
    )
    .expect("crossover")
    .expect("a crossover");
    assert!(powersgd_compresses(ring, 1) && ring > 1, "{ring}");
    assert!(x < 100 || d(x * 95 / 100) >= 0.0, "x={x}");
}

fn pt(elements: usize, rank: usize, per_elem: f64) -> PowerSgdPoint {
    PowerSgdPoint {
        elements,
        rank,
        per_elem,
    }
}

/// The measured curve prices a layer by its size and rank: the probed
/// points exactly, log-linear in size between them and flat past them,
/// linear in rank between probed ranks and along the last two past them;
/// without a curve, the linear fit.
#[test]
fn powersgd_curve_interpolates_in_log_size_and_rank() {
    let lin = PowerSgdFit {
        a: 1e-5,
        per_elem: 2e-9,
        per_elem_rank: 1e-9,
        ..PowerSgdFit::default()
    };
    assert!(rel(lin.at(1e6, 2.0), 1e-5 + 2e-3 + 2e-3) < 1e-12);
    let (ku, mu) = (262144usize, 8388608usize);
    let (k, m) = (ku as f64, mu as f64);
    let f = PowerSgdFit {
        // Out of order, as a hand-written profile may be.
        curve: vec![
            pt(mu, 1, 1.9e-9),
            pt(ku, 1, 0.7e-9),
            pt(ku, 2, 1.5e-9),
            pt(mu, 4, 2.9e-9),
            pt(mu, 2, 2.8e-9),
            pt(ku, 4, 1.8e-9),
        ],
        ..lin.clone()
    };
    assert!(!f.is_zero());
    // The probed points themselves.
    assert!(rel(f.at(k, 2.0), 1.5e-9 * k) < 1e-12);
    assert!(rel(f.at(m, 4.0), 2.9e-9 * m) < 1e-12);
    // Halfway in log-size (√(k·m)): halfway in cost per element.
    let mid = (k * m).sqrt();
    assert!(rel(f.at(mid, 2.0), (1.5e-9 + 2.8e-9) / 2.0 * mid) < 1e-9);
    // Flat per element past the ends.
    assert!(rel(f.at(1000.0, 1.0), 0.7e-9 * 1000.0) < 1e-12);
    assert!(rel(f.at(4.0 * m, 1.0), 1.9e-9 * 4.0 * m) < 1e-12);
    // Rank 3 halfway between 2 and 4; rank 8 along the line through 2
    // and 4; below the first probed rank, the first's.
    assert!(rel(f.at(k, 3.0), 1.65e-9 * k) < 1e-9);
    assert!(rel(f.at(k, 8.0), (1.8e-9 + 2.0 * 0.3e-9) * k) < 1e-9);
    assert!(rel(f.at(k, 0.5), 0.7e-9 * k) < 1e-12);
    // Costs grow with the size and the rank here.
    assert!(f.at(2e6, 2.0) > f.at(1e6, 2.0) && f.at(1e6, 4.0) > f.at(1e6, 2.0));
    // A noisy curve whose higher rank came out cheaper: past it, flat,
    // never down to nothing; a NaN size or rank is NaN, not free.
    let falling = PowerSgdFit {
        curve: vec![pt(ku, 2, 2e-9), pt(ku, 4, 1e-9)],
        ..PowerSgdFit::default()
    };
    assert!(rel(falling.at(k, 32.0), 1e-9 * k) < 1e-12);
    assert!(falling.at(f64::NAN, 2.0).is_nan() && falling.at(k, f64::NAN).is_nan());
    // A curve of one point prices everything at its per-element cost.
    let one = PowerSgdFit {
        curve: vec![pt(ku, 2, 1e-9)],
        ..PowerSgdFit::default()
    };
    assert!(!one.is_zero());
    assert!(rel(one.at(5.0 * k, 7.0), 5.0 * k * 1e-9) < 1e-12);
    // The profile check refuses a hostile curve, naming powersgd.
    for bad in [
        pt(0, 1, 1e-9),
        pt(ku, 0, 1e-9),
        pt(ku, 1, -1e-9),
        pt(ku, 1, f64::NAN),
        pt(ku, 1, f64::INFINITY),
    ] {
        let mut p = psg_prof();
        p.powersgd.curve = vec![bad];
        let e = p.validate().expect_err("refused").to_string();
        assert!(e.contains("powersgd"), "{e}");
    }
    let mut p = psg_prof();
    p.powersgd.curve = vec![pt(ku, 1, 1e-9); 65];
    assert!(p.validate().is_err(), "at most 64 points");
    p.powersgd.curve = vec![pt(ku, 1, 0.0), pt(ku, 2, 0.0)];
    assert!(
        p.validate().is_err(),
        "a curve of zeros would make PowerSGD free"
    );
    // A profile with a curve survives JSON; one without leaves it out.
    let mut p = psg_prof();
    p.powersgd = f.clone();
    let back: Profile = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back.powersgd, f);
    assert!(!serde_json::to_string(&psg_prof())
        .unwrap()
        .contains("curve"));
}

/// In a table of the calibration's tables' size or larger, a PowerSGD
/// layer costs its curve's price times the tables' ratio to the curve at
/// the probed sizes (log-linear between them, the nearest past them, never
/// below 1); in a small table, its curve's price alone.
#[test]
fn powersgd_in_a_large_table_takes_the_tables_ratio() {
    let (ku, mu) = (262144usize, 4194304usize);
    let mut f = PowerSgdFit {
        curve: vec![pt(ku, 2, 2e-9), pt(mu, 2, 4e-9)],
        ..PowerSgdFit::default()
    };
    let k = ku as f64;
    assert_eq!(f.at_in_table(k, 2.0, 1e9), f.at(k, 2.0), "no tables");
    f.table = vec![pt(ku, 2, 3e-9), pt(mu, 2, 3e-9)];
    f.table_bytes = 64.0 * 1048576.0;
    // 1.5 times at 256 Ki, 0.75 (so 1: noise) at 4 Mi, 1.25 halfway in
    // log-size.
    assert!(rel(f.at_in_table(k, 2.0, 1e8), 1.5 * f.at(k, 2.0)) < 1e-12);
    assert!(rel(f.at_in_table(k, 4.0, 1e8), 1.5 * f.at(k, 4.0)) < 1e-12);
    let m = mu as f64;
    assert_eq!(f.at_in_table(m, 2.0, 1e8), f.at(m, 2.0));
    let mid = (k * m).sqrt();
    assert!(rel(f.at_in_table(mid, 2.0, 1e8), 1.25 * f.at(mid, 2.0)) < 1e-9);
    assert_eq!(f.at_in_table(k, 2.0, 1e6), f.at(k, 2.0), "a small table");
    // The profile check names a hostile table.
    let mut p = psg_prof();
    p.powersgd = f.clone();
    p.validate().expect("valid");
    p.powersgd.table = vec![pt(ku, 2, f64::NAN)];
    let e = p.validate().expect_err("refused").to_string();
    assert!(e.contains("powersgd.table"), "{e}");
    p.powersgd = f.clone();
    p.powersgd.table_bytes = -1.0;
    assert!(p.validate().is_err());
}
