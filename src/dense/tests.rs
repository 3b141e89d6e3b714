//! Unit and property tests of the dense collectives on the in-process transport.
#![allow(clippy::needless_range_loop)]

use super::*;
use crate::comm::LocalComm;
use proptest::prelude::*;

/// Integer-valued input of rank `r`: sums are exact in any order.
fn int_input(r: usize, n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761 + r as u64 * 40503 + seed) % 201) as f32 - 100.0)
        .collect()
}

fn expected_sum(p: usize, n: usize, seed: u64) -> Vec<f32> {
    let mut acc = vec![0f64; n];
    for r in 0..p {
        for (a, x) in acc.iter_mut().zip(int_input(r, n, seed)) {
            *a += x as f64;
        }
    }
    acc.into_iter().map(|x| x as f32).collect()
}

fn run_allreduce(
    p: usize,
    n: usize,
    seed: u64,
    algo: AllreduceAlgo,
    opts: AllreduceOptions,
) -> Vec<Vec<f32>> {
    LocalComm::run(p, |c| {
        let mut buf = int_input(c.rank(), n, seed);
        allreduce(&c, &mut buf, algo, &opts).expect("allreduce");
        buf
    })
}

const ALGOS: [AllreduceAlgo; 2] = [AllreduceAlgo::Rabenseifner, AllreduceAlgo::Ring];

#[test]
fn fold_maps_virtual_ranks_back() {
    for p in 1..=33 {
        let f = Fold::new(p);
        assert!(f.p2.is_power_of_two() && f.p2 <= p && p < 2 * f.p2);
        let vranks: Vec<usize> = (0..p).filter_map(|r| f.vrank(r)).collect();
        assert_eq!(vranks, (0..f.p2).collect::<Vec<_>>(), "p={p}");
        for r in 0..p {
            if let Some(v) = f.vrank(r) {
                assert_eq!(f.real(v), r);
            }
        }
        assert_eq!(f.real(f.p2), p);
    }
}

#[test]
fn exact_sums_for_edge_counts() {
    for p in 1usize..=9 {
        for n in [0, 1, p.saturating_sub(1), p, p + 1, 2 * p + 1, 1000] {
            let want = expected_sum(p, n, 7);
            for algo in ALGOS {
                for chunk in [0, 1, 3] {
                    let opts = AllreduceOptions {
                        chunk_elems: chunk,
                        ..Default::default()
                    };
                    for (r, got) in run_allreduce(p, n, 7, algo, opts).iter().enumerate() {
                        assert_eq!(got, &want, "p={p} n={n} {algo:?} chunk={chunk} rank={r}");
                    }
                }
            }
        }
    }
}

#[test]
fn average_divides_by_p() {
    for p in [1, 2, 3, 6, 8] {
        for algo in ALGOS {
            for chunk in [0, 2] {
                let opts = AllreduceOptions {
                    op: ReduceOp::Average,
                    chunk_elems: chunk,
                    ..Default::default()
                };
                let out = LocalComm::run(p, |c| {
                    let mut b = vec![(c.rank() * 2) as f64; 13];
                    allreduce(&c, &mut b, algo, &opts).unwrap();
                    b
                });
                for b in out {
                    assert!(
                        b.iter().all(|&x| x == (p - 1) as f64),
                        "p={p} {algo:?}: {b:?}"
                    );
                }
                // Sums that p does not divide: the correctly rounded
                // quotient, as MPI_Allreduce then `/ p` gives (`· (1/p)`
                // missed it by an ulp for some, e.g. 28/3).
                let out = LocalComm::run(p, |c| {
                    let mut b: Vec<f32> = (0..300)
                        .map(|i| (i + usize::from(c.rank() == 0)) as f32)
                        .collect();
                    allreduce(&c, &mut b, algo, &opts).unwrap();
                    b
                });
                for b in out {
                    for (i, &x) in b.iter().enumerate() {
                        let want = (p * i + 1) as f32 / p as f32;
                        assert_eq!(x, want, "p={p} {algo:?} element {i}");
                    }
                }
            }
        }
    }
}

