//! The calibration itself: the probes of both phases, their rounds, and
//! the fits that turn the measured means into a [`Profile`].

use super::check::{check_probes, compare, CHECK_SIZES};
use super::lowrank::{fit_powersgd, powersgd_probe};
use super::probes::{
    allgather_time, barrier_span, clear_probe, cold_add_probe, exchange_time, exchange_time_with,
    idle_exchange_time, layers_probe, local, net_cap, net_sizes, pairs, pingpong, pingpong_with,
    sizes_up_to, sparse_step_probe, step_probe, synthetic, Pairs, Probe, NET_PROBE_S,
};
use super::{phase, CalibrateOptions, Calibration, Progress};
use crate::codec::{CodecConfig, RgcMethod};
use crate::comm::{MpiComm, Transport};
use crate::cost::{self, CodecFit, CurvePoint, LinearFit, Profile, ProfileMeta, PROFILE_VERSION};
use crate::dense::{
    allgatherv, allreduce_with, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Gathered,
    Workspace,
};
use crate::Result;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

/// Largest layer of the local-cost probes (bytes).
const LOCAL_MAX_BYTES: usize = 16 << 20;

/// Tables of this many of the largest local layers also measure the dense
/// path's local cost (the `dense_local_curve` beyond one layer).
const DENSE_TABLES: [usize; 2] = [2, 4];
/// Smallest local layer (elements) whose clearing is timed for γ_clear:
/// 4 MiB (the `gamma_clear_curve` goes on to the 32 and 128 MiB outputs of
/// [`UNPACK_COLD_NS`]).
const CLEAR_MIN: usize = 1 << 20;
/// Outputs (elements) of the `gamma_unpack_curve` probes beyond the local
/// fits: 32 and 128 MiB, around ResNet-50's 97.5 MiB as one sparse group
/// (whatever `--max-bytes` says: the sparse allreduces' outputs are whole
/// groups, not messages; 160 MiB a rank).
const UNPACK_COLD_NS: [usize; 2] = [8 << 20, 32 << 20];

