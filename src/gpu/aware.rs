//! Whether the MPI library takes device pointers (issue #16, part 3).
//!
//! The only thing trusted is the MPI library's own run-time answer,
//! `MPIX_Query_cuda_support()` (Open MPI's `mpi-ext.h`, MPICH ≥ 4.0), or
//! the user's override `GRADSYNC_CUDA_AWARE=auto|0|1`. The function is not
//! in `mpi.h` (so not in `mpi::ffi`) and older MPICH lacks it, so it is
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

/// What the MPI library's `MPIX_Query_cuda_support` said.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Query {
    /// The library has no `MPIX_Query_cuda_support` (MPICH before 4.0,
    /// other MPIs).
    Missing,
    /// It returned this value (non-zero: CUDA-aware at run time).
    Returned(i32),
}

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
                    aware: matches!(q, Query::Returned(v) if v != 0),
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
                "CUDA-aware MPI: {yes} (the MPI library has no MPIX_Query_cuda_support)"
            ),
            Some(Query::Returned(v)) => {
                write!(f, "CUDA-aware MPI: {yes} (MPIX_Query_cuda_support() = {v})")
            }
        }
    }
}

/// Whether MPI takes device pointers in this process: `GRADSYNC_CUDA_AWARE`
/// if it says `0` or `1`, else the MPI library's `MPIX_Query_cuda_support()`
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

/// Call the MPI library's `MPIX_Query_cuda_support()`, found with `dlsym`.
pub fn query_mpi() -> Query {
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
        if let Some(g) = lookup(c"MPIX_Query_cuda_support") {
            assert_eq!(lookup_in_mpi_library(c"MPIX_Query_cuda_support"), Some(g));
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
        ] {
            let d = CudaAware::decide(Override::Auto, || q);
            assert_eq!((d.aware, d.source, d.query), (aware, "query", Some(q)));
        }
        assert_eq!(
            CudaAware::decide(Override::Auto, || Query::Returned(0)).to_string(),
            "CUDA-aware MPI: no (MPIX_Query_cuda_support() = 0)"
        );
    }
}
