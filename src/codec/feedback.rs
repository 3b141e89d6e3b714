//! Error feedback (residual accumulation), kept apart from the codecs.
//!
//! Each step adds the new gradient to the residual, compresses the residual,
//! decodes the message locally and keeps what was not sent:
//! `r ← r + g; m ← C(r); r ← r − D(m)`. This is 3LC's Fig. 3 (steps 1, 2, a,
//! b), RedSync's residual gradients and SBC's residual accumulation in one
//! place, so any lossy codec runs with or without it. The running sum of
//! decoded messages then equals the running sum of gradients minus the current
//! residual, exactly up to float rounding.

use super::Codec;
use crate::{Error, Result};

/// Per-layer residual state for error feedback.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    #[serde(skip)]
    decoded: Vec<f32>,
    #[serde(skip)]
    sum: Vec<f32>,
}

impl ErrorFeedback {
    /// Zero residual for a layer of `n` elements.
    pub fn new(n: usize) -> Self {
        ErrorFeedback {
            residual: vec![0.0; n],
            decoded: vec![0.0; n],
            sum: vec![0.0; n],
        }
    }

    /// What has not been sent yet.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Add `grad` to the residual, encode the residual with `codec` into `out`,
    /// and subtract what the receiver will decode. On any error (NaN/Inf in
    /// `grad`, a codec error) the residual is left as it was.
    pub fn step(&mut self, codec: &mut dyn Codec, grad: &[f32], out: &mut Vec<u8>) -> Result<()> {
        if grad.len() != self.residual.len() {
            return Err(Error::InvalidArgument(format!(
                "gradient has {} elements, the residual {}",
                grad.len(),
                self.residual.len()
            )));
        }
        // A bad gradient must not poison the residual for every later step.
        super::check_finite(grad)?;
        // Work on scratch so any error leaves the residual as it was.
        self.sum.clear();
        self.sum
            .extend(self.residual.iter().zip(grad).map(|(r, g)| r + g));
        self.decoded.resize(self.residual.len(), 0.0);
        codec.encode(&self.sum, out)?;
        codec.decode(out, &mut self.decoded)?;
        for ((r, s), d) in self.residual.iter_mut().zip(&self.sum).zip(&self.decoded) {
            *r = s - d;
        }
        Ok(())
    }
}
