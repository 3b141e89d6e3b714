//! Hierarchical (node-aware) sparse allreduce (the "hierarchical
//! sparse path"): the two-level scheme of NCCL's and Horovod's hierarchical
//! allreduce applied to sparse units. The ranks of a node reduce their
//! `(index, value)` pairs into one sparse unit per node over shared memory,
//! the nodes' leaders exchange those units, and each leader broadcasts
//! them to its node; every rank sums the node units into a dense output.
//!
//! It is for jobs where several ranks share one network link: the flat
//! fused allgather of [`super`] sends every rank's unit across the network
//! once for every off-node rank, while here only one unit per node crosses
//! it, and a unit in which the node's ranks overlap (the same hot indices)
//! is smaller than the sum of its parts.
//!
//! 1. **Agreement** (one 56-byte recursive-doubling max, as in
//!    [`super::allreduce`]): an argument error on one rank (an index `≥ n`,
//!    index and value slices of different lengths, an output of the wrong
//!    length, a node map whose length is not the number of ranks,
//!    `opts.reselect`, which this path does not support, a NaN `delta`)
//!    becomes [`Error::RankFailed`] naming that rank on every rank
//!    ([`crate::comm::agree::agree`]); different `n` is [`Error::SizeMismatch`],
//!    different node maps or allgatherv algorithms
//!    [`Error::ArgumentMismatch`], on every rank alike.
//! 2. **Intra-node reduction**: a node's leader is its lowest rank. Every
//!    other rank sends its pairs (sorted by index, its duplicates summed) to
//!    the leader, which merges the node's pairs in local-rank order into one
//!    unit of distinct sorted indices with summed values.
//! 3. **Inter-node exchange**: the leaders allgatherv their node units
//!    (over a [`Group`] of the leaders, recursive doubling; when every rank
//!    is its own node, over `comm` itself with `opts.gather`). A unit is
//!    self-describing, `[kind u32 | nnz u32 | ...]` little-endian: kind 0
//!    `nnz` indices u32 then `nnz` values f32; kind 1 (SparCML's switch to a
//!    dense representation, taken when `nnz / n > opts.delta`) the `n`
//!    values f32.
//! 4. **Intra-node broadcast**: each leader sends the gathered units (their
//!    lengths, then one byte buffer) down a binomial tree over its node.
//!    Every rank validates them and sums them into `out` (**overwritten**)
//!    in node order, so every rank of the job ends with the same bits. A
//!    corrupt unit is [`Error::PeerMessage`] naming the node's leader, on
//!    every rank (they all decode the same bytes); corrupt pairs or lengths
//!    seen by one node only end the job ([`Transport::abort`]), since the
//!    other nodes may already wait in the next collective.
//!
//! **Cost.** With `H` nodes of `L` ranks (`p = H·L`), `m` bytes of one
//! rank's unit (8 a pair) and `u ≤ min(L·m, 4n) + 8` bytes of a node's unit
//! (smaller when the node's ranks select the same indices), each node's
//! link carries the other `(H−1)` node units, `(H−1)·u` bytes in (as many
//! out, recursive doubling), against `L·(p−L)·m` for the flat fused
//! allgather: at least `L` times less. Within the node (shared memory): the
//! `L−1` ranks' pairs into the leader and the `H` units to the `L−1` ranks.
//! Latency: `L−1` receives at the leader, `⌈lg H⌉` exchange rounds (two
//! more for a non-power-of-two `H`), `⌈lg L⌉` broadcast rounds. It is the
//! fused allgather's traffic divided by `L`, not O(k) per rank as
//! [`sparse_allreduce`](super::allreduce::sparse_allreduce)'s
//! split-and-reduce (Ok-Topk): with many nodes and little overlap between
//! ranks that one sends fewer bytes; with few nodes of many ranks, or
//! heavily overlapping selections, this one does.
//!
//! Sources: SparCML (Renggli et al., "SparCML: high-performance sparse
//! communication for machine learning", SC'19) for the sparse stream that
//! switches to a dense representation past a fill-in threshold `δ`;
//! Ok-Topk (Li & Hoefler, PPoPP'22) for the flat O(k) alternative; NCCL's
//! and Horovod's hierarchical allreduce (reduce within the node, exchange
//! among nodes, broadcast within the node) for the hierarchy, as in
//! [`crate::dense::hierarchical`]. Values pass through as they are: NaN and
//! Inf are summed like any other value.

