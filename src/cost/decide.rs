//! The one decision table: typed strategy ids and the single [`choose`]
//! that every decision goes through: the engine's `Strategy::Auto`,
//! `gradsync predict`'s `choice`, `plan`, `calibrate --check` and
//! `model-check`. As in NCCL's tuning table and Open MPI's `coll/tuned`,
//! the algorithms never decide and this table never communicates.
//!
//! A strategy the engine cannot run from a prediction alone is never
//! chosen unless a caller names it: `gradiveq-ring` (its ratio depends on
//! the data; the engine runs GradiVeQ only when a layer asks for it) is
//! predicted and listed, but not picked by default.

use super::{Prediction, STRATEGIES};
use crate::codec::{CodecConfig, RgcMethod};
use crate::dense::AllreduceAlgo;
use crate::strategy::{Pick, SparseExchange, Strategy};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// A strategy of the cost model, typed (its [`name`](Self::name) is the
/// one `predict --json` prints).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StrategyId {
    /// Rabenseifner allreduce of the whole layer.
    #[default]
    #[serde(rename = "dense-rabenseifner")]
    DenseRabenseifner,
    /// Ring allreduce of the whole layer.
    #[serde(rename = "dense-ring")]
    DenseRing,
    /// RGC units in the fused allgather.
    #[serde(rename = "sparse-allgather")]
    SparseAllgather,
    /// Quantized RGC units in the fused allgather.
    #[serde(rename = "sparse-allgather-quant")]
    SparseAllgatherQuant,
    /// GradiVeQ's compressed-domain ring.
    #[serde(rename = "gradiveq-ring")]
    GradiveqRing,
    /// The node-aware allreduce of the whole layer
    /// ([`crate::dense::hierarchical_allreduce`]).
    #[serde(rename = "dense-hierarchical")]
    DenseHierarchical,
    /// RGC selection, exchanged by the O(k) sparse allreduce
    /// ([`crate::sparse::sparse_allreduce`], Ok-Topk's split and reduce).
    #[serde(rename = "sparse-allreduce")]
    SparseAllreduce,
    /// RGC selection, exchanged by the node-aware sparse allreduce (units
    /// merged per node, exchanged among nodes, broadcast in the node).
    #[serde(rename = "sparse-hierarchical")]
    SparseHierarchical,
    /// fp16 in the fused allgather.
    #[serde(rename = "fp16")]
    Fp16,
    /// int8 in the fused allgather.
    #[serde(rename = "int8")]
    Int8,
    /// QSGD in the fused allgather.
    #[serde(rename = "qsgd")]
    Qsgd,
    /// SBC in the fused allgather.
    #[serde(rename = "sbc")]
    Sbc,
    /// 3LC in the fused allgather.
    #[serde(rename = "3lc")]
    ThreeLc,
    /// FastSGD in the fused allgather.
    #[serde(rename = "fastsgd")]
    Fastsgd,
    /// PowerSGD: the layer's factors in the step's two fused factor
    /// allreduces (the dense group's algorithm), its products local.
    #[serde(rename = "powersgd")]
    Powersgd,
}

impl StrategyId {
    /// Every strategy, in [`STRATEGIES`] order.
    pub const ALL: [StrategyId; 15] = [
        StrategyId::DenseRabenseifner,
        StrategyId::DenseRing,
        StrategyId::SparseAllgather,
        StrategyId::SparseAllgatherQuant,
        StrategyId::GradiveqRing,
        StrategyId::DenseHierarchical,
        StrategyId::SparseAllreduce,
        StrategyId::SparseHierarchical,
        StrategyId::Fp16,
        StrategyId::Int8,
        StrategyId::Qsgd,
        StrategyId::Sbc,
        StrategyId::ThreeLc,
        StrategyId::Fastsgd,
        StrategyId::Powersgd,
    ];

