//! `gradsync calibrate` (measure this machine's α, β, γ's and local cost
//! fits, write a [`Profile`]) and `gradsync model-check` (the profile's
//! predictions against measurements of the same strategies, and how often
//! the model's choice is the measured-fastest). Both run under `mpirun`.
//!
//! Local costs are measured on every rank at once (so ranks contend for
//! memory bandwidth as they do in a real step) and the slowest rank's
//! median is kept.

use super::bench::median;
use super::{max_over_ranks, parse_list, parse_size, synthetic};
use crate::codec::{CodecConfig, RgcMethod};
use crate::comm::{LocalComm, MpiComm, Transport};
use crate::cost::{self, CodecFit, LinearFit, Profile, ProfileMeta, Query, PROFILE_VERSION};
use crate::dense::{
    allgatherv_with, allreduce_with, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Gathered,
    Workspace,
};
use crate::sync::{Config, GradSync, Strategy};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `gradsync calibrate`.
#[derive(clap::Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// Where to write the profile (JSON).
    #[arg(long)]
    pub out: PathBuf,
    /// Densities at which selection costs are fitted.
    #[arg(long, default_value = "0.001,0.01")]
    pub densities: String,
    /// Largest layer for the local fits (bytes).
    #[arg(long, default_value = "16M")]
    pub max_bytes: String,
    /// Repetitions per measurement (medians).
    #[arg(long, default_value_t = 7)]
    pub reps: usize,
    /// Free-form note stored in the profile (e.g. "netem 1gbit").
    #[arg(long, default_value = "")]
    pub note: String,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Then run `model-check` on the new profile in the same job (same
    /// machine state; its default grid, JSON lines).
    #[arg(long)]
    pub check: bool,
}

struct Progress {
    total: usize,
    done: usize,
    show: bool,
}

impl Progress {
    fn step(&mut self, what: &str) {
        self.done += 1;
        if self.show {
            let w = 30;
            let filled = (self.done * w / self.total.max(1)).min(w);
            eprint!(
                "\r[{}{}] {:>3}% {:<40}",
                "#".repeat(filled),
                ".".repeat(w - filled),
                100 * self.done / self.total.max(1),
                what
            );
            if self.done >= self.total {
                eprintln!();
            }
        }
    }
}

/// Median of `reps` timings of `f` on this rank (after one warm-up call).
fn local_median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(&mut t))
}

/// The slowest rank's value.
fn slowest(comm: &MpiComm, v: f64) -> f64 {
    let mut x = [v];
    max_over_ranks(comm, &mut x);
    x[0]
}

/// One-way time of a `bytes` message between ranks 0 and 1 (ping-pong / 2).
fn pingpong(comm: &MpiComm, bytes: usize, reps: usize) -> Result<f64> {
    let mut buf = vec![0u8; bytes];
    let rank = comm.rank();
    let mut t = Vec::new();
    for i in 0..=reps {
        comm.barrier()?;
        let t0 = mpi::time();
        match rank {
            0 => {
                comm.send(&buf, 1, 77)?;
                comm.recv(&mut buf, 1, 77)?;
            }
            1 => {
                comm.recv(&mut buf, 0, 77)?;
                comm.send(&buf, 0, 77)?;
            }
            _ => {}
        }
        if i > 0 {
            t.push((mpi::time() - t0) / 2.0);
        }
    }
    Ok(slowest(comm, if rank <= 1 { median(&mut t) } else { 0.0 }))
}

/// Time of a pairwise exchange (`sendrecv` of `bytes` each way between
/// ranks `2i` and `2i+1`): one step of Rabenseifner's or recursive
/// doubling's schedule, `α + bytes·β` in the model.
fn exchange_time(comm: &MpiComm, bytes: usize, reps: usize) -> Result<f64> {
    let (rank, p) = (comm.rank(), comm.size());
    let send = vec![1u8; bytes];
    let mut recv = vec![0u8; bytes];
    let peer = rank ^ 1;
    let mut t = Vec::new();
    for i in 0..=reps {
        comm.barrier()?;
        let t0 = mpi::time();
        if peer < p {
            comm.sendrecv(&send, peer, &mut recv, peer, 78)?;
        }
        if i > 0 {
            t.push(mpi::time() - t0);
        }
    }
    Ok(slowest(comm, if peer < p { median(&mut t) } else { 0.0 }))
}

