//! The synchronization engine: what a data-parallel training loop calls every
//! step.
//!
//! [`GradSync`] holds a layer table (`register`), per-layer state (residuals,
//! momentum, codec state) and the communication buffers. Each step it turns
//! every rank's local gradients into one *update direction* per layer, the
//! same on every rank, which the caller applies as `w -= lr · d`:
//!
//! * `Sparse` layers run RedSync's Algorithm 4 (Appendix A; §4, §5.6):
//!   momentum correction (`U = m·U + g; V += U`, or `V += g + m·U` for
//!   Nesterov), residual accumulation, selection and encoding by the layer's
//!   codec, momentum factor masking (`U[i] = 0` where sent) and `V -= sent`
//!   (error feedback, exact for RGC's copied values, keeping quantized codecs'
//!   rounding in the residual). All sparse layers' units are fused into one
//!   message per rank and exchanged by ONE allgatherv ([`crate::sparse`]);
//!   the result is the average of every rank's decoded unit. With
//!   [`Config::sparse_exchange`] = [`SparseExchange::Allreduce`] the layers
//!   whose codec sends index/value pairs (RGC, quantized RGC) leave that
//!   message: their pairs, over the layers' concatenated index space, go
//!   through ONE O(k) sparse allreduce
//!   ([`crate::sparse::sparse_allreduce`]) after the step's status
//!   agreement, with bitwise the same result (`job.rs` says how failures
//!   and NaN/Inf reach every rank on that path); `Hierarchical` runs the
//!   node-aware one, and `auto` ([`Pick::Auto`]) lets the cost model
//!   choose among the three every step (the decision table,
//!   [`crate::cost::Tuning`], pricing by
//!   [`crate::cost::choose_sparse_exchange`] with a fill ratio
//!   estimated from the previous steps' results; `exchange.rs`).
//! * `Dense` layers are fused into one buffer and averaged with Rabenseifner's
//!   allreduce (Horovod-style tensor fusion); momentum (plain or Nesterov) is
//!   applied to the average, so every rank keeps the same momentum.
//! * Weight decay (`g += wd·w`, needs the weights), local gradient clipping
//!   (the global norm of this rank's gradient clipped to `c·N^−1/2`, Lin et
//!   al.'s local clipping of §5.5), warm-up (all layers dense for the first
//!   steps, or a density schedule such as 25%, 6.25%, 1.5625%, 0.4%, 0.1%),
//!   and SBC's communication delay (`delay = T`: communicate every T-th step;
//!   in between each rank applies its own direction; the communicating step
//!   writes the weights of the window's first step back into the caller's
//!   weights and returns the average of every rank's directions since, so
//!   every rank's weights are equal bit for bit after it, whatever the
//!   learning rate (`delay.rs`); momentum is then local, as in federated
//!   averaging).
//!
//! Nesterov: Algorithm 4 as printed adds `U + g` to the residual after
//! `U = m·U + g`, which is not Nesterov's `g + m·U`; the engine uses the
//! latter (what DGC's code computes with its pre-multiplied buffer).
//!
//! Communication can overlap computation: [`GradSync::start`] compresses and
//! hands the fused buffers to a progress thread that runs the allgatherv and
//! the allreduce; [`GradSync::wait`] collects and unpacks. A step can also
//! be handed over in parts as backward produces them
//! ([`GradSync::submit_bucket`] … [`GradSync::finish_step`], `bucket.rs`):
//! each bucket's collectives are queued to the progress thread while the
//! caller computes, and the result is the whole step's bit for bit; a whole
//! step is the step of one bucket. With MPI this needs
//! `MPI_THREAD_SERIALIZED` (and the application must not call MPI between
//! `start` and `wait` unless it has `MPI_THREAD_MULTIPLE`); with a lower level
//! the engine communicates inside `start` and says so once in the log.
//!
//! Failures are collective ([`crate::comm::agree`]): an error that can arise on
//! a subset of ranks inside a step reaches every rank as an `Err` in the same
//! step, naming the rank and the cause, or — where agreement is impossible —
//! ends the job with `MPI_Abort`. A rank whose local half of the step fails
//! (bad lengths, an encoder error, NaN/Inf in a GradiVeQ input) still enters
//! the step's collectives with a failure marker: a `GSFX` message in place of
//! its fused sparse message, a status word after the fused dense buffer, or,
//! for steps with only GradiVeQ layers or layers for the sparse allreduce,
//! a small status allreduce (which always runs before the sparse
//! allreduce, so a failed rank never enters it alone). Every rank
//! checks the status before applying anything and returns the same
//! [`Error::RankFailed`]; what each rank had encoded goes back into its
//! residual, and the step counter advances alike. With `delay > 1` a
//! communicating step that fails, or has a NaN/Inf in any layer, is void on
//! every rank (every layer's result NaN) and puts back the local directions
//! it took out of the delay accumulator (or the ranks' weights would drift
//! apart for good); a delayed step without communication runs only an
//! 8-byte status allreduce: a failure there is the same `RankFailed` on
//! every rank, and a NaN/Inf on any rank voids the step on every rank
//! (NaN in every layer's result, nothing accumulated). Every step of
//! several ranks carries the status, even one with nothing to exchange.
//!
//! Safety: every `register` checks with one small collective that all ranks
//! registered the same layer (name, shape, strategy) under the same options;
//! NaN/Inf in gradients follow [`NonFinitePolicy`]; a peer's corrupt unit is
//! an [`Error::PeerMessage`] naming rank and layer. State snapshots
//! ([`GradSync::save_snapshot`]) restore bitwise.
//!
//! * `Gradiveq` layers are aggregated by GradiVeQ's compressed-domain ring
//!   ([`crate::gradiveq`]) on the progress thread, each with its own schedule,
//!   and get momentum like dense layers.
//! * `Powersgd` layers ([`crate::powersgd`]) from their `start` on: on the
//!   progress thread, every such layer's `P` in one allreduce, then every
//!   `Q` in another; the approximation gets momentum like a dense layer.
//!
//! The strategy of a layer is fixed once: at registration for an explicit
//! one or the default ([`GradSync::resolve`]); for `Auto` layers when the
//! table is complete (the first step, or a snapshot restore), by the step
//! model ([`crate::cost::plan_step`]) planning the whole table with
//! `Config::profile`, so that a group's α is paid once
//! ([`GradSync::auto_plan`] shows the plan).
//!
//! # A step
//!
//! [`GradSync::start`] and [`GradSync::wait`] (or each bucket, `bucket.rs`)
//! read as a script:
//!
//! 1. **plan** — every per-step decision, a pure function of (step, options,
//!    number of ranks, layer table), alike on every rank and tested without
//!    a transport; with `sparse_exchange = "auto"` then the step's exchange,
//!    from the cost model and inputs alike on every rank (`exchange.rs`);
//! 2. **local math** — this rank's inputs validated, clipping, Algorithm 4
//!    on sparse layers, the dense layers' fused buffer, the local step of a
//!    delayed step (no communication);
//! 3. **pack** — the fused sparse message (or this rank's failure marker),
//!    the reduced layers' pairs, the dense status words, the collectives
//!    to run;
//! 4. **communicate** — on the progress thread or inline;
//! 5. **unpack** (in `wait`) — every rank's units decoded and averaged,
//!    momentum on dense results, the NaN/Inf policy, the step's stats.
//!
//! # Where each decision lives
//!
//! | decision | where |
//! |---|---|
//! | a layer's strategy at registration (the cost model's with a profile, else by size) | `table.rs`: [`GradSync::resolve`], looked up in the decision table ([`crate::cost::Tuning::layer_strategy`]) |
//! | an `Auto` layer's strategy | `table.rs` when the table is complete: [`crate::cost::Tuning::plan_table`] (the step model over the table's candidates) |
//! | options' validity; GradiVeQ not with `delay > 1` | `config.rs` (`Config::check`), `table.rs` (registration) |
//! | whether a step communicates (SBC's delay, steps `T−1, 2T−1, ...`) | `plan.rs` |
//! | when the delay window's weights are kept and written back; a delayed step without writable weights refused | `delay.rs` |
//! | each layer's mode this step (dense warm-up, sparse, GradiVeQ, PowerSGD, local) | `plan.rs` |
//! | the codec density this step (density warm-up schedule, else the layer's own) | `plan.rs` |
//! | dense layers' offsets in the fused buffer; the sparse, GradiVeQ, PowerSGD and local groups | `plan.rs` |
//! | which collectives run | `plan.rs` |
//! | serial or parallel local math and unpacking | `plan.rs`, looked up ([`crate::cost::Tuning::parallel`]) |
//! | the math of a layer (momentum, residual, masking, error feedback, clipping) | `layer.rs` |
//! | which sparse layers leave the fused message for the sparse allreduce (`Config::sparse_exchange`, index/value codecs), their offsets | `plan.rs` |
//! | this step's exchange of those layers, dense algorithm, fused allgatherv and PowerSGD factors' allreduce | `exchange.rs`, looked up in the decision table ([`crate::cost::Tuning`]: `exchange`, `dense_allreduce`, `allgatherv`, `factor_allreduce`) from the groups' nominal sizes and the fill estimate |
//! | the fill estimate (moving average of the group's distinct results over `p·k`: `sparse_reduce_nnz` after reducing steps, the nonzero elements the unpacking counts after `auto`'s allgatherv steps) | `tuner.rs`, measured in `unpack.rs` |
//! | the bucket cap of the overlapped step | [`GradSync::plan_buckets`], looked up ([`crate::cost::Tuning::buckets`]) |
//! | wire formats of the fused messages | [`crate::sparse`], packed in `job.rs` |
//! | collective failure handling inside a step | `job.rs` (status word, failure markers), [`crate::comm::agree`] |
//! | NaN/Inf results | `unpack.rs`, by [`NonFinitePolicy`] |
//! | what a snapshot holds and how a restore is agreed | `snapshot.rs` |
//!
//! Files: `config.rs` (options), `plan.rs` (the step's script), `layer.rs`
//! (layer state and Algorithm 4), `bucket.rs` (the step as a program of
//! buckets; the step's state), `progress.rs` (who runs the collectives:
//! inline, a progress thread, lost), `job.rs` (one bucket's job and its
//! collectives),
//! `unpack.rs`, `stats.rs`, `table.rs` (registration and table agreement),
//! `exchange.rs` (the per-step collectives of `auto`, the fill estimate's
//! rule), `tuner.rs` (what those choices learn from the steps done),
//! `snapshot.rs`, `options.rs` (options as flat JSON for the bindings),
//! `mixed.rs` (float16 and bfloat16 gradients through float32 workspaces);
//! this file holds the engine, its constructors and the step script.

