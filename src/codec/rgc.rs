//! RedSync residual gradient compression (Fang et al., "RedSync", §5.2–5.3).
//!
//! * `rgc` ([`Rgc`]): send a communication-set of the residual as the
//!   RedSync packed message (§5.3): a length, the indices, the values. The set
//!   is chosen by [`RgcMethod`]: `exact` top-k, `trimmed` top-k (§5.2.1,
//!   Algorithm 2, the default), `threshold` binary search (§5.2.2,
//!   Algorithm 3, with the threshold reused for the next 5 calls) or
//!   `sampled` threshold search (estimate on a 1% strided sample, then the
//!   binary search if the count is off). See [`crate::select`].
//! * `rgc-quant` ([`RgcQuant`]): quantized RGC (§5.2.3, Algorithm 5's
//!   `topk_quant` / `lowk_quant`): calls alternate between the `k` largest
//!   strictly positive values (1st, 3rd, ... call) and the `k` most negative
//!   values (2nd, 4th, ...); every sent position carries one value, the mean
//!   of the selected values, so only indices and one float travel. Selection
//!   is exact: a threshold estimated on a strided sample, one filter pass
//!   and a quickselect among the candidates (`crate::select`'s
//!   `exact_topk_signed`; the exact set whatever the sample says); fewer than `k` entries are sent when the tensor
//!   has fewer than `k` values of the turn's sign (none: `len = 0`,
//!   `mean = 0`), and the turn still flips.
//!
//! `k = max(1, ceil(density · n))` (capped at `n`; 0 for an empty tensor), so
//! every non-empty tensor sends something. `density` must lie in `(0, 1]`.
//! One codec instance per layer: `threshold`/`sampled` reuse a threshold
//! across calls and `rgc-quant` alternates signs, so sharing an instance
//! between tensors mixes their state (a change of length forces a search).
//!
//! ## Wire format (after the common header)
//!
//! `rgc`:
//!
//! | bytes | field |
//! |---|---|
//! | 4 | `len`, u32 LE (entries; `len ≤ n`) |
//! | 4·len | indices, u32 LE, each `< n` (the encoder writes them ascending) |
//! | 4·len | values, f32 LE, finite |
//!
//! `rgc-quant`:
//!
//! | bytes | field |
//! |---|---|
//! | 4 | `len`, u32 LE (`len ≤ n`) |
//! | 4 | `mean`, f32 LE, finite |
//! | 4·len | indices, u32 LE, each `< n` |
//!
//! Decoders check `len ≤ n`, the exact payload length, every index and
//! value **before** writing anything, so `acc` is untouched on error.
//! Indices must be strictly ascending, as every encoder sends them (the
//! selections of [`crate::select`] are sorted): a repeated or out-of-order
//! index is a corrupt message, which would otherwise add one entry twice.
//!
//! ## Error bound
//!
//! No useful per-element bound: an unselected element decodes to 0, so
//! `|x_i − y_i| ≤ |x_i|`. Selected elements decode exactly (`rgc`) or to the
//! set's mean (`rgc-quant`). For `exact`/`trimmed`, every dropped `|x_i|` is
//! at most the k-th largest magnitude; `threshold`/`sampled` after a search
//! send a superset of the top-k. Both codecs are meant to run with
//! [`ErrorFeedback`](super::ErrorFeedback) (RedSync's residuals).
//!
//! Inputs containing NaN or ±∞ are rejected with
//! [`Error::InvalidArgument`] (the decoders would reject such values, and a
//! non-finite residual means training has diverged); the selection functions
//! themselves are NaN-safe.
//!
//! # Error feedback
//!
//! Both are contractive, so full error feedback is bounded (see
//! `feedback.rs`): `rgc` sends exact values, `‖x − C(x)‖² = ‖x‖² − ‖x_S‖²`
//! (`δ = k/n` for exact top-k, at least the sent set's share for the
//! approximate methods); `rgc-quant` sends the mean `μ` of its set,
//! `‖x − C(x)‖² = ‖x‖² − |S|μ²` (zero on a turn whose sign is absent; the
//! next turn takes the other sign).

use super::{check_finite, check_header, write_header, Codec, CodecConfig, CodecId, Reader};
use crate::select::{exact_topk, signed_topk, trimmed_topk_checked, ThresholdSearch};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Communication-set selection method of `rgc`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RgcMethod {
    /// Exact top-k by magnitude (quickselect), exactly `k` entries.
    Exact,
    /// Trimmed top-k (Algorithm 2), exactly `k` entries (same set as exact).
    #[default]
    Trimmed,
    /// Threshold binary search (Algorithm 3) with threshold reuse for the
    /// next 5 calls: `k..=2k` entries after a search, any number on reuse.
    Threshold,
    /// Sampled threshold estimate, binary search when it misses `[k, 2k]`;
    /// reuse as `threshold`.
    Sampled,
}

pub(crate) fn default_density() -> f64 {
    0.001
}

