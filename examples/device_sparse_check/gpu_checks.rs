//! `--kernels` and `--bench` of `device_sparse_check` (feature `cuda`).

use super::{fail, grad};
use gradsync::codec::{rgc_k, CodecConfig, RgcMethod};
use gradsync::comm::MpiComm;
use gradsync::gpu::sparse::{
    policy, CudaOps, DeviceSparse, DeviceSparseConfig, HostOps, LayerState, Method, SparseOps,
};
use gradsync::gpu::CudaStaging;
use gradsync::sync::{Config, GradSync, Strategy};
use mpi::traits::Communicator;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::time::Instant;

fn ok<T>(r: gradsync::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn same(what: &str, a: &[f32], b: &[f32]) {
    if let Some(i) = (0..a.len().max(b.len()))
        .find(|&i| a.get(i).map(|v| v.to_bits()) != b.get(i).map(|v| v.to_bits()))
    {
        fail(format!(
            "{what}: element {i} of {}: device {:?} cpu {:?}",
            a.len(),
            a.get(i),
            b.get(i)
        ));
    }
}

/// The device's and the CPU's statistics of `V`: counts and maxima equal,
/// sums equal on integers and within 1e-12 otherwise (another order).
fn stats_agree(
    c: &mut CudaOps,
    h: &mut HostOps,
    integer: bool,
    what: &str,
) -> Vec<gradsync::gpu::sparse::AbsStats> {
    let (cs, hs) = (ok(c.stats(), "stats"), ok(h.stats(), "stats"));
    for (l, (a, b)) in cs.iter().zip(&hs).enumerate() {
        let rel = (a.sum - b.sum).abs() / b.sum.abs().max(1e-30);
        if a.count != b.count
            || a.max.to_bits() != b.max.to_bits()
            || (integer && a.sum != b.sum)
            || rel > 1e-12
        {
            fail(format!("{what} of layer {l}: device {a:?} cpu {b:?}"));
        }
    }
    hs
}

/// Every kernel against the CPU reference on the same buffers.
pub fn kernels(_: &[String]) {
    if let Err(why) = gradsync::gpu::probe() {
        println!("GPU-SKIPPED {why}");
        return;
    }
    let sizes = [0usize, 1, 4095, 4096, 4097, 100_000, 3_000_000, 17];
    let n: usize = sizes.iter().sum();
    let mut checks = 0;
    for integer in [true, false] {
        let tag = if integer { "integer" } else { "real" };
        let mut c = ok(CudaOps::new(0, &sizes), "CudaOps");
        let mut h = HostOps::new(&sizes);
        let g = grad(0, 1, n, integer);
        let v0 = grad(0, 2, n, integer);
        ok(c.upload_grads(&g), "upload");
        h.grads = g.clone();
        ok(c.upload_residual(&v0), "upload");
        h.v = v0;
        if ok(c.grads_nonfinite(), "nonfinite") || ok(h.grads_nonfinite(), "nonfinite") {
            fail(format!("{tag}: finite gradients called non-finite"));
        }
        checks += 1;
        for (m, nest) in [(0.9f32, false), (0.9, true), (0.0, false)] {
            ok(c.accumulate(m, nest), "accumulate");
            ok(h.accumulate(m, nest), "accumulate");
            same(
                &format!("{tag} accumulate m={m} nesterov={nest}"),
                &ok(c.download_residual(), "v"),
                &h.v,
            );
            checks += 1;
        }
        let hs = stats_agree(&mut c, &mut h, integer, &format!("{tag} stats"));
        checks += hs.len();
        // Thresholds: 31 ratios of each layer, and exact magnitudes of
        // some elements (strictness: |x| > t, not ≥).
        let mut thr: Vec<Vec<f32>> = Vec::new();
        let mut at = 0;
        for (l, s) in hs.iter().enumerate() {
            let mean = if s.count == 0 {
                0.0
            } else {
                s.sum / s.count as f64
            };
            let mut t: Vec<f32> = (0..28)
                .map(|j| (mean + (j as f64 / 27.0) * (f64::from(s.max) - mean)) as f32)
                .collect();
            for j in 0..3 {
                if sizes[l] > 0 {
                    t.push(h.v[at + (j * 7919) % sizes[l]].abs());
                }
            }
            t.sort_by(f32::total_cmp);
            t.dedup();
            thr.push(t);
            at += sizes[l];
        }
        let (cc, hc) = (
            ok(c.count_above(&thr), "count"),
            ok(h.count_above(&thr), "count"),
        );
        if cc != hc {
            fail(format!("{tag} count_above: device {cc:?} cpu {hc:?}"));
        }
        checks += 1;
        for pick in [0usize, 10, 20, 27] {
            let t1: Vec<f32> = thr
                .iter()
                .map(|t| t.get(pick).copied().unwrap_or(0.0))
                .collect();
            let (a, b) = (ok(c.compact(&t1), "compact"), ok(h.compact(&t1), "compact"));
            if a.counts != b.counts || a.idx != b.idx || bits(&a.val) != bits(&b.val) {
                fail(format!(
                    "{tag} compact at threshold {pick}: counts {:?} / {:?}",
                    a.counts, b.counts
                ));
            }
            checks += 1;
        }
        let gidx: Vec<u64> = (0..n as u64).step_by(97).collect();
        ok(c.clear_sent(&gidx), "clear");
        ok(h.clear_sent(&gidx), "clear");
        same(
            &format!("{tag} clear_sent"),
            &ok(c.download_residual(), "v"),
            &h.v,
        );
        checks += 1;
        // Statistics by their own pass (the residual changed since the
        // accumulation took them).
        checks += stats_agree(&mut c, &mut h, integer, &format!("{tag} stats pass")).len();
        ok(c.clear_layer(6), "clear_layer");
        ok(h.clear_layer(6), "clear_layer");
        same(
            &format!("{tag} clear_layer"),
            &ok(c.download_residual(), "v"),
            &h.v,
        );
        checks += 1;
        let ranks: Vec<(Vec<u64>, Vec<f32>)> = (0..3u64)
            .map(|r| {
                let gi: Vec<u64> = (r..n as u64).step_by(13 + r as usize).collect();
                let v = gi.iter().map(|&i| h.grads[i as usize] + r as f32).collect();
                (gi, v)
            })
            .collect();
        ok(c.scatter(&ranks, 1.0 / 3.0), "scatter");
        ok(h.scatter(&ranks, 1.0 / 3.0), "scatter");
        same(
            &format!("{tag} scatter"),
            &ok(c.download_grads(), "g"),
            &h.grads,
        );
        checks += 1;
        let mut bad = g.clone();
        bad[n - 5] = f32::INFINITY;
        ok(c.upload_grads(&bad), "upload");
        if !ok(c.grads_nonfinite(), "nonfinite") {
            fail(format!("{tag}: an infinite gradient not found"));
        }
        checks += 1;
    }
    println!("KERNELS-OK checks={checks}");
}

fn arg(args: &[String], name: &str, default: f64) -> f64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| {
            v.parse().unwrap_or_else(|_| fail(format!("{name} {v}")))
        })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn normals(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let (u1, u2): (f64, f64) = (rng.gen::<f64>().max(1e-300), rng.gen());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn resnet50_sizes() -> Vec<usize> {
    let path = "examples/layers/resnet50.json";
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| fail(format!("{path}: {e}")));
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| fail(format!("{path}: {e}")));
    v["layers"]
        .as_array()
        .unwrap_or_else(|| fail(format!("{path}: no layers")))
        .iter()
        .map(|l| l["elements"].as_u64().unwrap_or(0) as usize)
        .collect()
}

