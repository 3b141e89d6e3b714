//! Probes of the machine's state beside a job's own measurements, each
//! against what its profile's calibration measured of the same: the
//! development VMs move between states for seconds at a time (their vCPUs
//! between core complexes, for one), and a profile describes the state
//! its calibration ran in. `bench --op step` times these in its steps'
//! rounds, so that its records say whether a miss of the step model is
//! the network's state or the model's.

use super::probes::{exchange_time, Probe, BURST};
use crate::comm::{MpiComm, Transport};
use crate::cost::Profile;
use crate::Result;

/// One state probe and the profile's price of it.
pub(crate) struct StateProbe<'a> {
    /// `exchange`: a pairwise `sendrecv` between ranks 2i and 2i+1, as
    /// the calibration's exchanges on one node.
    pub probe: &'static str,
    /// Bytes each way.
    pub size: usize,
    /// The profile's price: `α + β(m)·m`.
    pub profile_s: f64,
    run: Probe<'a>,
}

impl StateProbe<'_> {
    /// A short warm burst, as the calibration's rounds run a probe (one
    /// untimed call, then three timed): their median. Collective.
    pub(crate) fn measure(&mut self, round: usize) -> Result<f64> {
        let base = round * (BURST + 1);
        (self.run)(base)?;
        let mut t = [0f64; BURST];
        for (b, x) in t.iter_mut().enumerate() {
            *x = (self.run)(base + b + 1)?;
        }
        Ok(super::median(&mut t))
    }
}

/// The state probes `prof` can price, the same on every rank: exchanges
/// of 64 KiB and of the largest size its calibration measured, up to
/// 16 MiB (its exchanges stop where one takes 50 ms: 4 MiB at 1 Gbit/s),
/// on more than one rank (none on one). Collective only in the probes'
/// runs.
pub(crate) fn state_probes<'a>(comm: &'a MpiComm, prof: &Profile) -> Result<Vec<StateProbe<'a>>> {
    let mut v = Vec::new();
    if comm.size() > 1 {
        let top = prof
            .beta_curve
            .iter()
            .map(|c| c.bytes as usize)
            .max()
            .unwrap_or(LONG);
        let long = top.clamp(SHORT, LONG);
        let sizes = if long > SHORT {
            vec![SHORT, long]
        } else {
            vec![SHORT]
        };
        for b in sizes {
            let (mut send, mut recv) = (vec![0u8; b], vec![0u8; b]);
            let m = b as f64;
            v.push(StateProbe {
                probe: "exchange",
                size: b,
                profile_s: prof.alpha + m * prof.beta_at(m),
                run: Box::new(move |r| exchange_time(comm, &mut send, &mut recv, r)),
            });
        }
    }
    Ok(v)
}

/// The short exchange, bytes.
const SHORT: usize = 64 << 10;

/// The longest exchange, bytes.
const LONG: usize = 16 << 20;
