//! A step as a program of buckets (Horovod's tensor fusion and DDP's
//! buckets, inside the engine): the caller hands the step's gradients over
//! in parts, each part (a *bucket*: any subset of the registered layers) as
//! soon as backward has produced it, and finishes the step once.
//!
//! Each bucket runs the same script as a whole step, on its own layers:
//! its plan is the step's plan restricted to them
//! ([`restrict_into`](super::plan::restrict_into); every per-step decision
//! is taken once, for the whole step, when its first bucket arrives:
//! warm-up, density schedule, delay, auto's plan, the exchange, the
//! algorithms), its local math runs on the caller's thread, and its
//! collectives are one job queued to the progress thread, which runs the
//! jobs in order while the caller goes on computing. Unpacking waits for
//! every bucket, in [`GradSync::finish_step`]: the policies that look at the
//! whole step (a failure anywhere voids it everywhere; `delay > 1`'s void
//! step on a NaN) see all of it. A whole step
//! ([`start`](GradSync::start)/[`wait`](GradSync::wait)) is the program of
//! one bucket.
//!
//! # Bit for bit
//!
//! A bucketed step's results equal the whole step's bit for bit, for every
//! layer strategy: per-layer math does not depend on the cut; sparse units
//! are decoded per layer in rank order; the sparse allreduces sum each
//! index in rank order; and Rabenseifner's allreduce gives an element the
//! same summation tree wherever it sits in the buffer (its recursive
//! halving pairs ranks alike for every element, and `a + b = b + a` in
//! IEEE arithmetic). Where that cannot hold, the step is *staged*: the
//! buckets' gradients are copied into the engine and the step runs as one
//! bucket when the last arrives (no overlap; logged once). That is the
//! case for local clipping (`clip_norm`: the factor needs the whole
//! gradient's norm), for dense layers or PowerSGD's factors summed by an
//! algorithm whose order depends on an element's place (`ring`,
//! `hierarchical`, `mpi`, or what `auto` chose among them), for GradiVeQ's
//! rings (they advance their state as they run), and for the node-aware
//! sparse allreduce. PowerSGD's layers run in their bucket: their state,
//! advanced there, is rolled back with the step's if a later bucket fails
//! (`PowerSgd::rollback`), as a whole step that fails leaves it.
//!
//! # Failures
//!
//! A bucket's first collective agrees its fingerprint: the step, its
//! place in the step, its layers, and every bucket before it. Ranks that
//! cut the step differently (another order, another split, a bucket
//! missing) fail that agreement alike, with
//! [`Error::ArgumentMismatch`] naming what each rank submitted, before any
//! collective whose size depends on the cut; a failed bucket (this or a
//! rank-local failure) makes every later bucket of the step run nothing on
//! every rank ([`super::progress::Runner`]), and the step returns its
//! first error on every rank, nothing applied anywhere. The last bucket is
//! the one that completes the table, the same on every rank whose
//! fingerprints agreed; [`GradSync::finish_step`] before that submits the
//! missing layers as a failed bucket, so peers waiting in it are released
//! with the error. Misuse that no peer can see (a layer named twice, out of
//! range, already submitted) is refused on this rank without entering
//! anything, and the step goes on.

use super::job::{Job, RoundBuffers};
use super::plan::{restrict_into, StepScript};
use super::table::{fnv, FNV_OFFSET};
use super::{GradSync, LayerId, SparseExchange, StartInfo, StepStats};
use crate::comm::agree::CallKind;
use crate::comm::Transport;
use crate::dense::AllreduceAlgo;
use crate::sparse::Entry;
use crate::{Error, Result};
use std::time::Instant;

/// Layers not yet submitted in the open step.
const NONE: u32 = u32::MAX;

/// What the engine is doing between calls: the step's state as a type.
#[derive(Default)]
pub(super) enum StepState {
    /// Between steps.
    #[default]
    Idle,
    /// Buckets of the current step have been submitted.
    Open(Box<OpenStep>),
}

/// One bucket of the open step: its plan and its job (`None` while the
/// progress thread holds it).
pub(super) struct Part {
    pub(super) plan: StepScript,
    pub(super) job: Option<Box<Job>>,
    /// Every rank's parsed units of the bucket's fused message.
    pub(super) entries: Vec<Entry>,
}

