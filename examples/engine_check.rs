//! The synchronization engine on real MPI ranks, checked against the MPI
//! library's own `MPI_Allreduce`. Used by `tests/mpi.rs`; runnable by hand:
//!
//! ```text
//! mpirun -np 4 target/release/examples/engine_check codecs
//! mpirun -np 3 target/release/examples/engine_check mismatch
//! mpirun -np 3 target/release/examples/engine_check run --from 0 --to 6
//! mpirun -np 3 target/release/examples/engine_check run --from 0 --to 3 --save /tmp/snap
//! mpirun -np 3 target/release/examples/engine_check run --from 3 --to 6 --load /tmp/snap
//! ```
//!
//! * `codecs`: for every codec, a mixed table (dense layers, sparse layers,
//!   an empty layer, ranks whose gradient is all zero) runs three overlapped
//!   steps; every sparse layer's result must equal `MPI_Allreduce` of every
//!   rank's decoded unit divided by `p`, every dense layer's the
//!   `MPI_Allreduce` average. Prints `OK <codec>` per codec.
//! * `mismatch`: the last rank registers a different shape; every rank must
//!   get the table-mismatch error. Prints `MISMATCH <error>`.
//! * `run`: steps `from..to` with momentum, Nesterov, weight decay, a density
//!   warm-up and stateful codecs; prints one hash of every rank's outputs per
//!   step, optionally saving or loading per-rank snapshots.

use gradsync::codec::CodecConfig;
use gradsync::sync::{Config, GradSync, Strategy, Warmup};
use mpi::collective::SystemOperation;
use mpi::traits::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn grad(rank: usize, step: u64, layer: usize, n: usize) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64((rank as u64) << 40 ^ step << 20 ^ layer as u64);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn fail(msg: String) -> ! {
    eprintln!("engine_check: {msg}");
    std::process::exit(1)
}

fn codecs<C: Communicator>(world: &C) {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let list = [
        "rgc:density=0.01",
        "rgc:density=0.01,method=threshold",
        "rgc:density=0.01,method=sampled",
        "rgc-quant:density=0.01",
        "sbc:p=0.01",
        "3lc",
        "fastsgd",
        "qsgd",
        "int8",
    ];
    // (name, elements, sparse?)
    let table = [
        ("conv1", 3000usize, true),
        ("bias1", 17, false),
        ("fc", 20_000, true),
        ("empty", 0, true),
        ("zero-on-even-ranks", 500, true),
        ("bias2", 1000, false),
    ];
    for name in list {
        let codec: CodecConfig = name.parse().unwrap_or_else(|e| fail(format!("{e}")));
        let mut s =
            GradSync::new(world, Config::default()).unwrap_or_else(|e| fail(format!("{e}")));
        let ids: Vec<_> = table
            .iter()
            .map(|&(n, len, sparse)| {
                let st = if sparse {
                    Strategy::Sparse {
                        codec: codec.clone(),
                        density: None,
                    }
                } else {
                    Strategy::Dense
                };
                s.register_with(n, &[len], st)
                    .unwrap_or_else(|e| fail(format!("{e}")))
            })
            .collect();
        for step in 0..3u64 {
            let mut g: Vec<Vec<f32>> = table
                .iter()
                .enumerate()
                .map(|(i, &(n, len, _))| {
                    if n == "zero-on-even-ranks" && rank % 2 == 0 {
                        vec![0.0; len]
                    } else {
                        grad(rank, step, i, len)
                    }
                })
                .collect();
            let input = g.clone();
            {
                let view: Vec<&[f32]> = g.iter().map(|v| &v[..]).collect();
                s.start(&view)
                    .unwrap_or_else(|e| fail(format!("{name}: {e}")));
            }
            let mut out: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
            let stats = s
                .wait(&mut out)
                .unwrap_or_else(|e| fail(format!("{name}: {e}")))
                .clone();
            if p > 1 && !stats.overlapped {
                fail("the progress thread did not run".into());
            }
            for (i, &(lname, len, sparse)) in table.iter().enumerate() {
                let mine = if sparse {
                    let mut d = vec![0f32; len];
                    s.decode_unit(ids[i], s.last_unit(ids[i]), &mut d)
                        .unwrap_or_else(|e| fail(format!("{name} {lname}: {e}")));
                    d
                } else {
                    input[i].clone()
                };
                let mut sum = vec![0f32; len];
                let mut abs = vec![0f32; len];
                let mine_abs: Vec<f32> = mine.iter().map(|x| x.abs()).collect();
                world.all_reduce_into(&mine[..], &mut sum[..], SystemOperation::sum());
                world.all_reduce_into(&mine_abs[..], &mut abs[..], SystemOperation::sum());
                for j in 0..len {
                    let want = sum[j] / p as f32;
                    let tol = 4.0 * p as f32 * f32::EPSILON * abs[j] / p as f32 + 1e-30;
                    if (g[i][j] - want).abs() > tol {
                        fail(format!(
                            "{name} step {step} layer {lname} [{j}]: engine {} vs MPI_Allreduce {want}",
                            g[i][j]
                        ));
                    }
                }
            }
        }
        if rank == 0 {
            println!("OK {name} ranks={p}");
        }
    }
}

