//! The engine's failure model on real MPI ranks (`tests/failure.rs`):
//! one rank fails inside a step and every rank must get the same error in
//! that step, then go on. Runnable by hand:
//!
//! ```text
//! mpirun -np 3 target/release/examples/failure_check bad-len 1
//! mpirun -np 4 target/release/examples/failure_check nan-gradiveq 0
//! mpirun -np 2 target/release/examples/failure_check extra-layer 1
//! ```
//!
//! Scenarios (the last argument is the failing rank):
//! * `bad-len`, `bad-len-dense`, `bad-len-sparse`, `bad-len-gradiveq`: in
//!   step 2 that rank passes a gradient of the wrong length, with a mixed
//!   table, dense layers only (the failure rides in the dense status word),
//!   sparse layers only (in the fused message) or a GradiVeQ layer only (a
//!   one-word status allreduce).
//! * `nan-gradiveq`: NaN in that rank's GradiVeQ gradient in step 2 (the
//!   QSGD-ring sample phase).
//! * `huge-qsgd`: gradients near `f32::MAX` in a QSGD layer on that rank
//!   in step 2 (an encoder overflow on one rank).
//! * `extra-layer`: that rank registers one more layer than the others.
//!
//! Each rank prints `STEP <s> OK <hash>` or `STEP <s> ERR <error>` for steps
//! 0..5 (overlapped with a progress thread), or `SETUP ERR <error>`. Exits 0
//! when it could print its lines (the test compares them across ranks).

use gradsync::codec::CodecConfig;
use gradsync::gradiveq::{schedule::ScheduleConfig, Dim};
use gradsync::sync::{Config, GradSync, Strategy};
use mpi::traits::*;

fn gvq() -> Strategy {
    Strategy::Gradiveq(ScheduleConfig {
        k: 32,
        dim: Dim::Fixed(4),
        reuse: None,
        warmup: 1,
        lt: 2,
        lc: 1000,
        loss_threshold: 0.5,
        qsgd_bits: 8,
        qsgd_bucket: 0,
    })
}

fn table(scenario: &str) -> Vec<(&'static str, usize, Strategy)> {
    let rgc = Strategy::rgc(0.01);
    let qsgd = Strategy::Sparse {
        codec: "qsgd:bits=4".parse::<CodecConfig>().expect("codec"),
        density: None,
    };
    match scenario {
        "bad-len-dense" => vec![("a", 300, Strategy::Dense), ("b", 77, Strategy::Dense)],
        "bad-len-sparse" => vec![("a", 3000, rgc.clone()), ("b", 5000, rgc)],
        "bad-len-gradiveq" | "nan-gradiveq" => vec![("conv", 256, gvq())],
        "huge-qsgd" => vec![("q", 4096, qsgd), ("d", 64, Strategy::Dense)],
        _ => vec![
            ("dense", 300, Strategy::Dense),
            ("sparse", 4000, rgc),
            ("conv", 256, gvq()),
        ],
    }
}

fn grad(rank: usize, step: u64, layer: usize, n: usize) -> Vec<f32> {
    // Integer-valued, so sums are exact and every rank hashes alike.
    (0..n)
        .map(|i| ((i * 7 + layer * 13 + rank * 3 + step as usize * 5) % 17) as f32 - 8.0)
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).map_or("bad-len", String::as_str).to_string();
    let bad: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Serialized).expect("MPI initializes");
    let world = universe.world();
    let rank = world.rank() as usize;
    let cfg = Config {
        overlap: true,
        ..Config::default()
    };
    let setup = (|| -> gradsync::Result<GradSync> {
        let mut s = GradSync::new(&world, cfg)?;
        let mut t = table(&scenario);
        if scenario == "extra-layer" && rank == bad {
            t.push(("extra", 10, Strategy::Dense));
        }
        for (name, n, st) in t {
            s.register_with(name, &[n], st)?;
        }
        Ok(s)
    })();
    let mut s = match setup {
        Ok(s) => s,
        Err(e) => {
            println!("SETUP ERR {e}");
            return;
        }
    };
    let sizes: Vec<usize> = table(&scenario).iter().map(|t| t.1).collect();
    for step in 0..5u64 {
        let mut g: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(l, &n)| grad(rank, step, l, n))
            .collect();
        if step == 2 && rank == bad {
            match scenario.as_str() {
                "nan-gradiveq" => g[0][5] = f32::NAN,
                "huge-qsgd" => g[0].iter_mut().for_each(|x| *x = 3.0e38),
                "extra-layer" => {}
                _ => {
                    let last = g.len() - 1;
                    g[last].push(1.0);
                }
            }
        }
        let mut views: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
        match s.sync(&mut views) {
            Ok(_) => {
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for v in &g {
                    for x in v {
                        h = (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3);
                    }
                }
                println!("STEP {step} OK {h:016x}");
            }
            Err(e) => println!("STEP {step} ERR {e}"),
        }
    }
}
