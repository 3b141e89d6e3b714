//! The crate's layering, kept: no import cycle between the top-level
//! modules of `src/` (`comm` below `dense`, `cost` below `sync`,
//! `calibrate` above both, the CLI on top), nor between the sibling
//! submodules of any module (`cost::topology`, `cost::step`,
//! `cost::exchange`, ...). A child naming its parent's own items is not an
//! edge; a child naming a sibling's item through the parent's re-export
//! (`super::StrategyId`, from `cost::decide`) is an edge to that sibling.
//! Unit-test modules are left out: a test may check one module against
//! another.
//!
//! Read from the source: every `crate::` and `super::` path (in `use`
//! lines and inline, `{...}` groups included; comments skipped), resolved
//! to the longest module path that exists as a file, then through the
//! `pub use` re-exports of the item named after it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file of `src/` (not `src/bin`) with its module path.
fn files(dir: &Path, prefix: &ModPath, out: &mut Vec<(PathBuf, ModPath)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            if prefix.is_empty() && name == "bin" {
                continue;
            }
            let mut m = prefix.clone();
            m.push(name);
            files(&p, &m, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let mut m = prefix.clone();
            if !(name == "mod" || (prefix.is_empty() && name == "lib")) {
                m.push(name);
            }
            out.push((p, m));
        }
    }
}

