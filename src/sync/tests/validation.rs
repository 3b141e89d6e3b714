//! Bad arguments and calls: layer tables and options that differ across ranks,
//! bad layer names, calls out of order, overlapping buffers.

use super::*;

#[test]
fn mismatched_layer_tables_fail_on_every_rank() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("a", &[100]).expect("same on all ranks");
        let shape = if rank == 1 { [101] } else { [100] };
        s.register("b", &shape)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for r in &res {
        let e = r.as_ref().expect_err("every rank fails");
        // Every rank names both sides: rank 0's layer and rank 1's.
        assert!(
            e.contains("not the same on every rank: rank 0 has layer #1 \"b\" of shape [100]"),
            "{e}"
        );
        assert!(
            e.contains("rank 1 has layer #1 \"b\" of shape [101]"),
            "{e}"
        );
    }
    // Different numbers of layers: caught before the first step.
    let res = LocalComm::run(2, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("a", &[10]).expect("register");
        let mut g = vec![vec![1.0f32; 10]; 1 + rank];
        if rank == 1 {
            if let Err(e) = s.register("b", &[10]) {
                return e.to_string();
            }
        }
        let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
        s.sync(&mut v)
            .map(|_| String::new())
            .unwrap_or_else(|e| e.to_string())
    });
    assert!(res.iter().all(|e| e.contains("differs")), "{res:?}");
    // Different options.
    let res = LocalComm::run(2, |c| {
        let m = if c.rank() == 0 { 0.9 } else { 0.0 };
        GradSync::with_transport(
            c,
            Config {
                momentum: m,
                ..cfg()
            },
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    });
    assert!(res.iter().all(|r| r.is_err()));
}

#[test]
fn bad_calls_are_errors() {
    LocalComm::run(1, |c| {
        let mut s = GradSync::with_transport(
            c,
            Config {
                weight_decay: 0.1,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("a", &[4]).expect("register");
        let mut g = [0.0f32; 3];
        assert!(s.sync(&mut [&mut g[..]]).is_err(), "wrong length");
        let g = [0.0f32; 4];
        let mut out = [0.0f32; 4];
        // Weight decay needs the weights: the step fails (in `wait`).
        s.start(&[&g[..]]).expect("a failing step is still started");
        let e = s
            .wait(&mut [&mut out[..]])
            .expect_err("weight decay needs weights");
        assert!(e.to_string().contains("no weights were given"), "{e}");
        assert!(s.wait(&mut [&mut out[..]]).is_err(), "wait without start");
        s.start_with_weights(&[&g[..]], &[&g[..]]).expect("start");
        assert!(s.start_with_weights(&[&g[..]], &[&g[..]]).is_err(), "twice");
        s.wait(&mut [&mut out[..]]).expect("wait");
        assert!(s.register("late", &[4]).is_err(), "register after a step");
    });
    for delay in [0, config::MAX_DELAY + 1, u64::MAX] {
        let bad = Config { delay, ..cfg() };
        LocalComm::run(1, |c| {
            let e = GradSync::with_transport(c, bad.clone())
                .err()
                .expect("refused");
            assert!(e.to_string().contains(&format!("delay {delay}")), "{e}");
        });
    }
    let auto_density = [0.0, -1.0, 5.0, f64::NAN].map(|auto_density| Config {
        auto_density,
        ..cfg()
    });
    let weight_decay = [-0.1, f32::NAN, f32::INFINITY].map(|weight_decay| Config {
        weight_decay,
        ..cfg()
    });
    for (bad, needle) in auto_density
        .into_iter()
        .map(|c| (c, "auto_density"))
        .chain(weight_decay.into_iter().map(|c| (c, "weight_decay")))
    {
        LocalComm::run(1, |c| {
            let e = GradSync::with_transport(c, bad.clone())
                .err()
                .expect("refused");
            assert!(e.to_string().contains(needle), "{e}");
        });
    }
    let ok = Config {
        delay: config::MAX_DELAY,
        ..cfg()
    };
    LocalComm::run(1, |c| {
        assert!(GradSync::with_transport(c, ok.clone()).is_ok())
    });
}

/// Layer names tell layers apart in errors, stats and snapshots: an empty
/// name, a control character or a name already registered fails the
/// registration on every rank (naming the rank, the layer and why), and
/// registers nothing anywhere.
#[test]
fn layer_names_must_be_unique_and_printable() {
    let out = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg()).expect("engine");
        s.register("w", &[8]).expect("first w");
        let mut errs = Vec::new();
        for bad in ["w", "", "a\0b", "x\ny"] {
            // Only the last rank passes the bad name; the others a good one.
            let name = if rank == 2 { bad } else { "fine" };
            errs.push(s.register(name, &[4]).unwrap_err().to_string());
        }
        s.register("b", &[4]).expect("the table goes on");
        (errs, s.num_layers())
    });
    for (errs, n) in &out {
        assert_eq!(errs, &out[0].0, "the same errors on every rank");
        assert_eq!(*n, 2, "nothing registered by the failed calls");
    }
    let e = &out[0].0;
    assert!(
        e[0].contains("rank 2 failed") && e[0].contains("layer #0 has the same name"),
        "{}",
        e[0]
    );
    assert!(e[1].contains("a layer needs a name"), "{}", e[1]);
    assert!(
        e[2].contains("control character") && e[3].contains("control character"),
        "{e:?}"
    );
}

