//! The docs as a reference: every engine option and codec is listed in
//! `docs/reference/options.md`, and every relative link of the README and
//! the docs resolves.

use gradsync::codec::CodecConfig;
use gradsync::sync::Config;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn every_option_and_codec_is_in_the_reference() {
    let doc = read(&repo().join("docs/reference/options.md"));
    let serde_json::Value::Object(fields) = serde_json::to_value(Config::default()).unwrap() else {
        panic!("Config is an object");
    };
    // `sparse_exchange` is left out of the JSON at its default; the
    // bindings' own spellings too.
    let mut keys: Vec<String> = fields.keys().cloned().collect();
    keys.extend(
        [
            "sparse_exchange",
            "progress_poll_us",
            "warmup_steps",
            "nonfinite",
        ]
        .map(String::from),
    );
    for k in &keys {
        assert!(
            doc.contains(&format!("`{k}`")),
            "option {k:?} is not in docs/reference/options.md"
        );
        // And the binding takes it.
        if !matches!(k.as_str(), "warmup" | "codec" | "profile") {
            let v = match k.as_str() {
                "warmup_steps" | "compress_threshold" | "parallel_min_elems" | "delay"
                | "progress_poll_us" => "1",
                "nonfinite" | "non_finite" => "\"error\"",
                "allgather" => "\"recdbl\"",
                "allreduce" => "\"rabenseifner\"",
                "sparse_exchange" => "\"allgather\"",
                "clip_norm" => "1.0",
                "nesterov" | "overlap" | "auto_quant" => "true",
                _ => "0.5",
            };
            Config::from_options_json(&format!("{{\"{k}\": {v}}}"))
                .unwrap_or_else(|e| panic!("option {k}: {e}"));
        }
    }
    for spec in [
        "rgc",
        "rgc-quant",
        "sbc",
        "3lc",
        "fastsgd",
        "qsgd",
        "int8",
        "fp16",
        "none",
    ] {
        let c: CodecConfig = spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert!(
            doc.contains(&format!("| `{}` |", c.name())),
            "codec {spec:?} is not in the reference"
        );
    }
}

/// Relative links `](path)` and `](path#anchor)` of a markdown file.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(j) = rest.find(')') else { break };
        let target = &rest[..j];
        if !(target.contains("://") || target.starts_with('#') || target.starts_with("mailto:")) {
            out.push(target.split('#').next().unwrap_or_default().to_string());
        }
    }
    out
}

#[test]
fn every_relative_link_of_the_docs_resolves() {
    let root = repo();
    let mut files = vec![root.join("README.md")];
    for dir in ["docs", "docs/reference"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "md") {
                files.push(e.path());
            }
        }
    }
    for f in files {
        let base = f.parent().unwrap();
        for l in links(&read(&f)) {
            if l.is_empty() || l.contains(' ') {
                continue;
            }
            assert!(
                base.join(&l).exists(),
                "{}: link {l:?} does not resolve",
                f.display()
            );
        }
    }
}
