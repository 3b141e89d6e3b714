//! The step planner: every per-step policy decision of the engine, as a pure
//! function of (step, options, number of ranks, layer table) — no I/O, no
//! layer state, no transport — so it is the same on every rank by
//! construction and is tested without one (the tests below).
//!
//! [`plan_step`] decides:
//!
//! * whether the step communicates: SBC's communication delay (`delay = T`,
//!   SBC §3 "communication delay"): steps `T−1, 2T−1, ...` (0-based)
//!   communicate, the others are local (every layer [`Mode::Local`]);
//!   `delay = 1` communicates every step;
//! * each layer's [`Mode`]: RedSync §5.6's dense warm-up ([`Warmup::Dense`]:
//!   every layer, sparse and GradiVeQ ones included, dense for the first
//!   `steps` steps), else the layer's registered kind (sparse codec, dense,
//!   GradiVeQ's compressed-domain ring);
//! * the density each sparse layer's codec is set to: DGC's exponential
//!   warm-up ([`Warmup::Density`]: `schedule[step / steps_per_stage]` while
//!   the schedule lasts), else the layer's own (the strategy's `density`,
//!   else the codec's);
//! * the groups: the dense layers' offsets in the fused dense buffer and its
//!   length (Horovod-style tensor fusion, RedSync §4), the sparse layers
//!   fused into one allgatherv message, the sparse layers exchanged by one
//!   sparse allreduce instead (`Config::sparse_exchange` other than
//!   `Allgather`, for codecs whose units are index/value pairs: RGC and
//!   quantized RGC) with their offsets in its concatenated index space,
//!   the GradiVeQ layers' rings, the local layers. With
//!   `sparse_exchange = "auto"` those layers are planned as reduced and
//!   the engine's per-step choice ([`set_exchange`], from the cost model
//!   and inputs alike on every rank) keeps them there, with the sparse
//!   allreduce or the node-aware one, or moves them back into the fused
//!   message (then the plan is the `allgather` one);
//! * which collectives run (allgatherv when some layer is in the fused
//!   message and there is more than one rank; the allreduce for the dense
//!   buffer, or as a status exchange before GradiVeQ's rings when nothing
//!   else carries the step's status and always before the sparse
//!   allreduce; the sparse allreduce when some layer is reduced) and
//!   whether the local math and the unpacking run in parallel.
//!
//! The rest of the step ([`super::GradSync`]'s `start`/`wait`) only executes
//! the plan.

use super::config::{Config, SparseExchange, Strategy, Warmup};
use crate::codec::CodecConfig;

/// What a layer does in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Mode {
    /// GradiVeQ's compressed-domain ring.
    Gradiveq,
    /// Part of the fused dense allreduce.
    #[default]
    Dense,
    /// Compressed into the fused sparse message (Algorithm 4).
    Sparse,
    /// A delayed step without communication: the local direction.
    Local,
}

/// How a registered layer is synchronized, as far as the planner cares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum LayerKind {
    /// Dense allreduce.
    Dense,
    /// A sparse codec with its configured density (the strategy's
    /// override, else the codec's own; `None` for codecs without one).
    Sparse {
        /// The layer's configured density.
        density: Option<f64>,
        /// The codec's units are index/value pairs (RGC, quantized RGC),
        /// so the layer can be exchanged by the sparse allreduce.
        pairs: bool,
    },
    /// GradiVeQ.
    Gradiveq,
}

/// One row of the layer table the planner reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct LayerPlanInput {
    /// Element count.
    pub(super) n: usize,
    /// Registered kind.
    pub(super) kind: LayerKind,
}

impl LayerPlanInput {
    /// The planner's row of a layer of `n` elements with the resolved
    /// `strategy` (`Auto` is resolved at registration; it counts as dense,
    /// as a layer without a codec does).
    pub(super) fn new(n: usize, strategy: &Strategy) -> Self {
        let kind = match strategy {
            Strategy::Sparse { codec, density } => LayerKind::Sparse {
                density: density.or_else(|| config_density(codec)),
                pairs: config_pairs(codec),
            },
            Strategy::Gradiveq(_) => LayerKind::Gradiveq,
            Strategy::Dense | Strategy::Auto => LayerKind::Dense,
        };
        LayerPlanInput { n, kind }
    }
}

