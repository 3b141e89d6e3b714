//! What the model commands compute: `predict`'s JSON equals the formulas,
//! `plan`, `scale` and `crossover` choose and sweep as the prices say,
//! flags and profile curves override each other as documented, and
//! PowerSGD is offered where the profile prices it.

use super::*;

#[test]
fn predict_json_equals_the_formulas() {
    let (al, bw, gr, gu, sc) = (4e-6f64, 1.25e8f64, 2e-10f64, 9e-10f64, 3e-9f64);
    let be = 1.0 / bw;
    for p in [1usize, 2, 3, 4, 6, 7, 8, 13, 64] {
        for (n, d) in [
            (1000usize, 0.01f64),
            (1usize << 20, 0.001),
            (3_000_001, 0.05),
        ] {
            let (ok, out, err) = gradsync(&[
                "predict",
                "--elements",
                &n.to_string(),
                "--ranks",
                &p.to_string(),
                "--density",
                &d.to_string(),
                "--alpha",
                &al.to_string(),
                "--bandwidth",
                &bw.to_string(),
                "--gamma-reduce",
                &gr.to_string(),
                "--gamma-unpack",
                &gu.to_string(),
                "--select-cost",
                &sc.to_string(),
                "--gradiveq-ratio",
                "8",
                "--json",
            ]);
            assert!(ok, "{err}");
            let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
            let t = |name: &str| {
                v["strategies"]
                    .as_array()
                    .expect("strategies")
                    .iter()
                    .find(|s| s["name"] == name)
                    .and_then(|s| s["seconds"].as_f64())
                    .unwrap_or_else(|| panic!("{name} in {out}"))
            };
            let pf = p as f64;
            let lg = if p == 1 { 0.0 } else { (pf).log2().ceil() };
            let nb = 4.0 * n as f64;
            let k = (d * n as f64).ceil();
            let f = (pf - 1.0) / pf;
            // Codec header + RedSync's unit; +32: the engine's fused
            // header and table-of-contents entry.
            let m = 16.0 + 8.0 * k;
            let mq = 20.0 + 4.0 * k;
            let sel = sc * n as f64;
            let sparse = sel + lg * al + (pf - 1.0) * (m + 32.0) * be + pf * m * gu;
            let quant = sel + lg * al + (pf - 1.0) * (mq + 32.0) * be + pf * mq * gu;
            let mut raben = 2.0 * lg * al + 2.0 * f * nb * be + f * nb * gr;
            if p > 1 && !p.is_power_of_two() {
                // The documented fold term.
                raben += al + 2.0 * nb * be + 0.5 * nb * gr;
            }
            let ring = 2.0 * (pf - 1.0) * al + 2.0 * f * nb * be + f * nb * gr;
            let cb = nb / 8.0;
            let gring = 2.0 * (pf - 1.0) * al + 2.0 * f * cb * be + f * cb * gr;
            for (name, want) in [
                ("sparse-allgather", sparse),
                ("sparse-allgather-quant", quant),
                ("dense-rabenseifner", raben),
                ("dense-ring", ring),
                ("gradiveq-ring", gring),
            ] {
                assert!(
                    rel(t(name), want) < 1e-9,
                    "{name} p={p} n={n}: {} vs {want}",
                    t(name)
                );
            }
            // The choice is the fastest strategy the engine runs
            // (gradiveq-ring is listed, never chosen unless named; codecs
            // the profile has no fit for are listed, never chosen).
            let choice = v["choice"].as_str().expect("choice");
            let named = [
                "dense-rabenseifner",
                "dense-ring",
                "sparse-allgather",
                "sparse-allgather-quant",
                "dense-hierarchical",
                "sparse-allreduce",
                "sparse-hierarchical",
            ];
            assert!(named.contains(&choice), "{choice}");
            let min = v["strategies"]
                .as_array()
                .expect("strategies")
                .iter()
                .filter(|s| named.iter().any(|n| s["name"] == *n))
                .map(|s| s["seconds"].as_f64().expect("seconds"))
                .fold(f64::INFINITY, f64::min);
            assert_eq!(t(choice), min, "choice is the fastest the engine runs");
        }
    }
}

