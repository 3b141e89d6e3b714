//! The last part of a step: every rank's fused sparse message parsed and
//! decoded into the average (RedSync §4's decompression; SBC and the other
//! codecs through their `decode`), the sparse allreduce's result sliced
//! into its layers, the dense average and GradiVeQ's ring
//! output with momentum applied (`dense_update`), the delayed steps'
//! correction, and the NaN/Inf policy. What each layer reads is fixed by
//! the step's plan ([`plan`](super::plan)).

use super::bucket::OpenStep;
use super::layer::Layer;
use super::plan::Mode;
use super::{GradSync, NonFinitePolicy};
use crate::comm::Transport;
use crate::sparse::{parse_fused, unpack_layer_counting, Entry, EntryKind};
use crate::{Error, Result};
use rayon::prelude::*;
use std::time::Instant;

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
        for part in &mut st.parts {
            let Some(job) = part.job.as_mut() else {
                continue;
            };
            for e in &mut job.gvq {
                if let Some(s) = e.state.take() {
                    self.layers[e.layer].gvq = Some(s);
                }
            }
        }
        if comm.is_err() {
            // The step failed on every rank and nothing is applied: what
            // this rank encoded goes back into its residuals (nothing lost).
            for l in &mut self.layers {
                l.rollback();
            }
        }
        comm?;
        if out.len() != self.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "{} output buffers for {} layers",
                out.len(),
                self.layers.len()
            )));
        }
        if let Some((i, l)) = self
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
        let p = self.size;
        let names = |id: u32| {
            self.layers
                .get(id as usize)
                .map_or_else(|| format!("#{id}"), |l| l.name.clone())
        };
        // Parse every rank's fused message of each bucket; entries[l * p + r].
        for part in &mut st.parts {
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
            if job.gathered.len() != p {
                return Err(Error::Transport(format!(
                    "gathered {} messages from {p} ranks",
                    job.gathered.len()
                )));
            }
            for r in 0..p {
                parse_fused(
                    job.gathered.message(r),
                    r,
                    self.step,
                    &part.plan.sparse.ids,
                    &names,
                    &mut self.rank_entries,
                )?;
                for (j, e) in self.rank_entries.iter().enumerate() {
                    part.entries[j * p + r] = *e;
                }
            }
        }
        let plan = &self.plan;
        let parts = &st.parts;
        let owner = &st.owner;
        // Layer `i`'s bucket: its plan and its job.
        let part_of = |i: usize| {
            let part = &parts[owner[i] as usize];
            (
                &part.plan,
                part.job.as_deref().expect("every bucket's job is back"),
                &part.entries,
            )
        };
        let inv = 1.0 / p as f32;
        let rank = self.rank;
        let policy = self.cfg.non_finite;
        let params = (self.cfg.momentum, self.cfg.nesterov, plan.delayed);
        // `auto`'s group in the allgatherv: its unpacking counts the fill.
        let probe_ids = super::exchange::fill_probe_ids(plan, &self.step_load);
        let probed = |i: usize| probe_ids.binary_search(&(i as u32)).is_ok();
        // A delayed step without communication in which some rank's layer
        // was non-finite is void on every rank: every local layer's result
        // is NaN and no rank's state takes any of it (a loss scaler skips
        // the whole step on every rank, and the weights stay in step).
        let void = plan.layers.iter().enumerate().any(|(i, lp)| {
            lp.mode == Mode::Local
                && (part_of(i).1.dn_bad_rank[i].is_some() || self.layers[i].non_finite)
        });
        // Per layer: its error, if any, and for a probed layer the nonzero
        // elements of its result (`None`: not counted).
        type Unpacked = (Option<Error>, Option<usize>);
        let work = |(i, (l, o)): (usize, (&mut Layer, &mut &mut [f32]))| -> Result<Unpacked> {
            let t = Instant::now();
            let (plan, job, entries) = part_of(i);
            let lp = &plan.layers[i];
            let sparse_pos = |i: usize| plan.sparse.ids.binary_search(&(i as u32)).ok();
            let reduced_pos = |i: usize| plan.reduced.ids.binary_search(&(i as u32)).ok();
            let (reduced, bad_rank) = (&job.sp_out, &job.sp_bad_rank);
            let (dense, dense_bad_rank, gvq) = (&job.dense, &job.dn_bad_rank, &job.gvq);
            let gathered = &job.gathered;
            let mut counted = None;
            let r = match lp.mode {
                Mode::Local => {
                    // The lowest rank whose gradient was non-finite (the
                    // status words' markers; this rank alone when no
                    // allreduce ran).
                    let bad = dense_bad_rank[i].or(l.non_finite.then_some(rank));
                    if void {
                        o.fill(f32::NAN);
                    } else {
                        l.commit_local(o, params.0);
                    }
                    bad.map(|r| Error::NonFinite {
                        rank: Some(r),
                        layer: l.name.clone(),
                    })
                }
                Mode::Sparse if lp.reduced => {
                    // The sparse allreduce's slice: every rank's pairs,
                    // already scaled by 1/p (job.rs), as `unpack_layer`
                    // would have added them; a non-finite layer as its
                    // `NonFinite` entries would have it.
                    let j = reduced_pos(i).expect("reduced layer is in the reduced group");
                    o.copy_from_slice(&reduced[lp.reduce_off..lp.reduce_off + l.n]);
                    if params.2 {
                        crate::dense::sub_from(o, &l.prev);
                    }
                    bad_rank[j].map(|r| {
                        if policy == NonFinitePolicy::Propagate {
                            o.fill(f32::NAN);
                        }
                        Error::NonFinite {
                            rank: Some(r),
                            layer: l.name.clone(),
                        }
                    })
                }
                Mode::Sparse => {
                    let j = sparse_pos(i).expect("sparse layer is in the fused table");
                    let codec = l.codec.as_deref().expect("sparse layer has a codec");
                    let unpacked = unpack_layer_counting(
                        gathered,
                        &entries[j * p..(j + 1) * p],
                        codec,
                        &l.name,
                        inv,
                        o,
                        probed(i),
                    );
                    let (bad, nnz) = match unpacked {
                        // Finite messages whose sum overflowed: as a
                        // non-finite dense sum, naming no rank.
                        Err(e @ Error::NonFinite { .. }) => {
                            if policy == NonFinitePolicy::Propagate {
                                o.fill(f32::NAN);
                            }
                            l.stats.unpack_s = t.elapsed().as_secs_f64();
                            return Ok((Some(e), None));
                        }
                        r => r?,
                    };
                    counted = nnz.filter(|_| bad.is_none());
                    if params.2 {
                        crate::dense::sub_from(o, &l.prev);
                    }
                    bad.map(|r| {
                        if policy == NonFinitePolicy::Propagate {
                            o.fill(f32::NAN);
                        }
                        Error::NonFinite {
                            rank: Some(r),
                            layer: l.name.clone(),
                        }
                    })
                }
                Mode::Gradiveq => {
                    let e = gvq
                        .iter()
                        .find(|e| e.layer == i)
                        .expect("every GradiVeQ layer has a job entry");
                    for (x, y) in o.iter_mut().zip(&e.output) {
                        *x = y * inv;
                    }
                    if o.iter().any(|x| !x.is_finite()) {
                        Some(Error::NonFinite {
                            rank: None,
                            layer: l.name.clone(),
                        })
                    } else {
                        l.dense_update(o, params);
                        None
                    }
                }
                Mode::Other => unreachable!("a layer's own bucket plans it"),
                Mode::Dense => {
                    let g = &dense[lp.dense_off..lp.dense_off + l.n];
                    if g.iter().any(|x| !x.is_finite()) {
                        o.copy_from_slice(g);
                        // The lowest rank whose input was non-finite (this
                        // one alone when no allreduce ran); none when finite
                        // inputs overflowed in the sum.
                        let rank = dense_bad_rank[i].or(l.non_finite.then_some(rank));
                        Some(Error::NonFinite {
                            rank,
                            layer: l.name.clone(),
                        })
                    } else {
                        l.dense_update_from(g, o, params);
                        None
                    }
                }
            };
            l.stats.unpack_s = t.elapsed().as_secs_f64();
            Ok((r, counted))
        };
        let unpacked: Result<Vec<Unpacked>> = if plan.parallel_unpack {
            self.layers
                .par_iter_mut()
                .zip(out.par_iter_mut())
                .enumerate()
                .map(work)
                .collect()
        } else {
            self.layers
                .iter_mut()
                .zip(out.iter_mut())
                .enumerate()
                .map(work)
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
            for (l, o) in self.layers.iter_mut().zip(out.iter_mut()) {
                l.rollback();
                o.fill(f32::NAN);
            }
        }
        let unpacked = unpacked?;
        for (l, lp) in self.layers.iter_mut().zip(&plan.layers) {
            l.fill_stats(lp.mode);
        }
        // The fill of the probed group: every probed layer counted, or
        // nothing is measured (a non-finite unit, a dense decode). Kept in
        // the first bucket's job.
        let probe_nnz = if probe_ids.is_empty() {
            None
        } else {
            probe_ids
                .iter()
                .map(|&i| unpacked[i as usize].1)
                .sum::<Option<usize>>()
        };
        for (k, part) in st.parts.iter_mut().enumerate() {
            if let Some(job) = part.job.as_mut() {
                job.probe_nnz = if k == 0 { probe_nnz } else { None };
            }
        }
        match unpacked.into_iter().find_map(|(e, _)| e) {
            Some(e) if policy == NonFinitePolicy::Error => Err(e),
            Some(e) => {
                log::warn!("gradsync: {e} (propagated as NaN)");
                Ok(())
            }
            None => Ok(()),
        }
    }
}
