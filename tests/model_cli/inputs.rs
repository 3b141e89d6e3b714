//! What the model commands refuse: files, entries, fields, flags and
//! numbers that are wrong or would change nothing are errors naming them,
//! with no panic and no output that looks like a price.

use super::*;

#[test]
fn layer_sizes_whose_bytes_overflow_are_errors_not_zero() {
    // 2^62 elements: 4·n wrapped to `bytes: 0`.
    let mut args = vec![
        "predict",
        "--elements",
        "4611686018427387904",
        "--ranks",
        "4",
    ];
    args.extend(NET);
    args.push("--json");
    let (ok, out, err) = gradsync(&args);
    assert!(!ok, "accepted: {out}");
    assert!(
        err.contains("--elements 4611686018427387904") && err.contains("do not fit"),
        "{err}"
    );
    // The largest that fits is fine.
    let max = (usize::MAX / 4).to_string();
    let mut args = vec!["predict", "--elements", &max, "--ranks", "4"];
    args.extend(NET);
    args.push("--json");
    let (ok, out, err) = gradsync(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["bytes"].as_u64(), Some((usize::MAX / 4 * 4) as u64));
    // --bytes that are not whole f32 elements (3 bytes gave 0 elements).
    let mut args = vec!["predict", "--bytes", "3", "--ranks", "4"];
    args.extend(NET);
    let (ok, _, err) = gradsync(&args);
    assert!(
        !ok && err.contains("--bytes 3") && err.contains("multiple of 4"),
        "{err}"
    );
    // The same overflow in a layers file names the file, layer and field.
    let f = temp_file(
        "overflow",
        "layers.json",
        r#"{"layers": [{"name": "fc", "elements": 4611686018427387904}]}"#,
    );
    let mut args = vec!["plan", "--layers", f.to_str().unwrap(), "--ranks", "4"];
    args.extend(NET);
    let (ok, _, err) = gradsync(&args);
    assert!(!ok, "accepted");
    for want in [
        f.to_str().unwrap(),
        "layer 0 (\"fc\")",
        "\"elements\"",
        "do not fit",
    ] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
    // Two layers that fit alone but not together (their sum was planned).
    let f = temp_file(
        "overflow",
        "two.json",
        r#"[{"name": "a", "elements": 4600000000000000000},
            {"name": "b", "elements": 4600000000000000000}]"#,
    );
    let mut args = vec!["plan", "--layers", f.to_str().unwrap(), "--ranks", "4"];
    args.extend(NET);
    let (ok, out, err) = gradsync(&args);
    assert!(!ok, "accepted: {out}");
    for want in [f.to_str().unwrap(), "9200000000000000000", "in all"] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
}

