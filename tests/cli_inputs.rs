//! The CLI's input phase under real `mpirun`: flags and files
//! that are bad on some ranks, or differ between the ranks of an MPMD launch
//! (`mpirun -np 1 gradsync ... : -np 1 gradsync ...`), end the job within
//! seconds with a non-zero status and one message naming the rank, the flag
//! or file, and the cause. Every job runs under a time limit: a hang fails
//! the test instead of blocking it.

mod common;

use common::MPI_JOBS;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Time limit of one job: every job here ends in seconds unless it hangs.
const LIMIT: Duration = Duration::from_secs(60);

struct Job {
    ok: bool,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// `mpirun` with one application context per segment (`np`, arguments of
/// `gradsync`), joined by `:`; panics if it runs past [`LIMIT`].
fn mpmd(segments: &[(usize, &[&str])]) -> Job {
    let _one = MPI_JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let np: usize = segments.iter().map(|s| s.0).sum();
    let mut cmd = common::mpirun_command(np);
    for (i, (n, args)) in segments.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", &n.to_string(), env!("CARGO_BIN_EXE_gradsync")])
            .args(*args);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .expect("mpirun not found: run hpc/setup.sh to install Open MPI");
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            r.read_to_string(&mut s).ok();
            s
        })
    };
    let out = reader(Box::new(child.stdout.take().unwrap()));
    let err = reader(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > LIMIT {
            // SIGTERM first: mpirun then ends its ranks too.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{segments:?} did not finish in {LIMIT:?} (hang)\n{}",
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Job {
        ok: status.success(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        elapsed: start.elapsed(),
    }
}

/// One SPMD job of `np` ranks.
fn mpirun(np: usize, args: &[&str]) -> Job {
    mpmd(&[(np, args)])
}

/// Asserts the job failed and its stderr holds every `want`.
fn assert_fails_with(job: &Job, what: &str, wants: &[&str]) {
    assert!(!job.ok, "{what}: succeeded\n{}\n{}", job.stdout, job.stderr);
    for w in wants {
        assert!(
            job.stderr.contains(w),
            "{what}: {w:?} not in stderr:\n{}",
            job.stderr
        );
    }
}

/// Asserts the failure was agreed (every rank returned it; rank 0 printed
/// it once), not an `MPI_Abort` of one rank.
fn assert_agreed(job: &Job, what: &str) {
    assert!(
        !job.stderr.contains("MPI_Abort"),
        "{what}: aborted instead of failing alike:\n{}",
        job.stderr
    );
    assert_eq!(
        job.stderr.matches("gradsync: ").count(),
        1,
        "{what}: one message for the job:\n{}",
        job.stderr
    );
}

fn temp_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gradsync-cli-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const GOOD_PROFILE: &str =
    r#"{"version": 1, "alpha": 1e-6, "beta": 1e-9, "gamma_reduce": 0, "gamma_unpack": 0}"#;
const BAD_PROFILE: &str =
    r#"{"version": 1, "alpha": -1, "beta": 1e-9, "gamma_reduce": 0, "gamma_unpack": 0}"#;

#[test]
fn a_profile_valid_on_one_rank_and_invalid_on_another_fails_alike() {
    let d = temp_dir("profile");
    let (good, bad, cut) = (d.join("good.json"), d.join("bad.json"), d.join("cut.json"));
    std::fs::write(&good, GOOD_PROFILE).unwrap();
    std::fs::write(&bad, BAD_PROFILE).unwrap();
    std::fs::write(&cut, &GOOD_PROFILE[..30]).unwrap();
    let (g, b, c) = (
        good.to_str().unwrap(),
        bad.to_str().unwrap(),
        cut.to_str().unwrap(),
    );
    fn check(p: &str) -> Vec<&str> {
        vec![
            "model-check",
            "--profile",
            p,
            "--sizes",
            "64K",
            "--iters",
            "3",
            "--min-seconds",
            "0",
        ]
    }
    let job = mpmd(&[(1, &check(g)), (1, &check(b))]);
    assert_fails_with(&job, "model-check", &["rank 1 failed", b, "alpha = -1"]);
    assert_agreed(&job, "model-check");
    // A truncated profile names the file too.
    let job = mpmd(&[(1, &check(c)), (1, &check(g))]);
    assert_fails_with(&job, "model-check", &["rank 0 failed", c, "EOF"]);
    assert_agreed(&job, "model-check");
    // A FIFO on one rank: opening it blocked that rank while its peer
    // waited in the agreement (the job hung).
    let fifo = d.join("fifo");
    if std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        let f = fifo.to_str().unwrap();
        let job = mpmd(&[(1, &check(g)), (1, &check(f))]);
        assert_fails_with(
            &job,
            "model-check FIFO",
            &["rank 1 failed", f, "not a regular file (a FIFO)"],
        );
        assert_agreed(&job, "model-check FIFO");
    }
}

#[test]
fn predict_with_a_bad_profile_on_one_rank_ends_in_seconds() {
    // `predict` does not use MPI: each rank exits on its own, and mpirun
    // ends the job with the failing rank's status.
    let d = temp_dir("predict");
    let (good, bad) = (d.join("good.json"), d.join("bad.json"));
    std::fs::write(&good, GOOD_PROFILE).unwrap();
    std::fs::write(&bad, BAD_PROFILE).unwrap();
    let args = |p: &PathBuf| {
        vec![
            "predict".to_string(),
            "--elements".into(),
            "1000".into(),
            "--ranks".into(),
            "2".into(),
            "--profile".into(),
            p.to_str().unwrap().to_string(),
        ]
    };
    let (a0, a1) = (args(&good), args(&bad));
    let a0: Vec<&str> = a0.iter().map(String::as_str).collect();
    let a1: Vec<&str> = a1.iter().map(String::as_str).collect();
    for segs in [[(1, &a0[..]), (1, &a1[..])], [(1, &a1[..]), (1, &a0[..])]] {
        let job = mpmd(&segs);
        assert_fails_with(&job, "predict", &[bad.to_str().unwrap(), "alpha = -1"]);
        assert!(job.elapsed < Duration::from_secs(30), "{:?}", job.elapsed);
    }
}

#[test]
fn mpmd_ranks_with_different_layer_counts_fail_alike() {
    let args = |layers: &'static str| {
        [
            "bench", "--op", "sparse", "--layers", layers, "--bytes", "64K", "--iters", "2",
            "--warmup", "0",
        ]
    };
    let job = mpmd(&[(1, &args("2")), (1, &args("3"))]);
    assert_fails_with(&job, "layers", &["rank 1 failed", "--layers 3 (rank 0: 2)"]);
    assert_agreed(&job, "layers");
}

