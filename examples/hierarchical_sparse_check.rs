//! The hierarchical sparse allreduce
//! ([`gradsync::sparse::hierarchical`]) on real MPI ranks
//! (`tests/hierarchical_sparse.rs`, `hpc/cluster_test.sh`). Runnable by hand:
//!
//! ```text
//! mpirun -np 5 target/release/examples/hierarchical_sparse_check sum
//! mpirun -np 3 target/release/examples/hierarchical_sparse_check errors
//! ```
//!
//! * `sum`: prints `NODES <map>` (MPI's node map, `MpiComm::node_ids`) on
//!   rank 0; then for that map and emulated ones (two ranks per node,
//!   alternating ranks, all on one node, every rank its own node), several
//!   n and deltas (the dense switch forced either way; the MPI allgatherv
//!   with delta 2), every rank's random sparse contribution (integer
//!   values, overlapping indices, some ranks empty or all zero) is summed
//!   by the hierarchical sparse allreduce and, densely decoded, by
//!   `MPI_Allreduce`: the two must be bitwise equal, the report the same on
//!   every rank and its union count right. Prints
//!   `OK <case> ranks=<p>` or `FAIL <case> ...` per case on every rank.
//! * `errors`: an index ≥ n on the last rank, a different n on rank 0, a
//!   different node map on rank 0, a short node map on the last rank and
//!   `reselect` on rank 0; every rank prints `ERR <case> <error>` for each
//!   (the cases needing two ranks are skipped at p = 1), then
//!   `OK after-errors` once a good call succeeds on the same communicator.

use gradsync::comm::{MpiComm, Transport};
use gradsync::dense::AllgathervAlgo;
use gradsync::sparse::allreduce::SparseAllreduceOptions;
use gradsync::sparse::hierarchical::hierarchical_sparse_allreduce;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn fail(msg: String) -> ! {
    eprintln!("hierarchical_sparse_check: {msg}");
    std::process::exit(2)
}

fn contribution(r: usize, n: usize, seed: u64) -> (Vec<u32>, Vec<f32>) {
    let mut g = SmallRng::seed_from_u64(seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    if n == 0 || g.gen_range(0..5) == 0 {
        return (Vec::new(), Vec::new());
    }
    let k = g.gen_range(0..=(n / 4).clamp(1, 5000));
    let zeros = g.gen_range(0..6) == 0;
    let hot = SmallRng::seed_from_u64(seed).gen_range(0..n);
    let idx = (0..k)
        .map(|_| match g.gen_range(0..3) {
            0 => ((hot + g.gen_range(0..16)) % n) as u32,
            _ => g.gen_range(0..n) as u32,
        })
        .collect();
    let val = (0..k)
        .map(|_| {
            if zeros {
                0.0
            } else {
                g.gen_range(-100i32..=100) as f32
            }
        })
        .collect();
    (idx, val)
}

fn mpi_sum(comm: &MpiComm, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    comm.native_allreduce_sum(x, &mut y)
        .expect("MpiComm has MPI_Allreduce")
        .unwrap_or_else(|e| fail(format!("MPI_Allreduce: {e}")));
    y
}

fn sum(comm: &MpiComm) {
    let (rank, p) = (comm.rank(), comm.size());
    let mpi_nodes = comm.node_ids();
    if rank == 0 {
        println!("NODES {mpi_nodes:?}");
    }
    let maps: Vec<(&str, Vec<usize>)> = vec![
        ("mpi", mpi_nodes),
        ("pairs", (0..p).map(|r| r / 2).collect()),
        ("alternating", (0..p).map(|r| r % 2).collect()),
        ("one-node", vec![3; p]),
        ("own-node", (0..p).collect()),
    ];
    let mut seed = 0u64;
    for (name, nodes) in &maps {
        for n in [0usize, 1, 5, 1000, 100_003] {
            for delta in [0.5, 0.0, 2.0] {
                seed += 1;
                let gather = if delta == 2.0 {
                    AllgathervAlgo::Mpi
                } else {
                    AllgathervAlgo::RecursiveDoubling
                };
                let opts = SparseAllreduceOptions {
                    delta,
                    gather,
                    ..Default::default()
                };
                let case = format!("map={name} n={n} delta={delta} {}", gather.name());
                let (idx, val) = contribution(rank, n, seed);
                let mut got = vec![f32::NAN; n];
                let res =
                    hierarchical_sparse_allreduce(comm, n, nodes, &idx, &val, &mut got, &opts);
                let mut dense = vec![0f32; n];
                let mut mine = vec![0f32; n];
                for (&i, &x) in idx.iter().zip(&val) {
                    dense[i as usize] += x;
                    mine[i as usize] = 1.0;
                }
                let want = mpi_sum(comm, &dense);
                let union = mpi_sum(comm, &mine).iter().filter(|&&c| c > 0.0).count();
                let rep = match res {
                    Err(e) => {
                        println!("FAIL {case} error {e} ranks={p}");
                        continue;
                    }
                    Ok(rep) => rep,
                };
                if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                    println!(
                        "FAIL {case} out[{i}] = {} want {} ranks={p}",
                        got[i], want[i]
                    );
                    continue;
                }
                // The same report on every rank: the sums of its fields are
                // p times this rank's.
                let dense_nodes = rep.dense.iter().filter(|&&d| d).count();
                let fields = [
                    rep.result_nnz as f32,
                    rep.node_nnz.iter().sum::<usize>() as f32,
                    rep.node_nnz.len() as f32,
                    dense_nodes as f32,
                ];
                let all = mpi_sum(comm, &fields);
                let nonzero = want.iter().filter(|x| x.to_bits() != 0).count();
                let union_ok = if dense_nodes == 0 {
                    rep.result_nnz == union
                } else {
                    (nonzero..=union).contains(&rep.result_nnz)
                };
                if all.iter().zip(&fields).any(|(a, f)| *a != f * p as f32) || !union_ok {
                    println!(
                        "FAIL {case} report {rep:?} (union {union}, nonzero {nonzero}) ranks={p}"
                    );
                    continue;
                }
                println!("OK {case} dense_nodes={dense_nodes} ranks={p}");
            }
        }
    }
}

