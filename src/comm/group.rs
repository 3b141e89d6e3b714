//! A subset of a transport's ranks as a transport of its own ([`Group`]),
//! so that any collective written over [`Transport`] runs among, say, the
//! ranks of one node or the ranks of the same local index on every node
//! (the node-aware collectives: [`crate::dense::hierarchical`]).
//!
//! No communicator is created: a group maps its ranks `0..len` onto the
//! parent's ranks and sends through the parent. Two groups sharing a pair
//! of parent ranks would share their messages, so the groups of one
//! collective must not overlap in pairs while both communicate (a node's
//! group and a group across nodes never do: one pairs ranks of the same
//! node, the other ranks of different nodes).

use super::{check_peer, Elem, Tag, Transport};
use crate::{Error, Result};

/// The ranks `ranks` of `parent`, renumbered `0..ranks.len()` in that
/// order; this process is one of them.
pub struct Group<'a, C: Transport> {
    parent: &'a C,
    ranks: Vec<usize>,
    me: usize,
}

impl<'a, C: Transport> Group<'a, C> {
    /// The group of `ranks` (distinct parent ranks, including this one).
    pub fn new(parent: &'a C, ranks: Vec<usize>) -> Result<Self> {
        let p = parent.size();
        let mut seen = vec![false; p];
        for &r in &ranks {
            if r >= p || std::mem::replace(&mut seen[r], true) {
                return Err(Error::InvalidArgument(format!(
                    "group {ranks:?}: rank {r} is out of range for {p} ranks or repeated"
                )));
            }
        }
        let me = ranks
            .iter()
            .position(|&r| r == parent.rank())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "group {ranks:?} does not contain this rank ({})",
                    parent.rank()
                ))
            })?;
        Ok(Self { parent, ranks, me })
    }

    /// The parent rank of group rank `r`.
    pub fn parent_rank(&self, r: usize) -> usize {
        self.ranks[r]
    }

    fn map(&self, r: usize) -> Result<usize> {
        check_peer(self.ranks.len(), r)?;
        Ok(self.ranks[r])
    }
}

impl<C: Transport> Transport for Group<'_, C> {
    type Request = C::Request;

    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.ranks.len()
    }
    fn send<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<()> {
        self.parent.send(buf, self.map(dest)?, tag)
    }
    fn recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()> {
        self.parent.recv(buf, self.map(src)?, tag)
    }
    fn sendrecv<T: Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: Tag,
    ) -> Result<()> {
        self.parent
            .sendrecv(send, self.map(dest)?, recv, self.map(src)?, tag)
    }
    unsafe fn isend<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<Self::Request> {
        // SAFETY: the caller's contract is the parent's.
        unsafe { self.parent.isend(buf, self.map(dest)?, tag) }
    }
    unsafe fn irecv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<Self::Request> {
        // SAFETY: the caller's contract is the parent's.
        unsafe { self.parent.irecv(buf, self.map(src)?, tag) }
    }
    fn progress_thread_ok(&self) -> bool {
        self.parent.progress_thread_ok()
    }
    /// A dissemination barrier among the group's ranks.
    fn barrier(&self) -> Result<()> {
        let (r, p) = (self.me, self.ranks.len());
        let mut d = 1;
        while d < p {
            let mut got = [0u8];
            self.sendrecv(
                &[1u8],
                (r + d) % p,
                &mut got,
                (r + p - d) % p,
                super::tags::BARRIER,
            )?;
            d *= 2;
        }
        Ok(())
    }
    fn node_ids(&self) -> Option<Vec<usize>> {
        let all = self.parent.node_ids()?;
        Some(self.ranks.iter().map(|&r| all[r]).collect())
    }
    fn abort(&self, code: i32, msg: &str) -> ! {
        self.parent.abort(code, msg)
    }
    fn aborter(&self) -> super::Aborter {
        self.parent.aborter()
    }
}