/// The density parameter of a codec configuration, if it has one.
pub(super) fn config_density(c: &CodecConfig) -> Option<f64> {
    match c {
        CodecConfig::Rgc { density, .. } | CodecConfig::RgcQuant { density } => Some(*density),
        CodecConfig::Sbc { p } => Some(*p),
        _ => None,
    }
}

/// Whether a codec's units are index/value pairs, one value per index
/// (its [`for_each_sent`](crate::codec::Codec::for_each_sent) visits them):
/// RGC and quantized RGC. SBC also visits positions, but its Golomb-coded
/// unit is far smaller than the sparse allreduce's 8 bytes a pair, so it
/// stays in the fused allgatherv.
pub(super) fn config_pairs(c: &CodecConfig) -> bool {
    matches!(c, CodecConfig::Rgc { .. } | CodecConfig::RgcQuant { .. })
}

/// One layer's part of the plan.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct LayerPlan {
    /// What the layer does this step.
    pub(super) mode: Mode,
    /// Sparse layers: the density the codec is set to this step (`None`:
    /// the codec keeps its own).
    pub(super) density: Option<f64>,
    /// Dense layers: offset in the fused dense buffer (0 otherwise).
    pub(super) dense_off: usize,
    /// Sparse layers exchanged by the sparse allreduce (the `reduced`
    /// group) rather than in the fused allgatherv message.
    pub(super) reduced: bool,
    /// Reduced layers: offset of the layer's first element in the
    /// concatenated index space of the sparse allreduce (0 otherwise).
    pub(super) reduce_off: usize,
}

/// Layers that are treated alike in a step, in registration order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Group {
    /// Layer indices.
    pub(super) ids: Vec<u32>,
    /// Their elements in all (for the dense group: the fused buffer's
    /// length).
    pub(super) elems: usize,
}

impl Group {
    fn clear(&mut self) {
        self.ids.clear();
        self.elems = 0;
    }
    fn push(&mut self, id: usize, n: usize) {
        self.ids.push(id as u32);
        self.elems += n;
    }
}

/// Everything a step decides before it touches data. See the module docs.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct StepPlan {
    /// The step (0-based).
    pub(super) step: u64,
    /// Whether this step communicates (SBC's delay).
    pub(super) communicates: bool,
    /// Whether this step is in the dense warm-up.
    pub(super) dense_warmup: bool,
    /// The density warm-up's density for this step, while it lasts.
    pub(super) stage_density: Option<f64>,
    /// `delay > 1`: layers accumulate their local directions, and the
    /// communicating step subtracts what each rank applied alone.
    pub(super) delayed: bool,
    /// Per layer, in registration order.
    pub(super) layers: Vec<LayerPlan>,
    /// Dense layers (the fused allreduce buffer).
    pub(super) dense: Group,
    /// Sparse layers in the fused allgatherv message.
    pub(super) sparse: Group,
    /// Sparse layers exchanged by one sparse allreduce over their
    /// concatenated index space (`Config::sparse_exchange` is not
    /// `Allgather` and their codec sends index/value pairs); `elems` is
    /// that space's size.
    pub(super) reduced: Group,
    /// GradiVeQ layers (their rings).
    pub(super) gradiveq: Group,
    /// Local layers (a delayed step without communication).
    pub(super) local: Group,
    /// Run the allgatherv of the fused sparse messages.
    pub(super) gather: bool,
    /// Run the allreduce of the fused dense buffer (with its status word).
    pub(super) reduce: bool,
    /// Run the GradiVeQ layers' rings.
    pub(super) rings: bool,
    /// Run the sparse allreduce of the `reduced` layers (after the status
    /// agreement; at one rank it only copies this rank's pairs).
    pub(super) sparse_reduce: bool,
    /// How the `reduced` layers are exchanged this step: the configured
    /// exchange, `Auto` until the engine resolves it
    /// ([`set_exchange`]), `Allgather` when no layer is reduced.
    pub(super) exchange: SparseExchange,
    /// The dense allreduce this step: the configured algorithm; with
    /// `allreduce = "auto"` Rabenseifner until the engine resolves it by
    /// the dense group's size ([`crate::cost::choose_dense_allreduce`]).
    pub(super) allreduce: crate::dense::AllreduceAlgo,
    /// Compress / step the non-dense layers in parallel (rayon).
    pub(super) parallel_local: bool,
    /// Unpack the layers in parallel (rayon).
    pub(super) parallel_unpack: bool,
}

