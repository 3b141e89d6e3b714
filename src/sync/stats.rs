//! What a step reports: per-layer ([`LayerStats`]) and per-step
//! ([`StepStats`]) statistics, filled by the local phase, the progress job
//! and the unpacking, returned by `sync`/`wait`.

use serde::Serialize;

/// What ran for one layer in one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerStats {
    /// Layer name.
    pub name: String,
    /// `dense`, `sparse` or `local` (a delayed step without communication).
    pub strategy: String,
    /// Codec name (`none` for dense).
    pub codec: String,
    /// Whether the strategy was the cost model's choice (`Strategy::Auto`).
    pub auto: bool,
    /// Fraction of this rank's elements sent (1 for dense).
    pub density: f64,
    /// Bytes this rank put on the wire for the layer: its unit (fused
    /// allgatherv), its dense slice, or, for a layer in the sparse allreduce
    /// (`sparse_exchange` allreduce or hierarchical), 8 per pair it
    /// contributes (the allreduce's own traffic is the group's).
    pub bytes_sent: usize,
    /// `4n / bytes_sent`.
    pub ratio: f64,
    /// Selection and encoding, seconds.
    pub select_s: f64,
    /// Residual / momentum update and packing, seconds.
    pub pack_s: f64,
    /// Decoding every rank's unit (or unfusing), seconds.
    pub unpack_s: f64,
    /// Error feedback of a sparse layer (`full`, `damped(γ)`, `none`; see
    /// [`Codec::feedback`](crate::codec::Codec::feedback)), empty for others.
    pub feedback: String,
    /// Consecutive sparse steps, up to this one, in which the layer sent
    /// nothing although its residual was not zero (0 once it sends). At
    /// [`crate::codec::STARVED_STEPS`] the engine warns that it starves.
    pub starved_steps: u64,
}

/// What ran in one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepStats {
    /// Step counter (0-based) of this step.
    pub step: u64,
    /// Whether the step communicated (false on delayed local steps).
    pub communicated: bool,
    /// Whether communication ran on the progress thread.
    pub overlapped: bool,
    /// The step's buckets ([`GradSync::submit_bucket`](super::GradSync::submit_bucket); 1 for a whole
    /// step, 1 for a staged one).
    pub buckets: usize,
    /// Per layer.
    pub layers: Vec<LayerStats>,
    /// Bytes of this rank's fused sparse message (0 when no layer is in it).
    pub fused_bytes: usize,
    /// Bytes of the fused dense buffer.
    pub dense_bytes: usize,
    /// Sum of the layers' `select_s`.
    pub select_s: f64,
    /// Sum of the layers' `pack_s` plus fusion.
    pub pack_s: f64,
    /// Allgatherv of the fused sparse messages, seconds.
    pub allgather_s: f64,
    /// Dense allreduce, seconds.
    pub allreduce_s: f64,
    /// Sparse allreduce of the layers that `Config::sparse_exchange` takes
    /// out of the fused allgatherv, seconds (0 without such layers).
    pub sparse_reduce_s: f64,
    /// Distinct indices of that sparse allreduce's result (the fill-in of
    /// the summed selections, over the concatenated index space of those
    /// layers; their elements in all are the space's size). A caller or a
    /// cost model can estimate the next steps' fill-in from it.
    pub sparse_reduce_nnz: usize,
    /// How this step's RGC / quantized-RGC pairs were exchanged:
    /// `allgather` (in the fused allgatherv, or no such layer this step),
    /// `allreduce` or `hierarchical`; with `sparse_exchange = "auto"` the
    /// cost model's choice for this step.
    pub sparse_exchange: String,
    /// The fill ratio `ρ = nnz/(p·k)` of the sparse allreduces estimated
    /// from the steps up to this one that measured it (every reducing
    /// step; with `auto`, its allgatherv steps too: an exponential moving
    /// average, `GradSync::fill_estimate`), what the next step's `auto`
    /// choice prices with; `None` before any such step.
    pub fill_estimate: Option<f64>,
    /// What this step measured of the fill (the distinct result indices of
    /// its reduced group, alike on every rank; `None`: nothing), for the
    /// engine's tuner (`tuner.rs`).
    #[serde(skip)]
    pub(crate) fill_sample: Option<usize>,
    /// The algorithm of this step's dense allreduce (`rabenseifner`,
    /// `ring`, `mpi`, `hierarchical`; with `allreduce = "auto"` the cost
    /// model's choice for the step's dense group); empty when the step ran
    /// no dense allreduce.
    pub allreduce: String,
    /// The algorithm of this step's fused allgatherv (`recdbl`, `node`,
    /// `mpi`; with `allgather = "auto"` the cost model's choice for the
    /// step's message; `recdbl` where `node` falls back to it: one node,
    /// one rank per node); empty when the step ran no allgatherv.
    pub allgather: String,
    /// GradiVeQ layers' compressed-domain rings (compression included), seconds.
    pub gradiveq_s: f64,
    /// PowerSGD layers: their products, orthogonalization and the two
    /// factor allreduces, seconds.
    pub powersgd_s: f64,
    /// Unpacking, seconds.
    pub unpack_s: f64,
    /// Time `wait` blocked for communication (≈ 0 when fully overlapped).
    pub wait_s: f64,
    /// A step on device buffers ([`GradSync::sync_device`](super::GradSync::sync_device)): how the
    /// gradients moved; `None` (and left out of the JSON) for host steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceStats>,
}

/// How a device step ([`GradSync::sync_device`](super::GradSync::sync_device)) moved its gradients.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceStats {
    /// `staged`: copied to pinned host memory, stepped by the host engine,
    /// copied back.
    pub route: String,
    /// Whether MPI takes device pointers in this process
    /// ([`crate::gpu::cuda_aware`], also logged once); `None` when that
    /// cannot be told (a bad `GRADSYNC_CUDA_AWARE`, MPI not initialized).
    pub cuda_aware: Option<bool>,
    /// Bytes copied each way.
    pub bytes: usize,
    /// The copies to the host, from the first started to the last done,
    /// seconds.
    pub to_host_s: f64,
    /// The copies back to the device, seconds.
    pub to_device_s: f64,
}
