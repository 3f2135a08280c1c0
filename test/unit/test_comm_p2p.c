// deps: test/support/fixture.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c trainer/backend/fatal.c
/* test_comm_p2p: point-to-point sends and receives (comm_send, comm_recv, comm_start_send,
 * comm_start_recv) of the cpu backend, with real processes on loopback (test/support/fixture:
 * forked ranks, a store server, an alarm per rank; no fixed ports).
 *
 * What is checked: a pair moves float32 and bfloat16 messages of 10 to 2 Mi elements (8 MiB)
 * byte for byte (tolerance: exact; arbitrary bit patterns, NaN payloads included, so a conversion
 * would show), blocking and started, with a guard element after every receive buffer, the stats
 * (payload bytes exactly, calls) and the observer's "send"/"recv"; the pipeline's pattern, one
 * two-rank communicator per direction, exchanges 8 MiB both ways with everything started before
 * any wait; the same exchange on one communicator fails with a timeout instead of hanging (the
 * documented limit); rings of 3 and 4 pass messages to rank + 1; the refusals (non-neighbours,
 * the rank itself, out of range, a one-rank group, NULL buffers, a backend without
 * point-to-point) are COMM_EINVAL with their message and leave the communicator usable; a receive
 * whose count or dtype differs from the send's, or that meets a collective, fails with
 * COMM_EREMOTE naming both; a peer that exits, aborts, stalls or has a fault injected fails a
 * pending transfer promptly with a message naming it. Synchronization between ranks goes through
 * store keys, never sleeps. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/store.h"
#include "test/support/fixture.h"
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h" /* a fake backend without point-to-point (test_refusals_local) */

#define CHILD_ALARM_S 60
#define TIMEOUT_MS 20000
#define PROMPT_S 5.0 /* "promptly": a quarter of the communicators' timeout */

static int run_ranks(int n, fixture_rank_fn fn, void *arg) {
  int failed = fixture_run_ranks(n, fn, arg, CHILD_ALARM_S);
  assert_true(failed >= 0);
  return failed;
}

/* Arbitrary bytes (as floats: NaNs with payloads, subnormals, infinities among them). */
static void pattern(void *buf, size_t bytes, uint32_t salt) {
  unsigned char *b = buf;
  uint32_t x = salt * 2654435761u + 12345u;
  for (size_t i = 0; i < bytes; i++) {
    x = x * 1664525u + 1013904223u;
    b[i] = (unsigned char)(x >> 24);
  }
}

/* Receive buffers are count + 1 elements; the last must stay GUARD_BYTE. */
#define GUARD_BYTE 0xa5

/* 0 when buf holds pattern(salt) and an untouched guard element, else prints the first difference. */
static int check_message(int rank, const char *what, const void *buf, size_t count, dtype_t dtype,
                         uint32_t salt) {
  size_t esz = dtype_size(dtype), bytes = count * esz;
  unsigned char *want = malloc(bytes ? bytes : 1);
  pattern(want, bytes, salt);
  const unsigned char *got = buf;
  int bad = 0;
  for (size_t i = 0; i < bytes; i++)
    if (got[i] != want[i]) {
      fprintf(stderr, "rank %d: %s: element %zu of %zu differs at byte %zu: 0x%02x, want 0x%02x (tolerance: "
              "exact)\n", rank, what, i / esz, count, i % esz, got[i], want[i]);
      bad = 1;
      break;
    }
  for (size_t i = bytes; i < bytes + esz && !bad; i++)
    if (got[i] != GUARD_BYTE) {
      fprintf(stderr, "rank %d: %s wrote past the end of its %zu elements\n", rank, what, count);
      bad = 1;
    }
  free(want);
  return bad;
}

static void *recv_buffer(size_t count, dtype_t dtype) {
  size_t bytes = (count + 1) * dtype_size(dtype);
  void *b = malloc(bytes);
  if (b) memset(b, GUARD_BYTE, bytes);
  return b;
}

static const char *dname(dtype_t d) { return d == DT_F32 ? "float32" : "bfloat16"; }

/* ---- 1. a pair: three messages, blocking then started; stats and observer ---- */

typedef struct {
  size_t count;
  dtype_t dtype;
} msg_t;
static const msg_t k_msgs[] = {{10, DT_F32}, {1000, DT_BF16}, {(size_t)2 << 20, DT_F32}};
#define NMSGS (sizeof k_msgs / sizeof k_msgs[0])

