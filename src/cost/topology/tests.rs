use super::*;
use crate::cost::{
    dense_rabenseifner, dense_ring, Burst, CurvePoint, NetLevel, Profile, StrategyId,
};

/// A profile of shared memory inside a node, `inter` (α, bytes/s) between
/// nodes.
pub(crate) fn prof(inter: Option<(f64, f64)>) -> Profile {
    let mut p = Profile::from_network(1e-6, 5e9, 2e-10, 1e-9).expect("profile");
    p.inter_node = inter.map(|(alpha, bw)| NetLevel {
        alpha,
        beta: 1.0 / bw,
        beta_curve: Vec::new(),
        oneway_curve: Vec::new(),
        burst: None,
    });
    p
}

fn net(prof: &Profile, p: usize, l: usize) -> Net<'_> {
    Net::new(prof, p, Some(l), None)
}

/// `|a − b| / |b|`.
pub(crate) fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

#[test]
fn crossings_follow_the_partner_schedules() {
    // 2 nodes of 2: recursive doubling pairs inside the node first.
    assert_eq!(*crossings(Sched::Doubling, 4, 2), vec![0, 2, 0]);
    // 4 nodes of 1: every step crosses with one rank per node.
    assert_eq!(*crossings(Sched::Doubling, 4, 1), vec![1, 1, 0]);
    // 6 ranks, 3 nodes of 2: the fold pairs (0,1), (2,3) stay inside
    // nodes 0 and 1; virtual ranks 0..4 are real 0, 2, 4, 5, and at
    // distance 2 both ranks of node 2 (4 <-> 0, 5 <-> 2) cross.
    assert_eq!(*crossings(Sched::Doubling, 6, 2), vec![1, 2, 0]);
    // Pairwise r -> r + s on 2 nodes of 2: s = 1 and 3 cross once per
    // node, s = 2 twice.
    assert_eq!(pairwise_runs(4, 2), vec![(1, 1), (1, 2), (1, 1)]);
    // One node: nothing crosses.
    assert_eq!(pairwise_runs(5, 8), vec![(4, 0)]);
    assert_eq!(pairwise_runs(5, 5), vec![(4, 0)]);
    assert!(pairwise_runs(1, 1).is_empty());
    // Bruck's allgather on 3 nodes of 2: at distance 1 one rank a node
    // (0 -> 5, 2 -> 1, 4 -> 3) crosses, at 2 and 4 both.
    assert_eq!(*crossings(Sched::Bruck, 6, 2), vec![1, 2, 2]);
}

/// The allgatherv for `p` not a power of two is Bruck's: `⌈lg p⌉` steps of
/// `min(d, p − d)` blocks, `(p − 1)·m` in all (the fold it replaced moved
/// about twice that, and the two-level model charged only half of it, so a
/// 127-rank job came out cheaper than 64 ranks). With one rank per node
/// and equal levels it is the one-level closed form, and across nodes it
/// never gets cheaper with more ranks.
#[test]
fn the_allgather_is_bruck_for_any_p_and_grows_with_p() {
    let pr = prof(Some((1e-6, 5e9)));
    for p in [2usize, 3, 5, 6, 7, 12, 96, 127, 128, 129] {
        for m in [8.0, 4096.0, 1e6] {
            let a = allgather(&net(&pr, p, 1), m);
            let b = crate::cost::ceil_lg(p) * pr.alpha + (p as f64 - 1.0) * m * pr.beta;
            assert!(rel(a, b) < 1e-12, "p={p} m={m}: {a} vs {b}");
        }
    }
    let slow = prof(Some((2e-5, 1.25e8)));
    let mut last = 0.0;
    for p in 2..=300usize {
        let t = allgather(&net(&slow, p, 1), 1e5);
        assert!(
            t >= last,
            "one rank a node: p={p} costs {t}, p-1 cost {last}"
        );
        last = t;
    }
    // Several ranks a node: recursive doubling keeps its first steps inside
    // the nodes and Bruck's does not, so 15 ranks may cost more than 16,
    // but never less than the power of two below them.
    for l in [4usize, 8] {
        for p in 2..=300usize {
            let below = 1usize << (usize::BITS - 1 - p.leading_zeros());
            let (t, t2) = (
                allgather(&net(&slow, p, l), 1e5),
                allgather(&net(&slow, below, l), 1e5),
            );
            assert!(t >= t2, "l={l}: p={p} costs {t}, {below} ranks {t2}");
        }
    }
}