    /// The name `predict --json` prints (`dense-rabenseifner`, ...), as
    /// serde writes it.
    pub const fn name(self) -> &'static str {
        use StrategyId::*;
        match self {
            DenseRabenseifner => "dense-rabenseifner",
            DenseRing => "dense-ring",
            SparseAllgather => "sparse-allgather",
            SparseAllgatherQuant => "sparse-allgather-quant",
            GradiveqRing => "gradiveq-ring",
            DenseHierarchical => "dense-hierarchical",
            SparseAllreduce => "sparse-allreduce",
            SparseHierarchical => "sparse-hierarchical",
            Fp16 => "fp16",
            Int8 => "int8",
            Qsgd => "qsgd",
            Sbc => "sbc",
            ThreeLc => "3lc",
            Fastsgd => "fastsgd",
            Powersgd => "powersgd",
        }
    }

    /// Whether the engine can run this strategy from a prediction alone
    /// (everything but `gradiveq-ring`).
    pub fn engine_runs(self) -> bool {
        self != StrategyId::GradiveqRing
    }

    /// Whether the layer joins the fused dense allreduce.
    pub fn is_dense(self) -> bool {
        use StrategyId::*;
        matches!(self, DenseRabenseifner | DenseRing | DenseHierarchical)
    }

    /// The collective of the sparse group a layer with this strategy
    /// joins: the fused allgatherv (RGC, quantized RGC, the codecs), the
    /// sparse allreduce or the node-aware one; `None` for dense and
    /// GradiVeQ layers.
    pub fn sparse_group(self) -> Option<StrategyId> {
        use StrategyId::*;
        match self {
            DenseRabenseifner | DenseRing | DenseHierarchical | GradiveqRing | Powersgd => None,
            SparseAllreduce | SparseHierarchical => Some(self),
            _ => Some(SparseAllgather),
        }
    }

    /// Whether this is one of the codecs (`fp16` … `fastsgd`) rather than
    /// a named collective strategy.
    pub fn is_codec(self) -> bool {
        use StrategyId::*;
        matches!(self, Fp16 | Int8 | Qsgd | Sbc | ThreeLc | Fastsgd)
    }

    /// The engine's [`Strategy`] for this id (`density` and `method` for
    /// the selection codecs), or `None` where the engine cannot run it from
    /// a prediction ([`engine_runs`](Self::engine_runs)). The dense
    /// algorithms are the engine's `Dense` layer and the sparse allreduces
    /// its RGC layer: which collective their group runs is the plan's
    /// group algorithm ([`super::GroupPlan::algorithm`]).
    pub fn engine_strategy(self, density: f64, method: RgcMethod) -> Option<Strategy> {
        let sparse = |codec: CodecConfig| {
            Some(Strategy::Sparse {
                codec,
                density: None,
            })
        };
        match self {
            StrategyId::DenseRabenseifner
            | StrategyId::DenseRing
            | StrategyId::DenseHierarchical => Some(Strategy::Dense),
            StrategyId::SparseAllgather
            | StrategyId::SparseAllreduce
            | StrategyId::SparseHierarchical => sparse(CodecConfig::Rgc { density, method }),
            StrategyId::SparseAllgatherQuant => sparse(CodecConfig::RgcQuant { density }),
            StrategyId::GradiveqRing => None,
            // The rank is the caller's (the engine's `auto_powersgd`);
            // compression from the first step after any warm-up.
            StrategyId::Powersgd => Some(Strategy::Powersgd(crate::powersgd::PowerSgdConfig {
                start: 0,
                ..Default::default()
            })),
            codec => sparse(codec.name().parse().ok()?),
        }
    }
}

impl std::str::FromStr for StrategyId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        StrategyId::ALL
            .into_iter()
            .find(|id| id.name() == s.trim())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown strategy {s:?} (known: {})",
                    STRATEGIES.join(", ")
                ))
            })
    }
}

