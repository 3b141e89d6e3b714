//! GradiVeQ (Yu et al., NeurIPS 2018): a PCA compressor that commutes with
//! summation, and a ring all-reduce that aggregates in the compressed
//! domain (§2, Algorithm 1, eqs. 3–6).
//!
//! * [`flatten_conv`]: a convolution's `(H, W, D, F)` gradient reordered so
//!   the `F` collocated gradients of the filters are adjacent, filled along
//!   depth, then width, then height (Fig. 3a).
//! * [`Compressor`]: from `L_t` aggregated samples of a slice of `K`
//!   adjacent gradients, the mean `μ` and the top-`d` eigenvectors `U_d` of
//!   the sample covariance (symmetric eigendecomposition with faer, in f64,
//!   sequential, so every rank computes the same bits from the same
//!   samples); `d` is the smallest with retained energy `≥ 1 − λ` (eq. 6)
//!   or given. Compression `U_dᵀ(g_n − μ/N)` (eq. 3), decompression
//!   `U_d g' + μ` (eq. 5); the sum of the compressed slices of the `N` ranks
//!   is the compression of the sum (eq. 4).
//! * [`LayerCompressor`]: a layer of `n` elements as `⌊n/K⌋` slices, one
//!   compressor per group of `s` consecutive slices (the reuse factor; `s =
//!   ∞` is one compressor per layer, fitted on its first slice as the paper
//!   does), the `n mod K` tail carried uncompressed.
//! * [`ring`]: Algorithm 1 over any [`Transport`](crate::comm::Transport),
//!   compression of the next segment overlapped with the transfer of the
//!   previous one, and the QSGD ring the paper compares against.
//!
//! * [`schedule`]: warm-up, `L_t` QSGD-aggregated iterations that supply the
//!   PCA samples, up to `L_c` compressed iterations, and the eq.-7 loss
//!   monitor whose majority vote triggers an early rebuild.
//!
//! The engine runs it as `Strategy::Gradiveq` (each layer its own ring on
//! the progress thread, `src/sync/job.rs`) and keeps its state in
//! snapshots (`src/sync/snapshot.rs`).

pub mod ring;
pub mod schedule;

use crate::{Error, Result};
use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{self_adjoint_evd, self_adjoint_evd_scratch, ComputeEigenvectors};
use faer::{Mat, Par};

/// Reorder a convolution gradient stored as `(H, W, D, F)` (row-major,
/// filter index fastest) into GradiVeQ's flattening: for each position
/// (height, then width, then depth) the `F` collocated filter gradients are
/// adjacent, filling along depth first, then width, then height (Fig. 3a).
///
/// With the `(H, W, D, F)` row-major layout this is already the order
/// `((h·W + w)·D + d)·F + f`; the function validates the shape and copies,
/// and [`flatten_conv_from_fdhw`] converts from the `(F, D, H, W)` layout of
/// most frameworks.
pub fn flatten_conv(grad: &[f32], shape: [usize; 4], out: &mut Vec<f32>) -> Result<()> {
    let n: usize = shape.iter().product();
    if grad.len() != n {
        return Err(Error::InvalidArgument(format!(
            "gradient has {} elements, shape {shape:?} needs {n}",
            grad.len()
        )));
    }
    out.clear();
    out.extend_from_slice(grad);
    Ok(())
}

/// [`flatten_conv`] from a `(F, D, H, W)` (PyTorch `Conv2d.weight`) layout.
pub fn flatten_conv_from_fdhw(
    grad: &[f32],
    shape_fdhw: [usize; 4],
    out: &mut Vec<f32>,
) -> Result<()> {
    let [f, d, h, w] = shape_fdhw;
    let n = f * d * h * w;
    if grad.len() != n {
        return Err(Error::InvalidArgument(format!(
            "gradient has {} elements, shape {shape_fdhw:?} needs {n}",
            grad.len()
        )));
    }
    out.clear();
    out.resize(n, 0.0);
    for hi in 0..h {
        for wi in 0..w {
            for di in 0..d {
                let base = ((hi * w + wi) * d + di) * f;
                for fi in 0..f {
                    out[base + fi] = grad[((fi * d + di) * h + hi) * w + wi];
                }
            }
        }
    }
    Ok(())
}

