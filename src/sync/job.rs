//! The progress job: one communication round's buffers and flags
//! ([`Job`]), moved to the progress thread ([`Worker`]) and back, and the
//! collectives it runs: the fused sparse messages' allgatherv
//! ([`crate::sparse`], RedSync §4), the fused dense buffer's allreduce
//! (Rabenseifner, with a status word after the data), the sparse
//! allreduce of the `reduced` layers (`Config::sparse_exchange`),
//! GradiVeQ's compressed-domain rings and PowerSGD's two fused factor
//! allreduces. A failure flagged by any rank
//! reaches every rank as the same [`crate::Error::RankFailed`]; any other
//! error ends the job ([`crate::comm::agree`]). Also the between-steps status
//! agreement used by snapshot restores.
//!
//! # The sparse allreduce of the reduced layers
//!
//! With `Config::sparse_exchange = Allreduce`, the sparse layers whose
//! codec sends index/value pairs (RGC, quantized RGC: the plan's `reduced`
//! group) are not in the fused message. After the local phase, each such
//! layer's unit is read back ([`Codec::for_each_sent`](crate::codec::Codec::for_each_sent))
//! into one list of pairs over the layers' concatenated index space
//! (global index = the layer's offset + the unit's index), each value
//! scaled by `1/p` as `unpack_layer` scales it (and `+ 0.0`, as its zeroed
//! accumulator adds it): the sparse allreduce adds in rank order, so every
//! layer's result is bitwise the allgather path's.
//!
//! Failures and NaN/Inf, in order:
//!
//! 1. the step always runs the status allreduce (the plan forces it), with
//!    two words after the dense data: this rank failed, and some reduced
//!    or dense layer's gradient held NaN/Inf on this rank (a reduced one
//!    sends no pairs, as its `NonFinite` entry sends no unit in the fused
//!    message; a dense one makes the sum non-finite on every rank);
//! 2. a failure (first word, or a failure marker in the fused message)
//!    ends the step on every rank with the same `RankFailed`, before the
//!    sparse allreduce: a rank whose local phase failed never enters it
//!    alone;
//! 3. if the second word is set, one small allgatherv of every rank's
//!    non-finite layer positions gives every rank, per layer, the lowest
//!    such rank: unpacking then does what the fused path does with a
//!    `NonFinite` entry (`Error::NonFinite` naming that rank, or NaN), and
//!    names that rank for a dense layer whose sum is non-finite (a sum
//!    that overflowed from finite inputs names none);
//! 4. the sparse allreduce itself; its non-collective errors end the job
//!    (`run`), like the other collectives'.

use super::layer::Layer;
use super::plan::{Mode, StepScript};
use super::SparseExchange;
use crate::comm::agree::{agree_call, first_rank_differing, CallKind};
use crate::comm::Transport;
use crate::dense::{
    allgatherv::allgatherv_nodes_with, allreduce_with, AllgathervAlgo, AllreduceAlgo,
    AllreduceOptions, Gathered, ReduceOp, Workspace,
};
use crate::sparse::{
    failure_text, fused_allgather, hierarchical_sparse_allreduce_with, sparse_allreduce,
    write_failed, write_fused, EntryKind, HierarchicalWorkspace, SparseAllreduceOptions,
};
use crate::{Error, Result};
use std::time::Instant;

/// The high bit of a non-finite marker word: a dense layer's id, not a
/// reduced layer's position.
const DENSE_MARK: u32 = 1 << 31;

/// One communication round's state, moved to the progress thread and
/// back: its workspace ([`RoundBuffers`]), what it runs
/// ([`RoundScript`]) and what it measured and returned ([`RoundOutcome`]).
#[derive(Default)]
pub(super) struct Job {
    /// The round's buffers, sized once and kept across steps.
    pub(super) buf: RoundBuffers,
    /// What this round runs (set by `pack`, or between steps by the
    /// status agreement).
    pub(super) script: RoundScript,
    /// What the round measured and returned, read back by the engine.
    pub(super) out: RoundOutcome,
}

