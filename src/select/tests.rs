#![allow(clippy::needless_range_loop)]

use super::*;
use proptest::prelude::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box–Muller.
            let u: f64 = rng.gen_range(1e-12..1.0);
            let v: f64 = rng.gen_range(0.0..1.0);
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

/// The k largest magnitudes (non-NaN), descending.
fn true_top(x: &[f32], k: usize) -> Vec<f32> {
    let mut a: Vec<f32> = x.iter().map(|v| v.abs()).filter(|a| !a.is_nan()).collect();
    a.sort_by(|p, q| q.total_cmp(p));
    a.truncate(k);
    a
}

/// Checks shared by all methods: sorted unique in-range indices, values
/// match, no NaN, and the selection contains the true top-k magnitudes.
fn check_selection(x: &[f32], k: usize, idx: &[u32], val: &[f32]) {
    assert_eq!(idx.len(), val.len());
    assert!(idx.windows(2).all(|w| w[0] < w[1]), "indices sorted unique");
    for (&i, &v) in idx.iter().zip(val) {
        assert!((i as usize) < x.len());
        assert_eq!(v.to_bits(), x[i as usize].to_bits());
        assert!(!v.is_nan(), "NaN selected");
    }
    let want = true_top(x, k);
    let mut got: Vec<f32> = val.iter().map(|v| v.abs()).collect();
    got.sort_by(|p, q| q.total_cmp(p));
    assert!(got.len() >= want.len(), "{} < {}", got.len(), want.len());
    assert_eq!(&got[..want.len()], &want[..], "top-k magnitudes missing");
}

#[test]
fn exact_and_trimmed_return_exactly_k_true_top() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    for (seed, n) in [(1, 1000), (2, 10_000), (3, 7)] {
        for x in [uniform(n, seed), normal(n, seed)] {
            for k in [1, 2, 5, n / 100 + 1, n / 10, n / 2, n - 1] {
                exact_topk(&x, k, &mut idx, &mut val).expect("test");
                assert_eq!(idx.len(), k.min(n));
                check_selection(&x, k, &idx, &val);
                let exact = idx.clone();
                trimmed_topk(&x, k, &mut idx, &mut val).expect("test");
                assert_eq!(idx.len(), k.min(n));
                check_selection(&x, k, &idx, &val);
                assert_eq!(idx, exact, "trimmed selects the exact set");
            }
        }
    }
}

#[test]
fn exact_topk_pinned_values() {
    let x = [0.5, -3.0, 2.0, 0.0, -2.0, 1.0];
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    exact_topk(&x, 3, &mut idx, &mut val).expect("test");
    // |−3| > |2| = |−2| (tie to the lower index: 2 before 4).
    assert_eq!(idx, [1, 2, 4]);
    assert_eq!(val, [-3.0, 2.0, -2.0]);
    exact_topk(&x, 2, &mut idx, &mut val).expect("test");
    assert_eq!(idx, [1, 2]);
    trimmed_topk(&x, 2, &mut idx, &mut val).expect("test");
    assert_eq!(idx, [1, 2]);
    exact_topk_signed(&x, 2, true, &mut idx, &mut val).expect("test");
    assert_eq!(
        (idx.as_slice(), val.as_slice()),
        (&[2u32, 5][..], &[2.0f32, 1.0][..])
    );
    exact_topk_signed(&x, 5, false, &mut idx, &mut val).expect("test");
    assert_eq!(
        (idx.as_slice(), val.as_slice()),
        (&[1u32, 4][..], &[-3.0f32, -2.0][..])
    );
}

