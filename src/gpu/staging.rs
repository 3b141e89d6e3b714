//! Host staging of a device buffer's allreduce, for an MPI that does not
//! take device pointers.
//!
//! The buffer is reduced in chunks through two host staging slots (pinned
//! memory on a GPU): the copy of chunk `i+1` to the host runs while chunk
//! `i` is allreduced, and the copy of chunk `i` back to the device runs
//! while chunk `i+1` is. The logic is I/O-free in the quinn-proto manner:
//!
//! * [`schedule`] is the pipeline as a plain sequence of [`Action`]s, with
//!   no memory and no communication, so its ordering is unit-tested alone;
//! * [`DeviceCopies`] is the one thing the pipeline needs from a device:
//!   asynchronous chunk copies on one in-order queue, fences, host slots;
//! * [`HostMemory`] implements it on host memory with *deferred* copies (a
//!   copy happens only when a fence at or after it is waited on, or at the
//!   synchronize), the way a CUDA stream behaves, so a missing wait in the
//!   pipeline shows as wrong data in tests instead of passing by luck; the
//!   CUDA implementation (`CudaStaging`, feature `cuda`) is the
//!   same contract over a stream, events and pinned buffers;
//! * [`staged_allreduce`] drives the schedule over a [`Transport`].
//!
//! The failure model ([`crate::comm::agree`]) holds: the length, the chunk
//! size, the algorithm and the operation are agreed on first (a mismatch is
//! an error on every rank, not a hang); a copy that fails on one rank does
//! not stop it: it goes on reducing zeros so its peers never wait alone,
//! and every rank then returns [`Error::RankFailed`] naming it. An error of
//! the transport inside a chunk's allreduce is returned as the dense
//! collectives return it (the peers may be blocked: a caller that cannot
//! return on every rank aborts the job, as the engine does).

use crate::comm::agree::{agree, agree_args, fnv, FNV_OFFSET};
use crate::comm::{tags, MpiComm, Transport};
use crate::dense::{allreduce_with, AllreduceAlgo, AllreduceOptions, ReduceOp, Workspace};
use crate::{Error, Result};
use mpi::topology::Communicator;
use serde::Serialize;
use std::collections::VecDeque;
use std::ops::Range;

/// Host staging slots the pipeline uses: one being reduced, one being
/// filled.
pub const SLOTS: usize = 2;

/// Default chunk: 1 Mi elements (4 MiB of f32), large enough that a copy
/// and an allreduce of it are bandwidth-bound, small enough to overlap.
pub const DEFAULT_CHUNK_ELEMS: usize = 1 << 20;

/// One step of the staging pipeline ([`schedule`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start copying device elements `range` (chunk `chunk`) into host slot
    /// `slot`.
    ToHost {
        /// Chunk index.
        chunk: usize,
        /// Device elements.
        range: Range<usize>,
        /// Host slot.
        slot: usize,
    },
    /// Wait until the copy of chunk `chunk` into slot `slot` has completed.
    WaitToHost {
        /// Chunk index.
        chunk: usize,
        /// Host slot.
        slot: usize,
    },
    /// Allreduce the first `len` elements of host slot `slot` (chunk
    /// `chunk`).
    Reduce {
        /// Chunk index.
        chunk: usize,
        /// Host slot.
        slot: usize,
        /// Elements.
        len: usize,
    },
    /// Start copying host slot `slot` back over device elements `range`.
    ToDevice {
        /// Chunk index.
        chunk: usize,
        /// Device elements.
        range: Range<usize>,
        /// Host slot.
        slot: usize,
    },
    /// Wait until every copy issued has completed.
    Synchronize,
}

