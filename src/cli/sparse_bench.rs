//! `gradsync bench --op sparse`: one synchronization step of the engine
//! ([`crate::sync::GradSync::sync`]) on `--layers` sparse layers of `--bytes`
//! each, against `MPI_Allreduce` of the same gradient bytes (dense
//! synchronization by the MPI library) in the same run, iterations
//! interleaved. Reports the medians of the slowest rank and the time
//! breakdown of the engine (select / pack / allgather / unpack, as RedSync's
//! Fig. 10). With `--compute-ms X` each step is `start`, X ms of simulated
//! device compute (a sleep: the CPU stays free, as while a GPU computes),
//! then `wait`; with `--overlap` the communication runs behind that compute
//! on the engine's progress thread.

use super::bench::{
    check_common, common_must_match, flag_error, parse_sizes, time_interleaved, timed, BenchArgs,
};
use super::{max_over_ranks, synthetic};
use crate::calibrate::median;
use crate::codec::CodecConfig;
use crate::comm::agree::agree_inputs;
use crate::comm::{MpiComm, Transport};
use crate::dense::AllgathervAlgo;
use crate::strategy::Pick;
use crate::sync::{Config, GradSync, LayerId, Strategy};
use crate::{Error, Result};
use mpi::collective::{CommunicatorCollectives, SystemOperation};
use serde::Serialize;

/// One result line of `gradsync bench --op sparse --json`.
#[derive(Serialize, Debug, Clone)]
pub struct SparseRecord {
    /// `sparse`.
    pub op: String,
    /// Codec name.
    pub codec: String,
    /// Codec parameters as used (`key=value,...`).
    pub codec_params: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Bytes of each layer (f32 gradient).
    pub bytes: usize,
    /// Density used (codecs with a density parameter; `null` for others).
    pub density: Option<f64>,
    /// Number of layers (fused into one allgatherv).
    pub layers: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median time of one engine step (slowest rank), seconds.
    pub median_s: f64,
    /// Minimum time of one engine step, seconds.
    pub min_s: f64,
    /// Median time of `MPI_Allreduce` on all layers' bytes, same run.
    pub dense_mpi_median_s: f64,
    /// `dense_mpi_median_s / median_s`.
    pub speedup_vs_dense: f64,
    /// Bytes of this rank's fused message (rank 0).
    pub wire_bytes_per_rank: usize,
    /// Fraction of elements rank 0 actually sent (last step).
    pub sent_density: f64,
    /// Median selection + encoding time, seconds (slowest rank).
    pub select_s: f64,
    /// Median residual update + packing time, seconds.
    pub pack_s: f64,
    /// Median allgatherv time, seconds.
    pub allgather_s: f64,
    /// Median unpack (scatter-add) time, seconds.
    pub unpack_s: f64,
    /// Allgatherv algorithm.
    pub allgather: String,
    /// Whether communication ran on the progress thread.
    pub overlap: bool,
    /// Simulated compute between `start` and `wait` per step, seconds
    /// (included in `median_s`).
    pub compute_s: f64,
    /// Median time `wait` blocked for communication, seconds (≈ 0 when the
    /// communication was hidden behind the compute).
    pub wait_s: f64,
    /// "ok", "failed" (result differs from the reference), "starved" (a
    /// layer sent nothing for `STARVED_STEPS` consecutive steps, or for every
    /// step of a shorter run, while its residual grew) or "skipped".
    pub check: String,
}

/// Default of `--density` (for codecs whose string sets none).
const DEFAULT_DENSITY: f64 = 0.001;

/// `bench --op sparse`'s arguments, parsed and validated.
struct Inputs {
    /// Layer sizes (bytes, multiples of 4).
    sizes: Vec<usize>,
    /// `--layers`: number of layers.
    layers: usize,
    /// The layers' strategy (`Dense` for `--codec dense`).
    strategy: Strategy,
    /// The density used, for codecs with one.
    density: Option<f64>,
    allgather: Pick<AllgathervAlgo>,
    compute: std::time::Duration,
}

/// The parameter of `codec` that is its density, if it has one.
fn density_key(codec: &CodecConfig) -> Option<&'static str> {
    match codec {
        CodecConfig::Rgc { .. } | CodecConfig::RgcQuant { .. } => Some("density"),
        CodecConfig::Sbc { .. } => Some("p"),
        _ => None,
    }
}

