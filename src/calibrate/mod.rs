//! Calibration: measure this machine's α, β (and β curve), γ_reduce,
//! γ_unpack and the local cost fits of the model (RedSync §5.4 and
//! Appendix B; Thakur, Rabenseifner & Gropp 2005 for the collectives) and
//! return them as a [`Profile`]; and the check of a profile's predictions
//! against measurements of the same strategies ([`model_check`]).
//!
//! [`calibrate`] is what `gradsync calibrate` runs, and what a training job
//! calls to calibrate on the ranks it already has (`--check` is
//! [`calibrate_with`] with [`CalibrateOptions::check`]). Both calls are
//! collective: every rank of the communicator calls them with the same
//! options and gets the same result. Options that are invalid on some rank,
//! or differ between ranks, are the same [`Error::RankFailed`] on every
//! rank before anything is measured ([`crate::comm::agree`]).
//!
//! # How the measurements run
//!
//! Every measurement is a *probe* that owns its buffers. Probes run in
//! *rounds*: each round runs every probe once, in a new shuffled order (the
//! same on every rank), each probe as a short warm burst (one untimed call,
//! then three timed ones). Rounds repeat for at least
//! [`CalibrateOptions::reps`] rounds and [`CalibrateOptions::min_seconds`]
//! (rank 0 decides, every rank follows), and each probe keeps the slowest
//! rank's interquartile mean over the rounds. On a shared machine whose
//! speed drifts (the 2-vCPU guests of this project move between a fast and
//! a 3–5× slower state for episodes of up to tens of seconds) this gives
//! every probe the same mix of machine states, so their means describe the
//! same machine.
//!
//! Two phases of rounds:
//!
//! 1. **Network**: ping-pong between ranks 0 and 1, pairwise exchanges
//!    (`sendrecv` both ways, one step of Rabenseifner's or recursive
//!    doubling's schedule) and the recursive-doubling allgather over powers
//!    of two up to [`CalibrateOptions::max_bytes`]; gradsync's Rabenseifner
//!    allreduce over the layer sizes; and with
//!    [`CalibrateOptions::check`] the check's probes, so the model is
//!    compared with measurements taken in the same machine states. On a
//!    job spanning several nodes, also the exchange across the link after
//!    20 ms of idling: the link's burst credit ([`crate::cost::Burst`]),
//!    fitted last.
//! 2. **Local costs**, on every rank at once (after a barrier, so ranks
//!    contend for memory bandwidth as in a real step): RGC unit
//!    scatter-adds (γ_unpack), clearing dense outputs of 4 MiB and more
//!    (γ_clear), one sparse engine step per selection method
//!    and density (the `select` fits), encode and decode of every codec.
//!
//! Then the fits: `alpha` and `beta` by relative least squares over the
//! exchanges, the β curve `(T(m) − α)/m` from 4 KiB up, γ_reduce from the
//! allreduces minus their α-β part under that curve, γ_unpack, γ_clear, and the
//! linear fits `a + b·n` of the local costs.
//!
//! Files: the probes themselves (closures that time one operation) are in
//! `probes.rs` and PowerSGD's in `lowrank.rs`; which of them a calibration
//! runs at which sizes is `plan.rs`; the rounds and the fits are `fit.rs`;
//! the check against the model (`--check`) is `check.rs`, the burst
//! credit's probe `burst.rs`.

mod burst;
mod check;
mod fit;
mod lowrank;
mod plan;
mod probes;
#[cfg(feature = "cli")]
mod state;

pub use check::{model_check, CheckRecord, CheckReport, CheckSummary, ModelCheckOptions};
/// The CLI's harness bookkeeping uses the same reduction.
#[cfg(feature = "cli")]
pub(crate) use probes::max_over_ranks;
pub use probes::{step_gradient, synthetic};
#[cfg(feature = "cli")]
pub(crate) use state::state_probes;

use crate::comm::agree::{agree_inputs, MustMatch};
use crate::comm::{MpiComm, Transport};
use crate::cost::Profile;
use crate::{Error, Result};
use probes::{rounds, sizes_up_to, Probe};

