//! Node-aware exchanges: ranks placed on nodes with a slow link between
//! them, where `auto` picks the node-aware sparse allreduce and allgatherv.

use super::*;

use crate::strategy::Pick;

/// The in-process transport with a node map, ranks in blocks of `per`
/// (what `MpiComm::node_ids` reports on a multi-node job).
struct Noded {
    inner: LocalComm,
    per: usize,
}

impl crate::comm::Transport for Noded {
    type Request = <LocalComm as crate::comm::Transport>::Request;
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send<T: crate::comm::Elem>(
        &self,
        buf: &[T],
        dest: usize,
        tag: crate::comm::Tag,
    ) -> Result<()> {
        self.inner.send(buf, dest, tag)
    }
    fn recv<T: crate::comm::Elem>(
        &self,
        buf: &mut [T],
        src: usize,
        tag: crate::comm::Tag,
    ) -> Result<()> {
        self.inner.recv(buf, src, tag)
    }
    fn sendrecv<T: crate::comm::Elem>(
        &self,
        send: &[T],
        dest: usize,
        recv: &mut [T],
        src: usize,
        tag: crate::comm::Tag,
    ) -> Result<()> {
        self.inner.sendrecv(send, dest, recv, src, tag)
    }
    unsafe fn isend<T: crate::comm::Elem>(
        &self,
        buf: &[T],
        dest: usize,
        tag: crate::comm::Tag,
    ) -> Result<Self::Request> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.isend(buf, dest, tag) }
    }
    unsafe fn irecv<T: crate::comm::Elem>(
        &self,
        buf: &mut [T],
        src: usize,
        tag: crate::comm::Tag,
    ) -> Result<Self::Request> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.irecv(buf, src, tag) }
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn abort(&self, code: i32, msg: &str) -> ! {
        self.inner.abort(code, msg)
    }
    fn node_ids(&self) -> Option<Vec<usize>> {
        Some((0..self.size()).map(|r| r / self.per).collect())
    }
}

/// A two-level profile: shared memory at 3 µs and 2.5 GB/s inside a node,
/// a 1 Gbit/s link at 30 µs between nodes.
fn slow_link_profile() -> crate::cost::Profile {
    let mut prof = crate::cost::Profile::from_network(3e-6, 2.5e9, 0.0, 0.0).expect("profile");
    prof.inter_node = Some(crate::cost::NetLevel {
        alpha: 3e-5,
        beta: 1.0 / 1.25e8,
        beta_curve: Vec::new(),
        oneway_curve: Vec::new(),
        burst: None,
    });
    prof
}

/// `steps` synced steps of `table` under `cfg` on `p` in-process ranks
/// placed `per` a node ([`Noded`]; `exchange_grad` gradients, integers
/// with `int`): each rank's gradients after each step and its stats.
fn run_on_nodes(
    p: usize,
    per: usize,
    cfg: &Config,
    table: &[(&'static str, usize, Strategy)],
    steps: u64,
    int: bool,
) -> Vec<Vec<(Vec<Vec<f32>>, StepStats)>> {
    LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(Noded { inner: c, per }, cfg.clone()).expect("engine");
        for (n, len, st) in table {
            s.register_with(n, &[*len], st.clone()).expect("register");
        }
        let mut out = Vec::new();
        for step in 0..steps {
            let mut g: Vec<Vec<f32>> = table
                .iter()
                .enumerate()
                .map(|(l, (name, n, _))| exchange_grad(int, rank, step, l, name, *n))
                .collect();
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            let st = s.sync(&mut v).expect("sync").clone();
            out.push((g, st));
        }
        out
    })
}

