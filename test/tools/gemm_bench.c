// deps:
/* gemm_bench: bf16 matrix products on the cpu, three ways, on the shapes a Llama trains with.
 *
 *   gemm_bench [set=256|1024|all] [reps=N] [threads=T]
 *
 * For each linear layer of the model (rows N, in, out) it runs the three products the model
 * makes with it (trainer/backend/backend.h):
 *   fwd  y  = x W^T      NT  m=N   n=out k=in   beta 0, c bf16
 *   dx   dx += dy W      NN  m=N   n=in  k=out  beta 1, c bf16
 *   dW   dW += dy^T x    TN  m=out n=in  k=N    beta 1, c fp32 (gradients stay fp32)
 * and times them
 *   (a) fp32: fp32 operands, cblas_sgemm split into one block of c per OpenMP thread, each
 *       block a single-threaded sgemm (what backend_cpu.c's cpu_matmul does);
 *   (b) widen: bf16 operands widened to fp32 scratch, then (a)'s sgemm blocks; a bf16 c is
 *       widened (when beta != 0) and rounded back per block. Widening and rounding are timed;
 *   (c) dnnl: oneDNN's matmul on the bf16 operands (f32 accumulation, dst bf16 or f32, beta as
 *       a sum post-op), primitive created once per shape and reused, T OpenMP threads.
 * Each time is the median of `reps` rounds after a warm-up round; a round runs (a), (b), (c) in
 * turn, so a drift in clock or load reaches all three alike. b/a is what the bf16 storage costs
 * (or saves) over fp32; c/b is the speedup oneDNN would bring over widening. rel(b,c) is
 * max|b - c| / max|b| over the whole output (both accumulate in fp32, in different orders);
 * err(b), err(c) compare 64 sampled outputs with an fp64 product of the same bf16 operands,
 * relative to the largest sampled |ref|. The "step" lines weight each shape by how often one
 * training step runs it (per layer: 4 attention projections, 2 up, 1 down; the head once).
 *
 * Built without oneDNN (no dnnl.h), it prints (a) and (b) only. OpenBLAS always runs
 * single-threaded here, as in the backend. Its DYNAMIC_ARCH build picks kernels by cpu model:
 * Debian's 0.3.21 does not know the development VM's (family 6 model 207, Emerald Rapids) and
 * falls back to SSE3 (Prescott) kernels, which the header line shows and a warning names;
 * OPENBLAS_CORETYPE=SkylakeX (read when the library loads) selects the AVX-512 ones.
 *
 * What it showed there (2 cores, AVX512-BF16 but no AMX exposed; oneDNN 2.6.3 picks
 * brg:avx512_core_bf16): oneDNN reaches ~83 GFLOP/s per core, which is the cpu's vdpbf16ps
 * peak: that instruction issues at half the rate of vfmadd231ps (64 flops per 2 cycles against
 * 2 x 32 per cycle), so widening plus AVX-512 sgemm (~140 per core) wins, c/b = 0.74 at dim 256
 * and 0.60 at dim 1024. Against the Prescott kernels c/b is ~2.7, but choosing the right
 * OpenBLAS kernels gains more (4.3x on fp32 and bf16 alike). A cpu with AMX would need a
 * new measurement. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "trainer/backend/bf16.h"

#ifdef MESHRUN_HAVE_DNNL
#include <dnnl.h>
#endif

typedef struct {
  const char *name;
  int rows, in, out; /* x (rows, in), W (out, in) */
  int count;         /* how many of this layer one training step runs */
} layer_t;

typedef struct {
  const char *name;
  int trans_a, trans_b;
  float beta;
  int c_bf16;
} case_t;

static const case_t CASES[3] = {
    {"fwd NT", 0, 1, 0.0f, 1},
    {"dx  NN", 0, 0, 1.0f, 1},
    {"dW  TN", 1, 0, 1.0f, 0},
};

/* dim 256: 8 layers, seq 512 x batch 8; dim 1024: 16 layers, seq 1024 x batch 2, and the
 * 32000-word head on 512 rows only (a loss-parallel or chunked head sees fewer rows). */
