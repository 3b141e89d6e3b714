//! GradiVeQ's Algorithm 1 (ring all-reduce in the compressed domain, with
//! compression and decompression overlapped with the transfers) and the
//! 4-bit QSGD ring the paper compares against.
//!
//! Algorithm 1 on rank `r` of `p`: the layer's slices are split into `p`
//! segments of whole slices (the uncompressed tail rides with the last one).
//! Rank `r` compresses segment `r` and sends it on; in each of the `p − 1`
//! reduce steps it posts the receive of segment `r − i` from its
//! predecessor, compresses its own copy of that segment while the message is
//! in flight, adds the two compressed segments and forwards the sum. Rank `r`
//! then holds the fully aggregated compressed segment `r + 1`. In each of the
//! `p − 1` allgather steps it forwards the last complete segment and receives
//! the next, decompressing the one it forwards while both are in flight.
//! Every segment is summed at exactly one rank and copied verbatim to the
//! others, so the result is bit-identical on every rank.
//!
//! The QSGD ring cannot add in the compressed domain: every reduce step
//! decodes the received segment, adds the local one and re-encodes the sum
//! (4 bits per value, one norm per bucket of 512 in the bench), so nothing
//! overlaps.

use super::LayerCompressor;
use crate::codec::{Codec, Qsgd};
use crate::comm::{Request, Tag, Transport};
use crate::{Error, Result};
use std::time::Instant;

const TAG_GRADIVEQ: Tag = crate::comm::tags::GRADIVEQ;
const TAG_QSGD_RING: Tag = crate::comm::tags::QSGD_RING;

/// Where the time of one [`gradiveq_ring_allreduce`] went (this rank).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RingStats {
    /// Compressing the `p` local segments.
    pub compress_s: f64,
    /// Decompressing the `p` aggregated segments.
    pub decompress_s: f64,
    /// Blocked waiting for transfers after the overlapped work was done.
    pub wait_s: f64,
    /// Total.
    pub total_s: f64,
}

/// Reusable buffers of the rings.
#[derive(Debug, Default)]
pub struct RingWorkspace {
    segs: Vec<Vec<f32>>,
    tmp: Vec<f32>,
    bytes: Vec<Vec<u8>>,
    recv_bytes: Vec<u8>,
    dense: Vec<f32>,
}

/// Slice ranges `[a, b)` of the `p` segments.
pub fn segments(slices: usize, p: usize) -> Vec<(usize, usize)> {
    let (base, rem) = (slices / p, slices % p);
    let mut v = Vec::with_capacity(p);
    let mut a = 0;
    for i in 0..p {
        let len = base + usize::from(i < rem);
        v.push((a, a + len));
        a += len;
    }
    v
}

/// Sum of every rank's `g` (the whole layer, `lc.len()` elements),
/// compressed, aggregated and decompressed by Algorithm 1; `out` receives
/// `Σ_n` GradiVeQ(`g_n`) `= U(Uᵀ(Σ g_n − μ)) + μ`, identical on all ranks.
pub fn gradiveq_ring_allreduce<C: Transport>(
    comm: &C,
    lc: &LayerCompressor,
    g: &[f32],
    out: &mut [f32],
    ws: &mut RingWorkspace,
) -> Result<RingStats> {
    let n = lc.len();
    if g.len() != n || out.len() != n {
        return Err(Error::InvalidArgument(format!(
            "layer of {n} elements, got gradient {} and output {}",
            g.len(),
            out.len()
        )));
    }
    let t_all = Instant::now();
    let (r, p) = (comm.rank(), comm.size());
    let segs = segments(lc.slices(), p);
    let tail = |i: usize| i == p - 1;
    ws.segs.resize_with(p, Vec::new);
    for (i, &(a, b)) in segs.iter().enumerate() {
        ws.segs[i].resize(lc.compressed_len(a, b, tail(i)), 0.0);
    }
    let mut st = RingStats::default();
    let compress = |ws: &mut RingWorkspace, i: usize, st: &mut RingStats| {
        let t = Instant::now();
        let (a, b) = segs[i];
        lc.compress_range(g, p, a, b, tail(i), &mut ws.segs[i]);
        st.compress_s += t.elapsed().as_secs_f64();
    };
    let decompress = |ws: &RingWorkspace, i: usize, out: &mut [f32], st: &mut RingStats| {
        let t = Instant::now();
        let (a, b) = segs[i];
        lc.decompress_range(&ws.segs[i], a, b, tail(i), out);
        st.decompress_s += t.elapsed().as_secs_f64();
    };
    if p == 1 {
        compress(ws, 0, &mut st);
        decompress(ws, 0, out, &mut st);
        st.total_s = t_all.elapsed().as_secs_f64();
        return Ok(st);
    }
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    let wrap = |x: isize| x.rem_euclid(p as isize) as usize;
    // Reduce round.
    compress(ws, r, &mut st);
    // SAFETY: `ws.segs[r]` is not written until this send is waited on
    // (it is next touched in the allgather round, after the wait below).
    let mut send = Some(unsafe { comm.isend(&ws.segs[r], next, TAG_GRADIVEQ)? });
    for i in 1..p {
        let idx = wrap(r as isize - i as isize);
        ws.tmp.resize(ws.segs[idx].len(), 0.0);
        // SAFETY: `ws.tmp` is neither read nor resized until the wait.
        let recv = unsafe { comm.irecv(&mut ws.tmp[..], prev, TAG_GRADIVEQ)? };
        // Overlapped: compress our copy of the segment being received.
        compress(ws, idx, &mut st);
        let t = Instant::now();
        recv.wait()?;
        if let Some(s) = send.take() {
            s.wait()?;
        }
        st.wait_s += t.elapsed().as_secs_f64();
        for (x, y) in ws.segs[idx].iter_mut().zip(&ws.tmp) {
            *x += *y;
        }
        if i < p - 1 {
            // SAFETY: `ws.segs[idx]` is not written until this send is
            // waited on at the next step.
            send = Some(unsafe { comm.isend(&ws.segs[idx], next, TAG_GRADIVEQ)? });
        }
    }
    // Allgather round: forward the last complete segment, receive the next,
    // decompress the forwarded one meanwhile.
    for i in 0..p - 1 {
        let s_idx = wrap(r as isize + 1 - i as isize);
        let r_idx = wrap(r as isize - i as isize);
        // SAFETY: the two segments are distinct (p ≥ 2) and neither is
        // written through another path until both requests are waited on;
        // decompression below only reads `segs[s_idx]`.
        let send = unsafe { comm.isend(&ws.segs[s_idx], next, TAG_GRADIVEQ)? };
        let recv = {
            let buf: &mut [f32] = &mut ws.segs[r_idx];
            // SAFETY: see above.
            unsafe { comm.irecv(buf, prev, TAG_GRADIVEQ)? }
        };
        decompress(ws, s_idx, out, &mut st);
        let t = Instant::now();
        recv.wait()?;
        send.wait()?;
        st.wait_s += t.elapsed().as_secs_f64();
    }
    decompress(ws, wrap(r as isize + 2), out, &mut st);
    st.total_s = t_all.elapsed().as_secs_f64();
    Ok(st)
}

