//! Gradients on the GPU ([`gradsync::gpu`]):
//!
//! * on real MPI ranks (`examples/staging_check`, no GPU needed): the
//!   host-staged allreduce equals `MPI_Allreduce` bit for bit, mismatches
//!   and failed copies are errors on every rank; the CUDA-aware detection
//!   agrees with `ompi_info` and obeys `GRADSYNC_CUDA_AWARE`;
//! * on a GPU (feature `cuda`): the same staged allreduce over a CUDA
//!   stream and pinned buffers. Without a usable GPU, or without the
//!   feature, these tests print `skipped: <reason>` and pass: run with
//!   `--nocapture` to see it (hpc/test.sh does).

mod common;

use common::{example, mpirun_env};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

fn staging_check(np: usize, aware: &str) -> (bool, String, String) {
    let ex = example("staging_check");
    assert!(
        ex.exists(),
        "{} not built (cargo test builds it; with --test gpu, build it first: cargo build --release --example staging_check)",
        ex.display()
    );
    mpirun_env(np, &ex, &[], &[("GRADSYNC_CUDA_AWARE", aware)], LIMIT)
}

fn lines<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.starts_with(prefix)).collect()
}

fn device_engine_check(np: usize, args: &[&str]) -> (bool, String, String) {
    let ex = example("device_engine_check");
    assert!(
        ex.exists(),
        "{} not built (cargo test builds it; with --test gpu, build it first: cargo build --release --example device_engine_check)",
        ex.display()
    );
    mpirun_env(np, &ex, args, &[], LIMIT)
}

/// The engine on device buffers (host staging, `GradSync::sync_device`)
/// equals the host engine bit for bit under mpirun (dense, RGC, quantized
/// RGC, an empty layer, momentum), and a copy in that fails on the last
/// rank fails that step on every rank, after which the steps go on.
#[test]
fn device_engine_equals_host_engine() {
    for np in [1, 2, 3, 5] {
        let (ok, out, err) = device_engine_check(np, &[]);
        assert!(ok, "np={np}: {err}\n{out}");
        assert_eq!(
            lines(&out, &format!("OK steps=4 ranks={np}")).len(),
            np,
            "{out}"
        );
        let errs = lines(&out, "ERR ");
        assert_eq!(errs.len(), np, "{out}");
        let who = format!("rank {} failed in step 4", np - 1);
        assert!(
            errs.iter()
                .all(|l| l.contains(&who) && l.contains("injected")),
            "{out}"
        );
        assert_eq!(lines(&out, "AFTER ok").len(), np, "{out}");
    }
}

/// The engine on real device buffers (`CudaStaging`) equals the host
/// engine bit for bit for 3 steps, 2 ranks sharing the GPU; skipped with
/// the reason where a rank has no usable GPU.
#[test]
fn gpu_device_engine_under_mpirun() {
    let np = 2;
    let (ok, out, err) = device_engine_check(np, &[]);
    assert!(ok, "{err}\n{out}");
    let skipped = lines(&out, "GPU-SKIPPED ");
    if let Some(l) = skipped.first() {
        assert_eq!(skipped.len(), np, "{out}");
        println!(
            "gpu_device_engine_under_mpirun: skipped: {}",
            &l["GPU-SKIPPED ".len()..]
        );
        return;
    }
    assert_eq!(
        lines(&out, &format!("GPU-OK steps=3 ranks={np}")).len(),
        np,
        "{out}"
    );
}

/// A copy back to the device that fails after the step's collectives ends
/// the whole job (MPI_Abort) with a message naming the rank, the step and
/// the layer; no rank goes on.
#[test]
fn device_engine_failed_copy_back_aborts_the_job() {
    let (ok, out, err) = device_engine_check(3, &["--fail-copy-back"]);
    assert!(!ok, "the job went on:\n{out}\n{err}");
    assert!(
        err.contains(
            "rank 2 of 3: copying step 4's result of layer 0 (\"dense\") back to the device failed"
        ) && err.contains("MPI_Abort"),
        "{err}"
    );
    assert!(!err.contains("went on"), "{err}");
}

