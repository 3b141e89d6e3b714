//! Baselines: `none` (fp32), `fp16` (IEEE half) and `int8` (255 levels,
//! `round(x / max|x| · 127)`, the 8-bit comparison point of 3LC §5).
//!
//! Error bounds: `none` exact; `fp16` relative 2^-11 for normal halves
//! (inputs beyond ±65504 are rejected); `int8` absolute `max|x| / 254`. All
//! reject NaN/Inf inputs, and decoders reject non-finite values on the wire.

use super::{check_finite, check_header, write_header, Codec, CodecConfig, CodecId};
use crate::{Error, Result};

/// fp32 pass-through.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCompression;

/// IEEE 754 half precision.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp16;

/// 255-level linear quantization with one f32 scale.
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

impl Codec for Fp16 {
    fn id(&self) -> CodecId {
        CodecId::Fp16
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Fp16
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_finite(x)?;
        if let Some(i) = x.iter().position(|v| v.abs() > f32::from(half::f16::MAX)) {
            return Err(Error::InvalidArgument(format!(
                "fp16: element {i} = {} is beyond the half-precision range (±65504)",
                x[i]
            )));
        }
        write_header(out, CodecId::Fp16, x.len());
        out.reserve(2 * x.len());
        for &v in x {
            out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::Fp16, acc.len())?;
        let p = r.rest();
        expect_len(p.len(), acc.len() * 2)?;
        let val = |c: &[u8]| half::f16::from_le_bytes([c[0], c[1]]);
        if let Some(i) = p.chunks_exact(2).position(|c| !val(c).is_finite()) {
            return Err(Error::Decode(format!("value {i} is not finite")));
        }
        for (a, c) in acc.iter_mut().zip(p.chunks_exact(2)) {
            *a += half::f16::from_le_bytes([c[0], c[1]]).to_f32();
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
        let inv = if scale > 0.0 { 127.0 / scale } else { 0.0 };
        out.extend(
            x.iter()
                .map(|&v| ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8),
        );
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::Int8, acc.len())?;
        let scale = r.finite_f32()?;
        let p = r.rest();
        expect_len(p.len(), acc.len())?;
        let step = scale / 127.0;
        for (a, &b) in acc.iter_mut().zip(p) {
            *a += (b as i8) as f32 * step;
        }
        Ok(())
    }
}
