#!/usr/bin/env bash
# Make .gpu/ (ignored by git): what a GPU machine lent through the workplace's
# `device` tool needs to run gradsync's GPU checks. That machine
# reaches no package registry and has no MPI library, so everything travels
# from here, built here:
#   .gpu/deb/      Debian 12's Open MPI 4.1 and the libraries it needs
#                  (binary packages, unpacked there by hpc/gpu/run.sh);
#   .gpu/bin/      the `gpu` integration test and the examples it runs, built
#                  with --features cuda, stripped;
#   .gpu/exe_dir   the directory the test expects the examples in (a path
#                  compiled into it; run.sh recreates it there);
#   .gpu/wheel/    the Python package built with the cuda feature.
# Then, with the `device` tool:
#   run(command="hpc/gpu/run.sh", carry=[".gpu"])
# Debian's Open MPI is not CUDA-aware (mpi_built_with_cuda_support: false),
# so the device checks run the staged route; the direct route needs a
# CUDA-aware MPI brought the same way.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/deb .gpu/bin

# 1. Open MPI and what it links that a CUDA image may lack (not libc,
#    libstdc++, zlib or OpenSSL, which every image has).
pkgs=(openmpi-bin libopenmpi3 openmpi-common libpmix2 libevent-core-2.1-7
      libevent-pthreads-2.1-7 libhwloc15 libhwloc-plugins libfabric1 libucx0
      libibverbs1 ibverbs-providers librdmacm1 libnl-3-200 libnl-route-3-200
      libnuma1 libpciaccess0 libpsm-infinipath1 libpsm2-2 libmunge2 libxnvctrl0
      ocl-icd-libopencl1 libx11-6 libxext6 libxcb1 libxau6 libxdmcp6 libbsd0
      libmd0 libxml2 libicu72)
(cd .gpu/deb && apt-get download "${pkgs[@]}" >/dev/null)

# 2. The test and the examples, built with the cuda feature.
cargo build --release --features cuda --example staging_check --example device_engine_check --example device_sparse_check
test_exe=$(cargo test --release --features cuda --test gpu --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])' | tail -1)
[ -n "$test_exe" ] || { echo "bundle.sh: no gpu test executable" >&2; exit 1; }
strip -o .gpu/bin/gpu "$test_exe"
for ex in staging_check device_engine_check device_sparse_check; do
  strip -o ".gpu/bin/$ex" "target/release/examples/$ex"
done
realpath target/release > .gpu/exe_dir

# 3. The Python package with the cuda feature (abi3: any CPython >= 3.9, so
#    the image's 3.12 takes it), for tests/python/check_cuda.py there.
maturin=${GRADSYNC_VENV:-.venv}/bin/maturin
[ -x "$maturin" ] || { echo "bundle.sh: no $maturin: run hpc/setup.sh first" >&2; exit 1; }
# --auditwheel skip: libmpi stays the machine's own (never bundled), the one
# mpi4py uses.
"$maturin" build --quiet --release --features cuda --strip --auditwheel skip -m python/Cargo.toml -o .gpu/wheel
du -sh .gpu
