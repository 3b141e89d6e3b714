//! `gradsync bench --op sparse-allreduce`: one layer's sparse contribution
//! (`--density` of `--bytes / 4` elements a rank, distinct random indices,
//! integer values) summed three ways in interleaved rounds: the sparse
//! allreduce ([`crate::sparse::allreduce`], default options), the fused
//! allgatherv of RedSync units `[len | indices | values]` followed by the
//! scatter-add of every rank's unit (today's sparse path), and
//! `MPI_Allreduce` of the dense layer (the baseline). The allgatherv is
//! `--allgather`'s; `auto` (the default) runs what the engine's `auto`
//! would: the model's choice of `recdbl` or `node` with `--profile` (so
//! the prediction prices the algorithm that ran), `recdbl` without. With
//! `--hierarchical` also the hierarchical sparse allreduce
//! ([`crate::sparse::hierarchical`], MPI's node map from
//! [`MpiComm::node_ids`]), as algo `hierarchical-sparse-allreduce`.
//! `--check` compares every result bitwise with `MPI_Allreduce`.

use super::bench::{
    any_rank, check_common, common_must_match, emit, flag_error, parse_sizes, time_interleaved,
    timed, BenchArgs, BenchRecord,
};
use crate::calibrate::median;
use crate::comm::agree::{agree, agree_inputs};
use crate::comm::{MpiComm, Transport};
use crate::cost::{self, Profile, StrategyId};
use crate::dense::{allgatherv_with, AllgathervAlgo, Gathered};
use crate::sparse::allreduce::{sparse_allreduce, SparseAllreduceOptions};
use crate::sparse::hierarchical::{hierarchical_sparse_allreduce_with, HierarchicalWorkspace};
use crate::strategy::Pick;
use crate::{Error, Result};
use rand::SeedableRng;

const ALGOS: [&str; 3] = [
    "sparse-allreduce",
    "fused-allgatherv",
    "hierarchical-sparse-allreduce",
];

type Inputs = (Vec<usize>, f64, Option<Profile>, Pick<AllgathervAlgo>);

fn inputs(a: &BenchArgs) -> Result<Inputs> {
    check_common(a)?;
    let profile = match &a.profile {
        Some(p) => Some(Profile::load(p).map_err(|e| flag_error("--profile", e))?),
        None => None,
    };
    let allgather: Pick<AllgathervAlgo> = a
        .allgather
        .parse()
        .map_err(|e| flag_error(format!("--allgather {:?}", a.allgather), e))?;
    Ok((
        parse_sizes("--bytes", a.bytes_or_default(), 4)?,
        a.density.unwrap_or(0.001),
        profile,
        allgather,
    ))
}

/// The model's time of `algo` (one of [`ALGOS`]) for `k` pairs of `n`,
/// the fused allgatherv by `gather`'s algorithm (`auto`: the model's
/// choice).
#[allow(clippy::too_many_arguments)]
fn predicted(
    path: &std::path::Path,
    prof: &Profile,
    algo: &str,
    n: usize,
    k: usize,
    p: usize,
    l: Option<usize>,
    gather: AllgathervAlgo,
) -> Result<f64> {
    let id = match algo {
        "sparse-allreduce" => StrategyId::SparseAllreduce,
        "fused-allgatherv" => StrategyId::SparseAllgather,
        _ => StrategyId::SparseHierarchical,
    };
    let t = cost::sparse_collective_by(prof, id, n, k, p, l, None, Some(Pick::Fixed(gather)))?;
    if !t.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "--profile {}: its constants price {algo} of {n} elements at {t} s (not a finite time)",
            path.display()
        )));
    }
    Ok(t)
}

/// Pairs each rank sends for a layer of `n` elements at `density`.
fn pairs_of(density: f64, n: usize) -> usize {
    ((density * n as f64).round() as usize).clamp(usize::from(n > 0), n)
}

