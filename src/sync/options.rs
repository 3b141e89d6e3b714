//! Engine options and layer strategies as text and flat JSON: the one place
//! where the C ABI's `config_json` and the Python package's keyword
//! arguments become a [`Config`] and a [`Strategy`], so the two bindings
//! accept exactly the same options with the same errors.
//!
//! Options are a flat JSON object. Every [`Config`] field is accepted in its
//! serde form (`compress_threshold`, `weight_decay`, `clip_norm`, `delay`,
//! `allgather`, `allreduce`, `sparse_exchange`, `overlap`, `auto_density`,
//! ...), plus the spellings a training script uses:
//!
//! | key | value |
//! |---|---|
//! | `momentum`, `nesterov` | number, bool |
//! | `warmup_steps` | dense steps before sparse ones (RedSync §5.6) |
//! | `nonfinite` | `"error"` or `"propagate"` |
//! | `codec` | a codec string (`"rgc:density=0.001"`) or its JSON object |
//! | `profile` | a path to a `gradsync calibrate` profile, or the profile object |
//!
//! ```
//! use gradsync::sync::{Config, Strategy};
//! let cfg = Config::from_options_json(
//!     r#"{"momentum": 0.9, "warmup_steps": 5, "codec": "rgc:density=0.01"}"#,
//! ).unwrap();
//! assert_eq!(cfg.momentum, 0.9);
//! assert!(Config::from_options_json(r#"{"momentun": 0.9}"#).is_err());
//! assert_eq!(Strategy::parse("dense").unwrap(), Strategy::Dense);
//! ```

use super::{Config, NonFinitePolicy, Warmup};
use crate::codec::CodecConfig;
use crate::{Error, Result};
use serde_json::{Map, Value};

impl Config {
    /// A [`Config`] from a flat JSON object of options, as the C ABI's
    /// `config_json` and the Python package's keyword arguments give them;
    /// an empty string or `null` gives the defaults. Every [`Config`] field
    /// is accepted in its serde form (`compress_threshold`, `weight_decay`,
    /// `clip_norm`, `delay`, `allgather`, `allreduce`, `sparse_exchange`,
    /// `overlap`, `auto_density`, ...), plus `warmup_steps` (dense steps first),
    /// `nonfinite` (`"error"` or `"propagate"`), `codec` as a codec string
    /// (`"rgc:density=0.001"`) and `profile` as a path to a `gradsync
    /// calibrate` profile (or the profile object, checked as a file is).
    /// Unknown keys and values of the wrong type are errors naming the key.
    pub fn from_options_json(json: &str) -> Result<Config> {
        if json.trim().is_empty() {
            return Ok(Config::default());
        }
        let v: Value = serde_json::from_str(json)
            .map_err(|e| Error::InvalidArgument(format!("options are not JSON: {e}")))?;
        // A key given twice: the parsed object keeps the last silently.
        if let Ok(TopKeys(keys)) = serde_json::from_str::<TopKeys>(json) {
            if let Some(k) = keys
                .iter()
                .enumerate()
                .find(|(i, k)| keys[..*i].contains(k))
                .map(|(_, k)| k)
            {
                return Err(Error::InvalidArgument(format!(
                    "option {k:?} is given twice"
                )));
            }
        }
        match v {
            Value::Null => Ok(Config::default()),
            Value::Object(m) => Config::from_options(&m),
            other => Err(Error::InvalidArgument(format!(
                "options must be a JSON object, got {other}"
            ))),
        }
    }

