//! `gradsync codecs` end to end (no MPI): JSON fields, .npy input, errors.

mod common;

use common::{run_gradsync as run, write_npy, write_npy_f32, write_npy_f64};

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gradsync-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
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

/// One codec's failure must not abort the whole comparison: it is
/// reported in its row (`error` in JSON, the `error` column in the table),
/// the other codecs still run, and the exit status is non-zero.
#[test]
fn codecs_reports_a_failing_codec_in_its_row() {
    let args = [
        "codecs",
        "--synthetic",
        "5000",
        "--codecs",
        "none,rgc:density=5,int8",
    ];
    let (ok, out, err) = run(&[&args[..], &["--json"]].concat());
    assert!(!ok, "a failed row must fail the run: {out}");
    let recs = json_lines(&out);
    assert_eq!(recs.len(), 3, "{out}");
    assert_eq!(recs[0]["codec"], "none");
    assert!(recs[0]["error"].is_null() && recs[0]["ratio"].is_number());
    assert_eq!(recs[1]["codec"], "rgc");
    let e = recs[1]["error"].as_str().expect("error field");
    assert!(e.contains("density"), "{e}");
    assert_eq!(recs[2]["codec"], "int8");
    assert!(recs[2]["error"].is_null() && recs[2]["rel_l2_error"].as_f64().unwrap() < 0.02);
    assert!(err.contains("1 of 3") && err.contains("rgc"), "{err}");
    // The table: a header with an error column and every row.
    let (ok, out, _) = run(&args);
    assert!(!ok);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines[0].trim_end().ends_with("error"), "{out}");
    assert!(
        lines[2].starts_with("rgc") && lines[2].contains("density"),
        "{out}"
    );
    assert!(lines[3].starts_with("int8"), "{out}");
}

