//! The search of [`super::plan_step`]: the configurations of open groups
//! it tries (simplest first), every auto layer's options in each, the
//! Gauss–Seidel descent that assigns each layer its least marginal cost,
//! and the pick among near-tied configurations (the simplest within
//! [`NEAR_TIE`](crate::cost::NEAR_TIE)). What each option and group costs
//! is [`super`]'s and [`super::groups`]'; this file only searches.

use super::groups::{dense_group, sparse_group};
use super::{
    assigned_groups, auto_matrix, effective_local, fits, marginal_from, option, powersgd_factors,
    total_seconds, Before, GroupKind, LayerKind, Open, Option_, Sizes, StepLayer,
};
use crate::cost::argmin;
use crate::cost::query::StepQuery;
use crate::cost::topology::Net;
use crate::cost::{Profile, StrategyId};

/// The configurations of open groups [`super::plan_step`] tries, simplest first:
/// every dense algorithm (or none) with every sparse collective (or none)
/// among `cands`, only those the `fixed` layers force where they force one.
pub(super) fn configurations(cands: &[StrategyId], fixed: &[Option<Option_>]) -> Vec<Open> {
    // The dense algorithm a fixed dense layer forces (the engine fuses all
    // dense layers into one allreduce), likewise the sparse collective.
    let forced_dense = fixed.iter().flatten().find_map(|o| match o.group {
        GroupKind::Dense => Some(o.id),
        _ => None,
    });
    let forced_sparse = fixed.iter().flatten().find_map(|o| o.id.sparse_group());
    let mut dense_algos: Vec<StrategyId> = match forced_dense {
        Some(a) => vec![a],
        None => cands.iter().copied().filter(|c| c.is_dense()).collect(),
    };
    let mut sparse_algos: Vec<StrategyId> = match forced_sparse {
        Some(a) => vec![a],
        None => cands.iter().filter_map(|c| c.sparse_group()).collect(),
    };
    // The simplest first, whatever order the caller listed them in: a
    // near-tie goes to the first ([`near_tie_pick`]).
    let rank = |id: &StrategyId| StrategyId::ALL.iter().position(|a| a == id);
    dense_algos.sort_by_key(rank);
    dense_algos.dedup();
    sparse_algos.sort_by_key(rank);
    sparse_algos.dedup();
    // The PowerSGD group: forced open by a fixed PowerSGD layer, tried
    // closed then open when it is a candidate.
    let forced_lowrank = fixed
        .iter()
        .flatten()
        .any(|o| o.group == GroupKind::Lowrank);
    let lowrank_opts: &[bool] = if forced_lowrank {
        &[true]
    } else if cands.contains(&StrategyId::Powersgd) {
        &[false, true]
    } else {
        &[false]
    };
    let mut configs = Vec::new();
    let dense_opts: Vec<Option<StrategyId>> = if forced_dense.is_some() {
        dense_algos.iter().map(|a| Some(*a)).collect()
    } else {
        // Dense configurations first: on a tie (p = 1) the plan keeps
        // dense, as `choose` does (dense strategies come first).
        dense_algos
            .iter()
            .map(|a| Some(*a))
            .chain(std::iter::once(None))
            .collect()
    };
    let sparse_opts: Vec<Option<StrategyId>> = if forced_sparse.is_some() {
        sparse_algos.iter().map(|a| Some(*a)).collect()
    } else {
        std::iter::once(None)
            .chain(sparse_algos.iter().map(|a| Some(*a)))
            .collect()
    };
    for &lowrank in lowrank_opts {
        for d in &dense_opts {
            for s in &sparse_opts {
                configs.push(Open {
                    dense: *d,
                    sparse: *s,
                    lowrank,
                });
            }
        }
    }
    configs
}

