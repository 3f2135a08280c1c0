// deps: trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/backend_cuda.cu common/env.c trainer/backend/fatal.c common/err.c
/* test_backend_cuda: every kernel of the cuda backend against the cpu backend on the same
 * random inputs, in fp32 and in bf16, and the cuda kernels' determinism (the same inputs twice
 * give the same bits).
 *
 * fp32 tensors: the error is max |cuda - cpu| / max |cpu| over the elements (relative to the
 * tensor's scale, so near-zero elements do not dominate), printed for every tensor. Tolerances:
 * 1e-5 for fp32 kernels; 0 where both backends do the same roundings in the same order (add,
 * scale, embedding); 1e-6 for RoPE (the same roundings, but cos/sin tables from two math
 * libraries may differ in a last bit); 1e-10 for sumsq and sumsq_groups (double sums, other
 * order); 0 for step_loss, clip_scale, adamw_multi_dev and uploads (test_step_stats,
 * test_uploads: the same operations in the same order, or copies); 5e-3 for
 * matmuls with TF32 allowed (inputs rounded to a 10-bit mantissa, about 5e-4 each, over k
 * products of uniform inputs). The fused entries (qkv_rope_*, add_rmsnorm_fwd) are also held to
 * the unfused cuda calls they replace: the same bits.
 *
 * bf16 (dt = DT_BF16): both backends read the same bf16 inputs (random values rounded to bf16),
 * widen them, compute in fp32 and round once per store, so their fp32 intermediates differ only
 * as the fp32 kernels do (summation order, exp implementations), and one rounding to bf16 can
 * turn a tiny fp32 difference into one bf16 ulp when it straddles a rounding boundary. A bf16
 * element therefore passes when |cuda - cpu| <= 2 ulp(cpu) + floor, with ulp the bf16 spacing
 * at |cpu| (2^-8 to 2^-7 relative) and floor = the fp32 kernel's tolerance above times max|cpu|
 * over the tensor (for values near zero, or results of cancellation, where the fp32 difference
 * exceeds an ulp of the result). Printed: max |diff|, max ulps, elements that differ in bits.
 * fp32 outputs of bf16 calls (rmsnorm's rstd and dw, attention's lse, the losses, embedding's
 * dtable) keep the fp32 criterion and tolerance of their fp32 kernel: their inputs are the same
 * bf16 values on both sides. Exact (0) where both do the same fp32 operation and the same
 * rounding: add (one fp32 add, one rounding), embedding (copies; dtable adds in position order
 * in both), convert (against trainer/backend/bf16.h itself), and AdamW's bf16 copy must be the rounding
 * of the fp32 parameter it wrote. bf16 matmuls run on tensor cores with fp32 accumulation whose
 * order and intermediate rounding are cuBLASLt's (not IEEE sequential sums): floor 1e-4 x
 * max|cpu| for the fp32 part of the error, with k up to 4096.
 *
 * Accumulating kernels start from random gradients, so that "+=" is checked too. First, what the
 * registry and the backend report of the device (test_device). Needs a GPU: with none visible it
 * prints the backend's message and exits 1. */
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

#include <cuda_runtime.h>

#include "trainer/backend/backend.h"
#include "trainer/backend/bf16.h"

#define TOL_FP32 1e-5
#define TOL_TF32 5e-3
#define TOL_BF16_MM 1e-4 /* fp32 part of a bf16 tensor-core product's error, x max|ref| */
#define BF16_ULPS 2      /* rounding part of a bf16 output's error */

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

/* A tensor of dt on both backends, with the host values it was filled from. */
typedef struct {
  size_t n;
  dtype_t dt;
  void *host; /* initial values, n elements of dt */
  void *c;    /* cpu backend (host memory) */
  void *g;    /* cuda backend */
} pair_t;

static size_t pair_bytes(const pair_t *p) { return p->n * dtype_size(p->dt); }
/* element i of the cpu or cuda copy (offsets in elements of the pair's dtype) */
static void *on_cpu(const pair_t *p, size_t i) { return (char *)p->c + i * dtype_size(p->dt); }
static void *on_gpu(const pair_t *p, size_t i) { return (char *)p->g + i * dtype_size(p->dt); }
static double value(const void *base, dtype_t dt, size_t i) {
  return dt == DT_BF16 ? (double)bf16_to_f32(((const bf16_t *)base)[i]) : (double)((const float *)base)[i];
}

static void pair_reset(pair_t *p) {
  cpu->to_device(cpu, p->c, p->host, pair_bytes(p));
  gpu->to_device(gpu, p->g, p->host, pair_bytes(p));
}

/* uniform values in [lo, hi), rounded to bf16 for DT_BF16 */
static pair_t pair_new_dt(size_t n, float lo, float hi, dtype_t dt) {
  size_t es = dtype_size(dt);
  pair_t p = {n, dt, malloc((n + 1) * es), cpu->alloc(cpu, n * es), gpu->alloc(gpu, n * es)};
  assert_non_null(p.host);
  assert_non_null(p.c);
  assert_non_null(p.g);
  for (size_t i = 0; i < n; i++) {
    float x = rng_uniform(lo, hi);
    if (dt == DT_BF16) ((bf16_t *)p.host)[i] = bf16_from_f32(x);
    else ((float *)p.host)[i] = x;
  }
  pair_reset(&p);
  return p;
}
static pair_t pair_new(size_t n, float lo, float hi) { return pair_new_dt(n, lo, hi, DT_F32); }

static void pair_free(pair_t *p) {
  free(p->host);
  cpu->free(cpu, p->c);
  gpu->free(gpu, p->g);
  memset(p, 0, sizeof *p);
}

/* the cuda copy's raw elements, in host memory */
static void *pair_fetch(const pair_t *p) {
  void *h = malloc(pair_bytes(p) + 1);
  assert_non_null(h);
  gpu->to_host(gpu, h, p->g, pair_bytes(p));
  return h;
}

/* The bf16 spacing at |x|: 2^(e-7) for |x| in [2^e, 2^(e+1)), 2^-133 among subnormals. */
static double bf16_ulp(double x) {
  int e;
  if (x == 0.0 || !isfinite(x)) return ldexp(1.0, -133);
  frexp(fabs(x), &e); /* |x| = f 2^e, f in [0.5, 1) */
  return ldexp(1.0, (e - 1 < -126 ? -126 : e - 1) - 7);
}

/* bf16: each element within BF16_ULPS ulps of the cpu value plus floor_rel * max|cpu|. */
static void pair_check_bf16(const char *what, const pair_t *p, double floor_rel) {
  bf16_t *h = pair_fetch(p);
  const bf16_t *r = p->c;
  double maxref = 0.0, maxdiff = 0.0, maxulps = 0.0;
  size_t nonfinite = 0, outside = 0, differ = 0, worst = 0;
  for (size_t i = 0; i < p->n; i++) maxref = fmax(maxref, fabs((double)bf16_to_f32(r[i])));
  double floor = floor_rel * maxref;
  for (size_t i = 0; i < p->n; i++) {
    double g = bf16_to_f32(h[i]), c = bf16_to_f32(r[i]), d = fabs(g - c), u = bf16_ulp(c);
    if (!isfinite(g)) nonfinite++;
    differ += h[i] != r[i];
    if (d > maxdiff) maxdiff = d;
    if (fabs(c) > floor && d / u > maxulps) maxulps = d / u; /* ulps only where they mean something */
    if (!(d <= BF16_ULPS * u + floor)) {
      if (!outside) worst = i;
      outside++;
    }
  }
  printf("  %-44s bf16 max|diff| %.3e  max|ref| %.3e  max %.2f ulps  %zu of %zu differ in bits "
         "(tolerance %d ulps + %.0e max|ref|)%s\n",
         what, maxdiff, maxref, maxulps, differ, p->n, BF16_ULPS, floor_rel, nonfinite ? "  NON-FINITE VALUES" : "");
  if (outside)
    printf("    %zu outside the tolerance, first at %zu: cuda %.9g cpu %.9g\n", outside, worst,
           (double)bf16_to_f32(h[worst]), (double)bf16_to_f32(r[worst]));
  free(h);
  assert_int_equal(nonfinite, 0);
  assert_int_equal(outside, 0);
}

/* Prints and checks the error of p (cuda against cpu): fp32 relative to max|cpu| within tol,
 * bf16 within BF16_ULPS ulps + tol * max|cpu| (the file's top comment says why). */
static void pair_check(const char *what, const pair_t *p, double tol) {
  if (p->dt == DT_BF16) {
    pair_check_bf16(what, p, tol);
    return;
  }
  float *h = pair_fetch(p);
  const float *c = p->c;
  double maxref = 0.0, maxdiff = 0.0;
  size_t worst = 0, bad = 0;
  for (size_t i = 0; i < p->n; i++) {
    double r = c[i], d = fabs((double)h[i] - r);
    if (!isfinite(h[i])) bad++;
    if (fabs(r) > maxref) maxref = fabs(r);
    if (d > maxdiff) maxdiff = d, worst = i;
  }
  double rel = maxref > 0.0 ? maxdiff / maxref : maxdiff;
  printf("  %-44s max|diff| %.3e  max|ref| %.3e  rel %.3e (tolerance %.0e)%s\n", what, maxdiff, maxref, rel, tol,
         bad ? "  NON-FINITE VALUES" : "");
  if (rel > tol || bad)
    printf("    worst at %zu: cuda %.9g cpu %.9g\n", worst, (double)h[worst], (double)c[worst]);
  free(h);
  assert_int_equal(bad, 0);
  assert_true(rel <= tol);
}

/* The same bits on both backends (tolerance 0), any dtype. */
static void pair_check_bits(const char *what, const pair_t *p) {
  unsigned char *h = pair_fetch(p);
  size_t es = dtype_size(p->dt), differ = 0, first = 0;
  for (size_t i = 0; i < p->n; i++)
    if (memcmp(h + i * es, (const unsigned char *)p->c + i * es, es) != 0) {
      if (!differ) first = i;
      differ++;
    }
  printf("  %-44s %s: %zu of %zu elements differ in bits (tolerance 0)\n", what, dtype_name(p->dt), differ, p->n);
  if (differ)
    printf("    first at %zu: cuda %.9g cpu %.9g\n", first, value(h, p->dt, first), value(p->c, p->dt, first));
  free(h);
  assert_int_equal(differ, 0);
}

