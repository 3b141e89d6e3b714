//! The engine on device gradients ([`GradSync::sync_device`], host
//! staging) on real MPI ranks (`tests/gpu.rs`), on [`HostMemory`], the
//! host-memory model of a device and its stream (no GPU needed):
//!
//! ```text
//! mpirun -np 3 target/release/examples/device_engine_check
//! mpirun -np 3 target/release/examples/device_engine_check --fail-copy-back
//! ```
//!
//! Two engines per rank with the same table (dense, RGC, quantized RGC and
//! an empty layer, momentum 0.9): one steps on host slices, the other on
//! device buffers; their outputs must be equal bit for bit for 4 steps
//! (`OK steps=4 ranks=<p>`). Then a copy to the host that fails on the
//! last rank must fail that step on every rank (`ERR <error>`) and the next
//! step must equal the host engine's after the same failure (`AFTER ok`).
//! Built with `--features cuda` and where every rank has a GPU, the same
//! steps on real device buffers (`GPU-OK steps=3 ranks=<p>`; otherwise
//! `GPU-SKIPPED <reason>`).
//! With `--fail-copy-back`, the last rank's copy back to the device fails
//! after a step: the job must end (`MPI_Abort`) with a message naming the
//! rank and the step. Exits 2 with the first difference.

use gradsync::comm::MpiComm;
use gradsync::gpu::HostMemory;
use gradsync::sync::{Config, GradSync, Strategy};
use gradsync::Error;

const SIZES: [usize; 4] = [300, 5000, 3000, 0];

fn engine(world: &mpi::topology::SimpleCommunicator) -> GradSync<MpiComm> {
    let cfg = Config {
        momentum: 0.9,
        ..Config::default()
    };
    let mut e = GradSync::new(world, cfg).expect("engine");
    e.register_with("dense", &[SIZES[0]], Strategy::Dense)
        .expect("register");
    e.register_with("rgc", &[SIZES[1]], Strategy::rgc(0.01))
        .expect("register");
    let quant = Strategy::Sparse {
        codec: "rgc-quant".parse().expect("codec"),
        density: Some(0.02),
    };
    e.register_with("quant", &[SIZES[2]], quant)
        .expect("register");
    e.register_with("empty", &[SIZES[3]], Strategy::Dense)
        .expect("register");
    e
}

fn grads(rank: usize, step: usize) -> Vec<Vec<f32>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(l, &n)| {
            (0..n)
                .map(|i| (((i * 7 + l * 13 + rank * 31 + step * 5) % 23) as f32) - 11.0)
                .collect()
        })
        .collect()
}

