//! The small collectives that agreement runs on, below every algorithm
//! module: an element-wise max of a few words by recursive doubling (with
//! the Thakur–Rabenseifner–Gropp fold for any `p`), and the in-place
//! allgather of variable-length blocks (recursive doubling for a power of
//! two ranks, Bruck's algorithm otherwise; Thakur et al. §4.1) with its
//! length exchange. [`crate::dense::allgatherv`] runs the same allgather on
//! payloads; [`super::agree`] runs both on failure flags and texts.

use super::tags::ALLGATHERV as TAG;
use super::{Elem, Tag, Transport};
use crate::{Error, Result};

/// The Thakur–Rabenseifner–Gropp fold of `p` ranks onto `p' = 2^⌊lg p⌋`
/// virtual ranks: among the first `2r` ranks (`r = p − p'`) each even rank
/// stays (virtual rank `rank/2`) and its odd partner drops out; ranks `≥ 2r`
/// become virtual rank `rank − r`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fold {
    pub p2: usize,
    pub r: usize,
}

impl Fold {
    pub fn new(p: usize) -> Self {
        let p2 = if p == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - p.leading_zeros())
        };
        Fold { p2, r: p - p2 }
    }
    /// Virtual rank of `rank`, or `None` if it drops out.
    pub fn vrank(&self, rank: usize) -> Option<usize> {
        if rank < 2 * self.r {
            (rank % 2 == 0).then_some(rank / 2)
        } else {
            Some(rank - self.r)
        }
    }
    /// Lowest real rank represented by virtual rank `v` (`v == p2` gives `p`).
    pub fn real(&self, v: usize) -> usize {
        if v < self.r {
            2 * v
        } else {
            v + self.r
        }
    }
}

/// Element-wise max of a tiny `u64` vector over all ranks, by recursive
/// doubling with the non-power-of-two fold.
pub(crate) fn small_allreduce_max<C: Transport, const N: usize>(
    comm: &C,
    v: &mut [u64; N],
    tag: Tag,
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    if p == 1 {
        return Ok(());
    }
    let f = Fold::new(p);
    let mut other = [0u64; N];
    let merge = |v: &mut [u64; N], o: &[u64; N]| {
        for (a, b) in v.iter_mut().zip(o) {
            *a = (*a).max(*b);
        }
    };
    if rank < 2 * f.r {
        if rank % 2 == 1 {
            comm.send(&v[..], rank - 1, tag)?;
            comm.recv(&mut v[..], rank - 1, tag)?;
            return Ok(());
        }
        comm.recv(&mut other[..], rank + 1, tag)?;
        merge(v, &other);
    }
    let vr = f.vrank(rank).expect("odd folded ranks returned above");
    let mut mask = 1;
    while mask < f.p2 {
        let peer = f.real(vr ^ mask);
        comm.sendrecv(&v[..], peer, &mut other[..], peer, tag)?;
        merge(v, &other);
        mask <<= 1;
    }
    if rank < 2 * f.r {
        comm.send(&v[..], rank + 1, tag)?;
    }
    Ok(())
}

/// Split one mutable slice into a shared sub-slice `a` and a mutable sub-slice
/// `b` that do not overlap (for exchanges within one buffer).
pub(crate) fn split_ref_mut<T>(
    buf: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[T], &mut [T]) {
    assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// The result of an allgatherv: all messages back to back, in rank order.
/// Reuse one across calls to avoid allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gathered {
    /// Concatenated messages.
    pub data: Vec<u8>,
    /// `displs[i]..displs[i + 1]` is rank `i`'s message (`p + 1` entries).
    pub displs: Vec<usize>,
    pub(crate) counts_u64: Vec<u64>,
    pub(crate) counts: Vec<usize>,
    /// The node-aware allgatherv's staging buffer for node maps that are
    /// not blocks of consecutive ranks (kept across calls).
    pub(crate) scratch: Vec<u8>,
}

