//! The engine's decision table, in the shape of NCCL's `graph/tuning.cc`:
//! built once per engine from the agreed profile, the ranks and the node
//! map, with the user's forced choices applied as masks, and asked by the
//! engine for each step's collectives. The engine looks choices up here
//! and never compares prices or applies a rule of its own:
//!
//! | decision | candidates under `auto` | forced (`Pick::Fixed`) |
//! |---|---|---|
//! | the dense group's allreduce | Rabenseifner, the ring, the hierarchical allreduce (several nodes) | that algorithm |
//! | the fused message's allgatherv | recursive doubling/Bruck's, the node-aware one (several nodes, several ranks on one); recursive doubling without a profile | that algorithm |
//! | the reduced pairs' exchange | the fused allgatherv, the sparse allreduce, the node-aware one (several nodes); the allgatherv alone past `u32::MAX` elements (the sparse allreduces' `u32` indices) | that exchange |
//! | the sparse allreduces' own allgatherv | recursive doubling | that algorithm |
//!
//! Each decision is priced by the cost model's group prices
//! ([`super::choose_dense_allreduce`], [`super::choose_allgatherv`],
//! [`super::choose_sparse_exchange`]; their one argmin and near-tie rule is
//! `cost::argmin`) once for each input it sees: a row stays priced
//! while the step's input is the one it was priced for (the dense group's
//! bytes, the fused message's bytes, the reduced group's load and the fill
//! estimate), so a table whose groups do not change is priced once. The
//! engine logs the table once at `debug`, after the lookups of its first
//! step that communicates without a dense warm-up ([`Tuning::log_once`]).
//! A model error (the same on every rank: every input is) falls back to
//! the simplest candidate with a warning naming it. A forced
//! choice that cannot run in this job (a node-aware collective without a
//! node map) is refused by [`Tuning::new`], naming why.

pub mod policy;

use super::{ExchangeQuery, Profile, StrategyId};
use crate::dense::{AllgathervAlgo, AllreduceAlgo};
use crate::strategy::{Pick, SparseExchange};
use crate::{Error, Result};
pub use policy::LayerPolicy;

/// The user's forced choices (`Pick::Fixed`) and the ones left to the
/// table (`Pick::Auto`): `sync::Config::allreduce`, `allgather` and
/// `sparse_exchange`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Masks {
    /// The dense group's allreduce.
    pub allreduce: Pick<AllreduceAlgo>,
    /// The fused message's allgatherv.
    pub allgather: Pick<AllgathervAlgo>,
    /// The reduced pairs' exchange.
    pub exchange: Pick<SparseExchange>,
}

/// One looked-up decision: what runs, and what it was chosen among.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision<T> {
    /// What runs.
    pub pick: T,
    /// The candidates' predicted seconds, in the table's order (empty when
    /// forced, or chosen without pricing).
    pub prices: Vec<(&'static str, f64)>,
    /// Why the table fell back to the simplest candidate (a model error),
    /// `None` otherwise.
    pub fallback: Option<String>,
}

impl<T: Copy> Decision<T> {
    fn unpriced(pick: T) -> Self {
        Decision {
            pick,
            prices: Vec::new(),
            fallback: None,
        }
    }

