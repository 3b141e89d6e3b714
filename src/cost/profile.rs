//! A calibrated cluster, as `gradsync calibrate` writes it and every
//! prediction reads it: the α-β-γ constants and their curves, the local
//! cost fits of selection, codecs, dense fusing and PowerSGD, the network
//! between nodes ([`NetLevel`], [`Burst`]), where and when it was measured
//! ([`ProfileMeta`]); loading, saving and validating it, and the
//! accessors that evaluate its curves at a size. What the numbers are fed
//! into is [`crate::cost`]'s formulas and [`super::topology`]'s schedules.

use super::curve::{curve_at, curve_time_at, CurvePoint, LinearFit, PowerSgdFit};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Cost of one codec: encode and decode fits and wire size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CodecFit {
    /// Encoding `n` elements.
    pub encode: LinearFit,
    /// Decoding (adding) one message of `n` elements.
    pub decode: LinearFit,
    /// Measured wire bytes per element (data-dependent codecs: 3LC, FastSGD);
    /// `None` uses the codec's analytic size.
    #[serde(default)]
    pub bytes_per_element: Option<f64>,
}

/// Where and when a profile was measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileMeta {
    /// Host name(s) and CPU.
    #[serde(default)]
    pub machine: String,
    /// MPI library version string.
    #[serde(default)]
    pub mpi: String,
    /// Date of the calibration (UTC, ISO 8601).
    #[serde(default)]
    pub date: String,
    /// Ranks of the calibration job.
    #[serde(default)]
    pub ranks: usize,
    /// Free-form note (transport, network emulation, ...).
    #[serde(default)]
    pub note: String,
}

/// The least speedup of the layer-parallel local phase
/// ([`Profile::local_parallelism`]) for which the engine runs it
/// ([`layers_in_parallel`](super::layers_in_parallel)) and the step model divides by it. Where
/// every core is already busy with a rank the calibration measures it
/// about 1 (0.80–1.03 in the development VM's calibrations, 2 ranks on 2
/// cores), and the engine then ran the phase parallel or serial by the
/// noise of one probe. Parallel there cost the LSTM table's RGC step
/// 5 % over shared memory (96.8 against 92.1 ms, means of four 7-step
/// medians) and up to 8 % at 1 Gbit/s, with twice the spread.
pub const PARALLEL_MIN_SPEEDUP: f64 = 1.1;

/// Current profile format version (2 added the β and γ_reduce curves;
/// version-1 profiles still load, with constant β and γ).
pub const PROFILE_VERSION: u32 = 2;