#[test]
fn staged_allreduce_equals_mpi_allreduce() {
    for np in [1, 2, 3, 5] {
        let (ok, out, err) = staging_check(np, "auto");
        assert!(ok, "np={np}: {err}\n{out}");
        // 7 (length, chunk) cases x 3 algorithms, on every rank.
        let oks = lines(&out, "OK ")
            .iter()
            .filter(|l| l.ends_with(&format!("ranks={np}")))
            .count();
        assert_eq!(oks, 21 * np, "np={np}:\n{out}\n{err}");
        // The 1 Mi + 3 element buffer really went in chunks.
        assert!(
            out.contains("OK n=1048579 chunk=262144 mpi chunks=5 ranks="),
            "{out}"
        );
        assert_eq!(lines(&out, "ERR size-mismatch ").len(), np, "{out}");
        if np > 1 {
            assert!(
                lines(&out, "ERR size-mismatch ")
                    .iter()
                    .all(|l| l.contains("size mismatch across ranks")),
                "{out}"
            );
        }
        let failed = lines(&out, "ERR copy-failed ");
        assert_eq!(failed.len(), np, "{out}");
        assert!(
            failed
                .iter()
                .all(|l| l.contains(&format!("rank {} failed", np - 1))
                    && l.contains("copy 4 failed")),
            "{out}"
        );
        assert_eq!(lines(&out, "AFTER ok").len(), np, "{out}");
        // Not CUDA-aware here (auto; the test below checks the query):
        // device_allreduce stages every case.
        assert_device_routes(&out, np, false);
    }
}

/// `device_allreduce`'s cases: 5 (length, chunk) x (mpi, ring) per rank,
/// all equal to MPI_Allreduce; mpi direct when `aware`, ring always
/// staged; ranks whose routes differ and a failed direct copy are errors on
/// every rank.
fn assert_device_routes(out: &str, np: usize, aware: bool) {
    let dev = lines(out, "OK-DEVICE ");
    assert_eq!(dev.len(), 10 * np, "{out}");
    let mpi_route = if aware {
        "route=direct"
    } else {
        "route=staged"
    };
    for l in &dev {
        let want = if l.contains(" mpi ") {
            mpi_route
        } else {
            "route=staged"
        };
        assert!(l.starts_with(&format!("OK-DEVICE {want} ")), "{l}");
    }
    let mism = lines(out, "ERR route-mismatch ");
    assert_eq!(mism.len(), np, "{out}");
    if np > 1 {
        assert!(mism.iter().all(|l| l.contains("options differ")), "{out}");
    }
    let failed = lines(out, "ERR direct-copy-failed ");
    assert_eq!(failed.len(), np, "{out}");
    assert!(
        failed
            .iter()
            .all(|l| l.contains(&format!("rank {} failed", np - 1)) && l.contains("copy 1 failed")),
        "{out}"
    );
}

#[test]
fn direct_route_equals_mpi_allreduce() {
    // GRADSYNC_CUDA_AWARE=1 on the host model: the device addresses are
    // host addresses, which this MPI takes, so the direct route's
    // agreement, chunking, scratch and copy back are checked without a GPU.
    for np in [1, 2, 3] {
        let (ok, out, err) = staging_check(np, "1");
        assert!(ok, "np={np}: {err}\n{out}");
        assert_device_routes(&out, np, true);
        assert_eq!(lines(&out, "AFTER ok").len(), np, "{out}");
    }
}

/// What `mpichversion` says about the MPICH build, when it is there:
/// `Some(false)` for a library configured without CUDA (Debian's).
fn mpich_built_with_cuda() -> Option<bool> {
    let out = std::process::Command::new("mpichversion").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("MPICH configure:"))?;
    Some(line.contains("--with-cuda") && !line.contains("--with-cuda=no"))
}

