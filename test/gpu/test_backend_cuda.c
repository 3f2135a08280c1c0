// deps: trainer/backend.c trainer/backend_cpu.c trainer/backend_cuda.cu common/env.c
/* test_backend_cuda: every kernel of the cuda backend against the cpu backend on the same
 * random inputs, and the cuda kernels' determinism (the same inputs twice give the same bits).
 *
 * The error of a tensor is max |cuda - cpu| / max |cpu| over its elements (relative to the
 * tensor's scale, so near-zero elements do not dominate), printed for every tensor. Tolerances:
 * 1e-5 for fp32 kernels; 0 where both backends do the same roundings in the same order (add,
 * scale, embedding); 1e-6 for RoPE (the same roundings, but cos/sin tables from two math
 * libraries may differ in a last bit); 1e-10 for sumsq (double sums, other order); 5e-3 for matmuls with TF32 allowed (inputs rounded to a 10-bit
 * mantissa, about 5e-4 each, over k products of uniform inputs). Accumulating kernels start
 * from random gradients, so that "+=" is checked too. Needs a GPU: with none visible it prints
 * the backend's message and exits 1. */
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

#define TOL_FP32 1e-5
#define TOL_TF32 5e-3

static backend_t *cpu, *gpu;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
static float rng_uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)((rng_next() >> 40) * (1.0 / 16777216.0));
}
static int rng_int(int lo, int hi) { return lo + (int)(rng_next() % (uint64_t)(hi - lo)); } /* [lo, hi) */

/* A tensor on both backends, with the host values it was filled from. */
typedef struct {
  size_t n;
  float *host; /* initial values */
  float *c;    /* cpu backend (host memory) */
  float *g;    /* cuda backend */
} pair_t;

static void pair_reset(pair_t *p) {
  cpu->to_device(cpu, p->c, p->host, p->n * sizeof(float));
  gpu->to_device(gpu, p->g, p->host, p->n * sizeof(float));
}

static pair_t pair_new(size_t n, float lo, float hi) {
  pair_t p = {n, malloc((n + 1) * sizeof(float)), cpu->alloc(cpu, n * sizeof(float)), gpu->alloc(gpu, n * sizeof(float))};
  assert_non_null(p.host);
  assert_non_null(p.c);
  assert_non_null(p.g);
  for (size_t i = 0; i < n; i++) p.host[i] = rng_uniform(lo, hi);
  pair_reset(&p);
  return p;
}

static void pair_free(pair_t *p) {
  free(p->host);
  cpu->free(cpu, p->c);
  gpu->free(gpu, p->g);
  memset(p, 0, sizeof *p);
}

static float *pair_fetch(const pair_t *p) {
  float *h = malloc(p->n * sizeof(float));
  assert_non_null(h);
  gpu->to_host(gpu, h, p->g, p->n * sizeof(float));
  return h;
}

/* Prints and checks the error of p (cuda against cpu). */
static void pair_check(const char *what, const pair_t *p, double tol) {
  float *h = pair_fetch(p);
  double maxref = 0.0, maxdiff = 0.0;
  size_t worst = 0, bad = 0;
  for (size_t i = 0; i < p->n; i++) {
    double r = p->c[i], d = fabs((double)h[i] - r);
    if (!isfinite(h[i])) bad++;
    if (fabs(r) > maxref) maxref = fabs(r);
    if (d > maxdiff) maxdiff = d, worst = i;
  }
  double rel = maxref > 0.0 ? maxdiff / maxref : maxdiff;
  printf("  %-44s max|diff| %.3e  max|ref| %.3e  rel %.3e (tolerance %.0e)%s\n", what, maxdiff, maxref, rel, tol,
         bad ? "  NON-FINITE VALUES" : "");
  if (rel > tol || bad)
    printf("    worst at %zu: cuda %.9g cpu %.9g\n", worst, (double)h[worst], (double)p->c[worst]);
  free(h);
  assert_int_equal(bad, 0);
  assert_true(rel <= tol);
}

/* Determinism: snapshot p's cuda values, to compare with a rerun. */
static float *snap(const pair_t *p) { return pair_fetch(p); }
static void check_same_bits(const char *what, const pair_t *p, float *before) {
  float *after = pair_fetch(p);
  size_t diff = 0;
  for (size_t i = 0; i < p->n; i++) diff += memcmp(&before[i], &after[i], sizeof(float)) != 0;
  printf("  %-44s rerun: %zu of %zu elements differ in bits (tolerance 0)\n", what, diff, p->n);
  free(before);
  free(after);
  assert_int_equal(diff, 0);
}

