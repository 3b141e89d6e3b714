//! Where prices are compared, and nowhere else (`tests/layering.rs`
//! checks it): the least price ([`fastest`]), the one near-tie rule
//! ([`NEAR_TIE`], [`tie_limit`]) that every choice of the cost model
//! applies (the exchange, the dense algorithm, the allgatherv, the step
//! plan's groups, the bucket size), and the pick among candidates listed
//! simplest first ([`cheapest`]).

/// How close two predictions must be to count as a tie in
/// [`super::choose_sparse_exchange`], [`super::choose_dense_allreduce`], [`super::choose_allgatherv`], the step plan's groups and the bucket size:
/// 2 %, far inside the model's error (docs/benchmarks/cluster.md measures it at
/// ±20 %), so the choice between them is the model's noise.
pub const NEAR_TIE: f64 = 0.02;

/// The first of `predictions` (not empty) within [`NEAR_TIE`] of the
/// cheapest. The candidates are listed simplest first (the fused allgatherv
/// before the sparse allreduces, Rabenseifner before the ring and the
/// node-aware allreduce): where the model cannot tell two apart, the one
/// with fewer phases and less local work runs. (ResNet-50's exchange at
/// 2 × 2 and density 0.001 is priced 8.02 ms as the allgatherv and 7.96
/// as the node-aware allreduce; the node-aware step measured 8–15 % slower.)
pub(crate) fn cheapest<T: Copy>(predictions: &[(T, f64)]) -> T {
    let best = predictions
        .iter()
        .map(|c| c.1)
        .fold(f64::INFINITY, f64::min);
    let i = first_tied(predictions.iter().map(|c| c.1), best, best).unwrap_or(0);
    predictions[i].0
}

/// The first of `items` of least `price` (`None` when there is none).
pub(crate) fn fastest<T>(
    items: impl IntoIterator<Item = T>,
    price: impl Fn(&T) -> f64,
) -> Option<T> {
    // Each item priced once (`min_by` prices both sides of every
    // comparison: twice the step model's work per layer); the first of
    // equal prices kept, as `min_by` keeps it.
    let mut best: Option<(T, f64)> = None;
    for it in items {
        let p = price(&it);
        if best.as_ref().is_none_or(|(_, b)| p.total_cmp(b).is_lt()) {
            best = Some((it, p));
        }
    }
    best.map(|(it, _)| it)
}

/// The highest price that still ties with `best`: within [`NEAR_TIE`] of
/// `scale` (the cost the tie is relative to: `best` itself, or the group
/// whose collective is being chosen).
fn tie_limit(best: f64, scale: f64) -> f64 {
    best + NEAR_TIE * scale.abs()
}

/// The index of the first of `prices` that ties with `best` (within
/// [`NEAR_TIE`] of `scale`, as [`tie_limit`]); `None` when none does. A
/// candidate that may not be taken is priced `f64::INFINITY`.
pub(crate) fn first_tied(
    prices: impl IntoIterator<Item = f64>,
    best: f64,
    scale: f64,
) -> Option<usize> {
    let limit = tie_limit(best, scale);
    prices.into_iter().position(|p| p <= limit)
}

/// The index of the last of `prices` that ties with `best` (within
/// [`NEAR_TIE`] of `best`): where the candidates are listed from the most
/// to the fewest phases (the bucket caps, ascending).
pub(crate) fn last_tied(prices: &[f64], best: f64) -> Option<usize> {
    let limit = tie_limit(best, best);
    prices.iter().rposition(|&p| p <= limit)
}
