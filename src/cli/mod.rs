//! The `gradsync` command line. Under `mpirun`/`srun`: `bench` (OSU-style
//! benchmarks against the MPI library's own collectives), `verify` (every
//! collective checked against `MPI_Allreduce`/`MPI_Allgatherv`),
//! `calibrate` (a cost-model profile of this machine) and `model-check`.
//! Without MPI: the cost model's `predict`, `plan`, `crossover` and
//! `scale`, and `codecs` (each codec's bound on synthetic gradients).

/// `println!` that returns an error (the enclosing function's `?`) where
/// standard output cannot be written (a full disk, a closed pipe), instead
/// of panicking: under `mpirun` a panic aborted the job, alone it printed a
/// backtrace.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($t)*).map_err(crate::cli::stdout_error)?
    }};
}

/// `eprintln!` that ignores a closed or full stderr (`eprintln!` panics
/// there, which would turn an error exit into a panic: exit 101, or an
/// `MPI_Abort` under mpirun).
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

/// `eprint!`, likewise ([`errln`]).
macro_rules! err {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr().lock(), $($t)*);
    }};
}

/// `print!`, likewise ([`outln`]).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($t)*).map_err(crate::cli::stdout_error)?
    }};
}

/// The error of [`outln`] and [`out`].
pub(crate) fn stdout_error(e: std::io::Error) -> Error {
    Error::file("standard output", format!("cannot write: {e}"))
}

mod bench;
mod calibrate;
mod codecs;
mod gradiveq_bench;
mod model;
mod scale;
mod sparse_allreduce_bench;
mod sparse_bench;
mod step_bench;
mod step_record;
mod verify;

pub(crate) use crate::calibrate::max_over_ranks;
use crate::comm::MpiComm;
use crate::{Error, Result};
use clap::{Parser, Subcommand};
use mpi::topology::{Communicator, SimpleCommunicator};

/// A synthetic gradient-like tensor (the library's [`crate::calibrate::synthetic`]).
pub use crate::calibrate::synthetic;
pub use crate::calibrate::{CheckRecord, CheckSummary};
pub use bench::BenchArgs;
pub use calibrate::{CalibrateArgs, ModelCheckArgs};
pub use codecs::{measure, read_npy, CodecRecord, CodecsArgs};
pub use gradiveq_bench::GradiveqRecord;
pub use model::{
    plan_record, predict_record, read_layers, CrossoverArgs, LayerSpec, ModelArgs, PlanArgs,
    PredictArgs, PredictRecord,
};
pub use scale::{parse_ranks, scale_record, ScaleArgs, ScaleRecord};
pub use sparse_bench::SparseRecord;
pub use step_record::{StepGroupRecord, StepLayerRecord, StepRecord};
pub use verify::VerifyArgs;

/// gradsync: gradient synchronization for data-parallel training over MPI.
#[derive(Parser, Debug)]
#[command(name = "gradsync", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Benchmark collectives against the MPI library's own (run under mpirun).
    Bench(BenchArgs),
    /// Check every collective against MPI_Allreduce / MPI_Allgatherv (run under mpirun).
    Verify(VerifyArgs),
    /// Ratio, error and throughput of the compression codecs (no MPI needed).
    Codecs(CodecsArgs),
    /// Measure this machine's α, β, γ and local cost fits; write a profile (run under mpirun).
    Calibrate(CalibrateArgs),
    /// A profile's predictions against measurements, and the model's choices (run under mpirun).
    ModelCheck(ModelCheckArgs),
    /// Predicted synchronization time of one layer per strategy (α-β-γ model; no MPI).
    Predict(PredictArgs),
    /// Per-layer strategy choice and total step time for a model's layer table (no MPI).
    Plan(PlanArgs),
    /// Layer size at which sparse beats dense, with an optional SVG plot (no MPI).
    Crossover(CrossoverArgs),
    /// Predicted step sync time per strategy against the number of ranks, on
    /// nodes of --ranks-per-node ranks, with an optional SVG plot (no MPI).
    Scale(ScaleArgs),
}