    /// `name 1.2 us, ...` of the prices.
    pub fn describe(&self) -> String {
        self.prices
            .iter()
            .map(|(name, s)| format!("{name} {:.1} us", s * 1e6))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The reduced group's load in a step, the input of the exchange's row:
/// elements, nominal pairs per rank, the bytes it would add to the fused
/// message, and each layer's elements and bytes
/// ([`ExchangeQuery::layers`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExchangeLoad {
    /// Elements of the group's concatenated index space.
    pub n: usize,
    /// Nominal pairs per rank.
    pub k: f64,
    /// Bytes the group would add to the fused message.
    pub message_bytes: f64,
    /// Each layer's elements and message bytes.
    pub layers: Vec<(usize, f64)>,
}

/// A priced row: the input it was priced for and the decision.
#[derive(Clone, Debug)]
struct Row<K, T> {
    input: K,
    decision: Decision<T>,
}

/// The engine's decision table ([module docs](self)).
#[derive(Clone, Debug)]
pub struct Tuning {
    prof: Option<Profile>,
    p: usize,
    ranks_per_node: Option<usize>,
    masks: Masks,
    /// The options' per-layer choices ([`policy`]).
    policy: LayerPolicy,
    dense: Option<Row<u64, AllreduceAlgo>>,
    gather: Option<Row<u64, AllgathervAlgo>>,
    exchange: Option<Row<(ExchangeLoad, Option<u64>), SparseExchange>>,
    logged: bool,
}

impl Tuning {
    /// The table of an engine on `p` ranks: `ranks_per_node` when the job
    /// spans several nodes (`None`: one node, or the nodes unknown),
    /// `has_nodes` whether the transport knows the ranks' nodes. Refuses a
    /// forced node-aware collective without a node map. Without a profile
    /// every `auto` row is its simplest candidate, unpriced (the engine's
    /// options refuse `auto` of the dense allreduce and of the exchange
    /// without one, `sync::Config::check`).
    pub fn new(
        prof: Option<&Profile>,
        p: usize,
        ranks_per_node: Option<usize>,
        has_nodes: bool,
        masks: Masks,
    ) -> Result<Tuning> {
        if !has_nodes && masks.allgather.is(AllgathervAlgo::Node) {
            return Err(Error::Unsupported(
                "allgather \"node\" needs the ranks' nodes (an MPI communicator); \
                 this transport has none"
                    .into(),
            ));
        }
        if !has_nodes && masks.allreduce.is(AllreduceAlgo::Hierarchical) {
            return Err(Error::Unsupported(
                "allreduce \"hierarchical\" needs the ranks' nodes (an MPI communicator); \
                 this transport has none"
                    .into(),
            ));
        }
        if !has_nodes && masks.exchange.is(SparseExchange::Hierarchical) {
            return Err(Error::Unsupported(
                "sparse_exchange \"hierarchical\" needs the ranks' nodes \
                 (an MPI communicator); this transport has none"
                    .into(),
            ));
        }
        Ok(Tuning {
            prof: prof.cloned(),
            p,
            ranks_per_node,
            masks,
            policy: LayerPolicy::default(),
            dense: None,
            gather: None,
            exchange: None,
            logged: false,
        })
    }

    /// The masks the table was built with.
    pub fn masks(&self) -> Masks {
        self.masks
    }

    /// The dense group's allreduce for `bytes` per rank.
    pub fn dense_allreduce(&mut self, bytes: f64) -> &Decision<AllreduceAlgo> {
        let key = bytes.to_bits();
        if stale(&self.dense, &key) {
            self.dense = Some(Row::new(key, self.price_dense(bytes)));
        }
        priced(&self.dense)
    }

    fn price_dense(&self, bytes: f64) -> Decision<AllreduceAlgo> {
        let prof = match to_price(
            self.masks.allreduce,
            &self.prof,
            AllreduceAlgo::Rabenseifner,
        ) {
            Ok(prof) => prof,
            Err(d) => return d,
        };
        match super::choose_dense_allreduce(prof, bytes, &self.placement(None)) {
            Ok(c) => Decision {
                pick: match c.pick {
                    StrategyId::DenseRing => AllreduceAlgo::Ring,
                    StrategyId::DenseHierarchical => AllreduceAlgo::Hierarchical,
                    _ => AllreduceAlgo::Rabenseifner,
                },
                prices: c
                    .predictions
                    .iter()
                    .map(|(id, s)| (id.name(), *s))
                    .collect(),
                fallback: None,
            },
            Err(e) => fallen_back(AllreduceAlgo::Rabenseifner, "allreduce", e),
        }
    }

