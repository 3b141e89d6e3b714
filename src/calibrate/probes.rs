//! The probes of a calibration or check: each a measurement that owns its
//! buffers, run in shuffled rounds by [`rounds`].

use super::interquartile_mean;
use crate::codec::CodecConfig;
use crate::comm::tags;
use crate::comm::{LocalComm, MpiComm, Transport};
use crate::dense::{allgatherv_with, AllgathervAlgo, Gathered};
use crate::sync::{Config, GradSync, Strategy};
use crate::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

/// One measurement of a calibration or check round: this rank's seconds (0
/// where the rank takes no part). Each probe owns its buffers.
pub(super) type Probe<'a> = Box<dyn FnMut(usize) -> Result<f64> + 'a>;

/// A local measurement run on every rank at once (after a barrier, so the
/// ranks contend for memory bandwidth as they do in a real step), timed
/// up to a second barrier: the span until the slowest rank is done, which
/// is what a step waits for before its collective. (Timed to the rank's
/// own end, ranks sharing a core measured their work as if alone: at 4
/// ranks on 2 cores the local phase of a step took twice the prediction.)
/// The barriers' own cost is an empty probe in the same rounds
/// ([`barrier_span`]), which the fits subtract.
///
/// The caches are left as the previous call left them. Cold-cache probes
/// (a 64 MiB sweep before each call) were tried for the step model: they
/// over-predicted the engine's sparse path in whole-model steps by about
/// 25 % (1.6–1.8 ns per element against 1.3–1.45 measured in the step)
/// and did not close the dense path's gap, so they were dropped.
pub(super) fn local<'a>(comm: &'a MpiComm, mut f: impl FnMut() -> Result<()> + 'a) -> Probe<'a> {
    Box::new(move |_| {
        comm.barrier()?;
        let t0 = Instant::now();
        f()?;
        comm.barrier()?;
        Ok(t0.elapsed().as_secs_f64())
    })
}

/// The empty [`local`] probe: two barriers, the part of every local
/// probe's time that is not the work.
pub(super) fn barrier_span(comm: &MpiComm) -> Probe<'_> {
    local(comm, || Ok(()))
}

/// [`local`] with an untimed preparation: `prep(&mut state)` (e.g. a fresh
/// gradient copied into place, which a training step gets from
/// backpropagation), then `f(&mut state)` timed.
pub(super) fn local_prep<'a, T: 'a>(
    comm: &'a MpiComm,
    mut state: T,
    mut prep: impl FnMut(&mut T) + 'a,
    mut f: impl FnMut(&mut T) -> Result<()> + 'a,
) -> Probe<'a> {
    Box::new(move |_| {
        prep(&mut state);
        comm.barrier()?;
        let t0 = Instant::now();
        f(&mut state)?;
        comm.barrier()?;
        Ok(t0.elapsed().as_secs_f64())
    })
}

