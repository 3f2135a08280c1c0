// deps: test/support/fixture.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/parallel/mesh.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/err.c common/env.c trainer/backend/fatal.c
/* test_comm_cpu: the cpu collective backend with real processes on loopback.
 *
 * Each test starts a store server on its own libuv loop in a thread (port 0), forks one
 * process per rank into a fresh process group, and waits for them; a failing rank gets the
 * whole group killed, and every rank has an alarm so that nothing can hang the suite. Ranks
 * check their own results against an expectation computed locally and print the first
 * difference. Data are small integers unless said otherwise, so every sum is exact and the
 * tolerance is zero (bit equality); the random-float tests state their own tolerance. The bf16
 * tests (the second half) repeat each collective on 2-byte elements: exact answers on small
 * integers, byte-exact moves of arbitrary bit patterns, round-to-nearest-even ties, and random
 * inputs against both the documented ring order (bit for bit) and an fp32 reference. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/store.h"
#include "test/support/fixture.h"
#include "trainer/backend/backend.h"
#include "trainer/backend/bf16.h"
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h" /* a fake float32-only backend table (test_bf16_refused_by_fp32_backend) */
#include "trainer/parallel/mesh.h"

#define CHILD_ALARM_S 60

/* ---- harness: test/support/fixture (store server thread + forked ranks, killed together
 * on the first failure) ---- */

typedef fixture_rank_fn rank_fn;

static int run_ranks(int n, rank_fn fn, void *arg) {
  int failed = fixture_run_ranks(n, fn, arg, CHILD_ALARM_S);
  assert_true(failed >= 0); /* the harness itself started */
  return failed;
}

static int comm_open(comm_t **c, const char *name, int rank, int n, store_t *st, int timeout_ms) {
  return fixture_comm_open(c, name, rank, n, st, timeout_ms);
}

static float val(int rank, size_t i) { return (float)((int)((i * 31 + (size_t)rank * 17) % 23) - 11); }

static float expect_reduce(int n, size_t i, comm_op_t op) {
  float acc = val(0, i);
  for (int r = 1; r < n; r++) acc = op == COMM_MAX ? fmaxf(acc, val(r, i)) : acc + val(r, i);
  return op == COMM_AVG ? acc / (float)n : acc;
}

static int check_equal(int rank, const char *what, const float *got, size_t count, float (*want)(size_t, void *),
                       void *ctx) {
  for (size_t i = 0; i < count; i++) {
    float w = want(i, ctx);
    if (memcmp(&got[i], &w, sizeof w) != 0) {
      fprintf(stderr, "rank %d: %s: element %zu of %zu is %.9g, want %.9g (tolerance: exact)\n",
              rank, what, i, count, got[i], w);
      return 1;
    }
  }
  return 0;
}

static const size_t k_counts[] = {0, 1, 7, 1000, 1u << 20};
#define NCOUNTS (sizeof k_counts / sizeof k_counts[0])
static const comm_op_t k_ops[] = {COMM_SUM, COMM_AVG, COMM_MAX};
static const float GUARD = 12345.5f;

typedef struct {
  int n;
  comm_op_t op;
} exp_ctx_t;

static float want_reduce(size_t i, void *ctx) {
  exp_ctx_t *e = ctx;
  return expect_reduce(e->n, i, e->op);
}

/* ---- all_reduce ---- */

static int rank_all_reduce(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "ar", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NCOUNTS && !bad; k++) {
    size_t count = k_counts[k];
    float *buf = malloc((count + 1) * sizeof(float));
    for (size_t o = 0; o < 3 && !bad; o++) {
      for (size_t i = 0; i < count; i++) buf[i] = val(rank, i);
      buf[count] = GUARD;
      int rc = comm_all_reduce(c, buf, count, DT_F32, k_ops[o]);
      if (rc) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[64];
      snprintf(what, sizeof what, "all_reduce(%s, n=%d, count=%zu)", comm_op_name(k_ops[o]), n, count);
      exp_ctx_t e = {n, k_ops[o]};
      bad = check_equal(rank, what, buf, count, want_reduce, &e);
      if (!bad && buf[count] != GUARD) {
        fprintf(stderr, "rank %d: %s wrote past the end of the buffer\n", rank, what);
        bad = 1;
      }
    }
    free(buf);
  }
  comm_destroy(c);
  return bad;
}

static void test_all_reduce(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_all_reduce, NULL), 0);
}

/* ---- all_gather ---- */

static float want_gather(size_t i, void *ctx) {
  size_t count = *(size_t *)ctx;
  return val((int)(i / count), i % count);
}

static int rank_all_gather(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "ag", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NCOUNTS && !bad; k++) {
    size_t count = k_counts[k], total = count * (size_t)n;
    float *in = malloc((count + 1) * sizeof(float)), *out = malloc((total + 1) * sizeof(float));
    for (int inplace = 0; inplace <= 1 && !bad; inplace++) {
      for (size_t i = 0; i < total; i++) out[i] = -99.0f;
      out[total] = GUARD;
      float *src = inplace ? out + (size_t)rank * count : in;
      for (size_t i = 0; i < count; i++) src[i] = val(rank, i);
      if (comm_all_gather(c, src, out, count, DT_F32)) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[64];
      snprintf(what, sizeof what, "all_gather(n=%d, count=%zu, %s)", n, count,
               inplace ? "in place" : "out of place");
      bad = count ? check_equal(rank, what, out, total, want_gather, &count) : 0;
      if (!bad && out[total] != GUARD) {
        fprintf(stderr, "rank %d: %s wrote past the end of the output\n", rank, what);
        bad = 1;
      }
    }
    free(in);
    free(out);
  }
  comm_destroy(c);
  return bad;
}

static void test_all_gather(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_all_gather, NULL), 0);
}

/* ---- reduce_scatter ---- */

typedef struct {
  int n, rank;
  size_t count;
  comm_op_t op;
} rs_ctx_t;

