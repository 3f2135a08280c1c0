// deps: trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/env.c trainer/backend/fatal.c common/err.c
/* test_backend_cpu: every kernel of the cpu backend against a naive double-precision reference.
 *
 * Forward kernels are compared with a straightforward double implementation; backward kernels
 * with central finite differences of that double reference (loss = sum(out * R) for a random
 * R, so dout = R), or, where the derivative is elementwise, with the analytic formula.
 * Errors are relative: max|kernel - ref| / max|ref|. Tolerances: 1e-5 for forwards (fp32
 * rounding), 1e-4 for backwards (fp32 plus O(h^2) finite-difference error), exact bits for the
 * determinism checks and for the fused entries (qkv_rope_*, add_rmsnorm_fwd) against the unfused
 * calls they replace. Every check prints the observed error. Shapes are small and odd on
 * purpose (t = 67 crosses the 64-row attention block; ld > V pads the logits).
 *
 * The bf16 tests (test_bf16_*) run each kernel with DT_BF16 against the same kernel with DT_F32
 * on the widened inputs and require round(fp32 result) exactly (0 ulps; see the bf16 section),
 * plus hand-worked rounding cases for convert. */
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
#include "trainer/model/rng.h"

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
      be->matmul(be, c, a, b, m, n, k, ta, tb, alpha, beta, DT_F32, DT_F32);
      ref_matmul(ref, a, b, m, n, k, ta, tb, alpha, beta);
      char what[96];
      snprintf(what, sizeof what, "matmul %dx%dx%d ta=%d tb=%d threads=%s", m, n, k, ta, tb, be == be1 ? "1" : "2");
      check(what, max_rel(c, ref, (size_t)m * n), FWD_TOL);
      /* beta = 0 must ignore whatever c held (NaN included) */
      for (size_t i = 0; i < (size_t)m * n; i++)
        c[i] = NAN;
      be->matmul(be, c, a, b, m, n, k, ta, tb, 1.0f, 0.0f, DT_F32, DT_F32);
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
  be2->add(be2, o, a, b, n, DT_F32);
  double err = 0.0;
  for (size_t i = 0; i < n; i++)
    err = fmax(err, fabs((double)o[i] - ((double)a[i] + b[i])));
  check("add", err, 1e-6);
  be2->add(be2, a, a, b, n, DT_F32); /* aliasing out = a */
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
  /* sumsq_parts: each piece's sum as sumsq gives it (an empty piece too), in one call */
  const size_t off[4] = {0, 17, 17, 5000}, cnt[4] = {17, 0, 4983, n - 5000};
  double parts[4], one;
  size_t same = 0;
  be2->sumsq_parts(be2, b, off, cnt, 4, parts);
  for (int i = 0; i < 4; i++) same += parts[i] == (one = be2->sumsq(be2, b + off[i], cnt[i]));
  printf("  sumsq_parts: %zu of 4 pieces the same bits as sumsq (tolerance: all)\n", same);
  assert_int_equal(same, 4);
  assert_true(parts[1] == 0.0);
  /* sumsq_parts_add: each piece's sum added into what out held (twice: the sum doubles), against
   * a plain C sum; a nan in one piece makes that piece's sum nan and no other */
  double acc[4] = {1.0, 2.0, 0.0, 0.0}, worst = 0.0;
  be2->sumsq_parts_add(be2, b, off, cnt, 4, acc);
  be2->sumsq_parts_add(be2, b, off, cnt, 4, acc);
  for (int i = 0; i < 4; i++) {
    double want = i == 0 ? 1.0 : i == 1 ? 2.0 : 0.0;
    for (size_t k = 0; k < cnt[i]; k++) want += 2.0 * (double)b[off[i] + k] * b[off[i] + k];
    const double rel = fabs(acc[i] - want) / fmax(want, 1e-300);
    printf("  sumsq_parts_add piece %d: %.17g, plain C %.17g, rel %.3e (tolerance 1e-12)\n", i, acc[i], want, rel);
    worst = fmax(worst, rel);
  }
  assert_true(worst <= 1e-12);
  const float keep = b[6000];
  b[6000] = NAN;
  double bad[4] = {0, 0, 0, 0};
  be2->sumsq_parts_add(be2, b, off, cnt, 4, bad);
  b[6000] = keep;
  printf("  sumsq_parts_add with a nan at 6000: %g %g %g %g (nan in piece 3 only)\n", bad[0], bad[1], bad[2], bad[3]);
  assert_true(isfinite(bad[0]) && isfinite(bad[1]) && isfinite(bad[2]) && isnan(bad[3]));
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
  be2->embedding_fwd(be2, out, table, tok, n, c, vstart, rows, DT_F32);
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
  be2->embedding_bwd(be2, dt, dout, tok, n, c, vstart, rows, DT_F32);
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
  be2->rmsnorm_fwd(be2, out, rstd, x, w, n, c, eps, DT_F32);
  check("rmsnorm_fwd", max_rel(out, ref, (size_t)n * c), FWD_TOL);

  /* backward into pre-filled buffers (accumulation), minus the prefill */
  float *dx = malloc((size_t)n * c * sizeof *dx), *dw = malloc(c * sizeof *dw);
  for (int i = 0; i < n * c; i++)
    dx[i] = 1.0f;
  for (int j = 0; j < c; j++)
    dw[j] = 1.0f;
  be2->rmsnorm_bwd(be2, dx, dw, R, x, w, rstd, n, c, DT_F32);
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
  be2->rope_fwd(be2, y, 1, 5, h * 2, d, 0, 10000.0f, DT_F32);
  memcpy(y, x, n * sizeof *y);
  be2->rope_fwd(be2, y, b, t, h, d, 3, 500.0f, DT_F32);
  ref_rope(xd, b, t, h, d, 3, 500.0, 1.0);
  check("rope_fwd (offset 3, theta 500)", max_rel(y, xd, n), FWD_TOL);
  /* The rotation is orthogonal: its gradient is the inverse rotation, and bwd(fwd(x)) = x. */
  double *rd = to_double(x, n);
  float *g = fcopy(x, n);
  be2->rope_bwd(be2, g, b, t, h, d, 3, 500.0f, DT_F32);
  ref_rope(rd, b, t, h, d, 3, 500.0, -1.0);
  check("rope_bwd (rotation by -angle)", max_rel(g, rd, n), FWD_TOL);
  be2->rope_bwd(be2, y, b, t, h, d, 3, 500.0f, DT_F32);
  double *xo = to_double(x, n);
  check("rope_bwd(rope_fwd(x)) == x", max_rel(y, xo, n), FWD_TOL);
  /* adjacent-pair layout: position 1, pair 0 of head 0 rotates by exactly 1 radian (theta^0) */
  float p[4] = {1.0f, 0.0f, 0.0f, 0.0f}, q[8] = {0};
  memcpy(q + 4, p, sizeof p);
  be1->rope_fwd(be1, q, 1, 2, 1, 4, 0, 10000.0f, DT_F32);
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
  be->attention_fwd(be, out, lse, q, k, v, s->b, s->t, s->h, s->kv, s->d, DT_F32);
  ref_attention(s, qd, kd, vd, ro, rl, NULL);
  char what[128];
  snprintf(what, sizeof what, "attention_fwd b=%d t=%d h=%d kv=%d d=%d out", s->b, s->t, s->h, s->kv, s->d);
  check(what, max_rel(out, ro, nq), FWD_TOL);
  check("attention_fwd lse", max_rel(lse, rl, nl), FWD_TOL);

  float *dq = malloc(nq * sizeof *dq), *dk = malloc(nk * sizeof *dk), *dv = malloc(nk * sizeof *dv);
  for (size_t i = 0; i < nq; i++)
    dq[i] = 2.0f; /* old values the backward must overwrite (it writes, it does not accumulate) */
  for (size_t i = 0; i < nk; i++)
    dk[i] = dv[i] = 2.0f;
  be->attention_bwd(be, dq, dk, dv, R, q, k, v, out, lse, s->b, s->t, s->h, s->kv, s->d, DT_F32);
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

