//! Integration tests on real MPI ranks: `mpirun --oversubscribe` launches the
//! `gradsync` binary (and the example) with p in {1, 2, 3, 4, 5, 7, 8}; every
//! collective is checked against `MPI_Allreduce` / `MPI_Allgatherv` inside the
//! job (`gradsync verify`) and the JSON verdicts are checked here.

mod common;

use common::{example, gradsync, mpirun, mpirun_env};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

const COUNTS: &str = "0,1,p-1,p+1,1000,1048579"; // 1048579 = 2^20 + 3

fn verify(np: usize) {
    verify_with(np, &[]);
}

/// `gradsync verify` with `extra` arguments: every case checked against
/// MPI's own collective.
fn verify_with(np: usize, extra: &[&str]) {
    let mut args = vec!["verify", "--json", "--counts", COUNTS];
    args.extend_from_slice(extra);
    let (ok, out, err) = mpirun(np, Path::new(gradsync()), &args, Duration::from_secs(600));
    let cases = json_lines(&out);
    let failed: Vec<_> = cases.iter().filter(|c| c["check"] != "ok").collect();
    assert!(
        failed.is_empty(),
        "p={np}: failed cases: {failed:#?}\n{err}"
    );
    assert!(ok, "p={np}: verify exited non-zero\n{err}");
    // 6 counts x (f32, f64) x (int, float) x (rabenseifner 2 + ring 2x2 + mpi 2
    // + hierarchical 2) + 6 x 3 allgatherv (recdbl, mpi, node: one node
    // here, so node is the flat one by MPI's node map)
    assert_eq!(
        cases.len(),
        6 * 2 * 2 * 10 + 6 * 3,
        "p={np}: unexpected number of cases"
    );
    for c in &cases {
        assert_eq!(c["ranks"], np);
    }
}

#[test]
fn verify_p1() {
    verify(1);
}
#[test]
fn verify_p2() {
    verify(2);
}
#[test]
fn verify_p3() {
    verify(3);
}
#[test]
fn verify_p4() {
    verify(4);
}
#[test]
fn verify_p5() {
    verify(5);
}
#[test]
fn verify_p7() {
    verify(7);
}
#[test]
fn verify_p8() {
    verify(8);
}

/// Every collective over a transport that waits politely (MPI's immediate
/// calls, tested with sleeps between tests: the engine's progress thread
/// while its caller computes) equals MPI's own collective.
#[test]
fn verify_with_polite_waits() {
    for np in [1, 3, 4] {
        verify_with(np, &["--poll-us", "50"]);
    }
}

#[test]
fn size_mismatch_returns_error_on_every_rank() {
    for (np, poll) in [(2, "0"), (3, "0"), (5, "0"), (3, "50")] {
        let (ok, out, err) = mpirun(
            np,
            Path::new(gradsync()),
            &[
                "verify",
                "--json",
                "--mismatch",
                "--counts",
                "0,1000",
                "--poll-us",
                poll,
            ],
            Duration::from_secs(120),
        );
        let cases = json_lines(&out);
        // An exact receive's length error, then 2 counts x 4 algorithms x
        // (mismatch case + the communicator still works)
        assert_eq!(cases.len(), 1 + 16, "p={np}: {out}\n{err}");
        assert!(
            cases.iter().all(|c| c["check"] == "ok"),
            "p={np}: {out}\n{err}"
        );
        assert!(ok, "p={np}\n{err}");
    }
}

#[test]
fn bench_json_has_the_documented_fields_and_checks_pass() {
    for (op, algo, n) in [("allreduce", 4, 3), ("allgatherv", 3, 3)] {
        let (ok, out, err) = mpirun(
            3,
            Path::new(gradsync()),
            &[
                "bench", "--op", op, "--algo", "all", "--sizes", "4K,64K", "--iters", "3",
                "--warmup", "1", "--check", "--json",
            ],
            Duration::from_secs(120),
        );
        assert!(ok, "{op}: {err}");
        let recs = json_lines(&out);
        assert_eq!(recs.len(), 2 * algo, "{op}: {out}");
        for r in &recs {
            for f in [
                "op",
                "algo",
                "ranks",
                "bytes",
                "iters",
                "median_s",
                "min_s",
                "mpi_median_s",
                "ratio_vs_mpi",
                "check",
            ] {
                assert!(r.get(f).is_some(), "{op}: field {f} missing in {r}");
            }
            assert_eq!(r["op"], op);
            assert_eq!(r["ranks"], n);
            assert_eq!(r["iters"], 3);
            assert_eq!(r["check"], "ok");
            let (med, mpi) = (
                r["median_s"].as_f64().unwrap(),
                r["mpi_median_s"].as_f64().unwrap(),
            );
            assert!(med > 0.0 && mpi > 0.0);
            assert!((r["ratio_vs_mpi"].as_f64().unwrap() - med / mpi).abs() < 1e-9 * (med / mpi));
        }
        let bytes: Vec<_> = recs.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
        assert!(bytes.contains(&4096) && bytes.contains(&65536));
    }
}

