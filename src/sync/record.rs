//! A finished step's record: [`StepStats`] and its [`LayerStats`] filled
//! from the layers' records and the step's jobs (`record_stats`, called by
//! `wait` in `bucket.rs`).

use super::bucket::OpenStep;
use super::stats::{LayerStats, StepStats};
use super::GradSync;
use crate::comm::Transport;

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Fill [`last_stats`](GradSync::last_stats) from the layers' records and
    /// the step's job; `fill_sample` is what the step measured of the fill.
    pub(super) fn record_stats(&mut self, st: &OpenStep, wait_s: f64, fill_sample: Option<usize>) {
        let info = &st.info;
        // Sums over the step's buckets.
        let jobs = || st.parts.iter().filter_map(|p| p.job.as_deref());
        let sum = |f: fn(&super::job::Job) -> f64| jobs().map(f).sum::<f64>();
        let fused_bytes = st
            .parts
            .iter()
            .filter(|p| !p.plan.sparse.ids.is_empty())
            .filter_map(|p| p.job.as_deref())
            .map(|j| j.buf.fused.len())
            .sum();
        // Reuse the previous step's per-layer records (no allocation once
        // the names have been copied).
        let mut layer_stats = std::mem::take(&mut self.last.layers);
        let mut exchange = std::mem::take(&mut self.last.sparse_exchange);
        exchange.clear();
        exchange.push_str(self.plan.exchange.name());
        let mut allreduce = std::mem::take(&mut self.last.allreduce);
        allreduce.clear();
        if self.plan.reduce && self.plan.communicates {
            allreduce.push_str(self.plan.allreduce.name());
        }
        let mut allgather = std::mem::take(&mut self.last.allgather);
        allgather.clear();
        if self.plan.gather && self.plan.communicates {
            // `node` where the nodes make no second level runs the flat one.
            let flat = self.plan.allgather == crate::dense::AllgathervAlgo::Node
                && self.ranks_per_node().is_none_or(|l| l <= 1);
            allgather.push_str(if flat {
                crate::dense::AllgathervAlgo::RecursiveDoubling.name()
            } else {
                self.plan.allgather.name()
            });
        }
        layer_stats.resize_with(self.reg.layers.len(), LayerStats::default);
        for (d, l) in layer_stats.iter_mut().zip(&self.reg.layers) {
            d.clone_from(&l.stats);
        }
        self.last = StepStats {
            step: self.step,
            communicated: info.communicated,
            overlapped: info.overlapped,
            layers: layer_stats,
            buckets: st.parts.len(),
            fused_bytes,
            dense_bytes: 4 * jobs().map(|j| j.script.dense_len).sum::<usize>(),
            select_s: info.select_s,
            pack_s: info.pack_s,
            allgather_s: sum(|j| j.out.allgather_s),
            allreduce_s: sum(|j| j.out.allreduce_s),
            sparse_reduce_s: sum(|j| j.out.sparse_reduce_s),
            sparse_reduce_nnz: jobs().map(|j| j.out.sparse_reduce_nnz).sum(),
            sparse_exchange: exchange,
            fill_estimate: self.tuner.fill(),
            fill_sample,
            allreduce,
            allgather,
            gradiveq_s: sum(|j| j.out.gvq_s),
            powersgd_s: sum(|j| j.out.psg_s),
            unpack_s: self.reg.layers.iter().map(|l| l.stats.unpack_s).sum(),
            wait_s,
            device: None,
        };
    }
}