/* What the observer heard (index 0: "send", 1: "recv"); it runs on the progress thread too. */
static pthread_mutex_t obs_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  int run[2], wait[2], other;
  uint64_t run_bytes[2], wait_bytes[2];
} obs;

static void observe(const comm_t *c, int what, const char *op, uint64_t bytes, int64_t t0, int64_t t1) {
  int k = !strcmp(op, "send") ? 0 : !strcmp(op, "recv") ? 1 : -1;
  pthread_mutex_lock(&obs_mu);
  if (k < 0 || t1 < t0) {
    obs.other++;
  } else if (what == COMM_OBSERVE_RUN) {
    obs.run[k]++;
    obs.run_bytes[k] += bytes;
  } else {
    obs.wait[k]++;
    obs.wait_bytes[k] += bytes;
  }
  pthread_mutex_unlock(&obs_mu);
}

static int check_stats(int rank, const char *when, comm_t *c, uint64_t sent, uint64_t recvd, uint64_t calls) {
  comm_stats_t s;
  comm_get_stats(c, &s);
  if (s.bytes_sent == sent && s.bytes_recv == recvd && s.calls == calls) return 0;
  fprintf(stderr, "rank %d: %s: stats sent %llu recv %llu calls %llu, want %llu %llu %llu\n", rank, when,
          (unsigned long long)s.bytes_sent, (unsigned long long)s.bytes_recv, (unsigned long long)s.calls,
          (unsigned long long)sent, (unsigned long long)recvd, (unsigned long long)calls);
  return 1;
}

static int rank_pair(int rank, int n, store_t *st, void *arg) {
  comm_set_observer(observe); /* before any communicator, as comm.h asks */
  comm_t *c;
  if (fixture_comm_open(&c, "pair", rank, n, st, TIMEOUT_MS)) return 1;
  const int peer = 1 - rank;
  void *buf[NMSGS];
  uint64_t total = 0;
  for (size_t m = 0; m < NMSGS; m++) {
    buf[m] = recv_buffer(k_msgs[m].count, k_msgs[m].dtype);
    total += k_msgs[m].count * dtype_size(k_msgs[m].dtype);
  }
  int bad = 0;
  char what[96];
  /* Round 0 blocking, on the caller's thread (no progress thread yet); round 1 started, all
   * three in flight before the first wait. Fresh contents each round. */
  for (int round = 0; round < 2 && !bad; round++) {
    comm_req_t *req[NMSGS] = {NULL};
    for (size_t m = 0; m < NMSGS && !bad; m++) {
      const msg_t *k = &k_msgs[m];
      uint32_t salt = (uint32_t)(10 * round + m);
      if (rank == 0) pattern(buf[m], k->count * dtype_size(k->dtype), salt);
      int rc = round == 0 ? (rank == 0 ? comm_send(c, buf[m], k->count, k->dtype, peer)
                                       : comm_recv(c, buf[m], k->count, k->dtype, peer))
                          : (rank == 0 ? comm_start_send(c, buf[m], k->count, k->dtype, peer, &req[m])
                                       : comm_start_recv(c, buf[m], k->count, k->dtype, peer, &req[m]));
      if (rc) {
        fprintf(stderr, "rank %d: %s: %s\n", rank, round ? "start" : "blocking", comm_errmsg(c));
        bad = 1;
      }
    }
    for (size_t m = 0; m < NMSGS && round == 1; m++) {
      uint64_t sent = 99;
      int rc = comm_wait(req[m], &sent);
      uint64_t want_sent = rank == 0 ? k_msgs[m].count * dtype_size(k_msgs[m].dtype) : 0;
      if (rc || sent != want_sent) {
        fprintf(stderr, "rank %d: wait %zu: rc %d sent %llu (want %llu): %s\n", rank, m, rc,
                (unsigned long long)sent, (unsigned long long)want_sent, comm_errmsg(c));
        bad = 1;
      }
    }
    for (size_t m = 0; m < NMSGS && rank == 1 && !bad; m++) {
      snprintf(what, sizeof what, "%s recv of %zu %s", round ? "started" : "blocking", k_msgs[m].count,
               dname(k_msgs[m].dtype));
      bad = check_message(rank, what, buf[m], k_msgs[m].count, k_msgs[m].dtype, (uint32_t)(10 * round + m));
    }
    uint64_t r = (uint64_t)round + 1;
    snprintf(what, sizeof what, "after round %d", round);
    if (!bad) bad = check_stats(rank, what, c, rank == 0 ? r * total : 0, rank == 1 ? r * total : 0, r * NMSGS);
  }
  /* The observer: 6 runs and 6 waits of this rank's op and nothing else; a run's bytes are what
   * this rank sent, a wait's its buffer. */
  int k = rank; /* rank 0 sends, rank 1 receives */
  pthread_mutex_lock(&obs_mu);
  if (!bad && (obs.run[k] != 6 || obs.wait[k] != 6 || obs.run[1 - k] || obs.wait[1 - k] || obs.other ||
               obs.run_bytes[k] != (rank == 0 ? 2 * total : 0) || obs.wait_bytes[k] != 2 * total)) {
    fprintf(stderr, "rank %d: observer heard run %d/%d wait %d/%d other %d, run bytes %llu, wait bytes %llu\n",
            rank, obs.run[0], obs.run[1], obs.wait[0], obs.wait[1], obs.other,
            (unsigned long long)obs.run_bytes[k], (unsigned long long)obs.wait_bytes[k]);
    bad = 1;
  }
  pthread_mutex_unlock(&obs_mu);
  /* count 0: done at once on both sides, nothing reaches the backend (calls stays 6), NULL ok.
   * (After the observer check: a wait on such a call is still reported as a wait.) */
  comm_req_t *z = NULL;
  if (!bad && (comm_send(c, NULL, 0, DT_F32, peer) || comm_recv(c, NULL, 0, DT_BF16, peer) ||
               comm_start_recv(c, NULL, 0, DT_F32, peer, &z) || comm_wait(z, NULL) ||
               check_stats(rank, "after count 0", c, rank == 0 ? 2 * total : 0, rank == 1 ? 2 * total : 0, 6))) {
    fprintf(stderr, "rank %d: count 0: %s\n", rank, comm_errmsg(c));
    bad = 1;
  }
  if (!bad)
    printf("  rank %d: 2 x %zu messages (%llu B) %s exactly; stats and observer agree\n", rank, NMSGS,
           (unsigned long long)total, rank == 0 ? "sent" : "received");
  for (size_t m = 0; m < NMSGS; m++) free(buf[m]);
  comm_destroy(c);
  return bad;
}

