//! What a calibration measured, as functions of size: the linear fits
//! `a + b·n` of the local costs ([`LinearFit`]), the curves of seconds per
//! byte by message size ([`CurvePoint`], read by [`curve_at`] and
//! [`curve_time_at`]), PowerSGD's local cost by size and rank
//! ([`PowerSgdFit`]), and the least-squares fits `calibrate` makes of
//! them. The [`Profile`](super::Profile) holds them; the formulas of
//! [`crate::cost`] read them.

use super::argmin;
use serde::{Deserialize, Serialize};

/// `seconds = a + b·n`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinearFit {
    /// Fixed seconds per call.
    pub a: f64,
    /// Seconds per element.
    pub b: f64,
}

impl LinearFit {
    /// Whether both coefficients are zero (not measured).
    pub fn is_zero(&self) -> bool {
        self.a == 0.0 && self.b == 0.0
    }

    /// Evaluate at `n` elements.
    pub fn at(&self, n: f64) -> f64 {
        self.a + self.b * n
    }

    /// Fit `(n, seconds)` points by least squares on relative errors (see
    /// [`fit_relative_l2`]).
    pub fn fit(points: &[(f64, f64)]) -> LinearFit {
        let rows: Vec<(f64, f64, f64)> = points.iter().map(|&(n, t)| (1.0, n, t)).collect();
        let (a, b) = fit_relative_l2(&rows);
        LinearFit { a, b }
    }
}

/// One point of a per-size curve (β, γ_reduce, γ_unpack, the dense local
/// cost).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurvePoint {
    /// Message bytes.
    pub bytes: f64,
    /// Seconds per byte at that size.
    pub per_byte: f64,
}

/// `curve` at `m` bytes: linear in `log m` between points, constant beyond
/// the ends; `fallback` when the curve is empty. Points must be sorted by
/// `bytes` (see [`Profile::validate`](super::Profile::validate)).
pub fn curve_at(curve: &[CurvePoint], fallback: f64, m: f64) -> f64 {
    let (Some(first), Some(last)) = (curve.first(), curve.last()) else {
        return fallback;
    };
    // NaN (a hostile size) reads the first point rather than no point.
    if m.is_nan() || m <= first.bytes {
        return first.per_byte;
    }
    if m >= last.bytes {
        return last.per_byte;
    }
    let i = curve.partition_point(|c| c.bytes <= m);
    let (a, b) = (curve[i - 1], curve[i]);
    let t = (m.ln() - a.bytes.ln()) / (b.bytes.ln() - a.bytes.ln());
    a.per_byte + t * (b.per_byte - a.per_byte)
}

/// [`curve_at`] for a curve whose `m·c(m)` is the time of `m` bytes (β,
/// γ_reduce, γ_clear): raised where needed so that the time never falls
/// as `m` grows, `max over m' ≤ m of m'·c(m')`, divided by `m`. Moving more
/// bytes is never faster than moving fewer (they could be padded), but a
/// measured curve that falls steeply between two points (cache effects,
/// noise: 2.2 → 0.76 ns/B over one doubling in a calibrated γ_reduce)
/// would make the interpolated time fall, and a 512 KiB allreduce cost less
/// than a 320 KiB one.
///
/// ```
/// use gradsync::cost::{curve_time_at, CurvePoint};
/// let c = [
///     CurvePoint { bytes: 1000.0, per_byte: 4.0 },
///     CurvePoint { bytes: 4000.0, per_byte: 0.5 },
/// ];
/// // Interpolated, 1794 bytes take 4529 and 4000 bytes only 2000; the
/// // envelope holds 4529 until 0.5 per byte catches up (9058 bytes).
/// let t = |m: f64| m * curve_time_at(&c, 0.0, m);
/// let mut last = 0.0;
/// for m in (1..200).map(|i| 100.0 * i as f64) {
///     assert!(t(m) >= last, "{m}");
///     last = t(m);
/// }
/// assert!((t(4000.0) - t(1794.0)).abs() < 0.1 && (t(8000.0) - 4528.8).abs() < 0.1);
/// assert_eq!(curve_time_at(&c, 0.0, 500.0), 4.0);
/// assert_eq!(t(20000.0), 10000.0);
/// ```
pub fn curve_time_at(curve: &[CurvePoint], fallback: f64, m: f64) -> f64 {
    let c = curve_at(curve, fallback, m);
    if !(m > 0.0 && m.is_finite()) || curve.len() < 2 {
        return c;
    }
    let own = m * c;
    let mut best = own;
    for w in curve.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.bytes >= m {
            break;
        }
        best = best.max(a.bytes * a.per_byte);
        // Inside a falling segment c = a.c + s·ln(x/a), so x·c(x) peaks
        // where c(x) = −s, at x·(−s).
        let span = b.bytes.ln() - a.bytes.ln();
        let s = (b.per_byte - a.per_byte) / span;
        if s < 0.0 {
            let t = (-s - a.per_byte) / (b.per_byte - a.per_byte);
            if t > 0.0 && t < 1.0 {
                let x = (a.bytes.ln() + t * span).exp();
                if x < m {
                    best = best.max(x * -s);
                }
            }
        }
    }
    // Unraised: `c` itself (m·c/m need not round back to it).
    if best > own {
        best / m
    } else {
        c
    }
}