/* Determinism: snapshot p's cuda values, to compare with a rerun. */
static void *snap(const pair_t *p) { return pair_fetch(p); }
static void check_same_bits(const char *what, const pair_t *p, void *before) {
  unsigned char *after = pair_fetch(p);
  size_t es = dtype_size(p->dt), diff = 0;
  for (size_t i = 0; i < p->n; i++) diff += memcmp((unsigned char *)before + i * es, after + i * es, es) != 0;
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

/* a and b of ab, c of cd; offset shifts every pointer by that many elements (cuBLASLt must cope
 * with 4-byte fp32 and 2-byte bf16 alignment) */
/* A bf16 accumulation (bf16 output, beta != 0) may round alpha op(a)op(b) to bf16 before it adds
 * beta c, as cuBLASLt's epilogue does for some shapes (an H200 gave m=128 n=256 k=64 alpha 0.5
 * beta 1 results one ulp off at |x| in [4, 8); docs/gpu.md) and as PyTorch's bf16 addmm does.
 * backend.h allows it: such an element passes when it is within the once-rounded tolerance plus
 * one bf16 ulp of the larger term, max(|alpha ab|, |beta c|). Printed: how many elements needed
 * that extra ulp, and how many lie outside even so (must be 0). */
static void matmul_bf16_acc_check(const char *what, const pair_t *a, const pair_t *b, const pair_t *c, int m, int n,
                                  int k, int ta, int tb, float alpha, float beta, int offset, double tol) {
  size_t mn = (size_t)m * n;
  float *prod = cpu->alloc(cpu, mn * sizeof(float));
  assert_non_null(prod);
  cpu->matmul(cpu, prod, on_cpu(a, offset), on_cpu(b, offset), m, n, k, ta, tb, alpha, 0.0f, DT_BF16, DT_F32);
  bf16_t *g = pair_fetch(c);
  const bf16_t *r = (const bf16_t *)c->c + offset, *c0 = (const bf16_t *)c->host + offset;
  double maxref = 0.0, maxdiff = 0.0;
  for (size_t i = 0; i < mn; i++) maxref = fmax(maxref, fabs((double)bf16_to_f32(r[i])));
  size_t once = 0, outside = 0, nonfinite = 0, worst = 0;
  for (size_t i = 0; i < mn; i++) {
    double gv = bf16_to_f32(g[offset + i]), cv = bf16_to_f32(r[i]), d = fabs(gv - cv);
    double lim = BF16_ULPS * bf16_ulp(cv) + tol * maxref;
    if (!isfinite(gv)) nonfinite++;
    if (d > maxdiff) maxdiff = d;
    if (d <= lim) continue;
    once++;
    double big = fmax(fabs((double)prod[i]), fabs((double)beta * bf16_to_f32(c0[i])));
    if (!(d <= lim + bf16_ulp(big)) && !outside++) worst = i;
  }
  printf("  %-44s bf16 max|diff| %.3e  max|ref| %.3e  %zu of %zu past the once-rounded tolerance (%d ulps + "
         "%.0e max|ref|), %zu past one more ulp of the larger term (tolerance 0)%s\n",
         what, maxdiff, maxref, once, mn, BF16_ULPS, tol, outside, nonfinite ? "  NON-FINITE VALUES" : "");
  if (outside)
    printf("    first at %zu: cuda %.9g cpu %.9g\n", worst, (double)bf16_to_f32(g[offset + worst]),
           (double)bf16_to_f32(r[worst]));
  free(g);
  cpu->free(cpu, prod);
  assert_int_equal(nonfinite, 0);
  assert_int_equal(outside, 0);
}

static void matmul_case(int m, int n, int k, int ta, int tb, float alpha, float beta, int offset, double tol, dtype_t ab,
                        dtype_t cd) {
  pair_t a = pair_new_dt((size_t)m * k + offset, -1.0f, 1.0f, ab), b = pair_new_dt((size_t)k * n + offset, -1.0f, 1.0f, ab);
  pair_t c = pair_new_dt((size_t)m * n + offset, -1.0f, 1.0f, cd);
  cpu->matmul(cpu, on_cpu(&c, offset), on_cpu(&a, offset), on_cpu(&b, offset), m, n, k, ta, tb, alpha, beta, ab, cd);
  gpu->matmul(gpu, on_gpu(&c, offset), on_gpu(&a, offset), on_gpu(&b, offset), m, n, k, ta, tb, alpha, beta, ab, cd);
  char what[112];
  snprintf(what, sizeof what, "matmul %s->%s m=%d n=%d k=%d ta=%d tb=%d a=%.1f b=%.1f +%d", dtype_name(ab),
           dtype_name(cd), m, n, k, ta, tb, alpha, beta, offset);
  if (cd == DT_BF16 && beta != 0.0f) matmul_bf16_acc_check(what, &a, &b, &c, m, n, k, ta, tb, alpha, beta, offset, tol);
  else pair_check(what, &c, tol);
  void *first = snap(&c);
  pair_reset(&c);
  gpu->matmul(gpu, on_gpu(&c, offset), on_gpu(&a, offset), on_gpu(&b, offset), m, n, k, ta, tb, alpha, beta, ab, cd);
  check_same_bits(what, &c, first);
  pair_free(&a);
  pair_free(&b);
  pair_free(&c);
}

static const int mm_shapes[][3] = {{1, 1, 1}, {37, 53, 71}, {128, 256, 64}, {300, 200, 500}, {64, 1000, 16}, {8, 8, 4096}};

/* every shape, transposition and beta of one dtype combination, and the empty product */
static void matmul_combo(dtype_t ab, dtype_t cd, double tol) {
  for (size_t s = 0; s < sizeof mm_shapes / sizeof mm_shapes[0]; s++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++) {
        matmul_case(mm_shapes[s][0], mm_shapes[s][1], mm_shapes[s][2], ta, tb, 1.0f, 0.0f, 0, tol, ab, cd);
        matmul_case(mm_shapes[s][0], mm_shapes[s][1], mm_shapes[s][2], ta, tb, 0.5f, 1.0f, 0, tol, ab, cd);
      }
  matmul_case(5, 7, 0, 0, 1, 1.0f, 0.5f, 0, tol, ab, cd); /* empty product: c = beta c */
}

/* What the registry and the backend say about the device: the cuda entry counts the GPUs that
 * CUDA numbers (its count is common/gpus.h's, the one meshrun makes for --nproc_per_node=gpu,
 * from /dev and CUDA_VISIBLE_DEVICES), and the backend knows the peak FLOP/s of the GPUs in its
 * table (checked on H100 and H200, printed on any). */
static void test_device(void **state) {
  const backend_entry_t *e = backend_find("cuda");
  assert_non_null(e);
  assert_non_null(e->visible_devices);
  int count = 0;
  assert_int_equal(cudaGetDeviceCount(&count), cudaSuccess);
  printf("  GPUs: %d counted from /dev and CUDA_VISIBLE_DEVICES, %d by cudaGetDeviceCount\n", e->visible_devices(),
         count);
  assert_int_equal(e->visible_devices(), count);
  assert_non_null(gpu->peak_flops);
  const double bf16 = gpu->peak_flops(gpu, DT_BF16), tf32 = gpu->peak_flops(gpu, DT_F32);
  printf("  %s: peak %.0f TFLOP/s bf16, %.0f tf32 (0: not in the backend's table)\n", gpu->device, bf16 / 1e12,
         tf32 / 1e12);
  if (strstr(gpu->device, "H100") || strstr(gpu->device, "H200")) assert_true(bf16 > 0 && tf32 > 0);
}

static void test_matmul(void **state) {
  matmul_combo(DT_F32, DT_F32, TOL_FP32);
  matmul_case(37, 53, 71, 0, 1, 1.0f, 1.0f, 1, TOL_FP32, DT_F32, DT_F32);
  matmul_case(256, 128, 512, 1, 0, 1.0f, 1.0f, 3, TOL_FP32, DT_F32, DT_F32);
  printf("  with TF32 allowed:\n");
  gpu->set_tf32(gpu, 1);
  matmul_case(300, 200, 500, 0, 1, 1.0f, 0.0f, 0, TOL_TF32, DT_F32, DT_F32);
  matmul_case(512, 512, 1024, 0, 0, 1.0f, 1.0f, 0, TOL_TF32, DT_F32, DT_F32);
  matmul_case(256, 384, 2048, 1, 0, 1.0f, 1.0f, 0, TOL_TF32, DT_F32, DT_F32);
  gpu->set_tf32(gpu, 0);
}

/* (bf16, bf16) and (bf16, fp32). After the other kernels' tests: if cuBLASLt had no algorithm
 * for a bf16 shape, the backend's fatal path would end the process. */
static void test_matmul_bf16(void **state) {
  matmul_combo(DT_BF16, DT_BF16, TOL_BF16_MM);
  matmul_combo(DT_BF16, DT_F32, TOL_BF16_MM);
  printf("  with TF32 allowed (it concerns fp32 operands only):\n");
  gpu->set_tf32(gpu, 1);
  matmul_case(300, 200, 500, 0, 1, 1.0f, 1.0f, 0, TOL_BF16_MM, DT_BF16, DT_BF16);
  matmul_case(256, 384, 2048, 1, 0, 1.0f, 1.0f, 0, TOL_BF16_MM, DT_BF16, DT_F32);
  gpu->set_tf32(gpu, 0);
}

/* bf16 operands at odd element offsets (2-byte aligned pointers). Last in the run, for the same
 * reason as test_matmul_bf16. */
static void test_matmul_bf16_unaligned(void **state) {
  static const dtype_t outs[2] = {DT_BF16, DT_F32};
  for (int o = 0; o < 2; o++) {
    dtype_t ab = DT_BF16, cd = outs[o];
    matmul_case(37, 53, 71, 0, 1, 1.0f, 1.0f, 1, TOL_BF16_MM, ab, cd);
    matmul_case(256, 128, 512, 1, 0, 1.0f, 1.0f, 3, TOL_BF16_MM, ab, cd);
    matmul_case(64, 96, 128, 1, 1, 0.5f, 1.0f, 4, TOL_BF16_MM, ab, cd);
  }
}

/* ------------------------------------------------------------------ elementwise */

/* SwiGLU over rows of a and g side by side (ag (rows, 2f)); the backward writes dag, which
 * starts from other random values on each side. */
static void swiglu_case(int rows, int f, dtype_t dt) {
  char what[96];
  size_t n = (size_t)rows * f;
  pair_t ag = pair_new_dt(2 * n, -4.0f, 4.0f, dt), out = pair_new_dt(n, -1.0f, 1.0f, dt);
  cpu->swiglu_fwd(cpu, out.c, ag.c, rows, f, dt);
  gpu->swiglu_fwd(gpu, out.g, ag.g, rows, f, dt);
  snprintf(what, sizeof what, "swiglu_fwd %s rows=%d f=%d", dtype_name(dt), rows, f);
  pair_check(what, &out, TOL_FP32);
  pair_t dout = pair_new_dt(n, -1.0f, 1.0f, dt), dag = pair_new_dt(2 * n, -1.0f, 1.0f, dt);
  cpu->swiglu_bwd(cpu, dag.c, dout.c, ag.c, rows, f, dt);
  gpu->swiglu_bwd(gpu, dag.g, dout.g, ag.g, rows, f, dt);
  snprintf(what, sizeof what, "swiglu_bwd %s rows=%d f=%d dag (written)", dtype_name(dt), rows, f);
  pair_check(what, &dag, TOL_FP32);
  pair_free(&ag);
  pair_free(&out);
  pair_free(&dout);
  pair_free(&dag);
}

static void elementwise_case(dtype_t dt) {
  size_t n = 1000003;
  char what[96];
  pair_t a = pair_new_dt(n, -4.0f, 4.0f, dt), b = pair_new_dt(n, -4.0f, 4.0f, dt), out = pair_new_dt(n, -1.0f, 1.0f, dt);
  cpu->add(cpu, out.c, a.c, b.c, n, dt);
  gpu->add(gpu, out.g, a.g, b.g, n, dt);
  snprintf(what, sizeof what, "add %s", dtype_name(dt));
  if (dt == DT_BF16) pair_check_bits(what, &out); /* one fp32 add, one rounding: the same bits */
  else pair_check(what, &out, 0.0);
  cpu->add(cpu, a.c, a.c, b.c, n, dt); /* out aliasing a */
  gpu->add(gpu, a.g, a.g, b.g, n, dt);
  snprintf(what, sizeof what, "add in place %s", dtype_name(dt));
  if (dt == DT_BF16) pair_check_bits(what, &a);
  else pair_check(what, &a, 0.0);
  pair_free(&a);
  pair_free(&b);
  pair_free(&out);
  swiglu_case(977, 1024, dt); /* bf16: the 8-wide kernels */
  swiglu_case(999, 1001, dt); /* f not a multiple of 8: the plain ones */
}

static void test_elementwise(void **state) {
  size_t n = 1000003;
  elementwise_case(DT_F32);
  pair_t b = pair_new(n, -4.0f, 4.0f);
  cpu->scale(cpu, b.c, 0.37f, n);
  gpu->scale(gpu, b.g, 0.37f, n);
  pair_check("scale", &b, 0.0);
  pair_free(&b);

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
  /* sumsq_parts: each piece as sumsq gives it on the device (same bits), within 1e-10 of the cpu */
  pair_t x = pair_new(3000001, -3.0f, 3.0f);
  const size_t off[5] = {0, 5, 5, 4102, 1000000}, cnt[5] = {5, 0, 4097, 995898, 2000001};
  double pc[5], pg[5];
  cpu->sumsq_parts(cpu, x.c, off, cnt, 5, pc);
  gpu->sumsq_parts(gpu, x.g, off, cnt, 5, pg);
  for (int i = 0; i < 5; i++) {
    double one = gpu->sumsq(gpu, (const float *)x.g + off[i], cnt[i]);
    double rel = pc[i] > 0 ? fabs(pg[i] - pc[i]) / pc[i] : fabs(pg[i]);
    printf("  sumsq_parts piece %d n=%-8zu cuda %.17g cpu %.17g rel %.3e (tolerance 1e-10); as sumsq: %s\n", i,
           cnt[i], pg[i], pc[i], rel, memcmp(&one, &pg[i], sizeof one) ? "DIFFERS" : "same bits");
    assert_true(rel <= 1e-10);
    assert_memory_equal(&one, &pg[i], sizeof one);
  }
  pair_free(&x);
}

/* sumsq_parts_add: more pieces than one launch takes (SUMSQ_ADD_PIECES), empty and large ones,
 * called twice into the same sums (so the second launch finds the ticket reset and adds on):
 * each within 1e-10 of the cpu's; then a nan in one piece makes that piece's sum nan only. */
static void test_sumsq_parts_add(void **state) {
  enum { NP = SUMSQ_ADD_PIECES + 4 };
  pair_t x = pair_new(2000003, -3.0f, 3.0f);
  size_t off[NP], cnt[NP], at = 0;
  for (int i = 0; i < NP; i++) {
    cnt[i] = i == 3 ? 0 : i == 7 ? 1000000 : (size_t)(1 + 4099 * i);
    off[i] = at;
    at += cnt[i];
  }
  assert_true(at <= x.n);
  double hc[NP] = {0}, hg[NP];
  double *dg = gpu->alloc(gpu, NP * sizeof(double));
  assert_non_null(dg);
  for (int k = 0; k < 2; k++) {
    cpu->sumsq_parts_add(cpu, x.c, off, cnt, NP, hc);
    gpu->sumsq_parts_add(gpu, x.g, off, cnt, NP, dg);
  }
  gpu->to_host(gpu, hg, dg, sizeof hg);
  double worst = 0.0;
  for (int i = 0; i < NP; i++) {
    const double rel = hc[i] > 0 ? fabs(hg[i] - hc[i]) / hc[i] : fabs(hg[i]);
    worst = rel > worst ? rel : worst;
  }
  printf("  sumsq_parts_add, %d pieces twice: worst rel %.3e against the cpu (tolerance 1e-10); piece 7 cuda %.17g "
         "cpu %.17g\n", NP, worst, hg[7], hc[7]);
  assert_true(worst <= 1e-10);
  const float nan = NAN;
  gpu->to_device(gpu, (float *)x.g + off[9] + 5, &nan, sizeof nan);
  gpu->zero(gpu, dg, NP * sizeof(double));
  gpu->sumsq_parts_add(gpu, x.g, off, cnt, NP, dg);
  gpu->to_host(gpu, hg, dg, sizeof hg);
  int bad = 0;
  for (int i = 0; i < NP; i++) bad += !isfinite(hg[i]) != (i == 9);
  printf("  sumsq_parts_add with a nan in piece 9: %d pieces wrong (piece 9: %g)\n", bad, hg[9]);
  assert_int_equal(bad, 0);
  gpu->free(gpu, dg);
  pair_free(&x);
}

static void test_elementwise_bf16(void **state) { elementwise_case(DT_BF16); }

/* ------------------------------------------------------------------ convert */

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* fp32 -> bf16 against trainer/backend/bf16.h bit for bit (a NaN only as a NaN: CUDA writes the
 * canonical quiet NaN, bf16.h keeps the payload), bf16 -> fp32 exact, and same-dtype copies. */
static void test_convert(void **state) {
  const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX,
                           from_bits(0x7f7f0000u) /* the largest bf16 */,
                           from_bits(0x7f7f8000u) /* halfway to infinity: rounds to it (even) */,
                           from_bits(0x7f7f7fffu) /* just below: the largest bf16 */,
                           from_bits(0x3f808000u) /* 1 + 2^-8, a tie: to even, 1 */,
                           from_bits(0x3f818000u) /* 1 + 3 2^-8, a tie: to even, up */,
                           from_bits(0x3f808001u) /* just past a tie: up */,
                           from_bits(0x3f807fffu) /* just before a tie: down */,
                           from_bits(0x00000001u) /* the smallest subnormal: to 0 */,
                           from_bits(0x00018000u) /* a subnormal tie */, -FLT_MIN, 1e-40f, 65504.0f, 0.1f, -2.5e7f};
  size_t ns = sizeof special / sizeof special[0], n = 300007;
  float *src = malloc(n * sizeof(float)), *back = malloc(n * sizeof(float));
  bf16_t *lp = malloc(n * sizeof(bf16_t)), *lp2 = malloc(n * sizeof(bf16_t));
  assert_non_null(src);
  assert_non_null(back);
  assert_non_null(lp);
  assert_non_null(lp2);
  for (size_t i = 0; i < n; i++) {
    if (i < ns) src[i] = special[i];
    else if (i % 3 == 0) src[i] = rng_uniform(-1e4f, 1e4f);
    else {
      /* random bit patterns (every exponent and low half; non-finite ones made finite) */
      src[i] = from_bits((uint32_t)(rng_next() >> 32));
      if (!isfinite(src[i])) src[i] = 1.5f;
    }
  }
  float *g32 = gpu->alloc(gpu, n * sizeof(float)), *g32b = gpu->alloc(gpu, n * sizeof(float));
  void *g16 = gpu->alloc(gpu, n * sizeof(bf16_t)), *g16b = gpu->alloc(gpu, n * sizeof(bf16_t));
  assert_non_null(g32);
  assert_non_null(g32b);
  assert_non_null(g16);
  assert_non_null(g16b);
  gpu->to_device(gpu, g32, src, n * sizeof(float));

  gpu->convert(gpu, g16, DT_BF16, g32, DT_F32, n);
  gpu->to_host(gpu, lp, g16, n * sizeof(bf16_t));
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    bf16_t want = bf16_from_f32(src[i]);
    int ok = isnan(src[i]) ? isnan(bf16_to_f32(lp[i])) : lp[i] == want;
    if (!ok && !wrong++) first = i;
  }
  printf("  convert fp32 -> bf16 (%zu values, %zu special): %zu differ from bf16.h's rounding (tolerance 0)\n", n, ns,
         wrong);
  if (wrong)
    printf("    first at %zu: %.9g -> cuda 0x%04x, bf16.h 0x%04x\n", first, (double)src[first], lp[first],
           bf16_from_f32(src[first]));
  assert_int_equal(wrong, 0);

  gpu->convert(gpu, g32b, DT_F32, g16, DT_BF16, n);
  gpu->to_host(gpu, back, g32b, n * sizeof(float));
  wrong = 0;
  for (size_t i = 0; i < n; i++) {
    float want = bf16_to_f32(lp[i]);
    int ok = isnan(want) ? isnan(back[i]) : memcmp(&want, &back[i], sizeof want) == 0;
    if (!ok && !wrong++) first = i;
  }
  printf("  convert bf16 -> fp32: %zu differ from the exact widening (tolerance 0)\n", wrong);
  if (wrong) printf("    first at %zu: 0x%04x -> cuda %.9g\n", first, lp[first], (double)back[first]);
  assert_int_equal(wrong, 0);

  gpu->convert(gpu, g16b, DT_BF16, g16, DT_BF16, n);
  gpu->to_host(gpu, lp2, g16b, n * sizeof(bf16_t));
  gpu->convert(gpu, g32b, DT_F32, g32, DT_F32, n);
  gpu->to_host(gpu, back, g32b, n * sizeof(float));
  int same16 = memcmp(lp, lp2, n * sizeof(bf16_t)) == 0, same32 = memcmp(src, back, n * sizeof(float)) == 0;
  printf("  convert bf16 -> bf16, fp32 -> fp32: %s, %s (want copies)\n", same16 ? "same bits" : "DIFFER",
         same32 ? "same bits" : "DIFFER");
  assert_true(same16);
  assert_true(same32);
  gpu->free(gpu, g32);
  gpu->free(gpu, g32b);
  gpu->free(gpu, g16);
  gpu->free(gpu, g16b);
  free(src);
  free(back);
  free(lp);
  free(lp2);
}