static float want_rs(size_t i, void *ctx) {
  rs_ctx_t *e = ctx;
  return expect_reduce(e->n, (size_t)e->rank * e->count + i, e->op);
}

static int rank_reduce_scatter(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "rs", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NCOUNTS && !bad; k++) {
    size_t count = k_counts[k], total = count * (size_t)n;
    float *in = malloc((total + 1) * sizeof(float)), *out = malloc((count + 1) * sizeof(float));
    for (size_t i = 0; i < total; i++) in[i] = val(rank, i);
    for (size_t o = 0; o < 3 && !bad; o++) {
      for (size_t i = 0; i < count; i++) out[i] = -99.0f;
      out[count] = GUARD;
      if (comm_reduce_scatter(c, in, out, count, DT_F32, k_ops[o])) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[80];
      snprintf(what, sizeof what, "reduce_scatter(%s, n=%d, count=%zu)", comm_op_name(k_ops[o]), n, count);
      rs_ctx_t e = {n, rank, count, k_ops[o]};
      bad = check_equal(rank, what, out, count, want_rs, &e);
      if (!bad && out[count] != GUARD) {
        fprintf(stderr, "rank %d: %s wrote past the end of the output\n", rank, what);
        bad = 1;
      }
      for (size_t i = 0; i < total && !bad; i++)
        if (in[i] != val(rank, i)) {
          fprintf(stderr, "rank %d: %s modified its input at %zu\n", rank, what, i);
          bad = 1;
        }
    }
    free(in);
    free(out);
  }
  comm_destroy(c);
  return bad;
}

static void test_reduce_scatter(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_reduce_scatter, NULL), 0);
}

/* ---- broadcast ---- */

static float want_bcast(size_t i, void *ctx) { return val(*(int *)ctx, i); }

static int rank_broadcast(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "bc", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NCOUNTS && !bad; k++) {
    size_t count = k_counts[k];
    float *buf = malloc((count + 1) * sizeof(float));
    for (int root = 0; root < n && !bad; root++) {
      for (size_t i = 0; i < count; i++) buf[i] = val(rank, i);
      buf[count] = GUARD;
      if (comm_broadcast(c, buf, count, DT_F32, root)) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[64];
      snprintf(what, sizeof what, "broadcast(root=%d, n=%d, count=%zu)", root, n, count);
      bad = check_equal(rank, what, buf, count, want_bcast, &root) || buf[count] != GUARD;
    }
    free(buf);
  }
  comm_destroy(c);
  return bad;
}

static void test_broadcast(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_broadcast, NULL), 0);
}

/* ---- barrier: nobody leaves before everyone has arrived ---- */

static int rank_barrier(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "bar", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (int round = 0; round < 3 && !bad; round++) {
    char key[32];
    snprintf(key, sizeof key, "arrived/%d", round);
    int64_t v = 0;
    if (store_add(st, key, 1, &v) != 0) return 1;
    if (comm_barrier(c)) {
      fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
      return 1;
    }
    if (store_add(st, key, 0, &v) != 0) return 1;
    if (v != n) {
      fprintf(stderr, "rank %d: left barrier %d when only %lld of %d ranks had arrived\n", rank,
              round, (long long)v, n);
      bad = 1;
    }
  }
  comm_destroy(c);
  return bad;
}

static void test_barrier(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_barrier, NULL), 0);
}

/* ---- random floats: identical bits on every rank and in every run ---- */

static uint64_t fnv1a(const void *p, size_t len) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < len; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static float rnd(int rank, size_t i) {
  uint64_t x = (uint64_t)rank * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull + 1;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Every rank publishes its hash under tag/<rank>; each compares against all. */
static int same_on_all_ranks(store_t *st, int rank, int n, const char *tag, uint64_t h) {
  char key[64], mine[32];
  snprintf(key, sizeof key, "%s/%d", tag, rank);
  snprintf(mine, sizeof mine, "%016llx", (unsigned long long)h);
  if (store_set(st, key, mine, strlen(mine))) return 1;
  int bad = 0;
  for (int r = 0; r < n && !bad; r++) {
    void *v = NULL;
    size_t len = 0;
    snprintf(key, sizeof key, "%s/%d", tag, r);
    if (store_get(st, key, &v, &len, 10000) != 0) return 1;
    if (len != strlen(mine) || memcmp(v, mine, len) != 0) {
      fprintf(stderr, "rank %d: %s: result bits differ from rank %d's (%s vs %.*s)\n", rank, tag, r, mine,
              (int)len, (char *)v);
      bad = 1;
    }
    free(v);
  }
  return bad;
}

static int rank_determinism(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "det", rank, n, st, 10000)) return 1;
  size_t count = 100003;
  float *buf = malloc(count * sizeof(float));
  uint64_t h[2];
  for (int run = 0; run < 2; run++) {
    for (size_t i = 0; i < count; i++) buf[i] = rnd(rank, i);
    if (comm_all_reduce(c, buf, count, DT_F32, COMM_SUM)) {
      fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
      return 1;
    }
    h[run] = fnv1a(buf, count * sizeof(float));
  }
  int bad = 0;
  if (h[0] != h[1]) {
    fprintf(stderr, "rank %d: two identical all_reduces gave different bits\n", rank);
    bad = 1;
  }
  /* Against a double-precision sum: |got - want| <= 1e-6 * sum |x| (fp32 rounding of n terms). */
  double maxdiff = 0;
  for (size_t i = 0; i < count; i++) {
    double want = 0, mag = 0;
    for (int r = 0; r < n; r++) {
      want += rnd(r, i);
      mag += fabs(rnd(r, i));
    }
    double d = fabs(buf[i] - want) / (mag > 0 ? mag : 1);
    if (d > maxdiff) maxdiff = d;
  }
  if (maxdiff > 1e-6) {
    fprintf(stderr, "rank %d: relative difference %.3g exceeds tolerance 1e-6\n", rank, maxdiff);
    bad = 1;
  }
  if (!bad) bad = same_on_all_ranks(st, rank, n, "hash", h[0]);
  if (rank == 0) printf("  determinism: n=%d count=%zu max relative difference %.3g (tolerance 1e-6)\n", n, count, maxdiff);
  free(buf);
  comm_destroy(c);
  return bad;
}

