use super::*;
use crate::comm::LocalComm;

/// Replays a schedule: every element is reduced once, from a slot
/// whose copy was waited on, with the next copy issued before the
/// reduction (overlap), and slots reused only after their copy back.
fn check_schedule(n: usize, chunk: usize) {
    let acts: Vec<Action> = schedule(n, chunk).collect();
    assert_eq!(acts.last(), Some(&Action::Synchronize));
    let k = n.div_ceil(chunk);
    let mut covered = 0;
    let pos = |a: &Action| acts.iter().position(|b| b == a);
    for i in 0..k {
        let r = i * chunk..((i + 1) * chunk).min(n);
        let s = i % SLOTS;
        let to_host = pos(&Action::ToHost {
            chunk: i,
            range: r.clone(),
            slot: s,
        })
        .unwrap();
        let wait = pos(&Action::WaitToHost { chunk: i, slot: s }).unwrap();
        let reduce = pos(&Action::Reduce {
            chunk: i,
            slot: s,
            len: r.len(),
        })
        .unwrap();
        let back = pos(&Action::ToDevice {
            chunk: i,
            range: r.clone(),
            slot: s,
        })
        .unwrap();
        assert!(
            to_host < wait && wait < reduce && reduce < back,
            "chunk {i}"
        );
        if i + 1 < k {
            // The next chunk's copy overlaps this chunk's reduction.
            let next = acts
                .iter()
                .position(|a| matches!(a, Action::ToHost { chunk, .. } if *chunk == i + 1))
                .unwrap();
            assert!(next < reduce, "chunk {i}: copy of {} not overlapped", i + 1);
        }
        if i >= SLOTS {
            let prev_back = acts
                .iter()
                .position(|a| matches!(a, Action::ToDevice { chunk, .. } if *chunk == i - SLOTS))
                .unwrap();
            assert!(
                prev_back < to_host,
                "slot {s} reused before chunk {} left it",
                i - SLOTS
            );
        }
        assert_eq!(r.start, covered);
        covered = r.end;
    }
    assert_eq!(covered, n);
    assert_eq!(acts.len(), 1 + 4 * k);
}

#[test]
fn route_is_direct_only_for_mpi_sum_on_a_cuda_aware_mpi() {
    let o = |algo, op| StagingOptions {
        chunk_elems: 8,
        algo,
        op,
    };
    let (mpi, ring) = (AllreduceAlgo::Mpi, AllreduceAlgo::Ring);
    assert_eq!(Route::choose(true, &o(mpi, ReduceOp::Sum)), Route::Direct);
    assert_eq!(Route::choose(false, &o(mpi, ReduceOp::Sum)), Route::Staged);
    assert_eq!(Route::choose(true, &o(ring, ReduceOp::Sum)), Route::Staged);
    assert_eq!(
        Route::choose(true, &o(mpi, ReduceOp::Average)),
        Route::Staged
    );
}

#[test]
fn schedule_orders_copies_and_reductions() {
    for (n, chunk) in [(0, 1), (1, 1), (1, 8), (7, 3), (9, 3), (10, 1), (1000, 64)] {
        check_schedule(n, chunk);
    }
}

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + rank * 104_729) % 201) as f32 - 100.0)
        .collect()
}

#[test]
fn staged_equals_whole_buffer_allreduce_in_process() {
    for p in [1, 2, 3, 4] {
        for (n, chunk) in [
            (0, 4),
            (1, 4),
            (10, 3),
            (1000, 7),
            (1000, 1000),
            (1000, 5000),
        ] {
            for op in [ReduceOp::Sum, ReduceOp::Average] {
                let out = LocalComm::run(p, move |c| {
                    let x = input(c.rank(), n);
                    let mut want = x.clone();
                    let o = AllreduceOptions {
                        op,
                        ..Default::default()
                    };
                    crate::dense::allreduce(&c, &mut want, AllreduceAlgo::Ring, &o).unwrap();
                    let mut dev = HostMemory::new(x);
                    let opts = StagingOptions {
                        chunk_elems: chunk,
                        algo: AllreduceAlgo::Ring,
                        op,
                    };
                    let rep = staged_allreduce(&c, &mut dev, &opts).unwrap();
                    (want, dev.hazards(), dev.max_pending(), rep, dev.into_data())
                });
                for (want, hazards, pending, rep, got) in out {
                    assert_eq!(hazards, 0);
                    assert_eq!(rep.chunks, n.div_ceil(chunk.min(n).max(1)));
                    if rep.chunks > 1 {
                        assert!(pending >= 2, "copies never overlapped");
                    }
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "p={p} n={n} chunk={chunk} {op:?}");
                }
            }
        }
    }
}

#[test]
fn mismatches_and_failures_are_errors_on_every_rank() {
    // Lengths differ.
    let out = LocalComm::run(3, |c| {
        let n = if c.rank() == 2 { 11 } else { 10 };
        let mut dev = HostMemory::new(vec![1.0; n]);
        staged_allreduce(&c, &mut dev, &StagingOptions::default()).map_err(|e| e.to_string())
    });
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap_err().contains("size mismatch")),
        "{out:?}"
    );
    // Chunk sizes differ.
    let out = LocalComm::run(3, |c| {
        let mut dev = HostMemory::new(vec![1.0; 10]);
        let opts = StagingOptions {
            chunk_elems: 3 + c.rank() % 2,
            ..Default::default()
        };
        staged_allreduce(&c, &mut dev, &opts).map_err(|e| e.to_string())
    });
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap_err().contains("options differ")),
        "{out:?}"
    );
    // A zero chunk on rank 1.
    let out = LocalComm::run(3, |c| {
        let mut dev = HostMemory::new(vec![1.0; 10]);
        let opts = StagingOptions {
            chunk_elems: if c.rank() == 1 { 0 } else { 4 },
            algo: AllreduceAlgo::Ring,
            ..Default::default()
        };
        staged_allreduce(&c, &mut dev, &opts).map_err(|e| e.to_string())
    });
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap_err().contains("rank 1 failed")),
        "{out:?}"
    );
    // A copy that fails mid-pipeline on rank 2 (copy 3 in issue order:
    // the third chunk's copy to the host), then a good call on the same transport.
    let out = LocalComm::run(3, |c| {
        let mut dev = HostMemory::new(vec![1.0; 10]);
        if c.rank() == 2 {
            dev = dev.fail_copy(3);
        }
        let opts = StagingOptions {
            chunk_elems: 3,
            algo: AllreduceAlgo::Rabenseifner,
            ..Default::default()
        };
        let first = staged_allreduce(&c, &mut dev, &opts).map_err(|e| e.to_string());
        let mut dev = HostMemory::new(vec![1.0; 10]);
        staged_allreduce(&c, &mut dev, &opts).unwrap();
        (first, dev.into_data())
    });
    for (first, after) in &out {
        let e = first.as_ref().unwrap_err();
        assert!(
            e.contains("rank 2 failed") && e.contains("copy 3 failed"),
            "{e}"
        );
        assert!(after.iter().all(|&x| x == 3.0));
    }
}
