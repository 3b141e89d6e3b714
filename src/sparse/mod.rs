//! The sparse-collective layer: per-layer packed units fused into one message
//! per rank and exchanged by ONE variable-length allgather (RedSync §5.3 and
//! Algorithm 4, lines 25–47; tensor fusion as in Horovod).
//!
//! A *unit* is one layer's compressed message as a [`Codec`] writes it: for
//! RGC the RedSync packing `[len | indices | values]`, for quantized RGC
//! `[len | mean | indices]`, otherwise the codec's own payload, each behind
//! the codec's 12-byte header. A rank's *fused message* is
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `b"GSF1"` |
//! | 4..8 | number of entries `u`, u32 LE |
//! | 8..16 | the step counter of the sender, u64 LE |
//! | 16..16+16u | table of contents: per entry layer id u32, kind u32 (0 = unit, 1 = non-finite gradient), unit length u64 |
//! | … | the units back to back, in table order |
//!
//! The table of contents comes first so receivers can slice every unit before
//! decoding any, and decode layers in parallel. Every field is validated
//! against what the receiver expects (same layers in the same order, same
//! step, lengths that add up): a corrupt or truncated message becomes
//! [`Error::PeerMessage`] naming the rank and layer, never a panic.
//! A rank that selected nothing still sends a unit (with `len = 0`).
//!
//! A rank that failed before the exchange (a caller error, an encoder error:
//! the failure model of [`crate::comm::agree`]) still takes part in it, with a
//! *failure message* instead: magic `b"GSFX"`, its step (u64 LE), then its
//! error text (UTF-8). Every rank sees every message, so every rank learns
//! which rank failed and why in the same exchange ([`failure_text`]).
//!
//! Beside it, two allreduces of one layer's `(index, value)` pairs, which
//! the engine runs for RGC layers under `Config::sparse_exchange`:
//! [`allreduce`], O(k) per rank (Ok-Topk's
//! split-and-reduce and allgather with SparCML's dense switch), and
//! [`hierarchical`], node-aware (the node's pairs reduced into one unit per
//! node over shared memory, the node units allgathered among the nodes'
//! leaders, then broadcast within each node: one unit per node crosses the
//! network).

pub mod allreduce;
pub mod hierarchical;
pub use allreduce::{sparse_allreduce, Balance, SparseAllreduceOptions, SparseAllreduceReport};
pub use hierarchical::{
    hierarchical_sparse_allreduce, hierarchical_sparse_allreduce_with, HierarchicalSparseReport,
    HierarchicalWorkspace,
};

use crate::codec::Codec;
use crate::comm::Transport;
use crate::dense::{allgatherv_with, AllgathervAlgo, Gathered};
use crate::{Error, Result};

/// Magic bytes of a fused message.
pub const FUSED_MAGIC: [u8; 4] = *b"GSF1";
/// Magic bytes of a failure message (a rank that failed before the exchange).
pub const FAILED_MAGIC: [u8; 4] = *b"GSFX";
/// Bytes before the table of contents.
pub const FUSED_HEADER_LEN: usize = 16;
/// Bytes per table-of-contents entry.
pub const TOC_ENTRY_LEN: usize = 16;

/// What a table-of-contents entry carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum EntryKind {
    /// A codec unit.
    Unit = 0,
    /// The sender's gradient for this layer held NaN/Inf; no unit follows.
    NonFinite = 1,
}