/// Byte-weighted mean of `curve` over the messages `msgs` (`Σ m·c(m) / Σ m`,
/// each `c(m)` from [`curve_time_at`]); exactly `fallback` when the curve
/// is empty or no bytes move.
pub fn curve_mean(curve: &[CurvePoint], fallback: f64, msgs: &[f64]) -> f64 {
    if curve.is_empty() {
        return fallback;
    }
    let total: f64 = msgs.iter().sum();
    if total <= 0.0 {
        return fallback;
    }
    msgs.iter()
        .map(|&m| m * curve_time_at(curve, fallback, m))
        .sum::<f64>()
        / total
}

/// Fit `t ≈ c1·x + c2·y` with `x, y ≥ 0` minimizing `Σ ((c1·x + c2·y − t)/t)²`
/// (least squares on relative errors; a negative coefficient is clamped to
/// 0 and the other refitted). Unlike [`fit_relative_l1`] it splits the
/// difference between regimes (cache-resident and memory-bound sizes).
pub fn fit_relative_l2(rows: &[(f64, f64, f64)]) -> (f64, f64) {
    let (mut s11, mut s12, mut s22, mut r1, mut r2) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(c1, c2, t) in rows.iter().filter(|r| r.2 > 0.0 && r.2.is_finite()) {
        let w = 1.0 / (t * t);
        s11 += w * c1 * c1;
        s12 += w * c1 * c2;
        s22 += w * c2 * c2;
        r1 += w * c1 * t;
        r2 += w * c2 * t;
    }
    let det = s11 * s22 - s12 * s12;
    let (x, y) = if det.abs() > 1e-300 * (s11 * s22).max(1e-300) && det != 0.0 {
        ((r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det)
    } else {
        (-1.0, -1.0)
    };
    if x >= 0.0 && y >= 0.0 {
        (x, y)
    } else {
        let only_x = if s11 > 0.0 { (r1 / s11).max(0.0) } else { 0.0 };
        let only_y = if s22 > 0.0 { (r2 / s22).max(0.0) } else { 0.0 };
        let cost = |a: f64, b: f64| -> f64 {
            rows.iter()
                .filter(|r| r.2 > 0.0 && r.2.is_finite())
                .map(|&(c1, c2, t)| ((c1 * a + c2 * b - t) / t).powi(2))
                .sum()
        };
        if cost(only_x, 0.0) <= cost(0.0, only_y) {
            (only_x, 0.0)
        } else {
            (0.0, only_y)
        }
    }
}

/// Fit `t ≈ c1·x + c2·y` with `x, y ≥ 0` minimizing `Σ |c1·x + c2·y − t| / t`.
///
/// A relative L1 fit is robust: where a machine has two regimes (messages
/// that stay in cache and messages that do not), it follows the majority of
/// the measured points instead of splitting the difference, so its errors
/// concentrate on the few points of the other regime. The optimum of this
/// linear program lies on a vertex: a line through two points, or through
/// one point with the other coefficient zero; all are tried (fine for the
/// few dozen points of a calibration).
pub fn fit_relative_l1(rows: &[(f64, f64, f64)]) -> (f64, f64) {
    let rows: Vec<(f64, f64, f64)> = rows
        .iter()
        .copied()
        .filter(|r| r.2 > 0.0 && r.2.is_finite())
        .collect();
    let cost = |x: f64, y: f64| -> f64 {
        rows.iter()
            .map(|&(c1, c2, t)| (c1 * x + c2 * y - t).abs() / t)
            .sum()
    };
    let mut cands = vec![(0.0, 0.0)];
    for (i, &(a1, b1, t1)) in rows.iter().enumerate() {
        if a1 > 0.0 {
            cands.push((t1 / a1, 0.0));
        }
        if b1 > 0.0 {
            cands.push((0.0, t1 / b1));
        }
        for &(a2, b2, t2) in &rows[i + 1..] {
            let det = a1 * b2 - a2 * b1;
            if det.abs() > 1e-300 {
                let x = (t1 * b2 - t2 * b1) / det;
                let y = (a1 * t2 - a2 * t1) / det;
                if x >= 0.0 && y >= 0.0 {
                    cands.push((x, y));
                }
            }
        }
    }
    argmin::fastest(cands, |p| cost(p.0, p.1)).unwrap_or((0.0, 0.0))
}

/// PowerSGD's local seconds for one layer of `n` elements per step at
/// rank `r` (its three products of `2·n·r` flops, and the passes over `n`
/// that add the error, keep the new one and apply momentum), measured by
/// `calibrate` on matrices of a few sizes and ranks: the measured
/// `curve` where the profile has one, else `a + per_elem·n +
/// per_elem_rank·n·r`; zero when not measured (then the model does not
/// offer `powersgd`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PowerSgdFit {
    /// Fixed seconds per layer.
    pub a: f64,
    /// Seconds per element.
    pub per_elem: f64,
    /// Seconds per element and unit of rank.
    pub per_elem_rank: f64,
    /// Seconds per element measured at a few (elements, rank) points:
    /// the cost per element grows with the layer as its matrices leave
    /// the caches (1.5 to 2.8 ns per element at rank 2 from 0.6 M to
    /// 8 Mi elements on the development VM), which one linear fit cannot
    /// follow. Interpolated in log-size and in rank ([`Self::at`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<PowerSgdPoint>,
    /// The same step in a whole model's: per element at a few (elements,
    /// rank) points, each measured on a table of such layers, `table_bytes`
    /// of gradients, one layer after another, so that each finds its
    /// matrices out of the caches, pushed out by the others' (on one
    /// 2-vCPU VM 1.3 times the same layer alone at 256 Ki elements,
    /// 1.0–1.05 at 1 and 4 Mi).
    /// [`Self::at_in_table`] prices a layer of a large table at `curve`
    /// times their ratio to it. Empty in profiles from before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub table: Vec<PowerSgdPoint>,
    /// Bytes of gradients in each table of [`Self::table`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub table_bytes: f64,
}

