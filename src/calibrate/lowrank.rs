//! PowerSGD's local cost in a calibration: the probe of one layer's
//! local step (its products, orthogonalization and the error kept) and
//! the fit `a + n·per_elem + n·r·per_elem_rank` the step model prices
//! `powersgd` with ([`crate::cost::PowerSgdFit`]).

use super::probes::{local_prep, Probe};
use crate::comm::MpiComm;
use crate::cost;
use crate::Result;

/// One PowerSGD layer's local step of a `rows × cols` gradient at rank
/// `r`, as the engine times it into `StepStats::powersgd_s` on one rank
/// (the allreduces are the network's): `P = M Q` with the error added,
/// orthogonalization, `Q = Mᵀ P`, `M̂ = P Qᵀ` and the new error. The
/// gradient's copy in and the result's copy out are the dense path's,
/// which the step model charges every PowerSGD layer as `dense_local`:
/// the gradient is copied in untimed here, as backpropagation writes it
/// in a step. Timing the copies too charged them twice, about 0.7 ns an
/// element of a layer out of the caches (development VM, two processes:
/// 2.3 ns for the step's part, 3.0 with the copies), and over-predicted
/// every all-PowerSGD step (by up to 60 % for the LSTM).
pub(super) fn powersgd_probe<'a>(
    comm: &'a MpiComm,
    x: &[f32],
    rows: usize,
    cols: usize,
    r: usize,
) -> Result<Probe<'a>> {
    let g: Vec<f32> = x.iter().copied().cycle().take(rows * cols).collect();
    Ok(local_prep(
        comm,
        Workspace::new(rows, cols, r)?,
        move |w: &mut Workspace| w.input.copy_from_slice(&g),
        Workspace::step,
    ))
}

/// [`powersgd_probe`] on a table of `layers` such layers, one after
/// another (each gradient copied in untimed first, as backpropagation
/// writes a whole model's): in a whole model's step each layer finds its
/// matrices out of the caches, pushed out by the others'
/// ([`crate::cost::PowerSgdFit::table`]).
pub(super) fn powersgd_table_probe<'a>(
    comm: &'a MpiComm,
    x: &[f32],
    (rows, cols, r): (usize, usize, usize),
    layers: usize,
) -> Result<Probe<'a>> {
    let g: Vec<f32> = x.iter().copied().cycle().take(rows * cols).collect();
    let table = (0..layers)
        .map(|_| Workspace::new(rows, cols, r))
        .collect::<Result<Vec<_>>>()?;
    Ok(local_prep(
        comm,
        table,
        move |t: &mut Vec<Workspace>| t.iter_mut().for_each(|w| w.input.copy_from_slice(&g)),
        |t: &mut Vec<Workspace>| t.iter_mut().try_for_each(Workspace::step),
    ))
}

/// What [`powersgd_probe`] keeps between calls.
struct Workspace {
    st: crate::powersgd::PowerSgd,
    input: Vec<f32>,
    out: Vec<f32>,
    p: Vec<f32>,
    q: Vec<f32>,
}

impl Workspace {
    /// A `rows × cols` layer's at rank `r`, zeroed.
    fn new(rows: usize, cols: usize, r: usize) -> Result<Self> {
        let st = crate::powersgd::PowerSgd::new(rows, cols, r, true, 1)?;
        let (np, nq) = st.factor_lens();
        Ok(Self {
            st,
            input: vec![0f32; rows * cols],
            out: vec![0f32; rows * cols],
            p: vec![0f32; np],
            q: vec![0f32; nq],
        })
    }

    /// The timed part: the products, orthogonalization and the error kept.
    fn step(&mut self) -> Result<()> {
        self.st.begin(&self.input, &mut self.p)?;
        self.st.after_p(&self.p, &mut self.q)?;
        self.st.after_q(&self.q, 1, &mut self.out)
    }
}

