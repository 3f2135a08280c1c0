/* backend_cpu: the host implementation of backend.h, fp32 arithmetic for fp32 and bf16 tensors.
 *
 * Every matrix product is an OpenBLAS cblas_sgemm (row-major); the rest are OpenMP loops with
 * num_threads(threads) and static schedules. Determinism comes from never letting two threads
 * add into the same value: reductions that cross rows (rmsnorm dw, embedding dtable) split the
 * columns among threads instead, attention's backward owns one (batch, kv head) per task and
 * loops over its query heads in order, and sumsq sums fixed chunks whose partials are added in
 * chunk order (so it is even independent of the thread count).
 *
 * Attention never keeps a (T, T) matrix between calls: the forward saves the log-sum-exp of
 * each row, the backward recomputes the probabilities block by block. Rows are processed in
 * blocks of ATT_BLOCK so that the causal mask also skips the upper-right blocks' flops.
 *
 * OpenBLAS is always called single-threaded, from inside OpenMP regions: matmuls split their
 * output into one block per thread, attention runs one (batch, head) task per iteration. With
 * two thread pools (OpenMP's and OpenBLAS's) each pool's idle workers spin while the other
 * computes, which cost ~20% at 2 threads on 2 cores.
 *
 * bf16 (dt = DT_BF16) reuses the fp32 kernels rather than having its own: a bf16 call widens
 * its bf16 inputs into fp32 scratch (exact), and, for the outputs it accumulates into (dx +=,
 * matmul's beta * c), their old values too; runs the fp32 kernel on the scratch; and rounds each
 * bf16 output once, to nearest even, on the way back. So there is one copy of every kernel's
 * arithmetic, fp32 calls compute exactly the bits they did before dtypes existed, and a bf16
 * result is by construction round(fp32 kernel on the widened inputs), which the unit test checks
 * bit for bit. The price is the widen and round passes (memory-bound, vectorized, threaded above
 * PAR_MIN) and fp32 scratch as large as the largest call's tensors, which is fine on a host
 * where memory is not the scarce resource. Row copies (embedding_fwd, copy_2d) and add need no
 * scratch: they move bytes, or widen, add and round in one loop. matmul's bf16 path is the one
 * function matmul_bf16, so that a native bf16 GEMM could replace it.
 *
 * Scratch (attention score blocks, sumsq partials, RoPE cos/sin table, the fp32 copies of bf16
 * tensors) is cached in the backend and grows only when a call needs more than any earlier
 * call; it is not thread-safe to call one backend from several threads at once. */
/* The clamps in vexpf vectorize only when GCC may if-convert float compares, which it refuses
 * under the default -ftrapping-math. Nothing here reads floating-point exception flags, and the
 * option changes no result (it allows no reassociation), so this file turns it off. */
#pragma GCC optimize("no-trapping-math")

#include "trainer/backend/backend.h"
#include "trainer/backend/step_skip_rule.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "trainer/backend/bf16.h"

#define ATT_BLOCK 64                  /* query rows per attention block */
#define SUMSQ_CHUNK ((size_t)1 << 15) /* elements per sumsq partial */
#define PAR_MIN 16384                 /* elementwise loops shorter than this stay serial */

typedef struct {
  int threads;
  /* attention: per thread, two (ATT_BLOCK, att_t) blocks (scores/probabilities, their grads) */
  float *att_scratch;
  size_t att_scratch_floats; /* per thread */
  /* sumsq partials */
  double *partials;
  size_t n_partials;
  /* RoPE table, (t, d/2) cos then (t, d/2) sin, for the key below */
  float *rope_cos, *rope_sin;
  size_t rope_cap;
  int rope_t, rope_d, rope_offset;
  float rope_theta;
  /* bf16 calls: the fp32 copies of their tensors, carved by wide_bufs */
  float *wide;
  size_t wide_floats;
} cpu_t;

static cpu_t *cpu_of(backend_t *be) { return be->impl; }

/* ------------------------------------------------------------------ vector math helpers */

/* exp in a form GCC vectorizes (no libm call, no branches): x = n ln2 + r with |r| <= ln2/2,
 * e^r by its Taylor series to r^7 (truncation error below 1e-8 relative on that interval),
 * 2^n through the exponent bits (measured: max relative error 1e-7 over [-87, 88], about
 * 1.7 ulp). ln2 is split in two (hi has 12 significant bits, so n * hi is exact) to keep r
 * accurate. Inputs are clamped to [-87, 88], so exp(-inf) gives ~1e-38 rather than 0
 * (callers that need exact zeros, the causal mask, write them). n is rounded with the
 * 1.5 * 2^23 trick: plain float adds, which need no -ffast-math to vectorize. */
static inline float vexpf(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  union {
    float f;
    int32_t i;
  } t = {.f = x * 1.44269504088896341f + 12582912.0f}, e;
  float n = t.f - 12582912.0f;
  float r = (x - n * 0.693115234375f) - n * 3.194618329871446e-05f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  e.i = (t.i - 0x4B400000 + 127) << 23;
  return p * e.f;
}

/* Row reductions in a fixed order: 8 lanes, each lane summing at most 256 terms in float
 * before they are added to a double total (vectorizable without reassociating flags). */
#define ROW_LANES 8
#define ROW_CHUNK 256

static float row_max(const float *x, int n) {
  float m[ROW_LANES];
  for (int u = 0; u < ROW_LANES; u++)
    m[u] = x[0];
  int j = 0;
  for (; j + ROW_LANES <= n; j += ROW_LANES)
    for (int u = 0; u < ROW_LANES; u++)
      m[u] = x[j + u] > m[u] ? x[j + u] : m[u];
  float r = m[0];
  for (int u = 1; u < ROW_LANES; u++)
    r = m[u] > r ? m[u] : r;
  for (; j < n; j++)
    r = x[j] > r ? x[j] : r;
  return r;
}

/* sum_j x[j] (mx = NAN) or sum_j exp(x[j] - mx) */
static double row_sum_impl(const float *x, int n, float mx, int do_exp) {
  double total = 0.0;
  int j = 0;
  while (j + ROW_LANES <= n) {
    float acc[ROW_LANES] = {0};
    int end = j + ROW_CHUNK < n ? j + ROW_CHUNK : n;
    for (; j + ROW_LANES <= end; j += ROW_LANES)
      for (int u = 0; u < ROW_LANES; u++)
        acc[u] += do_exp ? vexpf(x[j + u] - mx) : x[j + u];
    for (int u = 0; u < ROW_LANES; u++)
      total += acc[u];
  }
  for (; j < n; j++)
    total += do_exp ? vexpf(x[j] - mx) : x[j];
  return total;
}
static double row_sum(const float *x, int n) { return row_sum_impl(x, n, 0.0f, 0); }
static double row_sumexp(const float *x, int n, float mx) { return row_sum_impl(x, n, mx, 1); }

static void fill_nan(float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    x[i] = NAN;
}
static void fill_nan_bf16(void *x, size_t n) {
  bf16_t *h = x, nan = bf16_from_f32(NAN);
  for (size_t i = 0; i < n; i++)
    h[i] = nan;
}

/* ------------------------------------------------------------------ bf16: widen, compute, round */

/* Carves count fp32 buffers of n[i] floats out of the backend's cached scratch into out[i], each
 * starting on 64 bytes. The scratch grows only (to the largest call so far) and keeps nothing
 * between calls. Returns 0, or -1 after a message when it cannot grow: kernels have no error
 * path, so the caller then fills its outputs with NaN, which the loss carries to the trainer. */
static int wide_bufs(cpu_t *cp, int count, const size_t *n, float **out) {
  size_t total = 16; /* never empty, so that no pointer is carved from NULL */
  for (int i = 0; i < count; i++)
    total += (n[i] + 15) & ~(size_t)15;
  if (total > cp->wide_floats) {
    free(cp->wide);
    cp->wide_floats = 0;
    cp->wide = aligned_alloc(64, total * sizeof(float));
    if (!cp->wide) {
      fprintf(stderr, "backend cpu: out of memory for bf16 scratch (%zu floats); output set to NaN\n", total);
      return -1;
    }
    cp->wide_floats = total;
  }
  float *p = cp->wide;
  for (int i = 0; i < count; i++) {
    out[i] = p;
    p += (n[i] + 15) & ~(size_t)15;
  }
  return 0;
}

/* dst (fp32) = src (bf16), exact. Plain loops over bf16.h's inline conversions: GCC vectorizes
 * both directions with SSE4 integer ops (no bf16 instructions needed). */
static void widen(cpu_t *cp, float *dst, const void *src, size_t n) {
  const bf16_t *h = src;
  int nt = cp->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (n > PAR_MIN)
  for (size_t i = 0; i < n; i++)
    dst[i] = bf16_to_f32(h[i]);
}

