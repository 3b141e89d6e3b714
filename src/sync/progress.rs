//! Who runs the step's collectives: the engine's progress as an explicit
//! state ([`Progress`]). The transport is held either by the engine itself
//! (`Inline`: collectives run on the caller's thread, inside `start` or a
//! bucket's submission) or by a progress thread (`Threaded`: jobs queued to
//! it in order and handed back in the same order, any number in flight), or
//! it is `Lost` (the progress thread died; the job is ended, since peers
//! may be waiting in a collective for this rank).
//!
//! Jobs run through a [`Runner`], which holds the one thing that outlives
//! a job: whether an earlier bucket of the current step already failed on
//! every rank (an error every rank got alike). The step's later buckets
//! then run no collective on any rank, alike everywhere, and the step
//! returns that first error (`bucket.rs`). A whole step is a step of one
//! bucket.
//!
//! How the progress thread waits ([`PoliteWait`], `progress_poll_us`):
//! while the caller computes, its transport tests the transfers and sleeps
//! between tests, so that on a CPU with a core per rank the backward pass
//! keeps its core (a thread spinning in MPI's blocking calls would take
//! half of it); while the caller waits for a job
//! ([`collect_job`](GradSync::collect_job)) the waits spin, as MPI's own
//! do. Back on the caller's thread the transport waits MPI's way again.

use super::job::Job;
use super::GradSync;
use crate::comm::agree::CallKind;
use crate::comm::{Aborter, PoliteWait, Transport};
use crate::{Error, Result};
use std::sync::{mpsc, Arc};

/// The engine's progress. See the module docs.
pub(super) enum Progress<C> {
    /// The engine holds the transport; collectives run on the caller's
    /// thread.
    Inline(C, Runner),
    /// A progress thread holds the transport.
    Threaded(Worker<C>),
    /// The progress thread has died and the transport with it; what ends
    /// the job from here remains.
    Lost(Aborter),
}

impl<C> Progress<C> {
    /// The transport, when the engine holds it (before any threaded step,
    /// or without a progress thread).
    pub(super) fn inline_comm(&self) -> Option<&C> {
        match self {
            Progress::Inline(c, _) => Some(c),
            Progress::Threaded(_) | Progress::Lost(_) => None,
        }
    }
}

/// A progress thread and the jobs queued to it.
pub(super) struct Worker<C> {
    jobs: mpsc::Sender<Box<Job>>,
    done: mpsc::Receiver<Box<Job>>,
    thread: std::thread::JoinHandle<C>,
    /// Jobs sent and not yet received back.
    in_flight: usize,
    /// How the thread's transport waits; urgent while the caller waits
    /// for a job ([`collect_job`](GradSync::collect_job)).
    wait: Option<Arc<PoliteWait>>,
    /// Ends the job should the thread die with the transport.
    aborter: Aborter,
}

/// Runs jobs in order, remembering the step whose earlier bucket failed
/// on every rank (module docs).
#[derive(Default)]
pub(super) struct Runner {
    failed_step: Option<u64>,
}

impl Runner {
    /// Run `job`'s collectives (or, in a step that already failed on every
    /// rank, none: the step's first error stands).
    pub(super) fn run<C: Transport>(&mut self, job: &mut Job, comm: &C) {
        if job.script.first {
            // A new step (or the same step number again, after a restore).
            self.failed_step = None;
        }
        if let Some(step) = job.script.step.filter(|&s| self.failed_step == Some(s)) {
            job.script.check = None;
            job.out.result = Some(Err(Error::InvalidArgument(format!(
                "step {step}: an earlier bucket failed on every rank"
            ))));
            return;
        }
        job.run(comm);
        if matches!(job.out.result, Some(Err(_))) {
            self.failed_step = job.script.step;
        }
    }
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Start the progress thread if allowed (idempotent); false when
    /// communication stays on this thread.
    pub(super) fn ensure_worker(&mut self) -> bool {
        match &self.progress {
            Progress::Threaded(_) => return true,
            Progress::Lost(_) => return false,
            Progress::Inline(comm, _) if !comm.progress_thread_ok() => {
                if !self.warned_no_thread {
                    log::warn!(
                        "gradsync: MPI threading level below MPI_THREAD_SERIALIZED; \
                         communicating without overlap (initialize MPI with Threading::Serialized)"
                    );
                    self.warned_no_thread = true;
                }
                return false;
            }
            Progress::Inline(..) => {}
        }
        let Progress::Inline(comm, _) = &self.progress else {
            unreachable!("matched Inline above")
        };
        let aborter = comm.aborter();
        let Progress::Inline(comm, mut runner) =
            std::mem::replace(&mut self.progress, Progress::Lost(aborter.clone()))
        else {
            unreachable!("matched Inline above")
        };
        let (jtx, jrx) = mpsc::channel::<Box<Job>>();
        let (dtx, drx) = mpsc::channel::<Box<Job>>();
        let us = self.cfg.progress_poll_us;
        let wait = (us > 0)
            .then(|| Arc::new(PoliteWait::new(std::time::Duration::from_micros(us.into()))));
        let thread_wait = wait.clone();
        // The transport moves into the closure; `spawn` fails before taking
        // it only in theory (std gives the closure back to no one), so a
        // failed spawn loses it: the engine then cannot communicate at all.
        let spawned = std::thread::Builder::new()
            .name("gradsync-progress".into())
            .spawn(move || {
                let mut comm = comm;
                comm.set_wait(thread_wait);
                while let Ok(mut job) = jrx.recv() {
                    runner.run(&mut job, &comm);
                    if dtx.send(job).is_err() {
                        break;
                    }
                }
                // Back on the caller's thread, MPI's blocking calls again.
                comm.set_wait(None);
                comm
            });
        match spawned {
            Ok(thread) => {
                self.progress = Progress::Threaded(Worker {
                    jobs: jtx,
                    done: drx,
                    thread,
                    in_flight: 0,
                    wait,
                    aborter,
                });
                true
            }
            Err(e) => {
                let msg = format!("cannot start the progress thread: {e}");
                // The transport went with the closure that was not run.
                self.abort_job(&msg)
            }
        }
    }

