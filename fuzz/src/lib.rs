//! Shared setup of the fuzz targets and of the seed generator
//! (`examples/seeds.rs`): the snapshot target's engine, its deterministic
//! gradients, and the temp file the path-taking loaders read.

use gradsync::codec::CodecConfig;
use gradsync::comm::LocalComm;
use gradsync::gradiveq::{schedule::ScheduleConfig, Dim};
use gradsync::sync::{Config, GradSync, Strategy, Warmup};

/// Codec configurations of the `codec_decode` target (byte 0 of an input
/// picks one): every codec, plus the variants whose decoders take another path
/// (3LC stages, QSGD bit widths and buckets, FastSGD flag sizes, RGC
/// selection methods).
pub const CODECS: &[&str] = &[
    "none",
    "fp16",
    "int8",
    "qsgd",
    "rgc",
    "rgc-quant",
    "sbc",
    "3lc",
    "fastsgd",
    "qsgd:bits=2",
    "qsgd:bits=8,bucket=16",
    "3lc:s=1.5,stage=quartic",
    "3lc:s=1.5,stage=quant",
    "fastsgd:b=2,tau=16,l=1",
    "fastsgd:b=1.02,tau=128,l=4",
    "rgc:method=threshold",
    "sbc:p=0.5",
];

/// Layers of the snapshot target's engine: every kind of per-layer state
/// (dense, each stateful codec, momentum, density warm-up, GradiVeQ).
pub const LAYERS: &[(&str, usize, &str)] = &[
    ("dense", 64, "dense"),
    ("thr", 300, "rgc:method=threshold"),
    ("quant", 200, "rgc-quant"),
    ("qsgd", 100, "qsgd"),
    ("sbc", 200, "sbc"),
    ("3lc", 100, "3lc"),
    ("fastsgd", 100, "fastsgd"),
    ("conv", 64, "gradiveq"),
];

/// GradiVeQ schedule of the `conv` layer: collects samples from step 1,
/// compresses from step 3 (so a few steps cover every state).
pub fn gvq_cfg() -> ScheduleConfig {
    ScheduleConfig {
        k: 16,
        dim: Dim::Fixed(2),
        reuse: None,
        warmup: 1,
        lt: 2,
        lc: 1000,
        loss_threshold: 0.5,
        qsgd_bits: 8,
        qsgd_bucket: 0,
    }
}

/// A one-rank engine over [`LocalComm`] with [`LAYERS`] registered.
pub fn engine() -> GradSync<LocalComm> {
    let comm = LocalComm::create(1).pop().expect("one rank");
    let cfg = Config {
        overlap: false,
        momentum: 0.9,
        warmup: Warmup::Density {
            schedule: vec![0.25, 0.0625],
            steps_per_stage: 1,
        },
        ..Config::default()
    };
    let mut s = GradSync::with_transport(comm, cfg).expect("engine");
    for &(name, n, codec) in LAYERS {
        let strategy = match codec {
            "dense" => Strategy::Dense,
            "gradiveq" => Strategy::Gradiveq(gvq_cfg()),
            c => Strategy::Sparse {
                codec: c.parse::<CodecConfig>().expect("codec"),
                density: None,
            },
        };
        s.register_with(name, &[n], strategy).expect("register");
    }
    s
}

/// Deterministic gradients of step `t` (a small LCG; no RNG dependency).
pub fn grads(t: u64) -> Vec<Vec<f32>> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ t.wrapping_mul(0x2545_F491_4F6C_DD1D);
    LAYERS
        .iter()
        .map(|&(_, n, _)| {
            (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
                })
                .collect()
        })
        .collect()
}

/// Run steps `from..to` on `s`; the first error is returned.
pub fn run_steps(s: &mut GradSync<LocalComm>, from: u64, to: u64) -> gradsync::Result<()> {
    for t in from..to {
        let mut g = grads(t);
        let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
        s.sync(&mut v)?;
    }
    Ok(())
}

/// A per-process scratch file named `name` (the path-taking loaders read
/// the fuzz input from it).
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("gradsync-fuzz-{}-{name}", std::process::id()))
}
