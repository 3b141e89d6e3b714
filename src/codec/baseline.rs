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
//! * `int8`: `q = round(x · 127/m)` to the nearest integer, ties to even
//!   (ties went away from zero before the encoder was vectorized; either is
//!   within half a step), so
//!   `|x − y| ≤ (1 + 2⁻¹⁵)·m/254 + 2⁻¹⁴⁹` (half a step, plus the
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

use super::{
    check_finite, check_header, finite_max_abs, write_header, Codec, CodecConfig, CodecId,
};
use crate::{Error, Result};
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

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

/// The scale `2^-k` as two f32 factors whose product is `2^-k`: one
/// factor (and `1.0`) when `2^-k` is a normal f32 (`k ≥ -127`), else
/// `2^64 · 2^(-k-64)` (`k < -127` only happens for `m < 2^-113`, so both
/// steps scale up and neither overflows: `|x · 2^-k| < 2^15`).
///
/// `x · s1 · s2` in f32 is the f64 product `x · 2^-k` rounded once to f32,
/// so the half that follows sees the same value the f64 formulation gave:
/// scaling up by powers of two is exact, and a single scale-down rounds only
/// when the result is below 2⁻¹²⁶, where f32 multiplication rounds the exact
/// product correctly (and half rounds it to 0 either way).
fn fp16_scales(k: i32) -> (f32, f32) {
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    if -k <= 127 {
        (pow2(-k), 1.0)
    } else {
        (pow2(64), pow2(-k - 64))
    }
}

/// Elements per block of the fp16/int8 encoders: scale (and convert) into a
/// stack buffer, then one `extend_from_slice`, so the hot loops have no
/// per-element `Vec` pushes and stay vectorized.
const BLOCK: usize = 4096;

