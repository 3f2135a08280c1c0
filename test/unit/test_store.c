// deps: common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c
/* test_store: the store server on its own libuv loop (a thread), driven by the blocking client
 * and by raw sockets that speak (or abuse) the wire format.
 *
 * Every test starts a fresh server on 127.0.0.1 port 0, hosted by job "jobA" (open unless the
 * test gives it a secret). Parking and limits are observed through the server's counters,
 * read on the loop thread via uv_async, never by sleeping. Abuse tests check both sides: the
 * abusive socket sees the connection closed, and a fresh client is served correctly
 * afterwards. Raw sockets that should get past the handshake say HELLO first (raw_session). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "common/net.h"
#include "common/store.h"
#include "common/store_proto.h"
#include "launcher/store_server.h"

#define WAIT_MS 5000 /* upper bound for anything that should happen "soon" */

#define JOB_A "jobA"
#define SECRET_A "correct horse battery staple"

typedef struct {
  char host[64];
  char run_id[64], secret[64]; /* the hosting job, and the auth client() uses */
  store_server_opts_t opts;
  uv_loop_t loop;
  uv_async_t async;
  store_server_t *srv;
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int port, started, start_rc;
  char start_err[256];
  int stop, query, answered;
  int pause, paused; /* fixture_pause: the loop thread is held in on_async */
  size_t nclients, nkeys, nwaiters, nforeign, inflight;
} fixture_t;

static void on_async(uv_async_t *a) {
  fixture_t *f = a->data;
  pthread_mutex_lock(&f->mu);
  if (f->query) {
    f->nclients = store_server_num_clients(f->srv);
    f->nkeys = store_server_num_keys(f->srv);
    f->nwaiters = store_server_num_waiters(f->srv);
    f->nforeign = store_server_num_foreign(f->srv);
    f->inflight = store_server_inflight_bytes(f->srv);
    f->query = 0;
    f->answered = 1;
    pthread_cond_broadcast(&f->cv);
  }
  if (f->pause) {
    f->paused = 1;
    pthread_cond_broadcast(&f->cv);
    while (f->pause) pthread_cond_wait(&f->cv, &f->mu);
    f->paused = 0;
  }
  if (f->stop) {
    store_server_close(f->srv);
    f->srv = NULL;
    uv_close((uv_handle_t *)&f->async, NULL);
  }
  pthread_mutex_unlock(&f->mu);
}

static void *server_thread(void *arg) {
  fixture_t *f = arg;
  uv_loop_init(&f->loop);
  f->async.data = f;
  uv_async_init(&f->loop, &f->async, on_async);
  int rc = store_server_start(&f->srv, &f->loop, f->host, 0, &f->opts, &f->port, f->start_err, sizeof f->start_err);
  pthread_mutex_lock(&f->mu);
  f->start_rc = rc;
  f->started = 1;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  if (rc) uv_close((uv_handle_t *)&f->async, NULL);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  uv_loop_close(&f->loop);
  return NULL;
}

/* Starts a server hosted by JOB_A with the limits of opts (NULL: defaults; its run_id and
 * secret are ignored) and secret (NULL: an open store). */
static fixture_t *fixture_start_opts(const char *host, const store_server_opts_t *opts, const char *secret) {
  fixture_t *f = calloc(1, sizeof *f);
  snprintf(f->host, sizeof f->host, "%s", host);
  snprintf(f->run_id, sizeof f->run_id, "%s", JOB_A);
  snprintf(f->secret, sizeof f->secret, "%s", secret ? secret : "");
  if (opts) f->opts = *opts;
  f->opts.run_id = f->run_id;
  f->opts.secret = f->secret;
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  pthread_create(&f->th, NULL, server_thread, f);
  pthread_mutex_lock(&f->mu);
  while (!f->started) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
  return f;
}

static fixture_t *fixture_start(const char *host) { return fixture_start_opts(host, NULL, NULL); }

static void fixture_stop(fixture_t *f) {
  if (!f) return;
  pthread_mutex_lock(&f->mu);
  f->stop = 1;
  pthread_mutex_unlock(&f->mu);
  if (f->start_rc == 0) uv_async_send(&f->async);
  pthread_join(f->th, NULL);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
}

/* Reads the server's counters on its loop thread. A loop that does not answer within WAIT_MS
 * (spinning, say) fails the test instead of hanging it. */
static void fixture_query(fixture_t *f) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += WAIT_MS / 1000;
  pthread_mutex_lock(&f->mu);
  f->query = 1;
  f->answered = 0;
  uv_async_send(&f->async);
  int rc = 0;
  while (!f->answered && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&f->cv, &f->mu, &until);
  int answered = f->answered;
  pthread_mutex_unlock(&f->mu);
  if (!answered) print_message("the server's loop did not answer within %d ms\n", WAIT_MS);
  assert_true(answered);
}

/* Holds the server's loop (as a busy host's would be) until fixture_resume: connections made
 * meanwhile wait in the listen backlog, with whatever their clients sent. */
static void fixture_pause(fixture_t *f) {
  pthread_mutex_lock(&f->mu);
  f->pause = 1;
  uv_async_send(&f->async);
  while (!f->paused) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
}

static void fixture_resume(fixture_t *f) {
  pthread_mutex_lock(&f->mu);
  f->pause = 0;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Polls the counters until the server has exactly n parked requests and m clients (m < 0:
 * any), or WAIT_MS passes. Returns 1 when reached. */
static int wait_counts(fixture_t *f, size_t n, long m) {
  int64_t end = now_ms() + WAIT_MS;
  for (;;) {
    fixture_query(f);
    if (f->nwaiters == n && (m < 0 || f->nclients == (size_t)m)) return 1;
    if (now_ms() > end) {
      print_message("counters: waiters %zu (want %zu), clients %zu (want %ld)\n", f->nwaiters, n, f->nclients, m);
      return 0;
    }
    sched_yield();
  }
}

static int setup(void **state) {
  fixture_t *f = fixture_start("127.0.0.1");
  if (f->start_rc) {
    print_message("server start: %s\n", f->start_err);
    return -1;
  }
  *state = f;
  return 0;
}

static int setup_secret(void **state) {
  fixture_t *f = fixture_start_opts("127.0.0.1", NULL, SECRET_A);
  if (f->start_rc) {
    print_message("server start: %s\n", f->start_err);
    return -1;
  }
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture_stop(*state);
  return 0;
}

/* Connects as job run_id with secret (NULL: none); returns the code, the client in *s and the
 * message in err. */
static int connect_as(fixture_t *f, const char *run_id, const char *secret, store_t **s, char *err, size_t errlen) {
  store_auth_t auth = {.run_id = run_id, .secret = secret};
  *s = NULL;
  int rc = store_connect(s, f->host, f->port, &auth, WAIT_MS, err, errlen);
  print_message("connect as '%s' %s a secret: %s%s%s\n", run_id, secret ? "with" : "without", store_strerror(rc),
                rc ? ": " : "", rc ? err : "");
  return rc;
}

/* A client of the hosting job (with the store's secret, if any). */
static store_t *client(fixture_t *f) {
  store_t *s = NULL;
  char err[512];
  store_auth_t auth = {.run_id = f->run_id, .secret = f->secret};
  int rc = store_connect(&s, f->host, f->port, &auth, WAIT_MS, err, sizeof err);
  if (rc) print_message("store_connect: %s\n", err);
  assert_int_equal(rc, STORE_OK);
  return s;
}

/* ---- raw sockets --------------------------------------------------------------------- */

static int raw_connect(fixture_t *f) {
  char err[256];
  int fd = net_connect(f->host, f->port, WAIT_MS, err, sizeof err);
  assert_true(fd >= 0);
  return fd;
}

static void raw_send(int fd, store_proto_writer_t *w) {
  assert_int_equal(store_proto_finish(w), 0);
  assert_int_equal(net_send_all(fd, w->buf, w->len), 0);
}

/* Sends HELLO as run_id with an all-zero nonce (fine for tests). */
static void raw_send_hello(int fd, const char *run_id) {
  store_proto_writer_t w = {0};
  uint8_t nonce[STORE_PROTO_NONCE] = {0};
  store_proto_begin(&w, STORE_OP_HELLO);
  store_proto_put_bytes(&w, STORE_PROTO_BANNER, strlen(STORE_PROTO_BANNER));
  store_proto_put_bytes(&w, run_id, strlen(run_id));
  store_proto_put_bytes(&w, nonce, sizeof nonce);
  raw_send(fd, &w);
  store_proto_writer_free(&w);
}

/* Reads one reply frame; returns its op and a malloc'ed payload. */
static int raw_reply(int fd, uint8_t **payload, size_t *plen) {
  uint8_t hdr[STORE_PROTO_HEADER];
  assert_int_equal(net_recv_all(fd, hdr, sizeof hdr, WAIT_MS), 0);
  uint32_t flen;
  int op;
  char why[160];
  assert_int_equal(store_proto_parse_header(hdr, 0, &flen, &op, why, sizeof why), 0);
  *plen = flen - STORE_PROTO_HEADER;
  *payload = malloc(*plen + 1);
  assert_int_equal(net_recv_all(fd, *payload, *plen, WAIT_MS), 0);
  return op;
}

/* HELLO as run_id and its reply; returns whether the store said it requires a secret. */
static int raw_hello(int fd, const char *run_id) {
  raw_send_hello(fd, run_id);
  uint8_t *p;
  size_t n;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_HELLO);
  store_proto_reader_t r;
  store_proto_reader_init(&r, p, n);
  size_t bn, jn, nn;
  store_proto_get_bytes(&r, &bn);
  store_proto_get_bytes(&r, &jn);
  int req = store_proto_get_u8(&r);
  store_proto_get_bytes(&r, &nn);
  assert_true(store_proto_reader_done(&r));
  assert_int_equal(nn, STORE_PROTO_NONCE);
  free(p);
  return req;
}

