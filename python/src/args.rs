//! The arguments of the extension's calls, checked and converted: the
//! communicator from mpi4py, arrays (dtype, layout, shape, writability,
//! overlap), layer ids, paths, and the engine's statistics as Python
//! objects. A wrong argument is a [`Bad`]: the engine still enters the
//! step's collectives with it ([`gradsync::sync::GradSync::fail_step`]),
//! so every rank raises in the same step.

use crate::{engine_err, Error};
use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;

/// The kind of a rank-local argument error (the Python exception type).
pub(crate) enum Bad {
    Type(String),
    Value(String),
}

impl Bad {
    pub(crate) fn text(&self) -> &str {
        match self {
            Bad::Type(m) | Bad::Value(m) => m,
        }
    }
    /// The exception raised on the rank that passed the bad argument, once
    /// every rank has failed the step: the local cause first, then what
    /// every rank saw.
    pub(crate) fn raise(self, collective: Option<&gradsync::Error>) -> PyErr {
        let msg = match collective {
            Some(e) => format!("{} (raised on every rank: {e})", self.text()),
            None => self.text().to_string(),
        };
        match self {
            Bad::Type(_) => PyTypeError::new_err(msg),
            Bad::Value(_) => PyValueError::new_err(msg),
        }
    }
}

/// A raw communicator handle from an mpi4py intra-communicator (or a
/// Fortran integer handle, as `comm.py2f()` returns).
pub(crate) fn raw_comm(comm: &Bound<'_, PyAny>) -> PyResult<RawComm> {
    // Before touching the communicator: after MPI_Finalize even py2f aborts.
    gradsync::comm::mpi_ready().map_err(engine_err)?;
    let py = comm.py();
    let f: i64 = if comm.is_instance_of::<pyo3::types::PyInt>() {
        let i: i64 = comm.extract()?;
        if i32::try_from(i).is_err() {
            return Err(PyValueError::new_err(format!(
                "{i} is not a Fortran communicator handle (MPI_Fint)"
            )));
        }
        i
    } else {
        let intracomm = py.import("mpi4py.MPI")?.getattr("Intracomm")?;
        if !comm.is_instance(&intracomm)? {
            return Err(PyTypeError::new_err(format!(
                "comm must be an mpi4py intra-communicator (e.g. MPI.COMM_WORLD), got {}",
                comm.repr().map(|r| r.to_string()).unwrap_or_default()
            )));
        }
        comm.call_method0("py2f")?.extract()?
    };
    // SAFETY: MPI is initialized; MPI_Comm_f2c accepts any integer and
    // returns MPI_COMM_NULL (or an invalid handle MPI reports) for junk.
    let raw = unsafe { mpi::ffi::RSMPI_Comm_f2c(f as _) };
    Ok(RawComm(raw))
}

/// A path from `str`, `bytes` or `os.PathLike`, or why not.
pub(crate) fn to_path(obj: &Bound<'_, PyAny>) -> Result<PathBuf, String> {
    let os = obj.py().import("os").map_err(|e| e.to_string())?;
    os.call_method1("fsdecode", (obj,))
        .and_then(|p| p.extract::<String>())
        .map(PathBuf::from)
        .map_err(|_| {
            format!(
                "a path must be str, bytes or os.PathLike, got {}",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            )
        })
}

/// A str argument, or why not.
pub(crate) fn to_str(obj: &Bound<'_, PyAny>, what: &str) -> Result<String, String> {
    obj.extract::<String>().map_err(|_| {
        format!(
            "{what} must be a str, got {}",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        )
    })
}

/// A raw handle moved into the GIL-free closure (MPI handles are
/// process-wide; gradsync requires MPI_THREAD_SERIALIZED or better for
/// use from another thread, which mpi4py's default MULTIPLE satisfies).
#[derive(Clone, Copy)]
pub(crate) struct RawComm(mpi::ffi::MPI_Comm);
// SAFETY: see above; the handle is only used by one thread at a time.
unsafe impl Send for RawComm {}

