//! What a table of many layers costs the engine, per layer: registration
//! (one small collective each), completing the table, and one step's
//! fixed cost (every layer 4 dense elements, so the bytes are nothing and
//! the per-layer work is all there is). Run under mpirun; rank 0 prints
//! one JSON line per table size:
//!
//! ```text
//! hpc/mpirun.sh -np 2 target/release/examples/layer_scaling 100 10000 100000
//! ```
//!
//! `{"layers": N, "ranks": p, "register_us_per_layer": ..,
//! "complete_us_per_layer": .., "step_us_per_layer": .., "rss_mb": ..}`
//! (the step: the median of 5 after one warm-up step; `rss_mb`: this
//! rank's peak resident memory, from `/proc/self/status`).

use gradsync::sync::{Config, GradSync};
use mpi::traits::*;
use std::time::Instant;

fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn main() {
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Serialized).expect("MPI initialized twice");
    let world = universe.world();
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a table size (layers)"))
        .collect();
    for n in if sizes.is_empty() {
        vec![100, 10_000]
    } else {
        sizes
    } {
        let cfg = Config {
            overlap: false,
            ..Config::default()
        };
        let mut s = GradSync::new(&world, cfg).expect("engine");
        world.barrier();
        let t = Instant::now();
        for i in 0..n {
            s.register(&format!("layer{i}.weight"), &[4])
                .expect("register");
        }
        world.barrier();
        let register = t.elapsed().as_secs_f64();
        let t = Instant::now();
        s.complete_table().expect("complete_table");
        let complete = t.elapsed().as_secs_f64();
        let mut g: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32; 4]).collect();
        let mut times = Vec::new();
        for _ in 0..6 {
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            world.barrier();
            let t = Instant::now();
            s.sync(&mut v).expect("step");
            times.push(t.elapsed().as_secs_f64());
        }
        times.remove(0);
        times.sort_by(f64::total_cmp);
        let step = times[times.len() / 2];
        if world.rank() == 0 {
            let per = |x: f64| x * 1e6 / n as f64;
            println!(
                "{{\"layers\": {n}, \"ranks\": {}, \"register_us_per_layer\": {:.2}, \
                 \"complete_us_per_layer\": {:.3}, \"step_us_per_layer\": {:.3}, \"rss_mb\": {:.0}}}",
                world.size(),
                per(register),
                per(complete),
                per(step),
                peak_rss_mb()
            );
        }
    }
}
