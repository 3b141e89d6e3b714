//! `gradsync bench --op step`: the engine ([`crate::sync::GradSync::sync`])
//! on a whole model's layer table, against the step model's prediction
//! ([`crate::cost::plan_step`]) and against the MPI library's own
//! `MPI_Allreduce` of the same gradients fused into one buffer (what a
//! Horovod-style dense job does), interleaved in the same run.
//!
//! Every layer gets random gradients of its own magnitude (a normal
//! distribution whose scale is drawn log-uniformly in `[1e-5, 1e-1]` per
//! layer, the same on every rank; the values differ by rank), so that the
//! selection sees a realistic spread across layers, and each step its own
//! ([`crate::calibrate::step_gradient`]), as in training. The strategy of each
//! layer is the plan's: with `--profile`, `plan_step` over `--strategies`
//! (default: what `Strategy::Auto` chooses among); without a profile, the
//! engine's default (dense below its compression threshold, else RGC).
//! `--sparse-exchange` sets the engine's exchange of the RGC layers' pairs
//! (`Config::sparse_exchange`; `auto` needs a profile, which the engine
//! then prices every step with); the record says which exchange each
//! timed step took.

use super::bench::{
    check_common, common_must_match, flag_error, time_interleaved, timed, BenchArgs,
};
use super::step_record::{print_record, StateRecord, StepGroupRecord, StepLayerRecord, StepRecord};
use super::{max_over_ranks, model, synthetic};
use crate::calibrate::median;
use crate::codec::RgcMethod;
use crate::comm::agree::agree_inputs;
use crate::comm::{MpiComm, Transport};
use crate::cost::{self, GroupKind, Profile, StepQuery, StrategyId};
use crate::dense::AllreduceAlgo;
use crate::sync::{Config, GradSync, Pick, SparseExchange, Strategy};
use crate::{Error, Result};

/// The rank-local inputs.
struct Inputs {
    path: String,
    layers: Vec<model::LayerSpec>,
    profile: Option<Profile>,
    density: f64,
    allowed: Vec<StrategyId>,
    /// Ranks per node of this job (the two-level model), if several nodes.
    ranks_per_node: Option<usize>,
    /// `--sparse-exchange`.
    exchange: Pick<SparseExchange>,
    /// `--powersgd-rank`.
    powersgd_rank: usize,
}

fn inputs(a: &BenchArgs, rank: usize) -> Result<Inputs> {
    check_common(a)?;
    if let (true, Some(out), 0) = (a.calibrate, &a.profile, rank) {
        // Where rank 0 writes the new profile: fail now, not after the
        // minutes of calibrating.
        super::calibrate::check_writable(out, "--profile")?;
    }
    let path = std::path::PathBuf::from(&a.layers);
    if a.layers.parse::<usize>().is_ok() {
        return Err(Error::InvalidArgument(format!(
            "--op step: --layers {:?} must be a layers file (JSON, see examples/layers/), not a count",
            a.layers
        )));
    }
    let layers = model::read_layers(&path)?;
    if layers.is_empty() {
        return Err(Error::file(&path, "no layers"));
    }
    if let Some(l) = layers.iter().find(|l| l.elements == 0) {
        return Err(Error::file(
            &path,
            format!("layer {:?} has no elements", l.name),
        ));
    }
    // With --calibrate, --profile names where the new profile goes.
    let profile = match &a.profile {
        Some(p) if !a.calibrate => Some(Profile::load(p).map_err(|e| flag_error("--profile", e))?),
        _ => None,
    };
    let allowed = cost::parse_list(&a.strategies)
        .map_err(|e| flag_error(format!("--strategies {:?}", a.strategies), e))?;
    if let Some(id) = allowed.iter().find(|id| !id.engine_runs()) {
        return Err(Error::InvalidArgument(format!(
            "--strategies: the engine cannot run {id} from a plan"
        )));
    }
    let exchange: Pick<SparseExchange> = a
        .sparse_exchange
        .parse()
        .map_err(|e| flag_error(format!("--sparse-exchange {:?}", a.sparse_exchange), e))?;
    if exchange.is_auto() && profile.is_none() && !a.calibrate {
        return Err(Error::InvalidArgument(
            "--sparse-exchange auto needs --profile or --calibrate (the cost model chooses)".into(),
        ));
    }
    if profile.is_none() && !a.calibrate && !a.strategies.is_empty() {
        return Err(Error::InvalidArgument(
            "--strategies needs --profile or --calibrate (the plan chooses among them)".into(),
        ));
    }
    Ok(Inputs {
        path: a.layers.clone(),
        layers,
        profile,
        density: a.density.unwrap_or(0.001),
        allowed,
        ranks_per_node: None,
        exchange,
        powersgd_rank: a.powersgd_rank,
    })
}

