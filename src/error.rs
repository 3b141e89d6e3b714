//! The crate's one error type.
//!
//! Every fallible call in gradsync returns [`Result`]. Collectives are written so
//! that an error detected by one rank is either detected by every rank (size
//! validation) or surfaces as a transport error instead of a hang or garbage.

/// Errors returned by gradsync.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Ranks passed buffers of different lengths to the same collective.
    /// Returned on *every* rank when validation is on.
    #[error("size mismatch across ranks: this rank passed {local} elements, ranks passed between {min} and {max}")]
    SizeMismatch {
        /// Length passed on this rank.
        local: u64,
        /// Smallest length passed by any rank.
        min: u64,
        /// Largest length passed by any rank.
        max: u64,
    },
    /// A point-to-point message did not have the length the algorithm expected.
    #[error("message from rank {peer} (tag {tag}) has {got} elements, expected {expected}")]
    MessageSize {
        /// Sending rank.
        peer: usize,
        /// Message tag.
        tag: i32,
        /// Elements the receiver expected.
        expected: usize,
        /// Elements that arrived (or a lower bound when MPI truncated).
        got: usize,
    },
    /// An MPI call returned an error code (gradsync sets `MPI_ERRORS_RETURN` on
    /// its own duplicated communicator, so MPI errors come back as values).
    #[error("MPI error in {call}: {message} (code {code})")]
    Mpi {
        /// The MPI function that failed.
        call: &'static str,
        /// MPI's error code.
        code: i32,
        /// MPI's error string.
        message: String,
    },
    /// A transport-level failure that is not an MPI error code (in-process
    /// transport timeouts, peers that went away).
    #[error("transport error: {0}")]
    Transport(String),
    /// A caller passed something that cannot work (rank out of range, too many
    /// elements for one MPI call, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The transport cannot do what was asked (e.g. MPI-native collectives on
    /// the in-process transport).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An encoded message is corrupt, truncated, or does not fit the buffer
    /// it is decoded into. Decoders return this instead of panicking.
    #[error("decode error: {0}")]
    Decode(String),
    /// A peer's fused message, or one layer's unit in it, is corrupt or
    /// truncated. Names the sending rank and the layer.
    #[error("bad message from rank {rank}, layer {layer:?}: {reason}")]
    PeerMessage {
        /// Rank whose message is bad.
        rank: usize,
        /// Layer name (`"<fused header>"` for the message framing).
        layer: String,
        /// What is wrong.
        reason: String,
    },
    /// Ranks disagree on the synchronization engine's layer table (names,
    /// shapes, strategies, options). Returned on every rank.
    #[error("layer table differs across ranks: {0}")]
    TableMismatch(String),
    /// A gradient held NaN or Inf and the engine's policy is to fail. Returned
    /// on every rank.
    #[error("non-finite gradient in layer {layer:?} {}", match .rank { Some(r) => format!("from rank {r}"), None => "(found in the allreduced result)".to_string() })]
    NonFinite {
        /// The rank whose gradient was bad, when known.
        rank: Option<usize>,
        /// Layer name.
        layer: String,
    },
    /// A snapshot file is unreadable, from another version, or from another
    /// layer table or rank.
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// I/O error (CLI and reports).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// JSON (de)serialization error.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
}

/// `Result<T, gradsync::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
