//! `gradsync calibrate` (measure this machine's α, β, γ's and local cost
//! fits, write a [`Profile`]) and `gradsync model-check` (the profile's
//! predictions against measurements of the same strategies, and how often
//! the model's choice is the measured-fastest). Both run under `mpirun`.
//!
//! Every measurement is a *probe* that owns its buffers. Probes run in
//! rounds, each round in a new shuffled order and each probe as a short
//! warm burst, for at least `--min-seconds` (see `rounds` for why a shared
//! machine needs this), and the slowest rank's interquartile mean is kept.
//! Local costs are measured on every rank at once (so ranks contend for
//! memory bandwidth as they do in a real step). With `calibrate --check`
//! the check's probes share the network probes' rounds, so the model is
//! compared with measurements taken in the same machine states.

use super::bench::{agree_inputs, flag_error, median, parse_sizes, MustMatch};
use super::{max_over_ranks, parse_list, parse_size, synthetic};
use crate::codec::{CodecConfig, RgcMethod};
use crate::comm::tags;
use crate::comm::{LocalComm, MpiComm, Transport};
use crate::cost::StrategyId;
use crate::cost::{self, CodecFit, LinearFit, Profile, ProfileMeta, Query, PROFILE_VERSION};
use crate::dense::{
    allgatherv_with, allreduce_with, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Gathered,
    Workspace,
};
use crate::failure::agree;
use crate::sync::{Config, GradSync, Strategy};
use crate::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
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
    /// Least number of measurement rounds, at least 3 (each round times
    /// every probe 3 times after a warm-up call; interquartile means over
    /// the rounds).
    #[arg(long, default_value_t = 7)]
    pub reps: usize,
    /// Free-form note stored in the profile (e.g. "netem 1gbit").
    #[arg(long, default_value = "")]
    pub note: String,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Also measure `model-check`'s grid in the same rounds as the network
    /// probes and print its comparison with the new profile (JSON lines).
    #[arg(long)]
    pub check: bool,
    /// Spread the network, allreduce (and check) measurements over at
    /// least this many seconds of shuffled rounds, so that a machine whose
    /// speed drifts is sampled alike by every probe.
    #[arg(long, default_value_t = 10.0)]
    pub min_seconds: f64,
}

/// One measurement of a calibration or check round: this rank's seconds (0
/// where the rank takes no part). Each probe owns its buffers.
type Probe<'a> = Box<dyn FnMut(usize) -> Result<f64> + 'a>;

/// A local measurement run on every rank at once (after a barrier, so the
/// ranks contend for memory bandwidth as they do in a real step).
fn local<'a>(comm: &'a MpiComm, mut f: impl FnMut() -> Result<()> + 'a) -> Probe<'a> {
    Box::new(move |_| {
        comm.barrier()?;
        let t0 = Instant::now();
        f()?;
        Ok(t0.elapsed().as_secs_f64())
    })
}