/// The plan of step `step` for `ranks` ranks under `cfg` with the layer
/// table `table`. Pure: the same inputs give the same plan on every rank.
// The engine replans into its own buffers (`plan_step_into`).
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn plan_step(
    step: u64,
    cfg: &Config,
    ranks: usize,
    table: &[LayerPlanInput],
) -> StepPlan {
    let mut plan = StepPlan::default();
    plan_step_into(&mut plan, step, cfg, ranks, table);
    plan
}

/// [`plan_step`] into an existing plan, reusing its buffers (no allocation
/// once they have grown to the table).
pub(super) fn plan_step_into(
    plan: &mut StepPlan,
    step: u64,
    cfg: &Config,
    ranks: usize,
    table: &[LayerPlanInput],
) {
    // `delay` ≥ 1 is checked with the options; 0 is read as 1.
    let delay = cfg.delay.max(1);
    // Steps T−1, 2T−1, ... communicate: (step + 1) % T == 0.
    let communicates = step % delay == delay - 1;
    let dense_warmup = matches!(cfg.warmup, Warmup::Dense { steps } if step < steps);
    let stage_density = match &cfg.warmup {
        Warmup::Density {
            schedule,
            steps_per_stage,
        } => step
            .checked_div(*steps_per_stage)
            .and_then(|s| schedule.get(s as usize).copied()),
        _ => None,
    };
    plan.step = step;
    plan.communicates = communicates;
    plan.dense_warmup = dense_warmup;
    plan.stage_density = stage_density;
    plan.delayed = cfg.delay > 1;
    plan.layers.clear();
    let reduce_pairs = cfg.sparse_exchange != SparseExchange::Allgather;
    for g in [
        &mut plan.dense,
        &mut plan.sparse,
        &mut plan.reduced,
        &mut plan.gradiveq,
        &mut plan.local,
    ] {
        g.clear();
    }
    for (i, l) in table.iter().enumerate() {
        let mode = if !communicates {
            Mode::Local
        } else if dense_warmup {
            Mode::Dense
        } else {
            match l.kind {
                LayerKind::Dense => Mode::Dense,
                LayerKind::Sparse { .. } => Mode::Sparse,
                LayerKind::Gradiveq => Mode::Gradiveq,
            }
        };
        let mut lp = LayerPlan {
            mode,
            ..LayerPlan::default()
        };
        match mode {
            Mode::Dense => {
                lp.dense_off = plan.dense.elems;
                plan.dense.push(i, l.n);
            }
            Mode::Sparse => {
                let (own, pairs) = match l.kind {
                    LayerKind::Sparse { density, pairs } => (density, pairs),
                    LayerKind::Dense | LayerKind::Gradiveq => (None, false),
                };
                lp.density = stage_density.or(own);
                if pairs && reduce_pairs {
                    lp.reduced = true;
                    lp.reduce_off = plan.reduced.elems;
                    plan.reduced.push(i, l.n);
                } else {
                    plan.sparse.push(i, l.n);
                }
            }
            Mode::Gradiveq => plan.gradiveq.push(i, l.n),
            Mode::Local => plan.local.push(i, l.n),
        }
        plan.layers.push(lp);
    }
    plan.gather = !plan.sparse.ids.is_empty() && ranks > 1;
    plan.rings = !plan.gradiveq.ids.is_empty();
    plan.sparse_reduce = !plan.reduced.ids.is_empty();
    plan.exchange = if plan.sparse_reduce {
        cfg.sparse_exchange
    } else {
        SparseExchange::Allgather
    };
    plan.allreduce = match cfg.allreduce {
        crate::dense::AllreduceAlgo::Auto => crate::dense::AllreduceAlgo::Rabenseifner,
        a => a,
    };
    // A step with GradiVeQ layers and no fused message carries its status
    // in a one-word allreduce before the rings. A step with reduced layers
    // always runs the status allreduce: its second word says whether some
    // rank's reduced layer was non-finite (the fused message cannot say:
    // those layers are not in it), and it decides before the sparse
    // allreduce whether the step failed. So does every step of several
    // ranks with nothing else to carry the status (a delayed step without
    // communication, `delay > 1`; a table of empty dense layers, or none):
    // eight bytes, so that a failure or a NaN/Inf on one rank reaches every
    // rank in that step.
    set_reduce(plan, ranks);
    plan_parallel(plan, cfg);
}

