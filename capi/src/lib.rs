//! The C ABI of gradsync: `libgradsync.so` / `libgradsync.a` and the header
//! `include/gradsync.h` (generated from this crate by cbindgen), for training
//! programs written in C or C++ or bound through a C FFI.
//!
//! A thin layer over the engine crate: every function converts C arguments
//! into Rust ones, calls [`gradsync_engine`], and turns the result into a
//! `gs_status` code plus a thread-local error text (`gs_last_error`). No
//! synchronization logic lives here.
//!
//! * [`engine`]: the opaque `gs_engine` handle over
//!   [`GradSync`](gradsync_engine::sync::GradSync): create, register layers,
//!   `gs_sync` / `gs_start` / `gs_wait`, step statistics, snapshots.
//! * [`allreduce`]: `gs_allreduce`, the verified dense allreduce on any
//!   communicator, for float and double buffers.
//!
//! Rules every function follows:
//!
//! * MPI is never initialized nor finalized here; the caller owns MPI and
//!   passes communicators, which the library duplicates.
//! * No panic crosses the ABI: each exported function runs inside
//!   `catch_unwind` and reports a panic as `GS_ERR_PANIC` (an engine that
//!   panicked refuses further calls; destroy it).
//! * Collective calls fail collectively: an argument problem one rank finds
//!   locally (a NULL gradient pointer, a wrong layer count, a NULL name)
//!   still enters the call's collectives, so that every rank returns the
//!   same `GS_ERR_RANK_FAILED` naming the failing rank instead of one rank
//!   returning while its peers wait forever.
#![allow(non_camel_case_types)]

pub mod allreduce;
pub mod engine;

use gradsync_engine::Error;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Return codes of the `int`-returning functions.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum gs_status {
    /// Success.
    GS_OK = 0,
    /// A bad argument found on this rank only where no collective can carry
    /// it (a NULL engine, a NULL path for gs_save_snapshot, bad arrays for
    /// gs_wait), or a call out of order (gs_wait without gs_start,
    /// gs_register during a step). Peers are not affected.
    GS_ERR_INVALID = 1,
    /// A collective failure that every rank of the communicator returned
    /// alike in the same call: one rank's bad argument or local failure
    /// (the text names the lowest failing rank and its cause), a layer table
    /// or buffer length that differs across ranks, NaN/Inf in a gradient,
    /// a snapshot that does not load on some rank. Every rank may go on
    /// (the next step runs normally).
    GS_ERR_RANK_FAILED = 2,
    /// An MPI or transport error on this rank (an MPI call that returned an
    /// error code, a message of the wrong length). Peers may be blocked in
    /// a collective: the usual answer is MPI_Abort. (MPI not initialized or
    /// already finalized is GS_ERR_INVALID.)
    GS_ERR_MPI = 3,
    /// A file could not be written or read on this rank (gs_save_snapshot).
    GS_ERR_IO = 4,
    /// A panic inside the library (a bug: please report it with
    /// gs_last_error's text). An engine that panicked refuses further calls.
    GS_ERR_PANIC = 5,
}

/// Element type of a gs_allreduce buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum gs_dtype {
    /// `float` (IEEE binary32).
    GS_FLOAT32 = 0,
    /// `double` (IEEE binary64).
    GS_FLOAT64 = 1,
}

/// Where gs_sync_device's gradient arrays live.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum gs_memory {
    /// Host memory: gs_sync_device is gs_sync.
    GS_MEMORY_HOST = 0,
    /// CUDA device memory (a library built with the cargo feature `cuda`).
    GS_MEMORY_CUDA = 1,
}

/// Allreduce algorithm of gs_allreduce.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum gs_algo {
    /// Rabenseifner's reduce-scatter + allgather (recursive halving and
    /// doubling; any number of ranks).
    GS_ALGO_RABENSEIFNER = 0,
    /// Ring reduce-scatter + allgather (bandwidth-optimal for large buffers).
    GS_ALGO_RING = 1,
    /// The MPI library's own MPI_Allreduce.
    GS_ALGO_MPI = 2,
    /// Node-aware: reduce-scatter within each node (shared memory), allreduce
    /// of each shard across nodes, allgather within the node; the nodes are
    /// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)'s.
    GS_ALGO_HIERARCHICAL = 3,
}