/* dst (bf16) = src (fp32) rounded to nearest even: the one rounding of a bf16 store. */
static void narrow(cpu_t *cp, void *dst, const float *src, size_t n) {
  bf16_t *h = dst;
  int nt = cp->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (n > PAR_MIN)
  for (size_t i = 0; i < n; i++)
    h[i] = bf16_from_f32(src[i]);
}

/* ------------------------------------------------------------------ memory */

static void *cpu_alloc(backend_t *be, size_t bytes) {
  size_t n = (bytes + 63) & ~(size_t)63;
  if (n == 0) n = 64;
  void *p = aligned_alloc(64, n);
  if (p) memset(p, 0, n);
  return p;
}
static void cpu_free(backend_t *be, void *p) { free(p); }
static void cpu_copy(backend_t *be, void *dst, const void *src, size_t bytes) {
  if (bytes && dst != src) memmove(dst, src, bytes);
}
static void cpu_zero(backend_t *be, void *p, size_t bytes) {
  if (bytes) memset(p, 0, bytes);
}
static void cpu_sync(backend_t *be) {}

/* ------------------------------------------------------------------ dense algebra */

/* One sgemm on a block of c: rows [m0, m1) and columns [n0, n1) of the full product. The
 * operands keep their leading dimensions; only the start pointers move. */
static void sgemm_block(float *c, const float *a, const float *b, int m, int n, int k, int trans_a, int trans_b,
                        float alpha, float beta, int m0, int m1, int n0, int n1) {
  if (m1 <= m0 || n1 <= n0) return;
  const float *ab = trans_a ? a + m0 : a + (size_t)m0 * k; /* a (k,m) or (m,k) */
  const float *bb = trans_b ? b + (size_t)n0 * k : b + n0; /* b (n,k) or (k,n) */
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m1 - m0, n1 - n0,
              k, alpha, ab, trans_a ? m : k, bb, trans_b ? k : n, beta, c + (size_t)m0 * n + n0, n);
}

/* The threads split c into row blocks (or column blocks when c is wide), each one
 * single-threaded sgemm: OpenBLAS's own thread pool stays asleep, so OpenMP and OpenBLAS workers
 * never spin against each other on the same cores. Each element of c is computed by one thread
 * with the full k loop, so the result does not depend on the split. */
static void matmul_f32(backend_t *be, float *c, const float *a, const float *b, int m, int n, int k, int trans_a,
                       int trans_b, float alpha, float beta) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) { /* c = beta * c; sgemm implementations differ on k = 0 */
    for (size_t i = 0; i < (size_t)m * n; i++)
      c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  int nt = cpu_of(be)->threads;
  double flops = 2.0 * m * n * k;
  if (nt <= 1 || flops < 1e6) {
    sgemm_block(c, a, b, m, n, k, trans_a, trans_b, alpha, beta, 0, m, 0, n);
    return;
  }
  int split_rows = m >= n;
  int len = split_rows ? m : n;
#pragma omp parallel num_threads(nt)
  {
    int tn = omp_get_num_threads(), ti = omp_get_thread_num();
    /* blocks in multiples of 16 (the sgemm kernels' register tile) */
    int units = (len + 15) / 16;
    int u0 = (int)((long)units * ti / tn), u1 = (int)((long)units * (ti + 1) / tn);
    int i0 = u0 * 16, i1 = u1 * 16 < len ? u1 * 16 : len;
    if (split_rows)
      sgemm_block(c, a, b, m, n, k, trans_a, trans_b, alpha, beta, i0, i1, 0, n);
    else
      sgemm_block(c, a, b, m, n, k, trans_a, trans_b, alpha, beta, 0, m, i0, i1);
  }
}

/* Every product with a bf16 tensor: bf16 operands are widened (exact, and so are their products
 * in fp32: 8-bit significands), matmul_f32 computes the fp32 product, into c itself when c is
 * fp32 (dW += dy^T x accumulates there directly), else into scratch holding the widened old c
 * (when beta != 0), which is then rounded once into c. (fp32 operands with a bf16 c, outside
 * backend.h's combinations, work the same way.) The whole bf16 GEMM is this function, so that a
 * native one can replace it. */
static void matmul_bf16(backend_t *be, void *c, const void *a, const void *b, int m, int n, int k, int trans_a,
                        int trans_b, float alpha, float beta, dtype_t ab_dt, dtype_t c_dt) {
  cpu_t *cp = cpu_of(be);
  size_t na = (size_t)m * k, nb = (size_t)k * n, nc = (size_t)m * n;
  int wide_ab = ab_dt == DT_BF16, wide_c = c_dt == DT_BF16;
  float *s[3];
  if (wide_bufs(cp, 3, (size_t[]){wide_ab ? na : 0, wide_ab ? nb : 0, wide_c ? nc : 0}, s) != 0) {
    if (wide_c)
      fill_nan_bf16(c, nc);
    else
      fill_nan(c, nc);
    return;
  }
  const float *fa = a, *fb = b;
  float *fc = wide_c ? s[2] : c;
  if (wide_ab) {
    widen(cp, s[0], a, na);
    widen(cp, s[1], b, nb);
    fa = s[0];
    fb = s[1];
  }
  if (wide_c && beta != 0.0f) widen(cp, fc, c, nc);
  matmul_f32(be, fc, fa, fb, m, n, k, trans_a, trans_b, alpha, beta);
  if (wide_c) narrow(cp, c, fc, nc);
}

static void cpu_matmul(backend_t *be, void *c, const void *a, const void *b, int m, int n, int k, int trans_a,
                       int trans_b, float alpha, float beta, dtype_t ab_dt, dtype_t c_dt) {
  if (m <= 0 || n <= 0) return;
  if (ab_dt == DT_F32 && c_dt == DT_F32)
    matmul_f32(be, c, a, b, m, n, k, trans_a, trans_b, alpha, beta);
  else
    matmul_bf16(be, c, a, b, m, n, k, trans_a, trans_b, alpha, beta, ab_dt, c_dt);
}

/* ------------------------------------------------------------------ elementwise */

/* bf16: widen, add, round in one loop (no scratch); out may alias a or b either way. */
static void cpu_add(backend_t *be, void *out, const void *a, const void *b, size_t n, dtype_t dt) {
  int nt = cpu_of(be)->threads;
  if (dt == DT_F32) {
    float *o = out;
    const float *x = a, *y = b;
#pragma omp parallel for num_threads(nt) schedule(static) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++)
      o[i] = x[i] + y[i];
    return;
  }
  bf16_t *o = out;
  const bf16_t *x = a, *y = b;
#pragma omp parallel for num_threads(nt) schedule(static) if (n > PAR_MIN)
  for (size_t i = 0; i < n; i++)
    o[i] = bf16_from_f32(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

static void cpu_scale(backend_t *be, float *x, float s, size_t n) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (n > PAR_MIN)
  for (size_t i = 0; i < n; i++)
    x[i] *= s;
}

static double cpu_sumsq(backend_t *be, const float *x, size_t n) {
  cpu_t *cp = cpu_of(be);
  size_t nc = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
  if (nc > cp->n_partials) {
    double *p = realloc(cp->partials, nc * sizeof *p);
    if (!p) { /* no scratch: the serial sum is the same chunked order */
      double total = 0.0;
      for (size_t c = 0; c < nc; c++) {
        double s = 0.0;
        for (size_t i = c * SUMSQ_CHUNK; i < n && i < (c + 1) * SUMSQ_CHUNK; i++)
          s += (double)x[i] * x[i];
        total += s;
      }
      return total;
    }
    cp->partials = p;
    cp->n_partials = nc;
  }
  double *part = cp->partials;
  int nt = cp->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (nc > 1)
  for (size_t c = 0; c < nc; c++) {
    size_t i0 = c * SUMSQ_CHUNK, i1 = i0 + SUMSQ_CHUNK < n ? i0 + SUMSQ_CHUNK : n;
    double s = 0.0;
    for (size_t i = i0; i < i1; i++)
      s += (double)x[i] * x[i];
    part[c] = s;
  }
  double total = 0.0;
  for (size_t c = 0; c < nc; c++)
    total += part[c];
  return total;
}

static void cpu_sumsq_parts(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                            double *out) {
  for (int i = 0; i < n; i++) out[i] = cpu_sumsq(be, x + offset[i], count[i]);
}

/* Same dtypes: a byte copy, in chunks of PAR_MIN floats' bytes split among the threads. */
static void cpu_convert(backend_t *be, void *dst, dtype_t dst_dt, const void *src, dtype_t src_dt, size_t n) {
  cpu_t *cp = cpu_of(be);
  if (dst_dt == src_dt) {
    size_t bytes = n * dtype_size(dst_dt), chunk = PAR_MIN * sizeof(float), nch = (bytes + chunk - 1) / chunk;
    int nt = cp->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (nch > 1)
    for (size_t c = 0; c < nch; c++) {
      size_t off = c * chunk, len = bytes - off < chunk ? bytes - off : chunk;
      memcpy((char *)dst + off, (const char *)src + off, len);
    }
  } else if (dst_dt == DT_F32) {
    widen(cp, dst, src, n);
  } else {
    narrow(cp, dst, src, n);
  }
}

/* ------------------------------------------------------------------ embedding */

/* Rows are copied as bytes, whatever their dtype (a bf16 row needs no arithmetic). */
static void cpu_embedding_fwd(backend_t *be, void *out, const void *table, const int32_t *tokens, int n, int c,
                              int vocab_start, int rows, dtype_t dt) {
  int nt = cpu_of(be)->threads;
  size_t row = (size_t)c * dtype_size(dt); /* bytes */
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * c > PAR_MIN)
  for (int i = 0; i < n; i++) {
    int r = tokens[i] - vocab_start;
    char *o = (char *)out + (size_t)i * row;
    if (r >= 0 && r < rows)
      memcpy(o, (const char *)table + (size_t)r * row, row);
    else
      memset(o, 0, row);
  }
}