/// `register` between `start` and `wait` (no progress thread) is a local
/// error on the rank that calls it; the step then finishes everywhere.
#[test]
fn register_inside_a_step_is_refused_locally() {
    let res = LocalComm::run(3, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(
            c,
            Config {
                overlap: false,
                ..cfg()
            },
        )
        .expect("engine");
        s.register("d", &[8]).expect("register");
        let mut g = grad(rank, 0, 0, 8);
        s.start(&[&g[..]]).expect("start");
        let late = if rank == 1 {
            Some(
                s.register("late", &[4])
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            )
        } else {
            None
        };
        s.wait(&mut [&mut g[..]]).expect("wait");
        let mut g = grad(rank, 1, 0, 8);
        s.sync(&mut [&mut g[..]]).expect("the next step");
        late
    });
    let e = res[1]
        .clone()
        .expect("rank 1 registered")
        .expect_err("refused");
    assert!(e.contains("before the first step"), "{e}");
}

/// [`first_overlap`]: a written buffer meets any other, a read one only a
/// written one, through a buffer that reaches past its neighbours too;
/// empty buffers and touching ends never overlap.
#[test]
fn first_overlap_finds_written_pairs_only() {
    // A long read buffer holds a short read one, then a written one.
    let spans = [(0, 100, false), (10, 10, false), (50, 10, true)];
    assert_eq!(first_overlap(&spans), Some((0, 2)));
    // Only read buffers, nested: fine.
    assert_eq!(first_overlap(&spans[..2]), None);
    // Written buffers that touch end to start, and an empty one inside.
    let spans = [(0, 8, true), (8, 8, true), (4, 0, true)];
    assert_eq!(first_overlap(&spans), None);
    // The same buffer twice, written: found, indices in order.
    assert_eq!(
        first_overlap(&[(64, 8, true), (0, 8, true), (64, 8, true)]),
        Some((0, 2))
    );
    assert_eq!(first_overlap(&[]), None);
}

/// Ranks in different engine calls meet in the calls' first agreement and
/// fail alike, naming both calls, instead of waiting in two collectives; a
/// step that met a peer in another call does not count, so the ranks stay
/// in step.
#[test]
fn ranks_in_different_calls_fail_alike_and_stay_in_step() {
    type Call = fn(&mut GradSync<LocalComm>, usize) -> Result<()>;
    fn one_step(s: &mut GradSync<LocalComm>, rank: usize) -> Result<()> {
        let mut g = grad(rank, 0, 0, 8);
        s.sync(&mut [&mut g[..]]).map(|_| ())
    }
    let step: Call = one_step;
    let late_register: Call = |s, _| s.register("late", &[4]).map(|_| ());
    let restore: Call = |s, _| s.restore_bytes(b"not a snapshot");
    let complete_then_step: Call = |s, rank| {
        s.complete_table()?;
        one_step(s, rank)
    };
    for (name, steps_before, odd, others, want) in [
        (
            "late register",
            1,
            late_register,
            step,
            ["step 1", "register after"],
        ),
        ("restore", 1, restore, step, ["step 1", "a restore"]),
        (
            "first step",
            0,
            restore,
            complete_then_step,
            ["step 0", "a restore"],
        ),
    ] {
        let res = LocalComm::run(3, move |c| {
            let rank = c.rank();
            let mut s = GradSync::with_transport(c, cfg()).expect("engine");
            s.register("a", &[8]).expect("register");
            for _ in 0..steps_before {
                step(&mut s, rank).expect("a step everywhere");
            }
            let call = if rank == 2 { odd } else { others };
            let e = call(&mut s, rank).expect_err("every rank fails");
            // Still in step: the same call everywhere runs.
            step(&mut s, rank).expect("the next step everywhere");
            (e.to_string(), s.step())
        });
        for (e, st) in &res {
            assert!(e.contains("the call differs across ranks"), "{name}: {e}");
            assert!(
                e.contains(&format!("rank 0 is in {}", want[0]))
                    && e.contains(&format!("rank 2 in {}", want[1])),
                "{name}: {e}"
            );
            assert_eq!(*st, steps_before + 1, "{name}: {e}");
        }
    }
}