/* ------------------------------------------------------------------ embedding */

static void embedding_case(dtype_t dt) {
  int n = 3000, c = 96, rows = 50, vocab_start = 10;
  char what[96];
  ids_t tok = ids_new((size_t)n, 0, 70); /* some below vocab_start, some past it + rows, many repeats */
  tok.host[0] = -1;
  ids_upload(&tok);
  pair_t table = pair_new_dt((size_t)rows * c, -1.0f, 1.0f, dt);
  pair_t out = pair_new_dt((size_t)n * c, 5.0f, 6.0f, dt); /* garbage that must be overwritten */
  cpu->embedding_fwd(cpu, out.c, table.c, tok.c, n, c, vocab_start, rows, dt);
  gpu->embedding_fwd(gpu, out.g, table.g, tok.g, n, c, vocab_start, rows, dt);
  snprintf(what, sizeof what, "embedding_fwd %s", dtype_name(dt));
  pair_check_bits(what, &out);

  /* dtable is fp32 whatever dt is (a parameter gradient) */
  pair_t dout = pair_new_dt((size_t)n * c, -1.0f, 1.0f, dt), dtable = pair_new((size_t)rows * c, -1.0f, 1.0f);
  cpu->embedding_bwd(cpu, dtable.c, dout.c, tok.c, n, c, vocab_start, rows, dt);
  gpu->embedding_bwd(gpu, dtable.g, dout.g, tok.g, n, c, vocab_start, rows, dt);
  snprintf(what, sizeof what, "embedding_bwd %s (position order, as cpu)", dtype_name(dt));
  pair_check(what, &dtable, 0.0);
  void *first = snap(&dtable);
  pair_reset(&dtable);
  gpu->embedding_bwd(gpu, dtable.g, dout.g, tok.g, n, c, vocab_start, rows, dt);
  check_same_bits("embedding_bwd", &dtable, first);
  ids_free(&tok);
  pair_free(&table);
  pair_free(&out);
  pair_free(&dout);
  pair_free(&dtable);
}

static void test_embedding(void **state) { embedding_case(DT_F32); }
static void test_embedding_bf16(void **state) { embedding_case(DT_BF16); }

/* ------------------------------------------------------------------ RMSNorm */