impl RawComm {
    /// The handle (a method, so closures capture the `Send` wrapper).
    pub(crate) fn get(self) -> mpi::ffi::MPI_Comm {
        self.0
    }
}

/// A layer shape: an int, or a sequence of ints (numpy integers too).
pub(crate) fn shape_of(shape: &Bound<'_, PyAny>, name: &str) -> Result<Vec<usize>, String> {
    let bad = || {
        format!(
            "shape of layer {name:?} must be a tuple of non-negative ints, got {}",
            shape.repr().map(|r| r.to_string()).unwrap_or_default()
        )
    };
    let dim = |d: &Bound<'_, PyAny>| -> Result<usize, String> {
        if d.is_instance_of::<pyo3::types::PyBool>() {
            return Err(bad());
        }
        d.call_method0("__index__")
            .and_then(|i| i.extract::<usize>())
            .map_err(|_| bad())
    };
    if let Ok(n) = dim(shape) {
        return Ok(vec![n]);
    }
    if shape.is_instance_of::<pyo3::types::PyString>()
        || shape.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(bad());
    }
    let items = shape.try_iter().map_err(|_| bad())?;
    items
        .map(|d| d.map_err(|_| bad()).and_then(|d| dim(&d)))
        .collect()
}

/// One gradient argument: a NumPy float32 array, C-contiguous, of the
/// layer's shape (or flat with the layer's size).
pub(crate) fn check_array<'py>(
    a: &Bound<'py, PyAny>,
    what: &str,
    i: usize,
    name: &str,
    shape: &[usize],
) -> Result<Bound<'py, PyArrayDyn<f32>>, Bad> {
    let arr = a.cast::<PyArrayDyn<f32>>().map_err(|_| {
        let ty = a
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let got = match a.getattr("dtype") {
            Ok(d) => format!("a {ty} of dtype {d}"),
            Err(_) => format!("a {ty}"),
        };
        // `sync` takes half precision (through DLPack); `start`/`wait`
        // and weights take float32.
        let want = if what == "gradient" {
            "a numpy float32 array (sync also takes numpy float16 and DLPack tensors of float32, float16 or bfloat16)"
        } else {
            "a numpy float32 array"
        };
        Bad::Type(format!(
            "{what} {i} (layer {name:?}) must be {want}, got {got}"
        ))
    })?;
    if !arr.is_c_contiguous() {
        return Err(Bad::Value(format!(
            "{what} {i} (layer {name:?}) is not C-contiguous: gradsync works in place (np.ascontiguousarray would copy)"
        )));
    }
    if !arr.is_aligned() {
        return Err(Bad::Value(format!(
            "{what} {i} (layer {name:?}) is not aligned to its 4-byte elements (a view at an odd byte offset): gradsync works in place (np.require(a, requirements='A') would copy)"
        )));
    }
    let n: usize = shape.iter().product();
    let got = arr.shape();
    if got != shape && !(got.len() == 1 && got[0] == n) {
        return Err(Bad::Value(format!(
            "{what} {i} (layer {name:?}) has shape {got:?}, registered {shape:?} ({n} elements)"
        )));
    }
    Ok(arr.clone())
}

/// Write access to every array (numpy's borrow flags: read-only arrays and
/// an array passed twice are refused).
pub(crate) fn writable<'py>(
    arrays: &[Bound<'py, PyArrayDyn<f32>>],
) -> Result<Vec<PyReadwriteArrayDyn<'py, f32>>, Bad> {
    writable_as(arrays, "gradient")
}

/// [`writable`] naming the arrays `what` ("weight": `delay > 1` writes the
/// delay window's weights back).
pub(crate) fn writable_as<'py>(
    arrays: &[Bound<'py, PyArrayDyn<f32>>],
    what: &str,
) -> Result<Vec<PyReadwriteArrayDyn<'py, f32>>, Bad> {
    arrays
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.try_readwrite().map_err(|e| {
                Bad::Value(format!(
                    "{what} {i} cannot be written in place ({e}): read-only (numpy marks \
                     arrays imported from legacy, unversioned DLPack capsules so), or the same \
                     array passed twice"
                ))
            })
        })
        .collect()
}