/// The default slice size for a convolution with `f` filters of depth `d`
/// and kernel height `h`: `K = h·F·D` (the paper's 768 for a (3,3,16,16)
/// layer: a multiple of `F·D`, where its Fig. 5 shows the loss drops).
pub fn default_slice_size(kernel_h: usize, depth: usize, filters: usize) -> usize {
    kernel_h * depth * filters
}

/// How many components to keep.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dim {
    /// The smallest `d` with retained energy `≥ 1 − λ` (eq. 6).
    Lambda(f64),
    /// Exactly `d` (at most `K`).
    Fixed(usize),
}

/// A slice compressor: `U_d` (`K × d`) and the whitening vector `μ`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Compressor {
    k: usize,
    d: usize,
    /// `U_dᵀ`, row-major `d × K`: row `j` is eigenvector `j`.
    ut: Vec<f32>,
    mu: Vec<f32>,
    /// `U_dᵀ μ` (subtracted, divided by N, from every compressed slice).
    ut_mu: Vec<f32>,
    /// Eigenvalues, descending (all `K`).
    eig: Vec<f64>,
}

impl Compressor {
    /// PCA of `samples` (each of length `K`, at least 2): mean, covariance,
    /// symmetric eigendecomposition, top `d` by `dim`.
    pub fn fit(samples: &[&[f32]], dim: Dim) -> Result<Self> {
        let (l, k) = check_samples(samples)?;
        let mean = sample_mean(samples, k, l);
        let cov = sample_covariance(samples, &mean, l);
        let (s, u) = symmetric_evd(&cov, k)?;
        // Descending order of eigenvalues.
        let mut order: Vec<usize> = (0..k).collect();
        let sv: Vec<f64> = (0..k).map(|i| s[i].max(0.0)).collect();
        order.sort_by(|&a, &b| sv[b].total_cmp(&sv[a]).then(a.cmp(&b)));
        let eig: Vec<f64> = order.iter().map(|&i| sv[i]).collect();
        let d = kept_components(dim, &eig, k)?;
        let ut = signed_basis(&u, &order, d, k);
        let mu: Vec<f32> = mean.iter().map(|&m| m as f32).collect();
        let ut_mu = (0..d)
            .map(|j| {
                ut[j * k..(j + 1) * k]
                    .iter()
                    .zip(&mu)
                    .map(|(u, m)| f64::from(*u) * f64::from(*m))
                    .sum::<f64>() as f32
            })
            .collect();
        Ok(Compressor {
            k,
            d,
            ut,
            mu,
            ut_mu,
            eig,
        })
    }

    /// Slice size `K`.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Kept components `d`.
    pub fn d(&self) -> usize {
        self.d
    }
    /// The whitening vector `μ` (mean of the samples).
    pub fn mu(&self) -> &[f32] {
        &self.mu
    }
    /// Eigenvalues of the sample covariance, descending.
    pub fn eigenvalues(&self) -> &[f64] {
        &self.eig
    }
    /// Fraction of the sample energy the kept components retain.
    pub fn retained_energy(&self) -> f64 {
        let total: f64 = self.eig.iter().sum();
        if total <= 0.0 {
            1.0
        } else {
            self.eig[..self.d].iter().sum::<f64>() / total
        }
    }

    /// Eq. (3): `out = U_dᵀ(g − μ/N)` (`out.len() == d`).
    pub fn compress(&self, g: &[f32], n_ranks: usize, out: &mut [f32]) {
        debug_assert_eq!(g.len(), self.k);
        debug_assert_eq!(out.len(), self.d);
        let inv = 1.0 / n_ranks as f32;
        for (j, o) in out.iter_mut().enumerate() {
            let row = &self.ut[j * self.k..(j + 1) * self.k];
            let mut acc = [0f32; 8];
            let (rc, gc, mc) = (
                row.chunks_exact(8),
                g.chunks_exact(8),
                self.mu.chunks_exact(8),
            );
            let tail: f32 = row[rc.len() * 8..]
                .iter()
                .zip(&g[gc.len() * 8..])
                .zip(&self.mu[mc.len() * 8..])
                .map(|((u, x), m)| u * (x - m * inv))
                .sum();
            for ((r, x), m) in rc.zip(gc).zip(mc) {
                for l in 0..8 {
                    acc[l] += r[l] * (x[l] - m[l] * inv);
                }
            }
            *o = acc.iter().sum::<f32>() + tail;
        }
    }