    /// The cost model's id of the dense group's algorithm for `bytes` per
    /// rank (how the step model prices the layers fixed dense; priced
    /// afresh, the row left as it is). A model error is an error here: a
    /// plan is not made from a fallback.
    pub fn dense_id(&self, bytes: f64) -> Result<StrategyId> {
        let d = self.price_dense(bytes);
        if let Some(why) = d.fallback {
            return Err(Error::InvalidArgument(why));
        }
        Ok(match d.pick {
            AllreduceAlgo::Ring => StrategyId::DenseRing,
            AllreduceAlgo::Hierarchical => StrategyId::DenseHierarchical,
            AllreduceAlgo::Rabenseifner | AllreduceAlgo::Mpi => StrategyId::DenseRabenseifner,
        })
    }

    /// The fused message's allgatherv for `bytes` per rank.
    pub fn allgatherv(&mut self, bytes: f64) -> &Decision<AllgathervAlgo> {
        let key = bytes.to_bits();
        if stale(&self.gather, &key) {
            self.gather = Some(Row::new(key, self.price_gather(bytes)));
        }
        priced(&self.gather)
    }

    fn price_gather(&self, bytes: f64) -> Decision<AllgathervAlgo> {
        let prof = match to_price(
            self.masks.allgather,
            &self.prof,
            AllgathervAlgo::RecursiveDoubling,
        ) {
            Ok(prof) => prof,
            Err(d) => return d,
        };
        match super::choose_allgatherv(prof, bytes, &self.placement(None)) {
            Ok(c) => Decision {
                pick: c.pick,
                prices: c.predictions.iter().map(|(a, s)| (a.name(), *s)).collect(),
                fallback: None,
            },
            Err(e) => fallen_back(AllgathervAlgo::RecursiveDoubling, "allgather", e),
        }
    }

    /// The fused message's allgatherv when it needs no pricing (forced, or
    /// `auto` without a profile), so that the caller need not size the
    /// message; `None` when [`allgatherv`](Self::allgatherv) prices it.
    pub fn allgatherv_unpriced(&self) -> Option<AllgathervAlgo> {
        to_price(
            self.masks.allgather,
            &self.prof,
            AllgathervAlgo::RecursiveDoubling,
        )
        .err()
        .map(|d| d.pick)
    }

    /// The allgatherv inside the sparse allreduces: the forced one, else
    /// the flat one (`auto` chooses for the fused message's size only).
    pub fn reduce_allgatherv(&self) -> AllgathervAlgo {
        self.masks
            .allgather
            .fixed()
            .unwrap_or(AllgathervAlgo::RecursiveDoubling)
    }

    /// The reduced group's exchange for `load` at the fill estimate `fill`
    /// (`None`: independent selections).
    pub fn exchange(
        &mut self,
        load: &ExchangeLoad,
        fill: Option<f64>,
    ) -> &Decision<SparseExchange> {
        let fill_bits = fill.map(f64::to_bits);
        let same =
            |r: &Row<(ExchangeLoad, Option<u64>), _>| r.input.0 == *load && r.input.1 == fill_bits;
        if !self.exchange.as_ref().is_some_and(same) {
            let decision = self.price_exchange(load, fill);
            self.exchange = Some(Row::new((load.clone(), fill_bits), decision));
        }
        priced(&self.exchange)
    }

