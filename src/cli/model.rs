//! `gradsync predict`, `plan` and `crossover`: the cost model
//! ([`crate::cost`]) on the command line. No MPI needed.

use super::parse_size;
use crate::cost::{self, LinearFit, Prediction, Profile, Query, STRATEGIES};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where the model's constants come from.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Calibrated profile (JSON from `gradsync calibrate`).
    #[arg(long, conflicts_with_all = ["alpha", "bandwidth"])]
    pub profile: Option<PathBuf>,
    /// Latency α, seconds per message (without --profile).
    #[arg(long, requires = "bandwidth")]
    pub alpha: Option<f64>,
    /// Bandwidth 1/β, bytes per second (without --profile).
    #[arg(long, requires = "alpha")]
    pub bandwidth: Option<f64>,
    /// γ_reduce, seconds per byte reduced (without --profile; with one,
    /// it replaces the profile's constant and its curve by message size).
    #[arg(long)]
    pub gamma_reduce: Option<f64>,
    /// γ_unpack, seconds per byte of sparse unit scatter-added (without
    /// --profile; with one, it replaces the profile's constant and its
    /// curve by output size).
    #[arg(long)]
    pub gamma_unpack: Option<f64>,
    /// Selection cost, seconds per element (overrides the profile's fit).
    #[arg(long)]
    pub select_cost: Option<f64>,
    /// Fixed selection cost, seconds per layer (with --select-cost).
    #[arg(long)]
    pub select_fixed: Option<f64>,
    /// Selection method whose profile fit `sparse-allgather` uses.
    #[arg(long, default_value = "trimmed")]
    pub select_method: String,
    /// GradiVeQ compression ratio r.
    #[arg(long, default_value_t = 8.0)]
    pub gradiveq_ratio: f64,
    /// Strategies the choice is made among (comma list; default: all).
    #[arg(long, default_value = "")]
    pub strategies: String,
    /// Ranks per node (block placement): the two-level model of
    /// `cost::topology` (default: every rank on one node).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub ranks_per_node: Option<u64>,
    /// Latency between nodes, seconds per message (default: the profile's
    /// `inter_node`, else its `alpha`). Needs --ranks-per-node.
    #[arg(long, requires = "ranks_per_node")]
    pub inter_alpha: Option<f64>,
    /// Bandwidth of a node's link, bytes per second (default: the
    /// profile's `inter_node`, else one level). Needs --ranks-per-node.
    #[arg(long, requires = "ranks_per_node")]
    pub inter_bandwidth: Option<f64>,
    /// Measured fill ratio of the sparse allreduce, distinct indices of
    /// the sum over p·k, in (0, 1] (default: independent selections).
    #[arg(long)]
    pub fill: Option<f64>,
    /// Layers with fewer elements stay dense in a planned step, as the
    /// engine keeps them under `auto` (its `compress_threshold`, 32768 by
    /// default). 0: every layer chosen by price alone.
    #[arg(long, default_value_t = 0)]
    pub compress_threshold: usize,
}

impl ModelArgs {
    /// The profile these arguments describe.
    pub fn profile(&self) -> Result<Profile> {
        let mut p = match (&self.profile, self.alpha, self.bandwidth) {
            (Some(path), _, _) => Profile::load(path)?,
            (None, Some(a), Some(bw)) => Profile::from_network(a, bw, 0.0, 0.0)?,
            _ => {
                return Err(Error::InvalidArgument(
                    "give --profile FILE, or --alpha S and --bandwidth BYTES_PER_S".into(),
                ))
            }
        };
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
        if let Some(f) = self.fill {
            if !(f > 0.0 && f <= 1.0) {
                return Err(Error::InvalidArgument(format!(
                    "--fill {f}: must lie in (0, 1] (distinct indices of the sum over p·k)"
                )));
            }
        }
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
                p.select.insert(m.to_string(), fit);
            }
        }
        p.validate()?;
        Ok(p)
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

