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
