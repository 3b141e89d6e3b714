//! Gradients in float16 and bfloat16: the engine's step on a table whose
//! layers' gradients come in several dtypes ([`Grad`]).
//!
//! The engine's arithmetic stays float32: each half-precision gradient is
//! widened (exactly) into a float32 workspace the engine keeps, the step
//! runs on float32 ([`GradSync::sync`]: dense layers summed in float32,
//! selection, residuals and momentum in float32), and each result is
//! rounded back to the gradient's dtype (round to nearest, ties to even;
//! `half`'s conversions). So a mixed step's result is, bit for bit, the
//! float32 step's result on the widened inputs, rounded once.
//!
//! Error bound against a float64 reference `r` of a dense layer's average
//! over `p` ranks of inputs `x_j` (exact in every dtype here): the float32
//! sum and scaling add at most `γ_p·Σ|x_j|/p` (`γ_p = p·u/(1 − p·u)`,
//! `u = 2⁻²⁴`), and the final rounding `u_h·|r'|` for a result `r'` in the
//! dtype's normal range (`u_h = 2⁻¹¹` float16, `2⁻⁸` bfloat16), or half
//! the smallest subnormal below it (`2⁻²⁵` float16, `2⁻¹³⁴` bfloat16):
//!
//! `|out − r| ≤ u_h·(|r| + e) + e + η_h`, with `e = γ_p·Σ|x_j|/p`.
//!
//! A result beyond float16's range (±65504) becomes ±inf, as PyTorch's own
//! casts do; bfloat16 has float32's range. A step that fails on every rank
//! ([`crate::Error::RankFailed`]) leaves the inputs as they were (the
//! round trip through float32 is exact).

