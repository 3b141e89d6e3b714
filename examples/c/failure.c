/*
 * The failure model through the C ABI: bad arguments on ONE rank make every
 * rank return the same error from the same call (nobody hangs), and the
 * next step works. Every rank prints one line per check,
 *   <check> | rc=<code> | <gs_last_error text>
 * which must be identical on every rank (tests/capi.rs compares them, read
 * from GRADSYNC_REPORT_DIR/report-<rank>.txt when that is set), and rank 0
 * prints "c failure: OK" if every rank saw the expected codes.
 *
 *   mpicc -I include examples/c/failure.c -L target/release -lgradsync \
 *         -Wl,-rpath,$PWD/target/release -o failure
 *   hpc/mpirun.sh -np 3 ./failure
 */
#include <gradsync.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nprocs, failures;

/* Every line printed, kept for GRADSYNC_REPORT_DIR/report-<rank>.txt: the
 * test reads the ranks' lines from there, since mpirun may cut and
 * interleave lines of several ranks on its own stdout under load. */
static char kept[1 << 16];
static size_t kept_len;

static void keep(const char *line) {
  size_t n = strlen(line);
  if (kept_len + n < sizeof kept) memcpy(kept + kept_len, line, n), kept_len += n;
}

static void write_kept(void) {
  const char *dir = getenv("GRADSYNC_REPORT_DIR");
  if (!dir) return;
  char path[4096];
  snprintf(path, sizeof path, "%s/report-%d.txt", dir, rank);
  FILE *f = fopen(path, "w");
  if (!f) return;
  fwrite(kept, 1, kept_len, f);
  fclose(f);
}

/* Print the check's line; count it as failed unless rc == want and the
 * error text contains `needle` (NULL: anything). */
static void report(const char *check, int rc, int want, const char *needle) {
  const char *err = gs_last_error();
  char line[2048];
  snprintf(line, sizeof line, "%s | rc=%d | %s\n", check, rc, err);
  keep(line);
  fputs(line, stdout);
  fflush(stdout);
  if (rc != want || (needle && !strstr(err, needle))) {
    fprintf(stderr, "rank %d: %s: rc %d (want %d), error %s (want %s)\n", rank, check, rc, want,
            err, needle ? needle : "-");
    failures++;
  }
}

#define NL 2
static float wg[1000], bg[10];

/* Integer-valued gradients, so the dense layer's average is exact. */
static void fill(int step) {
  for (int i = 0; i < 1000; i++) wg[i] = (float)((i + rank + step) % 7);
  for (int i = 0; i < 10; i++) bg[i] = (float)(rank * 10 + i + step);
}

