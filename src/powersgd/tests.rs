//! PowerSGD against a float64 reference of the algorithm, across ranks
//! simulated in process (every rank's factors summed in rank order, as an
//! allreduce does).

use super::*;

/// A deterministic pseudo-random matrix.
fn matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut g = Normal::new(seed);
    (0..rows * cols).map(|_| g.next() as f32).collect()
}

/// One step of every rank; returns each rank's output.
fn step(states: &mut [PowerSgd], grads: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (plen, qlen) = states[0].factor_lens();
    let n = grads[0].len();
    let mut ps = vec![vec![0f32; plen]; states.len()];
    for ((s, g), p) in states.iter_mut().zip(grads).zip(&mut ps) {
        s.begin(g, p).unwrap();
    }
    let psum = sum(&ps);
    let mut qs = vec![vec![0f32; qlen]; states.len()];
    for (s, q) in states.iter_mut().zip(&mut qs) {
        s.after_p(&psum, q).unwrap();
    }
    let qsum = sum(&qs);
    let ranks = states.len();
    states
        .iter_mut()
        .map(|s| {
            let mut out = vec![0f32; n];
            s.after_q(&qsum, ranks, &mut out).unwrap();
            out
        })
        .collect()
}

fn sum(v: &[Vec<f32>]) -> Vec<f32> {
    let mut s = v[0].clone();
    for x in &v[1..] {
        for (a, b) in s.iter_mut().zip(x) {
            *a += b;
        }
    }
    s
}

/// The algorithm in f64 from the same `Q` (`cols × r`), classical
/// Gram–Schmidt: the averaged approximation.
fn reference(grads: &[Vec<f32>], rows: usize, cols: usize, r: usize, q0: &[f32]) -> Vec<f64> {
    let q0: Vec<f64> = q0.iter().map(|&x| x as f64).collect();
    let ms: Vec<Vec<f64>> = grads
        .iter()
        .map(|g| g.iter().map(|&x| x as f64).collect())
        .collect();
    let mut p = vec![0f64; rows * r];
    for m in &ms {
        for i in 0..rows {
            for j in 0..r {
                p[i * r + j] += (0..cols)
                    .map(|k| m[i * cols + k] * q0[k * r + j])
                    .sum::<f64>();
            }
        }
    }
    for j in 0..r {
        for k in 0..j {
            let dot: f64 = (0..rows).map(|i| p[i * r + k] * p[i * r + j]).sum();
            for i in 0..rows {
                p[i * r + j] -= dot * p[i * r + k];
            }
        }
        let norm = (0..rows).map(|i| p[i * r + j].powi(2)).sum::<f64>().sqrt();
        for i in 0..rows {
            p[i * r + j] /= norm;
        }
    }
    let mut q = vec![0f64; cols * r];
    for m in &ms {
        for k in 0..cols {
            for j in 0..r {
                q[k * r + j] += (0..rows)
                    .map(|i| m[i * cols + k] * p[i * r + j])
                    .sum::<f64>();
            }
        }
    }
    let ranks = grads.len() as f64;
    (0..rows * cols)
        .map(|x| {
            let (i, k) = (x / cols, x % cols);
            (0..r).map(|j| p[i * r + j] * q[k * r + j]).sum::<f64>() / ranks
        })
        .collect()
}

#[test]
fn the_matrix_view_is_the_first_dimension_by_the_rest() {
    assert_eq!(matrix_view(&[64, 3, 3, 3]), Some((64, 27)));
    assert_eq!(matrix_view(&[10, 20]), Some((10, 20)));
    assert_eq!(matrix_view(&[100]), None);
    assert_eq!(matrix_view(&[]), None);
    assert_eq!(matrix_view(&[0, 5]), None);
    assert!(worth_compressing(512, 4608, 4, 2.0));
    assert!(!worth_compressing(4, 4, 4, 2.0));
}

