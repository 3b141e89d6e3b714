//! `gradsync scale`: the predicted synchronization time of a whole step
//! (the step model, [`crate::cost::plan_step`]) per strategy as the job
//! grows, on nodes of `L` ranks ([`crate::cost::topology`]), and the rank
//! counts at which one strategy overtakes another. No MPI.

use super::model::{read_layers, step_layers, step_query, ModelArgs};
use crate::cost::{self, StrategyId};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `gradsync scale`.
#[derive(clap::Args, Debug, Clone)]
pub struct ScaleArgs {
    /// Layers file (as `plan`'s).
    #[arg(long)]
    pub layers: PathBuf,
    /// Rank counts: `A..B` (powers of two times A up to B, both included)
    /// or a comma list.
    #[arg(long, default_value = "8..4096")]
    pub ranks: String,
    /// Density of the sparse strategies.
    #[arg(long, default_value_t = 0.001, allow_hyphen_values = true)]
    pub density: f64,
    /// Model constants (`--ranks-per-node` places the ranks).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Write an SVG plot of step time against ranks per strategy.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The whole-table strategies compared: every layer synchronized one way.
pub const SCALE_STRATEGIES: [StrategyId; 6] = [
    StrategyId::DenseRabenseifner,
    StrategyId::DenseRing,
    StrategyId::DenseHierarchical,
    StrategyId::SparseAllgather,
    StrategyId::SparseAllreduce,
    StrategyId::SparseHierarchical,
];

/// [`SCALE_STRATEGIES`], and `powersgd` where the profile prices it (every
/// layer with a `shape` of two or more dimensions that PowerSGD shrinks,
/// at `--powersgd-rank`; the rest dense, as the engine runs them).
pub fn scale_strategies(prof: &cost::Profile) -> Vec<StrategyId> {
    let mut v = SCALE_STRATEGIES.to_vec();
    if !prof.powersgd.is_zero() {
        v.push(StrategyId::Powersgd);
    }
    v
}

/// One rank count.
#[derive(Serialize, Debug, Clone)]
pub struct ScalePoint {
    /// Ranks.
    pub ranks: usize,
    /// Nodes (`⌈ranks / ranks_per_node⌉`).
    pub nodes: usize,
    /// Predicted step seconds with every layer synchronized by each
    /// strategy.
    pub strategies: BTreeMap<String, f64>,
    /// The planned step (the per-layer choice of `plan`).
    pub planned_s: f64,
    /// Number of layers per strategy in the plan.
    pub choices: BTreeMap<String, usize>,
}

/// A rank count from which one strategy is predicted faster than another
/// (for every larger count of the sweep).
#[derive(Serialize, Debug, Clone)]
pub struct Crossover {
    /// The faster one from `ranks` on.
    pub faster: String,
    /// The one it overtakes.
    pub than: String,
    /// Smallest rank count (refined between sweep points) from which
    /// `faster` wins at every larger swept count; `null` if it never does,
    /// the first swept count if it always does.
    pub ranks: Option<usize>,
}

/// `gradsync scale --json` output.
#[derive(Serialize, Debug, Clone)]
pub struct ScaleRecord {
    /// Ranks per node (`null`: one node).
    pub ranks_per_node: Option<usize>,
    /// Density.
    pub density: f64,
    /// Layers in the table.
    pub layers: usize,
    /// Elements of the table.
    pub elements: usize,
    /// Per rank count.
    pub points: Vec<ScalePoint>,
    /// `sparse-allreduce` over `sparse-allgather`; the best dense over the
    /// best sparse; `sparse-hierarchical` over `sparse-allgather`; where
    /// the profile prices PowerSGD, `powersgd` over the best sparse and
    /// over the best dense.
    pub crossovers: Vec<Crossover>,
}

/// Parse `A..B` or `a,b,c` (every count at least 1, increasing).
pub fn parse_ranks(s: &str) -> Result<Vec<usize>> {
    // A long list is named by its start and length, not echoed whole.
    let shown = if s.chars().count() > 60 {
        let head: String = s.chars().take(40).collect();
        format!("\"{head}...\" ({} characters)", s.chars().count())
    } else {
        format!("{s:?}")
    };
    let bad = |m: String| Error::InvalidArgument(format!("--ranks {shown}: {m}"));
    let num = |x: &str| {
        x.trim()
            .parse::<usize>()
            .ok()
            .filter(|&v| v >= 1)
            .ok_or_else(|| bad(format!("{x:?} is not a rank count ≥ 1")))
    };
    let v: Vec<usize> = if let Some((a, b)) = s.split_once("..") {
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(bad(format!("{a} is above {b}")));
        }
        let mut v: Vec<usize> = std::iter::successors(Some(a), |&x| x.checked_mul(2))
            .take_while(|&x| x <= b)
            .collect();
        if v.last() != Some(&b) {
            v.push(b);
        }
        v
    } else {
        s.split(',').map(num).collect::<Result<_>>()?
    };
    if v.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad("rank counts must increase".into()));
    }
    if let Some(&big) = v.last().filter(|&&x| x > cost::MAX_RANKS) {
        return Err(bad(format!(
            "{big} is past the model's limit of {} (2^24)",
            cost::MAX_RANKS
        )));
    }
    if v.len() > 4096 {
        return Err(bad(format!("{} rank counts (at most 4096)", v.len())));
    }
    Ok(v)
}

