//! Calling gradsync from an existing rsmpi program: a toy data-parallel
//! training loop that averages per-layer gradients every step.
//!
//! ```text
//! mpirun -np 4 target/release/examples/training_loop
//! ```
use gradsync::comm::{MpiComm, Transport};
use gradsync::dense::{allreduce_with, AllreduceAlgo, AllreduceOptions, ReduceOp, Workspace};
use mpi::traits::*;

fn main() -> Result<(), gradsync::Error> {
    let universe = mpi::initialize().expect("MPI initialized twice");
    let world = universe.world();
    // One duplicate for all of gradsync's traffic; the application keeps `world`.
    let comm = MpiComm::duplicate_of(&world)?;
    let (rank, p) = (comm.rank(), comm.size());

    // Three "layers" of different sizes; each rank has its own gradients.
    let sizes = [10usize, 1000, 250_000];
    let mut layers: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let mut ws = Workspace::new(); // reused: no allocation after the first step
    let opts = AllreduceOptions {
        op: ReduceOp::Average,
        ..Default::default()
    };

    for step in 0..5 {
        for (l, g) in layers.iter_mut().enumerate() {
            g.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = (rank + i + l + step) as f32);
            // Small layers: latency-bound, Rabenseifner; large: ring.
            let algo = if g.len() < 65_536 {
                AllreduceAlgo::Rabenseifner
            } else {
                AllreduceAlgo::Ring
            };
            allreduce_with(&comm, g, algo, &opts, &mut ws)?;
            // Average over ranks of (rank + i + l + step) = (p-1)/2 + i + l + step.
            let want = |i: usize| (p - 1) as f32 / 2.0 + (i + l + step) as f32;
            if let Some(i) =
                (0..g.len()).find(|&i| (g[i] - want(i)).abs() > 1e-3 * want(i).max(1.0))
            {
                eprintln!(
                    "rank {rank}: layer {l} element {i} = {}, expected {}",
                    g[i],
                    want(i)
                );
                world.abort(1);
            }
        }
    }
    if rank == 0 {
        println!(
            "training_loop: {p} ranks, 5 steps x {} layers averaged correctly",
            sizes.len()
        );
    }
    Ok(())
}
