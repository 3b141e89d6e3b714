//! Device and page-locked buffers of [`super::cuda::CudaOps`]: grown on
//! demand, never shrunk, so a step in steady state allocates nothing;
//! reads back to the host through one page-locked landing buffer each.

use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, PinnedHostSlice};
use std::sync::Arc;

/// Start copying the first `len` elements of `src` into a page-locked
/// buffer kept in `pin` (grown as needed): one DMA, where a pageable copy
/// is staged by the driver; [`landed`] reads it after a wait for the
/// stream. The copy is the driver's own call on the stream, as
/// [`crate::gpu::CudaStaging`] does: cudarc's copy into a
/// `PinnedHostSlice` also records the slice's blocking-sync event.
pub(super) fn down_pinned<T: DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Clone>(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<T>,
    pin: &mut Option<PinnedHostSlice<T>>,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if len > src.len() {
        return Err(Error::InvalidArgument(format!(
            "reading {len} entries of a device buffer of {}",
            src.len()
        )));
    }
    if pin.as_ref().is_none_or(|p| p.len() < len) {
        *pin = None;
        // SAFETY: written by the copy below before it is read. Flags 0:
        // cached, not write-combined (the CPU reads it).
        let p = unsafe {
            stream
                .context()
                .alloc_pinned_with_flags::<T>(len.next_power_of_two(), 0)
        }
        .map_err(dev("pinned allocation"))?;
        *pin = Some(p);
    }
    // No event was ever recorded on it: this returns at once.
    let dst = pin
        .as_mut()
        .expect("allocated")
        .as_mut_slice()
        .map_err(dev("pinned buffer"))?;
    let (src_ptr, _guard) = cudarc::driver::DevicePtr::device_ptr(src, stream);
    // SAFETY: `dst` holds at least `len` elements of page-locked memory
    // owned by `pin`, which outlives the copy (waited for below); the
    // source holds at least `len` (checked).
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(&mut dst[..len], src_ptr, stream.cu_stream())
    }
    .map_err(dev("copy to the host"))
}

/// The first `len` elements of a landing buffer that [`down_pinned`]
/// filled, once the stream has been waited for.
pub(super) fn landed<T: DeviceRepr + cudarc::driver::ValidAsZeroBits + Clone>(
    pin: &mut Option<PinnedHostSlice<T>>,
    len: usize,
) -> Result<Vec<T>> {
    match pin {
        Some(p) if len > 0 => Ok(p.as_mut_slice().map_err(dev("pinned buffer"))?[..len].to_vec()),
        _ => Ok(Vec::new()),
    }
}

/// At least one element (a zero-length device allocation is refused).
pub(super) fn pad<T: Copy + Default>(v: &[T]) -> Vec<T> {
    if v.is_empty() {
        vec![T::default()]
    } else {
        v.to_vec()
    }
}

/// Grow `slot` to at least `len` elements (contents not kept).
pub(super) fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<()> {
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        *slot = None;
        *slot = Some(
            stream
                .alloc_zeros::<T>(len.max(1).next_power_of_two())
                .map_err(dev("allocation"))?,
        );
    }
    Ok(())
}

/// A driver error as the crate's, naming what failed.
pub(super) fn dev(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Device(format!("{what}: {e}"))
}