/// Predicted step seconds at `p` ranks for each whole-table strategy.
fn point(
    prof: &cost::Profile,
    m: &ModelArgs,
    table: &[cost::StepLayer],
    p: usize,
    d: f64,
) -> Result<ScalePoint> {
    let q = step_query(prof, m, p, d)?;
    let mut strategies = BTreeMap::new();
    for id in scale_strategies(prof) {
        let t = cost::predict_step(prof, &q, table, &vec![id; table.len()])?;
        strategies.insert(id.name().to_string(), t.seconds);
    }
    let plan = cost::plan_step(prof, &q, table)?;
    let mut choices = BTreeMap::new();
    for (_, c) in plan.choices() {
        *choices.entry(c.name().to_string()).or_default() += 1;
    }
    Ok(ScalePoint {
        ranks: p,
        nodes: m.rpn().map_or(1, |l| p.div_ceil(l)),
        strategies,
        planned_s: plan.seconds,
        choices,
    })
}

fn best_of(pt: &ScalePoint, names: &[&str]) -> f64 {
    names
        .iter()
        .filter_map(|n| pt.strategies.get(*n))
        .copied()
        .fold(f64::INFINITY, f64::min)
}

const DENSE: [&str; 3] = ["dense-rabenseifner", "dense-ring", "dense-hierarchical"];
const SPARSE: [&str; 3] = [
    "sparse-allgather",
    "sparse-allreduce",
    "sparse-hierarchical",
];

/// The smallest rank count from which `a` beats `b` at every larger swept
/// count, refined by bisection between the last losing and the first
/// winning swept count.
fn crossover(
    points: &[ScalePoint],
    a: &[&str],
    b: &[&str],
    at: &mut dyn FnMut(usize) -> Result<ScalePoint>,
) -> Result<Option<usize>> {
    let wins = |pt: &ScalePoint| best_of(pt, a) < best_of(pt, b);
    let Some(first) = (0..points.len())
        .rev()
        .take_while(|&i| wins(&points[i]))
        .last()
    else {
        return Ok(None);
    };
    if first == 0 {
        return Ok(Some(points[0].ranks));
    }
    let (mut lo, mut hi) = (points[first - 1].ranks, points[first].ranks);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if wins(&at(mid)?) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi))
}

/// The sweep and its crossovers.
pub fn scale_record(
    prof: &cost::Profile,
    m: &ModelArgs,
    layers: &[super::LayerSpec],
    ranks: &[usize],
    d: f64,
) -> Result<ScaleRecord> {
    let table = step_layers(layers);
    let points = ranks
        .iter()
        .map(|&p| point(prof, m, &table, p, d))
        .collect::<Result<Vec<_>>>()?;
    let mut at = |p: usize| point(prof, m, &table, p, d);
    let mut crossovers = Vec::new();
    let mut pairs = vec![
        (&["sparse-allreduce"][..], &["sparse-allgather"][..]),
        (&["sparse-hierarchical"][..], &["sparse-allgather"][..]),
        (&DENSE[..], &SPARSE[..]),
    ];
    if !prof.powersgd.is_zero() {
        pairs.push((&["powersgd"][..], &SPARSE[..]));
        pairs.push((&["powersgd"][..], &DENSE[..]));
    }
    for (faster, than) in pairs {
        let name = |v: &[&str]| {
            if v.len() == 1 {
                v[0].to_string()
            } else if v[0].starts_with("dense") {
                "dense (best)".to_string()
            } else {
                "sparse (best)".to_string()
            }
        };
        crossovers.push(Crossover {
            faster: name(faster),
            than: name(than),
            ranks: crossover(&points, faster, than, &mut at)?,
        });
    }
    Ok(ScaleRecord {
        ranks_per_node: m.rpn(),
        density: d,
        layers: layers.len(),
        elements: layers.iter().map(|l| l.elements).sum(),
        points,
        crossovers,
    })
}