fn check_density(density: f64) -> Result<()> {
    if !(density > 0.0 && density <= 1.0) {
        return Err(Error::InvalidArgument(format!(
            "rgc density {density} must lie in (0, 1]"
        )));
    }
    Ok(())
}

/// `k = max(1, ceil(density · n))`, at most `n` (so 0 for an empty tensor).
pub fn rgc_k(density: f64, n: usize) -> usize {
    ((density * n as f64).ceil() as usize)
        .clamp(1, n.max(1))
        .min(n)
}

fn check_n(n: usize) -> Result<()> {
    if u32::try_from(n).is_err() {
        return Err(Error::InvalidArgument(format!(
            "rgc: {n} elements do not fit u32 indices and length"
        )));
    }
    Ok(())
}

/// Read `len` and check it against `n` and the bytes left (`per` bytes per
/// entry after `fixed` more bytes).
fn read_len(r: &mut Reader<'_>, n: usize, fixed: usize, per: usize) -> Result<usize> {
    let len = r.u32()? as usize;
    if len > n {
        return Err(Error::Decode(format!(
            "{len} entries for a tensor of {n} elements"
        )));
    }
    let want = len
        .checked_mul(per)
        .and_then(|b| b.checked_add(fixed))
        .ok_or_else(|| Error::Decode(format!("length {len} overflows")))?;
    if r.remaining() != want {
        return Err(Error::Decode(format!(
            "payload has {} bytes after the length, expected {want} for {len} entries",
            r.remaining()
        )));
    }
    Ok(len)
}

fn u32s(b: &[u8]) -> impl Iterator<Item = usize> + '_ {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize)
}

/// Indices in range and strictly ascending: the encoders send their
/// selection's indices that way ([`crate::select`]); a repeated or
/// out-of-order index is a corrupt message (it would add one entry twice),
/// an error naming the entry.
fn check_indices(idx: &[u8], n: usize) -> Result<()> {
    let mut prev: Option<usize> = None;
    for (j, i) in u32s(idx).enumerate() {
        if i >= n {
            return Err(Error::Decode(format!(
                "entry {j}: index {i} out of range for {n} elements"
            )));
        }
        if let Some(p) = prev.filter(|&p| p >= i) {
            return Err(Error::Decode(format!(
                "entry {j}: index {i} after {p} (indices must be strictly ascending)"
            )));
        }
        prev = Some(i);
    }
    Ok(())
}

/// RedSync RGC: top-k (by the configured method) indices and values.
#[derive(Clone, Debug)]
pub struct Rgc {
    density: f64,
    method: RgcMethod,
    search: ThresholdSearch,
    idx: Vec<u32>,
    val: Vec<f32>,
}

impl Rgc {
    /// RGC with `density` in `(0, 1]` and the given selection method.
    pub fn new(density: f64, method: RgcMethod) -> Result<Self> {
        check_density(density)?;
        Ok(Rgc {
            density,
            method,
            search: ThresholdSearch::new(),
            idx: Vec::new(),
            val: Vec::new(),
        })
    }
}

/// Read a little-endian state record of `N` bytes.
fn state_bytes<const N: usize>(state: &[u8], what: &str) -> Result<[u8; N]> {
    state.try_into().map_err(|_| {
        Error::Decode(format!(
            "{what} state must be {N} bytes, got {}",
            state.len()
        ))
    })
}

