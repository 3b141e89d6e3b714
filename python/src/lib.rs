//! `gradsync._gradsync`: the Python extension behind the `gradsync` package
//! (issue #12). A thin layer over the Rust engine ([`gradsync::sync`]) and
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
use gradsync::sync::{Config, GradSync as Engine};
use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::sync::Mutex;

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

/// A raw communicator handle from an mpi4py communicator (or a Fortran
/// integer handle, as `comm.py2f()` returns).
fn raw_comm(comm: &Bound<'_, PyAny>) -> PyResult<RawComm> {
    let f: i64 = if let Ok(i) = comm.extract::<i64>() {
        i
    } else {
        comm.call_method0("py2f")
            .map_err(|_| {
                PyTypeError::new_err(format!(
                    "comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD), got {}",
                    comm.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })?
            .extract()?
    };
    gradsync::comm::mpi_ready().map_err(engine_err)?;
    // SAFETY: MPI is initialized; MPI_Comm_f2c accepts any integer and
    // returns MPI_COMM_NULL (or an invalid handle MPI reports) for junk.
    let raw = unsafe { mpi::ffi::RSMPI_Comm_f2c(f as _) };
    Ok(RawComm(raw))
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

/// One gradient argument: a NumPy float32 array, C-contiguous, of the
/// layer's shape (or flat with the layer's size).
fn check_array<'py>(
    a: &Bound<'py, PyAny>,
    i: usize,
    name: &str,
    shape: &[usize],
) -> Result<Bound<'py, PyArrayDyn<f32>>, Bad> {
    let arr = a.cast::<PyArrayDyn<f32>>().map_err(|_| {
        let what = a
            .getattr("dtype")
            .map(|d| format!("an array of dtype {d}"))
            .unwrap_or_else(|_| {
                format!(
                    "a {}",
                    a.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                )
            });
        Bad::Type(format!(
            "gradient {i} (layer {name:?}) must be a numpy float32 array, got {what}"
        ))
    })?;
    if !arr.is_c_contiguous() {
        return Err(Bad::Value(format!(
            "gradient {i} (layer {name:?}) is not C-contiguous: gradsync works in place (np.ascontiguousarray would copy)"
        )));
    }
    let n: usize = shape.iter().product();
    let got = arr.shape();
    if got != shape && !(got.len() == 1 && got[0] == n) {
        return Err(Bad::Value(format!(
            "gradient {i} (layer {name:?}) has shape {got:?}, registered {shape:?} ({n} elements)"
        )));
    }
    Ok(arr.clone())
}

/// Write access to every array (numpy's borrow flags: read-only arrays and
/// an array passed twice are refused).
fn writable<'py>(
    arrays: &[Bound<'py, PyArrayDyn<f32>>],
) -> Result<Vec<PyReadwriteArrayDyn<'py, f32>>, Bad> {
    arrays
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.try_readwrite().map_err(|e| {
                Bad::Value(format!(
                    "gradient {i} cannot be written in place ({e}): read-only, or the same array passed twice"
                ))
            })
        })
        .collect()
}

/// The synchronization engine (see `gradsync.GradSync`).
#[pyclass(module = "gradsync._gradsync", name = "GradSync")]
struct PyGradSync {
    inner: Mutex<Option<Engine>>,
    /// (name, shape) of the registered layers, for argument checks.
    layers: Mutex<Vec<(String, Vec<usize>)>>,
}

type Held<'a> = std::sync::MutexGuard<'a, Option<Engine>>;

