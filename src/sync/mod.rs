//! The synchronization engine: what a data-parallel training loop calls every
//! step.
//!
//! [`GradSync`] holds a layer table (`register`), per-layer state (residuals,
//! momentum, codec state) and the communication buffers. Each step it turns
//! every rank's local gradients into one *update direction* per layer, the
//! same on every rank, which the caller applies as `w -= lr · d`:
//!
//! * `Sparse` layers run RedSync's Algorithm 4 (Appendix A; §4, §5.6):
//!   momentum correction (`U = m·U + g; V += U`, or `V += g + m·U` for
//!   Nesterov), residual accumulation, selection and encoding by the layer's
//!   codec, momentum factor masking (`U[i] = 0` where sent) and `V -= sent`
//!   (error feedback, exact for RGC's copied values, keeping quantized codecs'
//!   rounding in the residual). All sparse layers' units are fused into one
//!   message per rank and exchanged by ONE allgatherv ([`crate::sparse`]);
//!   the result is the average of every rank's decoded unit.
//! * `Dense` layers are fused into one buffer and averaged with Rabenseifner's
//!   allreduce (Horovod-style tensor fusion); momentum (plain or Nesterov) is
//!   applied to the average, so every rank keeps the same momentum.
//! * Weight decay (`g += wd·w`, needs the weights), local gradient clipping
//!   (the global norm of this rank's gradient clipped to `c·N^−1/2`, Lin et
//!   al.'s local clipping of §5.5), warm-up (all layers dense for the first
//!   steps, or a density schedule such as 25%, 6.25%, 1.5625%, 0.4%, 0.1%),
//!   and SBC's communication delay (`delay = T`: communicate every T-th step;
//!   in between each rank applies its own direction, and the communicating
//!   step returns the direction that brings every rank to the same averaged
//!   update, exact (up to the rounding of each rank's own path) for a
//!   learning rate constant within the T steps; momentum is then local, as
//!   in federated averaging).
//!
//! Nesterov: Algorithm 4 as printed adds `U + g` to the residual after
//! `U = m·U + g`, which is not Nesterov's `g + m·U`; the engine uses the
//! latter (what DGC's code computes with its pre-multiplied buffer).
//!
//! Communication can overlap computation: [`GradSync::start`] compresses and
//! hands the fused buffers to a progress thread that runs the allgatherv and
//! the allreduce; [`GradSync::wait`] collects and unpacks. With MPI this needs
//! `MPI_THREAD_SERIALIZED` (and the application must not call MPI between
//! `start` and `wait` unless it has `MPI_THREAD_MULTIPLE`); with a lower level
//! the engine communicates inside `start` and says so once in the log.
//!
//! Failures are collective ([`crate::failure`]): an error that can arise on
//! a subset of ranks inside a step reaches every rank as an `Err` in the same
//! step, naming the rank and the cause, or — where agreement is impossible —
//! ends the job with `MPI_Abort`. A rank whose local half of the step fails
//! (bad lengths, an encoder error, NaN/Inf in a GradiVeQ input) still enters
//! the step's collectives with a failure marker: a `GSFX` message in place of
//! its fused sparse message, a status word after the fused dense buffer, or,
//! for steps with only GradiVeQ layers, a one-word allreduce. Every rank
//! checks the status before applying anything and returns the same
//! [`Error::RankFailed`]; what each rank had encoded goes back into its
//! residual, and the step counter advances alike. On delayed steps without
//! communication (`delay > 1`) an error stays local (no peer waits).
//!
//! Safety: every `register` checks with one small collective that all ranks
//! registered the same layer (name, shape, strategy) under the same options;
//! NaN/Inf in gradients follow [`NonFinitePolicy`]; a peer's corrupt unit is
//! an [`Error::PeerMessage`] naming rank and layer. State snapshots
//! ([`GradSync::save_snapshot`]) restore bitwise.
//!
//! * `Gradiveq` layers are aggregated by GradiVeQ's compressed-domain ring
//!   ([`crate::gradiveq`]) on the progress thread, each with its own schedule,
//!   and get momentum like dense layers.
//!
//! The strategy of a layer is resolved once, at registration:
//! [`GradSync::resolve`] gives the default, and `Auto` asks the cost model
//! ([`crate::cost`]) with `Config::profile`.

mod options;
mod snapshot;

use crate::codec::{Codec, CodecConfig, RgcMethod};
use crate::comm::{MpiComm, Transport};
use crate::dense::{
    allreduce_with, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Gathered, ReduceOp, Workspace,
};
use crate::sparse::{
    failure_text, fused_allgather, parse_fused, unpack_layer, write_failed, write_fused, Entry,
    EntryKind,
};
use crate::{Error, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::sync::mpsc;
use std::time::Instant;

pub use snapshot::SNAPSHOT_VERSION;

/// How one layer is synchronized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "kebab-case")]
pub enum Strategy {
    /// Fused Rabenseifner allreduce of the full gradient.
    Dense,
    /// Residual compression with `codec`; `density` (when given) overrides
    /// the codec's own density (`rgc`, `rgc-quant`: `density`; `sbc`: `p`).
    Sparse {
        /// The codec.
        codec: CodecConfig,
        /// Fraction of elements sent, for codecs that have one.
        #[serde(default)]
        density: Option<f64>,
    },
    /// GradiVeQ ([`crate::gradiveq`]): the layer is aggregated by the
    /// compressed-domain ring, with its own schedule (warm-up, `L_t`
    /// QSGD-aggregated samples, `L_c` compressed steps, the eq.-7 loss
    /// monitor). Meant for convolution layers flattened by
    /// [`flatten_conv`](crate::gradiveq::flatten_conv); works on any layer
    /// of at least `K` elements. Not combinable with `delay > 1`.
    Gradiveq(crate::gradiveq::schedule::ScheduleConfig),
    /// The cost model's choice ([`crate::cost`]) from `Config::profile` at
    /// registration: `Dense`, RGC (`sparse-allgather`) or, with
    /// `Config::auto_quant`, quantized RGC, whichever is predicted fastest
    /// for the layer's size on this communicator. Resolved once, logged, and
    /// visible in [`GradSync::layer`] and the step stats.
    Auto,
}

impl Strategy {
    /// RGC with trimmed top-k at `density`, RedSync's choice for mid-size layers.
    pub fn rgc(density: f64) -> Self {
        Strategy::Sparse {
            codec: CodecConfig::Rgc {
                density,
                method: RgcMethod::Trimmed,
            },
            density: None,
        }
    }
    /// Short label: `dense` or the codec name.
    pub fn label(&self) -> String {
        match self {
            Strategy::Dense => "dense".into(),
            Strategy::Sparse { codec, .. } => codec.name(),
            Strategy::Auto => "auto".into(),
            Strategy::Gradiveq(_) => "gradiveq".into(),
        }
    }
}

/// Warm-up of sparse layers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "warmup", rename_all = "kebab-case")]
pub enum Warmup {
    /// Sparse from the first step.
    #[default]
    None,
    /// Every layer dense for the first `steps` steps (RedSync §5.6's choice).
    Dense {
        /// Number of dense steps.
        steps: u64,
    },
    /// Density `schedule[i]` during steps `i·steps_per_stage ..
    /// (i+1)·steps_per_stage`, then the layer's own (DGC's exponential
    /// warm-up, e.g. `[0.25, 0.0625, 0.015625, 0.004]`). Codecs without a
    /// density ignore it.
    Density {
        /// Densities of the stages.
        schedule: Vec<f64>,
        /// Steps per stage.
        steps_per_stage: u64,
    },
}

/// What to do when a gradient holds NaN or Inf.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NonFinitePolicy {
    /// Every rank returns [`Error::NonFinite`] naming the layer (and the rank
    /// for sparse layers) after writing the other layers' results.
    #[default]
    Error,
    /// The layer's result is NaN on every rank (so a loss scaler can skip the
    /// step); residuals and momentum are not poisoned.
    Propagate,
}