/// Runs every probe once per round until at least `min_rounds` rounds and
/// `min_seconds` have passed (rank 0 decides, every rank follows), after
/// one untimed round. Returns each probe's [`interquartile_mean`], the
/// slowest rank's, and
/// the number of rounds; `on_round(round, seconds)` reports progress.
///
/// Every round runs all probes in a new order, the same on every rank.
/// This is what makes a calibration on a shared machine repeatable. On the
/// 2-vCPU KVM guests of this project the two vCPUs share a core complex
/// most of the time and sit in different ones, where cache-to-cache
/// transfers are 3–5× slower, for episodes of a fraction of a second to
/// tens of seconds. Measuring one size after the other catches an episode
/// in some sizes and not in others, and a calibration followed by a check
/// compares two different machines. Rounds spread over seconds give every
/// probe the same mix of states, so their medians describe the same
/// machine, and the shuffled order stops one probe from always following
/// the one that filled the caches (a fixed order cost one strategy 40 %).
pub(super) fn rounds(
    comm: &MpiComm,
    probes: &mut [Probe<'_>],
    min_rounds: usize,
    min_seconds: f64,
    seed: u64,
    mut on_round: impl FnMut(usize, f64),
) -> Result<(Vec<f64>, usize)> {
    if probes.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); probes.len()];
    let mut order: Vec<usize> = (0..probes.len()).collect();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut round = 0;
    loop {
        order.shuffle(&mut rng);
        for &i in &order {
            // A short burst, as `gradsync bench` and a training loop run
            // them back to back: the first call warms the caches (a probe
            // right after another one's 16 MiB finds them full of that
            // data), the next BURST are timed.
            for b in 0..=BURST {
                let x = probes[i](round * (BURST + 1) + b)?;
                if round > 0 && b > 0 {
                    t[i].push(x);
                }
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        on_round(round, elapsed);
        let more = round < min_rounds || (elapsed < min_seconds && round < MAX_ROUNDS);
        let mut flag = [if comm.rank() == 0 && more { 1.0 } else { 0.0 }];
        max_over_ranks(comm, &mut flag);
        if flag[0] == 0.0 {
            break;
        }
        round += 1;
    }
    if log::log_enabled!(log::Level::Trace) {
        for (i, v) in t.iter().enumerate() {
            log::trace!(
                "samples of round set {seed} rank {} probe {i}: {:?}",
                comm.rank(),
                v
            );
        }
    }
    let mut med: Vec<f64> = t.iter_mut().map(|v| interquartile_mean(v)).collect();
    max_over_ranks(comm, &mut med);
    Ok((med, round))
}

/// Upper bound on measurement rounds, whatever `min_seconds` says.
pub(super) const MAX_ROUNDS: usize = 100_000;

/// Timed calls of a probe per round (after one untimed call).
pub(super) const BURST: usize = 3;

/// One-way time of a message between ranks 0 and 1 (ping-pong / 2).
pub(super) fn pingpong(comm: &MpiComm, buf: &mut [u8]) -> Result<f64> {
    let rank = comm.rank();
    comm.barrier()?;
    let t0 = mpi::time();
    match rank {
        0 => {
            comm.send(buf, 1, tags::CALIBRATE_PINGPONG)?;
            comm.recv(buf, 1, tags::CALIBRATE_PINGPONG)?;
        }
        1 => {
            comm.recv(buf, 0, tags::CALIBRATE_PINGPONG)?;
            comm.send(buf, 0, tags::CALIBRATE_PINGPONG)?;
        }
        _ => return Ok(0.0),
    }
    Ok((mpi::time() - t0) / 2.0)
}

/// One-way time of a message between this rank and `peer` (ping-pong / 2;
/// the lower rank starts); `None`: this rank only takes part in the
/// barrier.
pub(super) fn pingpong_with(comm: &MpiComm, peer: Option<usize>, buf: &mut [u8]) -> Result<f64> {
    let rank = comm.rank();
    comm.barrier()?;
    let t0 = mpi::time();
    let Some(peer) = peer else {
        return Ok(0.0);
    };
    if rank < peer {
        comm.send(buf, peer, tags::CALIBRATE_PINGPONG)?;
        comm.recv(buf, peer, tags::CALIBRATE_PINGPONG)?;
    } else {
        comm.recv(buf, peer, tags::CALIBRATE_PINGPONG)?;
        comm.send(buf, peer, tags::CALIBRATE_PINGPONG)?;
    }
    Ok((mpi::time() - t0) / 2.0)
}

/// Time of a pairwise exchange (`sendrecv` of the buffer each way between
/// ranks `2i` and `2i+1`): one step of Rabenseifner's or recursive
/// doubling's schedule, `α + bytes·β` in the model.
pub(super) fn exchange_time(
    comm: &MpiComm,
    send: &mut [u8],
    recv: &mut [u8],
    round: usize,
) -> Result<f64> {
    let peer = comm.rank() ^ 1;
    exchange_time_with(
        comm,
        (peer < comm.size()).then_some(peer),
        send,
        recv,
        round,
    )
}

/// The same with this rank's partner given (`None`: this rank only takes
/// part in the barrier).
pub(super) fn exchange_time_with(
    comm: &MpiComm,
    peer: Option<usize>,
    send: &mut [u8],
    recv: &mut [u8],
    round: usize,
) -> Result<f64> {
    // Fresh data every time, as a gradient is: the sender's cache holds the
    // lines modified, so the copy pays the cache-to-cache transfer that a
    // collective's steps pay (a send buffer that never changes ends up
    // cached on both cores and measures a local copy: 2-4x too fast here).
    send.fill(round as u8);
    comm.barrier()?;
    let t0 = mpi::time();
    let Some(peer) = peer else {
        return Ok(0.0);
    };
    comm.sendrecv(send, peer, recv, peer, tags::CALIBRATE_EXCHANGE)?;
    Ok(mpi::time() - t0)
}

/// [`exchange_time_with`] after every rank (and so the link) has idled
/// for [`super::burst::IDLE_S`]: the probe of the link's burst credit.
pub(super) fn idle_exchange_time(
    comm: &MpiComm,
    peer: Option<usize>,
    send: &mut [u8],
    recv: &mut [u8],
    round: usize,
) -> Result<f64> {
    std::thread::sleep(std::time::Duration::from_secs_f64(super::burst::IDLE_S));
    let t = exchange_time_with(comm, peer, send, recv, round)?;
    // The other ranks wait (polling, as in a collective) until the pair is
    // done: on a machine whose ranks share cores, a pair alone with idle
    // cores moves its burst several times faster than inside a collective.
    comm.barrier()?;
    Ok(t)
}

/// The pairs of a calibration on several nodes: inside a node
/// every rank is paired with a neighbour of the same node (all pairs at
/// once, as the collectives' intra-node steps run), across nodes rank 0
/// alone with the first rank of another node (one pair on the link, the
/// model's `inter_node` level).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Pairs {
    /// Whether the job spans several nodes.
    pub multi: bool,
    /// Largest number of ranks on one node.
    pub ranks_per_node: usize,
    /// Whether some node has two ranks (an intra-node pair exists).
    pub any_intra: bool,
    /// This rank's partner inside its node.
    pub intra: Option<usize>,
    /// This rank's partner on another node (ranks 0 and its peer only).
    pub inter: Option<usize>,
}