/// The pipeline for a buffer of `n` elements in chunks of `chunk` (> 0)
/// elements, for a device whose copies complete in issue order (one
/// stream): chunk `i` lives in slot `i % 2`; the copy of chunk `i+1` to
/// the host is issued before chunk `i` is reduced, and the copy of chunk
/// `i` back to the device after. Slot reuse is safe by issue order: the
/// copy of chunk `i+2` into a slot is issued after the copy of chunk `i`
/// out of it.
pub fn schedule(n: usize, chunk: usize) -> impl Iterator<Item = Action> {
    assert!(chunk > 0, "schedule: chunk must be positive");
    let k = n.div_ceil(chunk);
    let range = move |i: usize| i * chunk..((i + 1) * chunk).min(n);
    let to_host = move |i: usize| Action::ToHost {
        chunk: i,
        range: range(i),
        slot: i % SLOTS,
    };
    let first = (k > 0).then(|| to_host(0));
    let body = (0..k).flat_map(move |i| {
        [
            Some(Action::WaitToHost {
                chunk: i,
                slot: i % SLOTS,
            }),
            (i + 1 < k).then(|| to_host(i + 1)),
            Some(Action::Reduce {
                chunk: i,
                slot: i % SLOTS,
                len: range(i).len(),
            }),
            Some(Action::ToDevice {
                chunk: i,
                range: range(i),
                slot: i % SLOTS,
            }),
        ]
        .into_iter()
        .flatten()
    });
    first
        .into_iter()
        .chain(body)
        .chain(std::iter::once(Action::Synchronize))
}

/// A device buffer of `f32` and the host staging memory of its
/// allreduce: what [`staged_allreduce`] needs from a device.
///
/// Contract: copies are asynchronous and complete in the order they were
/// started (one CUDA stream); a slot's contents are defined only after the
/// copy into it has been waited on; errors of an asynchronous copy may
/// surface only at [`wait`](Self::wait) or [`synchronize`](Self::synchronize).
pub trait DeviceCopies {
    /// Marks the completion of one copy to the host.
    type Fence;
    /// Elements of the device buffer.
    fn len(&self) -> usize;
    /// Whether the device buffer is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Make `slots` host slots of at least `elems` elements each available
    /// (pinned allocation on a GPU; kept across calls).
    fn prepare(&mut self, slots: usize, elems: usize) -> Result<()>;
    /// Host slot `slot` (after [`prepare`](Self::prepare)); the caller
    /// reads and writes it only when no copy into or out of it is pending.
    fn slot(&mut self, slot: usize) -> Result<&mut [f32]>;
    /// Start copying device elements `range` into the first `range.len()`
    /// elements of host slot `slot`.
    fn start_to_host(&mut self, range: Range<usize>, slot: usize) -> Result<Self::Fence>;
    /// Start copying the first `range.len()` elements of host slot `slot`
    /// over device elements `range`.
    fn start_to_device(&mut self, slot: usize, range: Range<usize>) -> Result<()>;
    /// Block until the copy that returned `fence` (and every copy started
    /// before it) has completed.
    fn wait(&mut self, fence: Self::Fence) -> Result<()>;
    /// Block until every copy started has completed.
    fn synchronize(&mut self) -> Result<()>;

    /// The direct route ([`device_allreduce`]): make a scratch buffer of
    /// at least `elems` elements available, in the memory the buffer is in
    /// (kept across calls).
    fn prepare_direct(&mut self, elems: usize) -> Result<()>;
    /// The direct route: wait until all work on the buffer has completed
    /// (the MPI library does not order itself after a stream), then return
    /// the address of elements `range` and of the scratch, for MPI.
    fn direct_ptrs(&mut self, range: Range<usize>) -> Result<(*const f32, *mut f32)>;
    /// The direct route: copy the scratch's first `range.len()` elements
    /// over elements `range`; completed on return.
    fn commit_direct(&mut self, range: Range<usize>) -> Result<()>;
}

/// Options of [`staged_allreduce`]; must be the same on every rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StagingOptions {
    /// Elements per chunk (> 0).
    pub chunk_elems: usize,
    /// The allreduce of each chunk.
    pub algo: AllreduceAlgo,
    /// Sum or average.
    pub op: ReduceOp,
}