/// A round's workspace: the fused message and its gathered copy, the fused
/// dense buffer, the reduced layers' pairs and result, the non-finite
/// markers and the collectives' scratch; sized once and kept across
/// steps.
#[derive(Default)]
pub(super) struct RoundBuffers {
    /// Every rank's node (the hierarchical sparse exchange), set when the
    /// engine is created.
    pub(super) nodes: Vec<usize>,
    pub(super) fused: Vec<u8>,
    pub(super) gathered: Gathered,
    pub(super) dense: Vec<f32>,
    /// `dense` holds the ranks' sum, not their average: the `mpi`
    /// allreduce, whose average would be a pass of its own, is taken as
    /// the layers are unpacked (`unpack.rs`). Set by every dense round.
    pub(super) dense_summed: bool,
    pub(super) ws: Workspace<f32>,
    /// This rank's pairs of the reduced layers: global index, value · 1/p.
    pub(super) sp_idx: Vec<u32>,
    pub(super) sp_val: Vec<f32>,
    /// The sparse allreduce's result (`sp_n` elements).
    pub(super) sp_out: Vec<f32>,
    /// Positions in the reduced group of this rank's non-finite layers.
    pub(super) sp_nonfinite: Vec<u32>,
    /// Pairs this rank contributes per reduced layer (by position).
    pub(super) sp_layer_pairs: Vec<usize>,
    /// Per reduced layer, the lowest rank whose gradient was non-finite.
    pub(super) sp_bad_rank: Vec<Option<usize>>,
    /// Layer ids of this rank's non-finite dense layers (their sum is
    /// non-finite on every rank; this names who).
    pub(super) dn_nonfinite: Vec<u32>,
    /// Per layer id, the lowest rank whose dense layer was non-finite
    /// (gathered with the reduced layers' markers).
    pub(super) dn_bad_rank: Vec<Option<usize>>,
    /// The node-aware sparse allreduce's buffers, kept across steps.
    pub(super) hier_ws: HierarchicalWorkspace,
    /// GradiVeQ layers of this step: state, input, output.
    pub(super) gvq: Vec<GvqEntry>,
    /// PowerSGD layers of this step: state, input, output.
    pub(super) psg: Vec<PsgEntry>,
    /// Every PowerSGD layer's `P`, then `Q`, fused (each allreduced once).
    pub(super) psg_p: Vec<f32>,
    pub(super) psg_q: Vec<f32>,
}

/// A round's script: which collectives run and by which algorithm, the
/// sizes they run on, the step, this rank's failure and the agreements
/// that come first (set by `pack`, or between steps by the status
/// agreement).
#[derive(Default)]
pub(super) struct RoundScript {
    pub(super) do_gather: bool,
    pub(super) do_reduce: bool,
    pub(super) do_gvq: bool,
    /// Run the PowerSGD layers' two fused factor allreduces.
    pub(super) do_psg: bool,
    /// Elements of `dense` before its status words.
    pub(super) dense_len: usize,
    /// Status words after the dense data: 1 (this rank failed), or 2 in a
    /// step (and: a reduced or dense layer was non-finite on this rank).
    pub(super) status_len: usize,
    /// Run the sparse allreduce of the reduced layers.
    pub(super) do_sparse: bool,
    /// How the reduced layers are exchanged.
    pub(super) exchange: SparseExchange,
    /// The reduced layers' concatenated index space (elements).
    pub(super) sp_n: usize,
    /// The step, for failure messages (`None` between steps).
    pub(super) step: Option<u64>,
    /// This rank's own failure in the local phase (error text).
    pub(super) local_failed: Option<String>,
    /// The step's collectives, as the decision table gave them (`pack`):
    /// the fused message's allgatherv, the one inside the sparse
    /// allreduces, the dense allreduce.
    pub(super) gather_algo: AllgathervAlgo,
    pub(super) reduce_gather_algo: AllgathervAlgo,
    pub(super) reduce_algo: AllreduceAlgo,
    /// PowerSGD's factors' allreduce, as the decision table gave it.
    pub(super) factor_algo: AllreduceAlgo,
    /// Between steps: a value that must be the same on every rank, what to
    /// say if it is not, and this rank's own outcome
    /// ([`super::GradSync::agree_status`]).
    pub(super) print: Option<(u64, String, Result<()>)>,
    /// In a step: the bucket's fingerprint (the step, its place in the
    /// step, its layers, whether it is the last) and what it holds, agreed
    /// before any collective whose size depends on it, so that ranks
    /// that cut the step differently fail alike instead of exchanging
    /// buffers of different lengths (`bucket.rs`).
    pub(super) check: Option<(u64, String)>,
    /// Which call the job's first agreement belongs to, and the step
    /// counter it names (`check` and `print` carry it: ranks in different
    /// calls meet there and fail alike, [`crate::comm::agree::agree_call`]).
    pub(super) call: Option<(CallKind, u64)>,
    /// The step's first bucket (the progress runner forgets an earlier
    /// step's failure there, `progress.rs`).
    pub(super) first: bool,
}