/* A raw connection past the handshake of an open store, as the hosting job. */
static int raw_session(fixture_t *f) {
  int fd = raw_connect(f);
  assert_int_equal(raw_hello(fd, f->run_id), 0);
  return fd;
}

/* Expects an ERROR reply with code. */
static void expect_error(int fd, int code) {
  uint8_t *p;
  size_t n;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_ERROR);
  store_proto_reader_t r;
  store_proto_reader_init(&r, p, n);
  int64_t got = store_proto_get_i64(&r);
  size_t mn;
  const uint8_t *m = store_proto_get_bytes(&r, &mn);
  print_message("ERROR %lld: %.*s\n", (long long)got, (int)mn, (const char *)m);
  assert_int_equal(got, code);
  free(p);
}

/* The server must close this connection soon: EOF or reset, not silence. */
static void expect_closed(int fd) {
  uint8_t b[4096];
  int64_t end = now_ms() + WAIT_MS;
  for (;;) {
    int rc = net_recv_all(fd, b, 1, (int)(end - now_ms() > 0 ? end - now_ms() : 0));
    if (rc == 0) continue; /* drain anything sent before the close */
    assert_int_equal(rc, -ECONNRESET);
    return;
  }
}

/* The server refuses this connection: an ERROR with code, then EOF. Closes fd. */
static void expect_refused(int fd, int code) {
  expect_error(fd, code);
  expect_closed(fd);
  close(fd);
}

/* Sends SET key before the handshake is done: refused with code, and nothing stored. */
static void expect_set_refused(fixture_t *f, int fd, const char *key, int code) {
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_SET);
  store_proto_put_bytes(&w, key, strlen(key));
  store_proto_put_bytes(&w, "x", 1);
  raw_send(fd, &w);
  store_proto_writer_free(&w);
  expect_refused(fd, code);
  fixture_query(f);
  assert_int_equal(f->nkeys, 0);
}

/* A fresh client gets correct service. */
static void expect_healthy(fixture_t *f) {
  store_t *s = client(f);
  char key[64];
  snprintf(key, sizeof key, "health-%lld", (long long)now_ms());
  assert_int_equal(store_set(s, key, "ok", 2), STORE_OK);
  void *v;
  size_t n;
  assert_int_equal(store_get(s, key, &v, &n, 1000), STORE_OK);
  assert_int_equal(n, 2);
  assert_memory_equal(v, "ok", 2);
  free(v);
  store_close(s);
}

/* ---- operations ---------------------------------------------------------------------- */

static void test_set_get(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  assert_int_equal(store_set(s, "a", "hello", 5), STORE_OK);
  void *v;
  size_t n;
  assert_int_equal(store_get(s, "a", &v, &n, 1000), STORE_OK);
  assert_int_equal(n, 5);
  assert_string_equal(v, "hello"); /* NUL appended past len */
  free(v);
  assert_int_equal(store_set(s, "a", "", 0), STORE_OK);
  assert_int_equal(store_get_nowait(s, "a", &v, &n), STORE_OK);
  assert_int_equal(n, 0);
  free(v);
  assert_int_equal(store_get_nowait(s, "absent", &v, &n), STORE_ENOKEY);
  assert_null(v);
  assert_int_equal(store_set(s, "b", "\0\1\2", 3), STORE_OK);
  assert_int_equal(store_get(s, "b", &v, &n, 0), STORE_OK);
  assert_memory_equal(v, "\0\1\2", 3);
  free(v);
  int64_t nk;
  assert_int_equal(store_num_keys(s, &nk), STORE_OK);
  assert_int_equal(nk, 2);
  assert_int_equal(store_set(s, "", "x", 1), STORE_EINVAL);
  store_close(s);
}

static void test_add(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  int64_t r;
  assert_int_equal(store_add(s, "ctr", 5, &r), STORE_OK);
  assert_int_equal(r, 5);
  assert_int_equal(store_add(s, "ctr", -7, &r), STORE_OK);
  assert_int_equal(r, -2);
  void *v;
  size_t n;
  assert_int_equal(store_get_nowait(s, "ctr", &v, &n), STORE_OK);
  assert_string_equal(v, "-2"); /* stored as decimal text */
  free(v);
  assert_int_equal(store_set(s, "txt", "abc", 3), STORE_OK);
  assert_int_equal(store_add(s, "txt", 1, &r), STORE_EINVAL);
  assert_non_null(strstr(store_errmsg(s), "not a decimal integer"));
  assert_int_equal(store_set(s, "big", "9223372036854775807", 19), STORE_OK);
  assert_int_equal(store_add(s, "big", 1, &r), STORE_EINVAL);
  assert_non_null(strstr(store_errmsg(s), "overflows"));
  /* An error reply leaves the connection usable. */
  assert_int_equal(store_add(s, "ctr", 2, &r), STORE_OK);
  assert_int_equal(r, 0);
  store_close(s);
}

static void test_compare_set(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  void *v;
  size_t n;
  /* Absent key, expecting absent: swaps. */
  assert_int_equal(store_compare_set(s, "k", NULL, 0, "one", 3, &v, &n), STORE_OK);
  assert_int_equal(n, 3);
  assert_memory_equal(v, "one", 3);
  free(v);
  /* Mismatch: unchanged, returns the current value. */
  assert_int_equal(store_compare_set(s, "k", "zzz", 3, "two", 3, &v, &n), STORE_OK);
  assert_memory_equal(v, "one", 3);
  free(v);
  /* Expecting absent on a present key: unchanged. */
  assert_int_equal(store_compare_set(s, "k", NULL, 0, "two", 3, &v, &n), STORE_OK);
  assert_memory_equal(v, "one", 3);
  free(v);
  /* Match: swaps. */
  assert_int_equal(store_compare_set(s, "k", "one", 3, "two!", 4, &v, &n), STORE_OK);
  assert_int_equal(n, 4);
  assert_memory_equal(v, "two!", 4);
  free(v);
  assert_int_equal(store_get_nowait(s, "k", &v, &n), STORE_OK);
  assert_memory_equal(v, "two!", 4);
  free(v);
  /* Absent key with a value expected: nothing set, nothing returned. */
  assert_int_equal(store_compare_set(s, "nokey", "x", 1, "y", 1, &v, &n), STORE_OK);
  assert_null(v);
  assert_int_equal(n, 0);
  assert_int_equal(store_get_nowait(s, "nokey", &v, &n), STORE_ENOKEY);
  /* Empty expected value is a value, not absence. */
  assert_int_equal(store_set(s, "e", "", 0), STORE_OK);
  assert_int_equal(store_compare_set(s, "e", "", 0, "full", 4, &v, &n), STORE_OK);
  assert_memory_equal(v, "full", 4);
  free(v);
  store_close(s);
}

static void test_check_wait_delete(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  const char *keys[] = {"x", "y"};
  int exist = -1, deleted = -1;
  assert_int_equal(store_check(s, keys, 2, &exist), STORE_OK);
  assert_int_equal(exist, 0);
  assert_int_equal(store_set(s, "x", "1", 1), STORE_OK);
  assert_int_equal(store_check(s, keys, 2, &exist), STORE_OK);
  assert_int_equal(exist, 0);
  assert_int_equal(store_set(s, "y", "2", 1), STORE_OK);
  assert_int_equal(store_check(s, keys, 2, &exist), STORE_OK);
  assert_int_equal(exist, 1);
  assert_int_equal(store_wait(s, keys, 2, 1000), STORE_OK);
  assert_int_equal(store_wait(s, keys, 0, 0), STORE_OK);
  assert_int_equal(store_delete(s, "x", &deleted), STORE_OK);
  assert_int_equal(deleted, 1);
  assert_int_equal(store_delete(s, "x", &deleted), STORE_OK);
  assert_int_equal(deleted, 0);
  assert_int_equal(store_check(s, keys, 2, &exist), STORE_OK);
  assert_int_equal(exist, 0);
  int64_t nk;
  assert_int_equal(store_num_keys(s, &nk), STORE_OK);
  assert_int_equal(nk, 1);
  store_close(s);
}

static void test_multi(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  const char *keys[] = {"m0", "m1", "m2"};
  const void *vals[] = {"zero", "", "two"};
  size_t lens[] = {4, 0, 3};
  assert_int_equal(store_multi_set(s, keys, vals, lens, 3), STORE_OK);
  void *out[3];
  size_t olen[3];
  assert_int_equal(store_multi_get(s, keys, 3, out, olen, 1000), STORE_OK);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(olen[i], lens[i]);
    assert_memory_equal(out[i], vals[i], lens[i]);
    free(out[i]);
  }
  const char *some_missing[] = {"m0", "missing"};
  int64_t t0 = now_ms();
  assert_int_equal(store_multi_get(s, some_missing, 2, out, olen, 50), STORE_ETIMEDOUT);
  assert_true(now_ms() - t0 >= 45);
  assert_null(out[0]);
  /* A multi_set with one bad key sets nothing. */
  char longkey[STORE_MAX_KEY + 2];
  memset(longkey, 'k', sizeof longkey - 1);
  longkey[sizeof longkey - 1] = 0;
  const char *bad[] = {"fresh", longkey};
  assert_int_equal(store_multi_set(s, bad, vals, lens, 2), STORE_ETOOBIG);
  int exist;
  assert_int_equal(store_check(s, bad, 1, &exist), STORE_OK);
  assert_int_equal(exist, 0);
  store_close(s);
}

static void test_wait_timeout(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  void *v;
  size_t n;
  int64_t t0 = now_ms();
  assert_int_equal(store_get(s, "never", &v, &n, 100), STORE_ETIMEDOUT);
  int64_t dt = now_ms() - t0;
  print_message("get timeout 100 ms took %lld ms (want 95..3000)\n", (long long)dt);
  assert_true(dt >= 95 && dt < 3000);
  assert_non_null(strstr(store_errmsg(s), "never"));
  const char *keys[] = {"never"};
  assert_int_equal(store_wait(s, keys, 1, 0), STORE_ETIMEDOUT);
  assert_int_equal(store_wait(s, keys, 1, 30), STORE_ETIMEDOUT);
  /* The connection is in step after timeouts. */
  assert_int_equal(store_set(s, "never", "now", 3), STORE_OK);
  assert_int_equal(store_wait(s, keys, 1, 30), STORE_OK);
  assert_true(wait_counts(f, 0, 1));
  store_close(s);
}

