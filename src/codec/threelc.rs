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
mod tests {
    #![allow(clippy::needless_range_loop)]
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    fn enc(c: &mut ThreeLc, x: &[f32]) -> Vec<u8> {
        let mut m = Vec::new();
        c.encode(x, &mut m).expect("test");
        m
    }

    fn payload(msg: &[u8]) -> &[u8] {
        &msg[super::super::HEADER_LEN + 5..]
    }

    fn full() -> ThreeLc {
        ThreeLc::new(1.0, ThreeLcStage::Full).expect("test")
    }

    fn quartic() -> ThreeLc {
        ThreeLc::new(1.0, ThreeLcStage::Quartic).expect("test")
    }

    #[test]
    fn five_zeros_encode_to_121() {
        let m = enc(&mut quartic(), &[0.0; 5]);
        assert_eq!(payload(&m), &[121]);
        let m = enc(&mut full(), &[0.0; 5]);
        assert_eq!(payload(&m), &[121]);
        // Scale is zero, no NaN anywhere.
        let mut out = [9.0f32; 5];
        full().decode(&m, &mut out).expect("test");
        assert_eq!(out, [0.0; 5]);
    }

    #[test]
    fn quartic_digits_follow_the_paper() {
        // n = 5: each partition holds one element, byte = Σ p_k·3^(4−k).
        let x = [1.0, -1.0, 0.0, 1.0, -1.0];
        let m = enc(&mut quartic(), &x);
        assert_eq!(payload(&m), &[2 * 81 + 9 + 2 * 3]);
        // n = 10: partitions are contiguous, p_0 = x[0..2], p_1 = x[2..4], ...
        let mut x = [0.0f32; 10];
        x[1] = 1.0; // p_0[1]
        x[8] = -1.0; // p_4[0]
        let m = enc(&mut quartic(), &x);
        assert_eq!(payload(&m), &[121 - 1, 121 + 81]);
    }

