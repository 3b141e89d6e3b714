//! The node-aware allreduce ([`gradsync::dense::hierarchical_allreduce`]) on
//! real MPI ranks (`tests/hierarchical.rs`). Runnable by hand:
//!
//! ```text
//! mpirun -np 5 target/release/examples/hierarchical_check
//! ```
//!
//! For the node map MPI reports (`MpiComm::node_ids`, ranks sharing
//! memory) and for emulated maps (two ranks per node, alternating ranks,
//! one rank per node, an uneven split), several lengths, sum and average:
//! the result must equal `MPI_Allreduce` of the same integer-valued inputs
//! bit for bit (sum; the average as the sum times `1/p`). Then the engine
//! configured with `AllreduceAlgo::Hierarchical` (MPI's map): three dense
//! layers' directions must be MPI's average. Bad node maps on one rank
//! (too short; different) must be an error on every rank (`ERR <case>`),
//! and the next call must work (`AFTER ok`). Prints `NODES <map>` once,
//! then `OK <case> ranks=<p>` per case on every rank, or exits 2 with the
//! first difference.

use gradsync::comm::{MpiComm, Transport};
use gradsync::dense::{hierarchical_allreduce, AllreduceAlgo, AllreduceOptions, ReduceOp};
use gradsync::sync::{Config, GradSync, Strategy};

fn input(r: usize, n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + r * 104_729 + seed * 31) % 201) as f32 - 100.0)
        .collect()
}

fn fail(msg: String) -> ! {
    eprintln!("hierarchical_check: {msg}");
    std::process::exit(2)
}

fn main() {
    let universe = mpi::initialize().expect("MPI");
    let comm = MpiComm::duplicate_of(&universe.world()).expect("communicator");
    let (rank, p) = (comm.rank(), comm.size());
    let mpi_nodes = comm.node_ids();
    if rank == 0 {
        println!("NODES {mpi_nodes:?}");
    }
    let maps: Vec<(&str, Vec<usize>)> = vec![
        ("mpi", mpi_nodes),
        ("pairs", (0..p).map(|r| r / 2).collect()),
        ("alternating", (0..p).map(|r| r % 2).collect()),
        ("one-per-node", (0..p).collect()),
        (
            "uneven",
            (0..p).map(|r| usize::from(r > p.div_ceil(2))).collect(),
        ),
    ];
    for (name, nodes) in &maps {
        for n in [0, 1, p + 1, 1000, 65_537] {
            for (seed, op) in [(1, ReduceOp::Sum), (2, ReduceOp::Average)] {
                let x = input(rank, n, seed);
                let mut want = vec![0f32; n];
                comm.native_allreduce_sum(&x, &mut want)
                    .expect("MPI_Allreduce on MpiComm")
                    .expect("MPI_Allreduce");
                if op == ReduceOp::Average {
                    want.iter_mut().for_each(|v| *v /= p as f32);
                }
                let mut got = x.clone();
                let opts = AllreduceOptions {
                    op,
                    ..Default::default()
                };
                if let Err(e) = hierarchical_allreduce(&comm, &mut got, nodes, &opts) {
                    eprintln!("hierarchical_check: {name} n={n} {op:?}: {e}");
                    std::process::exit(2);
                }
                if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                    eprintln!(
                        "hierarchical_check: rank {rank}: {name} {nodes:?} n={n} {op:?}: element {i}: {} vs MPI {}",
                        got[i], want[i]
                    );
                    std::process::exit(2);
                }
                println!("OK {name} n={n} {op:?} ranks={p}");
            }
        }
    }
    // A node map of the wrong length on the last rank, then a map that
    // differs on rank 0: an error on every rank (`ERR <case> <error>`), no
    // hang; then a good call on the same communicator (`AFTER ok`).
    let mut b = vec![1f32; 100];
    let good: Vec<usize> = (0..p).map(|r| r / 2).collect();
    let short: Vec<usize> = if rank == p - 1 {
        good[..p - 1].to_vec()
    } else {
        good.clone()
    };
    let opts = AllreduceOptions::default();
    match hierarchical_allreduce(&comm, &mut b, &short, &opts) {
        Err(e) => println!("ERR short-map {e}"),
        Ok(()) => fail(format!(
            "rank {rank}: a short map on rank {} was accepted",
            p - 1
        )),
    }
    if p > 1 {
        let other: Vec<usize> = if rank == 0 {
            (0..p).collect()
        } else {
            good.clone()
        };
        match hierarchical_allreduce(&comm, &mut b, &other, &opts) {
            Err(e) => println!("ERR different-map {e}"),
            Ok(()) => fail(format!(
                "rank {rank}: a different map on rank 0 was accepted"
            )),
        }
    }
    let mut b = vec![1f32; 100];
    if hierarchical_allreduce(&comm, &mut b, &good, &opts).is_ok()
        && b.iter().all(|&x| x == p as f32)
    {
        println!("AFTER ok");
    } else {
        fail(format!("rank {rank}: the call after the errors failed"));
    }
    // The engine's fused dense group through the hierarchical allreduce.
    let cfg = Config {
        allreduce: AllreduceAlgo::Hierarchical.into(),
        ..Config::default()
    };
    let mut engine = GradSync::new(&universe.world(), cfg).expect("engine");
    let sizes = [7usize, 1000, 65_537];
    for (i, &n) in sizes.iter().enumerate() {
        engine
            .register_with(&format!("layer{i}"), &[n], Strategy::Dense)
            .expect("register");
    }
    for step in 0..3 {
        let mut grads: Vec<Vec<f32>> = sizes.iter().map(|&n| input(rank, n, 10 + step)).collect();
        let mut want: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0f32; n]).collect();
        for (g, w) in grads.iter().zip(want.iter_mut()) {
            comm.native_allreduce_sum(g, w)
                .expect("MPI_Allreduce on MpiComm")
                .expect("MPI_Allreduce");
            w.iter_mut().for_each(|v| *v /= p as f32);
        }
        let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| &mut g[..]).collect();
        engine.sync(&mut views).expect("engine step");
        if grads
            .iter()
            .zip(&want)
            .any(|(g, w)| g.iter().zip(w).any(|(a, b)| a.to_bits() != b.to_bits()))
        {
            eprintln!(
                "hierarchical_check: rank {rank}: engine step {step} differs from MPI's average"
            );
            std::process::exit(2);
        }
        println!("OK engine step={step} ranks={p}");
    }
}