/// Element ranges of `p` near-equal segments of `n` elements.
fn element_segments(n: usize, p: usize) -> Vec<(usize, usize)> {
    segments(n, p)
}

/// The paper's comparator: ring all-reduce of `g` (sum over ranks) where
/// every transfer is QSGD (`bits` per value, one norm per `bucket` values,
/// 0 = per segment), each reduce step decoding, adding and re-encoding.
/// `out` is identical on every rank.
pub fn qsgd_ring_allreduce<C: Transport>(
    comm: &C,
    g: &[f32],
    out: &mut [f32],
    bits: u32,
    bucket: usize,
    seed: u64,
    ws: &mut RingWorkspace,
) -> Result<()> {
    let n = g.len();
    if out.len() != n {
        return Err(Error::InvalidArgument(format!(
            "gradient {n} and output {} differ",
            out.len()
        )));
    }
    let (r, p) = (comm.rank(), comm.size());
    let mut codec = Qsgd::new(bits, seed ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))?
        .with_bucket(bucket)?;
    let segs = element_segments(n, p);
    let wrap = |x: isize| x.rem_euclid(p as isize) as usize;
    ws.bytes.resize_with(p, Vec::new);
    if p == 1 {
        codec.encode(g, &mut ws.bytes[0])?;
        return codec.decode(&ws.bytes[0], out);
    }
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    // Reduce round: encode, send; receive, decode, add, re-encode.
    let (a, b) = segs[r];
    codec.encode(&g[a..b], &mut ws.bytes[r])?;
    let mut outgoing = r;
    for i in 1..p {
        let idx = wrap(r as isize - i as isize);
        let (a, b) = segs[idx];
        let want = encoded_len(b - a, bits, bucket);
        ws.recv_bytes.resize(want, 0);
        let send = std::mem::take(&mut ws.bytes[outgoing]);
        comm.sendrecv(&send[..], next, &mut ws.recv_bytes[..], prev, TAG_QSGD_RING)?;
        ws.bytes[outgoing] = send;
        ws.dense.clear();
        ws.dense.extend_from_slice(&g[a..b]);
        codec.decode_add(&ws.recv_bytes, &mut ws.dense)?;
        codec.encode(&ws.dense, &mut ws.bytes[idx])?;
        outgoing = idx;
    }
    // Allgather round: circulate the final encoded segments.
    for i in 0..p - 1 {
        let s_idx = wrap(r as isize + 1 - i as isize);
        let r_idx = wrap(r as isize - i as isize);
        let (a, b) = segs[r_idx];
        ws.recv_bytes.resize(encoded_len(b - a, bits, bucket), 0);
        let send = std::mem::take(&mut ws.bytes[s_idx]);
        comm.sendrecv(&send[..], next, &mut ws.recv_bytes[..], prev, TAG_QSGD_RING)?;
        ws.bytes[s_idx] = send;
        std::mem::swap(&mut ws.bytes[r_idx], &mut ws.recv_bytes);
    }
    for (i, &(a, b)) in segs.iter().enumerate() {
        codec.decode(&ws.bytes[i], &mut out[a..b])?;
    }
    Ok(())
}

/// Bytes of a QSGD message of `n` values at `bits` bits.
fn encoded_len(n: usize, bits: u32, bucket: usize) -> usize {
    let norms = if bucket == 0 {
        4
    } else {
        4 + 4 * n.div_ceil(bucket)
    };
    crate::codec::HEADER_LEN + 1 + norms + (n * bits as usize).div_ceil(8)
}
