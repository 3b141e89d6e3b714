//! The α-β-γ cost model: predicted synchronization time of one layer per
//! strategy, from a calibrated cluster [`Profile`] (RedSync §5.4 and
//! Appendix B; Thakur, Rabenseifner & Gropp 2005 for the collectives).
//!
//! Sending a message of `b` bytes costs `α + b·β`; reducing `b` bytes locally
//! costs `b·γ_reduce`, scatter-adding a received sparse unit of `b` bytes
//! `b·γ_unpack`. A layer has `n` f32 elements (`N = 4n` bytes) on `p` ranks;
//! a sparse strategy at density `D` selects `k = ⌈D·n⌉` elements.
//!
//! | strategy | predicted seconds | source |
//! |---|---|---|
//! | `sparse-allgather` | `T_select(n) + ⌈lg p⌉·α + (p−1)·M·β + p·m·γ_unpack`, `m = 16 + 8k` the RGC message (12-byte codec header, then `[len \| indices \| values]`), `M = m + 32` as the engine sends it alone (16-byte fused header, 16-byte table-of-contents entry) | RedSync eq. (1), App. B (recursive doubling, or Bruck's algorithm for `p` not a power of two: `⌈lg p⌉` steps, `(p−1)·M` bytes); [`crate::sparse`]'s framing |
//! | `sparse-allgather-quant` | same with `m = 20 + 4k` (`[len \| mean \| indices]`) and the quantized selection's `T_select` | RedSync §5.2.3 |
//! | `dense-rabenseifner` | `2⌈lg p⌉·α + 2·(p−1)/p·N·β + (p−1)/p·N·γ_reduce`, plus `α + 2N·β + ½N·γ_reduce` when `p` is not a power of two | RedSync eq. (2); Thakur et al. §4.4; the extra term is gradsync's fold (below) |
//! | `dense-ring` | `2(p−1)·α + 2·(p−1)/p·N·β + (p−1)/p·N·γ_reduce` | Thakur et al. §4.3 (ring reduce-scatter + allgather) |
//! | `gradiveq-ring` | the ring formula on `N/r` bytes (ratio `r`) plus the compression not hidden behind communication (below) | GradiVeQ Alg. 1 |
//! | one per codec (`fp16`, `int8`, `qsgd`, `sbc`, `3lc`, `fastsgd`) | `T_encode(n) + ⌈lg p⌉·α + (p−1)·(w + 32)·β + p·T_decode(n)`, `w` the codec's wire bytes | the codec's message exchanged by the same allgather, each rank decoding `p` messages |
//! | `dense-hierarchical` | `2(L−1)·(α + (N/S)·β) + (L−1)·(N/S)·γ_reduce` plus the `dense-rabenseifner` formula over the `H` nodes on `N/S` bytes; one node (`L = p`, `H = 1`): the `dense-ring` formula; one rank per node: the `dense-rabenseifner` one | NCCL's and Horovod's hierarchical allreduce: ring reduce-scatter and allgather inside the node, Thakur et al. §4.4 on each shard between nodes; [`crate::dense::hierarchical_allreduce`] |
//! | `sparse-allreduce` | `T_select(n) + 3⌈lg p⌉·α + (p−1)·(2α + (8 + 8k/p)·β) + (p−1)·R·β + (8k + p·R)·γ_unpack + 4n·γ_clear`: the agreement and sample allgather (`2⌈lg p⌉·α`), `p − 1` pairwise rounds of a count and `k/p` pairs, the allgather of each rank's reduced region of `R = min(8F(p)/p, 4n/p) + 8` bytes, summing what arrives and clearing the `n`-element output | Ok-Topk §3.1 (split and reduce, then allgatherv; Li & Hoefler 2022) with SparCML's dense switch; [`crate::sparse::sparse_allreduce`] |
//! | `sparse-hierarchical` | `T_select(n) + ⌈lg p⌉·α + (L−1)·(α + 8k·β) + ⌈lg H⌉·α + (H−1)·U·β + ⌈lg L⌉·(α + H·U·β) + (8kL + H·U)·γ_unpack + 4n·γ_clear`: the agreement, the node's other ranks' `k` pairs into its leader, the leaders' recursive-doubling allgather of the node units of `U = min(8F(L), 4n) + 8` bytes, a binomial broadcast of the `H` units inside the node, summing and clearing | NCCL's and Horovod's hierarchical scheme on sparse units, with SparCML's dense switch; [`crate::sparse::hierarchical_sparse_allreduce`] |
//! | `powersgd` (rank `r`, [`predict_matrix`]; only where the profile measured PowerSGD) | `T_powersgd(n, r) + T_dense_local(n) + R(4·rows·r) + R(4·cols·r)`: the layer as a `rows × cols` matrix (its shape's, else [`square_view`]), `r` at most `min(rows, cols)`, `R(b)` the `dense-rabenseifner` formula for `b` bytes (the allreduces of `P`, then `Q`), `T_powersgd` the calibrated products and passes ([`PowerSgdFit`]); a matrix whose factors are not twice smaller than it (PyTorch's `min_compression_rate`) is priced as `dense-rabenseifner` | PowerSGD (Vogels et al. 2019) Alg. 1: one power-iteration step, two allreduces |
//!
//! The node-aware strategies use the placement: `H` nodes, `L` ranks on
//! the largest, `S` on the smallest (one node unless a rank count per node
//! is given). `F(j)` is the fill-in, the distinct indices of `j` ranks'
//! selections summed ([`topology`]). The formulas are the one-level
//! model's (every step at `α` and `β`); with a profile that knows the
//! network between nodes, [`topology`] prices each step at the level it
//! crosses.
//!
//! Dense strategies add the engine's local cost of a dense layer,
//! `T_dense_local(n)` (fusing, momentum, unfusing; zero unless calibrated).
//!
//! The non-power-of-two term: gradsync's Rabenseifner folds the first `2r`
//! ranks (`r = p − 2^⌊lg p⌋`) as Open MPI does: partners swap halves and
//! reduce one each (`α + ½N·β + ½N·γ`), the odd rank hands its reduced half
//! over (`α + ½N·β`) and gets the result back at the end (`α + N·β`). That
//! is `3α + 2N·β + ½N·γ` beyond the power-of-two core, of which `2α` are
//! already counted by `⌈lg p⌉` over `⌊lg p⌋`. (MPICH's fold, which sends the
//! whole vector, costs `2α + 2N·β + N·γ`.)
//!
//! GradiVeQ's overlap: compressing the `p` segments costs `T_c(n)`,
//! decompressing `T_d(n)`. Algorithm 1 compresses the next segment while
//! the previous one is in flight, so only the first segment's compression
//! (`T_c/p`) and whatever of the rest exceeds the reduce-scatter's transfer
//! time `(p−1)·(α + N/(r·p)·β)` add to the ring; decompression likewise
//! against the allgather phase.
//!
//! ## β and γ_reduce as functions of the message size
//!
//! One β cannot describe a machine whose copies run at cache speed for
//! messages that stay in cache and at memory speed for the others (over
//! shared memory the two differ by 2–5×; LogGP's `G` and NCCL's per-protocol
//! bandwidths make the same point). A profile may therefore carry a
//! **β curve**: the effective seconds per byte of one pairwise exchange step
//! of `m` bytes each way, `β(m) = (T_exchange(m) − α)/m`, measured by
//! `gradsync calibrate` at powers of two and interpolated linearly in
//! `log m` (constant beyond the ends); likewise a γ_reduce curve. Every
//! formula above is then evaluated with the byte-weighted mean over the
//! algorithm's own messages,
//!
//! `β_eff = Σ mᵢ·β(mᵢ) / Σ mᵢ`,
//!
//! the messages being `N/2, N/4, …, N/p'` twice for Rabenseifner (plus the
//! fold's `N/2, N/2, N` for `p ≠ 2^k`), `2(p−1)` segments of `N/p` for the
//! ring, and `min(2^i, p − 2^i)·m` at step `i` of the recursive-doubling
//! allgather (γ_reduce over the reduced halves `N/2, …, N/p'` and the
//! fold's `N/2`, or `N/p` for the ring). With constant β and γ (no curves,
//! e.g. `--alpha --bandwidth` on the command line) `β_eff = β` and the
//! formulas are exactly the closed forms of the table.
//!
//! Selection and codec costs are linear fits `a + b·n` measured by
//! `gradsync calibrate` (for the sparse strategies `T_select` is the whole
//! local cost of a sparse step in the engine: residual accumulation,
//! selection, packing and zeroing the result). Without a profile they are
//! zero unless given on the command line.