#[test]
fn file_errors_name_the_file_entry_and_field() {
    // A missing profile: the I/O error names the path.
    let mut args = vec!["predict", "--elements", "10", "--ranks", "4"];
    args.extend(["--profile", "/nonexistent/gradsync-p.json"]);
    let (ok, _, err) = gradsync(&args);
    assert!(!ok && err.contains("/nonexistent/gradsync-p.json"), "{err}");
    assert!(err.contains("No such file"), "{err}");
    // A truncated profile ("EOF while parsing" without a file name).
    let f = temp_file(
        "files",
        "truncated.json",
        r#"{"version": 1, "alpha": 1e-6, "be"#,
    );
    let args = [
        "predict",
        "--elements",
        "10",
        "--ranks",
        "4",
        "--profile",
        f.to_str().unwrap(),
    ];
    let (ok, _, err) = gradsync(&args);
    assert!(!ok, "accepted");
    assert!(
        err.contains(f.to_str().unwrap()) && err.contains("EOF") && err.contains("profile"),
        "{err}"
    );
    // A profile with a negative constant names the file and the constant.
    let f = temp_file(
        "files",
        "negative.json",
        r#"{"version": 1, "alpha": -1, "beta": 1e-9, "gamma_reduce": 0, "gamma_unpack": 0}"#,
    );
    let args = [
        "predict",
        "--elements",
        "10",
        "--ranks",
        "4",
        "--profile",
        f.to_str().unwrap(),
    ];
    let (ok, _, err) = gradsync(&args);
    assert!(
        !ok && err.contains(f.to_str().unwrap()) && err.contains("alpha = -1"),
        "{err}"
    );
    // A device or a huge file given as the profile or the layers file: an
    // error naming it, not a read that fills the memory.
    if std::path::Path::new("/dev/zero").exists() {
        for args in [
            vec![
                "predict",
                "--elements",
                "10",
                "--ranks",
                "4",
                "--profile",
                "/dev/zero",
            ],
            vec![
                "plan",
                "--layers",
                "/dev/zero",
                "--ranks",
                "4",
                "--alpha",
                "1e-6",
                "--bandwidth",
                "1e9",
            ],
        ] {
            let (ok, _, err) = gradsync(&args);
            assert!(
                !ok && err.contains("/dev/zero") && err.contains("not a regular file (a device)"),
                "{args:?}: {err}"
            );
        }
    }
    // A regular file past the size limit (a sparse one: no disk used).
    let huge = std::env::temp_dir().join(format!("gs-huge-{}.json", std::process::id()));
    std::fs::File::create(&huge)
        .and_then(|f| f.set_len((64 << 20) + 1))
        .expect("sparse file");
    let h = huge.to_str().unwrap();
    let (ok, _, err) = gradsync(&[
        "predict",
        "--elements",
        "10",
        "--ranks",
        "4",
        "--profile",
        h,
    ]);
    std::fs::remove_file(&huge).ok();
    assert!(
        !ok && err.contains(h) && err.contains("larger than"),
        "{err}"
    );
    // A codec's wire bytes per element out of range (it panicked `plan`:
    // a NaN message size) and a negative fit: errors naming the field.
    for (name, field, want) in [
        (
            "bpe.json",
            r#""codecs": {"3lc": {"encode": {"a": 0, "b": 1e-9}, "decode": {"a": 0, "b": 1e-9}, "bytes_per_element": -1e308}}"#,
            "codecs.3lc.bytes_per_element = -1e308",
        ),
        (
            "bpe-nan.json",
            r#""codecs": {"qsgd": {"encode": {"a": 0, "b": 1e-9}, "decode": {"a": 0, "b": 1e-9}, "bytes_per_element": 1e308}}"#,
            "codecs.qsgd.bytes_per_element",
        ),
        (
            "allgather.json",
            r#""allgather": {"a": -9.2e18, "b": 0}"#,
            "allgather = ",
        ),
    ] {
        let f = temp_file(
            "files",
            name,
            &format!(
                r#"{{"version": 1, "alpha": 1e-6, "beta": 1e-9, "gamma_reduce": 0, "gamma_unpack": 0, {field}}}"#
            ),
        );
        let path = f.to_str().unwrap();
        for args in [
            vec![
                "predict",
                "--elements",
                "10",
                "--ranks",
                "4",
                "--profile",
                path,
            ],
            vec![
                "plan",
                "--layers",
                "examples/layers/resnet50.json",
                "--ranks",
                "8",
                "--profile",
                path,
            ],
        ] {
            let (ok, _, err) = gradsync(&args);
            assert!(
                !ok && err.contains(path) && err.contains(want),
                "{args:?}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    // Layers files: "data did not match any variant of untagged enum
    // LayersFile" named neither the entry nor the field.
    for (name, contents, wants) in [
        (
            "string.json",
            r#"{"layers": [{"name": "a", "elements": 1}, {"name": "conv2", "elements": "big"}]}"#,
            vec!["layer 1 (\"conv2\")", "field \"elements\"", "not a number"],
        ),
        (
            "noname.json",
            r#"[{"elements": 5}]"#,
            vec!["layer 0", "missing field \"name\""],
        ),
        (
            "negative.json",
            r#"[{"name": "x", "elements": 3}, {"name": "y", "elements": -3}]"#,
            vec![
                "layer 1 (\"y\")",
                "field \"elements\"",
                "non-negative integer",
            ],
        ),
        (
            "missing.json",
            r#"{"layers": [{"name": "fc"}]}"#,
            vec!["layer 0 (\"fc\")", "missing field \"elements\""],
        ),
        (
            "unknown.json",
            r#"[{"name": "a", "elements": 5, "strategy": "dense"}]"#,
            vec!["layer 0 (\"a\")", "unknown field \"strategy\""],
        ),
        (
            "shape.json",
            r#"{"model": "x"}"#,
            vec!["no \"layers\" field"],
        ),
        (
            "broken.json",
            r#"{"layers": [{"name""#,
            vec!["not a layers file", "EOF"],
        ),
    ] {
        let f = temp_file("files", name, contents);
        let mut args = vec!["plan", "--layers", f.to_str().unwrap(), "--ranks", "4"];
        args.extend(NET);
        let (ok, _, err) = gradsync(&args);
        assert!(!ok, "{name} accepted");
        assert!(err.contains(f.to_str().unwrap()), "{name}: {err}");
        for w in wants {
            assert!(err.contains(w), "{name}: {w:?} not in {err}");
        }
        assert!(!err.contains("untagged"), "{err}");
    }
    // A plot that cannot be written names its path.
    let mut args = vec![
        "crossover",
        "--ranks",
        "4",
        "--plot",
        "/nonexistent/dir/x.svg",
    ];
    args.extend(NET);
    let (ok, _, err) = gradsync(&args);
    assert!(!ok && err.contains("/nonexistent/dir/x.svg"), "{err}");
}

/// Rank counts past the model's limit (2^24) are errors naming it, on
/// every predictor (`predict` at 2^63 panicked on a capacity overflow; at
/// 2^64 − 1 and at 65536 ranks it ran for minutes: the pairwise schedule
/// was counted rank by rank). 65536 ranks is now answered at once.
#[test]
fn rank_counts_past_the_limit_are_errors_and_large_ones_are_fast() {
    let net = ["--alpha", "1e-5", "--bandwidth", "1e9"];
    for r in ["16777217", "9223372036854775807", "18446744073709551615"] {
        for cmd in [&["predict", "--bytes", "4K"][..], &["crossover"][..]] {
            let args: Vec<&str> = cmd
                .iter()
                .chain(&["--ranks", r])
                .chain(&net)
                .copied()
                .collect();
            let (ok, _, err) = gradsync(&args);
            assert!(!ok && err.contains("limit of 16777216"), "{args:?}: {err}");
        }
    }
    let (ok, _, err) = gradsync(&[
        "scale",
        "--layers",
        "examples/layers/resnet50.json",
        "--ranks",
        "1..1099511627776",
        "--alpha",
        "1e-5",
        "--bandwidth",
        "1e9",
    ]);
    assert!(
        !ok && err.contains("1099511627776 is past the model's limit"),
        "{err}"
    );
    let t = std::time::Instant::now();
    let (ok, out, err) = gradsync(&[
        "predict",
        "--bytes",
        "4K",
        "--ranks",
        "65536",
        "--alpha",
        "1e-5",
        "--bandwidth",
        "1e9",
    ]);
    assert!(ok && out.contains("dense-ring"), "{out}\n{err}");
    eprintln!("predict at 65536 ranks: {:?}", t.elapsed());
}

/// An empty layer table and a layer of no elements are errors naming the
/// file or flag (they were priced: a step of "-0.000 ms", "NaNx over
/// dense"); a zero-element layer inside a table adds nothing to the step
/// (its marginal time was negative).
#[test]
fn empty_tables_and_empty_layers() {
    let d = std::env::temp_dir().join(format!("gradsync-empty-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let (empty, zero) = (d.join("empty.json"), d.join("zero.json"));
    std::fs::write(&empty, r#"{"layers": []}"#).unwrap();
    std::fs::write(
        &zero,
        r#"[{"name": "e", "elements": 0}, {"name": "w", "elements": 100000}]"#,
    )
    .unwrap();
    let net = ["--ranks", "8", "--alpha", "1e-5", "--bandwidth", "1e9"];
    let with =
        |a: &[&str]| -> Vec<String> { a.iter().chain(&net).map(|s| s.to_string()).collect() };
    let run = |a: Vec<String>| gradsync(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let (ok, _, err) = run(with(&["plan", "--layers", empty.to_str().unwrap()]));
    assert!(
        !ok && err.contains("empty.json") && err.contains("no layers"),
        "{err}"
    );
    for flag in [["--bytes", "0"], ["--elements", "0"]] {
        let (ok, _, err) = run(with(&["predict", flag[0], flag[1]]));
        assert!(!ok && err.contains("0 elements"), "{flag:?}: {err}");
    }
    let (ok, out, err) = run(with(&[
        "plan",
        "--layers",
        zero.to_str().unwrap(),
        "--json",
    ]));
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers[0]["seconds"].as_f64(), Some(0.0), "{out}");
    assert!(layers[1]["seconds"].as_f64().unwrap() > 0.0, "{out}");
    // Tables a model could not have: each an error naming the file and
    // the entry (a table of only empty layers printed "NaNx over dense").
    for (file, body, want) in [
        (
            "zeros.json",
            r#"[{"name": "a", "elements": 0}]"#,
            "every layer has 0 elements",
        ),
        (
            "dup.json",
            r#"[{"name": "a", "elements": 4}, {"name": "a", "elements": 8}]"#,
            "layer 1 (\"a\"): the same name as layer 0",
        ),
        (
            "noname.json",
            r#"[{"name": "", "elements": 4}]"#,
            "layer 0 (\"\"): field \"name\" must be non-empty",
        ),
        (
            "total.json",
            r#"{"total_elements": 13, "layers": [{"name": "a", "elements": 4}, {"name": "b", "elements": 8}]}"#,
            "\"total_elements\" is 13, but the layers hold 12 elements",
        ),
    ] {
        let path = d.join(file);
        std::fs::write(&path, body).unwrap();
        let (ok, _, err) = run(with(&["plan", "--layers", path.to_str().unwrap()]));
        assert!(
            !ok && err.contains(file) && err.contains(want),
            "{file}: {err}"
        );
    }
    std::fs::remove_dir_all(&d).ok();
}

/// Constants that overflow the model's times are an error naming them
/// (`predict --json` wrote `null` for every time beside a choice, and
/// `scale` times of 1.8e308 s, with status 0).
#[test]
fn overflowing_constants_are_errors() {
    let slow = ["--alpha", "1e-5", "--bandwidth", "1e-300"];
    let runs: [Vec<&str>; 2] = [
        ["predict", "--bytes", "1G", "--ranks", "4096", "--json"]
            .into_iter()
            .chain(slow)
            .collect(),
        [
            "scale",
            "--layers",
            "examples/layers/resnet50.json",
            "--ranks",
            "8,64",
            "--json",
        ]
        .into_iter()
        .chain(slow)
        .collect(),
    ];
    for args in runs {
        let (ok, out, err) = gradsync(&args);
        assert!(
            !ok && out.is_empty()
                && err.contains("--bandwidth) overflow")
                && (err.contains("the predicted time of strategy ")
                    || err.contains("the predicted time of layer \"")),
            "{args:?}: {out}{err}"
        );
    }
}

/// Flags that would change nothing or make no sense are errors naming
/// them: a negative selection cost, `crossover` with the strategies'
/// roles swapped, the link's constants without `--ranks-per-node` (one
/// node: no link), and a list with an empty item.
#[test]
fn flags_that_would_do_nothing_are_errors() {
    let base = ["--alpha", "5e-6", "--bandwidth", "1e9"];
    let run = |args: &[&str]| {
        let mut v: Vec<&str> = args.to_vec();
        v.extend_from_slice(&base);
        gradsync(&v)
    };
    let predict = |extra: &[&str]| {
        let mut v = vec!["predict", "--bytes", "16M", "--ranks", "8"];
        v.extend_from_slice(extra);
        run(&v)
    };
    let (ok, _, err) = predict(&["--select-cost=-1"]);
    assert!(
        !ok && err.contains("--select-cost -1: must be a finite number of seconds ≥ 0"),
        "{err}"
    );
    let (ok, _, err) = run(&["crossover", "--ranks", "8", "--sparse", "dense-ring"]);
    assert!(
        !ok && err.contains("--sparse dense-ring: a dense strategy"),
        "{err}"
    );
    let (ok, _, err) = run(&["crossover", "--ranks", "8", "--dense", "sparse-allreduce"]);
    assert!(
        !ok && err.contains("--dense sparse-allreduce: not a dense strategy"),
        "{err}"
    );
    for (flag, v) in [("--inter-alpha", "1e-5"), ("--inter-bandwidth", "1e9")] {
        let (ok, _, err) = predict(&[flag, v]);
        assert!(!ok && err.contains("--ranks-per-node"), "{flag}: {err}");
        let (ok, _, err) = predict(&[flag, v, "--ranks-per-node", "2"]);
        assert!(ok, "{flag} with --ranks-per-node: {err}");
    }
    let (ok, _, err) = predict(&["--strategies", "dense-ring,,sparse-allgather"]);
    assert!(!ok && err.contains("an empty item"), "{err}");
    let (ok, _, err) = predict(&["--strategies", "dense-ring,sparse-allgather,"]);
    assert!(ok, "a trailing comma is fine: {err}");
    // crossover compares --sparse with --dense: --strategies was ignored.
    let (ok, _, err) = run(&["crossover", "--ranks", "8", "--strategies", "dense-ring"]);
    assert!(
        !ok && err.contains("--strategies \"dense-ring\": crossover compares"),
        "{err}"
    );
    // The plots are SVG: an SVG named x.png opened as a broken image.
    let (ok, _, err) = run(&["crossover", "--ranks", "8", "--plot", "/tmp/x.png"]);
    assert!(
        !ok && err.contains("--plot /tmp/x.png: the plot is SVG"),
        "{err}"
    );
    let (ok, _, err) = run(&[
        "scale",
        "--layers",
        "examples/layers/resnet50.json",
        "--ranks",
        "8..16",
        "--plot",
        "/tmp/x.png",
    ]);
    assert!(
        !ok && err.contains("--plot /tmp/x.png: the plot is SVG"),
        "{err}"
    );
}

/// `--ranks-per-node` past `--ranks` was clamped to one node, dropping the
/// `--inter-*` level without a word; equal is one node, and fine.
#[test]
fn ranks_per_node_past_the_ranks_is_an_error() {
    let p = "docs/scale/profile-2x2-1gbit.json";
    let layers = "examples/layers/resnet50.json";
    for args in [
        vec!["predict", "--elements", "1000000", "--ranks", "8"],
        vec!["plan", "--layers", layers, "--ranks", "8"],
        vec!["crossover", "--ranks", "8"],
    ] {
        let mut bad = args.clone();
        bad.extend(["--profile", p, "--ranks-per-node", "100"]);
        let (ok, out, err) = gradsync(&bad);
        assert!(!ok, "{bad:?} accepted: {out}");
        assert!(
            err.contains("--ranks-per-node 100 is more than --ranks 8"),
            "{bad:?}: {err}"
        );
        let mut fine = args.clone();
        fine.extend(["--profile", p, "--ranks-per-node", "8"]);
        let (ok, _, err) = gradsync(&fine);
        assert!(ok, "{fine:?}: {err}");
    }
}

/// Output that cannot be written (a full disk, here `/dev/full`) is an
/// error naming standard output, not a panic with a backtrace.
#[test]
fn unwritable_standard_output_is_an_error_not_a_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("SKIP: no /dev/full on this machine");
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradsync"))
        .args(["predict", "--elements", "1000", "--ranks", "8", "--json"])
        .args(NET)
        .stdout(full)
        .output()
        .expect("run gradsync");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("standard output") && !err.contains("panicked"),
        "{err}"
    );
}

/// Found by a hostile review of the model CLI: `scale` with every swept
/// count inside one node (its `--inter-*` ignored) is refused as `plan`
/// refuses it; a key given twice in a layers file is an error naming it;
/// `plan` on one rank with no costs prints a speedup of 1, not NaN (JSON
/// null); `--inter-bandwidth` drops the profile's burst credit (the
/// measured link's token bucket made a 100 Mbit/s link as fast as 1 Gbit/s
/// for the first 262 KB).
#[test]
fn model_cli_review_findings() {
    let d = std::env::temp_dir().join(format!("gradsync-review-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let prof = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/scale/profile-2x2-1gbit-burst.json"
    );
    let layers = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/layers/resnet50.json");
    let (ok, _, err) = gradsync(&[
        "scale",
        "--layers",
        layers,
        "--ranks",
        "8..64",
        "--ranks-per-node",
        "128",
        "--inter-bandwidth",
        "1",
        "--profile",
        prof,
    ]);
    assert!(!ok && err.contains("--ranks-per-node 128"), "{err}");
    for (file, text, want) in [
        (
            "dup.json",
            r#"[{"name": "a", "name": "b", "elements": 1}]"#,
            "duplicate field `name`",
        ),
        (
            "dup2.json",
            r#"{"layers": [], "layers": [{"name": "a", "elements": 9}]}"#,
            "duplicate field `layers`",
        ),
        (
            "dup3.json",
            r#"{"layers": 5, "layers": [{"name": "a", "elements": 9}]}"#,
            "duplicate field `layers`",
        ),
    ] {
        let path = d.join(file);
        std::fs::write(&path, text).unwrap();
        let (ok, _, err) = gradsync(&[
            "plan",
            "--layers",
            path.to_str().unwrap(),
            "--ranks",
            "8",
            "--alpha",
            "1e-5",
            "--bandwidth",
            "1e9",
        ]);
        assert!(!ok && err.contains(want) && err.contains(file), "{err}");
    }
    let (ok, out, err) = gradsync(&[
        "plan",
        "--layers",
        layers,
        "--ranks",
        "1",
        "--alpha",
        "1e-5",
        "--bandwidth",
        "1e9",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["speedup"].as_f64(), Some(1.0), "{out}");
    let secs = |extra: &[&str]| -> f64 {
        let mut a = vec![
            "predict",
            "--bytes",
            "256K",
            "--ranks",
            "16",
            "--ranks-per-node",
            "4",
            "--profile",
            prof,
            "--json",
            "--strategies",
            "dense-rabenseifner",
        ];
        a.extend(extra);
        let (ok, out, err) = gradsync(&a);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["strategies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == "dense-rabenseifner")
            .unwrap()["seconds"]
            .as_f64()
            .unwrap()
    };
    let (slow, fast) = (
        secs(&["--inter-bandwidth", "1.25e7"]),
        secs(&["--inter-bandwidth", "1.25e8"]),
    );
    // 256 KiB over 16 ranks: the crossing steps move ~100 KB a rank, with
    // 4 ranks on a link; 10x the bandwidth is far more than 2x the time.
    assert!(
        slow > 5.0 * fast,
        "100 Mbit/s {slow} s vs 1 Gbit/s {fast} s"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// Negative numbers reach the range checks (not clap's "unexpected
/// argument"), a zero-element layer is refused as Python's `predict`
/// refuses it, and a tiny density prints in scientific notation.
#[test]
fn numbers_out_of_range_name_their_flag() {
    for (args, want) in [
        (
            vec!["--alpha", "-1", "--bandwidth", "1e9"],
            "--alpha -1: must be a finite number",
        ),
        (
            vec!["--alpha", "1e-6", "--bandwidth", "-5"],
            "--bandwidth -5: must be a positive number",
        ),
        (
            vec![
                "--alpha",
                "1e-6",
                "--bandwidth",
                "1e9",
                "--gamma-reduce",
                "-1e-9",
            ],
            "--gamma-reduce -0.000000001: must be a finite number",
        ),
        (
            vec!["--alpha", "1e-6", "--bandwidth", "1e9", "--density", "-0.5"],
            "--density -0.5: must lie in (0, 1]",
        ),
    ] {
        let mut a = vec!["predict", "--elements", "1000", "--ranks", "4"];
        a.extend(args);
        let (ok, _, err) = gradsync(&a);
        assert!(!ok && err.contains(want), "{a:?}: {err}");
    }
    // A layer of 0 elements, by either flag.
    for (flag, want) in [
        ("--elements", "--elements 0: a layer of 0 elements"),
        ("--bytes", "--bytes 0: a layer of 0 elements"),
    ] {
        let a = [
            "predict",
            flag,
            "0",
            "--ranks",
            "4",
            "--alpha",
            "1e-6",
            "--bandwidth",
            "1e9",
        ];
        let (ok, _, err) = gradsync(&a);
        assert!(!ok && err.contains(want), "{a:?}: {err}");
    }
    let (ok, out, err) = gradsync(&[
        "predict",
        "--elements",
        "1000",
        "--ranks",
        "4",
        "--alpha",
        "1e-6",
        "--bandwidth",
        "1e9",
        "--density",
        "1e-308",
    ]);
    assert!(ok && out.contains("density 1e-308"), "{out}{err}");
    assert!(out.lines().all(|l| l.len() < 200), "{out}");
}

/// A bad `--ranks` list is named by its start and length, not echoed whole.
#[test]
fn a_long_ranks_list_is_not_echoed_whole() {
    let list: Vec<String> = (2..3000).map(|i| i.to_string()).collect();
    let ranks = format!("{},x", list.join(","));
    let layers = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/layers/resnet50.json");
    let (ok, _, err) = gradsync(&[
        "scale",
        "--layers",
        layers,
        "--ranks",
        &ranks,
        "--alpha",
        "5e-6",
        "--bandwidth",
        "1e9",
    ]);
    assert!(
        !ok && err.contains("--ranks \"2,3,4,5,6,7,8,9,10,11,12,13,14,15,"),
        "{err}"
    );
    assert!(
        err.contains("characters)") && err.contains("\"x\" is not a rank count"),
        "{err}"
    );
    assert!(err.len() < 300, "{err}");
}
