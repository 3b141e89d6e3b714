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
//! use gradsync::failure::agree;
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

use crate::comm::{Tag, Transport};
use crate::dense::{allgatherv, small_allreduce_max, AllgathervAlgo};
use crate::{Error, Result};

const TAG_AGREE: Tag = crate::comm::tags::AGREE;

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
    let g = allgatherv(comm, text.as_bytes(), AllgathervAlgo::RecursiveDoubling)?;
    let msgs: Vec<String> = (0..g.len())
        .map(|r| String::from_utf8_lossy(g.message(r)).into_owned())
        .collect();
    Err(
        rank_failed(&msgs, None).unwrap_or_else(|| Error::RankFailed {
            rank: p - v[0] as usize,
            others: 0,
            step: None,
            message: "(message lost)".into(),
        }),
    )
}

/// [`Error::RankFailed`] from every rank's error text (empty = no failure):
/// the lowest failing rank, its message, the count of the others. `None`
/// when no rank failed.
pub fn rank_failed(msgs: &[String], step: Option<u64>) -> Option<Error> {
    let mut failing = msgs.iter().enumerate().filter(|(_, m)| !m.is_empty());
    let (rank, message) = failing.next()?;
    Some(Error::RankFailed {
        rank,
        others: failing.count(),
        step,
        message: message.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn success_returns_each_value() {
        let out = LocalComm::run(5, |c| agree(&c, Ok(c.rank() * 10)).unwrap());
        assert_eq!(out, vec![0, 10, 20, 30, 40]);
    }
}