/// The average is the last reduce step's sum divided in the same pass
/// (a multiply by the exact `1/p` where `p` is a power of two): bit for
/// bit the sum then `/ p` on every rank, for both algorithms, pipelined
/// or not, with values whose sums round (not integers), at powers of two
/// and at folded counts.
#[test]
fn average_is_the_sum_then_divided_bitwise() {
    for algo in ALGOS {
        for chunk in [0, 3] {
            let opts = |op| AllreduceOptions {
                op,
                chunk_elems: chunk,
                ..Default::default()
            };
            for p in [2, 3, 4, 5, 7, 8] {
                for n in [1, 2, 5, 1000] {
                    let input = |r: usize| -> Vec<f32> {
                        (0..n)
                            .map(|i| ((i * 7919 + r * 104729) % 1009) as f32 * 0.1037 - 50.3)
                            .collect()
                    };
                    let run = |op| {
                        LocalComm::run(p, |c| {
                            let mut b = input(c.rank());
                            allreduce(&c, &mut b, algo, &opts(op)).unwrap();
                            b
                        })
                    };
                    let (sums, avgs) = (run(ReduceOp::Sum), run(ReduceOp::Average));
                    for (s, a) in sums.iter().zip(&avgs) {
                        let want: Vec<u32> = s.iter().map(|&x| (x / p as f32).to_bits()).collect();
                        let got: Vec<u32> = a.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(got, want, "{algo:?} chunk {chunk} p={p} n={n}");
                    }
                }
            }
        }
    }
}

#[test]
fn mismatch_is_reported_on_every_rank() {
    for p in [2, 3, 5] {
        for algo in ALGOS {
            let out = LocalComm::run(p, |c| {
                let mut b = vec![1.0f32; 10 + c.rank()];
                let r = allreduce(&c, &mut b, algo, &AllreduceOptions::default());
                // The communicator keeps working afterwards.
                let mut ok = vec![1.0f32; 4];
                allreduce(&c, &mut ok, algo, &AllreduceOptions::default()).unwrap();
                (r, ok)
            });
            for (r, (res, ok)) in out.into_iter().enumerate() {
                match res {
                    Err(Error::SizeMismatch {
                        local,
                        min,
                        max,
                        min_rank,
                        max_rank,
                    }) => {
                        assert_eq!(
                            (local, min, max, min_rank, max_rank),
                            ((10 + r) as u64, 10, (10 + p - 1) as u64, 0, p - 1)
                        );
                    }
                    other => panic!("p={p} rank {r}: expected SizeMismatch, got {other:?}"),
                }
                assert_eq!(ok, vec![p as f32; 4]);
            }
        }
    }
}

#[test]
fn mpi_algo_is_unsupported_in_process() {
    let out = LocalComm::run(2, |c| {
        let mut b = vec![1.0f32; 3];
        allreduce(&c, &mut b, AllreduceAlgo::Mpi, &AllreduceOptions::default())
    });
    assert!(out.iter().all(|r| matches!(r, Err(Error::Unsupported(_)))));
}

#[test]
fn workspace_is_reused_across_calls() {
    LocalComm::run(3, |c| {
        let mut ws = Workspace::new();
        for n in [100, 10, 100] {
            let mut b = vec![1.0f32; n];
            rabenseifner_allreduce_with(&c, &mut b, &AllreduceOptions::default(), &mut ws).unwrap();
            assert!(b.iter().all(|&x| x == 3.0));
        }
        assert!(ws.tmp.len() <= 51 && ws.tmp.capacity() == ws.tmp.len());
    });
}