fn allgather_time(comm: &MpiComm, bytes: usize, reps: usize) -> Result<f64> {
    let mine = vec![1u8; bytes];
    let mut g = Gathered::default();
    let mut t = Vec::new();
    for i in 0..=reps {
        comm.barrier()?;
        let t0 = mpi::time();
        allgatherv_with(comm, &mine, AllgathervAlgo::RecursiveDoubling, &mut g)?;
        if i > 0 {
            t.push(mpi::time() - t0);
        }
    }
    Ok(slowest(comm, median(&mut t)))
}

/// Local cost of one sparse engine step (one rank, in process): residual
/// accumulation, selection, packing, zeroing and unpacking its own unit.
fn sparse_step_time(codec: CodecConfig, n: usize, reps: usize) -> Result<f64> {
    let comm = LocalComm::create(1).pop().expect("one rank");
    let mut s = GradSync::with_transport(
        comm,
        Config {
            overlap: false,
            ..Config::default()
        },
    )?;
    s.register_with(
        "layer",
        &[n],
        Strategy::Sparse {
            codec,
            density: None,
        },
    )?;
    let g = synthetic(n, "normal", n as u64)?;
    let mut w = g.clone();
    local_median(reps, || {
        w.copy_from_slice(&g);
        s.sync(&mut [&mut w[..]]).map(|_| ())
    })
}

fn sizes_up_to(max_bytes: usize) -> Vec<usize> {
    // Elements: 16K (64 KiB) .. max, by factors of 2.
    let mut v = Vec::new();
    let mut n = 16384usize;
    while 4 * n <= max_bytes {
        v.push(n);
        n *= 2;
    }
    v
}

