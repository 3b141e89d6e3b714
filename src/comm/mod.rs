//! Transport: the small point-to-point interface every gradsync algorithm is
//! written against.
//!
//! Algorithms in [`crate::dense`] never call MPI directly; they call
//! [`Transport`]. Two implementations ship:
//!
//! * [`MpiComm`]: any rsmpi communicator (`SimpleCommunicator`, a split of it,
//!   ...). It duplicates the user's communicator once so library traffic never
//!   matches application messages, and sets `MPI_ERRORS_RETURN` on the
//!   duplicate so MPI failures come back as [`Error::Mpi`](crate::Error::Mpi).
//! * [`LocalComm`]: an in-process transport (one thread per rank, mailboxes in
//!   shared memory) for fast unit and property tests of the algorithms with any
//!   number of ranks, in the spirit of quinn-proto's in-memory pair.
//!
//! Errors: the transport returns every failure as a value (MPI errors come
//! back as [`Error::Mpi`](crate::Error::Mpi), never through MPI's fatal
//! handler), and [`Transport::abort`] ends the whole job. Collective code
//! over a transport follows one rule, stated in [`agree`]: an error
//! on a subset of ranks reaches every rank in the same collective phase, or
//! the job is aborted; no rank returns alone while a peer waits.
//!
//! The split mirrors Open MPI's `coll/base` (algorithms over the PML) and
//! NCCL's primitives/transport separation.

pub mod agree;
mod cached;
mod group;
mod local;
mod mpi_comm;
mod mpi_lib;
mod mpi_request;
pub(crate) mod small;

pub use group::Group;
pub use local::LocalComm;
pub use mpi_comm::MpiComm;
#[cfg(feature = "cli")]
pub(crate) use mpi_lib::abort_raw;
pub use mpi_lib::{mpi_library_version, mpi_ready};
pub use small::Gathered;

use crate::Result;

pub mod tags;

/// Message tag. Collectives use tags below [`TAG_USER_BASE`] ([`tags`]).
pub type Tag = i32;

/// First tag free for callers that send their own messages over a transport.
pub const TAG_USER_BASE: Tag = 1 << 12;

/// An element type that can travel over any transport: plain old data with an
/// MPI datatype.
pub trait Elem: bytemuck::Pod + mpi::datatype::Equivalence + Send + Sync + 'static {}
impl<T: bytemuck::Pod + mpi::datatype::Equivalence + Send + Sync + 'static> Elem for T {}

/// A pending non-blocking operation. Waiting consumes it; dropping it without
/// waiting also waits (errors are then only logged), so a buffer is never left
/// in use by a forgotten request.
pub trait Request {
    /// Block until the operation has completed.
    fn wait(self) -> Result<()>;
}

/// How a transport's blocking calls wait while the engine's caller
/// computes: by testing their requests and sleeping between tests
/// ([`pause`](Self::pause): `interval`, growing in a long wait to an eighth
/// of the time waited, at most 1 ms), so that a progress thread leaves the
/// CPU to the caller's compute instead of spinning inside MPI. While
/// [`urgent`](Self::set_urgent) is set (the caller itself waits for the
/// result) or during the first `interval` of a wait, they test without
/// sleeping; `urgent` is seen when the current sleep ends.
///
/// Why: an MPI library progresses transfers only while a thread is inside
/// it, and its blocking calls spin. On a CPU with a core per rank (CPU
/// training), a progress thread spinning in `MPI_Wait` halves the caller's
/// backward pass, and overlapping gains nothing; a sleeping one costs at
/// most a pause per transfer round while the caller computes (the
/// network keeps moving what the sockets and shared-memory buffers hold).
/// Horovod's background thread sleeps its cycle time for the same reason.
#[derive(Debug)]
pub struct PoliteWait {
    interval: std::time::Duration,
    urgent: std::sync::atomic::AtomicBool,
}