    /// Run `job`'s collectives: queued to the progress thread (true is
    /// returned; [`collect_job`](Self::collect_job) gets it back, in
    /// order), or here.
    pub(super) fn dispatch(&mut self, mut job: Box<Job>) -> (bool, Option<Box<Job>>) {
        match &mut self.progress {
            Progress::Inline(comm, runner) => {
                runner.run(&mut job, comm);
                (false, Some(job))
            }
            Progress::Threaded(w) => {
                if w.jobs.send(job).is_ok() {
                    w.in_flight += 1;
                    return (true, None);
                }
                // The progress thread is gone (it panicked): peers may be
                // waiting for this rank's part of the step.
                self.abort_job("the progress thread has exited")
            }
            Progress::Lost(_) => self.abort_job("the transport was lost with the progress thread"),
        }
    }

    /// The oldest job in flight, back from the progress thread (blocking
    /// until its collectives are done).
    pub(super) fn collect_job(&mut self) -> Box<Job> {
        if let Progress::Threaded(w) = &mut self.progress {
            // The caller waits now: the progress thread may spin.
            let urgent = |on| w.wait.as_ref().map(|p| p.set_urgent(on));
            urgent(true);
            let job = w.done.recv();
            urgent(false);
            if let Ok(job) = job {
                w.in_flight -= 1;
                return job;
            }
        }
        self.abort_job("the progress thread has exited")
    }

    /// Agree on a rank-local outcome between steps (collective), on the
    /// progress thread if there is one: one small max-allreduce that also
    /// checks `print.0` is the same on every rank, plus the error texts
    /// only when some rank failed, after the call itself (`call`, [`crate::comm::agree::agree_call`]). Every
    /// rank returns the same [`Error::RankFailed`] if any rank passed
    /// `Err`, else [`Error::ArgumentMismatch`] with `print.1` if the values
    /// differ.
    pub(crate) fn agree_status(
        &mut self,
        call: CallKind,
        local: Result<()>,
        print: (u64, String),
    ) -> Result<()> {
        if self.pending() {
            return Err(Error::InvalidArgument("not between start and wait".into()));
        }
        let mut job = self.spare_job();
        job.script.print = Some((print.0, print.1, local));
        job.script.call = Some((call, self.step));
        job.script.check = None;
        job.script.first = false;
        job.script.do_gather = false;
        job.script.do_reduce = false;
        job.script.do_gvq = false;
        job.script.do_psg = false;
        job.script.do_sparse = false;
        job.script.step = None;
        job.out.result = None;
        let mut job = match self.dispatch(job) {
            (_, Some(job)) => job,
            (_, None) => self.collect_job(),
        };
        let r = job.out.result.take().unwrap_or(Ok(()));
        self.work.spare.push(job);
        r
    }

    /// Stop the progress thread (after the jobs in flight: their buffers
    /// are in use by MPI) and take the transport back from it.
    pub(super) fn stop_worker(&mut self) {
        if let Progress::Threaded(w) = &self.progress {
            let lost = Progress::Lost(w.aborter.clone());
            let Progress::Threaded(w) = std::mem::replace(&mut self.progress, lost) else {
                unreachable!("matched Threaded above")
            };
            for _ in 0..w.in_flight {
                if w.done.recv().is_err() {
                    break;
                }
            }
            drop(w.jobs);
            if let Ok(comm) = w.thread.join() {
                self.progress = Progress::Inline(comm, Runner::default());
            }
        }
    }

    /// End the whole job from this rank ([`Transport::abort`], `MPI_Abort`
    /// over MPI) with `msg`: for a failure the other ranks can no longer
    /// be told of in the same step.
    pub(super) fn abort_job(&mut self, msg: &str) -> ! {
        self.stop_worker();
        match &self.progress {
            Progress::Inline(comm, _) => comm.abort(1, msg),
            Progress::Threaded(w) => w.aborter.abort(1, msg),
            Progress::Lost(aborter) => aborter.abort(1, msg),
        }
    }
}

impl<C: Transport + Send + 'static> Drop for GradSync<C> {
    fn drop(&mut self) {
        self.stop_worker();
    }
}
