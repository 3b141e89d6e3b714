//! The step model: a whole synchronization step predicted as the engine
//! ([`crate::sync`]) executes it, and the per-layer choice that minimizes
//! it (RedSync §5.3's fusion, §5.4's cost model and Appendix B).
//!
//! The engine does not synchronize layers one by one. Each step it runs
//!
//! 1. the local phase: every sparse layer's selection and encoding;
//! 2. ONE fused allgatherv of every rank's sparse units (the *sparse
//!    group*: a 16-byte header, then per layer a 16-byte table-of-contents
//!    entry and the codec's message, [`crate::sparse`]);
//! 3. ONE allreduce (Rabenseifner or ring, the engine's configured
//!    algorithm) of every dense layer fused into one buffer (the *dense
//!    group*);
//! 4. each GradiVeQ layer's own compressed-domain ring (no fusion);
//! 5. decoding: the `p` received units of every sparse layer.
//!
//! The sparse layers' local work (steps 1 and 5) runs on the engine's
//! threads, several layers at once, where the profile's `local_parallelism`
//! (the speedup `calibrate` measured) is at least
//! [`super::PARALLEL_MIN_SPEEDUP`]; it then divides that
//! work when the sparse group has two layers or more. The dense layers' fusing and momentum
//! (`dense_local`) run on one thread; their cost per element depends on
//! the whole table's size (the step's working set: a table larger than
//! the last-level cache streams from memory), [`Profile::dense_local_at`];
//! so does a sparse layer's, whose data in such a step are out of the
//! caches too ([`Profile::select_in_table`]).
//!
//! All of it runs one after the other (the progress thread overlaps the
//! whole step with the caller's computation, not its parts with each
//! other), so the step time is the sum
//!
//! `T = Σ_layers local + T_allgather(M) + T_allreduce(B) + Σ_gradiveq T_ring`,
//!
//! `M` the sparse group's message bytes per rank and `B` the dense group's
//! bytes. A group's α terms are paid once, by the group, whatever number
//! of layers it carries; a layer's *marginal* cost is what it adds to the
//! step: its local costs plus `T_G(X + b) − T_G(X)` for the group `G` it
//! joins (`X` the rest of the group, `b` its bytes).
//!
//! [`plan_step`] chooses every free layer's strategy to minimize `T`: for
//! each set of open groups (no dense group or one per allowed dense
//! algorithm, × sparse group or not) it assigns every layer the option of
//! least marginal cost among the open groups, in three Gauss–Seidel passes
//! (with β curves the marginal depends on the group's size), and keeps the
//! set with the least total. A lone 64-element vector thus never opens a
//! group of its own, and the α of a group is charged to the step once.
//!
//! This is the one place where the engine's `Strategy::Auto`, `gradsync
//! plan` and `gradsync bench --op step` get their per-layer choice; the
//! per-layer [`super::predict`] (one layer alone, paying every α) remains
//! what `predict` prints.
//!
//! The engine's per-step choice of each group's collective
//! (`sparse_exchange = "auto"`, `allreduce = "auto"`) is priced by the
//! same group costs, in [`super::exchange`].
//!
//! This file holds a layer's options (what each strategy costs it
//! locally and adds to its group), the marginal cost and [`plan_step`] /
//! [`predict_step`]; [`groups`] prices each group's collective, `search`
//! tries the configurations, `describe` spells out the chosen plan.

mod describe;
mod groups;
mod search;

use describe::describe;
use groups::{dense_alpha, dense_wire, lowrank_group, sparse_alpha, sparse_wire};
pub(super) use groups::{dense_group, sparse_group};
pub use groups::{sparse_collective, sparse_collective_by};
use search::{
    auto_options, configurations, descend, group_costs, near_tie_pick, Rows, PARALLEL_LAYERS,
};

use super::query::StepQuery;
use super::topology::Net;
use super::{
    codec_wire_bytes, gradiveq_ring, nominal_bytes_per_element, Prediction, Profile, StrategyId,
};
use crate::sparse::TOC_ENTRY_LEN;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// How a layer of the table enters the planner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LayerKind {
    /// The planner chooses (the engine's `Strategy::Auto`, every layer of
    /// `gradsync plan`).
    Auto,
    /// The caller chose this strategy, sparse ones at this density
    /// (`powersgd`: at this rank).
    Fixed(StrategyId, f64),
}