/// The `mpi` algorithm passes the linked library's `MPI_IN_PLACE` (Open
/// MPI's and MPICH's differ; a value built from another library's `mpi.h`
/// would make it fall back to a copy with a warning), and its result is
/// MPI's own.
#[test]
fn the_mpi_allreduce_passes_the_linked_librarys_in_place() {
    let args = [
        "bench",
        "--op",
        "allreduce",
        "--algo",
        "mpi",
        "--sizes",
        "4K,1M",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--check",
        "--json",
    ];
    let env = [("RUST_LOG", "gradsync::comm=debug")];
    let (ok, out, err) = mpirun_env(
        2,
        Path::new(gradsync()),
        &args,
        &env,
        Duration::from_secs(300),
    );
    assert!(ok, "{err}");
    let recs = json_lines(&out);
    assert_eq!(recs.len(), 2, "{out}");
    assert!(recs.iter().all(|r| r["check"] == "ok"), "{out}");
    assert!(
        err.contains("passes MPI_IN_PLACE") && !err.contains("does not match"),
        "no in-place allreduce on the linked library:\n{err}"
    );
}

#[test]
fn bench_rejects_bad_arguments() {
    let (ok, _, err) = mpirun(
        1,
        Path::new(gradsync()),
        &["bench", "--sizes", "4Q"],
        Duration::from_secs(60),
    );
    assert!(!ok && err.contains("bad size"), "{err}");
    let (ok, _, err) = mpirun(
        1,
        Path::new(gradsync()),
        &["bench", "--algo", "bogus"],
        Duration::from_secs(60),
    );
    assert!(!ok && err.contains("unknown allreduce algorithm"), "{err}");
}

#[test]
fn training_loop_example_runs_on_real_ranks() {
    let ex = example("training_loop");
    assert!(
        ex.exists(),
        "{} not built (cargo test builds examples)",
        ex.display()
    );
    for np in [1, 3] {
        let (ok, out, err) = mpirun(np, &ex, &[], Duration::from_secs(120));
        assert!(ok, "np={np}: {err}");
        assert!(out.contains(&format!("{np} ranks")), "{out}");
    }
}

fn engine_check() -> PathBuf {
    let ex = example("engine_check");
    assert!(ex.exists(), "{} not built", ex.display());
    ex
}

