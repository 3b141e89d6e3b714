//! The failure model: how an error on some ranks reaches every rank.
//!
//! gradsync sits inside thousands of training steps on every rank of a job.
//! A rank that returns early while its peers are inside (or about to enter)
//! a collective leaves them waiting forever, and the whole allocation is
//! lost. So every piece of collective code follows one rule:
//!
//! > **An error that can arise on a subset of ranks inside a step either
//! > reaches every rank as an `Err` in the same step, naming the rank and the
//! > cause, or — where agreement is impossible because a peer may already be
//! > blocked in a collective — ends the job with `MPI_Abort` and a clear
//! > message.** No rank returns, finalizes or raises alone while its peers
//! > wait.
//!
//! How the pieces follow it:
//!
//! * **A rank-local failure before a collective still enters it**, carrying
//!   a failure flag: [`agree`] for set-up phases (one 8-byte max-allreduce,
//!   plus a gather of the error texts only when something failed); inside a
//!   training step ([`crate::sync`]) the flag and the error text ride in the
//!   step's own fused sparse message and a status word of the fused dense
//!   buffer, so the common path adds no round trip. Every rank checks the
//!   status before anything is applied, and every rank then returns
//!   [`Error::RankFailed`] naming the lowest failing rank and its message.
//! * **Data that every rank sees alike fails alike**: the gathered fused
//!   messages (a corrupt unit is [`Error::PeerMessage`] on every rank), the
//!   allreduced dense buffer (NaN/Inf is [`Error::NonFinite`] on every
//!   rank), the layer table (one hash per registration and one over the
//!   whole table before the first step: [`Error::TableMismatch`]).
//! * **Transport errors inside a collective** (an MPI error code, a message
//!   of the wrong length from one peer) cannot be agreed on: the peers of the
//!   failing rank may be blocked in the same collective. The engine calls
//!   [`Transport::abort`] (`MPI_Abort`) with the error.
//! * **The CLI** (`gradsync` under `mpirun`): an error that
//!   [`Error::is_collective`] says every rank returned ends every rank with
//!   the same message and exit status 1 after `MPI_Finalize`; any other error
//!   on any rank, and any panic, calls `MPI_Abort`, so the job ends within
//!   seconds with a non-zero status instead of finalizing next to a peer
//!   that spins in a collective.
//!
//! ```
//! use gradsync::comm::LocalComm;
//! use gradsync::comm::agree::agree;
//! use gradsync::Error;
//! let out = LocalComm::run(3, |c| {
//!     let local: gradsync::Result<u32> = if gradsync::comm::Transport::rank(&c) == 1 {
//!         Err(Error::InvalidArgument("bad profile p.json".into()))
//!     } else {
//!         Ok(7)
//!     };
//!     agree(&c, local).map_err(|e| e.to_string())
//! });
//! // Every rank gets the same error, naming rank 1 and its cause.
//! assert!(out.iter().all(|r| r.as_ref().unwrap_err() == out[0].as_ref().unwrap_err()));
//! assert!(out[0].as_ref().unwrap_err().contains("rank 1"));
//! ```

use super::small::{allgather_bytes, small_allreduce_max};
use super::{Tag, Transport};
use crate::{Error, Result};

const TAG_AGREE: Tag = crate::comm::tags::AGREE;