/// The open step.
#[derive(Default)]
pub(super) struct OpenStep {
    pub(super) parts: Vec<Part>,
    /// Per layer: the part that holds it (`NONE`: not submitted yet).
    pub(super) owner: Vec<u32>,
    /// Layers submitted.
    submitted: usize,
    /// Buckets submitted by the caller.
    buckets: usize,
    /// The fingerprint of the buckets so far.
    seq: u64,
    /// A staged step's gradients (module docs).
    staged: Option<Staged>,
    /// Accumulated over the buckets, for the step's stats.
    pub(super) info: StartInfo,
}

impl OpenStep {
    /// No bucket submitted yet (the step was opened by a refused one).
    pub(super) fn is_empty(&self) -> bool {
        self.buckets == 0
    }
}

/// Job buffers, bucket plans and a step's bookkeeping, kept across
/// steps.
#[derive(Default)]
pub(super) struct Workspace {
    // Boxed: a job moves to the progress thread and back by pointer.
    #[allow(clippy::vec_box)]
    pub(super) spare: Vec<Box<Job>>,
    pub(super) spare_parts: Vec<Part>,
    pub(super) spare_step: Option<Box<OpenStep>>,
    /// One rank's parsed units while unpacking (`unpack.rs`).
    pub(super) rank_entries: Vec<Entry>,
    /// Float32 workspaces of half-precision gradients (`mixed.rs`).
    pub(super) widened: Vec<Vec<f32>>,
}

/// A staged step: every layer's gradient and weights, copied as its
/// bucket arrives; the first of this rank's failures.
#[derive(Default)]
struct Staged {
    grads: Vec<Vec<f32>>,
    weights: Vec<Vec<f32>>,
    with_weights: bool,
    error: Option<Error>,
}