static void test_pair(void **state) { assert_int_equal(run_ranks(2, rank_pair, NULL), 0); }

/* ---- 2. one communicator per direction: the pipeline's pattern ---- */

#define EXCHANGE_COUNT ((size_t)2 << 20) /* float32: 8 MiB each way */

/* "fwd" has global rank 0 as group rank 0, "bwd" global rank 1: in each, group rank 0 only sends
 * and group rank 1 only receives. Both ranks start the send first (the order that would deadlock
 * on one communicator), then the receive, and only then wait; three rounds. */
static int rank_two_directions(int rank, int n, store_t *st, void *arg) {
  comm_t *fwd, *bwd;
  if (fixture_comm_open(&fwd, "fwd", rank, 2, st, TIMEOUT_MS) ||
      fixture_comm_open(&bwd, "bwd", 1 - rank, 2, st, TIMEOUT_MS))
    return 1;
  comm_t *out = rank == 0 ? fwd : bwd, *in = rank == 0 ? bwd : fwd;
  float *sbuf = malloc(EXCHANGE_COUNT * sizeof(float)), *rbuf = recv_buffer(EXCHANGE_COUNT, DT_F32);
  int bad = 0;
  double t0 = fixture_now_s();
  for (int round = 0; round < 3 && !bad; round++) {
    pattern(sbuf, EXCHANGE_COUNT * sizeof(float), (uint32_t)(100 + 10 * round + rank));
    comm_req_t *rs, *rr;
    if (comm_start_send(out, sbuf, EXCHANGE_COUNT, DT_F32, 1, &rs) ||
        comm_start_recv(in, rbuf, EXCHANGE_COUNT, DT_F32, 0, &rr)) {
      fprintf(stderr, "rank %d: start: %s / %s\n", rank, comm_errmsg(out), comm_errmsg(in));
      return 1;
    }
    int er = comm_wait(rr, NULL), es = comm_wait(rs, NULL);
    if (er || es) {
      fprintf(stderr, "rank %d: round %d: recv %s: %s; send %s: %s\n", rank, round, comm_strerror(er),
              comm_errmsg(in), comm_strerror(es), comm_errmsg(out));
      bad = 1;
      break;
    }
    char what[64];
    snprintf(what, sizeof what, "round %d, 8 MiB from rank %d", round, 1 - rank);
    bad = check_message(rank, what, rbuf, EXCHANGE_COUNT, DT_F32, (uint32_t)(100 + 10 * round + 1 - rank));
  }
  if (!bad)
    printf("  rank %d: 3 rounds of 8 MiB both ways on two communicators in %.3f s, contents exact\n", rank,
           fixture_now_s() - t0);
  free(sbuf);
  free(rbuf);
  comm_destroy(fwd);
  comm_destroy(bwd);
  return bad;
}

