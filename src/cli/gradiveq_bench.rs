//! `gradsync bench --op gradiveq`: GradiVeQ's compressed-domain ring
//! (Algorithm 1) against the uncompressed ring all-reduce and the 4-bit QSGD
//! ring, in the same run, iterations interleaved, slowest rank, medians.
//!
//! The compressor is fitted on `--lt` aggregated samples of the layer's
//! first slice (`s = ∞`: one compressor per layer, as the paper settles
//! on). The samples are each rank's own, summed with Rabenseifner's
//! allreduce, so every rank fits from the same bits; `--check` compares the
//! compressor hashes across ranks, checks that every rank got the same
//! result, and that it equals the centralized `U(Uᵀ(Σg − μ)) + μ` of
//! `MPI_Allreduce(g)`.
//!
//! `--data lowrank` synthesizes gradients near a `K/8`-dimensional affine
//! subspace (plus 1 % noise) per slice; `--data FILE.npy` takes a
//! `(steps, n)` array of real gradients: the first `--lt` rows train the
//! compressor, rank `r` compresses row `lt + r` (wrapping).

use super::bench::{
    check_common, common_must_match, flag_error, time_interleaved, timed, BenchArgs,
};
use super::{max_over_ranks, parse_size, read_npy};
use crate::calibrate::median;
use crate::comm::agree::agree_inputs;
use crate::comm::{MpiComm, Transport};
use crate::dense::{
    rabenseifner_allreduce, ring_allreduce_with, AllreduceOptions, ReduceOp, Workspace,
};
use crate::gradiveq::ring::{
    gradiveq_ring_allreduce, qsgd_ring_allreduce, RingStats, RingWorkspace,
};
use crate::gradiveq::{Compressor, Dim, LayerCompressor};
use crate::{Error, Result};
use mpi::collective::CommunicatorCollectives;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use serde::Serialize;

/// One result line of `gradsync bench --op gradiveq --json`.
#[derive(Serialize, Debug, Clone)]
pub struct GradiveqRecord {
    /// `gradiveq`.
    pub op: String,
    /// Ranks.
    pub ranks: usize,
    /// Layer bytes (f32).
    pub bytes: usize,
    /// Slice size K.
    pub k: usize,
    /// Kept components d.
    pub d: usize,
    /// Compression ratio (layer elements / compressed elements).
    pub ratio: f64,
    /// `‖result − Σ g‖ / ‖Σ g‖`.
    pub rel_l2_error: f64,
    /// Eq. 7 on rank 0: `‖g − (U Q(g) + μ/N)‖² / ‖g‖²` (relative).
    pub local_loss: f64,
    /// Training samples (L_t).
    pub lt: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median of the GradiVeQ ring (compression and decompression included).
    pub median_s: f64,
    /// Median of the uncompressed ring all-reduce.
    pub ring_median_s: f64,
    /// Median of the 4-bit QSGD ring (buckets of 512).
    pub qsgd_ring_median_s: f64,
    /// `ring_median_s / median_s`.
    pub speedup_vs_ring: f64,
    /// `qsgd_ring_median_s / median_s`.
    pub speedup_vs_qsgd_ring: f64,
    /// Median compression time per call (slowest rank).
    pub compress_s: f64,
    /// Median decompression time per call.
    pub decompress_s: f64,
    /// Median time blocked on transfers after the overlapped work.
    pub wait_s: f64,
    /// Data source.
    pub data: String,
    /// "ok", "failed" or "skipped".
    pub check: String,
}

fn lowrank_basis(k: usize, d0: usize) -> (Vec<f32>, Vec<f32>) {
    let mut r = SmallRng::seed_from_u64(0x6772_6164);
    let b = (0..k * d0).map(|_| r.gen_range(-1.0f32..1.0)).collect();
    let mu = (0..k).map(|_| r.gen_range(-0.1f32..0.1)).collect();
    (b, mu)
}

