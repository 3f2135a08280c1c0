// deps: test/support/fixture.c trainer/comm.c trainer/comm_cpu.c trainer/comm_staged.c trainer/mesh.c trainer/backend.c trainer/backend_cpu.c trainer/rng.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c
/* test_comm_staged: the staged comm backend (device buffers through host memory, reduced by an
 * inner cpu communicator) against the cpu backend, with real forked ranks and a store server.
 *
 * Every rank runs each collective twice on the same random floats: once on host memory with a
 * "cpu" communicator, once on "device" memory with a "staged" one, and compares the results
 * bit for bit (tolerance 0: staged reduces with the same ring in the same order, so any
 * difference is a bug). Two devices play the GPU: the cpu backend itself, and a fake device
 * whose pointers are host pointers with a high bit set, so that any direct dereference of device
 * memory (a memcpy that should have been a to_host) crashes instead of passing unnoticed. Also:
 * the configuration errors, that a peer's exit fails the others with a message naming the
 * group and the operation, and a mesh connected with "staged": every group's device comm moves
 * fake-device buffers while its host comm (a "cpu" ring of its own) moves host values. The bf16
 * tests run every collective on 2-byte elements (see their section for what and how exactly).
 * Needs no GPU. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "test/support/fixture.h"
#include "trainer/backend.h"
#include "trainer/bf16.h"
#include "trainer/comm.h"
#include "trainer/mesh.h"

#define ALARM_S 60
#define TIMEOUT_MS 20000

/* ---- the fake device: host memory behind tagged pointers ---- */

#define FAKE_TAG ((uintptr_t)1 << 62) /* makes the address non-canonical: dereferencing faults */

static void *untag(const void *p) { return (void *)((uintptr_t)p ^ FAKE_TAG); }

/* Live allocations, so that every copy is checked against the buffer it touches: a size computed
 * with the wrong element size runs past the end and aborts the rank here, even where the bytes
 * beyond would have come back unchanged. */
#define FAKE_MAX_ALLOCS 32
static struct {
  uintptr_t base;
  size_t bytes;
} fake_allocs[FAKE_MAX_ALLOCS];

static void *fake_alloc(backend_t *be, size_t bytes) {
  void *p = calloc(1, bytes ? bytes : 1);
  if (!p) return NULL;
  for (int i = 0; i < FAKE_MAX_ALLOCS; i++)
    if (!fake_allocs[i].base) {
      fake_allocs[i].base = (uintptr_t)p ^ FAKE_TAG;
      fake_allocs[i].bytes = bytes;
      return (void *)fake_allocs[i].base;
    }
  free(p);
  return NULL;
}
static void fake_free(backend_t *be, void *p) {
  if (!p) return;
  for (int i = 0; i < FAKE_MAX_ALLOCS; i++)
    if (fake_allocs[i].base == (uintptr_t)p) fake_allocs[i].base = 0;
  free(untag(p));
}
static void fake_check(const void *p, size_t n, const char *what) {
  uintptr_t a = (uintptr_t)p;
  for (int i = 0; i < FAKE_MAX_ALLOCS; i++)
    if (fake_allocs[i].base && a >= fake_allocs[i].base && n <= fake_allocs[i].bytes &&
        a - fake_allocs[i].base <= fake_allocs[i].bytes - n)
      return;
  fprintf(stderr, "fake device: %s of %zu bytes at %p is outside every allocation\n", what, n, p);
  abort();
}
static void fake_to_device(backend_t *be, void *dst, const void *src, size_t n) {
  fake_check(dst, n, "to_device");
  memcpy(untag(dst), src, n);
}
static void fake_to_host(backend_t *be, void *dst, const void *src, size_t n) {
  fake_check(src, n, "to_host");
  memcpy(dst, untag(src), n);
}
static void fake_copy(backend_t *be, void *dst, const void *src, size_t n) {
  fake_check(dst, n, "copy to");
  fake_check(src, n, "copy from");
  memmove(untag(dst), untag(src), n);
}
static void fake_sync(backend_t *be) {}

static backend_t fake_device = {.name = "fake", .alloc = fake_alloc, .free = fake_free,
                                .to_device = fake_to_device, .to_host = fake_to_host,
                                .copy = fake_copy, .synchronize = fake_sync};

/* ---- helpers ---- */

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Floats in [-1, 1) with full mantissas, so that the summation order shows in the bits. */
static void fill(float *x, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; i++) x[i] = (float)((double)(rng_next(&s) >> 11) / 4503599627370496.0 - 1.0);
}