mod bucket;
mod config;
mod delay;
mod device;
mod exchange;
mod job;
mod layer;
mod local;
mod mixed;
mod options;
mod plan;
mod progress;
mod record;
mod snapshot;
mod stats;
mod table;
mod tuner;
mod unpack;

pub use config::{Config, NonFinitePolicy, Pick, SparseExchange, Strategy, Warmup, MAX_DELAY};
pub use mixed::Grad;
pub use snapshot::SNAPSHOT_VERSION;
pub use stats::{DeviceStats, LayerStats, StepStats};
pub use table::LayerId;

use crate::comm::{MpiComm, Transport};
use crate::{Error, Result};
use bucket::{StepState, Workspace};
use delay::Window;
use job::Job;
use layer::Layer;
use plan::{Mode, StepScript};
use progress::{Progress, Runner};
use table::{fnv, LayerTable, FNV_OFFSET};

/// The per-step synchronization engine. See the [module docs](self).
///
/// ```
/// use gradsync::comm::LocalComm;
/// use gradsync::sync::{Config, GradSync, Strategy};
/// let out = LocalComm::run(3, |comm| {
///     let mut s = GradSync::with_transport(comm, Config::default()).unwrap();
///     s.register_with("fc.weight", &[100, 100], Strategy::rgc(0.01)).unwrap();
///     s.register("fc.bias", &[100]).unwrap(); // small: dense
///     let mut w = vec![1.0f32; 10_000];
///     let mut b = vec![0.5f32; 100];
///     s.sync(&mut [&mut w[..], &mut b[..]]).unwrap();
///     (w.iter().filter(|&&x| x != 0.0).count(), b[0])
/// });
/// // 1% of 10 000 elements from each rank (all at the same places here).
/// assert_eq!(out[0], (100, 0.5));
/// ```
pub struct GradSync<C: Transport + Send + 'static = MpiComm> {
    /// Who holds the transport and runs the collectives (`progress.rs`).
    progress: Progress<C>,
    rank: usize,
    size: usize,
    cfg: Config,
    /// The registered layers, their planner rows and the table's agreement
    /// (`table.rs`).
    reg: LayerTable,
    /// The current (or last) step's plan.
    plan: StepScript,
    /// This run's identity: rank 0's random number, agreed at creation (or
    /// the restored snapshots'). Snapshots carry it, so that a restore
    /// refuses snapshots of different runs (at the same step they passed
    /// every other check, and the replicas drifted apart).
    run: u64,
    step: u64,
    /// Between steps, or the open step's buckets (`bucket.rs`).
    step_state: StepState,
    /// Buffers kept across steps (`bucket.rs`).
    work: Workspace,
    last: StepStats,
    warned_no_thread: bool,
    warned_staged: bool,
    /// The delay window's state (`delay.rs`).
    window: Window,
    /// Every rank's node, when the configuration needs them (the
    /// node-aware collectives, a two-level profile for `Auto`,
    /// `sparse_exchange = "auto"`).
    nodes: Option<Vec<usize>>,
    /// What the per-step `auto` choices learn from the steps done: the
    /// fill estimate, the step's reduced load, the last choices
    /// (`tuner.rs`).
    tuner: tuner::Tuner,
    /// The decision table every per-step collective is looked up in
    /// ([`crate::cost::Tuning`]): built at creation from the agreed
    /// profile, the node map and the forced options.
    tuning: crate::cost::Tuning,
}