/// One layer of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLayer {
    /// Name (for the output).
    pub name: String,
    /// f32 elements.
    pub n: usize,
    /// Chosen by the planner or fixed.
    pub kind: LayerKind,
    /// The matrix PowerSGD sees (rows, columns:
    /// [`crate::powersgd::matrix_view`] of the layer's shape); `None`: no
    /// shape known, or fewer than two dimensions (then `powersgd` is not
    /// an option, and a layer fixed to it is priced dense, as the engine
    /// runs it).
    pub matrix: Option<(usize, usize)>,
}

/// The three kinds of group of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupKind {
    /// The fused dense allreduce.
    Dense,
    /// The fused sparse allgatherv.
    Sparse,
    /// One GradiVeQ layer's own ring.
    Gradiveq,
    /// The PowerSGD layers' two fused factor allreduces.
    Lowrank,
}

/// One layer's planned strategy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerPlan {
    /// Name.
    pub name: String,
    /// f32 elements.
    pub elements: usize,
    /// The strategy.
    pub choice: StrategyId,
    /// The group it is synchronized in.
    pub group: GroupKind,
    /// Whether the planner chose it (`false`: fixed by the caller).
    pub auto: bool,
    /// Bytes it adds to its group's message per rank (dense: `4n`; sparse:
    /// the codec's message and its table-of-contents entry).
    pub message_bytes: f64,
    /// Its local seconds (selection/encoding, decoding the `p` units).
    pub local_s: f64,
    /// What it adds to the step: local seconds plus its share of its
    /// group's communication (`T_G(X + b) − T_G(X)`).
    pub marginal_s: f64,
    /// The same strategy predicted for the layer alone ([`super::predict`],
    /// every α paid by the layer).
    pub alone_s: f64,
}

/// One group of the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupPlan {
    /// Kind.
    pub kind: GroupKind,
    /// The collective: `dense-rabenseifner`/`dense-ring` for the dense
    /// group, `sparse-allgather` for the fused allgatherv,
    /// `gradiveq-ring` for a GradiVeQ layer.
    pub algorithm: StrategyId,
    /// Layers in it.
    pub layers: usize,
    /// Their f32 elements.
    pub elements: usize,
    /// Bytes of the group's message per rank (the fused buffer or message).
    pub message_bytes: f64,
    /// Bytes each rank sends for it.
    pub wire_bytes: f64,
    /// Predicted seconds of its collective (α, β and γ_reduce/γ_unpack
    /// terms; local costs are the layers').
    pub comm_s: f64,
    /// Σ of its layers' local seconds.
    pub local_s: f64,
}

/// A predicted step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    /// Ranks.
    pub ranks: usize,
    /// Density of the sparse strategies.
    pub density: f64,
    /// Per layer, in table order.
    pub layers: Vec<LayerPlan>,
    /// The step's groups (dense, sparse, then GradiVeQ layers).
    pub groups: Vec<GroupPlan>,
    /// Predicted seconds of the whole step.
    pub seconds: f64,
    /// Bytes each rank sends in the step.
    pub wire_bytes: f64,
}

impl StepPlan {
    /// The layers' choices (`name → strategy`), in table order.
    pub fn choices(&self) -> impl Iterator<Item = (&str, StrategyId)> {
        self.layers.iter().map(|l| (l.name.as_str(), l.choice))
    }
}

/// What one option of a layer costs.
#[derive(Clone, Copy, Debug)]
struct Option_ {
    id: StrategyId,
    group: GroupKind,
    /// Bytes it adds to its group's message (sparse allreduces: its `8k`
    /// bytes of pairs; PowerSGD: its `P`).
    bytes: f64,
    /// PowerSGD: the bytes of its `Q` (the group's second allreduce).
    bytes_q: f64,
    /// Elements (the sparse allreduces' index space).
    n: f64,
    local: f64,
}