/// Arguments of `gradsync predict`.
#[derive(clap::Args, Debug, Clone)]
pub struct PredictArgs {
    /// Layer size in f32 elements.
    #[arg(long, conflicts_with = "bytes", required_unless_present = "bytes")]
    pub elements: Option<usize>,
    /// Layer size in bytes (K/M/G suffixes), 4 bytes per element.
    #[arg(long)]
    pub bytes: Option<String>,
    /// Number of ranks.
    #[arg(long)]
    pub ranks: usize,
    /// Density of the sparse strategies.
    #[arg(long, default_value_t = 0.001)]
    pub density: f64,
    /// Model constants.
    #[command(flatten)]
    pub model: ModelArgs,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
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
}

fn elements(e: Option<usize>, b: &Option<String>) -> Result<usize> {
    let n = match (e, b) {
        (Some(e), _) => {
            layer_bytes(e).map_err(|m| Error::InvalidArgument(format!("--elements {e}: {m}")))?;
            Ok(e)
        }
        (None, Some(b)) => {
            let bytes = parse_size(b)?;
            if bytes % 4 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "--bytes {b}: {bytes} bytes is not a whole number of f32 elements \
                     (a multiple of 4)"
                )));
            }
            Ok(bytes / 4)
        }
        _ => Err(Error::InvalidArgument("give --elements or --bytes".into())),
    }?;
    if n == 0 {
        // Nothing to synchronize: every prediction would be a bare α.
        return Err(Error::InvalidArgument(
            "a layer of 0 elements (--elements / --bytes): nothing to predict".into(),
        ));
    }
    Ok(n)
}

/// Bytes of a layer of `n` f32 elements, or why it has no byte size
/// (`4·n` overflows).
pub(crate) fn layer_bytes(n: usize) -> std::result::Result<usize, String> {
    n.checked_mul(4).ok_or_else(|| {
        format!(
            "{n} f32 elements do not fit in memory (at most {} elements)",
            usize::MAX / 4
        )
    })
}

/// Prediction record for one layer.
pub fn predict_record(
    prof: &Profile,
    m: &ModelArgs,
    n: usize,
    p: usize,
    d: f64,
) -> Result<PredictRecord> {
    layer_bytes(n).map_err(Error::InvalidArgument)?;
    let preds = cost::predict(
        prof,
        &Query {
            n,
            p,
            density: d,
            gradiveq_ratio: m.gradiveq_ratio,
            ranks_per_node: m.rpn(),
            fill: m.fill,
        },
        &m.select_method,
    )?;
    let choice = cost::choose(&preds, &m.allowed(prof)?)
        .map(|c| c.name.clone())
        .unwrap_or_default();
    Ok(PredictRecord {
        elements: n,
        bytes: layer_bytes(n).map_err(Error::InvalidArgument)?,
        ranks: p,
        density: d,
        strategies: preds,
        choice,
    })
}

pub(super) fn run_predict(a: &PredictArgs) -> Result<i32> {
    let prof = a.model.profile()?;
    let n = elements(a.elements, &a.bytes)?;
    a.model.check_point(a.ranks, a.density)?;
    let r = predict_record(&prof, &a.model, n, a.ranks, a.density)?;
    if a.json {
        outln!("{}", serde_json::to_string(&r)?);
        return Ok(0);
    }
    outln!(
        "layer: {} elements ({} bytes), {} ranks, density {}",
        r.elements,
        r.bytes,
        r.ranks,
        r.density
    );
    outln!(
        "{:<24} {:>14} {:>16}",
        "strategy",
        "predicted_us",
        "wire_bytes/rank"
    );
    for s in &r.strategies {
        let mark = if s.name == r.choice {
            "  <- choice"
        } else {
            ""
        };
        outln!(
            "{:<24} {:>14.3} {:>16.0}{mark}",
            s.name,
            s.seconds * 1e6,
            s.wire_bytes
        );
    }
    Ok(0)
}

