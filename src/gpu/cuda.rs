//! The CUDA side of [`super`] (feature `cuda`): the probe,
//! [`CudaStaging`] and [`BorrowedCuda`] (a caller's device pointer, from
//! C or DLPack), through cudarc with the driver loaded at run time.
//!
//! A missing `libcuda` makes cudarc panic at the first driver call, so
//! every entry point here checks [`driver_present`] first and returns an
//! error instead.

use super::{DeviceCopies, DeviceInfo};
use crate::{Error, Result};
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError,
    PinnedHostSlice,
};
use std::ops::Range;
use std::sync::Arc;

/// Whether the CUDA driver library can be loaded.
fn driver_present() -> bool {
    // SAFETY: only tries to load the library (dlopen); no driver call.
    unsafe { sys::is_culib_present() }
}

fn device_err(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e}"))
}

fn need_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(Error::Device(
            "libcuda not found (no CUDA driver on this machine)".into(),
        ))
    }
}

pub(crate) fn probe() -> std::result::Result<DeviceInfo, String> {
    if !driver_present() {
        return Err("libcuda not found (no CUDA driver on this machine)".into());
    }
    let devices = match CudaContext::device_count() {
        Ok(n) => n,
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => {
            return Err("no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)".into())
        }
        Err(e) => return Err(format!("the CUDA driver failed: {e}")),
    };
    if devices <= 0 {
        return Err("no CUDA device".into());
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("CUDA device 0: {e}"))?;
    let name = ctx.name().map_err(|e| format!("CUDA device 0: {e}"))?;
    let compute_capability = ctx
        .compute_capability()
        .map_err(|e| format!("CUDA device 0: {e}"))?;
    let mut driver_version = 0;
    // SAFETY: the driver is loaded (checked above); one out-parameter.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion: {e}"))?;
    Ok(DeviceInfo {
        devices: devices as usize,
        ordinal: 0,
        name,
        compute_capability,
        driver_version,
    })
}

/// [`DeviceCopies`] over a CUDA device buffer: the copies are
/// `cuMemcpy{DtoH,HtoD}Async` on one stream (so they complete in issue
/// order), fences are events recorded after each copy to the host, and
/// the staging slots are page-locked host memory allocated without the
/// write-combined flag (the CPU reads them: write-combined memory is slow
/// to read).
pub struct CudaStaging {
    stream: Arc<CudaStream>,
    buf: CudaSlice<f32>,
    slots: Slots,
    /// The direct route's device scratch chunk.
    scratch: Option<CudaSlice<f32>>,
}

impl CudaStaging {
    /// Stage `buf`, whose copies run on `stream`.
    pub fn new(stream: Arc<CudaStream>, buf: CudaSlice<f32>) -> Self {
        let slots = Slots {
            stream: stream.clone(),
            v: Vec::new(),
        };
        CudaStaging {
            stream,
            buf,
            slots,
            scratch: None,
        }
    }

    /// A copy of `data` on device `ordinal`, on a new stream.
    pub fn from_host(ordinal: usize, data: &[f32]) -> Result<Self> {
        need_driver()?;
        let ctx = CudaContext::new(ordinal).map_err(device_err("CUDA context"))?;
        let stream = ctx.new_stream().map_err(device_err("CUDA stream"))?;
        let buf = if data.is_empty() {
            stream.null()
        } else {
            stream.clone_htod(data)
        }
        .map_err(device_err("copy to the device"))?;
        Ok(Self::new(stream, buf))
    }

    /// The device buffer, copied to the host (waits for the stream).
    pub fn to_host(&self) -> Result<Vec<f32>> {
        if self.buf.is_empty() {
            return Ok(Vec::new());
        }
        self.stream
            .clone_dtoh(&self.buf)
            .map_err(device_err("copy to the host"))
    }

    /// The device buffer back (after the stream's pending copies).
    pub fn into_inner(self) -> Result<CudaSlice<f32>> {
        self.stream
            .synchronize()
            .map_err(device_err("stream synchronize"))?;
        Ok(self.buf)
    }

    fn device_ptr(&self, range: &Range<usize>) -> Result<sys::CUdeviceptr> {
        // The raw driver calls below run in the calling thread's current
        // context: make it the stream's.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(device_err("cuCtxSetCurrent"))?;
        if range.end > self.buf.len() {
            return Err(Error::InvalidArgument(format!(
                "staging copy of {range:?}: the device buffer has {} elements",
                self.buf.len()
            )));
        }
        let (base, _record) = self.buf.device_ptr(&self.stream);
        Ok(base + (range.start * std::mem::size_of::<f32>()) as sys::CUdeviceptr)
    }

    fn host_slot(&mut self, slot: usize, len: usize) -> Result<&mut [f32]> {
        let s = self
            .slots
            .v
            .get_mut(slot)
            .ok_or_else(|| Error::InvalidArgument(format!("no staging slot {slot}")))?;
        let s = s.as_mut_slice().map_err(device_err("pinned slot"))?;
        if len > s.len() {
            return Err(Error::InvalidArgument(format!(
                "staging copy of {len} elements into a slot of {}",
                s.len()
            )));
        }
        Ok(&mut s[..len])
    }
}