pub(super) fn run_calibrate(comm: &MpiComm, a: &CalibrateArgs) -> Result<i32> {
    let p = comm.size();
    let densities = parse_list(&a.densities, |s| {
        s.parse::<f64>()
            .ok()
            .filter(|d| *d > 0.0 && *d <= 1.0)
            .ok_or_else(|| Error::InvalidArgument(format!("bad density {s:?}")))
    })?;
    let max_bytes = parse_size(&a.max_bytes)?;
    let reps = a.reps.max(3);
    let ns = sizes_up_to(max_bytes);
    // A few small messages for α, then every power of two of the layer
    // range (32 KiB .. --max-bytes).
    let net_sizes: Vec<usize> = [3usize, 9, 12]
        .into_iter()
        .chain(15..=30)
        .map(|e| 1usize << e)
        .filter(|&b| b <= max_bytes.max(1 << 12))
        .collect();
    let methods = ["trimmed", "threshold", "sampled", "exact"];
    let codecs = ["fp16", "int8", "qsgd", "sbc", "3lc", "fastsgd"];
    let mut prog = Progress {
        total: 2 * net_sizes.len()
            + 2
            + densities.len() * (methods.len() + 1) * ns.len()
            + codecs.len() * ns.len(),
        done: 0,
        show: comm.rank() == 0 && !a.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    // 1. α and β. Three measurements over sizes: ping-pong between ranks 0
    // and 1 (one-way latency and bandwidth), pairwise exchange (sendrecv
    // both ways at once) and the recursive-doubling allgather. The
    // collectives the model describes are sequences of exchanges, which a
    // ping-pong does not measure (both directions at once), and the
    // allgather adds a copy of the rank's own block; so `alpha` and `beta`
    // are fitted to the exchanges, and the other two fits are kept in the
    // profile for reference.
    let (mut pp_rows, mut ex_rows, mut ag_rows) = (Vec::new(), Vec::new(), Vec::new());
    for &b in &net_sizes {
        if p > 1 {
            pp_rows.push((1.0, b as f64, pingpong(comm, b, reps)?));
            ex_rows.push((1.0, b as f64, exchange_time(comm, b, reps)?));
        }
        prog.step(&format!("ping-pong, exchange {b} B"));
        if p > 1 {
            let t = allgather_time(comm, b, reps)?;
            ag_rows.push((cost::ceil_lg(p), (p as f64 - 1.0) * b as f64, t));
        }
        prog.step(&format!("allgather {b} B"));
    }
    let (alpha, beta) = cost::fit_relative_l2(&ex_rows);
    let fit = |rows: &[(f64, f64, f64)]| {
        let (a, b) = cost::fit_relative_l2(rows);
        LinearFit { a, b }
    };
    let (pingpong_fit, allgather_fit) = (fit(&pp_rows), fit(&ag_rows));
    // 2. γ_reduce: what the allreduce costs beyond its α-β part, per
    // reduced byte. Measured on gradsync's Rabenseifner allreduce over the
    // layer sizes, minus `2⌈lg p⌉α + 2(p−1)/p·N·β` (with the fold's extra
    // term for p ≠ 2^k), fitted against the reduced bytes. This is the
    // effective γ of the reduction steps on this machine (cache effects
    // included), which a bare add loop in cache underestimates.
    let big = ns.last().copied().unwrap_or(1 << 16);
    let x = synthetic(big, "normal", 1)?;
    let mut y = vec![0f32; big];
    let mut rows = Vec::new();
    if p > 1 {
        let mut ws = Workspace::<f32>::new();
        let opts = AllreduceOptions {
            validate: false,
            ..AllreduceOptions::default()
        };
        let no_gamma = Profile::from_network(alpha, 1.0 / beta.max(1e-300), 0.0, 0.0)?;
        for &n in &ns {
            let mut t = Vec::new();
            for i in 0..=reps {
                y[..n].copy_from_slice(&x[..n]);
                comm.barrier()?;
                let t0 = mpi::time();
                allreduce_with(
                    comm,
                    &mut y[..n],
                    AllreduceAlgo::Rabenseifner,
                    &opts,
                    &mut ws,
                )?;
                if i > 0 {
                    t.push(mpi::time() - t0);
                }
            }
            let t = slowest(comm, median(&mut t));
            let bytes = (4 * n) as f64;
            let ab = cost::dense_rabenseifner(&no_gamma, bytes, p);
            let per = (p as f64 - 1.0) / p as f64 + if p.is_power_of_two() { 0.0 } else { 0.5 };
            rows.push((0.0, per * bytes, (t - ab).max(t * 1e-3)));
        }
    }
    let gamma_reduce = cost::fit_relative_l2(&rows).1;
    prog.step("gamma_reduce");
    // 3. γ_unpack: scatter-add of RGC units (1% of the elements), per unit
    // byte, over the layer sizes.
    let mut rows = Vec::new();
    for &n in &ns {
        let k = (n / 100).max(1);
        let mut codec = CodecConfig::Rgc {
            density: k as f64 / n as f64,
            method: RgcMethod::Exact,
        }
        .build()?;
        let mut unit = Vec::new();
        codec.encode(&x[..n], &mut unit)?;
        let t = local_median(reps, || codec.decode_add(&unit, &mut y[..n]))?;
        rows.push((0.0, unit.len() as f64, slowest(comm, t)));
    }
    let gamma_unpack = cost::fit_relative_l2(&rows).1;
    prog.step("gamma_unpack");
    // 4. Local cost of a sparse step per selection method and density.
    let mut select = BTreeMap::new();
    for (di, &d) in densities.iter().enumerate() {
        let mut cfgs: Vec<(String, CodecConfig)> = methods
            .iter()
            .map(|m| {
                let method: RgcMethod =
                    serde_json::from_value(serde_json::json!(m)).expect("method names parse");
                (m.to_string(), CodecConfig::Rgc { density: d, method })
            })
            .collect();
        cfgs.push(("quant".into(), CodecConfig::RgcQuant { density: d }));
        for (name, cfg) in cfgs {
            let mut pts = Vec::new();
            for &n in &ns {
                let t = slowest(comm, sparse_step_time(cfg.clone(), n, reps)?);
                pts.push((n as f64, t));
                prog.step(&format!("select {name} D={d} n={n}"));
            }
            let fit = LinearFit::fit(&pts);
            if di == 0 {
                select.insert(name.clone(), fit);
            }
            select.insert(format!("{name}@{d}"), fit);
        }
    }
    // 5. Codecs: encode / decode fits and measured size.
    let mut codec_fits = BTreeMap::new();
    for name in codecs {
        let cfg: CodecConfig = name.parse()?;
        let (mut enc, mut dec) = (Vec::new(), Vec::new());
        let mut bpe = None;
        for &n in &ns {
            let x = synthetic(n, "normal", 7)?;
            let mut c = cfg.build()?;
            let mut msg = Vec::new();
            let te = slowest(comm, local_median(reps, || c.encode(&x, &mut msg))?);
            let mut acc = vec![0f32; n];
            let td = slowest(comm, local_median(reps, || c.decode_add(&msg, &mut acc))?);
            enc.push((n as f64, te));
            dec.push((n as f64, td));
            bpe = Some((msg.len() as f64 - 12.0).max(0.0) / n as f64);
            prog.step(&format!("codec {name} n={n}"));
        }
        let data_dependent = matches!(name, "3lc" | "fastsgd");
        codec_fits.insert(
            name.to_string(),
            CodecFit {
                encode: LinearFit::fit(&enc),
                decode: LinearFit::fit(&dec),
                bytes_per_element: if data_dependent { bpe } else { None },
            },
        );
    }
    let profile = Profile {
        version: PROFILE_VERSION,
        alpha,
        beta,
        gamma_reduce,
        gamma_unpack,
        select,
        codecs: codec_fits,
        gradiveq_compress: LinearFit::default(),
        gradiveq_decompress: LinearFit::default(),
        pingpong: pingpong_fit,
        allgather: allgather_fit,
        meta: ProfileMeta {
            machine: machine(),
            mpi: mpi::environment::library_version()
                .unwrap_or_default()
                .trim_end_matches('\0')
                .to_string(),
            date: date(),
            ranks: p,
            note: a.note.clone(),
        },
    };
    profile.validate()?;
    if comm.rank() == 0 {
        profile.save(&a.out)?;
    }
    if comm.rank() == 0 {
        eprintln!(
            "calibrate: alpha {:.3e} s, beta {:.3e} s/B ({:.2} GB/s), gamma_reduce {:.3e} s/B, gamma_unpack {:.3e} s/B -> {}",
            alpha,
            beta,
            1e-9 / beta.max(1e-30),
            gamma_reduce,
            gamma_unpack,
            a.out.display()
        );
    }
    if a.check {
        let sizes = parse_list("64K,256K,1M,4M,16M", parse_size)?;
        model_check(comm, &profile, &sizes, &densities, 10, true)?;
    }
    Ok(0)
}

fn machine() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::fs::read_to_string("/proc/cpuinfo").map_or(0, |s| {
        s.lines().filter(|l| l.starts_with("processor")).count()
    });
    format!("{host}: {cpu}, {cores} cores")
}

