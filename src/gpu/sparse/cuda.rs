//! [`SparseOps`] on a CUDA device: the kernels of `kernels.cu`
//! (`cuda_kernels.rs` compiles them at run time by NVRTC, loaded like the
//! driver, so a machine without CUDA builds and fails here with a reason,
//! never a panic), launched on one stream. Every layer's work is one
//! launch; what comes back to the host is per-layer statistics and counts
//! and the selected entries.

use super::{AbsStats, Compacted, SparseOps, CHUNK, MAX_T};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PinnedHostSlice, PushKernelArg};
use std::sync::Arc;

use super::cuda_kernels::{blocks, build, grid, grid_exact, Kernels};
use super::cuda_mem::{dev, down_pinned, ensure, landed, pad};

/// The block tables: block `b` covers `[blk_start[b], min(+CHUNK,
/// seg_end[blk_seg[b]]))`.
struct Tables {
    nblk: usize,
    blk_seg: CudaSlice<u32>,
    blk_start: CudaSlice<u64>,
    seg_begin: CudaSlice<u64>,
    seg_end: CudaSlice<u64>,
    seg_first_blk: CudaSlice<u32>,
    seg_nblk: CudaSlice<u32>,
}

/// The device buffers and scratch of a [`super::DeviceSparse`] step on a GPU.
pub struct CudaOps {
    stream: Arc<CudaStream>,
    k: Kernels,
    sizes: Vec<usize>,
    n: usize,
    t: Tables,
    grads: CudaSlice<f32>,
    v: CudaSlice<f32>,
    u: CudaSlice<f32>,
    part_sum: CudaSlice<f64>,
    part_cnt: CudaSlice<u32>,
    seg_max: CudaSlice<u32>,
    /// Per layer: the sum's bits, the count, the maximum's bits.
    seg_stats: CudaSlice<u64>,
    thr: CudaSlice<f32>,
    nthr: CudaSlice<u32>,
    hist: CudaSlice<u64>,
    thr1: CudaSlice<f32>,
    blk_cnt: CudaSlice<u32>,
    blk_off: CudaSlice<u64>,
    seg_total: CudaSlice<u64>,
    seg_out: CudaSlice<u64>,
    flag: CudaSlice<u32>,
    out_idx: Option<CudaSlice<u32>>,
    out_val: Option<CudaSlice<f32>>,
    in_idx: Option<CudaSlice<u64>>,
    in_val: Option<CudaSlice<f32>>,
    /// Page-locked landing buffers of the selected entries.
    pin_idx: Option<PinnedHostSlice<u32>>,
    pin_val: Option<PinnedHostSlice<f32>>,
    /// The block statistics of the current `V` are in the partials (the
    /// accumulation took them).
    stats_fresh: bool,
    /// `GRADSYNC_GPU_TRACE` set: each operation's phases timed (the
    /// stream waited for after each) on standard error.
    trace: bool,
}

