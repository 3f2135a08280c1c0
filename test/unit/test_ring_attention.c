// deps: test/support/fixture.c trainer/model/ring_attention.c trainer/parallel/mesh.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/err.c common/env.c trainer/backend/fatal.c
/* test_ring_attention: causal attention split over a context-parallel ring of real processes
 * (test/support/fixture: forked ranks, a store, loopback; the mesh's cp channels) equals the
 * attention of the whole sequence.
 *
 * Every rank builds the same q, k, v and dout of the whole sequence (same seed), takes its two
 * chunks (cp rank r: chunks r and 2 cp - 1 - r, chunk-major), and runs ring_attention_fwd and
 * ring_attention_bwd; its out, lse, dq, dk and dv are compared with the rows of its chunks in
 * attention_fwd / attention_bwd of the whole sequence on the cpu backend. fp32: tolerance 1e-5
 * relative to the tensor's max |value| (the two differ in summation order and the merge's
 * rescaling only). bf16 (inputs rounded to bf16, both sides): 1e-2 (the outputs are rounded to
 * bf16 once on each side, from fp32 values that differ as the fp32 ones do: up to one bf16 ulp,
 * 2^-8 relative). cp = 2, 3 and 4; GQA; chunks of 20 rows and of 70 (past the cpu kernel's
 * 64-row block); micro-batches of 2. Each check prints the observed error.
 *
 * The variants (ring_attention_set_rotate) run too: the ring without overlap must give the
 * ring's bits exactly (the same blocks in the same order, only the waits move), and allgather
 * the ring's forward bits exactly (the same blocks merged in the same order) and its backward
 * within the tolerance above (the K/V gradients are summed by a reduce-scatter instead of along
 * the ring). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/fixture.h"
#include "trainer/backend/backend.h"
#include "trainer/backend/bf16.h"
#include "trainer/model/ring_attention.h"
#include "trainer/model/rng.h"
#include "trainer/parallel/mesh.h"

#define CHILD_ALARM_S 120
#define TIMEOUT_MS 30000

typedef struct {
  int b, c, h, kv, d;
  dtype_t dt;
  double tol;
} ring_case_t;

static void *rand_dt(size_t n, uint64_t stream, dtype_t dt) {
  rng_t r;
  rng_init(&r, 3, stream);
  void *x = malloc(n * dtype_size(dt));
  for (size_t i = 0; i < n; i++) {
    float v = (float)rng_normal(&r);
    if (dt == DT_BF16)
      ((bf16_t *)x)[i] = bf16_from_f32(v);
    else
      ((float *)x)[i] = v;
  }
  return x;
}

static double get(const void *x, size_t i, dtype_t dt) {
  return dt == DT_BF16 ? bf16_to_f32(((const bf16_t *)x)[i]) : ((const float *)x)[i];
}

/* Rows [g c, g c + c) of every sequence of x (B, T, W) for this rank's two chunks, chunk-major:
 * out (2, B, c, W). */
static void take_chunks(void *out, const void *x, int b, int t, int c, int w, const int g[2], size_t es) {
  for (int i = 0; i < 2; i++)
    for (int bi = 0; bi < b; bi++)
      memcpy((char *)out + (((size_t)i * b + bi) * c) * w * es, (const char *)x + ((size_t)bi * t + g[i] * c) * w * es,
             (size_t)c * w * es);
}

/* The same for lse (B, H, T) -> (2, B, H, c). */
static void take_lse(float *out, const float *x, int b, int h, int t, int c, const int g[2]) {
  for (int i = 0; i < 2; i++)
    for (int bh = 0; bh < b * h; bh++)
      memcpy(out + ((size_t)i * b * h + bh) * c, x + (size_t)bh * t + g[i] * c, (size_t)c * sizeof(float));
}

/* max |a - ref| / max |ref| over n elements; printed with what. */
static int compare(int rank, const char *what, const void *a, const void *ref, size_t n, dtype_t dt, double tol) {
  double md = 0, mr = 0;
  for (size_t i = 0; i < n; i++) {
    double x = get(a, i, dt), y = get(ref, i, dt);
    md = fmax(md, fabs(x - y));
    mr = fmax(mr, fabs(y));
    if (!isfinite(x)) md = INFINITY;
  }
  double rel = mr > 0 ? md / mr : md;
  printf("  rank %d %-40s max rel err %.3e (tol %.0e)\n", rank, what, rel, tol);
  return !(rel <= tol);
}

/* Bytes a and b (n each) equal: 0, else prints and 1. */
static int same_bits(int rank, const char *what, const void *a, const void *b, size_t n) {
  int same = !memcmp(a, b, n);
  printf("  rank %d %-40s %s\n", rank, what, same ? "bit for bit the ring's" : "DIFFERS from the ring's");
  return !same;
}

