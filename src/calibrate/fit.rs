//! The calibration itself: the rounds of both phases' probes (made by
//! [`super::plan`]) and the fits that turn the measured means into a
//! [`Profile`].

use super::check::{compare, CHECK_SIZES};
use super::lowrank::fit_powersgd;
use super::plan::{
    local_probes_into, network_probes, LocalAt, NetworkAt, Sizes, CODECS, UNPACK_COLD_NS,
};
use super::probes::Probe;
use super::{phase, CalibrateOptions, Calibration, Progress};
use crate::comm::agree::agree;
use crate::comm::{MpiComm, Transport};
use crate::cost::{self, CodecFit, CurvePoint, LinearFit, Profile, ProfileMeta, PROFILE_VERSION};
use crate::dense::{allgatherv, AllgathervAlgo};
use crate::Result;
use std::collections::BTreeMap;

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
    // Made on every rank alike; an error in one rank's (an allocation the
    // engine refused) is every rank's, before the rounds' barriers.
    let at = agree(comm, network_probes(comm, opts, &sizes, &mut probes))?;
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
    let lat = agree(
        comm,
        local_probes_into(comm, densities, &sizes, &mut local_probes),
    )?;
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
    let select_table = fit_select_table(densities[0], &lat, &local_med);
    let psg_times = &local_med[lat.psg_at..lat.psg_at + lat.psg_shapes.len()];
    let psg_table_times =
        &local_med[lat.psg_table_at..lat.psg_table_at + lat.psg_table_shapes.len()];
    let powersgd = fit_powersgd(
        &lat.psg_shapes,
        psg_times,
        &lat.psg_table_shapes,
        psg_table_times,
        lat.table_elems,
    );
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
        select_table,
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

/// The sparse tables' cost per byte by layer size (7b.): each table's
/// time over its gradients' bytes; `None` without a table.
fn fit_select_table(density: f64, lat: &LocalAt, local_med: &[f64]) -> Option<cost::SelectTable> {
    let bytes = 4.0 * lat.table_elems as f64;
    let curve: Vec<CurvePoint> = lat
        .table_ns
        .iter()
        .enumerate()
        .map(|(i, &n)| (n, local_med[lat.table_at + i]))
        .filter(|(_, t)| *t > 0.0 && t.is_finite())
        .map(|(n, t)| CurvePoint {
            bytes: 4.0 * n as f64,
            per_byte: t / bytes,
        })
        .collect();
    log::debug!("calibrate: sparse tables of {bytes} B: {curve:?}");
    (!curve.is_empty()).then(|| cost::SelectTable {
        key: format!("trimmed@{density}"),
        table_bytes: bytes,
        curve,
    })
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