/* int32 ids on both backends */
typedef struct {
  size_t n;
  int32_t *host, *c, *g;
} ids_t;

static ids_t ids_new(size_t n, int lo, int hi) {
  ids_t t = {n, malloc((n + 1) * sizeof(int32_t)), cpu->alloc(cpu, n * sizeof(int32_t)), gpu->alloc(gpu, n * sizeof(int32_t))};
  assert_non_null(t.host);
  assert_non_null(t.c);
  assert_non_null(t.g);
  for (size_t i = 0; i < n; i++) t.host[i] = rng_int(lo, hi);
  return t;
}
static void ids_upload(ids_t *t) {
  cpu->to_device(cpu, t->c, t->host, t->n * sizeof(int32_t));
  gpu->to_device(gpu, t->g, t->host, t->n * sizeof(int32_t));
}
static void ids_free(ids_t *t) {
  free(t->host);
  cpu->free(cpu, t->c);
  gpu->free(gpu, t->g);
}

/* ------------------------------------------------------------------ memory */

static void test_memory(void **state) {
  size_t n = 100003;
  float *h = malloc(n * sizeof(float)), *back = malloc(n * sizeof(float));
  assert_non_null(h);
  assert_non_null(back);
  float *a = gpu->alloc(gpu, n * sizeof(float)), *b = gpu->alloc(gpu, n * sizeof(float));
  assert_non_null(a);
  assert_non_null(b);
  gpu->to_host(gpu, back, a, n * sizeof(float));
  size_t nonzero = 0;
  for (size_t i = 0; i < n; i++) nonzero += back[i] != 0.0f;
  printf("  alloc: %zu of %zu elements non-zero (want 0)\n", nonzero, n);
  assert_int_equal(nonzero, 0);
  for (size_t i = 0; i < n; i++) h[i] = rng_uniform(-1.0f, 1.0f);
  gpu->to_device(gpu, a, h, n * sizeof(float));
  gpu->copy(gpu, b, a, n * sizeof(float));
  gpu->zero(gpu, b + 10, 100 * sizeof(float));
  gpu->synchronize(gpu);
  gpu->to_host(gpu, back, b, n * sizeof(float));
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += back[i] != ((i >= 10 && i < 110) ? 0.0f : h[i]);
  printf("  to_device, copy, zero, to_host: %zu wrong elements (want 0)\n", wrong);
  assert_int_equal(wrong, 0);
  void *huge = gpu->alloc(gpu, (size_t)1 << 50); /* 1 PiB: must fail cleanly */
  printf("  alloc(1 PiB) returned %s (want NULL)\n", huge ? "a pointer" : "NULL");
  assert_null(huge);
  gpu->free(gpu, NULL);
  gpu->free(gpu, a);
  gpu->free(gpu, b);
  free(h);
  free(back);
}

/* ------------------------------------------------------------------ matmul */

static void matmul_case(int m, int n, int k, int ta, int tb, float alpha, float beta, int offset, double tol) {
  /* offset shifts every pointer by that many floats: cuBLASLt must cope with 4-byte alignment */
  pair_t a = pair_new((size_t)m * k + offset, -1.0f, 1.0f), b = pair_new((size_t)k * n + offset, -1.0f, 1.0f);
  pair_t c = pair_new((size_t)m * n + offset, -1.0f, 1.0f);
  cpu->matmul(cpu, c.c + offset, a.c + offset, b.c + offset, m, n, k, ta, tb, alpha, beta);
  gpu->matmul(gpu, c.g + offset, a.g + offset, b.g + offset, m, n, k, ta, tb, alpha, beta);
  char what[96];
  snprintf(what, sizeof what, "matmul m=%d n=%d k=%d ta=%d tb=%d b=%.1f +%d", m, n, k, ta, tb, beta, offset);
  pair_check(what, &c, tol);
  float *first = snap(&c);
  pair_reset(&c);
  gpu->matmul(gpu, c.g + offset, a.g + offset, b.g + offset, m, n, k, ta, tb, alpha, beta);
  check_same_bits(what, &c, first);
  pair_free(&a);
  pair_free(&b);
  pair_free(&c);
}

