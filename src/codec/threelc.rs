//! 3LC: 3-value quantization with sparsity multiplication, quartic encoding
//! and zero-run encoding (Lim, Andersen, Kaminsky, "3LC: Lightweight and
//! Effective Traffic Compression for Distributed Machine Learning", §3.1–3.3,
//! Fig. 3). Error accumulation (Fig. 3 steps 1, a, b) is not part of the
//! codec: wrap it in [`ErrorFeedback`](super::ErrorFeedback).
//!
//! # Definition
//!
//! * **3-value quantization (§3.1, eqs. 1–3).** `M = max|x| · s` with the
//!   sparsity multiplier `1 ≤ s < 2`, `q_i = round(x_i / M) ∈ {-1, 0, 1}`, and
//!   the decoded value is `q_i · M`. The rounding is evaluated exactly, without
//!   a division: `q_i = sign(x_i)` iff `2|x_i| > M`, else `0`. Ties
//!   (`|x_i| = M/2` exactly) therefore round to 0, as TensorFlow's and
//!   NumPy's round-half-to-even `round()` does in the paper's prototype. An
//!   all-zero tensor gives `M = 0` and all-zero trits (no NaN). If `max|x| · s`
//!   overflows, `M` saturates to `f32::MAX` (the bound below still holds).
//! * **Quartic encoding (§3.2).** Trits are shifted to digits `p = q + 1 ∈
//!   {0, 1, 2}`; the flat array is padded to `5L` digits with `L = ⌈n/5⌉`
//!   and divided, as in the paper, into five *contiguous partitions*
//!   `p_0 … p_4` of `L` digits each (`p_k[j]` is element `k·L + j`). Byte `j`
//!   is `p_0[j]·81 + p_1[j]·27 + p_2[j]·9 + p_3[j]·3 + p_4[j] ∈ 0..=242`. The
//!   paper pads "with zeros" after adding 1, which would be the trit −1; we pad
//!   with the trit 0 (digit 1) instead so that padding never breaks a zero run,
//!   and the decoder rejects padding digits other than 1. Five zero trits
//!   encode to byte 121.
//! * **Zero-run encoding (§3.3).** A run of `k = 2..=14` consecutive bytes 121
//!   becomes the single byte `243 + (k − 2)` (so 14 → 255); longer runs are
//!   split greedily into 14s and a remainder (a remainder of 1 stays 121).
//!   The decoder accepts any split of a run (e.g. `243 243` for a run of 4),
//!   since every split expands to the same quartic bytes.
//!
//! # Wire format
//!
//! After the common 12-byte header (codec id 5, element count `n`):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | `M`, f32 little endian (finite, ≥ 0) |
//! | 1 | stage: 0 = `quant`, 1 = `quartic`, 2 = `full` |
//! | rest | payload, by stage (below) |
//!
//! | stage | payload | size |
//! |---|---|---|
//! | `quant` | one trit per element as `i8` ∈ {−1, 0, 1} | `n` bytes (8 bits/value) |
//! | `quartic` | quartic bytes, each ≤ 242 | exactly `⌈n/5⌉` bytes (1.6 bits/value) |
//! | `full` | zero-run-encoded quartic bytes | expands to exactly `⌈n/5⌉` bytes |
//!
//! The decoder reads the stage from the message, so any `3lc` decoder decodes
//! every stage. The stages exist so that reports can show what each step buys.
//! An all-zero tensor of `n` elements (`n` a multiple of 70) costs
//! `17 + n/70` bytes with `full`, i.e. → 280× for large `n`.
//!
//! # Error bound
//!
//! `|x_i − decode(encode(x))_i| ≤ M/2 = max|x| · s / 2` for every element
//! (§3.1 "Convergence"). Inputs with NaN or ±Inf are rejected with
//! [`Error::InvalidArgument`].
//!
//! # Performance
//!
//! Encoding is two streaming passes over the input (max |x| and the finite
//! check fused into one integer max over the bit patterns, then quantize +
//! quartic straight into the output buffer, five partition streams at a
//! time), then zero-run encoding in place over the 5× smaller byte stream.
//! Decoding validates the whole payload first (nothing is written into the
//! accumulator on error), then adds via a 256-entry table of five trits;
//! zero bytes and zero runs are skipped.
//!
//! # Error feedback
//!
//! Contractive, so full error feedback is bounded (see `feedback.rs`): an
//! element is sent as `±M` only when `2|x_i| > M`, where its error
//! `M − |x_i| < |x_i|`; dropped ones lose `|x_i|`; so `|e_i| ≤ |x_i|`, and the
//! maximum's error is `(s − 1)·max < max` (`s < 2`):
//! `‖e‖² ≤ (1 − (1 − (s−1)²)/n)‖x‖²`. With `s` near 2 the guarantee (and
//! what is sent) becomes small.

