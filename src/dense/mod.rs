//! Dense collectives over any [`Transport`]: Rabenseifner and ring allreduce,
//! recursive-doubling allgatherv.
//!
//! * [`rabenseifner_allreduce`]: recursive-halving reduce-scatter followed by
//!   recursive-doubling allgather (Thakur, Rabenseifner & Gropp 2005, §4.4);
//!   non-powers of two fold the first `2r` ranks pairwise first, as Open MPI's
//!   `redscat_allgather` does. Cost
//!   `(2⌊lg p⌋+2)α + (2(p−1)/p + 2)nβ + n(1+(p−1)/p)γ` for `p ≠ 2^k`.
//! * [`ring_allreduce`]: bandwidth-optimal ring reduce-scatter + allgather,
//!   `2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ`, optionally pipelined in chunks so the
//!   reduction of one chunk overlaps the transfer of the next.
//! * [`allgatherv`]: variable-length byte messages gathered on every rank
//!   (the sparse layer's building block), by recursive doubling (a power of
//!   two ranks), Bruck's algorithm (any other number) or through
//!   `MPI_Allgatherv`.
//!
//! Every allreduce validates by default that all ranks passed the same length
//! (one 16-byte collective); on a mismatch every rank returns
//! [`Error::SizeMismatch`] instead of hanging.
//!
//! Hot paths are allocation-free given a [`Workspace`]: the `_with` variants take
//! one and reuse its buffer across calls.

pub(crate) mod allgatherv;
pub mod hierarchical;
mod rabenseifner;
mod ring;

pub use allgatherv::{allgatherv, allgatherv_with, AllgathervAlgo, Gathered};
pub use hierarchical::{hierarchical_allreduce, hierarchical_allreduce_with};
pub use rabenseifner::{rabenseifner_allreduce, rabenseifner_allreduce_with};
pub use ring::{effective_chunk, ring_allreduce, ring_allreduce_with, MAX_CHUNKS_PER_SEGMENT};

pub(crate) use crate::comm::small::{small_allreduce_max, split_ref_mut, Fold};
use crate::comm::{Elem, Tag, Transport};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

pub(crate) const TAG_VALIDATE: Tag = crate::comm::tags::VALIDATE;
pub(crate) const TAG_RABENSEIFNER: Tag = crate::comm::tags::RABENSEIFNER;
pub(crate) const TAG_RING: Tag = crate::comm::tags::RING;

/// A floating-point element that collectives can reduce.
pub trait Real:
    Elem
    + Copy
    + PartialEq
    + std::fmt::Debug
    + std::ops::AddAssign
    + std::ops::MulAssign
    + std::ops::DivAssign
{
    /// The count `n` in this type (exact up to 2^24 ranks in f32).
    fn of_count(n: usize) -> Self;
}
impl Real for f32 {
    fn of_count(n: usize) -> Self {
        n as f32
    }
}
impl Real for f64 {
    fn of_count(n: usize) -> Self {
        n as f64
    }
}

/// Reduction applied by an allreduce.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Element-wise sum.
    #[default]
    Sum,
    /// Element-wise sum divided by the number of ranks.
    Average,
}

/// Options shared by the allreduce algorithms.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllreduceOptions {
    /// Sum or average.
    pub op: ReduceOp,
    /// Check (one 16-byte collective) that every rank passed the same length.
    pub validate: bool,
    /// Ring only: pipeline each ring segment in chunks of this many elements
    /// (0 = one message per segment). Raised so that a segment has at most
    /// [`MAX_CHUNKS_PER_SEGMENT`] chunks (see [`effective_chunk`]).
    pub chunk_elems: usize,
}

impl Default for AllreduceOptions {
    fn default() -> Self {
        AllreduceOptions {
            op: ReduceOp::Sum,
            validate: true,
            chunk_elems: 0,
        }
    }
}

/// Which allreduce algorithm to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllreduceAlgo {
    /// [`rabenseifner_allreduce`].
    #[default]
    Rabenseifner,
    /// [`ring_allreduce`].
    Ring,
    /// The MPI library's own `MPI_Allreduce` (only on [`MpiComm`](crate::comm::MpiComm)).
    Mpi,
    /// [`hierarchical_allreduce`] over the transport's node map
    /// ([`Transport::node_ids`]; only on [`MpiComm`](crate::comm::MpiComm)).
    Hierarchical,
}