pub(crate) mod argmin;
mod bucket;
pub(crate) mod decide;
mod exchange;
mod layers_file;
mod query;
pub mod records;
mod step;
pub mod topology;
pub mod tuning;
pub use argmin::NEAR_TIE;
pub use bucket::{
    choose_bucket_cap, cut_buckets, price_buckets, BucketPlan, BucketTiming, CAPS_MB,
    FIRST_STEP_CAP_BYTES,
};
pub use decide::{choose, default_candidates, engine_candidates, parse_list, StrategyId};
pub use exchange::{
    choose_allgatherv, choose_dense_allreduce, choose_sparse_exchange, Choice, ExchangeQuery,
};
pub use query::{Placement, StepQuery, GRADIVEQ_RATIO};
pub use step::{
    plan_step, predict_step, sparse_collective, sparse_collective_by, GroupKind, GroupPlan,
    LayerKind, LayerPlan, StepLayer, StepPlan, MAX_RANKS,
};
pub use topology::{Burst, NetLevel};
pub use tuning::{layers_in_parallel, Decision, ExchangeLoad, LayerPolicy, Masks, Tuning};

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
/// `bytes` (see [`Profile::validate`]).
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

/// Cost of one codec: encode and decode fits and wire size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CodecFit {
    /// Encoding `n` elements.
    pub encode: LinearFit,
    /// Decoding (adding) one message of `n` elements.
    pub decode: LinearFit,
    /// Measured wire bytes per element (data-dependent codecs: 3LC, FastSGD);
    /// `None` uses the codec's analytic size.
    #[serde(default)]
    pub bytes_per_element: Option<f64>,
}

/// Where and when a profile was measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileMeta {
    /// Host name(s) and CPU.
    #[serde(default)]
    pub machine: String,
    /// MPI library version string.
    #[serde(default)]
    pub mpi: String,
    /// Date of the calibration (UTC, ISO 8601).
    #[serde(default)]
    pub date: String,
    /// Ranks of the calibration job.
    #[serde(default)]
    pub ranks: usize,
    /// Free-form note (transport, network emulation, ...).
    #[serde(default)]
    pub note: String,
}

/// The least speedup of the layer-parallel local phase
/// ([`Profile::local_parallelism`]) for which the engine runs it
/// ([`layers_in_parallel`]) and the step model divides by it. Where
/// every core is already busy with a rank the calibration measures it
/// about 1 (0.80–1.03 in the development VM's calibrations, 2 ranks on 2
/// cores), and the engine then ran the phase parallel or serial by the
/// noise of one probe. Parallel there cost the LSTM table's RGC step
/// 5 % over shared memory (96.8 against 92.1 ms, means of four 7-step
/// medians) and up to 8 % at 1 Gbit/s, with twice the spread.
pub const PARALLEL_MIN_SPEEDUP: f64 = 1.1;

/// Current profile format version (2 added the β and γ_reduce curves;
/// version-1 profiles still load, with constant β and γ).
pub const PROFILE_VERSION: u32 = 2;