impl CudaOps {
    /// Zeroed buffers for layers of `sizes` on device `ordinal`, its
    /// kernels compiled.
    pub fn new(ordinal: usize, sizes: &[usize]) -> Result<Self> {
        if let Err(why) = crate::gpu::probe() {
            return Err(Error::Device(why));
        }
        let ctx = CudaContext::new(ordinal).map_err(dev("CUDA context"))?;
        // SAFETY: every buffer of this context object is used on its one
        // stream only, so cudarc's per-use events (an event record and a
        // wait per buffer argument of every launch once a process has
        // several streams) order nothing the stream does not.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(dev("CUDA stream"))?;
        let k = build(&ctx)?;
        let nseg = sizes.len();
        let (mut blk_seg, mut blk_start) = (Vec::new(), Vec::new());
        let (mut seg_begin, mut seg_end, mut seg_first, mut seg_nblk) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut off = 0u64;
        for (s, &len) in sizes.iter().enumerate() {
            seg_begin.push(off);
            seg_end.push(off + len as u64);
            seg_first.push(blk_seg.len() as u32);
            let nb = len.div_ceil(CHUNK);
            seg_nblk.push(nb as u32);
            for b in 0..nb {
                blk_seg.push(s as u32);
                blk_start.push(off + (b * CHUNK) as u64);
            }
            off += len as u64;
        }
        let n = off as usize;
        let nblk = blk_seg.len();
        let up32 = |v: &[u32]| stream.clone_htod(&pad(v)).map_err(dev("tables"));
        let up64 = |v: &[u64]| stream.clone_htod(&pad(v)).map_err(dev("tables"));
        let t = Tables {
            nblk,
            blk_seg: up32(&blk_seg)?,
            blk_start: up64(&blk_start)?,
            seg_begin: up64(&seg_begin)?,
            seg_end: up64(&seg_end)?,
            seg_first_blk: up32(&seg_first)?,
            seg_nblk: up32(&seg_nblk)?,
        };
        let z32 = |len: usize| {
            stream
                .alloc_zeros::<f32>(len.max(1))
                .map_err(dev("allocation"))
        };
        let zu32 = |len: usize| {
            stream
                .alloc_zeros::<u32>(len.max(1))
                .map_err(dev("allocation"))
        };
        let zu64 = |len: usize| {
            stream
                .alloc_zeros::<u64>(len.max(1))
                .map_err(dev("allocation"))
        };
        let zf64 = |len: usize| {
            stream
                .alloc_zeros::<f64>(len.max(1))
                .map_err(dev("allocation"))
        };
        Ok(CudaOps {
            grads: z32(n)?,
            v: z32(n)?,
            u: z32(n)?,
            part_sum: zf64(nblk)?,
            part_cnt: zu32(nblk)?,
            seg_max: zu32(nseg)?,
            seg_stats: zu64(3 * nseg)?,
            thr: z32(nseg * MAX_T)?,
            nthr: zu32(nseg)?,
            hist: zu64(nseg * (MAX_T + 1))?,
            thr1: z32(nseg)?,
            blk_cnt: zu32(nblk)?,
            blk_off: zu64(nblk)?,
            seg_total: zu64(nseg)?,
            seg_out: zu64(nseg)?,
            flag: zu32(1)?,
            out_idx: None,
            out_val: None,
            in_idx: None,
            in_val: None,
            pin_idx: None,
            pin_val: None,
            stats_fresh: false,
            trace: std::env::var_os("GRADSYNC_GPU_TRACE").is_some(),
            stream,
            k,
            sizes: sizes.to_vec(),
            n,
            t,
        })
    }

    /// The stream every operation runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The fused gradient buffer (input, then the result). Write it on
    /// [`stream`](Self::stream), or wait for your own stream's writes
    /// before the step: this context keeps no per-buffer events, so work
    /// on another stream is not ordered with the step's.
    pub fn grads(&mut self) -> &mut CudaSlice<f32> {
        &mut self.grads
    }

    /// The gradients from the host (all layers, fused).
    pub fn upload_grads(&mut self, g: &[f32]) -> Result<()> {
        self.check_len(g.len())?;
        if self.n > 0 {
            self.stream
                .memcpy_htod(g, &mut self.grads)
                .map_err(dev("copy to the device"))?;
        }
        Ok(())
    }

    /// The gradient buffer to the host.
    pub fn download_grads(&self) -> Result<Vec<f32>> {
        self.down(&self.grads)
    }

    /// The residual to the host.
    pub fn download_residual(&self) -> Result<Vec<f32>> {
        self.down(&self.v)
    }

    /// The residual from the host (checks: start from a known `V`).
    pub fn upload_residual(&mut self, v: &[f32]) -> Result<()> {
        self.check_len(v.len())?;
        self.stats_fresh = false;
        if self.n > 0 {
            self.stream
                .memcpy_htod(v, &mut self.v)
                .map_err(dev("copy to the device"))?;
        }
        Ok(())
    }

