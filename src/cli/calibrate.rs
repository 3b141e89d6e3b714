//! `gradsync calibrate` (measure this machine's α, β, γ's and local cost
//! fits, write a [`Profile`](crate::cost::Profile)) and `gradsync
//! model-check` (the profile's predictions against measurements of the same
//! strategies, and how often the model's choice is the measured-fastest).
//! Both run under `mpirun`.
//!
//! The measurements and fits are the library's ([`crate::calibrate::calibrate_with`],
//! [`cost::model_check`]; their module docs say how the rounds run): here
//! the flags are parsed into their options, and the results saved and
//! printed.

use super::bench::{flag_error, parse_sizes};
use super::{parse_list, parse_size};
use crate::calibrate::{
    self as cal_lib, CalibrateOptions, CheckReport, ModelCheckOptions, Progress,
};
use crate::comm::agree::agree;
use crate::comm::{MpiComm, Transport};
use crate::cost::Profile;
use crate::{Error, Result};
use std::path::PathBuf;

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

/// Fails now, naming the file, if the profile cannot be written to `out`
/// (rather than after minutes of measuring): it is written through a
/// temporary file beside its target and a rename (`Profile::save`), so
/// this creates and removes one such file. Leaves an existing file as it
/// is and no new file behind.
pub(super) fn check_writable(out: &std::path::Path, flag: &str) -> Result<()> {
    // Opening a FIFO blocks (rank 0 alone, its peers waiting), the rename
    // would replace a special file, and a read-only file is kept.
    let (target, _) = crate::error::replace_target(out)
        .map_err(|e| Error::file(out, format!("{flag}: cannot write the profile: {e}")))?;
    let (tmp, _) = crate::error::create_temp_beside(&target)
        .map_err(|e| Error::file(out, format!("{flag}: cannot write the profile: {e}")))?;
    std::fs::remove_file(&tmp)
        .map_err(|e| Error::file(&tmp, format!("{flag}: cannot remove the test file: {e}")))
}

/// The rank-local input phase of `calibrate`: the flags as options,
/// validated, and (rank 0) the output file writable.
fn calibrate_inputs(a: &CalibrateArgs, rank: usize, p: usize) -> Result<CalibrateOptions> {
    let opts = CalibrateOptions {
        densities: parse_densities(&a.densities)?,
        max_bytes: parse_size(&a.max_bytes).map_err(|e| flag_error("--max-bytes", e))?,
        reps: a.reps,
        min_seconds: a.min_seconds,
        note: a.note.clone(),
        check: a.check,
    };
    opts.validate(p).map_err(|e| match e {
        // The flag's value as given (`1K`), not in bytes.
        Error::InvalidArgument(m) => Error::InvalidArgument(
            match m.strip_prefix(&format!("--max-bytes {}:", opts.max_bytes)) {
                Some(rest) => format!("--max-bytes {}:{rest}", a.max_bytes),
                None => m,
            },
        ),
        e => e,
    })?;
    if rank == 0 {
        check_writable(&a.out, "--out")?;
    }
    Ok(opts)
}