#[test]
fn one_rank_per_node_with_equal_levels_is_the_one_level_model() {
    // Every pair crosses (c = 1) at the same α, β: the closed forms.
    let pr = prof(Some((1e-6, 5e9)));
    for p in [2usize, 4, 8, 64] {
        let n = net(&pr, p, 1);
        assert!(n.two_level());
        for bytes in [4096.0, 1e6, 1e8] {
            let (a, b) = (rabenseifner(&n, bytes), dense_rabenseifner(&pr, bytes, p));
            assert!(rel(a, b) < 1e-12, "p={p} {bytes}: {a} vs {b}");
            let (a, b) = (ring(&n, bytes), dense_ring(&pr, bytes, p));
            assert!(rel(a, b) < 1e-12, "ring p={p} {bytes}: {a} vs {b}");
        }
    }
}

#[test]
fn shared_links_charge_every_rank_that_crosses() {
    // 2 nodes of 4 over a link 40x slower than shared memory.
    let pr = prof(Some((2e-5, 1.25e8)));
    let n = net(&pr, 8, 4);
    let bytes = 64.0 * 1024.0 * 1024.0;
    let (bi, be) = (pr.beta, 1.0 / 1.25e8);
    // Rabenseifner: steps at distance 1 and 2 inside the node (N/2, N/4),
    // distance 4 across with all 4 ranks (N/8 each): twice each.
    let want = 2.0 * (2.0 * 1e-6 + (bytes / 2.0 + bytes / 4.0) * bi)
        + 2.0 * (2e-5 + 4.0 * bytes / 8.0 * be)
        + (bytes / 2.0 + bytes / 4.0 + bytes / 8.0) * pr.gamma_reduce;
    assert!(rel(rabenseifner(&n, bytes), want) < 1e-12);
    // The hierarchical allreduce moves the same bytes across (its shards
    // of N/4 cross 4 at a time), so the two are within the α terms.
    let h = hierarchical(&n, bytes);
    assert!(rel(h, rabenseifner(&n, bytes)) < 0.05, "{h}");
    // The fused allgather's big steps cross: 4 ranks x 4 blocks.
    let m = 1e5;
    let ag = allgather(&n, m);
    let want = (1e-6 + m * bi) + (1e-6 + 2.0 * m * bi) + (2e-5 + 4.0 * 4.0 * m * be);
    assert!(rel(ag, want) < 1e-12, "{ag} vs {want}");
}

#[test]
fn the_ring_pays_the_one_way_rate_across_nodes() {
    let mut pr = prof(Some((2e-5, 1.25e8)));
    let n = net(&pr, 4, 2);
    let bytes = 64.0 * 1024.0 * 1024.0;
    let two_way = ring(&n, bytes);
    pr.inter_node.as_mut().expect("inter").oneway_curve = vec![CurvePoint {
        bytes: 1.0,
        per_byte: 0.5 / 1.25e8,
    }];
    let n = net(&pr, 4, 2);
    let one_way = ring(&n, bytes);
    let seg = bytes / 4.0;
    let want = 6.0 * (2e-5 + seg * 0.5 / 1.25e8) + 3.0 * seg * pr.gamma_reduce;
    assert!(rel(one_way, want) < 1e-12, "{one_way} vs {want}");
    assert!(one_way < 0.6 * two_way);
    // Rabenseifner's exchanges still pay the two-way β.
    let mut two = pr.clone();
    two.inter_node.as_mut().expect("inter").oneway_curve.clear();
    assert_eq!(
        rabenseifner(&n, bytes),
        rabenseifner(&net(&two, 4, 2), bytes)
    );
}