/// Whether `x` is zero (serde's `skip_serializing_if` of the cost
/// model's optional constants).
pub(super) fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// How much of a layer's cost in a whole model's step its table of `step`
/// gradient bytes takes from the calibration's tables of `probes` bytes
/// (past the caches) rather than from the layer alone (its data in them):
/// 1 from `probes` up, 0 at a sixteenth of it and below, linear in the
/// logarithm of the size between.
///
/// ```
/// use gradsync::cost::table_weight;
/// assert_eq!(table_weight(128.0, 64.0), 1.0);
/// assert_eq!(table_weight(4.0, 64.0), 0.0);
/// assert!((table_weight(16.0, 64.0) - 0.5).abs() < 1e-12);
/// ```
pub fn table_weight(step: f64, probes: f64) -> f64 {
    if !(probes > 0.0 && step > 0.0) {
        return 0.0;
    }
    (1.0 + (step / probes).ln() / 16f64.ln()).clamp(0.0, 1.0)
}

/// One measured point of [`PowerSgdFit::curve`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PowerSgdPoint {
    /// Elements of the probed matrix.
    pub elements: usize,
    /// Its rank.
    pub rank: usize,
    /// Measured seconds per element.
    pub per_elem: f64,
}

impl PowerSgdFit {
    /// Whether every coefficient is zero (not measured; [`Self::table`]
    /// alone only scales a price, it makes none).
    pub fn is_zero(&self) -> bool {
        self.a == 0.0 && self.per_elem == 0.0 && self.per_elem_rank == 0.0 && self.curve.is_empty()
    }