    fn price_exchange(&self, load: &ExchangeLoad, fill: Option<f64>) -> Decision<SparseExchange> {
        let prof = match to_price(self.masks.exchange, &self.prof, SparseExchange::Allgather) {
            Ok(prof) => prof,
            Err(d) => return d,
        };
        let q = ExchangeQuery {
            at: self.placement(fill),
            n: load.n,
            k: load.k,
            message_bytes: load.message_bytes,
            layers: load.layers.clone(),
        };
        match super::choose_sparse_exchange(prof, &q) {
            Ok(c) => Decision {
                // Past u32 indices the cost model prices the allgatherv
                // alone (`choose_sparse_exchange`).
                pick: match c.pick {
                    StrategyId::SparseAllreduce => SparseExchange::Allreduce,
                    StrategyId::SparseHierarchical => SparseExchange::Hierarchical,
                    _ => SparseExchange::Allgather,
                },
                prices: c
                    .predictions
                    .iter()
                    .map(|(id, s)| (id.name(), *s))
                    .collect(),
                fallback: None,
            },
            Err(e) => fallen_back(SparseExchange::Allgather, "sparse exchange", e),
        }
    }

    /// The table as priced so far, one line: the placement, each row's
    /// mask and, for `auto`, its pick among the candidates' prices at the
    /// input it was last priced for.
    pub fn describe(&self) -> String {
        let place = match self.ranks_per_node {
            Some(l) => format!("{} ranks, {l} per node", self.p),
            None => format!("{} ranks, one node", self.p),
        };
        let row = |what: &str, mask: String, line: Option<String>| match line {
            Some(line) => format!("{what}: {line}"),
            None => format!("{what}: {mask}, not asked yet"),
        };
        let dense = self.dense.as_ref().map(|r| {
            let bytes = f64::from_bits(r.input);
            format!(
                "{} for {bytes} bytes",
                row_line(self.masks.allreduce, &r.decision)
            )
        });
        let gather = self.gather.as_ref().map(|r| {
            let bytes = f64::from_bits(r.input);
            format!(
                "{} for {bytes} bytes",
                row_line(self.masks.allgather, &r.decision)
            )
        });
        let exchange = self.exchange.as_ref().map(|r| {
            format!(
                "{} for {} elements, {} pairs a rank",
                row_line(self.masks.exchange, &r.decision),
                r.input.0.n,
                r.input.0.k
            )
        });
        format!(
            "decision table ({place}, {}): {}; {}; {}; the sparse allreduces' allgatherv: {}; \
             PowerSGD's factors: {}; auto layers among {} (dense below {} elements, \
             but for PowerSGD)",
            if self.prof.is_some() {
                "profiled"
            } else {
                "no profile"
            },
            row("allreduce", self.masks.allreduce.to_string(), dense),
            row("allgatherv", self.masks.allgather.to_string(), gather),
            row("exchange", self.masks.exchange.to_string(), exchange),
            self.reduce_allgatherv(),
            match self.masks.allreduce {
                Pick::Fixed(AllreduceAlgo::Mpi) => format!(
                    "{} (MPI_Allreduce does not promise every rank the same bits)",
                    self.factor_allreduce(AllreduceAlgo::Mpi)
                ),
                _ => "the dense allreduce's".to_string(),
            },
            self.candidates()
                .iter()
                .map(|id| id.name())
                .collect::<Vec<_>>()
                .join(", "),
            self.policy.min_sparse_elems
        )
    }

