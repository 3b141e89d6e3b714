//! The step model (`plan_step`): the exhaustive optimum, the dense threshold,
//! groups that open only when they pay, fixed layers, the dense local cost.

use super::*;

/// With constant β the step's cost is linear in each group's bytes once
/// the set of open groups is fixed, so the plan must be the optimum up to
/// the near-tie rule of its collectives (2 % of a group): compare with
/// every assignment of a small table.
#[test]
fn plan_step_is_the_exhaustive_optimum() {
    use StrategyId::*;
    let pr = prof();
    let ns = [64usize, 9408, 64, 1 << 20, 300, 2_000_000, 1];
    let allowed = [DenseRabenseifner, SparseAllgather, SparseAllgatherQuant];
    for p in [1usize, 2, 3, 4, 8, 32, 128] {
        let q = sq(p, &allowed);
        let layers = table(&ns);
        let plan = plan_step(&pr, &q, &layers).expect("plan");
        let mut best = f64::INFINITY;
        let mut choice = vec![DenseRabenseifner; ns.len()];
        for code in 0..3usize.pow(ns.len() as u32) {
            let mut c = code;
            for x in choice.iter_mut() {
                *x = allowed[c % 3];
                c /= 3;
            }
            let t = predict_step(&pr, &q, &layers, &choice)
                .expect("predict")
                .seconds;
            best = best.min(t);
        }
        // The simplest configuration within NEAR_TIE of the optimum.
        assert!(
            plan.seconds <= best * (1.0 + NEAR_TIE + 1e-12),
            "p={p}: plan {} vs optimum {best}",
            plan.seconds
        );
        // The plan's own total is what predict_step says for its choices.
        let mine: Vec<StrategyId> = plan.layers.iter().map(|l| l.choice).collect();
        let again = predict_step(&pr, &q, &layers, &mine).expect("predict");
        assert!(rel(again.seconds, plan.seconds) < 1e-12);
        // Groups: at most one dense and one sparse, holding every layer.
        assert!(plan.groups.len() <= 2);
        assert_eq!(
            plan.groups.iter().map(|g| g.layers).sum::<usize>(),
            ns.len()
        );
    }
}

/// `min_sparse_elems` keeps the smaller layers dense whatever their
/// price (a rule for convergence), and only them: on a slow, high-latency
/// network the plan by price alone sends the small layers sparse with the
/// big ones (a dense group would add its α); with the threshold those are
/// dense, the big layers stay sparse, and the plan's total is what
/// `predict_step` says for its choices.
#[test]
fn plan_step_keeps_layers_below_the_threshold_dense() {
    use StrategyId::*;
    let mut pr = Profile::from_network(1e-3, 1.25e8, 1.5e-10, 7e-10).expect("profile");
    pr.select
        .insert("trimmed".into(), LinearFit { a: 2e-5, b: 1.3e-9 });
    let ns = [64usize, 9408, 64, 1 << 20, 300, 2_000_000, 1];
    let allowed = [DenseRabenseifner, SparseAllgather];
    let layers = table(&ns);
    let free = plan_step(&pr, &sq(32, &allowed), &layers).expect("plan");
    let small_sparse = |plan: &StepPlan| {
        plan.layers
            .iter()
            .zip(ns)
            .filter(|(l, n)| *n < 32768 && !l.choice.is_dense())
            .count()
    };
    assert!(
        small_sparse(&free) > 0,
        "by price some small layer is sparse: {free:?}"
    );
    let q = StepQuery {
        min_sparse_elems: 32768,
        ..sq(32, &allowed)
    };
    let kept = plan_step(&pr, &q, &layers).expect("plan");
    assert_eq!(small_sparse(&kept), 0, "{kept:?}");
    for (i, n) in ns.iter().enumerate() {
        if *n >= 32768 {
            assert_eq!(kept.layers[i].choice, free.layers[i].choice, "layer {i}");
        }
    }
    let mine: Vec<StrategyId> = kept.layers.iter().map(|l| l.choice).collect();
    let again = predict_step(&pr, &q, &layers, &mine).expect("predict");
    assert!(rel(again.seconds, kept.seconds) < 1e-12);
}

