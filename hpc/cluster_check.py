"""Checks of an emulated cluster (hpc/cluster.sh), run on its ranks (mpi4py):

    hpc/cluster.sh --hosts 2 --ranks-per-host 2 --link 100mbit -- .venv/bin/python hpc/cluster_check.py

1. Placement: every rank's MPI_Get_processor_name equals its hostname; there are
   GRADSYNC_CLUSTER_HOSTS distinct hostnames, each with
   GRADSYNC_CLUSTER_RANKS_PER_HOST ranks, rank r on host r // R; and
   MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups exactly the ranks of a host.
2. Between hosts (rank 0 -> first rank of host 1, and back): one-way
   bandwidth of --bytes messages over about --seconds, within --tolerance of
   the link rate (GRADSYNC_CLUSTER_LINK_BPS / 8; payload bytes against the
   rate tc shapes, so TCP/IP headers cost about 4 %). With 3 hosts or more,
   hosts 1 and 2 send to host 0 at once: their sum, capped by host 0's
   incoming link, is also within --tolerance of the link rate. Each case
   gets up to 3 trials; the first within tolerance passes it.
3. Both ways at once: every rank of host 0 exchanges --bytes messages with
   its counterpart on host 1 (MPI_Sendrecv, as a Rabenseifner step that
   crosses the link); each direction of the link, summed over the pairs, at
   least --two-way-min of the link rate. TCP over these shaped links moves
   two-way traffic at 68-92 % of the link (raw sockets too: the ACKs queue
   behind the data; least at 100mbit); Open MPI's TCP BTL with its default
   2 GiB put fragments ran some of these exchanges one way at a time, at
   about 50 %, by chance per job (so this check catches it in some jobs,
   not all); hpc/cluster.sh sets btl_tcp_rdma_pipeline_frag_size.
4. Within a host (rank 0 -> rank 1, when R >= 2): shared memory, at least
   --intra-factor times the link rate.
5. With --delay-ms D: half the round trip of 1-byte messages between hosts is
   D to D + --delay-slack-ms (hpc/cluster.sh delays each host's outgoing side).

Ranks not in a measurement wait in a sleeping poll (they share the cores).
Prints one JSON object per measurement and `cluster_check: PASS|FAIL ...`
lines on rank 0; exits 1 when a check fails.
"""

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

TAG = 77
# Measurements of each one-way case before it fails (section 2).
TRIALS = 3


def idle_barrier(comm):
    """A barrier that sleeps instead of spinning (ranks share the cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def one_way(comm, srcs, dst, nbytes, reps):
    """Bytes/s arriving at dst while every rank of srcs sends it reps messages
    at once (after a warm-up message each: connections up, tbf buckets empty);
    timed at dst from its "go" to the last byte."""
    rank = comm.Get_rank()
    buf = np.full(nbytes, rank + 1, dtype=np.uint8)  # real pages, not the zero page
    go = np.zeros(1, dtype=np.uint8)
    rate = None
    if rank in srcs:
        comm.Send(buf, dst, TAG)
        comm.Recv(go, dst, TAG)
        for _ in range(reps):
            comm.Send(buf, dst, TAG)
    elif rank == dst:
        bufs = [np.empty(nbytes, dtype=np.uint8) for _ in srcs]
        for src, b in zip(srcs, bufs):
            comm.Recv(b, src, TAG)
        t0 = MPI.Wtime()
        for src in srcs:
            comm.Send(go, src, TAG)
        for _ in range(reps):
            MPI.Request.Waitall([comm.Irecv(b, src, TAG) for src, b in zip(srcs, bufs)])
        rate = len(srcs) * reps * nbytes / (MPI.Wtime() - t0)
    idle_barrier(comm)
    return comm.bcast(rate, root=dst)


def two_way(comm, pairs, nbytes, reps):
    """Bytes/s each way across the link while every pair (a, b) exchanges
    reps messages at once with MPI_Sendrecv (after a warm-up exchange);
    from the common start to the last pair's end."""
    rank = comm.Get_rank()
    peer = next((b if rank == a else a for a, b in pairs if rank in (a, b)), None)
    elapsed, wrong = 0.0, False
    if peer is not None:
        buf = np.full(nbytes, rank + 1, dtype=np.uint8)
        got = np.empty(nbytes, dtype=np.uint8)
        comm.Sendrecv(buf, peer, TAG, got, peer, TAG)
    idle_barrier(comm)
    if peer is not None:
        t0 = MPI.Wtime()
        for _ in range(reps):
            comm.Sendrecv(buf, peer, TAG, got, peer, TAG)
        elapsed = MPI.Wtime() - t0
        wrong = bool((got != peer + 1).any())
    # Ranks outside the pairs must not spin in the allreduce while the pairs
    # exchange: with more ranks than cores they would take the pairs' cores
    # (a 3 x 1 job on 2 cores measured half the rate that way).
    idle_barrier(comm)
    slowest = comm.allreduce(elapsed, op=MPI.MAX)
    # Wrong bytes arrived somewhere: rate 0, so the check fails.
    return 0.0 if comm.allreduce(wrong, op=MPI.LOR) else len(pairs) * reps * nbytes / slowest