/// Entry point of the binary; returns the process exit code.
pub fn main() -> i32 {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Under a launcher, bad arguments on one rank end the job: say
            // which rank, then MPI_Abort. Exiting alone is not enough:
            // Open MPI's mpirun ends the job when a rank exits before
            // MPI_Init, but MPICH's Hydra leaves its peers waiting in
            // MPI_Init for ever.
            // Only for the subcommands that start MPI: a command of the
            // model (plan, predict, ...) run from inside a rank inherits
            // the launcher's variables and must not join its job.
            if e.use_stderr() {
                if let Some(rank) = launcher_rank() {
                    errln!(
                        "gradsync: rank {rank} (from the launcher's environment): bad arguments:"
                    );
                    if !names_a_no_mpi_command(std::env::args().skip(1)) {
                        let _ = e.print();
                        abort_job(e.exit_code());
                    }
                }
            }
            e.exit()
        }
    };
    let no_mpi = match &cli.command {
        Command::Codecs(a) => Some(codecs::run(a)),
        Command::Predict(a) => Some(model::run_predict(a)),
        Command::Plan(a) => Some(model::run_plan(a)),
        Command::Crossover(a) => Some(model::run_crossover(a)),
        Command::Scale(a) => Some(scale::run(a)),
        _ => None,
    };
    if let Some(r) = no_mpi {
        return r.unwrap_or_else(|e| {
            errln!("gradsync: {e}");
            1
        });
    }
    // Serialized: the engine's progress thread may communicate while the
    // main thread computes (`bench --op sparse --overlap`).
    let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Serialized) else {
        errln!("gradsync: MPI was already initialized");
        return 2;
    };
    let world = universe.world();
    install_abort_on_panic();
    let code = match run(&cli, &world) {
        Ok(code) => code,
        Err(e) if e.is_collective() => {
            // Every rank returned this error at the same point (the failure
            // model, `crate::comm::agree`): no peer is left in a collective, so
            // finalizing is safe. One rank prints it for the job.
            if world.rank() == 0 {
                errln!("gradsync: {e}");
            }
            1
        }
        Err(e) => {
            // Possibly this rank alone: a peer may be blocked in a
            // collective, and MPI_Finalize would hang next to it.
            abort_world(&world, &format!("{e}"))
        }
    };
    drop(world);
    drop(universe);
    code
}

/// The command line as [`Cli`], with `bench`'s flags given on the command
/// line recorded ([`BenchArgs::given`]).
fn parse() -> std::result::Result<Cli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let cmd = Cli::command();
    let m = cmd.clone().try_get_matches()?;
    let mut cli = Cli::from_arg_matches(&m)?;
    if let (Command::Bench(a), Some(("bench", sub)), Some(bench)) = (
        &mut cli.command,
        m.subcommand(),
        cmd.find_subcommand("bench"),
    ) {
        // The arguments only (the matches also hold the struct's group).
        a.given = bench
            .get_arguments()
            .map(|arg| arg.get_id().as_str())
            .filter(|id| sub.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .map(str::to_string)
            .collect();
    }
    Ok(cli)
}

/// This process's rank as its launcher exported it, before MPI is up:
/// Open MPI, PMIx (srun --mpi=pmix), MPICH/Hydra and PMI-2. Not
/// `SLURM_PROCID`: a batch script has it too, outside any launch.
fn launcher_rank() -> Option<String> {
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|r| !r.is_empty()))
}

/// The subcommands that never start MPI.
const NO_MPI_COMMANDS: [&str; 5] = ["codecs", "predict", "plan", "crossover", "scale"];

/// Whether the command line's first word (its subcommand, as typed) is one
/// that never starts MPI.
fn names_a_no_mpi_command(mut args: impl Iterator<Item = String>) -> bool {
    args.next()
        .is_some_and(|a| NO_MPI_COMMANDS.contains(&a.as_str()))
}

/// Initialize MPI and end the whole job with `MPI_Abort(code)`: for a
/// rank that must stop before running anything (its peers are, or soon
/// will be, in `MPI_Init` or a collective).
fn abort_job(code: i32) -> ! {
    use mpi::raw::AsRaw;
    if let Some(universe) = mpi::initialize() {
        let world = universe.world();
        // SAFETY: MPI is up and `world` is live.
        unsafe { crate::comm::abort_raw(world.as_raw(), code) };
    }
    std::process::exit(code)
}

/// `MPI_Abort` on `MPI_COMM_WORLD` after printing `msg` with this rank.
fn abort_world(world: &SimpleCommunicator, msg: &str) -> ! {
    use mpi::raw::AsRaw;
    errln!(
        "gradsync: rank {} of {}: {msg}; aborting the job (MPI_Abort)",
        world.rank(),
        world.size()
    );
    // SAFETY: MPI is up and `world` is live.
    unsafe { crate::comm::abort_raw(world.as_raw(), 1) }
}

/// A panic on one rank (a bug) ends the whole job with `MPI_Abort` instead of
/// leaving its peers in a collective.
fn install_abort_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
            let rank = {
                let mut r: std::os::raw::c_int = -1;
                // SAFETY: MPI is initialized; RSMPI_COMM_WORLD is a valid handle.
                unsafe { mpi::ffi::MPI_Comm_rank(mpi::ffi::RSMPI_COMM_WORLD, &mut r) };
                r
            };
            errln!("gradsync: rank {rank}: panic; aborting the job (MPI_Abort)");
            // SAFETY: as above; MPI_Abort ends every process of the job.
            unsafe { crate::comm::abort_raw(mpi::ffi::RSMPI_COMM_WORLD, 70) };
        }
    }));
}