impl Default for StagingOptions {
    fn default() -> Self {
        StagingOptions {
            chunk_elems: DEFAULT_CHUNK_ELEMS,
            algo: AllreduceAlgo::Mpi,
            op: ReduceOp::Sum,
        }
    }
}

/// How a device buffer's allreduce reaches MPI ([`Route::choose`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    /// Through host staging slots ([`staged_allreduce`]).
    #[default]
    Staged,
    /// Device addresses handed to a CUDA-aware MPI's blocking
    /// `MPI_Allreduce` (Open MPI 4.x takes device buffers in blocking
    /// collectives only), chunk by chunk through a device scratch chunk.
    Direct,
}

impl Route {
    /// Direct when MPI takes device pointers (`aware`, from
    /// [`super::cuda_aware`]) and the options ask for MPI's own sum;
    /// otherwise staged: gradsync's own algorithms reduce on the host, and
    /// the average needs a scaling on the device (no device kernels yet).
    pub fn choose(aware: bool, opts: &StagingOptions) -> Route {
        if aware && opts.algo == AllreduceAlgo::Mpi && opts.op == ReduceOp::Sum {
            Route::Direct
        } else {
            Route::Staged
        }
    }
}

/// What [`staged_allreduce`] or [`device_allreduce`] did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StagingReport {
    /// The route taken.
    pub route: Route,
    /// Elements reduced.
    pub elems: usize,
    /// Chunks.
    pub chunks: usize,
    /// Elements per chunk (the last may be shorter).
    pub chunk_elems: usize,
}

/// Largest chunk: one MPI call's count is a C `int`.
const MAX_CHUNK: usize = 1 << 30;

/// The collective start of both routes: the rank-local checks and
/// allocations, then one agreement on them, the length, the options and
/// the route. Returns the chunk length.
fn agree_start<C: Transport, D: DeviceCopies>(
    comm: &C,
    dev: &mut D,
    opts: &StagingOptions,
    route: Route,
) -> Result<usize> {
    let n = dev.len();
    let chunk = opts.chunk_elems.min(n).max(1);
    let local = if opts.chunk_elems == 0 || opts.chunk_elems > MAX_CHUNK {
        Err(Error::InvalidArgument(format!(
            "device allreduce: chunk_elems must be in 1..={MAX_CHUNK}, not {}",
            opts.chunk_elems
        )))
    } else {
        match route {
            Route::Staged => dev.prepare(SLOTS, chunk),
            Route::Direct => dev.prepare_direct(chunk),
        }
    };
    let print = fnv(
        fnv(FNV_OFFSET, &(opts.chunk_elems as u64).to_le_bytes()),
        format!("{}/{:?}/{route:?}", opts.algo.name(), opts.op).as_bytes(),
    );
    let what = || {
        format!(
            "device allreduce options differ: this rank has chunk {} elements, {} {:?}, route {route:?}",
            opts.chunk_elems,
            opts.algo.name(),
            opts.op
        )
    };
    agree_args(comm, tags::GPU_STAGING, local, n, &[(print, &what)])?;
    Ok(chunk)
}

/// Allreduce (sum or average) of a device buffer through host staging
/// slots, in chunks, with the device↔host copies overlapped with the
/// chunks' allreduces ([`schedule`]). Collective: every rank calls it with
/// the same length and options. The result equals [`allreduce_with`] of
/// the whole buffer with the same algorithm element for element (each
/// element is reduced by the same algorithm over the same ranks; with
/// `AllreduceAlgo::Mpi`, it is `MPI_Allreduce` of each chunk).
///
/// Errors (on every rank alike): different lengths ([`Error::SizeMismatch`]),
/// different options ([`Error::ArgumentMismatch`]), a bad option or a
/// staging allocation or copy that failed on some rank
/// ([`Error::RankFailed`]). On an error the device buffer's contents are
/// unspecified.
pub fn staged_allreduce<C: Transport, D: DeviceCopies>(
    comm: &C,
    dev: &mut D,
    opts: &StagingOptions,
) -> Result<StagingReport> {
    let chunk = agree_start(comm, dev, opts, Route::Staged)?;
    run_staged(comm, dev, opts, chunk)
}

