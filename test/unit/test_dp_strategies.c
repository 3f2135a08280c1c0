// deps: trainer/run/train.c trainer/run/hooks.c trainer/run/metrics.c trainer/run/tensorboard.c trainer/run/opprof.c trainer/run/weights.c trainer/formats/data.c trainer/formats/tokenizer.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/parallel/pipeline_run.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c launcher/store_server.c test/support/fixture.c test/support/step_run.c test/support/serial_run.c
/* test_dp_strategies: the multi-rank data-parallel strategies (trainer/parallel/dp_ddp.c,
 * dp_fsdp.c) against the serial one, with real ranks: forked processes on loopback through a
 * store (test/support/fixture), "cpu" communicators, the tiny model of test/support/serial_run.
 *
 * Two ranks each train two steps of train_step with micro-batches of 2 sequences; the serial
 * reference trains the same two steps with one micro-batch of the same 4 sequences (the loader
 * gives dp rank r of 2 the sequences r * 2.. of the global batch). Afterwards:
 * - DDP (mesh.dp_replicate=2): both ranks hold bit-identical parameters (rank 0's broadcast to
 *   rank 1), within TOL of the reference's; the reported loss (the mean over dp) within TOL_LOSS;
 * - FSDP (mesh.dp_shard=2): the parameters gathered unit by unit from the shards are within TOL
 *   of the reference's, and the same on both ranks;
 * - ZeRO-1 (DDP with parallel.zero=1): as DDP.
 * Each strategy is the one asked for: its name, and the AdamW moments shared between the ranks
 * under ZeRO-1 and FSDP (half on each), whole on each under DDP.
 * Tolerances: the reductions add the same numbers in another order (float), and AdamW's first
 * steps amplify that only on gradients near zero; TOL is 1/30 of lr, about the largest step
 * AdamW takes, so a wrong or missing reduction fails it. Each rank prints what it saw. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/fixture.h"
#include "test/support/step_run.h"

#define STEPS 2
#define ALARM_S 60
static const double TOL = 1e-5, TOL_LOSS = 1e-6;

typedef struct {
  const char *strategy; /* what dp_create must have chosen */
  const char *sets[4];
  int nsets;
  int optim_shards; /* the ranks that share the AdamW moments: 1 for DDP, 2 for ZeRO-1 and FSDP */
} case_t;

/* The reference: one process, micro-batches of 4 (the global batch). Losses into loss[STEPS],
 * parameters into a malloc'ed array. */
static float *reference(double loss[STEPS], size_t *n, char *err, size_t errlen) {
  static const char *sets[] = {"train.micro_batch_size=4"};
  step_run_t r;
  if (step_run_open(&r, sets, 1, 0, 1, NULL, err, errlen)) return NULL;
  float *h = malloc(model_num_params(r.m) * sizeof(float));
  int rc = h ? 0 : -1;
  for (int s = 0; s < STEPS && !rc; s++) {
    train_result_t res;
    rc = train_step(&r.t, s, &res, err, errlen);
    loss[s] = res.loss;
  }
  if (!rc) rc = step_run_params(&r, h, err, errlen);
  *n = model_num_params(r.m);
  step_run_close(&r);
  if (rc) {
    free(h);
    return NULL;
  }
  return h;
}

static double max_diff(const float *a, const float *b, size_t n, size_t *at) {
  double m = 0;
  for (size_t i = 0; i < n; i++) {
    const double d = fabs((double)a[i] - b[i]);
    if (d > m || isnan(d)) m = d, *at = i;
  }
  return m;
}

