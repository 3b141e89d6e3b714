//! The device sparse path's kernels: `kernels.cu` compiled to PTX by NVRTC
//! once per process (contraction off, so the device's sums are the host's),
//! loaded into a context, and the launch shapes the operations use.

use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::sync::Arc;

use super::cuda_mem::dev;

const SRC: &str = include_str!("kernels.cu");
pub(super) const THREADS: u32 = 256;

pub(super) struct Kernels {
    pub(super) accumulate: CudaFunction,
    pub(super) nonfinite: CudaFunction,
    pub(super) abs_stats: CudaFunction,
    pub(super) seg_sum: CudaFunction,
    pub(super) seg_offsets: CudaFunction,
    pub(super) count_multi: CudaFunction,
    pub(super) count_above: CudaFunction,
    pub(super) scan_blocks: CudaFunction,
    pub(super) compact: CudaFunction,
    pub(super) clear_sent: CudaFunction,
    pub(super) scatter_add: CudaFunction,
}

/// `kernels.cu` compiled to PTX by NVRTC, contraction off (no GPU
/// needed: NVRTC alone).
pub fn compile_kernels() -> Result<cudarc::nvrtc::Ptx> {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Device(
            "libnvrtc not found (the device sparse path compiles its kernels at run time: \
             put CUDA's lib64 on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        fmad: Some(false),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SRC, opts)
        .map_err(|e| Error::Device(format!("NVRTC compiling kernels.cu: {e}")))
}

/// The kernels built for `ctx` (compiled once per process).
pub(super) fn build(ctx: &Arc<CudaContext>) -> Result<Kernels> {
    static PTX: std::sync::OnceLock<std::result::Result<String, String>> =
        std::sync::OnceLock::new();
    let src = PTX
        .get_or_init(|| {
            compile_kernels()
                .map(|p| p.to_src())
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Error::Device)?;
    let ptx = cudarc::nvrtc::Ptx::from_src(src);
    let m = ctx.load_module(ptx).map_err(dev("loading the kernels"))?;
    let f = |name: &'static str| m.load_function(name).map_err(dev(name));
    Ok(Kernels {
        accumulate: f("gs_accumulate_stats")?,
        nonfinite: f("gs_nonfinite")?,
        abs_stats: f("gs_abs_stats")?,
        seg_sum: f("gs_seg_sum")?,
        seg_offsets: f("gs_seg_offsets")?,
        count_multi: f("gs_count_multi")?,
        count_above: f("gs_count_above")?,
        scan_blocks: f("gs_scan_blocks")?,
        compact: f("gs_compact")?,
        clear_sent: f("gs_clear_sent")?,
        scatter_add: f("gs_scatter_add")?,
    })
}

pub(super) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 132 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn blocks(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per entry (the kernels without a stride loop).
pub(super) fn grid_exact(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    /// The kernels compile (NVRTC, where its library is found; no GPU
    /// needed), and the PTX has every kernel and no fused multiply-add.
    #[test]
    fn kernels_compile_without_contraction() {
        let ptx = match super::compile_kernels() {
            Ok(p) => p.to_src(),
            Err(e) if e.to_string().contains("libnvrtc not found") => {
                println!("kernels_compile_without_contraction: skipped: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        for k in [
            "gs_accumulate_stats",
            "gs_nonfinite",
            "gs_abs_stats",
            "gs_seg_sum",
            "gs_seg_offsets",
            "gs_count_multi",
            "gs_count_above",
            "gs_scan_blocks",
            "gs_compact",
            "gs_clear_sent",
            "gs_scatter_add",
        ] {
            assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing");
        }
        assert!(
            !ptx.contains("fma.rn.f32"),
            "a float multiply-add was contracted"
        );
    }
}