fn date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let s = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// Arguments of `gradsync model-check`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelCheckArgs {
    /// Profile from `gradsync calibrate`.
    #[arg(long)]
    pub profile: PathBuf,
    /// Layer sizes (bytes).
    #[arg(long, default_value = "64K,256K,1M,4M,16M")]
    pub sizes: String,
    /// Densities.
    #[arg(long, default_value = "0.001,0.01")]
    pub densities: String,
    /// Timed iterations per point.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One grid point of `gradsync model-check`.
#[derive(Serialize, Debug, Clone)]
pub struct CheckRecord {
    /// Layer bytes.
    pub bytes: usize,
    /// Density of the sparse strategy.
    pub density: f64,
    /// Measured medians: dense-rabenseifner, dense-ring, sparse-allgather.
    pub measured_s: BTreeMap<String, f64>,
    /// The model's predictions for the same.
    pub predicted_s: BTreeMap<String, f64>,
    /// |predicted − measured| / measured per strategy.
    pub rel_error: BTreeMap<String, f64>,
    /// The model's (Auto's) choice.
    pub choice: String,
    /// The measured-fastest strategy.
    pub fastest: String,
    /// Measured time of the choice over the fastest (1 = right choice).
    pub choice_over_fastest: f64,
}

/// Summary line of `gradsync model-check`.
#[derive(Serialize, Debug, Clone)]
pub struct CheckSummary {
    /// Ranks.
    pub ranks: usize,
    /// Grid points.
    pub points: usize,
    /// Median relative error over all (point, strategy) pairs.
    pub median_rel_error: f64,
    /// Median relative error per strategy.
    pub median_rel_error_by_strategy: BTreeMap<String, f64>,
    /// Fraction of points where the choice is within 10% of the fastest.
    pub choice_within_10pct: f64,
}

const CHECKED: [&str; 3] = ["dense-rabenseifner", "dense-ring", "sparse-allgather"];

pub(super) fn run_model_check(comm: &MpiComm, a: &ModelCheckArgs) -> Result<i32> {
    let prof = Profile::load(&a.profile)?;
    let sizes = parse_list(&a.sizes, parse_size)?;
    let densities = parse_list(&a.densities, |s| {
        s.parse::<f64>()
            .map_err(|e| Error::InvalidArgument(format!("density {s:?}: {e}")))
    })?;
    model_check(comm, &prof, &sizes, &densities, a.iters, a.json)?;
    Ok(0)
}