#[test]
fn mpmd_ranks_with_different_sizes_fail_before_the_mpi_baseline() {
    // Used to segfault in the harness's own MPI_Allreduce baseline.
    let job = mpmd(&[
        (1, &["bench", "--sizes", "4K", "--iters", "2"]),
        (1, &["bench", "--sizes", "1M", "--iters", "2"]),
    ]);
    assert_fails_with(
        &job,
        "sizes",
        &["rank 1 failed", "--sizes [1048576] (rank 0: [4096])"],
    );
    assert_agreed(&job, "sizes");
    // Sparse layer bytes and another subcommand alike.
    let job = mpmd(&[
        (1, &["bench", "--op", "sparse", "--bytes", "64K"]),
        (1, &["bench", "--op", "sparse", "--bytes", "128K"]),
    ]);
    assert_fails_with(
        &job,
        "bytes",
        &["rank 1 failed", "--bytes [131072] (rank 0: [65536])"],
    );
    let job = mpmd(&[
        (1, &["bench", "--sizes", "4K", "--iters", "2"]),
        (1, &["verify", "--counts", "5"]),
    ]);
    assert_fails_with(&job, "subcommand", &["rank 1 failed", "subcommand verify"]);
    // Subcommands whose first collectives differ (these hung until killed).
    for (a, b) in [
        (
            &["bench", "--sizes", "4K", "--iters", "2"][..],
            &[
                "calibrate",
                "--max-bytes",
                "64K",
                "--reps",
                "3",
                "--min-seconds",
                "0",
                "--out",
                "/dev/null",
            ][..],
        ),
        (
            &[
                "model-check",
                "--profile",
                "docs/scale/profile-2x2-1gbit.json",
                "--sizes",
                "64K",
                "--iters",
                "2",
            ][..],
            &["verify", "--counts", "5"][..],
        ),
    ] {
        let job = mpmd(&[(1, a), (1, b)]);
        assert_fails_with(
            &job,
            "subcommand",
            &[
                "rank 1 failed",
                &format!("subcommand {} (rank 0: {})", b[0], a[0]),
            ],
        );
        assert_agreed(&job, "subcommand");
    }
}

