//! The progress job: one communication round's buffers and flags
//! ([`Job`]), moved to the progress thread ([`Worker`]) and back, and the
//! collectives it runs: the fused sparse messages' allgatherv
//! ([`crate::sparse`], RedSync §4), the fused dense buffer's allreduce
//! (Rabenseifner, with a status word after the data) and GradiVeQ's
//! compressed-domain rings. A failure flagged by any rank reaches every rank
//! as the same [`crate::Error::RankFailed`]; any other error ends the job
//! ([`crate::failure`]). Also the between-steps status agreement used by
//! snapshot restores.

use super::layer::Layer;
use super::plan::StepPlan;
use super::{Config, GradSync};
use crate::comm::Transport;
use crate::dense::{
    allreduce_with, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Gathered, ReduceOp, Workspace,
};
use crate::sparse::{failure_text, fused_allgather, write_failed, write_fused, EntryKind};
use crate::{Error, Result};
use std::sync::mpsc;
use std::time::Instant;

/// Buffers and flags of one communication round; moved to the progress
/// thread and back.
#[derive(Default)]
pub(super) struct Job {
    pub(super) fused: Vec<u8>,
    pub(super) gathered: Gathered,
    pub(super) dense: Vec<f32>,
    pub(super) ws: Workspace<f32>,
    pub(super) do_gather: bool,
    pub(super) do_reduce: bool,
    pub(super) do_gvq: bool,
    /// Elements of `dense` before its status word.
    pub(super) dense_len: usize,
    /// The step, for failure messages (`None` between steps).
    pub(super) step: Option<u64>,
    /// This rank's own failure in the local phase (error text).
    pub(super) local_failed: Option<String>,
    pub(super) gather_algo: Option<AllgathervAlgo>,
    pub(super) reduce_algo: Option<AllreduceAlgo>,
    pub(super) allgather_s: f64,
    pub(super) allreduce_s: f64,
    /// GradiVeQ layers of this step: state, input, output.
    pub(super) gvq: Vec<GvqEntry>,
    pub(super) gvq_s: f64,
    pub(super) result: Option<Result<()>>,
}

#[derive(Default)]
pub(super) struct GvqEntry {
    pub(super) layer: usize,
    pub(super) state: Option<crate::gradiveq::schedule::GradiveqLayer>,
    pub(super) input: Vec<f32>,
    pub(super) output: Vec<f32>,
}

impl Job {
    /// Run the step's collectives. Errors every rank got alike (a failure
    /// flagged in the step's status, corrupt data every rank received)
    /// return to the caller; any other error may be this rank's alone while
    /// its peers block in a collective, so it ends the job
    /// ([`Transport::abort`], the failure model of [`crate::failure`]).
    pub(super) fn run<C: Transport>(&mut self, comm: &C) {
        let r = self.communicate(comm);
        if let Err(e) = &r {
            if !e.is_collective() {
                let at = self
                    .step
                    .map_or_else(String::new, |s| format!("step {s}: "));
                comm.abort(1, &format!("{at}{e}"));
            }
        }
        self.result = Some(r);
    }