/* Returns 0 when equal, else prints the first difference. */
static int same(const char *what, int rank, const float *want, const float *got, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&want[i], &got[i], sizeof(float)) != 0) {
      fprintf(stderr, "rank %d: %s: element %zu: staged %.9g, cpu %.9g (tolerance 0)\n", rank, what, i,
              (double)got[i], (double)want[i]);
      return 1;
    }
  return 0;
}

static int open_staged(comm_t **c, const char *name, int rank, int n, store_t *st, backend_t *dev) {
  char err[COMM_ERR_MAX] = "";
  comm_config_t cfg = {.name = name, .rank = rank, .size = n, .store = st, .host = "127.0.0.1",
                       .timeout_ms = TIMEOUT_MS, .device = dev};
  int rc = comm_create(c, "staged", &cfg, err, sizeof err);
  if (rc) fprintf(stderr, "rank %d: comm_create staged: %s\n", rank, err);
  return rc;
}

/* The device under test, by the test's argument. */
typedef enum { DEV_CPU_BACKEND, DEV_FAKE } dev_kind_t;

static backend_t *device_open(dev_kind_t kind) {
  if (kind == DEV_FAKE) return &fake_device;
  char err[256];
  backend_t *be = backend_cpu_create(1, err, sizeof err);
  if (!be) fprintf(stderr, "backend_cpu_create: %s\n", err);
  return be;
}

static void device_close(backend_t *be) {
  if (be && be != &fake_device) backend_destroy(be);
}

/* ---- every collective, staged vs cpu ---- */

static const size_t counts[] = {1, 7, 1000, 4099}; /* 4099: not divisible by 3 or 4 */
static const comm_op_t ops[] = {COMM_SUM, COMM_AVG, COMM_MAX};

