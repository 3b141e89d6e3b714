//! The cost model's answers as records: a layer's prediction under every
//! strategy ([`predict_record`]), a layers file ([`read_layers`]) and its
//! planned step ([`plan_record`]), from the model's constants
//! ([`ModelArgs`]). What `gradsync predict` and `plan` print and what the
//! Python binding's `gradsync.predict` returns; no MPI, no command line
//! (the flags are `ModelArgs`'s fields, and the `cli` feature derives
//! them).

use crate::cost::{self, LinearFit, Prediction, Profile, Query};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where the model's constants come from.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct ModelArgs {
    /// Calibrated profile (JSON from `gradsync calibrate`).
    #[cfg_attr(feature = "cli", arg(long, conflicts_with_all = ["alpha", "bandwidth"]))]
    pub profile: Option<PathBuf>,
    /// Latency α, seconds per message (without --profile).
    #[cfg_attr(
        feature = "cli",
        arg(long, requires = "bandwidth", allow_hyphen_values = true)
    )]
    pub alpha: Option<f64>,
    /// Bandwidth 1/β, bytes per second (without --profile).
    #[cfg_attr(
        feature = "cli",
        arg(long, requires = "alpha", allow_hyphen_values = true)
    )]
    pub bandwidth: Option<f64>,
    /// γ_reduce, seconds per byte reduced (without --profile; with one,
    /// it replaces the profile's constant and its curve by message size).
    #[cfg_attr(feature = "cli", arg(long, allow_hyphen_values = true))]
    pub gamma_reduce: Option<f64>,
    /// γ_unpack, seconds per byte of sparse unit scatter-added (without
    /// --profile; with one, it replaces the profile's constant and its
    /// curve by output size).
    #[cfg_attr(feature = "cli", arg(long, allow_hyphen_values = true))]
    pub gamma_unpack: Option<f64>,
    /// Selection cost, seconds per element (overrides the profile's fit).
    #[cfg_attr(feature = "cli", arg(long, allow_hyphen_values = true))]
    pub select_cost: Option<f64>,
    /// Fixed selection cost, seconds per layer (with --select-cost).
    #[cfg_attr(feature = "cli", arg(long, allow_hyphen_values = true))]
    pub select_fixed: Option<f64>,
    /// Selection method whose profile fit `sparse-allgather` uses.
    #[cfg_attr(feature = "cli", arg(long, default_value = "trimmed"))]
    pub select_method: String,
    /// GradiVeQ compression ratio r.
    #[cfg_attr(
        feature = "cli",
        arg(long, default_value_t = 8.0, allow_hyphen_values = true)
    )]
    pub gradiveq_ratio: f64,
    /// Strategies the choice is made among (comma list; default: all).
    #[cfg_attr(feature = "cli", arg(long, default_value = ""))]
    pub strategies: String,
    /// Ranks per node (block placement): the two-level model of
    /// `cost::topology` (default: every rank on one node).
    #[cfg_attr(feature = "cli", arg(long, value_parser = clap::value_parser!(u64).range(1..)))]
    pub ranks_per_node: Option<u64>,
    /// Latency between nodes, seconds per message (default: the profile's
    /// `inter_node`, else its `alpha`). Needs --ranks-per-node.
    #[cfg_attr(
        feature = "cli",
        arg(long, requires = "ranks_per_node", allow_hyphen_values = true)
    )]
    pub inter_alpha: Option<f64>,
    /// Bandwidth of a node's link, bytes per second (default: the
    /// profile's `inter_node`, else one level). Needs --ranks-per-node.
    #[cfg_attr(
        feature = "cli",
        arg(long, requires = "ranks_per_node", allow_hyphen_values = true)
    )]
    pub inter_bandwidth: Option<f64>,
    /// Measured fill ratio of the sparse allreduce, distinct indices of
    /// the sum over p·k, in (0, 1] (default: independent selections).
    #[cfg_attr(feature = "cli", arg(long, allow_hyphen_values = true))]
    pub fill: Option<f64>,
    /// Layers with fewer elements are never sparsified or quantized in a
    /// planned step (dense, or PowerSGD where it is offered), as the
    /// engine keeps them under `auto` (its `compress_threshold`, 32768 by
    /// default). 0: every layer chosen by price alone.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub compress_threshold: usize,
    /// The rank `powersgd` is priced at (a layers file's layers with a
    /// `shape` of two or more dimensions; the engine's `auto_powersgd`).
    #[cfg_attr(
        feature = "cli",
        arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))
    )]
    pub powersgd_rank: usize,
}