static void test_two_directions(void **state) { assert_int_equal(run_ranks(2, rank_two_directions, NULL), 0); }

/* The same exchange on ONE communicator, with messages too large for the sockets to absorb: each
 * rank's send waits for a receive queued behind the other's send. Documented to deadlock; it must
 * end in the 1 s timeout (ETIMEDOUT on at least one rank; the other may see the first close its
 * links: EREMOTE), both requests of a rank failing alike, well before the alarm. */
static int rank_one_comm_both_ways(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (fixture_comm_open(&c, "both", rank, n, st, 1000)) return 1;
  size_t bytes = fixture_unbufferable_bytes(), count = bytes / sizeof(float);
  float *sbuf = calloc(count, sizeof(float)), *rbuf = calloc(count, sizeof(float));
  comm_req_t *rs, *rr;
  double t0 = fixture_now_s();
  if (comm_start_send(c, sbuf, count, DT_F32, 1 - rank, &rs) ||
      comm_start_recv(c, rbuf, count, DT_F32, 1 - rank, &rr))
    return 1;
  int es = comm_wait(rs, NULL), er = comm_wait(rr, NULL);
  double dt = fixture_now_s() - t0;
  printf("  rank %d: %zu MiB both ways on one comm: send %s, recv %s after %.3f s: %s\n", rank, bytes >> 20,
         comm_strerror(es), comm_strerror(er), dt, comm_errmsg(c));
  int bad = !(es == COMM_ETIMEDOUT || es == COMM_EREMOTE) || er != es || dt > PROMPT_S;
  if (es == COMM_ETIMEDOUT && !strstr(comm_errmsg(c), "send timed out after 1 s waiting for rank "))
    bad = 1;
  /* Each rank publishes whether it timed out; rank 0 wants at least one. */
  char key[16];
  snprintf(key, sizeof key, "timedout/%d", rank);
  if (store_set(st, key, es == COMM_ETIMEDOUT ? "y" : "n", 1)) bad = 1;
  if (rank == 0 && !bad) {
    int timeouts = 0;
    for (int r = 0; r < 2; r++) {
      void *v = NULL;
      size_t len = 0;
      snprintf(key, sizeof key, "timedout/%d", r);
      if (store_get(st, key, &v, &len, TIMEOUT_MS)) return 1;
      timeouts += len == 1 && *(char *)v == 'y';
      free(v);
    }
    if (timeouts == 0) {
      fprintf(stderr, "rank 0: neither rank timed out\n");
      bad = 1;
    }
  }
  if (bad) fprintf(stderr, "rank %d: the documented deadlock did not end in the timeout\n", rank);
  free(sbuf);
  free(rbuf);
  comm_destroy(c);
  return bad;
}

static void test_one_comm_both_ways_times_out(void **state) {
  assert_int_equal(run_ranks(2, rank_one_comm_both_ways, NULL), 0);
}

/* ---- 3. a ring: each rank sends to rank + 1 and receives from rank - 1 ---- */

#define RING_COUNT ((size_t)1 << 20) /* float32: 4 MiB, about what the sockets buffer */

/* Rank 0 sends first, the others receive first: with one call at a time per communicator that
 * order cannot deadlock whatever the message size. Blocking calls, then the same order started. */