#[test]
fn fill_in_estimates() {
    // Independent selections: n(1 - (1 - D)^j).
    let f = fill(1e6, 1e3, 8, None);
    assert!(rel(f, 1e6 * (1.0 - (1.0 - 1e-3f64).powi(8))) < 1e-12);
    assert!(f < 8e3 && f > 7.9e3);
    // A measured ratio, bounded by k and n.
    assert_eq!(fill(1e6, 1e3, 8, Some(0.5)), 4e3);
    assert_eq!(fill(1e6, 1e3, 8, Some(1.0 / 64.0)), 1e3);
    assert_eq!(fill(1e4, 1e3, 64, Some(1.0)), 1e4);
    assert_eq!(fill(0.0, 0.0, 8, None), 0.0);
}

#[test]
fn node_aware_sparse_beats_the_flat_allgather_across_nodes() {
    // 8 nodes of 8 ranks, 1 Gbit/s links; a 25M-element table at 0.1 %.
    let pr = prof(Some((2e-5, 1.25e8)));
    let n = net(&pr, 64, 8);
    let (elems, k) = (25e6, 25e3);
    let unit = 8.0 * k + 16.0 + 32.0;
    let (ag, sar, hier) = (
        allgather(&n, unit),
        sparse_allreduce(&n, elems, k, None),
        sparse_hierarchical(&n, elems, k, None),
    );
    // The allgather pushes L·(p − L) units through each link, the
    // hierarchical path about (H − 1)·L.
    assert!(hier * 4.0 < ag, "hier {hier} vs allgather {ag}");
    // Independent selections at p·D = 6 % barely overlap: the sparse
    // allreduce's result is nearly p·k pairs, so it costs what the
    // allgather does (Ok-Topk's gain needs overlap or its reselection).
    assert!(
        rel(sar, ag) < 0.1,
        "sparse allreduce {sar} vs allgather {ag}"
    );
    // With full overlap (every rank selected the same indices) the
    // sparse allreduce's result is k pairs, not p·k.
    let same = n.with_fill(Some(1.0 / 64.0));
    assert!(sparse_allreduce(&same, elems, k, same.fill) < sar / 2.0);
    // One node: no link, no inter-node phase.
    let one = net(&pr, 8, 8);
    assert!(!one.two_level());
    assert!(sparse_hierarchical(&one, elems, k, None) < hier);
}

#[test]
fn the_sparse_collectives_pay_for_clearing_their_output() {
    let mut p = prof(Some((3e-5, 1.25e8)));
    let (n, k) = (1usize << 24, 16_777usize);
    let base: Vec<f64> = [
        StrategyId::SparseAllgather,
        StrategyId::SparseAllreduce,
        StrategyId::SparseHierarchical,
    ]
    .iter()
    .map(|&id| crate::cost::sparse_collective(&p, id, n, k, 4, Some(2), None).expect("sparse"))
    .collect();
    p.gamma_clear = 1e-10;
    let clear = 4.0 * n as f64 * 1e-10;
    for (i, id) in [
        StrategyId::SparseAllgather,
        StrategyId::SparseAllreduce,
        StrategyId::SparseHierarchical,
    ]
    .into_iter()
    .enumerate()
    {
        let t = crate::cost::sparse_collective(&p, id, n, k, 4, Some(2), None).expect("sparse");
        assert!(
            rel(t - base[i], clear) < 1e-9,
            "{id}: {t} vs {} + {clear}",
            base[i]
        );
    }
    // The collective functions themselves (what the step model charges a
    // reduced sparse group) include it; the fused allgather's is the
    // layers' (their selection fits).
    let nt = net(&p, 4, 2);
    let with = sparse_hierarchical(&nt, n as f64, k as f64, None);
    p.gamma_clear = 0.0;
    let nt = net(&p, 4, 2);
    assert!(
        rel(
            with - sparse_hierarchical(&nt, n as f64, k as f64, None),
            clear
        ) < 1e-9
    );
    // Not a sparse collective, or more pairs than elements: errors.
    let e = crate::cost::sparse_collective(&p, StrategyId::DenseRing, n, k, 4, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dense-ring") && e.contains("not a sparse collective"),
        "{e}"
    );
    assert!(
        crate::cost::sparse_collective(&p, StrategyId::SparseAllreduce, 4, 5, 4, None, None)
            .is_err()
    );
    // One rank: nothing to exchange.
    assert_eq!(
        crate::cost::sparse_collective(&p, StrategyId::SparseAllgather, n, k, 1, None, None)
            .expect("p = 1"),
        0.0
    );
}