/// A calibrated cluster: the α-β-γ constants and the local cost fits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Format version ([`PROFILE_VERSION`]).
    #[serde(default = "profile_version")]
    pub version: u32,
    /// Seconds per message.
    pub alpha: f64,
    /// Seconds per byte sent.
    pub beta: f64,
    /// Seconds per byte reduced locally (dense allreduce).
    #[serde(default)]
    pub gamma_reduce: f64,
    /// Seconds per byte of sparse unit scatter-added.
    #[serde(default)]
    pub gamma_unpack: f64,
    /// Seconds per byte of clearing a dense output (`fill(0.0)` of a layer
    /// of several MiB, every rank at once): what the sparse allreduces pay
    /// to overwrite their `n`-element result before summing into it
    /// ([`topology`]). The engine's fused-allgather path clears its layers
    /// in the local phase, inside the selection fits. Zero in profiles from
    /// before it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gamma_clear: f64,
    /// γ_clear by the size of the output (`bytes` = 4·n), log-linear
    /// between its points ([`Self::gamma_clear_at`]): `calibrate` clears
    /// 4 MiB up to 128 MiB on every rank at once. The cost per byte is not flat: past the size where memset
    /// switches to non-temporal stores (about the last-level cache) it
    /// halves on the project's VMs. Empty in profiles from before it (then
    /// [`Self::gamma_clear`] everywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gamma_clear_curve: Vec<CurvePoint>,
    /// β by message size (pairwise exchange steps; see the module docs);
    /// empty: the constant `beta`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub beta_curve: Vec<CurvePoint>,
    /// γ_reduce by the size of the reduced message; empty: the constant
    /// `gamma_reduce`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gamma_reduce_curve: Vec<CurvePoint>,
    /// γ_unpack by the size of the dense output the pairs are added into
    /// (`bytes` = 4·n): the sparse allreduces clear an output of the whole
    /// group (ResNet-50's 97.5 MiB) and then add the received pairs into
    /// it, each pair a cache line fetched from memory, at 2.5–3 times the
    /// cost per byte of [`Self::gamma_unpack`] (measured on the emulated
    /// cluster, docs/benchmarks/cluster.md), which `calibrate` fits on
    /// outputs of at most 16 MiB reused between calls. The first point is
    /// that fit at the largest of those outputs; the next ones are added
    /// into a just-cleared output ([`Self::gamma_unpack_at`]). Empty in
    /// profiles from before it (then the constant everywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gamma_unpack_curve: Vec<CurvePoint>,
    /// Local cost of a sparse step per selection method (`trimmed`,
    /// `threshold`, `sampled`, `exact`, and `quant` for quantized RGC);
    /// `method@density` keys hold fits calibrated at one density.
    #[serde(default)]
    pub select: BTreeMap<String, LinearFit>,
    /// The same local cost by layer size, per key of [`Self::select`]:
    /// seconds per byte of the layer (`4n`) at each probed size. Its last
    /// point prices the layers larger than every probe
    /// ([`Self::select_at`]). Empty in profiles from before it (then the
    /// fit everywhere).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub select_curve: BTreeMap<String, Vec<CurvePoint>>,
    /// Per codec (`fp16`, `int8`, `qsgd`, `sbc`, `3lc`, `fastsgd`).
    #[serde(default)]
    pub codecs: BTreeMap<String, CodecFit>,
    /// The engine's local cost of one dense layer per step: copying it
    /// into the fused dense buffer, the momentum update and copying the
    /// average out (`n` elements; zero when not measured). The step model
    /// charges it to every dense layer ([`plan_step`]).
    #[serde(default, skip_serializing_if = "LinearFit::is_zero")]
    pub dense_local: LinearFit,
    /// The same cost per gradient byte by the size of the step's whole
    /// table (bytes): a step whose table is larger than the last-level
    /// cache streams its dense layers from memory (measured on one layer
    /// up to 16 MiB, then on tables of several). Empty in profiles from
    /// before it (then [`Self::dense_local`] alone).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_local_curve: Vec<CurvePoint>,
    /// Effective speedup of the engine's layer-parallel local phase
    /// (selection, encoding and unpacking of several sparse layers spread
    /// over its threads), measured by `calibrate` with every rank busy at
    /// once; 1 when not measured. Where it pays
    /// ([`Profile::parallel_speedup`]) the engine runs the phase on its
    /// threads, and the step model divides the sparse group's local
    /// seconds by it when the group has two layers or more.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub local_parallelism: f64,
    /// PowerSGD's local cost of a layer ([`PowerSgdFit`]); zero (and left
    /// out of the JSON) in profiles from before it.
    #[serde(default, skip_serializing_if = "PowerSgdFit::is_zero")]
    pub powersgd: PowerSgdFit,
    /// GradiVeQ compression of a whole layer.
    #[serde(default)]
    pub gradiveq_compress: LinearFit,
    /// GradiVeQ decompression of a whole layer.
    #[serde(default)]
    pub gradiveq_decompress: LinearFit,
    /// One-way ping-pong fit (`a` = latency, `b` = seconds per byte), for
    /// reference: the model's `alpha`/`beta` are fitted to pairwise
    /// exchanges (sendrecv), which run both directions at once as the
    /// collectives' steps do.
    #[serde(default)]
    pub pingpong: LinearFit,
    /// Recursive-doubling allgather fit of `⌈lg p⌉·a + (p−1)·bytes·b`, for
    /// reference (it includes the copy of the rank's own block).
    #[serde(default)]
    pub allgather: LinearFit,
    /// The network between nodes ([`topology`]): `None` when the
    /// calibrating job ran on one node (the model is then one level).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_node: Option<NetLevel>,
    /// Metadata.
    #[serde(default)]
    pub meta: ProfileMeta,
}

