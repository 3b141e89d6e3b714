//! The two-level network: ranks placed `L` per node, shared
//! memory inside a node, one network link per node between nodes, and the
//! node-aware and O(k) strategies that only pay off there.
//!
//! A profile's `alpha`/`beta`/`beta_curve` describe one pair of ranks
//! exchanging alone (inside a node when the job that calibrated it spanned
//! several nodes); [`Profile::inter_node`] the same for a pair on two
//! different nodes. Ranks are placed in blocks (`mpirun --map-by
//! ppr:L:node`, Slurm's default block distribution): rank `r` is on node
//! `⌊r/L⌋`. A step of a collective in which `c` ranks of one node exchange
//! `m` bytes each with ranks of other nodes, all at once, shares that
//! node's link `c` ways:
//!
//! `T_step = α_inter + c·m·β_inter(m)`, else (every pair inside its node)
//! `α + m·β(m)`.
//!
//! The step's `c` is the largest over the nodes, counted from the
//! algorithm's own partner schedule (computed once per `(p, L)`):
//!
//! | algorithm | partners at step `i` | source |
//! |---|---|---|
//! | Rabenseifner | virtual rank `v ⊕ 2^i` (distance 1 first) after the fold of the first `2r` ranks into pairs | Thakur et al. §4.4; [`crate::dense`] |
//! | allgather (the allgatherv) | `r ⊕ 2^i` for a power of two; otherwise Bruck's `r − 2^i` (send) and `r + 2^i` (receive) | Thakur et al. §4.1; [`crate::dense::allgatherv`] |
//! | ring | `r → r + 1`: one rank per node crosses (`c = 1`), one way on each connection ([`NetLevel::oneway_curve`]) | Thakur et al. §4.3 |
//! | sparse allreduce (split and reduce) | round `s`: `r → r + s` | Ok-Topk; [`crate::sparse::allreduce`] |
//!
//! and the node-aware algorithms are costed by their phases:
//!
//! * `dense-hierarchical` ([`crate::dense::hierarchical_allreduce`]): a
//!   ring reduce-scatter inside each node (`L − 1` steps of `N/S`, `S` the
//!   smallest node's ranks), Rabenseifner among the `H` nodes on each
//!   shard of `N/S` bytes with all `S` shards crossing at once (`c = S`),
//!   the ring allgather inside the node;
//! * the node-aware allgatherv ([`crate::dense::AllgathervAlgo::Node`]):
//!   `L − 1` messages into the node's leader, the leaders' allgather of
//!   the `L·m`-byte node blocks over the `H` nodes (one rank per node
//!   crosses), a binomial broadcast of the `p·m`-byte result inside the
//!   node (`allgather_node`);
//! * `sparse-allreduce` ([`crate::sparse::sparse_allreduce`]): its
//!   agreement and sample allgather (`2⌈lg p⌉·α`), `p − 1` rounds of
//!   pairwise exchange (two messages each: the count, then `k/p` pairs of
//!   8 bytes), then the recursive-doubling allgather of each region's
//!   reduced result, `F/p` pairs (`F` the fill-in, below) or its `n/p`
//!   dense values when that is smaller (SparCML's switch);
//! * `sparse-hierarchical` (the node-aware sparse allreduce of
//!   [`crate::sparse`]): the `L − 1` other ranks of a node send their `k`
//!   pairs to its leader, the leaders allgather the merged node units
//!   (`F_L` pairs each: the fill-in of `L` ranks) by recursive doubling
//!   over the `H` nodes (one rank per node crosses), and each leader
//!   broadcasts the `H` units inside its node (binomial tree).
//!
//! Both sparse allreduces also pay their local work: summing the received
//! pairs and results at γ_unpack per byte (at the output's size,
//! [`Profile::gamma_unpack_at`]: an output of a whole group is far larger
//! than the caches), and clearing their `n`-element
//! dense result, `4n·γ_clear` ([`Profile::gamma_clear_at`] at the output's
//! size: memset is cheaper per byte past the caches; at density 0.001
//! on the emulated cluster that is a third of the node-aware path's time,
//! docs/benchmarks/cluster.md). The fused allgather's clearing is its layers', in
//! their selection fits.
//!
//! **Fill-in.** The sum of `j` ranks' selections of `k` of `n` indices has
//! `F(j)` distinct indices: `n·(1 − (1 − k/n)^j)` when the selections are
//! independent (the most a sparse allreduce can carry, and what random
//! data gives); gradients selected by magnitude overlap more. A measured
//! fill ratio `ρ = F(p)/(p·k)` (the engine reports `F(p)` each step) gives
//! `F(j) = clamp(ρ·j·k, k, n)` instead ([`Placement::fill`](super::Placement::fill)).
//!
//! **Burst credit.** A link shaped by a token bucket ([`Burst`]: a cloud
//! VM's, the emulated cluster's) moves the first bytes after an idle spell
//! faster than its sustained rate. Each collective starts with the whole
//! credit (a training step's forward and backward pass leave the link
//! idle), and its inter-node steps spend it in schedule order: the first
//! `bytes` of `c·m` on a node's link cost `β_burst` each instead of
//! `β_inter(m)`.
//!
//! A profile without [`Profile::inter_node`], or one node (`L ≥ p`), is
//! the one-level model of [`super`]: exactly the closed forms there.

