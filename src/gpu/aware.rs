//! Whether the MPI library takes device pointers.
//!
//! The only thing trusted is the MPI library's own run-time answer, or
//! the user's override `GRADSYNC_CUDA_AWARE=auto|0|1`. The answer is
//! MPICH's `MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &yes)` (MPICH ≥
//! 4.0 and its derivatives) where the library has it, else
//! `MPIX_Query_cuda_support()` (Open MPI's `mpi-ext.h`; MPICH 4 has it
//! too, as a wrapper of the former). Neither is in `mpi.h`'s standard
//! part (so not in `mpi::ffi`) and older MPIs lack both, so they are
//! looked up at run time with `dlsym`: first in the process's global scope
//! (`RTLD_DEFAULT`), then in the library that holds `MPI_Comm_rank` (an MPI
//! loaded with `RTLD_LOCAL`, as inside a Python extension). A library
//! without it is taken as not CUDA-aware. Compile-time macros
//! (`MPIX_CUDA_AWARE_SUPPORT`) say only how the headers were built, not
//! what the library loaded at run time can do, and are not used.

use crate::{Error, Result};
use serde::Serialize;
use std::sync::OnceLock;

/// The environment variable that overrides the run-time query.
pub const ENV: &str = "GRADSYNC_CUDA_AWARE";

/// What `GRADSYNC_CUDA_AWARE` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Override {
    /// Unset, empty or `auto`: ask the MPI library.
    Auto,
    /// `0`: never hand device pointers to MPI (stage through host memory).
    Off,
    /// `1`: hand device pointers to MPI (the user vouches for the library).
    On,
}

impl Override {
    /// Parse the variable's value (`None`: unset). Anything but unset,
    /// empty, `auto`, `0` or `1` is an error naming the variable and the
    /// value: a typo must not silently pick a default.
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("") | Some("auto") => Ok(Override::Auto),
            Some("0") => Ok(Override::Off),
            Some("1") => Ok(Override::On),
            Some(v) => Err(Error::InvalidArgument(format!(
                "{ENV}={v:?}: expected auto, 0 or 1"
            ))),
        }
    }

    /// [`Override::parse`] of the process environment. A value that is
    /// not Unicode is an error too.
    pub fn from_env() -> Result<Self> {
        match std::env::var(ENV) {
            Ok(v) => Self::parse(Some(&v)),
            Err(std::env::VarError::NotPresent) => Self::parse(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidArgument(format!(
                "{ENV}={v:?}: expected auto, 0 or 1"
            ))),
        }
    }
}

/// What the MPI library said when asked whether it takes CUDA memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Query {
    /// The library has neither `MPIX_GPU_query_support` nor
    /// `MPIX_Query_cuda_support` (MPICH before 4.0, other MPIs).
    Missing,
    /// `MPIX_Query_cuda_support()` returned this value (non-zero:
    /// CUDA-aware at run time); Open MPI.
    Returned(i32),
    /// `MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &v)` succeeded with
    /// this `v` (non-zero: CUDA-aware at run time); MPICH ≥ 4.0.
    GpuQuery(i32),
}

/// MPICH's `MPIX_GPU_SUPPORT_CUDA` (`mpi.h`, MPICH 4.0).
const MPIX_GPU_SUPPORT_CUDA: std::os::raw::c_int = 0;

/// Whether MPI takes device pointers, and why ([`cuda_aware`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CudaAware {
    /// Device pointers may be passed to MPI calls.
    pub aware: bool,
    /// Why: `"override"` (`GRADSYNC_CUDA_AWARE=0|1`) or `"query"`.
    pub source: &'static str,
    /// The library's answer, when it was asked (`None` under an override:
    /// the query is then not made at all).
    pub query: Option<Query>,
}