#[test]
fn out_of_range_flags_are_errors_naming_the_flag() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["bench", "--op", "sparse", "--compute-ms", "inf"],
            &["--compute-ms inf", "[0, 3600000]"],
        ),
        (
            &["bench", "--op", "sparse", "--compute-ms=-1"],
            &["--compute-ms -1", "[0, 3600000]"],
        ),
        (
            &["bench", "--op", "gradiveq", "--lt", "0", "--bytes", "64K"],
            &["--lt 0", "at least 2"],
        ),
        (
            &["bench", "--op", "gradiveq", "--d", "0", "--bytes", "64K"],
            &["--d 0", "1..=768"],
        ),
        (
            &["bench", "--op", "gradiveq", "--d", "1000", "--bytes", "64K"],
            &["--d 1000", "1..=768"],
        ),
        // Flags another --op uses were ignored (a bogus --codec, a
        // --profile for another op).
        (
            &["bench", "--op", "allreduce", "--codec", "bogus:x=1"],
            &["--codec is not used by --op allreduce (only by --op sparse)"],
        ),
        (
            &["bench", "--op", "step", "--codec", "fp16"],
            &["--codec is not used by --op step"],
        ),
        (
            &["bench", "--op", "sparse", "--sparse-exchange", "bogus"],
            &["--sparse-exchange is not used by --op sparse (only by --op step)"],
        ),
        // The file's rows are the layer: a --bytes beside it was ignored.
        (
            &[
                "bench", "--op", "gradiveq", "--data", "g.npy", "--bytes", "64K",
            ],
            &["--bytes 64K is not used with --data g.npy"],
        ),
        (
            &["bench", "--sizes", "3"],
            &["--sizes", "3 bytes", "multiple of 4"],
        ),
        (&["bench", "--algo", ""], &["--algo \"\"", "no algorithm"]),
        (&["bench", "--iters", "0"], &["--iters 0"]),
        // Counts and sizes past any run: they wrapped, panicked on a
        // capacity overflow or ran out of memory.
        (
            &["bench", "--iters", "18446744073709551615"],
            &["--iters 18446744073709551615", "[1, 1000000]"],
        ),
        (
            &["bench", "--sizes", "4K", "--warmup", "18446744073709551615"],
            &["--warmup 18446744073709551615", "at most 1000000"],
        ),
        (
            &["bench", "--op", "gradiveq", "--lt", "18446744073709551615"],
            &["--lt 18446744073709551615", "at most 10000"],
        ),
        (
            &["bench", "--sizes", "4K,64G"],
            &["--sizes", "past 17179869184"],
        ),
        (
            &["verify", "--counts", "18446744073709551615"],
            &["--counts", "past 2147483648"],
        ),
        (
            &[
                "calibrate",
                "--out",
                "/tmp/never.json",
                "--max-bytes",
                "32G",
            ],
            &["--max-bytes 32G", "at most"],
        ),
        (
            &[
                "calibrate",
                "--out",
                "/tmp/never.json",
                "--reps",
                "18446744073709551615",
            ],
            &["--reps 18446744073709551615", "at most 100000"],
        ),
        (
            &["bench", "--op", "sparse", "--layers", "0"],
            &["--layers 0"],
        ),
        (
            &["bench", "--op", "sparse", "--density", "0"],
            &["--density 0", "(0, 1]"],
        ),
        (&["bench", "--op", "bogus"], &["unknown --op \"bogus\""]),
        (
            &["verify", "--counts", "p-5"],
            &["--counts", "\"p-5\" is negative with 2 ranks"],
        ),
        (
            &[
                "model-check",
                "--profile",
                "/nonexistent/p.json",
                "--iters",
                "1",
            ],
            &["/nonexistent/p.json", "No such file"],
        ),
    ];
    for (args, wants) in cases {
        let job = mpirun(2, args);
        assert_fails_with(&job, &format!("{args:?}"), wants);
        assert!(
            job.stderr.contains("rank 0 failed (and 1 other rank)"),
            "{}",
            job.stderr
        );
        assert_agreed(&job, &format!("{args:?}"));
    }
}

