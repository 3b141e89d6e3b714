//! Engine tests on the in-process transport; the same scenarios run on real
//! MPI ranks in `tests/mpi.rs` (through `examples/engine_check.rs`).

mod auto_collectives;
mod auto_layers;
mod delay;
mod failures;
mod gradiveq;
mod node_aware;
mod non_finite;
mod powersgd;
mod results;
mod snapshots;
mod sparse_exchange;
mod validation;

use super::*;
use crate::codec::CodecConfig;
use crate::comm::LocalComm;
use crate::dense::AllgathervAlgo;
use rand::{rngs::SmallRng, Rng, SeedableRng};

pub(super) fn grad(rank: usize, step: u64, layer: usize, n: usize) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64((rank as u64) << 40 ^ step << 20 ^ layer as u64);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// `trials` restores of `good` (this engine's snapshot) with 1–4 bits
/// flipped, every fifth also truncated (seeded by `seed`): none panics, a
/// refused one leaves the engine as it was, and one that still parses (a
/// flipped float bit) is undone with `good`.
pub(super) fn hostile_restores(s: &mut GradSync<LocalComm>, good: &[u8], seed: u64, trials: usize) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for trial in 0..trials {
        let mut bad = good.to_vec();
        for _ in 0..1 + trial % 4 {
            let i = rng.gen_range(0..bad.len());
            bad[i] ^= 1 << rng.gen_range(0..8);
        }
        if trial % 5 == 0 {
            bad.truncate(rng.gen_range(0..bad.len()));
        }
        let before = s.snapshot_bytes().expect("snapshot");
        if s.restore_bytes(&bad).is_err() {
            assert_eq!(
                s.snapshot_bytes().expect("snapshot"),
                before,
                "trial {trial}"
            );
        } else {
            s.restore_bytes(good).expect("restore");
        }
    }
}

/// The error `GradSync::with_transport` gives every one of `p` ranks
/// created with `cfg` (which must fail).
pub(super) fn creation_errors(p: usize, cfg: Config) -> Vec<String> {
    LocalComm::run(p, |c| {
        GradSync::with_transport(c, cfg.clone())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
}

pub(super) fn cfg() -> Config {
    Config {
        overlap: false,
        ..Config::default()
    }
}

/// Layer `l`'s gradient: small integers (exact sums in any order) or
/// uniform floats.
pub(super) fn exchange_grad(
    int: bool,
    rank: usize,
    step: u64,
    l: usize,
    name: &str,
    n: usize,
) -> Vec<f32> {
    if name == "zero" || (name == "zero-on-even" && rank % 2 == 0) {
        return vec![0.0; n];
    }
    if !int {
        return grad(rank, step, l, n);
    }
    (0..n)
        .map(|i| ((i * 31 + rank * 17 + step as usize * 7 + l * 3) % 23) as f32 - 11.0)
        .collect()
}

/// One rank's record of a step: output bits, per layer (reduced this
/// step, indices of this rank's unit), the step's stats.
pub(super) type ExchangeStep = (Vec<Vec<u32>>, Vec<(bool, Vec<usize>)>, StepStats);

/// [`run_exchange`] of another table.
pub(super) fn run_exchange_table(
    p: usize,
    cfg: &Config,
    int: bool,
    steps: u64,
    table: &[(&'static str, usize, Strategy)],
) -> Vec<(Vec<ExchangeStep>, Vec<Vec<u32>>)> {
    LocalComm::run(p, |c| {
        let rank = c.rank();
        let mut s = GradSync::with_transport(c, cfg.clone()).expect("engine");
        let ids: Vec<LayerId> = table
            .iter()
            .map(|(n, len, st)| s.register_with(n, &[*len], st.clone()).expect("register"))
            .collect();
        let mut rec = Vec::new();
        // With a delay the engine needs the weights (it writes them back).
        let mut w: Vec<Vec<f32>> = table.iter().map(|(_, n, _)| vec![0.0; *n]).collect();
        for step in 0..steps {
            let mut g: Vec<Vec<f32>> = table
                .iter()
                .enumerate()
                .map(|(l, (name, n, _))| exchange_grad(int, rank, step, l, name, *n))
                .collect();
            let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
            let st = if cfg.delay > 1 {
                let mut wv: Vec<&mut [f32]> = w.iter_mut().map(|x| &mut x[..]).collect();
                s.sync_with_weights_mut(&mut v, &mut wv)
            } else {
                s.sync(&mut v)
            }
            .expect("sync")
            .clone();
            let units = ids
                .iter()
                .map(|&id| {
                    let l = &s.reg.layers[id.0];
                    let mut idx = Vec::new();
                    let unit = s.last_unit(id);
                    if let Some(c) = l.codec.as_deref().filter(|_| !unit.is_empty()) {
                        c.for_each_sent(unit, l.n, &mut |i, _| idx.push(i))
                            .expect("own unit");
                    }
                    (s.plan.layers[id.0].reduced, idx)
                })
                .collect();
            let bits = g
                .iter()
                .map(|x| x.iter().map(|v| v.to_bits()).collect())
                .collect();
            rec.push((bits, units, st));
        }
        let res = ids
            .iter()
            .map(|&id| {
                s.residual(id)
                    .map_or_else(Vec::new, |r| r.iter().map(|v| v.to_bits()).collect())
            })
            .collect();
        (rec, res)
    })
}