/// Reduction of gs_allreduce.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum gs_op {
    /// Element-wise sum.
    GS_OP_SUM = 0,
    /// Element-wise sum divided by the number of ranks.
    GS_OP_AVERAGE = 1,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// The status code of an engine error: collective errors (every rank
/// returned it) first, then by kind.
pub(crate) fn status_of(e: &Error) -> gs_status {
    if e.is_collective() {
        return gs_status::GS_ERR_RANK_FAILED;
    }
    match e {
        Error::Mpi { .. } | Error::Transport(_) | Error::MessageSize { .. } => {
            gs_status::GS_ERR_MPI
        }
        Error::Io(_) | Error::File { .. } | Error::Snapshot(_) => gs_status::GS_ERR_IO,
        _ => gs_status::GS_ERR_INVALID,
    }
}

/// Store `msg` as this thread's last error (NUL bytes, which C strings
/// cannot hold, become spaces).
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

fn clear_last_error() {
    LAST_ERROR.with(|l| {
        if !l.borrow().as_bytes().is_empty() {
            *l.borrow_mut() = CString::default();
        }
    });
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    format!("panic in gradsync (a bug; please report it): {what}")
}

/// Run the body of an exported function: clears the last error, catches
/// panics, and turns the result into a status code (setting the last error
/// on failure).
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    clear_last_error();
    let status = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => gs_status::GS_OK,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            status_of(&e)
        }
        Err(p) => {
            set_last_error(&panic_text(&*p));
            gs_status::GS_ERR_PANIC
        }
    };
    status as c_int
}

/// Run the body of an exported function that returns a pointer (NULL on
/// failure or panic, with the last error set).
pub(crate) fn guard_ptr<T>(f: impl FnOnce() -> Result<*const T, Error>) -> *const T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            std::ptr::null()
        }
        Err(p) => {
            set_last_error(&panic_text(&*p));
            std::ptr::null()
        }
    }
}

/// `Error::InvalidArgument(msg)`.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// A C string argument as UTF-8 text; `what` names it in errors.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and
/// unchanged for `'a`.
pub(crate) unsafe fn c_text<'a>(p: *const c_char, what: &str) -> Result<&'a str, String> {
    if p.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: `p` is non-null (checked above), so by this function's
    // contract it points to a NUL-terminated string valid and unchanged for
    // `'a`, which is what `CStr::from_ptr` requires.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|e| format!("{what} is not UTF-8: {e}"))
}

/// Text of the last failed call on this thread: what failed and why (for a
/// collective failure, the lowest failing rank and its cause). `""` when the
/// last status-returning call on this thread succeeded; each `int`-returning
/// function clears it on entry. The string belongs to the library and stays
/// valid until the next gradsync call on this thread. Never NULL.
#[no_mangle]
pub extern "C" fn gs_last_error() -> *const c_char {
    // Reading a thread-local cannot panic; no guard needed.
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Version text, e.g. `"gradsync 0.1.0 (Open MPI v4.1.4, ...)"`: the
/// library version and the MPI library it is linked with (compare it with
/// your own `MPI_Get_library_version` when mixing builds). Static; callable
/// before `MPI_Init`. Never NULL.
#[no_mangle]
pub extern "C" fn gs_version() -> *const c_char {
    static VERSION: OnceLock<CString> = OnceLock::new();
    let v = VERSION.get_or_init(|| {
        let mpi = catch_unwind(gradsync_engine::comm::mpi_library_version).unwrap_or_default();
        let mpi = mpi.lines().next().unwrap_or("").trim().to_string();
        let text = if mpi.is_empty() {
            format!("gradsync {}", env!("CARGO_PKG_VERSION"))
        } else {
            format!("gradsync {} ({mpi})", env!("CARGO_PKG_VERSION"))
        };
        CString::new(text.replace('\0', " ")).unwrap_or_default()
    });
    v.as_ptr()
}
