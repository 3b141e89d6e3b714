//! The synchronization engine on real MPI ranks, checked against the MPI
//! library's own `MPI_Allreduce`. Used by `tests/mpi.rs`; runnable by hand:
//!
//! ```text
//! mpirun -np 4 target/release/examples/engine_check codecs
//! mpirun -np 5 target/release/examples/engine_check exchange [allreduce|hierarchical|auto]
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
//! * `exchange`: an engine with `sparse_exchange = allreduce` (RGC,
//!   quantized RGC, threshold RGC, fp16, dense, empty and partly zero
//!   layers, momentum, overlapped) beside one with the fused allgatherv,
//!   fed the same gradients: every layer's result must be bitwise the
//!   allgather engine's and, for sparse layers, `MPI_Allreduce` of every
//!   rank's decoded unit divided by `p`; the step's `sparse_reduce_nnz`
//!   must be the size of the union of every rank's selected indices
//!   (counted by `MPI_Allreduce`). Step 3 puts a NaN into one layer on the
//!   last rank: both engines must fail alike on every rank, naming it.
//!   Prints `OK exchange step <t> <exchange> ...` per checked step (4) and
//!   `OK exchange nonfinite ...`. With `hierarchical` the node-aware
//!   sparse allreduce (checked against `MPI_Allreduce` only: it adds node
//!   by node); with `auto` the cost model's choice every step, from a
//!   latency-free profile and one more layer at density 0.5, under which
//!   the sparse allreduce pays off at 8 ranks (the step's `sparse_exchange` says which ran: the allgatherv
//!   must report no sparse-allreduce indices, the others the union).
//! * `powersgd`: a table of PowerSGD layers (`powersgd:rank=2,start=2`:
//!   two matrices it compresses, a bias and a small matrix it leaves
//!   dense), overlapped, six steps: every result bitwise the same on every
//!   rank (compared by `MPI_Allgather` of each rank's bits), the dense
//!   ones `MPI_Allreduce`'s average, the compressed ones PowerSGD's phases
//!   run by hand with `MPI_Allreduce` summing the factors (within float32
//!   rounding of the sums' order); a snapshot taken after step 3 and
//!   restored into a fresh engine continues bitwise; a NaN on the last
//!   rank fails every rank alike. Prints `OK powersgd ranks=<p>`.
//! * `mpi-dense`: dense layers (sizes 0 to 70 001) with momentum, plain and
//!   Nesterov, in an engine whose dense allreduce is MPI's own
//!   (`allreduce = mpi`, which sums and averages as it unpacks) beside one
//!   with Rabenseifner's (which averages in its last halving), fed the
//!   same integer-valued gradients (exact sums in any order): five steps
//!   whose every result must be bitwise the same in both, then a NaN on
//!   the last rank that both must fail alike, with the same outputs.
//!   Prints `OK mpi-dense nesterov=<b> ranks=<p>`.
//! * `mismatch`: the last rank registers a different shape; every rank must
//!   get the table-mismatch error. Prints `MISMATCH <error>`.
//! * `run`: steps `from..to` with momentum, Nesterov, weight decay, a density
//!   warm-up and stateful codecs; prints one hash of every rank's outputs per
//!   step, optionally saving or loading per-rank snapshots.
//!
//! `codecs --node-aware` and `run ... --node-aware` run the same checks with
//! the node-aware paths (`allreduce = hierarchical`,
//! `sparse_exchange = hierarchical`; MPI's node map), as `hpc/cluster_test.sh`
//! does on its emulated hosts; `--auto` with the cost model's per-step
//! choice of both (`allreduce = "auto"`, `sparse_exchange = "auto"`).

use gradsync::codec::CodecConfig;

use gradsync::dense::AllreduceAlgo;
use gradsync::strategy::Pick;
use gradsync::sync::{Config, GradSync, SparseExchange, Strategy, Warmup};
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