/// Engine options. Serializable, so runs can keep them in JSON profiles.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Strategy given by [`GradSync::register`] to layers with at least
    /// `compress_threshold` elements.
    pub codec: CodecConfig,
    /// Layers with fewer elements are `Dense` under [`GradSync::register`]
    /// (RedSync's `compress_thd`).
    pub compress_threshold: usize,
    /// Momentum factor `m` (0 = plain SGD).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Weight decay: `g += weight_decay · w` (needs the weights).
    pub weight_decay: f32,
    /// Global gradient-norm clipping threshold `c`; each rank clips its local
    /// gradient to `c · N^−1/2` before residual accumulation.
    pub clip_norm: Option<f32>,
    /// Warm-up of sparse layers.
    pub warmup: Warmup,
    /// Communicate every `delay` steps (SBC's communication delay; 1 = every step).
    pub delay: u64,
    /// Allgatherv of the fused sparse messages.
    pub allgather: AllgathervAlgo,
    /// Allreduce of the fused dense buffer.
    pub allreduce: AllreduceAlgo,
    /// NaN/Inf policy.
    pub non_finite: NonFinitePolicy,
    /// Communicate on a progress thread so `start`/`wait` overlap computation.
    pub overlap: bool,
    /// Compress and unpack layers in parallel (rayon) when the sparse layers
    /// hold at least this many elements in all.
    pub parallel_min_elems: usize,
    /// A calibrated cluster profile (`gradsync calibrate`). With one,
    /// [`GradSync::register`] gives every layer [`Strategy::Auto`].
    pub profile: Option<crate::cost::Profile>,
    /// Density of the sparse strategies `Auto` considers.
    pub auto_density: f64,
    /// Let `Auto` choose quantized RGC too.
    pub auto_quant: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            codec: CodecConfig::Rgc {
                density: 0.001,
                method: RgcMethod::Trimmed,
            },
            compress_threshold: 32 * 1024,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            clip_norm: None,
            warmup: Warmup::None,
            delay: 1,
            allgather: AllgathervAlgo::RecursiveDoubling,
            allreduce: AllreduceAlgo::Rabenseifner,
            non_finite: NonFinitePolicy::Error,
            overlap: true,
            parallel_min_elems: 1 << 18,
            profile: None,
            auto_density: 0.001,
            auto_quant: false,
        }
    }
}

/// Handle of a registered layer (its index in registration order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerId(pub usize);

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
    /// Bytes this rank put on the wire for the layer (unit or dense slice).
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
    /// [`Codec::feedback`]), empty for others.
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
    /// Per layer.
    pub layers: Vec<LayerStats>,
    /// Bytes of this rank's fused sparse message.
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
    /// GradiVeQ layers' compressed-domain rings (compression included), seconds.
    pub gradiveq_s: f64,
    /// Unpacking, seconds.
    pub unpack_s: f64,
    /// Time `wait` blocked for communication (≈ 0 when fully overlapped).
    pub wait_s: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Gradiveq,
    Dense,
    Sparse,
    Local,
}

struct Layer {
    name: String,
    shape: Vec<usize>,
    n: usize,
    strategy: Strategy,
    codec: Option<Box<dyn Codec>>,
    /// Residual V (sparse layers).
    v: Vec<f32>,
    /// Momentum U (when momentum ≠ 0).
    u: Vec<f32>,
    /// Delay: sum of local directions applied since the last communication.
    acc: Vec<f32>,
    /// Delay: `acc` before this step's direction (subtracted from the result).
    prev: Vec<f32>,
    /// Local direction (delayed steps) or dense decode scratch.
    dir: Vec<f32>,
    /// This step's encoded unit.
    unit: Vec<u8>,
    /// GradiVeQ state (moved into the communication job during a step).
    gvq: Option<crate::gradiveq::schedule::GradiveqLayer>,
    mode: Mode,
    /// Density the codec was last set to.
    cur_density: Option<f64>,
    non_finite: bool,
    /// This step's unit was subtracted from the residual (undone by
    /// `unsend` when the step fails).
    sent: bool,
    /// Offset in the fused dense buffer.
    dense_off: usize,
    stats: LayerStats,
}

/// Buffers and flags of one communication round; moved to the progress
/// thread and back.
#[derive(Default)]
struct Job {
    fused: Vec<u8>,
    gathered: Gathered,
    dense: Vec<f32>,
    ws: Workspace<f32>,
    do_gather: bool,
    do_reduce: bool,
    do_gvq: bool,
    /// Elements of `dense` before its status word.
    dense_len: usize,
    /// The step, for failure messages (`None` between steps).
    step: Option<u64>,
    /// This rank's own failure in the local phase (error text).
    local_failed: Option<String>,
    gather_algo: Option<AllgathervAlgo>,
    reduce_algo: Option<AllreduceAlgo>,
    allgather_s: f64,
    allreduce_s: f64,
    /// GradiVeQ layers of this step: state, input, output.
    gvq: Vec<GvqEntry>,
    gvq_s: f64,
    result: Option<Result<()>>,
}

#[derive(Default)]
struct GvqEntry {
    layer: usize,
    state: Option<crate::gradiveq::schedule::GradiveqLayer>,
    input: Vec<f32>,
    output: Vec<f32>,
}

impl Job {
    /// Run the step's collectives. Errors every rank got alike (a failure
    /// flagged in the step's status, corrupt data every rank received)
    /// return to the caller; any other error may be this rank's alone while
    /// its peers block in a collective, so it ends the job
    /// ([`Transport::abort`], the failure model of [`crate::failure`]).
    fn run<C: Transport>(&mut self, comm: &C) {
        let r = self.communicate(comm);
        if let Err(e) = &r {
            if !e.is_collective() {
                let at = self
                    .step
                    .map_or_else(String::new, |s| format!("step {s}: "));
                comm.abort(1, &format!("{at}{e}"));
            }
        }
        self.result = Some(r);
    }

    fn communicate<C: Transport>(&mut self, comm: &C) -> Result<()> {
        // Every rank's failure text (empty = ok), once any rank failed.
        let mut failed: Option<Vec<String>> = None;
        if self.do_gather {
            let t = Instant::now();
            let algo = self
                .gather_algo
                .unwrap_or(AllgathervAlgo::RecursiveDoubling);
            fused_allgather(comm, &self.fused, algo, &mut self.gathered)?;
            self.allgather_s = t.elapsed().as_secs_f64();
            // The common path only looks at each message's magic.
            let g = &self.gathered;
            if (0..g.len()).any(|r| failure_text(g.message(r)).is_some()) {
                failed = Some(
                    (0..g.len())
                        .map(|r| failure_text(g.message(r)).unwrap_or_default())
                        .collect(),
                );
            }
        }
        if self.do_reduce && failed.is_none() {
            let t = Instant::now();
            let opts = AllreduceOptions {
                op: ReduceOp::Average,
                // The layer table was checked at registration.
                validate: false,
                chunk_elems: 0,
            };
            let algo = self.reduce_algo.unwrap_or(AllreduceAlgo::Rabenseifner);
            allreduce_with(comm, &mut self.dense, algo, &opts, &mut self.ws)?;
            self.allreduce_s = t.elapsed().as_secs_f64();
            // The status word: the fraction of ranks that failed.
            if self.dense[self.dense_len] != 0.0 {
                let mine = self.local_failed.clone().unwrap_or_default();
                let g = crate::dense::allgatherv(
                    comm,
                    mine.as_bytes(),
                    AllgathervAlgo::RecursiveDoubling,
                )?;
                failed = Some(
                    (0..g.len())
                        .map(|r| String::from_utf8_lossy(g.message(r)).into_owned())
                        .collect(),
                );
            }
        }
        if failed.is_none() && comm.size() == 1 {
            failed = self.local_failed.clone().map(|t| vec![t]);
        }
        if let Some(texts) = failed {
            return Err(
                crate::failure::rank_failed(&texts, self.step).unwrap_or_else(|| {
                    Error::RankFailed {
                        rank: 0,
                        others: 0,
                        step: self.step,
                        message: "(a rank flagged a failure without a message)".into(),
                    }
                }),
            );
        }
        let t = Instant::now();
        if self.do_gvq {
            for e in &mut self.gvq {
                let st = e.state.as_mut().ok_or_else(|| {
                    Error::Transport("GradiVeQ state missing from the job".into())
                })?;
                st.step(comm, &e.input, &mut e.output)?;
            }
        }
        self.gvq_s = t.elapsed().as_secs_f64();
        Ok(())
    }
}

struct Worker<C> {
    jobs: mpsc::Sender<Box<Job>>,
    done: mpsc::Receiver<Box<Job>>,
    thread: std::thread::JoinHandle<C>,
}

/// The per-step synchronization engine. See the [module docs](self).
///
/// ```
/// use gradsync::comm::LocalComm;
/// use gradsync::sync::{Config, GradSync, Strategy};
/// let out = LocalComm::run(3, |comm| {
///     let mut s = GradSync::with_transport(comm, Config::default()).unwrap();
///     s.register_with("fc.weight", &[100, 100], Strategy::rgc(0.01)).unwrap();
///     s.register("fc.bias", &[100]).unwrap(); // small: dense
///     let mut w = vec![1.0f32; 10_000];
///     let mut b = vec![0.5f32; 100];
///     s.sync(&mut [&mut w[..], &mut b[..]]).unwrap();
///     (w.iter().filter(|&&x| x != 0.0).count(), b[0])
/// });
/// // 1% of 10 000 elements from each rank (all at the same places here).
/// assert_eq!(out[0], (100, 0.5));
/// ```
pub struct GradSync<C: Transport + Send + 'static = MpiComm> {
    comm: Option<C>,
    worker: Option<Worker<C>>,
    rank: usize,
    size: usize,
    cfg: Config,
    layers: Vec<Layer>,
    table_hash: u64,
    table_checked: bool,
    /// Set (alike on every rank) when the table check failed: the engine
    /// communicates no more and every later step returns this error.
    broken: Option<String>,
    step: u64,
    job: Option<Box<Job>>,
    in_flight: bool,
    started: Option<StartInfo>,
    entries: Vec<Entry>,
    rank_entries: Vec<Entry>,
    sparse_ids: Vec<u32>,
    last: StepStats,
    warned_no_thread: bool,
}

