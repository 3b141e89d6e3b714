//! Drift check of the C header: regenerate `include/gradsync.h` from the
//! sources with cbindgen (capi/cbindgen.toml) and compare it with the
//! checked-in file. `GRADSYNC_BLESS=1 cargo test -p gradsync-capi-header
//! --release` rewrites the file instead.

use std::path::Path;

#[test]
fn header_matches_the_sources() {
    // The C ABI crate (capi/), one level up from this package.
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("capi/header has a parent");
    let header = crate_dir.join("../include/gradsync.h");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("read capi/cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen failed on capi/src");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("header is UTF-8");

    // What the checked-in header must contain, whatever cbindgen's layout.
    for needle in [
        "#ifndef GRADSYNC_H",
        "#include <mpi.h>",
        "typedef struct gs_engine gs_engine;",
        "extern \"C\" {",
        "int gs_engine_create(MPI_Comm comm,",
        "int gs_allreduce(MPI_Comm comm,",
        "GS_ERR_RANK_FAILED = 2",
    ] {
        assert!(
            fresh.contains(needle),
            "generated header lacks {needle:?}:\n{fresh}"
        );
    }

    if std::env::var_os("GRADSYNC_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&header, &fresh).expect("write include/gradsync.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&header).unwrap_or_default();
    if checked_in != fresh {
        let first = checked_in
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(fresh.lines().count()));
        panic!(
            "include/gradsync.h is out of date with capi/src (first difference at line {}); \
             regenerate it with: GRADSYNC_BLESS=1 cargo test -p gradsync-capi-header --release",
            first + 1
        );
    }
}
