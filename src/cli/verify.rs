//! `gradsync verify`: every collective checked against the MPI library's own on
//! real ranks. Integer-valued inputs must match `MPI_Allreduce` bit for bit;
//! random floats within a reduction-order bound; allgatherv byte for byte
//! against `MPI_Allgatherv` and the known pattern. `--mismatch` gives each rank
//! another length and expects `SizeMismatch` on every rank.

use super::bench::flag_error;
use super::{max_over_ranks, parse_list};
use crate::comm::agree::agree_inputs;
use crate::comm::{MpiComm, Transport};
use crate::dense::{
    allgatherv, allreduce, AllgathervAlgo, AllreduceAlgo, AllreduceOptions, Real, ReduceOp,
};
use crate::{Error, Result};

/// Arguments of `gradsync verify`.
#[derive(clap::Args, Debug, Clone)]
pub struct VerifyArgs {
    /// Element counts to test; `p` stands for the number of ranks (e.g. `0,1,p-1,p+1,1000`).
    #[arg(long, default_value = "0,1,p-1,p,p+1,1000,1048579")]
    pub counts: String,
    /// Ring chunk sizes (elements) to test; 0 = unpipelined. The ring raises a
    /// chunk so that a segment has at most 16 chunks.
    #[arg(long, default_value = "0,7")]
    pub chunks: String,
    /// Instead: give rank r a length of count + r and expect SizeMismatch on every rank.
    #[arg(long)]
    pub mismatch: bool,
    /// Print one JSON object per case.
    #[arg(long)]
    pub json: bool,
    /// Run every case over a transport that waits as the engine's progress
    /// thread does while its caller computes: test the requests and sleep
    /// this many microseconds between tests (`progress_poll_us`), with
    /// MPI's immediate calls in place of its blocking ones (the `mpi`
    /// allreduce then copies instead of passing `MPI_IN_PLACE`, as the
    /// engine's does). 0: MPI's blocking calls.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub poll_us: u32,
}

fn parse_count(s: &str, p: usize) -> Result<usize> {
    let bad = || Error::InvalidArgument(format!("bad count {s:?}"));
    if let Some(rest) = s.strip_prefix('p') {
        if rest.is_empty() {
            return Ok(p);
        }
        let (sign, num) = rest.split_at(1);
        let k: usize = num.parse().map_err(|_| bad())?;
        return match sign {
            "+" => p.checked_add(k).ok_or_else(bad),
            "-" => p.checked_sub(k).ok_or_else(|| {
                Error::InvalidArgument(format!("count {s:?} is negative with {p} ranks"))
            }),
            _ => Err(bad()),
        };
    }
    super::parse_size(s)
}

struct Report<'a> {
    comm: &'a MpiComm,
    json: bool,
    failures: usize,
}

impl Report<'_> {
    /// Record one case; the verdict is agreed on by all ranks.
    fn case(&mut self, what: &str, count: usize, local_ok: bool, detail: &str) -> Result<()> {
        let mut v = [f64::from(u8::from(!local_ok))];
        max_over_ranks(self.comm, &mut v);
        let ok = v[0] == 0.0;
        if !ok {
            self.failures += 1;
        }
        if self.comm.rank() == 0 {
            let verdict = if ok { "ok" } else { "failed" };
            if self.json {
                outln!(
                    "{}",
                    serde_json::json!({"case": what, "ranks": self.comm.size(), "count": count, "check": verdict, "detail": detail})
                );
            } else {
                outln!(
                    "{verdict:<7} p={} count={count:<8} {what} {detail}",
                    self.comm.size()
                );
            }
        }
        Ok(())
    }
}

/// The rank-local input phase: `--counts` and `--chunks` parsed.
fn inputs(a: &VerifyArgs, p: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    let counts = parse_list(&a.counts, |s| parse_count(s, p))
        .map_err(|e| flag_error(format!("--counts {:?}", a.counts), e))?;
    // Counts are of f64 elements at most: 8 bytes each.
    let max = super::bench::MAX_RUN_BYTES / 8;
    if let Some(c) = counts.iter().find(|&&c| c > max) {
        return Err(Error::InvalidArgument(format!(
            "--counts {:?}: {c} elements is past {max} (16G of f64)",
            a.counts
        )));
    }
    let chunks = parse_list(&a.chunks, |s| {
        s.parse::<usize>()
            .map_err(|_| Error::InvalidArgument(format!("bad chunk {s:?}")))
    })
    .map_err(|e| flag_error(format!("--chunks {:?}", a.chunks), e))?;
    if counts.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--counts {:?}: no counts given",
            a.counts
        )));
    }
    if chunks.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--chunks {:?}: no chunk sizes given",
            a.chunks
        )));
    }
    Ok((counts, chunks))
}