/// The link between nodes as the profile holds it, which this module's
/// schedules price (also `cost::NetLevel` and `cost::Burst`).
pub use super::profile::{Burst, NetLevel};
use super::query::StepQuery;
use super::{ceil_lg, Profile};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// The placement a prediction is made for: `p` ranks, `l` per node.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Net<'a> {
    pub prof: &'a Profile,
    pub p: usize,
    /// Ranks per node (`≥ p`: one node).
    pub l: usize,
    /// Measured fill ratio of the sparse allreduces, if any.
    pub fill: Option<f64>,
    /// The fused message's allgatherv ([`Placement::allgather`](super::Placement::allgather)).
    pub gather: crate::strategy::Pick<crate::dense::AllgathervAlgo>,
    /// Bytes of the link's [`Burst`] credit the current collective has not
    /// spent yet (each collective's entry point refills it).
    credit: Cell<f64>,
}

impl<'a> Net<'a> {
    /// The placement of `q` (one node without `ranks_per_node`).
    pub fn of(prof: &'a Profile, q: &StepQuery) -> Self {
        Self::new(prof, q.at.p, q.at.ranks_per_node, q.at.fill).with_gather(q.at.allgather)
    }

    /// The same placement with the fused message's allgatherv `gather`.
    pub fn with_gather(self, gather: crate::strategy::Pick<crate::dense::AllgathervAlgo>) -> Self {
        Net { gather, ..self }
    }

    /// `p` ranks, `ranks_per_node` per node (one node without it).
    pub fn new(
        prof: &'a Profile,
        p: usize,
        ranks_per_node: Option<usize>,
        fill: Option<f64>,
    ) -> Self {
        Net {
            prof,
            p,
            l: ranks_per_node.unwrap_or(p).max(1),
            fill,
            gather: crate::strategy::Pick::Auto,
            credit: Cell::new(0.0),
        }
    }

    /// The same placement with the fill ratio `fill`.
    #[cfg(test)]
    pub fn with_fill(&self, fill: Option<f64>) -> Self {
        Net {
            fill,
            ..self.clone()
        }
    }

    /// A collective starts on a link that has idled: its whole burst
    /// credit is there.
    fn refill(&self) {
        let b = self.prof.inter_node.as_ref().and_then(|e| e.burst);
        self.credit.set(b.map_or(0.0, |b| b.bytes));
    }

    /// Seconds the credit takes off `bytes` crossing at `beta` per byte
    /// (and spends that much of it).
    fn spend(&self, bytes: f64, beta: f64) -> f64 {
        let Some(b) = self.prof.inter_node.as_ref().and_then(|e| e.burst) else {
            return 0.0;
        };
        let left = self.credit.get();
        let x = bytes.min(left).max(0.0);
        self.credit.set(left - x);
        x * (beta - b.beta).max(0.0)
    }

    /// Whether the two-level model applies: several nodes and a profile
    /// that knows the link between them.
    pub fn two_level(&self) -> bool {
        self.l < self.p && self.prof.inter_node.is_some()
    }

    /// One exchange step of `m` bytes each way in which `c` ranks of a
    /// node cross to other nodes (`c = 0`: every pair inside its node).
    /// The `c·m` bytes on each node's link first spend what is left of
    /// the link's [`Burst`] credit.
    pub fn step(&self, m: f64, c: usize) -> f64 {
        self.steps(1.0, m, c)
    }