/// Measures and fits (the options are valid and agreed on): the sizes
/// ([`Sizes::new`]), the network phase ([`network_probes`]), the local
/// phase ([`local_probes_into`]), then the fits of the measured means.
pub(super) fn run(
    comm: &MpiComm,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Calibration> {
    let p = comm.size();
    let (densities, reps) = (&opts.densities[..], opts.reps);
    let sizes = Sizes::new(comm, opts.max_bytes)?;
    // Every measurement is a probe. Two phases of rounds: the network
    // probes, the allreduces and (with `check`) the check's, then the
    // local costs (see below).
    let mut probes: Vec<Probe<'_>> = Vec::new();
    let at = network_probes(comm, opts, &sizes, &mut probes)?;
    let (remote_med, nrounds) = phase(
        comm,
        &mut probes,
        reps,
        opts.min_seconds,
        1,
        "network",
        progress,
    )?;
    drop(probes);
    let mut local_probes: Vec<Probe<'_>> = Vec::new();
    let lat = local_probes_into(comm, densities, &sizes, &mut local_probes)?;
    let (mut local_med, local_rounds) = phase(
        comm,
        &mut local_probes,
        reps,
        0.0,
        3,
        "local costs",
        progress,
    )?;
    drop(local_probes);
    let base = local_med[lat.base_at];
    for m in &mut local_med {
        *m = (*m - base).max(*m * 0.1);
    }
    log::debug!("calibrate: {local_rounds} rounds of local costs (barriers {base:.3e} s)");
    log::debug!("calibrate: {nrounds} rounds");
    let net = fit_network(comm, &sizes, &at, &remote_med);
    let (gamma_reduce, gamma_reduce_curve) = fit_gamma_reduce(p, &sizes, &at, &net, &remote_med)?;
    let unpack = fit_unpack_clear(&sizes, &lat, &local_med);
    let (select, select_curve) = fit_select(densities, &sizes, &lat, &local_med);
    let codec_fits = fit_codecs(&sizes, &lat, &local_med);
    let (dense_local, dense_local_curve) = fit_dense_local(&sizes, &lat, &local_med);
    let local_parallelism = fit_parallelism(&lat, &local_med);
    let psg_times = &local_med[lat.psg_at..lat.psg_at + lat.psg_shapes.len()];
    let powersgd = fit_powersgd(&lat.psg_shapes, psg_times);
    // The credit last: the γ_reduce fit above subtracts the allreduces'
    // α-β part as they ran, back to back, on a link without credit.
    let mut inter_node = net.inter_node;
    if let Some(e) = inter_node.as_mut() {
        fit_burst(e, &at, &remote_med);
    }
    let profile = Profile {
        version: PROFILE_VERSION,
        alpha: net.alpha,
        beta: net.beta,
        gamma_reduce,
        gamma_unpack: unpack.gamma_unpack,
        gamma_clear: unpack.gamma_clear,
        gamma_clear_curve: unpack.gamma_clear_curve,
        beta_curve: net.beta_curve,
        gamma_reduce_curve,
        gamma_unpack_curve: unpack.gamma_unpack_curve,
        select,
        select_curve,
        codecs: codec_fits,
        dense_local,
        dense_local_curve,
        local_parallelism,
        powersgd,
        gradiveq_compress: LinearFit::default(),
        gradiveq_decompress: LinearFit::default(),
        pingpong: net.pingpong,
        allgather: net.allgather,
        inter_node,
        meta: rank0_meta(comm, &opts.note)?,
    };
    profile.validate()?;
    let check = if opts.check {
        Some(compare(
            p,
            &profile,
            &CHECK_SIZES,
            densities,
            &remote_med[at.check_at..],
        )?)
    } else {
        None
    };
    Ok(Calibration {
        profile,
        check,
        rounds: nrounds,
        local_rounds,
    })
}

/// Selection methods of the local sparse-step probes (4.).
const METHODS: [&str; 4] = ["trimmed", "threshold", "sampled", "exact"];
/// Codecs of the encode/decode probes (5.).
const CODECS: [&str; 6] = ["fp16", "int8", "qsgd", "sbc", "3lc", "fastsgd"];

/// The sizes every probe is made for, and the job's placement.
struct Sizes {
    /// Layer sizes (elements) up to `max_bytes`.
    ns: Vec<usize>,
    /// Layer sizes of the local fits (up to [`LOCAL_MAX_BYTES`]).
    lns: Vec<usize>,
    /// Largest network message (bytes).
    net_max: usize,
    /// Network message sizes (bytes).
    net_sizes: Vec<usize>,
    /// Network sizes measured (none at one rank).
    net: usize,
    /// Network sizes measured between nodes (none on one node).
    inter: usize,
    /// The exchanges' partners inside and between nodes.
    pairs: Pairs,
    /// The synthetic data of the allreduce and unpack probes.
    x: Vec<f32>,
}

impl Sizes {
    /// The sizes (collective: the network cap and the node map).
    fn new(comm: &MpiComm, max_bytes: usize) -> Result<Sizes> {
        let p = comm.size();
        let ns = sizes_up_to(max_bytes);
        // The local fits stop at 16 MiB layers: every probe owns its buffers
        // for the whole calibration, and at 64 MiB they took 5 GB per rank (a
        // p = 4 job on a 24 GB machine was killed); the per-element costs
        // have reached their memory-bound plateau well before.
        let lns = sizes_up_to(max_bytes.min(LOCAL_MAX_BYTES));
        // The network probes stop where one exchange takes NET_PROBE_S (a
        // slow network's large messages add nothing to the fits but minutes).
        let net_max = if p > 1 {
            net_cap(comm, max_bytes)?
        } else {
            max_bytes
        };
        if net_max < max_bytes && comm.rank() == 0 {
            log::info!(
                "calibrate: network messages up to {net_max} bytes (one exchange of that size \
                 takes over {NET_PROBE_S} s; the beta curve is flat beyond)"
            );
        }
        let net_sizes = net_sizes(net_max);
        let x = synthetic(ns.last().copied().unwrap_or(1 << 16), "normal", 1)?;
        let net = if p > 1 { net_sizes.len() } else { 0 };
        // On several nodes the exchanges pair ranks inside their
        // node, and one more set of probes times rank 0 with a rank of
        // another node, alone on the link: the profile's two levels.
        let pairs = pairs(&if p > 1 { comm.node_ids() } else { vec![0] }, comm.rank());
        if pairs.multi && comm.rank() == 0 {
            log::info!(
                "calibrate: the job spans several nodes (up to {} ranks per node): \
                 measuring inside a node and between nodes",
                pairs.ranks_per_node
            );
        }
        let inter = if pairs.multi { net } else { 0 };
        Ok(Sizes {
            ns,
            lns,
            net_max,
            net_sizes,
            net,
            inter,
            pairs,
            x,
        })
    }
}

/// Where the network phase's probes are, and what they measured at.
struct NetworkAt {
    /// The exchanges between nodes, then the ping-pongs between nodes.
    inter_at: usize,
    /// The allreduces, one per `reduce_ns`.
    reduce_at: usize,
    reduce_ns: Vec<usize>,
    /// The check's probes (`check`).
    check_at: usize,
    /// The exchanges between nodes after idling, one per `idle_sizes`.
    idle_at: usize,
    idle_sizes: Vec<usize>,
}

/// The network phase's probes, in order: ping-pongs, exchanges (inside a
/// node), exchanges and ping-pongs between nodes, allgathers, allreduces,
/// the check's, the exchanges after idling.
fn network_probes<'a>(
    comm: &'a MpiComm,
    opts: &CalibrateOptions,
    s: &Sizes,
    probes: &mut Vec<Probe<'a>>,
) -> Result<NetworkAt> {
    let p = comm.size();
    let (inter, net_sizes, pairs) = (s.inter, &s.net_sizes, &s.pairs);
    let inter_at = link_probes(comm, s, probes);
    // 2. γ_reduce: what the allreduce costs beyond its α-β part, per
    // reduced byte. Measured on gradsync's Rabenseifner allreduce over the
    // layer sizes (fresh data each time), minus its α-β part under the β
    // curve, fitted against the reduced bytes. This is the effective γ of
    // the reduction steps on this machine (cache effects included), which
    // a bare add loop in cache underestimates.
    let reduce_at = probes.len();
    let reduce_ns: Vec<usize> =
        s.ns.iter()
            .copied()
            .filter(|&n| p > 1 && 4 * n <= s.net_max)
            .collect();
    for &n in &reduce_ns {
        let (x, mut y, mut ws) = (s.x[..n].to_vec(), vec![0f32; n], Workspace::<f32>::new());
        probes.push(Box::new(move |_| {
            y.copy_from_slice(&x);
            comm.barrier()?;
            let t0 = mpi::time();
            let opts = AllreduceOptions {
                validate: false,
                ..AllreduceOptions::default()
            };
            allreduce_with(comm, &mut y, AllreduceAlgo::Rabenseifner, &opts, &mut ws)?;
            Ok(mpi::time() - t0)
        }));
    }
    // The network probes, the allreduces and the check's measurements
    // share rounds of a few hundred milliseconds for at least
    // `min_seconds`, so each gets dozens of samples from the same mix of
    // machine states. The local costs come after, in their own rounds (a
    // few seconds each at 16 MiB layers), with their own buffers: run
    // first, they left the network phase 2-3x slower than the same probes
    // in a `model-check` job (measured; a guess at the cause: these VMs
    // report freed memory to the host through virtio-balloon free page
    // reporting, and the gigabyte the local probes free comes back slower).
    let check_at = probes.len();
    if opts.check {
        probes.extend(check_probes(comm, &CHECK_SIZES, &opts.densities)?);
    }
    // 1b. The link's burst credit (several nodes only): the exchanges
    // across it again, each after the link has idled (as it does through a
    // training step's forward and backward pass).
    let idle_at = probes.len();
    let idle_sizes: Vec<usize> = net_sizes[..inter]
        .iter()
        .copied()
        .filter(|&b| b >= 16 << 10)
        .collect();
    for &b in &idle_sizes {
        let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
        let peer = pairs.inter;
        probes.push(Box::new(move |r| {
            idle_exchange_time(comm, peer, &mut send, &mut recv, r)
        }));
    }
    Ok(NetworkAt {
        inter_at,
        reduce_at,
        reduce_ns,
        check_at,
        idle_at,
        idle_sizes,
    })
}