fn mismatch<C: Communicator>(world: &C) {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let mut s = GradSync::new(world, Config::default()).unwrap_or_else(|e| fail(format!("{e}")));
    s.register("a", &[100])
        .unwrap_or_else(|e| fail(format!("{e}")));
    let shape = if rank == p - 1 { [100, 3] } else { [100, 2] };
    match s.register("b", &shape) {
        Ok(_) if p == 1 => println!("MISMATCH none on one rank"),
        Ok(_) => fail("mismatch not detected".into()),
        Err(e) => println!("MISMATCH rank {rank}: {e}"),
    }
}

fn run_cfg() -> Config {
    Config {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-4,
        warmup: Warmup::Density {
            schedule: vec![0.25, 0.05],
            steps_per_stage: 1,
        },
        ..Config::default()
    }
}

fn run<C: Communicator>(world: &C, from: u64, to: u64, save: Option<&str>, load: Option<&str>) {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let mut s = GradSync::new(world, run_cfg()).unwrap_or_else(|e| fail(format!("{e}")));
    let table: [(&str, usize, Strategy); 4] = [
        ("bias", 64, Strategy::Dense),
        (
            "thr",
            5000,
            Strategy::Sparse {
                codec: "rgc:method=threshold".parse().expect("codec"),
                density: Some(0.01),
            },
        ),
        (
            "quant",
            3000,
            Strategy::Sparse {
                codec: "rgc-quant".parse().expect("codec"),
                density: Some(0.01),
            },
        ),
        (
            "qsgd",
            700,
            Strategy::Sparse {
                codec: "qsgd".parse().expect("codec"),
                density: None,
            },
        ),
    ];
    for (n, len, st) in &table {
        s.register_with(n, &[*len], st.clone())
            .unwrap_or_else(|e| fail(format!("{e}")));
    }
    let path = |dir: &str| format!("{dir}/gradsync.rank{rank}.snap");
    if let Some(dir) = load {
        s.load_snapshot(path(dir))
            .unwrap_or_else(|e| fail(format!("load: {e}")));
    }
    let w: Vec<Vec<f32>> = table.iter().map(|t| vec![0.25; t.1]).collect();
    let wv: Vec<&[f32]> = w.iter().map(|x| &x[..]).collect();
    for step in from..to {
        let mut g: Vec<Vec<f32>> = table
            .iter()
            .enumerate()
            .map(|(i, t)| grad(rank, step, i, t.1))
            .collect();
        let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
        s.sync_with_weights(&mut v, &wv)
            .unwrap_or_else(|e| fail(format!("step {step}: {e}")));
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for x in g.iter().flatten() {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        let mut all = vec![0u64; p];
        world.all_gather_into(&h, &mut all[..]);
        if rank == 0 {
            let hs: Vec<String> = all.iter().map(|h| format!("{h:016x}")).collect();
            println!("STEP {step} {}", hs.join(","));
        }
    }
    if let Some(dir) = save {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| fail(format!("{e}")));
        s.save_snapshot(path(dir))
            .unwrap_or_else(|e| fail(format!("save: {e}")));
    }
}

fn main() {
    let (universe, _level) = mpi::initialize_with_threading(mpi::Threading::Serialized)
        .unwrap_or_else(|| fail("MPI initialized twice".into()));
    let world = universe.world();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    let num = |k: &str| {
        opt(k)
            .map(|v| {
                v.parse::<u64>()
                    .unwrap_or_else(|e| fail(format!("{k}: {e}")))
            })
            .unwrap_or(0)
    };
    match args.first().map(String::as_str) {
        Some("codecs") => codecs(&world),
        Some("mismatch") => mismatch(&world),
        Some("run") => run(
            &world,
            num("--from"),
            num("--to"),
            opt("--save"),
            opt("--load"),
        ),
        _ => fail(
            "usage: engine_check codecs | mismatch | run --from A --to B [--save DIR] [--load DIR]"
                .into(),
        ),
    }
}