/// Most layers `--op sparse` takes: past real models' 10^2–10^4 tensors
/// by far, and the per-layer engine state alone is gigabytes there.
const MAX_LAYERS: usize = 1 << 22;

/// Bytes a rank holds per byte of one layer's gradient (its gradient,
/// output, residual, the fused message and its receive buffer), and per
/// layer whatever its size (the engine's table and stats): measured at
/// 10^3–10^5 layers of 4 KB and 10^4 of 64 KB (5.1–5.7× and ~3 KB).
const BYTES_PER_GRADIENT_BYTE: f64 = 5.5;
const BYTES_PER_LAYER: f64 = 3072.0;

/// `--layers` layers of up to `bytes` each must fit: at most
/// [`MAX_LAYERS`], and the memory they need within this machine's
/// available memory (`available`, when known), or a clear error naming
/// what they would need.
fn check_memory(layers: usize, bytes: usize, available: Option<f64>) -> Result<()> {
    if layers > MAX_LAYERS {
        return Err(Error::InvalidArgument(format!(
            "--layers {layers}: at most {MAX_LAYERS} (real models have 10^2–10^4 tensors)"
        )));
    }
    let need = layers as f64 * (BYTES_PER_GRADIENT_BYTE * bytes as f64 + BYTES_PER_LAYER);
    match available {
        Some(have) if need > have => Err(Error::InvalidArgument(format!(
            "--layers {layers} of --bytes {bytes} need about {:.1} GB a rank (each layer's \
             gradient about {BYTES_PER_GRADIENT_BYTE} times over, and ~3 KB of engine state), \
             and this machine has {:.1} GB available: fewer layers or smaller --bytes",
            need / 1e9,
            have / 1e9
        ))),
        _ => Ok(()),
    }
}

/// This machine's available memory in bytes (`MemAvailable` of
/// `/proc/meminfo`), `None` where it cannot be read.
fn mem_available() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// The rank-local input phase. The density: one given in the codec string
/// (`rgc:density=0.5`) is used as given; `--density` applies to a codec
/// string without one (default 0.001); both given and different is an
/// error. `--density` with a codec that has no density is ignored with a
/// warning.
fn inputs(a: &BenchArgs) -> Result<Inputs> {
    check_common(a)?;
    let layers: usize = a.layers.trim().parse().map_err(|_| {
        Error::InvalidArgument(format!(
            "--layers {:?}: --op sparse takes a number of layers",
            a.layers
        ))
    })?;
    if layers == 0 {
        return Err(Error::InvalidArgument(
            "--layers 0: must be at least 1".into(),
        ));
    }
    let sizes = parse_sizes("--bytes", a.bytes_or_default(), 4)?;
    if sizes.contains(&0) {
        return Err(Error::InvalidArgument(
            "--bytes: a layer needs at least one element (4 bytes)".into(),
        ));
    }
    check_memory(
        layers,
        sizes.iter().copied().max().unwrap_or(0),
        mem_available(),
    )?;
    let allgather: Pick<AllgathervAlgo> = a
        .allgather
        .parse()
        .map_err(|e| flag_error(format!("--allgather {:?}", a.allgather), e))?;
    let compute = std::time::Duration::from_secs_f64(a.compute_ms / 1e3);
    // `dense`: the engine's fused Rabenseifner path (for overlap runs).
    if a.codec == "dense" {
        if let Some(d) = a.density {
            log::warn!("--density {d} does not apply to --codec dense; ignored");
        }
        return Ok(Inputs {
            sizes,
            layers,
            strategy: Strategy::Dense,
            density: None,
            allgather,
            compute,
        });
    }
    let mut codec: CodecConfig = a.codec.parse().map_err(|e| flag_error("--codec", e))?;
    let density = match density_key(&codec) {
        None => {
            if let Some(d) = a.density {
                log::warn!(
                    "--density {d} does not apply to codec {} (it has no density); ignored",
                    codec.name()
                );
            }
            None
        }
        Some(key) => {
            let given = a.codec.split_once(':').and_then(|(_, params)| {
                params
                    .split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .find(|(k, _)| k.trim() == key)
            });
            let d = match (given, a.density) {
                (Some(_), Some(flag)) => {
                    let in_codec = codec_density(&codec);
                    if in_codec != flag {
                        return Err(Error::InvalidArgument(format!(
                            "--codec {:?} sets {key}={in_codec} but --density is {flag}: \
                             give the density once",
                            a.codec
                        )));
                    }
                    flag
                }
                (Some(_), None) => codec_density(&codec),
                (None, flag) => flag.unwrap_or(DEFAULT_DENSITY),
            };
            match &mut codec {
                CodecConfig::Rgc { density, .. } | CodecConfig::RgcQuant { density } => {
                    *density = d
                }
                CodecConfig::Sbc { p } => *p = d,
                _ => {}
            }
            // Validates the density (and every other parameter).
            codec
                .build()
                .map_err(|e| flag_error(format!("--codec {:?}", a.codec), e))?;
            Some(d)
        }
    };
    Ok(Inputs {
        sizes,
        layers,
        strategy: Strategy::Sparse {
            codec,
            density: None,
        },
        density,
        allgather,
        compute,
    })
}

