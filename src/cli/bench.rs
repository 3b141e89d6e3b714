//! `gradsync bench`: OSU-style timing of gradsync's collectives against the MPI
//! library's own, in the same run, iterations interleaved so that drift hits
//! both alike. Each iteration starts after a barrier; its time is the slowest
//! rank's; medians and minima are over `--iters` iterations after `--warmup`.

use super::{max_over_ranks, parse_list, parse_size};
use crate::calibrate::median;
use crate::comm::agree::{agree_inputs, MustMatch};
use crate::comm::{MpiComm, Transport};
use crate::dense::{
    allgatherv_with, allreduce_with, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Gathered,
    Workspace,
};
use crate::{Error, Result};
use serde::Serialize;

/// Arguments of `gradsync bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Collective: allreduce (f32 sum, in place), allgatherv (bytes per
    /// rank), sparse (the engine's sparse synchronization vs dense
    /// MPI_Allreduce), sparse-allreduce (one layer's pairs: the Ok-Topk
    /// sparse allreduce vs the fused allgatherv of units and MPI_Allreduce
    /// of the dense layer; --bytes, --density), gradiveq (compressed-domain
    /// ring vs ring and QSGD ring) or step (the engine on a whole layer table vs the step model
    /// and MPI_Allreduce).
    #[arg(long, default_value = "allreduce")]
    pub op: String,
    /// Algorithm: allreduce: rabenseifner|ring|mpi|hierarchical|all; allgatherv:
    /// recdbl|mpi|node|all.
    #[arg(long, default_value = "all")]
    pub algo: String,
    /// Message sizes in bytes, K/M/G = powers of 1024 (allgatherv: per rank).
    #[arg(long, default_value = "4K,64K,1M,16M")]
    pub sizes: String,
    /// Timed iterations per size and algorithm.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Untimed warm-up iterations.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Verify each algorithm's result against the MPI library's own collective.
    #[arg(long)]
    pub check: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Ring pipelining chunk in elements (0 = unpipelined).
    #[arg(long, default_value_t = 0)]
    pub chunk: usize,
    /// Skip the per-call length validation (one 16-byte collective).
    #[arg(long)]
    pub no_validate: bool,
    /// `--op sparse`: codec of every layer (`rgc`, `rgc-quant`, `3lc`, `sbc`,
    /// `fastsgd`, ... with optional `:key=value` parameters), or `dense` for
    /// the engine's fused Rabenseifner path.
    #[arg(long, default_value = "rgc")]
    pub codec: String,
    /// `--op sparse`, `sparse-allreduce`, `gradiveq` (with `--data
    /// lowrank`): bytes of each layer (a list runs one record per size)
    /// [default: 16M].
    #[arg(long)]
    pub bytes: Option<String>,
    /// `--op sparse`: fraction of elements sent, in (0, 1], for codecs with
    /// a density (`rgc`, `rgc-quant`: `density`; `sbc`: `p`) whose `--codec`
    /// string does not set it [default: 0.001]. A density in the codec
    /// string is used as given; `--density` with another value is an error.
    #[arg(long)]
    pub density: Option<f64>,
    /// `--op sparse`: number of layers, fused into one allgatherv;
    /// `--op step`: the layers file (JSON, see `examples/layers/`).
    #[arg(long, default_value = "1")]
    pub layers: String,
    /// `--op step`: a calibrated profile; the plan (`cost::plan_step`)
    /// chooses every layer's strategy and predicts the step.
    /// `--op sparse-allreduce`: each collective's predicted time
    /// (`cost::sparse_collective`, this job's ranks per node), reported
    /// beside the measured one as `predicted_s`.
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// `--op step`: strategies the plan chooses among (comma list of
    /// cost-model names; default: what `Strategy::Auto` chooses among).
    #[arg(long, default_value = "")]
    pub strategies: String,
    /// `--op step`: calibrate in this job first (`calibrate::calibrate` with
    /// its defaults but messages and layers up to 64 MiB) and plan with
    /// that profile; with `--profile`, write the profile there.
    #[arg(long)]
    pub calibrate: bool,
    /// `--op step`: how the engine exchanges the RGC layers' index/value
    /// pairs (`Config::sparse_exchange`): allgather (the fused
    /// allgatherv), allreduce (one sparse allreduce), hierarchical (the
    /// node-aware one) or auto (the cost model's choice every step; needs
    /// --profile or --calibrate).
    #[arg(long, default_value = "allgather")]
    pub sparse_exchange: String,
    /// `--op step`: also measure the same table dense-only (every layer
    /// in the fused allreduce) and all-sparse (every layer RGC), in the
    /// same interleaved rounds: one record per configuration; and where
    /// the table has layers on both sides of the engine's compression
    /// threshold, `sparse-threshold` (RGC above it, dense below: the
    /// engine's default for an RGC codec).
    #[arg(long)]
    pub compare: bool,
    /// `--op step`: the PowerSGD rank: of the `powersgd` configuration
    /// `--compare` adds (every layer of two or more dimensions PowerSGD,
    /// where the profile prices it), and of the planned one's choice.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub powersgd_rank: usize,
    /// `--op step`: the engine's `compress_threshold` in elements (default
    /// the engine's, 32768): layers below it are never sparsified by the
    /// plan, and `sparse-threshold` keeps them dense. 0 lets the plan
    /// compress every layer, as `sparse` does.
    #[arg(long)]
    pub compress_threshold: Option<usize>,
    /// `--op sparse`: communicate on the engine's progress thread.
    #[arg(long)]
    pub overlap: bool,
    /// `--op sparse`: simulated compute (ms, a sleep) between start and
    /// wait, in [0, 3600000].
    #[arg(long, default_value_t = 0.0)]
    pub compute_ms: f64,
    /// `--op gradiveq`: slice size K.
    #[arg(long, default_value_t = 768)]
    pub k: usize,
    /// `--op gradiveq`: loss threshold λ of eq. 6 (d = smallest with
    /// retained energy ≥ 1 − λ).
    #[arg(long, default_value_t = 0.01)]
    pub lambda: f64,
    /// `--op gradiveq`: fixed d (1..=K) instead of --lambda.
    #[arg(long)]
    pub d: Option<usize>,
    /// `--op gradiveq`: `lowrank` (synthetic) or a (steps, n) .npy of gradients.
    #[arg(long, default_value = "lowrank")]
    pub data: String,
    /// `--op gradiveq`: aggregated samples the compressor is fitted on
    /// (L_t, at least 2).
    #[arg(long, default_value_t = 100)]
    pub lt: usize,
    /// `--op sparse` and `sparse-allreduce`: allgatherv of the fused
    /// messages: auto (the engine's choice by --profile; recdbl without
    /// one), recdbl, mpi or node.
    #[arg(long, default_value = "auto")]
    pub allgather: String,
    /// `--op sparse-allreduce`: also time (and with `--check` verify) the
    /// hierarchical sparse allreduce with MPI's node map
    /// (`MpiComm::node_ids`), as algo `hierarchical-sparse-allreduce`.
    #[arg(long)]
    pub hierarchical: bool,
    /// The flags given on the command line (clap's ids), filled in after
    /// parsing: a flag that `--op` does not use is an error, not ignored.
    #[arg(skip)]
    pub given: Vec<String>,
}