impl PyGradSync {
    fn engine(&self) -> PyResult<Held<'_>> {
        let g = self
            .inner
            .lock()
            .map_err(|_| Error::new_err("the engine was poisoned by a panic"))?;
        if g.is_none() {
            return Err(Error::new_err("the engine is closed"));
        }
        Ok(g)
    }

    fn check_list<'py>(
        &self,
        grads: &Bound<'py, PyAny>,
    ) -> Result<Vec<Bound<'py, PyArrayDyn<f32>>>, Bad> {
        let layers = self
            .layers
            .lock()
            .map_err(|_| Bad::Value("poisoned".into()))?;
        let items: Vec<Bound<'py, PyAny>> = grads
            .try_iter()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>())
            .map_err(|_| Bad::Type("gradients must be a list of numpy float32 arrays".into()))?;
        if items.len() != layers.len() {
            return Err(Bad::Value(format!(
                "{} gradients for {} registered layers",
                items.len(),
                layers.len()
            )));
        }
        items
            .iter()
            .zip(layers.iter())
            .enumerate()
            .map(|(i, (a, (name, shape)))| check_array(a, i, name, shape))
            .collect()
    }

    /// Fail this step on every rank because of `bad` (found on this rank).
    fn fail(&self, py: Python<'_>, bad: Bad) -> PyErr {
        let mut g = match self.engine() {
            Ok(g) => g,
            Err(e) => return e,
        };
        let eng = g.as_mut().expect("checked open");
        let text = bad.text().to_string();
        let e = py.detach(|| eng.fail_step(gradsync::Error::InvalidArgument(text)));
        bad.raise(Some(&e))
    }
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
    /// `options_json` is a flat JSON object of engine options.
    #[new]
    fn new(py: Python<'_>, comm: &Bound<'_, PyAny>, options_json: &str) -> PyResult<Self> {
        let raw = raw_comm(comm)?;
        let my_rank: Option<usize> = comm.call_method0("Get_rank").and_then(|r| r.extract()).ok();
        // Options that are bad on this rank still enter the engine's set-up
        // collective (which fails every rank alike, naming this one); the
        // local check only picks the exception type raised here.
        let local = Config::from_options_json(options_json).err();
        let json = options_json.to_string();
        // SAFETY: `raw` came from MPI_Comm_f2c on an initialized MPI.
        let eng = py.detach(move || unsafe { Engine::from_raw_comm_options(raw.get(), &json) });
        let eng = eng.map_err(|e| match &local {
            Some(mine) => PyValueError::new_err(format!("{mine} (raised on every rank: {e})")),
            // An option that parses but is out of range here (momentum 1.5).
            None if matches!(&e, gradsync::Error::RankFailed { rank, .. } if Some(*rank) == my_rank) => {
                PyValueError::new_err(e.to_string())
            }
            None => engine_err(e),
        })?;
        Ok(PyGradSync {
            inner: Mutex::new(Some(eng)),
            layers: Mutex::new(Vec::new()),
        })
    }

    /// Register a layer (collective); returns its index.
    #[pyo3(signature = (name, shape, strategy="auto"))]
    fn register(
        &self,
        py: Python<'_>,
        name: &str,
        shape: &Bound<'_, PyAny>,
        strategy: &str,
    ) -> PyResult<usize> {
        let dims: Result<Vec<usize>, String> = if let Ok(n) = shape.extract::<usize>() {
            Ok(vec![n])
        } else {
            shape.extract::<Vec<usize>>().map_err(|_| {
                format!("shape of layer {name:?} must be a tuple of non-negative ints, got {shape}")
            })
        };
        let mut g = self.engine()?;
        let eng = g.as_mut().expect("checked open");
        // A bad shape still enters the registration collective (as an
        // unparseable strategy carrying the reason), so peers never wait.
        let (dims_ok, spec) = match &dims {
            Ok(d) => (d.clone(), strategy.to_string()),
            Err(why) => (vec![0], format!("<{why}>")),
        };
        let local_bad = dims.is_err()
            || (strategy.trim() != "auto" && gradsync::sync::Strategy::parse(strategy).is_err());
        let id = py
            .detach(|| eng.register_spec(name, &dims_ok, &spec))
            .map_err(|e| {
                // This rank's own bad argument (seen by the engine's checks
                // too, e.g. a density out of range) is a ValueError here.
                let mine = local_bad
                    || matches!(&e, gradsync::Error::RankFailed { rank, .. } if *rank == eng.rank());
                match &dims {
                    Err(why) => PyTypeError::new_err(format!("{why} ({e})")),
                    Ok(_) if mine => PyValueError::new_err(e.to_string()),
                    Ok(_) => engine_err(e),
                }
            })?;
        self.layers
            .lock()
            .map_err(|_| Error::new_err("poisoned"))?
            .push((name.to_string(), dims_ok));
        Ok(id.0)
    }

    /// One synchronous step in place; returns the step's stats as a dict.
    fn sync(&self, py: Python<'_>, grads: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let arrays = match self.check_list(grads) {
            Ok(a) => a,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        let mut guards = match writable(&arrays) {
            Ok(g) => g,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        let mut slices: Vec<&mut [f32]> = guards
            .iter_mut()
            .map(|g| g.as_slice_mut().expect("checked C-contiguous"))
            .collect();
        let mut g = self.engine()?;
        let eng = g.as_mut().expect("checked open");
        let stats = py.detach(|| eng.sync(&mut slices)).map_err(engine_err)?;
        stats_dict(py, stats)
    }

    /// Start a step (returns once this step's gradients are consumed).
    fn start(&self, py: Python<'_>, grads: &Bound<'_, PyAny>) -> PyResult<()> {
        let arrays = match self.check_list(grads) {
            Ok(a) => a,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        let guards: Vec<PyReadonlyArrayDyn<'_, f32>> = match arrays
            .iter()
            .map(|a| a.try_readonly())
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(g) => g,
            Err(e) => {
                return Err(self.fail(
                    py,
                    Bad::Value(format!("a gradient is being written elsewhere ({e})")),
                ))
            }
        };
        let slices: Vec<&[f32]> = guards
            .iter()
            .map(|g| g.as_slice().expect("checked C-contiguous"))
            .collect();
        let mut g = self.engine()?;
        let eng = g.as_mut().expect("checked open");
        py.detach(|| eng.start(&slices)).map_err(engine_err)
    }

    /// Finish the step begun by `start`, writing the results in place.
    fn wait(&self, py: Python<'_>, grads: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        // The exchange is already under way on every rank: a bad output
        // argument is this rank's alone, and the result stays in the engine
        // so that `wait` can be called again with the right arrays.
        let arrays = self.check_list(grads).map_err(|b| b.raise(None))?;
        let mut guards = writable(&arrays).map_err(|b| b.raise(None))?;
        let mut slices: Vec<&mut [f32]> = guards
            .iter_mut()
            .map(|g| g.as_slice_mut().expect("checked C-contiguous"))
            .collect();
        let mut g = self.engine()?;
        let eng = g.as_mut().expect("checked open");
        let stats = py.detach(|| eng.wait(&mut slices)).map_err(engine_err)?;
        stats_dict(py, stats)
    }

    /// Write this rank's engine state (collective-free).
    fn save_snapshot(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let mut g = self.engine()?;
        let eng = g.as_mut().expect("checked open");
        py.detach(move || eng.save_snapshot(&path))
            .map_err(engine_err)
    }

    /// Restore state written by `save_snapshot` (collective).
    fn load_snapshot(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let mut g = self.engine()?;
        let eng = g.as_mut().expect("checked open");
        py.detach(|| eng.load_snapshot(&path)).map_err(engine_err)
    }

    /// The last step's stats as a dict.
    fn last_stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let g = self.engine()?;
        stats_dict(py, g.as_ref().expect("checked open").last_stats())
    }

    /// Registered layers: a list of (name, shape, strategy label).
    fn layers(&self) -> PyResult<Vec<(String, Vec<usize>, String)>> {
        let g = self.engine()?;
        let eng = g.as_ref().expect("checked open");
        Ok((0..eng.num_layers())
            .filter_map(|i| eng.layer(gradsync::sync::LayerId(i)))
            .map(|(n, s, st)| (n.to_string(), s.to_vec(), st.label()))
            .collect())
    }

    /// This rank in the engine's communicator.
    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.engine()?.as_ref().expect("checked open").rank())
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> PyResult<usize> {
        Ok(self.engine()?.as_ref().expect("checked open").size())
    }

    /// Steps run so far.
    #[getter]
    fn step(&self) -> PyResult<u64> {
        Ok(self.engine()?.as_ref().expect("checked open").step())
    }

    /// Free the engine and its duplicated communicator now (a local
    /// `MPI_Comm_free`, as on garbage collection). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let e = self
            .inner
            .lock()
            .map_err(|_| Error::new_err("poisoned"))?
            .take();
        py.detach(move || drop(e));
        Ok(())
    }
}

