//! The module's functions: the in-place `allreduce` of one array over an
//! mpi4py communicator, the cost model's `predict`, the MPI library's
//! version and the engine's bucket cut (`cut_buckets`).

use crate::args::{json_to_py, raw_comm, to_str, Bad};
use crate::{engine_err, Error};
use gradsync::dense::{
    allreduce_agreed, allreduce_agreed_with, AllreduceAlgo, AnyBuf, AnyWorkspace, ReduceOp,
};
use numpy::{PyArrayDyn, PyArrayMethods, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::{LazyLock, Mutex};

/// `allreduce`'s scratch, kept across calls (as large as the largest
/// array's algorithm needed: half of it for `rabenseifner`, none for `mpi`,
/// which passes `MPI_IN_PLACE`): a fresh one each call paid the first
/// touch of its pages.
static SCRATCH: LazyLock<Mutex<AnyWorkspace>> = LazyLock::new(Mutex::default);

/// In-place allreduce of a float32/float64 array over `comm`.
#[pyfunction]
#[pyo3(signature = (comm, array, algo=None, op=None))]
pub(crate) fn allreduce(
    py: Python<'_>,
    comm: &Bound<'_, PyAny>,
    array: &Bound<'_, PyAny>,
    algo: Option<&Bound<'_, PyAny>>,
    op: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let raw = raw_comm(comm)?;
    // Everything rank-local first, converted here (not by PyO3 before the
    // call): a failure still enters the agreement, so no rank is left alone.
    let local = allreduce_args(array, algo, op);
    let (mut arr, bad) = match local {
        Ok((a, algo, op)) => (Some((a, algo, op)), None),
        Err(b) => (None, Some(b)),
    };
    let call: gradsync::Result<(AnyBuf<'_>, AllreduceAlgo, ReduceOp)> = match (&bad, arr.as_mut()) {
        (None, Some((Arr::F32(a), algo, op))) => Ok((
            AnyBuf::F32(a.as_slice_mut().expect("contiguous")),
            *algo,
            *op,
        )),
        (None, Some((Arr::F64(a), algo, op))) => Ok((
            AnyBuf::F64(a.as_slice_mut().expect("contiguous")),
            *algo,
            *op,
        )),
        (Some(b), _) => Err(gradsync::Error::InvalidArgument(b.text().to_string())),
        (None, None) => Err(gradsync::Error::InvalidArgument("no array".into())),
    };
    let r = py.detach(move || {
        // SAFETY: `raw` came from MPI_Comm_f2c on an initialized MPI. The
        // duplicate kept on `comm` (made by the first call on it).
        let comm = unsafe { gradsync::comm::MpiComm::duplicate_kept(raw.get()) }?;
        // The kept scratch, unless another thread's call holds it (a
        // panic that poisoned it left it usable: its contents never matter).
        match SCRATCH.try_lock() {
            Ok(mut ws) => allreduce_agreed_with(&comm, call, &mut ws),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                allreduce_agreed_with(&comm, call, &mut p.into_inner())
            }
            Err(std::sync::TryLockError::WouldBlock) => allreduce_agreed(&comm, call),
        }
    });
    match (r, bad) {
        (Ok(()), _) => Ok(()),
        (Err(e), Some(bad)) => Err(bad.raise(Some(&e))),
        (Err(e), None) => Err(engine_err(e)),
    }
}

/// The array `allreduce` writes in place, borrowed for writing.
enum Arr<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    F64(PyReadwriteArrayDyn<'py, f64>),
}

/// `allreduce`'s rank-local arguments, checked: the array (float32 or
/// float64, C-contiguous, aligned, writable), the algorithm and the op.
fn allreduce_args<'py>(
    array: &Bound<'py, PyAny>,
    algo: Option<&Bound<'_, PyAny>>,
    op: Option<&Bound<'_, PyAny>>,
) -> Result<(Arr<'py>, AllreduceAlgo, ReduceOp), Bad> {
    let algo = match algo {
        None => AllreduceAlgo::Rabenseifner,
        Some(a) => {
            let name = to_str(a, "algo").map_err(Bad::Type)?;
            // `auto` is the engine's per-step choice, not a call's.
            name.parse().map_err(|_| {
                Bad::Value(format!(
                    "unknown allreduce algorithm {name:?} (rabenseifner, ring, mpi, \
                     hierarchical; \"auto\" is an engine option, not an algorithm)"
                ))
            })?
        }
    };
    let op = match op
        .map(|o| to_str(o, "op"))
        .transpose()
        .map_err(Bad::Type)?
        .as_deref()
    {
        None | Some("sum") => ReduceOp::Sum,
        Some("average" | "avg" | "mean") => ReduceOp::Average,
        Some(o) => return Err(Bad::Value(format!("unknown op {o:?} (sum, average)"))),
    };
    let contiguous = |a: &Bound<'_, numpy::PyUntypedArray>| {
        if !a.is_c_contiguous() {
            Err(Bad::Value(
                "array is not C-contiguous (gradsync works in place)".into(),
            ))
        } else if !a.is_aligned() {
            Err(Bad::Value(
                "array is not aligned to its elements (a view at an odd byte offset; gradsync works in place)".into(),
            ))
        } else {
            Ok(())
        }
    };
    let rw = |e: numpy::BorrowError| Bad::Value(format!("array cannot be written in place ({e})"));
    let arr = if let Ok(a) = array.cast::<PyArrayDyn<f32>>() {
        contiguous(a.as_untyped())?;
        Arr::F32(a.try_readwrite().map_err(rw)?)
    } else if let Ok(a) = array.cast::<PyArrayDyn<f64>>() {
        contiguous(a.as_untyped())?;
        Arr::F64(a.try_readwrite().map_err(rw)?)
    } else {
        let what = array
            .getattr("dtype")
            .map(|d| format!("dtype {d}"))
            .unwrap_or_else(|_| {
                let name = array.get_type().name();
                format!(
                    "a {}",
                    name.map_or_else(|_| "?".to_string(), |n| n.to_string())
                )
            });
        return Err(Bad::Type(format!(
            "array must be a numpy float32 or float64 array, got {what}"
        )));
    };
    Ok((arr, algo, op))
}