static int bias_ok(int step) {
  for (int i = 0; i < 10; i++) {
    float sum = 0;
    for (int r = 0; r < nprocs; r++) sum += (float)(r * 10 + i + step);
    if (bg[i] != sum / (float)nprocs) return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  int provided;
  char check[256], needle[256];
  /* Before MPI_Init: a clear error, and gradsync does not initialize MPI. */
  gs_engine *early = NULL;
  int early_rc = gs_engine_create(MPI_COMM_WORLD, NULL, &early);
  char early_err[512];
  snprintf(early_err, sizeof early_err, "%s", gs_last_error());
  int early_init = 1;
  MPI_Initialized(&early_init);
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
  const int bad = nprocs - 1; /* the rank that misbehaves */
  const size_t wshape[2] = {10, 100}, bshape[1] = {10};

  {
    char line[2048];
    snprintf(line, sizeof line, "create before MPI_Init | rc=%d | %s\n", early_rc, early_err);
    keep(line);
    fputs(line, stdout);
  }
  if (early_rc != GS_ERR_INVALID || early || early_init || !strstr(early_err, "not initialized"))
    fprintf(stderr, "rank %d: create before MPI_Init: rc %d\n", rank, early_rc), failures++;

  gs_engine *e = NULL;
  int rc = gs_engine_create(MPI_COMM_WORLD, "{\"momentum\": 0.0}", &e);
  report("create", rc, GS_OK, NULL);
  if (!e) MPI_Abort(MPI_COMM_WORLD, 2);
  report("register weight", gs_register(e, "w", wshape, 2, "rgc:density=0.01"), GS_OK, NULL);
  report("register bias", gs_register(e, "b", bshape, 1, "dense"), GS_OK, NULL);

  /* Steps 0..5; step 2: a NULL gradient pointer on `bad`; step 3: a wrong
   * nlayers on `bad`; step 4: a NULL grads array on `bad`; step 5: arrays
   * that overlap on `bad` (the bias inside the weight: GS_OK with replicas
   * that differ, before). */
  for (int step = 0; step < 6; step++) {
    float *grads[NL] = {wg, bg};
    size_t n = NL;
    float *const *g = grads;
    fill(step);
    static const char *causes[6] = {NULL, NULL, "grads[1] (layer \"b\") is NULL",
                                    "nlayers = 1, but 2 layers are registered", "grads is NULL",
                                    "grads[0] (layer \"w\") and grads[1] (layer \"b\") overlap"};
    if (rank == bad && step == 2) grads[1] = NULL;
    if (rank == bad && step == 3) n = 1;
    if (rank == bad && step == 4) g = NULL;
    if (rank == bad && step == 5) grads[1] = wg + 5;
    rc = gs_sync(e, g, n);
    snprintf(check, sizeof check, "step %d", step);
    if (step >= 2 && step <= 5) {
      snprintf(needle, sizeof needle, "rank %d failed in step %d", bad, step);
      report(check, rc, GS_ERR_RANK_FAILED, needle);
      if (!strstr(gs_last_error(), causes[step]))
        fprintf(stderr, "rank %d: step %d: cause missing\n", rank, step), failures++;
    } else {
      report(check, rc, GS_OK, NULL);
      if (!bias_ok(step)) fprintf(stderr, "rank %d: step %d: wrong bias\n", rank, step), failures++;
    }
  }

  /* Local misuse: errors on this rank only, no collective involved. */
  report("sync on NULL engine", gs_sync(NULL, NULL, 0), GS_ERR_INVALID, "engine is NULL");
  report("wait without start", gs_wait(e, NULL, 0), GS_ERR_INVALID, "wait without start");
  {
    /* gs_wait with a NULL array: the step completes on every rank, and
     * each rank that passed NULL loses only its copy of the result. */
    const float *in[NL] = {wg, bg};
    report("start", gs_start(e, in, NL), GS_OK, NULL);
    report("wait into NULL", gs_wait(e, NULL, NL), GS_ERR_INVALID, "result was discarded");
  }
  /* Every rank registers late: the call still enters the ranks' first
     agreement (a peer in a step would be released with the same error),
     so every rank returns it alike. */
  report("register after the first step", gs_register(e, "late", bshape, 1, "dense"),
         GS_ERR_RANK_FAILED, "before the first step");
  report("save to NULL path", gs_save_snapshot(e, NULL), GS_ERR_INVALID, "path is NULL");
  if (gs_last_stats_json(NULL) != NULL) fprintf(stderr, "stats of NULL engine\n"), failures++;
  /* A snapshot that is missing on one rank fails the load everywhere. */
  rc = gs_load_snapshot(e, rank == bad ? "/nonexistent/gradsync.snap" : NULL);
  report("load missing snapshot", rc, GS_ERR_RANK_FAILED, "failed");
  fill(6);
  {
    float *grads[NL] = {wg, bg};
    report("step 6", gs_sync(e, grads, NL), GS_OK, NULL);
    if (!bias_ok(6)) fprintf(stderr, "rank %d: step 6: wrong bias\n", rank), failures++;
  }
  /* gs_sync_device: host memory is gs_sync; CUDA memory on one rank (host
   * pointers here: no GPU, or a library without CUDA) and an out-of-range
   * memory value on one rank fail the step on every rank; then it works. */
  for (int step = 7; step < 11; step++) {
    float *grads[NL] = {wg, bg};
    fill(step);
    gs_memory mem = GS_MEMORY_HOST;
    if (rank == bad && step == 8) mem = GS_MEMORY_CUDA;
    if (rank == bad && step == 9) mem = (gs_memory)7;
    rc = gs_sync_device(e, grads, NL, mem, NULL);
    snprintf(check, sizeof check, "sync_device step %d", step);
    if (step == 8 || step == 9) {
      snprintf(needle, sizeof needle, "rank %d failed in step", bad);
      report(check, rc, GS_ERR_RANK_FAILED, needle);
      const char *cause = step == 9 ? "memory 7 is not a gs_memory" : "gs_sync_device";
      if (!strstr(gs_last_error(), cause))
        fprintf(stderr, "rank %d: sync_device step %d: cause missing\n", rank, step), failures++;
    } else {
      report(check, rc, GS_OK, NULL);
      if (!bias_ok(step))
        fprintf(stderr, "rank %d: sync_device step %d: wrong bias\n", rank, step), failures++;
    }
  }
  gs_engine_destroy(e);

  /* Bad options on one rank: creation fails on every rank. */
  e = NULL;
  rc = gs_engine_create(MPI_COMM_WORLD, rank == bad ? "{\"momentun\": 0.9}" : "{}", &e);
  snprintf(needle, sizeof needle, "rank %d failed", bad);
  report("create with bad options on one rank", rc, GS_ERR_RANK_FAILED, needle);
  if (e) fprintf(stderr, "rank %d: engine from a failed create\n", rank), failures++;
  gs_engine_destroy(e);

  /* weight_decay needs weights that gs_sync cannot take: refused at
   * creation, on every rank (before, every later gs_sync failed). */
  e = NULL;
  rc = gs_engine_create(MPI_COMM_WORLD, rank == bad ? "{\"weight_decay\": 0.0001}" : "{}", &e);
  report("create with weight_decay on one rank", rc, GS_ERR_RANK_FAILED, "weight_decay");
  if (e) fprintf(stderr, "rank %d: engine from a failed create\n", rank), failures++;
  gs_engine_destroy(e);

  /* delay > 1 writes the weights back at each communicating step: the same. */
  e = NULL;
  rc = gs_engine_create(MPI_COMM_WORLD, rank == bad ? "{\"delay\": 2}" : "{}", &e);
  report("create with delay 2 on one rank", rc, GS_ERR_RANK_FAILED, "delay > 1 is not available");
  if (e) fprintf(stderr, "rank %d: engine from a failed create\n", rank), failures++;
  gs_engine_destroy(e);

  /* Registration problems on one rank fail every rank. */
  gs_engine_create(MPI_COMM_WORLD, NULL, &e);
  rc = gs_register(e, rank == bad ? NULL : "w", wshape, 2, "dense");
  report("register NULL name on one rank", rc, GS_ERR_RANK_FAILED, "name is NULL");
  gs_engine_destroy(e);
  gs_engine_create(MPI_COMM_WORLD, NULL, &e);
  rc = gs_register(e, "w", wshape, 2, rank == bad ? "rgc:bogus=1" : "rgc:density=0.01");
  report("register bad strategy on one rank", rc, GS_ERR_RANK_FAILED, "rgc:bogus=1");
  gs_engine_destroy(e);

  /* A mismatched layer table (needs two ranks): `bad` registers another
   * shape; the registration and every later step fail on every rank. */
  if (nprocs > 1) {
    const size_t other[2] = {10, 99};
    gs_engine_create(MPI_COMM_WORLD, NULL, &e);
    rc = gs_register(e, "w", rank == bad ? other : wshape, 2, "dense");
    report("register mismatched shape", rc, GS_ERR_RANK_FAILED, "not the same on every rank");
    float *grads[1] = {wg};
    rc = gs_sync(e, grads, 1);
    report("step after mismatch", rc, GS_ERR_RANK_FAILED, "layer table differs");
    gs_engine_destroy(e);
  }

  /* gs_allreduce with a different count on one rank, or a NULL buffer. */
  rc = gs_allreduce(MPI_COMM_WORLD, wg, rank == bad ? 999 : 1000, GS_FLOAT32, GS_ALGO_RING,
                    GS_OP_SUM);
  report("allreduce count mismatch", rc, nprocs > 1 ? GS_ERR_RANK_FAILED : GS_OK, NULL);
  rc = gs_allreduce(MPI_COMM_WORLD, rank == bad ? NULL : wg, 1000, GS_FLOAT32,
                    GS_ALGO_RABENSEIFNER, GS_OP_AVERAGE);
  report("allreduce NULL buffer on one rank", rc, GS_ERR_RANK_FAILED, "buf is NULL");
  /* An out-of-range enum value on one rank is an error, not undefined
     behaviour (the library receives the integer). */
  rc = gs_allreduce(MPI_COMM_WORLD, wg, 1000, GS_FLOAT32,
                    rank == bad ? (gs_algo)7 : GS_ALGO_RING, GS_OP_SUM);
  report("allreduce algo out of range on one rank", rc, GS_ERR_RANK_FAILED, "not a gs_algo");
  /* dtype, algorithm or operation that differ on one rank: agreed, never
     mixed on the wire (a hang, or half-summed half-averaged results). */
  rc = gs_allreduce(MPI_COMM_WORLD, wg, 500, rank == bad ? GS_FLOAT64 : GS_FLOAT32,
                    GS_ALGO_RABENSEIFNER, GS_OP_SUM);
  report("allreduce dtype mismatch", rc, nprocs > 1 ? GS_ERR_RANK_FAILED : GS_OK,
         nprocs > 1 ? "dtype differs" : NULL);
  rc = gs_allreduce(MPI_COMM_WORLD, wg, 1000, GS_FLOAT32,
                    rank == bad ? GS_ALGO_MPI : GS_ALGO_RING, GS_OP_SUM);
  report("allreduce algo mismatch", rc, nprocs > 1 ? GS_ERR_RANK_FAILED : GS_OK,
         nprocs > 1 ? "algorithm differs" : NULL);
  rc = gs_allreduce(MPI_COMM_WORLD, wg, 1000, GS_FLOAT32, GS_ALGO_RING,
                    rank == bad ? GS_OP_AVERAGE : GS_OP_SUM);
  report("allreduce op mismatch", rc, nprocs > 1 ? GS_ERR_RANK_FAILED : GS_OK,
         nprocs > 1 ? "operation differs" : NULL);
  /* MPI_COMM_NULL on every rank: refused before MPI sees it (its fatal
   * handler would end the job), alike on every rank. */
  rc = gs_allreduce(MPI_COMM_NULL, wg, 1000, GS_FLOAT32, GS_ALGO_RING, GS_OP_SUM);
  report("allreduce on MPI_COMM_NULL", rc, GS_ERR_INVALID, "MPI_COMM_NULL");

  int one = 1, sum = 0;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (sum != nprocs) failures++;
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  /* An engine used after MPI_Finalize: an error, as before MPI_Init (never
     an abort inside MPI). */
  gs_engine *late = NULL;
  if (gs_engine_create(MPI_COMM_WORLD, NULL, &late) != GS_OK) total++;
  if (rank == 0) printf(total ? "c failure: FAILED (%d checks)\n" : "c failure: OK\n", total);
  MPI_Finalize();
  rc = gs_sync(late, NULL, 0);
  {
    char line[2048];
    snprintf(line, sizeof line, "sync after MPI_Finalize | rc=%d | %s\n", rc, gs_last_error());
    keep(line);
    fputs(line, stdout);
  }
  int after = rc == GS_ERR_INVALID && strstr(gs_last_error(), "finalized") != NULL;
  if (!after) fprintf(stderr, "rank %d: sync after MPI_Finalize: rc %d, %s\n", rank, rc, gs_last_error());
  gs_engine_destroy(late);
  write_kept();
  return total || !after ? 1 : 0;
}
