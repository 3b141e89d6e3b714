//! The layer table and its agreement across ranks: registration
//! (`register*`: a default strategy is resolved here by
//! [`GradSync::resolve`]; `Auto` layers are planned together when the table
//! is complete, by the step model [`crate::cost::plan_step`], in
//! `check_table`), the layer's
//! state allocation (in the rank-local half, so a failure fails every rank
//! alike), and the collective checks that every rank registered the same
//! table under the same options (an FNV hash compared by one small
//! allreduce per registration, one more before the first step; the failure
//! model of [`crate::comm::agree`]).

use super::layer::{zeros, Layer};
use super::plan::TableRow;
use super::{GradSync, LayerStats, Strategy};
use crate::codec::Codec;
use crate::comm::Transport;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Handle of a registered layer (its index in registration order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerId(pub usize);

use crate::comm::agree::{agree_call, CallKind};
pub(super) use crate::comm::agree::{fnv, FNV_OFFSET};

/// The layer table: the registered layers and their state, the planner's
/// rows, the names, and the table's agreement across ranks (its hashes,
/// whether it was checked complete, the `Auto` layers' plan, or why it
/// broke).
pub(super) struct LayerTable {
    pub(super) layers: Vec<Layer>,
    /// The planner's view of the layer table (one row per layer).
    pub(super) table: Vec<TableRow>,
    /// Each registered layer's index by name (names are unique).
    pub(super) names: std::collections::HashMap<String, usize>,
    pub(super) table_hash: u64,
    /// `table_hash` as it would be with `allgather: "recdbl"`, the default
    /// when older snapshots were written: a snapshot that matches it gets
    /// an error saying which option to set.
    pub(super) legacy_hash: u64,
    pub(super) table_checked: bool,
    /// The step model's plan of the `Auto` layers, once the table is complete.
    pub(super) auto_plan: Option<crate::cost::StepPlan>,
    /// Set (alike on every rank) when the table check failed: the engine
    /// communicates no more and every later step returns this error.
    pub(super) broken: Option<String>,
}

impl LayerTable {
    /// An empty table whose hashes start from the options' (`table_hash`)
    /// and the legacy options' (`legacy_hash`).
    pub(super) fn new(table_hash: u64, legacy_hash: u64) -> Self {
        LayerTable {
            layers: Vec::new(),
            table: Vec::new(),
            names: std::collections::HashMap::new(),
            table_hash,
            legacy_hash,
            table_checked: false,
            auto_plan: None,
            broken: None,
        }
    }
}

impl<C: Transport + Send + 'static> GradSync<C> {
    /// The entry agreement of a table call (`call`: which one, for ranks
    /// in different calls, [`agree_call`]): compare `h` across ranks (one
    /// 56-byte collective); on a mismatch every rank returns
    /// [`Error::TableMismatch`] with `what()`. A rank that passes `Err`
    /// still enters the collective: every rank then returns the same
    /// [`Error::RankFailed`] (the failure model, [`crate::comm::agree`]).
    pub(super) fn agree(
        &mut self,
        call: (CallKind, &dyn Fn() -> String),
        h: Result<u64>,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let comm = self.progress.inline_comm().ok_or_else(|| {
            Error::InvalidArgument("the layer table is fixed once steps have started".into())
        })?;
        let (local, h) = match h {
            Ok(h) => (Ok(()), h),
            Err(e) => (Err(e), 0),
        };
        if agree_call(comm, call.0, call.1, local, h)? {
            return Ok(());
        }
        // Every rank is here (the hashes differ somewhere): every rank
        // names the same two, rank 0's and the lowest rank's that differs.
        let mine = what();
        let why = match crate::comm::agree::first_difference(comm, h, &mine)? {
            (first, Some((r, theirs))) => {
                format!("not the same on every rank: rank 0 has {first}, rank {r} has {theirs}")
            }
            (_, None) => format!("not the same on every rank: {mine}"),
        };
        Err(Error::TableMismatch(why))
    }

    /// The strategy a layer of `n` elements gets from [`register`](Self::register):
    /// with a profile, the cost model's choice ([`Strategy::Auto`]);
    /// otherwise `Dense` below `compress_threshold`, else the configured
    /// codec (the decision table's answer,
    /// [`crate::cost::Tuning::layer_strategy`]).
    pub fn resolve(&self, n: usize) -> Strategy {
        self.tuning.layer_strategy(n, self.tuner.fill())
    }

    /// The cost model's choice for one layer of `n` elements synchronized
    /// alone: the step model's plan ([`crate::cost::plan_step`]) of a
    /// one-layer table, the planner a table of `Auto` layers gets
    /// ([`auto_plan`](Self::auto_plan)), among dense (the configured
    /// allreduce), RGC and optionally quantized RGC at `auto_density`
    /// (dense only below `compress_threshold`), with each candidate's
    /// prediction alone (name, seconds); the decision table's answer
    /// ([`crate::cost::Tuning::layer_alone`]).
    pub fn auto_choice(&self, n: usize) -> Result<(Strategy, Vec<(String, f64)>)> {
        self.tuning.layer_alone(n, self.tuner.fill())
    }

    /// Register a layer with the default strategy ([`resolve`](Self::resolve)).
    /// Collective: all ranks must register the same layers in the same order.
    /// Names must be unique, non-empty and free of control characters
    /// (errors, stats and snapshots name layers by them).
    pub fn register(&mut self, name: &str, shape: &[usize]) -> Result<LayerId> {
        let strategy = self.default_strategy(shape);
        self.register_impl(name, shape, strategy)
    }

    /// What `register` (and the spec `"auto"`) gives a layer: the cost
    /// model's choice with a profile, else by size.
    pub(super) fn default_strategy(&self, shape: &[usize]) -> Result<Strategy> {
        if self.cfg.profile.is_some() {
            return Ok(Strategy::Auto);
        }
        shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .map(|n| self.resolve(n))
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows")))
    }

    /// Register a layer with an explicit strategy. Collective: one 16-byte
    /// allreduce compares a hash of the table so far; a rank whose table
    /// differs makes every rank fail with [`Error::TableMismatch`].
    pub fn register_with(
        &mut self,
        name: &str,
        shape: &[usize],
        strategy: Strategy,
    ) -> Result<LayerId> {
        self.register_impl(name, shape, Ok(strategy))
    }

    /// Register a layer with a strategy given as text, as the C ABI and the
    /// Python package do: `"auto"` ([`register`](Self::register)'s choice:
    /// the cost model with a profile, else by size), `"dense"`,
    /// `"gradiveq[:k=768,d=96|lambda=0.01,...]"`, or a codec string such
    /// as `"rgc:density=0.001"` or `"3lc:s=1.75"` ([`Strategy::parse`]).
    /// A spec that does not parse on one rank fails the registration
    /// collective on every rank, naming that rank.
    pub fn register_spec(&mut self, name: &str, shape: &[usize], spec: &str) -> Result<LayerId> {
        let strategy = match spec.trim() {
            "auto" => self.default_strategy(shape),
            s => Strategy::parse(s),
        };
        self.register_impl(name, shape, strategy)
    }

    /// Take part in a registration carrying an error the caller found
    /// before it had a valid name, shape or strategy (a binding given
    /// arguments of the wrong type): the registration collective fails on
    /// every rank, naming this one and `err`; nothing is registered
    /// anywhere. Returns that error.
    pub fn fail_register(&mut self, name: &str, err: Error) -> Error {
        match self.register_impl(name, &[0], Err(err)) {
            Err(e) => e,
            Ok(_) => Error::InvalidArgument("a failed registration succeeded".into()),
        }
    }

    /// A registration after the table was fixed (by the first step's
    /// start, or a restore): no peer is in a registration collective any
    /// more (peers are in steps, or registering late alike). This call
    /// still enters their call's first agreement, as a registration
    /// carrying the error, so that they fail with it instead of waiting (in
    /// a step: ranks in different calls). A rank whose own step is open is
    /// alone in its misuse (its step's collectives run on; no peer waits
    /// for this call).
    fn refuse_late_registration(&mut self, name: &str) -> Result<LayerId> {
        let err = Error::InvalidArgument(format!(
            "register {name:?}: register every layer before the first step"
        ));
        if self.pending() {
            return Err(err);
        }
        let what = format!("registration of {name:?} after the first step");
        self.agree_status(CallKind::Register, Err(err), (0, what))?;
        Err(Error::InvalidArgument(
            "a registration after the first step succeeded".into(),
        ))
    }

    pub(super) fn register_impl(
        &mut self,
        name: &str,
        shape: &[usize],
        strategy: Result<Strategy>,
    ) -> Result<LayerId> {
        if self.reg.table_checked
            || self.pending()
            || self.step > 0
            || matches!(self.progress, super::progress::Progress::Threaded(_))
        {
            return self.refuse_late_registration(name);
        }
        let id = self.reg.layers.len();
        // Everything rank-local first; a failure still enters the
        // registration collective so no peer waits in it.
        let (mom, delay) = (self.cfg.momentum != 0.0, self.cfg.delay > 1);
        // The layer's state is allocated here, in the rank-local half: a
        // rank that cannot allocate it fails the registration collective
        // on every rank instead of aborting after it (peers would wait).
        let local = strategy
            .and_then(|s| self.prepare_layer(id, name, shape, s))
            .and_then(|l| {
                // An `Auto` layer may become sparse when the table is planned.
                let sparse = l.codec.is_some() || l.auto;
                let st = layer_buffers(l.n, sparse, mom, delay)?;
                Ok((l, st))
            });
        // The resolved strategy with all its parameters (the mismatch
        // message shows rank 0's and the differing rank's side by side).
        let label = local.as_ref().map_or_else(
            |_| String::new(),
            |l| serde_json::to_string(&l.0.strategy).unwrap_or_else(|_| l.0.label.clone()),
        );
        let h = local.as_ref().map(|l| l.0.hash).map_err(|e| {
            let why = match e {
                Error::InvalidArgument(m) => m.clone(),
                e => e.to_string(),
            };
            Error::InvalidArgument(format!("layer {name:?} (#{id}): {why}"))
        });
        if let Some(why) = &self.reg.broken {
            return Err(Error::TableMismatch(why.clone()));
        }
        let call = || CallKind::Table.describe(0);
        let r = self.agree((CallKind::Table, &call), h, || {
            format!("layer #{id} {name:?} of shape {shape:?}, strategy {label}")
        });
        if let Err(Error::TableMismatch(why)) = &r {
            // The ranks' tables are out of step (this collective may even
            // have met a peer's final table check): no rank may go on.
            self.reg.broken = Some(why.clone());
        }
        r?;
        let (prep, bufs) = local?;
        self.reg.table_hash = prep.hash;
        self.reg.legacy_hash = layer_hash(self.reg.legacy_hash, id, name, shape, &prep.strategy)?;
        let (n, label) = (prep.n, prep.label.clone());
        let layer = new_layer(name, shape, prep, bufs);
        self.reg.table.push(layer.table_row());
        self.reg.names.insert(layer.name.clone(), id);
        self.reg.layers.push(layer);
        log::debug!("gradsync: layer #{id} {name:?} {shape:?} ({n} elements): {label}");
        Ok(LayerId(id))
    }

    /// The rank-local part of [`register_with`](Self::register_with).
    pub(super) fn prepare_layer(
        &self,
        id: usize,
        name: &str,
        shape: &[usize],
        strategy: Strategy,
    ) -> Result<Prepared> {
        // Errors, stats and snapshots name layers: a name must tell one
        // layer from the others.
        if name.is_empty() {
            return Err(Error::InvalidArgument(
                "a layer needs a name (errors and stats name layers by it)".into(),
            ));
        }
        if name.chars().any(char::is_control) {
            return Err(Error::InvalidArgument(
                "the name holds a control character (NUL, newline, ...)".into(),
            ));
        }
        // By the name index: a scan of the table here made registering
        // n layers cost O(n²).
        if let Some(&j) = self.reg.names.get(name) {
            return Err(Error::InvalidArgument(format!(
                "layer #{j} has the same name (names must be unique: errors, stats and \
                 snapshots name layers by them)"
            )));
        }
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows")))?;
        // `Auto` is resolved when the table is complete ([`Self::check_table`]):
        // the step model plans every layer against the whole step.
        let auto = strategy == Strategy::Auto;
        if auto && self.cfg.profile.is_none() {
            return Err(Error::InvalidArgument(
                "Strategy::Auto needs Config::profile (gradsync calibrate)".into(),
            ));
        }
        let gvq = match &strategy {
            Strategy::Gradiveq(sc) => {
                if self.cfg.delay > 1 {
                    return Err(Error::InvalidArgument(
                        "GradiVeQ cannot be combined with delay > 1".to_string(),
                    ));
                }
                Some(crate::gradiveq::schedule::GradiveqLayer::new(
                    n,
                    sc.clone(),
                )?)
            }
            _ => None,
        };
        let psg = match &strategy {
            Strategy::Powersgd(c) => {
                if self.cfg.delay > 1 {
                    return Err(Error::InvalidArgument(
                        "PowerSGD cannot be combined with delay > 1".to_string(),
                    ));
                }
                c.layer_state(shape, id)?
            }
            _ => None,
        };
        let codec = build_codec(&strategy, n)?;
        let hash = layer_hash(self.reg.table_hash, id, name, shape, &strategy)?;
        let label = strategy.label();
        Ok(Prepared {
            n,
            strategy,
            codec,
            hash,
            label,
            gvq,
            psg,
            auto,
        })
    }

    /// Declare the layer table complete now (collective): the check that
    /// every rank registered the same table, and the plan of the `Auto`
    /// layers, otherwise done by the first step. For callers that start
    /// several engines' steps in an order that may differ across ranks
    /// (the first `start` of each would block in this check). Idempotent;
    /// no layer can be registered afterwards.
    ///
    /// ```
    /// use gradsync::comm::LocalComm;
    /// use gradsync::sync::{Config, GradSync};
    /// let out = LocalComm::run(2, |c| {
    ///     let mut e = GradSync::with_transport(c, Config::default()).unwrap();
    ///     e.register("w", &[4]).unwrap();
    ///     e.complete_table().unwrap();
    ///     e.complete_table().unwrap(); // idempotent
    ///     let late = e.register("b", &[2]).is_err();
    ///     let mut w = [e.rank() as f32; 4];
    ///     e.sync(&mut [&mut w[..]]).unwrap();
    ///     (late, w[0])
    /// });
    /// assert_eq!(out[1], (true, 0.5));
    /// ```
    pub fn complete_table(&mut self) -> Result<()> {
        if self.pending() {
            return Err(Error::InvalidArgument(
                "complete_table between start and wait".into(),
            ));
        }
        self.check_table()
    }

    /// Check once, before the first step, that every rank registered the
    /// same number of layers.
    pub(super) fn check_table(&mut self) -> Result<()> {
        if self.reg.table_checked {
            return Ok(());
        }
        let h = fnv(
            fnv(self.reg.table_hash, b"complete"),
            &(self.reg.layers.len() as u64).to_le_bytes(),
        );
        if let Some(why) = &self.reg.broken {
            return Err(Error::TableMismatch(why.clone()));
        }
        let n = self.reg.layers.len();
        // The `Auto` layers' plan is rank-local (the same on every rank:
        // same table, same agreed profile); a rank where it fails still
        // enters the check, which then fails on every rank.
        let planned = self.plan_auto();
        let h = planned
            .as_ref()
            .map(|_| h)
            .map_err(|e| Error::InvalidArgument(format!("planning the Auto layers: {e}")));
        let describe = || CallKind::Table.describe(0);
        let r = self.agree((CallKind::Table, &describe), h, || {
            format!("{n} layers registered")
        });
        match r.and(planned) {
            Ok(planned) => {
                self.apply_auto(planned);
                self.reg.table_checked = true;
                Ok(())
            }
            Err(e) => {
                // Every rank got an error here: none may run a step.
                self.reg.broken = Some(match &e {
                    Error::TableMismatch(why) => why.clone(),
                    e => e.to_string(),
                });
                Err(e)
            }
        }
    }

    /// Plan every `Auto` layer with the step model ([`crate::cost::plan_step`])
    /// over the whole table: the layers fixed by the caller stay as they are
    /// and open their groups, the `Auto` ones get the strategy of least
    /// marginal cost to the step among what the engine runs for this
    /// configuration ([`crate::cost::engine_candidates`]). `None` when no
    /// layer is `Auto`.
    fn plan_auto(&self) -> Result<Option<AutoPlan>> {
        if !self.reg.layers.iter().any(|l| l.strategy == Strategy::Auto) {
            return Ok(None);
        }
        let table = self.step_layers()?;
        let plan = self.tuning.plan_table(&table, self.tuner.fill())?;
        let mut layers = Vec::new();
        for (i, (l, lp)) in self.reg.layers.iter().zip(&plan.layers).enumerate() {
            if l.strategy != Strategy::Auto {
                continue;
            }
            let s = self.tuning.engine_strategy(lp.choice)?;
            let psg = match &s {
                Strategy::Powersgd(c) => c
                    .layer_state(&l.shape, i)
                    .map_err(|e| Error::InvalidArgument(format!("layer {:?}: {e}", l.name)))?,
                _ => None,
            };
            let codec = build_codec(&s, l.n)
                .map_err(|e| Error::InvalidArgument(format!("layer {:?}: {e}", l.name)))?;
            layers.push((i, s, codec, psg));
        }
        Ok(Some(AutoPlan { plan, layers }))
    }

    /// Bytes of the layers fixed dense (the dense group of a step without
    /// warm-up), which the decision table's allreduce is looked up for.
    fn fixed_dense_bytes(&self) -> f64 {
        let elems: usize = self
            .reg
            .layers
            .iter()
            .filter(|l| l.strategy == Strategy::Dense)
            .map(|l| l.n)
            .sum();
        4.0 * elems as f64
    }

    /// The overlap model's plan of this engine's table as a step in
    /// buckets ([`submit_bucket`](Self::submit_bucket)) against a backward
    /// pass of `backward_s` seconds: cut at `cap_bytes`, or with `None`
    /// at the cap of least predicted step time
    /// ([`crate::cost::choose_bucket_cap`]; the module docs of
    /// [`crate::cost`]'s bucket model say how it prices). Priced with
    /// `Config::profile` and the layers' resolved strategies, so after
    /// the table is complete ([`complete_table`](Self::complete_table) or
    /// a step). Local: every rank given the same `backward_s` (agree it
    /// first, e.g. the ranks' maximum) gets the same plan.
    pub fn plan_buckets(
        &self,
        backward_s: f64,
        cap_bytes: Option<usize>,
    ) -> Result<crate::cost::BucketPlan> {
        if self.cfg.profile.is_none() {
            return Err(Error::InvalidArgument(
                "plan_buckets needs Config::profile (gradsync calibrate)".into(),
            ));
        }
        if self.reg.layers.iter().any(|l| l.strategy == Strategy::Auto) {
            return Err(Error::InvalidArgument(
                "the auto layers have no strategy yet: complete_table() first".into(),
            ));
        }
        let table = self.step_layers()?;
        self.tuning
            .buckets(&table, backward_s, cap_bytes, self.tuner.fill())
    }

    /// The table as the step model reads it: an `Auto` layer as
    /// [`LayerKind::Auto`](crate::cost::LayerKind::Auto), every other as
    /// the cost-model id and density of its strategy, a dense one with the
    /// decision table's algorithm for the layers fixed dense (`auto`
    /// chooses every step by the dense group's size).
    fn step_layers(&self) -> Result<Vec<crate::cost::StepLayer>> {
        use crate::cost::{LayerKind, StepLayer};
        let dense = self.tuning.dense_id(self.fixed_dense_bytes())?;
        let layer = |l: &super::layer::Layer| StepLayer {
            name: l.name.clone(),
            n: l.n,
            kind: match &l.strategy {
                Strategy::Auto => LayerKind::Auto,
                s => {
                    let (id, density) = self.tuning.fixed_layer(s, l.psg.is_some(), dense);
                    LayerKind::Fixed(id, density)
                }
            },
            matrix: l.matrix(),
        };
        Ok(self.reg.layers.iter().map(layer).collect())
    }

    /// Ranks per node for the step model: the largest node's count when the
    /// job spans several nodes (block placement assumed), else `None`.
    pub(super) fn ranks_per_node(&self) -> Option<usize> {
        crate::comm::ranks_per_node(self.nodes.as_ref()?)
    }

    /// Give the `Auto` layers their planned strategies (cannot fail).
    fn apply_auto(&mut self, planned: Option<AutoPlan>) {
        let Some(AutoPlan { plan, layers }) = planned else {
            return;
        };
        for (i, s, codec, psg) in layers {
            let l = &mut self.reg.layers[i];
            l.psg = psg;
            if codec.is_none() {
                // Not sparse after all: no residual.
                l.v = Vec::new();
            }
            log::debug!(
                "gradsync: layer {:?} ({} elements): auto planned {} ({} us marginal)",
                l.name,
                l.n,
                s.label(),
                plan.layers[i].marginal_s * 1e6
            );
            l.strategy = s;
            l.codec = codec;
            self.reg.table[i] = l.table_row();
        }
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for l in &plan.layers {
            *counts.entry(l.choice.name()).or_default() += 1;
        }
        log::info!(
            "gradsync: auto planned {} layers on {} ranks: {:?}; predicted step {:.3} ms in {} group(s)",
            plan.layers.len(),
            self.size,
            counts,
            plan.seconds * 1e3,
            plan.groups.len()
        );
        self.reg.auto_plan = Some(plan);
    }

    /// The step model's plan of the table ([`crate::cost::plan_step`]) when
    /// some layer was registered `Auto`: per layer the choice, group and
    /// marginal seconds, the groups and the predicted step. Available once
    /// the table is complete (after the first step, or a snapshot restore).
    pub fn auto_plan(&self) -> Option<&crate::cost::StepPlan> {
        self.reg.auto_plan.as_ref()
    }
}