/// What the step's buckets tell `wait` about the step.
#[derive(Default)]
struct StartInfo {
    communicated: bool,
    overlapped: bool,
    select_s: f64,
    pack_s: f64,
}

impl GradSync<MpiComm> {
    /// An engine over a duplicate of the rsmpi communicator `comm`
    /// (collective over `comm`).
    pub fn new<Cm: mpi::topology::Communicator>(comm: &Cm, cfg: Config) -> Result<Self> {
        Self::with_transport(MpiComm::duplicate_of(comm)?, cfg)
    }

    /// An engine over a duplicate of a raw `MPI_Comm` handle (collective
    /// over it): how the C ABI and the Python package, whose communicators
    /// come from C or mpi4py, build one. `cfg` is this rank's options or
    /// its own failure to build them (bad JSON, an option of the wrong
    /// type): one 8-byte agreement ([`crate::comm::agree::agree`]) makes such a
    /// failure on one rank fail every rank alike, naming it, before the
    /// engine's own checks. See [`MpiComm::duplicate_raw`] for the errors
    /// of the communicator itself.
    ///
    /// # Safety
    /// `raw` must be a valid communicator handle of the MPI library
    /// gradsync is linked with.
    pub unsafe fn from_raw_comm(raw: mpi::ffi::MPI_Comm, cfg: Result<Config>) -> Result<Self> {
        // SAFETY: `raw` is a handle of the linked MPI library (this
        // function's contract).
        let comm = unsafe { MpiComm::duplicate_raw(raw)? };
        let cfg = crate::comm::agree::agree(&comm, cfg)?;
        Self::with_transport(comm, cfg)
    }
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// An engine over any transport (collective: checks that every rank
    /// passed the same options).
    pub fn with_transport(comm: C, cfg: Config) -> Result<Self> {
        // Options that are invalid on one rank only still enter the options
        // agreement below, so every rank fails alike instead of the others
        // waiting in it (the failure model, crate::comm::agree).
        let valid = cfg.check();
        let json = serde_json::to_vec(&cfg)?;
        let table_hash = fnv(FNV_OFFSET, &json);
        let legacy = Config {
            allgather: Pick::Fixed(crate::dense::AllgathervAlgo::RecursiveDoubling),
            ..cfg.clone()
        };
        let legacy_hash = fnv(FNV_OFFSET, &serde_json::to_vec(&legacy)?);
        let mut s = Self::fresh(comm, cfg, table_hash, legacy_hash);
        let create = || crate::comm::agree::CallKind::Create.describe(0);
        match s.agree(
            (crate::comm::agree::CallKind::Create, &create),
            valid.map(|()| table_hash),
            String::new,
        ) {
            // Every rank is here: name what differs (one more collective).
            // Before any layer is registered the table is the options.
            Err(Error::TableMismatch(_)) => {
                let comm = s
                    .progress
                    .inline_comm()
                    .expect("transport held at creation");
                return Err(Error::ArgumentMismatch(
                    crate::comm::agree::option_differences(comm, &json)?,
                ));
            }
            r => r?,
        }
        s.agree_run_id()?;
        s.fetch_nodes()?;
        // Every job carries `s.nodes` (`spare_job`): the map `allgather =
        // "auto"` prices the node-aware allgatherv with is the one it runs
        // on.
        Ok(s)
    }

