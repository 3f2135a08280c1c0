// deps: trainer/run/sample.c trainer/formats/tokenizer.c trainer/formats/data.c trainer/run/weights.c trainer/formats/interop.c trainer/formats/safetensors.c trainer/model/model.c trainer/model/ring_attention.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/model/optim.c trainer/formats/ckpt.c trainer/parallel/mesh.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/comm_staged.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/net.c common/store.c common/store_proto.c common/log.c common/err.c common/env.c common/fs.c test/support/model_cfg.c trainer/backend/fatal.c
/* test_sample: the KV-cache decode against the full forward, and the draw's filters.
 *
 * KV cache: greedy generation through model_kv_* (prefill, one-token steps, the sliding window
 * once max_seq_len is full) must pick exactly the tokens that full forwards over the last
 * max_seq_len tokens pick, on a small random GQA model and on llama2.c's stories260K (skipped
 * when ../shared/data/stories260K.bin is absent), with the last-position logits of every step
 * within KV_TOL relative to the largest logit (the max difference is printed; the two paths
 * differ only in summation order: attention as matmuls over the cache vs the fused kernel, one
 * row vs all rows). The
 * same with teacher forcing over a fixed sequence, in fp32 and in bf16, where the tolerance is
 * BF16_TOL times bf16's own error (the bf16 full forward against the fp32 one). Misuse of
 * the cache (two tokens after the prefill, past capacity) is refused with a message.
 * Draw: temperature 0 is the arg max; top_k 1 and a tiny top_p equal it; with a fixed seed
 * top_k k draws only among the k largest logits (and, over many draws, each of them); top_p
 * draws only from the nucleus; top_k 0 / top_p 1 reproduce the plain softmax draw bit for bit;
 * the same seed gives the same tokens. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/log.h"
#include "test/support/model_cfg.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
#include "trainer/run/sample.h"
#include "trainer/run/weights.h"

#define KV_TOL 1e-5   /* fp32 logits: max|diff| <= KV_TOL * max(1, max|logit|), as test_interop.py */
#define BF16_TOL 2.0 /* bf16: times the bf16 full forward's own max error against fp32 */

static backend_t *be;

/* ------------------------------------------------------------------ KV cache vs full forward */

typedef struct {
  int n_tokens;     /* generated */
  double max_diff;  /* over every step's last-position logits */
  double tol;       /* KV_TOL * max(1, max|logit|) */
  int first_differ; /* first generated index where the tokens differ, -1 when none */
  int32_t ids[1024];
  int n;
} greedy_t;

static int argmax(const float *x, int v) {
  int b = 0;
  for (int i = 1; i < v; i++)
    if (x[i] > x[b]) b = i;
  return b;
}

/* Greedy from prompt[0..np) for n_new tokens with a window of W positions, by both paths;
 * the full forward's tokens lead (both see the same sequence), the cache's are compared. m must
 * have activations for (1, W). */
static void greedy_both(model_t *m, int W, const int32_t *prompt, int np, int n_new, greedy_t *g) {
  const int v = model_vocab_size(m);
  char err[256];
  model_kv_t *kv = NULL;
  assert_int_equal(model_kv_create(&kv, m, W, err, sizeof err), 0);
  float *a = malloc((size_t)v * sizeof *a), *b = malloc((size_t)v * sizeof *b);
  memcpy(g->ids, prompt, (size_t)np * sizeof *prompt);
  g->n = np;
  g->max_diff = 0;
  g->first_differ = -1;
  double scale = 1;
  for (int k = 0; k < n_new; k++) {
    int t = g->n < W ? g->n : W;
    assert_int_equal(model_forward(m, g->ids + g->n - t, NULL, 1, t, NULL), 0);
    be->to_host(be, a, model_logits(m) + (size_t)(t - 1) * v, (size_t)v * sizeof *a);
    int rc;
    if (k == 0 || model_kv_len(kv) == W) {
      model_kv_reset(kv);
      rc = model_kv_forward(kv, g->ids + g->n - t, t);
    } else {
      rc = model_kv_forward(kv, g->ids + g->n - 1, 1);
    }
    if (rc) printf("model_kv_forward: %s\n", model_errmsg(m));
    assert_int_equal(rc, 0);
    be->to_host(be, b, model_kv_logits(kv), (size_t)v * sizeof *b);
    for (int i = 0; i < v; i++) {
      g->max_diff = fmax(g->max_diff, fabs((double)a[i] - b[i]));
      scale = fmax(scale, fabs(a[i]));
    }
    int ta = argmax(a, v), tb = argmax(b, v);
    if (ta != tb && g->first_differ < 0) g->first_differ = k;
    g->ids[g->n++] = ta;
  }
  g->n_tokens = n_new;
  g->tol = KV_TOL * scale;
  free(a);
  free(b);
  model_kv_destroy(kv);
}