static void test_matmul(void **state) {
  static const int shapes[][3] = {{1, 1, 1}, {37, 53, 71}, {128, 256, 64}, {300, 200, 500}, {64, 1000, 16}, {8, 8, 4096}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++) {
        matmul_case(shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, 1.0f, 0.0f, 0, TOL_FP32);
        matmul_case(shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, 0.5f, 1.0f, 0, TOL_FP32);
      }
  matmul_case(37, 53, 71, 0, 1, 1.0f, 1.0f, 1, TOL_FP32);
  matmul_case(256, 128, 512, 1, 0, 1.0f, 1.0f, 3, TOL_FP32);
  matmul_case(5, 7, 0, 0, 1, 1.0f, 0.5f, 0, TOL_FP32); /* empty product: c = beta c */
  printf("  with TF32 allowed:\n");
  backend_cuda_set_tf32(gpu, 1);
  matmul_case(300, 200, 500, 0, 1, 1.0f, 0.0f, 0, TOL_TF32);
  matmul_case(512, 512, 1024, 0, 0, 1.0f, 1.0f, 0, TOL_TF32);
  matmul_case(256, 384, 2048, 1, 0, 1.0f, 1.0f, 0, TOL_TF32);
  backend_cuda_set_tf32(gpu, 0);
}

/* ------------------------------------------------------------------ elementwise */

static void test_elementwise(void **state) {
  size_t n = 1000003;
  pair_t a = pair_new(n, -4.0f, 4.0f), b = pair_new(n, -4.0f, 4.0f), out = pair_new(n, -1.0f, 1.0f);
  cpu->add(cpu, out.c, a.c, b.c, n);
  gpu->add(gpu, out.g, a.g, b.g, n);
  pair_check("add", &out, 0.0);
  cpu->add(cpu, a.c, a.c, b.c, n); /* out aliasing a */
  gpu->add(gpu, a.g, a.g, b.g, n);
  pair_check("add in place", &a, 0.0);
  cpu->scale(cpu, b.c, 0.37f, n);
  gpu->scale(gpu, b.g, 0.37f, n);
  pair_check("scale", &b, 0.0);
  pair_reset(&a);
  pair_reset(&b);

  cpu->swiglu_fwd(cpu, out.c, a.c, b.c, n);
  gpu->swiglu_fwd(gpu, out.g, a.g, b.g, n);
  pair_check("swiglu_fwd", &out, TOL_FP32);
  pair_t dout = pair_new(n, -1.0f, 1.0f), da = pair_new(n, -1.0f, 1.0f), dg = pair_new(n, -1.0f, 1.0f);
  cpu->swiglu_bwd(cpu, da.c, dg.c, dout.c, a.c, b.c, n);
  gpu->swiglu_bwd(gpu, da.g, dg.g, dout.g, a.g, b.g, n);
  pair_check("swiglu_bwd da", &da, TOL_FP32);
  pair_check("swiglu_bwd dg", &dg, TOL_FP32);

  static const size_t sizes[] = {1, 1000, 4097, 3000001};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    pair_t x = pair_new(sizes[s], -3.0f, 3.0f);
    double rc = cpu->sumsq(cpu, x.c, x.n), rg = gpu->sumsq(gpu, x.g, x.n), rg2 = gpu->sumsq(gpu, x.g, x.n);
    double rel = fabs(rg - rc) / rc;
    printf("  sumsq n=%-8zu cuda %.17g cpu %.17g rel %.3e (tolerance 1e-10); rerun %s\n", sizes[s], rg, rc, rel,
           memcmp(&rg, &rg2, sizeof rg) ? "DIFFERS" : "same bits");
    assert_true(rel <= 1e-10);
    assert_memory_equal(&rg, &rg2, sizeof rg);
    pair_free(&x);
  }
  pair_free(&a);
  pair_free(&b);
  pair_free(&out);
  pair_free(&dout);
  pair_free(&da);
  pair_free(&dg);
}

/* ------------------------------------------------------------------ embedding */