/// The option `id` for a layer of `n` elements at `density`, in a step
/// whose whole table has `table` elements (the dense and sparse paths'
/// per-element costs depend on it: [`Profile::dense_local_at`],
/// [`Profile::select_in_table`]).
fn option(
    prof: &Profile,
    q: &StepQuery,
    (n, table, matrix): (usize, f64, Option<(usize, usize)>),
    id: StrategyId,
    density: f64,
) -> Option_ {
    let (p, nf) = (q.at.p as f64, n as f64);
    let toc = TOC_ENTRY_LEN as f64;
    let unpack = |m: f64| p * m * prof.gamma_unpack_at(4.0 * nf);
    let o = |group, bytes, local| Option_ {
        id,
        group,
        bytes,
        bytes_q: 0.0,
        n: nf,
        local,
    };
    match id {
        // `matrix`: the layer's as the engine compresses it (a fixed
        // layer's), or one PowerSGD would shrink (`auto_matrix`).
        StrategyId::Powersgd => match matrix.map(|(rows, cols)| {
            let r = (density.max(1.0) as usize).min(rows).min(cols);
            (rows, cols, r)
        }) {
            // Its products, and the dense path's copy in and momentum out
            // (the engine runs both for a PowerSGD layer).
            Some((rows, cols, r)) => Option_ {
                bytes_q: 4.0 * (cols * r) as f64,
                ..o(
                    GroupKind::Lowrank,
                    4.0 * (rows * r) as f64,
                    prof.powersgd.at_in_table(nf, r as f64, table) + prof.dense_local_at(nf, table),
                )
            },
            // Not compressed (a vector, or too small): dense, as the
            // engine runs it.
            None => Option_ {
                id: StrategyId::DenseRabenseifner,
                ..o(GroupKind::Dense, 4.0 * nf, prof.dense_local_at(nf, table))
            },
        },
        StrategyId::DenseRabenseifner | StrategyId::DenseRing | StrategyId::DenseHierarchical => {
            o(GroupKind::Dense, 4.0 * nf, prof.dense_local_at(nf, table))
        }
        StrategyId::SparseAllreduce | StrategyId::SparseHierarchical => {
            let k = super::sparse_k(n, density);
            o(
                GroupKind::Sparse,
                8.0 * k,
                prof.select_in_table(&q.select_method, density, nf, table),
            )
        }
        StrategyId::SparseAllgather | StrategyId::SparseAllgatherQuant => {
            let (codec, select) = if id == StrategyId::SparseAllgather {
                (
                    "rgc",
                    prof.select_in_table(&q.select_method, density, nf, table),
                )
            } else {
                (
                    "rgc-quant",
                    prof.select_in_table("quant", density, nf, table),
                )
            };
            let m = codec_wire_bytes(codec, n, density).unwrap_or(0.0);
            o(GroupKind::Sparse, m + toc, select + unpack(m))
        }
        StrategyId::GradiveqRing => o(
            GroupKind::Gradiveq,
            4.0 * nf / q.gradiveq_ratio,
            gradiveq_ring(prof, n, q.at.p, q.gradiveq_ratio),
        ),
        codec => {
            let fit = prof.codecs.get(codec.name()).copied().unwrap_or_default();
            let w = match fit.bytes_per_element {
                Some(b) => 12.0 + b * nf,
                None => codec_wire_bytes(codec.name(), n, density)
                    .unwrap_or_else(|| 12.0 + nominal_bytes_per_element(codec.name()) * nf),
            };
            o(
                GroupKind::Sparse,
                w + toc,
                fit.encode.at(nf) + p * fit.decode.at(nf),
            )
        }
    }
}

/// PowerSGD's rows, columns and rank for a layer of matrix view `matrix`
/// at rank `rank`, or `None` where it leaves the layer dense (no matrix,
/// or factors not twice smaller: PyTorch's `min_compression_rate`).
pub(super) fn powersgd_factors(
    matrix: Option<(usize, usize)>,
    rank: f64,
) -> Option<(usize, usize, usize)> {
    let (rows, cols) = matrix?;
    let r = (rank.max(1.0) as usize).min(rows).min(cols);
    crate::powersgd::worth_compressing(rows, cols, r, 2.0).then_some((rows, cols, r))
}