/// Runs every probe once per round until at least `min_rounds` rounds and
/// `min_seconds` have passed (rank 0 decides, every rank follows), after
/// one untimed round. Returns each probe's [`interquartile_mean`], the
/// slowest rank's, and
/// the number of rounds; `on_round(round, seconds)` reports progress.
///
/// Every round runs all probes in a new order, the same on every rank.
/// This is what makes a calibration on a shared machine repeatable. On the
/// 2-vCPU KVM guests of this project the two vCPUs share a core complex
/// most of the time and sit in different ones, where cache-to-cache
/// transfers are 3–5× slower, for episodes of a fraction of a second to
/// tens of seconds. Measuring one size after the other catches an episode
/// in some sizes and not in others, and a calibration followed by a check
/// compares two different machines. Rounds spread over seconds give every
/// probe the same mix of states, so their medians describe the same
/// machine, and the shuffled order stops one probe from always following
/// the one that filled the caches (a fixed order cost one strategy 40 %).
fn rounds(
    comm: &MpiComm,
    probes: &mut [Probe<'_>],
    min_rounds: usize,
    min_seconds: f64,
    seed: u64,
    mut on_round: impl FnMut(usize, f64),
) -> Result<(Vec<f64>, usize)> {
    if probes.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); probes.len()];
    let mut order: Vec<usize> = (0..probes.len()).collect();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut round = 0;
    loop {
        order.shuffle(&mut rng);
        for &i in &order {
            // A short burst, as `gradsync bench` and a training loop run
            // them back to back: the first call warms the caches (a probe
            // right after another one's 16 MiB finds them full of that
            // data), the next BURST are timed.
            for b in 0..=BURST {
                let x = probes[i](round * (BURST + 1) + b)?;
                if round > 0 && b > 0 {
                    t[i].push(x);
                }
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        on_round(round, elapsed);
        let more = round < min_rounds || (elapsed < min_seconds && round < MAX_ROUNDS);
        let mut flag = [if comm.rank() == 0 && more { 1.0 } else { 0.0 }];
        max_over_ranks(comm, &mut flag);
        if flag[0] == 0.0 {
            break;
        }
        round += 1;
    }
    let mut med: Vec<f64> = t.iter_mut().map(|v| interquartile_mean(v)).collect();
    max_over_ranks(comm, &mut med);
    Ok((med, round))
}

/// Mean of the middle half of the samples (the interquartile mean; the
/// median for fewer than 4).
///
/// The statistic of `calibrate` and `model-check`. Where a machine runs in
/// two states (here a fast and a 3–5× slower one), the median of a probe
/// jumps from one state to the other as the share of slow samples crosses
/// one half, so two probes measured in the same rounds, say Rabenseifner
/// and the ring with identical schedules at p = 2, could differ by 40 %.
/// The interquartile mean moves continuously with that share, and like the
/// median it ignores the quarter of outliers at either end (preempted
/// calls).
pub(crate) fn interquartile_mean(v: &mut [f64]) -> f64 {
    if v.len() < 4 {
        return median(v);
    }
    v.sort_by(f64::total_cmp);
    let q = v.len() / 4;
    let mid = &v[q..v.len() - q];
    mid.iter().sum::<f64>() / mid.len() as f64
}

/// Upper bound on measurement rounds, whatever `--min-seconds` says.
const MAX_ROUNDS: usize = 100_000;

/// Timed calls of a probe per round (after one untimed call).
const BURST: usize = 3;

/// One-way time of a message between ranks 0 and 1 (ping-pong / 2).
fn pingpong(comm: &MpiComm, buf: &mut [u8]) -> Result<f64> {
    let rank = comm.rank();
    comm.barrier()?;
    let t0 = mpi::time();
    match rank {
        0 => {
            comm.send(buf, 1, tags::CALIBRATE_PINGPONG)?;
            comm.recv(buf, 1, tags::CALIBRATE_PINGPONG)?;
        }
        1 => {
            comm.recv(buf, 0, tags::CALIBRATE_PINGPONG)?;
            comm.send(buf, 0, tags::CALIBRATE_PINGPONG)?;
        }
        _ => return Ok(0.0),
    }
    Ok((mpi::time() - t0) / 2.0)
}

/// Time of a pairwise exchange (`sendrecv` of the buffer each way between
/// ranks `2i` and `2i+1`): one step of Rabenseifner's or recursive
/// doubling's schedule, `α + bytes·β` in the model.
fn exchange_time(comm: &MpiComm, send: &mut [u8], recv: &mut [u8], round: usize) -> Result<f64> {
    let (rank, p) = (comm.rank(), comm.size());
    let peer = rank ^ 1;
    // Fresh data every time, as a gradient is: the sender's cache holds the
    // lines modified, so the copy pays the cache-to-cache transfer that a
    // collective's steps pay (a send buffer that never changes ends up
    // cached on both cores and measures a local copy: 2-4x too fast here).
    send.fill(round as u8);
    comm.barrier()?;
    let t0 = mpi::time();
    if peer >= p {
        return Ok(0.0);
    }
    comm.sendrecv(send, peer, recv, peer, tags::CALIBRATE_EXCHANGE)?;
    Ok(mpi::time() - t0)
}

/// Time of the recursive-doubling allgather of the buffer (fresh data).
fn allgather_time(comm: &MpiComm, send: &mut [u8], g: &mut Gathered, round: usize) -> Result<f64> {
    send.fill(round as u8);
    comm.barrier()?;
    let t0 = mpi::time();
    allgatherv_with(comm, send, AllgathervAlgo::RecursiveDoubling, g)?;
    Ok(mpi::time() - t0)
}

/// Local cost of one sparse engine step (one rank, in process): residual
/// accumulation, selection, packing, zeroing and unpacking its own unit.
fn sparse_step_probe(comm: &MpiComm, codec: CodecConfig, n: usize) -> Result<Probe<'_>> {
    let mut s = GradSync::with_transport(
        LocalComm::create(1).pop().expect("one rank"),
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
    Ok(local(comm, move || {
        w.copy_from_slice(&g);
        s.sync(&mut [&mut w[..]]).map(|_| ())
    }))
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

/// `--densities`: a non-empty list of numbers in (0, 1].
fn parse_densities(s: &str) -> Result<Vec<f64>> {
    let v = parse_list(s, |x| {
        x.parse::<f64>()
            .ok()
            .filter(|d| *d > 0.0 && *d <= 1.0)
            .ok_or_else(|| Error::InvalidArgument(format!("density {x:?} is not in (0, 1]")))
    })
    .map_err(|e| flag_error(format!("--densities {s:?}"), e))?;
    if v.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--densities {s:?}: no densities given"
        )));
    }
    Ok(v)
}

