//! Every codec's decoder on hostile bytes: `decode`, `decode_add` and
//! `for_each_sent` must return `Ok` or `Err`, never panic, and agree with
//! each other; hostile encoder state (`set_state`) must be refused or leave
//! an encoder whose messages decode.
//!
//! Input: byte 0 picks the codec configuration ([`CONFIGS`]), byte 1 the
//! destination length (see [`length`]), the rest is the message.
#![no_main]

use gradsync::codec::{Codec, CodecConfig, HEADER_LEN};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

use gradsync_fuzz::CODECS as CONFIGS;

/// Largest destination the target allocates.
const MAX_N: usize = 1 << 16;

fn codecs() -> &'static [Box<dyn Codec>] {
    static C: OnceLock<Vec<Box<dyn Codec>>> = OnceLock::new();
    C.get_or_init(|| {
        CONFIGS
            .iter()
            .map(|s| {
                let cfg: CodecConfig = s.parse().expect("config parses");
                cfg.build().expect("config builds")
            })
            .collect()
    })
}

/// The header's element count when it is small and `sel` is even (the
/// common case a receiver sees); otherwise `sel / 2`, which mostly
/// disagrees with the header and exercises the length checks.
fn length(msg: &[u8], sel: u8) -> usize {
    if sel % 2 == 0 && msg.len() >= HEADER_LEN {
        let n = u64::from_le_bytes(msg[4..12].try_into().unwrap());
        if n <= MAX_N as u64 {
            return n as usize;
        }
    }
    usize::from(sel / 2)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let which = usize::from(data[0]) % CONFIGS.len();
    let msg = &data[2..];
    let n = length(msg, data[1]);
    let codec = &codecs()[which];

    let mut out = vec![f32::NAN; n];
    let dec = codec.decode(msg, &mut out);

    let mut acc = vec![1.0f32; n];
    let add = codec.decode_add(msg, &mut acc);
    assert_eq!(
        dec.is_ok(),
        add.is_ok(),
        "{}: decode {dec:?} but decode_add {add:?}",
        CONFIGS[which]
    );
    if dec.is_ok() {
        for (i, (&o, &a)) in out.iter().zip(&acc).enumerate() {
            // Each sent value is finite (checked below), but an accepted
            // message may still sum to ±Inf (RGC-quant with a repeated
            // index and a mean near f32::MAX): not checked here.
            if !o.is_finite() {
                continue;
            }
            // `decode_add` into ones adds the same values (up to rounding).
            let want = o + 1.0;
            assert!(
                (a - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{}: decode_add[{i}] = {a}, decode gives {o}",
                CONFIGS[which]
            );
        }
    }

    let mut sent = vec![0.0f32; n];
    let mut visited = 0usize;
    let each = codec.for_each_sent(msg, n, &mut |i, v| {
        assert!(i < n, "{}: sent index {i} of {n}", CONFIGS[which]);
        assert!(v.is_finite(), "{}: sent value {v} at {i}", CONFIGS[which]);
        sent[i] += v;
        visited += 1;
    });
    match each {
        Ok(true) => {
            assert!(
                dec.is_ok(),
                "{}: for_each_sent accepts what decode refuses: {dec:?}",
                CONFIGS[which]
            );
            for (i, (&s, &o)) in sent.iter().zip(&out).enumerate() {
                assert!(
                    s == o || (s - o).abs() <= 1e-6 * o.abs().max(1.0),
                    "{}: for_each_sent gives {s} at {i}, decode {o}",
                    CONFIGS[which]
                );
            }
        }
        Ok(false) => assert_eq!(visited, 0, "{}: dense codec visited", CONFIGS[which]),
        Err(_) => assert_eq!(visited, 0, "{}: visited before refusing", CONFIGS[which]),
    }

    // Hostile encoder state: refused, or an encoder whose output decodes.
    let mut fresh = codec.config().build().expect("builds");
    if fresh.set_state(msg).is_ok() {
        let x: Vec<f32> = (0..97)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.01)
            .collect();
        let mut wire = Vec::new();
        if fresh.encode(&x, &mut wire).is_ok() {
            let mut back = vec![0.0f32; x.len()];
            codec.decode(&wire, &mut back).unwrap_or_else(|e| {
                panic!(
                    "{}: own message after set_state refused: {e}",
                    CONFIGS[which]
                )
            });
        }
    }
});
