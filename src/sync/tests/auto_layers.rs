//! `Strategy::Auto` layers: chosen by the cost model, the same choice as
//! `gradsync predict` and `plan`, the whole table planned as one step.

use super::*;

use crate::strategy::Pick;

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
        powersgd_rank: 1,
    }
}

/// `Strategy::Auto`, `gradsync predict`'s choice and `plan`
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
                crate::dense::AllreduceAlgo::Rabenseifner.into(),
                SparseExchange::Allgather.into(),
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
            let rec = crate::cost::records::predict_record(&prof, &m, n, 4, 0.001, None).unwrap();
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

/// A table of `Auto` layers is planned as a whole, by the step
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

/// `Strategy::Auto` layers under `sparse_exchange = auto` are
/// planned among the dense group, the allgatherv and the sparse allreduce
/// (never the node-aware one without nodes), run, and report their
/// exchange every step.
#[test]
fn auto_layers_with_auto_exchange_plan_and_run() {
    let prof = crate::cost::Profile::from_network(1e-9, 1e9, 0.0, 0.0).expect("profile");
    let res = LocalComm::run(4, |c| {
        let rank = c.rank();
        let cfg = Config {
            sparse_exchange: Pick::Auto,
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
