//! One layer's state and the local math of a step: RedSync's Algorithm 4
//! (Appendix A; §4, §5.6): momentum correction (plain or Nesterov),
//! residual accumulation `V`, selection and encoding by the layer's codec,
//! momentum factor masking and error feedback (`V -= sent`, or `γ·V` for
//! damped codecs), undone by `unsend` when a step fails; dense layers'
//! contribution to the fused allreduce buffer and momentum on the average;
//! SBC's communication delay (local directions accumulated in `acc`, put
//! back from `prev` when a communicating step fails; the caller's weights
//! go back to `wc`, `delay.rs`); Lin et al.'s local gradient clipping
//! (§5.5). [`GradSync::local_phase`](super::local) runs it over the table.
//! No policy and no communication here.

use super::plan::{Mode, RowKind, TableRow};
use super::{LayerStats, Strategy};
use crate::codec::Codec;
use crate::{Error, Result};
use std::time::Instant;

pub(super) struct Layer {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) n: usize,
    pub(super) strategy: Strategy,
    pub(super) codec: Option<Box<dyn Codec>>,
    /// Residual V (sparse layers).
    pub(super) v: Vec<f32>,
    /// Momentum U (when momentum ≠ 0).
    pub(super) u: Vec<f32>,
    /// Delay: sum of local directions applied since the last communication.
    pub(super) acc: Vec<f32>,
    /// Delay: `acc` before this step's direction (put back when a
    /// communicating step fails).
    pub(super) prev: Vec<f32>,
    /// Delay: the weights at the start of the delay window (after the last
    /// communicating step: the same on every rank), written back into the
    /// caller's weights at the next communicating step (`delay.rs`).
    pub(super) wc: Vec<f32>,
    /// Local direction (delayed steps) or dense decode scratch.
    pub(super) dir: Vec<f32>,
    /// This step's encoded unit.
    pub(super) unit: Vec<u8>,
    /// GradiVeQ state (moved into the communication job during a step).
    pub(super) gvq: Option<crate::gradiveq::schedule::GradiveqLayer>,
    /// PowerSGD state (moved into the communication job during a step).
    pub(super) psg: Option<crate::powersgd::PowerSgd>,
    /// Density the codec was last set to.
    pub(super) cur_density: Option<f64>,
    pub(super) non_finite: bool,
    /// This step's unit was subtracted from the residual (undone by
    /// `unsend` when the step fails).
    pub(super) sent: bool,
    /// The codec's encoder state before this step's encode (QSGD's and
    /// RGC-quant's call counters, RGC's reused threshold), put back by
    /// `rollback` when the step fails: a failed step leaves no trace in
    /// what later steps encode. `None` for a stateless codec or before
    /// the encode.
    pub(super) codec_state: Option<Vec<u8>>,
    /// Delay: where this communicating step moved `acc` (undone by
    /// `rollback` when the step fails).
    pub(super) moved: Moved,
    pub(super) stats: LayerStats,
}

impl Layer {
    /// The planner's row of this layer: its strategy's, dense where
    /// PowerSGD leaves it dense (a vector, or too small: no state).
    pub(super) fn table_row(&self) -> TableRow {
        let mut row = TableRow::new(self.n, &self.strategy);
        if self.psg.is_none() && matches!(row.kind, RowKind::Powersgd { .. }) {
            row.kind = RowKind::Dense;
        }
        row
    }

    /// The matrix the step model prices PowerSGD on: a PowerSGD layer's
    /// own (none where it stays dense), any other layer's view of its
    /// shape ([`crate::powersgd::matrix_view`]).
    pub(super) fn matrix(&self) -> Option<(usize, usize)> {
        match &self.strategy {
            Strategy::Powersgd(_) => self.psg.as_ref().map(|p| p.shape()),
            _ => crate::powersgd::matrix_view(&self.shape),
        }
    }
}