/// Arguments of `gradsync plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// Layers file: JSON `{"layers": [{"name": ..., "elements": ...}, ...]}`
    /// or a bare array of such objects (see `examples/layers/`).
    #[arg(long)]
    pub layers: PathBuf,
    /// Number of ranks.
    #[arg(long)]
    pub ranks: usize,
    /// Density of the sparse strategies.
    #[arg(long, default_value_t = 0.001)]
    pub density: f64,
    /// Model constants.
    #[command(flatten)]
    pub model: ModelArgs,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One entry of a layers file.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct LayerSpec {
    /// Layer (tensor) name.
    pub name: String,
    /// f32 elements.
    pub elements: usize,
}

/// Read a layers file. Every error ([`Error::File`]) names the file and,
/// for a bad entry, its index, its name when it has one, and the field.
pub fn read_layers(path: &std::path::Path) -> Result<Vec<LayerSpec>> {
    use serde_json::Value;
    const SHAPE: &str =
        "expected {\"layers\": [{\"name\": ..., \"elements\": ...}, ...]} or a bare array";
    let bad = |m: String| Error::file(path, m);
    // 64 MiB: a million layers and then some.
    let bytes = crate::error::read_small_file(path, 64 << 20, "layers file")?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| bad(format!("not a layers file: {e}; {SHAPE}")))?;
    let entries = match &v {
        Value::Array(a) => a,
        Value::Object(o) => match o.get("layers") {
            Some(Value::Array(a)) => a,
            Some(_) => return Err(bad(format!("\"layers\" is not an array; {SHAPE}"))),
            None => return Err(bad(format!("no \"layers\" field; {SHAPE}"))),
        },
        _ => return Err(bad(format!("not a layers file; {SHAPE}"))),
    };
    // A key given twice ("name", "elements", "layers"): the parsed object
    // keeps the last silently; serde's derive names it.
    {
        use serde::de::IgnoredAny;
        #[derive(serde::Deserialize)]
        #[allow(dead_code)] // only parsed, for serde's duplicate-field check
        struct Entry {
            name: Option<IgnoredAny>,
            elements: Option<IgnoredAny>,
        }
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Top {
            layers: Option<IgnoredAny>,
        }
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Wrapped {
            layers: Vec<Entry>,
        }
        // The top level first, whatever its values' types
        // ({"layers": 5, "layers": [...]}), then the entries.
        let r = if v.is_array() {
            serde_json::from_slice::<Vec<Entry>>(&bytes).map(drop)
        } else {
            serde_json::from_slice::<Top>(&bytes)
                .and_then(|_| serde_json::from_slice::<Wrapped>(&bytes))
                .map(drop)
        };
        // Other shape errors are named better by the checks below.
        if let Err(e) = r.map_err(|e| e.to_string()) {
            if e.starts_with("duplicate field") {
                return Err(bad(format!("{e} (a key given twice)")));
            }
        }
    }
    let mut out = Vec::with_capacity(entries.len());
    let mut seen = std::collections::HashMap::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let Value::Object(o) = e else {
            return Err(bad(format!(
                "layer {i}: not an object {{\"name\": ..., \"elements\": ...}}"
            )));
        };
        let name = match o.get("name") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(bad(format!(
                    "layer {i}: field \"name\" is {other}, not a string"
                )))
            }
            None => return Err(bad(format!("layer {i}: missing field \"name\""))),
        };
        let at = format!("layer {i} ({name:?})");
        // A key this reader does not know (a "strategy", a misspelt
        // "elemets") would otherwise be ignored without a word.
        if let Some(k) = o
            .keys()
            .find(|k| !matches!(k.as_str(), "name" | "elements"))
        {
            return Err(bad(format!(
                "{at}: unknown field {k:?} (a layer has \"name\" and \"elements\")"
            )));
        }
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(bad(format!(
                "{at}: field \"name\" must be non-empty without control characters"
            )));
        }
        if let Some(j) = seen.insert(name.clone(), i) {
            return Err(bad(format!(
                "{at}: the same name as layer {j} (names must be unique)"
            )));
        }
        let elements = match o.get("elements") {
            Some(Value::Number(x)) => x
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "{at}: field \"elements\" is {x}, not a non-negative integer"
                    ))
                })?,
            Some(other) => {
                return Err(bad(format!(
                    "{at}: field \"elements\" is {other}, not a number"
                )))
            }
            None => return Err(bad(format!("{at}: missing field \"elements\""))),
        };
        layer_bytes(elements).map_err(|m| bad(format!("{at}: field \"elements\": {m}")))?;
        out.push(LayerSpec { name, elements });
    }
    if out.is_empty() {
        return Err(bad(format!("no layers; {SHAPE}")));
    }
    if out.iter().all(|l| l.elements == 0) {
        return Err(bad(
            "every layer has 0 elements: nothing to synchronize".into()
        ));
    }
    let sum: u128 = out.iter().map(|l| l.elements as u128).sum();
    // A step reads every layer's gradient: the table must fit in memory
    // as a whole, not only layer by layer.
    if usize::try_from(sum).map_or(true, |n| layer_bytes(n).is_err()) {
        return Err(bad(format!(
            "the layers hold {sum} f32 elements in all: their bytes overflow a 64-bit \
             size (at most {} elements)",
            usize::MAX / 4
        )));
    }
    if let Some(t) = v.get("total_elements") {
        if t.as_u64().map(u128::from) != Some(sum) {
            return Err(bad(format!(
                "\"total_elements\" is {t}, but the layers hold {sum} elements"
            )));
        }
    }
    Ok(out)
}

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
        p,
        density,
        select_method: m.select_method.clone(),
        gradiveq_ratio: m.gradiveq_ratio,
        allowed: m.allowed(prof)?,
        ranks_per_node: m.rpn(),
        fill: m.fill,
        allgather: crate::dense::AllgathervAlgo::Auto,
        min_sparse_elems: m.compress_threshold,
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