/// A calibrated cluster: the α-β-γ constants and the local cost fits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Format version ([`PROFILE_VERSION`]).
    #[serde(default = "profile_version")]
    pub version: u32,
    /// Seconds per message.
    pub alpha: f64,
    /// Seconds per byte sent.
    pub beta: f64,
    /// Seconds per byte reduced locally (dense allreduce).
    #[serde(default)]
    pub gamma_reduce: f64,
    /// Seconds per byte of sparse unit scatter-added.
    #[serde(default)]
    pub gamma_unpack: f64,
    /// Seconds per byte of clearing a dense output (`fill(0.0)` of a layer
    /// of several MiB, every rank at once): what the sparse allreduces pay
    /// to overwrite their `n`-element result before summing into it
    /// ([`topology`](super::topology)). The engine's fused-allgather path clears its layers
    /// in the local phase, inside the selection fits. Zero in profiles from
    /// before it.
    #[serde(default, skip_serializing_if = "super::curve::is_zero")]
    pub gamma_clear: f64,
    /// γ_clear by the size of the output (`bytes` = 4·n), log-linear
    /// between its points ([`Self::gamma_clear_at`]): `calibrate` clears
    /// 4 MiB up to 128 MiB on every rank at once. The cost per byte is not flat: past the size where memset
    /// switches to non-temporal stores (about the last-level cache) it
    /// halves on the project's VMs. Empty in profiles from before it (then
    /// [`Self::gamma_clear`] everywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gamma_clear_curve: Vec<CurvePoint>,
    /// β by message size (pairwise exchange steps; see the module docs);
    /// empty: the constant `beta`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub beta_curve: Vec<CurvePoint>,
    /// γ_reduce by the size of the reduced message; empty: the constant
    /// `gamma_reduce`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gamma_reduce_curve: Vec<CurvePoint>,
    /// γ_unpack by the size of the dense output the pairs are added into
    /// (`bytes` = 4·n): the sparse allreduces clear an output of the whole
    /// group (ResNet-50's 97.5 MiB) and then add the received pairs into
    /// it, each pair a cache line fetched from memory, at 2.5–3 times the
    /// cost per byte of [`Self::gamma_unpack`] (measured on the emulated
    /// cluster, docs/benchmarks/cluster.md), which `calibrate` fits on
    /// outputs of at most 16 MiB reused between calls. The first point is
    /// that fit at the largest of those outputs; the next ones are added
    /// into a just-cleared output ([`Self::gamma_unpack_at`]). Empty in
    /// profiles from before it (then the constant everywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gamma_unpack_curve: Vec<CurvePoint>,
    /// Local cost of a sparse step per selection method (`trimmed`,
    /// `threshold`, `sampled`, `exact`, and `quant` for quantized RGC);
    /// `method@density` keys hold fits calibrated at one density.
    #[serde(default)]
    pub select: BTreeMap<String, LinearFit>,
    /// The same local cost by layer size, per key of [`Self::select`]:
    /// seconds per byte of the layer (`4n`) at each probed size. Its last
    /// point prices the layers larger than every probe
    /// ([`Self::select_at`]). Empty in profiles from before it (then the
    /// fit everywhere).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub select_curve: BTreeMap<String, Vec<CurvePoint>>,
    /// The same local cost in a step whose whole table is past the caches
    /// ([`SelectTable`], [`Self::select_in_table`]); `None` in profiles
    /// from before it (then [`Self::select_at`] everywhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub select_table: Option<SelectTable>,
    /// Per codec (`fp16`, `int8`, `qsgd`, `sbc`, `3lc`, `fastsgd`).
    #[serde(default)]
    pub codecs: BTreeMap<String, CodecFit>,
    /// The engine's local cost of one dense layer per step: copying it
    /// into the fused dense buffer, the momentum update and copying the
    /// average out (`n` elements; zero when not measured). The step model
    /// charges it to every dense layer ([`plan_step`](super::plan_step)).
    #[serde(default, skip_serializing_if = "LinearFit::is_zero")]
    pub dense_local: LinearFit,
    /// The same cost per gradient byte by the size of the step's whole
    /// table (bytes): a step whose table is larger than the last-level
    /// cache streams its dense layers from memory (measured on one layer
    /// up to 16 MiB, then on tables of several). Empty in profiles from
    /// before it (then [`Self::dense_local`] alone).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_local_curve: Vec<CurvePoint>,
    /// Effective speedup of the engine's layer-parallel local phase
    /// (selection, encoding and unpacking of several sparse layers spread
    /// over its threads), measured by `calibrate` with every rank busy at
    /// once; 1 when not measured. Where it pays
    /// ([`Profile::parallel_speedup`]) the engine runs the phase on its
    /// threads, and the step model divides the sparse group's local
    /// seconds by it when the group has two layers or more.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub local_parallelism: f64,
    /// PowerSGD's local cost of a layer ([`PowerSgdFit`]); zero (and left
    /// out of the JSON) in profiles from before it.
    #[serde(default, skip_serializing_if = "PowerSgdFit::is_zero")]
    pub powersgd: PowerSgdFit,
    /// GradiVeQ compression of a whole layer.
    #[serde(default)]
    pub gradiveq_compress: LinearFit,
    /// GradiVeQ decompression of a whole layer.
    #[serde(default)]
    pub gradiveq_decompress: LinearFit,
    /// One-way ping-pong fit (`a` = latency, `b` = seconds per byte), for
    /// reference: the model's `alpha`/`beta` are fitted to pairwise
    /// exchanges (sendrecv), which run both directions at once as the
    /// collectives' steps do.
    #[serde(default)]
    pub pingpong: LinearFit,
    /// Recursive-doubling allgather fit of `⌈lg p⌉·a + (p−1)·bytes·b`, for
    /// reference (it includes the copy of the rank's own block).
    #[serde(default)]
    pub allgather: LinearFit,
    /// The network between nodes ([`topology`](super::topology)): `None` when the
    /// calibrating job ran on one node (the model is then one level).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_node: Option<NetLevel>,
    /// Metadata.
    #[serde(default)]
    pub meta: ProfileMeta,
}