/// A layer's rank-local registration ([`GradSync::prepare_layer`]).
pub(super) struct Prepared {
    /// Elements.
    pub(super) n: usize,
    /// The strategy as registered.
    pub(super) strategy: Strategy,
    /// The codec (sparse layers).
    pub(super) codec: Option<Box<dyn Codec>>,
    /// The table hash with this layer.
    pub(super) hash: u64,
    /// The strategy's label.
    pub(super) label: String,
    /// GradiVeQ's state (GradiVeQ layers).
    pub(super) gvq: Option<crate::gradiveq::schedule::GradiveqLayer>,
    /// PowerSGD's state (PowerSGD layers it compresses).
    pub(super) psg: Option<crate::powersgd::PowerSgd>,
    /// Registered `Auto`.
    pub(super) auto: bool,
}

/// A registered layer from its rank-local registration and state buffers.
fn new_layer(name: &str, shape: &[usize], prep: Prepared, bufs: LayerBuffers) -> Layer {
    let (v, u, acc, prev, wc) = bufs;
    Layer {
        name: name.to_string(),
        shape: shape.to_vec(),
        n: prep.n,
        strategy: prep.strategy,
        codec: prep.codec,
        v,
        u,
        acc,
        prev,
        wc,
        dir: Vec::new(),
        unit: Vec::new(),
        gvq: prep.gvq,
        psg: prep.psg,
        cur_density: None,
        non_finite: false,
        sent: false,
        codec_state: None,
        moved: super::layer::Moved::No,
        stats: LayerStats {
            name: name.to_string(),
            auto: prep.auto,
            ..LayerStats::default()
        },
    }
}