/// Lay out one rank's fused message for step `step` in `buf` (cleared; its
/// capacity is reused): `entries` are `(layer id, kind, unit bytes)` in table
/// order (a [`EntryKind::NonFinite`] entry's unit should be empty).
pub fn write_fused<'a, I>(buf: &mut Vec<u8>, step: u64, entries: I)
where
    I: IntoIterator<Item = (u32, EntryKind, &'a [u8])>,
    I::IntoIter: Clone,
{
    let entries = entries.into_iter();
    let (count, units) = entries
        .clone()
        .fold((0usize, 0usize), |(c, b), e| (c + 1, b + e.2.len()));
    buf.clear();
    buf.reserve(FUSED_HEADER_LEN + TOC_ENTRY_LEN * count + units);
    buf.extend_from_slice(&FUSED_MAGIC);
    buf.extend_from_slice(&(count as u32).to_le_bytes());
    buf.extend_from_slice(&step.to_le_bytes());
    for (layer, kind, unit) in entries.clone() {
        buf.extend_from_slice(&layer.to_le_bytes());
        buf.extend_from_slice(&(kind as u32).to_le_bytes());
        buf.extend_from_slice(&(unit.len() as u64).to_le_bytes());
    }
    for (_, _, unit) in entries {
        buf.extend_from_slice(unit);
    }
}

/// Lay out a failure message for step `step` in `buf` (cleared): the
/// sender failed before the exchange with the error text `why`.
pub fn write_failed(buf: &mut Vec<u8>, step: u64, why: &str) {
    buf.clear();
    buf.extend_from_slice(&FAILED_MAGIC);
    buf.extend_from_slice(&step.to_le_bytes());
    buf.extend_from_slice(why.as_bytes());
}

/// The error text of a failure message ([`write_failed`]), `None` for any
/// other message. Hostile bytes give a lossy text, never a panic.
pub fn failure_text(msg: &[u8]) -> Option<String> {
    if msg.len() < 12 || msg[0..4] != FAILED_MAGIC {
        return None;
    }
    let t = String::from_utf8_lossy(&msg[12..]).into_owned();
    Some(if t.is_empty() {
        "(no message)".into()
    } else {
        t
    })
}

/// One entry of a parsed fused message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Layer id.
    pub layer: u32,
    /// Unit or non-finite marker.
    pub kind: EntryKind,
    /// Byte range of the unit within the sender's message.
    pub start: usize,
    /// End of the unit (exclusive).
    pub end: usize,
}

/// Parse and validate rank `rank`'s fused message `msg`: it must be for step
/// `step` and list exactly `expected` layer ids in order. `names` maps layer
/// ids to names for error messages. Fills `out` (cleared) with one entry per
/// expected layer.
pub fn parse_fused(
    msg: &[u8],
    rank: usize,
    step: u64,
    expected: &[u32],
    names: &dyn Fn(u32) -> String,
    out: &mut Vec<Entry>,
) -> Result<()> {
    out.clear();
    let bad = |layer: String, reason: String| Error::PeerMessage {
        rank,
        layer,
        reason,
    };
    let header = || "<fused header>".to_string();
    if msg.len() < FUSED_HEADER_LEN {
        return Err(bad(
            header(),
            format!("{} bytes, shorter than the header", msg.len()),
        ));
    }
    if msg[0..4] != FUSED_MAGIC {
        return Err(bad(header(), "bad magic".into()));
    }
    let u = u32::from_le_bytes(msg[4..8].try_into().expect("4 bytes")) as usize;
    let their_step = u64::from_le_bytes(msg[8..16].try_into().expect("8 bytes"));
    if their_step != step {
        return Err(bad(
            header(),
            format!("message is for step {their_step}, this rank is at step {step}"),
        ));
    }
    if u != expected.len() {
        return Err(bad(
            header(),
            format!("{u} entries, expected {}", expected.len()),
        ));
    }
    let toc_end = FUSED_HEADER_LEN + TOC_ENTRY_LEN * u;
    if msg.len() < toc_end {
        return Err(bad(header(), "truncated table of contents".into()));
    }
    let mut pos = toc_end;
    for (i, &want) in expected.iter().enumerate() {
        let e = &msg[FUSED_HEADER_LEN + TOC_ENTRY_LEN * i..][..TOC_ENTRY_LEN];
        let layer = u32::from_le_bytes(e[0..4].try_into().expect("4 bytes"));
        let kind = u32::from_le_bytes(e[4..8].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(e[8..16].try_into().expect("8 bytes"));
        if layer != want {
            return Err(bad(
                names(want),
                format!("entry {i} is for layer id {layer}, expected {want}"),
            ));
        }
        let kind = match kind {
            0 => EntryKind::Unit,
            1 => EntryKind::NonFinite,
            k => return Err(bad(names(want), format!("unknown entry kind {k}"))),
        };
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| pos.checked_add(l))
            .filter(|&end| end <= msg.len())
            .ok_or_else(|| {
                bad(
                    names(want),
                    format!(
                        "unit of {len} bytes at offset {pos} overruns the {}-byte message",
                        msg.len()
                    ),
                )
            })?;
        out.push(Entry {
            layer,
            kind,
            start: pos,
            end,
        });
        pos = end;
    }
    if pos != msg.len() {
        return Err(bad(header(), format!("{} trailing bytes", msg.len() - pos)));
    }
    Ok(())
}