use super::{check_header, write_header, Codec, CodecConfig, CodecId};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Quartic byte of five zero trits.
pub const ZERO_GROUP: u8 = 121;
/// Largest quartic byte (`3^5 − 1`).
pub const MAX_QUARTIC: u8 = 242;
/// First zero-run byte (a run of 2).
const RUN_BASE: u8 = 243;
/// Longest run one byte encodes.
pub const MAX_RUN: usize = 14;

/// Which 3LC stages run (see the module docs for each wire format).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ThreeLcStage {
    /// 3-value quantization only, one `i8` trit per element.
    Quant,
    /// Quantization + quartic encoding (1.6 bits per element).
    Quartic,
    /// Quantization + quartic + zero-run encoding (the full 3LC).
    #[default]
    Full,
}

impl ThreeLcStage {
    fn to_u8(self) -> u8 {
        match self {
            Self::Quant => 0,
            Self::Quartic => 1,
            Self::Full => 2,
        }
    }
    fn from_u8(b: u8) -> Result<Self> {
        Ok(match b {
            0 => Self::Quant,
            1 => Self::Quartic,
            2 => Self::Full,
            _ => return Err(Error::Decode(format!("unknown 3LC stage {b}"))),
        })
    }
}

/// Default sparsity multiplier (the paper's default, which preserves max |x|).
pub(crate) fn default_s() -> f32 {
    1.0
}

/// The 3LC codec.
#[derive(Clone, Copy, Debug)]
pub struct ThreeLc {
    s: f32,
    stage: ThreeLcStage,
}

impl ThreeLc {
    /// A 3LC codec with sparsity multiplier `s` (must satisfy `1 ≤ s < 2`).
    pub fn new(s: f32, stage: ThreeLcStage) -> Result<Self> {
        if !(1.0..2.0).contains(&s) {
            return Err(Error::InvalidArgument(format!(
                "3LC sparsity multiplier s = {s} is outside [1, 2)"
            )));
        }
        Ok(ThreeLc { s, stage })
    }

    /// The scale `M = max|x| · s` this codec uses for `x` (saturated to
    /// `f32::MAX`); errors on NaN/Inf.
    pub fn scale(&self, x: &[f32]) -> Result<f32> {
        Ok(scale_of(max_abs_finite(x)?, self.s))
    }
}

fn scale_of(max: f32, s: f32) -> f32 {
    (max * s).min(f32::MAX)
}

/// max |x| in one pass, as an integer max over the bit patterns with the sign
/// cleared (monotone for non-negative floats; NaN and Inf sort above every
/// finite value, so they are detected by the same max).
fn max_abs_finite(x: &[f32]) -> Result<f32> {
    const LANES: usize = 16;
    let bits: &[u32] = bytemuck::cast_slice(x);
    let mut acc = [0u32; LANES];
    let chunks = bits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            acc[k] = acc[k].max(c[k] & 0x7fff_ffff);
        }
    }
    let mut m = acc.iter().copied().max().unwrap_or(0);
    for &b in tail {
        m = m.max(b & 0x7fff_ffff);
    }
    if m >= 0x7f80_0000 {
        // Report the first offender like `check_finite` does.
        return super::check_finite(x).map(|_| 0.0);
    }
    Ok(f32::from_bits(m))
}

/// Digit `q + 1` of `v` for scale `m` (exact: `2v` is exact or overflows to
/// ±inf, which compares correctly against the finite `m`).
#[inline(always)]
fn digit(v: f32, m: f32) -> u8 {
    let d = v + v;
    1 + (d > m) as u8 - (d < -m) as u8
}

/// Five digits of each quartic byte, most significant (partition 0) first.
const DIGITS: [[u8; 5]; 243] = {
    let mut t = [[0u8; 5]; 243];
    let mut b = 0;
    while b < 243 {
        let mut v = b;
        let mut k = 5;
        while k > 0 {
            k -= 1;
            t[b][k] = (v % 3) as u8;
            v /= 3;
        }
        b += 1;
    }
    t
};

/// Trits (`digit − 1`) of each byte as f32; zero for bytes ≥ 243.
const TRITS: [[f32; 5]; 256] = {
    let mut t = [[0f32; 5]; 256];
    let mut b = 0;
    while b < 243 {
        let mut k = 0;
        while k < 5 {
            t[b][k] = DIGITS[b][k] as f32 - 1.0;
            k += 1;
        }
        b += 1;
    }
    t
};