typedef struct {
  fixture_t *f;
  int op; /* 0 get, 1 wait, 2 multi_get */
  int timeout_ms;
  int rc;
  void *val;
  size_t len;
  void *vals[2];
  size_t lens[2];
} waiter_arg_t;

static void *waiter_thread(void *p) {
  waiter_arg_t *a = p;
  store_t *s = NULL;
  char err[256];
  store_auth_t auth = {.run_id = a->f->run_id};
  a->rc = store_connect(&s, a->f->host, a->f->port, &auth, WAIT_MS, err, sizeof err);
  if (a->rc) return NULL;
  const char *keys[] = {"late1", "late2"};
  if (a->op == 0) a->rc = store_get(s, "late1", &a->val, &a->len, a->timeout_ms);
  else if (a->op == 1) a->rc = store_wait(s, keys, 2, a->timeout_ms);
  else a->rc = store_multi_get(s, keys, 2, a->vals, a->lens, a->timeout_ms);
  store_close(s);
  return NULL;
}

static void later_set(void **state, int op) {
  fixture_t *f = *state;
  waiter_arg_t a = {.f = f, .op = op, .timeout_ms = 10000, .rc = 99};
  pthread_t th;
  pthread_create(&th, NULL, waiter_thread, &a);
  assert_true(wait_counts(f, 1, -1));
  store_t *s = client(f);
  assert_int_equal(store_set(s, "late1", "L1", 2), STORE_OK);
  if (op != 0) {
    /* One of two keys is not enough. */
    fixture_query(f);
    assert_int_equal(f->nwaiters, 1);
    assert_int_equal(store_set(s, "unrelated", "u", 1), STORE_OK);
    fixture_query(f);
    assert_int_equal(f->nwaiters, 1);
    assert_int_equal(store_set(s, "late2", "L2", 2), STORE_OK);
  }
  pthread_join(th, NULL);
  assert_int_equal(a.rc, STORE_OK);
  if (op == 0) {
    assert_int_equal(a.len, 2);
    assert_memory_equal(a.val, "L1", 2);
    free(a.val);
  } else if (op == 2) {
    assert_memory_equal(a.vals[0], "L1", 2);
    assert_memory_equal(a.vals[1], "L2", 2);
    free(a.vals[0]);
    free(a.vals[1]);
  }
  assert_true(wait_counts(f, 0, -1));
  store_close(s);
}

static void test_get_satisfied_later(void **state) { later_set(state, 0); }
static void test_wait_satisfied_later(void **state) { later_set(state, 1); }
static void test_multi_get_satisfied_later(void **state) { later_set(state, 2); }

static void test_add_wakes_waiter(void **state) {
  fixture_t *f = *state;
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_GET);
  store_proto_put_bytes(&w, "late1", 5);
  store_proto_put_i64(&w, -1);
  raw_send(fd, &w);
  assert_true(wait_counts(f, 1, 1));
  store_t *s = client(f);
  int64_t r;
  assert_int_equal(store_add(s, "late1", 42, &r), STORE_OK);
  uint8_t *p;
  size_t n;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_VALUE);
  assert_int_equal(n, 4 + 2);
  assert_memory_equal(p + 4, "42", 2);
  free(p);
  store_proto_writer_free(&w);
  close(fd);
  store_close(s);
}

static void test_big_values(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  /* The largest value a SET frame can carry for key "big": header, key field, value field. */
  size_t max = STORE_MAX_FRAME - STORE_PROTO_HEADER - (4 + 3) - 4;
  uint8_t *big = malloc(max + 1);
  for (size_t i = 0; i <= max; i++) big[i] = (uint8_t)(i * 131 + 7);
  assert_int_equal(store_set(s, "big", big, max + 1), STORE_ETOOBIG);
  assert_non_null(strstr(store_errmsg(s), "frame limit"));
  assert_int_equal(store_set(s, "big", big, max), STORE_OK);
  void *v;
  size_t n;
  assert_int_equal(store_get(s, "big", &v, &n, 1000), STORE_OK);
  assert_int_equal(n, max);
  assert_memory_equal(v, big, max);
  free(v);
  free(big);
  expect_healthy(f);
  store_close(s);
}

static void test_key_limits(void **state) {
  fixture_t *f = *state;
  store_t *s = client(f);
  char key[STORE_MAX_KEY + 2];
  memset(key, 'q', sizeof key);
  key[STORE_MAX_KEY] = 0;
  assert_int_equal(store_set(s, key, "v", 1), STORE_OK);
  key[STORE_MAX_KEY] = 'q';
  key[STORE_MAX_KEY + 1] = 0;
  void *v;
  size_t n;
  assert_int_equal(store_set(s, key, "v", 1), STORE_ETOOBIG);
  assert_int_equal(store_get(s, key, &v, &n, 0), STORE_ETOOBIG);
  /* The server checks too: a hand-made frame with a 2000-byte key gets an error reply. */
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  char huge[2000];
  memset(huge, 'h', sizeof huge);
  store_proto_begin(&w, STORE_OP_SET);
  store_proto_put_bytes(&w, huge, sizeof huge);
  store_proto_put_bytes(&w, "v", 1);
  raw_send(fd, &w);
  uint8_t *p;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_ERROR);
  store_proto_reader_t r;
  store_proto_reader_init(&r, p, n);
  assert_int_equal(store_proto_get_i64(&r), STORE_ETOOBIG);
  free(p);
  store_proto_writer_free(&w);
  close(fd);
  store_close(s);
}

/* ---- abuse --------------------------------------------------------------------------- */

static void test_garbage(void **state) {
  fixture_t *f = *state;
  int fd = raw_connect(f);
  uint8_t junk[4096];
  uint32_t x = 12345;
  for (size_t i = 0; i < sizeof junk; i++) {
    x = x * 1103515245u + 12345u;
    junk[i] = (uint8_t)(x >> 16);
  }
  junk[4] = 0xee; /* never our magic, whatever the length field says */
  assert_int_equal(net_send_all(fd, junk, sizeof junk), 0);
  expect_closed(fd);
  close(fd);
  expect_healthy(f);
  assert_true(wait_counts(f, 0, 0));
}

static void test_truncated_then_close(void **state) {
  fixture_t *f = *state;
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_SET);
  store_proto_put_bytes(&w, "trunc", 5);
  store_proto_put_bytes(&w, "value", 5);
  assert_int_equal(store_proto_finish(&w), 0);
  assert_int_equal(net_send_all(fd, w.buf, w.len - 3), 0);
  close(fd);
  assert_true(wait_counts(f, 0, 0));
  expect_healthy(f);
  store_t *s = client(f);
  int exist;
  const char *k[] = {"trunc"};
  assert_int_equal(store_check(s, k, 1, &exist), STORE_OK);
  assert_int_equal(exist, 0);
  store_close(s);
  store_proto_writer_free(&w);
}

static void send_header(int fd, uint32_t len, int magic, int version, int op) {
  uint8_t h[8] = {(uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len,
                  (uint8_t)magic, (uint8_t)version, (uint8_t)op, 0};
  assert_int_equal(net_send_all(fd, h, sizeof h), 0);
}

static void test_oversize_frame(void **state) {
  fixture_t *f = *state;
  int fd = raw_connect(f);
  /* Only the header: the server must not wait for (or buffer) the announced 1 GiB. */
  send_header(fd, 1u << 30, STORE_PROTO_MAGIC, STORE_PROTO_VERSION, STORE_OP_SET);
  expect_closed(fd);
  close(fd);
  fd = raw_connect(f);
  send_header(fd, STORE_MAX_FRAME + 1, STORE_PROTO_MAGIC, STORE_PROTO_VERSION, STORE_OP_SET);
  expect_closed(fd);
  close(fd);
  fd = raw_connect(f);
  send_header(fd, 3, STORE_PROTO_MAGIC, STORE_PROTO_VERSION, STORE_OP_SET); /* shorter than a header */
  expect_closed(fd);
  close(fd);
  expect_healthy(f);
}

static void test_wrong_version_and_op(void **state) {
  fixture_t *f = *state;
  int fd = raw_connect(f);
  send_header(fd, 8, STORE_PROTO_MAGIC, STORE_PROTO_VERSION + 1, STORE_OP_NUM_KEYS);
  expect_closed(fd);
  close(fd);
  fd = raw_connect(f);
  send_header(fd, 8, STORE_PROTO_MAGIC, STORE_PROTO_VERSION, 0x7f);
  expect_closed(fd);
  close(fd);
  fd = raw_connect(f);
  send_header(fd, 8, STORE_PROTO_MAGIC, STORE_PROTO_VERSION, STORE_REP_OK); /* a reply is no request */
  expect_closed(fd);
  close(fd);
  expect_healthy(f);
}

static void test_malformed_payload(void **state) {
  fixture_t *f = *state;
  /* A SET whose key field claims more bytes than the frame holds. */
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_SET);
  store_proto_put_u32(&w, 1000);
  store_proto_put_bytes(&w, "v", 1);
  raw_send(fd, &w);
  expect_closed(fd);
  close(fd);
  /* Trailing bytes after the last field. */
  fd = raw_session(f);
  store_proto_begin(&w, STORE_OP_NUM_KEYS);
  store_proto_put_u8(&w, 1);
  raw_send(fd, &w);
  expect_closed(fd);
  close(fd);
  /* A key count the payload cannot hold. */
  fd = raw_session(f);
  store_proto_begin(&w, STORE_OP_CHECK);
  store_proto_put_u32(&w, 0xffffffffu);
  raw_send(fd, &w);
  expect_closed(fd);
  close(fd);
  store_proto_writer_free(&w);
  expect_healthy(f);
}

