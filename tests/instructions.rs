//! Instruction counts of the engine's local phases (encode/select, pack,
//! unpack, the dense and the sparse step on one rank), counted by
//! callgrind on `examples/local_phases.rs` and held against the baseline
//! kept in `benches/instructions.json`: a phase that executes more than
//! the baseline's tolerance (3 %) more instructions fails. Wall-clock on
//! shared 2-core machines moves by a third between days; an instruction
//! count moves only with the code and the compiler.
//!
//! Counted: the instructions executed in the program's own code (gradsync
//! and the Rust crates it links, all compiled into the binary) while the
//! phase's function runs. Not counted: the C library's (`memcpy`,
//! `memset`, the allocator), whose implementation glibc picks by CPU, so
//! that the count is the same on any x86-64 machine.
//!
//! The baseline names the compiler it was counted with; under another
//! `rustc` (which moves the counts by itself) a rise past the looser
//! `OTHER_COMPILER_TOLERANCE` (10 %) still fails, so that a new
//! toolchain does not switch the check off; rebaseline with
//! `GRADSYNC_UPDATE_INSTRUCTIONS=1 cargo test --release --test instructions`
//! (or `hpc/instructions.sh --update`). Without valgrind the test prints
//! `SKIP` with the reason; `GRADSYNC_REQUIRE_VALGRIND=1` (set by
//! `hpc/test.sh`) makes that a failure.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const PHASES: [&str; 5] = ["select", "pack", "unpack", "dense_step", "sparse_step"];
const TOLERANCE: f64 = 0.03;
/// The tolerance against a baseline counted by another `rustc`.
const OTHER_COMPILER_TOLERANCE: f64 = 0.10;

fn baseline_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/instructions.json")
}

/// Self cost (Ir) per object of a callgrind output file, and the file's
/// total. Cost lines of calls (`calls=` then the inclusive cost) are not
/// self cost and are skipped.
fn self_cost_by_object(text: &str) -> (BTreeMap<String, u64>, u64) {
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    let mut by_ob: BTreeMap<String, u64> = BTreeMap::new();
    let mut ob = String::new();
    let mut skip_next = false;
    let mut total = 0;
    // `ob=(3) /path` defines id 3; `ob=(3)` refers to it.
    let mut resolve = |v: &str| -> String {
        let v = v.trim();
        if let Some(rest) = v.strip_prefix('(') {
            if let Some((id, name)) = rest.split_once(')') {
                let name = name.trim();
                if name.is_empty() {
                    return names.get(id).cloned().unwrap_or_default();
                }
                names.insert(id.to_string(), name.to_string());
                return name.to_string();
            }
        }
        v.to_string()
    };
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("ob=") {
            ob = resolve(v);
        } else if let Some(v) = line.strip_prefix("cob=") {
            resolve(v); // defines names too
        } else if line.starts_with("calls=") {
            skip_next = true;
        } else if let Some(v) = line
            .strip_prefix("summary:")
            .or(line.strip_prefix("totals:"))
        {
            total = v.trim().parse().unwrap_or(total);
        } else if line.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '*')) {
            if skip_next {
                skip_next = false;
                continue;
            }
            let ir: u64 = line
                .split_whitespace()
                .nth(1)
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            *by_ob.entry(ob.clone()).or_default() += ir;
        }
    }
    (by_ob, total)
}

/// (own-code instructions, all instructions) of one phase.
fn count(prog: &Path, phase: &str, dir: &Path) -> (u64, u64) {
    let out = dir.join(format!("callgrind.{phase}.out"));
    let (ok, stdout, stderr) = common::run_limited(
        {
            let mut c = Command::new("valgrind");
            c.args([
                "--tool=callgrind",
                &format!("--toggle-collect=gs_phase_{phase}"),
                &format!("--callgrind-out-file={}", out.display()),
            ])
            .arg(prog)
            .arg(phase)
            .env("RAYON_NUM_THREADS", "1");
            c
        },
        std::time::Duration::from_secs(600),
        "callgrind",
    );
    assert!(ok, "callgrind on {phase} failed:\n{stdout}\n{stderr}");
    let text = std::fs::read_to_string(&out).expect("callgrind wrote its output");
    let (by_ob, total) = self_cost_by_object(&text);
    let prog_name = prog.file_name().unwrap().to_string_lossy().to_string();
    let own: u64 = by_ob
        .iter()
        .filter(|(ob, _)| ob.ends_with(&prog_name))
        .map(|(_, ir)| ir)
        .sum();
    assert!(
        own > 0,
        "no instructions of {prog_name} counted for {phase}: {by_ob:?}"
    );
    (own, total)
}

