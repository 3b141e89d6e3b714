//! `sparse_exchange = "auto"`'s per-step choice.

use super::*;

use crate::cost::topology::{self, Net};
use crate::strategy::Pick;

fn q(n: usize, k: f64, p: usize) -> ExchangeQuery {
    ExchangeQuery {
        at: crate::cost::Placement {
            p,
            ranks_per_node: None,
            fill: None,
            allgather: Pick::Auto,
        },
        n,
        k,
        message_bytes: 12.0 + 8.0 * k + 16.0,
        layers: Vec::new(),
    }
}

/// The first of a choice's candidates within [`NEAR_TIE`] of the
/// cheapest, computed here as the tests read the rule.
fn first_near_tie<T: Copy>(c: &Choice<T>) -> T {
    let best = c
        .predictions
        .iter()
        .map(|x| x.1)
        .fold(f64::INFINITY, f64::min);
    let first = c
        .predictions
        .iter()
        .position(|x| x.1 <= best + NEAR_TIE * best.abs())
        .expect("the minimum itself");
    c.predictions[first].0
}

fn pred(c: &Choice<StrategyId>, id: StrategyId) -> f64 {
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
                        at: crate::cost::Placement {
                            ranks_per_node: l,
                            fill,
                            ..q(n, k, p).at
                        },
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
                        matrix: None,
                    }];
                    let sq = StepQuery {
                        at: crate::cost::Placement {
                            p,
                            ranks_per_node: l,
                            fill,
                            allgather: Pick::Auto,
                        },
                        density: d,
                        select_method: "trimmed".into(),
                        gradiveq_ratio: 8.0,
                        allowed: Vec::new(),
                        min_sparse_elems: 0,
                        powersgd_rank: 1,
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
                    // The first candidate within NEAR_TIE of the minimum.
                    assert_eq!(c.pick, first_near_tie(&c), "{at}");
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
    assert_eq!(c.pick, StrategyId::SparseAllgather);
    assert!(c.predictions.iter().all(|x| x.1 == 0.0));
    // No pairs at all.
    let c = choose_sparse_exchange(&pr, &q(1000, 0.0, 8)).unwrap();
    assert_eq!(c.pick, StrategyId::SparseAllgather);
    // Two ranks, a few pairs: the allreduce's extra latencies lose.
    for p in [2, 3, 4] {
        let c = choose_sparse_exchange(&pr, &q(1_000_000, 100.0, p)).unwrap();
        assert_eq!(c.pick, StrategyId::SparseAllgather, "p={p}: {c:?}");
    }
}