pub(super) fn run_calibrate(comm: &MpiComm, a: &CalibrateArgs) -> Result<i32> {
    // Every rank fails alike on a flag that is bad on some rank; the
    // library then checks that every rank passes the same options.
    let opts = agree(comm, calibrate_inputs(a, comm.rank(), comm.size()))?;
    let show = comm.rank() == 0 && !a.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut bar = |pr: &Progress| {
        if !show {
            return;
        }
        if pr.finished {
            errln!();
            return;
        }
        let w = 30;
        let filled = (pr.fraction * w as f64) as usize;
        err!(
            "\r{:<14} [{}{}] {:>3.0}% round {}, {:.1} s   ",
            pr.phase,
            "#".repeat(filled),
            ".".repeat(w - filled),
            100.0 * pr.fraction,
            pr.round,
            pr.elapsed_s
        );
    };
    let cal = cal_lib::calibrate_with(comm, &opts, &mut bar)?;
    let (profile, nrounds) = (&cal.profile, cal.rounds);
    let (alpha, beta, gamma_reduce, gamma_unpack) = (
        profile.alpha,
        profile.beta,
        profile.gamma_reduce,
        profile.gamma_unpack,
    );
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
        errln!(
            "calibrate: alpha {:.3e} s, beta {:.3e} s/B ({:.2} GB/s), gamma_reduce {:.3e} s/B, gamma_unpack {:.3e} s/B, {nrounds} rounds -> {}",
            alpha,
            beta,
            1e-9 / beta.max(1e-30),
            gamma_reduce,
            gamma_unpack,
            a.out.display()
        );
        if let Some(e) = &profile.inter_node {
            let burst = e.burst.map_or(String::new(), |b| {
                format!(
                    "; after idling, the first {:.0} KB each way at {:.3e} s/B (burst credit)",
                    b.bytes / 1e3,
                    b.beta
                )
            });
            errln!(
                "calibrate: between nodes alpha {:.3e} s, beta {:.3e} s/B ({:.2} GB/s){burst}",
                e.alpha,
                e.beta,
                1e-9 / e.beta.max(1e-30),
            );
        }
    }
    if let Some(check) = &cal.check {
        print_check(comm, check, true)?;
    }
    Ok(0)
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

/// The rank-local input phase of `model-check`: (profile, options).
fn model_check_inputs(a: &ModelCheckArgs, p: usize) -> Result<(Profile, ModelCheckOptions)> {
    if p < 2 {
        // As calibrate: one rank has no network to check the model on
        // (it printed a 395× error against 0-second exchanges).
        return Err(Error::InvalidArgument(format!(
            "model-check needs at least 2 ranks (it runs on {p}): the model's predictions \
             are checked against exchanges between ranks; run it under mpirun -np 2 or more"
        )));
    }
    let prof = Profile::load(&a.profile)?;
    let opts = ModelCheckOptions {
        sizes: parse_sizes("--sizes", &a.sizes, 4)?,
        densities: parse_densities(&a.densities)?,
        iters: a.iters,
        min_seconds: a.min_seconds,
    };
    opts.validate()?;
    Ok((prof, opts))
}

pub(super) fn run_model_check(comm: &MpiComm, a: &ModelCheckArgs) -> Result<i32> {
    let (prof, opts) = agree(comm, model_check_inputs(a, comm.size()))?;
    let report = cal_lib::model_check(comm, &prof, &opts)?;
    print_check(comm, &report, a.json)?;
    Ok(0)
}

/// Rank 0 prints the check's records (JSON lines or a table), a warning
/// when the machine is not in the state it was calibrated in, and the
/// summary (a JSON line).
fn print_check(comm: &MpiComm, report: &CheckReport, json: bool) -> Result<()> {
    if comm.rank() != 0 {
        return Ok(());
    }
    for rec in &report.records {
        if json {
            outln!("{}", serde_json::to_string(rec)?);
        } else {
            outln!(
                "{:>9} B D={:<6} measured rab {:>9.1} ring {:>9.1} sparse {:>9.1} us | predicted {:>9.1} {:>9.1} {:>9.1} | choice {} (x{:.2} of fastest {})",
                rec.bytes,
                rec.density,
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
    let s = &report.summary;
    if s.state_differs() {
        log::warn!(
            "model-check: a 64 KiB exchange takes {:.1} us now and took {:.1} us in the calibration: \
             the machine is not in the state it was calibrated in, so the predictions are off by \
             about that factor (re-calibrate, or use `calibrate --check`)",
            s.exchange_64k_s * 1e6,
            s.exchange_64k_profile_s * 1e6
        );
    }
    outln!("{}", serde_json::to_string(s)?);
    Ok(())
}
