//! GradiVeQ layers in the engine: results, snapshots (hostile bytes included) and
//! parameter checks at registration.

use super::*;

fn gvq_cfg() -> crate::gradiveq::schedule::ScheduleConfig {
    crate::gradiveq::schedule::ScheduleConfig {
        k: 32,
        dim: crate::gradiveq::Dim::Fixed(4),
        reuse: None,
        warmup: 1,
        lt: 6,
        lc: 1000,
        loss_threshold: 0.5,
        qsgd_bits: 8,
        qsgd_bucket: 0,
    }
}

/// Gradients in a 4-dimensional subspace of each 32-element slice.
fn gvq_grad(rank: usize, step: u64) -> Vec<f32> {
    let mut basis = SmallRng::seed_from_u64(77);
    let b: Vec<f32> = (0..32 * 4).map(|_| basis.gen_range(-1.0f32..1.0)).collect();
    let mut r = SmallRng::seed_from_u64((rank as u64) << 32 ^ step);
    let mut v = Vec::with_capacity(256);
    for _ in 0..8 {
        let c: Vec<f32> = (0..4).map(|_| r.gen_range(-1.0f32..1.0)).collect();
        for i in 0..32 {
            v.push((0..4).map(|j| b[i * 4 + j] * c[j]).sum());
        }
    }
    v
}

fn gvq_steps(
    s: &mut GradSync<LocalComm>,
    rank: usize,
    from: u64,
    to: u64,
) -> Vec<(Vec<f32>, Vec<f32>, String)> {
    (from..to)
        .map(|t| {
            let mut g = gvq_grad(rank, t);
            let mut d = vec![rank as f32; 8];
            let st = s.sync(&mut [&mut g[..], &mut d[..]]).expect("sync").clone();
            (g, d, st.layers[0].strategy.clone())
        })
        .collect()
}

/// GradiVeQ as an engine strategy: every rank gets the same result, which
/// approximates the average once compressed; its schedule and compressors
/// go into the snapshot, and a restored run continues bitwise.
#[test]
#[allow(clippy::needless_range_loop)] // steps index several per-rank histories
fn gradiveq_layers_in_the_engine_and_their_snapshot() {
    let p = 3;
    let register = |s: &mut GradSync<LocalComm>| {
        s.register_with("conv", &[256], Strategy::Gradiveq(gvq_cfg()))
            .expect("gvq");
        s.register("bias", &[8]).expect("dense");
    };
    let straight = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        register(&mut s);
        gvq_steps(&mut s, rank, 0, 12)
    });
    for t in 0..12 {
        for r in 1..p {
            assert_eq!(
                straight[r][t].0, straight[0][t].0,
                "step {t}: same on every rank"
            );
        }
        assert_eq!(straight[0][t].2, "gradiveq");
        assert!(
            straight[0][t].1.iter().all(|&x| x == 1.0),
            "dense layer averaged"
        );
    }
    // Steps 7.. are compressed (1 warm-up + 6 samples): close to the average.
    for t in 7..12u64 {
        let want: Vec<f32> = (0..256)
            .map(|i| (0..p).map(|r| gvq_grad(r, t)[i]).sum::<f32>() / p as f32)
            .collect();
        let got = &straight[0][t as usize].0;
        let err: f32 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f32>()
            .sqrt()
            / want.iter().map(|b| b * b).sum::<f32>().sqrt();
        // Six QSGD-aggregated samples: the quantization noise in them tilts
        // the fitted subspace a little.
        assert!(err < 0.2, "step {t}: rel error {err}");
    }
    let dir = std::env::temp_dir().join(format!("gradsync-gvq-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let paths = LocalComm::run(p, |c| {
        let rank = c.rank();
        let path = dir.join(format!("r{rank}.snap"));
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        register(&mut s);
        gvq_steps(&mut s, rank, 0, 5); // stopped while collecting samples
        s.save_snapshot(&path).expect("save");
        path
    });
    let resumed = LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        register(&mut s);
        s.load_snapshot(&paths[rank]).expect("load");
        gvq_steps(&mut s, rank, 5, 12)
    });
    for r in 0..p {
        for t in 5..12 {
            let (a, b) = (&straight[r][t].0, &resumed[r][t - 5].0);
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "rank {r} step {t}"
            );
        }
    }
    // A snapshot of another layer table is refused.
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("conv", &[256]).expect("dense this time");
        s.register("bias", &[8]).expect("dense");
        assert!(s.load_snapshot(&paths[0]).is_err());
    });
    std::fs::remove_dir_all(&dir).ok();
}

/// Hostile snapshot bytes (mutated or truncated, GradiVeQ state included)
/// never panic; a refused restore leaves the engine as it was.
#[test]
fn mutated_snapshots_with_gradiveq_state_never_panic() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register_with("conv", &[256], Strategy::Gradiveq(gvq_cfg()))
            .expect("gvq");
        s.register_with("fc", &[500], Strategy::rgc(0.02))
            .expect("rgc");
        gvq_steps_one(&mut s, 0, 9);
        let good = s.snapshot_bytes().expect("snapshot");
        hostile_restores(&mut s, &good, 5, 400);
        // The restored engine still runs.
        gvq_steps_one(&mut s, 9, 11);
    });
}

fn gvq_steps_one(s: &mut GradSync<LocalComm>, from: u64, to: u64) {
    for t in from..to {
        let mut g = gvq_grad(0, t);
        let mut f = grad(0, t, 1, 500);
        s.sync(&mut [&mut g[..], &mut f[..]]).expect("sync");
    }
}

/// GradiVeQ parameters and codec strings are checked whole at
/// registration, on every rank: a bad QSGD width or λ used to pass and
/// abort the job at the step that first used it (λ: `L_t` steps in), `d`
/// and `reuse` were clamped, and a parameter given twice kept the last.
#[test]
fn bad_gradiveq_parameters_and_repeated_keys_fail_registration() {
    for (spec, needle) in [
        ("gradiveq:k=64,lt=2,qsgd_bits=0", "qsgd_bits = 0"),
        ("gradiveq:k=64,lt=2,qsgd_bits=99", "qsgd_bits = 99"),
        ("gradiveq:k=64,lt=2,lambda=2", "lambda = 2"),
        ("gradiveq:k=64,lt=2,lambda=-1", "lambda = -1"),
        ("gradiveq:k=64,lt=2,d=0", "d = 0"),
        ("gradiveq:k=64,lt=2,d=100000", "d = 100000"),
        ("gradiveq:k=64,lt=2,reuse=0", "reuse = 0"),
        ("gradiveq:k=64,lt=2,reuse=1000000", "reuse = 1000000"),
        ("gradiveq:k=64,lt=2,lc=0", "lc = 0"),
        (
            "gradiveq:k=64,lt=2,loss_threshold=-5",
            "loss_threshold = -5",
        ),
        ("gradiveq:k=64,lt=2,k=32", "given twice"),
        ("gradiveq:k=64,d=4,lambda=0.1", "given twice"),
        ("rgc:density=0.1,density=0.5", "given twice"),
    ] {
        let res = LocalComm::run(2, |c| {
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            s.register_spec("L", &[4096], spec)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        for r in res {
            let e = r.expect_err(spec);
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }
    // The bounds themselves are accepted.
    let res = LocalComm::run(2, |c| {
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register_spec("L", &[4096], "gradiveq:k=64,lt=2,d=64,reuse=64,qsgd_bits=8")
            .map(|_| ())
    });
    assert!(res.iter().all(Result::is_ok), "{res:?}");
}