/* The ring without overlap and allgather against the ring's results (ro, rl, rdq, rdk, rdv). */
static int variants(int rank, ring_attention_t *ring, comm_t *group, const void *q, const void *k, const void *v,
                    const void *dout, const void *ro, const float *rl, const void *rdq, const void *rdk,
                    const void *rdv, int b, size_t lq, size_t lk, size_t ll, double tol) {
  const size_t es = dtype_size(ring->dt);
  void *o = malloc(lq * es), *dq = malloc(lq * es), *dk = malloc(lk * es), *dv = malloc(lk * es);
  float *l = malloc(ll * sizeof(float));
  char err[256];
  int bad = 0;
  for (int variant = 0; variant < 2 && !bad; variant++) {
    if (ring_attention_set_rotate(ring, variant ? RING_ROTATE_ALLGATHER : RING_ROTATE_RING, variant, group, err,
                                  sizeof err) ||
        ring_attention_fwd(ring, o, l, q, k, v, b) || ring_attention_bwd(ring, dq, dk, dv, dout, q, k, v, o, l, b)) {
      fprintf(stderr, "rank %d: %s%s\n", rank, err, ring_attention_errmsg(ring));
      bad = 1;
      break;
    }
    const char *name = variant ? "allgather" : "ring without overlap";
    char what[96];
    snprintf(what, sizeof what, "%s: out and lse", name);
    bad |= same_bits(rank, what, o, ro, lq * es) | (memcmp(l, rl, ll * sizeof(float)) != 0);
    if (!variant) {
      snprintf(what, sizeof what, "%s: dq, dk, dv", name);
      bad |= same_bits(rank, what, dq, rdq, lq * es) | (memcmp(dk, rdk, lk * es) != 0) | (memcmp(dv, rdv, lk * es) != 0);
    } else {
      bad |= compare(rank, "allgather: dq against the ring's", dq, rdq, lq, ring->dt, tol);
      bad |= compare(rank, "allgather: dk against the ring's", dk, rdk, lk, ring->dt, tol);
      bad |= compare(rank, "allgather: dv against the ring's", dv, rdv, lk, ring->dt, tol);
    }
  }
  free(o), free(dq), free(dk), free(dv), free(l);
  return bad;
}

