//! Completing the MPI transport's non-blocking requests: [`wait_all`]
//! (`MPI_Waitall`, or `MPI_Testall` with a polite wait) and
//! [`MpiRequest`], the transport's [`Request`], whose completion checks a
//! receive's length; [`check`], every MPI return code as a `Result`.

use super::{PoliteWait, Request, Tag};
use crate::{Error, Result};
use mpi::ffi;
use std::mem::MaybeUninit;
use std::os::raw::{c_char, c_int};
use std::sync::Arc;

/// Complete every request of `reqs` (`MPI_Waitall`), politely when `wait`
/// is given ([`PoliteWait`]: `MPI_Testall`, then a sleep of its
/// [`pause`](PoliteWait::pause) between tests once the first interval has
/// passed, unless urgent).
pub(super) fn wait_all(
    wait: Option<&PoliteWait>,
    reqs: &mut [ffi::MPI_Request],
    statuses: &mut [MaybeUninit<ffi::MPI_Status>],
) -> Result<()> {
    debug_assert_eq!(reqs.len(), statuses.len());
    let n = reqs.len() as c_int;
    let st = statuses.as_mut_ptr() as *mut ffi::MPI_Status;
    let Some(w) = wait else {
        // SAFETY: `reqs` are requests of this library (active or null) and
        // `st` has room for one status each.
        return check(
            unsafe { ffi::MPI_Waitall(n, reqs.as_mut_ptr(), st) },
            "MPI_Waitall",
        );
    };
    let start = std::time::Instant::now();
    loop {
        let mut flag: c_int = 0;
        // SAFETY: as above; `flag` is a live int.
        let rc = unsafe { ffi::MPI_Testall(n, reqs.as_mut_ptr(), &mut flag, st) };
        check(rc, "MPI_Testall")?;
        if flag != 0 {
            return Ok(());
        }
        if w.is_urgent() || start.elapsed() < w.interval() {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(w.pause(start.elapsed()));
        }
    }
}

/// A pending `MPI_Isend`/`MPI_Irecv`.
pub struct MpiRequest {
    pub(super) raw: ffi::MPI_Request,
    /// For receives: (expected count, datatype, source, tag) to check on completion.
    pub(super) recv_check: Option<(usize, ffi::MPI_Datatype, usize, Tag)>,
    pub(super) done: bool,
    /// The transport's wait policy when the request was made.
    pub(super) wait: Option<Arc<PoliteWait>>,
}

impl MpiRequest {
    fn complete(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let mut status = [MaybeUninit::<ffi::MPI_Status>::uninit()];
        wait_all(
            self.wait.as_deref(),
            std::slice::from_mut(&mut self.raw),
            &mut status,
        )?;
        let status = &status[0];
        if let Some((expected, dt, src, tag)) = self.recv_check {
            let mut count: c_int = 0;
            // SAFETY: MPI_Wait completed a receive and filled the status.
            let rc = unsafe { ffi::MPI_Get_count(status.as_ptr(), dt, &mut count) };
            check(rc, "MPI_Get_count")?;
            if count < 0 || count as usize != expected {
                return Err(Error::MessageSize {
                    peer: src,
                    tag,
                    expected,
                    got: count.max(0) as usize,
                });
            }
        }
        Ok(())
    }
}

impl Request for MpiRequest {
    fn wait(mut self) -> Result<()> {
        self.complete()
    }
}

impl Drop for MpiRequest {
    fn drop(&mut self) {
        if let Err(e) = self.complete() {
            log::warn!("MPI request dropped with an error: {e}");
        }
    }
}

/// Turn an MPI return code into a `Result`.
pub(crate) fn check(rc: c_int, call: &'static str) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut buf = [0 as c_char; 1024];
    let mut len: c_int = 0;
    // SAFETY: buffer larger than MPI_MAX_ERROR_STRING of Open MPI and MPICH.
    let message = unsafe {
        if ffi::MPI_Error_string(rc, buf.as_mut_ptr(), &mut len) == ffi::MPI_SUCCESS as c_int {
            let bytes: Vec<u8> = buf[..len.clamp(0, 1023) as usize]
                .iter()
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            "unknown MPI error".to_string()
        }
    };
    Err(Error::Mpi {
        call,
        code: rc,
        message,
    })
}
