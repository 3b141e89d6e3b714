//! An O(k) sparse allreduce of one layer's sparse contribution: Ok-Topk's
//! split-and-reduce followed by an allgather of the reduced regions
//! (Li & Hoefler, "Near-optimal sparse allreduce for distributed deep
//! learning", PPoPP'22), with SparCML's switch to a dense representation
//! of a region whose reduced result has filled in (Renggli et al.,
//! "SparCML: high-performance sparse communication for machine learning",
//! SC'19).
//!
//! Every rank passes `k_r` pairs `(index, value)` with indices in `[0, n)`
//! (sorted or not; duplicates on one rank are summed) and gets the exact
//! sum of all contributions, written into a dense output of length `n`.
//! Beside the fused allgather of [`super`] (every rank receives every
//! rank's unit, `(p−1)·(8k+4)` bytes per rank, O(k·p)), this costs O(k):
//!
//! 1. **Agreement** (one 56-byte recursive-doubling max): a failure of one
//!    rank's arguments (an index `≥ n`, index and value slices of different
//!    lengths, an output of the wrong length) becomes
//!    [`Error::RankFailed`] naming that rank on every rank (through
//!    [`crate::comm::agree::agree`]), different `n` becomes
//!    [`Error::SizeMismatch`] and different options (balancing,
//!    reselection, the allgatherv algorithm) [`Error::ArgumentMismatch`],
//!    on every rank alike.
//! 2. **Region boundaries** ([`Balance`]): `[0, n)` is cut into `p`
//!    regions, region `j` owned by rank `j`. [`Balance::Sampled`] (the
//!    default) balances them by the global distribution of the selected
//!    indices, as Ok-Topk does: every rank contributes up to `s` evenly
//!    spaced quantiles of its sorted indices, weighted by `k_r / s`
//!    (one allgatherv of `8 + 4s` bytes per rank); every rank cuts the same
//!    weighted sample at `j·K/p` (`K = Σ k_r`), so each region receives
//!    about `K/p` pairs. [`Balance::Equal`] cuts equal widths (no
//!    collective), [`Balance::Fixed`] reuses boundaries (e.g. those of an
//!    earlier step's [`SparseAllreduceReport::boundaries`]: Ok-Topk
//!    re-balances only every few iterations).
//! 3. **Split and reduce**: `p − 1` rounds of pairwise exchange
//!    (`MPI_Sendrecv` with `rank ± s`): the pair count first (8 bytes),
//!    then the pairs of the peer's region (8 bytes a pair). Rank `j` sums
//!    what it received for region `j`, in rank order.
//! 4. **Optional second selection** ([`SparseAllreduceOptions::reselect`],
//!    Ok-Topk proper): with `Some(k)` each region keeps its
//!    `⌈k·nnz_j/Σnnz⌉` largest-magnitude sums (one more 8-byte-per-rank
//!    allgatherv for `Σnnz`); the dropped ones are returned to the owning
//!    rank as [`SparseAllreduceReport::residual`] (error feedback is the
//!    caller's). `None` gives the exact sum.
//! 5. **SparCML dense switch**: a region whose fill-in (distinct indices /
//!    region width) exceeds [`SparseAllreduceOptions::delta`] is sent as
//!    its dense values (4 bytes an element) instead of pairs (8 bytes a
//!    pair); `δ = 0.5` is where the two cost the same.
//! 6. **Allgatherv** of the regions' results, each self-describing
//!    (`[kind u32 | nnz u32 | ...]`, kind 0: `nnz` indices u32 then `nnz`
//!    values f32; kind 1: the region's `width` values f32; little-endian),
//!    validated on receipt ([`Error::PeerMessage`]); every rank writes the
//!    sum into `out` (**overwritten**: zero where nobody contributed).
//!
//! Bytes sent per rank, with `k` pairs per rank spread evenly: phase 3
//! `8k(p−1)/p`; phase 6 by recursive doubling (power-of-two `p`) the other
//! ranks' regions, at most `8·min(K, n/2)(p−1)/p` (fewer with overlap,
//! the dense switch or `reselect`); with `reselect = Some(k)` about
//! `8k(p−1)/p`: `16k(p−1)/p` in all (Ok-Topk's bound counts 4-byte
//! values and indices separately, `6k(p−1)/p` with its threshold reuse),
//! against `(p−1)(8k+4)` for the fused allgather. Values pass through as
//! they are: NaN and Inf are summed like any other value.

