//! The hierarchical sparse allreduce on real MPI ranks:
//! `examples/hierarchical_sparse_check` compares it with `MPI_Allreduce` of
//! the densely decoded contributions (bitwise, integer values) for MPI's
//! node map and emulated ones, and checks that an argument error on one
//! rank is an error on every rank.

mod common;

use common::{example, mpirun};
use std::time::Duration;

fn check() -> std::path::PathBuf {
    let ex = example("hierarchical_sparse_check");
    assert!(ex.exists(), "{} not built", ex.display());
    ex
}

#[test]
fn hierarchical_sparse_allreduce_equals_mpi_allreduce() {
    let ex = check();
    for np in [1, 2, 3, 5, 8] {
        let (ok, out, err) = mpirun(np, &ex, &["sum"], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        assert!(!out.contains("FAIL"), "np={np}:\n{out}");
        let oks: Vec<&str> = out.lines().filter(|l| l.starts_with("OK ")).collect();
        // 5 maps x 5 n x 3 deltas, on every rank.
        assert_eq!(oks.len(), 75 * np, "np={np}:\n{out}\n{err}");
        assert!(
            oks.iter().all(|l| l.ends_with(&format!("ranks={np}"))),
            "{out}"
        );
        // The dense switch was taken (delta 0) and not (delta 2).
        assert!(oks
            .iter()
            .any(|l| l.contains("delta=0 ") && !l.contains("dense_nodes=0")));
        assert!(oks
            .iter()
            .filter(|l| l.contains("delta=2 "))
            .all(|l| l.contains("dense_nodes=0")));
        // One machine: MPI puts every rank on one node.
        let nodes = out.lines().find(|l| l.starts_with("NODES ")).expect("map");
        assert_eq!(nodes, format!("NODES {:?}", vec![0usize; np]), "{out}");
    }
}

#[test]
fn hierarchical_sparse_errors_reach_every_rank() {
    let ex = check();
    for np in [1, 2, 3, 5] {
        let (ok, out, err) = mpirun(np, &ex, &["errors"], Duration::from_secs(120));
        assert!(ok, "np={np}: {err}\n{out}");
        assert!(!out.contains("NOERR"), "np={np}:\n{out}");
        let lines = |case: &str| -> Vec<&str> {
            out.lines()
                .filter(|l| l.starts_with(&format!("ERR {case} ")))
                .collect()
        };
        let last = format!("rank {} failed", np - 1);
        let index = lines("index");
        assert_eq!(index.len(), np, "np={np}:\n{out}");
        assert!(
            index
                .iter()
                .all(|l| l.contains(&last) && l.contains("index 100")),
            "{out}"
        );
        let short = lines("short-map");
        assert_eq!(short.len(), np, "np={np}:\n{out}");
        assert!(short.iter().all(|l| l.contains(&last)), "{out}");
        let reselect = lines("reselect");
        assert_eq!(reselect.len(), np, "np={np}:\n{out}");
        assert!(
            reselect
                .iter()
                .all(|l| l.contains("rank 0 failed") && l.contains("reselect")),
            "{out}"
        );
        let two = if np == 1 { 0 } else { np };
        assert_eq!(lines("n").len(), two, "np={np}:\n{out}");
        let map = lines("map");
        assert_eq!(map.len(), two, "np={np}:\n{out}");
        assert!(map.iter().all(|l| l.contains("node maps")), "{out}");
        let after = out.lines().filter(|l| *l == "OK after-errors").count();
        assert_eq!(after, np, "np={np}:\n{out}");
        // Every ERR line comes before that rank's OK after-errors: the
        // errors did not end the job.
        assert!(out.lines().filter(|l| l.starts_with("ERR ")).count() == np * 3 + 2 * two);
    }
}

#[test]
fn bench_sparse_allreduce_hierarchical_checks_pass() {
    for np in [1, 3] {
        let (ok, out, err) = mpirun(
            np,
            std::path::Path::new(common::gradsync()),
            &[
                "bench",
                "--op",
                "sparse-allreduce",
                "--hierarchical",
                "--check",
                "--json",
                "--iters",
                "2",
                "--warmup",
                "0",
                "--bytes",
                "0,4,400K",
                "--density",
                "0.3",
            ],
            Duration::from_secs(120),
        );
        assert!(ok, "np={np}: {err}\n{out}");
        let recs: Vec<serde_json::Value> = out
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).expect("JSON"))
            .collect();
        // 3 sizes x (sparse allreduce, fused allgatherv, hierarchical).
        assert_eq!(recs.len(), 9, "{out}");
        assert!(
            recs.iter().all(|r| r["check"] == "ok" && r["ranks"] == np),
            "{out}"
        );
        let hier = recs
            .iter()
            .filter(|r| r["algo"] == "hierarchical-sparse-allreduce")
            .count();
        assert_eq!(hier, 3, "{out}");
    }
}

#[test]
fn bench_sparse_allreduce_reports_the_models_prediction() {
    let dir = std::env::temp_dir().join(format!("gs-sa-pred-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let prof = dir.join("prof.json");
    std::fs::write(
        &prof,
        r#"{"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_unpack": 1e-9, "gamma_clear": 1e-10}"#,
    )
    .expect("profile");
    let args = |p: &str| {
        [
            "bench",
            "--op",
            "sparse-allreduce",
            "--hierarchical",
            "--json",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--bytes",
            "4M",
            "--density",
            "0.01",
            "--profile",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([p.to_string()])
        .collect::<Vec<String>>()
    };
    let exe = std::path::Path::new(common::gradsync());
    let a = args(prof.to_str().expect("utf-8"));
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (ok, out, err) = mpirun(3, exe, &a, Duration::from_secs(120));
    assert!(ok, "{err}\n{out}");
    let recs: Vec<serde_json::Value> = out
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    assert_eq!(recs.len(), 3, "{out}");
    // One node of 3 ranks: every collective's prediction includes at least
    // clearing the 4 MiB output (4 MiB x 1e-10 s/B = 0.42 ms) and is finite.
    for r in &recs {
        let t = r["predicted_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("no prediction: {r}"));
        assert!(t > 4.0 * 1048576.0 * 1e-10 && t < 1.0, "{r}");
    }
    // A profile that cannot be read is an error naming the flag, on every rank.
    let bad = dir.join("missing.json");
    let a = args(bad.to_str().expect("utf-8"));
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (ok, out, err) = mpirun(2, exe, &a, Duration::from_secs(120));
    assert!(!ok, "{out}");
    assert!(
        err.contains("--profile") && err.contains("missing.json"),
        "{err}\n{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
