//! The link's burst credit ([`Burst`]): how much faster the first bytes
//! after an idle spell cross the link between nodes than bytes sent back to
//! back. Measured on a job spanning several nodes by the exchange probe of
//! the β curve run after [`IDLE_S`] of silence ([`super::probes`]), and
//! fitted here against the back-to-back curve.

use crate::cost::{Burst, NetLevel};

/// Seconds every rank idles before a post-idle exchange: longer than the
/// bucket of any shaper worth modelling takes to refill (the emulated
/// cluster's: 2 ms), and shorter than the forward and backward pass a
/// training step idles the link for.
pub(super) const IDLE_S: f64 = 0.02;

/// Smallest message the fit uses: below it the exchange is latency.
const MIN_BYTES: f64 = 16384.0;

/// How much better (root mean square of the relative error, absolute) the
/// fit with a credit must describe the post-idle exchanges than the
/// back-to-back curve alone before the profile gets one: noise on a link
/// with no credit does not make one.
const MIN_GAIN: f64 = 0.05;

/// The credit that best explains `rows` (message bytes, seconds of one
/// exchange after idling) against `level`'s back-to-back curve: `bytes`
/// and `beta` of `α + m·β(m) − min(m, bytes)·max(0, β(m) − beta)`, by a
/// grid search (credit: 4 steps per octave from half the smallest message
/// to the largest; rate: 2 % steps of the sustained β) minimizing the
/// relative squared error. `None` when it explains them no better than no
/// credit (by [`MIN_GAIN`]), or there are fewer than 3 messages of 16 KiB
/// or more.
pub(super) fn fit(level: &NetLevel, rows: &[(f64, f64)]) -> Option<Burst> {
    let rows: Vec<(f64, f64)> = rows
        .iter()
        .copied()
        .filter(|&(m, t)| m >= MIN_BYTES && t.is_finite() && t > 0.0)
        .collect();
    if rows.len() < 3 {
        return None;
    }
    let sustained = |m: f64| level.alpha + m * level.beta_at(m);
    let rms = |c: f64, bb: f64| {
        let e: f64 = rows
            .iter()
            .map(|&(m, t)| {
                let saved = m.min(c) * (level.beta_at(m) - bb).max(0.0);
                ((sustained(m) - saved - t) / t).powi(2)
            })
            .sum();
        (e / rows.len() as f64).sqrt()
    };
    let (lo, hi) = rows
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &(m, _)| {
            (a.min(m), b.max(m))
        });
    let top = level.beta_at(hi);
    let mut best = (rms(0.0, 0.0), 0.0, top);
    let mut c = lo / 2.0;
    while c <= hi * 1.0001 {
        for j in 0..50 {
            let bb = top * j as f64 / 50.0;
            let e = rms(c, bb);
            if e < best.0 {
                best = (e, c, bb);
            }
        }
        c *= 2f64.powf(0.25);
    }
    let (e, bytes, beta) = best;
    log::debug!(
        "calibrate: burst credit {bytes:.0} B at {beta:.3e} s/B: rms {e:.3} against {:.3} \
         without",
        rms(0.0, 0.0)
    );
    (bytes > 0.0 && e + MIN_GAIN <= rms(0.0, 0.0)).then_some(Burst { bytes, beta })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CurvePoint;

    fn level() -> NetLevel {
        NetLevel {
            alpha: 2e-5,
            beta: 8e-9,
            beta_curve: vec![
                CurvePoint {
                    bytes: 4096.0,
                    per_byte: 3e-9,
                },
                CurvePoint {
                    bytes: 131072.0,
                    per_byte: 8e-9,
                },
            ],
            oneway_curve: Vec::new(),
            burst: None,
        }
    }

    fn sizes() -> impl Iterator<Item = f64> {
        (12..=23).map(|e| (1u64 << e) as f64)
    }

    /// A token bucket of 300 KB at 3 ns/B is found again from its
    /// post-idle exchanges (within the grid's steps), noise of ±3 %
    /// included.
    #[test]
    fn finds_a_token_bucket() {
        let l = level();
        let rows: Vec<(f64, f64)> = sizes()
            .enumerate()
            .map(|(i, m)| {
                let t = l.alpha + m * l.beta_at(m) - m.min(3e5) * (l.beta_at(m) - 3e-9).max(0.0);
                (m, t * if i % 2 == 0 { 1.03 } else { 0.97 })
            })
            .collect();
        let b = fit(&l, &rows).expect("a credit");
        assert!((b.bytes / 3e5 - 1.0).abs() < 0.2, "{b:?}");
        assert!((b.beta - 3e-9).abs() < 0.6e-9, "{b:?}");
    }

    /// A link at one rate, measured with ±3 % noise, gets no credit.
    #[test]
    fn a_link_at_one_rate_has_none() {
        let l = level();
        let rows: Vec<(f64, f64)> = sizes()
            .enumerate()
            .map(|(i, m)| {
                let t = l.alpha + m * l.beta_at(m);
                (m, t * if i % 3 == 0 { 1.03 } else { 0.98 })
            })
            .collect();
        assert_eq!(fit(&l, &rows), None);
    }

    /// Too few messages to tell, or none that is finite: none.
    #[test]
    fn too_few_rows_are_none() {
        let l = level();
        assert_eq!(fit(&l, &[(1e5, 1e-4), (2e5, 2e-4)]), None);
        assert_eq!(fit(&l, &[(1e5, f64::NAN), (2e5, 0.0), (4e5, -1.0)]), None);
        assert_eq!(fit(&l, &[]), None);
    }
}