impl Default for ModelArgs {
    /// The command line's defaults: no constants given.
    fn default() -> Self {
        ModelArgs {
            profile: None,
            alpha: None,
            bandwidth: None,
            gamma_reduce: None,
            gamma_unpack: None,
            select_cost: None,
            select_fixed: None,
            select_method: "trimmed".into(),
            gradiveq_ratio: crate::cost::GRADIVEQ_RATIO,
            strategies: String::new(),
            ranks_per_node: None,
            inter_alpha: None,
            inter_bandwidth: None,
            fill: None,
            compress_threshold: 0,
            powersgd_rank: 1,
        }
    }
}

impl ModelArgs {
    /// The profile these arguments describe.
    pub fn profile(&self) -> Result<Profile> {
        self.check_constants()?;
        let mut p = self.base_profile()?;
        self.apply_gammas(&mut p);
        self.apply_inter_node(&mut p)?;
        if let Some(f) = self.fill {
            if !(f > 0.0 && f <= 1.0) {
                return Err(Error::InvalidArgument(format!(
                    "--fill {f}: must lie in (0, 1] (distinct indices of the sum over p·k)"
                )));
            }
        }
        self.apply_select(&mut p)?;
        p.validate()?;
        Ok(p)
    }

    /// Range checks of `--alpha`, `--gamma-*` and `--bandwidth`, before
    /// any profile is read.
    fn check_constants(&self) -> Result<()> {
        // Every constant's range, naming its flag (Python's keyword through
        // the binding's flag map), before the model's own checks.
        for (flag, v) in [
            ("--alpha", self.alpha),
            ("--gamma-reduce", self.gamma_reduce),
            ("--gamma-unpack", self.gamma_unpack),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(Error::InvalidArgument(format!(
                    "{flag} {v}: must be a finite number ≥ 0 (seconds, or seconds per byte)"
                )));
            }
        }
        if let Some(bw) = self.bandwidth.filter(|b| !(b.is_finite() && *b > 0.0)) {
            return Err(Error::InvalidArgument(format!(
                "--bandwidth {bw}: must be a positive number of bytes per second"
            )));
        }
        Ok(())
    }

    /// The profile read from `--profile`, or built from `--alpha` and
    /// `--bandwidth`.
    fn base_profile(&self) -> Result<Profile> {
        match (&self.profile, self.alpha, self.bandwidth) {
            (Some(path), _, _) => Profile::load(path),
            (None, Some(a), Some(bw)) => Profile::from_network(a, bw, 0.0, 0.0),
            _ => Err(Error::InvalidArgument(
                "give --profile FILE, or --alpha S and --bandwidth BYTES_PER_S".into(),
            )),
        }
    }

    /// `--gamma-reduce` and `--gamma-unpack` in place of the profile's
    /// constants and curves.
    fn apply_gammas(&self, p: &mut Profile) {
        if let Some(g) = self.gamma_reduce {
            // The constant everywhere, as --gamma-unpack: the profile's
            // curve would otherwise still price every message it covers.
            p.gamma_reduce = g;
            p.gamma_reduce_curve.clear();
        }
        if let Some(g) = self.gamma_unpack {
            // The constant everywhere: a profile's curve by output size
            // would still price the large outputs.
            p.gamma_unpack = g;
            p.gamma_unpack_curve.clear();
        }
    }

    /// Checks `--ranks-per-node` and applies `--inter-alpha` and
    /// `--inter-bandwidth` to the profile's link between nodes.
    fn apply_inter_node(&self, p: &mut Profile) -> Result<()> {
        // clap checks these for the command line; the Python binding
        // fills the same struct from keywords.
        if self.ranks_per_node == Some(0) {
            return Err(Error::InvalidArgument(
                "--ranks-per-node 0: must be at least 1".into(),
            ));
        }
        if (self.inter_alpha.is_some() || self.inter_bandwidth.is_some())
            && self.ranks_per_node.is_none()
        {
            return Err(Error::InvalidArgument(
                "--inter-alpha and --inter-bandwidth need --ranks-per-node (the link between \
                 nodes is only used when ranks are placed on several nodes)"
                    .into(),
            ));
        }
        if self.inter_alpha.is_some() || self.inter_bandwidth.is_some() {
            let mut e = p.inter_node.clone().unwrap_or(cost::NetLevel {
                alpha: p.alpha,
                beta: p.beta,
                beta_curve: p.beta_curve.clone(),
                oneway_curve: Vec::new(),
                burst: None,
            });
            if let Some(a) = self.inter_alpha {
                if !(a.is_finite() && a >= 0.0) {
                    return Err(Error::InvalidArgument(format!(
                        "--inter-alpha {a}: must be a finite number of seconds ≥ 0"
                    )));
                }
                e.alpha = a;
            }
            if let Some(bw) = self.inter_bandwidth {
                if !(bw.is_finite() && bw > 0.0) {
                    return Err(Error::InvalidArgument(format!(
                        "--inter-bandwidth {bw}: must be a positive number of bytes per second"
                    )));
                }
                e.beta = 1.0 / bw;
                e.beta_curve.clear();
                e.oneway_curve.clear();
                // The measured link's token bucket is not this link's.
                e.burst = None;
            }
            p.inter_node = Some(e);
        }
        Ok(())
    }

    /// Checks `--select-cost` and `--select-fixed` and puts their fit in
    /// place of the profile's selection fits.
    fn apply_select(&self, p: &mut Profile) -> Result<()> {
        for (flag, v) in [
            ("--select-cost", self.select_cost),
            ("--select-fixed", self.select_fixed),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(Error::InvalidArgument(format!(
                    "{flag} {v}: must be a finite number of seconds ≥ 0"
                )));
            }
        }
        if self.select_fixed.is_some() && self.select_cost.is_none() {
            return Err(Error::InvalidArgument(
                "--select-fixed needs --select-cost (the per-element part of the same fit)".into(),
            ));
        }
        if self.select_cost.is_some() || self.select_fixed.is_some() {
            let fit = LinearFit {
                a: self.select_fixed.unwrap_or(0.0),
                b: self.select_cost.unwrap_or(0.0),
            };
            // The override replaces the method's fits at every density too
            // (a calibrated profile keys them `trimmed@0.001`, ..., which
            // `select_fit` prefers: the flags changed nothing there).
            for m in [self.select_method.as_str(), "quant"] {
                let at = format!("{m}@");
                p.select.retain(|k, _| k != m && !k.starts_with(&at));
                p.select_curve.retain(|k, _| k != m && !k.starts_with(&at));
                p.select.insert(m.to_string(), fit);
            }
            // The calibrated tables would price a large table's layers
            // over the override.
            p.select_table = None;
        }
        Ok(())
    }

    /// `--ranks-per-node` past `ranks` would put every rank on one node
    /// and drop the `--inter-*` level without a word (it was clamped).
    /// `--ranks` at least 1, `--density` in (0, 1] and [`Self::check_rpn`],
    /// the errors naming the flags (the model's own checks name only
    /// values).
    pub fn check_point(&self, ranks: usize, density: f64) -> Result<()> {
        if ranks == 0 {
            return Err(Error::InvalidArgument(
                "--ranks 0: must be at least 1".into(),
            ));
        }
        if !(density > 0.0 && density <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "--density {density}: must lie in (0, 1]"
            )));
        }
        self.check_rpn(ranks)
    }

    /// `--ranks-per-node` no more than `ranks` (the job's ranks, or the
    /// most that a sweep prices).
    pub fn check_rpn(&self, ranks: usize) -> Result<()> {
        match self.rpn() {
            Some(l) if l > ranks => Err(Error::InvalidArgument(format!(
                "--ranks-per-node {l} is more than --ranks {ranks}: the job would fit in one \
                 node (leave --ranks-per-node out for one node)"
            ))),
            _ => Ok(()),
        }
    }

    /// The cost model's query for one layer of `n` elements on `p` ranks
    /// at density `density`, with these arguments' GradiVeQ ratio,
    /// placement and fill.
    pub fn query(&self, n: usize, p: usize, density: f64) -> Query {
        Query {
            at: crate::cost::Placement {
                p,
                ranks_per_node: self.rpn(),
                fill: self.fill,
                ..crate::cost::Placement::default()
            },
            n,
            density,
            gradiveq_ratio: self.gradiveq_ratio,
        }
    }

    /// Ranks per node (`--ranks-per-node`).
    pub fn rpn(&self) -> Option<usize> {
        self.ranks_per_node
            .map(|l| usize::try_from(l).unwrap_or(usize::MAX))
    }

    /// The candidate strategies of the choice (`--strategies`, else
    /// [`cost::default_candidates`] of `prof`).
    pub fn allowed(&self, prof: &Profile) -> Result<Vec<cost::StrategyId>> {
        let v = cost::parse_list(&self.strategies)
            .map_err(|e| Error::InvalidArgument(format!("--strategies: {e}")))?;
        Ok(if v.is_empty() {
            cost::default_candidates(prof)
        } else {
            v
        })
    }
}