/// α and β (1.). Three measurements over sizes: ping-pong between ranks 0
/// and 1 (one-way latency and bandwidth), pairwise exchange (sendrecv
/// both ways at once) and the recursive-doubling allgather. The
/// collectives the model describes are sequences of exchanges, which a
/// ping-pong does not measure (both directions at once), and the
/// allgather adds a copy of the rank's own block; so `alpha` and `beta`
/// are fitted to the exchanges, and the other two fits are kept in the
/// profile for reference. The β curve is the exchanges' per-byte cost
/// at each size from 4 KiB up, `(T(m) − α)/m`. Returns where the probes
/// between nodes start.
fn link_probes<'a>(comm: &'a MpiComm, s: &Sizes, probes: &mut Vec<Probe<'a>>) -> usize {
    let (net, inter, net_sizes, pairs) = (s.net, s.inter, &s.net_sizes, &s.pairs);
    for &b in &net_sizes[..net] {
        let mut buf = vec![0u8; b];
        probes.push(Box::new(move |_| pingpong(comm, &mut buf)));
    }
    for &b in &net_sizes[..net] {
        let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
        let peer = pairs.intra;
        let multi = pairs.multi;
        probes.push(Box::new(move |r| {
            if multi {
                exchange_time_with(comm, peer, &mut send, &mut recv, r)
            } else {
                exchange_time(comm, &mut send, &mut recv, r)
            }
        }));
    }
    let inter_at = probes.len();
    for &b in &net_sizes[..inter] {
        let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
        let peer = pairs.inter;
        probes.push(Box::new(move |r| {
            exchange_time_with(comm, peer, &mut send, &mut recv, r)
        }));
    }
    for &b in &net_sizes[..inter] {
        let mut buf = vec![0u8; b];
        let peer = pairs.inter;
        probes.push(Box::new(move |_| pingpong_with(comm, peer, &mut buf)));
    }
    for &b in &net_sizes[..net] {
        let (mut send, mut g) = (vec![0u8; b], Gathered::default());
        probes.push(Box::new(move |r| {
            allgather_time(comm, &mut send, &mut g, r)
        }));
    }
    inter_at
}