impl std::str::FromStr for AllreduceAlgo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "rabenseifner" => Ok(Self::Rabenseifner),
            "ring" => Ok(Self::Ring),
            "mpi" => Ok(Self::Mpi),
            "hierarchical" => Ok(Self::Hierarchical),
            _ => Err(Error::InvalidArgument(format!(
                "unknown allreduce algorithm {s:?} (rabenseifner, ring, mpi, hierarchical)"
            ))),
        }
    }
}

impl AllreduceAlgo {
    /// Every algorithm.
    pub const ALL: [AllreduceAlgo; 4] = [
        AllreduceAlgo::Rabenseifner,
        AllreduceAlgo::Ring,
        AllreduceAlgo::Mpi,
        AllreduceAlgo::Hierarchical,
    ];

    /// Name as used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rabenseifner => "rabenseifner",
            Self::Ring => "ring",
            Self::Mpi => "mpi",
            Self::Hierarchical => "hierarchical",
        }
    }
}

impl std::fmt::Display for AllreduceAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reusable scratch memory for the allreduce algorithms. It only grows, so a
/// training loop that keeps one per element type allocates once.
#[derive(Debug, Default)]
pub struct Workspace<T> {
    tmp: Vec<T>,
}

impl<T: Real> Workspace<T> {
    /// An empty workspace.
    pub fn new() -> Self {
        Workspace { tmp: Vec::new() }
    }
    /// Scratch of at least `n` elements (contents unspecified).
    pub(crate) fn scratch(&mut self, n: usize) -> &mut [T] {
        if self.tmp.len() < n {
            self.tmp.resize(n, T::zeroed());
        }
        &mut self.tmp[..n]
    }
}

/// In-place allreduce of `buf` with the chosen algorithm.
pub fn allreduce<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    algo: AllreduceAlgo,
    opts: &AllreduceOptions,
) -> Result<()> {
    allreduce_with(comm, buf, algo, opts, &mut Workspace::new())
}

/// [`allreduce`] with caller-provided scratch.
pub fn allreduce_with<C: Transport, T: Real>(
    comm: &C,
    buf: &mut [T],
    algo: AllreduceAlgo,
    opts: &AllreduceOptions,
    ws: &mut Workspace<T>,
) -> Result<()> {
    match algo {
        AllreduceAlgo::Rabenseifner => rabenseifner_allreduce_with(comm, buf, opts, ws),
        AllreduceAlgo::Ring => ring_allreduce_with(comm, buf, opts, ws),
        AllreduceAlgo::Hierarchical => {
            let nodes = comm.node_ids().ok_or_else(|| {
                Error::Unsupported(
                    "the hierarchical allreduce needs the ranks' nodes (an MPI communicator)"
                        .into(),
                )
            })?;
            hierarchical_allreduce_with(comm, buf, &nodes, opts, ws)
        }
        AllreduceAlgo::Mpi => {
            if opts.validate {
                validate_same_len(comm, buf.len())?;
            }
            // In place where the transport can (no copy of the input: a
            // whole pass over the buffer), else through a scratch copy.
            match comm.native_allreduce_sum_in_place(buf) {
                Some(r) => r?,
                None => {
                    let tmp = ws.scratch(buf.len());
                    tmp.copy_from_slice(buf);
                    comm.native_allreduce_sum(tmp, buf).ok_or_else(|| {
                        Error::Unsupported("this transport has no MPI-native allreduce".into())
                    })??;
                }
            }
            if opts.op == ReduceOp::Average {
                average(buf, comm.size());
            }
            Ok(())
        }
    }
}