/// Per layer the engine strategy and cost-model id; the prediction; what
/// the plan chose among.
type Planned = (Choices, Option<cost::StepPlan>, Vec<StrategyId>);

/// Per layer the engine strategy and its cost-model id.
type Choices = Vec<(Strategy, StrategyId)>;

/// The plan: per layer the engine strategy and the cost-model id, and the
/// prediction (with a profile).
fn plan(inp: &Inputs, p: usize, cfg: &Config) -> Result<Planned> {
    let Some(prof) = &inp.profile else {
        // The engine's default without a profile.
        let v = inp
            .layers
            .iter()
            .map(|l| {
                if l.elements < cfg.compress_threshold {
                    (Strategy::Dense, StrategyId::DenseRabenseifner)
                } else {
                    (Strategy::rgc(inp.density), StrategyId::SparseAllgather)
                }
            })
            .collect();
        return Ok((v, None, Vec::new()));
    };
    let allowed = if inp.allowed.is_empty() {
        // What the engine's `Auto` layers choose among under these
        // options, asked of its decision table: PowerSGD too (at
        // `--powersgd-rank`) where the profile prices it.
        let engine = Config {
            auto_powersgd: inp.powersgd_rank,
            ..cfg.clone()
        };
        cost::Tuning::new(Some(prof), p, inp.ranks_per_node, true, engine.masks())?
            .with_policy(engine.policy())
            .candidates()
    } else {
        through_exchange(&inp.allowed, inp.exchange, inp.ranks_per_node)?
    };
    let q = StepQuery {
        at: crate::cost::Placement {
            p,
            ranks_per_node: inp.ranks_per_node,
            fill: None,
            allgather: Pick::Auto,
        },
        density: inp.density,
        powersgd_rank: inp.powersgd_rank,
        select_method: "trimmed".into(),
        gradiveq_ratio: crate::cost::GRADIVEQ_RATIO,
        min_sparse_elems: cfg.compress_threshold,
        allowed: allowed.clone(),
    };
    let plan = cost::plan_step(prof, &q, &model::step_layers(&inp.layers))?;
    let v = plan
        .layers
        .iter()
        .map(|l| {
            l.choice
                .engine_strategy(inp.density, RgcMethod::Trimmed)
                .map(|s| (with_rank(s, inp.powersgd_rank), l.choice))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!("the engine cannot run {}", l.choice))
                })
        })
        .collect::<Result<_>>()?;
    Ok((v, Some(plan), allowed))
}