impl Codec for Fp16 {
    fn id(&self) -> CodecId {
        CodecId::Fp16
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Fp16
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        let m = finite_max_abs(x)?;
        let k = fp16_exponent(m);
        debug_assert!(FP16_K.contains(&k));
        let (s1, s2) = fp16_scales(k);
        write_header(out, CodecId::Fp16, x.len());
        out.reserve(2 + 2 * x.len());
        out.extend_from_slice(&(k as i16).to_le_bytes());
        // `half`'s slice conversion uses the CPU's F16C instructions (runtime
        // detection) where present, else its portable round-to-nearest-even
        // code: the same half values either way.
        let mut scaled = [0f32; BLOCK];
        let mut bits = [0u16; BLOCK];
        for c in x.chunks(BLOCK) {
            let (f, h) = (&mut scaled[..c.len()], &mut bits[..c.len()]);
            for (d, &v) in f.iter_mut().zip(c) {
                *d = v * s1 * s2;
            }
            h.reinterpret_cast_mut::<half::f16>()
                .convert_from_f32_slice(f);
            if cfg!(target_endian = "little") {
                out.extend_from_slice(bytemuck::cast_slice(h));
            } else {
                out.extend(h.iter().flat_map(|b| b.to_le_bytes()));
            }
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
        // Half's infinities and NaNs: the exponent bits all set. Checked on
        // the bits, before `acc` is touched.
        let bits = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
        if let Some(i) = p.chunks_exact(2).position(|c| bits(c) & 0x7c00 == 0x7c00) {
            return Err(Error::Decode(format!("value {i} is not finite")));
        }
        let scale = 2f64.powi(k);
        let max = f64::from(f32::MAX);
        // Block by block through stack buffers, converted by `half`'s
        // slice conversion (F16C where the CPU has it, as the encoder): the
        // per-element `f16::to_f32` ran at 1.9 GB/s of output.
        let mut h = [0u16; BLOCK];
        let mut f = [0f32; BLOCK];
        for (a, c) in acc.chunks_mut(BLOCK).zip(p.chunks(2 * BLOCK)) {
            let (h, f) = (&mut h[..a.len()], &mut f[..a.len()]);
            for (d, c) in h.iter_mut().zip(c.chunks_exact(2)) {
                *d = bits(c);
            }
            h.reinterpret_cast::<half::f16>().convert_to_f32_slice(f);
            for (a, &v) in a.iter_mut().zip(f.iter()) {
                // Exact in f64; the clamp only bites when the tensor's
                // maximum was within half an fp16 step of f32::MAX and
                // rounded up.
                *a += (f64::from(v) * scale).clamp(-max, max) as f32;
            }
        }
        Ok(())
    }
}

/// `t` clamped to `[-127, 127]` and rounded to the nearest integer (ties to
/// even), as the two's-complement byte. Adding `1.5·2⁵²` makes the FPU round
/// to an integer (the sum's ulp is 1), and the sum's low mantissa bits are
/// that integer modulo 2³²; no `round()` call (a libm call without SSE4.1),
/// no branch, so the loop vectorizes on every x86-64.
#[inline(always)]
fn round_to_i8(t: f64) -> u8 {
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    (t.clamp(-127.0, 127.0) + MAGIC).to_bits() as u8
}

impl Codec for Int8 {
    fn id(&self) -> CodecId {
        CodecId::Int8
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Int8
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        let scale = finite_max_abs(x)?;
        write_header(out, CodecId::Int8, x.len());
        out.extend_from_slice(&scale.to_le_bytes());
        // In f64: 127/scale is finite for every positive f32 (up to 127·2¹⁴⁹).
        let inv = if scale > 0.0 {
            127.0 / f64::from(scale)
        } else {
            0.0
        };
        out.reserve(x.len());
        let mut q = [0u8; BLOCK];
        for c in x.chunks(BLOCK) {
            for (d, &v) in q.iter_mut().zip(c) {
                *d = round_to_i8(f64::from(v) * inv);
            }
            out.extend_from_slice(&q[..c.len()]);
        }
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

#[cfg(test)]
mod tests {
    use super::super::HEADER_LEN;
    use super::*;

    /// The per-element formulations the block encoders replaced: f64 scale
    /// then one rounding to half; `round()` (ties away) to int8.
    fn reference(x: &[f32]) -> (Vec<u8>, Vec<u8>) {
        let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let k = fp16_exponent(m);
        let inv = 2f64.powi(-k);
        let h = x
            .iter()
            .flat_map(|&v| half::f16::from_f32((f64::from(v) * inv) as f32).to_le_bytes())
            .collect();
        let inv = if m > 0.0 { 127.0 / f64::from(m) } else { 0.0 };
        let q = x
            .iter()
            .map(|&v| ((f64::from(v) * inv).round().clamp(-127.0, 127.0) as i8) as u8)
            .collect();
        (h, q)
    }

    #[test]
    fn block_encoders_match_the_per_element_reference() {
        let sub = f32::from_bits(1);
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![0.0; 5],
            vec![sub, -sub, 0.0],
            vec![3e-44, -1e-45, 7e-40],
            vec![1e-36, -2.5e-38, 1e-40, 3e-45],
            vec![f32::MAX, -f32::MAX, 1.0, 1e-30, -65504.0],
            vec![1e6, -3.0, 0.1, 1e-3, 6e-8],
        ];
        // Gradient-like data over a spread of scales, not a block multiple.
        for (s, scale) in [1e-30f32, 1e-3, 1.0, 1e20].iter().enumerate() {
            cases.push(
                (0..9000)
                    .map(|i| {
                        let u = ((i * 7919 + s * 31) % 10007) as f32 / 10007.0 - 0.5;
                        u * u.abs() * scale
                    })
                    .collect(),
            );
        }
        for x in &cases {
            let (h, q) = reference(x);
            let mut msg = Vec::new();
            Fp16.encode(x, &mut msg).expect("finite");
            assert_eq!(
                &msg[HEADER_LEN + 2..],
                &h[..],
                "fp16 {:?}",
                &x[..x.len().min(4)]
            );
            Int8.encode(x, &mut msg).expect("finite");
            let got = &msg[HEADER_LEN + 4..];
            for (i, (&a, &b)) in got.iter().zip(&q).enumerate() {
                // Exact ties may now round to even instead of away from zero.
                let (a, b) = (i32::from(a as i8), i32::from(b as i8));
                assert!((a - b).abs() <= 1, "int8 element {i}: {a} vs {b}");
                if a != b {
                    let t = f64::from(x[i]) * 127.0
                        / f64::from(f32::from_le_bytes(
                            msg[HEADER_LEN..HEADER_LEN + 4].try_into().expect("4 bytes"),
                        ));
                    assert_eq!(t.fract().abs(), 0.5, "only ties differ: {t}");
                }
            }
            assert_eq!(got.len(), q.len());
        }
        assert!(Fp16.encode(&[1.0, f32::NAN], &mut Vec::new()).is_err());
        assert!(Int8.encode(&[f32::NEG_INFINITY], &mut Vec::new()).is_err());
    }
}