static int rank_ring(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (fixture_comm_open(&c, "ring", rank, n, st, TIMEOUT_MS)) return 1;
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  float *sbuf = malloc(RING_COUNT * sizeof(float)), *rbuf = recv_buffer(RING_COUNT, DT_F32);
  uint16_t *s16 = malloc(999 * 2), *r16 = recv_buffer(999, DT_BF16);
  int bad = 0;
  for (int round = 0; round < 2 && !bad; round++) {
    uint32_t salt = (uint32_t)(1000 + 10 * round);
    pattern(sbuf, RING_COUNT * sizeof(float), salt + (uint32_t)rank);
    pattern(s16, 999 * 2, salt + 5 + (uint32_t)rank);
    comm_req_t *req[4] = {NULL};
    int rc = 0;
    if (round == 0 && rank == 0)
      rc = comm_send(c, sbuf, RING_COUNT, DT_F32, right) || comm_send(c, s16, 999, DT_BF16, right) ||
           comm_recv(c, rbuf, RING_COUNT, DT_F32, left) || comm_recv(c, r16, 999, DT_BF16, left);
    else if (round == 0)
      rc = comm_recv(c, rbuf, RING_COUNT, DT_F32, left) || comm_recv(c, r16, 999, DT_BF16, left) ||
           comm_send(c, sbuf, RING_COUNT, DT_F32, right) || comm_send(c, s16, 999, DT_BF16, right);
    else if (rank == 0)
      rc = comm_start_send(c, sbuf, RING_COUNT, DT_F32, right, &req[0]) ||
           comm_start_send(c, s16, 999, DT_BF16, right, &req[1]) ||
           comm_start_recv(c, rbuf, RING_COUNT, DT_F32, left, &req[2]) ||
           comm_start_recv(c, r16, 999, DT_BF16, left, &req[3]);
    else
      rc = comm_start_recv(c, rbuf, RING_COUNT, DT_F32, left, &req[0]) ||
           comm_start_recv(c, r16, 999, DT_BF16, left, &req[1]) ||
           comm_start_send(c, sbuf, RING_COUNT, DT_F32, right, &req[2]) ||
           comm_start_send(c, s16, 999, DT_BF16, right, &req[3]);
    for (int i = 0; i < 4; i++) rc |= comm_wait(req[i], NULL) != 0;
    if (rc) {
      fprintf(stderr, "rank %d: ring round %d: %s\n", rank, round, comm_errmsg(c));
      bad = 1;
      break;
    }
    char what[64];
    snprintf(what, sizeof what, "ring of %d, round %d, from rank %d", n, round, left);
    bad = check_message(rank, what, rbuf, RING_COUNT, DT_F32, salt + (uint32_t)left) ||
          check_message(rank, what, r16, 999, DT_BF16, salt + 5 + (uint32_t)left);
  }
  if (!bad && rank == 0)
    printf("  ring of %d: every rank got rank - 1's messages exactly, blocking and started\n", n);
  free(sbuf);
  free(rbuf);
  free(s16);
  free(r16);
  comm_destroy(c);
  return bad;
}

static void test_ring(void **state) {
  assert_int_equal(run_ranks(3, rank_ring, NULL), 0);
  assert_int_equal(run_ranks(4, rank_ring, NULL), 0);
}

/* ---- 4. refusals ---- */

/* Expects code and a message containing want; prints the message when print is set. */
static int expect(int rank, int print, const char *what, comm_t *c, int rc, int code, const char *want) {
  if (print) printf("  %s: %s: %s\n", what, comm_strerror(rc), comm_errmsg(c));
  if (rc == code && strstr(comm_errmsg(c), want)) return 0;
  fprintf(stderr, "rank %d: %s returned %s with \"%s\"; want %s with \"%s\"\n", rank, what, comm_strerror(rc),
          comm_errmsg(c), comm_strerror(code), want);
  return 1;
}

/* In a group of n >= 3, every argument refusal of every rank, then a ring exchange that shows the
 * communicator is still usable. */