fn one() -> f64 {
    1.0
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn profile_version() -> u32 {
    PROFILE_VERSION
}

impl Profile {
    /// A profile with only the network constants (all local costs zero).
    pub fn from_network(
        alpha: f64,
        bandwidth: f64,
        gamma_reduce: f64,
        gamma_unpack: f64,
    ) -> Result<Self> {
        if !(bandwidth > 0.0 && bandwidth.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "bandwidth {bandwidth} bytes/s must be positive"
            )));
        }
        let p = Profile {
            version: PROFILE_VERSION,
            alpha,
            beta: 1.0 / bandwidth,
            gamma_reduce,
            gamma_unpack,
            gamma_clear: 0.0,
            gamma_clear_curve: Vec::new(),
            beta_curve: Vec::new(),
            gamma_reduce_curve: Vec::new(),
            gamma_unpack_curve: Vec::new(),
            dense_local_curve: Vec::new(),
            select: BTreeMap::new(),
            select_curve: BTreeMap::new(),
            codecs: BTreeMap::new(),
            dense_local: LinearFit::default(),
            local_parallelism: 1.0,
            powersgd: PowerSgdFit::default(),
            gradiveq_compress: LinearFit::default(),
            gradiveq_decompress: LinearFit::default(),
            pingpong: LinearFit::default(),
            allgather: LinearFit::default(),
            inter_node: None,
            meta: ProfileMeta::default(),
        };
        p.validate()?;
        Ok(p)
    }

    /// Reject negative or non-finite constants and unknown versions.
    pub fn validate(&self) -> Result<()> {
        if !(1..=PROFILE_VERSION).contains(&self.version) {
            return Err(Error::InvalidArgument(format!(
                "profile version {} (this build reads {PROFILE_VERSION})",
                self.version
            )));
        }
        let mut bad = Vec::new();
        self.bad_constants(&mut bad);
        self.bad_fits(&mut bad);
        self.bad_curves(&mut bad);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "bad profile constants (each must be finite and ≥ 0, curves in increasing \
                 sizes): {}",
                bad.join(", ")
            )))
        }
    }

    /// Appends to `bad` the scalar constants out of range (the local
    /// parallelism, α, β, the γs, the link between nodes and its burst
    /// credit).
    fn bad_constants(&self, bad: &mut Vec<String>) {
        if !(self.local_parallelism.is_finite() && self.local_parallelism > 0.0) {
            bad.push(format!("local_parallelism = {}", self.local_parallelism));
        }
        let inter = self.inter_node.as_ref();
        for (name, v) in [
            ("alpha", self.alpha),
            ("beta", self.beta),
            ("gamma_reduce", self.gamma_reduce),
            ("gamma_unpack", self.gamma_unpack),
            ("gamma_clear", self.gamma_clear),
            ("inter_node.alpha", inter.map_or(0.0, |e| e.alpha)),
            ("inter_node.beta", inter.map_or(0.0, |e| e.beta)),
            (
                "inter_node.burst.bytes",
                inter.and_then(|e| e.burst).map_or(0.0, |b| b.bytes),
            ),
            (
                "inter_node.burst.beta",
                inter.and_then(|e| e.burst).map_or(0.0, |b| b.beta),
            ),
        ] {
            if !non_negative(v) {
                bad.push(format!("{name} = {v}"));
            }
        }
        // A credit moves its bytes faster than the link's sustained rate
        // at some message size, or it is no credit (the model would
        // ignore it without a word). The calibration fits it below β at
        // its largest message.
        if let Some((e, b)) = inter.and_then(|e| e.burst.map(|b| (e, b))) {
            let slowest = e
                .beta_curve
                .iter()
                .map(|c| c.per_byte)
                .fold(e.beta, f64::max);
            if non_negative(b.beta) && b.bytes > 0.0 && b.beta >= slowest {
                bad.push(format!(
                    "inter_node.burst.beta = {} (not below the link's sustained {slowest} s/B \
                     at any size: a burst credit is faster than the link)",
                    b.beta
                ));
            }
        }
    }

    /// Appends to `bad` the linear fits out of range and the codecs' wire
    /// bytes per element outside [0, 16].
    fn bad_fits(&self, bad: &mut Vec<String>) {
        let fits = self
            .select
            .iter()
            .map(|(k, f)| (format!("select.{k}"), *f))
            .chain(self.codecs.iter().flat_map(|(k, c)| {
                [
                    (format!("codecs.{k}.encode"), c.encode),
                    (format!("codecs.{k}.decode"), c.decode),
                ]
            }))
            .chain([
                ("dense_local".to_string(), self.dense_local),
                ("gradiveq_compress".to_string(), self.gradiveq_compress),
                ("gradiveq_decompress".to_string(), self.gradiveq_decompress),
                ("pingpong".to_string(), self.pingpong),
                ("allgather".to_string(), self.allgather),
            ]);
        for (k, f) in fits {
            if !non_negative(f.a) || !non_negative(f.b) {
                bad.push(format!("{k} = {f:?}"));
            }
        }
        let ps = &self.powersgd;
        if ![ps.a, ps.per_elem, ps.per_elem_rank]
            .into_iter()
            .all(non_negative)
            || !ps
                .curve
                .iter()
                .all(|p| p.elements >= 1 && p.rank >= 1 && non_negative(p.per_elem))
            || ps.curve.len() > 64
            || (!ps.curve.is_empty() && ps.curve.iter().all(|p| p.per_elem == 0.0))
        {
            bad.push(format!(
                "powersgd = {{a: {}, per_elem: {}, per_elem_rank: {}, curve: {} points}} \
                 (coefficients and per-element costs finite and non-negative, a curve of \
                 at most 64 points at 1 element and rank 1 or more, not all of them zero)",
                ps.a,
                ps.per_elem,
                ps.per_elem_rank,
                ps.curve.len()
            ));
        }
        // A codec's measured wire bytes per element: at most 16 (an
        // index/value pair and then some).
        for (k, c) in &self.codecs {
            if let Some(b) = c.bytes_per_element {
                if !(b.is_finite() && (0.0..=16.0).contains(&b)) {
                    bad.push(format!(
                        "codecs.{k}.bytes_per_element = {b:?} (must be in [0, 16])"
                    ));
                }
            }
        }
    }

    /// Appends to `bad` the curves' points out of range or out of order
    /// (sizes must increase).
    fn bad_curves(&self, bad: &mut Vec<String>) {
        let inter = self.inter_node.as_ref();
        let no_curve = Vec::new();
        for (name, curve) in [
            ("beta_curve", &self.beta_curve),
            ("gamma_reduce_curve", &self.gamma_reduce_curve),
            ("gamma_unpack_curve", &self.gamma_unpack_curve),
            ("gamma_clear_curve", &self.gamma_clear_curve),
            ("dense_local_curve", &self.dense_local_curve),
            (
                "inter_node.beta_curve",
                inter.map_or(&no_curve, |e| &e.beta_curve),
            ),
            (
                "inter_node.oneway_curve",
                inter.map_or(&no_curve, |e| &e.oneway_curve),
            ),
        ]
        .into_iter()
        .map(|(name, c)| (name.to_string(), c))
        .chain(
            self.select_curve
                .iter()
                .map(|(k, c)| (format!("select_curve.{k}"), c)),
        ) {
            for (i, c) in curve.iter().enumerate() {
                if !(c.bytes.is_finite() && c.bytes > 0.0 && non_negative(c.per_byte)) {
                    bad.push(format!("{name}[{i}] = {c:?}"));
                } else if i > 0 && curve[i - 1].bytes >= c.bytes {
                    bad.push(format!("{name}[{i}]: sizes must increase"));
                }
            }
        }
    }

    /// Read a JSON profile. Every error ([`Error::File`]) names the file:
    /// unreadable, not a profile (truncated, a field of the wrong type), or
    /// constants out of range.
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        // 64 MiB: a profile is a few KiB.
        let bytes = crate::error::read_small_file(path, 64 << 20, "profile")?;
        let p: Profile = serde_json::from_slice(&bytes)
            .map_err(|e| Error::file(path, format!("not a gradsync profile: {e}")))?;
        p.validate()
            .map_err(|e| Error::file(path, format!("bad profile: {e}")))?;
        Ok(p)
    }

    /// Write as pretty JSON (errors name the file), through a temporary
    /// file and a rename: a full disk leaves an existing profile whole.
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        crate::error::write_replacing(path, &serde_json::to_vec_pretty(self)?)
            .map_err(|e| Error::file(path, format!("cannot write profile: {e}")))
    }

    /// β at a message of `m` bytes (the curve if there is one, read by
    /// [`curve_time_at`]).
    pub fn beta_at(&self, m: f64) -> f64 {
        curve_time_at(&self.beta_curve, self.beta, m)
    }

    /// The layer-parallel local phase's speedup
    /// ([`Self::local_parallelism`]) where it pays, at least
    /// [`PARALLEL_MIN_SPEEDUP`]; `None` (serial) otherwise.
    pub fn parallel_speedup(&self) -> Option<f64> {
        (self.local_parallelism >= PARALLEL_MIN_SPEEDUP).then_some(self.local_parallelism)
    }

    /// The engine's local cost of a dense layer of `n` elements in a step
    /// whose whole table has `table` elements: `4n` bytes at the
    /// [`Self::dense_local_curve`]'s cost per byte for the table's size,
    /// or [`Self::dense_local`] where there is no curve.
    pub fn dense_local_at(&self, n: f64, table: f64) -> f64 {
        if self.dense_local_curve.is_empty() {
            return self.dense_local.at(n);
        }
        4.0 * n * curve_at(&self.dense_local_curve, 0.0, 4.0 * table.max(n))
    }

    /// γ_reduce at a reduced message of `m` bytes.
    pub fn gamma_reduce_at(&self, m: f64) -> f64 {
        curve_time_at(&self.gamma_reduce_curve, self.gamma_reduce, m)
    }

    /// γ_unpack (seconds per byte of pairs) for pairs added into a dense
    /// output of `out_bytes`: the [`Self::gamma_unpack_curve`], log-linear
    /// between its points, its first point's value below it and its last
    /// one's above; [`Self::gamma_unpack`] without a curve.
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, Profile};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// assert_eq!(p.gamma_unpack_at(1e9), 1e-9);
    /// p.gamma_unpack_curve = vec![
    ///     CurvePoint { bytes: 16.0 * 1048576.0, per_byte: 1e-9 },
    ///     CurvePoint { bytes: 64.0 * 1048576.0, per_byte: 2e-9 },
    /// ];
    /// assert_eq!(p.gamma_unpack_at(4096.0), 1e-9);
    /// assert!((p.gamma_unpack_at(32.0 * 1048576.0) - 1.5e-9).abs() < 1e-15);
    /// assert_eq!(p.gamma_unpack_at(1e9), 2e-9);
    /// ```
    pub fn gamma_unpack_at(&self, out_bytes: f64) -> f64 {
        curve_at(&self.gamma_unpack_curve, self.gamma_unpack, out_bytes)
    }

    /// γ_clear (seconds per byte) for clearing a dense output of
    /// `out_bytes`: the [`Self::gamma_clear_curve`] as
    /// [`Self::gamma_unpack_at`] reads its curve (through
    /// [`curve_time_at`]: clearing more never takes less time),
    /// [`Self::gamma_clear`] without one.
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, Profile};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// p.gamma_clear = 5e-11;
    /// assert_eq!(p.gamma_clear_at(1e9), 5e-11);
    /// p.gamma_clear_curve = vec![
    ///     CurvePoint { bytes: 16.0 * 1048576.0, per_byte: 4e-11 },
    ///     CurvePoint { bytes: 64.0 * 1048576.0, per_byte: 2e-11 },
    /// ];
    /// assert_eq!(p.gamma_clear_at(4096.0), 4e-11);
    /// assert!((p.gamma_clear_at(32.0 * 1048576.0) - 3e-11).abs() < 1e-18);
    /// assert_eq!(p.gamma_clear_at(1e9), 2e-11);
    /// ```
    pub fn gamma_clear_at(&self, out_bytes: f64) -> f64 {
        curve_time_at(&self.gamma_clear_curve, self.gamma_clear, out_bytes)
    }

    /// The selection fit of `method` at `density`: the fit calibrated at
    /// exactly that density (`"trimmed@0.01"`) if there is one, else the
    /// method's default (`"trimmed"`), else zero.
    pub fn select_fit(&self, method: &str, density: f64) -> LinearFit {
        self.select_key(method, density)
            .map_or_else(LinearFit::default, |k| self.select[k])
    }

    /// The key of [`Self::select`] that prices `method` at `density`
    /// (as [`Self::select_fit`] reads it).
    fn select_key(&self, method: &str, density: f64) -> Option<&str> {
        // `method@density` keys compared without formatting the density:
        // the step model asks once per layer and strategy, and a table of
        // 10^6 layers spent a fifth of `plan` in that `format!`.
        let at_density = |k: &str| {
            k.split_once('@')
                .is_some_and(|(m, d)| m == method && d.parse::<f64>().ok() == Some(density))
        };
        self.select
            .keys()
            .find(|k| at_density(k))
            .or_else(|| self.select.get_key_value(method).map(|(k, _)| k))
            .map(String::as_str)
    }

    /// Seconds of the local cost of a sparse step of `method` at
    /// `density` on a layer of `n` elements: [`Self::select_fit`] over
    /// the probed sizes; past the largest of them, the more of the fit and
    /// the largest probe's cost per element ([`Self::select_curve`]'s last
    /// point). The fit averages sizes that fit in the caches, and a layer
    /// past the probes is out of them, as the largest probe is: the LSTM
    /// table's 9–15 M-element layers cost 1.4–1.6 ns an element where the
    /// fit said 1.3. Inside the probed range the fit, not the curve's
    /// points: on the development VM the probes at 1 and 2 Mi elements
    /// read 2.4–2.6 ns in one job's four calibrations (512 Ki and 4 Mi:
    /// 1.4–1.7), which ResNet-50's steps did not show.
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, LinearFit, Profile};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// p.select.insert("trimmed".into(), LinearFit { a: 1e-6, b: 1e-9 });
    /// assert!((p.select_at("trimmed", 0.001, 1e7) - 1.0001e-2).abs() < 1e-12);
    /// p.select_curve.insert("trimmed".into(), vec![
    ///     CurvePoint { bytes: 4.0 * 65536.0, per_byte: 0.25e-9 },
    ///     CurvePoint { bytes: 4.0 * 4194304.0, per_byte: 0.4e-9 },
    /// ]);
    /// // Past the largest probe: its 1.6 ns an element.
    /// assert!((p.select_at("trimmed", 0.001, 1e7) - 1.6e-2).abs() < 1e-12);
    /// // Inside the probed range: the fit.
    /// assert!((p.select_at("trimmed", 0.001, 1e6) - 1.001e-3).abs() < 1e-12);
    /// ```
    pub fn select_at(&self, method: &str, density: f64, n: f64) -> f64 {
        // The key once: the planner prices every layer with this.
        let Some(key) = self.select_key(method, density) else {
            return 0.0;
        };
        let fit = self.select[key].at(n);
        match self.select_curve.get(key).and_then(|c| c.last()) {
            Some(l) if 4.0 * n > l.bytes => fit.max(4.0 * n * l.per_byte),
            _ => fit,
        }
    }
}

