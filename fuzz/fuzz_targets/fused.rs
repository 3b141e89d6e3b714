//! The fused-message parser (`parse_fused`) and the failure-message reader
//! (`failure_text`) on hostile bytes: `Ok` with entries that tile the
//! message, or an error, never a panic.
//!
//! Input: byte 0 is the number of layers the receiver expects (mod 9, ids
//! `0..u`), the rest is the message (for step 3).
#![no_main]

use gradsync::sparse::{failure_text, parse_fused, FUSED_HEADER_LEN, TOC_ENTRY_LEN};
use libfuzzer_sys::fuzz_target;

/// Step the receiver is at (the seeds are written for it).
pub const STEP: u64 = 3;

fuzz_target!(|data: &[u8]| {
    let Some((&u, msg)) = data.split_first() else {
        return;
    };
    let expected: Vec<u32> = (0..u32::from(u % 9)).collect();
    let _ = failure_text(msg);
    let mut out = Vec::new();
    let names = |id: u32| format!("layer{id}");
    if parse_fused(msg, 1, STEP, &expected, &names, &mut out).is_ok() {
        assert_eq!(out.len(), expected.len());
        let mut pos = FUSED_HEADER_LEN + TOC_ENTRY_LEN * expected.len();
        for (e, &want) in out.iter().zip(&expected) {
            assert_eq!(e.layer, want);
            assert_eq!(e.start, pos, "entries are contiguous");
            assert!(e.start <= e.end && e.end <= msg.len());
            pos = e.end;
        }
        assert_eq!(pos, msg.len(), "entries cover the message");
    } else {
        assert!(out.len() <= expected.len());
    }
});
