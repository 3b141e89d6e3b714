//! How a layer is synchronized: the vocabulary that the cost model
//! ([`crate::cost`]) decides in and the engine ([`crate::sync`]) runs.
//! [`Strategy`] is a layer's strategy (dense, a sparse codec, GradiVeQ, or
//! the cost model's choice), with its text form ([`Strategy::parse`]);
//! [`SparseExchange`] is how the step's index/value units travel;
//! [`Pick`] is an option the user may leave to the cost model (`auto`) or
//! force (one runnable algorithm). Plain data, below both the decider and
//! the engine.

use crate::codec::{CodecConfig, RgcMethod};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How one layer is synchronized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "kebab-case")]
pub enum Strategy {
    /// Fused Rabenseifner allreduce of the full gradient.
    Dense,
    /// Residual compression with `codec`; `density` (when given) overrides
    /// the codec's own density (`rgc`, `rgc-quant`: `density`; `sbc`: `p`).
    Sparse {
        /// The codec.
        codec: CodecConfig,
        /// Fraction of elements sent, for codecs that have one.
        #[serde(default)]
        density: Option<f64>,
    },
    /// GradiVeQ ([`crate::gradiveq`]): the layer is aggregated by the
    /// compressed-domain ring, with its own schedule (warm-up, `L_t`
    /// QSGD-aggregated samples, `L_c` compressed steps, the eq.-7 loss
    /// monitor). Meant for convolution layers flattened by
    /// [`flatten_conv`](crate::gradiveq::flatten_conv); works on any layer
    /// of at least `K` elements. Not combinable with `delay > 1`.
    Gradiveq(crate::gradiveq::schedule::ScheduleConfig),
    /// PowerSGD ([`crate::powersgd`]): a rank-`r` approximation with error
    /// feedback, its factors `P` and `Q` in two fused allreduces of every
    /// PowerSGD layer of the step. A layer of fewer than two dimensions,
    /// or whose factors are not `min_rate` times smaller, is allreduced
    /// dense; so is every layer before step `start`. Not combinable with
    /// `delay > 1`.
    Powersgd(crate::powersgd::PowerSgdConfig),
    /// The step model's choice ([`crate::cost::plan_step`]) from
    /// `Config::profile`: `Dense`, RGC (`sparse-allgather`) or, with
    /// `Config::auto_quant`, quantized RGC, whichever adds least to the
    /// predicted step of the whole table on this communicator (the fused
    /// dense allreduce and the fused allgatherv each pay their α once).
    /// Resolved once, when the table is complete (the first step or a
    /// snapshot restore), logged, and visible in
    /// [`GradSync::layer`](crate::sync::GradSync::layer) (`Auto` until then),
    /// [`GradSync::auto_plan`](crate::sync::GradSync::auto_plan) and the step stats.
    Auto,
}

impl Strategy {
    /// RGC with trimmed top-k at `density`, RedSync's choice for mid-size layers.
    pub fn rgc(density: f64) -> Self {
        Strategy::Sparse {
            codec: CodecConfig::Rgc {
                density,
                method: RgcMethod::Trimmed,
            },
            density: None,
        }
    }
    /// Short label: `dense` or the codec name.
    pub fn label(&self) -> String {
        match self {
            Strategy::Dense => "dense".into(),
            Strategy::Sparse { codec, .. } => codec.name(),
            Strategy::Auto => "auto".into(),
            Strategy::Gradiveq(_) => "gradiveq".into(),
            Strategy::Powersgd(_) => "powersgd".into(),
        }
    }
}

impl Strategy {
    /// A strategy from text: `"dense"`, `"auto"` (the cost model's choice,
    /// which needs [`Config::profile`](crate::sync::Config::profile)), `"gradiveq"` with optional
    /// schedule parameters (`"gradiveq:k=768,d=96"` or `lambda=0.01`,
    /// `reuse`, `warmup`, `lt`, `lc`, `loss_threshold`, `qsgd_bits`,
    /// `qsgd_bucket`), or a codec string (`"rgc:density=0.001"`,
    /// `"3lc:s=1.75"`, `"qsgd:bits=4"`, ... as [`CodecConfig`] parses).
    ///
    /// A JSON object is a serialized [`Strategy`] (what
    /// [`GradSync::layer_strategy`](crate::sync::GradSync::layer_strategy) gives
    /// for a resolved layer), taken as it is.
    pub fn parse(spec: &str) -> Result<Strategy> {
        let spec = spec.trim();
        if spec.starts_with('{') {
            return serde_json::from_str(spec).map_err(|e| {
                Error::InvalidArgument(format!(
                    "strategy {spec:?} is not a serialized strategy: {e}"
                ))
            });
        }
        let (name, params) = spec.split_once(':').unwrap_or((spec, ""));
        match name.trim() {
            "" => Err(Error::InvalidArgument("empty strategy".into())),
            "dense" | "auto" if !params.trim().is_empty() => Err(Error::InvalidArgument(format!(
                "strategy {spec:?}: {name} takes no parameters"
            ))),
            "dense" => Ok(Strategy::Dense),
            "auto" => Ok(Strategy::Auto),
            "gradiveq" => parse_gradiveq(spec, params).map(Strategy::Gradiveq),
            "powersgd" => parse_powersgd(spec, params).map(Strategy::Powersgd),
            _ => spec
                .parse::<CodecConfig>()
                .map(|codec| Strategy::Sparse {
                    codec,
                    density: None,
                })
                .map_err(|e| {
                    Error::InvalidArgument(format!(
                        "strategy {spec:?} is not auto, dense, gradiveq, powersgd or a codec: {e}"
                    ))
                }),
        }
    }
}