/// Where the local phase's probes are, and what they measured at.
struct LocalAt {
    /// γ_unpack's probes (from 0): the units' bytes, one per local size.
    unit_bytes: Vec<f64>,
    /// The clearing probes, one per `clear_ns`.
    clear_at: usize,
    clear_ns: Vec<usize>,
    /// The cold unpacks, one per [`UNPACK_COLD_NS`], and their units' bytes.
    cold_at: usize,
    cold_bytes: Vec<f64>,
    /// The sparse steps: per `select_names` entry, one per local size.
    select_at: usize,
    select_names: Vec<(String, f64)>,
    /// The codecs: per codec and local size, encode then decode; the
    /// bytes per element each measured at the largest size.
    codec_at: usize,
    codec_bpe: Vec<f64>,
    /// The dense steps, one per `dense_tables` entry (layers, elements).
    dense_at: usize,
    dense_tables: Vec<(usize, usize)>,
    /// The layer-parallel local phase, then the same one after another.
    par_at: usize,
    /// PowerSGD's step of one layer, one per `psg_shapes` entry (rows,
    /// columns, rank).
    psg_at: usize,
    psg_shapes: Vec<(usize, usize, usize)>,
    /// The barriers around every local probe.
    base_at: usize,
}

/// The local phase's probes, in order (3. to 8.).
fn local_probes_into<'a>(
    comm: &'a MpiComm,
    densities: &[f64],
    s: &Sizes,
    local_probes: &mut Vec<Probe<'a>>,
) -> Result<LocalAt> {
    let unit_bytes = unpack_probes(comm, s, local_probes)?;
    let (clear_at, clear_ns, cold_at, cold_bytes) = clear_probes(comm, s, local_probes);
    let (select_at, select_names) = select_probes(comm, densities, s, local_probes)?;
    let (codec_at, codec_bpe) = codec_probes(comm, s, local_probes)?;
    let lns = &s.lns;
    // 6. The engine's local cost of a dense layer (fusing, momentum,
    // unfusing): one layer of each size, then tables of 2 and 4 of the
    // largest (a whole model's table exceeds the last-level cache, where
    // the cost per element is ~1.6x that of a cached layer: measured).
    let dense_at = local_probes.len();
    let top = lns.last().copied().unwrap_or(1 << 16);
    let dense_tables: Vec<(usize, usize)> = lns
        .iter()
        .map(|&n| (1, n))
        .chain(DENSE_TABLES.iter().map(|&k| (k, top)))
        .collect();
    for &(k, n) in &dense_tables {
        local_probes.push(step_probe(comm, crate::sync::Strategy::Dense, k, n)?);
    }
    // 7. The speedup of the engine's layer-parallel local phase: eight RGC
    // layers sharing the largest size, in parallel and one after another.
    let par_at = local_probes.len();
    let par_n = (lns.last().copied().unwrap_or(1 << 16) / 8).max(1);
    let par_codec = CodecConfig::Rgc {
        density: densities[0],
        method: RgcMethod::Trimmed,
    };
    for parallel in [true, false] {
        local_probes.push(layers_probe(comm, par_codec.clone(), 8, par_n, parallel)?);
    }
    // 9. PowerSGD's local step of one layer (its products and the error
    // kept, as the engine's `powersgd_s` times it) at ranks 1, 2 and 4 on
    // matrices of 256 Ki, 1 Mi and up to 8 Mi elements (32 MiB): its cost per element
    // grows with the layer as the matrices leave the caches (on the
    // development VM, two ranks at once at rank 2: 1.7-1.8 ns at 256 Ki,
    // 1.8-2.0 at 1 Mi, 2.0-2.4 at 4 Mi), which the step model follows as a curve
    // (`cost::PowerSgdFit::curve`). One size alone mispriced whole
    // models: in-cache probes under-predicted ResNet-50 and LSTM steps by
    // 10-30 %, the 8 Mi probe over-predicted ResNet-50's (layers of at
    // most 2.4 M elements) by 9-21 % in seven runs.
    let psg_at = local_probes.len();
    let big = (top / 1024).clamp(16, 8192);
    // (Each size once: a small `--max-bytes` makes the largest one of the
    // fixed two, or smaller.)
    let psg_shapes: Vec<(usize, usize, usize)> = [(256, 1024), (1024, 1024)]
        .into_iter()
        .filter(|&(rows, cols)| rows * cols < 1024 * big)
        .chain([(1024, big)])
        .flat_map(|(rows, cols)| [1, 2, 4].map(|r| (rows, cols, r)))
        .collect();
    for &(rows, cols, r) in &psg_shapes {
        local_probes.push(powersgd_probe(comm, &s.x, rows, cols, r)?);
    }
    // 8. The barriers around every local probe, subtracted from each.
    let base_at = local_probes.len();
    local_probes.push(barrier_span(comm));
    Ok(LocalAt {
        unit_bytes,
        clear_at,
        clear_ns,
        cold_at,
        cold_bytes,
        select_at,
        select_names,
        codec_at,
        codec_bpe,
        dense_at,
        dense_tables,
        par_at,
        psg_at,
        psg_shapes,
        base_at,
    })
}

