//! The `gs_engine` handle: one [`GradSync`] engine over a duplicate of the
//! caller's communicator, the element count of every registered layer (the
//! C caller passes bare pointers) and the last step statistics as JSON.

use crate::{c_text, gs_status, guard, guard_ptr, invalid, set_last_error};
use gradsync_engine::sync::{Config, GradSync, LayerId};
use gradsync_engine::Error;
use std::ffi::{c_char, c_int, CStr, CString};
use std::os::unix::ffi::OsStrExt;

/// An engine (opaque). Create it with gs_engine_create, free it with
/// gs_engine_destroy. Not thread-safe: call one function at a time on it.
pub struct gs_engine {
    sync: GradSync,
    /// Element count of each registered layer, in registration order.
    lens: Vec<usize>,
    /// `gs_last_stats_json`'s text.
    stats_json: CString,
    /// A panic escaped a call on this engine: it refuses further calls.
    poisoned: bool,
}

/// Largest element count a C array may have for a Rust slice of `T`.
fn max_elems<T>() -> usize {
    isize::MAX as usize / std::mem::size_of::<T>().max(1)
}

/// Run `f` on the engine `e` inside [`guard`]; NULL and poisoned handles are
/// local errors (`GS_ERR_INVALID`, `GS_ERR_PANIC`).
///
/// # Safety
/// `e` is NULL or a live handle from gs_engine_create.
unsafe fn with_engine(
    e: *mut gs_engine,
    what: &str,
    f: impl FnOnce(&mut gs_engine) -> Result<(), Error>,
) -> c_int {
    if e.is_null() {
        return guard(|| Err(invalid(format!("{what}: the engine is NULL"))));
    }
    // SAFETY: `e` is non-null (checked above), so by this function's
    // contract it is a live handle from gs_engine_create (a valid, aligned
    // `gs_engine`); handles are not thread-safe (one call at a time on
    // each), so nothing else refers to it during this call.
    let e = unsafe { &mut *e };
    if e.poisoned {
        let _ = guard(|| Ok(()));
        set_last_error(&format!(
            "{what}: the engine panicked in an earlier call and cannot be used; destroy it"
        ));
        return gs_status::GS_ERR_PANIC as c_int;
    }
    // Every call but saving a snapshot enters MPI: after MPI_Finalize (or
    // before MPI_Init) that aborts inside the library; an error instead.
    if what != "gs_save_snapshot" {
        if let Err(err) = gradsync_engine::comm::mpi_ready() {
            let why = match err {
                Error::InvalidArgument(m) => m,
                other => other.to_string(),
            };
            return guard(|| Err(invalid(format!("{what}: {why}"))));
        }
    }
    let code = guard(|| f(&mut *e));
    if code == gs_status::GS_ERR_PANIC as c_int {
        e.poisoned = true;
    }
    code
}