/// What `ompi_info` says about the Open MPI build, when it is there:
/// `Some(false)` for a library built without CUDA support.
fn ompi_built_with_cuda() -> Option<bool> {
    let out = std::process::Command::new("ompi_info")
        .args(["--parsable", "--all"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("opal_built_with_cuda_support:value:"))?;
    Some(line.ends_with(":true"))
}

#[test]
fn cuda_aware_detection_and_override() {
    // auto: the MPI library's own answer, on every rank.
    let (ok, out, err) = staging_check(2, "auto");
    assert!(ok, "{err}\n{out}");
    let aware = lines(&out, "AWARE ");
    assert_eq!(aware.len(), 2, "{out}");
    for l in &aware {
        let v: serde_json::Value = serde_json::from_str(&l["AWARE ".len()..]).unwrap();
        assert_eq!(v["source"], "query", "{l}");
        if common::flavor() == common::Flavor::Mpich && mpich_built_with_cuda() == Some(false) {
            // Debian's MPICH: built without CUDA, MPIX_GPU_query_support
            // answers, and says 0.
            assert_eq!(v["aware"], false, "{l}");
            assert_eq!(v["query"], serde_json::json!({"gpu_query": 0}), "{l}");
        } else if common::flavor() == common::Flavor::OpenMpi
            && ompi_built_with_cuda() == Some(false)
        {
            // This machine's Open MPI: built without CUDA, it exports
            // MPIX_Query_cuda_support and says 0.
            assert_eq!(v["aware"], false, "{l}");
            assert_eq!(v["query"], serde_json::json!({"returned": 0}), "{l}");
        } else {
            println!("ompi_info/mpichversion do not say the MPI lacks CUDA: only the shape of {l} is checked");
        }
    }
    // The override wins and the library is not asked.
    let (ok, out, err) = staging_check(2, "1");
    assert!(ok, "{err}\n{out}");
    let want = r#"AWARE {"aware":true,"source":"override","query":null}"#;
    assert_eq!(lines(&out, "AWARE "), vec![want; 2], "{out}");
    let (ok, out, err) = staging_check(1, "0");
    assert!(ok, "{err}\n{out}");
    let want = r#"AWARE {"aware":false,"source":"override","query":null}"#;
    assert_eq!(lines(&out, "AWARE "), vec![want], "{out}");
    // Anything else is an error naming the variable and the value.
    let (ok, out, err) = staging_check(2, "yes");
    assert!(ok, "{err}\n{out}");
    let errs = lines(&out, "AWARE-ERR ");
    assert_eq!(errs.len(), 2, "{out}");
    assert!(
        errs.iter()
            .all(|l| l.contains("GRADSYNC_CUDA_AWARE=\"yes\"") && l.contains("auto, 0 or 1")),
        "{out}"
    );
}

/// The GPU this test can use, or `None` after printing why it is skipped.
fn gpu_or_skip(test: &str) -> Option<gradsync::gpu::DeviceInfo> {
    match gradsync::gpu::probe() {
        Ok(d) => {
            println!("{test}: on {d:?}");
            Some(d)
        }
        Err(reason) => {
            println!("{test}: skipped: {reason}");
            None
        }
    }
}

#[test]
fn gpu_probe() {
    let Some(d) = gpu_or_skip("gpu_probe") else {
        // Without a GPU the probe must have said why, not panicked.
        return;
    };
    assert!(d.devices >= 1 && d.compute_capability.0 >= 1, "{d:?}");
}

#[test]
fn gpu_device_allreduce_under_mpirun() {
    // examples/staging_check on real device buffers where every rank has
    // a GPU: staged (MPI, ring) and by this MPI's route, equal to
    // MPI_Allreduce of the host copies; GPU-SKIPPED <reason> otherwise.
    let np = 2;
    let (ok, out, err) = staging_check(np, "auto");
    assert!(ok, "{err}\n{out}");
    let skipped = lines(&out, "GPU-SKIPPED ");
    if let Some(l) = skipped.first() {
        assert_eq!(skipped.len(), np, "{out}");
        println!(
            "gpu_device_allreduce_under_mpirun: skipped: {}",
            &l["GPU-SKIPPED ".len()..]
        );
        return;
    }
    assert_eq!(lines(&out, "GPU-OK ").len(), 6 * np, "{out}");
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_staged_allreduce_equals_host_model() {
    use gradsync::comm::{LocalComm, Transport};
    use gradsync::dense::{AllreduceAlgo, ReduceOp};
    use gradsync::gpu::{staged_allreduce, CudaStaging, HostMemory, StagingOptions};
    if gpu_or_skip("gpu_staged_allreduce_equals_host_model").is_none() {
        return;
    }
    for p in [1, 2, 3] {
        for (n, chunk) in [(0, 16), (1, 16), (1000, 7), (1_048_579, 1 << 18)] {
            let out = LocalComm::run(p, move |c| {
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 7919 + c.rank() * 104_729) % 201) as f32 - 100.0)
                    .collect();
                let opts = StagingOptions {
                    chunk_elems: chunk,
                    algo: AllreduceAlgo::Ring,
                    op: ReduceOp::Sum,
                };
                let mut host = HostMemory::new(x.clone());
                staged_allreduce(&c, &mut host, &opts).unwrap();
                let mut dev = CudaStaging::from_host(0, &x).expect("device buffer");
                staged_allreduce(&c, &mut dev, &opts).unwrap();
                (host.into_data(), dev.to_host().expect("copy back"))
            });
            for (want, got) in out {
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "p={p} n={n} chunk={chunk}"
                );
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_staged_allreduce_equals_host_model() {
    println!(
        "gpu_staged_allreduce_equals_host_model: skipped: built without the cuda feature (cargo test --features cuda)"
    );
}

fn device_sparse_check(np: usize, args: &[&str]) -> (bool, String, String) {
    let ex = example("device_sparse_check");
    assert!(
        ex.exists(),
        "{} not built (cargo test builds it; with --test gpu, build it first: cargo build --release --example device_sparse_check)",
        ex.display()
    );
    mpirun_env(np, &ex, args, &[], LIMIT)
}

/// The device-resident sparse step (`gpu::sparse`) against the host
/// engine under mpirun, bit for bit on integer gradients for 5 steps of
/// trimmed and threshold selection with momentum, on the CPU reference
/// at p = 1, 2, 3 (any machine) and on the kernels where every rank has
/// a GPU; a NaN on the last rank fails that step on every rank.
#[test]
fn device_sparse_step_equals_host_engine_under_mpirun() {
    for np in [1, 2, 3] {
        let (ok, out, err) = device_sparse_check(np, &[]);
        assert!(ok, "np={np}: {err}\n{out}");
        assert_eq!(
            lines(&out, &format!("SPARSE-OK host steps=15 ranks={np}")).len(),
            np,
            "{out}"
        );
        assert_eq!(lines(&out, "SPARSE-ERR-OK host").len(), np, "{out}");
        let skipped = lines(&out, "GPU-SKIPPED ");
        if let Some(l) = skipped.first() {
            assert_eq!(skipped.len(), np, "{out}");
            println!(
                "device_sparse_step_equals_host_engine_under_mpirun (cuda): skipped: {}",
                &l["GPU-SKIPPED ".len()..]
            );
            continue;
        }
        assert_eq!(
            lines(&out, &format!("SPARSE-OK cuda steps=15 ranks={np}")).len(),
            np,
            "{out}"
        );
    }
}

/// Each device sparse kernel against its CPU reference on device memory;
/// skipped with the reason without a GPU.
#[test]
fn gpu_sparse_kernels_equal_the_cpu_reference() {
    let (ok, out, err) = device_sparse_check(1, &["--kernels"]);
    assert!(ok, "{err}\n{out}");
    if let Some(l) = lines(&out, "GPU-SKIPPED ").first() {
        println!(
            "gpu_sparse_kernels_equal_the_cpu_reference: skipped: {}",
            &l["GPU-SKIPPED ".len()..]
        );
        return;
    }
    assert_eq!(lines(&out, "KERNELS-OK ").len(), 1, "{out}");
}

/// `hpc/gpu/check.sh`, the one device check, where there is no GPU: every
/// step says why it cannot pass (the environment step fails naming the
/// missing GPU, the others skip), and the exit status counts the failures.
/// Where `nvidia-smi` finds a GPU this is the device's job: skipped.
#[test]
fn gpu_check_script_says_why_without_a_gpu() {
    let gpu = std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success());
    if gpu {
        // Not "skipped:": hpc/gpu/check.sh counts a GPU test that
        // says so as one that did not run on the GPU.
        println!("gpu_check_script_says_why_without_a_gpu: not for a machine with a GPU (hpc/gpu/check.sh is the check there)");
        return;
    }
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("gs-check-{}", std::process::id()));
    let o = std::process::Command::new(root.join("hpc/gpu/check.sh"))
        .env("OUT", &out)
        .output()
        .expect("hpc/gpu/check.sh runs");
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let fails = text.lines().filter(|l| l.contains(": FAIL")).count() as i32;
    assert_eq!(o.status.code(), Some(fails), "{text}");
    assert!(text.contains("check.sh: env: FAIL no GPU found"), "{text}");
    // With a bundle (hpc/gpu/bundle.sh) every device step skips naming
    // the missing GPU; without one the script stops at the bundle.
    if root.join(".gpu/bin").is_dir() {
        for step in ["tests", "kernels", "sparse", "bench"] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("check.sh: {step}: SKIP"))
                        && l.contains("no GPU")),
                "{step}: {text}"
            );
        }
    } else {
        assert!(
            text.contains("check.sh: bundle: FAIL no .gpu/bin"),
            "{text}"
        );
    }
    assert!(out.join("check.log").exists() && out.join("env.txt").exists());
    let _ = std::fs::remove_dir_all(&out);
}