#[test]
fn allgatherv_with_empty_and_uneven_messages() {
    for p in 1..=9 {
        for lens in [
            vec![0; p],
            (0..p).collect::<Vec<_>>(),
            (0..p).map(|r| (r * 37) % 5).collect(),
        ] {
            let expected: Vec<u8> = (0..p).flat_map(|r| vec![r as u8 + 1; lens[r]]).collect();
            let out = LocalComm::run(p, |c| {
                allgatherv(
                    &c,
                    &vec![c.rank() as u8 + 1; lens[c.rank()]],
                    AllgathervAlgo::RecursiveDoubling,
                )
                .unwrap()
            });
            for g in out {
                assert_eq!(g.data, expected, "p={p} lens={lens:?}");
                assert_eq!(g.len(), p);
                for r in 0..p {
                    assert_eq!(g.message(r).len(), lens[r]);
                }
            }
        }
    }
}

#[test]
fn split_ref_mut_handles_empty_and_adjacent_ranges() {
    let mut v: Vec<u32> = (0..10).collect();
    let (a, b) = split_ref_mut(&mut v, 5..5, 5..10);
    assert!(a.is_empty() && b.len() == 5);
    let (a, b) = split_ref_mut(&mut v, 5..10, 5..5);
    assert!(a.len() == 5 && b.is_empty());
    let (a, b) = split_ref_mut(&mut v, 6..9, 0..2);
    assert_eq!((a, &*b), (&[6, 7, 8][..], &[0, 1][..]));
}

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 40,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn prop_allreduce_exact(p in 1usize..=17, n in 0usize..10_000, seed in any::<u64>(),
                            algo_ix in 0usize..2, chunk in prop_oneof![Just(0usize), 1usize..600]) {
        let algo = ALGOS[algo_ix];
        let want = expected_sum(p, n, seed % 1000);
        let opts = AllreduceOptions { chunk_elems: chunk, ..Default::default() };
        for got in run_allreduce(p, n, seed % 1000, algo, opts) {
            prop_assert_eq!(&got, &want);
        }
    }

    #[test]
    fn prop_allreduce_float_within_order_tolerance(p in 1usize..=17, n in 0usize..3_000, seed in any::<u64>(), algo_ix in 0usize..2) {
        let algo = ALGOS[algo_ix];
        let input = |r: usize| -> Vec<f32> {
            let mut s = seed ^ (r as u64 + 1).wrapping_mul(0x9E3779B97F4A7C15) | 1;
            (0..n).map(|_| { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5 }).collect()
        };
        let mut exact = vec![0f64; n];
        let mut abs = vec![0f64; n];
        for r in 0..p { for (i, x) in input(r).into_iter().enumerate() { exact[i] += x as f64; abs[i] += (x as f64).abs(); } }
        let out = LocalComm::run(p, |c| { let mut b = input(c.rank()); allreduce(&c, &mut b, algo, &AllreduceOptions::default()).unwrap(); b });
        for got in &out {
            for i in 0..n {
                let tol = (p as f64 + 1.0) * f32::EPSILON as f64 * abs[i];
                prop_assert!((got[i] as f64 - exact[i]).abs() <= tol, "i={} got={} exact={}", i, got[i], exact[i]);
            }
            // All ranks hold bitwise the same result.
            prop_assert_eq!(got, &out[0]);
        }
    }

    #[test]
    fn prop_allgatherv(p in 1usize..=17, lens in proptest::collection::vec(0usize..700, 17), seed in any::<u8>()) {
        let byte = |r: usize, i: usize| (r as u8).wrapping_mul(31).wrapping_add(i as u8).wrapping_add(seed);
        let expected: Vec<u8> = (0..p).flat_map(|r| (0..lens[r]).map(move |i| byte(r, i))).collect();
        let out = LocalComm::run(p, |c| {
            let mine: Vec<u8> = (0..lens[c.rank()]).map(|i| byte(c.rank(), i)).collect();
            allgatherv(&c, &mine, AllgathervAlgo::RecursiveDoubling).unwrap()
        });
        for g in out {
            prop_assert_eq!(&g.data, &expected);
            for r in 0..p { prop_assert_eq!(g.message(r).len(), lens[r]); }
        }
    }
}