#[test]
fn gamma_clear_is_optional_and_validated() {
    let old: Profile = serde_json::from_str(r#"{"version": 2, "alpha": 1e-6, "beta": 1e-9}"#)
        .expect("old profile");
    assert_eq!(old.gamma_clear, 0.0);
    assert!(!serde_json::to_string(&old)
        .expect("json")
        .contains("gamma_clear"));
    let mut p = old.clone();
    p.gamma_clear = 2e-11;
    let back: Profile =
        serde_json::from_str(&serde_json::to_string(&p).expect("json")).expect("parse");
    assert_eq!(back.gamma_clear, 2e-11);
    p.gamma_clear = -1.0;
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("gamma_clear"), "{e}");
}

#[test]
fn gamma_clear_curve_prices_the_clearing_by_output_size() {
    use crate::cost::CurvePoint;
    let old: Profile = serde_json::from_str(r#"{"version": 2, "alpha": 1e-6, "beta": 1e-9}"#)
        .expect("old profile");
    assert!(old.gamma_clear_curve.is_empty());
    assert!(!serde_json::to_string(&old)
        .expect("json")
        .contains("gamma_clear_curve"));
    let mut p = Profile::from_network(2e-5, 1e9, 1e-10, 1e-9).expect("profile");
    p.gamma_clear = 1e-10;
    let (n, k) = (1usize << 24, 1usize << 14);
    let at = |p: &Profile| sparse_hierarchical(&net(p, 4, 2), n as f64, k as f64, None);
    let flat = at(&p);
    // Cheaper per byte past 32 MiB (memset's non-temporal stores): the
    // 64 MiB output is priced at the curve's value there, not the constant.
    p.gamma_clear_curve = vec![
        CurvePoint {
            bytes: 16.0 * 1048576.0,
            per_byte: 8e-11,
        },
        CurvePoint {
            bytes: 128.0 * 1048576.0,
            per_byte: 2e-11,
        },
    ];
    let per = p.gamma_clear_at(4.0 * n as f64);
    assert!(per > 2e-11 && per < 8e-11, "{per}");
    assert!(rel(flat - at(&p), 4.0 * n as f64 * (1e-10 - per)) < 1e-9);
    let back: Profile =
        serde_json::from_str(&serde_json::to_string(&p).expect("json")).expect("parse");
    assert_eq!(back.gamma_clear_curve, p.gamma_clear_curve);
    back.validate().expect("valid");
    // Validated as the other curves: finite, non-negative, ascending.
    let mut bad = p.clone();
    bad.gamma_clear_curve[1].per_byte = f64::NAN;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("gamma_clear_curve[1]"), "{e}");
    let mut bad = p.clone();
    bad.gamma_clear_curve[1].bytes = 1.0;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("gamma_clear_curve"), "{e}");
}

#[test]
fn the_crossing_cache_stays_bounded_and_right() {
    for p in 2..(CACHE_MAX + 100) {
        let c = crossings(Sched::Bruck, p, 1);
        assert_eq!(c.len(), ceil_lg(p) as usize);
    }
    assert!(SCHEDULES.with(|c| c.borrow().len()) <= CACHE_MAX);
    // Still the schedule after starting over.
    assert_eq!(*crossings(Sched::Bruck, 6, 2), vec![1, 2, 2]);
}