/// The engine with MPI's own dense allreduce (a sum, averaged as the
/// layers are unpacked) against the one with Rabenseifner's, bitwise, with
/// momentum and Nesterov, and failing alike on a NaN
/// (examples/engine_check.rs `mpi-dense`).
#[test]
fn engine_with_the_mpi_allreduce_equals_rabenseifners_bitwise() {
    let ex = engine_check();
    for np in [1, 2, 3, 4] {
        let (ok, out, err) = mpirun(np, &ex, &["mpi-dense"], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        let oks = out
            .lines()
            .filter(|l| l.starts_with("OK mpi-dense") && l.ends_with(&format!("ranks={np}")))
            .count();
        assert_eq!(oks, 2, "np={np}:\n{out}");
    }
}

/// PowerSGD layers under mpirun: the same bits on every rank, its phases
/// by hand with `MPI_Allreduce` summing the factors, a snapshot restored
/// bitwise, a NaN on one rank failing every rank (examples/engine_check.rs).
#[test]
fn engine_powersgd_equals_its_phases_over_mpi_allreduce() {
    let ex = engine_check();
    for np in [1, 2, 3, 4] {
        let (ok, out, err) = mpirun(np, &ex, &["powersgd"], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        assert!(
            out.lines().any(|l| l == format!("OK powersgd ranks={np}")),
            "np={np}:\n{out}"
        );
    }
}

#[test]
fn engine_sparse_sync_equals_mpi_allreduce_of_decoded_units() {
    let ex = engine_check();
    for np in [1, 2, 3, 4, 5, 8] {
        let (ok, out, err) = mpirun(np, &ex, &["codecs"], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        for codec in ["rgc:", "rgc-quant", "sbc", "3lc", "fastsgd", "qsgd", "int8"] {
            assert!(
                out.lines().any(|l| l.starts_with(&format!("OK {codec}"))
                    && l.ends_with(&format!("ranks={np}"))),
                "np={np}: {codec} missing:\n{out}"
            );
        }
    }
}

/// The same checks with `allreduce = "auto"` and
/// `sparse_exchange = "auto"` (the cost model's per-step choices: the ring
/// at 3 and 5 ranks, the sparse allreduce where it moves fewer bytes).
#[test]
fn engine_with_auto_collectives_equals_mpi_allreduce_of_decoded_units() {
    let ex = engine_check();
    for np in [1, 2, 3, 5, 8] {
        let (ok, out, err) = mpirun(np, &ex, &["codecs", "--auto"], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        let oks = out
            .lines()
            .filter(|l| l.starts_with("OK ") && l.ends_with(&format!("ranks={np}")))
            .count();
        assert_eq!(oks, 9, "np={np}:\n{out}");
    }
}

/// `sparse_exchange = allreduce` under mpirun, against
/// `MPI_Allreduce` of the decoded units and the allgather engine (bitwise),
/// with the sparse allreduce's distinct indices and a NaN on one rank.
#[test]
fn engine_sparse_allreduce_exchange_equals_mpi_allreduce_of_decoded_units() {
    exchange_check("allreduce");
}

/// The same with `sparse_exchange = hierarchical` (the node-aware sparse
/// allreduce; one node here, several in `hpc/cluster_test.sh`), against
/// `MPI_Allreduce` of the decoded units.
#[test]
fn engine_hierarchical_exchange_equals_mpi_allreduce_of_decoded_units() {
    exchange_check("hierarchical");
}

/// The same with `sparse_exchange = auto`: the cost model's choice every
/// step (one node: allgatherv or sparse allreduce), each step checked
/// against `MPI_Allreduce` and, as both are bitwise the same, the
/// allgather engine; at 8 ranks the latency-free profile makes it reduce,
/// at 1 and 2 it keeps the allgatherv.
#[test]
fn engine_auto_exchange_equals_mpi_allreduce_of_decoded_units() {
    let outs = exchange_check("auto");
    for (np, out) in outs {
        let steps: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("OK exchange step"))
            .collect();
        let reduced = steps.iter().filter(|l| l.contains(" allreduce ")).count();
        assert!(
            steps
                .iter()
                .all(|l| l.contains(" allreduce ") || l.contains(" allgather nnz=0 ")),
            "np={np}:\n{out}"
        );
        if np == 8 {
            assert!(reduced > 0, "np=8 never reduced:\n{out}");
        }
        if np <= 2 {
            assert_eq!(reduced, 0, "np={np}:\n{out}");
        }
    }
}

/// Runs `engine_check exchange <which>` at 1, 2, 3, 5 and 8 ranks, checks
/// its lines, and returns every run's output.
fn exchange_check(which: &str) -> Vec<(usize, String)> {
    let ex = engine_check();
    let mut outs = Vec::new();
    for np in [1, 2, 3, 5, 8] {
        let (ok, out, err) = mpirun(np, &ex, &["exchange", which], Duration::from_secs(300));
        assert!(ok, "np={np}: {err}\n{out}");
        let lines: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("OK exchange"))
            .collect();
        // Steps 0, 1, 2 and 4 checked; step 3 fails alike (a NaN).
        assert_eq!(lines.len(), 5, "np={np}:\n{out}");
        for t in [0, 1, 2, 4] {
            assert!(
                lines
                    .iter()
                    .any(|l| l.starts_with(&format!("OK exchange step {t} "))),
                "np={np} step {t}:\n{out}"
            );
        }
        assert!(lines.contains(&format!("OK exchange nonfinite ranks={np}").as_str()));
        assert!(
            lines.iter().all(|l| l.ends_with(&format!("ranks={np}"))),
            "np={np}:\n{out}"
        );
        outs.push((np, out));
    }
    outs
}

#[test]
fn engine_mismatched_layer_tables_fail_on_every_rank() {
    let ex = engine_check();
    for np in [2, 3, 5] {
        let (ok, out, err) = mpirun(np, &ex, &["mismatch"], Duration::from_secs(120));
        assert!(ok, "np={np}: {err}");
        for r in 0..np {
            assert!(
                out.contains(&format!("MISMATCH rank {r}: layer table differs")),
                "np={np} rank {r}:\n{out}"
            );
        }
    }
}

fn step_hashes(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("STEP "))
        .map(str::to_string)
        .collect()
}

#[test]
fn engine_snapshot_restore_across_jobs_is_bitwise_exact() {
    let ex = engine_check();
    for np in [1, 3, 4] {
        let dir =
            std::env::temp_dir().join(format!("gradsync-mpi-snap-{}-{np}", std::process::id()));
        let d = dir.to_str().expect("utf-8 temp dir");
        let lim = Duration::from_secs(120);
        let (ok, straight, err) = mpirun(np, &ex, &["run", "--from", "0", "--to", "6"], lim);
        assert!(ok, "{err}");
        let (ok, first, err) = mpirun(
            np,
            &ex,
            &["run", "--from", "0", "--to", "3", "--save", d],
            lim,
        );
        assert!(ok, "{err}");
        let (ok, second, err) = mpirun(
            np,
            &ex,
            &["run", "--from", "3", "--to", "6", "--load", d],
            lim,
        );
        assert!(ok, "{err}");
        let straight = step_hashes(&straight);
        assert_eq!(straight.len(), 6);
        // Every rank's outputs are identical within a step.
        for l in &straight {
            let hs: Vec<&str> = l.split(' ').nth(2).expect("hashes").split(',').collect();
            assert!(hs.iter().all(|h| *h == hs[0]), "ranks differ: {l}");
        }
        let resumed = [step_hashes(&first), step_hashes(&second)].concat();
        assert_eq!(straight, resumed, "np={np}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// RGC at density 0.1% reaches the dense run's final loss within 2% in the
/// same number of steps (data-parallel momentum SGD on 4 ranks), and the
/// compressed layer matters: freezing it is clearly worse.
#[test]
fn convergence_rgc_at_one_permille_matches_dense() {
    let ex = example("convergence");
    assert!(ex.exists(), "{} not built", ex.display());
    let (ok, out, err) = mpirun(
        4,
        &ex,
        &["--steps", "1000", "--density", "0.001"],
        Duration::from_secs(300),
    );
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with('{')).expect("JSON line");
    let v: serde_json::Value = serde_json::from_str(line).expect("JSON");
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {line}"));
    let (dense, rgc, frozen, init) = (
        f("dense_loss"),
        f("rgc_loss"),
        f("frozen_w1_loss"),
        f("initial_loss"),
    );
    assert!(dense < 0.6 * init, "dense training learns: {line}");
    assert!(rgc <= 1.02 * dense, "rgc within 2% of dense: {line}");
    assert!(frozen > 1.05 * dense, "the sparse layer matters: {line}");
    assert!(f("rgc_wire_bytes") < 0.2 * f("dense_wire_bytes"), "{line}");
}

/// `calibrate` writes a valid profile on real ranks (small and quick here),
/// `predict --profile` and `model-check` use it.
#[test]
fn calibrate_writes_a_profile_that_predict_and_model_check_use() {
    let prof = std::env::temp_dir().join(format!("gradsync-prof-{}.json", std::process::id()));
    let p = prof.to_str().expect("utf-8");
    let (ok, _, err) = mpirun(
        2,
        Path::new(gradsync()),
        &[
            "calibrate",
            "--out",
            p,
            "--max-bytes",
            "256K",
            "--reps",
            "3",
            "--min-seconds",
            "0",
            "--quiet",
        ],
        Duration::from_secs(300),
    );
    assert!(ok, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&prof).expect("profile written"))
            .expect("JSON");
    for k in ["alpha", "beta", "gamma_reduce", "gamma_unpack"] {
        let x = v[k].as_f64().unwrap_or(-1.0);
        assert!(x >= 0.0 && x.is_finite(), "{k} = {x}");
    }
    assert!(v["beta"].as_f64().unwrap_or(0.0) > 0.0, "beta measured");
    // Clearing a dense output (the sparse allreduces' own cost).
    assert!(
        v["gamma_clear"]
            .as_f64()
            .is_some_and(|x| x > 0.0 && x < 1e-6),
        "gamma_clear = {}",
        v["gamma_clear"]
    );
    // γ_clear by output size: 32 and 128 MiB cleared whatever --max-bytes
    // says (the sparse allreduces clear whole groups), ascending.
    let c = v["gamma_clear_curve"]
        .as_array()
        .expect("gamma_clear_curve");
    let at: Vec<f64> = c.iter().filter_map(|x| x["bytes"].as_f64()).collect();
    assert_eq!(at, [33554432.0, 134217728.0], "{c:?}");
    assert!(
        c.iter()
            .all(|x| x["per_byte"].as_f64().is_some_and(|y| y > 0.0 && y < 1e-6)),
        "{c:?}"
    );
    // γ_unpack by output size: the local fit at the largest local layer
    // (--max-bytes), then the just-cleared 32 and 128 MiB outputs, which
    // miss the caches (their per-byte cost is not asserted: timing).
    let u = v["gamma_unpack_curve"]
        .as_array()
        .expect("gamma_unpack_curve");
    let at: Vec<f64> = u.iter().filter_map(|x| x["bytes"].as_f64()).collect();
    assert_eq!(at, [262144.0, 33554432.0, 134217728.0], "{u:?}");
    assert_eq!(u[0]["per_byte"], v["gamma_unpack"], "{u:?}");
    assert!(
        u.iter()
            .all(|x| x["per_byte"].as_f64().is_some_and(|b| b > 0.0 && b < 1e-6)),
        "{u:?}"
    );
    // The β curve: one point per exchange size from 4 KiB to --max-bytes.
    let c = v["beta_curve"].as_array().expect("beta_curve");
    let sizes: Vec<f64> = c.iter().filter_map(|x| x["bytes"].as_f64()).collect();
    assert_eq!(sizes.first(), Some(&4096.0), "{c:?}");
    assert_eq!(sizes.last(), Some(&262144.0), "{c:?}");
    assert!(sizes.windows(2).all(|w| w[0] < w[1]), "{c:?}");
    assert!(c
        .iter()
        .all(|x| x["per_byte"].as_f64().is_some_and(|b| b >= 0.0)));
    assert_eq!(v["version"], 2);
    assert!(v["select"]["trimmed"]["b"].as_f64().unwrap_or(0.0) > 0.0);
    assert!(v["select"]["trimmed@0.01"].is_object());
    assert_eq!(v["meta"]["ranks"], 2);
    let out = Command::new(gradsync())
        .args([
            "predict",
            "--bytes",
            "1M",
            "--ranks",
            "2",
            "--profile",
            p,
            "--json",
        ])
        .output()
        .expect("predict");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, out, err) = mpirun(
        2,
        Path::new(gradsync()),
        &[
            "model-check",
            "--profile",
            p,
            "--sizes",
            "64K,256K",
            "--iters",
            "3",
            "--min-seconds",
            "0",
            "--json",
        ],
        Duration::from_secs(300),
    );
    assert!(ok, "{err}");
    let summary = out.lines().last().expect("summary");
    let s: serde_json::Value = serde_json::from_str(summary).expect("summary JSON");
    assert_eq!(s["points"], 4);
    assert!(
        s["median_rel_error"].as_f64().is_some() && s["choice_within_10pct"].as_f64().is_some()
    );
    std::fs::remove_file(&prof).ok();
}

/// GradiVeQ's ring on real ranks, p = 1..5: every rank fits the same
/// compressor (hash compared), gets the same result, equal to the
/// centralized `U(Uᵀ(Σg − μ)) + μ`; the JSON has the documented fields.
#[test]
fn gradiveq_ring_matches_the_centralized_compressor_on_real_ranks() {
    for np in 1..=5 {
        let (ok, out, err) = mpirun(
            np,
            Path::new(gradsync()),
            &[
                "bench", "--op", "gradiveq", "--bytes", "1M", "--k", "256", "--d", "32", "--lt",
                "40", "--iters", "2", "--warmup", "1", "--check", "--json",
            ],
            Duration::from_secs(300),
        );
        assert!(ok, "np={np}: {err}\n{out}");
        let line = out.lines().find(|l| l.starts_with('{')).expect("JSON line");
        let v: serde_json::Value = serde_json::from_str(line).expect("JSON");
        for k in [
            "op",
            "ranks",
            "bytes",
            "k",
            "d",
            "ratio",
            "rel_l2_error",
            "median_s",
            "ring_median_s",
            "qsgd_ring_median_s",
            "speedup_vs_ring",
            "check",
        ] {
            assert!(!v[k].is_null(), "np={np}: field {k} missing: {line}");
        }
        assert_eq!(v["check"], "ok", "np={np}: {line}");
        assert_eq!(v["ranks"], np);
        assert_eq!(v["d"], 32);
        let ratio = v["ratio"].as_f64().expect("ratio");
        assert!((ratio - 8.0).abs() < 0.1, "{ratio}");
        assert!(v["rel_l2_error"].as_f64().expect("err") < 0.05, "{line}");
    }
}

/// Real convolution gradients: the CNN example trains, dumps its (3,3,16,16)
/// layer's gradients as .npy and reports GradiVeQ's ratio and eq.-7 loss;
/// the bench then runs Algorithm 1 on that file on real ranks.
#[test]
fn gradiveq_on_real_cnn_gradients() {
    let ex = example("gradiveq_cnn");
    assert!(ex.exists(), "{} not built", ex.display());
    let npy = std::env::temp_dir().join(format!("gradsync-conv2-{}.npy", std::process::id()));
    let out = Command::new(&ex)
        .args([
            "--steps",
            "130",
            "--lt",
            "100",
            "--out",
            npy.to_str().expect("utf-8"),
        ])
        .output()
        .expect("run example");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.trim()).expect("JSON");
    let d = v["d"].as_u64().expect("d");
    assert!((1..=768).contains(&d), "{text}");
    assert!(v["ratio"].as_f64().expect("ratio") >= 1.0);
    let loss = v["eq7_loss_mean"].as_f64().expect("eq7");
    assert!(loss.is_finite() && loss >= 0.0, "{text}");
    assert!(
        v["train_loss_last"].as_f64() < v["train_loss_first"].as_f64(),
        "the CNN learns: {text}"
    );
    let (ok, out, err) = mpirun(
        2,
        Path::new(gradsync()),
        &[
            "bench",
            "--op",
            "gradiveq",
            "--data",
            npy.to_str().expect("utf-8"),
            "--k",
            "768",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--check",
            "--json",
        ],
        Duration::from_secs(120),
    );
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with('{')).expect("JSON");
    let b: serde_json::Value = serde_json::from_str(line).expect("JSON");
    assert_eq!(b["check"], "ok", "{line}");
    std::fs::remove_file(&npy).ok();
}

