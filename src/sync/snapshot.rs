//! Engine state snapshots: residuals, momentum, delay accumulators, codec
//! state, the delay window's weights and the step counter, per rank, as a
//! versioned bincode file.
//!
//! A run stopped after step `t` and restored from its snapshots continues
//! bitwise as the uninterrupted run: everything that shapes later messages is
//! in the file, and the file is checked against the engine it is loaded into
//! (format version, rank, size, layer table hash, layer names and lengths).
//!
//! Integrity: the file is the bincode payload followed by the
//! CRC-32 (IEEE, `crc32fast`) of the payload, u32 LE, so one flipped bit
//! anywhere is caught; every loaded float (residuals, momentum, delay
//! accumulators, density) must be finite; every error names the file.
//! Loading is collective ([`GradSync::load_snapshot`]): each rank parses and
//! validates its own file, the ranks agree on the outcome, and only then is
//! anything applied, so a corrupt snapshot on one rank fails every rank
//! alike and leaves every engine as it was (no replica silently drifts).

use super::{GradSync, Layer};
use crate::comm::agree::CallKind;
use crate::comm::Transport;
use crate::{Error, Result};
use bincode::Options;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Version of the snapshot format (4: the run's identity; 5: the delay
/// window's weights).
pub const SNAPSHOT_VERSION: u32 = 5;
/// Bytes of the CRC-32 trailer.
const CRC_LEN: usize = 4;
/// The largest step a snapshot may hold (2^53: a step a microsecond for
/// 285 years); past it the counter is corrupt, and stepping on would wrap.
const MAX_STEP: u64 = 1 << 53;
const MAGIC: [u8; 8] = *b"GSSNAP\0\0";

#[derive(Serialize, Deserialize)]
struct Snapshot {
    magic: [u8; 8],
    version: u32,
    rank: u64,
    size: u64,
    table_hash: u64,
    step: u64,
    layers: Vec<LayerSnap>,
    /// The run that wrote it ([`GradSync`]'s `run`): a restore's ranks
    /// must all load snapshots of one run.
    run: u64,
    /// `delay > 1`: the next step starts a delay window.
    window_start: bool,
}

/// Two values as one hash (FNV-1a of both, little-endian).
fn mix(a: u64, b: u64) -> u64 {
    use super::table::{fnv, FNV_OFFSET};
    fnv(fnv(FNV_OFFSET, &a.to_le_bytes()), &b.to_le_bytes())
}

/// A fresh run identity: random (the standard library's per-process
/// random hash keys, and the clock), never 0.
pub(super) fn new_run_id() -> u64 {
    use std::hash::BuildHasher;
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new()
        .hash_one((t, std::process::id()))
        .max(1)
}

/// A parsed and validated snapshot, ready to apply.
struct Restored {
    snap: Snapshot,
    codecs: Codecs,
    gvqs: Gvqs,
    psgs: Psgs,
}

/// Each layer's rebuilt codec (`None`: a layer without one).
type Codecs = Vec<Option<Box<dyn crate::codec::Codec>>>;
/// Each layer's restored GradiVeQ state (`None`: not a GradiVeQ layer).
type Gvqs = Vec<Option<crate::gradiveq::schedule::GradiveqLayer>>;
/// Each layer's restored PowerSGD state (`None`: not compressed by it).
type Psgs = Vec<Option<crate::powersgd::PowerSgd>>;

#[derive(Serialize, Deserialize)]
struct LayerSnap {
    name: String,
    n: u64,
    residual: Vec<f32>,
    momentum: Vec<f32>,
    acc: Vec<f32>,
    /// The weights at the start of the delay window (`delay > 1`).
    window_weights: Vec<f32>,
    codec_state: Vec<u8>,
    cur_density: Option<f64>,
    /// The low-rank state (bincode), by the layer's strategy: GradiVeQ's
    /// schedule and compressors, or PowerSGD's `Q`, error and draws.
    gradiveq: Option<Vec<u8>>,
}

impl LayerSnap {
    /// A snapshot holds finite values only: checked when writing (never
    /// write what cannot be loaded, e.g. a residual that overflowed) and
    /// when loading.
    fn check_finite(&self) -> Result<()> {
        for (what, v) in [
            ("residual", &self.residual),
            ("momentum", &self.momentum),
            ("delay accumulator", &self.acc),
            ("delay window's weights", &self.window_weights),
        ] {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Error::Snapshot(format!(
                    "layer {:?}: {what}[{i}] is {} (a snapshot holds finite values only)",
                    self.name, v[i]
                )));
            }
        }
        Ok(())
    }
}

