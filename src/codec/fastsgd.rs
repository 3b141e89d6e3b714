//! FastSGD (Yang, Chen, Zeng, Gao: "FastSGD: A Fast Compressed SGD Framework
//! for Distributed Machine Learning"), §3: the gradient value encoder
//! (Algorithm 1: reciprocal mapper, logarithm quantization, threshold filter)
//! and the gradient key encoder (Algorithm 2 / Fig. 3: delta keys with
//! adaptive binary encoding behind an `l`-bit length flag).
//!
//! # Definition
//!
//! For a tensor `x` of `n` elements let `sum = Σ|x_i|` (over the tensor,
//! accumulated in f64, in eight interleaved lanes). For every nonzero `x_i`:
//!
//! * reciprocal mapper (eq. 2): `R_i = sum / |x_i| ≥ 1`;
//! * logarithm quantization (eq. 3): `L_i = ceil(log_b R_i) ≥ 0`, evaluated
//!   exactly as "the smallest `L ≥ 0` with `sum · b^-L ≤ |x_i|`", where
//!   `b^-L` comes from a table built by repeated division (so encoder and
//!   decoder agree bit for bit);
//! * threshold filter (Algorithm 1, early-stop threshold `τ_e = sum / b^τ`):
//!   element `i` is kept iff `|x_i| ≥ τ_e`, i.e. iff `L_i ≤ τ`. Zeros are
//!   never kept; larger `L` (smaller magnitude) is dropped.
//!
//! Kept keys (ascending) are delta-encoded (eq. 4: `Δk_1 = k_1`,
//! `Δk_j = k_j − k_{j−1}`). `M` is the **bit length** of the largest delta
//! (the paper's `ceil(log2 maxDelta)`, Algorithm 2, is one bit short for powers
//! of two: 256 needs 9 bits). The `l`-bit length flag `f ∈ 0..2^l` selects the width
//! `w_f = ceil((f+1)·M / 2^l)`; for `l = 2` these are `M/4, M/2, 3M/4, M`
//! (Fig. 3: `M = 8` gives ranges `[0,4), [4,16), [16,64), [64,256)`). Each
//! delta is written as the smallest flag whose width holds it, then the delta
//! in that many bits, MSB first (Fig. 3: delta 3, `l = 2`, `M = 8` →
//! `0011`). The decoder accepts only this canonical form.
//!
//! # One byte per value (the paper's `τ = 128` needs 258 codes)
//!
//! `L ∈ 0..=τ` plus a sign needs `2(τ+1)` codes; with the paper's `τ = 128`
//! that is 258, two more than a byte. gradsync keeps `τ = 128` and folds
//! `L = 0` into `L = 1`: the value byte is `sign << 7 | (max(L,1) − 1)`
//! (sign 1 = negative), so `τ ≤ 128` is enforced. `L = 0` happens only when
//! one element holds (up to f64 rounding) the whole mass `sum`; it is then
//! decoded as `sum / b` instead of `sum`, still an underestimate inside the
//! bound below. The decoder returns `±sum · b^-max(L,1)`.
//!
//! # A threshold that cannot starve (deviation from the paper)
//!
//! The paper's filter keeps nothing when `Σ|x| > b^τ · max|x|`, which dense
//! tensors of more than about `b^τ` elements (`1.1^128 ≈ 196 000`) reach
//! under error feedback: the residual's sum grows faster than its maximum,
//! and the layer then sends nothing, for ever. FastSGD is meant
//! for sparse gradients, where `Σ|x|` runs over the few values sent. So
//! gradsync encodes against a reference sum `S` in place of `Σ|x|` (levels
//! `L_i = ceil(log_b(S/|x_i|))`, kept iff `|x_i| ≥ S/b^τ`, `S` on the wire
//! where the paper puts `sum`; the decoder is unchanged):
//!
//! * `S = Σ|x|`, the paper's, whenever that keeps every nonzero
//!   (`Σ|x| · b^-τ ≤ min_{x_i ≠ 0}|x_i|`; sparse gradients, the paper's
//!   case): the output is then exactly the paper's, and `S` is the sum over
//!   what is sent;
//! * otherwise `S = Σ_{|x_i| ≥ max·b^-j} |x_i|`, the sum over the set of
//!   elements within `b^j` of the maximum, for the largest `j ∈ 0..=τ` whose
//!   whole set passes the threshold it implies (`S·b^-τ ≤ max·b^-j`): the
//!   paper's `Σ|x|` over (at least) what is sent. `S ≤ Σ|x|`, so this keeps
//!   a superset of what the paper keeps (e.g. 15–20% of a dense N(0,1)
//!   residual of 1.5M elements, where the paper keeps nothing, and the
//!   residual stays bounded);
//! * if no `j` qualifies (more than `b^τ` elements equal the maximum),
//!   `S = max·b^τ` (rounded down until `S·b^-τ ≤ max`), which keeps the
//!   elements equal to the maximum.
//!
//! The maximum is therefore always kept. `fastsgd:paper=true` keeps the
//! paper's `S = Σ|x|` in every case (to reproduce it; it can starve).
//!
//! Computing `S` needs the per-level sums only up to the first level whose
//! set fails its threshold, i.e. for the few elements near the maximum. The
//! encoder estimates that level on a strided sample, collects the elements
//! a factor 1.25 below it in one filter pass and sums those per level: the
//! same sums, hence the same `S` bit for bit, as a pass over the whole
//! tensor, which it falls back to when the estimate was short. The kept
//! set is then read from those candidates. One pass for `Σ|x|`, min, max
//! and finiteness, one filter pass, and work on about 3% of a dense
//! gradient: about 2.5 GB/s single-threaded where a `ln` per element gave
//! 0.25.
//!
//! # Error feedback
//!
//! Every element's error is at most its magnitude (kept: `|x|/b ≤ |decoded|
//! ≤ |x|`; dropped: decoded 0), and the maximum is always kept, so
//! `‖x − C(x)‖² ≤ ‖x‖² − (1 − (1 − 1/b)²)·max² ≤ (1 − (2b − 1)/(b²n))‖x‖²`:
//! contractive, full error feedback is bounded. With `paper=true` the codec
//! is only non-expansive (`‖x − C(x)‖ ≤ ‖x‖`): the residual cannot grow
//! geometrically but a layer can starve, which the engine flags.
//!
//! # Wire format (after the common header)
//!
//! | bytes | field |
//! |---|---|
//! | 8 | `sum`: the reference sum `S`, f64 LE (f64, not f32: `Σ|x|` can exceed `f32::MAX`) |
//! | 8 | `b`, f64 LE (finite, `> 1`) |
//! | 1 | `τ` (`≤ 128`) |
//! | 1 | `l` (`1..=4`) |
//! | 1 | `M` (`≤ 64`; bit length of the largest delta, 0 when `d = 0`) |
//! | 8 | `d`, number of kept elements, u64 LE (`≤ n`) |
//! | `d` | value bytes, `sign << 7 \| (max(L,1) − 1)`, in key order |
//! | rest | key bit stream: per key `flag` (`l` bits) then `Δk` (`w_flag` bits), MSB first, zero-padded to a byte |
//!
//! A zero (or empty) tensor sends `sum = 0`, `d = 0`, `M = 0` and no payload.
//! Inputs with NaN/Inf are rejected with [`Error::InvalidArgument`].
//!
//! # Error bound
//!
//! Dropped elements (`L > τ`, i.e. `|x_i| < sum / b^τ`) decode to 0. Every kept
//! element decodes with its sign and `|x_i| / b ≤ |decoded_i| ≤ |x_i|`
//! (the ceiling makes FastSGD an underestimate, §3.2), up to one f32 rounding
//! of the lower side (relative 2^-24), for decoded values in the normal f32
//! range. There is no per-element absolute bound for dropped elements other
//! than `|x_i| < sum / b^τ`.

