use super::*;
use crate::codec::CodecConfig;
use crate::strategy::Pick;

/// A profile that measured the parallel local phase slower, or no
/// clear gain, keeps it serial; one that measured a gain (or no profile)
/// runs it.
#[test]
fn parallel_local_phase_only_where_the_profile_says_it_pays() {
    let table = [
        TableRow::new(1 << 20, &Strategy::rgc(0.01)),
        TableRow::new(1 << 20, &Strategy::rgc(0.01)),
    ];
    let mut prof = crate::cost::Profile::from_network(1e-6, 1e9, 0.0, 0.0).unwrap();
    // About 1 (every core busy with a rank) is no gain: serial.
    for (par, want) in [
        (None, true),
        (Some(0.9), false),
        (Some(1.03), false),
        (Some(1.6), true),
    ] {
        let cfg = Config {
            profile: par.map(|x| {
                prof.local_parallelism = x;
                prof.clone()
            }),
            ..Config::default()
        };
        let p = script_step(0, &cfg, 2, &table);
        assert_eq!(
            (p.parallel_local, p.parallel_unpack),
            (want, want),
            "{par:?}"
        );
    }
}
use crate::codec::RgcMethod;

fn sparse(n: usize, density: Option<f64>) -> TableRow {
    TableRow {
        n,
        kind: RowKind::Sparse {
            density,
            pairs: false,
        },
    }
}
/// A sparse layer whose codec sends index/value pairs (RGC).
fn pairs(n: usize, density: f64) -> TableRow {
    TableRow {
        n,
        kind: RowKind::Sparse {
            density: Some(density),
            pairs: true,
        },
    }
}
fn dense(n: usize) -> TableRow {
    TableRow {
        n,
        kind: RowKind::Dense,
    }
}
fn gvq(n: usize) -> TableRow {
    TableRow {
        n,
        kind: RowKind::Gradiveq,
    }
}
fn modes(p: &StepScript) -> Vec<Mode> {
    p.layers.iter().map(|l| l.mode).collect()
}
/// A table of every kind: dense 10, sparse 1000 (own density 0.01),
/// GradiVeQ 500, dense 7, sparse 300 (codec without a density).
fn table() -> Vec<TableRow> {
    vec![
        dense(10),
        sparse(1000, Some(0.01)),
        gvq(500),
        dense(7),
        sparse(300, None),
    ]
}

#[test]
fn groups_offsets_and_collectives() {
    let p = script_step(0, &Config::default(), 4, &table());
    assert!(p.communicates && !p.dense_warmup && !p.delayed);
    use Mode::*;
    assert_eq!(modes(&p), [Dense, Sparse, Gradiveq, Dense, Sparse]);
    assert_eq!(p.dense.ids, [0, 3]);
    assert_eq!(p.dense.elems, 17);
    assert_eq!((p.layers[0].dense_off, p.layers[3].dense_off), (0, 10));
    assert_eq!(p.sparse.ids, [1, 4]);
    assert_eq!(p.sparse.elems, 1300);
    assert_eq!(p.gradiveq.ids, [2]);
    assert_eq!(p.gradiveq.elems, 500);
    assert!(p.local.ids.is_empty());
    assert_eq!(p.layers[1].density, Some(0.01));
    assert_eq!(p.layers[4].density, None);
    assert_eq!(p.layers[0].density, None);
    assert!(p.gather && p.reduce && p.rings);
    // Small layers: serial.
    assert!(!p.parallel_local && !p.parallel_unpack);
    let cfg = Config {
        parallel_min_elems: 1300,
        ..Config::default()
    };
    let p = script_step(0, &cfg, 4, &table());
    assert!(p.parallel_local && p.parallel_unpack);
}

#[test]
fn one_rank_gathers_nothing() {
    let p = script_step(0, &Config::default(), 1, &table());
    assert!(!p.gather && p.reduce && p.rings);
    // GradiVeQ alone on one rank: its status goes in a one-word allreduce.
    let p = script_step(0, &Config::default(), 1, &[gvq(100)]);
    assert!(!p.gather && p.reduce && p.rings);
    assert_eq!(p.dense.elems, 0);
    // With a fused message, that message carries the status.
    let p = script_step(0, &Config::default(), 2, &[gvq(100), sparse(50, None)]);
    assert!(p.gather && !p.reduce && p.rings);
}

