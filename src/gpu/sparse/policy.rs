//! Which entries each layer sends: the host selection's policy
//! ([`crate::select`]: Algorithm 2's trimmed top-k, Algorithm 3's binary
//! search with Algorithm 5's threshold reuse, the exact top-k) driven by
//! counts from [`SparseOps`], so that the device's passes decide exactly
//! what the host's loops decide.
//!
//! Every layer advances in the same rounds: each round is one
//! [`SparseOps::count_above`] pass in which every undecided layer counts
//! up to [`MAX_T`] thresholds: the five of Algorithm 2, the one reused
//! threshold, or the next five levels of Algorithm 3's search tree (31
//! ratios; the walk through them is the host loop's, step for step,
//! including its `ε` stop and its 64-step cap). Then one
//! [`SparseOps::compact`] pass takes every layer's entries above its
//! threshold; trimmed and exact top-k reduce those candidates to `k` on
//! the host, as [`crate::select::trimmed_topk`] does.

use super::{AbsStats, Compacted, SparseOps, MAX_T};
use crate::select::{DEFAULT_INTERVAL, DEFAULT_SEARCH_EPS, TRIM_EPS};
use crate::Result;
use std::collections::HashMap;

/// Selection method of the device step (the host's [`crate::codec::RgcMethod`]
/// but `sampled`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// Exact top-k (every non-NaN element is a candidate: the layer
    /// crosses to the host whole; for checks, not for speed).
    Exact,
    /// Trimmed top-k (Algorithm 2), exactly `k` entries.
    Trimmed,
    /// Binary search (Algorithm 3) with the threshold reused for the next
    /// `interval` steps.
    Threshold {
        /// Steps that reuse a found threshold.
        interval: u32,
        /// The search's termination width on the ratio.
        eps: f64,
    },
}

impl Method {
    /// The host's `rgc` method of the same name, with the host's defaults.
    pub fn from_rgc(m: crate::codec::RgcMethod) -> Option<Method> {
        use crate::codec::RgcMethod as R;
        match m {
            R::Exact => Some(Method::Exact),
            R::Trimmed => Some(Method::Trimmed),
            R::Threshold => Some(Method::Threshold {
                interval: DEFAULT_INTERVAL,
                eps: DEFAULT_SEARCH_EPS,
            }),
            R::Sampled => None,
        }
    }
}

/// One layer's selection state across steps (the reused threshold).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerState {
    n: usize,
    k: usize,
    method: Method,
    threshold: Option<f32>,
    reuse_left: u32,
    /// Searches run (Algorithm 3).
    pub searches: u64,
}

impl LayerState {
    /// A layer of `n` elements sending `k`, with no threshold yet.
    pub fn new(n: usize, k: usize, method: Method) -> Self {
        LayerState {
            n,
            k,
            method,
            threshold: None,
            reuse_left: 0,
            searches: 0,
        }
    }
}

/// A step's selection.
pub struct Selection {
    /// What each layer sends.
    pub entries: Compacted,
    /// Layers whose residual overflowed f32 (to be cleared; nothing sent).
    pub overflowed: Vec<usize>,
    /// Counting passes run.
    pub count_passes: usize,
    /// Bytes the selection read back from the device.
    pub to_host_bytes: usize,
}

/// What a layer does next.
enum Plan {
    /// Nothing to send (k = 0, empty, overflowed).
    Nothing,
    /// Candidates above `t`; `topk`: reduce them to the k largest.
    Take {
        t: f32,
        topk: bool,
        store: Store,
    },
    /// Count these thresholds next round.
    Trim,
    Search(Search),
}

/// What a threshold layer keeps after this step's compaction.
#[derive(Clone, Copy)]
enum Store {
    /// Nothing changes (trimmed, exact, trivial).
    No,
    /// The reused threshold, one use spent (already counted).
    Reused,
    /// A search found `t`: keep it, reuse `interval` times.
    Found,
    /// The search failed: keep `next_down` of the k-th magnitude.
    Fallback,
}