/// Layout of the five partitions for `n` elements.
#[derive(Clone, Copy, Debug)]
struct Layout {
    n: usize,
    /// Partition length `⌈n/5⌉` (= quartic bytes).
    l: usize,
    /// Bytes `j < full` have all five partition elements inside `0..n`.
    full: usize,
}

impl Layout {
    fn new(n: usize) -> Self {
        let l = n.div_ceil(5);
        Layout {
            n,
            l,
            full: n.saturating_sub(4 * l).min(l),
        }
    }
    /// Element index of partition `k`, byte `j`, if it is not padding.
    #[inline]
    fn index(&self, k: usize, j: usize) -> Option<usize> {
        let i = k * self.l + j;
        (i < self.n).then_some(i)
    }
}

/// Quantize + quartic-encode `x` with scale `m` into `dst` (`⌈n/5⌉` bytes).
fn quartic_encode(x: &[f32], m: f32, dst: &mut [u8]) {
    let lay = Layout::new(x.len());
    debug_assert_eq!(dst.len(), lay.l);
    let f = lay.full;
    if f > 0 {
        let l = lay.l;
        let (p0, p1, p2, p3, p4) = (
            &x[..f],
            &x[l..l + f],
            &x[2 * l..2 * l + f],
            &x[3 * l..3 * l + f],
            &x[4 * l..4 * l + f],
        );
        let d = &mut dst[..f];
        for j in 0..f {
            d[j] = digit(p0[j], m) * 81
                + digit(p1[j], m) * 27
                + digit(p2[j], m) * 9
                + digit(p3[j], m) * 3
                + digit(p4[j], m);
        }
    }
    for (j, b) in dst.iter_mut().enumerate().skip(f) {
        let mut v = 0u8;
        for k in 0..5 {
            let dg = lay.index(k, j).map_or(1, |i| digit(x[i], m));
            v = v * 3 + dg;
        }
        *b = v;
    }
}

/// Zero-run encode `buf` in place; returns the new length. The write cursor
/// never passes the read cursor, so no scratch buffer is needed.
fn zre_in_place(buf: &mut [u8]) -> usize {
    let len = buf.len();
    let (mut r, mut w) = (0, 0);
    while r < len {
        let b = buf[r];
        if b != ZERO_GROUP {
            buf[w] = b;
            w += 1;
            r += 1;
            continue;
        }
        let mut k = 1;
        while k < MAX_RUN && r + k < len && buf[r + k] == ZERO_GROUP {
            k += 1;
        }
        buf[w] = if k == 1 {
            ZERO_GROUP
        } else {
            RUN_BASE + (k - 2) as u8
        };
        w += 1;
        r += k;
    }
    w
}

/// Zero-run decode (test helper; the decoder streams instead): the quartic
/// bytes of `zre`, or an error if they would exceed `max` bytes.
#[cfg(test)]
fn zre_decode(zre: &[u8], max: usize) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(zre.len().min(max));
    for &b in zre {
        let k = run_len(b);
        if out.len() + k > max {
            return Err(Error::Decode(format!(
                "zero runs expand past {max} quartic bytes"
            )));
        }
        if k == 1 {
            out.push(b);
        } else {
            out.resize(out.len() + k, ZERO_GROUP);
        }
    }
    Ok(out)
}

/// Quartic bytes a ZRE byte stands for.
#[inline(always)]
fn run_len(b: u8) -> usize {
    if b >= RUN_BASE {
        (b - RUN_BASE) as usize + 2
    } else {
        1
    }
}

/// Padding digits of byte `b` at position `j` must be 1 (trit 0).
#[inline]
fn check_padding(lay: &Layout, j: usize, b: u8) -> Result<()> {
    if j < lay.full {
        return Ok(());
    }
    let d = &DIGITS[b as usize];
    for (k, &dk) in d.iter().enumerate() {
        if lay.index(k, j).is_none() && dk != 1 {
            return Err(Error::Decode(format!(
                "quartic byte {j} has a non-zero padding trit"
            )));
        }
    }
    Ok(())
}

/// The accumulator split into the five partitions (the last may be short).
struct Parts<'a> {
    p: [&'a mut [f32]; 5],
}