/// The pinned staging slots, which must outlive the copies into and out
/// of them: dropping them first waits for the stream.
struct Slots {
    stream: Arc<CudaStream>,
    v: Vec<PinnedHostSlice<f32>>,
}

impl Drop for Slots {
    fn drop(&mut self) {
        if self.v.is_empty() {
            return;
        }
        if let Err(e) = self.stream.synchronize() {
            log::error!("CudaStaging: stream synchronize before freeing the pinned slots: {e}");
        }
    }
}

impl DeviceCopies for CudaStaging {
    type Fence = CudaEvent;

    fn len(&self) -> usize {
        self.buf.len()
    }

    fn prepare(&mut self, slots: usize, elems: usize) -> Result<()> {
        if self.slots.v.len() >= slots && self.slots.v.iter().all(|s| s.len() >= elems) {
            return Ok(());
        }
        self.stream
            .synchronize()
            .map_err(device_err("stream synchronize"))?;
        self.slots.v.clear();
        let ctx = self.stream.context().clone();
        for _ in 0..slots {
            // SAFETY: the memory is uninitialized until a copy fills it; the
            // pipeline reads a slot only after the copy into it completed.
            // Flags 0: cached, not write-combined (the CPU reads it).
            let s = unsafe { ctx.alloc_pinned_with_flags::<f32>(elems.max(1), 0) }
                .map_err(device_err("pinned host allocation"))?;
            self.slots.v.push(s);
        }
        Ok(())
    }

    fn slot(&mut self, slot: usize) -> Result<&mut [f32]> {
        let len = self.slots.v.get(slot).map_or(0, |s| s.len());
        self.host_slot(slot, len)
    }

    fn start_to_host(&mut self, range: Range<usize>, slot: usize) -> Result<CudaEvent> {
        let src = self.device_ptr(&range)?;
        let cu_stream = self.stream.cu_stream();
        let dst = self.host_slot(slot, range.len())?;
        // SAFETY: `src` is `range` of the device buffer (checked), `dst`
        // pinned memory owned by `self`, which synchronizes the stream
        // before freeing it; the pipeline does not touch `dst` before the
        // fence returned here has been waited on.
        unsafe { result::memcpy_dtoh_async(dst, src, cu_stream) }
            .map_err(device_err("cuMemcpyDtoHAsync"))?;
        self.stream
            .record_event(None)
            .map_err(device_err("cuEventRecord"))
    }

    fn start_to_device(&mut self, slot: usize, range: Range<usize>) -> Result<()> {
        let dst = self.device_ptr(&range)?;
        let cu_stream = self.stream.cu_stream();
        let src = self.host_slot(slot, range.len())?;
        // SAFETY: as in `start_to_host`; the pipeline writes `src` again
        // only after a later copy into it, which the stream orders after
        // this one, has been waited on.
        unsafe { result::memcpy_htod_async(dst, src, cu_stream) }
            .map_err(device_err("cuMemcpyHtoDAsync"))
    }

    fn wait(&mut self, fence: CudaEvent) -> Result<()> {
        fence
            .synchronize()
            .map_err(device_err("cuEventSynchronize"))
    }

    fn synchronize(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(device_err("cuStreamSynchronize"))
    }

    fn prepare_direct(&mut self, elems: usize) -> Result<()> {
        if self.scratch.as_ref().is_some_and(|s| s.len() >= elems) {
            return Ok(());
        }
        self.scratch = None;
        let s = self
            .stream
            .alloc_zeros::<f32>(elems.max(1))
            .map_err(device_err("device scratch allocation"))?;
        self.scratch = Some(s);
        Ok(())
    }

    fn direct_ptrs(&mut self, range: Range<usize>) -> Result<(*const f32, *mut f32)> {
        let src = self.device_ptr(&range)?;
        let scratch = self.scratch_ptr(range.len())?;
        // MPI does not order itself after the stream: wait for it.
        self.synchronize()?;
        Ok((src as usize as *const f32, scratch as usize as *mut f32))
    }

    fn commit_direct(&mut self, range: Range<usize>) -> Result<()> {
        let dst = self.device_ptr(&range)?;
        let src = self.scratch_ptr(range.len())?;
        // SAFETY: both ranges checked against their allocations; the copy
        // completes before this returns.
        unsafe {
            result::memcpy_dtod_async(
                dst,
                src,
                range.len() * std::mem::size_of::<f32>(),
                self.stream.cu_stream(),
            )
        }
        .map_err(device_err("cuMemcpyDtoDAsync"))?;
        self.synchronize()
    }
}

impl CudaStaging {
    fn scratch_ptr(&self, len: usize) -> Result<sys::CUdeviceptr> {
        match &self.scratch {
            Some(s) if s.len() >= len => Ok(s.device_ptr(&self.stream).0),
            _ => Err(Error::InvalidArgument(format!(
                "direct allreduce of {len} elements: the device scratch is smaller"
            ))),
        }
    }
}

