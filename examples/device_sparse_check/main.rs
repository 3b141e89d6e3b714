//! The device-resident sparse step (`gradsync::gpu::sparse`) on real MPI
//! ranks (`tests/gpu.rs`, `hpc/gpu/check.sh`):
//!
//! ```text
//! mpirun -np 3 target/release/examples/device_sparse_check
//! mpirun -np 1 target/release/examples/device_sparse_check --kernels
//! mpirun -np 1 target/release/examples/device_sparse_check --bench [--log2n 26] [--density 0.001] [--reps 11]
//! ```
//!
//! Default: for `trimmed` and `threshold` selection with momentum 0.5
//! (Nesterov for one), the device step and the host engine with the same
//! `rgc` strategy run 5 steps of integer-valued gradients on a table of
//! 6 layers; their results must be equal bit for bit every step, on the
//! CPU reference (`SPARSE-OK host ...`) and, built with `--features cuda`
//! on a GPU, on the kernels (`SPARSE-OK cuda ...`, else `GPU-SKIPPED
//! <reason>`). Then a NaN gradient on the last rank must fail the step on
//! every rank (`SPARSE-ERR-OK`). Exits 2 with the first difference.
//!
//! `--kernels` (a GPU): each kernel against the CPU reference on the same
//! buffers, real-valued and integer-valued, layers across block borders:
//! `KERNELS-OK checks=<n>`.
//!
//! `--bench` (a GPU, one rank): the selection of one layer of `2^log2n`
//! normal values at `density` (threshold search, its reuse, trimmed), and
//! one step of the ResNet-50 table (`examples/layers/resnet50.json`) at
//! density 0.001, device-resident against the staged path (copy to the
//! host, host engine, copy back), medians of `reps`: one line
//! `BENCH-JSON {...}`.

use gradsync::codec::{CodecConfig, RgcMethod};
use gradsync::comm::MpiComm;
use gradsync::gpu::sparse::{DeviceSparse, DeviceSparseConfig, HostOps, Method, SparseOps};
use gradsync::sync::{Config, GradSync, Strategy};
use mpi::traits::Communicator;

const SIZES: [usize; 6] = [3000, 1, 0, 4097, 20000, 70000];

fn fail(msg: String) -> ! {
    eprintln!("device_sparse_check: {msg}");
    std::process::exit(2)
}

/// Integers in [-40, 40], or reals in [-1, 1), from a hash.
fn grad(rank: usize, step: usize, n: usize, integer: bool) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut h = (i as u64 + 1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add((rank as u64 + 1) << 40)
                .wrapping_add((step as u64 + 1) << 20);
            h ^= h >> 29;
            h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h ^= h >> 32;
            if integer {
                (h % 81) as f32 - 40.0
            } else {
                (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            }
        })
        .collect()
}

/// Gradients in and results out of a device step's buffers.
trait Grads: SparseOps {
    fn put(&mut self, g: &[f32]);
    fn get(&mut self) -> Vec<f32>;
}

impl Grads for HostOps {
    fn put(&mut self, g: &[f32]) {
        self.grads = g.to_vec();
    }
    fn get(&mut self) -> Vec<f32> {
        self.grads.clone()
    }
}

#[cfg(feature = "cuda")]
impl Grads for gradsync::gpu::sparse::CudaOps {
    fn put(&mut self, g: &[f32]) {
        self.upload_grads(g)
            .unwrap_or_else(|e| fail(format!("upload: {e}")));
    }
    fn get(&mut self) -> Vec<f32> {
        self.download_grads()
            .unwrap_or_else(|e| fail(format!("download: {e}")))
    }
}

fn host_engine<C: Communicator>(
    world: &C,
    method: RgcMethod,
    m: f32,
    nest: bool,
) -> GradSync<MpiComm> {
    let cfg = Config {
        momentum: m,
        nesterov: nest,
        ..Config::default()
    };
    let mut e = GradSync::new(world, cfg).expect("engine");
    for (l, &n) in SIZES.iter().enumerate() {
        let s = Strategy::Sparse {
            codec: CodecConfig::Rgc {
                density: 0.01,
                method,
            },
            density: None,
        };
        e.register_with(&format!("l{l}"), &[n], s)
            .expect("register");
    }
    e
}

