// deps: trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/backend_cuda.cu common/env.c trainer/backend/fatal.c common/err.c
/* test_backend_cuda_tp: the cuda backend's tensor-parallel kernels (copy_2d and the
 * vocab-parallel cross-entropy ce_shard_max / ce_shard_stats / ce_shard_loss) against the cpu
 * backend on the same random inputs, with fp32 and with bf16 logits. A vocabulary is cut into
 * shards the way the model cuts it (the last shard partly or wholly padding); the per-shard
 * results are combined on the host as the model's all-reduces would, so the losses and
 * gradients are also checked against the plain cross_entropy of the cpu backend.
 * fp32 tensors (and the fp32 row stats and losses of bf16 calls): error = max |cuda - cpu| /
 * max |cpu| per tensor, printed; tolerance 1e-5 (fp32, other summation order); 0 for the row
 * max (a max of the same values) and copy_2d (a copy, any dtype: compared in bits).
 * bf16 gradients: each element within 2 bf16 ulps of the reference plus 1e-5 x max|ref| (the
 * fp32 difference, then one rounding to bf16 that may straddle a boundary; as in
 * test_backend_cuda.c). Needs a GPU: with none visible it prints the backend's message and
 * exits 1. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/backend/backend.h"
#include "trainer/backend/bf16.h"

#define TOL 1e-5
#define BF16_ULPS 2

static backend_t *cpu, *gpu;
static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static float uniform(float lo, float hi) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return lo + (hi - lo) * (float)((rng_state >> 40) * (1.0 / 16777216.0));
}

/* n floats in dt (a host copy: the cpu backend's memory is host memory) */
static void *host_dt(const float *x, size_t n, dtype_t dt) {
  void *h = malloc(n * dtype_size(dt) + 1);
  assert_non_null(h);
  if (dt == DT_BF16) bf16_from_f32_n(h, x, n);
  else memcpy(h, x, n * sizeof(float));
  return h;
}
/* n elements of dt widened to fp32 */
static float *widen_dt(const void *x, size_t n, dtype_t dt) {
  float *f = malloc(n * sizeof(float) + 1);
  assert_non_null(f);
  if (dt == DT_BF16) bf16_to_f32_n(f, x, n);
  else memcpy(f, x, n * sizeof(float));
  return f;
}

/* n elements of dt on the gpu from host memory, and back */
static void *up_dt(const void *h, size_t n, dtype_t dt) {
  void *g = gpu->alloc(gpu, n * dtype_size(dt));
  assert_non_null(g);
  gpu->to_device(gpu, g, h, n * dtype_size(dt));
  return g;
}
static void *down_dt(const void *g, size_t n, dtype_t dt) {
  void *h = malloc(n * dtype_size(dt) + 1);
  assert_non_null(h);
  gpu->to_host(gpu, h, g, n * dtype_size(dt));
  return h;
}
static float *up(const float *h, size_t n) { return up_dt(h, n, DT_F32); }
static float *down(const float *g, size_t n) { return down_dt(g, n, DT_F32); }

static void check(const char *what, const float *got, const float *want, size_t n, double tol) {
  double d = 0, w = 0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - want[i]);
    assert_true(isfinite(got[i]));
    d = e > d ? e : d;
    w = fabs(want[i]) > w ? fabs(want[i]) : w;
  }
  double rel = w > 0 ? d / w : d;
  printf("  %-52s max|diff| %.3e  rel %.3e (tolerance %.0e)\n", what, d, rel, tol);
  assert_true(rel <= tol);
}

/* The bf16 spacing at |x|: 2^(e-7) for |x| in [2^e, 2^(e+1)), 2^-133 among subnormals. */
static double bf16_ulp(double x) {
  int e;
  if (x == 0.0 || !isfinite(x)) return ldexp(1.0, -133);
  frexp(fabs(x), &e);
  return ldexp(1.0, (e - 1 < -126 ? -126 : e - 1) - 7);
}

/* bf16 values (widened): each within BF16_ULPS ulps of want plus floor_rel * max|want| */
static void check_bf16(const char *what, const float *got, const float *want, size_t n, double floor_rel) {
  double w = 0, d = 0;
  size_t outside = 0, first = 0;
  for (size_t i = 0; i < n; i++) w = fabs(want[i]) > w ? fabs(want[i]) : w;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - want[i]);
    assert_true(isfinite(got[i]));
    d = e > d ? e : d;
    if (!(e <= BF16_ULPS * bf16_ulp(want[i]) + floor_rel * w) && !outside++) first = i;
  }
  printf("  %-52s bf16 max|diff| %.3e  max|ref| %.3e (tolerance %d ulps + %.0e max|ref|)\n", what, d, w, BF16_ULPS,
         floor_rel);
  if (outside)
    printf("    %zu outside, first at %zu: got %.9g want %.9g\n", outside, first, (double)got[first], (double)want[first]);
  assert_int_equal(outside, 0);
}

/* a gradient of dt: the fp32 criterion or the bf16 one */
static void check_dt(const char *what, const float *got, const float *want, size_t n, dtype_t dt) {
  if (dt == DT_BF16) check_bf16(what, got, want, n, TOL);
  else check(what, got, want, n, TOL);
}

