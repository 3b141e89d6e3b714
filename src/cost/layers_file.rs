//! A layers file (`{"layers": [{"name": ..., "elements": ...}, ...]}` or a
//! bare array): the table `plan`, `scale` and `bench --op step` price.
//!
//! An entry may also give its tensor's `"shape"` (`[out, in, kh, kw]` for a
//! convolution, `[c]` for a bias): an array of non-negative integers whose
//! product must be `"elements"` (`[]` is a scalar, 1 element). It is the
//! matrix view PowerSGD prices: the first dimension by the product of the
//! rest, as PyTorch's `view(shape[0], -1)`. Without it a layer has no
//! matrix view (`None`).
//!
//! Read in one pass of serde_json's streaming parser into one small record
//! per entry, then checked entry by entry, so every error names the file,
//! the entry's index and name, and the field. A table of 10^6 layers is
//! read in a fraction of a second and holds about its names' and shapes'
//! bytes (not a JSON tree of the whole file).

use crate::{Error, Result};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt;

/// One entry of a layers file.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct LayerSpec {
    /// Layer (tensor) name.
    pub name: String,
    /// f32 elements.
    pub elements: usize,
    /// The tensor's shape, when the file gives it: its product is
    /// `elements` (checked by [`read_layers`]). PowerSGD prices the matrix
    /// `shape[0] × (product of the rest)`, as PyTorch's `view(shape[0], -1)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
}

/// Bytes of a layer of `n` f32 elements, or why it has no byte size
/// (`4·n` overflows).
pub fn layer_bytes(n: usize) -> std::result::Result<usize, String> {
    n.checked_mul(4).ok_or_else(|| {
        format!(
            "{n} f32 elements do not fit in memory (at most {} elements)",
            usize::MAX / 4
        )
    })
}

const SHAPE: &str =
    "expected {\"layers\": [{\"name\": ..., \"elements\": ...}, ...]} or a bare array";

/// Read a layers file. Every error ([`Error::File`]) names the file and,
/// for a bad entry, its index, its name when it has one, and the field. A
/// key given twice (`"name"`, `"elements"`, `"shape"`, `"layers"`) is an
/// error. A `"shape"` must hold exactly `"elements"` elements.
pub fn read_layers(path: &std::path::Path) -> Result<Vec<LayerSpec>> {
    let bad = |m: String| Error::file(path, m);
    // 64 MiB: a million layers and then some.
    let bytes = crate::error::read_small_file(path, 64 << 20, "layers file")?;
    let file: RawFile = serde_json::from_slice(&bytes).map_err(|e| {
        let e = e.to_string();
        if e.starts_with("duplicate field") {
            bad(format!("{e} (a key given twice)"))
        } else {
            bad(format!("not a layers file: {e}; {SHAPE}"))
        }
    })?;
    let entries = match file.layers {
        Some(Layers::Entries(e)) => e,
        Some(Layers::Other) if file.object => {
            return Err(bad(format!("\"layers\" is not an array; {SHAPE}")))
        }
        None if file.object => return Err(bad(format!("no \"layers\" field; {SHAPE}"))),
        _ => return Err(bad(format!("not a layers file; {SHAPE}"))),
    };
    let mut out = Vec::with_capacity(entries.len());
    let mut seen = std::collections::HashMap::with_capacity(entries.len());
    for (i, e) in entries.into_iter().enumerate() {
        let spec = e.check(i, &mut seen).map_err(bad)?;
        out.push(spec);
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
    if let Some(t) = file.total_elements {
        if t.as_u64().map(u128::from) != Some(sum) {
            return Err(bad(format!(
                "\"total_elements\" is {t}, but the layers hold {sum} elements"
            )));
        }
    }
    Ok(out)
}

/// The file as parsed: the top level's shape and what it holds.
#[derive(Default)]
struct RawFile {
    /// The top level is an object (else a bare array, or neither).
    object: bool,
    /// The entries (a bare array's, or the object's `"layers"`).
    layers: Option<Layers>,
    /// The object's `"total_elements"`, checked against the sum.
    total_elements: Option<Value>,
}

/// The value of `"layers"` (or the bare top level).
enum Layers {
    Entries(Vec<RawEntry>),
    /// Not an array.
    Other,
}

/// One entry as written; [`RawEntry::check`] says what is wrong with it.
#[derive(Default)]
struct RawEntry {
    /// The entry is a JSON object.
    object: bool,
    name: Option<Value>,
    elements: Option<Value>,
    shape: Option<Value>,
    /// The first key that is not `"name"`, `"elements"` or `"shape"`.
    unknown: Option<String>,
}

impl RawEntry {
    /// The layer, or why entry `i` is not one; `seen` maps names to the
    /// first entry that had them.
    fn check(
        self,
        i: usize,
        seen: &mut std::collections::HashMap<String, usize>,
    ) -> std::result::Result<LayerSpec, String> {
        if !self.object {
            return Err(format!(
                "layer {i}: not an object {{\"name\": ..., \"elements\": ...}}"
            ));
        }
        let name = match self.name {
            Some(Value::String(s)) => s,
            Some(other) => {
                return Err(format!(
                    "layer {i}: field \"name\" is {other}, not a string"
                ))
            }
            None => return Err(format!("layer {i}: missing field \"name\"")),
        };
        let at = format!("layer {i} ({name:?})");
        // A key this reader does not know (a "strategy", a misspelt
        // "elemets") would otherwise be ignored without a word.
        if let Some(k) = self.unknown {
            return Err(format!(
                "{at}: unknown field {k:?} (a layer has \"name\", \"elements\" and an \
                 optional \"shape\")"
            ));
        }
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(format!(
                "{at}: field \"name\" must be non-empty without control characters"
            ));
        }
        if let Some(j) = seen.insert(name.clone(), i) {
            return Err(format!(
                "{at}: the same name as layer {j} (names must be unique)"
            ));
        }
        let elements = match self.elements {
            Some(Value::Number(x)) => x
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| {
                    format!("{at}: field \"elements\" is {x}, not a non-negative integer")
                })?,
            Some(other) => {
                return Err(format!("{at}: field \"elements\" is {other}, not a number"))
            }
            None => return Err(format!("{at}: missing field \"elements\"")),
        };
        layer_bytes(elements).map_err(|m| format!("{at}: field \"elements\": {m}"))?;
        let shape = match self.shape {
            None => None,
            Some(v) => Some(check_shape(v, elements).map_err(|m| format!("{at}: {m}"))?),
        };
        Ok(LayerSpec {
            name,
            elements,
            shape,
        })
    }
}