#[test]
fn a_panicking_rank_fails_the_others_fast() {
    let start = std::time::Instant::now();
    let r = std::panic::catch_unwind(|| {
        LocalComm::run(3, |c| {
            if c.rank() == 1 {
                panic!("injected");
            }
            let mut b = vec![1.0f32; 8];
            allreduce(
                &c,
                &mut b,
                AllreduceAlgo::Ring,
                &AllreduceOptions::default(),
            )
        })
    });
    assert!(r.is_err());
    assert!(start.elapsed() < std::time::Duration::from_secs(20));
}

#[test]
fn in_process_barrier_and_exact_receives() {
    use crate::comm::Transport;
    LocalComm::run(4, |c| {
        for _ in 0..3 {
            c.barrier().unwrap();
        }
        let (p, r) = (c.size(), c.rank());
        let mut got = [0u32; 2];
        c.sendrecv(&[r as u32; 2], (r + 1) % p, &mut got, (r + p - 1) % p, 99)
            .unwrap();
        assert_eq!(got, [((r + p - 1) % p) as u32; 2]);
        // A receive of the wrong length is an error, not a truncation.
        c.send(&[1u32; 3], (r + 1) % p, 98).unwrap();
        let mut short = [0u32; 2];
        assert!(matches!(
            c.recv(&mut short, (r + p - 1) % p, 98),
            Err(Error::MessageSize {
                expected: 2,
                got: 3,
                ..
            })
        ));
        assert!(matches!(
            c.send(&[1u8], 9, 1),
            Err(Error::InvalidArgument(_))
        ));
    });
}

#[test]
fn ring_chunks_are_bounded_per_segment() {
    assert_eq!(effective_chunk(0, 1000), 0);
    assert_eq!(effective_chunk(7, 100), 7);
    assert_eq!(effective_chunk(7, 1_000_000), 62_500);
    for seg in [1usize, 15, 16, 17, 1000, 524_290] {
        for req in [1usize, 3, 100] {
            let c = effective_chunk(req, seg);
            assert!(
                c >= req && seg.div_ceil(c) <= MAX_CHUNKS_PER_SEGMENT,
                "seg={seg} req={req} c={c}"
            );
        }
    }
}

/// `allreduce_agreed` (the bindings' entry): a rank-local error, a length or
/// a dtype that differs on one rank fails every rank alike; otherwise the
/// result equals the plain allreduce's.
#[test]
fn allreduce_agreed_fails_every_rank_alike() {
    for p in [1usize, 2, 3, 5] {
        for case in 0..6 {
            let out = LocalComm::run(p, move |c| {
                let r = c.rank();
                let last = r == p - 1;
                let mut a = vec![r as f32 + 1.0; if case == 2 && last { 6 } else { 5 }];
                let mut b = vec![r as f64 + 1.0; 5];
                let algo = if case == 4 && last {
                    AllreduceAlgo::Rabenseifner
                } else {
                    AllreduceAlgo::Ring
                };
                let op = if case == 5 && last {
                    ReduceOp::Average
                } else {
                    ReduceOp::Sum
                };
                let call = match case {
                    1 if last => Err(Error::InvalidArgument("array is read-only".into())),
                    3 if last => Ok((AnyBuf::F64(&mut b), algo, op)),
                    _ => Ok((AnyBuf::F32(&mut a), algo, op)),
                };
                allreduce_agreed(&c, call)
                    .map(|()| a[0])
                    .map_err(|e| e.to_string())
            });
            let sum = (p * (p + 1) / 2) as f32;
            for (i, o) in out.iter().enumerate() {
                let err = || o.as_ref().unwrap_err().clone();
                match case {
                    1 => {
                        let e = err();
                        assert!(e.contains(&format!("rank {} failed", p - 1)), "{e}");
                        assert!(e.contains("read-only"), "{e}");
                    }
                    _ if case == 0 || p == 1 => {
                        let want = if case == 5 && p == 1 { 1.0 } else { sum };
                        assert_eq!(o, &Ok(want), "p={p} case={case}")
                    }
                    // The last rank is the odd one: every rank names it.
                    2 => assert!(
                        err().contains("size mismatch")
                            && err().contains(&format!("5 (rank 0) and 6 (rank {})", p - 1)),
                        "rank {i}: {o:?}"
                    ),
                    _ => {
                        let what = ["dtype", "algorithm", "operation"][case - 3];
                        let e = err();
                        assert!(e.contains(&format!("{what} differs")), "rank {i}: {e}");
                        assert!(
                            e.contains(&format!("rank {} passed other than rank 0", p - 1)),
                            "rank {i}: {e}"
                        );
                    }
                }
            }
        }
    }
}

