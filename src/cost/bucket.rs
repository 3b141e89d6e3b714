//! The overlap model: a step cut into buckets, priced against the backward
//! pass that produces its gradients, and the bucket size that minimizes it
//! (DDP's `bucket_cap_mb`, Horovod's fusion threshold, chosen by the model
//! where the user gives none).
//!
//! Backward produces the gradients in reverse registration order; the
//! model takes layer `i`'s gradient ready at
//! `t_i = T_bwd · (Σ_{j ≥ i} n_j) / Σ_j n_j` (backward time proportional
//! to the parameters behind it, the usual assumption of Horovod's and
//! ByteScheduler's analyses). The table is cut as the bindings cut it
//! ([`cut_buckets`]: reverse registration order, each bucket up to the cap,
//! a larger layer alone); a bucket is ready with its last gradient, except
//! the last bucket (the first layers), which the step itself submits after
//! backward. The engine runs the buckets one after the other
//! (`sync/bucket.rs`: one progress thread, jobs in order), each priced as a
//! step of its own layers ([`super::predict_step`]: its local phase, its
//! collectives with their α, its unpacking), so
//!
//! `start_b = max(ready_b, end_{b−1})`, `end_b = start_b + T(bucket b)`,
//!
//! and the step ends at `end_last` (≥ `T_bwd`); the whole step submitted
//! after backward ends at `T_bwd + T(table)`. More buckets start earlier
//! but pay more α; [`choose_bucket_cap`] takes the cap of least `end_last`
//! among [`CAPS_MB`] and the whole table, the larger cap on a near tie.
//! The model charges the buckets' compression to the pipeline, not to
//! backward (on a core shared with backward it delays both).

use super::argmin;
use super::query::StepQuery;
use super::step::{predict_step, LayerKind, StepLayer};
use super::{Profile, StrategyId};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// The cap of a step in buckets before the model can price one: the
/// first step's, when none is given (DDP's default, 25 MiB), after which
/// the bindings ask [`choose_bucket_cap`] for the backward pass measured.
pub const FIRST_STEP_CAP_BYTES: usize = 25 << 20;

/// The caps [`choose_bucket_cap`] tries, in MiB (and the whole table).
pub const CAPS_MB: [f64; 11] = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 32.0, 64.0, 128.0];

/// One bucket of a priced step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketTiming {
    /// Its layers (indices into the table), in submission order.
    pub layers: Vec<usize>,
    /// Their f32 elements.
    pub elements: usize,
    /// When its last gradient is ready (seconds from the start of backward).
    pub ready_s: f64,
    /// When the engine starts it.
    pub start_s: f64,
    /// When it is done.
    pub end_s: f64,
    /// Its own step time ([`super::predict_step`] of its layers).
    pub seconds: f64,
}

/// A step in buckets against backward. See the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketPlan {
    /// The cap in bytes; `None`: the whole table as one bucket.
    pub cap_bytes: Option<usize>,
    /// The backward pass's seconds the plan is priced against.
    pub backward_s: f64,
    /// The buckets, in submission order.
    pub buckets: Vec<BucketTiming>,
    /// From the start of backward to the step's end.
    pub step_s: f64,
    /// The step's communication not hidden by backward (`step_s − backward_s`).
    pub exposed_s: f64,
    /// The whole step submitted after backward (`backward_s + T(table)`).
    pub whole_s: f64,
    /// `(cap_bytes, step_s)` of every cap tried, when chosen.
    pub tried: Vec<(Option<usize>, f64)>,
}

