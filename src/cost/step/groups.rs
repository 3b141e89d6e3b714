//! What each group of a step costs on the wire: the dense group's
//! allreduce, the sparse group's collective (the fused allgatherv or a
//! sparse allreduce) and the PowerSGD group's two allreduces, in seconds
//! and in bytes a rank sends, and each group's α terms (what it costs
//! before any layer joins). The closed forms are [`crate::cost`]'s on one
//! node and [`topology`]'s on several (Thakur et al. 2005; RedSync App. B;
//! Ok-Topk §3.1 for the sparse allreduce). The planner ([`super`]) adds
//! the layers' local costs and chooses; this file only prices.

use super::Sizes;
use crate::cost::topology::{self, Net};
use crate::cost::{allgather_beta, ceil_lg, dense_rabenseifner, dense_ring, Profile, StrategyId};
use crate::sparse::FUSED_HEADER_LEN;
use crate::{Error, Result};

/// Seconds of the PowerSGD group's two allreduces (`P`, then `Q`) with the
/// dense group's algorithm `algo`.
pub(super) fn lowrank_group(net: &Net, algo: StrategyId, s: Sizes) -> f64 {
    if s.lowrank_p <= 0.0 {
        return 0.0;
    }
    dense_group(net, algo, s.lowrank_p) + dense_group(net, algo, s.lowrank_q)
}

/// Seconds of the dense group's allreduce of `bytes` with `algo`: the
/// one-level closed forms of [`crate::cost`] on one node, the placement-aware
/// ones of [`topology`] on several.
pub(in crate::cost) fn dense_group(net: &Net, algo: StrategyId, bytes: f64) -> f64 {
    let (prof, p) = (net.prof, net.p);
    if bytes <= 0.0 || p <= 1 {
        return 0.0;
    }
    match (algo, net.two_level()) {
        (StrategyId::DenseHierarchical, _) => topology::hierarchical(net, bytes),
        (StrategyId::DenseRing, false) => dense_ring(prof, bytes, p),
        (StrategyId::DenseRing, true) => topology::ring(net, bytes),
        (_, false) => dense_rabenseifner(prof, bytes, p),
        (_, true) => topology::rabenseifner(net, bytes),
    }
}

/// Bytes a rank sends in the dense group's allreduce of `bytes`.
pub(super) fn dense_wire(net: &Net, algo: StrategyId, bytes: f64) -> f64 {
    let p = net.p as f64;
    if net.p <= 1 {
        return 0.0;
    }
    if algo == StrategyId::DenseHierarchical {
        // Inside the node 2(L−1)/L, between nodes 2(H−1)/H of a shard.
        let (l, h) = (net.l.min(net.p) as f64, net.nodes() as f64);
        return 2.0 * (l - 1.0) / l * bytes + 2.0 * (h - 1.0) / h * bytes / l;
    }
    2.0 * (p - 1.0) / p * bytes
}

/// A tiny group: what a group costs before any layer joins (its α terms).
const EMPTY: f64 = 1e-9;

/// Its α terms (what a group of zero bytes would cost).
pub(super) fn dense_alpha(net: &Net, algo: StrategyId) -> f64 {
    let (prof, p) = (net.prof, net.p);
    if p <= 1 {
        return 0.0;
    }
    match algo {
        _ if net.two_level() || algo == StrategyId::DenseHierarchical => {
            dense_group(net, algo, EMPTY)
        }
        StrategyId::DenseRing => 2.0 * (p as f64 - 1.0) * prof.alpha,
        _ => {
            let fold = if p.is_power_of_two() { 0.0 } else { 1.0 };
            (2.0 * ceil_lg(p) + fold) * prof.alpha
        }
    }
}

/// Seconds of the sparse group's collective (`algo`: the fused allgatherv
/// of `s.sparse` bytes per rank plus its header, or a sparse allreduce of
/// `s.sparse / 8` pairs over `s.sparse_n` elements); unpacking the
/// allgatherv's units is the layers'.
pub(in crate::cost) fn sparse_group(net: &Net, algo: StrategyId, s: Sizes) -> f64 {
    let (prof, p) = (net.prof, net.p);
    if s.sparse <= 0.0 || p <= 1 {
        return 0.0;
    }
    match algo {
        StrategyId::SparseAllreduce => {
            topology::sparse_allreduce(net, s.sparse_n, s.sparse / 8.0, net.fill)
        }
        StrategyId::SparseHierarchical => {
            topology::sparse_hierarchical(net, s.sparse_n, s.sparse / 8.0, net.fill)
        }
        _ => {
            let m = s.sparse + FUSED_HEADER_LEN as f64;
            if net.two_level() {
                topology::fused_allgather(net, m)
            } else {
                ceil_lg(p) * prof.alpha + (p as f64 - 1.0) * m * allgather_beta(prof, m, p)
            }
        }
    }
}

