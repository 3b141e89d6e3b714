//! `gradsync._gradsync`: the Python extension behind the `gradsync` package.
//! A thin layer over the Rust engine ([`gradsync::sync`]) and
//! the dense collectives ([`gradsync::dense`]):
//!
//! * the communicator comes from mpi4py (`comm.py2f()` → `MPI_Comm_f2c` →
//!   `MPI_Comm_dup`); MPI is never initialized or finalized here;
//! * gradients are NumPy `float32` C-contiguous arrays used in place (no
//!   copy), and the GIL is released while the engine runs;
//! * an argument that is wrong on one rank (dtype, layout, shape, count)
//!   still enters the step's collectives ([`GradSync::fail_step`]), so
//!   every rank raises in the same step instead of hanging.
//!
//! The Python-facing API, its docstrings and the MPI library check live in
//! `gradsync/__init__.py`; this module is what it calls.

use gradsync::dense::{allreduce_agreed, AllreduceAlgo, AnyBuf, ReduceOp};
use gradsync::sync::{Config, GradSync as Engine, LayerId};
use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;

mod dlpack;
use std::sync::{Arc, Mutex};

pyo3::create_exception!(
    _gradsync,
    Error,
    PyRuntimeError,
    "An error from the gradsync engine. Collective errors (a rank failed in a step, layer tables differ, sizes differ) are raised alike on every rank."
);

fn engine_err(e: gradsync::Error) -> PyErr {
    Error::new_err(e.to_string())
}

/// The kind of a rank-local argument error (the Python exception type).
enum Bad {
    Type(String),
    Value(String),
}

