//! Engine state snapshots: residuals, momentum, delay accumulators, codec
//! state and the step counter, per rank, as a versioned bincode file.
//!
//! A run stopped after step `t` and restored from its snapshots continues
//! bitwise as the uninterrupted run: everything that shapes later messages is
//! in the file, and the file is checked against the engine it is loaded into
//! (format version, rank, size, layer table hash, layer names and lengths).

use super::{GradSync, Layer};
use crate::comm::Transport;
use crate::{Error, Result};
use bincode::Options;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Version of the snapshot format.
pub const SNAPSHOT_VERSION: u32 = 2;
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
}

#[derive(Serialize, Deserialize)]
struct LayerSnap {
    name: String,
    n: u64,
    residual: Vec<f32>,
    momentum: Vec<f32>,
    acc: Vec<f32>,
    codec_state: Vec<u8>,
    cur_density: Option<f64>,
    /// GradiVeQ schedule and compressors (bincode), for GradiVeQ layers.
    gradiveq: Option<Vec<u8>>,
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
        if self.started.is_some() {
            return Err(Error::InvalidArgument(
                "cannot snapshot between start and wait".into(),
            ));
        }
        let snap = Snapshot {
            magic: MAGIC,
            version: SNAPSHOT_VERSION,
            rank: self.rank as u64,
            size: self.size as u64,
            table_hash: self.table_hash,
            step: self.step,
            layers: self
                .layers
                .iter()
                .map(|l: &Layer| LayerSnap {
                    name: l.name.clone(),
                    n: l.n as u64,
                    residual: l.v.clone(),
                    momentum: l.u.clone(),
                    acc: l.acc.clone(),
                    codec_state: l.codec.as_ref().map_or_else(Vec::new, |c| c.state()),
                    cur_density: l.cur_density,
                    gradiveq: None,
                })
                .collect(),
        };
        let mut snap = snap;
        for (ls, l) in snap.layers.iter_mut().zip(&self.layers) {
            if let Some(g) = &l.gvq {
                ls.gradiveq = Some(
                    options(u64::MAX)
                        .serialize(g)
                        .map_err(|e| Error::Snapshot(format!("encoding GradiVeQ state: {e}")))?,
                );
            }
        }
        options(u64::MAX)
            .serialize(&snap)
            .map_err(|e| Error::Snapshot(format!("encoding: {e}")))
    }

    /// Restore from [`snapshot_bytes`](Self::snapshot_bytes). The engine must
    /// have the same layer table, rank and size; on any error it is unchanged.
    pub fn restore_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        if self.started.is_some() {
            return Err(Error::InvalidArgument(
                "cannot restore between start and wait".into(),
            ));
        }
        let snap: Snapshot = options(bytes.len() as u64)
            .deserialize(bytes)
            .map_err(|e| Error::Snapshot(format!("corrupt or truncated: {e}")))?;
        if snap.magic != MAGIC {
            return Err(Error::Snapshot("not a gradsync snapshot".into()));
        }
        if snap.version != SNAPSHOT_VERSION {
            return Err(Error::Snapshot(format!(
                "format version {} (this build reads {SNAPSHOT_VERSION})",
                snap.version
            )));
        }
        if snap.rank != self.rank as u64 || snap.size != self.size as u64 {
            return Err(Error::Snapshot(format!(
                "written by rank {} of {}, loading on rank {} of {}",
                snap.rank, snap.size, self.rank, self.size
            )));
        }
        if snap.table_hash != self.table_hash || snap.layers.len() != self.layers.len() {
            return Err(Error::Snapshot(
                "written for another layer table or other options".into(),
            ));
        }
        for (s, l) in snap.layers.iter().zip(&self.layers) {
            let ok = s.name == l.name
                && s.n == l.n as u64
                && s.residual.len() == l.v.len()
                && s.momentum.len() == l.u.len()
                && s.acc.len() == l.acc.len();
            if !ok {
                return Err(Error::Snapshot(format!(
                    "layer {:?} does not match the registered layer {:?}",
                    s.name, l.name
                )));
            }
        }
        // Codec state first: it is the only part that can still fail.
        let mut codecs = Vec::with_capacity(self.layers.len());
        for (s, l) in snap.layers.iter().zip(&self.layers) {
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
        let mut gvqs = Vec::with_capacity(self.layers.len());
        for (s, l) in snap.layers.iter().zip(&self.layers) {
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
                (None, super::Strategy::Gradiveq(_)) | (Some(_), _) => {
                    return Err(Error::Snapshot(format!(
                        "layer {:?}: GradiVeQ state does not match the layer's strategy",
                        s.name
                    )))
                }
                (None, _) => None,
            });
        }
        for (((s, l), c), g) in snap
            .layers
            .into_iter()
            .zip(&mut self.layers)
            .zip(codecs)
            .zip(gvqs)
        {
            if g.is_some() {
                l.gvq = g;
            }
            l.v = s.residual;
            l.u = s.momentum;
            l.acc = s.acc;
            l.cur_density = s.cur_density;
            if c.is_some() {
                l.codec = c;
            }
        }
        self.step = snap.step;
        Ok(())
    }

    /// Write the snapshot to `path` (atomically: a temporary file renamed
    /// over it). Use one file per rank, e.g. `ckpt/gradsync.rank3.snap`.
    pub fn save_snapshot(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.snapshot_bytes()?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    /// Restore from a file written by [`save_snapshot`](Self::save_snapshot).
    pub fn load_snapshot(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let bytes = std::fs::read(path)?;
        self.restore_bytes(&bytes)
    }
}
