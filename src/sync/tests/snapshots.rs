//! Snapshots: a restored run continues bitwise; corrupt, foreign, stale or
//! non-finite snapshots are refused on every rank and change nothing.

use super::*;

use crate::strategy::Pick;

fn full_cfg() -> Config {
    Config {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-4,
        clip_norm: Some(5.0),
        warmup: Warmup::Density {
            schedule: vec![0.25, 0.0625],
            steps_per_stage: 1,
        },
        ..cfg()
    }
}

fn register_full(s: &mut GradSync<LocalComm>) {
    s.register("dense", &[64]).expect("register");
    s.register_with(
        "thr",
        &[3000],
        Strategy::Sparse {
            codec: "rgc:method=threshold".parse().expect("codec"),
            density: Some(0.01),
        },
    )
    .expect("register");
    s.register_with(
        "quant",
        &[2000],
        Strategy::Sparse {
            codec: "rgc-quant".parse().expect("codec"),
            density: Some(0.01),
        },
    )
    .expect("register");
    s.register_with(
        "qsgd",
        &[500],
        Strategy::Sparse {
            codec: "qsgd".parse().expect("codec"),
            density: None,
        },
    )
    .expect("register");
}

/// Run steps `from..to`, returning every step's outputs.
fn steps(s: &mut GradSync<LocalComm>, rank: usize, from: u64, to: u64) -> Vec<Vec<Vec<f32>>> {
    let n = [64usize, 3000, 2000, 500];
    let w: Vec<Vec<f32>> = n.iter().map(|&n| vec![0.5; n]).collect();
    let wv: Vec<&[f32]> = w.iter().map(|x| &x[..]).collect();
    (from..to)
        .map(|t| {
            let mut g: Vec<Vec<f32>> = n
                .iter()
                .enumerate()
                .map(|(i, &n)| grad(rank, t, i, n))
                .collect();
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            s.sync_with_weights(&mut v, &wv).expect("sync");
            g
        })
        .collect()
}