#[test]
fn threshold_search_lands_in_k_2k_on_random_data() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    for seed in 0..5 {
        for x in [uniform(20_000, seed), normal(20_000, seed)] {
            for k in [20, 100, 1000, 5000] {
                let mut s = ThresholdSearch::new();
                let o = s.select(&x, k, &mut idx, &mut val).expect("test");
                assert_eq!(o.source, ThresholdSource::Searched, "seed {seed} k {k}");
                assert!((k..=2 * k).contains(&idx.len()), "{} for k {k}", idx.len());
                check_selection(&x, k, &idx, &val);
                assert!(idx.iter().all(|&i| x[i as usize].abs() > o.threshold));
                assert_eq!(
                    x.iter().filter(|v| v.abs() > o.threshold).count(),
                    idx.len()
                );

                let mut s = ThresholdSearch::new();
                let o = s.select_sampled(&x, k, &mut idx, &mut val).expect("test");
                assert!(matches!(
                    o.source,
                    ThresholdSource::Sampled | ThresholdSource::Searched
                ));
                assert!((k..=2 * k).contains(&idx.len()), "{} for k {k}", idx.len());
                check_selection(&x, k, &idx, &val);
            }
        }
    }
}

#[test]
fn sampled_estimate_is_usually_accepted() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let mut sampled = 0;
    for seed in 0..10 {
        let x = normal(200_000, seed);
        let mut s = ThresholdSearch::new().with_interval(0);
        let o = s
            .select_sampled(&x, 2000, &mut idx, &mut val)
            .expect("test");
        sampled += usize::from(o.source == ThresholdSource::Sampled);
        assert!((2000..=4000).contains(&idx.len()));
    }
    assert!(
        sampled >= 7,
        "sample estimate accepted only {sampled}/10 times"
    );
}

#[test]
fn threshold_reuse_for_interval_calls_then_search() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let mut s = ThresholdSearch::new();
    assert_eq!(s.threshold(), None);
    let x0 = normal(5000, 7);
    let o = s.select(&x0, 50, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::Searched);
    let t = o.threshold;
    assert_eq!(s.threshold(), Some(t));
    assert_eq!(s.searches(), 1);
    for step in 1..=DEFAULT_INTERVAL {
        // Different data each call (here x0 rotated, so the count above the
        // threshold stays within 2k): the stored threshold is applied as is.
        let mut x = x0.clone();
        x.rotate_left(step as usize * 97);
        let o = s.select(&x, 50, &mut idx, &mut val).expect("test");
        assert_eq!(o.source, ThresholdSource::Reused);
        assert_eq!(o.threshold.to_bits(), t.to_bits());
        assert_eq!(idx.len(), x.iter().filter(|v| v.abs() > t).count());
        assert_eq!(s.searches(), 1);
    }
    // Scaled data: the reused threshold would now select nearly everything
    // (or nothing) — the documented trade — until the next search.
    let big: Vec<f32> = x0.iter().map(|v| v * 100.0).collect();
    let o = s.select(&big, 50, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::Searched);
    assert_eq!(s.searches(), 2);
    assert!((50..=100).contains(&idx.len()));
    let o = s.select(&x0, 50, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::Reused);
    assert!(idx.len() < 50, "stale threshold selects fewer than k");
    // A different k or length forces a search; interval 0 searches always.
    let o = s.select(&x0, 60, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::Searched);
    let o = s.select(&x0[..4000], 60, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::Searched);
    s.reset();
    assert_eq!(s.threshold(), None);
    let mut s = ThresholdSearch::new().with_interval(0);
    for _ in 0..3 {
        let o = s.select(&x0, 50, &mut idx, &mut val).expect("test");
        assert_eq!(o.source, ThresholdSource::Searched);
    }
    assert_eq!(s.searches(), 3);
}