/// Create an engine over a duplicate of `comm` (collective over `comm`:
/// every rank calls it). `config_json` is a flat JSON object of engine
/// options, e.g. `{"momentum": 0.9, "codec": "rgc:density=0.001"}`, or NULL
/// or `""` for the defaults. On success `*out` receives the handle; on
/// failure `*out` is set to NULL.
///
/// MPI must be initialized (`MPI_Init_thread` with `MPI_THREAD_SERIALIZED`
/// or higher lets the engine communicate on a progress thread between
/// gs_start and gs_wait; with a lower level it communicates inside
/// gs_start). The library never initializes or finalizes MPI, and never
/// frees `comm`.
///
/// A bad `config_json` or NULL `out` on some rank fails every rank alike
/// (`GS_ERR_RANK_FAILED`). An invalid `comm` or MPI not being initialized
/// is a local `GS_ERR_INVALID` / `GS_ERR_MPI`.
///
/// # Safety
/// `comm` is a valid communicator of the MPI library gradsync is linked
/// with; `config_json` is NULL or a NUL-terminated string; `out` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn gs_engine_create(
    comm: mpi::ffi::MPI_Comm,
    config_json: *const c_char,
    out: *mut *mut gs_engine,
) -> c_int {
    if !out.is_null() {
        // SAFETY: `out` is non-null (checked above), and the contract
        // promises that a non-null `out` is writable.
        unsafe { *out = std::ptr::null_mut() };
    }
    guard(|| {
        let cfg = if out.is_null() {
            Err(invalid("gs_engine_create: out is NULL"))
        } else if config_json.is_null() {
            Ok(Config::default())
        } else {
            // SAFETY: `config_json` is non-null (checked above), and the
            // contract promises it is then a NUL-terminated string; it is
            // only read during this call.
            unsafe { c_text(config_json, "gs_engine_create: config_json") }
                .map_err(invalid)
                .and_then(Config::from_options_json)
                .and_then(|c| {
                    if c.weight_decay != 0.0 {
                        // No entry point here takes the weights it needs.
                        Err(invalid(
                            "gs_engine_create: config_json: weight_decay is not available \
                             through the C ABI (gs_sync takes no weights); apply the decay \
                             in the optimizer",
                        ))
                    } else if c.delay > 1 {
                        // A communicating step writes the weights back.
                        Err(invalid(
                            "gs_engine_create: config_json: delay > 1 is not available through \
                             the C ABI (gs_sync takes no weights, and a delayed run needs them \
                             writable at every step so that the ranks' weights stay equal)",
                        ))
                    } else {
                        Ok(c)
                    }
                })
        };
        // The options are parsed on each rank: the engine agrees on them
        // before its own collectives, so a rank with bad options fails
        // them all.
        // SAFETY: the contract promises that `comm` is a valid communicator
        // of the MPI library gradsync is linked with, as from_raw_comm
        // requires.
        let sync = unsafe { GradSync::from_raw_comm(comm, cfg) }?;
        let eng = Box::into_raw(Box::new(gs_engine {
            sync,
            lens: Vec::new(),
            stats_json: CString::default(),
            poisoned: false,
        }));
        // SAFETY: `out` is non-null here: a NULL `out` made `cfg` an error,
        // which from_raw_comm returns (its agreement fails every rank on a
        // local error), so the `?` above left; a non-null `out` is writable
        // (contract).
        unsafe { *out = eng };
        Ok(())
    })
}

/// Destroy an engine and free its duplicate communicator (local; NULL is a
/// no-op). Call it before `MPI_Finalize` (after it the duplicate is leaked
/// instead of freed, which is harmless). A step still in flight after
/// gs_start is waited for (every rank must have started it), its result
/// discarded. The caller's communicator stays usable.
///
/// # Safety
/// `e` is NULL or a live handle from gs_engine_create, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn gs_engine_destroy(e: *mut gs_engine) {
    if e.is_null() {
        return;
    }
    let _ = guard(|| {
        // SAFETY: `e` is non-null (checked above), so by the contract it is a
        // live handle from gs_engine_create (made by `Box::into_raw`) that
        // the caller never uses again: ownership returns to a Box once.
        drop(unsafe { Box::from_raw(e) });
        Ok(())
    });
}