use super::allreduce::{check_pairs, merge_sorted, sorted_pairs, SparseAllreduceOptions};
use crate::comm::agree::{agree_args, map_hash};
use crate::comm::{tags, Group, Tag, Transport};
use crate::dense::{allgatherv_with, AllgathervAlgo, Gathered};
use crate::{Error, Result};
use std::collections::HashMap;

const TAG: Tag = tags::SPARSE_HIERARCHICAL;

/// Node unit kind: distinct sorted indices, then their values.
const KIND_SPARSE: u32 = 0;
/// Node unit kind: the `n` values.
const KIND_DENSE: u32 = 1;

/// What [`hierarchical_sparse_allreduce`] did (the same on every rank).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HierarchicalSparseReport {
    /// Distinct indices of each node's merged unit, in node order (nodes
    /// ordered by their lowest rank).
    pub node_nnz: Vec<usize>,
    /// Whether each node's unit was sent densely (SparCML's switch).
    pub dense: Vec<bool>,
    /// Distinct indices of the summed result: the union of the node units'
    /// indices. A dense unit does not name its indices: from it, the
    /// indices whose node sum is not `+0.0` count (so with a dense unit a
    /// selected index whose node sum is exactly `+0.0` may be missed).
    pub result_nnz: usize,
}

/// Sum every rank's sparse contribution `(indices[i], values[i])` (indices
/// in `[0, n)`, any order, duplicates summed) and write the exact sum into
/// `out` (length `n`, overwritten) on every rank, node by node: `nodes[r]`
/// is rank `r`'s node (any ids; equal ids share a node, e.g.
/// [`MpiComm::node_ids`](crate::comm::MpiComm::node_ids)). Collective:
/// every rank calls it with the same `n`, `nodes` and `opts.gather`;
/// `opts.delta` may differ (each leader decides for its node's unit),
/// `opts.balance` is not used and `opts.reselect` must be `None`. See the
/// [module docs](self) for the algorithm and its cost.
///
/// ```
/// use gradsync::comm::{LocalComm, Transport};
/// use gradsync::sparse::hierarchical::hierarchical_sparse_allreduce;
/// // 5 ranks on 2 nodes: {0, 1, 2} and {3, 4}.
/// let nodes = [0, 0, 0, 1, 1];
/// let got = LocalComm::run(5, |c| {
///     let r = c.rank() as u32;
///     let mut out = vec![0f32; 10];
///     let rep = hierarchical_sparse_allreduce(
///         &c, 10, &nodes, &[r, 9], &[1.0, 2.0], &mut out, &Default::default(),
///     )
///     .unwrap();
///     (out, rep)
/// });
/// assert_eq!(got[0].0, vec![1., 1., 1., 1., 1., 0., 0., 0., 0., 10.]);
/// // Node units {0, 1, 2, 9} and {3, 4, 9}; their union has 6 indices.
/// assert_eq!(got[4].1.node_nnz, vec![4, 3]);
/// assert_eq!(got[4].1.result_nnz, 6);
/// ```
pub fn hierarchical_sparse_allreduce<C: Transport>(
    comm: &C,
    n: usize,
    nodes: &[usize],
    indices: &[u32],
    values: &[f32],
    out: &mut [f32],
    opts: &SparseAllreduceOptions,
) -> Result<HierarchicalSparseReport> {
    hierarchical_sparse_allreduce_with(
        comm,
        n,
        nodes,
        indices,
        values,
        out,
        opts,
        &mut HierarchicalWorkspace::default(),
    )
}

/// The buffers [`hierarchical_sparse_allreduce_with`] keeps from one call
/// to the next (a workspace, as faer's): the bitset that counts the
/// result's distinct indices (`n/8` bytes, all zero between calls) and the
/// leaders' gathered units. A fresh bitset each call cost `n/8` bytes of
/// new pages and a pass to count its bits; now the bits are counted as
/// they are set and the bitset is zeroed in place.
#[derive(Debug, Default)]
pub struct HierarchicalWorkspace {
    seen: Vec<u64>,
    gathered: Gathered,
}

