//! The engine's options: how a layer is synchronized ([`Strategy`]: dense,
//! a sparse codec — RGC/RedSync, SBC, 3LC, ... —, GradiVeQ, or the cost
//! model's choice), warm-up ([`Warmup`]: RedSync §5.6's dense steps or DGC's
//! density schedule), SBC's communication delay, momentum, weight decay,
//! local clipping (§5.5) and the NaN/Inf policy, with their rank-local
//! validity checks. Plain data: what a step does with them is decided in
//! [`plan`](super::plan) (per-step policy) and [`layer`](super::layer)
//! (Algorithm 4's math).

use crate::codec::{CodecConfig, RgcMethod};
use crate::dense::{AllgathervAlgo, AllreduceAlgo};
pub use crate::strategy::{Pick, SparseExchange, Strategy};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

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
    /// Every rank returns [`Error::NonFinite`] naming the layer and the
    /// lowest rank whose gradient was non-finite (no rank when finite
    /// gradients overflowed in a dense sum) after writing the other layers'
    /// results.
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
    /// Strategy given by [`GradSync::register`](super::GradSync::register) to layers with at least
    /// `compress_threshold` elements.
    pub codec: CodecConfig,
    /// Layers with fewer elements are `Dense` under [`GradSync::register`](super::GradSync::register)
    /// (RedSync's `compress_thd`), and never sparsified or quantized by
    /// `Auto`, which may still give them PowerSGD (`auto_powersgd`: it
    /// compresses every matrix its factors shrink, as PyTorch's hook does).
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
    /// Allgatherv of the fused sparse messages: `auto` (default: with
    /// [`Config::profile`] the cost model's cheaper of `recdbl` and the
    /// node-aware `node` for each step's message, which only a job across
    /// several nodes with several ranks on one can make `node`; `recdbl`
    /// without a profile), `recdbl`, `node` or `mpi`
    /// ([`AllgathervAlgo`]). The sparse allreduces' own allgatherv is the
    /// configured one, `recdbl` under `auto`.
    pub allgather: Pick<AllgathervAlgo>,
    /// Allreduce of the fused dense buffer: an algorithm, or `auto` (the
    /// cost model's choice for the step's dense group; needs `profile`).
    pub allreduce: Pick<AllreduceAlgo>,
    /// NaN/Inf policy.
    pub non_finite: NonFinitePolicy,
    /// Communicate on a progress thread so `start`/`wait` overlap computation.
    pub overlap: bool,
    /// While the caller computes, the progress thread tests its transfers
    /// and sleeps this many microseconds between tests (growing in a long
    /// wait to an eighth of the time waited, at most 1 ms) instead of spinning
    /// inside MPI ([`crate::comm::PoliteWait`]), leaving the CPU to the
    /// caller; while the caller waits for the step it spins. 0: MPI's own
    /// blocking calls throughout (they spin).
    #[serde(skip_serializing_if = "is_default_poll")]
    pub progress_poll_us: u32,
    /// Compress and unpack layers in parallel (rayon) when the sparse layers
    /// hold at least this many elements in all.
    pub parallel_min_elems: usize,
    /// A calibrated cluster profile (`gradsync calibrate`). With one,
    /// [`GradSync::register`](super::GradSync::register) gives every layer [`Strategy::Auto`].
    pub profile: Option<crate::cost::Profile>,
    /// Density of the sparse strategies `Auto` considers.
    pub auto_density: f64,
    /// Let `Auto` choose quantized RGC too.
    pub auto_quant: bool,
    /// Let `Auto` choose PowerSGD at this rank (0: never) for layers of
    /// two or more dimensions, where the profile prices it
    /// ([`crate::cost::PowerSgdFit`], `gradsync calibrate`).
    #[serde(skip_serializing_if = "is_zero_rank")]
    pub auto_powersgd: usize,
    /// How the sparse layers of index/value codecs (RGC, quantized RGC)
    /// are exchanged: in the fused allgatherv (default), by one sparse
    /// allreduce (flat or node-aware), or as the cost model chooses each
    /// step (`auto`, needs `profile`) ([`SparseExchange`]).
    #[serde(skip_serializing_if = "is_default_exchange")]
    pub sparse_exchange: Pick<SparseExchange>,
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
            allgather: Pick::Auto,
            allreduce: Pick::Fixed(AllreduceAlgo::Rabenseifner),
            non_finite: NonFinitePolicy::Error,
            overlap: true,
            progress_poll_us: DEFAULT_PROGRESS_POLL_US,
            parallel_min_elems: 1 << 18,
            profile: None,
            auto_density: 0.001,
            auto_quant: false,
            auto_powersgd: 0,
            sparse_exchange: Pick::Fixed(SparseExchange::Allgather),
        }
    }
}