#[test]
fn every_rank_gets_the_same_bits_and_the_f64_reference_within_its_bound() {
    for (ranks, rows, cols, r) in [
        (1, 16, 9, 1),
        (2, 64, 27, 2),
        (3, 40, 100, 4),
        (4, 7, 300, 3),
    ] {
        let grads: Vec<Vec<f32>> = (0..ranks)
            .map(|i| matrix(rows, cols, 7 + i as u64))
            .collect();
        let mut states: Vec<PowerSgd> = (0..ranks)
            .map(|_| PowerSgd::new(rows, cols, r, true, 42).unwrap())
            .collect();
        let q0 = states[0].q().to_vec();
        let out = step(&mut states, &grads);
        for o in &out[1..] {
            assert_eq!(o, &out[0], "ranks differ at p = {ranks}");
        }
        let want = reference(&grads, rows, cols, r, &q0);
        let scale = want.iter().fold(0f64, |a, &x| a.max(x.abs()));
        let worst = out[0]
            .iter()
            .zip(&want)
            .fold(0f64, |a, (&o, &w)| a.max((o as f64 - w).abs()));
        // Stated bound: 1e-4 of the largest element (f32 products over
        // at most a few hundred terms and one orthogonalization).
        assert!(
            worst <= 1e-4 * scale,
            "p {ranks} {rows}x{cols} r {r}: {worst} of {scale}"
        );
    }
}

#[test]
fn a_matrix_of_rank_r_is_reproduced_and_the_error_is_what_was_left() {
    // M = A Bᵀ of rank 2, the same on every rank: one step recovers it.
    let (rows, cols) = (30, 20);
    let a = matrix(rows, 2, 1);
    let b = matrix(cols, 2, 2);
    let m: Vec<f32> = (0..rows * cols)
        .map(|x| {
            (0..2)
                .map(|j| a[(x / cols) * 2 + j] * b[(x % cols) * 2 + j])
                .sum()
        })
        .collect();
    let mut states: Vec<PowerSgd> = (0..2)
        .map(|_| PowerSgd::new(rows, cols, 2, true, 9).unwrap())
        .collect();
    let out = step(&mut states, &[m.clone(), m.clone()]);
    let scale = m.iter().fold(0f32, |x, &v| x.max(v.abs()));
    for (o, want) in out[0].iter().zip(&m) {
        assert!((o - want).abs() <= 1e-5 * scale, "{o} vs {want}");
    }
    for (e, (g, o)) in states[0].error().iter().zip(m.iter().zip(&out[0])) {
        assert_eq!(*e, g - o);
    }
}

#[test]
fn rank_deficient_and_zero_layers_give_finite_results() {
    // Rank 1 at r = 3: two columns of P depend on the first.
    let (rows, cols) = (12, 8);
    let u = matrix(rows, 1, 3);
    let v = matrix(cols, 1, 4);
    let m: Vec<f32> = (0..rows * cols)
        .map(|x| u[x / cols] * v[x % cols])
        .collect();
    let mut s = vec![PowerSgd::new(rows, cols, 3, true, 5).unwrap()];
    let out = step(&mut s, std::slice::from_ref(&m));
    let scale = m.iter().fold(0f32, |x, &v| x.max(v.abs()));
    for (o, want) in out[0].iter().zip(&m) {
        assert!(
            o.is_finite() && (o - want).abs() <= 1e-5 * scale,
            "{o} vs {want}"
        );
    }
    // All zero: zero out, zero error, no NaN, and the next step still runs.
    let zero = vec![0f32; rows * cols];
    let mut s = vec![
        PowerSgd::new(rows, cols, 2, true, 5).unwrap(),
        PowerSgd::new(rows, cols, 2, true, 5).unwrap(),
    ];
    for _ in 0..2 {
        let out = step(&mut s, &[zero.clone(), zero.clone()]);
        assert!(out[0].iter().all(|&x| x == 0.0), "{:?}", &out[0][..4]);
        assert!(s[0].error().iter().all(|&x| x == 0.0));
    }
    // Warm start after the zero steps: Q's columns came back zero and are
    // drawn again, so the layer is approximated again (it was all zero
    // from then on: the rank lost for good).
    let out = step(&mut s, &[m.clone(), m.clone()]);
    assert!(out[0].iter().all(|x| x.is_finite()));
    assert!(out[0].iter().any(|&x| x != 0.0), "the rank came back");
    assert!(s[0].q().iter().any(|&x| x != 0.0));
}

#[test]
fn a_non_finite_result_resets_the_state_instead_of_poisoning_it() {
    let (rows, cols) = (12, 9);
    let mut s = vec![PowerSgd::new(rows, cols, 2, true, 3).unwrap()];
    // (The engine refuses a non-finite gradient before this; here it
    // stands for any overflow of `G + E`, the products or the sums.)
    let mut big = matrix(rows, cols, 1);
    big[0] = f32::INFINITY;
    step(&mut s, &[matrix(rows, cols, 2)]);
    let out = step(&mut s, &[big]);
    assert!(
        out[0].iter().any(|x| !x.is_finite()),
        "the overflow is reported"
    );
    assert!(s[0].error().iter().all(|&x| x == 0.0), "no NaN kept");
    let out = step(&mut s, &[matrix(rows, cols, 4)]);
    assert!(
        out[0].iter().all(|x| x.is_finite()),
        "the next step runs clean"
    );
}

