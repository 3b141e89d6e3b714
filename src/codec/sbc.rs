//! Sparse Binary Compression (Sattler et al., "Sparse Binary Compression:
//! Towards Distributed Deep Learning with minimal Communication"): §II
//! "Sparse Binarization" (Algorithm 2) and "Optimal Position Encoding"
//! (Golomb position coding, eq. 5, derived from the paper's model: geometric
//! gaps, a Golomb divisor that is a power of two; see "Position coding").
//! Communication delay and residual accumulation are not part of the codec:
//! run it under [`ErrorFeedback`](super::ErrorFeedback) for the latter.
//!
//! # Sparse binarization
//!
//! For a tensor `x` of `n` elements and density `p ∈ (0, 0.5]`:
//!
//! 1. `k = max(1, round(p·n))` (round half away from zero, `f64::round`;
//!    `k ≤ n` always holds since `p ≤ 0.5`). Nothing is kept when `n = 0`.
//! 2. `T` = the `k` largest elements, `B` = the `k` smallest (order
//!    [`f32::total_cmp`]; equal values at the `k`-th boundary are taken lowest
//!    index first, so the choice is deterministic). `T` and `B` may overlap
//!    when `2k > n`.
//! 3. `P` = the strictly positive elements of `T`, `N` = the strictly negative
//!    elements of `B`; `μ+ = mean(P)`, `μ− = mean(N)` (sums in f64, rounded to
//!    f32), the mean of an empty set being `0`.
//! 4. If `μ+ ≥ |μ−|` (compared as the f32 values sent; a **tie goes to the
//!    positive set**, as in the paper's Algorithm 2) the message carries the
//!    positions of `P` and the value `μ+`, otherwise those of `N` and `μ−`.
//!    An empty or all-zero tensor (or one with `P` and `N` empty) sends the
//!    empty set with mean `0`.
//!
//! Decoding sets every sent position to the one mean and leaves all others
//! at zero. The paper's prose says "keep the fraction p biggest and smallest,
//! then the mean of the remaining positives/negatives"; step 3 reads the
//! positives from the `k` largest and the negatives from the `k` smallest,
//! which is what Algorithm 2 computes and agrees with the prose except when a
//! side holds fewer than `k` elements of its sign (then the prose would also
//! count, e.g., the smallest positives as "remaining positives"; we do not:
//! they are the least important values, not the most).
//!
//! Selection is exact and `O(n)`: a threshold per sign estimated on a strided
//! sample, one filter pass over `x` for both signs (which also checks every
//! element is finite), and a quickselect among the few candidates
//! (`crate::select`'s signed top-k; before, two quickselects on a full copy
//! of `x`). Inputs with NaN/Inf are rejected with
//! [`Error::InvalidArgument`](crate::Error::InvalidArgument), as are tensors
//! of more than 2^32 elements (positions are selected as u32).
//!
//! # Position coding
//!
//! The sent positions, ascending, become gaps `g₀ = pos₀ + 1`,
//! `gᵢ = posᵢ − posᵢ₋₁` (all `≥ 1`), each Golomb-Rice coded with divisor
//! `2^b`: the quotient `(g − 1) >> b` in unary (ones, then a zero), then the
//! `b` low bits of `g − 1`, MSB-first (see `golomb.rs`).
//! `b = b*(p) = 1 + floor(log2(ln(φ − 1) / ln(1 − p)))` (φ the golden ratio),
//! clamped to `0..=31`: `b = 6` and ≈ 8.1 bits per position at `p = 0.01`.
//! Worst case the stream holds `count·(b + 1) + n / 2^b` bits, so it never
//! exceeds about one bit per element plus `b + 1` bits per position.
//!
//! # Wire format
//!
//! | bytes | field |
//! |---|---|
//! | 0..12 | common header (codec id [`CodecId::Sbc`], element count `n`) |
//! | 12 | Rice parameter `b`, u8, `0..=31` |
//! | 13..21 | number of positions `count`, u64 LE, `≤ n` |
//! | 21..25 | the mean, f32 LE, finite (`0` for the empty set) |
//! | 25.. | `count` Rice codes, MSB-first, padded to a byte with one bits |
//!
//! The decoder validates everything before touching the accumulator: `b`,
//! `count ≤ n`, a finite mean, every position `< n` (strictly increasing by
//! construction), unary runs bounded by the bits left, no bytes after the last
//! code's byte and padding bits all ones (so a stream read with a larger
//! `count` than was written always fails: the extra code would begin in the
//! padding and never terminate its unary run).
//!
//! # Error bound
//!
//! None per element (it is top-k sparsification plus binarization): unsent
//! elements decode to `0`, sent ones to the mean of their set. The decoded
//! vector is exactly the binarized vector defined above; its accuracy comes
//! from error feedback.
//!
//! # Error feedback
//!
//! Contractive, so full error feedback is bounded (see `feedback.rs`): the
//! sent set `S` carries its own mean `μ`, so
//! `‖x − C(x)‖² = ‖x‖² − |S|μ²`, and `S` is non-empty with `μ ≠ 0` for any
//! nonzero `x`.

