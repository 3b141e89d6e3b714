//! The Python package under real `mpirun`: `gradsync.allreduce`
//! against `MPI.COMM_WORLD.Allreduce`, the engine through Python against the
//! Rust engine bit for bit, failures on one rank raising on every rank, the
//! README's program, the digits training run and the PyTorch wrapper.
//!
//! Needs the package installed (`hpc/test.sh` installs it into the
//! environment `hpc/setup.sh` makes, `.venv`; or `pip install ./python`). Without it these tests print why and pass,
//! unless `GRADSYNC_REQUIRE_PYTHON=1` (set by `hpc/test.sh`), where a
//! missing package fails them.

mod common;

use common::{example, mpirun};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The interpreter: `$GRADSYNC_PYTHON`, else the environment `hpc/setup.sh`
/// makes (`.venv`), else `python3`.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("GRADSYNC_PYTHON") {
        return p.into();
    }
    let venv = repo().join(".venv/bin/python");
    if venv.exists() {
        return venv;
    }
    "python3".into()
}

/// The newest modification time of the files under `dirs` (recursively).
fn newest(dirs: &[PathBuf]) -> Option<(std::time::SystemTime, PathBuf)> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                if !path.ends_with("__pycache__") {
                    stack.push(path);
                }
            } else if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                if best.as_ref().is_none_or(|(b, _)| t > *b) {
                    best = Some((t, path));
                }
            }
        }
    }
    best
}

/// Whether the interpreter can import gradsync (from outside the source
/// tree). An installed package older than the sources it embeds (the
/// engine, the bindings, the Python modules) fails the test: it would test
/// old code and pass or fail for the wrong reason.
fn python_ready(test: &str) -> bool {
    let out = Command::new(python())
        .args([
            "-c",
            "import gradsync, mpi4py, numpy; print(gradsync._gradsync.__file__)",
        ])
        .current_dir(std::env::temp_dir())
        .output();
    let why = match out {
        Ok(o) if o.status.success() => {
            let ext = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            let built = std::fs::metadata(&ext).and_then(|m| m.modified());
            let src = newest(&[
                repo().join("src"),
                repo().join("python/src"),
                repo().join("python/gradsync"),
            ]);
            if let (Ok(built), Some((t, file))) = (built, src) {
                assert!(
                    t <= built,
                    "{test}: the installed gradsync ({}) is older than {}: \
                     reinstall it (`pip install --no-build-isolation ./python`, as hpc/test.sh does)",
                    ext.display(),
                    file.display()
                );
            }
            return true;
        }
        Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
        Err(e) => format!("python3: {e}"),
    };
    let msg = format!(
        "{test}: the gradsync Python package is not importable (run hpc/setup.sh, or `pip install ./python`): {why}"
    );
    if std::env::var("GRADSYNC_REQUIRE_PYTHON").as_deref() == Ok("1") {
        panic!("{msg}");
    }
    eprintln!("SKIP {msg}");
    false
}

/// `mpirun -np p python3 -m mpi4py script args` (mpi4py's runner aborts the
/// job when a rank raises, so a failing check never hangs the others).
fn mpirun_py(p: usize, script: &Path, args: &[&str], limit: u64) -> (bool, String, String) {
    let mut a = vec!["-m", "mpi4py", script.to_str().unwrap()];
    a.extend_from_slice(args);
    mpirun(p, &python(), &a, Duration::from_secs(limit))
}

#[test]
fn python_api_under_mpirun() {
    if !python_ready("python_api_under_mpirun") {
        return;
    }
    let script = repo().join("tests/python/check_api.py");
    for p in 1..=4 {
        let (ok, out, err) = mpirun_py(p, &script, &[], 300);
        assert!(ok, "p={p}\n{out}\n{err}");
        for r in 0..p {
            assert!(
                out.contains(&format!("rank {r}: OK ")),
                "p={p} rank {r}\n{out}\n{err}"
            );
        }
        // (check_api.py itself asserts, on every rank, the exception type
        // and that the message names the failing rank and step.)
        assert!(
            out.contains(&format!("rank {}: tables differ: Error: ", p - 1)) || p == 1,
            "{out}"
        );
    }
}