pub(super) fn run_plan(a: &PlanArgs) -> Result<i32> {
    let prof = a.model.profile()?;
    let layers = read_layers(&a.layers)?;
    for l in &layers {
        layer_bytes(l.elements).map_err(Error::InvalidArgument)?;
    }
    a.model.check_point(a.ranks, a.density)?;
    let out = plan_record(&prof, &a.model, &layers, a.ranks, a.density)?;
    if a.json {
        outln!("{}", serde_json::to_string(&out)?);
        return Ok(0);
    }
    outln!(
        "{:<32} {:>12} {:<24} {:<9} {:>12} {:>12} {:>12}",
        "layer",
        "elements",
        "choice",
        "group",
        "marginal_us",
        "alone_us",
        "dense_us"
    );
    for l in &out.layers {
        outln!(
            "{:<32} {:>12} {:<24} {:<9} {:>12.2} {:>12.2} {:>12.2}",
            l.name,
            l.elements,
            l.choice,
            serde_json::to_value(l.group)?.as_str().unwrap_or("?"),
            l.seconds * 1e6,
            l.alone_s * 1e6,
            l.dense_s * 1e6
        );
    }
    outln!("groups:");
    for g in &out.groups {
        outln!(
            "  {:<9} {:<20} {:>4} layers {:>11} elements {:>12.0} B/rank sent  comm {:>10.1} us  local {:>10.1} us",
            serde_json::to_value(g.kind)?.as_str().unwrap_or("?"),
            g.algorithm.name(),
            g.layers,
            g.elements,
            g.wire_bytes,
            g.comm_s * 1e6,
            g.local_s * 1e6
        );
    }
    outln!(
        "step: dense-only {:.3} ms, all-sparse {:.3} ms, planned {:.3} ms ({:.2}x over dense); choices {:?}",
        out.dense_total_s * 1e3,
        out.all_sparse_s * 1e3,
        out.planned_total_s * 1e3,
        out.speedup,
        out.choices
    );
    Ok(0)
}