use super::{check_finite, check_header, write_header, Codec, CodecConfig, CodecId};
use crate::{Error, Result};

/// Largest threshold `τ` (the value byte has 7 bits of level, see module docs).
pub const MAX_TAU: u32 = 128;
/// Largest length-flag size `l`.
pub const MAX_L: u32 = 4;

const TABLE: usize = MAX_TAU as usize + 1;

/// FastSGD codec (see the module docs).
#[derive(Clone, Debug)]
pub struct FastSgd {
    b: f64,
    tau: u32,
    l: u32,
    /// The paper's `S = Σ|x|` even where it keeps nothing.
    paper: bool,
    /// Reused buffer of key deltas.
    deltas: Vec<u64>,
    /// Reused buffer of candidate indices and values (`reference_sum`).
    cand: Vec<(u32, f32)>,
}

impl FastSgd {
    /// A FastSGD codec with base `b > 1`, threshold `τ ≤ 128` and length flag
    /// size `l ∈ 1..=4`.
    pub fn new(b: f64, tau: u32, l: u32) -> Result<Self> {
        if !(b.is_finite() && b > 1.0) {
            return Err(Error::InvalidArgument(format!(
                "fastsgd: base b = {b} must be finite and > 1"
            )));
        }
        if tau > MAX_TAU {
            return Err(Error::InvalidArgument(format!(
                "fastsgd: threshold tau = {tau} exceeds {MAX_TAU} (sign and level share one byte)"
            )));
        }
        if l == 0 || l > MAX_L {
            return Err(Error::InvalidArgument(format!(
                "fastsgd: length flag size l = {l} must be in 1..={MAX_L}"
            )));
        }
        Ok(FastSgd {
            b,
            tau,
            l,
            paper: false,
            deltas: Vec::new(),
            cand: Vec::new(),
        })
    }

