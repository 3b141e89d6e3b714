//! QSGD (Alistarh et al., NeurIPS 2017), the stochastic quantizer GradiVeQ
//! compares against and composes with.
//!
//! With `s = 2^(bits−1) − 1` levels and `‖x‖₂`, element `x_i` becomes
//! `sign(x_i) · ‖x‖ · ξ_i / s` where `ξ_i ∈ {ℓ, ℓ+1}`, `ℓ = ⌊s|x_i|/‖x‖⌋`,
//! and `ξ_i = ℓ + 1` with probability `s|x_i|/‖x‖ − ℓ`: unbiased
//! (`E[decode] = x`), error at most `‖x‖/s` per element.
//!
//! The coin of element `i` compares a 24-bit uniform `k·2⁻²⁴` with
//! `p = r − ℓ`, so the probability is `⌈p·2²⁴⌉·2⁻²⁴ ∈ [p, p + 2⁻²⁴)`:
//! unbiased to `2⁻²⁴` of a step (`0 ≤ E[ξ_i] − r < 2⁻²⁴`, the same
//! resolution as the per-element `rand` `gen::<f32>()` draw used before). The
//! uniforms come from eight xoshiro128++ generators stepped together (SSE2 on
//! x86-64), one 32-bit word per element, seeded from `SmallRng` with the
//! config's seed and the call count, so a run is reproducible and a restored
//! encoder continues the same stream. Encoding runs in blocks of branch-free
//! loops (ratio, uniforms, codes, packing), about 3 GB/s single-threaded
//! where one `SmallRng` draw per element gave 0.5.
//!
//! Wire format after the header: `bits u8 | norm f32 | packed codes`, each code
//! `bits` wide (sign in the top bit, level below), packed LSB-first;
//! `ceil(n·bits/8)` bytes. Default 4 bits: 7 levels + sign.
//!
//! With `bucket = b > 0` (the QSGD paper's bucketing, typically 512) each run
//! of `b` elements is quantized with its own norm, which bounds the error by
//! the bucket's norm instead of the whole vector's: the `bits` byte then has
//! its top bit set and is followed by `b` as u32 and `⌈n/b⌉` norms, then the
//! codes as above. `bucket = 0` (the default) is one norm for the vector.
//!
//! # Error feedback
//!
//! QSGD is unbiased but, at low bit widths on large buckets, not a
//! contraction. Per bucket of `B` elements with step `Δ = ‖x_B‖/s`, element
//! `i` with `r_i = |x_i|/Δ` has `E e_i² = Δ²·p(1 − p)`, `p = r_i − ⌊r_i⌋`, and
//! `p(1 − p) ≤ min(r_i, 1/4)`; with `Σ r_i = ‖x_B‖₁/Δ ≤ √B·‖x_B‖/Δ` this
//! gives `E‖Q(x) − x‖² ≤ ω‖x‖²` with `ω = min(√B/s, B/(4s²))` (QSGD's Lemma
//! 3.1, with the 1/4). `B` is `bucket`, or the tensor size `n` when
//! `bucket = 0`. [`Codec::feedback`] then decides (module docs of
//! `feedback.rs` for the proofs):
//!
//! * `ef=auto` (default): full error feedback when `ω ≤ 1/2` (contraction in
//!   expectation, `δ = 1 − ω ≥ 1/2`); otherwise damped with `γ = 1/(1 + ω)`
//!   (contraction `δ = 1/(1 + ω)` of the scaled codec). E.g. 8 bits on 4096
//!   elements: `ω = 0.063`, full; 4 bits on 4096: `ω = 9.1`, `γ = 0.099`;
//!   2 bits on 4096: `ω = 64`, `γ = 0.015`; 4 bits with `bucket = 16`:
//!   `ω = 0.082`, full.
//! * `ef=full`: full error feedback, refused (at the engine's `register` and
//!   in [`ErrorFeedback`](super::ErrorFeedback)) when `ω ≥ 1`: the residual
//!   then grows geometrically.
//! * `ef=damped`: damped with `γ = 1/(1 + ω)` at any `ω`.
//! * `ef=none`: no residual (QSGD's own, unbiased use).

use super::{
    check_finite, check_header, write_header, Codec, CodecConfig, CodecId, Feedback, FeedbackMode,
};
use crate::{Error, Result};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