    /// An engine over `comm` with nothing registered, before any agreement.
    fn fresh(comm: C, cfg: Config, table_hash: u64, legacy_hash: u64) -> Self {
        // Replaced once the node map is known (`fetch_nodes`); with nodes
        // assumed nothing is refused.
        let tuning = crate::cost::Tuning::new(None, 1, None, true, cfg.masks())
            .expect("a table assuming a node map refuses nothing")
            .with_policy(cfg.policy());
        GradSync {
            rank: comm.rank(),
            size: comm.size(),
            progress: Progress::Inline(comm, Runner::default()),
            cfg,
            reg: LayerTable::new(table_hash, legacy_hash),
            plan: StepScript::default(),
            run: 0,
            step: 0,
            step_state: StepState::Idle,
            work: Workspace::default(),
            last: StepStats::default(),
            warned_no_thread: false,
            warned_staged: false,
            window: Window::default(),
            nodes: None,
            tuner: tuner::Tuner::default(),
            tuning,
        }
    }

    /// The run's identity: rank 0's draw, on every rank (8 bytes).
    fn agree_run_id(&mut self) -> Result<()> {
        let comm = self
            .progress
            .inline_comm()
            .expect("transport held at creation");
        let mut run = [if self.rank == 0 {
            snapshot::new_run_id()
        } else {
            0
        }];
        crate::dense::small_allreduce_max(comm, &mut run, crate::comm::tags::TABLE)?;
        self.run = run[0];
        Ok(())
    }

