//! Builds `src/comm/in_place.c`, the one value of the MPI library's
//! `mpi.h` that rsmpi does not export (`MPI_IN_PLACE`), against the MPI
//! library that rsmpi's own build finds (the same probe: `mpicc`, else
//! pkg-config's include paths).

fn main() {
    println!("cargo:rerun-if-changed=src/comm/in_place.c");
    // No rerun on the probe's environment (MPICC, MPI_PKG_CONFIG, ...):
    // mpi-sys's build does not rerun on it either, and the shim must stay
    // built against the library mpi-sys links (the engine also checks the
    // value against the linked library at run time).
    let lib = match build_probe_mpi::probe() {
        Ok(lib) => lib,
        Err(errs) => {
            for (i, e) in errs.iter().enumerate() {
                println!("cargo:warning=MPI probe, method {}: {e}", i + 1);
            }
            panic!("gradsync needs an MPI library (mpicc or pkg-config's mpi), as rsmpi does");
        }
    };
    let mut b = cc::Build::new();
    b.file("src/comm/in_place.c");
    if let Some(mpicc) = lib.mpicc {
        b.compiler(mpicc);
    } else {
        for inc in &lib.include_paths {
            b.include(inc);
        }
    }
    b.compile("gradsync_in_place");
}
