//! The engine's per-layer and per-step choices beyond the three
//! collectives' rows of [`Tuning`]: which strategy a layer gets, how a
//! layer the caller fixed is priced, the bucket cap, whether a step's local
//! phase runs on rayon's threads, and which allreduce carries PowerSGD's
//! factors. The engine ([`crate::sync`]) asks these of its table and never
//! applies a rule of its own; each answer comes from the pricing modules
//! ([`crate::cost::plan_step`], [`crate::cost::choose_bucket_cap`],
//! [`layers_in_parallel`]), whose argmin and near-tie rule is
//! `cost::argmin`. [`LayerPolicy`] holds what the engine's options say
//! about these choices (the candidates' density, the selection method,
//! the compression threshold, what `auto` may offer), set once with
//! [`Tuning::with_policy`].
//!
//! | decision | asked by | answered from |
//! |---|---|---|
//! | a layer's strategy when the whole table is complete | the table check | [`Tuning::plan_table`] (the step model's plan of every `Auto` layer at once) |
//! | the strategy `register` gives a layer (and `GradSync::auto_choice`'s one-layer answer) | registration | [`Tuning::layer_strategy`]: with a profile the one-layer plan, otherwise (or on a model error) the size rule: dense below the compression threshold, the configured codec from it |
//! | how a fixed layer is priced in a plan | the table check, `plan_buckets` | [`Tuning::fixed_layer`] |
//! | the bucket cap | `plan_buckets` | [`Tuning::buckets`] |
//! | rayon for the local phase and the unpacking | every step's script | [`Tuning::parallel`] |
//! | PowerSGD's factors' allreduce | every step | [`Tuning::factor_allreduce`] |

use super::{layers_in_parallel, Tuning};
use crate::codec::{CodecConfig, RgcMethod};
use crate::cost::{
    engine_candidates, predict, BucketPlan, Placement, Query, StepLayer, StepPlan, StepQuery,
    StrategyId, GRADIVEQ_RATIO,
};
use crate::dense::AllreduceAlgo;
use crate::strategy::{Pick, SparseExchange, Strategy};
use crate::{Error, Result};

/// What the engine's options say about its per-layer choices
/// (`sync::Config`'s `auto_density`, `codec`, `compress_threshold`,
/// `auto_quant`, `auto_powersgd`, `delay` and `parallel_min_elems`).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPolicy {
    /// Density of the selection strategies `auto` chooses among.
    pub density: f64,
    /// The configured codec: the size rule's choice for a layer from the
    /// threshold, and its RGC selection method (if it is RGC) what `auto`'s
    /// RGC runs.
    pub codec: CodecConfig,
    /// Layers with fewer elements are not sparsified
    /// ([`StepQuery::min_sparse_elems`]).
    pub min_sparse_elems: usize,
    /// Whether `auto` may choose quantized RGC.
    pub quant: bool,
    /// The rank `auto` may give a matrix PowerSGD at (0: not offered).
    pub powersgd_rank: usize,
    /// The engine's delay window (PowerSGD cannot run with `delay > 1`).
    pub delay: u64,
    /// Fewest sparse elements for the layer-parallel local phase.
    pub parallel_min_elems: usize,
}

impl Default for LayerPolicy {
    /// The engine's default options' policy.
    fn default() -> Self {
        LayerPolicy {
            density: 0.001,
            codec: CodecConfig::Rgc {
                density: 0.001,
                method: RgcMethod::Trimmed,
            },
            min_sparse_elems: 32 * 1024,
            quant: false,
            powersgd_rank: 0,
            delay: 1,
            parallel_min_elems: 1 << 18,
        }
    }
}

impl LayerPolicy {
    /// The RGC selection method `auto` runs (the configured codec's, if it
    /// is RGC) and its name in the profile.
    pub fn method(&self) -> Result<(RgcMethod, String)> {
        let method = match &self.codec {
            CodecConfig::Rgc { method, .. } => *method,
            _ => RgcMethod::Trimmed,
        };
        let name = serde_json::to_value(method)?
            .as_str()
            .unwrap_or("trimmed")
            .to_string();
        Ok((method, name))
    }
}

impl Tuning {
    /// The table with the options' per-layer `policy`.
    pub fn with_policy(mut self, policy: LayerPolicy) -> Tuning {
        self.policy = policy;
        self
    }

    /// The options' per-layer policy.
    pub fn policy(&self) -> &LayerPolicy {
        &self.policy
    }