static int rank_ring(int rank, int n, store_t *st, void *arg) {
  const ring_case_t *k = arg;
  const int cp = n, b = k->b, c = k->c, h = k->h, kv = k->kv, d = k->d, t = 2 * cp * c;
  const dtype_t dt = k->dt;
  const size_t es = dtype_size(dt), nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  char err[512] = "";
  int dims[MESH_NDIMS] = {0};
  dims[MESH_PP] = dims[MESH_DP_REPLICATE] = dims[MESH_DP_SHARD] = dims[MESH_TP] = 1;
  dims[MESH_CP] = cp;
  mesh_t *m = NULL;
  backend_t *be = backend_cpu_create(1, err, sizeof err);
  ring_attention_t ring;
  if (!be || mesh_create_dims(&m, dims, rank, n, err, sizeof err) ||
      mesh_connect(m, "cpu", NULL, st, 0, "127.0.0.1", TIMEOUT_MS, err, sizeof err) ||
      ring_attention_init(&ring, be, m->cp.send, m->cp.recv, cp, m->coord[MESH_CP], b, c, h, kv, d, dt, err,
                          sizeof err)) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    return 1;
  }
  /* the whole sequence, the same on every rank */
  void *q = rand_dt(nq, 1, dt), *kk = rand_dt(nk, 2, dt), *v = rand_dt(nk, 3, dt), *dout = rand_dt(nq, 4, dt);
  void *out = malloc(nq * es), *dq = malloc(nq * es), *dk = malloc(nk * es), *dv = malloc(nk * es);
  float *lse = malloc((size_t)b * h * t * sizeof(float));
  be->attention_fwd(be, out, lse, q, kk, v, b, t, h, kv, d, dt);
  be->attention_bwd(be, dq, dk, dv, dout, q, kk, v, out, lse, b, t, h, kv, d, dt);
  /* this rank's chunks of everything */
  const int g[2] = {ring_attention_chunk(&ring, 0), ring_attention_chunk(&ring, 1)};
  const size_t lq = (size_t)2 * b * c * h * d, lk = (size_t)2 * b * c * kv * d, ll = (size_t)2 * b * h * c;
  void *mq = malloc(lq * es), *mk = malloc(lk * es), *mv = malloc(lk * es), *mdo = malloc(lq * es);
  void *want_o = malloc(lq * es), *want_dq = malloc(lq * es), *want_dk = malloc(lk * es), *want_dv = malloc(lk * es);
  float *want_l = malloc(ll * sizeof(float));
  take_chunks(mq, q, b, t, c, h * d, g, es);
  take_chunks(mk, kk, b, t, c, kv * d, g, es);
  take_chunks(mv, v, b, t, c, kv * d, g, es);
  take_chunks(mdo, dout, b, t, c, h * d, g, es);
  take_chunks(want_o, out, b, t, c, h * d, g, es);
  take_chunks(want_dq, dq, b, t, c, h * d, g, es);
  take_chunks(want_dk, dk, b, t, c, kv * d, g, es);
  take_chunks(want_dv, dv, b, t, c, kv * d, g, es);
  take_lse(want_l, lse, b, h, t, c, g);

  void *ro = malloc(lq * es), *rdq = malloc(lq * es), *rdk = malloc(lk * es), *rdv = malloc(lk * es);
  float *rl = malloc(ll * sizeof(float));
  int bad = 0;
  if (ring_attention_fwd(&ring, ro, rl, mq, mk, mv, b) ||
      ring_attention_bwd(&ring, rdq, rdk, rdv, mdo, mq, mk, mv, ro, rl, b)) {
    fprintf(stderr, "rank %d: %s\n", rank, ring_attention_errmsg(&ring));
    bad = 1;
  }
  bad |= variants(rank, &ring, mesh_comm(m, "cp"), mq, mk, mv, mdo, ro, rl, rdq, rdk, rdv, b, lq, lk, ll, k->tol);
  char what[96];
  snprintf(what, sizeof what, "cp%d %s out (chunks %d, %d)", cp, dtype_name(dt), g[0], g[1]);
  bad |= compare(rank, what, ro, want_o, lq, dt, k->tol);
  snprintf(what, sizeof what, "cp%d %s lse", cp, dtype_name(dt));
  bad |= compare(rank, what, rl, want_l, ll, DT_F32, dt == DT_F32 ? k->tol : 1e-5);
  snprintf(what, sizeof what, "cp%d %s dq", cp, dtype_name(dt));
  bad |= compare(rank, what, rdq, want_dq, lq, dt, k->tol);
  snprintf(what, sizeof what, "cp%d %s dk", cp, dtype_name(dt));
  bad |= compare(rank, what, rdk, want_dk, lk, dt, k->tol);
  snprintf(what, sizeof what, "cp%d %s dv", cp, dtype_name(dt));
  bad |= compare(rank, what, rdv, want_dv, lk, dt, k->tol);
  void *all[] = {q, kk, v, dout, out, dq, dk, dv, lse, mq, mk, mv, mdo, want_o, want_dq, want_dk, want_dv, want_l,
                 ro, rdq, rdk, rdv, rl};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    free(all[i]);
  ring_attention_free(&ring);
  mesh_destroy(m);
  backend_destroy(be);
  return bad;
}

static void run(int cp, ring_case_t k) { assert_int_equal(fixture_run_ranks(cp, rank_ring, &k, CHILD_ALARM_S), 0); }

static void test_ring_fp32(void **state) {
  (void)state;
  run(2, (ring_case_t){2, 20, 4, 2, 8, DT_F32, 1e-5});
  run(3, (ring_case_t){2, 20, 4, 2, 8, DT_F32, 1e-5});
  run(4, (ring_case_t){1, 70, 2, 1, 16, DT_F32, 1e-5});
}

static void test_ring_bf16(void **state) {
  (void)state;
  run(2, (ring_case_t){2, 20, 4, 2, 8, DT_BF16, 1e-2});
  run(4, (ring_case_t){1, 24, 4, 4, 16, DT_BF16, 1e-2});
}

/* Refusals of init: a ring of one, a rank outside it, no channels. */
static void test_ring_refusals(void **state) {
  (void)state;
  char err[256];
  backend_t *be = backend_cpu_create(1, err, sizeof err);
  ring_attention_t r;
  comm_t *fake = (comm_t *)1; /* never used: init refuses before */
  assert_int_equal(ring_attention_init(&r, be, fake, fake, 1, 0, 1, 4, 2, 2, 8, DT_F32, err, sizeof err), RING_EINVAL);
  printf("  %s\n", err);
  assert_int_equal(ring_attention_init(&r, be, fake, fake, 2, 2, 1, 4, 2, 2, 8, DT_F32, err, sizeof err), RING_EINVAL);
  assert_int_equal(ring_attention_init(&r, be, NULL, fake, 2, 0, 1, 4, 2, 2, 8, DT_F32, err, sizeof err), RING_EINVAL);
  assert_non_null(strstr(err, "bad geometry"));
  backend_destroy(be);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ring_fp32),
      cmocka_unit_test(test_ring_bf16),
      cmocka_unit_test(test_ring_refusals),
  };
  return cmocka_run_group_tests_name("ring_attention", tests, NULL, NULL);
}