static void test_kv_random_model(void **state) {
  /* GQA (4 heads, 2 kv heads), max_seq_len 100: the prefill, decode spans of 64 and 100
   * positions, then 50 tokens of sliding window */
  plan_model_t c = test_model_cfg(32, 2, 4, 2, 31, 96, 100);
  model_t *m = NULL;
  char err[256];
  assert_int_equal(model_create(&m, &c, be, 1, 100, 0, 0, err, sizeof err), 0);
  model_init_random(m, 11, 0.3);
  const int32_t prompt[5] = {3, 17, 5, 29, 8};
  greedy_t g;
  greedy_both(m, 100, prompt, 5, 145, &g);
  printf("  random model: %d greedy tokens (window 100, 50 of them sliding), KV cache vs full forward: tokens %s, "
         "logits max|diff| %.3g (tolerance %.3g)\n",
         g.n_tokens, g.first_differ < 0 ? "identical" : "DIFFER", g.max_diff, g.tol);
  assert_int_equal(g.first_differ, -1);
  assert_true(g.max_diff <= g.tol);
  /* the generation is not degenerate (a constant sequence would compare trivially) */
  int distinct = 0, seen[31] = {0};
  for (int i = 5; i < g.n; i++) distinct += !seen[g.ids[i]]++;
  assert_true(distinct >= 3);
  model_destroy(m);
}

/* Teacher forcing: the same 80 tokens through both paths; every position's logits compared.
 * Returns max|diff|; full (80, 31) gets the full forward's logits. */
static double forced_diff(dtype_t dt, float *full) {
  plan_model_t c = test_model_cfg(32, 2, 4, 1, 31, 96, 80);
  model_opts_t o = {.max_b = 1, .max_t = 80, .param_dtype = dt};
  model_t *m = NULL;
  model_kv_t *kv = NULL;
  char err[256];
  assert_int_equal(model_create_opts(&m, &c, be, &o, err, sizeof err), 0);
  model_init_random(m, 5, 0.3);
  int32_t ids[80];
  for (int i = 0; i < 80; i++) ids[i] = (i * 13 + 7) % 31;
  assert_int_equal(model_forward(m, ids, NULL, 1, 80, NULL), 0);
  float row[31];
  be->to_host(be, full, model_logits(m), 80 * 31 * sizeof *full);
  assert_int_equal(model_kv_create(&kv, m, 80, err, sizeof err), 0);
  double d = 0;
  assert_int_equal(model_kv_forward(kv, ids, 10), 0); /* prefill 10, then one by one */
  be->to_host(be, row, model_kv_logits(kv), sizeof row);
  for (int j = 0; j < 31; j++) d = fmax(d, fabs((double)row[j] - full[9 * 31 + j]));
  for (int i = 10; i < 80; i++) {
    assert_int_equal(model_kv_forward(kv, ids + i, 1), 0);
    be->to_host(be, row, model_kv_logits(kv), sizeof row);
    for (int j = 0; j < 31; j++) d = fmax(d, fabs((double)row[j] - full[i * 31 + j]));
  }
  /* misuse: a full cache, and more than one token after the prefill */
  assert_int_equal(model_kv_forward(kv, ids, 1), MODEL_EINVAL);
  printf("  refused: %s\n", model_errmsg(m));
  assert_non_null(strstr(model_errmsg(m), "up to the cache's 80 positions"));
  model_kv_reset(kv);
  assert_int_equal(model_kv_forward(kv, ids, 3), 0);
  assert_int_equal(model_kv_forward(kv, ids, 2), MODEL_EINVAL);
  int32_t bad = 31;
  model_kv_reset(kv);
  assert_int_equal(model_kv_forward(kv, &bad, 1), MODEL_EINVAL);
  assert_non_null(strstr(model_errmsg(m), "outside [0, 31)"));
  model_kv_destroy(kv);
  model_destroy(m);
  return d;
}