struct StartInfo {
    communicated: bool,
    overlapped: bool,
    select_s: f64,
    pack_s: f64,
}

impl GradSync<MpiComm> {
    /// An engine over a duplicate of the rsmpi communicator `comm`
    /// (collective over `comm`).
    pub fn new<Cm: mpi::topology::Communicator>(comm: &Cm, cfg: Config) -> Result<Self> {
        Self::with_transport(MpiComm::duplicate_of(comm)?, cfg)
    }

    /// An engine over a duplicate of a raw `MPI_Comm` handle (collective
    /// over it): how the C ABI and the Python package, whose communicators
    /// come from C or mpi4py, build one. `cfg` is this rank's options or
    /// its own failure to build them (bad JSON, an option of the wrong
    /// type): one 8-byte agreement ([`crate::failure::agree`]) makes such a
    /// failure on one rank fail every rank alike, naming it, before the
    /// engine's own checks. See [`MpiComm::duplicate_raw`] for the errors
    /// of the communicator itself.
    ///
    /// # Safety
    /// `raw` must be a valid communicator handle of the MPI library
    /// gradsync is linked with.
    pub unsafe fn from_raw_comm(raw: mpi::ffi::MPI_Comm, cfg: Result<Config>) -> Result<Self> {
        let comm = MpiComm::duplicate_raw(raw)?;
        let cfg = crate::failure::agree(&comm, cfg)?;
        Self::with_transport(comm, cfg)
    }
}