/// Mutable slices of write-borrowed arrays.
pub(crate) fn write_slices<'a>(
    guards: &'a mut [PyReadwriteArrayDyn<'_, f32>],
) -> Vec<&'a mut [f32]> {
    guards
        .iter_mut()
        .map(|g| g.as_slice_mut().expect("checked C-contiguous"))
        .collect()
}

/// Read access to every array (refused while another borrow writes it).
pub(crate) fn readable<'py>(
    arrays: &[Bound<'py, PyArrayDyn<f32>>],
    what: &str,
) -> Result<Vec<PyReadonlyArrayDyn<'py, f32>>, Bad> {
    arrays
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.try_readonly().map_err(|e| {
                Bad::Value(format!(
                    "{what} {i} cannot be read: its memory is being written ({e})"
                ))
            })
        })
        .collect()
}

/// A bucket's layer indices (a list of ints).
pub(crate) fn layer_ids(layers: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    layers
        .try_iter()
        .and_then(|it| {
            it.map(|x| x?.extract::<usize>())
                .collect::<PyResult<Vec<_>>>()
        })
        .map_err(|_| PyTypeError::new_err("layers must be a list of layer indices (ints)"))
}

/// The arrays' memory, read (checked C-contiguous by `check_array`).
pub(crate) fn read_slices<'a>(guards: &'a [PyReadonlyArrayDyn<'_, f32>]) -> Vec<&'a [f32]> {
    guards
        .iter()
        .map(|g| g.as_slice().expect("checked C-contiguous"))
        .collect()
}

/// Refuse arrays written in place (`written`: the gradients of `sync` and
/// `wait`) whose memory overlaps another array of the call (`read`: the
/// weights; [`gradsync::sync::first_overlap`]). numpy's borrow flags see
/// overlaps only between views of one base; arrays that reach the same
/// memory through different owners (DLPack imports, `np.frombuffer` of a
/// memoryview, `__array_interface__` wrappers) are caught here, by address.
pub(crate) fn no_overlap(
    written: &[Bound<'_, PyArrayDyn<f32>>],
    read: &[Bound<'_, PyArrayDyn<f32>>],
) -> Result<(), Bad> {
    let span = |a: &Bound<'_, PyArrayDyn<f32>>, w: bool| {
        (a.data() as usize, a.len() * std::mem::size_of::<f32>(), w)
    };
    let spans: Vec<(usize, usize, bool)> = written
        .iter()
        .map(|a| span(a, true))
        .chain(read.iter().map(|a| span(a, false)))
        .collect();
    let Some((a, b)) = gradsync::sync::first_overlap(&spans) else {
        return Ok(());
    };
    let name = |k: usize| match k.checked_sub(written.len()) {
        None => format!("gradient {k}"),
        Some(w) => format!("weight {w}"),
    };
    // Name the weight first when a weight meets a gradient.
    let (first, second) = if b >= written.len() && a < written.len() {
        (b, a)
    } else {
        (a, b)
    };
    Err(Bad::Value(format!(
        "{} and {} share memory: gradsync writes each layer's result in place",
        name(first),
        name(second)
    )))
}

pub(crate) fn stats_dict(py: Python<'_>, stats: &gradsync::sync::StepStats) -> PyResult<Py<PyAny>> {
    let v = serde_json::to_value(stats).map_err(|e| Error::new_err(e.to_string()))?;
    json_to_py(py, &v)
}

pub(crate) fn json_to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None(),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any().unbind(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any().unbind(),
            _ => n
                .as_f64()
                .unwrap_or(f64::NAN)
                .into_pyobject(py)?
                .into_any()
                .unbind(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any().unbind(),
        Value::Array(a) => {
            let l = PyList::empty(py);
            for x in a {
                l.append(json_to_py(py, x)?)?;
            }
            l.into_any().unbind()
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any().unbind()
        }
    })
}