/// [`hierarchical_sparse_allreduce`] with the buffers of `ws` (reuse one
/// across calls: the engine keeps one per instance).
#[allow(clippy::too_many_arguments)]
pub fn hierarchical_sparse_allreduce_with<C: Transport>(
    comm: &C,
    n: usize,
    nodes: &[usize],
    indices: &[u32],
    values: &[f32],
    out: &mut [f32],
    opts: &SparseAllreduceOptions,
    ws: &mut HierarchicalWorkspace,
) -> Result<HierarchicalSparseReport> {
    let rank = comm.rank();
    // 1. Agreement on failures, n, the node map and the allgatherv.
    agree_call(comm, n, nodes, indices, values, out.len(), opts)?;

    // Phase times for `RUST_LOG=gradsync::sparse=trace` (docs/benchmarks/cluster.md).
    let t0 = std::time::Instant::now();
    let mut phases = [0f64; 4];
    let layout = Layout::new(nodes, rank);
    let node = Group::new(comm, layout.local.clone())?;
    let pairs = sorted_pairs(indices, values);
    // 2. and 3.: the leader reduces its node's pairs and exchanges units.
    let mine = if node.rank() == 0 {
        let merged = reduce_node(&node, n, pairs)?;
        let unit = encode_unit(&merged, n, opts.delta);
        phases[0] = t0.elapsed().as_secs_f64();
        Some(exchange_units(
            comm,
            &layout.leaders,
            unit,
            opts.gather,
            &mut ws.gathered,
        )?)
    } else {
        send_pairs(&node, &pairs)?;
        None
    };
    // 4. The node's broadcast, then the sum of the node units.
    let spare = std::mem::take(&mut ws.gathered.data);
    let (counts, data) = broadcast(&node, layout.leaders.len(), n, mine, spare)?;
    phases[1] = t0.elapsed().as_secs_f64();
    out.fill(0.0);
    phases[2] = t0.elapsed().as_secs_f64();
    let report = add_units(&counts, &data, &layout.leaders, n, out, &mut ws.seen)?;
    // The units' buffer serves the next call (its allgatherv or receive).
    ws.gathered.data = data;
    phases[3] = t0.elapsed().as_secs_f64();
    log::trace!(
        "hierarchical sparse allreduce: rank {rank}, seconds since the call: merged and encoded {:.4} (leaders), units received {:.4}, output cleared {:.4}, units added {:.4}",
        phases[0], phases[1], phases[2], phases[3]
    );
    Ok(report)
}

/// Step 1: every rank agrees on the rank-local argument checks
/// ([`check_local`]), `n`, the node map and the allgatherv algorithm.
fn agree_call<C: Transport>(
    comm: &C,
    n: usize,
    nodes: &[usize],
    indices: &[u32],
    values: &[f32],
    out_len: usize,
    opts: &SparseAllreduceOptions,
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    let local = check_local(rank, p, n, nodes, indices, values, out_len, opts);
    let map = map_hash(nodes);
    let algo = match opts.gather {
        AllgathervAlgo::RecursiveDoubling => 1u64,
        AllgathervAlgo::Mpi => 2,
        AllgathervAlgo::Node => 3,
    };
    agree_args(
        comm,
        TAG,
        local,
        n,
        &[
            (map, &|| {
                format!(
                    "the node maps of the hierarchical sparse allreduce differ across ranks (this rank's: {nodes:?})"
                )
            }),
            (algo, &|| {
                format!(
                    "the allgatherv of the hierarchical sparse allreduce differs across ranks (this rank: {})",
                    opts.gather.name()
                )
            }),
        ],
    )
}