    /// [`from_options_json`](Self::from_options_json) on a parsed object.
    pub fn from_options(opts: &Map<String, Value>) -> Result<Config> {
        let Value::Object(mut cfg) = serde_json::to_value(Config::default())? else {
            return Err(Error::InvalidArgument("Config is not an object".into()));
        };
        let mut known: Vec<String> = cfg.keys().cloned().collect();
        // Serialized only when not the default (it keeps the options' JSON,
        // and the table hash, as they were before the option existed).
        for k in ["sparse_exchange", "progress_poll_us", "auto_powersgd"] {
            if !known.iter().any(|n| n == k) {
                known.push(k.to_string());
            }
        }
        if opts.contains_key("warmup_steps") && opts.contains_key("warmup") {
            return Err(Error::InvalidArgument(
                "give warmup_steps or warmup, not both".into(),
            ));
        }
        if opts.contains_key("nonfinite") && opts.contains_key("non_finite") {
            return Err(Error::InvalidArgument(
                "give nonfinite or non_finite, not both".into(),
            ));
        }
        for (k, v) in opts {
            let bad = |why: String| Error::InvalidArgument(format!("option {k:?}: {why}"));
            let (key, val) = match k.as_str() {
                "warmup_steps" => {
                    let steps = v
                        .as_u64()
                        .ok_or_else(|| bad(format!("{v} is not a whole number of steps")))?;
                    let w = if steps == 0 {
                        Warmup::None
                    } else {
                        Warmup::Dense { steps }
                    };
                    ("warmup", serde_json::to_value(w)?)
                }
                "nonfinite" | "non_finite" => {
                    let p = match v.as_str() {
                        Some("error") => NonFinitePolicy::Error,
                        Some("propagate") => NonFinitePolicy::Propagate,
                        _ => return Err(bad(format!("{v} is not \"error\" or \"propagate\""))),
                    };
                    ("non_finite", serde_json::to_value(p)?)
                }
                "codec" => match v {
                    Value::String(s) => {
                        let c: CodecConfig = s.parse().map_err(|e: Error| bad(e.to_string()))?;
                        ("codec", serde_json::to_value(c)?)
                    }
                    other => ("codec", other.clone()),
                },
                "profile" => match v {
                    Value::String(path) => {
                        let p = crate::cost::Profile::load(path)?;
                        ("profile", serde_json::to_value(p)?)
                    }
                    Value::Null => ("profile", Value::Null),
                    // A profile given inline gets the checks a file gets.
                    other => {
                        let p: crate::cost::Profile = serde_json::from_value(other.clone())
                            .map_err(|e| bad(format!("not a gradsync profile: {e}")))?;
                        p.validate().map_err(|e| bad(format!("bad profile: {e}")))?;
                        ("profile", serde_json::to_value(p)?)
                    }
                },
                "allgather" => match v {
                    // Accept the command line's name too.
                    Value::String(s) if s == "recursive-doubling" => {
                        ("allgather", Value::String("recdbl".into()))
                    }
                    other => ("allgather", other.clone()),
                },
                "momentum" | "weight_decay" | "clip_norm" => {
                    single_precision(k, v)?;
                    (k.as_str(), v.clone())
                }
                key if known.iter().any(|n| n == key) => (key, v.clone()),
                _ => {
                    return Err(bad(format!(
                        "unknown option (known: {}, warmup_steps, nonfinite)",
                        known.join(", ")
                    )))
                }
            };
            // Each value alone, so that the error names its key.
            let mut probe = Map::new();
            probe.insert(key.to_string(), val.clone());
            serde_json::from_value::<Config>(Value::Object(probe))
                .map_err(|e| bad(format!("{e}")))?;
            cfg.insert(key.to_string(), val);
        }
        serde_json::from_value(Value::Object(cfg))
            .map_err(|e| Error::InvalidArgument(format!("options: {e}")))
    }
}

/// The f32 options (`momentum`, `weight_decay`, `clip_norm`) checked as
/// the caller wrote them: a value that single precision turns into
/// something else in kind (0, infinity, or a momentum of exactly 1) is an
/// error naming what was given, not a message about the rounded value.
fn single_precision(key: &str, v: &Value) -> Result<()> {
    let Some(x) = v.as_f64() else {
        return Ok(()); // not a number: the type check names it
    };
    let r = x as f32;
    let why = if r.is_infinite() {
        "is past single precision's range (these options are f32)"
    } else if r == 0.0 && x != 0.0 {
        "is below single precision's smallest value (these options are f32)"
    } else if key == "momentum" && x < 1.0 && r >= 1.0 {
        "rounds to 1 in single precision; momentum must lie in [0, 1)"
    } else {
        return Ok(());
    };
    Err(Error::InvalidArgument(format!("option {key:?}: {v} {why}")))
}

/// The keys of a JSON object, in order, duplicates kept (values skipped).
struct TopKeys(Vec<String>);