/// Fused-allgatherv path: gather `[k u32 | idx | val]` units by `algo`,
/// scatter-add.
fn fused(
    comm: &MpiComm,
    algo: AllgathervAlgo,
    unit: &[u8],
    g: &mut Gathered,
    out: &mut [f32],
) -> Result<()> {
    allgatherv_with(comm, unit, algo, g)?;
    out.fill(0.0);
    for r in 0..g.len() {
        let m = g.message(r);
        let k = u32::from_le_bytes(m[..4].try_into().expect("4 bytes")) as usize;
        if m.len() != 4 + 8 * k {
            return Err(Error::Transport(format!(
                "unit of rank {r} has a bad length"
            )));
        }
        let (idx, val) = m[4..].split_at(4 * k);
        for (i, v) in idx.chunks_exact(4).zip(val.chunks_exact(4)) {
            let i = u32::from_le_bytes(i.try_into().expect("4 bytes")) as usize;
            out[i] += f32::from_le_bytes(v.try_into().expect("4 bytes"));
        }
    }
    Ok(())
}

pub(super) fn run(comm: &MpiComm, a: &BenchArgs) -> Result<i32> {
    let (sizes, density, profile, allgather) =
        agree_inputs(comm, inputs(a), |(sizes, density, prof, allgather)| {
            let mut m = common_must_match(a);
            m.push(("--allgather", allgather.to_string()));
            m.push(("--bytes", format!("{sizes:?}")));
            m.push(("--density", density.to_string()));
            m.push(("--hierarchical", a.hierarchical.to_string()));
            m.push((
                "--profile",
                prof.as_ref().map_or_else(String::new, |p| {
                    serde_json::to_string(p).unwrap_or_default()
                }),
            ));
            m
        })?;
    let (rank, p) = (comm.rank(), comm.size());
    let opts = SparseAllreduceOptions::default();
    // MPI's node map (collective the first time: every rank asks, or none).
    let nodes = if a.hierarchical || profile.is_some() {
        comm.node_ids()
    } else {
        Vec::new()
    };
    let per_node = crate::comm::ranks_per_node(&nodes);
    let algos = &ALGOS[..if a.hierarchical { 3 } else { 2 }];
    // `--allgather auto` (the default): what the engine's `auto` runs,
    // the model's choice for each size's unit with `--profile` (the
    // algorithm its prediction then prices), recursive doubling without.
    let gathers = sizes
        .iter()
        .map(|&bytes| match (allgather, &profile) {
            (Pick::Auto, Some(prof)) => {
                let k = pairs_of(density, bytes / 4);
                Ok(cost::choose_allgatherv(
                    prof,
                    (4 + 8 * k) as f64,
                    &cost::Placement::on(p, per_node),
                )?
                .pick)
            }
            (Pick::Auto, None) => Ok(AllgathervAlgo::RecursiveDoubling),
            (Pick::Fixed(a), _) => Ok(a),
        })
        .collect::<Result<Vec<_>>>();
    let gathers = agree(comm, gathers)?;
    // Priced before anything is measured: a profile that cannot price
    // this run fails it at once, on every rank alike.
    let preds = sizes
        .iter()
        .zip(&gathers)
        .map(|(&bytes, &gather)| {
            let n = bytes / 4;
            algos
                .iter()
                .map(|name| {
                    profile
                        .as_ref()
                        .map(|prof| {
                            let path = a.profile.as_deref().unwrap_or(std::path::Path::new(""));
                            predicted(
                                path,
                                prof,
                                name,
                                n,
                                pairs_of(density, n),
                                p,
                                per_node,
                                gather,
                            )
                        })
                        .transpose()
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>();
    let preds = agree(comm, preds)?;
    let mut failed = false;
    let mut first = true;
    for (si, &bytes) in sizes.iter().enumerate() {
        let n = bytes / 4;
        let k = pairs_of(density, n);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(rank as u64 + 1);
        let mut idx: Vec<u32> = rand::seq::index::sample(&mut rng, n, k)
            .into_iter()
            .map(|i| i as u32)
            .collect();
        idx.sort_unstable();
        let val: Vec<f32> = idx
            .iter()
            .map(|&i| ((i as usize * 31 + rank * 17) % 64) as f32 - 32.0)
            .collect();
        let mut dense = vec![0f32; n];
        for (&i, &v) in idx.iter().zip(&val) {
            dense[i as usize] = v;
        }
        let gather = gathers[si];
        if rank == 0 && allgather.is_auto() && profile.is_some() {
            errln!(
                "gradsync bench: {bytes} bytes: fused-allgatherv runs the {} allgatherv (--allgather auto: the model's choice)",
                gather.name()
            );
        }
        let mut unit = Vec::with_capacity(4 + 8 * k);
        unit.extend_from_slice(&(k as u32).to_le_bytes());
        idx.iter()
            .for_each(|i| unit.extend_from_slice(&i.to_le_bytes()));
        val.iter()
            .for_each(|v| unit.extend_from_slice(&v.to_le_bytes()));
        let mut reference = vec![0f32; n];
        let mut out = vec![0f32; n];
        let mut g = Gathered::default();
        // The node-aware path keeps its buffers across calls, as the engine does.
        let mut hws = HierarchicalWorkspace::default();
        let mpi = |dense: &[f32], reference: &mut [f32]| {
            comm.native_allreduce_sum(dense, reference)
                .ok_or_else(|| Error::Unsupported("no MPI allreduce".into()))?
        };
        mpi(&dense, &mut reference)?;
        let mut checks = Vec::new();
        for k in 0..algos.len() {
            checks.push(if a.check {
                match k {
                    0 => sparse_allreduce(comm, n, &idx, &val, &mut out, &opts).map(|_| ())?,
                    1 => fused(comm, gather, &unit, &mut g, &mut out)?,
                    _ => hierarchical_sparse_allreduce_with(
                        comm, n, &nodes, &idx, &val, &mut out, &opts, &mut hws,
                    )
                    .map(|_| ())?,
                }
                let bad = out
                    .iter()
                    .zip(&reference)
                    .any(|(x, y)| x.to_bits() != y.to_bits());
                if any_rank(comm, bad) {
                    failed = true;
                    "failed"
                } else {
                    "ok"
                }
            } else {
                "skipped"
            });
        }
        let mut ref2 = vec![0f32; n];
        let times = time_interleaved(comm, a.iters, a.warmup, algos.len() + 1, |op| match op {
            0 => timed(comm, || mpi(&dense, &mut ref2)),
            1 => timed(comm, || {
                sparse_allreduce(comm, n, &idx, &val, &mut out, &opts).map(|_| ())
            }),
            2 => timed(comm, || fused(comm, gather, &unit, &mut g, &mut out)),
            _ => timed(comm, || {
                hierarchical_sparse_allreduce_with(
                    comm, n, &nodes, &idx, &val, &mut out, &opts, &mut hws,
                )
                .map(|_| ())
            }),
        })?;
        let mpi_med = median(&mut times[0].clone());
        for (j, name) in algos.iter().enumerate() {
            let med = median(&mut times[j + 1].clone());
            let min = times[j + 1].iter().copied().fold(f64::INFINITY, f64::min);
            let rec = BenchRecord {
                op: "sparse-allreduce".into(),
                algo: (*name).into(),
                ranks: p,
                bytes,
                iters: a.iters,
                median_s: med,
                min_s: min,
                mpi_median_s: mpi_med,
                ratio_vs_mpi: med / mpi_med,
                busbw_gbs: if med > 0.0 {
                    2.0 * (p as f64 - 1.0) / p as f64 * bytes as f64 / med / 1e9
                } else {
                    0.0
                },
                check: checks[j].into(),
                chunk_elems: 0,
                predicted_s: preds[si][j],
            };
            emit(comm, a, &rec, first)?;
            first = false;
        }
    }
    Ok(i32::from(failed))
}