#[test]
fn snapshot_restore_continues_bitwise() {
    let p = 3;
    let straight = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        steps(&mut s, rank, 0, 8)
    });
    let dir = std::env::temp_dir().join(format!("gradsync-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let resumed = LocalComm::run(p, |c| {
        let rank = c.rank();
        let path = dir.join(format!("rank{rank}.snap"));
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        steps(&mut s, rank, 0, 4);
        s.save_snapshot(&path).expect("save");
        drop(s);
        // A fresh engine (as after a restart) on a fresh transport is built
        // below; here only the file survives.
        path
    });
    let after = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        s.load_snapshot(&resumed[rank]).expect("load");
        assert_eq!(s.step(), 4);
        steps(&mut s, rank, 4, 8)
    });
    for r in 0..p {
        for t in 0..4 {
            let (a, b) = (&straight[r][4 + t], &after[r][t]);
            for (x, y) in a.iter().zip(b) {
                let (xb, yb): (Vec<u32>, Vec<u32>) = (
                    x.iter().map(|v| v.to_bits()).collect(),
                    y.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(xb, yb, "rank {r} step {}", 4 + t);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corrupt_or_foreign_snapshots_are_rejected_and_change_nothing() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        steps(&mut s, 0, 0, 2);
        let good = s.snapshot_bytes().expect("snapshot");
        let residual = s.residual(LayerId(1)).expect("sparse").to_vec();
        for cut in [0, 7, 20, good.len() / 2, good.len() - 1] {
            assert!(s.restore_bytes(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut bad = good.clone();
        bad[9] ^= 1; // version
        assert!(s.restore_bytes(&bad).is_err());
        let mut bad = good.clone();
        bad[30] ^= 0x40; // table hash
        assert!(s.restore_bytes(&bad).is_err());
        assert_eq!(s.residual(LayerId(1)).expect("sparse"), &residual[..]);
        assert_eq!(s.step(), 2);
        s.restore_bytes(&good).expect("restores");
    });
}

/// A snapshot of other options is refused; under the default
/// `"allgather": "auto"` the error says how a snapshot written under the
/// earlier default (`recdbl`) loads, and it does load that way.
#[test]
fn a_snapshot_of_the_earlier_allgather_default_names_the_option() {
    LocalComm::run(1, |c| {
        let old = Config {
            allgather: Pick::Fixed(AllgathervAlgo::RecursiveDoubling),
            ..full_cfg()
        };
        let mut s = GradSync::with_transport(c, old).expect("engine");
        register_full(&mut s);
        steps(&mut s, 0, 0, 2);
        let snap = s.snapshot_bytes().expect("snapshot");
        drop(s);
        let c = LocalComm::create(1).pop().expect("one rank");
        assert_eq!(full_cfg().allgather, Pick::Auto);
        let mut s = GradSync::with_transport(c, full_cfg()).expect("engine");
        register_full(&mut s);
        let e = s.restore_bytes(&snap).unwrap_err().to_string();
        assert!(e.contains("another layer table or other options"), "{e}");
        assert!(e.contains("\"allgather\": \"recdbl\""), "{e}");
        let c = LocalComm::create(1).pop().expect("one rank");
        let old = Config {
            allgather: Pick::Fixed(AllgathervAlgo::RecursiveDoubling),
            ..full_cfg()
        };
        let mut s = GradSync::with_transport(c, old).expect("engine");
        register_full(&mut s);
        s.restore_bytes(&snap)
            .expect("restores with the earlier default");
        // Another difference (the momentum) gets no word about the
        // allgather.
        let c = LocalComm::create(1).pop().expect("one rank");
        let other = Config {
            momentum: full_cfg().momentum + 0.05,
            ..full_cfg()
        };
        let mut s = GradSync::with_transport(c, other).expect("engine");
        register_full(&mut s);
        let e = s.restore_bytes(&snap).unwrap_err().to_string();
        assert!(e.contains("another layer table or other options"), "{e}");
        assert!(!e.contains("allgather"), "{e}");
    });
}

/// Snapshots are checked (CRC-32 over the file, finite
/// floats) and loading is collective: bad bytes on one rank fail every rank
/// with the same error and leave every engine unchanged.
#[test]
fn bad_snapshots_fail_every_rank_and_change_nothing() {
    let dir = std::env::temp_dir().join(format!("gradsync-snap-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .unwrap();
        let sp = s.register_with("w", &[1000], Strategy::rgc(0.01)).unwrap();
        s.register_with("b", &[8], Strategy::Dense).unwrap();
        let step = |s: &mut GradSync<LocalComm>, k: usize| {
            // Element 7 is never selected: its residual is a known value.
            let mut w: Vec<f32> = (0..1000)
                .map(|i| {
                    if i == 7 {
                        0.123
                    } else {
                        ((i * 13 + k + rank) % 97) as f32
                    }
                })
                .collect();
            let mut b = [1.0f32; 8];
            s.sync(&mut [&mut w[..], &mut b[..]]).unwrap();
        };
        step(&mut s, 0);
        let good = s.snapshot_bytes().unwrap();
        step(&mut s, 1);
        let residual = s.residual(sp).unwrap().to_vec();
        let mut results = Vec::new();
        // 1. One flipped bit on rank 2 only.
        let mut flipped = good.clone();
        if rank == 2 {
            let mid = flipped.len() / 2;
            flipped[mid] ^= 0x04;
        }
        results.push(s.restore_bytes(&flipped).unwrap_err().to_string());
        // 2. A missing file on rank 1 only.
        let path = dir.join(format!("r{rank}.snap"));
        std::fs::write(&path, &good).unwrap();
        if rank == 1 {
            std::fs::remove_file(&path).unwrap();
        }
        results.push(s.load_snapshot(&path).unwrap_err().to_string());
        // 3. A device on rank 0 only (it never ends; a FIFO would block).
        let zero = if rank == 0 {
            std::path::PathBuf::from("/dev/zero")
        } else {
            dir.join(format!("r{rank}.snap"))
        };
        std::fs::write(dir.join(format!("r{rank}.snap")), &good).unwrap();
        results.push(s.load_snapshot(&zero).unwrap_err().to_string());
        // 4. A step counter past any run (the CRC made valid): stepping on
        // from it would wrap.
        let mut wrapped = good.clone();
        wrapped[36..44].copy_from_slice(&u64::MAX.to_le_bytes());
        let body = wrapped.len() - 4;
        let crc = crc32fast::hash(&wrapped[..body]);
        wrapped[body..].copy_from_slice(&crc.to_le_bytes());
        results.push(s.restore_bytes(&wrapped).unwrap_err().to_string());
        // 5. The first layer's name length past the data (CRC valid):
        // bincode's own message for it is empty.
        let mut long = good.clone();
        long[52..60].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let body = long.len() - 4;
        let crc = crc32fast::hash(&long[..body]);
        long[body..].copy_from_slice(&crc.to_le_bytes());
        results.push(s.restore_bytes(&long).unwrap_err().to_string());
        let unchanged = s.step() == 2 && s.residual(sp).unwrap() == &residual[..];
        // The good snapshot still loads everywhere afterwards.
        let reload = s.restore_bytes(&good).map(|_| s.step());
        (results, unchanged, reload.ok())
    });
    std::fs::remove_dir_all(&dir).ok();
    for (results, unchanged, reload) in &out {
        assert_eq!(results, &out[0].0, "same errors on every rank");
        assert!(
            results[0].starts_with("rank 2 failed: ") && results[0].contains("checksum mismatch"),
            "{}",
            results[0]
        );
        assert!(
            results[1].starts_with("rank 1 failed: ") && results[1].contains("r1.snap"),
            "{}",
            results[1]
        );
        assert!(
            results[2].starts_with("rank 0 failed: ") && results[2].contains("not a regular file"),
            "{}",
            results[2]
        );
        assert!(
            results[3].contains(&format!("step {} is past any run", u64::MAX)),
            "{}",
            results[3]
        );
        assert!(
            results[4].contains("a length field runs past the end of the data"),
            "{}",
            results[4]
        );
        assert!(unchanged, "a failed load changes no engine");
        assert_eq!(*reload, Some(1));
    }
}

/// A snapshot whose checksum is right but which holds a NaN residual is
/// refused, naming the layer and the element.
#[test]
fn a_snapshot_with_a_nan_residual_is_refused() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).unwrap();
        s.register_with("w", &[1000], Strategy::rgc(0.01)).unwrap();
        let mut w: Vec<f32> = (0..1000)
            .map(|i| if i == 7 { 0.123 } else { (i % 97) as f32 })
            .collect();
        s.sync(&mut [&mut w[..]]).unwrap();
        let mut bytes = s.snapshot_bytes().unwrap();
        let payload = bytes.len() - 4;
        let at = bytes[..payload]
            .windows(4)
            .position(|x| x == 0.123f32.to_le_bytes())
            .expect("the residual value is in the file");
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..payload]);
        bytes[payload..].copy_from_slice(&crc.to_le_bytes());
        let e = s.restore_bytes(&bytes).unwrap_err().to_string();
        assert!(e.contains("layer \"w\": residual[7] is NaN"), "{e}");
    });
}