/// What [`calibrate`] measures and how long. [`Default`] is
/// `gradsync calibrate`'s defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrateOptions {
    /// Densities at which the selection costs are fitted, each in (0, 1];
    /// the first is also stored under the bare method name.
    pub densities: Vec<f64>,
    /// Largest layer of the local fits and largest network message, bytes
    /// (at least 64 KiB, the smallest layer of the fits).
    pub max_bytes: usize,
    /// Least number of measurement rounds, at least 3.
    pub reps: usize,
    /// Least seconds of network rounds (finite, ≥ 0).
    pub min_seconds: f64,
    /// Free-form note stored in the profile's `meta.note`.
    pub note: String,
    /// Also measure [`model_check`]'s default grid in the network rounds
    /// and compare it with the new profile ([`Calibration::check`]).
    pub check: bool,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        Self {
            densities: vec![0.001, 0.01],
            max_bytes: 16 << 20,
            reps: 7,
            min_seconds: 10.0,
            note: String::new(),
            check: false,
        }
    }
}

impl CalibrateOptions {
    /// Checks the options for a job of `ranks` ranks. The messages name the
    /// `gradsync calibrate` flag of each option.
    pub fn validate(&self, ranks: usize) -> Result<()> {
        if ranks < 2 {
            return Err(Error::InvalidArgument(format!(
                "calibrate needs at least 2 ranks (it runs on {ranks}): a profile's alpha and \
                 beta are measured between ranks; run it under mpirun -np 2 or more"
            )));
        }
        check_densities(&self.densities)?;
        if self.max_bytes > MAX_FIT_BYTES {
            return Err(Error::InvalidArgument(format!(
                "--max-bytes {}: at most {MAX_FIT_BYTES} (16G)",
                self.max_bytes
            )));
        }
        if sizes_up_to(self.max_bytes).is_empty() {
            return Err(Error::InvalidArgument(format!(
                "--max-bytes {}: must be at least 64K (the smallest layer of the local fits)",
                self.max_bytes
            )));
        }
        check_rounds("--reps", self.reps)?;
        check_min_seconds(self.min_seconds)
    }

    /// What every rank must pass alike (compared across ranks).
    fn must_match(&self) -> MustMatch {
        vec![
            ("subcommand", "calibrate".to_string()),
            ("--densities", format!("{:?}", self.densities)),
            ("--max-bytes", self.max_bytes.to_string()),
            ("--reps", self.reps.to_string()),
            ("--min-seconds", self.min_seconds.to_string()),
            ("--check", self.check.to_string()),
        ]
    }
}

/// Progress of a phase of measurement rounds, reported to the hook of
/// [`calibrate_with`] on every rank after every round, and once more with
/// `finished` when the phase ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// `"network"` or `"local costs"`.
    pub phase: &'static str,
    /// Rounds done so far in this phase (the first, untimed, is round 0).
    pub round: usize,
    /// Seconds since the phase began.
    pub elapsed_s: f64,
    /// Estimated fraction of the phase done, in [0, 1].
    pub fraction: f64,
    /// The phase has ended (the last report of the phase).
    pub finished: bool,
}

/// The result of [`calibrate_with`]: the same on every rank.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The new profile (validated).
    pub profile: Profile,
    /// With [`CalibrateOptions::check`]: the check's measurements, taken in
    /// the network rounds, against the new profile's predictions.
    pub check: Option<CheckReport>,
    /// Network rounds run (after the untimed first one).
    pub rounds: usize,
    /// Local-cost rounds run.
    pub local_rounds: usize,
}

/// Measures this machine and returns its [`Profile`] (collective: every
/// rank calls it with the same options and gets the same profile).
///
/// Options invalid on some rank or different between ranks return the same
/// [`Error::RankFailed`] on every rank before anything is measured.
///
/// ```no_run
/// use gradsync::comm::MpiComm;
/// use gradsync::calibrate::{calibrate, CalibrateOptions};
/// let universe = mpi::initialize().unwrap();
/// let comm = MpiComm::duplicate_of(&universe.world()).unwrap();
/// let opts = CalibrateOptions { max_bytes: 1 << 20, min_seconds: 2.0, ..Default::default() };
/// let profile = calibrate(&comm, &opts).unwrap();
/// if gradsync::comm::Transport::rank(&comm) == 0 {
///     profile.save("profile.json").unwrap();
/// }
/// ```
pub fn calibrate(comm: &MpiComm, opts: &CalibrateOptions) -> Result<Profile> {
    Ok(calibrate_with(comm, opts, &mut |_| {})?.profile)
}