    /// Use the paper's threshold `Σ|x|/b^τ` in every case (it can keep
    /// nothing; see the module docs).
    pub fn with_paper_threshold(mut self, paper: bool) -> Self {
        self.paper = paper;
        self
    }
}

/// One pass over `x`: `Σ|x|` (f64, eight lanes), the smallest nonzero and
/// the largest `|x_i|`, and whether every element is finite.
struct Stats {
    sum: f64,
    min: f64,
    max: f64,
    finite: bool,
}

fn abs_stats(x: &[f32]) -> Stats {
    const L: usize = 8;
    // Compare-and-select in f32 (packed on SSE2, where i32 min/max are
    // not). NaN/±∞ make the f64 sum non-finite (finite f32 magnitudes sum
    // to at most 2^160 over 2^32 elements), which is the finiteness check.
    let (mut sum, mut mn, mut mx) = ([0f64; L], [f32::INFINITY; L], [0f32; L]);
    let mut step = |j: usize, v: f32| {
        let a = v.abs();
        sum[j] += f64::from(a);
        mx[j] = if a > mx[j] { a } else { mx[j] };
        let nz = if a > 0.0 { a } else { f32::INFINITY };
        mn[j] = if nz < mn[j] { nz } else { mn[j] };
    };
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for (j, &v) in c.iter().enumerate() {
            step(j, v);
        }
    }
    for (j, &v) in tail.iter().enumerate() {
        step(j, v);
    }
    // From +0.0 (an empty f64 `sum()` is -0.0).
    let sum = sum.iter().fold(0.0, |s, v| s + v);
    Stats {
        sum,
        min: f64::from(mn.into_iter().fold(f32::INFINITY, f32::min)),
        max: f64::from(mx.into_iter().fold(0.0, f32::max)),
        finite: sum.is_finite(),
    }
}

/// The smallest f32 `t` with `t ≥ v` (for `v ≥ 0`; `+∞` above `f32::MAX`), so
/// that `f64::from(a) ≥ v ⟺ a ≥ t` for every f32 `a`.
fn f32_at_least(v: f64) -> f32 {
    let t = v as f32;
    if f64::from(t) < v {
        f32::from_bits(t.to_bits() + 1)
    } else {
        t
    }
}

