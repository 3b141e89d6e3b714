//! Gradients on the GPU: what exists so far.
//!
//! * [`cuda_aware`]: whether the MPI library takes device pointers, from
//!   its run-time `MPIX_Query_cuda_support()` (looked up with `dlsym`) and
//!   the override `GRADSYNC_CUDA_AWARE=auto|0|1`; built with or without
//!   the `cuda` feature, since it needs no CUDA library.
//! * [`staged_allreduce`]: the allreduce of a device buffer through pinned
//!   host staging buffers, in chunks, with the device↔host copies
//!   overlapped with the chunks' allreduces: the path for an MPI that is
//!   not CUDA-aware. Written I/O-free ([`schedule`], [`DeviceCopies`]) and
//!   tested under `mpirun` on [`HostMemory`], a host-memory model of a
//!   stream.
//! * [`device_allreduce`]: the same, or, where MPI is CUDA-aware and the
//!   sum is MPI's own, the device addresses straight to MPI's blocking
//!   `MPI_Allreduce` ([`Route`]); the ranks agree on the route first.
//!   Tested under `mpirun` on [`HostMemory`] with `GRADSYNC_CUDA_AWARE=1`
//!   (host addresses, which any MPI takes); never yet on a GPU.
//! * [`probe`]: the GPU this process can use, or why none (`libcuda` not
//!   found, no device, built without the feature), never a panic. With
//!   the `cuda` feature the CUDA driver is loaded at run time (cudarc's
//!   dynamic loading), so the crate builds and its CPU tests run on
//!   machines without CUDA; `CudaStaging` is [`DeviceCopies`] over a
//!   CUDA stream, events and pinned host buffers.
//!
//! * [`sparse`]: the device-resident sparse step (RedSync §5.2–5.3 on
//!   the GPU: error feedback, threshold search, compaction and
//!   scatter-add as kernels; only the selected units cross to the host),
//!   over [`sparse::SparseOps`]: the kernels or their CPU reference.
//!
//! The engine takes device buffers through this module
//! (`GradSync::sync_device`, C's `gs_sync_device`, Python's DLPack CUDA
//! tensors), staged. Not here: device-side reduction for gradsync's own
//! dense algorithms and the average on the direct route. All of it ran
//! on an H200 (`hpc/gpu/check.sh`; docs/benchmarks/gpu.md), the direct
//! route only on the host model (no CUDA-aware MPI there).

mod aware;
#[cfg(feature = "cuda")]
mod cuda;
pub mod sparse;
mod staging;

pub use aware::{cuda_aware, query_mpi, CudaAware, Override, Query, ENV as CUDA_AWARE_ENV};
#[cfg(feature = "cuda")]
pub use cuda::{BorrowedCuda, CudaStaging};
pub use staging::{
    device_allreduce, schedule, staged_allreduce, Action, DeviceCopies, HostMemory, Route,
    StagingOptions, StagingReport, DEFAULT_CHUNK_ELEMS, SLOTS,
};

use serde::Serialize;

/// The GPU [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// CUDA devices visible to this process.
    pub devices: usize,
    /// Ordinal of the device described (0).
    pub ordinal: usize,
    /// Its name.
    pub name: String,
    /// Its compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. 13000).
    pub driver_version: i32,
}

/// The GPU this process can use (device 0), or why none can be used: a
/// one-line reason (`built without the cuda feature`, `libcuda not
/// found`, `no CUDA device`, a driver error). Never panics, with or
/// without a CUDA driver on the machine.
pub fn probe() -> std::result::Result<DeviceInfo, String> {
    #[cfg(feature = "cuda")]
    {
        cuda::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("gradsync was built without the cuda feature".into())
    }
}
