//! The last part of a step: every rank's fused sparse message parsed and
//! decoded into the average (RedSync §4's decompression; SBC and the other
//! codecs through their `decode`), the sparse allreduce's result sliced
//! into its layers, the dense average and GradiVeQ's ring
//! output with momentum applied (`dense_update`), a void delayed step's
//! rollback, and the NaN/Inf policy. What each layer reads is fixed by
//! the step's plan ([`plan`](super::plan)).
//!
//! [`GradSync::unpack`] runs the stages in order: the GradiVeQ states back
//! to their layers, the outputs checked, every bucket's messages parsed
//! ([`GradSync::parse_messages`]), each layer unpacked by its mode
//! ([`Unpacker`]), a failed delayed step voided, and the fill probe and
//! the NaN/Inf policy applied.

use super::bucket::{OpenStep, Part};
use super::job::Job;
use super::layer::Layer;
use super::plan::{Mode, StepScript};
use super::{GradSync, NonFinitePolicy};
use crate::comm::Transport;
use crate::dense::Averaging;
use crate::sparse::{parse_fused, unpack_layer_counting, Entry, EntryKind};
use crate::{Error, Result};
use rayon::prelude::*;
use std::time::Instant;

/// Where layer `i` is in a group's sorted `ids`.
#[inline]
fn position(ids: &[u32], i: usize) -> Option<usize> {
    ids.binary_search(&(i as u32)).ok()
}

/// One layer's unpacking: its error, if any, and for a probed layer the
/// nonzero elements of its result (`None`: not counted).
type Unpacked = (Option<Error>, Option<usize>);

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Unpack the step's results into `out` (the last part of the step
    /// script): `comm` is the outcome of the communication round.
    pub(super) fn unpack(
        &mut self,
        st: &mut OpenStep,
        out: &mut [&mut [f32]],
        comm: Result<()>,
    ) -> Result<()> {
        // GradiVeQ states go back to their layers whatever happened.
        self.return_gvq_states(st);
        if comm.is_err() {
            // The step failed on every rank and nothing is applied: what
            // this rank encoded goes back into its residuals (nothing lost).
            for l in &mut self.reg.layers {
                l.rollback();
            }
        }
        comm?;
        if let Err(e) = self.check_outputs(out) {
            // This rank's result is lost; with a delay its weights were
            // written back already: they are no longer its peers'.
            if self.plan.delayed && self.plan.communicates {
                self.mark_diverged(self.step);
            }
            return Err(e);
        }
        if let Err(e) = self.parse_messages(&mut st.parts) {
            // The same gathered bytes on every rank: every rank fails here.
            // With a delay the window's directions go back, as for a void
            // step (the window stays open).
            if self.plan.delayed && self.plan.communicates {
                for l in &mut self.reg.layers {
                    l.rollback();
                }
            }
            return Err(e);
        }
        let plan = &self.plan;
        // `auto`'s group in the allgatherv: its unpacking counts the fill.
        let probe_ids = super::exchange::fill_probe_ids(plan, &self.tuner.load);
        let unpacker = Unpacker::new(self, st, probe_ids);
        let unpacked: Result<Vec<Unpacked>> = if plan.parallel_unpack {
            self.reg
                .layers
                .par_iter_mut()
                .zip(out.par_iter_mut())
                .enumerate()
                .map(|(i, (l, o))| unpacker.layer(i, l, o))
                .collect()
        } else {
            self.reg
                .layers
                .iter_mut()
                .zip(out.iter_mut())
                .enumerate()
                .map(|(i, (l, o))| unpacker.layer(i, l, o))
                .collect()
        };
        // With `delay > 1`, a communicating step that fails in any layer on
        // every rank (a NaN/Inf, a corrupt unit) is void on every rank:
        // each caller skips the whole step (on an error, or on the NaN a
        // loss scaler sees), so every layer must keep the local directions
        // it was exchanging, or the ranks' weights drift apart for good.
        let failed = match &unpacked {
            Ok(u) => u.iter().any(|(e, _)| e.is_some()),
            Err(_) => true,
        };
        if plan.delayed && plan.communicates && failed {
            for (l, o) in self.reg.layers.iter_mut().zip(out.iter_mut()) {
                l.rollback();
                o.fill(f32::NAN);
            }
        }
        let (delayed, communicated) = (plan.delayed, plan.communicates);
        let unpacked = unpacked?;
        for (l, lp) in self.reg.layers.iter_mut().zip(&plan.layers) {
            l.fill_stats(lp.mode);
        }
        record_probe_nnz(&mut st.parts, probe_ids, &unpacked);
        if delayed {
            self.end_window(communicated, !failed);
        }
        apply_policy(self.cfg.non_finite, unpacked)
    }

    /// Every bucket's GradiVeQ and PowerSGD states back into their layers.
    fn return_gvq_states(&mut self, st: &mut OpenStep) {
        for part in &mut st.parts {
            let Some(job) = part.job.as_mut() else {
                continue;
            };
            for e in &mut job.buf.gvq {
                if let Some(s) = e.state.take() {
                    self.reg.layers[e.layer].gvq = Some(s);
                }
            }
            for e in &mut job.buf.psg {
                if let Some(s) = e.state.take() {
                    self.reg.layers[e.layer].psg = Some(s);
                }
            }
        }
    }

    /// One output buffer per layer, each of the layer's length.
    fn check_outputs(&self, out: &[&mut [f32]]) -> Result<()> {
        if out.len() != self.reg.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "{} output buffers for {} layers",
                out.len(),
                self.reg.layers.len()
            )));
        }
        if let Some((i, l)) = self
            .reg
            .layers
            .iter()
            .enumerate()
            .find(|(i, l)| out[*i].len() != l.n)
        {
            return Err(Error::InvalidArgument(format!(
                "layer {:?}: output has {} elements, registered {}",
                l.name,
                out[i].len(),
                l.n
            )));
        }
        Ok(())
    }

    /// Parse every rank's fused message of each bucket into the bucket's
    /// `entries` (`entries[l * p + r]`: its `l`-th sparse layer, rank `r`).
    fn parse_messages(&mut self, parts: &mut [Part]) -> Result<()> {
        let p = self.size;
        let names = |id: u32| {
            self.reg
                .layers
                .get(id as usize)
                .map_or_else(|| format!("#{id}"), |l| l.name.clone())
        };
        for part in parts {
            let ns = part.plan.sparse.ids.len();
            if ns == 0 {
                continue;
            }
            let job = part.job.as_ref().expect("every bucket's job is back");
            part.entries.clear();
            part.entries.resize(
                ns * p,
                Entry {
                    layer: 0,
                    kind: EntryKind::Unit,
                    start: 0,
                    end: 0,
                },
            );
            if job.buf.gathered.len() != p {
                return Err(Error::Transport(format!(
                    "gathered {} messages from {p} ranks",
                    job.buf.gathered.len()
                )));
            }
            for r in 0..p {
                parse_fused(
                    job.buf.gathered.message(r),
                    r,
                    self.step,
                    &part.plan.sparse.ids,
                    &names,
                    &mut self.work.rank_entries,
                )?;
                for (j, e) in self.work.rank_entries.iter().enumerate() {
                    part.entries[j * p + r] = *e;
                }
            }
        }
        Ok(())
    }
}