/* Threads split the columns; each walks all rows in order, so a token that appears twice is
 * accumulated in position order whatever the thread count. */
static void embedding_bwd_f32(backend_t *be, float *dtable, const float *dout, const int32_t *tokens, int n, int c,
                              int vocab_start, int rows) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel num_threads(nt) if ((size_t)n * c > PAR_MIN)
  {
    int tn = omp_get_num_threads(), ti = omp_get_thread_num();
    int c0 = (int)((long)c * ti / tn), c1 = (int)((long)c * (ti + 1) / tn);
    for (int i = 0; i < n; i++) {
      int r = tokens[i] - vocab_start;
      if (r < 0 || r >= rows) continue;
      float *dt = dtable + (size_t)r * c;
      const float *d = dout + (size_t)i * c;
      for (int j = c0; j < c1; j++)
        dt[j] += d[j];
    }
  }
}

/* dtable is fp32 whatever dt is; only dout is widened. */
static void cpu_embedding_bwd(backend_t *be, float *dtable, const void *dout, const int32_t *tokens, int n, int c,
                              int vocab_start, int rows, dtype_t dt) {
  if (dt == DT_F32) {
    embedding_bwd_f32(be, dtable, dout, tokens, n, c, vocab_start, rows);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nc = (size_t)n * c;
  float *s[1];
  if (wide_bufs(cp, 1, &nc, s) != 0) {
    fill_nan(dtable, (size_t)rows * c);
    return;
  }
  widen(cp, s[0], dout, nc);
  embedding_bwd_f32(be, dtable, s[0], tokens, n, c, vocab_start, rows);
}

/* ------------------------------------------------------------------ RMSNorm */

static void rmsnorm_fwd_f32(backend_t *be, float *out, float *rstd, const float *x, const float *w, int n, int c,
                            float eps) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * c > PAR_MIN)
  for (int i = 0; i < n; i++) {
    const float *xi = x + (size_t)i * c;
    float *oi = out + (size_t)i * c;
    float ss = 0.0f;
    for (int j = 0; j < c; j++)
      ss += xi[j] * xi[j];
    float r = 1.0f / sqrtf(ss / (float)c + eps);
    rstd[i] = r;
    for (int j = 0; j < c; j++)
      oi[j] = xi[j] * r * w[j];
  }
}

/* y_j = x_j r w_j, r = (mean(x^2) + eps)^(-1/2):
 *   dx_j += r w_j dy_j - x_j r^3 / C * sum_k dy_k w_k x_k,   dw_j += sum_rows dy_j x_j r.
 * dx is split by rows, dw by columns (no two threads add into one value). */
static void rmsnorm_bwd_f32(backend_t *be, float *dx, float *dw, const float *dout, const float *x, const float *w,
                            const float *rstd, int n, int c) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel num_threads(nt) if ((size_t)n * c > PAR_MIN)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
      const float *xi = x + (size_t)i * c, *di = dout + (size_t)i * c;
      float *dxi = dx + (size_t)i * c;
      float r = rstd[i], dot = 0.0f;
      for (int j = 0; j < c; j++)
        dot += di[j] * w[j] * xi[j];
      float k = dot * r * r * r / (float)c;
      for (int j = 0; j < c; j++)
        dxi[j] += r * w[j] * di[j] - xi[j] * k;
    }
    int tn = omp_get_num_threads(), ti = omp_get_thread_num();
    int c0 = (int)((long)c * ti / tn), c1 = (int)((long)c * (ti + 1) / tn);
    for (int i = 0; i < n; i++) {
      const float *xi = x + (size_t)i * c, *di = dout + (size_t)i * c;
      float r = rstd[i];
      for (int j = c0; j < c1; j++)
        dw[j] += di[j] * xi[j] * r;
    }
  }
}

static void cpu_rmsnorm_fwd(backend_t *be, void *out, float *rstd, const void *x, const void *w, int n, int c,
                            float eps, dtype_t dt) {
  if (dt == DT_F32) {
    rmsnorm_fwd_f32(be, out, rstd, x, w, n, c, eps);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nc = (size_t)n * c;
  float *s[3]; /* x, w, out */
  if (wide_bufs(cp, 3, (size_t[]){nc, (size_t)c, nc}, s) != 0) {
    fill_nan_bf16(out, nc);
    fill_nan(rstd, (size_t)n);
    return;
  }
  widen(cp, s[0], x, nc);
  widen(cp, s[1], w, (size_t)c);
  rmsnorm_fwd_f32(be, s[2], rstd, s[0], s[1], n, c, eps);
  narrow(cp, out, s[2], nc);
}

/* dx (bf16) accumulates: its old value is widened, the fp32 kernel adds, the sum is rounded. */
static void cpu_rmsnorm_bwd(backend_t *be, void *dx, float *dw, const void *dout, const void *x, const void *w,
                            const float *rstd, int n, int c, dtype_t dt) {
  if (dt == DT_F32) {
    rmsnorm_bwd_f32(be, dx, dw, dout, x, w, rstd, n, c);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nc = (size_t)n * c;
  float *s[4]; /* dx, dout, x, w */
  if (wide_bufs(cp, 4, (size_t[]){nc, nc, nc, (size_t)c}, s) != 0) {
    fill_nan_bf16(dx, nc);
    return;
  }
  widen(cp, s[0], dx, nc);
  widen(cp, s[1], dout, nc);
  widen(cp, s[2], x, nc);
  widen(cp, s[3], w, (size_t)c);
  rmsnorm_bwd_f32(be, s[0], dw, s[1], s[2], s[3], rstd, n, c);
  narrow(cp, dx, s[0], nc);
}

/* The add and the norm as the two entries compute them, one after the other: the same bits by
 * construction (one pass over memory matters on a device, not here). */
static void cpu_add_rmsnorm_fwd(backend_t *be, void *sum, void *out, float *rstd, const void *a, const void *b,
                                const void *w, int n, int c, float eps, dtype_t dt) {
  cpu_add(be, sum, a, b, (size_t)n * c, dt);
  cpu_rmsnorm_fwd(be, out, rstd, sum, w, n, c, eps, dt);
}

/* ------------------------------------------------------------------ RoPE */

/* Returns 0 or -1 when the table cannot be allocated. Angles are computed in double and
 * rounded once, so the table is as exact as fp32 allows. */
static int rope_table(cpu_t *cp, int t, int d, int pos_offset, float theta) {
  if (cp->rope_cos && cp->rope_t == t && cp->rope_d == d && cp->rope_offset == pos_offset && cp->rope_theta == theta)
    return 0;
  size_t need = (size_t)t * (size_t)(d / 2);
  if (need > cp->rope_cap) {
    float *c = realloc(cp->rope_cos, need * sizeof *c);
    if (!c) return -1;
    cp->rope_cos = c;
    float *s = realloc(cp->rope_sin, need * sizeof *s);
    if (!s) return -1;
    cp->rope_sin = s;
    cp->rope_cap = need;
  }
  int half = d / 2;
  for (int p = 0; p < t; p++)
    for (int i = 0; i < half; i++) {
      double freq = pow((double)theta, -2.0 * i / (double)d);
      double ang = (double)(pos_offset + p) * freq;
      cp->rope_cos[(size_t)p * half + i] = (float)cos(ang);
      cp->rope_sin[(size_t)p * half + i] = (float)sin(ang);
    }
  cp->rope_t = t;
  cp->rope_d = d;
  cp->rope_offset = pos_offset;
  cp->rope_theta = theta;
  return 0;
}

/* sign = +1 rotates by +angle (forward), -1 by -angle (backward). */
static void rope_apply(backend_t *be, float *x, int b, int t, int h, int d, int pos_offset, float theta, float sign) {
  cpu_t *cp = cpu_of(be);
  if (rope_table(cp, t, d, pos_offset, theta) != 0) {
    fprintf(stderr, "backend cpu: out of memory for the RoPE table (t=%d d=%d); output set to NaN\n", t, d);
    fill_nan(x, (size_t)b * t * h * d);
    return;
  }
  const float *cs = cp->rope_cos, *sn = cp->rope_sin;
  int half = d / 2, nt = cp->threads;
  long rows = (long)b * t;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)rows * h * d > PAR_MIN)
  for (long r = 0; r < rows; r++) {
    int p = (int)(r % t);
    const float *cr = cs + (size_t)p * half, *sr = sn + (size_t)p * half;
    float *xr = x + (size_t)r * h * d;
    for (int hh = 0; hh < h; hh++) {
      float *xh = xr + (size_t)hh * d;
      for (int i = 0; i < half; i++) {
        float c = cr[i], s = sign * sr[i];
        float x0 = xh[2 * i], x1 = xh[2 * i + 1];
        xh[2 * i] = x0 * c - x1 * s;
        xh[2 * i + 1] = x0 * s + x1 * c;
      }
    }
  }
}