pub(super) fn run(a: &ScaleArgs) -> Result<i32> {
    let prof = a.model.profile()?;
    if let Some(p) = &a.plot {
        super::model::check_svg_path(p)?;
    }
    let layers = read_layers(&a.layers)?;
    let ranks = parse_ranks(&a.ranks)?;
    // Every swept count on one node would price nothing between nodes
    // (--inter-* ignored): as predict, plan and crossover refuse it.
    if let Some(&most) = ranks.iter().max() {
        a.model.check_point(most, a.density)?;
    }
    let rec = scale_record(&prof, &a.model, &layers, &ranks, a.density)?;
    let ids = scale_strategies(&prof);
    if let Some(path) = &a.plot {
        plot(&rec, &ids, &a.layers, path)?;
    }
    if a.json {
        outln!("{}", serde_json::to_string(&rec)?);
        return Ok(0);
    }
    out!("{:>7} {:>6}", "ranks", "nodes");
    for id in &ids {
        out!(" {:>20}", id.name());
    }
    outln!(" {:>12}  (ms per step)", "planned");
    for pt in &rec.points {
        out!("{:>7} {:>6}", pt.ranks, pt.nodes);
        for id in &ids {
            out!(" {:>20.3}", pt.strategies[id.name()] * 1e3);
        }
        outln!(" {:>12.3}", pt.planned_s * 1e3);
    }
    for c in &rec.crossovers {
        match c.ranks {
            Some(p) => outln!("{} beats {} from {p} ranks", c.faster, c.than),
            None => outln!("{} never beats {} in this range", c.faster, c.than),
        }
    }
    Ok(0)
}

/// Step time against ranks (log-log), one line per strategy and the plan.
fn plot(
    rec: &ScaleRecord,
    ids: &[StrategyId],
    layers: &std::path::Path,
    path: &std::path::Path,
) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| Error::file(path, format!("cannot write plot: {e}"));
    let (Some(first), Some(last)) = (rec.points.first(), rec.points.last()) else {
        return Ok(());
    };
    let ys = rec
        .points
        .iter()
        .flat_map(|p| p.strategies.values().copied().chain([p.planned_s]))
        .filter(|y| *y > 0.0);
    let (ymin, ymax) = ys.fold((f64::INFINITY, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    if !(ymin.is_finite() && ymax > 0.0) {
        return Err(err(&"every predicted time is zero (one rank?)"));
    }
    let x0 = first.ranks as f64;
    let x1 = (last.ranks as f64).max(x0 * 2.0);
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let name = layers
        .file_stem()
        .map_or_else(|| "table".into(), |s| s.to_string_lossy().into_owned());
    let title = format!(
        "{name}: predicted sync time per step, {} ranks/node, density {}",
        rec.ranks_per_node
            .map_or_else(|| "all".into(), |l| l.to_string()),
        super::short_float(rec.density)
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale(), (ymin * 0.5..ymax * 2.0).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("ranks")
        .y_desc("seconds per step")
        .x_label_formatter(&|v| format!("{}", v.round()))
        .y_label_formatter(&|v| super::tick_label(*v))
        .draw()
        .map_err(|e| err(&e))?;
    // One color per strategy, the plan always black.
    let palette = [
        RED,
        BLUE,
        MAGENTA,
        GREEN,
        RGBColor(230, 140, 0),
        CYAN,
        RGBColor(0, 128, 128),
    ];
    let colors: Vec<RGBColor> = palette.into_iter().take(ids.len()).chain([BLACK]).collect();
    let series = ids
        .iter()
        .map(|id| id.name().to_string())
        .chain(["planned".to_string()]);
    for (i, (s, color)) in series.zip(colors).enumerate() {
        let pts: Vec<(f64, f64)> = rec
            .points
            .iter()
            .map(|p| {
                let y = if s == "planned" {
                    p.planned_s
                } else {
                    p.strategies[&s]
                };
                (p.ranks as f64, y.max(ymin * 0.5))
            })
            .collect();
        let style = if s == "planned" {
            color.stroke_width(1)
        } else {
            color.stroke_width(2)
        };
        let dashed = i == ids.len();
        chart
            .draw_series(LineSeries::new(pts.clone(), style))
            .map_err(|e| err(&e))?
            .label(if dashed {
                "planned (per layer)".into()
            } else {
                s
            })
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
            )
            .map_err(|e| err(&e))?;
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