/// A round's outcome: the collectives' timings, the sparse allreduce's and
/// the fill probe's measures, and the round's result.
#[derive(Default)]
pub(super) struct RoundOutcome {
    pub(super) sparse_reduce_s: f64,
    /// Distinct indices of the sparse allreduce's result.
    pub(super) sparse_reduce_nnz: usize,
    /// With `auto` and the allgatherv: the nonzero elements of the
    /// reduced group's unpacked result (`unpack.rs`), the fill's measure.
    pub(super) probe_nnz: Option<usize>,
    pub(super) allgather_s: f64,
    pub(super) allreduce_s: f64,
    pub(super) gvq_s: f64,
    /// The PowerSGD phase: products, orthogonalization and both
    /// allreduces.
    pub(super) psg_s: f64,
    pub(super) result: Option<Result<()>>,
}

#[derive(Default)]
pub(super) struct GvqEntry {
    pub(super) layer: usize,
    /// The layer's name, for errors inside its ring.
    pub(super) name: String,
    pub(super) state: Option<crate::gradiveq::schedule::GradiveqLayer>,
    pub(super) input: Vec<f32>,
    pub(super) output: Vec<f32>,
    /// Whether this step's `input` is finite (checked as it was written).
    pub(super) finite: bool,
}

/// One PowerSGD layer of a step: its state (moved in from the layer for
/// the round), this rank's input (the dense contribution) and the
/// averaged approximation.
#[derive(Default)]
pub(super) struct PsgEntry {
    pub(super) layer: usize,
    pub(super) state: Option<crate::powersgd::PowerSgd>,
    pub(super) input: Vec<f32>,
    pub(super) output: Vec<f32>,
    /// Whether this step's `input` is finite (checked as it was written).
    pub(super) finite: bool,
}

impl Job {
    /// Run the step's collectives. Errors every rank got alike (a failure
    /// flagged in the step's status, corrupt data every rank received)
    /// return to the caller; any other error may be this rank's alone while
    /// its peers block in a collective, so it ends the job
    /// ([`Transport::abort`], the failure model of [`crate::comm::agree`]).
    pub(super) fn run<C: Transport>(&mut self, comm: &C) {
        let r = self.communicate(comm);
        if let Err(e) = &r {
            if !e.is_collective() {
                let at = self
                    .script
                    .step
                    .map_or_else(String::new, |s| format!("step {s}: "));
                comm.abort(1, &format!("{at}{e}"));
            }
        }
        self.out.result = Some(r);
    }