/// `slices` slices of `μ0 + B c + noise`, coefficients from `seed`.
fn lowrank(basis: &(Vec<f32>, Vec<f32>), k: usize, d0: usize, len: usize, seed: u64) -> Vec<f32> {
    let (b, mu) = basis;
    let mut r = SmallRng::seed_from_u64(seed);
    let mut v = Vec::with_capacity(len);
    let mut c = vec![0f32; d0];
    while v.len() < len {
        for x in c.iter_mut() {
            *x = r.gen_range(-1.0f32..1.0);
        }
        for i in 0..k.min(len - v.len()) {
            let row = &b[i * d0..(i + 1) * d0];
            let x: f32 = row.iter().zip(&c).map(|(a, b)| a * b).sum();
            v.push(mu[i] + x + 0.01 * r.gen_range(-1.0f32..1.0));
        }
    }
    v
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// This rank's samples of the first slice (`lt · k`), its gradient, and
/// the data source's name.
type Data = (Vec<f32>, Vec<f32>, String);

/// The rank-local input phase: flags checked, the data synthesized or read.
fn inputs(a: &BenchArgs, rank: usize, p: usize) -> Result<(Dim, Data)> {
    check_common(a)?;
    let (k, lt) = (a.k, a.lt);
    if k == 0 {
        return Err(Error::InvalidArgument("--k 0: must be at least 1".into()));
    }
    if lt < 2 {
        return Err(Error::InvalidArgument(format!(
            "--lt {lt}: the compressor is fitted on at least 2 samples"
        )));
    }
    let dim = match a.d {
        Some(d) if d == 0 || d > k => {
            return Err(Error::InvalidArgument(format!(
                "--d {d}: must lie in 1..={k} (1..=--k)"
            )))
        }
        Some(d) => Dim::Fixed(d),
        None if !(0.0..1.0).contains(&a.lambda) => {
            return Err(Error::InvalidArgument(format!(
                "--lambda {}: must lie in [0, 1)",
                a.lambda
            )))
        }
        None => Dim::Lambda(a.lambda),
    };
    // Samples of the first slice (this rank's) and this rank's gradient.
    let data = if a.data == "lowrank" {
        let bytes = parse_size(a.bytes_or_default()).map_err(|e| flag_error("--bytes", e))?;
        if bytes % 4 != 0 {
            return Err(Error::InvalidArgument(format!(
                "--bytes {}: {bytes} bytes is not a whole number of f32 elements (a multiple of 4)",
                a.bytes_or_default()
            )));
        }
        let n = bytes / 4;
        if n < k {
            return Err(Error::InvalidArgument(format!(
                "--bytes gives {n} elements, fewer than --k {k}"
            )));
        }
        let d0 = (k / 8).max(1);
        let basis = lowrank_basis(k, d0);
        let mut s = Vec::with_capacity(lt * k);
        for t in 0..lt {
            s.extend(lowrank(&basis, k, d0, k, (t * p + rank) as u64 + 1));
        }
        let g = lowrank(&basis, k, d0, n, 1_000_000 + rank as u64);
        (s, g, "lowrank".to_string())
    } else {
        if let Some(b) = &a.bytes {
            return Err(Error::InvalidArgument(format!(
                "--bytes {b} is not used with --data {} (the file's rows are the layer)",
                a.data
            )));
        }
        let path = std::path::Path::new(&a.data);
        let (shape, v) = read_npy(path).map_err(|e| match e {
            // The reader's I/O errors do not name the file.
            Error::Io(e) => Error::file(path, format!("--data: {e}")),
            e => e,
        })?;
        if shape.len() < 2 || shape[0] <= lt {
            return Err(Error::InvalidArgument(format!(
                "{}: need a (steps, n) array with more than --lt {lt} steps, got {shape:?}",
                a.data
            )));
        }
        let n = v.len() / shape[0];
        if n < k || k == 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: rows of {n} elements, fewer than --k {k}",
                a.data
            )));
        }
        let mut s = Vec::with_capacity(lt * k);
        for t in 0..lt {
            s.extend_from_slice(&v[t * n..t * n + k]);
        }
        let row = lt + rank % (shape[0] - lt);
        (s, v[row * n..(row + 1) * n].to_vec(), a.data.clone())
    };
    Ok((dim, data))
}