    /// Every rank's node, where the agreed options need them: the
    /// node-aware collectives, a two-level profile, and the `auto` choices
    /// (the node-aware exchange is a candidate only where the nodes are
    /// known). Every rank has the same options here, so every rank asks
    /// (collective on MPI) or none does, and all get the same answer. Then
    /// the decision table is built from them ([`crate::cost::Tuning::new`],
    /// which refuses a node-aware collective forced without a node map,
    /// naming why).
    fn fetch_nodes(&mut self) -> Result<()> {
        use crate::dense::{AllgathervAlgo, AllreduceAlgo};
        let cfg = &self.cfg;
        let two_level = cfg.profile.as_ref().is_some_and(|p| p.inter_node.is_some());
        let wanted = two_level
            || cfg.allreduce.is(AllreduceAlgo::Hierarchical)
            || cfg.allreduce.is_auto()
            || cfg.allgather.is(AllgathervAlgo::Node)
            || cfg.sparse_exchange.is_auto()
            || cfg.sparse_exchange.is(SparseExchange::Hierarchical);
        if wanted {
            let comm = self
                .progress
                .inline_comm()
                .expect("transport held at creation");
            self.nodes = comm.node_ids();
        }
        self.tuning = crate::cost::Tuning::new(
            self.cfg.profile.as_ref(),
            self.size,
            self.ranks_per_node(),
            self.nodes.is_some(),
            self.cfg.masks(),
        )?
        .with_policy(self.cfg.policy());
        Ok(())
    }

    /// Options in use.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Number of registered layers.
    pub fn num_layers(&self) -> usize {
        self.reg.layers.len()
    }
    /// Name, shape and resolved strategy of a layer.
    pub fn layer(&self, id: LayerId) -> Option<(&str, &[usize], &Strategy)> {
        self.reg
            .layers
            .get(id.0)
            .map(|l| (l.name.as_str(), l.shape.as_slice(), &l.strategy))
    }