fn options(limit: u64) -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .with_limit(limit)
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// The state as snapshot bytes.
    pub fn snapshot_bytes(&self) -> Result<Vec<u8>> {
        if self.pending() {
            return Err(Error::InvalidArgument(
                "cannot snapshot between start and wait".into(),
            ));
        }
        let snap = Snapshot {
            magic: MAGIC,
            version: SNAPSHOT_VERSION,
            rank: self.rank as u64,
            size: self.size as u64,
            table_hash: self.reg.table_hash,
            step: self.step,
            layers: self
                .reg
                .layers
                .iter()
                .map(|l: &Layer| LayerSnap {
                    name: l.name.clone(),
                    n: l.n as u64,
                    residual: l.v.clone(),
                    momentum: l.u.clone(),
                    acc: l.acc.clone(),
                    window_weights: l.wc.clone(),
                    codec_state: l.codec.as_ref().map_or_else(Vec::new, |c| c.state()),
                    cur_density: l.cur_density,
                    gradiveq: None,
                })
                .collect(),
            run: self.run,
            window_start: self.window.start,
        };
        // Never write what cannot be loaded: a residual that overflowed (a
        // gradient near f32::MAX) would make the file unusable.
        for ls in &snap.layers {
            ls.check_finite()?;
        }
        let mut snap = snap;
        for (ls, l) in snap.layers.iter_mut().zip(&self.reg.layers) {
            if let Some(g) = &l.gvq {
                ls.gradiveq = Some(
                    options(u64::MAX)
                        .serialize(g)
                        .map_err(|e| Error::Snapshot(format!("encoding GradiVeQ state: {e}")))?,
                );
            }
            if let Some(p) = &l.psg {
                ls.gradiveq = Some(
                    options(u64::MAX)
                        .serialize(&p.snapshot())
                        .map_err(|e| Error::Snapshot(format!("encoding PowerSGD state: {e}")))?,
                );
            }
        }
        let mut bytes = options(u64::MAX)
            .serialize(&snap)
            .map_err(|e| Error::Snapshot(format!("encoding: {e}")))?;
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        Ok(bytes)
    }

    /// Restore from [`snapshot_bytes`](Self::snapshot_bytes). Collective:
    /// every rank calls it with its own bytes; the engine must have the same
    /// layer table, rank and size. If any rank's bytes are bad, every rank
    /// returns the same [`Error::RankFailed`] naming that rank and the cause,
    /// and every engine is unchanged.
    pub fn restore_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.restore_agreed("the snapshot", |s| s.parse_snapshot(bytes))
    }

    /// Take part in a restore carrying a failure the caller found before it
    /// had a snapshot to give (a binding's path of the wrong type): every
    /// rank's restore fails alike with [`Error::RankFailed`] naming this
    /// rank and `err`, and no engine changes. Returns that error.
    pub fn fail_restore(&mut self, err: Error) -> Error {
        let msg = err.to_string();
        match self.restore_agreed("no snapshot", move |_| Err(Error::Snapshot(msg))) {
            Err(e) => e,
            Ok(()) => Error::InvalidArgument("a failed restore succeeded".into()),
        }
    }

    /// Parse and validate locally, agree across ranks, then apply.
    /// The snapshots' steps are compared in the same agreement: ranks
    /// restored to different steps would run different plans (warm-up,
    /// delay) and refuse each other's messages, or drift apart silently
    /// where no message carries the step (dense layers). `what` names the
    /// source in that error.
    fn restore_agreed(
        &mut self,
        what: &str,
        parse: impl FnOnce(&Self) -> Result<Restored>,
    ) -> Result<()> {
        if self.pending() {
            // This rank's own step is pending: no peer waits for this call.
            return Err(Error::InvalidArgument(
                "cannot restore between start and wait".into(),
            ));
        }
        // `Auto` layers get their strategies (and codec state) once the
        // table is complete; a restore completes it (collective, as this is).
        self.check_table()?;
        let local = parse(self);
        let status = local.as_ref().map(|_| ()).map_err(|e| match e {
            Error::Snapshot(m) => Error::Snapshot(m.clone()),
            e => Error::Snapshot(e.to_string()),
        });
        // Every rank passes a value (a failed rank's is not compared: the
        // failure wins), so every rank runs the same collective.
        let (step, run) = local.as_ref().map_or((0, 0), |r| (r.snap.step, r.snap.run));
        let print = (
            mix(step, run),
            format!(
                "snapshots from different steps or runs: rank {}'s ({what}) is at step {step} \
                 of run {run:016x}, another rank's is not",
                self.rank
            ),
        );
        self.agree_status(CallKind::Restore, status, print)?;
        self.apply_snapshot(local?);
        Ok(())
    }

    /// The rank-local half of a restore: everything that can fail.
    fn parse_snapshot(&self, bytes: &[u8]) -> Result<Restored> {
        let snap = decode_snapshot(bytes)?;
        self.check_snapshot(&snap)?;
        let (codecs, gvqs) = self.restored_states(&snap)?;
        let psgs = self.restored_powersgd(&snap)?;
        Ok(Restored {
            snap,
            codecs,
            gvqs,
            psgs,
        })
    }

    /// Whether `snap` was written by this rank of an engine with this
    /// engine's options and layer table, and holds values it can take.
    fn check_snapshot(&self, snap: &Snapshot) -> Result<()> {
        // (Magic and version were checked above: a payload shorter than
        // 12 bytes does not decode.)
        if snap.step > MAX_STEP {
            return Err(Error::Snapshot(format!(
                "step {} is past any run (at most {MAX_STEP}): corrupt",
                snap.step
            )));
        }
        if snap.rank != self.rank as u64 || snap.size != self.size as u64 {
            return Err(Error::Snapshot(format!(
                "written by rank {} of {}, loading on rank {} of {}",
                snap.rank, snap.size, self.rank, self.size
            )));
        }
        if snap.table_hash != self.reg.table_hash || snap.layers.len() != self.reg.layers.len() {
            // The one option whose default changed under existing
            // snapshots: they hash "allgather": "recdbl". Said only where
            // that is the difference.
            let legacy = snap.table_hash == self.reg.legacy_hash
                && snap.layers.len() == self.reg.layers.len()
                && !self
                    .cfg
                    .allgather
                    .is(crate::dense::AllgathervAlgo::RecursiveDoubling);
            let hint = if legacy {
                " (this one was written with \"allgather\": \"recdbl\", the default before \"auto\": load it with that option)"
            } else {
                ""
            };
            return Err(Error::Snapshot(format!(
                "written for another layer table or other options{hint}"
            )));
        }
        for s in &snap.layers {
            s.check_finite()?;
            if let Some(d) = s
                .cur_density
                .filter(|d| !(d.is_finite() && *d > 0.0 && *d <= 1.0))
            {
                return Err(Error::Snapshot(format!(
                    "layer {:?}: density {d} outside (0, 1]",
                    s.name
                )));
            }
        }
        for (s, l) in snap.layers.iter().zip(&self.reg.layers) {
            let ok = s.name == l.name
                && s.n == l.n as u64
                && s.residual.len() == l.v.len()
                && s.momentum.len() == l.u.len()
                && s.acc.len() == l.acc.len()
                && s.window_weights.len() == l.wc.len();
            if !ok {
                return Err(Error::Snapshot(format!(
                    "layer {:?} does not match the registered layer {:?}",
                    s.name, l.name
                )));
            }
        }
        Ok(())
    }

    /// The layers' codec and GradiVeQ states rebuilt from `snap`: the only
    /// part of a restore that can still fail after the checks.
    fn restored_states(&self, snap: &Snapshot) -> Result<(Codecs, Gvqs)> {
        let mut codecs = Vec::with_capacity(self.reg.layers.len());
        for (s, l) in snap.layers.iter().zip(&self.reg.layers) {
            codecs.push(match &l.codec {
                Some(c) => {
                    let mut c2 = c.config().build()?;
                    if let Some(d) = s.cur_density {
                        c2.set_density(d).ok();
                    }
                    c2.set_state(&s.codec_state).map_err(|e| {
                        Error::Snapshot(format!("layer {:?}: codec state: {e}", s.name))
                    })?;
                    Some(c2)
                }
                None => None,
            });
        }
        let mut gvqs = Vec::with_capacity(self.reg.layers.len());
        for (s, l) in snap.layers.iter().zip(&self.reg.layers) {
            if matches!(l.strategy, super::Strategy::Powersgd(_)) {
                // Its bytes are PowerSGD's (`restored_powersgd`).
                gvqs.push(None);
                continue;
            }
            gvqs.push(match (&s.gradiveq, &l.strategy) {
                (Some(bytes), super::Strategy::Gradiveq(cfg)) => {
                    let g: crate::gradiveq::schedule::GradiveqLayer = options(bytes.len() as u64)
                        .deserialize(bytes)
                        .map_err(|e| {
                            Error::Snapshot(format!("layer {:?}: GradiVeQ state: {e}", s.name))
                        })?;
                    g.validate(l.n, cfg)
                        .map_err(|e| Error::Snapshot(format!("layer {:?}: {e}", s.name)))?;
                    Some(g)
                }
                (None, super::Strategy::Gradiveq(_)) => {
                    return Err(Error::Snapshot(format!(
                        "layer {:?}: the snapshot holds no GradiVeQ state, and the layer's \
                         strategy is gradiveq",
                        s.name
                    )))
                }
                (Some(_), other) => {
                    // Saved under GradiVeQ or PowerSGD (or an `auto`
                    // that chose one), restored under another strategy.
                    return Err(Error::Snapshot(format!(
                        "layer {:?}: the snapshot holds low-rank (GradiVeQ or PowerSGD) \
                         state, but the layer's strategy is now {}",
                        s.name,
                        other.label()
                    )));
                }
                (None, _) => None,
            });
        }
        Ok((codecs, gvqs))
    }

    /// The PowerSGD layers' states from `snap`: a layer PowerSGD
    /// compresses must have one that fits it, any other none.
    fn restored_powersgd(&self, snap: &Snapshot) -> Result<Psgs> {
        let mut out = Vec::with_capacity(self.reg.layers.len());
        for (s, l) in snap.layers.iter().zip(&self.reg.layers) {
            let bad =
                |why: String| Error::Snapshot(format!("layer {:?}: PowerSGD state: {why}", s.name));
            out.push(match (&s.gradiveq, &l.psg) {
                (Some(bytes), Some(cur)) => {
                    let st: crate::powersgd::PowerSgdSnapshot = options(bytes.len() as u64)
                        .deserialize(bytes)
                        .map_err(|e| bad(e.to_string()))?;
                    let mut p = cur.clone();
                    p.restore(&st).map_err(|e| bad(e.to_string()))?;
                    Some(p)
                }
                (None, Some(_)) => {
                    return Err(bad("missing (the layer's strategy is powersgd)".into()))
                }
                (Some(_), None) if matches!(l.strategy, super::Strategy::Powersgd(_)) => {
                    return Err(bad("present, for a layer PowerSGD leaves dense".into()))
                }
                _ => None,
            });
        }
        Ok(out)
    }

    /// Apply a validated restore (cannot fail).
    fn apply_snapshot(&mut self, r: Restored) {
        let Restored {
            snap,
            codecs,
            gvqs,
            psgs,
        } = r;
        // The fill estimate is not in the snapshot: a restored run starts
        // from the independent-selection estimate, as a fresh engine does.
        self.tuner.reset();
        for ((((s, l), c), g), ps) in snap
            .layers
            .into_iter()
            .zip(&mut self.reg.layers)
            .zip(codecs)
            .zip(gvqs)
            .zip(psgs)
        {
            if g.is_some() {
                l.gvq = g;
            }
            if ps.is_some() {
                l.psg = ps;
            }
            l.v = s.residual;
            l.u = s.momentum;
            l.acc = s.acc;
            l.wc = s.window_weights;
            l.cur_density = s.cur_density;
            if c.is_some() {
                l.codec = c;
            }
        }
        self.step = snap.step;
        self.window.start = snap.window_start;
        self.window.kept = false;
        self.window.diverged = None;
        // A new branch of the restored run: the loaded identity mixed with
        // this job's (alike on every rank). Two jobs restored from the same
        // files then write different identities, so a mix of their later
        // snapshots is refused too.
        self.run = mix(snap.run, self.run);
    }

    /// Write the snapshot to `path` (atomically: a temporary file renamed
    /// over it). Use one file per rank, e.g. `ckpt/gradsync.rank3.snap`.
    /// Local (no communication): each rank writes its own file.
    pub fn save_snapshot(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.snapshot_bytes()?;
        crate::error::write_replacing(path, &bytes)
            .map_err(|e| Error::Snapshot(format!("{}: {e}", path.display())))
    }

    /// Restore from a file written by [`save_snapshot`](Self::save_snapshot).
    /// Collective, like [`restore_bytes`](Self::restore_bytes): a missing,
    /// corrupt or mismatched file on any rank fails every rank alike (the
    /// error names the rank and the file) and changes no engine.
    pub fn load_snapshot(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.restore_agreed(&path.display().to_string(), |s| {
            let named = |e: String| Error::Snapshot(format!("{}: {e}", path.display()));
            // A FIFO would block this rank in open() while its peers wait
            // in the agreement, and a device (/dev/zero) never ends.
            if let Some(kind) = crate::error::special_file(path) {
                return Err(named(format!(
                    "not a regular file ({kind}): not a gradsync snapshot"
                )));
            }
            let bytes = std::fs::read(path).map_err(|e| named(e.to_string()))?;
            s.parse_snapshot(&bytes).map_err(|e| match e {
                Error::Snapshot(m) => Error::Snapshot(format!("{}: {m}", path.display())),
                e => Error::Snapshot(format!("{}: {e}", path.display())),
            })
        })
    }
}

