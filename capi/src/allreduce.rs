//! `gs_allreduce`: the engine's verified dense allreduce
//! ([`gradsync_engine::dense::allreduce`]) on a caller's communicator.

use crate::{gs_algo, gs_dtype, gs_op, guard, invalid};
use gradsync_engine::comm::MpiComm;
use gradsync_engine::dense::{
    allreduce_agreed, allreduce_agreed_with, AllreduceAlgo, AnyBuf, AnyWorkspace, ReduceOp,
};
use std::ffi::{c_int, c_void};
use std::sync::{LazyLock, Mutex};

/// `gs_allreduce`'s scratch, kept across calls (as large as the largest
/// buffer's algorithm needed: half of it for `GS_ALGO_RABENSEIFNER`, all of
/// it for `GS_ALGO_MPI`): a fresh one each call paid the first touch of its pages.
static SCRATCH: LazyLock<Mutex<AnyWorkspace>> = LazyLock::new(Mutex::default);

/// The enum parameters as the integers C passes, so that an out-of-range
/// value is an error rather than undefined behaviour (a Rust enum must
/// hold one of its variants). cbindgen skips these and writes the enums'
/// own names in the signature, as C callers know them.
pub mod abi {
    use std::ffi::c_int;
    /// cbindgen:ignore
    #[repr(transparent)]
    #[derive(Clone, Copy, Debug)]
    pub struct gs_dtype(pub c_int);
    /// cbindgen:ignore
    #[repr(transparent)]
    #[derive(Clone, Copy, Debug)]
    pub struct gs_algo(pub c_int);
    /// cbindgen:ignore
    #[repr(transparent)]
    #[derive(Clone, Copy, Debug)]
    pub struct gs_op(pub c_int);
    /// cbindgen:ignore
    #[repr(transparent)]
    #[derive(Clone, Copy, Debug)]
    pub struct gs_memory(pub c_int);
}

/// The raw enum integers as Rust values, or what is wrong.
fn parse(
    dtype: c_int,
    algo: c_int,
    op: c_int,
) -> Result<(gs_dtype, AllreduceAlgo, ReduceOp), String> {
    let dtype = match dtype {
        x if x == gs_dtype::GS_FLOAT32 as c_int => gs_dtype::GS_FLOAT32,
        x if x == gs_dtype::GS_FLOAT64 as c_int => gs_dtype::GS_FLOAT64,
        x => return Err(format!("gs_allreduce: dtype {x} is not a gs_dtype")),
    };
    let algo = match algo {
        x if x == gs_algo::GS_ALGO_RABENSEIFNER as c_int => AllreduceAlgo::Rabenseifner,
        x if x == gs_algo::GS_ALGO_RING as c_int => AllreduceAlgo::Ring,
        x if x == gs_algo::GS_ALGO_MPI as c_int => AllreduceAlgo::Mpi,
        x if x == gs_algo::GS_ALGO_HIERARCHICAL as c_int => AllreduceAlgo::Hierarchical,
        x => return Err(format!("gs_allreduce: algo {x} is not a gs_algo")),
    };
    let op = match op {
        x if x == gs_op::GS_OP_SUM as c_int => ReduceOp::Sum,
        x if x == gs_op::GS_OP_AVERAGE as c_int => ReduceOp::Average,
        x => return Err(format!("gs_allreduce: op {x} is not a gs_op")),
    };
    Ok((dtype, algo, op))
}

