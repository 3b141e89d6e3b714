//! Communication-set selection: which elements of a residual to send.
//!
//! RedSync (Fang et al., §5.2) replaces a full top-k by cheaper selections
//! built from reductions (mean, max, count) and one stream compaction:
//!
//! | function | paper | returns |
//! |---|---|---|
//! | [`exact_topk`] | baseline top-k (quickselect) | exactly `min(k, m)` entries |
//! | [`trimmed_topk`] | §5.2.1, Algorithm 2 | exactly `min(k, m)` entries |
//! | [`ThresholdSearch::select`] | §5.2.2, Algorithm 3 + threshold reuse | `k..=2k` entries after a search |
//! | [`ThresholdSearch::select_sampled`] | §5.2.2 "sampled threshold binary search" | `k..=2k` entries after an estimate |
//! | [`exact_topk_signed`] | §5.2.3 `topk_quant` / `lowk_quant` (sampled threshold, one filter pass, quickselect of the candidates) | exactly `min(k, m±)` entries |
//!
//! (`m` is the number of non-NaN elements, `m±` the number of strictly
//! positive / strictly negative ones.)
//!
//! Every function writes the selected indices, **sorted ascending**, into a
//! caller-provided `Vec<u32>` and the matching values `x[i]` into a
//! `Vec<f32>`; both are cleared first and only grow, so a caller that keeps
//! them across steps allocates nothing in steady state. Indices are `u32`, so
//! `x.len()` must not exceed 2^32 (longer slices give
//! [`Error::InvalidArgument`]).
//!
//! ## Thresholds (RedSync's Algorithms 2 and 3, corrected)
//!
//! With `mean` and `max` of `|x|`, a ratio in `[0, 1]` gives the threshold
//! `mean + ratio · (max − mean)`; an element is *above* it when
//! `|x_i| > threshold` (strictly). As printed, Algorithm 2 counts against
//! the threshold before setting it, and Algorithm 3 assigns the threshold
//! to the ratio's bounds `l`/`r` and has an `nnz < k/2` branch at odds with
//! its goal `k ≤ nnz ≤ 2k`; what follows is their stated intent.
//!
//! * Algorithm 2 starts at ratio `1 − ε` ([`TRIM_EPS`] = 0.2 as printed) and
//!   lowers it by `ε` until at least `k` elements are above; then it runs an
//!   exact top-k among those candidates only. If even ratio 0 (threshold =
//!   mean) leaves fewer than `k` candidates (e.g. all-equal values), every
//!   element is a candidate, so the result always has exactly `k` entries.
//! * Algorithm 3 binary-searches the ratio on `[0, 1]` until the count above
//!   lies in `[k, 2k]`, or `r − l ≤ ε` (default [`DEFAULT_SEARCH_EPS`]). If it
//!   stops on `ε` with more than `2k` above, those are returned (still a
//!   superset of the top-k); with fewer than `k` it falls back to the exact
//!   top-k, so a search always yields at least `min(k, m)` entries.
//!
//! ## Threshold reuse (§5.2.2, Algorithm 5)
//!
//! After a search, [`ThresholdSearch`] keeps the threshold and reuses it for
//! the next `interval` calls (default [`DEFAULT_INTERVAL`] = 5) with a single
//! filter pass and no count. A reused threshold is *not* re-checked, so those
//! calls may return fewer than `k` (even zero) or more than `2k` entries; that
//! is the paper's trade. A change of `x.len()` or `k` forces a new search.
//! (Algorithm 5 as printed resets `interval` to 0 and tests `interval % 5 ==
//! 0`, which would search every call; the intent, one search then reuse, is
//! what is implemented.)
//!
//! ## Cost on a CPU
//!
//! The paper's methods avoid radixSelect on a GPU. On a CPU, quickselect is
//! already O(n) (here on a contiguous copy of the candidate magnitudes), so
//! exact, trimmed and a fresh binary search cost about the same (uniform
//! data, k = n/1000, n = 2^23: roughly 30–45 ms each on a shared, loaded
//! 2-core machine); the clear CPU wins are the sampled estimate (about 2/3
//! of that) and threshold reuse (one filter pass, about 1/4).
//!
//! ## NaN and infinities
//!
//! All functions are NaN-safe: `|NaN|` is treated as smaller than every
//! other magnitude, so NaN never panics a sort and is **never selected** (it
//! is not even a candidate when `k` exceeds the non-NaN count, which is why
//! counts above are in terms of `m`). `±∞` are ordinary, largest magnitudes;
//! they make `mean`/`max` infinite, the thresholds NaN and every count zero,
//! so the threshold methods fall back to the exact top-k. Ties in magnitude
//! are broken towards the lower index, so results are deterministic.