/// [`Pairs`] from the node of every rank.
pub(super) fn pairs(nodes: &[usize], rank: usize) -> Pairs {
    let mine: Vec<usize> = (0..nodes.len())
        .filter(|&r| nodes[r] == nodes[rank])
        .collect();
    let i = mine.iter().position(|&r| r == rank).unwrap_or(0);
    let intra = mine.get(i ^ 1).copied();
    let other = (0..nodes.len()).find(|&r| nodes[r] != nodes[0]);
    let inter = match other {
        Some(o) if rank == 0 => Some(o),
        Some(o) if rank == o => Some(0),
        _ => None,
    };
    let mut counts = std::collections::HashMap::new();
    for &n in nodes {
        *counts.entry(n).or_insert(0usize) += 1;
    }
    Pairs {
        multi: other.is_some(),
        ranks_per_node: crate::comm::ranks_per_node(nodes).unwrap_or(nodes.len()),
        any_intra: counts.values().any(|&c| c >= 2),
        intra,
        inter,
    }
}

/// Time of the recursive-doubling allgather of the buffer (fresh data).
pub(super) fn allgather_time(
    comm: &MpiComm,
    send: &mut [u8],
    g: &mut Gathered,
    round: usize,
) -> Result<f64> {
    send.fill(round as u8);
    comm.barrier()?;
    let t0 = mpi::time();
    allgatherv_with(comm, send, AllgathervAlgo::RecursiveDoubling, g)?;
    Ok(mpi::time() - t0)
}

/// Local cost of one sparse engine step (one rank, in process): residual
/// accumulation, selection, packing, zeroing and unpacking its own unit.
pub(super) fn sparse_step_probe(comm: &MpiComm, codec: CodecConfig, n: usize) -> Result<Probe<'_>> {
    step_probe(
        comm,
        Strategy::Sparse {
            codec,
            density: None,
        },
        1,
        n,
    )
}

/// Local cost of one engine step of `layers` layers of `n` elements with
/// `strategy` (one rank, in process, so no communication): for dense
/// layers, copying them into the fused buffer, momentum and copying the
/// result out (`dense_local`). Several layers make a table larger than one
/// layer may be (a whole model's dense step streams from memory).
pub(super) fn step_probe(
    comm: &MpiComm,
    strategy: Strategy,
    layers: usize,
    n: usize,
) -> Result<Probe<'_>> {
    engine_probe(comm, Config::default(), strategy, layers, n)
}

/// One engine step of `layers` RGC layers of `n` elements each (one rank,
/// in process), with the layers' local work spread over the engine's
/// threads (`parallel`) or one after the other: the two give the
/// effective speedup of the engine's layer-parallel local phase.
pub(super) fn layers_probe(
    comm: &MpiComm,
    codec: CodecConfig,
    layers: usize,
    n: usize,
    parallel: bool,
) -> Result<Probe<'_>> {
    let config = Config {
        parallel_min_elems: if parallel { 0 } else { usize::MAX },
        ..Config::default()
    };
    let strategy = Strategy::Sparse {
        codec,
        density: None,
    };
    engine_probe(comm, config, strategy, layers, n)
}

