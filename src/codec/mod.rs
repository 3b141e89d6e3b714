//! Compression codecs of the papers under one contract.
//!
//! A [`Codec`] encodes a dense `&[f32]` into self-describing bytes and decodes
//! them back, either into a dense buffer ([`Codec::decode`]) or added into an
//! accumulator ([`Codec::decode_add`], the aggregation hot path of the sparse
//! layer). Every message starts with a [`HEADER_LEN`]-byte header:
//!
//! | bytes | field |
//! |---|---|
//! | 0..2 | magic `b"GS"` |
//! | 2 | format version ([`FORMAT_VERSION`]) |
//! | 3 | codec id ([`CodecId`]) |
//! | 4..12 | element count, u64 little endian |
//!
//! followed by the codec's own parameters (scale, mean, norm, ...) and payload,
//! so a receiver needs nothing but the bytes. Decoders treat their input as
//! hostile: any byte string yields `Ok` or [`Error::Decode`], never a panic or
//! an out-of-bounds write ([`Reader`] does all bounds checks).
//!
//! Codecs are configured by [`CodecConfig`], which (de)serializes with serde
//! and parses from strings such as `rgc:density=0.001` or `3lc:s=1.75`.
//! Lossy codecs run with or without [`ErrorFeedback`], kept apart from them.

mod baseline;
mod fastsgd;
mod feedback;
mod golomb;
mod qsgd;
mod rgc;
mod sbc;
mod threelc;
mod wire;

pub use baseline::{Fp16, Int8, NoCompression};
pub use fastsgd::FastSgd;
pub use feedback::{ErrorFeedback, Feedback, FeedbackMode, STARVED_STEPS};
pub use qsgd::Qsgd;
pub use rgc::{rgc_k, Rgc, RgcMethod, RgcQuant};
pub use sbc::Sbc;
pub use threelc::{ThreeLc, ThreeLcStage};
pub use wire::sparse_k;

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Length of the common header.
pub const HEADER_LEN: usize = 12;
/// Current wire-format version.
pub const FORMAT_VERSION: u8 = 1;
const MAGIC: [u8; 2] = *b"GS";

/// Codec identifiers on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum CodecId {
    /// fp32, uncompressed.
    None = 0,
    /// IEEE half precision with a per-tensor power-of-two scale.
    Fp16 = 1,
    /// 255-level linear quantization.
    Int8 = 2,
    /// RedSync residual gradient compression (top-k, index + value).
    Rgc = 3,
    /// RedSync quantized RGC (same-sign set, one mean).
    RgcQuant = 4,
    /// 3LC (3-value quantization, quartic, zero-run encoding).
    ThreeLc = 5,
    /// Sparse binary compression.
    Sbc = 6,
    /// FastSGD.
    FastSgd = 7,
    /// QSGD.
    Qsgd = 8,
}

impl CodecId {
    /// The id of a wire byte.
    pub fn from_u8(b: u8) -> Result<Self> {
        Ok(match b {
            0 => Self::None,
            1 => Self::Fp16,
            2 => Self::Int8,
            3 => Self::Rgc,
            4 => Self::RgcQuant,
            5 => Self::ThreeLc,
            6 => Self::Sbc,
            7 => Self::FastSgd,
            8 => Self::Qsgd,
            _ => return Err(Error::Decode(format!("unknown codec id {b}"))),
        })
    }
}