/// `--min-seconds`: finite and ≥ 0.
fn check_min_seconds(s: f64) -> Result<()> {
    if s.is_finite() && s >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "--min-seconds {s}: must be a finite number of seconds ≥ 0"
        )))
    }
}

/// Least rounds of `calibrate --reps` and `model-check --iters`: an
/// interquartile mean needs a few samples.
const MIN_ROUNDS: usize = 3;

/// Fails now, naming the file, if the profile cannot be written to `out`
/// (rather than after minutes of measuring). Leaves an existing file as it
/// is and no new file behind.
fn check_writable(out: &std::path::Path) -> Result<()> {
    let existed = out.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(out)
        .map_err(|e| Error::file(out, format!("--out: cannot write the profile: {e}")))?;
    if !existed {
        std::fs::remove_file(out)
            .map_err(|e| Error::file(out, format!("--out: cannot remove the test file: {e}")))?;
    }
    Ok(())
}

/// The rank-local input phase of `calibrate`: (densities, max bytes).
fn calibrate_inputs(a: &CalibrateArgs, rank: usize, p: usize) -> Result<(Vec<f64>, usize)> {
    if p < 2 {
        return Err(Error::InvalidArgument(format!(
            "calibrate needs at least 2 ranks (it runs on {p}): a profile's alpha and beta are \
             measured between ranks; run it under mpirun -np 2 or more"
        )));
    }
    let densities = parse_densities(&a.densities)?;
    let max_bytes = parse_size(&a.max_bytes).map_err(|e| flag_error("--max-bytes", e))?;
    if sizes_up_to(max_bytes).is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--max-bytes {}: must be at least 64K (the smallest layer of the local fits)",
            a.max_bytes
        )));
    }
    if a.reps < MIN_ROUNDS {
        return Err(Error::InvalidArgument(format!(
            "--reps {}: must be at least {MIN_ROUNDS}",
            a.reps
        )));
    }
    check_min_seconds(a.min_seconds)?;
    if rank == 0 {
        check_writable(&a.out)?;
    }
    Ok((densities, max_bytes))
}

