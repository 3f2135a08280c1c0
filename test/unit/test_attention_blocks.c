// deps: trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/env.c trainer/backend/fatal.c common/err.c
/* test_attention_blocks: the pieces of ring attention (attention_fwd_block, attention_merge,
 * attention_bwd_block) put back together give causal attention.
 *
 * A sequence of T tokens is cut into 2*cp chunks as context parallelism cuts it; every query
 * chunk meets every key chunk (a ring visits them all, in some order) and the blocks are merged
 * or their gradients summed. The result is compared with attention_fwd / attention_bwd on the
 * whole sequence. Tolerance 1e-5 relative (max |difference| / max |reference|): the two differ
 * only in fp32 summation order and in the merge's rescaling. Checked exactly: the one block
 * t = tq = tk at positions 0 is attention_fwd bit for bit, a block wholly in the future has out 0
 * and lse -inf and merging it changes nothing, and the order of the merges does not matter to
 * within the tolerance. Every check prints what it observed. */
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

#define TOL 1e-5

static backend_t *be;

typedef struct {
  int b, t, h, kv, d;
} shape_t;

static float *frand(size_t n, uint64_t stream) {
  rng_t r;
  rng_init(&r, 7, stream);
  float *x = malloc(n * sizeof *x);
  for (size_t i = 0; i < n; i++)
    x[i] = (float)rng_normal(&r);
  return x;
}

static double max_rel(const float *a, const float *ref, size_t n) {
  double md = 0.0, mr = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - ref[i]);
    md = d > md ? d : md;
    mr = fabs(ref[i]) > mr ? fabs(ref[i]) : mr;
  }
  return mr > 0 ? md / mr : md;
}

static void check(const char *what, double err, double tol) {
  printf("  %-58s max rel err %.3e (tol %.0e)\n", what, err, tol);
  assert_true(err <= tol);
}

/* Rows [c0, c0 + c) of every sequence of x (B, T, W) into y (B, c, W), or back (put). */
static void chunk_rows(float *y, float *x, int b, int t, int w, int c0, int c, int put) {
  for (int bi = 0; bi < b; bi++)
    for (int i = 0; i < c; i++) {
      float *row = x + ((size_t)bi * t + c0 + i) * w, *ch = y + ((size_t)bi * c + i) * w;
      if (put)
        memcpy(row, ch, (size_t)w * sizeof(float));
      else
        memcpy(ch, row, (size_t)w * sizeof(float));
    }
}

/* The same for the (B, H, T) layout of lse. */
static void chunk_lse(float *y, float *x, int b, int h, int t, int c0, int c, int put) {
  for (int bh = 0; bh < b * h; bh++) {
    float *row = x + (size_t)bh * t + c0, *ch = y + (size_t)bh * c;
    if (put)
      memcpy(row, ch, (size_t)c * sizeof(float));
    else
      memcpy(ch, row, (size_t)c * sizeof(float));
  }
}

typedef struct {
  float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv; /* whole sequence */
} whole_t;

static whole_t whole(const shape_t *s) {
  size_t nq = (size_t)s->b * s->t * s->h * s->d, nk = (size_t)s->b * s->t * s->kv * s->d;
  whole_t w = {frand(nq, 1), frand(nk, 2), frand(nk, 3), calloc(nq, 4), calloc((size_t)s->b * s->h * s->t, 4),
               frand(nq, 4), calloc(nq, 4), calloc(nk, 4), calloc(nk, 4)};
  be->attention_fwd(be, w.out, w.lse, w.q, w.k, w.v, s->b, s->t, s->h, s->kv, s->d, DT_F32);
  be->attention_bwd(be, w.dq, w.dk, w.dv, w.dout, w.q, w.k, w.v, w.out, w.lse, s->b, s->t, s->h, s->kv, s->d, DT_F32);
  return w;
}

static void whole_free(whole_t *w) {
  float *all[] = {w->q, w->k, w->v, w->out, w->lse, w->dout, w->dq, w->dk, w->dv};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    free(all[i]);
}