use crate::{Error, Result};

mod search;
pub use search::{ThresholdOutcome, ThresholdSearch, ThresholdSource};

/// Step `ε` of Algorithm 2 (ratio starts at `1 − ε`, drops by `ε`).
pub const TRIM_EPS: f64 = 0.2;
/// Default termination width `ε` of the ratio binary search (Algorithm 3;
/// the paper leaves it open). `1e-4` is at most 14 count passes.
pub const DEFAULT_SEARCH_EPS: f64 = 1e-4;
/// Default number of calls that reuse a found threshold (§5.2.2: "5").
pub const DEFAULT_INTERVAL: u32 = 5;
/// Default fraction of elements sampled by [`ThresholdSearch::select_sampled`]
/// (Lin et al.'s 0.1%–1%, via §5.2.2).
pub const DEFAULT_SAMPLE_FRACTION: f64 = 0.01;

fn check_len(x: &[f32]) -> Result<()> {
    if u32::try_from(x.len().saturating_sub(1)).is_err() {
        return Err(Error::InvalidArgument(format!(
            "selection over {} elements: indices are u32, at most 2^32 elements",
            x.len()
        )));
    }
    Ok(())
}

/// The `k` largest `|x_i|` among the elements passing `keep` (which must
/// reject NaN), ties to the lower index, indices ascending. One pass collects
/// the candidates' indices (`idx`) and magnitudes (`val`, reused as scratch);
/// quickselect runs on the contiguous magnitudes; one pass over the
/// candidates keeps those above the k-th magnitude and the first ties.
fn select_topk(
    x: &[f32],
    k: usize,
    keep: impl Fn(f32) -> bool,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) {
    idx.clear();
    val.clear();
    if k == 0 {
        return;
    }
    for (i, &v) in x.iter().enumerate() {
        if keep(v) {
            idx.push(i as u32);
            val.push(v.abs());
        }
    }
    reduce_to_topk(x, k, idx, val);
}

/// Candidates `|x_i| > t` (via the chunked [`filter_above`]), then their top-k.
fn select_topk_above(x: &[f32], k: usize, t: f32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
    idx.clear();
    val.clear();
    if k == 0 {
        return;
    }
    filter_above(x, t, idx);
    val.extend(idx.iter().map(|&i| x[i as usize].abs()));
    reduce_to_topk(x, k, idx, val);
}

/// Keep the `k` largest magnitudes of the candidates `idx` (`val` holds
/// their magnitudes; ties broken by index), then gather their values.
fn reduce_to_topk(x: &[f32], k: usize, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
    if idx.len() > k {
        let (before, kth, _) = val.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let kth = *kth;
        // `before` holds the k − 1 magnitudes ≥ kth, so ties ≥ 1.
        let mut ties = k - before.iter().filter(|&&a| a > kth).count();
        idx.retain(|&i| {
            let a = x[i as usize].abs();
            if a > kth {
                true
            } else if a == kth && ties > 0 {
                ties -= 1;
                true
            } else {
                false
            }
        });
    }
    gather(x, idx, val);
}

fn gather(x: &[f32], idx: &[u32], val: &mut Vec<f32>) {
    val.clear();
    val.extend(idx.iter().map(|&i| x[i as usize]));
}