/// Register a layer of `shape[0] × … × shape[ndim-1]` elements (`ndim` 0: one
/// element) under `name`, in the order every rank uses; layer `i` of
/// gs_sync's `grads` is the `i`-th registered layer. Collective: every rank
/// registers the same layers (name, shape, strategy) in the same order,
/// before the first step; a difference fails every rank.
///
/// `strategy` (NULL = `"auto"`): `"auto"` (dense below the configured
/// `compress_threshold`, else the configured codec; the cost model's choice
/// with a `profile` option), `"dense"`, `"gradiveq[:k=768,d=96,...]"`, or a
/// codec string such as `"rgc:density=0.001"`, `"3lc:s=1.75"`,
/// `"qsgd:bits=4"`.
///
/// A NULL or non-UTF-8 `name` or `strategy`, or a NULL `shape` with
/// `ndim > 0`, on one rank still takes part in the registration collective
/// and fails every rank with `GS_ERR_RANK_FAILED` naming that rank.
///
/// # Safety
/// `e` is NULL or a live handle; `name` and `strategy` are NULL or
/// NUL-terminated; `shape` is NULL or points to `ndim` values.
#[no_mangle]
pub unsafe extern "C" fn gs_register(
    e: *mut gs_engine,
    name: *const c_char,
    shape: *const usize,
    ndim: usize,
    strategy: *const c_char,
) -> c_int {
    let register = |eng: &mut gs_engine| {
        // SAFETY: the contract promises that `name` is NULL (which c_text
        // reports) or NUL-terminated; it is only read during this call.
        let name_r = unsafe { c_text(name, "gs_register: name") };
        let shape_r: Result<&[usize], String> = if ndim == 0 {
            Ok(&[])
        } else if shape.is_null() {
            Err(format!("gs_register: shape is NULL with ndim = {ndim}"))
        } else if ndim > max_elems::<usize>() {
            Err(format!("gs_register: ndim = {ndim} is absurd"))
        } else {
            // SAFETY: `shape` is non-null and `ndim` ≤ isize::MAX / 8 (both
            // checked above), so by the contract it points to `ndim` readable
            // `usize`s, only read during this call.
            Ok(unsafe { std::slice::from_raw_parts(shape, ndim) })
        };
        let spec_r = if strategy.is_null() {
            Ok("auto")
        } else {
            // SAFETY: `strategy` is non-null (checked above), and the contract
            // promises it is then NUL-terminated; only read during this call.
            unsafe { c_text(strategy, "gs_register: strategy") }
        };
        let id = match (&name_r, &shape_r, &spec_r) {
            (Ok(name), Ok(shape), Ok(spec)) => eng.sync.register_spec(name, shape, spec)?,
            _ => {
                let why = [name_r.err(), shape_r.err(), spec_r.err()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join("; ");
                // Enter the registration collective carrying the cause, so
                // every rank fails.
                return Err(eng.sync.fail_register("<invalid>", invalid(why)));
            }
        };
        let n = eng
            .sync
            .layer(id)
            .map_or(0, |(_, shape, _)| shape.iter().product());
        eng.lens.push(n);
        Ok(())
    };
    // SAFETY: the contract promises that `e` is NULL or a live handle, which
    // is all with_engine requires.
    unsafe { with_engine(e, "gs_register", register) }
}

/// The gradient arrays as slices, or what is wrong with them.
///
/// # Safety
/// `grads` is NULL or points to `nlayers` pointers, readable during the
/// call (the pointers are returned, not dereferenced).
unsafe fn slices<P: Copy>(
    eng: &gs_engine,
    what: &str,
    grads: *const P,
    nlayers: usize,
    is_null: impl Fn(P) -> bool,
    is_aligned: impl Fn(P) -> bool,
) -> Result<Vec<(P, usize)>, String> {
    let n = eng.lens.len();
    if nlayers != n {
        return Err(format!(
            "{what}: nlayers = {nlayers}, but {n} layers are registered"
        ));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    if grads.is_null() {
        return Err(format!("{what}: grads is NULL"));
    }
    // SAFETY: `grads` is non-null (checked above) and `nlayers == n`, so by
    // this function's contract it points to `n` readable pointers, which the
    // slice (dropped on return) only reads.
    let ptrs = unsafe { std::slice::from_raw_parts(grads, n) };
    let name = |i: usize| {
        eng.sync
            .layer(LayerId(i))
            .map_or_else(String::new, |(nm, _, _)| format!(" (layer {nm:?})"))
    };
    let mut out: Vec<(P, usize)> = Vec::with_capacity(n);
    for (i, (&p, &len)) in ptrs.iter().zip(&eng.lens).enumerate() {
        if len > 0 && is_null(p) {
            return Err(format!("{what}: grads[{i}]{} is NULL", name(i)));
        }
        if len > 0 && !is_aligned(p) {
            return Err(format!(
                "{what}: grads[{i}]{} is not aligned for float",
                name(i)
            ));
        }
        out.push((p, len));
    }
    Ok(out)
}

/// One synchronous step: `grads[i]` (layer `i`'s local gradient, as many
/// floats as the layer has elements) is replaced in place by the layer's
/// update direction, the same on every rank; apply it as `w -= lr * d`.
/// `nlayers` must equal the number of registered layers. Collective.
///
/// A NULL `grads` or `grads[i]`, a wrong `nlayers`, or arrays that overlap
/// (each layer's result is written in place), on one rank fails this step
/// on every rank with `GS_ERR_RANK_FAILED` (gs_last_error names the rank
/// and the cause); nothing is applied and the next step runs normally.
///
/// # Safety
/// `e` is NULL or a live handle; `grads` is NULL or points to `nlayers`
/// pointers, each NULL or to the layer's element count of writable floats.
#[no_mangle]
pub unsafe extern "C" fn gs_sync(
    e: *mut gs_engine,
    grads: *const *mut f32,
    nlayers: usize,
) -> c_int {
    let step = |eng: &mut gs_engine| {
        // SAFETY: the contract promises that `grads` is NULL or points to
        // `nlayers` pointers, each NULL or to the layer's element count of
        // writable floats: mut_slices' requirement (it checks the rest).
        match unsafe { mut_slices(eng, "gs_sync", grads, nlayers) } {
            Ok(mut g) => eng.sync.sync(&mut g).map(|_| ()),
            Err(why) => Err(eng.sync.fail_step(invalid(why))),
        }
    };
    // SAFETY: the contract promises that `e` is NULL or a live handle, which
    // is all with_engine requires.
    unsafe { with_engine(e, "gs_sync", step) }
}

/// gs_sync with the gradient arrays in `memory` (a gs_memory value).
/// `GS_MEMORY_HOST`: exactly gs_sync (`stream` unused). `GS_MEMORY_CUDA`:
/// each `grads[i]` is a CUDA device pointer to the layer's element count of
/// floats, replaced in place on the device; `stream` is the
/// `cudaStream_t`/`CUstream` the gradients were last written on (NULL: the
/// legacy default stream): gradsync's copies are ordered after the work
/// queued there so far, and the results are in device memory when the
/// call returns. The step runs the host engine on pinned staging copies
/// (residuals and momentum on the host). Collective.
///
/// A bad `memory` value, `GS_MEMORY_CUDA` in a library built without the
/// cargo feature `cuda`, no usable CUDA driver, a pointer that is not
/// device memory or a copy to the host that fails, on one rank, fail this
/// step on every rank with `GS_ERR_RANK_FAILED`, as gs_sync's bad
/// arguments do. A copy back to the device that fails after the step's
/// collectives ends the job (MPI_Abort) with a message naming the layer.
///
/// # Safety
/// As gs_sync, the arrays in `memory`; with `GS_MEMORY_CUDA`, `stream` is
/// NULL or a live stream of the pointers' context, and the arrays are not
/// written by other work during the call.
#[no_mangle]
pub unsafe extern "C" fn gs_sync_device(
    e: *mut gs_engine,
    grads: *const *mut f32,
    nlayers: usize,
    memory: crate::allreduce::abi::gs_memory,
    stream: *mut std::ffi::c_void,
) -> c_int {
    const WHAT: &str = "gs_sync_device";
    let step = |eng: &mut gs_engine| match memory.0 {
        x if x == crate::gs_memory::GS_MEMORY_HOST as c_int => {
            // SAFETY: with GS_MEMORY_HOST the contract is gs_sync's: `grads`
            // is NULL or points to `nlayers` pointers, each NULL or to the
            // layer's element count of writable host floats, as mut_slices
            // requires.
            match unsafe { mut_slices(eng, WHAT, grads, nlayers) } {
                Ok(mut g) => eng.sync.sync(&mut g).map(|_| ()),
                Err(why) => Err(eng.sync.fail_step(invalid(why))),
            }
        }
        x if x == crate::gs_memory::GS_MEMORY_CUDA as c_int => {
            // SAFETY: with GS_MEMORY_CUDA the contract promises device
            // arrays of the layers' element counts behind `grads`, not
            // written by other work during the call, and a NULL or live
            // `stream` of their context: sync_cuda's requirements.
            unsafe { sync_cuda(eng, grads, nlayers, stream) }
        }
        x => Err(eng
            .sync
            .fail_step(invalid(format!("{WHAT}: memory {x} is not a gs_memory")))),
    };
    // SAFETY: the contract (gs_sync's) promises that `e` is NULL or a live
    // handle, which is all with_engine requires.
    unsafe { with_engine(e, WHAT, step) }
}

/// gs_sync_device's `GS_MEMORY_CUDA` step.
///
/// # Safety
/// `grads` is NULL or points to `nlayers` pointers, each NULL or a CUDA
/// device pointer to the layer's element count of floats that no other work
/// writes during the call; `stream` is NULL or a live stream of their
/// context.
#[cfg(feature = "cuda")]
unsafe fn sync_cuda(
    eng: &mut gs_engine,
    grads: *const *mut f32,
    nlayers: usize,
    stream: *mut std::ffi::c_void,
) -> Result<(), Error> {
    use gradsync_engine::gpu::BorrowedCuda;
    // SAFETY: by this function's contract `grads` is NULL or points to
    // `nlayers` pointers (slices only reads those pointers, never the
    // device memory they point to).
    let bufs = unsafe {
        slices(
            eng,
            "gs_sync_device",
            grads,
            nlayers,
            |p| p.is_null(),
            |p| p.is_aligned(),
        )
    }
    .and_then(|s| {
        let spans: Vec<(usize, usize)> = s.iter().map(|&(p, n)| (p as usize, n)).collect();
        no_overlap(eng, "gs_sync_device", &spans).map(|()| s)
    })
    .map_err(invalid)
    .and_then(|s| {
        s.into_iter()
            .enumerate()
            .map(|(i, (p, n))| {
                // SAFETY: `p` is non-null and aligned when `n > 0` (slices
                // checked), and by this function's contract a device
                // pointer to `n` floats not written by other work during
                // the call (the borrows are dropped before it returns);
                // `stream` is NULL or a live stream of their context.
                unsafe { BorrowedCuda::new(p as u64, n, stream) }
                    .map_err(|e| invalid(format!("gs_sync_device: grads[{i}]: {e}")))
            })
            .collect::<Result<Vec<_>, Error>>()
    });
    match bufs {
        Ok(mut b) => eng.sync.sync_device(&mut b).map(|_| ()),
        Err(e) => Err(eng.sync.fail_step(e)),
    }
}

#[cfg(not(feature = "cuda"))]
unsafe fn sync_cuda(
    eng: &mut gs_engine,
    _grads: *const *mut f32,
    _nlayers: usize,
    _stream: *mut std::ffi::c_void,
) -> Result<(), Error> {
    Err(eng.sync.fail_step(invalid(
        "gs_sync_device: GS_MEMORY_CUDA, but this libgradsync was built without CUDA support (cargo feature cuda)",
    )))
}

/// [`slices`] of writable arrays, as slices.
///
/// # Safety
/// As [`slices`], and each `grads[i]` is NULL or points to the layer's
/// element count of writable floats that nothing else accesses for `'a`
/// (overlap between them is checked here).
unsafe fn mut_slices<'a>(
    eng: &gs_engine,
    what: &str,
    grads: *const *mut f32,
    nlayers: usize,
) -> Result<Vec<&'a mut [f32]>, String> {
    // SAFETY: this function's contract includes slices' (`grads` is NULL or
    // points to `nlayers` readable pointers).
    let s = unsafe {
        slices(
            eng,
            what,
            grads,
            nlayers,
            |p| p.is_null(),
            |p| p.is_aligned(),
        )
    }?;
    no_overlap(
        eng,
        what,
        &s.iter().map(|&(p, n)| (p as usize, n)).collect::<Vec<_>>(),
    )?;
    Ok(s.into_iter()
        .map(|(p, n)| {
            // SAFETY: slices checked that `p` is non-null and aligned when
            // `n > 0`, no_overlap that the arrays are disjoint, and this
            // function's contract that `p` points to `n` writable floats
            // nothing else accesses for `'a`: mut_slice's requirement.
            unsafe { mut_slice(p, n) }
        })
        .collect())
}

