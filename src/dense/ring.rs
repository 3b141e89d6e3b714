//! Ring allreduce: `p − 1` reduce-scatter steps then `p − 1` allgather steps
//! around the ring `rank → rank + 1`, each moving one `n/p` segment
//! (Patarasuk & Yuan 2009; Open MPI `coll_base_allreduce_intra_ring`).
//! Segments follow Open MPI: `n/p` elements each, the first `n mod p` one more.
//!
//! With `chunk_elems > 0` each segment travels as several messages and a
//! received chunk is reduced and forwarded at once, so the reduction of one
//! chunk overlaps the transfer of the next and consecutive steps pipeline
//! (the schedule NCCL's ring uses).

use super::{
    add_average_into, add_into, split_ref_mut, validate_same_len, AllreduceOptions, Real, ReduceOp,
    Workspace, TAG_RING as TAG,
};
use crate::comm::{Request, Transport};
use crate::Result;
use std::collections::VecDeque;
use std::ops::Range;

/// Segment `i` of `n` elements split over `p` ranks.
#[inline]
pub(super) fn segment(n: usize, p: usize, i: usize) -> Range<usize> {
    let (base, extra) = (n / p, n % p);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Most chunks one segment is cut into. Together with completing the sends of
/// step `t` by the end of step `t + 1`, this bounds the messages in flight per
/// peer to about `3 · MAX_CHUNKS_PER_SEGMENT`, whatever `n` and `p`. Unbounded
/// pipelines break real MPIs: Open MPI's ob1 orders messages per peer with a
/// 16-bit sequence number, and with more than 65 536 in flight over shared
/// memory it matched the wrong messages (seen with 75 000 chunks of 7 floats).
pub const MAX_CHUNKS_PER_SEGMENT: usize = 16;

/// The chunk actually used: `requested`, raised so that a segment of `seg`
/// elements has at most [`MAX_CHUNKS_PER_SEGMENT`] chunks (0 = unpipelined).
pub fn effective_chunk(requested: usize, seg: usize) -> usize {
    if requested == 0 {
        0
    } else {
        requested.max(seg.div_ceil(MAX_CHUNKS_PER_SEGMENT))
    }
}

/// In-place ring allreduce of `buf` over all ranks of `comm`.
///
/// ```
/// use gradsync::comm::{LocalComm, Transport};
/// use gradsync::dense::{ring_allreduce, AllreduceOptions};
/// let out = LocalComm::run(3, |c| {
///     let mut g: Vec<f32> = (0..10).map(|i| (i + c.rank()) as f32).collect();
///     let opts = AllreduceOptions { chunk_elems: 2, ..Default::default() };
///     ring_allreduce(&c, &mut g, &opts).unwrap();
///     g
/// });
/// assert_eq!(out[2][0], 0.0 + 1.0 + 2.0);
/// ```
pub fn ring_allreduce<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    opts: &AllreduceOptions,
) -> Result<()> {
    ring_allreduce_with(comm, buf, opts, &mut Workspace::new())
}

/// [`ring_allreduce`] with caller-provided scratch (one segment).
pub fn ring_allreduce_with<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    opts: &AllreduceOptions,
    ws: &mut Workspace<T>,
) -> Result<()> {
    let (p, n) = (comm.size(), buf.len());
    if opts.validate {
        validate_same_len(comm, n)?;
    }
    if p == 1 || n == 0 {
        return Ok(());
    }
    let tmp = ws.scratch(segment(n, p, 0).len());
    let chunk = effective_chunk(opts.chunk_elems, tmp.len());
    if chunk == 0 || chunk >= tmp.len() {
        ring_plain(comm, buf, tmp, opts.op)
    } else {
        ring_pipelined(comm, buf, tmp, opts.op, chunk)
    }
}

fn ring_plain<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    tmp: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (rank, p, n) = (comm.rank(), comm.size(), buf.len());
    let (right, left) = ((rank + 1) % p, (rank + p - 1) % p);
    for s in 0..p - 1 {
        let sb = segment(n, p, (rank + p - s) % p);
        let rb = segment(n, p, (rank + 2 * p - s - 1) % p);
        let t = &mut tmp[..rb.len()];
        comm.sendrecv(&buf[sb], right, t, left, TAG)?;
        // The last step's sum is this rank's reduced segment: the average
        // in the same pass.
        if op == ReduceOp::Average && s == p - 2 {
            add_average_into(&mut buf[rb], t, p);
        } else {
            add_into(&mut buf[rb], t);
        }
    }
    for s in 0..p - 1 {
        let sb = segment(n, p, (rank + 1 + p - s) % p);
        let rb = segment(n, p, (rank + p - s) % p);
        let (snd, rcv) = split_ref_mut(buf, sb, rb);
        comm.sendrecv(snd, right, rcv, left, TAG)?;
    }
    Ok(())
}