/// The dimensions of a `"shape"` value, or why it is not the shape of a
/// tensor of `elements` elements (the message names the field).
fn check_shape(v: Value, elements: usize) -> std::result::Result<Vec<usize>, String> {
    let Value::Array(xs) = &v else {
        return Err(format!(
            "field \"shape\" is {v}, not an array of non-negative integers"
        ));
    };
    let mut dims = Vec::with_capacity(xs.len());
    for (k, x) in xs.iter().enumerate() {
        let d = x.as_u64().and_then(|d| usize::try_from(d).ok());
        let Some(d) = d else {
            return Err(format!(
                "field \"shape\" {v}: dimension {k} is {x}, not a non-negative integer"
            ));
        };
        dims.push(d);
    }
    let product = dims
        .iter()
        .try_fold(1usize, |p, &d| p.checked_mul(d))
        .ok_or_else(|| {
            format!(
                "field \"shape\" {dims:?}: the product of its dimensions overflows a 64-bit size"
            )
        })?;
    if product != elements {
        return Err(format!(
            "field \"shape\" {dims:?} holds {product} elements, \"elements\" is {elements}"
        ));
    }
    Ok(dims)
}

/// Consume any JSON value; `f` says what the caller makes of it. The
/// visitors below take every type (a wrong one is a record's finding, not
/// a parse error: the error then names the entry).
macro_rules! accept_scalars {
    ($value:ty, $f:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<$value, E> {
            Ok($f)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<$value, E> {
            Ok($f)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<$value, E> {
            Ok($f)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<$value, E> {
            Ok($f)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<$value, E> {
            Ok($f)
        }
        fn visit_unit<E: de::Error>(self) -> std::result::Result<$value, E> {
            Ok($f)
        }
    };
}

impl<'de> Deserialize<'de> for RawFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawFile;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(SHAPE)
            }
            accept_scalars!(RawFile, RawFile::default());
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                seq: A,
            ) -> std::result::Result<RawFile, A::Error> {
                Ok(RawFile {
                    layers: Some(Layers::Entries(entries(seq)?)),
                    ..RawFile::default()
                })
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawFile, A::Error> {
                let mut file = RawFile {
                    object: true,
                    ..RawFile::default()
                };
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "layers" if file.layers.is_some() => {
                            return Err(de::Error::duplicate_field("layers"))
                        }
                        "layers" => file.layers = Some(map.next_value()?),
                        "total_elements" => file.total_elements = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(file)
            }
        }
        d.deserialize_any(V)
    }
}