/// Step 4's sum: the gathered node units (`counts[j]` bytes of `data` for
/// the node led by `leaders[j]`) added into `out` in node order, their
/// indices marked in the bitset `seen` (grown to `n` bits, and left all
/// zero again, after an error too); the first bad unit's error stops it.
fn add_units(
    counts: &[u64],
    data: &[u8],
    leaders: &[usize],
    n: usize,
    out: &mut [f32],
    seen: &mut Vec<u64>,
) -> Result<HierarchicalSparseReport> {
    let words = n.div_ceil(64);
    if seen.len() < words {
        seen.resize(words, 0);
    }
    let seen = &mut seen[..words];
    let mut report = HierarchicalSparseReport::default();
    let mut at = 0usize;
    let mut added = Ok(());
    for (j, &c) in counts.iter().enumerate() {
        // The lengths were checked against the data in `broadcast`.
        let m = &data[at..at + c as usize];
        at += c as usize;
        match add_unit(m, leaders[j], n, out, seen) {
            Ok((nnz, dense, fresh)) => {
                report.node_nnz.push(nnz);
                report.dense.push(dense);
                report.result_nnz += fresh;
            }
            Err(e) => {
                added = Err(e);
                break;
            }
        }
    }
    // Back to all zero for the next call (after an error too): `n/8`
    // bytes, 1/32 of the output the caller cleared.
    seen.fill(0);
    added?;
    Ok(report)
}

fn peer(rank: usize, reason: String) -> Error {
    Error::PeerMessage {
        rank,
        layer: "<hierarchical sparse allreduce>".into(),
        reason,
    }
}

/// Rank-local argument checks (their failure is agreed on by every rank).
#[allow(clippy::too_many_arguments)]
fn check_local(
    rank: usize,
    p: usize,
    n: usize,
    nodes: &[usize],
    indices: &[u32],
    values: &[f32],
    out_len: usize,
    opts: &SparseAllreduceOptions,
) -> Result<()> {
    check_pairs(rank, n, indices, values, out_len)?;
    let bad = |m: String| Err(Error::InvalidArgument(format!("rank {rank}: {m}")));
    if nodes.len() != p {
        return bad(format!(
            "node map of {} ranks for a communicator of {p}",
            nodes.len()
        ));
    }
    if let Some(k) = opts.reselect {
        return bad(format!(
            "reselect = Some({k}): the hierarchical sparse allreduce computes the exact sum only (reselect must be None)"
        ));
    }
    if opts.delta.is_nan() {
        return bad("delta is NaN".into());
    }
    Ok(())
}

/// This rank's place in the node map.
struct Layout {
    /// The parent ranks of this rank's node, ascending (the leader first).
    local: Vec<usize>,
    /// Every node's leader (lowest rank), ascending: the node order.
    leaders: Vec<usize>,
}

impl Layout {
    fn new(nodes: &[usize], rank: usize) -> Self {
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (r, &id) in nodes.iter().enumerate() {
            let j = *index.entry(id).or_insert_with(|| {
                members.push(Vec::new());
                members.len() - 1
            });
            members[j].push(r);
        }
        let mine = index[&nodes[rank]];
        Layout {
            local: members[mine].clone(),
            leaders: members.iter().map(|m| m[0]).collect(),
        }
    }
}

/// A non-leader's pairs to its leader: the count, then (when not zero)
/// the indices and the values' bits in one `u32` buffer.
fn send_pairs<C: Transport>(node: &Group<C>, pairs: &[(u32, f32)]) -> Result<()> {
    node.send(&[pairs.len() as u64], 0, TAG)?;
    if !pairs.is_empty() {
        let mut buf = Vec::with_capacity(2 * pairs.len());
        buf.extend(pairs.iter().map(|&(i, _)| i));
        buf.extend(pairs.iter().map(|&(_, x)| x.to_bits()));
        node.send(&buf, 0, TAG)?;
    }
    Ok(())
}