/// The cost model's prediction for one layer, as a dict (the JSON of
/// `gradsync predict --json`).
#[pyfunction]
#[pyo3(signature = (elements, ranks, density=0.001, profile=None, alpha=None, bandwidth=None,
    gamma_reduce=None, gamma_unpack=None, select_cost=None, select_fixed=None,
    select_method="trimmed", gradiveq_ratio=8.0, strategies=None, ranks_per_node=None,
    inter_alpha=None, inter_bandwidth=None, fill=None, shape=None, powersgd_rank=1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn predict(
    py: Python<'_>,
    elements: usize,
    ranks: usize,
    density: f64,
    profile: Option<PathBuf>,
    alpha: Option<f64>,
    bandwidth: Option<f64>,
    gamma_reduce: Option<f64>,
    gamma_unpack: Option<f64>,
    select_cost: Option<f64>,
    select_fixed: Option<f64>,
    select_method: &str,
    gradiveq_ratio: f64,
    strategies: Option<Vec<String>>,
    ranks_per_node: Option<u64>,
    inter_alpha: Option<f64>,
    inter_bandwidth: Option<f64>,
    fill: Option<f64>,
    shape: Option<Vec<usize>>,
    powersgd_rank: usize,
) -> PyResult<Py<PyAny>> {
    if powersgd_rank == 0 {
        return Err(PyValueError::new_err("powersgd_rank=0: must be at least 1"));
    }
    if profile.is_some() && (alpha.is_some() || bandwidth.is_some()) {
        return Err(PyValueError::new_err(
            "give profile, or alpha and bandwidth, not both",
        ));
    }
    if profile.is_none() && (alpha.is_none() || bandwidth.is_none()) {
        return Err(PyValueError::new_err(
            "give profile=PATH (gradsync calibrate), or alpha= (s) and bandwidth= (bytes/s)",
        ));
    }
    let m = gradsync::cost::records::ModelArgs {
        profile,
        alpha,
        bandwidth,
        gamma_reduce,
        gamma_unpack,
        select_cost,
        select_fixed,
        select_method: select_method.to_string(),
        gradiveq_ratio,
        strategies: strategies.unwrap_or_default().join(","),
        ranks_per_node,
        inter_alpha,
        inter_bandwidth,
        fill,
        // One layer's prices: no threshold.
        compress_threshold: 0,
        powersgd_rank,
    };
    let rec = m
        .profile()
        .and_then(|p| {
            m.check_point(ranks, density)?;
            gradsync::cost::records::predict_record(
                &p,
                &m,
                elements,
                ranks,
                density,
                shape.as_deref(),
            )
        })
        .map_err(|e| PyValueError::new_err(python_flags(&e.to_string())))?;
    let v = serde_json::to_value(&rec).map_err(|e| Error::new_err(e.to_string()))?;
    json_to_py(py, &v)
}

/// The command line's flags in a model error, as this module's keywords
/// (`--ranks-per-node` → `ranks_per_node=`): the same checks serve both.
pub(crate) fn python_flags(msg: &str) -> String {
    // Longest first: `--ranks-per-node` before `--ranks`.
    const FLAGS: [&str; 18] = [
        "--inter-bandwidth",
        "--ranks-per-node",
        "--gradiveq-ratio",
        "--select-method",
        "--gamma-reduce",
        "--gamma-unpack",
        "--select-fixed",
        "--select-cost",
        "--inter-alpha",
        "--strategies",
        "--bandwidth",
        "--elements",
        "--density",
        "--profile",
        "--alpha",
        "--ranks",
        "--fill",
        "--shape",
    ];
    // Whole flags only: not inside a longer word or flag.
    let part = |c: char| c.is_alphanumeric() || c == '-' || c == '_';
    let mut out = msg.to_string();
    for flag in FLAGS {
        let keyword = format!("{}=", flag[2..].replace('-', "_"));
        let mut from = 0;
        while let Some(i) = out[from..].find(flag).map(|i| i + from) {
            let end = i + flag.len();
            let before = out[..i].chars().next_back().is_some_and(part);
            let after = out[end..].chars().next().is_some_and(part);
            if before || after {
                from = end;
            } else {
                out.replace_range(i..end, &keyword);
                from = i + keyword.len();
            }
        }
    }
    out
}

/// `MPI_Get_library_version` of the MPI library this extension is linked with.
#[pyfunction]
pub(crate) fn mpi_library_version() -> String {
    gradsync::comm::mpi_library_version()
}

/// The table's layers (their f32 `elements`) cut into buckets of up to
/// `cap_bytes`, as the overlapped step submits them
/// (`gradsync::cost::cut_buckets`): indices, reverse registration order.
#[pyfunction]
pub(crate) fn cut_buckets(elements: Vec<usize>, cap_bytes: usize) -> Vec<Vec<usize>> {
    gradsync::cost::cut_buckets(&elements, cap_bytes)
}