/// Algorithm 3's loop state, between rounds.
struct Search {
    l: f64,
    r: f64,
    iters: u32,
    last: Option<(f32, u64)>,
    mean: f64,
    max: f64,
}

fn threshold_at(mean: f64, max: f64, ratio: f64) -> f32 {
    (mean + ratio * (max - mean)) as f32
}

/// The largest f32 below `v` (`v ≥ 0`, as in [`crate::select`]).
pub(crate) fn next_down(v: f32) -> f32 {
    if v == 0.0 {
        -f32::from_bits(1)
    } else {
        f32::from_bits(v.to_bits() - 1)
    }
}

const TRIM_STEPS: usize = (1.0 / TRIM_EPS + 0.5) as usize;
/// Levels of the search tree counted per pass: 2^5 − 1 = 31 ratios.
const LEVELS: u32 = 5;

fn trim_thresholds(s: &AbsStats) -> Vec<f32> {
    let (mean, max) = mean_max(s);
    (0..TRIM_STEPS)
        .map(|j| threshold_at(mean, max, (1.0 - (j + 1) as f64 * TRIM_EPS).max(0.0)))
        .collect()
}

fn mean_max(s: &AbsStats) -> (f64, f64) {
    let mean = if s.count == 0 {
        0.0
    } else {
        s.sum / s.count as f64
    };
    (mean, f64::from(s.max))
}

impl Search {
    /// The ratios of the next `LEVELS` levels below the current interval.
    fn ratios(&self, eps: f64, out: &mut Vec<f64>) {
        fn node(l: f64, r: f64, depth: u32, iters: u32, eps: f64, out: &mut Vec<f64>) {
            if depth == 0 || iters >= 64 || r - l <= eps {
                return;
            }
            let ratio = l + (r - l) / 2.0;
            out.push(ratio);
            node(l, ratio, depth - 1, iters + 1, eps, out);
            node(ratio, r, depth - 1, iters + 1, eps, out);
        }
        node(self.l, self.r, LEVELS, self.iters, eps, out);
    }

    /// The host loop, as far as `counts` (by ratio bits) reach: `Some`
    /// when it ended (with its threshold, or `None` for the fallback).
    fn walk(
        &mut self,
        k: usize,
        eps: f64,
        counts: &HashMap<u64, (f32, u64)>,
    ) -> Option<Option<f32>> {
        let hi = k.saturating_mul(2) as u64;
        let k = k as u64;
        loop {
            if self.iters >= 64 || self.r - self.l <= eps {
                return Some(match self.last {
                    Some((t, nnz)) if nnz >= k => Some(t),
                    _ => None,
                });
            }
            let ratio = self.l + (self.r - self.l) / 2.0;
            let &(t, nnz) = counts.get(&ratio.to_bits())?;
            self.iters += 1;
            self.last = Some((t, nnz));
            if (k..=hi).contains(&nnz) {
                return Some(Some(t));
            } else if nnz < k {
                self.r = ratio;
            } else {
                self.l = ratio;
            }
        }
    }
}

/// Count `want[l]` (any order, NaN allowed: counts 0) for every layer in
/// one pass: `counts[l][j]` for `want[l][j]`.
fn count_round<O: SparseOps + ?Sized>(ops: &mut O, want: &[Vec<f32>]) -> Result<Vec<Vec<u64>>> {
    let sorted: Vec<Vec<f32>> = want
        .iter()
        .map(|w| {
            let mut s: Vec<f32> = w.iter().copied().filter(|t| !t.is_nan()).collect();
            s.sort_by(f32::total_cmp);
            s.dedup_by(|a, b| a.to_bits() == b.to_bits() || a == b);
            debug_assert!(s.len() <= MAX_T);
            s
        })
        .collect();
    let counts = ops.count_above(&sorted)?;
    Ok(want
        .iter()
        .zip(&sorted)
        .zip(&counts)
        .map(|((w, s), c)| {
            w.iter()
                .map(|t| {
                    if t.is_nan() {
                        return 0;
                    }
                    // The first sorted threshold equal to t.
                    let j = s.partition_point(|x| x < t);
                    c[j]
                })
                .collect()
        })
        .collect())
}