    /// `count` steps of [`Net::step`] one after the other (the credit
    /// spent by the first of them; O(1): a ring has `2(p − 1)` steps).
    pub fn steps(&self, count: f64, m: f64, c: usize) -> f64 {
        self.repeat(count, m, c, false)
    }

    /// `count` rounds of two steps, `m1` then `m2` bytes, `c` ranks of a
    /// node crossing: `count` times `step(m1, c) + step(m2, c)`, the
    /// credit spent in that order, in O(1).
    pub fn rounds(&self, count: usize, m1: f64, m2: f64, c: usize) -> f64 {
        let left = self.credit.get();
        self.credit.set(0.0);
        let n = count as f64;
        let base = self.steps(n, m1, c) + self.steps(n, m2, c);
        self.credit.set(left);
        let (Some(e), true) = (self.prof.inter_node.as_ref(), c > 0 && self.l < self.p) else {
            return base;
        };
        let Some(burst) = e.burst else {
            return base;
        };
        let (a, b) = (c as f64 * m1, c as f64 * m2);
        let (da, db) = (
            (e.beta_at(m1) - burst.beta).max(0.0),
            (e.beta_at(m2) - burst.beta).max(0.0),
        );
        // Whole rounds on credit, then one round that spends the rest.
        let whole = if a + b > 0.0 {
            (left / (a + b)).floor().min(n)
        } else {
            n
        };
        let mut rest = (left - whole * (a + b)).max(0.0);
        let mut off = whole * (a * da + b * db);
        if whole < n {
            let x = a.min(rest);
            rest -= x;
            let y = b.min(rest);
            rest -= y;
            off += x * da + y * db;
        }
        self.credit.set(rest);
        base - off
    }

    /// `count` steps of one-way traffic (each connection carries one
    /// direction: the ring), `c` ranks of a node crossing.
    pub fn steps_oneway(&self, count: f64, m: f64, c: usize) -> f64 {
        self.repeat(count, m, c, true)
    }

    /// `count` steps at the exchange's or the one-way rate.
    fn repeat(&self, count: f64, m: f64, c: usize, oneway: bool) -> f64 {
        if count <= 0.0 {
            return 0.0;
        }
        match &self.prof.inter_node {
            Some(e) if c > 0 && self.l < self.p => {
                let beta = if oneway && !e.oneway_curve.is_empty() {
                    super::curve_time_at(&e.oneway_curve, e.beta, m)
                } else {
                    e.beta_at(m)
                };
                let bytes = c as f64 * m;
                count * (e.alpha + bytes * beta) - self.spend(count * bytes, beta)
            }
            _ => count * (self.prof.alpha + m * self.prof.beta_at(m)),
        }
    }

    /// Nodes.
    pub fn nodes(&self) -> usize {
        self.p.div_ceil(self.l)
    }
}

/// Which partner schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Sched {
    /// Recursive halving/doubling after the fold (Rabenseifner; the
    /// allgatherv when `p` is a power of two, no fold): entry `i` is step
    /// `i`'s crossing count; the last entry is the fold's.
    Doubling,
    /// Bruck's allgather (the allgatherv for `p` not a power of two): at
    /// distance `d = 1, 2, 4, … < p`, `r` sends to `r − d` and receives
    /// from `r + d`.
    Bruck,
}

/// Crossing counts by schedule, ranks and ranks per node.
type Cache = HashMap<(Sched, usize, usize), Rc<Vec<usize>>>;

thread_local! {
    static SCHEDULES: RefCell<Cache> = RefCell::new(HashMap::new());
}

/// Entries the crossing-count cache keeps before it starts over (a sweep
/// of `scale` over 8..4096 ranks needs a few dozen).
const CACHE_MAX: usize = 512;

/// The largest number of ranks of one node whose partner is on another
/// node, per step of `sched` for `p` ranks, `l` per node (cached; at most
/// [`CACHE_MAX`] placements).
fn crossings(sched: Sched, p: usize, l: usize) -> Rc<Vec<usize>> {
    SCHEDULES.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= CACHE_MAX && !c.contains_key(&(sched, p, l)) {
            c.clear();
        }
        c.entry((sched, p, l))
            .or_insert_with(|| Rc::new(compute(sched, p, l)))
            .clone()
    })
}