/// The flags each `--op` reads besides `--op`, `--iters`, `--warmup` and
/// `--json` (clap ids: the field names).
const OP_FLAGS: &[(&str, &[&str])] = &[
    (
        "allreduce",
        &["algo", "sizes", "check", "chunk", "no_validate"],
    ),
    ("allgatherv", &["algo", "sizes", "check", "no_validate"]),
    (
        "sparse",
        &[
            "codec",
            "bytes",
            "density",
            "layers",
            "overlap",
            "compute_ms",
            "allgather",
            "check",
        ],
    ),
    (
        "sparse-allreduce",
        &[
            "bytes",
            "density",
            "profile",
            "hierarchical",
            "allgather",
            "check",
        ],
    ),
    (
        "gradiveq",
        &["bytes", "k", "lambda", "d", "data", "lt", "check"],
    ),
    (
        "step",
        &[
            "layers",
            "profile",
            "strategies",
            "calibrate",
            "sparse_exchange",
            "compare",
            "density",
            "powersgd_rank",
            "compress_threshold",
        ],
    ),
];

/// A flag given that `--op` does not use: an error naming both (it was
/// ignored, so a mistyped `--codec` or a `--profile` for another op went
/// unnoticed, and differed across ranks unnoticed).
fn check_flags_apply(a: &BenchArgs) -> Result<()> {
    let Some((_, used)) = OP_FLAGS.iter().find(|(op, _)| *op == a.op) else {
        return Ok(()); // an unknown --op is named where it is dispatched
    };
    for id in &a.given {
        let common = ["op", "iters", "warmup", "json"].contains(&id.as_str());
        if !common && !used.contains(&id.as_str()) {
            let flag = format!("--{}", id.replace('_', "-"));
            let ops: Vec<&str> = OP_FLAGS
                .iter()
                .filter(|(_, f)| f.contains(&id.as_str()))
                .map(|(op, _)| *op)
                .collect();
            return Err(Error::InvalidArgument(format!(
                "{flag} is not used by --op {} (only by --op {})",
                a.op,
                ops.join(", --op ")
            )));
        }
    }
    Ok(())
}

