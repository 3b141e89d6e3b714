use super::*;

fn prof() -> Profile {
    let mut p = Profile::from_network(3e-6, 2.5e9, 1.5e-10, 7e-10).expect("profile");
    p.select
        .insert("trimmed".into(), LinearFit { a: 2e-5, b: 1.3e-9 });
    p.select
        .insert("quant".into(), LinearFit { a: 4e-5, b: 5e-9 });
    p
}

fn get(preds: &[Prediction], name: &str) -> f64 {
    preds.iter().find(|p| p.name == name).expect(name).seconds
}

fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}

/// The issue's formulas, written out independently of the module.
#[test]
fn predictions_equal_the_documented_formulas() {
    let pr = prof();
    let (al, be, gr, gu) = (pr.alpha, pr.beta, pr.gamma_reduce, pr.gamma_unpack);
    for p in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 16, 100, 128] {
        for n in [1usize, 1000, 65_536, 4_000_001] {
            for d in [0.001, 0.01, 0.5] {
                let q = Query {
                    n,
                    p,
                    density: d,
                    gradiveq_ratio: 8.0,
                    ranks_per_node: None,
                    fill: None,
                };
                let preds = predict(&pr, &q, "trimmed").expect("predict");
                let pf = p as f64;
                let lg = (pf).log2().ceil();
                let nb = 4.0 * n as f64;
                let k = (d * n as f64).ceil();
                // The message as the engine sends it: codec header (12),
                // RedSync's unit, table-of-contents entry (16), fused header (16).
                let m = 16.0 + 8.0 * k;
                let sparse =
                    2e-5 + 1.3e-9 * n as f64 + lg * al + (pf - 1.0) * (m + 32.0) * be + pf * m * gu;
                let mq = 20.0 + 4.0 * k;
                let quant =
                    4e-5 + 5e-9 * n as f64 + lg * al + (pf - 1.0) * (mq + 32.0) * be + pf * mq * gu;
                let f = (pf - 1.0) / pf;
                let mut raben = 2.0 * lg * al + 2.0 * f * nb * be + f * nb * gr;
                if !p.is_power_of_two() {
                    raben += al + 2.0 * nb * be + 0.5 * nb * gr;
                }
                let ring = 2.0 * (pf - 1.0) * al + 2.0 * f * nb * be + f * nb * gr;
                let cb = nb / 8.0;
                let gring = 2.0 * (pf - 1.0) * al + 2.0 * f * cb * be + f * cb * gr;
                for (name, want) in [
                    ("sparse-allgather", sparse),
                    ("sparse-allgather-quant", quant),
                    ("dense-rabenseifner", if p == 1 { 0.0 } else { raben }),
                    ("dense-ring", ring),
                    ("gradiveq-ring", gring),
                ] {
                    let got = get(&preds, name);
                    assert!(
                        rel(got, want) < 1e-9,
                        "{name} p={p} n={n} d={d}: {got} vs {want}"
                    );
                }
                assert_eq!(preds.len(), STRATEGIES.len());
            }
        }
    }
}

#[test]
fn one_rank_costs_only_local_work() {
    let pr = prof();
    let preds = predict(
        &pr,
        &Query {
            n: 1 << 20,
            p: 1,
            density: 0.001,
            gradiveq_ratio: 8.0,
            ranks_per_node: None,
            fill: None,
        },
        "trimmed",
    )
    .expect("predict");
    assert_eq!(get(&preds, "dense-rabenseifner"), 0.0);
    assert_eq!(get(&preds, "dense-ring"), 0.0);
    let k = (0.001f64 * f64::from(1u32 << 20)).ceil();
    let want = 2e-5 + 1.3e-9 * f64::from(1u32 << 20) + (16.0 + 8.0 * k) * pr.gamma_unpack;
    assert!(rel(get(&preds, "sparse-allgather"), want) < 1e-12);
}

#[test]
fn redsync_traffic_remark_at_p128() {
    // "When p is 128, the communication bandwidth for sparse synchronization
    // will be 12.8% of dense" at D = 0.1%.
    let pr = prof();
    let preds = predict(
        &pr,
        &Query {
            n: 25_000_000,
            p: 128,
            density: 0.001,
            gradiveq_ratio: 8.0,
            ranks_per_node: None,
            fill: None,
        },
        "trimmed",
    )
    .expect("predict");
    let w = |n: &str| preds.iter().find(|p| p.name == n).expect(n).wire_bytes;
    let r = w("sparse-allgather") / w("dense-rabenseifner");
    assert!((r - 0.128).abs() < 0.001, "{r}");
}