/// Selection throughput and the ResNet-50 step, device against staged.
pub fn bench<C: Communicator>(world: &C, args: &[String]) {
    if let Err(why) = gradsync::gpu::probe() {
        println!("GPU-SKIPPED {why}");
        return;
    }
    let log2n = arg(args, "--log2n", 26.0) as u32;
    let density = arg(args, "--density", 0.001);
    let reps = (arg(args, "--reps", 11.0) as usize).max(3);
    let n = 1usize << log2n;
    let k = rgc_k(density, n);
    let mut ops = ok(CudaOps::new(0, &[n]), "CudaOps");
    ok(ops.upload_residual(&normals(n, 7)), "upload");
    ok(ops.sync(), "sync");
    let time = |f: &mut dyn FnMut()| -> f64 {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let thr = Method::Threshold {
        interval: 5,
        eps: 1e-4,
    };
    // The statistics come with the accumulation (one fused pass, timed
    // apart: `V += 0` here); the selection starts from them, as in a step.
    let mut t_of = std::collections::BTreeMap::<&str, Vec<f64>>::new();
    let (mut sent_search, mut sent_reuse, mut passes) = (0, 0, 0);
    let probe_t = {
        let st = ok(ops.stats(), "stats")[0];
        let mean = st.sum / st.count as f64;
        (mean + 0.5 * (f64::from(st.max) - mean)) as f32
    };
    for r in 0..reps + 2 {
        let mut row: Vec<(&str, f64)> = Vec::new();
        row.push((
            "accumulate_stats",
            time(&mut || {
                ok(ops.accumulate(0.0, false), "accumulate");
                ok(ops.sync(), "sync");
            }),
        ));
        let mut ls = vec![LayerState::new(n, k, thr)];
        row.push((
            "search",
            time(&mut || {
                let s = ok(policy::select(&mut ops, &mut ls), "select");
                sent_search = s.entries.idx.len();
                passes = s.count_passes;
            }),
        ));
        row.push((
            "reuse",
            time(&mut || {
                let s = ok(policy::select(&mut ops, &mut ls), "select");
                sent_reuse = s.entries.idx.len();
            }),
        ));
        let mut lt = vec![LayerState::new(n, k, Method::Trimmed)];
        row.push((
            "trimmed",
            time(&mut || {
                ok(policy::select(&mut ops, &mut lt), "select");
            }),
        ));
        row.push((
            "op_stats_from_accumulate",
            time(&mut || {
                ok(ops.stats(), "stats");
            }),
        ));
        row.push((
            "op_count_1",
            time(&mut || {
                ok(ops.count_above(&[vec![probe_t]]), "count");
            }),
        ));
        row.push((
            "op_compact",
            time(&mut || {
                ok(ops.compact(&[probe_t]), "compact");
            }),
        ));
        row.push((
            "copy",
            time(&mut || {
                ok(ops.copy_residual_to_grads(), "copy");
                ok(ops.sync(), "sync");
            }),
        ));
        // The accumulation of the next round adds the gradients to V: back
        // to zero (else V doubles every round and a fixed threshold takes
        // all of it).
        ok(ops.zero_grads(), "zero");
        if r >= 2 {
            for (name, v) in row {
                t_of.entry(name).or_default().push(v);
            }
        }
    }
    let med: std::collections::BTreeMap<&str, f64> =
        t_of.into_iter().map(|(k, v)| (k, median(v))).collect();
    let (search, reuse, trimmed, copy) = (med["search"], med["reuse"], med["trimmed"], med["copy"]);
    eprintln!(
        "bench: select 2^{log2n} at k = {k}: search {:.3} ms ({passes} count passes, {sent_search} sent), reuse {:.3} ms ({sent_reuse} sent), trimmed {:.3} ms; copy {:.3} ms; {med:?}",
        search * 1e3,
        reuse * 1e3,
        trimmed * 1e3,
        copy * 1e3
    );
    drop(ops);
    // The ResNet-50 table, one rank: device-resident against staged.
    let sizes = resnet50_sizes();
    let total: usize = sizes.iter().sum();
    let g = normals(total, 11);
    let comm = MpiComm::duplicate_of(world).expect("comm");
    let cfg = DeviceSparseConfig {
        density: 0.001,
        method: thr,
        momentum: 0.9,
        nesterov: false,
    };
    let mut dev = ok(
        DeviceSparse::new(ok(CudaOps::new(0, &sizes), "CudaOps"), cfg),
        "DeviceSparse",
    );
    let mut dev_t = vec![];
    let mut last = None;
    for r in 0..reps + 2 {
        ok(dev.ops().upload_grads(&g), "upload");
        ok(dev.ops().sync(), "sync");
        let t = Instant::now();
        let st = ok(dev.step(&comm), "device step");
        ok(dev.ops().sync(), "sync");
        if r >= 2 {
            dev_t.push(t.elapsed().as_secs_f64());
        }
        last = Some(st);
    }
    let mut host = GradSync::new(
        world,
        Config {
            momentum: 0.9,
            ..Config::default()
        },
    )
    .expect("engine");
    for (l, &n) in sizes.iter().enumerate() {
        let s = Strategy::Sparse {
            codec: CodecConfig::Rgc {
                density: 0.001,
                method: RgcMethod::Threshold,
            },
            density: None,
        };
        host.register_with(&format!("l{l}"), &[n], s)
            .expect("register");
    }
    let mut staged_t = vec![];
    let mut at = 0;
    let parts: Vec<&[f32]> = sizes
        .iter()
        .map(|&n| {
            let p = &g[at..at + n];
            at += n;
            p
        })
        .collect();
    let mut layers: Vec<CudaStaging> = parts
        .iter()
        .map(|p| ok(CudaStaging::from_host(0, p), "staging"))
        .collect();
    for r in 0..reps + 2 {
        // The gradients back into the device buffers (the last step left
        // its result there), through the layers' own pinned slots, which
        // the first step allocated: not timed.
        use gradsync::gpu::DeviceCopies;
        for (l, p) in layers.iter_mut().zip(&parts) {
            ok(l.prepare(1, p.len()), "prepare");
            ok(l.slot(0), "slot")[..p.len()].copy_from_slice(p);
            ok(l.start_to_device(0, 0..p.len()), "upload");
            ok(l.synchronize(), "sync");
        }
        let t = Instant::now();
        ok(host.sync_device(&mut layers).map(|_| ()), "staged step");
        if r >= 2 {
            staged_t.push(t.elapsed().as_secs_f64());
        }
    }
    let (dev_s, staged_s) = (median(dev_t), median(staged_t));
    let st = last.expect("steps ran");
    eprintln!(
        "bench: ResNet-50 step at density 0.001: device {:.3} ms, staged {:.3} ms ({:.1}x); device PCIe bytes {}, staged {}",
        dev_s * 1e3,
        staged_s * 1e3,
        staged_s / dev_s,
        st.pcie_bytes,
        8 * total
    );
    let out = serde_json::json!({
        "n": n, "k": k, "reps": reps,
        "select_s": search, "select_count_passes": passes, "select_sent": sent_search,
        "medians_s": med,
        "reuse_s": reuse, "reuse_sent": sent_reuse, "trimmed_s": trimmed,
        "copy_s": copy, "copy_gbps": 8.0 * n as f64 / copy / 1e9,
        "resnet50": {
            "elements": total, "layers": sizes.len(), "density": 0.001,
            "device_step_s": dev_s, "staged_step_s": staged_s,
            "speedup": staged_s / dev_s,
            "device_step": st,
            "device_pcie_bytes": st.pcie_bytes, "staged_pcie_bytes": 8 * total,
        }
    });
    println!("BENCH-JSON {out}");
}
