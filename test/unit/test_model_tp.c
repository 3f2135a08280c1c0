// deps: test/support/fixture.c trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c trainer/backend/fatal.c
/* test_model_tp: the tensor-parallel model against the serial one.
 *
 * For each configuration the parent builds the serial model, runs two micro-batches of forward
 * and backward (gradient accumulation with loss_scale 1/2, some targets ignored) and keeps the
 * losses, the full gradients and the logits of a forward without targets. Then it forks tp
 * ranks (test/support/fixture: store server thread, cpu comm on loopback); each builds the TP
 * model with the same seed and runs the same steps. Ranks check, against the parent's values
 * (inherited through fork):
 *   - initial weights assembled with model_export_tensor equal the serial ones exactly;
 *   - each loss within 1e-5 relative (and the same bits on every tp rank, since the losses come
 *     out of identical all-reduced values);
 *   - every gradient, assembled across tp like the weights (the unit's parameter pointer
 *     aimed at its gradients, then model_export_tensor), within 1e-4 of the largest
 *     magnitude in that tensor (max |tp - serial| / max |serial|);
 *   - logits of a forward without targets (gathered when the output is vocab-sharded) within
 *     1e-5 relative to the largest logit;
 *   - for tp 2 under the default plan, parameters per rank at most 55% of the serial model's;
 *   - with full activation checkpointing, the same loss and gradient bits as without.
 * Shapes are tiny (dim 16, 2 layers) and N = B*T = 14 rows, so tp 4 with sequence parallelism
 * pads rows to 16; one configuration has a vocabulary of 97 (padded to 98 / 100). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/net.h"
#include "test/support/fixture.h"
#include "trainer/backend/backend.h"
#include "trainer/comm/comm.h"
#include "trainer/model/model.h"

#define B 2
#define T 7
#define N (B * T)
#define SEED 1234
#define INIT_STD 0.2
#define LOSS_TOL 1e-5
#define GRAD_TOL 1e-4
#define LOGIT_TOL 1e-5

typedef struct {
  const char *name;
  int tp, sp, lp, vocab, kv;
  const char *replicate[4]; /* modules the plan keeps whole */
} tp_case_t;

/* The serial model's results for one case, computed in the parent before forking. */
typedef struct {
  plan_model_t cfg;
  int32_t tok[2][N], tgt[2][N];
  float loss[2];
  int n_tensors;
  float **param, **grad; /* per tensor, full */
  float *logits;         /* (N, V) forward of tok[0] without targets */
  size_t num_params;
} serial_ref_t;

static const tp_case_t *g_case;
static serial_ref_t g_ref;

static plan_model_t make_cfg(const tp_case_t *c) {
  plan_model_t cfg = {.dim = 16, .n_layers = 2, .n_heads = 4, .n_kv_heads = c->kv, .vocab_size = c->vocab,
                      .max_seq_len = 16, .hidden_dim = 32, .rope_theta = 10000.0, .norm_eps = 1e-5};
  return cfg;
}

static backend_t *make_backend(void) {
  char err[256] = "";
  backend_t *be = backend_create("cpu", 1, err, sizeof err);
  if (!be) fprintf(stderr, "backend: %s\n", err);
  return be;
}

/* Serial forward/backward of both micro-batches and the reference values. */
static void serial_reference(const tp_case_t *c) {
  serial_ref_t *r = &g_ref;
  r->cfg = make_cfg(c);
  uint32_t s = 99;
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < N; i++) {
      s = s * 1664525u + 1013904223u;
      r->tok[k][i] = (int32_t)((s >> 8) % (uint32_t)c->vocab);
      s = s * 1664525u + 1013904223u;
      r->tgt[k][i] = i % 5 == 3 ? -1 : (int32_t)((s >> 8) % (uint32_t)c->vocab); /* some ignored */
    }
  backend_t *be = make_backend();
  assert_non_null(be);
  model_t *m = NULL;
  char err[256] = "";
  if (model_create(&m, &r->cfg, be, B, T, 0, 0, err, sizeof err)) fail_msg("serial model: %s", err);
  model_init_random(m, SEED, INIT_STD);
  model_zero_grad(m);
  for (int k = 0; k < 2; k++) {
    assert_int_equal(model_forward(m, r->tok[k], r->tgt[k], B, T, &r->loss[k]), 0);
    assert_int_equal(model_backward(m, 0.5f), 0);
  }
  r->num_params = model_num_params(m);
  r->n_tensors = model_num_tensors(m);
  r->param = calloc((size_t)r->n_tensors, sizeof *r->param);
  r->grad = calloc((size_t)r->n_tensors, sizeof *r->grad);
  for (int i = 0; i < r->n_tensors; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    r->param[i] = malloc(t->numel * sizeof(float));
    r->grad[i] = malloc(t->numel * sizeof(float));
    memcpy(r->param[i], model_params(m) + t->offset, t->numel * sizeof(float));
    memcpy(r->grad[i], model_grads(m) + t->offset, t->numel * sizeof(float));
  }
  assert_int_equal(model_forward(m, r->tok[0], NULL, B, T, NULL), 0);
  r->logits = malloc((size_t)N * c->vocab * sizeof(float));
  memcpy(r->logits, model_logits(m), (size_t)N * c->vocab * sizeof(float));
  model_destroy(m);
  backend_destroy(be);
}

