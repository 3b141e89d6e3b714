//! `gradsync codecs`: compression ratio, error and throughput of every codec on
//! a real tensor (`--input FILE.npy`, f32 or f64, any shape) or a synthetic
//! one. With `--steps`, the leading axis is a sequence of steps fed through
//! error feedback, and errors compare the running sums (what training sees).
//! Throughput is GB/s of f32 input, median of repeated single-threaded runs.
//! A codec that fails is reported in its own row (`error` in the JSON line,
//! the `error` column of the table) and the others still run; the exit status
//! is 1 if any failed. Peak memory is about 3x the tensor's f32 bytes (input,
//! message, one decoded tensor) plus what a codec itself allocates.

use crate::calibrate::synthetic;
use crate::codec::{CodecConfig, ErrorFeedback};
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// Arguments of `gradsync codecs`.
#[derive(clap::Args, Debug, Clone)]
pub struct CodecsArgs {
    /// Input tensor (.npy, f32 or f64, any shape).
    #[arg(long, conflicts_with = "synthetic")]
    pub input: Option<std::path::PathBuf>,
    /// With --input: treat the leading axis as steps fed through error feedback (use the first N steps).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Synthetic tensor of N elements (K/M/G suffixes: powers of 1024).
    #[arg(long, value_parser = |v: &str| super::parse_size(v).map_err(|e| e.to_string()))]
    pub synthetic: Option<usize>,
    /// Distribution of the synthetic tensor: normal, laplace or zeros.
    #[arg(long, default_value = "normal")]
    pub dist: String,
    /// Seed of the synthetic tensor.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Codecs, e.g. `3lc:s=1.75,rgc:density=0.001,none` (`;` also separates), default all.
    #[arg(long)]
    pub codecs: Option<String>,
    /// One JSON object per codec.
    #[arg(long)]
    pub json: bool,
}

/// One line of `gradsync codecs --json`.
#[derive(Serialize, Debug, Clone)]
pub struct CodecRecord {
    /// Codec name.
    pub codec: String,
    /// Parameters (`key=value,...`).
    pub params: String,
    /// Elements per step.
    pub elements: usize,
    /// Steps fed (1 without --steps).
    pub steps: usize,
    /// Input bytes (f32), all steps.
    pub bytes_in: usize,
    /// Encoded bytes, headers included, all steps.
    pub bytes_out: usize,
    /// bytes_in / bytes_out.
    pub ratio: f64,
    /// 8 · bytes_out / (elements · steps).
    pub bits_per_value: f64,
    /// ‖decoded − input‖₂ / ‖input‖₂ (of the running sums with --steps).
    pub rel_l2_error: f64,
    /// max |decoded − input| (of the running sums with --steps).
    pub max_abs_error: f64,
    /// Encode throughput, GB/s of f32 input.
    pub encode_gbps: f64,
    /// Decode throughput, GB/s of f32 output.
    pub decode_gbps: f64,
    /// Always `null` here; a codec that failed prints a `CodecFailure`
    /// line (same `codec`, `params`, `elements`, `steps`, and the message).
    pub error: Option<String>,
}

