// deps: trainer/backend.c trainer/backend_cpu.c trainer/rng.c common/env.c
/* test_backend_cpu: every kernel of the cpu backend against a naive double-precision reference.
 *
 * Forward kernels are compared with a straightforward double implementation; backward kernels
 * with central finite differences of that double reference (loss = sum(out * R) for a random
 * R, so dout = R), or, where the derivative is elementwise, with the analytic formula.
 * Errors are relative: max|kernel - ref| / max|ref|. Tolerances: 1e-5 for forwards (fp32
 * rounding), 1e-4 for backwards (fp32 plus O(h^2) finite-difference error), exact bits for the
 * determinism checks. Every check prints the observed error. Shapes are small and odd on
 * purpose (t = 67 crosses the 64-row attention block; ld > V pads the logits). */
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
#include "trainer/rng.h"

#define FWD_TOL 1e-5
#define BWD_TOL 1e-4

static backend_t *be1, *be2; /* 1 and 2 threads */

/* ------------------------------------------------------------------ helpers */

static float *frand(size_t n, uint64_t stream, double scale) {
  rng_t r;
  rng_init(&r, 42, stream);
  float *x = malloc(n * sizeof *x);
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(rng_normal(&r) * scale);
  return x;
}
static double *to_double(const float *x, size_t n) {
  double *d = malloc(n * sizeof *d);
  for (size_t i = 0; i < n; i++)
    d[i] = x[i];
  return d;
}
static float *fcopy(const float *x, size_t n) {
  float *y = malloc(n * sizeof *y);
  memcpy(y, x, n * sizeof *y);
  return y;
}
static double max_rel(const float *a, const double *ref, size_t n) {
  double md = 0.0, mr = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - ref[i]);
    md = d > md ? d : md;
    mr = fabs(ref[i]) > mr ? fabs(ref[i]) : mr;
  }
  return mr > 0 ? md / mr : md;
}
static void check(const char *what, double err, double tol) {
  printf("  %-44s max rel err %.3e (tol %.0e)\n", what, err, tol);
  assert_true(err <= tol);
}

/* ------------------------------------------------------------------ matmul */

static void ref_matmul(double *c, const float *a, const float *b, int m, int n, int k, int ta, int tb, double alpha,
                       double beta) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      double s = 0.0;
      for (int p = 0; p < k; p++) {
        double av = ta ? a[(size_t)p * m + i] : a[(size_t)i * k + p];
        double bv = tb ? b[(size_t)j * k + p] : b[(size_t)p * n + j];
        s += av * bv;
      }
      c[(size_t)i * n + j] = alpha * s + beta * c[(size_t)i * n + j];
    }
}

static void matmul_case(backend_t *be, int m, int n, int k) {
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      float *a = frand((size_t)m * k, 1, 1.0), *b = frand((size_t)k * n, 2, 1.0), *c = frand((size_t)m * n, 3, 1.0);
      double *ref = to_double(c, (size_t)m * n);
      float alpha = 0.75f, beta = ta == tb ? 1.0f : -0.5f;
      be->matmul(be, c, a, b, m, n, k, ta, tb, alpha, beta);
      ref_matmul(ref, a, b, m, n, k, ta, tb, alpha, beta);
      char what[96];
      snprintf(what, sizeof what, "matmul %dx%dx%d ta=%d tb=%d threads=%s", m, n, k, ta, tb, be == be1 ? "1" : "2");
      check(what, max_rel(c, ref, (size_t)m * n), FWD_TOL);
      /* beta = 0 must ignore whatever c held (NaN included) */
      for (size_t i = 0; i < (size_t)m * n; i++)
        c[i] = NAN;
      be->matmul(be, c, a, b, m, n, k, ta, tb, 1.0f, 0.0f);
      for (size_t i = 0; i < (size_t)m * n; i++)
        ref[i] = 0.0;
      ref_matmul(ref, a, b, m, n, k, ta, tb, 1.0, 0.0);
      assert_true(max_rel(c, ref, (size_t)m * n) <= FWD_TOL);
      free(a);
      free(b);
      free(c);
      free(ref);
    }
}

static void test_matmul(void **state) {
  matmul_case(be1, 37, 29, 23);
  matmul_case(be2, 37, 29, 23);
  matmul_case(be2, 150, 90, 50);  /* large enough for the threaded split over rows */
  matmul_case(be2, 40, 170, 160); /* wide: split over columns */
}

