//! The exchange of the index/value layers' pairs, step by step
//! (`Config::sparse_exchange = "auto"`), and the fill estimate the cost
//! model prices the sparse allreduces with.
//!
//! **The choice.** After planning (the pair layers planned as reduced),
//! [`crate::cost::choose_sparse_exchange`] picks the fused allgatherv, the
//! sparse allreduce or (when the job spans several nodes) the node-aware
//! one from inputs that are the same on every rank: the agreed profile,
//! the reduced group's elements, its *nominal* pairs per rank (each
//! layer's RGC `k = max(1, ⌈d·n⌉)` at this step's density, never a rank's
//! own trimmed count), the message bytes those layers would add to the
//! fused allgatherv (their codecs' nominal sizes), the ranks, the ranks
//! per node (from the node map fetched at creation) and the fill
//! estimate below. Every rank thus runs the same collective. The plan is
//! then resolved ([`super::plan::set_exchange`]); a change of choice is
//! logged (info) with the predictions.
//!
//! **The fill estimate.** After a step whose pairs went through a
//! reducing exchange (any `sparse_exchange`, `Allreduce` and
//! `Hierarchical` too), the measured fill ratio is
//! `ρ = sparse_reduce_nnz / (p·k)`, `k` that step's nominal pairs per
//! rank, clamped to `[1/p, 1]` (all ranks' selections the same .. all
//! disjoint); `sparse_reduce_nnz` is the result's distinct indices, the
//! same on every rank. When `auto` sent the group through the fused
//! allgatherv instead, its unpacking counts the nonzero elements of the
//! group's results as it scatter-adds the pairs (a compare per pair, exact
//! but for sums that cancel to zero; [`crate::sparse::unpack_layer`]'s
//! counting twin) and that count stands for `sparse_reduce_nnz`, alike on
//! every rank (the same bytes added in the same order): without it a job
//! that starts on the allgatherv would never learn that its ranks'
//! selections overlap, where the sparse allreduce pays. A dense decode or
//! a non-finite unit in the group measures nothing. The estimate is an
//! exponential moving average,
//! `ρ̂ ← ρ` at the first measurement, then `ρ̂ ← (ρ̂ + ρ)/2`: it follows a
//! drift within a few steps and does not flip the choice on one outlier.
//! A step that reduced nothing (a failure before the sparse allreduce,
//! every pair non-finite) measures nothing; a configured `Allgather`
//! measures nothing either (no choice reads it). Before any measurement the
//! estimate is `None`: the cost model assumes independent selections.
//! `Strategy::Auto`'s plan (made once, when the table is complete) uses
//! the estimate when there is one. Snapshots do not hold it: a restored
//! run starts from `None` again (the allgatherv and the flat sparse
//! allreduce give bitwise the same result; only a switch to or from the
//! node-aware one changes the order of the additions).

use super::plan::{set_exchange, StepScript};
use super::tuner::{Choice, Load};
use super::{GradSync, SparseExchange};
use crate::comm::Transport;
use crate::cost::{ExchangeChoice, ExchangeQuery, StrategyId};
use crate::sparse::TOC_ENTRY_LEN;