use crate::comm::agree::agree_args;
use crate::comm::{tags, Tag, Transport};
use crate::dense::{allgatherv_with, AllgathervAlgo, Gathered};
use crate::{Error, Result};

const TAG: Tag = tags::SPARSE_ALLREDUCE;

/// Region kind in the allgathered results: index/value pairs.
const KIND_SPARSE: u32 = 0;
/// Region kind in the allgathered results: the region's dense values.
const KIND_DENSE: u32 = 1;

/// How `[0, n)` is split into the `p` regions of the reduce phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Balance {
    /// Equal widths `⌊j·n/p⌋` (no collective; unbalanced when the selected
    /// indices cluster, e.g. in one layer of a fused buffer).
    Equal,
    /// Cut the global distribution of the selected indices, estimated from
    /// up to `per_rank` evenly spaced quantiles of every rank's indices (one
    /// small allgatherv), so each region receives about `K/p` pairs.
    Sampled {
        /// Samples a rank contributes (at most its `k`); 0 means [`Balance::Equal`].
        per_rank: usize,
    },
    /// These boundaries (`p + 1` of them, `0 = b_0 ≤ b_1 ≤ … ≤ b_p = n`),
    /// the same on every rank.
    Fixed(Vec<usize>),
}

/// Options of [`sparse_allreduce`].
#[derive(Clone, Debug, PartialEq)]
pub struct SparseAllreduceOptions {
    /// SparCML's switch: a region whose reduced fill-in (distinct indices /
    /// width) is above `delta` is sent densely. 0.5 (default) is where 8
    /// bytes a pair cost what 4 bytes an element do; `0.0` sends every
    /// non-empty region densely, `1.0` or more never. May differ across
    /// ranks (each region's owner decides and the message says which).
    pub delta: f64,
    /// How the index space is split into regions (must agree across ranks).
    pub balance: Balance,
    /// Ok-Topk's second selection: `Some(k)` keeps about `k` of the reduced
    /// sums in all (largest magnitudes, shared among regions by their
    /// counts) and returns the rest to the owner as the residual; `None`
    /// (default) gives the exact sum. Must agree across ranks.
    pub reselect: Option<usize>,
    /// Allgatherv of the regions (and of the samples).
    pub gather: AllgathervAlgo,
}

impl Default for SparseAllreduceOptions {
    fn default() -> Self {
        SparseAllreduceOptions {
            delta: 0.5,
            balance: Balance::Sampled { per_rank: 32 },
            reselect: None,
            gather: AllgathervAlgo::RecursiveDoubling,
        }
    }
}

/// What [`sparse_allreduce`] did (the same on every rank, but `residual`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseAllreduceReport {
    /// The `p + 1` region boundaries used (reusable as [`Balance::Fixed`]).
    pub boundaries: Vec<usize>,
    /// Distinct indices of each region's reduced (and reselected) result.
    pub region_nnz: Vec<usize>,
    /// Whether each region was sent densely (the SparCML switch).
    pub dense: Vec<bool>,
    /// With `reselect`: the reduced sums of this rank's region that the
    /// second selection dropped, `(index, value)` sorted by index (not in
    /// `out`). Empty otherwise.
    pub residual: Vec<(u32, f32)>,
}