/// Stochastic s-level quantization with the vector norm.
pub struct Qsgd {
    bits: u32,
    seed: u64,
    /// Elements per norm (0: the whole vector).
    bucket: usize,
    /// Messages encoded so far; call `c` draws from an RNG seeded with
    /// `seed` and `c`, so a restored encoder continues the same stream.
    calls: u64,
    /// Requested error feedback.
    ef: FeedbackMode,
}

impl Qsgd {
    /// `bits` in 2..=8 (sign + `bits − 1` level bits).
    pub fn new(bits: u32, seed: u64) -> Result<Self> {
        if !(2..=8).contains(&bits) {
            return Err(Error::InvalidArgument(format!(
                "qsgd bits must be in 2..=8, got {bits}"
            )));
        }
        Ok(Qsgd {
            bits,
            seed,
            bucket: 0,
            calls: 0,
            ef: FeedbackMode::Auto,
        })
    }

    /// Request a kind of error feedback (module docs).
    pub fn with_feedback(mut self, ef: FeedbackMode) -> Self {
        self.ef = ef;
        self
    }

    /// The variance bound `ω = min(√B/s, B/(4s²))` of a tensor of `n`
    /// elements: `E‖Q(x) − x‖² ≤ ω‖x‖²` (module docs).
    pub fn variance_bound(&self, n: usize) -> f64 {
        let b = if self.bucket == 0 {
            n
        } else {
            self.bucket.min(n)
        } as f64;
        let s = f64::from(Self::levels(self.bits));
        (b.sqrt() / s).min(b / (4.0 * s * s))
    }

    /// Quantize each run of `bucket` elements with its own norm (0: one norm
    /// for the whole vector).
    pub fn with_bucket(mut self, bucket: usize) -> Result<Self> {
        if bucket > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "qsgd bucket {bucket} too large"
            )));
        }
        self.bucket = bucket;
        Ok(self)
    }
    fn levels(bits: u32) -> u32 {
        (1 << (bits - 1)) - 1
    }
}