/// γ_unpack (3.): scatter-add of RGC units (1% of the elements), per unit
/// byte, over the layer sizes; the units' bytes.
fn unpack_probes<'a>(
    comm: &'a MpiComm,
    s: &Sizes,
    local_probes: &mut Vec<Probe<'a>>,
) -> Result<Vec<f64>> {
    let mut unit_bytes = Vec::new();
    for &n in &s.lns {
        let k = (n / 100).max(1);
        let mut codec = CodecConfig::Rgc {
            density: k as f64 / n as f64,
            method: RgcMethod::Exact,
        }
        .build()?;
        let mut unit = Vec::new();
        codec.encode(&s.x[..n], &mut unit)?;
        unit_bytes.push(unit.len() as f64);
        let mut y = vec![0f32; n];
        local_probes.push(local(comm, move || codec.decode_add(&unit, &mut y)));
    }
    Ok(unit_bytes)
}

/// 3b. γ_clear: clearing a dense output (what the sparse allreduces pay
/// before summing into it), every rank at once, per byte, from 4 MiB up
/// to 128 MiB: the `gamma_clear_curve`, past the last-level cache and
/// past the size where memset switches to non-temporal stores (which
/// halves the cost per byte on the project's VMs).
/// 3c. γ_unpack on outputs far past the caches, just cleared: what the
/// sparse allreduces pay to sum the received pairs into a whole group.
/// The two largest outputs are shared by 3b and 3c. Returns where the
/// clearing probes start and their sizes, where the cold unpacks start
/// and their units' bytes.
fn clear_probes<'a>(
    comm: &'a MpiComm,
    s: &Sizes,
    local_probes: &mut Vec<Probe<'a>>,
) -> (usize, Vec<usize>, usize, Vec<f64>) {
    let clear_at = local_probes.len();
    let cold: Vec<Rc<RefCell<Vec<f32>>>> = UNPACK_COLD_NS
        .iter()
        .map(|&n| Rc::new(RefCell::new(vec![1f32; n])))
        .collect();
    let local_clear: Vec<usize> = s.lns.iter().copied().filter(|&n| n >= CLEAR_MIN).collect();
    for &n in &local_clear {
        local_probes.push(clear_probe(comm, Rc::new(RefCell::new(vec![1f32; n]))));
    }
    for out in &cold {
        local_probes.push(clear_probe(comm, out.clone()));
    }
    let clear_ns: Vec<usize> = local_clear.into_iter().chain(UNPACK_COLD_NS).collect();
    let cold_at = local_probes.len();
    let mut cold_bytes = Vec::new();
    for (i, out) in cold.iter().enumerate() {
        let (probe, bytes) = cold_add_probe(comm, out.clone(), 7 + i as u64);
        local_probes.push(probe);
        cold_bytes.push(bytes);
    }
    (clear_at, clear_ns, cold_at, cold_bytes)
}

/// Local cost (4.) of a sparse step per selection method and density:
/// where the probes start, and per method and density its name.
fn select_probes<'a>(
    comm: &'a MpiComm,
    densities: &[f64],
    s: &Sizes,
    local_probes: &mut Vec<Probe<'a>>,
) -> Result<(usize, Vec<(String, f64)>)> {
    let select_at = local_probes.len();
    let mut select_names = Vec::new();
    for &d in densities {
        let mut cfgs: Vec<(String, CodecConfig)> = METHODS
            .iter()
            .map(|m| {
                let method: RgcMethod =
                    serde_json::from_value(serde_json::json!(m)).expect("method names parse");
                (m.to_string(), CodecConfig::Rgc { density: d, method })
            })
            .collect();
        cfgs.push(("quant".into(), CodecConfig::RgcQuant { density: d }));
        for (name, cfg) in cfgs {
            for &n in &s.lns {
                local_probes.push(sparse_step_probe(comm, cfg.clone(), n)?);
            }
            select_names.push((name, d));
        }
    }
    Ok((select_at, select_names))
}

/// Codecs (5.): encode / decode fits and measured size: where the probes
/// start, and each codec's bytes per element at the largest size.
fn codec_probes<'a>(
    comm: &'a MpiComm,
    s: &Sizes,
    local_probes: &mut Vec<Probe<'a>>,
) -> Result<(usize, Vec<f64>)> {
    let codec_at = local_probes.len();
    let mut codec_bpe = Vec::new();
    for name in CODECS {
        let cfg: CodecConfig = name.parse()?;
        let mut bpe = 0.0;
        for &n in &s.lns {
            let xn = synthetic(n, "normal", 7)?;
            let mut enc = cfg.build()?;
            let mut msg = Vec::new();
            enc.encode(&xn, &mut msg)?;
            bpe = (msg.len() as f64 - 12.0).max(0.0) / n as f64;
            let dec = cfg.build()?;
            let mut acc = vec![0f32; n];
            let mut out = Vec::new();
            local_probes.push(local(comm, move || enc.encode(&xn, &mut out)));
            local_probes.push(local(comm, move || dec.decode_add(&msg, &mut acc)));
        }
        codec_bpe.push(bpe);
    }
    Ok((codec_at, codec_bpe))
}

