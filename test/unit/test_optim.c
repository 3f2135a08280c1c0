// deps: trainer/model/optim.c trainer/backend/backend.c trainer/backend/backend_cpu.c common/env.c trainer/backend/fatal.c common/err.c
/* test_optim: the LR schedule at its key steps, the clip scale and the gradient sum of squares,
 * AdamW steps against a double-precision reference written here (PyTorch's AdamW formulas,
 * decoupled decay, per-tensor decay flags), and sharded ranges giving the same bits as the
 * whole buffer. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/model/optim.h"

static plan_train_t base_cfg(void) {
  plan_train_t c;
  memset(&c, 0, sizeof c);
  c.steps = 110;
  c.lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup_steps = 10;
  c.decay = PLAN_SCHED_COSINE;
  c.weight_decay = 0.1;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.grad_clip = 1.0;
  return c;
}

#define CHECK_LR(cfg, s, want)                                                                  \
  do {                                                                                          \
    double got_ = optim_lr(&(cfg), (s)), want_ = (want);                                        \
    printf("  lr(step %3d) = %.9e, want %.9e, |diff| %.1e (tolerance 1e-15)\n", (s), got_, want_, \
           fabs(got_ - want_));                                                                 \
    assert_true(fabs(got_ - want_) <= 1e-15);                                                   \
  } while (0)

static void test_schedule(void **state) {
  plan_train_t c = base_cfg();
  printf("cosine, warmup 10, 110 steps, lr 1e-3, min 1e-4:\n");
  CHECK_LR(c, 0, 1e-4);   /* warmup: (s+1)/warmup */
  CHECK_LR(c, 4, 5e-4);
  CHECK_LR(c, 9, 1e-3);   /* last warmup step reaches the peak */
  CHECK_LR(c, 10, 1e-3);  /* decay starts at p = 0 */
  CHECK_LR(c, 35, 1e-4 + 0.9e-3 * (1 + cos(M_PI * 0.25)) / 2);
  CHECK_LR(c, 60, 5.5e-4); /* half way: the mean of lr and min_lr */
  CHECK_LR(c, 109, 1e-4 + 0.9e-3 * (1 + cos(M_PI * 0.99)) / 2);
  CHECK_LR(c, 110, 1e-4);  /* past the end: min_lr */
  c.decay = PLAN_SCHED_LINEAR;
  printf("linear:\n");
  CHECK_LR(c, 35, 1e-3 - 0.9e-3 * 0.25);
  CHECK_LR(c, 60, 5.5e-4);
  c.decay = PLAN_SCHED_CONSTANT;
  printf("constant:\n");
  CHECK_LR(c, 5, 6e-4);
  CHECK_LR(c, 100, 1e-3);
  c = base_cfg();
  c.warmup_steps = 0;
  printf("no warmup:\n");
  CHECK_LR(c, 0, 1e-3);
  CHECK_LR(c, 55, 5.5e-4);
}

static void test_clip(void **state) {
  assert_true(optim_clip_scale(2.0, 0.5) == 0.25);
  assert_true(optim_clip_scale(0.3, 0.5) == 1.0);
  assert_true(optim_clip_scale(0.5, 0.5) == 1.0);
  assert_true(optim_clip_scale(100.0, 0.0) == 1.0); /* clip off */

  char err[256];
  backend_t *be = backend_create("cpu", 1, err, sizeof err);
  assert_non_null(be);
  plan_train_t c = base_cfg();
  model_tensor_t t[2] = {{.offset = 0, .numel = 3, .decay = 1}, {.offset = 3, .numel = 2, .decay = 0}};
  optim_t o;
  assert_int_equal(optim_init(&o, be, &c, t, 2, 0, 5, err, sizeof err), 0);
  float g[5] = {1, 2, 3, 4, -5};
  double ss = optim_grad_sumsq(&o, g);
  printf("sumsq %.17g, want 55\n", ss);
  assert_true(ss == 55.0);
  optim_free(&o);

  /* The shard [2, 5) sums only its part. */
  assert_int_equal(optim_init(&o, be, &c, t, 2, 2, 3, err, sizeof err), 0);
  assert_true(optim_grad_sumsq(&o, g + 2) == 9.0 + 16.0 + 25.0);
  assert_int_equal(o.n_segs, 2);
  optim_free(&o);

  /* Tensors that do not tile the range are refused. */
  model_tensor_t gap[2] = {{.offset = 0, .numel = 2}, {.offset = 3, .numel = 2}};
  assert_int_equal(optim_init(&o, be, &c, gap, 2, 0, 5, err, sizeof err), OPTIM_EINVAL);
  printf("gap: %s\n", err);
  backend_destroy(be);
}