/* ------------------------------------------------------------------ elementwise */

static void test_add_scale_sumsq(void **state) {
  size_t n = 100003;
  float *a = frand(n, 4, 1.0), *b = frand(n, 5, 1.0), *o = malloc(n * sizeof *o);
  be2->add(be2, o, a, b, n);
  double err = 0.0;
  for (size_t i = 0; i < n; i++)
    err = fmax(err, fabs((double)o[i] - ((double)a[i] + b[i])));
  check("add", err, 1e-6);
  be2->add(be2, a, a, b, n); /* aliasing out = a */
  assert_memory_equal(a, o, n * sizeof *o);
  be2->scale(be2, o, -0.5f, n);
  err = 0.0;
  for (size_t i = 0; i < n; i++)
    err = fmax(err, fabs((double)o[i] + 0.5 * a[i]));
  check("scale", err, 1e-6);
  double ref = 0.0;
  for (size_t i = 0; i < n; i++)
    ref += (double)b[i] * b[i];
  double s1 = be1->sumsq(be1, b, n), s2 = be2->sumsq(be2, b, n);
  check("sumsq (double accumulation)", fabs(s2 - ref) / ref, 1e-12);
  printf("  sumsq 1 thread vs 2 threads: %s\n", s1 == s2 ? "same bits" : "DIFFERENT");
  assert_true(s1 == s2);
  free(a);
  free(b);
  free(o);
}

/* ------------------------------------------------------------------ embedding */

static void test_embedding(void **state) {
  int rows = 11, c = 9, n = 40, vstart = 5;
  float *table = frand((size_t)rows * c, 6, 1.0), *out = malloc((size_t)n * c * sizeof *out);
  int32_t tok[40];
  rng_t r;
  rng_init(&r, 1, 7);
  for (int i = 0; i < n; i++)
    tok[i] = (int32_t)rng_below(&r, 20); /* some below 5 and past 15: zero rows */
  tok[3] = tok[4] = tok[30] = 8;         /* repeated token */
  be2->embedding_fwd(be2, out, table, tok, n, c, vstart, rows);
  double err = 0.0;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < c; j++) {
      int rr = tok[i] - vstart;
      double ref = (rr >= 0 && rr < rows) ? table[rr * c + j] : 0.0;
      err = fmax(err, fabs(out[i * c + j] - ref));
    }
  check("embedding_fwd (vocab slice [5, 16))", err, 0.0);
  float *dout = frand((size_t)n * c, 8, 1.0), *dt = frand((size_t)rows * c, 9, 1.0);
  double *ref = to_double(dt, (size_t)rows * c);
  for (int i = 0; i < n; i++) {
    int rr = tok[i] - vstart;
    if (rr < 0 || rr >= rows) continue;
    for (int j = 0; j < c; j++)
      ref[rr * c + j] += dout[i * c + j];
  }
  be2->embedding_bwd(be2, dt, dout, tok, n, c, vstart, rows);
  check("embedding_bwd (accumulates, repeated ids)", max_rel(dt, ref, (size_t)rows * c), FWD_TOL);
  free(table);
  free(out);
  free(dout);
  free(dt);
  free(ref);
}

/* ------------------------------------------------------------------ RMSNorm */

static double ref_rmsnorm_loss(const double *x, const double *w, const float *R, int n, int c, double eps,
                               double *out) {
  double loss = 0.0;
  for (int i = 0; i < n; i++) {
    double ss = 0.0;
    for (int j = 0; j < c; j++)
      ss += x[i * c + j] * x[i * c + j];
    double r = 1.0 / sqrt(ss / c + eps);
    for (int j = 0; j < c; j++) {
      double y = x[i * c + j] * r * w[j];
      if (out) out[i * c + j] = y;
      loss += y * R[i * c + j];
    }
  }
  return loss;
}

