//! The sparse allreduce on real MPI ranks: `examples/sparse_allreduce_check`
//! compares it with `MPI_Allreduce` of the densely decoded contributions
//! (bitwise, integer values) and checks that an argument error on one rank
//! is an error on every rank.

mod common;

use common::{example, mpirun};
use std::time::Duration;

fn check() -> std::path::PathBuf {
    let ex = example("sparse_allreduce_check");
    assert!(ex.exists(), "{} not built", ex.display());
    ex
}

#[test]
fn sparse_allreduce_equals_mpi_allreduce() {
    let ex = check();
    for np in [1, 2, 3, 5, 8] {
        let (ok, out, err) = mpirun(np, &ex, &["sum"], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        let oks = out.lines().filter(|l| l.starts_with("OK ")).count();
        // 5 n x 2 balancings x 3 deltas x 2 allgathervs, on every rank.
        assert_eq!(oks, 60 * np, "np={np}:\n{out}\n{err}");
        assert!(
            out.lines()
                .filter(|l| l.starts_with("OK "))
                .all(|l| l.ends_with(&format!("ranks={np}"))),
            "{out}"
        );
    }
}

#[test]
fn sparse_allreduce_errors_reach_every_rank() {
    let ex = check();
    for np in [1, 2, 3, 5] {
        let (ok, out, err) = mpirun(np, &ex, &["errors"], Duration::from_secs(120));
        assert!(ok, "np={np}: {err}\n{out}");
        let lines: Vec<&str> = out.lines().collect();
        let index: Vec<_> = lines
            .iter()
            .filter(|l| l.starts_with("ERR index"))
            .collect();
        assert_eq!(index.len(), np, "np={np}:\n{out}");
        for l in index {
            assert!(
                l.contains(&format!("rank {} failed", np - 1)) && l.contains("index 100"),
                "{l}"
            );
        }
        let sizes = lines.iter().filter(|l| l.starts_with("ERR n")).count();
        assert_eq!(sizes, if np == 1 { 0 } else { np }, "np={np}:\n{out}");
        let after = lines.iter().filter(|l| **l == "OK after-errors").count();
        assert_eq!(after, np, "np={np}:\n{out}");
    }
}

#[test]
fn bench_sparse_allreduce_checks_pass() {
    let (ok, out, err) = mpirun(
        3,
        std::path::Path::new(common::gradsync()),
        &[
            "bench",
            "--op",
            "sparse-allreduce",
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
    assert!(ok, "{err}\n{out}");
    let recs: Vec<serde_json::Value> = out
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    // 3 sizes x (sparse allreduce, fused allgatherv).
    assert_eq!(recs.len(), 6, "{out}");
    assert!(
        recs.iter().all(|r| r["check"] == "ok" && r["ranks"] == 3),
        "{out}"
    );
}