#[test]
fn search_falls_back_to_exact_when_short() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    // All equal: no element exceeds mean + ratio·(max − mean) = the value.
    let x = vec![0.5f32; 100];
    let mut s = ThresholdSearch::new();
    let o = s.select(&x, 10, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::ExactFallback);
    assert_eq!(idx, (0..10).collect::<Vec<u32>>());
    // The stored threshold would pass all 100 > 2k elements: the reuse
    // guard searches again instead.
    let o = s.select(&x, 10, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::ExactFallback);
    assert_eq!(idx.len(), 10);
    // A huge eps ends the search at once.
    let x = uniform(1000, 3);
    let mut s = ThresholdSearch::new().with_eps(0.9).expect("test");
    s.select(&x, 10, &mut idx, &mut val).expect("test");
    assert!(idx.len() >= 10);
    check_selection(&x, 10, &idx, &val);
    assert!(ThresholdSearch::new().with_eps(0.0).is_err());
    assert!(ThresholdSearch::new().with_eps(f64::NAN).is_err());
    assert!(ThresholdSearch::new().with_sample_fraction(0.0).is_err());
    assert!(ThresholdSearch::new().with_sample_fraction(1.0).is_ok());
}

#[test]
fn nan_is_never_selected_and_never_panics() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let mut x = normal(1000, 11);
    for i in (0..1000).step_by(7) {
        x[i] = f32::NAN;
    }
    x[3] = -f32::NAN;
    let m = x.iter().filter(|v| !v.is_nan()).count();
    for k in [0, 1, 10, 100, m - 1, m, m + 1, 1000, 5000] {
        exact_topk(&x, k, &mut idx, &mut val).expect("test");
        assert_eq!(idx.len(), k.min(m));
        check_selection(&x, k, &idx, &val);
        trimmed_topk(&x, k, &mut idx, &mut val).expect("test");
        assert_eq!(idx.len(), k.min(m));
        check_selection(&x, k, &idx, &val);
        let mut s = ThresholdSearch::new();
        s.select(&x, k, &mut idx, &mut val).expect("test");
        assert!(idx.len() >= k.min(m));
        check_selection(&x, k, &idx, &val);
        s.select_sampled(&x, k, &mut idx, &mut val).expect("test");
        check_selection(&x, k, &idx, &val);
        for pos in [true, false] {
            exact_topk_signed(&x, k, pos, &mut idx, &mut val).expect("test");
            assert!(val.iter().all(|v| if pos { *v > 0.0 } else { *v < 0.0 }));
        }
    }
    // All NaN.
    let x = vec![f32::NAN; 50];
    exact_topk(&x, 5, &mut idx, &mut val).expect("test");
    assert!(idx.is_empty());
    trimmed_topk(&x, 5, &mut idx, &mut val).expect("test");
    assert!(idx.is_empty());
    ThresholdSearch::new()
        .select_sampled(&x, 5, &mut idx, &mut val)
        .expect("test");
    assert!(idx.is_empty());
}

#[test]
fn infinities_are_largest_and_do_not_break_thresholds() {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let mut x = uniform(1000, 5);
    x[10] = f32::INFINITY;
    x[20] = f32::NEG_INFINITY;
    trimmed_topk(&x, 5, &mut idx, &mut val).expect("test");
    assert_eq!(idx.len(), 5);
    check_selection(&x, 5, &idx, &val);
    let mut s = ThresholdSearch::new();
    let o = s.select(&x, 5, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::ExactFallback);
    check_selection(&x, 5, &idx, &val);
    assert!(idx.contains(&10) && idx.contains(&20));
}