/// Exchange every rank's fused message with one allgatherv.
pub fn fused_allgather<C: Transport>(
    comm: &C,
    mine: &[u8],
    algo: AllgathervAlgo,
    out: &mut Gathered,
) -> Result<()> {
    allgatherv_with(comm, mine, algo, out)
}

/// Scatter-add every rank's unit for one layer into `acc` (zeroed first):
/// `acc = Σ_r scale · decode(unit_r)`, in rank order (so every rank computes
/// the same bits). Sparse codecs add `scale · v` per sent element (O(k) per
/// rank after the zero fill); dense codecs decode-add and scale once at the
/// end. `entries[r]` is rank `r`'s parsed entry for this layer. Returns the
/// lowest rank that marked the layer non-finite, if any (its unit is skipped).
pub fn unpack_layer(
    gathered: &Gathered,
    entries: &[Entry],
    codec: &dyn Codec,
    layer_name: &str,
    scale: f32,
    acc: &mut [f32],
) -> Result<Option<usize>> {
    unpack_layer_counting(gathered, entries, codec, layer_name, scale, acc, false)
        .map(|(bad, _)| bad)
}

/// [`unpack_layer`], and with `count` the nonzero elements of the result
/// (`None` without `count`, or where a dense codec decoded a unit): each
/// scatter-add that turns an element nonzero counts one, each that turns
/// one back to zero takes one away, so the count is exact at one compare
/// per pair, not a pass over `acc`. The engine's fill measurement on
/// steps whose pairs went through the allgatherv (`sync/exchange.rs`).
pub(crate) fn unpack_layer_counting(
    gathered: &Gathered,
    entries: &[Entry],
    codec: &dyn Codec,
    layer_name: &str,
    scale: f32,
    acc: &mut [f32],
    count: bool,
) -> Result<(Option<usize>, Option<usize>)> {
    acc.fill(0.0);
    let n = acc.len();
    let mut non_finite = None;
    let mut dense = false;
    // Nonzero elements so far (never negative: a step down follows a step up).
    let mut nnz = 0usize;
    for (r, e) in entries.iter().enumerate() {
        if e.kind == EntryKind::NonFinite {
            non_finite.get_or_insert(r);
            continue;
        }
        let unit = &gathered.message(r)[e.start..e.end];
        let res = if dense {
            codec.decode_add(unit, acc)
        } else {
            let sent = if count {
                codec.for_each_sent(unit, n, &mut |i, v| {
                    let (a, b) = (acc[i], acc[i] + scale * v);
                    acc[i] = b;
                    nnz = nnz + usize::from(b != 0.0) - usize::from(a != 0.0);
                })
            } else {
                codec.for_each_sent(unit, n, &mut |i, v| acc[i] += scale * v)
            };
            match sent {
                Ok(true) => Ok(()),
                Ok(false) => {
                    dense = true;
                    codec.decode_add(unit, acc)
                }
                Err(e) => Err(e),
            }
        };
        res.map_err(|err| Error::PeerMessage {
            rank: r,
            layer: layer_name.to_string(),
            reason: err.to_string(),
        })?;
    }
    if dense && scale != 1.0 {
        // Summed before scaling: p finite messages near f32's limit can
        // overflow although their average fits. Found in this pass, an
        // error on every rank (every rank sums the same messages).
        let mut finite = true;
        for x in acc.iter_mut() {
            *x *= scale;
            finite &= x.is_finite();
        }
        if !finite && non_finite.is_none() {
            return Err(Error::NonFinite {
                rank: None,
                layer: layer_name.to_string(),
            });
        }
    }
    Ok((non_finite, (count && !dense).then_some(nnz)))
}

#[cfg(test)]
mod tests;