/* ag's rows (n, 2f) from a and g (n, f each): a's row, then g's. */
static void pack_rows(float *ag, const float *a, const float *g, int n, int f) {
  for (int r = 0; r < n; r++) {
    memcpy(ag + (size_t)r * 2 * f, a + (size_t)r * f, (size_t)f * sizeof(float));
    memcpy(ag + (size_t)r * 2 * f + f, g + (size_t)r * f, (size_t)f * sizeof(float));
  }
}

static void test_swiglu(void **state) {
  int rows = 13, f = 1539; /* 20007 elements: threaded */
  size_t n = (size_t)rows * f;
  float *a = frand(n, 30, 3.0), *g = frand(n, 31, 1.0), *R = frand(n, 32, 1.0), *out = malloc(n * sizeof *out);
  float *ag = malloc(2 * n * sizeof *ag), *dag = malloc(2 * n * sizeof *dag), *da = malloc(n * sizeof *da),
        *dg = malloc(n * sizeof *dg);
  pack_rows(ag, a, g, rows, f);
  be2->swiglu_fwd(be2, out, ag, rows, f, DT_F32);
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
  check("swiglu_fwd (a, g packed in rows of 2f)", max_rel(out, ref, n), FWD_TOL);
  for (int pass = 0; pass < 2; pass++) { /* writes: a second call gives the same, not twice */
    be2->swiglu_bwd(be2, dag, R, ag, rows, f, DT_F32);
    for (int r = 0; r < rows; r++) {
      memcpy(da + (size_t)r * f, dag + (size_t)r * 2 * f, (size_t)f * sizeof(float));
      memcpy(dg + (size_t)r * f, dag + (size_t)r * 2 * f + f, (size_t)f * sizeof(float));
    }
    check(pass ? "swiglu_bwd writes (called twice): dg" : "swiglu_bwd da vs finite differences", max_rel(da, rda, n),
          BWD_TOL);
    check("swiglu_bwd dg", max_rel(dg, rdg, n), FWD_TOL);
  }
  free(a);
  free(g);
  free(R);
  free(out);
  free(ag);
  free(dag);
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
  be2->cross_entropy(be2, losses, dl, logits, tg, n, v, ld, gs, DT_F32);
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
  be2->cross_entropy(be2, l2, logits, logits, tg, n, v, ld, gs, DT_F32);
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
    be2->adamw(be2, p, g, m, v, NULL, n, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd, step, (float)gsc);
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

/* ------------------------------------------------------------------ bf16
 *
 * Every kernel with a dt runs twice on the same values: with DT_BF16 on bf16 tensors (random
 * values rounded to bf16), and with DT_F32 on their exact fp32 widenings, the reference.
 * backend.h promises widen, compute in fp32, round once per store; so a bf16 output must be
 * bf16_round(the fp32 output), and an accumulated one (dx +=, beta * c) round(the fp32 kernel
 * accumulating into the widened old value). Tolerance: 0 ulps, since the cpu backend runs the
 * very fp32 kernels on the widened values and any other difference is a bug. The fp32 outputs
 * of bf16 calls (rstd, lse, losses, row stats, dw, dtable) must be the reference's bits.
 * Non-accumulated bf16 outputs start as NaN, so an element the kernel misses fails. */

#define BF16_ULP_TOL 0

typedef struct {
  bf16_t *h; /* the bf16 tensor the DT_BF16 call reads */
  float *f;  /* its exact widening, for the DT_F32 reference */
  size_t n;
} pair_t;

static pair_t pair_from(const float *x, size_t n) {
  pair_t p = {malloc(n * sizeof(bf16_t)), malloc(n * sizeof(float)), n};
  for (size_t i = 0; i < n; i++) {
    p.h[i] = bf16_from_f32(x[i]);
    p.f[i] = bf16_to_f32(p.h[i]);
  }
  return p;
}
/* frand's values, rounded to bf16 */
static pair_t pair_rand(size_t n, uint64_t stream, double scale) {
  rng_t r;
  rng_init(&r, 42, stream);
  pair_t p = {malloc(n * sizeof(bf16_t)), malloc(n * sizeof(float)), n};
  for (size_t i = 0; i < n; i++) {
    p.h[i] = bf16_from_f32((float)(rng_normal(&r) * scale));
    p.f[i] = bf16_to_f32(p.h[i]);
  }
  return p;
}
static void pair_free(pair_t *p) {
  free(p->h);
  free(p->f);
}
static bf16_t *hcopy(const bf16_t *x, size_t n) {
  bf16_t *y = malloc(n * sizeof *y);
  memcpy(y, x, n * sizeof *y);
  return y;
}
static bf16_t *hnan(size_t n) {
  bf16_t *y = malloc(n * sizeof *y);
  for (size_t i = 0; i < n; i++)
    y[i] = 0x7fc0; /* a quiet NaN */
  return y;
}
static float *fnan(size_t n) {
  float *y = malloc(n * sizeof *y);
  for (size_t i = 0; i < n; i++)
    y[i] = NAN;
  return y;
}

/* Distance in bf16 steps between two bf16 values (ordered by value, -0 = +0); NaN against a
 * number counts as 1 << 20, NaN against NaN as 0. */
static long bf16_ulps(bf16_t a, bf16_t b) {
  int an = isnan(bf16_to_f32(a)), bn = isnan(bf16_to_f32(b));
  if (an || bn) return an && bn ? 0 : 1L << 20;
  long ia = (a & 0x8000) ? -(long)(a & 0x7fff) : (long)a;
  long ib = (b & 0x8000) ? -(long)(b & 0x7fff) : (long)b;
  return labs(ia - ib);
}

/* A bf16 output against the fp32 reference rounded once: prints the largest distance in ulps. */
static void check_bf16(const char *what, const bf16_t *got, const float *ref, size_t n) {
  long mx = 0;
  for (size_t i = 0; i < n; i++) {
    long u = bf16_ulps(got[i], bf16_from_f32(ref[i]));
    mx = u > mx ? u : mx;
  }
  printf("  %-58s max %ld ulp vs round(fp32) (tol %d)\n", what, mx, BF16_ULP_TOL);
  assert_true(mx <= BF16_ULP_TOL);
}

/* An fp32 output of a bf16 call against the fp32 reference: the same bits. */
static void check_f32_same(const char *what, const float *got, const float *ref, size_t n) {
  size_t bad = 0;
  double md = 0.0;
  for (size_t i = 0; i < n; i++)
    if (memcmp(got + i, ref + i, sizeof(float)) != 0) {
      bad++;
      md = fmax(md, fabs((double)got[i] - ref[i]));
    }
  printf("  %-58s %zu of %zu differ, max abs diff %.3e (tol: same bits)\n", what, bad, n, md);
  assert_true(bad == 0);
}

static void bf16_matmul_case(backend_t *be, int m, int n, int k) {
  size_t mn = (size_t)m * n;
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      pair_t a = pair_rand((size_t)m * k, 80, 1.0), b = pair_rand((size_t)k * n, 81, 1.0), c = pair_rand(mn, 82, 1.0);
      float alpha = 0.75f, beta = ta == tb ? 1.0f : -0.5f;
      char what[128], tag[64];
      snprintf(tag, sizeof tag, "%dx%dx%d ta=%d tb=%d threads=%s", m, n, k, ta, tb, be == be1 ? "1" : "2");
      /* (fp32, fp32) on the widened values: the reference, itself checked against doubles */
      float *ref = fcopy(c.f, mn);
      double *dref = to_double(c.f, mn);
      be->matmul(be, ref, a.f, b.f, m, n, k, ta, tb, alpha, beta, DT_F32, DT_F32);
      ref_matmul(dref, a.f, b.f, m, n, k, ta, tb, alpha, beta);
      snprintf(what, sizeof what, "matmul (fp32,fp32) %s", tag);
      check(what, max_rel(ref, dref, mn), FWD_TOL);
      /* (bf16, bf16): c accumulates (beta != 0) into bf16 */
      bf16_t *ch = hcopy(c.h, mn);
      be->matmul(be, ch, a.h, b.h, m, n, k, ta, tb, alpha, beta, DT_BF16, DT_BF16);
      snprintf(what, sizeof what, "matmul (bf16,bf16) %s", tag);
      check_bf16(what, ch, ref, mn);
      /* (bf16, fp32): dW += dy^T x into fp32 gradients, no rounding */
      float *cf = fcopy(c.f, mn);
      be->matmul(be, cf, a.h, b.h, m, n, k, ta, tb, alpha, beta, DT_BF16, DT_F32);
      snprintf(what, sizeof what, "matmul (bf16,fp32) %s", tag);
      check_f32_same(what, cf, ref, mn);
      /* beta = 0 ignores c, NaN included, for both output dtypes */
      float *ref0 = fnan(mn);
      be->matmul(be, ref0, a.f, b.f, m, n, k, ta, tb, 1.0f, 0.0f, DT_F32, DT_F32);
      bf16_t *ch0 = hnan(mn);
      be->matmul(be, ch0, a.h, b.h, m, n, k, ta, tb, 1.0f, 0.0f, DT_BF16, DT_BF16);
      snprintf(what, sizeof what, "matmul (bf16,bf16) beta=0 %s", tag);
      check_bf16(what, ch0, ref0, mn);
      float *cf0 = fnan(mn);
      be->matmul(be, cf0, a.h, b.h, m, n, k, ta, tb, 1.0f, 0.0f, DT_BF16, DT_F32);
      snprintf(what, sizeof what, "matmul (bf16,fp32) beta=0 %s", tag);
      check_f32_same(what, cf0, ref0, mn);
      pair_free(&a);
      pair_free(&b);
      pair_free(&c);
      free(ref);
      free(dref);
      free(ch);
      free(cf);
      free(ref0);
      free(ch0);
      free(cf0);
    }
}