static void free_reference(void) {
  for (int i = 0; i < g_ref.n_tensors; i++) {
    free(g_ref.param[i]);
    free(g_ref.grad[i]);
  }
  free(g_ref.param);
  free(g_ref.grad);
  free(g_ref.logits);
  memset(&g_ref, 0, sizeof g_ref);
}

/* The default Llama plan with c's modules replaced by "replicate". */
static int make_plan(const tp_case_t *c, plan_tp_entry_t *plan) {
  static const struct {
    const char *module;
    plan_tp_style_t style;
  } def[] = {{"tok_embeddings", PLAN_TP_ROWWISE},  {"attention_norm", PLAN_TP_SEQUENCE_PARALLEL},
             {"attention.wq", PLAN_TP_COLWISE},    {"attention.wk", PLAN_TP_COLWISE},
             {"attention.wv", PLAN_TP_COLWISE},    {"attention.wo", PLAN_TP_ROWWISE},
             {"ffn_norm", PLAN_TP_SEQUENCE_PARALLEL}, {"feed_forward.w1", PLAN_TP_COLWISE},
             {"feed_forward.w3", PLAN_TP_COLWISE}, {"feed_forward.w2", PLAN_TP_ROWWISE},
             {"norm", PLAN_TP_SEQUENCE_PARALLEL},  {"output", PLAN_TP_COLWISE},
             {"attention", PLAN_TP_PREPARE_INPUT}, {"feed_forward", PLAN_TP_PREPARE_INPUT}};
  int n = (int)(sizeof def / sizeof def[0]);
  for (int i = 0; i < n; i++) {
    snprintf(plan[i].module, sizeof plan[i].module, "%s", def[i].module);
    plan[i].style = def[i].style;
    for (int k = 0; k < 4 && c->replicate[k]; k++)
      if (!strcmp(def[i].module, c->replicate[k])) plan[i].style = PLAN_TP_REPLICATE;
  }
  return n;
}

/* max |got - want| / max |want| over n values. */
static double rel_diff(const float *got, const float *want, size_t n, double *absmax) {
  double d = 0, w = 0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - want[i]);
    d = e > d ? e : d;
    w = fabs(want[i]) > w ? fabs(want[i]) : w;
  }
  if (absmax) *absmax = d;
  return w > 0 ? d / w : d;
}

/* Full tensor i assembled across tp: its parameters, or (grads) its gradients, exported by
 * pointing the unit's parameter buffer at the gradient buffer for the call. */
static int export_full(model_t *m, int i, int grads, float *out) {
  const model_tensor_t *t = model_tensor(m, i);
  size_t off, numel;
  model_unit_range(m, t->unit, &off, &numel);
  if (grads) model_set_unit_buffers(m, t->unit, model_grads(m) + off, NULL);
  int rc = model_export_tensor(m, i, out);
  if (grads) model_set_unit_buffers(m, t->unit, NULL, NULL);
  return rc;
}

/* Full activation checkpointing on the same tp rank: a second model (checkpoint_every 1) runs
 * the same two micro-batches; its losses and this rank's gradients must equal m's bit for bit
 * (tolerance: none; the recomputation reruns the tp collectives, which are deterministic). */