pub(super) fn run(comm: &MpiComm, a: &VerifyArgs) -> Result<i32> {
    // Agreed first: duplicating the communicator is collective.
    crate::comm::agree::same_on_every_rank(comm, &[("--poll-us", a.poll_us.to_string())])?;
    if a.poll_us == 0 {
        return run_on(comm, a);
    }
    let mut polite = MpiComm::duplicate_of(comm.communicator())?;
    polite.set_wait(Some(std::sync::Arc::new(crate::comm::PoliteWait::new(
        std::time::Duration::from_micros(a.poll_us.into()),
    ))));
    run_on(&polite, a)
}

fn run_on(comm: &MpiComm, a: &VerifyArgs) -> Result<i32> {
    let p = comm.size();
    let (counts, chunks) = agree_inputs(comm, inputs(a, p), |(counts, chunks)| {
        vec![
            ("subcommand", "verify".to_string()),
            ("--counts", format!("{counts:?}")),
            ("--chunks", format!("{chunks:?}")),
            ("--mismatch", a.mismatch.to_string()),
        ]
    })?;
    let mut rep = Report {
        comm,
        json: a.json,
        failures: 0,
    };
    if a.mismatch {
        mismatch(comm, &counts, &mut rep)?;
    } else {
        for &n in &counts {
            allreduce_cases::<f32>(comm, n, &chunks, &mut rep, "f32")?;
            allreduce_cases::<f64>(comm, n, &chunks, &mut rep, "f64")?;
            allgatherv_cases(comm, n, &mut rep)?;
        }
    }
    Ok(i32::from(rep.failures > 0))
}

fn algos() -> [AllreduceAlgo; 4] {
    [
        AllreduceAlgo::Rabenseifner,
        AllreduceAlgo::Ring,
        AllreduceAlgo::Mpi,
        AllreduceAlgo::Hierarchical,
    ]
}

/// Deterministic small generator (xorshift) so every rank knows its input.
fn rng_next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

trait FromF64: Real {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    const EPS: f64;
}
impl FromF64 for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    const EPS: f64 = f32::EPSILON as f64;
}
impl FromF64 for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    const EPS: f64 = f64::EPSILON;
}