fn one() -> f64 {
    1.0
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

fn profile_version() -> u32 {
    PROFILE_VERSION
}

impl Profile {
    /// A profile with only the network constants (all local costs zero).
    pub fn from_network(
        alpha: f64,
        bandwidth: f64,
        gamma_reduce: f64,
        gamma_unpack: f64,
    ) -> Result<Self> {
        if !(bandwidth > 0.0 && bandwidth.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "bandwidth {bandwidth} bytes/s must be positive"
            )));
        }
        let p = Profile {
            version: PROFILE_VERSION,
            alpha,
            beta: 1.0 / bandwidth,
            gamma_reduce,
            gamma_unpack,
            gamma_clear: 0.0,
            gamma_clear_curve: Vec::new(),
            beta_curve: Vec::new(),
            gamma_reduce_curve: Vec::new(),
            gamma_unpack_curve: Vec::new(),
            dense_local_curve: Vec::new(),
            select: BTreeMap::new(),
            select_curve: BTreeMap::new(),
            select_table: None,
            codecs: BTreeMap::new(),
            dense_local: LinearFit::default(),
            local_parallelism: 1.0,
            powersgd: PowerSgdFit::default(),
            gradiveq_compress: LinearFit::default(),
            gradiveq_decompress: LinearFit::default(),
            pingpong: LinearFit::default(),
            allgather: LinearFit::default(),
            inter_node: None,
            meta: ProfileMeta::default(),
        };
        p.validate()?;
        Ok(p)
    }

    /// Reject negative or non-finite constants and unknown versions.
    pub fn validate(&self) -> Result<()> {
        if !(1..=PROFILE_VERSION).contains(&self.version) {
            return Err(Error::InvalidArgument(format!(
                "profile version {} (this build reads {PROFILE_VERSION})",
                self.version
            )));
        }
        let mut bad = Vec::new();
        self.bad_constants(&mut bad);
        self.bad_fits(&mut bad);
        self.bad_curves(&mut bad);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "bad profile constants (each must be finite and ≥ 0, curves in increasing \
                 sizes): {}",
                bad.join(", ")
            )))
        }
    }

    /// Appends to `bad` the scalar constants out of range (the local
    /// parallelism, α, β, the γs, the link between nodes and its burst
    /// credit).
    fn bad_constants(&self, bad: &mut Vec<String>) {
        if !(self.local_parallelism.is_finite() && self.local_parallelism > 0.0) {
            bad.push(format!("local_parallelism = {}", self.local_parallelism));
        }
        let inter = self.inter_node.as_ref();
        for (name, v) in [
            ("alpha", self.alpha),
            ("beta", self.beta),
            ("gamma_reduce", self.gamma_reduce),
            ("gamma_unpack", self.gamma_unpack),
            ("gamma_clear", self.gamma_clear),
            ("inter_node.alpha", inter.map_or(0.0, |e| e.alpha)),
            ("inter_node.beta", inter.map_or(0.0, |e| e.beta)),
            (
                "inter_node.burst.bytes",
                inter.and_then(|e| e.burst).map_or(0.0, |b| b.bytes),
            ),
            (
                "inter_node.burst.beta",
                inter.and_then(|e| e.burst).map_or(0.0, |b| b.beta),
            ),
        ] {
            if !non_negative(v) {
                bad.push(format!("{name} = {v}"));
            }
        }
        // A credit moves its bytes faster than the link's sustained rate
        // at some message size, or it is no credit (the model would
        // ignore it without a word). The calibration fits it below β at
        // its largest message.
        if let Some((e, b)) = inter.and_then(|e| e.burst.map(|b| (e, b))) {
            let slowest = e
                .beta_curve
                .iter()
                .map(|c| c.per_byte)
                .fold(e.beta, f64::max);
            if non_negative(b.beta) && b.bytes > 0.0 && b.beta >= slowest {
                bad.push(format!(
                    "inter_node.burst.beta = {} (not below the link's sustained {slowest} s/B \
                     at any size: a burst credit is faster than the link)",
                    b.beta
                ));
            }
        }
    }

    /// Appends to `bad` the linear fits out of range and the codecs' wire
    /// bytes per element outside [0, 16].
    fn bad_fits(&self, bad: &mut Vec<String>) {
        let fits = self
            .select
            .iter()
            .map(|(k, f)| (format!("select.{k}"), *f))
            .chain(self.codecs.iter().flat_map(|(k, c)| {
                [
                    (format!("codecs.{k}.encode"), c.encode),
                    (format!("codecs.{k}.decode"), c.decode),
                ]
            }))
            .chain([
                ("dense_local".to_string(), self.dense_local),
                ("gradiveq_compress".to_string(), self.gradiveq_compress),
                ("gradiveq_decompress".to_string(), self.gradiveq_decompress),
                ("pingpong".to_string(), self.pingpong),
                ("allgather".to_string(), self.allgather),
            ]);
        for (k, f) in fits {
            if !non_negative(f.a) || !non_negative(f.b) {
                bad.push(format!("{k} = {f:?}"));
            }
        }
        let ps = &self.powersgd;
        if ![ps.a, ps.per_elem, ps.per_elem_rank]
            .into_iter()
            .all(non_negative)
            || !ps
                .curve
                .iter()
                .all(|p| p.elements >= 1 && p.rank >= 1 && non_negative(p.per_elem))
            || ps.curve.len() > 64
            || (!ps.curve.is_empty() && ps.curve.iter().all(|p| p.per_elem == 0.0))
        {
            bad.push(format!(
                "powersgd = {{a: {}, per_elem: {}, per_elem_rank: {}, curve: {} points}} \
                 (coefficients and per-element costs finite and non-negative, a curve of \
                 at most 64 points at 1 element and rank 1 or more, not all of them zero)",
                ps.a,
                ps.per_elem,
                ps.per_elem_rank,
                ps.curve.len()
            ));
        }
        if !ps
            .table
            .iter()
            .all(|p| p.elements >= 1 && p.rank >= 1 && non_negative(p.per_elem))
            || ps.table.len() > 64
            || !non_negative(ps.table_bytes)
        {
            bad.push(format!(
                "powersgd.table = {} points in tables of {} bytes (per-element costs finite and \
                 non-negative, at most 64 points at 1 element and rank 1 or more)",
                ps.table.len(),
                ps.table_bytes
            ));
        }
        // A codec's measured wire bytes per element: at most 16 (an
        // index/value pair and then some).
        for (k, c) in &self.codecs {
            if let Some(b) = c.bytes_per_element {
                if !(b.is_finite() && (0.0..=16.0).contains(&b)) {
                    bad.push(format!(
                        "codecs.{k}.bytes_per_element = {b:?} (must be in [0, 16])"
                    ));
                }
            }
        }
    }

    /// Appends to `bad` the curves' points out of range or out of order
    /// (sizes must increase).
    fn bad_curves(&self, bad: &mut Vec<String>) {
        if let Some(t) = self.select_table.as_ref() {
            if !(t.table_bytes.is_finite() && t.table_bytes > 0.0) {
                bad.push(format!("select_table.table_bytes = {}", t.table_bytes));
            }
        }
        let inter = self.inter_node.as_ref();
        let no_curve = Vec::new();
        for (name, curve) in [
            ("beta_curve", &self.beta_curve),
            ("gamma_reduce_curve", &self.gamma_reduce_curve),
            ("gamma_unpack_curve", &self.gamma_unpack_curve),
            ("gamma_clear_curve", &self.gamma_clear_curve),
            ("dense_local_curve", &self.dense_local_curve),
            (
                "inter_node.beta_curve",
                inter.map_or(&no_curve, |e| &e.beta_curve),
            ),
            (
                "inter_node.oneway_curve",
                inter.map_or(&no_curve, |e| &e.oneway_curve),
            ),
        ]
        .into_iter()
        .map(|(name, c)| (name.to_string(), c))
        .chain(
            self.select_curve
                .iter()
                .map(|(k, c)| (format!("select_curve.{k}"), c)),
        )
        .chain(
            self.select_table
                .iter()
                .map(|t| ("select_table.curve".to_string(), &t.curve)),
        ) {
            for (i, c) in curve.iter().enumerate() {
                if !(c.bytes.is_finite() && c.bytes > 0.0 && non_negative(c.per_byte)) {
                    bad.push(format!("{name}[{i}] = {c:?}"));
                } else if i > 0 && curve[i - 1].bytes >= c.bytes {
                    bad.push(format!("{name}[{i}]: sizes must increase"));
                }
            }
        }
    }

    /// Read a JSON profile. Every error ([`Error::File`]) names the file:
    /// unreadable, not a profile (truncated, a field of the wrong type), or
    /// constants out of range.
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        // 64 MiB: a profile is a few KiB.
        let bytes = crate::error::read_small_file(path, 64 << 20, "profile")?;
        let p: Profile = serde_json::from_slice(&bytes)
            .map_err(|e| Error::file(path, format!("not a gradsync profile: {e}")))?;
        p.validate()
            .map_err(|e| Error::file(path, format!("bad profile: {e}")))?;
        Ok(p)
    }

    /// Write as pretty JSON (errors name the file), through a temporary
    /// file and a rename: a full disk leaves an existing profile whole.
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        crate::error::write_replacing(path, &serde_json::to_vec_pretty(self)?)
            .map_err(|e| Error::file(path, format!("cannot write profile: {e}")))
    }

    /// β at a message of `m` bytes (the curve if there is one, read by
    /// [`curve_time_at`]).
    pub fn beta_at(&self, m: f64) -> f64 {
        curve_time_at(&self.beta_curve, self.beta, m)
    }

    /// The layer-parallel local phase's speedup
    /// ([`Self::local_parallelism`]) where it pays, at least
    /// [`PARALLEL_MIN_SPEEDUP`]; `None` (serial) otherwise.
    pub fn parallel_speedup(&self) -> Option<f64> {
        (self.local_parallelism >= PARALLEL_MIN_SPEEDUP).then_some(self.local_parallelism)
    }

    /// The engine's local cost of a dense layer of `n` elements in a step
    /// whose whole table has `table` elements: `4n` bytes at the
    /// [`Self::dense_local_curve`]'s cost per byte for the table's size,
    /// or [`Self::dense_local`] where there is no curve.
    pub fn dense_local_at(&self, n: f64, table: f64) -> f64 {
        if self.dense_local_curve.is_empty() {
            return self.dense_local.at(n);
        }
        4.0 * n * curve_at(&self.dense_local_curve, 0.0, 4.0 * table.max(n))
    }

    /// γ_reduce at a reduced message of `m` bytes.
    pub fn gamma_reduce_at(&self, m: f64) -> f64 {
        curve_time_at(&self.gamma_reduce_curve, self.gamma_reduce, m)
    }

    /// γ_unpack (seconds per byte of pairs) for pairs added into a dense
    /// output of `out_bytes`: the [`Self::gamma_unpack_curve`], log-linear
    /// between its points, its first point's value below it and its last
    /// one's above; [`Self::gamma_unpack`] without a curve.
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, Profile};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// assert_eq!(p.gamma_unpack_at(1e9), 1e-9);
    /// p.gamma_unpack_curve = vec![
    ///     CurvePoint { bytes: 16.0 * 1048576.0, per_byte: 1e-9 },
    ///     CurvePoint { bytes: 64.0 * 1048576.0, per_byte: 2e-9 },
    /// ];
    /// assert_eq!(p.gamma_unpack_at(4096.0), 1e-9);
    /// assert!((p.gamma_unpack_at(32.0 * 1048576.0) - 1.5e-9).abs() < 1e-15);
    /// assert_eq!(p.gamma_unpack_at(1e9), 2e-9);
    /// ```
    pub fn gamma_unpack_at(&self, out_bytes: f64) -> f64 {
        curve_at(&self.gamma_unpack_curve, self.gamma_unpack, out_bytes)
    }

    /// γ_clear (seconds per byte) for clearing a dense output of
    /// `out_bytes`: the [`Self::gamma_clear_curve`] as
    /// [`Self::gamma_unpack_at`] reads its curve (through
    /// [`curve_time_at`]: clearing more never takes less time),
    /// [`Self::gamma_clear`] without one.
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, Profile};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// p.gamma_clear = 5e-11;
    /// assert_eq!(p.gamma_clear_at(1e9), 5e-11);
    /// p.gamma_clear_curve = vec![
    ///     CurvePoint { bytes: 16.0 * 1048576.0, per_byte: 4e-11 },
    ///     CurvePoint { bytes: 64.0 * 1048576.0, per_byte: 2e-11 },
    /// ];
    /// assert_eq!(p.gamma_clear_at(4096.0), 4e-11);
    /// assert!((p.gamma_clear_at(32.0 * 1048576.0) - 3e-11).abs() < 1e-18);
    /// assert_eq!(p.gamma_clear_at(1e9), 2e-11);
    /// ```
    pub fn gamma_clear_at(&self, out_bytes: f64) -> f64 {
        curve_time_at(&self.gamma_clear_curve, self.gamma_clear, out_bytes)
    }

    /// The selection fit of `method` at `density`: the fit calibrated at
    /// exactly that density (`"trimmed@0.01"`) if there is one, else the
    /// method's default (`"trimmed"`), else zero.
    pub fn select_fit(&self, method: &str, density: f64) -> LinearFit {
        self.select_key(method, density)
            .map_or_else(LinearFit::default, |k| self.select[k])
    }

    /// The key of [`Self::select`] that prices `method` at `density`
    /// (as [`Self::select_fit`] reads it).
    fn select_key(&self, method: &str, density: f64) -> Option<&str> {
        // `method@density` keys compared without formatting the density:
        // the step model asks once per layer and strategy, and a table of
        // 10^6 layers spent a fifth of `plan` in that `format!`.
        let at_density = |k: &str| {
            k.split_once('@')
                .is_some_and(|(m, d)| m == method && d.parse::<f64>().ok() == Some(density))
        };
        self.select
            .keys()
            .find(|k| at_density(k))
            .or_else(|| self.select.get_key_value(method).map(|(k, _)| k))
            .map(String::as_str)
    }

    /// Seconds of the local cost of a sparse step of `method` at
    /// `density` on a layer of `n` elements: [`Self::select_fit`] over
    /// the probed sizes; past the largest of them, the more of the fit and
    /// the largest probe's cost per element ([`Self::select_curve`]'s last
    /// point). The fit averages sizes that fit in the caches, and a layer
    /// past the probes is out of them, as the largest probe is: the LSTM
    /// table's 9–15 M-element layers cost 1.4–1.6 ns an element where the
    /// fit said 1.3. Inside the probed range the fit, not the curve's
    /// points: on the development VM the probes at 1 and 2 Mi elements
    /// read 2.4–2.6 ns in one job's four calibrations (512 Ki and 4 Mi:
    /// 1.4–1.7), which ResNet-50's steps did not show.
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, LinearFit, Profile};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// p.select.insert("trimmed".into(), LinearFit { a: 1e-6, b: 1e-9 });
    /// assert!((p.select_at("trimmed", 0.001, 1e7) - 1.0001e-2).abs() < 1e-12);
    /// p.select_curve.insert("trimmed".into(), vec![
    ///     CurvePoint { bytes: 4.0 * 65536.0, per_byte: 0.25e-9 },
    ///     CurvePoint { bytes: 4.0 * 4194304.0, per_byte: 0.4e-9 },
    /// ]);
    /// // Past the largest probe: its 1.6 ns an element.
    /// assert!((p.select_at("trimmed", 0.001, 1e7) - 1.6e-2).abs() < 1e-12);
    /// // Inside the probed range: the fit.
    /// assert!((p.select_at("trimmed", 0.001, 1e6) - 1.001e-3).abs() < 1e-12);
    /// ```
    pub fn select_at(&self, method: &str, density: f64, n: f64) -> f64 {
        // The key once: the planner prices every layer with this.
        self.select_key(method, density)
            .map_or(0.0, |key| self.select_alone(key, n))
    }

    /// [`Self::select_at`] for a key of [`Self::select`].
    fn select_alone(&self, key: &str, n: f64) -> f64 {
        let fit = self.select[key].at(n);
        match self.select_curve.get(key).and_then(|c| c.last()) {
            Some(l) if 4.0 * n > l.bytes => fit.max(4.0 * n * l.per_byte),
            _ => fit,
        }
    }

    /// Seconds of the local cost of a sparse step of `method` at
    /// `density` on a layer of `n` elements in a step whose whole table
    /// has `table` elements, by the [`table_weight`](super::table_weight)
    /// of the table's size: a table of at least the calibration's
    /// ([`SelectTable::table_bytes`]) prices the layer as the tables
    /// measured it (at the [`SelectTable::curve`] for its size, scaled by
    /// `method`'s fit against the tables' own), or alone where that costs
    /// more and the one-layer probes measured the layer's size (noise, or
    /// a layer past the caches by itself); one of at most a sixteenth of
    /// it as [`Self::select_at`] (alone, its data in the caches). No
    /// [`Self::select_table`]: [`Self::select_at`].
    ///
    /// A layer larger than both the tables' largest and the one-layer
    /// probes' largest is priced from the tables alone: both prices are
    /// then the cost an element of their largest layers, and the tables'
    /// ran the step's own code on a step's working set (a large LSTM's
    /// 9–15 M-element layers ran at 3.4–4.5 ns an element in steps on one
    /// VM, its 4 Mi-element tables read 4.5, its 4 Mi-element layer alone
    /// 4.9).
    ///
    /// ```
    /// use gradsync::cost::{CurvePoint, LinearFit, Profile, SelectTable};
    /// let mut p = Profile::from_network(1e-5, 1e9, 0.0, 1e-9).unwrap();
    /// p.select.insert("trimmed".into(), LinearFit { a: 0.0, b: 2e-9 });
    /// p.select_table = Some(SelectTable {
    ///     key: "trimmed".into(),
    ///     table_bytes: 64.0 * 1048576.0,
    ///     curve: vec![CurvePoint { bytes: 1048576.0, per_byte: 1e-9 }],
    /// });
    /// let n = 262144.0;
    /// // A small table: the layer alone (2 ns an element).
    /// assert!((p.select_in_table("trimmed", 0.001, n, 1e6) - 2e-9 * n).abs() < 1e-12);
    /// // A whole model's: the tables' 4 ns an element.
    /// assert!((p.select_in_table("trimmed", 0.001, n, 3e7) - 4e-9 * n).abs() < 1e-12);
    /// ```
    pub fn select_in_table(&self, method: &str, density: f64, n: f64, table: f64) -> f64 {
        let Some(key) = self.select_key(method, density) else {
            return 0.0;
        };
        let alone = self.select_alone(key, n);
        let Some(t) = self
            .select_table
            .as_ref()
            .filter(|t| !t.curve.is_empty() && t.table_bytes > 0.0)
        else {
            return alone;
        };
        let w = super::table_weight(4.0 * table.max(n), t.table_bytes);
        if w == 0.0 {
            return alone;
        }
        let fit = self.select[key].at(n);
        let reference = self.select.get(&t.key).map_or(fit, |f| f.at(n));
        let ratio = if reference > 0.0 {
            fit / reference
        } else {
            1.0
        };
        let tabled = 4.0 * n * curve_at(&t.curve, 0.0, 4.0 * n) * ratio;
        // The largest layer either kind of probe measured.
        let last = |c: &[CurvePoint]| c.last().map_or(0.0, |l| l.bytes);
        let measured = last(&t.curve).max(self.select_curve.get(key).map_or(0.0, |c| last(c)));
        let in_table = if 4.0 * n > measured {
            tabled
        } else {
            alone.max(tabled)
        };
        alone + w * (in_table - alone)
    }
}