/// The engine's options of every check: the defaults, or with
/// `--node-aware` the node-aware dense allreduce, sparse exchange and
/// allgatherv of the fused message.
/// `--auto` the cost model's per-step choices of both (a latency-free
/// profile: the ring where Rabenseifner pays its fold, the reducing sparse
/// exchanges where they move fewer bytes).
fn base_cfg() -> Config {
    if std::env::args().any(|a| a == "--node-aware") {
        Config {
            allreduce: Pick::Fixed(AllreduceAlgo::Hierarchical),
            sparse_exchange: Pick::Fixed(SparseExchange::Hierarchical),
            allgather: Pick::Fixed(gradsync::dense::AllgathervAlgo::Node),
            ..Config::default()
        }
    } else if std::env::args().any(|a| a == "--auto") {
        Config {
            allreduce: Pick::Auto,
            sparse_exchange: Pick::Auto,
            profile: Some(
                gradsync::cost::Profile::from_network(1e-9, 1e9, 0.0, 0.0)
                    .unwrap_or_else(|e| fail(format!("{e}"))),
            ),
            ..Config::default()
        }
    } else {
        Config::default()
    }
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
        let mut s = GradSync::new(world, base_cfg()).unwrap_or_else(|e| fail(format!("{e}")));
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

/// `mpi-dense` (module docs).
fn mpi_dense<C: Communicator>(world: &C) {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let sizes = [0usize, 1, 5, 4099, 70_001];
    for nesterov in [false, true] {
        let engine = |algo: AllreduceAlgo| {
            let cfg = Config {
                allreduce: Pick::Fixed(algo),
                momentum: 0.9,
                nesterov,
                ..Config::default()
            };
            let mut s = GradSync::new(world, cfg).unwrap_or_else(|e| fail(format!("{e}")));
            for (i, &n) in sizes.iter().enumerate() {
                s.register_with(&format!("d{i}"), &[n], Strategy::Dense)
                    .unwrap_or_else(|e| fail(format!("{e}")));
            }
            s
        };
        let (mut m, mut r) = (
            engine(AllreduceAlgo::Mpi),
            engine(AllreduceAlgo::Rabenseifner),
        );
        for step in 0..6usize {
            let mut g: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    (0..n)
                        .map(|j| ((rank * 7 + step * 3 + i * 5 + j) % 11) as f32 - 5.0)
                        .collect()
                })
                .collect();
            let bad = step == 5;
            if bad && rank == p - 1 {
                g[3][17] = f32::NAN;
            }
            let mut gr = g.clone();
            let mut vm: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
            let rm = m.sync(&mut vm).map(|_| ()).map_err(|e| e.to_string());
            let mut vr: Vec<&mut [f32]> = gr.iter_mut().map(|v| &mut v[..]).collect();
            let rr = r.sync(&mut vr).map(|_| ()).map_err(|e| e.to_string());
            if rm != rr || bad != rm.is_err() {
                fail(format!(
                    "mpi-dense step {step}: mpi {rm:?}, rabenseifner {rr:?}"
                ));
            }
            if bad
                && !rm
                    .as_ref()
                    .err()
                    .is_some_and(|e| e.contains("d3") && e.contains(&format!("rank {}", p - 1)))
            {
                fail(format!(
                    "mpi-dense: the NaN step's error names neither: {rm:?}"
                ));
            }
            for (i, (a, b)) in g.iter().zip(&gr).enumerate() {
                let differ = a
                    .iter()
                    .zip(b)
                    .position(|(x, y)| x.to_bits() != y.to_bits());
                if let Some(j) = differ {
                    fail(format!(
                        "mpi-dense nesterov={nesterov} step {step} d{i}[{j}]: mpi {} vs rabenseifner {}",
                        a[j], b[j]
                    ));
                }
            }
        }
        if rank == 0 {
            println!("OK mpi-dense nesterov={nesterov} ranks={p}");
        }
    }
}

/// PowerSGD's phases over `world` by hand: `MPI_Allreduce` sums the
/// factors.
fn powersgd_reference<C: Communicator>(
    world: &C,
    st: &mut gradsync::powersgd::PowerSgd,
    g: &[f32],
) -> Vec<f32> {
    let (np, nq) = st.factor_lens();
    let (mut p, mut psum) = (vec![0f32; np], vec![0f32; np]);
    st.begin(g, &mut p).unwrap_or_else(|e| fail(format!("{e}")));
    world.all_reduce_into(&p[..], &mut psum[..], SystemOperation::sum());
    let (mut q, mut qsum) = (vec![0f32; nq], vec![0f32; nq]);
    st.after_p(&psum, &mut q)
        .unwrap_or_else(|e| fail(format!("{e}")));
    world.all_reduce_into(&q[..], &mut qsum[..], SystemOperation::sum());
    let mut out = vec![0f32; g.len()];
    st.after_q(&qsum, world.size() as usize, &mut out)
        .unwrap_or_else(|e| fail(format!("{e}")));
    out
}

