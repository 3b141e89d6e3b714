//! Error feedback (residual accumulation), kept apart from the codecs, and
//! which codecs it converges with.
//!
//! Each step adds the new gradient to the residual, compresses the residual,
//! decodes the message locally and keeps what was not sent:
//! `r ← r + g; m ← C(r); r ← r − D(m)`. This is 3LC's Fig. 3 (steps 1, 2, a,
//! b), RedSync's residual gradients and SBC's residual accumulation in one
//! place, so any lossy codec runs with or without it. The running sum of
//! decoded messages then equals the running sum of gradients minus the current
//! residual, exactly up to float rounding.
//!
//! # When error feedback converges
//!
//! Write `e(x) = x − D(C(x))` for what a codec leaves behind. A codec is
//! **contractive** when `‖e(x)‖² ≤ (1 − δ)‖x‖²` for some `δ > 0`
//! (deterministically, or in expectation for a randomized one). Then, with
//! gradients `‖g_t‖ ≤ G`, the residual stays bounded: from
//! `‖r + g‖² ≤ (1 + ε)‖r‖² + (1 + 1/ε)‖g‖²` with `ε = δ/2`,
//! `E‖r_{t+1}‖² ≤ (1 − δ/2)·E‖r_t‖² + 3G²/δ`, hence
//! `sup_t E‖r_t‖² ≤ 6G²/δ²` (Stich & Karimireddy's argument). The running-sum
//! error `‖r_t‖` then stays bounded while the running sum grows, so its
//! relative error falls.
//!
//! An unbiased codec with variance `E‖e(x)‖² ≤ ω‖x‖²` and `ω ≥ 1` (QSGD at
//! low bit widths on large buckets) is **not** a contraction: fed its own
//! residual, `E‖r_{t+1}‖² ≈ ω·E‖r_t + g_t‖²` grows geometrically (measured:
//! 4-bit QSGD's running-sum error went 2.45 → 1.2e6 in 300 steps). Two
//! remedies are proven bounded:
//!
//! * [`Feedback::Damped`]`(γ)`: encode `γ·(r + g)` instead of `r + g` and keep
//!   `r ← (r + g) − D(C(γ(r + g)))`. For an unbiased `C` the cross term
//!   vanishes: `E‖s − C(γs)‖² = (1 − γ)²‖s‖² + E‖γs − C(γs)‖²
//!   ≤ ((1 − γ)² + γ²ω)‖s‖²`, minimal at `γ = 1/(1 + ω)` where it equals
//!   `ω/(1 + ω)·‖s‖²`: a contraction in expectation with `δ = 1/(1 + ω)`, so
//!   `sup_t E‖r_t‖² ≤ 6(1 + ω)²G²` by the bound above. The price is lag: the
//!   residual first builds up to about `(1 + ω)` gradients.
//! * [`Feedback::None`]: no residual at all (the QSGD paper's own use): every
//!   step's error is independent and unbiased, so the running-sum error grows
//!   like `√t` with the running sum itself (constant relative error `≈ √ω`).
//!
//! | codec | class | feedback |
//! |---|---|---|
//! | `none` | exact | full |
//! | `fp16` | relative error ≤ 2⁻¹¹ (values below the half range flush to 0): contractive | full |
//! | `int8` | max sent exactly, others within half a step: contractive (`δ ≥ 1/n`) | full |
//! | `rgc` | sent values exact: `‖e‖² = ‖x‖² − ‖x_S‖²`; exact top-k gives `δ = k/n` | full |
//! | `rgc-quant`, `sbc` | one mean `μ` over the sent set `S`: `‖e‖² = ‖x‖² − |S|μ²` | full |
//! | `3lc` | `|e_i| ≤ |x_i|`, the maximum strictly smaller (`s < 2`): `δ ≥ (1 − (s−1)²)/n` | full |
//! | `fastsgd` | kept values within `[|x|/b, |x|]`, the maximum always kept: `δ ≥ (2b − 1)/(b²n)` | full |
//! | `fastsgd:paper=true` | non-expansive (`‖e‖ ≤ ‖x‖`) but may send nothing forever | full, starvation flagged |
//! | `qsgd` | unbiased, `ω = min(√B/s, B/(4s²))` (`B` bucket, `s` levels) | full when `ω ≤ 1/2`, else damped `γ = 1/(1+ω)` |
//!
//! A codec says which applies to a tensor of `n` elements through
//! [`Codec::feedback`]; [`ErrorFeedback::step`] and the synchronization
//! engine both follow it, and refuse (with [`Error::InvalidArgument`]) a
//! combination known to diverge, such as `qsgd:ef=full` with `ω ≥ 1`.
//!
//! A codec that is merely non-expansive can still **starve**: send nothing
//! for ever while the residual grows (FastSGD's paper threshold `Σ|x|/b^τ` on
//! dense layers of more than about `b^τ` elements). The engine counts such
//! steps per layer ([`STARVED_STEPS`]) and warns.