static const layer_t SET256[] = {
    {"attn C>C", 4096, 256, 256, 4 * 8},
    {"up   C>F", 4096, 256, 688, 2 * 8},
    {"down F>C", 4096, 688, 256, 1 * 8},
    {"head C>V", 4096, 256, 512, 1},
};
static const layer_t SET1024[] = {
    {"attn C>C", 2048, 1024, 1024, 4 * 16},
    {"up   C>F", 2048, 1024, 2816, 2 * 16},
    {"down F>C", 2048, 2816, 1024, 1 * 16},
    {"head C>V", 512, 1024, 32000, 1},
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float urand(void) { /* uniform in [-1, 1) */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((rng_state >> 40) * (2.0 / 16777216.0) - 1.0);
}

static void *xmalloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64)) {
    fprintf(stderr, "gemm_bench: out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

/* ------------------------------------------------------------------ (a) fp32, blocked sgemm */

/* One single-threaded sgemm on rows [m0, m1), columns [n0, n1) of c; operands keep their
 * leading dimensions, only the start pointers move (as backend_cpu.c's sgemm_block). */
static void sgemm_block(float *c, const float *a, const float *b, int m, int n, int k, int ta, int tb, float alpha,
                        float beta, int m0, int m1, int n0, int n1) {
  if (m1 <= m0 || n1 <= n0) return;
  const float *ab = ta ? a + m0 : a + (size_t)m0 * k;
  const float *bb = tb ? b + (size_t)n0 * k : b + n0;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m1 - m0, n1 - n0, k,
              alpha, ab, ta ? m : k, bb, tb ? k : n, beta, c + (size_t)m0 * n + n0, n);
}

/* The block of thread ti out of tn: rows when c is tall, columns when wide, in multiples of 16. */
static void thread_block(int m, int n, int ti, int tn, int *m0, int *m1, int *n0, int *n1) {
  int split_rows = m >= n, len = split_rows ? m : n;
  int units = (len + 15) / 16;
  int u0 = (int)((long)units * ti / tn), u1 = (int)((long)units * (ti + 1) / tn);
  int i0 = u0 * 16, i1 = u1 * 16 < len ? u1 * 16 : len;
  *m0 = split_rows ? i0 : 0;
  *m1 = split_rows ? i1 : m;
  *n0 = split_rows ? 0 : i0;
  *n1 = split_rows ? n : i1;
}

static void mm_f32(int nt, float *c, const float *a, const float *b, int m, int n, int k, int ta, int tb, float alpha,
                   float beta) {
#pragma omp parallel num_threads(nt)
  {
    int m0, m1, n0, n1;
    thread_block(m, n, omp_get_thread_num(), omp_get_num_threads(), &m0, &m1, &n0, &n1);
    sgemm_block(c, a, b, m, n, k, ta, tb, alpha, beta, m0, m1, n0, n1);
  }
}

/* ------------------------------------------------------------------ (b) widen, then (a) */

typedef struct {
  float *a, *b, *c; /* fp32 copies: (m*k), (k*n), (m*n) */
} widen_scratch_t;

/* c (bf16 when c_bf16, else fp32) = alpha op(a) op(b) + beta c for bf16 a, b. One parallel
 * region: both operands are widened by all threads (static split), then each thread widens its
 * block of c (a bf16 c with beta != 0), runs its sgemm and rounds the block back. */
static void mm_widen(int nt, widen_scratch_t *w, void *c, int c_bf16, const bf16_t *a, const bf16_t *b, int m, int n,
                     int k, int ta, int tb, float alpha, float beta) {
  size_t na = (size_t)m * k, nb = (size_t)k * n;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static) nowait
    for (size_t i = 0; i < na; i++)
      w->a[i] = bf16_to_f32(a[i]);
#pragma omp for schedule(static)
    for (size_t i = 0; i < nb; i++)
      w->b[i] = bf16_to_f32(b[i]);
    int m0, m1, n0, n1;
    thread_block(m, n, omp_get_thread_num(), omp_get_num_threads(), &m0, &m1, &n0, &n1);
    if (!c_bf16) {
      sgemm_block(c, w->a, w->b, m, n, k, ta, tb, alpha, beta, m0, m1, n0, n1);
    } else {
      bf16_t *c16 = c;
      if (beta != 0.0f)
        for (int i = m0; i < m1; i++)
          bf16_to_f32_n(w->c + (size_t)i * n + n0, c16 + (size_t)i * n + n0, (size_t)(n1 - n0));
      sgemm_block(w->c, w->a, w->b, m, n, k, ta, tb, alpha, beta, m0, m1, n0, n1);
      for (int i = m0; i < m1; i++)
        bf16_from_f32_n(c16 + (size_t)i * n + n0, w->c + (size_t)i * n + n0, (size_t)(n1 - n0));
    }
  }
}