/* bf16: x is widened, rotated in fp32 and rounded back in place. */
static void rope_dt(backend_t *be, void *x, int b, int t, int h, int d, int pos_offset, float theta, float sign,
                    dtype_t dt) {
  if (dt == DT_F32) {
    rope_apply(be, x, b, t, h, d, pos_offset, theta, sign);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nx = (size_t)b * t * h * d;
  float *s[1];
  if (wide_bufs(cp, 1, &nx, s) != 0) {
    fill_nan_bf16(x, nx);
    return;
  }
  widen(cp, s[0], x, nx);
  rope_apply(be, s[0], b, t, h, d, pos_offset, theta, sign);
  narrow(cp, x, s[0], nx);
}

static void cpu_rope_fwd(backend_t *be, void *x, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt) {
  rope_dt(be, x, b, t, h, d, pos_offset, theta, 1.0f, dt);
}
static void cpu_rope_bwd(backend_t *be, void *dx, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt) {
  rope_dt(be, dx, b, t, h, d, pos_offset, theta, -1.0f, dt);
}

/* ------------------------------------------------------------------ Q, K, V of one product */

/* Element i of a dt buffer widened to fp32, and a value stored rounded to dt. */
static inline float load_dt(const void *p, size_t i, dtype_t dt) {
  return dt == DT_F32 ? ((const float *)p)[i] : bf16_to_f32(((const bf16_t *)p)[i]);
}
static inline void store_dt(void *p, size_t i, float v, dtype_t dt) {
  if (dt == DT_F32) ((float *)p)[i] = v;
  else ((bf16_t *)p)[i] = bf16_from_f32(v);
}

/* nh heads of one row from src (from element so) to dst (from do_), each pair rotated by the
 * row's angles (cr, sr) times sign as rope_apply rotates it, or copied when cr is NULL (v). */
static void qkv_heads(void *dst, size_t do_, const void *src, size_t so, int nh, int d, const float *cr,
                      const float *sr, float sign, dtype_t dt) {
  for (int hh = 0; hh < nh; hh++)
    for (int i = 0; i < d / 2; i++) {
      size_t s0 = so + (size_t)hh * d + 2 * i, d0 = do_ + (size_t)hh * d + 2 * i;
      float x0 = load_dt(src, s0, dt), x1 = load_dt(src, s0 + 1, dt);
      if (cr) {
        float c = cr[i], s = sign * sr[i];
        store_dt(dst, d0, x0 * c - x1 * s, dt);
        store_dt(dst, d0 + 1, x0 * s + x1 * c, dt);
      } else {
        store_dt(dst, d0, x0, dt);
        store_dt(dst, d0 + 1, x1, dt);
      }
    }
}

/* Rows of qkv <-> q, k, v (to_packed: toward qkv), q and k rotated by sign * angle. Widening a
 * bf16 element, rotating in fp32 and rounding once is what rope_dt does over a whole tensor. */
static void qkv_rope(backend_t *be, void *qkv, void *q, void *k, void *v, int b, int t, int h, int kv, int d,
                     int pos_offset, float theta, float sign, int to_packed, dtype_t dt) {
  cpu_t *cp = cpu_of(be);
  const size_t rows = (size_t)b * t, HD = (size_t)h * d, KD = (size_t)kv * d, W = HD + 2 * KD;
  if (rope_table(cp, t, d, pos_offset, theta) != 0) {
    fprintf(stderr, "backend cpu: out of memory for the RoPE table (t=%d d=%d); output set to NaN\n", t, d);
    void *outs[3] = {q, k, v};
    size_t ns[3] = {rows * HD, rows * KD, rows * KD};
    for (int i = 0; i < (to_packed ? 1 : 3); i++) {
      void *o = to_packed ? qkv : outs[i];
      size_t no = to_packed ? rows * W : ns[i];
      if (dt == DT_F32) fill_nan(o, no);
      else fill_nan_bf16(o, no);
    }
    return;
  }
  const int half = d / 2, nt = cp->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * W > PAR_MIN)
  for (size_t r = 0; r < rows; r++) {
    const float *cr = cp->rope_cos + (r % (size_t)t) * half, *sr = cp->rope_sin + (r % (size_t)t) * half;
    void *part[3] = {q, k, v};
    const size_t width[3] = {HD, KD, KD}, col[3] = {0, HD, HD + KD};
    const int heads[3] = {h, kv, kv};
    for (int i = 0; i < 3; i++) {
      const float *c = i < 2 ? cr : NULL;
      if (to_packed)
        qkv_heads(qkv, r * W + col[i], part[i], r * width[i], heads[i], d, c, sr, sign, dt);
      else
        qkv_heads(part[i], r * width[i], qkv, r * W + col[i], heads[i], d, c, sr, sign, dt);
    }
  }
}

static void cpu_qkv_rope_fwd(backend_t *be, void *q, void *k, void *v, const void *qkv, int b, int t, int h, int kv,
                             int d, int pos_offset, float theta, dtype_t dt) {
  qkv_rope(be, (void *)qkv, q, k, v, b, t, h, kv, d, pos_offset, theta, 1.0f, 0, dt);
}
static void cpu_qkv_rope_bwd(backend_t *be, void *dqkv, const void *dq, const void *dk, const void *dv, int b, int t,
                             int h, int kv, int d, int pos_offset, float theta, dtype_t dt) {
  qkv_rope(be, dqkv, (void *)dq, (void *)dk, (void *)dv, b, t, h, kv, d, pos_offset, theta, -1.0f, 1, dt);
}

/* ------------------------------------------------------------------ attention */

/* Makes sure every thread has two (ATT_BLOCK, t) blocks. NULL when they cannot be allocated:
 * the kernels have no error path, so they then fill their outputs with NaN, which the loss
 * carries to the caller (model_forward returns it, the trainer stops with a message). */
static float *att_scratch(cpu_t *cp, int t) {
  size_t per = 2 * (size_t)ATT_BLOCK * (size_t)t;
  if (per > cp->att_scratch_floats) {
    free(cp->att_scratch);
    cp->att_scratch_floats = 0;
    cp->att_scratch = aligned_alloc(64, ((per * cp->threads * sizeof(float)) + 63) & ~(size_t)63);
    if (!cp->att_scratch) {
      fprintf(stderr, "backend cpu: out of memory for attention scratch (t=%d); output set to NaN\n", t);
      return NULL;
    }
    cp->att_scratch_floats = per;
  }
  return cp->att_scratch;
}

/* Scores of query rows [r0, r1) of a block against its keys [0, nc), probabilities written in
 * place, masked entries 0. Row i sees the keys j <= i + off (off: the query block's first
 * position minus the key block's), none when that is below 0: then its probabilities are all 0
 * and its lse -inf. With lse_in the row log-sum-exps are given (backward), else computed into
 * lse_out. */
static void att_probs(float *s, int r0, int r1, int nc, long off, const float *lse_in, float *lse_out) {
  for (int i = r0; i < r1; i++) {
    float *si = s + (size_t)(i - r0) * nc;
    long seen = i + off + 1;
    int valid = seen < 0 ? 0 : seen > nc ? nc : (int)seen;
    if (lse_in) {
      float l = lse_in[i];
      for (int j = 0; j < valid; j++)
        si[j] = vexpf(si[j] - l);
    } else if (valid == 0) {
      lse_out[i] = -INFINITY;
    } else {
      float mx = row_max(si, valid);
      for (int j = 0; j < valid; j++)
        si[j] = vexpf(si[j] - mx);
      double sum = row_sum(si, valid);
      lse_out[i] = mx + (float)log(sum);
      float inv = (float)(1.0 / sum);
      for (int j = 0; j < valid; j++)
        si[j] *= inv;
    }
    for (int j = valid; j < nc; j++)
      si[j] = 0.0f;
  }
}

