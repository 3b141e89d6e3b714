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
//!
//! ## Where things are
//!
//! This file holds the per-layer formulas above and [`predict`],
//! [`crossover`]; the [`Profile`] they read is in `profile.rs`, its fits
//! and curves in `curve.rs`; the whole step ([`plan_step`]) in `step/`,
//! the engine's per-step choices in `exchange.rs` and its decision table
//! in [`tuning`], the strategy ids and [`choose`] in `decide.rs`, and the
//! one comparison of prices in `argmin.rs`.

pub(crate) mod argmin;
mod bucket;
mod curve;
pub(crate) mod decide;
mod exchange;
mod layers_file;
mod profile;
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
pub use curve::{
    curve_at, curve_mean, curve_time_at, fit_relative_l1, fit_relative_l2, table_weight,
    CurvePoint, LinearFit, PowerSgdFit, PowerSgdPoint,
};
pub use decide::{choose, default_candidates, engine_candidates, parse_list, StrategyId};
pub use exchange::{
    choose_allgatherv, choose_dense_allreduce, choose_sparse_exchange, Choice, ExchangeQuery,
};
pub use profile::{
    Burst, CodecFit, NetLevel, Profile, ProfileMeta, SelectTable, PARALLEL_MIN_SPEEDUP,
    PROFILE_VERSION,
};
pub use query::{Placement, StepQuery, GRADIVEQ_RATIO};
pub use step::{
    plan_step, predict_step, sparse_collective, sparse_collective_by, GroupKind, GroupPlan,
    LayerKind, LayerPlan, StepLayer, StepPlan, MAX_RANKS,
};
pub use tuning::{layers_in_parallel, Decision, ExchangeLoad, LayerPolicy, Masks, Tuning};

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

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