/// [`calibrate`] with a progress hook (called on every rank) and the whole
/// [`Calibration`]: with [`CalibrateOptions::check`] also the check's
/// comparison, measured in the same rounds.
pub fn calibrate_with(
    comm: &MpiComm,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Calibration> {
    agree_inputs(comm, opts.validate(comm.size()), |()| opts.must_match())?;
    fit::run(comm, opts, progress)
}

/// Least rounds of [`CalibrateOptions::reps`] and
/// [`ModelCheckOptions::iters`]: an interquartile mean needs a few samples.
pub const MIN_ROUNDS: usize = 3;

/// `flag`, a number of rounds: at least [`MIN_ROUNDS`], at most the
/// rounds `--min-seconds` may add (100 000; more ran for ever).
fn check_rounds(flag: &str, n: usize) -> Result<()> {
    let max = probes::MAX_ROUNDS;
    if !(MIN_ROUNDS..=max).contains(&n) {
        return Err(Error::InvalidArgument(format!(
            "{flag} {n}: must be at least {MIN_ROUNDS} and at most {max}"
        )));
    }
    Ok(())
}

/// The largest layer `--max-bytes` may ask the local fits for (16 GiB per
/// rank, several buffers of it: past any node's memory for a probe).
pub const MAX_FIT_BYTES: usize = 16 << 30;

/// `--densities`: a non-empty list of numbers in (0, 1].
fn check_densities(v: &[f64]) -> Result<()> {
    if v.is_empty() {
        return Err(Error::InvalidArgument(
            "--densities: no densities given".into(),
        ));
    }
    if let Some(d) = v.iter().find(|d| !(**d > 0.0 && **d <= 1.0)) {
        return Err(Error::InvalidArgument(format!(
            "--densities: density {d} is not in (0, 1]"
        )));
    }
    Ok(())
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

/// Mean of the middle half of the samples (the interquartile mean; the
/// median for fewer than 4).
///
/// The statistic of the calibration and the check. Where a machine runs in
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

/// Median (NaN for no samples); sorts `v`.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

/// Runs `probes` in rounds, reporting each round to `progress` as `phase`.
fn phase(
    comm: &MpiComm,
    probes: &mut [Probe<'_>],
    min_rounds: usize,
    min_seconds: f64,
    seed: u64,
    name: &'static str,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(Vec<f64>, usize)> {
    log::trace!("calibrate: the {name} phase is round set {seed}");
    let mut last = (0, 0.0);
    let fraction = |r: usize, t: f64| {
        (r as f64 / min_rounds.max(1) as f64)
            .max(if min_seconds > 0.0 {
                t / min_seconds
            } else {
                1.0
            })
            .min(1.0)
    };
    let out = rounds(comm, probes, min_rounds, min_seconds, seed, |r, t| {
        last = (r, t);
        progress(&Progress {
            phase: name,
            round: r,
            elapsed_s: t,
            fraction: fraction(r, t),
            finished: false,
        });
    })?;
    progress(&Progress {
        phase: name,
        round: last.0,
        elapsed_s: last.1,
        fraction: 1.0,
        finished: true,
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn median_of_odd_and_even_lengths() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn options_name_their_flags() {
        let ok = CalibrateOptions::default();
        assert!(ok.validate(2).is_ok());
        let msg = |o: CalibrateOptions, p: usize| o.validate(p).unwrap_err().to_string();
        assert!(msg(ok.clone(), 1).contains("at least 2 ranks"));
        let o = CalibrateOptions {
            reps: 1,
            ..ok.clone()
        };
        assert!(msg(o, 2).contains("--reps 1: must be at least 3"));
        let o = CalibrateOptions {
            densities: vec![0.1, 2.0],
            ..ok.clone()
        };
        assert!(msg(o, 2).contains("--densities: density 2 is not in (0, 1]"));
        let o = CalibrateOptions {
            max_bytes: 1024,
            ..ok.clone()
        };
        assert!(msg(o, 2).contains("--max-bytes 1024: must be at least 64K"));
        let o = CalibrateOptions {
            min_seconds: f64::NAN,
            ..ok
        };
        assert!(msg(o, 2).contains("--min-seconds NaN"));
    }
}