/// Whether a profile constant is in range: finite and ≥ 0.
fn non_negative(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

/// A layer and the parameters of the sparse strategies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Query {
    /// f32 elements of the layer.
    pub n: usize,
    /// Where it is synchronized.
    pub at: Placement,
    /// Density of the sparse strategies, in `(0, 1]`.
    pub density: f64,
    /// GradiVeQ compression ratio `r ≥ 1`.
    pub gradiveq_ratio: f64,
}

impl Query {
    /// The step model's query for this layer synchronized alone: no
    /// threshold, every strategy allowed, PowerSGD at `powersgd_rank`.
    fn alone(&self, select_method: &str, powersgd_rank: usize) -> StepQuery {
        StepQuery {
            at: self.at,
            density: self.density,
            select_method: select_method.to_string(),
            gradiveq_ratio: self.gradiveq_ratio,
            allowed: Vec::new(),
            min_sparse_elems: 0,
            powersgd_rank,
        }
    }
}

/// One strategy's prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The strategy, typed (the decision path uses this, never the name).
    #[serde(skip)]
    pub id: StrategyId,
    /// Strategy name (`dense-rabenseifner`, `sparse-allgather`, ...).
    pub name: String,
    /// Predicted seconds.
    pub seconds: f64,
    /// Bytes each rank sends.
    pub wire_bytes: f64,
}

