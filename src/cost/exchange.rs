//! The engine's per-step choice of its two collectives, from the same
//! group costs as the step model ([`super::step`]): how the index/value
//! layers' pairs are exchanged under `sparse_exchange = "auto"` (the fused
//! allgatherv, Ok-Topk's sparse allreduce, or the node-aware one) and which
//! algorithm runs the fused dense allreduce under
//! `allreduce = "auto"` (Rabenseifner, the ring, or the hierarchical
//! allreduce), and which allgatherv carries the fused message under
//! `allgather = "auto"` (recursive doubling/Bruck's, or the node-aware
//! one). Every input is the same on every rank, so every rank runs the
//! same collective; near-ties ([`NEAR_TIE`]) go to the simpler one.

use super::argmin::cheapest;
use super::query::{Placement, StepQuery};
use super::step::{check, check_ranks, dense_group, sparse_group, Sizes, MAX_RANKS};
use super::topology::allgatherv_candidates;
use super::topology::Net;
use super::{Profile, StrategyId};
use crate::dense::AllgathervAlgo;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// The inputs of the engine's per-step choice of how the index/value
/// layers' pairs are exchanged (`sparse_exchange = "auto"`): every one of
/// them must be the same on every rank (the engine derives them from the
/// agreed options, the layer table, the step and results every rank
/// received alike), so that every rank runs the same collective.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeQuery {
    /// Elements of those layers' concatenated index space.
    pub n: usize,
    /// Nominal pairs per rank: the sum over those layers of RGC's
    /// `max(1, ⌈density·n⌉)` at this step's density (not a rank's own
    /// count, which its selection may trim).
    pub k: f64,
    /// Bytes those layers add to the fused allgatherv message per rank
    /// (their nominal units and table-of-contents entries).
    pub message_bytes: f64,
    /// Where the step runs (its `allgather` prices the fused allgatherv
    /// candidate; only with several nodes is the node-aware sparse
    /// allreduce a candidate).
    pub at: Placement,
    /// Each of those layers' elements and the bytes it adds to the
    /// message (summing to `n` and `message_bytes`). The fused allgatherv
    /// adds a layer's received pairs into that layer's own output, so its
    /// adds are priced at each layer's size, as [`plan_step`](super::plan_step) prices them
    /// ([`Profile::gamma_unpack_at`]); the sparse allreduces add into one
    /// output of all `n` elements. Empty: one layer of `n` elements.
    pub layers: Vec<(usize, f64)>,
}

/// A priced choice of the cost model: what the argmin picked and every
/// candidate's predicted seconds ([`choose_sparse_exchange`] and
/// [`choose_dense_allreduce`] over [`StrategyId`]s, [`choose_allgatherv`]
/// over [`AllgathervAlgo`]s).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice<T> {
    /// The pick: the first candidate within the near tie of the cheapest
    /// (`sparse-allgather`, `sparse-allreduce` or `sparse-hierarchical`;
    /// `dense-rabenseifner`, `dense-ring` or `dense-hierarchical`; `recdbl`
    /// or `node`).
    pub pick: T,
    /// Predicted seconds of every candidate, in the order tried (the
    /// node-aware ones only with several nodes).
    pub predictions: Vec<(T, f64)>,
}