fn allreduce_cases<T: FromF64>(
    comm: &MpiComm,
    n: usize,
    chunks: &[usize],
    rep: &mut Report,
    ty: &str,
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ ((rank as u64 + 1) << 32) ^ n as u64;
    let ints: Vec<T> = (0..n)
        .map(|_| T::from_f64((rng_next(&mut seed) % 2001) as f64 - 1000.0))
        .collect();
    let floats: Vec<T> = (0..n)
        .map(|_| T::from_f64((rng_next(&mut seed) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0))
        .collect();
    for (kind, input) in [("int", &ints), ("float", &floats)] {
        let mut reference = vec![T::zeroed(); n];
        comm.native_allreduce_sum(input, &mut reference)
            .expect("MPI transport")?;
        let abs_in: Vec<T> = input
            .iter()
            .map(|x| T::from_f64(x.to_f64().abs()))
            .collect();
        let mut abs_sum = vec![T::zeroed(); n];
        comm.native_allreduce_sum(&abs_in, &mut abs_sum)
            .expect("MPI transport")?;
        for algo in algos() {
            let chunk_list: &[usize] = if algo == AllreduceAlgo::Ring {
                chunks
            } else {
                &[0]
            };
            for &chunk in chunk_list {
                for op in [ReduceOp::Sum, ReduceOp::Average] {
                    let opts = AllreduceOptions {
                        op,
                        chunk_elems: chunk,
                        ..Default::default()
                    };
                    let mut buf = input.clone();
                    let res = allreduce(comm, &mut buf, algo, &opts);
                    // MPI_Allreduce's sum, divided by p for the average.
                    let divisor = if op == ReduceOp::Average {
                        T::of_count(p)
                    } else {
                        T::from_f64(1.0)
                    };
                    let (ok, detail) = match res {
                        Err(e) => (false, format!("error: {e}")),
                        Ok(()) => compare(&buf, &reference, &abs_sum, divisor, kind == "int", p),
                    };
                    let what = format!(
                        "allreduce {ty} {kind} {} {:?} chunk={chunk}",
                        algo.name(),
                        op
                    );
                    rep.case(&what, n, ok, &detail)?;
                }
            }
        }
    }
    Ok(())
}

/// Exact for integer-valued inputs (every summation order is exact);
/// otherwise `|got − want| ≤ (p + 2)·ε·Σ|x|`, the bound of any summation order.
fn compare<T: FromF64>(
    got: &[T],
    sum: &[T],
    abs_sum: &[T],
    divisor: T,
    exact: bool,
    p: usize,
) -> (bool, String) {
    for i in 0..got.len() {
        let mut want = sum[i];
        want /= divisor;
        let (g, w) = (got[i].to_f64(), want.to_f64());
        let ok = if exact {
            got[i] == want
        } else {
            let tol = (p as f64 + 2.0) * T::EPS * abs_sum[i].to_f64() / divisor.to_f64().abs()
                + f64::MIN_POSITIVE;
            (g - w).abs() <= tol
        };
        if !ok {
            return (
                false,
                format!("element {i}: got {g}, MPI_Allreduce gives {w}"),
            );
        }
    }
    (true, String::new())
}

fn allgatherv_cases(comm: &MpiComm, n: usize, rep: &mut Report) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    // Rank r sends (n + 3r) % (n + 1) bytes: varied lengths, some ranks empty.
    let len_of = |r: usize| (n + 3 * r) % (n + 1);
    let byte = |r: usize, i: usize| (r * 31 + i * 7) as u8;
    let mine: Vec<u8> = (0..len_of(rank)).map(|i| byte(rank, i)).collect();
    let expected: Vec<u8> = (0..p)
        .flat_map(|r| (0..len_of(r)).map(move |i| byte(r, i)))
        .collect();
    for algo in [
        AllgathervAlgo::RecursiveDoubling,
        AllgathervAlgo::Mpi,
        AllgathervAlgo::Node,
    ] {
        let (ok, detail) = match allgatherv(comm, &mine, algo) {
            Err(e) => (false, format!("error: {e}")),
            Ok(g) => {
                let lens_ok = (0..p).all(|r| g.message(r).len() == len_of(r));
                if g.data == expected && lens_ok {
                    (true, String::new())
                } else {
                    (
                        false,
                        "gathered bytes differ from the expected messages".into(),
                    )
                }
            }
        };
        rep.case(&format!("allgatherv {}", algo.name()), n, ok, &detail)?;
    }
    Ok(())
}

fn mismatch(comm: &MpiComm, counts: &[usize], rep: &mut Report) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    if p == 1 {
        rep.case("mismatch (needs p > 1)", 0, true, "skipped")?;
        return Ok(());
    }
    // Receives are exact: every rank sends 3 elements to the next and
    // expects 4 from the previous, and gets the size error naming them.
    let mut got = [0f32; 4];
    let prev = (rank + p - 1) % p;
    let res = comm.sendrecv(&[1f32; 3], (rank + 1) % p, &mut got, prev, 1);
    let (ok, detail) = match res {
        Err(Error::MessageSize {
            peer,
            expected,
            got,
            ..
        }) => (
            peer == prev && expected == 4 && got == 3,
            format!("MessageSize from rank {peer}: expected {expected}, got {got}"),
        ),
        Err(e) => (false, format!("wrong error: {e}")),
        Ok(()) => (false, "no error".into()),
    };
    rep.case("mismatch sendrecv length", 3, ok, &detail)?;
    for &n in counts {
        for algo in algos() {
            let mut buf = vec![1.0f32; n + rank];
            let res = allreduce(comm, &mut buf, algo, &AllreduceOptions::default());
            let (ok, detail) = match res {
                Err(Error::SizeMismatch {
                    local,
                    min,
                    max,
                    min_rank,
                    max_rank,
                }) => (
                    local == (n + rank) as u64
                        && min == n as u64
                        && max == (n + p - 1) as u64
                        && min_rank == 0
                        && max_rank == p - 1,
                    format!(
                        "SizeMismatch local={local} min={min} (rank {min_rank}) max={max} (rank {max_rank})"
                    ),
                ),
                Err(e) => (false, format!("wrong error: {e}")),
                Ok(()) => (false, "no error".into()),
            };
            rep.case(
                &format!("mismatch allreduce {}", algo.name()),
                n,
                ok,
                &detail,
            )?;
            // The communicator must still work after a detected mismatch.
            let mut v = vec![1.0f32; 3];
            let after = allreduce(comm, &mut v, algo, &AllreduceOptions::default());
            let ok = after.is_ok() && v == vec![p as f32; 3];
            rep.case(
                &format!("after mismatch allreduce {}", algo.name()),
                3,
                ok,
                "",
            )?;
        }
    }
    Ok(())
}