impl BenchArgs {
    /// `--bytes` as given, or its default (16M).
    pub fn bytes_or_default(&self) -> &str {
        self.bytes.as_deref().unwrap_or("16M")
    }
}

/// One result line of `gradsync bench --json`.
#[derive(Serialize, Debug, Clone)]
pub struct BenchRecord {
    /// Collective.
    pub op: String,
    /// Algorithm.
    pub algo: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Message size in bytes (allgatherv: per rank).
    pub bytes: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median time of one collective (slowest rank), seconds.
    pub median_s: f64,
    /// Minimum time, seconds.
    pub min_s: f64,
    /// Median time of the MPI library's own collective in the same run.
    pub mpi_median_s: f64,
    /// `median_s / mpi_median_s`.
    pub ratio_vs_mpi: f64,
    /// Allreduce bus bandwidth `2(p−1)/p · bytes / median_s` (allgatherv:
    /// `(p−1) · bytes / median_s`), GB/s.
    pub busbw_gbs: f64,
    /// "ok", "failed" or "skipped".
    pub check: String,
    /// Ring chunk (elements), 0 = unpipelined.
    pub chunk_elems: usize,
    /// The cost model's prediction of `median_s` (`--op sparse-allreduce
    /// --profile`), seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_s: Option<f64>,
}

/// Integer-valued input, so that every summation order gives the same bits.
pub(crate) fn fill_input(buf: &mut [f32], rank: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = ((i.wrapping_mul(31) + rank * 17) % 64) as f32 - 32.0;
    }
}

/// Any-rank-failed flag, agreed on by all ranks.
pub(super) fn any_rank(comm: &MpiComm, failed: bool) -> bool {
    let mut v = [f64::from(u8::from(failed))];
    max_over_ranks(comm, &mut v);
    v[0] > 0.0
}

/// Barrier, then the time of `f` on this rank (MPI_Wtime).
pub(super) fn timed(comm: &MpiComm, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    comm.barrier()?;
    let t0 = mpi::time();
    f()?;
    Ok(mpi::time() - t0)
}

/// Run `warmup + iters` interleaved rounds of the `nops` operations (index 0 is
/// the MPI baseline); `round(k)` prepares op `k` untimed and returns its time
/// from [`timed`]. Returns per-op per-iteration times of the slowest rank.
///
/// Each round runs the operations in a new order (the same on every rank).
/// In a fixed order the first gradsync algorithm always ran right after
/// `MPI_Allreduce`, whose fresh temporary evicts the caches: at 4 MiB on
/// p = 2 that made Rabenseifner look 1.6× slower than the ring, whose
/// schedule at p = 2 is the same.
pub(super) fn time_interleaved(
    comm: &MpiComm,
    iters: usize,
    warmup: usize,
    nops: usize,
    mut round: impl FnMut(usize) -> Result<f64>,
) -> Result<Vec<Vec<f64>>> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut times = vec![vec![0.0; iters]; nops];
    let mut order: Vec<usize> = (0..nops).collect();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x6273);
    for it in 0..warmup + iters {
        order.shuffle(&mut rng);
        for &k in &order {
            let dt = round(k)?;
            if it >= warmup {
                times[k][it - warmup] = dt;
            }
        }
    }
    for t in &mut times {
        max_over_ranks(comm, t);
    }
    Ok(times)
}

/// `e` (a parse error of a flag's value) prefixed with the flag.
pub(super) fn flag_error(flag: impl std::fmt::Display, e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{flag}: {m}")),
        e => Error::InvalidArgument(format!("{flag}: {e}")),
    }
}

/// Most `--iters` (and `--warmup`) of a benchmark: a million calls.
const MAX_ITERS: usize = 1_000_000;

/// Most GradiVeQ samples `--lt` (each is a copy of the layer).
const MAX_LT: usize = 10_000;

/// Largest message of `--sizes`/`--bytes` (and `verify --counts`, in
/// elements of 4 bytes or more): 16 GiB, past any node's memory for the
/// several buffers a collective needs (a size past it ran out of memory).
pub(super) const MAX_RUN_BYTES: usize = 16 << 30;

