/* hpc/mpirun.sh -np 4 examples/c/quickstart  (build: make -C examples/c) */
#include <gradsync.h>
#include <stdio.h>

#define D 4096 /* weights: compressed (RGC, 1% of the elements per rank) */
#define K 64   /* bias: dense (averaged exactly) */

static void check(int rc, const char *what) {
  if (rc != GS_OK) { /* gs_last_error names the call, the rank and the cause */
    fprintf(stderr, "%s: %s\n", what, gs_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

int main(int argc, char **argv) {
  int provided, rank, nprocs;
  /* SERIALIZED lets the engine communicate on a progress thread. */
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nprocs);

  gs_engine *e = NULL;
  check(gs_engine_create(MPI_COMM_WORLD, "{\"momentum\": 0.9}", &e), "create");
  /* Every rank registers the same layers in the same order. */
  const size_t wshape[1] = {D}, bshape[1] = {K};
  check(gs_register(e, "fc.weight", wshape, 1, "rgc:density=0.01"), "register");
  check(gs_register(e, "fc.bias", bshape, 1, "dense"), "register");

  static float w[D], b[K], gw[D], gb[K];
  float *grads[2] = {gw, gb};
  for (int step = 0; step < 100; step++) {
    /* Your backward pass: this rank's gradients of its own mini-batch. */
    for (int i = 0; i < D; i++) gw[i] = (float)((i * 31 + rank + step) % 17) - 8.0f;
    for (int i = 0; i < K; i++) gb[i] = (float)(rank + i);

    /* In place: grads become the update directions, equal on every rank. */
    int rc = gs_sync(e, grads, 2);
    if (rc == GS_ERR_RANK_FAILED) { /* every rank got it: skip the step */
      if (rank == 0) fprintf(stderr, "step %d skipped: %s\n", step, gs_last_error());
      continue;
    }
    check(rc, "gs_sync");
    for (int i = 0; i < D; i++) w[i] -= 0.01f * gw[i];
    for (int i = 0; i < K; i++) b[i] -= 0.01f * gb[i];
  }
  if (rank == 0) printf("%s\nlast step: %s\nquickstart: OK\n", gs_version(), gs_last_stats_json(e));
  gs_engine_destroy(e); /* before MPI_Finalize; MPI is yours to finalize */
  MPI_Finalize();
  return 0;
}
