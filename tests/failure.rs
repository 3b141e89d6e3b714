//! The failure model on real MPI ranks: one rank fails inside a
//! step and every rank gets the same error in that step, in seconds, then
//! goes on; ranks that disagree on the layer table all fail; a CLI error on
//! one rank ends the whole job instead of hanging it.

mod common;

use common::{example, mpirun};
use std::collections::BTreeMap;
use std::time::Duration;

/// Run `failure_check SCENARIO BAD` on `np` ranks; return per-line-key the
/// set of lines every rank printed (`STEP s` → lines, `SETUP` → lines).
fn run(scenario: &str, np: usize, bad: usize) -> BTreeMap<String, Vec<String>> {
    let ex = example("failure_check");
    assert!(ex.exists(), "{} not built", ex.display());
    let (ok, out, err) = mpirun(
        np,
        &ex,
        &[scenario, &bad.to_string()],
        Duration::from_secs(60),
    );
    assert!(ok, "{scenario} p={np}: job failed\n{out}\n{err}");
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in out.lines() {
        let key = line.split(" OK ").next().unwrap_or(line);
        let key = key.split(" ERR ").next().unwrap_or(key).to_string();
        by_key.entry(key).or_default().push(line.to_string());
    }
    by_key
}

/// Every rank printed the same line for every step.
fn assert_agreed(m: &BTreeMap<String, Vec<String>>, np: usize, what: &str) {
    for (k, lines) in m {
        assert_eq!(lines.len(), np, "{what}: {k}: {lines:?}");
        assert!(
            lines.iter().all(|l| l == &lines[0]),
            "{what}: ranks disagree at {k}: {lines:?}"
        );
    }
}

fn step2_fails_then_recovers(scenario: &str, np: usize, bad: usize, cause: &str) {
    let what = format!("{scenario} p={np} bad={bad}");
    let m = run(scenario, np, bad);
    assert_agreed(&m, np, &what);
    for s in 0..5 {
        let line = &m[&format!("STEP {s}")][0];
        if s == 2 {
            assert!(
                line.contains(&format!("ERR rank {bad} failed in step 2")) && line.contains(cause),
                "{what}: {line}"
            );
        } else {
            assert!(line.contains(" OK "), "{what}: step {s}: {line}");
        }
    }
}

#[test]
fn wrong_length_on_one_rank_fails_every_rank_in_that_step() {
    for (np, bad) in [(1, 0), (2, 1), (3, 1), (4, 0), (5, 4)] {
        step2_fails_then_recovers("bad-len", np, bad, "gradient has 257 elements");
    }
}

#[test]
fn failure_rides_the_dense_status_word_the_fused_message_or_a_status_allreduce() {
    step2_fails_then_recovers("bad-len-dense", 3, 2, "gradient has 78 elements");
    step2_fails_then_recovers("bad-len-sparse", 3, 0, "gradient has 5001 elements");
    step2_fails_then_recovers("bad-len-gradiveq", 3, 1, "gradient has 257 elements");
}

#[test]
fn nan_in_one_ranks_gradiveq_sample_phase_fails_every_rank() {
    // Before: the QSGD ring's encoder failed on that rank alone and its
    // peers waited forever in the ring.
    for (np, bad) in [(2, 0), (3, 1)] {
        step2_fails_then_recovers(
            "nan-gradiveq",
            np,
            bad,
            "non-finite gradient in layer \"conv\"",
        );
    }
}

#[test]
fn encoder_failure_on_one_rank_is_agreed() {
    // Gradients near f32::MAX on one rank: whatever the codec does with
    // them, every rank reports the same outcome in every step.
    let m = run("huge-qsgd", 3, 1);
    assert_agreed(&m, 3, "huge-qsgd");
    assert!(m["STEP 1"][0].contains(" OK "));
}

#[test]
fn a_rank_with_an_extra_layer_fails_every_rank() {
    let ex = example("failure_check");
    let (ok, out, err) = mpirun(2, &ex, &["extra-layer", "1"], Duration::from_secs(60));
    assert!(ok, "{out}\n{err}");
    // Rank 1 fails at registration; rank 0 at its first step and, without
    // communicating again, at every later one (before: the second step's
    // table check waited for rank 1, which had left).
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("SETUP ERR")).count(),
        1,
        "{out}"
    );
    assert!(
        lines
            .iter()
            .all(|l| l.contains(" ERR layer table differs across ranks: ")
                && !l.contains("differs across ranks: layer table")),
        "{out}"
    );
}