/// `dst[i] += src[i]`: the reduction kernel (auto-vectorized).
#[inline]
pub(crate) fn add_into<T: Real>(dst: &mut [T], src: &[T]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// `dst[i] = (dst[i] + src[i]) / p`: [`add_into`] then [`average`] in one
/// pass over the memory, bit for bit the same (each element is rounded
/// after the sum and after the division, as the two passes round it).
#[inline]
pub(crate) fn add_average_into<T: Real>(dst: &mut [T], src: &[T], p: usize) {
    debug_assert_eq!(dst.len(), src.len());
    if let Some(r) = exact_reciprocal::<T>(p) {
        for (x, s) in dst.iter_mut().zip(src) {
            let mut v = *x;
            v += *s;
            v *= r;
            *x = v;
        }
        return;
    }
    let d = T::of_count(p);
    for (x, s) in dst.iter_mut().zip(src) {
        let mut v = *x;
        v += *s;
        v /= d;
        *x = v;
    }
}

/// `1/p` where it is exact (`p` a power of two): then `x · (1/p)` is the
/// correctly rounded `x / p`, bit for bit, and a multiply is several
/// times cheaper than a divide (a 264 MB average at p = 2 spent 4–8 ms
/// more than the sum dividing).
#[inline]
fn exact_reciprocal<T: Real>(p: usize) -> Option<T> {
    p.is_power_of_two().then(|| {
        let mut r = T::of_count(1);
        r /= T::of_count(p);
        r
    })
}

/// `dst[i] -= src[i]`.
#[inline]
pub(crate) fn sub_from(dst: &mut [f32], src: &[f32]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d -= *s;
    }
}

/// The average of `p` ranks' sum, one element at a time, bitwise as
/// [`average`] takes it: a multiply by the exact `1/p` where `p` is a power
/// of two, else a division. For a pass that reads the sum anyway (the
/// engine's dense layers unpacked after the `mpi` allreduce's sum), so
/// that the average costs no pass of its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Averaging {
    /// `x · (1/p)`, `1/p` exact.
    Mul(f32),
    /// `x / p`.
    Div(f32),
}

impl Averaging {
    /// The averaging of `p` ranks' sum.
    pub(crate) fn of(p: usize) -> Self {
        match exact_reciprocal::<f32>(p) {
            Some(r) => Averaging::Mul(r),
            None => Averaging::Div(f32::of_count(p)),
        }
    }

    /// The average of the sum `x`.
    #[inline]
    pub(crate) fn apply(self, x: f32) -> f32 {
        match self {
            Averaging::Mul(r) => x * r,
            Averaging::Div(d) => x / d,
        }
    }
}

/// `buf[i] /= p`: the average of `p` ranks, correctly rounded (a sum of
/// integers that `p` divides averages to that integer exactly, as
/// `MPI_Allreduce` then `/ p` gives; `· (1/p)` was off by an ulp at p = 3).
/// Where `p` is a power of two it multiplies by the exact `1/p`, which is
/// the same division bit for bit.
#[inline]
pub(crate) fn average<T: Real>(buf: &mut [T], p: usize) {
    if let Some(r) = exact_reciprocal::<T>(p) {
        for x in buf {
            *x *= r;
        }
        return;
    }
    let d = T::of_count(p);
    for x in buf {
        *x /= d;
    }
}

/// Check that every rank passed `len`. All ranks learn the global min and max
/// (recursive doubling on two `u64`), so on a mismatch every rank returns
/// [`Error::SizeMismatch`].
pub fn validate_same_len<C: Transport>(comm: &C, len: usize) -> Result<()> {
    let mut v = [len as u64, !(len as u64)];
    small_allreduce_max(comm, &mut v, TAG_VALIDATE)?;
    let (max, min) = (v[0], !v[1]);
    if min != max {
        return Err(crate::comm::agree::size_mismatch(
            comm,
            TAG_VALIDATE,
            len as u64,
            min,
            max,
        )?);
    }
    Ok(())
}

/// A user's buffer of either float type, for callers that get their
/// buffers from C or Python ([`allreduce_agreed`]).
pub enum AnyBuf<'a> {
    /// `float32` / `float`.
    F32(&'a mut [f32]),
    /// `float64` / `double`.
    F64(&'a mut [f64]),
}

impl AnyBuf<'_> {
    fn len(&self) -> usize {
        match self {
            AnyBuf::F32(b) => b.len(),
            AnyBuf::F64(b) => b.len(),
        }
    }
    fn dtype(&self) -> (u64, &'static str) {
        match self {
            AnyBuf::F32(_) => (1, "float32"),
            AnyBuf::F64(_) => (2, "float64"),
        }
    }
}