/// Arguments of `gradsync crossover`.
#[derive(clap::Args, Debug, Clone)]
pub struct CrossoverArgs {
    /// Number of ranks.
    #[arg(long)]
    pub ranks: usize,
    /// Density of the sparse strategies.
    #[arg(long, default_value_t = 0.001)]
    pub density: f64,
    /// The sparse strategy compared.
    #[arg(long, default_value = "sparse-allgather")]
    pub sparse: String,
    /// The dense strategy compared.
    #[arg(long, default_value = "dense-rabenseifner")]
    pub dense: String,
    /// Largest layer considered (bytes).
    #[arg(long, default_value = "4G")]
    pub max_bytes: String,
    /// Write an SVG plot of predicted time vs layer size per strategy.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Model constants.
    #[command(flatten)]
    pub model: ModelArgs,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `gradsync crossover --json` output.
#[derive(Serialize, Debug, Clone)]
pub struct CrossoverRecord {
    /// Ranks.
    pub ranks: usize,
    /// Density.
    pub density: f64,
    /// Sparse strategy.
    pub sparse: String,
    /// Dense strategy.
    pub dense: String,
    /// Layer size (elements) from which sparse is faster; null if never.
    pub crossover_elements: Option<usize>,
    /// The same in bytes.
    pub crossover_bytes: Option<usize>,
    /// Where sparse wins somewhere but not up to `--max-bytes` (no
    /// crossover): the smallest and the largest power-of-two layer size,
    /// bytes, at which it is predicted faster; null otherwise.
    pub wins_between_bytes: Option<[usize; 2]>,
}

pub(super) fn run_crossover(a: &CrossoverArgs) -> Result<i32> {
    let prof = a.model.profile()?;
    a.model.check_point(a.ranks, a.density)?;
    if let Some(p) = &a.plot {
        check_svg_path(p)?;
    }
    if !a.model.strategies.trim().is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--strategies {:?}: crossover compares --sparse with --dense (it was ignored)",
            a.model.strategies
        )));
    }
    for s in [&a.sparse, &a.dense] {
        if !STRATEGIES.contains(&s.as_str()) {
            return Err(Error::InvalidArgument(format!("unknown strategy {s:?}")));
        }
    }
    if a.sparse.starts_with("dense-") {
        return Err(Error::InvalidArgument(format!(
            "--sparse {}: a dense strategy (--sparse takes a compressed one, e.g. \
             sparse-allgather, sparse-allreduce, qsgd)",
            a.sparse
        )));
    }
    if !a.dense.starts_with("dense-") {
        return Err(Error::InvalidArgument(format!(
            "--dense {}: not a dense strategy (dense-rabenseifner, dense-ring, \
             dense-hierarchical)",
            a.dense
        )));
    }
    let max_b = parse_size(&a.max_bytes)?;
    if max_b < 4 || max_b % 4 != 0 {
        return Err(Error::InvalidArgument(format!(
            "--max-bytes {}: at least one f32 element (4 B) and a multiple of 4",
            a.max_bytes
        )));
    }
    if a.plot.is_some() && max_b < 128 {
        return Err(Error::InvalidArgument(format!(
            "--max-bytes {} with --plot: at least 128 B (the plot's lines join sizes \
             from 16 elements, by powers of two: two at least)",
            a.max_bytes
        )));
    }
    let max_n = max_b / 4;
    let base = Query {
        n: 1,
        p: a.ranks,
        density: a.density,
        gradiveq_ratio: a.model.gradiveq_ratio,
        ranks_per_node: a.model.rpn(),
        fill: a.model.fill,
    };
    let x = cost::crossover(
        &prof,
        &base,
        &a.model.select_method,
        &a.sparse,
        &a.dense,
        max_n,
    )?;
    // No crossover: does sparse win anywhere below the top (a band)?
    let band = match x {
        Some(_) => None,
        None => {
            let mut wins = Vec::new();
            for n in std::iter::successors(Some(1usize), |&n| n.checked_mul(2))
                .take_while(|&n| n <= max_n)
            {
                let preds = cost::predict(&prof, &Query { n, ..base }, &a.model.select_method)?;
                let t = |name: &str| preds.iter().find(|x| x.name == name).map(|x| x.seconds);
                if let (Some(s), Some(d)) = (t(&a.sparse), t(&a.dense)) {
                    if s < d {
                        wins.push(n);
                    }
                }
            }
            wins.first()
                .zip(wins.last())
                .map(|(&lo, &hi)| [4 * lo, 4 * hi])
        }
    };
    let rec = CrossoverRecord {
        ranks: a.ranks,
        density: a.density,
        sparse: a.sparse.clone(),
        dense: a.dense.clone(),
        crossover_elements: x,
        crossover_bytes: x.map(|n| 4 * n),
        wins_between_bytes: band,
    };
    if let Some(path) = &a.plot {
        plot(&prof, &a.model, a.ranks, a.density, max_n, path, x)?;
    }
    if a.json {
        outln!("{}", serde_json::to_string(&rec)?);
    } else {
        match x {
            Some(n) => outln!(
                "{} beats {} from {} elements ({}) on {} ranks at density {}",
                a.sparse,
                a.dense,
                n,
                human(4 * n),
                a.ranks,
                a.density
            ),
            None => match band {
                Some([lo, hi]) => outln!(
                    "{} beats {} only from about {} to {} (power-of-two sizes), not up to {}, on {} ranks at density {}",
                    a.sparse,
                    a.dense,
                    human(lo),
                    human(hi),
                    a.max_bytes,
                    a.ranks,
                    a.density
                ),
                None => outln!(
                    "{} never beats {} up to {} on {} ranks at density {}",
                    a.sparse, a.dense, a.max_bytes, a.ranks, a.density
                ),
            },
        }
    }
    Ok(0)
}

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30)),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20)),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// `--plot PATH`: the plot is SVG, so the name must say so (an SVG
/// written to `x.png` opens as a broken image).
pub(super) fn check_svg_path(path: &std::path::Path) -> Result<()> {
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    if let Some(kind) = crate::error::special_file(path) {
        Err(Error::file(
            path,
            format!("--plot: not a regular file ({kind})"),
        ))
    } else if svg {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "--plot {}: the plot is SVG; name the file .svg",
            path.display()
        )))
    }
}

