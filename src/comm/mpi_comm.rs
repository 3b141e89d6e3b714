//! [`Transport`] over any rsmpi communicator, through `mpi::ffi` so that every
//! MPI return code is checked (rsmpi's safe calls rely on the fatal error
//! handler) and non-blocking requests need no rsmpi scope.

use super::mpi_lib::{abort_raw, in_place_constant, mpi_ready};
use super::mpi_request::{check, wait_all, MpiRequest};
use super::{check_peer, Elem, PoliteWait, Request, Tag, Transport};
use crate::{Error, Result};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};
use std::mem::MaybeUninit;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

/// Largest element count moved by one MPI call (`Count` is a C `int`); longer
/// blocking transfers are split into several messages.
const MAX_COUNT: usize = 1 << 30;

/// A gradsync transport over an rsmpi communicator.
///
/// Build it with [`MpiComm::duplicate_of`] (recommended: library traffic gets its
/// own communicator, and MPI errors on it are returned, not fatal) or
/// [`MpiComm::wrap`] (use a communicator as it is). Drop it before the rsmpi
/// `Universe`, as any communicator.
///
/// ```no_run
/// use mpi::traits::*;
/// let universe = mpi::initialize().unwrap();
/// let world = universe.world();
/// let comm = gradsync::comm::MpiComm::duplicate_of(&world).unwrap();
/// let mut grad = vec![1.0f32; 1000];
/// gradsync::dense::rabenseifner_allreduce(&comm, &mut grad, &Default::default()).unwrap();
/// assert_eq!(grad[0], world.size() as f32);
/// ```
pub struct MpiComm<C: Communicator = SimpleCommunicator> {
    /// `ManuallyDrop` so that [`Drop`] can leak it once MPI is finalized
    /// (freeing a communicator after `MPI_Finalize` is erroneous; a Python
    /// engine may be collected after mpi4py's `atexit` finalized MPI).
    comm: std::mem::ManuallyDrop<C>,
    raw: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    /// [`MpiComm::node_ids`], once measured.
    nodes: std::sync::OnceLock<Vec<usize>>,
    /// `Some`: blocking calls are immediate ones waited on politely
    /// ([`Transport::set_wait`]); `None`: MPI's blocking calls.
    wait: Option<Arc<PoliteWait>>,
    /// Dropping the value frees the communicator (false for
    /// [`MpiComm::borrow_raw`]'s).
    owned: bool,
}

// SAFETY: an MPI communicator handle is a process-wide reference that any
// thread may use within the MPI threading level; gradsync moves a communicator
// to its progress thread only when the level is at least
// `MPI_THREAD_SERIALIZED` (see `Transport::progress_thread_ok`) and never uses
// one from two threads at once.
unsafe impl<C: Communicator> Send for MpiComm<C> {}

impl MpiComm<SimpleCommunicator> {
    /// Duplicate `comm` (`MPI_Comm_dup`, collective over `comm`) and set
    /// `MPI_ERRORS_RETURN` on the duplicate.
    pub fn duplicate_of<C: Communicator>(comm: &C) -> Result<Self> {
        let dup = comm.duplicate();
        let raw = dup.as_raw();
        // SAFETY: `raw` is a live communicator handle owned by `dup`.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
        check(rc, "MPI_Comm_set_errhandler")?;
        Ok(Self::wrap(dup))
    }

    /// Duplicate a raw `MPI_Comm` handle (from C, or from mpi4py through
    /// `MPI_Comm_f2c`) and own the duplicate; the caller's handle is never
    /// freed. Errors, instead of MPI's fatal handler, when MPI is not
    /// initialized or already finalized (gradsync never initializes MPI),
    /// when `raw` is `MPI_COMM_NULL`, or when it is an inter-communicator.
    ///
    /// # Safety
    /// `raw` must be a communicator handle of the MPI library gradsync was
    /// built against (any valid handle, including `MPI_COMM_WORLD`).
    pub unsafe fn duplicate_raw(raw: ffi::MPI_Comm) -> Result<Self> {
        // SAFETY: as this function's contract.
        let dup = unsafe { dup_checked(raw) }?;
        // SAFETY: `dup` is a live intra-communicator that only this value
        // owns; rsmpi frees it on drop.
        Ok(Self::wrap(unsafe {
            <SimpleCommunicator as mpi::raw::FromRaw>::from_raw(dup)
        }))
    }

