//! The test harness's `mpirun` helper itself (`tests/common`): it drains a
//! job's output while the job runs, and it ends a job past its limit with
//! no rank left behind. Every integration test on real ranks relies on both.

mod common;

/// The mpirun helper reads the job's output while it runs: 2 ranks writing
/// 200 KB each to stdout and to stderr (more than a pipe holds) finish and
/// every byte comes back. Before, the helper read only after the exit, so
/// such a job blocked in its writes until the time limit, as a "hang".
#[test]
fn the_mpirun_helper_drains_more_output_than_a_pipe_holds() {
    let script =
        "head -c 200000 /dev/zero | tr '\\000' x; head -c 200000 /dev/zero | tr '\\000' y >&2";
    let (ok, out, err) = common::mpirun(
        2,
        std::path::Path::new("/bin/sh"),
        &["-c", script],
        std::time::Duration::from_secs(60),
    );
    assert!(ok, "{err}");
    assert_eq!(out.matches('x').count(), 400_000);
    assert_eq!(err.matches('y').count(), 400_000);
}

/// Past its limit the helper ends the job (SIGTERM to mpirun, which ends
/// its ranks) and panics naming it, with what the job wrote to stderr; no
/// rank is left running.
#[test]
fn the_mpirun_helper_ends_a_job_past_its_limit() {
    let script = "echo gradsync-limit-test >&2; exec sleep 47";
    let r = std::panic::catch_unwind(|| {
        common::mpirun(
            2,
            std::path::Path::new("/bin/sh"),
            &["-c", script],
            std::time::Duration::from_secs(3),
        )
    });
    let msg = match r {
        Ok(v) => panic!("the job ended within its limit: {v:?}"),
        Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(msg.contains("did not finish in 3s"), "{msg}");
    assert!(msg.contains("gradsync-limit-test"), "{msg}");
    std::thread::sleep(std::time::Duration::from_secs(1));
    // Every process's command line (no pgrep on a minimal machine).
    let left: Vec<String> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|d| std::fs::read(d.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.trim_end() == "sleep 47")
        .collect();
    assert!(left.is_empty(), "ranks left: {left:?}");
}