    /// Eq. (5): `out = U_d g' + μ`.
    pub fn decompress(&self, gc: &[f32], out: &mut [f32]) {
        debug_assert_eq!(gc.len(), self.d);
        out.copy_from_slice(&self.mu);
        for (j, &c) in gc.iter().enumerate() {
            let row = &self.ut[j * self.k..(j + 1) * self.k];
            for (o, &u) in out.iter_mut().zip(row) {
                *o += c * u;
            }
        }
    }

    /// Check the internal sizes (after deserializing untrusted bytes).
    pub fn validate(&self) -> Result<()> {
        let ok = self.k > 0
            && (1..=self.k).contains(&self.d)
            && self.ut.len() == self.d * self.k
            && self.mu.len() == self.k
            && self.ut_mu.len() == self.d
            && self.eig.len() == self.k;
        let finite = self
            .ut
            .iter()
            .chain(&self.mu)
            .chain(&self.ut_mu)
            .all(|v| v.is_finite())
            && self.eig.iter().all(|v| v.is_finite());
        if ok && !finite {
            return Err(Error::Decode(
                "GradiVeQ compressor holds NaN/Inf".to_string(),
            ));
        }
        if ok {
            Ok(())
        } else {
            Err(Error::Decode(format!(
                "inconsistent GradiVeQ compressor (K {}, d {})",
                self.k, self.d
            )))
        }
    }