static void test_embedding(void **state) {
  int n = 3000, c = 96, rows = 50, vocab_start = 10;
  ids_t tok = ids_new((size_t)n, 0, 70); /* some below vocab_start, some past it + rows, many repeats */
  tok.host[0] = -1;
  ids_upload(&tok);
  pair_t table = pair_new((size_t)rows * c, -1.0f, 1.0f);
  pair_t out = pair_new((size_t)n * c, 5.0f, 6.0f); /* garbage that must be overwritten */
  cpu->embedding_fwd(cpu, out.c, table.c, tok.c, n, c, vocab_start, rows);
  gpu->embedding_fwd(gpu, out.g, table.g, tok.g, n, c, vocab_start, rows);
  pair_check("embedding_fwd", &out, 0.0);

  pair_t dout = pair_new((size_t)n * c, -1.0f, 1.0f), dtable = pair_new((size_t)rows * c, -1.0f, 1.0f);
  cpu->embedding_bwd(cpu, dtable.c, dout.c, tok.c, n, c, vocab_start, rows);
  gpu->embedding_bwd(gpu, dtable.g, dout.g, tok.g, n, c, vocab_start, rows);
  pair_check("embedding_bwd (position order, as cpu)", &dtable, 0.0);
  float *first = snap(&dtable);
  pair_reset(&dtable);
  gpu->embedding_bwd(gpu, dtable.g, dout.g, tok.g, n, c, vocab_start, rows);
  check_same_bits("embedding_bwd", &dtable, first);
  ids_free(&tok);
  pair_free(&table);
  pair_free(&out);
  pair_free(&dout);
  pair_free(&dtable);
}

/* ------------------------------------------------------------------ RMSNorm */

static void rmsnorm_case(int n, int c) {
  char what[96];
  pair_t x = pair_new((size_t)n * c, -2.0f, 2.0f), w = pair_new((size_t)c, 0.5f, 1.5f);
  pair_t out = pair_new((size_t)n * c, 0.0f, 1.0f), rstd = pair_new((size_t)n, 0.0f, 1.0f);
  cpu->rmsnorm_fwd(cpu, out.c, rstd.c, x.c, w.c, n, c, 1e-5f);
  gpu->rmsnorm_fwd(gpu, out.g, rstd.g, x.g, w.g, n, c, 1e-5f);
  snprintf(what, sizeof what, "rmsnorm_fwd n=%d c=%d out", n, c);
  pair_check(what, &out, TOL_FP32);
  snprintf(what, sizeof what, "rmsnorm_fwd n=%d c=%d rstd", n, c);
  pair_check(what, &rstd, TOL_FP32);

  /* the backward from the cpu's rstd on both, so that only the backward is compared */
  gpu->to_device(gpu, rstd.g, rstd.c, (size_t)n * sizeof(float));
  pair_t dout = pair_new((size_t)n * c, -1.0f, 1.0f), dx = pair_new((size_t)n * c, -1.0f, 1.0f);
  pair_t dw = pair_new((size_t)c, -1.0f, 1.0f);
  cpu->rmsnorm_bwd(cpu, dx.c, dw.c, dout.c, x.c, w.c, rstd.c, n, c);
  gpu->rmsnorm_bwd(gpu, dx.g, dw.g, dout.g, x.g, w.g, rstd.g, n, c);
  snprintf(what, sizeof what, "rmsnorm_bwd n=%d c=%d dx", n, c);
  pair_check(what, &dx, TOL_FP32);
  snprintf(what, sizeof what, "rmsnorm_bwd n=%d c=%d dw", n, c);
  pair_check(what, &dw, TOL_FP32);
  float *fdx = snap(&dx), *fdw = snap(&dw);
  pair_reset(&dx);
  pair_reset(&dw);
  gpu->rmsnorm_bwd(gpu, dx.g, dw.g, dout.g, x.g, w.g, rstd.g, n, c);
  check_same_bits("rmsnorm_bwd dx", &dx, fdx);
  check_same_bits("rmsnorm_bwd dw", &dw, fdw);
  pair_free(&x);
  pair_free(&w);
  pair_free(&out);
  pair_free(&rstd);
  pair_free(&dout);
  pair_free(&dx);
  pair_free(&dw);
}

static void test_rmsnorm(void **state) {
  rmsnorm_case(67, 300);
  rmsnorm_case(600, 1024); /* more rows than the backward's partial rows */
  rmsnorm_case(3, 4096);
}

/* ------------------------------------------------------------------ RoPE */