impl Bad {
    fn text(&self) -> &str {
        match self {
            Bad::Type(m) | Bad::Value(m) => m,
        }
    }
    /// The exception raised on the rank that passed the bad argument, once
    /// every rank has failed the step: the local cause first, then what
    /// every rank saw.
    fn raise(self, collective: Option<&gradsync::Error>) -> PyErr {
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
fn raw_comm(comm: &Bound<'_, PyAny>) -> PyResult<RawComm> {
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
fn to_path(obj: &Bound<'_, PyAny>) -> Result<PathBuf, String> {
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
fn to_str(obj: &Bound<'_, PyAny>, what: &str) -> Result<String, String> {
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
struct RawComm(mpi::ffi::MPI_Comm);
// SAFETY: see above; the handle is only used by one thread at a time.
unsafe impl Send for RawComm {}

impl RawComm {
    /// The handle (a method, so closures capture the `Send` wrapper).
    fn get(self) -> mpi::ffi::MPI_Comm {
        self.0
    }
}

/// A layer shape: an int, or a sequence of ints (numpy integers too).
fn shape_of(shape: &Bound<'_, PyAny>, name: &str) -> Result<Vec<usize>, String> {
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
fn check_array<'py>(
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
fn writable<'py>(
    arrays: &[Bound<'py, PyArrayDyn<f32>>],
) -> Result<Vec<PyReadwriteArrayDyn<'py, f32>>, Bad> {
    writable_as(arrays, "gradient")
}

/// [`writable`] naming the arrays `what` ("weight": `delay > 1` writes the
/// delay window's weights back).
fn writable_as<'py>(
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
fn write_slices<'a>(guards: &'a mut [PyReadwriteArrayDyn<'_, f32>]) -> Vec<&'a mut [f32]> {
    guards
        .iter_mut()
        .map(|g| g.as_slice_mut().expect("checked C-contiguous"))
        .collect()
}

/// Read access to every array (refused while another borrow writes it).
fn readable<'py>(
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
fn layer_ids(layers: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    layers
        .try_iter()
        .and_then(|it| {
            it.map(|x| x?.extract::<usize>())
                .collect::<PyResult<Vec<_>>>()
        })
        .map_err(|_| PyTypeError::new_err("layers must be a list of layer indices (ints)"))
}

/// The arrays' memory, read (checked C-contiguous by `check_array`).
fn read_slices<'a>(guards: &'a [PyReadonlyArrayDyn<'_, f32>]) -> Vec<&'a [f32]> {
    guards
        .iter()
        .map(|g| g.as_slice().expect("checked C-contiguous"))
        .collect()
}

/// The synchronization engine (see `gradsync.GradSync`).
#[pyclass(module = "gradsync._gradsync", name = "GradSync")]
struct PyGradSync {
    inner: Mutex<Option<Engine>>,
    /// (name, shape) of the registered layers, for argument checks (an
    /// `Arc` so a step takes a snapshot and holds no lock while it looks at
    /// Python objects, which may run Python code).
    layers: Mutex<LayerTable>,
    /// `delay > 1`: the weights are borrowed writable (a communicating
    /// step writes the delay window's weights back into them).
    delayed: bool,
}

/// (name, shape) of each registered layer.
type LayerTable = Arc<Vec<(String, Vec<usize>)>>;

type Held<'a> = std::sync::MutexGuard<'a, Option<Engine>>;

impl PyGradSync {
    /// The engine, locked. Another Python thread may hold it inside a
    /// GIL-free call (a `sync`); waiting for it with the GIL held would
    /// deadlock (that thread needs the GIL to return), so wait without it.
    fn engine(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        let g = loop {
            match self.inner.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::WouldBlock) => {
                    py.detach(|| std::thread::sleep(std::time::Duration::from_micros(50)))
                }
                Err(std::sync::TryLockError::Poisoned(_)) => {
                    return Err(Error::new_err("the engine was poisoned by a panic"))
                }
            }
        };
        if g.is_none() {
            return Err(Error::new_err("the engine is closed"));
        }
        Ok(g)
    }

    /// The engine, locked, for a call that communicates: MPI must still be
    /// up (after `MPI.Finalize()` an MPI call aborts the process).
    fn collective(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        let g = self.engine(py)?;
        gradsync::comm::mpi_ready().map_err(engine_err)?;
        Ok(g)
    }

    /// The engine, locked, for a call that begins a step (`sync`, `start`,
    /// `fail_step`). A step this rank left pending (its `wait` raised on a
    /// bad output argument and was not called again) is finished first
    /// into scratch buffers, its result discarded with a `RuntimeWarning`:
    /// the peers finished that step and wait in this one, so refusing here
    /// ("start called twice") would leave them waiting for ever.
    fn begin(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        self.begin_if(py, Engine::pending)
    }

    /// [`begin`](Self::begin) for a bucket: only a step whose every layer
    /// was submitted (its `finish_step` raised on this rank) is finished
    /// first; an open step with layers still to come takes the bucket.
    fn begin_bucket(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        self.begin_if(py, Engine::pending_finish)
    }

    fn begin_if(&self, py: Python<'_>, stale: fn(&Engine) -> bool) -> PyResult<Held<'_>> {
        let mut g = self.collective(py)?;
        let eng = g.as_mut().expect("checked open");
        if stale(eng) {
            let done = py.detach(|| eng.discard_pending());
            let text = match done {
                Ok(_) => "gradsync: the previous step's wait() did not complete on this rank; \
                          its result was discarded so that this rank takes part in the new step"
                    .to_string(),
                Err(e) => format!(
                    "gradsync: the previous step's wait() did not complete on this rank, and \
                     that step failed: {e}"
                ),
            };
            let msg = std::ffi::CString::new(text.replace('\0', " ")).expect("no NUL");
            let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
            // Warned with the engine unlocked: a warnings hook may read it
            // (`sync.step`), and would wait for ever on this thread's lock.
            drop(g);
            // A warnings filter of "error" must not stop this rank from
            // joining the step: the warning's own error is dropped.
            let _ = PyErr::warn(py, category.as_any(), &msg, 1);
            return self.collective(py);
        }
        Ok(g)
    }

    fn check_list<'py>(
        &self,
        grads: &Bound<'py, PyAny>,
        what: &str,
    ) -> Result<Vec<Bound<'py, PyArrayDyn<f32>>>, Bad> {
        let layers = Arc::clone(
            &*self
                .layers
                .lock()
                .map_err(|_| Bad::Value("poisoned".into()))?,
        );
        let items: Vec<Bound<'py, PyAny>> = grads
            .try_iter()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>())
            .map_err(|e| {
                if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(grads.py()) {
                    Bad::Type(format!("interrupted: {e}"))
                } else {
                    Bad::Type(format!("{what}s must be a list of numpy float32 arrays"))
                }
            })?;
        if items.len() != layers.len() {
            return Err(Bad::Value(format!(
                "{} {what}s for {} registered layers",
                items.len(),
                layers.len()
            )));
        }
        let arrays: Vec<Bound<'py, PyArrayDyn<f32>>> = items
            .iter()
            .zip(layers.iter())
            .enumerate()
            .map(|(i, (a, (name, shape)))| check_array(a, what, i, name, shape))
            .collect::<Result<_, _>>()?;
        Ok(arrays)
    }

    /// A bucket's layer ids (ints) and its arrays, checked against those
    /// layers' shapes. Ids that are not ints or out of range are this
    /// rank's misuse (`Err(Err)`: raised, nothing entered); bad arrays
    /// are carried to every rank (`Err(Ok(bad))`, with the ids).
    #[allow(clippy::type_complexity)]
    fn check_bucket<'py>(
        &self,
        layers: &Bound<'py, PyAny>,
        grads: &Bound<'py, PyAny>,
        what: &str,
    ) -> Result<(Vec<usize>, Vec<Bound<'py, PyArrayDyn<f32>>>), (Vec<usize>, Result<Bad, PyErr>)>
    {
        let table = Arc::clone(
            &*self
                .layers
                .lock()
                .map_err(|_| (vec![], Err(Error::new_err("poisoned"))))?,
        );
        let ids = layer_ids(layers).map_err(|e| (vec![], Err(e)))?;
        if let Some(&i) = ids.iter().find(|&&i| i >= table.len()) {
            let e = PyValueError::new_err(format!(
                "bucket names layer {i}; {} layers are registered",
                table.len()
            ));
            return Err((vec![], Err(e)));
        }
        let items: Vec<Bound<'py, PyAny>> = grads
            .try_iter()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>())
            .map_err(|_| {
                let bad = Bad::Type(format!("{what}s must be a list of numpy float32 arrays"));
                (ids.clone(), Ok(bad))
            })?;
        if items.len() != ids.len() {
            let bad = Bad::Value(format!(
                "{} {what}s for a bucket of {} layers",
                items.len(),
                ids.len()
            ));
            return Err((ids, Ok(bad)));
        }
        let arrays = items
            .iter()
            .zip(&ids)
            .map(|(a, &i)| check_array(a, what, i, &table[i].0, &table[i].1))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|bad| (ids.clone(), Ok(bad)))?;
        Ok((ids, arrays))
    }

    /// Fail this rank's bucket `ids` of the open step on every rank
    /// because of `bad` (found on this rank); raised here, the step fails
    /// alike everywhere at `finish_step`.
    fn fail_bucket_with(&self, py: Python<'_>, ids: &[usize], bad: Bad) -> PyErr {
        let mut g = match self.begin_bucket(py) {
            Ok(g) => g,
            Err(e) => return e,
        };
        let eng = g.as_mut().expect("checked open");
        let ids: Vec<LayerId> = ids.iter().map(|&i| LayerId(i)).collect();
        let text = bad.text().to_string();
        match py.detach(|| eng.fail_bucket(&ids, gradsync::Error::InvalidArgument(text))) {
            Ok(()) => bad.raise(None),
            Err(e) => engine_err(e),
        }
    }

    /// Fail this step on every rank because of `bad` (found on this rank).
    fn fail(&self, py: Python<'_>, bad: Bad) -> PyErr {
        let mut g = match self.begin(py) {
            Ok(g) => g,
            Err(e) => return e,
        };
        let eng = g.as_mut().expect("checked open");
        let text = bad.text().to_string();
        let e = py.detach(|| eng.fail_step(gradsync::Error::InvalidArgument(text)));
        bad.raise(Some(&e))
    }
}

/// Refuse arrays written in place (`written`: the gradients of `sync` and
/// `wait`) whose memory overlaps another array of the call (`read`: the
/// weights; [`gradsync::sync::first_overlap`]). numpy's borrow flags see
/// overlaps only between views of one base; arrays that reach the same
/// memory through different owners (DLPack imports, `np.frombuffer` of a
/// memoryview, `__array_interface__` wrappers) are caught here, by address.
fn no_overlap(
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

fn stats_dict(py: Python<'_>, stats: &gradsync::sync::StepStats) -> PyResult<Py<PyAny>> {
    let v = serde_json::to_value(stats).map_err(|e| Error::new_err(e.to_string()))?;
    json_to_py(py, &v)
}

fn json_to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
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

#[pymethods]
impl PyGradSync {
    /// Create an engine over a duplicate of `comm` (collective over `comm`).
    /// `options_json` is a flat JSON object of engine options; `error`,
    /// when given, is this rank's own failure to build them (the Python
    /// side's), which still enters the set-up collective.
    #[new]
    #[pyo3(signature = (comm, options_json, error=None))]
    fn new(
        py: Python<'_>,
        comm: &Bound<'_, PyAny>,
        options_json: &str,
        error: Option<String>,
    ) -> PyResult<Self> {
        let raw = raw_comm(comm)?;
        let my_rank: Option<usize> = comm.call_method0("Get_rank").and_then(|r| r.extract()).ok();
        let cfg = match &error {
            Some(why) => Err(gradsync::Error::InvalidArgument(why.clone())),
            None => Config::from_options_json(options_json),
        };
        let mine = cfg.is_err();
        // Options bad on this rank still enter the set-up agreement, which
        // fails every rank alike, naming this one.
        // SAFETY: `raw` came from MPI_Comm_f2c on an initialized MPI.
        let eng = py.detach(move || unsafe { Engine::from_raw_comm(raw.get(), cfg) });
        let eng = eng.map_err(|e| {
            // This rank's own options (or, once agreed, an option that
            // parses but is out of range here: momentum 1.5).
            let ours = mine
                || matches!((&e, my_rank), (gradsync::Error::RankFailed { failed, .. }, Some(me)) if failed.contains(&me));
            if ours {
                PyValueError::new_err(e.to_string())
            } else {
                engine_err(e)
            }
        })?;
        let delayed = eng.config().delay > 1;
        Ok(PyGradSync {
            inner: Mutex::new(Some(eng)),
            layers: Mutex::new(Arc::new(Vec::new())),
            delayed,
        })
    }

    /// Register a layer (collective); returns its index. Names must be
    /// unique, non-empty and free of control characters.
    #[pyo3(signature = (name, shape, strategy=None))]
    fn register(
        &self,
        py: Python<'_>,
        name: &Bound<'_, PyAny>,
        shape: &Bound<'_, PyAny>,
        strategy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        // Every argument is converted here, not by PyO3 before the call: a
        // wrong type on one rank must still enter the registration
        // collective (as an unparseable strategy carrying the reason).
        let name_r = to_str(name, "the layer name");
        let label = name_r.clone().unwrap_or_else(|_| "<bad name>".into());
        let spec_r = match strategy {
            None => Ok("auto".to_string()),
            Some(s) => to_str(s, &format!("the strategy of layer {label:?}")),
        };
        let dims_r: Result<Vec<usize>, String> = shape_of(shape, &label);
        let type_err = name_r
            .as_ref()
            .err()
            .or(spec_r.as_ref().err())
            .or(dims_r.as_ref().err())
            .cloned();
        let dims = dims_r.clone().unwrap_or_else(|_| vec![0]);
        let spec = spec_r.clone().unwrap_or_default();
        let local_bad = type_err.is_some()
            || (spec.trim() != "auto" && gradsync::sync::Strategy::parse(&spec).is_err());
        let mut g = self.collective(py)?;
        let eng = g.as_mut().expect("checked open");
        let id = py
            .detach(|| match &type_err {
                // Wrong argument types still enter the collective.
                Some(why) => Err(eng.fail_register(&label, gradsync::Error::InvalidArgument(why.clone()))),
                None => eng.register_spec(&label, &dims, &spec),
            })
            .map_err(|e| {
                // This rank's own bad argument (seen by the engine's checks
                // too, e.g. a density out of range, or an empty name) is a
                // ValueError here, also when other ranks failed as well
                // (every rank passing the same bad argument raises the same
                // type on every rank).
                let mine = local_bad
                    || matches!(&e, gradsync::Error::RankFailed { failed, .. } if failed.contains(&eng.rank()));
                match &type_err {
                    Some(why) => PyTypeError::new_err(format!("{why} (raised on every rank: {e})")),
                    None if mine => PyValueError::new_err(e.to_string()),
                    None => engine_err(e),
                }
            })?;
        let mut layers = self.layers.lock().map_err(|_| Error::new_err("poisoned"))?;
        Arc::make_mut(&mut layers).push((label, dims));
        Ok(id.0)
    }

    /// Every layer's strategy as JSON (`auto` resolved once the table is
    /// complete), which `register` takes back.
    fn strategies(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let g = self.engine(py)?;
        let eng = g.as_ref().expect("checked open");
        Ok((0..eng.num_layers())
            .filter_map(|i| eng.layer_strategy(gradsync::sync::LayerId(i)))
            .collect())
    }

    /// Declare the layer table complete now (collective; otherwise the
    /// first step does it): the table agreement and `auto`'s plan.
    fn complete_table(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.collective(py)?;
        let eng = g.as_mut().expect("checked open");
        py.detach(|| eng.complete_table()).map_err(engine_err)
    }

    /// The overlap model's plan of this table as a step in buckets against
    /// a backward pass of `backward_s` seconds (`GradSync::plan_buckets`):
    /// cut at `cap_bytes`, or at the cap of least predicted step time.
    /// Needs a profile and a complete table; local (give every rank the
    /// same `backward_s`).
    #[pyo3(signature = (backward_s, cap_bytes=None))]
    fn plan_buckets(
        &self,
        py: Python<'_>,
        backward_s: f64,
        cap_bytes: Option<usize>,
    ) -> PyResult<Py<PyAny>> {
        let g = self.engine(py)?;
        let eng = g.as_ref().expect("checked open");
        let plan = eng
            .plan_buckets(backward_s, cap_bytes)
            .map_err(engine_err)?;
        let v = serde_json::to_value(&plan).map_err(|e| Error::new_err(e.to_string()))?;
        json_to_py(py, &v)
    }

    /// Take part in this step carrying an error found on this rank (e.g. in
    /// the forward or backward pass), so that no peer waits: every rank's
    /// step fails alike; raises `gradsync.Error` here too.
    fn fail_step(&self, py: Python<'_>, reason: &Bound<'_, PyAny>) -> PyResult<()> {
        let text = reason
            .str()
            .map(|s| s.to_string())
            .unwrap_or_else(|_| "(unprintable reason)".into());
        let mut g = self.begin(py)?;
        let eng = g.as_mut().expect("checked open");
        let e = py.detach(|| eng.fail_step(gradsync::Error::InvalidArgument(text)));
        Err(engine_err(e))
    }

    /// One synchronous step in place; returns the step's stats as a dict.
    /// `weights` (one array per layer) are needed with weight decay (read)
    /// and with `delay > 1` (written: a communicating step puts back the
    /// weights every rank had at the last one).
    #[pyo3(signature = (grads, weights=None))]
    fn sync(
        &self,
        py: Python<'_>,
        grads: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        if dlpack::takes_dlpack(grads) {
            return self.sync_dlpack(py, grads, weights);
        }
        let arrays = match self.check_list(grads, "gradient") {
            Ok(a) => a,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        let warrays = match weights.map(|w| self.check_list(w, "weight")).transpose() {
            Ok(a) => a.unwrap_or_default(),
            Err(bad) => return Err(self.fail(py, bad)),
        };
        if let Err(bad) = no_overlap(&arrays, &warrays) {
            return Err(self.fail(py, bad));
        }
        let mut guards = match writable(&arrays) {
            Ok(g) => g,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        if self.delayed && weights.is_some() {
            // The delay window's weights are written back (`delay.rs`).
            let mut wguards = match writable_as(&warrays, "weight") {
                Ok(g) => g,
                Err(bad) => {
                    drop(guards);
                    return Err(self.fail(py, bad));
                }
            };
            let mut wslices = write_slices(&mut wguards);
            let mut slices = write_slices(&mut guards);
            let mut g = self.begin(py)?;
            let eng = g.as_mut().expect("checked open");
            let stats = py
                .detach(|| eng.sync_with_weights_mut(&mut slices, &mut wslices))
                .map_err(engine_err)?;
            return stats_dict(py, stats);
        }
        let wguards = match readable(&warrays, "weight") {
            Ok(g) => g,
            Err(bad) => {
                drop(guards);
                return Err(self.fail(py, bad));
            }
        };
        let wslices: Vec<&[f32]> = wguards
            .iter()
            .map(|g| g.as_slice().expect("checked C-contiguous"))
            .collect();
        let mut slices: Vec<&mut [f32]> = guards
            .iter_mut()
            .map(|g| g.as_slice_mut().expect("checked C-contiguous"))
            .collect();
        let mut g = self.begin(py)?;
        let eng = g.as_mut().expect("checked open");
        let with_w = weights.is_some();
        let stats = py
            .detach(|| match with_w {
                true => eng.sync_with_weights(&mut slices, &wslices),
                false => eng.sync(&mut slices),
            })
            .map_err(engine_err)?;
        stats_dict(py, stats)
    }

    /// Start a step (returns once this step's gradients are consumed).
    #[pyo3(signature = (grads, weights=None))]
    fn start(
        &self,
        py: Python<'_>,
        grads: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let arrays = match self.check_list(grads, "gradient") {
            Ok(a) => a,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        let warrays = match weights.map(|w| self.check_list(w, "weight")).transpose() {
            Ok(a) => a.unwrap_or_default(),
            Err(bad) => return Err(self.fail(py, bad)),
        };
        if self.delayed && weights.is_some() {
            // The delay window's weights are written back (`delay.rs`).
            let (guards, mut wguards) = match (
                readable(&arrays, "gradient"),
                writable_as(&warrays, "weight"),
            ) {
                (Ok(g), Ok(w)) => (g, w),
                (Err(bad), _) | (_, Err(bad)) => return Err(self.fail(py, bad)),
            };
            let (slices, mut wslices) = (read_slices(&guards), write_slices(&mut wguards));
            let mut g = self.begin(py)?;
            let eng = g.as_mut().expect("checked open");
            return py
                .detach(|| eng.start_with_weights_mut(&slices, &mut wslices))
                .map_err(engine_err);
        }
        let (guards, wguards) = match (readable(&arrays, "gradient"), readable(&warrays, "weight"))
        {
            (Ok(g), Ok(w)) => (g, w),
            (Err(bad), _) | (_, Err(bad)) => return Err(self.fail(py, bad)),
        };
        let (slices, wslices) = (read_slices(&guards), read_slices(&wguards));
        let mut g = self.begin(py)?;
        let eng = g.as_mut().expect("checked open");
        let with_w = weights.is_some();
        py.detach(|| match with_w {
            true => eng.start_with_weights(&slices, &wslices),
            false => eng.start(&slices),
        })
        .map_err(engine_err)
    }

    /// Finish the step begun by `start`, writing the results in place.
    fn wait(&self, py: Python<'_>, grads: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        // The exchange is already under way on every rank: a bad output
        // argument is this rank's alone, and the result stays in the engine
        // so that `wait` can be called again with the right arrays.
        let arrays = self
            .check_list(grads, "gradient")
            .map_err(|b| b.raise(None))?;
        no_overlap(&arrays, &[]).map_err(|b| b.raise(None))?;
        let mut guards = writable(&arrays).map_err(|b| b.raise(None))?;
        let mut slices: Vec<&mut [f32]> = guards
            .iter_mut()
            .map(|g| g.as_slice_mut().expect("checked C-contiguous"))
            .collect();
        let mut g = self.collective(py)?;
        let eng = g.as_mut().expect("checked open");
        let stats = py.detach(|| eng.wait(&mut slices)).map_err(engine_err)?;
        stats_dict(py, stats)
    }

    /// Submit one bucket of this step (`GradSync::submit_bucket`):
    /// `grads[j]` is layer `layers[j]`'s gradient (float32, C-contiguous;
    /// read, not written). Its compression runs here, its collectives on
    /// the engine's progress thread while the caller goes on. Every rank
    /// must cut the step alike (else every rank's `finish_step` raises).
    /// A bad array is carried to every rank (the step fails everywhere at
    /// `finish_step`) and raised here; a layer index out of range or
    /// already submitted is refused here alone.
    #[pyo3(signature = (layers, grads, weights=None))]
    fn submit_bucket(
        &self,
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (ids, arrays) = match self.check_bucket(layers, grads, "gradient") {
            Ok(x) => x,
            Err((_, Err(e))) => return Err(e),
            Err((ids, Ok(bad))) => return Err(self.fail_bucket_with(py, &ids, bad)),
        };
        let warrays = match weights
            .map(|w| self.check_bucket(layers, w, "weight"))
            .transpose()
        {
            Ok(a) => a.map(|x| x.1).unwrap_or_default(),
            Err((_, Err(e))) => return Err(e),
            Err((ids, Ok(bad))) => return Err(self.fail_bucket_with(py, &ids, bad)),
        };
        let lids: Vec<LayerId> = ids.iter().map(|&i| LayerId(i)).collect();
        if self.delayed && weights.is_some() {
            // The delay window's weights are written back (`delay.rs`).
            let (guards, mut wguards) = match (
                readable(&arrays, "gradient"),
                writable_as(&warrays, "weight"),
            ) {
                (Ok(g), Ok(w)) => (g, w),
                (Err(bad), _) | (_, Err(bad)) => return Err(self.fail_bucket_with(py, &ids, bad)),
            };
            let (slices, mut wslices) = (read_slices(&guards), write_slices(&mut wguards));
            let mut g = self.begin_bucket(py)?;
            let eng = g.as_mut().expect("checked open");
            return py
                .detach(|| eng.submit_bucket_with_weights_mut(&lids, &slices, &mut wslices))
                .map_err(engine_err);
        }
        let (guards, wguards) = match (readable(&arrays, "gradient"), readable(&warrays, "weight"))
        {
            (Ok(g), Ok(w)) => (g, w),
            (Err(bad), _) | (_, Err(bad)) => return Err(self.fail_bucket_with(py, &ids, bad)),
        };
        let (slices, wslices) = (read_slices(&guards), read_slices(&wguards));
        let mut g = self.begin_bucket(py)?;
        let eng = g.as_mut().expect("checked open");
        let with_w = weights.is_some();
        py.detach(|| match with_w {
            true => eng.submit_bucket_with_weights(&lids, &slices, &wslices),
            false => eng.submit_bucket(&lids, &slices),
        })
        .map_err(engine_err)
    }

    /// Submit bucket `layers` of this step carrying `reason`, a failure
    /// found on this rank: every rank's step fails alike at
    /// `finish_step`. Returns (the error comes from `finish_step`).
    fn fail_bucket(
        &self,
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        reason: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = layer_ids(layers)?;
        let text = reason
            .str()
            .map(|s| s.to_string())
            .unwrap_or_else(|_| "(unprintable reason)".into());
        let lids: Vec<LayerId> = ids.iter().map(|&i| LayerId(i)).collect();
        let mut g = self.begin_bucket(py)?;
        let eng = g.as_mut().expect("checked open");
        py.detach(|| eng.fail_bucket(&lids, gradsync::Error::InvalidArgument(text)))
            .map_err(engine_err)
    }

    /// Finish the step whose buckets were submitted, writing every layer's
    /// result in place into `grads` (one array per registered layer, as
    /// `wait`); layers never submitted fail the step on every rank.
    fn finish_step(&self, py: Python<'_>, grads: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.wait(py, grads)
    }

    /// Whether this rank has a step open (started or with buckets
    /// submitted) that `wait`/`finish_step` has not finished.
    fn pending(&self, py: Python<'_>) -> PyResult<bool> {
        let g = self.engine(py)?;
        Ok(g.as_ref().expect("checked open").pending())
    }

    /// Write this rank's engine state (collective-free).
    fn save_snapshot(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<()> {
        let path = to_path(path).map_err(PyTypeError::new_err)?;
        let mut g = self.engine(py)?;
        let eng = g.as_mut().expect("checked open");
        py.detach(move || eng.save_snapshot(&path))
            .map_err(engine_err)
    }

    /// Restore state written by `save_snapshot` (collective).
    fn load_snapshot(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<()> {
        // A path of the wrong type still enters the collective load,
        // carrying the reason, so every rank fails alike naming it.
        let p = to_path(path);
        let target = p.clone();
        // A step this rank kept after its wait() failed is finished first
        // (as sync and start do): refusing the load on this rank alone
        // left its peers waiting in the restore's agreement.
        let mut g = self.begin(py)?;
        let eng = g.as_mut().expect("checked open");
        let r = py.detach(move || match target {
            Ok(t) => eng.load_snapshot(&t),
            Err(why) => Err(eng.fail_restore(gradsync::Error::InvalidArgument(why))),
        });
        match (r, p) {
            (Ok(()), _) => Ok(()),
            (Err(e), Err(why)) => Err(PyTypeError::new_err(format!(
                "{why} (raised on every rank: {e})"
            ))),
            (Err(e), Ok(_)) => Err(engine_err(e)),
        }
    }

    /// The last step's stats as a dict.
    fn last_stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let g = self.engine(py)?;
        stats_dict(py, g.as_ref().expect("checked open").last_stats())
    }

    /// Registered layers: a list of (name, shape, strategy label).
    fn layers(&self, py: Python<'_>) -> PyResult<Vec<(String, Vec<usize>, String)>> {
        let g = self.engine(py)?;
        let eng = g.as_ref().expect("checked open");
        Ok((0..eng.num_layers())
            .filter_map(|i| eng.layer(gradsync::sync::LayerId(i)))
            .map(|(n, s, st)| (n.to_string(), s.to_vec(), st.label()))
            .collect())
    }

    /// This rank in the engine's communicator.
    #[getter]
    fn rank(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.engine(py)?.as_ref().expect("checked open").rank())
    }

    /// Number of ranks.
    #[getter]
    fn size(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.engine(py)?.as_ref().expect("checked open").size())
    }

    /// Steps run so far.
    #[getter]
    fn step(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.engine(py)?.as_ref().expect("checked open").step())
    }

    /// Free the engine and its duplicated communicator now (a local
    /// `MPI_Comm_free`, as on garbage collection). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        // As `engine()`: another thread may hold the engine inside a
        // GIL-free step, and needs the GIL to return: wait without it.
        let mut g = loop {
            match self.inner.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::WouldBlock) => {
                    py.detach(|| std::thread::sleep(std::time::Duration::from_micros(50)))
                }
                Err(std::sync::TryLockError::Poisoned(_)) => {
                    return Err(Error::new_err("the engine was poisoned by a panic"))
                }
            }
        };
        let Some(eng) = g.as_mut() else {
            return Ok(()); // closed already: no collective
        };
        // Every rank's close meets in one agreement: a peer in another
        // call (a step) gets an error naming both, not a wait for ever.
        // After that error the engine stays open; after any other (a
        // broken engine) it is closed all the same, with a warning.
        let broken = match py.detach(|| eng.prepare_close()) {
            Err(e @ gradsync::Error::CallMismatch(_)) => return Err(engine_err(e)),
            Err(e) => Some(format!("gradsync: close: {e} (closed all the same)")),
            Ok(()) => None,
        };
        let e = g.take();
        drop(g);
        py.detach(move || drop(e));
        if let Some(text) = broken {
            let msg = std::ffi::CString::new(text.replace('\0', " ")).expect("no NUL");
            let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
            let _ = PyErr::warn(py, category.as_any(), &msg, 1);
        }
        Ok(())
    }
}