/// A strategy's defaults as a JSON object and its `key=value` pairs.
type Params<'a> = (serde_json::Map<String, Value>, Vec<(&'a str, &'a str)>);

/// A strategy's parameters (`T`'s defaults as a JSON object) and its
/// `key=value` pairs (trimmed), or the error naming `spec` of a pair
/// without `=`.
fn defaults_and_pairs<'a, T: Default + Serialize>(
    spec: &str,
    params: &'a str,
) -> Result<Params<'a>> {
    let bad = |why: String| Error::InvalidArgument(format!("strategy {spec:?}: {why}"));
    let Value::Object(m) = serde_json::to_value(T::default())? else {
        return Err(bad("the defaults are not an object".into()));
    };
    let pairs = params
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| bad(format!("parameter {kv:?} is not key=value")))
        })
        .collect::<Result<_>>()?;
    Ok((m, pairs))
}

fn parse_gradiveq(spec: &str, params: &str) -> Result<crate::gradiveq::schedule::ScheduleConfig> {
    let bad = |why: String| Error::InvalidArgument(format!("strategy {spec:?}: {why}"));
    let (mut m, pairs) =
        defaults_and_pairs::<crate::gradiveq::schedule::ScheduleConfig>(spec, params)?;
    let mut seen: Vec<&str> = Vec::new();
    for (k, v) in pairs {
        // `d` and `lambda` both set the kept dimension.
        let slot = if k == "lambda" { "d" } else { k };
        if seen.contains(&slot) {
            return Err(bad(format!(
                "parameter {k:?} given twice (or both d and lambda)"
            )));
        }
        seen.push(slot);
        let num: Value = serde_json::from_str(v)
            .ok()
            .filter(Value::is_number)
            .ok_or_else(|| bad(format!("{k}={v:?} is not a number")))?;
        match k {
            "d" => m.insert("dim".into(), serde_json::json!({ "fixed": num })),
            "lambda" => m.insert("dim".into(), serde_json::json!({ "lambda": num })),
            "reuse" => m.insert("reuse".into(), num),
            k if m.contains_key(k) && k != "dim" => m.insert(k.into(), num),
            _ => return Err(bad(format!("unknown parameter {k:?}"))),
        };
    }
    serde_json::from_value(Value::Object(m)).map_err(|e| bad(e.to_string()))
}

/// `powersgd`'s `key=value` parameters over the defaults: `rank`,
/// `start`, `warm_start` (`true`/`false`), `min_rate`, `seed`.
fn parse_powersgd(spec: &str, params: &str) -> Result<crate::powersgd::PowerSgdConfig> {
    let bad = |why: String| Error::InvalidArgument(format!("strategy {spec:?}: {why}"));
    let (mut m, pairs) = defaults_and_pairs::<crate::powersgd::PowerSgdConfig>(spec, params)?;
    let mut seen: Vec<&str> = Vec::new();
    for (k, v) in pairs {
        if !m.contains_key(k) {
            return Err(bad(format!(
                "unknown parameter {k:?} (rank, start, warm_start, min_rate, seed)"
            )));
        }
        if seen.contains(&k) {
            return Err(bad(format!("parameter {k:?} given twice")));
        }
        seen.push(k);
        let want_bool = k == "warm_start";
        let val: Value = serde_json::from_str(v)
            .ok()
            .filter(|x: &Value| {
                if want_bool {
                    x.is_boolean()
                } else {
                    x.is_number()
                }
            })
            .ok_or_else(|| {
                let what = if want_bool {
                    "true or false"
                } else {
                    "a number"
                };
                bad(format!("{k}={v:?} is not {what}"))
            })?;
        m.insert(k.into(), val);
    }
    let c: crate::powersgd::PowerSgdConfig =
        serde_json::from_value(Value::Object(m)).map_err(|e| bad(e.to_string()))?;
    c.validate().map_err(|e| bad(e.to_string()))?;
    Ok(c)
}

