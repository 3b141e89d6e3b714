//! Baselines: `none` (fp32), `fp16` (IEEE half with a per-tensor power-of-two
//! scale) and `int8` (255 levels, `round(x / max|x| · 127)`, the 8-bit
//! comparison point of 3LC §5).
//!
//! All three accept every finite f32, subnormals and ±`f32::MAX` included,
//! reject NaN/Inf inputs, and their decoders reject non-finite values on the
//! wire. With `m = max|x|` and `y = decode(encode(x))`:
//!
//! * `none`: exact.
//! * `fp16`: `|x − y| ≤ 2⁻¹¹·|x| + 2⁻³⁹·m` for every element. The tensor is
//!   scaled by `2^-k` (`k = ⌊log₂ m⌋ − 14`, so `m·2^-k ∈ [2¹⁴, 2¹⁵)`, like
//!   loss scaling) before the conversion to half, so large tensors do not
//!   overflow half's ±65504 and tiny ones are not flushed to zero. Elements
//!   about 2²⁸ times smaller than `m` land in half's subnormals (the `2⁻³⁹·m`
//!   term); decoded values are exact multiples of `2^k` and are clamped to
//!   ±`f32::MAX` (only elements within a relative 2⁻¹² of `f32::MAX` can round up to 2¹²⁸).
//! * `int8`: `|x − y| ≤ (1 + 2⁻¹⁵)·m/254 + 2⁻¹⁴⁹` (half a step, plus the
//!   final rounding to f32; the `2⁻¹⁴⁹` matters only for subnormal results).
//!   `127/m` and `q·m/127` are computed in f64, so nothing overflows for any
//!   finite `m` (in f32, `127/m` was infinite for `m < 3.7e-37`).
//!
//! # Wire format (after the common header, little endian)
//!
//! | codec | parameters | payload |
//! |---|---|---|
//! | `none` | — | `n` × f32 |
//! | `fp16` | i16 `k` (`-163 ..= 113`; 0 for an all-zero tensor) | `n` × f16, value = `f16 · 2^k` |
//! | `int8` | f32 `m` (finite, `≥ 0`) | `n` × i8 `q`, value = `q · m / 127` |

use super::{check_finite, check_header, write_header, Codec, CodecConfig, CodecId};
use crate::{Error, Result};

/// fp32 pass-through.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCompression;

/// IEEE 754 half precision after a per-tensor power-of-two scale (see the
/// module docs for the bound).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp16;

/// 255-level linear quantization with one f32 scale (see the module docs for
/// the bound).
#[derive(Clone, Copy, Debug, Default)]
pub struct Int8;

fn expect_len(payload: usize, want: usize) -> Result<()> {
    if payload != want {
        return Err(Error::Decode(format!(
            "payload has {payload} bytes, expected {want}"
        )));
    }
    Ok(())
}

impl Codec for NoCompression {
    fn id(&self) -> CodecId {
        CodecId::None
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::None
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_finite(x)?;
        write_header(out, CodecId::None, x.len());
        if cfg!(target_endian = "little") {
            out.extend_from_slice(bytemuck::cast_slice(x));
        } else {
            out.extend(x.iter().flat_map(|v| v.to_le_bytes()));
        }
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::None, acc.len())?;
        let p = r.rest();
        expect_len(p.len(), acc.len() * 4)?;
        let val = |c: &[u8]| f32::from_le_bytes(c.try_into().expect("4 bytes"));
        if let Some(i) = p.chunks_exact(4).position(|c| !val(c).is_finite()) {
            return Err(Error::Decode(format!("value {i} is not finite")));
        }
        for (a, c) in acc.iter_mut().zip(p.chunks_exact(4)) {
            *a += val(c);
        }
        Ok(())
    }
}

/// Exponent of the fp16 scale: `⌊log₂ m⌋ − 14` (so `m·2^-k ∈ [2¹⁴, 2¹⁵)`).
fn fp16_exponent(m: f32) -> i32 {
    if m == 0.0 {
        return 0;
    }
    // Every positive f32 (subnormals included) is a normal f64.
    let e = ((f64::from(m).to_bits() >> 52) & 0x7ff) as i32 - 1023;
    e - 14
}

/// Range of the fp16 scale exponent: `⌊log₂ m⌋ ∈ [-149, 127]` for a finite
/// nonzero f32 `m`.
const FP16_K: std::ops::RangeInclusive<i32> = -163..=113;

/// Round `x · 2^-k` to half. The product is formed in f64 (`2^-k` may be
/// beyond f32's range) and is exact in f32 whenever it is at least 2⁻¹²⁶;
/// smaller ones round to 0 in half either way, so there is one rounding.
fn to_scaled_f16(x: f32, inv: f64) -> half::f16 {
    half::f16::from_f32((f64::from(x) * inv) as f32)
}

impl Codec for Fp16 {
    fn id(&self) -> CodecId {
        CodecId::Fp16
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Fp16
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_finite(x)?;
        let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let k = fp16_exponent(m);
        debug_assert!(FP16_K.contains(&k));
        let inv = 2f64.powi(-k);
        write_header(out, CodecId::Fp16, x.len());
        out.reserve(2 + 2 * x.len());
        out.extend_from_slice(&(k as i16).to_le_bytes());
        for &v in x {
            out.extend_from_slice(&to_scaled_f16(v, inv).to_le_bytes());
        }
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::Fp16, acc.len())?;
        let k = i32::from(r.u16()? as i16);
        if !FP16_K.contains(&k) {
            return Err(Error::Decode(format!(
                "fp16 scale exponent {k} outside {FP16_K:?}"
            )));
        }
        let p = r.rest();
        expect_len(p.len(), acc.len() * 2)?;
        let val = |c: &[u8]| half::f16::from_le_bytes([c[0], c[1]]);
        if let Some(i) = p.chunks_exact(2).position(|c| !val(c).is_finite()) {
            return Err(Error::Decode(format!("value {i} is not finite")));
        }
        let scale = 2f64.powi(k);
        let max = f64::from(f32::MAX);
        for (a, c) in acc.iter_mut().zip(p.chunks_exact(2)) {
            // Exact in f64; the clamp only bites when the tensor's maximum
            // was within half an fp16 step of f32::MAX and rounded up.
            *a += (f64::from(val(c).to_f32()) * scale).clamp(-max, max) as f32;
        }
        Ok(())
    }
}

impl Codec for Int8 {
    fn id(&self) -> CodecId {
        CodecId::Int8
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Int8
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_finite(x)?;
        write_header(out, CodecId::Int8, x.len());
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        out.extend_from_slice(&scale.to_le_bytes());
        // In f64: 127/scale is finite for every positive f32 (up to 127·2¹⁴⁹).
        let inv = if scale > 0.0 {
            127.0 / f64::from(scale)
        } else {
            0.0
        };
        out.reserve(x.len());
        out.extend(
            x.iter()
                .map(|&v| ((f64::from(v) * inv).round().clamp(-127.0, 127.0) as i8) as u8),
        );
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::Int8, acc.len())?;
        let scale = r.finite_f32()?;
        if scale < 0.0 {
            return Err(Error::Decode(format!("int8 scale {scale} is negative")));
        }
        let p = r.rest();
        expect_len(p.len(), acc.len())?;
        // In f64, |q·step| ≤ scale·(1 + 2⁻⁵²), which rounds to at most
        // scale ≤ f32::MAX in f32.
        let step = f64::from(scale) / 127.0;
        for (a, &b) in acc.iter_mut().zip(p) {
            *a += (f64::from(b as i8) * step) as f32;
        }
        Ok(())
    }
}