/// The network's fits: α, β and the β curve (inside a node), the level
/// between nodes, and the ping-pong and allgather fits kept for reference.
struct NetworkFit {
    alpha: f64,
    beta: f64,
    beta_curve: Vec<cost::CurvePoint>,
    inter_node: Option<cost::NetLevel>,
    pingpong: LinearFit,
    allgather: LinearFit,
}

/// One network level (α, β and the β curve from 4 KiB up) from rows
/// `(1, bytes, seconds)`.
fn level(rows: &[(f64, f64, f64)]) -> cost::NetLevel {
    let (alpha, beta) = cost::fit_relative_l2(rows);
    let curve: Vec<cost::CurvePoint> = rows
        .iter()
        .filter(|r| r.1 >= 4096.0)
        .map(|&(_, b, t)| cost::CurvePoint {
            bytes: b,
            per_byte: ((t - alpha) / b).max(0.0),
        })
        .collect();
    cost::NetLevel {
        alpha,
        beta,
        beta_curve: curve,
        oneway_curve: Vec::new(),
        burst: None,
    }
}

/// Fit the network phase's ping-pongs, exchanges and allgathers (1.).
fn fit_network(comm: &MpiComm, s: &Sizes, at: &NetworkAt, remote_med: &[f64]) -> NetworkFit {
    let p = comm.size();
    let (net, inter, net_sizes) = (s.net, s.inter, &s.net_sizes);
    let (mut pp_rows, mut ex_rows, mut ag_rows) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &b) in net_sizes[..net].iter().enumerate() {
        let (pp, ex, ag) = (
            remote_med[i],
            remote_med[net + i],
            remote_med[2 * net + 2 * inter + i],
        );
        log::debug!(
            "calibrate: {b} B ping-pong {pp:.3e} s, exchange {ex:.3e} s, allgather {ag:.3e} s"
        );
        let bf = b as f64;
        pp_rows.push((1.0, bf, pp));
        ex_rows.push((1.0, bf, ex));
        ag_rows.push((cost::ceil_lg(p), (p as f64 - 1.0) * bf, ag));
    }
    let inter_at = at.inter_at;
    let inter_node = s.pairs.multi.then(|| {
        let rows: Vec<(f64, f64, f64)> = net_sizes[..inter]
            .iter()
            .enumerate()
            .map(|(i, &b)| (1.0, b as f64, remote_med[inter_at + i]))
            .collect();
        log::debug!("calibrate: between nodes {rows:?}");
        let mut e = level(&rows);
        // One-way: the ping-pong across the link, half its round trip.
        e.oneway_curve = net_sizes[..inter]
            .iter()
            .enumerate()
            .filter(|(_, &b)| b >= 4096)
            .map(|(i, &b)| cost::CurvePoint {
                bytes: b as f64,
                per_byte: ((remote_med[inter_at + inter + i] - e.alpha) / b as f64).max(0.0),
            })
            .collect();
        let slow = e.two_way_slowdown().filter(|&(_, x)| x > 1.5);
        if let Some((bytes, x)) = slow.filter(|_| comm.rank() == 0) {
            log::warn!(
                "calibrate: between nodes a two-way exchange of {bytes} B moves each byte \
                 {x:.1}x slower than one-way traffic: the transport runs the two directions \
                 one after the other (with Open MPI over TCP, set \
                 OMPI_MCA_btl_tcp_rdma_pipeline_frag_size=131072; docs/running.md)"
            );
        }
        e
    });
    // Every node holds one rank: nothing was measured inside a node, and
    // the one level is the link.
    let intra = match (&inter_node, s.pairs.any_intra) {
        (Some(e), false) => e.clone(),
        _ => level(&ex_rows),
    };
    let fit = |rows: &[(f64, f64, f64)]| {
        let (a, b) = cost::fit_relative_l2(rows);
        LinearFit { a, b }
    };
    NetworkFit {
        alpha: intra.alpha,
        beta: intra.beta,
        beta_curve: intra.beta_curve,
        inter_node,
        pingpong: fit(&pp_rows),
        allgather: fit(&ag_rows),
    }
}