/// One step of an in-process engine (`config`, without its progress
/// thread) over `layers` layers of `n` elements with `strategy`; the
/// gradients are copied in before the clock starts, a different one
/// every call ([`step_gradient`]).
fn engine_probe(
    comm: &MpiComm,
    config: Config,
    strategy: Strategy,
    layers: usize,
    n: usize,
) -> Result<Probe<'_>> {
    let mut s = GradSync::with_transport(
        LocalComm::create(1).pop().expect("one rank"),
        Config {
            overlap: false,
            ..config
        },
    )?;
    let mut g = Vec::with_capacity(layers);
    for i in 0..layers {
        s.register_with(&format!("layer{i}"), &[n], strategy.clone())?;
        g.push(synthetic(n, "normal", (n + i) as u64)?);
    }
    let w = g.clone();
    let mut step = 0;
    Ok(local_prep(
        comm,
        (s, w),
        move |(_, w)| {
            for (w, g) in w.iter_mut().zip(&g) {
                step_gradient(w, g, step);
            }
            step += 1;
        },
        |(s, w)| {
            let mut views: Vec<&mut [f32]> = w.iter_mut().map(|x| &mut x[..]).collect();
            s.sync(&mut views).map(|_| ())
        },
    ))
}

/// The sparse allreduces' local sum on an output of `n` elements: one node
/// unit of `n/100` distinct sorted pairs (random indices) added into the
/// output just cleared (untimed), as [`crate::sparse::hierarchical`] adds
/// the node units after clearing its result, with its bitset of the
/// result's indices (kept across calls, as in the collective's
/// workspace). Returns the probe and the unit's bytes.
pub(super) fn cold_add_probe(
    comm: &MpiComm,
    out: Rc<RefCell<Vec<f32>>>,
    seed: u64,
) -> (Probe<'_>, f64) {
    let n = out.borrow().len();
    let k = (n / 100).max(1);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut idx: Vec<u32> = rand::seq::index::sample(&mut rng, n, k)
        .into_iter()
        .map(|i| i as u32)
        .collect();
    idx.sort_unstable();
    let pairs: Vec<(u32, f32)> = idx.iter().map(|&i| (i, (i % 64) as f32 - 32.0)).collect();
    let unit = crate::sparse::hierarchical::encode_unit(&pairs, n, 1.0);
    let bytes = unit.len() as f64;
    // The bitset is kept and zeroed after the add, as the collective keeps
    // it in its workspace (`HierarchicalWorkspace`).
    let probe = local_prep(
        comm,
        (out, vec![0u64; n.div_ceil(64)]),
        |(out, _)| out.borrow_mut().fill(0.0),
        move |(out, seen)| {
            crate::sparse::hierarchical::add_unit(&unit, 0, n, &mut out.borrow_mut(), seen)?;
            std::hint::black_box(&*seen);
            seen.fill(0);
            Ok(())
        },
    );
    (probe, bytes)
}

/// Clearing an output of `out`'s length, every rank at once ([`local`]),
/// as the sparse allreduces clear their result once their messages are in.
/// (The buffer is shared with [`cold_add_probe`]: one allocation per size.)
pub(super) fn clear_probe(comm: &MpiComm, out: Rc<RefCell<Vec<f32>>>) -> Probe<'_> {
    local_prep(
        comm,
        out,
        |_| {},
        |out| {
            let mut out = out.borrow_mut();
            out.fill(0.0);
            std::hint::black_box(&mut *out);
            Ok(())
        },
    )
}

/// The layer sizes of the local fits, elements: 16K (64 KiB) up to
/// `max_bytes`, by factors of 2.
pub(super) fn sizes_up_to(max_bytes: usize) -> Vec<usize> {
    // Elements: 16K (64 KiB) .. max, by factors of 2.
    let mut v = Vec::new();
    let mut n = 16384usize;
    while 4 * n <= max_bytes {
        v.push(n);
        n *= 2;
    }
    v
}