static void test_slow_client_does_not_stall(void **state) {
  fixture_t *f = *state;
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_SET);
  store_proto_put_bytes(&w, "slow", 4);
  store_proto_put_bytes(&w, "poke", 4);
  assert_int_equal(store_proto_finish(&w), 0);
  assert_int_equal(net_send_all(fd, w.buf, 5), 0); /* half a header, then idle */
  expect_healthy(f);
  assert_int_equal(net_send_all(fd, w.buf + 5, w.len - 5), 0);
  uint8_t *p;
  size_t n;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_OK);
  free(p);
  store_proto_writer_free(&w);
  close(fd);
}

static void test_disconnect_while_parked(void **state) {
  fixture_t *f = *state;
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_MULTI_GET);
  store_proto_put_i64(&w, -1);
  store_proto_put_u32(&w, 1);
  store_proto_put_bytes(&w, "gone", 4);
  raw_send(fd, &w);
  assert_true(wait_counts(f, 1, 1));
  close(fd);
  assert_true(wait_counts(f, 0, 0));
  store_t *s = client(f);
  assert_int_equal(store_set(s, "gone", "x", 1), STORE_OK); /* would touch a freed waiter */
  store_close(s);
  store_proto_writer_free(&w);
  expect_healthy(f);
}

static void test_many_waiters(void **state) {
  fixture_t *f = *state;
  enum { N = 300 };
  int fds[N];
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_GET);
  store_proto_put_bytes(&w, "go", 2);
  store_proto_put_i64(&w, 20000);
  assert_int_equal(store_proto_finish(&w), 0);
  for (int i = 0; i < N; i++) {
    fds[i] = raw_session(f);
    assert_int_equal(net_send_all(fds[i], w.buf, w.len), 0);
  }
  assert_true(wait_counts(f, N, N));
  store_t *s = client(f);
  assert_int_equal(store_set(s, "go", "now", 3), STORE_OK);
  for (int i = 0; i < N; i++) {
    uint8_t *p;
    size_t n;
    assert_int_equal(raw_reply(fds[i], &p, &n), STORE_REP_VALUE);
    assert_int_equal(n, 4 + 3);
    assert_memory_equal(p + 4, "now", 3);
    free(p);
    close(fds[i]);
  }
  assert_true(wait_counts(f, 0, 1));
  store_close(s);
  store_proto_writer_free(&w);
}

/* Waiters are filed under the first key they miss, and move on as keys appear. One multi_get
 * over keys k0..k7, with keys set out of order, a key it saw deleted behind it, and the last
 * key deleted and set again: answered exactly when all eight exist, with the values current
 * then. Waiters on other keys are not disturbed, and a CAS, an ADD and a multi_set wake the
 * waiters of the keys they write. */
static void test_waiters_follow_keys(void **state) {
  fixture_t *f = *state;
  enum { K = 8 };
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_MULTI_GET);
  store_proto_put_i64(&w, 20000);
  store_proto_put_u32(&w, K);
  for (int i = 0; i < K; i++) {
    char k[8];
    snprintf(k, sizeof k, "k%d", i);
    store_proto_put_bytes(&w, k, strlen(k));
  }
  raw_send(fd, &w);
  int other = raw_session(f); /* waits for a key nobody writes */
  store_proto_begin(&w, STORE_OP_GET);
  store_proto_put_bytes(&w, "nobody", 6);
  store_proto_put_i64(&w, 20000);
  raw_send(other, &w);
  assert_true(wait_counts(f, 2, 2));
  store_t *s = client(f);
  void *act;
  size_t alen;
  int64_t r;
  assert_int_equal(store_set(s, "k5", "5", 1), STORE_OK);                                /* filed under k0 */
  assert_int_equal(store_compare_set(s, "k0", NULL, 0, "0", 1, &act, &alen), STORE_OK); /* moves to k1 */
  free(act);
  assert_int_equal(store_add(s, "k1", 1, &r), STORE_OK);                                /* to k2 */
  const char *mk[] = {"k2", "k3", "k4"};
  const void *mv[] = {"2", "3", "4"};
  size_t ml[] = {1, 1, 1};
  assert_int_equal(store_multi_set(s, mk, mv, ml, 3), STORE_OK); /* to k6 (k5 is there) */
  int deleted;
  assert_int_equal(store_delete(s, "k5", &deleted), STORE_OK); /* behind it now */
  assert_int_equal(deleted, 1);
  assert_int_equal(store_set(s, "k6", "6", 1), STORE_OK);
  assert_int_equal(store_set(s, "k7", "7", 1), STORE_OK); /* all but k5: around to k5 */
  assert_true(wait_counts(f, 2, 3));
  assert_int_equal(store_set(s, "k5", "five", 4), STORE_OK);
  uint8_t *p;
  size_t n;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_VALUES);
  store_proto_reader_t rd;
  store_proto_reader_init(&rd, p, n);
  assert_int_equal(store_proto_get_u32(&rd), K);
  const char *want[K] = {"0", "1", "2", "3", "4", "five", "6", "7"};
  for (int i = 0; i < K; i++) {
    size_t vn;
    const uint8_t *v = store_proto_get_bytes(&rd, &vn);
    assert_int_equal(vn, strlen(want[i]));
    assert_memory_equal(v, want[i], vn);
  }
  assert_true(store_proto_reader_done(&rd));
  free(p);
  assert_true(wait_counts(f, 1, 3)); /* the other one still waits */
  store_close(s);
  close(fd);
  close(other);
  assert_true(wait_counts(f, 0, 0));
  store_proto_writer_free(&w);
}

/* A client that pipelines requests and does not read the replies: the server stops reading
 * from it once about STORE_MAX_FRAME of replies are queued, keeps serving others, and
 * resumes (in order) when the client reads. */
static void test_unread_replies(void **state) {
  fixture_t *f = *state;
  enum { N = 100, VLEN = 1 << 20 };
  store_t *s = client(f);
  uint8_t *val = malloc(VLEN);
  for (size_t i = 0; i < VLEN; i++) val[i] = (uint8_t)(i * 7);
  assert_int_equal(store_set(s, "mb", val, VLEN), STORE_OK);
  int fd = raw_session(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_GET_NOWAIT);
  store_proto_put_bytes(&w, "mb", 2);
  assert_int_equal(store_proto_finish(&w), 0);
  for (int i = 0; i < N; i++) assert_int_equal(net_send_all(fd, w.buf, w.len), 0);
  expect_healthy(f);
  for (int i = 0; i < N; i++) {
    uint8_t *p;
    size_t n;
    assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_VALUE);
    assert_int_equal(n, 4 + VLEN);
    assert_memory_equal(p + 4, val, VLEN);
    free(p);
  }
  /* Nothing more than the N replies. */
  char b;
  assert_int_equal(net_recv_all(fd, &b, 1, 50), -ETIMEDOUT);
  close(fd);
  free(val);
  store_proto_writer_free(&w);
  store_close(s);
}

/* ---- connecting ---------------------------------------------------------------------- */

typedef struct {
  int lfd;
  const char *say; /* written before closing; NULL: close at once */
} impostor_t;

static void *impostor_thread(void *p) {
  impostor_t *im = p;
  int c = accept(im->lfd, NULL, NULL);
  if (c >= 0) {
    if (im->say) net_send_all(c, im->say, strlen(im->say));
    close(c);
  }
  return NULL;
}

static void impostor(const char *say) {
  impostor_t im = {.say = say};
  int port;
  char err[256];
  im.lfd = net_listen("127.0.0.1", 0, 4, &port, err, sizeof err);
  assert_true(im.lfd >= 0);
  pthread_t th;
  pthread_create(&th, NULL, impostor_thread, &im);
  store_t *s = NULL;
  int rc = store_connect(&s, "127.0.0.1", port, NULL, WAIT_MS, err, sizeof err);
  print_message("impostor (%s): %s\n", say ? "talks" : "silent close", err);
  assert_int_equal(rc, STORE_EPROTO);
  assert_null(s);
  char want[64];
  snprintf(want, sizeof want, "127.0.0.1:%d is not a meshrun store", port);
  assert_non_null(strstr(err, want));
  pthread_join(th, NULL);
  close(im.lfd);
}

static void test_not_a_store(void **state) {
  impostor("HTTP/1.0 200 OK\r\n");
  impostor(NULL);
}

static void test_connect_refused(void **state) {
  int port;
  char err[256];
  assert_int_equal(net_free_port("127.0.0.1", &port, err, sizeof err), 0);
  store_t *s = NULL;
  assert_int_equal(store_connect(&s, "127.0.0.1", port, NULL, 100, err, sizeof err), STORE_ECONNECT);
  assert_non_null(strstr(err, "connection refused"));
  assert_int_equal(store_connect_endpoint(&s, "127.0.0.1", NULL, 100, err, sizeof err), STORE_EINVAL);
  assert_int_equal(store_connect_endpoint(&s, "127.0.0.1:99999", NULL, 100, err, sizeof err), STORE_EINVAL);
}