static void test_determinism(void **state) {
  assert_int_equal(run_ranks(3, rank_determinism, NULL), 0);
  assert_int_equal(run_ranks(4, rank_determinism, NULL), 0);
}

/* ---- traffic: all_reduce sends 2 (n-1)/n of the buffer per rank ---- */

static int rank_bytes(int rank, int n, store_t *st, void *arg) {
  size_t count = *(size_t *)arg;
  comm_t *c;
  if (comm_open(&c, "bytes", rank, n, st, 10000)) return 1;
  float *buf = calloc(count, sizeof(float));
  comm_reset_stats(c);
  if (comm_all_reduce(c, buf, count, DT_F32, COMM_SUM)) {
    fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
    return 1;
  }
  comm_stats_t s;
  comm_get_stats(c, &s);
  double size = (double)count * sizeof(float);
  double ideal = 2.0 * (n - 1) / n * size;
  double ratio = (double)s.bytes_sent / ideal;
  /* Balanced chunks: rank r sends every chunk but its own in the reduce-scatter and every
   * chunk but its right neighbour's in the all-gather, exactly. */
  size_t q = count / (size_t)n, rem = count % (size_t)n;
  size_t len_r = q + ((size_t)rank < rem), len_r1 = q + ((size_t)((rank + 1) % n) < rem);
  uint64_t exact = (uint64_t)(2 * count - len_r - len_r1) * sizeof(float);
  int bad = 0;
  if (s.bytes_sent != exact || fabs(ratio - 1.0) > 0.01 || s.bytes_sent >= (n - 1) * size) {
    fprintf(stderr, "rank %d: sent %llu bytes for a %.0f-byte all_reduce on %d ranks; want %llu; "
            "2(n-1)/n*size = %.0f (ratio %.4f, tolerance 1%%), naive (n-1)*size = %.0f\n", rank,
            (unsigned long long)s.bytes_sent, size, n, (unsigned long long)exact, ideal, ratio,
            (n - 1) * size);
    bad = 1;
  }
  if (rank == 0)
    printf("  all_reduce n=%d size=%.0f B: sent %llu B/rank = %.4f x 2(n-1)/n*size\n", n, size,
           (unsigned long long)s.bytes_sent, ratio);
  free(buf);
  comm_destroy(c);
  return bad;
}

static void test_all_reduce_bytes(void **state) {
  size_t big = 1u << 20, odd = 1000;
  assert_int_equal(run_ranks(4, rank_bytes, &big), 0);
  assert_int_equal(run_ranks(3, rank_bytes, &odd), 0);
}

/* ---- failures: a dead peer, a stalled peer ---- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Rank 2 of 3 exits right after setup; the others are mid all_reduce with a 20 s timeout and
 * must fail within 5 s, rank 0 (rank 2's right neighbour) naming rank 2. */
static int rank_peer_exit(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "dead", rank, n, st, 20000)) return 1;
  if (comm_barrier(c)) return 1;
  if (rank == 2) _exit(0); /* dies without a word, sockets closed by the kernel */
  size_t count = 1u << 20;
  float *buf = calloc(count, sizeof(float));
  double t0 = now_s();
  int rc = comm_all_reduce(c, buf, count, DT_F32, COMM_SUM);
  double dt = now_s() - t0;
  const char *msg = comm_errmsg(c);
  printf("  rank %d: rc=%s after %.3f s: %s\n", rank, comm_strerror(rc), dt, msg);
  int bad = 0;
  if (rc != COMM_EREMOTE && rc != COMM_ETIMEDOUT) bad = 1;
  if (rc == COMM_ETIMEDOUT || dt > 5.0) bad = 1;
  if (rank == 0 && !strstr(msg, "rank 2 (127.0.0.1:")) bad = 1;
  if (!strstr(msg, "comm dead (rank ")) bad = 1;
  /* The communicator is broken now: later calls fail at once with the first message. */
  if (comm_barrier(c) != rc || strstr(comm_errmsg(c), "all_reduce") == NULL) bad = 1;
  if (bad) fprintf(stderr, "rank %d: unexpected failure report\n", rank);
  free(buf);
  comm_destroy(c);
  return bad;
}

static void test_peer_exit(void **state) { assert_int_equal(run_ranks(3, rank_peer_exit, NULL), 0); }

/* Rank 2 of 3 stays alive but never joins the collective (it waits on a store key the others
 * set when they are done); with a 0.5 s timeout rank 0 must report a timeout naming rank 2. */
static int rank_stall(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "stall", rank, n, st, 500)) return 1;
  if (rank == 2) {
    void *v = NULL;
    size_t len;
    int rc = store_get(st, "release/0", &v, &len, 20000);
    free(v);
    if (rc == 0) rc = store_get(st, "release/1", &v, &len, 20000);
    free(v);
    comm_destroy(c);
    return rc;
  }
  float buf[1000] = {0};
  double t0 = now_s();
  int rc = comm_all_reduce(c, buf, 1000, DT_F32, COMM_SUM);
  double dt = now_s() - t0;
  const char *msg = comm_errmsg(c);
  printf("  rank %d: rc=%s after %.3f s: %s\n", rank, comm_strerror(rc), dt, msg);
  int bad = 0;
  if (rc == COMM_OK || dt > 3.0) bad = 1;
  if (rank == 0 && (rc != COMM_ETIMEDOUT || dt < 0.45 ||
                    !strstr(msg, "all_reduce timed out after 0.5 s waiting for rank 2 (127.0.0.1:")))
    bad = 1;
  char key[32];
  snprintf(key, sizeof key, "release/%d", rank);
  store_set(st, key, "1", 1);
  if (bad) fprintf(stderr, "rank %d: unexpected failure report\n", rank);
  comm_destroy(c);
  return bad;
}