    /// `grads = V`, a device-to-device copy (the bandwidth a selection
    /// is measured against).
    pub fn copy_residual_to_grads(&mut self) -> Result<()> {
        if self.n > 0 {
            self.stream
                .memcpy_dtod(&self.v, &mut self.grads)
                .map_err(dev("device-to-device copy"))?;
        }
        Ok(())
    }

    /// The gradient buffer zeroed.
    pub fn zero_grads(&mut self) -> Result<()> {
        if self.n > 0 {
            self.stream
                .memset_zeros(&mut self.grads)
                .map_err(dev("memset"))?;
        }
        Ok(())
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len != self.n {
            return Err(Error::InvalidArgument(format!(
                "{len} elements for the device buffers of {}",
                self.n
            )));
        }
        Ok(())
    }

    fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        s: &CudaSlice<T>,
    ) -> Result<Vec<T>> {
        self.down_n(s, self.n)
    }

    fn down_n<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        s: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        if len > 0 {
            self.stream
                .memcpy_dtoh(&s.slice(0..len), &mut out)
                .map_err(dev("copy to the host"))?;
        }
        self.sync()?;
        Ok(out)
    }

    /// The compaction's write pass into the first `cap` output entries.
    fn compact_write(&mut self, cap: usize) -> Result<()> {
        let s = self.stream.clone();
        let (oi, ov) = (
            self.out_idx.as_mut().expect("capacity"),
            self.out_val.as_mut().expect("capacity"),
        );
        let t = &self.t;
        let cap = cap as u64;
        // SAFETY: out_idx/out_val hold at least `cap` entries, and the
        // kernel writes none at or past it; each block writes its own range.
        unsafe {
            s.launch_builder(&self.k.compact)
                .arg(&self.v)
                .arg(&t.blk_seg)
                .arg(&t.blk_start)
                .arg(&t.seg_end)
                .arg(&t.seg_begin)
                .arg(&self.thr1)
                .arg(&self.blk_off)
                .arg(&self.seg_out)
                .arg(oi)
                .arg(ov)
                .arg(&cap)
                .launch(blocks(t.nblk))
        }
        .map_err(dev("gs_compact"))?;
        Ok(())
    }

    /// With tracing on, wait for the stream and print the time since `t`.
    fn mark(&self, what: &str, t: &mut std::time::Instant) {
        if self.trace {
            let _ = self.stream.synchronize();
            eprintln!(
                "gpu-trace {what}: {:.1} us",
                t.elapsed().as_secs_f64() * 1e6
            );
            *t = std::time::Instant::now();
        }
    }

    /// Wait for the stream.
    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev("stream synchronize"))
    }

    fn nseg(&self) -> usize {
        self.sizes.len()
    }
}

impl SparseOps for CudaOps {
    fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    fn grads_nonfinite(&mut self) -> Result<bool> {
        if self.n == 0 {
            return Ok(false);
        }
        self.stream
            .memset_zeros(&mut self.flag)
            .map_err(dev("memset"))?;
        let n = self.n as u64;
        // SAFETY: the kernel reads n floats of grads and writes flag[0].
        unsafe {
            self.stream
                .launch_builder(&self.k.nonfinite)
                .arg(&self.grads)
                .arg(&n)
                .arg(&mut self.flag)
                .launch(grid(self.n))
        }
        .map_err(dev("gs_nonfinite"))?;
        Ok(self.down_n(&self.flag, 1)?[0] != 0)
    }