/// The allreduce of a device buffer by the route [`Route::choose`] picks
/// for `aware` (whether MPI takes device pointers: [`super::cuda_aware`]):
/// [`staged_allreduce`], or, for a CUDA-aware MPI and `MPI_Allreduce`'s
/// sum, the device addresses straight to MPI, one chunk at a time into a
/// device scratch chunk copied back over the buffer (written before the
/// engine's host path passed `MPI_IN_PLACE`; not yet changed, as it can
/// only be checked on a GPU with a CUDA-aware MPI). Collective; the ranks' routes are agreed on with the
/// length and options, so ranks that decided differently (different
/// `GRADSYNC_CUDA_AWARE`) get [`Error::ArgumentMismatch`] on every rank.
/// Errors as [`staged_allreduce`].
pub fn device_allreduce<C: Communicator, D: DeviceCopies>(
    comm: &MpiComm<C>,
    dev: &mut D,
    opts: &StagingOptions,
    aware: bool,
) -> Result<StagingReport> {
    let route = Route::choose(aware, opts);
    let chunk = agree_start(comm, dev, opts, route)?;
    if route == Route::Staged {
        return run_staged(comm, dev, opts, chunk);
    }
    let n = dev.len();
    let mut failed: Option<Error> = None;
    let (mut zeros, mut out) = (Vec::<f32>::new(), Vec::<f32>::new());
    let mut report = StagingReport {
        route,
        elems: n,
        chunks: 0,
        chunk_elems: chunk,
    };
    for start in (0..n).step_by(chunk) {
        let range = start..(start + chunk).min(n);
        let len = range.len();
        report.chunks += 1;
        let ptrs = if failed.is_none() {
            dev.direct_ptrs(range.clone())
                .map_err(|e| failed = Some(e))
                .ok()
        } else {
            None
        };
        match ptrs {
            // SAFETY: the device's addresses of `range` and of its scratch
            // (at least `chunk` elements, `prepare_direct`), with no copy
            // pending on them (`direct_ptrs` waited), for a CUDA-aware MPI.
            Some((send, recv)) => unsafe { comm.allreduce_sum_f32_raw(send, recv, len)? },
            None => {
                // A failed rank keeps its peers company with zeros.
                zeros.clear();
                zeros.resize(len, 0.0);
                out.resize(len, 0.0);
                // SAFETY: two distinct host buffers of `len` elements.
                unsafe { comm.allreduce_sum_f32_raw(zeros.as_ptr(), out.as_mut_ptr(), len)? }
            }
        }
        if failed.is_none() {
            if let Err(e) = dev.commit_direct(range) {
                failed = Some(e);
            }
        }
    }
    agree(comm, failed.map_or(Ok(()), Err))?;
    Ok(report)
}