/// Predicted time vs layer size (log-log), one line per strategy.
fn plot(
    prof: &Profile,
    m: &ModelArgs,
    p: usize,
    d: f64,
    max_n: usize,
    path: &std::path::Path,
    cross: Option<usize>,
) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| Error::file(path, format!("cannot write plot: {e}"));
    let sizes: Vec<usize> = (0..)
        .map(|i| 1usize << i)
        .take_while(|&n| n <= max_n)
        .filter(|&n| n >= 16)
        .collect();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = cost::StrategyId::ALL
        .into_iter()
        .filter(|s| !s.is_codec())
        .map(|s| (s.name().to_string(), Vec::new()))
        .collect();
    for &n in &sizes {
        let preds = cost::predict(
            prof,
            &Query {
                n,
                p,
                density: d,
                gradiveq_ratio: m.gradiveq_ratio,
                ranks_per_node: m.rpn(),
                fill: m.fill,
            },
            &m.select_method,
        )?;
        for (name, pts) in &mut series {
            if let Some(x) = preds.iter().find(|x| &x.name == name) {
                pts.push(((4 * n) as f64, x.seconds.max(1e-9)));
            }
        }
    }
    let (ymin, ymax) = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold((f64::INFINITY, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    let xmax = (4 * max_n) as f64;
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "predicted synchronization time, p = {p}{}, density = {d}",
        m.rpn()
            .map_or_else(String::new, |l| format!(" ({l} per node)"))
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (64f64..xmax).log_scale(),
            (ymin * 0.5..ymax * 2.0).log_scale(),
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("layer size (bytes)")
        .y_desc("seconds")
        .x_label_formatter(&|v| super::tick_label(*v))
        .y_label_formatter(&|v| super::tick_label(*v))
        .draw()
        .map_err(|e| err(&e))?;
    let colors = [
        RED,
        BLUE,
        GREEN,
        MAGENTA,
        BLACK,
        CYAN,
        RGBColor(230, 140, 0),
        RGBColor(120, 60, 160),
    ];
    for ((name, pts), color) in series.into_iter().zip(colors) {
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    if let Some(n) = cross {
        let x = (4 * n) as f64;
        chart
            .draw_series(LineSeries::new(
                vec![(x, ymin * 0.5), (x, ymax * 2.0)],
                BLACK.mix(0.4),
            ))
            .map_err(|e| err(&e))?
            .label(format!("crossover {}", human(4 * n)))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