/// PowerSGD's local cost (9.) from the probes of `shapes` (rows, columns,
/// rank) and their `times`: `a + n·per_elem + n·r·per_elem_rank` by
/// least squares on relative errors over the probes' shapes; coefficients
/// that come out negative (noise at small sizes) are refitted without
/// that term. With them, the tables of `table_elems` elements each, one
/// per `table_shapes` entry, that measured `table_times` (9b.: the fit's
/// [`cost::PowerSgdFit::table`]).
pub(super) fn fit_powersgd(
    shapes: &[(usize, usize, usize)],
    times: &[f64],
    table_shapes: &[(usize, usize, usize)],
    table_times: &[f64],
    table_elems: usize,
) -> cost::PowerSgdFit {
    let pts: Vec<(f64, f64, f64)> = shapes
        .iter()
        .zip(times)
        .map(|(&(rows, cols, r), &t)| {
            let n = (rows * cols) as f64;
            (n, n * r as f64, t)
        })
        .filter(|p| p.2 > 0.0 && p.2.is_finite())
        .collect();
    // No fixed term (charged once per layer, a model's dozens of PowerSGD
    // layers multiply its noise); the curve of the measured points is
    // what the step model prices with.
    let mut fit = fit_three(&pts, false);
    if !fit.is_zero() {
        fit.curve = shapes
            .iter()
            .zip(times)
            .filter(|(_, t)| **t > 0.0 && t.is_finite())
            .map(|(&(rows, cols, r), &t)| cost::PowerSgdPoint {
                elements: rows * cols,
                rank: r,
                per_elem: t / (rows * cols) as f64,
            })
            .collect();
        monotone_in_rank(&mut fit.curve);
        fit.table = table_shapes
            .iter()
            .zip(table_times)
            .filter(|(_, t)| **t > 0.0 && t.is_finite())
            .map(|(&(rows, cols, r), &t)| cost::PowerSgdPoint {
                elements: rows * cols,
                rank: r,
                per_elem: t / table_elems as f64,
            })
            .collect();
        if !fit.table.is_empty() {
            fit.table_bytes = 4.0 * table_elems as f64;
        }
    }
    log::debug!("calibrate: PowerSGD local points {pts:?}: {fit:?}");
    fit
}

/// At each probed size, no point above one of a higher rank: a higher
/// rank does the same passes over the layer and more products, so a
/// lower rank measured slower is noise, and a shared machine's noise only
/// adds time. Such a point takes the higher rank's value. One
/// calibration measured 3.21 ns an element at rank 2 and 2.27 at rank 4
/// on the same 4 Mi-element matrix (rank 2 is 1.95–2.44 in the others),
/// and priced the LSTM's all-PowerSGD step 20 % over its measurement.
fn monotone_in_rank(curve: &mut [cost::PowerSgdPoint]) {
    for i in 0..curve.len() {
        let cap = curve
            .iter()
            .filter(|q| q.elements == curve[i].elements && q.rank > curve[i].rank)
            .map(|q| q.per_elem)
            .fold(f64::INFINITY, f64::min);
        curve[i].per_elem = curve[i].per_elem.min(cap);
    }
}

/// The non-negative least-squares fit of `t ≈ a + b·n + c·m` on relative
/// errors (each row divided by `t`), over the terms that stay
/// non-negative: all three (only with `intercept`), else `b·n + c·m`, else
/// `c·m` alone.
pub(super) fn fit_three(pts: &[(f64, f64, f64)], intercept: bool) -> cost::PowerSgdFit {
    type Row = fn(f64, f64) -> [f64; 3];
    let forms: [Row; 3] = [|n, m| [1.0, n, m], |n, m| [0.0, n, m], |_, m| [0.0, 0.0, m]];
    for form in forms.into_iter().skip(usize::from(!intercept)) {
        // Normal equations of the weighted rows (zero columns dropped by
        // a unit diagonal).
        let mut ata = [[0.0f64; 3]; 3];
        let mut atb = [0.0f64; 3];
        for &(n, m, t) in pts {
            let row = form(n, m).map(|v| v / t);
            for i in 0..3 {
                for j in 0..3 {
                    ata[i][j] += row[i] * row[j];
                }
                atb[i] += row[i];
            }
        }
        for (i, r) in ata.iter_mut().enumerate() {
            if r[i] == 0.0 {
                r[i] = 1.0;
            }
        }
        if let Some(x) = solve3(ata, atb) {
            if x.iter().all(|v| v.is_finite() && *v >= 0.0) {
                return cost::PowerSgdFit {
                    a: x[0],
                    per_elem: x[1],
                    per_elem_rank: x[2],
                    ..cost::PowerSgdFit::default()
                };
            }
        }
    }
    cost::PowerSgdFit::default()
}