static void rmsnorm_case(int n, int c, dtype_t dt) {
  char what[96];
  const char *dn = dtype_name(dt);
  pair_t x = pair_new_dt((size_t)n * c, -2.0f, 2.0f, dt), w = pair_new_dt((size_t)c, 0.5f, 1.5f, dt);
  pair_t out = pair_new_dt((size_t)n * c, 0.0f, 1.0f, dt), rstd = pair_new((size_t)n, 0.0f, 1.0f);
  cpu->rmsnorm_fwd(cpu, out.c, rstd.c, x.c, w.c, n, c, 1e-5f, dt);
  gpu->rmsnorm_fwd(gpu, out.g, rstd.g, x.g, w.g, n, c, 1e-5f, dt);
  snprintf(what, sizeof what, "rmsnorm_fwd %s n=%d c=%d out", dn, n, c);
  pair_check(what, &out, TOL_FP32);
  snprintf(what, sizeof what, "rmsnorm_fwd %s n=%d c=%d rstd", dn, n, c);
  pair_check(what, &rstd, TOL_FP32);

  /* the backward from the cpu's rstd on both, so that only the backward is compared; dw fp32 */
  gpu->to_device(gpu, rstd.g, rstd.c, (size_t)n * sizeof(float));
  pair_t dout = pair_new_dt((size_t)n * c, -1.0f, 1.0f, dt), dx = pair_new_dt((size_t)n * c, -1.0f, 1.0f, dt);
  pair_t dw = pair_new((size_t)c, -1.0f, 1.0f);
  cpu->rmsnorm_bwd(cpu, dx.c, dw.c, dout.c, x.c, w.c, rstd.c, n, c, dt);
  gpu->rmsnorm_bwd(gpu, dx.g, dw.g, dout.g, x.g, w.g, rstd.g, n, c, dt);
  snprintf(what, sizeof what, "rmsnorm_bwd %s n=%d c=%d dx", dn, n, c);
  pair_check(what, &dx, TOL_FP32);
  snprintf(what, sizeof what, "rmsnorm_bwd %s n=%d c=%d dw", dn, n, c);
  pair_check(what, &dw, TOL_FP32);
  void *fdx = snap(&dx), *fdw = snap(&dw);
  pair_reset(&dx);
  pair_reset(&dw);
  gpu->rmsnorm_bwd(gpu, dx.g, dw.g, dout.g, x.g, w.g, rstd.g, n, c, dt);
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
  rmsnorm_case(67, 300, DT_F32);
  rmsnorm_case(600, 1024, DT_F32); /* more rows than the backward's partial rows */
  rmsnorm_case(3, 4096, DT_F32);
}

static void test_rmsnorm_bf16(void **state) {
  rmsnorm_case(67, 300, DT_BF16);
  rmsnorm_case(600, 1024, DT_BF16);
  rmsnorm_case(3, 4096, DT_BF16);
}

/* ------------------------------------------------------------------ RoPE */

static void test_rope(void **state) {
  int b = 2, t = 37, h = 3, d = 64;
  pair_t x = pair_new((size_t)b * t * h * d, -1.0f, 1.0f);
  cpu->rope_fwd(cpu, x.c, b, t, h, d, 5, 10000.0f, DT_F32);
  gpu->rope_fwd(gpu, x.g, b, t, h, d, 5, 10000.0f, DT_F32);
  pair_check("rope_fwd (offset 5, theta 1e4)", &x, 1e-6);
  cpu->rope_bwd(cpu, x.c, b, t, h, d, 5, 10000.0f, DT_F32);
  gpu->rope_bwd(gpu, x.g, b, t, h, d, 5, 10000.0f, DT_F32);
  pair_check("rope_bwd", &x, 1e-6);
  float *back = pair_fetch(&x);
  const float *init = x.host;
  double maxd = 0.0;
  for (size_t i = 0; i < x.n; i++) maxd = fmax(maxd, fabs((double)back[i] - init[i]));
  printf("  rope_bwd(rope_fwd(x)) - x: max|diff| %.3e (tolerance 1e-6)\n", maxd);
  free(back);
  assert_true(maxd <= 1e-6);
  /* another shape and theta: the cached table must be rebuilt */
  pair_t y = pair_new((size_t)1 * 100 * 2 * 128, -1.0f, 1.0f);
  cpu->rope_fwd(cpu, y.c, 1, 100, 2, 128, 0, 500000.0f, DT_F32);
  gpu->rope_fwd(gpu, y.g, 1, 100, 2, 128, 0, 500000.0f, DT_F32);
  pair_check("rope_fwd (t 100, d 128, theta 5e5)", &y, 1e-6);
  pair_free(&x);
  pair_free(&y);
}

/* bf16 in place: each rotation widens, rotates in fp32 with the same roundings as the fp32
 * kernel and rounds once, so the fp32 tolerance (1e-6, the tables) is the floor. */
static void test_rope_bf16(void **state) {
  int b = 2, t = 37, h = 3, d = 64;
  pair_t x = pair_new_dt((size_t)b * t * h * d, -1.0f, 1.0f, DT_BF16);
  cpu->rope_fwd(cpu, x.c, b, t, h, d, 5, 10000.0f, DT_BF16);
  gpu->rope_fwd(gpu, x.g, b, t, h, d, 5, 10000.0f, DT_BF16);
  pair_check("rope_fwd bf16 (offset 5, theta 1e4)", &x, 1e-6);
  pair_reset(&x); /* the backward from the same inputs on both */
  cpu->rope_bwd(cpu, x.c, b, t, h, d, 5, 10000.0f, DT_BF16);
  gpu->rope_bwd(gpu, x.g, b, t, h, d, 5, 10000.0f, DT_BF16);
  pair_check("rope_bwd bf16", &x, 1e-6);
  pair_t y = pair_new_dt((size_t)1 * 100 * 2 * 128, -1.0f, 1.0f, DT_BF16);
  cpu->rope_fwd(cpu, y.c, 1, 100, 2, 128, 0, 500000.0f, DT_BF16);
  gpu->rope_fwd(gpu, y.g, 1, 100, 2, 128, 0, 500000.0f, DT_BF16);
  pair_check("rope_fwd bf16 (t 100, d 128, theta 5e5)", &y, 1e-6);
  pair_t z = pair_new_dt((size_t)1 * 9 * 2 * 12, -1.0f, 1.0f, DT_BF16); /* d 12: not the 8-wide kernel */
  cpu->rope_fwd(cpu, z.c, 1, 9, 2, 12, 0, 10000.0f, DT_BF16);
  gpu->rope_fwd(gpu, z.g, 1, 9, 2, 12, 0, 10000.0f, DT_BF16);
  pair_check("rope_fwd bf16 (t 9, d 12)", &z, 1e-6);
  pair_free(&x);
  pair_free(&y);
  pair_free(&z);
}

/* ------------------------------------------------------------------ fused entries */

/* Two cuda buffers of n dt elements: the same bits (a fused kernel against the calls it replaces). */
static void gpu_same_bits(const char *what, const void *x, const void *y, size_t n, dtype_t dt) {
  size_t es = dtype_size(dt), differ = 0;
  unsigned char *a = malloc(n * es + 1), *b = malloc(n * es + 1);
  assert_non_null(a);
  assert_non_null(b);
  gpu->to_host(gpu, a, x, n * es);
  gpu->to_host(gpu, b, y, n * es);
  for (size_t i = 0; i < n; i++) differ += memcmp(a + i * es, b + i * es, es) != 0;
  printf("  %-44s %s: %zu of %zu elements differ in bits from the unfused calls (tolerance 0)\n", what,
         dtype_name(dt), differ, n);
  free(a);
  free(b);
  assert_int_equal(differ, 0);
}

/* qkv_rope_fwd and qkv_rope_bwd: cuda against cpu (tolerance 1e-6, RoPE's: the same roundings
 * over cos/sin tables from two math libraries), and against the unfused cuda calls (columns
 * copied out with copy_2d, rope_fwd/rope_bwd on q and k): the same bits. */
static void qkv_rope_case(int b, int t, int h, int kv, int d, int pos, dtype_t dt) {
  char what[128];
  const size_t rows = (size_t)b * t, HD = (size_t)h * d, KD = (size_t)kv * d, W = HD + 2 * KD, es = dtype_size(dt);
  pair_t qkv = pair_new_dt(rows * W, -1.0f, 1.0f, dt), q = pair_new_dt(rows * HD, -1.0f, 1.0f, dt),
         k = pair_new_dt(rows * KD, -1.0f, 1.0f, dt), v = pair_new_dt(rows * KD, -1.0f, 1.0f, dt);
  cpu->qkv_rope_fwd(cpu, q.c, k.c, v.c, qkv.c, b, t, h, kv, d, pos, 10000.0f, dt);
  gpu->qkv_rope_fwd(gpu, q.g, k.g, v.g, qkv.g, b, t, h, kv, d, pos, 10000.0f, dt);
  snprintf(what, sizeof what, "qkv_rope_fwd b=%d t=%d h=%d kv=%d d=%d q", b, t, h, kv, d);
  pair_check(what, &q, 1e-6);
  pair_check("qkv_rope_fwd k", &k, 1e-6);
  pair_check("qkv_rope_fwd v (copied)", &v, 0.0);
  void *uq = gpu->alloc(gpu, rows * HD * es), *uk = gpu->alloc(gpu, rows * KD * es), *uw = gpu->alloc(gpu, rows * W * es);
  assert_non_null(uq);
  assert_non_null(uk);
  assert_non_null(uw);
  gpu->copy_2d(gpu, uq, (int)HD, qkv.g, (int)W, (int)rows, (int)HD, dt);
  gpu->copy_2d(gpu, uk, (int)KD, on_gpu(&qkv, HD), (int)W, (int)rows, (int)KD, dt);
  gpu->rope_fwd(gpu, uq, b, t, h, d, pos, 10000.0f, dt);
  gpu->rope_fwd(gpu, uk, b, t, kv, d, pos, 10000.0f, dt);
  gpu_same_bits("qkv_rope_fwd q", q.g, uq, rows * HD, dt);
  gpu_same_bits("qkv_rope_fwd k", k.g, uk, rows * KD, dt);
  /* backward from q, k, v as they are now (the same on both sides after pair_reset) */
  pair_reset(&q);
  pair_reset(&k);
  pair_reset(&v);
  cpu->qkv_rope_bwd(cpu, qkv.c, q.c, k.c, v.c, b, t, h, kv, d, pos, 10000.0f, dt);
  gpu->qkv_rope_bwd(gpu, qkv.g, q.g, k.g, v.g, b, t, h, kv, d, pos, 10000.0f, dt);
  pair_check("qkv_rope_bwd dqkv (written)", &qkv, 1e-6);
  gpu->copy(gpu, uq, q.g, rows * HD * es);
  gpu->copy(gpu, uk, k.g, rows * KD * es);
  gpu->rope_bwd(gpu, uq, b, t, h, d, pos, 10000.0f, dt);
  gpu->rope_bwd(gpu, uk, b, t, kv, d, pos, 10000.0f, dt);
  gpu->copy_2d(gpu, uw, (int)W, uq, (int)HD, (int)rows, (int)HD, dt);
  gpu->copy_2d(gpu, (char *)uw + HD * es, (int)W, uk, (int)KD, (int)rows, (int)KD, dt);
  gpu->copy_2d(gpu, (char *)uw + (HD + KD) * es, (int)W, v.g, (int)KD, (int)rows, (int)KD, dt);
  gpu_same_bits("qkv_rope_bwd dqkv", qkv.g, uw, rows * W, dt);
  gpu->free(gpu, uq);
  gpu->free(gpu, uk);
  gpu->free(gpu, uw);
  pair_free(&qkv);
  pair_free(&q);
  pair_free(&k);
  pair_free(&v);
}

static void test_qkv_rope(void **state) {
  qkv_rope_case(2, 37, 4, 2, 64, 0, DT_F32);
  qkv_rope_case(1, 1, 4, 1, 128, 17, DT_F32); /* one decoding row at position 17 */
  qkv_rope_case(2, 37, 4, 2, 64, 0, DT_BF16); /* the 8-wide kernel */
  qkv_rope_case(1, 9, 2, 1, 12, 3, DT_BF16);  /* d 12: the plain one */
}

/* add_rmsnorm_fwd: cuda against cpu (rmsnorm's tolerance; sum: one add, one rounding, the
 * same bits), and against the unfused cuda calls (add, rmsnorm_fwd): the same bits, with sum
 * apart and aliasing a. */
