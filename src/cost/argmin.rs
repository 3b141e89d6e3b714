//! Where prices are compared: the near-tie rule that every choice of the
//! cost model applies (the exchange, the dense algorithm, the allgatherv,
//! the step plan's groups, the bucket size), and the pick among
//! candidates listed simplest first.

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
    let within = best + NEAR_TIE * best.abs();
    predictions
        .iter()
        .find(|c| c.1 <= within)
        .unwrap_or(&predictions[0])
        .0
}