/// `--strategies` as the engine runs them with `--sparse-exchange`: an
/// RGC layer (`sparse-allgather`) goes through the configured exchange, so
/// the plan prices it there (`sparse-allreduce`, `sparse-hierarchical`, or
/// with `auto` whichever the model finds fastest, as the engine's choice
/// does); naming a reducing collective the exchange does not run is an
/// error.
fn through_exchange(
    allowed: &[StrategyId],
    exchange: Pick<SparseExchange>,
    ranks_per_node: Option<usize>,
) -> Result<Vec<StrategyId>> {
    use StrategyId::{SparseAllgather, SparseAllreduce, SparseHierarchical};
    let runs = |id: StrategyId| match exchange {
        Pick::Fixed(SparseExchange::Allgather) => id != SparseAllreduce && id != SparseHierarchical,
        Pick::Fixed(SparseExchange::Allreduce) => id != SparseHierarchical,
        Pick::Fixed(SparseExchange::Hierarchical) => id != SparseAllreduce,
        Pick::Auto => id != SparseHierarchical || ranks_per_node.is_some(),
    };
    if let Some(id) = allowed.iter().find(|&&id| !runs(id)) {
        return Err(Error::InvalidArgument(format!(
            "--strategies {id} is not what --sparse-exchange {} runs (allgather: sparse-allgather; allreduce: sparse-allreduce; hierarchical: sparse-hierarchical, on several nodes; auto: any of them)",
            exchange
        )));
    }
    let mut out = Vec::new();
    for &id in allowed {
        let mapped: &[StrategyId] = match (id, exchange) {
            (SparseAllgather, Pick::Fixed(SparseExchange::Allreduce)) => &[SparseAllreduce],
            (SparseAllgather, Pick::Fixed(SparseExchange::Hierarchical)) => &[SparseHierarchical],
            (SparseAllgather, Pick::Auto) if ranks_per_node.is_some() => {
                &[SparseAllgather, SparseAllreduce, SparseHierarchical]
            }
            (SparseAllgather, Pick::Auto) => &[SparseAllgather, SparseAllreduce],
            _ => std::slice::from_ref(&id),
        };
        for &m in mapped {
            if !out.contains(&m) {
                out.push(m);
            }
        }
    }
    Ok(out)
}

/// The scale of layer `i`'s gradients: log-uniform in `[1e-5, 1e-1]`,
/// from a hash of the index (the same on every rank).
fn layer_scale(i: usize) -> f32 {
    let h = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    // `synthetic` draws with scale 1e-3.
    (10f64.powf(-5.0 + 4.0 * u) / 1e-3) as f32
}

/// One measured configuration: its engine, per-layer strategies and
/// prediction.
struct Measured {
    name: &'static str,
    engine: GradSync,
    strategies: Vec<(Strategy, StrategyId)>,
    plan: Option<cost::StepPlan>,
    /// Per step: the sparse group, the dense allreduce, the local phase,
    /// the PowerSGD group.
    parts: [Vec<f64>; 4],
    bytes: (usize, usize),
    /// Per step, the exchange the pairs took.
    exchanges: Vec<String>,
    fill: Option<f64>,
    /// Steps run so far (warm-up included): which gradient the next one
    /// gets.
    steps: usize,
}

/// `s` with PowerSGD's rank set to `rank` (other strategies as they are).
fn with_rank(s: Strategy, rank: usize) -> Strategy {
    match s {
        Strategy::Powersgd(c) => Strategy::Powersgd(crate::powersgd::PowerSgdConfig { rank, ..c }),
        s => s,
    }
}

/// Every layer with one strategy, and the step model's prediction of it.
fn uniform(
    inp: &Inputs,
    p: usize,
    st: Strategy,
    id: StrategyId,
) -> Result<(Choices, Option<cost::StepPlan>)> {
    fixed(inp, p, vec![(st, id); inp.layers.len()])
}

/// A table with every layer's strategy given, and its prediction.
fn fixed(inp: &Inputs, p: usize, v: Choices) -> Result<(Choices, Option<cost::StepPlan>)> {
    let ids: Vec<StrategyId> = v.iter().map(|(_, id)| *id).collect();
    let plan = match &inp.profile {
        Some(prof) => {
            let q = StepQuery {
                at: crate::cost::Placement {
                    p,
                    ranks_per_node: inp.ranks_per_node,
                    fill: None,
                    allgather: Pick::Auto,
                },
                density: inp.density,
                select_method: "trimmed".into(),
                gradiveq_ratio: crate::cost::GRADIVEQ_RATIO,
                min_sparse_elems: 0,
                allowed: Vec::new(),
                powersgd_rank: inp.powersgd_rank,
            };
            let table = model::step_layers(&inp.layers);
            Some(cost::predict_step(prof, &q, &table, &ids)?)
        }
        None => None,
    };
    Ok((v, plan))
}

