//! Node-aware (hierarchical) allreduce: the ranks of a node
//! reduce-scatter over shared memory, each local rank allreduces its shard
//! with the ranks of the same local index on the other nodes, and the ranks
//! of a node allgather the shards: the scheme of NCCL's and Horovod's
//! hierarchical allreduce, with Thakur–Rabenseifner–Gropp's Rabenseifner
//! algorithm (§4.4) between nodes.
//!
//! Between nodes each rank sends only `2·(N−1)/N` of its shard, `n/S`
//! elements with `S` ranks per node, so the node's link carries about
//! `2·(N−1)/N · n` per node, as a flat algorithm would per *rank*: the
//! saving a flat Rabenseifner or ring misses when several ranks share one
//! network link.
//!
//! Nodes may hold different numbers of ranks: the buffer is cut into `S`
//! shards, `S` the smallest node's count; local ranks `≥ S` take part in
//! the node's reduce-scatter and allgather with empty shards. The node map
//! comes from [`MpiComm::node_ids`](crate::comm::MpiComm::node_ids) (ranks
//! sharing memory) or from the caller; every rank must pass the same map
//! (with `opts.validate`, a map of the wrong length on some rank, or maps
//! that differ, are the same error on every rank).

use super::ring::segment;
use super::{
    add_into, average, rabenseifner_allreduce_with, split_ref_mut, AllreduceOptions, Real,
    ReduceOp, Workspace, TAG_RING as TAG, TAG_VALIDATE,
};
use crate::comm::{Group, Transport};
use crate::{Error, Result};

/// In-place allreduce of `buf` over all ranks of `comm`, node-aware:
/// `nodes[r]` is rank `r`'s node (any id; equal ids share a node).
///
/// ```
/// use gradsync::comm::{LocalComm, Transport};
/// use gradsync::dense::{hierarchical_allreduce, AllreduceOptions};
/// // 5 ranks on 2 nodes: {0, 1, 2} and {3, 4}.
/// let out = LocalComm::run(5, |c| {
///     let mut g = vec![c.rank() as f32; 11];
///     hierarchical_allreduce(&c, &mut g, &[0, 0, 0, 3, 3], &AllreduceOptions::default()).unwrap();
///     g
/// });
/// assert!(out.iter().all(|g| g.iter().all(|&x| x == 10.0)));
/// ```
pub fn hierarchical_allreduce<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    nodes: &[usize],
    opts: &AllreduceOptions,
) -> Result<()> {
    hierarchical_allreduce_with(comm, buf, nodes, opts, &mut Workspace::new())
}

/// [`hierarchical_allreduce`] with caller-provided scratch.
pub fn hierarchical_allreduce_with<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    nodes: &[usize],
    opts: &AllreduceOptions,
    ws: &mut Workspace<T>,
) -> Result<()> {
    let (rank, p, n) = (comm.rank(), comm.size(), buf.len());
    let local = if nodes.len() == p {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "node map of {} ranks for a communicator of {p}",
            nodes.len()
        )))
    };
    if opts.validate {
        // One small collective agrees on the length, the map's validity
        // and the map itself: ranks holding different maps would enter
        // different groups and wait for each other forever.
        let h = crate::comm::agree::map_hash(nodes);
        crate::comm::agree::agree_args(
            comm,
            TAG_VALIDATE,
            local,
            n,
            &[(h, &|| {
                format!(
                    "the node maps of the hierarchical allreduce differ across ranks (this rank's: {nodes:?})"
                )
            })],
        )?;
    } else {
        // Without validation the caller guarantees agreement (as for every
        // algorithm's length); a wrong map is still refused before sending.
        local?;
    }
    if p == 1 || n == 0 {
        return Ok(());
    }
    let layout = Layout::new(nodes, rank);
    let shard = |j: usize| {
        if j < layout.shards {
            segment(n, layout.shards, j)
        } else {
            0..0
        }
    };
    let node = Group::new(comm, layout.local.clone())?;
    let li = node.rank();
    let l = node.size();
    // 1. The node's reduce-scatter (a ring over shared memory): local rank
    // j ends with shard j summed over the node.
    if l > 1 {
        let tmp = ws.scratch(shard(0).len());
        let (right, left) = ((li + 1) % l, (li + l - 1) % l);
        for s in 0..l - 1 {
            let sb = shard((li + 2 * l - s - 1) % l);
            let rb = shard((li + 2 * l - s - 2) % l);
            let t = &mut tmp[..rb.len()];
            node.sendrecv(&buf[sb], right, t, left, TAG)?;
            add_into(&mut buf[rb], t);
        }
    }
    // 2. Between nodes: shard `li` with the ranks of local index `li` on
    // every node (their pairs never share a node, so they cannot match the
    // node ring's messages).
    let mine = shard(li);
    if li < layout.shards {
        if layout.across.len() > 1 {
            let across = Group::new(comm, layout.across.clone())?;
            let inner = AllreduceOptions {
                op: ReduceOp::Sum,
                validate: false,
                chunk_elems: 0,
            };
            rabenseifner_allreduce_with(&across, &mut buf[mine.clone()], &inner, ws)?;
        }
        if opts.op == ReduceOp::Average {
            average(&mut buf[mine], p);
        }
    }
    // 3. The node's allgather of the shards.
    if l > 1 {
        let (right, left) = ((li + 1) % l, (li + l - 1) % l);
        for s in 0..l - 1 {
            let sb = shard((li + l - s) % l);
            let rb = shard((li + 2 * l - s - 1) % l);
            let (snd, rcv) = split_ref_mut(buf, sb, rb);
            node.sendrecv(snd, right, rcv, left, TAG)?;
        }
    }
    Ok(())
}

/// This rank's place in the node map.
struct Layout {
    /// The parent ranks of this rank's node, ascending.
    local: Vec<usize>,
    /// The parent ranks of this rank's local index on every node, in the
    /// order of the nodes' lowest ranks.
    across: Vec<usize>,
    /// Shards of the buffer: the smallest node's number of ranks.
    shards: usize,
}

impl Layout {
    fn new(nodes: &[usize], rank: usize) -> Self {
        // Nodes in the order of their lowest rank; each node's ranks ascending.
        let mut order: Vec<usize> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (r, &id) in nodes.iter().enumerate() {
            match order.iter().position(|&x| x == id) {
                Some(i) => members[i].push(r),
                None => {
                    order.push(id);
                    members.push(vec![r]);
                }
            }
        }
        let mine = members
            .iter()
            .position(|m| m.contains(&rank))
            .expect("every rank is in the map");
        let li = members[mine]
            .iter()
            .position(|&r| r == rank)
            .expect("member");
        let shards = members.iter().map(Vec::len).min().unwrap_or(1);
        let across = members.iter().filter_map(|m| m.get(li).copied()).collect();
        Layout {
            local: members[mine].clone(),
            across,
            shards,
        }
    }
}
