//! Golomb-Rice coding of position gaps (SBC §II "Optimal Position Encoding",
//! eq. 5, derived from the paper's model: geometric gaps, a Golomb divisor
//! that is a power of two), with an MSB-first bit writer and a bounds-checked
//! bit reader.
//!
//! A gap `g ≥ 1` is coded with divisor `2^b`: the quotient `(g − 1) >> b` in
//! unary (that many `1` bits, then one `0`), then the `b` low bits of `g − 1`,
//! most significant first. A gap therefore costs `((g − 1) >> b) + 1 + b` bits.
//!
//! Under the paper's model (positions independent with probability `p`, so
//! gaps are geometric) the expected cost is `b + 1 / (1 − (1 − p)^(2^b))` bits
//! ([`expected_bits_per_position`]), minimised by
//! `b* = 1 + floor(log2(ln(φ − 1) / ln(1 − p)))` ([`optimal_rice_parameter`]):
//! `b* = 6` and ≈ 8.11 bits per position at `p = 0.01`.
//!
//! Bits are packed MSB-first into bytes; the last byte is padded with **one**
//! bits. One-padding makes the stream unambiguous: a code cannot be read out
//! of the padding (it would be an unterminated unary run), so a reader that
//! expects more codes than were written always fails. The reader never reads
//! past its slice and bounds every unary run by the bits that remain, so
//! hostile input costs at most one pass over the bytes.

use crate::{Error, Result};

/// Largest Rice parameter accepted on the wire (remainders are read as u32).
pub(crate) const MAX_RICE_PARAMETER: u8 = 31;

/// The paper's optimal Rice parameter for position density `p`:
/// `1 + floor(log2(ln(φ − 1) / ln(1 − p)))`, clamped to `0..=31`.
///
/// `p` outside `(0, 1)` (or NaN) gives the clamp ends: `31` for `p ≤ 0`,
/// `0` for `p ≥ 1`.
pub(crate) fn optimal_rice_parameter(p: f64) -> u8 {
    if p.is_nan() || p >= 1.0 {
        return 0;
    }
    if p <= 0.0 {
        return MAX_RICE_PARAMETER;
    }
    let phi = (1.0 + 5f64.sqrt()) / 2.0;
    // ln(1 − p) via ln_1p for accuracy at small p.
    let b = 1.0 + ((phi - 1.0).ln() / (-p).ln_1p()).log2().floor();
    b.clamp(0.0, MAX_RICE_PARAMETER as f64) as u8
}

/// Expected bits per position for geometric gaps of success probability `p`
/// coded with Rice parameter `b`: `b + 1 / (1 − (1 − p)^(2^b))`.
pub(crate) fn expected_bits_per_position(p: f64, b: u8) -> f64 {
    let r = ((2f64).powi(b as i32) * (-p).ln_1p()).exp();
    b as f64 + 1.0 / (1.0 - r)
}

/// Bits one gap costs with Rice parameter `b`: `((g − 1) >> b) + 1 + b`.
#[cfg(test)]
pub(crate) fn gap_bits(gap: u64, b: u8) -> u64 {
    ((gap - 1) >> b) + 1 + b as u64
}

/// MSB-first bit packer appending to a byte vector.
pub(crate) struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    /// Pending bits, right-aligned (at most 7 between calls).
    acc: u64,
    nbits: u32,
}

impl<'a> BitWriter<'a> {
    /// A writer appending to `out`.
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter {
            out,
            acc: 0,
            nbits: 0,
        }
    }

    /// Append the low `nb` bits of `value` (`nb ≤ 32`), MSB first.
    #[inline]
    pub(crate) fn write_bits(&mut self, value: u32, nb: u32) {
        debug_assert!(nb <= 32);
        if nb == 0 {
            return;
        }
        let v = u64::from(value) & ((1u64 << nb) - 1);
        self.acc = (self.acc << nb) | v;
        self.nbits += nb;
        while self.nbits >= 8 {
            self.nbits -= 8;
            self.out.push((self.acc >> self.nbits) as u8);
        }
        self.acc &= (1u64 << self.nbits) - 1;
    }

    /// Append `q` one bits and a terminating zero.
    #[inline]
    pub(crate) fn write_unary(&mut self, mut q: u64) {
        while q >= 32 {
            self.write_bits(u32::MAX, 32);
            q -= 32;
        }
        // q ones followed by a zero: (2^q − 1) << 1 in q + 1 bits.
        self.write_bits(((1u32 << q) - 1) << 1, q as u32 + 1);
    }

    /// Append one Rice code of `gap ≥ 1` with parameter `b ≤ 31`.
    #[inline]
    pub(crate) fn write_rice(&mut self, gap: u64, b: u8) {
        debug_assert!(gap >= 1 && b <= MAX_RICE_PARAMETER);
        let v = gap - 1;
        self.write_unary(v >> b);
        self.write_bits((v & ((1u64 << b) - 1)) as u32, u32::from(b));
    }

    /// Flush the last partial byte, padded with one bits.
    pub(crate) fn finish(self) {
        if self.nbits > 0 {
            let pad = 8 - self.nbits;
            self.out
                .push(((self.acc << pad) | ((1u64 << pad) - 1)) as u8);
        }
    }
}

