//! SBC's communication delay without drift (SBC §3, "communication
//! delay"): with `delay = T > 1` each rank applies its own local
//! directions for `T − 1` steps, and every `T`-th step exchanges the sum
//! of its directions since the last exchange.
//!
//! Subtracting the locally applied directions from that average (the
//! engine's first form) cannot bring the ranks back together: the caller
//! applied them with its own learning rate per step (a schedule changes
//! it between steps) and rounded each update, so the ranks' weights drift
//! apart for good. Here the engine keeps the weights at the start of each
//! delay window (the first step after a communicating one, when every
//! rank's weights are the same), and a communicating step writes them back
//! into the caller's weights after its local phase has read them (for
//! weight decay). Its result is the average of every rank's directions
//! since that point, so `w -= lr · r` gives every rank the same weights,
//! bit for bit, whatever the learning rate.
//!
//! The engine therefore needs the weights, writable, at every step of a
//! delayed run: [`GradSync::sync_with_weights_mut`],
//! [`GradSync::start_with_weights_mut`] and
//! [`GradSync::submit_bucket_with_weights_mut`]. Any other entry with
//! `delay > 1` fails the step on every rank (as any rank-local failure
//! does), saying why.

use super::bucket::Input;
use super::{GradSync, LayerId, StepStats};
use crate::comm::Transport;
use crate::{Error, Result};

/// The delay window's state (`delay > 1`): whether the next step starts a
/// window, whether the open step kept its weights, whether this call
/// writes them back, and why this rank diverged.
pub(super) struct Window {
    /// `delay > 1`: the next step starts a delay window (the first step,
    /// or the one after a communicating step that succeeded on every
    /// rank): its weights are kept (`delay.rs`).
    pub(super) start: bool,
    /// The open step kept weights for its window (`start` ends with
    /// the step).
    pub(super) kept: bool,
    /// This call writes the window's weights back (`delay.rs`): set only
    /// while a `*_with_weights_mut` call submits.
    pub(super) resets_weights: bool,
    /// Set when a delayed communicating step's result was discarded on
    /// this rank (`delay.rs`): every step fails on every rank until a
    /// restore.
    pub(super) diverged: Option<String>,
}

impl Default for Window {
    /// Before the first step: it starts a window.
    fn default() -> Self {
        Window {
            start: true,
            kept: false,
            resets_weights: false,
            diverged: None,
        }
    }
}

/// Why a delayed step without writable weights is refused.
const NEEDS_WEIGHTS: &str = "delay > 1 needs the weights, writable, at every step \
     (Rust: sync_with_weights_mut / start_with_weights_mut / submit_bucket_with_weights_mut; \
     Python: sync(grads, weights=...) with writable float32 numpy arrays): at each \
     communicating step the engine puts back the weights every rank had at the last one, \
     or the ranks' weights drift apart";