fn rustc_version() -> String {
    Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .arg("-V")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

#[test]
fn local_phases_execute_no_more_instructions_than_the_baseline() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        let why = "valgrind is not installed (apt-get install valgrind; hpc/setup.sh does)";
        assert!(
            std::env::var_os("GRADSYNC_REQUIRE_VALGRIND").is_none(),
            "GRADSYNC_REQUIRE_VALGRIND is set: {why}"
        );
        println!("SKIP local_phases instruction counts: {why}");
        return;
    }
    let prog = common::example("local_phases");
    assert!(
        prog.exists(),
        "{} is missing: cargo build --release --example local_phases (cargo test builds it)",
        prog.display()
    );
    let dir = std::env::temp_dir().join(format!("gradsync-callgrind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut counts = BTreeMap::new();
    for phase in PHASES {
        counts.insert(phase.to_string(), count(&prog, phase, &dir));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let rustc = rustc_version();
    if std::env::var_os("GRADSYNC_UPDATE_INSTRUCTIONS").is_some() {
        let phases: serde_json::Map<String, serde_json::Value> = counts
            .iter()
            .map(|(k, (own, total))| (k.clone(), serde_json::json!({ "own": own, "total": total })))
            .collect();
        let doc = serde_json::json!({
            "rustc": rustc,
            "tolerance": TOLERANCE,
            "phases": phases,
        });
        std::fs::write(
            baseline_path(),
            serde_json::to_string_pretty(&doc).unwrap() + "\n",
        )
        .unwrap();
        println!("wrote {}", baseline_path().display());
        return;
    }
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(baseline_path()).unwrap())
            .expect("benches/instructions.json is JSON");
    let same_compiler = base["rustc"].as_str() == Some(rustc.as_str());
    let tolerance = if same_compiler {
        TOLERANCE
    } else {
        OTHER_COMPILER_TOLERANCE
    };
    let mut report = Vec::new();
    let mut rises = Vec::new();
    for phase in PHASES {
        let (own, total) = counts[phase];
        let was = base["phases"][phase]["own"]
            .as_u64()
            .unwrap_or_else(|| panic!("benches/instructions.json has no phase {phase}"));
        let ratio = own as f64 / was as f64;
        report.push(format!(
            "{phase:<12} own {own:>12} (baseline {was:>12}, {ratio:.4}x)  all {total:>12}"
        ));
        if ratio > 1.0 + tolerance {
            rises.push(format!("{phase}: {ratio:.4}x"));
        }
    }
    println!("instructions ({rustc}):\n{}", report.join("\n"));
    if !same_compiler {
        println!(
            "the baseline was counted with {}; this is {rustc}: held to {:.0} % \
             instead of {:.0} % (rebaseline: GRADSYNC_UPDATE_INSTRUCTIONS=1)",
            base["rustc"],
            OTHER_COMPILER_TOLERANCE * 100.0,
            TOLERANCE * 100.0
        );
    }
    assert!(
        rises.is_empty(),
        "instructions rose past {:.0} % of benches/instructions.json: {}\n{}",
        tolerance * 100.0,
        rises.join(", "),
        report.join("\n")
    );
}

#[test]
fn the_callgrind_reader_counts_self_cost_only() {
    let text = "events: Ir\nob=(1) /x/local_phases\nfl=(1) a.rs\nfn=(1) f\n10 5\n+1 7\n\
                cob=(2) /lib/libc.so.6\ncfn=(2) memcpy\ncalls=1 0\n+1 1000\n\
                ob=(2)\nfn=(2)\n0 900\nob=(1)\nfn=(1)\n12 3\nsummary: 915\n";
    let (by_ob, total) = self_cost_by_object(text);
    assert_eq!(by_ob["/x/local_phases"], 15);
    assert_eq!(by_ob["/lib/libc.so.6"], 900);
    assert_eq!(total, 915);
}