    /// A hash of the compressor's bits (to compare across ranks).
    pub fn hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: &[u8]| {
            for &x in b {
                h = (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(&(self.k as u64).to_le_bytes());
        eat(&(self.d as u64).to_le_bytes());
        for v in self.ut.iter().chain(&self.mu) {
            eat(&v.to_bits().to_le_bytes());
        }
        h
    }
}

/// The smallest `d` with `Σ_{k<d} s_k / Σ s_k ≥ 1 − λ` (eq. 6), at least 1.
pub fn select_d(eig_desc: &[f64], lambda: f64) -> usize {
    let total: f64 = eig_desc.iter().sum();
    if total <= 0.0 {
        return 1;
    }
    let mut acc = 0.0;
    for (i, &e) in eig_desc.iter().enumerate() {
        acc += e;
        if acc / total >= 1.0 - lambda {
            return i + 1;
        }
    }
    eig_desc.len().max(1)
}

/// [`Compressor::fit`]'s argument checks: at least 2 samples of one positive
/// length, all finite; returns `(L, K)`.
fn check_samples(samples: &[&[f32]]) -> Result<(usize, usize)> {
    let l = samples.len();
    let k = samples.first().map_or(0, |s| s.len());
    if l < 2 || k == 0 || samples.iter().any(|s| s.len() != k) {
        return Err(Error::InvalidArgument(format!(
            "PCA needs at least 2 samples of one positive length (got {l} of lengths {:?})",
            samples
                .iter()
                .map(|s| s.len())
                .collect::<std::collections::BTreeSet<_>>()
        )));
    }
    if samples.iter().any(|s| s.iter().any(|x| !x.is_finite())) {
        return Err(Error::InvalidArgument("PCA samples hold NaN/Inf".into()));
    }
    Ok((l, k))
}

/// The mean of the `l` samples of length `k`, in f64, summed in sample order.
fn sample_mean(samples: &[&[f32]], k: usize, l: usize) -> Vec<f64> {
    let mut mean = vec![0f64; k];
    for s in samples {
        for (m, &x) in mean.iter_mut().zip(s.iter()) {
            *m += f64::from(x);
        }
    }
    for m in &mut mean {
        *m /= l as f64;
    }
    mean
}

/// The sample covariance (divided by `l − 1`) of the `l` samples about
/// `mean`, as a symmetric `K × K` matrix.
fn sample_covariance(samples: &[&[f32]], mean: &[f64], l: usize) -> Mat<f64> {
    let k = mean.len();
    // Covariance (K × K, column-major), a fixed summation order.
    let mut cov = Mat::<f64>::zeros(k, k);
    let mut centered = vec![0f64; k];
    for s in samples {
        for ((c, &x), m) in centered.iter_mut().zip(s.iter()).zip(mean) {
            *c = f64::from(x) - m;
        }
        for j in 0..k {
            let cj = centered[j];
            if cj == 0.0 {
                continue;
            }
            let col = cov
                .col_mut(j)
                .try_as_col_major_mut()
                .expect("owned columns are contiguous");
            let col = col.as_slice_mut();
            for i in j..k {
                col[i] += centered[i] * cj;
            }
        }
    }
    let scale = 1.0 / (l as f64 - 1.0);
    for j in 0..k {
        for i in j..k {
            let v = cov[(i, j)] * scale;
            cov[(i, j)] = v;
            cov[(j, i)] = v;
        }
    }
    cov
}

/// Eigenvalues and eigenvectors of the symmetric `k × k` matrix `cov`
/// (faer, sequential), in the solver's order.
fn symmetric_evd(cov: &Mat<f64>, k: usize) -> Result<(Diag<f64>, Mat<f64>)> {
    let mut s = Diag::<f64>::zeros(k);
    let mut u = Mat::<f64>::zeros(k, k);
    let params = Default::default();
    let mut mem = MemBuffer::new(self_adjoint_evd_scratch::<f64>(
        k,
        ComputeEigenvectors::Yes,
        Par::Seq,
        params,
    ));
    let r = self_adjoint_evd(
        cov.as_ref(),
        s.as_mut(),
        Some(u.as_mut()),
        Par::Seq,
        MemStack::new(&mut mem),
        params,
    )
    .map_err(|e| Error::InvalidArgument(format!("eigendecomposition failed: {e:?}")));
    crate::cpu::clear_upper_state();
    r?;
    Ok((s, u))
}

/// The number of components `d` that `dim` keeps of the descending
/// eigenvalues `eig` of a slice of size `k` (checking `dim`).
fn kept_components(dim: Dim, eig: &[f64], k: usize) -> Result<usize> {
    Ok(match dim {
        Dim::Fixed(d) if (1..=k).contains(&d) => d,
        Dim::Fixed(d) => {
            return Err(Error::InvalidArgument(format!(
                "d {d} must be in 1..={k} (the slice size)"
            )))
        }
        Dim::Lambda(lambda) => {
            if !(0.0..1.0).contains(&lambda) {
                return Err(Error::InvalidArgument(format!(
                    "lambda {lambda} must lie in [0, 1)"
                )));
            }
            select_d(eig, lambda)
        }
    })
}

/// `U_dᵀ` (row-major `d × k`, f32): the eigenvector columns of `u` named by
/// the first `d` entries of `order`, each signed by the sign convention.
fn signed_basis(u: &Mat<f64>, order: &[usize], d: usize, k: usize) -> Vec<f32> {
    let mut ut = vec![0f32; d * k];
    for (j, &col) in order.iter().take(d).enumerate() {
        // A sign convention (largest-magnitude entry positive) so the
        // basis does not depend on the solver's arbitrary signs.
        let c = u.col(col);
        let (mut best, mut sign) = (0f64, 1f64);
        for i in 0..k {
            if c[i].abs() > best {
                best = c[i].abs();
                sign = c[i].signum();
            }
        }
        for i in 0..k {
            ut[j * k + i] = (sign * c[i]) as f32;
        }
    }
    ut
}

/// A layer of `n` elements: `⌊n/K⌋` slices compressed in groups of `s`
/// slices sharing one compressor, the `n mod K` tail uncompressed.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayerCompressor {
    n: usize,
    k: usize,
    reuse: usize,
    groups: Vec<Compressor>,
}

impl LayerCompressor {
    /// Fit from `samples` of the whole aggregated layer (each of length
    /// `n`): the compressor of each group of `reuse` slices (`None` = one
    /// group) is fitted on the samples of the group's first slice.
    pub fn fit(samples: &[&[f32]], k: usize, reuse: Option<usize>, dim: Dim) -> Result<Self> {
        let n = samples.first().map_or(0, |s| s.len());
        if k == 0 || n < k {
            return Err(Error::InvalidArgument(format!(
                "slice size {k} must be in 1..={n} (the layer length)"
            )));
        }
        let slices = n / k;
        let reuse = match reuse {
            None => slices,
            Some(r) if (1..=slices).contains(&r) => r,
            Some(r) => {
                return Err(Error::InvalidArgument(format!(
                    "reuse {r} must be in 1..={slices} (the slices of {k})"
                )))
            }
        };
        let mut groups = Vec::new();
        let mut first = 0;
        while first < slices {
            let sl: Vec<&[f32]> = samples
                .iter()
                .map(|s| &s[first * k..(first + 1) * k])
                .collect();
            groups.push(Compressor::fit(&sl, dim)?);
            first += reuse;
        }
        Ok(LayerCompressor {
            n,
            k,
            reuse,
            groups,
        })
    }