/// The calibration's warning: a two-way exchange measured 2x slower per
/// byte than one-way traffic at the largest size both curves have.
#[test]
fn two_way_slowdown_compares_the_largest_common_size() {
    let pt = |bytes: f64, per_byte: f64| CurvePoint { bytes, per_byte };
    let mut e = NetLevel {
        alpha: 1e-5,
        beta: 8e-9,
        beta_curve: vec![pt(4096.0, 5e-9), pt((1 << 24) as f64, 16e-9)],
        oneway_curve: Vec::new(),
        burst: None,
    };
    assert_eq!(e.two_way_slowdown(), None, "no one-way curve");
    e.oneway_curve = vec![pt(4096.0, 2.5e-9), pt((1 << 24) as f64, 8e-9)];
    let (bytes, x) = e.two_way_slowdown().expect("both curves");
    assert_eq!(bytes, (1 << 24) as f64);
    assert!(rel(x, 2.0) < 1e-12, "{x}");
    // Full duplex: the two rates agree.
    e.beta_curve[1].per_byte = 8.3e-9;
    assert!(e.two_way_slowdown().unwrap().1 < 1.1);
    // A one-way size the exchange did not measure is passed over.
    e.oneway_curve.push(pt((1 << 25) as f64, 8e-9));
    assert_eq!(e.two_way_slowdown().unwrap().0, (1 << 24) as f64);
}

#[test]
fn the_sparse_collectives_add_pairs_at_their_outputs_gamma_unpack() {
    use crate::cost::CurvePoint;
    let mut p = prof(Some((3e-5, 1.25e8)));
    let g = p.gamma_unpack;
    assert!(g > 0.0);
    let ids = [
        StrategyId::SparseAllgather,
        StrategyId::SparseAllreduce,
        StrategyId::SparseHierarchical,
    ];
    // (elements, pairs): an output inside the curve's first point, and
    // one of 128 MiB past its last.
    let cases = [(1usize << 16, 655usize), (1 << 25, 335_544)];
    let at = |p: &Profile| -> Vec<f64> {
        cases
            .iter()
            .flat_map(|&(n, k)| {
                ids.iter().map(move |&id| {
                    crate::cost::sparse_collective(p, id, n, k, 4, Some(2), None).expect("sparse")
                })
            })
            .collect()
    };
    let flat = at(&p);
    p.gamma_unpack_curve = vec![
        CurvePoint {
            bytes: 1048576.0,
            per_byte: g,
        },
        CurvePoint {
            bytes: 64.0 * 1048576.0,
            per_byte: 3.0 * g,
        },
    ];
    let curved = at(&p);
    // Small outputs: unchanged; large ones: dearer, the fused allgather by
    // exactly its p units at 2·γ more per byte.
    assert_eq!(flat[..3], curved[..3]);
    for i in 3..6 {
        assert!(
            curved[i] > flat[i],
            "{}: {} vs {}",
            ids[i - 3],
            curved[i],
            flat[i]
        );
    }
    let units = 4.0 * (8.0 * 335_544.0 + 4.0);
    assert!(rel(curved[3] - flat[3], units * 2.0 * g) < 1e-9);
}

/// The closed form of the pairwise schedule's crossings equals counting
/// every rank's partner, for every placement up to 64 ranks (the count
/// was O(p²) per placement: `predict --ranks 65536` took minutes).
#[test]
fn pairwise_crossings_in_closed_form_equal_the_count() {
    for p in 1..=64usize {
        for l in 1..=p + 2 {
            let node = |r: usize| r / l;
            for s in 1..p {
                let mut count = vec![0usize; p.div_ceil(l)];
                for r in 0..p {
                    if node(r) != node((r + s) % p) {
                        count[node(r)] += 1;
                    }
                }
                let want = count.iter().copied().max().unwrap_or(0);
                assert_eq!(super::pairwise_crossing(p, l, s), want, "p {p} l {l} s {s}");
            }
        }
    }
}

