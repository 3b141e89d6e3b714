//! The one query of the step model: a step's placement (ranks, ranks per
//! node), its density and the candidates the layers are chosen among.
//! Below every pricing module ([`super::topology`], [`super::step`],
//! [`super::exchange`], [`super::bucket`]), which all read it.

use super::StrategyId;

/// The step's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct StepQuery {
    /// Ranks.
    pub p: usize,
    /// Density of the sparse strategies the planner chooses.
    pub density: f64,
    /// The profile's selection fit `sparse-allgather` uses (`trimmed`, ...).
    pub select_method: String,
    /// GradiVeQ compression ratio.
    pub gradiveq_ratio: f64,
    /// Strategies free layers are chosen among (empty:
    /// [`super::default_candidates`](crate::cost::default_candidates)).
    pub allowed: Vec<StrategyId>,
    /// Ranks per node (block placement); `None`: one node, the one-level
    /// model ([`super::topology`]).
    pub ranks_per_node: Option<usize>,
    /// Measured fill ratio `ρ = F/(p·k)` of the sparse allreduce's result
    /// (from earlier steps); `None`: independent selections
    /// ([`super::topology`]).
    pub fill: Option<f64>,
    /// The allgatherv of the fused sparse message (`sync::Config::allgather`):
    /// `Auto` prices the cheaper of the flat and the node-aware one, as the
    /// engine's `auto` runs it; `Node` the node-aware one; any other the
    /// flat one (`mpi` priced as that).
    pub allgather: crate::strategy::Pick<crate::dense::AllgathervAlgo>,
    /// Free layers with fewer elements stay dense (in the dense group,
    /// whatever sparse or low-rank strategy would price lower): RedSync's
    /// `compress_thd` and DGC's uncompressed small layers, a rule for
    /// convergence, not for time. Top-k of a bias or a small convolution
    /// sends one or a few elements a step and holds back the rest in the
    /// residual, which slows training by far more than the α it saves
    /// (measured in docs/benchmarks/pytorch.md). 0: every layer
    /// chosen by price alone.
    pub min_sparse_elems: usize,
}
