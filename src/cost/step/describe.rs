//! The plan of one assignment, spelled out: every layer's option, its
//! marginal cost against the rest of the step and its cost alone, and
//! every group's bytes and seconds ([`StepPlan`]), as `gradsync plan`,
//! `predict_step` and `bench --op step` report them. The search for the
//! assignment is [`super::search`]'s; this file describes the one it found.

use super::groups::{dense_group, dense_wire, lowrank_group, sparse_group, sparse_wire};
use super::{
    alone, assigned_groups, auto_matrix, effective_local, marginal, GroupKind, GroupPlan,
    LayerKind, LayerPlan, Open, Option_, Sizes, StepLayer, StepPlan,
};
use crate::cost::query::StepQuery;
use crate::cost::topology::Net;
use crate::cost::{Profile, StrategyId};
use crate::sparse::FUSED_HEADER_LEN;

/// The plan of `layers` under the assignment `assign`: every layer's
/// costs, every group's, and the step's totals.
pub(super) fn describe(
    prof: &Profile,
    q: &StepQuery,
    layers: &[StepLayer],
    assign: &[Option_],
) -> StepPlan {
    let net = Net::of(prof, q);
    let p = q.at.p;
    let got = assigned_groups(assign);
    let open = Open {
        dense: Some(got.dense.unwrap_or(StrategyId::DenseRabenseifner)),
        sparse: Some(got.sparse.unwrap_or(StrategyId::SparseAllgather)),
        lowrank: got.lowrank,
    };
    let (algo, salgo) = (open.dense.expect("set"), open.sparse.expect("set"));
    let mut sizes = Sizes::default();
    for o in assign {
        sizes.add(o, 1.0);
    }
    let nsparse = assign
        .iter()
        .filter(|o| o.group == GroupKind::Sparse)
        .count();
    let mut out_layers = Vec::with_capacity(layers.len());
    let (mut dense, mut sparse) = empty_groups(algo, salgo);
    let mut lowrank = GroupPlan {
        kind: GroupKind::Lowrank,
        algorithm: StrategyId::Powersgd,
        ..dense.clone()
    };
    let mut gvq = Vec::new();
    for (l, o) in layers.iter().zip(assign) {
        let layer = layer_plan(prof, q, &net, open, sizes, nsparse, (l, o));
        let local_s = layer.local_s;
        out_layers.push(layer);
        let g = match o.group {
            GroupKind::Dense => &mut dense,
            GroupKind::Sparse => &mut sparse,
            GroupKind::Lowrank => {
                lowrank.message_bytes += o.bytes_q;
                &mut lowrank
            }
            GroupKind::Gradiveq => {
                gvq.push(gradiveq_group(&net, l, o));
                continue;
            }
        };
        g.layers += 1;
        g.elements += l.n;
        g.message_bytes += o.bytes;
        g.local_s += local_s;
    }
    if lowrank.layers > 0 {
        lowrank.comm_s = lowrank_group(&net, algo, sizes);
        lowrank.wire_bytes =
            dense_wire(&net, algo, sizes.lowrank_p) + dense_wire(&net, algo, sizes.lowrank_q);
    }
    let mut groups = step_groups(&net, dense, sparse, gvq, sizes);
    if lowrank.layers > 0 {
        groups.push(lowrank);
    }
    let seconds = groups.iter().map(|g| g.comm_s + g.local_s).sum();
    let wire_bytes = groups.iter().map(|g| g.wire_bytes).sum();
    StepPlan {
        ranks: p,
        density: q.density,
        layers: out_layers,
        groups,
        seconds,
        wire_bytes,
    }
}

/// The dense group of algorithm `algo` and the sparse group of collective
/// `salgo`, with no layers yet (the fused allgatherv's message starts
/// with its header).
fn empty_groups(algo: StrategyId, salgo: StrategyId) -> (GroupPlan, GroupPlan) {
    let dense = GroupPlan {
        kind: GroupKind::Dense,
        algorithm: algo,
        layers: 0,
        elements: 0,
        message_bytes: 0.0,
        wire_bytes: 0.0,
        comm_s: 0.0,
        local_s: 0.0,
    };
    let sparse = GroupPlan {
        kind: GroupKind::Sparse,
        algorithm: salgo,
        message_bytes: if salgo == StrategyId::SparseAllgather {
            FUSED_HEADER_LEN as f64
        } else {
            0.0
        },
        ..dense.clone()
    };
    (dense, sparse)
}

/// Layer `l`'s plan under its option `o`, in a step of groups `open` and
/// `sizes` (all layers' options added) with `nsparse` sparse layers.
fn layer_plan(
    prof: &Profile,
    q: &StepQuery,
    net: &Net,
    open: Open,
    sizes: Sizes,
    nsparse: usize,
    (l, o): (&StepLayer, &Option_),
) -> LayerPlan {
    // The layer's marginal cost against the rest of the step.
    let mut rest = sizes;
    rest.add(o, -1.0);
    let local_s = effective_local(prof, o, nsparse);
    let marginal_s = if l.n == 0 {
        // No elements: the layer adds nothing to the step (the
        // difference of two step totals could come out below zero).
        0.0
    } else if o.group == GroupKind::Gradiveq {
        o.local
    } else {
        marginal(net, open, rest, o) - effective_local(prof, o, 2) + local_s
    };
    let density = match l.kind {
        LayerKind::Fixed(_, d) => d,
        LayerKind::Auto => q.density,
    };
    // (A layer PowerSGD leaves dense is priced as the dense one it is.)
    let matrix = match l.kind {
        LayerKind::Auto => auto_matrix(l, q.powersgd_rank as f64),
        LayerKind::Fixed(..) => l.matrix,
    };
    let alone_s = alone(prof, q, (l.n, matrix), o.id, density).seconds;
    LayerPlan {
        name: l.name.clone(),
        elements: l.n,
        choice: o.id,
        group: o.group,
        auto: l.kind == LayerKind::Auto,
        message_bytes: o.bytes,
        local_s,
        marginal_s,
        alone_s,
    }
}

/// The group of GradiVeQ layer `l` (option `o`): its own ring.
fn gradiveq_group(net: &Net, l: &StepLayer, o: &Option_) -> GroupPlan {
    GroupPlan {
        kind: GroupKind::Gradiveq,
        algorithm: StrategyId::GradiveqRing,
        layers: 1,
        elements: l.n,
        message_bytes: o.bytes,
        wire_bytes: dense_wire(net, StrategyId::DenseRing, o.bytes),
        comm_s: 0.0,
        local_s: o.local,
    }
}

/// The step's groups in order (dense, sparse, then the GradiVeQ layers'
/// `gvq`), the dense and sparse ones priced and left out when empty.
fn step_groups(
    net: &Net,
    mut dense: GroupPlan,
    mut sparse: GroupPlan,
    gvq: Vec<GroupPlan>,
    sizes: Sizes,
) -> Vec<GroupPlan> {
    let (algo, salgo) = (dense.algorithm, sparse.algorithm);
    let mut groups = Vec::new();
    if dense.layers > 0 {
        dense.comm_s = dense_group(net, algo, dense.message_bytes);
        dense.wire_bytes = dense_wire(net, algo, dense.message_bytes);
        groups.push(dense);
    }
    if sparse.layers > 0 {
        sparse.comm_s = sparse_group(net, salgo, sizes);
        sparse.wire_bytes = sparse_wire(net, salgo, sizes);
        groups.push(sparse);
    }
    groups.extend(gvq);
    groups
}