/// Elements sampled (strided) for `reference_sum`'s estimate.
const SAMPLE: usize = 1 << 16;

/// The reference sum `S` (module docs): `Σ|x|` when that keeps the minimum
/// nonzero, else the sum over the largest set near the maximum that passes
/// its own threshold. `S · p[tau] ≤ max` always holds for a nonzero `x`.
///
/// Also returns `t` and fills `cand` with the indices (ascending) and values of every
/// `|x_i| ≥ t` (`t = +∞`, `cand` empty, when it did not filter): the
/// encoder's kept set is within them whenever its threshold is `≥ t`.
///
/// The per-level sums are needed only up to the first invalid level, i.e.
/// for the few elements near the maximum (1–2% of a dense gradient). So a
/// strided sample estimates that level `ĵ`; one filter pass collects the
/// candidates `|x_i| ≥ max·p[j_c]`, `j_c = ĵ` plus levels worth a factor 2;
/// their exact per-level sums (each level's elements in index order, so the
/// same f64 sums as a pass over all of `x`) decide, as long as level `j_c`
/// itself is invalid. Otherwise (sample fooled, or tensors shorter than
/// `4·SAMPLE`) every element at or above the floor `max·p[τ]` is a
/// candidate, which is the full computation.
fn reference_sum(
    x: &[f32],
    st: &Stats,
    p: &[f64; TABLE],
    tau: usize,
    ln_b: f64,
    cand: &mut Vec<(u32, f32)>,
) -> (f64, f64) {
    let (sum, min, max) = (st.sum, st.min, st.max);
    if max == 0.0 || sum * p[tau] <= min {
        // The paper's filter keeps every nonzero: Σ|x| is the sum sent.
        return (sum, f64::INFINITY);
    }
    // (jc, filter threshold): levels up to jc are summed exactly from the
    // candidates; the filter goes further down, to 0.85 of the estimated
    // encoder threshold S·p[τ], so that the kept set is among them too.
    let (jc, tf) = match (x.len() >= 4 * SAMPLE && u32::try_from(x.len()).is_ok())
        .then(|| estimate_level(x, max, p, tau, ln_b))
        .flatten()
    {
        Some((j, c)) => {
            // Levels worth a factor 1.25 below the estimate (3 at b = 1.1).
            let margin = (1.25f64.ln() / ln_b).ceil() as usize;
            let jc = (j + margin.max(2)).min(tau);
            (jc, (max * p[jc]).min(0.85 * c * p[tau]))
        }
        None => (tau, 0.0),
    };
    let sums = |jc: usize, cand: &mut Vec<(u32, f32)>| -> Option<f64> {
        // bucket[j]: sum of |x_i| with level j relative to the maximum.
        let mut bucket = [0f64; TABLE];
        let t = max * p[jc];
        let lv = Levels::new(max, p, tau, ln_b);
        let mut add = |a: f64| {
            if a >= t {
                bucket[lv.of(a)] += a;
            }
        };
        if jc < tau {
            filter_at_least(x, f32_at_least(tf), cand);
            for &(_, v) in cand.iter() {
                add(v.abs() as f64);
            }
        } else {
            cand.clear();
            for &v in x {
                add(v.abs() as f64);
            }
        }
        let mut cum = 0.0;
        let mut best = None;
        // Valid j form a prefix: cum grows with j while max·p[j] falls.
        for (j, b) in bucket.iter().enumerate().take(jc + 1) {
            cum += b;
            if cum * p[tau] > max * p[j] {
                return Some(best.unwrap_or(f64::NAN));
            }
            best = Some(cum);
        }
        // Every level up to jc is valid: only final when jc = tau.
        (jc == tau).then(|| best.unwrap_or(f64::NAN))
    };
    let (best, from) = match sums(jc, cand) {
        Some(b) if jc < tau => (b, tf),
        Some(b) => (b, f64::INFINITY),
        None => (sums(tau, cand).expect("all levels decide"), f64::INFINITY),
    };
    if !best.is_nan() {
        return (best, from);
    }
    let mut s = max / p[tau];
    while s * p[tau] > max {
        s = f64::from_bits(s.to_bits() - 1);
    }
    (s, f64::INFINITY)
}