static void test_kv_teacher_forced(void **state) {
  static float f32[80 * 31], f16[80 * 31];
  double d32 = forced_diff(DT_F32, f32), d16 = forced_diff(DT_BF16, f16), own = 0, scale = 1;
  for (int i = 0; i < 80 * 31; i++) {
    own = fmax(own, fabs((double)f32[i] - f16[i]));
    scale = fmax(scale, fabs(f32[i]));
  }
  printf("  teacher-forced 80 tokens (MQA): logits max|diff| KV cache vs full forward: fp32 %.3g (tolerance %.3g), "
         "bf16 %.3g (tolerance %g x bf16's own error, full forward bf16 vs fp32: %.3g)\n",
         d32, KV_TOL * scale, d16, BF16_TOL, own);
  assert_true(d32 <= KV_TOL * scale);
  assert_true(d16 <= BF16_TOL * own);
}

static void test_kv_stories260k(void **state) {
  const char *path = "../shared/data/stories260K.bin";
  if (access(path, R_OK) != 0) {
    printf("  skipped: %s not found\n", path);
    skip();
  }
  weights_file_t *f = NULL;
  char err[512];
  assert_int_equal(weights_open(&f, path, err, sizeof err), 0);
  const plan_model_t *c = weights_model(f);
  assert_non_null(c);
  assert_int_equal(c->max_seq_len, 512);
  model_t *m = NULL;
  assert_int_equal(model_create(&m, c, be, 1, 512, 0, 0, err, sizeof err), 0);
  assert_int_equal(weights_load_file(m, f, err, sizeof err), 0);
  weights_close(f);
  const int32_t bos = 1;
  greedy_t g;
  greedy_both(m, 512, &bos, 1, 150, &g);
  printf("  stories260K: %d greedy tokens from BOS, KV cache vs full forward: tokens %s, logits max|diff| %.3g "
         "(tolerance %.3g)\n  ids:",
         g.n_tokens, g.first_differ < 0 ? "identical" : "DIFFER", g.max_diff, g.tol);
  for (int i = 0; i < g.n; i++) printf(" %d", g.ids[i]);
  printf("\n");
  assert_int_equal(g.first_differ, -1);
  assert_true(g.max_diff <= g.tol);
  model_destroy(m);
}

/* ------------------------------------------------------------------ the draw */

static void random_logits(float *x, int v, uint64_t seed) {
  rng_t r;
  rng_init(&r, seed, 1);
  for (int i = 0; i < v; i++) x[i] = (float)(3 * rng_normal(&r));
}

static sample_picker_t picker(double temperature, int top_k, double top_p, uint64_t seed, int v) {
  plan_sample_t s = {.temperature = temperature, .top_k = top_k, .top_p = top_p};
  sample_picker_t p;
  char err[128];
  assert_int_equal(sample_picker_init(&p, &s, seed, v, err, sizeof err), 0);
  return p;
}

static void test_greedy_equivalents(void **state) {
  enum { V = 200 };
  float x[V];
  int same_k = 0, same_p = 0;
  for (int row = 0; row < 200; row++) {
    random_logits(x, V, (uint64_t)row);
    if (row == 0) x[17] = x[argmax(x, V)]; /* a tie: the lower id wins everywhere */
    sample_picker_t g = picker(0, 0, 1, 1, V), k1 = picker(1.0, 1, 1, 1, V), p0 = picker(1.5, 0, 1e-9, 1, V);
    int want = sample_picker_next(&g, x);
    assert_int_equal(want, argmax(x, V));
    same_k += sample_picker_next(&k1, x) == want;
    same_p += sample_picker_next(&p0, x) == want;
    sample_picker_free(&g);
    sample_picker_free(&k1);
    sample_picker_free(&p0);
  }
  printf("  200 rows: top_k=1 equals greedy on %d, top_p=1e-9 on %d\n", same_k, same_p);
  assert_int_equal(same_k, 200);
  assert_int_equal(same_p, 200);
}