/// The case: at p = 32, α = 5 µs, 1.25 GB/s, ResNet-50's 64-element
/// vectors must not be sent sparse (k = 1) just because a lone layer pays
/// an α either way: in the step they join the dense group, whose α the
/// step pays once, since each would cost a selection in the sparse group;
/// the convolutions go to the one sparse group.
#[test]
fn small_vectors_join_the_dense_group_in_a_fused_step() {
    use StrategyId::*;
    let mut pr = Profile::from_network(5e-6, 1.25e9, 0.0, 0.0).expect("profile");
    // A selection that costs 5 µs per layer plus 1 ns per element, as
    // calibrated on this machine's order of magnitude.
    pr.select
        .insert("trimmed".into(), LinearFit { a: 5e-6, b: 1e-9 });
    let mut ns = vec![9408usize, 64, 64, 36864, 64, 64, 2_359_296, 2048, 2048];
    ns.extend([64; 20]);
    let layers = table(&ns);
    let q = sq(32, &[DenseRabenseifner, SparseAllgather]);
    let plan = plan_step(&pr, &q, &layers).expect("plan");
    for l in &plan.layers {
        if l.elements <= 256 {
            assert_eq!(l.choice, DenseRabenseifner, "{}", l.name);
        } else {
            assert_eq!(l.choice, SparseAllgather, "{}", l.name);
        }
    }
    assert_eq!(plan.groups.len(), 2);
    // Alone, each small vector would have been predicted sparse (one α
    // instead of 2·lg p of them): the per-layer model's old mistake.
    let alone = predict(
        &pr,
        &Query {
            at: crate::cost::Placement {
                p: 32,
                ranks_per_node: None,
                fill: None,
                ..crate::cost::Placement::default()
            },
            n: 64,
            density: 0.001,
            gradiveq_ratio: 8.0,
        },
        "trimmed",
    )
    .expect("predict");
    assert_eq!(
        choose(&alone, &[DenseRabenseifner, SparseAllgather])
            .expect("choice")
            .id,
        SparseAllgather
    );
    // The planned step beats dense-only and all-sparse.
    let all = |id| {
        predict_step(&pr, &q, &layers, &vec![id; ns.len()])
            .expect("predict")
            .seconds
    };
    assert!(plan.seconds <= all(DenseRabenseifner));
    assert!(plan.seconds <= all(SparseAllgather));
}

/// A table of only small layers under a large α opens one group, never
/// two: the second group's α would cost more than any layer saves.
#[test]
fn a_second_group_opens_only_when_it_pays() {
    use StrategyId::*;
    let pr = Profile::from_network(1e-3, 1e9, 0.0, 0.0).expect("profile");
    let q = sq(16, &[DenseRabenseifner, SparseAllgather]);
    let plan = plan_step(&pr, &q, &table(&[64, 4096, 100_000, 64])).expect("plan");
    assert_eq!(plan.groups.len(), 1, "{:?}", plan.groups);
    // Every layer alone: the planner on a one-layer table and `predict`'s
    // choice agree (the same model, the same decision table).
    for n in [1usize, 64, 4096, 100_000, 1 << 22] {
        for p in [1usize, 2, 5, 16] {
            let q = sq(p, &[]);
            let plan = plan_step(&pr, &q, &table(&[n])).expect("plan");
            let preds = predict(
                &pr,
                &Query {
                    at: crate::cost::Placement {
                        p,
                        ranks_per_node: None,
                        fill: None,
                        ..crate::cost::Placement::default()
                    },
                    n,
                    density: q.density,
                    gradiveq_ratio: 8.0,
                },
                "trimmed",
            )
            .expect("predict");
            let c = choose(&preds, &default_candidates(&pr)).expect("choice");
            assert_eq!(plan.layers[0].choice, c.id, "n={n} p={p}");
            assert!(rel(plan.seconds, c.seconds) < 1e-12, "n={n} p={p}");
        }
    }
}