fn engine(
    comm: &MpiComm,
    cfg: &Config,
    inp: &Inputs,
    st: &[(Strategy, StrategyId)],
) -> Result<GradSync> {
    let mut s = GradSync::new(comm.communicator(), cfg.clone())?;
    for (l, (st, _)) in inp.layers.iter().zip(st) {
        let flat = [l.elements];
        s.register_with(&l.name, l.shape.as_deref().unwrap_or(&flat), st.clone())?;
    }
    Ok(s)
}

pub(super) fn run(comm: &MpiComm, a: &BenchArgs) -> Result<i32> {
    let mut inp = agree_inputs(comm, inputs(a, comm.rank()), |inp| {
        let mut m = common_must_match(a);
        // The table's contents, not the path (the same file by two
        // paths is the same table; the engine's registration compares
        // names and shapes exactly).
        let digest = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for l in &inp.layers {
                (&l.name, l.elements, &l.shape).hash(&mut h);
            }
            h.finish()
        };
        m.push((
            "--layers",
            format!(
                "{} layers, {} elements (digest {digest:016x})",
                inp.layers.len(),
                inp.layers.iter().map(|l| l.elements).sum::<usize>()
            ),
        ));
        m.push((
            "--profile",
            inp.profile.as_ref().map_or_else(String::new, |p| {
                serde_json::to_string(p).unwrap_or_default()
            }),
        ));
        m.push(("--strategies", format!("{:?}", inp.allowed)));
        m.push(("--density", inp.density.to_string()));
        m.push(("--calibrate", a.calibrate.to_string()));
        m.push(("--compare", a.compare.to_string()));
        m.push(("--sparse-exchange", inp.exchange.to_string()));
        m.push(("--powersgd-rank", inp.powersgd_rank.to_string()));
        m
    })?;
    // The job's placement for the two-level model (collective on every rank).
    inp.ranks_per_node = crate::comm::ranks_per_node(&comm.node_ids());
    let (rank, p) = (comm.rank(), comm.size());
    if a.calibrate {
        // The library's calibration, from inside this job (collective).
        // Messages and layers up to 64 MiB: a whole table's fused buffers
        // are hundreds of MB, far past the default's 16 MiB curve.
        let opts = crate::calibrate::CalibrateOptions {
            max_bytes: 64 << 20,
            ..Default::default()
        };
        let prof = crate::calibrate::calibrate(comm, &opts)?;
        if let Some(path) = &a.profile {
            crate::comm::agree::agree(comm, if rank == 0 { prof.save(path) } else { Ok(()) })?;
        }
        inp.profile = Some(prof);
    }
    let mut cfg = Config {
        sparse_exchange: inp.exchange,
        // The engine follows the profile the plan was made with: `auto`
        // prices every step with it, and its measured local parallelism
        // decides whether the local phase runs layer-parallel, as the
        // step model assumes (`Profile::local_parallelism`).
        profile: inp.profile.clone(),
        ..Config::default()
    };
    if let Some(t) = a.compress_threshold {
        cfg.compress_threshold = t;
    }
    // The engine runs one dense algorithm a step: the one named, or with
    // several named the model's choice each step (`allreduce = "auto"`),
    // as the plan prices the dense group.
    let dense_named: Vec<StrategyId> = inp
        .allowed
        .iter()
        .copied()
        .filter(|id| id.is_dense())
        .collect();
    cfg.allreduce = match dense_named.as_slice() {
        [StrategyId::DenseRing] => Pick::Fixed(AllreduceAlgo::Ring),
        [StrategyId::DenseHierarchical] => Pick::Fixed(AllreduceAlgo::Hierarchical),
        [_, _, ..] if cfg.profile.is_some() => Pick::Auto,
        _ => Pick::Fixed(AllreduceAlgo::Rabenseifner),
    };
    let algo = cfg.allreduce;
    let dense_id = match algo {
        Pick::Fixed(AllreduceAlgo::Ring) => StrategyId::DenseRing,
        Pick::Fixed(AllreduceAlgo::Hierarchical) => StrategyId::DenseHierarchical,
        _ => StrategyId::DenseRabenseifner,
    };
    let (strategies, plan, allowed) = plan(&inp, p, &cfg)?;
    let mut configs = vec![("planned", strategies, plan)];
    if a.compare {
        let (s, pl) = uniform(&inp, p, Strategy::Dense, dense_id)?;
        configs.push(("dense", s, pl));
        let sparse_id = match inp.exchange {
            Pick::Fixed(SparseExchange::Allreduce) => StrategyId::SparseAllreduce,
            Pick::Fixed(SparseExchange::Hierarchical) => StrategyId::SparseHierarchical,
            _ => StrategyId::SparseAllgather,
        };
        let (s, pl) = uniform(&inp, p, Strategy::rgc(inp.density), sparse_id)?;
        configs.push(("sparse", s, pl));
        // RGC as the engine runs it given the codec and no profile: the
        // layers below `compress_threshold` dense (for convergence, as
        // RedSync and DGC leave them), the rest RGC. The single strategy
        // a user would run, beside which `planned` is judged; listed where
        // the table has layers on both sides of the threshold.
        let small = |l: &model::LayerSpec| l.elements < cfg.compress_threshold;
        if inp.layers.iter().any(small) && !inp.layers.iter().all(small) {
            let v = inp
                .layers
                .iter()
                .map(|l| {
                    if small(l) {
                        (Strategy::Dense, dense_id)
                    } else {
                        (Strategy::rgc(inp.density), sparse_id)
                    }
                })
                .collect();
            let (s, pl) = fixed(&inp, p, v)?;
            configs.push(("sparse-threshold", s, pl));
        }
        if inp.profile.as_ref().is_some_and(|p| !p.powersgd.is_zero()) {
            let st = Strategy::Powersgd(crate::powersgd::PowerSgdConfig {
                rank: inp.powersgd_rank,
                start: 0,
                ..Default::default()
            });
            let (s, pl) = uniform(&inp, p, st, StrategyId::Powersgd)?;
            configs.push(("powersgd", s, pl));
        }
    }
    let mut runs: Vec<Measured> = configs
        .into_iter()
        .map(|(name, strategies, plan)| {
            Ok(Measured {
                name,
                engine: engine(comm, &cfg, &inp, &strategies)?,
                strategies,
                plan,
                parts: Default::default(),
                bytes: (0, 0),
                exchanges: Vec::new(),
                fill: None,
                steps: 0,
            })
        })
        .collect::<Result<_>>()?;
    let input: Vec<Vec<f32>> = inp
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let k = layer_scale(i);
            let mut g = synthetic(l.elements, "normal", (rank * 100_003 + i) as u64 + 1)?;
            g.iter_mut().for_each(|x| *x *= k);
            Ok(g)
        })
        .collect::<Result<_>>()?;
    let mut work = input.clone();
    let dense_in: Vec<f32> = input.concat();
    let mut dense_out = vec![0f32; dense_in.len()];
    let nruns = runs.len();
    // The machine's state beside the steps against the profile's.
    let mut state = match &inp.profile {
        Some(prof) => crate::calibrate::state_probes(comm, prof)?,
        None => Vec::new(),
    };
    let nstate = state.len();
    let mut state_round = 0;
    let ops = 1 + nstate + nruns;
    let mut times = time_interleaved(comm, a.iters, a.warmup, ops, |k| {
        if k == 0 {
            return timed(comm, || {
                comm.native_allreduce_sum(&dense_in, &mut dense_out)
                    .ok_or_else(|| Error::Unsupported("no MPI allreduce".into()))?
            });
        }
        if k <= nstate {
            state_round += 1;
            return state[k - 1].measure(state_round);
        }
        let r = &mut runs[k - 1 - nstate];
        // Each step its own gradient, as in training (a sparse layer's
        // residual would otherwise accumulate one gradient, and its
        // selection slow down with the step count).
        for (w, i) in work.iter_mut().zip(&input) {
            crate::calibrate::step_gradient(w, i, r.steps);
        }
        r.steps += 1;
        let mut st = None;
        let t = timed(comm, || {
            let mut views: Vec<&mut [f32]> = work.iter_mut().map(|w| &mut w[..]).collect();
            st = Some(r.engine.sync(&mut views)?.clone());
            Ok(())
        })?;
        let st = st.expect("sync ran");
        // The sparse group: the fused allgatherv and the pairs' sparse
        // allreduce, whichever ran.
        r.parts[0].push(st.allgather_s + st.sparse_reduce_s);
        r.exchanges.push(st.sparse_exchange.clone());
        r.fill = st.fill_estimate;
        r.parts[1].push(st.allreduce_s);
        r.parts[2].push(st.select_s + st.pack_s + st.unpack_s);
        r.parts[3].push(st.powersgd_s);
        r.bytes = (st.fused_bytes, st.dense_bytes);
        Ok(t)
    })?;
    let dense = median(&mut times[0]);
    let state: Vec<StateRecord> = state
        .iter()
        .zip(&mut times[1..])
        .map(|(s, t)| StateRecord {
            probe: s.probe.into(),
            size: s.size,
            measured_s: median(t),
            profile_s: s.profile_s,
        })
        .collect();
    for (r, t) in runs.iter_mut().zip(times.iter_mut().skip(1 + nstate)) {
        let mut rec = record(comm, a, &inp, r, t, dense, algo, &allowed, p)?;
        rec.state_probes = state.clone();
        if rank == 0 {
            print_record(a, &rec)?;
        }
    }
    Ok(0)
}