#[test]
fn an_explicit_codec_density_is_not_replaced_by_the_default() {
    let run = |extra: &[&str]| {
        let mut a = vec![
            "bench", "--op", "sparse", "--bytes", "64K", "--iters", "1", "--warmup", "0", "--json",
        ];
        a.extend(extra);
        mpirun(2, &a)
    };
    let density = |job: &Job| -> (f64, String) {
        assert!(job.ok, "{}", job.stderr);
        let v: serde_json::Value = serde_json::from_str(job.stdout.trim()).expect("one JSON line");
        (
            v["density"].as_f64().expect("density"),
            v["codec_params"].as_str().unwrap().to_string(),
        )
    };
    // The codec's own density (was: replaced by --density's default 0.001).
    let (d, params) = density(&run(&["--codec", "rgc:density=0.5"]));
    assert_eq!(d, 0.5);
    assert!(params.contains("density=0.5"), "{params}");
    let (d, params) = density(&run(&["--codec", "sbc:p=0.05"]));
    assert_eq!(d, 0.05);
    assert!(params.contains("p=0.05"), "{params}");
    // --density applies when the codec string has none; the default otherwise.
    assert_eq!(
        density(&run(&["--codec", "rgc", "--density", "0.02"])).0,
        0.02
    );
    assert_eq!(density(&run(&["--codec", "rgc"])).0, 0.001);
    // Both, the same: fine; different: an error.
    assert_eq!(
        density(&run(&["--codec", "rgc:density=0.5", "--density", "0.5"])).0,
        0.5
    );
    let job = run(&["--codec", "rgc:density=0.5", "--density", "0.01"]);
    assert_fails_with(
        &job,
        "density twice",
        &["density=0.5", "--density is 0.01", "give the density once"],
    );
}