/// The fill of the probed group: every probed layer counted, or nothing
/// is measured (a non-finite unit, a dense decode). Kept in the first
/// bucket's job.
fn record_probe_nnz(parts: &mut [Part], probe_ids: &[u32], unpacked: &[Unpacked]) {
    let probe_nnz = if probe_ids.is_empty() {
        None
    } else {
        probe_ids
            .iter()
            .map(|&i| unpacked[i as usize].1)
            .sum::<Option<usize>>()
    };
    for (k, part) in parts.iter_mut().enumerate() {
        if let Some(job) = part.job.as_mut() {
            job.out.probe_nnz = if k == 0 { probe_nnz } else { None };
        }
    }
}

/// The step's outcome under the NaN/Inf `policy`: the first layer's error,
/// or a warning when it is propagated as NaN.
fn apply_policy(policy: NonFinitePolicy, unpacked: Vec<Unpacked>) -> Result<()> {
    match unpacked.into_iter().find_map(|(e, _)| e) {
        Some(e) if policy == NonFinitePolicy::Error => Err(e),
        Some(e) => {
            log::warn!("gradsync: {e} (propagated as NaN)");
            Ok(())
        }
        None => Ok(()),
    }
}

/// What unpacking any one layer reads: every bucket's plan, job and
/// parsed entries, and the step's constants. Shared by the layers (they
/// may run under rayon); each layer's own state and output are its alone.
struct Unpacker<'a> {
    parts: &'a [Part],
    /// Per layer, the bucket that holds it.
    owner: &'a [u32],
    p: usize,
    inv: f32,
    rank: usize,
    policy: NonFinitePolicy,
    /// Momentum, Nesterov, delayed step.
    params: (f32, bool, bool),
    /// The layers whose unpacking counts the fill (sorted).
    probe_ids: &'a [u32],
    /// A delayed step without communication that is void on every rank.
    void: bool,
}