/* copy_2d moves bytes: the same bits as the cpu backend, and as the copy written out here */
static void copy_2d_case(dtype_t dt) {
  int rows = 37, lds = 50, ldd = 70, cols = 33;
  size_t es = dtype_size(dt), ns = (size_t)rows * lds, nd = (size_t)rows * ldd;
  float *srcf = malloc(ns * sizeof(float)), *zero = calloc(nd, sizeof(float));
  assert_non_null(srcf);
  assert_non_null(zero);
  for (size_t i = 0; i < ns; i++) srcf[i] = uniform(-1, 1);
  unsigned char *src = host_dt(srcf, ns, dt), *dc = host_dt(zero, nd, dt), *want = host_dt(zero, nd, dt);
  for (int i = 0; i < rows; i++) memcpy(want + ((size_t)i * ldd + 5) * es, src + ((size_t)i * lds + 3) * es, cols * es);
  void *gs = up_dt(src, ns, dt), *gd = up_dt(dc, nd, dt);
  cpu->copy_2d(cpu, dc + 5 * es, ldd, src + 3 * es, lds, rows, cols, dt);
  gpu->copy_2d(gpu, (char *)gd + 5 * es, ldd, (char *)gs + 3 * es, lds, rows, cols, dt);
  unsigned char *h = down_dt(gd, nd, dt);
  size_t differ = 0, wrong = 0;
  for (size_t i = 0; i < nd; i++) {
    differ += memcmp(h + i * es, dc + i * es, es) != 0;
    wrong += memcmp(h + i * es, want + i * es, es) != 0;
  }
  printf("  copy_2d %s 37 x 33 (lds 50, ldd 70): %zu of %zu elements differ from cpu, %zu from the copy "
         "(tolerance 0)\n",
         dtype_name(dt), differ, nd, wrong);
  assert_int_equal(differ, 0);
  assert_int_equal(wrong, 0);
  free(h);
  free(src);
  free(dc);
  free(want);
  free(srcf);
  free(zero);
  gpu->free(gpu, gs);
  gpu->free(gpu, gd);
}

static void test_copy_2d(void **state) {
  copy_2d_case(DT_F32);
  copy_2d_case(DT_BF16);
}

