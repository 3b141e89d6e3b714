//! The step's local phase: [`GradSync::local_phase`] validates this rank's
//! inputs and runs each layer's local math ([`super::layer`]) as the
//! step's [plan](super::plan) says (mode and codec density of each
//! layer), filling the [`Job`]'s fused dense buffer, sparse units and
//! GradiVeQ inputs for the collectives. No policy and no communication
//! here.

use super::job::{GvqEntry, Job, PsgEntry};
use super::layer::{Layer, StepParams};
use super::plan::{Mode, StepScript};
use super::GradSync;
use crate::comm::Transport;
use crate::{Error, Result};
use rayon::prelude::*;

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Validate this rank's inputs, run the local math (Algorithm 4's
    /// residual and momentum updates, selection and encoding), and fill the
    /// fused dense buffer and GradiVeQ inputs of `job`. An error here is
    /// this rank's alone; the caller still enters the step's collectives.
    /// `plan` is the bucket's (the whole step's for a whole step): its
    /// other layers (`Mode::Other`) are neither read nor touched, and
    /// `grads` (and `weights`) are indexed by layer.
    pub(super) fn local_phase(
        &mut self,
        plan: &StepScript,
        grads: &[&[f32]],
        weights: Option<&[&[f32]]>,
        job: &mut Job,
    ) -> Result<()> {
        // Every element is written below (the dense layers tile the fused
        // buffer), so the buffer is only resized, not cleared: zeroing a
        // whole model's table cost one more pass over memory per step.
        job.buf.dense.resize(plan.dense.elems, 0.0);
        for e in &mut job.buf.gvq {
            e.state = None;
        }
        for e in &mut job.buf.psg {
            e.state = None;
        }
        self.check_inputs(plan, grads, weights)?;
        let cfg = &self.cfg;
        let params = StepParams {
            factor: self.clip_factor(grads),
            momentum: cfg.momentum,
            nesterov: cfg.nesterov,
            wd: cfg.weight_decay,
            delay: plan.delayed,
        };
        self.compress_layers(plan, grads, weights, &params)?;
        self.dense_inputs(plan, grads, weights, &params, job);
        self.hand_over_gvq(job)
    }

    /// One gradient (and one weight tensor) per layer, each of its
    /// layer's length (the bucket's layers only).
    fn check_inputs(
        &self,
        plan: &StepScript,
        grads: &[&[f32]],
        weights: Option<&[&[f32]]>,
    ) -> Result<()> {
        if grads.len() != self.reg.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "{} gradients for {} registered layers",
                grads.len(),
                self.reg.layers.len()
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
        for (i, l) in self.reg.layers.iter().enumerate() {
            if plan.layers[i].mode == Mode::Other {
                continue;
            }
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
        Ok(())
    }

    /// Local clipping (Lin et al. §5.5): one factor for all layers of this
    /// rank, 1 without `clip_norm`.
    fn clip_factor(&self, grads: &[&[f32]]) -> f32 {
        match self.cfg.clip_norm {
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
        }
    }

    /// Sparse and local layers: compress (or take the local step), in
    /// parallel when the plan says it pays. On an error every layer is
    /// rolled back: nothing this rank encoded is sent.
    fn compress_layers(
        &mut self,
        plan: &StepScript,
        grads: &[&[f32]],
        weights: Option<&[&[f32]]>,
        params: &StepParams,
    ) -> Result<()> {
        let work = |(i, l): (usize, &mut Layer)| -> Result<()> {
            let w = weights.map(|w| w[i]);
            let lp = &plan.layers[i];
            match lp.mode {
                Mode::Sparse => l.compress(grads[i], w, params, lp.density),
                Mode::Local => {
                    l.local_step(grads[i], w, params);
                    Ok(())
                }
                Mode::Dense | Mode::Gradiveq | Mode::Powersgd | Mode::Other => Ok(()),
            }
        };
        let r = if plan.parallel_local {
            self.reg
                .layers
                .par_iter_mut()
                .enumerate()
                .try_for_each(work)
        } else {
            self.reg.layers.iter_mut().enumerate().try_for_each(work)
        };
        if let Err(e) = r {
            // Nothing this rank encoded is sent: put it back in the residuals.
            for l in &mut self.reg.layers {
                l.rollback();
            }
            return Err(e);
        }
        Ok(())
    }

    /// Dense layers: their contribution into the fused buffer; GradiVeQ
    /// and PowerSGD layers: their inputs into `job.buf.gvq` and
    /// `job.buf.psg` (one entry each, in layer order).
    fn dense_inputs(
        &mut self,
        plan: &StepScript,
        grads: &[&[f32]],
        weights: Option<&[&[f32]]>,
        params: &StepParams,
        job: &mut Job,
    ) {
        let (mut gi, mut pi) = (0, 0);
        for (i, l) in self.reg.layers.iter_mut().enumerate() {
            let w = weights.map(|w| w[i]);
            let lp = &plan.layers[i];
            if lp.mode == Mode::Dense {
                let dst = &mut job.buf.dense[lp.dense_off..lp.dense_off + l.n];
                // A non-finite contribution makes the sum non-finite on
                // every rank; the status words name this rank (job.rs).
                l.non_finite = !l.dense_contribution(grads[i], w, params, dst);
            } else if lp.mode == Mode::Gradiveq {
                if job.buf.gvq.len() == gi {
                    job.buf.gvq.push(GvqEntry::default());
                }
                let e = &mut job.buf.gvq[gi];
                e.layer = i;
                e.name.clone_from(&l.name);
                e.input.resize(l.n, 0.0);
                e.output.resize(l.n, 0.0);
                e.finite = l.dense_contribution(grads[i], w, params, &mut e.input);
                l.stats.strategy = "gradiveq".into();
                l.stats.codec = "gradiveq".into();
                gi += 1;
            } else if lp.mode == Mode::Powersgd {
                if job.buf.psg.len() == pi {
                    job.buf.psg.push(PsgEntry::default());
                }
                let e = &mut job.buf.psg[pi];
                e.layer = i;
                e.input.resize(l.n, 0.0);
                e.finite = l.dense_contribution(grads[i], w, params, &mut e.input);
                l.stats.strategy = "powersgd".into();
                l.stats.codec = "powersgd".into();
                if let Some(s) = &l.psg {
                    // What its two allreduces carry: P and Q, not the layer.
                    let (np, nq) = s.factor_lens();
                    l.stats.bytes_sent = 4 * (np + nq);
                    l.stats.density = (np + nq) as f64 / l.n.max(1) as f64;
                }
                pi += 1;
            }
        }
        job.buf.gvq.truncate(gi);
        job.buf.psg.truncate(pi);
    }

    /// The GradiVeQ and PowerSGD layers' states into the job, unless
    /// some input is non-finite: NaN/Inf would poison its ring (or the
    /// factors' sums) on every rank, so the step fails on every rank
    /// instead (every layer rolled back).
    fn hand_over_gvq(&mut self, job: &mut Job) -> Result<()> {
        let gvq_bad = job.buf.gvq.iter().find(|e| !e.finite).map(|e| e.layer);
        let psg_bad = job.buf.psg.iter().find(|e| !e.finite).map(|e| e.layer);
        if let Some(bad) = gvq_bad.into_iter().chain(psg_bad).min() {
            let layer = self.reg.layers[bad].name.clone();
            for l in &mut self.reg.layers {
                l.rollback();
            }
            return Err(Error::NonFinite {
                rank: Some(self.rank),
                layer,
            });
        }
        for e in &mut job.buf.gvq {
            e.state = self.reg.layers[e.layer].gvq.take();
        }
        for e in &mut job.buf.psg {
            e.state = self.reg.layers[e.layer].psg.take();
        }
        Ok(())
    }
}
