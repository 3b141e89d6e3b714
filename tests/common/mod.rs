//! Helpers shared by the integration tests: find the binaries, run one MPI
//! job at a time under `mpirun` with a time limit.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub fn gradsync() -> &'static str {
    env!("CARGO_BIN_EXE_gradsync")
}

/// Run the `gradsync` command with `args` (no MPI); returns (exit ok,
/// stdout, stderr).
pub fn run_gradsync(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(gradsync())
        .args(args)
        .output()
        .expect("run gradsync");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn example(name: &str) -> PathBuf {
    Path::new(gradsync())
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

/// One MPI job at a time: concurrent oversubscribed jobs on a 2-core machine
/// slow each other down by orders of magnitude.
pub static MPI_JOBS: Mutex<()> = Mutex::new(());

/// Run `prog args` on `np` ranks ([`mpirun_command`]); returns (exit ok,
/// stdout, stderr).
pub fn mpirun(np: usize, prog: &Path, args: &[&str], limit: Duration) -> (bool, String, String) {
    mpirun_env(np, prog, args, &[], limit)
}

/// [`mpirun`] with `env` set for mpirun and so for every (local) rank.
pub fn mpirun_env(
    np: usize,
    prog: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> (bool, String, String) {
    let _one_job = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let mut cmd = mpirun_command(np);
    cmd.args(["-np", &np.to_string()]);
    cmd.arg(prog).args(args).envs(env.iter().copied());
    let what = format!("mpirun -np {np} {} {args:?}", prog.display());
    run_limited(cmd, limit, &what)
}

/// The MPI library whose `mpirun` is on `PATH`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// Open MPI (`mpirun (Open MPI) 4.1.4`).
    OpenMpi,
    /// MPICH's Hydra (`HYDRA build details`), or anything else.
    Mpich,
}

/// Which `mpirun` this is, asked once (`mpirun --version`).
pub fn flavor() -> Flavor {
    static FLAVOR: std::sync::OnceLock<Flavor> = std::sync::OnceLock::new();
    *FLAVOR.get_or_init(|| {
        let out = Command::new("mpirun")
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("mpirun --version: {e}: run hpc/setup.sh to install MPI"));
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if text.contains("Open MPI") || text.contains("OpenRTE") {
            Flavor::OpenMpi
        } else {
            Flavor::Mpich
        }
    })
}

/// `mpirun` with what a job of `np` ranks needs on this machine, before
/// its `-np` and program (or its first `-np` of an MPMD line). Open MPI:
/// root allowed, no binding, oversubscription allowed, and with more
/// ranks than cores the TCP BTL over loopback (spinning shared-memory
/// transfers crawl when peers are descheduled: 13 s against 3.5 s for the
/// same job here); they test correctness only. MPICH's Hydra needs none
/// of these: it runs as root, binds nothing and oversubscribes by default,
/// and passes the whole environment to the ranks.
pub fn mpirun_command(np: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    if flavor() == Flavor::OpenMpi {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cmd.args(["--oversubscribe", "--bind-to", "none"]);
        if np > cores {
            cmd.args(["--mca", "btl", "self,tcp"]);
        }
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd
}

/// Run `cmd` (an mpirun job) with a time limit; returns (exit ok, stdout,
/// stderr). Past the limit it kills the command and panics with `what`
/// and its stderr.
pub fn run_limited(mut cmd: Command, limit: Duration, what: &str) -> (bool, String, String) {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| {
        panic!("{what}: cannot start ({e}): run hpc/setup.sh to install Open MPI")
    });
    // Drain both pipes while the job runs: a job that writes more than a
    // pipe holds (64 KiB; a RUST_LOG run's stderr) would otherwise block
    // in its writes and look like a hang at the time limit.
    type Sink = std::sync::Arc<Mutex<Vec<u8>>>;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        let (sink, (tx, rx)): (Sink, _) = (Default::default(), std::sync::mpsc::channel());
        let s = std::sync::Arc::clone(&sink);
        std::thread::spawn(move || {
            let mut chunk = [0u8; 65536];
            if let Some(mut p) = pipe {
                loop {
                    match p.read(&mut chunk) {
                        Ok(0) => break,
                        Ok(k) => s
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .extend_from_slice(&chunk[..k]),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            }
            let _ = tx.send(());
        });
        (sink, rx)
    };
    let out_pipe = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err_pipe = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    // What a pipe held: a rank that outlived mpirun may keep it open, so
    // wait a bounded time for its end, then take what came.
    let text = |(sink, rx): (Sink, std::sync::mpsc::Receiver<()>)| {
        let ended = rx.recv_timeout(Duration::from_secs(10)).is_ok();
        let b = sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut t = String::from_utf8_lossy(&b).into_owned();
        if !ended {
            t.push_str("\n[still open 10 s after mpirun ended: the output above is what came]\n");
        }
        t
    };
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            // SIGTERM first: mpirun then ends its ranks too.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let t = Instant::now();
            while child.try_wait().ok().flatten().is_none() && t.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not finish in {limit:?} (hang?)\n{}",
                text(err_pipe)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.success(), text(out_pipe), text(err_pipe))
}

/// A minimal version-1.0 .npy writer: `descr` (e.g. `<f4`), shape, raw data.
pub fn write_npy(path: &std::path::Path, descr: &str, fortran: bool, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let fo = if fortran { "True" } else { "False" };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': {fo}, 'shape': {shape_s}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write npy");
}

/// Little-endian f64, C order.
pub fn write_npy_f64(path: &std::path::Path, shape: &[usize], data: &[f64]) {
    let b: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_npy(path, "<f8", false, shape, &b);
}

/// Little-endian f32, C order.
pub fn write_npy_f32(path: &std::path::Path, shape: &[usize], data: &[f32]) {
    let b: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_npy(path, "<f4", false, shape, &b);
}