    /// Layer `id`'s strategy as a JSON object that [`register_spec`](Self::register_spec)
    /// takes back: after the table is complete
    /// ([`complete_table`](Self::complete_table) or the first step), an
    /// `auto` layer's resolved choice, so that other engines (the buckets
    /// of an overlapped step) can be registered with the whole table's plan.
    ///
    /// ```
    /// use gradsync::comm::LocalComm;
    /// use gradsync::sync::{Config, GradSync, LayerId};
    /// let out = LocalComm::run(1, |c| {
    ///     let mut a = GradSync::with_transport(c, Config::default()).unwrap();
    ///     a.register_spec("w", &[100_000], "rgc:density=0.01").unwrap();
    ///     let json = a.layer_strategy(LayerId(0)).unwrap();
    ///     drop(a);
    ///     json
    /// });
    /// let back = LocalComm::run(1, |c| {
    ///     let mut b = GradSync::with_transport(c, Config::default()).unwrap();
    ///     b.register_spec("w", &[100_000], &out[0]).unwrap();
    ///     b.layer_strategy(LayerId(0)).unwrap()
    /// });
    /// assert_eq!(back[0], out[0]); // the same strategy, density included
    /// assert!(out[0].contains("0.01"));
    /// ```
    pub fn layer_strategy(&self, id: LayerId) -> Option<String> {
        self.reg
            .layers
            .get(id.0)
            .and_then(|l| serde_json::to_string(&l.strategy).ok())
    }

    /// One synchronous step: `grads[i]` (layer `i`'s local gradient, in
    /// registration order) is replaced by the layer's update direction.
    pub fn sync(&mut self, grads: &mut [&mut [f32]]) -> Result<&StepStats> {
        {
            let view: Vec<&[f32]> = grads.iter().map(|g| &**g).collect();
            self.start(&view)?;
        }
        self.wait(grads)
    }

    /// [`sync`](Self::sync) with weight decay (`weights[i]` is layer `i`'s
    /// weights).
    pub fn sync_with_weights(
        &mut self,
        grads: &mut [&mut [f32]],
        weights: &[&[f32]],
    ) -> Result<&StepStats> {
        {
            let view: Vec<&[f32]> = grads.iter().map(|g| &**g).collect();
            self.start_with_weights(&view, weights)?;
        }
        self.wait(grads)
    }

    /// Compress this step's gradients and start communicating; the gradients
    /// are no longer needed when it returns. Finish with [`wait`](Self::wait).
    /// With `weight_decay` set the weights are needed
    /// ([`start_with_weights`](Self::start_with_weights)): without them the
    /// step fails on every rank, as any rank-local failure does (the
    /// error comes from `wait`), so a peer that did pass its weights is
    /// never left waiting.
    pub fn start(&mut self, grads: &[&[f32]]) -> Result<()> {
        if self.cfg.weight_decay != 0.0 {
            return self.start_impl(Err(Error::InvalidArgument(
                "weight_decay is set but no weights were given (Rust: start_with_weights / \
                 sync_with_weights; Python: sync(grads, weights=...))"
                    .into(),
            )));
        }
        self.start_impl(Ok((grads, None)))
    }

    /// Take part in this step carrying a failure found by the caller before
    /// it could hand over its gradients (a binding that got a float64 or
    /// read-only array, a null pointer from C). The step's collectives run
    /// as for any rank-local failure ([`crate::comm::agree`]): every rank,
    /// this one included, returns the same [`Error::RankFailed`] for this
    /// step, nothing is applied anywhere, and the next step runs normally.
    /// Returns that error (or an earlier, purely local misuse error).
    pub fn fail_step(&mut self, err: Error) -> Error {
        if let Err(e) = self.start_impl(Err(err)) {
            return e;
        }
        match self.wait(&mut []) {
            Err(e) => e,
            Ok(_) => Error::InvalidArgument("a failed step succeeded".into()),
        }
    }