/* The keys a block of query rows [r0, r1) sees: [0, nc). */
static int att_keys(int r1, int tk, long off) {
  long nc = r1 + off;
  return nc < 0 ? 0 : nc > tk ? tk : (int)nc;
}

/* One block: tq query rows at positions q_pos.. against tk keys at k_pos.. (attention_fwd_block's
 * contract; the whole causal attention when tq = tk and q_pos = k_pos). */
static void attention_fwd_block_f32(backend_t *be, float *out, float *lse, const float *q, const float *k,
                                    const float *v, int b, int tq, int tk, int h, int kv, int d, long q_pos,
                                    long k_pos) {
  cpu_t *cp = cpu_of(be);
  float *scratch = att_scratch(cp, tk);
  if (!scratch) {
    fill_nan(out, (size_t)b * tq * h * d);
    return;
  }
  size_t per = cp->att_scratch_floats;
  int group = h / kv, nt = cp->threads;
  int qs = h * d, ks = kv * d; /* row strides of q/out and k/v */
  float scale = 1.0f / sqrtf((float)d);
  long off = q_pos - k_pos;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int bh = 0; bh < b * h; bh++) {
    int bi = bh / h, hi = bh % h, ki = hi / group;
    float *s = scratch + per * omp_get_thread_num();
    const float *qh = q + (size_t)bi * tq * qs + (size_t)hi * d; /* (tq, D) stride qs */
    const float *kh = k + (size_t)bi * tk * ks + (size_t)ki * d; /* (tk, D) stride ks */
    const float *vh = v + (size_t)bi * tk * ks + (size_t)ki * d; /* (tk, D) stride ks */
    float *oh = out + (size_t)bi * tq * qs + (size_t)hi * d;     /* (tq, D) stride qs */
    float *lh = lse + ((size_t)bi * h + hi) * tq;                /* (tq) */
    for (int r0 = 0; r0 < tq; r0 += ATT_BLOCK) {
      int r1 = r0 + ATT_BLOCK < tq ? r0 + ATT_BLOCK : tq, mb = r1 - r0, nc = att_keys(r1, tk, off);
      if (nc == 0) { /* rows before every key: nothing seen */
        for (int i = r0; i < r1; i++) {
          memset(oh + (size_t)i * qs, 0, (size_t)d * sizeof(float));
          lh[i] = -INFINITY;
        }
        continue;
      }
      /* s (mb, nc) = scale * q[r0:r1] k[0:nc]^T */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mb, nc, d, scale, qh + (size_t)r0 * qs, qs, kh, ks, 0.0f, s,
                  nc);
      att_probs(s, r0, r1, nc, off, NULL, lh);
      /* out[r0:r1] (mb, D) = p v[0:nc] */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mb, d, nc, 1.0f, s, nc, vh, ks, 0.0f, oh + (size_t)r0 * qs,
                  qs);
    }
  }
}

static void attention_fwd_f32(backend_t *be, float *out, float *lse, const float *q, const float *k, const float *v,
                              int b, int t, int h, int kv, int d) {
  attention_fwd_block_f32(be, out, lse, q, k, v, b, t, t, h, kv, d, 0, 0);
}

/* Per (batch, kv head) task, over its query heads in order (deterministic dk/dv sums):
 *   p = exp(s - lse), dv += p^T do, dp = do v^T, ds = p * (dp - rowsum(do * o)),
 *   dq += scale ds k, dk += scale ds^T q. */
static void attention_bwd_block_f32(backend_t *be, float *dq, float *dk, float *dv, const float *dout,
                                    const float *q, const float *k, const float *v, const float *out,
                                    const float *lse, int b, int tq, int tk, int h, int kv, int d, long q_pos,
                                    long k_pos) {
  cpu_t *cp = cpu_of(be);
  float *scratch = att_scratch(cp, tk);
  if (!scratch) {
    fill_nan(dq, (size_t)b * tq * h * d);
    return;
  }
  size_t per = cp->att_scratch_floats;
  int group = h / kv, nt = cp->threads;
  int qs = h * d, ks = kv * d;
  float scale = 1.0f / sqrtf((float)d);
  long off = q_pos - k_pos;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int bk = 0; bk < b * kv; bk++) {
    int bi = bk / kv, ki = bk % kv;
    float *p = scratch + per * omp_get_thread_num(), *dp = p + (size_t)ATT_BLOCK * tk;
    const float *kh = k + (size_t)bi * tk * ks + (size_t)ki * d;
    const float *vh = v + (size_t)bi * tk * ks + (size_t)ki * d;
    float *dkh = dk + (size_t)bi * tk * ks + (size_t)ki * d;
    float *dvh = dv + (size_t)bi * tk * ks + (size_t)ki * d;
    for (int hi = ki * group; hi < (ki + 1) * group; hi++) {
      const float *qh = q + (size_t)bi * tq * qs + (size_t)hi * d;
      const float *oh = out + (size_t)bi * tq * qs + (size_t)hi * d;
      const float *doh = dout + (size_t)bi * tq * qs + (size_t)hi * d;
      float *dqh = dq + (size_t)bi * tq * qs + (size_t)hi * d;
      const float *lh = lse + ((size_t)bi * h + hi) * tq;
      for (int r0 = 0; r0 < tq; r0 += ATT_BLOCK) {
        int r1 = r0 + ATT_BLOCK < tq ? r0 + ATT_BLOCK : tq, mb = r1 - r0, nc = att_keys(r1, tk, off);
        if (nc == 0) continue; /* rows before every key of the block: no share of its gradients */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mb, nc, d, scale, qh + (size_t)r0 * qs, qs, kh, ks, 0.0f,
                    p, nc);
        att_probs(p, r0, r1, nc, off, lh, NULL);
        /* dv[0:nc] (nc, D) += p^T (nc, mb) do[r0:r1] (mb, D) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nc, d, mb, 1.0f, p, nc, doh + (size_t)r0 * qs, qs, 1.0f,
                    dvh, ks);
        /* dp (mb, nc) = do[r0:r1] v[0:nc]^T */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mb, nc, d, 1.0f, doh + (size_t)r0 * qs, qs, vh, ks, 0.0f,
                    dp, nc);
        for (int i = r0; i < r1; i++) {
          const float *oi = oh + (size_t)i * qs, *di = doh + (size_t)i * qs;
          float delta = 0.0f;
          for (int j = 0; j < d; j++)
            delta += oi[j] * di[j];
          float *pi = p + (size_t)(i - r0) * nc, *dpi = dp + (size_t)(i - r0) * nc;
          for (int j = 0; j < nc; j++)
            dpi[j] = pi[j] * (dpi[j] - delta);
        }
        /* dq[r0:r1] (mb, D) += scale ds (mb, nc) k[0:nc] (nc, D) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mb, d, nc, scale, dp, nc, kh, ks, 1.0f,
                    dqh + (size_t)r0 * qs, qs);
        /* dk[0:nc] (nc, D) += scale ds^T (nc, mb) q[r0:r1] (mb, D) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nc, d, mb, scale, dp, nc, qh + (size_t)r0 * qs, qs, 1.0f,
                    dkh, ks);
      }
    }
  }
}

static void attention_bwd_f32(backend_t *be, float *dq, float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *out, const float *lse, int b, int t, int h,
                              int kv, int d) {
  attention_bwd_block_f32(be, dq, dk, dv, dout, q, k, v, out, lse, b, t, t, h, kv, d, 0, 0);
}

static void cpu_attention_fwd(backend_t *be, void *out, float *lse, const void *q, const void *k, const void *v, int b,
                              int t, int h, int kv, int d, dtype_t dt) {
  if (dt == DT_F32) {
    attention_fwd_f32(be, out, lse, q, k, v, b, t, h, kv, d);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  float *s[4]; /* q, k, v, out */
  if (wide_bufs(cp, 4, (size_t[]){nq, nk, nk, nq}, s) != 0) {
    fill_nan_bf16(out, nq);
    return;
  }
  widen(cp, s[0], q, nq);
  widen(cp, s[1], k, nk);
  widen(cp, s[2], v, nk);
  attention_fwd_f32(be, s[3], lse, s[0], s[1], s[2], b, t, h, kv, d);
  narrow(cp, out, s[3], nq);
}

/* bf16: dq, dk and dv sum over query blocks and query heads in fp32 scratch (from zero) and are
 * rounded once at the end, not after every block. */