static void test_rope(void **state) {
  int b = 2, t = 37, h = 3, d = 64;
  pair_t x = pair_new((size_t)b * t * h * d, -1.0f, 1.0f);
  cpu->rope_fwd(cpu, x.c, b, t, h, d, 5, 10000.0f);
  gpu->rope_fwd(gpu, x.g, b, t, h, d, 5, 10000.0f);
  pair_check("rope_fwd (offset 5, theta 1e4)", &x, 1e-6);
  cpu->rope_bwd(cpu, x.c, b, t, h, d, 5, 10000.0f);
  gpu->rope_bwd(gpu, x.g, b, t, h, d, 5, 10000.0f);
  pair_check("rope_bwd", &x, 1e-6);
  float *back = pair_fetch(&x);
  double maxd = 0.0;
  for (size_t i = 0; i < x.n; i++) maxd = fmax(maxd, fabs((double)back[i] - x.host[i]));
  printf("  rope_bwd(rope_fwd(x)) - x: max|diff| %.3e (tolerance 1e-6)\n", maxd);
  free(back);
  assert_true(maxd <= 1e-6);
  /* another shape and theta: the cached table must be rebuilt */
  pair_t y = pair_new((size_t)1 * 100 * 2 * 128, -1.0f, 1.0f);
  cpu->rope_fwd(cpu, y.c, 1, 100, 2, 128, 0, 500000.0f);
  gpu->rope_fwd(gpu, y.g, 1, 100, 2, 128, 0, 500000.0f);
  pair_check("rope_fwd (t 100, d 128, theta 5e5)", &y, 1e-6);
  pair_free(&x);
  pair_free(&y);
}

/* ------------------------------------------------------------------ attention */

static void attention_case(int b, int t, int h, int kv, int d) {
  char what[128];
  size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  pair_t q = pair_new(nq, -2.0f, 2.0f), k = pair_new(nk, -2.0f, 2.0f), v = pair_new(nk, -1.0f, 1.0f);
  pair_t out = pair_new(nq, 0.0f, 1.0f), lse = pair_new((size_t)b * h * t, 0.0f, 1.0f);
  cpu->attention_fwd(cpu, out.c, lse.c, q.c, k.c, v.c, b, t, h, kv, d);
  gpu->attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, b, t, h, kv, d);
  snprintf(what, sizeof what, "attention_fwd b=%d t=%d h=%d kv=%d d=%d out", b, t, h, kv, d);
  pair_check(what, &out, TOL_FP32);
  snprintf(what, sizeof what, "attention_fwd b=%d t=%d h=%d kv=%d d=%d lse", b, t, h, kv, d);
  pair_check(what, &lse, TOL_FP32);
  float *fo = snap(&out), *fl = snap(&lse);
  gpu->attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, b, t, h, kv, d);
  check_same_bits("attention_fwd out", &out, fo);
  check_same_bits("attention_fwd lse", &lse, fl);

  /* the backward from the cpu's out and lse on both, so that only the backward is compared */
  gpu->to_device(gpu, out.g, out.c, nq * sizeof(float));
  gpu->to_device(gpu, lse.g, lse.c, lse.n * sizeof(float));
  pair_t dout = pair_new(nq, -1.0f, 1.0f), dq = pair_new(nq, -1.0f, 1.0f);
  pair_t dk = pair_new(nk, -1.0f, 1.0f), dv = pair_new(nk, -1.0f, 1.0f);
  cpu->attention_bwd(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, b, t, h, kv, d);
  gpu->attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, t, h, kv, d);
  snprintf(what, sizeof what, "attention_bwd b=%d t=%d h=%d kv=%d d=%d dq", b, t, h, kv, d);
  pair_check(what, &dq, TOL_FP32);
  snprintf(what, sizeof what, "attention_bwd b=%d t=%d h=%d kv=%d d=%d dk", b, t, h, kv, d);
  pair_check(what, &dk, TOL_FP32);
  snprintf(what, sizeof what, "attention_bwd b=%d t=%d h=%d kv=%d d=%d dv", b, t, h, kv, d);
  pair_check(what, &dv, TOL_FP32);
  float *fq = snap(&dq), *fk = snap(&dk), *fv = snap(&dv);
  pair_reset(&dq);
  pair_reset(&dk);
  pair_reset(&dv);
  gpu->attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, t, h, kv, d);
  check_same_bits("attention_bwd dq", &dq, fq);
  check_same_bits("attention_bwd dk", &dk, fk);
  check_same_bits("attention_bwd dv", &dv, fv);
  pair_free(&q);
  pair_free(&k);
  pair_free(&v);
  pair_free(&out);
  pair_free(&lse);
  pair_free(&dout);
  pair_free(&dq);
  pair_free(&dk);
  pair_free(&dv);
}