static int check_checkpointed(model_t *m, model_opts_t opts, backend_t *be, const float *losses, int rank,
                              const char *name) {
  const serial_ref_t *r = &g_ref;
  opts.checkpoint_every = 1;
  model_t *mc = NULL;
  char err[256] = "";
  if (model_create_opts(&mc, &r->cfg, be, &opts, err, sizeof err)) {
    fprintf(stderr, "rank %d: %s: checkpointed model: %s\n", rank, name, err);
    return 1;
  }
  model_init_random(mc, SEED, INIT_STD);
  model_zero_grad(mc);
  int bad = 0;
  for (int k = 0; k < 2 && !bad; k++) {
    float loss = NAN;
    if (model_forward(mc, r->tok[k], r->tgt[k], B, T, &loss) || model_backward(mc, 0.5f)) {
      fprintf(stderr, "rank %d: %s: checkpointed micro-batch %d: %s\n", rank, name, k, model_errmsg(mc));
      bad = 1;
    } else if (memcmp(&loss, &losses[k], sizeof loss)) {
      fprintf(stderr, "rank %d: %s: checkpointed loss %.9g differs from %.9g\n", rank, name, loss, losses[k]);
      bad = 1;
    }
  }
  size_t np = model_num_params(m), ndiff = 0;
  for (size_t i = 0; i < np && !bad; i++)
    ndiff += memcmp(&model_grads(mc)[i], &model_grads(m)[i], sizeof(float)) != 0;
  if (ndiff) {
    fprintf(stderr, "rank %d: %s: checkpointed: %zu of %zu gradients differ (tolerance: none)\n", rank, name, ndiff,
            np);
    bad = 1;
  }
  model_destroy(mc);
  return bad;
}

static int rank_main(int rank, int n, store_t *st, void *arg) {
  const tp_case_t *c = g_case;
  serial_ref_t *r = &g_ref;
  comm_t *comm = NULL;
  backend_t *be = make_backend();
  if (!be || fixture_comm_open(&comm, "tp", rank, n, st, 20000)) return 1;
  plan_tp_entry_t plan[PLAN_TP_PLAN_MAX];
  model_tp_t tpo = {.comm = comm, .sequence_parallel = c->sp, .loss_parallel = c->lp, .plan = plan};
  tpo.n_plan = make_plan(c, plan);
  model_opts_t opts = {.max_b = B, .max_t = T, .tp = &tpo};
  model_t *m = NULL;
  char err[256] = "";
  int bad = 0;
  if (model_create_opts(&m, &r->cfg, be, &opts, err, sizeof err)) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    return 1;
  }
  model_init_random(m, SEED, INIT_STD);
  model_zero_grad(m);

  double frac = (double)model_num_params(m) / (double)r->num_params;
  if (n == 2 && !c->replicate[0] && frac > 0.55) { /* the default plan splits all but the norms */
    fprintf(stderr, "rank %d: %s: %.1f%% of the serial parameters per rank (limit 55%%)\n", rank, c->name,
            100 * frac);
    bad = 1;
  }

  float *full = malloc((size_t)c->vocab * 64 * sizeof(float) + 4096 * sizeof(float));
  for (int i = 0; i < model_num_tensors(m) && !bad; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    size_t fn = (size_t)t->full_shape[0] * t->full_shape[1];
    if (export_full(m, i, 0, full) || memcmp(full, r->param[i], fn * sizeof(float)) != 0) {
      fprintf(stderr, "rank %d: %s: initial %s differs from the serial model's (tolerance: exact)\n", rank, c->name,
              t->name);
      bad = 1;
    }
  }

  double loss_d = 0, grad_d = 0, logit_d = 0;
  const char *worst = "";
  float losses[2] = {NAN, NAN};
  for (int k = 0; k < 2 && !bad; k++) {
    float loss = NAN;
    if (model_forward(m, r->tok[k], r->tgt[k], B, T, &loss) || model_backward(m, 0.5f)) {
      fprintf(stderr, "rank %d: %s: micro-batch %d: %s\n", rank, c->name, k, model_errmsg(m));
      bad = 1;
      break;
    }
    losses[k] = loss;
    double d = fabs((double)loss - r->loss[k]) / fabs((double)r->loss[k]);
    loss_d = d > loss_d ? d : loss_d;
    /* the same loss bits on every tp rank */
    float all[64];
    float mine = loss;
    if (comm_all_gather(comm, &mine, all, 1, DT_F32)) bad = 1;
    for (int j = 0; j < n && !bad; j++)
      if (memcmp(&all[j], &mine, sizeof mine)) {
        fprintf(stderr, "rank %d: %s: loss %.9g differs from rank %d's %.9g\n", rank, c->name, mine, j, all[j]);
        bad = 1;
      }
  }
  for (int i = 0; i < model_num_tensors(m) && !bad; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    size_t fn = (size_t)t->full_shape[0] * t->full_shape[1];
    if (export_full(m, i, 1, full)) {
      bad = 1;
      break;
    }
    double d = rel_diff(full, r->grad[i], fn, NULL);
    if (d > grad_d) grad_d = d, worst = t->name;
  }
  if (!bad) {
    if (model_forward(m, r->tok[0], NULL, B, T, NULL))
      fprintf(stderr, "rank %d: %s: forward without targets: %s\n", rank, c->name, model_errmsg(m));
    const float *lg = model_logits(m);
    if (!lg) {
      fprintf(stderr, "rank %d: %s: no logits after a forward without targets\n", rank, c->name);
      bad = 1;
    } else {
      logit_d = rel_diff(lg, r->logits, (size_t)N * c->vocab, NULL);
    }
  }
  if (!bad) bad = check_checkpointed(m, opts, be, losses, rank, c->name);
  if (rank == 0 && !bad)
    printf("  %-28s tp %d: loss rel diff %.2e (tol %.0e), grads max rel diff %.2e (tol %.0e, worst %s), "
           "logits %.2e (tol %.0e), params/rank %.1f%%; full checkpointing: same bits\n",
           c->name, n, loss_d, LOSS_TOL, grad_d, GRAD_TOL, worst, logit_d, LOGIT_TOL, 100 * frac);
  if (loss_d > LOSS_TOL || grad_d > GRAD_TOL || logit_d > LOGIT_TOL) {
    fprintf(stderr, "rank %d: %s: loss %.2e, grads %.2e (%s), logits %.2e over tolerance\n", rank, c->name, loss_d,
            grad_d, worst, logit_d);
    bad = 1;
  }
  fflush(stdout);
  free(full);
  model_destroy(m);
  comm_destroy(comm);
  backend_destroy(be);
  return bad;
}