static void test_bf16_matmul(void **state) {
  bf16_matmul_case(be1, 37, 29, 23);
  bf16_matmul_case(be2, 37, 29, 23);
  bf16_matmul_case(be2, 150, 90, 50);  /* threaded split over rows */
  bf16_matmul_case(be2, 40, 170, 160); /* split over columns */
  /* k = 0: c = beta * c, rounded once */
  pair_t c = pair_rand(15, 83, 1.0);
  float dummy = 0.0f, *ref = fcopy(c.f, 15);
  be1->matmul(be1, ref, &dummy, &dummy, 3, 5, 0, 0, 0, 1.0f, 0.3f, DT_F32, DT_F32);
  be1->matmul(be1, c.h, &dummy, &dummy, 3, 5, 0, 0, 0, 1.0f, 0.3f, DT_BF16, DT_BF16);
  check_bf16("matmul (bf16,bf16) k=0: c = round(0.3 c)", c.h, ref, 15);
  pair_free(&c);
  free(ref);
}

static void test_bf16_add(void **state) {
  size_t n = 100003; /* threaded */
  pair_t a = pair_rand(n, 84, 1.0), b = pair_rand(n, 85, 3.0);
  float *ref = malloc(n * sizeof *ref);
  bf16_t *o = hnan(n);
  be2->add(be2, ref, a.f, b.f, n, DT_F32);
  be2->add(be2, o, a.h, b.h, n, DT_BF16);
  check_bf16("add", o, ref, n);
  be2->add(be2, a.h, a.h, b.h, n, DT_BF16); /* out aliases a */
  assert_memory_equal(a.h, o, n * sizeof *o);
  printf("  add in place (out = a): same bits as out of place\n");
  pair_free(&a);
  pair_free(&b);
  free(ref);
  free(o);
}

/* fp32 -> bf16 cases worked out by hand (bf16 keeps 8 significant bits, so the ulp of [1, 2)
 * is 2^-7 and 2^-8 is half of it). */
static const struct {
  uint32_t in;
  uint16_t out;
  const char *what;
} round_cases[] = {
    {0x3f800000u, 0x3f80, "1"},
    {0x3f808000u, 0x3f80, "1 + 2^-8: tie, down to even 1"},
    {0x3f818000u, 0x3f82, "1 + 3*2^-8: tie, up to even 1 + 2^-6"},
    {0xbf818000u, 0xbf82, "-(1 + 3*2^-8): tie, to even -(1 + 2^-6)"},
    {0x3f808001u, 0x3f81, "1 + 2^-8 + 2^-23: above the tie, up"},
    {0x3f807fffu, 0x3f80, "1 + 2^-8 - 2^-23: below the tie, down"},
    {0x3f810000u, 0x3f81, "1 + 2^-7: exact"},
    {0x3fff8000u, 0x4000, "2 - 2^-8: tie, carries into the exponent (2)"},
    {0x7f7f0000u, 0x7f7f, "largest bf16 (2 - 2^-7) 2^127: exact"},
    {0x7f7f7fffu, 0x7f7f, "just below the tie above it: largest bf16"},
    {0x7f7f8000u, 0x7f80, "(2 - 2^-8) 2^127: tie, to even = inf"},
    {0x7f7fffffu, 0x7f80, "FLT_MAX: inf"},
    {0xff7fffffu, 0xff80, "-FLT_MAX: -inf"},
    {0x7f800000u, 0x7f80, "inf"},
    {0xff800000u, 0xff80, "-inf"},
    {0x00000000u, 0x0000, "0"},
    {0x80000000u, 0x8000, "-0"},
    {0x00000001u, 0x0000, "smallest fp32 subnormal: 0"},
    {0x00008000u, 0x0000, "2^-134: tie, to even 0"},
    {0x00018000u, 0x0002, "3*2^-134: tie, to even 2^-132"},
    {0x00008001u, 0x0001, "just above 2^-134: the smallest bf16 subnormal"},
};
/* NaNs, including those that a plain round-half-up of the bits would turn into inf or -0 */
static const uint32_t nan_cases[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu};

static void test_bf16_convert(void **state) {
  size_t nr = sizeof round_cases / sizeof round_cases[0], nn = sizeof nan_cases / sizeof nan_cases[0];
  float in[32];
  bf16_t out[32];
  for (size_t i = 0; i < nr; i++)
    memcpy(in + i, &round_cases[i].in, sizeof(float));
  for (size_t i = 0; i < nn; i++)
    memcpy(in + nr + i, &nan_cases[i], sizeof(float));
  be1->convert(be1, out, DT_BF16, in, DT_F32, nr + nn);
  int bad = 0;
  for (size_t i = 0; i < nr; i++)
    if (out[i] != round_cases[i].out) {
      printf("  convert %-50s got 0x%04x, want 0x%04x\n", round_cases[i].what, out[i], round_cases[i].out);
      bad++;
    }
  for (size_t i = 0; i < nn; i++)
    if (!isnan(bf16_to_f32(out[nr + i]))) {
      printf("  convert NaN 0x%08x gave 0x%04x, not a NaN\n", nan_cases[i], out[nr + i]);
      bad++;
    }
  printf("  convert fp32->bf16: %zu rounding cases (ties to even, overflow to inf, subnormals) and %zu NaNs, %d "
         "wrong\n",
         nr, nn, bad);
  assert_int_equal(bad, 0);

  /* widening every bf16 bit pattern is exact (NaN stays NaN), and narrowing it back returns it */
  size_t n = 65536; /* threaded */
  bf16_t *all = malloc(n * sizeof *all), *back = malloc(n * sizeof *back);
  float *w = malloc(n * sizeof *w);
  for (size_t i = 0; i < n; i++)
    all[i] = (bf16_t)i;
  be2->convert(be2, w, DT_F32, all, DT_BF16, n);
  be2->convert(be2, back, DT_BF16, w, DT_F32, n);
  size_t wrong_w = 0, wrong_b = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, w + i, sizeof u);
    int nan = (i & 0x7fff) > 0x7f80;
    if (nan ? !isnan(w[i]) : u != (uint32_t)i << 16) wrong_w++;
    if (nan ? !isnan(bf16_to_f32(back[i])) : back[i] != all[i]) wrong_b++;
  }
  printf("  convert bf16->fp32 of all 65536 patterns: %zu not exact; back to bf16: %zu changed\n", wrong_w, wrong_b);
  assert_true(wrong_w == 0 && wrong_b == 0);

  /* the threaded narrowing of random values is bf16.h's rounding, element for element */
  size_t m = 100003;
  float *x = frand(m, 86, 100.0), *x2 = malloc(m * sizeof *x2);
  bf16_t *h = hnan(m), *h2 = malloc(m * sizeof *h2);
  be2->convert(be2, h, DT_BF16, x, DT_F32, m);
  check_bf16("convert fp32->bf16, 100003 random values", h, x, m);
  /* same dtype: a copy */
  be2->convert(be2, x2, DT_F32, x, DT_F32, m);
  be2->convert(be2, h2, DT_BF16, h, DT_BF16, m);
  assert_memory_equal(x2, x, m * sizeof *x);
  assert_memory_equal(h2, h, m * sizeof *h);
  printf("  convert fp32->fp32 and bf16->bf16: same bits\n");
  free(all);
  free(back);
  free(w);
  free(x);
  free(x2);
  free(h);
  free(h2);
}