impl PoliteWait {
    /// Sleep `interval` between tests.
    pub fn new(interval: std::time::Duration) -> Self {
        PoliteWait {
            interval,
            urgent: std::sync::atomic::AtomicBool::new(false),
        }
    }
    /// The first sleep between two tests of a wait (and its spin).
    pub fn interval(&self) -> std::time::Duration {
        self.interval
    }
    /// The sleep after a test of a wait that has lasted `elapsed`: the
    /// interval, growing with the wait to an eighth of its length (at most
    /// [`MAX_BACKOFF`](Self::MAX_BACKOFF), or the interval if larger). A
    /// wait then ends at most an eighth late, and a long transfer (a large
    /// bucket on a slow link) is tested a few hundred times, not thousands:
    /// each test and wake-up takes CPU from the caller's backward pass.
    pub fn pause(&self, elapsed: std::time::Duration) -> std::time::Duration {
        let cap = self.interval.max(Self::MAX_BACKOFF);
        (elapsed / 8).clamp(self.interval, cap)
    }
    /// The longest sleep [`pause`](Self::pause) grows to (unless the
    /// interval is longer): what the sockets of a 1 Gbit/s link hold
    /// (125 KB), so the link does not idle while the thread sleeps.
    pub const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_millis(1);
    /// Set while a thread waits for the result: waits then spin.
    pub fn set_urgent(&self, on: bool) {
        self.urgent.store(on, std::sync::atomic::Ordering::Release);
    }
    /// Whether waits spin now.
    pub fn is_urgent(&self) -> bool {
        self.urgent.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Ends the whole job from one rank without the transport
/// ([`Transport::aborter`]).
#[derive(Clone)]
pub struct Aborter(std::sync::Arc<AbortFn>);

/// What an [`Aborter`] runs: `(code, message)`.
type AbortFn = dyn Fn(i32, &str) + Send + Sync;

impl Aborter {
    /// An aborter running `f(code, msg)`; should `f` return, the process
    /// exits with `code` (at least 1).
    pub fn new(f: impl Fn(i32, &str) + Send + Sync + 'static) -> Self {
        Aborter(std::sync::Arc::new(f))
    }
    /// End the job with `code` and `msg`.
    pub fn abort(&self, code: i32, msg: &str) -> ! {
        (self.0)(code, msg);
        std::process::exit(code.max(1))
    }
}

impl std::fmt::Debug for Aborter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Aborter")
    }
}

/// Point-to-point communication among `size()` ranks.
///
/// Receives are exact: a receive of `buf.len()` elements fails with
/// [`Error::MessageSize`](crate::Error::MessageSize) (or an MPI truncation
/// error) when the matching message has another length. Messages between the
/// same pair of ranks with the same tag are non-overtaking, as in MPI.
pub trait Transport {
    /// Handle of a non-blocking operation.
    type Request: Request;

    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;