/* ------------------------------------------------------------------ (c) oneDNN */

#ifdef MESHRUN_HAVE_DNNL
typedef struct {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  dnnl_primitive_desc_t pd;
  dnnl_primitive_t prim;
  dnnl_memory_t mem[3]; /* src, weights, dst */
} dnnl_mm_t;

#define DNNL_OK(call)                                                                                       \
  do {                                                                                                      \
    dnnl_status_t st_ = (call);                                                                             \
    if (st_ != dnnl_success) {                                                                              \
      fprintf(stderr, "gemm_bench: %s:%d: %s: dnnl status %d\n", __FILE__, __LINE__, #call, (int)st_);     \
      exit(1);                                                                                              \
    }                                                                                                       \
  } while (0)

/* A plain row-major (rows, cols) matrix, or its transpose stored as (cols, rows). */
static void dnnl_md(dnnl_memory_desc_t *md, int rows, int cols, int trans, dnnl_data_type_t dt) {
  dnnl_dims_t dims = {rows, cols};
  dnnl_dims_t strides = {trans ? 1 : cols, trans ? rows : 1};
  DNNL_OK(dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides));
}

static void dnnl_mm_init(dnnl_mm_t *d, dnnl_engine_t engine, dnnl_stream_t stream, void *c, int c_bf16,
                         const bf16_t *a, const bf16_t *b, int m, int n, int k, int ta, int tb, float alpha,
                         float beta) {
  d->engine = engine;
  d->stream = stream;
  dnnl_memory_desc_t md_a, md_b, md_c;
  dnnl_md(&md_a, m, k, ta, dnnl_bf16);
  dnnl_md(&md_b, k, n, tb, dnnl_bf16);
  dnnl_md(&md_c, m, n, 0, c_bf16 ? dnnl_bf16 : dnnl_f32);
  dnnl_matmul_desc_t desc;
  DNNL_OK(dnnl_matmul_desc_init(&desc, &md_a, &md_b, NULL, &md_c));
  dnnl_primitive_attr_t attr;
  DNNL_OK(dnnl_primitive_attr_create(&attr));
  if (alpha != 1.0f) DNNL_OK(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha));
  if (beta != 0.0f) {
    dnnl_post_ops_t po;
    DNNL_OK(dnnl_post_ops_create(&po));
    DNNL_OK(dnnl_post_ops_append_sum(po, beta));
    DNNL_OK(dnnl_primitive_attr_set_post_ops(attr, po));
    DNNL_OK(dnnl_post_ops_destroy(po));
  }
  DNNL_OK(dnnl_primitive_desc_create(&d->pd, &desc, attr, engine, NULL));
  DNNL_OK(dnnl_primitive_attr_destroy(attr));
  DNNL_OK(dnnl_primitive_create(&d->prim, d->pd));
  DNNL_OK(dnnl_memory_create(&d->mem[0], &md_a, engine, (void *)a));
  DNNL_OK(dnnl_memory_create(&d->mem[1], &md_b, engine, (void *)b));
  DNNL_OK(dnnl_memory_create(&d->mem[2], &md_c, engine, c));
}

static const char *dnnl_mm_impl(const dnnl_mm_t *d) {
  const char *s = NULL;
  if (dnnl_primitive_desc_query(d->pd, dnnl_query_impl_info_str, 0, &s) != dnnl_success || !s) return "?";
  return s;
}

