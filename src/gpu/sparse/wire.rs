//! The device step's fused message: for every layer in order, RedSync's
//! unit `[len: u32 | len indices: u32 | len values: f32]`, little-endian
//! (the `rgc` codec's payload, without the codec header), or
//! `len = u32::MAX` alone: the layer's residual overflowed on that rank
//! (the host engine's non-finite unit). Parsing checks
//! every rank's message whole before anything is applied: lengths against
//! the layer and the bytes left, indices strictly ascending and inside
//! the layer, values finite; an error names the rank and the layer and
//! never panics, whatever the bytes.

use super::Compacted;
use crate::dense::Gathered;
use crate::{Error, Result};

/// The length that marks a layer non-finite on its rank.
const NON_FINITE: u32 = u32::MAX;

/// This rank's message from its selection (`overflowed`: the layers
/// marked non-finite, which send nothing).
pub(super) fn pack(e: &Compacted, overflowed: &[usize], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(4 * e.counts.len() + 8 * e.idx.len());
    let mut at = 0;
    for (l, &c) in e.counts.iter().enumerate() {
        if overflowed.contains(&l) {
            out.extend_from_slice(&NON_FINITE.to_le_bytes());
            continue;
        }
        out.extend_from_slice(&(c as u32).to_le_bytes());
        for &i in &e.idx[at..at + c] {
            out.extend_from_slice(&i.to_le_bytes());
        }
        for &v in &e.val[at..at + c] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        at += c;
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One rank's message as fused indices (`offsets[l] + i`) and values;
/// the layers it marks non-finite go to `non_finite`.
pub(super) fn parse(
    msg: &[u8],
    rank: usize,
    sizes: &[usize],
    offsets: &[u64],
    gidx: &mut Vec<u64>,
    val: &mut Vec<f32>,
    non_finite: &mut Vec<usize>,
) -> Result<()> {
    let bad = |layer: usize, why: String| Error::PeerMessage {
        rank,
        layer: format!("{layer}"),
        reason: why,
    };
    let mut at = 0usize;
    for (l, (&n, &base)) in sizes.iter().zip(offsets).enumerate() {
        if msg.len() - at < 4 {
            return Err(bad(
                l,
                format!("message ends at byte {at} before the unit's length"),
            ));
        }
        let len = u32_at(msg, at);
        at += 4;
        if len == NON_FINITE {
            non_finite.push(l);
            continue;
        }
        let len = len as usize;
        if len > n {
            return Err(bad(l, format!("{len} entries for a layer of {n}")));
        }
        if (msg.len() - at) / 8 < len {
            return Err(bad(
                l,
                format!("{len} entries overrun the message at byte {at}"),
            ));
        }
        let (ib, vb) = (at, at + 4 * len);
        let mut prev: Option<u32> = None;
        for j in 0..len {
            let i = u32_at(msg, ib + 4 * j);
            if i as usize >= n || prev.is_some_and(|p| i <= p) {
                return Err(bad(
                    l,
                    format!("index {i} at entry {j} is out of order or past {n}"),
                ));
            }
            prev = Some(i);
            let v = f32::from_bits(u32_at(msg, vb + 4 * j));
            if !v.is_finite() {
                return Err(bad(l, format!("value {v} at entry {j} is not finite")));
            }
            gidx.push(base + u64::from(i));
            val.push(v);
        }
        at += 8 * len;
    }
    if at != msg.len() {
        return Err(bad(
            sizes.len(),
            format!("{} trailing bytes", msg.len() - at),
        ));
    }
    Ok(())
}

/// Every rank's message, in rank order, and the first layer any rank
/// marked non-finite with the lowest rank that marked it (the host
/// engine's error for the step).
#[allow(clippy::type_complexity)]
pub(super) fn parse_all(
    g: &Gathered,
    p: usize,
    sizes: &[usize],
    offsets: &[u64],
) -> Result<(Vec<(Vec<u64>, Vec<f32>)>, Option<(usize, usize)>)> {
    let mut first: Option<(usize, usize)> = None;
    let ranks = (0..p)
        .map(|r| {
            let (mut gi, mut v, mut nf) = (Vec::new(), Vec::new(), Vec::new());
            parse(g.message(r), r, sizes, offsets, &mut gi, &mut v, &mut nf)?;
            if let Some(&l) = nf.first() {
                // Layer order first, then the lowest rank.
                if first.is_none_or(|(fl, _)| l < fl) {
                    first = Some((l, r));
                }
            }
            Ok((gi, v))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((ranks, first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_hostile_bytes_never_panic() {
        let e = Compacted {
            counts: vec![2, 0, 1],
            idx: vec![1, 5, 0],
            val: vec![1.5, -2.0, 3.0],
        };
        let sizes = [8, 4, 2];
        let offsets = [0, 8, 12];
        let mut m = Vec::new();
        pack(&e, &[], &mut m);
        let (mut gi, mut v, mut nf) = (Vec::new(), Vec::new(), Vec::new());
        parse(&m, 0, &sizes, &offsets, &mut gi, &mut v, &mut nf).unwrap();
        assert_eq!(gi, vec![1, 5, 12]);
        assert_eq!(v, vec![1.5, -2.0, 3.0]);
        assert!(nf.is_empty());
        // A layer marked non-finite sends nothing and is reported.
        let mut mk = Vec::new();
        let e2 = Compacted {
            counts: vec![2, 0, 0],
            idx: vec![1, 5],
            val: vec![1.5, -2.0],
        };
        pack(&e2, &[2], &mut mk);
        let (mut gi, mut v, mut nf) = (Vec::new(), Vec::new(), Vec::new());
        parse(&mk, 0, &sizes, &offsets, &mut gi, &mut v, &mut nf).unwrap();
        assert_eq!((gi, nf), (vec![1, 5], vec![2]));
        // Every truncation and every single-byte change: an error or a
        // valid parse, never a panic; truncations always an error.
        for cut in 0..m.len() {
            let (mut gi, mut v) = (Vec::new(), Vec::new());
            assert!(parse(
                &m[..cut],
                1,
                &sizes,
                &offsets,
                &mut gi,
                &mut v,
                &mut Vec::new()
            )
            .is_err());
        }
        for at in 0..m.len() {
            for b in [0u8, 1, 0x7f, 0x80, 0xff] {
                let mut h = m.clone();
                h[at] = b;
                let (mut gi, mut v) = (Vec::new(), Vec::new());
                let _ = parse(&h, 1, &sizes, &offsets, &mut gi, &mut v, &mut Vec::new());
            }
        }
        // A repeated index, an index past the layer, a NaN: errors naming
        // the rank and the layer.
        let mut h = m.clone();
        h[8..12].copy_from_slice(&1u32.to_le_bytes());
        let err = parse(
            &h,
            3,
            &sizes,
            &offsets,
            &mut Vec::new(),
            &mut Vec::new(),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(err.to_string().contains('3'), "{err}");
        let mut h = m.clone();
        h[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(parse(
            &h,
            0,
            &sizes,
            &offsets,
            &mut Vec::new(),
            &mut Vec::new(),
            &mut Vec::new()
        )
        .is_err());
        let mut h = m.clone();
        h[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(parse(
            &h,
            0,
            &sizes,
            &offsets,
            &mut Vec::new(),
            &mut Vec::new(),
            &mut Vec::new()
        )
        .is_err());
    }
}