    /// Seconds for `n` elements at rank `r`: from the curve where there is
    /// one (per element, log-linear in size between the probed sizes and
    /// flat past them, linear in rank between the probed ranks and along
    /// the last two past them), else from the linear fit.
    pub fn at(&self, n: f64, r: f64) -> f64 {
        if self.curve.is_empty() {
            return self.a + self.per_elem * n + self.per_elem_rank * n * r;
        }
        if !(n.is_finite() && r.is_finite()) {
            // Not a layer: NaN, which the step model's checks refuse.
            return f64::NAN;
        }
        // The probed ranks around `r` (no allocation: the planner prices
        // every layer of a table with this).
        let ranks = || self.curve.iter().map(|p| p.rank);
        let below = ranks().filter(|&k| k as f64 <= r).max();
        let above = ranks().filter(|&k| k as f64 > r).min();
        let pe = match (below, above) {
            (Some(lo), Some(hi)) => lerp(self.at_rank(lo, n), self.at_rank(hi, n), r),
            (None, Some(hi)) => self.at_rank(hi, n).1,
            (Some(lo), None) => match ranks().filter(|&k| k < lo).max() {
                // Past the last probed rank along the last two, never
                // falling: a noisy probe that made the higher rank
                // cheaper must not price large ranks at nothing.
                Some(prev) => {
                    let (a, b) = (self.at_rank(prev, n), self.at_rank(lo, n));
                    b.1 + ((b.1 - a.1) / (b.0 - a.0)).max(0.0) * (r - b.0)
                }
                None => self.at_rank(lo, n).1,
            },
            (None, None) => 0.0,
        };
        pe.max(0.0) * n
    }

    /// Seconds for `n` elements at rank `r` in a step whose whole table
    /// has `table` elements: [`Self::at`], times the ratio of the
    /// [`Self::table`] points to it at their sizes (each at least 1: a
    /// table cheaper than its layers alone is noise; linear in `ln n`
    /// between them, the nearest one's past them), by the
    /// [`table_weight`] of the table's size.
    pub fn at_in_table(&self, n: f64, r: f64, table: f64) -> f64 {
        let alone = self.at(n, r);
        let w = table_weight(4.0 * table.max(n), self.table_bytes);
        if self.table.is_empty() || w == 0.0 {
            return alone;
        }
        let ratio = |p: &PowerSgdPoint| {
            let e = p.elements as f64;
            let a = self.at(e, p.rank as f64) / e;
            if a > 0.0 {
                (p.per_elem / a).max(1.0)
            } else {
                1.0
            }
        };
        let f = log_size_lerp(self.table.iter(), n, ratio, 1.0);
        alone * (1.0 + w * (f - 1.0))
    }

    /// (`rank`, seconds per element at `n` elements) from the curve's
    /// points at `rank`: linear in `ln n` between the probed sizes
    /// around `n`, the nearest one's past them.
    fn at_rank(&self, rank: usize, n: f64) -> (f64, f64) {
        let pts = self.curve.iter().filter(move |p| p.rank == rank);
        let pe = log_size_lerp(pts, n, |p| p.per_elem, 0.0);
        (rank as f64, pe)
    }
}

/// `value` at `n` elements from the points around it: linear in `ln n`
/// between the nearest below and above, the nearest one's past them,
/// `none` without points.
fn log_size_lerp<'a>(
    pts: impl Iterator<Item = &'a PowerSgdPoint> + Clone,
    n: f64,
    value: impl Fn(&PowerSgdPoint) -> f64,
    none: f64,
) -> f64 {
    let lo = pts
        .clone()
        .filter(|p| p.elements as f64 <= n)
        .max_by_key(|p| p.elements);
    let hi = pts
        .filter(|p| p.elements as f64 >= n)
        .min_by_key(|p| p.elements);
    match (lo, hi) {
        (Some(a), Some(b)) if a.elements != b.elements => lerp(
            ((a.elements as f64).ln(), value(a)),
            ((b.elements as f64).ln(), value(b)),
            n.ln(),
        ),
        (Some(a), _) | (None, Some(a)) => value(a),
        (None, None) => none,
    }
}

/// The line through `a` and `b` at `x`.
fn lerp(a: (f64, f64), b: (f64, f64), x: f64) -> f64 {
    if b.0 == a.0 {
        return b.1;
    }
    a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0)
}
