//! In-process transport: `p` ranks as `p` threads sharing mailboxes.
//!
//! Sends are buffered (copied into the destination's mailbox and complete at
//! once), receives match on `(source, tag)` in arrival order, which gives MPI's
//! non-overtaking rule. A receive that waits longer than the timeout (default
//! 60 s) fails instead of hanging a test forever.

use super::{check_peer, Aborter, Elem, Request, Tag, Transport};
use crate::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Msg {
    src: usize,
    tag: Tag,
    data: Vec<u8>,
}

#[derive(Default)]
struct Mailbox {
    queue: Mutex<VecDeque<Msg>>,
    arrived: Condvar,
}

struct Shared {
    boxes: Vec<Mailbox>,
    /// Set when a rank thread panicked, so the others fail fast instead of
    /// waiting for messages that will never come.
    aborted: AtomicBool,
    timeout: Duration,
}

/// One rank of an in-process communicator. Create all ranks with
/// [`LocalComm::create`] or run a closure on every rank with [`LocalComm::run`].
///
/// ```
/// use gradsync::comm::{LocalComm, Transport};
/// let sums = LocalComm::run(3, |c| {
///     let mut v = vec![c.rank() as f32; 4];
///     gradsync::dense::rabenseifner_allreduce(&c, &mut v, &Default::default()).unwrap();
///     v[0]
/// });
/// assert_eq!(sums, vec![3.0; 3]);
/// ```
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// Create the `size` ranks of a new in-process communicator.
    pub fn create(size: usize) -> Vec<LocalComm> {
        Self::create_with_timeout(size, Duration::from_secs(60))
    }

    /// As [`create`](Self::create), with a receive timeout.
    pub fn create_with_timeout(size: usize, timeout: Duration) -> Vec<LocalComm> {
        assert!(size > 0, "a communicator needs at least one rank");
        let shared = Arc::new(Shared {
            boxes: (0..size).map(|_| Mailbox::default()).collect(),
            aborted: AtomicBool::new(false),
            timeout,
        });
        (0..size)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Run `f` on every rank of a fresh `size`-rank communicator, one thread per
    /// rank, and return the results in rank order.
    pub fn run<R: Send, F: Fn(LocalComm) -> R + Sync>(size: usize, f: F) -> Vec<R> {
        let comms = Self::create(size);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let f = &f;
                    s.spawn(move || {
                        let _guard = AbortOnPanic(c.shared.clone());
                        f(c)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        })
    }

    fn push(&self, dest: usize, tag: Tag, bytes: &[u8]) -> Result<()> {
        check_peer(self.size(), dest)?;
        let mb = &self.shared.boxes[dest];
        let mut q = mb.queue.lock().map_err(|_| poisoned())?;
        q.push_back(Msg {
            src: self.rank,
            tag,
            data: bytes.to_vec(),
        });
        mb.arrived.notify_all();
        Ok(())
    }

    fn pop_into(&self, out: &mut [u8], elem: usize, src: usize, tag: Tag) -> Result<()> {
        check_peer(self.size(), src)?;
        let mb = &self.shared.boxes[self.rank];
        let deadline = Instant::now() + self.shared.timeout;
        let mut q = mb.queue.lock().map_err(|_| poisoned())?;
        loop {
            if let Some(pos) = q.iter().position(|m| m.src == src && m.tag == tag) {
                let m = q.remove(pos).expect("position is in range");
                if m.data.len() != out.len() {
                    return Err(Error::MessageSize {
                        peer: src,
                        tag,
                        expected: out.len() / elem.max(1),
                        got: m.data.len() / elem.max(1),
                    });
                }
                out.copy_from_slice(&m.data);
                return Ok(());
            }
            if self.shared.aborted.load(Ordering::SeqCst) {
                return Err(Error::Transport(format!(
                    "rank {}: another rank panicked or aborted while this one waited for rank {src} (tag {tag})",
                    self.rank
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Transport(format!(
                    "rank {} timed out waiting for a message from rank {src} with tag {tag}",
                    self.rank
                )));
            }
            q = mb
                .arrived
                .wait_timeout(q, deadline - now)
                .map_err(|_| poisoned())?
                .0;
        }
    }
}

/// Marks the communicator aborted if its rank thread unwinds.
struct AbortOnPanic(Arc<Shared>);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.aborted.store(true, Ordering::SeqCst);
            for mb in &self.0.boxes {
                let _q = mb.queue.lock();
                mb.arrived.notify_all();
            }
        }
    }
}