#[test]
fn edge_cases_k0_k_ge_n_empty_all_equal() {
    let (mut idx, mut val) = (vec![9u32], vec![9f32]);
    let x = normal(100, 1);
    let mut s = ThresholdSearch::new();
    // k = 0: nothing, and the outputs are cleared.
    exact_topk(&x, 0, &mut idx, &mut val).expect("test");
    assert!(idx.is_empty() && val.is_empty());
    trimmed_topk(&x, 0, &mut idx, &mut val).expect("test");
    assert!(idx.is_empty() && val.is_empty());
    let o = s.select(&x, 0, &mut idx, &mut val).expect("test");
    assert_eq!(o.source, ThresholdSource::Trivial);
    assert!(idx.is_empty());
    // k ≥ n: everything.
    for k in [100, 101, usize::MAX] {
        let all: Vec<u32> = (0..100).collect();
        exact_topk(&x, k, &mut idx, &mut val).expect("test");
        assert_eq!(idx, all);
        assert_eq!(val, x);
        trimmed_topk(&x, k, &mut idx, &mut val).expect("test");
        assert_eq!(idx, all);
        s.select(&x, k, &mut idx, &mut val).expect("test");
        assert_eq!(idx, all);
        s.select_sampled(&x, k, &mut idx, &mut val).expect("test");
        assert_eq!(idx, all);
    }
    // n = 0.
    for k in [0, 1, 5] {
        exact_topk(&[], k, &mut idx, &mut val).expect("test");
        assert!(idx.is_empty());
        trimmed_topk(&[], k, &mut idx, &mut val).expect("test");
        assert!(idx.is_empty());
        s.select(&[], k, &mut idx, &mut val).expect("test");
        assert!(idx.is_empty());
        exact_topk_signed(&[], k, true, &mut idx, &mut val).expect("test");
        assert!(idx.is_empty());
    }
    // All equal (also all zero): ties go to the lowest indices.
    for v in [0.0f32, -2.5] {
        let x = vec![v; 64];
        exact_topk(&x, 6, &mut idx, &mut val).expect("test");
        assert_eq!(idx, [0, 1, 2, 3, 4, 5]);
        trimmed_topk(&x, 6, &mut idx, &mut val).expect("test");
        assert_eq!(idx, [0, 1, 2, 3, 4, 5]);
        let mut s = ThresholdSearch::new();
        s.select(&x, 6, &mut idx, &mut val).expect("test");
        assert_eq!(idx, [0, 1, 2, 3, 4, 5]);
        s.reset();
        s.select_sampled(&x, 6, &mut idx, &mut val).expect("test");
        assert_eq!(idx, [0, 1, 2, 3, 4, 5]);
    }
}

#[test]
fn steady_state_reuses_buffers() {
    let x = normal(10_000, 2);
    let (mut idx, mut val) = (Vec::with_capacity(10_000), Vec::with_capacity(10_000));
    let (pi, pv) = (idx.as_ptr(), val.as_ptr());
    let mut s = ThresholdSearch::new();
    for _ in 0..20 {
        exact_topk(&x, 50, &mut idx, &mut val).expect("test");
        trimmed_topk(&x, 50, &mut idx, &mut val).expect("test");
        s.select(&x, 50, &mut idx, &mut val).expect("test");
        s.select_sampled(&x, 50, &mut idx, &mut val).expect("test");
    }
    assert_eq!((idx.as_ptr(), val.as_ptr()), (pi, pv));
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -1e3f32..1e3,
        1 => Just(0.0f32),
        1 => Just(f32::NAN),
        1 => Just(1.0f32),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn prop_all_methods_contain_true_topk(x in proptest::collection::vec(any_f32(), 0..600),
                                          k in 0usize..700) {
        let m = x.iter().filter(|v| !v.is_nan()).count();
        let (mut idx, mut val) = (Vec::new(), Vec::new());
        exact_topk(&x, k, &mut idx, &mut val).expect("test");
        prop_assert_eq!(idx.len(), k.min(m));
        check_selection(&x, k, &idx, &val);
        let exact = idx.clone();
        trimmed_topk(&x, k, &mut idx, &mut val).expect("test");
        prop_assert_eq!(&idx, &exact);
        let mut s = ThresholdSearch::new();
        for _ in 0..2 {
            s.select(&x, k, &mut idx, &mut val).expect("test");
            prop_assert!(idx.len() >= k.min(m));
            check_selection(&x, k, &idx, &val);
        }
        let mut s = ThresholdSearch::new();
        s.select_sampled(&x, k, &mut idx, &mut val).expect("test");
        prop_assert!(idx.len() >= k.min(m));
        check_selection(&x, k, &idx, &val);
    }
}