#[test]
fn gradiveq_compression_is_hidden_up_to_the_transfer_time() {
    let mut pr = prof();
    let q = Query {
        n: 1 << 22,
        p: 4,
        density: 0.001,
        gradiveq_ratio: 8.0,
        ranks_per_node: None,
        fill: None,
    };
    let base = get(&predict(&pr, &q, "trimmed").expect("p"), "gradiveq-ring");
    // A tiny compression cost: only the first segment's quarter shows.
    pr.gradiveq_compress = LinearFit { a: 0.0, b: 1e-12 };
    let t = get(&predict(&pr, &q, "trimmed").expect("p"), "gradiveq-ring");
    let tc = 1e-12 * f64::from(1u32 << 22);
    assert!(rel(t - base, tc / 4.0) < 1e-9);
    // A huge one: everything beyond the transfer time shows.
    pr.gradiveq_compress = LinearFit { a: 1.0, b: 0.0 };
    let t = get(&predict(&pr, &q, "trimmed").expect("p"), "gradiveq-ring");
    let phase = 3.0 * (pr.alpha + 4.0 * f64::from(1u32 << 22) / 8.0 / 4.0 * pr.beta);
    assert!(rel(t - base, 0.25 + (0.75 - phase)) < 1e-9);
}

fn base8() -> Query {
    Query {
        n: 1,
        p: 8,
        density: 0.001,
        gradiveq_ratio: 8.0,
        ranks_per_node: None,
        fill: None,
    }
}

#[test]
fn crossover_matches_a_direct_scan() {
    let pr = prof();
    let x = crossover(
        &pr,
        &base8(),
        "trimmed",
        "sparse-allgather",
        "dense-rabenseifner",
        1 << 26,
    )
    .expect("crossover")
    .expect("sparse wins for large layers");
    let d = |n: usize| {
        let p = predict(
            &pr,
            &Query {
                n,
                p: 8,
                density: 0.001,
                gradiveq_ratio: 8.0,
                ranks_per_node: None,
                fill: None,
            },
            "trimmed",
        )
        .expect("p");
        get(&p, "sparse-allgather") - get(&p, "dense-rabenseifner")
    };
    assert!(d(x) < 0.0 && d(x * 2) < 0.0);
    assert!(d(x * 98 / 100) >= 0.0 || x < 100);
    // A selection cost above the dense per-element cost: sparse never wins.
    let mut slow = pr.clone();
    slow.select
        .insert("trimmed".into(), LinearFit { a: 0.0, b: 1e-6 });
    assert_eq!(
        crossover(
            &slow,
            &base8(),
            "trimmed",
            "sparse-allgather",
            "dense-rabenseifner",
            1 << 26
        )
        .expect("crossover"),
        None
    );
}