/// A snapshot file's bytes decoded: the checksum, the magic and the
/// format version checked first, each failure named.
fn decode_snapshot(bytes: &[u8]) -> Result<Snapshot> {
    if bytes.len() < CRC_LEN {
        return Err(Error::Snapshot(format!(
            "{} bytes: truncated (not a gradsync snapshot)",
            bytes.len()
        )));
    }
    let (payload, crc) = bytes.split_at(bytes.len() - CRC_LEN);
    let want = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    if crc32fast::hash(payload) != want {
        return Err(Error::Snapshot(
            "checksum mismatch: the file is corrupt or truncated (or from a gradsync \
                 older than snapshot format 3, which had no checksum)"
                .into(),
        ));
    }
    // Magic and version first (bytes 0..12): an older format's payload
    // would otherwise fail the full decode as "truncated".
    if payload.len() >= 12 {
        if payload[..8] != MAGIC {
            return Err(Error::Snapshot("not a gradsync snapshot".into()));
        }
        let version = u32::from_le_bytes(payload[8..12].try_into().expect("4 bytes"));
        if version != SNAPSHOT_VERSION {
            return Err(Error::Snapshot(format!(
                "format version {version} (this build reads {SNAPSHOT_VERSION})"
            )));
        }
    }
    options(payload.len() as u64)
        .deserialize(payload)
        .map_err(|e| {
            let why = match *e {
                // bincode's message for a length past the data is
                // empty ("io error: ").
                bincode::ErrorKind::Io(ref io)
                    if io.kind() == std::io::ErrorKind::UnexpectedEof =>
                {
                    "a length field runs past the end of the data".to_string()
                }
                ref e => e.to_string(),
            };
            Error::Snapshot(format!("corrupt or truncated: {why}"))
        })
}