    /// Blocking send of `buf` to `dest`.
    fn send<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<()>;
    /// Blocking receive of exactly `buf.len()` elements from `src`.
    fn recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()>;
    /// Combined send to `dest` and receive of exactly `recv.len()` elements from
    /// `src` (`MPI_Sendrecv`); deadlock-free for pairwise exchanges and rings.
    fn sendrecv<T: Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: Tag,
    ) -> Result<()>;

    /// Start a non-blocking send.
    ///
    /// # Safety
    /// `buf` must stay alive and unmodified until the returned request has been
    /// waited on or dropped (the MPI contract of `MPI_Isend`); leaking the
    /// request with `mem::forget` while `buf` is freed is undefined behaviour.
    unsafe fn isend<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<Self::Request>;
    /// Start a non-blocking receive of exactly `buf.len()` elements.
    ///
    /// # Safety
    /// `buf` must stay alive and must not be read or written through any other
    /// path until the returned request has been waited on or dropped.
    unsafe fn irecv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<Self::Request>;

    /// Whether this transport may be driven from a helper thread (the
    /// engine's progress thread) while the thread that created it computes.
    /// For MPI this needs `MPI_THREAD_SERIALIZED` or better.
    fn progress_thread_ok(&self) -> bool {
        true
    }

    /// Make this transport's blocking calls wait politely ([`PoliteWait`])
    /// or, with `None`, the transport's own way (MPI: its blocking calls).
    /// The engine sets it on the transport its progress thread holds.
    /// Transports that never spin ignore it.
    fn set_wait(&mut self, _wait: Option<std::sync::Arc<PoliteWait>>) {}

    /// Synchronize all ranks.
    fn barrier(&self) -> Result<()>;

    /// End the whole job now, on every rank: the last resort of the failure
    /// model ([`crate::comm::agree`]) when an error on some ranks cannot be
    /// agreed on because peers may be blocked in a collective. Prints `msg`
    /// (naming this rank) to stderr first. MPI: `MPI_Abort` on this
    /// communicator, which ends every process of the job with `code`. In
    /// process: marks every rank aborted (their receives fail at once) and
    /// panics on this thread.
    fn abort(&self, code: i32, msg: &str) -> !;

    /// What ends the job from this rank once the transport itself is out
    /// of reach (moved to a thread that died): kept by the engine before
    /// its progress thread takes the transport. By default it prints and
    /// exits the process; MPI's calls `MPI_Abort` on `MPI_COMM_WORLD`, the
    /// in-process transport wakes and fails its peers as
    /// [`abort`](Self::abort) does.
    fn aborter(&self) -> Aborter {
        let (rank, size) = (self.rank(), self.size());
        Aborter::new(move |code, msg| {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr().lock(),
                "gradsync: rank {rank} of {size}: {msg}; exiting (code {code})"
            );
        })
    }

    /// Every rank's node (equal ids share a node and its memory), if this
    /// transport knows them: [`MpiComm::node_ids`] (collective the first
    /// time). `None` in process. The node-aware collectives need it.
    fn node_ids(&self) -> Option<Vec<usize>> {
        None
    }

    /// The MPI library's own `MPI_Allreduce` (sum), out of place, if this
    /// transport has one. `None` means "not available here".
    fn native_allreduce_sum<T: Elem>(&self, _send: &[T], _recv: &mut [T]) -> Option<Result<()>> {
        None
    }

    /// The MPI library's own `MPI_Allreduce` (sum) in place
    /// (`MPI_IN_PLACE`: no copy of the input), if this transport has one.
    /// `None` means "not available here".
    fn native_allreduce_sum_in_place<T: Elem>(&self, _buf: &mut [T]) -> Option<Result<()>> {
        None
    }

    /// The MPI library's own `MPI_Allgatherv` of bytes, if this transport has
    /// one. `counts[i]` bytes from rank `i` land at `displs[i]` in `out`.
    fn native_allgatherv(
        &self,
        _mine: &[u8],
        _out: &mut [u8],
        _counts: &[usize],
        _displs: &[usize],
    ) -> Option<Result<()>> {
        None
    }
}

/// Check a peer rank against the communicator size.
pub(crate) fn check_peer(size: usize, peer: usize) -> Result<()> {
    if peer >= size {
        return Err(crate::Error::InvalidArgument(format!(
            "rank {peer} out of range for a communicator of size {size}"
        )));
    }
    Ok(())
}

/// Ranks per node of a node map (`nodes[r]` = rank `r`'s node) for the
/// cost model's two levels: the largest node's count when the ranks span
/// several nodes, `None` on one node.
pub fn ranks_per_node(nodes: &[usize]) -> Option<usize> {
    let mut counts = std::collections::HashMap::new();
    for &n in nodes {
        *counts.entry(n).or_insert(0usize) += 1;
    }
    (counts.len() > 1).then(|| counts.values().copied().max().unwrap_or(1))
}

#[cfg(test)]
mod polite_tests {
    use super::PoliteWait;
    use std::time::Duration;

    #[test]
    fn pause_grows_with_the_wait_within_its_bounds() {
        let us = Duration::from_micros;
        let w = PoliteWait::new(us(100));
        assert_eq!(w.pause(us(0)), us(100));
        assert_eq!(w.pause(us(800)), us(100));
        assert_eq!(w.pause(us(1600)), us(200));
        assert_eq!(w.pause(us(4000)), us(500));
        assert_eq!(w.pause(Duration::from_secs(5)), PoliteWait::MAX_BACKOFF);
        // An interval above the cap is kept as given.
        let slow = PoliteWait::new(us(5000));
        assert_eq!(slow.pause(us(0)), us(5000));
        assert_eq!(slow.pause(Duration::from_secs(5)), us(5000));
    }
}