/// The density parameter of a codec with one ([`density_key`]).
fn codec_density(c: &CodecConfig) -> f64 {
    match c {
        CodecConfig::Rgc { density, .. } | CodecConfig::RgcQuant { density } => *density,
        CodecConfig::Sbc { p } => *p,
        _ => f64::NAN,
    }
}

pub(super) fn run(comm: &MpiComm, a: &BenchArgs) -> Result<i32> {
    let inp = agree_inputs(comm, inputs(a), |i| {
        let mut m = common_must_match(a);
        // The codec's name and its parameters (rgc and rgc-quant have the
        // same parameters: the message named neither).
        m.push((
            "--codec",
            format!("{}:{}", i.strategy.label(), strategy_params(&i.strategy)),
        ));
        m.push(("--bytes", format!("{:?}", i.sizes)));
        m.push(("--layers", i.layers.to_string()));
        m.push(("--allgather", i.allgather.to_string()));
        m.push(("--overlap", a.overlap.to_string()));
        m
    })?;
    let mut failed = false;
    for (i, &bytes) in inp.sizes.iter().enumerate() {
        let rec = one(comm, a, &inp, bytes)?;
        failed |= rec.check != "ok" && rec.check != "skipped";
        if comm.rank() == 0 {
            if a.json {
                outln!("{}", serde_json::to_string(&rec)?);
            } else {
                if i == 0 {
                    outln!(
                        "{:<10} {:>5} {:>10} {:>8} {:>6} {:>11} {:>11} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7}",
                        "codec", "ranks", "bytes", "density", "layers", "median_us", "dense_us",
                        "speedup", "wire_B", "select_us", "pack_us", "gather_us", "unpack_us", "check"
                    );
                }
                outln!(
                    "{:<10} {:>5} {:>10} {:>8} {:>6} {:>11.1} {:>11.1} {:>8.2} {:>10} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7}",
                    rec.codec,
                    rec.ranks,
                    rec.bytes,
                    // Short in the column: 0.001, 1e-300 (Display wrote 300 digits).
                    rec.density.map_or("-".to_string(), |d| {
                        if d >= 1e-4 { d.to_string() } else { format!("{d:e}") }
                    }),
                    rec.layers,
                    rec.median_s * 1e6,
                    rec.dense_mpi_median_s * 1e6,
                    rec.speedup_vs_dense,
                    rec.wire_bytes_per_rank,
                    rec.select_s * 1e6,
                    rec.pack_s * 1e6,
                    rec.allgather_s * 1e6,
                    rec.unpack_s * 1e6,
                    rec.check
                );
            }
        }
    }
    Ok(i32::from(failed))
}