    /// Run the collectives of the job, in this order on every rank: the
    /// bucket's fingerprint agreed (or, between steps, the status
    /// agreement alone); the fused messages' allgatherv; the fused dense
    /// allreduce with the status words (and the failure texts or the
    /// non-finite markers it calls for); any rank's failure as
    /// `RankFailed`; the sparse allreduce of the reduced layers; the
    /// GradiVeQ rings.
    pub(super) fn communicate<C: Transport>(&mut self, comm: &C) -> Result<()> {
        self.agree_bucket(comm)?;
        if let Some((h, what, local)) = self.script.print.take() {
            return self.agree_entry(comm, local, h, &what);
        }
        // Every rank's failure text (empty = ok), once any rank failed.
        let mut failed: Option<Vec<String>> = None;
        if self.script.do_gather {
            failed = self.gather_messages(comm)?;
        }
        if self.script.do_reduce && failed.is_none() {
            failed = self.reduce_dense(comm)?;
        }
        if failed.is_none() && comm.size() == 1 {
            failed = self.script.local_failed.clone().map(|t| vec![t]);
        }
        if let Some(texts) = failed {
            return Err(self.rank_failed(&texts));
        }
        if self.script.do_sparse {
            self.reduce_pairs(comm)?;
        }
        self.run_rings(comm)?;
        self.run_powersgd(comm)
    }

    /// The bucket's fingerprint, agreed before any collective whose size
    /// depends on it (at more than one rank).
    fn agree_bucket<C: Transport>(&mut self, comm: &C) -> Result<()> {
        if let Some((h, what)) = self.script.check.take() {
            if comm.size() > 1 {
                self.agree_entry(comm, Ok(()), h, &what)?;
            }
        }
        Ok(())
    }

    /// The job's first agreement ([`agree_call`]): the call every rank is
    /// in (`call`), this rank's outcome `local` and the fingerprint `h`;
    /// where the fingerprints differ, every rank's
    /// [`Error::ArgumentMismatch`] with `what` ([`mismatch`]).
    fn agree_entry<C: Transport>(
        &mut self,
        comm: &C,
        local: Result<()>,
        h: u64,
        what: &str,
    ) -> Result<()> {
        // The text only on a mismatch: nothing is formatted per bucket.
        let (kind, step) = self
            .script
            .call
            .take()
            .unwrap_or((CallKind::Step, self.script.step.unwrap_or(0)));
        let describe = || kind.describe(step);
        if agree_call(comm, kind, &describe, local, h)? {
            Ok(())
        } else {
            Err(mismatch(comm, h, what)?)
        }
    }

    /// The fused allgatherv of every rank's message into `gathered`; every
    /// rank's failure text (empty = ok) when any message is a failure
    /// marker.
    fn gather_messages<C: Transport>(&mut self, comm: &C) -> Result<Option<Vec<String>>> {
        let t = Instant::now();
        let algo = self.script.gather_algo;
        if algo == AllgathervAlgo::Node && !self.buf.nodes.is_empty() {
            // The engine's agreed node map, the one its model priced.
            allgatherv_nodes_with(
                comm,
                &self.buf.fused,
                Some(&self.buf.nodes),
                &mut self.buf.gathered,
            )?;
        } else {
            fused_allgather(comm, &self.buf.fused, algo, &mut self.buf.gathered)?;
        }
        self.out.allgather_s = t.elapsed().as_secs_f64();
        // The common path only looks at each message's magic.
        let g = &self.buf.gathered;
        if (0..g.len()).any(|r| failure_text(g.message(r)).is_some()) {
            return Ok(Some(
                (0..g.len())
                    .map(|r| failure_text(g.message(r)).unwrap_or_default())
                    .collect(),
            ));
        }
        Ok(None)
    }