/// The pairwise schedule's runs expand to the step-by-step crossing
/// counts, and the sparse allreduce priced run by run (`Net::rounds`)
/// equals it priced step by step, burst credit included (spent part-way
/// through a run, or lasting past several), on one node and across nodes.
#[test]
fn pairwise_runs_price_the_steps_one_by_one() {
    for p in 1..=70usize {
        for l in 1..=p + 2 {
            let steps: Vec<usize> = pairwise_runs(p, l)
                .into_iter()
                .flat_map(|(n, c)| std::iter::repeat_n(c, n))
                .collect();
            let want: Vec<usize> = (1..p).map(|s| super::pairwise_crossing(p, l, s)).collect();
            assert_eq!(steps, want, "p {p} l {l}");
        }
    }
    let mut pr = prof(Some((20e-6, 0.125e9)));
    for credit in [0.0, 100.0, 5e3, 262e3, 1e9] {
        pr.inter_node.as_mut().unwrap().burst = (credit > 0.0).then_some(Burst {
            bytes: credit,
            beta: 1.0 / 1e9,
        });
        for (p, l) in [(2, 1), (4, 2), (7, 3), (16, 4), (33, 8), (64, 64), (100, 7)] {
            for k in [1.0, 200.0, 40_000.0] {
                let n = net(&pr, p, l);
                n.refill();
                let per = 8.0 * k / p as f64;
                let one_by_one: f64 = (1..p)
                    .map(|s| {
                        let c = super::pairwise_crossing(p, l, s);
                        n.step(8.0, c) + n.step(per, c)
                    })
                    .sum();
                let left = n.credit.get();
                n.refill();
                let by_runs: f64 = pairwise_runs(p, l)
                    .into_iter()
                    .map(|(m, c)| n.rounds(m, 8.0, per, c))
                    .sum();
                assert!(
                    rel(by_runs, one_by_one) < 1e-9,
                    "p {p} l {l} k {k} credit {credit}: {by_runs} vs {one_by_one}"
                );
                assert!((n.credit.get() - left).abs() <= 1e-6 * credit.max(1.0));
            }
        }
    }
}

/// The burst credit: each collective starts with the whole of it, its
/// inter-node steps spend it in schedule order at `β − β_burst` a byte,
/// and a phase inside a collective does not refill it.
#[test]
fn the_burst_credit_is_spent_once_per_collective() {
    let plain = prof(Some((2e-5, 1.25e8)));
    let mut pr = plain.clone();
    let burst = Burst {
        bytes: 150e3,
        beta: 3e-9,
    };
    pr.inter_node.as_mut().expect("two levels").burst = Some(burst);
    let per_byte = 8e-9 - 3e-9;
    let (without, with) = (net(&plain, 4, 1), net(&pr, 4, 1));
    // An allgather of 100 KB a rank on 4 × 1 moves 100 + 200 KB each way
    // on every link: 150 KB of them on credit.
    let m = 100e3;
    let want = allgather(&without, m) - 150e3 * per_byte;
    assert!(rel(allgather(&with, m), want) < 1e-12);
    // The next collective finds the credit whole again.
    assert!(rel(allgather(&with, m), want) < 1e-12);
    // Traffic under the credit is all at the burst rate: 10 + 20 KB.
    let small = allgather(&without, 10e3) - 30e3 * per_byte;
    assert!(rel(allgather(&with, 10e3), small) < 1e-12);
    // 64 MiB of Rabenseifner: the first step's message alone exceeds it.
    let big = (64 << 20) as f64;
    let saved = rabenseifner(&without, big) - rabenseifner(&with, big);
    assert!(rel(saved, 150e3 * per_byte) < 1e-9, "{saved}");
    // The ring's 2(p − 1) = 6 steps of 10 KB: 60 KB, all of it on credit.
    let saved = ring(&without, 40e3) - ring(&with, 40e3);
    assert!(rel(saved, 60e3 * per_byte) < 1e-9, "{saved}");
    // The sparse allreduce's rounds and its allgather share one credit.
    let (n, k) = (16e6, 16e3);
    let saved = sparse_allreduce(&without, n, k, None) - sparse_allreduce(&with, n, k, None);
    assert!(rel(saved, 150e3 * per_byte) < 1e-9, "{saved}");
    // Inside one node there is no link and no credit.
    let (one, one_b) = (net(&plain, 4, 4), net(&pr, 4, 4));
    assert_eq!(allgather(&one, m), allgather(&one_b, m));
    // A credit is validated and survives a round trip.
    let back: Profile = serde_json::from_str(&serde_json::to_string(&pr).unwrap()).unwrap();
    assert_eq!(back.inter_node.unwrap().burst, Some(burst));
    pr.inter_node.as_mut().unwrap().burst = Some(Burst {
        bytes: -1.0,
        beta: 3e-9,
    });
    let e = pr.validate().unwrap_err().to_string();
    assert!(e.contains("inter_node.burst.bytes = -1"), "{e}");
}