/// γ_reduce and its curve from the allreduces (2.), by the size of the
/// largest reduced message (half the vector): what each allreduce costs
/// beyond its α-β part per reduced byte at that size. Large vectors
/// reduce and copy at memory speed, small ones in cache; one constant
/// fitted over both would charge a 100 MB model's fused buffer the cache
/// rate.
fn fit_gamma_reduce(
    p: usize,
    s: &Sizes,
    at: &NetworkAt,
    net: &NetworkFit,
    remote_med: &[f64],
) -> Result<(f64, Vec<cost::CurvePoint>)> {
    let mut rows = Vec::new();
    let mut gamma_reduce_curve = Vec::new();
    if p > 1 {
        let mut no_gamma = Profile::from_network(net.alpha, 1.0 / net.beta.max(1e-300), 0.0, 0.0)?;
        no_gamma.beta_curve = net.beta_curve.clone();
        no_gamma.inter_node = net.inter_node.clone();
        let mut unit_gamma = no_gamma.clone();
        unit_gamma.gamma_reduce = 1.0;
        // The allreduce's α-β part on this job's placement (two levels
        // when it spans nodes).
        let raben = |prof: &Profile, bytes: f64| {
            let net = cost::topology::Net::new(prof, p, Some(s.pairs.ranks_per_node), None);
            if net.two_level() {
                cost::topology::rabenseifner(&net, bytes)
            } else {
                cost::dense_rabenseifner(prof, bytes, p)
            }
        };
        for (i, &n) in at.reduce_ns.iter().enumerate() {
            let (bytes, t) = ((4 * n) as f64, remote_med[at.reduce_at + i]);
            log::debug!("calibrate: rabenseifner allreduce {bytes} B {t:.3e} s");
            let ab = raben(&no_gamma, bytes);
            let per = raben(&unit_gamma, bytes) - ab;
            rows.push((0.0, per, (t - ab).max(t * 1e-3)));
            if per > 0.0 {
                gamma_reduce_curve.push(cost::CurvePoint {
                    bytes: bytes / 2.0,
                    per_byte: ((t - ab) / per).max(0.0),
                });
            }
        }
    }
    Ok((cost::fit_relative_l2(&rows).1, gamma_reduce_curve))
}

/// The link's burst credit (1b.) from the exchanges after idling.
fn fit_burst(e: &mut cost::NetLevel, at: &NetworkAt, remote_med: &[f64]) {
    let rows: Vec<(f64, f64)> = at
        .idle_sizes
        .iter()
        .enumerate()
        .map(|(i, &b)| (b as f64, remote_med[at.idle_at + i]))
        .collect();
    log::debug!("calibrate: between nodes after idling {rows:?}");
    e.burst = super::burst::fit(e, &rows);
}

/// γ_unpack, γ_clear and their curves (3., 3b., 3c.).
struct UnpackFit {
    gamma_unpack: f64,
    gamma_unpack_curve: Vec<cost::CurvePoint>,
    gamma_clear: f64,
    gamma_clear_curve: Vec<cost::CurvePoint>,
}

/// Fit the unpack and clearing probes (3., 3b., 3c.).
fn fit_unpack_clear(s: &Sizes, lat: &LocalAt, local_med: &[f64]) -> UnpackFit {
    let rows: Vec<(f64, f64, f64)> = lat
        .unit_bytes
        .iter()
        .enumerate()
        .map(|(i, &u)| (0.0, u, local_med[i]))
        .collect();
    let gamma_unpack = cost::fit_relative_l2(&rows).1;
    let rows: Vec<(f64, f64, f64)> = lat
        .clear_ns
        .iter()
        .enumerate()
        .map(|(i, &n)| (0.0, (4 * n) as f64, local_med[lat.clear_at + i]))
        .collect();
    let mut gamma_unpack_curve = Vec::new();
    if let Some(&last) = s.lns.last() {
        gamma_unpack_curve.push(cost::CurvePoint {
            bytes: (4 * last) as f64,
            per_byte: gamma_unpack,
        });
        for (i, &n) in UNPACK_COLD_NS.iter().enumerate() {
            let t = local_med[lat.cold_at + i];
            if n > last && t > 0.0 && t.is_finite() {
                gamma_unpack_curve.push(cost::CurvePoint {
                    bytes: (4 * n) as f64,
                    per_byte: t / lat.cold_bytes[i],
                });
            }
        }
    }
    log::debug!("calibrate: unpack curve: {gamma_unpack_curve:?}");
    log::debug!("calibrate: clear: {rows:?}");
    let gamma_clear = cost::fit_relative_l2(&rows).1;
    let gamma_clear_curve: Vec<cost::CurvePoint> = rows
        .iter()
        .filter(|&&(_, _, t)| t > 0.0 && t.is_finite())
        .map(|&(_, bytes, t)| cost::CurvePoint {
            bytes,
            per_byte: t / bytes,
        })
        .collect();
    UnpackFit {
        gamma_unpack,
        gamma_unpack_curve,
        gamma_clear,
        gamma_clear_curve,
    }
}