/// The matrix of a layer the planner may give PowerSGD at `rank`: its
/// own where PowerSGD would shrink it (at PyTorch's default
/// `min_compression_rate`, the engine's `auto` layers'), else `None`.
fn auto_matrix(l: &StepLayer, rank: f64) -> Option<(usize, usize)> {
    powersgd_factors(l.matrix, rank).map(|(rows, cols, _)| (rows, cols))
}

/// One strategy for one layer synchronized alone (its group's α paid by
/// it): what [`super::predict`] prints for every strategy.
pub(super) fn alone(
    prof: &Profile,
    q: &StepQuery,
    (n, matrix): (usize, Option<(usize, usize)>),
    id: StrategyId,
    density: f64,
) -> Prediction {
    let net = Net::of(prof, q);
    let o = option(prof, q, (n, n as f64, matrix), id, density);
    let mut s = Sizes::default();
    s.add(&o, 1.0);
    let (seconds, wire_bytes) = match o.group {
        GroupKind::Dense => (
            o.local + dense_group(&net, id, s.dense),
            dense_wire(&net, id, s.dense),
        ),
        GroupKind::Sparse => {
            let algo = id.sparse_group().unwrap_or(StrategyId::SparseAllgather);
            (
                o.local + sparse_group(&net, algo, s),
                sparse_wire(&net, algo, s),
            )
        }
        GroupKind::Gradiveq => (o.local, dense_wire(&net, StrategyId::DenseRing, o.bytes)),
        GroupKind::Lowrank => {
            let algo = StrategyId::DenseRabenseifner;
            (
                o.local + lowrank_group(&net, algo, s),
                dense_wire(&net, algo, o.bytes) + dense_wire(&net, algo, o.bytes_q),
            )
        }
    };
    Prediction {
        id,
        name: id.name().to_string(),
        seconds,
        wire_bytes,
    }
}

/// The groups that may be open in one configuration: the dense group's
/// algorithm and the sparse group's collective.
#[derive(Clone, Copy, Debug)]
struct Open {
    dense: Option<StrategyId>,
    sparse: Option<StrategyId>,
    /// The PowerSGD group (its allreduces run the dense group's
    /// algorithm, Rabenseifner when there is none).
    lowrank: bool,
}

impl Open {
    /// The algorithm of the dense group and of PowerSGD's allreduces.
    fn dense_algo(&self) -> StrategyId {
        self.dense.unwrap_or(StrategyId::DenseRabenseifner)
    }
}

/// Group sizes of an assignment: dense bytes, sparse bytes (without the
/// fused header) and the sparse layers' elements.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sizes {
    pub(super) dense: f64,
    pub(super) sparse: f64,
    pub(super) sparse_n: f64,
    /// The PowerSGD group's fused `P` and `Q` (bytes).
    pub(super) lowrank_p: f64,
    pub(super) lowrank_q: f64,
}

impl Sizes {
    fn add(&mut self, o: &Option_, sign: f64) {
        match o.group {
            GroupKind::Dense => self.dense += sign * o.bytes,
            GroupKind::Sparse => {
                self.sparse += sign * o.bytes;
                self.sparse_n += sign * o.n;
            }
            GroupKind::Lowrank => {
                self.lowrank_p += sign * o.bytes;
                self.lowrank_q += sign * o.bytes_q;
            }
            GroupKind::Gradiveq => {}
        }
    }
}

/// What adding `o` to groups of `sizes` costs the step.
fn marginal(net: &Net, open: Open, s: Sizes, o: &Option_) -> f64 {
    marginal_from(net, open, s, Before::of(net, open, s), o)
}

/// What the groups of some `sizes` cost before a layer joins one: the
/// part of [`marginal`] that all of a layer's options share (priced once
/// per layer, not once per option).
#[derive(Clone, Copy)]
struct Before {
    dense: f64,
    sparse: f64,
    lowrank: f64,
}

