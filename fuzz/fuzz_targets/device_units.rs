//! The device sparse step's message parser (`gpu::sparse::parse_units`)
//! on hostile bytes: `Ok` or `Err`, never a panic; on `Ok` every index is
//! inside its layer, ascending within it, and every value finite.
//!
//! Input: byte 0 picks the layer table (1 to 4 layers of 0 to 64 Ki
//! elements, from the next bytes), the rest is the message.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let layers = 1 + (data[0] % 4) as usize;
    if data.len() < 1 + 2 * layers {
        return;
    }
    let sizes: Vec<usize> = (0..layers)
        .map(|l| u16::from_le_bytes([data[1 + 2 * l], data[2 + 2 * l]]) as usize)
        .collect();
    let msg = &data[1 + 2 * layers..];
    if let Ok((gidx, val, _non_finite)) = gradsync::gpu::sparse::parse_units(msg, 0, &sizes) {
        let total: u64 = sizes.iter().map(|&n| n as u64).sum();
        assert_eq!(gidx.len(), val.len());
        assert!(gidx.iter().all(|&i| i < total));
        assert!(gidx.windows(2).all(|w| w[0] != w[1]));
        assert!(val.iter().all(|v| v.is_finite()));
    }
});