/// Pipelined ring. Step `s` of the `2(p−1)` steps receives segment `rb(s)`
/// from the left; the segment sent at step `s + 1` is exactly `rb(s)`, so each
/// chunk is forwarded right after it has been reduced (or received, in the
/// allgather half). Sends of step `t` are completed before step `t + p − 1`
/// receives into the same segment, and at the latest at the end of step
/// `t + 1` (their receiver posts them at its step `t`, so this cannot
/// deadlock: every wait depends only on earlier steps).
fn ring_pipelined<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    tmp: &mut [T],
    op: ReduceOp,
    chunk: usize,
) -> Result<()> {
    let (rank, p, n) = (comm.rank(), comm.size(), buf.len());
    let (right, left) = ((rank + 1) % p, (rank + p - 1) % p);
    let steps = 2 * (p - 1);
    let recv_seg = |s: usize| {
        if s < p - 1 {
            segment(n, p, (rank + 2 * p - s - 1) % p)
        } else {
            segment(n, p, (rank + 2 * p - (s - (p - 1))) % p)
        }
    };
    let base = buf.as_mut_ptr();
    let tbase = tmp.as_mut_ptr();
    let nchunks = segment(n, p, 0).len().div_ceil(chunk);
    // (step the send belongs to, request); bounded by ~2 segments of chunks.
    let mut sends: VecDeque<(usize, C::Request)> = VecDeque::with_capacity(2 * nchunks + 2);
    let mut recvs: Vec<C::Request> = Vec::with_capacity(nchunks);

    // The rule every unsafe block below relies on: every slice made from
    // `base`/`tbase` is in bounds (segments partition 0..n, chunks
    // partition a segment, `tmp` holds one full segment); a region handed
    // to a pending isend is not written until that send is waited (the
    // step rule above); a region handed to a pending irecv is not touched
    // until that receive is waited; `buf` and `tmp` are not used through
    // their references meanwhile.
    // SAFETY: this rank's segment of `buf`, not written until these sends
    // are waited (the rule above).
    unsafe { send_first(comm, base, segment(n, p, rank), chunk, right, &mut sends)? };
    for s in 0..steps {
        let seg = recv_seg(s);
        let reduce = s < p - 1;
        if !reduce {
            // Segment `seg` was sent at step s − (p − 1): finish those sends.
            let sent_at = s - (p - 1);
            while sends.front().is_some_and(|(t, _)| *t <= sent_at) {
                sends.pop_front().expect("front exists").1.wait()?;
            }
        }
        // Post every chunk receive of this step (empty segment: one empty message).
        let mut c = seg.start;
        loop {
            let len = chunk.min(seg.end - c);
            // SAFETY: in `tmp` (reduce) or `seg` of `buf`; the sends that read
            // this region were waited above (the rule).
            let dst = unsafe {
                if reduce {
                    view_mut(tbase, c - seg.start, len)
                } else {
                    view_mut(base, c, len)
                }
            };
            // SAFETY: `dst` is not touched before this receive is waited.
            recvs.push(unsafe { comm.irecv(dst, left, TAG)? });
            c += len;
            if c >= seg.end {
                break;
            }
        }
        let mut c = seg.start;
        for req in recvs.drain(..) {
            req.wait()?;
            let len = chunk.min(seg.end - c);
            // SAFETY: this chunk's receive is done; no send of it is pending.
            let mine = unsafe { view_mut(base, c, len) };
            if reduce {
                // SAFETY: the received chunk in `tmp`, its receive done.
                let got = unsafe { view(tbase, c - seg.start, len) };
                if s == p - 2 && op == ReduceOp::Average {
                    add_average_into(mine, got, p);
                } else {
                    add_into(mine, got);
                }
            }
            if s + 1 < steps {
                // SAFETY: `mine` is not written before this send is waited.
                sends.push_back((s + 1, unsafe { comm.isend(&*mine, right, TAG)? }));
            }
            c += len;
        }
        // Bound what is in flight: sends of steps up to s − 1 are done.
        while sends.front().is_some_and(|(t, _)| *t < s) {
            sends.pop_front().expect("front exists").1.wait()?;
        }
    }
    for (_, req) in sends.drain(..) {
        req.wait()?;
    }
    Ok(())
}

/// Step 0 of [`ring_pipelined`]: the segment `first` of the buffer at
/// `base` to `right`, chunk by chunk (one empty message for an empty
/// segment), each send recorded as step 0's.
///
/// # Safety
/// `first` lies in the buffer at `base`, which is not written (nor used
/// through a reference) until these sends are waited.
unsafe fn send_first<C: Transport, T: Real>(
    comm: &C,
    base: *const T,
    first: Range<usize>,
    chunk: usize,
    right: usize,
    sends: &mut VecDeque<(usize, C::Request)>,
) -> Result<()> {
    for c in (first.start..first.end).step_by(chunk) {
        // SAFETY: in `first` (the caller's promise); read while the send is
        // pending.
        let part = unsafe { view(base, c, chunk.min(first.end - c)) };
        // SAFETY: `part` is not written before this send is waited.
        sends.push_back((0, unsafe { comm.isend(part, right, TAG)? }));
    }
    if first.is_empty() {
        // SAFETY: an empty static slice.
        sends.push_back((0, unsafe { comm.isend(&[] as &[T], right, TAG)? }));
    }
    Ok(())
}

/// `len` elements at `base + off`.
///
/// # Safety
/// `base + off .. base + off + len` lies in one live allocation, and
/// nothing writes it while the slice is used.
unsafe fn view<'a, T>(base: *const T, off: usize, len: usize) -> &'a [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(base.add(off), len) }
}

/// [`view`], writable.
///
/// # Safety
/// As [`view`], and nothing else reads or writes the region while the
/// slice is used.
unsafe fn view_mut<'a, T>(base: *mut T, off: usize, len: usize) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(base.add(off), len) }
}
