"""Two-way exchanges across hpc/cluster.sh's links, raw TCP against Open MPI
(docs/benchmarks/cluster.md, "Open MPI's TCP BTL ran two-way exchanges one way at
a time"). Rank r of host 0 pairs with rank r of host 1; every pair sends
and receives --bytes at once, 8 times; one line per exchange with every
rank's milliseconds.

    hpc/cluster.sh --hosts 2 --ranks-per-host 2 --link 1gbit -- \\
      .venv/bin/python hpc/twoway_probe.py --mode mpi     # MPI_Sendrecv
    hpc/cluster.sh --hosts 2 --ranks-per-host 2 --link 1gbit -- \\
      .venv/bin/python hpc/twoway_probe.py --mode tcp     # one socket per pair
    # Open MPI settings through the environment, e.g.
    # OMPI_MCA_btl_tcp_rdma_pipeline_frag_size=2147482624 (Open MPI's default)
"""

import argparse
import os
import socket
import threading
import time

import numpy as np
from mpi4py import MPI

PORT = 5701


def tcp_pair(comm, host0, h, rank):
    """A connected socket to this rank's partner (the host-0 side listens)."""
    server = rank < h
    port = PORT + rank % h
    if server:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host0, port))
        ls.listen(1)
    comm.Barrier()
    if server:
        s, _ = ls.accept()
        ls.close()
    else:
        s = socket.create_connection((host0, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def tcp_exchange(s, buf, rbuf):
    """Send buf and receive as many bytes at once (a thread sends)."""
    th = threading.Thread(target=s.sendall, args=(buf,))
    th.start()
    mv, n = memoryview(rbuf), len(buf)
    while n > 0:
        n -= s.recv_into(mv[: min(n, len(rbuf))])
    th.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["mpi", "tcp"], required=True)
    ap.add_argument("--bytes", type=int, default=32 << 20)
    ap.add_argument("--exchanges", type=int, default=8)
    ap.add_argument("--host0", default="10.77.0.1", help="host 0's address (hpc/cluster.sh: 10.77.0.1)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    h = p // 2
    peer = (rank + h) % p
    buf = np.full(args.bytes, rank + 1, np.uint8)
    if args.mode == "mpi":
        rb = np.empty(args.bytes, np.uint8)
        step = lambda: comm.Sendrecv(buf, peer, 0, rb, peer, 0)  # noqa: E731
    else:
        s = tcp_pair(comm, args.host0, h, rank)
        rb = bytearray(1 << 20)
        step = lambda: tcp_exchange(s, buf, rb)  # noqa: E731
    for _ in range(args.exchanges):
        comm.Barrier()
        t = time.perf_counter()
        step()
        ms = comm.gather((time.perf_counter() - t) * 1e3)
        if rank == 0:
            print(f"{args.mode} exchange of {args.bytes} B each way, ms per rank:",
                  " ".join(f"{m:.0f}" for m in ms), flush=True)


if __name__ == "__main__":
    main()