use super::Codec;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// After this many consecutive steps in which a layer sent nothing although
/// its residual was not zero, the engine warns that the layer starves (and
/// `gradsync bench --op sparse --check` fails).
pub const STARVED_STEPS: u64 = 20;

/// How error feedback runs with a codec on a tensor (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Feedback {
    /// `r ← r + g; r ← r − D(C(r))`: the codec is contractive.
    Full,
    /// `s = r + g; r ← s − D(C(γ·s))` with `γ ∈ (0, 1]`: for unbiased codecs
    /// that are not contractive, with `γ = 1/(1 + ω)`.
    Damped(f32),
    /// No residual: every step sends `C(g)`.
    None,
}

impl Feedback {
    /// `full`, `damped(γ)` or `none`.
    pub fn label(&self) -> String {
        match self {
            Feedback::Full => "full".into(),
            Feedback::Damped(g) => format!("damped({g:.3})"),
            Feedback::None => "none".into(),
        }
    }
}

/// What a codec configuration asks for (`qsgd:ef=...`); the codec turns it
/// into a [`Feedback`] for a tensor size, refusing what diverges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FeedbackMode {
    /// Full where proven bounded, else damped.
    #[default]
    Auto,
    /// Full error feedback; refused where it diverges.
    Full,
    /// Damped with `γ = 1/(1 + ω)`.
    Damped,
    /// No residual.
    None,
}

impl FeedbackMode {
    /// Whether this is the default (`auto`), for `skip_serializing_if`.
    pub fn is_auto(&self) -> bool {
        *self == FeedbackMode::Auto
    }
}

/// Per-layer residual state for error feedback.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    #[serde(skip)]
    decoded: Vec<f32>,
    #[serde(skip)]
    sum: Vec<f32>,
    #[serde(skip)]
    scaled: Vec<f32>,
}

impl ErrorFeedback {
    /// Zero residual for a layer of `n` elements.
    pub fn new(n: usize) -> Self {
        ErrorFeedback {
            residual: vec![0.0; n],
            decoded: vec![0.0; n],
            sum: vec![0.0; n],
            scaled: Vec::new(),
        }
    }