fn compute(sched: Sched, p: usize, l: usize) -> Vec<usize> {
    let node = |r: usize| r / l;
    let nodes = p.div_ceil(l);
    let mut count = vec![0usize; nodes];
    let mut max_of = |pairs: &mut dyn Iterator<Item = (usize, usize)>| {
        count.iter_mut().for_each(|c| *c = 0);
        for (a, b) in pairs {
            if node(a) != node(b) {
                count[node(a)] += 1;
            }
        }
        count.iter().copied().max().unwrap_or(0)
    };
    match sched {
        Sched::Doubling => {
            let f = crate::dense::Fold::new(p);
            let mut out = Vec::new();
            let mut mask = 1;
            while mask < f.p2 {
                out.push(max_of(
                    &mut (0..f.p2).map(|v| (f.real(v), f.real(v ^ mask))),
                ));
                mask <<= 1;
            }
            out.push(max_of(
                &mut (0..f.r).flat_map(|j| [(2 * j, 2 * j + 1), (2 * j + 1, 2 * j)]),
            ));
            out
        }
        // A node's ranks sending to r − d are as many as those receiving
        // from r + d: the shift by d and by p − d cross alike.
        Sched::Bruck => std::iter::successors(Some(1usize), |d| d.checked_mul(2))
            .take_while(|&d| d < p)
            .map(|d| pairwise_crossing(p, l, d))
            .collect(),
    }
}

/// The pairwise exchange's crossing counts (rank `r` sends to
/// `(r + s) mod p`, `s = 1 … p − 1`) as runs `(steps, c)` in step order.
/// Every node's count is flat (its size) for `s` in `[l, p − l]`, so one
/// run covers that middle and at most `2l` steps lie outside it: O(l) runs
/// where the list of counts had `p − 1` entries (a `scale` sweep to 2^20
/// ranks took 133 s, now 7 s).
fn pairwise_runs(p: usize, l: usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut push = |n: usize, c: usize| match runs.last_mut() {
        Some((k, c0)) if *c0 == c => *k += n,
        _ => runs.push((n, c)),
    };
    if l >= p {
        if p > 1 {
            push(p - 1, 0);
        }
        return runs;
    }
    let mut s = 1;
    while s < p {
        if s >= l && s + l <= p {
            let end = p - l;
            push(end - s + 1, pairwise_crossing(p, l, s));
            s = end + 1;
        } else {
            push(1, pairwise_crossing(p, l, s));
            s += 1;
        }
    }
    runs
}

/// Step `s` of the pairwise exchange (rank `r` sends to `(r + s) mod p`):
/// the most ranks of one node whose partner is on another node, in O(1)
/// (was a pass over every rank, O(p²) for the whole schedule). A shift is
/// the same for every block of `m` consecutive ranks: of a node's `m`,
/// `max(0, m − s)` land in it directly and `max(0, s + m − p)` after the
/// wrap; the rest cross. Full nodes have `l` ranks, the last one `p mod l`
/// when `l` does not divide `p`.
fn pairwise_crossing(p: usize, l: usize, s: usize) -> usize {
    let crossing = |m: usize| {
        let stay = m.saturating_sub(s) + (s + m).saturating_sub(p);
        m - stay.min(m)
    };
    let full = if p >= l { crossing(l) } else { 0 };
    let last = p % l;
    if last == 0 {
        full
    } else {
        full.max(crossing(last))
    }
}

/// Rabenseifner's allreduce of `bytes` on `p` ranks of `net`, step by step.
pub(crate) fn rabenseifner(net: &Net, bytes: f64) -> f64 {
    if net.p <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    net.refill();
    let cross = crossings(Sched::Doubling, net.p, net.l);
    halving(net, bytes, net.p, &cross)
}

/// Rabenseifner among `h` nodes, every step crossing `c` ranks of each node
/// (the middle phase of the hierarchical allreduce).
fn rabenseifner_nodes(net: &Net, bytes: f64, h: usize, c: usize) -> f64 {
    if h <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let steps = crate::dense::Fold::new(h).p2.trailing_zeros() as usize;
    halving(net, bytes, h, &vec![c; steps + 1])
}

/// Recursive halving and doubling of `bytes` over `q` participants whose
/// step `i` crosses `cross[i]` ranks of a node (the last entry: the fold's).
fn halving(net: &Net, bytes: f64, q: usize, cross: &[usize]) -> f64 {
    let (steps, fold) = cross.split_at(cross.len() - 1);
    let prof = net.prof;
    let folded = !q.is_power_of_two();
    let mut t = 0.0;
    // In schedule order (the order the burst credit is spent in): the
    // fold's two half messages, the reduce-scatter, the allgather, the
    // fold's result back.
    if folded {
        t += net.steps(2.0, bytes / 2.0, fold[0]) + bytes / 2.0 * prof.gamma_reduce_at(bytes / 2.0);
    }
    let mut m = bytes;
    for &c in steps {
        m /= 2.0;
        t += net.step(m, c) + m * prof.gamma_reduce_at(m);
    }
    for &c in steps.iter().rev() {
        t += net.step(m, c);
        m *= 2.0;
    }
    if folded {
        t += net.step(bytes, fold[0]);
    }
    t
}