static void add_rmsnorm_case(int n, int c, dtype_t dt) {
  char what[128];
  const size_t nc = (size_t)n * c, es = dtype_size(dt);
  pair_t a = pair_new_dt(nc, -2.0f, 2.0f, dt), y = pair_new_dt(nc, -2.0f, 2.0f, dt),
         w = pair_new_dt((size_t)c, 0.5f, 1.5f, dt), sum = pair_new_dt(nc, 0.0f, 1.0f, dt),
         out = pair_new_dt(nc, 0.0f, 1.0f, dt), rstd = pair_new((size_t)n, 0.0f, 1.0f);
  cpu->add_rmsnorm_fwd(cpu, sum.c, out.c, rstd.c, a.c, y.c, w.c, n, c, 1e-5f, dt);
  gpu->add_rmsnorm_fwd(gpu, sum.g, out.g, rstd.g, a.g, y.g, w.g, n, c, 1e-5f, dt);
  snprintf(what, sizeof what, "add_rmsnorm_fwd n=%d c=%d sum", n, c);
  pair_check_bits(what, &sum);
  pair_check("add_rmsnorm_fwd out", &out, TOL_FP32);
  pair_check("add_rmsnorm_fwd rstd", &rstd, TOL_FP32);
  void *us = gpu->alloc(gpu, nc * es), *uo = gpu->alloc(gpu, nc * es), *ur = gpu->alloc(gpu, (size_t)n * 4);
  assert_non_null(us);
  assert_non_null(uo);
  assert_non_null(ur);
  gpu->add(gpu, us, a.g, y.g, nc, dt);
  gpu->rmsnorm_fwd(gpu, uo, ur, us, w.g, n, c, 1e-5f, dt);
  gpu_same_bits("add_rmsnorm_fwd sum", sum.g, us, nc, dt);
  gpu_same_bits("add_rmsnorm_fwd out", out.g, uo, nc, dt);
  gpu_same_bits("add_rmsnorm_fwd rstd (fp32)", rstd.g, ur, (size_t)n, DT_F32);
  gpu->add_rmsnorm_fwd(gpu, a.g, out.g, rstd.g, a.g, y.g, w.g, n, c, 1e-5f, dt); /* sum aliasing a */
  gpu_same_bits("add_rmsnorm_fwd sum aliasing a", a.g, us, nc, dt);
  gpu_same_bits("add_rmsnorm_fwd out, sum aliasing a", out.g, uo, nc, dt);
  gpu->free(gpu, us);
  gpu->free(gpu, uo);
  gpu->free(gpu, ur);
  pair_free(&a);
  pair_free(&y);
  pair_free(&w);
  pair_free(&sum);
  pair_free(&out);
  pair_free(&rstd);
}

static void test_add_rmsnorm(void **state) {
  add_rmsnorm_case(67, 300, DT_F32);
  add_rmsnorm_case(600, 1024, DT_F32);
  add_rmsnorm_case(67, 300, DT_BF16);   /* c not a multiple of 8: the plain kernel */
  add_rmsnorm_case(600, 1024, DT_BF16); /* the 8-wide kernel */
}

/* ------------------------------------------------------------------ attention */

static void attention_case(int b, int t, int h, int kv, int d, dtype_t dt) {
  char what[128];
  const char *dn = dtype_name(dt);
  size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  pair_t q = pair_new_dt(nq, -2.0f, 2.0f, dt), k = pair_new_dt(nk, -2.0f, 2.0f, dt), v = pair_new_dt(nk, -1.0f, 1.0f, dt);
  pair_t out = pair_new_dt(nq, 0.0f, 1.0f, dt), lse = pair_new((size_t)b * h * t, 0.0f, 1.0f);
  cpu->attention_fwd(cpu, out.c, lse.c, q.c, k.c, v.c, b, t, h, kv, d, dt);
  gpu->attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, b, t, h, kv, d, dt);
  snprintf(what, sizeof what, "attention_fwd %s b=%d t=%d h=%d kv=%d d=%d out", dn, b, t, h, kv, d);
  pair_check(what, &out, TOL_FP32);
  snprintf(what, sizeof what, "attention_fwd %s b=%d t=%d h=%d kv=%d d=%d lse", dn, b, t, h, kv, d);
  pair_check(what, &lse, TOL_FP32);
  void *fo = snap(&out), *fl = snap(&lse);
  gpu->attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, b, t, h, kv, d, dt);
  check_same_bits("attention_fwd out", &out, fo);
  check_same_bits("attention_fwd lse", &lse, fl);

  /* the backward from the cpu's out and lse on both, so that only the backward is compared */
  gpu->to_device(gpu, out.g, out.c, pair_bytes(&out));
  gpu->to_device(gpu, lse.g, lse.c, pair_bytes(&lse));
  pair_t dout = pair_new_dt(nq, -1.0f, 1.0f, dt), dq = pair_new_dt(nq, -1.0f, 1.0f, dt);
  pair_t dk = pair_new_dt(nk, -1.0f, 1.0f, dt), dv = pair_new_dt(nk, -1.0f, 1.0f, dt);
  cpu->attention_bwd(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, b, t, h, kv, d, dt);
  gpu->attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, t, h, kv, d, dt);
  snprintf(what, sizeof what, "attention_bwd %s b=%d t=%d h=%d kv=%d d=%d dq", dn, b, t, h, kv, d);
  pair_check(what, &dq, TOL_FP32);
  snprintf(what, sizeof what, "attention_bwd %s b=%d t=%d h=%d kv=%d d=%d dk", dn, b, t, h, kv, d);
  pair_check(what, &dk, TOL_FP32);
  snprintf(what, sizeof what, "attention_bwd %s b=%d t=%d h=%d kv=%d d=%d dv", dn, b, t, h, kv, d);
  pair_check(what, &dv, TOL_FP32);
  void *fq = snap(&dq), *fk = snap(&dk), *fv = snap(&dv);
  pair_reset(&dq);
  pair_reset(&dk);
  pair_reset(&dv);
  gpu->attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, t, h, kv, d, dt);
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
  attention_case(2, 100, 4, 2, 64, DT_F32);  /* GQA, a partial last tile */
  attention_case(1, 257, 8, 8, 128, DT_F32); /* multi-head, t one past a tile */
  attention_case(2, 33, 6, 2, 40, DT_F32);   /* head dim padded to 64 */
  attention_case(1, 64, 4, 1, 16, DT_F32);   /* multi-query, whole tiles */
  attention_case(1, 5, 2, 1, 32, DT_F32);    /* shorter than a tile */
  attention_case(1, 512, 4, 2, 128, DT_F32); /* several tiles each way */
}

static void test_attention_bf16(void **state) {
  attention_case(2, 100, 4, 2, 64, DT_BF16);
  attention_case(1, 257, 8, 8, 128, DT_BF16);
  attention_case(2, 33, 6, 2, 40, DT_BF16);
  attention_case(1, 64, 4, 1, 16, DT_BF16);
  attention_case(1, 5, 2, 1, 32, DT_BF16);
  attention_case(1, 512, 4, 2, 128, DT_BF16);
}

/* ------------------------------------------------------------------ blocks of ring attention */

/* A block's lse: the rows that see no key are -inf on both sides, the rest within tol of the
 * cpu's relative to max|cpu|. */
static void lse_check(const char *what, const pair_t *p, double tol) {
  float *h = pair_fetch(p);
  const float *c = p->c;
  size_t inf_mismatch = 0, n_inf = 0;
  double maxref = 0.0, maxdiff = 0.0;
  for (size_t i = 0; i < p->n; i++) {
    int ci = c[i] == -INFINITY, gi = h[i] == -INFINITY;
    n_inf += ci;
    if (ci || gi) {
      inf_mismatch += ci != gi;
      continue;
    }
    maxref = fmax(maxref, fabs((double)c[i]));
    maxdiff = fmax(maxdiff, fabs((double)h[i] - c[i]));
  }
  double rel = maxref > 0.0 ? maxdiff / maxref : maxdiff;
  printf("  %-44s %zu rows -inf (%zu where the other side is not); rel %.3e (tolerance %.0e)\n", what, n_inf,
         inf_mismatch, rel, tol);
  free(h);
  assert_int_equal(inf_mismatch, 0);
  assert_true(rel <= tol);
}

/* One block (queries at q_pos, keys at k_pos), the merge into a running result, and the block's
 * backward accumulated into gradients that hold values already: cuda against cpu. The inputs
 * are dt; outputs, the running result and the gradients fp32 (backend.h). */
static void attention_block_case(int b, int tq, int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt) {
  char what[160];
  char shape[96];
  snprintf(shape, sizeof shape, "%s b=%d tq=%d tk=%d h=%d kv=%d d=%d q@%ld k@%ld", dtype_name(dt), b, tq, tk, h, kv, d,
           q_pos, k_pos);
  size_t nq = (size_t)b * tq * h * d, nk = (size_t)b * tk * kv * d, nl = (size_t)b * h * tq;
  pair_t q = pair_new_dt(nq, -2.0f, 2.0f, dt), k = pair_new_dt(nk, -2.0f, 2.0f, dt), v = pair_new_dt(nk, -1.0f, 1.0f, dt);
  pair_t ob = pair_new(nq, 0.0f, 1.0f), lb = pair_new(nl, 0.0f, 1.0f);
  cpu->attention_fwd_block(cpu, ob.c, lb.c, q.c, k.c, v.c, b, tq, tk, h, kv, d, q_pos, k_pos, dt);
  gpu->attention_fwd_block(gpu, ob.g, lb.g, q.g, k.g, v.g, b, tq, tk, h, kv, d, q_pos, k_pos, dt);
  snprintf(what, sizeof what, "attention_fwd_block %s out", shape);
  pair_check(what, &ob, TOL_FP32);
  snprintf(what, sizeof what, "attention_fwd_block %s lse", shape);
  lse_check(what, &lb, TOL_FP32);

  /* merge into a running result with finite lse (both sides from the cpu's block) */
  gpu->to_device(gpu, ob.g, ob.c, pair_bytes(&ob));
  gpu->to_device(gpu, lb.g, lb.c, pair_bytes(&lb));
  pair_t run = pair_new(nq, -1.0f, 1.0f), rl = pair_new(nl, -1.0f, 3.0f);
  cpu->attention_merge(cpu, run.c, rl.c, ob.c, lb.c, b, tq, h, d);
  gpu->attention_merge(gpu, run.g, rl.g, ob.g, lb.g, b, tq, h, d);
  snprintf(what, sizeof what, "attention_merge %s out", shape);
  pair_check(what, &run, TOL_FP32);
  snprintf(what, sizeof what, "attention_merge %s lse", shape);
  lse_check(what, &rl, TOL_FP32);

  /* backward with a whole row's out (dt) and finite lse, accumulating into non-zero gradients */
  pair_t out = pair_new_dt(nq, -1.0f, 1.0f, dt), lse = pair_new(nl, 1.0f, 4.0f), dout = pair_new_dt(nq, -1.0f, 1.0f, dt);
  pair_t dq = pair_new(nq, -1.0f, 1.0f), dk = pair_new(nk, -1.0f, 1.0f), dv = pair_new(nk, -1.0f, 1.0f);
  cpu->attention_bwd_block(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, b, tq, tk, h, kv, d, q_pos,
                           k_pos, dt);
  gpu->attention_bwd_block(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, tq, tk, h, kv, d, q_pos,
                           k_pos, dt);
  const char *names[3] = {"dq", "dk", "dv"};
  pair_t *grads[3] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; i++) {
    snprintf(what, sizeof what, "attention_bwd_block %s %s", shape, names[i]);
    pair_check(what, grads[i], TOL_FP32);
  }
  pair_t *all[] = {&q, &k, &v, &ob, &lb, &run, &rl, &out, &lse, &dout, &dq, &dk, &dv};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) pair_free(all[i]);
}

/* A past block (every key seen), a diagonal one, one where the first rows see no key and the
 * tiles straddle, and a future one (nothing seen, nothing accumulated); fp32 and bf16 inputs. */
static void test_attention_blocks(void **state) {
  (void)state;
  for (int i = 0; i < 2; i++) {
    dtype_t dt = i ? DT_BF16 : DT_F32;
    attention_block_case(2, 100, 100, 4, 2, 64, 100, 0, dt);
    attention_block_case(1, 96, 96, 8, 8, 128, 192, 192, dt);
    attention_block_case(2, 70, 90, 6, 2, 40, 32, 64, dt);
    attention_block_case(1, 64, 64, 4, 1, 16, 0, 128, dt);
  }
}