/// The leader's merge of its node's pairs, in local-rank order (its own
/// first): distinct sorted indices, equal indices summed in that order.
fn reduce_node<C: Transport>(
    node: &Group<C>,
    n: usize,
    mut all: Vec<(u32, f32)>,
) -> Result<Vec<(u32, f32)>> {
    let l = node.size();
    // A corrupt count or index is this node's alone while the other nodes
    // go on to the exchange: the job ends (crate::comm::agree's rule).
    let die = |j: usize, reason: String| -> ! {
        let e = peer(node.parent_rank(j), reason);
        node.abort(1, &format!("hierarchical sparse allreduce: {e}"))
    };
    for j in 1..l {
        let mut cnt = [0u64];
        node.recv(&mut cnt, j, TAG)?;
        let c = usize::try_from(cnt[0])
            .ok()
            .filter(|&c| c <= n)
            .unwrap_or_else(|| die(j, format!("sends {} pairs for n = {n}", cnt[0])));
        if c == 0 {
            continue;
        }
        let mut buf = vec![0u32; 2 * c];
        node.recv(&mut buf, j, TAG)?;
        let (idx, val) = buf.split_at(c);
        let mut prev: Option<u32> = None;
        for (&i, &x) in idx.iter().zip(val) {
            if i as usize >= n || prev.is_some_and(|q| q >= i) {
                die(
                    j,
                    format!("sent index {i} out of order or out of range for n = {n}"),
                );
            }
            prev = Some(i);
            all.push((i, f32::from_bits(x)));
        }
    }
    if l > 1 {
        // Stable: equal indices stay in local-rank order.
        all.sort_by_key(|&(i, _)| i);
        all = merge_sorted(all);
    }
    Ok(all)
}

/// Lay out a node unit (distinct sorted pairs): densely when its fill-in
/// `nnz / n` exceeds `delta` (SparCML's switch), else as pairs.
pub(crate) fn encode_unit(pairs: &[(u32, f32)], n: usize, delta: f64) -> Vec<u8> {
    let nnz = pairs.len();
    let dense = n > 0 && nnz as f64 > delta * n as f64;
    let mut msg = Vec::with_capacity(8 + if dense { 4 * n } else { 8 * nnz });
    if dense {
        msg.extend_from_slice(&KIND_DENSE.to_le_bytes());
        msg.extend_from_slice(&(nnz as u32).to_le_bytes());
        let mut d = vec![0f32; n];
        for &(i, x) in pairs {
            d[i as usize] = x;
        }
        d.iter()
            .for_each(|x| msg.extend_from_slice(&x.to_le_bytes()));
    } else {
        msg.extend_from_slice(&KIND_SPARSE.to_le_bytes());
        msg.extend_from_slice(&(nnz as u32).to_le_bytes());
        pairs
            .iter()
            .for_each(|(i, _)| msg.extend_from_slice(&i.to_le_bytes()));
        pairs
            .iter()
            .for_each(|(_, x)| msg.extend_from_slice(&x.to_le_bytes()));
    }
    msg
}

/// The leaders' allgatherv of the node units: every node's unit length
/// and the units back to back, in node order.
fn exchange_units<C: Transport>(
    comm: &C,
    leaders: &[usize],
    unit: Vec<u8>,
    algo: AllgathervAlgo,
    g: &mut Gathered,
) -> Result<(Vec<u64>, Vec<u8>)> {
    if leaders.len() == 1 {
        return Ok((vec![unit.len() as u64], unit));
    }
    if leaders.len() == comm.size() {
        allgatherv_with(comm, &unit, algo, g)?;
    } else {
        // A group has no MPI communicator of its own: recursive doubling.
        let group = Group::new(comm, leaders.to_vec())?;
        allgatherv_with(&group, &unit, AllgathervAlgo::RecursiveDoubling, g)?;
    }
    let counts = g.displs.windows(2).map(|w| (w[1] - w[0]) as u64).collect();
    Ok((counts, std::mem::take(&mut g.data)))
}