static void test_rmsnorm(void **state) {
  int n = 13, c = 37;
  float eps = 1e-5f;
  float *x = frand((size_t)n * c, 10, 1.0), *w = frand(c, 11, 0.3), *R = frand((size_t)n * c, 12, 1.0);
  for (int j = 0; j < c; j++)
    w[j] += 1.0f;
  float *out = malloc((size_t)n * c * sizeof *out), rstd[13];
  double *xd = to_double(x, (size_t)n * c), *wd = to_double(w, c), *ref = malloc((size_t)n * c * sizeof *ref);
  ref_rmsnorm_loss(xd, wd, R, n, c, eps, ref);
  be2->rmsnorm_fwd(be2, out, rstd, x, w, n, c, eps);
  check("rmsnorm_fwd", max_rel(out, ref, (size_t)n * c), FWD_TOL);

  /* backward into pre-filled buffers (accumulation), minus the prefill */
  float *dx = malloc((size_t)n * c * sizeof *dx), *dw = malloc(c * sizeof *dw);
  for (int i = 0; i < n * c; i++)
    dx[i] = 1.0f;
  for (int j = 0; j < c; j++)
    dw[j] = 1.0f;
  be2->rmsnorm_bwd(be2, dx, dw, R, x, w, rstd, n, c);
  for (int i = 0; i < n * c; i++)
    dx[i] -= 1.0f;
  for (int j = 0; j < c; j++)
    dw[j] -= 1.0f;
  double h = 1e-6, *gx = malloc((size_t)n * c * sizeof *gx), *gw = malloc(c * sizeof *gw);
  for (int i = 0; i < n * c; i++) {
    double s = xd[i];
    xd[i] = s + h;
    double lp = ref_rmsnorm_loss(xd, wd, R, n, c, eps, NULL);
    xd[i] = s - h;
    double lm = ref_rmsnorm_loss(xd, wd, R, n, c, eps, NULL);
    xd[i] = s;
    gx[i] = (lp - lm) / (2 * h);
  }
  for (int j = 0; j < c; j++) {
    double s = wd[j];
    wd[j] = s + h;
    double lp = ref_rmsnorm_loss(xd, wd, R, n, c, eps, NULL);
    wd[j] = s - h;
    double lm = ref_rmsnorm_loss(xd, wd, R, n, c, eps, NULL);
    wd[j] = s;
    gw[j] = (lp - lm) / (2 * h);
  }
  check("rmsnorm_bwd dx vs finite differences", max_rel(dx, gx, (size_t)n * c), BWD_TOL);
  check("rmsnorm_bwd dw vs finite differences", max_rel(dw, gw, c), BWD_TOL);
  free(x);
  free(w);
  free(R);
  free(out);
  free(xd);
  free(wd);
  free(ref);
  free(dx);
  free(dw);
  free(gx);
  free(gw);
}

/* ------------------------------------------------------------------ RoPE */

static void ref_rope(double *x, int b, int t, int h, int d, int off, double theta, double sign) {
  for (int bi = 0; bi < b; bi++)
    for (int ti = 0; ti < t; ti++)
      for (int hi = 0; hi < h; hi++)
        for (int i = 0; i < d / 2; i++) {
          double ang = sign * (off + ti) * pow(theta, -2.0 * i / d);
          double *p = x + (((size_t)bi * t + ti) * h + hi) * d + 2 * i;
          double x0 = p[0], x1 = p[1];
          p[0] = x0 * cos(ang) - x1 * sin(ang);
          p[1] = x0 * sin(ang) + x1 * cos(ang);
        }
}