pub(super) fn run_calibrate(comm: &MpiComm, a: &CalibrateArgs) -> Result<i32> {
    let p = comm.size();
    let (densities, max_bytes) = agree_inputs(
        comm,
        calibrate_inputs(a, comm.rank(), p),
        |(densities, max_bytes)| {
            vec![
                ("subcommand", "calibrate".to_string()),
                ("--densities", format!("{densities:?}")),
                ("--max-bytes", max_bytes.to_string()),
                ("--reps", a.reps.to_string()),
                ("--min-seconds", a.min_seconds.to_string()),
                ("--check", a.check.to_string()),
            ]
        },
    )?;
    let reps = a.reps;
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
    let show = comm.rank() == 0 && !a.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let x = synthetic(ns.last().copied().unwrap_or(1 << 16), "normal", 1)?;
    // Every measurement is a probe. Two phases of rounds: the network
    // probes, the allreduces and (with `--check`) the check's, then the
    // local costs (see below).
    let mut probes: Vec<Probe<'_>> = Vec::new();
    // 1. α and β. Three measurements over sizes: ping-pong between ranks 0
    // and 1 (one-way latency and bandwidth), pairwise exchange (sendrecv
    // both ways at once) and the recursive-doubling allgather. The
    // collectives the model describes are sequences of exchanges, which a
    // ping-pong does not measure (both directions at once), and the
    // allgather adds a copy of the rank's own block; so `alpha` and `beta`
    // are fitted to the exchanges, and the other two fits are kept in the
    // profile for reference. The β curve is the exchanges' per-byte cost
    // at each size from 4 KiB up, `(T(m) − α)/m`.
    let net = if p > 1 { net_sizes.len() } else { 0 };
    for &b in &net_sizes[..net] {
        let mut buf = vec![0u8; b];
        probes.push(Box::new(move |_| pingpong(comm, &mut buf)));
    }
    for &b in &net_sizes[..net] {
        let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
        probes.push(Box::new(move |r| {
            exchange_time(comm, &mut send, &mut recv, r)
        }));
    }
    for &b in &net_sizes[..net] {
        let (mut send, mut g) = (vec![0u8; b], Gathered::default());
        probes.push(Box::new(move |r| {
            allgather_time(comm, &mut send, &mut g, r)
        }));
    }
    // 2. γ_reduce: what the allreduce costs beyond its α-β part, per
    // reduced byte. Measured on gradsync's Rabenseifner allreduce over the
    // layer sizes (fresh data each time), minus its α-β part under the β
    // curve, fitted against the reduced bytes. This is the effective γ of
    // the reduction steps on this machine (cache effects included), which
    // a bare add loop in cache underestimates.
    let reduce_at = probes.len();
    for &n in if p > 1 { &ns[..] } else { &[] } {
        let (x, mut y, mut ws) = (x[..n].to_vec(), vec![0f32; n], Workspace::<f32>::new());
        probes.push(Box::new(move |_| {
            y.copy_from_slice(&x);
            comm.barrier()?;
            let t0 = mpi::time();
            let opts = AllreduceOptions {
                validate: false,
                ..AllreduceOptions::default()
            };
            allreduce_with(comm, &mut y, AllreduceAlgo::Rabenseifner, &opts, &mut ws)?;
            Ok(mpi::time() - t0)
        }));
    }
    // The network probes, the allreduces and the check's measurements
    // share rounds of a few hundred milliseconds for at least
    // `--min-seconds`, so each gets dozens of samples from the same mix of
    // machine states. The local costs come after, in their own rounds (a
    // few seconds each at 16 MiB layers), with their own buffers: run
    // first, they left the network phase 2-3x slower than the same probes
    // in a `model-check` job (measured; a guess at the cause: these VMs
    // report freed memory to the host through virtio-balloon free page
    // reporting, and the gigabyte the local probes free comes back slower).
    let check_at = probes.len();
    let check_sizes = parse_list("64K,256K,1M,4M,16M", parse_size)?;
    if a.check {
        probes.extend(check_probes(comm, &check_sizes, &densities)?);
    }
    let progress = |phase: &'static str, min_rounds: usize, min_s: f64| {
        move |r: usize, t: f64| {
            if show {
                let f = (r as f64 / min_rounds.max(1) as f64)
                    .max(if min_s > 0.0 { t / min_s } else { 1.0 })
                    .min(1.0);
                let w = 30;
                let filled = (f * w as f64) as usize;
                eprint!(
                    "\r{phase:<14} [{}{}] {:>3.0}% round {r}, {t:.1} s   ",
                    "#".repeat(filled),
                    ".".repeat(w - filled),
                    100.0 * f
                );
            }
        }
    };
    let (remote_med, nrounds) = rounds(
        comm,
        &mut probes,
        reps,
        a.min_seconds,
        1,
        progress("network", reps, a.min_seconds),
    )?;
    drop(probes);
    if show {
        eprintln!();
    }
    let mut local_probes: Vec<Probe<'_>> = Vec::new();
    // 3. γ_unpack: scatter-add of RGC units (1% of the elements), per unit
    // byte, over the layer sizes.
    let mut unit_bytes = Vec::new();
    for &n in &ns {
        let k = (n / 100).max(1);
        let mut codec = CodecConfig::Rgc {
            density: k as f64 / n as f64,
            method: RgcMethod::Exact,
        }
        .build()?;
        let mut unit = Vec::new();
        codec.encode(&x[..n], &mut unit)?;
        unit_bytes.push(unit.len() as f64);
        let mut y = vec![0f32; n];
        local_probes.push(local(comm, move || codec.decode_add(&unit, &mut y)));
    }
    // 4. Local cost of a sparse step per selection method and density.
    let select_at = local_probes.len();
    let mut select_names = Vec::new();
    for &d in &densities {
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
            for &n in &ns {
                local_probes.push(sparse_step_probe(comm, cfg.clone(), n)?);
            }
            select_names.push((name, d));
        }
    }
    // 5. Codecs: encode / decode fits and measured size.
    let codec_at = local_probes.len();
    let mut codec_bpe = Vec::new();
    for name in codecs {
        let cfg: CodecConfig = name.parse()?;
        let mut bpe = 0.0;
        for &n in &ns {
            let xn = synthetic(n, "normal", 7)?;
            let mut enc = cfg.build()?;
            let mut msg = Vec::new();
            enc.encode(&xn, &mut msg)?;
            bpe = (msg.len() as f64 - 12.0).max(0.0) / n as f64;
            let dec = cfg.build()?;
            let mut acc = vec![0f32; n];
            let mut out = Vec::new();
            local_probes.push(local(comm, move || enc.encode(&xn, &mut out)));
            local_probes.push(local(comm, move || dec.decode_add(&msg, &mut acc)));
        }
        codec_bpe.push(bpe);
    }
    let (local_med, local_rounds) = rounds(
        comm,
        &mut local_probes,
        reps,
        0.0,
        3,
        progress("local costs", reps, 0.0),
    )?;
    drop(local_probes);
    if show {
        eprintln!();
    }
    log::debug!("calibrate: {local_rounds} rounds of local costs");
    log::debug!("calibrate: {nrounds} rounds");
    let (mut pp_rows, mut ex_rows, mut ag_rows) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &b) in net_sizes[..net].iter().enumerate() {
        let (pp, ex, ag) = (remote_med[i], remote_med[net + i], remote_med[2 * net + i]);
        log::debug!(
            "calibrate: {b} B ping-pong {pp:.3e} s, exchange {ex:.3e} s, allgather {ag:.3e} s"
        );
        let bf = b as f64;
        pp_rows.push((1.0, bf, pp));
        ex_rows.push((1.0, bf, ex));
        ag_rows.push((cost::ceil_lg(p), (p as f64 - 1.0) * bf, ag));
    }
    let (alpha, beta) = cost::fit_relative_l2(&ex_rows);
    let beta_curve: Vec<cost::CurvePoint> = ex_rows
        .iter()
        .filter(|r| r.1 >= 4096.0)
        .map(|&(_, b, t)| cost::CurvePoint {
            bytes: b,
            per_byte: ((t - alpha) / b).max(0.0),
        })
        .collect();
    let fit = |rows: &[(f64, f64, f64)]| {
        let (a, b) = cost::fit_relative_l2(rows);
        LinearFit { a, b }
    };
    let (pingpong_fit, allgather_fit) = (fit(&pp_rows), fit(&ag_rows));
    let mut rows = Vec::new();
    if p > 1 {
        let mut no_gamma = Profile::from_network(alpha, 1.0 / beta.max(1e-300), 0.0, 0.0)?;
        no_gamma.beta_curve = beta_curve.clone();
        let mut unit_gamma = no_gamma.clone();
        unit_gamma.gamma_reduce = 1.0;
        for (i, &n) in ns.iter().enumerate() {
            let (bytes, t) = ((4 * n) as f64, remote_med[reduce_at + i]);
            log::debug!("calibrate: rabenseifner allreduce {bytes} B {t:.3e} s");
            let ab = cost::dense_rabenseifner(&no_gamma, bytes, p);
            let per = cost::dense_rabenseifner(&unit_gamma, bytes, p) - ab;
            rows.push((0.0, per, (t - ab).max(t * 1e-3)));
        }
    }
    let gamma_reduce = cost::fit_relative_l2(&rows).1;
    let rows: Vec<(f64, f64, f64)> = unit_bytes
        .iter()
        .enumerate()
        .map(|(i, &u)| (0.0, u, local_med[i]))
        .collect();
    let gamma_unpack = cost::fit_relative_l2(&rows).1;
    let mut select = BTreeMap::new();
    for (c, (name, d)) in select_names.iter().enumerate() {
        let pts: Vec<(f64, f64)> = ns
            .iter()
            .enumerate()
            .map(|(i, &n)| (n as f64, local_med[select_at + c * ns.len() + i]))
            .collect();
        let fit = LinearFit::fit(&pts);
        if *d == densities[0] {
            select.insert(name.clone(), fit);
        }
        select.insert(format!("{name}@{d}"), fit);
    }
    let mut codec_fits = BTreeMap::new();
    for (c, name) in codecs.iter().enumerate() {
        let base = codec_at + 2 * c * ns.len();
        let (mut enc, mut dec) = (Vec::new(), Vec::new());
        for (i, &n) in ns.iter().enumerate() {
            enc.push((n as f64, local_med[base + 2 * i]));
            dec.push((n as f64, local_med[base + 2 * i + 1]));
        }
        let data_dependent = matches!(*name, "3lc" | "fastsgd");
        codec_fits.insert(
            name.to_string(),
            CodecFit {
                encode: LinearFit::fit(&enc),
                decode: LinearFit::fit(&dec),
                bytes_per_element: data_dependent.then_some(codec_bpe[c]),
            },
        );
    }
    let profile = Profile {
        version: PROFILE_VERSION,
        alpha,
        beta,
        gamma_reduce,
        gamma_unpack,
        beta_curve,
        gamma_reduce_curve: Vec::new(),
        select,
        codecs: codec_fits,
        dense_local: LinearFit::default(),
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
    // Every rank learns whether rank 0 could write it.
    agree(
        comm,
        if comm.rank() == 0 {
            profile.save(&a.out)
        } else {
            Ok(())
        },
    )?;
    if comm.rank() == 0 {
        eprintln!(
            "calibrate: alpha {:.3e} s, beta {:.3e} s/B ({:.2} GB/s), gamma_reduce {:.3e} s/B, gamma_unpack {:.3e} s/B, {nrounds} rounds -> {}",
            alpha,
            beta,
            1e-9 / beta.max(1e-30),
            gamma_reduce,
            gamma_unpack,
            a.out.display()
        );
    }
    if a.check {
        check_report(
            comm,
            &profile,
            &check_sizes,
            &densities,
            &remote_med[check_at..],
            true,
        )?;
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
    /// Least number of rounds (each times every point 3 times after a
    /// warm-up call; interquartile means over the rounds).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Spread the measurements over at least this many seconds (rounds
    /// over every size and strategy).
    #[arg(long, default_value_t = 10.0)]
    pub min_seconds: f64,
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
    /// A 64 KiB pairwise exchange measured with the check (ranks 0 and 1;
    /// 0 on one rank): the machine's state now...
    pub exchange_64k_s: f64,
    /// ...and the profile's `α + β(64 KiB)·64 KiB`, the calibration's
    /// measurement of the same. A ratio far from 1 means the machine is not
    /// in the state it was calibrated in (see `docs/benchmarks.md`).
    pub exchange_64k_profile_s: f64,
}

/// Bytes of the state probe of `model-check`.
const STATE_PROBE_BYTES: usize = 65536;

/// The strategies `calibrate --check` and `model-check` measure and choose among.
const CHECKED: [StrategyId; 3] = [
    StrategyId::DenseRabenseifner,
    StrategyId::DenseRing,
    StrategyId::SparseAllgather,
];

/// The rank-local input phase of `model-check`: (profile, sizes, densities).
fn model_check_inputs(a: &ModelCheckArgs) -> Result<(Profile, Vec<usize>, Vec<f64>)> {
    let prof = Profile::load(&a.profile)?;
    let sizes = parse_sizes("--sizes", &a.sizes, 4)?;
    if sizes.contains(&0) {
        return Err(Error::InvalidArgument(
            "--sizes: a layer needs at least one element (4 bytes)".into(),
        ));
    }
    let densities = parse_densities(&a.densities)?;
    if a.iters < MIN_ROUNDS {
        return Err(Error::InvalidArgument(format!(
            "--iters {}: must be at least {MIN_ROUNDS}",
            a.iters
        )));
    }
    check_min_seconds(a.min_seconds)?;
    Ok((prof, sizes, densities))
}

pub(super) fn run_model_check(comm: &MpiComm, a: &ModelCheckArgs) -> Result<i32> {
    let (prof, sizes, densities) =
        agree_inputs(comm, model_check_inputs(a), |(prof, sizes, densities)| {
            use std::hash::{Hash, Hasher};
            // Fixed keys: the same on every rank.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            serde_json::to_string(prof).unwrap_or_default().hash(&mut h);
            let m: MustMatch = vec![
                ("subcommand", "model-check".to_string()),
                ("--profile (contents hash)", format!("{:016x}", h.finish())),
                ("--sizes", format!("{sizes:?}")),
                ("--densities", format!("{densities:?}")),
                ("--iters", a.iters.to_string()),
                ("--min-seconds", a.min_seconds.to_string()),
            ];
            m
        })?;
    model_check(
        comm,
        &prof,
        &sizes,
        &densities,
        a.iters,
        a.min_seconds,
        a.json,
    )?;
    Ok(0)
}

/// The probes of `model-check`: for every size, Rabenseifner, ring, and one
/// sparse engine step (RGC) per density, in that order.
fn check_probes<'a>(
    comm: &'a MpiComm,
    sizes: &[usize],
    densities: &[f64],
) -> Result<Vec<Probe<'a>>> {
    // Dense: the collectives as `gradsync bench --op allreduce` runs them,
    // without length validation as the engine runs its fused allreduce;
    // sparse: one engine step per density as `gradsync bench --op sparse`
    // runs it. Fresh data (the rank's synthetic gradient) before each.
    let mut probes: Vec<Probe<'a>> = Vec::new();
    for &bytes in sizes {
        let n = bytes / 4;
        let input = synthetic(n, "normal", comm.rank() as u64 + 1)?;
        for algo in [AllreduceAlgo::Rabenseifner, AllreduceAlgo::Ring] {
            let (input, mut buf, mut ws) = (input.clone(), input.clone(), Workspace::new());
            probes.push(Box::new(move |_| {
                buf.copy_from_slice(&input);
                comm.barrier()?;
                let t0 = mpi::time();
                let opts = AllreduceOptions {
                    validate: false,
                    ..AllreduceOptions::default()
                };
                allreduce_with(comm, &mut buf, algo, &opts, &mut ws)?;
                Ok(mpi::time() - t0)
            }));
        }
        for &d in densities {
            let mut s = GradSync::new(
                comm.communicator(),
                Config {
                    overlap: false,
                    ..Config::default()
                },
            )?;
            s.register_with("layer", &[n], Strategy::rgc(d))?;
            let (input, mut buf) = (input.clone(), input.clone());
            probes.push(Box::new(move |_| {
                buf.copy_from_slice(&input);
                comm.barrier()?;
                let t0 = mpi::time();
                s.sync(&mut [&mut buf[..]])?;
                Ok(mpi::time() - t0)
            }));
        }
    }
    // Last: the state probe, one exchange as `calibrate` measures it.
    let (mut send, mut recv) = (vec![0u8; STATE_PROBE_BYTES], vec![0u8; STATE_PROBE_BYTES]);
    probes.push(Box::new(move |r| {
        exchange_time(comm, &mut send, &mut recv, r)
    }));
    Ok(probes)
}