    /// A transport over `dup`, a duplicate that something else owns and
    /// frees (the attribute of [`super::cached`]): dropping it frees nothing.
    ///
    /// # Safety
    /// `dup` is a live intra-communicator that outlives the value.
    pub(super) unsafe fn borrow_raw(dup: ffi::MPI_Comm) -> Self {
        // SAFETY: as this function's contract; never freed here (`owned`).
        let mut c = Self::wrap(unsafe { <SimpleCommunicator as mpi::raw::FromRaw>::from_raw(dup) });
        c.owned = false;
        c
    }
}

/// `Ok` when MPI is initialized and not finalized and `raw` is not
/// `MPI_COMM_NULL` (which MPI's fatal handler would meet first).
pub(super) fn check_handle(raw: ffi::MPI_Comm) -> Result<()> {
    mpi_ready()?;
    // SAFETY: reading a constant handle of the linked MPI library.
    if raw == unsafe { ffi::RSMPI_COMM_NULL } {
        return Err(Error::InvalidArgument(
            "the communicator is MPI_COMM_NULL".into(),
        ));
    }
    Ok(())
}

/// Duplicate a raw handle (`MPI_Comm_dup`, collective over `raw`) with
/// `MPI_ERRORS_RETURN` on the duplicate, which the caller owns. Errors,
/// instead of MPI's fatal handler, when MPI is not initialized or already
/// finalized, when `raw` is `MPI_COMM_NULL`, or when it is an
/// inter-communicator.
///
/// # Safety
/// `raw` is a communicator handle of the MPI library gradsync was built
/// against.
pub(super) unsafe fn dup_checked(raw: ffi::MPI_Comm) -> Result<ffi::MPI_Comm> {
    check_handle(raw)?;
    let mut inter: c_int = 0;
    // SAFETY: `raw` is a valid handle (the caller's contract); `inter`
    // is a live int.
    let rc = unsafe { ffi::MPI_Comm_test_inter(raw, &mut inter) };
    check(rc, "MPI_Comm_test_inter")?;
    if inter != 0 {
        return Err(Error::InvalidArgument(
            "inter-communicators are not supported: pass an intra-communicator".into(),
        ));
    }
    // SAFETY: reading a constant handle of the linked MPI library.
    let mut dup = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: `raw` is a valid intra-communicator (checked above);
    // `dup` is a live handle to write.
    check(unsafe { ffi::MPI_Comm_dup(raw, &mut dup) }, "MPI_Comm_dup")?;
    // SAFETY: `dup` was just created; the handler is a library constant.
    let rc = unsafe { ffi::MPI_Comm_set_errhandler(dup, ffi::RSMPI_ERRORS_RETURN) };
    if let Err(e) = check(rc, "MPI_Comm_set_errhandler") {
        // SAFETY: `dup` is ours and not used after this.
        unsafe { ffi::MPI_Comm_free(&mut dup) };
        return Err(e);
    }
    Ok(dup)
}

impl<C: Communicator> Drop for MpiComm<C> {
    fn drop(&mut self) {
        let mut fin: c_int = 0;
        // SAFETY: MPI_Finalized may be called at any time.
        unsafe { ffi::MPI_Finalized(&mut fin) };
        if fin == 0 && self.owned {
            // SAFETY: dropped exactly once, here.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.comm) };
        }
        // Else leak it: MPI already released every communicator (or, not
        // owned, its owner frees it).
    }
}

impl<C: Communicator> MpiComm<C> {
    /// Use `comm` as it is: no duplication, its error handler untouched.
    pub fn wrap(comm: C) -> Self {
        let raw = comm.as_raw();
        let rank = comm.rank() as usize;
        let size = comm.size() as usize;
        MpiComm {
            comm: std::mem::ManuallyDrop::new(comm),
            raw,
            rank,
            size,
            nodes: std::sync::OnceLock::new(),
            wait: None,
            owned: true,
        }
    }