/// Choose and read back every layer's entries for this step, advancing
/// the layers' thresholds as the host selection would.
///
/// A reused threshold goes straight to the compaction, whose count is the
/// host's check (at most `2k` entries, else search again): no counting
/// pass for it. Layers whose reused threshold passed too many search and
/// are compacted a second time (their first entries dropped).
pub fn select<O: SparseOps + ?Sized>(ops: &mut O, layers: &mut [LayerState]) -> Result<Selection> {
    let stats = ops.stats()?;
    let mut overflowed = Vec::new();
    let mut plans: Vec<Plan> = Vec::with_capacity(layers.len());
    for (l, (ls, s)) in layers.iter_mut().zip(&stats).enumerate() {
        // The host encoder refuses a non-finite residual (its statistics
        // pass tells), and the engine clears it.
        let finite = s.count == ls.n as u64 && s.max.is_finite();
        if !finite {
            overflowed.push(l);
            plans.push(Plan::Nothing);
            continue;
        }
        plans.push(first_plan(ls, s));
    }
    let mut sel = Selection {
        entries: Compacted::default(),
        overflowed,
        count_passes: 0,
        to_host_bytes: 16 * stats.len(),
    };
    rounds(ops, layers, &stats, &mut plans, &mut sel)?;
    let mut got = take(ops, layers, &plans, &mut sel)?;
    // Reused thresholds that passed more than 2k: search again.
    let mut again = false;
    for (l, p) in plans.iter_mut().enumerate() {
        let ls = &mut layers[l];
        let redo = matches!(
            p,
            Plan::Take {
                store: Store::Reused,
                ..
            }
        ) && got[l].0.len() > ls.k.saturating_mul(2);
        *p = if redo {
            ls.threshold = None;
            ls.reuse_left = 0;
            again = true;
            search_or_exact(ls, &stats[l])
        } else {
            Plan::Nothing
        };
    }
    if again {
        rounds(ops, layers, &stats, &mut plans, &mut sel)?;
        let redo = take(ops, layers, &plans, &mut sel)?;
        for (l, p) in plans.iter().enumerate() {
            if matches!(p, Plan::Take { .. }) {
                got[l] = redo[l].clone();
            }
        }
    }
    for (idx, val) in got {
        sel.entries.counts.push(idx.len());
        sel.entries.idx.extend_from_slice(&idx);
        sel.entries.val.extend_from_slice(&val);
    }
    Ok(sel)
}

/// Counting rounds until every layer is at `Take` or `Nothing`.
fn rounds<O: SparseOps + ?Sized>(
    ops: &mut O,
    layers: &mut [LayerState],
    stats: &[AbsStats],
    plans: &mut [Plan],
    sel: &mut Selection,
) -> Result<()> {
    loop {
        let mut want = vec![Vec::new(); layers.len()];
        let mut any = false;
        for (l, p) in plans.iter().enumerate() {
            match p {
                Plan::Trim => want[l] = trim_thresholds(&stats[l]),
                Plan::Search(s) => {
                    let mut r = Vec::new();
                    let Method::Threshold { eps, .. } = layers[l].method else {
                        unreachable!("only threshold layers search")
                    };
                    s.ratios(eps, &mut r);
                    want[l] = r.iter().map(|&q| threshold_at(s.mean, s.max, q)).collect();
                }
                _ => continue,
            }
            any = true;
        }
        if !any {
            return Ok(());
        }
        let counts = count_round(ops, &want)?;
        sel.count_passes += 1;
        sel.to_host_bytes += 8 * (MAX_T + 1) * layers.len();
        for (l, p) in plans.iter_mut().enumerate() {
            let ls = &mut layers[l];
            let c = &counts[l];
            let next = match std::mem::replace(p, Plan::Nothing) {
                Plan::Trim => {
                    let t = want[l]
                        .iter()
                        .zip(c)
                        .find(|(_, &n)| n >= ls.k as u64)
                        .map_or(f32::NEG_INFINITY, |(&t, _)| t);
                    Plan::Take {
                        t,
                        topk: true,
                        store: Store::No,
                    }
                }
                Plan::Search(mut s) => {
                    let Method::Threshold { eps, .. } = ls.method else {
                        unreachable!("only threshold layers search")
                    };
                    let mut r = Vec::new();
                    s.ratios(eps, &mut r);
                    let map: HashMap<u64, (f32, u64)> = r
                        .iter()
                        .zip(&want[l])
                        .zip(c)
                        .map(|((q, &t), &n)| (q.to_bits(), (t, n)))
                        .collect();
                    match s.walk(ls.k, eps, &map) {
                        None => Plan::Search(s),
                        Some(Some(t)) => Plan::Take {
                            t,
                            topk: false,
                            store: Store::Found,
                        },
                        Some(None) => Plan::Take {
                            t: next_down(0.0),
                            topk: true,
                            store: Store::Fallback,
                        },
                    }
                }
                other => other,
            };
            *p = next;
        }
    }
}