    /// The fused dense allreduce (the average; the sum with the `mpi`
    /// algorithm, averaged in the unpacking) with the status words after the
    /// data; then, if some rank failed, one allgatherv of every rank's
    /// failure text (returned), else if some layer was non-finite, the
    /// non-finite markers ([`agree_non_finite`](Self::agree_non_finite)).
    fn reduce_dense<C: Transport>(&mut self, comm: &C) -> Result<Option<Vec<String>>> {
        let t = Instant::now();
        let algo = self.script.reduce_algo;
        // MPI's own allreduce can only sum: its average is taken in the
        // unpacking's pass over the result instead of one of its own. The
        // status words below are read as "nonzero", sum or average.
        self.buf.dense_summed = algo == AllreduceAlgo::Mpi;
        let opts = AllreduceOptions {
            op: if self.buf.dense_summed {
                ReduceOp::Sum
            } else {
                ReduceOp::Average
            },
            // The layer table was checked at registration.
            validate: false,
            chunk_elems: 0,
        };
        allreduce_with(comm, &mut self.buf.dense, algo, &opts, &mut self.buf.ws)?;
        self.out.allreduce_s = t.elapsed().as_secs_f64();
        // The status word: the fraction of ranks that failed.
        let status = &self.buf.dense[self.script.dense_len..];
        let non_finite = self.script.status_len > 1 && status[1] != 0.0;
        if status[0] != 0.0 {
            let mine = self.script.local_failed.clone().unwrap_or_default();
            let g =
                crate::dense::allgatherv(comm, mine.as_bytes(), AllgathervAlgo::RecursiveDoubling)?;
            return Ok(Some(
                (0..g.len())
                    .map(|r| String::from_utf8_lossy(g.message(r)).into_owned())
                    .collect(),
            ));
        } else if non_finite {
            self.agree_non_finite(comm)?;
        }
        Ok(None)
    }

    /// Every rank's failure `texts` (empty = ok) as the step's
    /// `RankFailed`, the same on every rank.
    fn rank_failed(&self, texts: &[String]) -> Error {
        crate::comm::agree::rank_failed(texts, self.script.step).unwrap_or_else(|| {
            Error::RankFailed {
                rank: 0,
                others: 0,
                failed: vec![0],
                step: self.script.step,
                message: "(a rank flagged a failure without a message)".into(),
            }
        })
    }