/* Forward and backward by blocks over n chunks, key chunks visited in the order
 * (i + step * dir) mod n from query chunk i (a ring in either direction). */
static void by_blocks(const shape_t *s, const whole_t *w, int n, int dir, const char *label) {
  const int b = s->b, t = s->t, h = s->h, kv = s->kv, d = s->d, c = t / n, qw = h * d, kw = kv * d;
  size_t nq = (size_t)b * t * qw, nk = (size_t)b * t * kw, cq = (size_t)b * c * qw, ck = (size_t)b * c * kw;
  float *out = calloc(nq, 4), *lse = calloc((size_t)b * h * t, 4), *dq = calloc(nq, 4), *dk = calloc(nk, 4),
        *dv = calloc(nk, 4);
  float *q_c = malloc(cq * 4), *k_c = malloc(ck * 4), *v_c = malloc(ck * 4), *o_c = malloc(cq * 4),
        *l_c = malloc((size_t)b * h * c * 4), *ob = malloc(cq * 4), *lb = malloc((size_t)b * h * c * 4),
        *do_c = malloc(cq * 4), *dq_c = malloc(cq * 4), *dk_c = malloc(ck * 4), *dv_c = malloc(ck * 4);
  for (int i = 0; i < n; i++) { /* forward: query chunk i against every key chunk */
    chunk_rows(q_c, w->q, b, t, qw, i * c, c, 0);
    memset(o_c, 0, cq * 4);
    for (size_t x = 0; x < (size_t)b * h * c; x++)
      l_c[x] = -INFINITY;
    for (int step = 0; step < n; step++) {
      int j = ((i + dir * step) % n + n) % n;
      chunk_rows(k_c, w->k, b, t, kw, j * c, c, 0);
      chunk_rows(v_c, w->v, b, t, kw, j * c, c, 0);
      be->attention_fwd_block(be, ob, lb, q_c, k_c, v_c, b, c, c, h, kv, d, (long)i * c, (long)j * c, DT_F32);
      be->attention_merge(be, o_c, l_c, ob, lb, b, c, h, d);
    }
    chunk_rows(o_c, out, b, t, qw, i * c, c, 1);
    chunk_lse(l_c, lse, b, h, t, i * c, c, 1);
  }
  char what[128];
  snprintf(what, sizeof what, "%s: out vs attention_fwd", label);
  check(what, max_rel(out, w->out, nq), TOL);
  snprintf(what, sizeof what, "%s: lse vs attention_fwd", label);
  check(what, max_rel(lse, w->lse, (size_t)b * h * t), TOL);
  for (int j = 0; j < n; j++) { /* backward: a key chunk's gradients gather from every query chunk */
    chunk_rows(k_c, w->k, b, t, kw, j * c, c, 0);
    chunk_rows(v_c, w->v, b, t, kw, j * c, c, 0);
    memset(dk_c, 0, ck * 4);
    memset(dv_c, 0, ck * 4);
    for (int step = 0; step < n; step++) {
      int i = ((j - dir * step) % n + n) % n;
      chunk_rows(q_c, w->q, b, t, qw, i * c, c, 0);
      chunk_rows(o_c, w->out, b, t, qw, i * c, c, 0);
      chunk_rows(do_c, w->dout, b, t, qw, i * c, c, 0);
      chunk_lse(l_c, w->lse, b, h, t, i * c, c, 0);
      chunk_rows(dq_c, dq, b, t, qw, i * c, c, 0);
      be->attention_bwd_block(be, dq_c, dk_c, dv_c, do_c, q_c, k_c, v_c, o_c, l_c, b, c, c, h, kv, d, (long)i * c,
                              (long)j * c, DT_F32);
      chunk_rows(dq_c, dq, b, t, qw, i * c, c, 1);
    }
    chunk_rows(dk_c, dk, b, t, kw, j * c, c, 1);
    chunk_rows(dv_c, dv, b, t, kw, j * c, c, 1);
  }
  snprintf(what, sizeof what, "%s: dq vs attention_bwd", label);
  check(what, max_rel(dq, w->dq, nq), TOL);
  snprintf(what, sizeof what, "%s: dk vs attention_bwd", label);
  check(what, max_rel(dk, w->dk, nk), TOL);
  snprintf(what, sizeof what, "%s: dv vs attention_bwd", label);
  check(what, max_rel(dv, w->dv, nk), TOL);
  float *all[] = {out, lse, dq, dk, dv, q_c, k_c, v_c, o_c, l_c, ob, lb, do_c, dq_c, dk_c, dv_c};
  for (size_t x = 0; x < sizeof all / sizeof *all; x++)
    free(all[x]);
}