#[test]
fn redsync_rules_and_traffic_remark() {
    // RedSync §5.4: 3.5 GB/s, p = 8: allreduce below ~128 KB, sparse above.
    let net = [
        "--alpha",
        "5e-6",
        "--bandwidth",
        "3.5e9",
        "--select-fixed",
        "6e-5",
        "--select-cost",
        "2e-10",
        "--strategies",
        "dense-rabenseifner,sparse-allgather",
    ];
    let choice = |bytes: &str| {
        let mut a = vec![
            "predict",
            "--bytes",
            bytes,
            "--ranks",
            "8",
            "--density",
            "0.001",
            "--json",
        ];
        a.extend(net);
        let (ok, out, err) = gradsync(&a);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        v["choice"].as_str().expect("choice").to_string()
    };
    assert_eq!(choice("32K"), "dense-rabenseifner");
    assert_eq!(choice("64K"), "dense-rabenseifner");
    assert_eq!(choice("256K"), "sparse-allgather");
    assert_eq!(choice("4M"), "sparse-allgather");
    let mut a = vec!["crossover", "--ranks", "8", "--density", "0.001", "--json"];
    // Not --strategies: crossover compares its --sparse with its --dense.
    a.extend(&net[..net.len() - 2]);
    let (ok, out, err) = gradsync(&a);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let x = v["crossover_bytes"].as_f64().expect("a crossover");
    assert!(
        (64.0 * 1024.0..=192.0 * 1024.0).contains(&x),
        "roughly 128 KB: {x}"
    );
    // p = 128, D = 0.1%: sparse traffic ≈ 12.8% of dense.
    let (ok, out, err) = gradsync(&[
        "predict",
        "--elements",
        "25000000",
        "--ranks",
        "128",
        "--density",
        "0.001",
        "--alpha",
        "5e-6",
        "--bandwidth",
        "3.5e9",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let w = |name: &str| {
        v["strategies"]
            .as_array()
            .expect("strategies")
            .iter()
            .find(|s| s["name"] == name)
            .and_then(|s| s["wire_bytes"].as_f64())
            .expect("wire bytes")
    };
    let r = w("sparse-allgather") / w("dense-rabenseifner");
    assert!((r - 0.128).abs() < 0.001, "{r}");
}

#[test]
fn plan_and_plot_and_bad_input() {
    let layers = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/layers/resnet50.json");
    let (ok, out, err) = gradsync(&[
        "plan",
        "--layers",
        layers,
        "--ranks",
        "8",
        "--alpha",
        "5e-6",
        "--bandwidth",
        "3.5e9",
        "--select-fixed",
        "6e-5",
        "--select-cost",
        "2e-10",
        "--strategies",
        "dense-rabenseifner,sparse-allgather",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["layers"].as_array().expect("layers").len(), 161);
    let (dense, planned) = (
        v["dense_total_s"].as_f64().expect("dense"),
        v["planned_total_s"].as_f64().expect("planned"),
    );
    assert!(planned <= dense && planned > 0.0);
    let svg = std::env::temp_dir().join(format!("gradsync-crossover-{}.svg", std::process::id()));
    let (ok, _, err) = gradsync(&[
        "crossover",
        "--ranks",
        "4",
        "--alpha",
        "5e-6",
        "--bandwidth",
        "1.25e8",
        "--plot",
        svg.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&svg).expect("svg written");
    assert!(text.contains("<svg") && text.contains("sparse-allgather"));
    std::fs::remove_file(&svg).ok();
    // Bad input: clear errors, no panic.
    for args in [
        vec!["predict", "--elements", "10", "--ranks", "4"],
        vec![
            "predict",
            "--elements",
            "10",
            "--ranks",
            "0",
            "--alpha",
            "1e-6",
            "--bandwidth",
            "1e9",
        ],
        vec![
            "predict",
            "--elements",
            "10",
            "--ranks",
            "4",
            "--alpha",
            "1e-6",
            "--bandwidth",
            "-1",
        ],
        vec![
            "predict",
            "--elements",
            "10",
            "--ranks",
            "4",
            "--alpha",
            "1e-6",
            "--bandwidth",
            "1e9",
            "--density",
            "2",
        ],
        vec![
            "predict",
            "--elements",
            "10",
            "--ranks",
            "4",
            "--profile",
            "/nonexistent.json",
        ],
        vec![
            "plan",
            "--layers",
            "/nonexistent.json",
            "--ranks",
            "4",
            "--alpha",
            "1e-6",
            "--bandwidth",
            "1e9",
        ],
        vec![
            "predict",
            "--elements",
            "10",
            "--ranks",
            "4",
            "--alpha",
            "1e-6",
            "--bandwidth",
            "1e9",
            "--strategies",
            "bogus",
        ],
    ] {
        let (ok, _, err) = gradsync(&args);
        assert!(!ok && err.contains("gradsync"), "{args:?}: {err}");
    }
}

/// `gradsync scale` sweeps the rank count on nodes of L ranks,
/// finds the crossovers and plots; bad flags are errors naming the flag.
#[test]
fn scale_sweeps_ranks_and_names_bad_flags() {
    let layers = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/layers/resnet50.json");
    let dir = std::env::temp_dir().join(format!("gradsync-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let svg = dir.join("scale.svg");
    let net = [
        "--alpha",
        "1e-6",
        "--bandwidth",
        "5e9",
        "--inter-alpha",
        "2e-5",
        "--inter-bandwidth",
        "1.25e8",
    ];
    let mut args = vec![
        "scale",
        "--layers",
        layers,
        "--ranks",
        "8..4096",
        "--ranks-per-node",
        "8",
        "--json",
        "--plot",
        svg.to_str().expect("utf-8"),
    ];
    args.extend(net);
    let (ok, out, err) = gradsync(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let pts = v["points"].as_array().expect("points");
    assert_eq!(pts.len(), 10, "8, 16, ..., 4096");
    assert_eq!(pts[0]["nodes"], 1);
    assert_eq!(pts[9]["nodes"], 512);
    // Past one node the fused allgather grows with p, the dense
    // allreduce does not: dense wins at 4096 ranks, sparse at 16. The
    // fused allgather is priced node-aware there (`allgather = "auto"`),
    // its node blocks crossing each link once, as the node-aware sparse
    // allreduce's units do.
    let t = |i: usize, s: &str| pts[i]["strategies"][s].as_f64().expect(s);
    assert!(t(9, "sparse-allgather") > 4.0 * t(9, "dense-rabenseifner"));
    assert!(t(9, "sparse-allgather") < 1.1 * t(9, "sparse-hierarchical"));
    assert!(t(1, "sparse-hierarchical") < t(1, "dense-rabenseifner"));
    let cross = v["crossovers"].as_array().expect("crossovers");
    let dense = cross
        .iter()
        .find(|c| c["faster"] == "dense (best)")
        .and_then(|c| c["ranks"].as_u64())
        .expect("dense overtakes sparse in this range");
    assert!((16..=4096).contains(&dense), "{dense}");
    let svg_text = std::fs::read_to_string(&svg).expect("plot written");
    assert!(svg_text.contains("<svg") && svg_text.contains("sparse-hierarchical"));
    for (flag, value, needle) in [
        ("--ranks", "64..8", "--ranks"),
        ("--ranks", "8,x", "--ranks"),
        ("--ranks-per-node", "0", "--ranks-per-node"),
        ("--fill", "1.5", "--fill"),
        ("--inter-bandwidth", "0", "--inter-bandwidth"),
    ] {
        let mut a = vec!["scale", "--layers", layers, flag, value];
        for kv in net.chunks(2) {
            if kv[0] != flag {
                a.extend(kv);
            }
        }
        let (ok, _, err) = gradsync(&a);
        assert!(!ok && err.contains(needle), "{flag} {value}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A profile's `gamma_unpack_curve` prices the adds into large outputs;
/// `--gamma-unpack` replaces the constant and the curve alike.
#[test]
fn gamma_unpack_curve_prices_large_outputs_and_the_flag_replaces_it() {
    let flat = r#"{"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_unpack": 1e-9}"#;
    let curved = r#"{"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_unpack": 1e-9,
        "gamma_unpack_curve": [{"bytes": 16777216, "per_byte": 1e-9},
                               {"bytes": 134217728, "per_byte": 3e-9}]}"#;
    let f = temp_file("unpack", "flat.json", flat);
    let c = temp_file("unpack", "curved.json", curved);
    let seconds = |prof: &std::path::Path, bytes: &str, extra: &[&str]| {
        predicted(prof, bytes, "sparse-allreduce", extra)
    };
    // A 1 MiB output: below the curve, the constant.
    assert_eq!(seconds(&f, "1M", &[]), seconds(&c, "1M", &[]));
    // 128 MiB: three times the constant per byte added.
    assert!(seconds(&c, "128M", &[]) > seconds(&f, "128M", &[]));
    assert_eq!(
        seconds(&c, "128M", &["--gamma-unpack", "1e-9"]),
        seconds(&f, "128M", &[])
    );
}

/// `--gamma-reduce` replaces a profile's γ_reduce curve too: before, the
/// curve still priced every message it covered and the flag changed
/// nothing there.
#[test]
fn gamma_reduce_flag_replaces_the_profiles_curve() {
    let flat = r#"{"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_reduce": 1e-10}"#;
    let curved = r#"{"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_reduce": 1e-10,
        "gamma_reduce_curve": [{"bytes": 4096, "per_byte": 5e-9},
                               {"bytes": 134217728, "per_byte": 5e-9}]}"#;
    let f = temp_file("reduce", "flat.json", flat);
    let c = temp_file("reduce", "curved.json", curved);
    let seconds = |prof: &std::path::Path, extra: &[&str]| {
        predicted(prof, "64M", "dense-rabenseifner", extra)
    };
    // The curve's 5 ns/B against the constant's 0.1: 64 MiB reduced in
    // part costs far more.
    assert!(seconds(&c, &[]) > seconds(&f, &[]) * 1.5);
    assert_eq!(seconds(&c, &["--gamma-reduce", "1e-10"]), seconds(&f, &[]));
    assert!(seconds(&f, &["--gamma-reduce", "5e-9"]) > seconds(&f, &[]) * 1.5);
}

/// Where sparse wins in a band of sizes but loses again below
/// `--max-bytes`, `crossover` says so (it printed "never beats"), with the
/// band in `--json`; `--max-bytes` below one element, or below the plot's
/// first size with `--plot` (which ran for ever), is an error.
#[test]
fn crossover_reports_a_band_and_checks_max_bytes() {
    let p = "docs/scale/profile-2x2-1gbit.json";
    let (ok, out, err) = gradsync(&["crossover", "--ranks", "8", "--profile", p, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    assert!(v["crossover_bytes"].is_null(), "{out}");
    let band = v["wins_between_bytes"].as_array().expect("a band");
    let (lo, hi) = (band[0].as_u64().unwrap(), band[1].as_u64().unwrap());
    assert!(lo < hi && hi < 1 << 32, "{out}");
    // Inside the band sparse is predicted faster; above it, slower.
    let at = |bytes: u64| {
        let b = bytes.to_string();
        let (ok, out, _) = gradsync(&[
            "predict",
            "--bytes",
            &b,
            "--ranks",
            "8",
            "--profile",
            p,
            "--json",
        ]);
        assert!(ok);
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        let t = |name: &str| {
            v["strategies"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["name"] == name)
                .unwrap()["seconds"]
                .as_f64()
                .unwrap()
        };
        t("sparse-allgather") < t("dense-rabenseifner")
    };
    assert!(at(lo) && at(hi) && !at(4 * hi), "band {lo}..{hi}");
    let (ok, out, _) = gradsync(&["crossover", "--ranks", "8", "--profile", p]);
    assert!(ok && out.contains("only from about"), "{out}");
    for (max, plot, want) in [
        ("0", false, "at least one f32 element"),
        ("6", false, "multiple of 4"),
        ("4", true, "at least 128 B"),
        ("64", true, "at least 128 B"),
    ] {
        let mut args = vec![
            "crossover",
            "--ranks",
            "8",
            "--profile",
            p,
            "--max-bytes",
            max,
        ];
        if plot {
            args.extend(["--plot", "/tmp/gradsync-crossover-test.svg"]);
        }
        let (ok, _, err) = gradsync(&args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
}

/// `--select-cost` overrides a calibrated profile's selection fits, which
/// are keyed by density (`trimmed@0.001`) and used to win over the flag:
/// the prediction did not change. `--select-fixed` alone is an error (its
/// help says "with --select-cost").
#[test]
fn select_cost_overrides_a_calibrated_profile() {
    let p = "docs/scale/profile-2x2-1gbit.json";
    let sparse = |extra: &[&str]| {
        let mut args = vec![
            "predict",
            "--bytes",
            "16M",
            "--ranks",
            "8",
            "--profile",
            p,
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = gradsync(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        v["strategies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == "sparse-allgather")
            .unwrap()["seconds"]
            .as_f64()
            .unwrap()
    };
    let (base, slow) = (sparse(&[]), sparse(&["--select-cost", "1e-6"]));
    // 4M elements at 1 µs each: about 4.2 s more than the profile's fit.
    assert!(slow > base + 4.0, "{base} -> {slow}");
    let (ok, _, err) = gradsync(&[
        "predict",
        "--bytes",
        "16M",
        "--ranks",
        "8",
        "--profile",
        p,
        "--select-fixed",
        "1",
    ]);
    assert!(
        !ok && err.contains("--select-fixed needs --select-cost"),
        "{err}"
    );
}

/// With a profile that prices PowerSGD's products, `predict` lists
/// `powersgd` (on `--shape`'s matrix, else the most nearly square one),
/// `crossover --sparse powersgd` finds where it overtakes dense, and
/// `scale` sweeps it and its crossovers; without the fit none of them
/// offers it, and `crossover` says why.
#[test]
fn predict_crossover_and_scale_list_powersgd_where_the_profile_prices_it() {
    let base = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/scale/profile-2x2-1gbit.json"
    );
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(base).expect("profile")).expect("JSON");
    v["powersgd"] = serde_json::json!({"a": 0.0, "per_elem": 7e-10, "per_elem_rank": 7e-10});
    let with = temp_file("powersgd-cli", "psg.json", &v.to_string());
    let with = with.to_str().expect("utf-8");
    let pred = |prof: &str, extra: &[&str]| {
        let mut a = vec!["predict", "--ranks", "64", "--profile", prof, "--json"];
        a.extend(extra);
        let (ok, out, err) = gradsync(&a);
        assert!(ok, "{a:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).expect("JSON")
    };
    let names = |r: &serde_json::Value| -> Vec<String> {
        r["strategies"]
            .as_array()
            .expect("strategies")
            .iter()
            .map(|s| s["name"].as_str().expect("name").to_string())
            .collect()
    };
    let secs = |r: &serde_json::Value, s: &str| {
        r["strategies"]
            .as_array()
            .expect("strategies")
            .iter()
            .find(|x| x["name"] == s)
            .and_then(|x| x["seconds"].as_f64())
            .unwrap_or_else(|| panic!("{s} listed"))
    };
    // The layer's own shape: a 3x3 convolution, 512 by 4608.
    let r = pred(with, &["--shape", "512,512,3,3"]);
    assert_eq!(r["elements"], 512 * 512 * 9);
    assert_eq!(r["powersgd_matrix"], serde_json::json!([512, 4608]));
    assert_eq!(names(&r).last().map(String::as_str), Some("powersgd"));
    // Its factors are 0.3 % of the layer: cheaper than dense at 64 ranks.
    assert!(secs(&r, "powersgd") < secs(&r, "dense-rabenseifner"));
    // The same elements without a shape: the most nearly square view,
    // which PowerSGD shrinks more.
    let sq = pred(with, &["--elements", "2359296"]);
    assert_eq!(sq["powersgd_matrix"], serde_json::json!([1536, 1536]));
    assert!(secs(&sq, "powersgd") <= secs(&r, "powersgd"));
    // A vector is priced dense, as the engine runs it.
    let vec = pred(with, &["--shape", "4608"]);
    assert_eq!(
        secs(&vec, "powersgd"),
        secs(&vec, "dense-rabenseifner"),
        "a vector stays dense"
    );
    // --shape and --elements must agree; the error names the flag.
    let (ok, _, err) = gradsync(&[
        "predict",
        "--ranks",
        "64",
        "--profile",
        with,
        "--elements",
        "100",
        "--shape",
        "10,11",
    ]);
    assert!(
        !ok && err.contains("--shape 10,11") && err.contains("110"),
        "{err}"
    );
    // Without the fit: not listed, no matrix.
    let plain = pred(base, &["--shape", "512,512,3,3"]);
    assert!(!names(&plain).contains(&"powersgd".to_string()));
    assert!(plain.get("powersgd_matrix").is_none());
    // crossover: from some size on, PowerSGD beats dense at 64 ranks.
    let cross = |prof: &str| {
        gradsync(&[
            "crossover",
            "--ranks",
            "64",
            "--profile",
            prof,
            "--sparse",
            "powersgd",
            "--json",
        ])
    };
    let (ok, out, err) = cross(with);
    assert!(ok, "{err}");
    let c: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let x = c["crossover_elements"].as_u64().expect("a crossover");
    assert!(x > 1 && x < 1 << 20, "{x}");
    let (ok, _, err) = cross(base);
    assert!(!ok && err.contains("does not price PowerSGD"), "{err}");
    // scale: a powersgd column and its crossovers, only with the fit.
    let layers = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/layers/resnet50.json");
    let sweep = |prof: &str| {
        let (ok, out, err) = gradsync(&[
            "scale",
            "--layers",
            layers,
            "--ranks",
            "2..256",
            "--profile",
            prof,
            "--json",
        ]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).expect("JSON")
    };
    let s = sweep(with);
    let pts = s["points"].as_array().expect("points");
    assert!(pts
        .iter()
        .all(|p| p["strategies"]["powersgd"].as_f64().is_some()));
    let faster: Vec<String> = s["crossovers"]
        .as_array()
        .expect("crossovers")
        .iter()
        .map(|c| format!("{} > {}", c["faster"], c["than"]))
        .collect();
    assert!(
        faster.contains(&"\"powersgd\" > \"sparse (best)\"".to_string())
            && faster.contains(&"\"powersgd\" > \"dense (best)\"".to_string()),
        "{faster:?}"
    );
    let s = sweep(base);
    assert!(s["points"][0]["strategies"].get("powersgd").is_none());
    assert_eq!(s["crossovers"].as_array().expect("crossovers").len(), 3);
}

/// `--select-cost` overrides a profile's tables past the caches too
/// (`select_table`): with them or without, the same plan and price.
#[test]
fn select_cost_overrides_the_profiles_tables() {
    let text = std::fs::read_to_string("docs/scale/profile-1x2-1gbit.json").expect("profile");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    v["select_table"] = serde_json::json!({
        "key": "trimmed@0.001",
        "table_bytes": 67108864.0,
        "curve": [{"bytes": 1048576.0, "per_byte": 2e-9}]
    });
    let with = temp_file("select-tables", "tables.json", &v.to_string());
    let planned = |profile: &str, extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--layers",
            "examples/layers/resnet50.json",
            "--ranks",
            "2",
            "--profile",
            profile,
            "--strategies",
            "sparse-allgather",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = gradsync(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        v["planned_total_s"].as_f64().expect("planned_total_s")
    };
    let p = "docs/scale/profile-1x2-1gbit.json";
    let w = with.to_str().unwrap();
    // The tables price ResNet-50's 25.6 M elements at 8 ns each, the
    // profile's fit at 2.1: 0.15 s more.
    assert!(planned(w, &[]) > planned(p, &[]) + 0.1);
    let over = ["--select-cost", "1e-10"];
    assert_eq!(planned(w, &over), planned(p, &over));
}