fn model_check(
    comm: &MpiComm,
    prof: &Profile,
    sizes: &[usize],
    densities: &[f64],
    iters: usize,
    min_seconds: f64,
    json: bool,
) -> Result<CheckSummary> {
    let mut probes = check_probes(comm, sizes, densities)?;
    let (med, _) = rounds(comm, &mut probes, iters, min_seconds, 2, |_, _| {})?;
    drop(probes);
    check_report(comm, prof, sizes, densities, &med, json)
}

/// Compare the check probes' medians `med` (layout of [`check_probes`])
/// with the profile's predictions; print records and the summary.
fn check_report(
    comm: &MpiComm,
    prof: &Profile,
    sizes: &[usize],
    densities: &[f64],
    med: &[f64],
    json: bool,
) -> Result<CheckSummary> {
    let p = comm.size();
    let per = 2 + densities.len();
    let mut records = Vec::new();
    for (si, &bytes) in sizes.iter().enumerate() {
        let n = bytes / 4;
        let mut dense = BTreeMap::new();
        dense.insert("dense-rabenseifner".to_string(), med[si * per]);
        dense.insert("dense-ring".to_string(), med[si * per + 1]);
        for (di, &d) in densities.iter().enumerate() {
            let m = [med[si * per + 2 + di]];
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
                        .find(|x| x.id == *k)
                        .map_or(f64::NAN, |x| x.seconds);
                    (k.name().to_string(), v)
                })
                .collect();
            let rel_error = CHECKED
                .iter()
                .map(|k| {
                    let k = k.name();
                    (
                        k.to_string(),
                        (predicted[k] - measured[k]).abs() / measured[k],
                    )
                })
                .collect();
            let choice = cost::choose(&preds, &CHECKED)
                .map(|c| c.name.clone())
                .unwrap_or_default();
            let fastest = CHECKED
                .iter()
                .min_by(|x, y| measured[x.name()].total_cmp(&measured[y.name()]))
                .expect("three strategies")
                .name()
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
            let mut v: Vec<f64> = records.iter().map(|r| r.rel_error[k.name()]).collect();
            (k.name().to_string(), median(&mut v))
        })
        .collect();
    let ok = records
        .iter()
        .filter(|r| r.choice_over_fastest <= 1.10)
        .count();
    let m = STATE_PROBE_BYTES as f64;
    let (now, then) = (
        med[sizes.len() * per],
        if p > 1 {
            prof.alpha + m * prof.beta_at(m)
        } else {
            0.0
        },
    );
    if comm.rank() == 0 && p > 1 && !(then / 1.5..=then * 1.5).contains(&now) {
        log::warn!(
            "model-check: a 64 KiB exchange takes {:.1} us now and took {:.1} us in the calibration: \
             the machine is not in the state it was calibrated in, so the predictions are off by \
             about that factor (re-calibrate, or use `calibrate --check`)",
            now * 1e6,
            then * 1e6
        );
    }
    let summary = CheckSummary {
        ranks: p,
        points: records.len(),
        median_rel_error: median(&mut all),
        median_rel_error_by_strategy: by,
        choice_within_10pct: ok as f64 / records.len().max(1) as f64,
        exchange_64k_s: now,
        exchange_64k_profile_s: then,
    };
    if comm.rank() == 0 {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::interquartile_mean;

    #[test]
    fn interquartile_mean_drops_a_quarter_at_each_end() {
        assert_eq!(interquartile_mean(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(
            interquartile_mean(&mut [100.0, 1.0, 2.0, 3.0, 4.0, 0.0, 5.0, 6.0]),
            3.5
        );
        // Moves continuously with the share of slow samples, unlike the median.
        let mix = |slow: usize| {
            let mut v: Vec<f64> = (0..20).map(|i| if i < slow { 3.0 } else { 1.0 }).collect();
            interquartile_mean(&mut v)
        };
        assert_eq!(mix(0), 1.0);
        assert!(mix(9) > 1.0 && mix(9) < mix(11) && mix(11) < 3.0);
        assert!(interquartile_mean(&mut []).is_nan());
    }
}