static void cpu_attention_bwd(backend_t *be, void *dq, void *dk, void *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const float *lse, int b, int t, int h,
                              int kv, int d, dtype_t dt) {
  const size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  if (dt == DT_F32) { /* the kernel accumulates; the contract writes */
    memset(dq, 0, nq * sizeof(float));
    memset(dk, 0, nk * sizeof(float));
    memset(dv, 0, nk * sizeof(float));
    attention_bwd_f32(be, dq, dk, dv, dout, q, k, v, out, lse, b, t, h, kv, d);
    return;
  }
  cpu_t *cp = cpu_of(be);
  float *s[8]; /* dq, dk, dv, dout, q, k, v, out */
  if (wide_bufs(cp, 8, (size_t[]){nq, nk, nk, nq, nq, nk, nk, nq}, s) != 0) {
    fill_nan_bf16(dq, nq);
    return;
  }
  memset(s[0], 0, nq * sizeof(float));
  memset(s[1], 0, nk * sizeof(float));
  memset(s[2], 0, nk * sizeof(float));
  widen(cp, s[3], dout, nq);
  widen(cp, s[4], q, nq);
  widen(cp, s[5], k, nk);
  widen(cp, s[6], v, nk);
  widen(cp, s[7], out, nq);
  attention_bwd_f32(be, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], lse, b, t, h, kv, d);
  narrow(cp, dq, s[0], nq);
  narrow(cp, dk, s[1], nk);
  narrow(cp, dv, s[2], nk);
}

/* Blocks of attention for context parallelism (backend.h, attention_fwd_block): bf16 inputs are
 * widened; the block's out, lse and the gradients are fp32 by contract, so nothing is rounded. */
static void cpu_attention_fwd_block(backend_t *be, float *out, float *lse, const void *q, const void *k,
                                    const void *v, int b, int tq, int tk, int h, int kv, int d, long q_pos, long k_pos,
                                    dtype_t dt) {
  if (dt == DT_F32) {
    attention_fwd_block_f32(be, out, lse, q, k, v, b, tq, tk, h, kv, d, q_pos, k_pos);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nq = (size_t)b * tq * h * d, nk = (size_t)b * tk * kv * d;
  float *s[3]; /* q, k, v */
  if (wide_bufs(cp, 3, (size_t[]){nq, nk, nk}, s) != 0) {
    fill_nan(out, nq);
    return;
  }
  widen(cp, s[0], q, nq);
  widen(cp, s[1], k, nk);
  widen(cp, s[2], v, nk);
  attention_fwd_block_f32(be, out, lse, s[0], s[1], s[2], b, tq, tk, h, kv, d, q_pos, k_pos);
}

/* out, lse (the running result) and out_b, lse_b (a block's): per row, the weights of the two
 * are exp(lse - lse_new) and exp(lse_b - lse_new), lse_new = log(exp(lse) + exp(lse_b)). A side
 * whose lse is -inf has seen no key and weighs exactly 0. */
static void cpu_attention_merge(backend_t *be, float *out, float *lse, const float *out_b, const float *lse_b, int b,
                                int t, int h, int d) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int bh = 0; bh < b * h; bh++) {
    int bi = bh / h, hi = bh % h;
    for (int i = 0; i < t; i++) {
      float *l = lse + (size_t)bh * t + i;
      float lb = lse_b[(size_t)bh * t + i];
      if (lb == -INFINITY) continue;
      float *o = out + ((size_t)bi * t + i) * h * d + (size_t)hi * d;
      const float *ob = out_b + ((size_t)bi * t + i) * h * d + (size_t)hi * d;
      float mx = *l > lb ? *l : lb;
      double wa = *l == -INFINITY ? 0.0 : exp((double)*l - mx), wb = exp((double)lb - mx), sum = wa + wb;
      float fa = (float)(wa / sum), fb = (float)(wb / sum);
      for (int j = 0; j < d; j++)
        o[j] = fa * o[j] + fb * ob[j];
      *l = mx + (float)log(sum);
    }
  }
}

static void cpu_attention_bwd_block(backend_t *be, float *dq, float *dk, float *dv, const void *dout, const void *q,
                                    const void *k, const void *v, const void *out, const float *lse, int b, int tq,
                                    int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt) {
  if (dt == DT_F32) {
    attention_bwd_block_f32(be, dq, dk, dv, dout, q, k, v, out, lse, b, tq, tk, h, kv, d, q_pos, k_pos);
    return;
  }
  cpu_t *cp = cpu_of(be);
  const size_t nq = (size_t)b * tq * h * d, nk = (size_t)b * tk * kv * d;
  float *s[5]; /* dout, q, k, v, out */
  if (wide_bufs(cp, 5, (size_t[]){nq, nq, nk, nk, nq}, s) != 0) {
    fill_nan(dq, nq);
    return;
  }
  widen(cp, s[0], dout, nq);
  widen(cp, s[1], q, nq);
  widen(cp, s[2], k, nk);
  widen(cp, s[3], v, nk);
  widen(cp, s[4], out, nq);
  attention_bwd_block_f32(be, dq, dk, dv, s[0], s[1], s[2], s[3], s[4], lse, b, tq, tk, h, kv, d, q_pos, k_pos);
}

/* ------------------------------------------------------------------ SwiGLU */

/* Rows of ag hold a then g (f each); rows in parallel, each a loop GCC vectorizes. */
static void swiglu_fwd_f32(backend_t *be, float *out, const float *ag, int n, int f) {
  int nt = cpu_of(be)->threads;
  const size_t F = (size_t)f;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * F > PAR_MIN)
  for (int r = 0; r < n; r++) {
    const float *a = ag + (size_t)r * 2 * F, *g = a + F;
    float *o = out + (size_t)r * F;
    for (size_t j = 0; j < F; j++) {
      float x = a[j];
      o[j] = x / (1.0f + vexpf(-x)) * g[j];
    }
  }
}

/* silu(a) = a s, s = sigmoid(a); silu'(a) = s (1 + a (1 - s)). dag's rows as ag's. */
static void swiglu_bwd_f32(backend_t *be, float *dag, const float *dout, const float *ag, int n, int f) {
  int nt = cpu_of(be)->threads;
  const size_t F = (size_t)f;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * F > PAR_MIN)
  for (int r = 0; r < n; r++) {
    const float *a = ag + (size_t)r * 2 * F, *g = a + F, *dr = dout + (size_t)r * F;
    float *da = dag + (size_t)r * 2 * F, *dg = da + F;
    for (size_t j = 0; j < F; j++) {
      float x = a[j], s = 1.0f / (1.0f + vexpf(-x)), d = dr[j];
      da[j] = 0.0f + d * g[j] * s * (1.0f + x * (1.0f - s)); /* written; 0 + keeps the bits of += on zeros */
      dg[j] = 0.0f + d * x * s;
    }
  }
}

static void cpu_swiglu_fwd(backend_t *be, void *out, const void *ag, int n, int f, dtype_t dt) {
  if (dt == DT_F32) {
    swiglu_fwd_f32(be, out, ag, n, f);
    return;
  }
  cpu_t *cp = cpu_of(be);
  const size_t nf = (size_t)n * f;
  float *s[2]; /* ag, out */
  if (wide_bufs(cp, 2, (size_t[]){2 * nf, nf}, s) != 0) {
    fill_nan_bf16(out, nf);
    return;
  }
  widen(cp, s[0], ag, 2 * nf);
  swiglu_fwd_f32(be, s[1], s[0], n, f);
  narrow(cp, out, s[1], nf);
}

static void cpu_swiglu_bwd(backend_t *be, void *dag, const void *dout, const void *ag, int n, int f, dtype_t dt) {
  if (dt == DT_F32) {
    swiglu_bwd_f32(be, dag, dout, ag, n, f);
    return;
  }
  cpu_t *cp = cpu_of(be);
  const size_t nf = (size_t)n * f;
  float *s[3]; /* dag (written by the kernel), dout, ag */
  if (wide_bufs(cp, 3, (size_t[]){2 * nf, nf, 2 * nf}, s) != 0) {
    fill_nan_bf16(dag, 2 * nf);
    return;
  }
  widen(cp, s[1], dout, nf);
  widen(cp, s[2], ag, 2 * nf);
  swiglu_bwd_f32(be, s[0], s[1], s[2], n, f);
  narrow(cp, dag, s[0], 2 * nf);
}

/* ------------------------------------------------------------------ cross-entropy */