#[test]
fn sparse_allreduce_for_many_ranks_and_dense_results() {
    let pr = prof();
    // 5 % of a million elements from each of 64 ranks: the summed
    // result is nearly dense, the allgatherv carries p·k pairs.
    let c = choose_sparse_exchange(&pr, &q(1_000_000, 50_000.0, 64)).unwrap();
    assert_eq!(c.pick, StrategyId::SparseAllreduce, "{c:?}");
    assert!(pred(&c, StrategyId::SparseAllreduce) < pred(&c, StrategyId::SparseAllgather) / 2.0);
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
        at: crate::cost::Placement {
            ranks_per_node: Some(8),
            ..q(4_000_000, 40_000.0, 32).at
        },
        ..q(4_000_000, 40_000.0, 32)
    };
    let c = choose_sparse_exchange(&pr, &qq).unwrap();
    let gather = pred(&c, StrategyId::SparseAllgather);
    let hier = pred(&c, StrategyId::SparseHierarchical);
    assert!(gather <= hier * (1.0 + NEAR_TIE), "{c:?}");
    let ag =
        crate::cost::choose_allgatherv(&pr, qq.message_bytes, &Placement::on(32, Some(8))).unwrap();
    assert_eq!(ag.pick, crate::dense::AllgathervAlgo::Node, "{ag:?}");
    assert!(ag.predictions[1].1 < ag.predictions[0].1 / 4.0, "{ag:?}");
    let overlapping = ExchangeQuery {
        at: crate::cost::Placement {
            fill: Some(1.0 / 32.0),
            ..qq.clone().at
        },
        ..qq.clone()
    };
    let c = choose_sparse_exchange(&pr, &overlapping).unwrap();
    assert_eq!(c.pick, StrategyId::SparseHierarchical, "{c:?}");
    // An engine configured with the flat allgatherv is priced with it:
    // its L = 8 ranks a node pull 8 times the bytes through the link.
    let flat = ExchangeQuery {
        at: crate::cost::Placement {
            allgather: Pick::Fixed(crate::dense::AllgathervAlgo::RecursiveDoubling),
            ..qq.clone().at
        },
        ..qq.clone()
    };
    let c = choose_sparse_exchange(&pr, &flat).unwrap();
    assert_eq!(c.pick, StrategyId::SparseHierarchical, "{c:?}");
    assert!(
        pred(&c, StrategyId::SparseAllgather) > 4.0 * gather,
        "{c:?}"
    );
    let node = ExchangeQuery {
        at: crate::cost::Placement {
            allgather: Pick::Fixed(crate::dense::AllgathervAlgo::Node),
            ..qq.clone().at
        },
        ..qq.clone()
    };
    let c = choose_sparse_exchange(&pr, &node).unwrap();
    assert!(
        rel(pred(&c, StrategyId::SparseAllgather), gather) < 1e-12,
        "{c:?}"
    );
    // The same job on one node (nodes unknown): never hierarchical.
    let one = ExchangeQuery {
        at: crate::cost::Placement {
            ranks_per_node: None,
            ..qq.clone().at
        },
        ..qq.clone()
    };
    let c = choose_sparse_exchange(&pr, &one).unwrap();
    assert_ne!(c.pick, StrategyId::SparseHierarchical);
    // ranks_per_node ≥ p is one node too.
    let c = choose_sparse_exchange(
        &pr,
        &ExchangeQuery {
            at: crate::cost::Placement {
                ranks_per_node: Some(32),
                ..qq.at
            },
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
                at: crate::cost::Placement {
                    fill,
                    ..base.clone().at
                },
                ..base.clone()
            },
        )
        .unwrap()
    };
    let disjoint = at(Some(1.0));
    let overlap = at(Some(1.0 / p as f64));
    assert_eq!(disjoint.pick, StrategyId::SparseAllgather, "{disjoint:?}");
    assert_eq!(overlap.pick, StrategyId::SparseAllreduce, "{overlap:?}");
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
            at: crate::cost::Placement {
                p: 0,
                ..q(10, 1.0, 2).at
            },
            ..q(10, 1.0, 2)
        },
        ExchangeQuery {
            at: crate::cost::Placement {
                fill: Some(0.0),
                ..q(10, 1.0, 2).at
            },
            ..q(10, 1.0, 2)
        },
        ExchangeQuery {
            at: crate::cost::Placement {
                fill: Some(1.5),
                ..q(10, 1.0, 2).at
            },
            ..q(10, 1.0, 2)
        },
        ExchangeQuery {
            at: crate::cost::Placement {
                ranks_per_node: Some(0),
                ..q(10, 1.0, 2).at
            },
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

// The dense allreduce's and the allgatherv's choices, on the topology
// tests' profiles.
use crate::cost::topology::tests::{prof as net_prof, rel};

#[test]
fn the_dense_choice_is_the_cheapest_dense_group() {
    use crate::cost::choose_dense_allreduce;
    // One node: Rabenseifner and the ring, priced as plan_step prices them.
    let flat = net_prof(None);
    for (p, bytes) in [(1usize, 4e6), (4, 4e6), (3, 4e6), (5, 64.0), (8, 0.0)] {
        let c = choose_dense_allreduce(&flat, bytes, &Placement::on(p, None)).expect("choice");
        assert_eq!(c.predictions.len(), 2, "p={p}");
        let (r, g) = if p == 1 || bytes == 0.0 {
            (0.0, 0.0)
        } else {
            (
                dense_rabenseifner(&flat, bytes, p),
                dense_ring(&flat, bytes, p),
            )
        };
        assert!(rel(c.predictions[0].1, r) < 1e-12 || (r == 0.0 && c.predictions[0].1 == 0.0));
        assert!(rel(c.predictions[1].1, g) < 1e-12 || (g == 0.0 && c.predictions[1].1 == 0.0));
        // Rabenseifner unless the ring is more than NEAR_TIE faster.
        let want = if r > g + crate::cost::NEAR_TIE * g {
            StrategyId::DenseRing
        } else {
            StrategyId::DenseRabenseifner
        };
        assert_eq!(c.pick, want, "p={p} bytes={bytes}");
    }
    // Several nodes behind a slow link: the hierarchical one is a
    // candidate; the choice is the first within NEAR_TIE of the cheapest.
    let two = net_prof(Some((3e-5, 1.25e8)));
    let c = choose_dense_allreduce(&two, 64e6, &Placement::on(64, Some(8))).expect("choice");
    assert_eq!(c.predictions.len(), 3);
    assert_eq!(c.pick, first_near_tie(&c), "{c:?}");
    // Bad inputs are errors.
    assert!(choose_dense_allreduce(&two, -1.0, &Placement::on(4, None)).is_err());
    assert!(choose_dense_allreduce(&two, 1.0, &Placement::on(0, None)).is_err());
    assert!(choose_dense_allreduce(&two, 1.0, &Placement::on(4, Some(0))).is_err());
}

#[test]
fn the_allgatherv_choice_checks_its_inputs_and_lists_its_candidates() {
    use crate::cost::choose_allgatherv;
    use crate::dense::AllgathervAlgo;
    let pr = net_prof(Some((3e-5, 1.25e8)));
    for (bytes, p, l) in [
        (f64::NAN, 4, None),
        (-1.0, 4, None),
        (10.0, 0, None),
        (10.0, 4, Some(0)),
    ] {
        assert!(
            choose_allgatherv(&pr, bytes, &Placement::on(p, l)).is_err(),
            "{bytes} {p} {l:?}"
        );
    }
    // One node, unknown nodes, a one-level profile: recdbl alone.
    for (pr, l) in [(&pr, Some(8)), (&pr, None), (&net_prof(None), Some(2))] {
        let c = choose_allgatherv(pr, 1e6, &Placement::on(8, l)).unwrap();
        assert_eq!(c.pick, AllgathervAlgo::RecursiveDoubling);
        assert_eq!(c.predictions.len(), 1);
    }
    // Several nodes of several ranks: both, and the node-aware one wins
    // on this slow link.
    let c = choose_allgatherv(&pr, 1e6, &Placement::on(8, Some(2))).unwrap();
    assert_eq!(c.predictions.len(), 2);
    assert_eq!(c.pick, AllgathervAlgo::Node, "{c:?}");
    // A link as fast as shared memory: the flat one (fewer phases).
    let fast = net_prof(Some((1e-6, 5e9)));
    let c = choose_allgatherv(&fast, 1e6, &Placement::on(8, Some(2))).unwrap();
    assert_eq!(c.pick, AllgathervAlgo::RecursiveDoubling, "{c:?}");
}