impl CudaStaging {
    /// Wait for the stream, free the staging memory and give up the
    /// device buffer without freeing it (it is the caller's).
    fn release_borrowed(self) {
        if let Err(e) = self.stream.synchronize() {
            log::error!("BorrowedCuda: stream synchronize before releasing the buffer: {e}");
        }
        let CudaStaging {
            buf,
            slots,
            scratch,
            ..
        } = self;
        drop(scratch);
        drop(slots);
        // A zero-length buffer is cudarc's null slice: nothing to keep.
        let _ = buf.leak();
    }
}

/// [`DeviceCopies`] over a caller's CUDA device memory (a raw device
/// pointer from the C ABI, or a DLPack tensor's data): [`CudaStaging`] on
/// gradsync's own stream of the pointer's device, ordered after
/// `producer`, the stream the caller's last writes ran on (an event
/// recorded there, waited for by gradsync's stream). The memory stays the
/// caller's: dropping this waits for gradsync's copies and never frees it.
pub struct BorrowedCuda {
    inner: Option<CudaStaging>,
}

impl BorrowedCuda {
    /// Borrow `len` `f32`s at device address `ptr`.
    ///
    /// # Safety
    /// `ptr` is a CUDA device allocation (or inside one) holding at least
    /// `len` `f32`s, valid and not written by other work until this is
    /// dropped; `producer` is null (the legacy default stream) or a live
    /// stream of the pointer's context.
    pub unsafe fn new(ptr: u64, len: usize, producer: *mut std::ffi::c_void) -> Result<Self> {
        need_driver()?;
        if len > 0 && ptr == 0 {
            return Err(Error::InvalidArgument("a null device pointer".into()));
        }
        let mut ordinal: i32 = -1;
        if len > 0 {
            // SAFETY: `ordinal` is a live i32, the attribute's type; the
            // driver only reads `ptr`'s address.
            unsafe {
                sys::cuPointerGetAttribute(
                    (&mut ordinal as *mut i32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                )
            }
            .result()
            .map_err(|e| {
                Error::InvalidArgument(format!(
                    "{ptr:#x} is not CUDA device memory (cuPointerGetAttribute: {e})"
                ))
            })?;
        }
        let ctx = CudaContext::new(ordinal.max(0) as usize).map_err(device_err("CUDA context"))?;
        let stream = ctx.new_stream().map_err(device_err("CUDA stream"))?;
        ctx.bind_to_thread()
            .map_err(device_err("cuCtxSetCurrent"))?;
        // gradsync's stream waits for the producer's work so far.
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(device_err("cuEventCreate"))?;
        // SAFETY: `ev` was just created; `producer` is null or a live
        // stream of this context (the caller's contract).
        let ordered = unsafe { result::event::record(ev, producer as sys::CUstream) }
            .and_then(|()| {
                // SAFETY: our live stream and event.
                unsafe {
                    result::stream::wait_event(
                        stream.cu_stream(),
                        ev,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
            })
            .map_err(device_err("ordering after the producer's stream"));
        // Destroying an event with work still waiting on it is allowed.
        // SAFETY: `ev` is not used after this.
        let _ = unsafe { result::event::destroy(ev) };
        ordered?;
        let buf = if len == 0 {
            stream.null().map_err(device_err("empty buffer"))?
        } else {
            // SAFETY: `ptr` holds `len` f32s of this context, valid until
            // this value is dropped (the caller's contract).
            unsafe { stream.upgrade_device_ptr::<f32>(ptr, len) }
        };
        Ok(BorrowedCuda {
            inner: Some(CudaStaging::new(stream, buf)),
        })
    }

    fn get(&mut self) -> &mut CudaStaging {
        self.inner.as_mut().expect("present until dropped")
    }
}

impl Drop for BorrowedCuda {
    fn drop(&mut self) {
        if let Some(s) = self.inner.take() {
            s.release_borrowed();
        }
    }
}

impl DeviceCopies for BorrowedCuda {
    type Fence = CudaEvent;
    fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |s| s.len())
    }
    fn prepare(&mut self, slots: usize, elems: usize) -> Result<()> {
        self.get().prepare(slots, elems)
    }
    fn slot(&mut self, slot: usize) -> Result<&mut [f32]> {
        self.get().slot(slot)
    }
    fn start_to_host(&mut self, range: Range<usize>, slot: usize) -> Result<CudaEvent> {
        self.get().start_to_host(range, slot)
    }
    fn start_to_device(&mut self, slot: usize, range: Range<usize>) -> Result<()> {
        self.get().start_to_device(slot, range)
    }
    fn wait(&mut self, fence: CudaEvent) -> Result<()> {
        self.get().wait(fence)
    }
    fn synchronize(&mut self) -> Result<()> {
        self.get().synchronize()
    }
    fn prepare_direct(&mut self, elems: usize) -> Result<()> {
        self.get().prepare_direct(elems)
    }
    fn direct_ptrs(&mut self, range: Range<usize>) -> Result<(*const f32, *mut f32)> {
        self.get().direct_ptrs(range)
    }
    fn commit_direct(&mut self, range: Range<usize>) -> Result<()> {
        self.get().commit_direct(range)
    }
}