/// One flipped bit in one rank's snapshot fails every rank in the load,
/// naming the rank and the file, in seconds (rather than loading silently,
/// that rank's replica drifting while the job exits 0).
#[test]
fn a_corrupt_snapshot_on_one_rank_fails_every_rank() {
    let ex = example("engine_check");
    let dir = std::env::temp_dir().join(format!("gradsync-failure-snap-{}", std::process::id()));
    let d = dir.to_str().expect("utf-8 temp dir");
    let lim = Duration::from_secs(60);
    let (ok, _, err) = mpirun(
        3,
        &ex,
        &["run", "--from", "0", "--to", "3", "--save", d],
        lim,
    );
    assert!(ok, "{err}");
    let victim = dir.join("gradsync.rank1.snap");
    let mut bytes = std::fs::read(&victim).expect("rank 1's snapshot");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&victim, &bytes).expect("write");
    let (ok, out, err) = mpirun(
        3,
        &ex,
        &["run", "--from", "3", "--to", "6", "--load", d],
        lim,
    );
    std::fs::remove_dir_all(&dir).ok();
    assert!(!ok, "the job must fail\n{out}");
    // engine_check exits at once on the error, and mpirun may kill the
    // other ranks before they print theirs (and interleaves their stderr):
    // every report must be the same agreed error, and no rank may have gone
    // on to a step.
    let reports: Vec<&str> = err.split("engine_check: load: ").skip(1).collect();
    assert!(!reports.is_empty(), "the load failure is reported\n{err}");
    for r in &reports {
        assert!(
            r.starts_with("rank 1 failed: snapshot: ")
                && r.contains("gradsync.rank1.snap: checksum mismatch"),
            "{err}"
        );
    }
    assert!(
        !out.contains("STEP"),
        "no rank runs a step after a bad load\n{out}"
    );
}

/// NaN in rank 0's row of a GradiVeQ bench input ends the job within
/// seconds with a non-zero status and the cause on stderr (rather than
/// hanging it in the QSGD-ring sample phase).
#[test]
fn nan_in_gradiveq_bench_data_ends_the_job_in_seconds() {
    let dir = std::env::temp_dir().join(format!("gradsync-failure-gvq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let npy = dir.join("g.npy");
    // A (8, 2304) f32 .npy, row 0 holding a NaN.
    let (rows, cols) = (8usize, 2304usize);
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| {
            if i == 5 {
                f32::NAN
            } else {
                ((i * 37 % 101) as f32 - 50.0) / 25.0
            }
        })
        .collect();
    common::write_npy_f32(&npy, &[rows, cols], &data);
    let t = std::time::Instant::now();
    let (ok, out, err) = mpirun(
        2,
        std::path::Path::new(common::gradsync()),
        &[
            "bench",
            "--op",
            "gradiveq",
            "--data",
            npy.to_str().unwrap(),
            "--k",
            "144",
            "--lt",
            "4",
            "--check",
        ],
        Duration::from_secs(60),
    );
    std::fs::remove_dir_all(&dir).ok();
    assert!(!ok, "the job must fail\n{out}\n{err}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );
    assert!(err.contains("NaN"), "the cause is printed\n{err}");
}

/// A progress thread that dies inside a step (here: a panic on one rank's
/// thread while it holds the transport, in step 2) ends the whole job
/// within seconds, with `MPI_Abort` and a message naming the rank and the
/// cause, instead of leaving the peers in the step's collective. (At
/// p = 1 a step calls no transport: there is nothing to die in.)
#[test]
fn a_dead_progress_thread_ends_the_job_with_mpi_abort() {
    let ex = example("progress_death");
    assert!(ex.exists(), "{} not built", ex.display());
    for (np, bad) in [(3usize, 1usize), (2, 0), (4, 3)] {
        let t = std::time::Instant::now();
        let (ok, out, err) = mpirun(np, &ex, &[&bad.to_string()], Duration::from_secs(60));
        assert!(!ok, "p={np}: the job must fail\n{out}\n{err}");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "p={np}: took {:?}\n{err}",
            t.elapsed()
        );
        let want = format!(
            "rank {bad} of {np}: the progress thread has exited; aborting the job \
             (MPI_Abort on MPI_COMM_WORLD"
        );
        assert!(err.contains(&want), "p={np}: expected {want:?}\n{err}");
        assert!(
            err.contains("dies on purpose"),
            "p={np}: the thread's panic\n{err}"
        );
        // Steps 0 and 1 finished on every rank; step 2 on none.
        assert_eq!(out.matches("STEP 1 OK").count(), np, "p={np}\n{out}");
        assert_eq!(out.matches("STEP 2 OK").count(), 0, "p={np}\n{out}");
    }
}
