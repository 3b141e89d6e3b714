//! DLPack import for `GradSync.sync`: gradients that are not all numpy
//! float32 arrays but export `__dlpack__` / `__dlpack_device__` (PyTorch
//! tensors, CuPy and JAX arrays, numpy float16 arrays), in place, in
//! float32, float16 or bfloat16 (`GradSync::sync_mixed`). CPU tensors go to the host
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

use crate::args::{stats_dict, Bad};
use gradsync::sync::Grad;
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

/// The element types the engine takes ([`gradsync::sync::Grad`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    /// From a DLPack `(code, bits, lanes)`: float (2) 32 or 16, bfloat (4) 16.
    fn from_dl(t: &DLDataType) -> Option<Dtype> {
        match (t.code, t.bits, t.lanes) {
            (2, 32, 1) => Some(Dtype::F32),
            (2, 16, 1) => Some(Dtype::F16),
            (4, 16, 1) => Some(Dtype::Bf16),
            _ => None,
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

/// One imported tensor: its data (`len` compact elements of `dtype`) and
/// where it lives; its deleter runs on drop.
pub(crate) struct Imported {
    managed: *mut DLManagedTensor,
    pub ptr: *mut u8,
    pub len: usize,
    pub dtype: Dtype,
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

/// Whether a step's `grads` take the DLPack path: a list or tuple with a
/// DLPack tensor ([`is_dlpack`]) or a numpy float16 array in it (numpy's
/// own path takes float32 arrays only); for other iterables, whether the
/// first item is a DLPack tensor (read without consuming a list).
pub(crate) fn takes_dlpack(grads: &Bound<'_, PyAny>) -> bool {
    use numpy::{PyArrayDescrMethods, PyUntypedArrayMethods};
    let half = |a: &Bound<'_, PyAny>| {
        a.cast::<numpy::PyUntypedArray>()
            .is_ok_and(|arr| arr.dtype().is_equiv_to(&numpy::dtype::<half::f16>(a.py())))
    };
    if let Ok(list) = grads.cast::<pyo3::types::PyList>() {
        return list.iter().any(|a| is_dlpack(&a) || half(&a));
    }
    if let Ok(tuple) = grads.cast::<pyo3::types::PyTuple>() {
        return tuple.iter().any(|a| is_dlpack(&a) || half(&a));
    }
    grads
        .try_iter()
        .ok()
        .and_then(|mut it| it.next())
        .is_some_and(|first| first.as_ref().is_ok_and(is_dlpack))
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
        dtype: Dtype::F32,
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
    imp.dtype = Dtype::from_dl(&t.dtype).ok_or_else(|| {
        Bad::Type(format!(
            "{at} must be float32, float16 or bfloat16, got DLPack dtype (code {}, bits {}, lanes {})",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        ))
    })?;
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
    if n > 0 && (t.data.is_null() || base % imp.dtype.size() != 0) {
        return Err(Bad::Value(format!(
            "{at}: data pointer {base:#x} is not a {:?} address",
            imp.dtype
        )));
    }
    imp.ptr = base as *mut u8;
    imp.len = n;
    Ok(imp)
}

impl crate::engine::PyGradSync {
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
            let mut grads: Vec<Grad<'_>> = imported.iter().map(host_grad).collect();
            py.detach(|| eng.sync_mixed(&mut grads).cloned())
        }
        .map_err(crate::engine_err)?;
        drop(g);
        drop(imported);
        stats_dict(py, &stats)
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
                "weights with DLPack gradients are not supported: pass float32 numpy arrays (for \
                 weight decay, or writable for delay > 1)"
                    .into(),
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
            if !a.hasattr("__dlpack__").unwrap_or(false) {
                let ty = a
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default();
                return Err(Bad::Type(format!(
                    "gradient {i} (layer {name:?}) is a {ty}: gradients must be numpy arrays or \
                     DLPack tensors of float32, float16 or bfloat16"
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
            .map(|t| (t.ptr as usize, t.dtype.size() * t.len, true))
            .collect();
        if let Some((a, b)) = gradsync::sync::first_overlap(&spans) {
            return Err(Bad::Value(format!(
                "gradients {a} and {b} share memory: gradsync writes each in place"
            )));
        }
        Ok(out)
    }
}

/// A CPU tensor's elements as the engine's [`Grad`] of its dtype.
fn host_grad(t: &Imported) -> Grad<'_> {
    macro_rules! slice {
        ($ty:ty) => {
            match t.len {
                0 => &mut [][..],
                // SAFETY: checked by `import`: `len` compact elements of
                // `dtype` at `ptr`, aligned, alive until the `Imported`
                // drops; distinct tensors do not overlap (`import_all`).
                n => unsafe { std::slice::from_raw_parts_mut(t.ptr.cast::<$ty>(), n) },
            }
        };
    }
    match t.dtype {
        Dtype::F32 => Grad::F32(slice!(f32)),
        Dtype::F16 => Grad::F16(slice!(half::f16)),
        Dtype::Bf16 => Grad::Bf16(slice!(half::bf16)),
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
            if t.dtype != Dtype::F32 {
                return Err(gradsync::Error::InvalidArgument(format!(
                    "gradient {i} is a {:?} CUDA tensor: the device path takes float32 \
                     (half-precision gradients are taken on the CPU)",
                    t.dtype
                )));
            }
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
