//! The check: a profile's predictions against measurements of the same
//! strategies, and how often the model's choice is the measured-fastest
//! (`gradsync model-check`, `gradsync calibrate --check`).

use super::probes::{exchange_time, rounds, synthetic, Probe};
use super::{check_densities, check_min_seconds, check_rounds, median};
use crate::comm::agree::{agree_inputs, MustMatch};
use crate::comm::{MpiComm, Transport};
use crate::cost::{self, Profile, Query, StrategyId};
use crate::dense::{allreduce_with, AllreduceAlgo, AllreduceOptions, Workspace};
use crate::sync::{Config, GradSync, Strategy};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// What [`model_check`] measures. [`Default`] is `gradsync model-check`'s
/// defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCheckOptions {
    /// Layer sizes, bytes (each a non-zero multiple of 4).
    pub sizes: Vec<usize>,
    /// Densities of the sparse strategy, each in (0, 1].
    pub densities: Vec<f64>,
    /// Least number of rounds, at least 3.
    pub iters: usize,
    /// Least seconds of rounds (finite, ≥ 0).
    pub min_seconds: f64,
}

/// The layer sizes of [`ModelCheckOptions::default`] and of
/// `calibrate --check`, bytes: 64 KiB, 256 KiB, 1, 4 and 16 MiB.
pub(super) const CHECK_SIZES: [usize; 5] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

impl Default for ModelCheckOptions {
    fn default() -> Self {
        Self {
            sizes: CHECK_SIZES.to_vec(),
            densities: vec![0.001, 0.01],
            iters: 10,
            min_seconds: 10.0,
        }
    }
}

impl ModelCheckOptions {
    /// Checks the options; the messages name `gradsync model-check`'s flags.
    pub fn validate(&self) -> Result<()> {
        if let Some(b) = self.sizes.iter().find(|&&b| b > super::MAX_FIT_BYTES) {
            return Err(Error::InvalidArgument(format!(
                "--sizes: {b} bytes is past {} (16G)",
                super::MAX_FIT_BYTES
            )));
        }
        if self.sizes.is_empty() {
            return Err(Error::InvalidArgument("--sizes: no sizes given".into()));
        }
        if self.sizes.contains(&0) {
            return Err(Error::InvalidArgument(
                "--sizes: a layer needs at least one element (4 bytes)".into(),
            ));
        }
        if let Some(b) = self.sizes.iter().find(|&&b| b % 4 != 0) {
            return Err(Error::InvalidArgument(format!(
                "--sizes: {b} bytes is not a whole number of 4-byte elements (a multiple of 4)"
            )));
        }
        check_densities(&self.densities)?;
        check_rounds("--iters", self.iters)?;
        check_min_seconds(self.min_seconds)
    }
}

/// The result of a check: one record per (size, density), then the summary.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// One per grid point, sizes outer, densities inner.
    pub records: Vec<CheckRecord>,
    /// Over all records.
    pub summary: CheckSummary,
}

impl CheckSummary {
    /// Whether the 64 KiB exchange measured now is more than 1.5× off the
    /// profile's (either way): the machine is not in the state it was
    /// calibrated in, and the predictions are off by about that factor.
    pub fn state_differs(&self) -> bool {
        let (now, then) = (self.exchange_64k_s, self.exchange_64k_profile_s);
        self.ranks > 1 && !(then / 1.5..=then * 1.5).contains(&now)
    }
}

