//! The step planner: every per-step policy decision of the engine, as a pure
//! function of (step, options, number of ranks, layer table) — no I/O, no
//! layer state, no transport — so it is the same on every rank by
//! construction and is tested without one (the tests below).
//!
//! [`script_step`] decides:
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
//!   the GradiVeQ layers' rings, the PowerSGD layers (dense before their
//!   `start`; their factors in two fused allreduces), the local layers. With
//!   `sparse_exchange = "auto"` those layers are planned as reduced and
//!   the engine's per-step choice ([`set_exchange`], from the cost model
//!   and inputs alike on every rank) keeps them there, with the sparse
//!   allreduce or the node-aware one, or moves them back into the fused
//!   message (then the plan is the `allgather` one);
//! * which collectives run (allgatherv when some layer is in the fused
//!   message and there is more than one rank; the allreduce for the dense
//!   buffer, or as a status exchange before GradiVeQ's rings or PowerSGD's
//!   factors when nothing
//!   else carries the step's status and always before the sparse
//!   allreduce; the sparse allreduce when some layer is reduced) and
//!   whether the local math and the unpacking run in parallel.
//!
//! The rest of the step ([`super::GradSync`]'s `start`/`wait`) only executes
//! the plan.

use super::config::{Config, Pick, SparseExchange, Strategy, Warmup};
use crate::cost::Tuning;

/// What a layer does in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Mode {
    /// GradiVeQ's compressed-domain ring.
    Gradiveq,
    /// PowerSGD: its factors in the step's two fused allreduces.
    Powersgd,
    /// Part of the fused dense allreduce.
    #[default]
    Dense,
    /// Compressed into the fused sparse message (Algorithm 4).
    Sparse,
    /// A delayed step without communication: the local direction.
    Local,
    /// In another bucket of the step (a bucket's plan only,
    /// [`restrict_into`]).
    Other,
}

/// How a registered layer is synchronized, as far as the planner cares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum RowKind {
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
    /// PowerSGD from step `start` on (dense before).
    Powersgd {
        /// The first compressed step.
        start: u64,
    },
}

/// One row of the layer table the planner reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct TableRow {
    /// Element count.
    pub(super) n: usize,
    /// Registered kind.
    pub(super) kind: RowKind,
}

impl TableRow {
    /// The planner's row of a layer of `n` elements with the resolved
    /// `strategy` (`Auto` is resolved at registration; it counts as dense,
    /// as a layer without a codec does).
    pub(super) fn new(n: usize, strategy: &Strategy) -> Self {
        let kind = match strategy {
            Strategy::Sparse { codec, density } => RowKind::Sparse {
                density: density.or_else(|| codec.own_density()),
                pairs: codec.sends_pairs(),
            },
            Strategy::Gradiveq(_) => RowKind::Gradiveq,
            // A layer PowerSGD does not compress (too small, a vector)
            // is made dense by the caller, which knows its shape.
            Strategy::Powersgd(c) => RowKind::Powersgd { start: c.start },
            Strategy::Dense | Strategy::Auto => RowKind::Dense,
        };
        TableRow { n, kind }
    }
}

/// One layer's part of the plan.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct LayerStep {
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
pub(super) struct StepScript {
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
    pub(super) layers: Vec<LayerStep>,
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
    /// PowerSGD layers (their factors' two fused allreduces).
    pub(super) powersgd: Group,
    /// Local layers (a delayed step without communication).
    pub(super) local: Group,
    /// Run the allgatherv of the fused sparse messages.
    pub(super) gather: bool,
    /// Run the allreduce of the fused dense buffer (with its status word).
    pub(super) reduce: bool,
    /// Run the GradiVeQ layers' rings.
    pub(super) rings: bool,
    /// Run the PowerSGD layers' factor allreduces.
    pub(super) lowrank: bool,
    /// Run the sparse allreduce of the `reduced` layers (after the status
    /// agreement; at one rank it only copies this rank's pairs).
    pub(super) sparse_reduce: bool,
    /// How the `reduced` layers are exchanged this step: the forced
    /// exchange, or the decision table's ([`crate::cost::Tuning::exchange`],
    /// set by [`set_exchange`]); `Allgather` when no layer is reduced.
    pub(super) exchange: SparseExchange,
    /// The dense allreduce this step: the forced algorithm, or the
    /// decision table's for the dense group's size
    /// ([`crate::cost::Tuning::dense_allreduce`]).
    pub(super) allreduce: crate::dense::AllreduceAlgo,
    /// The allreduce of PowerSGD's factors this step: the dense one's,
    /// unless that cannot give every rank the same bits
    /// ([`crate::cost::Tuning::factor_allreduce`]).
    pub(super) factor_allreduce: crate::dense::AllreduceAlgo,
    /// The allgatherv of the fused message this step: the configured
    /// algorithm, or the decision table's for the message's nominal size
    /// ([`crate::cost::Tuning::allgatherv`]).
    pub(super) allgather: crate::dense::AllgathervAlgo,
    /// The allgatherv inside the sparse allreduces: the forced one, else
    /// the flat one ([`crate::cost::Tuning::reduce_allgatherv`]).
    pub(super) reduce_allgather: crate::dense::AllgathervAlgo,
    /// Compress / step the non-dense layers in parallel (rayon).
    pub(super) parallel_local: bool,
    /// Unpack the layers in parallel (rayon).
    pub(super) parallel_unpack: bool,
}

