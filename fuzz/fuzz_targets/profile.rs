//! The profile loader (`gradsync::cost::Profile::load`, `--profile` of
//! `predict`/`plan`/`crossover` and `Config::profile`) on hostile files:
//! `Ok` or an error naming the file, never a panic; an accepted profile
//! predicts, chooses and finds crossovers without panicking, and what it
//! saves loads again.
#![no_main]

use gradsync::cost::{choose, crossover, predict, Placement, Profile, Query, StrategyId};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = gradsync_fuzz::scratch("profile.json");
    std::fs::write(&path, data).expect("write scratch file");
    let prof = match Profile::load(&path) {
        Ok(p) => p,
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains(&*path.to_string_lossy()),
                "error does not name the file: {text}"
            );
            return;
        }
    };
    for (n, p, l) in [
        (1usize, 1usize, None),
        (1000, 4, Some(2)),
        (1 << 24, 64, Some(8)),
        (1 << 20, 6, Some(4)),
    ] {
        for method in ["trimmed", "threshold", "quant", "exact"] {
            let q = Query {
                n,
                at: Placement {
                    p,
                    ranks_per_node: l,
                    ..Placement::default()
                },
                density: 0.01,
                gradiveq_ratio: 8.0,
            };
            if let Ok(preds) = predict(&prof, &q, method) {
                let _ = choose(&preds, &[]);
                let _ = choose(&preds, &[StrategyId::DenseRing, StrategyId::Sbc]);
            }
        }
    }
    let base = Query {
        n: 1,
        at: Placement {
            p: 8,
            ranks_per_node: Some(2),
            ..Placement::default()
        },
        density: 0.001,
        gradiveq_ratio: 8.0,
    };
    let _ = crossover(
        &prof,
        &base,
        "trimmed",
        ("sparse-allgather", "dense-rabenseifner"),
        1 << 20,
        1,
    );
    // PowerSGD from a hostile profile's curve: priced, never a panic.
    let _ = crossover(
        &prof,
        &base,
        "trimmed",
        ("powersgd", "dense-rabenseifner"),
        1 << 20,
        2,
    );
    for (n, r) in [(1usize, 1usize), (4096, 2), (1 << 22, 4), (1 << 24, 9)] {
        let _ = gradsync::cost::predict_matrix(
            &prof,
            &Query { n, ..base },
            "trimmed",
            gradsync::cost::square_view(n),
            r,
        );
    }
    let out = gradsync_fuzz::scratch("profile-saved.json");
    prof.save(&out).expect("save");
    Profile::load(&out).expect("a saved profile loads");
});
