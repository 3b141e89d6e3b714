//! The engine's adaptive state behind one type, in the shape of quinn's
//! `congestion::Controller`: what the per-step `auto` choices learn from
//! the steps done. The engine asks it (the fill estimate the cost model
//! prices the sparse allreduces with, the reduced group's load of the open
//! step), tells it a step is done ([`Tuner::on_step_done`]) and forgets it
//! on a restore ([`Tuner::reset`]); the choices themselves are the cost
//! model's (`crate::cost`), made from the same inputs on every rank.
//!
//! What it learns is alike on every rank by construction: the fill comes
//! from the step's distinct result indices (the reducing exchange's, or
//! the nonzero elements the allgatherv's unpacking counted, the same bytes
//! added in the same order everywhere) and the step's nominal load, never
//! from a rank's own timings. See `exchange.rs` for the estimate's rule.

use super::{SparseExchange, StepStats};
use crate::dense::{AllgathervAlgo, AllreduceAlgo};

/// The reduced group's load in a step: elements, nominal pairs per rank,
/// bytes it would add to the fused allgatherv message.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Load {
    pub(super) n: usize,
    pub(super) k: f64,
    pub(super) message_bytes: f64,
    /// Each layer's elements and message bytes
    /// ([`crate::cost::ExchangeQuery::layers`]).
    pub(super) layers: Vec<(usize, f64)>,
    /// The group's layers, in registration order (only with `auto`: the
    /// layers whose result measures the fill when the allgatherv runs).
    pub(super) ids: Vec<u32>,
}

/// Weight of a new measurement in the fill estimate.
const FILL_WEIGHT: f64 = 0.5;

/// The engine's adaptive state (module docs).
#[derive(Debug, Default)]
pub(super) struct Tuner {
    /// The fill ratio of the sparse allreduces, estimated from the
    /// previous steps' results; `None` before any measurement.
    fill: Option<f64>,
    /// The open (or last) step's reduced group's nominal load.
    pub(super) load: Load,
    /// The last choices of `sparse_exchange`, `allreduce` and `allgather =
    /// "auto"` (a change is logged).
    exchange: Option<SparseExchange>,
    allreduce: Option<AllreduceAlgo>,
    allgather: Option<AllgathervAlgo>,
}

/// Which `auto` choice [`Tuner::chose`] records.
pub(super) enum Choice {
    Exchange(SparseExchange),
    Allreduce(AllreduceAlgo),
    Allgather(AllgathervAlgo),
}

impl Tuner {
    /// The fill estimate (`None`: the cost model assumes independent
    /// selections).
    pub(super) fn fill(&self) -> Option<f64> {
        self.fill
    }

    /// Record this step's `auto` choice; true when it differs from the
    /// last one of its kind (the caller logs it).
    pub(super) fn chose(&mut self, c: Choice) -> bool {
        fn note<T: PartialEq>(last: &mut Option<T>, now: T) -> bool {
            let changed = last.as_ref() != Some(&now);
            *last = Some(now);
            changed
        }
        match c {
            Choice::Exchange(x) => note(&mut self.exchange, x),
            Choice::Allreduce(x) => note(&mut self.allreduce, x),
            Choice::Allgather(x) => note(&mut self.allgather, x),
        }
    }

    /// A step is done: fold its measured fill in (`exchange.rs`). `stats`
    /// is the step's record ([`StepStats::fill_sample`]: the distinct
    /// result indices of its reduced group, `None` when it measured
    /// nothing); `p` the ranks.
    pub(super) fn on_step_done(&mut self, stats: &StepStats, p: usize) {
        let k = self.load.k;
        let Some(nnz) = stats.fill_sample.filter(|&z| z > 0 && k > 0.0) else {
            return;
        };
        let p = p as f64;
        let rho = (nnz as f64 / (p * k)).clamp(1.0 / p, 1.0);
        self.fill = Some(match self.fill {
            None => rho,
            Some(old) => (1.0 - FILL_WEIGHT) * old + FILL_WEIGHT * rho,
        });
    }

    /// Forget what was learnt (a restore: snapshots do not hold it, and a
    /// restored run starts as a fresh engine does).
    pub(super) fn reset(&mut self) {
        self.fill = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(sample: Option<usize>) -> StepStats {
        StepStats {
            fill_sample: sample,
            ..StepStats::default()
        }
    }

    #[test]
    fn the_fill_is_a_moving_average_of_the_clamped_samples() {
        let mut t = Tuner::default();
        t.load.k = 100.0;
        assert_eq!(t.fill(), None);
        t.on_step_done(&done(None), 4);
        assert_eq!(t.fill(), None, "nothing measured");
        t.on_step_done(&done(Some(0)), 4);
        assert_eq!(t.fill(), None, "an empty result measures nothing");
        t.on_step_done(&done(Some(200)), 4); // 200 / 400
        assert_eq!(t.fill(), Some(0.5));
        t.on_step_done(&done(Some(4000)), 4); // clamped to 1
        assert_eq!(t.fill(), Some(0.75));
        t.on_step_done(&done(Some(1)), 4); // clamped to 1/p
        assert_eq!(t.fill(), Some(0.5));
        t.reset();
        assert_eq!(t.fill(), None);
        t.load.k = 0.0;
        t.on_step_done(&done(Some(10)), 4);
        assert_eq!(t.fill(), None, "no pairs this step");
    }

    #[test]
    fn a_choice_is_news_only_when_it_changes() {
        let mut t = Tuner::default();
        assert!(t.chose(Choice::Allreduce(AllreduceAlgo::Ring)));
        assert!(!t.chose(Choice::Allreduce(AllreduceAlgo::Ring)));
        assert!(t.chose(Choice::Allreduce(AllreduceAlgo::Rabenseifner)));
        assert!(t.chose(Choice::Exchange(SparseExchange::Allgather)));
        assert!(!t.chose(Choice::Exchange(SparseExchange::Allgather)));
        assert!(t.chose(Choice::Allgather(AllgathervAlgo::Node)));
    }
}