fn errors(comm: &MpiComm) {
    let (rank, p) = (comm.rank(), comm.size());
    let opts = SparseAllreduceOptions::default();
    let good: Vec<usize> = (0..p).map(|r| r / 2).collect();
    let mut out = vec![0f32; 100];
    let report = |case: &str, r: gradsync::Result<_>| match r {
        Ok(_) => println!("NOERR {case}"),
        Err(e) => println!("ERR {case} {e}"),
    };
    let bad = if rank == p - 1 { 100 } else { 3 };
    report(
        "index",
        hierarchical_sparse_allreduce(comm, 100, &good, &[1, bad], &[1.0, 1.0], &mut out, &opts),
    );
    let short = if rank == p - 1 {
        &good[..p - 1]
    } else {
        &good[..]
    };
    report(
        "short-map",
        hierarchical_sparse_allreduce(comm, 100, short, &[1], &[1.0], &mut out, &opts),
    );
    let reselect = SparseAllreduceOptions {
        reselect: (rank == 0).then_some(10),
        ..Default::default()
    };
    report(
        "reselect",
        hierarchical_sparse_allreduce(comm, 100, &good, &[1], &[1.0], &mut out, &reselect),
    );
    if p > 1 {
        let n = if rank == 0 { 99 } else { 100 };
        report(
            "n",
            hierarchical_sparse_allreduce(comm, n, &good, &[1], &[1.0], &mut out[..n], &opts),
        );
        let other: Vec<usize> = if rank == 0 {
            (0..p).collect()
        } else {
            good.clone()
        };
        report(
            "map",
            hierarchical_sparse_allreduce(comm, 100, &other, &[1], &[1.0], &mut out, &opts),
        );
    }
    let r = hierarchical_sparse_allreduce(comm, 100, &good, &[7], &[2.0], &mut out, &opts);
    if r.is_ok() && out[7] == 2.0 * p as f32 && out.iter().filter(|&&x| x != 0.0).count() == 1 {
        println!("OK after-errors");
    } else {
        println!("FAIL after-errors {r:?}");
    }
}

fn main() {
    let universe = mpi::initialize().unwrap_or_else(|| fail("MPI initialized twice".into()));
    let world = universe.world();
    let comm = MpiComm::duplicate_of(&world).unwrap_or_else(|e| fail(format!("{e}")));
    match std::env::args().nth(1).as_deref() {
        Some("sum") => sum(&comm),
        Some("errors") => errors(&comm),
        _ => fail("usage: hierarchical_sparse_check sum | errors".into()),
    }
}