/* One vocabulary of v ids in tp shards of vl = ceil(v/tp) columns, logits in dt. */
static void shard_case(int n, int v, int tp, dtype_t dt) {
  int vl = (v + tp - 1) / tp;
  size_t nl = (size_t)n * vl, es = dtype_size(dt);
  const char *dn = dtype_name(dt);
  float *full = malloc((size_t)n * v * sizeof(float)), *ref_loss = malloc(n * sizeof(float));
  int32_t *tg = malloc(n * sizeof(int32_t));
  for (int i = 0; i < n * v; i++) full[i] = dt == DT_BF16 ? bf16_round(uniform(-4, 4)) : uniform(-4, 4);
  for (int i = 0; i < n; i++) tg[i] = i % 7 == 3 ? -1 : (int)(uniform(0, 1) * v) % v;
  float gs = 1.0f / n;
  void *full_dt = host_dt(full, (size_t)n * v, dt), *ref_dl_dt = host_dt(full, (size_t)n * v, dt);
  cpu->cross_entropy(cpu, ref_loss, ref_dl_dt, full_dt, tg, n, v, v, gs, dt);
  float *ref_dl = widen_dt(ref_dl_dt, (size_t)n * v, dt);
  int32_t *gtg = gpu->alloc(gpu, n * sizeof(int32_t));
  gpu->to_device(gpu, gtg, tg, n * sizeof(int32_t));

  /* per shard: local logits, row max; the all-reduces done here on the host */
  void **sh = calloc(tp, sizeof *sh), **gsh = calloc(tp, sizeof *gsh);
  float *mx_c = malloc(n * sizeof(float)), *mx_g = malloc(n * sizeof(float));
  float *st_c = calloc(2 * (size_t)n, sizeof(float)), *st_g = calloc(2 * (size_t)n, sizeof(float));
  float *part = malloc(2 * (size_t)n * sizeof(float));
  for (int i = 0; i < n; i++) mx_c[i] = mx_g[i] = -FLT_MAX;
  for (int r = 0; r < tp; r++) {
    int vv = v - r * vl;
    vv = vv < 0 ? 0 : vv > vl ? vl : vv;
    float *shf = calloc(nl, sizeof(float));
    for (int i = 0; i < n; i++) memcpy(shf + (size_t)i * vl, full + (size_t)i * v + r * vl, vv * sizeof(float));
    sh[r] = host_dt(shf, nl, dt);
    free(shf);
    gsh[r] = up_dt(sh[r], nl, dt);
    cpu->ce_shard_max(cpu, part, sh[r], n, vv, vl, dt);
    for (int i = 0; i < n; i++) mx_c[i] = fmaxf(mx_c[i], part[i]);
    float *gm = gpu->alloc(gpu, n * sizeof(float));
    gpu->ce_shard_max(gpu, gm, gsh[r], n, vv, vl, dt);
    float *hm = down(gm, n);
    char what[96];
    snprintf(what, sizeof what, "ce_shard_max %s n=%d v=%d shard %d/%d (%d real)", dn, n, v, r, tp, vv);
    check(what, hm, part, n, 0);
    for (int i = 0; i < n; i++) mx_g[i] = fmaxf(mx_g[i], hm[i]);
    free(hm);
    gpu->free(gpu, gm);
  }
  float *gmx = up(mx_g, n);
  for (int r = 0; r < tp; r++) {
    int vv = v - r * vl;
    vv = vv < 0 ? 0 : vv > vl ? vl : vv;
    cpu->ce_shard_stats(cpu, part, sh[r], mx_c, tg, n, vv, vl, r * vl, dt);
    for (int i = 0; i < 2 * n; i++) st_c[i] += part[i];
    float *gst = gpu->alloc(gpu, 2 * (size_t)n * sizeof(float));
    gpu->ce_shard_stats(gpu, gst, gsh[r], gmx, gtg, n, vv, vl, r * vl, dt);
    float *hs = down(gst, 2 * (size_t)n);
    char what[96];
    snprintf(what, sizeof what, "ce_shard_stats %s n=%d v=%d shard %d/%d", dn, n, v, r, tp);
    check(what, hs, part, 2 * (size_t)n, TOL);
    for (int i = 0; i < 2 * n; i++) st_g[i] += hs[i];
    free(hs);
    gpu->free(gpu, gst);
  }
  float *gst = up(st_g, 2 * (size_t)n), *gl = gpu->alloc(gpu, n * sizeof(float));
  float *lc = malloc(n * sizeof(float));
  void *dl = malloc(nl * es + 1);
  for (int r = 0; r < tp; r++) {
    int vv = v - r * vl;
    vv = vv < 0 ? 0 : vv > vl ? vl : vv;
    cpu->ce_shard_loss(cpu, lc, dl, sh[r], mx_c, st_c, tg, n, vv, vl, r * vl, gs, dt);
    gpu->ce_shard_loss(gpu, gl, gsh[r], gsh[r], gmx, gst, gtg, n, vv, vl, r * vl, gs, dt); /* aliased */
    float *hl = down(gl, n);
    void *hd_raw = down_dt(gsh[r], nl, dt);
    float *hd = widen_dt(hd_raw, nl, dt), *dlf = widen_dt(dl, nl, dt);
    char what[96];
    snprintf(what, sizeof what, "ce_shard_loss %s n=%d v=%d shard %d/%d losses", dn, n, v, r, tp);
    check(what, hl, lc, n, TOL);
    snprintf(what, sizeof what, "ce_shard_loss %s n=%d v=%d shard %d/%d dlogits", dn, n, v, r, tp);
    check_dt(what, hd, dlf, nl, dt);
    /* the cpu pieces against the plain cross-entropy: the sharded loss is the same loss */
    float *want = calloc(nl, sizeof(float));
    for (int i = 0; i < n; i++) memcpy(want + (size_t)i * vl, ref_dl + (size_t)i * v + r * vl, vv * sizeof(float));
    snprintf(what, sizeof what, "cpu ce_shard_loss %s vs cross_entropy shard %d/%d", dn, r, tp);
    check_dt(what, dlf, want, nl, dt);
    if (r == 0) check("cpu ce_shard_loss vs cross_entropy losses", lc, ref_loss, n, TOL);
    free(want);
    free(hl);
    free(hd_raw);
    free(hd);
    free(dlf);
  }
  for (int r = 0; r < tp; r++) {
    free(sh[r]);
    gpu->free(gpu, gsh[r]);
  }
  free(sh);
  free(gsh);
  free(full);
  free(full_dt);
  free(ref_loss);
  free(ref_dl);
  free(ref_dl_dt);
  free(tg);
  free(mx_c);
  free(mx_g);
  free(st_c);
  free(st_g);
  free(part);
  free(lc);
  free(dl);
  gpu->free(gpu, gtg);
  gpu->free(gpu, gmx);
  gpu->free(gpu, gst);
  gpu->free(gpu, gl);
}

static void test_ce_shards(void **state) {
  shard_case(13, 97, 2, DT_F32);
  shard_case(13, 97, 4, DT_F32);
  shard_case(5, 5, 4, DT_F32); /* shard 3 is all padding */
  shard_case(9, 5000, 2, DT_F32);
}

static void test_ce_shards_bf16(void **state) {
  shard_case(13, 97, 2, DT_BF16);
  shard_case(13, 97, 4, DT_BF16);
  shard_case(5, 5, 4, DT_BF16);
  shard_case(9, 5000, 2, DT_BF16);
}

int main(void) {
  char err[512];
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!(cpu = backend_cpu_create(0, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda_tp: %s\n", err);
    return 1;
  }
  if (!(gpu = backend_create("cuda", 0, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda_tp: %s\n", err);
    backend_destroy(cpu);
    return 1;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_copy_2d), cmocka_unit_test(test_ce_shards),
                                     cmocka_unit_test(test_ce_shards_bf16)};
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  backend_destroy(gpu);
  backend_destroy(cpu);
  return rc;
}