// ---- the node-aware allreduce (hierarchical.rs) ----

fn run_hierarchical(p: usize, n: usize, seed: u64, nodes: &[usize], op: ReduceOp) -> Vec<Vec<f32>> {
    LocalComm::run(p, |c| {
        let mut buf = int_input(c.rank(), n, seed);
        let opts = AllreduceOptions {
            op,
            ..Default::default()
        };
        hierarchical_allreduce(&c, &mut buf, nodes, &opts).expect("hierarchical allreduce");
        buf
    })
}

/// Even, uneven, interleaved and one-rank-per-node maps: the exact sum on
/// every rank, and the average as the flat algorithms compute it.
#[test]
fn hierarchical_exact_for_node_maps() {
    let maps: Vec<Vec<usize>> = vec![
        vec![0],
        vec![0, 0],
        vec![0, 1],
        vec![0, 0, 1, 1],
        vec![0, 1, 0, 1],
        vec![5, 5, 5, 9, 9],
        vec![0, 0, 1, 1, 1, 1, 2],
        vec![0, 1, 2],
        vec![3, 3, 3, 3, 3, 3, 3, 3],
        vec![0, 0, 0, 1, 1, 1, 2, 2, 2],
    ];
    for nodes in &maps {
        let p = nodes.len();
        for n in [0, 1, p.saturating_sub(1), p + 1, 7, 1000, 4099] {
            let want = expected_sum(p, n, 3);
            for got in run_hierarchical(p, n, 3, nodes, ReduceOp::Sum) {
                assert_eq!(got, want, "nodes {nodes:?} n {n}");
            }
            let avg: Vec<f32> = want.iter().map(|&x| x / p as f32).collect();
            for got in run_hierarchical(p, n, 3, nodes, ReduceOp::Average) {
                assert_eq!(got, avg, "average, nodes {nodes:?} n {n}");
            }
        }
    }
}

/// A node map of the wrong length, and lengths that differ across ranks,
/// are errors (on every rank for the lengths).
#[test]
fn hierarchical_bad_inputs_are_errors() {
    let out = LocalComm::run(3, |c| {
        let mut b = vec![1f32; 4];
        hierarchical_allreduce(&c, &mut b, &[0, 0], &AllreduceOptions::default()).is_err()
    });
    assert!(out.iter().all(|&e| e));
    let out = LocalComm::run(4, |c| {
        let mut b = vec![1f32; 4 + usize::from(c.rank() == 2)];
        hierarchical_allreduce(&c, &mut b, &[0, 0, 1, 1], &AllreduceOptions::default())
    });
    assert!(
        out.iter()
            .all(|r| matches!(r, Err(Error::SizeMismatch { .. }))),
        "{out:?}"
    );
    // One rank's map of the wrong length, or a map that differs on one
    // rank: the same error on every rank (not a hang in the node groups).
    let out = LocalComm::run(4, |c| {
        let mut b = vec![1f32; 8];
        let map: &[usize] = if c.rank() == 3 {
            &[0, 0, 1]
        } else {
            &[0, 0, 1, 1]
        };
        hierarchical_allreduce(&c, &mut b, map, &AllreduceOptions::default())
    });
    assert!(
        out.iter()
            .all(|r| matches!(r, Err(Error::RankFailed { rank: 3, .. }))),
        "{out:?}"
    );
    let out = LocalComm::run(4, |c| {
        let mut b = vec![1f32; 8];
        let map: &[usize] = if c.rank() == 1 {
            &[0, 1, 0, 1]
        } else {
            &[0, 0, 1, 1]
        };
        hierarchical_allreduce(&c, &mut b, map, &AllreduceOptions::default())
    });
    assert!(
        out.iter()
            .all(|r| matches!(r, Err(Error::ArgumentMismatch(m)) if m.contains("rank 1 passed other values than rank 0"))),
        "{out:?}"
    );
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn prop_hierarchical_exact(nodes in proptest::collection::vec(0usize..4, 1..=10),
                               n in 0usize..5_000, seed in any::<u64>()) {
        let p = nodes.len();
        let want = expected_sum(p, n, seed % 1000);
        for got in run_hierarchical(p, n, seed % 1000, &nodes, ReduceOp::Sum) {
            prop_assert_eq!(&got, &want);
        }
    }
}