/// Indices with `|x_i| > t` (never NaN), in order.
/// Indices with `|x_i| > t`, in order. Chunks of 16 are first tested
/// branch-free (vectorized) and skipped when nothing in them passes: with a
/// density of 0.1–1% most chunks are skipped.
fn filter_above(x: &[f32], t: f32, idx: &mut Vec<u32>) {
    const L: usize = 16;
    idx.clear();
    let chunks = x.chunks_exact(L);
    let tail_start = x.len() - chunks.remainder().len();
    for (c, chunk) in chunks.enumerate() {
        let hit = chunk.iter().fold(false, |a, v| a | (v.abs() > t));
        if hit {
            let base = c * L;
            for (j, v) in chunk.iter().enumerate() {
                if v.abs() > t {
                    idx.push((base + j) as u32);
                }
            }
        }
    }
    for (j, v) in x[tail_start..].iter().enumerate() {
        if v.abs() > t {
            idx.push((tail_start + j) as u32);
        }
    }
}

fn count_above(x: &[f32], t: f32) -> usize {
    x.iter().filter(|v| v.abs() > t).count()
}

/// Mean and max of `|x|` over the non-NaN elements, and their count.
///
/// Eight independent lanes: one serial `sum += a` chain is bound by the add
/// latency (~4 cycles per element), eight chains run at memory speed. Lanes
/// sum in f32 over blocks of 128 elements each (relative error ~1e-5, plenty
/// for a selection heuristic) and blocks add up in f64, which keeps the loop
/// in packed f32 arithmetic.
fn abs_stats(x: &[f32]) -> (f64, f64, usize) {
    const L: usize = 8;
    const BLOCK: usize = L * 128;
    let mut total = 0f64;
    let mut m = 0usize;
    let mut mx = [0f32; L];
    for block in x.chunks(BLOCK) {
        let (mut sum, mut cnt) = ([0f32; L], [0u32; L]);
        let chunks = block.chunks_exact(L);
        let tail = chunks.remainder();
        for c in chunks {
            for j in 0..L {
                let a = c[j].abs();
                let ok = !a.is_nan();
                sum[j] += if ok { a } else { 0.0 };
                cnt[j] += u32::from(ok);
                mx[j] = mx[j].max(a); // f32::max ignores NaN
            }
        }
        for (j, v) in tail.iter().enumerate() {
            let a = v.abs();
            if !a.is_nan() {
                sum[j] += a;
                cnt[j] += 1;
                mx[j] = mx[j].max(a);
            }
        }
        total += sum.iter().map(|&v| f64::from(v)).sum::<f64>();
        m += cnt.iter().map(|&c| c as usize).sum::<usize>();
    }
    let max = mx.iter().fold(0f32, |a, &b| a.max(b));
    let mean = if m == 0 { 0.0 } else { total / m as f64 };
    (mean, f64::from(max), m)
}

fn threshold_at(mean: f64, max: f64, ratio: f64) -> f32 {
    (mean + ratio * (max - mean)) as f32
}

/// The largest f32 below `v` (for finite or +∞ `v ≥ 0`): `|x| > next_down(v)`
/// is `|x| ≥ v`. (`f32::next_down` needs Rust 1.86.)
fn next_down(v: f32) -> f32 {
    if v == 0.0 {
        -f32::from_bits(1)
    } else {
        f32::from_bits(v.to_bits() - 1)
    }
}

/// Exact top-k by magnitude: the `min(k, m)` elements of largest `|x_i|`
/// (`m` = non-NaN count; NaN is never selected), sorted by index, ties to the
/// lower index. `val_out` doubles as the quickselect scratch of magnitudes
/// (capacity up to `x.len()`).
pub fn exact_topk(
    x: &[f32],
    k: usize,
    idx_out: &mut Vec<u32>,
    val_out: &mut Vec<f32>,
) -> Result<()> {
    check_len(x)?;
    select_topk(x, k, |v| !v.is_nan(), idx_out, val_out);
    Ok(())
}

