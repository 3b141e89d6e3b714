//! Per-layer predictions: the documented formulas, one rank, RedSync's traffic
//! remark, GradiVeQ's hidden compression, crossovers, selection methods, monotonicity.

use super::*;

fn get(preds: &[Prediction], name: &str) -> f64 {
    preds.iter().find(|p| p.name == name).expect(name).seconds
}

/// The formulas, written out independently of the module.
#[test]
fn predictions_equal_the_documented_formulas() {
    let pr = prof();
    let (al, be, gr, gu) = (pr.alpha, pr.beta, pr.gamma_reduce, pr.gamma_unpack);
    for p in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 16, 100, 128] {
        for n in [1usize, 1000, 65_536, 4_000_001] {
            for d in [0.001, 0.01, 0.5] {
                let q = Query {
                    at: crate::cost::Placement {
                        p,
                        ranks_per_node: None,
                        fill: None,
                        ..crate::cost::Placement::default()
                    },
                    n,
                    density: d,
                    gradiveq_ratio: 8.0,
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
                // Every strategy but PowerSGD, which is priced on a
                // layer's matrix (a layers file's shape), not on `n`.
                assert_eq!(preds.len(), STRATEGIES.len() - 1);
                assert!(preds.iter().all(|x| x.id != StrategyId::Powersgd));
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
            at: crate::cost::Placement {
                p: 1,
                ranks_per_node: None,
                fill: None,
                ..crate::cost::Placement::default()
            },
            n: 1 << 20,
            density: 0.001,
            gradiveq_ratio: 8.0,
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
            at: crate::cost::Placement {
                p: 128,
                ranks_per_node: None,
                fill: None,
                ..crate::cost::Placement::default()
            },
            n: 25_000_000,
            density: 0.001,
            gradiveq_ratio: 8.0,
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
        at: crate::cost::Placement {
            p: 4,
            ranks_per_node: None,
            fill: None,
            ..crate::cost::Placement::default()
        },
        n: 1 << 22,
        density: 0.001,
        gradiveq_ratio: 8.0,
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
        at: crate::cost::Placement {
            p: 8,
            ranks_per_node: None,
            fill: None,
            ..crate::cost::Placement::default()
        },
        n: 1,
        density: 0.001,
        gradiveq_ratio: 8.0,
    }
}

#[test]
fn crossover_matches_a_direct_scan() {
    let pr = prof();
    let x = crossover(
        &pr,
        &base8(),
        "trimmed",
        ("sparse-allgather", "dense-rabenseifner"),
        1 << 26,
        1,
    )
    .expect("crossover")
    .expect("sparse wins for large layers");
    let d = |n: usize| {
        let p = predict(
            &pr,
            &Query {
                at: crate::cost::Placement {
                    p: 8,
                    ranks_per_node: None,
                    fill: None,
                    ..crate::cost::Placement::default()
                },
                n,
                density: 0.001,
                gradiveq_ratio: 8.0,
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
            ("sparse-allgather", "dense-rabenseifner"),
            1 << 26,
            1
        )
        .expect("crossover"),
        None
    );
}

/// An unknown selection method is an error naming it (it used to price
/// the selection as free, the profile having no fit under that name).
#[test]
fn an_unknown_selection_method_is_an_error() {
    let pr = prof();
    let q = Query {
        at: crate::cost::Placement {
            p: 4,
            ranks_per_node: None,
            fill: None,
            ..crate::cost::Placement::default()
        },
        n: 1 << 20,
        density: 0.001,
        gradiveq_ratio: 8.0,
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
                    at: crate::cost::Placement {
                        p,
                        ranks_per_node: rpn,
                        fill: None,
                        ..crate::cost::Placement::default()
                    },
                    n,
                    density: 0.001,
                    gradiveq_ratio: 8.0,
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