/// Longest simulated compute of `--compute-ms` (one hour).
const MAX_COMPUTE_MS: f64 = 3_600_000.0;

/// Range checks of the flags every `--op` reads or could read: `--iters`,
/// `--compute-ms`, `--density`.
pub(super) fn check_common(a: &BenchArgs) -> Result<()> {
    check_flags_apply(a)?;
    if !(1..=MAX_ITERS).contains(&a.iters) {
        return Err(Error::InvalidArgument(format!(
            "--iters {}: must lie in [1, {MAX_ITERS}]",
            a.iters
        )));
    }
    if a.warmup > MAX_ITERS {
        return Err(Error::InvalidArgument(format!(
            "--warmup {}: at most {MAX_ITERS}",
            a.warmup
        )));
    }
    if !(2..=MAX_LT).contains(&a.lt) {
        return Err(Error::InvalidArgument(format!(
            "--lt {}: must be at least 2 and at most {MAX_LT}",
            a.lt
        )));
    }
    if !(a.compute_ms >= 0.0 && a.compute_ms <= MAX_COMPUTE_MS) {
        return Err(Error::InvalidArgument(format!(
            "--compute-ms {}: must be a number of milliseconds in [0, {MAX_COMPUTE_MS}]",
            a.compute_ms
        )));
    }
    if let Some(d) = a.density {
        if !(d > 0.0 && d <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "--density {d}: must lie in (0, 1]"
            )));
        }
    }
    Ok(())
}

/// The common arguments every `--op` must agree on.
pub(super) fn common_must_match(a: &BenchArgs) -> MustMatch {
    vec![
        ("subcommand", format!("bench --op {}", a.op)),
        ("--iters", a.iters.to_string()),
        ("--warmup", a.warmup.to_string()),
        ("--check", a.check.to_string()),
    ]
}

/// `--sizes` (or `--bytes`) parsed: a non-empty list; with `elem` > 1,
/// every size a whole number of elements.
pub(super) fn parse_sizes(flag: &str, s: &str, elem: usize) -> Result<Vec<usize>> {
    let sizes = parse_list(s, parse_size).map_err(|e| flag_error(format!("{flag} {s:?}"), e))?;
    if sizes.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{flag} {s:?}: no sizes given"
        )));
    }
    if let Some(b) = sizes.iter().find(|&&b| b > MAX_RUN_BYTES) {
        return Err(Error::InvalidArgument(format!(
            "{flag}: {b} bytes is past {MAX_RUN_BYTES} (16G)"
        )));
    }
    if let Some(b) = sizes.iter().find(|&&b| b % elem != 0) {
        return Err(Error::InvalidArgument(format!(
            "{flag}: {b} bytes is not a whole number of {elem}-byte elements (a multiple of {elem})"
        )));
    }
    Ok(sizes)
}

/// The dense collectives' inputs.
enum DenseOp {
    Allreduce(Vec<AllreduceAlgo>),
    Allgatherv(Vec<AllgathervAlgo>),
}

fn parse_algos<T: std::str::FromStr<Err = Error> + PartialEq>(
    algo: &str,
    all: Vec<T>,
    known: &str,
) -> Result<Vec<T>> {
    let v = if algo.trim() == "all" {
        all
    } else {
        let v: Vec<T> =
            parse_list(algo, str::parse).map_err(|e| flag_error(format!("--algo {algo:?}"), e))?;
        // `auto` parses (the engine's per-step choice) but is no algorithm.
        if v.iter().any(|x| !all.contains(x)) {
            return Err(Error::InvalidArgument(format!(
                "--algo {algo:?}: bench runs {known} (or all); \"auto\" is the engine's per-step choice"
            )));
        }
        v
    };
    if v.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--algo {algo:?}: no algorithm given ({known} or all)"
        )));
    }
    Ok(v)
}