impl<'de> serde::Deserialize<'de> for TopKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TopKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<TopKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    m.next_value::<serde::de::IgnoredAny>()?;
                    keys.push(k);
                }
                Ok(TopKeys(keys))
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {

    /// The decision table's own default policy is the default options'
    /// (a table built without `with_policy` plans as the engine would).
    #[test]
    fn the_default_policy_is_the_default_options() {
        assert_eq!(
            crate::cost::LayerPolicy::default(),
            crate::sync::Config::default().policy()
        );
    }

    use super::*;
    use crate::strategy::Strategy;

    #[test]
    fn options_map_onto_config() {
        let c = Config::from_options_json(
            r#"{"momentum": 0.9, "nesterov": true, "warmup_steps": 3, "nonfinite": "propagate",
                "codec": "3lc:s=1.75", "compress_threshold": 10, "allreduce": "ring",
                "allgather": "mpi", "delay": 2, "clip_norm": 1.5}"#,
        )
        .unwrap();
        assert_eq!(c.momentum, 0.9);
        assert!(c.nesterov);
        assert_eq!(c.warmup, Warmup::Dense { steps: 3 });
        assert_eq!(c.non_finite, NonFinitePolicy::Propagate);
        assert_eq!(c.codec, "3lc:s=1.75".parse().unwrap());
        assert_eq!(c.compress_threshold, 10);
        assert!(c.allreduce.is(crate::dense::AllreduceAlgo::Ring));
        assert!(c.allgather.is(crate::dense::AllgathervAlgo::Mpi));
        assert_eq!(c.delay, 2);
        assert_eq!(c.clip_norm, Some(1.5));
        assert_eq!(Config::from_options_json("").unwrap(), Config::default());
        assert_eq!(
            Config::from_options_json("null").unwrap(),
            Config::default()
        );
    }

    /// Every `Config` field is an option, those serialized only when not
    /// the default too (`auto_powersgd` was not, and Python and C could
    /// not set it): a value of the wrong type is refused naming the key,
    /// never as an unknown option.
    #[test]
    fn every_config_field_is_an_option() {
        let src = include_str!("config.rs");
        let body = &src[src.find("pub struct Config {").expect("Config")..];
        let body = &body[..body.find("\n}").expect("end of Config")];
        let fields: Vec<&str> = body
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub "))
            .filter_map(|l| l.split_once(':').map(|(name, _)| name.trim()))
            .filter(|name| !name.contains(' '))
            .collect();
        assert!(fields.len() >= 17, "{fields:?}");
        for f in &fields {
            let e = Config::from_options_json(&format!(r#"{{"{f}": [1, 2]}}"#))
                .expect_err(f)
                .to_string();
            assert!(!e.contains("unknown option") && e.contains(f), "{f}: {e}");
        }
        let c = Config::from_options_json(r#"{"auto_powersgd": 2}"#).unwrap();
        assert_eq!(c.auto_powersgd, 2);
    }

    #[test]
    fn bad_options_name_the_key() {
        for (json, needle) in [
            (r#"{"momentun": 0.9}"#, "\"momentun\""),
            (r#"{"momentum": "high"}"#, "\"momentum\""),
            (r#"{"warmup_steps": -1}"#, "\"warmup_steps\""),
            (r#"{"nonfinite": "ignore"}"#, "\"nonfinite\""),
            (r#"{"codec": "rgc:density=x"}"#, "\"codec\""),
            (r#"{"allreduce": "tree"}"#, "\"allreduce\""),
            (r#"{"profile": {"alpha": -1}}"#, "\"profile\""),
            (
                r#"{"profile": "/nonexistent/p.json"}"#,
                "/nonexistent/p.json",
            ),
            (
                r#"{"warmup_steps": 1, "warmup": {"warmup": "none"}}"#,
                "not both",
            ),
            ("[1]", "object"),
            (
                r#"{"momentum": 0.9, "momentum": 0.1}"#,
                "\"momentum\" is given twice",
            ),
            ("{", "JSON"),
            (r#"{"momentum": 0.99999999}"#, "0.99999999 rounds to 1"),
            (r#"{"clip_norm": 1e-50}"#, "is below single precision"),
            (r#"{"weight_decay": 1e39}"#, "past single precision's range"),
        ] {
            let e = Config::from_options_json(json).unwrap_err().to_string();
            assert!(e.contains(needle), "{json}: {e}");
        }
    }

    #[test]
    fn strategies_parse() {
        assert_eq!(Strategy::parse("dense").unwrap(), Strategy::Dense);
        assert_eq!(Strategy::parse(" auto ").unwrap(), Strategy::Auto);
        assert_eq!(
            Strategy::parse("rgc:density=0.001").unwrap(),
            Strategy::Sparse {
                codec: "rgc:density=0.001".parse().unwrap(),
                density: None
            }
        );
        let Strategy::Gradiveq(g) = Strategy::parse("gradiveq:k=64,d=8,lt=10").unwrap() else {
            panic!("not gradiveq")
        };
        assert_eq!((g.k, g.dim, g.lt), (64, crate::gradiveq::Dim::Fixed(8), 10));
        assert!(matches!(
            Strategy::parse("gradiveq").unwrap(),
            Strategy::Gradiveq(_)
        ));
        for bad in [
            "",
            "dense:x=1",
            "gradiveq:k=x",
            "gradiveq:dim=3",
            "nope",
            "rgc:foo=1",
        ] {
            assert!(Strategy::parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