#[test]
fn empty_table() {
    for step in [0, 1, 5] {
        let cfg = Config {
            delay: 2,
            ..Config::default()
        };
        let p = script_step(step, &cfg, 3, &[]);
        assert!(p.layers.is_empty());
        assert_eq!(p.dense, Group::default());
        assert_eq!(p.sparse, Group::default());
        assert!(!p.gather && !p.rings);
        // The status allreduce (8 bytes) still runs, so a failure on
        // one rank reaches every rank; alone, nothing runs.
        assert!(p.reduce && p.dense.elems == 0);
        assert!(!script_step(step, &cfg, 1, &[]).reduce);
        assert!(!p.parallel_local && !p.parallel_unpack);
        assert_eq!(p.communicates, step % 2 == 1);
    }
}

#[test]
fn dense_warmup_makes_every_layer_dense_gradiveq_included() {
    let cfg = Config {
        warmup: Warmup::Dense { steps: 3 },
        ..Config::default()
    };
    for step in 0..3 {
        let p = script_step(step, &cfg, 2, &table());
        assert!(p.dense_warmup, "step {step}");
        assert!(p.layers.iter().all(|l| l.mode == Mode::Dense));
        assert_eq!(p.dense.ids, [0, 1, 2, 3, 4]);
        assert_eq!(p.dense.elems, 10 + 1000 + 500 + 7 + 300);
        let offs: Vec<usize> = p.layers.iter().map(|l| l.dense_off).collect();
        assert_eq!(offs, [0, 10, 1010, 1510, 1517]);
        assert!(p.layers.iter().all(|l| l.density.is_none()));
        assert!(!p.gather && p.reduce && !p.rings);
    }
    let p = script_step(3, &cfg, 2, &table());
    assert!(!p.dense_warmup);
    use Mode::*;
    assert_eq!(modes(&p), [Dense, Sparse, Gradiveq, Dense, Sparse]);
    assert_eq!(p.layers[3].dense_off, 10);
}

#[test]
fn density_schedule_then_own_density() {
    let cfg = Config {
        warmup: Warmup::Density {
            schedule: vec![0.25, 0.0625],
            steps_per_stage: 2,
        },
        ..Config::default()
    };
    let want = [
        Some(0.25),
        Some(0.25),
        Some(0.0625),
        Some(0.0625),
        None,
        None,
    ];
    for (step, w) in want.into_iter().enumerate() {
        let p = script_step(step as u64, &cfg, 2, &table());
        assert_eq!(p.stage_density, w, "step {step}");
        assert!(!p.dense_warmup);
        // The stage's density overrides the layer's own, for codecs
        // without one too (they ignore it when it is set).
        assert_eq!(p.layers[1].density, w.or(Some(0.01)), "step {step}");
        assert_eq!(p.layers[4].density, w, "step {step}");
        // The schedule does not change modes.
        assert_eq!(p.layers[1].mode, Mode::Sparse);
        assert_eq!(p.layers[2].mode, Mode::Gradiveq);
    }
}

#[test]
fn delay_communicates_every_t_th_step() {
    let cfg = Config {
        delay: 3,
        ..Config::default()
    };
    let t = table();
    let comm: Vec<bool> = (0..9)
        .map(|s| script_step(s, &cfg, 2, &t).communicates)
        .collect();
    assert_eq!(
        comm,
        [false, false, true, false, false, true, false, false, true]
    );
    let p = script_step(0, &cfg, 2, &t);
    assert!(p.delayed);
    assert!(p.layers.iter().all(|l| l.mode == Mode::Local));
    assert_eq!(p.local.ids, [0, 1, 2, 3, 4]);
    assert!(p.dense.ids.is_empty() && p.sparse.ids.is_empty());
    // Only the status allreduce: a failure or a NaN/Inf on one rank
    // reaches every rank in this step. Alone, no collective at all.
    assert!(!p.gather && p.reduce && !p.rings);
    assert_eq!(p.dense.elems, 0);
    assert!(!script_step(0, &cfg, 1, &t).reduce);
    // Several local layers but nothing sparse: serial.
    assert!(!p.parallel_local);
    let p = script_step(2, &cfg, 2, &t);
    assert!(p.delayed && p.communicates);
    assert_eq!(p.sparse.ids, [1, 4]);
    // delay 1: every step, no accumulators.
    let p = script_step(7, &Config::default(), 2, &t);
    assert!(p.communicates && !p.delayed);
}