/* cp = 1, 2, 4 (2, 4, 8 chunks), rings both ways; GQA, MHA; chunks shorter and longer than the
 * cpu kernel's 64-row block. */
static void test_blocks_make_attention(void **state) {
  (void)state;
  const shape_t shapes[] = {{2, 96, 4, 2, 16}, {1, 160, 2, 2, 8}, {2, 48, 6, 1, 8}};
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    const shape_t *s = &shapes[si];
    whole_t w = whole(s);
    for (int cp = 1; cp <= 4; cp *= 2) {
      if (s->t % (2 * cp)) continue;
      for (int dir = -1; dir <= 1; dir += 2) {
        char label[96];
        snprintf(label, sizeof label, "b%d t%d h%d kv%d d%d cp%d ring%+d", s->b, s->t, s->h, s->kv, s->d, cp, dir);
        by_blocks(s, &w, 2 * cp, dir, label);
      }
    }
    whole_free(&w);
  }
}

/* The one block at positions 0 is attention_fwd/bwd bit for bit; a block in the future gives
 * out 0, lse -inf, no gradient, and merging it changes nothing. */
static void test_block_edges(void **state) {
  (void)state;
  const shape_t s = {2, 67, 4, 2, 8};
  whole_t w = whole(&s);
  size_t nq = (size_t)s.b * s.t * s.h * s.d, nk = (size_t)s.b * s.t * s.kv * s.d, nl = (size_t)s.b * s.h * s.t;
  float *out = malloc(nq * 4), *lse = malloc(nl * 4), *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
  be->attention_fwd_block(be, out, lse, w.q, w.k, w.v, s.b, s.t, s.t, s.h, s.kv, s.d, 0, 0, DT_F32);
  be->attention_bwd_block(be, dq, dk, dv, w.dout, w.q, w.k, w.v, w.out, w.lse, s.b, s.t, s.t, s.h, s.kv, s.d, 0, 0,
                          DT_F32);
  int same = !memcmp(out, w.out, nq * 4) && !memcmp(lse, w.lse, nl * 4) && !memcmp(dq, w.dq, nq * 4) &&
             !memcmp(dk, w.dk, nk * 4) && !memcmp(dv, w.dv, nk * 4);
  printf("  one block at positions 0 == attention_fwd/bwd bit for bit: %s\n", same ? "yes" : "no");
  assert_true(same);

  /* queries at 0..66 against keys at 67..133: nothing seen */
  float *ob = malloc(nq * 4), *lb = malloc(nl * 4);
  be->attention_fwd_block(be, ob, lb, w.q, w.k, w.v, s.b, s.t, s.t, s.h, s.kv, s.d, 0, s.t, DT_F32);
  size_t bad = 0;
  for (size_t i = 0; i < nq; i++)
    bad += ob[i] != 0.0f;
  for (size_t i = 0; i < nl; i++)
    bad += lb[i] != -INFINITY;
  memset(dq, 0, nq * 4);
  memset(dk, 0, nk * 4);
  memset(dv, 0, nk * 4);
  be->attention_bwd_block(be, dq, dk, dv, w.dout, w.q, w.k, w.v, w.out, w.lse, s.b, s.t, s.t, s.h, s.kv, s.d, 0, s.t,
                          DT_F32);
  for (size_t i = 0; i < nq; i++)
    bad += dq[i] != 0.0f;
  for (size_t i = 0; i < nk; i++)
    bad += dk[i] != 0.0f || dv[i] != 0.0f;
  be->attention_merge(be, out, lse, ob, lb, s.b, s.t, s.h, s.d);
  bad += memcmp(out, w.out, nq * 4) != 0;
  bad += memcmp(lse, w.lse, nl * 4) != 0;
  printf("  future block: nonzero outputs/gradients or a changed merge: %zu (expected 0)\n", bad);
  assert_int_equal(bad, 0);
  float *all[] = {out, lse, dq, dk, dv, ob, lb};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    free(all[i]);
  whole_free(&w);
}