/// A gradient compressor.
///
/// `encode` takes `&mut self` because some codecs keep state between calls
/// (RGC-quant alternates signs, QSGD advances its RNG, threshold search reuses
/// its threshold). Decoding is stateless.
pub trait Codec: Send + Sync {
    /// Wire id.
    fn id(&self) -> CodecId;
    /// The configuration this codec was built from.
    fn config(&self) -> CodecConfig;
    /// Encode `x` into `out` (cleared first), header included.
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()>;
    /// Add the decoded message into `acc` (`acc.len()` must equal the element
    /// count in the header). On error `acc` may be partly updated only if the
    /// codec documents it; built-in codecs validate fully before writing.
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()>;
    /// Decode into `out` (overwritten).
    fn decode(&self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        check_header(bytes, self.id(), out.len())?;
        out.fill(0.0);
        self.decode_add(bytes, out)
    }
    /// Visit each `(index, value)` a sparse message adds, after validating
    /// the whole message; returns `Ok(false)` without visiting for dense
    /// codecs. The engine uses it to update residuals and mask momentum in
    /// O(k) instead of O(n).
    fn for_each_sent(&self, bytes: &[u8], n: usize, f: &mut dyn FnMut(usize, f32)) -> Result<bool> {
        let _ = (bytes, n, f);
        Ok(false)
    }
    /// Change the fraction of elements sent, for codecs that have one
    /// (`rgc`, `rgc-quant`: `density`; `sbc`: `p`). The synchronization engine
    /// uses it for density warm-up schedules. Others return
    /// [`Error::Unsupported`].
    fn set_density(&mut self, density: f64) -> Result<()> {
        Err(Error::Unsupported(format!(
            "codec {} has no density parameter (asked for {density})",
            self.config().name()
        )))
    }
    /// Encoder state that shapes future messages (RGC-quant's sign turn, a
    /// reused threshold, QSGD's call counter), as bytes for snapshots. Empty
    /// for stateless codecs.
    fn state(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Restore what [`state`](Self::state) returned. Hostile bytes give
    /// [`Error::Decode`].
    fn set_state(&mut self, state: &[u8]) -> Result<()> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(Error::Decode(format!(
                "codec {} is stateless but got {} state bytes",
                self.config().name(),
                state.len()
            )))
        }
    }
    /// How error feedback must run with this codec on a tensor of `n`
    /// elements, or [`Error::InvalidArgument`] for a combination known to
    /// diverge (the classes and proofs are in `src/codec/feedback.rs`). The
    /// default, [`Feedback::Full`], is for contractive codecs.
    fn feedback(&self, n: usize) -> Result<Feedback> {
        let _ = n;
        Ok(Feedback::Full)
    }
}

/// Write the common header for `n` elements of codec `id` into `out` (cleared).
pub fn write_header(out: &mut Vec<u8>, id: CodecId, n: usize) {
    out.clear();
    out.extend_from_slice(&MAGIC);
    out.push(FORMAT_VERSION);
    out.push(id as u8);
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

/// Parse the common header: returns the codec id and element count.
pub fn read_header(bytes: &[u8]) -> Result<(CodecId, usize)> {
    if bytes.len() < HEADER_LEN {
        return Err(Error::Decode(format!(
            "message of {} bytes is shorter than the {HEADER_LEN}-byte header",
            bytes.len()
        )));
    }
    if bytes[0..2] != MAGIC {
        return Err(Error::Decode("bad magic (not a gradsync message)".into()));
    }
    if bytes[2] != FORMAT_VERSION {
        return Err(Error::Decode(format!(
            "unsupported format version {}",
            bytes[2]
        )));
    }
    let id = CodecId::from_u8(bytes[3])?;
    let n = u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes"));
    let n =
        usize::try_from(n).map_err(|_| Error::Decode(format!("element count {n} too large")))?;
    Ok((id, n))
}

/// Check the header against the codec and the destination length; returns a
/// [`Reader`] positioned after the header.
pub fn check_header(bytes: &[u8], id: CodecId, len: usize) -> Result<Reader<'_>> {
    let (got, n) = read_header(bytes)?;
    if got != id {
        return Err(Error::Decode(format!(
            "message is {got:?}, decoder is {id:?}"
        )));
    }
    if n != len {
        return Err(Error::Decode(format!(
            "message holds {n} elements, destination has {len}"
        )));
    }
    Ok(Reader {
        buf: bytes,
        pos: HEADER_LEN,
    })
}

/// Bounds-checked little-endian cursor over a message.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `buf` from offset 0.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Take the next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Decode(format!(
                "truncated message: need {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// The rest of the message.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
    /// Next byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    /// Next u16.
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.bytes(2)?.try_into().expect("2 bytes"),
        ))
    }
    /// Next u32.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().expect("4 bytes"),
        ))
    }
    /// Next u64.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// Next f32; rejects NaN and infinities (parameters must be finite).
    pub fn finite_f32(&mut self) -> Result<f32> {
        let v = f32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes"));
        if !v.is_finite() {
            return Err(Error::Decode(format!("non-finite parameter {v}")));
        }
        Ok(v)
    }
    /// Fail unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.remaining() != 0 {
            return Err(Error::Decode(format!(
                "{} trailing bytes",
                self.remaining()
            )));
        }
        Ok(())
    }
}

/// Reject NaN/Inf in an input tensor (codecs whose scale would be poisoned).
pub fn check_finite(x: &[f32]) -> Result<()> {
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "input element {i} is {} (NaN/Inf cannot be compressed)",
            x[i]
        )));
    }
    Ok(())
}