/// Strategy names in output order (codecs after the eight named
/// strategies): [`StrategyId::ALL`]'s names, derived from them.
pub const STRATEGIES: [&str; StrategyId::ALL.len()] = {
    let mut names = [""; StrategyId::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = StrategyId::ALL[i].name();
        i += 1;
    }
    names
};

/// `⌈lg p⌉` (0 for `p = 1`).
pub fn ceil_lg(p: usize) -> f64 {
    if p <= 1 {
        0.0
    } else {
        f64::from(usize::BITS - (p - 1).leading_zeros())
    }
}

fn frac(p: usize) -> f64 {
    (p as f64 - 1.0) / p as f64
}

/// `k = ⌈D·n⌉` (the codecs' count, [`crate::codec::sparse_k`]).
pub use crate::codec::sparse_k;

/// The messages of Rabenseifner's allreduce of `bytes` on `p` ranks: those
/// sent (halving and doubling on `p' = 2^⌊lg p⌋` ranks, plus the fold's) and
/// those reduced.
fn rabenseifner_messages(bytes: f64, p: usize) -> (Vec<f64>, Vec<f64>) {
    let pp = if p.is_power_of_two() {
        p
    } else {
        1usize << (usize::BITS - 1 - p.leading_zeros())
    };
    let mut halves = Vec::new();
    let mut m = bytes;
    let mut q = 1;
    while q < pp {
        m /= 2.0;
        halves.push(m);
        q *= 2;
    }
    let mut sent: Vec<f64> = halves.iter().chain(halves.iter()).copied().collect();
    let mut reduced = halves;
    if !p.is_power_of_two() {
        sent.extend([bytes / 2.0, bytes / 2.0, bytes]);
        reduced.push(bytes / 2.0);
    }
    (sent, reduced)
}