#[test]
fn error_feedback_loses_nothing_over_steps() {
    // One rank: Σ outputs + the final error = Σ gradients.
    let (rows, cols) = (20, 15);
    for warm in [true, false] {
        let mut s = vec![PowerSgd::new(rows, cols, 1, warm, 11).unwrap()];
        let mut sent = vec![0f64; rows * cols];
        let mut given = vec![0f64; rows * cols];
        for t in 0..6 {
            let g = matrix(rows, cols, 100 + t);
            for (a, &x) in given.iter_mut().zip(&g) {
                *a += x as f64;
            }
            let out = step(&mut s, &[g]);
            for (a, &x) in sent.iter_mut().zip(&out[0]) {
                *a += x as f64;
            }
        }
        for ((a, e), g) in sent.iter().zip(s[0].error()).zip(&given) {
            assert!((a + *e as f64 - g).abs() < 1e-4, "{a} + {e} vs {g}");
        }
    }
}

#[test]
fn the_same_seed_draws_the_same_q_and_bad_sizes_are_errors() {
    let a = PowerSgd::new(10, 6, 2, false, 3).unwrap();
    let b = PowerSgd::new(10, 6, 2, false, 3).unwrap();
    let c = PowerSgd::new(10, 6, 2, false, 4).unwrap();
    assert_eq!(a.q(), b.q());
    assert_ne!(a.q(), c.q());
    // Orthonormal columns.
    let q = a.q();
    let dot = |x: usize, y: usize| (0..6).map(|i| q[i * 2 + x] * q[i * 2 + y]).sum::<f32>();
    assert!(
        (dot(0, 0) - 1.0).abs() < 1e-6 && (dot(1, 1) - 1.0).abs() < 1e-6 && dot(0, 1).abs() < 1e-6
    );
    assert_eq!(PowerSgd::new(3, 5, 9, true, 0).unwrap().rank(), 3);
    assert!(PowerSgd::new(0, 5, 1, true, 0).is_err());
    let mut s = PowerSgd::new(4, 4, 1, true, 0).unwrap();
    assert!(s.begin(&[0.0; 15], &mut [0.0; 4]).is_err());
    assert!(s.set_q(&[0.0; 3]).is_err());
}

#[test]
fn a_rolled_back_step_leaves_the_state_as_it_was_and_settle_keeps_it() {
    let (rows, cols, r) = (24, 16, 2);
    let mk = || {
        (0..2)
            .map(|_| PowerSgd::new(rows, cols, r, true, 7).unwrap())
            .collect::<Vec<_>>()
    };
    let g = |step: u64| -> Vec<Vec<f32>> {
        (0..2).map(|k| matrix(rows, cols, step * 10 + k)).collect()
    };
    let mut states = mk();
    step(&mut states, &g(0));
    states.iter_mut().for_each(PowerSgd::settle);
    let before: Vec<_> = states.iter().map(PowerSgd::snapshot).collect();
    // A step that runs and is undone, including one whose result is not
    // finite (the state reset is undone too).
    let first = step(&mut states, &g(1));
    assert!(states.iter_mut().all(|s| s.rollback()));
    assert!(!states[0].rollback(), "undone once");
    let after: Vec<_> = states.iter().map(PowerSgd::snapshot).collect();
    assert_eq!(before, after, "error, Q, draws and stepped as before");
    let mut bad = g(1);
    bad[0][3] = f32::MAX;
    bad[1][3] = f32::MAX;
    step(&mut states, &bad);
    assert!(states[0].error().iter().all(|&e| e == 0.0), "reset");
    assert!(states.iter_mut().all(|s| s.rollback()));
    let after: Vec<_> = states.iter().map(PowerSgd::snapshot).collect();
    assert_eq!(before, after, "the reset undone");
    // The same step again gives the same bits as the first time.
    let again = step(&mut states, &g(1));
    let bits = |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
    assert_eq!(bits(&first), bits(&again));
    // Settled, a rollback does nothing; a fresh state has nothing to undo.
    states.iter_mut().for_each(PowerSgd::settle);
    let kept: Vec<_> = states.iter().map(PowerSgd::snapshot).collect();
    assert!(!states[1].rollback());
    assert_eq!(kept[1], states[1].snapshot());
    assert!(!mk()[0].rollback());
}