static void test_top_k_draws_among_k_largest(void **state) {
  enum { V = 100, K = 5, N = 20000 };
  float x[V];
  random_logits(x, V, 42);
  /* the K largest, and a flat distribution so that outside tokens would be drawn often */
  int32_t order[V];
  for (int i = 0; i < V; i++) order[i] = i;
  for (int i = 0; i < V; i++)
    for (int j = i + 1; j < V; j++)
      if (x[order[j]] > x[order[i]]) {
        int32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
      }
  int in_top[V] = {0}, hits[V] = {0}, outside = 0;
  for (int i = 0; i < K; i++) in_top[order[i]] = 1;
  sample_picker_t p = picker(50.0, K, 1, 7, V);
  for (int n = 0; n < N; n++) {
    int id = sample_picker_next(&p, x);
    hits[id]++;
    outside += !in_top[id];
  }
  sample_picker_free(&p);
  int covered = 0;
  for (int i = 0; i < K; i++) covered += hits[order[i]] > 0;
  printf("  top_k=%d, temperature 50, %d draws: %d outside the %d largest logits, %d of them drawn\n", K, N, outside, K,
         covered);
  assert_int_equal(outside, 0);
  assert_int_equal(covered, K);
  /* without the filter the same draws leave the top K most of the time */
  sample_picker_t all = picker(50.0, 0, 1, 7, V);
  int leave = 0;
  for (int n = 0; n < 1000; n++) leave += !in_top[sample_picker_next(&all, x)];
  sample_picker_free(&all);
  assert_true(leave > 500);
}

static void test_top_p_nucleus(void **state) {
  /* probabilities at temperature 1: 0.5, 0.25, 0.125, ... (logits log 2 apart) */
  enum { V = 8 };
  float x[V];
  for (int i = 0; i < V; i++) x[i] = (float)(-(double)i * log(2.0));
  sample_picker_t p = picker(1.0, 0, 0.7, 3, V); /* 0.5 + 0.25 >= 0.7: tokens 0 and 1 */
  int hits[V] = {0};
  for (int n = 0; n < 5000; n++) hits[sample_picker_next(&p, x)]++;
  sample_picker_free(&p);
  printf("  top_p=0.7 over 0.5, 0.25, 0.125...: draws %d, %d, then %d elsewhere\n", hits[0], hits[1],
         5000 - hits[0] - hits[1]);
  assert_int_equal(hits[0] + hits[1], 5000);
  assert_true(hits[1] > 1000 && hits[0] > 2500); /* renormalized 2:1 */
}

/* The draw of the versions before top_k/top_p, which the defaults must reproduce. */
static int old_draw(const float *logits, int v, double temperature, rng_t *r) {
  int best = 0;
  for (int i = 1; i < v; i++)
    if (logits[i] > logits[best]) best = i;
  double total = 0;
  for (int i = 0; i < v; i++) total += exp((logits[i] - logits[best]) / temperature);
  double u = rng_uniform(r) * total, acc = 0;
  for (int i = 0; i < v; i++) {
    acc += exp((logits[i] - logits[best]) / temperature);
    if (u < acc) return i;
  }
  return best;
}

static void test_defaults_and_seed(void **state) {
  enum { V = 300 };
  float x[V];
  rng_t r;
  rng_init(&r, 9, rng_hash_str("sample"));
  sample_picker_t p = picker(0.8, 0, 1, 9, V), q = picker(0.8, 40, 0.9, 9, V), q2 = picker(0.8, 40, 0.9, 9, V),
                  q3 = picker(0.8, 40, 0.9, 10, V);
  int differ_seed = 0;
  for (int row = 0; row < 300; row++) {
    random_logits(x, V, 1000 + (uint64_t)row);
    assert_int_equal(sample_picker_next(&p, x), old_draw(x, V, 0.8, &r));
    int a = sample_picker_next(&q, x), b = sample_picker_next(&q2, x);
    assert_int_equal(a, b);
    differ_seed += sample_picker_next(&q3, x) != a;
  }
  printf("  defaults: 300 draws equal the plain softmax draw; filtered draws repeat under a seed, another seed "
         "changes %d of 300\n", differ_seed);
  assert_true(differ_seed > 30);
  sample_picker_free(&p);
  sample_picker_free(&q);
  sample_picker_free(&q2);
  sample_picker_free(&q3);
}

static int setup(void **state) {
  log_init("[test_sample]");
  char err[256];
  be = backend_create("cpu", 1, err, sizeof err);
  return be ? 0 : -1;
}

static int teardown(void **state) {
  backend_destroy(be);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kv_random_model),     cmocka_unit_test(test_kv_teacher_forced),
      cmocka_unit_test(test_kv_stories260k),      cmocka_unit_test(test_greedy_equivalents),
      cmocka_unit_test(test_top_k_draws_among_k_largest), cmocka_unit_test(test_top_p_nucleus),
      cmocka_unit_test(test_defaults_and_seed),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