static int rank_refusals(int rank, int n, store_t *st, void *arg) {
  comm_t *c;
  if (fixture_comm_open(&c, "refuse", rank, n, st, TIMEOUT_MS)) return 1;
  const int right = (rank + 1) % n, left = (rank + n - 1) % n, far = (rank + 2) % n;
  float x[8] = {0};
  char want[160];
  int bad = 0;
  const int say = rank == 0; /* one rank prints the messages */
  snprintf(want, sizeof want, "send to rank %d: point-to-point on the cpu comm only between ring neighbours: "
           "send to rank+1 (%d), receive from rank-1 (%d)", far, right, left);
  bad |= expect(rank, say, "send to a non-neighbour", c, comm_send(c, x, 8, DT_F32, far), COMM_EINVAL,
                want);
  snprintf(want, sizeof want, "recv from rank %d: point-to-point on the cpu comm only between ring", right);
  bad |= expect(rank, say, "recv from the right neighbour", c, comm_recv(c, x, 8, DT_F32, right),
                COMM_EINVAL, want);
  snprintf(want, sizeof want, "send to rank %d: point-to-point", left);
  bad |= expect(rank, say, "send to the left neighbour", c, comm_send(c, x, 8, DT_F32, left), COMM_EINVAL,
                want);
  snprintf(want, sizeof want, "send to rank %d: that is this rank", rank);
  bad |= expect(rank, say, "send to itself", c, comm_send(c, x, 8, DT_F32, rank), COMM_EINVAL, want);
  snprintf(want, sizeof want, "recv from rank %d: peer not in a group of size %d", n, n);
  bad |= expect(rank, say, "recv from rank n", c, comm_recv(c, x, 8, DT_F32, n), COMM_EINVAL, want);
  bad |= expect(rank, say, "send to rank -1", c, comm_send(c, x, 8, DT_F32, -1), COMM_EINVAL,
                "send to rank -1: peer not in a group");
  snprintf(want, sizeof want, "send to rank %d: NULL buffer", right);
  bad |= expect(rank, say, "NULL buffer", c, comm_send(c, NULL, 8, DT_F32, right), COMM_EINVAL, want);
  bad |= expect(rank, say, "unknown dtype", c, comm_send(c, x, 8, (dtype_t)7, right), COMM_EINVAL,
                "send: unknown dtype 7");
  /* count 0 does not excuse a wrong peer */
  bad |= expect(rank, say, "count 0 to a non-neighbour", c, comm_send(c, NULL, 0, DT_F32, far),
                COMM_EINVAL, "only between ring neighbours");
  comm_req_t *r = (comm_req_t *)x; /* must come back NULL */
  bad |= expect(rank, say, "started send to a non-neighbour", c, comm_start_send(c, x, 8, DT_F32, far, &r),
                COMM_EINVAL, "only between ring neighbours");
  if (r) {
    fprintf(stderr, "rank %d: a refused start left a request\n", rank);
    bad = 1;
  }
  /* Nothing reached the backend, and the communicator still works: a ring pass, rank 0 first. */
  comm_stats_t s;
  comm_get_stats(c, &s);
  if (s.calls != 0) {
    fprintf(stderr, "rank %d: refusals counted %llu calls\n", rank, (unsigned long long)s.calls);
    bad = 1;
  }
  float y[8] = {0};
  for (int i = 0; i < 8; i++) x[i] = (float)(rank * 10 + i);
  int rc = rank == 0 ? comm_send(c, x, 8, DT_F32, right) || comm_recv(c, y, 8, DT_F32, left)
                     : comm_recv(c, y, 8, DT_F32, left) || comm_send(c, x, 8, DT_F32, right);
  if (rc || y[7] != (float)(left * 10 + 7)) {
    fprintf(stderr, "rank %d: after the refusals: %s, y[7] = %g\n", rank, comm_errmsg(c), y[7]);
    bad = 1;
  }
  comm_destroy(c);
  return bad;
}

static void test_refusals(void **state) {
  assert_int_equal(run_ranks(3, rank_refusals, NULL), 0);
  assert_int_equal(run_ranks(4, rank_refusals, NULL), 0);
}

/* A one-rank group has no valid peer; a backend without point-to-point refuses it. No store. */
static int fake_sends;
static int fake_barrier(comm_t *c) {
  fake_sends++;
  return COMM_OK;
}

static void test_refusals_local(void **state) {
  char err[256] = "";
  comm_config_t cfg = {.name = "alone", .rank = 0, .size = 1};
  comm_t *one = NULL;
  assert_int_equal(comm_create(&one, "cpu", &cfg, err, sizeof err), COMM_OK);
  float x[2] = {1, 2};
  assert_int_equal(expect(0, 1, "send on a group of one", one, comm_send(one, x, 2, DT_F32, 0), COMM_EINVAL,
                          "comm alone (rank 0/1): send to rank 0: that is this rank"), 0);
  assert_int_equal(expect(0, 1, "recv on a group of one", one, comm_recv(one, x, 2, DT_F32, 1), COMM_EINVAL,
                          "recv from rank 1: peer not in a group of size 1"), 0);
  assert_int_equal(comm_send(one, x, 0, DT_F32, 0), COMM_EINVAL); /* count 0 too */
  comm_destroy(one);

  static const comm_ops_t no_p2p = {.name = "fake", .barrier = fake_barrier, .bf16 = 1};
  comm_t c = {.ops = &no_p2p, .name = "fake.0", .rank = 0, .size = 2, .timeout_ms = 1000};
  assert_int_equal(expect(0, 1, "send on a backend without it", &c, comm_send(&c, x, 2, DT_F32, 1),
                          COMM_EINVAL, "send to rank 1: backend fake has no point-to-point"), 0);
  assert_int_equal(comm_barrier(&c), COMM_OK); /* not broken */
  assert_int_equal(fake_sends, 1);
}

