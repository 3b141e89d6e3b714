//! The device-resident sparse step: RedSync §5.2–5.3 with the residuals,
//! the momentum and the selection on the GPU, and only the packed
//! `[len | indices | values]` units crossing to the host.
//!
//! The engine's staged path ([`crate::sync::GradSync::sync_device`])
//! copies every layer to the host and back: at density 0.001 a thousand
//! times more bytes over PCIe than the network carries. Here a step of
//! `rgc` layers held in one fused device buffer is
//!
//! 1. a check that every gradient is finite, agreed by every rank
//!    ([`crate::comm::agree`]) before any state changes;
//! 2. error feedback with momentum correction on the device
//!    (`U = m·U + g; V += U`, or Nesterov's `g + m·U`);
//! 3. RedSync's selection on the device, every layer in each launch:
//!    `|V|`'s mean and maximum (one pass), then Algorithm 2's five
//!    trimmed thresholds (one counting pass) or Algorithm 3's binary
//!    search with threshold reuse, five levels of the search tree
//!    counted per pass ([`policy`]); then an order-keeping stream
//!    compaction of `|V| > t` (a count pass, a scan, a write pass);
//! 4. the selected entries to the host (trimmed and exact top-k reduce
//!    their candidates there, as the host selection does), one fused
//!    message of every layer's unit, one allgatherv
//!    ([`crate::sparse::fused_allgather`]), every rank's units parsed and
//!    checked before anything is applied;
//! 5. what was sent cleared from `V` and `U` (momentum factor masking),
//!    and every rank's entries scatter-added into the gradient buffer in
//!    rank order, scaled by `1/p`: the step's update direction, in place.
//!
//! The operations are the [`SparseOps`] trait: [`HostOps`] does them on
//! the CPU (the reference, tested against the host engine bit for bit),
//! `CudaOps` (feature `cuda`) with the kernels of `kernels.cu`, compiled
//! at run time by NVRTC with contraction off, so that every multiply-add
//! rounds as the host's Rust does. The policy (which thresholds, when to
//! reuse, the top-k of the candidates) is one code for both.
//!
//! What the result equals: on integer-valued gradients (and momentum with
//! few significant bits), the host engine's step with the same
//! [`crate::sync::Strategy`] bit for bit. Otherwise `|V|`'s mean is a
//! sum in another order (f64 per element on the device, f32 blocks on the
//! host): the thresholds can differ in their last bits, so an element
//! whose `|V|` lies within that rounding of a threshold can be selected on
//! one path and not on the other; every other element is the same.
//!
//! Not here (the staged path has them): `rgc-quant`, the `sampled`
//! method, dense layers, weight decay, clipping, delayed steps, the
//! `propagate` non-finite policy and a per-layer choice of strategy. A
//! non-finite gradient on any rank fails the step on every rank with
//! nothing changed; a residual that overflowed f32 is cleared, as the
//! host engine clears it, and the step fails on every rank naming the
//! layer and the rank (its unit says so), after the other layers'
//! results were written.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_kernels;
#[cfg(feature = "cuda")]
mod cuda_mem;
mod host;
pub mod policy;
#[cfg(test)]
mod tests;
mod wire;

#[cfg(feature = "cuda")]
pub use cuda::CudaOps;
#[cfg(feature = "cuda")]
pub use cuda_kernels::compile_kernels;
pub use host::HostOps;
pub use policy::{LayerState, Method};

use crate::comm::agree::agree;
use crate::comm::Transport;
use crate::dense::{AllgathervAlgo, Gathered};
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// Thresholds counted in one pass, per layer (the kernels' `MAX_T`).
pub const MAX_T: usize = 31;
/// Elements one block of the kernels handles (the kernels' `CHUNK`).
pub const CHUNK: usize = 4096;

/// `|V|` of one layer: the sum (f64), the non-NaN count and the maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AbsStats {
    /// `Σ|v|` over the non-NaN elements.
    pub sum: f64,
    /// Non-NaN elements.
    pub count: u64,
    /// `max |v|` (NaN ignored).
    pub max: f32,
}

/// Every layer's selected entries, in layer order: `counts[l]` entries of
/// layer `l`, their indices inside the layer (ascending) and values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Compacted {
    /// Entries of each layer.
    pub counts: Vec<usize>,
    /// Their indices inside their layers, layer after layer.
    pub idx: Vec<u32>,
    /// Their values.
    pub val: Vec<f32>,
}