/// Ranks that make different engine calls (a resume whose snapshot is
/// missing on one rank, a restore against a step, a layer registered after
/// the first step on one rank, complete_table against load_snapshot) fail
/// alike within seconds, every rank naming both calls, and stay in step.
#[test]
fn python_different_calls_fail_alike_under_mpirun() {
    if !python_ready("python_different_calls_fail_alike_under_mpirun") {
        return;
    }
    mpirun_checks("check_calls.py", &[2, 3]);
}

/// SBC's delay with a per-step learning rate: every rank's weights
/// equal bit for bit after every communicating step (p = 2, 3).
#[test]
fn python_delayed_weights_agree_bitwise_under_mpirun() {
    if !python_ready("python_delayed_weights_agree_bitwise_under_mpirun") {
        return;
    }
    mpirun_checks("check_delay.py", &[2, 3]);
}

/// GradSync.sync on DLPack tensors through the engine's own import (the
/// path CUDA tensors take): equal to the numpy path bit for bit and in
/// place; bad dtype, strides or overlap on one rank fail the step on every
/// rank; a capsule claiming CUDA memory fails it on every rank without a
/// GPU (or the cuda feature), and its deleter runs once.
#[test]
fn python_dlpack_under_mpirun() {
    if !python_ready("python_dlpack_under_mpirun") {
        return;
    }
    let script = repo().join("tests/python/check_dlpack.py");
    for p in 1..=3 {
        let (ok, out, err) = mpirun_py(p, &script, &[], 300);
        assert!(ok, "p={p}\n{out}\n{err}");
        for r in 0..p {
            assert!(
                out.contains(&format!("rank {r}: OK ")),
                "p={p} rank {r}\n{out}\n{err}"
            );
        }
    }
}

/// PyTorch CUDA tensors through `GradSync.sync` equal the host engine bit
/// for bit (tests/python/check_cuda.py, run on a GPU by hpc/gpu/run.sh).
/// Without torch, a GPU or the cuda feature every rank skips and rank 0
/// prints the reason: checked here, so the skip is never silent.
#[test]
fn python_cuda_tensors_under_mpirun_or_a_printed_skip() {
    if !python_ready("python_cuda_tensors_under_mpirun_or_a_printed_skip") {
        return;
    }
    let script = repo().join("tests/python/check_cuda.py");
    let p = 2;
    let (ok, out, err) = mpirun_py(p, &script, &[], 300);
    assert!(ok, "{out}\n{err}");
    let skips: Vec<&str> = out.lines().filter(|l| l.starts_with("SKIPPED: ")).collect();
    if skips.is_empty() {
        for r in 0..p {
            assert!(
                out.contains(&format!("rank {r}: OK ")),
                "rank {r}\n{out}\n{err}"
            );
        }
    } else {
        assert_eq!(skips.len(), 1, "rank 0 alone prints the skip\n{out}");
        assert!(skips[0].len() > "SKIPPED: ".len() + 5, "a reason\n{out}");
        assert!(!out.contains(": OK "), "skipped, yet checks ran\n{out}");
        eprintln!("python_cuda: {}", skips[0]);
    }
}

