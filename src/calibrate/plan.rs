//! Which probes a calibration runs, at which sizes: the sizes every probe
//! is made for ([`Sizes`]), the network phase's probes (pairwise exchanges,
//! allgathers and allreduces, the link between nodes) and the local
//! phase's (selection, codecs, unpacking, clearing, the dense path's
//! local cost and PowerSGD), each a closure timed in shuffled rounds by
//! [`super::fit::run`]. Turning the measured times into a profile is
//! [`super::fit`]'s.

use super::check::{check_probes, CHECK_SIZES};
use super::lowrank::{powersgd_probe, powersgd_table_probe};
use super::probes::{
    allgather_time, barrier_span, clear_probe, cold_add_probe, exchange_time, exchange_time_with,
    idle_exchange_time, layers_probe, local, net_cap, net_sizes, pairs, pingpong, pingpong_with,
    sizes_up_to, sparse_step_probe, step_probe, synthetic, Pairs, Probe, NET_PROBE_S,
};
use super::CalibrateOptions;
use crate::codec::{CodecConfig, RgcMethod};
use crate::comm::{MpiComm, Transport};
use crate::dense::{allreduce_with, AllreduceAlgo, AllreduceOptions, Gathered, Workspace};
use crate::Result;
use std::cell::RefCell;
use std::rc::Rc;

/// Largest layer of the local-cost probes (bytes).
const LOCAL_MAX_BYTES: usize = 16 << 20;

/// Tables of this many of the largest local layers also measure the dense
/// path's local cost (the `dense_local_curve` beyond one layer).
const DENSE_TABLES: [usize; 2] = [2, 4];
/// Layer sizes (elements) of the sparse tables (7b.): RGC layers of one
/// size, one after another, in a table of [`SPARSE_TABLE_MAX`] elements at
/// most (four of the largest local layer, as the dense tables).
/// Three sizes, as each table holds its gradients, their source and the
/// residuals (about 200 MiB a rank) until the local phase ends.
const SPARSE_TABLE_NS: [usize; 3] = [1 << 14, 1 << 18, 1 << 22];
/// The sparse tables' largest size (elements): 64 MiB of gradients, past
/// the last-level caches of the machines this is for.
const SPARSE_TABLE_MAX: usize = 1 << 24;
/// Their smallest (elements): 32 MiB. Smaller tables (a small
/// `--max-bytes`) could stay in the caches, and are not run.
const SPARSE_TABLE_MIN: usize = 1 << 23;
/// Smallest local layer (elements) whose clearing is timed for γ_clear:
/// 4 MiB (the `gamma_clear_curve` goes on to the 32 and 128 MiB outputs of
/// [`UNPACK_COLD_NS`]).
const CLEAR_MIN: usize = 1 << 20;
/// Outputs (elements) of the `gamma_unpack_curve` probes beyond the local
/// fits: 32 and 128 MiB, around ResNet-50's 97.5 MiB as one sparse group
/// (whatever `--max-bytes` says: the sparse allreduces' outputs are whole
/// groups, not messages; 160 MiB a rank).
pub(super) const UNPACK_COLD_NS: [usize; 2] = [8 << 20, 32 << 20];

/// Selection methods of the local sparse-step probes (4.).
const METHODS: [&str; 4] = ["trimmed", "threshold", "sampled", "exact"];
/// Codecs of the encode/decode probes (5.).
pub(super) const CODECS: [&str; 6] = ["fp16", "int8", "qsgd", "sbc", "3lc", "fastsgd"];

/// The sizes every probe is made for, and the job's placement.
pub(super) struct Sizes {
    /// Layer sizes (elements) up to `max_bytes`.
    pub(super) ns: Vec<usize>,
    /// Layer sizes of the local fits (up to [`LOCAL_MAX_BYTES`]).
    pub(super) lns: Vec<usize>,
    /// Largest network message (bytes).
    pub(super) net_max: usize,
    /// Network message sizes (bytes).
    pub(super) net_sizes: Vec<usize>,
    /// Network sizes measured (none at one rank).
    pub(super) net: usize,
    /// Network sizes measured between nodes (none on one node).
    pub(super) inter: usize,
    /// The exchanges' partners inside and between nodes.
    pub(super) pairs: Pairs,
    /// The synthetic data of the allreduce and unpack probes.
    pub(super) x: Vec<f32>,
}

