//! RedSync Fig. 3 redone on this CPU: time to pick the top 0.1 % by magnitude
//! of `n = 2^10 .. 2^24` gradient-like values with a full sort, with
//! `select_nth_unstable`, with gradsync's exact top-k, trimmed top-k (Alg. 2),
//! threshold binary search (Alg. 3) without and with threshold reuse
//! (interval 5, amortized over calls), and the sampled threshold.
//!
//! `cargo bench --bench select`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gradsync::cli::synthetic;
use gradsync::select::{exact_topk, trimmed_topk, ThresholdSearch};
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("select");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let mut scratch: Vec<f32> = Vec::new();
    for log_n in (10..=24).step_by(2) {
        let n = 1usize << log_n;
        let k = (n / 1000).max(1);
        let x = synthetic(n, "laplace", log_n as u64).expect("synthetic");
        g.bench_function(BenchmarkId::new("full-sort", n), |b| {
            b.iter(|| {
                scratch.clear();
                scratch.extend(x.iter().map(|v| v.abs()));
                scratch.sort_unstable_by(|a, b| b.total_cmp(a));
                scratch[k - 1]
            })
        });
        g.bench_function(BenchmarkId::new("select_nth_unstable", n), |b| {
            b.iter(|| {
                scratch.clear();
                scratch.extend(x.iter().map(|v| v.abs()));
                *scratch
                    .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a))
                    .1
            })
        });
        g.bench_function(BenchmarkId::new("exact-topk", n), |b| {
            b.iter(|| exact_topk(&x, k, &mut idx, &mut val).expect("select"))
        });
        g.bench_function(BenchmarkId::new("trimmed-topk", n), |b| {
            b.iter(|| trimmed_topk(&x, k, &mut idx, &mut val).expect("select"))
        });
        let mut fresh = ThresholdSearch::new().with_interval(0);
        g.bench_function(BenchmarkId::new("threshold-search", n), |b| {
            b.iter(|| fresh.select(&x, k, &mut idx, &mut val).expect("select"))
        });
        let mut reuse = ThresholdSearch::new();
        g.bench_function(BenchmarkId::new("threshold-reuse5", n), |b| {
            b.iter(|| reuse.select(&x, k, &mut idx, &mut val).expect("select"))
        });
        let mut sampled = ThresholdSearch::new().with_interval(0);
        g.bench_function(BenchmarkId::new("threshold-sampled", n), |b| {
            b.iter(|| {
                sampled
                    .select_sampled(&x, k, &mut idx, &mut val)
                    .expect("select")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