    /// Whether a step begun by [`start`](Self::start) (or a bucket,
    /// [`submit_bucket`](Self::submit_bucket)) still waits for its
    /// [`wait`](Self::wait) on this rank.
    pub fn pending(&self) -> bool {
        matches!(self.step_state, StepState::Open(_))
    }

    /// Finish a pending step (see [`pending`](Self::pending)) into scratch
    /// buffers and discard this rank's result, so that the engine's state
    /// stays in step with its peers' (they finished that step); `Ok(false)`
    /// when none was pending, the step's own error if it failed. For a
    /// binding whose caller's `wait` failed on a bad output argument and
    /// who goes on to the next step: without it the next `start` would be
    /// refused on this rank alone while its peers wait in that step.
    pub fn discard_pending(&mut self) -> Result<bool> {
        if !self.pending() {
            return Ok(false);
        }
        let mut scratch: Vec<Vec<f32>> = self.reg.layers.iter().map(|l| vec![0.0; l.n]).collect();
        let mut out: Vec<&mut [f32]> = scratch.iter_mut().map(|v| &mut v[..]).collect();
        let (step, delayed) = (self.step, self.plan.delayed && self.plan.communicates);
        let r = self.wait(&mut out).map(|_| true);
        if r.is_ok() && delayed {
            self.mark_diverged(step);
        }
        r
    }

    /// The collective half of closing the engine: every rank's close meets
    /// in one agreement, so a rank that closes while a peer steps (or
    /// restores, or registers) gets the same [`Error::CallMismatch`] as
    /// that peer, naming both calls, instead of leaving it waiting. A
    /// step this rank still has pending is finished first, its result
    /// discarded ([`discard_pending`](Self::discard_pending)). Drop the
    /// engine after `Ok`; after an error it is as it was.
    pub fn prepare_close(&mut self) -> Result<()> {
        if self.pending() {
            // Its peers finished that step (or fail it alike).
            let _ = self.discard_pending();
        }
        self.agree_status(
            crate::comm::agree::CallKind::Close,
            Ok(()),
            (0, String::new()),
        )
    }

    /// [`start`](Self::start) with the weights, for weight decay.
    pub fn start_with_weights(&mut self, grads: &[&[f32]], weights: &[&[f32]]) -> Result<()> {
        self.start_impl(Ok((grads, Some(weights))))
    }

    /// The step's gradients (and weights), or the caller's own failure:
    /// the whole step as its one bucket (`bucket.rs`: plan → local math →
    /// pack → communicate).
    #[allow(clippy::type_complexity)]
    fn start_impl(&mut self, input: Result<(&[&[f32]], Option<&[&[f32]]>)>) -> Result<()> {
        // A step opened by a refused bucket (nothing submitted) takes this
        // whole step as its first bucket.
        let opened_empty = matches!(&self.step_state, StepState::Open(st) if st.is_empty());
        if self.pending() && !opened_empty {
            // Local misuse; this rank's own round is still pending, so no
            // peer waits for this call.
            return Err(Error::InvalidArgument(
                "start called twice without wait".into(),
            ));
        }
        let all: Vec<LayerId> = (0..self.reg.layers.len()).map(LayerId).collect();
        self.submit_impl(&all, input)
    }

    /// This rank's pairs of the bucket's reduced layers into `job` (the
    /// end of the local phase); on failure what this rank encoded goes
    /// back into its residuals, as for any local failure.
    fn reduced_pairs(&mut self, plan: &StepScript, job: &mut Job) -> Result<()> {
        let r = job.collect_pairs(plan, &self.reg.layers, self.size);
        if r.is_err() {
            for l in &mut self.reg.layers {
                l.rollback();
            }
        } else {
            // What the layer puts into the sparse allreduce: 8 bytes a pair
            // (index, f32 value), whatever its unit's encoding (rgc-quant's
            // unit is its indices and one mean: 4 bytes a pair).
            for (&id, &k) in plan.reduced.ids.iter().zip(&job.buf.sp_layer_pairs) {
                self.reg.layers[id as usize].stats.bytes_sent = 8 * k;
            }
        }
        r
    }