/// `max|x_i|` of `x`, or the error [`check_finite`] gives when `x` holds
/// NaN/Inf, in one pass that checks and reduces together (encoders used to
/// make two). Magnitudes are compared as the bits of `|x_i|` (sign cleared),
/// which order like the values and put NaN/Inf (`≥ 0x7f80_0000`) above every
/// finite one; sixteen independent lanes keep the loop vectorized.
pub(crate) fn finite_max_abs(x: &[f32]) -> Result<f32> {
    const L: usize = 16;
    let mut lanes = [0i32; L];
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = (*m).max((v.to_bits() & 0x7fff_ffff) as i32);
        }
    }
    let m = tail
        .iter()
        .map(|v| (v.to_bits() & 0x7fff_ffff) as i32)
        .chain(lanes)
        .max()
        .unwrap_or(0);
    if m >= 0x7f80_0000 {
        check_finite(x)?;
    }
    Ok(f32::from_bits(m as u32))
}

/// Typed codec configuration. Serializes as `{"codec": "3lc", "s": 1.75}` and
/// parses from `3lc:s=1.75` (see [`std::str::FromStr`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "codec", rename_all = "kebab-case", deny_unknown_fields)]
pub enum CodecConfig {
    /// fp32, uncompressed.
    None,
    /// IEEE half precision with a per-tensor power-of-two scale (any finite f32).
    Fp16,
    /// 255-level linear quantization (`round(x / max|x| · 127)`).
    Int8,
    /// QSGD stochastic quantization: `bits` per value (sign + level), seeded RNG.
    Qsgd {
        /// Bits per value, 2..=8 (default 4: 7 levels + sign).
        #[serde(default = "default_qsgd_bits")]
        bits: u32,
        /// RNG seed.
        #[serde(default)]
        seed: u64,
        /// Elements per norm (0, the default: one norm for the vector; the
        /// QSGD paper buckets by 512). Omitted from JSON and strings when 0.
        #[serde(default, skip_serializing_if = "is_zero")]
        bucket: usize,
        /// Error feedback: `auto` (default: full where proven bounded, else
        /// damped), `full` (refused where it diverges), `damped`, `none`.
        #[serde(default, skip_serializing_if = "FeedbackMode::is_auto")]
        ef: FeedbackMode,
    },
    /// Sparse binary compression: top/bottom fraction `p ∈ (0, 0.5]`, one
    /// mean, Golomb-Rice positions ([`Sbc`]).
    Sbc {
        /// Density of the kept set (default 0.01).
        #[serde(default = "default_sbc_p")]
        p: f64,
    },
    /// 3LC: 3-value quantization with sparsity multiplier `s ∈ [1, 2)`,
    /// quartic encoding and zero-run encoding (`stage` picks how many run).
    #[serde(rename = "3lc")]
    ThreeLc {
        /// Sparsity multiplier, `1 ≤ s < 2` (default 1).
        #[serde(default = "threelc::default_s")]
        s: f32,
        /// `full` (default), `quartic` or `quant`.
        #[serde(default)]
        stage: ThreeLcStage,
    },
    /// FastSGD (reciprocal mapper, log quantization, threshold filter,
    /// adaptive binary delta keys); see [`FastSgd`].
    Fastsgd {
        /// Base `b > 1` of the logarithm quantization.
        #[serde(default = "fastsgd_default_b")]
        b: f64,
        /// Threshold `τ ≤ 128`: elements with `L > τ` are dropped.
        #[serde(default = "fastsgd_default_tau")]
        tau: u32,
        /// Length flag size `l ∈ 1..=4` bits.
        #[serde(default = "fastsgd_default_l")]
        l: u32,
        /// The paper's threshold `Σ|x|/b^τ` even where it keeps nothing
        /// (default false: see [`FastSgd`]).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        paper: bool,
    },
    /// RedSync RGC: `k = max(1, ceil(density·n))` indices and values, chosen
    /// by `method` (`exact`, `trimmed`, `threshold`, `sampled`).
    Rgc {
        /// Fraction of elements sent (default 0.001).
        #[serde(default = "rgc::default_density")]
        density: f64,
        /// Selection method (default `trimmed`).
        #[serde(default)]
        method: RgcMethod,
    },
    /// RedSync quantized RGC: alternately the top-k positive and bottom-k
    /// negative values, sent as indices and their mean.
    RgcQuant {
        /// Fraction of elements sent (default 0.001).
        #[serde(default = "rgc::default_density")]
        density: f64,
    },
    // Codec variants: keep one per block, in wire-id order.
}