impl std::fmt::Display for StrategyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the engine's `Strategy::Auto` chooses among: the dense allreduce
/// the engine is configured with (its fused dense group runs one
/// algorithm; with `auto`, chosen every step
/// ([`super::choose_dense_allreduce`]), all three), RGC exchanged by its
/// configured sparse collective (`sparse_exchange`: the fused allgatherv,
/// the sparse allreduce or the node-aware one; with `auto`, which picks one
/// of them every step ([`super::choose_sparse_exchange`]), all three), and
/// quantized RGC when `quant` with the allgatherv (or `auto`). Without
/// `several_nodes` (the job has one node, or its nodes are unknown) the
/// `auto`s never run a node-aware collective, so neither is a candidate
/// through them.
pub fn engine_candidates(
    allreduce: Pick<AllreduceAlgo>,
    exchange: Pick<SparseExchange>,
    quant: bool,
    several_nodes: bool,
) -> Vec<StrategyId> {
    let dense: &[StrategyId] = match allreduce {
        Pick::Fixed(AllreduceAlgo::Ring) => &[StrategyId::DenseRing],
        Pick::Fixed(AllreduceAlgo::Hierarchical) => &[StrategyId::DenseHierarchical],
        Pick::Auto => &[
            StrategyId::DenseRabenseifner,
            StrategyId::DenseRing,
            StrategyId::DenseHierarchical,
        ],
        _ => &[StrategyId::DenseRabenseifner],
    };
    let sparse: &[StrategyId] = match exchange {
        Pick::Fixed(SparseExchange::Allgather) => &[StrategyId::SparseAllgather],
        Pick::Fixed(SparseExchange::Allreduce) => &[StrategyId::SparseAllreduce],
        Pick::Fixed(SparseExchange::Hierarchical) => &[StrategyId::SparseHierarchical],
        Pick::Auto => &[
            StrategyId::SparseAllgather,
            StrategyId::SparseAllreduce,
            StrategyId::SparseHierarchical,
        ],
    };
    let mut v = dense.to_vec();
    v.extend_from_slice(sparse);
    if quant
        && matches!(
            exchange,
            Pick::Fixed(SparseExchange::Allgather) | Pick::Auto
        )
    {
        v.push(StrategyId::SparseAllgatherQuant);
    }
    if !several_nodes {
        if allreduce.is_auto() {
            v.retain(|&id| id != StrategyId::DenseHierarchical);
        }
        if exchange.is_auto() {
            v.retain(|&id| id != StrategyId::SparseHierarchical);
        }
    }
    v
}

/// What a choice is made among when the caller names nothing: every
/// strategy the engine runs ([`StrategyId::engine_runs`]), the codecs
/// (`fp16` … `fastsgd`) only where `prof` has measured them (a codec
/// without an encode/decode fit would be predicted free and always win).
pub fn default_candidates(prof: &super::Profile) -> Vec<StrategyId> {
    StrategyId::ALL
        .into_iter()
        .filter(|id| id.engine_runs())
        .filter(|id| !id.is_codec() || prof.codecs.contains_key(id.name()))
        .filter(|&id| id != StrategyId::Powersgd || !prof.powersgd.is_zero())
        .collect()
}

/// The fastest prediction among `allowed` (when empty: every strategy the
/// engine runs, [`StrategyId::engine_runs`]). The one decision every
/// caller makes.
pub fn choose<'a>(preds: &'a [Prediction], allowed: &[StrategyId]) -> Option<&'a Prediction> {
    let allowed = preds.iter().filter(|p| {
        if allowed.is_empty() {
            p.id.engine_runs()
        } else {
            allowed.contains(&p.id)
        }
    });
    super::argmin::fastest(allowed, |p| p.seconds)
}

/// Parse a comma-separated list of strategy names (empty: none).
pub fn parse_list(s: &str) -> Result<Vec<StrategyId>> {
    split_list(s)?.into_iter().map(str::parse).collect()
}