/// The leader's units down a binomial tree over its node: the `h` lengths,
/// then the bytes. The leader passes `Some`, every other rank `None` and
/// receives into `spare` (a buffer kept from an earlier call).
fn broadcast<C: Transport>(
    node: &Group<C>,
    h: usize,
    n: usize,
    mine: Option<(Vec<u64>, Vec<u8>)>,
    mut spare: Vec<u8>,
) -> Result<(Vec<u64>, Vec<u8>)> {
    let (li, l) = (node.rank(), node.size());
    let mut got = mine;
    let mut mask = 1;
    while mask < l {
        if li & mask != 0 {
            let src = li - mask;
            let mut counts = vec![0u64; h];
            node.recv(&mut counts, src, TAG)?;
            // Only this node sees these lengths: a bad one ends the job.
            let total = units_len(&counts, n).unwrap_or_else(|| {
                let e = peer(
                    node.parent_rank(src),
                    format!("forwards node units of lengths {counts:?} for n = {n}"),
                );
                node.abort(1, &format!("hierarchical sparse allreduce: {e}"))
            });
            spare.clear();
            spare.resize(total, 0);
            node.recv(&mut spare, src, TAG)?;
            got = Some((counts, spare));
            break;
        }
        mask <<= 1;
    }
    let (counts, data) = got.expect("the leader holds the units, the others received them");
    mask >>= 1;
    while mask > 0 {
        if li + mask < l {
            node.send(&counts, li + mask, TAG)?;
            node.send(&data, li + mask, TAG)?;
        }
        mask >>= 1;
    }
    Ok((counts, data))
}

/// The total of node units' lengths, `None` when one cannot be a unit for
/// `n` (longer than `8 + 8n` bytes) or the total overflows.
fn units_len(counts: &[u64], n: usize) -> Option<usize> {
    let max = 8u64.checked_add(8u64.checked_mul(n as u64)?)?;
    counts.iter().try_fold(0usize, |t, &c| {
        (c <= max)
            .then(|| usize::try_from(c).ok())
            .flatten()
            .and_then(|c| t.checked_add(c))
    })
}

/// Validate the unit `m` of the node led by `leader` and add it into `out`
/// (length `n`), marking its indices in the bitset `seen`; returns
/// (nnz, dense). Hostile bytes give [`Error::PeerMessage`], never a panic;
/// `out` and `seen` are left untouched then. Also returns how many of its
/// indices were not marked before (the growth of the result's distinct
/// indices).
pub(crate) fn add_unit(
    m: &[u8],
    leader: usize,
    n: usize,
    out: &mut [f32],
    seen: &mut [u64],
) -> Result<(usize, bool, usize)> {
    let bad = |reason: String| Err(peer(leader, format!("node unit: {reason}")));
    if out.len() != n || seen.len() < n.div_ceil(64) {
        return Err(Error::InvalidArgument(format!(
            "add_unit: output of {} and bitset of {} words for n = {n}",
            out.len(),
            seen.len()
        )));
    }
    if m.len() < 8 {
        return bad(format!("{} bytes, shorter than its header", m.len()));
    }
    let word = |c: &[u8]| u32::from_le_bytes(c.try_into().expect("4 bytes"));
    let (kind, nnz) = (word(&m[0..4]), word(&m[4..8]) as usize);
    let body = &m[8..];
    if nnz > n {
        return bad(format!("{nnz} indices for n = {n}"));
    }
    let mut fresh = 0usize;
    let mut mark = |i: usize| {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        fresh += usize::from(seen[w] & b == 0);
        seen[w] |= b;
    };
    match kind {
        KIND_DENSE => {
            if body.len() != 4 * n {
                return bad(format!("dense unit of {} bytes for n = {n}", body.len()));
            }
            for (i, (o, c)) in out.iter_mut().zip(body.chunks_exact(4)).enumerate() {
                let x = f32::from_bits(word(c));
                if x.to_bits() != 0 {
                    mark(i);
                }
                *o += x;
            }
            Ok((nnz, true, fresh))
        }
        KIND_SPARSE => {
            if body.len() != 8 * nnz {
                return bad(format!(
                    "sparse unit of {} bytes for {nnz} pairs",
                    body.len()
                ));
            }
            let (idx, val) = body.split_at(4 * nnz);
            let mut prev: Option<u32> = None;
            for c in idx.chunks_exact(4) {
                let i = word(c);
                if i as usize >= n || prev.is_some_and(|q| q >= i) {
                    return bad(format!(
                        "index {i} out of order or out of range for n = {n}"
                    ));
                }
                prev = Some(i);
            }
            for (ci, cv) in idx.chunks_exact(4).zip(val.chunks_exact(4)) {
                let i = word(ci) as usize;
                mark(i);
                out[i] += f32::from_bits(word(cv));
            }
            Ok((nnz, false, fresh))
        }
        k => bad(format!("unknown kind {k}")),
    }
}

#[cfg(test)]
mod tests;
