//! The scatter-add of sorted sparse pairs into a dense output, alone, at
//! the sizes of docs/benchmarks/cluster.md's node-aware sparse path (density 1 %
//! of outputs from 4 MiB to 128 MiB): seconds per call and per unit byte
//! (8 bytes a pair), best of 7 calls on a warm output.
//!
//! ```sh
//! cargo build --release --example scatter_add
//! target/release/examples/scatter_add
//! # several processes at once (ranks sharing cores):
//! for i in 1 2 3 4; do target/release/examples/scatter_add > /tmp/sa$i.txt & done; wait
//! ```
use std::time::Instant;

fn main() {
    // xorshift, seeded by the process id (each process its own indices).
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id());
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for &n in &[1usize << 20, 1 << 22, 1 << 24, 25_557_032, 1 << 25] {
        let k = n / 100;
        let mut idx: Vec<u32> = (0..k).map(|_| (rnd() % n as u64) as u32).collect();
        idx.sort_unstable();
        let vals: Vec<f32> = (0..k).map(|i| i as f32).collect();
        let mut out = vec![0f32; n];
        let mut best = f64::MAX;
        for _ in 0..7 {
            let t = Instant::now();
            for (&i, &v) in idx.iter().zip(&vals) {
                out[i as usize] += v;
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "n {n:>9} output {:>4} MiB: {:.3} ms, {:.3} ns per unit byte",
            (4 * n) >> 20,
            best * 1e3,
            best * 1e9 / (8 * k) as f64
        );
        std::hint::black_box(&out);
    }
}