/// Sum every rank's sparse contribution `(indices[i], values[i])` (indices
/// in `[0, n)`, any order, duplicates summed) and write the sum into `out`
/// (length `n`, overwritten) on every rank. Collective: every rank calls it
/// with the same `n` and the same `opts.balance` and `opts.reselect`. See
/// the [module docs](self) for the algorithm and its cost.
///
/// ```
/// use gradsync::comm::{LocalComm, Transport};
/// use gradsync::sparse::allreduce::{sparse_allreduce, SparseAllreduceOptions};
/// let out = LocalComm::run(3, |c| {
///     let r = c.rank() as u32;
///     let mut out = vec![0f32; 10];
///     sparse_allreduce(&c, 10, &[r, 9], &[1.0, 2.0], &mut out, &Default::default()).unwrap();
///     out
/// });
/// assert_eq!(out[0], vec![1., 1., 1., 0., 0., 0., 0., 0., 0., 6.]);
/// ```
pub fn sparse_allreduce<C: Transport>(
    comm: &C,
    n: usize,
    indices: &[u32],
    values: &[f32],
    out: &mut [f32],
    opts: &SparseAllreduceOptions,
) -> Result<SparseAllreduceReport> {
    let (rank, p) = (comm.rank(), comm.size());
    let t0 = std::time::Instant::now();
    // 1. Agreement on failures, n and the options that shape the exchange.
    agree(comm, n, indices, values, out.len(), opts)?;

    // Local pairs sorted by index, duplicates summed in input order.
    let pairs = sorted_pairs(indices, values);

    // 2. Region boundaries.
    let bounds = match &opts.balance {
        Balance::Equal | Balance::Sampled { per_rank: 0 } => equal_bounds(n, p),
        Balance::Sampled { per_rank } => sampled_bounds(comm, n, &pairs, *per_rank, opts.gather)?,
        Balance::Fixed(b) => b.clone(),
    };
    let region = |j: usize| bounds[j]..bounds[j + 1];

    let agreed = t0.elapsed().as_secs_f64();
    // 3. Split and reduce: p − 1 rounds of pairwise exchange.
    let mine = region(rank);
    let received = exchange_regions(comm, &pairs, &bounds)?;
    let mut reduced = reduce_region(comm, &pairs[split(&pairs, &bounds, rank)], &received, &mine);

    // 4. Ok-Topk's second selection.
    let residual = match opts.reselect {
        Some(k) => reselect(comm, &mut reduced, k, opts.gather)?,
        None => Vec::new(),
    };

    // 5. SparCML's dense switch, and this rank's region message.
    let msg = region_message(&reduced, &mine, opts.delta);

    let split_reduced = t0.elapsed().as_secs_f64();
    // 6. Allgatherv of the regions, written into `out`.
    let mut g = Gathered::default();
    allgatherv_with(comm, &msg, opts.gather, &mut g)?;
    let gathered = t0.elapsed().as_secs_f64();
    out.fill(0.0);
    let cleared = t0.elapsed().as_secs_f64();
    let mut report = SparseAllreduceReport {
        boundaries: bounds.clone(),
        region_nnz: Vec::with_capacity(p),
        dense: Vec::with_capacity(p),
        residual,
    };
    for r in 0..p {
        let (nnz, dense) = decode_region(g.message(r), r, region(r), out)?;
        report.region_nnz.push(nnz);
        report.dense.push(dense);
    }
    log::trace!(
        "sparse allreduce: rank {rank}, seconds since the call: agreed {agreed:.4}, split and reduced {split_reduced:.4}, regions gathered {gathered:.4}, output cleared {cleared:.4}, regions added {:.4}",
        t0.elapsed().as_secs_f64()
    );
    Ok(report)
}

/// Phase 1: one agreement on every rank's argument failures, `n` and the
/// options that shape the exchange (module docs).
fn agree<C: Transport>(
    comm: &C,
    n: usize,
    indices: &[u32],
    values: &[f32],
    out_len: usize,
    opts: &SparseAllreduceOptions,
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    let local = check_local(rank, p, n, indices, values, out_len, opts);
    let fp = fingerprint(opts);
    agree_args(
        comm,
        TAG,
        local,
        n,
        &[(fp, &|| {
            format!(
                "sparse allreduce options differ across ranks: balance, reselect or the allgatherv \
                 (this rank: {:?}, reselect {:?}, allgatherv {})",
                opts.balance, opts.reselect, opts.gather.name()
            )
        })],
    )
}

