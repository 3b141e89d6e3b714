//! Per-step `auto` choices on the in-process transport: the sparse
//! exchange and the dense allreduce follow the cost model with the same results.

use super::*;

use crate::strategy::Pick;

/// `sparse_exchange = auto` chooses the exchange every step by
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
        sparse_exchange: Pick::Auto,
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

/// The fill is learned on the allgatherv's steps too. Every
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
    let fixed = run(SparseExchange::Allgather.into());
    let auto = run(Pick::Auto);
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

/// `allreduce = "auto"` runs, every step, the dense algorithm
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
        allreduce: Pick::Auto,
        ..base.clone()
    };
    for p in [1, 2, 3, 4, 5] {
        let fixed = run_exchange_table(p, &base, true, 3, &table);
        let chosen = run_exchange_table(p, &auto, true, 3, &table);
        let want = match crate::cost::choose_dense_allreduce(
            &prof,
            4.0 * 4010.0,
            &crate::cost::Placement::on(p, None),
        )
        .expect("choice")
        .pick
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
            allreduce: Pick::Auto,
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
        "auto".parse::<Pick<crate::dense::AllreduceAlgo>>().unwrap(),
        Pick::Auto
    );
    // `auto` is a choice layered on the algorithms, not one of them: the
    // library's allreduce cannot be given it (its type holds what runs).
    assert!("auto".parse::<crate::dense::AllreduceAlgo>().is_err());
}

/// `auto` needs a profile: without one, the same error on
/// every rank at creation; with one, the in-process transport (no nodes)
/// is accepted (auto then never picks the node-aware exchange).
#[test]
fn auto_exchange_needs_a_profile_on_every_rank() {
    let res = creation_errors(
        3,
        Config {
            sparse_exchange: Pick::Auto,
            ..cfg()
        },
    );
    for e in &res {
        assert!(e.contains("\"auto\"") && e.contains("profile"), "{e}");
    }
    let ok = LocalComm::run(2, |c| {
        let cfg = Config {
            sparse_exchange: Pick::Auto,
            profile: Some(crate::cost::Profile::from_network(1e-6, 1e9, 0.0, 0.0).unwrap()),
            ..cfg()
        };
        GradSync::with_transport(c, cfg).map(|s| s.fill_estimate())
    });
    for r in ok {
        assert_eq!(r.expect("created"), None);
    }
}