    /// The underlying rsmpi communicator.
    pub fn communicator(&self) -> &C {
        &self.comm
    }

    /// Every rank's node, as the lowest rank of its node
    /// (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`: the ranks that share
    /// memory), for the node-aware collectives
    /// ([`crate::dense::hierarchical_allreduce`]). Collective the first
    /// time (every rank must call it); kept for the later calls.
    pub fn node_ids(&self) -> Vec<usize> {
        self.nodes.get_or_init(|| self.measure_node_ids()).clone()
    }

    fn measure_node_ids(&self) -> Vec<usize> {
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        let shared = self.comm.split_shared(self.rank as i32);
        let me = self.rank as u64;
        let mut leader = 0u64;
        shared.all_reduce_into(&me, &mut leader, SystemOperation::min());
        let mut all = vec![0u64; self.size];
        self.comm.all_gather_into(&leader, &mut all[..]);
        all.into_iter().map(|x| x as usize).collect()
    }

    /// `MPI_Isend` of `buf` to `dest` (a rank or `MPI_PROC_NULL`).
    ///
    /// # Safety
    /// `buf` must stay alive and unwritten until the request completes.
    unsafe fn start_isend<T: Elem>(
        &self,
        buf: &[T],
        dest: c_int,
        tag: Tag,
    ) -> Result<ffi::MPI_Request> {
        // SAFETY: reading a constant of the linked MPI library.
        let mut raw = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: pointer and count describe `buf`, kept alive and
        // unwritten until completion (this function's contract).
        let rc = unsafe {
            ffi::MPI_Isend(
                buf.as_ptr() as *const c_void,
                buf.len() as c_int,
                dtype::<T>(),
                dest,
                tag,
                self.raw,
                &mut raw,
            )
        };
        check(rc, "MPI_Isend")?;
        Ok(raw)
    }

    /// `MPI_Irecv` into `buf` from `src` (a rank or `MPI_PROC_NULL`).
    ///
    /// # Safety
    /// `buf` must stay alive and untouched until the request completes.
    unsafe fn start_irecv<T: Elem>(
        &self,
        buf: &mut [T],
        src: c_int,
        tag: Tag,
    ) -> Result<ffi::MPI_Request> {
        // SAFETY: reading a constant of the linked MPI library.
        let mut raw = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: pointer and count describe `buf`, kept alive and
        // untouched until completion (this function's contract).
        let rc = unsafe {
            ffi::MPI_Irecv(
                buf.as_mut_ptr() as *mut c_void,
                buf.len() as c_int,
                dtype::<T>(),
                src,
                tag,
                self.raw,
                &mut raw,
            )
        };
        check(rc, "MPI_Irecv")?;
        Ok(raw)
    }

    /// One `MPI_Sendrecv` as an `MPI_Irecv` and an `MPI_Isend` waited on
    /// together ([`wait_all`]), for a transport that waits politely.
    /// `sdest` or `rsrc` may be `MPI_PROC_NULL`.
    fn sendrecv_immediate<T: Elem>(
        &self,
        s: &[T],
        sdest: c_int,
        r: &mut [T],
        rsrc: c_int,
        tag: Tag,
    ) -> Result<()> {
        // SAFETY: reading a constant of the linked MPI library.
        let proc_null = unsafe { ffi::RSMPI_PROC_NULL };
        // SAFETY: `r` is borrowed mutably until the request completes below
        // (or is cancelled and completed).
        let recv = unsafe { self.start_irecv(r, rsrc, tag) }?;
        // SAFETY: `s` is borrowed until the request completes below.
        let send = match unsafe { self.start_isend(s, sdest, tag) } {
            Ok(req) => req,
            Err(e) => {
                let mut recv = recv;
                // SAFETY: `recv` is the active receive started above; it is
                // cancelled and completed before `r` is released.
                unsafe {
                    ffi::MPI_Cancel(&mut recv);
                    ffi::MPI_Wait(&mut recv, ffi::RSMPI_STATUS_IGNORE);
                }
                return Err(e);
            }
        };
        let mut reqs = [recv, send];
        let mut status = [MaybeUninit::<ffi::MPI_Status>::uninit(); 2];
        wait_all(self.wait.as_deref(), &mut reqs, &mut status)?;
        if rsrc != proc_null {
            // SAFETY: the receive completed and MPI filled its status.
            let st = unsafe { status[0].assume_init_ref() };
            check_count::<T>(st, r.len(), rsrc as usize, tag)?;
        }
        Ok(())
    }