/// FNV-1a's offset basis: the start of a [`fnv`] hash.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a of `bytes`, continuing from `h`: the fingerprints of what must
/// be the same on every rank (layer tables, collectives' options, node
/// maps), compared in one small collective.
pub(crate) fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Agree on the outcome of a rank-local phase (collective: every rank must
/// call it once at the same point). With `Ok` on every rank, returns each
/// rank's value after one 8-byte allreduce. If any rank passed `Err`, every
/// rank returns the same [`Error::RankFailed`] naming the lowest failing
/// rank, its error text and how many other ranks failed (one more
/// allgatherv, on the error path only).
pub fn agree<C: Transport, T>(comm: &C, local: Result<T>) -> Result<T> {
    let (rank, p) = (comm.rank(), comm.size());
    // Max of `p − rank` over failing ranks names the lowest one.
    let mut v = [if local.is_err() { (p - rank) as u64 } else { 0 }];
    small_allreduce_max(comm, &mut v, TAG_AGREE)?;
    if v[0] == 0 {
        return local;
    }
    let text = match &local {
        Ok(_) => String::new(),
        Err(e) => {
            let t = e.to_string();
            if t.is_empty() {
                "(no message)".to_string()
            } else {
                t
            }
        }
    };
    let g = allgather_bytes(comm, text.as_bytes())?;
    let msgs: Vec<String> = (0..g.len())
        .map(|r| String::from_utf8_lossy(g.message(r)).into_owned())
        .collect();
    Err(
        rank_failed(&msgs, None).unwrap_or_else(|| Error::RankFailed {
            rank: p - v[0] as usize,
            others: 0,
            failed: vec![p - v[0] as usize],
            step: None,
            message: "(message lost)".into(),
        }),
    )
}

/// The argument check a collective makes before it communicates, in ONE
/// small max-allreduce: a rank-local argument error on any rank
/// ([`agree`]'s [`Error::RankFailed`] on every rank), a length `n` that
/// differs ([`Error::SizeMismatch`]) and up to two fingerprints of
/// arguments that must agree (node maps, options: the first that differs
/// is [`Error::ArgumentMismatch`] with its message). Every rank returns the
/// same outcome, so none is left waiting in the collective.
pub(crate) fn agree_args<C: Transport>(
    comm: &C,
    tag: Tag,
    local: Result<()>,
    n: usize,
    prints: &[(u64, &dyn Fn() -> String)],
) -> Result<()> {
    let (rank, p) = (comm.rank(), comm.size());
    assert!(prints.len() <= 2, "agree_args: at most two fingerprints");
    let mut v = [0u64; 7];
    v[0] = if local.is_err() { (p - rank) as u64 } else { 0 };
    v[1] = n as u64;
    v[2] = !(n as u64);
    for (i, (h, _)) in prints.iter().enumerate() {
        v[3 + 2 * i] = *h;
        v[4 + 2 * i] = !*h;
    }
    // Unused slots hold 0 and !0 on every rank, so they always agree.
    for i in prints.len()..2 {
        v[4 + 2 * i] = !0;
    }
    small_allreduce_max(comm, &mut v, tag)?;
    if v[0] != 0 {
        agree(comm, local)?;
        return Err(Error::Transport(
            "a rank flagged a failure that the agreement did not see".into(),
        ));
    }
    let (max, min) = (v[1], !v[2]);
    if min != max {
        return Err(size_mismatch(comm, tag, n as u64, min, max)?);
    }
    for (i, (h, msg)) in prints.iter().enumerate() {
        if v[3 + 2 * i] != *h || !v[4 + 2 * i] != *h {
            let odd = first_rank_differing(comm, tag, *h)?;
            return Err(Error::ArgumentMismatch(format!(
                "{} (rank {odd} passed other values than rank 0)",
                msg()
            )));
        }
    }
    Ok(())
}

/// [`Error::SizeMismatch`] naming the lowest rank that passed `min` and the
/// lowest that passed `max` (collective, on a mismatch only: every rank
/// has seen the same `min != max`, so every rank calls it; one more small
/// max-allreduce on `tag`).
pub(crate) fn size_mismatch<C: Transport>(
    comm: &C,
    tag: Tag,
    local: u64,
    min: u64,
    max: u64,
) -> Result<Error> {
    let (rank, p) = (comm.rank(), comm.size());
    let flag = |hit: bool| if hit { (p - rank) as u64 } else { 0 };
    let mut v = [flag(local == min), flag(local == max)];
    small_allreduce_max(comm, &mut v, tag)?;
    Ok(Error::SizeMismatch {
        local,
        min,
        max,
        min_rank: p - v[0] as usize,
        max_rank: p - v[1] as usize,
    })
}

/// Which engine call a rank is in, carried by the first agreement of every
/// collective entry of the engine ([`agree_call`]): ranks that make
/// different calls (one restores a snapshot while another steps, one
/// registers a layer after the first step while another steps) meet
/// in that agreement and both fail, naming the calls and the ranks,
/// instead of waiting in two different collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum CallKind {
    /// The layer table's agreements: each `register` before the first
    /// step, and the check of the whole table (the first step,
    /// `complete_table`, a restore); one kind, so that ranks whose tables
    /// differ meet in them and get the table's own error
    /// ([`Error::TableMismatch`]).
    Table = 1,
    /// A `register` after the table was fixed (by the first step,
    /// `complete_table` or a restore).
    Register = 2,
    /// A step: `sync`, `start`, `submit_bucket`, `finish_step`, ...
    Step = 3,
    /// `load_snapshot`, `restore_bytes`.
    Restore = 4,
    /// The engine's creation (its options agreement).
    Create = 5,
    /// Closing the engine ([`crate::sync::GradSync::prepare_close`]).
    Close = 6,
}