    /// Log the table ([`describe`](Self::describe)) at `debug`, the first
    /// time only: the engine calls it after the lookups of its first step
    /// that communicates without a dense warm-up.
    pub fn log_once(&mut self) {
        if !self.logged {
            self.logged = true;
            log::debug!("gradsync: {}", self.describe());
        }
    }
}

/// Whether a step's local phase (or its unpacking) runs its `layers`
/// layers of `elems` sparse elements in all on rayon's threads: across two
/// or more layers only (one layer gains nothing, and idle rayon workers
/// spinning next to MPI's polling cost more than they bring on a few
/// cores), from `min_elems` elements (`sync::Config::parallel_min_elems`),
/// and only where it pays ([`Profile::parallel_speedup`]): a profile whose
/// calibration measured no clear gain over one layer after another
/// (every core already busy with a rank) keeps it serial.
pub fn layers_in_parallel(
    prof: Option<&Profile>,
    min_elems: usize,
    layers: usize,
    elems: usize,
) -> bool {
    let pays = prof.is_none_or(|p| p.parallel_speedup().is_some());
    pays && layers >= 2 && elems >= min_elems
}

/// A row as the table's log prints it: forced, or the pick among prices.
fn row_line<T: Copy + std::fmt::Display>(mask: Pick<T>, d: &Decision<T>) -> String {
    match mask {
        Pick::Fixed(t) => format!("{t} (forced)"),
        Pick::Auto if d.prices.is_empty() => format!("{} (auto, unpriced)", d.pick),
        Pick::Auto => format!("{} (auto: {})", d.pick, d.describe()),
    }
}

impl<K, T> Row<K, T> {
    fn new(input: K, decision: Decision<T>) -> Self {
        Row { input, decision }
    }
}

/// Whether `row` is missing or was priced for another input than `key`.
fn stale<K: PartialEq, T>(row: &Option<Row<K, T>>, key: &K) -> bool {
    row.as_ref().is_none_or(|r| r.input != *key)
}

/// The decision of a row just priced.
fn priced<K, T>(row: &Option<Row<K, T>>) -> &Decision<T> {
    &row.as_ref().expect("priced by the caller").decision
}

/// The profile a row is priced with, or the decision without pricing: the
/// forced choice, or under `auto` without a profile the `simplest`.
fn to_price<T: Copy>(
    mask: Pick<T>,
    prof: &Option<Profile>,
    simplest: T,
) -> std::result::Result<&Profile, Decision<T>> {
    match (mask, prof) {
        (Pick::Fixed(t), _) => Err(Decision::unpriced(t)),
        (Pick::Auto, Some(prof)) => Ok(prof),
        (Pick::Auto, None) => Err(Decision::unpriced(simplest)),
    }
}

/// The simplest candidate, with a warning naming the model's error.
fn fallen_back<T: Copy + std::fmt::Display>(pick: T, what: &str, e: Error) -> Decision<T> {
    log::warn!("gradsync: {what} auto: {e}; using {pick}");
    Decision {
        pick,
        prices: Vec::new(),
        fallback: Some(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{NetLevel, Profile};

    /// Shared memory inside a node, a slower network between nodes.
    fn prof() -> Profile {
        let mut prof = Profile::from_network(1e-6, 5e9, 0.0, 0.0).unwrap();
        prof.inter_node = Some(NetLevel {
            alpha: 20e-6,
            beta: 8e-9,
            beta_curve: vec![],
            oneway_curve: vec![],
            burst: None,
        });
        prof
    }

    #[test]
    fn forced_choices_are_masks_and_auto_agrees_with_the_cost_model() {
        let pr = prof();
        let masks = Masks {
            allreduce: Pick::Fixed(AllreduceAlgo::Ring),
            allgather: Pick::Fixed(AllgathervAlgo::Mpi),
            exchange: Pick::Fixed(SparseExchange::Allreduce),
        };
        let mut t = Tuning::new(Some(&pr), 8, Some(2), true, masks).unwrap();
        assert_eq!(t.dense_allreduce(1e6).pick, AllreduceAlgo::Ring);
        assert!(t.dense_allreduce(1e6).prices.is_empty());
        assert_eq!(t.allgatherv(1e3).pick, AllgathervAlgo::Mpi);
        assert_eq!(t.reduce_allgatherv(), AllgathervAlgo::Mpi);
        let load = ExchangeLoad {
            n: 1 << 20,
            k: 1000.0,
            message_bytes: 8000.0,
            layers: vec![],
        };
        assert_eq!(t.exchange(&load, None).pick, SparseExchange::Allreduce);

        let mut a = Tuning::new(Some(&pr), 8, Some(2), true, Masks::default()).unwrap();
        for bytes in [4.0, 4e3, 4e6, 4e8] {
            let want = crate::cost::choose_dense_allreduce(
                &pr,
                bytes,
                &crate::cost::Placement::on(8, Some(2)),
            )
            .unwrap();
            let d = a.dense_allreduce(bytes).clone();
            assert_eq!(d.prices.len(), want.predictions.len());
            assert_eq!(a.dense_id(bytes).unwrap(), want.pick);
            let g =
                crate::cost::choose_allgatherv(&pr, bytes, &crate::cost::Placement::on(8, Some(2)))
                    .unwrap();
            assert_eq!(a.allgatherv(bytes).pick, g.pick);
        }
        assert_eq!(a.reduce_allgatherv(), AllgathervAlgo::RecursiveDoubling);
    }

    #[test]
    fn a_row_is_priced_again_only_when_its_input_changes() {
        let pr = prof();
        let mut t = Tuning::new(Some(&pr), 4, None, false, Masks::default()).unwrap();
        let load = ExchangeLoad {
            n: 1 << 20,
            k: 1049.0,
            message_bytes: 9000.0,
            layers: vec![(1 << 20, 9000.0)],
        };
        let first = t.exchange(&load, None).clone();
        assert_eq!(first.prices.len(), 2, "no node-aware exchange on one node");
        // The same input: the row as priced.
        assert_eq!(*t.exchange(&load, None), first);
        // Another fill: priced for it, as the cost model prices it.
        let q = |fill| ExchangeQuery {
            at: crate::cost::Placement {
                p: 4,
                ranks_per_node: None,
                fill,
                allgather: Pick::Auto,
            },
            n: load.n,
            k: load.k,
            message_bytes: load.message_bytes,
            layers: load.layers.clone(),
        };
        let want = crate::cost::choose_sparse_exchange(&pr, &q(Some(0.25))).unwrap();
        let got = t.exchange(&load, Some(0.25)).clone();
        assert_eq!(got.prices[1].1, want.predictions[1].1);
        let line = t.describe();
        assert!(
            line.contains("4 ranks, one node") && line.contains("exchange: "),
            "{line}"
        );
        assert!(
            line.contains("allreduce: rabenseifner, not asked yet")
                || line.contains("allreduce: auto"),
            "{line}"
        );
        // Past u32 indices only the allgatherv runs.
        let huge = ExchangeLoad {
            n: u32::MAX as usize + 1,
            k: 1.0,
            message_bytes: 1e12,
            layers: vec![],
        };
        assert_eq!(t.exchange(&huge, None).pick, SparseExchange::Allgather);
    }

    #[test]
    fn what_cannot_run_is_refused_naming_why() {
        let pr = prof();
        let node = Masks {
            allgather: Pick::Fixed(AllgathervAlgo::Node),
            allreduce: Pick::Fixed(AllreduceAlgo::Rabenseifner),
            exchange: Pick::Fixed(SparseExchange::Allgather),
        };
        let e = Tuning::new(Some(&pr), 4, None, false, node).unwrap_err();
        assert!(
            e.to_string()
                .contains("allgather \"node\" needs the ranks' nodes"),
            "{e}"
        );
        let hier = Masks {
            exchange: Pick::Fixed(SparseExchange::Hierarchical),
            ..node
        };
        let hier = Masks {
            allgather: Pick::Auto,
            ..hier
        };
        let e = Tuning::new(Some(&pr), 4, None, false, hier).unwrap_err();
        assert!(
            e.to_string().contains("sparse_exchange \"hierarchical\""),
            "{e}"
        );
        // Without a profile, auto's allgatherv is recursive doubling.
        let plain = Masks {
            allreduce: Pick::Fixed(AllreduceAlgo::Rabenseifner),
            allgather: Pick::Auto,
            exchange: Pick::Fixed(SparseExchange::Allgather),
        };
        let mut t = Tuning::new(None, 4, None, false, plain).unwrap();
        assert_eq!(t.allgatherv(1e6).pick, AllgathervAlgo::RecursiveDoubling);
    }
}