static void test_bf16_embedding(void **state) {
  int rows = 50, c = 333, n = 120, vstart = 7; /* n * c > PAR_MIN: threaded */
  pair_t table = pair_rand((size_t)rows * c, 87, 1.0), dout = pair_rand((size_t)n * c, 88, 1.0);
  int32_t tok[120];
  rng_t r;
  rng_init(&r, 2, 9);
  for (int i = 0; i < n; i++)
    tok[i] = (int32_t)rng_below(&r, 70); /* some outside [7, 57): zero rows */
  tok[5] = tok[6] = tok[90] = 20;        /* repeated token */
  float *ref = fnan((size_t)n * c);
  bf16_t *out = hnan((size_t)n * c);
  be2->embedding_fwd(be2, ref, table.f, tok, n, c, vstart, rows, DT_F32);
  be2->embedding_fwd(be2, out, table.h, tok, n, c, vstart, rows, DT_BF16);
  check_bf16("embedding_fwd", out, ref, (size_t)n * c);
  float *dt = frand((size_t)rows * c, 89, 1.0), *dref = fcopy(dt, (size_t)rows * c);
  be2->embedding_bwd(be2, dref, dout.f, tok, n, c, vstart, rows, DT_F32);
  be2->embedding_bwd(be2, dt, dout.h, tok, n, c, vstart, rows, DT_BF16);
  check_f32_same("embedding_bwd dtable (fp32, accumulated)", dt, dref, (size_t)rows * c);
  pair_free(&table);
  pair_free(&dout);
  free(ref);
  free(out);
  free(dt);
  free(dref);
}

static void bf16_rmsnorm_case(backend_t *be, int n, int c) {
  size_t nc = (size_t)n * c;
  float *w0 = frand(c, 91, 0.3);
  for (int j = 0; j < c; j++)
    w0[j] += 1.0f;
  pair_t x = pair_rand(nc, 90, 2.0), w = pair_from(w0, c), dout = pair_rand(nc, 92, 1.0), dx = pair_rand(nc, 93, 1.0);
  float *ref = fnan(nc), *rstd_f = fnan(n), *rstd_h = fnan(n);
  bf16_t *out = hnan(nc);
  be->rmsnorm_fwd(be, ref, rstd_f, x.f, w.f, n, c, 1e-5f, DT_F32);
  be->rmsnorm_fwd(be, out, rstd_h, x.h, w.h, n, c, 1e-5f, DT_BF16);
  char what[128];
  snprintf(what, sizeof what, "rmsnorm_fwd n=%d c=%d out", n, c);
  check_bf16(what, out, ref, nc);
  check_f32_same("rmsnorm_fwd rstd (fp32)", rstd_h, rstd_f, n);
  float *dx_ref = fcopy(dx.f, nc), *dw = frand(c, 94, 1.0), *dw_ref = fcopy(dw, c);
  be->rmsnorm_bwd(be, dx_ref, dw_ref, dout.f, x.f, w.f, rstd_f, n, c, DT_F32);
  be->rmsnorm_bwd(be, dx.h, dw, dout.h, x.h, w.h, rstd_h, n, c, DT_BF16);
  check_bf16("rmsnorm_bwd dx (accumulated: round(old + fp32 delta))", dx.h, dx_ref, nc);
  check_f32_same("rmsnorm_bwd dw (fp32, accumulated)", dw, dw_ref, c);
  free(w0);
  pair_free(&x);
  pair_free(&w);
  pair_free(&dout);
  pair_free(&dx);
  free(ref);
  free(rstd_f);
  free(rstd_h);
  free(out);
  free(dx_ref);
  free(dw);
  free(dw_ref);
}

static void test_bf16_rmsnorm(void **state) {
  bf16_rmsnorm_case(be1, 13, 37);
  bf16_rmsnorm_case(be2, 64, 300); /* threaded */
}

static void test_bf16_rope(void **state) {
  int b = 2, t = 67, h = 4, d = 32; /* threaded */
  size_t n = (size_t)b * t * h * d;
  pair_t x = pair_rand(n, 95, 1.0);
  float *ref = fcopy(x.f, n);
  be2->rope_fwd(be2, ref, b, t, h, d, 5, 10000.0f, DT_F32);
  be2->rope_fwd(be2, x.h, b, t, h, d, 5, 10000.0f, DT_BF16);
  check_bf16("rope_fwd (in place)", x.h, ref, n);
  /* backward from the bf16 result: the reference starts from its widening */
  for (size_t i = 0; i < n; i++)
    ref[i] = bf16_to_f32(x.h[i]);
  be2->rope_bwd(be2, ref, b, t, h, d, 5, 10000.0f, DT_F32);
  be2->rope_bwd(be2, x.h, b, t, h, d, 5, 10000.0f, DT_BF16);
  check_bf16("rope_bwd (in place)", x.h, ref, n);
  pair_free(&x);
  free(ref);
}

static void bf16_attention_case(backend_t *be, const att_shape_t *s) {
  size_t nq = (size_t)s->b * s->t * s->h * s->d, nk = (size_t)s->b * s->t * s->kv * s->d,
         nl = (size_t)s->b * s->h * s->t;
  pair_t q = pair_rand(nq, 100, 1.0), k = pair_rand(nk, 101, 1.0), v = pair_rand(nk, 102, 1.0);
  float *ref = fnan(nq), *lse_f = fnan(nl), *lse_h = fnan(nl);
  bf16_t *out = hnan(nq);
  be->attention_fwd(be, ref, lse_f, q.f, k.f, v.f, s->b, s->t, s->h, s->kv, s->d, DT_F32);
  be->attention_fwd(be, out, lse_h, q.h, k.h, v.h, s->b, s->t, s->h, s->kv, s->d, DT_BF16);
  char what[128];
  snprintf(what, sizeof what, "attention_fwd b=%d t=%d h=%d kv=%d d=%d out", s->b, s->t, s->h, s->kv, s->d);
  check_bf16(what, out, ref, nq);
  check_f32_same("attention_fwd lse (fp32)", lse_h, lse_f, nl);
  /* backward: the bf16 call reads the bf16 out, so the reference reads its widening */
  pair_t dout = pair_rand(nq, 103, 1.0), dq = pair_rand(nq, 104, 1.0), dk = pair_rand(nk, 105, 1.0),
         dv = pair_rand(nk, 106, 1.0);
  float *out_w = malloc(nq * sizeof *out_w), *dq_ref = fcopy(dq.f, nq), *dk_ref = fcopy(dk.f, nk),
        *dv_ref = fcopy(dv.f, nk);
  for (size_t i = 0; i < nq; i++)
    out_w[i] = bf16_to_f32(out[i]);
  be->attention_bwd(be, dq_ref, dk_ref, dv_ref, dout.f, q.f, k.f, v.f, out_w, lse_f, s->b, s->t, s->h, s->kv, s->d,
                    DT_F32);
  be->attention_bwd(be, dq.h, dk.h, dv.h, dout.h, q.h, k.h, v.h, out, lse_h, s->b, s->t, s->h, s->kv, s->d, DT_BF16);
  check_bf16("attention_bwd dq (written)", dq.h, dq_ref, nq);
  check_bf16("attention_bwd dk (written)", dk.h, dk_ref, nk);
  check_bf16("attention_bwd dv (written)", dv.h, dv_ref, nk);
  pair_free(&q);
  pair_free(&k);
  pair_free(&v);
  pair_free(&dout);
  pair_free(&dq);
  pair_free(&dk);
  pair_free(&dv);
  free(ref);
  free(lse_f);
  free(lse_h);
  free(out);
  free(out_w);
  free(dq_ref);
  free(dk_ref);
  free(dv_ref);
}