/// The last valid level (module docs) and its sum, estimated on a strided
/// sample of [`SAMPLE`] elements, sums scaled by `n / sample`; `None` when level 0
/// already looks invalid.
fn estimate_level(
    x: &[f32],
    max: f64,
    p: &[f64; TABLE],
    tau: usize,
    ln_b: f64,
) -> Option<(usize, f64)> {
    let stride = x.len() / SAMPLE;
    let mut bucket = [0f64; TABLE];
    let floor = max * p[tau];
    let lv = Levels::new(max, p, tau, ln_b);
    let mut m = 0usize;
    for &v in x.iter().step_by(stride) {
        let a = v.abs() as f64;
        m += 1;
        if a >= floor && a <= max {
            bucket[lv.of(a)] += a;
        }
    }
    let scale = x.len() as f64 / m as f64;
    let mut cum = 0.0;
    let mut best = None;
    for (j, b) in bucket.iter().enumerate() {
        cum += b * scale;
        if cum * p[tau] > max * p[j] {
            break;
        }
        best = Some((j, cum));
    }
    best
}

/// Indices and values with `|x_i| ≥ t`, ascending; chunks of 16 with none are skipped
/// after a branch-free test.
fn filter_at_least(x: &[f32], t: f32, cand: &mut Vec<(u32, f32)>) {
    const L: usize = 16;
    cand.clear();
    let mut buf = [(0u32, 0f32); L];
    for (ci, c) in x.chunks(L).enumerate() {
        if c.iter().fold(false, |h, v| h | (v.abs() >= t)) {
            // Branch-free compaction: write every element, advance past the
            // ones that pass (a branch per element mispredicts at ~3%).
            let mut k = 0;
            for (j, &v) in c.iter().enumerate() {
                buf[k] = ((ci * L + j) as u32, v);
                k += usize::from(v.abs() >= t);
            }
            cand.extend_from_slice(&buf[..k]);
        }
    }
}

/// `p[L] = b^-L` for `L ∈ 0..=128`, by repeated division (monotone
/// non-increasing, identical on encoder and decoder).
fn inv_powers(b: f64) -> [f64; TABLE] {
    let mut p = [1.0f64; TABLE];
    for k in 1..TABLE {
        p[k] = p[k - 1] / b;
    }
    p
}

/// `L = ceil(log_b(sum / a))`, exactly: the smallest `L` with
/// `sum · p[L] ≤ a`. Precondition: `a > 0`, `sum · p[tau] ≤ a`.
/// [`level`] for many `a` against one `sum`: the products `sum·p[L]` in a
/// table, an estimate from [`fast_log2`] and two branch-free table compares
/// (the estimate is within a level for `b ≳ 1.01`); a result that fails
/// the exact check goes through [`level`]'s loops, so it is exact always.
struct Levels<'a> {
    q: [f64; TABLE],
    p: &'a [f64; TABLE],
    sum: f64,
    log2_sum: f64,
    k: f64,
    tau: usize,
    ln_b: f64,
}

impl<'a> Levels<'a> {
    fn new(sum: f64, p: &'a [f64; TABLE], tau: usize, ln_b: f64) -> Self {
        Levels {
            q: std::array::from_fn(|l| sum * p[l]),
            p,
            sum,
            log2_sum: fast_log2(sum),
            k: std::f64::consts::LN_2 / ln_b,
            tau,
            ln_b,
        }
    }

