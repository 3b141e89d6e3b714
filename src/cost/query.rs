//! The queries of the cost model and the one placement they share: where
//! the step's collectives run ([`Placement`]: ranks, ranks per node, the
//! measured fill ratio, the fused message's allgatherv), asked about one
//! layer ([`super::Query`]), a whole step ([`StepQuery`]) or the reduced
//! pairs' exchange ([`super::ExchangeQuery`]). Below every pricing module
//! ([`super::topology`], [`super::step`], [`super::exchange`],
//! [`super::bucket`]), which all read it.

use super::StrategyId;
use crate::dense::AllgathervAlgo;
use crate::strategy::Pick;

/// GradiVeQ's compression ratio the step model prices `gradiveq-ring` at
/// (its paper's setting; the engine's GradiVeQ layers are fixed by the
/// caller, never chosen by `auto`).
pub const GRADIVEQ_RATIO: f64 = 8.0;

/// Where a step's collectives run, and what the engine learned about it:
/// the one part every query of the cost model shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placement {
    /// Ranks.
    pub p: usize,
    /// Ranks per node (block placement) when the job spans several nodes;
    /// `None`: one node, or the nodes unknown (the one-level model,
    /// [`super::topology`]).
    pub ranks_per_node: Option<usize>,
    /// Measured fill ratio `ρ = F/(p·k)` of the sparse allreduce's result
    /// (from earlier steps); `None`: independent selections
    /// ([`super::topology`]).
    pub fill: Option<f64>,
    /// The allgatherv of the fused sparse message (`sync::Config::allgather`):
    /// `Auto` prices the cheaper of the flat and the node-aware one, as the
    /// engine's `auto` runs it; `Node` the node-aware one; any other the
    /// flat one (`mpi` priced as that).
    pub allgather: Pick<AllgathervAlgo>,
}

impl Placement {
    /// `p` ranks, `ranks_per_node` of them on each node when the job
    /// spans several (`None`: one node, or the nodes unknown),
    /// independent selections, `auto`'s allgatherv.
    pub fn on(p: usize, ranks_per_node: Option<usize>) -> Placement {
        Placement {
            ranks_per_node,
            ..Placement::ranks(p)
        }
    }

    /// `p` ranks on one node, independent selections, `auto`'s allgatherv.
    pub fn ranks(p: usize) -> Placement {
        Placement {
            p,
            ranks_per_node: None,
            fill: None,
            allgather: Pick::Auto,
        }
    }
}

impl Default for Placement {
    /// One rank ([`Placement::ranks`]).
    fn default() -> Self {
        Placement::ranks(1)
    }
}

/// The step's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct StepQuery {
    /// Where the step runs.
    pub at: Placement,
    /// Density of the sparse strategies the planner chooses.
    pub density: f64,
    /// The profile's selection fit `sparse-allgather` uses (`trimmed`, ...).
    pub select_method: String,
    /// GradiVeQ compression ratio.
    pub gradiveq_ratio: f64,
    /// Strategies free layers are chosen among (empty:
    /// [`super::default_candidates`](crate::cost::default_candidates)).
    pub allowed: Vec<StrategyId>,
    /// Free layers with fewer elements are not sparsified (they stay in
    /// the dense group, whatever sparse or quantized strategy would price
    /// lower): RedSync's `compress_thd` and DGC's uncompressed small
    /// layers, a rule for convergence, not for time. Top-k of a bias or a
    /// small convolution sends one or a few elements a step and holds back
    /// the rest in the residual, which slows training by far more than the
    /// α it saves (measured in docs/benchmarks/pytorch.md). PowerSGD is
    /// exempt, as in its paper and PyTorch's hook, which compress every
    /// matrix the factors shrink by `min_compression_rate`: a small matrix
    /// keeps its best rank-`r` part every step, not a few elements. 0:
    /// every layer chosen by price alone.
    pub min_sparse_elems: usize,
    /// The rank `powersgd` is priced at for free layers (fixed ones carry
    /// their own).
    pub powersgd_rank: usize,
}
