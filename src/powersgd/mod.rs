//! PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019, Algorithm 1 with
//! error feedback, §3 and §4): a rank-`r` approximation of each layer's
//! gradient from one step of subspace (power) iteration, linear in the
//! gradient, so its factors ride an allreduce and its traffic does not grow
//! with the ranks. The logic only, with no I/O: the engine (`sync/job.rs`:
//! every PowerSGD layer's factors fused into one allreduce per phase) or
//! a test runs the two allreduces between the phases.
//!
//! One layer's step, as PyTorch's `powerSGD_hook` runs it (the reference
//! users compare against; its order and scalings are kept):
//!
//! 1. `M = G + E`: the gradient viewed as a `rows × cols` matrix
//!    ([`matrix_view`]: the first dimension by the product of the others,
//!    PyTorch's `tensor.view(shape[0], -1)`) plus the error kept from the
//!    last step ([`PowerSgd::begin`]).
//! 2. `P = M Q` (`rows × r`); **allreduce P (sum)**.
//! 3. `P ← orthogonalize(P)` ([`orthogonalize`]; the sum's scale does not
//!    matter), `Q = Mᵀ P` (`cols × r`) ([`PowerSgd::after_p`]);
//!    **allreduce Q (sum)**.
//! 4. `Q ← Q / p`, `M̂ = P Qᵀ` (the same on every rank: `P` and `Q` are),
//!    `E = M − M̂`; `M̂` is the step's averaged gradient
//!    ([`PowerSgd::after_q`]).
//!
//! `Q` starts from a standard normal draw seeded alike on every rank
//! ([`PowerSgd::new`], orthogonalized) and, with warm start, is the last
//! step's `Q` (orthogonalized again before use), as in the paper's §3.
//!
//! Products run on faer's matrix multiply (f32, sequential): the same
//! bits on every rank of one CPU type (faer picks its SIMD kernel by CPU,
//! so ranks on different CPU types may differ in the last bits of `M̂`,
//! which the engine must settle before it runs this); the orthogonalization is modified Gram–Schmidt applied
//! twice with f64 accumulation ("twice is enough"), and a column whose norm
//! falls to `RANK_TOL` of its norm before projection (a rank-deficient or
//! all-zero `P`) is set to zero instead of being divided by its rounding
//! error: its `Q` column is then zero and adds nothing to `M̂`.

use crate::{Error, Result};
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use serde::{Deserialize, Serialize};

/// A layer's PowerSGD parameters (`powersgd:rank=R,start=S,...`), as
/// PyTorch's `PowerSGDState` names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PowerSgdConfig {
    /// The approximation's rank `r` (`matrix_approximation_rank`; PyTorch
    /// recommends 1 to 4, the paper used 2 for ResNet and 4 for its LSTM).
    pub rank: usize,
    /// Steps (0-based) before this one are dense allreduces with no error
    /// kept (`start_powerSGD_iter`; PyTorch's docs example uses 10, its
    /// default is 1000: compression from the start hurts accuracy).
    pub start: u64,
    /// Keep `Q` across steps (the paper's §3 warm start); otherwise a fresh
    /// seeded draw every step.
    pub warm_start: bool,
    /// A layer is compressed only if its factors are at least this many
    /// times smaller than it (`min_compression_rate`); smaller layers,
    /// and layers of fewer than two dimensions, are allreduced dense.
    pub min_rate: f64,
    /// The seed of `Q`'s draws (the same on every rank; each layer mixes
    /// in its index).
    pub seed: u64,
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        PowerSgdConfig {
            rank: 1,
            start: 10,
            warm_start: true,
            min_rate: 2.0,
            seed: 0,
        }
    }
}

impl PowerSgdConfig {
    /// The parameters as `powersgd:` takes them.
    pub fn params(&self) -> String {
        format!(
            "rank={},start={},warm_start={},min_rate={},seed={}",
            self.rank, self.start, self.warm_start, self.min_rate, self.seed
        )
    }