static void test_endpoint_and_addrinuse(void **state) {
  fixture_t *f = *state;
  char ep[64], err[256];
  snprintf(ep, sizeof ep, "127.0.0.1:%d", f->port);
  store_t *s = NULL;
  store_auth_t auth = {.run_id = JOB_A};
  assert_int_equal(store_connect_endpoint(&s, ep, &auth, WAIT_MS, err, sizeof err), STORE_OK);
  assert_string_equal(store_server_job(s), JOB_A);
  store_close(s);
  uv_loop_t loop;
  uv_loop_init(&loop);
  store_server_t *srv = NULL;
  int bp;
  assert_int_equal(store_server_start(&srv, &loop, "127.0.0.1", f->port, NULL, &bp, err, sizeof err),
                   STORE_SERVER_EADDRINUSE);
  assert_null(srv);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_ipv6(void **state) {
  char err[256];
  int port;
  int fd = net_listen("::1", 0, 1, &port, err, sizeof err);
  if (fd < 0) skip();
  close(fd);
  fixture_t *f = fixture_start("::1");
  assert_int_equal(f->start_rc, 0);
  char ep[64];
  snprintf(ep, sizeof ep, "[::1]:%d", f->port);
  store_t *s = NULL;
  assert_int_equal(store_connect_endpoint(&s, ep, NULL, WAIT_MS, err, sizeof err), STORE_OK);
  assert_int_equal(store_set(s, "v6", "yes", 3), STORE_OK);
  int64_t r;
  assert_int_equal(store_add(s, "n", 1, &r), STORE_OK);
  store_close(s);
  fixture_stop(f);
}

static void *dead_server_waiter(void *p) {
  waiter_arg_t *a = p;
  store_t *s = NULL;
  char err[256];
  store_auth_t auth = {.run_id = a->f->run_id};
  a->rc = store_connect(&s, a->f->host, a->f->port, &auth, WAIT_MS, err, sizeof err);
  if (a->rc) return NULL;
  a->rc = store_get(s, "never", &a->val, &a->len, -1);
  store_close(s);
  return NULL;
}

static void test_server_gone_while_waiting(void **state) {
  fixture_t *f = fixture_start("127.0.0.1");
  assert_int_equal(f->start_rc, 0);
  waiter_arg_t a = {.f = f, .rc = 99};
  pthread_t th;
  pthread_create(&th, NULL, dead_server_waiter, &a);
  assert_true(wait_counts(f, 1, 1));
  fixture_stop(f); /* closes every client, then the loop ends */
  pthread_join(th, NULL);
  assert_int_equal(a.rc, STORE_EIO);
}

/* ---- jobs, secrets and limits -------------------------------------------------------- */

/* One connection attempt from source address src (NULL: any; 127.x.y.z: all of 127/8 is
 * loopback), no retries. Returns the socket, or -1 (no descriptor, refused, src not bindable). */
static int raw_try_connect(fixture_t *f, const char *src) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET};
  if (src) inet_pton(AF_INET, src, &a.sin_addr);
  struct sockaddr_in d = {.sin_family = AF_INET, .sin_port = htons((uint16_t)f->port)};
  inet_pton(AF_INET, "127.0.0.1", &d.sin_addr);
  if ((src && bind(fd, (struct sockaddr *)&a, sizeof a) != 0) || connect(fd, (struct sockaddr *)&d, sizeof d) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static int raw_connect_from(fixture_t *f, const char *src) { return raw_try_connect(f, src); }

static void expect_stored(store_t *s, const char *key, const char *want) {
  void *v = NULL;
  size_t n = 0;
  int rc = store_get_nowait(s, key, &v, &n);
  if (rc != STORE_OK || n != strlen(want) || memcmp(v, want, n) != 0)
    print_message("get '%s': %s, '%.*s' (want '%s')\n", key, store_strerror(rc), (int)n, v ? (char *)v : "", want);
  assert_int_equal(rc, STORE_OK);
  assert_int_equal(n, strlen(want));
  assert_memory_equal(v, want, n);
  free(v);
}

static void test_jobs_do_not_see_each_other(void **state) {
  fixture_t *f = *state;
  char err[512];
  store_t *a = client(f), *b = NULL, *c = NULL;
  assert_int_equal(connect_as(f, "jobB", NULL, &b, err, sizeof err), STORE_OK);
  /* "job" + "Ak" would spell "jobA" + "k" if namespaces were a plain concatenation. */
  assert_int_equal(connect_as(f, "job", NULL, &c, err, sizeof err), STORE_OK);
  assert_string_equal(store_server_job(b), JOB_A);
  assert_int_equal(store_set(a, "k", "a", 1), STORE_OK);
  void *v = NULL;
  size_t n;
  assert_int_equal(store_get_nowait(b, "k", &v, &n), STORE_ENOKEY);
  assert_int_equal(store_get_nowait(c, "Ak", &v, &n), STORE_ENOKEY);
  assert_int_equal(store_get(b, "k", &v, &n, 50), STORE_ETIMEDOUT);
  const char *ks[] = {"k"};
  int exist = -1;
  assert_int_equal(store_check(b, ks, 1, &exist), STORE_OK);
  assert_int_equal(exist, 0);
  assert_int_equal(store_wait(b, ks, 1, 50), STORE_ETIMEDOUT);
  /* Same name, two keys. */
  assert_int_equal(store_set(b, "k", "b", 1), STORE_OK);
  expect_stored(a, "k", "a");
  expect_stored(b, "k", "b");
  int64_t r;
  assert_int_equal(store_add(a, "ctr", 5, &r), STORE_OK);
  assert_int_equal(store_add(b, "ctr", 1, &r), STORE_OK);
  assert_int_equal(r, 1);
  /* CAS sees only its own job's value. */
  assert_int_equal(store_compare_set(b, "k", "a", 1, "x", 1, &v, &n), STORE_OK);
  assert_memory_equal(v, "b", 1);
  free(v);
  assert_int_equal(store_compare_set(c, "fresh", NULL, 0, "c", 1, &v, &n), STORE_OK);
  free(v);
  assert_int_equal(store_compare_set(a, "fresh", NULL, 0, "a", 1, &v, &n), STORE_OK);
  assert_memory_equal(v, "a", 1); /* absent in jobA although jobB... set it: swapped */
  free(v);
  const char *mk[] = {"k", "ctr"};
  void *vals[2];
  size_t lens[2];
  assert_int_equal(store_multi_get(b, mk, 2, vals, lens, 1000), STORE_OK);
  assert_memory_equal(vals[0], "b", 1);
  assert_memory_equal(vals[1], "1", 1);
  free(vals[0]);
  free(vals[1]);
  int deleted = -1;
  assert_int_equal(store_delete(c, "fresh", &deleted), STORE_OK);
  assert_int_equal(deleted, 1);
  expect_stored(a, "fresh", "a");
  int64_t na, nb, nc;
  assert_int_equal(store_num_keys(a, &na), STORE_OK);
  assert_int_equal(store_num_keys(b, &nb), STORE_OK);
  assert_int_equal(store_num_keys(c, &nc), STORE_OK);
  fixture_query(f);
  print_message("keys: jobA %lld, jobB %lld, job %lld, server %zu; foreign connections %zu\n", (long long)na,
                (long long)nb, (long long)nc, f->nkeys, f->nforeign);
  assert_int_equal(na, 3); /* k, ctr, fresh */
  assert_int_equal(nb, 2); /* k, ctr */
  assert_int_equal(nc, 0);
  assert_int_equal(f->nkeys, 5);
  assert_int_equal(f->nforeign, 2);
  /* A waiter is woken by its own job's write only. */
  int fd = raw_connect(f);
  assert_int_equal(raw_hello(fd, "jobB"), 0);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_GET);
  store_proto_put_bytes(&w, "w", 1);
  store_proto_put_i64(&w, -1);
  raw_send(fd, &w);
  assert_true(wait_counts(f, 1, -1));
  assert_int_equal(store_set(a, "w", "from A", 6), STORE_OK);
  fixture_query(f); /* the set was answered after the server rechecked its waiters */
  assert_int_equal(f->nwaiters, 1);
  assert_int_equal(store_set(b, "w", "from B", 6), STORE_OK);
  uint8_t *p;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_VALUE);
  assert_int_equal(n, 4 + 6);
  assert_memory_equal(p + 4, "from B", 6);
  free(p);
  close(fd);
  store_proto_writer_free(&w);
  store_close(a);
  store_close(b);
  store_close(c);
}

static void test_secret_admits(void **state) {
  fixture_t *f = *state;
  char err[512];
  store_t *a = client(f), *b = NULL;
  assert_int_equal(store_set(a, "k", "a", 1), STORE_OK);
  expect_stored(a, "k", "a");
  /* Another run id with the same secret: admitted, in its own namespace. */
  assert_int_equal(connect_as(f, "jobB", SECRET_A, &b, err, sizeof err), STORE_OK);
  assert_string_equal(store_server_job(b), JOB_A);
  void *v;
  size_t n;
  assert_int_equal(store_get_nowait(b, "k", &v, &n), STORE_ENOKEY);
  fixture_query(f);
  assert_int_equal(f->nforeign, 1);
  store_close(a);
  store_close(b);
}

static void test_wrong_secret_refused(void **state) {
  fixture_t *f = *state;
  char err[512];
  store_t *s = NULL;
  assert_int_equal(connect_as(f, "jobB", "not the secret", &s, err, sizeof err), STORE_EAUTH);
  assert_null(s);
  assert_non_null(strstr(err, "belongs to job 'jobA'"));
  assert_non_null(strstr(err, "refused the secret of job 'jobB'"));
  /* A raw client with a wrong proof that goes on regardless: refused, nothing written. */
  int fd = raw_connect(f);
  assert_int_equal(raw_hello(fd, "jobB"), 1);
  store_proto_writer_t w = {0};
  uint8_t proof[STORE_PROTO_PROOF] = {0};
  store_proto_begin(&w, STORE_OP_AUTH);
  store_proto_put_bytes(&w, proof, sizeof proof);
  raw_send(fd, &w);
  store_proto_writer_free(&w);
  expect_set_refused(f, fd, "stolen", STORE_EAUTH); /* sent before reading the verdict */
  assert_int_equal(connect_as(f, "jobB", SECRET_A, &s, err, sizeof err), STORE_OK);
  void *v;
  size_t n;
  assert_int_equal(store_get_nowait(s, "stolen", &v, &n), STORE_ENOKEY);
  store_close(s);
}