/// Exact top-k of one sign, for quantized RGC (§5.2.3): with `positive`, the
/// `min(k, #{x_i > 0})` largest values (`topk_quant`); otherwise the
/// `min(k, #{x_i < 0})` smallest, i.e. largest-magnitude negative values
/// (`lowk_quant`). Zeros and NaN are never selected. Sorted by index, ties
/// to the lower index. Computed by `signed_topk` (a sampled threshold and
/// one filter pass, exact result).
pub fn exact_topk_signed(
    x: &[f32],
    k: usize,
    positive: bool,
    idx_out: &mut Vec<u32>,
    val_out: &mut Vec<f32>,
) -> Result<()> {
    let out = Some((idx_out, val_out));
    if positive {
        signed_topk(x, k, out, None)?;
    } else {
        signed_topk(x, k, None, out)?;
    }
    Ok(())
}

/// Below this many elements [`signed_topk`] selects exactly from the start.
const SIGNED_SAMPLE_MIN: usize = 1 << 17;
/// Elements sampled (strided) for [`signed_topk`]'s threshold estimate.
const SIGNED_SAMPLE: usize = 1 << 16;

/// The output pair of one side of [`signed_topk`]: indices and values.
pub(crate) type Side<'a> = Option<(&'a mut Vec<u32>, &'a mut Vec<f32>)>;

/// [`exact_topk_signed`] for the positive side (`pos`), the negative side
/// (`neg`) or both, and whether every element of `x` is finite (so encoders
/// need no separate `check_finite` pass). The result is exact; only the
/// cost depends on the data:
///
/// 1. estimate: on a strided sample of [`SIGNED_SAMPLE`] elements, take per
///    side the `r`-th largest magnitude of that sign, with
///    `r = e + 4√e + 4` and `e = k·|sample|/n` the expected sample count
///    above the true `k`-th magnitude (the margin makes a short threshold
///    very unlikely on data in random order);
/// 2. one branch-free, chunked filter pass collects the candidates
///    `x_i ≥ t₊` and `x_i ≤ −t₋` (about `r·n/|sample|` of each) and the
///    finiteness of every element;
/// 3. per side, the exact top-k of the candidates (quickselect, ties to the
///    lower index), which is the top-k of `x` once there are at least `k`
///    candidates: every non-candidate of that sign is below the threshold.
///
/// A side with fewer than `k` candidates (structured data fooling the
/// stride, or fewer than `k` elements of that sign), and tensors shorter
/// than [`SIGNED_SAMPLE_MIN`], take the exact path ([`select_topk`], one
/// more pass).
pub(crate) fn signed_topk<'a>(
    x: &[f32],
    k: usize,
    mut pos: Side<'a>,
    mut neg: Side<'a>,
) -> Result<bool> {
    check_len(x)?;
    for (i, v) in pos.iter_mut().chain(neg.iter_mut()) {
        i.clear();
        v.clear();
    }
    let n = x.len();
    let exact_side = |side: &mut Side<'_>, positive: bool| {
        if let Some((i, v)) = side {
            if positive {
                select_topk(x, k, |v| v > 0.0, i, v);
            } else {
                select_topk(x, k, |v| v < 0.0, i, v);
            }
        }
    };
    if k == 0 || n < SIGNED_SAMPLE_MIN || k.saturating_mul(8) > n {
        exact_side(&mut pos, true);
        exact_side(&mut neg, false);
        return Ok(x.iter().all(|v| v.is_finite()));
    }
    // 1. Thresholds from the sample (NaN: that side is not wanted or the
    //    sample has too few of its sign; `x ≥ NaN` is always false).
    let stride = n / SIGNED_SAMPLE;
    let sample_len = n.div_ceil(stride);
    let e = k as f64 * sample_len as f64 / n as f64;
    let r = (e + 4.0 * e.sqrt() + 4.0).ceil() as usize;
    let estimate = |want: bool, positive: bool| -> f32 {
        if !want {
            return f32::NAN;
        }
        let mut mags: Vec<f32> = x
            .iter()
            .step_by(stride)
            .filter_map(|&v| {
                let m = if positive { v } else { -v };
                (m > 0.0).then_some(m)
            })
            .collect();
        if mags.len() < r {
            return f32::NAN;
        }
        *mags.select_nth_unstable_by(r - 1, |a, b| b.total_cmp(a)).1
    };
    let tp = estimate(pos.is_some(), true);
    let tn = estimate(neg.is_some(), false);
    // 2. One filter pass for both sides, collecting the finiteness too.
    let (mut pi, mut ni) = (Vec::new(), Vec::new());
    let pos_idx = pos.as_mut().map_or(&mut pi, |(i, _)| &mut **i);
    let neg_idx = neg.as_mut().map_or(&mut ni, |(i, _)| &mut **i);
    let finite = filter_signed(x, tp, tn, pos_idx, neg_idx);
    // 3. Exact top-k among the candidates, or the exact path.
    for (side, positive) in [(&mut pos, true), (&mut neg, false)] {
        if let Some((i, v)) = side {
            if i.len() >= k {
                v.clear();
                v.extend(i.iter().map(|&j| x[j as usize].abs()));
                reduce_to_topk(x, k, i, v);
            } else {
                exact_side(side, positive);
            }
        }
    }
    Ok(finite)
}