/// The table's layers cut into buckets as the bindings cut them: reverse
/// registration order, each bucket up to `cap_bytes` of f32 gradients (a
/// larger layer alone).
///
/// ```
/// use gradsync::cost::cut_buckets;
/// assert_eq!(cut_buckets(&[10, 10, 10], 80), vec![vec![2, 1], vec![0]]);
/// ```
pub fn cut_buckets(elements: &[usize], cap_bytes: usize) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut size = 0usize;
    for i in (0..elements.len()).rev() {
        let bytes = 4 * elements[i];
        if !cur.is_empty() && size + bytes > cap_bytes {
            buckets.push(std::mem::take(&mut cur));
            size = 0;
        }
        cur.push(i);
        size += bytes;
    }
    if !cur.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Price the step of `layers` (every one [`LayerKind::Fixed`]: the
/// engine's resolved strategies) cut at `cap_bytes` (`None`: whole)
/// against a backward pass of `backward_s` seconds.
pub fn price_buckets(
    prof: &Profile,
    q: &StepQuery,
    layers: &[StepLayer],
    backward_s: f64,
    cap_bytes: Option<usize>,
) -> Result<BucketPlan> {
    if !(backward_s >= 0.0 && backward_s.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "backward time {backward_s} s must be a finite number ≥ 0"
        )));
    }
    if let Some(l) = layers.iter().find(|l| l.kind == LayerKind::Auto) {
        return Err(Error::InvalidArgument(format!(
            "layer {:?} has no strategy yet: price buckets of a resolved table",
            l.name
        )));
    }
    let whole = step_seconds(prof, q, layers)?;
    let elements: Vec<usize> = layers.iter().map(|l| l.n).collect();
    let total: f64 = elements.iter().map(|&n| n as f64).sum();
    let cut = match cap_bytes {
        Some(cap) => cut_buckets(&elements, cap),
        None => vec![(0..layers.len()).rev().collect()],
    };
    let mut buckets = Vec::with_capacity(cut.len());
    let mut end = 0.0f64;
    // Elements whose gradients are ready (from the last layer back).
    let mut behind = 0.0f64;
    for (b, ids) in cut.iter().enumerate() {
        behind += ids.iter().map(|&i| elements[i] as f64).sum::<f64>();
        let ready = if b + 1 == cut.len() || total == 0.0 {
            backward_s
        } else {
            backward_s * behind / total
        };
        let part: Vec<StepLayer> = ids.iter().map(|&i| layers[i].clone()).collect();
        let seconds = step_seconds(prof, q, &part)?;
        let start = ready.max(end);
        end = start + seconds;
        buckets.push(BucketTiming {
            layers: ids.clone(),
            elements: ids.iter().map(|&i| elements[i]).sum(),
            ready_s: ready,
            start_s: start,
            end_s: end,
            seconds,
        });
    }
    let step_s = end.max(backward_s);
    Ok(BucketPlan {
        cap_bytes,
        backward_s,
        buckets,
        step_s,
        exposed_s: step_s - backward_s,
        whole_s: backward_s + whole,
        tried: Vec::new(),
    })
}

/// The cap of least step time among [`CAPS_MB`] and the whole table (the
/// larger on a near tie: fewer buckets, fewer α), priced by
/// [`price_buckets`]; `tried` lists every candidate.
pub fn choose_bucket_cap(
    prof: &Profile,
    q: &StepQuery,
    layers: &[StepLayer],
    backward_s: f64,
) -> Result<BucketPlan> {
    let mut caps: Vec<Option<usize>> = CAPS_MB
        .iter()
        .map(|mb| Some((mb * (1 << 20) as f64) as usize))
        .collect();
    caps.push(None);
    let mut plans = caps
        .into_iter()
        .map(|c| price_buckets(prof, q, layers, backward_s, c))
        .collect::<Result<Vec<_>>>()?;
    let tried: Vec<(Option<usize>, f64)> = plans.iter().map(|p| (p.cap_bytes, p.step_s)).collect();
    let prices: Vec<f64> = plans.iter().map(|p| p.step_s).collect();
    let best = argmin::fastest(prices.iter().copied(), |&s| s).unwrap_or(0.0);
    // Largest cap within the tie of the best (the list is ascending, the
    // whole table last).
    let pick = argmin::last_tied(&prices, best).unwrap_or(0);
    let mut plan = plans.swap_remove(pick);
    plan.tried = tried;
    Ok(plan)
}

