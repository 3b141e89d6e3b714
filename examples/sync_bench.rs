//! `GradSync::sync` timed from Rust, the reference for the Python binding's
//! overhead (`benches/python/sync_bench.py` runs the same table and
//! protocol; `hpc/python_overhead.sh` runs both and compares).
//!
//! ```text
//! mpirun -np 2 target/release/examples/sync_bench 1K,16K,256K,4M,64M 50
//! ```
//!
//! For each size: an engine with one layer of that many elements
//! (strategy `auto`: dense below 32768 elements, RGC at 0.1 % above),
//! 5 warm-up steps, then `reps` timed `sync` calls (barrier before each;
//! the gradient copied from a window of one pattern before it);
//! rank 0 prints one JSON line `{"lang": "rust", "elements", "median_s",
//! "min_s", "reps"}`.

use gradsync::sync::{Config, GradSync};
use mpi::traits::*;
use std::time::Instant;

fn main() {
    let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Serialized).unwrap();
    let world = universe.world();
    let args: Vec<String> = std::env::args().collect();
    let sizes = args.get(1).map_or("1K,64K,1M", |s| s.as_str());
    let reps: usize = args.get(2).map_or(30, |s| s.parse().expect("reps"));
    for s in sizes.split(',') {
        let n = gradsync::cli::parse_size(s).expect("size");
        let mut sync = GradSync::new(
            &world,
            Config {
                momentum: 0.9,
                ..Config::default()
            },
        )
        .unwrap();
        sync.register_spec("layer", &[n], "auto").unwrap();
        let mut g = vec![0f32; n];
        // Each step's gradient is a copy of a window of one pattern (the
        // Python side does the same copy, so both start with the same
        // memory traffic and cache state).
        let src: Vec<f32> = (0..n + 13).map(|j| ((j * 7) % 13) as f32 - 6.0).collect();
        let mut times = Vec::with_capacity(reps);
        for it in 0..reps + 5 {
            let s = it % 13;
            g.copy_from_slice(&src[s..s + n]);
            world.barrier();
            let t = Instant::now();
            sync.sync(&mut [&mut g[..]]).unwrap();
            if it >= 5 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        if world.rank() == 0 {
            println!(
                "{{\"lang\": \"rust\", \"elements\": {n}, \"median_s\": {:e}, \"min_s\": {:e}, \"reps\": {reps}}}",
                times[reps / 2], times[0]
            );
        }
    }
}