fn poisoned() -> Error {
    Error::Transport("in-process mailbox poisoned by a panicking rank".into())
}

/// Request of the in-process transport: sends are already complete; a
/// receive is carried out when waited on.
pub struct LocalRequest {
    pending: Option<PendingRecv>,
}

struct PendingRecv {
    comm: LocalComm,
    ptr: *mut u8,
    len: usize,
    elem: usize,
    src: usize,
    tag: Tag,
}

// SAFETY: the raw pointer is only dereferenced under the `irecv` contract
// (buffer alive and unaliased until the request completes).
unsafe impl Send for LocalRequest {}

impl LocalRequest {
    fn complete(&mut self) -> Result<()> {
        match self.pending.take() {
            None => Ok(()),
            Some(p) => {
                // SAFETY: guaranteed by the contract of `Transport::irecv`.
                let out = unsafe { std::slice::from_raw_parts_mut(p.ptr, p.len) };
                p.comm.pop_into(out, p.elem, p.src, p.tag)
            }
        }
    }
}

impl Request for LocalRequest {
    fn wait(mut self) -> Result<()> {
        self.complete()
    }
}

impl Drop for LocalRequest {
    fn drop(&mut self) {
        if let Err(e) = self.complete() {
            log::warn!("in-process request dropped with an error: {e}");
        }
    }
}

/// Fail every rank of `shared` (their waits return errors) and panic on
/// this one: the in-process job's `MPI_Abort`.
fn abort_local(shared: &Shared, rank: usize, code: i32, msg: &str) -> ! {
    shared.aborted.store(true, Ordering::SeqCst);
    for mb in &shared.boxes {
        let _q = mb.queue.lock();
        mb.arrived.notify_all();
    }
    panic!(
        "gradsync: rank {rank} of {}: {msg}; aborting the job (code {code})",
        shared.boxes.len()
    )
}

impl Transport for LocalComm {
    type Request = LocalRequest;

    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.boxes.len()
    }

    fn abort(&self, code: i32, msg: &str) -> ! {
        abort_local(&self.shared, self.rank, code, msg)
    }

    fn aborter(&self) -> Aborter {
        let (shared, rank) = (self.shared.clone(), self.rank);
        Aborter::new(move |code, msg| abort_local(&shared, rank, code, msg))
    }

    fn send<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<()> {
        self.push(dest, tag, bytemuck::cast_slice(buf))
    }

    fn recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()> {
        self.pop_into(
            bytemuck::cast_slice_mut(buf),
            std::mem::size_of::<T>(),
            src,
            tag,
        )
    }

    fn sendrecv<T: Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: Tag,
    ) -> Result<()> {
        self.send(send, dest, tag)?;
        self.recv(recv, src, tag)
    }

    unsafe fn isend<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<LocalRequest> {
        self.send(buf, dest, tag)?;
        Ok(LocalRequest { pending: None })
    }

    unsafe fn irecv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<LocalRequest> {
        check_peer(self.size(), src)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        Ok(LocalRequest {
            pending: Some(PendingRecv {
                comm: LocalComm {
                    rank: self.rank,
                    shared: self.shared.clone(),
                },
                ptr: bytes.as_mut_ptr(),
                len: bytes.len(),
                elem: std::mem::size_of::<T>(),
                src,
                tag,
            }),
        })
    }

    /// Dissemination barrier over the mailboxes (so it honours the timeout
    /// and the abort flag, unlike `std::sync::Barrier`).
    fn barrier(&self) -> Result<()> {
        const TAG_BARRIER: Tag = super::tags::BARRIER;
        let (rank, p) = (self.rank, self.size());
        let mut k = 1;
        while k < p {
            self.send::<u8>(&[], (rank + k) % p, TAG_BARRIER)?;
            self.recv::<u8>(&mut [], (rank + p - k) % p, TAG_BARRIER)?;
            k <<= 1;
        }
        Ok(())
    }
}
