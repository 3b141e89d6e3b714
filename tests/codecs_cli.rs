//! `gradsync codecs` end to end (no MPI): JSON fields, .npy input, errors.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync"))
        .args(args)
        .output()
        .expect("run gradsync");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A minimal version-1.0 .npy writer (little-endian f64, C order).
fn write_npy_f64(path: &std::path::Path, shape: &[usize], data: &[f64]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f8', 'fortran_order': False, 'shape': {shape_s}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).expect("write npy");
}

#[test]
fn codecs_json_has_the_documented_fields() {
    let (ok, out, err) = run(&[
        "codecs",
        "--synthetic",
        "20000",
        "--dist",
        "laplace",
        "--seed",
        "3",
        "--json",
    ]);
    assert!(ok, "{err}");
    let recs: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert!(recs.len() >= 4, "{out}");
    for r in &recs {
        for f in [
            "codec",
            "params",
            "elements",
            "bytes_in",
            "bytes_out",
            "ratio",
            "bits_per_value",
            "rel_l2_error",
            "max_abs_error",
            "encode_gbps",
            "decode_gbps",
        ] {
            assert!(r.get(f).is_some(), "field {f} missing in {r}");
        }
        assert_eq!(r["elements"], 20000);
        assert_eq!(r["bytes_in"], 80000);
    }
    let none = recs
        .iter()
        .find(|r| r["codec"] == "none")
        .expect("none codec");
    assert_eq!(none["rel_l2_error"], 0.0);
}

#[test]
fn codecs_reads_f64_npy_with_steps() {
    let dir = std::env::temp_dir().join(format!("gradsync-npy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("grads.npy");
    let data: Vec<f64> = (0..3 * 500)
        .map(|i| ((i * 37 % 101) as f64 - 50.0) * 1e-4)
        .collect();
    write_npy_f64(&path, &[3, 500], &data);
    let (ok, out, err) = run(&[
        "codecs",
        "--input",
        path.to_str().unwrap(),
        "--steps",
        "3",
        "--codecs",
        "int8,qsgd:bits=6",
        "--json",
    ]);
    assert!(ok, "{err}");
    let recs: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[0]["steps"], 3);
    assert_eq!(recs[0]["elements"], 500);
    assert_eq!(recs[1]["params"], "bits=6,seed=0");
    let (ok, _, err) = run(&["codecs", "--synthetic", "10", "--codecs", "nosuch"]);
    assert!(!ok && err.contains("nosuch"), "{err}");
    let (ok, _, err) = run(&[
        "codecs",
        "--input",
        dir.join("missing.npy").to_str().unwrap(),
    ]);
    assert!(!ok && !err.is_empty());
    std::fs::remove_dir_all(&dir).ok();
}
