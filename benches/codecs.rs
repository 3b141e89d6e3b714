//! Encode and decode throughput of every codec on a 16M-element f32 tensor
//! (Laplace-distributed, gradient-like), single-threaded and split into
//! per-thread chunks with rayon, next to `memcpy` of the same 64 MiB.
//!
//! `cargo bench --bench codecs` (set `GRADSYNC_BENCH_N` for another size).
//! Throughput is reported in bytes of f32 input per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gradsync::cli::synthetic;
use gradsync::codec::CodecConfig;
use rayon::prelude::*;
use std::time::Duration;

fn n() -> usize {
    std::env::var("GRADSYNC_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 24)
}

fn bench(c: &mut Criterion) {
    let n = n();
    let x = synthetic(n, "laplace", 7).expect("synthetic");
    let threads = rayon::current_num_threads();
    let chunk = n.div_ceil(threads);
    let mut g = c.benchmark_group("codecs");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g.throughput(Throughput::Bytes(4 * n as u64));

    let mut dst = vec![0f32; n];
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(&x)));

    for cfg in CodecConfig::all_defaults() {
        let name = format!("{}:{}", cfg.name(), cfg.params());
        let mut codec = cfg.build().expect("codec");
        let mut msg = Vec::new();
        g.bench_with_input(BenchmarkId::new("encode", &name), &x, |b, x| {
            b.iter(|| codec.encode(x, &mut msg).expect("encode"))
        });
        // The message to decode, also when a filter skips the encode bench.
        codec.encode(&x, &mut msg).expect("encode");
        let mut out = vec![0f32; n];
        g.bench_with_input(BenchmarkId::new("decode", &name), &msg, |b, m| {
            b.iter(|| codec.decode(m, &mut out).expect("decode"))
        });
        // rayon: one codec instance and message per chunk.
        let mut codecs: Vec<_> = (0..threads).map(|_| cfg.build().expect("codec")).collect();
        let mut msgs: Vec<Vec<u8>> = vec![Vec::new(); threads];
        for ((c, m), part) in codecs.iter_mut().zip(&mut msgs).zip(x.chunks(chunk)) {
            c.encode(part, m).expect("encode");
        }
        g.bench_with_input(BenchmarkId::new("encode-rayon", &name), &x, |b, x| {
            b.iter(|| {
                codecs
                    .par_iter_mut()
                    .zip(msgs.par_iter_mut())
                    .zip(x.par_chunks(chunk))
                    .for_each(|((c, m), part)| c.encode(part, m).expect("encode"))
            })
        });
        g.bench_function(BenchmarkId::new("decode-rayon", &name), |b| {
            b.iter(|| {
                codecs
                    .par_iter()
                    .zip(msgs.par_iter())
                    .zip(out.par_chunks_mut(chunk))
                    .for_each(|((c, m), part)| c.decode(m, part).expect("decode"))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