/// Bounds-checked MSB-first bit reader.
pub(crate) struct BitReader<'a> {
    data: &'a [u8],
    /// Next bit to read, counted from the start of `data`.
    pos: usize,
    total: usize,
}

impl<'a> BitReader<'a> {
    /// A reader over `data`.
    pub(crate) fn new(data: &'a [u8]) -> Result<Self> {
        let total = data
            .len()
            .checked_mul(8)
            .ok_or_else(|| Error::Decode("bit stream too long".into()))?;
        Ok(BitReader {
            data,
            pos: 0,
            total,
        })
    }

    /// Bits consumed so far.
    #[cfg(test)]
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// Bits left.
    pub(crate) fn remaining(&self) -> usize {
        self.total - self.pos
    }

    /// The 64 bits starting at the current position, left-aligned; bits past
    /// the end of the data read as zero. At least `min(57, remaining)` of them
    /// are real data.
    #[inline]
    fn peek64(&self) -> u64 {
        let byte = self.pos / 8;
        let mut w = [0u8; 8];
        if let Some(s) = self.data.get(byte..) {
            let m = s.len().min(8);
            w[..m].copy_from_slice(&s[..m]);
        }
        u64::from_be_bytes(w) << (self.pos % 8)
    }

    fn truncated(&self) -> Error {
        Error::Decode(format!(
            "truncated Golomb-Rice stream at bit {} of {}",
            self.pos, self.total
        ))
    }

    /// Read `nb ≤ 32` bits as an unsigned number.
    #[inline]
    pub(crate) fn read_bits(&mut self, nb: u32) -> Result<u32> {
        debug_assert!(nb <= 32);
        if nb == 0 {
            return Ok(0);
        }
        if nb as usize > self.remaining() {
            return Err(self.truncated());
        }
        let v = (self.peek64() >> (64 - nb)) as u32;
        self.pos += nb as usize;
        Ok(v)
    }

    /// Read a unary number (ones up to a zero, the zero consumed). Fails when
    /// the stream ends before the zero, or when the count exceeds `limit`
    /// (checked per 57-bit window, so the work is bounded by
    /// `min(limit + 57, remaining bits)`).
    #[inline]
    pub(crate) fn read_unary(&mut self, limit: u64) -> Result<u64> {
        let mut q = 0u64;
        loop {
            let avail = self.remaining().min(57);
            if avail == 0 {
                return Err(self.truncated());
            }
            let ones = self.peek64().leading_ones() as usize;
            if ones < avail {
                q += ones as u64;
                self.pos += ones + 1;
                break;
            }
            q += avail as u64;
            self.pos += avail;
            if q > limit {
                break;
            }
        }
        if q > limit {
            return Err(Error::Decode(format!(
                "Golomb-Rice quotient {q} exceeds its bound {limit}"
            )));
        }
        Ok(q)
    }