/// Measures the checked strategies (Rabenseifner, ring, one sparse engine
/// step per density) over the grid of `opts` in shuffled rounds and
/// compares them with `prof`'s predictions (collective: every rank calls
/// it with the same profile and options and gets the same report).
///
/// A profile or options that differ between ranks, or are invalid on one,
/// return the same [`Error::RankFailed`] on every rank before anything is
/// measured.
pub fn model_check(
    comm: &MpiComm,
    prof: &Profile,
    opts: &ModelCheckOptions,
) -> Result<CheckReport> {
    // The predictions first, against placeholder measurements: a profile
    // whose constants overflow a prediction fails here, on every rank
    // alike, not after the measuring (it aborted the job then).
    let local = prof
        .validate()
        .and_then(|()| opts.validate())
        .and_then(|()| {
            // The grid's points, then the state probe (`check_probes`' layout).
            let placeholder = vec![1.0; opts.sizes.len() * (2 + opts.densities.len()) + 1];
            compare(
                comm.size(),
                prof,
                &opts.sizes,
                &opts.densities,
                &placeholder,
            )
            .map(|_| ())
        });
    agree_inputs(comm, local, |()| {
        use std::hash::{Hash, Hasher};
        // Fixed keys: the same on every rank.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        serde_json::to_string(prof).unwrap_or_default().hash(&mut h);
        let m: MustMatch = vec![
            ("subcommand", "model-check".to_string()),
            ("--profile (contents hash)", format!("{:016x}", h.finish())),
            ("--sizes", format!("{:?}", opts.sizes)),
            ("--densities", format!("{:?}", opts.densities)),
            ("--iters", opts.iters.to_string()),
            ("--min-seconds", opts.min_seconds.to_string()),
        ];
        m
    })?;
    let mut probes = check_probes(comm, &opts.sizes, &opts.densities)?;
    let (med, _) = rounds(
        comm,
        &mut probes,
        opts.iters,
        opts.min_seconds,
        2,
        |_, _| {},
    )?;
    drop(probes);
    compare(comm.size(), prof, &opts.sizes, &opts.densities, &med)
}

/// One grid point of [`model_check`] (a JSON line of `gradsync model-check
/// --json`).
#[derive(Serialize, Debug, Clone, PartialEq)]
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

/// Summary of [`model_check`] (the last line of `gradsync model-check`).
#[derive(Serialize, Debug, Clone, PartialEq)]
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
    /// in the state it was calibrated in (see `docs/benchmarks/cost-model.md`).
    pub exchange_64k_profile_s: f64,
}

/// Bytes of the state probe of the check.
const STATE_PROBE_BYTES: usize = 65536;

/// The strategies the check measures and chooses among.
const CHECKED: [StrategyId; 3] = [
    StrategyId::DenseRabenseifner,
    StrategyId::DenseRing,
    StrategyId::SparseAllgather,
];

/// The probes of the check: for every size, Rabenseifner, ring, and one
/// sparse engine step (RGC) per density, in that order.
pub(super) fn check_probes<'a>(
    comm: &'a MpiComm,
    sizes: &[usize],
    densities: &[f64],
) -> Result<Vec<Probe<'a>>> {
    // Dense: the collectives as `gradsync bench --op allreduce` runs them,
    // without length validation as the engine runs its fused allreduce;
    // sparse: one engine step per density as `gradsync bench --op sparse`
    // runs it. Fresh data (the rank's synthetic gradient, rotated each
    // step: `step_gradient`) before each.
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
            let mut step = 0;
            probes.push(Box::new(move |_| {
                // Each step its own gradient, as in training.
                super::step_gradient(&mut buf, &input, step);
                step += 1;
                comm.barrier()?;
                let t0 = mpi::time();
                s.sync(&mut [&mut buf[..]])?;
                Ok(mpi::time() - t0)
            }));
        }
    }
    // Last: the state probe, one exchange as the calibration measures it.
    let (mut send, mut recv) = (vec![0u8; STATE_PROBE_BYTES], vec![0u8; STATE_PROBE_BYTES]);
    probes.push(Box::new(move |r| {
        exchange_time(comm, &mut send, &mut recv, r)
    }));
    Ok(probes)
}

/// Compares the check probes' means `med` (layout of [`check_probes`])
/// with the profile's predictions for `p` ranks.
pub(super) fn compare(
    p: usize,
    prof: &Profile,
    sizes: &[usize],
    densities: &[f64],
    med: &[f64],
) -> Result<CheckReport> {
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
                    at: crate::cost::Placement {
                        p,
                        ranks_per_node: None,
                        fill: None,
                        ..crate::cost::Placement::default()
                    },
                    n,
                    density: d,
                    gradiveq_ratio: crate::cost::GRADIVEQ_RATIO,
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
    let summary = CheckSummary {
        ranks: p,
        points: records.len(),
        median_rel_error: median(&mut all),
        median_rel_error_by_strategy: by,
        choice_within_10pct: ok as f64 / records.len().max(1) as f64,
        exchange_64k_s: now,
        exchange_64k_profile_s: then,
    };
    Ok(CheckReport { records, summary })
}
