//! The CPU state that the engine's local phases depend on, kept clean
//! after the code that disturbs it.
//!
//! faer's matrix kernels (PowerSGD's products, GradiVeQ's projections and
//! eigendecomposition) pick AVX or AVX-512 at run time and can return with
//! the upper halves of the vector registers still dirty. The rest of
//! gradsync is built for baseline x86-64: its loops (RGC's selection, the
//! residuals, momentum, fusing and unfusing) are legacy-SSE code, which
//! with the upper state dirty runs with a false dependency on it. On an
//! AMD EPYC of family 26 (2026-12-01) the calibration's RGC table of
//! 64 MiB, which took 21–25 ms alone, took 34–39 ms in the shuffled
//! rounds where PowerSGD's probes often ran just before it, and 42–51 ms
//! in rounds of only those two; one `VZEROUPPER` after the products
//! brought it back to 22–23 ms, and the calibration to what the engine's
//! steps measure (docs/benchmarks/powersgd.md). [`clear_upper_state`] is
//! that instruction, called after every faer call.

/// Zero the upper halves of the vector registers (`VZEROUPPER`) where the
/// CPU has AVX; nothing elsewhere. Cheap (one call after a check the
/// standard library caches).
#[inline]
pub(crate) fn clear_upper_state() {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has AVX (checked above), the one feature
            // `vzeroupper` is compiled with.
            unsafe { vzeroupper() };
        }
    }
}

/// `VZEROUPPER`, as a call of its own: the calling convention already
/// treats every vector register as clobbered by a call, and the asm says
/// which ones it changes, so no value of the caller is lost whatever
/// target features the caller was built with.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[inline(never)]
#[target_feature(enable = "avx")]
unsafe fn vzeroupper() {
    // SAFETY: VZEROUPPER (an AVX instruction; the caller's contract)
    // touches only bits 128 and up of ymm0-15, all declared clobbered;
    // no memory, stack or flags.
    unsafe {
        std::arch::asm!(
            "vzeroupper",
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nomem, nostack, preserves_flags)
        )
    };
}

#[cfg(test)]
mod tests {
    use super::clear_upper_state;

    #[test]
    fn clearing_keeps_the_values_in_flight() {
        // Floating-point values live in the low halves of the registers
        // across the call: they must come out unchanged.
        let v: Vec<f64> = (0..64).map(|i| i as f64 * 1.5).collect();
        let mut acc = 0.0f64;
        for (i, x) in v.iter().enumerate() {
            acc += x;
            if i % 7 == 0 {
                clear_upper_state();
            }
        }
        assert_eq!(acc, (0..64).map(|i| i as f64 * 1.5).sum::<f64>());
    }
}