    /// After the last code: the padding must be shorter than a byte and all ones.
    pub(crate) fn finish(&self) -> Result<()> {
        let rem = self.remaining();
        if rem >= 8 {
            return Err(Error::Decode(format!(
                "{} trailing bytes after the Golomb-Rice stream",
                rem / 8
            )));
        }
        if rem > 0 && (self.peek64() >> (64 - rem)).count_ones() as usize != rem {
            return Err(Error::Decode("padding bits are not all ones".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_gaps(bytes: &[u8], b: u8, count: usize) -> Result<Vec<u64>> {
        let mut r = BitReader::new(bytes)?;
        let mut gaps = Vec::new();
        for _ in 0..count {
            let q = r.read_unary(u64::MAX >> 32)?;
            let rem = r.read_bits(u32::from(b))?;
            gaps.push((q << b) + u64::from(rem) + 1);
        }
        r.finish()?;
        Ok(gaps)
    }

    #[test]
    fn rice_round_trip_known_gaps_exact_bit_count() {
        let gaps = [1u64, 2, 3, 64, 65, 1000];
        let b = 6;
        let mut out = Vec::new();
        let mut w = BitWriter::new(&mut out);
        for &g in &gaps {
            w.write_rice(g, b);
        }
        w.finish();
        // (0+7) + (0+7) + (0+7) + (0+7) + (1+7) + (15+7) = 58 bits.
        let bits: u64 = gaps.iter().map(|&g| ((g - 1) >> b) + 1 + b as u64).sum();
        assert_eq!(bits, 58);
        assert_eq!(gaps.iter().map(|&g| gap_bits(g, b)).sum::<u64>(), bits);
        assert_eq!(out.len() as u64, bits.div_ceil(8));
        // Bit string, by hand: 0000000 0000001 0000010 0111111 10000000
        // 111111111111111 0 100111, then six padding ones.
        assert_eq!(out, [0x00, 0x04, 0x13, 0xf8, 0x0f, 0xff, 0xe9, 0xff]);
        assert_eq!(decode_gaps(&out, b, gaps.len()).expect("test"), gaps);
        // One code fewer leaves a trailing byte; one more is truncated.
        assert!(decode_gaps(&out, b, gaps.len() - 1).is_err());
        assert!(decode_gaps(&out, b, gaps.len() + 1).is_err());
    }

    #[test]
    fn optimal_parameter_matches_the_paper() {
        assert_eq!(optimal_rice_parameter(0.01), 6);
        let e = expected_bits_per_position(0.01, 6);
        assert!((e - 8.108).abs() < 0.01, "{e}");
        // b* minimises the expected cost among all b.
        for p in [0.5, 0.2, 0.1, 0.03, 0.01, 0.001, 1e-4, 1e-6] {
            let bs = optimal_rice_parameter(p);
            let best = (0..=31u8)
                .map(|b| expected_bits_per_position(p, b))
                .fold(f64::INFINITY, f64::min);
            assert!(
                expected_bits_per_position(p, bs) <= best + 1e-9,
                "p={p} b*={bs}"
            );
        }
        assert_eq!(optimal_rice_parameter(0.5), 0);
        assert_eq!(optimal_rice_parameter(1e-300), 31);
        assert_eq!(optimal_rice_parameter(0.0), 31);
        assert_eq!(optimal_rice_parameter(f64::NAN), 0);
    }

    #[test]
    fn measured_bits_per_position_at_density_001() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5bc);
        let n = 2_000_000usize;
        let positions: Vec<u64> = (0..n as u64).filter(|_| rng.gen_bool(0.01)).collect();
        let b = optimal_rice_parameter(0.01);
        let mut out = Vec::new();
        let mut w = BitWriter::new(&mut out);
        let mut prev = 0u64;
        for &p in &positions {
            w.write_rice(p + 1 - prev, b);
            prev = p + 1;
        }
        w.finish();
        let per = out.len() as f64 * 8.0 / positions.len() as f64;
        assert!((7.5..=9.0).contains(&per), "{per} bits/position");
        assert!((per - expected_bits_per_position(0.01, b)).abs() < 0.1);
    }

    #[test]
    fn unary_runs_are_bounded() {
        let ones = vec![0xffu8; 1000];
        let mut r = BitReader::new(&ones).expect("test");
        assert!(r.read_unary(u64::MAX).is_err());
        let mut r = BitReader::new(&ones).expect("test");
        assert!(r.read_unary(100).is_err());
        assert!(r.position() < 200);
        let mut r = BitReader::new(&[]).expect("test");
        assert!(r.read_unary(5).is_err());
        assert!(r.read_bits(1).is_err());
        assert_eq!(r.read_bits(0).expect("test"), 0);
        // Padding that is not all ones is rejected.
        let mut r = BitReader::new(&[0b0100_0000]).expect("test");
        assert_eq!(r.read_unary(10).expect("test"), 0);
        assert!(r.finish().is_err());
    }

    proptest! {
        #[test]
        fn prop_rice_round_trip(gaps in proptest::collection::vec(1u64..100_000, 0..200), b in 0u8..=31) {
            let mut out = Vec::new();
            let mut w = BitWriter::new(&mut out);
            for &g in &gaps {
                w.write_rice(g, b);
            }
            w.finish();
            let bits: u64 = gaps.iter().map(|&g| gap_bits(g, b)).sum();
            prop_assert_eq!(out.len() as u64, bits.div_ceil(8));
            prop_assert_eq!(decode_gaps(&out, b, gaps.len()).expect("test"), gaps);
        }

        #[test]
        fn prop_bits_round_trip(vals in proptest::collection::vec((any::<u32>(), 0u32..=32), 0..100)) {
            let mut out = Vec::new();
            let mut w = BitWriter::new(&mut out);
            for &(v, nb) in &vals {
                w.write_bits(v, nb);
            }
            w.finish();
            let mut r = BitReader::new(&out).expect("test");
            for &(v, nb) in &vals {
                let want = if nb == 32 { v } else { v & ((1u32 << nb) - 1) };
                prop_assert_eq!(r.read_bits(nb).expect("test"), want);
            }
            prop_assert!(r.finish().is_ok());
        }
    }
}