use super::{GradSync, StepStats};
use crate::comm::Transport;
use crate::Result;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// One layer's gradient in its own dtype, written in place by
/// [`GradSync::sync_mixed`].
#[derive(Debug)]
pub enum Grad<'a> {
    /// float32: used in place, as [`GradSync::sync`] does.
    F32(&'a mut [f32]),
    /// IEEE binary16.
    F16(&'a mut [f16]),
    /// bfloat16 (float32's exponent, 8 significant bits).
    Bf16(&'a mut [bf16]),
}

impl Grad<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::F16(g) => g.len(),
            Grad::Bf16(g) => g.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype's name, as PyTorch spells it.
    pub fn dtype(&self) -> &'static str {
        match self {
            Grad::F32(_) => "float32",
            Grad::F16(_) => "float16",
            Grad::Bf16(_) => "bfloat16",
        }
    }
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// One synchronous step on gradients of several dtypes: `grads[i]` is
    /// layer `i`'s gradient (registration order), replaced by the layer's
    /// update direction in its own dtype. Float32 layers are used in place;
    /// float16 and bfloat16 ones go through a float32 workspace the engine
    /// keeps between steps (the module docs of `mixed.rs` give the error bound).
    /// Collective, like [`sync`](Self::sync).
    ///
    /// ```
    /// use gradsync::comm::LocalComm;
    /// use gradsync::sync::{Config, Grad, GradSync};
    /// use half::bf16;
    /// let got = LocalComm::run(2, |c| {
    ///     let mut e = GradSync::with_transport(c, Config::default()).unwrap();
    ///     e.register("w", &[2]).unwrap();
    ///     e.register("b", &[1]).unwrap();
    ///     let r = e.rank() as f32;
    ///     let mut w = [bf16::from_f32(r), bf16::from_f32(3.0)];
    ///     let mut b = [2.0 * r];
    ///     e.sync_mixed(&mut [Grad::Bf16(&mut w), Grad::F32(&mut b)]).unwrap();
    ///     (w.map(f32::from), b)
    /// });
    /// assert_eq!(got[1], ([0.5, 3.0], [1.0]));
    /// ```
    pub fn sync_mixed(&mut self, grads: &mut [Grad<'_>]) -> Result<&StepStats> {
        let mut work = std::mem::take(&mut self.work.widened);
        work.resize_with(grads.len(), Vec::new);
        let r = {
            let mut slices: Vec<&mut [f32]> = Vec::with_capacity(grads.len());
            for (g, w) in grads.iter_mut().zip(work.iter_mut()) {
                slices.push(match g {
                    Grad::F32(s) => &mut **s,
                    Grad::F16(s) => widen(w, s.len(), |o| s.convert_to_f32_slice(o)),
                    Grad::Bf16(s) => widen(w, s.len(), |o| s.convert_to_f32_slice(o)),
                });
            }
            self.sync(&mut slices).map(|_| ())
        };
        // Written back whatever the outcome: results where the step wrote
        // them (every layer but a non-finite one on `Error::NonFinite`),
        // the inputs' own bits where it did not (an exact round trip).
        for (g, w) in grads.iter_mut().zip(&work) {
            match g {
                Grad::F32(_) => {}
                Grad::F16(s) => s.convert_from_f32_slice(&w[..s.len()]),
                Grad::Bf16(s) => s.convert_from_f32_slice(&w[..s.len()]),
            }
        }
        self.work.widened = work;
        r.map(|()| self.last_stats())
    }
}

/// `w` resized to `n` and filled by `fill` (which writes every element),
/// as a slice; a workspace of the right length is not cleared first.
fn widen(w: &mut Vec<f32>, n: usize, fill: impl FnOnce(&mut [f32])) -> &mut [f32] {
    w.resize(n, 0.0);
    fill(&mut w[..]);
    &mut w[..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalComm;
    use crate::sync::{Config, Strategy};

    /// Deterministic inputs of rank `r`, layer `l`: a spread of magnitudes.
    fn input(r: usize, l: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i * 7919 + r * 104_729 + l * 31) % 2003) as f32 / 2003.0 - 0.5;
                x * (1 << (i % 9)) as f32 / 16.0
            })
            .collect()
    }

    const SIZES: [usize; 4] = [300, 300, 4000, 50];

    /// Every rank's results of three steps, as float64: float32 steps on
    /// the inputs rounded to each layer's dtype (`mixed = false`), or mixed
    /// steps on those inputs (`mixed = true`), plus the dtype inputs.
    #[allow(clippy::type_complexity)]
    fn run(p: usize, mixed: bool) -> Vec<Vec<(Vec<Vec<f64>>, Vec<Vec<f64>>)>> {
        LocalComm::run(p, move |c| {
            let cfg = Config {
                momentum: 0.0,
                ..Config::default()
            };
            let mut e = GradSync::with_transport(c, cfg).unwrap();
            e.register_with("d16", &[SIZES[0]], Strategy::Dense)
                .unwrap();
            e.register_with("dbf", &[SIZES[1]], Strategy::Dense)
                .unwrap();
            e.register_with("s16", &[SIZES[2]], Strategy::rgc(0.01))
                .unwrap();
            e.register_with("f", &[SIZES[3]], Strategy::Dense).unwrap();
            let r = e.rank();
            (0..3)
                .map(|step| {
                    let x: Vec<Vec<f32>> = SIZES
                        .iter()
                        .enumerate()
                        .map(|(l, &n)| input(r + 10 * step, l, n))
                        .collect();
                    let mut h0: Vec<f16> = x[0].iter().map(|&v| f16::from_f32(v)).collect();
                    let mut h1: Vec<bf16> = x[1].iter().map(|&v| bf16::from_f32(v)).collect();
                    let mut h2: Vec<f16> = x[2].iter().map(|&v| f16::from_f32(v)).collect();
                    let mut h3 = x[3].clone();
                    let mut w: Vec<Vec<f32>> = vec![
                        h0.iter().map(|v| v.to_f32()).collect(),
                        h1.iter().map(|v| v.to_f32()).collect(),
                        h2.iter().map(|v| v.to_f32()).collect(),
                        h3.clone(),
                    ];
                    let inputs: Vec<Vec<f64>> = w
                        .iter()
                        .map(|v| v.iter().map(|&y| f64::from(y)).collect())
                        .collect();
                    let outputs: Vec<Vec<f64>> = if mixed {
                        e.sync_mixed(&mut [
                            Grad::F16(&mut h0),
                            Grad::Bf16(&mut h1),
                            Grad::F16(&mut h2),
                            Grad::F32(&mut h3),
                        ])
                        .unwrap();
                        vec![
                            h0.iter().map(|v| v.to_f64()).collect(),
                            h1.iter().map(|v| v.to_f64()).collect(),
                            h2.iter().map(|v| v.to_f64()).collect(),
                            h3.iter().map(|&v| f64::from(v)).collect(),
                        ]
                    } else {
                        let mut s: Vec<&mut [f32]> = w.iter_mut().map(|v| &mut v[..]).collect();
                        e.sync(&mut s).unwrap();
                        // Rounded once to each layer's dtype.
                        vec![
                            w[0].iter().map(|&v| f16::from_f32(v).to_f64()).collect(),
                            w[1].iter().map(|&v| bf16::from_f32(v).to_f64()).collect(),
                            w[2].iter().map(|&v| f16::from_f32(v).to_f64()).collect(),
                            w[3].iter().map(|&v| f64::from(v)).collect(),
                        ]
                    };
                    (inputs, outputs)
                })
                .collect()
        })
    }

    /// The mixed step equals the float32 step on the widened inputs,
    /// rounded once, bit for bit (dense and RGC layers, float32 beside
    /// them), and the dense results hold the stated bound against float64.
    #[test]
    fn mixed_step_is_the_float32_step_rounded_once() {
        for p in [1, 2, 3, 4] {
            let mixed = run(p, true);
            let float32 = run(p, false);
            for (r, (m, f)) in mixed.iter().zip(&float32).enumerate() {
                for (step, (ms, fs)) in m.iter().zip(f).enumerate() {
                    for (l, (a, b)) in ms.1.iter().zip(&fs.1).enumerate() {
                        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "p={p} rank {r} step {step} layer {l}");
                    }
                }
            }
            let u = 2f64.powi(-24);
            let gamma = p as f64 * u / (1.0 - p as f64 * u);
            for step in 0..3 {
                for (l, uh, eta) in [
                    (0, 2f64.powi(-11), 2f64.powi(-25)),
                    (1, 2f64.powi(-8), 2f64.powi(-134)),
                ] {
                    for i in 0..SIZES[l] {
                        let xs: Vec<f64> = (0..p).map(|r| mixed[r][step].0[l][i]).collect();
                        let reference = xs.iter().sum::<f64>() / p as f64;
                        let e = gamma * xs.iter().map(|v| v.abs()).sum::<f64>() / p as f64;
                        let bound = uh * (reference.abs() + e) + e + eta;
                        for (r, m) in mixed.iter().enumerate() {
                            let got = m[step].1[l][i];
                            assert!(
                                (got - reference).abs() <= bound,
                                "p={p} rank {r} layer {l} elem {i}: {got} vs {reference} (bound {bound})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A failed step leaves half-precision inputs as they were, on every
    /// rank; a float16 result past its range is inf.
    #[test]
    fn a_failed_mixed_step_keeps_the_inputs_and_float16_overflows_to_inf() {
        let out = LocalComm::run(2, |c| {
            let cfg = Config {
                momentum: 0.0,
                ..Config::default()
            };
            let mut e = GradSync::with_transport(c, cfg).unwrap();
            e.register("w", &[3]).unwrap();
            let mut h = [f16::from_f32(1.5), f16::from_f32(-2.0), f16::from_f32(0.1)];
            let before = h;
            let failed = if e.rank() == 1 {
                let mut short = [f16::ZERO; 2];
                e.sync_mixed(&mut [Grad::F16(&mut short)]).is_err()
            } else {
                let r = e.sync_mixed(&mut [Grad::F16(&mut h)]).is_err();
                assert_eq!(h.map(|v| v.to_bits()), before.map(|v| v.to_bits()));
                r
            };
            // In range: two ranks' 60000 average to 60000.
            let mut big = [f16::from_f32(60000.0), f16::from_f32(1.0), f16::ZERO];
            e.sync_mixed(&mut [Grad::F16(&mut big)]).unwrap();
            (failed, big[0].to_f32())
        });
        assert!(
            out.iter().all(|o| o.0),
            "the failure reached every rank: {out:?}"
        );
        assert_eq!(out[0].1, 60000.0);
        // One rank: momentum makes the direction grow past 65504.
        let out = LocalComm::run(1, |c| {
            let cfg = Config {
                momentum: 0.9,
                ..Config::default()
            };
            let mut e = GradSync::with_transport(c, cfg).unwrap();
            e.register("w", &[1]).unwrap();
            let mut last = 0.0;
            for _ in 0..3 {
                let mut h = [f16::from_f32(60000.0)];
                e.sync_mixed(&mut [Grad::F16(&mut h)]).unwrap();
                last = h[0].to_f32();
            }
            last
        });
        assert_eq!(out[0], f32::INFINITY);
    }
}