fn powersgd<C: Communicator>(world: &C) {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let spec = "powersgd:rank=2,start=2,seed=5";
    let cfg = match Strategy::parse(spec).unwrap_or_else(|e| fail(format!("{e}"))) {
        Strategy::Powersgd(c) => c,
        s => fail(format!("{spec} parsed as {s:?}")),
    };
    let table: [(&str, &[usize]); 4] = [
        ("conv", &[16, 3, 3, 3]),
        ("bias", &[16]),
        ("fc", &[40, 30]),
        ("tiny", &[2, 2]),
    ];
    let engine = || {
        let mut s = GradSync::new(world, base_cfg()).unwrap_or_else(|e| fail(format!("{e}")));
        for (name, shape) in table {
            s.register_spec(name, shape, spec)
                .unwrap_or_else(|e| fail(format!("{name}: {e}")));
        }
        s
    };
    let grads = |step: u64| -> Vec<Vec<f32>> {
        table
            .iter()
            .enumerate()
            .map(|(l, (_, sh))| grad(rank, step, l, sh.iter().product()))
            .collect()
    };
    let sync = |s: &mut GradSync<gradsync::comm::MpiComm>, step: u64| -> Vec<Vec<f32>> {
        let mut g = grads(step);
        let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
        s.sync(&mut v)
            .unwrap_or_else(|e| fail(format!("powersgd step {step}: {e}")));
        g
    };
    let mut states: Vec<Option<gradsync::powersgd::PowerSgd>> = table
        .iter()
        .enumerate()
        .map(|(l, (_, sh))| {
            cfg.layer_state(sh, l)
                .unwrap_or_else(|e| fail(format!("{e}")))
        })
        .collect();
    let mut s = engine();
    let mut snap = Vec::new();
    let mut after = Vec::new();
    for step in 0..6u64 {
        let input = grads(step);
        let got = sync(&mut s, step);
        for (l, (name, _)) in table.iter().enumerate() {
            let want = match states[l].as_mut().filter(|_| step >= cfg.start) {
                Some(st) => powersgd_reference(world, st, &input[l]),
                None => {
                    let mut sum = vec![0f32; input[l].len()];
                    world.all_reduce_into(&input[l][..], &mut sum[..], SystemOperation::sum());
                    sum.iter().map(|x| x / p as f32).collect()
                }
            };
            let scale = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
            if let Some(j) = (0..want.len()).find(|&j| (got[l][j] - want[j]).abs() > 1e-5 * scale) {
                fail(format!(
                    "powersgd step {step} layer {name} [{j}]: engine {} vs by hand with MPI_Allreduce {}",
                    got[l][j], want[j]
                ));
            }
            // The same bits on every rank.
            let bits: Vec<u32> = got[l].iter().map(|x| x.to_bits()).collect();
            let mut all = vec![0u32; bits.len() * p];
            world.all_gather_into(&bits[..], &mut all[..]);
            if let Some(r) = (0..p).find(|&r| all[r * bits.len()..(r + 1) * bits.len()] != bits[..])
            {
                fail(format!(
                    "powersgd step {step} layer {name}: rank {r} has other bits than rank {rank}"
                ));
            }
        }
        if step == 3 {
            snap = s
                .snapshot_bytes()
                .unwrap_or_else(|e| fail(format!("snapshot: {e}")));
        } else if step > 3 {
            after.push(got);
        }
    }
    let mut r = engine();
    r.restore_bytes(&snap)
        .unwrap_or_else(|e| fail(format!("restore: {e}")));
    for (i, step) in (4..6u64).enumerate() {
        if sync(&mut r, step) != after[i] {
            fail(format!(
                "powersgd: the restored engine differs at step {step}"
            ));
        }
    }
    // A NaN on the last rank: every rank fails alike, naming it.
    let mut g = grads(6);
    if rank == p - 1 {
        g[2][7] = f32::NAN;
    }
    let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
    match r.sync(&mut v) {
        Ok(_) => fail("powersgd: a NaN step succeeded".into()),
        Err(e) => {
            let e = e.to_string();
            if !(e.contains("fc") && e.contains(&format!("rank {}", p - 1))) {
                fail(format!("powersgd: the NaN step's error names neither: {e}"));
            }
        }
    }
    if rank == 0 {
        println!("OK powersgd ranks={p}");
    }
}