    /// Whether the parameters can run: rank at least 1, a finite
    /// `min_rate` of at least 1.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::InvalidArgument(
                "powersgd: rank must be at least 1".into(),
            ));
        }
        if !(self.min_rate.is_finite() && self.min_rate >= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "powersgd: min_rate {} must be a number of at least 1",
                self.min_rate
            )));
        }
        Ok(())
    }

    /// The state of a layer of shape `shape` (its `id`-th in the table),
    /// or `None` where the layer is allreduced dense: fewer than two
    /// dimensions, or factors not `min_rate` times smaller.
    pub fn layer_state(&self, shape: &[usize], id: usize) -> Result<Option<PowerSgd>> {
        self.validate()?;
        let Some((rows, cols)) = matrix_view(shape) else {
            return Ok(None);
        };
        if !worth_compressing(rows, cols, self.rank, self.min_rate) {
            return Ok(None);
        }
        let seed = self.seed ^ (id as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        PowerSgd::new(rows, cols, self.rank, self.warm_start, seed).map(Some)
    }
}

/// What a snapshot keeps of a layer's PowerSGD state: everything that
/// shapes later steps (`Q`, the error, the draw counter, whether a step
/// ran since `Q` was drawn); the workspaces are rebuilt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PowerSgdSnapshot {
    q: Vec<f32>,
    error: Vec<f32>,
    draws: u64,
    stepped: bool,
}

/// A column whose norm after projection is at most this fraction of its
/// norm before is treated as dependent on the earlier ones and zeroed.
pub const RANK_TOL: f64 = 1e-6;

/// The `rows × cols` matrix PowerSGD sees of a layer of shape `shape`: the
/// first dimension by the product of the others; `None` for a layer of
/// fewer than two dimensions (biases, norms: those stay dense) or of no
/// elements.
pub fn matrix_view(shape: &[usize]) -> Option<(usize, usize)> {
    let (&rows, rest) = shape.split_first()?;
    if rest.is_empty() {
        return None;
    }
    let cols = rest.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    (rows > 0 && cols > 0).then_some((rows, cols))
}

/// Whether a `rows × cols` layer at rank `r` sends fewer elements as
/// factors (`(rows + cols)·r`) than whole, by at least `min_rate`
/// (PyTorch's `_should_compress`, `min_compression_rate` 2 by default).
pub fn worth_compressing(rows: usize, cols: usize, rank: usize, min_rate: f64) -> bool {
    let r = rank.min(rows).min(cols);
    (rows * cols) as f64 > min_rate * ((rows + cols) * r) as f64
}

/// One layer's PowerSGD state and workspace (sized once).
#[derive(Clone, Debug, PartialEq)]
pub struct PowerSgd {
    rows: usize,
    cols: usize,
    rank: usize,
    warm_start: bool,
    /// `Q`, `cols × r` row-major: the last step's (warm start) or the seeded
    /// draw.
    q: Vec<f32>,
    /// `P`, `rows × r` row-major.
    p: Vec<f32>,
    /// The error kept from the last step (`rows·cols`).
    error: Vec<f32>,
    /// `M = G + E` of the open step.
    m: Vec<f32>,
    seed: u64,
    draws: u64,
    /// A step has run since `Q` was drawn or set (warm start then
    /// orthogonalizes the kept `Q` before use, as PyTorch does).
    stepped: bool,
    /// What [`after_q`](Self::after_q) replaced, while it can be undone
    /// ([`rollback`](Self::rollback)): `Q`, the draw counter and `stepped`
    /// as [`begin`](Self::begin) found them (the old error is in `m`).
    undo: Undo,
}

/// The state before the open step, for [`PowerSgd::rollback`].
#[derive(Clone, Debug, PartialEq)]
struct Undo {
    /// `after_q` ran and nothing since: `m` holds the old error.
    armed: bool,
    q: Vec<f32>,
    draws: u64,
    stepped: bool,
}

impl PowerSgd {
    /// The state of a `rows × cols` layer at rank `min(rank, rows, cols)`,
    /// `Q` drawn from `seed` (the same on every rank gives the same `Q`).
    pub fn new(rows: usize, cols: usize, rank: usize, warm_start: bool, seed: u64) -> Result<Self> {
        if rows == 0 || cols == 0 || rank == 0 {
            return Err(Error::InvalidArgument(format!(
                "powersgd: a {rows} x {cols} matrix at rank {rank} (all must be at least 1)"
            )));
        }
        let rank = rank.min(rows).min(cols);
        let n = rows.checked_mul(cols).ok_or_else(|| {
            Error::InvalidArgument(format!("powersgd: {rows} x {cols} overflows"))
        })?;
        let mut s = PowerSgd {
            rows,
            cols,
            rank,
            warm_start,
            q: vec![0.0; cols * rank],
            p: vec![0.0; rows * rank],
            error: vec![0.0; n],
            m: vec![0.0; n],
            seed,
            draws: 0,
            stepped: false,
            undo: Undo {
                armed: false,
                q: vec![0.0; cols * rank],
                draws: 0,
                stepped: false,
            },
        };
        s.draw_q();
        Ok(s)
    }

