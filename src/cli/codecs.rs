//! `gradsync codecs`: compression ratio, error and throughput of every codec on
//! a real tensor (`--input FILE.npy`, f32 or f64, any shape) or a synthetic
//! one. With `--steps`, the leading axis is a sequence of steps fed through
//! error feedback, and errors compare the running sums (what training sees).
//! Throughput is GB/s of f32 input, median of repeated single-threaded runs.

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
}

/// xorshift64* uniform in (0, 1).
fn uniform(s: &mut u64) -> f64 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A synthetic gradient-like tensor.
pub fn synthetic(n: usize, dist: &str, seed: u64) -> Result<Vec<f32>> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let scale = 1e-3;
    Ok(match dist {
        "zeros" => vec![0.0; n],
        "normal" => (0..n)
            .map(|_| {
                let (u, v) = (uniform(&mut s), uniform(&mut s));
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * scale) as f32
            })
            .collect(),
        "laplace" => (0..n)
            .map(|_| {
                let u = uniform(&mut s) - 0.5;
                (-u.signum() * (1.0 - 2.0 * u.abs()).ln() * scale) as f32
            })
            .collect(),
        d => {
            return Err(Error::InvalidArgument(format!(
                "unknown --dist {d:?} (normal, laplace, zeros)"
            )))
        }
    })
}

/// Read a .npy of f32 or f64 (any shape) as (shape, f32 data).
pub fn read_npy(path: &std::path::Path) -> Result<(Vec<usize>, Vec<f32>)> {
    use ndarray::ArrayD;
    use ndarray_npy::ReadNpyExt;
    let open = || std::fs::File::open(path);
    let bad =
        |e: ndarray_npy::ReadNpyError| Error::InvalidArgument(format!("{}: {e}", path.display()));
    match ArrayD::<f32>::read_npy(open()?) {
        Ok(a) => Ok((a.shape().to_vec(), a.iter().copied().collect())),
        Err(ndarray_npy::ReadNpyError::WrongDescriptor(_)) => {
            let a = ArrayD::<f64>::read_npy(open()?).map_err(bad)?;
            Ok((a.shape().to_vec(), a.iter().map(|&v| v as f32).collect()))
        }
        Err(e) => Err(bad(e)),
    }
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
pub fn measure(cfg: &CodecConfig, steps: &[&[f32]], feedback: bool) -> Result<CodecRecord> {
    let n = steps.first().map_or(0, |s| s.len());
    let mut codec = cfg.build()?;
    let mut msg = Vec::new();
    let mut bytes_out = 0;
    let mut sent = vec![0f32; n];
    let mut total = vec![0f64; n];
    let mut ef = ErrorFeedback::new(n);
    for x in steps {
        if feedback {
            ef.step(codec.as_mut(), x, &mut msg)?;
        } else {
            codec.encode(x, &mut msg)?;
        }
        bytes_out += msg.len();
        codec.decode_add(&msg, &mut sent)?;
        for (t, v) in total.iter_mut().zip(x.iter()) {
            *t += *v as f64;
        }
    }
    let (mut err2, mut ref2, mut maxabs) = (0f64, 0f64, 0f64);
    for (s, t) in sent.iter().zip(&total) {
        let d = *s as f64 - t;
        err2 += d * d;
        ref2 += t * t;
        maxabs = maxabs.max(d.abs());
    }
    // Throughput on the last step, fresh codec state each measurement.
    let last = steps.last().copied().unwrap_or(&[]);
    let mut c2 = cfg.build()?;
    let enc = median_time(|| c2.encode(last, &mut msg))?;
    let mut out = vec![0f32; last.len()];
    let dec = median_time(|| c2.decode(&msg, &mut out))?;
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
    })
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
    let (shape, data) = match (&a.input, a.synthetic) {
        (Some(p), _) => read_npy(p)?,
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
                return Err(Error::InvalidArgument(
                    "--steps needs an input with a leading steps axis".into(),
                ));
            }
            let per = data.len() / shape[0];
            (
                data.chunks(per.max(1)).take(k.clamp(1, shape[0])).collect(),
                true,
            )
        }
        None => (vec![&data[..]], false),
    };
    let configs = match &a.codecs {
        Some(list) => split_codec_list(list)
            .iter()
            .map(|s| s.parse())
            .collect::<Result<Vec<CodecConfig>>>()?,
        None => CodecConfig::all_defaults(),
    };
    if !a.json {
        println!(
            "{:<10} {:<28} {:>10} {:>6} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9}",
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
    for cfg in &configs {
        let r = measure(cfg, &steps, feedback)?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            println!(
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
            );
        }
    }
    Ok(0)
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
}