#[test]
fn delay_and_dense_warmup() {
    let cfg = Config {
        delay: 2,
        warmup: Warmup::Dense { steps: 2 },
        ..Config::default()
    };
    let t = [sparse(100, None), dense(5)];
    // Local steps stay local in the warm-up; communicating ones are dense.
    assert_eq!(modes(&script_step(0, &cfg, 2, &t)), [Mode::Local; 2]);
    assert_eq!(modes(&script_step(1, &cfg, 2, &t)), [Mode::Dense; 2]);
    assert_eq!(modes(&script_step(2, &cfg, 2, &t)), [Mode::Local; 2]);
    assert_eq!(
        modes(&script_step(3, &cfg, 2, &t)),
        [Mode::Sparse, Mode::Dense]
    );
}

#[test]
fn table_rows_from_strategies() {
    let rgc = Strategy::rgc(0.02);
    assert_eq!(
        TableRow::new(9, &rgc).kind,
        RowKind::Sparse {
            density: Some(0.02),
            pairs: true
        }
    );
    let quant = Strategy::Sparse {
        codec: CodecConfig::RgcQuant { density: 0.02 },
        density: None,
    };
    assert_eq!(
        TableRow::new(9, &quant).kind,
        RowKind::Sparse {
            density: Some(0.02),
            pairs: true
        }
    );
    for codec in ["fp16", "qsgd", "3lc", "fastsgd", "none", "int8"] {
        let st = Strategy::Sparse {
            codec: codec.parse().unwrap(),
            density: None,
        };
        assert_eq!(
            TableRow::new(9, &st).kind,
            RowKind::Sparse {
                density: None,
                pairs: false
            },
            "{codec}"
        );
    }
    let over = Strategy::Sparse {
        codec: CodecConfig::Rgc {
            density: 0.02,
            method: RgcMethod::Trimmed,
        },
        density: Some(0.5),
    };
    assert_eq!(
        TableRow::new(9, &over).kind,
        RowKind::Sparse {
            density: Some(0.5),
            pairs: true
        }
    );
    let sbc = Strategy::Sparse {
        codec: CodecConfig::Sbc { p: 0.03 },
        density: None,
    };
    assert_eq!(
        TableRow::new(9, &sbc).kind,
        RowKind::Sparse {
            density: Some(0.03),
            pairs: false
        }
    );
    assert_eq!(
        TableRow::new(9, &Strategy::Dense),
        TableRow {
            n: 9,
            kind: RowKind::Dense
        }
    );
}

#[test]
fn replanning_reuses_the_plan_and_matches_a_fresh_one() {
    let cfg = Config {
        delay: 2,
        warmup: Warmup::Density {
            schedule: vec![0.5],
            steps_per_stage: 3,
        },
        ..Config::default()
    };
    let t = table();
    let mut p = StepScript::default();
    let tuning = crate::cost::Tuning::new(cfg.profile.as_ref(), 3, None, true, cfg.masks())
        .unwrap()
        .with_policy(cfg.policy());
    for step in 0..8 {
        script_step_into(&mut p, step, &cfg, 3, &t, &tuning);
        assert_eq!(p, script_step(step, &cfg, 3, &t), "step {step}");
    }
}