/// Fixed layers keep their strategy and force their group open; free
/// layers then join it at no α.
#[test]
fn fixed_layers_are_kept_and_open_their_group() {
    use StrategyId::*;
    let pr = Profile::from_network(1e-3, 1e9, 0.0, 0.0).expect("profile");
    let mut layers = table(&[1 << 20, 64, 64]);
    layers[0].kind = LayerKind::Fixed(DenseRing, 1.0);
    let q = sq(8, &[DenseRing, SparseAllgather]);
    let plan = plan_step(&pr, &q, &layers).expect("plan");
    assert!(!plan.layers[0].auto);
    for l in &plan.layers {
        assert_eq!(l.choice, DenseRing, "{}", l.name);
    }
    assert_eq!(plan.groups.len(), 1);
    assert_eq!(plan.groups[0].algorithm, DenseRing);
    // A fixed sparse layer opens the sparse group: the small ones join it.
    layers[0].kind = LayerKind::Fixed(SparseAllgather, 0.01);
    let plan = plan_step(&pr, &q, &layers).expect("plan");
    assert!(plan.layers.iter().all(|l| l.choice == SparseAllgather));
    // Errors name the parameter.
    let mut bad = sq(0, &[]);
    assert!(plan_step(&pr, &bad, &layers).is_err());
    bad.at.p = 2;
    bad.density = 0.0;
    assert!(plan_step(&pr, &bad, &layers).is_err());
    // An empty table is an empty step.
    let plan = plan_step(&pr, &sq(4, &[]), &[]).expect("plan");
    assert_eq!(plan.seconds, 0.0);
    assert!(plan.groups.is_empty());
}

/// The dense path's local cost follows the whole table's size: the same
/// layer costs more per element in a table larger than the cache (the
/// curve), a profile without the curve keeps its linear fit, and a curve
/// out of order does not validate.
#[test]
fn dense_local_cost_follows_the_table_size() {
    use StrategyId::*;
    let mut pr = Profile::from_network(1e-6, 1e9, 0.0, 0.0).expect("profile");
    pr.dense_local = LinearFit { a: 1e-5, b: 4e-10 };
    let n = 1 << 20;
    assert_eq!(
        pr.dense_local_at(n as f64, 1e9),
        pr.dense_local.at(n as f64)
    );
    // 0.1 ns/byte up to 16 MiB tables, 0.2 from 64 MiB.
    pr.dense_local_curve = curve(&[(16.0 * 1048576.0, 1e-10), (64.0 * 1048576.0, 2e-10)]);
    pr.validate().expect("valid");
    let small = pr.dense_local_at(n as f64, n as f64);
    let big = pr.dense_local_at(n as f64, 100e6);
    assert!(rel(small, 4.0 * n as f64 * 1e-10) < 1e-12, "{small}");
    assert!(rel(big, 4.0 * n as f64 * 2e-10) < 1e-12, "{big}");
    // The step model charges it per layer at the table's size.
    let q = sq(2, &[DenseRabenseifner]);
    let alone = plan_step(&pr, &q, &table(&[n])).expect("plan");
    let in_big = plan_step(&pr, &q, &table(&[n; 25])).expect("plan");
    let l0 = alone.layers[0].local_s;
    let l1 = in_big.layers[0].local_s;
    assert!(rel(l0, small) < 1e-12 && rel(l1, big) < 1e-12, "{l0} {l1}");
    pr.dense_local_curve.reverse();
    assert!(pr.validate().is_err());
}