/// The node-aware allgatherv against the flat one's expected bytes, for
/// node maps in blocks (in place), interleaved and uneven (through the
/// scratch buffer), with one node and with one rank per node (the flat
/// fallback), empty and uneven messages included.
#[test]
fn node_allgatherv_equals_the_flat_result_for_any_node_map() {
    let maps: Vec<Vec<usize>> = vec![
        vec![0],
        vec![0, 0],
        vec![0, 1],
        vec![0, 0, 1, 1],
        vec![0, 1, 0, 1],
        vec![0, 0, 2, 2, 4, 4],
        vec![7, 3, 7, 3, 7, 3],
        vec![0, 0, 0, 1, 1],
        vec![5, 1, 1, 5, 9, 1, 5],
        vec![0, 1, 2, 3, 4],
        vec![4; 6],
        vec![0, 0, 0, 0, 1, 2, 2, 3, 3, 3],
    ];
    for nodes in &maps {
        let p = nodes.len();
        for lens in [
            vec![0; p],
            (0..p).map(|r| r * 5 + 1).collect::<Vec<_>>(),
            (0..p).map(|r| (r * 37) % 5).collect(),
        ] {
            let expected: Vec<u8> = (0..p)
                .flat_map(|r| (0..lens[r]).map(move |i| (r * 31 + i) as u8))
                .collect();
            let out = LocalComm::run(p, |c| {
                let r = c.rank();
                let mut displs = vec![0usize];
                for l in &lens {
                    displs.push(displs[displs.len() - 1] + l);
                }
                let mut buf = vec![0xEEu8; displs[p]];
                for i in 0..lens[r] {
                    buf[displs[r] + i] = (r * 31 + i) as u8;
                }
                // A scratch left over from a larger call, full of other bytes.
                let mut scratch = vec![0xABu8; displs[p] + 17];
                allgatherv::node_gather_inplace(&c, nodes, &mut buf, &displs, &mut scratch)
                    .unwrap();
                buf
            });
            for (r, got) in out.iter().enumerate() {
                assert_eq!(got, &expected, "nodes={nodes:?} lens={lens:?} rank {r}");
            }
        }
    }
}

#[test]
fn node_allgatherv_refuses_a_map_of_the_wrong_length() {
    let out = LocalComm::run(2, |c| {
        let mut buf = vec![0u8; 2];
        allgatherv::node_gather_inplace(&c, &[0, 0, 1], &mut buf, &[0, 1, 2], &mut Vec::new())
    });
    for r in out {
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("node map of 3 ranks for a communicator of 2"),
            "{e}"
        );
    }
}

/// `AllgathervAlgo::Node` on a transport that knows no node map (in
/// process) is an error naming why on every rank, never the flat
/// allgatherv in its place.
#[test]
fn node_algo_without_a_node_map_is_refused() {
    let out = LocalComm::run(3, |c| {
        allgatherv(
            &c,
            &vec![c.rank() as u8; c.rank() + 1],
            AllgathervAlgo::Node,
        )
        .map(|g| g.data)
    });
    for r in out {
        let e = r.expect_err("refused").to_string();
        assert!(e.contains("needs the ranks' nodes"), "{e}");
    }
    assert_eq!(
        "node".parse::<AllgathervAlgo>().unwrap(),
        AllgathervAlgo::Node
    );
    assert_eq!(AllgathervAlgo::Node.name(), "node");
}