/// In-place allreduce of a float32/float64 array over `comm`.
#[pyfunction]
#[pyo3(signature = (comm, array, algo="rabenseifner", op="sum"))]
fn allreduce(
    py: Python<'_>,
    comm: &Bound<'_, PyAny>,
    array: &Bound<'_, PyAny>,
    algo: &str,
    op: &str,
) -> PyResult<()> {
    let raw = raw_comm(comm)?;
    // Everything rank-local first; a failure still enters the agreement.
    let algo_r: Result<AllreduceAlgo, Bad> = algo
        .parse()
        .map_err(|e: gradsync::Error| Bad::Value(e.to_string()));
    let op_r: Result<ReduceOp, Bad> = match op {
        "sum" => Ok(ReduceOp::Sum),
        "average" | "avg" | "mean" => Ok(ReduceOp::Average),
        _ => Err(Bad::Value(format!("unknown op {op:?} (sum, average)"))),
    };
    enum Arr<'py> {
        F32(PyReadwriteArrayDyn<'py, f32>),
        F64(PyReadwriteArrayDyn<'py, f64>),
    }
    let arr: Result<Arr<'_>, Bad> = (|| {
        let contiguous = |c: bool| {
            if c {
                Ok(())
            } else {
                Err(Bad::Value(
                    "array is not C-contiguous (gradsync works in place)".into(),
                ))
            }
        };
        let rw =
            |e: numpy::BorrowError| Bad::Value(format!("array cannot be written in place ({e})"));
        if let Ok(a) = array.cast::<PyArrayDyn<f32>>() {
            contiguous(a.is_c_contiguous())?;
            return Ok(Arr::F32(a.try_readwrite().map_err(rw)?));
        }
        if let Ok(a) = array.cast::<PyArrayDyn<f64>>() {
            contiguous(a.is_c_contiguous())?;
            return Ok(Arr::F64(a.try_readwrite().map_err(rw)?));
        }
        Err(Bad::Type(format!(
            "array must be a numpy float32 or float64 array, got {}",
            array
                .getattr("dtype")
                .map(|d| format!("dtype {d}"))
                .unwrap_or_else(|_| "no array".into())
        )))
    })();
    let mut first_bad = None;
    let (algo_v, op_v, mut arr_v) = (algo_r.ok(), op_r.ok(), None);
    match arr {
        Ok(a) => arr_v = Some(a),
        Err(b) => first_bad = Some(b),
    }
    if first_bad.is_none() && algo_v.is_none() {
        first_bad = Some(Bad::Value(format!(
            "unknown algo {algo:?} (rabenseifner, ring, mpi)"
        )));
    }
    if first_bad.is_none() && op_v.is_none() {
        first_bad = Some(Bad::Value(format!("unknown op {op:?} (sum, average)")));
    }
    let text = first_bad.as_ref().map(|b| b.text().to_string());
    let r = {
        let buf: gradsync::Result<AnyBuf<'_>> = match (&text, arr_v.as_mut()) {
            (None, Some(Arr::F32(a))) => Ok(AnyBuf::F32(a.as_slice_mut().expect("contiguous"))),
            (None, Some(Arr::F64(a))) => Ok(AnyBuf::F64(a.as_slice_mut().expect("contiguous"))),
            (Some(t), _) => Err(gradsync::Error::InvalidArgument(t.clone())),
            (None, None) => Err(gradsync::Error::InvalidArgument("no array".into())),
        };
        let algo = algo_v.unwrap_or(AllreduceAlgo::Rabenseifner);
        let op = op_v.unwrap_or(ReduceOp::Sum);
        py.detach(move || {
            // SAFETY: `raw` came from MPI_Comm_f2c on an initialized MPI.
            let comm = unsafe { gradsync::comm::MpiComm::duplicate_raw(raw.get()) }?;
            allreduce_agreed(&comm, buf, algo, op)
        })
    };
    match (r, first_bad) {
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
    select_method="trimmed", gradiveq_ratio=8.0, strategies=None))]
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
) -> PyResult<Py<PyAny>> {
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
    let m = gradsync::cli::ModelArgs {
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
    };
    let rec = m
        .profile()
        .and_then(|p| gradsync::cli::predict_record(&p, &m, elements, ranks, density))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let v = serde_json::to_value(&rec).map_err(|e| Error::new_err(e.to_string()))?;
    json_to_py(py, &v)
}

/// `MPI_Get_library_version` of the MPI library this extension is linked with.
#[pyfunction]
fn mpi_library_version() -> String {
    gradsync::comm::mpi_library_version()
}

/// The extension module.
#[pymodule]
fn _gradsync(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGradSync>()?;
    m.add_function(wrap_pyfunction!(allreduce, m)?)?;
    m.add_function(wrap_pyfunction!(predict, m)?)?;
    m.add_function(wrap_pyfunction!(mpi_library_version, m)?)?;
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