impl Codec for Qsgd {
    fn id(&self) -> CodecId {
        CodecId::Qsgd
    }
    fn config(&self) -> CodecConfig {
        CodecConfig::Qsgd {
            bits: self.bits,
            seed: self.seed,
            bucket: self.bucket,
            ef: self.ef,
        }
    }
    fn feedback(&self, n: usize) -> Result<Feedback> {
        let omega = self.variance_bound(n);
        let damped = Feedback::Damped((1.0 / (1.0 + omega)) as f32);
        Ok(match self.ef {
            FeedbackMode::Auto if omega <= 0.5 => Feedback::Full,
            FeedbackMode::Auto | FeedbackMode::Damped => damped,
            FeedbackMode::None => Feedback::None,
            FeedbackMode::Full if omega < 1.0 => Feedback::Full,
            FeedbackMode::Full => {
                return Err(Error::InvalidArgument(format!(
                    "codec qsgd:{}: full error feedback diverges on {n} elements: QSGD is \
                     unbiased but not a contraction here (variance bound ω = {omega:.3} ≥ 1); \
                     use ef=auto or ef=damped (scaled, bounded), ef=none, more bits or a \
                     smaller bucket",
                    self.config().params()
                )))
            }
        })
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        write_header(out, CodecId::Qsgd, x.len());
        let b = if self.bucket == 0 {
            x.len().max(1)
        } else {
            self.bucket
        };
        let mut norms = Vec::with_capacity(x.len().div_ceil(b).max(1));
        for chunk in x.chunks(b) {
            // NaN/Inf make the sum of squares non-finite (finite f32 squares
            // are below 2^256, so no finite input overflows f64).
            let norm64 = sum_of_squares(chunk).sqrt();
            if !norm64.is_finite() {
                check_finite(chunk)?;
            }
            if norm64 > f64::from(f32::MAX) {
                return Err(Error::InvalidArgument(format!(
                    "qsgd: the norm {norm64:e} overflows f32; scale the gradient down"
                )));
            }
            norms.push(norm64 as f32);
        }
        if self.bucket == 0 {
            out.push(self.bits as u8);
            out.extend_from_slice(&norms.first().copied().unwrap_or(0.0).to_le_bytes());
        } else {
            out.push(self.bits as u8 | BUCKETED);
            out.extend_from_slice(&(self.bucket as u32).to_le_bytes());
            for n in &norms {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        let mut rng = Lanes::new(self.seed ^ self.calls.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // Wrapping: a restored counter may sit at u64::MAX.
        self.calls = self.calls.wrapping_add(1);
        let bits = self.bits;
        let s = Self::levels(bits);
        out.reserve((x.len() * bits as usize).div_ceil(8));
        // Blocks of BLK elements, in straight loops the compiler vectorizes:
        // ratios (per run of one norm), uniforms, codes; then groups of G
        // codes pack into exactly `bits` bytes (LSB-first, as one continuous
        // bit stream would) and the block goes out in one extend.
        let (si, sf) = (s as i32, s as f32);
        let mut r = [0f32; BLK];
        let mut u = [0u32; BLK];
        let mut code = [0u32; BLK];
        let mut buf = [0u8; BLK + 8];
        for (bi, c) in x.chunks(BLK).enumerate() {
            let i0 = bi * BLK;
            let len = c.len();
            let mut j = 0;
            while j < len {
                let bucket = (i0 + j) / b;
                let end = ((bucket + 1) * b - i0).min(len);
                // A zero norm means zeros: any positive divisor gives r = 0.
                let norm = norms[bucket].max(f32::MIN_POSITIVE);
                for (rr, &v) in r[j..end].iter_mut().zip(&c[j..end]) {
                    // |v|/‖x‖ ≤ 1 first: no overflow even for tiny norms.
                    let t = v.abs() / norm * sf;
                    *rr = if t < sf { t } else { sf };
                }
                j = end;
            }
            let groups = len.div_ceil(G);
            rng.fill(&mut u[..groups * G]);
            for ((cd, (&rr, &uu)), &v) in code.iter_mut().zip(r.iter().zip(&u)).zip(c) {
                *cd = quantize(rr, uu, v < 0.0, si, bits);
            }
            code[len..groups * G].fill(0);
            let mut o = 0;
            for g in code[..groups * G].chunks_exact(G) {
                let packed = g
                    .iter()
                    .enumerate()
                    .fold(0u64, |acc, (j, &c)| acc | u64::from(c) << (j as u32 * bits));
                buf[o..o + 8].copy_from_slice(&packed.to_le_bytes());
                o += bits as usize;
            }
            out.extend_from_slice(&buf[..(len * bits as usize).div_ceil(8)]);
        }
        Ok(())
    }
    fn state(&self) -> Vec<u8> {
        self.calls.to_le_bytes().to_vec()
    }
    fn set_state(&mut self, state: &[u8]) -> Result<()> {
        let b: [u8; 8] = state.try_into().map_err(|_| {
            Error::Decode(format!("qsgd state must be 8 bytes, got {}", state.len()))
        })?;
        self.calls = u64::from_le_bytes(b);
        Ok(())
    }
    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::Qsgd, acc.len())?;
        let flag = r.u8()?;
        let bits = u32::from(flag & !BUCKETED);
        if !(2..=8).contains(&bits) {
            return Err(Error::Decode(format!("qsgd bits {bits} out of range")));
        }
        let n = acc.len();
        let (b, norms) = if flag & BUCKETED == 0 {
            (n.max(1), vec![r.finite_f32()?])
        } else {
            let b = r.u32()? as usize;
            if b == 0 {
                return Err(Error::Decode("qsgd bucket of 0 elements".into()));
            }
            let nb = n.div_ceil(b);
            if nb > r.remaining() / 4 {
                return Err(Error::Decode(format!(
                    "qsgd: {nb} bucket norms do not fit in {} bytes",
                    r.remaining()
                )));
            }
            let norms = (0..nb)
                .map(|_| r.finite_f32())
                .collect::<Result<Vec<f32>>>()?;
            (b, norms)
        };
        let payload = r.rest();
        let want = (acc.len() * bits as usize).div_ceil(8);
        if payload.len() != want {
            return Err(Error::Decode(format!(
                "qsgd payload has {} bytes, expected {want}",
                payload.len()
            )));
        }
        let s = Self::levels(bits);
        // Nothing to validate per code: a level has `bits − 1` bits and
        // `s = 2^(bits−1) − 1` is the largest, so every pattern is a level.
        add_codes(payload, bits as usize, b, &norms, s as f32, acc);
        Ok(())
    }
}

const BUCKETED: u8 = 0x80;

/// Adds the `acc.len()` packed `bits`-bit codes of `payload` (sign bit
/// high, then the level; LSB first) times their bucket's `norm / s` into
/// `acc`. Eight codes are exactly `bits` bytes: each group of eight is read
/// as one little-endian word, the signed levels of a block go into a stack
/// buffer, then each bucket's stretch of the block is scaled and added
/// (the per-element loop with its bit reader and division by the bucket
/// size ran at 1.5–1.9 GB/s). `−(l·step)` and `(−l)·step` are the same
/// float, so the sums are the per-element definition's bit for bit.
fn add_codes(payload: &[u8], bits: usize, b: usize, norms: &[f32], s: f32, acc: &mut [f32]) {
    const BLOCK: usize = 4096; // a multiple of 8
    let (m, sign_bit) = ((1u64 << bits) - 1, 1u64 << (bits - 1));
    let level = |code: u64| {
        let v = (code & (sign_bit - 1)) as f32;
        if code & sign_bit != 0 {
            -v
        } else {
            v
        }
    };
    let mut lv = [0f32; BLOCK];
    for (blk, a) in acc.chunks_mut(BLOCK).enumerate() {
        let start = blk * BLOCK;
        let lv = &mut lv[..a.len()];
        let from = start / 8 * bits;
        let to = ((start + a.len()) * bits).div_ceil(8).min(payload.len());
        for (g, out) in lv.chunks_mut(8).enumerate() {
            let at = from + g * bits;
            // One unaligned load where eight bytes remain (the bytes past
            // the group's `bits` are shifted out); the tail copies.
            let x = match payload.get(at..at + 8) {
                Some(w) => u64::from_le_bytes(w.try_into().expect("8 bytes")),
                None => {
                    let mut w = [0u8; 8];
                    let tail = &payload[at.min(to)..to];
                    w[..tail.len()].copy_from_slice(tail);
                    u64::from_le_bytes(w)
                }
            };
            for (j, o) in out.iter_mut().enumerate() {
                *o = level((x >> (j * bits)) & m);
            }
        }
        let mut e = 0;
        while e < a.len() {
            let bucket = (start + e) / b;
            let end = ((bucket + 1) * b - start).min(a.len());
            let step = norms[bucket] / s;
            for (x, &l) in a[e..end].iter_mut().zip(&lv[e..end]) {
                *x += l * step;
            }
            e = end;
        }
    }
}

/// Elements quantized together: `G` codes of `bits` bits fill `bits` bytes.
const G: usize = 8;

/// `Σ v²` in f64, in eight independent lanes (one serial chain is bound by
/// the add latency; the order differs from a left-to-right sum only in the
/// last bits).
fn sum_of_squares(x: &[f32]) -> f64 {
    let mut acc = [0f64; G];
    let chunks = x.chunks_exact(G);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    acc.iter().sum::<f64>()
        + tail
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
}

/// Elements per block of the encoder's loops (a multiple of [`G`]).
const BLK: usize = 256;

/// The code of one element with ratio `r = min(s|v|/‖x‖, s)` (module docs:
/// `ξ = ℓ + 1` with probability `r − ℓ`). `u` is a random 32-bit word; its
/// top 24 bits are the uniform `k·2⁻²⁴` compared with `r − ℓ`, so
/// `P(ξ = ℓ + 1) = ⌈(r − ℓ)·2²⁴⌉·2⁻²⁴`, within `2⁻²⁴` above `r − ℓ` (as
/// with `rand`'s `gen::<f32>()`, which the encoder drew per element
/// before): unbiased to that resolution, `0 ≤ E[ξ] − r < 2⁻²⁴`. Branch-free
/// i32/f32 arithmetic (SSE2 has packed forms of all of it).
#[inline(always)]
fn quantize(r: f32, u: u32, negative: bool, s: i32, bits: u32) -> u32 {
    // ℓ = ⌊r⌋ without a float-to-int cast (its saturation scalarizes the
    // loop): adding 2²³ rounds `0 ≤ r ≤ 128` to the nearest integer, which
    // then sits in the sum's low mantissa bits; step down when it rounded up.
    const TWO23: f32 = 8_388_608.0;
    let sum = r + TWO23;
    let up = i32::from(sum - TWO23 > r);
    let l = (sum.to_bits() as i32 - TWO23.to_bits() as i32) - up;
    let p = r - l as f32;
    let up = (u >> 8) as i32 as f32 * (1.0 / (1u32 << 24) as f32);
    let level = (l + i32::from(up < p)).min(s);
    let sign = i32::from(negative & (level != 0)) << (bits - 1);
    (level | sign) as u32
}

/// `G` xoshiro128++ generators (Blackman and Vigna) stepped together, one
/// 32-bit word per lane per step, so drawing a group's uniforms is a few
/// vector instructions instead of one scalar `SmallRng` call per element.
/// The lanes are seeded from `SmallRng::seed_from_u64(seed)`, so a message
/// is a function of the seed and the call count, as before.
struct Lanes {
    s: [[u32; G]; 4],
}

impl Lanes {
    fn new(seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut s = [[0u32; G]; 4];
        for w in s.iter_mut().flatten() {
            *w = rng.next_u32();
        }
        // An all-zero state would stay zero.
        for j in 0..G {
            if s.iter().all(|w| w[j] == 0) {
                s[0][j] = 1;
            }
        }
        Lanes { s }
    }