/// Huge and tiny tensors through the CLI: fp16 must not abort the comparison
/// on a value above 65504 nor flush tiny layers to zero, and int8 must not
/// decode tiny layers as ±max|x| everywhere.
#[test]
fn codecs_handle_huge_and_tiny_tensors() {
    let dir = scratch("range");
    for (name, scale) in [
        ("huge", 1e30f32),
        ("big", 1e5),
        ("tiny", 1e-10),
        ("tinier", 1e-38),
    ] {
        let path = dir.join(format!("{name}.npy"));
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0 * scale)
            .collect();
        write_npy_f32(&path, &[1000], &x);
        let (ok, out, err) = run(&[
            "codecs",
            "--input",
            path.to_str().unwrap(),
            "--codecs",
            "none,fp16,int8",
            "--json",
        ]);
        assert!(ok, "{name}: {err}\n{out}");
        let recs = json_lines(&out);
        assert_eq!(recs.len(), 3, "{out}");
        for (r, tol) in recs.iter().zip([0.0, 1e-3, 1e-2]) {
            let e = r["rel_l2_error"].as_f64().expect("number");
            assert!(e <= tol, "{name} {}: rel_l2_error {e} > {tol}", r["codec"]);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A .npy whose header claims 10^12 elements must not abort on allocation:
/// every read error names the file and exits with status 1.
#[test]
fn codecs_rejects_lying_npy_headers_naming_the_file() {
    let dir = scratch("npy-lies");
    let p = |n: &str| dir.join(n);
    type MakeFile = Box<dyn Fn(&std::path::Path)>;
    let cases: Vec<(&str, MakeFile, &str)> = vec![
        (
            "huge.npy",
            Box::new(|f| write_npy(f, "<f4", false, &[1_000_000, 1_000_000], &[0; 64])),
            "1000000000000 elements",
        ),
        (
            "overflow.npy",
            Box::new(|f| write_npy(f, "<f8", false, &[1 << 40, 1 << 40], &[0; 64])),
            "too many elements",
        ),
        (
            "short.npy",
            Box::new(|f| write_npy(f, "<f4", false, &[500], &[0; 400])),
            "400 bytes of data",
        ),
        (
            "long.npy",
            Box::new(|f| write_npy(f, "<f4", false, &[2], &[0; 12])),
            "12 bytes of data",
        ),
        (
            "int.npy",
            Box::new(|f| write_npy(f, "<i4", false, &[2], &[0; 8])),
            "not supported",
        ),
        (
            "magic.npy",
            Box::new(|f| std::fs::write(f, b"PK\x03\x04 not numpy").unwrap()),
            "magic",
        ),
        (
            "empty.npy",
            Box::new(|f| std::fs::write(f, b"").unwrap()),
            "ends inside",
        ),
        (
            "header.npy",
            Box::new(|f| {
                let mut b = b"\x93NUMPY\x01\x00\xff\xff".to_vec();
                b.extend_from_slice(b"{'descr': '<f4'");
                std::fs::write(f, b).unwrap()
            }),
            "header of 65535 bytes",
        ),
        (
            "garbled.npy",
            Box::new(|f| {
                let mut b = b"\x93NUMPY\x01\x00\x10\x00".to_vec();
                b.extend_from_slice(b"{'descr': '<f4',");
                std::fs::write(f, b).unwrap()
            }),
            "bad .npy header",
        ),
        (
            "range.npy",
            Box::new(|f| write_npy_f64(f, &[3], &[1.0, 1e300, 2.0])),
            "element 1",
        ),
        (
            "nan.npy",
            Box::new(|f| write_npy_f32(f, &[3], &[1.0, 2.0, f32::NAN])),
            "element 2 is NaN",
        ),
    ];
    for (name, make, want) in &cases {
        let path = p(name);
        make(&path);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradsync"))
            .args([
                "codecs",
                "--input",
                path.to_str().unwrap(),
                "--codecs",
                "none",
            ])
            .output()
            .expect("run gradsync");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {:?} {err}", out.status);
        assert!(
            err.contains(path.to_str().unwrap()),
            "{name}: error does not name the file: {err}"
        );
        assert!(err.contains(want), "{name}: {err:?} lacks {want:?}");
    }
    let missing = p("missing.npy");
    let (ok, _, err) = run(&["codecs", "--input", missing.to_str().unwrap()]);
    assert!(!ok && err.contains(missing.to_str().unwrap()), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--steps` beyond the file's leading axis (or 0) is an error, not a clamp.
#[test]
fn codecs_steps_out_of_range_is_an_error() {
    let dir = scratch("steps");
    let path = dir.join("g.npy");
    write_npy_f64(&path, &[3, 10], &[1e-3; 30]);
    for k in ["0", "4"] {
        let (ok, _, err) = run(&["codecs", "--input", path.to_str().unwrap(), "--steps", k]);
        assert!(!ok && err.contains(&format!("--steps {k}")), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Fortran-order and big-endian files read like C-order little-endian ones.
#[test]
fn codecs_reads_fortran_order_and_big_endian() {
    let dir = scratch("orders");
    // C order: row i = step i, all elements of step i equal to i + 1.
    let c: Vec<f32> = (0..3).flat_map(|i| vec![(i + 1) as f32; 4]).collect();
    let f: Vec<f32> = (0..4).flat_map(|_| (1..=3).map(|i| i as f32)).collect();
    let fb: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
    let be: Vec<u8> = c.iter().flat_map(|v| v.to_be_bytes()).collect();
    write_npy(&dir.join("f.npy"), "<f4", true, &[3, 4], &fb);
    write_npy(&dir.join("be.npy"), ">f4", false, &[3, 4], &be);
    write_npy_f32(&dir.join("c.npy"), &[3, 4], &c);
    let outs: Vec<String> = ["c", "f", "be"]
        .iter()
        .map(|n| {
            let path = dir.join(format!("{n}.npy"));
            let (ok, out, err) = run(&[
                "codecs",
                "--input",
                path.to_str().unwrap(),
                "--steps",
                "2",
                "--codecs",
                "int8",
                "--json",
            ]);
            assert!(ok, "{n}: {err}");
            let r = &json_lines(&out)[0];
            format!("{} {} {}", r["elements"], r["steps"], r["rel_l2_error"])
        })
        .collect();
    assert_eq!(outs[0], "4 2 0.0", "{outs:?}");
    assert!(outs.iter().all(|o| o == &outs[0]), "{outs:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Memory use of `codecs --synthetic 64M`: it once peaked at 7.3x the
/// tensor's bytes (an f64 running sum, error-feedback state that was never
/// used, a second decode buffer, ...). Peak RSS of a child run, from wait4(2), must
/// stay within 3.5x the f32 tensor.
/// Every codec, `qsgd` included (its decoder used to hold every code as a
/// u64, 2x the tensor).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
#[test]
// The child is reaped by wait4 (which std's wait cannot report rusage of).
#[allow(clippy::zombie_processes)]
fn codecs_peak_memory_is_bounded() {
    extern "C" {
        fn wait4(pid: i32, status: *mut i32, options: i32, rusage: *mut [i64; 18]) -> i32;
    }
    let n = 16usize << 20;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_gradsync"))
        .args([
            "codecs",
            "--synthetic",
            "16M",
            "--codecs",
            "none,fp16,int8,qsgd,rgc,rgc-quant,sbc,3lc,fastsgd",
            "--json",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn gradsync");
    let (mut status, mut ru) = (0i32, [0i64; 18]);
    // struct rusage on 64-bit Linux: two timevals, then ru_maxrss (KiB).
    // SAFETY: `ru` is as large as struct rusage (144 bytes); the pid is our
    // child, not yet reaped (std only reaps in wait/try_wait).
    let r = unsafe { wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(r, child.id() as i32, "wait4 failed");
    assert_eq!(status, 0, "gradsync codecs failed (wait status {status})");
    let peak = ru[4] as f64 * 1024.0;
    let ratio = peak / (4.0 * n as f64);
    eprintln!(
        "peak RSS {:.0} MiB = {ratio:.2}x the tensor",
        peak / 1048576.0
    );
    assert!(
        ratio <= 3.5,
        "peak RSS is {ratio:.2}x the tensor's f32 bytes"
    );
    assert!(
        ratio >= 1.0,
        "implausible peak RSS {peak} (the tensor alone is 1x)"
    );
}