/// The fastest exchange of a step's index/value pairs: the fused
/// allgatherv (its collective plus decoding the `p` received units, as
/// [`plan_step`](super::plan_step) charges a `sparse-allgather` layer), the sparse allreduce
/// (`topology::sparse_allreduce`) or, when the job spans several nodes,
/// the node-aware one (`topology::sparse_hierarchical`): the same group
/// costs [`plan_step`](super::plan_step) uses for the sparse group (the allgatherv's adds
/// per layer, on the engine's threads when there are several layers, as
/// [`plan_step`](super::plan_step) charges them). The pair layers are priced alone: the fused
/// allgatherv's α is charged to them even where other codecs' units keep
/// it running. The choice is the first candidate within [`NEAR_TIE`](super::NEAR_TIE) of
/// the cheapest, as [`plan_step`](super::plan_step) chooses its sparse
/// group's collective (within 2 % of that group's cost). The two price the
/// group alike but not identically (here the pair layers alone, with the
/// measured fill), so near a tie they may still name different exchanges.
/// Near-ties (one rank) and a group without pairs (empty layers) go to the
/// allgatherv.
pub fn choose_sparse_exchange(prof: &Profile, q: &ExchangeQuery) -> Result<Choice<StrategyId>> {
    check_ranks(q.at.p)?;
    if !(q.k >= 0.0 && q.k.is_finite() && q.message_bytes >= 0.0 && q.message_bytes.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "pairs {} and message bytes {} must be finite and not negative",
            q.k, q.message_bytes
        )));
    }
    let sq = StepQuery {
        at: q.at,
        density: 1.0,
        select_method: String::new(),
        gradiveq_ratio: 1.0,
        allowed: Vec::new(),
        min_sparse_elems: 0,
        powersgd_rank: 1,
    };
    check(&sq)?;
    let net = Net::of(prof, &sq);
    let n = q.n as f64;
    let pairs = Sizes {
        sparse: 8.0 * q.k,
        sparse_n: n,
        ..Sizes::default()
    };
    let gather = Sizes {
        sparse: q.message_bytes,
        sparse_n: n,
        ..Sizes::default()
    };
    if let Some((i, &(ln, bytes))) = q
        .layers
        .iter()
        .enumerate()
        .find(|(_, (ln, b))| !(b.is_finite() && *b >= 0.0) || *ln > q.n)
    {
        return Err(Error::InvalidArgument(format!(
            "layer {i} of the exchange: {bytes} message bytes for {ln} elements (of {})",
            q.n
        )));
    }
    let unpack = if q.at.p == 1 {
        0.0
    } else if q.layers.is_empty() {
        q.at.p as f64 * q.message_bytes * prof.gamma_unpack_at(4.0 * n)
    } else {
        // The layers' adds run on the engine's threads side by side, as
        // `effective_local` charges them in a plan.
        let adds: f64 = q
            .layers
            .iter()
            .map(|&(ln, bytes)| q.at.p as f64 * bytes * prof.gamma_unpack_at(4.0 * ln as f64))
            .sum();
        if q.layers.len() >= 2 {
            adds / prof.parallel_speedup().unwrap_or(1.0)
        } else {
            adds
        }
    };
    let mut predictions = vec![
        (
            StrategyId::SparseAllgather,
            sparse_group(&net, StrategyId::SparseAllgather, gather) + unpack,
        ),
        (
            StrategyId::SparseAllreduce,
            sparse_group(&net, StrategyId::SparseAllreduce, pairs),
        ),
    ];
    if q.n > u32::MAX as usize {
        // The sparse allreduces address the pairs' concatenated index
        // space with u32 indices: past it only the allgatherv runs.
        predictions.truncate(1);
    } else if q.at.ranks_per_node.is_some_and(|l| l < q.at.p) {
        predictions.push((
            StrategyId::SparseHierarchical,
            sparse_group(&net, StrategyId::SparseHierarchical, pairs),
        ));
    }
    // No pairs (empty layers): nothing to reduce.
    let id = if q.k > 0.0 {
        cheapest(&predictions)
    } else {
        predictions[0].0
    };
    Ok(Choice {
        pick: id,
        predictions,
    })
}