#[test]
fn python_engine_equals_rust_engine_bitwise() {
    if !python_ready("python_engine_equals_rust_engine_bitwise") {
        return;
    }
    let script = repo().join("tests/python/engine_parity.py");
    for p in [1, 2, 3, 4] {
        let dir = tempdir(&format!("parity{p}"));
        let d = dir.to_str().unwrap();
        let (ok, out, err) = mpirun_py(p, &script, &[d], 300);
        assert!(ok, "python p={p}\n{out}\n{err}");
        let (ok, out, err) = mpirun(p, &example("engine_replay"), &[d], Duration::from_secs(300));
        assert!(ok, "rust p={p}\n{out}\n{err}");
        for r in 0..p {
            let (s1, py) = gradsync::cli::read_npy(&dir.join(format!("py.rank{r}.npy"))).unwrap();
            let (s2, rs) = gradsync::cli::read_npy(&dir.join(format!("rust.rank{r}.npy"))).unwrap();
            let (_, input) = gradsync::cli::read_npy(&dir.join(format!("in.rank{r}.npy"))).unwrap();
            assert_eq!(s1, s2);
            assert!(py != input, "the engine changed the gradients");
            let same = py.iter().zip(&rs).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "p={p} rank {r}: Python and Rust engines differ");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn readme_python_program_runs() {
    if !python_ready("readme_python_program_runs") {
        return;
    }
    let prog = repo().join("examples/python/quickstart.py");
    let text = std::fs::read_to_string(&prog).unwrap();
    let readme = std::fs::read_to_string(repo().join("docs/python.md")).unwrap();
    assert!(
        readme.contains(text.trim()),
        "docs/python.md's program must be examples/python/quickstart.py verbatim"
    );
    for p in [1, 3] {
        let (ok, out, err) = mpirun_py(p, &prog, &[], 120);
        assert!(ok && out.contains("quickstart: OK"), "p={p}\n{out}\n{err}");
    }
}

/// docs/pytorch.md's complete programs are examples/python/torch_ddp_hook.py
/// and torch_optimizer.py verbatim, and run under mpirun (every rank ends
/// with the same weights; auto makes the large layer sparse).
#[test]
fn readme_torch_programs_run() {
    if !python_ready("readme_torch_programs_run") {
        return;
    }
    let readme = std::fs::read_to_string(repo().join("docs/pytorch.md")).unwrap();
    for name in ["torch_ddp_hook", "torch_optimizer"] {
        let prog = repo().join(format!("examples/python/{name}.py"));
        let text = std::fs::read_to_string(&prog).unwrap();
        assert!(
            readme.contains(text.trim()),
            "docs/pytorch.md must hold examples/python/{name}.py verbatim"
        );
        let has_torch = Command::new(python())
            .args(["-c", "import torch"])
            .status()
            .is_ok_and(|s| s.success());
        if !torch_ran(
            name,
            if has_torch {
                ""
            } else {
                "SKIP: torch is not installed"
            },
        ) {
            continue;
        }
        for p in [1, 3] {
            let (ok, out, err) = mpirun_py(p, &prog, &[], 300);
            assert!(
                ok && out.contains(&format!("{name}: OK")),
                "p={p}\n{out}\n{err}"
            );
            assert!(
                out.contains("rgc"),
                "auto made the 32768-element layer sparse\n{out}"
            );
        }
    }
}

/// The torch wrapper, where torch is importable; and `gradsync.torch`
/// imports without torch.
#[test]
fn torch_wrapper() {
    if !python_ready("torch_wrapper") {
        return;
    }
    let o = Command::new(python())
        .args(["-c", "import gradsync.torch"])
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "gradsync.torch must import without torch: {o:?}"
    );
    let script = repo().join("tests/python/check_torch.py");
    let (ok, out, err) = mpirun_py(2, &script, &[], 300);
    assert!(ok, "{out}\n{err}");
    torch_ran("torch_wrapper", &out);
}

/// Whether a torch script ran its checks; a skip (no torch) fails where
/// `GRADSYNC_REQUIRE_TORCH=1` (set by `hpc/test.sh`: CI installs torch).
fn torch_ran(test: &str, out: &str) -> bool {
    let Some(skip) = out.lines().find(|l| l.contains("SKIP")) else {
        return true;
    };
    if std::env::var("GRADSYNC_REQUIRE_TORCH").as_deref() == Ok("1") {
        panic!("{test}: torch must be installed here (GRADSYNC_REQUIRE_TORCH=1): {skip}");
    }
    eprintln!("{test}: {skip}");
    false
}

/// DDP over gloo with `gradsync_hook`, under mpirun at p = 1 to 4: the
/// hook equals the whole-step engine bit for bit (dense, rgc, auto; with
/// bucket rebuild, `no_sync()`, unused parameters), bfloat16 and float16
/// gradients are the float32 step rounded once and within the stated
/// bound, and a hook input that differs on one rank fails every rank's
/// futures, naming it (tests/python/check_torch_hook.py).
#[test]
fn torch_ddp_hook_and_half_precision_under_mpirun() {
    if !python_ready("torch_ddp_hook_and_half_precision_under_mpirun") {
        return;
    }
    let script = repo().join("tests/python/check_torch_hook.py");
    for p in 1..=4 {
        let (ok, out, err) = mpirun_py(p, &script, &[], 600);
        assert!(ok, "p={p}\n{out}\n{err}");
        if !torch_ran("torch_ddp_hook", &out) {
            return;
        }
        assert!(out.contains("check_torch_hook: OK"), "p={p}\n{out}\n{err}");
        eprintln!("p={p}:\n{out}");
    }
}

/// The digits training run: the compressed runs (auto, RGC, PowerSGD at
/// rank 2) reach the dense run's test accuracy within 1 point in the same
/// number of steps (4 ranks), and the
/// `MPI_Allreduce` baseline (`mpi-dense`) trains like gradsync's dense.
#[test]
fn train_digits_compressed_matches_dense() {
    if !python_ready("train_digits_compressed_matches_dense") {
        return;
    }
    let script = repo().join("examples/python/train_digits.py");
    let mut acc = std::collections::HashMap::new();
    for mode in ["mpi-dense", "dense", "auto", "rgc", "powersgd"] {
        let (ok, out, err) = mpirun_py(4, &script, &["--mode", mode, "--json"], 600);
        assert!(ok, "{mode}\n{out}\n{err}");
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with('{'))
            .unwrap_or_else(|| panic!("{mode}: no JSON line\n{out}"));
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        eprintln!("train_digits {mode}: {line}");
        let a = v["test_acc"].as_f64().unwrap();
        acc.insert(mode, if a > 1.0 { a / 100.0 } else { a });
    }
    let dense = acc["dense"];
    assert!(dense > 0.9, "dense run trains: {dense}");
    assert!(
        (acc["mpi-dense"] - dense).abs() <= 0.01,
        "mpi-dense: test accuracy {} vs gradsync dense {dense}",
        acc["mpi-dense"]
    );
    for mode in ["auto", "rgc", "powersgd"] {
        assert!(
            acc[mode] >= dense - 0.01,
            "{mode}: test accuracy {} vs dense {dense}",
            acc[mode]
        );
    }
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gradsync-py-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `tests/python/<script>` under mpirun at each of `ps` ranks (60 s each):
/// it must exit 0 with every rank's "rank R: OK" line.
fn mpirun_checks(script: &str, ps: &[usize]) {
    let path = repo().join("tests/python").join(script);
    for &p in ps {
        let (ok, out, err) = mpirun_py(p, &path, &[], 60);
        assert!(ok, "{script} p={p}\n{out}\n{err}");
        for r in 0..p {
            assert!(
                out.contains(&format!("rank {r}: OK ")),
                "{script} p={p} rank {r}\n{out}\n{err}"
            );
        }
    }
}

/// gradsync's PowerSGD against PyTorch's `powerSGD_hook` on the same
/// bucket (one matrix, rank 1, 2 and 4, four compressed steps with error
/// feedback and warm start, the hook's own first Q): every output within
/// float32 rounding of the hook's (1e-5 of the step's largest element).
/// Where torch is missing the script prints a SKIP line (an error under
/// `GRADSYNC_REQUIRE_TORCH=1`).
#[test]
fn powersgd_equals_torch_powersgd_hook() {
    use gradsync::powersgd::PowerSgd;
    let dir = tempdir("powersgd");
    let script = repo().join("tests/python/powersgd_torch.py");
    let o = Command::new(python())
        .arg(&script)
        .arg(&dir)
        .output()
        .expect("python runs");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    if !torch_ran("powersgd_equals_torch_powersgd_hook", &out) {
        return;
    }
    for case in 0..3 {
        let read = |what: &str| {
            gradsync::cli::read_npy(&dir.join(format!("case{case}.{what}.npy"))).unwrap()
        };
        let (gs, grads) = read("grads");
        let (qs, q0) = read("q0");
        let (_, torch) = read("torch");
        let (steps, rows, cols, rank) = (gs[0], gs[1], gs[2], qs[1]);
        let mut s = PowerSgd::new(rows, cols, rank, true, 0).unwrap();
        s.set_q(&q0).unwrap();
        let (plen, qlen) = s.factor_lens();
        let (mut p, mut q, mut mine) =
            (vec![0f32; plen], vec![0f32; qlen], vec![0f32; rows * cols]);
        for t in 0..steps {
            let g = &grads[t * rows * cols..(t + 1) * rows * cols];
            let want = &torch[t * rows * cols..(t + 1) * rows * cols];
            s.begin(g, &mut p).unwrap();
            let sum = p.clone();
            s.after_p(&sum, &mut q).unwrap();
            let sum = q.clone();
            s.after_q(&sum, 1, &mut mine).unwrap();
            let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
            let worst = mine
                .iter()
                .zip(want)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            eprintln!("powersgd case {case} ({rows}x{cols}, rank {rank}) step {t}: worst {worst:.3e} of {scale:.3e}");
            assert!(
                worst <= 1e-5 * scale,
                "case {case} step {t}: {worst} of {scale}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