impl Before {
    fn of(net: &Net, open: Open, s: Sizes) -> Self {
        let d = open.dense.unwrap_or(StrategyId::DenseRabenseifner);
        let sp = open.sparse.unwrap_or(StrategyId::SparseAllgather);
        Before {
            dense: if s.dense > 0.0 {
                dense_group(net, d, s.dense)
            } else {
                dense_alpha(net, d)
            },
            sparse: if s.sparse > 0.0 {
                sparse_group(net, sp, s)
            } else {
                sparse_alpha(net, sp)
            },
            // An open group's α is the step's, as the others' are.
            lowrank: if s.lowrank_p > 0.0 {
                lowrank_group(net, d, s)
            } else {
                2.0 * dense_alpha(net, d)
            },
        }
    }
}

/// [`marginal`] with the groups' cost before `o` joins given.
fn marginal_from(net: &Net, open: Open, s: Sizes, before: Before, o: &Option_) -> f64 {
    let comm = match o.group {
        GroupKind::Dense => {
            let algo = open.dense.unwrap_or(StrategyId::DenseRabenseifner);
            dense_group(net, algo, s.dense + o.bytes) - before.dense
        }
        GroupKind::Sparse => {
            let algo = open.sparse.unwrap_or(StrategyId::SparseAllgather);
            let before = before.sparse;
            let mut after = s;
            after.add(o, 1.0);
            // Never negative: `auto`'s allgatherv switches to the node-aware
            // one within the near-tie, so a larger message can price up to
            // 2 % below a smaller one there.
            (sparse_group(net, algo, after) - before).max(0.0)
        }
        GroupKind::Lowrank => {
            let mut after = s;
            after.add(o, 1.0);
            (lowrank_group(net, open.dense_algo(), after) - before.lowrank).max(0.0)
        }
        GroupKind::Gradiveq => 0.0,
    };
    comm + effective_local(net.prof, o, 2)
}

/// A layer's local seconds as the step spends them: a sparse layer's work
/// runs on the engine's threads beside the others' when the sparse group
/// has two layers or more ([`Profile::local_parallelism`]).
fn effective_local(prof: &Profile, o: &Option_, sparse_layers: usize) -> f64 {
    // The engine runs the phase in parallel only where the profile says it
    // pays (`sync::plan`), so a measured slowdown never applies.
    if o.group == GroupKind::Sparse && sparse_layers >= 2 {
        o.local / prof.parallel_speedup().unwrap_or(1.0)
    } else {
        o.local
    }
}

/// Ranks, density, GradiVeQ ratio, ranks per node and fill ratio in range
/// (errors name the value).
/// A selection method's name as `rgc`'s `method=` takes it (`exact`,
/// `trimmed`, `threshold`, `sampled`): the key of the profile's fit. An
/// unknown name would silently price the selection as free.
pub(super) fn check_select_method(m: &str) -> Result<()> {
    serde_json::from_value::<crate::codec::RgcMethod>(serde_json::Value::String(m.into()))
        .map(|_| ())
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "selection method {m:?} is not one of exact, trimmed, threshold, sampled"
            ))
        })
}

/// A rank count the model prices: 1 to [`MAX_RANKS`].
pub(super) fn check_ranks(p: usize) -> Result<()> {
    if p == 0 {
        return Err(Error::InvalidArgument("ranks must be at least 1".into()));
    }
    if p > MAX_RANKS {
        return Err(Error::InvalidArgument(format!(
            "ranks {p} is past the model's limit of {MAX_RANKS} (2^24)"
        )));
    }
    Ok(())
}

pub(super) fn check(q: &StepQuery) -> Result<()> {
    check_ranks(q.at.p)?;
    if !(q.density > 0.0 && q.density <= 1.0) {
        return Err(Error::InvalidArgument(format!(
            "density {} must lie in (0, 1]",
            q.density
        )));
    }
    if !(q.gradiveq_ratio >= 1.0 && q.gradiveq_ratio.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "GradiVeQ ratio {} must be at least 1",
            q.gradiveq_ratio
        )));
    }
    if q.at.ranks_per_node == Some(0) {
        return Err(Error::InvalidArgument(
            "ranks per node must be at least 1".into(),
        ));
    }
    // Empty: the engine's own queries, which price no selection.
    if !q.select_method.is_empty() {
        check_select_method(&q.select_method)?;
    }
    if let Some(f) = q.at.fill {
        if !(f > 0.0 && f <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "fill ratio {f} must lie in (0, 1] (distinct indices of the sum over p·k)"
            )));
        }
    }
    Ok(())
}

