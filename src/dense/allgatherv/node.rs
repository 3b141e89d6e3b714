//! The node-aware allgatherv ([`AllgathervAlgo::Node`](super::AllgathervAlgo::Node)):
//! the hierarchy of NCCL's and Horovod's hierarchical
//! collectives applied to the allgatherv. The ranks of a node send their
//! messages to the node's leader (its lowest rank) over shared memory, the
//! leaders allgatherv the node blocks (recursive doubling, Bruck's for a
//! number of nodes that is not a power of two: [`super`]), and each leader
//! sends the whole result down a binomial tree over its node.
//!
//! **Why.** The flat allgatherv moves `(p − 1)·m` bytes into every rank,
//! so the `L` ranks of a node pull `L·(p − L)·m` through their node's one
//! network link. Here only the leader's exchange crosses it: `(p − L)·m`
//! in (as many out), `L` times less, for `L − 1` receives at the leader and
//! `⌈lg L⌉` broadcast rounds of the `p·m`-byte result inside the node.
//! Whether that pays depends on how fast shared memory is against the
//! link: [`crate::cost`] prices both ([`crate::cost::topology`]).
//!
//! The node blocks travel in node-major order (nodes ordered by their
//! lowest rank, a node's ranks in rank order). With ranks placed in blocks
//! (`mpirun --map-by ppr:L:node`, Slurm's block distribution) that is rank
//! order and the result lands in place; otherwise it is gathered in a
//! scratch buffer (the caller's, kept across calls: [`super::Gathered`])
//! and copied into rank order at the end.

use super::gather_inplace;
use crate::comm::{tags, Elem, Group, Tag, Transport};
use crate::{Error, Result};

const TAG: Tag = tags::NODE_ALLGATHERV;

/// The node structure of a map `nodes[r]` (rank `r`'s node id).
pub(crate) struct Nodes {
    /// Each node's ranks, ascending; nodes ordered by their lowest rank.
    pub(crate) members: Vec<Vec<usize>>,
    /// This rank's node, an index into `members`.
    pub(crate) mine: usize,
}

impl Nodes {
    pub(crate) fn new(nodes: &[usize], rank: usize) -> Self {
        let mut index = std::collections::HashMap::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (r, id) in nodes.iter().enumerate() {
            let i = *index.entry(id).or_insert_with(|| {
                members.push(Vec::new());
                members.len() - 1
            });
            members[i].push(r);
        }
        let mine = index[&nodes[rank]];
        Self { members, mine }
    }

    /// Whether the hierarchy has two levels: several nodes, one of them
    /// with several ranks.
    pub(crate) fn two_level(&self) -> bool {
        self.members.len() > 1 && self.members.iter().any(|m| m.len() > 1)
    }
}

/// The node-aware allgather in place: rank `i`'s block
/// `buf[displs[i]..displs[i + 1]]` is filled on rank `i`, and every block
/// on every rank at the end. `nodes` is the same map on every rank
/// ([`Transport::node_ids`]); with one node, or one rank per node, this is
/// the flat [`gather_inplace`]. `scratch` stages the result where the map
/// is not in blocks (grown to the result's size, never shrunk).
pub(crate) fn node_gather_inplace<C: Transport, T: Elem>(
    comm: &C,
    nodes: &[usize],
    buf: &mut [T],
    displs: &[usize],
    scratch: &mut Vec<T>,
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    if nodes.len() != p {
        return Err(Error::InvalidArgument(format!(
            "node map of {} ranks for a communicator of {p}",
            nodes.len()
        )));
    }
    let layout = Nodes::new(nodes, rank);
    if !layout.two_level() {
        return gather_inplace(comm, buf, displs);
    }
    // Node-major order of the ranks and where each block starts in it.
    let order: Vec<usize> = layout.members.iter().flatten().copied().collect();
    let len = |r: usize| displs[r + 1] - displs[r];
    let mut at = Vec::with_capacity(p + 1);
    at.push(0usize);
    for &r in &order {
        at.push(at[at.len() - 1] + len(r));
    }
    let in_place = order.iter().enumerate().all(|(j, &r)| j == r);
    let stage: &mut [T] = if in_place {
        &mut buf[..displs[p]]
    } else {
        if scratch.len() < displs[p] {
            scratch.resize(displs[p], T::zeroed());
        }
        let j = order
            .iter()
            .position(|&r| r == rank)
            .expect("every rank is in one node");
        scratch[at[j]..at[j + 1]].copy_from_slice(&buf[displs[rank]..displs[rank + 1]]);
        &mut scratch[..displs[p]]
    };
    // Node-major position of a node's first rank, and of each node block.
    let mut first = Vec::with_capacity(layout.members.len() + 1);
    let mut j = 0;
    for m in &layout.members {
        first.push(j);
        j += m.len();
    }
    first.push(p);
    let node_displs: Vec<usize> = first.iter().map(|&j| at[j]).collect();
    let me = layout.mine;
    let members = &layout.members[me];
    let leader = members[0];

    // 1. The node's messages into its leader.
    if rank == leader {
        for (i, &r) in members.iter().enumerate().skip(1) {
            let j = first[me] + i;
            comm.recv(&mut stage[at[j]..at[j + 1]], r, TAG)?;
        }
    } else {
        let j = first[me] + members.iter().position(|&r| r == rank).expect("a member");
        comm.send(&stage[at[j]..at[j + 1]], leader, TAG)?;
    }
    // 2. The leaders' allgatherv of the node blocks.
    if rank == leader {
        let leaders: Vec<usize> = layout.members.iter().map(|m| m[0]).collect();
        let group = Group::new(comm, leaders)?;
        gather_inplace(&group, stage, &node_displs)?;
    }
    // 3. The result down a binomial tree over the node.
    let node = Group::new(comm, members.clone())?;
    let (li, l) = (node.rank(), node.size());
    let mut mask = 1;
    while mask < l {
        if li & mask != 0 {
            node.recv(stage, li - mask, TAG)?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if li + mask < l {
            node.send(stage, li + mask, TAG)?;
        }
        mask >>= 1;
    }
    if !in_place {
        for (j, &r) in order.iter().enumerate() {
            buf[displs[r]..displs[r + 1]].copy_from_slice(&scratch[at[j]..at[j + 1]]);
        }
    }
    Ok(())
}