/// Whether the step runs the dense allreduce: for the dense buffer, or
/// as the status exchange (module docs).
fn set_reduce(plan: &mut StepPlan, ranks: usize) {
    plan.reduce = plan.dense.elems > 0
        || (plan.rings && !plan.gather)
        || plan.sparse_reduce
        || (ranks > 1 && !plan.gather);
}

/// The exchange of the `reduced` group this step (`sparse_exchange =
/// "auto"`: the engine's per-step choice, the same on every rank).
/// `Allgather` moves the group's layers back into the fused allgatherv
/// message, giving the plan of `sparse_exchange = "allgather"`; the
/// sparse allreduces keep the group. Nothing to do without reduced
/// layers.
pub(super) fn set_exchange(plan: &mut StepPlan, exchange: SparseExchange, ranks: usize) {
    if !plan.sparse_reduce {
        plan.exchange = SparseExchange::Allgather;
        return;
    }
    plan.exchange = exchange;
    if exchange != SparseExchange::Allgather {
        return;
    }
    for &id in &plan.reduced.ids {
        let lp = &mut plan.layers[id as usize];
        lp.reduced = false;
        lp.reduce_off = 0;
    }
    // Both groups are in registration order; so is their union.
    plan.sparse.ids.extend_from_slice(&plan.reduced.ids);
    plan.sparse.ids.sort_unstable();
    plan.sparse.elems += plan.reduced.elems;
    plan.reduced.clear();
    plan.sparse_reduce = false;
    plan.gather = ranks > 1;
    set_reduce(plan, ranks);
}

