// deps: trainer/backend.c trainer/backend_cpu.c trainer/backend_cuda.cu common/env.c
/* test_backend_cuda_tp: the cuda backend's tensor-parallel kernels (copy_2d and the
 * vocab-parallel cross-entropy ce_shard_max / ce_shard_stats / ce_shard_loss) against the cpu
 * backend on the same random inputs. A vocabulary is cut into shards the way the model cuts it
 * (the last shard partly or wholly padding); the per-shard results are combined on the host as
 * the model's all-reduces would, so the losses and gradients are also checked against the plain
 * cross_entropy of the cpu backend. Error = max |cuda - cpu| / max |cpu| per tensor, printed;
 * tolerance 1e-5 (fp32, other summation order), 0 for copy_2d (a copy). Needs a GPU: with none
 * visible it prints the backend's message and exits 1. */
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

#include "trainer/backend.h"

#define TOL 1e-5

static backend_t *cpu, *gpu;
static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static float uniform(float lo, float hi) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return lo + (hi - lo) * (float)((rng_state >> 40) * (1.0 / 16777216.0));
}

/* n floats on the gpu from host values, and back */
static float *up(const float *h, size_t n) {
  float *g = gpu->alloc(gpu, n * sizeof(float));
  assert_non_null(g);
  gpu->to_device(gpu, g, h, n * sizeof(float));
  return g;
}
static float *down(const float *g, size_t n) {
  float *h = malloc(n * sizeof(float));
  assert_non_null(h);
  gpu->to_host(gpu, h, g, n * sizeof(float));
  return h;
}

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

static void test_copy_2d(void **state) {
  int rows = 37, lds = 50, ldd = 70, cols = 33;
  float *src = malloc((size_t)rows * lds * sizeof(float)), *dc = calloc((size_t)rows * ldd, sizeof(float));
  for (int i = 0; i < rows * lds; i++) src[i] = uniform(-1, 1);
  float *gs = up(src, (size_t)rows * lds), *gd = up(dc, (size_t)rows * ldd);
  cpu->copy_2d(cpu, dc + 5, ldd, src + 3, lds, rows, cols);
  gpu->copy_2d(gpu, gd + 5, ldd, gs + 3, lds, rows, cols);
  float *h = down(gd, (size_t)rows * ldd);
  check("copy_2d 37 x 33 (lds 50, ldd 70)", h, dc, (size_t)rows * ldd, 0);
  free(h);
  free(src);
  free(dc);
  gpu->free(gpu, gs);
  gpu->free(gpu, gd);
}