/// One sparse collective alone, as `gradsync bench --op sparse-allreduce`
/// runs it: each of `p` ranks (`ranks_per_node` per node) contributes `k`
/// distinct pairs of an `n`-element layer and ends with their dense sum.
/// `id` is the collective: [`StrategyId::SparseAllgather`] (the fused
/// allgatherv of every rank's `[k | indices | values]`, then clearing the
/// output and scatter-adding the `p` units, which the engine does in its
/// layers' local phase), [`StrategyId::SparseAllreduce`] or
/// [`StrategyId::SparseHierarchical`] (their own clearing and summing
/// included). `fill`: the measured fill ratio, as [`Placement::fill`](crate::cost::Placement::fill).
/// The fused allgatherv is priced as `allgather = "auto"` runs it (the
/// cheaper of the flat and the node-aware one,
/// [`choose_allgatherv`](crate::cost::choose_allgatherv));
/// [`sparse_collective_by`] names it.
pub fn sparse_collective(
    prof: &Profile,
    id: StrategyId,
    n: usize,
    k: usize,
    p: usize,
    ranks_per_node: Option<usize>,
    fill: Option<f64>,
) -> Result<f64> {
    sparse_collective_by(prof, id, n, k, p, ranks_per_node, fill, None)
}

/// [`sparse_collective`] with the fused allgatherv's algorithm named:
/// `Some(Node)` the node-aware one, `Some(Auto)` or `None` the choice of
/// `allgather = "auto"`, `Some` of any other the flat one (recursive
/// doubling or Bruck's; `mpi` is priced as that). The sparse allreduces
/// ignore it.
#[allow(clippy::too_many_arguments)]
pub fn sparse_collective_by(
    prof: &Profile,
    id: StrategyId,
    n: usize,
    k: usize,
    p: usize,
    ranks_per_node: Option<usize>,
    fill: Option<f64>,
    gather: Option<crate::strategy::Pick<crate::dense::AllgathervAlgo>>,
) -> Result<f64> {
    use StrategyId::{SparseAllgather, SparseAllreduce, SparseHierarchical};
    if !matches!(id, SparseAllgather | SparseAllreduce | SparseHierarchical) {
        return Err(Error::InvalidArgument(format!(
            "{id} is not a sparse collective (sparse-allgather, sparse-allreduce, sparse-hierarchical)"
        )));
    }
    if p == 0 || k > n {
        return Err(Error::InvalidArgument(format!(
            "a sparse collective of {k} pairs of {n} elements on {p} ranks"
        )));
    }
    let net = Net::new(prof, p, ranks_per_node, fill).with_gather(gather.unwrap_or_default());
    let s = Sizes {
        sparse: 8.0 * k as f64,
        sparse_n: n as f64,
        ..Sizes::default()
    };
    let comm = sparse_group(&net, id, s);
    Ok(if id == StrategyId::SparseAllgather && p > 1 {
        comm + p as f64 * (s.sparse + 4.0) * prof.gamma_unpack_at(4.0 * n as f64)
            + topology::clear(prof, n as f64)
    } else {
        comm
    })
}

/// Its α terms.
pub(super) fn sparse_alpha(net: &Net, algo: StrategyId) -> f64 {
    if algo == StrategyId::SparseAllgather && !net.two_level() {
        return ceil_lg(net.p) * net.prof.alpha;
    }
    let s = Sizes {
        sparse: EMPTY,
        sparse_n: EMPTY,
        ..Sizes::default()
    };
    sparse_group(net, algo, s)
}

/// Bytes a rank sends in the sparse group's collective.
pub(super) fn sparse_wire(net: &Net, algo: StrategyId, s: Sizes) -> f64 {
    let pf = net.p as f64;
    if net.p <= 1 || s.sparse <= 0.0 {
        return 0.0;
    }
    let k = s.sparse / 8.0;
    match algo {
        StrategyId::SparseAllreduce => {
            let f = topology::fill(s.sparse_n, k, net.p, net.fill);
            (pf - 1.0) / pf * (8.0 * k + (8.0 * f).min(4.0 * s.sparse_n))
        }
        StrategyId::SparseHierarchical => {
            let l = net.l.min(net.p);
            let f = topology::fill(s.sparse_n, k, l, net.fill);
            // A leader's share: its node unit to the other nodes.
            8.0 * k + (net.nodes() as f64 - 1.0) * (8.0 * f).min(4.0 * s.sparse_n) / l as f64
        }
        _ => (pf - 1.0) * (s.sparse + FUSED_HEADER_LEN as f64),
    }
}
