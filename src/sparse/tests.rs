use super::*;
use crate::codec::{CodecConfig, Rgc, RgcMethod};
use crate::comm::{LocalComm, Transport};
use proptest::prelude::*;

fn names(id: u32) -> String {
    format!("layer{id}")
}

fn sample(step: u64) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut c = Rgc::new(0.1, RgcMethod::Exact).expect("codec");
    let units: Vec<Vec<u8>> = [50usize, 0, 10]
        .iter()
        .map(|&n| {
            let x: Vec<f32> = (0..n).map(|i| i as f32 - 3.0).collect();
            let mut u = Vec::new();
            c.encode(&x, &mut u).expect("encode");
            u
        })
        .collect();
    let mut buf = Vec::new();
    write_fused(
        &mut buf,
        step,
        [
            (0u32, EntryKind::Unit, &units[0][..]),
            (2, EntryKind::Unit, &units[1][..]),
            (5, EntryKind::NonFinite, &[][..]),
        ],
    );
    (buf, units)
}

#[test]
fn fused_message_round_trips() {
    let (buf, units) = sample(7);
    let mut e = Vec::new();
    parse_fused(&buf, 0, 7, &[0, 2, 5], &names, &mut e).expect("parses");
    assert_eq!(e.len(), 3);
    assert_eq!(&buf[e[0].start..e[0].end], &units[0][..]);
    assert_eq!(&buf[e[1].start..e[1].end], &units[1][..]);
    assert_eq!(e[2].kind, EntryKind::NonFinite);
    assert_eq!(e[2].start, e[2].end);
    // Wrong step, wrong table: named errors.
    let err = parse_fused(&buf, 3, 8, &[0, 2, 5], &names, &mut e).expect_err("step");
    assert!(err.to_string().contains("rank 3"), "{err}");
    let err = parse_fused(&buf, 1, 7, &[0, 3, 5], &names, &mut e).expect_err("table");
    assert!(err.to_string().contains("layer3"), "{err}");
}

#[test]
fn a_corrupt_unit_names_rank_and_layer() {
    let out = LocalComm::run(3, |c| {
        let mut codec = Rgc::new(0.1, RgcMethod::Trimmed).expect("codec");
        let x: Vec<f32> = (0..100).map(|i| (i * (c.rank() + 1)) as f32).collect();
        let mut unit = Vec::new();
        codec.encode(&x, &mut unit).expect("encode");
        if c.rank() == 1 {
            let last = unit.len() - 5;
            unit[last] = 0xff; // a value byte: becomes NaN/huge or stays finite
            unit[20] = 0xff; // an index byte: out of range
        }
        let mut msg = Vec::new();
        write_fused(&mut msg, 0, [(4u32, EntryKind::Unit, &unit[..])]);
        let mut g = Gathered::default();
        fused_allgather(&c, &msg, AllgathervAlgo::RecursiveDoubling, &mut g).expect("gather");
        let mut entries = Vec::new();
        for r in 0..c.size() {
            let mut e = Vec::new();
            parse_fused(g.message(r), r, 0, &[4], &names, &mut e).expect("framing is intact");
            entries.push(e[0]);
        }
        let mut acc = vec![0f32; 100];
        unpack_layer(&g, &entries, &codec, "fc1", 1.0, &mut acc).map_err(|e| e.to_string())
    });
    for r in out {
        let e = r.expect_err("rank 1's unit is corrupt");
        assert!(e.contains("rank 1") && e.contains("fc1"), "{e}");
    }
}

#[test]
fn unpack_adds_every_rank_in_rank_order() {
    let (buf, units) = sample(0);
    let g = Gathered {
        data: [buf.clone(), buf.clone()].concat(),
        displs: vec![0, buf.len(), 2 * buf.len()],
        ..Default::default()
    };
    let mut e = Vec::new();
    parse_fused(&buf, 0, 0, &[0, 2, 5], &names, &mut e).expect("parses");
    // Entries are relative to each rank's message.
    let entries = [e[0], e[0]];
    let codec = CodecConfig::Rgc {
        density: 0.1,
        method: RgcMethod::Exact,
    }
    .build()
    .expect("codec");
    let mut acc = vec![1f32; 50];
    let bad = unpack_layer(&g, &entries, codec.as_ref(), "l", 1.0, &mut acc).expect("unpacks");
    assert_eq!(bad, None);
    let mut one = vec![0f32; 50];
    codec.decode(&units[0], &mut one).expect("decode");
    let want: Vec<f32> = one.iter().map(|x| x + x).collect();
    assert_eq!(acc, want);
    let entries = [e[2], e[2]];
    let bad = unpack_layer(&g, &entries, codec.as_ref(), "l", 1.0, &mut acc).expect("no units");
    assert_eq!(bad, Some(0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn hostile_fused_messages_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut e = Vec::new();
        let _ = parse_fused(&bytes, 0, 0, &[0, 1], &names, &mut e);
    }

    #[test]
    fn mutated_and_truncated_messages_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let (mut buf, _) = sample(1);
        for (i, b) in flips {
            let i = i.index(buf.len());
            buf[i] ^= b;
        }
        let cut = cut.index(buf.len() + 1);
        let mut e = Vec::new();
        if parse_fused(&buf[..cut], 0, 1, &[0, 2, 5], &names, &mut e).is_ok() {
            for x in &e {
                prop_assert!(x.start <= x.end && x.end <= cut);
            }
        }
    }
}

/// The counted unpacking (the engine's fill measurement) reports exactly
/// the nonzero elements of the result, cancellations included (values
/// in {-2..2}, so pairs from different ranks often sum to zero), writes
/// the same bits as `unpack_layer`, and counts nothing for a dense codec.
#[test]
fn counting_unpack_counts_the_nonzero_results_exactly() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let sparse = CodecConfig::Rgc {
        density: 0.3,
        method: RgcMethod::Exact,
    };
    for (cfg, counts) in [(sparse, true), ("fp16".parse().expect("codec"), false)] {
        for trial in 0..50 {
            let (p, n) = (rng.gen_range(1..6), rng.gen_range(1..80));
            let mut codec = cfg.build().expect("codec");
            let mut g = Gathered::default();
            g.displs.push(0);
            let mut entries = Vec::new();
            for _ in 0..p {
                let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-2i32..=2) as f32).collect();
                let mut unit = Vec::new();
                codec.encode(&x, &mut unit).expect("encode");
                let mut msg = Vec::new();
                write_fused(&mut msg, 0, [(0u32, EntryKind::Unit, &unit[..])]);
                let mut e = Vec::new();
                parse_fused(&msg, 0, 0, &[0], &names, &mut e).expect("parses");
                entries.push(e[0]);
                g.data.extend_from_slice(&msg);
                g.displs.push(g.data.len());
            }
            let at = format!("{cfg:?} trial {trial} p {p} n {n}");
            let mut plain = vec![9f32; n];
            unpack_layer(&g, &entries, codec.as_ref(), "l", 0.5, &mut plain).expect("unpacks");
            let mut acc = vec![9f32; n];
            let (bad, nnz) =
                unpack_layer_counting(&g, &entries, codec.as_ref(), "l", 0.5, &mut acc, true)
                    .expect("unpacks");
            assert_eq!(bad, None, "{at}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&acc), bits(&plain), "{at}");
            let want = acc.iter().filter(|&&x| x != 0.0).count();
            assert_eq!(nnz, counts.then_some(want), "{at}");
            let (_, none) =
                unpack_layer_counting(&g, &entries, codec.as_ref(), "l", 0.5, &mut acc, false)
                    .expect("unpacks");
            assert_eq!(none, None, "{at}");
        }
    }
}
