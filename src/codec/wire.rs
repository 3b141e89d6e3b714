//! The size half of the codec contract: how many bytes a codec's message
//! for `n` elements takes, as the codec writes it (the 12-byte header
//! included). The cost model ([`crate::cost`]) prices messages with this,
//! never with its own copy of each format, and the tests below encode
//! every codec to hold each formula to the encoder's output.

use super::CodecConfig;

/// `k = max(1, ⌈d·n⌉)` (RGC's count, [`super::rgc_k`]; 0 for an empty layer).
fn rgc_k(n: usize, d: f64) -> f64 {
    super::rgc_k(d, n) as f64
}

/// `k = ⌈D·n⌉`: the expected number of elements a codec of density `D`
/// sends from `n` (no floor of one; the cost model's count).
pub fn sparse_k(n: usize, density: f64) -> f64 {
    (density * n as f64).ceil()
}

impl CodecConfig {
    /// Bytes of this codec's message for `n` elements: exact for the
    /// fixed-size formats (`none`, `fp16`, `int8`, `qsgd`, exact-method
    /// `rgc`, `rgc-quant`), the expected size where the count or the
    /// coding varies a little with the data (`rgc` with the trimmed
    /// selection: about `k`; the threshold and sampled selections may send
    /// more; `sbc`: Golomb–Rice positions of a uniform spread), `None` where the size is the data's (`3lc`, `fastsgd`:
    /// a profile measures it).
    pub fn wire_bytes(&self, n: usize) -> Option<f64> {
        let nf = n as f64;
        let h = super::HEADER_LEN as f64;
        Some(match self {
            CodecConfig::None => h + 4.0 * nf,
            // Header, the scale's exponent (i16), one f16 per element.
            CodecConfig::Fp16 => h + 2.0 + 2.0 * nf,
            // Header, the scale (f32), one i8 per element.
            CodecConfig::Int8 => h + 4.0 + nf,
            // Header, bits (u8), one f32 norm (bucketed: the bucket size
            // (u32) and one norm per bucket), packed codes.
            CodecConfig::Qsgd { bits, bucket, .. } => {
                let norms = if *bucket == 0 {
                    4.0
                } else {
                    4.0 + 4.0 * n.div_ceil(*bucket) as f64
                };
                h + 1.0 + norms + (nf * f64::from(*bits) / 8.0).ceil()
            }
            CodecConfig::Sbc { p } => {
                // Header, count (u32), mean (f32), flags and the Rice
                // parameter (5 bytes), then k positions of
                // b* + 1/(1 − (1 − p)^(2^b*)) bits each.
                let p = p.clamp(1e-12, 0.5);
                let b = crate::codec::Sbc::new(p).map_or(0, |s| s.rice_parameter());
                let bits = f64::from(b) + 1.0 / (1.0 - (1.0 - p).powf(2f64.powi(i32::from(b))));
                h + 13.0 + (sparse_k(n, p) * bits / 8.0).ceil()
            }
            // Header, count (u32), k indices (u32) and values (f32).
            CodecConfig::Rgc { density, .. } => h + 4.0 + 8.0 * rgc_k(n, *density),
            // Header, count (u32), mean (f32), sign/flags (u32), k indices.
            CodecConfig::RgcQuant { density } => h + 8.0 + 4.0 * rgc_k(n, *density),
            CodecConfig::ThreeLc { .. } | CodecConfig::Fastsgd { .. } => return None,
        })
    }

    /// The same configuration with its density parameter (`rgc`,
    /// `rgc-quant`: `density`; `sbc`: `p`) set to `d`; others unchanged.
    pub fn with_density(mut self, d: f64) -> Self {
        match &mut self {
            CodecConfig::Rgc { density, .. } | CodecConfig::RgcQuant { density } => *density = d,
            CodecConfig::Sbc { p } => *p = d,
            _ => {}
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::RgcMethod;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e-2
            })
            .collect()
    }

    /// Every fixed-size format's formula equals the encoder's output, for
    /// sizes around every block, group and bucket boundary.
    #[test]
    fn fixed_size_formats_match_the_encoders_exactly() {
        let cfgs: Vec<CodecConfig> = [
            "none",
            "fp16",
            "int8",
            "qsgd",
            "qsgd:bits=2",
            "qsgd:bits=8,bucket=512",
            "qsgd:bits=3,bucket=100",
            "rgc:density=0.001,method=exact",
            "rgc:density=0.3,method=exact",
            "rgc-quant:density=0.001",
            "rgc-quant:density=0.05",
        ]
        .iter()
        .map(|s| s.parse().expect("codec parses"))
        .collect();
        for cfg in &cfgs {
            for n in [1usize, 7, 8, 9, 100, 511, 512, 513, 4097, 100_003] {
                let mut c = cfg.build().expect("build");
                let mut msg = Vec::new();
                c.encode(&data(n, n as u64), &mut msg).expect("encode");
                let want = cfg.wire_bytes(n).expect("fixed size");
                assert_eq!(msg.len() as f64, want, "{cfg:?} n={n}");
            }
        }
    }

    /// Approximate counts and Golomb–Rice coding: within 10 % (plus a few
    /// bytes) of the expected size at layer sizes the model prices.
    #[test]
    fn variable_formats_are_near_their_expected_size() {
        for cfg in [
            CodecConfig::Rgc {
                density: 0.001,
                method: RgcMethod::Trimmed,
            },
            CodecConfig::Rgc {
                density: 0.01,
                method: RgcMethod::Trimmed,
            },
            CodecConfig::Sbc { p: 0.01 },
            CodecConfig::Sbc { p: 0.001 },
        ] {
            for n in [100_000usize, 1 << 20] {
                let mut c = cfg.build().expect("build");
                let mut msg = Vec::new();
                c.encode(&data(n, 3), &mut msg).expect("encode");
                let want = cfg.wire_bytes(n).expect("expected size");
                let got = msg.len() as f64;
                assert!(
                    (got - want).abs() <= 0.1 * want + 16.0,
                    "{cfg:?} n={n}: {got} vs {want}"
                );
            }
        }
        assert!(CodecConfig::ThreeLc {
            s: 1.0,
            stage: Default::default()
        }
        .wire_bytes(10)
        .is_none());
    }
}