static void cross_entropy_f32(backend_t *be, float *losses, float *dlogits, const float *logits, const int32_t *targets,
                              int n, int v, int ld, float grad_scale) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * v > PAR_MIN)
  for (int i = 0; i < n; i++) {
    const float *li = logits + (size_t)i * ld;
    int tg = targets[i];
    if (tg < 0 || tg >= v) {
      losses[i] = 0.0f;
      if (dlogits) memset(dlogits + (size_t)i * ld, 0, (size_t)ld * sizeof(float));
      continue;
    }
    float mx = row_max(li, v), lt = li[tg]; /* lt read before dlogits may overwrite the row */
    if (!dlogits) {
      losses[i] = mx + (float)log(row_sumexp(li, v, mx)) - lt;
      continue;
    }
    float *di = dlogits + (size_t)i * ld;
    for (int j = 0; j < v; j++)
      di[j] = vexpf(li[j] - mx);
    double sum = row_sum(di, v);
    losses[i] = mx + (float)log(sum) - lt;
    float k = (float)(grad_scale / sum);
    for (int j = 0; j < v; j++)
      di[j] *= k;
    di[tg] -= grad_scale;
    for (int j = v; j < ld; j++)
      di[j] = 0.0f;
  }
}

/* bf16: the logits are widened into one fp32 buffer, which the fp32 kernel overwrites with the
 * gradient in place (as it does when dlogits aliases logits), rounded into dlogits. */
static void cpu_cross_entropy(backend_t *be, float *losses, void *dlogits, const void *logits, const int32_t *targets,
                              int n, int v, int ld, float grad_scale, dtype_t dt) {
  if (dt == DT_F32) {
    cross_entropy_f32(be, losses, dlogits, logits, targets, n, v, ld, grad_scale);
    return;
  }
  cpu_t *cp = cpu_of(be);
  size_t nl = (size_t)n * ld;
  float *s[1];
  if (wide_bufs(cp, 1, &nl, s) != 0) {
    fill_nan(losses, (size_t)n);
    if (dlogits) fill_nan_bf16(dlogits, nl);
    return;
  }
  widen(cp, s[0], logits, nl);
  cross_entropy_f32(be, losses, dlogits ? s[0] : NULL, s[0], targets, n, v, ld, grad_scale);
  if (dlogits) narrow(cp, dlogits, s[0], nl);
}

/* ------------------------------------------------------------------ tensor-parallel pieces */

static void cpu_copy_2d(backend_t *be, void *dst, int ldd, const void *src, int lds, int rows, int cols, dtype_t dt) {
  if (cols <= 0) return;
  size_t es = dtype_size(dt); /* bytes per element; a copy needs no arithmetic */
  for (int i = 0; i < rows; i++)
    memmove((char *)dst + (size_t)i * ldd * es, (const char *)src + (size_t)i * lds * es, (size_t)cols * es);
}

/* The vocab-parallel cross-entropy in three steps (backend.h); each row reduces in the same
 * fixed order as cpu_cross_entropy's (row_max, row_sumexp). */
static void ce_shard_max_f32(backend_t *be, float *rowmax, const float *logits, int n, int v, int ld) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * v > PAR_MIN)
  for (int i = 0; i < n; i++)
    rowmax[i] = v > 0 ? row_max(logits + (size_t)i * ld, v) : -FLT_MAX;
}

static void ce_shard_stats_f32(backend_t *be, float *stats, const float *logits, const float *rowmax,
                               const int32_t *targets, int n, int v, int ld, int vocab_start) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * v > PAR_MIN)
  for (int i = 0; i < n; i++) {
    const float *li = logits + (size_t)i * ld;
    int j = targets[i] - vocab_start;
    stats[i] = v > 0 ? (float)row_sumexp(li, v, rowmax[i]) : 0.0f;
    stats[n + i] = targets[i] >= 0 && j >= 0 && j < v ? li[j] : 0.0f;
  }
}

static void ce_shard_loss_f32(backend_t *be, float *losses, float *dlogits, const float *logits, const float *rowmax,
                              const float *stats, const int32_t *targets, int n, int v, int ld, int vocab_start,
                              float grad_scale) {
  int nt = cpu_of(be)->threads;
#pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)n * v > PAR_MIN)
  for (int i = 0; i < n; i++) {
    int tg = targets[i];
    float *di = dlogits ? dlogits + (size_t)i * ld : NULL;
    if (tg < 0) {
      losses[i] = 0.0f;
      if (di) memset(di, 0, (size_t)ld * sizeof(float));
      continue;
    }
    float mx = rowmax[i], sum = stats[i];
    losses[i] = mx + logf(sum) - stats[n + i];
    if (!di) continue;
    const float *li = logits + (size_t)i * ld;
    float k = grad_scale / sum;
    for (int j = 0; j < v; j++)
      di[j] = vexpf(li[j] - mx) * k;
    int jt = tg - vocab_start;
    if (jt >= 0 && jt < v) di[jt] -= grad_scale;
    for (int j = v > 0 ? v : 0; j < ld; j++)
      di[j] = 0.0f;
  }
}

/* bf16 shards: the logits widened into scratch (rows of ld, as they lie), the fp32 step run on
 * them; ce_shard_loss writes its gradient over that scratch in place and rounds it into
 * dlogits. Without dlogits it reads no logits at all, so nothing is widened. */
static float *wide_logits(backend_t *be, const void *logits, int n, int ld) {
  cpu_t *cp = cpu_of(be);
  size_t nl = (size_t)n * ld;
  float *s[1];
  if (wide_bufs(cp, 1, &nl, s) != 0) return NULL;
  widen(cp, s[0], logits, nl);
  return s[0];
}

static void cpu_ce_shard_max(backend_t *be, float *rowmax, const void *logits, int n, int v, int ld, dtype_t dt) {
  const float *l = dt == DT_F32 ? logits : wide_logits(be, logits, n, ld);
  if (!l) {
    fill_nan(rowmax, (size_t)n);
    return;
  }
  ce_shard_max_f32(be, rowmax, l, n, v, ld);
}

static void cpu_ce_shard_stats(backend_t *be, float *stats, const void *logits, const float *rowmax,
                               const int32_t *targets, int n, int v, int ld, int vocab_start, dtype_t dt) {
  const float *l = dt == DT_F32 ? logits : wide_logits(be, logits, n, ld);
  if (!l) {
    fill_nan(stats, 2 * (size_t)n);
    return;
  }
  ce_shard_stats_f32(be, stats, l, rowmax, targets, n, v, ld, vocab_start);
}

static void cpu_ce_shard_loss(backend_t *be, float *losses, void *dlogits, const void *logits, const float *rowmax,
                              const float *stats, const int32_t *targets, int n, int v, int ld, int vocab_start,
                              float grad_scale, dtype_t dt) {
  if (dt == DT_F32 || !dlogits) {
    ce_shard_loss_f32(be, losses, dlogits, dt == DT_F32 ? logits : NULL, rowmax, stats, targets, n, v, ld, vocab_start,
                      grad_scale);
    return;
  }
  float *l = wide_logits(be, logits, n, ld);
  if (!l) {
    fill_nan(losses, (size_t)n);
    fill_nan_bf16(dlogits, (size_t)n * ld);
    return;
  }
  ce_shard_loss_f32(be, losses, l, l, rowmax, stats, targets, n, v, ld, vocab_start, grad_scale);
  narrow(cpu_of(be), dlogits, l, (size_t)n * ld);
}

/* ------------------------------------------------------------------ AdamW */

/* PyTorch's AdamW, step for step: p *= 1 - lr wd; m, v moments; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
 * With param_lp the bf16 compute copy is rounded from the new fp32 value in the same pass.
 * adamw_t holds what one call computes once; adamw_one updates element i (both entries use it,
 * so a segment of adamw_multi gets adamw's bits). */
typedef struct {
  float beta1, beta2, eps, step_size, bc2_sqrt, grad_scale;
} adamw_t;

static adamw_t adamw_consts(float lr, float beta1, float beta2, float eps, int step, float grad_scale) {
  const adamw_step_t st = adamw_step_make(lr, beta1, beta2, step);
  return (adamw_t){beta1, beta2, eps, st.step_size, st.bc2_sqrt, grad_scale};
}

static inline void adamw_one(const adamw_t *a, float decay, float *param, const float *grad, float *m, float *v,
                             bf16_t *lp, size_t i) {
  float g = grad[i] * a->grad_scale;
  float mi = a->beta1 * m[i] + (1.0f - a->beta1) * g;
  float vi = a->beta2 * v[i] + (1.0f - a->beta2) * g * g;
  m[i] = mi;
  v[i] = vi;
  float p = param[i] * decay;
  param[i] = p - a->step_size * mi / (sqrtf(vi) / a->bc2_sqrt + a->eps);
  if (lp) lp[i] = bf16_from_f32(param[i]);
}

static void cpu_adamw(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp, size_t n,
                      float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
  int nt = cpu_of(be)->threads;
  const adamw_t a = adamw_consts(lr, beta1, beta2, eps, step, grad_scale);
  const float decay = 1.0f - lr * weight_decay;
#pragma omp parallel for num_threads(nt) schedule(static) if (n > PAR_MIN)
  for (size_t i = 0; i < n; i++) adamw_one(&a, decay, param, grad, m, v, param_lp, i);
}