static void test_attention(void **state) {
  attention_case(2, 100, 4, 2, 64);  /* GQA, a partial last tile */
  attention_case(1, 257, 8, 8, 128); /* multi-head, t one past a tile */
  attention_case(2, 33, 6, 2, 40);   /* head dim padded to 64 */
  attention_case(1, 64, 4, 1, 16);   /* multi-query, whole tiles */
  attention_case(1, 5, 2, 1, 32);    /* shorter than a tile */
  attention_case(1, 512, 4, 2, 128); /* several tiles each way */
}

/* ------------------------------------------------------------------ cross-entropy */

static void ce_case(int n, int v, int ld, int alias) {
  char what[96];
  ids_t tg = ids_new((size_t)n, 0, v);
  tg.host[0] = -1;           /* ignored */
  if (n > 2) tg.host[2] = v; /* out of range: ignored as well */
  ids_upload(&tg);
  pair_t logits = pair_new((size_t)n * ld, -8.0f, 8.0f), losses = pair_new((size_t)n, 3.0f, 4.0f);
  pair_t dl = pair_new((size_t)n * ld, 3.0f, 4.0f);
  pair_t *dst = alias ? &logits : &dl;
  float gs = 1.0f / (float)n;
  cpu->cross_entropy(cpu, losses.c, dst->c, logits.c, tg.c, n, v, ld, gs);
  gpu->cross_entropy(gpu, losses.g, dst->g, logits.g, tg.g, n, v, ld, gs);
  snprintf(what, sizeof what, "cross_entropy n=%d v=%d ld=%d%s losses", n, v, ld, alias ? " aliased" : "");
  pair_check(what, &losses, TOL_FP32);
  snprintf(what, sizeof what, "cross_entropy n=%d v=%d ld=%d%s dlogits", n, v, ld, alias ? " aliased" : "");
  pair_check(what, dst, TOL_FP32);
  float *fl = snap(&losses), *fd = snap(dst);
  pair_reset(&logits);
  pair_reset(&dl);
  gpu->cross_entropy(gpu, losses.g, dst->g, logits.g, tg.g, n, v, ld, gs);
  check_same_bits("cross_entropy losses", &losses, fl);
  check_same_bits("cross_entropy dlogits", dst, fd);
  /* forward only */
  pair_reset(&logits);
  cpu->cross_entropy(cpu, losses.c, NULL, logits.c, tg.c, n, v, ld, gs);
  gpu->cross_entropy(gpu, losses.g, NULL, logits.g, tg.g, n, v, ld, gs);
  pair_check("cross_entropy losses without gradient", &losses, TOL_FP32);
  ids_free(&tg);
  pair_free(&logits);
  pair_free(&losses);
  pair_free(&dl);
}

static void test_cross_entropy(void **state) {
  ce_case(37, 1000, 1024, 0);
  ce_case(37, 1000, 1024, 1);
  ce_case(8, 32000, 32000, 1);
  ce_case(5, 50, 50, 0);
}

/* ------------------------------------------------------------------ AdamW */

static void test_adamw(void **state) {
  size_t n = 100003;
  pair_t p = pair_new(n, -1.0f, 1.0f), m = pair_new(n, 0.0f, 0.0f), v = pair_new(n, 0.0f, 0.0f);
  for (int step = 1; step <= 3; step++) {
    pair_t g = pair_new(n, -1.0f, 1.0f);
    cpu->adamw(cpu, p.c, g.c, m.c, v.c, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    gpu->adamw(gpu, p.g, g.g, m.g, v.g, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    pair_free(&g);
  }
  pair_check("adamw (3 steps) param", &p, TOL_FP32);
  pair_check("adamw (3 steps) m", &m, TOL_FP32);
  pair_check("adamw (3 steps) v", &v, TOL_FP32);
  pair_free(&p);
  pair_free(&m);
  pair_free(&v);
}

int main(void) {
  char err[512];
  if (!(cpu = backend_cpu_create(0, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda: %s\n", err);
    return 1;
  }
  if (!(gpu = backend_cuda_create(-1, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda: %s\n", err);
    backend_destroy(cpu);
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_memory),    cmocka_unit_test(test_matmul),    cmocka_unit_test(test_elementwise),
      cmocka_unit_test(test_embedding), cmocka_unit_test(test_rmsnorm),   cmocka_unit_test(test_rope),
      cmocka_unit_test(test_attention), cmocka_unit_test(test_cross_entropy), cmocka_unit_test(test_adamw),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  backend_destroy(gpu);
  backend_destroy(cpu);
  return failed ? 1 : 0;
}