/// `sparse_exchange = auto`: the pair layers are planned as reduced;
/// resolving the step's exchange gives exactly the plan of the
/// configured exchange (allgather: back in the fused message, in
/// registration order), for every step of warm-ups and delays.
#[test]
fn auto_exchange_resolves_to_the_plan_of_the_chosen_exchange() {
    let t = [
        dense(10),
        pairs(1000, 0.01),
        sparse(300, None),
        pairs(0, 0.01),
        pairs(77, 0.1),
        gvq(40),
    ];
    let base = Config {
        delay: 2,
        warmup: Warmup::Dense { steps: 2 },
        ..Config::default()
    };
    let auto = Config {
        sparse_exchange: Pick::Auto,
        ..base.clone()
    };
    for ranks in [1, 2, 3] {
        for step in 0..6 {
            let planned = script_step(step, &auto, ranks, &t);
            // Under `auto` the script holds the decision table's simplest
            // candidate until the engine looks the step's exchange up.
            assert_eq!(planned.exchange, SparseExchange::Allgather);
            for ex in [
                SparseExchange::Allgather,
                SparseExchange::Allreduce,
                SparseExchange::Hierarchical,
            ] {
                let mut p = planned.clone();
                set_exchange(&mut p, ex, ranks);
                let cfg = Config {
                    sparse_exchange: ex.into(),
                    ..base.clone()
                };
                assert_eq!(
                    p,
                    script_step(step, &cfg, ranks, &t),
                    "{ex:?} step {step} ranks {ranks}"
                );
            }
        }
    }
    // Some step reduces (and moving back matters).
    let p = script_step(3, &auto, 3, &t);
    assert_eq!(p.reduced.ids, [1, 3, 4]);
    let mut q = p.clone();
    set_exchange(&mut q, SparseExchange::Allgather, 3);
    assert_eq!(q.sparse.ids, [1, 2, 3, 4]);
    assert!(q.gather && !q.sparse_reduce && q.reduce);
}

/// `sparse_exchange = allreduce`: the index/value layers leave the
/// fused message for the `reduced` group (offsets in its concatenated
/// index space), the others stay; the status allreduce always runs
/// with reduced layers (at one rank too, and without dense layers);
/// warm-up and delayed local steps reduce nothing.
#[test]
fn allreduce_exchange_moves_pair_layers_to_the_reduced_group() {
    let cfg = Config {
        sparse_exchange: Pick::Fixed(SparseExchange::Allreduce),
        ..Config::default()
    };
    let t = [
        dense(10),
        pairs(1000, 0.01),
        sparse(300, None),
        pairs(0, 0.01),
        pairs(77, 0.1),
    ];
    for ranks in [1, 2, 5] {
        let p = script_step(0, &cfg, ranks, &t);
        use Mode::*;
        assert_eq!(modes(&p), [Dense, Sparse, Sparse, Sparse, Sparse]);
        assert_eq!(p.sparse.ids, [2]);
        assert_eq!(p.sparse.elems, 300);
        assert_eq!(p.reduced.ids, [1, 3, 4]);
        assert_eq!(p.reduced.elems, 1077);
        let r: Vec<_> = p.layers.iter().map(|l| (l.reduced, l.reduce_off)).collect();
        assert_eq!(
            r,
            [
                (false, 0),
                (true, 0),
                (false, 0),
                (true, 1000),
                (true, 1000)
            ]
        );
        assert_eq!(p.layers[4].density, Some(0.1));
        assert!(p.sparse_reduce && p.reduce);
        assert_eq!(p.gather, ranks > 1);
    }
    // Only reduced layers: the status allreduce still runs.
    let p = script_step(0, &cfg, 3, &[pairs(100, 0.1)]);
    assert!(p.sparse_reduce && p.reduce && !p.gather && !p.rings);
    assert_eq!(p.dense.elems, 0);
    // The default exchange keeps every sparse layer in the message.
    let p = script_step(0, &Config::default(), 3, &t);
    assert_eq!(p.sparse.ids, [1, 2, 3, 4]);
    assert!(p.reduced.ids.is_empty() && !p.sparse_reduce);
    assert!(p.layers.iter().all(|l| !l.reduced));
    // Dense warm-up and delayed local steps: nothing to reduce.
    let warm = Config {
        warmup: Warmup::Dense { steps: 2 },
        delay: 2,
        ..cfg.clone()
    };
    for step in 0..3 {
        let p = script_step(step, &warm, 3, &t);
        assert!(!p.sparse_reduce && p.reduced.ids.is_empty(), "step {step}");
    }
    assert!(script_step(3, &warm, 3, &t).sparse_reduce);
    // Parallel phases count the reduced layers as sparse ones.
    let par = Config {
        parallel_min_elems: 1000,
        ..cfg
    };
    let p = script_step(0, &par, 2, &[pairs(600, 0.1), pairs(600, 0.1)]);
    assert!(p.parallel_local && p.parallel_unpack);
}