/* cuDNN's fused flash attention (model.attention cudnn) against the cpu's bf16 kernel, each
 * backward from its own forward's out and lse. cuDNN multiplies the probabilities by V and
 * dout in bf16 (they are rounded to bf16 first), where ours keeps them fp32, so its outputs
 * differ by more than a rounding: out passes within 2 ulps + 1e-2 x max|ref|, dq, dk and dv
 * within 2 ulps + 2e-2 x max|ref|, lse (fp32, the scores are fp32 products of bf16 inputs in
 * both) within 1e-4 relative. The observed figures are printed. Reruns give the same bits when
 * cuDNN built its deterministic backward (said when it did not). */
#define TOL_CUDNN_OUT 1e-2
#define TOL_CUDNN_GRAD 2e-2
#define TOL_CUDNN_LSE 1e-4
static void attention_cudnn_case(int b, int t, int h, int kv, int d) {
  char what[160], why[512] = "";
  size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  int r = gpu->attention_select(gpu, ATTN_FUSED, b, t, h, kv, d, DT_BF16, why, sizeof why);
  printf("  attention b=%d t=%d h=%d kv=%d d=%d: %s\n", b, t, h, kv, d, why);
  assert_int_equal(r, 1);
  pair_t q = pair_new_dt(nq, -2.0f, 2.0f, DT_BF16), k = pair_new_dt(nk, -2.0f, 2.0f, DT_BF16);
  pair_t v = pair_new_dt(nk, -1.0f, 1.0f, DT_BF16), out = pair_new_dt(nq, 0.0f, 1.0f, DT_BF16);
  pair_t lse = pair_new((size_t)b * h * t, 0.0f, 1.0f);
  cpu->attention_fwd(cpu, out.c, lse.c, q.c, k.c, v.c, b, t, h, kv, d, DT_BF16);
  gpu->attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, b, t, h, kv, d, DT_BF16);
  snprintf(what, sizeof what, "cudnn attention_fwd b=%d t=%d h=%d kv=%d d=%d out", b, t, h, kv, d);
  pair_check(what, &out, TOL_CUDNN_OUT);
  snprintf(what, sizeof what, "cudnn attention_fwd b=%d t=%d h=%d kv=%d d=%d lse", b, t, h, kv, d);
  pair_check(what, &lse, TOL_CUDNN_LSE);
  pair_t dout = pair_new_dt(nq, -1.0f, 1.0f, DT_BF16), dq = pair_new_dt(nq, -1.0f, 1.0f, DT_BF16);
  pair_t dk = pair_new_dt(nk, -1.0f, 1.0f, DT_BF16), dv = pair_new_dt(nk, -1.0f, 1.0f, DT_BF16);
  cpu->attention_bwd(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, b, t, h, kv, d, DT_BF16);
  gpu->attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, t, h, kv, d, DT_BF16);
  const char *names[3] = {"dq", "dk", "dv"};
  pair_t *grads[3] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; i++) {
    snprintf(what, sizeof what, "cudnn attention_bwd b=%d t=%d h=%d kv=%d d=%d %s", b, t, h, kv, d, names[i]);
    pair_check(what, grads[i], TOL_CUDNN_GRAD);
  }
  if (!strstr(why, "not deterministic")) {
    void *fq = snap(&dq), *fk = snap(&dk), *fv = snap(&dv);
    gpu->attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, b, t, h, kv, d, DT_BF16);
    check_same_bits("cudnn attention_bwd dq", &dq, fq);
    check_same_bits("cudnn attention_bwd dk", &dk, fk);
    check_same_bits("cudnn attention_bwd dv", &dv, fv);
  }
  pair_t *all[] = {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) pair_free(all[i]);
  gpu->attention_select(gpu, ATTN_REFERENCE, b, t, h, kv, d, DT_BF16, why, sizeof why); /* back to the reference */
}

static void test_attention_cudnn(void **state) {
  char why[512] = "";
  assert_non_null(gpu->attention_select);
  /* fp32 is refused with a reason under "cudnn", and is the reference under "auto" */
  assert_int_equal(gpu->attention_select(gpu, ATTN_FUSED, 1, 64, 4, 2, 64, DT_F32, why, sizeof why), -1);
  printf("  fp32 under cudnn: %s\n", why);
  assert_non_null(strstr(why, "bf16"));
  assert_int_equal(gpu->attention_select(gpu, ATTN_AUTO, 1, 64, 4, 2, 64, DT_F32, why, sizeof why), 0);
  attention_cudnn_case(2, 100, 4, 2, 64);  /* GQA, t not a multiple of a tile */
  attention_cudnn_case(1, 257, 8, 8, 128); /* multi-head, d 128 */
  attention_cudnn_case(1, 64, 4, 1, 16);   /* multi-query, small d */
  attention_cudnn_case(1, 5, 2, 1, 32);    /* very short */
  attention_cudnn_case(2, 1024, 16, 4, 64); /* Llama 3.2 1B's head layout at half its heads */
}

/* Blocks of ring attention on cuDNN (attention_select chose it for the chunk's shape): a past
 * block (every key before every query: no mask) and a diagonal one (the causal mask), against the
 * cpu's bf16 blocks with the tolerances of cuDNN's attention above. The forward's out (fp32, one
 * bf16 rounding on cuDNN) and lse; then the backward from a row's out and lse as the ring hands
 * them over (the cpu's block out rounded to bf16, its lse raised by 0.5 as if the row had met an
 * earlier block too), accumulated into fp32 gradients that hold values already. With lo 1 the
 * lse starts one float into its buffer, so that cuDNN's 16-byte aligned stats go through the
 * backend's scratch, as a later chunk's may. Reruns give the same bits where cuDNN built its
 * deterministic backward (det). */
static void attention_block_cudnn_case(int b, int t, int h, int kv, int d, long q_pos, long k_pos, int lo, int det) {
  char what[160], shape[96];
  snprintf(shape, sizeof shape, "b=%d t=%d h=%d kv=%d d=%d q@%ld k@%ld", b, t, h, kv, d, q_pos, k_pos);
  size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d, nl = (size_t)b * h * t;
  pair_t q = pair_new_dt(nq, -2.0f, 2.0f, DT_BF16), k = pair_new_dt(nk, -2.0f, 2.0f, DT_BF16);
  pair_t v = pair_new_dt(nk, -1.0f, 1.0f, DT_BF16);
  pair_t ob = pair_new(nq, 0.0f, 1.0f), lb = pair_new(nl + 1, 0.0f, 1.0f);
  float *lbc = (float *)lb.c + lo, *lbg = (float *)lb.g + lo;
  cpu->attention_fwd_block(cpu, ob.c, lbc, q.c, k.c, v.c, b, t, t, h, kv, d, q_pos, k_pos, DT_BF16);
  gpu->attention_fwd_block(gpu, ob.g, lbg, q.g, k.g, v.g, b, t, t, h, kv, d, q_pos, k_pos, DT_BF16);
  snprintf(what, sizeof what, "cudnn attention_fwd_block %s out", shape);
  pair_check(what, &ob, TOL_CUDNN_OUT);
  snprintf(what, sizeof what, "cudnn attention_fwd_block %s lse", shape);
  lse_check(what, &lb, TOL_CUDNN_LSE);

  pair_t out = pair_new_dt(nq, 0.0f, 1.0f, DT_BF16), lse = pair_new(nl + 1, 0.0f, 1.0f);
  for (size_t i = 0; i < nq; i++) ((bf16_t *)out.host)[i] = bf16_from_f32(((const float *)ob.c)[i]);
  for (size_t i = 0; i < nl; i++) ((float *)lse.host)[i + lo] = lbc[i] + 0.5f;
  pair_reset(&out);
  pair_reset(&lse);
  pair_t dout = pair_new_dt(nq, -1.0f, 1.0f, DT_BF16);
  pair_t dq = pair_new(nq, -1.0f, 1.0f), dk = pair_new(nk, -1.0f, 1.0f), dv = pair_new(nk, -1.0f, 1.0f);
  const float *lc = (const float *)lse.c + lo, *lg = (const float *)lse.g + lo;
  cpu->attention_bwd_block(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lc, b, t, t, h, kv, d, q_pos, k_pos,
                           DT_BF16);
  gpu->attention_bwd_block(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lg, b, t, t, h, kv, d, q_pos, k_pos,
                           DT_BF16);
  const char *names[3] = {"dq", "dk", "dv"};
  pair_t *grads[3] = {&dq, &dk, &dv};
  void *first[3];
  for (int i = 0; i < 3; i++) {
    snprintf(what, sizeof what, "cudnn attention_bwd_block %s %s", shape, names[i]);
    pair_check(what, grads[i], TOL_CUDNN_GRAD);
    first[i] = snap(grads[i]);
    gpu->to_device(gpu, grads[i]->g, grads[i]->host, pair_bytes(grads[i]));
  }
  if (det)
    gpu->attention_bwd_block(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lg, b, t, t, h, kv, d, q_pos, k_pos,
                             DT_BF16);
  for (int i = 0; i < 3; i++) {
    snprintf(what, sizeof what, "cudnn attention_bwd_block %s", names[i]);
    if (det) check_same_bits(what, grads[i], first[i]);
    else free(first[i]);
  }
  pair_t *all[] = {&q, &k, &v, &ob, &lb, &out, &lse, &dout, &dq, &dk, &dv};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) pair_free(all[i]);
}

/* cuDNN chosen for the chunk's shape; blocks of a chunk length that is not a multiple of a tile,
 * grouped-query and multi-head, then a partial block (the reference kernel runs it: checked
 * against the cpu at the fp32 tolerance). */
static void test_attention_blocks_cudnn(void **state) {
  (void)state;
  const int shapes[][5] = {{2, 100, 4, 2, 64}, {1, 96, 8, 8, 128}};
  char why[512] = "";
  for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
    const int *x = shapes[s];
    int r = gpu->attention_select(gpu, ATTN_FUSED, x[0], x[1], x[2], x[3], x[4], DT_BF16, why, sizeof why);
    printf("  attention blocks b=%d t=%d h=%d kv=%d d=%d: %s\n", x[0], x[1], x[2], x[3], x[4], why);
    assert_int_equal(r, 1);
    const int det = !strstr(why, "not deterministic");
    attention_block_cudnn_case(x[0], x[1], x[2], x[3], x[4], 3L * x[1], (long)x[1], (int)s, det);    /* past */
    attention_block_cudnn_case(x[0], x[1], x[2], x[3], x[4], 2L * x[1], 2L * x[1], 1 - (int)s, det); /* diagonal */
  }
  attention_block_case(2, 70, 90, 6, 2, 40, 32, 64, DT_BF16); /* partial: the reference kernel */
  gpu->attention_select(gpu, ATTN_REFERENCE, 1, 64, 4, 2, 64, DT_BF16, why, sizeof why); /* back to the reference */
}

/* ------------------------------------------------------------------ cross-entropy */

