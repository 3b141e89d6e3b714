//! The linked MPI library itself, apart from any communicator: whether it
//! is initialized, its version string, its `MPI_IN_PLACE` (checked against
//! the library found at run time), and `MPI_Abort` with the launcher given a
//! moment to forward what the rank printed.

use mpi::ffi;
use std::os::raw::{c_char, c_int, c_void};

use crate::{Error, Result};

// `src/comm/in_place.c`, built by build.rs against the MPI library's mpi.h.
extern "C" {
    /// The linked MPI library's `MPI_IN_PLACE`.
    fn gradsync_mpi_in_place() -> *mut c_void;
}

/// The linked MPI library's `MPI_IN_PLACE`, or `None` (the caller copies
/// instead) where the value the shim was built with does not match the
/// library found at run time: Open MPI's is `(void *) 1`, MPICH's (and its
/// derivatives') `(void *) -1`, and a build whose `mpi.h` was another
/// library's than the one linked would pass a wild pointer as a buffer.
pub(super) fn in_place_constant() -> Option<*const c_void> {
    static OK: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let v = *OK.get_or_init(|| {
        // SAFETY: a function of this crate's C shim returning a constant.
        let v = unsafe { gradsync_mpi_in_place() } as usize;
        let lib = mpi_library_version();
        let expected = if lib.contains("Open MPI") {
            Some(1usize)
        } else if lib.contains("MPICH") {
            Some(usize::MAX)
        } else {
            None
        };
        match expected {
            Some(e) if e != v => {
                log::warn!(
                    "MPI_IN_PLACE built as {v:#x} does not match the linked library ({lib}): \
                     the mpi allreduce copies instead (rebuild gradsync against this MPI)"
                );
                None
            }
            _ => {
                log::debug!("the mpi allreduce passes MPI_IN_PLACE = {v:#x} ({lib})");
                Some(v)
            }
        }
    });
    v.map(|v| v as *const c_void)
}

/// `Ok` when MPI is initialized and not finalized; otherwise an error that
/// says so (gradsync never initializes or finalizes MPI itself).
pub fn mpi_ready() -> Result<()> {
    let (mut init, mut fin): (c_int, c_int) = (0, 0);
    // SAFETY: both calls may be made at any time, before MPI_Init and after
    // MPI_Finalize.
    unsafe {
        ffi::MPI_Initialized(&mut init);
        ffi::MPI_Finalized(&mut fin);
    }
    if init == 0 {
        return Err(Error::InvalidArgument(
            "MPI is not initialized: initialize it first (MPI_Init_thread, or `from mpi4py import MPI`); gradsync never initializes MPI".into(),
        ));
    }
    if fin != 0 {
        return Err(Error::InvalidArgument("MPI is already finalized".into()));
    }
    Ok(())
}

/// The `MPI_Get_library_version` string of the MPI library gradsync is
/// linked with (callable before `MPI_Init`), to check that a caller (e.g.
/// mpi4py) uses the same library.
pub fn mpi_library_version() -> String {
    let mut buf = vec![0 as c_char; ffi::MPI_MAX_LIBRARY_VERSION_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_LIBRARY_VERSION_STRING characters.
    unsafe {
        ffi::MPI_Get_library_version(buf.as_mut_ptr(), &mut len);
    }
    let bytes: Vec<u8> = buf[..len.max(0) as usize]
        .iter()
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes)
        .trim_end_matches(['\0', '\n', ' '])
        .to_string()
}

/// `MPI_Abort(comm, code)` after the launcher has had a moment to forward
/// what this rank printed: MPICH's Hydra kills the job's processes at once
/// and drops output it has not forwarded yet (seen: the rank's message and
/// MPICH's own "Abort(1)" line both lost in 1 of 8 jobs). Ends the process
/// even if `MPI_Abort` returns.
///
/// # Safety
/// MPI is initialized and not finalized, and `comm` is a live communicator.
pub(crate) unsafe fn abort_raw(comm: ffi::MPI_Comm, code: c_int) -> ! {
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // SAFETY: as the caller promises; MPI_Abort does not return when it
    // succeeds.
    unsafe { ffi::MPI_Abort(comm, code) };
    std::process::exit(code.max(1))
}