    /// One compressor for the whole layer of `n` elements (`s = ∞`),
    /// fitted beforehand on samples of one slice.
    pub fn single(n: usize, c: Compressor) -> Result<Self> {
        let k = c.k();
        if k == 0 || n < k {
            return Err(Error::InvalidArgument(format!(
                "slice size {k} must be in 1..={n} (the layer length)"
            )));
        }
        Ok(LayerCompressor {
            n,
            k,
            reuse: n / k,
            groups: vec![c],
        })
    }

    /// Check the internal sizes (after deserializing untrusted bytes).
    pub fn validate(&self) -> Result<()> {
        let slices = self.n.checked_div(self.k).unwrap_or(0);
        if slices == 0
            || self.reuse == 0
            || self.groups.len() != slices.div_ceil(self.reuse)
            || self.groups.iter().any(|c| c.k() != self.k)
        {
            return Err(Error::Decode(
                "inconsistent GradiVeQ layer compressor".into(),
            ));
        }
        self.groups.iter().try_for_each(Compressor::validate)
    }

    /// Layer length.
    pub fn len(&self) -> usize {
        self.n
    }
    /// True for an empty layer (never: fitting needs `n ≥ K`).
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Slice size.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Number of whole slices.
    pub fn slices(&self) -> usize {
        self.n / self.k
    }
    /// The compressors (one per group of slices).
    pub fn groups(&self) -> &[Compressor] {
        &self.groups
    }
    fn comp(&self, slice: usize) -> &Compressor {
        &self.groups[slice / self.reuse]
    }
    /// The compressor of slice `slice`.
    pub fn group_of(&self, slice: usize) -> &Compressor {
        self.comp(slice)
    }
    /// A layer from compressors already fitted: group `i` covers slices
    /// `i·reuse .. (i+1)·reuse`.
    pub fn from_groups(n: usize, k: usize, reuse: usize, groups: Vec<Compressor>) -> Result<Self> {
        let slices = n.checked_div(k).unwrap_or(0);
        if k == 0
            || slices == 0
            || reuse == 0
            || groups.len() != slices.div_ceil(reuse)
            || groups.iter().any(|c| c.k() != k)
        {
            return Err(Error::InvalidArgument(format!(
                "{} compressors do not cover {slices} slices of {k} in groups of {reuse}",
                groups.len()
            )));
        }
        Ok(LayerCompressor {
            n,
            k,
            reuse,
            groups,
        })
    }
    /// Compressed length of slices `a..b` (plus the tail when `b` is the
    /// last slice and `with_tail`).
    pub fn compressed_len(&self, a: usize, b: usize, with_tail: bool) -> usize {
        (a..b).map(|m| self.comp(m).d()).sum::<usize>()
            + if with_tail { self.n % self.k } else { 0 }
    }
    /// Compression ratio `n / compressed length`.
    pub fn ratio(&self) -> f64 {
        self.n as f64 / self.compressed_len(0, self.slices(), true) as f64
    }
    /// Runs `[x, y)` of slices in `a..b` that share one compressor.
    fn runs(&self, a: usize, b: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let mut x = a;
        std::iter::from_fn(move || {
            if x >= b {
                return None;
            }
            let end = ((x / self.reuse + 1) * self.reuse).min(b);
            let r = (x, end);
            x = end;
            Some(r)
        })
    }