/// Arrays written in place must not overlap: one layer's result would
/// overwrite another's, differently on the rank that passed them (its
/// replicas drift apart with `GS_OK`). `spans`: (address, floats).
fn no_overlap(eng: &gs_engine, what: &str, spans: &[(usize, usize)]) -> Result<(), String> {
    let bytes: Vec<(usize, usize, bool)> = spans
        .iter()
        .map(|&(a, n)| (a, n.saturating_mul(4), true))
        .collect();
    let Some((a, b)) = gradsync_engine::sync::first_overlap(&bytes) else {
        return Ok(());
    };
    let name = |k: usize| {
        eng.sync
            .layer(LayerId(k))
            .map_or_else(String::new, |(nm, _, _)| format!(" (layer {nm:?})"))
    };
    Err(format!(
        "{what}: grads[{a}]{} and grads[{b}]{} overlap (each layer's result is written in \
         place)",
        name(a),
        name(b)
    ))
}

/// `n` floats at `p` as a slice (`p` unused when `n` is 0).
///
/// # Safety
/// With `n > 0`, `p` is non-null, aligned and points to `n` writable floats
/// that nothing else accesses for `'a`.
unsafe fn mut_slice<'a>(p: *mut f32, n: usize) -> &'a mut [f32] {
    if n == 0 {
        &mut []
    } else {
        // SAFETY: `n > 0` here, so by this function's contract `p` is
        // non-null, aligned and points to `n` writable floats (one
        // allocation, so `n * 4` ≤ isize::MAX) that nothing else accesses
        // for `'a`.
        unsafe { std::slice::from_raw_parts_mut(p, n) }
    }
}

