//! DLPack import for `GradSync.sync` (issue #16): gradients that are not
//! numpy arrays but export `__dlpack__` / `__dlpack_device__` (PyTorch
//! tensors, CuPy and JAX arrays), in place. CPU tensors go to the host
//! engine; CUDA tensors (with the `cuda` feature) to
//! `GradSync::sync_device` through `gpu::BorrowedCuda`. The producer's
//! stream is honoured as the DLPack protocol says: the capsule is asked
//! for with `stream=1` (the legacy default stream), so the producer makes
//! its pending work visible there, and gradsync's own stream waits for
//! the legacy default stream before it copies.
//!
//! The capsule is consumed as the protocol requires: renamed to
//! `used_dltensor` at once, and its deleter called when the [`Imported`]
//! is dropped (after the step).

use crate::Bad;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};
use std::ffi::{c_void, CStr};

/// `DLDeviceType` values.
pub(crate) const KDL_CPU: i32 = 1;
pub(crate) const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// One imported tensor: its `f32` data (`len` elements, compact) and
/// where it lives; its deleter runs on drop.
pub(crate) struct Imported {
    managed: *mut DLManagedTensor,
    pub ptr: *mut f32,
    pub len: usize,
    /// `KDL_CPU` (pinned CUDA host memory too) or `KDL_CUDA`.
    pub device: i32,
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: `managed` came from a "dltensor" capsule this import
        // renamed to "used_dltensor": the deleter is ours to call, once.
        unsafe {
            if let Some(d) = (*self.managed).deleter {
                d(self.managed);
            }
        }
    }
}

/// Whether `obj` takes the DLPack path: not a numpy array (those keep
/// numpy's own path) and it exports `__dlpack__`.
pub(crate) fn is_dlpack(obj: &Bound<'_, PyAny>) -> bool {
    obj.cast::<numpy::PyUntypedArray>().is_err() && obj.hasattr("__dlpack__").unwrap_or(false)
}

/// Import `obj` as gradient `i` of layer `name` (registered `shape`).
pub(crate) fn import(
    obj: &Bound<'_, PyAny>,
    what: &str,
    i: usize,
    name: &str,
    shape: &[usize],
) -> Result<Imported, Bad> {
    let at = format!("{what} {i} (layer {name:?})");
    let (device, _id): (i32, i32) = obj
        .call_method0("__dlpack_device__")
        .and_then(|d| d.extract())
        .map_err(|e| Bad::Type(format!("{at}: __dlpack_device__ failed: {e}")))?;
    let cap = if device == KDL_CUDA {
        let kw = PyDict::new(obj.py());
        kw.set_item("stream", 1)
            .map_err(|e| Bad::Type(e.to_string()))?;
        obj.call_method("__dlpack__", (), Some(&kw))
    } else {
        obj.call_method0("__dlpack__")
    }
    .map_err(|e| Bad::Type(format!("{at}: __dlpack__ failed: {e}")))?;
    let cap = cap
        .cast::<PyCapsule>()
        .map_err(|_| Bad::Type(format!("{at}: __dlpack__ did not return a capsule")))?;
    let ok_name = cap
        .name()
        .ok()
        .flatten()
        // SAFETY: the capsule is alive (held by `cap`), so is its name.
        .is_some_and(|n| unsafe { n.as_cstr() } == c"dltensor");
    if !ok_name {
        return Err(Bad::Type(format!(
            "{at}: __dlpack__ returned a capsule that is not an unused \"dltensor\""
        )));
    }
    let managed = cap
        .pointer_checked(Some(c"dltensor"))
        .map_err(|e| Bad::Type(format!("{at}: {e}")))?
        .as_ptr()
        .cast::<DLManagedTensor>();
    // Consumed from here on: the capsule's destructor must not delete it.
    const USED: &CStr = c"used_dltensor";
    // SAFETY: a live capsule; the name is a static C string.
    if unsafe { pyo3::ffi::PyCapsule_SetName(cap.as_ptr(), USED.as_ptr()) } != 0 {
        return Err(Bad::Type(format!("{at}: {}", PyErr::fetch(obj.py()))));
    }
    let mut imp = Imported {
        managed,
        ptr: std::ptr::null_mut(),
        len: 0,
        device: if device == KDL_CUDA_HOST {
            KDL_CPU
        } else {
            device
        },
    };
    // SAFETY: the producer keeps the tensor alive until its deleter runs.
    let t = unsafe { &(*managed).dl_tensor };
    if t.device.device_type != device {
        return Err(Bad::Value(format!(
            "{at}: __dlpack_device__ says device type {device}, the tensor {}",
            t.device.device_type
        )));
    }
    if imp.device != KDL_CPU && imp.device != KDL_CUDA {
        return Err(Bad::Type(format!(
            "{at} is on DLPack device type {device}: gradsync takes CPU and CUDA tensors"
        )));
    }
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (2, 32, 1) {
        return Err(Bad::Type(format!(
            "{at} must be float32, got DLPack dtype (code {}, bits {}, lanes {})",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        )));
    }
    let ndim = usize::try_from(t.ndim).unwrap_or(usize::MAX);
    if ndim > 64 || (ndim > 0 && t.shape.is_null()) {
        return Err(Bad::Value(format!("{at}: {} dimensions", t.ndim)));
    }
    // SAFETY: `shape` (and `strides` when not null) hold `ndim` entries.
    let dims: Vec<i64> = (0..ndim).map(|d| unsafe { *t.shape.add(d) }).collect();
    if dims.iter().any(|&d| d < 0) {
        return Err(Bad::Value(format!("{at}: negative shape {dims:?}")));
    }
    let got: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
    let n: usize = shape.iter().product();
    if got != shape && !(got.len() == 1 && got[0] == n) {
        return Err(Bad::Value(format!(
            "{at} has shape {got:?}, registered {shape:?} ({n} elements)"
        )));
    }
    if !t.strides.is_null() {
        let mut want = 1i64;
        for d in (0..ndim).rev() {
            // SAFETY: as above.
            let s = unsafe { *t.strides.add(d) };
            if dims[d] > 1 && s != want {
                return Err(Bad::Value(format!(
                    "{at} is not contiguous: gradsync works in place (call .contiguous() first)"
                )));
            }
            want = want.saturating_mul(dims[d]);
        }
    }
    let base = (t.data as usize).wrapping_add(t.byte_offset as usize);
    if n > 0 && (t.data.is_null() || base % std::mem::align_of::<f32>() != 0) {
        return Err(Bad::Value(format!(
            "{at}: data pointer {base:#x} is not a float32 address"
        )));
    }
    imp.ptr = base as *mut f32;
    imp.len = n;
    Ok(imp)
}