    /// Compress slices `a..b` of `g` (the whole layer) into `out` (eq. 3 for
    /// every slice, as one matrix product `U_dᵀ X` over the slices of each
    /// compressor group), and the tail, unchanged, when `with_tail`.
    pub fn compress_range(
        &self,
        g: &[f32],
        n_ranks: usize,
        a: usize,
        b: usize,
        with_tail: bool,
        out: &mut [f32],
    ) {
        use faer::linalg::matmul::matmul;
        use faer::{Accum, MatMut, MatRef};
        let mut o = 0;
        let inv = 1.0 / n_ranks as f32;
        for (x, y) in self.runs(a, b) {
            let c = self.comp(x);
            let (k, d, cols) = (self.k, c.d(), y - x);
            let xs = MatRef::from_column_major_slice(&g[x * k..y * k], k, cols);
            let u = MatRef::from_column_major_slice(&c.ut, k, d);
            let dst = MatMut::from_column_major_slice_mut(&mut out[o..o + d * cols], d, cols);
            matmul(dst, Accum::Replace, u.transpose(), xs, 1.0f32, Par::Seq);
            crate::cpu::clear_upper_state();
            // − U_dᵀ μ / N for every slice.
            for col in out[o..o + d * cols].chunks_exact_mut(d) {
                for (v, w) in col.iter_mut().zip(&c.ut_mu) {
                    *v -= w * inv;
                }
            }
            o += d * cols;
        }
        if with_tail {
            let t = self.slices() * self.k;
            out[o..o + (self.n - t)].copy_from_slice(&g[t..]);
        }
    }
    /// Decompress `gc` (slices `a..b`, tail when `with_tail`) into the
    /// matching range of `out` (the whole layer): eq. 5, `U_d C + μ`, as one
    /// matrix product per compressor group.
    pub fn decompress_range(
        &self,
        gc: &[f32],
        a: usize,
        b: usize,
        with_tail: bool,
        out: &mut [f32],
    ) {
        use faer::linalg::matmul::matmul;
        use faer::{Accum, MatMut, MatRef};
        let mut o = 0;
        for (x, y) in self.runs(a, b) {
            let c = self.comp(x);
            let (k, d, cols) = (self.k, c.d(), y - x);
            let dst_slice = &mut out[x * k..y * k];
            for col in dst_slice.chunks_exact_mut(k) {
                col.copy_from_slice(&c.mu);
            }
            let cs = MatRef::from_column_major_slice(&gc[o..o + d * cols], d, cols);
            let u = MatRef::from_column_major_slice(&c.ut, k, d);
            let dst = MatMut::from_column_major_slice_mut(dst_slice, k, cols);
            matmul(dst, Accum::Add, u, cs, 1.0f32, Par::Seq);
            crate::cpu::clear_upper_state();
            o += d * cols;
        }
        if with_tail {
            let t = self.slices() * self.k;
            let len = self.n - t;
            out[t..].copy_from_slice(&gc[o..o + len]);
        }
    }
    /// Centralized reference: `U(Uᵀ(g − μ)) + μ` of an aggregated `g`.
    pub fn round_trip(&self, g: &[f32], out: &mut [f32]) {
        let mut c = vec![0f32; self.compressed_len(0, self.slices(), true)];
        self.compress_range(g, 1, 0, self.slices(), true, &mut c);
        self.decompress_range(&c, 0, self.slices(), true, out);
    }
    /// Hash of every compressor (to compare across ranks).
    pub fn hash(&self) -> u64 {
        self.groups
            .iter()
            .fold(self.n as u64 ^ (self.k as u64) << 32, |h, c| {
                (h ^ c.hash()).wrapping_mul(0x0100_0000_01b3)
            })
    }
}

#[cfg(test)]
mod tests;