use super::golomb::{
    expected_bits_per_position, optimal_rice_parameter, BitReader, BitWriter, MAX_RICE_PARAMETER,
};
use super::{check_finite, check_header, write_header, Codec, CodecConfig, CodecId};
use crate::select::signed_topk;
use crate::{Error, Result};

/// Sparse binary compression with Golomb-Rice position coding.
///
/// Sends the positions of the `k = max(1, round(p·n))` largest values (if
/// their positive mean `μ+` is at least `|μ−|`, the negative mean of the `k`
/// smallest) or of the `k` smallest, plus that one mean; positions are
/// Golomb-Rice coded with the paper's optimal `b*(p)` (6 at `p = 0.01`, about
/// 8.1 bits per position). Message: common header, `b` (u8), position count
/// (u64), mean (f32), bit stream. No per-element error bound: run it under
/// [`ErrorFeedback`](super::ErrorFeedback).
#[derive(Clone, Debug)]
pub struct Sbc {
    p: f64,
    b: u8,
    /// Positions and values of the positive and negative sets.
    pos_set: Vec<u32>,
    pos_val: Vec<f32>,
    neg_set: Vec<u32>,
    neg_val: Vec<f32>,
}

impl Sbc {
    /// SBC at density `p ∈ (0, 0.5]`.
    pub fn new(p: f64) -> Result<Self> {
        if !(p > 0.0 && p <= 0.5) {
            return Err(Error::InvalidArgument(format!(
                "sbc: p = {p} must lie in (0, 0.5]"
            )));
        }
        Ok(Sbc {
            p,
            b: optimal_rice_parameter(p),
            pos_set: Vec::new(),
            pos_val: Vec::new(),
            neg_set: Vec::new(),
            neg_val: Vec::new(),
        })
    }

    /// The density `p`.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// The Rice parameter `b*(p)` this encoder writes.
    pub fn rice_parameter(&self) -> u8 {
        self.b
    }

    /// Eq. 5: expected position bits per sent element when the sent positions
    /// are spread at random with density `p`, `b + 1 / (1 − (1 − p)^(2^b))`
    /// (≈ 8.11 at `p = 0.01`).
    pub fn expected_bits_per_position(&self) -> f64 {
        expected_bits_per_position(self.p, self.b)
    }

    /// `k = max(1, round(p·n))` for `n > 0`, `0` for `n = 0`.
    pub fn k_for(&self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((self.p * n as f64).round() as usize).clamp(1, n)
    }

    /// Sparse binarization of `x`: fills the chosen positions (ascending)
    /// into `self.pos_set` and returns the mean; NaN/Inf inputs are
    /// rejected (checked in the selection's own pass).
    ///
    /// `P` (the positive members of the `k` largest) is exactly the top
    /// `min(k, #{x_i > 0})` positive values, ties lowest index first, and
    /// `N` likewise on the negative side, so both come from
    /// `crate::select`'s exact signed top-k (a sampled threshold, one filter
    /// pass for both sides, quickselect among the candidates).
    fn binarize(&mut self, x: &[f32]) -> Result<f32> {
        let n = x.len();
        let k = self.k_for(n);
        let finite = signed_topk(
            x,
            k,
            Some((&mut self.pos_set, &mut self.pos_val)),
            Some((&mut self.neg_set, &mut self.neg_val)),
        )?;
        if !finite {
            check_finite(x)?;
        }
        // Sums in f64, in index order.
        let mean = |v: &[f32]| {
            if v.is_empty() {
                0.0
            } else {
                (v.iter().map(|&v| f64::from(v)).sum::<f64>() / v.len() as f64) as f32
            }
        };
        let mu_p = mean(&self.pos_val);
        let mu_n = mean(&self.neg_val);
        Ok(if mu_p >= mu_n.abs() {
            mu_p
        } else {
            std::mem::swap(&mut self.pos_set, &mut self.neg_set);
            mu_n
        })
    }