/// `n` zeros when `on` (without writing them when `!fill`: a probe that
/// `n` floats can be allocated), or an error instead of the allocator's
/// abort when they cannot be.
fn zeros(n: usize, on: bool, fill: bool) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    if on {
        v.try_reserve_exact(n).map_err(|_| {
            Error::InvalidArgument(format!(
                "cannot allocate {n} f32 elements ({} bytes) of layer state",
                n.saturating_mul(4)
            ))
        })?;
        if fill {
            v.resize(n, 0.0);
        }
    }
    Ok(v)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// An engine over any transport (collective: checks that every rank
    /// passed the same options).
    pub fn with_transport(comm: C, cfg: Config) -> Result<Self> {
        // Options that are invalid on one rank only still enter the options
        // agreement below, so every rank fails alike instead of the others
        // waiting in it (the failure model, crate::failure).
        let valid = Self::check_config(&cfg);
        let json = serde_json::to_vec(&cfg)?;
        let table_hash = fnv(FNV_OFFSET, &json);
        let mut s = GradSync {
            rank: comm.rank(),
            size: comm.size(),
            comm: Some(comm),
            worker: None,
            cfg,
            layers: Vec::new(),
            table_hash,
            table_checked: false,
            broken: None,
            step: 0,
            job: Some(Box::default()),
            in_flight: false,
            started: None,
            entries: Vec::new(),
            rank_entries: Vec::new(),
            sparse_ids: Vec::new(),
            last: StepStats::default(),
            warned_no_thread: false,
        };
        s.agree(valid.map(|()| table_hash), || {
            "the engine options (Config) differ".to_string()
        })?;
        Ok(s)
    }

    /// The options' own checks (rank-local).
    fn check_config(cfg: &Config) -> Result<()> {
        if cfg.delay == 0 {
            return Err(Error::InvalidArgument("delay must be at least 1".into()));
        }
        if !(0.0..1.0).contains(&cfg.momentum) {
            return Err(Error::InvalidArgument(format!(
                "momentum {} must lie in [0, 1)",
                cfg.momentum
            )));
        }
        if let Some(c) = cfg.clip_norm {
            if !(c > 0.0 && c.is_finite()) {
                return Err(Error::InvalidArgument(format!(
                    "clip_norm {c} must be positive"
                )));
            }
        }
        if let Warmup::Density {
            schedule,
            steps_per_stage,
        } = &cfg.warmup
        {
            if *steps_per_stage == 0 || schedule.iter().any(|d| !(*d > 0.0 && *d <= 1.0)) {
                return Err(Error::InvalidArgument(
                    "density warm-up needs steps_per_stage ≥ 1 and densities in (0, 1]".into(),
                ));
            }
        }
        cfg.codec.build()?;
        Ok(())
    }

    /// Compare `h` across ranks (one 24-byte collective); on a mismatch every
    /// rank returns [`Error::TableMismatch`] with `what()`. A rank that
    /// passes `Err` still enters the collective: every rank then returns
    /// the same [`Error::RankFailed`] (the failure model, [`crate::failure`]).
    fn agree(&mut self, h: Result<u64>, what: impl FnOnce() -> String) -> Result<()> {
        let comm = self.comm.as_ref().ok_or_else(|| {
            Error::InvalidArgument("the layer table is fixed once steps have started".into())
        })?;
        let (rank, p) = (comm.rank(), comm.size());
        let mut v = match &h {
            Ok(h) => [0, *h, !*h],
            Err(_) => [(p - rank) as u64, 0, 0],
        };
        crate::dense::small_allreduce_max(comm, &mut v, TAG_TABLE)?;
        if v[0] != 0 {
            return crate::failure::agree(comm, h).map(|_| ());
        }
        let h = h?;
        if v[1] != h || !v[2] != h {
            return Err(Error::TableMismatch(what()));
        }
        Ok(())
    }

    /// Options in use.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Number of registered layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Name, shape and resolved strategy of a layer.
    pub fn layer(&self, id: LayerId) -> Option<(&str, &[usize], &Strategy)> {
        self.layers
            .get(id.0)
            .map(|l| (l.name.as_str(), l.shape.as_slice(), &l.strategy))
    }

    /// The strategy a layer of `n` elements gets from [`register`](Self::register):
    /// with a profile, the cost model's choice ([`Strategy::Auto`]);
    /// otherwise `Dense` below `compress_threshold`, else the configured
    /// codec.
    pub fn resolve(&self, n: usize) -> Strategy {
        if self.cfg.profile.is_some() {
            if let Ok((s, _)) = self.auto_choice(n) {
                return s;
            }
        }
        if n < self.cfg.compress_threshold {
            Strategy::Dense
        } else {
            Strategy::Sparse {
                codec: self.cfg.codec.clone(),
                density: None,
            }
        }
    }

    /// `Auto` for a layer of `n` elements: the predicted-fastest of dense
    /// (the configured allreduce), RGC and optionally quantized RGC at
    /// `auto_density`, with the predictions (name, seconds) it chose among.
    pub fn auto_choice(&self, n: usize) -> Result<(Strategy, Vec<(String, f64)>)> {
        use crate::cost::{choose, predict, Query};
        let prof = self.cfg.profile.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "Strategy::Auto needs Config::profile (gradsync calibrate)".into(),
            )
        })?;
        let d = self.cfg.auto_density;
        let method = match &self.cfg.codec {
            CodecConfig::Rgc { method, .. } => *method,
            _ => RgcMethod::Trimmed,
        };
        let method_name = serde_json::to_value(method)?
            .as_str()
            .unwrap_or("trimmed")
            .to_string();
        let preds = predict(
            prof,
            &Query {
                n,
                p: self.size,
                density: d,
                gradiveq_ratio: 8.0,
            },
            &method_name,
        )?;
        // The one decision table (crate::cost::choose) over what the
        // engine runs for this configuration.
        let allowed = crate::cost::engine_candidates(self.cfg.allreduce, self.cfg.auto_quant);
        let best = choose(&preds, &allowed)
            .ok_or_else(|| Error::InvalidArgument("no strategy to choose from".into()))?;
        let strategy = best
            .id
            .engine_strategy(d, method)
            .ok_or_else(|| Error::InvalidArgument(format!("the engine cannot run {}", best.id)))?;
        let considered = preds
            .iter()
            .filter(|p| allowed.contains(&p.id))
            .map(|p| (p.name.clone(), p.seconds))
            .collect();
        Ok((strategy, considered))
    }

    /// Register a layer with the default strategy ([`resolve`](Self::resolve)).
    /// Collective: all ranks must register the same layers in the same order.
    pub fn register(&mut self, name: &str, shape: &[usize]) -> Result<LayerId> {
        let strategy = self.default_strategy(shape);
        self.register_impl(name, shape, strategy)
    }

    /// What `register` (and the spec `"auto"`) gives a layer: the cost
    /// model's choice with a profile, else by size.
    fn default_strategy(&self, shape: &[usize]) -> Result<Strategy> {
        if self.cfg.profile.is_some() {
            return Ok(Strategy::Auto);
        }
        shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .map(|n| self.resolve(n))
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows")))
    }

    /// Register a layer with an explicit strategy. Collective: one 16-byte
    /// allreduce compares a hash of the table so far; a rank whose table
    /// differs makes every rank fail with [`Error::TableMismatch`].
    pub fn register_with(
        &mut self,
        name: &str,
        shape: &[usize],
        strategy: Strategy,
    ) -> Result<LayerId> {
        self.register_impl(name, shape, Ok(strategy))
    }

    /// Register a layer with a strategy given as text, as the C ABI and the
    /// Python package do: `"auto"` ([`register`](Self::register)'s choice:
    /// the cost model with a profile, else by size), `"dense"`,
    /// `"gradiveq[:k=768,d=96|lambda=0.01,...]"`, or a codec string such
    /// as `"rgc:density=0.001"` or `"3lc:s=1.75"` ([`Strategy::parse`]).
    /// A spec that does not parse on one rank fails the registration
    /// collective on every rank, naming that rank.
    pub fn register_spec(&mut self, name: &str, shape: &[usize], spec: &str) -> Result<LayerId> {
        let strategy = match spec.trim() {
            "auto" => self.default_strategy(shape),
            s => Strategy::parse(s),
        };
        self.register_impl(name, shape, strategy)
    }

    /// Take part in a registration carrying an error the caller found
    /// before it had a valid name, shape or strategy (a binding given
    /// arguments of the wrong type): the registration collective fails on
    /// every rank, naming this one and `err`; nothing is registered
    /// anywhere. Returns that error.
    pub fn fail_register(&mut self, name: &str, err: Error) -> Error {
        match self.register_impl(name, &[0], Err(err)) {
            Err(e) => e,
            Ok(_) => Error::InvalidArgument("a failed registration succeeded".into()),
        }
    }

    fn register_impl(
        &mut self,
        name: &str,
        shape: &[usize],
        strategy: Result<Strategy>,
    ) -> Result<LayerId> {
        if self.step > 0 || self.worker.is_some() {
            // Local misuse after the table was fixed: no peer is in a
            // registration collective any more (they are in steps).
            return Err(Error::InvalidArgument(
                "register every layer before the first step".into(),
            ));
        }
        let id = self.layers.len();
        // Everything rank-local first; a failure still enters the
        // registration collective so no peer waits in it.
        let (mom, delay) = (self.cfg.momentum != 0.0, self.cfg.delay > 1);
        // The layer's state is allocated here, in the rank-local half: a
        // rank that cannot allocate it fails the registration collective
        // on every rank instead of aborting after it (peers would wait).
        let local = strategy
            .and_then(|s| self.prepare_layer(id, name, shape, s))
            .and_then(|l| {
                let sparse = l.2.is_some();
                // Every layer needs its length in the step's buffers.
                drop(zeros(l.0, true, false)?);
                let st = (
                    zeros(l.0, sparse, true)?,
                    zeros(l.0, mom, true)?,
                    zeros(l.0, delay, true)?,
                    zeros(l.0, delay, true)?,
                );
                Ok((l, st))
            });
        let label = local
            .as_ref()
            .map_or_else(|_| String::new(), |l| l.0 .4.clone());
        let h = local.as_ref().map(|l| l.0 .3).map_err(|e| {
            let why = match e {
                Error::InvalidArgument(m) => m.clone(),
                e => e.to_string(),
            };
            Error::InvalidArgument(format!("layer {name:?} (#{id}): {why}"))
        });
        if let Some(why) = &self.broken {
            return Err(Error::TableMismatch(why.clone()));
        }
        let r = self.agree(h, || {
            format!("layer #{id} {name:?} (shape {shape:?}, {label}) is not the same on every rank")
        });
        if let Err(Error::TableMismatch(why)) = &r {
            // The ranks' tables are out of step (this collective may even
            // have met a peer's final table check): no rank may go on.
            self.broken = Some(why.clone());
        }
        r?;
        let ((n, strategy, codec, h, label, gvq, auto), (v, u, acc, prev)) = local?;
        self.table_hash = h;
        let layer = Layer {
            name: name.to_string(),
            shape: shape.to_vec(),
            n,
            strategy,
            codec,
            v,
            u,
            acc,
            prev,
            dir: Vec::new(),
            unit: Vec::new(),
            gvq,
            mode: Mode::Dense,
            cur_density: None,
            non_finite: false,
            sent: false,
            dense_off: 0,
            stats: LayerStats {
                name: name.to_string(),
                auto,
                ..LayerStats::default()
            },
        };
        self.layers.push(layer);
        log::debug!("gradsync: layer #{id} {name:?} {shape:?} ({n} elements): {label}");
        Ok(LayerId(id))
    }

    /// The rank-local part of [`register_with`](Self::register_with):
    /// element count, resolved strategy, codec, table hash, label, GradiVeQ
    /// state, whether `Auto` chose.
    #[allow(clippy::type_complexity)]
    fn prepare_layer(
        &self,
        id: usize,
        name: &str,
        shape: &[usize],
        strategy: Strategy,
    ) -> Result<(
        usize,
        Strategy,
        Option<Box<dyn Codec>>,
        u64,
        String,
        Option<crate::gradiveq::schedule::GradiveqLayer>,
        bool,
    )> {
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows")))?;
        let auto = strategy == Strategy::Auto;
        let strategy = if strategy == Strategy::Auto {
            let (s, preds) = self.auto_choice(n)?;
            log::info!(
                "gradsync: layer {name:?} ({n} elements, {} ranks): auto chose {} from {}",
                self.size,
                s.label(),
                preds
                    .iter()
                    .map(|(k, t)| format!("{k} {:.1} us", t * 1e6))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            s
        } else {
            strategy
        };
        let gvq = match &strategy {
            Strategy::Gradiveq(sc) => {
                if self.cfg.delay > 1 {
                    return Err(Error::InvalidArgument(
                        "GradiVeQ cannot be combined with delay > 1".to_string(),
                    ));
                }
                Some(crate::gradiveq::schedule::GradiveqLayer::new(
                    n,
                    sc.clone(),
                )?)
            }
            _ => None,
        };
        let codec = match &strategy {
            // `Auto` was resolved above.
            Strategy::Dense | Strategy::Auto | Strategy::Gradiveq(_) => None,
            Strategy::Sparse { codec, density } => {
                let mut c = codec.build()?;
                // Error feedback only where it stays bounded (codec::feedback).
                c.feedback(n)?;
                if let Some(d) = density {
                    c.set_density(*d)?;
                }
                Some(c)
            }
        };
        let h = {
            let mut h = fnv(self.table_hash, b"layer");
            h = fnv(h, &(id as u64).to_le_bytes());
            h = fnv(h, name.as_bytes());
            h = fnv(h, &[0xff]);
            for d in shape {
                h = fnv(h, &(*d as u64).to_le_bytes());
            }
            fnv(h, serde_json::to_string(&strategy)?.as_bytes())
        };
        let label = strategy.label();
        Ok((n, strategy, codec, h, label, gvq, auto))
    }

    /// Check once, before the first step, that every rank registered the
    /// same number of layers.
    fn check_table(&mut self) -> Result<()> {
        if self.table_checked {
            return Ok(());
        }
        let h = fnv(
            fnv(self.table_hash, b"complete"),
            &(self.layers.len() as u64).to_le_bytes(),
        );
        if let Some(why) = &self.broken {
            return Err(Error::TableMismatch(why.clone()));
        }
        let n = self.layers.len();
        let r = self.agree(Ok(h), || {
            format!("this rank registered {n} layers; some rank registered others")
        });
        match r {
            Ok(()) => {
                self.table_checked = true;
                Ok(())
            }
            Err(e) => {
                // Every rank got an error here: none may run a step.
                self.broken = Some(match &e {
                    Error::TableMismatch(why) => why.clone(),
                    e => e.to_string(),
                });
                Err(e)
            }
        }
    }

    /// One synchronous step: `grads[i]` (layer `i`'s local gradient, in
    /// registration order) is replaced by the layer's update direction.
    pub fn sync(&mut self, grads: &mut [&mut [f32]]) -> Result<&StepStats> {
        {
            let view: Vec<&[f32]> = grads.iter().map(|g| &**g).collect();
            self.start(&view)?;
        }
        self.wait(grads)
    }

    /// [`sync`](Self::sync) with weight decay (`weights[i]` is layer `i`'s
    /// weights).
    pub fn sync_with_weights(
        &mut self,
        grads: &mut [&mut [f32]],
        weights: &[&[f32]],
    ) -> Result<&StepStats> {
        {
            let view: Vec<&[f32]> = grads.iter().map(|g| &**g).collect();
            self.start_with_weights(&view, weights)?;
        }
        self.wait(grads)
    }

    /// Compress this step's gradients and start communicating; the gradients
    /// are no longer needed when it returns. Finish with [`wait`](Self::wait).
    pub fn start(&mut self, grads: &[&[f32]]) -> Result<()> {
        if self.cfg.weight_decay != 0.0 {
            return Err(Error::InvalidArgument(
                "weight_decay is set: use start_with_weights / sync_with_weights".into(),
            ));
        }
        self.start_impl(Ok((grads, None)))
    }

    /// Take part in this step carrying a failure found by the caller before
    /// it could hand over its gradients (a binding that got a float64 or
    /// read-only array, a null pointer from C). The step's collectives run
    /// as for any rank-local failure ([`crate::failure`]): every rank,
    /// this one included, returns the same [`Error::RankFailed`] for this
    /// step, nothing is applied anywhere, and the next step runs normally.
    /// Returns that error (or an earlier, purely local misuse error).
    pub fn fail_step(&mut self, err: Error) -> Error {
        if let Err(e) = self.start_impl(Err(err)) {
            return e;
        }
        match self.wait(&mut []) {
            Err(e) => e,
            Ok(_) => Error::InvalidArgument("a failed step succeeded".into()),
        }
    }

    /// [`start`](Self::start) with the weights, for weight decay.
    pub fn start_with_weights(&mut self, grads: &[&[f32]], weights: &[&[f32]]) -> Result<()> {
        self.start_impl(Ok((grads, Some(weights))))
    }

    /// The step's gradients (and weights), or the caller's own failure.
    #[allow(clippy::type_complexity)]
    fn start_impl(&mut self, input: Result<(&[&[f32]], Option<&[&[f32]]>)>) -> Result<()> {
        if self.started.is_some() {
            // Local misuse; this rank's own round is still pending, so no
            // peer waits for this call.
            return Err(Error::InvalidArgument(
                "start called twice without wait".into(),
            ));
        }
        self.check_table()?;
        let t_pack = Instant::now();
        let step = self.step;
        let communicates = (step + 1) % self.cfg.delay == 0;
        let dense_len = self.plan_modes(communicates);
        let mut job = self.job.take().expect("job buffers present when idle");
        // The rank-local half of the step. From here on this rank enters the
        // step's collectives whatever happens, carrying a failure flag if
        // this half failed, so no peer is left waiting (crate::failure).
        let local = match input {
            Ok((grads, weights)) => self.local_phase(grads, weights, &mut job, dense_len),
            Err(e) => {
                job.dense.clear();
                job.dense.resize(dense_len, 0.0);
                Err(e)
            }
        };
        if let Err(e) = &local {
            log::debug!("gradsync: rank {} step {step}: {e}", self.rank);
        }
        // Dense layers: the status word after the fused buffer (0 = ok).
        job.dense.resize(dense_len + 1, 0.0);
        job.dense[dense_len] = if local.is_err() { 1.0 } else { 0.0 };
        job.dense_len = dense_len;
        self.sparse_ids.clear();
        self.sparse_ids.extend(
            self.layers
                .iter()
                .enumerate()
                .filter(|(_, l)| l.mode == Mode::Sparse)
                .map(|(i, _)| i as u32),
        );
        match &local {
            Ok(()) => {
                let layers = &self.layers;
                write_fused(
                    &mut job.fused,
                    step,
                    self.sparse_ids.iter().map(|&i| {
                        let l = &layers[i as usize];
                        let kind = if l.non_finite {
                            EntryKind::NonFinite
                        } else {
                            EntryKind::Unit
                        };
                        (i, kind, if l.non_finite { &[][..] } else { &l.unit[..] })
                    }),
                );
            }
            Err(e) => write_failed(&mut job.fused, step, &e.to_string()),
        }
        job.step = Some(step);
        job.local_failed = local.as_ref().err().map(|e| e.to_string());
        job.do_gather = !self.sparse_ids.is_empty() && self.size > 1;
        job.do_gvq = self.layers.iter().any(|l| l.mode == Mode::Gradiveq);
        // A step with GradiVeQ layers and no fused message carries its
        // status in a one-word allreduce before the rings.
        job.do_reduce = dense_len > 0 || (job.do_gvq && !job.do_gather);
        job.gvq_s = 0.0;
        job.gather_algo = Some(self.cfg.allgather);
        job.reduce_algo = Some(self.cfg.allreduce);
        job.allgather_s = 0.0;
        job.allreduce_s = 0.0;
        job.result = None;
        if !job.do_gather && !self.sparse_ids.is_empty() {
            // One rank: the gathered data is our own message.
            job.gathered.data.clear();
            job.gathered.data.extend_from_slice(&job.fused);
            job.gathered.displs.clear();
            job.gathered.displs.extend([0, job.fused.len()]);
        }
        let select_s: f64 = self.layers.iter().map(|l| l.stats.select_s).sum();
        let pack_s = (t_pack.elapsed().as_secs_f64() - select_s).max(0.0);
        let mut overlapped = false;
        if job.do_gather || job.do_reduce || job.do_gvq {
            if self.cfg.overlap && self.ensure_worker() {
                let w = self.worker.as_ref().expect("worker just ensured");
                if let Err(mpsc::SendError(job)) = w.jobs.send(job) {
                    // The progress thread is gone (it panicked): peers may
                    // be waiting for this rank's part of the step.
                    let comm = self.comm.as_ref();
                    drop(job);
                    let msg = "gradsync: the progress thread has exited";
                    match comm {
                        Some(c) => c.abort(1, msg),
                        None => panic!("{msg}"),
                    }
                }
                self.in_flight = true;
                overlapped = true;
            } else {
                job.run(self.comm.as_ref().expect("transport held without a worker"));
                self.job = Some(job);
            }
        } else {
            job.result = Some(match &local {
                Ok(()) => Ok(()),
                // No exchange this step (a delayed local step or one rank):
                // the error is this rank's alone.
                Err(e) => Err(Error::RankFailed {
                    rank: self.rank,
                    others: 0,
                    step: Some(step),
                    message: e.to_string(),
                }),
            });
            self.job = Some(job);
        }
        self.started = Some(StartInfo {
            communicated: communicates,
            overlapped,
            select_s,
            pack_s,
        });
        Ok(())
    }

    /// The step plan, a pure function of (step, config, layer table): each
    /// layer's mode and offset in the fused dense buffer. Returns the fused
    /// dense length. The same on every rank whatever the inputs.
    fn plan_modes(&mut self, communicates: bool) -> usize {
        let dense_warmup = matches!(self.cfg.warmup, Warmup::Dense { steps } if self.step < steps);
        let mut dense_len = 0usize;
        for l in &mut self.layers {
            l.mode = if !communicates {
                Mode::Local
            } else if l.gvq.is_some() && !dense_warmup {
                Mode::Gradiveq
            } else if l.codec.is_none() || dense_warmup {
                Mode::Dense
            } else {
                Mode::Sparse
            };
            l.non_finite = false;
            l.sent = false;
            l.stats.select_s = 0.0;
            l.stats.unpack_s = 0.0;
            if l.mode == Mode::Dense {
                l.dense_off = dense_len;
                dense_len += l.n;
            }
        }
        dense_len
    }

    /// Validate this rank's inputs, run the local math (Algorithm 4's
    /// residual and momentum updates, selection and encoding), and fill the
    /// fused dense buffer and GradiVeQ inputs of `job`. An error here is
    /// this rank's alone; the caller still enters the step's collectives.
    fn local_phase(
        &mut self,
        grads: &[&[f32]],
        weights: Option<&[&[f32]]>,
        job: &mut Job,
        dense_len: usize,
    ) -> Result<()> {
        job.dense.clear();
        job.dense.resize(dense_len, 0.0);
        for e in &mut job.gvq {
            e.state = None;
        }
        if grads.len() != self.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "{} gradients for {} registered layers",
                grads.len(),
                self.layers.len()
            )));
        }
        if let Some(w) = weights {
            if w.len() != grads.len() {
                return Err(Error::InvalidArgument(format!(
                    "{} weight tensors for {} layers",
                    w.len(),
                    grads.len()
                )));
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if grads[i].len() != l.n {
                return Err(Error::InvalidArgument(format!(
                    "layer {:?}: gradient has {} elements, registered {}",
                    l.name,
                    grads[i].len(),
                    l.n
                )));
            }
            if let Some(w) = weights.map(|w| w[i].len()).filter(|&w| w != l.n) {
                return Err(Error::InvalidArgument(format!(
                    "layer {:?}: weights have {w} elements, registered {}",
                    l.name, l.n
                )));
            }
        }
        let cfg = &self.cfg;
        let step = self.step;
        let stage_density = match &cfg.warmup {
            Warmup::Density {
                schedule,
                steps_per_stage,
            } => schedule.get((step / steps_per_stage) as usize).copied(),
            _ => None,
        };
        // Local clipping: one factor for all layers of this rank.
        let factor = match cfg.clip_norm {
            Some(c) => {
                let norm = grads
                    .iter()
                    .map(|g| g.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
                    .sum::<f64>()
                    .sqrt();
                let limit = f64::from(c) / (self.size as f64).sqrt();
                if norm > limit {
                    (limit / norm) as f32
                } else {
                    1.0
                }
            }
            None => 1.0,
        };
        let sparse_elems: usize = self
            .layers
            .iter()
            .filter(|l| l.mode == Mode::Sparse)
            .map(|l| l.n)
            .sum();
        let params = StepParams {
            factor,
            momentum: cfg.momentum,
            nesterov: cfg.nesterov,
            wd: cfg.weight_decay,
            delay: cfg.delay > 1,
            stage_density,
        };
        // Sparse and local layers: compress in parallel when it pays.
        let work = |(i, l): (usize, &mut Layer)| -> Result<()> {
            let w = weights.map(|w| w[i]);
            match l.mode {
                Mode::Sparse => l.compress(grads[i], w, &params),
                Mode::Local => {
                    l.local_step(grads[i], w, &params);
                    Ok(())
                }
                Mode::Dense | Mode::Gradiveq => Ok(()),
            }
        };
        // Parallel only across two or more sparse layers: one layer gains
        // nothing, and idle rayon workers spinning next to MPI's polling cost
        // more than they bring on a few cores.
        let sparse_layers = self.layers.iter().filter(|l| l.mode != Mode::Dense).count();
        let r = if sparse_layers >= 2 && sparse_elems >= cfg.parallel_min_elems {
            self.layers.par_iter_mut().enumerate().try_for_each(work)
        } else {
            self.layers.iter_mut().enumerate().try_for_each(work)
        };
        if let Err(e) = r {
            // Nothing this rank encoded is sent: put it back in the residuals.
            for l in &mut self.layers {
                l.unsend();
            }
            return Err(e);
        }
        // Dense layers: the fused buffer; GradiVeQ layers: their inputs.
        let mut gi = 0;
        for (i, l) in self.layers.iter_mut().enumerate() {
            let w = weights.map(|w| w[i]);
            if l.mode == Mode::Dense {
                let dst = &mut job.dense[l.dense_off..l.dense_off + l.n];
                l.dense_contribution(grads[i], w, &params, dst);
            } else if l.mode == Mode::Gradiveq {
                if job.gvq.len() == gi {
                    job.gvq.push(GvqEntry::default());
                }
                let e = &mut job.gvq[gi];
                e.layer = i;
                e.input.resize(l.n, 0.0);
                e.output.resize(l.n, 0.0);
                l.dense_contribution(grads[i], w, &params, &mut e.input);
                l.stats.strategy = "gradiveq".into();
                l.stats.codec = "gradiveq".into();
                gi += 1;
            }
        }
        job.gvq.truncate(gi);
        // A NaN/Inf in a GradiVeQ layer's input would poison its ring on
        // every rank: the step fails on every rank instead.
        if let Some(e) = job.gvq.iter().find(|e| !all_finite(&e.input)) {
            let layer = self.layers[e.layer].name.clone();
            for l in &mut self.layers {
                l.unsend();
            }
            return Err(Error::NonFinite {
                rank: Some(self.rank),
                layer,
            });
        }
        for e in &mut job.gvq {
            e.state = self.layers[e.layer].gvq.take();
        }
        Ok(())
    }

    /// Agree on a rank-local outcome between steps (collective), through the
    /// step's status-word path: a one-word allreduce, plus the error texts
    /// only when some rank failed. Every rank returns the same
    /// [`Error::RankFailed`] if any rank passed `Err`.
    pub(crate) fn agree_status(&mut self, local: Result<()>) -> Result<()> {
        if self.started.is_some() {
            return Err(Error::InvalidArgument("not between start and wait".into()));
        }
        let mut job = self.job.take().expect("job buffers present when idle");
        job.dense.clear();
        job.dense.push(if local.is_err() { 1.0 } else { 0.0 });
        job.dense_len = 0;
        job.do_gather = false;
        job.do_reduce = true;
        job.do_gvq = false;
        job.local_failed = local.as_ref().err().map(|e| e.to_string());
        job.step = None;
        job.result = None;
        job.reduce_algo = Some(self.cfg.allreduce);
        let mut job = match &self.worker {
            Some(w) => {
                if let Err(mpsc::SendError(_)) = w.jobs.send(job) {
                    panic!("gradsync: the progress thread has exited");
                }
                w.done
                    .recv()
                    .unwrap_or_else(|_| panic!("gradsync: the progress thread has exited"))
            }
            None => {
                job.run(self.comm.as_ref().expect("transport held without a worker"));
                job
            }
        };
        let r = job.result.take().unwrap_or(Ok(()));
        self.job = Some(job);
        r.and(local)
    }

    /// Start the progress thread if allowed; false when communication must
    /// stay on this thread.
    fn ensure_worker(&mut self) -> bool {
        if self.worker.is_some() {
            return true;
        }
        let Some(comm) = self.comm.take() else {
            return false;
        };
        if !comm.progress_thread_ok() {
            if !self.warned_no_thread {
                log::warn!(
                    "gradsync: MPI threading level below MPI_THREAD_SERIALIZED; \
                     communicating without overlap (initialize MPI with Threading::Serialized)"
                );
                self.warned_no_thread = true;
            }
            self.comm = Some(comm);
            return false;
        }
        let (jtx, jrx) = mpsc::channel::<Box<Job>>();
        let (dtx, drx) = mpsc::channel::<Box<Job>>();
        let spawned = std::thread::Builder::new()
            .name("gradsync-progress".into())
            .spawn(move || {
                while let Ok(mut job) = jrx.recv() {
                    job.run(&comm);
                    if dtx.send(job).is_err() {
                        break;
                    }
                }
                comm
            });
        match spawned {
            Ok(thread) => {
                self.worker = Some(Worker {
                    jobs: jtx,
                    done: drx,
                    thread,
                });
                true
            }
            Err(e) => {
                // The closure (and the transport) is lost only if spawn
                // fails after taking it, which std does not do.
                log::warn!("gradsync: cannot start the progress thread: {e}");
                false
            }
        }
    }

    /// Finish the step started by [`start`](Self::start): `out[i]` receives
    /// layer `i`'s update direction. On [`Error::NonFinite`] every other
    /// layer's result is still written.
    pub fn wait(&mut self, out: &mut [&mut [f32]]) -> Result<&StepStats> {
        let info = self
            .started
            .take()
            .ok_or_else(|| Error::InvalidArgument("wait without start".into()))?;
        let t_wait = Instant::now();
        let mut job = if self.in_flight {
            self.in_flight = false;
            let w = self.worker.as_ref().expect("in-flight job has a worker");
            w.done
                .recv()
                .map_err(|_| Error::Transport("progress thread has exited".into()))?
        } else {
            self.job.take().expect("job buffers present")
        };
        let wait_s = t_wait.elapsed().as_secs_f64();
        let result = job.result.take().unwrap_or(Ok(()));
        let r = self.finish(&mut job, out, result);
        // Reuse the previous step's per-layer records (no allocation once
        // the names have been copied).
        let mut layer_stats = std::mem::take(&mut self.last.layers);
        layer_stats.resize_with(self.layers.len(), LayerStats::default);
        for (d, l) in layer_stats.iter_mut().zip(&self.layers) {
            d.clone_from(&l.stats);
        }
        self.last = StepStats {
            step: self.step,
            communicated: info.communicated,
            overlapped: info.overlapped,
            layers: layer_stats,
            fused_bytes: if self.sparse_ids.is_empty() {
                0
            } else {
                job.fused.len()
            },
            dense_bytes: 4 * job.dense_len,
            select_s: info.select_s,
            pack_s: info.pack_s,
            allgather_s: job.allgather_s,
            allreduce_s: job.allreduce_s,
            gradiveq_s: job.gvq_s,
            unpack_s: self.layers.iter().map(|l| l.stats.unpack_s).sum(),
            wait_s,
        };
        self.job = Some(job);
        // The round happened (every rank sees the same gathered bytes, so
        // ranks fail alike): the counter advances with the state.
        self.step += 1;
        r?;
        let s = &self.last;
        log::debug!(
            "gradsync: step {} select {:.3e}s pack {:.3e}s allgather {:.3e}s ({} B) allreduce {:.3e}s ({} B) unpack {:.3e}s wait {:.3e}s",
            s.step, s.select_s, s.pack_s, s.allgather_s, s.fused_bytes, s.allreduce_s, s.dense_bytes, s.unpack_s, s.wait_s
        );
        for l in &s.layers {
            log::trace!("gradsync: step {} {l:?}", s.step);
        }
        Ok(&self.last)
    }

    fn finish(&mut self, job: &mut Job, out: &mut [&mut [f32]], comm: Result<()>) -> Result<()> {
        // GradiVeQ states go back to their layers whatever happened.
        for e in &mut job.gvq {
            if let Some(st) = e.state.take() {
                self.layers[e.layer].gvq = Some(st);
            }
        }
        if comm.is_err() {
            // The step failed on every rank and nothing is applied: what
            // this rank encoded goes back into its residuals (nothing lost).
            for l in &mut self.layers {
                l.unsend();
            }
        }
        comm?;
        if out.len() != self.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "{} output buffers for {} layers",
                out.len(),
                self.layers.len()
            )));
        }
        if let Some((i, l)) = self
            .layers
            .iter()
            .enumerate()
            .find(|(i, l)| out[*i].len() != l.n)
        {
            return Err(Error::InvalidArgument(format!(
                "layer {:?}: output has {} elements, registered {}",
                l.name,
                out[i].len(),
                l.n
            )));
        }
        let p = self.size;
        let names = |id: u32| {
            self.layers
                .get(id as usize)
                .map_or_else(|| format!("#{id}"), |l| l.name.clone())
        };
        // Parse every rank's fused message; entries[l * p + r].
        let ns = self.sparse_ids.len();
        if ns > 0 {
            self.entries.clear();
            self.entries.resize(
                ns * p,
                Entry {
                    layer: 0,
                    kind: EntryKind::Unit,
                    start: 0,
                    end: 0,
                },
            );
            if job.gathered.len() != p {
                return Err(Error::Transport(format!(
                    "gathered {} messages from {p} ranks",
                    job.gathered.len()
                )));
            }
            for r in 0..p {
                parse_fused(
                    job.gathered.message(r),
                    r,
                    self.step,
                    &self.sparse_ids,
                    &names,
                    &mut self.rank_entries,
                )?;
                for (j, e) in self.rank_entries.iter().enumerate() {
                    self.entries[j * p + r] = *e;
                }
            }
        }
        let inv = 1.0 / p as f32;
        let rank = self.rank;
        let policy = self.cfg.non_finite;
        let params = (self.cfg.momentum, self.cfg.nesterov, self.cfg.delay > 1);
        let gathered = &job.gathered;
        let entries = &self.entries;
        let sparse_pos = |i: usize| self.sparse_ids.binary_search(&(i as u32)).ok();
        let dense = &job.dense;
        let gvq = &job.gvq;
        let total: usize = self
            .layers
            .iter()
            .filter(|l| l.mode == Mode::Sparse)
            .map(|l| l.n)
            .sum();
        let work = |(i, (l, o)): (usize, (&mut Layer, &mut &mut [f32]))| -> Result<Option<Error>> {
            let t = Instant::now();
            let r = match l.mode {
                Mode::Local => {
                    o.copy_from_slice(&l.dir);
                    l.non_finite.then(|| Error::NonFinite {
                        rank: Some(rank),
                        layer: l.name.clone(),
                    })
                }
                Mode::Sparse => {
                    let j = sparse_pos(i).expect("sparse layer is in the fused table");
                    let codec = l.codec.as_deref().expect("sparse layer has a codec");
                    let bad = unpack_layer(
                        gathered,
                        &entries[j * p..(j + 1) * p],
                        codec,
                        &l.name,
                        inv,
                        o,
                    )?;
                    if params.2 {
                        crate::dense::sub_from(o, &l.prev);
                    }
                    bad.map(|r| {
                        if policy == NonFinitePolicy::Propagate {
                            o.fill(f32::NAN);
                        }
                        Error::NonFinite {
                            rank: Some(r),
                            layer: l.name.clone(),
                        }
                    })
                }
                Mode::Gradiveq => {
                    let e = gvq
                        .iter()
                        .find(|e| e.layer == i)
                        .expect("every GradiVeQ layer has a job entry");
                    for (x, y) in o.iter_mut().zip(&e.output) {
                        *x = y * inv;
                    }
                    if o.iter().any(|x| !x.is_finite()) {
                        Some(Error::NonFinite {
                            rank: None,
                            layer: l.name.clone(),
                        })
                    } else {
                        l.dense_update(o, params);
                        None
                    }
                }
                Mode::Dense => {
                    let g = &dense[l.dense_off..l.dense_off + l.n];
                    o.copy_from_slice(g);
                    if g.iter().any(|x| !x.is_finite()) {
                        Some(Error::NonFinite {
                            rank: None,
                            layer: l.name.clone(),
                        })
                    } else {
                        l.dense_update(o, params);
                        None
                    }
                }
            };
            l.stats.unpack_s = t.elapsed().as_secs_f64();
            Ok(r)
        };
        let errors: Vec<Option<Error>> = if ns >= 2 && total >= self.cfg.parallel_min_elems {
            self.layers
                .par_iter_mut()
                .zip(out.par_iter_mut())
                .enumerate()
                .map(work)
                .collect::<Result<_>>()?
        } else {
            self.layers
                .iter_mut()
                .zip(out.iter_mut())
                .enumerate()
                .map(work)
                .collect::<Result<_>>()?
        };
        for l in &mut self.layers {
            l.fill_stats(p);
        }
        match errors.into_iter().flatten().next() {
            Some(e) if policy == NonFinitePolicy::Error => Err(e),
            Some(e) => {
                log::warn!("gradsync: {e} (propagated as NaN)");
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Statistics of the last completed step.
    pub fn last_stats(&self) -> &StepStats {
        &self.last
    }

    /// This rank's encoded unit of layer `id` in the last step (empty unless
    /// the layer was sparse).
    pub fn last_unit(&self, id: LayerId) -> &[u8] {
        self.layers
            .get(id.0)
            .filter(|l| l.mode == Mode::Sparse && !l.non_finite)
            .map_or(&[][..], |l| &l.unit[..])
    }

    /// Decode `unit` (e.g. [`last_unit`](Self::last_unit)) of layer `id` into
    /// `out`: what this rank contributed to the sum.
    pub fn decode_unit(&self, id: LayerId, unit: &[u8], out: &mut [f32]) -> Result<()> {
        let l = self
            .layers
            .get(id.0)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {}", id.0)))?;
        let c = l
            .codec
            .as_deref()
            .ok_or_else(|| Error::InvalidArgument(format!("layer {:?} is dense", l.name)))?;
        c.decode(unit, out)
    }

    /// The residual (what has not been sent yet) of a sparse layer.
    pub fn residual(&self, id: LayerId) -> Option<&[f32]> {
        self.layers
            .get(id.0)
            .filter(|l| l.codec.is_some())
            .map(|l| &l.v[..])
    }
}

const TAG_TABLE: crate::comm::Tag = crate::comm::tags::TABLE;

struct StepParams {
    factor: f32,
    momentum: f32,
    nesterov: bool,
    wd: f32,
    delay: bool,
    stage_density: Option<f64>,
}

/// `g_eff[i] = factor·g[i] + wd·w[i]`.
#[inline]
fn g_eff(g: &[f32], w: Option<&[f32]>, p: &StepParams, i: usize) -> f32 {
    let x = p.factor * g[i];
    match w {
        Some(w) if p.wd != 0.0 => x + p.wd * w[i],
        _ => x,
    }
}

fn all_finite(x: &[f32]) -> bool {
    x.iter().fold(true, |a, v| a & v.is_finite())
}

#[allow(clippy::needless_range_loop)] // index loops over several parallel arrays
impl Layer {
    /// The momentum-corrected local direction of `g_eff` (updates `U`):
    /// `U = m·U + g; d = U` (or `g + m·U` for Nesterov); `d = g` without
    /// momentum.
    #[inline]
    fn direction(u: &mut [f32], p: &StepParams, i: usize, g: f32) -> f32 {
        if p.momentum == 0.0 {
            return g;
        }
        let ui = p.momentum * u[i] + g;
        u[i] = ui;
        if p.nesterov {
            g + p.momentum * ui
        } else {
            ui
        }
    }

    /// A delayed step without communication: the local direction, kept in
    /// `dir` and added to `acc`.
    fn local_step(&mut self, g: &[f32], w: Option<&[f32]>, p: &StepParams) {
        let t = Instant::now();
        self.dir.resize(self.n, 0.0);
        if !all_finite(g) || w.is_some_and(|w| !all_finite(w)) {
            // Nothing to accumulate; the caller sees NaN locally.
            self.dir.fill(f32::NAN);
            self.non_finite = true;
        } else {
            for i in 0..self.n {
                let d = Self::direction(&mut self.u, p, i, g_eff(g, w, p, i));
                self.dir[i] = d;
                self.acc[i] += d;
            }
        }
        self.stats.strategy = "local".into();
        self.stats.bytes_sent = 0;
        self.stats.pack_s = t.elapsed().as_secs_f64();
    }

    /// Sparse step: accumulate into the residual, encode, keep what was not
    /// sent.
    fn compress(&mut self, g: &[f32], w: Option<&[f32]>, p: &StepParams) -> Result<()> {
        let t0 = Instant::now();
        if !all_finite(g) || w.is_some_and(|w| !all_finite(w)) {
            self.non_finite = true;
            self.unit.clear();
            self.stats.pack_s = t0.elapsed().as_secs_f64();
            return Ok(());
        }
        let n = self.n;
        if p.delay {
            // prev = acc; acc += d; V += acc; acc = 0.
            for i in 0..n {
                let d = Self::direction(&mut self.u, p, i, g_eff(g, w, p, i));
                self.prev[i] = self.acc[i];
                self.v[i] += self.acc[i] + d;
                self.acc[i] = 0.0;
            }
        } else if p.momentum == 0.0 && p.factor == 1.0 && (w.is_none() || p.wd == 0.0) {
            crate::dense::add_into(&mut self.v, g);
        } else {
            for i in 0..n {
                let d = Self::direction(&mut self.u, p, i, g_eff(g, w, p, i));
                self.v[i] += d;
            }
        }
        let codec = self.codec.as_mut().expect("sparse layer has a codec");
        let want = p.stage_density.or(match &self.strategy {
            Strategy::Sparse { density, codec } => density.or_else(|| config_density(codec)),
            Strategy::Dense | Strategy::Auto | Strategy::Gradiveq(_) => None,
        });
        if want != self.cur_density {
            if let Some(d) = want {
                // Codecs without a density keep their own (documented).
                if let Err(e) = codec.set_density(d) {
                    log::debug!("gradsync: layer {:?}: {e}", self.name);
                }
            }
            self.cur_density = want;
        }
        let fb = codec
            .feedback(n)
            .map_err(|e| Error::InvalidArgument(format!("layer {:?}: {e}", self.name)))?;
        let t1 = Instant::now();
        let pre = t1 - t0;
        let enc = match fb {
            crate::codec::Feedback::Damped(gamma) => {
                // Encode γ·V (V keeps what was not sent of V itself).
                self.dir.clear();
                self.dir.extend(self.v.iter().map(|x| gamma * x));
                codec.encode(&self.dir, &mut self.unit)
            }
            _ => codec.encode(&self.v, &mut self.unit),
        };
        enc.map_err(|e| {
            Error::InvalidArgument(format!("layer {:?}: encoding failed: {e}", self.name))
        })?;
        let t2 = Instant::now();
        // V -= sent; U[i] = 0 where sent (momentum factor masking; not
        // without feedback, where V is this step's direction only).
        let no_fb = fb == crate::codec::Feedback::None;
        let (v, u) = (
            &mut self.v,
            if no_fb { &mut [][..] } else { &mut self.u[..] },
        );
        let mut sent = 0usize;
        let sparse = codec.for_each_sent(&self.unit, n, &mut |i, x| {
            v[i] -= x;
            if let Some(ui) = u.get_mut(i) {
                *ui = 0.0;
            }
            sent += 1;
        })?;
        if !sparse {
            self.dir.resize(n, 0.0);
            codec.decode(&self.unit, &mut self.dir)?;
            for i in 0..n {
                let x = self.dir[i];
                v[i] -= x;
                if x != 0.0 {
                    sent += 1;
                    if let Some(ui) = u.get_mut(i) {
                        *ui = 0.0;
                    }
                }
            }
        }
        self.sent = true;
        // Starvation: nothing sent although there was something to send.
        let starved = sent == 0 && v.iter().any(|&x| x != 0.0);
        let norm = if starved {
            v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
        } else {
            0.0
        };
        if no_fb {
            v.fill(0.0);
        }
        if starved {
            self.stats.starved_steps += 1;
            // Warn at N, 2N, 4N, ... consecutive steps.
            let (k, lim) = (self.stats.starved_steps, crate::codec::STARVED_STEPS);
            if k % lim == 0 && (k / lim).is_power_of_two() {
                log::warn!(
                    "gradsync: layer {:?} ({} elements, codec {}) sent nothing for {k} \
                     consecutive steps while its residual grew (norm {:.3e}): it starves",
                    self.name,
                    n,
                    codec.config().name(),
                    norm
                );
            }
        } else {
            self.stats.starved_steps = 0;
        }
        self.stats.feedback = fb.label();
        self.stats.strategy = "sparse".into();
        self.stats.codec = codec.config().name();
        self.stats.density = if n == 0 { 0.0 } else { sent as f64 / n as f64 };
        self.stats.bytes_sent = self.unit.len();
        self.stats.select_s = (t2 - t1).as_secs_f64();
        self.stats.pack_s = (pre + t2.elapsed()).as_secs_f64();
        Ok(())
    }

    /// Undo `V -= sent` of this step (a failed step sends nothing): the
    /// residual again holds this step's gradient. Momentum masking is not
    /// undone (it only zeroes `U` where values were selected).
    fn unsend(&mut self) {
        if !self.sent {
            return;
        }
        self.sent = false;
        let Some(codec) = self.codec.as_ref() else {
            return;
        };
        let v = &mut self.v;
        match codec.for_each_sent(&self.unit, self.n, &mut |i, x| v[i] += x) {
            Ok(true) => {}
            _ => {
                self.dir.resize(self.n, 0.0);
                if codec.decode(&self.unit, &mut self.dir).is_ok() {
                    crate::dense::add_into(&mut self.v, &self.dir);
                }
            }
        }
    }

    /// Dense step: what this rank puts in the fused allreduce buffer.
    fn dense_contribution(
        &mut self,
        g: &[f32],
        w: Option<&[f32]>,
        p: &StepParams,
        dst: &mut [f32],
    ) {
        let t = Instant::now();
        if p.delay {
            for i in 0..self.n {
                let d = Self::direction(&mut self.u, p, i, g_eff(g, w, p, i));
                self.prev[i] = self.acc[i];
                dst[i] = self.acc[i] + d;
                self.acc[i] = 0.0;
            }
        } else {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = g_eff(g, w, p, i);
            }
        }
        if !self.v.is_empty() {
            // A sparse layer in dense warm-up: flush its residual.
            crate::dense::add_into(dst, &self.v);
            self.v.fill(0.0);
        }
        self.stats.strategy = "dense".into();
        self.stats.codec = "none".into();
        self.stats.density = 1.0;
        self.stats.bytes_sent = 4 * self.n;
        self.stats.pack_s = t.elapsed().as_secs_f64();
    }

    /// Dense result `o` (the average): apply momentum, or undo the delayed
    /// local steps.
    fn dense_update(&mut self, o: &mut [f32], (m, nesterov, delay): (f32, bool, bool)) {
        if delay {
            crate::dense::sub_from(o, &self.prev);
        } else if m != 0.0 {
            for (x, u) in o.iter_mut().zip(self.u.iter_mut()) {
                *u = m * *u + *x;
                *x = if nesterov { *x + m * *u } else { *u };
            }
        }
    }

    fn fill_stats(&mut self, _p: usize) {
        let s = &mut self.stats;
        s.ratio = if s.bytes_sent == 0 {
            f64::INFINITY
        } else {
            (4 * self.n) as f64 / s.bytes_sent as f64
        };
        if self.mode == Mode::Local {
            s.codec = "none".into();
            s.density = 0.0;
        }
    }
}

/// The density parameter of a codec configuration, if it has one.
fn config_density(c: &CodecConfig) -> Option<f64> {
    match c {
        CodecConfig::Rgc { density, .. } | CodecConfig::RgcQuant { density } => Some(*density),
        CodecConfig::Sbc { p } => Some(*p),
        _ => None,
    }
}

impl<C: Transport + Send + 'static> Drop for GradSync<C> {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            if self.in_flight {
                // Let the round finish: its buffers are in use by MPI.
                let _ = w.done.recv();
            }
            drop(w.jobs);
            if let Ok(comm) = w.thread.join() {
                drop(comm);
            }
        }
    }
}

#[cfg(test)]
mod tests;