    fn accumulate(&mut self, momentum: f32, nesterov: bool) -> Result<()> {
        self.stats_fresh = false;
        if self.t.nblk == 0 {
            return Ok(());
        }
        self.stream
            .memset_zeros(&mut self.seg_max)
            .map_err(dev("memset"))?;
        let nest = i32::from(nesterov);
        let t = &self.t;
        // SAFETY: g, v, u hold n floats; the tables describe nblk blocks
        // inside them; partials hold nblk entries, seg_max nseg.
        unsafe {
            self.stream
                .launch_builder(&self.k.accumulate)
                .arg(&self.grads)
                .arg(&mut self.v)
                .arg(&mut self.u)
                .arg(&momentum)
                .arg(&nest)
                .arg(&t.blk_seg)
                .arg(&t.blk_start)
                .arg(&t.seg_end)
                .arg(&mut self.part_sum)
                .arg(&mut self.part_cnt)
                .arg(&mut self.seg_max)
                .launch(blocks(t.nblk))
        }
        .map_err(dev("gs_accumulate_stats"))?;
        self.stats_fresh = true;
        Ok(())
    }

    fn stats(&mut self) -> Result<Vec<AbsStats>> {
        let nseg = self.nseg();
        if nseg == 0 {
            return Ok(Vec::new());
        }
        let t = &self.t;
        if t.nblk > 0 && !self.stats_fresh {
            self.stream
                .memset_zeros(&mut self.seg_max)
                .map_err(dev("memset"))?;
            // SAFETY: the tables describe nblk blocks inside v; partials
            // hold nblk entries, seg_max nseg.
            unsafe {
                self.stream
                    .launch_builder(&self.k.abs_stats)
                    .arg(&self.v)
                    .arg(&t.blk_seg)
                    .arg(&t.blk_start)
                    .arg(&t.seg_end)
                    .arg(&mut self.part_sum)
                    .arg(&mut self.part_cnt)
                    .arg(&mut self.seg_max)
                    .launch(blocks(t.nblk))
            }
            .map_err(dev("gs_abs_stats"))?;
        }
        // SAFETY: one block per layer over its nblk partials.
        unsafe {
            self.stream
                .launch_builder(&self.k.seg_sum)
                .arg(&self.part_sum)
                .arg(&self.part_cnt)
                .arg(&t.seg_first_blk)
                .arg(&t.seg_nblk)
                .arg(&self.seg_max)
                .arg(&mut self.seg_stats)
                .launch(blocks(nseg))
        }
        .map_err(dev("gs_seg_sum"))?;
        let st = self.down_n(&self.seg_stats, 3 * nseg)?;
        Ok(st
            .chunks_exact(3)
            .map(|s| AbsStats {
                sum: f64::from_bits(s[0]),
                count: s[1],
                max: f32::from_bits(s[2] as u32),
            })
            .collect())
    }

    fn count_above(&mut self, thr: &[Vec<f32>]) -> Result<Vec<Vec<u64>>> {
        let nseg = self.nseg();
        if thr.len() != nseg {
            return Err(Error::InvalidArgument(format!(
                "thresholds for {} layers of {nseg}",
                thr.len()
            )));
        }
        let mut flat = vec![0f32; nseg * MAX_T];
        let mut nthr = vec![0u32; nseg];
        for (s, ts) in thr.iter().enumerate() {
            if ts.len() > MAX_T {
                return Err(Error::InvalidArgument(format!(
                    "{} thresholds for layer {s}, at most {MAX_T}",
                    ts.len()
                )));
            }
            flat[s * MAX_T..s * MAX_T + ts.len()].copy_from_slice(ts);
            nthr[s] = ts.len() as u32;
        }
        if nseg == 0 {
            return Ok(Vec::new());
        }
        let s = &self.stream;
        s.memcpy_htod(&flat, &mut self.thr)
            .map_err(dev("thresholds"))?;
        s.memcpy_htod(&nthr, &mut self.nthr)
            .map_err(dev("thresholds"))?;
        s.memset_zeros(&mut self.hist).map_err(dev("memset"))?;
        let t = &self.t;
        if t.nblk > 0 {
            // SAFETY: tables as in stats; thr nseg·MAX_T, hist nseg·(MAX_T+1).
            unsafe {
                s.launch_builder(&self.k.count_multi)
                    .arg(&self.v)
                    .arg(&t.blk_seg)
                    .arg(&t.blk_start)
                    .arg(&t.seg_end)
                    .arg(&self.thr)
                    .arg(&self.nthr)
                    .arg(&mut self.hist)
                    .launch(blocks(t.nblk))
            }
            .map_err(dev("gs_count_multi"))?;
        }
        let hist = self.down_n(&self.hist, nseg * (MAX_T + 1))?;
        Ok(thr
            .iter()
            .enumerate()
            .map(|(s, ts)| {
                let h = &hist[s * (MAX_T + 1)..(s + 1) * (MAX_T + 1)];
                // |x| > ts[j] exactly when b ≥ j + 1.
                (0..ts.len()).map(|j| h[j + 1..].iter().sum()).collect()
            })
            .collect())
    }