/// In-place allreduce of a float32/float64 array over `comm`.
#[pyfunction]
#[pyo3(signature = (comm, array, algo=None, op=None))]
fn allreduce(
    py: Python<'_>,
    comm: &Bound<'_, PyAny>,
    array: &Bound<'_, PyAny>,
    algo: Option<&Bound<'_, PyAny>>,
    op: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let raw = raw_comm(comm)?;
    enum Arr<'py> {
        F32(PyReadwriteArrayDyn<'py, f32>),
        F64(PyReadwriteArrayDyn<'py, f64>),
    }
    // Everything rank-local first, converted here (not by PyO3 before the
    // call): a failure still enters the agreement, so no rank is left alone.
    let local = (|| -> Result<(Arr<'_>, AllreduceAlgo, ReduceOp), Bad> {
        let algo = match algo {
            None => AllreduceAlgo::Rabenseifner,
            Some(a) => {
                let name = to_str(a, "algo").map_err(Bad::Type)?;
                // `auto` is the engine's per-step choice, not a call's.
                match name.parse() {
                    Err(_) => {
                        return Err(Bad::Value(format!(
                            "unknown allreduce algorithm {name:?} (rabenseifner, ring, mpi, \
                             hierarchical; \"auto\" is an engine option, not an algorithm)"
                        )))
                    }
                    Ok(a) => a,
                }
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
        let rw =
            |e: numpy::BorrowError| Bad::Value(format!("array cannot be written in place ({e})"));
        let arr = if let Ok(a) = array.cast::<PyArrayDyn<f32>>() {
            contiguous(a.as_untyped())?;
            Arr::F32(a.try_readwrite().map_err(rw)?)
        } else if let Ok(a) = array.cast::<PyArrayDyn<f64>>() {
            contiguous(a.as_untyped())?;
            Arr::F64(a.try_readwrite().map_err(rw)?)
        } else {
            return Err(Bad::Type(format!(
                "array must be a numpy float32 or float64 array, got {}",
                array
                    .getattr("dtype")
                    .map(|d| format!("dtype {d}"))
                    .unwrap_or_else(|_| format!(
                        "a {}",
                        array
                            .get_type()
                            .name()
                            .map_or_else(|_| "?".to_string(), |n| n.to_string())
                    ))
            )));
        };
        Ok((arr, algo, op))
    })();
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
        // SAFETY: `raw` came from MPI_Comm_f2c on an initialized MPI.
        let comm = unsafe { gradsync::comm::MpiComm::duplicate_raw(raw.get()) }?;
        allreduce_agreed(&comm, call)
    });
    match (r, bad) {
        (Ok(()), _) => Ok(()),
        (Err(e), Some(bad)) => Err(bad.raise(Some(&e))),
        (Err(e), None) => Err(engine_err(e)),
    }
}

/// The cost model's prediction for one layer, as a dict (the JSON of
/// `gradsync predict --json`).
#[pyfunction]
#[pyo3(signature = (elements, ranks, density=0.001, profile=None, alpha=None, bandwidth=None,
    gamma_reduce=None, gamma_unpack=None, select_cost=None, select_fixed=None,
    select_method="trimmed", gradiveq_ratio=8.0, strategies=None, ranks_per_node=None,
    inter_alpha=None, inter_bandwidth=None, fill=None, shape=None, powersgd_rank=1))]
#[allow(clippy::too_many_arguments)]
fn predict(
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
fn python_flags(msg: &str) -> String {
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
fn mpi_library_version() -> String {
    gradsync::comm::mpi_library_version()
}

/// The table's layers (their f32 `elements`) cut into buckets of up to
/// `cap_bytes`, as the overlapped step submits them
/// (`gradsync::cost::cut_buckets`): indices, reverse registration order.
#[pyfunction]
fn cut_buckets(elements: Vec<usize>, cap_bytes: usize) -> Vec<Vec<usize>> {
    gradsync::cost::cut_buckets(&elements, cap_bytes)
}

/// The extension module.
#[pymodule]
fn _gradsync(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGradSync>()?;
    m.add_function(wrap_pyfunction!(allreduce, m)?)?;
    m.add_function(wrap_pyfunction!(predict, m)?)?;
    m.add_function(wrap_pyfunction!(mpi_library_version, m)?)?;
    m.add_function(wrap_pyfunction!(cut_buckets, m)?)?;
    m.add("FIRST_STEP_CAP_BYTES", gradsync::cost::FIRST_STEP_CAP_BYTES)?;
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