/// `n` floats at `p` as a slice (`p` unused when `n` is 0).
///
/// # Safety
/// With `n > 0`, `p` is non-null, aligned and points to `n` floats that
/// nothing writes for `'a`.
unsafe fn ref_slice<'a>(p: *const f32, n: usize) -> &'a [f32] {
    if n == 0 {
        &[]
    } else {
        // SAFETY: `n > 0` here, so by this function's contract `p` is
        // non-null, aligned and points to `n` readable floats (one
        // allocation, so `n * 4` ≤ isize::MAX) that nothing writes for `'a`.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

/// Start a step: compress this step's gradients and start communicating
/// (on a progress thread under `MPI_THREAD_SERIALIZED` or higher), so the
/// caller can compute meanwhile; the arrays are not needed once it returns.
/// Finish with gs_wait. Between the two, do not call MPI on the engine's
/// communicator's processes unless MPI has `MPI_THREAD_MULTIPLE`.
/// Collective. Bad pointers or `nlayers` on one rank fail this step on
/// every rank: that rank's gs_start returns `GS_ERR_RANK_FAILED` (the step
/// is then over for it: do not call gs_wait), its peers' gs_wait returns
/// the same error.
///
/// # Safety
/// As gs_sync, with read-only arrays.
#[no_mangle]
pub unsafe extern "C" fn gs_start(
    e: *mut gs_engine,
    grads: *const *const f32,
    nlayers: usize,
) -> c_int {
    let start = |eng: &mut gs_engine| {
        // SAFETY: the contract (gs_sync's) promises that `grads` is NULL or
        // points to `nlayers` pointers, as slices requires.
        let s = unsafe {
            slices(
                eng,
                "gs_start",
                grads,
                nlayers,
                |p| p.is_null(),
                |p| p.is_aligned(),
            )
        };
        match s {
            Ok(s) => {
                let g: Vec<&[f32]> = s
                    .into_iter()
                    .map(|(p, n)| {
                        // SAFETY: slices checked that `p` is non-null and
                        // aligned when `n > 0`; the contract promises it
                        // points to the layer's `n` floats, unchanged during
                        // the call, which `g` (dropped on return) does not
                        // outlive.
                        unsafe { ref_slice(p, n) }
                    })
                    .collect();
                eng.sync.start(&g)
            }
            Err(why) => Err(eng.sync.fail_step(invalid(why))),
        }
    };
    // SAFETY: the contract (gs_sync's) promises that `e` is NULL or a live
    // handle, which is all with_engine requires.
    unsafe { with_engine(e, "gs_start", start) }
}

/// Finish the step started by gs_start: `grads[i]` receives layer `i`'s
/// update direction. Bad pointers or `nlayers` here are a local
/// `GS_ERR_INVALID`: the step's communication is already done, so no peer
/// waits; the engine finishes the step (its state stays in step with the
/// peers') but this rank's result of the step is discarded. A failure of
/// the step itself returns `GS_ERR_RANK_FAILED` on every rank.
///
/// # Safety
/// As gs_sync.
#[no_mangle]
pub unsafe extern "C" fn gs_wait(
    e: *mut gs_engine,
    grads: *const *mut f32,
    nlayers: usize,
) -> c_int {
    let wait = |eng: &mut gs_engine| {
        // SAFETY: the contract (gs_sync's) promises that `grads` is NULL or
        // points to `nlayers` pointers, each NULL or to the layer's element
        // count of writable floats: mut_slices' requirement.
        match unsafe { mut_slices(eng, "gs_wait", grads, nlayers) } {
            Ok(mut g) => eng.sync.wait(&mut g).map(|_| ()),
            Err(why) => {
                // Finish the step into scratch buffers, so this rank's engine
                // state stays in step with its peers'; only the result is
                // lost. An error of the step itself (or no step pending)
                // takes precedence.
                if !eng.sync.discard_pending()? {
                    return Err(invalid("wait without start"));
                }
                Err(invalid(format!(
                    "{why}; the step completed but this rank's result was discarded"
                )))
            }
        }
    };
    // SAFETY: the contract (gs_sync's) promises that `e` is NULL or a live
    // handle, which is all with_engine requires.
    unsafe { with_engine(e, "gs_wait", wait) }
}

/// JSON of the last completed step's statistics (step, whether it
/// communicated, bytes and timings, and per layer its strategy, codec,
/// density and bytes sent). The string belongs to the engine and stays
/// valid until the next call on it. NULL if `e` is NULL (see gs_last_error).
///
/// # Safety
/// `e` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn gs_last_stats_json(e: *mut gs_engine) -> *const c_char {
    guard_ptr(|| {
        if e.is_null() {
            return Err(invalid("gs_last_stats_json: the engine is NULL"));
        }
        // SAFETY: `e` is non-null (checked above), so by the contract it is
        // a live handle from gs_engine_create, used by one call at a time.
        let eng = unsafe { &mut *e };
        let json = serde_json::to_string(eng.sync.last_stats())?;
        eng.stats_json = CString::new(json.replace('\0', " ")).unwrap_or_default();
        Ok(eng.stats_json.as_ptr())
    })
}

/// A path argument (any bytes but NUL, as POSIX allows).
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and
/// unchanged for `'a`.
unsafe fn c_path<'a>(p: *const c_char) -> Option<&'a std::path::Path> {
    (!p.is_null()).then(|| {
        // SAFETY: `p` is non-null (checked by `then`'s condition), so by
        // this function's contract it points to a NUL-terminated string
        // valid and unchanged for `'a`.
        let c = unsafe { CStr::from_ptr(p) };
        std::path::Path::new(std::ffi::OsStr::from_bytes(c.to_bytes()))
    })
}

/// Write this rank's engine state (residuals, momentum, codec state, step)
/// to `path`, atomically (a temporary file renamed over it). Local: each
/// rank writes its own file, e.g. `ckpt/gradsync.rank3.snap`. Errors are
/// `GS_ERR_IO` (or `GS_ERR_INVALID` for a NULL path).
///
/// # Safety
/// `e` is NULL or a live handle; `path` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn gs_save_snapshot(e: *mut gs_engine, path: *const c_char) -> c_int {
    let save = |eng: &mut gs_engine| {
        // SAFETY: the contract promises that `path` is NULL or
        // NUL-terminated; it is only read during this call.
        let path = unsafe { c_path(path) };
        let path = path.ok_or_else(|| invalid("gs_save_snapshot: path is NULL"))?;
        eng.sync.save_snapshot(path)
    };
    // SAFETY: the contract promises that `e` is NULL or a live handle, which
    // is all with_engine requires.
    unsafe { with_engine(e, "gs_save_snapshot", save) }
}

/// Restore the state written by gs_save_snapshot (this rank's own file).
/// Collective: a missing, corrupt or mismatched file (or a NULL path) on
/// any rank fails every rank alike with `GS_ERR_RANK_FAILED` and changes no
/// engine.
///
/// # Safety
/// `e` is NULL or a live handle; `path` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn gs_load_snapshot(e: *mut gs_engine, path: *const c_char) -> c_int {
    let load = |eng: &mut gs_engine| {
        // SAFETY: the contract promises that `path` is NULL or
        // NUL-terminated; it is only read during this call.
        match unsafe { c_path(path) } {
            Some(path) => eng.sync.load_snapshot(path),
            // Still enter the restore's collective: a path no file system
            // has (a NUL byte) makes this rank's read fail, and so every
            // rank.
            None => eng
                .sync
                .load_snapshot("(gs_load_snapshot: path is NULL)\0")
                .and(Err(invalid("gs_load_snapshot: path is NULL"))),
        }
    };
    // SAFETY: the contract promises that `e` is NULL or a live handle, which
    // is all with_engine requires.
    unsafe { with_engine(e, "gs_load_snapshot", load) }
}