    /// Run one collective: its blocking call, or, for a transport that
    /// waits politely, its immediate form (`MPI_I...`) waited on with
    /// [`wait_all`]. Each closure makes the MPI call and returns its code.
    fn collective(
        &self,
        blocking: impl FnOnce() -> c_int,
        blocking_call: &'static str,
        immediate: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
        immediate_call: &'static str,
    ) -> Result<()> {
        if self.wait.is_none() {
            return check(blocking(), blocking_call);
        }
        // SAFETY: reading a constant of the linked MPI library.
        let mut req = [unsafe { ffi::RSMPI_REQUEST_NULL }];
        check(immediate(&mut req[0]), immediate_call)?;
        wait_all(self.wait.as_deref(), &mut req, &mut [MaybeUninit::uninit()])
    }

    fn raw_recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()> {
        if self.wait.is_some() {
            // SAFETY: `buf` is borrowed mutably until the request, waited
            // on here, completes.
            return unsafe { self.irecv(buf, src, tag) }?.wait();
        }
        let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
        // SAFETY: buffer pointer/count describe `buf`; status is written by MPI.
        let rc = unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr() as *mut c_void,
                buf.len() as c_int,
                dtype::<T>(),
                src as c_int,
                tag,
                self.raw,
                status.as_mut_ptr(),
            )
        };
        check(rc, "MPI_Recv")?;
        // SAFETY: MPI_Recv succeeded and filled the status.
        check_count::<T>(unsafe { &status.assume_init() }, buf.len(), src, tag)
    }
}

fn dtype<T: Elem>() -> ffi::MPI_Datatype {
    T::equivalent_datatype().as_raw()
}

fn check_count<T: Elem>(
    status: &ffi::MPI_Status,
    expected: usize,
    src: usize,
    tag: Tag,
) -> Result<()> {
    let mut count: c_int = 0;
    // SAFETY: status comes from a completed receive.
    let rc = unsafe { ffi::MPI_Get_count(status, dtype::<T>(), &mut count) };
    check(rc, "MPI_Get_count")?;
    if count < 0 || count as usize != expected {
        return Err(Error::MessageSize {
            peer: src,
            tag,
            expected,
            got: count.max(0) as usize,
        });
    }
    Ok(())
}

impl<C: Communicator> MpiComm<C> {
    /// `MPI_Allreduce` (sum) of `n ≤ 2^30` `f32` from `send` into `recv`
    /// (distinct buffers), which may be device addresses when the MPI
    /// library is CUDA-aware ([`crate::gpu`]'s direct route). `n` must be
    /// the same on every rank (callers agree on it first).
    ///
    /// # Safety
    /// `send` and `recv` must be valid for `n` elements for the MPI library
    /// (host memory, or device memory with a CUDA-aware MPI), not
    /// overlapping, and not used otherwise during the call.
    pub(crate) unsafe fn allreduce_sum_f32_raw(
        &self,
        send: *const f32,
        recv: *mut f32,
        n: usize,
    ) -> Result<()> {
        if n > MAX_COUNT {
            return Err(Error::InvalidArgument(format!(
                "allreduce of {n} elements exceeds the {MAX_COUNT}-element limit of one MPI call"
            )));
        }
        // Blocking even for a transport that waits politely: Open MPI 4's
        // CUDA-aware support covers point-to-point and the blocking
        // collectives, not the non-blocking ones (its FAQ, "Which MPI APIs
        // work with CUDA-aware?"), and these may be device buffers.
        // SAFETY: the caller's contract: `send` and `recv` address `n`
        // floats each (device or host memory MPI can reach).
        let rc = unsafe {
            ffi::MPI_Allreduce(
                buf_ptr(send as *const u8, n),
                buf_ptr(recv as *const u8, n) as *mut c_void,
                n as c_int,
                dtype::<f32>(),
                ffi::RSMPI_SUM,
                self.raw,
            )
        };
        check(rc, "MPI_Allreduce")
    }
}