/// Whether the local math and the unpacking run in parallel.
fn plan_parallel(plan: &mut StepPlan, cfg: &Config) {
    // Parallel only across two or more layers: one layer gains nothing,
    // and idle rayon workers spinning next to MPI's polling cost more than
    // they bring on a few cores.
    // Only where it pays: a profile whose calibration measured the
    // layer-parallel phase slower than one layer after another (every core
    // already busy with a rank) keeps it serial.
    let pays = cfg
        .profile
        .as_ref()
        .is_none_or(|p| p.local_parallelism >= 1.0);
    let non_dense = plan.layers.len() - plan.dense.ids.len();
    let sparse_elems = plan.sparse.elems + plan.reduced.elems;
    let sparse_layers = plan.sparse.ids.len() + plan.reduced.ids.len();
    plan.parallel_local = pays && non_dense >= 2 && sparse_elems >= cfg.parallel_min_elems;
    plan.parallel_unpack = pays && sparse_layers >= 2 && sparse_elems >= cfg.parallel_min_elems;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A profile that measured the parallel local phase slower keeps it
    /// serial; one that measured a gain (or no profile) runs it.
    #[test]
    fn parallel_local_phase_only_where_the_profile_says_it_pays() {
        let table = [
            LayerPlanInput::new(1 << 20, &Strategy::rgc(0.01)),
            LayerPlanInput::new(1 << 20, &Strategy::rgc(0.01)),
        ];
        let mut prof = crate::cost::Profile::from_network(1e-6, 1e9, 0.0, 0.0).unwrap();
        for (par, want) in [(None, true), (Some(0.9), false), (Some(1.6), true)] {
            let cfg = Config {
                profile: par.map(|x| {
                    prof.local_parallelism = x;
                    prof.clone()
                }),
                ..Config::default()
            };
            let p = plan_step(0, &cfg, 2, &table);
            assert_eq!(
                (p.parallel_local, p.parallel_unpack),
                (want, want),
                "{par:?}"
            );
        }
    }
    use crate::codec::RgcMethod;

    fn sparse(n: usize, density: Option<f64>) -> LayerPlanInput {
        LayerPlanInput {
            n,
            kind: LayerKind::Sparse {
                density,
                pairs: false,
            },
        }
    }
    /// A sparse layer whose codec sends index/value pairs (RGC).
    fn pairs(n: usize, density: f64) -> LayerPlanInput {
        LayerPlanInput {
            n,
            kind: LayerKind::Sparse {
                density: Some(density),
                pairs: true,
            },
        }
    }
    fn dense(n: usize) -> LayerPlanInput {
        LayerPlanInput {
            n,
            kind: LayerKind::Dense,
        }
    }
    fn gvq(n: usize) -> LayerPlanInput {
        LayerPlanInput {
            n,
            kind: LayerKind::Gradiveq,
        }
    }
    fn modes(p: &StepPlan) -> Vec<Mode> {
        p.layers.iter().map(|l| l.mode).collect()
    }
    /// A table of every kind: dense 10, sparse 1000 (own density 0.01),
    /// GradiVeQ 500, dense 7, sparse 300 (codec without a density).
    fn table() -> Vec<LayerPlanInput> {
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
        let p = plan_step(0, &Config::default(), 4, &table());
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
        let p = plan_step(0, &cfg, 4, &table());
        assert!(p.parallel_local && p.parallel_unpack);
    }

    #[test]
    fn one_rank_gathers_nothing() {
        let p = plan_step(0, &Config::default(), 1, &table());
        assert!(!p.gather && p.reduce && p.rings);
        // GradiVeQ alone on one rank: its status goes in a one-word allreduce.
        let p = plan_step(0, &Config::default(), 1, &[gvq(100)]);
        assert!(!p.gather && p.reduce && p.rings);
        assert_eq!(p.dense.elems, 0);
        // With a fused message, that message carries the status.
        let p = plan_step(0, &Config::default(), 2, &[gvq(100), sparse(50, None)]);
        assert!(p.gather && !p.reduce && p.rings);
    }

    #[test]
    fn empty_table() {
        for step in [0, 1, 5] {
            let cfg = Config {
                delay: 2,
                ..Config::default()
            };
            let p = plan_step(step, &cfg, 3, &[]);
            assert!(p.layers.is_empty());
            assert_eq!(p.dense, Group::default());
            assert_eq!(p.sparse, Group::default());
            assert!(!p.gather && !p.rings);
            // The status allreduce (8 bytes) still runs, so a failure on
            // one rank reaches every rank; alone, nothing runs.
            assert!(p.reduce && p.dense.elems == 0);
            assert!(!plan_step(step, &cfg, 1, &[]).reduce);
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
            let p = plan_step(step, &cfg, 2, &table());
            assert!(p.dense_warmup, "step {step}");
            assert!(p.layers.iter().all(|l| l.mode == Mode::Dense));
            assert_eq!(p.dense.ids, [0, 1, 2, 3, 4]);
            assert_eq!(p.dense.elems, 10 + 1000 + 500 + 7 + 300);
            let offs: Vec<usize> = p.layers.iter().map(|l| l.dense_off).collect();
            assert_eq!(offs, [0, 10, 1010, 1510, 1517]);
            assert!(p.layers.iter().all(|l| l.density.is_none()));
            assert!(!p.gather && p.reduce && !p.rings);
        }
        let p = plan_step(3, &cfg, 2, &table());
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
            let p = plan_step(step as u64, &cfg, 2, &table());
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
            .map(|s| plan_step(s, &cfg, 2, &t).communicates)
            .collect();
        assert_eq!(
            comm,
            [false, false, true, false, false, true, false, false, true]
        );
        let p = plan_step(0, &cfg, 2, &t);
        assert!(p.delayed);
        assert!(p.layers.iter().all(|l| l.mode == Mode::Local));
        assert_eq!(p.local.ids, [0, 1, 2, 3, 4]);
        assert!(p.dense.ids.is_empty() && p.sparse.ids.is_empty());
        // Only the status allreduce: a failure or a NaN/Inf on one rank
        // reaches every rank in this step. Alone, no collective at all.
        assert!(!p.gather && p.reduce && !p.rings);
        assert_eq!(p.dense.elems, 0);
        assert!(!plan_step(0, &cfg, 1, &t).reduce);
        // Several local layers but nothing sparse: serial.
        assert!(!p.parallel_local);
        let p = plan_step(2, &cfg, 2, &t);
        assert!(p.delayed && p.communicates);
        assert_eq!(p.sparse.ids, [1, 4]);
        // delay 1: every step, no accumulators.
        let p = plan_step(7, &Config::default(), 2, &t);
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
        assert_eq!(modes(&plan_step(0, &cfg, 2, &t)), [Mode::Local; 2]);
        assert_eq!(modes(&plan_step(1, &cfg, 2, &t)), [Mode::Dense; 2]);
        assert_eq!(modes(&plan_step(2, &cfg, 2, &t)), [Mode::Local; 2]);
        assert_eq!(
            modes(&plan_step(3, &cfg, 2, &t)),
            [Mode::Sparse, Mode::Dense]
        );
    }

    #[test]
    fn table_rows_from_strategies() {
        let rgc = Strategy::rgc(0.02);
        assert_eq!(
            LayerPlanInput::new(9, &rgc).kind,
            LayerKind::Sparse {
                density: Some(0.02),
                pairs: true
            }
        );
        let quant = Strategy::Sparse {
            codec: CodecConfig::RgcQuant { density: 0.02 },
            density: None,
        };
        assert_eq!(
            LayerPlanInput::new(9, &quant).kind,
            LayerKind::Sparse {
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
                LayerPlanInput::new(9, &st).kind,
                LayerKind::Sparse {
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
            LayerPlanInput::new(9, &over).kind,
            LayerKind::Sparse {
                density: Some(0.5),
                pairs: true
            }
        );
        let sbc = Strategy::Sparse {
            codec: CodecConfig::Sbc { p: 0.03 },
            density: None,
        };
        assert_eq!(
            LayerPlanInput::new(9, &sbc).kind,
            LayerKind::Sparse {
                density: Some(0.03),
                pairs: false
            }
        );
        assert_eq!(
            LayerPlanInput::new(9, &Strategy::Dense),
            LayerPlanInput {
                n: 9,
                kind: LayerKind::Dense
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
        let mut p = StepPlan::default();
        for step in 0..8 {
            plan_step_into(&mut p, step, &cfg, 3, &t);
            assert_eq!(p, plan_step(step, &cfg, 3, &t), "step {step}");
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
            sparse_exchange: SparseExchange::Auto,
            ..base.clone()
        };
        for ranks in [1, 2, 3] {
            for step in 0..6 {
                let planned = plan_step(step, &auto, ranks, &t);
                assert_eq!(
                    planned.exchange,
                    if planned.sparse_reduce {
                        SparseExchange::Auto
                    } else {
                        SparseExchange::Allgather
                    }
                );
                for ex in [
                    SparseExchange::Allgather,
                    SparseExchange::Allreduce,
                    SparseExchange::Hierarchical,
                ] {
                    let mut p = planned.clone();
                    set_exchange(&mut p, ex, ranks);
                    let cfg = Config {
                        sparse_exchange: ex,
                        ..base.clone()
                    };
                    assert_eq!(
                        p,
                        plan_step(step, &cfg, ranks, &t),
                        "{ex:?} step {step} ranks {ranks}"
                    );
                }
            }
        }
        // Some step reduces (and moving back matters).
        let p = plan_step(3, &auto, 3, &t);
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
            sparse_exchange: SparseExchange::Allreduce,
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
            let p = plan_step(0, &cfg, ranks, &t);
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
        let p = plan_step(0, &cfg, 3, &[pairs(100, 0.1)]);
        assert!(p.sparse_reduce && p.reduce && !p.gather && !p.rings);
        assert_eq!(p.dense.elems, 0);
        // The default exchange keeps every sparse layer in the message.
        let p = plan_step(0, &Config::default(), 3, &t);
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
            let p = plan_step(step, &warm, 3, &t);
            assert!(!p.sparse_reduce && p.reduced.ids.is_empty(), "step {step}");
        }
        assert!(plan_step(3, &warm, 3, &t).sparse_reduce);
        // Parallel phases count the reduced layers as sparse ones.
        let par = Config {
            parallel_min_elems: 1000,
            ..cfg
        };
        let p = plan_step(0, &par, 2, &[pairs(600, 0.1), pairs(600, 0.1)]);
        assert!(p.parallel_local && p.parallel_unpack);
    }
}