/// Every element of `seq` as a [`RawEntry`].
fn entries<'de, A: SeqAccess<'de>>(mut seq: A) -> std::result::Result<Vec<RawEntry>, A::Error> {
    let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
    while let Some(e) = seq.next_element()? {
        out.push(e);
    }
    Ok(out)
}

impl<'de> Deserialize<'de> for Layers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Layers;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of layers")
            }
            accept_scalars!(Layers, Layers::Other);
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> std::result::Result<Layers, A::Error> {
                Ok(Layers::Entries(entries(seq)?))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> std::result::Result<Layers, A::Error> {
                IgnoredAny.visit_map(map)?;
                Ok(Layers::Other)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for RawEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEntry;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a layer {\"name\": ..., \"elements\": ...}")
            }
            accept_scalars!(RawEntry, RawEntry::default());
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                seq: A,
            ) -> std::result::Result<RawEntry, A::Error> {
                IgnoredAny.visit_seq(seq)?;
                Ok(RawEntry::default())
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawEntry, A::Error> {
                let mut e = RawEntry {
                    object: true,
                    ..RawEntry::default()
                };
                while let Some(k) = map.next_key::<String>()? {
                    let (field, slot) = match k.as_str() {
                        "name" => ("name", &mut e.name),
                        "elements" => ("elements", &mut e.elements),
                        "shape" => ("shape", &mut e.shape),
                        _ => {
                            if e.unknown.is_none() {
                                e.unknown = Some(k);
                            }
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    if slot.is_some() {
                        return Err(de::Error::duplicate_field(field));
                    }
                    *slot = Some(map.next_value()?);
                }
                Ok(e)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Vec<LayerSpec>> {
        let d = std::env::temp_dir().join(format!(
            "gradsync-layers-{}-{:x}",
            std::process::id(),
            text.len() * 7919 + text.bytes().map(usize::from).sum::<usize>()
        ));
        std::fs::write(&d, text).unwrap();
        let r = read_layers(&d);
        std::fs::remove_file(&d).ok();
        r
    }

    #[test]
    fn shapes_and_errors_name_the_entry_and_field() {
        let ok =
            read(r#"[{"name": "a", "elements": 3}, {"elements": 0, "name": "b\u0041"}]"#).unwrap();
        assert_eq!(
            ok.iter()
                .map(|l| (l.name.as_str(), l.elements))
                .collect::<Vec<_>>(),
            [("a", 3), ("bA", 0)]
        );
        let ok = read(r#"{"model": {"x": [1, 2]}, "layers": [{"name": "c", "elements": 5}], "total_elements": 5}"#).unwrap();
        assert_eq!((ok.len(), ok[0].elements), (1, 5));
        for (text, want) in [
            ("5", "not a layers file; expected"),
            (r#""layers""#, "not a layers file; expected"),
            ("[1, 2", "not a layers file: EOF"),
            (r#"{"layers": {"a": 1}}"#, "\"layers\" is not an array"),
            (r#"{"layers": 3}"#, "\"layers\" is not an array"),
            (r#"{"tables": []}"#, "no \"layers\" field"),
            ("[]", "no layers"),
            (r#"[[1, 2]]"#, "layer 0: not an object"),
            (
                r#"[{"name": "a", "elements": 1}, null]"#,
                "layer 1: not an object",
            ),
            (
                r#"[{"name": 7, "elements": 1}]"#,
                "layer 0: field \"name\" is 7, not a string",
            ),
            (r#"[{"elements": 1}]"#, "layer 0: missing field \"name\""),
            (
                r#"[{"name": "a", "elements": 1, "strategy": "x"}]"#,
                "layer 0 (\"a\"): unknown field \"strategy\"",
            ),
            (r#"[{"name": "", "elements": 1}]"#, "must be non-empty"),
            (
                r#"[{"name": "a", "elements": 1}, {"name": "a", "elements": 2}]"#,
                "layer 1 (\"a\"): the same name as layer 0",
            ),
            (
                r#"[{"name": "a", "elements": -1}]"#,
                "is -1, not a non-negative integer",
            ),
            (
                r#"[{"name": "a", "elements": 1.5}]"#,
                "is 1.5, not a non-negative integer",
            ),
            (
                r#"[{"name": "a", "elements": "9"}]"#,
                "is \"9\", not a number",
            ),
            (
                r#"[{"name": "a"}]"#,
                "layer 0 (\"a\"): missing field \"elements\"",
            ),
            (
                r#"[{"name": "a", "elements": 0}]"#,
                "every layer has 0 elements",
            ),
            (
                r#"[{"name": "a", "name": "b", "elements": 1}]"#,
                "duplicate field `name`",
            ),
            (
                r#"[{"name": "a", "elements": 1, "elements": 2}]"#,
                "duplicate field `elements`",
            ),
            (r#"{"layers": 5, "layers": []}"#, "duplicate field `layers`"),
            (
                r#"[{"name": "a", "elements": 1, "shape": [1], "shape": [1]}]"#,
                "duplicate field `shape`",
            ),
            (
                r#"{"total_elements": 2, "layers": [{"name": "a", "elements": 1}]}"#,
                "\"total_elements\" is 2, but the layers hold 1",
            ),
        ] {
            let e = read(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
            assert!(e.contains("gradsync-layers-"), "the file is named: {e}");
        }
    }

    #[test]
    fn shape_is_read_and_checked_against_elements() {
        let ok = read(
            r#"{"layers": [
                {"name": "conv.weight", "shape": [64, 3, 7, 7], "elements": 9408},
                {"name": "bn.bias", "elements": 64, "shape": [64]},
                {"name": "t", "elements": 1, "shape": []},
                {"name": "e", "elements": 0, "shape": [0, 5]},
                {"name": "fc.weight", "elements": 50}
            ]}"#,
        )
        .unwrap();
        let shapes: Vec<_> = ok.iter().map(|l| l.shape.clone()).collect();
        assert_eq!(
            shapes,
            [
                Some(vec![64, 3, 7, 7]),
                Some(vec![64]),
                Some(vec![]),
                Some(vec![0, 5]),
                None
            ]
        );
        // Written back, an absent shape stays absent.
        let back = serde_json::to_string(&ok[4..]).unwrap();
        assert_eq!(back, r#"[{"name":"fc.weight","elements":50}]"#);
        let back = serde_json::to_string(&ok[..1]).unwrap();
        assert_eq!(
            back,
            r#"[{"name":"conv.weight","elements":9408,"shape":[64,3,7,7]}]"#
        );

        let big = format!("[{}, {}, 2]", u64::MAX / 2 + 1, 2);
        for (text, want) in [
            (
                r#"[{"name": "ok", "elements": 1}, {"name": "fc.weight", "elements": 60, "shape": [10, 5]}]"#.to_string(),
                r#"layer 1 ("fc.weight"): field "shape" [10, 5] holds 50 elements, "elements" is 60"#.to_string(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": 6}]"#.into(),
                r#"layer 0 ("a"): field "shape" is 6, not an array of non-negative integers"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": "2x3"}]"#.into(),
                r#"layer 0 ("a"): field "shape" is "2x3", not an array"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": {"0": 6}}]"#.into(),
                r#"layer 0 ("a"): field "shape" is {"0":6}, not an array"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": [-2, -3]}]"#.into(),
                r#"layer 0 ("a"): field "shape" [-2,-3]: dimension 0 is -2, not a non-negative integer"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": [2, 3.0]}]"#.into(),
                r#"layer 0 ("a"): field "shape" [2,3.0]: dimension 1 is 3.0, not a non-negative integer"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": [2, "3"]}]"#.into(),
                r#"layer 0 ("a"): field "shape" [2,"3"]: dimension 1 is "3", not a non-negative integer"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": [[2, 3]]}]"#.into(),
                r#"layer 0 ("a"): field "shape" [[2,3]]: dimension 0 is [2,3], not a non-negative integer"#.into(),
            ),
            (
                format!(r#"[{{"name": "a", "elements": 6, "shape": {big}}}]"#),
                r#"layer 0 ("a"): field "shape" ["#.to_string() + &format!("{}, 2, 2]: the product of its dimensions overflows", u64::MAX / 2 + 1),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": []}]"#.into(),
                r#"layer 0 ("a"): field "shape" [] holds 1 elements, "elements" is 6"#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": [2, 3], "shape": [6]}]"#.into(),
                "duplicate field `shape`".into(),
            ),
            (
                r#"[{"name": "a", "shape": [2, 3]}]"#.into(),
                r#"layer 0 ("a"): missing field "elements""#.into(),
            ),
            (
                r#"[{"name": "a", "elements": 6, "shape": [2, 3], "dims": [6]}]"#.into(),
                r#"layer 0 ("a"): unknown field "dims" (a layer has "name", "elements" and an optional "shape")"#.into(),
            ),
        ] {
            let e = read(&text).unwrap_err().to_string();
            assert!(e.contains(&want), "{text}: {e}");
            assert!(e.contains("gradsync-layers-"), "the file is named: {e}");
        }
    }
}