/// The pairs of `pairs` (sorted by index) in region `j` of `bounds`.
fn split(pairs: &[(u32, f32)], bounds: &[usize], j: usize) -> std::ops::Range<usize> {
    let lo = pairs.partition_point(|&(i, _)| (i as usize) < bounds[j]);
    let hi = pairs.partition_point(|&(i, _)| (i as usize) < bounds[j + 1]);
    lo..hi
}

/// Phase 3, the exchange: `p − 1` rounds of pairwise `sendrecv` (rank
/// `+ s` gets its region's pairs, rank `− s` sends this rank's), the
/// pair count first. Per source rank, what it sent: `c` indices then
/// `c` values' bits (empty for this rank).
fn exchange_regions<C: Transport>(
    comm: &C,
    pairs: &[(u32, f32)],
    bounds: &[usize],
) -> Result<Vec<Vec<u32>>> {
    let (rank, p) = (comm.rank(), comm.size());
    let width = (bounds[rank]..bounds[rank + 1]).len();
    let mut received: Vec<Vec<u32>> = vec![Vec::new(); p];
    for s in 1..p {
        let dst = (rank + s) % p;
        let src = (rank + p - s) % p;
        let part = &pairs[split(pairs, bounds, dst)];
        let mut send = Vec::with_capacity(2 * part.len());
        send.extend(part.iter().map(|&(i, _)| i));
        send.extend(part.iter().map(|&(_, x)| x.to_bits()));
        let mut cnt = [0u64];
        comm.sendrecv(&[part.len() as u64], dst, &mut cnt, src, TAG)?;
        // A peer's corrupt count or index is this rank's alone while the
        // others go on exchanging: the job ends (the failure model of
        // crate::comm::agree) instead of returning here and leaving them waiting.
        let c = usize::try_from(cnt[0])
            .ok()
            .filter(|&c| c <= width)
            .unwrap_or_else(|| {
                let e = peer(
                    src,
                    format!("sends {} pairs for a region of width {width}", cnt[0]),
                );
                comm.abort(1, &format!("sparse allreduce: {e}"))
            });
        let mut buf = vec![0u32; 2 * c];
        comm.sendrecv(&send, dst, &mut buf, src, TAG)?;
        received[src] = buf;
    }
    Ok(received)
}

/// Phase 3, the reduction: this rank's region `mine`, its own pairs
/// `own` and every peer's `received`, summed in rank order (an index
/// outside the region ends the job).
fn reduce_region<C: Transport>(
    comm: &C,
    own: &[(u32, f32)],
    received: &[Vec<u32>],
    mine: &std::ops::Range<usize>,
) -> Vec<(u32, f32)> {
    let rank = comm.rank();
    let mut all: Vec<(u32, f32)> =
        Vec::with_capacity(own.len() + received.iter().map(|b| b.len() / 2).sum::<usize>());
    for (r, buf) in received.iter().enumerate() {
        if r == rank {
            all.extend_from_slice(own);
            continue;
        }
        let c = buf.len() / 2;
        for (&i, &x) in buf[..c].iter().zip(&buf[c..]) {
            if !mine.contains(&(i as usize)) {
                let e = peer(
                    r,
                    format!("sent index {i} outside this rank's region {mine:?}"),
                );
                comm.abort(1, &format!("sparse allreduce: {e}"));
            }
            all.push((i, f32::from_bits(x)));
        }
    }
    // Stable: equal indices are summed in rank order.
    all.sort_by_key(|&(i, _)| i);
    merge_sorted(all)
}

