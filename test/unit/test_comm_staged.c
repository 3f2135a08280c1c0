// deps: test/support/fixture.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/comm_staged.c trainer/parallel/mesh.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c trainer/backend/fatal.c
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
 * Point-to-point: sends and receives of device buffers between two ranks, exact and with guards,
 * their stats, a count mismatch, and the ring-neighbour rule on three ranks. Started sends that
 * do not block their caller, with messages larger than the sockets hold: the pipeline's pattern
 * (both ways on two staged comms, sends started before receives), issue order behind a pending
 * send, a failure after the start reported by comm_wait, and a send left to comm_destroy. Needs
 * no GPU. */
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
#include "trainer/backend/backend.h"
#include "trainer/backend/bf16.h"
#include "trainer/comm/comm.h"
#include "trainer/parallel/mesh.h"

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
      if (comm_all_reduce(ref, want, cnt, DT_F32, op) || comm_all_reduce(stg, d, cnt, DT_F32, op)) {
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
      if (comm_reduce_scatter(ref, h, want, cnt, DT_F32, op) ||
          comm_reduce_scatter(stg, d, d2, cnt, DT_F32, op)) {
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
    if (comm_all_gather(ref, h, want, cnt, DT_F32) || comm_all_gather(stg, d, d2, cnt, DT_F32)) {
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
    if (comm_all_gather(ref, want + (size_t)rank * cnt, want, cnt, DT_F32) ||
        comm_all_gather(stg, slot, d2, cnt, DT_F32)) {
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
    if (comm_broadcast(ref, want, cnt, DT_F32, n - 1) || comm_broadcast(stg, d, cnt, DT_F32, n - 1)) {
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
  int bad = comm_all_reduce(c, d, 5, DT_F32, COMM_SUM) || comm_reduce_scatter(c, d, d2, 5, DT_F32, COMM_SUM);
  fake_to_host(NULL, got, d2, sizeof got);
  bad |= same("reduce_scatter on one rank", 0, h, got, 5);
  bad |= comm_all_gather(c, d, d2, 5, DT_F32) != 0;
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
  /* a backend this build lacks (a stand-in in the registry): a clear message naming it */
  for (int i = 0; comm_registry[i]; i++) {
    if (comm_registry[i]->create) continue;
    assert_int_equal(comm_create(&c, comm_registry[i]->name, &cfg, err, sizeof err), COMM_EINVAL);
    printf("%s, not built: %s\n", comm_registry[i]->name, err);
    assert_non_null(strstr(err, comm_registry[i]->name));
    assert_non_null(strstr(err, "is not built"));
  }
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
static const float GUARD_F32 = 12345.5f;

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
      if (comm_all_reduce(stg, dv, cnt, DT_BF16, op)) {
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
      if (comm_reduce_scatter(stg, da, dr, cnt, DT_BF16, op)) {
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
      if (comm_all_reduce(ref, want, cnt, DT_BF16, op) || comm_all_reduce(stg, dv, cnt, DT_BF16, op)) {
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
      if (comm_reduce_scatter(ref, h, want, cnt, DT_BF16, op) ||
          comm_reduce_scatter(stg, da, dr, cnt, DT_BF16, op)) {
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
    if (comm_all_gather(stg, dv, da, cnt, DT_BF16)) {
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
    if (comm_all_gather(stg, da + (size_t)rank * cnt, da, cnt, DT_BF16)) {
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
      if (comm_broadcast(stg, dv, cnt, DT_BF16, root)) {
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
  int rc = comm_all_reduce(c, d, 1000, DT_F32, COMM_SUM);
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

/* ---- point-to-point through the staging buffers ----
 *
 * Two ranks: rank 0 sends float32 and bfloat16 device buffers (1000 random floats, 4099 bit
 * patterns), blocking and started; rank 1 receives them into device buffers sized exactly, each
 * with a guard element after it that must come back untouched (tolerance: exact). Stats count the
 * inner ring's payload bytes and one call per transfer. Then a receive of 8 elements meets a send
 * of 7: COMM_EREMOTE naming both, the prefix once, and the sender's next call fails too. */
static int rank_p2p_pair(int rank, int n, store_t *st, void *arg) {
  backend_t *dev = device_open(*(const dev_kind_t *)arg);
  comm_t *c = NULL;
  if (!dev || open_staged(&c, "stg-p2p", rank, n, st, dev)) return 1;
  enum { NF = 1000, NB = 4099 };
  float hf[NF + 1], gf[NF + 1];
  uint16_t hb[NB + 1], gb[NB + 1];
  float *df = dev->alloc(dev, (NF + 1) * sizeof(float));
  uint16_t *db = dev->alloc(dev, (NB + 1) * 2);
  if (!df || !db) return 1;
  fill(hf, NF, 77);
  hf[NF] = GUARD_F32;
  for (size_t i = 0; i < NB; i++) hb[i] = bpat(0, i);
  hb[NB] = BF_GUARD;
  int bad = 0;
  comm_req_t *r = NULL;
  if (rank == 0) {
    dev->to_device(dev, df, hf, NF * sizeof(float));
    dev->to_device(dev, db, hb, NB * 2);
    bad = comm_send(c, df, NF, DT_F32, 1) || comm_start_send(c, db, NB, DT_BF16, 1, &r) ||
          comm_wait(r, NULL);
  } else {
    for (size_t i = 0; i <= NF; i++) gf[i] = GUARD_F32;
    for (size_t i = 0; i <= NB; i++) gb[i] = BF_GUARD;
    dev->to_device(dev, df, gf, sizeof gf);
    dev->to_device(dev, db, gb, sizeof gb);
    bad = comm_start_recv(c, df, NF, DT_F32, 0, &r) || comm_wait(r, NULL) ||
          comm_recv(c, db, NB, DT_BF16, 0);
    dev->to_host(dev, gf, df, sizeof gf);
    dev->to_host(dev, gb, db, sizeof gb);
    if (!bad) bad = same("staged recv of 1000 float32 (+ guard)", rank, hf, gf, NF + 1) ||
                    same_bf16("staged recv of 4099 bfloat16 (+ guard)", rank, hb, gb, NB + 1);
  }
  if (bad) fprintf(stderr, "rank %d: staged send/recv: %s\n", rank, comm_errmsg(c));
  comm_stats_t s;
  comm_get_stats(c, &s);
  uint64_t bytes = NF * sizeof(float) + NB * 2;
  if (!bad && (s.bytes_sent != (rank == 0 ? bytes : 0) || s.bytes_recv != (rank == 1 ? bytes : 0) || s.calls != 2)) {
    fprintf(stderr, "rank %d: staged p2p stats: sent %llu recv %llu calls %llu; want %llu each way, 2 calls\n",
            rank, (unsigned long long)s.bytes_sent, (unsigned long long)s.bytes_recv, (unsigned long long)s.calls,
            (unsigned long long)bytes);
    bad = 1;
  }
  /* The mismatch. */
  if (!bad && rank == 0) {
    comm_send(c, df, 7, DT_F32, 1); /* fits the sockets: may succeed */
    int rc = comm_recv(c, df, 1, DT_F32, 1);
    bad = rc != COMM_EREMOTE;
    printf("staged sender after the mismatch: %s: %s\n", comm_strerror(rc), comm_errmsg(c));
  } else if (!bad) {
    int rc = comm_recv(c, df, 8, DT_F32, 0);
    const char *msg = comm_errmsg(c);
    printf("staged receiver of the mismatch: %s: %s\n", comm_strerror(rc), msg);
    bad = rc != COMM_EREMOTE || !strstr(msg, "comm stg-p2p (rank 1/2): recv of 8 float32 from rank 0 (127.0.0.1:") ||
          !strstr(msg, ") met a send of 7 float32") || strstr(msg + 1, "comm stg-p2p (rank");
  }
  if (!bad && rank == 1) printf("staged send/recv: exact, guards intact, stats %llu B\n", (unsigned long long)bytes);
  dev->free(dev, df);
  dev->free(dev, db);
  comm_destroy(c);
  device_close(dev);
  return bad;
}

static void test_p2p_pair(void **state) {
  dev_kind_t k = DEV_FAKE;
  assert_int_equal(fixture_run_ranks(2, rank_p2p_pair, &k, ALARM_S), 0);
  k = DEV_CPU_BACKEND;
  assert_int_equal(fixture_run_ranks(2, rank_p2p_pair, &k, ALARM_S), 0);
}

/* Three ranks: a send to rank + 2 is refused naming the staged comm's rule (and leaves it usable);
 * then a ring pass, rank 0 first, each rank receiving rank - 1's values on the device. */
static int rank_p2p_ring(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL;
  if (open_staged(&c, "stg-ring", rank, n, st, &fake_device)) return 1;
  float *d = fake_alloc(NULL, 64 * sizeof(float)), *e = fake_alloc(NULL, 64 * sizeof(float));
  float h[64], got[64];
  int bad = 0;
  int rc = comm_send(c, d, 64, DT_F32, (rank + 2) % n);
  if (rc != COMM_EINVAL || !strstr(comm_errmsg(c), "point-to-point on the staged comm only between ring neighbours")) {
    fprintf(stderr, "rank %d: send to a non-neighbour: %s: %s\n", rank, comm_strerror(rc), comm_errmsg(c));
    bad = 1;
  }
  if (rank == 0) printf("staged refusal: %s\n", comm_errmsg(c));
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  fill(h, 64, 500 + (uint64_t)rank);
  fake_to_device(NULL, d, h, sizeof h);
  rc = rank == 0 ? comm_send(c, d, 64, DT_F32, right) || comm_recv(c, e, 64, DT_F32, left)
                 : comm_recv(c, e, 64, DT_F32, left) || comm_send(c, d, 64, DT_F32, right);
  if (rc) {
    fprintf(stderr, "rank %d: staged ring: %s\n", rank, comm_errmsg(c));
    bad = 1;
  } else {
    fake_to_host(NULL, got, e, sizeof got);
    fill(h, 64, 500 + (uint64_t)left);
    bad |= same("staged ring recv from rank - 1", rank, h, got, 64);
  }
  fake_free(NULL, d);
  fake_free(NULL, e);
  comm_destroy(c);
  return bad;
}

static void test_p2p_ring(void **state) { assert_int_equal(fixture_run_ranks(3, rank_p2p_ring, NULL, ALARM_S), 0); }

/* ---- started sends that do not block: the pipeline's pattern, order, failure ----
 *
 * Messages larger than the kernel can hold between two loopback sockets (twice the sum of the
 * tcp_wmem and tcp_rmem maxima, at least 64 MiB), so a send cannot complete before the peer
 * reads: a start that ran the transfer to completion (as "staged" once did) stalls both ranks of
 * the pipeline's pattern until the timeout. Fake device, exact contents (tolerance: none), and
 * synchronization between ranks through store keys, never sleeps. */

#define PROMPT_S 10.0 /* "quickly": half the communicators' timeout, on a loaded machine */

/* 0 when the n floats are equal bit for bit, else prints the first difference. */
static int same_bits(const char *what, int rank, const float *want, const float *got, size_t n) {
  if (!memcmp(want, got, n * sizeof(float))) return 0;
  size_t i = 0;
  while (!memcmp(&want[i], &got[i], sizeof(float))) i++;
  fprintf(stderr, "rank %d: %s: element %zu of %zu is %.9g, want %.9g (tolerance: exact)\n", rank, what, i, n,
          (double)got[i], (double)want[i]);
  return 1;
}

/* "stg-fwd" (group rank = rank) carries rank 0's sends to rank 1, "stg-bwd" (group rank =
 * 1 - rank) rank 1's to rank 0: in each, group rank 0 only sends. Each rank starts its send,
 * then its receive, and only then waits (receive first); two rounds of fresh contents. Checks
 * the contents, each send's bytes from comm_wait, and the stats of both communicators. */
static int rank_p2p_two_directions(int rank, int n, store_t *st, void *arg) {
  comm_t *fwd = NULL, *bwd = NULL;
  if (open_staged(&fwd, "stg-fwd", rank, 2, st, &fake_device) ||
      open_staged(&bwd, "stg-bwd", 1 - rank, 2, st, &fake_device))
    return 1;
  comm_t *out = rank == 0 ? fwd : bwd, *in = rank == 0 ? bwd : fwd;
  const size_t cnt = fixture_unbufferable_bytes() / sizeof(float), bytes = cnt * sizeof(float);
  float *h = malloc(bytes), *got = malloc(bytes);
  float *ds = fake_alloc(NULL, bytes), *dr = fake_alloc(NULL, bytes);
  if (!h || !got || !ds || !dr) return 1;
  int bad = 0;
  const int rounds = 2;
  double t0 = fixture_now_s();
  for (int round = 0; round < rounds && !bad; round++) {
    fill(h, cnt, 1000 + 10 * (uint64_t)round + (uint64_t)rank);
    fake_to_device(NULL, ds, h, bytes);
    comm_req_t *rs = NULL, *rr = NULL;
    if (comm_start_send(out, ds, cnt, DT_F32, 1, &rs) || comm_start_recv(in, dr, cnt, DT_F32, 0, &rr)) {
      fprintf(stderr, "rank %d: start: %s / %s\n", rank, comm_errmsg(out), comm_errmsg(in));
      return 1;
    }
    uint64_t sent = 0;
    int er = comm_wait(rr, NULL), es = comm_wait(rs, &sent);
    if (er || es || sent != bytes) {
      fprintf(stderr, "rank %d: round %d after %.3f s: recv %s: %s; send %s (%llu B sent): %s\n", rank, round,
              fixture_now_s() - t0, comm_strerror(er), comm_errmsg(in), comm_strerror(es), (unsigned long long)sent,
              comm_errmsg(out));
      bad = 1;
      break;
    }
    fake_to_host(NULL, got, dr, bytes);
    fill(h, cnt, 1000 + 10 * (uint64_t)round + (uint64_t)(1 - rank));
    char what[96];
    snprintf(what, sizeof what, "round %d: %zu MiB from rank %d", round, bytes >> 20, 1 - rank);
    bad = same_bits(what, rank, h, got, cnt);
  }
  double dt = fixture_now_s() - t0;
  comm_stats_t so, si;
  comm_get_stats(out, &so);
  comm_get_stats(in, &si);
  const uint64_t want = (uint64_t)rounds * bytes;
  if (!bad && (so.bytes_sent != want || so.bytes_recv != 0 || so.calls != (uint64_t)rounds || si.bytes_sent != 0 ||
               si.bytes_recv != want || si.calls != (uint64_t)rounds)) {
    fprintf(stderr, "rank %d: stats: out sent %llu recv %llu calls %llu, in sent %llu recv %llu calls %llu; want "
            "%llu B each way, %d calls each\n", rank, (unsigned long long)so.bytes_sent,
            (unsigned long long)so.bytes_recv, (unsigned long long)so.calls, (unsigned long long)si.bytes_sent,
            (unsigned long long)si.bytes_recv, (unsigned long long)si.calls, (unsigned long long)want, rounds);
    bad = 1;
  }
  if (!bad && dt > PROMPT_S) {
    fprintf(stderr, "rank %d: %d rounds took %.3f s (limit %.0f s)\n", rank, rounds, dt, PROMPT_S);
    bad = 1;
  }
  if (!bad)
    printf("  rank %d: %d rounds of %zu MiB both ways on two staged comms in %.3f s, exact; stats %llu B\n", rank,
           rounds, bytes >> 20, dt, (unsigned long long)want);
  fake_free(NULL, ds);
  fake_free(NULL, dr);
  free(h);
  free(got);
  comm_destroy(fwd);
  comm_destroy(bwd);
  return bad;
}

static void test_p2p_two_directions(void **state) {
  assert_int_equal(fixture_run_ranks(2, rank_p2p_two_directions, NULL, ALARM_S), 0);
}

/* Issue order on one staged comm with a send still on its way. Rank 0 starts a send of A (more
 * than the sockets hold), checks with comm_test that it is not complete, and only then lets rank
 * 1 start receiving (store key); meanwhile it issues a blocking send of B and a blocking
 * all_reduce. Rank 1 receives A, B, then all_reduces. Had B or the all_reduce overtaken A, rank
 * 1's receive of A would meet them (COMM_EREMOTE). Exact contents and sum (small integers);
 * comm_wait's bytes for A; stats: A + B plus what a cpu comm's all_reduce of the same count
 * moves, three calls. */
static int rank_p2p_order(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL, *ref = NULL;
  if (open_staged(&c, "stg-order", rank, n, st, &fake_device) ||
      fixture_comm_open(&ref, "ref-order", rank, n, st, TIMEOUT_MS))
    return 1;
  enum { NB = 1000, NR = 4099 };
  const size_t na = fixture_unbufferable_bytes() / sizeof(float), abytes = na * sizeof(float);
  float *ha = malloc(abytes), hb[NB], gb[NB], hr[NR], gr[NR], want[NR];
  float *da = fake_alloc(NULL, abytes), *db = fake_alloc(NULL, sizeof hb), *dar = fake_alloc(NULL, sizeof hr);
  if (!ha || !da || !db || !dar) return 1;
  for (size_t i = 0; i < NR; i++) {
    hr[i] = (float)((int)(i % 13) + rank);
    want[i] = (float)(2 * (int)(i % 13) + 1);
  }
  fake_to_device(NULL, dar, hr, sizeof hr);
  fill(ha, na, 2000);
  fill(hb, NB, 2001);
  int bad = 0;
  uint64_t sent = 0;
  if (rank == 0) {
    fake_to_device(NULL, da, ha, abytes);
    fake_to_device(NULL, db, hb, sizeof hb);
    comm_req_t *r = NULL;
    int done = 1;
    if (comm_start_send(c, da, na, DT_F32, 1, &r) || comm_test(r, &done)) {
      fprintf(stderr, "rank 0: start_send: %s\n", comm_errmsg(c));
      return 1;
    }
    if (done) {
      fprintf(stderr, "rank 0: a send of %zu MiB that the peer has not begun to receive is complete\n",
              abytes >> 20);
      bad = 1;
    }
    store_set(st, "stg-order/started", "1", 1);
    int rb = comm_send(c, db, NB, DT_F32, 1), rar = comm_all_reduce(c, dar, NR, DT_F32, COMM_SUM);
    int ra = comm_wait(r, &sent);
    if (ra || rb || rar || sent != abytes) {
      fprintf(stderr, "rank 0: send A %s (%llu B), send B %s, all_reduce %s: %s\n", comm_strerror(ra),
              (unsigned long long)sent, comm_strerror(rb), comm_strerror(rar), comm_errmsg(c));
      bad = 1;
    }
  } else {
    if (fixture_await_key(st, "stg-order/started", TIMEOUT_MS)) return 1;
    int ra = comm_recv(c, da, na, DT_F32, 0), rb = ra ? ra : comm_recv(c, db, NB, DT_F32, 0);
    int rar = rb ? rb : comm_all_reduce(c, dar, NR, DT_F32, COMM_SUM);
    if (ra || rb || rar) {
      fprintf(stderr, "rank 1: recv A %s, recv B %s, all_reduce %s: %s\n", comm_strerror(ra), comm_strerror(rb),
              comm_strerror(rar), comm_errmsg(c));
      bad = 1;
    } else {
      float *ga = malloc(abytes);
      fake_to_host(NULL, ga, da, abytes);
      fake_to_host(NULL, gb, db, sizeof gb);
      bad = same_bits("A, received after B and the all_reduce were issued", 1, ha, ga, na) ||
            same_bits("B", 1, hb, gb, NB);
      free(ga);
    }
  }
  if (!bad) {
    fake_to_host(NULL, gr, dar, sizeof gr);
    bad = same_bits("all_reduce after the sends", rank, want, gr, NR);
  }
  /* The staged stats: the two messages plus the all_reduce's ring traffic, as a cpu comm counts it. */
  comm_stats_t s, sr;
  if (!bad && comm_all_reduce(ref, hr, NR, DT_F32, COMM_SUM)) bad = 1;
  comm_get_stats(c, &s);
  comm_get_stats(ref, &sr);
  const uint64_t msgs = abytes + sizeof hb;
  if (!bad && (s.bytes_sent != (rank == 0 ? msgs : 0) + sr.bytes_sent ||
               s.bytes_recv != (rank == 1 ? msgs : 0) + sr.bytes_recv || s.calls != 3)) {
    fprintf(stderr, "rank %d: stats sent %llu recv %llu calls %llu; want messages %llu B (%s) + all_reduce %llu "
            "sent %llu recv, 3 calls\n", rank, (unsigned long long)s.bytes_sent, (unsigned long long)s.bytes_recv,
            (unsigned long long)s.calls, (unsigned long long)msgs, rank == 0 ? "sent" : "received",
            (unsigned long long)sr.bytes_sent, (unsigned long long)sr.bytes_recv);
    bad = 1;
  }
  if (!bad && rank == 0)
    printf("  send of %zu MiB pending (comm_test), then a blocking send and all_reduce: in order, exact, "
           "stats %llu B sent\n", abytes >> 20, (unsigned long long)s.bytes_sent);
  fake_free(NULL, da);
  fake_free(NULL, db);
  fake_free(NULL, dar);
  free(ha);
  comm_destroy(c);
  comm_destroy(ref);
  return bad;
}

static void test_p2p_order(void **state) { assert_int_equal(fixture_run_ranks(2, rank_p2p_order, NULL, ALARM_S), 0); }

/* A started send whose peer exits only after the start returned (store key) fails at comm_wait
 * with the inner ring's reason under this comm's name (prefix once), promptly from the start (a
 * start that waited for the peer would wait out the key's 20 s), and the comm stays broken with
 * that code. */
static int rank_p2p_send_fails(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL;
  if (open_staged(&c, "stg-dead", rank, n, st, &fake_device)) return 1;
  if (rank == 1) /* the kernel closes its sockets */
    _exit(fixture_await_key(st, "stg-dead/started", TIMEOUT_MS) ? 1 : 0);
  const size_t cnt = fixture_unbufferable_bytes() / sizeof(float);
  float *d = fake_alloc(NULL, cnt * sizeof(float));
  comm_req_t *r = NULL;
  double t0 = fixture_now_s();
  if (!d || comm_start_send(c, d, cnt, DT_F32, 1, &r)) {
    fprintf(stderr, "rank 0: start_send: %s\n", comm_errmsg(c));
    return 1;
  }
  store_set(st, "stg-dead/started", "1", 1);
  int rc = comm_wait(r, NULL);
  double dt = fixture_now_s() - t0;
  const char *msg = comm_errmsg(c);
  printf("  started send to a peer that exits: %s %.3f s after the start: %s\n", comm_strerror(rc), dt, msg);
  int bad = rc != COMM_EREMOTE || dt > PROMPT_S ||
            !strstr(msg, "comm stg-dead (rank 0/2): send: connection to rank 1 (127.0.0.1:") ||
            strstr(msg + 1, "comm stg-dead (rank");
  if (comm_barrier(c) != rc) {
    fprintf(stderr, "rank 0: the comm is not broken after the failed send: %s\n", comm_errmsg(c));
    bad = 1;
  }
  fake_free(NULL, d);
  comm_destroy(c);
  return bad;
}

static void test_p2p_send_fails(void **state) {
  assert_int_equal(fixture_run_ranks(2, rank_p2p_send_fails, NULL, ALARM_S), 0);
}

/* A started send never waited for: comm_destroy waits for it (comm.h), so the receiver, which
 * begins only after the start returned (store key), gets every byte; the copy it sends from
 * lives until then. (The request itself is not freed: comm.h lets a caller that exits skip the
 * wait, not a caller that goes on.) */
static int rank_p2p_destroy_pending(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL;
  if (open_staged(&c, "stg-left", rank, n, st, &fake_device)) return 1;
  const size_t cnt = fixture_unbufferable_bytes() / sizeof(float), bytes = cnt * sizeof(float);
  float *h = malloc(bytes), *d = fake_alloc(NULL, bytes);
  if (!h || !d) return 1;
  fill(h, cnt, 3000);
  int bad = 0;
  if (rank == 0) {
    comm_req_t *r = NULL;
    fake_to_device(NULL, d, h, bytes);
    if (comm_start_send(c, d, cnt, DT_F32, 1, &r)) {
      fprintf(stderr, "rank 0: start_send: %s\n", comm_errmsg(c));
      return 1;
    }
    fake_free(NULL, d); /* the request sends from its own copy */
    d = NULL;
    store_set(st, "stg-left/started", "1", 1);
  } else {
    float *got = malloc(bytes);
    if (!got || fixture_await_key(st, "stg-left/started", TIMEOUT_MS)) return 1;
    if (comm_recv(c, d, cnt, DT_F32, 0)) {
      fprintf(stderr, "rank 1: recv of a send left to comm_destroy: %s\n", comm_errmsg(c));
      bad = 1;
    } else {
      fake_to_host(NULL, got, d, bytes);
      bad = same_bits("a send left to comm_destroy", 1, h, got, cnt);
    }
    if (!bad) printf("  a started send left to comm_destroy: %zu MiB delivered exactly\n", bytes >> 20);
    free(got);
  }
  comm_destroy(c);
  fake_free(NULL, d);
  free(h);
  return bad;
}

static void test_p2p_destroy_pending(void **state) {
  assert_int_equal(fixture_run_ranks(2, rank_p2p_destroy_pending, NULL, ALARM_S), 0);
}

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
    if (comm_all_reduce(c, d, 2, DT_F32, COMM_SUM) || comm_all_reduce(h, y, 2, DT_F32, COMM_SUM)) {
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
      cmocka_unit_test(test_p2p_pair),                cmocka_unit_test(test_p2p_ring),
      cmocka_unit_test(test_p2p_two_directions),      cmocka_unit_test(test_p2p_order),
      cmocka_unit_test(test_p2p_send_fails),          cmocka_unit_test(test_p2p_destroy_pending),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