impl<C: Transport + Send + 'static> GradSync<C> {
    /// The plan's reduced group's load, from the plan and the layer
    /// table only (the same on every rank).
    pub(super) fn reduced_load(&self) -> Load {
        let mut load = Load::default();
        // The per-layer list only for the auto choice, its one reader.
        let per_layer = self.plan.exchange == SparseExchange::Auto;
        for &id in &self.plan.reduced.ids {
            let i = id as usize;
            let n = self.table[i].n;
            let d = self.plan.layers[i].density.unwrap_or(self.cfg.auto_density);
            let k = crate::codec::rgc_k(d, n) as f64;
            let unit = self.layers[i]
                .codec
                .as_deref()
                .and_then(|c| c.config().with_density(d.clamp(1e-12, 1.0)).wire_bytes(n))
                .unwrap_or(12.0 + 8.0 * k);
            load.n += n;
            load.k += k;
            load.message_bytes += unit + TOC_ENTRY_LEN as f64;
            if per_layer {
                load.layers.push((n, unit + TOC_ENTRY_LEN as f64));
                load.ids.push(id);
            }
        }
        load
    }

    /// Resolve this step's exchange of the reduced group (`auto`: the cost
    /// model's choice; otherwise the configured one) and remember its
    /// nominal load for the fill measurement. Cannot fail: a model error
    /// (the same on every rank) falls back to the allgatherv.
    pub(super) fn resolve_exchange(&mut self) {
        self.tuner.load = if self.plan.sparse_reduce {
            self.reduced_load()
        } else {
            Load::default()
        };
        if self.plan.exchange != SparseExchange::Auto {
            return;
        }
        let q = ExchangeQuery {
            n: self.tuner.load.n,
            k: self.tuner.load.k,
            message_bytes: self.tuner.load.message_bytes,
            p: self.size,
            ranks_per_node: self.ranks_per_node(),
            fill: self.tuner.fill(),
            allgather: self.cfg.allgather,
            layers: std::mem::take(&mut self.tuner.load.layers),
        };
        let choice = match self.cfg.profile.as_ref() {
            Some(prof) => crate::cost::choose_sparse_exchange(prof, &q),
            None => Err(crate::Error::InvalidArgument(
                "sparse_exchange \"auto\" needs Config::profile".into(),
            )),
        };
        let ex = match &choice {
            // The sparse allreduces address the pairs' concatenated index
            // space with u32 indices: past it only the allgatherv runs.
            _ if q.n > u32::MAX as usize => SparseExchange::Allgather,
            Ok(c) => exchange_of(c.id),
            Err(e) => {
                log::warn!(
                    "gradsync: step {}: sparse exchange auto: {e}; using the allgatherv",
                    self.step
                );
                SparseExchange::Allgather
            }
        };
        if self.tuner.chose(Choice::Exchange(ex)) {
            if let Ok(c) = &choice {
                log::info!(
                    "gradsync: step {}: sparse exchange auto chose {} for {} elements, {} pairs per rank, fill {}: {}",
                    self.step,
                    ex.name(),
                    q.n,
                    q.k,
                    q.fill
                        .map_or_else(|| "independent".to_string(), |f| format!("{f:.3}")),
                    describe(c)
                );
            }
        }
        set_exchange(&mut self.plan, ex, self.size);
    }

    /// `allreduce = "auto"`: this step's dense algorithm, the cost model's
    /// fastest for the step's dense group ([`crate::cost::choose_dense_allreduce`]
    /// from its elements, the communicator's size and the node map: alike
    /// on every rank, so every rank runs the same algorithm). Logged when
    /// the choice changes. Nothing to do for a configured algorithm.
    pub(super) fn resolve_allreduce(&mut self) {
        use crate::dense::AllreduceAlgo;
        if self.cfg.allreduce != AllreduceAlgo::Auto {
            return;
        }
        let bytes = 4.0 * self.plan.dense.elems as f64;
        let choice = match self.cfg.profile.as_ref() {
            Some(prof) => {
                crate::cost::choose_dense_allreduce(prof, bytes, self.size, self.ranks_per_node())
            }
            None => Err(crate::Error::InvalidArgument(
                "allreduce \"auto\" needs Config::profile".into(),
            )),
        };
        let algo = match &choice {
            Ok(c) => match c.id {
                StrategyId::DenseRing => AllreduceAlgo::Ring,
                StrategyId::DenseHierarchical => AllreduceAlgo::Hierarchical,
                _ => AllreduceAlgo::Rabenseifner,
            },
            Err(e) => {
                log::warn!(
                    "gradsync: step {}: allreduce auto: {e}; using Rabenseifner",
                    self.step
                );
                AllreduceAlgo::Rabenseifner
            }
        };
        if self.tuner.chose(Choice::Allreduce(algo)) {
            if let Ok(c) = &choice {
                log::info!(
                    "gradsync: step {}: allreduce auto chose {} for {} dense bytes: {}",
                    self.step,
                    algo.name(),
                    bytes,
                    describe(c)
                );
            }
        }
        self.plan.allreduce = algo;
    }

    /// `allgather = "auto"`: this step's allgatherv of the fused message,
    /// the cost model's cheaper of the flat and the node-aware one
    /// ([`crate::cost::choose_allgatherv`]) for the message's nominal size
    /// (each fused layer's codec at this step's density, the sizes the
    /// step model prices; a data-dependent codec at the profile's measured
    /// bytes per element, else its nominal ones), the communicator's size
    /// and the node map: alike on every rank. Without a profile, or without
    /// a fused message, recursive doubling. Logged when the choice changes.
    pub(super) fn resolve_allgather(&mut self) {
        use crate::dense::AllgathervAlgo;
        if self.cfg.allgather != AllgathervAlgo::Auto || !self.plan.gather {
            return;
        }
        let Some(prof) = self.cfg.profile.as_ref() else {
            return;
        };
        let mut bytes = crate::sparse::FUSED_HEADER_LEN as f64;
        for &id in &self.plan.sparse.ids {
            let i = id as usize;
            let n = self.table[i].n;
            let unit = self.layers[i].codec.as_deref().map_or(0.0, |c| {
                let config = match self.plan.layers[i].density {
                    Some(d) => c.config().with_density(d.clamp(1e-12, 1.0)),
                    None => c.config(),
                };
                config
                    .wire_bytes(n)
                    .unwrap_or_else(|| crate::cost::nominal_wire_bytes(prof, &config.name(), n))
            });
            bytes += unit + TOC_ENTRY_LEN as f64;
        }
        let choice = crate::cost::choose_allgatherv(prof, bytes, self.size, self.ranks_per_node());
        let algo = match &choice {
            Ok(c) => c.algo,
            Err(e) => {
                log::warn!(
                    "gradsync: step {}: allgather auto: {e}; using recursive doubling",
                    self.step
                );
                AllgathervAlgo::RecursiveDoubling
            }
        };
        if self.tuner.chose(Choice::Allgather(algo)) {
            if let Ok(c) = &choice {
                log::info!(
                    "gradsync: step {}: allgather auto chose {} for {bytes} bytes a rank: {}",
                    self.step,
                    algo.name(),
                    c.predictions
                        .iter()
                        .map(|(a, s)| format!("{} {:.1} us", a.name(), s * 1e6))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        self.plan.allgather = algo;
    }

    /// The fill ratio estimated from the previous steps (module
    /// docs of `exchange.rs`), `None` before any.
    pub fn fill_estimate(&self) -> Option<f64> {
        self.tuner.fill()
    }
}

/// The layers whose unpacking counts the fill this step: the reduced
/// group that `auto` moved back into the allgatherv (empty otherwise).
pub(super) fn fill_probe_ids<'a>(plan: &StepScript, load: &'a Load) -> &'a [u32] {
    if plan.exchange == SparseExchange::Allgather {
        &load.ids
    } else {
        &[]
    }
}

/// The engine's exchange for the cost model's id.
fn exchange_of(id: StrategyId) -> SparseExchange {
    match id {
        StrategyId::SparseAllreduce => SparseExchange::Allreduce,
        StrategyId::SparseHierarchical => SparseExchange::Hierarchical,
        _ => SparseExchange::Allgather,
    }
}

/// `name 1.2 us, ...` of the predictions.
fn describe(c: &ExchangeChoice) -> String {
    c.predictions
        .iter()
        .map(|(id, s)| format!("{id} {:.1} us", s * 1e6))
        .collect::<Vec<_>>()
        .join(", ")
}