#[test]
fn linear_fit_recovers_a_line_and_profiles_validate() {
    let pts: Vec<(f64, f64)> = (1..10)
        .map(|i| (i as f64 * 1000.0, 5e-6 + 2e-9 * i as f64 * 1000.0))
        .collect();
    let f = LinearFit::fit(&pts);
    assert!(rel(f.a, 5e-6) < 1e-6 && rel(f.b, 2e-9) < 1e-6);
    assert!(Profile::from_network(1e-6, 0.0, 0.0, 0.0).is_err());
    let mut p = prof();
    p.alpha = f64::NAN;
    assert!(p.validate().is_err());
    let p = prof();
    let json = serde_json::to_string(&p).expect("json");
    let back: Profile = serde_json::from_str(&json).expect("parse");
    assert_eq!(back, p);
    assert!(serde_json::from_str::<Profile>(r#"{"alpha":1,"beta":1,"bogus":2}"#).is_err());
    assert!(predict(
        &p,
        &Query {
            n: 10,
            p: 0,
            density: 0.1,
            gradiveq_ratio: 8.0,
            ranks_per_node: None,
            fill: None,
        },
        "trimmed"
    )
    .is_err());
    assert!(predict(
        &p,
        &Query {
            n: 10,
            p: 2,
            density: 0.0,
            gradiveq_ratio: 8.0,
            ranks_per_node: None,
            fill: None,
        },
        "trimmed"
    )
    .is_err());
}

fn curve(points: &[(f64, f64)]) -> Vec<CurvePoint> {
    points
        .iter()
        .map(|&(bytes, per_byte)| CurvePoint { bytes, per_byte })
        .collect()
}

/// β(m) interpolates linearly in log m and is constant beyond the ends; an
/// empty curve is the constant β, bit for bit.
#[test]
fn curves_interpolate_in_log_size_and_fall_back_exactly() {
    let c = curve(&[(1024.0, 4e-10), (4096.0, 2e-10), (65536.0, 1e-10)]);
    assert_eq!(curve_at(&c, 9.0, 10.0), 4e-10);
    assert_eq!(curve_at(&c, 9.0, 1024.0), 4e-10);
    assert!(rel(curve_at(&c, 9.0, 2048.0), 3e-10) < 1e-12);
    assert!(rel(curve_at(&c, 9.0, 16384.0), 1.5e-10) < 1e-12);
    assert_eq!(curve_at(&c, 9.0, 1e9), 1e-10);
    assert_eq!(curve_at(&[], 9.0, 123.0), 9.0);
    // Byte-weighted mean over messages.
    let m = curve_mean(&c, 9.0, &[1024.0, 65536.0]);
    assert!(rel(m, (1024.0 * 4e-10 + 65536.0 * 1e-10) / 66560.0) < 1e-12);
    assert_eq!(curve_mean(&[], 0.123, &[1.0, 2.0]), 0.123);
    assert_eq!(curve_mean(&c, 0.123, &[]), 0.123);
}

/// With curves, each strategy is its closed form under the byte-weighted β
/// and γ of its own messages: p = 2 Rabenseifner and ring are
/// `2α + 2·(N/2)·β(N/2) + (N/2)·γ(N/2)`; p = 4 Rabenseifner sends N/2 and
/// N/4 twice and reduces N/2 and N/4; the allgather of p = 4 moves m then 2m.
#[test]
fn curves_follow_each_algorithm_s_messages() {
    let mut pr = prof();
    pr.beta_curve = curve(&[(4096.0, 5e-10), (1048576.0, 1e-10), (16777216.0, 3e-10)]);
    pr.gamma_reduce_curve = curve(&[(4096.0, 1e-10), (16777216.0, 4e-10)]);
    for n in [1024usize, 100_000, 1 << 20, 4 << 20] {
        let nb = 4.0 * n as f64;
        let (b, g) = (pr.beta_at(nb / 2.0), pr.gamma_reduce_at(nb / 2.0));
        let want = 2.0 * pr.alpha + nb * b + nb / 2.0 * g;
        assert!(rel(dense_rabenseifner(&pr, nb, 2), want) < 1e-12);
        assert!(rel(dense_ring(&pr, nb, 2), want) < 1e-12);
        let (b1, b2) = (pr.beta_at(nb / 2.0), pr.beta_at(nb / 4.0));
        let (g1, g2) = (pr.gamma_reduce_at(nb / 2.0), pr.gamma_reduce_at(nb / 4.0));
        let want4 =
            4.0 * pr.alpha + 2.0 * (nb / 2.0 * b1 + nb / 4.0 * b2) + nb / 2.0 * g1 + nb / 4.0 * g2;
        assert!(rel(dense_rabenseifner(&pr, nb, 4), want4) < 1e-12, "n={n}");
        let ring4 = 6.0 * pr.alpha
            + 1.5 * nb * pr.beta_at(nb / 4.0)
            + 0.75 * nb * pr.gamma_reduce_at(nb / 4.0);
        assert!(rel(dense_ring(&pr, nb, 4), ring4) < 1e-12);
        let m = 4.0 + 8.0 * (0.01 * n as f64).ceil();
        let ag = 2.0 * pr.alpha
            + m * pr.beta_at(m)
            + 2.0 * m * pr.beta_at(2.0 * m)
            + 4.0 * m * pr.gamma_unpack;
        assert!(rel(allgather_unpack(&pr, m, 4), ag) < 1e-12);
    }
    // A flat curve is the constant model.
    let mut flat = prof();
    flat.beta_curve = curve(&[(1.0, flat.beta), (1e9, flat.beta)]);
    for p in [2usize, 3, 6, 8] {
        let q = Query {
            n: 123_457,
            p,
            density: 0.01,
            gradiveq_ratio: 8.0,
            ranks_per_node: None,
            fill: None,
        };
        let (a, b) = (
            predict(&prof(), &q, "trimmed").expect("predict"),
            predict(&flat, &q, "trimmed").expect("predict"),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!(rel(x.seconds, y.seconds) < 1e-12, "{} p={p}", x.name);
        }
    }
}

/// Curves are validated (sizes increasing, values finite and ≥ 0), and a
/// version-1 profile without curves still loads.
#[test]
fn curves_are_validated_and_version_1_profiles_load() {
    let mut pr = prof();
    pr.beta_curve = curve(&[(4096.0, 1e-10), (1024.0, 1e-10)]);
    assert!(pr.validate().is_err());
    pr.beta_curve = curve(&[(4096.0, -1e-10)]);
    assert!(pr.validate().is_err());
    pr.beta_curve = curve(&[(0.0, 1e-10)]);
    assert!(pr.validate().is_err());
    pr.beta_curve = Vec::new();
    pr.gamma_reduce_curve = curve(&[(1.0, f64::INFINITY)]);
    assert!(pr.validate().is_err());
    pr.gamma_reduce_curve = Vec::new();
    pr.gamma_unpack_curve = curve(&[(1.0, f64::NAN)]);
    let e = pr.validate().unwrap_err().to_string();
    assert!(e.contains("gamma_unpack_curve[0]"), "{e}");
    pr.gamma_unpack_curve = curve(&[(64.0, 1e-9), (64.0, 2e-9)]);
    assert!(pr.validate().is_err());
    let v1: Profile =
        serde_json::from_str(r#"{"version":1,"alpha":1e-6,"beta":1e-9}"#).expect("v1");
    v1.validate().expect("v1 valid");
    assert!(v1.beta_curve.is_empty());
    let v9: Profile =
        serde_json::from_str(r#"{"version":9,"alpha":1e-6,"beta":1e-9}"#).expect("v9");
    assert!(v9.validate().is_err());
    let mut pr = prof();
    pr.beta_curve = curve(&[(4096.0, 2e-10), (65536.0, 1e-10)]);
    pr.gamma_unpack_curve = curve(&[(16e6, 1e-9), (128e6, 2e-9)]);
    let back: Profile =
        serde_json::from_str(&serde_json::to_string(&pr).expect("json")).expect("parse");
    assert_eq!(back, pr);
}

// ---- the step model (step.rs) ----

fn table(ns: &[usize]) -> Vec<StepLayer> {
    ns.iter()
        .enumerate()
        .map(|(i, &n)| StepLayer {
            name: format!("l{i}"),
            n,
            kind: LayerKind::Auto,
        })
        .collect()
}

fn sq(p: usize, allowed: &[StrategyId]) -> StepQuery {
    StepQuery {
        p,
        density: 0.001,
        select_method: "trimmed".into(),
        gradiveq_ratio: 8.0,
        ranks_per_node: None,
        fill: None,
        allgather: crate::dense::AllgathervAlgo::Auto,
        min_sparse_elems: 0,
        allowed: allowed.to_vec(),
    }
}

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

/// Within [`NEAR_TIE`] of the sparse group's cost the plan names the
/// simpler sparse exchange, as the engine's per-step choice
/// (`choose_sparse_exchange`) does; past it, the faster one. Every layer
/// is sparse here, so the step is the sparse group. The sparse allreduce's
/// cost grows with the fill ratio ρ, so scanning ρ walks its step time
/// through the allgatherv's.
#[test]
fn plan_step_breaks_near_ties_toward_the_simpler_exchange() {
    use StrategyId::*;
    let pr = prof();
    let layers = table(&[1 << 22, 1 << 20]);
    let (mut near, mut far) = (0, 0);
    for p in [8usize, 16, 64, 256] {
        for i in 1..=200 {
            let fill = i as f64 / 200.0;
            let q = |allowed: &[StrategyId]| StepQuery {
                fill: Some(fill),
                density: 0.01,
                ..sq(p, allowed)
            };
            let step = |id| {
                predict_step(&pr, &q(&[id]), &layers, &[id, id])
                    .expect("predict")
                    .seconds
            };
            let (gather, reduce) = (step(SparseAllgather), step(SparseAllreduce));
            // Either order of the caller's list gives the same plan.
            for allowed in [
                [SparseAllgather, SparseAllreduce],
                [SparseAllreduce, SparseAllgather],
            ] {
                let plan = plan_step(&pr, &q(&allowed), &layers).expect("plan");
                let chose: Vec<StrategyId> = plan.layers.iter().map(|l| l.choice).collect();
                if reduce < gather && reduce * (1.0 + NEAR_TIE) > gather * 1.001 {
                    near += 1;
                    assert_eq!(chose, [SparseAllgather; 2], "p={p} ρ={fill}");
                } else if reduce * (1.0 + NEAR_TIE) < gather * 0.999 {
                    far += 1;
                    assert_eq!(chose, [SparseAllreduce; 2], "p={p} ρ={fill}");
                }
            }
        }
    }
    assert!(near > 0 && far > 0, "near-ties {near}, clear wins {far}");
}

/// The tie is 2 % of the group the choice is about, not of the step: a
/// large fixed dense layer beside a sparse one must not make a sparse
/// allreduce that is 5 % faster than the allgatherv (at group level) a
/// "tie" (2 % of the step was several times the sparse group's gap).
#[test]
fn a_large_dense_group_does_not_widen_the_sparse_tie() {
    use StrategyId::*;
    let pr = prof();
    let mut layers = table(&[1 << 22]);
    layers.push(StepLayer {
        name: "big-dense".into(),
        n: 1 << 26,
        kind: LayerKind::Fixed(DenseRabenseifner, 1.0),
    });
    let mut clear_wins = 0;
    for p in [16usize, 64, 256] {
        for i in 1..=100 {
            let fill = i as f64 / 100.0;
            let q = |allowed: &[StrategyId]| StepQuery {
                fill: Some(fill),
                density: 0.01,
                ..sq(p, allowed)
            };
            let sparse_group = |id| {
                let st = predict_step(&pr, &q(&[id]), &layers, &[id, DenseRabenseifner])
                    .expect("predict");
                let g = st
                    .groups
                    .iter()
                    .find(|g| g.kind == GroupKind::Sparse)
                    .expect("a sparse group");
                (g.comm_s + g.local_s, st.seconds)
            };
            let ((gather, step), (reduce, reduce_step)) =
                (sparse_group(SparseAllgather), sparse_group(SparseAllreduce));
            let all_dense = predict_step(
                &pr,
                &q(&[DenseRabenseifner]),
                &layers,
                &[DenseRabenseifner, DenseRabenseifner],
            )
            .expect("predict")
            .seconds;
            // A clear win at group level, yet inside 2 % of the step (and
            // the layer is worth sending sparse at all).
            if reduce * 1.05 < gather
                && gather - reduce < NEAR_TIE * step
                && reduce_step < all_dense
            {
                clear_wins += 1;
                let plan = plan_step(
                    &pr,
                    &q(&[DenseRabenseifner, SparseAllgather, SparseAllreduce]),
                    &layers,
                )
                .expect("plan");
                assert_eq!(plan.layers[0].choice, SparseAllreduce, "p={p} ρ={fill}");
            }
        }
    }
    assert!(
        clear_wins > 0,
        "no case where the step's 2 % hid a group's win"
    );
}

/// The issue's case: at p = 32, α = 5 µs, 1.25 GB/s, ResNet-50's 64-element
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
            n: 64,
            p: 32,
            density: 0.001,
            gradiveq_ratio: 8.0,
            ranks_per_node: None,
            fill: None,
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
                    n,
                    p,
                    density: q.density,
                    gradiveq_ratio: 8.0,
                    ranks_per_node: None,
                    fill: None,
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
    bad.p = 2;
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

/// Issue #15: `sparse_exchange = "auto"`'s per-step choice.
mod exchange {
    use super::*;
    use crate::cost::topology::{self, Net};

    fn q(n: usize, k: f64, p: usize) -> ExchangeQuery {
        ExchangeQuery {
            n,
            k,
            message_bytes: 12.0 + 8.0 * k + 16.0,
            p,
            ranks_per_node: None,
            fill: None,
            allgather: crate::dense::AllgathervAlgo::Auto,
            layers: Vec::new(),
        }
    }

    fn pred(c: &ExchangeChoice, id: StrategyId) -> f64 {
        c.predictions
            .iter()
            .find(|(x, _)| *x == id)
            .unwrap_or_else(|| panic!("{id} predicted"))
            .1
    }

    fn two_level() -> Profile {
        let mut p = prof();
        p.inter_node = Some(NetLevel {
            alpha: 3e-5,
            beta: 1.0 / 1.25e8,
            beta_curve: Vec::new(),
            oneway_curve: Vec::new(),
            burst: None,
        });
        p
    }

    /// The predictions are the topology functions (the sparse group of
    /// `plan_step`), and the choice is their minimum.
    #[test]
    fn predictions_are_the_topology_costs_and_the_choice_their_minimum() {
        for pr in [prof(), two_level()] {
            for (p, l) in [
                (1, None),
                (2, None),
                (5, None),
                (16, Some(4)),
                (12, Some(5)),
            ] {
                for (n, d) in [(1000usize, 0.01), (1_000_000, 0.001), (200_000, 0.2)] {
                    for fill in [None, Some(1.0 / p as f64), Some(0.7)] {
                        let k = crate::cost::sparse_k(n, d);
                        let qq = ExchangeQuery {
                            ranks_per_node: l,
                            fill,
                            ..q(n, k, p)
                        };
                        let c = choose_sparse_exchange(&pr, &qq).expect("choice");
                        let net = Net::new(&pr, p, l, fill);
                        let at = format!("p={p} l={l:?} n={n} d={d} fill={fill:?}");
                        assert_eq!(
                            pred(&c, StrategyId::SparseAllreduce),
                            topology::sparse_allreduce(&net, n as f64, k, fill),
                            "{at}"
                        );
                        let ids: Vec<StrategyId> = c.predictions.iter().map(|x| x.0).collect();
                        if l.is_some() {
                            assert_eq!(
                                pred(&c, StrategyId::SparseHierarchical),
                                topology::sparse_hierarchical(&net, n as f64, k, fill),
                                "{at}"
                            );
                            assert_eq!(ids.len(), 3);
                        } else {
                            // One node: never the node-aware exchange.
                            assert_eq!(
                                ids,
                                [StrategyId::SparseAllgather, StrategyId::SparseAllreduce]
                            );
                        }
                        // The allgatherv as `plan_step` prices a layer of
                        // RGC units in the fused message: its group's
                        // collective plus decoding the p units.
                        let layers = [StepLayer {
                            name: "l".into(),
                            n,
                            kind: LayerKind::Fixed(StrategyId::SparseAllgather, d),
                        }];
                        let sq = StepQuery {
                            p,
                            density: d,
                            select_method: "trimmed".into(),
                            gradiveq_ratio: 8.0,
                            allowed: Vec::new(),
                            ranks_per_node: l,
                            fill,
                            allgather: crate::dense::AllgathervAlgo::Auto,
                            min_sparse_elems: 0,
                        };
                        let plan = predict_step(&pr, &sq, &layers, &[StrategyId::SparseAllgather])
                            .expect("plan");
                        let m = codec_wire_bytes("rgc", n, d).expect("rgc size");
                        let qa = ExchangeQuery {
                            message_bytes: plan.groups[0].message_bytes - 16.0,
                            ..qq.clone()
                        };
                        assert_eq!(qa.message_bytes, m + 16.0, "{at}");
                        let ca = choose_sparse_exchange(&pr, &qa).expect("choice");
                        let unpack = if p > 1 {
                            p as f64 * qa.message_bytes * pr.gamma_unpack
                        } else {
                            0.0
                        };
                        assert!(
                            rel(
                                pred(&ca, StrategyId::SparseAllgather),
                                plan.groups[0].comm_s + unpack
                            ) < 1e-12,
                            "{at}"
                        );
                        // The same for the sparse allreduce's group.
                        let layers = [StepLayer {
                            kind: LayerKind::Fixed(StrategyId::SparseAllreduce, d),
                            ..layers[0].clone()
                        }];
                        let plan = predict_step(&pr, &sq, &layers, &[StrategyId::SparseAllreduce])
                            .expect("plan");
                        assert_eq!(
                            pred(&c, StrategyId::SparseAllreduce),
                            plan.groups[0].comm_s,
                            "{at}"
                        );
                        let best = c
                            .predictions
                            .iter()
                            .map(|x| x.1)
                            .fold(f64::INFINITY, f64::min);
                        // The first candidate within NEAR_TIE of the minimum.
                        let first = c
                            .predictions
                            .iter()
                            .position(|x| x.1 <= best + NEAR_TIE * best.abs())
                            .expect("the minimum itself");
                        assert_eq!(c.id, c.predictions[first].0, "{at}");
                    }
                }
            }
        }
    }

    #[test]
    fn allgather_for_few_ranks_or_few_pairs_and_on_ties() {
        let pr = prof();
        // One rank: nothing to exchange, every prediction 0: the allgatherv.
        let c = choose_sparse_exchange(&pr, &q(1_000_000, 1000.0, 1)).unwrap();
        assert_eq!(c.id, StrategyId::SparseAllgather);
        assert!(c.predictions.iter().all(|x| x.1 == 0.0));
        // No pairs at all.
        let c = choose_sparse_exchange(&pr, &q(1000, 0.0, 8)).unwrap();
        assert_eq!(c.id, StrategyId::SparseAllgather);
        // Two ranks, a few pairs: the allreduce's extra latencies lose.
        for p in [2, 3, 4] {
            let c = choose_sparse_exchange(&pr, &q(1_000_000, 100.0, p)).unwrap();
            assert_eq!(c.id, StrategyId::SparseAllgather, "p={p}: {c:?}");
        }
    }

    #[test]
    fn sparse_allreduce_for_many_ranks_and_dense_results() {
        let pr = prof();
        // 5 % of a million elements from each of 64 ranks: the summed
        // result is nearly dense, the allgatherv carries p·k pairs.
        let c = choose_sparse_exchange(&pr, &q(1_000_000, 50_000.0, 64)).unwrap();
        assert_eq!(c.id, StrategyId::SparseAllreduce, "{c:?}");
        assert!(
            pred(&c, StrategyId::SparseAllreduce) < pred(&c, StrategyId::SparseAllgather) / 2.0
        );
    }

    #[test]
    fn the_allgathers_adds_are_priced_at_each_layers_size() {
        // Adds into outputs past 16 MB cost 3x the warm rate.
        let mut pr = prof();
        pr.gamma_unpack_curve = curve(&[(16e6, 1e-9), (32e6, 3e-9)]);
        let (p, k) = (8, 25_000.0);
        let group = q(25_000_000, k, p);
        // The same pairs in 5 layers of 5M elements (20 MB outputs) and in
        // 25 of 1M (4 MB: warm).
        let split = |layers: usize| ExchangeQuery {
            layers: vec![(25_000_000 / layers, group.message_bytes / layers as f64); layers],
            ..group.clone()
        };
        let at = |qq: &ExchangeQuery| {
            pred(
                &choose_sparse_exchange(&pr, qq).unwrap(),
                StrategyId::SparseAllgather,
            )
        };
        let comm = at(&group) - p as f64 * group.message_bytes * pr.gamma_unpack_at(1e8);
        for (layers, out_bytes) in [(5, 2e7), (25, 4e6)] {
            let want = comm + p as f64 * group.message_bytes * pr.gamma_unpack_at(out_bytes);
            assert!(rel(at(&split(layers)), want) < 1e-12, "{layers} layers");
        }
        assert!(at(&split(25)) < at(&split(5)) && at(&split(5)) < at(&group));
        // One layer listed is the group itself; the allreduces are unchanged.
        let one = split(1);
        assert!(rel(at(&one), at(&group)) < 1e-12);
        let (a, b) = (
            choose_sparse_exchange(&pr, &group).unwrap(),
            choose_sparse_exchange(&pr, &split(25)).unwrap(),
        );
        assert_eq!(
            pred(&a, StrategyId::SparseAllreduce),
            pred(&b, StrategyId::SparseAllreduce)
        );
        // Several layers' adds run on the engine's threads (as a plan
        // charges them); one layer's do not.
        let one_layer = at(&split(1));
        let mut pr = pr.clone();
        pr.local_parallelism = 2.0;
        let at = |qq: &ExchangeQuery| {
            pred(
                &choose_sparse_exchange(&pr, qq).unwrap(),
                StrategyId::SparseAllgather,
            )
        };
        let want = comm + p as f64 * group.message_bytes * pr.gamma_unpack_at(4e6) / 2.0;
        assert!(rel(at(&split(25)), want) < 1e-12);
        assert!(rel(at(&split(1)), one_layer) < 1e-12);
        // Layers that cannot be are errors naming the layer.
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let mut qq = split(5);
            qq.layers[3].1 = bad;
            let e = choose_sparse_exchange(&pr, &qq).unwrap_err().to_string();
            assert!(e.contains("layer 3"), "{e}");
        }
        let mut qq = split(5);
        qq.layers[0].0 = qq.n + 1;
        assert!(choose_sparse_exchange(&pr, &qq).is_err());
    }

    /// Across slow nodes of 8 ranks, 32 ranks: with independent selections
    /// the fused allgatherv goes node-aware (its node blocks cross the link
    /// once, as the node-aware sparse allreduce's units do: the two are
    /// within the near-tie, and the simpler one runs); with overlapping
    /// selections the node-aware sparse allreduce's merged units are
    /// smaller and it wins.
    #[test]
    fn hierarchical_across_slow_nodes_with_several_ranks_each() {
        let pr = two_level();
        let qq = ExchangeQuery {
            ranks_per_node: Some(8),
            ..q(4_000_000, 40_000.0, 32)
        };
        let c = choose_sparse_exchange(&pr, &qq).unwrap();
        let gather = pred(&c, StrategyId::SparseAllgather);
        let hier = pred(&c, StrategyId::SparseHierarchical);
        assert!(gather <= hier * (1.0 + NEAR_TIE), "{c:?}");
        let ag = crate::cost::choose_allgatherv(&pr, qq.message_bytes, 32, Some(8)).unwrap();
        assert_eq!(ag.algo, crate::dense::AllgathervAlgo::Node, "{ag:?}");
        assert!(ag.predictions[1].1 < ag.predictions[0].1 / 4.0, "{ag:?}");
        let overlapping = ExchangeQuery {
            fill: Some(1.0 / 32.0),
            ..qq.clone()
        };
        let c = choose_sparse_exchange(&pr, &overlapping).unwrap();
        assert_eq!(c.id, StrategyId::SparseHierarchical, "{c:?}");
        // An engine configured with the flat allgatherv is priced with it:
        // its L = 8 ranks a node pull 8 times the bytes through the link.
        let flat = ExchangeQuery {
            allgather: crate::dense::AllgathervAlgo::RecursiveDoubling,
            ..qq.clone()
        };
        let c = choose_sparse_exchange(&pr, &flat).unwrap();
        assert_eq!(c.id, StrategyId::SparseHierarchical, "{c:?}");
        assert!(
            pred(&c, StrategyId::SparseAllgather) > 4.0 * gather,
            "{c:?}"
        );
        let node = ExchangeQuery {
            allgather: crate::dense::AllgathervAlgo::Node,
            ..qq.clone()
        };
        let c = choose_sparse_exchange(&pr, &node).unwrap();
        assert!(
            rel(pred(&c, StrategyId::SparseAllgather), gather) < 1e-12,
            "{c:?}"
        );
        // The same job on one node (nodes unknown): never hierarchical.
        let one = ExchangeQuery {
            ranks_per_node: None,
            ..qq.clone()
        };
        let c = choose_sparse_exchange(&pr, &one).unwrap();
        assert_ne!(c.id, StrategyId::SparseHierarchical);
        // ranks_per_node ≥ p is one node too.
        let c = choose_sparse_exchange(
            &pr,
            &ExchangeQuery {
                ranks_per_node: Some(32),
                ..qq
            },
        )
        .unwrap();
        assert_eq!(c.predictions.len(), 2);
    }

    /// A measured fill flips the choice: disjoint selections (ρ = 1) make
    /// the sparse allreduce's result as large as the allgatherv's, full
    /// overlap (ρ = 1/p) makes it one rank's.
    #[test]
    fn the_measured_fill_flips_the_choice() {
        let pr = prof();
        let p = 16;
        let base = q(10_000_000, 100_000.0, p);
        let at = |fill| {
            choose_sparse_exchange(
                &pr,
                &ExchangeQuery {
                    fill,
                    ..base.clone()
                },
            )
            .unwrap()
        };
        let disjoint = at(Some(1.0));
        let overlap = at(Some(1.0 / p as f64));
        assert_eq!(disjoint.id, StrategyId::SparseAllgather, "{disjoint:?}");
        assert_eq!(overlap.id, StrategyId::SparseAllreduce, "{overlap:?}");
        // The allgatherv does not depend on the fill.
        assert_eq!(
            pred(&disjoint, StrategyId::SparseAllgather),
            pred(&overlap, StrategyId::SparseAllgather)
        );
    }

    #[test]
    fn bad_inputs_are_errors() {
        let pr = prof();
        for bad in [
            ExchangeQuery {
                p: 0,
                ..q(10, 1.0, 2)
            },
            ExchangeQuery {
                fill: Some(0.0),
                ..q(10, 1.0, 2)
            },
            ExchangeQuery {
                fill: Some(1.5),
                ..q(10, 1.0, 2)
            },
            ExchangeQuery {
                ranks_per_node: Some(0),
                ..q(10, 1.0, 2)
            },
            ExchangeQuery {
                k: f64::NAN,
                ..q(10, 1.0, 2)
            },
            ExchangeQuery {
                message_bytes: -1.0,
                ..q(10, 1.0, 2)
            },
        ] {
            assert!(choose_sparse_exchange(&pr, &bad).is_err(), "{bad:?}");
        }
    }
}

#[test]
fn near_ties_go_to_the_first_candidate_and_real_gaps_to_the_cheapest() {
    use super::argmin::cheapest;
    use StrategyId::{SparseAllgather, SparseAllreduce, SparseHierarchical};
    // ResNet-50's exchange at 2 x 2, density 0.001 (us): a tie.
    let tie = [
        (SparseAllgather, 8022.0),
        (SparseAllreduce, 12548.2),
        (SparseHierarchical, 7964.3),
    ];
    assert_eq!(cheapest(&tie), SparseAllgather);
    // Just outside 2 %: the cheaper one.
    let gap = [(SparseAllgather, 0.1021), (SparseHierarchical, 0.1)];
    assert_eq!(cheapest(&gap), SparseHierarchical);
    // Just inside it.
    let inside = [(SparseAllgather, 0.1019), (SparseHierarchical, 0.1)];
    assert_eq!(cheapest(&inside), SparseAllgather);
    // The first of several near the minimum, not the minimum.
    let several = [
        (SparseAllgather, 0.2),
        (SparseAllreduce, 0.1005),
        (SparseHierarchical, 0.1),
    ];
    assert_eq!(cheapest(&several), SparseAllreduce);
    // Negative predictions (a hand-made profile): the same 2 % of |min|.
    assert_eq!(
        cheapest(&[(SparseAllgather, -0.99), (SparseAllreduce, -1.0)]),
        SparseAllgather
    );
    assert_eq!(
        cheapest(&[(SparseAllgather, -0.9), (SparseAllreduce, -1.0)]),
        SparseAllreduce
    );
    // All zero (one rank): the first.
    assert_eq!(
        cheapest(&[(SparseAllgather, 0.0), (SparseAllreduce, 0.0)]),
        SparseAllgather
    );
}

/// An unknown selection method is an error naming it (it used to price
/// the selection as free, the profile having no fit under that name).
#[test]
fn an_unknown_selection_method_is_an_error() {
    let pr = prof();
    let q = Query {
        n: 1 << 20,
        p: 4,
        density: 0.001,
        gradiveq_ratio: 8.0,
        ranks_per_node: None,
        fill: None,
    };
    for m in ["exact", "trimmed", "threshold", "sampled"] {
        predict(&pr, &q, m).unwrap_or_else(|e| panic!("{m}: {e}"));
    }
    for m in ["zzz", "", "Trimmed"] {
        let e = predict(&pr, &q, m).expect_err(m).to_string();
        assert!(
            e.contains(&format!("{m:?}")) && e.contains("trimmed"),
            "{e}"
        );
    }
}

/// With the calibrated profiles in the repository (curves that fall
/// steeply between points: cache effects, noise), every collective's
/// predicted time never falls as its layer grows: the curves are read by
/// [`curve_time_at`]. (Read by interpolation alone, a 512 KiB Rabenseifner
/// allreduce on 12 ranks came out 16 % cheaper than a 320 KiB one.)
#[test]
fn predictions_never_fall_as_the_layer_grows() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/scale");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("docs/scale")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    let names = [
        "dense-rabenseifner",
        "dense-ring",
        "dense-hierarchical",
        "sparse-allgather",
        "sparse-allreduce",
        "sparse-hierarchical",
    ];
    for f in &files {
        let pr = Profile::load(f).expect("profile");
        for (p, rpn) in [(2, None), (12, None), (12, Some(2)), (64, Some(8))] {
            let mut last = vec![0.0; names.len()];
            let mut n = 1024usize;
            while n <= 1 << 26 {
                let q = Query {
                    n,
                    p,
                    density: 0.001,
                    gradiveq_ratio: 8.0,
                    ranks_per_node: rpn,
                    fill: None,
                };
                let preds = predict(&pr, &q, "trimmed").expect("predict");
                for (i, name) in names.iter().enumerate() {
                    let Some(t) = preds.iter().find(|x| x.name == *name).map(|x| x.seconds) else {
                        continue;
                    };
                    assert!(
                        t >= last[i] * (1.0 - 1e-12),
                        "{}: {name} at p={p} rpn={rpn:?}: {n} elements {t} s < {} s for fewer",
                        f.display(),
                        last[i]
                    );
                    last[i] = t;
                }
                n += n / 4 + 1;
            }
        }
    }
}
