//! `GradSync`: the engine ([`gradsync::sync::GradSync`]) behind a mutex,
//! its arguments checked on every rank before the step's collectives and
//! the GIL released while it communicates.

use crate::args::{
    check_array, json_to_py, layer_ids, no_overlap, raw_comm, read_slices, readable, shape_of,
    stats_dict, to_path, to_str, writable, writable_as, write_slices, Bad,
};
use crate::dlpack;
use crate::{engine_err, Error};
use gradsync::sync::{Config, GradSync as Engine, LayerId};
use numpy::PyArrayDyn;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// The synchronization engine (see `gradsync.GradSync`).
#[pyclass(module = "gradsync._gradsync", name = "GradSync")]
pub(crate) struct PyGradSync {
    pub(crate) inner: Mutex<Option<Engine>>,
    /// (name, shape) of the registered layers, for argument checks (an
    /// `Arc` so a step takes a snapshot and holds no lock while it looks at
    /// Python objects, which may run Python code).
    pub(crate) layers: Mutex<LayerTable>,
    /// `delay > 1`: the weights are borrowed writable (a communicating
    /// step writes the delay window's weights back into them).
    pub(crate) delayed: bool,
}

/// (name, shape) of each registered layer.
pub(crate) type LayerTable = Arc<Vec<(String, Vec<usize>)>>;

pub(crate) type Held<'a> = std::sync::MutexGuard<'a, Option<Engine>>;

impl PyGradSync {
    /// The engine's slot, locked, open or closed. Another Python thread may
    /// hold it inside a GIL-free call (a `sync`); waiting for it with the
    /// GIL held would deadlock (that thread needs the GIL to return), so
    /// wait without it.
    fn lock(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        loop {
            match self.inner.try_lock() {
                Ok(g) => return Ok(g),
                Err(std::sync::TryLockError::WouldBlock) => {
                    py.detach(|| std::thread::sleep(std::time::Duration::from_micros(50)))
                }
                Err(std::sync::TryLockError::Poisoned(_)) => {
                    return Err(Error::new_err("the engine was poisoned by a panic"))
                }
            }
        }
    }

    /// The engine, locked ([`lock`](Self::lock)); an error once closed.
    pub(crate) fn engine(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        let g = self.lock(py)?;
        if g.is_none() {
            return Err(Error::new_err("the engine is closed"));
        }
        Ok(g)
    }

    /// The engine, locked, for a call that communicates: MPI must still be
    /// up (after `MPI.Finalize()` an MPI call aborts the process).
    pub(crate) fn collective(&self, py: Python<'_>) -> PyResult<Held<'_>> {
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
    pub(crate) fn begin(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        self.begin_if(py, Engine::pending)
    }

    /// [`begin`](Self::begin) for a bucket: only a step whose every layer
    /// was submitted (its `finish_step` raised on this rank) is finished
    /// first; an open step with layers still to come takes the bucket.
    pub(crate) fn begin_bucket(&self, py: Python<'_>) -> PyResult<Held<'_>> {
        self.begin_if(py, Engine::pending_finish)
    }

    pub(crate) fn begin_if(
        &self,
        py: Python<'_>,
        stale: fn(&Engine) -> bool,
    ) -> PyResult<Held<'_>> {
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

    pub(crate) fn check_list<'py>(
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
    pub(crate) fn check_bucket<'py>(
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
    pub(crate) fn fail_bucket_with(&self, py: Python<'_>, ids: &[usize], bad: Bad) -> PyErr {
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
    pub(crate) fn fail(&self, py: Python<'_>, bad: Bad) -> PyErr {
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
        let mut g = self.lock(py)?;
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