/// The ring allreduce of `bytes` on `net` (one rank per node crosses).
pub(crate) fn ring(net: &Net, bytes: f64) -> f64 {
    let p = net.p;
    if p <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    net.refill();
    let seg = bytes / p as f64;
    let c = usize::from(net.nodes() > 1);
    net.steps_oneway(2.0 * (p as f64 - 1.0), seg, c)
        + (p as f64 - 1.0) * seg * net.prof.gamma_reduce_at(seg)
}

/// The ranks of the smallest and the largest node.
fn node_sizes(net: &Net) -> (usize, usize) {
    let (p, l) = (net.p, net.l.min(net.p));
    let last = p - (net.nodes() - 1) * l;
    (last.min(l), l)
}

/// The hierarchical (node-aware) allreduce of `bytes`.
pub(crate) fn hierarchical(net: &Net, bytes: f64) -> f64 {
    let p = net.p;
    if p <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    net.refill();
    let (s, l) = node_sizes(net);
    let shard = bytes / s as f64;
    let prof = net.prof;
    let intra = if l > 1 {
        2.0 * (l as f64 - 1.0) * net.step(shard, 0)
            + (l as f64 - 1.0) * shard * prof.gamma_reduce_at(shard)
    } else {
        0.0
    };
    intra + rabenseifner_nodes(net, shard, net.nodes(), s)
}

/// The allgatherv of `m` bytes per rank (recursive doubling, or Bruck's
/// for `p` not a power of two; no unpacking).
pub(crate) fn allgather(net: &Net, m: f64) -> f64 {
    net.refill();
    allgather_in(net, m)
}

/// [`allgather`] as a phase of a collective (the credit left as it is).
fn allgather_in(net: &Net, m: f64) -> f64 {
    let p = net.p;
    if p <= 1 || m <= 0.0 {
        return 0.0;
    }
    // Recursive doubling (XOR partners) for a power of two, Bruck's
    // (partners at distance d) otherwise: step i moves min(2^i, p − 2^i)
    // blocks either way ([`crate::dense::allgatherv`]).
    let sched = if p.is_power_of_two() {
        Sched::Doubling
    } else {
        Sched::Bruck
    };
    let cross = crossings(sched, p, net.l);
    let mut t = 0.0;
    let mut q = 1usize;
    for &c in &cross[..cross.len() - usize::from(sched == Sched::Doubling)] {
        t += net.step(q.min(p - q) as f64 * m, c);
        q *= 2;
    }
    t
}

/// The node-aware allgatherv of `m` bytes per rank
/// ([`crate::dense::AllgathervAlgo::Node`]): the `L − 1` other ranks of a
/// node send their message to its leader (one after another), the leaders
/// allgather the node blocks of `L·m` bytes (one rank per node crosses),
/// and each leader sends the `p·m`-byte result down a binomial tree over
/// its node. One node, or one rank per node: the flat [`allgather`].
pub(crate) fn allgather_node(net: &Net, m: f64) -> f64 {
    let p = net.p;
    if p <= 1 || m <= 0.0 {
        return 0.0;
    }
    let (_, l) = node_sizes(net);
    if !net.two_level() || l <= 1 {
        return allgather(net, m);
    }
    net.refill();
    let gather_in = (l as f64 - 1.0) * net.step(m, 0);
    let leaders = allgather_nodes(net, l as f64 * m, net.nodes());
    let bcast = ceil_lg(l) * net.step(p as f64 * m, 0);
    gather_in + leaders + bcast
}

/// The fused message's allgatherv of `m` bytes per rank, by
/// [`Net::gather`]: the node-aware one, the flat one, or (`Auto`) the
/// cheaper of the two as `allgather = "auto"` chooses it
/// ([`crate::cost::choose_allgatherv`]).
pub(crate) fn fused_allgather(net: &Net, m: f64) -> f64 {
    use crate::dense::AllgathervAlgo;
    use crate::strategy::Pick;
    match net.gather {
        Pick::Fixed(AllgathervAlgo::Node) => allgather_node(net, m),
        Pick::Auto => {
            let c = allgatherv_candidates(net, m);
            let pick = super::argmin::cheapest(&c);
            c.iter().find(|x| x.0 == pick).map_or(0.0, |x| x.1)
        }
        _ => allgather(net, m),
    }
}