/// The `Auto` layers' plan: the step model's output and, per `Auto` layer
/// (index), its strategy and codec.
pub(super) struct AutoPlan {
    plan: crate::cost::StepPlan,
    layers: Vec<AutoLayer>,
}

/// One planned `Auto` layer: index, strategy, codec, PowerSGD state.
type AutoLayer = (
    usize,
    Strategy,
    Option<Box<dyn Codec>>,
    Option<crate::powersgd::PowerSgd>,
);

/// A layer's codec for `strategy` (sparse only), with error feedback where
/// it stays bounded ([`Codec::feedback`]).
fn build_codec(strategy: &Strategy, n: usize) -> Result<Option<Box<dyn Codec>>> {
    Ok(match strategy {
        Strategy::Dense | Strategy::Auto | Strategy::Gradiveq(_) | Strategy::Powersgd(_) => None,
        Strategy::Sparse { codec, density } => {
            let mut c = codec.build()?;
            c.feedback(n)?;
            if let Some(d) = density {
                c.set_density(*d)?;
            }
            Some(c)
        }
    })
}

/// The layer table's hash `seed` with layer `id` (`name`, `shape`,
/// `strategy`) folded in: what a snapshot carries to be loaded only into
/// the same table and options.
pub(super) fn layer_hash(
    seed: u64,
    id: usize,
    name: &str,
    shape: &[usize],
    strategy: &Strategy,
) -> Result<u64> {
    let mut h = fnv(seed, b"layer");
    h = fnv(h, &(id as u64).to_le_bytes());
    h = fnv(h, name.as_bytes());
    h = fnv(h, &[0xff]);
    for d in shape {
        h = fnv(h, &(*d as u64).to_le_bytes());
    }
    Ok(fnv(h, serde_json::to_string(strategy)?.as_bytes()))
}

/// A layer's state: the residual `v` (sparse layers, and `Auto` ones that
/// may become sparse), the momentum `u`, and the delay window's
/// accumulator, previous and kept weights.
type LayerBuffers = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Allocate a layer's state (zeroed), failing (not aborting) when the
/// memory is not there; every layer also needs its length in the step's
/// buffers, tried once here.
fn layer_buffers(n: usize, sparse: bool, momentum: bool, delay: bool) -> Result<LayerBuffers> {
    drop(zeros(n, true, false)?);
    Ok((
        zeros(n, sparse, true)?,
        zeros(n, momentum, true)?,
        zeros(n, delay, true)?,
        zeros(n, delay, true)?,
        zeros(n, delay, true)?,
    ))
}