static void run_case(const tp_case_t *c) {
  serial_reference(c);
  g_case = c;
  int failed = fixture_run_ranks(c->tp, rank_main, NULL, 60);
  free_reference();
  assert_int_equal(failed, 0);
}

static const tp_case_t k_cases[] = {
    {"tp2", 2, 0, 0, 64, 2, {NULL}},
    {"tp2+sp", 2, 1, 0, 64, 2, {NULL}},
    {"tp2+sp+loss_parallel", 2, 1, 1, 64, 2, {NULL}},
    {"tp2+lp, no sp", 2, 0, 1, 64, 2, {NULL}},
    {"tp2+sp, output replicate", 2, 1, 1, 64, 2, {"output"}},
    {"tp2+sp, embedding replicate", 2, 1, 1, 64, 2, {"tok_embeddings"}},
    {"tp2, attention replicate", 2, 0, 1, 64, 2, {"attention.wq", "attention.wk", "attention.wv", "attention.wo"}},
    {"tp2+sp+lp, vocab 97", 2, 1, 1, 97, 2, {NULL}},
    {"tp2, vocab 97, no lp", 2, 0, 0, 97, 2, {NULL}},
    {"tp4+sp+lp, vocab 97", 4, 1, 1, 97, 4, {NULL}},
    {"tp4, vocab 97", 4, 0, 0, 97, 4, {NULL}},
};

static void test_tp_cases(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++)
    run_case(&k_cases[i]);
}

/* Heads that tp does not divide are refused at creation with a message naming them. */
static int rank_bad_heads(int rank, int n, store_t *st, void *arg) {
  (void)arg;
  comm_t *comm = NULL;
  backend_t *be = make_backend();
  if (!be || fixture_comm_open(&comm, "tp", rank, n, st, 20000)) return 1;
  tp_case_t c = {"bad", 2, 0, 0, 64, 3, {NULL}};
  plan_model_t cfg = make_cfg(&c);
  cfg.n_heads = 3;
  cfg.dim = 12;
  model_tp_t tpo = {.comm = comm};
  model_opts_t opts = {.max_b = B, .max_t = T, .tp = &tpo};
  model_t *m = NULL;
  char err[256] = "";
  int rc = model_create_opts(&m, &cfg, be, &opts, err, sizeof err);
  if (rank == 0) printf("  n_heads 3 on tp 2: %s\n", err);
  int bad = rc == 0 || !strstr(err, "n_heads=3");
  model_destroy(m);
  comm_destroy(comm);
  backend_destroy(be);
  return bad;
}

static void test_bad_heads(void **state) {
  (void)state;
  assert_int_equal(fixture_run_ranks(2, rank_bad_heads, NULL, 60), 0);
}

/* Errors reach the caller: MESHRUN_FAULT_COMM=1:2:fwd|bwd makes rank 1's first tensor-parallel
 * collective of the second training pass (its forward, or its backward) fail as a lost
 * connection would. Both ranks must get MODEL_ECOMM from that very call (the backward's failure
 * is returned, not only noticed at the next forward), the faulted rank naming the injected
 * fault, the other the collective it was in; and both well under the 30 s comm timeout (limit
 * 5 s), since the faulted rank shuts its ring down and the peer reads end-of-file. Pass 1 is
 * untouched on both ranks. */