#[test]
fn calibrate_refuses_one_rank_and_unwritable_out_before_measuring() {
    // Measuring takes at least --min-seconds 10 (the default): an error in
    // a few seconds came before it.
    let d = temp_dir("calibrate");
    let out = d.join("p.json");
    let job = mpirun(1, &["calibrate", "--out", out.to_str().unwrap(), "--quiet"]);
    assert_fails_with(&job, "p = 1", &["calibrate needs at least 2 ranks"]);
    assert!(job.elapsed < Duration::from_secs(8), "{:?}", job.elapsed);
    assert!(!out.exists(), "a profile with beta = 0 was written");
    let job = mpirun(
        2,
        &["calibrate", "--out", "/nonexistent/dir/p.json", "--quiet"],
    );
    assert_fails_with(
        &job,
        "--out",
        &[
            "rank 0 failed",
            "/nonexistent/dir/p.json",
            "cannot write the profile",
        ],
    );
    assert_agreed(&job, "--out");
    assert!(job.elapsed < Duration::from_secs(8), "{:?}", job.elapsed);
    // Rounds below the interquartile mean's minimum were silently raised.
    let job = mpirun(
        2,
        &["calibrate", "--out", out.to_str().unwrap(), "--reps", "1"],
    );
    assert_fails_with(&job, "--reps", &["--reps 1", "at least 3"]);
    assert!(!out.exists(), "the writability check left a file behind");
    // bench --op step --calibrate writes its profile to --profile: checked
    // before calibrating, not after.
    let job = mpirun(
        2,
        &[
            "bench",
            "--op",
            "step",
            "--layers",
            "examples/layers/resnet50.json",
            "--calibrate",
            "--profile",
            "/nonexistent/dir/p.json",
        ],
    );
    assert_fails_with(
        &job,
        "step --calibrate",
        &[
            "rank 0 failed",
            "/nonexistent/dir/p.json",
            "--profile: cannot write the profile",
        ],
    );
    assert!(job.elapsed < Duration::from_secs(8), "{:?}", job.elapsed);
    // A profile whose constants overflow a prediction: refused before
    // measuring, on every rank (it aborted the job after measuring).
    let text = std::fs::read_to_string("docs/scale/profile-2x1-1gbit.json").unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["alpha"] = serde_json::json!(1e308);
    let huge = d.join("alpha-huge.json");
    std::fs::write(&huge, v.to_string()).unwrap();
    let job = mpirun(
        2,
        &[
            "model-check",
            "--profile",
            huge.to_str().unwrap(),
            "--iters",
            "3",
        ],
    );
    assert_fails_with(
        &job,
        "model-check overflow",
        &["the predicted time of strategy dense-rabenseifner is inf s"],
    );
    assert_agreed(&job, "model-check overflow");
    assert!(job.elapsed < Duration::from_secs(8), "{:?}", job.elapsed);
    // The sparse-allreduce bench likewise (it printed predicted_s null).
    let job = mpirun(
        2,
        &[
            "bench",
            "--op",
            "sparse-allreduce",
            "--bytes",
            "64K",
            "--iters",
            "2",
            "--profile",
            huge.to_str().unwrap(),
        ],
    );
    assert_fails_with(
        &job,
        "sparse-allreduce overflow",
        &[
            "--profile",
            "alpha-huge.json: its constants price",
            "not a finite time",
        ],
    );
    assert_agreed(&job, "sparse-allreduce overflow");
    // model-check likewise needs a network (it printed a 395× error).
    let job = mpirun(
        1,
        &[
            "model-check",
            "--profile",
            "docs/scale/profile-2x1-1gbit.json",
            "--iters",
            "3",
        ],
    );
    assert_fails_with(
        &job,
        "model-check p = 1",
        &["model-check needs at least 2 ranks"],
    );
    assert!(job.elapsed < Duration::from_secs(8), "{:?}", job.elapsed);
}

/// A flag clap refuses on one rank of an MPMD launch: mpirun ends the job
/// within seconds, and the message names that rank (from the launcher's
/// environment: clap runs before MPI is up).
#[test]
fn a_flag_clap_refuses_on_one_rank_names_that_rank() {
    let job = mpmd(&[
        (
            1,
            &[
                "bench",
                "--op",
                "allreduce",
                "--sizes",
                "4K",
                "--iters",
                "1",
            ],
        ),
        (
            1,
            &[
                "bench",
                "--op",
                "allreduce",
                "--sizes",
                "4K",
                "--itres",
                "1",
            ],
        ),
    ]);
    assert!(!job.ok, "{}", job.stderr);
    assert!(job.elapsed < LIMIT, "{:?}", job.elapsed);
    assert!(
        job.stderr
            .contains("gradsync: rank 1 (from the launcher's environment): bad arguments")
            && job.stderr.contains("--itres"),
        "{}",
        job.stderr
    );
    assert!(!job.stderr.contains("rank 0 (from"), "{}", job.stderr);
}