/// The sampled signed top-k (tensors ≥ SIGNED_SAMPLE_MIN) returns exactly
/// the sort-based set, whether the sample's estimate holds or the data
/// fools it (then the exact path runs), and flags non-finite inputs.
#[test]
fn sampled_signed_topk_is_exact() {
    let n = SIGNED_SAMPLE_MIN + 12_345;
    let stride = n / SIGNED_SAMPLE;
    let sorted = |x: &[f32], k: usize, positive: bool| -> Vec<u32> {
        let mut i: Vec<u32> = (0..x.len() as u32)
            .filter(|&i| {
                let v = x[i as usize];
                if positive {
                    v > 0.0
                } else {
                    v < 0.0
                }
            })
            .collect();
        // Largest magnitude first, ties to the lower index.
        i.sort_by(|&a, &b| {
            let (a_, b_) = (x[a as usize].abs(), x[b as usize].abs());
            b_.total_cmp(&a_).then(a.cmp(&b))
        });
        i.truncate(k);
        i.sort_unstable();
        i
    };
    let mut cases = vec![uniform(n, 11), normal(n, 12)];
    // Ties everywhere: few distinct values.
    cases.push(
        uniform(n, 13)
            .iter()
            .map(|v| (v * 4.0).round() / 4.0)
            .collect(),
    );
    // Large values only where the stride never looks: the estimate is far
    // too high, the exact path must take over.
    let mut fool = uniform(n, 14);
    for (i, v) in fool.iter_mut().enumerate() {
        if i % stride == stride / 2 {
            *v *= 100.0;
        }
    }
    cases.push(fool);
    // One sign only.
    cases.push(uniform(n, 15).iter().map(|v| v.abs() + 0.5).collect());
    let (mut pi, mut pv, mut ni, mut nv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for x in &cases {
        for k in [1, 17, n / 1000, n / 100, n / 9] {
            let finite = signed_topk(x, k, Some((&mut pi, &mut pv)), Some((&mut ni, &mut nv)))
                .expect("test");
            assert!(finite);
            assert_eq!(pi, sorted(x, k, true), "positive side, k = {k}");
            assert_eq!(ni, sorted(x, k, false), "negative side, k = {k}");
            for (i, v) in pi.iter().zip(&pv).chain(ni.iter().zip(&nv)) {
                assert_eq!(x[*i as usize].to_bits(), v.to_bits());
            }
            exact_topk_signed(x, k, false, &mut ni, &mut nv).expect("test");
            assert_eq!(ni, sorted(x, k, false), "one side, k = {k}");
        }
    }
    let mut x = uniform(n, 16);
    x[n - 1] = f32::NAN;
    assert!(!signed_topk(&x, 50, None, Some((&mut ni, &mut nv))).expect("test"));
    assert_eq!(ni, sorted(&x, 50, false));
    x[n - 1] = f32::INFINITY;
    assert!(!signed_topk(&x, 50, Some((&mut pi, &mut pv)), None).expect("test"));
    assert_eq!(pi[pi.len() - 1] as usize, n - 1, "+inf is the largest");
}

/// The top-k of candidates that come with their values (the device
/// selection's) is the exact top-k's set, ties and all.
#[test]
fn topk_of_candidates_equals_exact_topk() {
    for seed in 0..20u64 {
        let n = 50 + (seed as usize * 37) % 400;
        let x: Vec<f32> = (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed * 97) % 15) as f32) - 7.0)
            .collect();
        for k in [1, 3, n / 10, n / 2, n - 1] {
            let (mut wi, mut wv) = (Vec::new(), Vec::new());
            exact_topk(&x, k, &mut wi, &mut wv).unwrap();
            let mut idx: Vec<u32> = (0..n as u32).collect();
            let mut val = x.clone();
            topk_of_candidates(k, &mut idx, &mut val, &mut Vec::new());
            assert_eq!(idx, wi, "seed {seed} k {k}");
            assert_eq!(val, wv, "seed {seed} k {k}");
        }
    }
}