fn host_step(e: &mut GradSync<MpiComm>, mut g: Vec<Vec<f32>>) -> Vec<Vec<u32>> {
    let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
    e.sync(&mut v).expect("host step");
    g.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

fn device_step(e: &mut GradSync<MpiComm>, g: Vec<Vec<f32>>) -> Vec<Vec<u32>> {
    let mut dev: Vec<HostMemory> = g.into_iter().map(HostMemory::new).collect();
    e.sync_device(&mut dev).expect("device step");
    dev.iter()
        .map(|d| d.data().iter().map(|f| f.to_bits()).collect())
        .collect()
}

fn fail(msg: String) -> ! {
    eprintln!("device_engine_check: {msg}");
    std::process::exit(2)
}

fn main() {
    let universe = mpi::initialize().expect("MPI");
    let world = universe.world();
    use mpi::traits::{Communicator, CommunicatorCollectives};
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let (mut host, mut dev) = (engine(&world), engine(&world));
    for t in 0..4 {
        let want = host_step(&mut host, grads(rank, t));
        let got = device_step(&mut dev, grads(rank, t));
        if got != want {
            fail(format!(
                "rank {rank} step {t}: device step differs from the host step"
            ));
        }
    }
    println!("OK steps=4 ranks={p}");
    if std::env::args().any(|a| a == "--fail-copy-back") {
        let mut d: Vec<HostMemory> = grads(rank, 9).into_iter().map(HostMemory::new).collect();
        if rank == p - 1 {
            // This layer's copy 0 is its copy in, copy 1 its copy back.
            let x = std::mem::take(&mut d[0]);
            d[0] = HostMemory::new(x.into_data()).fail_copy(1);
        }
        let r = dev.sync_device(&mut d).map(|_| ());
        // The failing rank aborts the job; the others wait to be ended.
        world.barrier();
        fail(format!(
            "rank {rank}: the job went on after a failed copy back ({r:?})"
        ));
    }
    // A failed copy in on the last rank: an error everywhere, then the
    // next step equals the host engine's after the same failure.
    let mut d: Vec<HostMemory> = grads(rank, 4).into_iter().map(HostMemory::new).collect();
    if rank == p - 1 {
        let x = std::mem::take(&mut d[1]);
        d[1] = HostMemory::new(x.into_data()).fail_copy(0);
    }
    match dev.sync_device(&mut d) {
        Ok(_) => fail(format!("rank {rank}: a failed copy in succeeded")),
        Err(e) => println!("ERR {e}"),
    }
    if rank == p - 1 {
        host.fail_step(Error::Device("the same failure".into()));
    } else if host
        .sync(
            &mut grads(rank, 4)
                .iter_mut()
                .map(|x| &mut x[..])
                .collect::<Vec<_>>(),
        )
        .is_ok()
    {
        fail(format!(
            "rank {rank}: the host step succeeded beside a failed rank"
        ));
    }
    let want = host_step(&mut host, grads(rank, 5));
    let got = device_step(&mut dev, grads(rank, 5));
    if got != want {
        fail(format!(
            "rank {rank}: the step after the failure differs from the host engine's"
        ));
    }
    println!("AFTER ok");
    gpu_cases(&world, rank, p);
}

/// The same on real device buffers ([`gradsync::gpu::CudaStaging`]) when
/// every rank has a GPU (the ranks agree first, so none waits alone):
/// `GPU-OK steps=3 ranks=<p>`, or `GPU-SKIPPED <reason>` on every rank.
#[cfg(feature = "cuda")]
fn gpu_cases(world: &mpi::topology::SimpleCommunicator, rank: usize, p: usize) {
    use gradsync::failure::agree;
    use gradsync::gpu::{probe, CudaStaging};
    let comm = MpiComm::duplicate_of(world).expect("communicator");
    let devices = match agree(&comm, probe().map_err(Error::Device)) {
        Ok(d) => d.devices,
        Err(e) => {
            println!("GPU-SKIPPED {e}");
            return;
        }
    };
    let (mut host, mut dev) = (engine(world), engine(world));
    for t in 0..3 {
        let want = host_step(&mut host, grads(rank, t));
        let bufs: gradsync::Result<Vec<CudaStaging>> = grads(rank, t)
            .iter()
            .map(|g| CudaStaging::from_host(rank % devices, g))
            .collect();
        let mut bufs = agree(&comm, bufs)
            .unwrap_or_else(|e| fail(format!("rank {rank}: device buffers: {e}")));
        dev.sync_device(&mut bufs)
            .unwrap_or_else(|e| fail(format!("rank {rank}: GPU step {t}: {e}")));
        let got: Vec<Vec<u32>> = bufs
            .iter()
            .map(|b| {
                let v = b
                    .to_host()
                    .unwrap_or_else(|e| fail(format!("rank {rank}: GPU step {t}: copy back: {e}")));
                v.iter().map(|f| f.to_bits()).collect()
            })
            .collect();
        if got != want {
            fail(format!(
                "rank {rank}: GPU step {t}: device step differs from the host step"
            ));
        }
    }
    println!("GPU-OK steps=3 ranks={p}");
}

#[cfg(not(feature = "cuda"))]
fn gpu_cases(_world: &mpi::topology::SimpleCommunicator, _rank: usize, _p: usize) {
    println!("GPU-SKIPPED built without the cuda feature");
}