    /// The binarized vector the codec transmits for `x` (what decoding
    /// reproduces exactly).
    pub fn binarized(&mut self, x: &[f32]) -> Result<Vec<f32>> {
        let mean = self.binarize(x)?;
        let mut y = vec![0f32; x.len()];
        for &i in &self.pos_set {
            y[i as usize] = mean;
        }
        Ok(y)
    }
}

/// Walk the Rice codes of `count` positions of an `n`-element tensor, calling
/// `f` on each; validates everything (positions `< n`, stream fully used).
fn walk_positions(
    payload: &[u8],
    b: u8,
    count: usize,
    n: usize,
    mut f: impl FnMut(usize),
) -> Result<()> {
    let mut r = BitReader::new(payload)?;
    // Every code takes at least b + 1 bits: reject absurd counts up front.
    if count
        .checked_mul(usize::from(b) + 1)
        .is_none_or(|bits| bits > r.remaining())
    {
        return Err(Error::Decode(format!(
            "{count} positions cannot fit in {} payload bytes",
            payload.len()
        )));
    }
    // Offsets (gap − 1) are ≤ n − 1, so quotients are ≤ (n − 1) >> b.
    let qmax = (n.saturating_sub(1) >> b) as u64;
    let mut base = 0usize; // previous position + 1
    for _ in 0..count {
        let q = r.read_unary(qmax)?;
        let rem = r.read_bits(u32::from(b))?;
        let off = usize::try_from(q)
            .ok()
            .and_then(|q| q.checked_shl(u32::from(b)))
            .and_then(|o| o.checked_add(rem as usize));
        let pos = off.and_then(|o| base.checked_add(o));
        match pos {
            Some(p) if p < n => {
                f(p);
                base = p + 1;
            }
            _ => {
                return Err(Error::Decode(format!(
                    "position past the end of a {n}-element tensor"
                )))
            }
        }
    }
    r.finish()
}

impl Codec for Sbc {
    fn id(&self) -> CodecId {
        CodecId::Sbc
    }

    fn config(&self) -> CodecConfig {
        CodecConfig::Sbc { p: self.p }
    }

    fn set_density(&mut self, density: f64) -> Result<()> {
        *self = Sbc::new(density)?;
        Ok(())
    }
    fn encode(&mut self, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
        let mean = self.binarize(x)?;
        write_header(out, CodecId::Sbc, x.len());
        let b = self.b;
        out.push(b);
        out.extend_from_slice(&(self.pos_set.len() as u64).to_le_bytes());
        out.extend_from_slice(&mean.to_le_bytes());
        let est_bits = self.pos_set.len() * (usize::from(b) + 2) + (x.len() >> b);
        out.reserve(est_bits / 8 + 8);
        let mut w = BitWriter::new(out);
        let mut base = 0usize;
        for &p in &self.pos_set {
            let p = p as usize;
            w.write_rice((p + 1 - base) as u64, b);
            base = p + 1;
        }
        w.finish();
        Ok(())
    }