/// Pointer for an MPI buffer argument. An empty slice's dangling pointer can
/// equal Open MPI's `MPI_IN_PLACE` (`(void*)1` for `u8`), which collectives
/// would misread; empty buffers get a pointer to a real static byte instead.
fn buf_ptr(ptr: *const u8, len: usize) -> *const c_void {
    static DUMMY: [u64; 1] = [0];
    if len == 0 {
        DUMMY.as_ptr() as *const c_void
    } else {
        ptr as *const c_void
    }
}

fn check_immediate_len(len: usize) -> Result<()> {
    if len > MAX_COUNT {
        return Err(Error::InvalidArgument(format!(
            "non-blocking transfer of {len} elements exceeds the {MAX_COUNT}-element limit of one MPI call"
        )));
    }
    Ok(())
}

impl<C: Communicator> Transport for MpiComm<C> {
    type Request = MpiRequest;

    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn progress_thread_ok(&self) -> bool {
        mpi::environment::threading_support() >= mpi::Threading::Serialized
    }

    fn abort(&self, code: i32, msg: &str) -> ! {
        // Not eprintln!: it panics on a closed stderr, and a panic here
        // would leave the peers waiting instead of ending the job.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr().lock(),
            "gradsync: rank {} of {}: {msg}; aborting the job (MPI_Abort, code {code})",
            self.rank,
            self.size
        );
        // SAFETY: `raw` is this transport's live communicator.
        unsafe { abort_raw(self.raw, code) }
    }

    fn aborter(&self) -> super::Aborter {
        let (rank, size) = (self.rank, self.size);
        super::Aborter::new(move |code, msg| {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr().lock(),
                "gradsync: rank {rank} of {size}: {msg}; aborting the job \
                 (MPI_Abort on MPI_COMM_WORLD, code {code})"
            );
            // After MPI_Finalize no MPI call but a few may be made: then
            // there is no job left to end, only this process.
            let mut finalized: c_int = 0;
            // SAFETY: MPI_Finalized may be called at any time; `finalized`
            // is a live int.
            unsafe { ffi::MPI_Finalized(&mut finalized) };
            if finalized != 0 {
                std::process::exit(code.max(1));
            }
            // SAFETY: MPI is initialized (this transport was built on it)
            // and not finalized (checked above); `MPI_COMM_WORLD` is a valid
            // handle then. The transport's own communicator may have been
            // freed with the thread that held it.
            unsafe { abort_raw(ffi::RSMPI_COMM_WORLD, code) }
        })
    }

    fn send<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<()> {
        check_peer(self.size, dest)?;
        let mut chunks = buf.chunks(MAX_COUNT);
        // A zero-length message must still be sent: the receiver expects one.
        let first = chunks.next().unwrap_or(&[]);
        for part in std::iter::once(first).chain(chunks) {
            if self.wait.is_some() {
                // SAFETY: `part` is borrowed until the request, waited on
                // here, completes.
                unsafe { self.isend(part, dest, tag) }?.wait()?;
                continue;
            }
            // SAFETY: pointer/count describe `part`.
            let rc = unsafe {
                ffi::MPI_Send(
                    part.as_ptr() as *const c_void,
                    part.len() as c_int,
                    dtype::<T>(),
                    dest as c_int,
                    tag,
                    self.raw,
                )
            };
            check(rc, "MPI_Send")?;
        }
        Ok(())
    }

    fn recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()> {
        check_peer(self.size, src)?;
        if buf.is_empty() {
            return self.raw_recv(buf, src, tag);
        }
        for part in buf.chunks_mut(MAX_COUNT) {
            self.raw_recv(part, src, tag)?;
        }
        Ok(())
    }

    fn sendrecv<T: Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: Tag,
    ) -> Result<()> {
        check_peer(self.size, dest)?;
        check_peer(self.size, src)?;
        let ns = send.len().div_ceil(MAX_COUNT).max(1);
        let nr = recv.len().div_ceil(MAX_COUNT).max(1);
        for i in 0..ns.max(nr) {
            let s: &[T] = if i < ns {
                &send[(i * MAX_COUNT).min(send.len())..((i + 1) * MAX_COUNT).min(send.len())]
            } else {
                &[]
            };
            let rlo = (i * MAX_COUNT).min(recv.len());
            let rhi = ((i + 1) * MAX_COUNT).min(recv.len());
            let r = &mut recv[rlo..rhi];
            let (sdest, rsrc) = (
                if i < ns {
                    dest as c_int
                } else {
                    // SAFETY: reading a constant of the linked MPI library.
                    unsafe { ffi::RSMPI_PROC_NULL }
                },
                if i < nr {
                    src as c_int
                } else {
                    // SAFETY: as above.
                    unsafe { ffi::RSMPI_PROC_NULL }
                },
            );
            if self.wait.is_some() {
                self.sendrecv_immediate(s, sdest, r, rsrc, tag)?;
                continue;
            }
            let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
            // SAFETY: pointers/counts describe `s` and `r`, which do not overlap.
            let rc = unsafe {
                ffi::MPI_Sendrecv(
                    s.as_ptr() as *const c_void,
                    s.len() as c_int,
                    dtype::<T>(),
                    sdest,
                    tag,
                    r.as_mut_ptr() as *mut c_void,
                    r.len() as c_int,
                    dtype::<T>(),
                    rsrc,
                    tag,
                    self.raw,
                    status.as_mut_ptr(),
                )
            };
            check(rc, "MPI_Sendrecv")?;
            if i < nr {
                // SAFETY: MPI_Sendrecv succeeded and filled the status.
                check_count::<T>(unsafe { &status.assume_init() }, r.len(), src, tag)?;
            }
        }
        Ok(())
    }

    unsafe fn isend<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<MpiRequest> {
        check_peer(self.size, dest)?;
        check_immediate_len(buf.len())?;
        // SAFETY: the caller keeps `buf` alive and unwritten until the
        // request completes (this method's contract).
        let raw = unsafe { self.start_isend(buf, dest as c_int, tag) }?;
        Ok(MpiRequest {
            raw,
            recv_check: None,
            done: false,
            wait: self.wait.clone(),
        })
    }

    unsafe fn irecv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<MpiRequest> {
        check_peer(self.size, src)?;
        check_immediate_len(buf.len())?;
        // SAFETY: the caller keeps `buf` alive and untouched until the
        // request completes (this method's contract).
        let raw = unsafe { self.start_irecv(buf, src as c_int, tag) }?;
        Ok(MpiRequest {
            raw,
            recv_check: Some((buf.len(), dtype::<T>(), src, tag)),
            done: false,
            wait: self.wait.clone(),
        })
    }

    fn set_wait(&mut self, wait: Option<Arc<PoliteWait>>) {
        self.wait = wait;
    }

    fn barrier(&self) -> Result<()> {
        if self.wait.is_none() {
            // SAFETY: live communicator.
            return check(unsafe { ffi::MPI_Barrier(self.raw) }, "MPI_Barrier");
        }
        // SAFETY: reading a constant of the linked MPI library.
        let mut req = [unsafe { ffi::RSMPI_REQUEST_NULL }];
        // SAFETY: live communicator; `req` is a live handle to write.
        let rc = unsafe { ffi::MPI_Ibarrier(self.raw, &mut req[0]) };
        check(rc, "MPI_Ibarrier")?;
        wait_all(self.wait.as_deref(), &mut req, &mut [MaybeUninit::uninit()])
    }

    fn node_ids(&self) -> Option<Vec<usize>> {
        Some(MpiComm::node_ids(self))
    }

    fn native_allreduce_sum<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Option<Result<()>> {
        if send.len() != recv.len() {
            return Some(Err(Error::InvalidArgument(format!(
                "allreduce send ({}) and receive ({}) lengths differ",
                send.len(),
                recv.len()
            ))));
        }
        let mut run = || -> Result<()> {
            for (s, r) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
                let n = s.len() as c_int;
                let (s, r) = (
                    buf_ptr(s.as_ptr() as *const u8, s.len()),
                    buf_ptr(r.as_mut_ptr() as *const u8, r.len()) as *mut c_void,
                );
                self.collective(
                    // SAFETY: pointers/counts describe the chunks `s` and `r`.
                    || unsafe {
                        ffi::MPI_Allreduce(s, r, n, dtype::<T>(), ffi::RSMPI_SUM, self.raw)
                    },
                    "MPI_Allreduce",
                    // SAFETY: as above; the request completes before the
                    // chunks' borrows end.
                    |req| unsafe {
                        ffi::MPI_Iallreduce(s, r, n, dtype::<T>(), ffi::RSMPI_SUM, self.raw, req)
                    },
                    "MPI_Iallreduce",
                )?;
            }
            Ok(())
        };
        Some(run())
    }

    fn native_allreduce_sum_in_place<T: Elem>(&self, buf: &mut [T]) -> Option<Result<()>> {
        // Not with polite waits (`MPI_Iallreduce`): Open MPI 4.1.4's
        // non-blocking allreduce in place took 4x its out-of-place time at
        // 64 MiB (49 against 12 ms at p = 2; blocking, in place was the
        // faster: 20.7 against 24.5 ms), so that path copies instead.
        if self.wait.is_some() {
            return None;
        }
        let in_place = in_place_constant()?;
        let mut run = || -> Result<()> {
            for r in buf.chunks_mut(MAX_COUNT) {
                let n = r.len() as c_int;
                let r = buf_ptr(r.as_mut_ptr() as *const u8, r.len()) as *mut c_void;
                // SAFETY: `r` and `n` describe the chunk, read and written
                // in place; `in_place` is the linked library's
                // `MPI_IN_PLACE` (`in_place_constant`).
                let rc = unsafe {
                    ffi::MPI_Allreduce(in_place, r, n, dtype::<T>(), ffi::RSMPI_SUM, self.raw)
                };
                check(rc, "MPI_Allreduce")?;
            }
            Ok(())
        };
        Some(run())
    }

    fn native_allgatherv(
        &self,
        mine: &[u8],
        out: &mut [u8],
        counts: &[usize],
        displs: &[usize],
    ) -> Option<Result<()>> {
        let run = || -> Result<()> {
            let to_int = |v: usize| {
                c_int::try_from(v).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "MPI_Allgatherv counts and displacements must fit in a C int, got {v}"
                    ))
                })
            };
            if counts.len() != self.size || displs.len() != self.size {
                return Err(Error::InvalidArgument(
                    "counts/displs must have one entry per rank".into(),
                ));
            }
            if counts[self.rank] != mine.len() {
                return Err(Error::InvalidArgument(
                    "counts[rank] must equal this rank's message length".into(),
                ));
            }
            for (c, d) in counts.iter().zip(displs) {
                if d.checked_add(*c).is_none_or(|end| end > out.len()) {
                    return Err(Error::InvalidArgument(
                        "allgatherv output buffer too small".into(),
                    ));
                }
            }
            let ci: Vec<c_int> = counts.iter().map(|&c| to_int(c)).collect::<Result<_>>()?;
            let di: Vec<c_int> = displs.iter().map(|&d| to_int(d)).collect::<Result<_>>()?;
            to_int(out.len())?;
            let (m, n) = (buf_ptr(mine.as_ptr(), mine.len()), mine.len() as c_int);
            let o = buf_ptr(out.as_ptr(), out.len()) as *mut c_void;
            // SAFETY: reading a constant of the linked MPI library.
            let u8t = unsafe { ffi::RSMPI_UINT8_T };
            self.collective(
                // SAFETY: counts/displs checked against `out`; `mine`
                // matches counts[rank].
                || unsafe {
                    ffi::MPI_Allgatherv(m, n, u8t, o, ci.as_ptr(), di.as_ptr(), u8t, self.raw)
                },
                "MPI_Allgatherv",
                // SAFETY: as above; `ci`, `di` and the buffers outlive the
                // request, completed before returning.
                |req| unsafe {
                    ffi::MPI_Iallgatherv(m, n, u8t, o, ci.as_ptr(), di.as_ptr(), u8t, self.raw, req)
                },
                "MPI_Iallgatherv",
            )
        };
        Some(run())
    }
}
