//! Every message tag gradsync's collectives use, in one place, so that no
//! two algorithms can match each other's messages on the same communicator
//! (each also runs on its own duplicated communicator, and all tags lie
//! below [`TAG_USER_BASE`](super::TAG_USER_BASE), which callers that send
//! their own messages over a transport start from).

use super::Tag;

/// The in-process transport's dissemination barrier.
pub const BARRIER: Tag = 10;
/// Length, dtype, algorithm agreements of the dense collectives.
pub const VALIDATE: Tag = 11;
/// Rabenseifner allreduce.
pub const RABENSEIFNER: Tag = 12;
/// Ring allreduce.
pub const RING: Tag = 13;
/// Recursive-doubling allgatherv.
pub const ALLGATHERV: Tag = 14;
/// GradiVeQ's compressed-domain ring.
pub const GRADIVEQ: Tag = 15;
/// The QSGD ring GradiVeQ is compared with.
pub const QSGD_RING: Tag = 16;
/// The sparse allreduce (Ok-Topk split-and-reduce,
/// [`crate::sparse::allreduce`]): its agreement and pairwise exchange.
pub const SPARSE_ALLREDUCE: Tag = 17;
/// The hierarchical sparse allreduce ([`crate::sparse::hierarchical`]):
/// its agreement, the node's gather of pairs and broadcast of node units.
pub const SPARSE_HIERARCHICAL: Tag = 18;
/// The node-aware allgatherv ([`crate::dense::AllgathervAlgo::Node`]):
/// the node's messages into its leader and the result down its node.
pub const NODE_ALLGATHERV: Tag = 19;
/// The engine's layer-table and options agreement.
pub const TABLE: Tag = 21;
/// The failure model's agreement ([`crate::comm::agree::agree`]).
pub const AGREE: Tag = 23;
/// The host-staged allreduce of a device buffer
/// ([`crate::gpu::staged_allreduce`]): its agreement on length and options.
pub const GPU_STAGING: Tag = 24;
/// `gradsync calibrate`'s ping-pong latency probe.
pub const CALIBRATE_PINGPONG: Tag = 77;
/// `gradsync calibrate`'s pairwise exchange probe.
pub const CALIBRATE_EXCHANGE: Tag = 78;

/// Every tag above, for the distinctness test.
pub const ALL: [Tag; 15] = [
    BARRIER,
    VALIDATE,
    RABENSEIFNER,
    RING,
    ALLGATHERV,
    GRADIVEQ,
    QSGD_RING,
    SPARSE_ALLREDUCE,
    SPARSE_HIERARCHICAL,
    NODE_ALLGATHERV,
    TABLE,
    AGREE,
    GPU_STAGING,
    CALIBRATE_PINGPONG,
    CALIBRATE_EXCHANGE,
];

#[cfg(test)]
mod tests {
    #[test]
    fn tags_are_distinct_and_below_the_user_base() {
        let mut t = super::ALL.to_vec();
        t.sort_unstable();
        t.dedup();
        assert_eq!(t.len(), super::ALL.len(), "two collectives share a tag");
        assert!(t
            .iter()
            .all(|&x| (0..super::super::TAG_USER_BASE).contains(&x)));
    }
}
