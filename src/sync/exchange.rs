//! The exchange of the index/value layers' pairs, step by step
//! (`Config::sparse_exchange = "auto"`), and the fill estimate the cost
//! model prices the sparse allreduces with.
//!
//! **The choice.** After planning (the pair layers planned as reduced),
//! the engine looks the exchange up in its decision table
//! ([`crate::cost::Tuning::exchange`]), whose `auto` row is priced by
//! [`crate::cost::choose_sparse_exchange`]: the fused allgatherv, the
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
use crate::cost::ExchangeLoad;
use crate::sparse::TOC_ENTRY_LEN;

impl<C: Transport + Send + 'static> GradSync<C> {
    /// The plan's reduced group's load, from the plan and the layer
    /// table only (the same on every rank).
    pub(super) fn reduced_load(&self) -> Load {
        let mut load = Load::default();
        // The per-layer list only for the auto choice, its one reader.
        let per_layer = self.cfg.sparse_exchange.is_auto();
        for &id in &self.plan.reduced.ids {
            let i = id as usize;
            let n = self.reg.table[i].n;
            let d = self.plan.layers[i].density.unwrap_or(self.cfg.auto_density);
            let k = crate::codec::rgc_k(d, n) as f64;
            let unit = self.reg.layers[i]
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

    /// This step's exchange of the reduced group, looked up in the
    /// decision table ([`crate::cost::Tuning::exchange`]: `auto`'s choice
    /// for the group's nominal load and the fill estimate, or the forced
    /// one), and its nominal load remembered for the fill measurement.
    /// Cannot fail: the table falls back to the allgatherv on a model
    /// error (the same on every rank).
    pub(super) fn resolve_exchange(&mut self) {
        self.tuner.load = if self.plan.sparse_reduce {
            self.reduced_load()
        } else {
            Load::default()
        };
        if !self.plan.sparse_reduce {
            return;
        }
        let fill = self.tuner.fill();
        let load = &mut self.tuner.load;
        let row = ExchangeLoad {
            n: load.n,
            k: load.k,
            message_bytes: load.message_bytes,
            layers: std::mem::take(&mut load.layers),
        };
        let d = self.tuning.exchange(&row, fill);
        let ex = d.pick;
        if self.cfg.sparse_exchange.is_auto()
            && self.tuner.chose(Choice::Exchange(ex))
            && d.fallback.is_none()
        {
            log::info!(
                "gradsync: step {}: sparse exchange auto chose {} for {} elements, {} pairs per rank, fill {}: {}",
                self.step,
                ex.name(),
                row.n,
                row.k,
                fill.map_or_else(|| "independent".to_string(), |f| format!("{f:.3}")),
                d.describe()
            );
        }
        self.tuner.load.layers = row.layers;
        set_exchange(&mut self.plan, ex, self.size);
    }

    /// This step's dense algorithm, looked up in the decision table for
    /// the step's dense group ([`crate::cost::Tuning::dense_allreduce`]:
    /// `auto`'s choice from the group's bytes, the communicator's size and
    /// the node map, alike on every rank; or the forced one). A change of
    /// `auto`'s choice is logged.
    pub(super) fn resolve_allreduce(&mut self) {
        let bytes = 4.0 * self.plan.dense.elems as f64;
        let d = self.tuning.dense_allreduce(bytes);
        let algo = d.pick;
        if self.cfg.allreduce.is_auto()
            && self.tuner.chose(Choice::Allreduce(algo))
            && d.fallback.is_none()
        {
            log::info!(
                "gradsync: step {}: allreduce auto chose {} for {} dense bytes: {}",
                self.step,
                algo.name(),
                bytes,
                d.describe()
            );
        }
        self.plan.allreduce = algo;
        self.plan.factor_allreduce = self.tuning.factor_allreduce(algo);
    }

    /// This step's allgatherv of the fused message, looked up in the
    /// decision table ([`crate::cost::Tuning::allgatherv`]) for the
    /// message's nominal size ([`fused_bytes`](Self::fused_bytes)): `auto`'s
    /// cheaper of the flat and the node-aware one (recursive doubling
    /// without a profile), or the forced one. A change of `auto`'s choice
    /// is logged.
    pub(super) fn resolve_allgather(&mut self) {
        self.plan.reduce_allgather = self.tuning.reduce_allgatherv();
        if !self.plan.gather {
            self.plan.allgather = self.plan.reduce_allgather;
            return;
        }
        // Forced, or `auto` without a profile: nothing to size or price.
        if let Some(algo) = self.tuning.allgatherv_unpriced() {
            self.plan.allgather = algo;
            return;
        }
        let bytes = self.fused_bytes();
        let d = self.tuning.allgatherv(bytes);
        let algo = d.pick;
        if self.tuner.chose(Choice::Allgather(algo)) && d.fallback.is_none() {
            log::info!(
                "gradsync: step {}: allgather auto chose {} for {bytes} bytes a rank: {}",
                self.step,
                algo.name(),
                d.describe()
            );
        }
        self.plan.allgather = algo;
    }

    /// The fused message's nominal bytes per rank this step: each fused
    /// layer's codec at this step's density (the sizes the step model
    /// prices; a data-dependent codec at the profile's measured bytes per
    /// element, else its nominal ones), with the header and the table of
    /// contents.
    pub(super) fn fused_bytes(&self) -> f64 {
        let mut bytes = crate::sparse::FUSED_HEADER_LEN as f64;
        for &id in &self.plan.sparse.ids {
            let i = id as usize;
            let n = self.reg.table[i].n;
            let unit = self.reg.layers[i].codec.as_deref().map_or(0.0, |c| {
                let config = match self.plan.layers[i].density {
                    Some(d) => c.config().with_density(d.clamp(1e-12, 1.0)),
                    None => c.config(),
                };
                config
                    .wire_bytes(n)
                    .unwrap_or_else(|| match &self.cfg.profile {
                        Some(prof) => crate::cost::nominal_wire_bytes(prof, &config.name(), n),
                        None => 0.0,
                    })
            });
            bytes += unit + TOC_ENTRY_LEN as f64;
        }
        bytes
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
