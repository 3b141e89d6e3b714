//! GradiVeQ's training schedule for one layer (§3): a warm-up of plain ring
//! all-reduces, then `L_t` iterations aggregated with 4-bit QSGD whose
//! aggregated results are the PCA samples, then up to `L_c` compressed
//! iterations (Algorithm 1), and again. Every compressed iteration each rank
//! computes its local compression loss (eq. 7, relative to `‖g_n‖²`); when
//! a majority of ranks exceed the threshold (one small allreduce counts
//! them) the layer goes back to collecting samples at once to rebuild its
//! compressor.
//!
//! Every rank fits from the same QSGD-aggregated samples (the QSGD ring's
//! result is identical on every rank) with deterministic math, so the
//! compressors are bit-identical; [`GradiveqLayer::compressor_hash`] lets a
//! test compare them.

use super::ring::{gradiveq_ring_allreduce, qsgd_ring_allreduce, RingWorkspace};
use super::{Compressor, Dim, LayerCompressor};
use crate::comm::Transport;
use crate::dense::{rabenseifner_allreduce, ring_allreduce_with, AllreduceOptions, Workspace};
use crate::{Error, Result};

/// Parameters of the schedule.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Slice size K.
    pub k: usize,
    /// Components kept.
    pub dim: Dim,
    /// Compressor reuse factor `s` (`None` = one compressor per layer).
    pub reuse: Option<usize>,
    /// Plain ring iterations before the first collection.
    pub warmup: u64,
    /// Samples per compressor (`L_t`, the paper's 100).
    pub lt: usize,
    /// Compressed iterations before a periodic rebuild (`L_c`, the paper's 400).
    pub lc: usize,
    /// Relative eq.-7 loss above which a rank votes for a rebuild.
    pub loss_threshold: f64,
    /// QSGD bits of the sample-collecting iterations (the paper's 4).
    pub qsgd_bits: u32,
    /// QSGD bucket of those iterations (0: one norm per segment).
    pub qsgd_bucket: usize,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            k: 768,
            dim: Dim::Lambda(0.01),
            reuse: None,
            warmup: 0,
            lt: 100,
            lc: 400,
            loss_threshold: 0.05,
            qsgd_bits: 4,
            qsgd_bucket: 512,
        }
    }
}

impl ScheduleConfig {
    /// Check every parameter for a layer of `n` elements, so that a bad one
    /// fails at registration, not at the step that first uses it (the
    /// QSGD bits at the first collection, λ and `d` when the compressor is
    /// fitted `L_t` steps later). Nothing is clamped.
    pub fn validate(&self, n: usize) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("GradiVeQ: {why}")));
        if self.k == 0 || n < self.k {
            return bad(format!(
                "the slice size k = {} must lie in 1..={n} (the layer's elements)",
                self.k
            ));
        }
        let slices = n / self.k;
        match self.dim {
            Dim::Fixed(d) if d == 0 || d > self.k => {
                return bad(format!("d = {d} must lie in 1..={} (k)", self.k))
            }
            Dim::Lambda(l) if !(0.0..1.0).contains(&l) => {
                return bad(format!("lambda = {l} must lie in [0, 1)"))
            }
            _ => {}
        }
        if let Some(r) = self.reuse.filter(|&r| r == 0 || r > slices) {
            return bad(format!(
                "reuse = {r} must lie in 1..={slices} (the layer's slices of {})",
                self.k
            ));
        }
        if self.lt < 2 {
            return bad(format!("lt = {} must be at least 2", self.lt));
        }
        if self.lc == 0 {
            return bad("lc = 0: at least one compressed step between rebuilds".into());
        }
        if !(self.loss_threshold.is_finite() && self.loss_threshold >= 0.0) {
            return bad(format!(
                "loss_threshold = {} must be finite and not negative",
                self.loss_threshold
            ));
        }
        if !(2..=8).contains(&self.qsgd_bits) {
            return bad(format!("qsgd_bits = {} must lie in 2..=8", self.qsgd_bits));
        }
        Ok(())
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepKind {
    /// Plain ring all-reduce (warm-up).
    Warmup,
    /// QSGD ring; the result became PCA sample `i` of `L_t`.
    Collect(usize),
    /// Compressed; this rank's relative eq.-7 loss and how many ranks voted
    /// for a rebuild.
    Compressed {
        /// This rank's relative loss.
        loss: f64,
        /// Ranks above the threshold.
        votes: usize,
    },
}

/// One layer's GradiVeQ state. Serializes (without its scratch buffers) for
/// the engine's snapshots.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct GradiveqLayer {
    cfg: ScheduleConfig,
    n: usize,
    step: u64,
    /// Samples of the first slice of every compressor group, `L_t` rows.
    samples: Vec<Vec<f32>>,
    compressor: Option<LayerCompressor>,
    compressed_steps: usize,
    rebuilds: u64,
    #[serde(skip)]
    ws: RingWorkspace,
    #[serde(skip)]
    dws: Workspace<f32>,
    #[serde(skip)]
    scratch: Vec<f32>,
    #[serde(skip)]
    scratch2: Vec<f32>,
}

impl GradiveqLayer {
    /// A layer of `n` elements.
    pub fn new(n: usize, cfg: ScheduleConfig) -> Result<Self> {
        cfg.validate(n)?;
        Ok(GradiveqLayer {
            cfg,
            n,
            step: 0,
            samples: Vec::new(),
            compressor: None,
            compressed_steps: 0,
            rebuilds: 0,
            ws: RingWorkspace::default(),
            dws: Workspace::new(),
            scratch: Vec::new(),
            scratch2: Vec::new(),
        })
    }