/// The fastest algorithm for the engine's fused dense allreduce of `bytes`
/// per rank (`sync::Config::allreduce = "auto"`): Rabenseifner, the ring
/// or, when the job spans several nodes (`ranks_per_node < p` of `at`; its
/// fill and allgatherv play no part), the
/// hierarchical allreduce, priced as [`plan_step`](super::plan_step) prices the dense group.
/// Every input must be the same on every rank (the engine passes the
/// step's dense elements, the communicator's size and its node map), so
/// every rank runs the same algorithm. Near-ties ([`NEAR_TIE`](super::NEAR_TIE); one rank,
/// no bytes) go to Rabenseifner; the predictions are in that order.
pub fn choose_dense_allreduce(
    prof: &Profile,
    bytes: f64,
    at: &Placement,
) -> Result<Choice<StrategyId>> {
    let (p, ranks_per_node) = (at.p, at.ranks_per_node);
    if p == 0 || !(bytes >= 0.0 && bytes.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "a dense allreduce of {bytes} bytes on {p} ranks"
        )));
    }
    if let Some(l) = ranks_per_node.filter(|&l| l == 0) {
        return Err(Error::InvalidArgument(format!("{l} ranks per node")));
    }
    let net = Net::new(prof, p, ranks_per_node, None);
    let mut ids = vec![StrategyId::DenseRabenseifner, StrategyId::DenseRing];
    if ranks_per_node.is_some_and(|l| l < p) {
        ids.push(StrategyId::DenseHierarchical);
    }
    let predictions: Vec<(StrategyId, f64)> = ids
        .iter()
        .map(|&id| (id, dense_group(&net, id, bytes)))
        .collect();
    Ok(Choice {
        pick: cheapest(&predictions),
        predictions,
    })
}

/// The fastest allgatherv for the engine's fused message of `bytes` per
/// rank (`sync::Config::allgather = "auto"`): the flat one (recursive
/// doubling, Bruck's for `p` not a power of two) or, when the job spans
/// several nodes with several ranks on one (`ranks_per_node < p`, a
/// profile with [`Profile::inter_node`]), the node-aware one
/// ([`crate::dense::AllgathervAlgo::Node`]), priced as
/// [`plan_step`](super::plan_step) prices the fused allgatherv. Every
/// input must be the same on every rank (the engine passes the step's
/// fused message size, the communicator's size and its node map), so
/// every rank runs the same algorithm. Near-ties ([`NEAR_TIE`](super::NEAR_TIE)) go to the
/// flat one.
///
/// ```
/// use gradsync::cost::{choose_allgatherv, NetLevel, Placement, Profile};
/// use gradsync::dense::AllgathervAlgo;
/// // Shared memory at 1 µs and 5 GB/s inside a node, 20 µs and 125 MB/s between.
/// let mut prof = Profile::from_network(1e-6, 5e9, 0.0, 0.0).unwrap();
/// prof.inter_node = Some(NetLevel { alpha: 20e-6, beta: 8e-9, beta_curve: vec![],
///                                   oneway_curve: vec![], burst: None });
/// // 4 nodes of 8 ranks, 1 MB a rank: one rank per node crosses.
/// let c = choose_allgatherv(&prof, 1e6, &Placement::on(32, Some(8))).unwrap();
/// assert_eq!(c.pick, AllgathervAlgo::Node);
/// // One node: nothing to be node-aware about.
/// let c = choose_allgatherv(&prof, 1e6, &Placement::on(8, Some(8))).unwrap();
/// assert_eq!(c.pick, AllgathervAlgo::RecursiveDoubling);
/// ```
pub fn choose_allgatherv(
    prof: &Profile,
    bytes: f64,
    at: &Placement,
) -> Result<Choice<AllgathervAlgo>> {
    let (p, ranks_per_node) = (at.p, at.ranks_per_node);
    if p == 0 || p > MAX_RANKS || !(bytes >= 0.0 && bytes.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "an allgatherv of {bytes} bytes a rank on {p} ranks (1..={MAX_RANKS})"
        )));
    }
    if let Some(l) = ranks_per_node.filter(|&l| l == 0) {
        return Err(Error::InvalidArgument(format!("{l} ranks per node")));
    }
    let net = Net::new(prof, p, ranks_per_node, None);
    let predictions = allgatherv_candidates(&net, bytes);
    Ok(Choice {
        pick: cheapest(&predictions),
        predictions,
    })
}