static void test_stall_timeout(void **state) { assert_int_equal(run_ranks(3, rank_stall, NULL), 0); }

/* ---- the fatal path: a device error on one rank must not leave its peers waiting ---- */

/* Rank 1 forks a child that shares its communicator and dies in backend_fatal (the function
 * behind CUDA_CHECK, CUBLAS_CHECK and NCCL_CHECK). Rank 1 itself keeps the sockets open, so
 * the kernel sends no end-of-file at the child's exit: only the fatal path's abort of every
 * registered communicator (shutdown of the ring) can tell rank 0, which is waiting in an
 * all_reduce with a 30 s timeout. Rank 0 must fail within 5 s naming rank 1; the child must
 * exit 1 after printing "[trainer rank 1 HOST] FILE:LINE: CALL: MESSAGE". */
static int rank_fatal(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "fatal", rank, n, st, 30000)) return 1;
  if (comm_barrier(c)) return 1;
  int bad = 0;
  if (rank == 0) {
    size_t count = 1u << 16;
    float *buf = calloc(count, sizeof(float));
    double t0 = now_s();
    int rc = comm_all_reduce(c, buf, count, DT_F32, COMM_SUM);
    double dt = now_s() - t0;
    printf("  rank 0: all_reduce rc=%s after %.3f s (limit 5 s, comm timeout 30 s): %s\n", comm_strerror(rc), dt,
           comm_errmsg(c));
    if (rc != COMM_EREMOTE || dt > 5.0 || !strstr(comm_errmsg(c), "rank 1 (127.0.0.1:")) {
      fprintf(stderr, "rank 0: the peer's fatal error did not fail this all_reduce promptly\n");
      bad = 1;
    }
    free(buf);
    store_set(st, "fatal/checked", "1", 1);
  } else {
    int pfd[2];
    if (pipe(pfd)) return 1;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
      dup2(pfd[1], 2);
      setenv("RANK", "1", 1);
      backend_fatal("trainer/backend/backend_cuda.cu", 123, "cudaMemcpyAsync(dst, src, bytes)",
                    "an illegal memory access was encountered");
    }
    close(pfd[1]);
    char out[512] = "";
    size_t len = 0;
    ssize_t k;
    while (len < sizeof out - 1 && (k = read(pfd[0], out + len, sizeof out - 1 - len)) > 0) len += (size_t)k;
    out[len] = '\0';
    close(pfd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    char host[256] = "?", want[512];
    gethostname(host, sizeof host - 1);
    snprintf(want, sizeof want, "[trainer rank 1 %s] trainer/backend/backend_cuda.cu:123: cudaMemcpyAsync(dst, src, bytes): "
             "an illegal memory access was encountered\n", host);
    printf("  rank 1: child exited %d, printed: %s", WIFEXITED(status) ? WEXITSTATUS(status) : -1, out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1 || strcmp(out, want) != 0) {
      fprintf(stderr, "rank 1: fatal child: want exit 1 and \"%s\"\n", want);
      bad = 1;
    }
    /* Hold the sockets until rank 0 has seen the failure (its deadline is far longer). */
    void *v = NULL;
    size_t vl;
    if (store_get(st, "fatal/checked", &v, &vl, 20000)) bad = 1;
    free(v);
  }
  comm_destroy(c);
  return bad;
}

static void test_fatal_aborts_comms(void **state) { assert_int_equal(run_ranks(2, rank_fatal, NULL), 0); }

/* comm_fail_next (the fault-injection hook): rank 1's next collective fails as a lost
 * connection would, and rank 0, inside the same collective, fails at once instead of waiting out
 * the 30 s timeout. Both stay broken. */
static int rank_fail_next(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "inject", rank, n, st, 30000)) return 1;
  if (comm_barrier(c)) return 1;
  if (rank == 1) comm_fail_next(c);
  float buf[4096] = {0};
  double t0 = now_s();
  int rc = comm_all_reduce(c, buf, 4096, DT_F32, COMM_SUM);
  double dt = now_s() - t0;
  printf("  rank %d: rc=%s after %.3f s: %s\n", rank, comm_strerror(rc), dt, comm_errmsg(c));
  int bad = dt > 5.0;
  if (rank == 1 && (rc != COMM_ESYSTEM || !strstr(comm_errmsg(c), "all_reduce: fault injected"))) bad = 1;
  if (rank == 0 && rc != COMM_EREMOTE) bad = 1;
  if (comm_barrier(c) != rc) bad = 1; /* broken for good, with the first code */
  if (bad) fprintf(stderr, "rank %d: unexpected result of the injected fault\n", rank);
  comm_destroy(c);
  return bad;
}

static void test_fail_next(void **state) { assert_int_equal(run_ranks(2, rank_fail_next, NULL), 0); }

/* Where each backend's memory lives, and the registry: comm_abort_all breaks every live
 * communicator (a one-rank group has no peer, but its calls fail from then on), and a destroyed
 * one is no longer in the registry. */
static void test_memory_and_abort(void **state) {
  assert_int_equal(comm_backend_memory(NULL), COMM_MEM_HOST);
  assert_int_equal(comm_backend_memory("cpu"), COMM_MEM_HOST);
  assert_int_equal(comm_backend_memory("nccl"), COMM_MEM_DEVICE);
  assert_int_equal(comm_backend_memory("staged"), COMM_MEM_DEVICE);
  char err[512] = "";
  comm_config_t cfg = {.name = "solo", .rank = 0, .size = 1};
  comm_t *a = NULL, *b = NULL;
  assert_int_equal(comm_create(&a, "cpu", &cfg, err, sizeof err), COMM_OK);
  cfg.name = "solo2";
  assert_int_equal(comm_create(&b, "cpu", &cfg, err, sizeof err), COMM_OK);
  assert_int_equal(comm_memory(a), COMM_MEM_HOST);
  comm_destroy(b);
  comm_abort_all("test");
  float x = 1;
  assert_int_equal(comm_all_reduce(a, &x, 1, DT_F32, COMM_SUM), COMM_ESYSTEM);
  printf("  after comm_abort_all: %s\n", comm_errmsg(a));
  assert_non_null(strstr(comm_errmsg(a), "comm solo (rank 0/1): aborted: test"));
  comm_destroy(a);
  comm_abort_all("nothing left"); /* the registry is empty: touches no freed communicator */
}