    fn decode_add(&self, bytes: &[u8], acc: &mut [f32]) -> Result<()> {
        self.for_each_sent(bytes, acc.len(), &mut |i, v| acc[i] += v)
            .map(|_| ())
    }
    fn for_each_sent(&self, bytes: &[u8], n: usize, f: &mut dyn FnMut(usize, f32)) -> Result<bool> {
        let mut r = check_header(bytes, CodecId::Sbc, n)?;
        let b = r.u8()?;
        if b > MAX_RICE_PARAMETER {
            return Err(Error::Decode(format!(
                "Rice parameter {b} exceeds {MAX_RICE_PARAMETER}"
            )));
        }
        let count = r.u64()?;
        let count = usize::try_from(count)
            .ok()
            .filter(|&c| c <= n)
            .ok_or_else(|| Error::Decode(format!("{count} positions in a {n}-element tensor")))?;
        let mean = r.finite_f32()?;
        let payload = r.rest();
        // Validate the whole stream first, then apply it.
        walk_positions(payload, b, count, n, |_| {})?;
        walk_positions(payload, b, count, n, |p| f(p, mean))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::needless_range_loop)]
    use super::*;
    use proptest::prelude::*;

    fn round_trip(c: &mut Sbc, x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut m = Vec::new();
        c.encode(x, &mut m).expect("test");
        let mut y = vec![3.0; x.len()];
        c.decode(&m, &mut y).expect("test");
        (m, y)
    }

    /// Reference binarization by full sort (stable: ties by index).
    fn reference(x: &[f32], p: f64) -> Vec<f32> {
        let n = x.len();
        let mut y = vec![0f32; n];
        if n == 0 {
            return y;
        }
        let k = ((p * n as f64).round() as usize).clamp(1, n);
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        let top: Vec<usize> = idx[..k].iter().copied().filter(|&i| x[i] > 0.0).collect();
        idx.sort_by(|&a, &b| x[a].total_cmp(&x[b]).then(a.cmp(&b)));
        let bot: Vec<usize> = idx[..k].iter().copied().filter(|&i| x[i] < 0.0).collect();
        let mean = |s: &[usize]| {
            if s.is_empty() {
                0f32
            } else {
                (s.iter().map(|&i| f64::from(x[i])).sum::<f64>() / s.len() as f64) as f32
            }
        };
        let (mp, mn) = (mean(&top), mean(&bot));
        let (set, m) = if mp >= mn.abs() { (top, mp) } else { (bot, mn) };
        for i in set {
            y[i] = m;
        }
        y
    }

    /// Above the selection's sampling size (the sampled path), the message
    /// still decodes to exactly the sort-based binarization.
    #[test]
    fn large_tensors_match_the_reference() {
        let n = (1 << 17) + 999;
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let lap: Vec<f32> = (0..n)
            .map(|_| next() * (next().abs() + 1e-7).ln())
            .collect();
        let skew: Vec<f32> = lap.iter().map(|v| v + 0.2).collect();
        let coarse: Vec<f32> = lap.iter().map(|v| (v * 8.0).round()).collect();
        for x in [&lap, &skew, &coarse] {
            for p in [0.001, 0.01, 0.1] {
                let mut c = Sbc::new(p).expect("test");
                assert_eq!(round_trip(&mut c, x).1, reference(x, p), "p = {p}");
            }
        }
    }

    #[test]
    fn positive_mean_wins() {
        // n = 10, p = 0.2 → k = 2. Top 2: 5, 3 → μ+ = 4. Bottom 2: −4, −1 → μ− = −2.5.
        let x = [0.5, 5.0, -1.0, 0.0, 3.0, -4.0, 0.25, 1.0, -0.5, 2.0];
        let mut c = Sbc::new(0.2).expect("test");
        let (m, y) = round_trip(&mut c, &x);
        assert_eq!(y, [0.0, 4.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(m[12], c.rice_parameter());
        assert_eq!(u64::from_le_bytes(m[13..21].try_into().expect("test")), 2);
        assert_eq!(f32::from_le_bytes(m[21..25].try_into().expect("test")), 4.0);
    }

    #[test]
    fn negative_mean_wins() {
        // k = 2. Top 2: 3, 1 → μ+ = 2. Bottom 2: −6, −3 → μ− = −4.5.
        let x = [1.0, -6.0, 0.5, 3.0, -3.0, -1.0, 0.0, 0.0, 0.2, -0.2];
        let mut c = Sbc::new(0.2).expect("test");
        let (_, y) = round_trip(&mut c, &x);
        assert_eq!(y, [0.0, -4.5, 0.0, 0.0, -4.5, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn ties_and_edge_cases() {
        let mut c = Sbc::new(0.5).expect("test");
        // μ+ = |μ−|: the positive set wins.
        assert_eq!(round_trip(&mut c, &[-1.0, 1.0]).1, [0.0, 1.0]);
        // Only the strictly positive members of the top k count (k = 2 here:
        // top {2, 0} → P = {2}; bottom {−1, 0} → N = {−1}).
        assert_eq!(
            round_trip(&mut c, &[0.0, 2.0, -1.0, 0.0]).1,
            [0.0, 2.0, 0.0, 0.0]
        );
        // Ties at the k-th value: lowest index first (k = 1).
        let mut c1 = Sbc::new(0.01).expect("test");
        assert_eq!(
            round_trip(&mut c1, &[1.0, 3.0, 3.0, -2.0]).1,
            [0.0, 3.0, 0.0, 0.0]
        );
        // All positive: only the top k, never the smallest positives.
        let mut c2 = Sbc::new(0.25).expect("test");
        assert_eq!(
            round_trip(&mut c2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).1,
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.5, 7.5]
        );
        // Empty and all-zero tensors send the empty set with mean 0.
        for x in [vec![], vec![0.0; 9], vec![-0.0; 3]] {
            let (m, y) = round_trip(&mut c, &x);
            assert_eq!(m.len(), 25);
            assert_eq!(&m[13..25], &[0u8; 12]);
            assert!(y.iter().all(|&v| v == 0.0));
        }
        // One element: k = 1.
        assert_eq!(round_trip(&mut c1, &[-2.5]).1, [-2.5]);
        assert_eq!(c1.k_for(0), 0);
        assert_eq!(c1.k_for(149), 1);
        assert_eq!(c1.k_for(150), 2); // round half away from zero
        assert_eq!(c1.k_for(1000), 10);
    }

    #[test]
    fn rejects_bad_p_and_nan() {
        for p in [0.0, -0.1, 0.5000001, 1.0, f64::NAN, f64::INFINITY] {
            assert!(CodecConfig::Sbc { p }.build().is_err(), "p={p}");
        }
        assert!(CodecConfig::Sbc { p: 0.5 }.build().is_ok());
        let mut c = Sbc::new(0.1).expect("test");
        let mut m = Vec::new();
        assert!(matches!(
            c.encode(&[1.0, f32::NAN], &mut m),
            Err(Error::InvalidArgument(_))
        ));
        assert!(c.encode(&[f32::INFINITY], &mut m).is_err());
    }

    #[test]
    fn config_parses() {
        let c: CodecConfig = "sbc".parse().expect("test");
        assert_eq!(c, CodecConfig::Sbc { p: 0.01 });
        assert_eq!(c.name(), "sbc");
        let c: CodecConfig = "sbc:p=0.05".parse().expect("test");
        assert_eq!(c, CodecConfig::Sbc { p: 0.05 });
        assert_eq!(c.build().expect("test").config(), c);
        let json = serde_json::to_string(&c).expect("test");
        assert_eq!(serde_json::from_str::<CodecConfig>(&json).expect("test"), c);
        assert!("sbc:q=1".parse::<CodecConfig>().is_err());
        assert!(CodecConfig::all_defaults().contains(&CodecConfig::Sbc { p: 0.01 }));
    }

    #[test]
    fn bits_per_position_near_eq5() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let n = 1_000_000;
        let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let mut c = Sbc::new(0.01).expect("test");
        assert_eq!(c.rice_parameter(), 6);
        assert!((c.expected_bits_per_position() - 8.108).abs() < 0.01);
        let (m, y) = round_trip(&mut c, &x);
        let count = u64::from_le_bytes(m[13..21].try_into().expect("test"));
        assert_eq!(count, 10_000);
        assert_eq!(y.iter().filter(|&&v| v != 0.0).count(), 10_000);
        let per = (m.len() - 25) as f64 * 8.0 / count as f64;
        assert!((7.5..=9.0).contains(&per), "{per} bits/position");
    }

    #[test]
    fn decoder_rejects_malformed_messages() {
        let x = [0.0, 5.0, 0.0, 4.0, -1.0, 0.0, 0.0, 0.0];
        let mut c = Sbc::new(0.25).expect("test");
        let (m, _) = round_trip(&mut c, &x);
        let mut out = vec![0f32; 8];
        let mut bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut mm = m.clone();
            f(&mut mm);
            assert!(c.decode(&mm, &mut out).is_err());
        };
        bad(&|m| m[12] = 32); // b out of range
        bad(&|m| m[13] = 9); // count > n
        bad(&|m| m[13] = 3); // one code short
        bad(&|m| m[13] = 1); // leftover bits
        bad(&|m| m[21..25].copy_from_slice(&f32::NAN.to_le_bytes()));
        bad(&|m| m.push(0)); // trailing byte
        bad(&|m| {
            m.pop();
        });
        bad(&|m| {
            let l = m.len();
            m[l - 1] &= !1; // padding bit
        });
        bad(&|m| {
            m.truncate(25);
            m.push(0xff); // unary run off the end
        });
        // A position past n: b = 0, one gap of 9 in an 8-element tensor.
        bad(&|m| {
            m.truncate(12);
            m.push(0);
            m.extend_from_slice(&1u64.to_le_bytes());
            m.extend_from_slice(&1f32.to_le_bytes());
            m.extend_from_slice(&[0xff, 0x00]);
        });
        // Nothing was written on failure.
        assert!(out.iter().all(|&v| v == 0.0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        #[test]
        fn prop_decodes_exactly_the_binarized_vector(
            x in proptest::collection::vec(prop_oneof![-1e3f32..1e3, Just(0.0f32), Just(1.5f32), Just(-1.5f32)], 0..3000),
            p in prop_oneof![Just(0.01), Just(0.5), 0.0001f64..0.5],
        ) {
            let mut c = Sbc::new(p).expect("test");
            let (m, y) = round_trip(&mut c, &x);
            let want = reference(&x, p);
            prop_assert_eq!(&y, &want);
            prop_assert_eq!(c.binarized(&x).expect("test"), want);
            // decode_add adds the same values.
            let mut acc = vec![1.0f32; x.len()];
            c.decode_add(&m, &mut acc).expect("test");
            for i in 0..x.len() {
                prop_assert_eq!(acc[i], 1.0 + y[i]);
            }
            // Size is exactly the Rice code lengths.
            let b = c.rice_parameter();
            let mut bits = 0u64;
            let mut base = 0u64;
            for (i, &v) in y.iter().enumerate() {
                if v != 0.0 {
                    bits += super::super::golomb::gap_bits(i as u64 + 1 - base, b);
                    base = i as u64 + 1;
                }
            }
            prop_assert_eq!((m.len() - 25) as u64, bits.div_ceil(8));
        }

        #[test]
        fn prop_hostile_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..64),
                                          n in 0usize..300, b in 0u8..40, count in 0u64..40) {
            let c = Sbc::new(0.01).expect("test");
            // Random payload behind a valid header and plausible parameters.
            let mut m = Vec::new();
            write_header(&mut m, CodecId::Sbc, n);
            m.push(b);
            m.extend_from_slice(&count.to_le_bytes());
            m.extend_from_slice(&1f32.to_le_bytes());
            m.extend_from_slice(&body);
            let mut out = vec![0f32; n];
            if c.decode(&m, &mut out).is_ok() {
                prop_assert!(out.iter().filter(|&&v| v != 0.0).count() as u64 == count);
            }
            // And fully random bytes.
            let _ = c.decode_add(&body, &mut out);
        }

        #[test]
        fn prop_mutated_messages_never_panic(x in proptest::collection::vec(-10f32..10.0, 0..500),
                                             flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
                                             cut in any::<usize>()) {
            let mut c = Sbc::new(0.05).expect("test");
            let (mut m, _) = round_trip(&mut c, &x);
            let cut = cut % (m.len() + 1);
            if cut < m.len() {
                prop_assert!(c.decode(&m[..cut], &mut vec![0f32; x.len()]).is_err());
            }
            for &(pos, b) in &flips {
                let l = m.len();
                m[pos % l] ^= b;
            }
            let mut out = vec![0f32; x.len()];
            let _ = c.decode(&m, &mut out);
            let _ = c.decode(&m[..cut], &mut out);
        }
    }
}