impl crate::PyGradSync {
    /// `sync` on DLPack tensors (all CPU, or all CUDA), in place.
    pub(crate) fn sync_dlpack(
        &self,
        py: Python<'_>,
        grads: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let imported = match self.import_all(grads, weights.is_some()) {
            Ok(v) => v,
            Err(bad) => return Err(self.fail(py, bad)),
        };
        let mut g = self.begin(py)?;
        let eng = g.as_mut().expect("checked open");
        let stats = if imported.first().is_some_and(|t| t.device == KDL_CUDA) {
            cuda_step(py, eng, &imported)
        } else {
            let mut slices: Vec<&mut [f32]> = imported
                .iter()
                .map(|t| match t.len {
                    0 => &mut [][..],
                    // SAFETY: checked by `import`: `len` compact float32s
                    // at `ptr`, alive until `imported` drops; distinct
                    // tensors do not overlap (`import_all`).
                    n => unsafe { std::slice::from_raw_parts_mut(t.ptr, n) },
                })
                .collect();
            py.detach(|| eng.sync(&mut slices).cloned())
        }
        .map_err(crate::engine_err)?;
        drop(g);
        drop(imported);
        crate::stats_dict(py, &stats)
    }

    fn import_all(&self, grads: &Bound<'_, PyAny>, weights: bool) -> Result<Vec<Imported>, Bad> {
        let layers = std::sync::Arc::clone(
            &*self
                .layers
                .lock()
                .map_err(|_| Bad::Value("poisoned".into()))?,
        );
        if weights {
            return Err(Bad::Type(
                "weights with DLPack gradients are not supported: pass numpy arrays for weight decay".into(),
            ));
        }
        let items: Vec<Bound<'_, PyAny>> = grads
            .try_iter()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>())
            .map_err(|e| Bad::Type(format!("gradients must be a list of tensors ({e})")))?;
        if items.len() != layers.len() {
            return Err(Bad::Value(format!(
                "{} gradients for {} registered layers",
                items.len(),
                layers.len()
            )));
        }
        let mut out = Vec::with_capacity(items.len());
        for (i, (a, (name, shape))) in items.iter().zip(layers.iter()).enumerate() {
            if !is_dlpack(a) {
                return Err(Bad::Type(format!(
                    "gradient {i} (layer {name:?}) is not a DLPack tensor, but gradient 0 is: pass all numpy arrays or all tensors"
                )));
            }
            out.push(import(a, "gradient", i, name, shape)?);
        }
        if out.iter().any(|t| t.device != out[0].device) {
            return Err(Bad::Value(
                "the gradients are on different devices (CPU and CUDA): pass all on one".into(),
            ));
        }
        // In place: no two gradients may share memory.
        let spans: Vec<(usize, usize, bool)> = out
            .iter()
            .map(|t| (t.ptr as usize, 4 * t.len, true))
            .collect();
        if let Some((a, b)) = gradsync::sync::first_overlap(&spans) {
            return Err(Bad::Value(format!(
                "gradients {a} and {b} share memory: gradsync writes each in place"
            )));
        }
        Ok(out)
    }
}

#[cfg(feature = "cuda")]
fn cuda_step(
    py: Python<'_>,
    eng: &mut gradsync::sync::GradSync,
    imported: &[Imported],
) -> gradsync::Result<gradsync::sync::StepStats> {
    use gradsync::gpu::BorrowedCuda;
    let bufs: gradsync::Result<Vec<BorrowedCuda>> = imported
        .iter()
        .enumerate()
        .map(|(i, t)| {
            // SAFETY: checked by `import`; the producer made its work
            // visible on the legacy default stream (`stream=1`), the
            // null `producer` here.
            unsafe { BorrowedCuda::new(t.ptr as u64, t.len, std::ptr::null_mut()) }
                .map_err(|e| gradsync::Error::InvalidArgument(format!("gradient {i}: {e}")))
        })
        .collect();
    match bufs {
        Ok(mut b) => py.detach(|| eng.sync_device(&mut b).cloned()),
        Err(e) => Err(py.detach(|| eng.fail_step(e))),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_step(
    py: Python<'_>,
    eng: &mut gradsync::sync::GradSync,
    _imported: &[Imported],
) -> gradsync::Result<gradsync::sync::StepStats> {
    Err(py.detach(|| {
        eng.fail_step(gradsync::Error::InvalidArgument(
            "CUDA tensors, but this gradsync was built without CUDA support (build the package with the cargo feature cuda: maturin build --features cuda)".into(),
        ))
    }))
}