    /// Finish the step started by [`start`](Self::start) (or submitted in
    /// buckets): `out[i]` receives layer `i`'s update direction. On
    /// [`Error::NonFinite`] every other layer's result is still written.
    pub fn wait(&mut self, out: &mut [&mut [f32]]) -> Result<&StepStats> {
        self.finish_impl(out)?;
        let s = &self.last;
        log::debug!(
            "gradsync: step {} buckets {} select {:.3e}s pack {:.3e}s allgather {:.3e}s ({} B) allreduce {} {:.3e}s ({} B) sparse exchange {} {:.3e}s ({} nnz, fill estimate {:?}) unpack {:.3e}s wait {:.3e}s",
            s.step, s.buckets, s.select_s, s.pack_s, s.allgather_s, s.fused_bytes, s.allreduce, s.allreduce_s, s.dense_bytes, s.sparse_exchange, s.sparse_reduce_s, s.sparse_reduce_nnz, s.fill_estimate, s.unpack_s, s.wait_s
        );
        for l in &s.layers {
            log::trace!("gradsync: step {} {l:?}", s.step);
        }
        Ok(&self.last)
    }

    /// Statistics of the last completed step.
    pub fn last_stats(&self) -> &StepStats {
        &self.last
    }

    /// This rank's encoded unit of layer `id` in the last step (empty unless
    /// the layer was sparse).
    pub fn last_unit(&self, id: LayerId) -> &[u8] {
        let sparse = |i: usize| self.plan.layers.get(i).map(|p| p.mode) == Some(Mode::Sparse);
        self.reg
            .layers
            .get(id.0)
            .filter(|l| sparse(id.0) && !l.non_finite)
            .map_or(&[][..], |l| &l.unit[..])
    }

    /// Decode `unit` (e.g. [`last_unit`](Self::last_unit)) of layer `id` into
    /// `out`: what this rank contributed to the sum.
    pub fn decode_unit(&self, id: LayerId, unit: &[u8], out: &mut [f32]) -> Result<()> {
        let l = self
            .reg
            .layers
            .get(id.0)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {}", id.0)))?;
        let c = l
            .codec
            .as_deref()
            .ok_or_else(|| Error::InvalidArgument(format!("layer {:?} is dense", l.name)))?;
        c.decode(unit, out)
    }

    /// The residual (what has not been sent yet) of a sparse layer.
    pub fn residual(&self, id: LayerId) -> Option<&[f32]> {
        self.reg
            .layers
            .get(id.0)
            .filter(|l| l.codec.is_some())
            .map(|l| &l.v[..])
    }
}

/// The first pair of a call's buffers whose memory overlaps where at least
/// one of the two is written in place, as indices into `spans` (address,
/// bytes, written); empty buffers never overlap. For the bindings (C ABI,
/// Python), which take the caller's buffers by address: one layer's result
/// written over another's, or over a buffer still to be read, would leave
/// that rank's replica different from its peers' without an error.
/// Buffers that are only read may overlap each other.
///
/// ```
/// use gradsync::sync::first_overlap;
/// // The second buffer starts inside the first, which is written.
/// assert_eq!(first_overlap(&[(0, 64, true), (32, 64, false)]), Some((0, 1)));
/// // Two buffers that are only read may share memory.
/// assert_eq!(first_overlap(&[(0, 64, false), (32, 64, false)]), None);
/// ```
pub fn first_overlap(spans: &[(usize, usize, bool)]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    order.sort_unstable_by_key(|&i| spans[i].0);
    let end = |i: usize| spans[i].0.saturating_add(spans[i].1);
    // By start: a pair shows when its later-starting buffer is reached,
    // against the furthest-reaching buffer before it (any, for a written
    // one; a written one, for a read one).
    let (mut any, mut written): (Option<usize>, Option<usize>) = (None, None);
    for &i in &order {
        let hit = if spans[i].2 { any } else { written };
        if let Some(j) = hit.filter(|&j| spans[i].0 < end(j)) {
            return Some((j.min(i), j.max(i)));
        }
        if any.is_none_or(|j| end(i) > end(j)) {
            any = Some(i);
        }
        if spans[i].2 && written.is_none_or(|j| end(i) > end(j)) {
            written = Some(i);
        }
    }
    None
}

#[cfg(test)]
mod bucket_tests;
#[cfg(test)]
mod tests;