fn exchange<C: Communicator>(world: &C, ex: Pick<SparseExchange>) {
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let sp = |c: &str| Strategy::Sparse {
        codec: c.parse().unwrap_or_else(|e| fail(format!("{c}: {e}"))),
        density: None,
    };
    // (name, elements, strategy, reduced by the sparse allreduce?)
    let mut table = vec![
        ("bias", 17usize, Strategy::Dense, false),
        ("rgc", 5000, sp("rgc:density=0.01"), true),
        ("quant", 3000, sp("rgc-quant:density=0.01"), true),
        ("thr", 4000, sp("rgc:density=0.01,method=threshold"), true),
        ("fp16", 700, sp("fp16"), false),
        ("zero-on-even-ranks", 500, sp("rgc:density=0.02"), true),
        ("empty", 0, sp("rgc:density=0.01"), true),
    ];
    // `auto` prices each step with a profile: no latency, 1 GB/s, so that
    // only the bytes decide; with a layer at density 0.5, whose sum is
    // nearly dense, the sparse allreduce wins at 8 ranks (and 4), the
    // allgatherv at 1, 2, 3 and 5.
    if ex == Pick::Auto {
        table.push(("wide", 4000, sp("rgc:density=0.5"), true));
    }
    let profile = (ex == Pick::Auto).then(|| {
        gradsync::cost::Profile::from_network(1e-12, 1e9, 0.0, 0.0)
            .unwrap_or_else(|e| fail(format!("{e}")))
    });
    let cfg = Config {
        momentum: 0.9,
        sparse_exchange: ex,
        profile,
        ..Config::default()
    };
    let gather_cfg = Config {
        sparse_exchange: Pick::Fixed(SparseExchange::Allgather),
        ..cfg.clone()
    };
    let mut s = GradSync::new(world, cfg).unwrap_or_else(|e| fail(format!("{e}")));
    let mut a = GradSync::new(world, gather_cfg).unwrap_or_else(|e| fail(format!("{e}")));
    let ids: Vec<_> = table
        .iter()
        .map(|(n, len, st, _)| {
            a.register_with(n, &[*len], st.clone())
                .unwrap_or_else(|e| fail(format!("{e}")));
            s.register_with(n, &[*len], st.clone())
                .unwrap_or_else(|e| fail(format!("{e}")))
        })
        .collect();
    for step in 0..5u64 {
        let mut g: Vec<Vec<f32>> = table
            .iter()
            .enumerate()
            .map(|(i, &(n, len, _, _))| {
                if n == "zero-on-even-ranks" && rank % 2 == 0 {
                    vec![0.0; len]
                } else {
                    grad(rank, step, i, len)
                }
            })
            .collect();
        let bad_step = step == 3;
        if bad_step && rank == p - 1 {
            g[1][7] = f32::NAN;
        }
        let mut ga = g.clone();
        {
            let view: Vec<&[f32]> = g.iter().map(|v| &v[..]).collect();
            s.start(&view)
                .unwrap_or_else(|e| fail(format!("step {step}: {e}")));
        }
        let mut out: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
        let r = s.wait(&mut out).cloned();
        let mut outa: Vec<&mut [f32]> = ga.iter_mut().map(|v| &mut v[..]).collect();
        let ra = a.sync(&mut outa).map(|_| ());
        if bad_step {
            let (e, ea) = match (r, ra) {
                (Err(e), Err(ea)) => (e.to_string(), ea.to_string()),
                (r, ra) => fail(format!(
                    "step {step}: a NaN did not fail both engines: {:?} / {ra:?}",
                    r.map(|_| ())
                )),
            };
            if e != ea || !e.contains("\"rgc\"") || !e.contains(&format!("rank {}", p - 1)) {
                fail(format!("step {step}: {e} / allgather: {ea}"));
            }
            if rank == 0 {
                println!("OK exchange nonfinite ranks={p}");
            }
            continue;
        }
        let stats = r.unwrap_or_else(|e| fail(format!("step {step}: {e}")));
        ra.unwrap_or_else(|e| fail(format!("step {step} (allgather): {e}")));
        if p > 1 && !stats.overlapped {
            fail("the progress thread did not run".into());
        }
        let mut want_nnz = 0usize;
        for (i, &(lname, len, _, reduced)) in table.iter().enumerate() {
            // The sparse allreduce adds in rank order, as the allgather's
            // unpacking does: bitwise the same. The node-aware one adds
            // node by node (checked against MPI_Allreduce below only).
            if stats.sparse_exchange != "hierarchical"
                && g[i]
                    .iter()
                    .zip(&ga[i])
                    .any(|(x, y)| x.to_bits() != y.to_bits())
            {
                fail(format!(
                    "step {step} layer {lname}: differs from the allgather engine"
                ));
            }
            if lname == "bias" {
                continue;
            }
            let mut mine = vec![0f32; len];
            s.decode_unit(ids[i], s.last_unit(ids[i]), &mut mine)
                .unwrap_or_else(|e| fail(format!("step {step} {lname}: {e}")));
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
                        "step {step} layer {lname} [{j}]: engine {} vs MPI_Allreduce {want}",
                        g[i][j]
                    ));
                }
            }
            if reduced {
                // Distinct selected indices of every rank: the union.
                let mut sel = vec![0i32; len];
                let l = s.layer(ids[i]).map(|l| l.2.clone());
                let Some(Strategy::Sparse { codec, .. }) = l else {
                    fail(format!("{lname} is not sparse"))
                };
                let c = codec.build().unwrap_or_else(|e| fail(format!("{e}")));
                c.for_each_sent(s.last_unit(ids[i]), len, &mut |j, _| sel[j] = 1)
                    .unwrap_or_else(|e| fail(format!("step {step} {lname}: {e}")));
                let mut any = vec![0i32; len];
                world.all_reduce_into(&sel[..], &mut any[..], SystemOperation::max());
                want_nnz += any.iter().filter(|&&x| x != 0).count();
            }
        }
        if stats.sparse_exchange == "allgather" {
            if ex != Pick::Auto || stats.sparse_reduce_nnz != 0 {
                fail(format!(
                    "step {step}: exchange allgather under {} with {} sparse-allreduce indices",
                    ex, stats.sparse_reduce_nnz
                ));
            }
        } else if stats.sparse_reduce_nnz != want_nnz || want_nnz == 0 {
            fail(format!(
                "step {step}: sparse_reduce_nnz {} but every rank selected {want_nnz} distinct indices",
                stats.sparse_reduce_nnz
            ));
        }
        // `auto` measures the fill after every clean step, whichever
        // exchange ran it (the allgatherv's unpacking counts it), and every
        // rank holds the same estimate: the next choice depends on it.
        if ex == Pick::Auto {
            let f = stats.fill_estimate.unwrap_or_else(|| {
                fail(format!(
                    "step {step}: no fill estimate after a clean {} step",
                    stats.sparse_exchange
                ))
            });
            let (mut lo, mut hi) = (0f64, 0f64);
            world.all_reduce_into(&f, &mut lo, SystemOperation::min());
            world.all_reduce_into(&f, &mut hi, SystemOperation::max());
            if lo.to_bits() != hi.to_bits() || !(1.0 / p as f64..=1.0).contains(&f) {
                fail(format!(
                    "step {step}: fill estimate {f} (ranks from {lo} to {hi}, p = {p})"
                ));
            }
        }
        if rank == 0 {
            println!(
                "OK exchange step {step} {} nnz={} fill={} s={:.1e} ranks={p}",
                stats.sparse_exchange,
                stats.sparse_reduce_nnz,
                stats
                    .fill_estimate
                    .map_or_else(|| "-".to_string(), |f| format!("{f:.3}")),
                stats.sparse_reduce_s
            );
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
        ..base_cfg()
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
        Some("exchange") => exchange(
            &world,
            match args.get(1).map(String::as_str) {
                None | Some("allreduce") => Pick::Fixed(SparseExchange::Allreduce),
                Some("hierarchical") => Pick::Fixed(SparseExchange::Hierarchical),
                Some("auto") => Pick::Auto,
                Some(x) => fail(format!(
                    "exchange {x:?}: allreduce, hierarchical or auto"
                )),
            },
        ),
        Some("mismatch") => mismatch(&world),
        Some("mpi-dense") => mpi_dense(&world),
        Some("powersgd") => powersgd(&world),
        Some("run") => run(
            &world,
            num("--from"),
            num("--to"),
            opt("--save"),
            opt("--load"),
        ),
        _ => fail(
            "usage: engine_check codecs | exchange | powersgd | mpi-dense | mismatch | run --from A --to B [--save DIR] [--load DIR]"
                .into(),
        ),
    }
}
