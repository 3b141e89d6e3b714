//! Cost-model tests: per-layer predictions, profiles and curves, the step
//! model, the near-tie rule and the per-step sparse exchange choice.

mod exchange;
mod near_ties;
mod powersgd;
mod predictions;
mod profiles;
mod step_plan;

use super::*;

use crate::strategy::Pick;

pub(super) fn prof() -> Profile {
    let mut p = Profile::from_network(3e-6, 2.5e9, 1.5e-10, 7e-10).expect("profile");
    p.select
        .insert("trimmed".into(), LinearFit { a: 2e-5, b: 1.3e-9 });
    p.select
        .insert("quant".into(), LinearFit { a: 4e-5, b: 5e-9 });
    p
}

pub(super) fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}

pub(super) fn curve(points: &[(f64, f64)]) -> Vec<CurvePoint> {
    points
        .iter()
        .map(|&(bytes, per_byte)| CurvePoint { bytes, per_byte })
        .collect()
}

// ---- the step model (step/) ----

pub(super) fn table(ns: &[usize]) -> Vec<StepLayer> {
    ns.iter()
        .enumerate()
        .map(|(i, &n)| StepLayer {
            name: format!("l{i}"),
            n,
            kind: LayerKind::Auto,
            matrix: None,
        })
        .collect()
}

pub(super) fn sq(p: usize, allowed: &[StrategyId]) -> StepQuery {
    StepQuery {
        at: crate::cost::Placement {
            p,
            ranks_per_node: None,
            fill: None,
            allgather: Pick::Auto,
        },
        density: 0.001,
        select_method: "trimmed".into(),
        gradiveq_ratio: 8.0,
        min_sparse_elems: 0,
        allowed: allowed.to_vec(),
        powersgd_rank: 1,
    }
}
