//! The host-staged allreduce of a device buffer
//! ([`gradsync::gpu::staged_allreduce`]) and the CUDA-aware detection
//! ([`gradsync::gpu::cuda_aware`]) on real MPI ranks (`tests/gpu.rs`), on
//! [`HostMemory`], the host-memory model of a device and its stream (no
//! GPU needed). Runnable by hand:
//!
//! ```text
//! mpirun -np 3 target/release/examples/staging_check
//! ```
//!
//! Prints `AWARE <json>` (or `AWARE-ERR <error>`) on every rank; then, for
//! several lengths and chunk sizes and the allreduce algorithms, the staged
//! result must equal `MPI_Allreduce` of the whole buffer bit for bit
//! (integer-valued inputs): `OK <case> ranks=<p>`. A length that differs
//! on the last rank and a copy that fails on the last rank must be errors
//! on every rank (`ERR <case> <error>`), and the next call must work
//! (`AFTER ok`). The same for [`device_allreduce`] with this process's
//! `cuda_aware()` decision (`OK-DEVICE route=<staged|direct> <case>`),
//! plus ranks whose routes differ and a failed copy on the direct route.
//! Exits 2 with the first difference.

use gradsync::comm::{MpiComm, Transport};
use gradsync::dense::{AllreduceAlgo, ReduceOp};
use gradsync::gpu::{cuda_aware, device_allreduce, staged_allreduce, HostMemory, StagingOptions};

fn input(r: usize, n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + r * 104_729 + seed * 31) % 201) as f32 - 100.0)
        .collect()
}

/// One case: this rank's input on the host model, `MPI_Allreduce`'s sum
/// of it (the expected result), the options and the case's name.
fn setup(
    comm: &MpiComm,
    n: usize,
    seed: usize,
    chunk: usize,
    algo: AllreduceAlgo,
) -> (HostMemory, Vec<f32>, StagingOptions, String) {
    let x = input(comm.rank(), n, seed);
    let mut want = vec![0f32; n];
    comm.native_allreduce_sum(&x, &mut want)
        .expect("MPI_Allreduce on MpiComm")
        .expect("MPI_Allreduce");
    let opts = StagingOptions {
        chunk_elems: chunk,
        algo,
        op: ReduceOp::Sum,
    };
    let case = format!("n={n} chunk={chunk} {}", algo.name());
    (HostMemory::new(x), want, opts, case)
}

fn fail(msg: String) -> ! {
    eprintln!("staging_check: {msg}");
    std::process::exit(2)
}

fn main() {
    let universe = mpi::initialize().expect("MPI");
    let comm = MpiComm::duplicate_of(&universe.world()).expect("communicator");
    let (rank, p) = (comm.rank(), comm.size());
    match cuda_aware() {
        Ok(a) => println!("AWARE {}", serde_json::to_string(&a).expect("json")),
        Err(e) => println!("AWARE-ERR {e}"),
    }
    let cases = [
        (0, 16),
        (1, 16),
        (p + 1, 1),
        (1000, 7),
        (1000, 1000),
        (65_537, 4096),
        (1_048_579, 1 << 18),
    ];
    for (seed, &(n, chunk)) in cases.iter().enumerate() {
        for algo in [
            AllreduceAlgo::Mpi,
            AllreduceAlgo::Ring,
            AllreduceAlgo::Rabenseifner,
        ] {
            let (mut dev, want, opts, case) = setup(&comm, n, seed, chunk, algo);
            let rep = staged_allreduce(&comm, &mut dev, &opts)
                .unwrap_or_else(|e| fail(format!("rank {rank}: {case}: {e}")));
            if dev.hazards() != 0 {
                fail(format!("rank {rank}: {case}: {} hazards", dev.hazards()));
            }
            if rep.chunks > 1 && dev.max_pending() < 2 {
                fail(format!("rank {rank}: {case}: copies never overlapped"));
            }
            let got = dev.into_data();
            if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                fail(format!(
                    "rank {rank}: {case}: element {i}: {} vs MPI {}",
                    got[i], want[i]
                ));
            }
            println!("OK {case} chunks={} ranks={p}", rep.chunks);
        }
    }
    // The route `device_allreduce` takes for this process's decision:
    // direct for MPI's sum where MPI is CUDA-aware (GRADSYNC_CUDA_AWARE=1
    // here: the host model's "device" is host memory, which any MPI takes),
    // staged otherwise; the result is MPI's either way.
    let aware = cuda_aware().is_ok_and(|a| a.aware);
    for (seed, &(n, chunk)) in [
        (0, 16),
        (1, 16),
        (1000, 7),
        (65_537, 4096),
        (1_048_579, 1 << 18),
    ]
    .iter()
    .enumerate()
    {
        for algo in [AllreduceAlgo::Mpi, AllreduceAlgo::Ring] {
            let (mut dev, want, opts, case) = setup(&comm, n, seed + 10, chunk, algo);
            let rep = device_allreduce(&comm, &mut dev, &opts, aware)
                .unwrap_or_else(|e| fail(format!("rank {rank}: device {case}: {e}")));
            let got = dev.into_data();
            if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                fail(format!(
                    "rank {rank}: device {case}: element {i}: {} vs MPI {}",
                    got[i], want[i]
                ));
            }
            let route = serde_json::to_string(&rep.route).expect("json");
            println!(
                "OK-DEVICE route={} {case} chunks={} ranks={p}",
                route.trim_matches('"'),
                rep.chunks
            );
        }
    }
    gpu_cases(&comm, aware);
    let opts = StagingOptions {
        chunk_elems: 100,
        ..Default::default()
    };
    // Rank 0 decides "CUDA-aware", the others not: the routes differ, an
    // error on every rank, not a hang.
    let mut dev = HostMemory::new(vec![1.0; 1000]);
    match device_allreduce(&comm, &mut dev, &opts, rank == 0) {
        Err(e) => println!("ERR route-mismatch {e}"),
        Ok(_) if p == 1 => println!("ERR route-mismatch (one rank: nothing to differ)"),
        Ok(_) => fail(format!("rank {rank}: different routes were accepted")),
    }
    // The direct route's copy back of the second chunk fails on the last
    // rank: an error on every rank naming it.
    let mut dev = HostMemory::new(vec![1.0; 1000]);
    if rank == p - 1 {
        dev = dev.fail_copy(1);
    }
    match device_allreduce(&comm, &mut dev, &opts, true) {
        Err(e) => println!("ERR direct-copy-failed {e}"),
        Ok(_) => fail(format!(
            "rank {rank}: a failed direct copy on the last rank was accepted"
        )),
    }
    // One more element on the last rank: an error on every rank, no hang.
    let mut dev = HostMemory::new(vec![1.0; 1000 + usize::from(rank == p - 1)]);
    match staged_allreduce(&comm, &mut dev, &opts) {
        Err(e) => println!("ERR size-mismatch {e}"),
        Ok(_) if p == 1 => println!("ERR size-mismatch (one rank: nothing to differ)"),
        Ok(_) => fail(format!(
            "rank {rank}: a longer buffer on the last rank was accepted"
        )),
    }
    // The last rank's fifth copy fails (in the middle of the pipeline).
    let mut dev = HostMemory::new(vec![1.0; 1000]);
    if rank == p - 1 {
        dev = dev.fail_copy(4);
    }
    match staged_allreduce(&comm, &mut dev, &opts) {
        Err(e) => println!("ERR copy-failed {e}"),
        Ok(_) => fail(format!(
            "rank {rank}: a failed copy on the last rank was accepted"
        )),
    }
    let mut dev = HostMemory::new(vec![1.0; 1000]);
    match staged_allreduce(&comm, &mut dev, &opts) {
        Ok(_) if dev.data().iter().all(|&v| v == p as f32) => println!("AFTER ok"),
        other => fail(format!("rank {rank}: the call after the errors: {other:?}")),
    }
}