static void test_no_secret_refused(void **state) {
  fixture_t *f = *state;
  char err[512];
  store_t *s = NULL;
  assert_int_equal(connect_as(f, "jobB", NULL, &s, err, sizeof err), STORE_EAUTH);
  assert_null(s);
  assert_non_null(strstr(err, "of job 'jobA' requires a secret"));
  assert_non_null(strstr(err, STORE_ENV_SECRET));
  /* A raw client that skips AUTH: its SET is refused and nothing is written. */
  int fd = raw_connect(f);
  assert_int_equal(raw_hello(fd, "jobB"), 1);
  expect_set_refused(f, fd, "sneaky", STORE_EAUTH);
}

static void test_secret_client_refuses_open_store(void **state) {
  fixture_t *f = *state;
  char err[512];
  store_t *s = NULL;
  assert_int_equal(connect_as(f, "jobB", "my secret", &s, err, sizeof err), STORE_EAUTH);
  assert_null(s);
  assert_non_null(strstr(err, "of job 'jobA' is open but this job has a secret"));
}

/* A "store" that knows no secret but claims to require one: the client must not believe it. */
static void *fake_secure_store(void *p) {
  int lfd = *(int *)p;
  int c = accept(lfd, NULL, NULL);
  if (c < 0) return NULL;
  uint8_t hdr[STORE_PROTO_HEADER], body[STORE_PROTO_PREAUTH_FRAME];
  store_proto_writer_t w = {0};
  uint8_t zeros[STORE_PROTO_NONCE] = {0};
  for (int step = 0; step < 2; step++) {
    uint32_t flen;
    int op;
    char why[160];
    if (net_recv_all(c, hdr, sizeof hdr, WAIT_MS) || store_proto_parse_header(hdr, 1, &flen, &op, why, sizeof why) ||
        flen > sizeof body || net_recv_all(c, body, flen - STORE_PROTO_HEADER, WAIT_MS))
      break;
    if (step == 0) {
      store_proto_begin(&w, STORE_REP_HELLO);
      store_proto_put_bytes(&w, STORE_PROTO_BANNER, strlen(STORE_PROTO_BANNER));
      store_proto_put_bytes(&w, JOB_A, strlen(JOB_A));
      store_proto_put_u8(&w, 1);
      store_proto_put_bytes(&w, zeros, sizeof zeros);
    } else {
      store_proto_begin(&w, STORE_REP_AUTH);
      store_proto_put_bytes(&w, zeros, STORE_PROTO_PROOF);
    }
    store_proto_finish(&w);
    net_send_all(c, w.buf, w.len);
  }
  store_proto_writer_free(&w);
  close(c);
  return NULL;
}

static void test_client_checks_the_store_proof(void **state) {
  int port;
  char err[512];
  int lfd = net_listen("127.0.0.1", 0, 4, &port, err, sizeof err);
  assert_true(lfd >= 0);
  pthread_t th;
  pthread_create(&th, NULL, fake_secure_store, &lfd);
  store_t *s = NULL;
  store_auth_t auth = {.run_id = JOB_A, .secret = SECRET_A};
  int rc = store_connect(&s, "127.0.0.1", port, &auth, WAIT_MS, err, sizeof err);
  print_message("fake store: %s: %s\n", store_strerror(rc), err);
  assert_int_equal(rc, STORE_EAUTH);
  assert_null(s);
  assert_non_null(strstr(err, "cannot prove"));
  pthread_join(th, NULL);
  close(lfd);
}

static void test_handshake_deadline(void **state) {
  store_server_opts_t o = {.handshake_ms = 200};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, SECRET_A);
  assert_int_equal(f->start_rc, 0);
  store_t *s = client(f); /* finished its handshake before the others started theirs */
  int64_t t0 = now_ms();
  int idle = raw_connect(f);    /* says nothing */
  int halfway = raw_connect(f); /* says HELLO, never AUTH */
  assert_int_equal(raw_hello(halfway, "jobB"), 1);
  expect_error(idle, STORE_ETIMEDOUT);
  expect_closed(idle);
  int64_t t_idle = now_ms() - t0;
  expect_error(halfway, STORE_ETIMEDOUT);
  expect_closed(halfway);
  int64_t t_half = now_ms() - t0;
  print_message("closed after %lld ms (silent) and %lld ms (HELLO only); deadline 200 ms, tolerance -50 ms\n",
                (long long)t_idle, (long long)t_half);
  assert_true(t_idle >= 150);
  assert_true(t_half >= 150);
  close(idle);
  close(halfway);
  /* Its own deadline passed meanwhile too: a finished handshake disarms it. */
  assert_int_equal(store_set(s, "still", "here", 4), STORE_OK);
  assert_true(wait_counts(f, 0, 1));
  store_close(s);
  fixture_stop(f);
}

static void test_request_before_hello(void **state) {
  fixture_t *f = *state;
  int fd = raw_connect(f);
  expect_set_refused(f, fd, "sneaky", STORE_EAUTH);
  /* A frame bigger than the handshake allows: closed on its header alone. */
  fd = raw_connect(f);
  send_header(fd, STORE_PROTO_PREAUTH_FRAME + 1, STORE_PROTO_MAGIC, STORE_PROTO_VERSION, STORE_OP_HELLO);
  expect_refused(fd, STORE_EPROTO);
  expect_healthy(f);
}