/// A sparse layer's local cost follows the whole table's size too: alone
/// (its data in the caches) in a small table, at the calibration's tables
/// in one of their size or larger, log-linear between, another method at
/// its fit's ratio to the tables' own, never under the layer alone; a
/// profile without tables keeps the layer alone, and a hostile table does
/// not validate.
#[test]
fn sparse_local_cost_follows_the_table_size() {
    use StrategyId::*;
    let mut pr = prof();
    let n = 1 << 18;
    let nf = n as f64;
    let alone = pr.select_at("trimmed", 0.001, nf);
    assert_eq!(pr.select_in_table("trimmed", 0.001, nf, 1e9), alone);
    // Tables of 64 MiB: 1 ns a byte (4 an element) at 1 MiB layers, 2 at 16 MiB.
    let mib = 1048576.0;
    pr.select_table = Some(SelectTable {
        key: "trimmed".into(),
        table_bytes: 64.0 * mib,
        curve: curve(&[(mib, 1e-9), (16.0 * mib, 2e-9)]),
    });
    pr.validate().expect("valid");
    let big = pr.select_in_table("trimmed", 0.001, nf, 1e8);
    assert!(rel(big, 4.0 * nf * 1e-9) < 1e-12, "{big}");
    assert_eq!(pr.select_in_table("trimmed", 0.001, nf, 1e6), alone);
    // A 16 MiB table, halfway in log-size from 4 to 64 MiB: halfway.
    let mid = pr.select_in_table("trimmed", 0.001, nf, 4.0 * mib);
    assert!(rel(mid, (alone + big) / 2.0) < 1e-12, "{mid} {alone} {big}");
    // Quantized RGC at its fit's ratio to trimmed's.
    let ratio = pr.select["quant"].at(nf) / pr.select["trimmed"].at(nf);
    let quant = pr.select_in_table("quant", 0.001, nf, 1e8);
    assert!(rel(quant, big * ratio) < 1e-12, "{quant}");
    // Never under the layer alone: where the tables read cheaper than
    // it (noise, or a layer past the caches by itself), the layer alone.
    let mut cheap = pr.clone();
    cheap.select_table.as_mut().unwrap().curve = curve(&[(mib, 1e-12)]);
    assert_eq!(cheap.select_in_table("trimmed", 0.001, nf, 1e9), alone);
    // Past every size a probe measured (the tables' 1 MiB layers, the
    // one-layer probes' 4 MiB), the tables alone, cheaper or not.
    cheap
        .select_curve
        .insert("trimmed".into(), curve(&[(4.0 * mib, 1e-9)]));
    let (n4, n8) = (mib, 2.0 * mib); // 4 MiB and 8 MiB layers
    let alone4 = cheap.select_at("trimmed", 0.001, n4);
    assert_eq!(cheap.select_in_table("trimmed", 0.001, n4, 1e9), alone4);
    let past = cheap.select_in_table("trimmed", 0.001, n8, 1e9);
    assert!(rel(past, 4.0 * n8 * 1e-12) < 1e-12, "{past}");
    // The step model charges it per layer at the table's size.
    let q = sq(2, &[SparseAllgather]);
    let one = plan_step(&pr, &q, &table(&[n])).expect("plan");
    let many = plan_step(&pr, &q, &table(&[n; 128])).expect("plan");
    let (l0, l1) = (one.layers[0].local_s, many.layers[0].local_s);
    assert!(l1 > 1.5 * l0, "{l0} {l1}");
    // Hostile tables are refused, naming the field.
    for (bytes, c) in [(0.0, 1e-9), (f64::NAN, 1e-9), (64.0 * mib, -1e-9)] {
        let mut bad = pr.clone();
        bad.select_table = Some(SelectTable {
            key: "trimmed".into(),
            table_bytes: bytes,
            curve: curve(&[(mib, c)]),
        });
        let e = bad.validate().expect_err("refused").to_string();
        assert!(e.contains("select_table"), "{e}");
    }
    // It survives JSON; a profile without it leaves it out.
    let back: Profile = serde_json::from_str(&serde_json::to_string(&pr).unwrap()).unwrap();
    assert_eq!(back, pr);
    assert!(!serde_json::to_string(&prof())
        .unwrap()
        .contains("select_table"));
}
