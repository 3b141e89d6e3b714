//! Allgatherv of variable-length byte messages: every rank ends with every
//! rank's message, in rank order. Empty messages are fine.
//!
//! `p` a power of two: recursive doubling (Thakur–Rabenseifner–Gropp §4.1):
//! each step exchanges the gathered range with the partner at XOR distance
//! `2^i`, a contiguous run of ranks, in place in the output buffer. Any
//! other `p`: Bruck's algorithm (Bruck et al. 1997; Thakur et al. §4.1's
//! choice for non-powers of two): at distance `d = 1, 2, 4, …` rank `r`
//! sends the first `s = min(d, p − d)` messages it holds, `r … r + s − 1`, to
//! `r − d` and receives `r + d …` from `r + d`, in the output buffer in
//! rank-relative order, which one rotation puts in rank order at the end.
//! Both take `⌈lg p⌉` steps and move `(p − 1)·m` bytes into each rank (the
//! fold of the first `2r` ranks into pairs, which this used before for
//! non-powers of two, moved about `2(p − 1)·m`: half the messages twice,
//! then the whole result once more). Message lengths are gathered the same
//! way first.
//!
//! [`AllgathervAlgo::Node`] runs the node-aware version on a job that
//! spans several nodes ([`node`]): one rank per node crosses the network.

mod node;

use crate::comm::small::gather_inplace;
pub use crate::comm::Gathered;
use crate::comm::Transport;
use crate::{Error, Result};
pub(crate) use node::node_gather_inplace;
use serde::{Deserialize, Serialize};

/// Which allgatherv implementation to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllgathervAlgo {
    /// Recursive doubling for a power of two ranks, Bruck's algorithm for
    /// any other number (any transport; module docs).
    #[serde(rename = "recdbl")]
    #[default]
    RecursiveDoubling,
    /// The MPI library's own `MPI_Allgatherv` (only on [`MpiComm`](crate::comm::MpiComm)).
    Mpi,
    /// Node-aware (`node`): gather to each node's leader, the leaders'
    /// allgatherv, a broadcast inside each node, by the transport's node
    /// map ([`Transport::node_ids`]). Where the transport has no node map
    /// (in process), an [`Error::Unsupported`] saying the node-aware
    /// allgatherv needs the ranks' nodes, on every rank before any
    /// collective; never the flat algorithm in its place. With one node, or
    /// one rank per node, the hierarchy has one level and the algorithm is
    /// the flat `recdbl` one (recursive doubling or Bruck) itself.
    Node,
}

impl AllgathervAlgo {
    /// Every algorithm.
    pub const ALL: [AllgathervAlgo; 3] = [
        AllgathervAlgo::RecursiveDoubling,
        AllgathervAlgo::Mpi,
        AllgathervAlgo::Node,
    ];

    /// Name as used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::RecursiveDoubling => "recdbl",
            Self::Mpi => "mpi",
            Self::Node => "node",
        }
    }
}

impl std::fmt::Display for AllgathervAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AllgathervAlgo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "recdbl" | "recursive-doubling" => Ok(Self::RecursiveDoubling),
            "mpi" => Ok(Self::Mpi),
            "node" => Ok(Self::Node),
            _ => Err(Error::InvalidArgument(format!(
                "unknown allgatherv algorithm {s:?} (recdbl, mpi, node)"
            ))),
        }
    }
}

/// Gather every rank's `mine` on every rank.
///
/// ```
/// use gradsync::comm::{LocalComm, Transport};
/// use gradsync::dense::{allgatherv, AllgathervAlgo};
/// let out = LocalComm::run(3, |c| {
///     let msg = vec![c.rank() as u8; c.rank()]; // rank 0 sends nothing
///     allgatherv(&c, &msg, AllgathervAlgo::RecursiveDoubling).unwrap()
/// });
/// assert_eq!(out[0].data, vec![1, 2, 2]);
/// assert_eq!(out[2].message(2), &[2, 2]);
/// ```
pub fn allgatherv<C: Transport>(comm: &C, mine: &[u8], algo: AllgathervAlgo) -> Result<Gathered> {
    let mut g = Gathered::default();
    allgatherv_with(comm, mine, algo, &mut g)?;
    Ok(g)
}

/// [`allgatherv`] into a reusable [`Gathered`].
pub fn allgatherv_with<C: Transport>(
    comm: &C,
    mine: &[u8],
    algo: AllgathervAlgo,
    out: &mut Gathered,
) -> Result<()> {
    match algo {
        AllgathervAlgo::Node => {
            let nodes = comm.node_ids();
            allgatherv_nodes_with(comm, mine, nodes.as_deref(), out)
        }
        _ => gather_with(comm, mine, algo, None, out),
    }
}

/// The node-aware [`allgatherv_with`] by the node map `nodes` (the same on
/// every rank: the engine's agreed map); an error without one (never the
/// flat allgatherv in its place). Nodes that make no second level (one
/// node, or a rank per node) run its one-level case, which is the flat one.
pub(crate) fn allgatherv_nodes_with<C: Transport>(
    comm: &C,
    mine: &[u8],
    nodes: Option<&[usize]>,
    out: &mut Gathered,
) -> Result<()> {
    gather_with(comm, mine, AllgathervAlgo::Node, nodes, out)
}

fn no_node_map() -> Error {
    Error::Unsupported(
        "the node-aware allgatherv needs the ranks' nodes (an MPI communicator); \
         this transport has none"
            .into(),
    )
}

fn gather_with<C: Transport>(
    comm: &C,
    mine: &[u8],
    algo: AllgathervAlgo,
    nodes: Option<&[usize]>,
    out: &mut Gathered,
) -> Result<()> {
    if algo == AllgathervAlgo::Node && nodes.is_none() {
        // Before any collective: every rank's transport answers alike.
        return Err(no_node_map());
    }
    let p = comm.size();
    // 1. Lengths: one u64 per rank, gathered by the same algorithm; the
    // displacements.
    let own = out.gather_lengths(comm, mine.len())?;
    // 2. The payload.
    match algo {
        AllgathervAlgo::RecursiveDoubling => {
            out.data[own.clone()].copy_from_slice(mine);
            gather_inplace(comm, &mut out.data, &out.displs)
        }
        AllgathervAlgo::Node => {
            out.data[own.clone()].copy_from_slice(mine);
            match nodes {
                Some(nodes) => {
                    node_gather_inplace(comm, nodes, &mut out.data, &out.displs, &mut out.scratch)
                }
                None => Err(no_node_map()),
            }
        }
        AllgathervAlgo::Mpi => {
            out.counts.clear();
            out.counts
                .extend(out.displs.windows(2).map(|w| w[1] - w[0]));
            comm.native_allgatherv(mine, &mut out.data, &out.counts, &out.displs[..p])
                .ok_or_else(|| {
                    Error::Unsupported("this transport has no MPI-native allgatherv".into())
                })?
        }
    }
}
