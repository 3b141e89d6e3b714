/*
 * Data-parallel linear regression in C through gradsync's C ABI, with
 * checks: every step the dense layer's result is compared bit for bit with
 * MPI_Allreduce of the same inputs; gs_allreduce is compared with
 * MPI_Allreduce for every algorithm and both element types; gs_start/gs_wait,
 * snapshots, step statistics, and MPI_COMM_WORLD after gs_engine_destroy.
 * Exits 0 and prints "c example: OK" on rank 0 only if every check passed.
 *
 * Build and run (from the repository root):
 *   cargo build --release -p gradsync-capi
 *   mpicc -O2 -I include examples/c/train.c -L target/release -lgradsync \
 *         -Wl,-rpath,$PWD/target/release -lm -o train
 *   hpc/mpirun.sh -np 4 ./train /tmp     # argv[1]: a directory for snapshots
 * (or `make -C examples/c`).
 */
#include <gradsync.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 128 /* inputs */
#define K 8   /* outputs */
#define N 32  /* samples per rank per step */
#define STEPS 20

static int rank, nprocs, failures;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "rank %d: check failed: ", rank);    \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      failures++;                                          \
    }                                                      \
  } while (0)

/* A gradsync call that must succeed. */
#define GS(call)                                                              \
  do {                                                                        \
    int rc_ = (call);                                                         \
    CHECK(rc_ == GS_OK, "%s returned %d: %s", #call, rc_, gs_last_error()); \
  } while (0)

/* Deterministic generator (splitmix64), uniform in [-1, 1). */
static uint64_t rng_state;
static double uniform(void) {
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* y = W_true x + b_true on this rank's samples of `step`; returns the loss
 * 0.5/N sum ||W x + b - y||^2 and the gradients (the bias gradient rounded
 * to multiples of 2^-10, so that its sums are exact in any order). */
static float batch_grad(int step, const float *w_true, const float *b_true,
                        const float *w, const float *b, float *gw, float *gb) {
  float x[D], r[K];
  double loss = 0;
  memset(gw, 0, sizeof(float) * K * D);
  memset(gb, 0, sizeof(float) * K);
  rng_state = 1000003ull * (uint64_t)(rank + 1) + 7919ull * (uint64_t)step;
  for (int n = 0; n < N; n++) {
    for (int j = 0; j < D; j++) x[j] = (float)uniform();
    for (int k = 0; k < K; k++) {
      float pred = b[k], y = b_true[k];
      for (int j = 0; j < D; j++) {
        pred += w[k * D + j] * x[j];
        y += w_true[k * D + j] * x[j];
      }
      r[k] = pred - y;
      loss += 0.5 * r[k] * r[k];
    }
    for (int k = 0; k < K; k++) {
      gb[k] += r[k] / N;
      for (int j = 0; j < D; j++) gw[k * D + j] += r[k] * x[j] / N;
    }
  }
  for (int k = 0; k < K; k++) gb[k] = roundf(gb[k] * 1024.0f) / 1024.0f;
  return (float)(loss / N);
}

/* gs_allreduce against MPI_Allreduce (sum) on integer-valued data. */
static void check_allreduce(void) {
  const size_t count = 1000 + 37; /* not a multiple of any rank count */
  const int algos[] = {GS_ALGO_RABENSEIFNER, GS_ALGO_RING, GS_ALGO_MPI, GS_ALGO_HIERARCHICAL};
  float *f = malloc(count * sizeof *f), *fref = malloc(count * sizeof *f);
  double *d = malloc(count * sizeof *d), *dref = malloc(count * sizeof *d);
  for (int a = 0; a < 4; a++) {
    for (size_t i = 0; i < count; i++) {
      f[i] = (float)((int)((i * 7 + (size_t)rank * 13) % 101) - 50);
      d[i] = (double)((int)((i * 11 + (size_t)rank * 5) % 1001) - 500);
    }
    MPI_Allreduce(f, fref, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(d, dref, (int)count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    GS(gs_allreduce(MPI_COMM_WORLD, f, count, GS_FLOAT32, algos[a], GS_OP_SUM));
    GS(gs_allreduce(MPI_COMM_WORLD, d, count, GS_FLOAT64, algos[a], GS_OP_SUM));
    CHECK(memcmp(f, fref, count * sizeof *f) == 0, "float32 allreduce, algo %d", algos[a]);
    CHECK(memcmp(d, dref, count * sizeof *d) == 0, "float64 allreduce, algo %d", algos[a]);
  }
  /* Out-of-range enum values are errors on every rank, buffer untouched. */
  int rc = gs_allreduce(MPI_COMM_WORLD, f, count, 7, GS_ALGO_RING, GS_OP_SUM);
  CHECK(rc == GS_ERR_RANK_FAILED && strstr(gs_last_error(), "dtype 7"),
        "bad dtype: rc %d, %s", rc, gs_last_error());
  CHECK(memcmp(f, fref, count * sizeof *f) == 0, "buffer changed by a failed call");
  free(f), free(fref), free(d), free(dref);
}

int main(int argc, char **argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
  const char *dir = argc > 1 ? argv[1] : ".";
  if (rank == 0) printf("%s, %d ranks\n", gs_version(), nprocs);

  check_allreduce();

  gs_engine *e = NULL;
  GS(gs_engine_create(MPI_COMM_WORLD, "{\"momentum\":0.0}", &e));
  if (!e) MPI_Abort(MPI_COMM_WORLD, 2);
  const size_t wshape[2] = {K, D}, bshape[1] = {K};
  GS(gs_register(e, "fc.weight", wshape, 2, "rgc:density=0.05"));
  GS(gs_register(e, "fc.bias", bshape, 1, "dense"));

  /* The model every rank starts from, and the ground truth. */
  static float w_true[K * D], b_true[K], w[K * D], b[K], gw[K * D], gb[K], gb_ref[K];
  rng_state = 42;
  for (int i = 0; i < K * D; i++) w_true[i] = (float)uniform();
  for (int k = 0; k < K; k++) b_true[k] = (float)(2.0 * uniform());
  const float lr = 0.5f;
  float first_loss = 0, loss = 0;
  float *grads[2] = {gw, gb};

  for (int step = 0; step <= STEPS; step++) {
    float local = batch_grad(step, w_true, b_true, w, b, gw, gb);
    MPI_Allreduce(&local, &loss, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    loss /= (float)nprocs;
    if (step == 0) first_loss = loss;
    /* The dense layer's expected result: the average, as the engine
     * computes it (the exact sum divided by p). */
    MPI_Allreduce(gb, gb_ref, K, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    for (int k = 0; k < K; k++) gb_ref[k] /= (float)nprocs;
    if (step < STEPS) {
      GS(gs_sync(e, grads, 2));
    } else {
      /* The last step overlaps: start, (compute), wait. */
      GS(gs_start(e, (const float *const *)grads, 2));
      GS(gs_wait(e, grads, 2));
    }
    CHECK(memcmp(gb, gb_ref, sizeof gb) == 0, "step %d: dense layer differs from MPI_Allreduce", step);
    for (int i = 0; i < K * D; i++) w[i] -= lr * gw[i];
    for (int k = 0; k < K; k++) b[k] -= lr * gb[k];
  }
  if (rank == 0) printf("loss %.4f -> %.4f after %d steps\n", first_loss, loss, STEPS);
  CHECK(loss < 0.75f * first_loss, "loss did not fall: %g -> %g", first_loss, loss);
  /* The model is the same on every rank. */
  float w0 = w[0], wmax = 0;
  MPI_Allreduce(&w0, &wmax, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
  CHECK(w0 == wmax, "ranks' weights differ");

  const char *stats = gs_last_stats_json(e);
  CHECK(stats && strstr(stats, "\"layers\""), "gs_last_stats_json");
  if (rank == 0) printf("last step stats: %s\n", stats ? stats : "(null)");

  char path[4096];
  snprintf(path, sizeof path, "%s/gradsync.rank%d.snap", dir, rank);
  GS(gs_save_snapshot(e, path));
  GS(gs_load_snapshot(e, path));
  GS(gs_sync(e, grads, 2)); /* steps go on after a restore */
  gs_engine_destroy(e);

  /* MPI_COMM_WORLD is untouched by the engine's lifetime. */
  int one = 1, sum = 0;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == nprocs, "MPI_COMM_WORLD after destroy: %d", sum);
  /* A second engine on the same communicator (NULL config: defaults). */
  GS(gs_engine_create(MPI_COMM_WORLD, NULL, &e));
  GS(gs_register(e, "bias", bshape, 1, NULL));
  GS(gs_sync(e, grads + 1, 1));
  gs_engine_destroy(e);
  gs_engine_destroy(NULL);

  int bad = 0;
  MPI_Allreduce(&failures, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf(bad ? "c example: FAILED (%d checks)\n" : "c example: OK\n", bad);
  MPI_Finalize();
  return bad ? 1 : 0;
}