impl<'a> Parts<'a> {
    fn new(acc: &'a mut [f32], l: usize) -> Self {
        let (a0, r) = acc.split_at_mut(l.min(acc.len()));
        let (a1, r) = r.split_at_mut(l.min(r.len()));
        let (a2, r) = r.split_at_mut(l.min(r.len()));
        let (a3, a4) = r.split_at_mut(l.min(r.len()));
        Parts {
            p: [a0, a1, a2, a3, a4],
        }
    }
    /// Add byte `b` (≤ 242) at position `j`, scaled by `m`.
    #[inline(always)]
    fn add(&mut self, j: usize, b: u8, m: f32, full: usize) {
        if b == ZERO_GROUP {
            return;
        }
        let t = &TRITS[b as usize];
        if j < full {
            for (p, &tk) in self.p.iter_mut().zip(t) {
                p[j] += tk * m;
            }
        } else {
            for (p, &tk) in self.p.iter_mut().zip(t) {
                if let Some(a) = p.get_mut(j) {
                    *a += tk * m;
                }
            }
        }
    }
}

impl Codec for ThreeLc {
    fn id(&self) -> CodecId {
        CodecId::ThreeLc
    }

    fn config(&self) -> CodecConfig {
        CodecConfig::ThreeLc {
            s: self.s,
            stage: self.stage,
        }
    }

    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        let m = self.scale(x)?;
        write_header(out, CodecId::ThreeLc, x.len());
        out.extend_from_slice(&m.to_le_bytes());
        out.push(self.stage.to_u8());
        let start = out.len();
        match self.stage {
            ThreeLcStage::Quant => {
                out.extend(x.iter().map(|&v| digit(v, m).wrapping_sub(1)));
            }
            ThreeLcStage::Quartic | ThreeLcStage::Full => {
                let l = x.len().div_ceil(5);
                out.resize(start + l, 0);
                quartic_encode(x, m, &mut out[start..]);
                if self.stage == ThreeLcStage::Full {
                    let w = zre_in_place(&mut out[start..]);
                    out.truncate(start + w);
                }
            }
        }
        Ok(())
    }

    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::ThreeLc, acc.len())?;
        let m = r.finite_f32()?;
        if m < 0.0 {
            return Err(Error::Decode(format!("negative 3LC scale {m}")));
        }
        let stage = ThreeLcStage::from_u8(r.u8()?)?;
        let p = r.rest();
        let n = acc.len();
        let lay = Layout::new(n);
        match stage {
            ThreeLcStage::Quant => {
                if p.len() != n {
                    return Err(Error::Decode(format!(
                        "3LC quant payload has {} bytes, expected {n}",
                        p.len()
                    )));
                }
                if let Some(i) = p.iter().position(|&b| !matches!(b, 0 | 1 | 0xff)) {
                    return Err(Error::Decode(format!(
                        "3LC trit {i} is {} (not -1, 0 or 1)",
                        p[i] as i8
                    )));
                }
                for (a, &b) in acc.iter_mut().zip(p) {
                    *a += (b as i8) as f32 * m;
                }
            }
            ThreeLcStage::Quartic => {
                if p.len() != lay.l {
                    return Err(Error::Decode(format!(
                        "3LC quartic payload has {} bytes, expected {}",
                        p.len(),
                        lay.l
                    )));
                }
                if let Some(j) = p.iter().position(|&b| b > MAX_QUARTIC) {
                    return Err(Error::Decode(format!(
                        "quartic byte {j} is {} (> {MAX_QUARTIC})",
                        p[j]
                    )));
                }
                for (j, &b) in p.iter().enumerate().skip(lay.full) {
                    check_padding(&lay, j, b)?;
                }
                let mut parts = Parts::new(acc, lay.l);
                for (j, &b) in p.iter().enumerate() {
                    parts.add(j, b, m, lay.full);
                }
            }
            ThreeLcStage::Full => {
                // Pass 1: the runs must expand to exactly L bytes (checked
                // before each step, so never more), padding must be zero.
                if p.len() > lay.l {
                    return Err(Error::Decode(format!(
                        "3LC payload of {} bytes is longer than {} quartic bytes",
                        p.len(),
                        lay.l
                    )));
                }
                let mut j = 0usize;
                for &b in p {
                    let k = run_len(b);
                    if k > lay.l - j {
                        return Err(Error::Decode(format!(
                            "zero runs expand past {} quartic bytes",
                            lay.l
                        )));
                    }
                    if k == 1 {
                        check_padding(&lay, j, b)?;
                    }
                    j += k;
                }
                if j != lay.l {
                    return Err(Error::Decode(format!(
                        "3LC payload expands to {j} quartic bytes, expected {}",
                        lay.l
                    )));
                }
                // Pass 2: add; zero runs add nothing.
                let mut parts = Parts::new(acc, lay.l);
                let mut j = 0usize;
                for &b in p {
                    let k = run_len(b);
                    if k == 1 {
                        parts.add(j, b, m, lay.full);
                    }
                    j += k;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