impl<C: Transport + Send + 'static> GradSync<C> {
    /// [`sync_with_weights`](Self::sync_with_weights) that may write the
    /// weights: needed with `delay > 1`, where a communicating step puts
    /// back into `weights` the weights of the delay window's first step
    /// (the same on every rank) and returns the average of every rank's
    /// directions since then; `w -= lr · r` then leaves every rank with
    /// the same weights, bit for bit. Without a delay it is
    /// `sync_with_weights`.
    ///
    /// ```
    /// use gradsync::comm::{LocalComm, Transport};
    /// use gradsync::sync::{Config, GradSync};
    /// let w = LocalComm::run(2, |comm| {
    ///     let rank = comm.rank() as f32;
    ///     let mut s = GradSync::with_transport(comm, Config { delay: 3, ..Config::default() }).unwrap();
    ///     s.register("w", &[4]).unwrap();
    ///     let mut w = vec![1.0f32; 4];
    ///     for step in 0..6 {
    ///         let lr = 0.1 / (1.0 + step as f32); // a schedule
    ///         let mut g = vec![rank + 0.3 * step as f32; 4];
    ///         s.sync_with_weights_mut(&mut [&mut g[..]], &mut [&mut w[..]]).unwrap();
    ///         w.iter_mut().zip(&g).for_each(|(w, d)| *w -= lr * d);
    ///     }
    ///     w
    /// });
    /// assert_eq!(w[0], w[1]); // after the communicating step 5
    /// ```
    pub fn sync_with_weights_mut(
        &mut self,
        grads: &mut [&mut [f32]],
        weights: &mut [&mut [f32]],
    ) -> Result<&StepStats> {
        {
            let view: Vec<&[f32]> = grads.iter().map(|g| &**g).collect();
            self.start_with_weights_mut(&view, weights)?;
        }
        self.wait(grads)
    }

    /// [`start_with_weights`](Self::start_with_weights) that may write the
    /// weights (see [`sync_with_weights_mut`](Self::sync_with_weights_mut)):
    /// a communicating step of `delay > 1` has written them back when it
    /// returns.
    pub fn start_with_weights_mut(
        &mut self,
        grads: &[&[f32]],
        weights: &mut [&mut [f32]],
    ) -> Result<()> {
        let all: Vec<LayerId> = (0..self.reg.layers.len()).map(LayerId).collect();
        self.in_window(&all, weights, |s, w| s.start_impl(Ok((grads, Some(w)))))
    }

    /// [`submit_bucket_with_weights`](Self::submit_bucket_with_weights)
    /// that may write the bucket's weights (`weights[j]` is layer
    /// `layers[j]`'s; see
    /// [`sync_with_weights_mut`](Self::sync_with_weights_mut)).
    pub fn submit_bucket_with_weights_mut(
        &mut self,
        layers: &[LayerId],
        grads: &[&[f32]],
        weights: &mut [&mut [f32]],
    ) -> Result<()> {
        self.in_window(layers, weights, |s, w| {
            s.submit_impl(layers, Ok((grads, Some(w))))
        })
    }

    /// Run `submit` with `weights` read-only, between the two ends of the
    /// delay window: at the window's first step the weights are kept, and
    /// after a communicating step's local phase they are put back.
    /// Layers whose weights have the wrong length are left alone (the step
    /// fails on every rank for them).
    fn in_window(
        &mut self,
        ids: &[LayerId],
        weights: &mut [&mut [f32]],
        submit: impl FnOnce(&mut Self, &[&[f32]]) -> Result<()>,
    ) -> Result<()> {
        let t = self.cfg.delay;
        let fits = |s: &Self, id: LayerId, w: &[f32]| {
            s.reg
                .layers
                .get(id.0)
                .is_some_and(|l| l.wc.len() == w.len() && l.n == w.len())
        };
        let paired = ids.len() == weights.len();
        self.window.resets_weights = true;
        let r = {
            let view: Vec<&[f32]> = weights.iter().map(|w| &**w).collect();
            submit(self, &view)
        };
        self.window.resets_weights = false;
        // A call refused on this rank alone (misuse) keeps nothing.
        r?;
        // The step reads the weights, never writes them: they are kept
        // after it as they were before it (and before the write-back).
        if t > 1 && paired && self.window.start {
            for (&id, w) in ids.iter().zip(weights.iter()) {
                if fits(self, id, w) {
                    self.reg.layers[id.0].wc.copy_from_slice(w);
                }
            }
            self.window.kept = true;
        }
        if t > 1 && paired && self.plan.communicates {
            for (&id, w) in ids.iter().zip(weights.iter_mut()) {
                if fits(self, id, w) {
                    w.copy_from_slice(&self.reg.layers[id.0].wc);
                }
            }
        }
        Ok(())
    }

    /// At a step's end: a window whose weights were kept has started; a
    /// communicating step that succeeded on every rank (`success`) starts
    /// the next one. A failed one does not: every rank keeps its window's
    /// weights and the directions since (`Layer::rollback`), so the next
    /// communicating step brings the ranks together again whatever each
    /// one's weights did in between.
    pub(super) fn end_window(&mut self, communicated: bool, success: bool) {
        if std::mem::take(&mut self.window.kept) {
            self.window.start = false;
        }
        if communicated && success {
            self.window.start = true;
        }
    }

    /// A step's input, refused (on every rank, through the step's
    /// collectives) when `delay > 1` and the caller gave no writable
    /// weights.
    pub(super) fn delay_input<'a>(&self, input: Input<'a>) -> Input<'a> {
        match input {
            Ok(_) if self.cfg.delay > 1 && !self.window.resets_weights => {
                Err(Error::InvalidArgument(NEEDS_WEIGHTS.into()))
            }
            Ok(_) if self.window.diverged.is_some() => Err(Error::InvalidArgument(
                self.window.diverged.clone().unwrap_or_default(),
            )),
            i => i,
        }
    }

    /// A communicating step of `delay > 1` whose result this rank lost (a
    /// `wait` refused on a bad output, or [`GradSync::discard_pending`])
    /// after its weights were written back: its weights are no longer its
    /// peers'. Every later step fails on every rank saying so, until a
    /// restore.
    pub(super) fn mark_diverged(&mut self, step: u64) {
        self.window.diverged = Some(format!(
            "the result of step {step} (a communicating step with delay > 1) was discarded on \
             rank {} (a refused output, or discard_pending) after its weights were written back: its weights now differ from its \
             peers'; restore every rank from a snapshot (load_snapshot)",
            self.rank
        ));
    }
}