/// Whether a profile constant is in range: finite and ≥ 0.
fn non_negative(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

/// The local cost of a sparse layer in a whole model's step: `calibrate`
/// times tables of RGC layers of one size, `table_bytes` of gradients in
/// all, one layer after another through the engine, as a step runs them.
/// Each layer then finds its gradient and residual out of the caches,
/// where the one-layer probes of [`Profile::select`] find them in: on one
/// 2-vCPU VM the tables of 256 Ki-element layers cost 3.2–3.5 ns an
/// element against 2.3–2.6 alone, and ResNet-50's RGC step 4.6 where
/// the layers alone priced 2.7.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectTable {
    /// The key of [`Profile::select`] the tables ran (`trimmed@0.001`);
    /// other methods and densities are priced at their fits' ratio to it.
    pub key: String,
    /// Bytes of gradients in each table.
    pub table_bytes: f64,
    /// Seconds per byte of a layer (`4n`), by the layer's size.
    pub curve: Vec<CurvePoint>,
}

/// The network between nodes: one pair of ranks on two nodes exchanging
/// alone (`gradsync calibrate` on a job spanning several nodes, or
/// `--inter-alpha`/`--inter-bandwidth`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetLevel {
    /// Seconds per message.
    pub alpha: f64,
    /// Seconds per byte.
    pub beta: f64,
    /// β by message size (as [`Profile::beta_curve`]); empty: `beta`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub beta_curve: Vec<CurvePoint>,
    /// β of one-way traffic by message size (ping-pong across the link,
    /// `(T_oneway(m) − α)/m`): what a ring step costs, whose messages go
    /// one way on each connection. Where a transport moves a large two-way
    /// exchange slower than one-way traffic (Open MPI's TCP BTL with its
    /// default 2 GiB put fragments ran some exchanges one way at a time,
    /// docs/benchmarks/cluster.md), the exchange's β would over-charge the ring.
    /// Empty: the exchange's β.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub oneway_curve: Vec<CurvePoint>,
    /// The link's burst credit, if it has one ([`Burst`]); `None`: every
    /// byte at the curves' rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<Burst>,
}