/// In-place allreduce for the bindings (`gs_allreduce`,
/// `gradsync.allreduce`), where a rank may fail before it has a buffer
/// (wrong dtype, read-only or non-contiguous array, an unknown algorithm):
/// `call` is that rank's buffer, algorithm and operation, or its error.
/// One 72-byte collective agrees first on failures, lengths, dtypes,
/// algorithms and operations, so a local error or any of those differing
/// on one rank fails every rank alike (never a hang, never mixed types or
/// algorithms on the wire, never half-summed, half-averaged results); then
/// the algorithm runs without its own length check.
pub fn allreduce_agreed<C: Transport>(
    comm: &C,
    call: Result<(AnyBuf<'_>, AllreduceAlgo, ReduceOp)>,
) -> Result<()> {
    allreduce_agreed_with(comm, call, &mut AnyWorkspace::default())
}

/// Scratch of [`allreduce_agreed_with`] for either float type, kept by a
/// binding across calls: an allreduce of `n` elements needs `n/2 + 1`
/// (Rabenseifner), `n/p` (ring) or `n` (`mpi`, a copy of the input), and a
/// fresh one each call cost the first touch of every page (a 98 MB
/// `gradsync.allreduce` at p = 2 took 33–36 ms, as long as `MPI_Allreduce`;
/// with the kept one 10–17 ms).
#[derive(Debug, Default)]
pub struct AnyWorkspace {
    /// For `float32` buffers.
    pub f32: Workspace<f32>,
    /// For `float64` buffers.
    pub f64: Workspace<f64>,
}

/// [`allreduce_agreed`] with caller-kept scratch `ws` (grown to the
/// largest buffer, never shrunk).
pub fn allreduce_agreed_with<C: Transport>(
    comm: &C,
    call: Result<(AnyBuf<'_>, AllreduceAlgo, ReduceOp)>,
    ws: &mut AnyWorkspace,
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    let code = |a: AllreduceAlgo, o: ReduceOp| -> (u64, u64) {
        let a = match a {
            AllreduceAlgo::Rabenseifner => 1,
            AllreduceAlgo::Ring => 2,
            AllreduceAlgo::Mpi => 3,
            AllreduceAlgo::Hierarchical => 4,
        };
        (a, if o == ReduceOp::Sum { 1 } else { 2 })
    };
    let mut v = match &call {
        Ok((b, algo, op)) => {
            let (n, d) = (b.len() as u64, b.dtype().0);
            let (a, o) = code(*algo, *op);
            [0, n, !n, d, !d, a, !a, o, !o]
        }
        Err(_) => [(p - rank) as u64, 0, 0, 0, 0, 0, 0, 0, 0],
    };
    small_allreduce_max(comm, &mut v, TAG_VALIDATE)?;
    if v[0] != 0 {
        crate::comm::agree::agree(comm, call.map(|_| ()))?;
        return Err(Error::Transport(
            "a rank flagged a failure that the agreement did not see".into(),
        ));
    }
    let (buf, algo, op) = call?;
    let (n, (d, dname)) = (buf.len() as u64, buf.dtype());
    let (a, o) = code(algo, op);
    let (max, min) = (v[1], !v[2]);
    if min != max {
        return Err(crate::comm::agree::size_mismatch(
            comm,
            TAG_VALIDATE,
            n,
            min,
            max,
        )?);
    }
    // Every rank sees the same differing word, so every rank names the
    // odd rank in the same extra collective.
    let differs = |what: &str, here: String, code: u64| -> Result<()> {
        let odd = crate::comm::agree::first_rank_differing(comm, TAG_VALIDATE, code)?;
        Err(Error::ArgumentMismatch(format!(
            "the {what} differs across ranks (this rank passed {here}; rank {odd} passed other than rank 0): pass the same on every rank"
        )))
    };
    if v[3] != d || !v[4] != d {
        return differs("buffer dtype", dname.to_string(), d);
    }
    if v[5] != a || !v[6] != a {
        return differs("allreduce algorithm", algo.name().to_string(), a);
    }
    if v[7] != o || !v[8] != o {
        return differs("reduce operation", format!("{op:?}").to_lowercase(), o);
    }
    let opts = AllreduceOptions {
        op,
        validate: false,
        chunk_elems: 0,
    };
    match buf {
        AnyBuf::F32(b) => allreduce_with(comm, b, algo, &opts, &mut ws.f32),
        AnyBuf::F64(b) => allreduce_with(comm, b, algo, &opts, &mut ws.f64),
    }
}

#[cfg(test)]
mod tests;