/* A receive whose count or dtype differs from the send's, or that meets a collective: COMM_EREMOTE
 * on the receiver naming both sides, and both communicators broken (the sender's next call fails
 * at once: the receiver closed its links). */
typedef struct {
  const char *name;
  size_t send_count, recv_count;
  dtype_t send_dtype, recv_dtype;
  int collective; /* rank 0 broadcasts instead of sending */
  const char *want;
} mismatch_t;

static const mismatch_t k_mismatches[] = {
    {"mm-count", 64, 100, DT_BF16, DT_F32, 0,
     "recv of 100 float32 from rank 0 (127.0.0.1:"},
    {"mm-dtype", 100, 50, DT_BF16, DT_F32, 0, "recv of 50 float32 from rank 0 (127.0.0.1:"},
    {"mm-coll", 64, 64, DT_F32, DT_F32, 1,
     "recv of 64 float32 from rank 0 (127.0.0.1:"},
};
static const char *const k_mismatch_tails[] = {") met a send of 64 bfloat16", ") met a send of 100 bfloat16",
                                               ") met something that is not a send"};

static int rank_mismatch(int rank, int n, store_t *st, void *arg) {
  int bad = 0;
  for (size_t i = 0; i < sizeof k_mismatches / sizeof *k_mismatches && !bad; i++) {
    const mismatch_t *m = &k_mismatches[i];
    comm_t *c;
    if (fixture_comm_open(&c, m->name, rank, n, st, TIMEOUT_MS)) return 1;
    float buf[128] = {0}; /* zeros: a broadcast's bytes are not a header */
    double t0 = fixture_now_s();
    if (rank == 0) {
      /* Its send fits the socket buffers and may well succeed; its next call must fail. */
      if (m->collective) comm_broadcast(c, buf, m->send_count, m->send_dtype, 0);
      else comm_send(c, buf, m->send_count, m->send_dtype, 1);
      int rc = comm_recv(c, buf, 1, DT_F32, 1);
      double dt = fixture_now_s() - t0;
      printf("  %s: sender's next call: %s after %.3f s: %s\n", m->name, comm_strerror(rc), dt, comm_errmsg(c));
      if (rc != COMM_EREMOTE || dt > PROMPT_S) {
        fprintf(stderr, "rank 0: %s: the sender's communicator did not break promptly\n", m->name);
        bad = 1;
      }
    } else {
      int rc = comm_recv(c, buf, m->recv_count, m->recv_dtype, 0);
      char want[160];
      bad |= expect(rank, 1, m->name, c, rc, COMM_EREMOTE, m->want);
      snprintf(want, sizeof want, "%s", k_mismatch_tails[i]);
      if (!strstr(comm_errmsg(c), want)) {
        fprintf(stderr, "rank 1: %s: message lacks \"%s\"\n", m->name, want);
        bad = 1;
      }
      if (comm_send(c, buf, 1, DT_F32, 0) != COMM_EREMOTE) bad = 1; /* broken for good */
    }
    comm_destroy(c);
  }
  return bad;
}

static void test_mismatch(void **state) { assert_int_equal(run_ranks(2, rank_mismatch, NULL), 0); }

/* ---- 5. failures of the peer: exit, abort, stall, fault, and a send to a dead peer ---- */

typedef enum { PEER_EXITS, PEER_ABORTS, PEER_STALLS, PEER_FAULT, SEND_TO_DEAD } failure_t;
static const char *const k_failure_names[] = {"exits", "aborts", "stalls", "fault injected", "send to dead"};