/// With the ranks' nodes known and a two-level profile whose
/// link between nodes is slow, `auto` runs the node-aware sparse
/// allreduce (2 nodes of 2 ranks): the same results as the allgather
/// engine (exactly, for integer gradients: the node-by-node sum is exact),
/// the stats name it and measure the fill; on one node it never does.
#[test]
fn auto_exchange_goes_node_aware_across_slow_nodes() {
    let prof = slow_link_profile();
    let table = vec![
        ("bias", 10, Strategy::Dense),
        ("a", 20_000, Strategy::rgc(0.2)),
        ("b", 5000, Strategy::rgc(0.2)),
    ];
    let run = |exchange: Pick<SparseExchange>, per: usize| {
        let cfg = Config {
            sparse_exchange: exchange,
            profile: Some(prof.clone()),
            ..cfg()
        };
        run_on_nodes(4, per, &cfg, &table, 3, true)
    };
    let gather = run(SparseExchange::Allgather.into(), 2);
    let nodes = run(Pick::Auto, 2);
    let one = run(Pick::Auto, 4);
    for r in 0..4 {
        for t in 0..3 {
            let at = format!("rank {r} step {t}");
            let (g, _) = &gather[r][t];
            let (a, st) = &nodes[r][t];
            assert_eq!(g, a, "{at}: results");
            // Node-aware: the sparse allreduce, or the fused allgatherv
            // (`allgather = "auto"`) with its node blocks.
            assert!(
                st.sparse_exchange == "hierarchical"
                    || (st.sparse_exchange == "allgather" && st.allgather == "node"),
                "{at}: {} / {}",
                st.sparse_exchange,
                st.allgather
            );
            // The fill is measured either way (the allgatherv's unpacking
            // counts it); a sparse allreduce reports its result's indices.
            assert!(st.fill_estimate.is_some(), "{at}");
            assert!(
                st.sparse_reduce_nnz > 0 || st.sparse_exchange == "allgather",
                "{at}"
            );
            let (o, st1) = &one[r][t];
            assert_eq!(g, o, "{at}: one node");
            assert_ne!(st1.sparse_exchange, "hierarchical", "{at}: one node");
            assert_ne!(st1.allgather, "node", "{at}: one node");
        }
    }
}

/// `allgather = "auto"` (the default) runs the node-aware
/// allgatherv for the fused message where the cost model prices it below
/// the flat one (2 nodes of 3 ranks, a slow link; QSGD layers, which only
/// the fused allgatherv carries), with bitwise the results of `recdbl`;
/// on one node, and without a profile, it is `recdbl`.
#[test]
fn auto_allgather_goes_node_aware_across_slow_nodes() {
    let prof = slow_link_profile();
    let qsgd = || Strategy::Sparse {
        codec: "qsgd:bits=4".parse().expect("codec"),
        density: None,
    };
    let table = vec![
        ("bias", 10, Strategy::Dense),
        ("w", 60_000, qsgd()),
        ("v", 7, qsgd()),
    ];
    let run = |allgather: Pick<AllgathervAlgo>, per: usize, profile: bool| {
        let cfg = Config {
            allgather,
            profile: profile.then(|| prof.clone()),
            ..cfg()
        };
        run_on_nodes(6, per, &cfg, &table, 2, false)
            .into_iter()
            .map(|rank| {
                rank.into_iter()
                    .map(|(g, st)| (g, st.allgather))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    let flat = run(AllgathervAlgo::RecursiveDoubling.into(), 3, true);
    let auto = run(Pick::Auto, 3, true);
    let one = run(Pick::Auto, 6, true);
    let bare = run(Pick::Auto, 3, false);
    for r in 0..6 {
        for t in 0..2 {
            let at = format!("rank {r} step {t}");
            assert_eq!(flat[r][t].1, "recdbl", "{at}");
            assert_eq!(auto[r][t].1, "node", "{at}");
            assert_eq!(one[r][t].1, "recdbl", "{at}: one node");
            assert_eq!(bare[r][t].1, "recdbl", "{at}: no profile");
            for other in [&auto, &one, &bare] {
                assert_eq!(flat[r][t].0, other[r][t].0, "{at}: results");
            }
        }
    }
}

/// A forced node-aware collective on a transport without a node map (in
/// process) is refused at creation, on every rank alike, naming the
/// option: the hierarchical allreduce as the node-aware allgatherv and
/// exchange are.
#[test]
fn forced_node_aware_collectives_without_nodes_fail_every_rank_at_creation() {
    let cases = [
        (
            Config {
                allreduce: crate::dense::AllreduceAlgo::Hierarchical.into(),
                ..cfg()
            },
            "allreduce \"hierarchical\"",
        ),
        (
            Config {
                allgather: crate::dense::AllgathervAlgo::Node.into(),
                ..cfg()
            },
            "allgather \"node\"",
        ),
    ];
    for (c, want) in cases {
        for p in [1, 3] {
            let errs = creation_errors(p, c.clone());
            assert_eq!(errs.len(), p);
            for e in &errs {
                assert!(
                    e.contains(want) && e.contains("needs the ranks' nodes"),
                    "p={p}: {e}"
                );
            }
        }
    }
}