/// Found by the `snapshot` fuzz target: an accepted snapshot whose residual
/// is near `f32::MAX` overflows in the next step, and the engine then wrote
/// a snapshot it could never load (`snapshot_bytes` now also refuses one,
/// naming the layer and the element). The overflow itself now fails its
/// step as a non-finite input and clears the residual, so the state stays
/// finite and the snapshot loads.
#[test]
fn fuzz_non_finite_state_is_never_written() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).unwrap();
        s.register_with("w", &[100], Strategy::rgc(0.01)).unwrap();
        let mut g = vec![3.0e38f32; 100];
        s.sync(&mut [&mut g[..]]).expect("3e38 is finite");
        let mut g = vec![3.0e38f32; 100];
        let e = s.sync(&mut [&mut g[..]]).map(|_| ()).expect_err("overflow");
        assert!(matches!(e, Error::NonFinite { .. }), "{e}");
        assert!(s.residual(LayerId(0)).unwrap().iter().all(|x| *x == 0.0));
        let bytes = s.snapshot_bytes().expect("a finite state is written");
        s.restore_bytes(&bytes).expect("and loads");
    });
}

/// Snapshots from different steps on different ranks (one stale file) are
/// refused on every rank, naming the file, and change no engine: restored
/// as they were, dense layers would drift apart with no error at all.
#[test]
fn snapshots_from_different_steps_are_refused_everywhere() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("d", &[16]).expect("dense");
        let mut snaps = Vec::new();
        for step in 0..3 {
            snaps.push(s.snapshot_bytes().expect("snapshot"));
            let mut g = grad(rank, step, 0, 16);
            s.sync(&mut [&mut g[..]]).expect("sync");
        }
        let before = s.snapshot_bytes().expect("snapshot");
        let pick = if rank == 2 { &snaps[1] } else { &snaps[2] };
        let e = s.restore_bytes(pick).expect_err("steps differ").to_string();
        let unchanged = s.snapshot_bytes().expect("snapshot") == before;
        // The same step everywhere restores.
        s.restore_bytes(&snaps[1]).expect("same step");
        (e, unchanged, s.step)
    });
    for (r, (e, unchanged, step)) in res.iter().enumerate() {
        assert!(
            e.contains("snapshots from different steps") && e.contains("the snapshot"),
            "rank {r}: {e}"
        );
        assert!(unchanged, "rank {r}: the engine changed");
        assert_eq!(*step, 1, "rank {r}");
    }
}