    #[test]
    fn fourteen_zero_groups_are_one_byte_255() {
        let m = enc(&mut full(), &[0.0; 70]);
        assert_eq!(payload(&m), &[255]);
        let m = enc(&mut full(), &[0.0; 75]);
        assert_eq!(payload(&m), &[255, 121]);
        let m = enc(&mut full(), &[0.0; 10]);
        assert_eq!(payload(&m), &[243]);
        let m = enc(&mut full(), &[0.0; 80]);
        assert_eq!(payload(&m), &[255, 243]);
        for n in [70, 75, 80] {
            let msg = enc(&mut full(), &vec![0.0; n]);
            let mut out = vec![1.0; n];
            full().decode(&msg, &mut out).expect("test");
            assert!(out.iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn zre_splits_runs_and_keeps_single_121() {
        let mut b = vec![1, 121, 2, 121, 121, 3];
        let w = zre_in_place(&mut b);
        assert_eq!(&b[..w], &[1, 121, 2, 243, 3]);
        let mut b = vec![121; 29];
        let w = zre_in_place(&mut b);
        assert_eq!(&b[..w], &[255, 255, 121]);
        let mut b = vec![121; 30];
        let w = zre_in_place(&mut b);
        assert_eq!(&b[..w], &[255, 255, 243]);
        assert_eq!(
            zre_decode(&[255, 255, 243], 30).expect("test"),
            vec![121; 30]
        );
        assert!(zre_decode(&[255, 255, 243], 29).is_err());
    }

    #[test]
    fn all_zero_million_compresses_over_270x() {
        let n = 1_000_000;
        let x = vec![0.0f32; n];
        let m = enc(&mut full(), &x);
        let ratio = (4 * n) as f64 / m.len() as f64;
        // 200000 quartic bytes → ⌈200000/14⌉ = 14286 bytes + 17 header bytes.
        assert_eq!(m.len(), 17 + 14286);
        assert!(ratio >= 270.0, "ratio {ratio}");
    }

    #[test]
    fn quartic_stage_is_1_6_bits_per_value() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        for n in [5usize, 100, 12345 * 5] {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let m = enc(&mut quartic(), &x);
            assert_eq!(payload(&m).len(), n / 5);
            assert_eq!(payload(&m).len() as f64 * 8.0 / n as f64, 1.6);
            assert!(payload(&m).iter().all(|&b| b <= MAX_QUARTIC));
        }
        // Quant stage: one byte per value.
        let mut q = ThreeLc::new(1.0, ThreeLcStage::Quant).expect("test");
        let m = enc(&mut q, &[0.5, -0.2, 0.1, -1.0]);
        assert_eq!(payload(&m), &[0, 0, 0, 0xff]);
        assert_eq!(f32::from_le_bytes(m[12..16].try_into().expect("test")), 1.0);
        assert_eq!(m[16], 0);
    }

    #[test]
    fn larger_s_is_sparser() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let x: Vec<f32> = (0..100_000)
            .map(|_| {
                let g: f32 = rng.gen_range(-1.0f32..1.0);
                g * g * g
            })
            .collect();
        let zeros = |s: f32| {
            let mut c = ThreeLc::new(s, ThreeLcStage::Quant).expect("test");
            let m = enc(&mut c, &x);
            payload(&m).iter().filter(|&&b| b == 0).count()
        };
        let size = |s: f32| enc(&mut ThreeLc::new(s, ThreeLcStage::Full).expect("test"), &x).len();
        let (z1, z19) = (zeros(1.0), zeros(1.9));
        assert!(z19 > z1, "{z1} {z19}");
        assert!(size(1.9) < size(1.0));
    }

    #[test]
    fn ties_and_extremes() {
        // |x| = M/2 exactly rounds to 0 (half to even); just above rounds to 1.
        let mut c = ThreeLc::new(1.0, ThreeLcStage::Quant).expect("test");
        let m = enc(&mut c, &[2.0, 1.0, -1.0, 1.0000001, 0.0]);
        assert_eq!(payload(&m), &[1, 0, 0, 1, 0]);
        // Overflowing max·s saturates M to f32::MAX, still within M/2.
        let mut c = ThreeLc::new(1.9, ThreeLcStage::Full).expect("test");
        let x = [f32::MAX, -f32::MAX * 0.6, 1.0];
        let m = enc(&mut c, &x);
        let mut y = [0.0; 3];
        c.decode(&m, &mut y).expect("test");
        assert_eq!(y, [f32::MAX, -f32::MAX, 0.0]);
        // Subnormals.
        let x = [f32::from_bits(1), -f32::from_bits(3), 0.0];
        let mut c = full();
        let m = enc(&mut c, &x);
        let mut y = [0.0; 3];
        c.decode(&m, &mut y).expect("test");
        for i in 0..3 {
            assert!((x[i] as f64 - y[i] as f64).abs() <= 3.0 * f32::from_bits(1) as f64 / 2.0);
        }
    }

    #[test]
    fn invalid_s_and_nan_are_rejected() {
        for s in [0.0, 0.99, 2.0, 2.5, f32::NAN, f32::INFINITY, -1.0] {
            let cfg = CodecConfig::ThreeLc {
                s,
                stage: ThreeLcStage::Full,
            };
            assert!(matches!(cfg.build(), Err(Error::InvalidArgument(_))), "{s}");
        }
        assert!("3lc:s=2"
            .parse::<CodecConfig>()
            .expect("test")
            .build()
            .is_err());
        let mut c = full();
        let mut m = Vec::new();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(matches!(
                c.encode(&[1.0, bad], &mut m),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn config_strings() {
        let c: CodecConfig = "3lc".parse().expect("test");
        assert_eq!(
            c,
            CodecConfig::ThreeLc {
                s: 1.0,
                stage: ThreeLcStage::Full
            }
        );
        assert_eq!(c.name(), "3lc");
        let c: CodecConfig = "3lc:s=1.75,stage=quartic".parse().expect("test");
        assert_eq!(
            c,
            CodecConfig::ThreeLc {
                s: 1.75,
                stage: ThreeLcStage::Quartic
            }
        );
        assert_eq!(c.build().expect("test").config(), c);
        let json = serde_json::to_string(&c).expect("test");
        assert_eq!(serde_json::from_str::<CodecConfig>(&json).expect("test"), c);
        assert!("3lc:stage=bogus".parse::<CodecConfig>().is_err());
        assert!("3lc:k=1".parse::<CodecConfig>().is_err());
    }

    #[test]
    fn decoder_rejects_non_canonical_messages() {
        let x: Vec<f32> = (0..12).map(|i| i as f32 - 6.0).collect();
        let good = enc(&mut quartic(), &x);
        let mut out = vec![0.0; 12];
        quartic().decode(&good, &mut out).expect("test");
        // Byte > 242 in the quartic stage.
        let mut bad = good.clone();
        bad[17] = 243;
        assert!(quartic().decode(&bad, &mut out).is_err());
        // Non-zero padding trit: n = 12, L = 3, byte 2 holds elements 2, 5, 8, 11
        // and one padding digit (the last).
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] = (bad[last] / 3) * 3 + 2;
        assert!(quartic().decode(&bad, &mut out).is_err());
        // Unknown stage, negative scale, trailing bytes.
        let mut bad = good.clone();
        bad[16] = 3;
        assert!(quartic().decode(&bad, &mut out).is_err());
        let mut bad = good.clone();
        bad[12..16].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(quartic().decode(&bad, &mut out).is_err());
        let mut bad = good.clone();
        bad.push(121);
        assert!(quartic().decode(&bad, &mut out).is_err());
        // Full stage: runs that overshoot, or fall short.
        let z = enc(&mut full(), &[0.0; 70]);
        let mut out = vec![0.0; 65];
        let mut m65 = Vec::new();
        write_header(&mut m65, CodecId::ThreeLc, 65);
        m65.extend_from_slice(&z[12..]);
        assert!(full().decode(&m65, &mut out).is_err());
        let mut out = vec![0.0; 75];
        let mut m75 = Vec::new();
        write_header(&mut m75, CodecId::ThreeLc, 75);
        m75.extend_from_slice(&z[12..]);
        assert!(full().decode(&m75, &mut out).is_err());
        // Quant stage: trit 2.
        let mut q = ThreeLc::new(1.0, ThreeLcStage::Quant).expect("test");
        let mut bad = enc(&mut q, &[1.0, 0.0]);
        bad[17] = 2;
        assert!(q.decode(&bad, &mut [0.0; 2]).is_err());
    }

    #[test]
    fn all_stages_decode_to_the_same_values() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        for n in [0usize, 1, 2, 3, 4, 5, 6, 9, 11, 16, 21, 69, 70, 71, 1001] {
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    if rng.gen_bool(0.7) {
                        0.0
                    } else {
                        rng.gen_range(-3.0..3.0)
                    }
                })
                .collect();
            let mut ys = Vec::new();
            for stage in [
                ThreeLcStage::Quant,
                ThreeLcStage::Quartic,
                ThreeLcStage::Full,
            ] {
                let mut c = ThreeLc::new(1.3, stage).expect("test");
                let m = enc(&mut c, &x);
                let mut y = vec![0.0; n];
                // Any 3LC decoder reads any stage.
                full().decode(&m, &mut y).expect("test");
                ys.push(y);
            }
            assert_eq!(ys[0], ys[1], "n={n}");
            assert_eq!(ys[1], ys[2], "n={n}");
        }
    }