/* ---- argument checks (one-rank groups need no store) ---- */

static void test_invalid_arguments(void **state) {
  char err[512] = "";
  comm_t *c = NULL;
  comm_config_t cfg = {.name = "solo", .rank = 0, .size = 1};
  assert_int_equal(comm_create(&c, "cpu", &cfg, err, sizeof err), COMM_OK);
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  assert_int_equal(comm_broadcast(c, x, 8, DT_F32, 1), COMM_EINVAL);
  assert_non_null(strstr(comm_errmsg(c), "comm solo (rank 0/1): broadcast: root 1"));
  assert_int_equal(comm_all_reduce(c, NULL, 8, DT_F32, COMM_SUM), COMM_EINVAL);
  assert_int_equal(comm_all_reduce(c, x, 8, DT_F32, (comm_op_t)7), COMM_EINVAL);
  assert_int_equal(comm_all_reduce(c, x, 8, (dtype_t)9, COMM_SUM), COMM_EINVAL);
  assert_int_equal(comm_all_gather(c, x + 1, x, 4, DT_F32), COMM_EINVAL); /* overlap */
  assert_int_equal(comm_reduce_scatter(c, x, x + 2, 4, DT_F32, COMM_SUM), COMM_EINVAL);
  /* Invalid arguments do not break the communicator. */
  assert_int_equal(comm_all_reduce(c, x, 8, DT_F32, COMM_SUM), COMM_OK);
  assert_true(x[7] == 8.0f);
  float y[4];
  assert_int_equal(comm_reduce_scatter(c, x, y, 4, DT_F32, COMM_AVG), COMM_OK);
  assert_true(y[3] == 4.0f);
  comm_destroy(c);

  cfg.size = 2;
  assert_int_equal(comm_create(&c, "cpu", &cfg, err, sizeof err), COMM_EINVAL); /* no store */
  assert_non_null(strstr(err, "needs a store"));
  cfg.name = "bad name";
  assert_int_equal(comm_create(&c, "cpu", &cfg, err, sizeof err), COMM_EINVAL);
  cfg.name = "x";
  cfg.size = 1;
  assert_int_equal(comm_create(&c, "mpi", &cfg, err, sizeof err), COMM_EINVAL);
  assert_non_null(strstr(err, "unknown backend 'mpi'"));
  assert_null(c);
}

/* ---- a 2x2x2 mesh: each group's all_reduce mixes exactly its members ---- */

/* Membership written out from the coordinates, independently of mesh.c. */
static int same_group(const char *g, int a, int b) {
  int ar = a / 4, as = (a / 2) % 2, at = a % 2, br = b / 4, bs = (b / 2) % 2, bt = b % 2;
  if (!strcmp(g, "tp")) return ar == br && as == bs;
  if (!strcmp(g, "dp_shard")) return ar == br && at == bt;
  if (!strcmp(g, "dp_replicate")) return as == bs && at == bt;
  if (!strcmp(g, "dp")) return at == bt;
  return 1; /* world */
}

static int rank_mesh(int rank, int n, store_t *st, void *arg) {
  char err[512] = "";
  mesh_t *m = NULL;
  if (mesh_create(&m, 2, 2, 2, rank, n, err, sizeof err) ||
      mesh_connect(m, "cpu", NULL, st, 0, "127.0.0.1", 10000, err, sizeof err)) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    mesh_destroy(m);
    return 1;
  }
  static const char *names[] = {"tp", "dp_shard", "dp_replicate", "dp", "world"};
  int bad = 0;
  for (int g = 0; g < 5 && !bad; g++) {
    comm_t *c = mesh_comm(m, names[g]);
    float x[3] = {(float)(1 << rank), 1.0f, (float)rank};
    if (!c || comm_all_reduce(c, x, 3, DT_F32, COMM_SUM)) {
      fprintf(stderr, "rank %d: group %s: %s\n", rank, names[g], c ? comm_errmsg(c) : "missing");
      bad = 1;
      break;
    }
    int mask = 0, size = 0;
    for (int q = 0; q < n; q++)
      if (same_group(names[g], rank, q)) mask |= 1 << q, size++;
    if ((int)x[0] != mask || (int)x[1] != size || comm_size(c) != size) {
      fprintf(stderr, "rank %d: group %s mixed members 0x%02x (size %d), want 0x%02x (size %d)\n",
              rank, names[g], (int)x[0], (int)x[1], mask, size);
      bad = 1;
    }
  }
  mesh_destroy(m);
  return bad;
}

static void test_mesh_2x2x2(void **state) { assert_int_equal(run_ranks(8, rank_mesh, NULL), 0); }

/* ---- bfloat16: exact answers on small integers, byte moves, rounding, random inputs ----
 *
 * The exact tests use the integers of val(): every partial sum (|s| <= 44) is a bf16 value, so
 * SUM and MAX are exact and AVG is the sum divided by n in fp32 and rounded once (exact for n = 2
 * and 4). Counts are odd or smaller than the group (all_reduce then has empty chunks), and a
 * guard element after every buffer catches a size computed with sizeof(float). */

static const size_t k_bf_counts[] = {0, 1, 2, 3, 7, 1001, (1u << 18) + 3};
#define NBFCOUNTS (sizeof k_bf_counts / sizeof k_bf_counts[0])
static const bf16_t BF_GUARD = 0x5a5a;

static bf16_t bval(int rank, size_t i) { return bf16_from_f32(val(rank, i)); }