/// The staged pipeline after the agreement.
fn run_staged<C: Transport, D: DeviceCopies>(
    comm: &C,
    dev: &mut D,
    opts: &StagingOptions,
    chunk: usize,
) -> Result<StagingReport> {
    let n = dev.len();
    let ropts = AllreduceOptions {
        op: opts.op,
        validate: false,
        chunk_elems: 0,
    };
    let mut ws = Workspace::new();
    let mut fences: [Option<D::Fence>; SLOTS] = std::array::from_fn(|_| None);
    let mut failed: Option<Error> = None;
    let mut zeros: Vec<f32> = Vec::new();
    let mut report = StagingReport {
        route: Route::Staged,
        elems: n,
        chunks: 0,
        chunk_elems: chunk,
    };
    for action in schedule(n, chunk) {
        match action {
            Action::ToHost { range, slot, .. } => {
                if failed.is_none() {
                    match dev.start_to_host(range, slot) {
                        Ok(f) => fences[slot] = Some(f),
                        Err(e) => failed = Some(e),
                    }
                }
            }
            Action::WaitToHost { slot, .. } => {
                if let Some(f) = fences[slot].take() {
                    if let Err(e) = dev.wait(f) {
                        failed.get_or_insert(e);
                    }
                }
            }
            Action::Reduce { slot, len, .. } => {
                report.chunks += 1;
                // A failed rank reduces zeros, never a slot a copy may
                // still be writing, and keeps its peers company.
                let mut buf = None;
                if failed.is_none() {
                    match dev.slot(slot) {
                        Ok(s) => buf = Some(&mut s[..len]),
                        Err(e) => failed = Some(e),
                    }
                }
                let buf = match buf {
                    Some(b) => b,
                    None => {
                        zeros.clear();
                        zeros.resize(len, 0.0);
                        &mut zeros[..]
                    }
                };
                allreduce_with(comm, buf, opts.algo, &ropts, &mut ws)?;
            }
            Action::ToDevice { range, slot, .. } => {
                if failed.is_none() {
                    if let Err(e) = dev.start_to_device(slot, range) {
                        failed = Some(e);
                    }
                }
            }
            Action::Synchronize => {
                if failed.is_none() {
                    if let Err(e) = dev.synchronize() {
                        failed = Some(e);
                    }
                }
            }
        }
    }
    agree(comm, failed.map_or(Ok(()), Err))?;
    Ok(report)
}

/// [`DeviceCopies`] on host memory, for tests and for checking the
/// pipeline without a GPU: the "device" is a `Vec<f32>`, and copies are
/// deferred, as on a stream: a copy runs only when a fence at or after it
/// is waited on, or at [`synchronize`](DeviceCopies::synchronize). It
/// counts hazards (a slot handed out while a copy into or out of it is
/// still pending) and can be told to fail one copy.
#[derive(Debug, Default)]
pub struct HostMemory {
    data: Vec<f32>,
    slots: Vec<Vec<f32>>,
    scratch: Vec<f32>,
    queue: VecDeque<(u64, Copy)>,
    issued: u64,
    fail_copy: Option<u64>,
    hazards: usize,
    max_pending: usize,
}

#[derive(Debug)]
enum Copy {
    ToHost(Range<usize>, usize),
    ToDevice(usize, Range<usize>),
    FromScratch(Range<usize>),
}

impl HostMemory {
    /// A "device" buffer holding `data`.
    pub fn new(data: Vec<f32>) -> Self {
        HostMemory {
            data,
            ..Default::default()
        }
    }

    /// Make copy number `index` (0-based, in issue order, both directions)
    /// fail when it runs.
    pub fn fail_copy(mut self, index: u64) -> Self {
        self.fail_copy = Some(index);
        self
    }

    /// The "device" buffer.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The "device" buffer, taken back.
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// Slots handed out while a copy into or out of them was pending
    /// (0 for a correct pipeline).
    pub fn hazards(&self) -> usize {
        self.hazards
    }

    /// Most copies pending at once (2 or more: copies overlapped with
    /// reductions).
    pub fn max_pending(&self) -> usize {
        self.max_pending
    }

    fn push(&mut self, c: Copy) -> u64 {
        let id = self.issued;
        self.issued += 1;
        self.queue.push_back((id, c));
        self.max_pending = self.max_pending.max(self.queue.len());
        id
    }