static void test_rope(void **state) {
  int b = 2, t = 11, h = 3, d = 8;
  size_t n = (size_t)b * t * h * d;
  float *x = frand(n, 13, 1.0);
  double *xd = to_double(x, n);
  float *y = fcopy(x, n);
  /* a first call with another key, so that the cached table must be rebuilt */
  be2->rope_fwd(be2, y, 1, 5, h * 2, d, 0, 10000.0f);
  memcpy(y, x, n * sizeof *y);
  be2->rope_fwd(be2, y, b, t, h, d, 3, 500.0f);
  ref_rope(xd, b, t, h, d, 3, 500.0, 1.0);
  check("rope_fwd (offset 3, theta 500)", max_rel(y, xd, n), FWD_TOL);
  /* The rotation is orthogonal: its gradient is the inverse rotation, and bwd(fwd(x)) = x. */
  double *rd = to_double(x, n);
  float *g = fcopy(x, n);
  be2->rope_bwd(be2, g, b, t, h, d, 3, 500.0f);
  ref_rope(rd, b, t, h, d, 3, 500.0, -1.0);
  check("rope_bwd (rotation by -angle)", max_rel(g, rd, n), FWD_TOL);
  be2->rope_bwd(be2, y, b, t, h, d, 3, 500.0f);
  double *xo = to_double(x, n);
  check("rope_bwd(rope_fwd(x)) == x", max_rel(y, xo, n), FWD_TOL);
  /* adjacent-pair layout: position 1, pair 0 of head 0 rotates by exactly 1 radian (theta^0) */
  float p[4] = {1.0f, 0.0f, 0.0f, 0.0f}, q[8] = {0};
  memcpy(q + 4, p, sizeof p);
  be1->rope_fwd(be1, q, 1, 2, 1, 4, 0, 10000.0f);
  printf("  rope pair (0,1) at pos 1: (%.6f, %.6f), want (cos 1, sin 1) = (%.6f, %.6f)\n", q[4], q[5], cos(1.0),
         sin(1.0));
  assert_true(fabs(q[4] - cos(1.0)) < 1e-6 && fabs(q[5] - sin(1.0)) < 1e-6);
  free(x);
  free(xd);
  free(y);
  free(rd);
  free(g);
  free(xo);
}

/* ------------------------------------------------------------------ attention */

typedef struct {
  int b, t, h, kv, d;
} att_shape_t;

/* out (B,T,H,D), lse (B,H,T); returns sum(out * R) when R is given. */
static double ref_attention(const att_shape_t *s, const double *q, const double *k, const double *v, double *out,
                            double *lse, const float *R) {
  int b = s->b, t = s->t, h = s->h, kv = s->kv, d = s->d, g = h / kv;
  double scale = 1.0 / sqrt((double)d), loss = 0.0;
  double *p = malloc((size_t)t * sizeof *p);
  for (int bi = 0; bi < b; bi++)
    for (int hi = 0; hi < h; hi++)
      for (int i = 0; i < t; i++) {
        const double *qi = q + (((size_t)bi * t + i) * h + hi) * d;
        double mx = -INFINITY;
        for (int j = 0; j <= i; j++) {
          const double *kj = k + (((size_t)bi * t + j) * kv + hi / g) * d;
          double sc = 0.0;
          for (int e = 0; e < d; e++)
            sc += qi[e] * kj[e];
          p[j] = sc * scale;
          mx = p[j] > mx ? p[j] : mx;
        }
        double sum = 0.0;
        for (int j = 0; j <= i; j++)
          sum += exp(p[j] - mx);
        if (lse) lse[((size_t)bi * h + hi) * t + i] = mx + log(sum);
        for (int e = 0; e < d; e++) {
          double o = 0.0;
          for (int j = 0; j <= i; j++)
            o += exp(p[j] - mx) / sum * v[(((size_t)bi * t + j) * kv + hi / g) * d + e];
          size_t idx = (((size_t)bi * t + i) * h + hi) * d + e;
          if (out) out[idx] = o;
          if (R) loss += o * R[idx];
        }
      }
  free(p);
  return loss;
}

/* Finite-difference gradient of sum(out * R) at `count` random elements of x (the others
 * stay NAN and are skipped by the comparison). */
static double fd_check(const att_shape_t *s, double *q, double *k, double *v, double *x, size_t n, const float *R,
                       const float *grad, int count, uint64_t stream) {
  rng_t r;
  rng_init(&r, 3, stream);
  double h = 1e-6, md = 0.0, mr = 0.0;
  for (int c = 0; c < count; c++) {
    size_t i = (size_t)rng_below(&r, n);
    double sv = x[i];
    x[i] = sv + h;
    double lp = ref_attention(s, q, k, v, NULL, NULL, R);
    x[i] = sv - h;
    double lm = ref_attention(s, q, k, v, NULL, NULL, R);
    x[i] = sv;
    double g = (lp - lm) / (2 * h);
    md = fmax(md, fabs(grad[i] - g));
    mr = fmax(mr, fabs(g));
  }
  return mr > 0 ? md / mr : md; /* t = 1: dq is exactly 0, compare absolutely */
}