fn run(cli: &Cli, world: &SimpleCommunicator) -> Result<i32> {
    let comm = MpiComm::duplicate_of(world)?;
    // Every rank runs the same subcommand, checked before any of them
    // communicates: two subcommands' first collectives differ, so ranks
    // that disagree would otherwise wait in different ones for ever.
    let name = match &cli.command {
        Command::Bench(_) => "bench",
        Command::Verify(_) => "verify",
        Command::Calibrate(_) => "calibrate",
        Command::ModelCheck(_) => "model-check",
        Command::Codecs(_) => "codecs",
        Command::Predict(_) => "predict",
        Command::Plan(_) => "plan",
        Command::Crossover(_) => "crossover",
        Command::Scale(_) => "scale",
    };
    crate::comm::agree::same_on_every_rank(&comm, &[("subcommand", name.to_string())])?;
    match &cli.command {
        Command::Bench(a) => match a.op.as_str() {
            "sparse" => sparse_bench::run(&comm, a),
            "sparse-allreduce" => sparse_allreduce_bench::run(&comm, a),
            "gradiveq" => gradiveq_bench::run(&comm, a),
            "step" => step_bench::run(&comm, a),
            _ => bench::run(&comm, a),
        },
        Command::Verify(a) => verify::run(&comm, a),
        Command::Calibrate(a) => calibrate::run_calibrate(&comm, a),
        Command::ModelCheck(a) => calibrate::run_model_check(&comm, a),
        // Normally run before MPI initialization (see `main`).
        Command::Codecs(a) => codecs::run(a),
        Command::Predict(a) => model::run_predict(a),
        Command::Plan(a) => model::run_plan(a),
        Command::Crossover(a) => model::run_crossover(a),
        Command::Scale(a) => scale::run(a),
    }
}

/// Parse a byte size such as `4K`, `64k`, `1M`, `2G` or `100` (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|v| v.checked_mul(mult))
        .ok_or_else(|| Error::InvalidArgument(format!("bad size {s:?} (e.g. 4K, 1M, 2G, 100)")))
}

/// Parse a comma-separated list with `f` (empty for a blank string; one
/// trailing comma allowed; an empty item elsewhere, as in `4K,,8K`, is an
/// error).
pub(crate) fn parse_list<T>(s: &str, f: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    crate::cost::decide::split_list(s)?
        .into_iter()
        .map(f)
        .collect()
}

/// A plot's tick label: three significant digits (whole numbers up to
/// 9999 in full), `0.3` and `6e-4` rather than plotters'
/// `0.30000000000000004` and `0.0006000000000000001`.
/// A number as a person reads it: as written between 10^-4 and 10^15,
/// else in scientific notation (`1e-308`, not 300 digits).
pub(crate) fn short_float(x: f64) -> String {
    if x == 0.0 || !x.is_finite() || (1e-4..1e15).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

pub(crate) fn tick_label(v: f64) -> String {
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    let a = v.abs();
    if a == 0.0 || !a.is_finite() {
        return format!("{v}");
    }
    if (0.01..10_000.0).contains(&a) {
        let digits = (2 - a.log10().floor() as i32).clamp(0, 4) as usize;
        trim(&format!("{v:.digits$}"))
    } else {
        let s = format!("{v:.2e}");
        let (mant, exp) = s.split_once('e').expect("an exponent");
        format!("{}e{exp}", trim(mant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The commands that never start MPI are named as clap spells them,
    /// and only they: bad arguments to any other one under a launcher end
    /// the job with MPI_Abort.
    #[test]
    fn no_mpi_commands_are_real_subcommands() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        for name in NO_MPI_COMMANDS {
            assert!(cmd.find_subcommand(name).is_some(), "{name}");
        }
        let words = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(names_a_no_mpi_command(
            words(&["plan", "--bad"]).into_iter()
        ));
        assert!(!names_a_no_mpi_command(
            words(&["bench", "--itres", "1"]).into_iter()
        ));
        assert!(!names_a_no_mpi_command(words(&["--bogus"]).into_iter()));
        assert!(!names_a_no_mpi_command(std::iter::empty()));
    }

    #[test]
    fn tick_labels_are_short() {
        for (v, want) in [
            (0.30000000000000004, "0.3"),
            (0.0006000000000000001, "6e-4"),
            (9.999999999999999e-6, "1e-5"),
            (1.5e-3, "1.5e-3"),
            (64.0, "64"),
            (1024.0, "1024"),
            (12.3456, "12.3"),
            (1048576.0, "1.05e6"),
            (0.0, "0"),
        ] {
            assert_eq!(tick_label(v), want, "{v}");
        }
    }
    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64k").unwrap(), 65536);
        assert_eq!(parse_size("16M").unwrap(), 16 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("4X").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn lists_refuse_empty_items_but_a_trailing_comma() {
        let p = |s: &str| parse_list(s, parse_size);
        assert_eq!(p("4K,8K").unwrap(), [4096, 8192]);
        assert_eq!(p("4K, 8K,").unwrap(), [4096, 8192]);
        assert!(
            p(" ").unwrap().is_empty(),
            "blank: no items (the caller says what is missing)"
        );
        for bad in ["4K,,8K", ",", ",4K", " , ", "4K,,"] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("empty item"), "{bad:?}: {e}");
        }
    }
}
