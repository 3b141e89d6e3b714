//! The snapshot loader (`GradSync::restore_bytes`) on hostile bytes: a
//! refused snapshot leaves the engine unchanged; an accepted one leaves an
//! engine that can still step and snapshot. Never a panic.
//!
//! The engine (`gradsync_fuzz::engine`, one rank over `LocalComm`) is built
//! once; every run starts from the same state (after two steps).
//!
//! Snapshot files end in a CRC-32 of their payload (format 3 and later), which a
//! mutated input almost never matches. So the fuzzer's input is the
//! *payload*: the target appends its valid CRC and fuzzes the parser and
//! the validation behind the checksum (the checksum itself is covered by
//! unit tests: `sync::tests::bad_snapshots_fail_every_rank_and_change_nothing`).
#![no_main]

use gradsync::comm::LocalComm;
use gradsync::sync::GradSync;
use libfuzzer_sys::fuzz_target;
use std::cell::RefCell;

struct Fixture {
    engine: GradSync<LocalComm>,
    baseline: Vec<u8>,
}

thread_local! {
    static FIX: RefCell<Fixture> = RefCell::new({
        let mut engine = gradsync_fuzz::engine();
        gradsync_fuzz::run_steps(&mut engine, 0, 2).expect("steps");
        let baseline = engine.snapshot_bytes().expect("snapshot");
        Fixture { engine, baseline }
    });
}

fuzz_target!(|payload: &[u8]| {
    let mut data = payload.to_vec();
    data.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    FIX.with(|f| {
        let f = &mut *f.borrow_mut();
        match f.engine.restore_bytes(&data) {
            Err(_) => {
                let now = f.engine.snapshot_bytes().expect("snapshot");
                assert!(now == f.baseline, "a refused snapshot changed the engine");
            }
            Ok(()) => {
                // Whatever was accepted must not break the next steps (an
                // error such as a non-finite residual is fine, a panic not).
                let step = f.engine.step();
                let _ = gradsync_fuzz::run_steps(&mut f.engine, step, step.saturating_add(2));
                // Its own snapshot restores, unless the steps drove the
                // state non-finite (values near f32::MAX), which
                // snapshot_bytes refuses to write.
                if let Ok(again) = f.engine.snapshot_bytes() {
                    f.engine
                        .restore_bytes(&again)
                        .expect("an engine's own snapshot restores");
                }
                f.engine
                    .restore_bytes(&f.baseline)
                    .expect("baseline restores");
                // The baseline's state again, under a new run identity (a
                // restore starts a branch of the run): the bytes to compare
                // later refusals against.
                f.baseline = f.engine.snapshot_bytes().expect("snapshot");
            }
        }
    });
});