    fn compact(&mut self, thr: &[f32]) -> Result<Compacted> {
        let nseg = self.nseg();
        if thr.len() != nseg {
            return Err(Error::InvalidArgument(format!(
                "thresholds for {} layers of {nseg}",
                thr.len()
            )));
        }
        if nseg == 0 || self.t.nblk == 0 {
            return Ok(Compacted {
                counts: vec![0; nseg],
                ..Default::default()
            });
        }
        let s = self.stream.clone();
        let mut tr = std::time::Instant::now();
        s.memcpy_htod(thr, &mut self.thr1)
            .map_err(dev("thresholds"))?;
        self.mark("compact: thresholds up", &mut tr);
        let t = &self.t;
        // SAFETY: tables as in stats; blk_cnt/blk_off nblk, seg_* nseg.
        unsafe {
            s.launch_builder(&self.k.count_above)
                .arg(&self.v)
                .arg(&t.blk_seg)
                .arg(&t.blk_start)
                .arg(&t.seg_end)
                .arg(&self.thr1)
                .arg(&mut self.blk_cnt)
                .launch(blocks(t.nblk))
        }
        .map_err(dev("gs_count_above"))?;
        // SAFETY: one block per layer over its blocks.
        unsafe {
            s.launch_builder(&self.k.scan_blocks)
                .arg(&self.blk_cnt)
                .arg(&t.seg_first_blk)
                .arg(&t.seg_nblk)
                .arg(&mut self.blk_off)
                .arg(&mut self.seg_total)
                .launch(blocks(nseg))
        }
        .map_err(dev("gs_scan_blocks"))?;
        self.mark("compact: count and scan", &mut tr);
        let nseg32 = nseg as u32;
        // SAFETY: one thread over nseg totals into nseg offsets.
        unsafe {
            s.launch_builder(&self.k.seg_offsets)
                .arg(&self.seg_total)
                .arg(&nseg32)
                .arg(&mut self.seg_out)
                .launch(blocks(1))
        }
        .map_err(dev("gs_seg_offsets"))?;
        // The write pass starts before the totals are read back: it writes
        // what fits the kept capacity; when the totals say more was
        // selected, the capacity grows and the write pass runs again.
        let mut cap = self.out_idx.as_ref().map_or(0, |b| b.len());
        let mut totals = Vec::new();
        for _ in 0..2 {
            if cap > 0 {
                self.compact_write(cap)?;
                self.mark("compact: write", &mut tr);
            }
            totals = self.down_n(&self.seg_total, nseg)?;
            self.mark("compact: totals down", &mut tr);
            let all: u64 = totals.iter().sum();
            if all as usize <= cap {
                break;
            }
            ensure(&s, &mut self.out_idx, all as usize)?;
            ensure(&s, &mut self.out_val, all as usize)?;
            cap = self.out_idx.as_ref().map_or(0, |b| b.len());
        }
        let all = totals.iter().sum::<u64>() as usize;
        let (idx, val) = match (&self.out_idx, &self.out_val) {
            (Some(oi), Some(ov)) if all > 0 => {
                down_pinned(&s, oi, &mut self.pin_idx, all)?;
                down_pinned(&s, ov, &mut self.pin_val, all)?;
                s.synchronize().map_err(dev("stream synchronize"))?;
                (
                    landed(&mut self.pin_idx, all)?,
                    landed(&mut self.pin_val, all)?,
                )
            }
            _ => (Vec::new(), Vec::new()),
        };
        self.mark("compact: entries down", &mut tr);
        Ok(Compacted {
            counts: totals.iter().map(|&c| c as usize).collect(),
            idx,
            val,
        })
    }