fn model_check(
    comm: &MpiComm,
    prof: &Profile,
    sizes: &[usize],
    densities: &[f64],
    iters: usize,
    json: bool,
) -> Result<CheckSummary> {
    let p = comm.size();
    let iters = iters.max(3);
    let mut records = Vec::new();
    let mut ws = Workspace::<f32>::new();
    for &bytes in sizes {
        let n = bytes / 4;
        let input = synthetic(n, "normal", comm.rank() as u64 + 1)?;
        let mut buf = input.clone();
        // Dense: the collectives as `gradsync bench --op allreduce` runs them.
        let mut dense = BTreeMap::new();
        for (name, algo) in [
            ("dense-rabenseifner", AllreduceAlgo::Rabenseifner),
            ("dense-ring", AllreduceAlgo::Ring),
        ] {
            // As the engine runs its fused allreduce: no length validation.
            let opts = AllreduceOptions {
                validate: false,
                ..AllreduceOptions::default()
            };
            let mut t = Vec::new();
            for i in 0..=iters {
                buf.copy_from_slice(&input);
                comm.barrier()?;
                let t0 = mpi::time();
                allreduce_with(comm, &mut buf, algo, &opts, &mut ws)?;
                if i > 0 {
                    t.push(mpi::time() - t0);
                }
            }
            let mut m = [median(&mut t)];
            max_over_ranks(comm, &mut m);
            dense.insert(name.to_string(), m[0]);
        }
        for &d in densities {
            // Sparse: one engine step as `gradsync bench --op sparse` runs it.
            let mut s = GradSync::new(
                comm.communicator(),
                Config {
                    overlap: false,
                    ..Config::default()
                },
            )?;
            s.register_with("layer", &[n], Strategy::rgc(d))?;
            let mut w = input.clone();
            let mut t = Vec::new();
            for i in 0..=iters {
                w.copy_from_slice(&input);
                comm.barrier()?;
                let t0 = mpi::time();
                s.sync(&mut [&mut w[..]])?;
                if i > 0 {
                    t.push(mpi::time() - t0);
                }
            }
            let mut m = [median(&mut t)];
            max_over_ranks(comm, &mut m);
            let mut measured = dense.clone();
            measured.insert("sparse-allgather".into(), m[0]);
            let preds = cost::predict(
                prof,
                &Query {
                    n,
                    p,
                    density: d,
                    gradiveq_ratio: 8.0,
                },
                "trimmed",
            )?;
            let predicted: BTreeMap<String, f64> = CHECKED
                .iter()
                .map(|k| {
                    let v = preds
                        .iter()
                        .find(|x| x.name == *k)
                        .map_or(f64::NAN, |x| x.seconds);
                    (k.to_string(), v)
                })
                .collect();
            let rel_error = CHECKED
                .iter()
                .map(|k| {
                    (
                        k.to_string(),
                        (predicted[*k] - measured[*k]).abs() / measured[*k],
                    )
                })
                .collect();
            let choice = cost::choose(&preds, &CHECKED)
                .map(|c| c.name.clone())
                .unwrap_or_default();
            let fastest = CHECKED
                .iter()
                .min_by(|x, y| measured[**x].total_cmp(&measured[**y]))
                .expect("three strategies")
                .to_string();
            let rec = CheckRecord {
                bytes,
                density: d,
                choice_over_fastest: measured[&choice] / measured[&fastest],
                measured_s: measured,
                predicted_s: predicted,
                rel_error,
                choice,
                fastest,
            };
            if comm.rank() == 0 {
                if json {
                    println!("{}", serde_json::to_string(&rec)?);
                } else {
                    println!(
                        "{:>9} B D={:<6} measured rab {:>9.1} ring {:>9.1} sparse {:>9.1} us | predicted {:>9.1} {:>9.1} {:>9.1} | choice {} (x{:.2} of fastest {})",
                        bytes,
                        d,
                        rec.measured_s["dense-rabenseifner"] * 1e6,
                        rec.measured_s["dense-ring"] * 1e6,
                        rec.measured_s["sparse-allgather"] * 1e6,
                        rec.predicted_s["dense-rabenseifner"] * 1e6,
                        rec.predicted_s["dense-ring"] * 1e6,
                        rec.predicted_s["sparse-allgather"] * 1e6,
                        rec.choice,
                        rec.choice_over_fastest,
                        rec.fastest
                    );
                }
            }
            records.push(rec);
        }
    }
    let mut all: Vec<f64> = records
        .iter()
        .flat_map(|r| r.rel_error.values().copied())
        .collect();
    let by = CHECKED
        .iter()
        .map(|k| {
            let mut v: Vec<f64> = records.iter().map(|r| r.rel_error[*k]).collect();
            (k.to_string(), median(&mut v))
        })
        .collect();
    let ok = records
        .iter()
        .filter(|r| r.choice_over_fastest <= 1.10)
        .count();
    let summary = CheckSummary {
        ranks: p,
        points: records.len(),
        median_rel_error: median(&mut all),
        median_rel_error_by_strategy: by,
        choice_within_10pct: ok as f64 / records.len().max(1) as f64,
    };
    if comm.rank() == 0 {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(summary)
}