/// In-place allreduce of `count` elements of type `dtype` (a gs_dtype
/// value) at `buf` over `comm` with algorithm `algo` (a gs_algo value) and
/// reduction `op` (a gs_op value). Collective over `comm`.
///
/// The first call on `comm` duplicates it (`MPI_Comm_dup`, so gradsync's
/// traffic never mixes with the caller's) and keeps the duplicate as an
/// attribute of `comm`; later calls reuse it, and `MPI_Comm_free(&comm)`
/// frees it. For many small buffers per step prefer one call on a fused
/// buffer, or the engine.
/// Every rank must pass the same `count`, `dtype`, `algo` and `op`: one
/// that differs, an out-of-range `dtype`/`algo`/`op`, or a NULL or
/// misaligned `buf` (with `count > 0`) on any rank fails every rank alike
/// with `GS_ERR_RANK_FAILED`, `buf` unchanged (one small agreement before
/// the transfer). An MPI error inside the transfer
/// is `GS_ERR_MPI` on the rank that saw it (peers may be blocked: abort).
/// The values are not inspected, as `MPI_Allreduce` does not inspect them:
/// a NaN or Inf (or a sum that overflows) reaches every rank's result
/// alike, with `GS_OK`; the engine (`gs_sync`) checks its gradients.
/// `GS_OP_AVERAGE` divides the sum by the number of ranks. The algorithm's
/// scratch is kept for the next call (half the buffer for
/// `GS_ALGO_RABENSEIFNER`, the whole buffer for `GS_ALGO_MPI`), as large as
/// the largest it needed, for the life of the process.
///
/// # Safety
/// `comm` is a valid communicator of the MPI library gradsync is linked
/// with; `buf` is NULL or points to `count` writable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn gs_allreduce(
    comm: mpi::ffi::MPI_Comm,
    buf: *mut c_void,
    count: usize,
    dtype: abi::gs_dtype,
    algo: abi::gs_algo,
    op: abi::gs_op,
) -> c_int {
    guard(|| {
        // SAFETY: `comm` is a valid communicator of the MPI library
        // gradsync is linked with, as gs_allreduce's `# Safety` contract
        // requires of the caller: duplicate_kept's own requirement.
        let mpi = unsafe { MpiComm::duplicate_kept(comm) }?;
        let local = parse(dtype.0, algo.0, op.0).and_then(|(dt, algo, op)| {
            let (size, aligned) = match dt {
                gs_dtype::GS_FLOAT32 => (4, buf.cast::<f32>().is_aligned()),
                gs_dtype::GS_FLOAT64 => (8, buf.cast::<f64>().is_aligned()),
            };
            if count > 0 && buf.is_null() {
                Err("gs_allreduce: buf is NULL".to_string())
            } else if count > 0 && !aligned {
                Err("gs_allreduce: buf is not aligned for its dtype".to_string())
            } else if count > isize::MAX as usize / size {
                Err(format!("gs_allreduce: count {count} is too large"))
            } else {
                Ok((dt, algo, op))
            }
        });
        // Argument errors are local, and dtype, count, algorithm and
        // operation must match: one agreement on all of them, so that no
        // rank returns alone and nothing mixed reaches the wire.
        let call = local.map_err(invalid).map(|(dt, algo, op)| {
            let b = match dt {
                gs_dtype::GS_FLOAT32 => AnyBuf::F32(if count == 0 {
                    &mut []
                } else {
                    // SAFETY: `local` is Ok, so with `count > 0` `buf` is
                    // non-null and aligned for `f32`, and `count * 4` ≤
                    // isize::MAX (all checked above); the contract promises
                    // `count` writable `f32`s at `buf`, lent for this call,
                    // which the slice does not outlive.
                    unsafe { std::slice::from_raw_parts_mut(buf.cast(), count) }
                }),
                gs_dtype::GS_FLOAT64 => AnyBuf::F64(if count == 0 {
                    &mut []
                } else {
                    // SAFETY: `local` is Ok, so with `count > 0` `buf` is
                    // non-null and aligned for `f64`, and `count * 8` ≤
                    // isize::MAX (all checked above); the contract promises
                    // `count` writable `f64`s at `buf`, lent for this call,
                    // which the slice does not outlive.
                    unsafe { std::slice::from_raw_parts_mut(buf.cast(), count) }
                }),
            };
            (b, algo, op)
        });
        // The kept scratch, unless another thread's call holds it (a
        // panic that poisoned it left it usable: its contents never matter).
        match SCRATCH.try_lock() {
            Ok(mut ws) => allreduce_agreed_with(&mpi, call, &mut ws),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                allreduce_agreed_with(&mpi, call, &mut p.into_inner())
            }
            Err(std::sync::TryLockError::WouldBlock) => allreduce_agreed(&mpi, call),
        }
    })
}