    /// The rank in use (`min(rank, rows, cols)`).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Rows and columns.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Elements of `P` and of `Q` (what each allreduce carries).
    pub fn factor_lens(&self) -> (usize, usize) {
        (self.p.len(), self.q.len())
    }

    /// `Q` (`cols × r`, row-major).
    pub fn q(&self) -> &[f32] {
        &self.q
    }

    /// Set `Q` (`cols × r`, row-major), e.g. to start from a reference's.
    pub fn set_q(&mut self, q: &[f32]) -> Result<()> {
        if q.len() != self.q.len() {
            return Err(Error::InvalidArgument(format!(
                "powersgd: Q of {} elements for a {} x {} layer at rank {} (want {})",
                q.len(),
                self.rows,
                self.cols,
                self.rank,
                self.q.len()
            )));
        }
        self.q.copy_from_slice(q);
        self.stepped = false;
        self.undo.armed = false;
        Ok(())
    }

    /// The error kept from the last step.
    pub fn error(&self) -> &[f32] {
        &self.error
    }

    /// The state a snapshot keeps ([`PowerSgdSnapshot`]).
    pub fn snapshot(&self) -> PowerSgdSnapshot {
        PowerSgdSnapshot {
            q: self.q.clone(),
            error: self.error.clone(),
            draws: self.draws,
            stepped: self.stepped,
        }
    }

