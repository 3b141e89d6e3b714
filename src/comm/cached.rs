//! One duplicate of a caller's communicator, kept for the bindings'
//! one-shot calls (`gradsync.allreduce`, `gs_allreduce`): MPI's attribute
//! caching (MPI-3.1 §6.7), as libraries that take a caller's communicator
//! keep their inner one (PETSc's). The first call on a communicator
//! duplicates it (`MPI_Comm_dup`, collective) and stores the duplicate as
//! an attribute of it; later calls find it there. The caller's
//! `MPI_Comm_free` of its communicator frees the duplicate (the attribute's
//! delete callback), so a handle value that MPI reuses for another
//! communicator never finds a stale duplicate. A duplicate per call cost
//! more than the call's collectives on small arrays
//! (`docs/benchmarks/python.md`, "The fixed cost of a call").
//!
//! At `MPI_Finalize` the standard deletes `MPI_COMM_SELF`'s attributes
//! first, while MPI still works; an attribute there marks the finalization,
//! and a duplicate deleted after the mark (with `MPI_COMM_WORLD` in the
//! library's teardown) is left to MPI instead of freed.
//!
//! A kept duplicate is clean between calls: every call ends its messages,
//! or fails on every rank in its agreement before any data moves
//! (`dense::allreduce_agreed`); an MPI error inside a transfer leaves the
//! job to abort, as before.

use super::mpi_comm::{check_handle, dup_checked, MpiComm};
use super::mpi_request::check;
use crate::{Error, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// `MPI_Finalize` has begun (`MPI_COMM_SELF`'s attributes deleted).
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// The keyval of the kept duplicates, created once per process.
static KEYVAL: OnceLock<std::result::Result<c_int, String>> = OnceLock::new();

const OK: c_int = ffi::MPI_SUCCESS as c_int;

/// The attribute's copy callback: a duplicate of the caller's communicator
/// gets its own kept duplicate when a call uses it (`MPI_COMM_NULL_COPY_FN`,
/// which Open MPI defines as a function and MPICH as a null pointer).
unsafe extern "C" fn no_copy(
    _: ffi::MPI_Comm,
    _: c_int,
    _: *mut c_void,
    _: *mut c_void,
    _: *mut c_void,
    flag: *mut c_int,
) -> c_int {
    // SAFETY: MPI passes a live int to write.
    unsafe { *flag = 0 };
    OK
}

/// The attribute's delete callback: frees the kept duplicate (the caller
/// freed its communicator), or leaves it to MPI once finalization began.
unsafe extern "C" fn free_kept(
    _: ffi::MPI_Comm,
    _: c_int,
    val: *mut c_void,
    _: *mut c_void,
) -> c_int {
    // SAFETY: every value of this keyval is a `Box<MPI_Comm>` that
    // `duplicate_kept` leaked into it, deleted once.
    let mut dup = unsafe { Box::from_raw(val.cast::<ffi::MPI_Comm>()) };
    if FINALIZING.load(Ordering::Acquire) {
        return OK;
    }
    // SAFETY: the duplicate is live and nothing else frees it.
    unsafe { ffi::MPI_Comm_free(&mut *dup) }
}

/// The delete callback of the attribute on `MPI_COMM_SELF`, which
/// `MPI_Finalize` runs first.
unsafe extern "C" fn mark_finalizing(
    _: ffi::MPI_Comm,
    _: c_int,
    _: *mut c_void,
    _: *mut c_void,
) -> c_int {
    FINALIZING.store(true, Ordering::Release);
    OK
}

fn keyval() -> Result<c_int> {
    let made = KEYVAL.get_or_init(|| {
        let create = |delete: ffi::MPI_Comm_delete_attr_function| -> Result<c_int> {
            let mut kv: c_int = 0;
            // SAFETY: both callbacks have MPI's signatures; `kv` is live.
            let rc = unsafe {
                ffi::MPI_Comm_create_keyval(Some(no_copy), delete, &mut kv, std::ptr::null_mut())
            };
            check(rc, "MPI_Comm_create_keyval").map(|()| kv)
        };
        let made = (|| {
            let kept = create(Some(free_kept))?;
            let mark = create(Some(mark_finalizing))?;
            // SAFETY: a constant handle of the linked library; the value is
            // never read.
            let rc =
                unsafe { ffi::MPI_Comm_set_attr(ffi::RSMPI_COMM_SELF, mark, std::ptr::null_mut()) };
            check(rc, "MPI_Comm_set_attr").map(|()| kept)
        })();
        made.map_err(|e| e.to_string())
    });
    made.clone().map_err(Error::Transport)
}

impl MpiComm {
    /// A transport over the duplicate of `raw` kept as an attribute of it
    /// (made by the first call on `raw`: collective over `raw`, as
    /// [`MpiComm::duplicate_raw`]; later calls are local). Dropping the
    /// value frees nothing; the caller's `MPI_Comm_free(raw)` frees the
    /// duplicate. Errors as [`MpiComm::duplicate_raw`].
    ///
    /// Every rank of `raw` must make its first such call at the same point
    /// of its collectives on `raw` (as any collective), and no two threads
    /// may use the kept duplicate at once.
    ///
    /// # Safety
    /// As [`MpiComm::duplicate_raw`]: `raw` is a communicator handle of the
    /// MPI library gradsync was built against.
    pub unsafe fn duplicate_kept(raw: ffi::MPI_Comm) -> Result<Self> {
        check_handle(raw)?;
        let kv = keyval()?;
        let mut val: *mut c_void = std::ptr::null_mut();
        let mut found: c_int = 0;
        // SAFETY: `raw` is a valid handle (the contract); MPI writes the
        // attribute's value (a pointer) into `val`.
        let rc = unsafe {
            ffi::MPI_Comm_get_attr(raw, kv, (&mut val as *mut *mut c_void).cast(), &mut found)
        };
        check(rc, "MPI_Comm_get_attr")?;
        if found != 0 {
            // SAFETY: the value is the live `Box<MPI_Comm>` set below; its
            // duplicate lives until `raw` is freed.
            return Ok(unsafe { MpiComm::borrow_raw(*val.cast::<ffi::MPI_Comm>()) });
        }
        // SAFETY: as this function's contract.
        let mut dup = unsafe { dup_checked(raw) }?;
        let boxed = Box::into_raw(Box::new(dup));
        // SAFETY: `raw` is valid; the value is the box, freed by `free_kept`.
        let rc = unsafe { ffi::MPI_Comm_set_attr(raw, kv, boxed.cast()) };
        if let Err(e) = check(rc, "MPI_Comm_set_attr") {
            // SAFETY: not stored: the box and the duplicate are still ours.
            unsafe {
                drop(Box::from_raw(boxed));
                ffi::MPI_Comm_free(&mut dup);
            }
            return Err(e);
        }
        // SAFETY: the duplicate is live until `raw` is freed.
        Ok(unsafe { MpiComm::borrow_raw(dup) })
    }
}