/* Arbitrary bit patterns (NaNs with payloads, subnormals, infinities among them): all_gather and
 * broadcast must move them untouched, which a conversion through fp32 would not. */
static bf16_t bpat(int rank, size_t i) { return (bf16_t)(i * 40503u + (size_t)rank * 7919u + 1u); }

static bf16_t bf_expect(int n, size_t i, comm_op_t op) {
  float sum = 0, mx = val(0, i);
  for (int r = 0; r < n; r++) {
    sum += val(r, i);
    mx = fmaxf(mx, val(r, i));
  }
  if (op == COMM_MAX) return bf16_from_f32(mx);
  return bf16_from_f32(op == COMM_AVG ? sum / (float)n : sum);
}

static int check_bf16(int rank, const char *what, const bf16_t *got, const bf16_t *want, size_t count) {
  for (size_t i = 0; i < count; i++)
    if (got[i] != want[i]) {
      fprintf(stderr, "rank %d: %s: element %zu of %zu is %.9g (0x%04x), want %.9g (0x%04x) (tolerance: exact)\n",
              rank, what, i, count, bf16_to_f32(got[i]), got[i], bf16_to_f32(want[i]), want[i]);
      return 1;
    }
  return 0;
}

static int rank_bf16_all_reduce(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "bar16", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NBFCOUNTS && !bad; k++) {
    size_t count = k_bf_counts[k];
    bf16_t *buf = malloc((count + 1) * sizeof *buf), *want = malloc((count + 1) * sizeof *want);
    for (size_t o = 0; o < 3 && !bad; o++) {
      for (size_t i = 0; i < count; i++) {
        buf[i] = bval(rank, i);
        want[i] = bf_expect(n, i, k_ops[o]);
      }
      buf[count] = want[count] = BF_GUARD;
      if (comm_all_reduce(c, buf, count, DT_BF16, k_ops[o])) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[80];
      snprintf(what, sizeof what, "bf16 all_reduce(%s, n=%d, count=%zu)", comm_op_name(k_ops[o]), n, count);
      bad = check_bf16(rank, what, buf, want, count + 1); /* the guard too */
    }
    free(buf);
    free(want);
  }
  comm_destroy(c);
  return bad;
}

static void test_bf16_all_reduce(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_bf16_all_reduce, NULL), 0);
}

static int rank_bf16_reduce_scatter(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "brs16", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NBFCOUNTS && !bad; k++) {
    size_t count = k_bf_counts[k], total = count * (size_t)n;
    bf16_t *in = malloc((total + 1) * sizeof *in), *out = malloc((count + 1) * sizeof *out);
    bf16_t *want = malloc((count + 1) * sizeof *want);
    for (size_t i = 0; i < total; i++) in[i] = bval(rank, i);
    for (size_t o = 0; o < 3 && !bad; o++) {
      for (size_t i = 0; i < count; i++) {
        out[i] = 0xffff;
        want[i] = bf_expect(n, (size_t)rank * count + i, k_ops[o]);
      }
      out[count] = want[count] = BF_GUARD;
      if (comm_reduce_scatter(c, in, out, count, DT_BF16, k_ops[o])) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[80];
      snprintf(what, sizeof what, "bf16 reduce_scatter(%s, n=%d, count=%zu)", comm_op_name(k_ops[o]), n, count);
      bad = check_bf16(rank, what, out, want, count + 1);
      for (size_t i = 0; i < total && !bad; i++)
        if (in[i] != bval(rank, i)) {
          fprintf(stderr, "rank %d: %s modified its input at %zu\n", rank, what, i);
          bad = 1;
        }
    }
    free(in);
    free(out);
    free(want);
  }
  comm_destroy(c);
  return bad;
}

static void test_bf16_reduce_scatter(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_bf16_reduce_scatter, NULL), 0);
}

static int rank_bf16_all_gather(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "bag16", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NBFCOUNTS && !bad; k++) {
    size_t count = k_bf_counts[k], total = count * (size_t)n;
    bf16_t *in = malloc((count + 1) * sizeof *in), *out = malloc((total + 1) * sizeof *out);
    bf16_t *want = malloc((total + 1) * sizeof *want);
    for (size_t i = 0; i < total; i++) want[i] = bpat((int)(i / count), i % count);
    want[total] = BF_GUARD;
    for (int inplace = 0; inplace <= 1 && !bad; inplace++) {
      for (size_t i = 0; i < total; i++) out[i] = 0;
      out[total] = BF_GUARD;
      bf16_t *src = inplace ? out + (size_t)rank * count : in;
      for (size_t i = 0; i < count; i++) src[i] = bpat(rank, i);
      if (comm_all_gather(c, src, out, count, DT_BF16)) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[80];
      snprintf(what, sizeof what, "bf16 all_gather(n=%d, count=%zu, %s)", n, count,
               inplace ? "in place" : "out of place");
      bad = check_bf16(rank, what, out, want, total + 1);
    }
    free(in);
    free(out);
    free(want);
  }
  comm_destroy(c);
  return bad;
}

static void test_bf16_all_gather(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_bf16_all_gather, NULL), 0);
}

static int rank_bf16_broadcast(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "bbc16", rank, n, st, 10000)) return 1;
  int bad = 0;
  for (size_t k = 0; k < NBFCOUNTS && !bad; k++) {
    size_t count = k_bf_counts[k];
    bf16_t *buf = malloc((count + 1) * sizeof *buf), *want = malloc((count + 1) * sizeof *want);
    for (int root = 0; root < n && !bad; root++) {
      for (size_t i = 0; i < count; i++) {
        buf[i] = bpat(rank, i);
        want[i] = bpat(root, i);
      }
      buf[count] = want[count] = BF_GUARD;
      if (comm_broadcast(c, buf, count, DT_BF16, root)) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
        break;
      }
      char what[80];
      snprintf(what, sizeof what, "bf16 broadcast(root=%d, n=%d, count=%zu)", root, n, count);
      bad = check_bf16(rank, what, buf, want, count + 1);
    }
    free(buf);
    free(want);
  }
  comm_destroy(c);
  return bad;
}