fn one(comm: &MpiComm, a: &BenchArgs, inp: &Inputs, bytes: usize) -> Result<SparseRecord> {
    let strategy = inp.strategy.clone();
    let world = comm.communicator();
    let (rank, p) = (comm.rank(), comm.size());
    let n = bytes / 4;
    let cfg = Config {
        overlap: a.overlap,
        allgather: inp.allgather,
        ..Config::default()
    };
    let mut s = GradSync::new(world, cfg)?;
    let ids: Vec<LayerId> = (0..inp.layers)
        .map(|l| s.register_with(&format!("layer{l}"), &[n], strategy.clone()))
        .collect::<Result<_>>()?;
    let input: Vec<Vec<f32>> = (0..inp.layers)
        .map(|l| synthetic(n, "normal", (rank * 1000 + l) as u64 + 1))
        .collect::<Result<_>>()?;
    let mut work = input.clone();
    let dense_in: Vec<f32> = input.concat();
    let mut dense_out = vec![0f32; dense_in.len()];
    // Per-iteration engine stats: select, pack, allgather, unpack.
    let mut parts: [Vec<f64>; 4] = Default::default();
    let mut wire = 0usize;
    let mut sent = 0.0;
    let mut ran_gather = String::new();
    let mut waits = Vec::new();
    let mut steps = 0u64;
    let mut times = time_interleaved(comm, a.iters, a.warmup, 2, |k| {
        if k == 0 {
            timed(comm, || {
                comm.native_allreduce_sum(&dense_in, &mut dense_out)
                    .ok_or_else(|| Error::Unsupported("no MPI allreduce".into()))?
            })
        } else {
            // Each step its own gradient, as in training.
            for (w, i) in work.iter_mut().zip(&input) {
                crate::calibrate::step_gradient(w, i, steps as usize);
            }
            let mut st = None;
            let compute = inp.compute;
            let t = timed(comm, || {
                {
                    let view: Vec<&[f32]> = work.iter().map(|w| &w[..]).collect();
                    s.start(&view)?;
                }
                if !compute.is_zero() {
                    // Device compute (backpropagation of earlier layers on
                    // a GPU) that leaves this CPU free.
                    std::thread::sleep(compute);
                }
                let mut views: Vec<&mut [f32]> = work.iter_mut().map(|w| &mut w[..]).collect();
                st = Some(s.wait(&mut views)?.clone());
                Ok(())
            })?;
            let st = st.expect("sync ran");
            steps += 1;
            waits.push(st.wait_s);
            parts[0].push(st.select_s);
            parts[1].push(st.pack_s);
            parts[2].push(st.allgather_s);
            parts[3].push(st.unpack_s);
            wire = st.fused_bytes;
            if !st.allgather.is_empty() {
                ran_gather.clone_from(&st.allgather);
            }
            sent = st.layers.iter().map(|l| l.density).sum::<f64>() / st.layers.len() as f64;
            Ok(t)
        }
    })?;
    // Breakdown: median over iterations after warm-up, slowest rank.
    let mut med_parts = [0f64; 4];
    for (m, v) in med_parts.iter_mut().zip(parts.iter_mut()) {
        let tail = v.split_off(a.warmup.min(v.len()));
        *m = median(&mut tail.clone());
    }
    let mut wait = [median(&mut waits.split_off(a.warmup.min(waits.len())))];
    max_over_ranks(comm, &mut med_parts);
    max_over_ranks(comm, &mut wait);
    let check = if a.check {
        let c = check(comm, &mut s, &ids, &input)?;
        if starved(comm, &s, steps + 1) {
            "starved"
        } else {
            c
        }
    } else {
        "skipped"
    };
    let dense = median(&mut times[0]);
    let t = &mut times[1];
    let med = median(t);
    Ok(SparseRecord {
        op: "sparse".into(),
        codec: match &strategy {
            Strategy::Sparse { codec, .. } => codec.name(),
            _ => "dense".into(),
        },
        codec_params: strategy_params(&strategy),
        ranks: p,
        bytes: n * 4,
        density: inp.density,
        layers: inp.layers,
        iters: a.iters,
        median_s: med,
        min_s: t.iter().copied().fold(f64::INFINITY, f64::min),
        dense_mpi_median_s: dense,
        speedup_vs_dense: dense / med,
        wire_bytes_per_rank: wire,
        sent_density: sent,
        select_s: med_parts[0],
        pack_s: med_parts[1],
        allgather_s: med_parts[2],
        unpack_s: med_parts[3],
        // What ran (`auto` resolves each step; the last step's), else
        // the configured name (one rank: no allgatherv).
        allgather: if ran_gather.is_empty() {
            inp.allgather.to_string()
        } else {
            ran_gather
        },
        overlap: a.overlap,
        compute_s: a.compute_ms / 1e3,
        wait_s: wait[0],
        check: check.into(),
    })
}