    /// The sparse allreduce of the reduced layers' pairs into `sp_out`.
    fn reduce_pairs<C: Transport>(&mut self, comm: &C) -> Result<()> {
        let t = Instant::now();
        let opts = SparseAllreduceOptions {
            gather: self.script.reduce_gather_algo,
            ..SparseAllreduceOptions::default()
        };
        self.buf.sp_out.resize(self.script.sp_n, 0.0);
        self.out.sparse_reduce_nnz = reduce_sparse(
            comm,
            (self.script.exchange, &self.buf.nodes),
            self.script.sp_n,
            &self.buf.sp_idx,
            &self.buf.sp_val,
            &mut self.buf.sp_out,
            &opts,
            &mut self.buf.hier_ws,
        )?;
        self.out.sparse_reduce_s = t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Each GradiVeQ layer's ring, in layer order (when the plan runs
    /// them), timed into `gvq_s`.
    fn run_rings<C: Transport>(&mut self, comm: &C) -> Result<()> {
        let t = Instant::now();
        if self.script.do_gvq {
            for e in &mut self.buf.gvq {
                let st = e.state.as_mut().ok_or_else(|| {
                    Error::Transport("GradiVeQ state missing from the job".into())
                })?;
                // An error inside the ring (a segment's QSGD norm that
                // overflows f32) ends the job: name the layer.
                st.step(comm, &e.input, &mut e.output)
                    .map_err(|err| match err {
                        Error::InvalidArgument(m) => {
                            Error::InvalidArgument(format!("GradiVeQ layer {:?}: {m}", e.name))
                        }
                        other => other,
                    })?;
            }
        }
        self.out.gvq_s = t.elapsed().as_secs_f64();
        Ok(())
    }

    /// The PowerSGD layers' step (when the plan runs them): every layer's
    /// `P = M Q` into one buffer, one allreduce (sum); each `P`
    /// orthogonalized and `Q = Mᵀ P` into another, one allreduce (sum);
    /// each layer's `M̂ = P Qᵀ / p` into its output, the error kept
    /// ([`crate::powersgd`]). The same bits on every rank: the sums are,
    /// and the rest is the same arithmetic on them. Timed into `psg_s`.
    fn run_powersgd<C: Transport>(&mut self, comm: &C) -> Result<()> {
        let t = Instant::now();
        if !self.script.do_psg {
            self.out.psg_s = 0.0;
            return Ok(());
        }
        let missing = || Error::Transport("PowerSGD state missing from the job".into());
        let (mut np, mut nq) = (0, 0);
        for e in &self.buf.psg {
            let (p, q) = e.state.as_ref().ok_or_else(missing)?.factor_lens();
            np += p;
            nq += q;
        }
        self.buf.psg_p.resize(np, 0.0);
        self.buf.psg_q.resize(nq, 0.0);
        let opts = AllreduceOptions {
            op: ReduceOp::Sum,
            validate: false,
            chunk_elems: 0,
        };
        // Every rank must get the same bits (each orthogonalizes its sum):
        // the decision table's algorithm gives them.
        let algo = self.script.factor_algo;
        let mut off = 0;
        for e in &mut self.buf.psg {
            let st = e.state.as_mut().ok_or_else(missing)?;
            let n = st.factor_lens().0;
            st.begin(&e.input, &mut self.buf.psg_p[off..off + n])?;
            off += n;
        }
        allreduce_with(comm, &mut self.buf.psg_p, algo, &opts, &mut self.buf.ws)?;
        let (mut op, mut oq) = (0, 0);
        for e in &mut self.buf.psg {
            let st = e.state.as_mut().ok_or_else(missing)?;
            let (p, q) = st.factor_lens();
            st.after_p(&self.buf.psg_p[op..op + p], &mut self.buf.psg_q[oq..oq + q])?;
            op += p;
            oq += q;
        }
        allreduce_with(comm, &mut self.buf.psg_q, algo, &opts, &mut self.buf.ws)?;
        let mut oq = 0;
        for e in &mut self.buf.psg {
            let st = e.state.as_mut().ok_or_else(missing)?;
            let q = st.factor_lens().1;
            e.output.resize(e.input.len(), 0.0);
            st.after_q(&self.buf.psg_q[oq..oq + q], comm.size(), &mut e.output)?;
            oq += q;
        }
        self.out.psg_s = t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Some rank's reduced layer was non-finite: every rank's positions of
    /// such layers, by one small allgatherv, into `sp_bad_rank` (the
    /// lowest rank per layer, as `unpack_layer` reports it).
    fn agree_non_finite<C: Transport>(&mut self, comm: &C) -> Result<()> {
        // Reduced layers by position; dense layers by id, high bit set.
        let mine: Vec<u8> = self
            .buf
            .sp_nonfinite
            .iter()
            .copied()
            .chain(self.buf.dn_nonfinite.iter().map(|&i| i | DENSE_MARK))
            .flat_map(|p| p.to_le_bytes())
            .collect();
        let g = crate::dense::allgatherv(comm, &mine, AllgathervAlgo::RecursiveDoubling)?;
        let bad = |rank: usize, reason: String| Error::PeerMessage {
            rank,
            layer: "<non-finite markers>".into(),
            reason,
        };
        let layers = self.buf.sp_bad_rank.len();
        for r in 0..g.len() {
            let m = g.message(r);
            if m.len() % 4 != 0 {
                return Err(bad(r, format!("{} bytes", m.len())));
            }
            for c in m.chunks_exact(4) {
                let word = u32::from_le_bytes(c.try_into().expect("4 bytes"));
                let pos = (word & !DENSE_MARK) as usize;
                let slot = if word & DENSE_MARK != 0 {
                    let n = self.buf.dn_bad_rank.len();
                    self.buf
                        .dn_bad_rank
                        .get_mut(pos)
                        .ok_or_else(|| bad(r, format!("dense layer {pos} of {n} layers")))?
                } else {
                    self.buf.sp_bad_rank.get_mut(pos).ok_or_else(|| {
                        bad(
                            r,
                            format!("layer position {pos} of {layers} reduced layers"),
                        )
                    })?
                };
                slot.get_or_insert(r);
            }
        }
        Ok(())
    }

    /// This rank's pairs of the plan's reduced layers (see the module
    /// docs): global index and value · 1/p, layer after layer; the
    /// non-finite layers' positions instead of their pairs. Part of the
    /// local phase: an error here is this rank's alone.
    pub(super) fn collect_pairs(
        &mut self,
        plan: &StepScript,
        layers: &[Layer],
        ranks: usize,
    ) -> Result<()> {
        self.buf.sp_idx.clear();
        self.buf.sp_val.clear();
        self.buf.sp_nonfinite.clear();
        self.buf.sp_layer_pairs.clear();
        self.buf.sp_layer_pairs.resize(plan.reduced.ids.len(), 0);
        self.script.sp_n = plan.reduced.elems;
        if plan.reduced.ids.is_empty() {
            return Ok(());
        }
        if u32::try_from(plan.reduced.elems).is_err() {
            return Err(Error::InvalidArgument(format!(
                "the sparse allreduce's layers hold {} elements in all, more than 32-bit \
                 indices address; use sparse_exchange \"allgather\"",
                plan.reduced.elems
            )));
        }
        let inv = 1.0 / ranks as f32;
        for (pos, &id) in plan.reduced.ids.iter().enumerate() {
            let l = &layers[id as usize];
            if l.non_finite {
                self.buf.sp_nonfinite.push(pos as u32);
                continue;
            }
            let off = plan.layers[id as usize].reduce_off as u32;
            let codec = l.codec.as_deref().ok_or_else(|| {
                Error::InvalidArgument(format!("layer {:?}: reduced without a codec", l.name))
            })?;
            let (idx, val) = (&mut self.buf.sp_idx, &mut self.buf.sp_val);
            let before = idx.len();
            let pairs = codec.for_each_sent(&l.unit, l.n, &mut |i, v| {
                idx.push(off + i as u32);
                // `unpack_layer` adds `scale · v` to a zeroed accumulator.
                val.push(inv * v + 0.0);
            })?;
            if !pairs {
                return Err(Error::InvalidArgument(format!(
                    "layer {:?}: codec {} does not send index/value pairs",
                    l.name,
                    codec.config().name()
                )));
            }
            self.buf.sp_layer_pairs[pos] = self.buf.sp_idx.len() - before;
        }
        Ok(())
    }
}

/// The sparse allreduce of the reduced layers by `exchange`: the exact sum
/// of every rank's pairs `(idx, vals)` (indices in `[0, n)`) written into
/// `out` (length `n`, overwritten), and the number of distinct indices of
/// the result. At one rank: this rank's pairs, without communication.
#[allow(clippy::too_many_arguments)]
fn reduce_sparse<C: Transport>(
    comm: &C,
    (exchange, nodes): (SparseExchange, &[usize]),
    n: usize,
    idx: &[u32],
    vals: &[f32],
    out: &mut [f32],
    opts: &SparseAllreduceOptions,
    ws: &mut HierarchicalWorkspace,
) -> Result<usize> {
    if comm.size() == 1 {
        out.fill(0.0);
        for (&i, &v) in idx.iter().zip(vals) {
            let o = out.get_mut(i as usize).ok_or_else(|| {
                Error::InvalidArgument(format!("sparse index {i} out of range for n = {n}"))
            })?;
            *o += v;
        }
        let mut distinct = idx.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        return Ok(distinct.len());
    }
    match exchange {
        SparseExchange::Allreduce => {
            let report = sparse_allreduce(comm, n, idx, vals, out, opts)?;
            Ok(report.region_nnz.iter().sum())
        }
        SparseExchange::Hierarchical => {
            let report =
                hierarchical_sparse_allreduce_with(comm, n, nodes, idx, vals, out, opts, ws)?;
            Ok(report.result_nnz)
        }
        SparseExchange::Allgather => Err(Error::InvalidArgument(
            "the fused allgatherv reduces no layer".into(),
        )),
    }
}

impl Job {
    /// Pack the step as `plan` says: the dense status word after the fused
    /// dense buffer (filled by the local phase), this rank's fused sparse
    /// message (or its failure marker when `local` failed), and the
    /// collectives to run.
    pub(super) fn pack(&mut self, plan: &StepScript, layers: &[Layer], local: &Result<()>) {
        let step = plan.step;
        let dense_len = plan.dense.elems;
        // Dense layers: the status words after the fused buffer (0 = ok):
        // this rank failed; a reduced or dense layer was non-finite here
        // (module docs).
        self.buf.dn_nonfinite.clear();
        self.buf.dn_nonfinite.extend(
            plan.layers
                .iter()
                .zip(layers)
                .enumerate()
                .filter(|(_, (lp, l))| matches!(lp.mode, Mode::Dense | Mode::Local) && l.non_finite)
                .map(|(i, _)| i as u32),
        );
        self.script.status_len = 2;
        self.buf
            .dense
            .resize(dense_len + self.script.status_len, 0.0);
        self.buf.dense[dense_len] = if local.is_err() { 1.0 } else { 0.0 };
        let nf = local.is_ok()
            && !(self.buf.sp_nonfinite.is_empty() && self.buf.dn_nonfinite.is_empty());
        self.buf.dense[dense_len + 1] = if nf { 1.0 } else { 0.0 };
        if local.is_err() {
            // Nothing of a failed local phase is sent.
            self.buf.sp_idx.clear();
            self.buf.sp_val.clear();
            self.buf.sp_nonfinite.clear();
            self.buf.dn_nonfinite.clear();
        }
        self.script.sp_n = plan.reduced.elems;
        self.buf.sp_bad_rank.clear();
        self.buf.sp_bad_rank.resize(plan.reduced.ids.len(), None);
        self.buf.dn_bad_rank.clear();
        self.buf.dn_bad_rank.resize(plan.layers.len(), None);
        self.script.do_sparse = plan.sparse_reduce;
        self.script.exchange = plan.exchange;
        self.out.sparse_reduce_s = 0.0;
        self.out.sparse_reduce_nnz = 0;
        self.out.probe_nnz = None;
        self.script.dense_len = dense_len;
        match local {
            Ok(()) => write_fused(
                &mut self.buf.fused,
                step,
                plan.sparse.ids.iter().map(|&i| {
                    let l = &layers[i as usize];
                    let kind = if l.non_finite {
                        EntryKind::NonFinite
                    } else {
                        EntryKind::Unit
                    };
                    (i, kind, if l.non_finite { &[][..] } else { &l.unit[..] })
                }),
            ),
            Err(e) => write_failed(&mut self.buf.fused, step, &e.to_string()),
        }
        self.script.step = Some(step);
        self.script.local_failed = local.as_ref().err().map(|e| e.to_string());
        self.script.do_gather = plan.gather;
        self.script.do_gvq = plan.rings;
        self.script.do_psg = plan.lowrank;
        self.script.do_reduce = plan.reduce;
        self.out.gvq_s = 0.0;
        self.out.psg_s = 0.0;
        self.script.gather_algo = plan.allgather;
        self.script.reduce_gather_algo = plan.reduce_allgather;
        self.script.reduce_algo = plan.allreduce;
        self.script.factor_algo = plan.factor_allreduce;
        self.out.allgather_s = 0.0;
        self.out.allreduce_s = 0.0;
        self.out.result = None;
        if !self.script.do_gather && !plan.sparse.ids.is_empty() {
            // One rank: the gathered data is our own message.
            self.buf.gathered.data.clear();
            self.buf.gathered.data.extend_from_slice(&self.buf.fused);
            self.buf.gathered.displs.clear();
            self.buf.gathered.displs.extend([0, self.buf.fused.len()]);
        }
    }
}

/// Every rank's error where the fingerprints `h` of one call differ (a
/// collective on that path only): `what`, naming the lowest rank whose
/// fingerprint differs from rank 0's.
fn mismatch<C: Transport>(comm: &C, h: u64, what: &str) -> Result<Error> {
    let odd = first_rank_differing(comm, crate::comm::tags::AGREE, h)?;
    Ok(Error::ArgumentMismatch(format!(
        "{what} (rank {odd} passed other values than rank 0)"
    )))
}