/// The device step on `ops` against the host engine, 5 steps.
fn compare<C: Communicator, O: Grads>(world: &C, label: &str, make: &dyn Fn() -> O) -> usize {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let comm = MpiComm::duplicate_of(world).expect("comm");
    let mut checks = 0;
    for (method, m, nest) in [
        (RgcMethod::Trimmed, 0.5, false),
        (RgcMethod::Threshold, 0.5, true),
        (RgcMethod::Threshold, 0.0, false),
    ] {
        let mut host = host_engine(world, method, m, nest);
        let cfg = DeviceSparseConfig {
            density: 0.01,
            method: Method::from_rgc(method).expect("method"),
            momentum: m,
            nesterov: nest,
        };
        let mut dev = DeviceSparse::new(make(), cfg).expect("device step");
        for step in 0..5 {
            let mut gs: Vec<Vec<f32>> = SIZES
                .iter()
                .enumerate()
                .map(|(l, &n)| grad(rank, step * 31 + l, n, true))
                .collect();
            dev.ops().put(&gs.concat());
            let mut view: Vec<&mut [f32]> = gs.iter_mut().map(|g| &mut g[..]).collect();
            host.sync(&mut view).expect("host step");
            if let Err(e) = dev.step(&comm) {
                fail(format!("rank {rank} {label} {method:?} step {step}: {e}"));
            }
            let (want, got) = (gs.concat(), dev.ops().get());
            if let Some(i) = (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits()) {
                fail(format!(
                    "rank {rank} {label} {method:?} momentum {m} step {step}: element {i}: host {} device {}",
                    want[i], got[i]
                ));
            }
            checks += 1;
        }
    }
    // A NaN on the last rank: an error on every rank, nothing changed.
    let mut dev = DeviceSparse::new(make(), DeviceSparseConfig::default()).expect("device step");
    let n: usize = SIZES.iter().sum();
    let mut g = grad(rank, 99, n, true);
    if rank == p - 1 {
        g[n / 2] = f32::NAN;
    }
    dev.ops().put(&g);
    match dev.step(&comm) {
        Err(e) if e.to_string().contains(&format!("rank {}", p - 1)) => {}
        other => fail(format!(
            "rank {rank} {label}: a NaN on rank {} gave {other:?}",
            p - 1
        )),
    }
    dev.ops().put(&grad(rank, 100, n, true));
    if let Err(e) = dev.step(&comm) {
        fail(format!(
            "rank {rank} {label}: the step after the failed one: {e}"
        ));
    }
    println!("SPARSE-OK {label} steps={checks} ranks={p}");
    println!("SPARSE-ERR-OK {label}");
    checks
}

fn main() {
    let universe = mpi::initialize().expect("MPI");
    let world = universe.world();
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--kernels") {
        kernels(&args);
        return;
    }
    if args.iter().any(|a| a == "--bench") {
        bench(&world, &args);
        return;
    }
    compare(&world, "host", &|| HostOps::new(&SIZES));
    cuda_compare(&world);
}

#[cfg(not(feature = "cuda"))]
fn cuda_compare<C: Communicator>(_: &C) {
    println!("GPU-SKIPPED built without the cuda feature");
}

#[cfg(not(feature = "cuda"))]
fn kernels(_: &[String]) {
    println!("GPU-SKIPPED built without the cuda feature");
}

#[cfg(not(feature = "cuda"))]
fn bench<C: Communicator>(_: &C, _: &[String]) {
    println!("GPU-SKIPPED built without the cuda feature");
}

#[cfg(feature = "cuda")]
fn cuda_compare<C: Communicator>(world: &C) {
    use mpi::collective::CommunicatorCollectives;
    use mpi::collective::SystemOperation;
    let rank = world.rank() as usize;
    let why = gradsync::gpu::probe().err();
    let mut any = [u32::from(why.is_some())];
    let mut all = [0u32];
    world.all_reduce_into(&any[..], &mut all[..], SystemOperation::max());
    any[0] = all[0];
    if any[0] != 0 {
        println!(
            "GPU-SKIPPED {}",
            why.unwrap_or_else(|| "another rank has no GPU".into())
        );
        return;
    }
    let ndev = gradsync::gpu::probe().map(|d| d.devices).unwrap_or(1);
    let make = || {
        gradsync::gpu::sparse::CudaOps::new(rank % ndev, &SIZES)
            .unwrap_or_else(|e| fail(format!("rank {rank}: CudaOps: {e}")))
    };
    compare(world, "cuda", &make);
}

#[cfg(feature = "cuda")]
mod gpu_checks;
#[cfg(feature = "cuda")]
use gpu_checks::{bench, kernels};