/* Rank 1 has a receive from rank 0 pending (started, key "posted" set) when rank 0 exits, aborts
 * its communicator, or has a fault injected into its send; or rank 0 never sends (stall, 0.5 s
 * timeout). SEND_TO_DEAD: rank 1 exits and rank 0 sends more than the sockets hold. The survivor
 * must fail with the right code within PROMPT_S (or the 0.5 s timeout), naming rank 0 or 1. */
static int rank_failure(int rank, int n, store_t *st, void *arg) {
  failure_t f = *(const failure_t *)arg;
  comm_t *c;
  char name[32];
  snprintf(name, sizeof name, "fail%d", (int)f);
  if (fixture_comm_open(&c, name, rank, n, st, TIMEOUT_MS) || comm_barrier(c)) return 1;
  if (f == PEER_STALLS) comm_set_timeout(c, 500);
  size_t count = f == SEND_TO_DEAD ? fixture_unbufferable_bytes() / sizeof(float) : (size_t)1 << 20;
  float *buf = calloc(count, sizeof(float));
  int bad = 0;
  if (f == SEND_TO_DEAD) {
    if (rank == 1) _exit(0); /* sockets closed by the kernel */
    double t0 = fixture_now_s();
    int rc = comm_send(c, buf, count, DT_F32, 1);
    double dt = fixture_now_s() - t0;
    printf("  %s: rank 0: %s after %.3f s: %s\n", k_failure_names[f], comm_strerror(rc), dt, comm_errmsg(c));
    bad = rc != COMM_EREMOTE || dt > PROMPT_S || !strstr(comm_errmsg(c), "send: connection to rank 1 (127.0.0.1:");
  } else if (rank == 0) {
    if (fixture_await_key(st, "posted", TIMEOUT_MS)) return 1;
    if (f == PEER_EXITS) _exit(0);
    if (f == PEER_ABORTS) {
      comm_abort(c, "test");
      bad = comm_send(c, buf, 1, DT_F32, 1) != COMM_ESYSTEM || !strstr(comm_errmsg(c), "aborted: test");
    }
    if (f == PEER_FAULT) {
      comm_fail_next(c);
      int rc = comm_send(c, buf, count, DT_F32, 1);
      bad = rc != COMM_ESYSTEM || !strstr(comm_errmsg(c), "send: fault injected");
      printf("  %s: rank 0: %s: %s\n", k_failure_names[f], comm_strerror(rc), comm_errmsg(c));
    }
    /* Keep the process (and its descriptors) alive until rank 1 has judged: only the abort or
     * the fault, not the kernel closing sockets at exit, may have told it. */
    if (fixture_await_key(st, "judged", TIMEOUT_MS)) bad = 1;
  } else {
    comm_req_t *r;
    if (comm_start_recv(c, buf, count, DT_F32, 0, &r)) return 1;
    double t0 = fixture_now_s();
    store_set(st, "posted", "1", 1);
    int rc = comm_wait(r, NULL);
    double dt = fixture_now_s() - t0;
    const char *msg = comm_errmsg(c);
    printf("  %s: rank 1: %s after %.3f s: %s\n", k_failure_names[f], comm_strerror(rc), dt, msg);
    if (f == PEER_STALLS)
      bad = rc != COMM_ETIMEDOUT || dt < 0.45 || dt > PROMPT_S ||
            !strstr(msg, "recv timed out after 0.5 s waiting for rank 0 (127.0.0.1:");
    else
      bad = rc != COMM_EREMOTE || dt > PROMPT_S || !strstr(msg, "recv: connection from rank 0 (127.0.0.1:");
    if (comm_recv(c, buf, count, DT_F32, 0) != rc) bad = 1; /* broken, with the first code */
    store_set(st, "judged", "1", 1);
  }
  if (bad) fprintf(stderr, "rank %d: %s: unexpected failure report\n", rank, k_failure_names[f]);
  free(buf);
  comm_destroy(c);
  return bad;
}

static void test_peer_failures(void **state) {
  static const failure_t all[] = {PEER_EXITS, PEER_ABORTS, PEER_STALLS, PEER_FAULT, SEND_TO_DEAD};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    assert_int_equal(run_ranks(2, rank_failure, (void *)&all[i]), 0);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pair),
      cmocka_unit_test(test_two_directions),
      cmocka_unit_test(test_one_comm_both_ways_times_out),
      cmocka_unit_test(test_ring),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_refusals_local),
      cmocka_unit_test(test_mismatch),
      cmocka_unit_test(test_peer_failures),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