/// The rank-local input phase of `bench --op allreduce|allgatherv`.
fn dense_inputs(a: &BenchArgs) -> Result<(DenseOp, Vec<usize>)> {
    check_common(a)?;
    match a.op.as_str() {
        "allreduce" => Ok((
            DenseOp::Allreduce(parse_algos(
                &a.algo,
                vec![
                    AllreduceAlgo::Rabenseifner,
                    AllreduceAlgo::Ring,
                    AllreduceAlgo::Mpi,
                    AllreduceAlgo::Hierarchical,
                ],
                "rabenseifner, ring, mpi, hierarchical",
            )?),
            // f32 buffers.
            parse_sizes("--sizes", &a.sizes, 4)?,
        )),
        "allgatherv" => Ok((
            DenseOp::Allgatherv(parse_algos(
                &a.algo,
                vec![
                    AllgathervAlgo::RecursiveDoubling,
                    AllgathervAlgo::Mpi,
                    AllgathervAlgo::Node,
                ],
                "recdbl, mpi, node",
            )?),
            parse_sizes("--sizes", &a.sizes, 1)?,
        )),
        other => Err(Error::InvalidArgument(format!(
            "unknown --op {other:?} (allreduce, allgatherv, sparse, sparse-allreduce, gradiveq, step)"
        ))),
    }
}

/// `--op allreduce` and `--op allgatherv` (the other ops have their own
/// modules; `cli::run` dispatches).
pub(super) fn run(comm: &MpiComm, a: &BenchArgs) -> Result<i32> {
    let (op, sizes) = agree_inputs(comm, dense_inputs(a), |(op, sizes)| {
        let mut m = common_must_match(a);
        let algos: Vec<&str> = match op {
            DenseOp::Allreduce(v) => v.iter().map(|x| x.name()).collect(),
            DenseOp::Allgatherv(v) => v.iter().map(|x| x.name()).collect(),
        };
        m.push(("--algo", algos.join(",")));
        m.push(("--sizes", format!("{sizes:?}")));
        m.push(("--chunk", a.chunk.to_string()));
        m.push(("--no-validate", a.no_validate.to_string()));
        m
    })?;
    let records = match op {
        DenseOp::Allreduce(algos) => bench_allreduce(comm, a, &sizes, &algos)?,
        DenseOp::Allgatherv(algos) => bench_allgatherv(comm, a, &sizes, &algos)?,
    };
    Ok(i32::from(records.iter().any(|r| r.check == "failed")))
}

pub(super) fn emit(comm: &MpiComm, a: &BenchArgs, r: &BenchRecord, first: bool) -> Result<()> {
    if comm.rank() != 0 {
        return Ok(());
    }
    if a.json {
        outln!("{}", serde_json::to_string(r)?);
    } else {
        if first {
            outln!(
                "{:<10} {:<13} {:>5} {:>11} {:>6} {:>12} {:>12} {:>12} {:>7} {:>9} {:>7}",
                "op",
                "algo",
                "ranks",
                "bytes",
                "iters",
                "median_us",
                "min_us",
                "mpi_med_us",
                "ratio",
                "busbw_GBs",
                "check"
            );
        }
        outln!(
            "{:<10} {:<13} {:>5} {:>11} {:>6} {:>12.1} {:>12.1} {:>12.1} {:>7.3} {:>9.3} {:>7}",
            r.op,
            r.algo,
            r.ranks,
            r.bytes,
            r.iters,
            r.median_s * 1e6,
            r.min_s * 1e6,
            r.mpi_median_s * 1e6,
            r.ratio_vs_mpi,
            r.busbw_gbs,
            r.check
        );
        if let Some(t) = r.predicted_s {
            outln!(
                "{:<10} predicted {:.1} us ({:+.0} % of the measured median)",
                "",
                t * 1e6,
                (t / r.median_s - 1.0) * 100.0
            );
        }
    }
    Ok(())
}