    pub(super) fn communicate<C: Transport>(&mut self, comm: &C) -> Result<()> {
        // Every rank's failure text (empty = ok), once any rank failed.
        let mut failed: Option<Vec<String>> = None;
        if self.do_gather {
            let t = Instant::now();
            let algo = self
                .gather_algo
                .unwrap_or(AllgathervAlgo::RecursiveDoubling);
            fused_allgather(comm, &self.fused, algo, &mut self.gathered)?;
            self.allgather_s = t.elapsed().as_secs_f64();
            // The common path only looks at each message's magic.
            let g = &self.gathered;
            if (0..g.len()).any(|r| failure_text(g.message(r)).is_some()) {
                failed = Some(
                    (0..g.len())
                        .map(|r| failure_text(g.message(r)).unwrap_or_default())
                        .collect(),
                );
            }
        }
        if self.do_reduce && failed.is_none() {
            let t = Instant::now();
            let opts = AllreduceOptions {
                op: ReduceOp::Average,
                // The layer table was checked at registration.
                validate: false,
                chunk_elems: 0,
            };
            let algo = self.reduce_algo.unwrap_or(AllreduceAlgo::Rabenseifner);
            allreduce_with(comm, &mut self.dense, algo, &opts, &mut self.ws)?;
            self.allreduce_s = t.elapsed().as_secs_f64();
            // The status word: the fraction of ranks that failed.
            if self.dense[self.dense_len] != 0.0 {
                let mine = self.local_failed.clone().unwrap_or_default();
                let g = crate::dense::allgatherv(
                    comm,
                    mine.as_bytes(),
                    AllgathervAlgo::RecursiveDoubling,
                )?;
                failed = Some(
                    (0..g.len())
                        .map(|r| String::from_utf8_lossy(g.message(r)).into_owned())
                        .collect(),
                );
            }
        }
        if failed.is_none() && comm.size() == 1 {
            failed = self.local_failed.clone().map(|t| vec![t]);
        }
        if let Some(texts) = failed {
            return Err(
                crate::failure::rank_failed(&texts, self.step).unwrap_or_else(|| {
                    Error::RankFailed {
                        rank: 0,
                        others: 0,
                        step: self.step,
                        message: "(a rank flagged a failure without a message)".into(),
                    }
                }),
            );
        }
        let t = Instant::now();
        if self.do_gvq {
            for e in &mut self.gvq {
                let st = e.state.as_mut().ok_or_else(|| {
                    Error::Transport("GradiVeQ state missing from the job".into())
                })?;
                st.step(comm, &e.input, &mut e.output)?;
            }
        }
        self.gvq_s = t.elapsed().as_secs_f64();
        Ok(())
    }
}

pub(super) struct Worker<C> {
    pub(super) jobs: mpsc::Sender<Box<Job>>,
    pub(super) done: mpsc::Receiver<Box<Job>>,
    pub(super) thread: std::thread::JoinHandle<C>,
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Agree on a rank-local outcome between steps (collective), through the
    /// step's status-word path: a one-word allreduce, plus the error texts
    /// only when some rank failed. Every rank returns the same
    /// [`Error::RankFailed`] if any rank passed `Err`.
    pub(crate) fn agree_status(&mut self, local: Result<()>) -> Result<()> {
        if self.started.is_some() {
            return Err(Error::InvalidArgument("not between start and wait".into()));
        }
        let mut job = self.job.take().expect("job buffers present when idle");
        job.dense.clear();
        job.dense.push(if local.is_err() { 1.0 } else { 0.0 });
        job.dense_len = 0;
        job.do_gather = false;
        job.do_reduce = true;
        job.do_gvq = false;
        job.local_failed = local.as_ref().err().map(|e| e.to_string());
        job.step = None;
        job.result = None;
        job.reduce_algo = Some(self.cfg.allreduce);
        let mut job = match &self.worker {
            Some(w) => {
                if let Err(mpsc::SendError(_)) = w.jobs.send(job) {
                    panic!("gradsync: the progress thread has exited");
                }
                w.done
                    .recv()
                    .unwrap_or_else(|_| panic!("gradsync: the progress thread has exited"))
            }
            None => {
                job.run(self.comm.as_ref().expect("transport held without a worker"));
                job
            }
        };
        let r = job.result.take().unwrap_or(Ok(()));
        self.job = Some(job);
        r.and(local)
    }

    /// Start the progress thread if allowed; false when communication must
    /// stay on this thread.
    pub(super) fn ensure_worker(&mut self) -> bool {
        if self.worker.is_some() {
            return true;
        }
        let Some(comm) = self.comm.take() else {
            return false;
        };
        if !comm.progress_thread_ok() {
            if !self.warned_no_thread {
                log::warn!(
                    "gradsync: MPI threading level below MPI_THREAD_SERIALIZED; \
                     communicating without overlap (initialize MPI with Threading::Serialized)"
                );
                self.warned_no_thread = true;
            }
            self.comm = Some(comm);
            return false;
        }
        let (jtx, jrx) = mpsc::channel::<Box<Job>>();
        let (dtx, drx) = mpsc::channel::<Box<Job>>();
        let spawned = std::thread::Builder::new()
            .name("gradsync-progress".into())
            .spawn(move || {
                while let Ok(mut job) = jrx.recv() {
                    job.run(&comm);
                    if dtx.send(job).is_err() {
                        break;
                    }
                }
                comm
            });
        match spawned {
            Ok(thread) => {
                self.worker = Some(Worker {
                    jobs: jtx,
                    done: drx,
                    thread,
                });
                true
            }
            Err(e) => {
                // The closure (and the transport) is lost only if spawn
                // fails after taking it, which std does not do.
                log::warn!("gradsync: cannot start the progress thread: {e}");
                false
            }
        }
    }
}