pub(super) fn run(comm: &MpiComm, a: &BenchArgs) -> Result<i32> {
    let (rank, p) = (comm.rank(), comm.size());
    let (k, lt) = (a.k, a.lt);
    let (dim, (mut samples, g, data)) = agree_inputs(comm, inputs(a, rank, p), |(dim, d)| {
        let mut m = common_must_match(a);
        m.push(("--k", k.to_string()));
        m.push(("--lt", lt.to_string()));
        m.push(("--d/--lambda", format!("{dim:?}")));
        m.push(("layer elements (--bytes or --data)", d.1.len().to_string()));
        m
    })?;
    let n = g.len();
    // Aggregate the samples (sum over ranks), identically on every rank.
    rabenseifner_allreduce(comm, &mut samples, &AllreduceOptions::default())?;
    let refs: Vec<&[f32]> = samples.chunks_exact(k).collect();
    // One compressor per layer (s = ∞), fitted on the first slice's samples.
    let lc = LayerCompressor::single(n, Compressor::fit(&refs, dim)?)?;
    let d = lc.groups()[0].d();
    let mut out = vec![0f32; n];
    let mut ws = RingWorkspace::default();
    let mut dws = Workspace::<f32>::new();
    let mut dense = g.clone();
    let mut qout = vec![0f32; n];
    let mut qws = RingWorkspace::default();
    let sum_opts = AllreduceOptions {
        op: ReduceOp::Sum,
        validate: false,
        chunk_elems: 0,
    };
    let mut stats: Vec<RingStats> = Vec::new();
    let mut times = time_interleaved(comm, a.iters, a.warmup, 3, |op| match op {
        0 => timed(comm, || {
            let st = gradiveq_ring_allreduce(comm, &lc, &g, &mut out, &mut ws)?;
            stats.push(st);
            Ok(())
        }),
        1 => {
            dense.copy_from_slice(&g);
            timed(comm, || {
                ring_allreduce_with(comm, &mut dense, &sum_opts, &mut dws)
            })
        }
        _ => timed(comm, || {
            qsgd_ring_allreduce(comm, &g, &mut qout, 4, 512, 99, &mut qws)
        }),
    })?;
    let tail = stats.split_off(a.warmup.min(stats.len()));
    let mut parts = [
        median(&mut tail.iter().map(|s| s.compress_s).collect::<Vec<_>>()),
        median(&mut tail.iter().map(|s| s.decompress_s).collect::<Vec<_>>()),
        median(&mut tail.iter().map(|s| s.wait_s).collect::<Vec<_>>()),
    ];
    max_over_ranks(comm, &mut parts);
    // Exact sum for the error and the check.
    let mut total = vec![0f32; n];
    comm.native_allreduce_sum(&g, &mut total)
        .ok_or_else(|| Error::Unsupported("no MPI allreduce".into()))??;
    let err = rel_l2(&out, &total);
    // Eq. 7 on this rank (relative to ‖g‖²).
    let local_loss = {
        let grp = &lc.groups()[0];
        let mut q = vec![0f32; grp.d()];
        let mut y = vec![0f32; k];
        let mut num = 0f64;
        let mut den = 0f64;
        for s in 0..lc.slices() {
            let x = &g[s * k..(s + 1) * k];
            grp.compress(x, p, &mut q);
            grp.decompress(&q, &mut y);
            // U Q(g) + μ/N = decompress(q) − μ + μ/N.
            for i in 0..k {
                // U Q(g) + μ/N = decompress(Q(g)) − μ + μ/N.
                let mu = grp.mu()[i];
                let approx = y[i] - mu + mu / p as f32;
                num += f64::from(x[i] - approx).powi(2);
                den += f64::from(x[i]).powi(2);
            }
        }
        num / den.max(1e-300)
    };
    let check = if a.check {
        let mut want = vec![0f32; n];
        lc.round_trip(&total, &mut want);
        let close = rel_l2(&out, &want) < 1e-4;
        let mut hashes = vec![0u64; p];
        let h = lc.hash();
        comm.communicator().all_gather_into(&h, &mut hashes[..]);
        let same_compressor = hashes.iter().all(|&x| x == h);
        let oh = out.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
        });
        let mut ohs = vec![0u64; p];
        comm.communicator().all_gather_into(&oh, &mut ohs[..]);
        let same_result = ohs.iter().all(|&x| x == oh);
        let mut bad = [f64::from(u8::from(
            !(close && same_compressor && same_result),
        ))];
        max_over_ranks(comm, &mut bad);
        if bad[0] > 0.0 {
            if rank == 0 {
                errln!(
                    "gradiveq check: close to centralized {close}, same compressor {same_compressor}, same result {same_result}"
                );
            }
            "failed"
        } else {
            "ok"
        }
    } else {
        "skipped"
    };
    let med = median(&mut times[0]);
    let ring = median(&mut times[1]);
    let qsgd = median(&mut times[2]);
    let rec = GradiveqRecord {
        op: "gradiveq".into(),
        ranks: p,
        bytes: 4 * n,
        k,
        d,
        ratio: lc.ratio(),
        rel_l2_error: err,
        local_loss,
        lt,
        iters: a.iters,
        median_s: med,
        ring_median_s: ring,
        qsgd_ring_median_s: qsgd,
        speedup_vs_ring: ring / med,
        speedup_vs_qsgd_ring: qsgd / med,
        compress_s: parts[0],
        decompress_s: parts[1],
        wait_s: parts[2],
        data,
        check: check.into(),
    };
    if rank == 0 {
        if a.json {
            outln!("{}", serde_json::to_string(&rec)?);
        } else {
            outln!(
                "gradiveq ranks {} bytes {} K {} d {} ratio {:.2} err {:.3e} | gradiveq {:.1} us, ring {:.1} us ({:.2}x), qsgd ring {:.1} us ({:.2}x) | compress {:.1} decompress {:.1} wait {:.1} us | check {}",
                rec.ranks,
                rec.bytes,
                rec.k,
                rec.d,
                rec.ratio,
                rec.rel_l2_error,
                rec.median_s * 1e6,
                rec.ring_median_s * 1e6,
                rec.speedup_vs_ring,
                rec.qsgd_ring_median_s * 1e6,
                rec.speedup_vs_qsgd_ring,
                rec.compress_s * 1e6,
                rec.decompress_s * 1e6,
                rec.wait_s * 1e6,
                rec.check
            );
        }
    }
    Ok(i32::from(rec.check == "failed"))
}