/* bf16 inputs are widened exactly: the bf16 block equals the fp32 block on the widened inputs
 * bit for bit (outputs and gradients are fp32 in both). */
static void test_block_bf16(void **state) {
  (void)state;
  const shape_t s = {2, 40, 4, 2, 8};
  const int c = 20;
  size_t nq = (size_t)s.b * c * s.h * s.d, nk = (size_t)s.b * c * s.kv * s.d, nl = (size_t)s.b * s.h * c;
  float *src[4] = {frand(nq, 11), frand(nk, 12), frand(nk, 13), frand(nq, 14)}; /* q k v dout */
  size_t n[4] = {nq, nk, nk, nq};
  bf16_t *h[4];
  for (int i = 0; i < 4; i++) { /* round, then widen back: both runs see the same values */
    h[i] = malloc(n[i] * sizeof(bf16_t));
    for (size_t j = 0; j < n[i]; j++) {
      h[i][j] = bf16_from_f32(src[i][j]);
      src[i][j] = bf16_to_f32(h[i][j]);
    }
  }
  float *o32 = malloc(nq * 4), *l32 = malloc(nl * 4), *o16 = malloc(nq * 4), *l16 = malloc(nl * 4);
  be->attention_fwd_block(be, o32, l32, src[0], src[1], src[2], s.b, c, c, s.h, s.kv, s.d, c, 0, DT_F32);
  be->attention_fwd_block(be, o16, l16, h[0], h[1], h[2], s.b, c, c, s.h, s.kv, s.d, c, 0, DT_BF16);
  int same = !memcmp(o32, o16, nq * 4) && !memcmp(l32, l16, nl * 4);
  bf16_t *oh = malloc(nq * sizeof(bf16_t));
  for (size_t j = 0; j < nq; j++) { /* the bwd block reads out in dt */
    oh[j] = bf16_from_f32(o32[j]);
    o32[j] = bf16_to_f32(oh[j]);
  }
  float *g32[3] = {calloc(nq, 4), calloc(nk, 4), calloc(nk, 4)}, *g16[3] = {calloc(nq, 4), calloc(nk, 4), calloc(nk, 4)};
  be->attention_bwd_block(be, g32[0], g32[1], g32[2], src[3], src[0], src[1], src[2], o32, l32, s.b, c, c, s.h, s.kv,
                          s.d, c, 0, DT_F32);
  be->attention_bwd_block(be, g16[0], g16[1], g16[2], h[3], h[0], h[1], h[2], oh, l32, s.b, c, c, s.h, s.kv, s.d, c, 0,
                          DT_BF16);
  same = same && !memcmp(g32[0], g16[0], nq * 4) && !memcmp(g32[1], g16[1], nk * 4) && !memcmp(g32[2], g16[2], nk * 4);
  printf("  bf16 block (queries at %d, keys at 0) == fp32 block on the widened inputs bit for bit: %s\n", c,
         same ? "yes" : "no");
  assert_true(same);
  for (int i = 0; i < 4; i++) {
    free(src[i]);
    free(h[i]);
  }
  for (int i = 0; i < 3; i++) {
    free(g32[i]);
    free(g16[i]);
  }
  free(o32), free(l32), free(o16), free(l16), free(oh);
}

static int setup(void **state) {
  (void)state;
  char err[256];
  be = backend_cpu_create(2, err, sizeof err);
  return be && be->attention_fwd_block && be->attention_merge && be->attention_bwd_block ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  backend_destroy(be);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_blocks_make_attention),
      cmocka_unit_test(test_block_edges),
      cmocka_unit_test(test_block_bf16),
  };
  return cmocka_run_group_tests_name("attention_blocks", tests, setup, teardown);
}