impl CallKind {
    /// What a rank in this call is doing (`step`: the engine's step
    /// counter), for [`Error::CallMismatch`].
    pub(crate) fn describe(self, step: u64) -> String {
        match self {
            CallKind::Table => "the layer table (register, complete_table or the first step)".into(),
            CallKind::Register => "register after the table was fixed (by the first step, complete_table or a restore)".into(),
            CallKind::Step => format!("step {step} (sync, start, submit_bucket or finish_step)"),
            CallKind::Restore => "a restore (load_snapshot or restore_bytes)".into(),
            CallKind::Create => "the engine's creation".into(),
            CallKind::Close => "close".into(),
        }
    }
}

/// The engine's entry agreement (one 56-byte max-allreduce on
/// [`tags::AGREE`](super::tags::AGREE), the same shape for every call, so
/// that any two entries meet): the call (`kind`, and `describe()` for the
/// error), this rank's failure (`local`) and a fingerprint `h` of the
/// call's arguments. In this order, alike on every rank:
///
/// 1. ranks in different calls: every rank returns the same
///    [`Error::CallMismatch`] naming rank 0's call and the lowest rank
///    whose call differs (their descriptions gathered, on this path only);
/// 2. a rank failed: every rank returns its [`Error::RankFailed`] ([`agree`]);
/// 3. otherwise whether every rank passed the same `h`: on `false` every
///    rank is still in step, and the caller's mismatch handling (a
///    collective on this error path) follows.
pub(crate) fn agree_call<C: Transport>(
    comm: &C,
    kind: CallKind,
    describe: &dyn Fn() -> String,
    local: Result<()>,
    h: u64,
) -> Result<bool> {
    let (rank, p) = (comm.rank(), comm.size());
    let k = kind as u64;
    let mut v = [
        if local.is_err() { (p - rank) as u64 } else { 0 },
        k,
        !k,
        h,
        !h,
        0,
        !0,
    ];
    small_allreduce_max(comm, &mut v, TAG_AGREE)?;
    if v[1] != k || !v[2] != k {
        let mine = describe();
        let (first, odd) = first_difference(comm, k, &mine)?;
        let (odd, theirs) = odd.unwrap_or((rank, mine));
        return Err(Error::CallMismatch(format!(
            "rank 0 is in {first}, rank {odd} in {theirs}; every rank must make the same \
             gradsync calls in the same order"
        )));
    }
    if v[0] != 0 {
        agree(comm, local)?;
        return Err(Error::Transport(
            "a rank flagged a failure that the agreement did not see".into(),
        ));
    }
    Ok(v[3] == h && !v[4] == h)
}

/// Every rank's `(key, text)` gathered (collective, on an error path
/// only: one small allgatherv), so that every rank names the same two:
/// rank 0's text, and the lowest rank whose key differs from rank 0's with
/// its text (`None` where every key is rank 0's).
pub(crate) fn first_difference<C: Transport>(
    comm: &C,
    key: u64,
    text: &str,
) -> Result<(String, Option<(usize, String)>)> {
    let g = allgather_bytes(comm, &serde_json::to_vec(&(key, text))?)?;
    let all: Vec<(u64, String)> = (0..comm.size())
        .map(|r| serde_json::from_slice(g.message(r)).unwrap_or_default())
        .collect();
    let odd = (1..all.len()).find(|&r| all[r].0 != all[0].0);
    let first = all.first().map(|a| a.1.clone()).unwrap_or_default();
    Ok((first, odd.map(|r| (r, all[r].1.clone()))))
}

/// The lowest rank whose `value` differs from rank 0's (collective, on a
/// mismatch path only: two more small max-allreduces on `tag`). With the
/// same value everywhere it returns 0.
pub(crate) fn first_rank_differing<C: Transport>(comm: &C, tag: Tag, value: u64) -> Result<usize> {
    let (rank, p) = (comm.rank(), comm.size());
    let mut first = [if rank == 0 { value } else { 0 }];
    small_allreduce_max(comm, &mut first, tag)?;
    let mut v = [if value != first[0] {
        (p - rank) as u64
    } else {
        0
    }];
    small_allreduce_max(comm, &mut v, tag)?;
    Ok(if v[0] == 0 { 0 } else { p - v[0] as usize })
}

/// FNV-1a of a node map (ids as u64 LE), for [`agree_args`].
pub(crate) fn map_hash(nodes: &[usize]) -> u64 {
    nodes
        .iter()
        .fold(FNV_OFFSET, |h, &x| fnv(h, &(x as u64).to_le_bytes()))
}