/// Phase 4, Ok-Topk's second selection: keep this region's share of `k`
/// largest-magnitude sums in `reduced` (one allgatherv of the regions'
/// counts); the dropped ones, sorted by index, are returned.
fn reselect<C: Transport>(
    comm: &C,
    reduced: &mut Vec<(u32, f32)>,
    k: usize,
    gather: AllgathervAlgo,
) -> Result<Vec<(u32, f32)>> {
    let mut residual = Vec::new();
    let g = gather_u64(comm, reduced.len() as u64, gather)?;
    let total: u128 = g.iter().map(|&x| x as u128).sum();
    if total > k as u128 {
        let quota = ((k as u128 * reduced.len() as u128).div_ceil(total.max(1))) as usize;
        if quota < reduced.len() {
            // Largest magnitudes first (NaN counts as largest).
            reduced.select_nth_unstable_by(quota, |a, b| b.1.abs().total_cmp(&a.1.abs()));
            residual = reduced.split_off(quota);
            reduced.sort_unstable_by_key(|&(i, _)| i);
            residual.sort_unstable_by_key(|&(i, _)| i);
        }
    }
    Ok(residual)
}

/// Phase 5: this rank's region message, its `reduced` sums as pairs or,
/// past SparCML's `delta` fill-in, as the region's dense values.
fn region_message(reduced: &[(u32, f32)], mine: &std::ops::Range<usize>, delta: f64) -> Vec<u8> {
    let width = mine.len();
    let dense_here = width > 0 && reduced.len() as f64 > delta * width as f64;
    let mut msg = Vec::with_capacity(
        8 + if dense_here {
            4 * width
        } else {
            8 * reduced.len()
        },
    );
    if dense_here {
        msg.extend_from_slice(&KIND_DENSE.to_le_bytes());
        msg.extend_from_slice(&(reduced.len() as u32).to_le_bytes());
        let mut d = vec![0f32; width];
        for &(i, x) in reduced {
            d[i as usize - mine.start] = x;
        }
        d.iter()
            .for_each(|x| msg.extend_from_slice(&x.to_le_bytes()));
    } else {
        msg.extend_from_slice(&KIND_SPARSE.to_le_bytes());
        msg.extend_from_slice(&(reduced.len() as u32).to_le_bytes());
        reduced
            .iter()
            .for_each(|(i, _)| msg.extend_from_slice(&i.to_le_bytes()));
        reduced
            .iter()
            .for_each(|(_, x)| msg.extend_from_slice(&x.to_le_bytes()));
    }
    msg
}

fn peer(rank: usize, reason: String) -> Error {
    Error::PeerMessage {
        rank,
        layer: "<sparse allreduce>".into(),
        reason,
    }
}

/// Rank-local argument checks (their failure is agreed on by every rank).
fn check_local(
    rank: usize,
    p: usize,
    n: usize,
    indices: &[u32],
    values: &[f32],
    out_len: usize,
    opts: &SparseAllreduceOptions,
) -> Result<()> {
    check_pairs(rank, n, indices, values, out_len)?;
    let bad = |m: String| Err(Error::InvalidArgument(format!("rank {rank}: {m}")));
    if opts.delta.is_nan() {
        return bad("delta is NaN".into());
    }
    if let Balance::Fixed(b) = &opts.balance {
        let ok = b.len() == p + 1 && b[0] == 0 && b[p] == n && b.windows(2).all(|w| w[0] <= w[1]);
        if !ok {
            return bad(format!(
                "fixed boundaries {b:?} are not p + 1 = {} non-decreasing values from 0 to n = {n}",
                p + 1
            ));
        }
    }
    Ok(())
}