    /// What has not been sent yet.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Add `grad` to the residual, encode the residual with `codec` into `out`,
    /// and subtract what the receiver will decode, as [`Codec::feedback`]
    /// says for this size (damped: encode `γ·(r + g)`; none: encode `g` and
    /// keep no residual). On any error (NaN/Inf in `grad`, a codec error, a
    /// feedback the codec refuses) the residual is left as it was.
    pub fn step(&mut self, codec: &mut dyn Codec, grad: &[f32], out: &mut Vec<u8>) -> Result<()> {
        if grad.len() != self.residual.len() {
            return Err(Error::InvalidArgument(format!(
                "gradient has {} elements, the residual {}",
                grad.len(),
                self.residual.len()
            )));
        }
        let fb = codec.feedback(grad.len())?;
        // A bad gradient must not poison the residual for every later step.
        super::check_finite(grad)?;
        // Work on scratch so any error leaves the residual as it was.
        self.sum.clear();
        self.sum
            .extend(self.residual.iter().zip(grad).map(|(r, g)| r + g));
        self.decoded.resize(self.residual.len(), 0.0);
        match fb {
            Feedback::Full | Feedback::None => codec.encode(&self.sum, out)?,
            Feedback::Damped(g) => {
                self.scaled.clear();
                self.scaled.extend(self.sum.iter().map(|s| g * s));
                codec.encode(&self.scaled, out)?;
            }
        }
        codec.decode(out, &mut self.decoded)?;
        if fb == Feedback::None {
            self.residual.fill(0.0);
        } else {
            for ((r, s), d) in self.residual.iter_mut().zip(&self.sum).zip(&self.decoded) {
                *r = s - d;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::CodecConfig;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    /// `steps` of uniform(−1, 1) gradients through error feedback: the
    /// residual norm at the end and the largest one seen.
    fn run(codec: &str, n: usize, steps: usize) -> Result<(f64, f64)> {
        let mut c = codec.parse::<CodecConfig>()?.build()?;
        let mut ef = ErrorFeedback::new(n);
        let mut rng = SmallRng::seed_from_u64(5);
        let (mut msg, mut max) = (Vec::new(), 0f64);
        let mut norm = 0.0;
        for _ in 0..steps {
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            ef.step(c.as_mut(), &g, &mut msg)?;
            norm = ef
                .residual()
                .iter()
                .map(|v| f64::from(*v).powi(2))
                .sum::<f64>()
                .sqrt();
            max = max.max(norm);
        }
        Ok((norm, max))
    }

    /// Full feedback with 4-bit QSGD on 1024 elements
    /// (ω = 4.6) blows up; `auto` damps it and stays within the proven
    /// `√6·(1 + ω)·G`, G = ‖g‖ ≈ √(n/3); `none` keeps no residual; `full`
    /// is refused.
    #[test]
    fn qsgd_feedback_is_bounded_or_refused() {
        let n = 1024;
        let g = (n as f64 / 3.0).sqrt();
        let (_, max) = run("qsgd:bits=4", n, 2000).expect("auto");
        assert!(
            max < 6f64.sqrt() * (1.0 + 32.0 / 7.0) * g,
            "damped max {max}"
        );
        let (end, _) = run("qsgd:bits=4,ef=none", n, 50).expect("none");
        assert_eq!(end, 0.0);
        let e = run("qsgd:bits=4,ef=full", n, 1).expect_err("refused");
        assert!(e.to_string().contains("diverges"), "{e}");
        // What full feedback does (r += g; r -= D(C(r)), by hand): the
        // residual grows geometrically.
        let mut c = "qsgd:bits=4"
            .parse::<CodecConfig>()
            .expect("p")
            .build()
            .expect("b");
        let mut r = vec![0f32; n];
        let (mut msg, mut d) = (Vec::new(), vec![0f32; n]);
        let mut rng = SmallRng::seed_from_u64(5);
        for _ in 0..100 {
            for v in r.iter_mut() {
                *v += rng.gen_range(-1.0f32..1.0);
            }
            c.encode(&r, &mut msg).expect("enc");
            c.decode(&msg, &mut d).expect("dec");
            for (v, x) in r.iter_mut().zip(&d) {
                *v -= x;
            }
        }
        let norm = r.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        assert!(norm > 1e3 * g, "undamped full feedback norm {norm}");
    }

    /// Refusals and errors leave the residual untouched.
    #[test]
    fn refused_feedback_leaves_the_residual() {
        let mut c = "qsgd:bits=2,ef=full"
            .parse::<CodecConfig>()
            .expect("p")
            .build()
            .expect("b");
        let mut ef = ErrorFeedback::new(8);
        let mut msg = Vec::new();
        assert!(matches!(
            ef.step(c.as_mut(), &[1.0; 8], &mut msg),
            Err(Error::InvalidArgument(_))
        ));
        assert!(ef.residual().iter().all(|v| *v == 0.0));
    }
}