/// A bucket's gradients (and weights), or this rank's failure to give them.
pub(super) type Input<'a> = Result<(&'a [&'a [f32]], Option<&'a [&'a [f32]]>)>;

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Submit one bucket of this step: `grads[j]` is layer `layers[j]`'s
    /// gradient (any order, any subset of the layers not yet submitted in
    /// this step). Its compression runs here; its collectives are queued to
    /// the progress thread and run while the caller goes on (inline when
    /// `overlap` is off or MPI's thread level is below
    /// `MPI_THREAD_SERIALIZED`). The gradients are no longer needed when
    /// it returns. Every rank must cut the step into the same buckets in
    /// the same order (checked: otherwise every rank gets the same error
    /// at [`finish_step`](Self::finish_step)). Finish with
    /// [`finish_step`](Self::finish_step).
    ///
    /// Errors returned here are this rank's misuse (a layer out of range,
    /// named twice, already submitted in this step), refused before
    /// anything is entered, or the table check of the first step; a
    /// bucket whose gradients are wrong is carried to every rank and fails
    /// the step at `finish_step`.
    ///
    /// ```
    /// use gradsync::comm::LocalComm;
    /// use gradsync::sync::{Config, GradSync, LayerId};
    /// let out = LocalComm::run(2, |comm| {
    ///     let mut s = GradSync::with_transport(comm, Config::default()).unwrap();
    ///     let a = s.register_spec("fc1", &[4096], "rgc:density=0.01").unwrap();
    ///     let b = s.register("fc2", &[64]).unwrap();
    ///     let (ga, gb) = (vec![1.0f32; 4096], vec![2.0f32; 64]);
    ///     // Backward produces fc2 first: its bucket starts at once.
    ///     s.submit_bucket(&[b], &[&gb[..]]).unwrap();
    ///     s.submit_bucket(&[a], &[&ga[..]]).unwrap();
    ///     let (mut oa, mut ob) = (vec![0.0f32; 4096], vec![0.0f32; 64]);
    ///     s.finish_step(&mut [&mut oa[..], &mut ob[..]]).unwrap();
    ///     (oa.iter().filter(|&&x| x != 0.0).count(), ob[0])
    /// });
    /// assert_eq!(out[0], (41, 2.0));
    /// ```
    pub fn submit_bucket(&mut self, layers: &[LayerId], grads: &[&[f32]]) -> Result<()> {
        if self.cfg.weight_decay != 0.0 {
            return self.submit_impl(
                layers,
                Err(Error::InvalidArgument(
                    "weight_decay is set but no weights were given \
                     (submit_bucket_with_weights)"
                        .into(),
                )),
            );
        }
        self.submit_impl(layers, Ok((grads, None)))
    }

    /// [`submit_bucket`](Self::submit_bucket) with the bucket's weights
    /// (`weights[j]` is layer `layers[j]`'s), for weight decay.
    pub fn submit_bucket_with_weights(
        &mut self,
        layers: &[LayerId],
        grads: &[&[f32]],
        weights: &[&[f32]],
    ) -> Result<()> {
        self.submit_impl(layers, Ok((grads, Some(weights))))
    }

    /// Submit bucket `layers` carrying a failure found by the caller before
    /// it could hand the gradients over (a binding's bad array, a hook
    /// that found a parameter missing): the bucket's collectives run as
    /// for any rank-local failure, and the step fails on every rank at
    /// [`finish_step`](Self::finish_step) with the same
    /// [`Error::RankFailed`] naming this rank and `err`. Misuse errors are
    /// returned as by [`submit_bucket`](Self::submit_bucket).
    pub fn fail_bucket(&mut self, layers: &[LayerId], err: Error) -> Result<()> {
        self.submit_impl(layers, Err(err))
    }

    /// Finish the step whose buckets were submitted
    /// ([`submit_bucket`](Self::submit_bucket)): waits for every bucket's
    /// collectives and writes layer `i`'s update direction into `out[i]`
    /// (every layer, in registration order), as [`wait`](Self::wait) does.
    /// Before every layer was submitted, the missing ones go as one failed
    /// bucket: every rank's step fails alike.
    pub fn finish_step(&mut self, out: &mut [&mut [f32]]) -> Result<&StepStats> {
        self.wait(out)
    }

    /// Whether this rank has a step open whose every layer was submitted
    /// (only [`finish_step`](Self::finish_step) is left): a binding whose
    /// caller's `finish_step` failed on a bad output argument finishes it
    /// ([`discard_pending`](Self::discard_pending)) before the next step's
    /// first bucket, which would otherwise be refused here alone.
    pub fn pending_finish(&self) -> bool {
        matches!(&self.step_state, StepState::Open(st) if st.buckets > 0 && st.submitted == self.reg.layers.len())
    }

    /// The buckets' shared half: local misuse, then the step opened (if
    /// none is), the bucket fingerprinted and run (or staged).
    pub(super) fn submit_impl(&mut self, layers: &[LayerId], input: Input<'_>) -> Result<()> {
        let input = self.delay_input(input);
        // Opened first, whatever the misuse below: a rank whose first
        // bucket is refused still has a step to finish, and its
        // `finish_step` then carries the failure to peers waiting in it.
        if !self.pending() {
            self.open_step()?;
        }
        let n = self.reg.layers.len();
        let mut members: Vec<u32> = Vec::with_capacity(layers.len());
        for id in layers {
            if id.0 >= n {
                return Err(Error::InvalidArgument(format!(
                    "bucket names layer {}; {n} layers are registered",
                    id.0
                )));
            }
            members.push(id.0 as u32);
        }
        members.sort_unstable();
        if let Some(w) = members.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::InvalidArgument(format!(
                "bucket names layer {:?} twice",
                self.reg.layers[w[0] as usize].name
            )));
        }
        if let StepState::Open(st) = &self.step_state {
            if st.submitted == n && st.buckets > 0 {
                return Err(Error::InvalidArgument(format!(
                    "every layer of step {} was submitted; finish the step first",
                    self.step
                )));
            }
            if let Some(&i) = members.iter().find(|&&i| st.owner[i as usize] != NONE) {
                return Err(Error::InvalidArgument(format!(
                    "layer {:?} was already submitted in step {}",
                    self.reg.layers[i as usize].name, self.step
                )));
            }
        }
        let StepState::Open(mut st) = std::mem::take(&mut self.step_state) else {
            unreachable!("opened above")
        };
        let index = st.buckets;
        st.buckets += 1;
        let slot = st.parts.len() as u32;
        for &i in &members {
            st.owner[i as usize] = slot;
        }
        st.submitted += members.len();
        let last = st.submitted == n;
        st.seq = self.bucket_print(st.seq, index, &members, last);
        if st.staged.is_none() && !(index == 0 && last) {
            if let Some(why) = self.staging_reason() {
                if !self.warned_staged {
                    log::info!(
                        "gradsync: buckets are staged and the step runs when the last arrives \
                         (no overlap): {why}"
                    );
                    self.warned_staged = true;
                }
                st.staged = Some(Staged::default());
            }
        }
        if let Some(staged) = &mut st.staged {
            stage(staged, &self.reg.layers, layers, input);
            if last {
                self.run_staged(&mut st);
            }
        } else {
            let what = self.bucket_text(index, &members, last);
            self.run_part(&mut st, &members, layers, input, what);
        }
        self.step_state = StepState::Open(st);
        Ok(())
    }

    /// Open a step: the table check (the first step), every per-step
    /// decision for the whole step (the script's first stage), the
    /// layers' per-step flags cleared, the progress thread started.
    fn open_step(&mut self) -> Result<()> {
        self.check_table()?;
        let t = Instant::now();
        // 1. Plan: every per-step decision, alike on every rank (plan.rs).
        super::plan::script_step_into(
            &mut self.plan,
            self.step,
            &self.cfg,
            self.size,
            &self.reg.table,
            &self.tuning,
        );
        // 2. This step's collectives, looked up in the decision table
        // (exchange.rs; `crate::cost::Tuning`): the reduced pairs'
        // exchange, the dense algorithm, the fused message's allgatherv.
        self.resolve_exchange();
        self.resolve_allreduce();
        self.resolve_allgather();
        // Once, at the first step whose collectives were all looked up (a
        // dense warm-up or a delayed step asks fewer).
        if self.plan.communicates && !self.plan.dense_warmup {
            self.tuning.log_once();
        }
        for l in &mut self.reg.layers {
            l.begin_step();
        }
        if self.cfg.overlap {
            self.ensure_worker();
        }
        let mut st = self.work.spare_step.take().unwrap_or_default();
        st.owner.clear();
        st.owner.resize(self.reg.layers.len(), NONE);
        st.submitted = 0;
        st.buckets = 0;
        st.seq = fnv(FNV_OFFSET, &self.step.to_le_bytes());
        st.staged = None;
        st.info = StartInfo {
            communicated: self.plan.communicates,
            overlapped: false,
            select_s: 0.0,
            pack_s: t.elapsed().as_secs_f64(),
        };
        self.step_state = StepState::Open(st);
        Ok(())
    }

    /// Why this step cannot run bucket by bucket bit for bit (module
    /// docs), if it cannot.
    fn staging_reason(&self) -> Option<String> {
        if self.cfg.clip_norm.is_some() {
            return Some("clip_norm scales every layer by the whole gradient's norm".into());
        }
        if self.plan.dense.elems > 0 && self.plan.allreduce != AllreduceAlgo::Rabenseifner {
            return Some(format!(
                "the {} allreduce sums an element in an order that depends on its place in \
                 the buffer (Rabenseifner's does not)",
                self.plan.allreduce.name()
            ));
        }
        if self.plan.rings {
            // A ring advances its layer's state as it runs: a later
            // bucket's failure could not undo it, as a whole step's does
            // (its status is agreed before the rings).
            return Some("GradiVeQ's rings advance their state as they run".into());
        }
        if self.plan.lowrank && self.plan.factor_allreduce != AllreduceAlgo::Rabenseifner {
            // Each bucket's factors are one allreduce: bit for bit only
            // when an element's sum does not depend on its place. (A
            // PowerSGD layer's state, advanced by its bucket, is undone if
            // a later bucket fails: `PowerSgd::rollback`.)
            return Some(format!(
                "the {} allreduce of PowerSGD's factors sums an element in an order that \
                 depends on its place in the buffer (Rabenseifner's does not)",
                self.plan.factor_allreduce.name()
            ));
        }
        if self.plan.sparse_reduce && self.plan.exchange == SparseExchange::Hierarchical {
            // Sums an index node by node, where its region lands: not
            // shown to be independent of the cut.
            return Some(
                "the node-aware sparse allreduce (its order is not shown to be the cut's)".into(),
            );
        }
        None
    }

    /// The fingerprint of the buckets so far, with bucket `index` of
    /// `members` (the last of the step or not).
    fn bucket_print(&self, seq: u64, index: usize, members: &[u32], last: bool) -> u64 {
        let mut h = fnv(seq, &(index as u64).to_le_bytes());
        h = fnv(h, &[u8::from(last)]);
        h = fnv(h, &(members.len() as u64).to_le_bytes());
        for &i in members {
            h = fnv(h, &i.to_le_bytes());
        }
        h
    }

    /// How a bucket is named in a mismatch: its place, its first layers.
    fn bucket_text(&self, index: usize, members: &[u32], last: bool) -> String {
        let names: Vec<&str> = members
            .iter()
            .take(3)
            .map(|&i| self.reg.layers[i as usize].name.as_str())
            .collect();
        let more = if members.len() > 3 { ", ..." } else { "" };
        log::debug!(
            "gradsync: rank {} step {} bucket {index}: {} layers ({}{more}){}",
            self.rank,
            self.step,
            members.len(),
            names.join(", "),
            if last { ", the step's last" } else { "" }
        );
        // The same text on every rank (staged or not): the error is.
        self.cut_differs_text()
    }

    /// The error of ranks whose buckets differ.
    fn cut_differs_text(&self) -> String {
        format!(
            "the step's buckets differ between ranks (step {}: another order, split or \
             number of buckets)",
            self.step
        )
    }

    /// Run one bucket: its plan, local math, pack, and its job dispatched.
    fn run_part(
        &mut self,
        st: &mut OpenStep,
        members: &[u32],
        ids: &[LayerId],
        input: Input<'_>,
        what: String,
    ) {
        let t = Instant::now();
        let mut part = self.spare_part();
        restrict_into(
            &mut part.plan,
            &self.plan,
            members,
            &self.reg.table,
            &self.tuning,
            self.size,
        );
        let mut job = self.spare_job();
        // 2. Local math (Algorithm 4, layer.rs). From here on this rank
        // enters the bucket's collectives whatever happens, carrying a
        // failure flag if this half failed, so no peer is left waiting
        // (crate::comm::agree).
        let local = match input {
            Ok((grads, weights)) => self.bucket_math(&part.plan, ids, grads, weights, &mut job),
            Err(e) => {
                job.buf.dense.clear();
                job.buf.dense.resize(part.plan.dense.elems, 0.0);
                Err(e)
            }
        };
        if let Err(e) = &local {
            log::debug!("gradsync: rank {} step {}: {e}", self.rank, self.step);
        }
        // 3. Pack: the fused sparse message and the status words (job.rs).
        job.pack(&part.plan, &self.reg.layers, &local);
        job.script.check = Some((st.seq, what));
        job.script.call = Some((CallKind::Step, self.step));
        job.script.first = st.parts.is_empty();
        let select_s: f64 = members
            .iter()
            .map(|&i| self.reg.layers[i as usize].stats.select_s)
            .sum();
        st.info.select_s += select_s;
        st.info.pack_s += (t.elapsed().as_secs_f64() - select_s).max(0.0);
        // 4. Communicate: on the progress thread, or here (progress.rs).
        if job.script.do_gather
            || job.script.do_reduce
            || job.script.do_gvq
            || job.script.do_psg
            || job.script.do_sparse
        {
            let (threaded, back) = self.dispatch(job);
            st.info.overlapped |= threaded;
            part.job = back;
        } else {
            // No exchange (one rank): the error is this rank's alone.
            job.out.result = Some(local.map_err(|e| Error::RankFailed {
                rank: self.rank,
                others: 0,
                failed: vec![self.rank],
                step: Some(self.step),
                message: e.to_string(),
            }));
            part.job = Some(job);
        }
        st.parts.push(part);
    }

    /// The bucket's local half: its gradients (given in `ids`' order)
    /// checked and set out by layer, then the local math and the reduced
    /// layers' pairs.
    fn bucket_math(
        &mut self,
        plan: &StepScript,
        ids: &[LayerId],
        grads: &[&[f32]],
        weights: Option<&[&[f32]]>,
        job: &mut Job,
    ) -> Result<()> {
        let n = self.reg.layers.len();
        let whole = ids.len() == n && ids.iter().enumerate().all(|(j, id)| id.0 == j);
        let r = if let Err(e) = counts(ids.len(), grads, weights, whole) {
            Err(e)
        } else if whole {
            self.local_phase(plan, grads, weights, job)
        } else {
            // Layer-indexed views; the other buckets' layers are not read.
            let mut g: Vec<&[f32]> = vec![&[]; n];
            let mut w: Vec<&[f32]> = vec![&[]; if weights.is_some() { n } else { 0 }];
            for (j, id) in ids.iter().enumerate() {
                g[id.0] = grads[j];
                if let Some(ws) = weights {
                    w[id.0] = ws[j];
                }
            }
            self.local_phase(plan, &g, weights.map(|_| &w[..]), job)
        };
        if r.is_err() {
            job.buf.dense.clear();
            job.buf.dense.resize(plan.dense.elems, 0.0);
            return r;
        }
        self.reduced_pairs(plan, job)
    }

    /// A staged step's one bucket, once the last bucket arrived (or
    /// `finish_step` came first): every layer, from the copies.
    fn run_staged(&mut self, st: &mut OpenStep) {
        let Some(staged) = st.staged.take() else {
            return;
        };
        let n = self.reg.layers.len();
        let all: Vec<LayerId> = (0..n).map(LayerId).collect();
        let members: Vec<u32> = (0..n as u32).collect();
        for o in &mut st.owner {
            *o = st.parts.len() as u32;
        }
        let what = self.cut_differs_text();
        let grads: Vec<&[f32]> = staged.grads.iter().map(|g| &g[..]).collect();
        let weights: Vec<&[f32]> = staged.weights.iter().map(|g| &g[..]).collect();
        let input = match staged.error {
            Some(e) => Err(e),
            None => Ok((&grads[..], staged.with_weights.then_some(&weights[..]))),
        };
        self.run_part(st, &members, &all, input, what);
    }

    /// Finish the open step: the missing layers as a failed bucket, every
    /// job back, unpacked (the script's last stage), the stats, the step
    /// counter.
    pub(super) fn finish_impl(&mut self, out: &mut [&mut [f32]]) -> Result<&StepStats> {
        let StepState::Open(mut st) = std::mem::take(&mut self.step_state) else {
            return Err(Error::InvalidArgument("wait without start".into()));
        };
        if st.submitted < self.reg.layers.len() || st.buckets == 0 {
            let missing: Vec<LayerId> = (0..self.reg.layers.len())
                .filter(|&i| st.owner[i] == NONE)
                .map(LayerId)
                .collect();
            let names: Vec<&str> = missing
                .iter()
                .take(3)
                .map(|id| self.reg.layers[id.0].name.as_str())
                .collect();
            let err = Error::InvalidArgument(format!(
                "the step was finished before {} of its layers were submitted ({}{})",
                missing.len(),
                names.join(", "),
                if missing.len() > 3 { ", ..." } else { "" }
            ));
            self.step_state = StepState::Open(st);
            // The missing layers, as the step's last bucket, carrying the
            // failure to every rank.
            self.submit_impl(&missing, Err(err))?;
            let StepState::Open(s) = std::mem::take(&mut self.step_state) else {
                unreachable!("submit_impl keeps the step open")
            };
            st = s;
        }
        let t_wait = Instant::now();
        for i in 0..st.parts.len() {
            if st.parts[i].job.is_none() {
                st.parts[i].job = Some(self.collect_job());
            }
        }
        let wait_s = t_wait.elapsed().as_secs_f64();
        let mut result = Ok(());
        for p in &mut st.parts {
            let r = p
                .job
                .as_mut()
                .and_then(|j| j.out.result.take())
                .unwrap_or(Ok(()));
            if result.is_ok() {
                result = r;
            }
        }
        // 5. Unpack (unpack.rs).
        let r = self.unpack(&mut st, out, result);
        // Only a clean step measures the fill: a rank whose reduced layer
        // was non-finite sent no pairs (every rank sees both alike: failures
        // are collective, `sp_bad_rank` is gathered).
        let jobs = || st.parts.iter().filter_map(|p| p.job.as_deref());
        let clean = r.is_ok() && jobs().all(|j| j.buf.sp_bad_rank.iter().all(Option::is_none));
        let sample = if !clean {
            None
        } else if self.plan.sparse_reduce {
            Some(
                jobs()
                    .filter(|j| j.script.do_sparse)
                    .map(|j| j.out.sparse_reduce_nnz)
                    .sum(),
            )
        } else {
            jobs().find_map(|j| j.out.probe_nnz)
        };
        self.record_stats(&st, wait_s, sample);
        // The tuner learns from the step's record; the record reports the
        // estimate the next step prices with.
        self.tuner.on_step_done(&self.last, self.size);
        self.last.fill_estimate = self.tuner.fill();
        self.recycle(&mut st);
        self.work.spare_step = Some(st);
        // The round happened (every rank sees the same gathered bytes, so
        // ranks fail alike): the counter advances with the state. Not
        // where the step's first agreement met peers in another call:
        // they did not step, and nothing was exchanged.
        if !matches!(r, Err(Error::CallMismatch(_))) {
            self.step += 1;
        }
        r?;
        Ok(&self.last)
    }

    /// A job's buffers for the next bucket (kept across steps).
    pub(super) fn spare_job(&mut self) -> Box<Job> {
        self.work.spare.pop().unwrap_or_else(|| {
            Box::new(Job {
                buf: RoundBuffers {
                    nodes: self.nodes.clone().unwrap_or_default(),
                    ..RoundBuffers::default()
                },
                ..Job::default()
            })
        })
    }

    /// A bucket's plan and entries (kept across steps).
    fn spare_part(&mut self) -> Part {
        self.work.spare_parts.pop().unwrap_or_else(|| Part {
            plan: StepScript::default(),
            job: None,
            entries: Vec::new(),
        })
    }

    /// The finished step's buffers back into the pools.
    fn recycle(&mut self, st: &mut OpenStep) {
        for mut p in st.parts.drain(..) {
            if let Some(j) = p.job.take() {
                self.work.spare.push(j);
            }
            self.work.spare_parts.push(p);
        }
    }
}