/// The strategies free layers choose among.
fn candidates(prof: &Profile, q: &StepQuery) -> Vec<StrategyId> {
    if q.allowed.is_empty() {
        super::default_candidates(prof)
    } else {
        let mut v = q.allowed.clone();
        v.dedup();
        v
    }
}

/// Whether option `o` may join the groups `open`.
fn fits(open: Open, o: &Option_) -> bool {
    match o.group {
        GroupKind::Dense => open.dense == Some(o.id),
        GroupKind::Sparse => open.sparse == o.id.sparse_group(),
        GroupKind::Lowrank => open.lowrank,
        GroupKind::Gradiveq => true,
    }
}

/// Choose every [`LayerKind::Auto`] layer's strategy so that the predicted
/// step is the fastest (module docs), and predict that step. The fastest
/// plan splits the layers into groups; each group's collective is then
/// chosen as the engine chooses it every step: the simplest (dense
/// algorithms in [`choose_dense_allreduce`](super::choose_dense_allreduce)'s
/// order, the fused allgatherv before the sparse allreduces) whose step
/// comes within [`NEAR_TIE`](super::NEAR_TIE) of that group's cost.
pub fn plan_step(prof: &Profile, q: &StepQuery, layers: &[StepLayer]) -> Result<StepPlan> {
    check(q)?;
    let cands = candidates(prof, q);
    if cands.is_empty() {
        return Err(Error::InvalidArgument("no strategy to choose from".into()));
    }
    let net = Net::of(prof, q);
    let table = table_elements(layers);
    let fixed: Vec<Option<Option_>> = layers
        .iter()
        .map(|l| match l.kind {
            LayerKind::Auto => None,
            LayerKind::Fixed(id, d) => Some(option(prof, q, (l.n, table, l.matrix), id, d)),
        })
        .collect();
    let configs = configurations(&cands, &fixed);
    let (all, start) = auto_options(prof, q, layers, table, &cands);
    let rows = Rows {
        all: &all,
        start: &start,
    };
    // Every configuration's plan, in `configs`' order (simplest first);
    // a large table's configurations in parallel (each is independent,
    // and the order of `plans` is the configurations' whatever the
    // threads do).
    // (Each its own `Net`: it tracks a collective's burst credit.)
    let run = |open: &Open| descend(&Net::of(prof, q), *open, layers, &fixed, rows);
    let plans: Vec<(Open, f64, Vec<u8>)> = if layers.len() >= PARALLEL_LAYERS {
        use rayon::prelude::*;
        configs.par_iter().filter_map(run).collect()
    } else {
        configs.iter().filter_map(run).collect()
    };
    let expand = |picks: &[u8]| rows.expand(&fixed, picks);
    let pick = near_tie_pick(&net, &plans, &expand)
        .ok_or_else(|| Error::InvalidArgument("no strategy to choose from".into()))?;
    let assign = expand(&plans[pick].2);
    finite(describe(prof, q, layers, &assign))
}