fn strategy_params(s: &Strategy) -> String {
    match s {
        Strategy::Sparse { codec, density } => {
            let mut c = codec.clone();
            if let Some(d) = density {
                match &mut c {
                    CodecConfig::Rgc { density, .. } | CodecConfig::RgcQuant { density } => {
                        *density = *d
                    }
                    CodecConfig::Sbc { p } => *p = *d,
                    _ => {}
                }
            }
            c.params()
        }
        Strategy::Powersgd(c) => c.params(),
        Strategy::Dense | Strategy::Auto | Strategy::Gradiveq(_) => String::new(),
    }
}

/// Whether a layer on any rank sent nothing for
/// [`STARVED_STEPS`](crate::codec::STARVED_STEPS) consecutive steps (or all
/// `steps` of a shorter run) while its residual was not zero; names them on
/// stderr.
fn starved(comm: &MpiComm, s: &GradSync, steps: u64) -> bool {
    let lim = crate::codec::STARVED_STEPS.min(steps.max(1));
    let names: Vec<String> = s
        .last_stats()
        .layers
        .iter()
        .filter(|l| l.starved_steps >= lim)
        .map(|l| format!("{:?} ({} steps)", l.name, l.starved_steps))
        .collect();
    if !names.is_empty() {
        errln!(
            "gradsync bench: rank {}: layer {} sent nothing while its residual grew: it starves",
            comm.rank(),
            names.join(", ")
        );
    }
    let mut v = [f64::from(u8::from(!names.is_empty()))];
    max_over_ranks(comm, &mut v);
    v[0] > 0.0
}

/// One more step; the result must equal `MPI_Allreduce` of every rank's
/// decoded unit divided by `p` (within summation-order rounding).
fn check(
    comm: &MpiComm,
    s: &mut GradSync,
    ids: &[LayerId],
    input: &[Vec<f32>],
) -> Result<&'static str> {
    let world = comm.communicator();
    let p = comm.size() as f32;
    let mut work = input.to_vec();
    let mut views: Vec<&mut [f32]> = work.iter_mut().map(|w| &mut w[..]).collect();
    s.sync(&mut views)?;
    let mut bad = 0.0f64;
    for (l, &id) in ids.iter().enumerate() {
        let n = input[l].len();
        let mut mine = vec![0f32; n];
        if s.layer(id).is_some_and(|l| *l.2 == Strategy::Dense) {
            mine.copy_from_slice(&input[l]);
        } else {
            s.decode_unit(id, s.last_unit(id), &mut mine)?;
        }
        let abs_mine: Vec<f32> = mine.iter().map(|x| x.abs()).collect();
        let (mut sum, mut abs) = (vec![0f32; n], vec![0f32; n]);
        world.all_reduce_into(&mine[..], &mut sum[..], SystemOperation::sum());
        world.all_reduce_into(&abs_mine[..], &mut abs[..], SystemOperation::sum());
        for j in 0..n {
            let tol = (p + 2.0) * f32::EPSILON * abs[j] / p + 1e-30;
            if (work[l][j] - sum[j] / p).abs() > tol {
                bad = 1.0;
                break;
            }
        }
    }
    let mut v = [bad];
    max_over_ranks(comm, &mut v);
    Ok(if v[0] > 0.0 { "failed" } else { "ok" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_layers_or_too_much_memory_is_refused_naming_it() {
        let e = check_memory(MAX_LAYERS + 1, 4, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--layers 4194305: at most 4194304"), "{e}");
        // 10^6 layers of 4 KiB: about 25 GB, on a machine with 8 GB free.
        let e = check_memory(1_000_000, 4096, Some(8e9))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("need about 25.6 GB a rank") && e.contains("8.0 GB available"),
            "{e}"
        );
        assert!(check_memory(1_000_000, 4096, Some(64e9)).is_ok());
        // Unknown available memory: only the layer bound applies.
        assert!(check_memory(1_000_000, 4096, None).is_ok());
        assert!(mem_available().is_none_or(|m| m > 0.0));
    }
}