/// The same on real device buffers ([`gradsync::gpu::CudaStaging`]), when
/// every rank has a GPU (the ranks agree first, so none waits alone):
/// `GPU-OK route=<r> <case> ranks=<p>`, or `GPU-SKIPPED <reason>` on every
/// rank.
#[cfg(feature = "cuda")]
fn gpu_cases(comm: &MpiComm, aware: bool) {
    use gradsync::gpu::{probe, CudaStaging};
    let (rank, p) = (comm.rank(), comm.size());
    let found = probe().map_err(gradsync::Error::Device);
    let devices = match gradsync::failure::agree(comm, found) {
        Ok(d) => d.devices,
        Err(e) => {
            println!("GPU-SKIPPED {e}");
            return;
        }
    };
    // GRADSYNC_CUDA_AWARE=1 forced over an MPI whose own query says it is
    // not CUDA-aware (the host model's check of the direct route): real
    // device pointers would crash that MPI, so the direct case is left out
    // here (the same on every rank: one library).
    use gradsync::gpu::{query_mpi, Query};
    let denied = matches!(query_mpi(), Query::Returned(0) | Query::GpuQuery(0));
    if aware && denied {
        println!("GPU-DIRECT-SKIPPED the override says CUDA-aware, the MPI library says not");
    }
    for (seed, &(n, chunk)) in [(1000, 7), (1_048_579, 1 << 18)].iter().enumerate() {
        // Staged by MPI's allreduce and by the ring, and MPI's sum by the
        // route this process's decision picks (direct on a CUDA-aware MPI).
        for (algo, aware) in [
            (AllreduceAlgo::Mpi, false),
            (AllreduceAlgo::Ring, false),
            (AllreduceAlgo::Mpi, aware),
        ] {
            if aware && denied {
                continue;
            }
            let x = input(rank, n, seed + 20);
            let mut want = vec![0f32; n];
            comm.native_allreduce_sum(&x, &mut want)
                .expect("MPI_Allreduce on MpiComm")
                .expect("MPI_Allreduce");
            let dev = CudaStaging::from_host(rank % devices, &x);
            let mut dev = gradsync::failure::agree(comm, dev)
                .unwrap_or_else(|e| fail(format!("rank {rank}: device buffer: {e}")));
            let opts = StagingOptions {
                chunk_elems: chunk,
                algo,
                op: ReduceOp::Sum,
            };
            let case = format!("n={n} chunk={chunk} {}", algo.name());
            let rep = device_allreduce(comm, &mut dev, &opts, aware)
                .unwrap_or_else(|e| fail(format!("rank {rank}: GPU {case}: {e}")));
            let got = dev
                .to_host()
                .unwrap_or_else(|e| fail(format!("rank {rank}: GPU {case}: copy back: {e}")));
            if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                fail(format!(
                    "rank {rank}: GPU {case}: element {i}: {} vs MPI {}",
                    got[i], want[i]
                ));
            }
            let route = serde_json::to_string(&rep.route).expect("json");
            println!("GPU-OK route={} {case} ranks={p}", route.trim_matches('"'));
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_cases(_comm: &MpiComm, _aware: bool) {
    println!("GPU-SKIPPED built without the cuda feature");
}