    /// Throughput smoke check (release builds only; timing on shared CI is
    /// noisy, so this only prints). Run with `--nocapture` to see it.
    #[test]
    fn encode_throughput_report() {
        let n = 1 << 22;
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let x: Vec<f32> = (0..n)
            .map(|_| rng.gen_range(-1.0f32..1.0).powi(3))
            .collect();
        let mut c = full();
        let mut m = Vec::with_capacity(n);
        c.encode(&x, &mut m).expect("test");
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            c.encode(&x, &mut m).expect("test");
        }
        let enc_s = t.elapsed().as_secs_f64() / reps as f64;
        let mut acc = vec![0.0f32; n];
        let t = std::time::Instant::now();
        for _ in 0..reps {
            c.decode_add(&m, &mut acc).expect("test");
        }
        let dec_s = t.elapsed().as_secs_f64() / reps as f64;
        eprintln!(
            "3lc full: encode {:.2} GB/s, decode_add {:.2} GB/s of f32 ({} -> {} bytes)",
            (4 * n) as f64 / enc_s / 1e9,
            (4 * n) as f64 / dec_s / 1e9,
            4 * n,
            m.len()
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        #[test]
        fn prop_error_within_half_m(x in proptest::collection::vec(
                prop_oneof![Just(0.0f32), -1e6f32..1e6, -1e-30f32..1e-30], 0..600),
                s in 1.0f32..1.9999, st in 0u8..3) {
            let stage = ThreeLcStage::from_u8(st).expect("test");
            let mut c = ThreeLc::new(s, stage).expect("test");
            let msg = enc(&mut c, &x);
            let m = c.scale(&x).expect("test");
            let mut y = vec![0.0; x.len()];
            c.decode(&msg, &mut y).expect("test");
            let mut acc = vec![0.0; x.len()];
            c.decode_add(&msg, &mut acc).expect("test");
            prop_assert_eq!(&acc, &y);
            for i in 0..x.len() {
                let e = (x[i] as f64 - y[i] as f64).abs();
                prop_assert!(e <= m as f64 / 2.0, "i={} x={} y={} M={}", i, x[i], y[i], m);
                prop_assert!(y[i] == 0.0 || y[i].abs() == m);
            }
            // Reference: q = round_half_even(x / M) evaluated in f64.
            for i in 0..x.len() {
                let q = if m == 0.0 { 0.0 } else { (x[i] as f64 / m as f64).round_ties_even() };
                prop_assert_eq!(q * m as f64, y[i] as f64);
            }
        }

        #[test]
        fn prop_hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200),
                                          n in 0usize..300, st in 0u8..3, mlen in 0usize..4) {
            let c = full();
            let mut out = vec![0f32; n];
            let _ = c.decode(&bytes, &mut out);
            // A valid header in front of random bytes reaches the payload checks.
            let mut msg = Vec::new();
            write_header(&mut msg, CodecId::ThreeLc, n);
            msg.extend_from_slice(&[0.5f32, 1.0, 0.0, 2.0][mlen].to_le_bytes());
            msg.push(st);
            msg.extend_from_slice(&bytes);
            let before = out.clone();
            if c.decode_add(&msg, &mut out).is_err() {
                prop_assert_eq!(before, out);
            }
        }

        #[test]
        fn prop_mutated_messages(x in proptest::collection::vec(prop_oneof![Just(0.0f32), -10f32..10.0], 0..400),
                                 flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
                                 cut in any::<usize>(), st in 0u8..3) {
            let mut c = ThreeLc::new(1.5, ThreeLcStage::from_u8(st).expect("test")).expect("test");
            let mut msg = enc(&mut c, &x);
            let cut = cut % (msg.len() + 1);
            let mut out = vec![0f32; x.len()];
            prop_assert!(c.decode(&msg[..cut], &mut out).is_err() || cut == msg.len());
            for &(pos, b) in &flips {
                let l = msg.len();
                msg[pos % l] ^= b;
            }
            let before = out.clone();
            if c.decode_add(&msg, &mut out).is_err() {
                prop_assert_eq!(before, out);
            }
        }
    }
}
