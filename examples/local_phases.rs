//! The engine's local phases on one rank, each in its own unmangled
//! function, for counting instructions under callgrind
//! (`tests/instructions.rs`, `hpc/instructions.sh`):
//!
//! * `gs_phase_select`: RGC's trimmed top-k selection and encoding of a
//!   2^20-element residual at density 0.001 (RedSync §5.2);
//! * `gs_phase_pack`: 256 codec units laid out as one fused message;
//! * `gs_phase_unpack`: four ranks' units of a 2^20-element layer
//!   scatter-added into the result, in rank order;
//! * `gs_phase_dense_step`: one engine step of a dense table (8 layers of
//!   2^17 elements, momentum 0.9) on one rank: the fused buffer filled,
//!   averaged and unfused, momentum applied;
//! * `gs_phase_sparse_step`: one engine step of an RGC table (4 layers of
//!   2^18 elements at density 0.001, momentum correction) on one rank:
//!   residuals, selection, packing, unpacking.
//!
//! Inputs come from a fixed seed and each phase runs once after a warm-up
//! call, so the count depends only on the code and the compiler. The
//! engine runs its layers one after another on the calling thread
//! (`parallel_min_elems`), the thread whose instructions callgrind counts;
//! `RAYON_NUM_THREADS=1` keeps any other parallel loop on one worker.
//! Argument: the phases to run (default: all).
//!
//! ```text
//! RAYON_NUM_THREADS=1 valgrind --tool=callgrind --toggle-collect=gs_phase_select \
//!     target/release/examples/local_phases select
//! ```

use gradsync::codec::{Codec, CodecConfig, RgcMethod};
use gradsync::comm::{Gathered, LocalComm};
use gradsync::sparse::{parse_fused, unpack_layer, write_fused, EntryKind};
use gradsync::sync::{Config, GradSync, Strategy};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::hint::black_box;

const N: usize = 1 << 20;
const DENSITY: f64 = 0.001;

fn gradient(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn rgc() -> Box<dyn Codec> {
    CodecConfig::Rgc {
        density: DENSITY,
        method: RgcMethod::Trimmed,
    }
    .build()
    .expect("rgc builds")
}

#[no_mangle]
#[inline(never)]
pub fn gs_phase_select(codec: &mut dyn Codec, x: &[f32], out: &mut Vec<u8>) {
    codec.encode(x, out).expect("encodes");
}

#[no_mangle]
#[inline(never)]
pub fn gs_phase_pack(buf: &mut Vec<u8>, units: &[Vec<u8>]) {
    write_fused(
        buf,
        7,
        units
            .iter()
            .enumerate()
            .map(|(i, u)| (i as u32, EntryKind::Unit, &u[..])),
    );
}

#[no_mangle]
#[inline(never)]
pub fn gs_phase_unpack(g: &Gathered, codec: &dyn Codec, acc: &mut [f32]) {
    let mut entries = Vec::new();
    for r in 0..g.len() {
        let mut e = Vec::new();
        parse_fused(g.message(r), r, 7, &[0], &|i| i.to_string(), &mut e).expect("parses");
        entries.push(e[0]);
    }
    unpack_layer(g, &entries, codec, "layer", 0.25, acc).expect("unpacks");
}

#[no_mangle]
#[inline(never)]
pub fn gs_phase_dense_step(s: &mut GradSync<LocalComm>, grads: &mut [&mut [f32]]) {
    s.sync(grads).expect("dense step");
}

#[no_mangle]
#[inline(never)]
pub fn gs_phase_sparse_step(s: &mut GradSync<LocalComm>, grads: &mut [&mut [f32]]) {
    s.sync(grads).expect("sparse step");
}

fn select() {
    let x = gradient(1, N);
    let mut codec = rgc();
    let mut out = Vec::new();
    codec.encode(&x, &mut out).expect("warm-up");
    gs_phase_select(&mut *codec, &x, &mut out);
    black_box(&out);
}

fn units(n_units: usize, n: usize) -> Vec<Vec<u8>> {
    let mut codec = rgc();
    (0..n_units)
        .map(|i| {
            let mut u = Vec::new();
            codec
                .encode(&gradient(10 + i as u64, n), &mut u)
                .expect("encodes");
            u
        })
        .collect()
}

fn pack() {
    let units = units(256, 1 << 14);
    let mut buf = Vec::new();
    gs_phase_pack(&mut buf, &units);
    gs_phase_pack(&mut buf, &units);
    black_box(&buf);
}

fn unpack() {
    let codec = rgc();
    let mut g = Gathered::default();
    g.displs.push(0);
    for r in 0..4u64 {
        let mut unit = Vec::new();
        rgc()
            .encode(&gradient(100 + r, N), &mut unit)
            .expect("encodes");
        let mut msg = Vec::new();
        write_fused(&mut msg, 7, [(0u32, EntryKind::Unit, &unit[..])]);
        g.data.extend_from_slice(&msg);
        g.displs.push(g.data.len());
    }
    let mut acc = vec![0.0f32; N];
    gs_phase_unpack(&g, &*codec, &mut acc);
    acc.fill(0.0);
    gs_phase_unpack(&g, &*codec, &mut acc);
    black_box(&acc);
}

fn engine_step(layers: usize, n: usize, strategy: Strategy, sparse: bool) {
    LocalComm::run(1, move |comm| {
        let cfg = Config {
            momentum: 0.9,
            overlap: false,
            // Layers one after another on this thread (callgrind counts
            // the thread that calls the phase).
            parallel_min_elems: usize::MAX,
            ..Config::default()
        };
        let mut s = GradSync::with_transport(comm, cfg).expect("engine");
        for i in 0..layers {
            s.register_with(&format!("l{i}"), &[n], strategy.clone())
                .expect("registers");
        }
        let mut g: Vec<Vec<f32>> = (0..layers).map(|i| gradient(200 + i as u64, n)).collect();
        let mut views: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
        s.sync(&mut views).expect("warm-up step");
        let mut g: Vec<Vec<f32>> = (0..layers).map(|i| gradient(300 + i as u64, n)).collect();
        let mut views: Vec<&mut [f32]> = g.iter_mut().map(|v| &mut v[..]).collect();
        if sparse {
            gs_phase_sparse_step(&mut s, &mut views);
        } else {
            gs_phase_dense_step(&mut s, &mut views);
        }
        black_box(&g);
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all = ["select", "pack", "unpack", "dense_step", "sparse_step"];
    let run: Vec<&str> = if args.is_empty() {
        all.to_vec()
    } else {
        args.iter().map(String::as_str).collect()
    };
    for phase in run {
        match phase {
            "select" => select(),
            "pack" => pack(),
            "unpack" => unpack(),
            "dense_step" => engine_step(8, 1 << 17, Strategy::Dense, false),
            "sparse_step" => engine_step(4, 1 << 18, Strategy::rgc(DENSITY), true),
            other => {
                eprintln!("local_phases: unknown phase {other:?} (one of {all:?})");
                std::process::exit(2);
            }
        }
    }
}