/// A step in buckets (`GradSync::submit_bucket`) on real ranks: bitwise
/// the whole step, dense layers within rounding of `MPI_Allreduce`.
#[test]
fn bucketed_steps_equal_the_whole_step_under_mpirun() {
    let ex = example("bucket_check");
    assert!(ex.exists(), "{} not built", ex.display());
    for np in [1, 2, 3, 4] {
        let (ok, out, err) = mpirun(np, &ex, &["equal"], Duration::from_secs(120));
        assert!(ok, "np={np}: {err}\n{out}");
        let oks = out
            .lines()
            .filter(|l| l.starts_with("OK buckets step") && l.contains("buckets=4"))
            .count();
        assert_eq!(oks, 4 * np, "np={np}:\n{out}");
    }
}

/// A step that fails in its last bucket, after the first bucket's PowerSGD
/// layer ran, fails on every rank in both engines (whole and bucketed),
/// and the later steps agree bitwise: the PowerSGD state is rolled back.
#[test]
fn a_failed_bucketed_step_rolls_powersgd_back_under_mpirun() {
    let ex = example("bucket_check");
    for np in [1, 2, 3] {
        let (ok, out, err) = mpirun(np, &ex, &["rollback"], Duration::from_secs(120));
        assert!(ok, "np={np}: {err}\n{out}");
        let count = |pre: &str| out.lines().filter(|l| l.starts_with(pre)).count();
        assert_eq!(count("FAILED step 1 rank"), np, "np={np}:\n{out}");
        assert_eq!(count("OK buckets step"), 3 * np, "np={np}:\n{out}");
        assert!(out.contains(&format!("rank {}", np - 1)), "{out}");
    }
}

/// One rank cutting the step into other buckets fails that step on every
/// rank with the same error, within the time limit, and the next step runs.
#[test]
fn a_bucket_cut_that_differs_on_one_rank_fails_every_rank_under_mpirun() {
    let ex = example("bucket_check");
    for np in [2, 3] {
        let (ok, out, err) = mpirun(np, &ex, &["differ"], Duration::from_secs(60));
        assert!(ok, "np={np}: {err}\n{out}");
        let errs: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("DIFFER rank "))
            .map(|l| l.split_once(": ").map_or(l, |x| x.1))
            .collect();
        assert_eq!(errs.len(), np, "np={np}:\n{out}");
        assert!(errs.iter().all(|e| e == &errs[0]), "np={np}:\n{out}");
        assert!(errs[0].contains("buckets differ between ranks"), "{out}");
        assert_eq!(out.matches("OK next step").count(), np, "{out}");
    }
}