/// The checks of one rank's pairs and output (shared with
/// [`super::hierarchical`]): `n` fits 32-bit indices, as many values as
/// indices, an output of length `n`, every index below `n`.
pub(crate) fn check_pairs(
    rank: usize,
    n: usize,
    indices: &[u32],
    values: &[f32],
    out_len: usize,
) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidArgument(format!("rank {rank}: {m}")));
    if n > u32::MAX as usize {
        return bad(format!("n = {n} does not fit 32-bit indices"));
    }
    if indices.len() != values.len() {
        return bad(format!(
            "{} indices but {} values",
            indices.len(),
            values.len()
        ));
    }
    if indices.len() > u32::MAX as usize {
        return bad(format!("{} pairs do not fit a 32-bit count", indices.len()));
    }
    if out_len != n {
        return bad(format!("output has {out_len} elements, n = {n}"));
    }
    if let Some((pos, &i)) = indices.iter().enumerate().find(|(_, &i)| i as usize >= n) {
        return bad(format!(
            "index {i} (pair {pos}) is out of range for n = {n}"
        ));
    }
    Ok(())
}

/// FNV-1a over the options that must agree across ranks.
fn fingerprint(opts: &SparseAllreduceOptions) -> u64 {
    let mut words: Vec<u64> = match &opts.balance {
        Balance::Equal | Balance::Sampled { per_rank: 0 } => vec![1],
        Balance::Sampled { per_rank } => vec![2, *per_rank as u64],
        Balance::Fixed(b) => std::iter::once(3)
            .chain(b.iter().map(|&x| x as u64))
            .collect(),
    };
    words.push(opts.reselect.map_or(u64::MAX, |k| k as u64));
    words.push(match opts.gather {
        AllgathervAlgo::RecursiveDoubling => 1,
        AllgathervAlgo::Mpi => 2,
        AllgathervAlgo::Node => 3,
    });
    words.iter().fold(crate::comm::agree::FNV_OFFSET, |h, w| {
        crate::comm::agree::fnv(h, &w.to_le_bytes())
    })
}

/// One rank's pairs sorted by index, duplicates summed in input order.
pub(crate) fn sorted_pairs(indices: &[u32], values: &[f32]) -> Vec<(u32, f32)> {
    let mut v: Vec<(u32, f32)> = indices
        .iter()
        .copied()
        .zip(values.iter().copied())
        .collect();
    if !v.windows(2).all(|w| w[0].0 < w[1].0) {
        v.sort_by_key(|&(i, _)| i);
        v = merge_sorted(v);
    }
    v
}

/// Sum runs of equal indices of a sorted list, in order.
pub(crate) fn merge_sorted(v: Vec<(u32, f32)>) -> Vec<(u32, f32)> {
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(v.len());
    for (i, x) in v {
        match out.last_mut() {
            Some(last) if last.0 == i => last.1 += x,
            _ => out.push((i, x)),
        }
    }
    out
}

fn equal_bounds(n: usize, p: usize) -> Vec<usize> {
    (0..=p)
        .map(|j| (j as u128 * n as u128 / p as u128) as usize)
        .collect()
}

/// Every rank's `x`, by one allgatherv of 8 bytes a rank.
fn gather_u64<C: Transport>(comm: &C, x: u64, algo: AllgathervAlgo) -> Result<Vec<u64>> {
    let mut g = Gathered::default();
    allgatherv_with(comm, &x.to_le_bytes(), algo, &mut g)?;
    (0..g.len())
        .map(|r| {
            let m = g.message(r);
            m.try_into()
                .map(u64::from_le_bytes)
                .map_err(|_| peer(r, format!("{}-byte count, expected 8", m.len())))
        })
        .collect()
}