/// The `all` and `start` of [`Rows`]: the options of every `Auto` layer.
pub(super) fn auto_options(
    prof: &Profile,
    q: &StepQuery,
    layers: &[StepLayer],
    table: f64,
    cands: &[StrategyId],
) -> (Vec<Option_>, Vec<usize>) {
    // Every candidate's option for every `Auto` layer, priced once for
    // all configurations (row `i`, `all[start[i]..start[i + 1]]`, is layer
    // `i`'s; a fixed layer's is empty): a table of 10^6 layers priced them
    // once per configuration.
    let mut all: Vec<Option_> = Vec::new();
    let mut start: Vec<usize> = Vec::with_capacity(layers.len() + 1);
    start.push(0);
    for l in layers {
        if l.kind == LayerKind::Auto {
            all.extend(
                cands
                    .iter()
                    .filter(|&&c| {
                        c != StrategyId::Powersgd
                            || powersgd_factors(l.matrix, q.powersgd_rank as f64).is_some()
                    })
                    .map(|&c| {
                        let param = if c == StrategyId::Powersgd {
                            q.powersgd_rank as f64
                        } else {
                            q.density
                        };
                        let matrix = auto_matrix(l, q.powersgd_rank as f64);
                        option(prof, q, (l.n, table, matrix), c, param)
                    })
                    // The threshold is sparsification's; PowerSGD
                    // compresses every matrix it shrinks (StepQuery).
                    .filter(|o| {
                        l.n >= q.min_sparse_elems
                            || matches!(o.group, GroupKind::Dense | GroupKind::Lowrank)
                    }),
            );
        }
        start.push(all.len());
    }
    (all, start)
}

/// Tables of at least this many layers plan their configurations in
/// parallel (below it the threads cost more than they save).
pub(super) const PARALLEL_LAYERS: usize = 4096;

/// Every `Auto` layer's options, priced once: layer `i`'s are
/// `all[start[i]..start[i + 1]]` (a fixed layer's are none).
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub(super) all: &'a [Option_],
    pub(super) start: &'a [usize],
}

impl Rows<'_> {
    fn row(&self, i: usize) -> &[Option_] {
        &self.all[self.start[i]..self.start[i + 1]]
    }

    /// A plan's options from its picks (an `Auto` layer's index in its
    /// row; a fixed layer's own option): plans keep a byte a layer, not
    /// the options (a table of 10^6 layers kept 48 MB per configuration).
    pub(super) fn expand(&self, fixed: &[Option<Option_>], picks: &[u8]) -> Vec<Option_> {
        fixed
            .iter()
            .zip(picks)
            .enumerate()
            .map(|(i, (f, &k))| f.unwrap_or_else(|| self.row(i)[usize::from(k)]))
            .collect()
    }
}

/// One configuration's plan (`open`: the groups' collectives): every
/// `Auto` layer's fastest option given the others, by coordinate descent
/// from the fixed layers, and the step's total; `None` when some layer has
/// no option that fits `open`. The plan's options as picks
/// ([`Rows::expand`]).
pub(super) fn descend(
    net: &Net,
    open: Open,
    layers: &[StepLayer],
    fixed: &[Option<Option_>],
    rows: Rows<'_>,
) -> Option<(Open, f64, Vec<u8>)> {
    let usable = |o: &&Option_| fits(open, o);
    if layers
        .iter()
        .enumerate()
        .any(|(i, l)| l.kind == LayerKind::Auto && !rows.row(i).iter().any(|o| usable(&o)))
    {
        return None;
    }
    let mut sizes = Sizes::default();
    let mut assign: Vec<Option<Option_>> = fixed.to_vec();
    let mut picks: Vec<u8> = vec![0; layers.len()];
    for o in assign.iter().flatten() {
        sizes.add(o, 1.0);
    }
    // At most 3 passes; a pass that changes no layer's pick leaves every
    // later pass the same state, so it ends.
    for _pass in 0..3 {
        let mut changed = false;
        for (i, l) in layers.iter().enumerate() {
            if l.kind != LayerKind::Auto {
                continue;
            }
            if let Some(o) = &assign[i] {
                sizes.add(o, -1.0);
            }
            let before = Before::of(net, open, sizes);
            let row = rows.row(i);
            let k = argmin::fastest((0..row.len()).filter(|&k| usable(&&row[k])), |&k| {
                marginal_from(net, open, sizes, before, &row[k])
            })
            .expect("options checked non-empty");
            let pick = row[k];
            sizes.add(&pick, 1.0);
            changed |= assign[i].map(|o| o.id) != Some(pick.id);
            assign[i] = Some(pick);
            picks[i] = k as u8;
        }
        if !changed {
            break;
        }
    }
    let assign: Vec<Option_> = assign.into_iter().flatten().collect();
    let total = total_seconds(net, open, &assign);
    Some((open, total, picks))
}