/// [`Error::RankFailed`] from every rank's error text (empty = no failure):
/// the lowest failing rank, its message, the count of the others. `None`
/// when no rank failed.
pub fn rank_failed(msgs: &[String], step: Option<u64>) -> Option<Error> {
    let failed: Vec<usize> = (0..msgs.len()).filter(|&r| !msgs[r].is_empty()).collect();
    let &rank = failed.first()?;
    Some(Error::RankFailed {
        rank,
        others: failed.len() - 1,
        failed,
        step,
        message: msgs[rank].clone(),
    })
}

/// Arguments that must be the same on every rank, as (flag, value) pairs
/// (the first names the subcommand), compared by [`agree_inputs`].
pub(crate) type MustMatch = Vec<(&'static str, String)>;

/// The end of a subcommand's (or a collective library call's, such as
/// [`crate::calibrate`]) rank-local input phase (flags parsed into
/// values, files loaded, everything validated), and the first collective of
/// the subcommand: every rank learns whether any rank failed, and every
/// rank then fails alike ([`agree`]: [`Error::RankFailed`] naming the
/// lowest failing rank and its error). Then `must_match` of the parsed
/// inputs is compared across ranks ([`same_on_every_rank`]), so that ranks
/// launched with different arguments (an MPMD `mpirun ... : ...`) fail
/// alike instead of entering collectives of different lengths or
/// different counts.
pub(crate) fn agree_inputs<C: Transport, T>(
    comm: &C,
    local: Result<T>,
    must_match: impl FnOnce(&T) -> MustMatch,
) -> Result<T> {
    let v = agree(comm, local)?;
    same_on_every_rank(comm, &must_match(&v))?;
    Ok(v)
}

/// Collective: gathers every rank's `mine` (one small allgatherv) and
/// returns the same [`Error::RankFailed`] on every rank when some rank's
/// values differ from rank 0's, naming the lowest such rank and each flag
/// that differs with both values.
pub(crate) fn same_on_every_rank<C: Transport>(
    comm: &C,
    mine: &[(&'static str, String)],
) -> Result<()> {
    let enc = serde_json::to_vec(mine)?;
    let g = allgather_bytes(comm, &enc)?;
    let all: Vec<Vec<(String, String)>> = (0..g.len())
        .map(|r| serde_json::from_slice(g.message(r)).unwrap_or_default())
        .collect();
    let msgs: Vec<String> = all.iter().map(|v| differences(&all[0], v)).collect();
    rank_failed(&msgs, None).map_or(Ok(()), Err)
}

/// Collective, on the path where every rank has learned that options
/// (a JSON object: `mine`) differ across ranks: gathers every rank's and
/// names, for the lowest rank whose options differ from rank 0's, each
/// top-level option that differs with both values (an object or a long
/// value, such as a profile, only by its name). Every rank returns the
/// same text.
pub(crate) fn option_differences<C: Transport>(comm: &C, mine: &[u8]) -> Result<String> {
    let g = allgather_bytes(comm, mine)?;
    let parse = |r: usize| -> serde_json::Map<String, serde_json::Value> {
        serde_json::from_slice(g.message(r)).unwrap_or_default()
    };
    let first = parse(0);
    for r in 1..g.len() {
        let theirs = parse(r);
        let mut keys: Vec<&String> = first.keys().chain(theirs.keys()).collect();
        keys.sort();
        keys.dedup();
        let d: Vec<String> = keys
            .into_iter()
            .filter(|k| first.get(*k) != theirs.get(*k))
            .map(|k| {
                let show = |v: Option<&serde_json::Value>| {
                    v.map_or("default".to_string(), |v| v.to_string())
                };
                let (v0, v) = (show(first.get(k)), show(theirs.get(k)));
                if v0.len() + v.len() > LONG {
                    format!("a different {k}")
                } else {
                    format!("{k} = {v} (rank 0: {v0})")
                }
            })
            .collect();
        if !d.is_empty() {
            return Ok(format!(
                "engine options (every rank must pass the same): rank {r} has {}",
                d.join(", ")
            ));
        }
    }
    Ok("engine options (every rank must pass the same)".into())
}

/// Values longer than this (the two together) are named, not printed.
const LONG: usize = 160;

/// What differs in `theirs` from rank 0's `first`; empty when nothing does.
fn differences(first: &[(String, String)], theirs: &[(String, String)]) -> String {
    let mut d = Vec::new();
    for i in 0..first.len().max(theirs.len()) {
        match (first.get(i), theirs.get(i)) {
            (Some((k0, v0)), Some((k, v))) if k0 == k => {
                if v0 != v && v0.len() + v.len() > LONG {
                    // A whole profile's JSON: its name, not its text.
                    d.push(format!("{k} differs from rank 0's"));
                } else if v0 != v {
                    d.push(format!("{k} {v} (rank 0: {v0})"));
                }
            }
            (Some((k0, v0)), Some((k, v))) => {
                d.push(format!("{k} {v} where rank 0 has {k0} {v0}"));
                break;
            }
            (Some((k0, v0)), None) => {
                d.push(format!("no {k0} (rank 0: {v0})"));
                break;
            }
            (None, Some((k, v))) => {
                d.push(format!("{k} {v} (rank 0: none)"));
                break;
            }
            (None, None) => break,
        }
    }
    if d.is_empty() {
        String::new()
    } else {
        format!(
            "arguments differ from rank 0's (every rank must pass the same): {}",
            d.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_each_flag_with_both_values() {
        let v = |x: &[(&str, &str)]| -> Vec<(String, String)> {
            x.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let r0 = v(&[
            ("subcommand", "bench --op sparse"),
            ("--layers", "2"),
            ("--bytes", "[4]"),
        ]);
        assert_eq!(differences(&r0, &r0), "");
        let r1 = v(&[
            ("subcommand", "bench --op sparse"),
            ("--layers", "3"),
            ("--bytes", "[8]"),
        ]);
        assert_eq!(
            differences(&r0, &r1),
            "arguments differ from rank 0's (every rank must pass the same): \
             --layers 3 (rank 0: 2), --bytes [8] (rank 0: [4])"
        );
        let other = v(&[("subcommand", "verify"), ("--counts", "[5]")]);
        assert!(differences(&r0, &other).contains("subcommand verify (rank 0: bench --op sparse)"));
        assert!(differences(&r0, &r0[..1]).contains("no --layers (rank 0: 2)"));
        assert!(differences(&r0[..1], &r0).contains("--layers 2 (rank 0: none)"));
        // Garbage from a peer (an empty list) still differs.
        assert!(!differences(&r0, &[]).is_empty());
        // A long value (a profile's JSON) is named, not printed.
        let (a, b) = ("x".repeat(200), "y".repeat(200));
        let long = |x: &str| v(&[("subcommand", "bench"), ("--profile", x)]);
        assert_eq!(
            differences(&long(&a), &long(&b)),
            "arguments differ from rank 0's (every rank must pass the same): \
             --profile differs from rank 0's"
        );
    }
    use crate::comm::LocalComm;

    #[test]
    fn every_rank_gets_the_lowest_failing_rank() {
        for p in 1..=6 {
            for fail in 0..p {
                let out = LocalComm::run(p, |c| {
                    let r = c.rank();
                    let local: Result<usize> = if r == fail || r == p - 1 {
                        Err(Error::InvalidArgument(format!("boom on {r}")))
                    } else {
                        Ok(r)
                    };
                    agree(&c, local).map_err(|e| e.to_string())
                });
                let others = usize::from(fail != p - 1);
                for o in &out {
                    let e = o.as_ref().unwrap_err();
                    assert_eq!(
                        e,
                        &format!(
                            "{}",
                            Error::RankFailed {
                                rank: fail,
                                others,
                                failed: Vec::new(),
                                step: None,
                                message: format!("invalid argument: boom on {fail}"),
                            }
                        ),
                        "p = {p}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_rank_learns_every_failing_rank() {
        // Ranks 1 and 3 of 4 fail: every rank (failing or not) gets the
        // lowest in `rank` and both in `failed`, so a binding raises each
        // failing rank's own error type on that rank.
        let out = LocalComm::run(4, |c| {
            let r = c.rank();
            let local: Result<()> = if r % 2 == 1 {
                Err(Error::InvalidArgument(format!("boom on {r}")))
            } else {
                Ok(())
            };
            match agree(&c, local) {
                Err(Error::RankFailed {
                    rank,
                    others,
                    failed,
                    ..
                }) => (rank, others, failed),
                other => panic!("rank {r}: {other:?}"),
            }
        });
        assert!(out.iter().all(|o| o == &(1, 1, vec![1, 3])), "{out:?}");
    }

    #[test]
    fn success_returns_each_value() {
        let out = LocalComm::run(5, |c| agree(&c, Ok(c.rank() * 10)).unwrap());
        assert_eq!(out, vec![0, 10, 20, 30, 40]);
    }
}
