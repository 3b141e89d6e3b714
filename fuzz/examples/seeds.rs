//! Writes the seed corpora (valid inputs of every target) under
//! `fuzz/corpus/<target>/seed-*`: `cargo run --release --example seeds`
//! in `fuzz/` (see fuzz/README.md). The campaign's minimized corpora are
//! kept in the same folders.

use gradsync::codec::CodecConfig;
use gradsync::cost::Profile;
use gradsync::sparse::{write_failed, write_fused, EntryKind};
use std::path::{Path, PathBuf};

use gradsync_fuzz::CODECS as CONFIGS;

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(format!("seed-{name}")), bytes).expect("write seed");
}

fn dir(root: &Path, target: &str) -> PathBuf {
    let d = root.join(target);
    std::fs::create_dir_all(&d).expect("corpus dir");
    d
}

fn vector(n: usize, k: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2_654_435_761).wrapping_add(k) >> 8) as f32
                / (1u32 << 24) as f32
                - 0.5)
                * if i % 7 == 0 { 4.0 } else { 1.0 }
        })
        .collect()
}

fn npy(version: u8, descr: &str, fortran: bool, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}",
        if fortran { "True" } else { "False" }
    );
    let prefix = if version == 1 { 10 } else { 12 };
    while (prefix + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.push(version);
    out.push(0);
    if version == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn main() {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "corpus".into()));

    // codec_decode: [config index, length selector 0 (the header's n), message];
    // and each codec's state after a few encodes (the set_state path).
    let d = dir(&root, "codec_decode");
    let mut units = Vec::new();
    for (i, s) in CONFIGS.iter().enumerate() {
        let cfg: CodecConfig = s.parse().expect("config");
        let mut c = cfg.build().expect("codec");
        for (j, n) in [0usize, 1, 37, 300].into_iter().enumerate() {
            let mut wire = Vec::new();
            if c.encode(&vector(n, j as u32), &mut wire).is_ok() {
                let mut seed = vec![i as u8, 0];
                seed.extend_from_slice(&wire);
                put(&d, &format!("{i}-{n}"), &seed);
                if n == 37 {
                    units.push(wire);
                }
            }
        }
        let state = c.state();
        if !state.is_empty() {
            let mut seed = vec![i as u8, 1];
            seed.extend_from_slice(&state);
            put(&d, &format!("{i}-state"), &seed);
        }
    }

    // fused: [expected layer count, message for step 3].
    let d = dir(&root, "fused");
    for u in [0usize, 1, 3, 8] {
        let entries: Vec<(u32, EntryKind, &[u8])> = (0..u)
            .map(|l| {
                if l % 3 == 2 {
                    (l as u32, EntryKind::NonFinite, &[][..])
                } else {
                    (l as u32, EntryKind::Unit, &units[l % units.len()][..])
                }
            })
            .collect();
        let mut buf = Vec::new();
        write_fused(&mut buf, 3, entries.iter().copied());
        let mut seed = vec![u as u8];
        seed.extend_from_slice(&buf);
        put(&d, &format!("fused-{u}"), &seed);
    }
    let mut buf = Vec::new();
    write_failed(
        &mut buf,
        3,
        "rank 2: layer \"fc\": 3 elements, registered 4",
    );
    put(&d, "failed", &[&[1u8][..], &buf].concat());

    // snapshot: the target's engine after 0, 2 and 5 steps (GradiVeQ
    // collecting samples, then compressing).
    let d = dir(&root, "snapshot");
    let mut e = gradsync_fuzz::engine();
    let mut at = 0;
    for to in [0u64, 2, 5] {
        gradsync_fuzz::run_steps(&mut e, at, to).expect("steps");
        at = to;
        // The target appends the CRC-32 trailer itself: keep the payload.
        let file = e.snapshot_bytes().expect("snapshot");
        put(&d, &format!("step{to}"), &file[..file.len() - 4]);
    }

    // npy: f32/f64, both byte orders, C and Fortran order, versions 1-3.
    let d = dir(&root, "npy");
    let f4: Vec<u8> = vector(6, 1).iter().flat_map(|x| x.to_le_bytes()).collect();
    let f4be: Vec<u8> = vector(6, 1).iter().flat_map(|x| x.to_be_bytes()).collect();
    let f8: Vec<u8> = vector(6, 1)
        .iter()
        .flat_map(|&x| f64::from(x).to_le_bytes())
        .collect();
    let f8be: Vec<u8> = vector(6, 1)
        .iter()
        .flat_map(|&x| f64::from(x).to_be_bytes())
        .collect();
    put(&d, "f4", &npy(1, "<f4", false, "(2, 3)", &f4));
    put(&d, "f4be-fortran", &npy(1, ">f4", true, "(3, 2)", &f4be));
    put(&d, "f8", &npy(2, "<f8", false, "(6,)", &f8));
    put(&d, "f8be", &npy(3, ">f8", false, "(1, 6)", &f8be));
    put(&d, "scalar", &npy(1, "<f4", false, "()", &f4[..4]));
    put(&d, "empty", &npy(1, "<f4", false, "(0, 3)", &[]));

    // profile: a network-only profile and one with every table.
    let d = dir(&root, "profile");
    let p = Profile::from_network(2e-6, 1e10, 1e-10, 2e-10).expect("profile");
    put(&d, "network", &serde_json::to_vec(&p).expect("json"));
    let full = r#"{"version":2,"alpha":3e-6,"beta":1e-10,"gamma_reduce":1e-10,"gamma_unpack":2e-9,
"beta_curve":[{"bytes":1024,"per_byte":3e-10},{"bytes":1048576,"per_byte":1e-10}],
"gamma_reduce_curve":[{"bytes":4096,"per_byte":2e-10},{"bytes":4194304,"per_byte":1e-10}],
"select":{"trimmed":{"a":1e-5,"b":2e-9},"threshold":{"a":1e-5,"b":1e-9},"quant":{"a":1e-5,"b":3e-9},"trimmed@0.01":{"a":1e-5,"b":4e-9}},
"codecs":{"fp16":{"encode":{"a":1e-6,"b":1e-9},"decode":{"a":1e-6,"b":1e-9}},"3lc":{"encode":{"a":1e-6,"b":5e-9},"decode":{"a":1e-6,"b":4e-9},"bytes_per_element":0.3}},
"gradiveq_compress":{"a":1e-5,"b":1e-8},"gradiveq_decompress":{"a":1e-5,"b":1e-8},
"pingpong":{"a":2e-6,"b":1e-10},"allgather":{"a":2e-6,"b":1e-10},
"meta":{"machine":"fuzz","mpi":"Open MPI 4.1","date":"2025-01-01","ranks":8,"note":"seed"}}"#;
    let path = gradsync_fuzz::scratch("seed-profile.json");
    std::fs::write(&path, full).expect("write");
    Profile::load(&path).expect("full seed profile loads");
    std::fs::remove_file(&path).ok();
    put(&d, "full", full.as_bytes());
    put(&d, "v1", br#"{"version":1,"alpha":1e-6,"beta":1e-9}"#);

    // layers: both shapes of the file and the shipped examples' shape.
    let d = dir(&root, "layers");
    put(
        &d,
        "object",
        br#"{"model":"m","layers":[{"name":"fc.weight","elements":4096},{"name":"fc.bias","elements":64}]}"#,
    );
    put(
        &d,
        "array",
        br#"[{"name":"a","elements":1},{"name":"b","elements":0}]"#,
    );
    println!("seeds written under {}", root.display());
}