/// `A x = b` for a 3 × 3 system (Gaussian elimination with partial
/// pivoting); `None` when singular.
#[allow(clippy::needless_range_loop)] // rows and columns index one matrix
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for c in 0..3 {
        let piv = (c..3).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        if a[piv][c].abs() < 1e-300 {
            return None;
        }
        a.swap(c, piv);
        b.swap(c, piv);
        for r in c + 1..3 {
            let f = a[r][c] / a[c][c];
            for k in c..3 {
                a[r][k] -= f * a[c][k];
            }
            b[r] -= f * b[c];
        }
    }
    let mut x = [0.0; 3];
    for c in (0..3).rev() {
        let s: f64 = (c + 1..3).map(|k| a[c][k] * x[k]).sum();
        x[c] = (b[c] - s) / a[c][c];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_known_coefficients_and_drops_negative_terms() {
        let (a, b, c) = (2e-5, 3e-10, 7e-10);
        let shapes = [
            (64.0 * 64.0, 1.0),
            (256.0 * 512.0, 1.0),
            (256.0 * 512.0, 2.0),
            (256.0 * 512.0, 4.0),
        ];
        let pts: Vec<(f64, f64, f64)> = shapes
            .iter()
            .map(|&(n, r)| (n, n * r, a + b * n + c * n * r))
            .collect();
        let f = fit_three(&pts, true);
        for (got, want) in [(f.a, a), (f.per_elem, b), (f.per_elem_rank, c)] {
            assert!(
                (got - want).abs() <= 1e-6 * want.max(1e-12) + 1e-15,
                "{f:?}"
            );
        }
        // A negative intercept (noise) is dropped, the rest refitted.
        let pts: Vec<(f64, f64, f64)> = shapes
            .iter()
            .map(|&(n, r)| (n, n * r, -1e-6 + b * n + c * n * r))
            .collect();
        let f = fit_three(&pts, true);
        assert_eq!(f.a, 0.0);
        assert!(f.per_elem >= 0.0 && f.per_elem_rank > 0.0, "{f:?}");
        // Nothing measured: zero (the model then offers no powersgd).
        assert!(fit_three(&[], true).is_zero());
        // Without the intercept, one size at three ranks: b and c exactly.
        let one: Vec<(f64, f64, f64)> = [1.0, 2.0, 4.0]
            .iter()
            .map(|&r| {
                let n = 8.0 * 1024.0 * 1024.0;
                (n, n * r, b * n + c * n * r)
            })
            .collect();
        let f = fit_three(&one, false);
        assert_eq!(f.a, 0.0);
        assert!(
            (f.per_elem - b).abs() <= 1e-6 * b && (f.per_elem_rank - c).abs() <= 1e-6 * c,
            "{f:?}"
        );
    }

    /// The calibration keeps every measured point as the curve the step
    /// model prices with, so that a probed size and rank is priced as
    /// measured; an unmeasured probe (zero time) is left out, and no
    /// measurement at all gives no fit.
    #[test]
    fn the_measured_points_become_the_curve() {
        let shapes = [
            (256, 1024, 1),
            (256, 1024, 2),
            (1024, 8192, 2),
            (1024, 1024, 4),
        ];
        let times = [2e-4, 4e-4, 0.023, 0.0];
        let f = fit_powersgd(&shapes, &times, &[], &[], 0);
        assert_eq!(f.curve.len(), 3, "{f:?}");
        for (&(rows, cols, r), &t) in shapes.iter().zip(&times).take(3) {
            let n = (rows * cols) as f64;
            assert!(((f.at(n, r as f64) - t) / t).abs() < 1e-12, "{f:?}");
        }
        assert!(fit_powersgd(&shapes, &[0.0; 4], &[], &[], 0).is_zero());
    }

    /// A lower rank measured slower than a higher one at the same size
    /// (noise) is priced at the higher rank's cost; points already in
    /// order, and other sizes, are kept as measured.
    #[test]
    fn a_rank_measured_slower_than_a_higher_one_takes_its_cost() {
        let shapes = [
            (1024, 1024, 1),
            (1024, 1024, 2),
            (1024, 1024, 4),
            (1024, 4096, 1),
            (1024, 4096, 2),
            (1024, 4096, 4),
        ];
        let n = |i: usize| (shapes[i].0 * shapes[i].1) as f64;
        let per = [0.8e-9, 2.0e-9, 2.1e-9, 1.3e-9, 3.2e-9, 2.3e-9];
        let times: Vec<f64> = per.iter().enumerate().map(|(i, p)| p * n(i)).collect();
        let f = fit_powersgd(&shapes, &times, &[], &[], 0);
        let got: Vec<f64> = f.curve.iter().map(|p| p.per_elem).collect();
        let want = [0.8e-9, 2.0e-9, 2.1e-9, 1.3e-9, 2.3e-9, 2.3e-9];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-18, "{got:?}");
        }
        // Rank 1 above both higher ranks takes the least of them.
        let per = [2.5e-9, 2.0e-9, 2.1e-9];
        let times: Vec<f64> = per.iter().enumerate().map(|(i, p)| p * n(i)).collect();
        let f = fit_powersgd(&shapes[..3], &times, &[], &[], 0);
        assert!((f.curve[0].per_elem - 2.0e-9).abs() < 1e-18, "{f:?}");
    }
}