static void dnnl_mm_run(dnnl_mm_t *d) {
  dnnl_exec_arg_t args[3] = {
      {DNNL_ARG_SRC, d->mem[0]}, {DNNL_ARG_WEIGHTS, d->mem[1]}, {DNNL_ARG_DST, d->mem[2]}};
  DNNL_OK(dnnl_primitive_execute(d->prim, d->stream, 3, args));
  DNNL_OK(dnnl_stream_wait(d->stream));
}

static void dnnl_mm_free(dnnl_mm_t *d) {
  for (int i = 0; i < 3; i++)
    dnnl_memory_destroy(d->mem[i]);
  dnnl_primitive_destroy(d->prim);
  dnnl_primitive_desc_destroy(d->pd);
}
#endif

/* ------------------------------------------------------------------ the run */

typedef struct {
  int nt, reps;
#ifdef MESHRUN_HAVE_DNNL
  dnnl_engine_t engine;
  dnnl_stream_t stream;
#endif
} bench_t;

typedef struct {
  double t[3];  /* median seconds of (a), (b), (c) */
  double flops; /* 2 m n k */
} result_t;

static float load(const void *c, int c_bf16, size_t i) {
  return c_bf16 ? bf16_to_f32(((const bf16_t *)c)[i]) : ((const float *)c)[i];
}