    fn clear_sent(&mut self, gidx: &[u64]) -> Result<()> {
        self.stats_fresh = false;
        if gidx.is_empty() {
            return Ok(());
        }
        if let Some(&i) = gidx.iter().find(|&&i| i as usize >= self.n) {
            return Err(Error::InvalidArgument(format!(
                "clearing index {i} past {} elements",
                self.n
            )));
        }
        let s = self.stream.clone();
        ensure(&s, &mut self.in_idx, gidx.len())?;
        let ii = self.in_idx.as_mut().expect("ensured");
        s.memcpy_htod(gidx, ii)
            .map_err(dev("indices to the device"))?;
        let m = gidx.len() as u64;
        // SAFETY: every index is < n (checked above).
        unsafe {
            s.launch_builder(&self.k.clear_sent)
                .arg(&mut self.v)
                .arg(&mut self.u)
                .arg(&*ii)
                .arg(&m)
                .launch(grid_exact(gidx.len()))
        }
        .map_err(dev("gs_clear_sent"))?;
        Ok(())
    }

    fn clear_layer(&mut self, l: usize) -> Result<()> {
        self.stats_fresh = false;
        let start: usize = self.sizes[..l].iter().sum();
        let end = start + self.sizes[l];
        if end > start {
            let s = self.stream.clone();
            s.memset_zeros(&mut self.v.slice_mut(start..end))
                .map_err(dev("memset"))?;
            s.memset_zeros(&mut self.u.slice_mut(start..end))
                .map_err(dev("memset"))?;
        }
        Ok(())
    }

    fn scatter(&mut self, ranks: &[(Vec<u64>, Vec<f32>)], scale: f32) -> Result<()> {
        let s = self.stream.clone();
        if self.n > 0 {
            s.memset_zeros(&mut self.grads).map_err(dev("memset"))?;
        }
        let total: usize = ranks.iter().map(|r| r.0.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let (mut gi, mut gv) = (Vec::with_capacity(total), Vec::with_capacity(total));
        for (i, v) in ranks {
            gi.extend_from_slice(i);
            gv.extend_from_slice(v);
        }
        for &i in &gi {
            if i as usize >= self.n {
                return Err(Error::InvalidArgument(format!(
                    "scatter index {i} past {} elements",
                    self.n
                )));
            }
        }
        ensure(&s, &mut self.in_idx, total)?;
        ensure(&s, &mut self.in_val, total)?;
        let (ii, iv) = (
            self.in_idx.as_mut().expect("ensured"),
            self.in_val.as_mut().expect("ensured"),
        );
        s.memcpy_htod(&gi, ii)
            .map_err(dev("entries to the device"))?;
        s.memcpy_htod(&gv, iv)
            .map_err(dev("entries to the device"))?;
        let mut at = 0usize;
        for (i, _) in ranks {
            let m = i.len();
            if m > 0 {
                let (vi, vv) = (ii.slice(at..at + m), iv.slice(at..at + m));
                let mm = m as u64;
                // SAFETY: indices checked < n above; one rank's are distinct.
                unsafe {
                    s.launch_builder(&self.k.scatter_add)
                        .arg(&mut self.grads)
                        .arg(&vi)
                        .arg(&vv)
                        .arg(&mm)
                        .arg(&scale)
                        .launch(grid_exact(m))
                }
                .map_err(dev("gs_scatter_add"))?;
            }
            at += m;
        }
        Ok(())
    }
}