/// Boundaries at the `j/p` quantiles of the weighted global sample of the
/// selected indices (the same on every rank: the same gathered bytes go
/// through the same arithmetic).
fn sampled_bounds<C: Transport>(
    comm: &C,
    n: usize,
    pairs: &[(u32, f32)],
    per_rank: usize,
    algo: AllgathervAlgo,
) -> Result<Vec<usize>> {
    let p = comm.size();
    // Quantiles of this rank's distinct indices, weighted by their count.
    let d = pairs.len();
    let s = per_rank.min(d);
    let mut msg = Vec::with_capacity(8 + 4 * s);
    msg.extend_from_slice(&(d as u64).to_le_bytes());
    for t in 0..s {
        let i = pairs[((2 * t + 1) * d) / (2 * s)].0;
        msg.extend_from_slice(&i.to_le_bytes());
    }
    let mut g = Gathered::default();
    allgatherv_with(comm, &msg, algo, &mut g)?;
    let mut samples: Vec<(u32, f64)> = Vec::new();
    for r in 0..p {
        let m = g.message(r);
        if m.len() < 8 || (m.len() - 8) % 4 != 0 || m.len() - 8 > per_rank.saturating_mul(4) {
            return Err(peer(r, format!("{}-byte index sample", m.len())));
        }
        let kr = u64::from_le_bytes(m[..8].try_into().expect("8 bytes"));
        let sr = (m.len() - 8) / 4;
        if sr == 0 {
            continue;
        }
        let w = kr as f64 / sr as f64;
        for c in m[8..].chunks_exact(4) {
            let i = u32::from_le_bytes(c.try_into().expect("4 bytes"));
            if i as usize >= n {
                return Err(peer(
                    r,
                    format!("sampled index {i} out of range for n = {n}"),
                ));
            }
            samples.push((i, w));
        }
    }
    if samples.is_empty() {
        return Ok(equal_bounds(n, p));
    }
    samples.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let total: f64 = samples.iter().map(|s| s.1).sum();
    let mut b = vec![n; p + 1];
    b[0] = 0;
    let (mut cum, mut j) = (0.0f64, 1usize);
    for &(i, w) in &samples {
        cum += w;
        while j < p && cum >= total * j as f64 / p as f64 {
            b[j] = i as usize + 1;
            j += 1;
        }
    }
    for j in 1..=p {
        b[j] = b[j].clamp(b[j - 1], n);
    }
    b[p] = n;
    Ok(b)
}

/// Write region `r`'s gathered result into `out`; returns (nnz, dense).
fn decode_region(
    m: &[u8],
    r: usize,
    range: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<(usize, bool)> {
    if m.len() < 8 {
        return Err(peer(r, format!("{}-byte region result", m.len())));
    }
    let kind = u32::from_le_bytes(m[0..4].try_into().expect("4 bytes"));
    let nnz = u32::from_le_bytes(m[4..8].try_into().expect("4 bytes")) as usize;
    let body = &m[8..];
    let width = range.len();
    let f = |c: &[u8]| f32::from_le_bytes(c.try_into().expect("4 bytes"));
    match kind {
        KIND_DENSE => {
            if body.len() != 4 * width || nnz > width {
                return Err(peer(
                    r,
                    format!(
                        "dense region of {} bytes (nnz {nnz}), width {width}",
                        body.len()
                    ),
                ));
            }
            // `+ 0.0`: a sum of −0.0 contributions reads +0.0, as the
            // allgather's adds into a cleared output and the node-aware
            // path give it (bit for bit the same result on every path).
            for (o, c) in out[range].iter_mut().zip(body.chunks_exact(4)) {
                *o = f(c) + 0.0;
            }
            Ok((nnz, true))
        }
        KIND_SPARSE => {
            if body.len() != 8 * nnz || nnz > width {
                return Err(peer(
                    r,
                    format!(
                        "sparse region of {} bytes for {nnz} pairs, width {width}",
                        body.len()
                    ),
                ));
            }
            let (idx, val) = body.split_at(4 * nnz);
            let mut prev: Option<usize> = None;
            for (ci, cv) in idx.chunks_exact(4).zip(val.chunks_exact(4)) {
                let i = u32::from_le_bytes(ci.try_into().expect("4 bytes")) as usize;
                if !range.contains(&i) || prev.is_some_and(|q| q >= i) {
                    return Err(peer(
                        r,
                        format!("index {i} out of order or outside region {range:?}"),
                    ));
                }
                prev = Some(i);
                out[i] = f(cv) + 0.0;
            }
            Ok((nnz, false))
        }
        k => Err(peer(r, format!("unknown region kind {k}"))),
    }
}

#[cfg(test)]
mod tests;