/// Snapshots of two runs at the same step (rank 1's from another job)
/// passed every check, and the dense layers' momentum drifted apart with no
/// error: the run's identity, agreed at creation and kept in the file, is
/// compared with the step. A restore starts a branch of the loaded run
/// (its identity mixed with the restoring job's), so two jobs restored
/// from the same files write different identities.
#[test]
fn snapshots_of_different_runs_are_refused_everywhere() {
    fn engine(c: LocalComm) -> GradSync<LocalComm> {
        let mut s = GradSync::with_transport(
            c,
            Config {
                momentum: 0.9,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("d", &[16]).expect("dense");
        s
    }
    let run = |seed: usize| {
        LocalComm::run(2, move |c| {
            let rank = c.rank();
            let mut s = engine(c);
            for step in 0..2 {
                let mut g = grad(rank + seed, step, 0, 16);
                s.sync(&mut [&mut g[..]]).expect("sync");
            }
            s.snapshot_bytes().expect("snapshot")
        })
    };
    let (a, b) = (run(0), run(7));
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = engine(c);
        let mixed = if rank == 0 { &a[0] } else { &b[1] };
        s.restore_bytes(mixed).expect_err("runs differ").to_string()
    });
    for (r, e) in res.iter().enumerate() {
        assert!(
            e.contains("snapshots from different steps or runs"),
            "rank {r}: {e}"
        );
    }
    // Two jobs restored from the same files, one step each: their step-3
    // snapshots are of different runs (each job is a branch of its own).
    let branch = || {
        LocalComm::run(2, |c| {
            let rank = c.rank();
            let mut s = engine(c);
            s.restore_bytes(&a[rank]).expect("one run");
            let mut g = grad(rank, 2, 0, 16);
            s.sync(&mut [&mut g[..]]).expect("sync");
            s.snapshot_bytes().expect("snapshot")
        })
    };
    let (x, y) = (branch(), branch());
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = engine(c);
        let mixed = if rank == 0 { &x[0] } else { &y[1] };
        let e = s
            .restore_bytes(mixed)
            .expect_err("branches differ")
            .to_string();
        // One branch's own snapshots restore together.
        s.restore_bytes(&x[rank]).map(|()| (e, s.step))
    });
    for (r, got) in res.into_iter().enumerate() {
        let (e, step) = got.expect("one branch restores");
        assert!(
            e.contains("snapshots from different steps or runs"),
            "rank {r}: {e}"
        );
        assert_eq!(step, 3, "rank {r}");
    }
    // A format-3 file (no run identity; a valid checksum) is named by its
    // version, not reported as truncated.
    let mut old = a[0][..a[0].len() - 4 - 8].to_vec();
    old[8..12].copy_from_slice(&3u32.to_le_bytes());
    let crc = crc32fast::hash(&old);
    old.extend_from_slice(&crc.to_le_bytes());
    let res = LocalComm::run(1, |c| {
        engine(c)
            .restore_bytes(&old)
            .expect_err("format 3")
            .to_string()
    });
    assert!(
        res[0].contains(&format!(
            "format version 3 (this build reads {})",
            crate::sync::SNAPSHOT_VERSION
        )),
        "{}",
        res[0]
    );
}
