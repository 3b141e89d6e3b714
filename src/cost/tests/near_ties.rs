//! The near-tie rule (`NEAR_TIE`): within 2 % of a group's cost the simpler
//! candidate wins, in the step plan and in `argmin::cheapest`.

use super::*;

/// Within [`NEAR_TIE`] of the sparse group's cost the plan names the
/// simpler sparse exchange, as the engine's per-step choice
/// (`choose_sparse_exchange`) does; past it, the faster one. Every layer
/// is sparse here, so the step is the sparse group. The sparse allreduce's
/// cost grows with the fill ratio ρ, so scanning ρ walks its step time
/// through the allgatherv's.
#[test]
fn plan_step_breaks_near_ties_toward_the_simpler_exchange() {
    use StrategyId::*;
    let pr = prof();
    let layers = table(&[1 << 22, 1 << 20]);
    let (mut near, mut far) = (0, 0);
    for p in [8usize, 16, 64, 256] {
        for i in 1..=200 {
            let fill = i as f64 / 200.0;
            let q = |allowed: &[StrategyId]| StepQuery {
                at: crate::cost::Placement {
                    fill: Some(fill),
                    ..sq(p, allowed).at
                },
                density: 0.01,
                ..sq(p, allowed)
            };
            let step = |id| {
                predict_step(&pr, &q(&[id]), &layers, &[id, id])
                    .expect("predict")
                    .seconds
            };
            let (gather, reduce) = (step(SparseAllgather), step(SparseAllreduce));
            // Either order of the caller's list gives the same plan.
            for allowed in [
                [SparseAllgather, SparseAllreduce],
                [SparseAllreduce, SparseAllgather],
            ] {
                let plan = plan_step(&pr, &q(&allowed), &layers).expect("plan");
                let chose: Vec<StrategyId> = plan.layers.iter().map(|l| l.choice).collect();
                if reduce < gather && reduce * (1.0 + NEAR_TIE) > gather * 1.001 {
                    near += 1;
                    assert_eq!(chose, [SparseAllgather; 2], "p={p} ρ={fill}");
                } else if reduce * (1.0 + NEAR_TIE) < gather * 0.999 {
                    far += 1;
                    assert_eq!(chose, [SparseAllreduce; 2], "p={p} ρ={fill}");
                }
            }
        }
    }
    assert!(near > 0 && far > 0, "near-ties {near}, clear wins {far}");
}

/// The tie is 2 % of the group the choice is about, not of the step: a
/// large fixed dense layer beside a sparse one must not make a sparse
/// allreduce that is 5 % faster than the allgatherv (at group level) a
/// "tie" (2 % of the step was several times the sparse group's gap).
#[test]
fn a_large_dense_group_does_not_widen_the_sparse_tie() {
    use StrategyId::*;
    let pr = prof();
    let mut layers = table(&[1 << 22]);
    layers.push(StepLayer {
        name: "big-dense".into(),
        n: 1 << 26,
        kind: LayerKind::Fixed(DenseRabenseifner, 1.0),
        matrix: None,
    });
    let mut clear_wins = 0;
    for p in [16usize, 64, 256] {
        for i in 1..=100 {
            let fill = i as f64 / 100.0;
            let q = |allowed: &[StrategyId]| StepQuery {
                at: crate::cost::Placement {
                    fill: Some(fill),
                    ..sq(p, allowed).at
                },
                density: 0.01,
                ..sq(p, allowed)
            };
            let sparse_group = |id| {
                let st = predict_step(&pr, &q(&[id]), &layers, &[id, DenseRabenseifner])
                    .expect("predict");
                let g = st
                    .groups
                    .iter()
                    .find(|g| g.kind == GroupKind::Sparse)
                    .expect("a sparse group");
                (g.comm_s + g.local_s, st.seconds)
            };
            let ((gather, step), (reduce, reduce_step)) =
                (sparse_group(SparseAllgather), sparse_group(SparseAllreduce));
            let all_dense = predict_step(
                &pr,
                &q(&[DenseRabenseifner]),
                &layers,
                &[DenseRabenseifner, DenseRabenseifner],
            )
            .expect("predict")
            .seconds;
            // A clear win at group level, yet inside 2 % of the step (and
            // the layer is worth sending sparse at all).
            if reduce * 1.05 < gather
                && gather - reduce < NEAR_TIE * step
                && reduce_step < all_dense
            {
                clear_wins += 1;
                let plan = plan_step(
                    &pr,
                    &q(&[DenseRabenseifner, SparseAllgather, SparseAllreduce]),
                    &layers,
                )
                .expect("plan");
                assert_eq!(plan.layers[0].choice, SparseAllreduce, "p={p} ρ={fill}");
            }
        }
    }
    assert!(
        clear_wins > 0,
        "no case where the step's 2 % hid a group's win"
    );
}

#[test]
fn near_ties_go_to_the_first_candidate_and_real_gaps_to_the_cheapest() {
    use crate::cost::argmin::cheapest;
    use StrategyId::{SparseAllgather, SparseAllreduce, SparseHierarchical};
    // ResNet-50's exchange at 2 x 2, density 0.001 (us): a tie.
    let tie = [
        (SparseAllgather, 8022.0),
        (SparseAllreduce, 12548.2),
        (SparseHierarchical, 7964.3),
    ];
    assert_eq!(cheapest(&tie), SparseAllgather);
    // Just outside 2 %: the cheaper one.
    let gap = [(SparseAllgather, 0.1021), (SparseHierarchical, 0.1)];
    assert_eq!(cheapest(&gap), SparseHierarchical);
    // Just inside it.
    let inside = [(SparseAllgather, 0.1019), (SparseHierarchical, 0.1)];
    assert_eq!(cheapest(&inside), SparseAllgather);
    // The first of several near the minimum, not the minimum.
    let several = [
        (SparseAllgather, 0.2),
        (SparseAllreduce, 0.1005),
        (SparseHierarchical, 0.1),
    ];
    assert_eq!(cheapest(&several), SparseAllreduce);
    // Negative predictions (a hand-made profile): the same 2 % of |min|.
    assert_eq!(
        cheapest(&[(SparseAllgather, -0.99), (SparseAllreduce, -1.0)]),
        SparseAllgather
    );
    assert_eq!(
        cheapest(&[(SparseAllgather, -0.9), (SparseAllreduce, -1.0)]),
        SparseAllreduce
    );
    // All zero (one rank): the first.
    assert_eq!(
        cheapest(&[(SparseAllgather, 0.0), (SparseAllreduce, 0.0)]),
        SparseAllgather
    );
}