/// Indices with `x_i ≥ tp` into `pos` and with `x_i ≤ −tn` into `neg`, in
/// order (a NaN threshold selects nothing); returns whether every element
/// is finite. Chunks of 16 are tested branch-free and skipped when nothing in
/// them passes; the finiteness is a max over the magnitude bits (NaN and
/// ±∞ are the bit patterns `≥ 0x7f80_0000`).
fn filter_signed(x: &[f32], tp: f32, tn: f32, pos: &mut Vec<u32>, neg: &mut Vec<u32>) -> bool {
    const L: usize = 16;
    pos.clear();
    neg.clear();
    let ntn = -tn;
    let mut mx = [0i32; L];
    let chunks = x.chunks_exact(L);
    let tail_start = x.len() - chunks.remainder().len();
    // Branch-free compaction of a chunk (`c.len() ≤ L`): write every index,
    // advance past those that pass (a branch each mispredicts at 1–2%).
    let (mut bp, mut bn) = ([0u32; L], [0u32; L]);
    let mut visit = |base: usize, c: &[f32]| {
        let (mut kp, mut kn) = (0, 0);
        for (j, &v) in c.iter().enumerate() {
            let i = (base + j) as u32;
            bp[kp] = i;
            kp += usize::from(v >= tp);
            bn[kn] = i;
            kn += usize::from(v <= ntn);
        }
        pos.extend_from_slice(&bp[..kp]);
        neg.extend_from_slice(&bn[..kn]);
    };
    for (ci, c) in chunks.enumerate() {
        let mut hit = false;
        for (m, &v) in mx.iter_mut().zip(c) {
            hit |= (v >= tp) | (v <= ntn);
            *m = (*m).max((v.to_bits() & 0x7fff_ffff) as i32);
        }
        if hit {
            visit(ci * L, c);
        }
    }
    visit(tail_start, &x[tail_start..]);
    let tail_max = x[tail_start..]
        .iter()
        .map(|v| (v.to_bits() & 0x7fff_ffff) as i32)
        .max()
        .unwrap_or(0);
    mx.iter().copied().max().unwrap_or(0).max(tail_max) < 0x7f80_0000
}

/// Trimmed top-k (§5.2.1, Algorithm 2, its threshold set before counting): lower the
/// ratio from `1 − 0.2` in steps of 0.2 until at least `k` elements exceed
/// `mean + ratio · (max − mean)`, then take the exact top-k of those. Returns
/// exactly `min(k, m)` entries (`m` = non-NaN count), the same set as
/// [`exact_topk`].
pub fn trimmed_topk(
    x: &[f32],
    k: usize,
    idx_out: &mut Vec<u32>,
    val_out: &mut Vec<f32>,
) -> Result<()> {
    trimmed_topk_checked(x, k, idx_out, val_out).map(|_| ())
}

