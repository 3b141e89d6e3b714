//! Profiles: linear fits, validation, JSON round trips and the β/γ curves
//! (interpolation, per-message use, version-1 files).

use super::*;

#[test]
fn linear_fit_recovers_a_line_and_profiles_validate() {
    let pts: Vec<(f64, f64)> = (1..10)
        .map(|i| (i as f64 * 1000.0, 5e-6 + 2e-9 * i as f64 * 1000.0))
        .collect();
    let f = LinearFit::fit(&pts);
    assert!(rel(f.a, 5e-6) < 1e-6 && rel(f.b, 2e-9) < 1e-6);
    assert!(Profile::from_network(1e-6, 0.0, 0.0, 0.0).is_err());
    let mut p = prof();
    p.alpha = f64::NAN;
    assert!(p.validate().is_err());
    let p = prof();
    let json = serde_json::to_string(&p).expect("json");
    let back: Profile = serde_json::from_str(&json).expect("parse");
    assert_eq!(back, p);
    assert!(serde_json::from_str::<Profile>(r#"{"alpha":1,"beta":1,"bogus":2}"#).is_err());
    assert!(predict(
        &p,
        &Query {
            at: crate::cost::Placement {
                p: 0,
                ranks_per_node: None,
                fill: None,
                ..crate::cost::Placement::default()
            },
            n: 10,
            density: 0.1,
            gradiveq_ratio: 8.0,
        },
        "trimmed"
    )
    .is_err());
    assert!(predict(
        &p,
        &Query {
            at: crate::cost::Placement {
                p: 2,
                ranks_per_node: None,
                fill: None,
                ..crate::cost::Placement::default()
            },
            n: 10,
            density: 0.0,
            gradiveq_ratio: 8.0,
        },
        "trimmed"
    )
    .is_err());
}

/// β(m) interpolates linearly in log m and is constant beyond the ends; an
/// empty curve is the constant β, bit for bit.
#[test]
fn curves_interpolate_in_log_size_and_fall_back_exactly() {
    let c = curve(&[(1024.0, 4e-10), (4096.0, 2e-10), (65536.0, 1e-10)]);
    assert_eq!(curve_at(&c, 9.0, 10.0), 4e-10);
    assert_eq!(curve_at(&c, 9.0, 1024.0), 4e-10);
    assert!(rel(curve_at(&c, 9.0, 2048.0), 3e-10) < 1e-12);
    assert!(rel(curve_at(&c, 9.0, 16384.0), 1.5e-10) < 1e-12);
    assert_eq!(curve_at(&c, 9.0, 1e9), 1e-10);
    assert_eq!(curve_at(&[], 9.0, 123.0), 9.0);
    // Byte-weighted mean over messages.
    let m = curve_mean(&c, 9.0, &[1024.0, 65536.0]);
    assert!(rel(m, (1024.0 * 4e-10 + 65536.0 * 1e-10) / 66560.0) < 1e-12);
    assert_eq!(curve_mean(&[], 0.123, &[1.0, 2.0]), 0.123);
    assert_eq!(curve_mean(&c, 0.123, &[]), 0.123);
}

/// With curves, each strategy is its closed form under the byte-weighted β
/// and γ of its own messages: p = 2 Rabenseifner and ring are
/// `2α + 2·(N/2)·β(N/2) + (N/2)·γ(N/2)`; p = 4 Rabenseifner sends N/2 and
/// N/4 twice and reduces N/2 and N/4; the allgather of p = 4 moves m then 2m.
#[test]
fn curves_follow_each_algorithm_s_messages() {
    let mut pr = prof();
    pr.beta_curve = curve(&[(4096.0, 5e-10), (1048576.0, 1e-10), (16777216.0, 3e-10)]);
    pr.gamma_reduce_curve = curve(&[(4096.0, 1e-10), (16777216.0, 4e-10)]);
    for n in [1024usize, 100_000, 1 << 20, 4 << 20] {
        let nb = 4.0 * n as f64;
        let (b, g) = (pr.beta_at(nb / 2.0), pr.gamma_reduce_at(nb / 2.0));
        let want = 2.0 * pr.alpha + nb * b + nb / 2.0 * g;
        assert!(rel(dense_rabenseifner(&pr, nb, 2), want) < 1e-12);
        assert!(rel(dense_ring(&pr, nb, 2), want) < 1e-12);
        let (b1, b2) = (pr.beta_at(nb / 2.0), pr.beta_at(nb / 4.0));
        let (g1, g2) = (pr.gamma_reduce_at(nb / 2.0), pr.gamma_reduce_at(nb / 4.0));
        let want4 =
            4.0 * pr.alpha + 2.0 * (nb / 2.0 * b1 + nb / 4.0 * b2) + nb / 2.0 * g1 + nb / 4.0 * g2;
        assert!(rel(dense_rabenseifner(&pr, nb, 4), want4) < 1e-12, "n={n}");
        let ring4 = 6.0 * pr.alpha
            + 1.5 * nb * pr.beta_at(nb / 4.0)
            + 0.75 * nb * pr.gamma_reduce_at(nb / 4.0);
        assert!(rel(dense_ring(&pr, nb, 4), ring4) < 1e-12);
        let m = 4.0 + 8.0 * (0.01 * n as f64).ceil();
        let ag = 2.0 * pr.alpha
            + m * pr.beta_at(m)
            + 2.0 * m * pr.beta_at(2.0 * m)
            + 4.0 * m * pr.gamma_unpack;
        assert!(rel(allgather_unpack(&pr, m, 4), ag) < 1e-12);
    }
    // A flat curve is the constant model.
    let mut flat = prof();
    flat.beta_curve = curve(&[(1.0, flat.beta), (1e9, flat.beta)]);
    for p in [2usize, 3, 6, 8] {
        let q = Query {
            at: crate::cost::Placement {
                p,
                ranks_per_node: None,
                fill: None,
                ..crate::cost::Placement::default()
            },
            n: 123_457,
            density: 0.01,
            gradiveq_ratio: 8.0,
        };
        let (a, b) = (
            predict(&prof(), &q, "trimmed").expect("predict"),
            predict(&flat, &q, "trimmed").expect("predict"),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!(rel(x.seconds, y.seconds) < 1e-12, "{} p={p}", x.name);
        }
    }
}

/// Curves are validated (sizes increasing, values finite and ≥ 0), and a
/// version-1 profile without curves still loads.
#[test]
fn curves_are_validated_and_version_1_profiles_load() {
    let mut pr = prof();
    pr.beta_curve = curve(&[(4096.0, 1e-10), (1024.0, 1e-10)]);
    assert!(pr.validate().is_err());
    pr.beta_curve = curve(&[(4096.0, -1e-10)]);
    assert!(pr.validate().is_err());
    pr.beta_curve = curve(&[(0.0, 1e-10)]);
    assert!(pr.validate().is_err());
    pr.beta_curve = Vec::new();
    pr.gamma_reduce_curve = curve(&[(1.0, f64::INFINITY)]);
    assert!(pr.validate().is_err());
    pr.gamma_reduce_curve = Vec::new();
    pr.gamma_unpack_curve = curve(&[(1.0, f64::NAN)]);
    let e = pr.validate().unwrap_err().to_string();
    assert!(e.contains("gamma_unpack_curve[0]"), "{e}");
    pr.gamma_unpack_curve = curve(&[(64.0, 1e-9), (64.0, 2e-9)]);
    assert!(pr.validate().is_err());
    let v1: Profile =
        serde_json::from_str(r#"{"version":1,"alpha":1e-6,"beta":1e-9}"#).expect("v1");
    v1.validate().expect("v1 valid");
    assert!(v1.beta_curve.is_empty());
    let v9: Profile =
        serde_json::from_str(r#"{"version":9,"alpha":1e-6,"beta":1e-9}"#).expect("v9");
    assert!(v9.validate().is_err());
    let mut pr = prof();
    pr.beta_curve = curve(&[(4096.0, 2e-10), (65536.0, 1e-10)]);
    pr.gamma_unpack_curve = curve(&[(16e6, 1e-9), (128e6, 2e-9)]);
    let back: Profile =
        serde_json::from_str(&serde_json::to_string(&pr).expect("json")).expect("parse");
    assert_eq!(back, pr);
}