static int rank_equivalence(int rank, int n, store_t *st, void *arg) {
  dev_kind_t kind = *(const dev_kind_t *)arg;
  backend_t *dev = device_open(kind);
  comm_t *ref = NULL, *stg = NULL;
  int bad = 0;
  if (!dev || fixture_comm_open(&ref, "ref", rank, n, st, TIMEOUT_MS) ||
      open_staged(&stg, "stg", rank, n, st, dev)) {
    bad = 1;
    goto done;
  }
  const size_t maxn = 4099 * 4;
  float *h = malloc(maxn * sizeof(float)), *want = malloc(maxn * sizeof(float));
  float *got = malloc(maxn * sizeof(float));
  float *d = dev->alloc(dev, maxn * sizeof(float)), *d2 = dev->alloc(dev, maxn * sizeof(float));
  if (!h || !want || !got || !d || !d2) {
    fprintf(stderr, "rank %d: out of memory\n", rank);
    bad = 1;
    goto out;
  }
  char what[128];
  for (size_t ci = 0; ci < sizeof counts / sizeof *counts && !bad; ci++) {
    size_t cnt = counts[ci], bytes = cnt * sizeof(float), all = (size_t)n * bytes;
    for (size_t oi = 0; oi < sizeof ops / sizeof *ops && !bad; oi++) {
      comm_op_t op = ops[oi];
      /* all_reduce */
      fill(h, cnt, 100 * (uint64_t)rank + ci);
      memcpy(want, h, bytes);
      dev->to_device(dev, d, h, bytes);
      if (comm_all_reduce(ref, want, cnt, COMM_FLOAT32, op) || comm_all_reduce(stg, d, cnt, COMM_FLOAT32, op)) {
        fprintf(stderr, "rank %d: all_reduce: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
        bad = 1;
        break;
      }
      dev->to_host(dev, got, d, bytes);
      snprintf(what, sizeof what, "all_reduce(%s) of %zu", comm_op_name(op), cnt);
      bad |= same(what, rank, want, got, cnt);
      /* reduce_scatter: input n * cnt, output cnt */
      fill(h, (size_t)n * cnt, 7 + 100 * (uint64_t)rank + ci);
      dev->to_device(dev, d, h, all);
      if (comm_reduce_scatter(ref, h, want, cnt, COMM_FLOAT32, op) ||
          comm_reduce_scatter(stg, d, d2, cnt, COMM_FLOAT32, op)) {
        fprintf(stderr, "rank %d: reduce_scatter: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
        bad = 1;
        break;
      }
      dev->to_host(dev, got, d2, bytes);
      snprintf(what, sizeof what, "reduce_scatter(%s) of %zu", comm_op_name(op), cnt);
      bad |= same(what, rank, want, got, cnt);
    }
    if (bad) break;
    /* all_gather, out of place then in place */
    fill(h, cnt, 13 + 100 * (uint64_t)rank + ci);
    dev->to_device(dev, d, h, bytes);
    memset(got, 0, all);
    dev->to_device(dev, d2, got, all); /* zero the output */
    if (comm_all_gather(ref, h, want, cnt, COMM_FLOAT32) || comm_all_gather(stg, d, d2, cnt, COMM_FLOAT32)) {
      fprintf(stderr, "rank %d: all_gather: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
      bad = 1;
      break;
    }
    dev->to_host(dev, got, d2, all);
    snprintf(what, sizeof what, "all_gather of %zu", cnt);
    bad |= same(what, rank, want, got, (size_t)n * cnt);
    memset(got, 0, all);
    memcpy((char *)got + (size_t)rank * bytes, h, bytes);
    dev->to_device(dev, d2, got, all);
    float *slot = (float *)((char *)d2 + (size_t)rank * bytes);
    memset(want, 0, all);
    memcpy(want + (size_t)rank * cnt, h, bytes);
    if (comm_all_gather(ref, want + (size_t)rank * cnt, want, cnt, COMM_FLOAT32) ||
        comm_all_gather(stg, slot, d2, cnt, COMM_FLOAT32)) {
      fprintf(stderr, "rank %d: all_gather in place: %s\n", rank, comm_errmsg(stg));
      bad = 1;
      break;
    }
    dev->to_host(dev, got, d2, all);
    snprintf(what, sizeof what, "all_gather in place of %zu", cnt);
    bad |= same(what, rank, want, got, (size_t)n * cnt);
    /* broadcast from the last rank (not 0, so the root's position matters) */
    fill(h, cnt, 21 + 100 * (uint64_t)rank + ci);
    memcpy(want, h, bytes);
    dev->to_device(dev, d, h, bytes);
    if (comm_broadcast(ref, want, cnt, COMM_FLOAT32, n - 1) || comm_broadcast(stg, d, cnt, COMM_FLOAT32, n - 1)) {
      fprintf(stderr, "rank %d: broadcast: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
      bad = 1;
      break;
    }
    dev->to_host(dev, got, d, bytes);
    snprintf(what, sizeof what, "broadcast of %zu", cnt);
    bad |= same(what, rank, want, got, cnt);
  }
  if (!bad && (comm_barrier(ref) || comm_barrier(stg))) {
    fprintf(stderr, "rank %d: barrier: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
    bad = 1;
  }
  /* The inner ring moved what the cpu one moved. */
  comm_stats_t a, b;
  comm_get_stats(ref, &a);
  comm_get_stats(stg, &b);
  if (!bad && (a.bytes_sent != b.bytes_sent || a.bytes_recv != b.bytes_recv || a.calls != b.calls)) {
    fprintf(stderr, "rank %d: stats differ: cpu sent %llu recv %llu calls %llu, staged %llu %llu %llu\n", rank,
            (unsigned long long)a.bytes_sent, (unsigned long long)a.bytes_recv, (unsigned long long)a.calls,
            (unsigned long long)b.bytes_sent, (unsigned long long)b.bytes_recv, (unsigned long long)b.calls);
    bad = 1;
  }
out:
  if (d) dev->free(dev, d);
  if (d2) dev->free(dev, d2);
  free(h);
  free(want);
  free(got);
done:
  comm_destroy(stg);
  comm_destroy(ref);
  device_close(dev);
  if (!bad && rank == 0) printf("staged == cpu, bit for bit, on %d ranks\n", n);
  return bad;
}

static void test_equivalence_cpu_backend(void **state) {
  dev_kind_t k = DEV_CPU_BACKEND;
  assert_int_equal(fixture_run_ranks(3, rank_equivalence, &k, ALARM_S), 0);
  assert_int_equal(fixture_run_ranks(4, rank_equivalence, &k, ALARM_S), 0);
}

static void test_equivalence_fake_device(void **state) {
  dev_kind_t k = DEV_FAKE;
  assert_int_equal(fixture_run_ranks(3, rank_equivalence, &k, ALARM_S), 0);
  assert_int_equal(fixture_run_ranks(2, rank_equivalence, &k, ALARM_S), 0);
}

/* One rank: the dispatch answers, but its local copies still go through the device. */
static int rank_single(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL;
  if (open_staged(&c, "one", 0, 1, st, &fake_device)) return 1;
  float h[5] = {1, 2, 3, 4, 5}, got[5] = {0};
  float *d = fake_alloc(NULL, sizeof h), *d2 = fake_alloc(NULL, sizeof h);
  fake_to_device(NULL, d, h, sizeof h);
  int bad = comm_all_reduce(c, d, 5, COMM_FLOAT32, COMM_SUM) || comm_reduce_scatter(c, d, d2, 5, COMM_FLOAT32, COMM_SUM);
  fake_to_host(NULL, got, d2, sizeof got);
  bad |= same("reduce_scatter on one rank", 0, h, got, 5);
  bad |= comm_all_gather(c, d, d2, 5, COMM_FLOAT32) != 0;
  fake_to_host(NULL, got, d2, sizeof got);
  bad |= same("all_gather on one rank", 0, h, got, 5);
  fake_free(NULL, d);
  fake_free(NULL, d2);
  comm_destroy(c);
  return bad;
}

static void test_single_rank(void **state) { assert_int_equal(fixture_run_ranks(1, rank_single, NULL, ALARM_S), 0); }

static void test_config_errors(void **state) {
  char err[COMM_ERR_MAX] = "";
  comm_t *c = (comm_t *)1;
  comm_config_t cfg = {.name = "nodev", .rank = 0, .size = 1};
  assert_int_equal(comm_create(&c, "staged", &cfg, err, sizeof err), COMM_EINVAL);
  assert_null(c);
  printf("without a device: %s\n", err);
  assert_non_null(strstr(err, "comm_config_t.device"));
  assert_int_equal(comm_create(&c, "warp", &cfg, err, sizeof err), COMM_EINVAL);
  assert_non_null(strstr(err, "unknown backend 'warp'"));
  /* nccl is not linked into this test: a clear message, not a link error or a crash */
  assert_int_equal(comm_create(&c, "nccl", &cfg, err, sizeof err), COMM_EINVAL);
  printf("nccl here: %s\n", err);
  assert_non_null(strstr(err, "nccl"));
}

/* ---- bfloat16 through the staging buffers ----
 *
 * Every collective on 2-byte elements in device memory, on counts that are odd or smaller than
 * the group (2 and 3 when n = 4), each device buffer followed by a guard element that must come
 * back untouched (a size computed with sizeof(float) would overwrite it, or read past the end of
 * a fake-device buffer). Checked four ways:
 *  - exact answers on small integers (every partial sum is a bf16 value; AVG is the sum divided
 *    by n in fp32 and rounded once, MAX the largest), tolerance 0;
 *  - all_gather and broadcast move arbitrary bit patterns (NaN payloads included) untouched;
 *  - random inputs: staged equals the cpu ring bit for bit (tolerance 0), and all_reduce is
 *    within the fp32 reference's tolerance: SUM (n - 1) * 2^-8 * sum|x|, AVG n * 2^-8 * sum|x| / n
 *    (2^-8 per bf16 rounding, 1% slack for the reference's own), MAX exact;
 *  - every rank ends with the same all_reduce bits (hashes compared through the store). */

static const size_t bf_counts[] = {1, 2, 3, 7, 1001, 4099};
#define BF_MAXN 4099
static const uint16_t BF_GUARD = 0x5a5a;

static float ival(int rank, size_t i) { return (float)((int)((i * 31 + (size_t)rank * 17) % 23) - 11); }
static uint16_t bpat(int rank, size_t i) { return (uint16_t)(i * 40503u + (size_t)rank * 7919u + 1u); }

static uint16_t bf_expect(int n, size_t i, comm_op_t op) {
  float sum = 0, mx = ival(0, i);
  for (int r = 0; r < n; r++) {
    sum += ival(r, i);
    if (ival(r, i) > mx) mx = ival(r, i);
  }
  return bf16_from_f32(op == COMM_MAX ? mx : op == COMM_AVG ? sum / (float)n : sum);
}

static uint16_t brnd(int rank, size_t i, uint64_t salt) {
  uint64_t s = (uint64_t)rank * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + salt + 1;
  return bf16_from_f32((float)((double)(rng_next(&s) >> 11) / 4503599627370496.0 - 1.0));
}

static int same_bf16(const char *what, int rank, const uint16_t *want, const uint16_t *got, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (want[i] != got[i]) {
      fprintf(stderr, "rank %d: %s: element %zu of %zu: staged %.9g (0x%04x), want %.9g (0x%04x) (tolerance 0)\n",
              rank, what, i, n, (double)bf16_to_f32(got[i]), got[i], (double)bf16_to_f32(want[i]), want[i]);
      return 1;
    }
  return 0;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t len) {
  const unsigned char *b = p;
  for (size_t i = 0; i < len; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* put copies h[0..n) and a guard element after it to the device; fetch reads both back. */
static void put(backend_t *dev, void *d, uint16_t *h, size_t n) {
  h[n] = BF_GUARD;
  dev->to_device(dev, d, h, (n + 1) * sizeof *h);
}
static void fetch(backend_t *dev, uint16_t *h, const void *d, size_t n) {
  dev->to_host(dev, h, d, (n + 1) * sizeof *h);
}

static int rank_bf16(int rank, int n, store_t *st, void *arg) {
  dev_kind_t kind = *(const dev_kind_t *)arg;
  backend_t *dev = device_open(kind);
  comm_t *ref = NULL, *stg = NULL;
  int bad = 0;
  if (!dev || fixture_comm_open(&ref, "ref16", rank, n, st, TIMEOUT_MS) ||
      open_staged(&stg, "stg16", rank, n, st, dev)) {
    bad = 1;
    goto done;
  }
  const size_t maxn = (size_t)BF_MAXN * (size_t)n + 1;
  uint16_t *h = malloc(maxn * 2), *want = malloc(maxn * 2), *got = malloc(maxn * 2);
  uint16_t *dv = NULL, *dr = NULL, *da = NULL; /* device: count (+ guard), ditto, n * count (+ guard) */
  if (!h || !want || !got) {
    fprintf(stderr, "rank %d: out of memory\n", rank);
    bad = 1;
    goto out;
  }
  char what[128];
  uint64_t hash = 1469598103934665603ull;
  double maxrel[3] = {0, 0, 0};
  for (size_t ci = 0; ci < sizeof bf_counts / sizeof *bf_counts && !bad; ci++) {
    size_t cnt = bf_counts[ci], all = (size_t)n * cnt;
    /* Sized exactly, so that the fake device's bounds check sees any copy past the guard. */
    if (dv) dev->free(dev, dv);
    if (dr) dev->free(dev, dr);
    if (da) dev->free(dev, da);
    dv = dev->alloc(dev, (cnt + 1) * 2);
    dr = dev->alloc(dev, (cnt + 1) * 2);
    da = dev->alloc(dev, (all + 1) * 2);
    if (!dv || !dr || !da) {
      fprintf(stderr, "rank %d: out of device memory\n", rank);
      bad = 1;
      break;
    }
    for (size_t oi = 0; oi < sizeof ops / sizeof *ops && !bad; oi++) {
      comm_op_t op = ops[oi];
      /* all_reduce, exact: small integers */
      for (size_t i = 0; i < cnt; i++) {
        h[i] = bf16_from_f32(ival(rank, i));
        want[i] = bf_expect(n, i, op);
      }
      want[cnt] = BF_GUARD;
      put(dev, dv, h, cnt);
      if (comm_all_reduce(stg, dv, cnt, COMM_BFLOAT16, op)) {
        fprintf(stderr, "rank %d: all_reduce: %s\n", rank, comm_errmsg(stg));
        bad = 1;
        break;
      }
      fetch(dev, got, dv, cnt);
      snprintf(what, sizeof what, "bf16 all_reduce(%s) of %zu small integers, n=%d", comm_op_name(op), cnt, n);
      bad |= same_bf16(what, rank, want, got, cnt + 1);
      /* reduce_scatter, exact: slice rank of the integers */
      for (size_t i = 0; i < all; i++) h[i] = bf16_from_f32(ival(rank, i));
      for (size_t i = 0; i < cnt; i++) want[i] = bf_expect(n, (size_t)rank * cnt + i, op);
      put(dev, da, h, all);
      got[cnt] = BF_GUARD;
      dev->to_device(dev, dr, got, (cnt + 1) * 2);
      if (comm_reduce_scatter(stg, da, dr, cnt, COMM_BFLOAT16, op)) {
        fprintf(stderr, "rank %d: reduce_scatter: %s\n", rank, comm_errmsg(stg));
        bad = 1;
        break;
      }
      fetch(dev, got, dr, cnt);
      snprintf(what, sizeof what, "bf16 reduce_scatter(%s) of %zu small integers, n=%d", comm_op_name(op), cnt, n);
      bad |= same_bf16(what, rank, want, got, cnt + 1);
      /* all_reduce, random: staged == cpu bit for bit, within tolerance of fp32, same on all ranks */
      uint64_t salt = 1000 * ci + oi;
      for (size_t i = 0; i < cnt; i++) want[i] = h[i] = brnd(rank, i, salt);
      want[cnt] = BF_GUARD;
      put(dev, dv, h, cnt);
      if (comm_all_reduce(ref, want, cnt, COMM_BFLOAT16, op) || comm_all_reduce(stg, dv, cnt, COMM_BFLOAT16, op)) {
        fprintf(stderr, "rank %d: all_reduce: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
        bad = 1;
        break;
      }
      fetch(dev, got, dv, cnt);
      snprintf(what, sizeof what, "bf16 all_reduce(%s) of %zu random, n=%d, vs cpu", comm_op_name(op), cnt, n);
      bad |= same_bf16(what, rank, want, got, cnt + 1);
      hash = fnv1a(hash, got, cnt * 2);
      for (size_t i = 0; i < cnt; i++) {
        float fref = op == COMM_MAX ? -INFINITY : 0, mag = 0;
        for (int r = 0; r < n; r++) {
          float x = bf16_to_f32(brnd(r, i, salt));
          fref = op == COMM_MAX ? (x > fref ? x : fref) : fref + x;
          mag += fabsf(x);
        }
        if (op == COMM_AVG) fref /= (float)n, mag /= (float)n;
        double rel = fabs((double)bf16_to_f32(got[i]) - fref) / (mag > 0 ? mag : 1);
        if (rel > maxrel[oi]) maxrel[oi] = rel;
      }
      /* reduce_scatter, random: staged == cpu */
      for (size_t i = 0; i < all; i++) h[i] = brnd(rank, i, salt + 7);
      put(dev, da, h, all);
      if (comm_reduce_scatter(ref, h, want, cnt, COMM_BFLOAT16, op) ||
          comm_reduce_scatter(stg, da, dr, cnt, COMM_BFLOAT16, op)) {
        fprintf(stderr, "rank %d: reduce_scatter: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
        bad = 1;
        break;
      }
      want[cnt] = BF_GUARD; /* dr's guard was put there by the exact reduce_scatter above */
      fetch(dev, got, dr, cnt);
      snprintf(what, sizeof what, "bf16 reduce_scatter(%s) of %zu random, n=%d, vs cpu", comm_op_name(op), cnt, n);
      bad |= same_bf16(what, rank, want, got, cnt + 1);
    }
    if (bad) break;
    /* all_gather of bit patterns, out of place then in place */
    for (size_t i = 0; i < all; i++) want[i] = bpat((int)(i / cnt), i % cnt);
    want[all] = BF_GUARD;
    for (size_t i = 0; i < cnt; i++) h[i] = bpat(rank, i);
    put(dev, dv, h, cnt);
    memset(got, 0, all * 2);
    put(dev, da, got, all);
    if (comm_all_gather(stg, dv, da, cnt, COMM_BFLOAT16)) {
      fprintf(stderr, "rank %d: all_gather: %s\n", rank, comm_errmsg(stg));
      bad = 1;
      break;
    }
    fetch(dev, got, da, all);
    snprintf(what, sizeof what, "bf16 all_gather of %zu, n=%d", cnt, n);
    bad |= same_bf16(what, rank, want, got, all + 1);
    memset(got, 0, all * 2);
    memcpy(got + (size_t)rank * cnt, h, cnt * 2);
    put(dev, da, got, all);
    if (comm_all_gather(stg, da + (size_t)rank * cnt, da, cnt, COMM_BFLOAT16)) {
      fprintf(stderr, "rank %d: all_gather in place: %s\n", rank, comm_errmsg(stg));
      bad = 1;
      break;
    }
    fetch(dev, got, da, all);
    snprintf(what, sizeof what, "bf16 all_gather in place of %zu, n=%d", cnt, n);
    bad |= same_bf16(what, rank, want, got, all + 1);
    /* broadcast of bit patterns from every root */
    for (int root = 0; root < n && !bad; root++) {
      for (size_t i = 0; i < cnt; i++) {
        h[i] = bpat(rank, i);
        want[i] = bpat(root, i);
      }
      want[cnt] = BF_GUARD;
      put(dev, dv, h, cnt);
      if (comm_broadcast(stg, dv, cnt, COMM_BFLOAT16, root)) {
        fprintf(stderr, "rank %d: broadcast: %s\n", rank, comm_errmsg(stg));
        bad = 1;
        break;
      }
      fetch(dev, got, dv, cnt);
      snprintf(what, sizeof what, "bf16 broadcast of %zu from root %d, n=%d", cnt, root, n);
      bad |= same_bf16(what, rank, want, got, cnt + 1);
    }
  }
  for (size_t oi = 0; oi < 3 && !bad; oi++) {
    double tol = ops[oi] == COMM_SUM ? (n - 1) * 0x1p-8 * 1.01 : ops[oi] == COMM_AVG ? n * 0x1p-8 * 1.01 : 0;
    if (rank == 0)
      printf("bf16 all_reduce(%s) n=%d: max relative error vs fp32 %.3g (tolerance %.3g)\n", comm_op_name(ops[oi]),
             n, maxrel[oi], tol);
    if (maxrel[oi] > tol) {
      fprintf(stderr, "rank %d: bf16 all_reduce(%s): relative error %.3g exceeds tolerance %.3g\n", rank,
              comm_op_name(ops[oi]), maxrel[oi], tol);
      bad = 1;
    }
  }
  /* Identical bits on every rank: each publishes its hash of all random all_reduce results. */
  if (!bad) {
    char key[32], mine[32];
    snprintf(key, sizeof key, "bf16hash/%d", rank);
    snprintf(mine, sizeof mine, "%016llx", (unsigned long long)hash);
    bad = store_set(st, key, mine, strlen(mine)) != 0;
    for (int r = 0; r < n && !bad; r++) {
      void *v = NULL;
      size_t len = 0;
      snprintf(key, sizeof key, "bf16hash/%d", r);
      if (store_get(st, key, &v, &len, TIMEOUT_MS) != 0 || len != strlen(mine) || memcmp(v, mine, len) != 0) {
        fprintf(stderr, "rank %d: bf16 all_reduce bits differ from rank %d's (%s vs %.*s)\n", rank, r, mine,
                v ? (int)len : 0, v ? (char *)v : "");
        bad = 1;
      }
      free(v);
    }
  }
out:
  if (dv) dev->free(dev, dv);
  if (dr) dev->free(dev, dr);
  if (da) dev->free(dev, da);
  free(h);
  free(want);
  free(got);
done:
  comm_destroy(stg);
  comm_destroy(ref);
  device_close(dev);
  if (!bad && rank == 0) printf("bf16 staged: exact, == cpu bit for bit, same bits on all %d ranks\n", n);
  return bad;
}

static void test_bf16_fake_device(void **state) {
  dev_kind_t k = DEV_FAKE;
  assert_int_equal(fixture_run_ranks(2, rank_bf16, &k, ALARM_S), 0);
  assert_int_equal(fixture_run_ranks(3, rank_bf16, &k, ALARM_S), 0);
}

static void test_bf16_cpu_backend(void **state) {
  dev_kind_t k = DEV_CPU_BACKEND;
  assert_int_equal(fixture_run_ranks(4, rank_bf16, &k, ALARM_S), 0);
}

/* Rank 2 exits after setup; ranks 0 and 1 must fail (not hang) with a message naming the group
 * and the operation, and stay broken. */
static int rank_peer_exit(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL;
  if (open_staged(&c, "dies", rank, n, st, &fake_device)) return 1;
  if (rank == 2) _exit(0);
  float *d = fake_alloc(NULL, 1000 * sizeof(float));
  int rc = comm_all_reduce(c, d, 1000, COMM_FLOAT32, COMM_SUM);
  const char *msg = comm_errmsg(c);
  int bad = !(rc == COMM_EREMOTE || rc == COMM_ETIMEDOUT) || !strstr(msg, "comm dies (rank") ||
            !strstr(msg, "all_reduce");
  fprintf(stderr, "rank %d: after the peer's exit: %d: %s\n", rank, rc, msg);
  /* the prefix appears once: the inner message was not stacked on ours */
  const char *second = strstr(msg + 1, "comm dies (rank");
  if (second) bad = 1;
  bad |= comm_barrier(c) == COMM_OK;
  fake_free(NULL, d);
  comm_destroy(c);
  return bad;
}

static void test_peer_exit(void **state) { assert_int_equal(fixture_run_ranks(3, rank_peer_exit, NULL, ALARM_S), 0); }

/* ---- a 2x1x2 mesh over "staged": device and host communicators of every group ---- */

static int rank_mesh_staged(int rank, int n, store_t *st, void *arg) {
  char err[512] = "";
  mesh_t *m = NULL;
  if (mesh_create(&m, 2, 1, 2, rank, n, err, sizeof err) ||
      mesh_connect(m, "staged", &fake_device, st, 0, "127.0.0.1", TIMEOUT_MS, err, sizeof err)) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    mesh_destroy(m);
    return 1;
  }
  static const char *names[] = {"dp_replicate", "dp_shard", "tp", "dp", "world"};
  int bad = 0;
  float *d = fake_alloc(NULL, 2 * sizeof(float));
  for (int g = 0; g < 5 && !bad; g++) {
    comm_t *c = mesh_comm(m, names[g]), *h = mesh_host_comm(m, names[g]);
    if (!c || !h || c == h || comm_size(c) != comm_size(h) || comm_rank(c) != comm_rank(h)) {
      fprintf(stderr, "rank %d: group %s: device and host comms missing or not of the same group\n", rank,
              names[g]);
      bad = 1;
      break;
    }
    /* Device memory through the staged comm (a host pointer here would fault in to_host), host
     * memory through the cpu one: both sum 1 + rank over the same members. */
    float x[2] = {1.0f, (float)rank}, y[2] = {1.0f, (float)rank}, got[2];
    fake_to_device(NULL, d, x, sizeof x);
    if (comm_all_reduce(c, d, 2, COMM_FLOAT32, COMM_SUM) || comm_all_reduce(h, y, 2, COMM_FLOAT32, COMM_SUM)) {
      fprintf(stderr, "rank %d: group %s: %s%s\n", rank, names[g], comm_errmsg(c), comm_errmsg(h));
      bad = 1;
      break;
    }
    fake_to_host(NULL, got, d, sizeof got);
    if (got[0] != (float)comm_size(c) || got[0] != y[0] || got[1] != y[1]) {
      fprintf(stderr, "rank %d: group %s: device sum (%g, %g), host sum (%g, %g), size %d\n", rank, names[g],
              got[0], got[1], y[0], y[1], comm_size(c));
      bad = 1;
    }
  }
  /* The host comm of a staged mesh has a uid of its own (its ring must not meet the staged
   * comm's inner ring of the same group in the store). */
  if (!bad && !strstr(comm_name(mesh_host_comm(m, "tp")), "host.tp.")) {
    fprintf(stderr, "rank %d: host tp comm is named %s\n", rank, comm_name(mesh_host_comm(m, "tp")));
    bad = 1;
  }
  fake_free(NULL, d);
  mesh_destroy(m);
  return bad;
}

static void test_mesh_staged(void **state) {
  assert_int_equal(fixture_run_ranks(4, rank_mesh_staged, NULL, ALARM_S), 0);
  /* "cpu": the host comm is the device comm. */
  char err[256] = "";
  mesh_t *m = NULL;
  assert_int_equal(mesh_create(&m, 1, 1, 1, 0, 1, err, sizeof err), 0);
  assert_int_equal(mesh_connect(m, "cpu", NULL, NULL, 0, "127.0.0.1", 1000, err, sizeof err), 0);
  assert_ptr_equal(mesh_comm(m, "world"), mesh_host_comm(m, "world"));
  mesh_destroy(m);
  /* "staged" without a device fails and leaves no comm. */
  assert_int_equal(mesh_create(&m, 1, 1, 1, 0, 1, err, sizeof err), 0);
  assert_int_equal(mesh_connect(m, "staged", NULL, NULL, 0, "127.0.0.1", 1000, err, sizeof err), COMM_EINVAL);
  assert_non_null(strstr(err, "needs comm_config_t.device"));
  for (int g = 0; g < MESH_NGROUPS; g++) {
    assert_null(m->groups[g].comm);
    assert_null(m->groups[g].host_comm);
  }
  mesh_destroy(m);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_config_errors),           cmocka_unit_test(test_single_rank),
      cmocka_unit_test(test_equivalence_cpu_backend), cmocka_unit_test(test_equivalence_fake_device),
      cmocka_unit_test(test_bf16_fake_device),        cmocka_unit_test(test_bf16_cpu_backend),
      cmocka_unit_test(test_peer_exit),
      cmocka_unit_test(test_mesh_staged),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