static void test_bf16_attention(void **state) {
  att_shape_t gqa = {2, 67, 4, 2, 8};
  bf16_attention_case(be2, &gqa);
  att_shape_t mha = {1, 5, 3, 3, 4};
  bf16_attention_case(be1, &mha);
}

static void test_bf16_swiglu(void **state) {
  int rows = 7, f = 1429; /* 10003 of each: threaded, and no multiple of 8 */
  size_t n = (size_t)rows * f;
  pair_t ag = pair_rand(2 * n, 110, 3.0), dout = pair_rand(n, 112, 1.0), dag = pair_rand(2 * n, 113, 1.0);
  float *ref = fnan(n), *dag_ref = fcopy(dag.f, 2 * n);
  bf16_t *out = hnan(n);
  be2->swiglu_fwd(be2, ref, ag.f, rows, f, DT_F32);
  be2->swiglu_fwd(be2, out, ag.h, rows, f, DT_BF16);
  check_bf16("swiglu_fwd", out, ref, n);
  be2->swiglu_bwd(be2, dag_ref, dout.f, ag.f, rows, f, DT_F32);
  be2->swiglu_bwd(be2, dag.h, dout.h, ag.h, rows, f, DT_BF16);
  check_bf16("swiglu_bwd da, dg (written)", dag.h, dag_ref, 2 * n);
  pair_free(&ag);
  pair_free(&dout);
  pair_free(&dag);
  free(ref);
  free(dag_ref);
  free(out);
}

/* ------------------------------------------------------------------ fused entries */

/* Bytes of two buffers the same: prints how many elements of es bytes differ. */
static void check_same_bits(const char *what, const void *got, const void *ref, size_t n, size_t es) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++)
    bad += memcmp((const char *)got + i * es, (const char *)ref + i * es, es) != 0;
  printf("  %-58s %zu of %zu differ (tol: same bits)\n", what, bad, n);
  assert_true(bad == 0);
}

/* qkv_rope_fwd against the unfused path (columns copied out, rope_fwd on q and k), and
 * qkv_rope_bwd against rope_bwd on copies packed: the same bits, in fp32 and bf16. The outputs
 * start as NaN (written, not accumulated); dq, dk, dv must come back unchanged. */
static void qkv_rope_case(backend_t *be, dtype_t dt, int b, int t, int h, int kv, int d, int pos) {
  const size_t es = dtype_size(dt), rows = (size_t)b * t, HD = (size_t)h * d, KD = (size_t)kv * d,
               W = HD + 2 * KD;
  pair_t qkv = pair_rand(rows * W, 120, 1.0), g = pair_rand(rows * W, 121, 1.0);
  const void *src = dt == DT_F32 ? (void *)qkv.f : (void *)qkv.h, *gsrc = dt == DT_F32 ? (void *)g.f : (void *)g.h;
  char *q = malloc(rows * HD * es), *k = malloc(rows * KD * es), *v = malloc(rows * KD * es);
  char *rq = malloc(rows * HD * es), *rk = malloc(rows * KD * es), *rv = malloc(rows * KD * es);
  char *out = malloc(rows * W * es), *ref = malloc(rows * W * es);
  memset(q, 0xff, rows * HD * es);
  memset(k, 0xff, rows * KD * es);
  memset(v, 0xff, rows * KD * es);
  be->copy_2d(be, rq, (int)HD, src, (int)W, (int)rows, (int)HD, dt);
  be->copy_2d(be, rk, (int)KD, (const char *)src + HD * es, (int)W, (int)rows, (int)KD, dt);
  be->copy_2d(be, rv, (int)KD, (const char *)src + (HD + KD) * es, (int)W, (int)rows, (int)KD, dt);
  be->rope_fwd(be, rq, b, t, h, d, pos, 10000.0f, dt);
  be->rope_fwd(be, rk, b, t, kv, d, pos, 10000.0f, dt);
  be->qkv_rope_fwd(be, q, k, v, src, b, t, h, kv, d, pos, 10000.0f, dt);
  char what[128];
  snprintf(what, sizeof what, "qkv_rope_fwd %s b=%d t=%d h=%d kv=%d d=%d: q", dtype_name(dt), b, t, h, kv, d);
  check_same_bits(what, q, rq, rows * HD, es);
  check_same_bits("  k", k, rk, rows * KD, es);
  check_same_bits("  v", v, rv, rows * KD, es);
  /* backward: the gradient's q, k, v columns as the inputs, the reference rotated in place */
  be->copy_2d(be, q, (int)HD, gsrc, (int)W, (int)rows, (int)HD, dt);
  be->copy_2d(be, k, (int)KD, (const char *)gsrc + HD * es, (int)W, (int)rows, (int)KD, dt);
  be->copy_2d(be, v, (int)KD, (const char *)gsrc + (HD + KD) * es, (int)W, (int)rows, (int)KD, dt);
  memcpy(rq, q, rows * HD * es);
  memcpy(rk, k, rows * KD * es);
  be->rope_bwd(be, rq, b, t, h, d, pos, 10000.0f, dt);
  be->rope_bwd(be, rk, b, t, kv, d, pos, 10000.0f, dt);
  be->copy_2d(be, ref, (int)W, rq, (int)HD, (int)rows, (int)HD, dt);
  be->copy_2d(be, ref + HD * es, (int)W, rk, (int)KD, (int)rows, (int)KD, dt);
  be->copy_2d(be, ref + (HD + KD) * es, (int)W, v, (int)KD, (int)rows, (int)KD, dt);
  memset(out, 0xff, rows * W * es);
  be->qkv_rope_bwd(be, out, q, k, v, b, t, h, kv, d, pos, 10000.0f, dt);
  check_same_bits("qkv_rope_bwd dqkv (written)", out, ref, rows * W, es);
  check_same_bits("  dq unchanged (row 0)", q, gsrc, HD, es);
  check_same_bits("  dv unchanged (row 0)", v, (const char *)gsrc + (HD + KD) * es, KD, es);
  pair_free(&qkv);
  pair_free(&g);
  free(q);
  free(k);
  free(v);
  free(rq);
  free(rk);
  free(rv);
  free(out);
  free(ref);
}

static void test_qkv_rope(void **state) {
  qkv_rope_case(be2, DT_F32, 2, 67, 4, 2, 32, 0); /* GQA, threaded */
  qkv_rope_case(be1, DT_F32, 1, 5, 3, 3, 6, 3);   /* MHA, a position offset (KV-cache decoding) */
  qkv_rope_case(be2, DT_BF16, 2, 67, 4, 2, 32, 0);
  qkv_rope_case(be1, DT_BF16, 1, 1, 2, 1, 4, 9); /* one row at position 9 */
}

/* add_rmsnorm_fwd against add then rmsnorm_fwd: the same bits (sum, out, rstd), with sum apart
 * and with sum aliasing a (x_mid over the residual it adds to, as the model may call it). */