/// xorshift64* uniform in (0, 1).
fn uniform(s: &mut u64) -> f64 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A synthetic gradient-like tensor of `n` elements: `dist` is `normal`,
/// `laplace` (scale 10⁻³) or `zeros`; the same `seed` gives the same data.
/// (`gradsync codecs --synthetic` and the calibration's probes.)
pub fn synthetic(n: usize, dist: &str, seed: u64) -> Result<Vec<f32>> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let scale = 1e-3;
    Ok(match dist {
        "zeros" => vec![0.0; n],
        "normal" => (0..n)
            .map(|_| {
                let (u, v) = (uniform(&mut s), uniform(&mut s));
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * scale) as f32
            })
            .collect(),
        "laplace" => (0..n)
            .map(|_| {
                let u = uniform(&mut s) - 0.5;
                (-u.signum() * (1.0 - 2.0 * u.abs()).ln() * scale) as f32
            })
            .collect(),
        d => {
            return Err(Error::InvalidArgument(format!(
                "unknown --dist {d:?} (normal, laplace, zeros)"
            )))
        }
    })
}

/// The gradient of step `step` for a benchmark or probe that has one
/// tensor `src` per layer: `src` rotated by the golden ratio's fraction of
/// its length per step, written to `dst` (same length). Successive steps
/// see different values with the same distribution, as training's
/// gradients differ from step to step. Feeding one gradient every step
/// made a sparse layer's residual accumulate it, and RGC's trimmed
/// selection grew slower with the step count (development VM, 4 Mi
/// elements, two processes: 1.6 ns an element at step 1, 2.0 by step 40,
/// 2.7 by step 100; rotated, 1.4–1.9 throughout), so a probe measured
/// whatever state its number of calls left, not a training step's.
///
/// ```
/// let src: Vec<f32> = (0..10).map(|i| i as f32).collect();
/// let mut dst = vec![0.0; 10];
/// gradsync::calibrate::step_gradient(&mut dst, &src, 0);
/// assert_eq!(dst, src);
/// gradsync::calibrate::step_gradient(&mut dst, &src, 1);
/// assert_eq!(dst[0], 6.0); // 10 × 0.618… = 6
/// let mut sorted = dst.clone();
/// sorted.sort_by(f32::total_cmp);
/// assert_eq!(sorted, src);
/// ```
pub fn step_gradient(dst: &mut [f32], src: &[f32], step: usize) {
    let n = src.len();
    if n == 0 {
        return;
    }
    let frac = (step as f64 * 0.618_033_988_749_895).fract();
    let off = ((frac * n as f64) as usize).min(n - 1);
    dst[..n - off].copy_from_slice(&src[off..]);
    dst[n - off..].copy_from_slice(&src[..off]);
}

/// Element-wise max over ranks of `v`, via MPI (harness bookkeeping, not timed).
pub(crate) fn max_over_ranks(comm: &MpiComm, v: &mut [f64]) {
    use mpi::collective::{CommunicatorCollectives, SystemOperation};
    let send = v.to_vec();
    comm.communicator()
        .all_reduce_into(&send[..], v, SystemOperation::max());
}

/// Seconds one pairwise exchange may take before larger messages stop
/// being measured ([`net_cap`]).
pub(super) const NET_PROBE_S: f64 = 0.05;

/// The largest network message worth measuring, bytes: sizes double from
/// 64 KiB up to `max_bytes` until one exchange (every pair at once, the
/// slowest rank's) takes [`NET_PROBE_S`]. Beyond it the messages are
/// bandwidth-bound, so the β curve is flat there (and the model extends
/// its last point); on a 1 Gbit/s link a 64 MiB message costs seconds per
/// call, and with every probe timed several times per round a 4-rank
/// calibration did not finish in 14 minutes. Collective: every rank
/// returns the same size.
pub(super) fn net_cap(comm: &MpiComm, max_bytes: usize) -> Result<usize> {
    let mut b = 64 << 10;
    while b < max_bytes {
        let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
        exchange_time(comm, &mut send, &mut recv, 0)?;
        let mut t = [exchange_time(comm, &mut send, &mut recv, 1)?];
        max_over_ranks(comm, &mut t);
        if t[0] > NET_PROBE_S {
            return Ok(b);
        }
        b *= 2;
    }
    Ok(max_bytes)
}

/// The network probes' message sizes, bytes: a few small messages for α,
/// then every power of two of the layer range (32 KiB up to `max_bytes`).
pub(super) fn net_sizes(max_bytes: usize) -> Vec<usize> {
    [3usize, 9, 12]
        .into_iter()
        .chain(15..=30)
        .map(|e| 1usize << e)
        .filter(|&b| b <= max_bytes.max(1 << 12))
        .collect()
}