/// Whether a bucket of `layers` layers got one gradient (and weight
/// tensor) each; `whole`: the bucket is the whole table (`start`'s words).
fn counts(layers: usize, grads: &[&[f32]], weights: Option<&[&[f32]]>, whole: bool) -> Result<()> {
    if grads.len() != layers {
        return Err(Error::InvalidArgument(if whole {
            format!("{} gradients for {layers} registered layers", grads.len())
        } else {
            format!("{} gradients for a bucket of {layers} layers", grads.len())
        }));
    }
    match weights {
        Some(w) if w.len() != layers => Err(Error::InvalidArgument(format!(
            "{} weight tensors for {layers} layers",
            w.len()
        ))),
        _ => Ok(()),
    }
}

/// Copy a staged bucket's gradients (and weights) into `staged`, or keep
/// this rank's first failure.
fn stage(staged: &mut Staged, layers: &[super::layer::Layer], ids: &[LayerId], input: Input<'_>) {
    let n = layers.len();
    staged.grads.resize_with(n, Vec::new);
    let keep = |staged: &mut Staged, e: Error| {
        staged.error.get_or_insert(e);
    };
    let (grads, weights) = match input {
        Ok(x) => x,
        Err(e) => return keep(staged, e),
    };
    if let Err(e) = counts(ids.len(), grads, weights, false) {
        return keep(staged, e);
    }
    if weights.is_some() {
        staged.weights.resize_with(n, Vec::new);
        staged.with_weights = true;
    }
    for (j, id) in ids.iter().enumerate() {
        let g = &mut staged.grads[id.0];
        g.clear();
        g.extend_from_slice(grads[j]);
        if let Some(w) = weights {
            let d = &mut staged.weights[id.0];
            d.clear();
            d.extend_from_slice(w[j]);
        }
    }
}