impl CudaAware {
    /// The decision from the override and, for [`Override::Auto`], the
    /// query (called only then).
    pub fn decide(ov: Override, query: impl FnOnce() -> Query) -> Self {
        match ov {
            Override::On | Override::Off => CudaAware {
                aware: ov == Override::On,
                source: "override",
                query: None,
            },
            Override::Auto => {
                let q = query();
                CudaAware {
                    aware: matches!(q, Query::Returned(v) | Query::GpuQuery(v) if v != 0),
                    source: "query",
                    query: Some(q),
                }
            }
        }
    }
}

impl std::fmt::Display for CudaAware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let yes = if self.aware { "yes" } else { "no" };
        match self.query {
            None => write!(f, "CUDA-aware MPI: {yes} ({ENV} override)"),
            Some(Query::Missing) => write!(
                f,
                "CUDA-aware MPI: {yes} (the MPI library has neither MPIX_GPU_query_support \
                 nor MPIX_Query_cuda_support)"
            ),
            Some(Query::GpuQuery(v)) => write!(
                f,
                "CUDA-aware MPI: {yes} (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) says {v})"
            ),
            Some(Query::Returned(v)) => {
                write!(f, "CUDA-aware MPI: {yes} (MPIX_Query_cuda_support() = {v})")
            }
        }
    }
}

/// Whether MPI takes device pointers in this process: `GRADSYNC_CUDA_AWARE`
/// if it says `0` or `1`, else the MPI library's answer ([`query_mpi`])
/// (MPI must be initialized: the answer may depend on what MPI loaded at
/// `MPI_Init`). Decided by the first successful call and logged then at
/// `info`; later calls return that decision (a later change of the
/// variable is not seen). A bad variable, or `auto` before `MPI_Init`, is
/// an error and decides nothing. Rank-local: ranks with different
/// environments can decide differently, so a collective caller agrees on
/// the decision before relying on it ([`crate::comm::agree`];
/// [`super::device_allreduce`] does).
pub fn cuda_aware() -> Result<CudaAware> {
    static DECIDED: OnceLock<CudaAware> = OnceLock::new();
    if let Some(d) = DECIDED.get() {
        return Ok(*d);
    }
    let ov = Override::from_env()?;
    if ov == Override::Auto {
        crate::comm::mpi_ready().map_err(|e| {
            Error::InvalidArgument(format!(
                "{ENV}=auto asks the MPI library, which is not usable: {e}"
            ))
        })?;
    }
    Ok(*DECIDED.get_or_init(|| {
        let d = CudaAware::decide(ov, query_mpi);
        log::info!("{d}");
        d
    }))
}

/// Ask the MPI library, through the functions found with `dlsym`:
/// MPICH's `MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &v)` first (its
/// general GPU query), then `MPIX_Query_cuda_support()` (Open MPI's; also
/// where the former fails).
pub fn query_mpi() -> Query {
    if let Some(f) = lookup(c"MPIX_GPU_query_support") {
        // SAFETY: the symbol is MPICH's `int MPIX_GPU_query_support(int
        // gpu_type, int *is_supported)`; `v` outlives the call.
        let f: extern "C" fn(std::os::raw::c_int, *mut std::os::raw::c_int) -> std::os::raw::c_int =
            unsafe { std::mem::transmute(f) };
        let mut v: std::os::raw::c_int = 0;
        if f(MPIX_GPU_SUPPORT_CUDA, &mut v) == mpi::ffi::MPI_SUCCESS as std::os::raw::c_int {
            return Query::GpuQuery(v);
        }
    }
    match lookup(c"MPIX_Query_cuda_support") {
        None => Query::Missing,
        Some(f) => {
            // SAFETY: the symbol is the MPI extension `int
            // MPIX_Query_cuda_support(void)` in Open MPI and MPICH.
            let f: extern "C" fn() -> std::os::raw::c_int = unsafe { std::mem::transmute(f) };
            Query::Returned(f())
        }
    }
}