    /// `level(sum, a, ..)`; same precondition `sum·p[τ] ≤ a`.
    #[inline]
    fn of(&self, a: f64) -> usize {
        let (q, tau) = (&self.q, self.tau);
        let est = (self.log2_sum - fast_log2(a)) * self.k;
        let e = if est > 0.0 {
            (est.min(tau as f64) as usize + 1).min(tau)
        } else {
            0
        };
        let lo = e.saturating_sub(1);
        let hi = (lo + 1).min(tau);
        let l = (lo + usize::from(q[lo] > a) + usize::from(q[hi] > a)).min(tau);
        if (l == 0 || q[l - 1] > a) && (l == tau || q[l] <= a) {
            l
        } else {
            level(self.sum, a, self.p, tau, self.ln_b)
        }
    }
}

#[inline]
fn level(sum: f64, a: f64, p: &[f64; TABLE], tau: usize, ln_b: f64) -> usize {
    // A start within about one level of the answer (no libm `ln`/`ceil`
    // calls: they were most of the encoder's time); the loops below make it
    // exact whatever the start.
    let est = (fast_log2(sum) - fast_log2(a)) * (std::f64::consts::LN_2 / ln_b);
    let mut l = if est > 0.0 {
        (est.min(tau as f64) as usize + 1).min(tau)
    } else {
        0
    };
    while l < tau && sum * p[l] > a {
        l += 1;
    }
    while l > 0 && sum * p[l - 1] <= a {
        l -= 1;
    }
    l
}

/// `log₂ v` within about 0.01 for a positive normal `v` (exponent plus a
/// quadratic in the mantissa); only a starting point for [`level`].
fn fast_log2(v: f64) -> f64 {
    let b = v.to_bits();
    let e = ((b >> 52) & 0x7ff) as i64 - 1023;
    let f = f64::from_bits((b & ((1 << 52) - 1)) | (1023 << 52)) - 1.0;
    e as f64 + f * (1.3465 - 0.3465 * f)
}

/// Number of bits needed to write `v` (0 for 0).
fn bit_len(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// Widths selected by the `2^l` length flags: `w_f = ceil((f+1)·M / 2^l)`.
fn widths(m: u32, l: u32) -> [u32; 1 << MAX_L] {
    let k = 1u32 << l;
    let mut w = [0u32; 1 << MAX_L];
    for (f, wf) in w.iter_mut().enumerate().take(k as usize) {
        *wf = ((f as u32 + 1) * m).div_ceil(k);
    }
    w
}

/// MSB-first bit packer appending to a byte vector.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u128,
    n: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter { out, acc: 0, n: 0 }
    }
    /// Append the low `bits` bits of `v` (`bits ≤ 96`).
    fn put(&mut self, v: u128, bits: u32) {
        if bits == 0 {
            return;
        }
        self.acc = (self.acc << bits) | v;
        self.n += bits;
        while self.n >= 8 {
            self.n -= 8;
            self.out.push((self.acc >> self.n) as u8);
        }
        self.acc &= (1u128 << self.n) - 1;
    }
    /// Flush the last partial byte, zero padded.
    fn finish(self) {
        if self.n > 0 {
            self.out.push((self.acc << (8 - self.n)) as u8);
        }
    }
}

/// Write one delta: the smallest flag whose width holds it, then the delta.
fn write_delta(bw: &mut BitWriter<'_>, delta: u64, l: u32, w: &[u32; 1 << MAX_L]) {
    let need = bit_len(delta);
    let last = (1usize << l) - 1;
    let f = w[..=last].iter().position(|&wf| need <= wf).unwrap_or(last);
    bw.put(((f as u128) << w[f]) | delta as u128, l + w[f]);
}

