//! `gradsync predict`, `plan` and `crossover`: the cost model
//! ([`crate::cost`]) on the command line. No MPI needed.

use super::parse_size;
pub use crate::cost::records::{
    layer_bytes, plan_record, predict_record, read_layers, step_layers, step_query, LayerSpec,
    ModelArgs, PredictRecord,
};
use crate::cost::{self, Profile, Query, STRATEGIES};
use crate::{Error, Result};
use serde::Serialize;
use std::path::PathBuf;

/// Arguments of `gradsync predict`.
#[derive(clap::Args, Debug, Clone)]
pub struct PredictArgs {
    /// Layer size in f32 elements.
    #[arg(
        long,
        conflicts_with = "bytes",
        required_unless_present_any = ["bytes", "shape"]
    )]
    pub elements: Option<usize>,
    /// Layer size in bytes (K/M/G suffixes), 4 bytes per element.
    #[arg(long)]
    pub bytes: Option<String>,
    /// The layer's shape, comma-separated (`2048,1024` or `64,3,7,7`):
    /// `powersgd` is priced on its first dimension by the rest (with
    /// `--elements` or `--bytes` too, they must agree). Without it,
    /// PowerSGD is priced on the most nearly square view of the layer.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub shape: Option<Vec<usize>>,
    /// Number of ranks.
    #[arg(long)]
    pub ranks: usize,
    /// Density of the sparse strategies.
    #[arg(long, default_value_t = 0.001, allow_hyphen_values = true)]
    pub density: f64,
    /// Model constants.
    #[command(flatten)]
    pub model: ModelArgs,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
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
            if bytes == 0 {
                // (`--elements 0` is refused by the model's own check,
                // which Python's `predict` shares.)
                return Err(Error::InvalidArgument(format!(
                    "--bytes {b}: a layer of 0 elements, nothing to predict"
                )));
            }
            Ok(bytes / 4)
        }
        _ => Err(Error::InvalidArgument("give --elements or --bytes".into())),
    }?;
    Ok(n)
}

pub(super) fn run_predict(a: &PredictArgs) -> Result<i32> {
    let prof = a.model.profile()?;
    let n = match (&a.shape, a.elements, &a.bytes) {
        (Some(s), None, None) => s
            .iter()
            .try_fold(1usize, |x, &d| x.checked_mul(d))
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "--shape {}: no elements, or more than 2^64",
                    crate::cost::records::shape_str(s)
                ))
            })?,
        _ => elements(a.elements, &a.bytes)?,
    };
    a.model.check_point(a.ranks, a.density)?;
    let r = predict_record(&prof, &a.model, n, a.ranks, a.density, a.shape.as_deref())?;
    if a.json {
        outln!("{}", serde_json::to_string(&r)?);
        return Ok(0);
    }
    outln!(
        "layer: {} elements ({} bytes), {} ranks, density {}",
        r.elements,
        r.bytes,
        r.ranks,
        super::short_float(r.density)
    );
    outln!(
        "{:<24} {:>14} {:>16}",
        "strategy",
        "predicted_us",
        "wire_bytes/rank"
    );
    if let Some([rows, cols]) = r.powersgd_matrix {
        let rank = a.model.powersgd_rank.min(rows).min(cols);
        let how = if crate::powersgd::worth_compressing(rows, cols, rank, 2.0) {
            format!("at rank {rank}")
        } else {
            "as dense (its factors would not halve it)".into()
        };
        outln!(
            "powersgd priced {how} on a {rows} x {cols} matrix{}",
            if a.shape.is_some() {
                ""
            } else {
                " (the most nearly square, listed, not chosen: --shape gives the layer's own)"
            }
        );
    }
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
    #[arg(long, default_value_t = 0.001, allow_hyphen_values = true)]
    pub density: f64,
    /// Model constants.
    #[command(flatten)]
    pub model: ModelArgs,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
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
    {
        // One line a layer, buffered (stdout flushes every line: a table
        // of 10^6 layers spent seconds in write calls); the group's name
        // as serde spells it, looked up once per kind.
        use std::io::Write as _;
        let mut names: Vec<(crate::cost::GroupKind, String)> = Vec::new();
        let mut w = std::io::BufWriter::new(std::io::stdout().lock());
        for l in &out.layers {
            if !names.iter().any(|(g, _)| *g == l.group) {
                let s = serde_json::to_value(l.group)?;
                names.push((l.group, s.as_str().unwrap_or("?").to_string()));
            }
            let group = names
                .iter()
                .find(|(g, _)| *g == l.group)
                .map_or("?", |(_, s)| s);
            writeln!(
                w,
                "{:<32} {:>12} {:<24} {:<9} {:>12.2} {:>12.2} {:>12.2}",
                l.name,
                l.elements,
                l.choice,
                group,
                l.seconds * 1e6,
                l.alone_s * 1e6,
                l.dense_s * 1e6
            )
            .map_err(crate::cli::stdout_error)?;
        }
        w.flush().map_err(crate::cli::stdout_error)?;
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
    #[arg(long, default_value_t = 0.001, allow_hyphen_values = true)]
    pub density: f64,
    /// The compressed strategy compared (`powersgd` too, priced on each
    /// size's most nearly square view at `--powersgd-rank`).
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
    let base = a.model.query(1, a.ranks, a.density);
    let x = cost::crossover(
        &prof,
        &base,
        &a.model.select_method,
        (&a.sparse, &a.dense),
        max_n,
        a.model.powersgd_rank,
    )?;
    // No crossover: does sparse win anywhere below the top (a band)?
    let band = match x {
        Some(_) => None,
        None => {
            let mut wins = Vec::new();
            for n in std::iter::successors(Some(1usize), |&n| n.checked_mul(2))
                .take_while(|&n| n <= max_n)
            {
                if a.sparse == "powersgd" && !cost::powersgd_compresses(n, a.model.powersgd_rank) {
                    continue; // priced dense there: no win of PowerSGD's
                }
                let preds = predict_sized(&prof, &a.model, &Query { n, ..base })?;
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
                super::short_float(a.density)
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
                    super::short_float(a.density)
                ),
                None => outln!(
                    "{} never beats {} up to {} on {} ranks at density {}",
                    a.sparse,
                    a.dense,
                    a.max_bytes,
                    a.ranks,
                    super::short_float(a.density)
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

/// Every strategy's prediction for a layer of `q.n` elements, PowerSGD's
/// on its most nearly square view where the profile prices it.
fn predict_sized(prof: &Profile, m: &ModelArgs, q: &Query) -> Result<Vec<cost::Prediction>> {
    cost::predict_matrix(
        prof,
        q,
        &m.select_method,
        cost::square_view(q.n),
        m.powersgd_rank,
    )
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
        let preds = predict_sized(prof, m, &m.query(n, p, d))?;
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
        RGBColor(0, 128, 128),
    ];
    // A strategy the profile does not price (no points) gets no legend
    // entry.
    let series = series.into_iter().filter(|(_, pts)| !pts.is_empty());
    for ((name, pts), color) in series.zip(colors) {
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