impl Sizes {
    /// The sizes (collective: the network cap and the node map).
    pub(super) fn new(comm: &MpiComm, max_bytes: usize) -> Result<Sizes> {
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
pub(super) struct NetworkAt {
    /// The exchanges between nodes, then the ping-pongs between nodes.
    pub(super) inter_at: usize,
    /// The allreduces, one per `reduce_ns`.
    pub(super) reduce_at: usize,
    pub(super) reduce_ns: Vec<usize>,
    /// The check's probes (`check`).
    pub(super) check_at: usize,
    /// The exchanges between nodes after idling, one per `idle_sizes`.
    pub(super) idle_at: usize,
    pub(super) idle_sizes: Vec<usize>,
}

/// The network phase's probes, in order: ping-pongs, exchanges (inside a
/// node), exchanges and ping-pongs between nodes, allgathers, allreduces,
/// the check's, the exchanges after idling.
pub(super) fn network_probes<'a>(
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
pub(super) struct LocalAt {
    /// γ_unpack's probes (from 0): the units' bytes, one per local size.
    pub(super) unit_bytes: Vec<f64>,
    /// The clearing probes, one per `clear_ns`.
    pub(super) clear_at: usize,
    pub(super) clear_ns: Vec<usize>,
    /// The cold unpacks, one per [`UNPACK_COLD_NS`], and their units' bytes.
    pub(super) cold_at: usize,
    pub(super) cold_bytes: Vec<f64>,
    /// The sparse steps: per `select_names` entry, one per local size.
    pub(super) select_at: usize,
    pub(super) select_names: Vec<(String, f64)>,
    /// The codecs: per codec and local size, encode then decode; the
    /// bytes per element each measured at the largest size.
    pub(super) codec_at: usize,
    pub(super) codec_bpe: Vec<f64>,
    /// The dense steps, one per `dense_tables` entry (layers, elements).
    pub(super) dense_at: usize,
    pub(super) dense_tables: Vec<(usize, usize)>,
    /// The layer-parallel local phase, then the same one after another.
    pub(super) par_at: usize,
    /// The sparse tables, one per `table_ns` entry (layers of that many
    /// elements), `table_elems` elements each.
    pub(super) table_at: usize,
    pub(super) table_ns: Vec<usize>,
    pub(super) table_elems: usize,
    /// PowerSGD's step of one layer, one per `psg_shapes` entry (rows,
    /// columns, rank).
    pub(super) psg_at: usize,
    pub(super) psg_shapes: Vec<(usize, usize, usize)>,
    /// The same on tables of `table_elems` elements, one per
    /// `psg_table_shapes` entry.
    pub(super) psg_table_at: usize,
    pub(super) psg_table_shapes: Vec<(usize, usize, usize)>,
    /// The barriers around every local probe.
    pub(super) base_at: usize,
}

/// The local phase's probes, in order (3. to 8.).
pub(super) fn local_probes_into<'a>(
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
    // 7b. A sparse layer's local cost in a whole model's step: tables of
    // RGC layers of one size, one after another (the parallel speedup
    // above divides them as it divides a step's), so that each layer finds
    // its data out of the caches, pushed out by the others', as in a step.
    // The one-layer probes of 4. find them in the caches: on one VM they
    // priced ResNet-50's RGC step at 2.7 ns an element where it took 4.6,
    // and 64 layers of 256 Ki elements at 2.7 where they took 3.4
    // (`cost::SelectTable`).
    let table_at = local_probes.len();
    let table_elems = (DENSE_TABLES[DENSE_TABLES.len() - 1] * top).min(SPARSE_TABLE_MAX);
    let table_ns: Vec<usize> = SPARSE_TABLE_NS
        .into_iter()
        .filter(|&n| table_elems >= SPARSE_TABLE_MIN && 2 * n <= table_elems)
        .collect();
    for &n in &table_ns {
        let layers = table_elems / n;
        local_probes.push(layers_probe(comm, par_codec.clone(), layers, n, false)?);
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
    // 9b. The same in a whole model's step: tables of the smallest and
    // largest rank-2 shapes that fit twice in the sparse tables' size
    // (as 7b., and only where those run; 256 MiB a table and rank).
    let psg_table_at = local_probes.len();
    let rank2: Vec<(usize, usize, usize)> = psg_shapes
        .iter()
        .copied()
        .filter(|&(rows, cols, r)| r == 2 && 2 * rows * cols <= table_elems)
        .collect();
    let psg_table_shapes: Vec<(usize, usize, usize)> = match (rank2.first(), rank2.last()) {
        _ if table_ns.is_empty() => Vec::new(),
        (Some(&a), Some(&b)) if a != b => vec![a, b],
        (Some(&a), _) => vec![a],
        _ => Vec::new(),
    };
    for &shape in &psg_table_shapes {
        let layers = table_elems / (shape.0 * shape.1);
        local_probes.push(powersgd_table_probe(comm, &s.x, shape, layers)?);
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
        table_at,
        table_ns,
        table_elems,
        psg_at,
        psg_shapes,
        psg_table_at,
        psg_table_shapes,
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
