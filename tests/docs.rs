//! The docs as a reference: every engine option and codec is listed in
//! `docs/reference/options.md`, every codec in
//! `docs/reference/strategies.md`, every relative link (and `#anchor`) of
//! the README and the docs resolves, and the README stays a front page.

use gradsync::codec::CodecConfig;
use gradsync::dense::{AllgathervAlgo, AllreduceAlgo};
use gradsync::strategy::{Pick, SparseExchange, Strategy};
use gradsync::sync::Config;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The `Config` fields, read from src/sync/config.rs (every `pub name:`
/// of `pub struct Config`).
fn config_fields() -> Vec<String> {
    let src = read(&repo().join("src/sync/config.rs"));
    let body = src
        .split("pub struct Config {")
        .nth(1)
        .and_then(|b| b.split("\n}\n").next())
        .expect("pub struct Config in src/sync/config.rs");
    let fields: Vec<String> = body
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub "))
        .filter_map(|l| l.split_once(':').map(|(name, _)| name.trim().to_string()))
        .collect();
    assert!(fields.len() >= 15, "read Config's fields: {fields:?}");
    fields
}

/// Every codec name the codec parser knows, from its own error for an
/// unknown one (serde lists the variants it expected).
fn codec_names() -> Vec<String> {
    let e = "no-such-codec"
        .parse::<CodecConfig>()
        .unwrap_err()
        .to_string();
    let list = e
        .split("expected one of")
        .nth(1)
        .unwrap_or_else(|| panic!("the codec parser lists its codecs: {e}"));
    let names: Vec<String> = list
        .split(',')
        .map(|n| n.trim().trim_matches('`').to_string())
        .filter(|n| !n.is_empty())
        .collect();
    assert!(names.len() >= 9, "{names:?} from {e}");
    names
}

/// The layer strategy words besides the codecs, from the strategy
/// parser's own error for an unknown one ("... is not auto, dense, ...
/// or a codec").
fn strategy_words() -> Vec<String> {
    let e = Strategy::parse("no-such-strategy").unwrap_err().to_string();
    let list = e
        .split("is not ")
        .nth(1)
        .and_then(|l| l.split(" or a codec").next())
        .unwrap_or_else(|| panic!("the strategy parser lists its words: {e}"));
    let words: Vec<String> = list
        .split(", ")
        .map(|w| w.trim().to_string())
        .filter(|w| !w.is_empty())
        .collect();
    assert!(words.len() >= 4, "{words:?} from {e}");
    words
}

#[test]
fn every_option_and_codec_is_in_the_reference() {
    let doc = read(&repo().join("docs/reference/options.md"));
    // Every field of Config, and the bindings' own spellings.
    let mut keys = config_fields();
    keys.extend(["progress_poll_us", "warmup_steps", "nonfinite"].map(String::from));
    for k in &keys {
        assert!(
            doc.contains(&format!("`{k}`")),
            "option {k:?} is not in docs/reference/options.md"
        );
        // And the binding takes it.
        if !matches!(k.as_str(), "warmup" | "codec" | "profile") {
            let v = match k.as_str() {
                "warmup_steps" | "compress_threshold" | "parallel_min_elems" | "delay"
                | "progress_poll_us" | "auto_powersgd" => "1",
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
    // Every codec the parser knows, and every layer strategy word.
    let strategies = read(&repo().join("docs/reference/strategies.md"));
    for name in codec_names() {
        let c: CodecConfig = name.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            doc.contains(&format!("| `{}` |", c.name()))
                && strategies.contains(&format!("| `{}` |", c.name())),
            "codec {name:?} is not in the reference"
        );
    }
    for word in strategy_words() {
        let word = word.as_str();
        Strategy::parse(word).unwrap_or_else(|e| panic!("{word}: {e}"));
        assert!(
            strategies.contains(&format!("| `{word}`")),
            "strategy {word:?} is not in docs/reference/strategies.md"
        );
    }
    // Every collective algorithm each option parses, and `auto`.
    let row = |option: &str| {
        strategies
            .lines()
            .find(|l| l.starts_with(&format!("| `{option}` |")))
            .unwrap_or_else(|| panic!("no row for {option} in strategies.md"))
            .to_string()
    };
    let check = |option: &str, names: Vec<&str>| {
        let r = row(option);
        for n in names.into_iter().chain(["auto"]) {
            assert!(
                r.contains(&format!("`{n}`")),
                "{option} {n:?} is not in: {r}"
            );
        }
    };
    check(
        "allreduce",
        AllreduceAlgo::ALL.iter().map(|a| a.name()).collect(),
    );
    check(
        "allgather",
        AllgathervAlgo::ALL.iter().map(|a| a.name()).collect(),
    );
    check(
        "sparse_exchange",
        SparseExchange::ALL.iter().map(|a| a.name()).collect(),
    );
    for a in AllreduceAlgo::ALL {
        assert_eq!(
            a.name().parse::<Pick<AllreduceAlgo>>().unwrap(),
            Pick::Fixed(a)
        );
    }
    for a in AllgathervAlgo::ALL {
        assert_eq!(
            a.name().parse::<Pick<AllgathervAlgo>>().unwrap(),
            Pick::Fixed(a)
        );
    }
    for a in SparseExchange::ALL {
        assert_eq!(
            a.name().parse::<Pick<SparseExchange>>().unwrap(),
            Pick::Fixed(a)
        );
    }
}

/// Relative links `](path)` and `](path#anchor)` of a markdown file, as
/// (path, anchor); a link within the file has an empty path.
fn links(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(j) = rest.find(')') else { break };
        let target = &rest[..j];
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a.to_string())),
            None => (target, None),
        };
        out.push((path.to_string(), anchor));
    }
    out
}