/// A link's burst credit: after an idle spell, the first `bytes` that
/// cross it in each direction move at `beta` seconds per byte, faster than
/// the sustained rate of the curves. A rate limiter built as a token bucket
/// works this way: the rate-limited network of a cloud VM, and the
/// emulated cluster's `tbf` (`hpc/cluster.sh`: a 2 ms bucket, 250 KB at
/// 1 Gbit/s). A training step finds the bucket full (the link idles
/// through the forward and backward pass), so the first bytes of each
/// collective cross on credit; a collective of a few hundred KB across the
/// link is mostly credit, one of many MB hardly at all.
///
/// `gradsync calibrate` ([`crate::calibrate`]) measures it on a job
/// spanning several nodes: the exchange across the link after 20 ms of
/// idling (the other ranks polling, as inside a collective) against the
/// same exchange back to back (the β curve), fitted as
/// `α + m·β(m) − min(m, bytes)·(β(m) − beta)`. A link that runs at one
/// rate (InfiniBand, an unshaped switch) measures none. The model spends
/// it step by step in the order of each collective's schedule, once per
/// collective (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    /// Bytes each direction of the link moves at the burst rate.
    pub bytes: f64,
    /// Seconds per byte of those.
    pub beta: f64,
}

impl NetLevel {
    /// β at a message of `m` bytes.
    pub fn beta_at(&self, m: f64) -> f64 {
        super::curve_time_at(&self.beta_curve, self.beta, m)
    }

    /// How much slower a two-way exchange moves each byte than one-way
    /// traffic, at the largest message both curves measured: `(bytes,
    /// two-way β / one-way β)`. About 1 on a full-duplex link; about 2 where
    /// the transport runs the two directions one after the other. `None`
    /// without both curves.
    pub fn two_way_slowdown(&self) -> Option<(f64, f64)> {
        self.oneway_curve.iter().rev().find_map(|one| {
            let two = self.beta_curve.iter().find(|c| c.bytes == one.bytes)?;
            (one.per_byte > 0.0 && two.per_byte > 0.0)
                .then(|| (one.bytes, two.per_byte / one.per_byte))
        })
    }
}