fn step_seconds(prof: &Profile, q: &StepQuery, layers: &[StepLayer]) -> Result<f64> {
    if layers.is_empty() {
        return Ok(0.0);
    }
    let choice = vec![StrategyId::DenseRabenseifner; layers.len()];
    Ok(predict_step(prof, q, layers, &choice)?.seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(p: usize) -> StepQuery {
        StepQuery {
            at: crate::cost::Placement {
                p,
                ranks_per_node: None,
                fill: None,
                allgather: crate::strategy::Pick::Fixed(
                    crate::dense::AllgathervAlgo::RecursiveDoubling,
                ),
            },
            density: 0.01,
            select_method: "trimmed".into(),
            gradiveq_ratio: crate::cost::GRADIVEQ_RATIO,
            allowed: Vec::new(),
            min_sparse_elems: 0,
            powersgd_rank: 1,
        }
    }

    fn dense_table(sizes: &[usize]) -> Vec<StepLayer> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| StepLayer {
                name: format!("l{i}"),
                n,
                kind: LayerKind::Fixed(StrategyId::DenseRabenseifner, 1.0),
                matrix: None,
            })
            .collect()
    }

    #[test]
    fn cuts_in_backward_order_up_to_the_cap() {
        assert_eq!(
            cut_buckets(&[1, 2, 3, 100], 16),
            vec![vec![3], vec![2], vec![1, 0]]
        );
        assert_eq!(cut_buckets(&[], 16), Vec::<Vec<usize>>::new());
        assert_eq!(cut_buckets(&[5, 5], usize::MAX), vec![vec![1, 0]]);
    }

    #[test]
    fn buckets_hide_communication_behind_backward() {
        // 1 Gbit/s-like link, 20 layers of 1 M elements (80 MB of
        // gradients), a backward pass about as long as the dense step.
        let prof = Profile::from_network(50e-6, 125e6, 0.0, 0.0).unwrap();
        let layers = dense_table(&[1 << 20; 20]);
        let q = query(4);
        let whole = price_buckets(&prof, &q, &layers, 0.0, None).unwrap();
        let bwd = whole.whole_s;
        let plan = choose_bucket_cap(&prof, &q, &layers, bwd).unwrap();
        let one = price_buckets(&prof, &q, &layers, bwd, None).unwrap();
        assert_eq!(one.buckets.len(), 1);
        assert!((one.step_s - 2.0 * bwd).abs() < 1e-9 * bwd, "{one:?}");
        // Overlap hides most of it: well under the whole step's 2·T_bwd.
        assert!(plan.step_s < 0.75 * one.step_s, "{plan:?}");
        assert!(plan.cap_bytes.is_some() && plan.buckets.len() > 1);
        assert_eq!(plan.tried.len(), CAPS_MB.len() + 1);
        // The buckets run one after another, none before it is ready.
        for w in plan.buckets.windows(2) {
            assert!(w[1].start_s >= w[0].end_s && w[1].start_s >= w[1].ready_s);
        }
        assert!(plan.buckets.last().unwrap().ready_s == bwd);
    }

    #[test]
    fn latency_makes_small_buckets_lose() {
        // A huge α and a short backward: one bucket (the whole table).
        let prof = Profile::from_network(0.05, 10e9, 0.0, 0.0).unwrap();
        let layers = dense_table(&[1000; 50]);
        let plan = choose_bucket_cap(&prof, &query(8), &layers, 1e-4).unwrap();
        assert_eq!(plan.buckets.len(), 1, "{plan:?}");
    }

    #[test]
    fn refuses_unresolved_layers_and_bad_times() {
        let prof = Profile::from_network(1e-5, 1e9, 0.0, 0.0).unwrap();
        let mut layers = dense_table(&[10, 10]);
        assert!(price_buckets(&prof, &query(2), &layers, -1.0, None).is_err());
        assert!(price_buckets(&prof, &query(2), &layers, f64::NAN, None).is_err());
        layers[1].kind = LayerKind::Auto;
        let e = price_buckets(&prof, &query(2), &layers, 0.1, None).unwrap_err();
        assert!(e.to_string().contains("l1"), "{e}");
    }
}
