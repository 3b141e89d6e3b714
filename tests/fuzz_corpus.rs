//! Every kept fuzz input (`fuzz/corpus/<target>/`) through its fuzz
//! target's own code, in the ordinary release build: the decoders' and
//! loaders' checks (never a panic on hostile bytes, errors that name the
//! file) on every input the fuzzing kept, on every test run.
//!
//! The targets' sources are compiled here unchanged: `fuzz_target!` (from
//! `libfuzzer_sys`, aliased to this crate) makes each one a `run`
//! function, and `gradsync_fuzz` (the fuzz crate's library) is included
//! from `fuzz/src/lib.rs`. No sanitizer and no new inputs: that is
//! `hpc/fuzz-ci.sh` (cargo fuzz, ASan), which `hpc/test.sh` runs where
//! its time budget allows.

// The names the fuzz targets import from.
extern crate self as gradsync_fuzz;
extern crate self as libfuzzer_sys;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// libfuzzer-sys's `fuzz_target!(|data: &[u8]| { ... })`, as a function
/// `run` of the target's module.
macro_rules! fuzz_target {
    (|$data:ident: &[u8]| $body:block) => {
        pub fn run($data: &[u8]) $body
    };
}
pub(crate) use fuzz_target;

#[allow(dead_code)]
#[path = "../fuzz/src/lib.rs"]
mod fuzz_lib;
pub use fuzz_lib::*;

// A target's `#![no_main]` is its own crate's attribute, inert here, and
// its `use libfuzzer_sys::fuzz_target` names the macro above.
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/codec_decode.rs"]
mod codec_decode;
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/device_units.rs"]
mod device_units;
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/fused.rs"]
mod fused;
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/layers.rs"]
mod layers;
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/npy.rs"]
mod npy;
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/profile.rs"]
mod profile;
#[allow(unused_attributes, unused_imports)]
#[path = "../fuzz/fuzz_targets/snapshot.rs"]
mod snapshot;

type Target = (&'static str, fn(&[u8]));

/// Every target of fuzz/Cargo.toml, by its `[[bin]]` name.
const TARGETS: &[Target] = &[
    ("codec_decode", codec_decode::run),
    ("device_units", device_units::run),
    ("fused", fused::run),
    ("layers", layers::run),
    ("npy", npy::run),
    ("profile", profile::run),
    ("snapshot", snapshot::run),
];

#[test]
fn every_kept_fuzz_input_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    // Every target the fuzz crate declares is replayed here.
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("fuzz/Cargo.toml");
    let declared = manifest.matches("[[bin]]").count();
    assert_eq!(
        declared,
        TARGETS.len(),
        "fuzz/Cargo.toml declares {declared} targets, this test replays {}: add the new one to TARGETS",
        TARGETS.len()
    );
    let mut failed = Vec::new();
    let mut total = 0;
    for (name, run) in TARGETS {
        let dir = root.join("corpus").join(name);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("corpus entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: no kept inputs", dir.display());
        for f in files {
            let data = std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            total += 1;
            if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
                failed.push(f.display().to_string());
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {total} kept inputs failed their target (the panics above; reproduce one with \
         `cargo fuzz run -O -a TARGET FILE` in fuzz/): {failed:?}",
        failed.len()
    );
    println!("{total} kept inputs of {} targets passed", TARGETS.len());
}
