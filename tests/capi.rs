//! The C ABI end to end: build `libgradsync` (package
//! gradsync-capi), compile the C programs of examples/c with `mpicc`, and
//! run them on 1–4 real MPI ranks. `train.c` checks its own results
//! (bitwise against MPI_Allreduce) and prints "c example: OK"; `failure.c`
//! makes one rank misbehave and prints one line per check on every rank,
//! which must agree across ranks (same status, same error text), with no
//! rank hanging (the mpirun helper's time limit).

mod common;

use common::{gradsync, mpirun};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Build the C library in this test's profile and with its `cuda` feature
/// where this test was built with it (`cargo test --features cuda`: one
/// engine build serves this test and the C ABI's cuda check in
/// hpc/test.sh), and compile the C programs once; returns the directory
/// holding `train` and `failure`.
fn programs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let libdir = Path::new(gradsync()).parent().unwrap().to_path_buf();
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .current_dir(root())
            .args(["build", "-p", "gradsync-capi"]);
        if libdir.ends_with("release") {
            cargo.arg("--release");
        }
        if cfg!(feature = "cuda") {
            cargo.args(["--features", "cuda"]);
        }
        let st = cargo.status().expect("run cargo");
        assert!(st.success(), "cargo build -p gradsync-capi failed");
        assert!(
            libdir.join("libgradsync.so").exists(),
            "{} has no libgradsync.so",
            libdir.display()
        );

        let out = std::env::temp_dir().join(format!("gradsync-capi-test-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        for prog in ["train", "failure", "quickstart"] {
            let src = root().join("examples/c").join(format!("{prog}.c"));
            let r = Command::new("mpicc")
                .arg("-O2")
                .arg("-Wall")
                .arg("-I")
                .arg(root().join("include"))
                .arg(&src)
                .arg("-L")
                .arg(&libdir)
                .arg("-lgradsync")
                .arg(format!("-Wl,-rpath,{}", libdir.display()))
                .arg("-lm")
                .arg("-o")
                .arg(out.join(prog))
                .output();
            let r = match r {
                Ok(r) => r,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                    "mpicc not found: the C ABI tests compile C programs with it \
                     (install Open MPI's development package, libopenmpi-dev: hpc/setup.sh)"
                ),
                Err(e) => panic!("mpicc: {e}"),
            };
            assert!(
                r.status.success(),
                "mpicc {}: failed\n{}",
                src.display(),
                String::from_utf8_lossy(&r.stderr)
            );
        }
        out
    })
}

#[test]
fn c_training_loop_matches_mpi_allreduce_on_1_to_4_ranks() {
    let dir = programs();
    for np in 1..=4 {
        let snaps = dir.join(format!("snap-p{np}"));
        std::fs::create_dir_all(&snaps).unwrap();
        let (ok, out, err) = mpirun(
            np,
            &dir.join("train"),
            &[snaps.to_str().unwrap()],
            Duration::from_secs(120),
        );
        assert!(
            ok && out.contains("c example: OK"),
            "train.c on {np} ranks failed\n{out}\n{err}"
        );
        assert!(out.contains("\"layers\""), "no step stats printed: {out}");
        for r in 0..np {
            assert!(
                snaps.join(format!("gradsync.rank{r}.snap")).exists(),
                "rank {r}'s snapshot missing"
            );
        }
    }
}

/// Checks whose error texts carry each rank's own view (its own length or
/// shape) from the engine: the status must agree, the text may differ.
const LOCAL_VIEW: [&str; 6] = [
    "register mismatched shape",
    "step after mismatch",
    "allreduce count mismatch",
    "allreduce dtype mismatch",
    "allreduce algo mismatch",
    "allreduce op mismatch",
];

#[test]
fn one_ranks_bad_arguments_fail_every_rank_alike_and_nobody_hangs() {
    let dir = programs();
    for np in 1..=4 {
        // Each rank's lines from its own file: mpirun may cut and
        // interleave the ranks' lines on its stdout under load.
        let reports =
            std::env::temp_dir().join(format!("gradsync-capi-failure-{}-{np}", std::process::id()));
        std::fs::create_dir_all(&reports).unwrap();
        let (ok, out, err) = common::mpirun_env(
            np,
            &dir.join("failure"),
            &[],
            &[("GRADSYNC_REPORT_DIR", reports.to_str().unwrap())],
            Duration::from_secs(120),
        );
        assert!(
            ok && out.contains("c failure: OK"),
            "failure.c on {np} ranks failed\n{out}\n{err}"
        );
        let text: String = (0..np)
            .map(|r| {
                let f = reports.join(format!("report-{r}.txt"));
                std::fs::read_to_string(&f)
                    .unwrap_or_else(|e| panic!("p={np}: {}: {e}\n{out}\n{err}", f.display()))
            })
            .collect();
        std::fs::remove_dir_all(&reports).ok();
        let mut by_check: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for line in text.lines().filter(|l| l.contains(" | rc=")) {
            let key = line.split(" | ").next().unwrap();
            by_check.entry(key).or_default().push(line);
        }
        assert!(by_check.len() >= 20, "too few checks printed:\n{out}");
        for (key, lines) in &by_check {
            assert_eq!(lines.len(), np, "{key}: not every rank reported: {lines:?}");
            let rc = |l: &str| l.split(" | ").nth(1).map(str::to_string);
            assert!(
                lines.iter().all(|l| rc(l) == rc(lines[0])),
                "p={np} {key}: ranks got different codes: {lines:?}"
            );
            if !LOCAL_VIEW.contains(key) {
                assert!(
                    lines.iter().all(|l| l == &lines[0]),
                    "p={np} {key}: ranks got different errors: {lines:?}"
                );
            }
        }
        let bad = np - 1;
        let step2 = by_check["step 2"][0];
        assert!(
            step2.contains("rc=2")
                && step2.contains(&format!("rank {bad} failed in step 2"))
                && step2.contains("grads[1]"),
            "p={np}: {step2}"
        );
        // Overlapping arrays on one rank (GS_OK with replicas that
        // differed, before).
        let step5 = by_check["step 5"][0];
        assert!(
            step5.contains("rc=2")
                && step5.contains(&format!("rank {bad} failed in step 5"))
                && step5.contains("overlap"),
            "p={np}: {step5}"
        );
        assert!(by_check["step 6"][0].contains("rc=0"), "p={np}: step 6");
        if np > 1 {
            let table = by_check["register mismatched shape"][0];
            assert!(table.contains("rc=2"), "p={np}: {table}");
        }
    }
}

/// The README's "From C" program is examples/c/quickstart.c verbatim, and
/// it runs.
#[test]
fn readme_c_program_runs() {
    let src = std::fs::read_to_string(root().join("examples/c/quickstart.c")).unwrap();
    let readme = std::fs::read_to_string(root().join("docs/c.md")).unwrap();
    assert!(
        readme.contains(src.trim()),
        "docs/c.md's program must be examples/c/quickstart.c verbatim"
    );
    let dir = programs();
    for np in [1, 4] {
        let (ok, out, err) = mpirun(np, &dir.join("quickstart"), &[], Duration::from_secs(120));
        assert!(
            ok && out.contains("quickstart: OK"),
            "np={np}\n{out}\n{err}"
        );
    }
}