/// The selection fits per method and density (4.): `name@density`, and
/// `name` alone at the first density.
fn fit_select(densities: &[f64], s: &Sizes, lat: &LocalAt, local_med: &[f64]) -> SelectFits {
    let lns = &s.lns;
    let (mut select, mut curves) = (BTreeMap::new(), BTreeMap::new());
    for (c, (name, d)) in lat.select_names.iter().enumerate() {
        let pts: Vec<(f64, f64)> = lns
            .iter()
            .enumerate()
            .map(|(i, &n)| (n as f64, local_med[lat.select_at + c * lns.len() + i]))
            .collect();
        log::debug!("calibrate: select {name}@{d}: {pts:?}");
        let fit = LinearFit::fit(&pts);
        let curve: Vec<CurvePoint> = pts
            .iter()
            .filter(|(_, t)| *t > 0.0 && t.is_finite())
            .map(|&(n, t)| CurvePoint {
                bytes: 4.0 * n,
                per_byte: t / (4.0 * n),
            })
            .collect();
        if *d == densities[0] {
            select.insert(name.clone(), fit);
            curves.insert(name.clone(), curve.clone());
        }
        select.insert(format!("{name}@{d}"), fit);
        curves.insert(format!("{name}@{d}"), curve);
    }
    (select, curves)
}

/// The selection fits and curves by key (`trimmed`, `trimmed@0.001`, ...):
/// `Profile::select` and `Profile::select_curve`.
type SelectFits = (
    BTreeMap<String, LinearFit>,
    BTreeMap<String, Vec<CurvePoint>>,
);

/// The codecs' encode and decode fits and, for the data-dependent ones,
/// their measured bytes per element (5.).
fn fit_codecs(s: &Sizes, lat: &LocalAt, local_med: &[f64]) -> BTreeMap<String, CodecFit> {
    let lns = &s.lns;
    let mut codec_fits = BTreeMap::new();
    for (c, name) in CODECS.iter().enumerate() {
        let base = lat.codec_at + 2 * c * lns.len();
        let (mut enc, mut dec) = (Vec::new(), Vec::new());
        for (i, &n) in lns.iter().enumerate() {
            enc.push((n as f64, local_med[base + 2 * i]));
            dec.push((n as f64, local_med[base + 2 * i + 1]));
        }
        let data_dependent = matches!(*name, "3lc" | "fastsgd");
        codec_fits.insert(
            name.to_string(),
            CodecFit {
                encode: LinearFit::fit(&enc),
                decode: LinearFit::fit(&dec),
                bytes_per_element: data_dependent.then_some(lat.codec_bpe[c]),
            },
        );
    }
    codec_fits
}

/// The dense path's local cost (6.): the fit over one layer of each size,
/// and the curve per byte over the tables.
fn fit_dense_local(
    s: &Sizes,
    lat: &LocalAt,
    local_med: &[f64],
) -> (LinearFit, Vec<cost::CurvePoint>) {
    let dense_pts: Vec<(f64, f64)> = s
        .lns
        .iter()
        .enumerate()
        .map(|(i, &n)| (n as f64, local_med[lat.dense_at + i]))
        .collect();
    log::debug!("calibrate: dense local: {dense_pts:?}");
    let dense_local = LinearFit::fit(&dense_pts);
    let mut dense_local_curve: Vec<cost::CurvePoint> = Vec::new();
    for (i, &(k, n)) in lat.dense_tables.iter().enumerate() {
        let (bytes, t) = ((4 * k * n) as f64, local_med[lat.dense_at + i]);
        if t > 0.0 && t.is_finite() && dense_local_curve.last().is_none_or(|c| c.bytes < bytes) {
            dense_local_curve.push(cost::CurvePoint {
                bytes,
                per_byte: t / bytes,
            });
        }
    }
    log::debug!("calibrate: dense local curve: {dense_local_curve:?}");
    (dense_local, dense_local_curve)
}

/// The layer-parallel local phase's speedup (7.), in `[0.25, 64]` (1 when
/// not measured).
fn fit_parallelism(lat: &LocalAt, local_med: &[f64]) -> f64 {
    let (par, ser) = (local_med[lat.par_at], local_med[lat.par_at + 1]);
    let local_parallelism = if par > 0.0 && ser > 0.0 {
        (ser / par).clamp(0.25, 64.0)
    } else {
        1.0
    };
    log::debug!("calibrate: 8 layers' local phase {ser:.3e} s serial, {par:.3e} s parallel");
    local_parallelism
}

/// The profile's [`ProfileMeta`] as rank 0 sees it (host, CPU, MPI library,
/// date), so that every rank returns the same profile.
fn rank0_meta(comm: &MpiComm, note: &str) -> Result<ProfileMeta> {
    let mine = ProfileMeta {
        machine: machine(),
        mpi: mpi::environment::library_version()
            .unwrap_or_default()
            .trim_end_matches('\0')
            .to_string(),
        date: date(),
        ranks: comm.size(),
        note: note.to_string(),
    };
    let enc = if comm.rank() == 0 {
        serde_json::to_vec(&mine)?
    } else {
        Vec::new()
    };
    let g = allgatherv(comm, &enc, AllgathervAlgo::RecursiveDoubling)?;
    Ok(serde_json::from_slice(g.message(0))?)
}

fn machine() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::fs::read_to_string("/proc/cpuinfo").map_or(0, |s| {
        s.lines().filter(|l| l.starts_with("processor")).count()
    });
    format!("{host}: {cpu}, {cores} cores")
}

fn date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let s = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}
