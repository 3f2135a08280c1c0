// deps: test/support/fixture.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/parallel/mesh.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/err.c common/env.c trainer/backend/fatal.c
/* test_comm_async: asynchronous collectives (comm_start_* / comm_wait / comm_test) of the cpu
 * backend, with real processes on loopback (test/support/fixture: forked ranks, a store server
 * thread, an alarm per rank).
 *
 * What is checked: several requests in flight on one communicator complete in issue order with
 * the same bits as the blocking calls (tolerance zero: the same ring runs the same sums); a
 * blocking call issued while requests are in flight runs after them; two communicators progress
 * independently; the caller is free while a request runs (it computes meanwhile, and comm_test
 * says "not done" until the data has come); a failure while others are queued is reported by the
 * failing request, and the queued ones fail with the same message without touching their
 * buffers; wait_ns counts the blocked time. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/store.h"
#include "test/support/fixture.h"
#include "trainer/comm/comm.h"

#define CHILD_ALARM_S 60

static int run_ranks(int n, fixture_rank_fn fn, void *arg) {
  int failed = fixture_run_ranks(n, fn, arg, CHILD_ALARM_S);
  assert_true(failed >= 0);
  return failed;
}

static float rnd(int rank, size_t i, int salt) {
  uint32_t x = (uint32_t)(i * 2654435761u) ^ (uint32_t)(rank * 40503 + salt * 977 + 1);
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return (float)(x % 20001) / 1000.0f - 10.0f;
}

static int first_diff(const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], sizeof(float))) return (int)i;
  return -1;
}

#define K 6
#define N ((size_t)1 << 16)

/* K all_reduces and reduce_scatters in flight at once against the same calls made blocking:
 * identical bits (tolerance 0), and the requests finish in issue order. */
static int rank_in_flight(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (fixture_comm_open(&c, "async", rank, n, st, 30000)) return 1;
  float *want = malloc(K * N * sizeof(float)), *got = malloc(K * N * sizeof(float));
  float *rs_want = malloc(N / 4 * sizeof(float)), *rs_got = malloc(N / 4 * sizeof(float));
  for (int k = 0; k < K; k++)
    for (size_t i = 0; i < N; i++) want[k * N + i] = got[k * N + i] = rnd(rank, i, k);
  for (int k = 0; k < K; k++)
    if (comm_all_reduce(c, want + k * N, N, DT_F32, COMM_SUM)) return 1;
  if (comm_reduce_scatter(c, want, rs_want, N / (size_t)n / 4, DT_F32, COMM_AVG))
    return 1;
  comm_req_t *req[K + 1];
  for (int k = 0; k < K; k++)
    if (comm_start_all_reduce(c, got + k * N, N, DT_F32, COMM_SUM, &req[k])) return 1;
  /* each wait finds its own and every earlier buffer final, whatever is still queued behind */
  int bad = 0;
  for (int k = 0; k < K; k++) {
    uint64_t sent = 0;
    if (comm_wait(req[k], &sent)) return 1;
    if (sent == 0) {
      fprintf(stderr, "rank %d: request %d reports 0 bytes sent\n", rank, k);
      bad = 1;
    }
    /* the later ones may still run, the earlier ones are all done */
    for (int j = 0; j <= k; j++) {
      int d = first_diff(got + j * N, want + j * N, N);
      if (d >= 0) {
        fprintf(stderr, "rank %d: request %d differs at %d after waiting %d: %g vs %g (tolerance 0)\n", rank, j,
                d, k, got[j * N + d], want[j * N + d]);
        bad = 1;
      }
    }
  }
  if (comm_start_reduce_scatter(c, got, rs_got, N / (size_t)n / 4, DT_F32, COMM_AVG, &req[K]) ||
      comm_wait(req[K], NULL))
    return 1;
  int d = first_diff(rs_got, rs_want, N / (size_t)n / 4);
  if (d >= 0) {
    fprintf(stderr, "rank %d: async reduce_scatter differs at %d (tolerance 0)\n", rank, d);
    bad = 1;
  }
  printf("  rank %d: %d requests in flight, bit-identical to blocking: %s\n", rank, K, bad ? "no" : "yes");
  comm_destroy(c);
  free(want);
  free(got);
  free(rs_want);
  free(rs_got);
  return bad;
}

static void test_in_flight(void **state) { assert_int_equal(run_ranks(3, rank_in_flight, NULL), 0); }

/* A blocking all_gather issued behind a queued all_reduce on the same buffer sees the reduced
 * values: it runs after the request. Two communicators progress independently: a request on
 * "b" completes while one on "a" waits for a peer that starts late. */