/* One parallel region for all segments: the threads split each segment in turn, without a
 * barrier between them (the elements are independent). */
static void cpu_adamw_multi(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                            const adamw_segment_t *segs, int n_segs, float lr, float beta1, float beta2, float eps,
                            float weight_decay, int step, float grad_scale) {
  int nt = cpu_of(be)->threads;
  const adamw_t a = adamw_consts(lr, beta1, beta2, eps, step, grad_scale);
  const float decay_on = 1.0f - lr * weight_decay, decay_off = 1.0f - lr * 0.0f; /* adamw's, with 0 */
  size_t total = 0;
  for (int s = 0; s < n_segs; s++) total += segs[s].numel;
#pragma omp parallel num_threads(nt) if (total > PAR_MIN)
  for (int s = 0; s < n_segs; s++) {
    const size_t lo = segs[s].offset, hi = segs[s].offset + segs[s].numel;
    const float decay = segs[s].decay ? decay_on : decay_off;
#pragma omp for schedule(static) nowait
    for (size_t i = lo; i < hi; i++) adamw_one(&a, decay, param, grad, m, v, param_lp, i);
  }
}

/* ------------------------------------------------------------------ a step without host waits */

/* The host's arithmetic of a step's statistics, on memory that is the host's anyway: the same
 * bits as the code that read them back did (backend.h). */
static void cpu_step_loss(backend_t *be, const float *rows, int n, int valid, int micro, int accum, int poison,
                          double *stat, float *mean) {
  double sum = 0.0;
  for (int i = 0; i < n; i++) sum += rows[i];
  float l = valid > 0 ? (float)(sum / valid) : 0.0f;
  if (poison) l = NAN;
  if (micro == 0) stat[0] = stat[1] = 0.0;
  stat[0] += l;
  if (!isfinite(l) && stat[1] == 0.0) stat[1] = micro + 1;
  if (micro == accum - 1) {
    stat[0] /= accum;
    *mean = (float)stat[0];
  }
}

static void cpu_sumsq_groups(backend_t *be, const float *x, const size_t *offset, const size_t *count,
                             const int *group, int n, double *sums, float *shares) {
  double s[2] = {0.0, 0.0};
  for (int i = 0; i < n; i++) s[group[i] ? 1 : 0] += cpu_sumsq(be, x + offset[i], count[i]);
  for (int g = 0; g < 2; g++) {
    sums[g] = s[g];
    shares[g] = (float)s[g];
  }
}

static void cpu_sumsq_parts_add(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                                double *out) {
  for (int i = 0; i < n; i++) out[i] += cpu_sumsq(be, x + offset[i], count[i]);
}

static void cpu_clip_scale(backend_t *be, const double *sums, const float *shares, int use_shares, double clip,
                           double *norm, float *scale) {
  const double r = use_shares ? sqrt((double)shares[0] + (double)shares[1]) : sqrt(sums[0] + sums[1]);
  *norm = r;
  *scale = (float)(clip <= 0 || r <= clip ? 1.0 : clip / r);
}

static void cpu_adamw_multi_dev(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                                const adamw_segment_t *segs, int n_segs, float beta1, float beta2, float eps,
                                float weight_decay, const adamw_step_t *st, const float *grad_scale) {
  if (st->skip) return;
  cpu_adamw_multi(be, param, grad, m, v, param_lp, segs, n_segs, st->lr, beta1, beta2, eps, weight_decay, st->step,
                  *grad_scale);
}

static void cpu_step_skip(backend_t *be, const float *loss, const double *norm, int nonfinite, double loss_z,
                          double norm_z, skip_window_t *win, skip_verdict_t *out, adamw_step_t *st) {
  skip_rule(*loss, *norm, nonfinite, loss_z, norm_z, win, out, st);
}

/* Host memory is the device's: an upload is a copy, and nothing runs beside it to wait for. */
static void *cpu_alloc_pinned(backend_t *be, size_t bytes) { return calloc(1, bytes ? bytes : 1); }
static void cpu_free_pinned(backend_t *be, void *p) { free(p); }
static void cpu_upload_host_wait(backend_t *be, int slot) {}
static void cpu_upload_async(backend_t *be, void *dst, const void *src, size_t bytes, int slot) {
  cpu_copy(be, dst, src, bytes);
}
static void cpu_upload_wait(backend_t *be, int slot) {}

/* ------------------------------------------------------------------ lifecycle */

static void cpu_destroy(backend_t *be) {
  if (!be) return;
  cpu_t *cp = be->impl;
  if (cp) {
    free(cp->att_scratch);
    free(cp->partials);
    free(cp->rope_cos);
    free(cp->rope_sin);
    free(cp->wide);
    free(cp);
  }
  free(be);
}

backend_t *backend_cpu_create(int threads, char *err, size_t errlen) {
  if (threads <= 0) threads = omp_get_max_threads(); /* OMP_NUM_THREADS, else the CPU count */
  if (threads <= 0) threads = 1;
  backend_t *be = calloc(1, sizeof *be);
  cpu_t *cp = calloc(1, sizeof *cp);
  if (!be || !cp) {
    free(be);
    free(cp);
    if (err && errlen) err_set(err, errlen, 0, "backend error: cpu: out of memory");
    return NULL;
  }
  cp->threads = threads;
  /* All threading is OpenMP's (see cpu_matmul); OpenBLAS runs on the calling thread. */
  openblas_set_num_threads(1);
  be->name = "cpu";
  be->mem = BACKEND_MEM_HOST;
  be->impl = cp;
  be->alloc = cpu_alloc;
  be->free = cpu_free;
  be->to_device = cpu_copy;
  be->to_host = cpu_copy;
  be->copy = cpu_copy;
  be->zero = cpu_zero;
  be->synchronize = cpu_sync;
  be->matmul = cpu_matmul;
  be->add = cpu_add;
  be->scale = cpu_scale;
  be->sumsq = cpu_sumsq;
  be->sumsq_parts = cpu_sumsq_parts;
  be->convert = cpu_convert;
  be->embedding_fwd = cpu_embedding_fwd;
  be->embedding_bwd = cpu_embedding_bwd;
  be->rmsnorm_fwd = cpu_rmsnorm_fwd;
  be->rmsnorm_bwd = cpu_rmsnorm_bwd;
  be->add_rmsnorm_fwd = cpu_add_rmsnorm_fwd;
  be->rope_fwd = cpu_rope_fwd;
  be->rope_bwd = cpu_rope_bwd;
  be->qkv_rope_fwd = cpu_qkv_rope_fwd;
  be->qkv_rope_bwd = cpu_qkv_rope_bwd;
  be->attention_fwd = cpu_attention_fwd;
  be->attention_bwd = cpu_attention_bwd;
  be->attention_fwd_block = cpu_attention_fwd_block;
  be->attention_merge = cpu_attention_merge;
  be->attention_bwd_block = cpu_attention_bwd_block;
  be->swiglu_fwd = cpu_swiglu_fwd;
  be->swiglu_bwd = cpu_swiglu_bwd;
  be->cross_entropy = cpu_cross_entropy;
  be->copy_2d = cpu_copy_2d;
  be->ce_shard_max = cpu_ce_shard_max;
  be->ce_shard_stats = cpu_ce_shard_stats;
  be->ce_shard_loss = cpu_ce_shard_loss;
  be->adamw = cpu_adamw;
  be->adamw_multi = cpu_adamw_multi;
  be->step_loss = cpu_step_loss;
  be->sumsq_groups = cpu_sumsq_groups;
  be->sumsq_parts_add = cpu_sumsq_parts_add;
  be->clip_scale = cpu_clip_scale;
  be->adamw_multi_dev = cpu_adamw_multi_dev;
  be->step_skip = cpu_step_skip;
  be->to_device_async = cpu_copy;
  be->host_alloc_pinned = cpu_alloc_pinned;
  be->host_free_pinned = cpu_free_pinned;
  be->upload_host_wait = cpu_upload_host_wait;
  be->upload_async = cpu_upload_async;
  be->upload_wait = cpu_upload_wait;
  be->destroy = cpu_destroy;
  return be;
}

/* The registry's entry (trainer/backend/registry.c): no device to pick or count; no peak
 * FLOP/s known for a host CPU (log.peak_tflops gives one). */
static backend_t *cpu_entry_create(int device, int threads, char *err, size_t errlen) {
  return backend_cpu_create(threads, err, errlen);
}

const backend_entry_t backend_entry_cpu = {
    .name = "cpu",
    .mem = BACKEND_MEM_HOST,
    .create = cpu_entry_create,
};