static void attention_case(backend_t *be, const att_shape_t *s) {
  size_t nq = (size_t)s->b * s->t * s->h * s->d, nk = (size_t)s->b * s->t * s->kv * s->d,
         nl = (size_t)s->b * s->h * s->t;
  float *q = frand(nq, 20, 1.0), *k = frand(nk, 21, 1.0), *v = frand(nk, 22, 1.0), *R = frand(nq, 23, 1.0);
  float *out = malloc(nq * sizeof *out), *lse = malloc(nl * sizeof *lse);
  double *qd = to_double(q, nq), *kd = to_double(k, nk), *vd = to_double(v, nk);
  double *ro = malloc(nq * sizeof *ro), *rl = malloc(nl * sizeof *rl);
  be->attention_fwd(be, out, lse, q, k, v, s->b, s->t, s->h, s->kv, s->d);
  ref_attention(s, qd, kd, vd, ro, rl, NULL);
  char what[128];
  snprintf(what, sizeof what, "attention_fwd b=%d t=%d h=%d kv=%d d=%d out", s->b, s->t, s->h, s->kv, s->d);
  check(what, max_rel(out, ro, nq), FWD_TOL);
  check("attention_fwd lse", max_rel(lse, rl, nl), FWD_TOL);

  float *dq = malloc(nq * sizeof *dq), *dk = malloc(nk * sizeof *dk), *dv = malloc(nk * sizeof *dv);
  for (size_t i = 0; i < nq; i++)
    dq[i] = 2.0f;
  for (size_t i = 0; i < nk; i++)
    dk[i] = dv[i] = 2.0f;
  be->attention_bwd(be, dq, dk, dv, R, q, k, v, out, lse, s->b, s->t, s->h, s->kv, s->d);
  for (size_t i = 0; i < nq; i++)
    dq[i] -= 2.0f; /* accumulation: remove the prefill */
  for (size_t i = 0; i < nk; i++) {
    dk[i] -= 2.0f;
    dv[i] -= 2.0f;
  }
  check("attention_bwd dq vs finite differences (120 elems)", fd_check(s, qd, kd, vd, qd, nq, R, dq, 120, 1), BWD_TOL);
  check("attention_bwd dk vs finite differences (120 elems)", fd_check(s, qd, kd, vd, kd, nk, R, dk, 120, 2), BWD_TOL);
  check("attention_bwd dv vs finite differences (120 elems)", fd_check(s, qd, kd, vd, vd, nk, R, dv, 120, 3), BWD_TOL);
  free(q);
  free(k);
  free(v);
  free(R);
  free(out);
  free(lse);
  free(qd);
  free(kd);
  free(vd);
  free(ro);
  free(rl);
  free(dq);
  free(dk);
  free(dv);
}

static void test_attention(void **state) {
  att_shape_t gqa = {2, 67, 4, 2, 8}; /* GQA, t crosses the 64-row block */
  attention_case(be2, &gqa);
  att_shape_t mha = {1, 5, 3, 3, 4};
  attention_case(be1, &mha);
  att_shape_t mqa = {3, 1, 2, 1, 6}; /* t = 1: a single key */
  attention_case(be1, &mqa);
}

/* ------------------------------------------------------------------ SwiGLU */

static void test_swiglu(void **state) {
  size_t n = 20011;
  float *a = frand(n, 30, 3.0), *g = frand(n, 31, 1.0), *R = frand(n, 32, 1.0), *out = malloc(n * sizeof *out);
  be2->swiglu_fwd(be2, out, a, g, n);
  double *ref = malloc(n * sizeof *ref), *rda = malloc(n * sizeof *rda), *rdg = malloc(n * sizeof *rdg);
  double h = 1e-6;
  for (size_t i = 0; i < n; i++) {
    double x = a[i], s = 1.0 / (1.0 + exp(-x));
    ref[i] = x * s * g[i];
    /* finite differences of the elementwise function */
    double xp = x + h, xm = x - h;
    rda[i] = R[i] * g[i] * (xp / (1.0 + exp(-xp)) - xm / (1.0 + exp(-xm))) / (2 * h);
    rdg[i] = R[i] * x * s;
  }
  check("swiglu_fwd", max_rel(out, ref, n), FWD_TOL);
  float *da = calloc(n, sizeof *da), *dg = calloc(n, sizeof *dg);
  be2->swiglu_bwd(be2, da, dg, R, a, g, n);
  check("swiglu_bwd da vs finite differences", max_rel(da, rda, n), BWD_TOL);
  check("swiglu_bwd dg", max_rel(dg, rdg, n), FWD_TOL);
  be2->swiglu_bwd(be2, da, dg, R, a, g, n); /* accumulates: twice the gradient */
  for (size_t i = 0; i < n; i++)
    rdg[i] *= 2.0;
  check("swiglu_bwd accumulates", max_rel(dg, rdg, n), FWD_TOL);
  free(a);
  free(g);
  free(R);
  free(out);
  free(ref);
  free(rda);
  free(rdg);
  free(da);
  free(dg);
}