/// How the sparse layers whose codec sends index/value pairs (RGC and
/// quantized RGC) are exchanged ([`Config::sparse_exchange`](crate::sync::Config::sparse_exchange)). Layers of
/// other codecs (fp16, QSGD, SBC, 3LC, ...) always go through the fused
/// allgatherv.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SparseExchange {
    /// Every sparse layer's unit in the ONE fused allgatherv (RedSync §4):
    /// every rank receives every rank's units, O(k·p) bytes per rank.
    #[default]
    Allgather,
    /// The index/value layers' pairs, over their concatenated index space,
    /// in ONE O(k) sparse allreduce ([`crate::sparse::sparse_allreduce`]:
    /// Ok-Topk's split-and-reduce, then an allgatherv of the reduced
    /// regions). The result is bitwise the allgather path's (each pair is
    /// scaled by `1/p` before the exact sum, which adds in rank order).
    Allreduce,
    /// As `Allreduce`, node-aware
    /// ([`crate::sparse::hierarchical_sparse_allreduce`]: the units merged
    /// per node, exchanged among the nodes' leaders, broadcast inside each
    /// node). Needs the ranks' nodes (an MPI communicator: ranks that share
    /// memory). Sums node by node, so equal to `Allreduce` up to the order
    /// of the additions (exactly for integers).
    Hierarchical,
}

impl std::str::FromStr for SparseExchange {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "allgather" => Ok(Self::Allgather),
            "allreduce" => Ok(Self::Allreduce),
            "hierarchical" => Ok(Self::Hierarchical),
            _ => Err(Error::InvalidArgument(format!(
                "unknown sparse exchange {s:?} (allgather, allreduce, hierarchical)"
            ))),
        }
    }
}

impl SparseExchange {
    /// Every exchange.
    pub const ALL: [SparseExchange; 3] = [
        SparseExchange::Allgather,
        SparseExchange::Allreduce,
        SparseExchange::Hierarchical,
    ];

    /// Name as used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Allgather => "allgather",
            Self::Allreduce => "allreduce",
            Self::Hierarchical => "hierarchical",
        }
    }
}

impl std::fmt::Display for SparseExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An option the user may leave to the cost model or force: the policy
/// layered on a mechanism enum ([`crate::dense::AllreduceAlgo`],
/// [`crate::dense::AllgathervAlgo`], [`SparseExchange`]), which holds only
/// what runs. `Auto` is the decision table's choice
/// ([`crate::cost::Tuning`]); `Fixed` masks the table to one candidate, and
/// one that cannot run in this job is an error naming why, never a silent
/// substitute. Text and JSON: `"auto"` or the algorithm's own name.
///
/// ```
/// use gradsync::dense::AllreduceAlgo;
/// use gradsync::strategy::Pick;
/// let p: Pick<AllreduceAlgo> = "ring".parse().unwrap();
/// assert_eq!(p, Pick::Fixed(AllreduceAlgo::Ring));
/// assert_eq!("auto".parse::<Pick<AllreduceAlgo>>().unwrap(), Pick::Auto);
/// assert_eq!(serde_json::to_string(&p).unwrap(), "\"ring\"");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Pick<T> {
    /// The decision table chooses, per step where its input changes.
    #[default]
    Auto,
    /// Forced by the user.
    Fixed(T),
}

impl<T: Copy> Pick<T> {
    /// The forced value, `None` for `Auto`.
    pub fn fixed(self) -> Option<T> {
        match self {
            Pick::Auto => None,
            Pick::Fixed(t) => Some(t),
        }
    }

    /// Whether the cost model chooses.
    pub fn is_auto(self) -> bool {
        matches!(self, Pick::Auto)
    }
}

impl<T: PartialEq + Copy> Pick<T> {
    /// Whether this forces `t`.
    pub fn is(self, t: T) -> bool {
        self == Pick::Fixed(t)
    }
}

impl<T> From<T> for Pick<T> {
    fn from(t: T) -> Self {
        Pick::Fixed(t)
    }
}

impl<T: std::fmt::Display> std::fmt::Display for Pick<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Pick::Auto => f.write_str("auto"),
            Pick::Fixed(t) => t.fmt(f),
        }
    }
}

impl<T: std::str::FromStr<Err = Error>> std::str::FromStr for Pick<T> {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(Pick::Auto);
        }
        // The mechanism's error lists its names in parentheses: `auto` joins them.
        s.parse().map(Pick::Fixed).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(match m.strip_suffix(')') {
                Some(head) => format!("{head}, auto)"),
                None => format!("{m} (or auto)"),
            }),
            e => e,
        })
    }
}

impl<T: Serialize> Serialize for Pick<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Pick::Auto => s.serialize_str("auto"),
            Pick::Fixed(t) => t.serialize(s),
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Pick<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{Error as _, IntoDeserializer};
        let s = String::deserialize(d)?;
        if s == "auto" {
            return Ok(Pick::Auto);
        }
        let de: serde::de::value::StringDeserializer<D::Error> = s.into_deserializer();
        T::deserialize(de)
            .map(Pick::Fixed)
            .map_err(|e| D::Error::custom(format!("{e}, or `auto`")))
    }
}