static result_t run_case(bench_t *bn, const char *set, const layer_t *L, const case_t *cs) {
  int m, n, k;
  if (cs == &CASES[0]) { m = L->rows, n = L->out, k = L->in; }
  else if (cs == &CASES[1]) { m = L->rows, n = L->in, k = L->out; }
  else { m = L->out, n = L->in, k = L->rows; }
  int ta = cs->trans_a, tb = cs->trans_b, cb = cs->c_bf16;
  float alpha = 1.0f, beta = cs->beta;
  size_t na = (size_t)m * k, nb = (size_t)k * n, nc = (size_t)m * n, csz = cb ? 2 : 4;

  float *a32 = xmalloc(na * 4), *b32 = xmalloc(nb * 4), *c32 = xmalloc(nc * 4), *c0 = xmalloc(nc * 4);
  bf16_t *a16 = xmalloc(na * 2), *b16 = xmalloc(nb * 2);
  void *cw = xmalloc(nc * csz), *cd = xmalloc(nc * csz);
  widen_scratch_t ws = {xmalloc(na * 4), xmalloc(nb * 4), xmalloc(nc * 4)};
  for (size_t i = 0; i < na; i++) a16[i] = bf16_from_f32(a32[i] = urand());
  for (size_t i = 0; i < nb; i++) b16[i] = bf16_from_f32(b32[i] = urand());
  for (size_t i = 0; i < nc; i++) c32[i] = c0[i] = cb ? bf16_round(urand()) : urand();
  for (size_t i = 0; i < nc; i++) {
    if (cb) ((bf16_t *)cw)[i] = ((bf16_t *)cd)[i] = bf16_from_f32(c0[i]);
    else ((float *)cw)[i] = ((float *)cd)[i] = c0[i];
  }
  result_t res = {{0, 0, 0}, 2.0 * m * n * k};

  /* one run of (b) and (c) from the same c, compared, before timing changes c */
  mm_widen(bn->nt, &ws, cw, cb, a16, b16, m, n, k, ta, tb, alpha, beta);
  double rel = NAN, err_b = 0.0, err_c = NAN;
  const char *impl = "-";
#ifdef MESHRUN_HAVE_DNNL
  dnnl_mm_t dm;
  dnnl_mm_init(&dm, bn->engine, bn->stream, cd, cb, a16, b16, m, n, k, ta, tb, alpha, beta);
  impl = dnnl_mm_impl(&dm);
  dnnl_mm_run(&dm);
  double dmax = 0.0, bmax = 0.0;
  for (size_t i = 0; i < nc; i++) {
    double x = load(cw, cb, i), y = load(cd, cb, i);
    dmax = fmax(dmax, fabs(x - y));
    bmax = fmax(bmax, fabs(x));
  }
  rel = bmax > 0.0 ? dmax / bmax : dmax;
  err_c = 0.0;
#endif
  double refmax = 0.0;
  for (int s = 0; s < 64; s++) {
    int i = (int)((urand() + 1.0f) * 0.5f * m), j = (int)((urand() + 1.0f) * 0.5f * n);
    i = i < m ? i : m - 1, j = j < n ? j : n - 1;
    double ref = 0.0;
    for (int p = 0; p < k; p++) {
      double x = bf16_to_f32(ta ? a16[(size_t)p * m + i] : a16[(size_t)i * k + p]);
      double y = bf16_to_f32(tb ? b16[(size_t)j * k + p] : b16[(size_t)p * n + j]);
      ref += x * y;
    }
    ref = alpha * ref + beta * c0[(size_t)i * n + j];
    refmax = fmax(refmax, fabs(ref));
    err_b = fmax(err_b, fabs(load(cw, cb, (size_t)i * n + j) - ref));
#ifdef MESHRUN_HAVE_DNNL
    err_c = fmax(err_c, fabs(load(cd, cb, (size_t)i * n + j) - ref));
#endif
  }
  if (refmax > 0.0) err_b /= refmax, err_c /= refmax;

  /* One warm-up round, then reps rounds that each run (a), (b), (c) in turn, so that a drift
   * in clock speed or machine load reaches all three alike; each variant's median is taken. */
  double ts[3][64];
  for (int r = -1; r < bn->reps; r++) {
    double t0 = now_s();
    mm_f32(bn->nt, c32, a32, b32, m, n, k, ta, tb, alpha, beta);
    double t1 = now_s();
    mm_widen(bn->nt, &ws, cw, cb, a16, b16, m, n, k, ta, tb, alpha, beta);
    double t2 = now_s();
#ifdef MESHRUN_HAVE_DNNL
    dnnl_mm_run(&dm);
#endif
    double t3 = now_s();
    if (r < 0) continue;
    ts[0][r] = t1 - t0, ts[1][r] = t2 - t1, ts[2][r] = t3 - t2;
  }
  for (int v = 0; v < 3; v++) {
    qsort(ts[v], (size_t)bn->reps, sizeof ts[v][0], cmp_double);
    res.t[v] = ts[v][bn->reps / 2];
  }
#ifdef MESHRUN_HAVE_DNNL
  dnnl_mm_free(&dm);
#else
  res.t[2] = NAN;
#endif

  double g[3];
  for (int v = 0; v < 3; v++)
    g[v] = res.flops / res.t[v] * 1e-9;
  printf("%5s %-9s %-6s %6d %6d %6d %4d %-4s %8.1f %8.1f %8.1f %6.2f %6.2f %9.2e %8.1e %8.1e  %s\n", set, L->name,
         cs->name, m, n, k, L->count, cb ? "bf16" : "fp32", g[0], g[1], g[2], g[1] / g[0], g[2] / g[1], rel, err_b,
         err_c, impl);
  fflush(stdout);

  free(a32), free(b32), free(c32), free(c0), free(a16), free(b16), free(cw), free(cd);
  free(ws.a), free(ws.b), free(ws.c);
  return res;
}

/* Step-weighted totals over the cases in mask (bit i = CASES[i]). */
static void print_total(const char *set, const char *what, const layer_t *ls, int nl, result_t r[][3], int mask) {
  double t[3] = {0, 0, 0}, f = 0.0;
  for (int l = 0; l < nl; l++)
    for (int c = 0; c < 3; c++) {
      if (!(mask >> c & 1)) continue;
      f += ls[l].count * r[l][c].flops;
      for (int v = 0; v < 3; v++)
        t[v] += ls[l].count * r[l][c].t[v];
    }
  printf("%5s step: %-7s ms/step  %8.1f %8.1f %8.1f %6.2f %6.2f   (GFLOP/s %.1f %.1f %.1f)\n", set, what,
         t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[0] / t[1], t[1] / t[2], f / t[0] * 1e-9, f / t[1] * 1e-9,
         f / t[2] * 1e-9);
}