static void ce_case(int n, int v, int ld, int alias, dtype_t dt) {
  char what[112];
  const char *dn = dtype_name(dt), *al = alias ? " aliased" : "";
  ids_t tg = ids_new((size_t)n, 0, v);
  tg.host[0] = -1;           /* ignored */
  if (n > 2) tg.host[2] = v; /* out of range: ignored as well */
  ids_upload(&tg);
  pair_t logits = pair_new_dt((size_t)n * ld, -8.0f, 8.0f, dt), losses = pair_new((size_t)n, 3.0f, 4.0f);
  pair_t dl = pair_new_dt((size_t)n * ld, 3.0f, 4.0f, dt);
  pair_t *dst = alias ? &logits : &dl;
  float gs = 1.0f / (float)n;
  cpu->cross_entropy(cpu, losses.c, dst->c, logits.c, tg.c, n, v, ld, gs, dt);
  gpu->cross_entropy(gpu, losses.g, dst->g, logits.g, tg.g, n, v, ld, gs, dt);
  snprintf(what, sizeof what, "cross_entropy %s n=%d v=%d ld=%d%s losses", dn, n, v, ld, al);
  pair_check(what, &losses, TOL_FP32);
  snprintf(what, sizeof what, "cross_entropy %s n=%d v=%d ld=%d%s dlogits", dn, n, v, ld, al);
  pair_check(what, dst, TOL_FP32);
  void *fl = snap(&losses), *fd = snap(dst);
  pair_reset(&logits);
  pair_reset(&dl);
  gpu->cross_entropy(gpu, losses.g, dst->g, logits.g, tg.g, n, v, ld, gs, dt);
  check_same_bits("cross_entropy losses", &losses, fl);
  check_same_bits("cross_entropy dlogits", dst, fd);
  /* forward only */
  pair_reset(&logits);
  cpu->cross_entropy(cpu, losses.c, NULL, logits.c, tg.c, n, v, ld, gs, dt);
  gpu->cross_entropy(gpu, losses.g, NULL, logits.g, tg.g, n, v, ld, gs, dt);
  snprintf(what, sizeof what, "cross_entropy %s losses without gradient", dn);
  pair_check(what, &losses, TOL_FP32);
  ids_free(&tg);
  pair_free(&logits);
  pair_free(&losses);
  pair_free(&dl);
}

static void test_cross_entropy(void **state) {
  ce_case(37, 1000, 1024, 0, DT_F32);
  ce_case(37, 1000, 1024, 1, DT_F32);
  ce_case(8, 32000, 32000, 1, DT_F32);
  ce_case(5, 50, 50, 0, DT_F32);
}

static void test_cross_entropy_bf16(void **state) {
  ce_case(37, 1000, 1024, 0, DT_BF16);
  ce_case(37, 1000, 1024, 1, DT_BF16);
  ce_case(8, 32000, 32000, 1, DT_BF16);
  ce_case(5, 50, 50, 0, DT_BF16);     /* ld not a multiple of 8: the one-element kernel */
  ce_case(9, 1001, 1008, 0, DT_BF16); /* 8-wide groups and a tail past the last one */
  ce_case(4, 128256, 128256, 1, DT_BF16); /* Llama 3's vocabulary, in place */
}

/* ------------------------------------------------------------------ AdamW */

