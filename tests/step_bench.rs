//! `gradsync bench --op step` under real `mpirun`: the engine on a whole
//! layer table against the step model and `MPI_Allreduce`. Only
//! the record's consistency is asserted here; timings are for benchmarks.

mod common;
use common::{gradsync, mpirun};
use std::path::Path;
use std::time::Duration;

fn temp(name: &str, body: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gradsync-step-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let f = dir.join(name);
    std::fs::write(&f, body).expect("write");
    f
}

const LAYERS: &str = r#"{"layers": [
  {"name": "conv", "elements": 40000},
  {"name": "bn.w", "elements": 64},
  {"name": "bn.b", "elements": 64},
  {"name": "fc", "elements": 300000},
  {"name": "fc.b", "elements": 10}
]}"#;

fn run(np: usize, args: &[&str]) -> (bool, String, String) {
    mpirun(np, Path::new(gradsync()), args, Duration::from_secs(120))
}

/// `gradsync bench --op step --layers L --profile P` and `extra`, on `np` ranks.
fn run_step(np: usize, layers: &Path, prof: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut a = vec![
        "bench",
        "--op",
        "step",
        "--layers",
        layers.to_str().unwrap(),
        "--profile",
        prof.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    run(np, &a)
}

#[test]
fn step_records_agree_with_the_plan_on_1_2_and_3_ranks() {
    let layers = temp("layers.json", LAYERS);
    // A profile whose selection costs make small layers dense: the plan
    // has two groups.
    let prof = temp(
        "profile.json",
        r#"{"alpha": 2e-6, "beta": 1e-9, "select": {"trimmed": {"a": 2e-5, "b": 1e-9}}}"#,
    );
    for np in [1usize, 2, 3] {
        let (ok, out, err) = run_step(
            np,
            &layers,
            &prof,
            &["--iters", "3", "--warmup", "1", "--json"],
        );
        assert!(ok, "np={np}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON record");
        assert_eq!(v["op"], "step");
        assert_eq!(v["ranks"], np);
        assert_eq!(v["layers"], 5);
        assert_eq!(v["elements"], 340_138);
        for f in [
            "median_s",
            "predicted_s",
            "dense_mpi_median_s",
            "speedup_vs_dense",
        ] {
            assert!(v[f].as_f64().expect(f) > 0.0 || np == 1, "{f} in {out}");
        }
        assert!(v["rel_error"].is_number());
        // Every timed step, whose median is the record's.
        let mut steps: Vec<f64> = v["step_times_s"]
            .as_array()
            .expect("step_times_s")
            .iter()
            .map(|t| t.as_f64().expect("a step's seconds"))
            .collect();
        assert_eq!(steps.len(), 3, "{out}");
        steps.sort_by(f64::total_cmp);
        assert_eq!(steps[1], v["median_s"].as_f64().unwrap(), "{out}");
        assert_eq!(steps[0], v["min_s"].as_f64().unwrap(), "{out}");
        // The state probes beside the steps, priced by the profile: its
        // exchanges (none on one rank).
        let state = v["state_probes"].as_array().expect("state_probes");
        assert_eq!(state.len(), if np > 1 { 2 } else { 0 }, "{out}");
        for x in state {
            assert_eq!(x["probe"], "exchange", "{out}");
            assert!(x["measured_s"].as_f64().expect("measured_s") > 0.0, "{out}");
            // α + β·m of the profile above (it has no β curve).
            let m = x["size"].as_f64().expect("size");
            let priced = x["profile_s"].as_f64().expect("profile_s");
            assert!((priced - (2e-6 + m * 1e-9)).abs() < 1e-12, "{out}");
        }
        if np > 1 {
            assert_eq!(state[0]["size"], 65536, "{out}");
            assert_eq!(state[1]["size"], 16 << 20, "{out}");
        }
        let choices = v["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 5);
        // The same plan as `gradsync plan` on the same profile.
        let (ok, plan, err) = run(
            1,
            &[
                "plan",
                "--layers",
                layers.to_str().unwrap(),
                "--ranks",
                &np.to_string(),
                "--profile",
                prof.to_str().unwrap(),
                "--strategies",
                "dense-rabenseifner,sparse-allgather",
                "--json",
            ],
        );
        assert!(ok, "{err}");
        let plan: serde_json::Value = serde_json::from_str(plan.trim()).expect("plan JSON");
        for (c, l) in choices
            .iter()
            .zip(plan["layers"].as_array().expect("layers"))
        {
            assert_eq!(c["name"], l["name"]);
            assert_eq!(c["choice"], l["choice"], "np={np}");
        }
        if np > 1 {
            assert_eq!(c_group(choices, "bn.w"), "dense", "{out}");
            assert_eq!(c_group(choices, "fc"), "sparse", "{out}");
            let groups = v["groups"].as_array().expect("groups");
            assert_eq!(groups.len(), 2, "{out}");
            // Bytes on the wire: the fused dense buffer (bn.w, bn.b, fc.b
            // and the status word) plus the fused sparse message.
            let dense = groups.iter().find(|g| g["kind"] == "dense").expect("dense");
            assert_eq!(dense["message_bytes"], 4 * (64 + 64 + 10));
            assert!(v["wire_bytes_per_rank"].as_u64().expect("wire") < 4 * 340_138 / 50);
        }
    }
    // --compare: the same table dense-only and all-sparse in the same
    // rounds, one record each, with their own predictions.
    let (ok, out, err) = run_step(
        2,
        &layers,
        &prof,
        &["--iters", "2", "--warmup", "0", "--compare", "--json"],
    );
    assert!(ok, "{err}");
    let recs: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    let names: Vec<&str> = recs.iter().map(|r| r["config"].as_str().unwrap()).collect();
    assert_eq!(names, ["planned", "dense", "sparse", "sparse-threshold"]);
    for (r, want) in recs[1..]
        .iter()
        .zip(["dense-rabenseifner", "sparse-allgather"])
    {
        let choices = r["choices"].as_array().expect("choices");
        assert!(choices.iter().all(|c| c["choice"] == want), "{r}");
        assert_eq!(r["groups"].as_array().expect("groups").len(), 1);
        assert!(r["predicted_s"].as_f64().expect("predicted") > 0.0);
    }
    // RGC as the engine runs it without a profile: the small layers
    // (64, 64 and 10 elements) dense, the rest RGC.
    let thr = &recs[3];
    for c in thr["choices"].as_array().expect("choices") {
        let small = c["elements"].as_u64().expect("elements") < 32768;
        let want = if small {
            "dense-rabenseifner"
        } else {
            "sparse-allgather"
        };
        assert_eq!(c["choice"], want, "{thr}");
    }
    assert_eq!(thr["groups"].as_array().expect("groups").len(), 2, "{thr}");
    // The plan is predicted no slower than any of the other tables.
    let pred = |i: usize| recs[i]["predicted_s"].as_f64().unwrap();
    assert!(
        pred(0) <= pred(1) && pred(0) <= pred(2) && pred(0) <= pred(3),
        "{out}"
    );
    // The dense configuration's fused buffer is the whole table.
    assert_eq!(recs[1]["wire_bytes_per_rank"], 4 * 340_138);
    // Without a profile: the engine's defaults, no prediction.
    let (ok, out, err) = run(
        2,
        &[
            "bench",
            "--op",
            "step",
            "--layers",
            layers.to_str().unwrap(),
            "--iters",
            "2",
            "--json",
        ],
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert!(v["predicted_s"].is_null());
}

fn c_group(choices: &[serde_json::Value], name: &str) -> String {
    choices
        .iter()
        .find(|c| c["name"] == name)
        .and_then(|c| c["group"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn step_bad_inputs_name_the_flag_or_file_on_every_rank() {
    let layers = temp("bad-layers.json", LAYERS);
    let empty = temp("empty.json", r#"{"layers": []}"#);
    for (args, wants) in [
        (vec!["--layers", "3"], vec!["--layers", "layers file"]),
        (
            vec!["--layers", empty.to_str().unwrap()],
            vec![empty.to_str().unwrap(), "no layers"],
        ),
        (
            vec![
                "--layers",
                layers.to_str().unwrap(),
                "--strategies",
                "sparse-allgather",
            ],
            vec!["--strategies", "--profile or --calibrate"],
        ),
        (
            vec![
                "--layers",
                layers.to_str().unwrap(),
                "--profile",
                "/nonexistent.json",
            ],
            vec!["--profile", "/nonexistent.json"],
        ),
    ] {
        let mut a = vec!["bench", "--op", "step", "--iters", "1"];
        a.extend(args);
        let (ok, _, err) = run(2, &a);
        assert!(!ok, "{a:?} accepted");
        for w in wants {
            assert!(err.contains(w), "{w:?} not in {err}");
        }
    }
}

/// `--calibrate`: the library's calibration from inside the benchmark job,
/// written to `--profile` and used for the plan.
#[test]
fn step_calibrates_in_the_same_job() {
    let layers = temp("cal-layers.json", LAYERS);
    let out_prof =
        std::env::temp_dir().join(format!("gradsync-step-cal-{}.json", std::process::id()));
    let (ok, out, err) = mpirun(
        2,
        Path::new(gradsync()),
        &[
            "bench",
            "--op",
            "step",
            "--layers",
            layers.to_str().unwrap(),
            "--calibrate",
            "--profile",
            out_prof.to_str().unwrap(),
            "--iters",
            "2",
            "--warmup",
            "0",
            "--json",
        ],
        Duration::from_secs(300),
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert!(v["predicted_s"].as_f64().expect("predicted") > 0.0);
    let prof: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_prof).expect("profile written"))
            .expect("profile JSON");
    assert!(prof["alpha"].as_f64().expect("alpha") > 0.0);
    assert!(
        prof["dense_local"]["b"]
            .as_f64()
            .expect("dense_local fitted")
            > 0.0
    );
    // The tables past the caches (64 MiB of gradients each): RGC's at
    // three layer sizes, PowerSGD's at two shapes, both priced.
    let t = &prof["select_table"];
    assert_eq!(t["key"], "trimmed@0.001", "{prof}");
    assert_eq!(t["table_bytes"].as_f64(), Some(67108864.0), "{prof}");
    let pts = t["curve"].as_array().expect("select_table.curve");
    assert_eq!(pts.len(), 3, "{prof}");
    assert!(
        pts.iter().all(|c| c["per_byte"].as_f64() > Some(0.0)),
        "{prof}"
    );
    let psg = prof["powersgd"]["table"]
        .as_array()
        .expect("powersgd.table");
    assert_eq!(psg.len(), 2, "{prof}");
    assert!(
        psg.iter().all(|c| c["per_elem"].as_f64() > Some(0.0)),
        "{prof}"
    );
    // Beside the steps, the largest local tables the calibration timed,
    // each at the price it measured.
    let state = v["state_probes"].as_array().expect("state_probes");
    let probes: Vec<&str> = state.iter().map(|x| x["probe"].as_str().unwrap()).collect();
    assert_eq!(
        probes,
        ["exchange", "exchange", "dense-table", "rgc-table"],
        "{out}"
    );
    let dense = prof["dense_local_curve"].as_array().expect("dense curve");
    let last = dense.last().expect("a dense table");
    let bytes = last["bytes"].as_f64().unwrap();
    assert_eq!(state[2]["size"].as_f64(), Some(bytes), "{out}");
    let priced = bytes * last["per_byte"].as_f64().unwrap();
    assert!((state[2]["profile_s"].as_f64().unwrap() - priced).abs() < 1e-12 * priced.max(1.0));
    let top = pts.last().unwrap()["per_byte"].as_f64().unwrap();
    assert_eq!(state[3]["size"].as_f64(), Some(67108864.0), "{out}");
    let priced = 67108864.0 * top;
    assert!((state[3]["profile_s"].as_f64().unwrap() - priced).abs() < 1e-12 * priced.max(1.0));
    assert!(state.iter().all(|x| x["measured_s"].as_f64() > Some(0.0)));
    let _ = std::fs::remove_file(&out_prof);
}

/// A profile with local tables: the step's records time them beside the
/// steps at the sizes the profile priced, on one rank (no exchanges) and
/// on three.
#[test]
fn step_state_probes_time_the_profiles_local_tables() {
    let layers = temp("local-layers.json", LAYERS);
    let prof = temp(
        "local-profile.json",
        r#"{"alpha": 2e-6, "beta": 1e-9,
            "select": {"trimmed": {"a": 2e-5, "b": 1e-9}, "trimmed@0.01": {"a": 2e-5, "b": 1e-9}},
            "dense_local_curve": [{"bytes": 65536, "per_byte": 3e-10},
                                  {"bytes": 262144, "per_byte": 5e-10}],
            "select_table": {"key": "trimmed@0.01", "table_bytes": 1048576,
                             "curve": [{"bytes": 65536, "per_byte": 1e-9},
                                       {"bytes": 262144, "per_byte": 2e-9}]}}"#,
    );
    for np in [1usize, 3] {
        let (ok, out, err) = run_step(
            np,
            &layers,
            &prof,
            &["--iters", "2", "--warmup", "0", "--json"],
        );
        assert!(ok, "np={np}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON record");
        let state = v["state_probes"].as_array().expect("state_probes");
        let local: Vec<_> = state.iter().filter(|x| x["probe"] != "exchange").collect();
        assert_eq!(
            state.len() - local.len(),
            if np > 1 { 2 } else { 0 },
            "{out}"
        );
        assert_eq!(local.len(), 2, "{out}");
        assert_eq!(local[0]["probe"], "dense-table", "{out}");
        assert_eq!(local[0]["size"], 262144, "{out}");
        assert!((local[0]["profile_s"].as_f64().unwrap() - 262144.0 * 5e-10).abs() < 1e-15);
        assert_eq!(local[1]["probe"], "rgc-table", "{out}");
        assert_eq!(local[1]["size"], 1048576, "{out}");
        assert!((local[1]["profile_s"].as_f64().unwrap() - 1048576.0 * 2e-9).abs() < 1e-15);
        assert!(
            local.iter().all(|x| x["measured_s"].as_f64() > Some(0.0)),
            "{out}"
        );
    }
    // Tables no calibration writes (a TiB each, a density past 1) are
    // not probed; the step runs without them.
    let huge = temp(
        "huge-profile.json",
        r#"{"alpha": 2e-6, "beta": 1e-9,
            "select": {"trimmed": {"a": 2e-5, "b": 1e-9}, "trimmed@2": {"a": 2e-5, "b": 1e-9}},
            "dense_local_curve": [{"bytes": 1099511627776, "per_byte": 3e-10}],
            "select_table": {"key": "trimmed@2", "table_bytes": 1048576,
                             "curve": [{"bytes": 262144, "per_byte": 2e-9}]}}"#,
    );
    let (ok, out, err) = run_step(
        1,
        &layers,
        &huge,
        &["--iters", "2", "--warmup", "0", "--json"],
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON record");
    assert_eq!(v["state_probes"].as_array().map(Vec::len), Some(0), "{out}");
}

/// `--sparse-exchange` gives the engine its exchange of the RGC
/// layers' pairs; the record says which was asked for and which ran in
/// each timed step; `auto` needs a profile; an unknown value names the
/// flag on every rank.
#[test]
fn step_sparse_exchange_is_passed_to_the_engine_and_reported() {
    let layers = temp("ex-layers.json", LAYERS);
    let prof = temp(
        "ex-profile.json",
        r#"{"alpha": 2e-6, "beta": 1e-9, "select": {"trimmed": {"a": 2e-5, "b": 1e-9}}}"#,
    );
    let (l, pr) = (layers.to_str().unwrap(), prof.to_str().unwrap());
    let base = [
        "bench",
        "--op",
        "step",
        "--layers",
        l,
        "--profile",
        pr,
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
    ];
    for (np, ex) in [
        (2, "allreduce"),
        (3, "allreduce"),
        (2, "allgather"),
        (2, "auto"),
        (3, "auto"),
    ] {
        let mut a = base.to_vec();
        a.extend(["--sparse-exchange", ex]);
        let (ok, out, err) = run(np, &a);
        assert!(ok, "np={np} {ex}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON record");
        assert_eq!(v["sparse_exchange"], ex, "{out}");
        assert_eq!(
            c_group(v["choices"].as_array().unwrap(), "fc"),
            "sparse",
            "{out}"
        );
        let ran = v["exchanges"].as_object().expect("exchanges");
        assert_eq!(
            ran.values().map(|x| x.as_u64().unwrap()).sum::<u64>(),
            3,
            "every timed step: {out}"
        );
        match ex {
            "auto" => assert!(
                ran.keys().all(|k| k == "allgather" || k == "allreduce"),
                "one node: never hierarchical: {out}"
            ),
            _ => assert_eq!(ran.keys().collect::<Vec<_>>(), [ex], "{out}"),
        }
        // Every step measures the fill but under a configured allgatherv
        // (`auto`'s allgatherv steps count it as they unpack).
        assert_eq!(v["fill_estimate"].is_number(), ex != "allgather", "{out}");
        let sparse = v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["kind"] == "sparse")
            .expect("sparse group")
            .clone();
        let want = if ex == "auto" {
            "sparse-auto".to_string()
        } else {
            format!("sparse-{ex}")
        };
        assert_eq!(sparse["algorithm"], want.as_str(), "{out}");
    }
    // The text output names the exchange too.
    let mut a = base[..base.len() - 1].to_vec();
    a.extend(["--sparse-exchange", "allreduce"]);
    let (ok, out, err) = run(2, &a);
    assert!(ok, "{err}");
    assert!(
        out.contains("sparse exchange allreduce (steps {\"allreduce\": 3}"),
        "{out}"
    );
    // Bad values, and auto without a profile: the flag named, every rank fails.
    for (args, wants) in [
        (
            vec!["--profile", pr, "--sparse-exchange", "tree"],
            vec!["--sparse-exchange \"tree\"", "auto"],
        ),
        (
            vec!["--sparse-exchange", "auto"],
            vec!["--sparse-exchange auto", "--profile or --calibrate"],
        ),
    ] {
        let mut a = vec!["bench", "--op", "step", "--iters", "1", "--layers", l];
        a.extend(args);
        let (ok, _, err) = run(2, &a);
        assert!(!ok, "{a:?} accepted");
        for w in wants {
            assert!(err.contains(w), "{w:?} not in {err}");
        }
    }
}

/// The engine runs the dense algorithm `--strategies` names (the
/// hierarchical one included), and with several named the model's choice
/// each step (`allreduce = "auto"`); the record's dense group says which.
#[test]
fn step_dense_group_runs_the_named_algorithm() {
    let layers = temp("layers-dense.json", LAYERS);
    let prof = temp("profile-dense.json", r#"{"alpha": 2e-6, "beta": 1e-9}"#);
    for (strategies, algo) in [
        ("dense-hierarchical", "dense-hierarchical"),
        ("dense-ring", "dense-ring"),
        ("dense-rabenseifner,dense-ring", "dense-auto"),
    ] {
        let (ok, out, err) = run_step(
            3,
            &layers,
            &prof,
            &[
                "--strategies",
                strategies,
                "--iters",
                "2",
                "--warmup",
                "0",
                "--json",
            ],
        );
        assert!(ok, "{strategies}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON record");
        let g = &v["groups"][0];
        assert_eq!(g["kind"], "dense", "{strategies}: {v}");
        assert_eq!(g["algorithm"], algo, "{strategies}: {v}");
        assert!(g["predicted_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
        assert!(g["measured_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
    }
}

/// A `--strategies` collective that `--sparse-exchange` does not run ends
/// the job with an error naming both flags (every rank finds it from the
/// agreed flags), not a hang.
#[test]
fn step_strategy_outside_the_exchange_fails_on_every_rank() {
    let layers = temp("layers-mismatch.json", LAYERS);
    let prof = temp("profile-mismatch.json", r#"{"alpha": 2e-6, "beta": 1e-9}"#);
    let (ok, out, err) = run_step(
        3,
        &layers,
        &prof,
        &[
            "--strategies",
            "dense-rabenseifner,sparse-allreduce",
            "--sparse-exchange",
            "allgather",
            "--iters",
            "1",
        ],
    );
    assert!(!ok, "{out}");
    assert!(
        err.contains("--strategies sparse-allreduce")
            && err.contains("--sparse-exchange allgather"),
        "{err}"
    );
}