static void add_rmsnorm_case(backend_t *be, dtype_t dt, int n, int c) {
  const size_t es = dtype_size(dt), nc = (size_t)n * c;
  pair_t a = pair_rand(nc, 130, 1.0), y = pair_rand(nc, 131, 1.0), w = pair_rand((size_t)c, 132, 1.0);
  const void *pa = dt == DT_F32 ? (void *)a.f : (void *)a.h, *py = dt == DT_F32 ? (void *)y.f : (void *)y.h,
             *pw = dt == DT_F32 ? (void *)w.f : (void *)w.h;
  char *sum = malloc(nc * es), *out = malloc(nc * es), *rsum = malloc(nc * es), *rout = malloc(nc * es);
  float *rstd = fnan((size_t)n), *rrstd = fnan((size_t)n);
  be->add(be, rsum, pa, py, nc, dt);
  be->rmsnorm_fwd(be, rout, rrstd, rsum, pw, n, c, 1e-5f, dt);
  be->add_rmsnorm_fwd(be, sum, out, rstd, pa, py, pw, n, c, 1e-5f, dt);
  char what[128];
  snprintf(what, sizeof what, "add_rmsnorm_fwd %s n=%d c=%d: sum", dtype_name(dt), n, c);
  check_same_bits(what, sum, rsum, nc, es);
  check_same_bits("  out", out, rout, nc, es);
  check_same_bits("  rstd (fp32)", rstd, rrstd, (size_t)n, sizeof(float));
  memcpy(sum, pa, nc * es); /* sum aliasing a */
  be->add_rmsnorm_fwd(be, sum, out, rstd, sum, py, pw, n, c, 1e-5f, dt);
  check_same_bits("  sum aliasing a: sum", sum, rsum, nc, es);
  check_same_bits("  sum aliasing a: out", out, rout, nc, es);
  pair_free(&a);
  pair_free(&y);
  pair_free(&w);
  free(sum);
  free(out);
  free(rsum);
  free(rout);
  free(rstd);
  free(rrstd);
}

static void test_add_rmsnorm(void **state) {
  add_rmsnorm_case(be1, DT_F32, 13, 37);
  add_rmsnorm_case(be2, DT_F32, 64, 300); /* threaded */
  add_rmsnorm_case(be1, DT_BF16, 13, 37);
  add_rmsnorm_case(be2, DT_BF16, 64, 300);
}

static void bf16_ce_case(int n, int v, int ld) {
  size_t nl = (size_t)n * ld;
  float *x = frand(nl, 120, 3.0);
  for (int i = 0; i < n; i++)
    for (int j = v; j < ld; j++)
      x[(size_t)i * ld + j] = 1e30f; /* padding: ignored */
  x[3] = 150.0f;                     /* extreme logits, as in test_cross_entropy */
  x[(size_t)2 * ld + 5] = -400.0f;
  pair_t lg = pair_from(x, nl);
  int32_t *tg = malloc((size_t)n * sizeof *tg);
  for (int i = 0; i < n; i++)
    tg[i] = i % 5 == 1 ? -1 : (int32_t)((i * 7) % v); /* some ignored rows */
  float *l_f = fnan(n), *l_h = fnan(n), *l_in = fnan(n), *d_f = fnan(nl), gs = 0.2f;
  bf16_t *d_h = hnan(nl);
  be2->cross_entropy(be2, l_f, d_f, lg.f, tg, n, v, ld, gs, DT_F32);
  be2->cross_entropy(be2, l_h, d_h, lg.h, tg, n, v, ld, gs, DT_BF16);
  char what[128];
  snprintf(what, sizeof what, "cross_entropy n=%d v=%d ld=%d losses (fp32)", n, v, ld);
  check_f32_same(what, l_h, l_f, n);
  check_bf16("cross_entropy dlogits", d_h, d_f, nl);
  be2->cross_entropy(be2, l_in, NULL, lg.h, tg, n, v, ld, gs, DT_BF16);
  check_f32_same("cross_entropy without dlogits: losses (fp32)", l_in, l_f, n);
  be2->cross_entropy(be2, l_in, lg.h, lg.h, tg, n, v, ld, gs, DT_BF16); /* in place */
  assert_memory_equal(l_in, l_h, (size_t)n * sizeof *l_in);
  assert_memory_equal(lg.h, d_h, nl * sizeof *d_h);
  printf("  cross_entropy bf16 in place: same bits as out of place\n");
  free(x);
  pair_free(&lg);
  free(tg);
  free(l_f);
  free(l_h);
  free(l_in);
  free(d_f);
  free(d_h);
}

static void test_bf16_cross_entropy(void **state) {
  bf16_ce_case(7, 13, 16);
  bf16_ce_case(64, 500, 512); /* threaded */
}

static void test_bf16_copy_2d(void **state) {
  int rows = 5, cols = 7, lds = 11, ldd = 9;
  pair_t src = pair_rand((size_t)rows * lds, 130, 1.0), dst = pair_rand((size_t)rows * ldd, 131, 1.0);
  bf16_t *want = hcopy(dst.h, (size_t)rows * ldd);
  for (int i = 0; i < rows; i++)
    for (int j = 0; j < cols; j++)
      want[i * ldd + j] = src.h[i * lds + j]; /* columns past cols stay as they were */
  be2->copy_2d(be2, dst.h, ldd, src.h, lds, rows, cols, DT_BF16);
  assert_memory_equal(dst.h, want, (size_t)rows * ldd * sizeof *want);
  /* and fp32, which had no test of its own */
  float *wantf = fcopy(dst.f, (size_t)rows * ldd);
  for (int i = 0; i < rows; i++)
    for (int j = 0; j < cols; j++)
      wantf[i * ldd + j] = src.f[i * lds + j];
  be2->copy_2d(be2, dst.f, ldd, src.f, lds, rows, cols, DT_F32);
  assert_memory_equal(dst.f, wantf, (size_t)rows * ldd * sizeof *wantf);
  printf("  copy_2d bf16 and fp32 (5x7 block, lds 11, ldd 9): exact, other columns untouched\n");
  pair_free(&src);
  pair_free(&dst);
  free(want);
  free(wantf);
}

/* The three loss-parallel steps on one shard, bf16 against fp32 on the widened logits. */
static void test_bf16_ce_shard(void **state) {
  int n = 40, v = 500, ld = 512, vstart = 1000; /* threaded; ld > v pads */
  size_t nl = (size_t)n * ld;
  float *x = frand(nl, 140, 3.0);
  for (int i = 0; i < n; i++) {
    for (int j = v; j < ld; j++)
      x[(size_t)i * ld + j] = 1e30f;                   /* padding: ignored */
    if (i % 3 == 0) x[(size_t)i * ld + v - 1] = 20.0f; /* the row max in the last real column */
  }
  pair_t lg = pair_from(x, nl);
  int32_t tg[40];
  for (int i = 0; i < n; i++)
    tg[i] = i % 4 == 1 ? -1 : vstart - 50 + (i * 37) % 600; /* ignored, in the shard, outside it */
  float *mx_f = fnan(n), *mx_h = fnan(n), *st_f = fnan(2 * (size_t)n), *st_h = fnan(2 * (size_t)n);
  be2->ce_shard_max(be2, mx_f, lg.f, n, v, ld, DT_F32);
  be2->ce_shard_max(be2, mx_h, lg.h, n, v, ld, DT_BF16);
  check_f32_same("ce_shard_max rowmax (fp32)", mx_h, mx_f, n);
  int wrong = 0; /* a max is exact: check it directly too, over the v real columns only */
  for (int i = 0; i < n; i++) {
    float m = -INFINITY;
    for (int j = 0; j < v; j++)
      m = fmaxf(m, lg.f[(size_t)i * ld + j]);
    wrong += m != mx_h[i];
  }
  printf("  ce_shard_max rowmax against a direct max over the v columns: %d wrong\n", wrong);
  assert_int_equal(wrong, 0);
  be2->ce_shard_stats(be2, st_f, lg.f, mx_f, tg, n, v, ld, vstart, DT_F32);
  be2->ce_shard_stats(be2, st_h, lg.h, mx_h, tg, n, v, ld, vstart, DT_BF16);
  check_f32_same("ce_shard_stats stats (fp32)", st_h, st_f, 2 * (size_t)n);
  float *l_f = fnan(n), *l_h = fnan(n), *l_in = fnan(n), *d_f = fnan(nl), gs = 0.25f;
  bf16_t *d_h = hnan(nl);
  be2->ce_shard_loss(be2, l_f, d_f, lg.f, mx_f, st_f, tg, n, v, ld, vstart, gs, DT_F32);
  be2->ce_shard_loss(be2, l_h, d_h, lg.h, mx_h, st_h, tg, n, v, ld, vstart, gs, DT_BF16);
  check_f32_same("ce_shard_loss losses (fp32)", l_h, l_f, n);
  check_bf16("ce_shard_loss dlogits", d_h, d_f, nl);
  be2->ce_shard_loss(be2, l_in, NULL, lg.h, mx_h, st_h, tg, n, v, ld, vstart, gs, DT_BF16);
  check_f32_same("ce_shard_loss without dlogits: losses (fp32)", l_in, l_f, n);
  be2->ce_shard_loss(be2, l_in, lg.h, lg.h, mx_h, st_h, tg, n, v, ld, vstart, gs, DT_BF16); /* in place */
  assert_memory_equal(lg.h, d_h, nl * sizeof *d_h);
  printf("  ce_shard_loss bf16 in place: same bits as out of place\n");
  free(x);
  pair_free(&lg);
  free(mx_f);
  free(mx_h);
  free(st_f);
  free(st_h);
  free(l_f);
  free(l_h);
  free(l_in);
  free(d_f);
  free(d_h);
}