static void test_evict_oldest_unauthenticated(void **state) {
  enum { MAX = 8, EXTRA = 4, N = MAX + EXTRA };
  store_server_opts_t o = {.max_unauth = MAX, .max_unauth_per_addr = 1000, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  int fds[N];
  for (int i = 0; i < N; i++) fds[i] = raw_connect(f);
  /* Accepted in order: the EXTRA oldest go (once their grace has passed), each told why. */
  for (int i = 0; i < EXTRA; i++) {
    expect_refused(fds[i], STORE_EBUSY);
  }
  assert_true(wait_counts(f, 0, MAX));
  /* A real client arriving now gets in: its HELLO came with it (nothing to evict), or it
   * costs the oldest idle one its place. A silent newcomer after it does in either case. */
  expect_healthy(f);
  int late = raw_connect(f);
  expect_refused(fds[EXTRA], STORE_EBUSY);
  for (int i = EXTRA + 1; i < N; i++) {
    assert_int_equal(raw_hello(fds[i], JOB_A), 0); /* the younger ones were left alone */
    close(fds[i]);
  }
  assert_int_equal(raw_hello(late, JOB_A), 0);
  close(late);
  assert_true(wait_counts(f, 0, 0));
  fixture_stop(f);
}

static void test_evict_per_address(void **state) {
  enum { PER = 4, N = 10, OTHER = 3 };
  store_server_opts_t o = {.max_unauth = 64, .max_unauth_per_addr = PER, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  int other[OTHER], fds[N];
  for (int i = 0; i < OTHER; i++) {
    other[i] = raw_connect_from(f, "127.0.0.2");
    if (other[i] < 0) {
      fixture_stop(f);
      skip();
    }
  }
  for (int i = 0; i < N; i++) fds[i] = raw_connect(f); /* from 127.0.0.1 */
  for (int i = 0; i < N - PER; i++) {
    expect_refused(fds[i], STORE_EBUSY);
  }
  assert_true(wait_counts(f, 0, OTHER + PER));
  /* A real client from the flooded address still gets in (as in the test above); the oldest
   * idle one there goes, by its hand or a silent newcomer's. */
  expect_healthy(f);
  int late = raw_connect(f);
  expect_refused(fds[N - PER], STORE_EBUSY);
  for (int i = N - PER + 1; i < N; i++) {
    assert_int_equal(raw_hello(fds[i], JOB_A), 0);
    close(fds[i]);
  }
  assert_int_equal(raw_hello(late, JOB_A), 0);
  close(late);
  /* The other address was under its own limit throughout. */
  for (int i = 0; i < OTHER; i++) {
    assert_int_equal(raw_hello(other[i], JOB_A), 0);
    close(other[i]);
  }
  assert_true(wait_counts(f, 0, 0));
  fixture_stop(f);
}

/* A connection in its handshake has EVICT_GRACE_MS (500 ms here: handshake_ms/2 is more)
 * before the limits on handshakes may take it: a real node on a loaded host may need that
 * long to answer. */
static void test_evict_after_grace(void **state) {
  enum { PER = 2, N = 4, GRACE_MS = 500, TOL_MS = 50 };
  store_server_opts_t o = {.max_unauth = 64, .max_unauth_per_addr = PER, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  int64_t t0 = now_ms();
  int fds[N];
  for (int i = 0; i < N; i++) fds[i] = raw_connect(f);
  assert_true(wait_counts(f, 0, N)); /* all in for now, past the limit */
  expect_refused(fds[0], STORE_EBUSY);
  int64_t waited = now_ms() - t0;
  expect_refused(fds[1], STORE_EBUSY);
  print_message("the oldest of %d silent connections (limit %d) evicted after %lld ms; grace %d ms, tolerance -%d "
                "ms\n", N, PER, (long long)waited, GRACE_MS, TOL_MS);
  assert_true(waited >= GRACE_MS - TOL_MS);
  for (int i = PER; i < N; i++) {
    assert_int_equal(raw_hello(fds[i], JOB_A), 0);
    close(fds[i]);
  }
  assert_true(wait_counts(f, 0, 0));
  fixture_stop(f);
}

/* Nodes connecting while the server's loop is busy: each has sent its HELLO before the server
 * gets to it, and libuv accepts the whole backlog at once. None is evicted, though they
 * outnumber the limits on handshakes many times over: an open store's handshake is done as the
 * connection is accepted; with a secret each one answers the store's HELLO with its AUTH (as
 * store_connect does), within its grace. */
static void burst(const char *secret) {
  enum { PER = 4, MAX = 8, N = 48 };
  store_server_opts_t o = {.max_unauth = MAX, .max_unauth_per_addr = PER, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, secret);
  assert_int_equal(f->start_rc, 0);
  fixture_pause(f);
  int fds[N];
  for (int i = 0; i < N; i++) {
    fds[i] = raw_connect(f);
    raw_send_hello(fds[i], JOB_A);
  }
  fixture_resume(f);
  int evicted = 0;
  store_proto_writer_t w = {0};
  for (int i = 0; i < N; i++) {
    uint8_t *p;
    size_t n;
    int op = raw_reply(fds[i], &p, &n);
    if (op == STORE_REP_HELLO && secret) {
      store_proto_reader_t r;
      store_proto_reader_init(&r, p, n);
      size_t bn, jn, nn;
      store_proto_get_bytes(&r, &bn);
      store_proto_get_bytes(&r, &jn);
      store_proto_get_u8(&r);
      const uint8_t *snonce = store_proto_get_bytes(&r, &nn);
      assert_int_equal(nn, STORE_PROTO_NONCE);
      uint8_t cnonce[STORE_PROTO_NONCE] = {0}, proof[STORE_PROTO_PROOF];
      assert_int_equal(store_proto_proof(proof, secret, 0, cnonce, snonce, JOB_A, strlen(JOB_A)), 0);
      store_proto_begin(&w, STORE_OP_AUTH);
      store_proto_put_bytes(&w, proof, sizeof proof);
      raw_send(fds[i], &w);
      free(p);
      op = raw_reply(fds[i], &p, &n);
    }
    evicted += op == STORE_REP_ERROR;
    free(p);
  }
  print_message("%d connections (limits: %d per address, %d in all) shook hands after a held loop%s: %d "
                "evicted\n", N, PER, MAX, secret ? " (with a secret)" : "", evicted);
  assert_int_equal(evicted, 0);
  assert_true(wait_counts(f, 0, N));
  for (int i = 0; i < N; i++) close(fds[i]);
  assert_true(wait_counts(f, 0, 0));
  store_proto_writer_free(&w);
  fixture_stop(f);
}

static void test_burst_open(void **state) { burst(NULL); }
static void test_burst_secret(void **state) { burst(SECRET_A); }

static void test_connection_limit(void **state) {
  store_server_opts_t o = {.max_conns = 4, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  store_t *s[4];
  for (int i = 0; i < 3; i++) s[i] = client(f);
  int idle = raw_connect(f);
  assert_true(wait_counts(f, 0, 4));
  /* Full: a newcomer evicts the connection still in its handshake... */
  s[3] = client(f);
  expect_refused(idle, STORE_EBUSY);
  /* ...and, with every connection past its handshake, is itself refused. */
  store_t *x = NULL;
  char err[512];
  int rc = store_connect(&x, f->host, f->port, NULL, 300, err, sizeof err);
  print_message("fifth connection: %s: %s\n", store_strerror(rc), err);
  assert_int_equal(rc, STORE_EBUSY);
  assert_non_null(strstr(err, "limit of 4 connections"));
  store_close(s[0]);
  assert_true(wait_counts(f, 0, 3));
  s[0] = client(f);
  assert_int_equal(store_set(s[0], "in", "yes", 3), STORE_OK);
  for (int i = 0; i < 4; i++) store_close(s[i]);
  fixture_stop(f);
}

/* Newcomers to a full store are refused one after the other, however long each refused one
 * stays open, and at most MAX_LINGER (16, store_server.c) of those wait for their client's EOF:
 * what the store holds is max_conns plus 16 descriptors. (A refused one used to stay on the
 * handshake list, and the next newcomer took its place: every second newcomer got in.) */
static void test_connection_limit_holds(void **state) {
  enum { MAX = 4, NEW = 24, LINGER = 16 };
  store_server_opts_t o = {.max_conns = MAX, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  store_t *s[MAX];
  for (int i = 0; i < MAX; i++) s[i] = client(f);
  int fds[NEW], admitted = 0;
  for (int i = 0; i < NEW; i++) {
    fds[i] = raw_connect(f);
    raw_send_hello(fds[i], JOB_A);
    uint8_t *p;
    size_t n;
    admitted += raw_reply(fds[i], &p, &n) != STORE_REP_ERROR;
    free(p);
  }
  fixture_query(f);
  print_message("%d newcomers to a full store (limit %d), each left open: %d admitted; the store holds %zu "
                "connections (bound %d + %d refused ones lingering)\n", NEW, MAX, admitted, f->nclients, MAX, LINGER);
  assert_int_equal(admitted, 0);
  assert_true(wait_counts(f, 0, MAX + LINGER));
  for (int i = 0; i < NEW; i++) close(fds[i]);
  assert_true(wait_counts(f, 0, MAX));
  for (int i = 0; i < MAX; i++) store_close(s[i]);
  fixture_stop(f);
}

/* Past the handshake one address holds at most max_conns_per_host connections: one more from
 * it is refused, naming the limit, while other addresses still get in; a place freed there is
 * taken again. */
static void test_conns_per_host(void **state) {
  enum { PER = 3 };
  store_server_opts_t o = {.max_conns_per_host = PER, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  int other[PER + 1];
  for (int i = 0; i <= PER; i++) {
    other[i] = raw_connect_from(f, "127.0.0.2");
    if (other[i] < 0) {
      fixture_stop(f);
      skip();
    }
  }
  for (int i = 0; i < PER; i++) assert_int_equal(raw_hello(other[i], JOB_A), 0);
  raw_send_hello(other[PER], JOB_A);
  expect_refused(other[PER], STORE_EBUSY);
  /* 127.0.0.1 has its own PER places... */
  store_t *s[PER];
  for (int i = 0; i < PER; i++) s[i] = client(f);
  store_t *x = NULL;
  char err[512];
  store_auth_t auth = {.run_id = JOB_A};
  int rc = store_connect_once(&x, f->host, f->port, &auth, WAIT_MS, err, sizeof err);
  print_message("connection %d from 127.0.0.1: %s: %s\n", PER + 1, store_strerror(rc), err);
  assert_int_equal(rc, STORE_EBUSY);
  assert_non_null(strstr(err, "its limit per host"));
  /* ...and one given back is taken again. */
  close(other[0]);
  store_close(s[0]);
  assert_true(wait_counts(f, 0, 2 * PER - 2));
  other[0] = raw_connect_from(f, "127.0.0.2");
  assert_int_equal(raw_hello(other[0], JOB_A), 0);
  s[0] = client(f);
  assert_int_equal(store_set(s[0], "in", "yes", 3), STORE_OK);
  for (int i = 0; i < PER; i++) {
    close(other[i]);
    store_close(s[i]);
  }
  fixture_stop(f);
}

static int count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n - 3; /* ".", ".." and the directory's own descriptor */
}

/* Descriptors run out (the client sockets of this test live in the server's process, so they
 * count too): accept fails with EMFILE, and the server must shrug it off, evicting connections
 * stuck in the handshake to make room, and serve normally once descriptors are back. */
static void test_out_of_descriptors(void **state) {
  enum { TRIES = 120, SPARE = 40 };
  store_server_opts_t o = {.max_unauth = 10000, .max_unauth_per_addr = 10000, .handshake_ms = 60000};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  struct rlimit old, low;
  assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
  int nopen = count_open_fds();
  if (nopen < 0) {
    fixture_stop(f);
    skip();
  }
  low.rlim_cur = (rlim_t)(nopen + SPARE);
  low.rlim_max = old.rlim_max;
  assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
  /* Single attempts: a client retrying refused connects (net_connect) while the server pauses
   * could connect to itself, loopback to an ephemeral port being what it is. */
  /* Each client sends the first byte of its HELLO, as the store's client does at once: the
   * server, if it took the connection, still waits for the rest. A connection whose handshake
   * was under way when the server closed its listener (pausing) can be established on this
   * side with nothing on the server's, never reset by itself: only a segment of ours, sent or
   * retransmitted, draws the RST that tells this side. */
  const uint8_t first = 0;
  int fds[TRIES], n = 0;
  for (int i = 0; i < TRIES; i++) {
    int fd = raw_try_connect(f, NULL);
    if (fd < 0) continue; /* this side ran out first, or the server paused accepting */
    (void)send(fd, &first, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    fds[n++] = fd;
  }
  /* Still at the low limit, until the server has dealt with every connection: accepted (it
   * counts them), or dropped or evicted (they turn readable: EOF, after an ERROR if evicted;
   * a reset, where the server had nothing of it). */
  int closed = 0;
  int64_t end = now_ms() + WAIT_MS;
  for (;;) {
    closed = 0;
    for (int i = 0; i < n; i++) {
      struct pollfd pf = {.fd = fds[i], .events = POLLIN};
      closed += poll(&pf, 1, 0) > 0;
    }
    fixture_query(f);
    if (f->nclients + (size_t)closed == (size_t)n || now_ms() > end) break;
    sched_yield();
  }
  assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
  int told = 0;
  for (int i = 0; i < n; i++) {
    struct pollfd pf = {.fd = fds[i], .events = POLLIN};
    uint8_t hdr[STORE_PROTO_HEADER];
    if (poll(&pf, 1, 0) > 0 && net_recv_all(fds[i], hdr, sizeof hdr, 0) == 0) told++;
  }
  print_message("descriptor limit %d: %d of %d connections made; the server kept %zu and closed %d (%d with an "
                "ERROR)\n", nopen + SPARE, n, TRIES, f->nclients, closed, told);
  assert_int_equal(f->nclients + (size_t)closed, (size_t)n);
  assert_true(closed > 0);
  for (int i = 0; i < n; i++) close(fds[i]);
  assert_true(wait_counts(f, 0, 0));
  expect_healthy(f);
  fixture_stop(f);
}

/* Sends the header and the first nsend value bytes of a SET "big" frame of flen bytes. */
static void send_partial_set(int fd, uint32_t flen, size_t nsend) {
  size_t vlen = flen - STORE_PROTO_HEADER - (4 + 3) - 4;
  uint8_t head[STORE_PROTO_HEADER + 4 + 3 + 4];
  uint8_t *p = head;
  uint32_t fields[] = {flen, 3, (uint32_t)vlen};
  for (int i = 0; i < 3; i++) {
    uint32_t v = fields[i];
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8), p[3] = (uint8_t)v;
    p += 4;
    if (i == 0) {
      *p++ = STORE_PROTO_MAGIC, *p++ = STORE_PROTO_VERSION, *p++ = STORE_OP_SET, *p++ = 0;
    } else if (i == 1) {
      memcpy(p, "big", 3);
      p += 3;
    }
  }
  assert_int_equal(net_send_all(fd, head, sizeof head), 0);
  uint8_t *body = calloc(1, nsend);
  assert_int_equal(net_send_all(fd, body, nsend), 0);
  free(body);
}

/* A fresh client's SET of a 5 MiB value: expects want, saying when. */
static void expect_big_set(fixture_t *f, const char *key, int want, const char *when) {
  size_t vlen = 5u << 20;
  uint8_t *val = calloc(1, vlen);
  store_t *s = client(f);
  int rc = store_set(s, key, val, vlen);
  print_message("big set %s: %s%s%s\n", when, store_strerror(rc), rc ? ": " : "", rc ? store_errmsg(s) : "");
  assert_int_equal(rc, want);
  store_close(s);
  free(val);
}

/* Reads the reply to a SET whose frame was sent whole: OK. */
static void expect_set_ok(int fd) {
  uint8_t *p;
  size_t n;
  assert_int_equal(raw_reply(fd, &p, &n), STORE_REP_OK);
  free(p);
}

/* A big frame must keep coming: one sent slowly but steadily, taking longer than frame_ms in
 * all, is stored; two that stop half way are dropped once frame_ms has passed without a byte,
 * each told why, and their budget goes to the next big SET, refused while they held it. */
static void test_frame_deadline(void **state) {
  enum { FRAME_MS = 1000, TOL_MS = 50, PIECES = 4 };
  const size_t budget = 8u << 20, frame = 4u << 20;
  store_server_opts_t o = {.inflight_budget = budget, .frame_ms = FRAME_MS};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);

  /* Steady: a piece every FRAME_MS/2 (pacing the sender, not waiting for the server). */
  int slow = raw_session(f);
  size_t piece = frame / PIECES;
  int64_t t0 = now_ms();
  send_partial_set(slow, (uint32_t)frame, piece - (STORE_PROTO_HEADER + 4 + 3 + 4)); /* after the SET's head */
  uint8_t *zeros = calloc(1, piece);
  for (int i = 1; i < PIECES; i++) {
    struct timespec ts = {0, FRAME_MS / 2 * 1000000L};
    nanosleep(&ts, NULL);
    assert_int_equal(net_send_all(slow, zeros, piece), 0);
  }
  expect_set_ok(slow);
  print_message("a %zu-byte frame sent in %d pieces over %lld ms (frame_ms %d): stored\n", frame, PIECES,
                (long long)(now_ms() - t0), FRAME_MS);
  close(slow);

  /* Stalled: the budget is theirs until the deadline, then released. */
  int fds[2];
  int64_t sent[2];
  for (int i = 0; i < 2; i++) {
    fds[i] = raw_session(f);
    send_partial_set(fds[i], (uint32_t)frame, frame / 2);
    sent[i] = now_ms();
  }
  int64_t end = now_ms() + WAIT_MS;
  do fixture_query(f);
  while (f->inflight < budget && now_ms() < end && (sched_yield(), 1));
  expect_big_set(f, "big", STORE_EBUSY, "while two stalled frames hold the budget");
  for (int i = 0; i < 2; i++) {
    expect_error(fds[i], STORE_ETIMEDOUT);
    int64_t waited = now_ms() - sent[i];
    print_message("stalled frame %d dropped %lld ms after its last byte was sent; frame_ms %d, tolerance -%d ms\n",
                  i, (long long)waited, FRAME_MS, TOL_MS);
    assert_true(waited >= FRAME_MS - TOL_MS);
    expect_closed(fds[i]);
    close(fds[i]);
  }
  expect_big_set(f, "big", STORE_OK, "after the drops");
  free(zeros);
  fixture_stop(f);
}

static void test_inflight_budget(void **state) {
  enum { N = 6 };
  const size_t budget = 8u << 20, frame = 4u << 20, sent = 3u << 20;
  store_server_opts_t o = {.inflight_budget = budget};
  fixture_t *f = fixture_start_opts("127.0.0.1", &o, NULL);
  assert_int_equal(f->start_rc, 0);
  int fds[N], refused[N] = {0}, admitted = 0, nrefused = 0;
  size_t peak = 0;
  for (int i = 0; i < N; i++) {
    fds[i] = raw_session(f);
    send_partial_set(fds[i], (uint32_t)frame, sent);
    /* Wait for the server's verdict: an ERROR on the socket, or its buffer grown for the frame
     * (to `frame` bytes once more than half of it arrived; buffers grow only by doubling). */
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
      struct pollfd pf = {.fd = fds[i], .events = POLLIN};
      if (poll(&pf, 1, 0) > 0) {
        expect_error(fds[i], STORE_EBUSY);
        refused[i] = 1;
        nrefused++;
        break;
      }
      fixture_query(f);
      if (f->inflight > peak) peak = f->inflight;
      if (f->inflight >= (size_t)(admitted + 1) * frame) {
        admitted++;
        break;
      }
      if (now_ms() > end) {
        print_message("connection %d: no verdict; %zu bytes in flight\n", i, f->inflight);
        fail();
      }
      sched_yield();
    }
  }
  fixture_query(f);
  if (f->inflight > peak) peak = f->inflight;
  print_message("%d connections announcing %zu-byte frames, %zu bytes sent each: %d admitted, %d refused; "
                "bytes in flight %zu (peak %zu), budget %zu\n",
                N, frame, sent, admitted, nrefused, f->inflight, peak, budget);
  assert_int_equal(admitted, (int)(budget / frame));
  assert_int_equal(nrefused, N - admitted);
  assert_true(peak <= budget);
  for (int i = 0; i < N; i++) {
    if (!refused[i]) continue;
    expect_closed(fds[i]);
    close(fds[i]);
  }
  /* Small requests never wait on the budget; a big one does while it is spent. */
  expect_healthy(f);
  expect_big_set(f, "big2", STORE_EBUSY, "while the budget is spent");
  for (int i = 0; i < N; i++)
    if (!refused[i]) close(fds[i]);
  int64_t end = now_ms() + WAIT_MS;
  do {
    fixture_query(f);
  } while ((f->inflight != 0 || f->nclients != 0) && now_ms() < end && (sched_yield(), 1));
  assert_int_equal(f->inflight, 0);
  expect_big_set(f, "big2", STORE_OK, "once the budget is free");
  fixture_stop(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_set_get, setup, teardown),
      cmocka_unit_test_setup_teardown(test_add, setup, teardown),
      cmocka_unit_test_setup_teardown(test_compare_set, setup, teardown),
      cmocka_unit_test_setup_teardown(test_check_wait_delete, setup, teardown),
      cmocka_unit_test_setup_teardown(test_multi, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wait_timeout, setup, teardown),
      cmocka_unit_test_setup_teardown(test_get_satisfied_later, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wait_satisfied_later, setup, teardown),
      cmocka_unit_test_setup_teardown(test_multi_get_satisfied_later, setup, teardown),
      cmocka_unit_test_setup_teardown(test_add_wakes_waiter, setup, teardown),
      cmocka_unit_test_setup_teardown(test_big_values, setup, teardown),
      cmocka_unit_test_setup_teardown(test_key_limits, setup, teardown),
      cmocka_unit_test_setup_teardown(test_garbage, setup, teardown),
      cmocka_unit_test_setup_teardown(test_truncated_then_close, setup, teardown),
      cmocka_unit_test_setup_teardown(test_oversize_frame, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wrong_version_and_op, setup, teardown),
      cmocka_unit_test_setup_teardown(test_malformed_payload, setup, teardown),
      cmocka_unit_test_setup_teardown(test_slow_client_does_not_stall, setup, teardown),
      cmocka_unit_test_setup_teardown(test_disconnect_while_parked, setup, teardown),
      cmocka_unit_test_setup_teardown(test_many_waiters, setup, teardown),
      cmocka_unit_test_setup_teardown(test_waiters_follow_keys, setup, teardown),
      cmocka_unit_test_setup_teardown(test_unread_replies, setup, teardown),
      cmocka_unit_test(test_not_a_store),
      cmocka_unit_test(test_connect_refused),
      cmocka_unit_test_setup_teardown(test_endpoint_and_addrinuse, setup, teardown),
      cmocka_unit_test(test_ipv6),
      cmocka_unit_test(test_server_gone_while_waiting),
      cmocka_unit_test_setup_teardown(test_jobs_do_not_see_each_other, setup, teardown),
      cmocka_unit_test_setup_teardown(test_secret_admits, setup_secret, teardown),
      cmocka_unit_test_setup_teardown(test_wrong_secret_refused, setup_secret, teardown),
      cmocka_unit_test_setup_teardown(test_no_secret_refused, setup_secret, teardown),
      cmocka_unit_test_setup_teardown(test_secret_client_refuses_open_store, setup, teardown),
      cmocka_unit_test(test_client_checks_the_store_proof),
      cmocka_unit_test(test_handshake_deadline),
      cmocka_unit_test_setup_teardown(test_request_before_hello, setup, teardown),
      cmocka_unit_test(test_evict_oldest_unauthenticated),
      cmocka_unit_test(test_evict_per_address),
      cmocka_unit_test(test_evict_after_grace),
      cmocka_unit_test(test_burst_open),
      cmocka_unit_test(test_burst_secret),
      cmocka_unit_test(test_connection_limit),
      cmocka_unit_test(test_connection_limit_holds),
      cmocka_unit_test(test_conns_per_host),
      cmocka_unit_test(test_inflight_budget),
      cmocka_unit_test(test_frame_deadline),
      cmocka_unit_test(test_out_of_descriptors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