typedef struct {
  const char *phase; /* "fwd" or "bwd" */
} fault_case_t;

static int rank_fault(int rank, int n, store_t *st, void *arg) {
  const fault_case_t *fc = arg;
  char spec[32], rs[16];
  snprintf(spec, sizeof spec, "1:2:%s", fc->phase);
  snprintf(rs, sizeof rs, "%d", rank);
  setenv("MESHRUN_FAULT_COMM", spec, 1);
  setenv("RANK", rs, 1);
  comm_t *comm = NULL;
  backend_t *be = make_backend();
  if (!be || fixture_comm_open(&comm, "tp", rank, n, st, 30000)) return 1;
  tp_case_t c = {"fault", 2, 1, 1, 64, 2, {NULL}};
  plan_tp_entry_t plan[PLAN_TP_PLAN_MAX];
  model_tp_t tpo = {.comm = comm, .sequence_parallel = 1, .loss_parallel = 1, .plan = plan};
  tpo.n_plan = make_plan(&c, plan);
  model_opts_t opts = {.max_b = B, .max_t = T, .tp = &tpo};
  plan_model_t cfg = make_cfg(&c);
  model_t *m = NULL;
  char err[256] = "";
  if (model_create_opts(&m, &cfg, be, &opts, err, sizeof err)) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    return 1;
  }
  model_init_random(m, SEED, INIT_STD);
  int32_t tok[N], tgt[N];
  for (int i = 0; i < N; i++) tok[i] = (int32_t)((i * 7 + 3) % 64), tgt[i] = (int32_t)((i * 5 + 1) % 64);
  int bad = 0, fwd = !strcmp(fc->phase, "fwd");
  float loss = 0;
  model_zero_grad(m);
  if (model_forward(m, tok, tgt, B, T, &loss) || model_backward(m, 1.0f)) {
    fprintf(stderr, "rank %d: pass 1 (no fault) failed: %s\n", rank, model_errmsg(m));
    bad = 1;
  }
  double t0 = (double)net_now_ms();
  int rf = bad ? -99 : model_forward(m, tok, tgt, B, T, &loss);
  int rb = bad || rf ? 0 : model_backward(m, 1.0f);
  double ms = (double)net_now_ms() - t0;
  int got = fwd ? rf : rb;
  const char *msg = model_errmsg(m);
  printf("  fault in the %s, rank %d: %s -> %d after %.0f ms (limit 5000): \"%s\"\n", fc->phase, rank,
         fwd ? "model_forward" : "model_backward", got, ms, msg);
  fflush(stdout);
  if (!bad && (got != MODEL_ECOMM || (!fwd && rf != 0))) {
    fprintf(stderr, "rank %d: fault in the %s: forward %d, backward %d, want %s\n", rank, fc->phase, rf, rb,
            fwd ? "forward MODEL_ECOMM" : "forward 0, backward MODEL_ECOMM");
    bad = 1;
  }
  if (!bad && fwd && !isnan(loss)) {
    fprintf(stderr, "rank %d: a failed forward left loss %f, want nan\n", rank, loss);
    bad = 1;
  }
  if (!bad && !strstr(msg, rank == 1 ? "fault injected" : "tensor-parallel")) {
    fprintf(stderr, "rank %d: message does not name the cause: %s\n", rank, msg);
    bad = 1;
  }
  if (!bad && ms > 5000) {
    fprintf(stderr, "rank %d: the failure took %.0f ms (limit 5000, comm timeout 30000)\n", rank, ms);
    bad = 1;
  }
  /* The tp group stays broken: the next forward fails at once with the first cause. */
  if (!bad && model_forward(m, tok, tgt, B, T, &loss) != MODEL_ECOMM) {
    fprintf(stderr, "rank %d: a forward after the failure did not fail\n", rank);
    bad = 1;
  }
  model_destroy(m);
  comm_destroy(comm);
  backend_destroy(be);
  return bad;
}

static void test_fault_forward(void **state) {
  (void)state;
  fault_case_t fc = {"fwd"};
  assert_int_equal(fixture_run_ranks(2, rank_fault, &fc, 60), 0);
}

static void test_fault_backward(void **state) {
  (void)state;
  fault_case_t fc = {"bwd"};
  assert_int_equal(fixture_run_ranks(2, rank_fault, &fc, 60), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tp_cases),
      cmocka_unit_test(test_bad_heads),
      cmocka_unit_test(test_fault_forward),
      cmocka_unit_test(test_fault_backward),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