/// [`trimmed_topk`], also returning whether every element of `x` is finite,
/// read from the statistics pass it makes anyway (no `NaN` counted, finite
/// maximum), so an encoder needs no separate check. When `x` is not all
/// finite the selection is made just the same (NaN-safe, as above).
pub(crate) fn trimmed_topk_checked(
    x: &[f32],
    k: usize,
    idx_out: &mut Vec<u32>,
    val_out: &mut Vec<f32>,
) -> Result<bool> {
    check_len(x)?;
    idx_out.clear();
    val_out.clear();
    if x.is_empty() {
        return Ok(true);
    }
    let (mean, max, m) = abs_stats(x);
    let finite = m == x.len() && max.is_finite();
    if k == 0 {
        return Ok(finite);
    }
    if k >= m {
        return exact_topk(x, k, idx_out, val_out).map(|_| finite);
    }
    // The ratios Algorithm 2 tries, 1 − ε, 1 − 2ε, ..., 0, are counted in
    // ONE pass (the printed loop makes one pass per ratio); the first with at
    // least k elements above wins, as in the loop. Every non-NaN element is
    // above −∞ (the fallback when ratio 0 is short).
    let mut ts = [f32::INFINITY; TRIM_STEPS];
    for (j, t) in ts.iter_mut().enumerate() {
        let ratio = (1.0 - (j + 1) as f64 * TRIM_EPS).max(0.0);
        *t = threshold_at(mean, max, ratio);
    }
    let counts = count_above_multi(x, &ts);
    let thr = ts
        .iter()
        .zip(&counts)
        .find(|(_, &c)| c >= k)
        .map_or(f32::NEG_INFINITY, |(&t, _)| t);
    select_topk_above(x, k, thr, idx_out, val_out);
    Ok(finite)
}

/// Ratios Algorithm 2 can try: `1 − jε` for `j = 1..` down to 0.
const TRIM_STEPS: usize = (1.0 / TRIM_EPS + 0.5) as usize;

/// `counts[j] = #{i : |x_i| > ts[j]}` for every threshold in one pass
/// (eight lanes of u32 counters per threshold, flushed every 2^16 chunks).
fn count_above_multi<const T: usize>(x: &[f32], ts: &[f32; T]) -> [usize; T] {
    const L: usize = 8;
    let mut total = [0usize; T];
    for block in x.chunks(L << 16) {
        let mut lanes = [[0u32; L]; T];
        let chunks = block.chunks_exact(L);
        let tail = chunks.remainder();
        for c in chunks {
            let mut a = [0f32; L];
            for l in 0..L {
                a[l] = c[l].abs();
            }
            for (lane, &t) in lanes.iter_mut().zip(ts) {
                for l in 0..L {
                    lane[l] += u32::from(a[l] > t);
                }
            }
        }
        for (tot, lane) in total.iter_mut().zip(&lanes) {
            *tot += lane.iter().map(|&v| v as usize).sum::<usize>();
        }
        for v in tail {
            for (tot, &t) in total.iter_mut().zip(ts) {
                *tot += usize::from(v.abs() > t);
            }
        }
    }
    total
}

/// The `k` largest magnitudes among candidates given as indices (ascending)
/// and their values, ties to the lower index, kept in index order: the rule
/// of this module's exact top-k on candidates that arrive with their values
/// (the device selection's, whose candidates come back from the GPU).
/// `mags` is scratch.
pub fn topk_of_candidates(k: usize, idx: &mut Vec<u32>, val: &mut Vec<f32>, mags: &mut Vec<f32>) {
    if idx.len() <= k {
        return;
    }
    if k == 0 {
        idx.clear();
        val.clear();
        return;
    }
    mags.clear();
    mags.extend(val.iter().map(|v| v.abs()));
    let (before, kth, _) = mags.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let kth = *kth;
    let mut ties = k - before.iter().filter(|&&a| a > kth).count();
    let mut w = 0;
    for r in 0..idx.len() {
        let a = val[r].abs();
        let keep = if a > kth {
            true
        } else if a == kth && ties > 0 {
            ties -= 1;
            true
        } else {
            false
        };
        if keep {
            idx[w] = idx[r];
            val[w] = val[r];
            w += 1;
        }
    }
    idx.truncate(w);
    val.truncate(w);
}

#[cfg(test)]
mod tests;
