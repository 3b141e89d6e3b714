//! Probes of the machine's state beside a job's own measurements, each
//! against what its profile's calibration measured of the same: the
//! development VMs move between states for seconds at a time (their vCPUs
//! between core complexes, for one), and a profile describes the state
//! its calibration ran in. `bench --op step` times these in its steps'
//! rounds, so that its records say whether a miss of the step model is
//! the machine's state or the model's: the network's (exchanges) or the
//! local phases' (a whole table's dense and RGC engine steps, whose cost
//! per element moved by 15-20 % between jobs minutes apart on one VM).

use super::probes::{exchange_time, layers_probe, step_probe, Probe, BURST};
use crate::codec::{CodecConfig, RgcMethod};
use crate::comm::{MpiComm, Transport};
use crate::cost::{curve_at, Profile};
use crate::sync::Strategy;
use crate::Result;

/// One state probe and the profile's price of it.
pub(crate) struct StateProbe<'a> {
    /// `exchange`: a pairwise `sendrecv` between ranks 2i and 2i+1, as
    /// the calibration's exchanges on one node. `dense-table`: one engine
    /// step of four dense layers (fusing, momentum, unfusing) on every
    /// rank at once, in process, as the calibration's largest dense
    /// table. `rgc-table`: one engine step of RGC layers one after
    /// another, as the calibration's sparse table of its largest layers.
    pub probe: &'static str,
    /// Bytes each way (`exchange`), or of the table's gradients.
    pub size: usize,
    /// The profile's price: `α + β(m)·m`; the local tables' cost per
    /// byte at their size (`dense_local_curve`, `select_table`), which
    /// is what the calibration measured of the same table.
    pub profile_s: f64,
    run: Probe<'a>,
}

impl StateProbe<'_> {
    /// A short warm burst, as the calibration's rounds run a probe (one
    /// untimed call, then three timed): their median. Collective.
    pub(crate) fn measure(&mut self, round: usize) -> Result<f64> {
        let base = round * (BURST + 1);
        (self.run)(base)?;
        let mut t = [0f64; BURST];
        for (b, x) in t.iter_mut().enumerate() {
            *x = (self.run)(base + b + 1)?;
        }
        Ok(super::median(&mut t))
    }
}

/// The state probes `prof` can price, the same on every rank: exchanges
/// of 64 KiB and of the largest size its calibration measured, up to
/// 16 MiB (its exchanges stop where one takes 50 ms: 4 MiB at 1 Gbit/s),
/// on more than one rank (none on one); then the local tables
/// ([`local_probes`]). Collective only in the probes' runs.
pub(crate) fn state_probes<'a>(comm: &'a MpiComm, prof: &Profile) -> Result<Vec<StateProbe<'a>>> {
    let mut v = Vec::new();
    if comm.size() > 1 {
        let top = prof
            .beta_curve
            .iter()
            .map(|c| c.bytes as usize)
            .max()
            .unwrap_or(LONG);
        let long = top.clamp(SHORT, LONG);
        let sizes = if long > SHORT {
            vec![SHORT, long]
        } else {
            vec![SHORT]
        };
        for b in sizes {
            let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
            let m = b as f64;
            v.push(StateProbe {
                probe: "exchange",
                size: b,
                profile_s: prof.alpha + m * prof.beta_at(m),
                run: Box::new(move |r| exchange_time(comm, &mut send, &mut recv, r)),
            });
        }
    }
    v.extend(local_probes(comm, prof)?);
    Ok(v)
}

/// The largest local tables `prof`'s calibration timed, each priced at
/// what it measured: the dense path's (the last point of
/// `dense_local_curve`, a table of four layers) and the RGC tables' of
/// their largest layer size (`select_table`). A profile without them
/// (older, or from a small `--max-bytes`) has none, nor one whose table
/// is past [`TABLE_MAX_BYTES`] or whose RGC density is out of (0, 1]
/// (not one `calibrate` wrote: the probe would hold several such tables
/// a rank).
fn local_probes<'a>(comm: &'a MpiComm, prof: &Profile) -> Result<Vec<StateProbe<'a>>> {
    let mut v = Vec::new();
    let in_range = |bytes: f64| bytes > 0.0 && bytes <= TABLE_MAX_BYTES;
    if let Some(last) = prof.dense_local_curve.last().filter(|l| in_range(l.bytes)) {
        let table = last.bytes as usize / 4;
        let n = table / DENSE_LAYERS;
        if n > 0 {
            let bytes = (4 * DENSE_LAYERS * n) as f64;
            v.push(StateProbe {
                probe: "dense-table",
                size: 4 * DENSE_LAYERS * n,
                profile_s: bytes * curve_at(&prof.dense_local_curve, 0.0, bytes),
                run: step_probe(comm, Strategy::Dense, DENSE_LAYERS, n)?,
            });
        }
    }
    let rgc = prof.select_table.as_ref().and_then(|t| {
        let density = t.key.strip_prefix("trimmed@")?.parse::<f64>().ok()?;
        let last = t.curve.last()?;
        if !(density > 0.0 && density <= 1.0 && in_range(t.table_bytes) && in_range(last.bytes)) {
            return None;
        }
        let n = last.bytes as usize / 4;
        let layers = (t.table_bytes / last.bytes) as usize;
        (n > 0 && layers > 0).then_some((density, n, layers, last.per_byte, t.table_bytes))
    });
    if let Some((density, n, layers, per_byte, table_bytes)) = rgc {
        let codec = CodecConfig::Rgc {
            density,
            method: RgcMethod::Trimmed,
        };
        v.push(StateProbe {
            probe: "rgc-table",
            size: 4 * n * layers,
            profile_s: per_byte * table_bytes,
            run: layers_probe(comm, codec, layers, n, false)?,
        });
    }
    Ok(v)
}

/// Layers of the dense table probe: the calibration's largest dense
/// table has four (`DENSE_TABLES`); its price is by the table's bytes.
const DENSE_LAYERS: usize = 4;

/// The largest local table probed beside the steps, bytes: the
/// calibration's tables are 64 MiB at most.
const TABLE_MAX_BYTES: f64 = (64 << 20) as f64;

/// The short exchange, bytes.
const SHORT: usize = 64 << 10;

/// The longest exchange, bytes.
const LONG: usize = 16 << 20;