def half_rtt(comm, a, b, reps=10):
    rank = comm.Get_rank()
    msg = np.zeros(1, dtype=np.uint8)
    best = None
    if rank in (a, b):
        peer = b if rank == a else a
        times = []
        for _ in range(reps + 1):
            t0 = MPI.Wtime()
            if rank == a:
                comm.Send(msg, peer, TAG)
                comm.Recv(msg, peer, TAG)
            else:
                comm.Recv(msg, peer, TAG)
                comm.Send(msg, peer, TAG)
            times.append(MPI.Wtime() - t0)
        best = float(np.median(times[1:])) / 2
    idle_barrier(comm)
    return comm.bcast(best, root=a)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4 << 20, help="message size (default 4 MiB)")
    ap.add_argument("--seconds", type=float, default=1.0, help="target time of the inter-host measurement")
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed relative error of the inter-host rate")
    ap.add_argument("--two-way-min", type=float, default=0.60,
                    help="each direction's rate, both ways at once, at least this fraction of the link")
    ap.add_argument("--intra-factor", type=float, default=3.0, help="intra-host rate must be this many times the link's")
    ap.add_argument("--delay-ms", type=float, default=None, help="expected one-way delay (hpc/cluster.sh --delay)")
    ap.add_argument("--delay-slack-ms", type=float, default=2.0)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = int(os.environ["GRADSYNC_CLUSTER_HOSTS"])
    rph = int(os.environ["GRADSYNC_CLUSTER_RANKS_PER_HOST"])
    link_Bps = float(os.environ["GRADSYNC_CLUSTER_LINK_BPS"]) / 8
    failures = []

    def check(ok, what):
        if rank == 0:
            print(f"cluster_check: {'PASS' if ok else 'FAIL'} {what}", flush=True)
            if not ok:
                failures.append(what)

    # 1. Placement.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    me = dict(rank=rank, hostname=socket.gethostname(), processor=MPI.Get_processor_name(),
              shared=sorted(node.allgather(rank)))
    everyone = comm.gather(me, root=0)
    if rank == 0:
        names = sorted({p["hostname"] for p in everyone})
        for p in everyone:
            print(json.dumps(p), flush=True)
        check(all(p["processor"] == p["hostname"] for p in everyone),
              "MPI_Get_processor_name is the hostname on every rank")
        check(len(names) == hosts and size == hosts * rph,
              f"{len(names)} distinct hostnames for {size} ranks (expected {hosts} hosts x {rph})")
        host_of = [p["hostname"] for p in everyone]
        check(all(host_of[r] == host_of[(r // rph) * rph] for r in range(size))
              and all(host_of[r] != host_of[r - rph] for r in range(rph, size)),
              f"rank r on host r // {rph} (ppr:{rph}:node)")
        check(all(p["shared"] == [q for q in range(size) if host_of[q] == p["hostname"]] for p in everyone),
              "MPI_COMM_TYPE_SHARED groups exactly the ranks of each host")

    # 2. Between hosts: both directions of one link, then (3 hosts or more)
    # two hosts sending to one at once, whose link in must cap their sum.
    if hosts >= 2:
        reps = max(2, round(args.seconds * link_Bps / args.bytes))
        cases = [("inter-host", [0], rph), ("inter-host", [rph], 0)]
        if hosts >= 3:
            cases.append(("inter-host incast", [rph, 2 * rph], 0))
        for path, srcs, dst in cases:
            # Several senders: at least 3 rounds, so that one sender
            # starting late (3 ranks on 2 cores) is not the whole measurement
            # (one round of 2 x 4 MiB measured 10.1 MB/s of 12.5 once).
            n = reps if len(srcs) == 1 else max(3, reps // len(srcs))
            # Up to TRIALS measurements, the first within tolerance counts:
            # the link caps the rate (tbf never lets more through), and a
            # trial below it on a loaded 2-core machine is the machine (one
            # CI run measured the incast at -13.6 % while single flows ran at
            # -4.5 %); a link shaped wrong misses in every trial.
            for trial in range(TRIALS):
                rate = one_way(comm, srcs, dst, args.bytes, n)
                err = rate / link_Bps - 1
                if rank == 0:
                    print(json.dumps(dict(path=path, src=srcs, dst=dst, bytes=args.bytes, reps=n,
                                          trial=trial + 1, MBps=round(rate / 1e6, 2),
                                          link_MBps=round(link_Bps / 1e6, 2),
                                          rel_err=round(err, 4))), flush=True)
                if abs(err) <= args.tolerance:
                    break
            if rank == 0:
                check(abs(err) <= args.tolerance,
                      f"{path} {srcs} -> {dst}: {rate / 1e6:.1f} MB/s vs link {link_Bps / 1e6:.1f} MB/s "
                      f"({err:+.1%}, tolerance {args.tolerance:.0%}, trial {trial + 1} of {TRIALS})")
    # 3. Both ways at once: host 0's ranks with host 1's.
    if hosts >= 2:
        pairs = [(r, rph + r) for r in range(rph)]
        n = max(4, round(args.seconds * link_Bps / (args.bytes * len(pairs))))
        rate = two_way(comm, pairs, args.bytes, n)
        if rank == 0:
            err = rate / link_Bps - 1
            print(json.dumps(dict(path="inter-host two-way", pairs=pairs, bytes=args.bytes, reps=n,
                                  MBps_each_way=round(rate / 1e6, 2), link_MBps=round(link_Bps / 1e6, 2),
                                  rel_err=round(err, 4))), flush=True)
            check(rate >= args.two_way_min * link_Bps,
                  f"inter-host two-way {pairs}: {rate / 1e6:.1f} MB/s vs link {link_Bps / 1e6:.1f} MB/s, "
                  f"each way at once ({err:+.1%}, at least {args.two_way_min:.0%} of the link)")
    # 4. Within a host.
    if rph >= 2:
        nbytes = 16 << 20
        rate = one_way(comm, [0], 1, nbytes, 8)
        if rank == 0:
            print(json.dumps(dict(path="intra-host", src=0, dst=1, bytes=nbytes, reps=8,
                                  MBps=round(rate / 1e6, 2), link_MBps=round(link_Bps / 1e6, 2))), flush=True)
            check(rate >= args.intra_factor * link_Bps,
                  f"intra-host {rate / 1e6:.1f} MB/s >= {args.intra_factor:g} x link {link_Bps / 1e6:.1f} MB/s")
    # 5. Delay.
    if args.delay_ms is not None and hosts >= 2:
        lat = half_rtt(comm, 0, rph)
        if rank == 0:
            ms = lat * 1e3
            print(json.dumps(dict(path="inter-host", half_rtt_ms=round(ms, 3), delay_ms=args.delay_ms)), flush=True)
            check(args.delay_ms <= ms <= args.delay_ms + args.delay_slack_ms,
                  f"inter-host half round trip {ms:.2f} ms for a one-way delay of {args.delay_ms:g} ms")

    ok = comm.bcast(not failures, root=0)
    node.Free()
    if rank == 0:
        print(f"cluster_check: {'all checks passed' if ok else 'FAILED: ' + '; '.join(failures)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