/// Where a communicating step of `delay > 1` moved the layer's `acc` (the
/// local directions applied since the last communication), kept in `prev`.
/// A step that fails must put it back: those directions were applied by
/// the caller and are still to be exchanged and subtracted, or the ranks'
/// weights drift apart for good.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Moved {
    /// Nothing moved (no delay, a local step, or not yet).
    #[default]
    No,
    /// Into the fused dense buffer.
    Dense,
    /// Into the residual `V` (a sparse layer).
    Residual,
}

/// `n` zeros when `on` (without writing them when `!fill`: a probe that
/// `n` floats can be allocated), or an error instead of the allocator's
/// abort when they cannot be.
pub(super) fn zeros(n: usize, on: bool, fill: bool) -> Result<Vec<f32>> {
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

/// The step's parameters of the local math, the same for every layer.
pub(super) struct StepParams {
    pub(super) factor: f32,
    pub(super) momentum: f32,
    pub(super) nesterov: bool,
    pub(super) wd: f32,
    pub(super) delay: bool,
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

/// Whether this step's input is finite: the gradient, and the weights
/// where weight decay reads them (unused weights are not checked: a NaN
/// there changes nothing gradsync computes).
fn input_finite(g: &[f32], w: Option<&[f32]>, p: &StepParams) -> bool {
    all_finite(g) && (p.wd == 0.0 || w.is_none_or(all_finite))
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

    /// A delayed step without communication: the local direction into
    /// `dir` and, with momentum, the new `U` into `prev` (free between
    /// communicating steps). Nothing of the layer's state changes until
    /// the step is known to have succeeded on every rank
    /// ([`commit_local`](Self::commit_local)).
    pub(super) fn local_step(&mut self, g: &[f32], w: Option<&[f32]>, p: &StepParams) {
        let t = Instant::now();
        self.dir.resize(self.n, 0.0);
        if !input_finite(g, w, p) {
            self.dir.fill(f32::NAN);
            self.non_finite = true;
        } else if p.momentum == 0.0 {
            for i in 0..self.n {
                self.dir[i] = g_eff(g, w, p, i);
            }
        } else {
            for i in 0..self.n {
                let gi = g_eff(g, w, p, i);
                let ui = p.momentum * self.u[i] + gi;
                self.prev[i] = ui;
                self.dir[i] = if p.nesterov { gi + p.momentum * ui } else { ui };
            }
        }
        self.stats.strategy = "local".into();
        self.stats.bytes_sent = 0;
        self.stats.pack_s = t.elapsed().as_secs_f64();
    }

    /// Sparse step: accumulate into the residual, encode, keep what was not
    /// sent.
    pub(super) fn compress(
        &mut self,
        g: &[f32],
        w: Option<&[f32]>,
        p: &StepParams,
        want: Option<f64>,
    ) -> Result<()> {
        let t0 = Instant::now();
        if !input_finite(g, w, p) {
            self.send_nothing(t0);
            return Ok(());
        }
        let n = self.n;
        self.accumulate(g, w, p);
        self.apply_density(want);
        let codec = self.codec.as_mut().expect("sparse layer has a codec");
        let fb = codec
            .feedback(n)
            .map_err(|e| Error::InvalidArgument(format!("layer {:?}: {e}", self.name)))?;
        let state = codec.state();
        self.codec_state = (!state.is_empty()).then_some(state);
        let t1 = Instant::now();
        let pre = t1 - t0;
        let enc = self.encode_residual(fb);
        if enc.is_err() && !all_finite(&self.v) {
            self.clear_overflow(g);
            self.send_nothing(t0);
            return Ok(());
        }
        enc.map_err(|e| {
            Error::InvalidArgument(format!("layer {:?}: encoding failed: {e}", self.name))
        })?;
        let t2 = Instant::now();
        let no_fb = fb == crate::codec::Feedback::None;
        let sent = self.subtract_sent(no_fb)?;
        self.sent = true;
        // Starvation: nothing sent although there was something to send.
        let starved = sent == 0 && self.v.iter().any(|&x| x != 0.0);
        let norm = if starved {
            self.v
                .iter()
                .map(|&x| f64::from(x).powi(2))
                .sum::<f64>()
                .sqrt()
        } else {
            0.0
        };
        if no_fb {
            self.v.fill(0.0);
        }
        self.count_starvation(starved, norm);
        let codec = self.codec.as_deref().expect("sparse layer has a codec");
        self.stats.feedback = fb.label();
        self.stats.strategy = "sparse".into();
        self.stats.codec = codec.config().name();
        self.stats.density = if n == 0 { 0.0 } else { sent as f64 / n as f64 };
        self.stats.bytes_sent = self.unit.len();
        self.stats.select_s = (t2 - t1).as_secs_f64();
        self.stats.pack_s = (pre + t2.elapsed()).as_secs_f64();
        Ok(())
    }

    /// A sparse step whose input is non-finite (or whose residual
    /// overflowed): no unit, the layer marked, the time since `t0` its
    /// packing.
    fn send_nothing(&mut self, t0: Instant) {
        self.non_finite = true;
        self.unit.clear();
        self.stats.pack_s = t0.elapsed().as_secs_f64();
    }

    /// The momentum-corrected direction of `g_eff` into the residual:
    /// `V += d`; with a delay, also the local directions since the last
    /// communication (`prev = acc; V += acc + d; acc = 0`).
    #[inline]
    fn accumulate(&mut self, g: &[f32], w: Option<&[f32]>, p: &StepParams) {
        let n = self.n;
        if p.delay {
            // prev = acc; acc += d; V += acc; acc = 0.
            self.moved = Moved::Residual;
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
    }

    /// The plan's density into the codec when it changed.
    fn apply_density(&mut self, want: Option<f64>) {
        let codec = self.codec.as_mut().expect("sparse layer has a codec");
        if want != self.cur_density {
            if let Some(d) = want {
                // Codecs without a density keep their own (documented).
                if let Err(e) = codec.set_density(d) {
                    log::debug!("gradsync: layer {:?}: {e}", self.name);
                }
            }
            self.cur_density = want;
        }
    }

    /// Encode the residual into `unit` (`γ·V` for a damped codec).
    fn encode_residual(&mut self, fb: crate::codec::Feedback) -> Result<()> {
        let codec = self.codec.as_mut().expect("sparse layer has a codec");
        match fb {
            crate::codec::Feedback::Damped(gamma) => {
                // Encode γ·V (V keeps what was not sent of V itself).
                self.dir.clear();
                self.dir.extend(self.v.iter().map(|x| gamma * x));
                codec.encode(&self.dir, &mut self.unit)
            }
            _ => codec.encode(&self.v, &mut self.unit),
        }
    }

    /// Finite gradients whose sum overflowed f32 in the residual (or the
    /// momentum): a non-finite input of this step, as the `non_finite`
    /// policy treats one, and a state no later step could encode (it
    /// stayed infinite and failed every step). What overflowed has no
    /// value left to keep: cleared.
    #[cold]
    fn clear_overflow(&mut self, g: &[f32]) {
        log::warn!(
            "gradsync: layer {:?}: the residual overflowed f32 (gradients near {:.1e}); \
             this step's input counts as non-finite, the residual and momentum are cleared",
            self.name,
            g.iter().fold(0f32, |a, x| a.max(x.abs()))
        );
        self.v.fill(0.0);
        self.u.fill(0.0);
    }

    /// `V -= sent; U[i] = 0` where sent (momentum factor masking; not
    /// without feedback, where V is this step's direction only). Returns
    /// the elements sent.
    fn subtract_sent(&mut self, no_fb: bool) -> Result<usize> {
        let n = self.n;
        let codec = self.codec.as_deref().expect("sparse layer has a codec");
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
        Ok(sent)
    }

    /// Count consecutive starved steps (`norm`: the residual's), warning
    /// at N, 2N, 4N, ... of them.
    fn count_starvation(&mut self, starved: bool, norm: f64) {
        if starved {
            self.stats.starved_steps += 1;
            // Warn at N, 2N, 4N, ... consecutive steps.
            let (k, lim) = (self.stats.starved_steps, crate::codec::STARVED_STEPS);
            if k % lim == 0 && (k / lim).is_power_of_two() {
                let codec = self.codec.as_deref().expect("sparse layer has a codec");
                log::warn!(
                    "gradsync: layer {:?} ({} elements, codec {}) sent nothing for {k} \
                     consecutive steps while its residual grew (norm {:.3e}): it starves",
                    self.name,
                    self.n,
                    codec.config().name(),
                    norm
                );
            }
        } else {
            self.stats.starved_steps = 0;
        }
    }

    /// A local step that succeeded on every rank: `o` = the direction,
    /// added to `acc`; the new momentum (in `prev`) becomes `U`.
    pub(super) fn commit_local(&mut self, o: &mut [f32], momentum: f32) {
        for ((x, &d), a) in o.iter_mut().zip(&self.dir).zip(self.acc.iter_mut()) {
            *x = d;
            *a += d;
        }
        if momentum != 0.0 {
            std::mem::swap(&mut self.u, &mut self.prev);
        }
    }

    /// Undo what a failed step did to this layer's state: what it encoded
    /// goes back into the residual ([`unsend`](Self::unsend)), and with
    /// `delay > 1` the local directions it took out of `acc` go back there
    /// (and out of `V` again, keeping this step's gradient in the residual);
    /// a PowerSGD layer that ran in this step (a bucket before the one that
    /// failed) gets its error and `Q` back
    /// ([`crate::powersgd::PowerSgd::rollback`]); a stateful codec gets its
    /// state from before the encode.
    pub(super) fn rollback(&mut self) {
        self.unsend();
        if let (Some(state), Some(codec)) = (self.codec_state.take(), self.codec.as_mut()) {
            // The codec's own state, taken this step: it reads back.
            if let Err(e) = codec.set_state(&state) {
                log::warn!("layer {:?}: codec state not restored: {e}", self.name);
            }
        }
        if let Some(p) = &mut self.psg {
            p.rollback();
        }
        match std::mem::take(&mut self.moved) {
            Moved::No => {}
            Moved::Dense => self.acc.copy_from_slice(&self.prev),
            Moved::Residual => {
                self.acc.copy_from_slice(&self.prev);
                crate::dense::sub_from(&mut self.v, &self.prev);
            }
        }
    }

    /// Undo `V -= sent` of this step (a failed step sends nothing): the
    /// residual again holds this step's gradient. Momentum masking is not
    /// undone (it only zeroes `U` where values were selected).
    pub(super) fn unsend(&mut self) {
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
    ///
    /// Returns whether the contribution is finite, checked block by block
    /// while each block is still in the L1 cache (a separate pass over a
    /// 97.5 MiB layer took 4.4 ms, 40 % of the contribution itself).
    pub(super) fn dense_contribution(
        &mut self,
        g: &[f32],
        w: Option<&[f32]>,
        p: &StepParams,
        dst: &mut [f32],
    ) -> bool {
        const BLOCK: usize = 4096;
        let t = Instant::now();
        if p.delay && !input_finite(g, w, p) {
            // With `delay > 1` the momentum is applied here, before the
            // exchange: a non-finite gradient must not reach `U` or `acc`.
            // The NaN contribution makes the sum non-finite on every rank,
            // which voids the step everywhere (unpack.rs).
            dst.fill(f32::NAN);
            self.stats.pack_s = t.elapsed().as_secs_f64();
            return false;
        }
        let mut finite = true;
        for start in (0..self.n).step_by(BLOCK) {
            let end = (start + BLOCK).min(self.n);
            if p.delay {
                self.moved = Moved::Dense;
                for i in start..end {
                    let d = Self::direction(&mut self.u, p, i, g_eff(g, w, p, i));
                    self.prev[i] = self.acc[i];
                    dst[i] = self.acc[i] + d;
                    self.acc[i] = 0.0;
                }
            } else {
                for (i, d) in dst[start..end].iter_mut().enumerate() {
                    *d = g_eff(g, w, p, start + i);
                }
            }
            if !self.v.is_empty() {
                // A sparse layer in dense warm-up: flush its residual.
                crate::dense::add_into(&mut dst[start..end], &self.v[start..end]);
            }
            finite &= all_finite(&dst[start..end]);
        }
        if !self.v.is_empty() {
            self.v.fill(0.0);
        }
        self.stats.strategy = "dense".into();
        self.stats.codec = "none".into();
        self.stats.density = 1.0;
        self.stats.bytes_sent = 4 * self.n;
        self.stats.pack_s = t.elapsed().as_secs_f64();
        finite
    }

    /// Dense result `o` (the average): apply momentum. With a delay the
    /// average is the result as it is (momentum was applied before the
    /// exchange, and the caller's weights went back to the window's start,
    /// `delay.rs`).
    pub(super) fn dense_update(&mut self, o: &mut [f32], (m, nesterov, delay): (f32, bool, bool)) {
        if !delay && m != 0.0 {
            for (x, u) in o.iter_mut().zip(self.u.iter_mut()) {
                *u = m * *u + *x;
                *x = if nesterov { *x + m * *u } else { *u };
            }
        }
    }

    /// [`Self::dense_update`] of the average `a` written into `o`, in one
    /// pass over memory instead of a copy and an update (bitwise the same).
    pub(super) fn dense_update_from(
        &mut self,
        a: &[f32],
        o: &mut [f32],
        (m, nesterov, delay): (f32, bool, bool),
    ) {
        if !delay && m != 0.0 && self.u.len() == o.len() {
            for ((x, &y), u) in o.iter_mut().zip(a).zip(self.u.iter_mut()) {
                *u = m * *u + y;
                *x = if nesterov { y + m * *u } else { *u };
            }
        } else {
            o.copy_from_slice(a);
            self.dense_update(o, (m, nesterov, delay));
        }
    }

    /// [`Self::dense_update_from`] of the ranks' sum `s`, averaged by `avg`
    /// in the same pass (bitwise the average, then the update).
    pub(super) fn dense_update_from_sum(
        &mut self,
        s: &[f32],
        o: &mut [f32],
        params: (f32, bool, bool),
        avg: crate::dense::Averaging,
    ) {
        use crate::dense::Averaging;
        match avg {
            Averaging::Mul(r) => self.dense_update_mapped(s, o, params, move |y| y * r),
            Averaging::Div(d) => self.dense_update_mapped(s, o, params, move |y| y / d),
        }
    }

    /// [`Self::dense_update_from`] of `f` of every element of `a` (one
    /// loop per `f`, so that it vectorizes).
    fn dense_update_mapped(
        &mut self,
        a: &[f32],
        o: &mut [f32],
        (m, nesterov, delay): (f32, bool, bool),
        f: impl Fn(f32) -> f32,
    ) {
        if !delay && m != 0.0 && self.u.len() == o.len() {
            for ((x, &y), u) in o.iter_mut().zip(a).zip(self.u.iter_mut()) {
                let y = f(y);
                *u = m * *u + y;
                *x = if nesterov { y + m * *u } else { *u };
            }
        } else {
            for (x, &y) in o.iter_mut().zip(a) {
                *x = f(y);
            }
            self.dense_update(o, (m, nesterov, delay));
        }
    }

    /// Clear the per-step flags and timers before a step.
    pub(super) fn begin_step(&mut self) {
        if let Some(p) = &mut self.psg {
            // The last step stands: only this step's PowerSGD is undone.
            p.settle();
        }
        self.non_finite = false;
        self.sent = false;
        self.codec_state = None;
        self.moved = Moved::No;
        self.stats.select_s = 0.0;
        self.stats.unpack_s = 0.0;
    }

    /// The ratio (and, for a local step, codec and density) of this step's
    /// stats, once the step is done.
    pub(super) fn fill_stats(&mut self, mode: Mode) {
        let s = &mut self.stats;
        s.ratio = if s.bytes_sent == 0 {
            f64::INFINITY
        } else {
            (4 * self.n) as f64 / s.bytes_sent as f64
        };
        if mode == Mode::Local {
            s.codec = "none".into();
            s.density = 0.0;
        }
    }
}