/// The operations of a device sparse step over one fused buffer of
/// layers (`sizes`, in order): the gradients (input, then the result),
/// the residual `V` and the momentum `U`. Each call covers every layer.
pub trait SparseOps {
    /// The layers' sizes.
    fn sizes(&self) -> &[usize];
    /// Whether some gradient element is NaN or ±∞.
    fn grads_nonfinite(&mut self) -> Result<bool>;
    /// `U = m·U + g; V += U` (Nesterov: `V += g + m·U`); `V += g` when
    /// `momentum` is 0.
    fn accumulate(&mut self, momentum: f32, nesterov: bool) -> Result<()>;
    /// Per layer, `|V|`'s statistics.
    fn stats(&mut self) -> Result<Vec<AbsStats>>;
    /// Per layer, for its thresholds `thr[l]` (ascending, not NaN, at most
    /// [`MAX_T`]), how many `|V_i|` exceed each: `counts[l][j]`.
    fn count_above(&mut self, thr: &[Vec<f32>]) -> Result<Vec<Vec<u64>>>;
    /// Per layer, the entries with `|V_i| > thr[l]`, in index order.
    fn compact(&mut self, thr: &[f32]) -> Result<Compacted>;
    /// `V_i = 0` and `U_i = 0` at the fused indices `gidx` (what was sent).
    fn clear_sent(&mut self, gidx: &[u64]) -> Result<()>;
    /// Layer `l`'s `V` and `U` zeroed (an overflowed residual).
    fn clear_layer(&mut self, l: usize) -> Result<()>;
    /// The gradient buffer zeroed, then, rank after rank in order,
    /// `g[gidx] += scale · val` for that rank's entries (distinct within
    /// a rank, as parsed messages are).
    fn scatter(&mut self, ranks: &[(Vec<u64>, Vec<f32>)], scale: f32) -> Result<()>;
}

/// Options of the device sparse step.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSparseConfig {
    /// Density of every layer: `k = max(1, ceil(density · n))`.
    pub density: f64,
    /// Selection method.
    pub method: Method,
    /// Momentum correction factor (0: none).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for DeviceSparseConfig {
    fn default() -> Self {
        DeviceSparseConfig {
            density: 0.001,
            method: Method::Trimmed,
            momentum: 0.0,
            nesterov: false,
        }
    }
}

/// Where one step's time went (seconds), and what it moved.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceSparseStats {
    /// Finite check and its agreement.
    pub check_s: f64,
    /// Error feedback with momentum.
    pub accumulate_s: f64,
    /// Statistics, threshold search and compaction, to the host.
    pub select_s: f64,
    /// Passes that counted thresholds.
    pub count_passes: usize,
    /// Packing, the allgatherv and parsing.
    pub exchange_s: f64,
    /// Clearing what was sent and the scatter-add.
    pub apply_s: f64,
    /// Entries this rank sent.
    pub sent: usize,
    /// Bytes of this rank's fused message.
    pub message_bytes: usize,
    /// Bytes copied between host and device (both ways, this rank).
    pub pcie_bytes: usize,
}

/// A device-resident sparse step over [`SparseOps`] (see the module).
pub struct DeviceSparse<O: SparseOps> {
    ops: O,
    cfg: DeviceSparseConfig,
    layers: Vec<LayerState>,
    /// Fused offset of each layer.
    offsets: Vec<u64>,
    gathered: Gathered,
    message: Vec<u8>,
    steps: u64,
}