impl Codec for Rgc {
    fn id(&self) -> CodecId {
        CodecId::Rgc
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Rgc {
            density: self.density,
            method: self.method,
        }
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_n(x.len())?;
        if self.method != RgcMethod::Trimmed {
            check_finite(x)?;
        }
        let k = rgc_k(self.density, x.len());
        let (idx, val) = (&mut self.idx, &mut self.val);
        match self.method {
            RgcMethod::Exact => exact_topk(x, k, idx, val)?,
            // Finiteness from the selection's statistics pass.
            RgcMethod::Trimmed => {
                if !trimmed_topk_checked(x, k, idx, val)? {
                    check_finite(x)?;
                }
            }
            RgcMethod::Threshold => {
                self.search.select(x, k, idx, val)?;
            }
            RgcMethod::Sampled => {
                self.search.select_sampled(x, k, idx, val)?;
            }
        }
        write_header(out, CodecId::Rgc, x.len());
        out.reserve(4 + 8 * idx.len());
        out.extend_from_slice(&(idx.len() as u32).to_le_bytes());
        for &i in idx.iter() {
            out.extend_from_slice(&i.to_le_bytes());
        }
        for &v in val.iter() {
            out.extend_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }
    fn set_density(&mut self, density: f64) -> Result<()> {
        check_density(density)?;
        self.density = density;
        Ok(())
    }
    fn state(&self) -> Vec<u8> {
        self.search.export_state().to_vec()
    }
    fn set_state(&mut self, state: &[u8]) -> Result<()> {
        self.search
            .import_state(&state_bytes::<{ ThresholdSearch::STATE_LEN }>(
                state, "rgc",
            )?);
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        self.for_each_sent(bytes, acc.len(), &mut |i, v| acc[i] += v)
            .map(|_| ())
    }
    fn for_each_sent(&self, bytes: &[u8], n: usize, f: &mut dyn FnMut(usize, f32)) -> Result<bool> {
        let mut r = check_header(bytes, CodecId::Rgc, n)?;
        let len = read_len(&mut r, n, 0, 8)?;
        let idx = r.bytes(4 * len)?;
        let val = r.bytes(4 * len)?;
        r.finish()?;
        check_indices(idx, n)?;
        if let Some((j, c)) = val
            .chunks_exact(4)
            .enumerate()
            .find(|(_, c)| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
        {
            return Err(Error::Decode(format!(
                "entry {j}: non-finite value {}",
                f32::from_le_bytes([c[0], c[1], c[2], c[3]])
            )));
        }
        for (i, c) in u32s(idx).zip(val.chunks_exact(4)) {
            f(i, f32::from_le_bytes(c.try_into().expect("4 bytes")));
        }
        Ok(true)
    }
}

/// RedSync quantized RGC: alternately the top-k positive and the bottom-k
/// negative values, all sent as their mean; a turn whose sign has no value
/// sends the other sign's set (the turns still alternate).
#[derive(Clone, Debug)]
pub struct RgcQuant {
    density: f64,
    /// Calls encoded so far; the next is a positive turn when even.
    calls: u64,
    idx: Vec<u32>,
    val: Vec<f32>,
}

impl RgcQuant {
    /// Quantized RGC with `density` in `(0, 1]`; the first call sends the
    /// positive set.
    pub fn new(density: f64) -> Result<Self> {
        check_density(density)?;
        Ok(RgcQuant {
            density,
            calls: 0,
            idx: Vec::new(),
            val: Vec::new(),
        })
    }

    /// Whether the next `encode` sends the positive set (top-k values) rather
    /// than the negative one (bottom-k).
    pub fn next_is_positive(&self) -> bool {
        self.calls % 2 == 0
    }
}

impl Codec for RgcQuant {
    fn id(&self) -> CodecId {
        CodecId::RgcQuant
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::RgcQuant {
            density: self.density,
        }
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_n(x.len())?;
        let k = rgc_k(self.density, x.len());
        // Exact selection; the same pass checks every element is finite.
        let positive = self.next_is_positive();
        let select = |positive: bool, idx: &mut Vec<u32>, val: &mut Vec<f32>| {
            let side = Some((idx, val));
            if positive {
                signed_topk(x, k, side, None)
            } else {
                signed_topk(x, k, None, side)
            }
        };
        let mut finite = select(positive, &mut self.idx, &mut self.val)?;
        if finite && self.idx.is_empty() {
            // No value of this turn's sign (a residual all of one sign):
            // the other sign's set, or every other step would send nothing
            // while the residual grows (and no single step looks starved).
            finite = select(!positive, &mut self.idx, &mut self.val)?;
        }
        if !finite {
            check_finite(x)?;
        }
        // Wrapping: a restored counter may sit at u64::MAX (odd), and 0
        // (even) still alternates the sign.
        self.calls = self.calls.wrapping_add(1);
        let mean = if self.val.is_empty() {
            0.0
        } else {
            (self.val.iter().map(|&v| f64::from(v)).sum::<f64>() / self.val.len() as f64) as f32
        };
        write_header(out, CodecId::RgcQuant, x.len());
        out.reserve(8 + 4 * self.idx.len());
        out.extend_from_slice(&(self.idx.len() as u32).to_le_bytes());
        out.extend_from_slice(&mean.to_le_bytes());
        for &i in &self.idx {
            out.extend_from_slice(&i.to_le_bytes());
        }
        Ok(())
    }
    fn set_density(&mut self, density: f64) -> Result<()> {
        check_density(density)?;
        self.density = density;
        Ok(())
    }
    fn state(&self) -> Vec<u8> {
        self.calls.to_le_bytes().to_vec()
    }
    fn set_state(&mut self, state: &[u8]) -> Result<()> {
        self.calls = u64::from_le_bytes(state_bytes::<8>(state, "rgc-quant")?);
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        self.for_each_sent(bytes, acc.len(), &mut |i, v| acc[i] += v)
            .map(|_| ())
    }
    fn for_each_sent(&self, bytes: &[u8], n: usize, f: &mut dyn FnMut(usize, f32)) -> Result<bool> {
        let mut r = check_header(bytes, CodecId::RgcQuant, n)?;
        let len = read_len(&mut r, n, 4, 4)?;
        let mean = r.finite_f32()?;
        let idx = r.bytes(4 * len)?;
        r.finish()?;
        check_indices(idx, n)?;
        for i in u32s(idx) {
            f(i, mean);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
