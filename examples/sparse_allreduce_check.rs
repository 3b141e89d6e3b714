//! The sparse allreduce ([`gradsync::sparse::allreduce`]) on real MPI ranks
//! (`tests/sparse_allreduce.rs`). Runnable by hand:
//!
//! ```text
//! mpirun -np 5 target/release/examples/sparse_allreduce_check sum
//! mpirun -np 3 target/release/examples/sparse_allreduce_check errors
//! ```
//!
//! * `sum`: for several n, seeds and options (balancing, the dense switch
//!   forced either way, the MPI allgatherv), every rank's random sparse
//!   contribution (integer values, overlapping indices, some ranks empty or
//!   all zero) is summed by the sparse allreduce and, densely decoded, by
//!   `MPI_Allreduce`; the two must be bitwise equal. Prints
//!   `OK <case> ranks=<p>` or `FAIL <case> ...` per case on every rank.
//! * `errors`: an index ≥ n on the last rank, then a different n on rank 0;
//!   every rank prints `ERR <case> <error>`, then `OK after-errors` once a
//!   good call succeeds on the same communicator.

use gradsync::comm::{MpiComm, Transport};
use gradsync::dense::AllgathervAlgo;
use gradsync::sparse::allreduce::{sparse_allreduce, Balance, SparseAllreduceOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn fail(msg: String) -> ! {
    eprintln!("sparse_allreduce_check: {msg}");
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

fn sum<C: Transport>(comm: &C) {
    let (rank, p) = (comm.rank(), comm.size());
    let mut cases = Vec::new();
    for n in [0usize, 1, 5, 1000, 100_003] {
        for (name, balance) in [
            ("equal", Balance::Equal),
            ("sampled", Balance::Sampled { per_rank: 32 }),
        ] {
            for delta in [0.5, 0.0, 2.0] {
                for gather in [AllgathervAlgo::RecursiveDoubling, AllgathervAlgo::Mpi] {
                    let opts = SparseAllreduceOptions {
                        delta,
                        balance: balance.clone(),
                        reselect: None,
                        gather,
                    };
                    cases.push((
                        format!("n={n},{name},delta={delta},{}", gather.name()),
                        n,
                        opts,
                    ));
                }
            }
        }
    }
    for (seed, (case, n, opts)) in cases.iter().enumerate() {
        let (idx, val) = contribution(rank, *n, seed as u64);
        let mut got = vec![f32::NAN; *n];
        let res = sparse_allreduce(comm, *n, &idx, &val, &mut got, opts);
        let mut dense = vec![0f32; *n];
        for (&i, &x) in idx.iter().zip(&val) {
            dense[i as usize] += x;
        }
        let mut want = vec![0f32; *n];
        comm.native_allreduce_sum(&dense, &mut want)
            .expect("MpiComm has MPI_Allreduce")
            .unwrap_or_else(|e| fail(format!("MPI_Allreduce: {e}")));
        match res {
            Err(e) => println!("FAIL {case} error {e} ranks={p}"),
            Ok(_)
                if got
                    .iter()
                    .zip(&want)
                    .any(|(a, b)| a.to_bits() != b.to_bits()) =>
            {
                let i = (0..*n)
                    .find(|&i| got[i].to_bits() != want[i].to_bits())
                    .unwrap_or(0);
                println!(
                    "FAIL {case} out[{i}] = {} want {} ranks={p}",
                    got[i], want[i]
                );
            }
            Ok(rep) => println!(
                "OK {case} dense_regions={} ranks={p}",
                rep.dense.iter().filter(|&&d| d).count()
            ),
        }
    }
}

fn errors<C: Transport>(comm: &C) {
    let (rank, p) = (comm.rank(), comm.size());
    let opts = SparseAllreduceOptions::default();
    let mut out = vec![0f32; 100];
    let bad = if rank == p - 1 { 100 } else { 3 };
    match sparse_allreduce(comm, 100, &[1, bad], &[1.0, 1.0], &mut out, &opts) {
        Ok(_) => println!("NOERR index"),
        Err(e) => println!("ERR index {e}"),
    }
    let n = if rank == 0 { 99 } else { 100 };
    match sparse_allreduce(comm, n, &[1], &[1.0], &mut out[..n], &opts) {
        Ok(_) => println!("NOERR n"),
        Err(e) => println!("ERR n {e}"),
    }
    let r = sparse_allreduce(comm, 100, &[7], &[2.0], &mut out, &opts);
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
        _ => fail("usage: sparse_allreduce_check sum | errors".into()),
    }
}