/// Dense Rabenseifner allreduce of `bytes` on `p` ranks (eq. 2 plus the
/// non-power-of-two fold; β and γ_reduce averaged over its messages).
pub fn dense_rabenseifner(prof: &Profile, bytes: f64, p: usize) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let (sent, reduced) = rabenseifner_messages(bytes, p);
    let beta = curve_mean(&prof.beta_curve, prof.beta, &sent);
    let gamma = curve_mean(&prof.gamma_reduce_curve, prof.gamma_reduce, &reduced);
    let base =
        2.0 * ceil_lg(p) * prof.alpha + 2.0 * frac(p) * bytes * beta + frac(p) * bytes * gamma;
    if p.is_power_of_two() {
        base
    } else {
        base + prof.alpha + 2.0 * bytes * beta + 0.5 * bytes * gamma
    }
}

/// Dense ring allreduce of `bytes` on `p` ranks (segments of `bytes/p`).
pub fn dense_ring(prof: &Profile, bytes: f64, p: usize) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let seg = bytes / p as f64;
    2.0 * (p as f64 - 1.0) * prof.alpha
        + 2.0 * frac(p) * bytes * prof.beta_at(seg)
        + frac(p) * bytes * prof.gamma_reduce_at(seg)
}

/// β averaged over the steps of a recursive-doubling allgather of `m` bytes
/// per rank (step `i` moves `min(2^i, p − 2^i)` blocks).
fn allgather_beta(prof: &Profile, m: f64, p: usize) -> f64 {
    if prof.beta_curve.is_empty() {
        return prof.beta;
    }
    let mut msgs = Vec::new();
    let mut q = 1usize;
    while q < p {
        msgs.push(q.min(p - q) as f64 * m);
        q *= 2;
    }
    curve_mean(&prof.beta_curve, prof.beta, &msgs)
}

/// Recursive-doubling allgather of `m` bytes per rank plus unpacking them
/// (`p·m·γ_unpack`): the communication part of eq. (1).
pub fn allgather_unpack(prof: &Profile, m: f64, p: usize) -> f64 {
    ceil_lg(p) * prof.alpha
        + (p as f64 - 1.0) * m * allgather_beta(prof, m, p)
        + p as f64 * m * prof.gamma_unpack
}

/// Wire bytes of a codec message for `n` elements at density `d` (the
/// 12-byte header included), from the codec's own size contract
/// ([`crate::codec::CodecConfig::wire_bytes`], its parameters' defaults and
/// density `d`); `None` for data-dependent codecs or an unknown name.
pub fn codec_wire_bytes(codec: &str, n: usize, d: f64) -> Option<f64> {
    use crate::codec::CodecConfig;
    use std::cell::RefCell;
    use std::collections::HashMap;
    thread_local! {
        // Each name parsed once per thread: the step model asks once per
        // layer and strategy, and parsing was 40 % of `plan` on 10^6 layers.
        static PARSED: RefCell<HashMap<String, Option<CodecConfig>>> = RefCell::default();
    }
    let parsed = PARSED.with(|m| {
        if let Some(c) = m.borrow().get(codec) {
            return c.clone();
        }
        let c = codec.parse::<CodecConfig>().ok();
        let mut m = m.borrow_mut();
        // The strategies name a handful of codecs; any other caller's
        // strings are not kept past a small bound.
        if m.len() < 64 {
            m.insert(codec.to_string(), c.clone());
        }
        c
    });
    parsed?.with_density(d.clamp(1e-12, 1.0)).wire_bytes(n)
}

/// Wire bytes of a data-dependent codec's message for `n` elements: the
/// profile's measured bytes per element for it, else its nominal ones
/// (as the step model prices such a layer).
pub fn nominal_wire_bytes(prof: &Profile, codec: &str, n: usize) -> f64 {
    let b = prof
        .codecs
        .get(codec)
        .and_then(|f| f.bytes_per_element)
        .unwrap_or_else(|| nominal_bytes_per_element(codec));
    12.0 + b * n as f64
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
    /// Whether every coefficient is zero (not measured).
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

    /// (`rank`, seconds per element at `n` elements) from the curve's
    /// points at `rank`: linear in `ln n` between the probed sizes
    /// around `n`, the nearest one's past them.
    fn at_rank(&self, rank: usize, n: f64) -> (f64, f64) {
        let pts = || self.curve.iter().filter(move |p| p.rank == rank);
        let lo = pts()
            .filter(|p| p.elements as f64 <= n)
            .max_by_key(|p| p.elements);
        let hi = pts()
            .filter(|p| p.elements as f64 >= n)
            .min_by_key(|p| p.elements);
        let pe = match (lo, hi) {
            (Some(a), Some(b)) if a.elements != b.elements => lerp(
                ((a.elements as f64).ln(), a.per_elem),
                ((b.elements as f64).ln(), b.per_elem),
                n.ln(),
            ),
            (Some(a), _) => a.per_elem,
            (None, Some(b)) => b.per_elem,
            (None, None) => 0.0,
        };
        (rank as f64, pe)
    }
}

/// The line through `a` and `b` at `x`.
fn lerp(a: (f64, f64), b: (f64, f64), x: f64) -> f64 {
    if b.0 == a.0 {
        return b.1;
    }
    a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0)
}

/// Nominal bytes per element of the data-dependent codecs when no profile
/// says otherwise: 3LC's 1.6 bits per value (its paper and gradsync's
/// own measurement); FastSGD 1 byte per value.
fn nominal_bytes_per_element(codec: &str) -> f64 {
    match codec {
        "3lc" => 0.2,
        _ => 1.0,
    }
}

/// Predicted time of every strategy, in [`STRATEGIES`] order.
///
/// `select_method` picks the profile's selection fit for
/// `sparse-allgather` (`trimmed` by default in the CLI); the quantized
/// strategy uses the `quant` fit.
pub fn predict(prof: &Profile, q: &Query, select_method: &str) -> Result<Vec<Prediction>> {
    step::check_select_method(select_method)?;
    let sq = q.alone(select_method, 1);
    step::check(&sq)?;
    // PowerSGD is priced on a matrix: a layer of `n` elements alone has
    // no shape (`plan` and `bench --op step` price it from a layers file).
    let preds: Vec<Prediction> = StrategyId::ALL
        .into_iter()
        .filter(|&id| id != StrategyId::Powersgd)
        .map(|id| step::alone(prof, &sq, (q.n, None), id, q.density))
        .collect();
    match preds.iter().find(|x| !step::sane(x.seconds)) {
        Some(x) => Err(step::overflow(&format!("strategy {}", x.name), x.seconds)),
        None => Ok(preds),
    }
}