/// `gradsync predict --json` output.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct PredictRecord {
    /// f32 elements.
    pub elements: usize,
    /// Bytes (4 per element).
    pub bytes: usize,
    /// Ranks.
    pub ranks: usize,
    /// Density.
    pub density: f64,
    /// Every strategy's prediction.
    pub strategies: Vec<Prediction>,
    /// The fastest allowed strategy.
    pub choice: String,
    /// The matrix `powersgd` is priced on (rows, columns): the layer's
    /// shape given, its first dimension by the rest, or without one the
    /// most nearly square view of its elements ([`cost::square_view`]);
    /// absent when the profile does not price PowerSGD.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub powersgd_matrix: Option<[usize; 2]>,
}

/// Prediction record for one layer; `shape`, where known, is the
/// layer's (its elements must be `n`): PowerSGD is priced on its matrix
/// view, else on the most nearly square one.
pub fn predict_record(
    prof: &Profile,
    m: &ModelArgs,
    n: usize,
    p: usize,
    d: f64,
    shape: Option<&[usize]>,
) -> Result<PredictRecord> {
    if n == 0 {
        // Nothing to synchronize: every prediction would be a bare α.
        // (The command line and Python's `predict` both come here.)
        return Err(Error::InvalidArgument(
            "--elements 0: a layer of 0 elements, nothing to predict".into(),
        ));
    }
    layer_bytes(n).map_err(Error::InvalidArgument)?;
    let matrix = match shape {
        None => cost::square_view(n),
        Some(s) => {
            let elements = s.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
            if elements != Some(n) {
                return Err(Error::InvalidArgument(format!(
                    "--shape {}: {} elements, not the layer's {n}",
                    shape_str(s),
                    elements.map_or_else(|| "more than 2^64".into(), |e| e.to_string())
                )));
            }
            // A vector: one row, which PowerSGD leaves dense.
            crate::powersgd::matrix_view(s).unwrap_or((1, n))
        }
    };
    // (Without a PowerSGD fit, `predict`'s list.)
    let preds = cost::predict_matrix(
        prof,
        &m.query(n, p, d),
        &m.select_method,
        matrix,
        m.powersgd_rank,
    )?;
    let mut allowed = m.allowed(prof)?;
    if shape.is_none() && m.strategies.trim().is_empty() {
        // PowerSGD on an assumed (the squarest) view is listed, not
        // chosen: the engine prices a layer known by its size alone
        // without it. Named in --strategies, it may be chosen.
        allowed.retain(|&id| id != cost::StrategyId::Powersgd);
    }
    let choice = cost::choose(&preds, &allowed)
        .map(|c| c.name.clone())
        .unwrap_or_default();
    Ok(PredictRecord {
        elements: n,
        bytes: layer_bytes(n).map_err(Error::InvalidArgument)?,
        ranks: p,
        density: d,
        strategies: preds,
        choice,
        powersgd_matrix: (!prof.powersgd.is_zero()).then_some([matrix.0, matrix.1]),
    })
}