impl Config {
    /// The forced options of the engine's decision table
    /// ([`crate::cost::Tuning`]): `allreduce`, `allgather` and
    /// `sparse_exchange`.
    pub fn masks(&self) -> crate::cost::Masks {
        crate::cost::Masks {
            allreduce: self.allreduce,
            allgather: self.allgather,
            exchange: self.sparse_exchange,
        }
    }

    /// What these options say about the per-layer choices
    /// ([`crate::cost::LayerPolicy`]), which the decision table answers.
    pub fn policy(&self) -> crate::cost::LayerPolicy {
        crate::cost::LayerPolicy {
            density: self.auto_density,
            codec: self.codec.clone(),
            min_sparse_elems: self.compress_threshold,
            quant: self.auto_quant,
            powersgd_rank: self.auto_powersgd,
            delay: self.delay,
            parallel_min_elems: self.parallel_min_elems,
        }
    }
}

/// [`Config::progress_poll_us`]'s default.
pub const DEFAULT_PROGRESS_POLL_US: u32 = 100;

/// Largest [`Config::progress_poll_us`]: a sleep of a second between two
/// tests of a transfer is a mistake, not a setting.
pub const MAX_PROGRESS_POLL_US: u32 = 1_000_000;

/// Serde skips the default, so that the options' JSON, and with it the
/// table hash that snapshots record, is what it was before the option
/// existed (it changes how the engine waits, never a result).
fn is_default_poll(us: &u32) -> bool {
    *us == DEFAULT_PROGRESS_POLL_US
}

/// Serde skips the default exchange (the fused allgatherv), so that the
/// options' JSON, and with it the table hash that snapshots record, is
/// what it was before the option existed.
fn is_default_exchange(x: &Pick<SparseExchange>) -> bool {
    x.is(SparseExchange::Allgather)
}

/// Serde skips 0 (`auto` never chooses PowerSGD), so that the options'
/// JSON, and with it the table hash that snapshots record, is what it was
/// before the option existed.
fn is_zero_rank(r: &usize) -> bool {
    *r == 0
}

/// Largest `delay`: a million steps between synchronizations is longer
/// than a training run; anything above is a mistake (a `-1` cast to
/// unsigned), not a setting.
pub const MAX_DELAY: u64 = 1_000_000;

impl Config {
    /// The options' own checks (rank-local).
    pub(super) fn check(&self) -> Result<()> {
        let cfg = self;
        if !(1..=MAX_DELAY).contains(&cfg.delay) {
            return Err(Error::InvalidArgument(format!(
                "delay {} must lie in [1, {MAX_DELAY}] (steps between synchronizations)",
                cfg.delay
            )));
        }
        if cfg.progress_poll_us > MAX_PROGRESS_POLL_US {
            return Err(Error::InvalidArgument(format!(
                "progress_poll_us {} must lie in [0, {MAX_PROGRESS_POLL_US}] (microseconds)",
                cfg.progress_poll_us
            )));
        }
        if !(0.0..1.0).contains(&cfg.momentum) {
            return Err(Error::InvalidArgument(format!(
                "momentum {} must lie in [0, 1)",
                cfg.momentum
            )));
        }
        if !(cfg.weight_decay >= 0.0 && cfg.weight_decay.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "weight_decay {} must be finite and not negative",
                cfg.weight_decay
            )));
        }
        if !(cfg.auto_density > 0.0 && cfg.auto_density <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "auto_density {} must lie in (0, 1]",
                cfg.auto_density
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
            if *steps_per_stage == 0
                || schedule.is_empty()
                || schedule.iter().any(|d| !(*d > 0.0 && *d <= 1.0))
            {
                return Err(Error::InvalidArgument(
                    "density warm-up needs steps_per_stage ≥ 1 and a schedule of one or more \
                     densities in (0, 1]"
                        .into(),
                ));
            }
        }
        if cfg.allreduce.is_auto() && cfg.profile.is_none() {
            return Err(Error::InvalidArgument(
                "allreduce \"auto\" needs Config::profile (gradsync calibrate)".into(),
            ));
        }
        if cfg.sparse_exchange.is_auto() && cfg.profile.is_none() {
            return Err(Error::InvalidArgument(
                "sparse_exchange \"auto\" needs Config::profile (gradsync calibrate)".into(),
            ));
        }
        cfg.codec.build()?;
        Ok(())
    }
}