/// The address of `name` in the global scope or in the MPI library.
#[cfg(unix)]
fn lookup(name: &std::ffi::CStr) -> Option<*mut std::ffi::c_void> {
    // SAFETY: dlsym with a valid NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if p.is_null() {
        lookup_in_mpi_library(name)
    } else {
        Some(p)
    }
}

/// The address of `name` in the shared library that holds
/// `MPI_Comm_rank`, found with `dladdr`: for an MPI library loaded with
/// `RTLD_LOCAL` (a Python extension's dependency), which `RTLD_DEFAULT`
/// does not search.
#[cfg(unix)]
fn lookup_in_mpi_library(name: &std::ffi::CStr) -> Option<*mut std::ffi::c_void> {
    // SAFETY: dladdr/dlopen/dlsym with valid NUL-terminated names; the
    // handle from dlopen(RTLD_NOLOAD) only adds a reference to a library
    // already loaded and is closed again.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let anchor = mpi::ffi::MPI_Comm_rank as *const std::ffi::c_void;
        if libc::dladdr(anchor, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let h = libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if h.is_null() {
            return None;
        }
        let p = libc::dlsym(h, name.as_ptr());
        libc::dlclose(h);
        (!p.is_null()).then_some(p)
    }
}

#[cfg(not(unix))]
fn lookup(_name: &std::ffi::CStr) -> Option<*mut std::ffi::c_void> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_values() {
        assert_eq!(Override::parse(None).unwrap(), Override::Auto);
        assert_eq!(Override::parse(Some("")).unwrap(), Override::Auto);
        assert_eq!(Override::parse(Some("auto")).unwrap(), Override::Auto);
        assert_eq!(Override::parse(Some(" 1 ")).unwrap(), Override::On);
        assert_eq!(Override::parse(Some("0")).unwrap(), Override::Off);
        for bad in ["yes", "true", "2", "AUTO", "01", "on"] {
            let e = Override::parse(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains("GRADSYNC_CUDA_AWARE") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
    }

    #[cfg(unix)]
    #[test]
    fn symbols_are_found_globally_and_in_the_mpi_library() {
        // Every MPI has MPI_Comm_size: both lookups find the same one.
        let g = lookup(c"MPI_Comm_size").expect("MPI_Comm_size in the global scope");
        let l = lookup_in_mpi_library(c"MPI_Comm_size").expect("MPI_Comm_size in libmpi");
        assert_eq!(g, l);
        assert!(lookup(c"MPIX_no_such_function_gradsync").is_none());
        // The extension, where the library has it: the same address both ways.
        for ext in [c"MPIX_Query_cuda_support", c"MPIX_GPU_query_support"] {
            if let Some(g) = lookup(ext) {
                assert_eq!(lookup_in_mpi_library(ext), Some(g));
            }
        }
    }

    #[test]
    fn decision() {
        let never = || -> Query { panic!("the query must not run under an override") };
        let on = CudaAware::decide(Override::On, never);
        assert!(on.aware && on.source == "override" && on.query.is_none());
        let off = CudaAware::decide(Override::Off, never);
        assert!(!off.aware && off.query.is_none());
        for (q, aware) in [
            (Query::Missing, false),
            (Query::Returned(0), false),
            (Query::Returned(1), true),
            (Query::GpuQuery(0), false),
            (Query::GpuQuery(1), true),
        ] {
            let d = CudaAware::decide(Override::Auto, || q);
            assert_eq!((d.aware, d.source, d.query), (aware, "query", Some(q)));
        }
        assert_eq!(
            CudaAware::decide(Override::Auto, || Query::Returned(0)).to_string(),
            "CUDA-aware MPI: no (MPIX_Query_cuda_support() = 0)"
        );
        assert_eq!(
            CudaAware::decide(Override::Auto, || Query::GpuQuery(1)).to_string(),
            "CUDA-aware MPI: yes (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) says 1)"
        );
    }
}
