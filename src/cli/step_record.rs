//! The records of `gradsync bench --op step` (one JSON line per measured
//! configuration, or a readable line with its groups), as
//! [`super::step_bench`] measures them.

use super::bench::BenchArgs;
use crate::cost::GroupKind;
use crate::Result;
use serde::Serialize;

/// One planned layer of the benchmark.
#[derive(Serialize, Debug, Clone)]
pub struct StepLayerRecord {
    /// Name.
    pub name: String,
    /// f32 elements.
    pub elements: usize,
    /// Strategy (a cost-model name).
    pub choice: String,
    /// Group (`dense`, `sparse`).
    pub group: GroupKind,
    /// Predicted marginal seconds (null without a profile).
    pub predicted_s: Option<f64>,
}

/// A probe of the machine's state timed in the steps' rounds beside the
/// profile's price of it (`crate::calibrate::StateProbe`): whether the
/// machine is in the state its profile was calibrated in.
#[derive(Serialize, Debug, Clone)]
pub struct StateRecord {
    /// `exchange` (pairwise, ranks 2i and 2i+1), `dense-table` or
    /// `rgc-table` (one engine step of the calibration's largest table).
    pub probe: String,
    /// Bytes each way (`exchange`), or of the table's gradients.
    pub size: usize,
    /// Median over the rounds (slowest rank; each round a burst of three
    /// after an untimed call).
    pub measured_s: f64,
    /// The profile's price of the same.
    pub profile_s: f64,
}

/// One group of the measured step.
#[derive(Serialize, Debug, Clone)]
pub struct StepGroupRecord {
    /// `dense` or `sparse`.
    pub kind: GroupKind,
    /// The collective.
    pub algorithm: String,
    /// Layers in it.
    pub layers: usize,
    /// Their elements.
    pub elements: usize,
    /// This rank's message bytes for the group (measured, rank 0).
    pub message_bytes: usize,
    /// Measured median seconds of its collective (slowest rank).
    pub measured_s: f64,
    /// Predicted seconds of its collective (null without a profile).
    pub predicted_s: Option<f64>,
}

/// The `--json` record of `gradsync bench --op step`.
#[derive(Serialize, Debug, Clone)]
pub struct StepRecord {
    /// `step`.
    pub op: String,
    /// `planned` (the plan's choices; the engine's defaults without a
    /// profile), `dense` (every layer dense) or `sparse` (every layer RGC).
    pub config: String,
    /// Ranks.
    pub ranks: usize,
    /// The layers file.
    pub layers_file: String,
    /// Layers.
    pub layers: usize,
    /// f32 elements of the whole table.
    pub elements: usize,
    /// Density of the sparse strategies.
    pub density: f64,
    /// What the plan chose among.
    pub strategies: Vec<String>,
    /// Timed steps.
    pub iters: usize,
    /// Median seconds of one engine step (slowest rank).
    pub median_s: f64,
    /// Fastest step.
    pub min_s: f64,
    /// Every timed step's seconds (slowest rank), in the order they ran.
    /// The configurations of one run take turns step by step, so the
    /// i-th entries of its records are the same round: their ratio pairs
    /// two configurations under the same machine state.
    pub step_times_s: Vec<f64>,
    /// The step model's prediction (null without a profile).
    pub predicted_s: Option<f64>,
    /// `(predicted_s − median_s) / median_s`.
    pub rel_error: Option<f64>,
    /// Median of `MPI_Allreduce` of the whole table fused into one buffer.
    pub dense_mpi_median_s: f64,
    /// `dense_mpi_median_s / median_s`.
    pub speedup_vs_dense: f64,
    /// Bytes of this rank's messages in one step: its fused sparse
    /// message plus its fused dense buffer (rank 0).
    pub wire_bytes_per_rank: usize,
    /// The step's groups, measured and predicted.
    pub groups: Vec<StepGroupRecord>,
    /// Median local seconds of a step (selection, packing, unpacking).
    pub local_s: f64,
    /// Per layer, in table order.
    pub choices: Vec<StepLayerRecord>,
    /// Layers per strategy.
    pub choice_counts: std::collections::BTreeMap<String, usize>,
    /// `--sparse-exchange`: how the engine was told to exchange the RGC
    /// layers' pairs (`allgather`, `allreduce`, `hierarchical`, `auto`).
    pub sparse_exchange: String,
    /// Timed steps per exchange the pairs actually took
    /// (`StepStats::sparse_exchange`, rank 0; `allgather` also for steps
    /// without such layers).
    pub exchanges: std::collections::BTreeMap<String, usize>,
    /// The fill estimate after the last step (`StepStats::fill_estimate`).
    pub fill_estimate: Option<f64>,
    /// The state probes (`exchange` of 64 KiB and of up to 16 MiB on
    /// more than one rank), against the profile's prices: where a probe
    /// measures far from its price, the machine is not in its
    /// calibration's state, and the predictions that use that part of the
    /// profile are off with it.
    pub state_probes: Vec<StateRecord>,
}

/// Print `rec`: its JSON line with `--json`, else readable lines.
pub(super) fn print_record(a: &BenchArgs, rec: &StepRecord) -> Result<()> {
    if a.json {
        outln!("{}", serde_json::to_string(rec)?);
        return Ok(());
    }
    outln!(
        "{} step of {} ({} layers, {} elements) on {} ranks: median {:.3} ms (min {:.3}), predicted {}, MPI_Allreduce of the table {:.3} ms ({:.2}x); {} bytes/rank; local {:.3} ms; choices {:?}; sparse exchange {} (steps {:?}, fill estimate {})",
        rec.config,
        rec.layers_file,
        rec.layers,
        rec.elements,
        rec.ranks,
        rec.median_s * 1e3,
        rec.min_s * 1e3,
        rec.predicted_s
            .map_or_else(|| "-".into(), |x| format!("{:.3} ms", x * 1e3)),
        rec.dense_mpi_median_s * 1e3,
        rec.speedup_vs_dense,
        rec.wire_bytes_per_rank,
        rec.local_s * 1e3,
        rec.choice_counts,
        rec.sparse_exchange,
        rec.exchanges,
        rec.fill_estimate
            .map_or_else(|| "-".into(), |f| format!("{f:.3}"))
    );
    for g in &rec.groups {
        outln!(
            "  group {:?} ({}): {} layers, {} elements, {} bytes/rank, measured {:.3} ms, predicted {}",
            g.kind,
            g.algorithm,
            g.layers,
            g.elements,
            g.message_bytes,
            g.measured_s * 1e3,
            g.predicted_s
                .map_or_else(|| "-".into(), |x| format!("{:.3} ms", x * 1e3))
        );
    }
    for x in &rec.state_probes {
        outln!(
            "  state: {} of {} measured {:.1} us, the profile's {:.1} us ({:.2}x)",
            x.probe,
            x.size,
            x.measured_s * 1e6,
            x.profile_s * 1e6,
            x.measured_s / x.profile_s
        );
    }
    Ok(())
}