/// Bounds-checked MSB-first bit cursor.
struct BitReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> BitReader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        BitReader { buf, pos: 0 }
    }
    /// Next `bits ≤ 64` bits as an integer.
    fn get(&mut self, bits: u32) -> Result<u64> {
        let end = self
            .pos
            .checked_add(bits as usize)
            .filter(|e| e.div_ceil(8) <= self.buf.len())
            .ok_or_else(|| Error::Decode("fastsgd: key bit stream truncated".into()))?;
        let mut v = 0u64;
        while self.pos < end {
            let byte = self.buf[self.pos / 8];
            let avail = 8 - (self.pos % 8) as u32;
            let take = avail.min((end - self.pos) as u32);
            let chunk = (byte >> (avail - take)) as u64 & ((1u64 << take) - 1);
            v = (v << take) | chunk;
            self.pos += take as usize;
        }
        Ok(v)
    }
    /// Fail unless only zero padding (< 8 bits) is left.
    fn finish(&self) -> Result<()> {
        if self.pos.div_ceil(8) != self.buf.len() {
            return Err(Error::Decode(format!(
                "fastsgd: {} trailing bytes after the key bit stream",
                self.buf.len() - self.pos.div_ceil(8)
            )));
        }
        if self.pos % 8 != 0 {
            let last = self.buf[self.pos / 8];
            if last & (0xffu8 >> (self.pos % 8)) != 0 {
                return Err(Error::Decode(
                    "fastsgd: nonzero padding bits in the key bit stream".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Read one delta in canonical form (the smallest flag that holds it).
fn read_delta(br: &mut BitReader<'_>, l: u32, w: &[u32; 1 << MAX_L]) -> Result<u64> {
    let f = br.get(l)? as usize;
    let v = br.get(w[f])?;
    if f > 0 && bit_len(v) <= w[f - 1] {
        return Err(Error::Decode(format!(
            "fastsgd: delta {v} written with length flag {f}, not the smallest"
        )));
    }
    Ok(v)
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Decode(format!("fastsgd: {}", msg.into()))
}

impl Codec for FastSgd {
    fn id(&self) -> CodecId {
        CodecId::FastSgd
    }

    fn config(&self) -> CodecConfig {
        CodecConfig::Fastsgd {
            b: self.b,
            tau: self.tau,
            l: self.l,
            paper: self.paper,
        }
    }

    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        // Algorithm 1, line 1, with the finiteness check, min and max in
        // the same pass.
        let st = abs_stats(x);
        if !st.finite {
            check_finite(x)?;
        }
        write_header(out, CodecId::FastSgd, x.len());
        let p = inv_powers(self.b);
        let tau = self.tau as usize;
        let ln_b = self.b.ln();
        self.cand.clear();
        let (sum, cand_from) = if self.paper {
            (st.sum, f64::INFINITY)
        } else {
            reference_sum(x, &st, &p, tau, ln_b, &mut self.cand)
        };
        out.extend_from_slice(&sum.to_le_bytes());
        out.extend_from_slice(&self.b.to_le_bytes());
        out.push(self.tau as u8);
        out.push(self.l as u8);
        let m_pos = out.len();
        out.push(0);
        let d_pos = out.len();
        out.extend_from_slice(&0u64.to_le_bytes());

        // Algorithm 1, lines 2-10, with the keys of Algorithm 2, lines 1-6.
        let tau_e = sum * p[tau];
        self.deltas.clear();
        let mut prev = 0usize;
        let mut max_delta = 0u64;
        let lv = Levels::new(sum, &p, tau, ln_b);
        let mut keep = |i: usize, v: f32| {
            let a = v.abs() as f64;
            if v == 0.0 || a < tau_e {
                return;
            }
            let lev = lv.of(a);
            let sign = if v < 0.0 { 0x80u8 } else { 0 };
            out.push(sign | (lev.max(1) - 1) as u8);
            let delta = (i - prev) as u64;
            max_delta = max_delta.max(delta);
            self.deltas.push(delta);
            prev = i;
        };
        if tau_e >= cand_from {
            // Everything kept is among the candidates reference_sum
            // collected (all |x_i| ≥ cand_from, in index order).
            for &(i, v) in &self.cand {
                keep(i as usize, v);
            }
        } else {
            // Chunks of 16 with nothing to keep are skipped branch-free.
            const L: usize = 16;
            let t = f32_at_least(tau_e).max(f32::from_bits(1));
            for (ci, c) in x.chunks(L).enumerate() {
                if c.iter().fold(false, |h, v| h | (v.abs() >= t)) {
                    for (j, &v) in c.iter().enumerate() {
                        keep(ci * L + j, v);
                    }
                }
            }
        }
        let d = self.deltas.len() as u64;
        let m = bit_len(max_delta);
        out[m_pos] = m as u8;
        out[d_pos..d_pos + 8].copy_from_slice(&d.to_le_bytes());

        // Algorithm 2, lines 7-11.
        let w = widths(m, self.l);
        out.reserve((self.deltas.len() * (self.l + m) as usize).div_ceil(8));
        let mut bw = BitWriter::new(out);
        for &delta in &self.deltas {
            write_delta(&mut bw, delta, self.l, &w);
        }
        bw.finish();
        Ok(())
    }

    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        let mut r = check_header(bytes, CodecId::FastSgd, acc.len())?;
        let n = acc.len();
        let sum = f64::from_le_bytes(r.bytes(8)?.try_into().expect("8 bytes"));
        if !(sum.is_finite() && sum.is_sign_positive()) {
            return Err(bad(format!("sum {sum} is not finite and >= 0")));
        }
        let b = f64::from_le_bytes(r.bytes(8)?.try_into().expect("8 bytes"));
        if !(b.is_finite() && b > 1.0) {
            return Err(bad(format!("base {b} is not finite and > 1")));
        }
        let tau = r.u8()? as u32;
        if tau > MAX_TAU {
            return Err(bad(format!("threshold {tau} exceeds {MAX_TAU}")));
        }
        let l = r.u8()? as u32;
        if l == 0 || l > MAX_L {
            return Err(bad(format!("length flag size {l} not in 1..={MAX_L}")));
        }
        let m = r.u8()? as u32;
        if m > 64 {
            return Err(bad(format!("delta bit length {m} exceeds 64")));
        }
        let d = r.u64()?;
        let d = usize::try_from(d)
            .ok()
            .filter(|&d| d <= n)
            .ok_or_else(|| bad(format!("{d} kept elements for {n} elements")))?;
        if d == 0 && m != 0 {
            return Err(bad("no kept elements but nonzero delta bit length"));
        }
        if d > 0 && sum == 0.0 {
            return Err(bad("kept elements with sum 0"));
        }
        let vals = r.bytes(d)?;
        let bits = r.rest();

        // Pass 1: validate everything before touching `acc`.
        let p = inv_powers(b);
        let mut dv = [0f32; TABLE];
        for (v, &pk) in dv.iter_mut().zip(&p) {
            *v = (sum * pk) as f32;
        }
        let lmax = tau.max(1) as usize;
        for &c in vals {
            let lev = (c & 0x7f) as usize + 1;
            if lev > lmax {
                return Err(bad(format!("level {lev} exceeds threshold {tau}")));
            }
            if !dv[lev].is_finite() {
                return Err(bad(format!("level {lev} decodes to a non-finite value")));
            }
        }
        let w = widths(m, l);
        let mut br = BitReader::new(bits);
        let mut key = 0u64;
        let mut max_delta = 0u64;
        for j in 0..d {
            let delta = read_delta(&mut br, l, &w)?;
            if j > 0 && delta == 0 {
                return Err(bad("keys are not strictly increasing"));
            }
            key = key
                .checked_add(delta)
                .filter(|&k| k < n as u64)
                .ok_or_else(|| bad(format!("key out of range for {n} elements")))?;
            max_delta = max_delta.max(delta);
        }
        if bit_len(max_delta) != m {
            return Err(bad(format!(
                "delta bit length {m} does not match the largest delta {max_delta}"
            )));
        }
        br.finish()?;

        // Pass 2: write.
        let mut br = BitReader::new(bits);
        let mut key = 0usize;
        for &c in vals {
            key += read_delta(&mut br, l, &w)? as usize;
            let v = dv[(c & 0x7f) as usize + 1];
            let a = acc.get_mut(key).ok_or_else(|| bad("key out of range"))?;
            *a += if c & 0x80 != 0 { -v } else { v };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