/* ------------------------------------------------------------------ cross-entropy */

static void test_cross_entropy(void **state) {
  int n = 7, v = 13, ld = 16;
  float *logits = frand((size_t)n * ld, 40, 3.0);
  for (int i = 0; i < n; i++)
    for (int j = v; j < ld; j++)
      logits[i * ld + j] = 1e30f; /* padding must be ignored */
  logits[0 * ld + 3] = 150.0f;    /* extreme logits: exp(-150), exp(-400) underflow, no inf/NaN */
  logits[2 * ld + 5] = -400.0f;
  logits[5 * ld + 7] = -300.0f; /* the target itself far below the rest: a large, finite loss */
  int32_t tg[7] = {3, -1, 12, 0, -1, 7, 7};
  float losses[7], *dl = malloc((size_t)n * ld * sizeof *dl), gs = 0.2f;
  for (int i = 0; i < n * ld; i++)
    dl[i] = NAN;
  be2->cross_entropy(be2, losses, dl, logits, tg, n, v, ld, gs);
  double rl[7], *rd = malloc((size_t)n * ld * sizeof *rd);
  for (int i = 0; i < n; i++) {
    double mx = -INFINITY, sum = 0.0;
    for (int j = 0; j < v; j++)
      mx = fmax(mx, logits[i * ld + j]);
    for (int j = 0; j < v; j++)
      sum += exp(logits[i * ld + j] - mx);
    double lse = mx + log(sum);
    rl[i] = tg[i] < 0 ? 0.0 : lse - logits[i * ld + tg[i]];
    for (int j = 0; j < ld; j++)
      rd[i * ld + j] = (tg[i] < 0 || j >= v) ? 0.0 : gs * (exp(logits[i * ld + j] - lse) - (j == tg[i]));
  }
  check("cross_entropy losses (ignored rows 0)", max_rel(losses, rl, n), FWD_TOL);
  check("cross_entropy dlogits (padding 0, ignored rows 0)", max_rel(dl, rd, (size_t)n * ld), FWD_TOL);
  /* in place: dlogits aliases logits */
  float l2[7];
  be2->cross_entropy(be2, l2, logits, logits, tg, n, v, ld, gs);
  assert_memory_equal(l2, losses, sizeof l2);
  assert_memory_equal(logits, dl, (size_t)n * ld * sizeof *dl);
  printf("  cross_entropy in place: same bits as out of place\n");
  free(logits);
  free(dl);
  free(rd);
}

/* ------------------------------------------------------------------ AdamW */

static void test_adamw(void **state) {
  size_t n = 30001;
  float *p = frand(n, 50, 1.0), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
  double *rp = to_double(p, n), *rm = calloc(n, sizeof *rm), *rv = calloc(n, sizeof *rv);
  double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, gsc = 0.5;
  for (int step = 1; step <= 3; step++) {
    float *g = frand(n, 60 + step, 1.0);
    be2->adamw(be2, p, g, m, v, n, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd, step, (float)gsc);
    double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
    for (size_t i = 0; i < n; i++) {
      double gi = g[i] * gsc;
      rm[i] = b1 * rm[i] + (1 - b1) * gi;
      rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
      rp[i] = rp[i] * (1 - lr * wd) - lr * (rm[i] / bc1) / (sqrt(rv[i] / bc2) + eps);
    }
    free(g);
  }
  check("adamw params after 3 steps", max_rel(p, rp, n), FWD_TOL);
  check("adamw first moment", max_rel(m, rm, n), FWD_TOL);
  check("adamw second moment", max_rel(v, rv, n), FWD_TOL);
  free(p);
  free(m);
  free(v);
  free(rp);
  free(rm);
  free(rv);
}

/* ------------------------------------------------------------------ determinism, creation */