impl<O: SparseOps> DeviceSparse<O> {
    /// The step over `ops`' layers. Errors on a density outside `(0, 1]`
    /// or a layer past `u32` indices.
    pub fn new(ops: O, cfg: DeviceSparseConfig) -> Result<Self> {
        if !(cfg.density > 0.0 && cfg.density <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "device sparse step: density {} must lie in (0, 1]",
                cfg.density
            )));
        }
        if let Method::Threshold { eps, .. } = cfg.method {
            if !(eps > 0.0 && eps < 1.0) {
                return Err(Error::InvalidArgument(format!(
                    "device sparse step: search eps {eps} must lie in (0, 1)"
                )));
            }
        }
        let mut offsets = Vec::with_capacity(ops.sizes().len());
        let mut off = 0u64;
        let mut layers = Vec::new();
        for (l, &n) in ops.sizes().iter().enumerate() {
            if u32::try_from(n).is_err() {
                return Err(Error::InvalidArgument(format!(
                    "device sparse step: layer {l} has {n} elements, past u32 indices"
                )));
            }
            offsets.push(off);
            off += n as u64;
            layers.push(LayerState::new(
                n,
                crate::codec::rgc_k(cfg.density, n),
                cfg.method,
            ));
        }
        Ok(DeviceSparse {
            ops,
            cfg,
            layers,
            offsets,
            gathered: Gathered::default(),
            message: Vec::new(),
            steps: 0,
        })
    }

    /// The operations (to fill the gradients before a step, read the
    /// result after).
    pub fn ops(&mut self) -> &mut O {
        &mut self.ops
    }

    /// Steps completed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One step, collective: every rank calls it with its gradients in
    /// the buffer; on return the buffer holds the average of every rank's
    /// sent entries. On an error every rank returns one: the same
    /// [`Error::RankFailed`] for a rank's non-finite gradient, with no
    /// state changed; the same [`Error::NonFinite`] (naming the first
    /// layer and the lowest rank) where a residual overflowed f32, after
    /// the other layers' results were written, as the host engine's
    /// default policy does. A device operation or the exchange failing
    /// after the agreement ends the job ([`Transport::abort`]:
    /// `MPI_Abort` over MPI), since the ranks' states would part.
    pub fn step<C: Transport>(&mut self, comm: &C) -> Result<DeviceSparseStats> {
        let mut st = DeviceSparseStats::default();
        let t = Instant::now();
        let local = match self.ops.grads_nonfinite() {
            Ok(false) => Ok(()),
            Ok(true) => Err(Error::InvalidArgument(format!(
                "rank {}: a gradient of the device sparse step is NaN or infinite",
                comm.rank()
            ))),
            Err(e) => Err(e),
        };
        agree(comm, local)?;
        st.check_s = t.elapsed().as_secs_f64();
        let step = self.steps;
        let die = |what: &str, e: Error| -> ! {
            comm.abort(
                1,
                &format!(
                    "rank {}: device sparse step {step}: {what} failed after the ranks agreed: {e}",
                    comm.rank()
                ),
            )
        };
        let t = Instant::now();
        if let Err(e) = self.ops.accumulate(self.cfg.momentum, self.cfg.nesterov) {
            die("error feedback", e);
        }
        st.accumulate_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let sel = match policy::select(&mut self.ops, &mut self.layers) {
            Ok(s) => s,
            Err(e) => die("selection", e),
        };
        st.count_passes = sel.count_passes;
        st.select_s = t.elapsed().as_secs_f64();
        // Clear what is sent (and overflowed layers) before the exchange:
        // nothing below can fail on one rank alone.
        let t = Instant::now();
        let gidx = fused_indices(&sel.entries, &self.offsets);
        for &l in &sel.overflowed {
            log::warn!(
                "gradsync: rank {}: device sparse step {step}: layer {l}'s residual overflowed f32; \
                 its residual and momentum are cleared and the step fails on every rank",
                comm.rank()
            );
            if let Err(e) = self.ops.clear_layer(l) {
                die("clearing an overflowed residual", e);
            }
        }
        if let Err(e) = self.ops.clear_sent(&gidx) {
            die("clearing what was sent", e);
        }
        st.sent = gidx.len();
        let clear_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        wire::pack(&sel.entries, &sel.overflowed, &mut self.message);
        st.message_bytes = self.message.len();
        if let Err(e) = crate::sparse::fused_allgather(
            comm,
            &self.message,
            AllgathervAlgo::default(),
            &mut self.gathered,
        ) {
            // The residuals already gave up what was sent.
            die("the allgatherv", e);
        }
        let parsed = wire::parse_all(&self.gathered, comm.size(), self.ops.sizes(), &self.offsets);
        st.exchange_s = t.elapsed().as_secs_f64();
        let (ranks, non_finite) = match parsed {
            Ok(r) => r,
            // Every rank parses the same bytes: the same error everywhere.
            Err(e) => die("parsing the units", e),
        };
        let t = Instant::now();
        let received: usize = ranks.iter().map(|r| r.0.len()).sum();
        if let Err(e) = self.ops.scatter(&ranks, 1.0 / comm.size() as f32) {
            die("the scatter-add", e);
        }
        st.apply_s = clear_s + t.elapsed().as_secs_f64();
        st.pcie_bytes = sel.to_host_bytes + 8 * gidx.len() + 12 * received;
        self.steps += 1;
        // As the host engine's default policy: every rank has the other
        // layers' results, and the same error naming the first such layer
        // and the lowest rank whose residual overflowed.
        if let Some((layer, rank)) = non_finite {
            return Err(Error::NonFinite {
                rank: Some(rank),
                layer: format!("{layer}"),
            });
        }
        self.steps += 1;
        Ok(st)
    }
}

/// The entries' indices in the fused buffer (`offsets[l] + i`).
fn fused_indices(e: &Compacted, offsets: &[u64]) -> Vec<u64> {
    let mut gidx = Vec::with_capacity(e.idx.len());
    let mut at = 0;
    for (l, &c) in e.counts.iter().enumerate() {
        let base = offsets[l];
        gidx.extend(e.idx[at..at + c].iter().map(|&i| base + u64::from(i)));
        at += c;
    }
    gidx
}

/// One rank's device-step message parsed against layers of `sizes`, as
/// every rank parses its peers' (the fuzz target's entry): the entries'
/// fused indices and values, and the layers it marks non-finite; an error
/// names the rank and the layer. Never panics, whatever the bytes.
pub fn parse_units(
    msg: &[u8],
    rank: usize,
    sizes: &[usize],
) -> Result<(Vec<u64>, Vec<f32>, Vec<usize>)> {
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut off = 0u64;
    for &n in sizes {
        offsets.push(off);
        off = off.saturating_add(n as u64);
    }
    let (mut gi, mut v, mut nf) = (Vec::new(), Vec::new(), Vec::new());
    wire::parse(msg, rank, sizes, &offsets, &mut gi, &mut v, &mut nf)?;
    Ok((gi, v, nf))
}
