/* Yield the CPU when MPICH's progress finds nothing to do, for
 * oversubscribed correctness runs (hpc/mpich_test.sh preloads it).
 *
 * MPICH's ch4 device (Debian's is ch4:ucx) busy-polls in every wait and,
 * unlike Open MPI (mpi_yield_when_idle, on by itself when oversubscribed),
 * never yields: with more ranks than cores a rank spins out its whole time
 * slice while the peer it waits for is descheduled. Measured on 2 cores, 3
 * ranks, `gradsync bench --op sparse --codec qsgd --bytes 16K`: 24 ms an
 * iteration, 0.086 ms with this shim. Each pass of MPICH's progress loop
 * calls UCX's ucp_worker_progress (through the PLT, so a preload takes the
 * call); when it reports no event, this gives the core away once.
 * Never for timings: on a machine with a core per rank it only adds
 * system calls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

typedef unsigned (*progress_fn)(void *);

/* UCX's own ucp_worker_progress: the next definition after this one, or,
 * where MPICH (and so UCX) was loaded with RTLD_LOCAL (mpi4py's dlopen),
 * the one in libucp itself, which the global search does not see. */
static progress_fn real_progress(void)
{
    progress_fn f = (progress_fn)dlsym(RTLD_NEXT, "ucp_worker_progress");
    if (!f) {
        void *ucp = dlopen("libucp.so.0", RTLD_LAZY | RTLD_NOLOAD);
        if (ucp)
            f = (progress_fn)dlsym(ucp, "ucp_worker_progress");
    }
    return f;
}

unsigned ucp_worker_progress(void *worker)
{
    static progress_fn real;
    if (!real) {
        real = real_progress();
        if (!real) {
            static const char msg[] = "mpich_yield.so: ucp_worker_progress not found\n";
            (void)!write(2, msg, sizeof msg - 1);
            abort();
        }
    }
    unsigned events = real(worker);
    if (events == 0)
        sched_yield();
    return events;
}