/* param_lp receives round(param) in the same pass and changes nothing else. */
static void test_bf16_adamw(void **state) {
  size_t n = 30001; /* threaded */
  float *p = frand(n, 150, 1.0), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
  float *p2 = fcopy(p, n), *m2 = calloc(n, sizeof *m2), *v2 = calloc(n, sizeof *v2);
  bf16_t *lp = hnan(n);
  for (int step = 1; step <= 3; step++) {
    float *g = frand(n, 160 + step, 1.0);
    be2->adamw(be2, p, g, m, v, NULL, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    be2->adamw(be2, p2, g, m2, v2, lp, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    free(g);
  }
  check_f32_same("adamw with param_lp: params (fp32) as without", p2, p, n);
  check_f32_same("adamw with param_lp: first moment as without", m2, m, n);
  check_f32_same("adamw with param_lp: second moment as without", v2, v, n);
  check_bf16("adamw param_lp = round(param)", lp, p, n);
  free(p);
  free(m);
  free(v);
  free(p2);
  free(m2);
  free(v2);
  free(lp);
}

/* adamw_multi against adamw called per segment: the same bits in params, moments and param_lp,
 * decayed and undecayed segments (a large weight decay, so a wrong flag shows), segments of
 * every size (threaded and not), and the gap between two segments left as it was. */
static void test_bf16_adamw_multi(void **state) {
  const adamw_segment_t segs[] = {
      {0, 30001, 1}, {30001, 7, 0}, {30011, 40000, 1}, {70011, 64, 0}, {70075, 1, 1},
  };
  const int ns = (int)(sizeof segs / sizeof segs[0]);
  const size_t n = 70076, gap = 30008; /* [30008, 30011) is in no segment */
  const float wd = 0.5f;
  float *p = frand(n, 170, 1.0), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
  float *p2 = fcopy(p, n), *m2 = calloc(n, sizeof *m2), *v2 = calloc(n, sizeof *v2), *p3 = fcopy(p, n);
  float *m3 = calloc(n, sizeof *m3), *v3 = calloc(n, sizeof *v3);
  bf16_t *lp = hnan(n), *lp2 = hnan(n);
  for (int step = 1; step <= 3; step++) {
    float *g = frand(n, 180 + step, 1.0);
    for (int i = 0; i < ns; i++) {
      const size_t o = segs[i].offset;
      be2->adamw(be2, p + o, g + o, m + o, v + o, lp + o, segs[i].numel, 1e-2f, 0.9f, 0.95f, 1e-8f,
                 segs[i].decay ? wd : 0.0f, step, 0.5f);
    }
    be2->adamw_multi(be2, p2, g, m2, v2, lp2, segs, ns, 1e-2f, 0.9f, 0.95f, 1e-8f, wd, step, 0.5f);
    be2->adamw_multi(be2, p3, g, m3, v3, NULL, segs, ns, 1e-2f, 0.9f, 0.95f, 1e-8f, wd, step, 0.5f);
    free(g);
  }
  check_f32_same("adamw_multi params as adamw per segment", p2, p, n);
  check_f32_same("adamw_multi first moment as adamw per segment", m2, m, n);
  check_f32_same("adamw_multi second moment as adamw per segment", v2, v, n);
  check_f32_same("adamw_multi without param_lp: params as with", p3, p2, n);
  size_t lp_bad = 0;
  for (size_t i = 0; i < n; i++) lp_bad += lp2[i] != lp[i];
  printf("  %-58s %zu of %zu differ (tol: same bits)\n", "adamw_multi param_lp as adamw per segment", lp_bad, n);
  assert_true(lp_bad == 0);
  check_bf16("adamw_multi param_lp = round(param) (segments)", lp2, p2, gap);
  float *p0 = frand(n, 170, 1.0);
  for (size_t i = gap; i < gap + 3; i++) {
    assert_memory_equal(&p2[i], &p0[i], sizeof(float)); /* untouched */
    assert_true(m2[i] == 0.0f && v2[i] == 0.0f && lp2[i] == 0x7fc0);
  }
  assert_false(p2[0] == p0[0]); /* and the segments did move */
  float *fs[] = {p0, p, m, v, p2, m2, v2, p3, m3, v3};
  for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++) free(fs[i]);
  free(lp);
  free(lp2);
}

/* ------------------------------------------------------------------ determinism, creation */

/* Runs the reducing kernels twice on the same inputs; the outputs must be the same bits. */
static void run_reducers(backend_t *be, float *outs) {
  int b = 2, t = 67, h = 4, kv = 2, d = 8, n = b * t, c = 48;
  size_t nq = (size_t)n * h * d, nk = (size_t)n * kv * d;
  float *q = frand(nq, 70, 1.0), *k = frand(nk, 71, 1.0), *v = frand(nk, 72, 1.0), *R = frand(nq, 73, 1.0);
  float *o = outs, *lse = o + nq, *dq = lse + (size_t)b * h * t, *dk = dq + nq, *dv = dk + nk, *dw = dv + nk,
        *dx = dw + c, *dt = dx + (size_t)n * c, *mm = dt + (size_t)10 * c;
  be->attention_fwd(be, o, lse, q, k, v, b, t, h, kv, d, DT_F32);
  be->attention_bwd(be, dq, dk, dv, R, q, k, v, o, lse, b, t, h, kv, d, DT_F32);
  float *x = frand((size_t)n * c, 74, 1.0), *w = frand(c, 75, 1.0), *dy = frand((size_t)n * c, 76, 1.0), rstd[134];
  float *y = malloc((size_t)n * c * sizeof *y);
  be->rmsnorm_fwd(be, y, rstd, x, w, n, c, 1e-5f, DT_F32);
  be->rmsnorm_bwd(be, dx, dw, dy, x, w, rstd, n, c, DT_F32);
  int32_t tok[134];
  for (int i = 0; i < n; i++)
    tok[i] = i % 10;
  be->embedding_bwd(be, dt, dy, tok, n, c, 0, 10, DT_F32);
  be->matmul(be, mm, dy, x, c, c, n, 1, 0, 1.0f, 0.0f, DT_F32, DT_F32);
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

/* Creation by name through the registry: an unknown name is refused naming it; a backend this
 * build lacks (a stand-in's entry, create NULL) names itself and the stand-in's reason; the cpu
 * backend is there. */
static void test_create(void **state) {
  char err[256] = "";
  assert_null(backend_create("tpu", 1, err, sizeof err));
  printf("  unknown backend: %s\n", err);
  assert_non_null(strstr(err, "unknown backend \"tpu\""));
  for (int i = 0; backend_registry[i]; i++) {
    const backend_entry_t *e = backend_registry[i];
    assert_ptr_equal(backend_find(e->name), e);
    if (e->create) continue;
    err[0] = 0;
    assert_null(backend_create(e->name, 1, err, sizeof err));
    printf("  %s, not built: %s\n", e->name, err);
    assert_non_null(strstr(err, e->name));
    assert_non_null(strstr(err, e->absent));
  }
  assert_non_null(backend_find("cpu"));
  assert_non_null(backend_find("cpu")->create);
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

/* ------------------------------------------------------------------ step_skip */

/* The reference of step_skip's z-score: mean and std from the sum and the sum of squares (not the
 * kernel's two passes), over the window's values in slot order. */
static double ref_z(const float *w, int n, double x, double *mean, double *std) {
  double s = 0, q = 0;
  for (int i = 0; i < n; i++) s += w[i], q += (double)w[i] * w[i];
  *mean = s / n;
  *std = sqrt(fmax(q / n - *mean * *mean, 0.0));
  return (x - *mean) / *std;
}

/* One call of step_skip on a loss and a norm; the verdict, and the update flag it left. */
static skip_verdict_t skip_one(skip_window_t *w, float loss, double norm, int nonfinite, double lz, double gz,
                               int *flag) {
  skip_verdict_t v;
  adamw_step_t st = adamw_step_make(1e-3f, 0.9f, 0.95f, 1);
  be1->step_skip(be1, &loss, &norm, nonfinite, lz, gz, w, &v, &st);
  *flag = st.skip;
  return v;
}

/* The window fills in slot order and wraps at SKIP_WINDOW; no z-score decides before SKIP_MIN
 * values; a z-score over the threshold skips (loss first, then norm), leaves the window as it was
 * and counts; a nan or an inf skips only with nonfinite set, and never enters the window; the
 * z-score, mean and std match the reference within 1e-9 (relative). */
static void test_step_skip(void **state) {
  skip_window_t w;
  memset(&w, 0, sizeof w);
  int flag = 0;
  float lv[SKIP_WINDOW + 40];
  double gv[SKIP_WINDOW + 40];
  for (int i = 0; i < SKIP_WINDOW + 40; i++) {
    lv[i] = 3.0f + 0.01f * (float)((i * 37) % 17);
    gv[i] = 1.0 + 0.02 * ((i * 11) % 13);
  }
  for (int i = 0; i < SKIP_MIN - 1; i++) assert_int_equal(skip_one(&w, lv[i], gv[i], 1, 3, 3, &flag).why, SKIP_NONE);
  skip_verdict_t v = skip_one(&w, 100.0f, 100.0, 0, 3, 3, &flag); /* 15 values: no decision yet */
  printf("  %-58s n %d, why %d (want 16, 0)\n", "a spike before SKIP_MIN values", w.n, v.why);
  assert_int_equal(v.why, SKIP_NONE);
  assert_int_equal(w.n, SKIP_MIN);
  w.n = w.next = SKIP_MIN - 1; /* take the spike back out */
  skip_one(&w, lv[SKIP_MIN - 1], gv[SKIP_MIN - 1], 1, 3, 3, &flag);
  for (int i = SKIP_MIN; i < SKIP_WINDOW + 40; i++) skip_one(&w, lv[i], gv[i], 1, 3, 3, &flag);
  printf("  %-58s n %d, next %d (want %d, 40)\n", "the window after 168 values", w.n, w.next, SKIP_WINDOW);
  assert_int_equal(w.n, SKIP_WINDOW);
  assert_int_equal(w.next, 40);
  assert_true(w.loss[39] == lv[SKIP_WINDOW + 39] && w.loss[40] == lv[40] && w.norm[0] == (float)gv[SKIP_WINDOW]);
  const skip_window_t before = w;
  double mean, sd;
  const double z = ref_z(w.loss, w.n, 3.5, &mean, &sd);
  v = skip_one(&w, 3.5f, gv[0], 0, z * 0.99, 0, &flag);
  const double dz = fabs(v.z - z) / z, dm = fabs(v.mean - mean) / mean, ds = fabs(v.std - sd) / sd;
  printf("  %-58s z %.6f (ref %.6f), mean %.6f std %.6f; rel diff %.1e %.1e %.1e (tol 1e-9)\n",
         "loss z-score over a full window", v.z, z, v.mean, v.std, dz, dm, ds);
  assert_int_equal(v.why, SKIP_LOSS_Z);
  assert_true(dz < 1e-9 && dm < 1e-9 && ds < 1e-9);
  assert_int_equal(flag, 1);
  assert_int_equal(v.total, 1);
  assert_memory_equal(w.loss, before.loss, sizeof w.loss); /* a skipped step's values stay out */
  assert_int_equal(w.n, before.n);
  assert_int_equal(w.next, before.next);
  v = skip_one(&w, 3.5f, gv[0], 0, z * 1.01, 0, &flag); /* just under the threshold: updates, enters */
  assert_int_equal(v.why, SKIP_NONE);
  assert_int_equal(flag, 0);
  assert_true(w.loss[40] == 3.5f && w.next == 41);
  const double gzr = ref_z(w.norm, w.n, 50.0, &mean, &sd);
  v = skip_one(&w, lv[0], 50.0, 0, 0, gzr * 0.99, &flag);
  printf("  %-58s why %d z %.3f (ref %.3f), total %d\n", "gradient norm z-score", v.why, v.z, gzr, v.total);
  assert_int_equal(v.why, SKIP_NORM_Z);
  assert_true(fabs(v.z - gzr) / gzr < 1e-9);
  assert_int_equal(v.total, 2);
  const skip_window_t before_nan = w;
  v = skip_one(&w, NAN, gv[0], 0, 3, 3, &flag); /* nonfinite off: no skip, the run stops at the read */
  assert_int_equal(v.why, SKIP_NONE);
  assert_int_equal(flag, 0);
  assert_int_equal(w.n, before_nan.n);
  assert_int_equal(w.next, before_nan.next);
  v = skip_one(&w, INFINITY, gv[0], 1, 0, 0, &flag);
  assert_int_equal(v.why, SKIP_LOSS_NONFINITE);
  assert_int_equal(flag, 1);
  v = skip_one(&w, lv[0], NAN, 1, 0, 0, &flag);
  printf("  %-58s why %d, total %d (want %d, 4)\n", "a nan norm with nonfinite", v.why, v.total, SKIP_NORM_NONFINITE);
  assert_int_equal(v.why, SKIP_NORM_NONFINITE);
  assert_int_equal(v.total, 4);
  assert_int_equal(w.next, before_nan.next);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matmul),         cmocka_unit_test(test_add_scale_sumsq),
      cmocka_unit_test(test_embedding),      cmocka_unit_test(test_rmsnorm),
      cmocka_unit_test(test_rope),           cmocka_unit_test(test_attention),
      cmocka_unit_test(test_swiglu),         cmocka_unit_test(test_cross_entropy),
      cmocka_unit_test(test_adamw),          cmocka_unit_test(test_determinism),
      cmocka_unit_test(test_create),         cmocka_unit_test(test_bf16_matmul),
      cmocka_unit_test(test_bf16_add),       cmocka_unit_test(test_bf16_convert),
      cmocka_unit_test(test_bf16_embedding), cmocka_unit_test(test_bf16_rmsnorm),
      cmocka_unit_test(test_bf16_rope),      cmocka_unit_test(test_bf16_attention),
      cmocka_unit_test(test_bf16_swiglu),    cmocka_unit_test(test_bf16_cross_entropy),
      cmocka_unit_test(test_bf16_copy_2d),   cmocka_unit_test(test_bf16_ce_shard),
      cmocka_unit_test(test_bf16_adamw),     cmocka_unit_test(test_bf16_adamw_multi),
      cmocka_unit_test(test_qkv_rope),       cmocka_unit_test(test_add_rmsnorm),
      cmocka_unit_test(test_step_skip),
  };
  return cmocka_run_group_tests_name("backend_cpu", tests, setup, teardown);
}