impl<'a> Unpacker<'a> {
    fn new<C: Transport + Send + 'static>(
        sync: &GradSync<C>,
        st: &'a OpenStep,
        probe_ids: &'a [u32],
    ) -> Self {
        let p = sync.size;
        let mut u = Unpacker {
            parts: &st.parts,
            owner: &st.owner,
            p,
            inv: 1.0 / p as f32,
            rank: sync.rank,
            policy: sync.cfg.non_finite,
            params: (sync.cfg.momentum, sync.cfg.nesterov, sync.plan.delayed),
            probe_ids,
            void: false,
        };
        u.void = u.void_local_step(&sync.plan, &sync.reg.layers);
        u
    }

    /// A delayed step without communication in which some rank's layer
    /// was non-finite is void on every rank: every local layer's result
    /// is NaN and no rank's state takes any of it (a loss scaler skips
    /// the whole step on every rank, and the weights stay in step).
    fn void_local_step(&self, plan: &StepScript, layers: &[Layer]) -> bool {
        plan.layers.iter().enumerate().any(|(i, lp)| {
            lp.mode == Mode::Local
                && (self.part_of(i).1.buf.dn_bad_rank[i].is_some() || layers[i].non_finite)
        })
    }

    /// Layer `i`'s bucket: its plan, its job and its parsed entries.
    #[inline]
    fn part_of(&self, i: usize) -> (&'a StepScript, &'a Job, &'a [Entry]) {
        let part = &self.parts[self.owner[i] as usize];
        (
            &part.plan,
            part.job.as_deref().expect("every bucket's job is back"),
            &part.entries,
        )
    }

    /// Whether layer `i`'s unpacking counts the fill.
    #[inline]
    fn probed(&self, i: usize) -> bool {
        self.probe_ids.binary_search(&(i as u32)).is_ok()
    }

    /// Unpack layer `i` into `o` as its bucket's plan says, timing it.
    #[inline]
    fn layer(&self, i: usize, l: &mut Layer, o: &mut &mut [f32]) -> Result<Unpacked> {
        let t = Instant::now();
        let (plan, job, entries) = self.part_of(i);
        let lp = &plan.layers[i];
        let r = match lp.mode {
            Mode::Local => (self.local(i, l, o, job), None),
            Mode::Sparse if lp.reduced => {
                let j =
                    position(&plan.reduced.ids, i).expect("reduced layer is in the reduced group");
                let slice = &job.buf.sp_out[lp.reduce_off..lp.reduce_off + l.n];
                (self.reduced(l, o, slice, &job.buf.sp_bad_rank[j]), None)
            }
            Mode::Sparse => {
                let j = position(&plan.sparse.ids, i).expect("sparse layer is in the fused table");
                self.sparse(i, l, o, job, &entries[j * self.p..(j + 1) * self.p])?
            }
            Mode::Gradiveq => (self.gradiveq(i, l, o, job), None),
            Mode::Powersgd => (self.powersgd(i, l, o, job), None),
            Mode::Other => unreachable!("a layer's own bucket plans it"),
            Mode::Dense => {
                let g = &job.buf.dense[lp.dense_off..lp.dense_off + l.n];
                let summed = job.buf.dense_summed.then(|| Averaging::of(self.p));
                (self.dense(l, o, g, summed, &job.buf.dn_bad_rank[i]), None)
            }
        };
        l.stats.unpack_s = t.elapsed().as_secs_f64();
        Ok(r)
    }

    /// A delayed step's local layer: its direction committed (or NaN when
    /// the step is void).
    fn local(&self, i: usize, l: &mut Layer, o: &mut [f32], job: &Job) -> Option<Error> {
        // The lowest rank whose gradient was non-finite (the status
        // words' markers; this rank alone when no allreduce ran).
        let bad = job.buf.dn_bad_rank[i].or(l.non_finite.then_some(self.rank));
        if self.void {
            o.fill(f32::NAN);
        } else {
            l.commit_local(o, self.params.0);
        }
        bad.map(|r| Error::NonFinite {
            rank: Some(r),
            layer: l.name.clone(),
        })
    }

    /// A reduced layer: the sparse allreduce's slice, every rank's pairs
    /// already scaled by 1/p (job.rs), as `unpack_layer` would have added
    /// them; a non-finite layer as its `NonFinite` entries would have it.
    fn reduced(
        &self,
        l: &Layer,
        o: &mut [f32],
        slice: &[f32],
        bad: &Option<usize>,
    ) -> Option<Error> {
        o.copy_from_slice(slice);
        self.bad_rank(l, o, *bad)
    }

    /// A layer of the fused message: every rank's unit decoded and
    /// scatter-added with scale 1/p, in rank order (`entries`: the
    /// layer's entry of each rank).
    fn sparse(
        &self,
        i: usize,
        l: &Layer,
        o: &mut [f32],
        job: &Job,
        entries: &[Entry],
    ) -> Result<Unpacked> {
        let codec = l.codec.as_deref().expect("sparse layer has a codec");
        let unpacked = unpack_layer_counting(
            &job.buf.gathered,
            entries,
            codec,
            &l.name,
            self.inv,
            o,
            self.probed(i),
        );
        let (bad, nnz) = match unpacked {
            // Finite messages whose sum overflowed: as a
            // non-finite dense sum, naming no rank.
            Err(e @ Error::NonFinite { .. }) => {
                if self.policy == NonFinitePolicy::Propagate {
                    o.fill(f32::NAN);
                }
                return Ok((Some(e), None));
            }
            r => r?,
        };
        let counted = nnz.filter(|_| bad.is_none());
        Ok((self.bad_rank(l, o, bad), counted))
    }

    /// A sparse layer in which rank `bad` (if any) was non-finite: its
    /// error, and the result NaN under `Propagate`.
    #[inline]
    fn bad_rank(&self, l: &Layer, o: &mut [f32], bad: Option<usize>) -> Option<Error> {
        bad.map(|r| {
            if self.policy == NonFinitePolicy::Propagate {
                o.fill(f32::NAN);
            }
            Error::NonFinite {
                rank: Some(r),
                layer: l.name.clone(),
            }
        })
    }

    /// A GradiVeQ layer: its ring's sum averaged, then momentum.
    fn gradiveq(&self, i: usize, l: &mut Layer, o: &mut [f32], job: &Job) -> Option<Error> {
        let e = job
            .buf
            .gvq
            .iter()
            .find(|e| e.layer == i)
            .expect("every GradiVeQ layer has a job entry");
        for (x, y) in o.iter_mut().zip(&e.output) {
            *x = y * self.inv;
        }
        if o.iter().any(|x| !x.is_finite()) {
            Some(Error::NonFinite {
                rank: None,
                layer: l.name.clone(),
            })
        } else {
            l.dense_update(o, self.params);
            None
        }
    }

    /// A PowerSGD layer: its approximation of the average (already
    /// divided by p), then momentum.
    fn powersgd(&self, i: usize, l: &mut Layer, o: &mut [f32], job: &Job) -> Option<Error> {
        let e = job
            .buf
            .psg
            .iter()
            .find(|e| e.layer == i)
            .expect("every PowerSGD layer has a job entry");
        if e.output.iter().any(|x| !x.is_finite()) {
            o.copy_from_slice(&e.output);
            Some(Error::NonFinite {
                rank: None,
                layer: l.name.clone(),
            })
        } else {
            l.dense_update_from(&e.output, o, self.params);
            None
        }
    }

    /// A dense layer: its slice `g` of the fused average (of the fused
    /// sum, averaged here by `summed`, after the `mpi` allreduce), then
    /// momentum; `bad`: the lowest rank whose input was non-finite, if any.
    fn dense(
        &self,
        l: &mut Layer,
        o: &mut [f32],
        g: &[f32],
        summed: Option<Averaging>,
        bad: &Option<usize>,
    ) -> Option<Error> {
        // (A sum is finite exactly where its average is.)
        if g.iter().any(|x| !x.is_finite()) {
            match summed {
                Some(avg) => o.iter_mut().zip(g).for_each(|(x, &y)| *x = avg.apply(y)),
                None => o.copy_from_slice(g),
            }
            // The lowest rank whose input was non-finite (this one alone
            // when no allreduce ran); none when finite inputs overflowed
            // in the sum.
            let rank = bad.or(l.non_finite.then_some(self.rank));
            Some(Error::NonFinite {
                rank,
                layer: l.name.clone(),
            })
        } else {
            match summed {
                Some(avg) => l.dense_update_from_sum(g, o, self.params, avg),
                None => l.dense_update_from(g, o, self.params),
            }
            None
        }
    }
}
