// deps: common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c
/* test_store: the store server on its own libuv loop (a thread), driven by the blocking client
 * and by raw sockets that speak (or abuse) the wire format.
 *
 * Every test starts a fresh server on 127.0.0.1 port 0. Parking is observed through the
 * server's counters, read on the loop thread via uv_async, never by sleeping. Abuse tests
 * check both sides: the abusive socket sees the connection closed, and a fresh client is
 * served correctly afterwards. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "common/net.h"
#include "common/store.h"
#include "common/store_proto.h"
#include "launcher/store_server.h"

#define WAIT_MS 5000 /* upper bound for anything that should happen "soon" */

typedef struct {
  char host[64];
  uv_loop_t loop;
  uv_async_t async;
  store_server_t *srv;
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int port, started, start_rc;
  char start_err[256];
  int stop, query, answered;
  size_t nclients, nkeys, nwaiters;
} fixture_t;

static void on_async(uv_async_t *a) {
  fixture_t *f = a->data;
  pthread_mutex_lock(&f->mu);
  if (f->query) {
    f->nclients = store_server_num_clients(f->srv);
    f->nkeys = store_server_num_keys(f->srv);
    f->nwaiters = store_server_num_waiters(f->srv);
    f->query = 0;
    f->answered = 1;
    pthread_cond_broadcast(&f->cv);
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
  int rc = store_server_start(&f->srv, &f->loop, f->host, 0, &f->port, f->start_err, sizeof f->start_err);
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

static fixture_t *fixture_start(const char *host) {
  fixture_t *f = calloc(1, sizeof *f);
  snprintf(f->host, sizeof f->host, "%s", host);
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  pthread_create(&f->th, NULL, server_thread, f);
  pthread_mutex_lock(&f->mu);
  while (!f->started) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
  return f;
}

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

/* Reads the server's counters on its loop thread. */
static void fixture_query(fixture_t *f) {
  pthread_mutex_lock(&f->mu);
  f->query = 1;
  f->answered = 0;
  uv_async_send(&f->async);
  while (!f->answered) pthread_cond_wait(&f->cv, &f->mu);
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

static int teardown(void **state) {
  fixture_stop(*state);
  return 0;
}

static store_t *client(fixture_t *f) {
  store_t *s = NULL;
  char err[256];
  int rc = store_connect(&s, f->host, f->port, WAIT_MS, err, sizeof err);
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
  a->rc = store_connect(&s, a->f->host, a->f->port, WAIT_MS, err, sizeof err);
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
  int fd = raw_connect(f);
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
  int fd = raw_connect(f);
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
  int fd = raw_connect(f);
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
  int fd = raw_connect(f);
  store_proto_writer_t w = {0};
  store_proto_begin(&w, STORE_OP_SET);
  store_proto_put_u32(&w, 1000);
  store_proto_put_bytes(&w, "v", 1);
  raw_send(fd, &w);
  expect_closed(fd);
  close(fd);
  /* Trailing bytes after the last field. */
  fd = raw_connect(f);
  store_proto_begin(&w, STORE_OP_NUM_KEYS);
  store_proto_put_u8(&w, 1);
  raw_send(fd, &w);
  expect_closed(fd);
  close(fd);
  /* A key count the payload cannot hold. */
  fd = raw_connect(f);
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
  int fd = raw_connect(f);
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
  int fd = raw_connect(f);
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
    fds[i] = raw_connect(f);
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
  int fd = raw_connect(f);
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
  int rc = store_connect(&s, "127.0.0.1", port, WAIT_MS, err, sizeof err);
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
  assert_int_equal(store_connect(&s, "127.0.0.1", port, 100, err, sizeof err), STORE_ECONNECT);
  assert_non_null(strstr(err, "connection refused"));
  assert_int_equal(store_connect_endpoint(&s, "127.0.0.1", 100, err, sizeof err), STORE_EINVAL);
  assert_int_equal(store_connect_endpoint(&s, "127.0.0.1:99999", 100, err, sizeof err), STORE_EINVAL);
}

static void test_endpoint_and_addrinuse(void **state) {
  fixture_t *f = *state;
  char ep[64], err[256];
  snprintf(ep, sizeof ep, "127.0.0.1:%d", f->port);
  store_t *s = NULL;
  assert_int_equal(store_connect_endpoint(&s, ep, WAIT_MS, err, sizeof err), STORE_OK);
  store_close(s);
  uv_loop_t loop;
  uv_loop_init(&loop);
  store_server_t *srv = NULL;
  int bp;
  assert_int_equal(store_server_start(&srv, &loop, "127.0.0.1", f->port, &bp, err, sizeof err),
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
  assert_int_equal(store_connect_endpoint(&s, ep, WAIT_MS, err, sizeof err), STORE_OK);
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
  a->rc = store_connect(&s, a->f->host, a->f->port, WAIT_MS, err, sizeof err);
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
      cmocka_unit_test_setup_teardown(test_unread_replies, setup, teardown),
      cmocka_unit_test(test_not_a_store),
      cmocka_unit_test(test_connect_refused),
      cmocka_unit_test_setup_teardown(test_endpoint_and_addrinuse, setup, teardown),
      cmocka_unit_test(test_ipv6),
      cmocka_unit_test(test_server_gone_while_waiting),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