static void test_adamw(void **state) {
  size_t n = 100003;
  pair_t p = pair_new(n, -1.0f, 1.0f), m = pair_new(n, 0.0f, 0.0f), v = pair_new(n, 0.0f, 0.0f);
  for (int step = 1; step <= 3; step++) {
    pair_t g = pair_new(n, -1.0f, 1.0f);
    cpu->adamw(cpu, p.c, g.c, m.c, v.c, NULL, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    gpu->adamw(gpu, p.g, g.g, m.g, v.g, NULL, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    pair_free(&g);
  }
  pair_check("adamw (3 steps) param", &p, TOL_FP32);
  pair_check("adamw (3 steps) m", &m, TOL_FP32);
  pair_check("adamw (3 steps) v", &v, TOL_FP32);
  pair_free(&p);
  pair_free(&m);
  pair_free(&v);
}

/* With param_lp: the fp32 update is the one without it (the same bits on the cuda side), and
 * the bf16 copy is exactly the rounding of the fp32 parameter the same pass wrote (tolerance 0),
 * and within the bf16 tolerance of the cpu backend's copy. */
static void test_adamw_bf16(void **state) {
  size_t n = 100003;
  pair_t p = pair_new(n, -1.0f, 1.0f), m = pair_new(n, 0.0f, 0.0f), v = pair_new(n, 0.0f, 0.0f);
  pair_t lp = pair_new_dt(n, 5.0f, 6.0f, DT_BF16); /* garbage that must be overwritten */
  float *ref_p = gpu->alloc(gpu, n * sizeof(float)), *ref_m = gpu->alloc(gpu, n * sizeof(float));
  float *ref_v = gpu->alloc(gpu, n * sizeof(float));
  assert_non_null(ref_p);
  assert_non_null(ref_m);
  assert_non_null(ref_v);
  gpu->copy(gpu, ref_p, p.g, n * sizeof(float));
  for (int step = 1; step <= 3; step++) {
    pair_t g = pair_new(n, -1.0f, 1.0f);
    cpu->adamw(cpu, p.c, g.c, m.c, v.c, lp.c, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    gpu->adamw(gpu, p.g, g.g, m.g, v.g, lp.g, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    gpu->adamw(gpu, ref_p, g.g, ref_m, ref_v, NULL, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
    pair_free(&g);
  }
  pair_check("adamw with param_lp (3 steps) param", &p, TOL_FP32);
  pair_check("adamw with param_lp (3 steps) param_lp", &lp, TOL_FP32);
  float *gp = pair_fetch(&p), *rp = malloc(n * sizeof(float));
  bf16_t *glp = pair_fetch(&lp);
  assert_non_null(rp);
  gpu->to_host(gpu, rp, ref_p, n * sizeof(float));
  size_t not_rounding = 0, not_same = 0;
  for (size_t i = 0; i < n; i++) {
    not_rounding += glp[i] != bf16_from_f32(gp[i]);
    not_same += memcmp(&gp[i], &rp[i], sizeof(float)) != 0;
  }
  printf("  adamw param_lp: %zu of %zu are not bf16 rounding of the fp32 param (tolerance 0)\n", not_rounding, n);
  printf("  adamw param with vs without param_lp: %zu of %zu differ in bits (tolerance 0)\n", not_same, n);
  assert_int_equal(not_rounding, 0);
  assert_int_equal(not_same, 0);
  free(gp);
  free(rp);
  free(glp);
  gpu->free(gpu, ref_p);
  gpu->free(gpu, ref_m);
  gpu->free(gpu, ref_v);
  pair_free(&p);
  pair_free(&m);
  pair_free(&v);
  pair_free(&lp);
}

/* adamw_multi over segments of every kind: decayed and not (a large weight decay, so a wrong
 * flag shows), longer than a chunk (16384) and of a few elements, starting off 4-element
 * alignment (the one-at-a-time head and tail around the 4-wide middle), a gap no segment covers,
 * with param_lp. Against the cpu backend's adamw_multi (itself adamw per segment, bit for bit):
 * the adamw tolerances. Against the cuda adamw called per segment: the same bits (one formula),
 * the gap untouched. Then all four pointers one float off 16-byte alignment (the scalar path). */
static void adamw_multi_case(size_t shift) {
  const adamw_segment_t segs[] = {
      {0, 40001, 1}, {40001, 7, 0}, {40011, 16384, 1}, {56395, 3, 0}, {56398, 33000, 0}, {89398, 1, 1},
  };
  const int ns = (int)(sizeof segs / sizeof segs[0]);
  const size_t n = 89399 + shift, gap = 40008; /* [40008, 40011) is in no segment */
  const float wd = 0.5f;
  pair_t p = pair_new(n, -1.0f, 1.0f), m = pair_new(n, 0.0f, 0.0f), v = pair_new(n, 0.0f, 0.0f);
  pair_t lp = pair_new_dt(n, 5.0f, 6.0f, DT_BF16);
  float *rp = gpu->alloc(gpu, n * sizeof(float)), *rm = gpu->alloc(gpu, n * sizeof(float));
  float *rv = gpu->alloc(gpu, n * sizeof(float));
  void *rlp = gpu->alloc(gpu, n * sizeof(bf16_t));
  assert_true(rp && rm && rv && rlp);
  gpu->copy(gpu, rp, p.g, n * sizeof(float));
  gpu->copy(gpu, rlp, lp.g, n * sizeof(bf16_t));
  for (int step = 1; step <= 3; step++) {
    pair_t g = pair_new(n, -1.0f, 1.0f);
    const size_t s = shift;
    cpu->adamw_multi(cpu, (float *)p.c + s, (float *)g.c + s, (float *)m.c + s, (float *)v.c + s,
                     (bf16_t *)lp.c + s, segs, ns, 1e-3f, 0.9f, 0.95f, 1e-8f, wd, step, 0.5f);
    gpu->adamw_multi(gpu, (float *)p.g + s, (float *)g.g + s, (float *)m.g + s, (float *)v.g + s,
                     (bf16_t *)lp.g + s, segs, ns, 1e-3f, 0.9f, 0.95f, 1e-8f, wd, step, 0.5f);
    for (int i = 0; i < ns; i++) {
      const size_t o = s + segs[i].offset;
      gpu->adamw(gpu, rp + o, (float *)g.g + o, rm + o, rv + o, (bf16_t *)rlp + o, segs[i].numel, 1e-3f, 0.9f,
                 0.95f, 1e-8f, segs[i].decay ? wd : 0.0f, step, 0.5f);
    }
    pair_free(&g);
  }
  printf("  adamw_multi, the range %zu float(s) past 16-byte alignment:\n", shift);
  pair_check("adamw_multi (3 steps) param", &p, TOL_FP32);
  pair_check("adamw_multi (3 steps) m", &m, TOL_FP32);
  pair_check("adamw_multi (3 steps) v", &v, TOL_FP32);
  pair_check("adamw_multi (3 steps) param_lp", &lp, TOL_FP32);
  float *gp = pair_fetch(&p), *gm = pair_fetch(&m), *gv = pair_fetch(&v);
  bf16_t *glp = pair_fetch(&lp);
  float *hp = malloc(n * sizeof(float)), *hm = malloc(n * sizeof(float)), *hv = malloc(n * sizeof(float));
  bf16_t *hlp = malloc(n * sizeof(bf16_t));
  assert_true(hp && hm && hv && hlp);
  gpu->to_host(gpu, hp, rp, n * sizeof(float));
  gpu->to_host(gpu, hm, rm, n * sizeof(float));
  gpu->to_host(gpu, hv, rv, n * sizeof(float));
  gpu->to_host(gpu, hlp, rlp, n * sizeof(bf16_t));
  size_t differ = 0;
  for (size_t i = 0; i < n; i++)
    differ += memcmp(&gp[i], &hp[i], 4) != 0 || memcmp(&gm[i], &hm[i], 4) != 0 || memcmp(&gv[i], &hv[i], 4) != 0 ||
              glp[i] != hlp[i];
  printf("  adamw_multi vs cuda adamw per segment: %zu of %zu elements differ in bits (tolerance 0)\n", differ, n);
  assert_int_equal(differ, 0);
  const float *p0 = (const float *)p.host;
  const bf16_t *lp0 = (const bf16_t *)lp.host;
  for (size_t i = shift + gap; i < shift + gap + 3; i++) /* the gap, untouched */
    assert_true(memcmp(&gp[i], &p0[i], 4) == 0 && gm[i] == 0.0f && gv[i] == 0.0f && glp[i] == lp0[i]);
  free(gp);
  free(gm);
  free(gv);
  free(glp);
  free(hp);
  free(hm);
  free(hv);
  free(hlp);
  gpu->free(gpu, rp);
  gpu->free(gpu, rm);
  gpu->free(gpu, rv);
  gpu->free(gpu, rlp);
  pair_free(&p);
  pair_free(&m);
  pair_free(&v);
  pair_free(&lp);
}

static void test_adamw_multi(void **state) {
  adamw_multi_case(0);
  adamw_multi_case(1);
}

/* A step's statistics without host waits, against the cpu backend. step_loss: the rows added in
 * the same order in double on both, so the same bits (tolerance 0), a poisoned micro-batch named
 * the same. sumsq_groups: each group within 1e-10 of the cpu (the pieces' sums in another order,
 * as sumsq), and the bits of the cuda sumsq_parts' pieces added in order. clip_scale on the same
 * sums: the same bits (one sqrt and one division, correctly rounded on both). adamw_multi_dev:
 * the bits of adamw_multi given the same scale. */
static void step_loss_case(int poison_micro) {
  const int n = 4999, accum = 3, valid[3] = {4000, 0, 4999};
  pair_t rows = pair_new((size_t)n * accum, 0.0f, 5.0f);
  double *sg = gpu->alloc(gpu, 2 * sizeof(double)), sc[2], sgh[2];
  float *mg = gpu->alloc(gpu, sizeof(float)), mc = 0, mgh = 0;
  assert_true(sg && mg);
  for (int k = 0; k < accum; k++) {
    cpu->step_loss(cpu, (const float *)rows.c + (size_t)k * n, n, valid[k], k, accum, k == poison_micro, sc, &mc);
    gpu->step_loss(gpu, (const float *)rows.g + (size_t)k * n, n, valid[k], k, accum, k == poison_micro, sg, mg);
  }
  gpu->to_host(gpu, sgh, sg, sizeof sgh);
  gpu->to_host(gpu, &mgh, mg, sizeof mgh);
  printf("  step_loss (poison %d): cuda %.17g / %g / %.9g, cpu %.17g / %g / %.9g (tolerance 0)\n", poison_micro,
         sgh[0], sgh[1], mgh, sc[0], sc[1], mc);
  assert_memory_equal(sgh, sc, sizeof sc);
  assert_memory_equal(&mgh, &mc, sizeof mc);
  gpu->free(gpu, sg);
  gpu->free(gpu, mg);
  pair_free(&rows);
}

static void test_step_stats(void **state) {
  step_loss_case(-1);
  step_loss_case(1);
  pair_t x = pair_new(3000001, -3.0f, 3.0f);
  const size_t off[5] = {0, 5, 5, 4102, 1000000}, cnt[5] = {5, 0, 4097, 995898, 2000001};
  const int grp[5] = {0, 1, 0, 1, 0};
  double pg[5], sc[2], sg[2];
  float hc[2], hg[2];
  void *dev = gpu->alloc(gpu, 2 * sizeof(double) + 2 * sizeof(float));
  assert_non_null(dev);
  cpu->sumsq_groups(cpu, x.c, off, cnt, grp, 5, sc, hc);
  for (int rep = 0; rep < 2; rep++) /* the second call runs on the cached table */
    gpu->sumsq_groups(gpu, x.g, off, cnt, grp, 5, dev, (float *)((double *)dev + 2));
  gpu->to_host(gpu, sg, dev, sizeof sg);
  gpu->to_host(gpu, hg, (double *)dev + 2, sizeof hg);
  gpu->sumsq_parts(gpu, x.g, off, cnt, 5, pg);
  const double in_order[2] = {pg[0] + pg[2] + pg[4], pg[1] + pg[3]};
  for (int g = 0; g < 2; g++) {
    const double rel = fabs(sg[g] - sc[g]) / sc[g];
    printf("  sumsq_groups group %d: cuda %.17g cpu %.17g rel %.3e (tolerance 1e-10); as sumsq_parts in order: %s; "
           "share %s\n", g, sg[g], sc[g], rel, memcmp(&sg[g], &in_order[g], sizeof sg[g]) ? "DIFFERS" : "same bits",
           hg[g] == (float)sg[g] ? "its fp32 rounding" : "WRONG");
    assert_true(rel <= 1e-10);
    assert_memory_equal(&sg[g], &in_order[g], sizeof sg[g]);
    assert_true(hg[g] == (float)sg[g]);
  }
  static const double clips[] = {0.0, 1.0, 1e12};
  double *ng = gpu->alloc(gpu, sizeof(double));
  float *kg = gpu->alloc(gpu, sizeof(float));
  assert_true(ng && kg);
  for (int use = 0; use < 2; use++)
    for (size_t c = 0; c < sizeof clips / sizeof clips[0]; c++) {
      double nc, nh;
      float kc, kh;
      cpu->clip_scale(cpu, sg, hg, use, clips[c], &nc, &kc);
      gpu->clip_scale(gpu, dev, (float *)((double *)dev + 2), use, clips[c], ng, kg);
      gpu->to_host(gpu, &nh, ng, sizeof nh);
      gpu->to_host(gpu, &kh, kg, sizeof kh);
      printf("  clip_scale (shares %d, clip %g): cuda %.17g / %.9g, cpu %.17g / %.9g (tolerance 0)\n", use, clips[c],
             nh, kh, nc, kc);
      assert_memory_equal(&nh, &nc, sizeof nh);
      assert_memory_equal(&kh, &kc, sizeof kh);
    }
  /* adamw_multi_dev against adamw_multi with the same scale, on the device */
  const adamw_segment_t segs[] = {{0, 40001, 1}, {40001, 7, 0}, {40008, 16384, 1}};
  const size_t n = 56392;
  pair_t p = pair_new(n, -1.0f, 1.0f), gr = pair_new(n, -1.0f, 1.0f);
  float *p2 = gpu->alloc(gpu, n * sizeof(float)), *m1 = gpu->alloc(gpu, n * sizeof(float));
  float *v1 = gpu->alloc(gpu, n * sizeof(float)), *m2 = gpu->alloc(gpu, n * sizeof(float));
  float *v2 = gpu->alloc(gpu, n * sizeof(float));
  assert_true(p2 && m1 && v1 && m2 && v2);
  gpu->copy(gpu, p2, p.g, n * sizeof(float));
  const float scale = 0.37f;
  gpu->to_device(gpu, kg, &scale, sizeof scale);
  /* the update's values from device memory, with lr changing each step; steps 3 to 5 replay the
   * call recorded once at step 3 (graph_begin .. graph_end), the values updated before each */
  adamw_step_t *st = gpu->alloc(gpu, sizeof *st);
  assert_non_null(st);
  void *graph = NULL;
  char gerr[256] = "";
  for (int step = 1; step <= 5; step++) {
    const float lr = 1e-3f / (float)step;
    const adamw_step_t h = adamw_step_make(lr, 0.9f, 0.95f, step);
    gpu->adamw_multi(gpu, p.g, gr.g, m1, v1, NULL, segs, 3, lr, 0.9f, 0.95f, 1e-8f, 0.1f, step, scale);
    gpu->to_device(gpu, st, &h, sizeof h);
    if (step < 3) {
      gpu->adamw_multi_dev(gpu, p2, gr.g, m2, v2, NULL, segs, 3, 0.9f, 0.95f, 1e-8f, 0.1f, st, kg);
      continue;
    }
    if (step == 3) {
      assert_int_equal(gpu->graph_begin(gpu, gerr, sizeof gerr), 0);
      gpu->adamw_multi_dev(gpu, p2, gr.g, m2, v2, NULL, segs, 3, 0.9f, 0.95f, 1e-8f, 0.1f, st, kg);
      graph = gpu->graph_end(gpu, gerr, sizeof gerr);
      if (!graph) printf("  graph_end: %s\n", gerr);
      assert_non_null(graph);
    }
    assert_int_equal(gpu->graph_launch(gpu, graph, gerr, sizeof gerr), 0);
  }
  gpu->graph_destroy(gpu, graph);
  gpu->free(gpu, st);
  float *a = pair_fetch(&p), *b = malloc(n * sizeof(float));
  assert_non_null(b);
  gpu->to_host(gpu, b, p2, n * sizeof(float));
  size_t differ = 0;
  for (size_t i = 0; i < n; i++) differ += memcmp(&a[i], &b[i], 4) != 0;
  printf("  adamw_multi_dev (steps 3-5 replayed from one recording) vs adamw_multi, scale %.2f: %zu of %zu "
         "parameters differ in bits (tolerance 0)\n", scale,
         differ, n);
  assert_int_equal(differ, 0);
  free(a);
  free(b);
  gpu->free(gpu, p2);
  gpu->free(gpu, m1);
  gpu->free(gpu, v1);
  gpu->free(gpu, m2);
  gpu->free(gpu, v2);
  gpu->free(gpu, ng);
  gpu->free(gpu, kg);
  gpu->free(gpu, dev);
  pair_free(&p);
  pair_free(&gr);
  pair_free(&x);
}

/* Uploads in turn through the two slots, each followed by a copy on the compute stream out of its
 * destination (what a forward reads): every copy sees its own upload, none the next one into the
 * same slot (tolerance 0), on both backends. */
static void uploads_case(backend_t *be) {
  enum { N = 1 << 20, UPLOADS = 8 };
  int32_t *host[2], *dst[2], *out[UPLOADS];
  for (int j = 0; j < 2; j++) {
    host[j] = be->host_alloc_pinned(be, N * sizeof(int32_t));
    dst[j] = be->alloc(be, N * sizeof(int32_t));
    assert_true(host[j] && dst[j]);
  }
  for (int k = 0; k < UPLOADS; k++) {
    const int j = k & 1;
    out[k] = be->alloc(be, N * sizeof(int32_t));
    assert_non_null(out[k]);
    be->upload_host_wait(be, j);
    for (int i = 0; i < N; i++) host[j][i] = k * 1000003 + i;
    be->upload_async(be, dst[j], host[j], N * sizeof(int32_t), j);
    be->upload_wait(be, j);
    be->copy(be, out[k], dst[j], N * sizeof(int32_t));
  }
  int32_t *h = malloc(N * sizeof(int32_t));
  assert_non_null(h);
  size_t wrong = 0;
  for (int k = 0; k < UPLOADS; k++) {
    be->to_host(be, h, out[k], N * sizeof(int32_t));
    for (int i = 0; i < N; i++) wrong += h[i] != k * 1000003 + i;
    be->free(be, out[k]);
  }
  printf("  uploads on %s: %d of %d ids each through two slots, %zu wrong (tolerance 0)\n", be->name, UPLOADS, N,
         wrong);
  assert_int_equal(wrong, 0);
  free(h);
  for (int j = 0; j < 2; j++) {
    be->host_free_pinned(be, host[j]);
    be->free(be, dst[j]);
  }
}

static void test_uploads(void **state) {
  uploads_case(cpu);
  uploads_case(gpu);
}

int main(void) {
  char err[512];
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!(cpu = backend_cpu_create(0, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda: %s\n", err);
    return 1;
  }
  if (!(gpu = backend_create("cuda", 0, err, sizeof err))) {
    fprintf(stderr, "test_backend_cuda: %s\n", err);
    backend_destroy(cpu);
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_device),
      cmocka_unit_test(test_memory),
      cmocka_unit_test(test_matmul),
      cmocka_unit_test(test_elementwise),
      cmocka_unit_test(test_sumsq_parts_add),
      cmocka_unit_test(test_embedding),
      cmocka_unit_test(test_rmsnorm),
      cmocka_unit_test(test_rope),
      cmocka_unit_test(test_attention),
      cmocka_unit_test(test_cross_entropy),
      cmocka_unit_test(test_adamw),
      cmocka_unit_test(test_convert),
      cmocka_unit_test(test_elementwise_bf16),
      cmocka_unit_test(test_embedding_bf16),
      cmocka_unit_test(test_rmsnorm_bf16),
      cmocka_unit_test(test_rope_bf16),
      cmocka_unit_test(test_attention_bf16),
      cmocka_unit_test(test_attention_cudnn),
      cmocka_unit_test(test_attention_blocks),
      cmocka_unit_test(test_attention_blocks_cudnn),
      cmocka_unit_test(test_cross_entropy_bf16),
      cmocka_unit_test(test_adamw_bf16),
      cmocka_unit_test(test_adamw_multi),
      cmocka_unit_test(test_qkv_rope),
      cmocka_unit_test(test_add_rmsnorm),
      cmocka_unit_test(test_step_stats),
      cmocka_unit_test(test_uploads),
      cmocka_unit_test(test_matmul_bf16),           /* the bf16 products last: see there */
      cmocka_unit_test(test_matmul_bf16_unaligned),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  backend_destroy(gpu);
  backend_destroy(cpu);
  return failed ? 1 : 0;
}