/* One vocabulary of v ids in tp shards of vl = ceil(v/tp) columns. */
static void shard_case(int n, int v, int tp) {
  int vl = (v + tp - 1) / tp;
  size_t nl = (size_t)n * vl;
  float *full = malloc((size_t)n * v * sizeof(float)), *ref_loss = malloc(n * sizeof(float));
  float *ref_dl = malloc((size_t)n * v * sizeof(float));
  int32_t *tg = malloc(n * sizeof(int32_t));
  for (int i = 0; i < n * v; i++) full[i] = uniform(-4, 4);
  for (int i = 0; i < n; i++) tg[i] = i % 7 == 3 ? -1 : (int)(uniform(0, 1) * v) % v;
  float gs = 1.0f / n;
  cpu->cross_entropy(cpu, ref_loss, ref_dl, full, tg, n, v, v, gs);
  int32_t *gtg = gpu->alloc(gpu, n * sizeof(int32_t));
  gpu->to_device(gpu, gtg, tg, n * sizeof(int32_t));

  /* per shard: local logits, row max; the all-reduces done here on the host */
  float **sh = calloc(tp, sizeof *sh), **gsh = calloc(tp, sizeof *gsh);
  float *mx_c = malloc(n * sizeof(float)), *mx_g = malloc(n * sizeof(float));
  float *st_c = calloc(2 * (size_t)n, sizeof(float)), *st_g = calloc(2 * (size_t)n, sizeof(float));
  float *part = malloc(2 * (size_t)n * sizeof(float));
  for (int i = 0; i < n; i++) mx_c[i] = mx_g[i] = -FLT_MAX;
  for (int r = 0; r < tp; r++) {
    int vv = v - r * vl;
    vv = vv < 0 ? 0 : vv > vl ? vl : vv;
    sh[r] = calloc(nl, sizeof(float));
    for (int i = 0; i < n; i++) memcpy(sh[r] + (size_t)i * vl, full + (size_t)i * v + r * vl, vv * sizeof(float));
    gsh[r] = up(sh[r], nl);
    cpu->ce_shard_max(cpu, part, sh[r], n, vv, vl);
    for (int i = 0; i < n; i++) mx_c[i] = fmaxf(mx_c[i], part[i]);
    float *gm = gpu->alloc(gpu, n * sizeof(float));
    gpu->ce_shard_max(gpu, gm, gsh[r], n, vv, vl);
    float *hm = down(gm, n);
    char what[96];
    snprintf(what, sizeof what, "ce_shard_max n=%d v=%d shard %d/%d (%d real)", n, v, r, tp, vv);
    check(what, hm, part, n, 0);
    for (int i = 0; i < n; i++) mx_g[i] = fmaxf(mx_g[i], hm[i]);
    free(hm);
    gpu->free(gpu, gm);
  }
  float *gmx = up(mx_g, n);
  for (int r = 0; r < tp; r++) {
    int vv = v - r * vl;
    vv = vv < 0 ? 0 : vv > vl ? vl : vv;
    cpu->ce_shard_stats(cpu, part, sh[r], mx_c, tg, n, vv, vl, r * vl);
    for (int i = 0; i < 2 * n; i++) st_c[i] += part[i];
    float *gst = gpu->alloc(gpu, 2 * (size_t)n * sizeof(float));
    gpu->ce_shard_stats(gpu, gst, gsh[r], gmx, gtg, n, vv, vl, r * vl);
    float *hs = down(gst, 2 * (size_t)n);
    char what[96];
    snprintf(what, sizeof what, "ce_shard_stats n=%d v=%d shard %d/%d", n, v, r, tp);
    check(what, hs, part, 2 * (size_t)n, TOL);
    for (int i = 0; i < 2 * n; i++) st_g[i] += hs[i];
    free(hs);
    gpu->free(gpu, gst);
  }
  float *gst = up(st_g, 2 * (size_t)n), *gl = gpu->alloc(gpu, n * sizeof(float));
  float *lc = malloc(n * sizeof(float)), *dl = malloc(nl * sizeof(float));
  for (int r = 0; r < tp; r++) {
    int vv = v - r * vl;
    vv = vv < 0 ? 0 : vv > vl ? vl : vv;
    cpu->ce_shard_loss(cpu, lc, dl, sh[r], mx_c, st_c, tg, n, vv, vl, r * vl, gs);
    gpu->ce_shard_loss(gpu, gl, gsh[r], gsh[r], gmx, gst, gtg, n, vv, vl, r * vl, gs); /* aliased */
    float *hl = down(gl, n), *hd = down(gsh[r], nl);
    char what[96];
    snprintf(what, sizeof what, "ce_shard_loss n=%d v=%d shard %d/%d losses", n, v, r, tp);
    check(what, hl, lc, n, TOL);
    snprintf(what, sizeof what, "ce_shard_loss n=%d v=%d shard %d/%d dlogits", n, v, r, tp);
    check(what, hd, dl, nl, TOL);
    /* the cpu pieces against the plain cross-entropy: the sharded loss is the same loss */
    float *want = calloc(nl, sizeof(float));
    for (int i = 0; i < n; i++) memcpy(want + (size_t)i * vl, ref_dl + (size_t)i * v + r * vl, vv * sizeof(float));
    snprintf(what, sizeof what, "cpu ce_shard_loss vs cross_entropy shard %d/%d", r, tp);
    check(what, dl, want, nl, TOL);
    if (r == 0) check("cpu ce_shard_loss vs cross_entropy losses", lc, ref_loss, n, TOL);
    free(want);
    free(hl);
    free(hd);
  }
  for (int r = 0; r < tp; r++) {
    free(sh[r]);
    gpu->free(gpu, gsh[r]);
  }
  free(sh);
  free(gsh);
  free(full);
  free(ref_loss);
  free(ref_dl);
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
  shard_case(13, 97, 2);
  shard_case(13, 97, 4);
  shard_case(5, 5, 4); /* shard 3 is all padding */
  shard_case(9, 5000, 2);
}

int main(void) {
  char err[512];
  if (!(cpu = backend_cpu_create(0, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda_tp: %s\n", err);
    return 1;
  }
  if (!(gpu = backend_cuda_create(-1, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda_tp: %s\n", err);
    backend_destroy(cpu);
    return 1;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_copy_2d), cmocka_unit_test(test_ce_shards)};
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  backend_destroy(gpu);
  backend_destroy(cpu);
  return rc;
}