/// Read a .npy of f32 or f64 (any shape, either byte order, C or Fortran
/// order) as (shape, f32 data in C order).
///
/// The header's shape is checked against the file size (overflow-checked)
/// before anything is allocated, f64 data is converted while it is read (one
/// f32 copy in memory, never an f64 one), and every error names the file.
pub fn read_npy(path: &std::path::Path) -> Result<(Vec<usize>, Vec<f32>)> {
    use std::io::Read;
    let name = path.display();
    let bad = |what: String| Error::InvalidArgument(format!("{name}: {what}"));
    let io = |e: std::io::Error| Error::Io(std::io::Error::new(e.kind(), format!("{name}: {e}")));
    let eof = |e: std::io::Error, what: &str| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            bad(format!("file ends inside the {what}"))
        } else {
            io(e)
        }
    };
    if let Some(kind) = crate::error::special_file(path) {
        return Err(bad(format!("not a regular file ({kind}): not a .npy file")));
    }
    let mut f = std::fs::File::open(path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    let mut pre = [0u8; 8];
    f.read_exact(&mut pre)
        .map_err(|e| eof(e, ".npy preamble"))?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file (bad magic)".into()));
    }
    let (header_len, prefix) = match pre[6] {
        1 => {
            let mut l = [0u8; 2];
            f.read_exact(&mut l).map_err(|e| eof(e, ".npy preamble"))?;
            (u64::from(u16::from_le_bytes(l)), 10u64)
        }
        2 | 3 => {
            let mut l = [0u8; 4];
            f.read_exact(&mut l).map_err(|e| eof(e, ".npy preamble"))?;
            (u64::from(u32::from_le_bytes(l)), 12u64)
        }
        v => return Err(bad(format!("unsupported .npy format version {v}"))),
    };
    let data_off = prefix + header_len;
    if data_off > file_len {
        return Err(bad(format!(
            "header of {header_len} bytes is longer than the file ({file_len} bytes)"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .map_err(|e| eof(e, ".npy header"))?;
    let header = String::from_utf8_lossy(&header);
    let h = parse_npy_header(&header).map_err(|e| bad(format!("bad .npy header: {e}")))?;
    let (little, size) = match h.descr.as_str() {
        "<f4" | "=f4" => (true, 4usize),
        ">f4" => (false, 4),
        "<f8" | "=f8" => (true, 8),
        ">f8" => (false, 8),
        d => {
            return Err(bad(format!(
                "dtype {d:?} is not supported (float32 or float64)"
            )))
        }
    };
    let count = h
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {:?} has too many elements", h.shape)))?;
    let data_len = file_len - data_off;
    if count.checked_mul(size).is_none_or(|b| b as u64 != data_len) {
        return Err(bad(format!(
            "header says shape {:?} of {} ({count} elements, {} bytes of data), but the file has {data_len} bytes of data",
            h.shape,
            h.descr,
            count as u128 * size as u128
        )));
    }
    let mut data: Vec<f32> = Vec::new();
    data.try_reserve_exact(count)
        .map_err(|e| bad(format!("cannot allocate {count} f32: {e}")))?;
    // Convert in 1 MiB chunks.
    let mut buf = vec![0u8; (1 << 20) / size * size];
    let mut left = count * size;
    while left > 0 {
        let chunk = &mut buf[..left.min(1 << 20) / size * size];
        f.read_exact(chunk).map_err(|e| eof(e, "data"))?;
        left -= chunk.len();
        if size == 4 {
            data.extend(chunk.chunks_exact(4).map(|c| {
                let b: [u8; 4] = c.try_into().expect("4 bytes");
                if little {
                    f32::from_le_bytes(b)
                } else {
                    f32::from_be_bytes(b)
                }
            }));
        } else {
            for c in chunk.chunks_exact(8) {
                let b: [u8; 8] = c.try_into().expect("8 bytes");
                let v = if little {
                    f64::from_le_bytes(b)
                } else {
                    f64::from_be_bytes(b)
                };
                if v.is_finite() && v.abs() > f64::from(f32::MAX) {
                    return Err(bad(format!(
                        "element {} = {v:e} is beyond the f32 range",
                        data.len()
                    )));
                }
                data.push(v as f32);
            }
        }
    }
    if h.fortran_order && h.shape.len() > 1 {
        data = fortran_to_c(&h.shape, &data);
    }
    Ok((h.shape, data))
}

/// The fields of a .npy header dictionary.
#[derive(Debug, PartialEq)]
struct NpyHeader {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// Parse `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`.
fn parse_npy_header(s: &str) -> std::result::Result<NpyHeader, String> {
    let b = s.trim_end_matches(['\n', ' ', '\0']).as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let expect = |i: &mut usize, c: u8| -> std::result::Result<(), String> {
        ws(i);
        if b.get(*i) == Some(&c) {
            *i += 1;
            Ok(())
        } else {
            Err(format!("expected {:?} at offset {}", c as char, *i))
        }
    };
    let string = |i: &mut usize| -> std::result::Result<String, String> {
        ws(i);
        let q = *b.get(*i).ok_or("unexpected end")?;
        if q != b'\'' && q != b'"' {
            return Err(format!("expected a string at offset {}", *i));
        }
        let start = *i + 1;
        let len = b[start..]
            .iter()
            .position(|&c| c == q)
            .ok_or("unterminated string")?;
        *i = start + len + 1;
        Ok(String::from_utf8_lossy(&b[start..start + len]).into_owned())
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    expect(&mut i, b'{')?;
    loop {
        ws(&mut i);
        if b.get(i) == Some(&b'}') {
            break;
        }
        let key = string(&mut i)?;
        expect(&mut i, b':')?;
        ws(&mut i);
        match key.as_str() {
            "descr" => descr = Some(string(&mut i)?),
            "fortran_order" => {
                let v = if b[i..].starts_with(b"True") {
                    true
                } else if b[i..].starts_with(b"False") {
                    false
                } else {
                    return Err("fortran_order is not True or False".into());
                };
                i += if v { 4 } else { 5 };
                fortran = Some(v);
            }
            "shape" => {
                expect(&mut i, b'(')?;
                let end = i + b[i..]
                    .iter()
                    .position(|&c| c == b')')
                    .ok_or("unterminated shape")?;
                let dims = std::str::from_utf8(&b[i..end])
                    .map_err(|_| "shape is not text")?
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(|d| {
                        d.trim_end_matches('L')
                            .parse::<usize>()
                            .map_err(|_| format!("shape dimension {d:?} is not a size"))
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                i = end + 1;
                shape = Some(dims);
            }
            k => return Err(format!("unknown key {k:?}")),
        }
        ws(&mut i);
        if b.get(i) == Some(&b',') {
            i += 1;
        }
    }
    Ok(NpyHeader {
        descr: descr.ok_or("no 'descr'")?,
        fortran_order: fortran.ok_or("no 'fortran_order'")?,
        shape: shape.ok_or("no 'shape'")?,
    })
}

/// Reorder Fortran-order `data` of `shape` into C order.
fn fortran_to_c(shape: &[usize], data: &[f32]) -> Vec<f32> {
    let mut strides = vec![1usize; shape.len()];
    for j in 1..shape.len() {
        strides[j] = strides[j - 1] * shape[j - 1];
    }
    let mut out = Vec::with_capacity(data.len());
    let mut idx = vec![0usize; shape.len()];
    let mut off = 0;
    for _ in 0..data.len() {
        out.push(data[off]);
        for j in (0..shape.len()).rev() {
            idx[j] += 1;
            off += strides[j];
            if idx[j] < shape[j] {
                break;
            }
            off -= strides[j] * shape[j];
            idx[j] = 0;
        }
    }
    out
}

fn median_time(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < 0.3 && times.len() < 50) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Measure one codec on `steps` (each a tensor of the same length).
///
/// Memory: besides the input, one decoded f32 tensor and the codec's message
/// (plus, with `feedback`, the error-feedback state of one step). Errors are
/// streamed: the running sum of the steps is formed block by block, and the
/// decoded buffer is reused for the decode timing.
pub fn measure(cfg: &CodecConfig, steps: &[&[f32]], feedback: bool) -> Result<CodecRecord> {
    let n = steps.first().map_or(0, |s| s.len());
    if let Some(s) = steps.iter().find(|s| s.len() != n) {
        return Err(Error::InvalidArgument(format!(
            "steps have {} and {n} elements",
            s.len()
        )));
    }
    let mut codec = Some(cfg.build()?);
    // Decoding is stateless: a separate instance, so the encoder (and its
    // scratch, up to one f32 per element for the selection codecs) can be
    // dropped before the decoded tensor is touched.
    let decoder = cfg.build()?;
    let mut msg = Vec::new();
    let mut bytes_out = 0;
    // Allocated after the first encode (zero pages cost nothing until the
    // decoder writes them).
    let mut sent = Vec::new();
    {
        let mut ef = feedback.then(|| ErrorFeedback::new(n));
        for (i, x) in steps.iter().enumerate() {
            let c = codec.as_mut().expect("encoder lives until the last step");
            match ef.as_mut() {
                Some(ef) => ef.step(c.as_mut(), x, &mut msg)?,
                None => c.encode(x, &mut msg)?,
            }
            if i + 1 == steps.len() {
                codec = None;
            }
            bytes_out += msg.len();
            if sent.len() != n {
                sent = vec![0f32; n];
            }
            decoder.decode_add(&msg, &mut sent)?;
        }
    }
    let (mut err2, mut ref2, mut maxabs) = (0f64, 0f64, 0f64);
    const BLOCK: usize = 4096;
    let mut total = [0f64; BLOCK];
    for (b, got) in sent.chunks(BLOCK).enumerate() {
        let t = &mut total[..got.len()];
        t.fill(0.0);
        for x in steps {
            for (t, v) in t.iter_mut().zip(&x[b * BLOCK..b * BLOCK + got.len()]) {
                *t += f64::from(*v);
            }
        }
        for (s, t) in got.iter().zip(t.iter()) {
            let d = f64::from(*s) - t;
            err2 += d * d;
            ref2 += t * t;
            maxabs = maxabs.max(d.abs());
        }
    }
    // Throughput on the last step, fresh codec state each measurement.
    drop(sent);
    let last = steps.last().copied().unwrap_or(&[]);
    let mut c2 = cfg.build()?;
    let enc = median_time(|| c2.encode(last, &mut msg))?;
    drop(c2);
    let mut out = vec![0f32; last.len()];
    let dec = median_time(|| decoder.decode(&msg, &mut out))?;
    let bytes_in = 4 * n * steps.len();
    let gbps = |t: f64| {
        if t > 0.0 {
            4.0 * last.len() as f64 / t / 1e9
        } else {
            f64::INFINITY
        }
    };
    Ok(CodecRecord {
        codec: cfg.name(),
        params: cfg.params(),
        elements: n,
        steps: steps.len(),
        bytes_in,
        bytes_out,
        ratio: bytes_in as f64 / bytes_out.max(1) as f64,
        bits_per_value: 8.0 * bytes_out as f64 / (n * steps.len()).max(1) as f64,
        rel_l2_error: if ref2 > 0.0 {
            (err2 / ref2).sqrt()
        } else {
            err2.sqrt()
        },
        max_abs_error: maxabs,
        encode_gbps: gbps(enc),
        decode_gbps: gbps(dec),
        error: None,
    })
}

/// A `gradsync codecs --json` line for a codec that failed.
#[derive(Serialize, Debug, Clone)]
pub struct CodecFailure {
    /// Codec name.
    pub codec: String,
    /// Parameters (`key=value,...`).
    pub params: String,
    /// Elements per step.
    pub elements: usize,
    /// Steps fed.
    pub steps: usize,
    /// What went wrong.
    pub error: String,
}

/// Split `3lc:s=1.75,stage=full,rgc:density=0.001;none` into codec strings: `;`
/// or `,` separate codecs, and a `key=value` token without `:` continues the
/// previous codec's parameters.
pub fn split_codec_list(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for tok in list
        .split([';', ','])
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        match out.last_mut() {
            Some(prev) if tok.contains('=') && !tok.contains(':') => {
                prev.push(',');
                prev.push_str(tok);
            }
            _ => out.push(tok.to_string()),
        }
    }
    out
}

pub(super) fn run(a: &CodecsArgs) -> Result<i32> {
    // Parse the codec list first: a typo should not cost a file read.
    let configs = match &a.codecs {
        Some(list) => split_codec_list(list)
            .iter()
            .map(|s| s.parse())
            .collect::<Result<Vec<CodecConfig>>>()?,
        None => CodecConfig::all_defaults(),
    };
    let (shape, data) = match (&a.input, a.synthetic) {
        (Some(p), _) => {
            let (shape, data) = read_npy(p)?;
            // Every codec rejects NaN/Inf; say so once, naming the file.
            if let Some(i) = data.iter().position(|v| !v.is_finite()) {
                return Err(Error::InvalidArgument(format!(
                    "{}: element {i} is {} (NaN/Inf cannot be compressed)",
                    p.display(),
                    data[i]
                )));
            }
            (shape, data)
        }
        (None, Some(n)) => (vec![n], synthetic(n, &a.dist, a.seed)?),
        (None, None) => {
            return Err(Error::InvalidArgument(
                "give --input FILE.npy or --synthetic N".into(),
            ))
        }
    };
    let (steps, feedback): (Vec<&[f32]>, bool) = match a.steps {
        Some(k) => {
            if shape.len() < 2 || shape[0] == 0 {
                return Err(Error::InvalidArgument(format!(
                    "--steps needs an input with a leading steps axis (shape {shape:?})"
                )));
            }
            if k == 0 || k > shape[0] {
                return Err(Error::InvalidArgument(format!(
                    "--steps {k} is out of range: the input has {} steps (shape {shape:?})",
                    shape[0]
                )));
            }
            let per = data.len() / shape[0];
            if per == 0 {
                return Err(Error::InvalidArgument(format!(
                    "--steps: each step of shape {shape:?} is empty"
                )));
            }
            (data.chunks(per).take(k).collect(), true)
        }
        None => (vec![&data[..]], false),
    };
    if !a.json {
        outln!(
            "{:<10} {:<28} {:>10} {:>6} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9}  error",
            "codec",
            "params",
            "elements",
            "steps",
            "ratio",
            "bits/val",
            "rel_l2_err",
            "max_abs_err",
            "enc_GB/s",
            "dec_GB/s"
        );
    }
    let mut failed = Vec::new();
    for cfg in &configs {
        // One codec's failure is its row's, not the whole comparison's.
        match measure(cfg, &steps, feedback) {
            Ok(r) if a.json => outln!("{}", serde_json::to_string(&r)?),
            Ok(r) => outln!(
                "{:<10} {:<28} {:>10} {:>6} {:>9.2} {:>9.3} {:>11.3e} {:>11.3e} {:>9.3} {:>9.3}",
                r.codec,
                r.params,
                r.elements,
                r.steps,
                r.ratio,
                r.bits_per_value,
                r.rel_l2_error,
                r.max_abs_error,
                r.encode_gbps,
                r.decode_gbps
            ),
            Err(e) => {
                let f = CodecFailure {
                    codec: cfg.name(),
                    params: cfg.params(),
                    elements: steps.first().map_or(0, |s| s.len()),
                    steps: steps.len(),
                    error: e.to_string(),
                };
                if a.json {
                    outln!("{}", serde_json::to_string(&f)?);
                } else {
                    outln!(
                        "{:<10} {:<28} {:>10} {:>6} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9}  {}",
                        f.codec,
                        f.params,
                        f.elements,
                        f.steps,
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        f.error
                    );
                }
                failed.push(cfg.name());
            }
        }
    }
    if failed.is_empty() {
        Ok(0)
    } else {
        errln!(
            "gradsync: codecs: {} of {} codecs failed ({}); see their rows",
            failed.len(),
            configs.len(),
            failed.join(", ")
        );
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_lists_split_on_codec_names() {
        assert_eq!(split_codec_list("none,fp16"), vec!["none", "fp16"]);
        assert_eq!(
            split_codec_list("qsgd:bits=8,seed=2,int8;none"),
            vec!["qsgd:bits=8,seed=2", "int8", "none"]
        );
    }

    #[test]
    fn synthetic_and_measure_report_consistent_numbers() {
        let x = synthetic(10_000, "normal", 3).expect("dist");
        let std = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
        assert!((std - 1e-3).abs() < 1e-4, "std {std}");
        assert!(synthetic(5, "zeros", 0)
            .expect("zeros")
            .iter()
            .all(|&v| v == 0.0));
        assert!(synthetic(5, "cauchy", 0).is_err());
        let r = measure(&"none".parse().expect("cfg"), &[&x], false).expect("measure");
        assert_eq!(
            (r.bytes_in, r.rel_l2_error, r.max_abs_error),
            (40_000, 0.0, 0.0)
        );
        assert_eq!(r.bytes_out, 40_000 + crate::codec::HEADER_LEN);
        let r = measure(&"int8".parse().expect("cfg"), &[&x], false).expect("measure");
        assert!(r.ratio > 3.9 && r.rel_l2_error < 0.02 && r.encode_gbps > 0.0);
        // Error feedback over steps: running-sum error stays at one step's error.
        let steps: Vec<Vec<f32>> = (0..20)
            .map(|s| synthetic(1000, "laplace", s).expect("dist"))
            .collect();
        let refs: Vec<&[f32]> = steps.iter().map(|s| &s[..]).collect();
        let r = measure(&"int8".parse().expect("cfg"), &refs, true).expect("measure");
        assert_eq!(r.steps, 20);
        assert!(r.max_abs_error < 1e-4, "{}", r.max_abs_error);
    }

    #[test]
    fn npy_headers_parse_or_fail_cleanly() {
        let h =
            parse_npy_header("{'descr': '<f8', 'fortran_order': True, 'shape': (3L, 4L), }   \n")
                .expect("header");
        assert_eq!(
            h,
            NpyHeader {
                descr: "<f8".into(),
                fortran_order: true,
                shape: vec![3, 4]
            }
        );
        let h = parse_npy_header("{\"shape\":(),\"descr\":\"<f4\",\"fortran_order\":False}")
            .expect("scalar");
        assert!(h.shape.is_empty() && h.descr == "<f4");
        for bad in [
            "",
            "{",
            "{'descr': '<f4'}",
            "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (1,)}",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1,",
            "{'descr: '<f4', 'fortran_order': False, 'shape': (1,)}",
            "{'extra': 1, 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}",
        ] {
            assert!(parse_npy_header(bad).is_err(), "{bad:?}");
        }
        // (2, 3) in Fortran order: columns are contiguous.
        let f = [1.0, 4.0, 2.0, 5.0, 3.0, 6.0];
        assert_eq!(
            fortran_to_c(&[2, 3], &f),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
    }
}