    /// Fill `u` (a multiple of `G` long) with the lanes' next words, lane
    /// `j` writing `u[j], u[j + G], ...`.
    #[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
    fn fill_portable(&mut self, u: &mut [u32]) {
        let [mut s0, mut s1, mut s2, mut s3] = self.s;
        for g in u.chunks_exact_mut(G) {
            for j in 0..G {
                g[j] = s0[j].wrapping_add(s3[j]).rotate_left(7).wrapping_add(s0[j]);
                let t = s1[j] << 9;
                s2[j] ^= s0[j];
                s3[j] ^= s1[j];
                s1[j] ^= s2[j];
                s0[j] ^= s3[j];
                s2[j] ^= t;
                s3[j] = s3[j].rotate_left(11);
            }
        }
        self.s = [s0, s1, s2, s3];
    }

    /// The same recurrence in SSE2, four lanes per register (the compiler
    /// kept the portable loop's lanes scalar).
    fn fill(&mut self, u: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `fill_sse2` only needs SSE2, which is part of the x86-64
        // baseline: every CPU this target runs on has it (and it is enabled
        // in the build configuration). No pointers are involved.
        unsafe {
            self.fill_sse2(u)
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.fill_portable(u)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "sse2")]
    fn fill_sse2(&mut self, u: &mut [u32]) {
        use std::arch::x86_64::{
            __m128i, _mm_add_epi32, _mm_or_si128, _mm_slli_epi32, _mm_srli_epi32, _mm_xor_si128,
        };
        let half = |w: &[u32; G], h: usize| -> __m128i {
            bytemuck::cast::<[u32; 4], __m128i>(w[4 * h..4 * h + 4].try_into().expect("4 lanes"))
        };
        let mut st: [[__m128i; 4]; 2] =
            std::array::from_fn(|h| std::array::from_fn(|w| half(&self.s[w], h)));
        for g in u.chunks_exact_mut(G) {
            for (h, [s0, s1, s2, s3]) in st.iter_mut().enumerate() {
                let sum = _mm_add_epi32(*s0, *s3);
                let rot = _mm_or_si128(_mm_slli_epi32::<7>(sum), _mm_srli_epi32::<25>(sum));
                let out = _mm_add_epi32(rot, *s0);
                g[4 * h..4 * h + 4].copy_from_slice(&bytemuck::cast::<__m128i, [u32; 4]>(out));
                let t = _mm_slli_epi32::<9>(*s1);
                *s2 = _mm_xor_si128(*s2, *s0);
                *s3 = _mm_xor_si128(*s3, *s1);
                *s1 = _mm_xor_si128(*s1, *s2);
                *s0 = _mm_xor_si128(*s0, *s3);
                *s2 = _mm_xor_si128(*s2, t);
                *s3 = _mm_or_si128(_mm_slli_epi32::<11>(*s3), _mm_srli_epi32::<21>(*s3));
            }
        }
        for (w, words) in self.s.iter_mut().enumerate() {
            for (h, regs) in st.iter().enumerate() {
                words[4 * h..4 * h + 4]
                    .copy_from_slice(&bytemuck::cast::<__m128i, [u32; 4]>(regs[w]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Feedback, HEADER_LEN};

    /// The decoder's sums equal the per-element definition (a bit reader,
    /// `norm[i / b] / s` per element, the sign applied after the product)
    /// bit for bit, for every bit width, with and without buckets (also
    /// buckets that straddle the decoder's blocks), over lengths that end
    /// mid-group and mid-block, into a nonzero accumulator.
    #[test]
    fn decode_is_the_per_element_definition() {
        for bits in 2..=8u32 {
            for bucket in [0usize, 1, 7, 512, 5000] {
                for n in [1usize, 8, 13, 4096, 4103, 9000] {
                    let x: Vec<f32> = (0..n)
                        .map(|i| ((i * 2654435761) % 1000) as f32 / 37.0 - 13.0)
                        .collect();
                    let mut q = Qsgd::new(bits, 3)
                        .expect("bits")
                        .with_bucket(bucket)
                        .expect("bucket");
                    let mut msg = Vec::new();
                    q.encode(&x, &mut msg).expect("encode");
                    let start: Vec<f32> = (0..n).map(|i| (i % 5) as f32).collect();
                    let mut got = start.clone();
                    q.decode_add(&msg, &mut got).expect("decode");
                    // The definition, from the message's fields.
                    let b = if bucket == 0 { n } else { bucket };
                    let mut at = HEADER_LEN + 1 + if bucket == 0 { 0 } else { 4 };
                    let norms: Vec<f32> = (0..n.div_ceil(b))
                        .map(|_| {
                            let v = f32::from_le_bytes(msg[at..at + 4].try_into().expect("4"));
                            at += 4;
                            v
                        })
                        .collect();
                    let s = Qsgd::levels(bits);
                    let (sign, mask) = (1u64 << (bits - 1), (1u64 << (bits - 1)) - 1);
                    let (mut buf, mut nbuf, mut it) = (0u64, 0u32, msg[at..].iter());
                    for i in 0..n {
                        while nbuf < bits {
                            buf |= u64::from(*it.next().unwrap_or(&0)) << nbuf;
                            nbuf += 8;
                        }
                        let code = buf & ((1 << bits) - 1);
                        buf >>= bits;
                        nbuf -= bits;
                        let v = (code & mask) as f32 * (norms[i / b] / s as f32);
                        let want = start[i] + if code & sign != 0 { -v } else { v };
                        assert_eq!(
                            got[i].to_bits(),
                            want.to_bits(),
                            "bits {bits}, bucket {bucket}, n {n}, element {i}"
                        );
                    }
                }
            }
        }
    }

    /// Every length around the block and group sizes, buckets that do and
    /// do not divide them: exact message length, error within the bucket's
    /// step, and unbiased on average.
    #[test]
    fn blocks_groups_and_buckets_at_every_boundary() {
        for n in [1usize, 7, 8, 9, 255, 256, 257, 1000] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            for bucket in [0usize, 1, 13, 16, 512] {
                let mut q = Qsgd::new(3, 5)
                    .expect("bits")
                    .with_bucket(bucket)
                    .expect("bucket");
                let b = if bucket == 0 { n } else { bucket };
                let trials = 400;
                let mut mean = vec![0f64; n];
                let mut msg = Vec::new();
                let mut y = vec![0f32; n];
                for _ in 0..trials {
                    q.encode(&x, &mut msg).expect("encode");
                    // bits byte, norm (or bucket size and one norm per
                    // bucket), codes.
                    let params = if bucket == 0 {
                        5
                    } else {
                        5 + 4 * n.div_ceil(b)
                    };
                    assert_eq!(msg.len(), HEADER_LEN + params + (3 * n).div_ceil(8));
                    q.decode(&msg, &mut y).expect("decode");
                    for (m, v) in mean.iter_mut().zip(&y) {
                        *m += f64::from(*v) / f64::from(trials);
                    }
                }
                for (c, (xc, mc)) in x.chunks(b).zip(mean.chunks(b)).enumerate() {
                    let norm = xc.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
                    let step = norm / 3.0;
                    for (v, m) in xc.iter().zip(mc) {
                        // One sample's std is at most step/2; 6 sigma.
                        let tol = 6.0 * step / 2.0 / f64::from(trials).sqrt() + 1e-6;
                        assert!(
                            (m - f64::from(*v)).abs() <= tol,
                            "n={n} bucket={bucket} #{c}: {m} vs {v}"
                        );
                    }
                }
                for (c, (xc, yc)) in x.chunks(b).zip(y.chunks(b)).enumerate() {
                    let norm = xc.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
                    for (v, w) in xc.iter().zip(yc) {
                        assert!(f64::from((v - w).abs()) <= norm / 3.0 * 1.0001, "#{c}");
                    }
                }
            }
        }
    }

    /// The SSE2 lanes and the portable loop draw the same words.
    #[test]
    fn lane_generators_agree() {
        let (mut a, mut b) = (Lanes::new(99), Lanes::new(99));
        let (mut ua, mut ub) = (vec![0u32; 64 * G], vec![0u32; 64 * G]);
        for _ in 0..3 {
            a.fill(&mut ua);
            b.fill_portable(&mut ub);
            assert_eq!(ua, ub);
        }
        assert!(ua.iter().any(|&w| w != ua[0]));
    }

    #[test]
    fn qsgd_is_unbiased_in_expectation() {
        // Fixed seed; mean of 4000 independent quantizations vs the input.
        let x: Vec<f32> = (0..64)
            .map(|i| ((i as f32) * 0.7).sin() * (1.0 + i as f32 / 32.0))
            .collect();
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        let mut q = Qsgd::new(4, 42).expect("valid bits");
        let trials = 4000;
        let mut mean = vec![0f64; x.len()];
        let mut msg = Vec::new();
        let mut out = vec![0f32; x.len()];
        for _ in 0..trials {
            q.encode(&x, &mut msg).expect("finite input");
            q.decode(&msg, &mut out).expect("own message");
            for (m, o) in mean.iter_mut().zip(&out) {
                *m += *o as f64 / trials as f64;
            }
        }
        // Per-element std of one sample ≤ step/2 = norm/(2s); the mean of 4000
        // has std ≤ norm/(2·7·sqrt(4000)); allow 5 sigma.
        let tol = 5.0 * norm as f64 / (2.0 * 7.0 * (trials as f64).sqrt());
        for (i, (m, v)) in mean.iter().zip(&x).enumerate() {
            assert!(
                (m - *v as f64).abs() < tol,
                "element {i}: mean {m} vs {v} (tol {tol})"
            );
        }
    }

    #[test]
    fn qsgd_error_within_norm_over_s_and_reproducible() {
        let x: Vec<f32> = (0..1001)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        for bits in 2..=8 {
            let s = Qsgd::levels(bits) as f32;
            let (mut a, mut b) = (
                Qsgd::new(bits, 7).expect("bits"),
                Qsgd::new(bits, 7).expect("bits"),
            );
            let (mut ma, mut mb) = (Vec::new(), Vec::new());
            a.encode(&x, &mut ma).expect("enc");
            b.encode(&x, &mut mb).expect("enc");
            assert_eq!(ma, mb, "same seed, same message");
            assert_eq!(
                ma.len(),
                super::super::HEADER_LEN + 5 + (x.len() * bits as usize).div_ceil(8)
            );
            let mut out = vec![0f32; x.len()];
            a.decode(&ma, &mut out).expect("dec");
            for (o, v) in out.iter().zip(&x) {
                assert!(
                    (o - v).abs() <= norm / s * 1.0001,
                    "bits={bits}: {o} vs {v}"
                );
            }
        }
        assert!(Qsgd::new(1, 0).is_err() && Qsgd::new(9, 0).is_err());
        let mut q = Qsgd::new(4, 0).expect("bits");
        let mut m = Vec::new();
        q.encode(&[0.0; 10], &mut m).expect("zeros");
        let mut out = vec![1f32; 10];
        q.decode(&m, &mut out).expect("dec");
        assert!(out.iter().all(|&v| v == 0.0));
        assert!(q.encode(&[f32::INFINITY], &mut m).is_err());
        assert!(q.encode(&[f32::MAX, f32::MAX], &mut m).is_err());
        // Tiny norm: zeros stay zero, the bound holds.
        q.encode(&[1e-38, 0.0], &mut m).expect("tiny");
        let mut out = [5f32; 2];
        q.decode(&m, &mut out).expect("dec");
        assert_eq!(out[1], 0.0);
        assert!((out[0] - 1e-38).abs() <= 1e-38 / 7.0 * 1.01);
    }

    /// The feedback classes quoted in the module docs.
    #[test]
    fn feedback_follows_the_variance_bound() {
        let fb = |s: &str, n: usize| {
            s.parse::<CodecConfig>()
                .expect("parse")
                .build()
                .expect("build")
                .feedback(n)
        };
        assert_eq!(fb("qsgd:bits=8", 4096).expect("ok"), Feedback::Full);
        assert_eq!(
            fb("qsgd:bits=4,bucket=16", 4096).expect("ok"),
            Feedback::Full
        );
        let damped = |s: &str, n: usize| match fb(s, n).expect("ok") {
            Feedback::Damped(g) => g,
            f => panic!("{s}: {f:?}"),
        };
        assert!((damped("qsgd:bits=4", 4096) - 1.0 / (1.0 + 64.0 / 7.0)).abs() < 1e-6);
        assert!((damped("qsgd:bits=2", 4096) - 1.0 / 65.0).abs() < 1e-6);
        assert!(
            (damped("qsgd:bits=8,ef=damped", 4096) - 1.0 / (1.0 + 4096.0 / 64516.0)).abs() < 1e-6
        );
        assert_eq!(fb("qsgd:bits=2,ef=none", 4096).expect("ok"), Feedback::None);
        assert_eq!(fb("qsgd:bits=8,ef=full", 4096).expect("ok"), Feedback::Full);
        // Known to diverge: refused, naming the codec and the bound.
        let e = fb("qsgd:bits=4,ef=full", 4096)
            .expect_err("diverges")
            .to_string();
        assert!(
            e.contains("qsgd:bits=4,ef=full") && e.contains("9.14"),
            "{e}"
        );
        // The option round-trips and stays out of default strings.
        let cfg: CodecConfig = "qsgd:ef=none".parse().expect("parse");
        assert_eq!(cfg.build().expect("build").config(), cfg);
        assert_eq!(cfg.params(), "bits=4,ef=none,seed=0");
        assert!("qsgd:ef=sometimes".parse::<CodecConfig>().is_err());
    }

    #[test]
    fn buckets_bound_the_error_by_the_bucket_norm() {
        // One huge element: without buckets its norm sets every element's
        // step (error bound 100/7); with buckets only its own bucket's.
        let mut x: Vec<f32> = (0..4096).map(|i| ((i as f32) * 0.3).sin() * 1e-2).collect();
        x[0] = 100.0;
        let run = |bucket: usize| {
            let mut q = Qsgd::new(4, 3)
                .expect("bits")
                .with_bucket(bucket)
                .expect("bucket");
            let mut msg = Vec::new();
            q.encode(&x, &mut msg).expect("encode");
            let mut y = vec![0f32; x.len()];
            q.decode(&msg, &mut y).expect("decode");
            (y, msg.len())
        };
        let (y, len512) = run(512);
        for (bi, (xc, yc)) in x.chunks(512).zip(y.chunks(512)).enumerate() {
            let norm = xc.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt() as f32;
            let bound = norm / 7.0 * 1.0001;
            for (a, b) in xc.iter().zip(yc) {
                assert!(
                    (a - b).abs() <= bound,
                    "bucket {bi}: {a} vs {b}, bound {bound}"
                );
            }
            if bi > 0 {
                assert!(bound < 0.05, "small buckets get small steps: {bound}");
            }
        }
        let (_, len0) = run(0);
        // 8 buckets: 4 bytes for the size and 4 per extra norm.
        assert_eq!(len512, len0 + 4 + 4 * 7);
        // The bucket is part of the config and survives a round trip; 0 is
        // the default and stays out of the parameter string.
        let cfg: CodecConfig = "qsgd:bucket=512".parse().expect("parse");
        assert_eq!(cfg.build().expect("build").config(), cfg);
        assert_eq!(cfg.params(), "bits=4,bucket=512,seed=0");
        let cfg0: CodecConfig = "qsgd:bucket=0".parse().expect("parse");
        assert_eq!(cfg0.params(), "bits=4,seed=0");
        assert!("qsgd:buckets=3".parse::<CodecConfig>().is_err());
        assert!("fp16:bucket=3".parse::<CodecConfig>().is_err());
        // Hostile bucket headers are errors.
        let q = Qsgd::new(4, 0).expect("bits");
        let mut msg = Vec::new();
        super::write_header(&mut msg, CodecId::Qsgd, 10);
        msg.push(4 | BUCKETED);
        msg.extend_from_slice(&0u32.to_le_bytes());
        assert!(q.decode(&msg, &mut [0f32; 10]).is_err());
    }
}