static void test_bf16_broadcast(void **state) {
  for (int n = 1; n <= 4; n++) assert_int_equal(run_ranks(n, rank_bf16_broadcast, NULL), 0);
}

/* Rounding of one combining step, two ranks (tolerance: exact bits). Spacing of bf16 is 2^-7
 * at 1 and 2 at 256, so 1 + 2^-8 and 257 are ties that go to the even neighbour (1 and 256),
 * 1 + 3 * 2^-8 is a tie that goes up (to 1 + 2^-6), 1 - 2^-9 a tie that goes up to 1; the
 * largest finite bf16 doubled overflows to infinity; inf - inf and NaN + 1 are NaN; -0 + -0 is
 * -0. Truncation or rounding half up would fail the ties. */
static int rank_bf16_rounding(int rank, int n, store_t *st, void *arg) {
  static const float a[] = {1, 1, 256, 1, 0x1.fep127f, INFINITY, NAN, -0.0f, 3};
  static const float b[] = {0x1p-8f, 0x3p-8f, 1, -0x1p-9f, 0x1.fep127f, -INFINITY, 1, -0.0f, 0.5f};
  static const float sum[] = {1, 1 + 0x1p-6f, 256, 1, INFINITY, NAN, NAN, -0.0f, 3.5f};
  enum { K = sizeof a / sizeof a[0] };
  comm_t *c;
  if (comm_open(&c, "bround", rank, n, st, 10000)) return 1;
  bf16_t buf[K];
  for (int i = 0; i < K; i++) buf[i] = bf16_from_f32(rank == 0 ? a[i] : b[i]);
  int bad = 0;
  if (comm_all_reduce(c, buf, K, DT_BF16, COMM_SUM)) {
    fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
    bad = 1;
  }
  for (int i = 0; i < K && !bad; i++) {
    float got = bf16_to_f32(buf[i]);
    int ok = isnan(sum[i]) ? isnan(got) : buf[i] == bf16_from_f32(sum[i]);
    if (!ok) {
      fprintf(stderr, "rank %d: bf16 %.9g + %.9g gave %.9g (0x%04x), want %.9g (round to nearest even, exact)\n",
              rank, a[i], b[i], got, buf[i], sum[i]);
      bad = 1;
    }
  }
  comm_destroy(c);
  return bad;
}

static void test_bf16_rounding(void **state) { assert_int_equal(run_ranks(2, rank_bf16_rounding, NULL), 0); }

/* Random bf16 inputs in [-1, 1), checked three ways:
 *  1. bit for bit against the documented order: chunk k of the ring is reduced from rank k + 1
 *     around to rank k, each step widening, combining in fp32 and rounding once; AVG then
 *     divides by n in fp32 and rounds (tolerance: exact);
 *  2. against an fp32 reference (the inputs widened and summed in fp32): SUM within
 *     (n - 1) * 2^-8 * sum|x| (one bf16 rounding per step, each at most 2^-8, the unit roundoff
 *     of an 8-bit significand, of a partial sum no larger than sum|x|), AVG within
 *     n * 2^-8 * sum|x| / n (one more rounding), MAX exact; 1% slack covers the fp32
 *     reference's own rounding. Truncating instead of rounding would err by up to 2^-7;
 *  3. identical bits on every rank and in a second run, and reduce_scatter's slice equal to the
 *     all_reduce of the same n * count inputs (its chunks are then the same). */
static bf16_t brnd(int rank, size_t i) { return bf16_from_f32(rnd(rank, i)); }

static int mod_n(int a, int n) { return ((a % n) + n) % n; }

static bf16_t ring_model(int n, int k, size_t i, comm_op_t op) {
  bf16_t acc = brnd(mod_n(k + 1, n), i);
  for (int s = 2; s <= n; s++) {
    bf16_t own = brnd(mod_n(k + s, n), i);
    float a = bf16_to_f32(acc), b = bf16_to_f32(own);
    acc = op == COMM_MAX ? (a > b ? acc : own) : bf16_from_f32(a + b);
  }
  return op == COMM_AVG ? bf16_from_f32(bf16_to_f32(acc) / (float)n) : acc;
}

/* The balanced chunk of element i (all_reduce: sizes differ by at most one, larger ones first). */
static int chunk_of(size_t i, size_t count, int n) {
  size_t q = count / (size_t)n, r = count % (size_t)n;
  return i < r * (q + 1) ? (int)(i / (q + 1)) : (int)(r + (i - r * (q + 1)) / q);
}