static int rank_main(int rank, int n, store_t *st, void *arg) {
  const case_t *c = arg;
  char err[1024] = "";
  double ref_loss[STEPS];
  size_t N = 0, at = 0;
  float *ref = reference(ref_loss, &N, err, sizeof err), *mine = NULL, *peer = NULL;
  step_run_t r;
  int bad = 1;
  if (!ref) goto out;
  if (step_run_open(&r, c->sets, c->nsets, rank, n, st, err, sizeof err)) goto out;
  if (strcmp(r.dp->name, c->strategy) || r.p.train.grad_accum_steps != 1 || model_num_params(r.m) != N) {
    snprintf(err, sizeof err, "strategy %s (want %s), %d micro-batches (want 1), %zu parameters (want %zu)",
             r.dp->name, c->strategy, r.p.train.grad_accum_steps, model_num_params(r.m), N);
    goto close;
  }
  dp_memory_t mem;
  dp_memory(r.dp, &mem);
  if (mem.optim_bytes * (size_t)c->optim_shards != 2 * N * sizeof(float)) {
    snprintf(err, sizeof err, "%zu bytes of AdamW moments, want %zu (shared by %d ranks)", mem.optim_bytes,
             2 * N * sizeof(float) / (size_t)c->optim_shards, c->optim_shards);
    goto close;
  }
  for (int s = 0; s < STEPS; s++) {
    train_result_t res;
    if (train_step(&r.t, s, &res, err, sizeof err)) goto close;
    const double dl = fabs(res.loss - ref_loss[s]);
    printf("  %s rank %d step %d: loss %.9g, serial %.9g: difference %.3g (tolerance %.0e)\n", c->strategy, rank,
           s + 1, res.loss, ref_loss[s], dl, TOL_LOSS);
    if (!(dl <= TOL_LOSS)) {
      snprintf(err, sizeof err, "step %d: the loss differs from the serial one by %.3g", s + 1, dl);
      goto close;
    }
  }
  mine = malloc(N * sizeof(float));
  peer = malloc(N * sizeof(float));
  if (!mine || !peer || step_run_params(&r, mine, err, sizeof err)) goto close;
  const double d = max_diff(mine, ref, N, &at);
  printf("  %s rank %d after %d steps: largest parameter difference from serial %.3g (element %zu of %zu; "
         "tolerance %.0e)\n", c->strategy, rank, STEPS, d, at, N, TOL);
  if (!(d <= TOL)) {
    snprintf(err, sizeof err, "parameter %zu differs from the serial step's by %.3g", at, d);
    goto close;
  }
  /* every rank ends with the same parameters: rank 0's, bit for bit */
  memcpy(peer, mine, N * sizeof(float));
  comm_t *world = mesh_host_comm(r.mesh, "world");
  if (comm_broadcast(world, peer, N, DT_F32, 0)) {
    snprintf(err, sizeof err, "broadcast: %s", comm_errmsg(world));
    goto close;
  }
  size_t differing = 0;
  for (size_t i = 0; i < N; i++) differing += memcmp(&peer[i], &mine[i], sizeof(float)) != 0;
  printf("  %s rank %d: %zu of %zu parameters differ from rank 0's (tolerance: none, the bits)\n", c->strategy, rank,
         differing, N);
  if (differing) {
    snprintf(err, sizeof err, "%zu parameters differ from rank 0's", differing);
    goto close;
  }
  bad = 0;
close:
  step_run_close(&r);
out:
  if (bad) fprintf(stderr, "%s rank %d: %s\n", c->strategy, rank, err);
  fflush(stdout);
  free(ref);
  free(mine);
  free(peer);
  return bad;
}

static void run_case(const case_t *c) { assert_int_equal(fixture_run_ranks(2, rank_main, (void *)c, ALARM_S), 0); }

static void test_ddp(void **state) {
  const case_t c = {"ddp", {"mesh.dp_replicate=2"}, 1, 1};
  run_case(&c);
}

static void test_zero1(void **state) {
  const case_t c = {"ddp", {"mesh.dp_replicate=2", "parallel.zero=1"}, 2, 2};
  run_case(&c);
}

static void test_fsdp(void **state) {
  const case_t c = {"fsdp", {"mesh.dp_shard=2"}, 1, 2};
  run_case(&c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ddp),
      cmocka_unit_test(test_zero1),
      cmocka_unit_test(test_fsdp),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