/* Runs the reducing kernels twice on the same inputs; the outputs must be the same bits. */
static void run_reducers(backend_t *be, float *outs) {
  int b = 2, t = 67, h = 4, kv = 2, d = 8, n = b * t, c = 48;
  size_t nq = (size_t)n * h * d, nk = (size_t)n * kv * d;
  float *q = frand(nq, 70, 1.0), *k = frand(nk, 71, 1.0), *v = frand(nk, 72, 1.0), *R = frand(nq, 73, 1.0);
  float *o = outs, *lse = o + nq, *dq = lse + (size_t)b * h * t, *dk = dq + nq, *dv = dk + nk, *dw = dv + nk,
        *dx = dw + c, *dt = dx + (size_t)n * c, *mm = dt + (size_t)10 * c;
  be->attention_fwd(be, o, lse, q, k, v, b, t, h, kv, d);
  be->attention_bwd(be, dq, dk, dv, R, q, k, v, o, lse, b, t, h, kv, d);
  float *x = frand((size_t)n * c, 74, 1.0), *w = frand(c, 75, 1.0), *dy = frand((size_t)n * c, 76, 1.0), rstd[134];
  float *y = malloc((size_t)n * c * sizeof *y);
  be->rmsnorm_fwd(be, y, rstd, x, w, n, c, 1e-5f);
  be->rmsnorm_bwd(be, dx, dw, dy, x, w, rstd, n, c);
  int32_t tok[134];
  for (int i = 0; i < n; i++)
    tok[i] = i % 10;
  be->embedding_bwd(be, dt, dy, tok, n, c, 0, 10);
  be->matmul(be, mm, dy, x, c, c, n, 1, 0, 1.0f, 0.0f);
  free(q);
  free(k);
  free(v);
  free(R);
  free(x);
  free(w);
  free(dy);
  free(y);
}

static void test_determinism(void **state) {
  size_t total = 2 * 134 * 32 + 2 * 4 * 67 + 4 * 134 * 16 + 48 + 134 * 48 + 10 * 48 + 48 * 48 + 1024;
  float *a = calloc(total, sizeof *a), *b = calloc(total, sizeof *b);
  run_reducers(be2, a);
  run_reducers(be2, b);
  printf("  attention, rmsnorm, embedding, matmul backward twice at 2 threads: %s\n",
         memcmp(a, b, total * sizeof *a) ? "DIFFERENT" : "same bits");
  assert_memory_equal(a, b, total * sizeof *a);
  free(a);
  free(b);
}

static void test_create(void **state) {
  char err[256] = "";
  assert_null(backend_create("tpu", 1, err, sizeof err));
  printf("  unknown backend: %s\n", err);
  assert_non_null(strstr(err, "tpu"));
#ifndef MESHRUN_HAVE_CUDA
  err[0] = 0;
  assert_null(backend_create("cuda", 1, err, sizeof err));
  printf("  cuda without nvcc: %s\n", err);
  assert_true(strlen(err) > 0);
#endif
  backend_t *be = backend_create("cpu", 0, err, sizeof err); /* threads from OMP_NUM_THREADS */
  assert_non_null(be);
  assert_string_equal(be->name, "cpu");
  float *p = be->alloc(be, 1000);
  for (int i = 0; i < 250; i++)
    assert_true(p[i] == 0.0f); /* alloc returns zeroed memory */
  be->free(be, p);
  be->free(be, NULL);
  backend_destroy(be);
  backend_destroy(NULL);
}

static int setup(void **state) {
  char err[256];
  be1 = backend_create("cpu", 1, err, sizeof err);
  be2 = backend_create("cpu", 2, err, sizeof err);
  return be1 && be2 ? 0 : -1;
}
static int teardown(void **state) {
  backend_destroy(be1);
  backend_destroy(be2);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matmul),    cmocka_unit_test(test_add_scale_sumsq),
      cmocka_unit_test(test_embedding), cmocka_unit_test(test_rmsnorm),
      cmocka_unit_test(test_rope),      cmocka_unit_test(test_attention),
      cmocka_unit_test(test_swiglu),    cmocka_unit_test(test_cross_entropy),
      cmocka_unit_test(test_adamw),     cmocka_unit_test(test_determinism),
      cmocka_unit_test(test_create),
  };
  return cmocka_run_group_tests_name("backend_cpu", tests, setup, teardown);
}