impl StepScript {
    /// Every group emptied (buffers kept).
    fn clear_groups(&mut self) {
        for g in [
            &mut self.dense,
            &mut self.sparse,
            &mut self.reduced,
            &mut self.gradiveq,
            &mut self.powersgd,
            &mut self.local,
        ] {
            g.clear();
        }
    }
}

/// The plan of step `step` for `ranks` ranks under `cfg` with the layer
/// table `table`. Pure: the same inputs give the same plan on every rank.
// The engine replans into its own buffers (`script_step_into`).
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn script_step(step: u64, cfg: &Config, ranks: usize, table: &[TableRow]) -> StepScript {
    let mut plan = StepScript::default();
    let tuning = crate::cost::Tuning::new(cfg.profile.as_ref(), ranks, None, true, cfg.masks())
        .expect("a table assuming a node map refuses nothing")
        .with_policy(cfg.policy());
    script_step_into(&mut plan, step, cfg, ranks, table, &tuning);
    plan
}

/// [`script_step`] into an existing plan, reusing its buffers (no allocation
/// once they have grown to the table).
pub(super) fn script_step_into(
    plan: &mut StepScript,
    step: u64,
    cfg: &Config,
    ranks: usize,
    table: &[TableRow],
    tuning: &Tuning,
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
    let reduce_pairs = !cfg.sparse_exchange.is(SparseExchange::Allgather);
    plan.clear_groups();
    for (i, l) in table.iter().enumerate() {
        let mode = if !communicates {
            Mode::Local
        } else if dense_warmup {
            Mode::Dense
        } else {
            match l.kind {
                RowKind::Dense => Mode::Dense,
                RowKind::Sparse { .. } => Mode::Sparse,
                RowKind::Gradiveq => Mode::Gradiveq,
                RowKind::Powersgd { start } if step >= start => Mode::Powersgd,
                RowKind::Powersgd { .. } => Mode::Dense,
            }
        };
        let mut lp = LayerStep {
            mode,
            ..LayerStep::default()
        };
        match mode {
            Mode::Dense => {
                lp.dense_off = plan.dense.elems;
                plan.dense.push(i, l.n);
            }
            Mode::Sparse => {
                let (own, pairs) = match l.kind {
                    RowKind::Sparse { density, pairs } => (density, pairs),
                    _ => (None, false),
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
            Mode::Powersgd => plan.powersgd.push(i, l.n),
            Mode::Local => plan.local.push(i, l.n),
            Mode::Other => unreachable!("the whole step's plan has every layer"),
        }
        plan.layers.push(lp);
    }
    plan.gather = !plan.sparse.ids.is_empty() && ranks > 1;
    plan.rings = !plan.gradiveq.ids.is_empty();
    plan.lowrank = !plan.powersgd.ids.is_empty();
    plan.sparse_reduce = !plan.reduced.ids.is_empty();
    // The forced exchange; under `auto` the engine looks this step's up
    // in its decision table (`crate::cost::Tuning`, exchange.rs), as it
    // looks up the dense allreduce and the allgathervs of every step.
    plan.exchange = match cfg.sparse_exchange {
        Pick::Fixed(x) if plan.sparse_reduce => x,
        _ => SparseExchange::Allgather,
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
    plan_parallel(plan, tuning);
}

/// Whether the step runs the dense allreduce: for the dense buffer, or
/// as the status exchange (module docs).
fn set_reduce(plan: &mut StepScript, ranks: usize) {
    plan.reduce = plan.dense.elems > 0
        || ((plan.rings || plan.lowrank) && !plan.gather)
        || plan.sparse_reduce
        || (ranks > 1 && !plan.gather);
}

/// The exchange of the `reduced` group this step (`sparse_exchange =
/// "auto"`: the engine's per-step choice, the same on every rank).
/// `Allgather` moves the group's layers back into the fused allgatherv
/// message, giving the plan of `sparse_exchange = "allgather"`; the
/// sparse allreduces keep the group. Nothing to do without reduced
/// layers.
pub(super) fn set_exchange(plan: &mut StepScript, exchange: SparseExchange, ranks: usize) {
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

/// The plan of one bucket of a step: `whole` (the step's plan, every
/// per-step decision already taken: modes, densities, the exchange and
/// the algorithms) restricted to the layers `members` (ascending), every
/// other layer [`Mode::Other`]. The groups keep registration order and
/// their offsets start at 0 in the bucket's own buffers; which
/// collectives run is decided for the bucket as [`script_step`] decides it
/// for a whole step, so a bucket always carries the step's status (a
/// bucket of one rank with nothing to exchange runs none). Pure, like
/// [`script_step`]: alike on every rank that cuts the step alike.
pub(super) fn restrict_into(
    part: &mut StepScript,
    whole: &StepScript,
    members: &[u32],
    table: &[TableRow],
    tuning: &Tuning,
    ranks: usize,
) {
    debug_assert!(members.windows(2).all(|w| w[0] < w[1]));
    part.step = whole.step;
    part.communicates = whole.communicates;
    part.dense_warmup = whole.dense_warmup;
    part.stage_density = whole.stage_density;
    part.delayed = whole.delayed;
    part.allreduce = whole.allreduce;
    part.factor_allreduce = whole.factor_allreduce;
    part.allgather = whole.allgather;
    part.reduce_allgather = whole.reduce_allgather;
    part.layers.clear();
    part.layers.resize(
        whole.layers.len(),
        LayerStep {
            mode: Mode::Other,
            ..LayerStep::default()
        },
    );
    part.clear_groups();
    for &id in members {
        let i = id as usize;
        let n = table[i].n;
        let mut lp = whole.layers[i];
        match lp.mode {
            Mode::Dense => {
                lp.dense_off = part.dense.elems;
                part.dense.push(i, n);
            }
            Mode::Sparse if lp.reduced => {
                lp.reduce_off = part.reduced.elems;
                part.reduced.push(i, n);
            }
            Mode::Sparse => part.sparse.push(i, n),
            Mode::Gradiveq => part.gradiveq.push(i, n),
            Mode::Powersgd => part.powersgd.push(i, n),
            Mode::Local => part.local.push(i, n),
            Mode::Other => {}
        }
        part.layers[i] = lp;
    }
    part.gather = !part.sparse.ids.is_empty() && ranks > 1;
    part.rings = !part.gradiveq.ids.is_empty();
    part.lowrank = !part.powersgd.ids.is_empty();
    part.sparse_reduce = !part.reduced.ids.is_empty();
    part.exchange = if part.sparse_reduce {
        whole.exchange
    } else {
        SparseExchange::Allgather
    };
    set_reduce(part, ranks);
    let non_dense = members.len() - part.dense.ids.len();
    parallel_flags(part, tuning, non_dense);
}

/// Whether the local math and the unpacking run in parallel.
fn plan_parallel(plan: &mut StepScript, tuning: &Tuning) {
    let non_dense = plan.layers.len() - plan.dense.ids.len();
    parallel_flags(plan, tuning, non_dense);
}

/// [`plan_parallel`] for a plan whose layers outside its groups are
/// `non_dense` (every layer of a whole step's): the decision table's
/// answer ([`Tuning::parallel`]).
fn parallel_flags(plan: &mut StepScript, tuning: &Tuning, non_dense: usize) {
    let sparse_elems = plan.sparse.elems + plan.reduced.elems;
    let sparse_layers = plan.sparse.ids.len() + plan.reduced.ids.len();
    plan.parallel_local = tuning.parallel(non_dense, sparse_elems);
    plan.parallel_unpack = tuning.parallel(sparse_layers, sparse_elems);
}

#[cfg(test)]
mod tests;
