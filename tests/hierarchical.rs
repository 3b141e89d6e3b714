//! The node-aware allreduce on real MPI ranks: `examples/hierarchical_check`
//! compares it with `MPI_Allreduce` bit for bit for MPI's own node map and
//! emulated ones (pairs, alternating, one rank per node, uneven).

mod common;

use common::{example, mpirun};
use std::time::Duration;

#[test]
fn hierarchical_allreduce_equals_mpi_allreduce() {
    let ex = example("hierarchical_check");
    assert!(ex.exists(), "{} not built", ex.display());
    for np in [1, 2, 3, 5, 8] {
        let (ok, out, err) = mpirun(np, &ex, &[], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        // 5 maps x 5 lengths x (sum, average) + 3 engine steps, on every rank.
        let oks = out
            .lines()
            .filter(|l| l.starts_with("OK ") && l.ends_with(&format!("ranks={np}")))
            .count();
        assert_eq!(oks, 53 * np, "np={np}:\n{out}\n{err}");
        // A bad map on one rank is an error on every rank, then a good call works.
        let errs = |case: &str| {
            out.lines()
                .filter(|l| l.starts_with(&format!("ERR {case} ")))
                .count()
        };
        assert_eq!(errs("short-map"), np, "{out}");
        assert!(
            out.lines()
                .filter(|l| l.starts_with("ERR short-map"))
                .all(|l| l.contains(&format!("rank {} failed", np - 1))),
            "{out}"
        );
        assert_eq!(errs("different-map"), if np > 1 { np } else { 0 }, "{out}");
        assert_eq!(
            out.lines().filter(|l| *l == "AFTER ok").count(),
            np,
            "{out}"
        );
        // One machine: MPI puts every rank on one node.
        let nodes = out
            .lines()
            .find(|l| l.starts_with("NODES "))
            .expect("node map");
        assert_eq!(nodes, format!("NODES {:?}", vec![0usize; np]), "{out}");
    }
}