/// The allgatherv's candidates for `m` bytes a rank at `net`'s placement
/// and their prices: the flat one always, the node-aware one with two
/// levels.
pub(crate) fn allgatherv_candidates(net: &Net, m: f64) -> Vec<(crate::dense::AllgathervAlgo, f64)> {
    let mut c = vec![(
        crate::dense::AllgathervAlgo::RecursiveDoubling,
        allgather(net, m),
    )];
    if net.two_level() && net.l > 1 {
        c.push((crate::dense::AllgathervAlgo::Node, allgather_node(net, m)));
    }
    c
}

/// Recursive doubling among `h` nodes, one rank per node (the leaders).
fn allgather_nodes(net: &Net, m: f64, h: usize) -> f64 {
    if h <= 1 || m <= 0.0 {
        return 0.0;
    }
    let mut t = 0.0;
    let mut q = 1usize;
    while q < h {
        t += net.step(q.min(h - q) as f64 * m, 1);
        q *= 2;
    }
    t
}

/// Distinct indices of the sum of `j` ranks' selections of `k` of `n`
/// (module docs).
pub(crate) fn fill(n: f64, k: f64, j: usize, rho: Option<f64>) -> f64 {
    if n <= 0.0 || k <= 0.0 {
        return 0.0;
    }
    match rho {
        Some(rho) => (rho * j as f64 * k).clamp(k.min(n), n),
        None => n * (1.0 - (1.0 - (k / n).min(1.0)).powi(j as i32)),
    }
}

/// Bytes of a sparse allreduce's (or node unit's) reduced result of `f`
/// distinct indices of `n`: pairs, or the dense values when smaller.
fn reduced_bytes(f: f64, n: f64) -> f64 {
    (8.0 * f).min(4.0 * n) + 8.0
}

/// The sparse allreduce of a group of `n` elements in which every rank
/// sends `k` pairs (communication and the local summing of received pairs
/// and results; selection is the layers').
pub(crate) fn sparse_allreduce(net: &Net, n: f64, k: f64, rho: Option<f64>) -> f64 {
    let p = net.p;
    if p <= 1 {
        return 0.0;
    }
    net.refill();
    let pf = p as f64;
    let prof = net.prof;
    let agree = 2.0 * ceil_lg(p) * prof.alpha;
    let per = 8.0 * k / pf;
    let rounds: f64 = pairwise_runs(p, net.l)
        .into_iter()
        .map(|(n, c)| net.rounds(n, 8.0, per, c))
        .sum();
    let region = reduced_bytes(fill(n, k, p, rho) / pf, n / pf);
    let gather = allgather_in(net, region);
    agree
        + rounds
        + gather
        + (8.0 * k + pf * region) * prof.gamma_unpack_at(4.0 * n)
        + clear(prof, n)
}

/// Clearing the `n`-element dense result a sparse allreduce overwrites.
pub(crate) fn clear(prof: &Profile, n: f64) -> f64 {
    4.0 * n * prof.gamma_clear_at(4.0 * n)
}

/// The node-aware sparse allreduce of a group of `n` elements, `k` pairs
/// per rank.
pub(crate) fn sparse_hierarchical(net: &Net, n: f64, k: f64, rho: Option<f64>) -> f64 {
    let p = net.p;
    if p <= 1 {
        return 0.0;
    }
    net.refill();
    let prof = net.prof;
    let (_, l) = node_sizes(net);
    let h = net.nodes();
    let agree = ceil_lg(p) * prof.alpha;
    let unit = reduced_bytes(fill(n, k, l, rho), n);
    let gather_in = (l as f64 - 1.0) * net.step(8.0 * k, 0);
    let leaders = allgather_nodes(net, unit, h);
    let bcast = ceil_lg(l) * net.step(h as f64 * unit, 0);
    agree
        + gather_in
        + leaders
        + bcast
        + (l as f64 * 8.0 * k + h as f64 * unit) * prof.gamma_unpack_at(4.0 * n)
        + clear(prof, n)
}

#[cfg(test)]
pub(crate) mod tests;