/// The most nearly square matrix view of a layer of `n` elements whose
/// shape is not known: `⌊√n⌋` rows of `⌈n / rows⌉` columns (at most a row
/// more than `n` elements). What `predict`, `crossover` and their
/// Python twin price PowerSGD on when no shape is given: the layer shape
/// that PowerSGD compresses most, so a best case for it.
pub fn square_view(n: usize) -> (usize, usize) {
    // ⌊√n⌋ (`usize::isqrt` is past the MSRV): the float's root, then
    // corrected by one either way.
    let mut rows = (n as f64).sqrt() as usize;
    while rows.checked_mul(rows).is_none_or(|sq| sq > n) {
        rows -= 1;
    }
    while (rows + 1).checked_mul(rows + 1).is_some_and(|sq| sq <= n) {
        rows += 1;
    }
    let rows = rows.max(1);
    (rows, n.div_ceil(rows).max(1))
}

/// Whether PowerSGD at `rank` compresses a layer of `n` elements on its
/// [`square_view`] (else it is priced, and runs, dense).
pub fn powersgd_compresses(n: usize, rank: usize) -> bool {
    step::powersgd_factors(Some(square_view(n)), rank as f64).is_some()
}

/// [`predict`] with PowerSGD too, priced at `rank` on the layer's
/// `matrix` (rows × columns; [`square_view`] where the shape is not
/// known) when the profile prices it (`calibrate` measures its products);
/// a matrix PowerSGD would not shrink at PyTorch's `min_compression_rate`
/// of 2 is priced as the engine runs it, dense. In [`STRATEGIES`] order.
pub fn predict_matrix(
    prof: &Profile,
    q: &Query,
    select_method: &str,
    matrix: (usize, usize),
    rank: usize,
) -> Result<Vec<Prediction>> {
    let mut preds = predict(prof, q, select_method)?;
    if prof.powersgd.is_zero() {
        return Ok(preds);
    }
    let (rows, cols) = matrix;
    if rows == 0 || cols == 0 || rows.saturating_mul(cols) < q.n {
        return Err(Error::InvalidArgument(format!(
            "a matrix of {rows} x {cols} cannot hold the layer's {} elements",
            q.n
        )));
    }
    if rank == 0 {
        return Err(Error::InvalidArgument(
            "PowerSGD rank 0: must be at least 1".into(),
        ));
    }
    let sq = q.alone(select_method, rank);
    let m = step::powersgd_factors(Some(matrix), rank as f64).map(|(r, c, _)| (r, c));
    let x = step::alone(prof, &sq, (q.n, m), StrategyId::Powersgd, rank as f64);
    if !step::sane(x.seconds) {
        return Err(step::overflow("strategy powersgd", x.seconds));
    }
    preds.push(x);
    preds.sort_by_key(|x| x.id as usize);
    Ok(preds)
}

/// GradiVeQ's ring on `N/r` bytes plus the compression and decompression
/// not hidden behind its transfers (module docs), for `n` elements.
pub fn gradiveq_ring(prof: &Profile, n: usize, p: usize, ratio: f64) -> f64 {
    let (nf, pf) = (n as f64, p as f64);
    let cb = 4.0 * nf / ratio;
    let ring = dense_ring(prof, cb, p);
    let phase = (pf - 1.0) * (prof.alpha + cb / pf * prof.beta_at(cb / pf));
    let (tc, td) = (
        prof.gradiveq_compress.at(nf),
        prof.gradiveq_decompress.at(nf),
    );
    let exposed = |t: f64| t / pf + (frac(p) * t - phase).max(0.0);
    ring + exposed(tc) + exposed(td)
}

/// Smallest layer size (elements, searched over powers of two and refined
/// by bisection to 1%) from which `sparse` is predicted faster than `dense`
/// for every larger size up to `max_n`; `None` if never. `base` gives the
/// ranks, their placement, density, fill and GradiVeQ ratio (its `n` is
/// ignored). `sparse` may be `powersgd`, priced at `powersgd_rank` on each
/// size's [`square_view`].
pub fn crossover(
    prof: &Profile,
    base: &Query,
    select_method: &str,
    (sparse, dense): (&str, &str),
    max_n: usize,
    powersgd_rank: usize,
) -> Result<Option<usize>> {
    let psg = sparse == StrategyId::Powersgd.name();
    if psg && prof.powersgd.is_zero() {
        return Err(Error::InvalidArgument(
            "powersgd: this profile does not price PowerSGD's products (gradsync \
             calibrate measures them)"
                .into(),
        ));
    }
    let diff = |n: usize| -> Result<f64> {
        if psg && !powersgd_compresses(n, powersgd_rank) {
            // Priced dense there: not a win of PowerSGD's.
            return Ok(1.0);
        }
        let q = Query { n, ..*base };
        let preds = predict_matrix(prof, &q, select_method, square_view(n), powersgd_rank)?;
        let get = |name: &str| {
            preds
                .iter()
                .find(|x| x.name == name)
                .map(|x| x.seconds)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown strategy {name:?}")))
        };
        Ok(get(sparse)? - get(dense)?)
    };
    // Walk powers of two from the top down while sparse stays faster.
    let mut hi = max_n.max(1);
    if diff(hi)? >= 0.0 {
        return Ok(None);
    }
    let mut lo = hi;
    while lo > 1 {
        let next = lo / 2;
        if diff(next)? >= 0.0 {
            break;
        }
        lo = next;
    }
    if lo == 1 {
        return Ok(Some(1));
    }
    // Sparse loses at lo/2, wins at lo: bisect.
    let mut a = lo / 2;
    hi = lo;
    while hi - a > (hi / 100).max(1) {
        let mid = a + (hi - a) / 2;
        if diff(mid)? < 0.0 {
            hi = mid;
        } else {
            a = mid;
        }
    }
    Ok(Some(hi))
}

#[cfg(test)]
mod tests;
