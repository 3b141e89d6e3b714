# Sourced by hpc/gpu/run.sh and hpc/gpu/check.sh on the GPU machine: the
# Open MPI carried in .gpu/deb (hpc/gpu/bundle.sh), unpacked under
# /opt/gs-mpi, and the environment that finds it.
root=/opt/gs-mpi
mkdir -p "$root"
for f in .gpu/deb/*.deb; do dpkg -x "$f" "$root"; done
# dpkg -x runs no maintainer scripts: no alternatives, so name mpirun here.
ln -sf orterun "$root/usr/bin/mpirun"
ln -sf orterun "$root/usr/bin/mpiexec"
lib="$root/usr/lib/x86_64-linux-gnu"
export PATH="$root/usr/bin:$PATH"
export LD_LIBRARY_PATH="$lib/openmpi/lib:$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$root/usr"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Debian's PMIx lacks its zlib component there: say nothing of it.
export PMIX_MCA_pcompress_base_silence_warning=1
