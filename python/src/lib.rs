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

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

mod args;
mod dlpack;
mod engine;
mod functions;

use engine::PyGradSync;
use functions::{allreduce, cut_buckets, mpi_library_version, predict};

pyo3::create_exception!(
    _gradsync,
    Error,
    PyRuntimeError,
    "An error from the gradsync engine. Collective errors (a rank failed in a step, layer tables differ, sizes differ) are raised alike on every rank."
);

pub(crate) fn engine_err(e: gradsync::Error) -> PyErr {
    Error::new_err(e.to_string())
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