/// A burst credit slower than the link's sustained rate is no credit: the
/// model would ignore it without a word, so the profile is refused.
#[test]
fn a_burst_slower_than_the_link_is_refused() {
    let mut pr = prof(Some((2e-5, 1.25e8)));
    let burst = |beta| {
        Some(Burst {
            bytes: 262144.0,
            beta,
        })
    };
    pr.inter_node.as_mut().expect("inter").burst = burst(1e-6);
    let e = pr.validate().expect_err("slower credit").to_string();
    assert!(e.contains("inter_node.burst.beta"), "{e}");
    pr.inter_node.as_mut().expect("inter").burst = burst(1e-9);
    pr.validate().expect("a faster credit");
}

/// The node-aware allgatherv's closed form at 3 nodes of 2 (no burst):
/// one message into the leader, Bruck's two steps among the 3 leaders
/// with one 2m-byte node block each, one broadcast round of the 6m-byte
/// result; and on one node or one rank per node, the flat allgatherv.
#[test]
fn the_node_aware_allgather_is_its_phases() {
    let (a, b, ai, bi) = (1e-6, 1.0 / 5e9, 3e-5, 1.0 / 1.25e8);
    let pr = prof(Some((ai, 1.0 / bi)));
    let m = 1e5;
    let want = (a + m * b) + 2.0 * (ai + 2.0 * m * bi) + (a + 6.0 * m * b);
    assert!(rel(allgather_node(&net(&pr, 6, 2), m), want) < 1e-12);
    // It moves a third of the flat one's bytes across each link here.
    assert!(allgather_node(&net(&pr, 6, 2), m) < allgather(&net(&pr, 6, 2), m) / 1.5);
    for (p, l) in [(6, 6), (6, 1), (5, 8)] {
        let n = net(&pr, p, l);
        assert_eq!(allgather_node(&n, m), allgather(&n, m), "p={p} l={l}");
    }
    assert_eq!(allgather_node(&net(&pr, 1, 1), m), 0.0);
    assert_eq!(allgather_node(&net(&pr, 6, 2), 0.0), 0.0);
}

/// `sparse_collective_by` prices the fused allgatherv by the named
/// algorithm; `None` (and `sparse_collective`) is `auto`'s cheaper one.
#[test]
fn the_fused_collective_is_priced_by_its_allgatherv() {
    use crate::cost::{sparse_collective, sparse_collective_by};
    use crate::dense::AllgathervAlgo;
    let pr = prof(Some((3e-5, 1.25e8)));
    let (n, k) = (16_000_000, 16_000);
    let by = |g| {
        sparse_collective_by(&pr, StrategyId::SparseAllgather, n, k, 6, Some(2), None, g)
            .expect("priced")
    };
    let (flat, node, auto) = (
        by(Some(AllgathervAlgo::RecursiveDoubling.into())),
        by(Some(AllgathervAlgo::Node.into())),
        by(None),
    );
    assert!(node < flat, "{node} {flat}");
    assert_eq!(auto, node);
    assert_eq!(
        sparse_collective(&pr, StrategyId::SparseAllgather, n, k, 6, Some(2), None).unwrap(),
        auto
    );
    assert_eq!(by(Some(AllgathervAlgo::Mpi.into())), flat);
    // One level: every algorithm is the closed form.
    let one = |g| {
        sparse_collective_by(&pr, StrategyId::SparseAllgather, n, k, 6, None, None, g)
            .expect("priced")
    };
    assert_eq!(one(Some(AllgathervAlgo::Node.into())), one(None));
}