static void run_set(bench_t *bn, const char *set, const layer_t *ls, int nl) {
  result_t r[8][3];
  for (int l = 0; l < nl; l++)
    for (int c = 0; c < 3; c++)
      r[l][c] = run_case(bn, set, &ls[l], &CASES[c]);
  print_total(set, "fwd", ls, nl, r, 1);
  print_total(set, "dx+dW", ls, nl, r, 6);
  print_total(set, "all", ls, nl, r, 7);
}

int main(int argc, char **argv) {
  const char *set = "all";
  long reps = 5, threads = 2;
  for (int i = 1; i < argc; i++) {
    if (!strncmp(argv[i], "set=", 4)) set = argv[i] + 4;
    else if (!strncmp(argv[i], "reps=", 5)) reps = strtol(argv[i] + 5, NULL, 10);
    else if (!strncmp(argv[i], "threads=", 8)) threads = strtol(argv[i] + 8, NULL, 10);
    else {
      fprintf(stderr, "usage: gemm_bench [set=256|1024|all] [reps=N] [threads=T]\n");
      return 2;
    }
  }
  if (reps < 1 || reps > 64 || threads < 1) {
    fprintf(stderr, "gemm_bench: reps must be in [1, 64] and threads >= 1\n");
    return 2;
  }
  bench_t bn = {.nt = (int)threads, .reps = (int)reps};
  /* all threading is OpenMP's; oneDNN (OpenMP runtime) takes its thread count from
   * omp_get_max_threads(), the blocked sgemm from num_threads() */
  openblas_set_num_threads(1);
  omp_set_num_threads(bn.nt);
  printf("# gemm_bench: threads=%d reps=%d (median), GFLOP/s = 2mnk / time\n", bn.nt, bn.reps);
  const char *core = openblas_get_corename();
  printf("# openblas: %s (core %s)\n", openblas_get_config(), core);
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && !strstr(core, "kylake") && !strstr(core, "ooperlake") &&
      !strstr(core, "apphire"))
    printf("# warning: this cpu has AVX-512 but OpenBLAS runs its %s kernels (a cpu model its DYNAMIC_ARCH table "
           "does not know); OPENBLAS_CORETYPE=SkylakeX selects the AVX-512 ones\n",
           core);
#ifdef MESHRUN_HAVE_DNNL
  const dnnl_version_t *ver = dnnl_version();
  printf("# onednn: %d.%d.%d, effective isa 0x%x\n", ver->major, ver->minor, ver->patch,
         (unsigned)dnnl_get_effective_cpu_isa());
  if (dnnl_engine_create(&bn.engine, dnnl_cpu, 0) != dnnl_success ||
      dnnl_stream_create(&bn.stream, bn.engine, dnnl_stream_default_flags) != dnnl_success) {
    fprintf(stderr, "gemm_bench: cannot create the oneDNN cpu engine/stream\n");
    return 1;
  }
#else
  printf("# onednn: not built in (no dnnl.h): column (c) is nan\n");
#endif
  {
    /* about half a second of sgemm first: clock speed and OpenBLAS's per-thread buffers settle
     * before the first row is timed */
    int w = 1024;
    float *x = xmalloc((size_t)w * w * 4), *y = xmalloc((size_t)w * w * 4);
    for (size_t i = 0; i < (size_t)w * w; i++)
      x[i] = urand();
    for (double t0 = now_s(); now_s() - t0 < 0.5;)
      mm_f32(bn.nt, y, x, x, w, w, w, 0, 1, 1.0f, 0.0f);
    free(x), free(y);
  }
  printf("#  set layer     case        m      n      k  cnt c     fp32(a) widen(b)  dnnl(c)    b/a    c/b  rel(b,c)   "
         "err(b)   err(c)  dnnl impl\n");
  printf("#                                                      GFLOP/s  GFLOP/s  GFLOP/s\n");
  if (!strcmp(set, "256") || !strcmp(set, "all")) run_set(&bn, "256", SET256, 4);
  if (!strcmp(set, "1024") || !strcmp(set, "all")) run_set(&bn, "1024", SET1024, 4);
#ifdef MESHRUN_HAVE_DNNL
  dnnl_stream_destroy(bn.stream);
  dnnl_engine_destroy(bn.engine);
#endif
  return 0;
}
