//! `calibrate::calibrate` called from Rust as a training job calls it
//! (`examples/calibrate_in_job.rs` under `mpirun`): every
//! rank gets the same valid profile, and an option that is bad on one rank,
//! or differs between ranks, is the same error on every rank within the
//! time limit (no hang). Needs `cargo build --release --examples` first.

mod common;

use common::{example, mpirun};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(180);

/// Runs the example on `np` ranks; returns each rank's line (by rank) and
/// the stdout.
fn job(np: usize, args: &[&str]) -> (Vec<String>, String) {
    let (ok, out, err) = mpirun(np, &example("calibrate_in_job"), args, LIMIT);
    assert!(ok, "np={np} {args:?}: {err}\n{out}");
    let mut lines = vec![String::new(); np];
    for l in out.lines() {
        let mut w = l.splitn(3, ' ');
        if w.next() == Some("RANK") {
            let r: usize = w.next().and_then(|r| r.parse().ok()).expect("rank");
            lines[r] = w.next().unwrap_or_default().to_string();
        }
    }
    assert!(
        lines.iter().all(|l| !l.is_empty()),
        "np={np} {args:?}: a rank printed nothing\n{out}\n{err}"
    );
    (lines, out)
}

#[test]
fn every_rank_gets_the_same_valid_profile() {
    for np in [2, 3] {
        let (lines, out) = job(np, &[]);
        assert!(lines[0].starts_with("OK "), "np={np}: {out}");
        assert!(
            lines.iter().all(|l| l == &lines[0]),
            "np={np}: profiles differ between ranks:\n{out}"
        );
        assert!(lines[0].ends_with(&format!(" {np}")), "meta.ranks: {out}");
        let json = out
            .lines()
            .find_map(|l| l.strip_prefix("PROFILE "))
            .expect("rank 0's profile");
        let prof: gradsync::cost::Profile = serde_json::from_str(json).expect("profile JSON");
        prof.validate().expect("valid");
        assert!(prof.alpha >= 0.0 && prof.beta > 0.0, "{json}");
        assert_eq!(prof.meta.note, "calibrate_in_job");
        assert!(prof.select.contains_key("trimmed@0.01"), "{json}");
        assert_eq!(prof.beta_curve.last().map(|c| c.bytes), Some(65536.0));
        // No tables past the caches: four of the largest layer here are
        // 256 KiB, which could stay in them.
        assert!(prof.select_table.is_none(), "{json}");
        assert!(prof.powersgd.table.is_empty(), "{json}");
    }
}

#[test]
fn one_rank_is_refused_alike() {
    let (lines, out) = job(1, &[]);
    assert!(
        lines[0].starts_with("ERR true ") && lines[0].contains("at least 2 ranks"),
        "{out}"
    );
}

#[test]
fn a_bad_option_on_one_rank_is_the_same_error_on_every_rank() {
    for (scenario, wants) in [
        (
            "bad-reps",
            ["rank 1 failed", "--reps 1: must be at least 3"],
        ),
        ("other-densities", ["rank 1 failed", "--densities [0.05]"]),
    ] {
        let (lines, out) = job(3, &[scenario, "1"]);
        assert!(
            lines.iter().all(|l| l == &lines[0]),
            "{scenario}: ranks differ:\n{out}"
        );
        assert!(lines[0].starts_with("ERR true "), "{scenario}: {out}");
        for w in wants {
            assert!(lines[0].contains(w), "{scenario}: no {w:?} in\n{out}");
        }
    }
}