static int rank_order(int rank, int n, store_t *st, void *arg) {
  comm_t *a, *b;
  if (fixture_comm_open(&a, "ord-a", rank, n, st, 30000) || fixture_comm_open(&b, "ord-b", rank, n, st, 30000))
    return 1;
  float x[64], all[64 * 4];
  for (int i = 0; i < 64; i++) x[i] = (float)(rank + 1);
  comm_req_t *r;
  if (comm_start_all_reduce(a, x, 64, DT_F32, COMM_SUM, &r)) return 1;
  if (comm_all_gather(a, x, all, 64, DT_F32)) return 1; /* runs after r: x is the sum */
  int bad = 0;
  const float sum = (float)(n * (n + 1) / 2);
  for (int i = 0; i < 64 * n; i++)
    if (all[i] != sum) {
      fprintf(stderr, "rank %d: all_gather saw %g at %d, want the reduced %g\n", rank, all[i], i, sum);
      bad = 1;
      break;
    }
  if (comm_wait(r, NULL)) return 1;

  /* Rank 0 starts on a, then does b's all_reduce; the others do b first and join a only after
   * b is done. b completing while a's request waits shows they do not block each other. */
  float y[16], z[16];
  for (int i = 0; i < 16; i++) y[i] = z[i] = 1;
  comm_req_t *ra = NULL;
  if (rank == 0 && comm_start_all_reduce(a, y, 16, DT_F32, COMM_SUM, &ra)) return 1;
  if (comm_all_reduce(b, z, 16, DT_F32, COMM_SUM)) return 1;
  int done = 1;
  if (rank == 0 && comm_test(ra, &done)) return 1;
  if (rank == 0 && done) { /* the others have not joined a yet: it cannot be done */
    fprintf(stderr, "rank 0: request on a done before its peers joined\n");
    bad = 1;
  }
  comm_barrier(b);
  if (rank != 0 && comm_start_all_reduce(a, y, 16, DT_F32, COMM_SUM, &ra)) return 1;
  if (comm_wait(ra, NULL)) return 1;
  if (y[0] != (float)n || z[0] != (float)n) {
    fprintf(stderr, "rank %d: sums %g %g, want %d\n", rank, y[0], z[0], n);
    bad = 1;
  }
  comm_stats_t s;
  comm_get_stats(a, &s);
  if (s.wait_ns == 0 || s.bytes_sent == 0) {
    fprintf(stderr, "rank %d: stats wait_ns %llu bytes_sent %llu\n", rank, (unsigned long long)s.wait_ns,
            (unsigned long long)s.bytes_sent);
    bad = 1;
  }
  comm_destroy(a);
  comm_destroy(b);
  return bad;
}

static void test_order_and_independence(void **state) { assert_int_equal(run_ranks(3, rank_order, NULL), 0); }

/* A fault in the first of three queued requests: it fails with the injected message, the two
 * behind it fail with the same code and message, and their buffers are untouched (a request
 * that fails after its peer broke never writes half-received data into a buffer it never
 * started on). The peer fails at once, not after the 30 s timeout. */
static int rank_fault(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (fixture_comm_open(&c, "async-fault", rank, n, st, 30000)) return 1;
  if (comm_barrier(c)) return 1;
  if (rank == 1) comm_fail_next(c);
  static float b0[1 << 14], b1[1 << 14], b2[1 << 14];
  for (int i = 0; i < (1 << 14); i++) b0[i] = b1[i] = b2[i] = 7.0f;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  comm_req_t *r0, *r1, *r2;
  if (comm_start_all_reduce(c, b0, 1 << 14, DT_F32, COMM_SUM, &r0) ||
      comm_start_all_reduce(c, b1, 1 << 14, DT_F32, COMM_SUM, &r1) ||
      comm_start_all_reduce(c, b2, 1 << 14, DT_F32, COMM_SUM, &r2))
    return 1;
  int e0 = comm_wait(r0, NULL);
  char first[COMM_ERR_MAX];
  snprintf(first, sizeof first, "%s", comm_errmsg(c));
  int e1 = comm_wait(r1, NULL), e2 = comm_wait(r2, NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  printf("  rank %d: %s / %s / %s after %.3f s: %s\n", rank, comm_strerror(e0), comm_strerror(e1),
         comm_strerror(e2), dt, first);
  int bad = dt > 5.0 || e0 == 0 || e1 != e0 || e2 != e0 || strcmp(first, comm_errmsg(c));
  if (rank == 1 && !strstr(first, "fault injected")) bad = 1;
  for (int i = 0; i < (1 << 14); i++)
    if (b1[i] != 7.0f || b2[i] != 7.0f) {
      fprintf(stderr, "rank %d: a request queued behind the failure wrote its buffer at %d\n", rank, i);
      bad = 1;
      break;
    }
  comm_req_t *r3;
  if (comm_start_all_reduce(c, b1, 16, DT_F32, COMM_SUM, &r3) != e0 || r3) bad = 1; /* broken for good */
  if (bad) fprintf(stderr, "rank %d: unexpected result of the fault among queued requests\n", rank);
  comm_destroy(c);
  return bad;
}

static void test_fault_in_flight(void **state) { assert_int_equal(run_ranks(2, rank_fault, NULL), 0); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_in_flight),
      cmocka_unit_test(test_order_and_independence),
      cmocka_unit_test(test_fault_in_flight),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