static int rank_bf16_random(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (comm_open(&c, "brnd", rank, n, st, 10000)) return 1;
  const size_t count = 100003, rs_count = 33335; /* odd, and not multiples of 3 or 4 */
  size_t rs_total = rs_count * (size_t)n;
  bf16_t *buf = malloc(count * sizeof *buf), *again = malloc(count * sizeof *again);
  bf16_t *rs_in = malloc(rs_total * sizeof *rs_in), *rs_out = malloc(rs_count * sizeof *rs_out);
  bf16_t *rs_ar = malloc(rs_total * sizeof *rs_ar);
  int bad = 0;
  for (size_t o = 0; o < 3 && !bad; o++) {
    comm_op_t op = k_ops[o];
    for (int run = 0; run < 2 && !bad; run++) {
      bf16_t *dst = run ? again : buf;
      for (size_t i = 0; i < count; i++) dst[i] = brnd(rank, i);
      if (comm_all_reduce(c, dst, count, DT_BF16, op)) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
        bad = 1;
      }
    }
    if (bad) break;
    if (memcmp(buf, again, count * sizeof *buf) != 0) {
      fprintf(stderr, "rank %d: bf16 all_reduce(%s): two identical calls gave different bits\n", rank,
              comm_op_name(op));
      bad = 1;
    }
    double maxrel = 0, tol = op == COMM_SUM ? (n - 1) * 0x1p-8 * 1.01 : op == COMM_AVG ? n * 0x1p-8 * 1.01 : 0;
    for (size_t i = 0; i < count && !bad; i++) {
      bf16_t model = ring_model(n, chunk_of(i, count, n), i, op);
      if (buf[i] != model) {
        fprintf(stderr, "rank %d: bf16 all_reduce(%s, n=%d): element %zu is 0x%04x, the ring order gives "
                "0x%04x (tolerance: exact)\n", rank, comm_op_name(op), n, i, buf[i], model);
        bad = 1;
      }
      float ref = op == COMM_MAX ? -INFINITY : 0, mag = 0;
      for (int r = 0; r < n; r++) {
        float x = bf16_to_f32(brnd(r, i));
        ref = op == COMM_MAX ? fmaxf(ref, x) : ref + x;
        mag += fabsf(x);
      }
      if (op == COMM_AVG) ref /= (float)n, mag /= (float)n;
      double rel = fabs((double)bf16_to_f32(buf[i]) - ref) / (mag > 0 ? mag : 1);
      if (rel > maxrel) maxrel = rel;
    }
    if (!bad && maxrel > tol) {
      fprintf(stderr, "rank %d: bf16 all_reduce(%s, n=%d): relative error %.3g exceeds tolerance %.3g\n", rank,
              comm_op_name(op), n, maxrel, tol);
      bad = 1;
    }
    char tag[32];
    snprintf(tag, sizeof tag, "bf16-%s", comm_op_name(op));
    if (!bad) bad = same_on_all_ranks(st, rank, n, tag, fnv1a(buf, count * sizeof *buf));
    if (rank == 0)
      printf("  bf16 all_reduce(%s) n=%d count=%zu: max relative error vs fp32 %.3g (tolerance %.3g), "
             "ring-order model exact, bits equal on all ranks\n", comm_op_name(op), n, count, maxrel, tol);
    /* reduce_scatter: its slice is the all_reduce's chunk of the same inputs, bit for bit. */
    for (size_t i = 0; i < rs_total; i++) rs_ar[i] = rs_in[i] = brnd(rank, i);
    if (bad || comm_reduce_scatter(c, rs_in, rs_out, rs_count, DT_BF16, op) ||
        comm_all_reduce(c, rs_ar, rs_total, DT_BF16, op)) {
      if (!bad) fprintf(stderr, "rank %d: %s\n", rank, comm_errmsg(c));
      bad = 1;
      break;
    }
    char what[80];
    snprintf(what, sizeof what, "bf16 reduce_scatter(%s, n=%d, count=%zu) vs all_reduce", comm_op_name(op), n,
             rs_count);
    bad = check_bf16(rank, what, rs_out, rs_ar + (size_t)rank * rs_count, rs_count);
  }
  free(buf);
  free(again);
  free(rs_in);
  free(rs_out);
  free(rs_ar);
  comm_destroy(c);
  return bad;
}

static void test_bf16_random(void **state) {
  for (int n = 2; n <= 4; n++) assert_int_equal(run_ranks(n, rank_bf16_random, NULL), 0);
}

/* The dispatch refuses bf16 to a backend whose table says float32 only (a fake one here: every
 * real backend moves bf16), and that refusal does not break the communicator. */
static int fake_calls;
static int fake_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op) {
  fake_calls++;
  return COMM_OK;
}

static void test_bf16_refused_by_fp32_backend(void **state) {
  static const comm_ops_t fake_ops = {.name = "fake", .all_reduce = fake_all_reduce, .bf16 = 0};
  comm_t c = {.ops = &fake_ops, .name = "fake.0", .rank = 0, .size = 2, .timeout_ms = 1000};
  bf16_t h[4] = {0};
  float f[4] = {0};
  assert_int_equal(comm_all_reduce(&c, h, 4, DT_BF16, COMM_SUM), COMM_EINVAL);
  printf("  %s\n", comm_errmsg(&c));
  assert_non_null(strstr(comm_errmsg(&c), "all_reduce: backend fake supports float32 only"));
  assert_int_equal(fake_calls, 0);
  assert_int_equal(comm_all_reduce(&c, f, 4, DT_F32, COMM_SUM), COMM_OK);
  assert_int_equal(fake_calls, 1);
  /* A one-rank cpu group answers bf16 itself, and a cpu group says it moves bf16. */
  char err[256] = "";
  comm_config_t cfg = {.name = "solo16", .rank = 0, .size = 1};
  comm_t *one = NULL;
  assert_int_equal(comm_create(&one, "cpu", &cfg, err, sizeof err), COMM_OK);
  h[0] = bf16_from_f32(1.5f);
  assert_int_equal(comm_all_reduce(one, h, 4, DT_BF16, COMM_AVG), COMM_OK);
  assert_int_equal(h[0], bf16_from_f32(1.5f));
  assert_int_equal(one->ops->bf16, 1);
  comm_destroy(one);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_invalid_arguments), cmocka_unit_test(test_all_reduce),
      cmocka_unit_test(test_all_gather),        cmocka_unit_test(test_reduce_scatter),
      cmocka_unit_test(test_broadcast),         cmocka_unit_test(test_barrier),
      cmocka_unit_test(test_determinism),       cmocka_unit_test(test_all_reduce_bytes),
      cmocka_unit_test(test_peer_exit),         cmocka_unit_test(test_stall_timeout),
      cmocka_unit_test(test_mesh_2x2x2),        cmocka_unit_test(test_fatal_aborts_comms),
      cmocka_unit_test(test_fail_next),         cmocka_unit_test(test_memory_and_abort),
      cmocka_unit_test(test_bf16_all_reduce),   cmocka_unit_test(test_bf16_reduce_scatter),
      cmocka_unit_test(test_bf16_all_gather),   cmocka_unit_test(test_bf16_broadcast),
      cmocka_unit_test(test_bf16_rounding),     cmocka_unit_test(test_bf16_random),
      cmocka_unit_test(test_bf16_refused_by_fp32_backend),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