impl<C: Transport + Send + 'static> Drop for GradSync<C> {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            if self.in_flight {
                // Let the round finish: its buffers are in use by MPI.
                let _ = w.done.recv();
            }
            drop(w.jobs);
            if let Ok(comm) = w.thread.join() {
                drop(comm);
            }
        }
    }
}

impl Job {
    /// Pack the step as `plan` says: the dense status word after the fused
    /// dense buffer (filled by the local phase), this rank's fused sparse
    /// message (or its failure marker when `local` failed), and the
    /// collectives to run.
    pub(super) fn pack(
        &mut self,
        plan: &StepPlan,
        layers: &[Layer],
        cfg: &Config,
        local: &Result<()>,
    ) {
        let step = plan.step;
        let dense_len = plan.dense.elems;
        // Dense layers: the status word after the fused buffer (0 = ok).
        self.dense.resize(dense_len + 1, 0.0);
        self.dense[dense_len] = if local.is_err() { 1.0 } else { 0.0 };
        self.dense_len = dense_len;
        match local {
            Ok(()) => write_fused(
                &mut self.fused,
                step,
                plan.sparse.ids.iter().map(|&i| {
                    let l = &layers[i as usize];
                    let kind = if l.non_finite {
                        EntryKind::NonFinite
                    } else {
                        EntryKind::Unit
                    };
                    (i, kind, if l.non_finite { &[][..] } else { &l.unit[..] })
                }),
            ),
            Err(e) => write_failed(&mut self.fused, step, &e.to_string()),
        }
        self.step = Some(step);
        self.local_failed = local.as_ref().err().map(|e| e.to_string());
        self.do_gather = plan.gather;
        self.do_gvq = plan.rings;
        self.do_reduce = plan.reduce;
        self.gvq_s = 0.0;
        self.gather_algo = Some(cfg.allgather);
        self.reduce_algo = Some(cfg.allreduce);
        self.allgather_s = 0.0;
        self.allreduce_s = 0.0;
        self.result = None;
        if !self.do_gather && !plan.sparse.ids.is_empty() {
            // One rank: the gathered data is our own message.
            self.gathered.data.clear();
            self.gathered.data.extend_from_slice(&self.fused);
            self.gathered.displs.clear();
            self.gathered.displs.extend([0, self.fused.len()]);
        }
    }
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Run the packed `job`'s collectives: on the progress thread when
    /// overlap is on and allowed (true is returned; [`collect`](Self::collect)
    /// gets the job back), else here. A step without any collective (a
    /// delayed local step, one rank) only records `local`'s outcome, as
    /// this rank's alone.
    pub(super) fn communicate(&mut self, mut job: Box<Job>, local: &Result<()>) -> bool {
        if !(job.do_gather || job.do_reduce || job.do_gvq) {
            job.result = Some(match local {
                Ok(()) => Ok(()),
                // No exchange this step (a delayed local step or one rank):
                // the error is this rank's alone.
                Err(e) => Err(Error::RankFailed {
                    rank: self.rank,
                    others: 0,
                    step: job.step,
                    message: e.to_string(),
                }),
            });
            self.job = Some(job);
            return false;
        }
        if self.cfg.overlap && self.ensure_worker() {
            let w = self.worker.as_ref().expect("worker just ensured");
            if let Err(mpsc::SendError(job)) = w.jobs.send(job) {
                // The progress thread is gone (it panicked): peers may
                // be waiting for this rank's part of the step.
                let comm = self.comm.as_ref();
                drop(job);
                let msg = "gradsync: the progress thread has exited";
                match comm {
                    Some(c) => c.abort(1, msg),
                    None => panic!("{msg}"),
                }
            }
            self.in_flight = true;
            true
        } else {
            job.run(self.comm.as_ref().expect("transport held without a worker"));
            self.job = Some(job);
            false
        }
    }

    /// The step's job back from the progress thread (blocking until its
    /// round is done), or from this thread.
    pub(super) fn collect(&mut self) -> Result<Box<Job>> {
        if self.in_flight {
            self.in_flight = false;
            let w = self.worker.as_ref().expect("in-flight job has a worker");
            w.done
                .recv()
                .map_err(|_| Error::Transport("progress thread has exited".into()))
        } else {
            Ok(self.job.take().expect("job buffers present"))
        }
    }
}