    /// Where the engine's steps run at the fill estimate `fill`.
    pub fn placement(&self, fill: Option<f64>) -> Placement {
        Placement {
            p: self.p,
            ranks_per_node: self.ranks_per_node,
            fill,
            allgather: self.masks.allgather,
        }
    }

    fn auto_profile(&self, what: &str) -> Result<&crate::cost::Profile> {
        self.prof.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!("{what} needs Config::profile (gradsync calibrate)"))
        })
    }

    /// What `Auto` layers choose among ([`engine_candidates`] for the
    /// masks), without the node-aware sparse and dense allreduces when the
    /// job has one node (or its nodes are unknown), which the `auto` rows
    /// then never run; PowerSGD where the policy offers it, the profile
    /// prices it and the delay window allows it.
    pub fn candidates(&self) -> Vec<StrategyId> {
        let mut v = engine_candidates(
            self.masks.allreduce,
            self.masks.exchange,
            self.policy.quant,
            self.ranks_per_node.is_some(),
        );
        let priced = self.prof.as_ref().is_some_and(|p| !p.powersgd.is_zero());
        if self.policy.powersgd_rank > 0 && priced && self.policy.delay <= 1 {
            v.push(StrategyId::Powersgd);
        }
        v
    }

    /// The step model's query for this engine's table at the fill
    /// estimate `fill`.
    pub fn step_query(&self, fill: Option<f64>) -> Result<StepQuery> {
        Ok(StepQuery {
            at: self.placement(fill),
            density: self.policy.density,
            select_method: self.policy.method()?.1,
            gradiveq_ratio: GRADIVEQ_RATIO,
            min_sparse_elems: self.policy.min_sparse_elems,
            allowed: self.candidates(),
            powersgd_rank: self.policy.powersgd_rank.max(1),
        })
    }

    /// The engine's strategy for a planned `id`: the selection codecs at
    /// the policy's density and method, PowerSGD at its rank.
    pub fn engine_strategy(&self, id: StrategyId) -> Result<Strategy> {
        let (method, _) = self.policy.method()?;
        let mut s = id
            .engine_strategy(self.policy.density, method)
            .ok_or_else(|| Error::InvalidArgument(format!("the engine cannot run {id}")))?;
        if let Strategy::Powersgd(c) = &mut s {
            c.rank = self.policy.powersgd_rank.max(1);
        }
        Ok(s)
    }

    /// The plan of every `Auto` layer of `layers` by the step model
    /// ([`crate::cost::plan_step`]) at the fill estimate `fill`: the fixed
    /// layers open their groups, each `Auto` one gets the candidate of
    /// least marginal cost to the step.
    pub fn plan_table(&self, layers: &[StepLayer], fill: Option<f64>) -> Result<StepPlan> {
        let prof = self.auto_profile("Strategy::Auto")?;
        crate::cost::plan_step(prof, &self.step_query(fill)?, layers)
    }

    /// The strategy of one layer of `n` elements synchronized alone, and
    /// each candidate's prediction alone (name, seconds): the step model's
    /// plan of a one-layer table ([`plan_table`](Self::plan_table), the
    /// planner a table of `Auto` layers gets), dense only below the
    /// compression threshold. An error without a profile.
    pub fn layer_alone(
        &self,
        n: usize,
        fill: Option<f64>,
    ) -> Result<(Strategy, Vec<(String, f64)>)> {
        let prof = self.auto_profile("Strategy::Auto")?;
        let (_, method_name) = self.policy.method()?;
        let preds = predict(
            prof,
            &Query {
                at: self.placement(fill),
                n,
                density: self.policy.density,
                gradiveq_ratio: GRADIVEQ_RATIO,
            },
            &method_name,
        )?;
        let mut allowed = self.candidates();
        if n < self.policy.min_sparse_elems {
            // Small layers stay dense (StepQuery::min_sparse_elems).
            allowed.retain(|a| a.is_dense());
        }
        let layer = StepLayer {
            name: String::new(),
            n,
            kind: crate::cost::LayerKind::Auto,
            // One layer on its own: no shape here, so no PowerSGD.
            matrix: None,
        };
        let plan = self.plan_table(&[layer], fill)?;
        let strategy = self.engine_strategy(plan.layers[0].choice)?;
        let considered = preds
            .iter()
            .filter(|p| allowed.contains(&p.id))
            .map(|p| (p.name.clone(), p.seconds))
            .collect();
        Ok((strategy, considered))
    }

    /// The strategy `register` gives a layer of `n` elements: with a
    /// profile, [`layer_alone`](Self::layer_alone)'s; otherwise, or where
    /// the model errs (alike on every rank: its inputs are), dense below
    /// the compression threshold and the configured codec from it.
    pub fn layer_strategy(&self, n: usize, fill: Option<f64>) -> Strategy {
        if self.prof.is_some() {
            match self.layer_alone(n, fill) {
                Ok((s, _)) => return s,
                Err(e) => log::debug!(
                    "gradsync: a layer of {n} elements: the cost model: {e}; by size instead"
                ),
            }
        }
        if n < self.policy.min_sparse_elems {
            Strategy::Dense
        } else {
            Strategy::Sparse {
                codec: self.policy.codec.clone(),
                density: None,
            }
        }
    }

    /// The cost model's id and density of a layer the caller fixed to
    /// `strategy` (`compresses`: a PowerSGD layer whose factors shrink it;
    /// `dense`: the dense group's algorithm): what the step model prices
    /// it as.
    pub fn fixed_layer(
        &self,
        strategy: &Strategy,
        compresses: bool,
        dense: StrategyId,
    ) -> (StrategyId, f64) {
        match strategy {
            Strategy::Dense | Strategy::Auto => (dense, 1.0),
            // Its rank in the density's place; a layer PowerSGD leaves
            // dense is in the dense group, with the engine's algorithm.
            Strategy::Powersgd(c) if compresses => (StrategyId::Powersgd, c.rank as f64),
            Strategy::Powersgd(_) => (dense, 1.0),
            Strategy::Gradiveq(_) => (StrategyId::GradiveqRing, 1.0),
            Strategy::Sparse { codec, density } => {
                let d = density
                    .or_else(|| codec.own_density())
                    .unwrap_or(self.policy.density);
                let id = match codec {
                    // RGC layers go by the configured sparse collective
                    // (the quantized ones too, priced as RGC there). With
                    // `auto` the exchange is chosen every step: priced as
                    // the fused allgatherv's.
                    CodecConfig::Rgc { .. } | CodecConfig::RgcQuant { .. }
                        if matches!(
                            self.masks.exchange,
                            Pick::Fixed(SparseExchange::Allreduce | SparseExchange::Hierarchical)
                        ) =>
                    {
                        match self.masks.exchange {
                            Pick::Fixed(SparseExchange::Hierarchical) => {
                                StrategyId::SparseHierarchical
                            }
                            _ => StrategyId::SparseAllreduce,
                        }
                    }
                    CodecConfig::Rgc { .. } => StrategyId::SparseAllgather,
                    CodecConfig::RgcQuant { .. } => StrategyId::SparseAllgatherQuant,
                    // `none` sends 4n bytes: RGC at density ½ sends as many.
                    CodecConfig::None => return (StrategyId::SparseAllgather, 0.5),
                    c => c.name().parse().unwrap_or(StrategyId::SparseAllgather),
                };
                (id, d)
            }
        }
    }

    /// The step of the fixed `layers` in buckets against a backward pass
    /// of `backward_s` seconds: cut at `cap_bytes`, or with `None` at the
    /// cap of least predicted step time ([`crate::cost::choose_bucket_cap`]).
    pub fn buckets(
        &self,
        layers: &[StepLayer],
        backward_s: f64,
        cap_bytes: Option<usize>,
        fill: Option<f64>,
    ) -> Result<BucketPlan> {
        let prof = self.auto_profile("plan_buckets")?;
        let q = self.step_query(fill)?;
        match cap_bytes {
            Some(cap) => crate::cost::price_buckets(prof, &q, layers, backward_s, Some(cap)),
            None => crate::cost::choose_bucket_cap(prof, &q, layers, backward_s),
        }
    }

    /// Whether a step's local phase (or its unpacking) runs its `layers`
    /// layers of `elems` sparse elements on rayon's threads
    /// ([`layers_in_parallel`] at the policy's threshold).
    pub fn parallel(&self, layers: usize, elems: usize) -> bool {
        layers_in_parallel(
            self.prof.as_ref(),
            self.policy.parallel_min_elems,
            layers,
            elems,
        )
    }

    /// The allreduce of PowerSGD's factors when the dense group runs
    /// `dense`: the same algorithm, except `mpi`, whose `MPI_Allreduce`
    /// the MPI standard does not promise to give every rank the same bits
    /// (each rank orthogonalizes its sum, so the ranks' factors must be
    /// identical): the factors then go by Rabenseifner's, which does
    /// (each element is summed on one rank and passed on). Logged with
    /// the table.
    pub fn factor_allreduce(&self, dense: AllreduceAlgo) -> AllreduceAlgo {
        match dense {
            AllreduceAlgo::Mpi => AllreduceAlgo::Rabenseifner,
            a => a,
        }
    }
}