    /// Run the pending copies up to and including `upto`.
    fn run_until(&mut self, upto: u64) -> Result<()> {
        while self.queue.front().is_some_and(|(id, _)| *id <= upto) {
            let (id, c) = self.queue.pop_front().expect("checked");
            if self.fail_copy == Some(id) {
                self.queue.clear();
                return Err(Error::Device(format!(
                    "staging copy {id} failed (injected by HostMemory::fail_copy)"
                )));
            }
            match c {
                Copy::ToHost(r, s) => {
                    let len = r.len();
                    self.slots[s][..len].copy_from_slice(&self.data[r]);
                }
                Copy::ToDevice(s, r) => {
                    let len = r.len();
                    self.data[r].copy_from_slice(&self.slots[s][..len]);
                }
                Copy::FromScratch(r) => {
                    let len = r.len();
                    self.data[r].copy_from_slice(&self.scratch[..len]);
                }
            }
        }
        Ok(())
    }

    fn check(&self, range: &Range<usize>, slot: usize) -> Result<()> {
        if range.end > self.data.len() || slot >= self.slots.len() {
            return Err(Error::InvalidArgument(format!(
                "staging copy of {range:?} via slot {slot}: the buffer has {} elements, {} slots",
                self.data.len(),
                self.slots.len()
            )));
        }
        if range.len() > self.slots[slot].len() {
            return Err(Error::InvalidArgument(format!(
                "staging copy of {} elements into a slot of {}",
                range.len(),
                self.slots[slot].len()
            )));
        }
        Ok(())
    }
}

impl DeviceCopies for HostMemory {
    type Fence = u64;

    fn len(&self) -> usize {
        self.data.len()
    }

    fn prepare(&mut self, slots: usize, elems: usize) -> Result<()> {
        if self.slots.len() < slots {
            self.slots.resize(slots, Vec::new());
        }
        for s in &mut self.slots {
            if s.len() < elems {
                // NaN: a slot read before its copy ran shows in the result.
                s.resize(elems, f32::NAN);
            }
        }
        Ok(())
    }

    fn slot(&mut self, slot: usize) -> Result<&mut [f32]> {
        if self.queue.iter().any(|(_, c)| match c {
            Copy::ToHost(_, s) | Copy::ToDevice(s, _) => *s == slot,
            Copy::FromScratch(_) => false,
        }) {
            self.hazards += 1;
        }
        self.slots
            .get_mut(slot)
            .map(|s| &mut s[..])
            .ok_or_else(|| Error::InvalidArgument(format!("no staging slot {slot}")))
    }

    fn start_to_host(&mut self, range: Range<usize>, slot: usize) -> Result<u64> {
        self.check(&range, slot)?;
        Ok(self.push(Copy::ToHost(range, slot)))
    }

    fn start_to_device(&mut self, slot: usize, range: Range<usize>) -> Result<()> {
        self.check(&range, slot)?;
        self.push(Copy::ToDevice(slot, range));
        Ok(())
    }

    fn wait(&mut self, fence: u64) -> Result<()> {
        self.run_until(fence)
    }

    fn synchronize(&mut self) -> Result<()> {
        self.run_until(u64::MAX)
    }

    fn prepare_direct(&mut self, elems: usize) -> Result<()> {
        if self.scratch.len() < elems {
            self.scratch.resize(elems, f32::NAN);
        }
        Ok(())
    }

    fn direct_ptrs(&mut self, range: Range<usize>) -> Result<(*const f32, *mut f32)> {
        self.run_until(u64::MAX)?;
        if range.end > self.data.len() || range.len() > self.scratch.len() {
            return Err(Error::InvalidArgument(format!(
                "direct allreduce of {range:?}: the buffer has {} elements, the scratch {}",
                self.data.len(),
                self.scratch.len()
            )));
        }
        Ok((self.data[range].as_ptr(), self.scratch.as_mut_ptr()))
    }

    fn commit_direct(&mut self, range: Range<usize>) -> Result<()> {
        if range.end > self.data.len() || range.len() > self.scratch.len() {
            return Err(Error::InvalidArgument(format!(
                "direct commit of {range:?}: the buffer has {} elements, the scratch {}",
                self.data.len(),
                self.scratch.len()
            )));
        }
        let id = self.push(Copy::FromScratch(range));
        self.run_until(id)
    }
}

#[cfg(test)]
mod tests;