/// The source without comments (line comments and doc comments; block
/// comments are not used in this crate's code).
fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for line in s.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut cut = line.len();
        for (i, c) in line.char_indices() {
            if c == '"' && prev != '\\' && prev != '\'' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && prev == '/' {
                cut = i - 1;
                break;
            }
            prev = c;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths that start at `s` (just after `crate::` or `super::`):
/// `a::b::C` or `{a::b, c::{d, e}}`, each as its segments.
fn paths_at(s: &str) -> Vec<Vec<String>> {
    let s = s.trim_start();
    if let Some(rest) = s.strip_prefix('{') {
        // Split the group at depth 0.
        let mut depth = 0;
        let mut items = Vec::new();
        let mut start = 0;
        for (i, c) in rest.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    items.push(&rest[start..i]);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&rest[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return items
            .into_iter()
            .filter(|i| !i.trim().is_empty())
            .flat_map(paths_at)
            .collect();
    }
    let ident: String = s.chars().take_while(|&c| is_ident(c)).collect();
    if ident.is_empty() {
        return Vec::new();
    }
    let rest = &s[ident.len()..];
    match rest.strip_prefix("::") {
        Some(r) => {
            let tails = paths_at(r);
            if tails.is_empty() {
                vec![vec![ident]]
            } else {
                tails
                    .into_iter()
                    .map(|mut t| {
                        t.insert(0, ident.clone());
                        t
                    })
                    .collect()
            }
        }
        None => vec![vec![ident]],
    }
}

/// The paths `src` names, resolved from module `me` (a file's `super`
/// is its module's parent, for `a/b.rs` and `a/b/mod.rs` alike).
fn references(src: &str, me: &ModPath) -> Vec<ModPath> {
    let mut out = Vec::new();
    let bytes = src.as_bytes();
    for (anchor, is_crate) in [("crate::", true), ("super::", false)] {
        let mut from = 0;
        while let Some(i) = src[from..].find(anchor).map(|i| i + from) {
            from = i + anchor.len();
            if i > 0 && (is_ident(bytes[i - 1] as char) || bytes[i - 1] == b':') {
                continue; // `self::super::` or part of a longer path
            }
            let mut base: ModPath = if is_crate { Vec::new() } else { me.clone() };
            let mut at = from;
            if !is_crate {
                base.pop();
                while src[at..].starts_with("super::") {
                    base.pop();
                    at += "super::".len();
                }
            }
            for p in paths_at(&src[at..]) {
                let mut full = base.clone();
                full.extend(p);
                out.push(full);
            }
        }
    }
    out
}

/// The items each module re-exports (`pub use a::b::Item;`,
/// `pub(crate) use ...`, `pub use a::{X, Y as Z}`), by (module, the name it
/// exports) -> the path it names, resolved from the module (relative paths
/// from the module itself, `crate::` and `super::` as [`references`]).
fn reexports(all: &[(PathBuf, ModPath)]) -> BTreeMap<(ModPath, String), ModPath> {
    let mut out = BTreeMap::new();
    for (file, me) in all {
        let text = strip_comments(&std::fs::read_to_string(file).unwrap());
        for line in text.split(';') {
            let l = line.trim();
            let Some(rest) = ["pub use ", "pub(crate) use ", "pub(super) use "]
                .iter()
                .find_map(|p| l.strip_prefix(p))
            else {
                continue;
            };
            let (base, at) = if let Some(r) = rest.strip_prefix("crate::") {
                (Vec::new(), r)
            } else if let Some(mut r) = rest.strip_prefix("super::") {
                // A file's `super` is its module's parent (`references`).
                let mut b = me.clone();
                b.pop();
                while let Some(rr) = r.strip_prefix("super::") {
                    b.pop();
                    r = rr;
                }
                (b, r)
            } else {
                (me.clone(), rest.strip_prefix("self::").unwrap_or(rest))
            };
            for p in paths_at(at) {
                let mut full = base.clone();
                full.extend(p);
                // `X as Y`: the last segment reads `X as Y` up to the space.
                let last = full.pop().unwrap_or_default();
                let item_src = last.split_whitespace().next().unwrap_or("").to_string();
                let name = at_alias(at, &item_src).unwrap_or(item_src.clone());
                full.push(item_src);
                out.insert((me.clone(), name), full);
            }
        }
    }
    out
}

/// The alias `Y` of `X as Y` in a `use` tail, if `item` is renamed there.
fn at_alias(text: &str, item: &str) -> Option<String> {
    let i = text.find(&format!("{item} as "))?;
    let rest = &text[i + item.len() + 4..];
    let name: String = rest
        .trim_start()
        .chars()
        .take_while(|&c| is_ident(c))
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The module a reference lands in: the longest existing module path it
/// names, followed through the re-exports of the item after it (a
/// sibling's item named through the parent's `pub use` is an edge to that
/// sibling).
fn resolve(
    target: &ModPath,
    modules: &BTreeSet<ModPath>,
    re: &BTreeMap<(ModPath, String), ModPath>,
) -> Option<ModPath> {
    let mut target = target.clone();
    for _ in 0..8 {
        let t = (0..=target.len())
            .rev()
            .map(|k| target[..k].to_vec())
            .find(|p| modules.contains(p))?;
        let Some(item) = target.get(t.len()) else {
            return Some(t);
        };
        match re.get(&(t.clone(), item.clone())) {
            Some(next) if *next != target => {
                let mut n = next.clone();
                n.extend(target[t.len() + 1..].iter().cloned());
                target = n;
            }
            _ => return Some(t),
        }
    }
    None
}

#[test]
fn no_import_cycles_between_modules() {
    let mut all = Vec::new();
    files(&src(), &Vec::new(), &mut all);
    let modules: BTreeSet<ModPath> = all.iter().map(|(_, m)| m.clone()).collect();
    assert!(
        modules.contains(&vec!["sync".to_string()]),
        "the walk found the crate's modules"
    );
    let re = reexports(&all);
    // The reader follows re-exports: `cost::StrategyId` is `cost::decide`'s,
    // `crate::failure` the agreement's module in `comm`.
    let sid = vec!["cost".to_string(), "StrategyId".to_string()];
    assert_eq!(
        resolve(&sid, &modules, &re),
        Some(vec!["cost".to_string(), "decide".to_string()])
    );
    let failure = vec!["failure".to_string(), "agree".to_string()];
    assert_eq!(
        resolve(&failure, &modules, &re),
        Some(vec!["comm".to_string(), "agree".to_string()])
    );
    // (parent, from child, to child) -> an example file.
    let mut edges: BTreeMap<(ModPath, String, String), String> = BTreeMap::new();
    for (file, me) in &all {
        // Unit-test modules (`tests.rs`, `tests/`, `*_tests.rs`) may reach
        // across their parent's siblings: the layering is the library's.
        if me.iter().any(|m| m == "tests" || m.ends_with("_tests")) {
            continue;
        }
        let text = strip_comments(&std::fs::read_to_string(file).unwrap());
        for target in references(&text, me) {
            // The module the reference lands in, through re-exports.
            let Some(t) = resolve(&target, &modules, &re) else {
                continue;
            };
            let common = me.iter().zip(&t).take_while(|(a, b)| a == b).count();
            if common < me.len() && common < t.len() {
                let parent = me[..common].to_vec();
                let rel = file.strip_prefix(src()).unwrap().display().to_string();
                edges
                    .entry((parent, me[common].clone(), t[common].clone()))
                    .or_insert(rel);
            }
        }
    }
    let mut graphs: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (parent, a, b) in edges.keys() {
        graphs
            .entry(parent.clone())
            .or_default()
            .entry(a.clone())
            .or_default()
            .insert(b.clone());
    }
    let mut cycles = Vec::new();
    for (parent, g) in &graphs {
        if let Some(cycle) = find_cycle(g) {
            let steps: Vec<String> = cycle
                .windows(2)
                .map(|w| {
                    let file = &edges[&(parent.clone(), w[0].clone(), w[1].clone())];
                    format!("{} -> {} (e.g. src/{file})", w[0], w[1])
                })
                .collect();
            let at = if parent.is_empty() {
                "crate".to_string()
            } else {
                parent.join("::")
            };
            cycles.push(format!("in {at}: {}", steps.join(", ")));
        }
    }
    assert!(
        cycles.is_empty(),
        "import cycles between modules:\n{}",
        cycles.join("\n")
    );
    // The check sees the layering it is meant to hold.
    let top = &graphs[&Vec::new()];
    assert!(top["sync"].contains("cost") && top["dense"].contains("comm"));
}

/// A cycle of `g` as its nodes, the first repeated at the end.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn dfs(
        g: &BTreeMap<String, BTreeSet<String>>,
        v: &str,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(v.to_string(), 1);
        stack.push(v.to_string());
        for w in g.get(v).into_iter().flatten() {
            match state.get(w.as_str()).copied().unwrap_or(0) {
                1 => {
                    let i = stack.iter().position(|x| x == w).unwrap();
                    let mut c = stack[i..].to_vec();
                    c.push(w.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = dfs(g, w, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(v.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for v in g.keys() {
        if state.get(v.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = dfs(g, v, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn the_reader_resolves_paths() {
    let me: ModPath = vec!["cost".into(), "step".into()];
    let refs = references(
        "use super::topology::{self, Net};\nuse crate::{comm::Transport, sync::{GradSync, plan}};\nlet x = super::super::dense::f();",
        &me,
    );
    let names: Vec<String> = refs.iter().map(|r| r.join("::")).collect();
    for want in [
        "cost::topology::self",
        "cost::topology::Net",
        "comm::Transport",
        "sync::GradSync",
        "sync::plan",
        "dense::f",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    assert_eq!(
        strip_comments("a // b\n/// c\nlet s = \"//\";"),
        "a \n\nlet s = \"//\";\n"
    );
}

/// The Python extension builds the engine without the command line: its
/// dependency tree holds none of the CLI's crates.
#[test]
fn the_python_extension_builds_without_the_cli_crates() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "-p",
            "gradsync-python",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && tree.contains("gradsync v"),
        "cargo tree -p gradsync-python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for krate in ["clap ", "plotters ", "env_logger "] {
        assert!(
            !tree.lines().any(|l| l.starts_with(krate)),
            "the Python extension depends on {krate}(the CLI's): {tree}"
        );
    }
}

/// One place compares prices: in the cost model and the engine, only
/// `src/cost/argmin.rs` takes a minimum or applies the near-tie rule (the
/// engine looks decisions up; calibration's medians sort measurements and
/// are not decisions).
#[test]
fn prices_are_compared_only_in_cost_argmin() {
    let mut all = Vec::new();
    files(&src(), &Vec::new(), &mut all);
    let compares = [
        ".min_by(",
        ".max_by(",
        "total_cmp(",
        "partial_cmp(",
        "NEAR_TIE *",
        "NEAR_TIE)",
        "fold(f64::INFINITY, f64::min)",
        "tie_limit(",
        "<= limit",
        "< limit",
    ];
    let mut found = Vec::new();
    // The engine, the mechanisms it runs and the bindings over it (the
    // command line's reports and the calibration's measurements compare
    // timings, not prices, and are left out).
    let mut scanned: Vec<(PathBuf, String)> = Vec::new();
    for (file, m) in &all {
        let rel = file.strip_prefix(src()).unwrap().display().to_string();
        let in_scope = matches!(
            m.first().map(String::as_str),
            Some("cost" | "sync" | "gpu" | "comm" | "dense" | "powersgd")
        );
        let is_test = m.iter().any(|s| s == "tests" || s.ends_with("_tests"));
        if in_scope && !is_test && rel != "cost/argmin.rs" {
            scanned.push((file.clone(), format!("src/{rel}")));
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for dir in ["python/src", "capi/src"] {
        let mut bound = Vec::new();
        rust_files(&root.join(dir), &mut bound);
        assert!(!bound.is_empty(), "{dir} holds the bindings' sources");
        for f in bound {
            let rel = f.strip_prefix(&root).unwrap().display().to_string();
            scanned.push((f, rel));
        }
    }
    for (file, rel) in &scanned {
        let text = strip_comments(&std::fs::read_to_string(file).unwrap());
        for (i, line) in text.lines().enumerate() {
            if compares.iter().any(|c| line.contains(c)) {
                found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "prices compared outside src/cost/argmin.rs:\n{}",
        found.join("\n")
    );
}

/// Every `.rs` file under `dir` (recursively).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = rd.map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The longest `unsafe` block this code base keeps (lines from `unsafe {`
/// to its closing brace): a block holds one operation and its arguments.
const MAX_UNSAFE_LINES: usize = 20;

/// `clippy::undocumented_unsafe_blocks` and small blocks, in every build
/// (CI installs no clippy): each `unsafe {` block and `unsafe impl` of the
/// engine, the C ABI and the Python extension has a `// SAFETY:` comment
/// in the lines just above it (within 6, so a comment over a `let` or a
/// call spanning a few lines counts), and no block spans more than
/// [`MAX_UNSAFE_LINES`] lines.
#[test]
fn every_unsafe_block_is_small_and_says_why_it_is_sound() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    for dir in ["src", "capi/src", "python/src"] {
        rust_files(&root.join(dir), &mut all);
    }
    assert!(all.len() > 50, "found {} files", all.len());
    let (mut blocks, mut problems) = (0, Vec::new());
    for file in &all {
        let raw = std::fs::read_to_string(file).unwrap();
        let code: Vec<String> = strip_comments(&raw).lines().map(str::to_string).collect();
        let lines: Vec<&str> = raw.lines().collect();
        let rel = file.strip_prefix(&root).unwrap().display().to_string();
        for (i, line) in code.iter().enumerate() {
            let at_block = line.find("unsafe {");
            if at_block.is_none() && !line.contains("unsafe impl") {
                continue;
            }
            blocks += 1;
            let above = &lines[i.saturating_sub(6)..i];
            if !above.iter().any(|l| l.contains("SAFETY:")) && !lines[i].contains("SAFETY:") {
                problems.push(format!("{rel}:{}: no SAFETY comment above", i + 1));
            }
            let Some(col) = at_block else { continue };
            // The block's length, by its braces (strings and comments
            // stripped: `code` keeps strings, which hold no braces here).
            let mut depth = 0i32;
            let mut end = i;
            'scan: for (j, l) in code.iter().enumerate().skip(i) {
                let from = if j == i { col } else { 0 };
                for c in l[from..].chars() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = j;
                                break 'scan;
                            }
                        }
                        _ => {}
                    }
                }
            }
            if end + 1 - i > MAX_UNSAFE_LINES {
                problems.push(format!(
                    "{rel}:{}: an unsafe block of {} lines",
                    i + 1,
                    end + 1 - i
                ));
            }
        }
    }
    assert!(blocks > 50, "found {blocks} unsafe blocks");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The longest function the engine's path keeps (signature to closing
/// brace): past it a function usually holds two concerns.
const MAX_FN_LINES: usize = 100;

/// Every function of the engine's path (all of `src/` but the command
/// line, `calibrate` and tests) is at most [`MAX_FN_LINES`] lines.
#[test]
fn no_function_on_the_engines_path_is_over_100_lines() {
    let mut all = Vec::new();
    rust_files(&src(), &mut all);
    let mut long = Vec::new();
    for file in &all {
        let rel = file.strip_prefix(src()).unwrap().display().to_string();
        let skip = rel.starts_with("cli/")
            || rel.starts_with("calibrate/")
            || rel.starts_with("bin/")
            || rel.contains("tests")
            || rel.ends_with("_tests.rs");
        if skip {
            continue;
        }
        let code = strip_comments(&std::fs::read_to_string(file).unwrap());
        let lines: Vec<&str> = code.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let t = lines[i].trim_start();
            let is_fn = [
                "fn ",
                "pub fn ",
                "pub(crate) fn ",
                "pub(super) fn ",
                "unsafe fn ",
                "pub unsafe fn ",
                "pub(crate) unsafe fn ",
                "const fn ",
                "pub const fn ",
            ]
            .iter()
            .any(|p| t.starts_with(p));
            if !is_fn || lines[i].trim_end().ends_with('}') {
                i += 1;
                continue;
            }
            let indent = lines[i].len() - t.len();
            // The signature ends at `{` (a body) or `;` (a declaration).
            let mut j = i;
            while j < lines.len() && !lines[j].contains('{') && !lines[j].trim_end().ends_with(';')
            {
                j += 1;
            }
            if j == lines.len() || !lines[j].contains('{') {
                i = j + 1;
                continue;
            }
            let end = (j..lines.len()).find(|&k| {
                let l = lines[k];
                l.trim() == "}" && l.len() - l.trim_start().len() == indent
            });
            let Some(end) = end else { break };
            if end + 1 - i > MAX_FN_LINES {
                long.push(format!("src/{rel}:{}: {} lines: {}", i + 1, end + 1 - i, t));
            }
            i = end + 1;
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        long.join("\n")
    );
}
