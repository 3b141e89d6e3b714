//! A progress thread that dies mid-step ends the whole job (`tests/failure.rs`):
//! the failure model's rule for a failure that no peer can be told of in
//! the same step. The engine's transport here is MPI behind a wrapper that
//! panics on the chosen rank's progress thread in step 2, inside the
//! step's collectives, with the thread holding the transport: the rank must
//! end the job (`MPI_Abort` on `MPI_COMM_WORLD`, with a message naming the
//! rank and the cause) instead of leaving its peers in the collective.
//!
//! ```text
//! mpirun -np 3 target/release/examples/progress_death 1
//! ```
//!
//! Prints `STEP <s> OK` per finished step on every rank; never exits 0 when
//! the failure happens (the job is aborted).

use gradsync::comm::{Aborter, Elem, MpiComm, PoliteWait, Tag, Transport};
use gradsync::sync::{Config, GradSync, Strategy};
use gradsync::Result;
use mpi::traits::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// MPI, with a panic on the progress thread once `armed` is set.
struct Dying {
    inner: MpiComm,
    armed: Arc<AtomicBool>,
}

impl Dying {
    fn maybe_die(&self) {
        let on_progress = std::thread::current().name() == Some("gradsync-progress");
        if on_progress && self.armed.load(Ordering::SeqCst) {
            panic!("progress_death: the progress thread dies on purpose");
        }
    }
}

impl Transport for Dying {
    type Request = <MpiComm as Transport>::Request;

    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<()> {
        self.maybe_die();
        self.inner.send(buf, dest, tag)
    }
    fn recv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()> {
        self.maybe_die();
        self.inner.recv(buf, src, tag)
    }
    fn sendrecv<T: Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: Tag,
    ) -> Result<()> {
        self.maybe_die();
        self.inner.sendrecv(send, dest, recv, src, tag)
    }
    unsafe fn isend<T: Elem>(&self, buf: &[T], dest: usize, tag: Tag) -> Result<Self::Request> {
        self.maybe_die();
        // SAFETY: the caller keeps `isend`'s contract, passed on as is.
        unsafe { self.inner.isend(buf, dest, tag) }
    }
    unsafe fn irecv<T: Elem>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<Self::Request> {
        self.maybe_die();
        // SAFETY: the caller keeps `irecv`'s contract, passed on as is.
        unsafe { self.inner.irecv(buf, src, tag) }
    }
    fn progress_thread_ok(&self) -> bool {
        self.inner.progress_thread_ok()
    }
    fn set_wait(&mut self, wait: Option<Arc<PoliteWait>>) {
        self.inner.set_wait(wait)
    }
    fn barrier(&self) -> Result<()> {
        self.maybe_die();
        self.inner.barrier()
    }
    fn abort(&self, code: i32, msg: &str) -> ! {
        self.inner.abort(code, msg)
    }
    fn aborter(&self) -> Aborter {
        self.inner.aborter()
    }
}

fn main() {
    let bad: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("usage: progress_death RANK");
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Serialized).expect("MPI initialized once");
    let world = universe.world();
    let rank = world.rank() as usize;
    let armed = Arc::new(AtomicBool::new(false));
    let comm = Dying {
        inner: MpiComm::duplicate_of(&world).expect("transport"),
        armed: armed.clone(),
    };
    let cfg = Config {
        overlap: true,
        ..Config::default()
    };
    let mut gs = GradSync::with_transport(comm, cfg).expect("engine");
    gs.register_with("w", &[4096], Strategy::Dense)
        .expect("layer");
    let mut g = vec![rank as f32; 4096];
    for step in 0..4u64 {
        if step == 2 && rank == bad {
            armed.store(true, Ordering::SeqCst);
        }
        gs.start(&[&g]).expect("start");
        let mut out = vec![0.0f32; 4096];
        gs.wait(&mut [&mut out]).expect("wait");
        g.copy_from_slice(&out);
        println!("STEP {step} OK");
    }
}