/// GitHub's anchor for a heading: lower case, everything but letters,
/// digits, `-`, `_` and spaces dropped, spaces made `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown file's headings (outside code fences), with
/// GitHub's `-1`, `-2`, ... for repeated ones.
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut fence = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fence = !fence;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fence || hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let mut a = base.clone();
        let mut n = 0;
        while out.contains(&a) {
            n += 1;
            a = format!("{base}-{n}");
        }
        out.push(a);
    }
    out
}

/// README.md and every markdown file under docs/.
fn doc_files() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_relative_link_of_the_docs_resolves() {
    for f in doc_files() {
        let base = f.parent().unwrap();
        let text = read(&f);
        for (l, anchor) in links(&text) {
            if l.contains(' ') {
                continue;
            }
            let target = if l.is_empty() {
                f.clone()
            } else {
                base.join(&l)
            };
            assert!(
                target.exists(),
                "{}: link {l:?} does not resolve",
                f.display()
            );
            // Anchors into markdown files name one of their headings.
            let Some(anchor) = anchor.filter(|a| !a.is_empty()) else {
                continue;
            };
            if target.extension().is_some_and(|x| x == "md") {
                let found = anchors(&read(&target));
                assert!(
                    found.contains(&anchor),
                    "{}: link {l:?}#{anchor} names no heading of {}",
                    f.display(),
                    target.display()
                );
            }
        }
    }
}

#[test]
fn anchors_are_githubs() {
    assert_eq!(slug("The engine's `auto`"), "the-engines-auto");
    assert_eq!(slug("4. Wire formats"), "4-wire-formats");
    assert_eq!(
        slug("A core per rank: 2 hosts × 1"),
        "a-core-per-rank-2-hosts--1"
    );
    assert_eq!(
        anchors("# A\n```sh\n# not a heading\n```\n## A\n#nope\n"),
        ["a", "a-1"]
    );
}

/// The README is a front page: the details live in docs/.
#[test]
fn the_readme_is_a_front_page() {
    let n = read(&repo().join("README.md")).lines().count();
    assert!(
        n <= 300,
        "README.md has {n} lines; keep it at most 300 and move details into docs/"
    );
}

/// Every codec is a strategy string of the strategies reference, and so
/// is every strategy the cost model names (`predict`, `plan`, the step
/// stats), taken from the engine's own list.
#[test]
fn every_codec_is_in_the_strategies_reference() {
    let doc = read(&repo().join("docs/reference/strategies.md"));
    let words = strategy_words();
    for spec in codec_names().iter().chain(&words) {
        assert!(
            doc.contains(&format!("`{spec}`")),
            "strategy {spec:?} is not in docs/reference/strategies.md"
        );
    }
    for id in gradsync::cost::StrategyId::ALL {
        assert!(
            doc.contains(&format!("`{}`", id.name())),
            "the cost model's strategy {:?} is not in docs/reference/strategies.md",
            id.name()
        );
    }
}