/// A shape as the command line takes it (`64,3,7,7`).
pub fn shape_str(s: &[usize]) -> String {
    s.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

pub use super::layers_file::{layer_bytes, read_layers, LayerSpec};

/// `gradsync plan --json` output: the step model ([`cost::plan_step`]).
#[derive(Serialize, Debug, Clone)]
pub struct PlanRecord {
    /// Ranks.
    pub ranks: usize,
    /// Density.
    pub density: f64,
    /// Per layer: name, elements, choice, group, its marginal seconds.
    pub layers: Vec<PlanLayer>,
    /// The step's groups (fused dense allreduce, fused sparse allgatherv,
    /// GradiVeQ rings).
    pub groups: Vec<cost::GroupPlan>,
    /// Predicted step with every layer in the fused dense allreduce.
    pub dense_total_s: f64,
    /// Predicted step with every layer RGC-sparse in the fused allgatherv.
    pub all_sparse_s: f64,
    /// Predicted step as planned.
    pub planned_total_s: f64,
    /// `dense_total_s / planned_total_s` (1 when both are 0: one rank
    /// with no local costs).
    pub speedup: f64,
    /// Bytes each rank sends in the planned step.
    pub wire_bytes: f64,
    /// Number of layers per chosen strategy.
    pub choices: std::collections::BTreeMap<String, usize>,
}

/// One planned layer.
#[derive(Serialize, Debug, Clone)]
pub struct PlanLayer {
    /// Name.
    pub name: String,
    /// Elements.
    pub elements: usize,
    /// Chosen strategy.
    pub choice: String,
    /// Its group (`dense`, `sparse`, `gradiveq`).
    pub group: cost::GroupKind,
    /// What it adds to the planned step (seconds).
    pub seconds: f64,
    /// The chosen strategy for the layer alone (every α its own).
    pub alone_s: f64,
    /// Dense Rabenseifner for the layer alone.
    pub dense_s: f64,
}

/// The step model's query for these arguments.
pub fn step_query(
    prof: &Profile,
    m: &ModelArgs,
    p: usize,
    density: f64,
) -> Result<cost::StepQuery> {
    Ok(cost::StepQuery {
        at: crate::cost::Placement {
            p,
            ranks_per_node: m.rpn(),
            fill: m.fill,
            allgather: crate::strategy::Pick::Auto,
        },
        density,
        select_method: m.select_method.clone(),
        gradiveq_ratio: m.gradiveq_ratio,
        allowed: m.allowed(prof)?,
        min_sparse_elems: m.compress_threshold,
        powersgd_rank: m.powersgd_rank,
    })
}

/// The step model's table for a layers file.
pub fn step_layers(layers: &[LayerSpec]) -> Vec<cost::StepLayer> {
    layers
        .iter()
        .map(|l| cost::StepLayer {
            name: l.name.clone(),
            n: l.elements,
            kind: cost::LayerKind::Auto,
            matrix: l.shape.as_deref().and_then(crate::powersgd::matrix_view),
        })
        .collect()
}

/// The plan of a layers file, with the dense-only and all-sparse steps.
pub fn plan_record(
    prof: &Profile,
    m: &ModelArgs,
    layers: &[LayerSpec],
    p: usize,
    d: f64,
) -> Result<PlanRecord> {
    let q = step_query(prof, m, p, d)?;
    let table = step_layers(layers);
    let plan = cost::plan_step(prof, &q, &table)?;
    let dense_algo = q
        .allowed
        .iter()
        .copied()
        .find(|s| *s == cost::StrategyId::DenseRing)
        .filter(|_| !q.allowed.contains(&cost::StrategyId::DenseRabenseifner))
        .unwrap_or(cost::StrategyId::DenseRabenseifner);
    let all = |id| cost::predict_step(prof, &q, &table, &vec![id; table.len()]);
    let dense = all(dense_algo)?;
    let sparse = all(cost::StrategyId::SparseAllgather)?;
    let mut choices = std::collections::BTreeMap::new();
    let out_layers = plan
        .layers
        .iter()
        .zip(&dense.layers)
        .map(|(l, d)| {
            *choices.entry(l.choice.name().to_string()).or_default() += 1;
            PlanLayer {
                name: l.name.clone(),
                elements: l.elements,
                choice: l.choice.name().to_string(),
                group: l.group,
                seconds: l.marginal_s,
                alone_s: l.alone_s,
                dense_s: d.alone_s,
            }
        })
        .collect();
    Ok(PlanRecord {
        ranks: p,
        density: d,
        layers: out_layers,
        groups: plan.groups.clone(),
        dense_total_s: dense.seconds,
        all_sparse_s: sparse.seconds,
        planned_total_s: plan.seconds,
        speedup: if dense.seconds == 0.0 && plan.seconds == 0.0 {
            1.0
        } else {
            dense.seconds / plan.seconds
        },
        wire_bytes: plan.wire_bytes,
        choices,
    })
}