/// The record of one measured configuration (collective: medians are the
/// slowest rank's).
#[allow(clippy::too_many_arguments)]
fn record(
    comm: &MpiComm,
    a: &BenchArgs,
    inp: &Inputs,
    r: &mut Measured,
    t: &mut [f64],
    dense: f64,
    algo: Pick<AllreduceAlgo>,
    allowed: &[StrategyId],
    p: usize,
) -> Result<StepRecord> {
    let mut med = [0f64; 4];
    for (m, v) in med.iter_mut().zip(r.parts.iter_mut()) {
        let mut tail = v.split_off(a.warmup.min(v.len()));
        *m = median(&mut tail);
    }
    max_over_ranks(comm, &mut med);
    let step_times_s = t.to_vec();
    let median_s = median(t);
    let min_s = t.iter().copied().fold(f64::INFINITY, f64::min);
    let (plan, bytes) = (&r.plan, r.bytes);
    let mut choices = Vec::new();
    let mut counts = std::collections::BTreeMap::new();
    let mut groups: Vec<StepGroupRecord> = Vec::new();
    for (i, (l, (_, id))) in inp.layers.iter().zip(&r.strategies).enumerate() {
        // A PowerSGD layer the planner (and the engine) left dense is in
        // the dense group.
        let group = match plan.as_ref().map(|pl| pl.layers[i].group) {
            Some(g) => g,
            None if id.is_dense() => GroupKind::Dense,
            None if *id == StrategyId::Powersgd => GroupKind::Lowrank,
            None => GroupKind::Sparse,
        };
        *counts.entry(id.name().to_string()).or_insert(0usize) += 1;
        choices.push(StepLayerRecord {
            name: l.name.clone(),
            elements: l.elements,
            choice: id.name().to_string(),
            group,
            predicted_s: plan.as_ref().map(|pl| pl.layers[i].marginal_s),
        });
        match groups.iter_mut().find(|g| g.kind == group) {
            Some(g) => {
                g.layers += 1;
                g.elements += l.elements;
            }
            None => groups.push(StepGroupRecord {
                kind: group,
                algorithm: match group {
                    GroupKind::Lowrank => "powersgd",
                    GroupKind::Dense => match algo {
                        Pick::Fixed(AllreduceAlgo::Ring) => "dense-ring",
                        Pick::Fixed(AllreduceAlgo::Hierarchical) => "dense-hierarchical",
                        Pick::Auto => "dense-auto",
                        _ => "dense-rabenseifner",
                    },
                    _ => match inp.exchange {
                        Pick::Fixed(SparseExchange::Allgather) => "sparse-allgather",
                        Pick::Fixed(SparseExchange::Allreduce) => "sparse-allreduce",
                        Pick::Fixed(SparseExchange::Hierarchical) => "sparse-hierarchical",
                        Pick::Auto => "sparse-auto",
                    },
                }
                .into(),
                layers: 1,
                elements: l.elements,
                message_bytes: 0,
                measured_s: 0.0,
                predicted_s: None,
            }),
        }
    }
    for g in &mut groups {
        let (measured, msg) = match g.kind {
            GroupKind::Dense => (med[1], bytes.1),
            // Its products and both allreduces (StepStats::powersgd_s);
            // the message is the plan's factors.
            GroupKind::Lowrank => (
                med[3],
                plan.as_ref()
                    .and_then(|pl| pl.groups.iter().find(|x| x.kind == GroupKind::Lowrank))
                    .map_or(0, |x| x.message_bytes as usize),
            ),
            _ => (med[0], bytes.0),
        };
        g.measured_s = measured;
        g.message_bytes = msg;
        g.predicted_s = plan
            .as_ref()
            .and_then(|pl| pl.groups.iter().find(|x| x.kind == g.kind))
            .map(|x| x.comm_s);
    }
    let predicted_s = plan.as_ref().map(|pl| pl.seconds);
    let mut exchanges = std::collections::BTreeMap::new();
    for e in r.exchanges.iter().skip(a.warmup) {
        *exchanges.entry(e.clone()).or_insert(0usize) += 1;
    }
    Ok(StepRecord {
        op: "step".into(),
        config: r.name.into(),
        ranks: p,
        layers_file: inp.path.clone(),
        layers: inp.layers.len(),
        elements: inp.layers.iter().map(|l| l.elements).sum(),
        density: inp.density,
        strategies: allowed.iter().map(|x| x.name().to_string()).collect(),
        iters: a.iters,
        median_s,
        min_s,
        step_times_s,
        predicted_s,
        rel_error: predicted_s.map(|x| (x - median_s) / median_s),
        dense_mpi_median_s: dense,
        speedup_vs_dense: dense / median_s,
        wire_bytes_per_rank: bytes.0 + bytes.1,
        groups,
        local_s: med[2],
        choices,
        choice_counts: counts,
        sparse_exchange: inp.exchange.to_string(),
        exchanges,
        fill_estimate: r.fill,
        state_probes: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use StrategyId::{DenseRabenseifner, SparseAllgather, SparseAllreduce, SparseHierarchical};

    #[test]
    fn strategies_are_priced_through_the_configured_exchange() {
        let rgc = [DenseRabenseifner, SparseAllgather];
        let x = |e: Pick<SparseExchange>, l: Option<usize>| through_exchange(&rgc, e, l);
        assert_eq!(x(SparseExchange::Allgather.into(), None).unwrap(), rgc);
        assert_eq!(
            x(SparseExchange::Allreduce.into(), None).unwrap(),
            [DenseRabenseifner, SparseAllreduce]
        );
        assert_eq!(
            x(SparseExchange::Hierarchical.into(), Some(2)).unwrap(),
            [DenseRabenseifner, SparseHierarchical]
        );
        assert_eq!(
            x(Pick::Auto, None).unwrap(),
            [DenseRabenseifner, SparseAllgather, SparseAllreduce]
        );
        assert_eq!(
            x(Pick::Auto, Some(2)).unwrap(),
            [
                DenseRabenseifner,
                SparseAllgather,
                SparseAllreduce,
                SparseHierarchical
            ]
        );
        // A reducing collective the exchange does not run: an error naming both flags.
        let e = through_exchange(&[SparseAllreduce], SparseExchange::Allgather.into(), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--strategies sparse-allreduce")
                && e.contains("--sparse-exchange allgather"),
            "{e}"
        );
        assert!(through_exchange(&[SparseHierarchical], Pick::Auto, None).is_err());
    }
}