/* PyTorch AdamW (decoupled decay), in double. */
static void ref_adamw(double *p, const double *g_raw, double *m, double *v, int n, double lr, double b1, double b2,
                      double eps, double wd, int step, double scale) {
  for (int i = 0; i < n; i++) {
    double g = g_raw[i] * scale;
    p[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    double mh = m[i] / (1 - pow(b1, step)), vh = v[i] / (1 - pow(b2, step));
    p[i] -= lr * mh / (sqrt(vh) + eps);
  }
}

enum { N = 40 };

static void test_adamw_reference(void **state) {
  char err[256];
  backend_t *be = backend_create("cpu", 1, err, sizeof err);
  assert_non_null(be);
  plan_train_t c = base_cfg();
  c.weight_decay = 0.5; /* large, so a wrong decay flag shows */
  /* Three tensors: decayed (0..24), not decayed (25..29), decayed (30..39). */
  model_tensor_t t[3] = {{.offset = 0, .numel = 25, .decay = 1},
                         {.offset = 25, .numel = 5, .decay = 0},
                         {.offset = 30, .numel = 10, .decay = 1}};
  optim_t o;
  assert_int_equal(optim_init(&o, be, &c, t, 3, 0, N, err, sizeof err), 0);

  float p[N], g[N];
  double rp[N], rg[N], rm[N] = {0}, rv[N] = {0};
  for (int i = 0; i < N; i++) rp[i] = p[i] = 0.05f * (float)(i % 7) - 0.1f;
  double max_diff = 0;
  for (int step = 1; step <= 5; step++) {
    for (int i = 0; i < N; i++) rg[i] = g[i] = (float)sin(0.37 * i * step) * (i % 3 ? 1.0f : 3.0f);
    double norm = sqrt(optim_grad_sumsq(&o, g)), scale = optim_clip_scale(norm, c.grad_clip);
    double lr = optim_lr(&c, step - 1) * 50; /* big steps so that parameters move visibly */
    optim_step(&o, p, g, NULL, lr, scale);
    for (int k = 0; k < 3; k++)
      ref_adamw(rp + t[k].offset, rg + t[k].offset, rm + t[k].offset, rv + t[k].offset, (int)t[k].numel, lr,
                c.beta1, c.beta2, c.eps, t[k].decay ? c.weight_decay : 0, step, scale);
    for (int i = 0; i < N; i++) {
      double d = fabs((double)p[i] - rp[i]);
      if (d > max_diff) max_diff = d;
    }
    printf("  step %d: grad norm %.4f, clip scale %.4f, lr %.3e\n", step, norm, scale, lr);
  }
  printf("AdamW vs double reference after 5 steps: max |diff| %.3e (tolerance 2e-6)\n", max_diff);
  assert_true(max_diff <= 2e-6);
  assert_int_equal(o.step, 5);
  optim_free(&o);
  backend_destroy(be);
}

static void test_shards_match_whole(void **state) {
  char err[256];
  backend_t *be = backend_create("cpu", 1, err, sizeof err);
  assert_non_null(be);
  plan_train_t c = base_cfg();
  model_tensor_t t[3] = {{.offset = 0, .numel = 25, .decay = 1},
                         {.offset = 25, .numel = 5, .decay = 0},
                         {.offset = 30, .numel = 10, .decay = 1}};
  optim_t whole, lo, hi;
  const size_t cut = 27; /* inside the second tensor */
  assert_int_equal(optim_init(&whole, be, &c, t, 3, 0, N, err, sizeof err), 0);
  assert_int_equal(optim_init(&lo, be, &c, t, 3, 0, cut, err, sizeof err), 0);
  assert_int_equal(optim_init(&hi, be, &c, t, 3, cut, N - cut, err, sizeof err), 0);
  float pw[N], ps[N], g[N];
  for (int i = 0; i < N; i++) pw[i] = ps[i] = 0.01f * (float)i;
  for (int step = 0; step < 3; step++) {
    for (int i = 0; i < N; i++) g[i] = (float)cos(0.1 * i + step);
    double sumsq = optim_grad_sumsq(&lo, g) + optim_grad_sumsq(&hi, g + cut);
    double scale = optim_clip_scale(sqrt(sumsq), 0.5);
    optim_step(&whole, pw, g, NULL, 1e-2, scale);
    optim_step(&lo, ps, g, NULL, 1e-2, scale);
    optim_step(&hi, ps + cut, g + cut, NULL, 1e-2, scale);
  }
  assert_memory_equal(pw, ps, sizeof pw);
  printf("shards [0,%zu) + [%zu,%d) give the same bits as the whole buffer\n", cut, cut, N);
  optim_free(&whole);
  optim_free(&lo);
  optim_free(&hi);
  backend_destroy(be);
}

/* optim_step makes one adamw_multi call, or adamw per segment where the backend has none: the
 * same bits either way, in the parameters and in the bf16 copy. */
static void test_multi_or_per_segment(void **state) {
  char err[256];
  backend_t *be = backend_create("cpu", 1, err, sizeof err), *seg = backend_create("cpu", 1, err, sizeof err);
  assert_non_null(be);
  assert_non_null(seg);
  assert_non_null(be->adamw_multi);
  seg->adamw_multi = NULL;
  plan_train_t c = base_cfg();
  c.weight_decay = 0.5;
  model_tensor_t t[3] = {{.offset = 0, .numel = 25, .decay = 1},
                         {.offset = 25, .numel = 5, .decay = 0},
                         {.offset = 30, .numel = 10, .decay = 1}};
  optim_t a, b;
  assert_int_equal(optim_init(&a, be, &c, t, 3, 0, N, err, sizeof err), 0);
  assert_int_equal(optim_init(&b, seg, &c, t, 3, 0, N, err, sizeof err), 0);
  float pa[N], pb[N], g[N];
  uint16_t la[N], lb[N];
  memset(la, 0xff, sizeof la);
  memset(lb, 0, sizeof lb);
  for (int i = 0; i < N; i++) pa[i] = pb[i] = 0.03f * (float)(i % 5) - 0.05f;
  for (int step = 0; step < 3; step++) {
    for (int i = 0; i < N; i++) g[i] = (float)sin(0.3 * i + step);
    optim_step(&a, pa, g, la, 5e-2, 0.7);
    optim_step(&b, pb, g, lb, 5e-2, 0.7);
  }
  assert_memory_equal(pa, pb, sizeof pa);
  assert_memory_equal(la, lb, sizeof la);
  printf("adamw_multi and adamw per segment: the same bits (params and bf16 copy) after 3 steps\n");
  optim_free(&a);
  optim_free(&b);
  backend_destroy(be);
  backend_destroy(seg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_schedule),
      cmocka_unit_test(test_clip),
      cmocka_unit_test(test_adamw_reference),
      cmocka_unit_test(test_shards_match_whole),
      cmocka_unit_test(test_multi_or_per_segment),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
