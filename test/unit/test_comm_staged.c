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
 * fake-device buffers while its host comm (a "cpu" ring of its own) moves host values. Needs no
 * GPU. */
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
#include "trainer/comm.h"
#include "trainer/mesh.h"

#define ALARM_S 60
#define TIMEOUT_MS 20000

/* ---- the fake device: host memory behind tagged pointers ---- */

#define FAKE_TAG ((uintptr_t)1 << 62) /* makes the address non-canonical: dereferencing faults */

static void *untag(const void *p) { return (void *)((uintptr_t)p ^ FAKE_TAG); }

static void *fake_alloc(backend_t *be, size_t bytes) {
  void *p = calloc(1, bytes ? bytes : 1);
  return p ? (void *)((uintptr_t)p ^ FAKE_TAG) : NULL;
}
static void fake_free(backend_t *be, void *p) {
  if (p) free(untag(p));
}
static void fake_to_device(backend_t *be, void *dst, const void *src, size_t n) { memcpy(untag(dst), src, n); }
static void fake_to_host(backend_t *be, void *dst, const void *src, size_t n) { memcpy(dst, untag(src), n); }
static void fake_copy(backend_t *be, void *dst, const void *src, size_t n) { memmove(untag(dst), untag(src), n); }
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

/* bf16 is refused (the inner cpu ring reduces float32 only) with a message naming staged. */
static int rank_bf16(int rank, int n, store_t *st, void *arg) {
  comm_t *c = NULL;
  if (open_staged(&c, "bf", rank, n, st, &fake_device)) return 1;
  uint16_t *d = fake_alloc(NULL, 8 * sizeof(uint16_t));
  int rc = comm_all_reduce(c, d, 8, COMM_BFLOAT16, COMM_SUM);
  int bad = rc != COMM_EINVAL || !strstr(comm_errmsg(c), "staged supports float32 only");
  if (bad) fprintf(stderr, "rank %d: bf16 all_reduce gave %d: %s\n", rank, rc, comm_errmsg(c));
  /* an EINVAL does not break the communicator */
  float *f = fake_alloc(NULL, 8 * sizeof(float));
  bad |= comm_all_reduce(c, f, 8, COMM_FLOAT32, COMM_SUM) != COMM_OK;
  fake_free(NULL, d);
  fake_free(NULL, f);
  comm_destroy(c);
  return bad;
}

static void test_bf16_refused(void **state) { assert_int_equal(fixture_run_ranks(2, rank_bf16, NULL, ALARM_S), 0); }

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
      cmocka_unit_test(test_bf16_refused),            cmocka_unit_test(test_peer_exit),
      cmocka_unit_test(test_mesh_staged),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