fn bench_allreduce(
    comm: &MpiComm,
    a: &BenchArgs,
    sizes: &[usize],
    algos: &[AllreduceAlgo],
) -> Result<Vec<BenchRecord>> {
    let (rank, p) = (comm.rank(), comm.size());
    let opts = AllreduceOptions {
        chunk_elems: a.chunk,
        validate: !a.no_validate,
        ..Default::default()
    };
    let mut ws = Workspace::<f32>::new();
    let mut out = Vec::new();
    for &bytes in sizes {
        let n = bytes / 4;
        let mut input = vec![0f32; n];
        fill_input(&mut input, rank);
        let mut buf = input.clone();
        let mut reference = vec![0f32; n];
        // Baseline MPI_Allreduce (out of place, as applications call it).
        comm.native_allreduce_sum(&input, &mut reference)
            .ok_or_else(|| Error::Unsupported("no MPI allreduce".into()))??;
        let mut checks = Vec::with_capacity(algos.len());
        for &algo in algos {
            let check = if a.check {
                buf.copy_from_slice(&input);
                allreduce_with(comm, &mut buf, algo, &opts, &mut ws)?;
                if any_rank(comm, buf != reference) {
                    "failed"
                } else {
                    "ok"
                }
            } else {
                "skipped"
            };
            checks.push(check);
        }
        let mut times = time_interleaved(comm, a.iters, a.warmup, algos.len() + 1, |k| {
            if k == 0 {
                timed(comm, || {
                    comm.native_allreduce_sum(&input, &mut reference)
                        .ok_or_else(|| Error::Unsupported("no MPI allreduce".into()))?
                })
            } else {
                buf.copy_from_slice(&input);
                timed(comm, || {
                    allreduce_with(comm, &mut buf, algos[k - 1], &opts, &mut ws)
                })
            }
        })?;
        let mpi_med = median(&mut times[0].clone());
        for (k, &algo) in algos.iter().enumerate() {
            let t = &mut times[k + 1];
            let med = median(t);
            let rec = BenchRecord {
                op: "allreduce".into(),
                algo: algo.name().into(),
                ranks: p,
                bytes: n * 4,
                iters: a.iters,
                median_s: med,
                min_s: t.iter().copied().fold(f64::INFINITY, f64::min),
                mpi_median_s: mpi_med,
                ratio_vs_mpi: med / mpi_med,
                busbw_gbs: 2.0 * (p as f64 - 1.0) / p as f64 * (n * 4) as f64 / med / 1e9,
                check: checks[k].into(),
                chunk_elems: if algo == AllreduceAlgo::Ring {
                    a.chunk
                } else {
                    0
                },
                predicted_s: None,
            };
            emit(comm, a, &rec, out.is_empty())?;
            out.push(rec);
        }
    }
    Ok(out)
}

fn bench_allgatherv(
    comm: &MpiComm,
    a: &BenchArgs,
    sizes: &[usize],
    algos: &[AllgathervAlgo],
) -> Result<Vec<BenchRecord>> {
    let (rank, p) = (comm.rank(), comm.size());
    let mut out = Vec::new();
    let mut g = Gathered::default();
    let mut reference = Gathered::default();
    for &bytes in sizes {
        let mine: Vec<u8> = (0..bytes).map(|i| (i * 7 + rank * 13) as u8).collect();
        allgatherv_with(comm, &mine, AllgathervAlgo::Mpi, &mut reference)?;
        let mut checks = Vec::with_capacity(algos.len());
        for &algo in algos {
            let check = if a.check {
                allgatherv_with(comm, &mine, algo, &mut g)?;
                if any_rank(
                    comm,
                    g.data != reference.data || g.displs != reference.displs,
                ) {
                    "failed"
                } else {
                    "ok"
                }
            } else {
                "skipped"
            };
            checks.push(check);
        }
        let mut times = time_interleaved(comm, a.iters, a.warmup, algos.len() + 1, |k| {
            let algo = if k == 0 {
                AllgathervAlgo::Mpi
            } else {
                algos[k - 1]
            };
            timed(comm, || allgatherv_with(comm, &mine, algo, &mut g))
        })?;
        let mpi_med = median(&mut times[0].clone());
        for (k, &algo) in algos.iter().enumerate() {
            let t = &mut times[k + 1];
            let med = median(t);
            let rec = BenchRecord {
                op: "allgatherv".into(),
                algo: algo.name().into(),
                ranks: p,
                bytes,
                iters: a.iters,
                median_s: med,
                min_s: t.iter().copied().fold(f64::INFINITY, f64::min),
                mpi_median_s: mpi_med,
                ratio_vs_mpi: med / mpi_med,
                busbw_gbs: (p as f64 - 1.0) * bytes as f64 / med / 1e9,
                check: checks[k].into(),
                chunk_elems: 0,
                predicted_s: None,
            };
            emit(comm, a, &rec, out.is_empty())?;
            out.push(rec);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{BenchArgs, OP_FLAGS};
    use clap::Args;

    /// A flag no `--op` lists is refused by every op (`check_flags_apply`):
    /// every field of `BenchArgs` is common or belongs to an op.
    #[test]
    fn every_flag_belongs_to_an_op() {
        let cmd = BenchArgs::augment_args(clap::Command::new("bench"));
        let mut seen = 0;
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if ["op", "iters", "warmup", "json", "help"].contains(&id) {
                continue;
            }
            seen += 1;
            assert!(
                OP_FLAGS.iter().any(|(_, f)| f.contains(&id)),
                "--{} is used by no --op in OP_FLAGS",
                id.replace('_', "-")
            );
        }
        assert!(seen > 10, "{seen} flags read");
    }
}