    /// Check a deserialized state against the layer it is restored into.
    pub fn validate(&self, n: usize, cfg: &ScheduleConfig) -> Result<()> {
        if self.n != n || &self.cfg != cfg {
            return Err(Error::Decode(
                "GradiVeQ state is for another layer or other parameters".into(),
            ));
        }
        let sample_len = {
            let slices = n / cfg.k;
            slices.div_ceil(cfg.reuse.unwrap_or(slices).clamp(1, slices)) * cfg.k
        };
        if self.samples.len() > cfg.lt || self.samples.iter().any(|s| s.len() != sample_len) {
            return Err(Error::Decode("inconsistent GradiVeQ samples".into()));
        }
        // A NaN sample would make the next PCA fit fail inside a step (an
        // abort of the job); refuse it at restore time.
        if self.samples.iter().flatten().any(|v| !v.is_finite()) {
            return Err(Error::Decode("GradiVeQ samples hold NaN/Inf".into()));
        }
        match &self.compressor {
            Some(c) if c.len() != n || c.k() != cfg.k => {
                Err(Error::Decode("GradiVeQ compressor of another shape".into()))
            }
            Some(c) => c.validate(),
            None => Ok(()),
        }
    }

    /// Compressors built so far (the first one included).
    pub fn rebuilds(&self) -> u64 {
        self.rebuilds
    }
    /// The current compressor, if any.
    pub fn compressor(&self) -> Option<&LayerCompressor> {
        self.compressor.as_ref()
    }
    /// Hash of the current compressor (0 without one).
    pub fn compressor_hash(&self) -> u64 {
        self.compressor.as_ref().map_or(0, LayerCompressor::hash)
    }

    /// One aggregation: `out` becomes the (approximate) sum over ranks of
    /// `g`, the same on every rank.
    pub fn step<C: Transport>(&mut self, comm: &C, g: &[f32], out: &mut [f32]) -> Result<StepKind> {
        if g.len() != self.n || out.len() != self.n {
            return Err(Error::InvalidArgument(format!(
                "GradiVeQ layer of {} elements got {} and {}",
                self.n,
                g.len(),
                out.len()
            )));
        }
        let p = comm.size();
        // Saturating: a restored counter may sit at its maximum.
        self.step = self.step.saturating_add(1);
        if self.step <= self.cfg.warmup {
            out.copy_from_slice(g);
            let opts = AllreduceOptions {
                validate: false,
                ..AllreduceOptions::default()
            };
            ring_allreduce_with(comm, out, &opts, &mut self.dws)?;
            return Ok(StepKind::Warmup);
        }
        if let Some(lc) = &self.compressor {
            gradiveq_ring_allreduce(comm, lc, g, out, &mut self.ws)?;
            // Eq. 7 locally: ‖g − (U Q(g) + μ/N)‖² / ‖g‖².
            let slices = lc.slices();
            self.scratch.resize(lc.compressed_len(0, slices, true), 0.0);
            self.scratch2.resize(self.n, 0.0);
            lc.compress_range(g, p, 0, slices, true, &mut self.scratch);
            lc.decompress_range(&self.scratch, 0, slices, true, &mut self.scratch2);
            let k = lc.k();
            let (mut num, mut den) = (0f64, 0f64);
            for (i, (&x, &y)) in g.iter().zip(&self.scratch2).enumerate() {
                // decompress gives U Q(g) + μ; eq. 7 wants U Q(g) + μ/N.
                let mu = if i < slices * k {
                    lc.group_of(i / k).mu()[i % k]
                } else {
                    0.0
                };
                let approx = y - mu + mu / p as f32;
                num += f64::from(x - approx).powi(2);
                den += f64::from(x).powi(2);
            }
            let loss = num / den.max(1e-300);
            let mut vote = vec![f32::from(u8::from(loss > self.cfg.loss_threshold))];
            rabenseifner_allreduce(comm, &mut vote, &AllreduceOptions::default())?;
            let votes = vote[0].round() as usize;
            self.compressed_steps = self.compressed_steps.saturating_add(1);
            if 2 * votes > p || self.compressed_steps >= self.cfg.lc {
                log::info!(
                    "gradiveq: rebuilding the compressor ({votes} of {p} ranks above loss {}, {} compressed steps)",
                    self.cfg.loss_threshold,
                    self.compressed_steps
                );
                self.compressor = None;
                self.samples.clear();
            }
            return Ok(StepKind::Compressed { loss, votes });
        }
        // Collect: QSGD-aggregated, the result is a sample.
        qsgd_ring_allreduce(
            comm,
            g,
            out,
            self.cfg.qsgd_bits,
            self.cfg.qsgd_bucket,
            self.step,
            &mut self.ws,
        )?;
        let k = self.cfg.k;
        let slices = self.n / k;
        let reuse = self.cfg.reuse.unwrap_or(slices).clamp(1, slices);
        let mut sample = Vec::with_capacity(slices.div_ceil(reuse) * k);
        let mut first = 0;
        while first < slices {
            sample.extend_from_slice(&out[first * k..(first + 1) * k]);
            first += reuse;
        }
        self.samples.push(sample);
        let got = self.samples.len();
        if got >= self.cfg.lt {
            let groups = slices.div_ceil(reuse);
            let mut comps = Vec::with_capacity(groups);
            for gi in 0..groups {
                let refs: Vec<&[f32]> = self
                    .samples
                    .iter()
                    .map(|s| &s[gi * k..(gi + 1) * k])
                    .collect();
                comps.push(Compressor::fit(&refs, self.cfg.dim)?);
            }
            self.compressor = Some(LayerCompressor::from_groups(self.n, k, reuse, comps)?);
            self.rebuilds = self.rebuilds.saturating_add(1);
            self.compressed_steps = 0;
            self.samples.clear();
        }
        Ok(StepKind::Collect(got - 1))
    }
}