    /// Take a snapshot's state, after checking it fits this layer (the
    /// factor and error lengths, finite values); on an error nothing
    /// changes.
    pub fn restore(&mut self, s: &PowerSgdSnapshot) -> Result<()> {
        if s.q.len() != self.q.len() || s.error.len() != self.error.len() {
            return Err(Error::InvalidArgument(format!(
                "PowerSGD state of Q {} and error {} elements for a {} x {} layer at rank {} \
                 (want {} and {})",
                s.q.len(),
                s.error.len(),
                self.rows,
                self.cols,
                self.rank,
                self.q.len(),
                self.error.len()
            )));
        }
        if let Some(i) = s.q.iter().chain(&s.error).position(|x| !x.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "PowerSGD state: element {i} of Q and error is not finite"
            )));
        }
        self.q.copy_from_slice(&s.q);
        self.error.copy_from_slice(&s.error);
        self.draws = s.draws;
        self.stepped = s.stepped;
        self.undo.armed = false;
        Ok(())
    }

    /// A fresh standard-normal `Q` from `(seed, draw)`, orthogonalized.
    fn draw_q(&mut self) {
        let mut rng = Normal::new(self.seed ^ self.draws.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for v in &mut self.q {
            *v = rng.next() as f32;
        }
        self.draws += 1;
        orthogonalize(&mut self.q, self.cols, self.rank);
    }

    /// Warm start keeps `Q`; a column of it that came back zero (the last
    /// step's `P` was rank-deficient: an all-zero layer, a gradient of
    /// lower rank) would stay zero for good and the layer's approximation
    /// lose that rank for the rest of the run. Such columns are drawn
    /// afresh (seeded, so alike on every rank) and `Q` orthogonalized
    /// again; a column dependent again stays zero until the next step.
    fn refill_zero_columns(&mut self) {
        let (r, cols) = (self.rank, self.cols);
        let zero: Vec<usize> = (0..r)
            .filter(|&j| (0..cols).all(|i| self.q[i * r + j] == 0.0))
            .collect();
        if zero.is_empty() {
            return;
        }
        let mut rng = Normal::new(self.seed ^ self.draws.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        self.draws += 1;
        for i in 0..cols {
            for &j in &zero {
                self.q[i * r + j] = rng.next() as f32;
            }
        }
        orthogonalize(&mut self.q, cols, r);
    }

    /// Step 1–2: `M = grad + E` and `P = M Q` into `p_out` (`rows × r`),
    /// the buffer the caller allreduces (sum).
    pub fn begin(&mut self, grad: &[f32], p_out: &mut [f32]) -> Result<()> {
        let n = self.m.len();
        if grad.len() != n || p_out.len() != self.p.len() {
            return Err(Error::InvalidArgument(format!(
                "powersgd: a gradient of {} elements and P of {} for a {} x {} layer at rank {}",
                grad.len(),
                p_out.len(),
                self.rows,
                self.cols,
                self.rank
            )));
        }
        // What a failed step restores (`m` is overwritten below: the last
        // step can no longer be undone).
        self.undo.armed = false;
        self.undo.q.copy_from_slice(&self.q);
        self.undo.draws = self.draws;
        self.undo.stepped = self.stepped;
        if !self.stepped {
            // The drawn (or given) Q, as it is.
        } else if self.warm_start {
            orthogonalize(&mut self.q, self.cols, self.rank);
            self.refill_zero_columns();
        } else {
            self.draw_q();
        }
        for ((m, g), e) in self.m.iter_mut().zip(grad).zip(&self.error) {
            *m = g + e;
        }
        // Row-major M (rows × cols) is column-major Mᵀ; Pᵀ = Qᵀ Mᵀ.
        let (r, rows, cols) = (self.rank, self.rows, self.cols);
        let mt = MatRef::from_column_major_slice(&self.m, cols, rows);
        let qt = MatRef::from_column_major_slice(&self.q, r, cols);
        let pt = MatMut::from_column_major_slice_mut(p_out, r, rows);
        matmul(pt, Accum::Replace, qt, mt, 1.0f32, Par::Seq);
        crate::cpu::clear_upper_state();
        Ok(())
    }

    /// Step 3: with `p_sum` the allreduced `P`, orthogonalize it and write
    /// `Q = Mᵀ P` into `q_out` (`cols × r`), the buffer the caller
    /// allreduces (sum).
    pub fn after_p(&mut self, p_sum: &[f32], q_out: &mut [f32]) -> Result<()> {
        if p_sum.len() != self.p.len() || q_out.len() != self.q.len() {
            return Err(Error::InvalidArgument(format!(
                "powersgd: P of {} and Q of {} elements (want {} and {})",
                p_sum.len(),
                q_out.len(),
                self.p.len(),
                self.q.len()
            )));
        }
        self.p.copy_from_slice(p_sum);
        orthogonalize(&mut self.p, self.rows, self.rank);
        // Qᵀ = Pᵀ M.
        let (r, rows, cols) = (self.rank, self.rows, self.cols);
        let mt = MatRef::from_column_major_slice(&self.m, cols, rows);
        let pt = MatRef::from_column_major_slice(&self.p, r, rows);
        let qt = MatMut::from_column_major_slice_mut(q_out, r, cols);
        matmul(qt, Accum::Replace, pt, mt.transpose(), 1.0f32, Par::Seq);
        crate::cpu::clear_upper_state();
        Ok(())
    }

    /// Step 4: with `q_sum` the allreduced `Q` over `ranks` ranks, write
    /// `M̂ = P (Q/p)ᵀ` into `out` (the layer's averaged gradient, the same
    /// on every rank) and keep `E = M − M̂` (and, with warm start, `Q/p`
    /// for the next step). Until the next [`begin`](Self::begin) the step
    /// can be undone ([`rollback`](Self::rollback)): the old error is kept
    /// in the workspace `M` held (swapped, not copied).
    pub fn after_q(&mut self, q_sum: &[f32], ranks: usize, out: &mut [f32]) -> Result<()> {
        if q_sum.len() != self.q.len() || out.len() != self.m.len() || ranks == 0 {
            return Err(Error::InvalidArgument(format!(
                "powersgd: Q of {} elements and an output of {} on {ranks} ranks (want {} and {})",
                q_sum.len(),
                out.len(),
                self.q.len(),
                self.m.len()
            )));
        }
        let inv = ranks as f32;
        for (q, s) in self.q.iter_mut().zip(q_sum) {
            *q = s / inv;
        }
        // M̂ row-major is column-major M̂ᵀ = Q Pᵀ.
        let (r, rows, cols) = (self.rank, self.rows, self.cols);
        let qt = MatRef::from_column_major_slice(&self.q, r, cols);
        let pt = MatRef::from_column_major_slice(&self.p, r, rows);
        let mhat = MatMut::from_column_major_slice_mut(out, cols, rows);
        matmul(mhat, Accum::Replace, qt.transpose(), pt, 1.0f32, Par::Seq);
        crate::cpu::clear_upper_state();
        if !out.iter().all(|x| x.is_finite()) {
            // An overflow (of `G + E`, a product or the sums): the caller
            // reports the non-finite result; the state starts over (no
            // error kept, `Q` drawn again), alike on every rank, where a
            // NaN kept in `E` would poison every later step.
            std::mem::swap(&mut self.error, &mut self.m);
            self.error.fill(0.0);
            self.draw_q();
            self.stepped = false;
            self.undo.armed = true;
            return Ok(());
        }
        // `M − M̂` in place, then swapped in: `m` keeps the old error.
        for (m, o) in self.m.iter_mut().zip(out.iter()) {
            *m -= o;
        }
        std::mem::swap(&mut self.error, &mut self.m);
        self.stepped = true;
        self.undo.armed = true;
        Ok(())
    }

    /// Undo the last [`after_q`](Self::after_q) (the error, `Q`, the draw
    /// counter: the state before its [`begin`](Self::begin)), when nothing
    /// ran since and it was not [`settle`](Self::settle)d: a step that
    /// ran this layer and then failed elsewhere leaves no trace, as a
    /// whole step that fails before its factors' allreduces. Returns
    /// whether it undid anything.
    pub fn rollback(&mut self) -> bool {
        if !self.undo.armed {
            return false;
        }
        std::mem::swap(&mut self.error, &mut self.m);
        self.q.copy_from_slice(&self.undo.q);
        self.draws = self.undo.draws;
        self.stepped = self.undo.stepped;
        self.undo.armed = false;
        true
    }

    /// The last step stands: a later [`rollback`](Self::rollback) does
    /// nothing (the engine settles every layer when a step opens).
    pub fn settle(&mut self) {
        self.undo.armed = false;
    }
}

/// Orthonormalize the `rank` columns of `a` (`rows × rank`, row-major) in
/// place: modified Gram–Schmidt applied twice, sums in f64. A column left
/// with at most [`RANK_TOL`] of its norm after the projections (dependent
/// on the earlier ones, or zero) is set to zero.
pub fn orthogonalize(a: &mut [f32], rows: usize, rank: usize) {
    debug_assert_eq!(a.len(), rows * rank);
    let col_norm = |a: &[f32], j: usize| -> f64 {
        (0..rows)
            .map(|i| {
                let v = a[i * rank + j] as f64;
                v * v
            })
            .sum::<f64>()
            .sqrt()
    };
    for j in 0..rank {
        let before = col_norm(a, j);
        for _pass in 0..2 {
            for k in 0..j {
                let dot: f64 = (0..rows)
                    .map(|i| a[i * rank + k] as f64 * a[i * rank + j] as f64)
                    .sum();
                for i in 0..rows {
                    a[i * rank + j] -= (dot * a[i * rank + k] as f64) as f32;
                }
            }
        }
        let after = col_norm(a, j);
        let dependent = !(after.is_finite() && after > RANK_TOL * before && after > 0.0);
        for i in 0..rows {
            let v = &mut a[i * rank + j];
            *v = if dependent {
                0.0
            } else {
                (*v as f64 / after) as f32
            };
        }
    }
}

/// Standard normal numbers from a seed (SplitMix64 and Box–Muller): the
/// same sequence on every rank and platform.
struct Normal {
    state: u64,
    spare: Option<f64>,
}

impl Normal {
    fn new(seed: u64) -> Self {
        Normal {
            state: seed,
            spare: None,
        }
    }

    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // 53 bits in (0, 1].
        ((z >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn next(&mut self) -> f64 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let (u, v) = (self.uniform(), self.uniform());
        let r = (-2.0 * u.ln()).sqrt();
        let t = std::f64::consts::TAU * v;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
}

#[cfg(test)]
mod tests;
