//! `gradsync predict / plan / crossover / scale` (no MPI): the JSON output
//! equals the cost model's formulas, written out here independently of
//! `src/cost` ([`prices`]), and bad input is an error naming the file,
//! entry, field or flag ([`inputs`]).

#[path = "../common/mod.rs"]
mod common;
mod inputs;
mod prices;

use common::run_gradsync as gradsync;

fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}

/// A file in a fresh temporary directory of this test (name, contents).
fn temp_file(test: &str, name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gradsync-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let p = dir.join(name);
    std::fs::write(&p, contents).expect("write temp file");
    p
}

const NET: [&str; 4] = ["--alpha", "1e-6", "--bandwidth", "1e9"];

/// `gradsync predict --json` at 4 ranks: the seconds it predicts for
/// `strategy` on `bytes` at density 0.01 with `prof`, plus `extra` flags.
fn predicted(prof: &std::path::Path, bytes: &str, strategy: &str, extra: &[&str]) -> f64 {
    let mut args = vec![
        "predict",
        "--bytes",
        bytes,
        "--ranks",
        "4",
        "--density",
        "0.01",
        "--strategies",
        strategy,
        "--json",
        "--profile",
        prof.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = gradsync(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    v["strategies"]
        .as_array()
        .expect("strategies")
        .iter()
        .find(|s| s["name"] == strategy)
        .and_then(|s| s["seconds"].as_f64())
        .expect(strategy)
}