/// Predict the step of a table whose every layer's strategy is given
/// (`choice[i]` at `q.density`, or the fixed one), without choosing.
pub fn predict_step(
    prof: &Profile,
    q: &StepQuery,
    layers: &[StepLayer],
    choice: &[StrategyId],
) -> Result<StepPlan> {
    check(q)?;
    if choice.len() != layers.len() {
        return Err(Error::InvalidArgument(format!(
            "{} choices for {} layers",
            choice.len(),
            layers.len()
        )));
    }
    let table = table_elements(layers);
    let assign: Vec<Option_> = layers
        .iter()
        .zip(choice)
        .map(|(l, c)| match l.kind {
            LayerKind::Fixed(id, d) => option(prof, q, (l.n, table, l.matrix), id, d),
            LayerKind::Auto if *c == StrategyId::Powersgd => {
                let rank = q.powersgd_rank as f64;
                option(prof, q, (l.n, table, auto_matrix(l, rank)), *c, rank)
            }
            LayerKind::Auto => option(prof, q, (l.n, table, l.matrix), *c, q.density),
        })
        .collect();
    let groups = assigned_groups(&assign);
    if let Some(o) = assign.iter().find(|o| !fits(groups, o)) {
        return Err(Error::InvalidArgument(format!(
            "{} cannot share a step with {}: the engine runs one dense and one sparse collective per step",
            o.id,
            if o.group == GroupKind::Dense {
                groups.dense
            } else {
                groups.sparse
            }
            .map_or("?", StrategyId::name)
        )));
    }
    finite(describe(prof, q, layers, &assign))
}

/// The most ranks the model prices (2^24, past any machine built). Its
/// schedules are evaluated in `O(lg p)` steps, the sparse allreduce's
/// pairwise exchange in `O(L)` runs of equal steps (`L` ranks a node).
pub const MAX_RANKS: usize = 1 << 24;

/// Elements of the whole table (every layer's gradient is read each step,
/// whatever its strategy, so this is the step's working set).
fn table_elements(layers: &[StepLayer]) -> f64 {
    layers.iter().map(|l| l.n as f64).sum()
}

/// The groups of an assignment (the first dense layer's algorithm, the
/// first sparse layer's collective).
fn assigned_groups(assign: &[Option_]) -> Open {
    Open {
        dense: assign
            .iter()
            .find(|o| o.group == GroupKind::Dense)
            .map(|o| o.id),
        sparse: assign.iter().find_map(|o| o.id.sparse_group()),
        lowrank: assign.iter().any(|o| o.group == GroupKind::Lowrank),
    }
}

/// The step's seconds: its two groups ([`group_costs`]), the PowerSGD
/// group and the GradiVeQ layers.
fn total_seconds(net: &Net, open: Open, assign: &[Option_]) -> f64 {
    let (dense, sparse) = group_costs(net, open, assign);
    // GradiVeQ layers: their own rings, charged in their local costs;
    // PowerSGD layers: their products, then the group's allreduces.
    let own: f64 = assign
        .iter()
        .filter(|o| matches!(o.group, GroupKind::Gradiveq | GroupKind::Lowrank))
        .map(|o| effective_local(net.prof, o, 0))
        .sum();
    let mut s = Sizes::default();
    for o in assign {
        s.add(o, 1.0);
    }
    let algo = open.dense.or(assigned_groups(assign).dense);
    let lowrank = lowrank_group(net, algo.unwrap_or(StrategyId::DenseRabenseifner), s);
    dense + sparse + own + lowrank
}

/// The plan, or an error where the profile's constants overflow its
/// times (e.g. a bandwidth of 1e-300 B/s: `inf`, written as `null` in
/// JSON beside a choice made among infinities).
fn finite(plan: StepPlan) -> Result<StepPlan> {
    let bad = plan
        .layers
        .iter()
        .find(|l| !(sane(l.marginal_s) && sane(l.alone_s)));
    match bad {
        None if sane(plan.seconds) => Ok(plan),
        None => Err(overflow("the step", plan.seconds)),
        Some(l) => Err(overflow(
            &format!("layer {:?} ({})", l.name, l.choice.name()),
            if sane(l.alone_s) {
                l.marginal_s
            } else {
                l.alone_s
            },
        )),
    }
}

/// A time the model can stand behind: finite and below 10^12 s (31,700
/// years; past it the constants, not the network, decide).
pub(super) fn sane(seconds: f64) -> bool {
    seconds.is_finite() && seconds.abs() < 1e12
}

/// The error of a prediction (of `what`: a layer, a strategy) that
/// overflowed.
pub(super) fn overflow(what: &str, seconds: f64) -> Error {
    Error::InvalidArgument(format!(
        "the predicted time of {what} is {seconds:.3e} s: the profile's constants (α, β, γ; \
         --alpha, --bandwidth) overflow at this size"
    ))
}