fn fastsgd_default_b() -> f64 {
    1.1
}
fn fastsgd_default_tau() -> u32 {
    128
}
fn fastsgd_default_l() -> u32 {
    2
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

fn default_qsgd_bits() -> u32 {
    4
}

fn default_sbc_p() -> f64 {
    0.01
}

impl CodecConfig {
    /// The codec's own density parameter, if it has one (`rgc`,
    /// `rgc-quant`: `density`; `sbc`: `p`).
    pub fn own_density(&self) -> Option<f64> {
        match self {
            Self::Rgc { density, .. } | Self::RgcQuant { density } => Some(*density),
            Self::Sbc { p } => Some(*p),
            _ => None,
        }
    }

    /// Whether the codec's units are index/value pairs, one value per
    /// index (its [`for_each_sent`](Codec::for_each_sent) visits them): RGC
    /// and quantized RGC. SBC also visits positions, but its Golomb-coded
    /// unit is far smaller than the sparse allreduce's 8 bytes a pair, so
    /// it stays in the fused allgatherv.
    pub fn sends_pairs(&self) -> bool {
        matches!(self, Self::Rgc { .. } | Self::RgcQuant { .. })
    }

    /// Short name (`none`, `fp16`, `3lc`, ...).
    pub fn name(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.get("codec").and_then(|c| c.as_str()).map(str::to_string))
            .unwrap_or_default()
    }

    /// Parameters as `key=value` pairs, in the string syntax.
    pub fn params(&self) -> String {
        let Ok(serde_json::Value::Object(m)) = serde_json::to_value(self) else {
            return String::new();
        };
        m.iter()
            .filter(|(k, _)| k.as_str() != "codec")
            .map(|(k, v)| {
                format!(
                    "{k}={}",
                    v.as_str().map_or_else(|| v.to_string(), str::to_string)
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Build the codec.
    pub fn build(&self) -> Result<Box<dyn Codec>> {
        Ok(match self {
            Self::None => Box::new(NoCompression),
            Self::Fp16 => Box::new(Fp16),
            Self::Int8 => Box::new(Int8),
            Self::Qsgd {
                bits,
                seed,
                bucket,
                ef,
            } => Box::new(
                Qsgd::new(*bits, *seed)?
                    .with_bucket(*bucket)?
                    .with_feedback(*ef),
            ),
            Self::Sbc { p } => Box::new(Sbc::new(*p)?),
            Self::Rgc { density, method } => Box::new(Rgc::new(*density, *method)?),
            Self::RgcQuant { density } => Box::new(RgcQuant::new(*density)?),
            Self::Fastsgd { b, tau, l, paper } => {
                Box::new(FastSgd::new(*b, *tau, *l)?.with_paper_threshold(*paper))
            }
            Self::ThreeLc { s, stage } => Box::new(ThreeLc::new(*s, *stage)?),
        })
    }

    /// Every codec with its default parameters.
    pub fn all_defaults() -> Vec<CodecConfig> {
        [
            "none",
            "fp16",
            "int8",
            "qsgd",
            "rgc",
            "rgc-quant",
            "sbc",
            "3lc",
            "fastsgd",
        ]
        .iter()
        .map(|s| s.parse().expect("built-in codec names parse"))
        .collect()
    }
}

impl std::str::FromStr for CodecConfig {
    type Err = Error;
    /// `name[:key=value[,key=value...]]`; values are numbers, booleans or strings.
    fn from_str(s: &str) -> Result<Self> {
        let (name, params) = s.split_once(':').unwrap_or((s, ""));
        let mut m = serde_json::Map::new();
        m.insert(
            "codec".into(),
            serde_json::Value::String(name.trim().to_string()),
        );
        for kv in params.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                Error::InvalidArgument(format!("codec parameter {kv:?} is not key=value"))
            })?;
            let v = v.trim();
            let val = serde_json::from_str::<serde_json::Value>(v)
                .ok()
                .filter(|j| j.is_number() || j.is_boolean())
                .unwrap_or_else(|| serde_json::Value::String(v.to_string()));
            let k = k.trim();
            if k == "codec" || m.insert(k.to_string(), val).is_some() {
                return Err(Error::InvalidArgument(format!(
                    "codec {s:?}: parameter {k:?} given twice"
                )));
            }
        }
        let cfg: CodecConfig = serde_json::from_value(serde_json::Value::Object(m.clone()))
            .map_err(|e| Error::InvalidArgument(format!("codec {s:?}: {e}")))?;
        // Unit variants ignore extra keys in serde (struct variants reject
        // them through `deny_unknown_fields`); reject them here.
        if let Ok(serde_json::Value::Object(back)) = serde_json::to_value(&cfg) {
            let unit = back.len() == 1;
            if let Some(k) = m.keys().find(|k| unit && !back.contains_key(*k)) {
                return Err(Error::InvalidArgument(format!(
                    "codec {s:?}: unknown parameter {k:?}"
                )));
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests;