/// The trimmed items of a comma-separated list: none for an empty or blank
/// string, one trailing comma allowed, an empty item elsewhere (`a,,b`,
/// `,a`) an error.
pub(crate) fn split_list(s: &str) -> Result<Vec<&str>> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut items: Vec<&str> = s.split(',').map(str::trim).collect();
    if items.len() > 1 && items.last() == Some(&"") {
        items.pop();
    }
    if items.iter().any(|x| x.is_empty()) {
        return Err(Error::InvalidArgument(format!(
            "an empty item in the list {s:?}"
        )));
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_agree() {
        for (id, name) in StrategyId::ALL.into_iter().zip(STRATEGIES) {
            assert_eq!(id.name(), name);
            assert_eq!(name.parse::<StrategyId>().unwrap(), id);
            assert_eq!(serde_json::to_value(id).unwrap(), name);
        }
        assert!("nope".parse::<StrategyId>().is_err());
        // Every codec strategy maps to a codec the engine runs.
        for id in StrategyId::ALL {
            assert_eq!(
                id.engine_strategy(0.01, RgcMethod::Trimmed).is_some(),
                id.engine_runs(),
                "{id}"
            );
        }
    }

    #[test]
    fn engine_candidates_follow_the_engine_collectives() {
        use StrategyId::*;
        let c = |a, e, q| engine_candidates(a, e, q, true);
        let (a, e) = (Pick::Fixed, Pick::Fixed);
        assert_eq!(
            c(
                a(AllreduceAlgo::Rabenseifner),
                e(SparseExchange::Allgather),
                true
            ),
            vec![DenseRabenseifner, SparseAllgather, SparseAllgatherQuant]
        );
        assert_eq!(
            c(
                a(AllreduceAlgo::Hierarchical),
                e(SparseExchange::Hierarchical),
                true
            ),
            vec![DenseHierarchical, SparseHierarchical]
        );
        assert_eq!(
            c(a(AllreduceAlgo::Ring), e(SparseExchange::Allreduce), false),
            vec![DenseRing, SparseAllreduce]
        );
        assert_eq!(
            c(a(AllreduceAlgo::Rabenseifner), Pick::Auto, true),
            vec![
                DenseRabenseifner,
                SparseAllgather,
                SparseAllreduce,
                SparseHierarchical,
                SparseAllgatherQuant
            ]
        );
        // One node: the autos' node-aware collectives are not candidates.
        assert_eq!(
            engine_candidates(Pick::Auto, Pick::Auto, false, false),
            vec![
                DenseRabenseifner,
                DenseRing,
                SparseAllgather,
                SparseAllreduce
            ]
        );
        assert_eq!(
            c(Pick::Auto, e(SparseExchange::Allgather), false),
            vec![
                DenseRabenseifner,
                DenseRing,
                DenseHierarchical,
                SparseAllgather
            ]
        );
        // Every candidate is an engine strategy; the sparse ones are RGC.
        for id in [SparseAllreduce, SparseHierarchical] {
            assert!(matches!(
                id.engine_strategy(0.01, RgcMethod::Trimmed),
                Some(Strategy::Sparse {
                    codec: CodecConfig::Rgc { .. },
                    ..
                })
            ));
            assert_eq!(id.sparse_group(), Some(id));
        }
        assert_eq!(Fp16.sparse_group(), Some(SparseAllgather));
        assert!(DenseHierarchical.is_dense() && DenseHierarchical.sparse_group().is_none());
    }

    #[test]
    fn choose_never_picks_what_the_engine_cannot_run_unless_asked() {
        let p = |id: StrategyId, s: f64| Prediction {
            id,
            name: id.name().into(),
            seconds: s,
            wire_bytes: 0.0,
        };
        let preds = [
            p(StrategyId::DenseRabenseifner, 3.0),
            p(StrategyId::GradiveqRing, 1.0),
            p(StrategyId::Sbc, 2.0),
        ];
        assert_eq!(choose(&preds, &[]).unwrap().id, StrategyId::Sbc);
        assert_eq!(
            choose(
                &preds,
                &[StrategyId::GradiveqRing, StrategyId::DenseRabenseifner]
            )
            .unwrap()
            .id,
            StrategyId::GradiveqRing
        );
        assert!(choose(&preds, &[StrategyId::Int8]).is_none());
    }
}