/// One compaction of every `Take` layer (the others take nothing), the
/// top-k of the candidates where asked, and the thresholds remembered.
fn take<O: SparseOps + ?Sized>(
    ops: &mut O,
    layers: &mut [LayerState],
    plans: &[Plan],
    sel: &mut Selection,
) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
    let thr: Vec<f32> = plans
        .iter()
        .map(|p| match p {
            Plan::Take { t, .. } => *t,
            _ => f32::INFINITY,
        })
        .collect();
    let got = ops.compact(&thr)?;
    sel.to_host_bytes += 8 * got.idx.len() + 8 * layers.len();
    let mut out = Vec::with_capacity(layers.len());
    let mut at = 0;
    let mut mags = Vec::new();
    for (l, p) in plans.iter().enumerate() {
        let c = got.counts[l];
        let mut idx = got.idx[at..at + c].to_vec();
        let mut val = got.val[at..at + c].to_vec();
        at += c;
        let ls = &mut layers[l];
        if let Plan::Take { t, topk, store } = p {
            if *topk {
                crate::select::topk_of_candidates(ls.k, &mut idx, &mut val, &mut mags);
            }
            match store {
                Store::No | Store::Reused => {}
                Store::Found => remember(ls, *t),
                Store::Fallback => {
                    let kth = val.iter().map(|v| v.abs()).fold(f32::INFINITY, f32::min);
                    remember(ls, next_down(kth));
                }
            }
        }
        out.push((idx, val));
    }
    Ok(out)
}

fn remember(ls: &mut LayerState, t: f32) {
    if let Method::Threshold { interval, .. } = ls.method {
        ls.threshold = Some(t);
        ls.reuse_left = interval;
        ls.searches += 1;
    }
}

/// The first round's plan of a finite layer.
fn first_plan(ls: &mut LayerState, s: &AbsStats) -> Plan {
    if ls.k == 0 || ls.n == 0 {
        return Plan::Nothing;
    }
    match ls.method {
        Method::Exact => Plan::Take {
            t: next_down(0.0),
            topk: true,
            store: Store::No,
        },
        Method::Trimmed => {
            if ls.k as u64 >= s.count {
                Plan::Take {
                    t: next_down(0.0),
                    topk: true,
                    store: Store::No,
                }
            } else {
                Plan::Trim
            }
        }
        Method::Threshold { .. } => match ls.threshold {
            // Straight to the compaction: its count is the check.
            Some(t) if ls.reuse_left > 0 => {
                ls.reuse_left -= 1;
                Plan::Take {
                    t,
                    topk: false,
                    store: Store::Reused,
                }
            }
            _ => search_or_exact(ls, s),
        },
    }
}

/// Algorithm 3 from the start, or the exact top-k when `k ≥ m` (which, as
/// on the host, keeps no threshold).
fn search_or_exact(ls: &LayerState, s: &AbsStats) -> Plan {
    if ls.k as u64 >= s.count {
        return Plan::Take {
            t: next_down(0.0),
            topk: true,
            store: Store::No,
        };
    }
    let (mean, max) = mean_max(s);
    Plan::Search(Search {
        l: 0.0,
        r: 1.0,
        iters: 0,
        last: None,
        mean,
        max,
    })
}