impl Gathered {
    /// Rank `i`'s message.
    pub fn message(&self, i: usize) -> &[u8] {
        &self.data[self.displs[i]..self.displs[i + 1]]
    }
    /// Number of messages (ranks).
    pub fn len(&self) -> usize {
        self.displs.len().saturating_sub(1)
    }
    /// True when no messages are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Gathered {
    /// Gather every rank's message length (by [`gather_inplace`]) and set
    /// the displacements; `data` is sized to the total, this rank's own
    /// block not yet filled. Returns this rank's block.
    pub(crate) fn gather_lengths<C: Transport>(
        &mut self,
        comm: &C,
        mine: usize,
    ) -> Result<std::ops::Range<usize>> {
        let (rank, p) = (comm.rank(), comm.size());
        self.counts_u64.clear();
        self.counts_u64.resize(p, 0);
        self.counts_u64[rank] = mine as u64;
        self.displs.clear();
        self.displs.extend(0..=p);
        gather_inplace(comm, &mut self.counts_u64, &self.displs)?;
        self.displs.clear();
        self.displs.push(0);
        let mut total = 0usize;
        for &c in &self.counts_u64 {
            let c = usize::try_from(c).map_err(|_| {
                Error::InvalidArgument(format!("message length {c} does not fit in memory"))
            })?;
            total = total.checked_add(c).ok_or_else(|| {
                Error::InvalidArgument("total allgatherv length overflows".into())
            })?;
            self.displs.push(total);
        }
        if self.displs[rank + 1] - self.displs[rank] != mine {
            return Err(Error::Transport(
                "gathered length of this rank's own message is wrong".into(),
            ));
        }
        self.data.resize(total, 0);
        Ok(self.displs[rank]..self.displs[rank + 1])
    }
}

/// Every rank's `mine` on every rank, in rank order: the lengths, then the
/// payload, both by [`gather_inplace`] (the `recdbl` allgatherv of
/// [`crate::dense::allgatherv`]).
pub(crate) fn allgather_bytes<C: Transport>(comm: &C, mine: &[u8]) -> Result<Gathered> {
    let mut g = Gathered::default();
    let own = g.gather_lengths(comm, mine.len())?;
    g.data[own].copy_from_slice(mine);
    gather_inplace(comm, &mut g.data, &g.displs)?;
    Ok(g)
}

/// Allgather in place: rank `i`'s block
/// `buf[displs[i]..displs[i+1]]` is already filled on rank `i`.
pub(crate) fn gather_inplace<C: Transport, T: Elem>(
    comm: &C,
    buf: &mut [T],
    displs: &[usize],
) -> Result<()> {
    if comm.size().is_power_of_two() {
        recdbl_inplace(comm, buf, displs)
    } else {
        bruck_inplace(comm, buf, displs)
    }
}

/// Bruck's allgather in place, for any `p` (module docs): `buf` holds the
/// messages in rank-relative order (this rank's first) while it runs, and
/// one rotation puts them in rank order.
fn bruck_inplace<C: Transport, T: Elem>(comm: &C, buf: &mut [T], displs: &[usize]) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    if p == 1 {
        return Ok(());
    }
    // rel[j]: where the message of rank (rank + j) mod p starts.
    let mut rel = Vec::with_capacity(p + 1);
    rel.push(0usize);
    for j in 0..p {
        let i = (rank + j) % p;
        rel.push(rel[j] + displs[i + 1] - displs[i]);
    }
    buf.copy_within(displs[rank]..displs[rank + 1], 0);
    let mut d = 1;
    while d < p {
        // Held: relative messages 0..d. Send the first s to rank − d
        // (they are its d..d+s), receive rank + d's first s as our d..d+s.
        let s = d.min(p - d);
        let (held, rest) = buf.split_at_mut(rel[d]);
        comm.sendrecv(
            &held[..rel[s]],
            (rank + p - d) % p,
            &mut rest[..rel[d + s] - rel[d]],
            (rank + d) % p,
            TAG,
        )?;
        d *= 2;
    }
    // Relative order is rank, rank + 1, …, p − 1, 0, …, rank − 1.
    buf[..displs[p]].rotate_right(displs[rank]);
    Ok(())
}

/// Recursive-doubling allgather in place, `p` a power of two: rank `i`'s
/// block `buf[displs[i]..displs[i+1]]` is already filled on rank `i`; at
/// distance `mask` the ranks exchange the gathered runs `[lo, lo + mask)`.
fn recdbl_inplace<C: Transport, T: Elem>(comm: &C, buf: &mut [T], displs: &[usize]) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    debug_assert!(p.is_power_of_two(), "{p} ranks: Bruck's algorithm's");
    let range = |first: usize, end: usize| displs[first]..displs[end];
    let mut mask = 1;
    while mask < p {
        let my_lo = rank & !(mask - 1);
        let peer_lo = my_lo ^ mask;
        let mine = range(my_lo, my_lo + mask);
        let theirs = range(peer_lo, peer_lo + mask);
        let (s, r) = split_ref_mut(buf, mine, theirs);
        comm.sendrecv(s, rank ^ mask, r, rank ^ mask, TAG)?;
        mask <<= 1;
    }
    Ok(())
}