/// Which of `plans` (every configuration's, simplest first) the step takes:
/// the fastest's split of layers into groups, and within it each group's
/// collective as the engine picks it every step (`choose_dense_allreduce`,
/// `choose_sparse_exchange`): the first configuration whose step comes
/// within [`NEAR_TIE`](super::NEAR_TIE) of that group's cost of the
/// fastest, the dense algorithm first, then the sparse collective beside
/// it. A tie is 2 % of the group the choice is about, not of the step.
pub(super) fn near_tie_pick(
    net: &Net,
    plans: &[(Open, f64, Vec<u8>)],
    expand: &dyn Fn(&[u8]) -> Vec<Option_>,
) -> Option<usize> {
    let fastest = |ok: &dyn Fn(&Open) -> bool| {
        argmin::fastest((0..plans.len()).filter(|&i| ok(&plans[i].0)), |&i| {
            plans[i].1
        })
    };
    let within = |ok: &dyn Fn(&Open) -> bool, base: usize, group: f64| {
        let prices = plans
            .iter()
            .map(|p| if ok(&p.0) { p.1 } else { f64::INFINITY });
        argmin::first_tied(prices, plans[base].1, group).unwrap_or(base)
    };
    let mut pick = fastest(&|_| true)?;
    let best = plans[pick].0;
    if best.dense.is_some() {
        let (dense, _) = group_costs(net, best, &expand(&plans[pick].2));
        let same =
            |o: &Open| o.sparse == best.sparse && o.lowrank == best.lowrank && o.dense.is_some();
        pick = within(&same, pick, dense);
    }
    let chosen = plans[pick].0;
    if chosen.sparse.is_some() {
        let same =
            |o: &Open| o.dense == chosen.dense && o.lowrank == chosen.lowrank && o.sparse.is_some();
        let base = fastest(&same).unwrap_or(pick);
        let (_, sparse) = group_costs(net, plans[base].0, &expand(&plans[base].2));
        pick = within(&same, base, sparse);
    }
    Some(pick)
}

/// An assignment's dense and sparse groups' seconds: each collective and
/// its layers' local work ([`total_seconds`] split by group).
pub(super) fn group_costs(net: &Net, open: Open, assign: &[Option_]) -> (f64, f64) {
    let mut s = Sizes::default();
    let nsparse = assign
        .iter()
        .filter(|o| o.group == GroupKind::Sparse)
        .count();
    let (mut dense, mut sparse) = (0.0, 0.0);
    for o in assign {
        s.add(o, 1.0);
        match o.group {
            GroupKind::Dense => dense += effective_local(net.prof, o, nsparse),
            GroupKind::Sparse => sparse += effective_local(net.prof, o, nsparse),
            GroupKind::Gradiveq | GroupKind::Lowrank => {}
        }
    }
    let got = assigned_groups(assign);
    let d = open
        .dense
        .or(got.dense)
        .unwrap_or(StrategyId::DenseRabenseifner);
    let sp = open
        .sparse
        .or(got.sparse)
        .unwrap_or(StrategyId::SparseAllgather);
    (
        dense + dense_group(net, d, s.dense),
        sparse + sparse_group(net, sp, s),
    )
}
