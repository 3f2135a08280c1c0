// deps: common/http.c common/net.c common/err.c
/* test_http: the HTTP/1.1 client under the etcd client, against a scripted server thread on a
 * loopback port the kernel picks: kept connections, the three body framings, streams stopped by
 * the caller, deadlines, wakes, refusals and malformed replies. (Real etcd replies are covered by
 * test_etcd.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/http.h"
#include "common/net.h"

/* The server: accepts connections one after another; for each request read on one, reply(fd,
 * nth request overall) writes an answer and returns whether to keep the connection. */
typedef int (*reply_fn)(int fd, int nth);

typedef struct {
  int lfd, port;
  reply_fn reply;
  atomic_int accepts, requests;
  atomic_int conn; /* the connection being served, -1 none */
  pthread_t th;
} server_t;

/* Reads one request (head and Content-Length body); 0, or -1 at EOF. */
static int read_request(int fd) {
  char buf[8192];
  size_t len = 0;
  for (;;) {
    ssize_t n = recv(fd, buf + len, sizeof buf - 1 - len, 0);
    if (n <= 0) return -1;
    len += (size_t)n;
    buf[len] = 0;
    char *blank = strstr(buf, "\r\n\r\n");
    if (!blank) continue;
    const char *cl = strstr(buf, "Content-Length: ");
    size_t body = cl ? strtoul(cl + 16, NULL, 10) : 0, have = len - (size_t)(blank + 4 - buf);
    while (have < body) {
      n = recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return -1;
      have += (size_t)n;
    }
    return 0;
  }
}

static void *serve(void *arg) {
  server_t *s = arg;
  for (;;) {
    int fd = accept(s->lfd, NULL, NULL);
    if (fd < 0) return NULL;
    atomic_fetch_add(&s->accepts, 1);
    atomic_store(&s->conn, fd);
    while (read_request(fd) == 0) {
      int nth = atomic_fetch_add(&s->requests, 1);
      if (!s->reply(fd, nth)) break;
    }
    atomic_store(&s->conn, -1);
    close(fd);
  }
}

static void server_start(server_t *s, reply_fn reply) {
  char err[256];
  memset(s, 0, sizeof *s);
  s->reply = reply;
  s->conn = -1;
  s->lfd = net_listen("127.0.0.1", 0, 8, &s->port, err, sizeof err);
  assert_true(s->lfd >= 0);
  assert_int_equal(pthread_create(&s->th, NULL, serve, s), 0);
}

static void server_stop(server_t *s) {
  shutdown(s->lfd, SHUT_RDWR);
  int c = atomic_load(&s->conn); /* a kept connection the client has not closed */
  if (c >= 0) shutdown(c, SHUT_RDWR);
  pthread_join(s->th, NULL);
  close(s->lfd);
}

static void say(int fd, const char *text) { assert_int_equal(net_send_all(fd, text, strlen(text)), 0); }

/* The client side: collects the body. */
typedef struct {
  char body[4096];
  size_t len;
  int stop_after; /* stop after this many callbacks (0: never) */
  int calls;
} sink_t;

static int collect(void *arg, const char *p, size_t n) {
  sink_t *k = arg;
  assert_true(k->len + n < sizeof k->body);
  memcpy(k->body + k->len, p, n);
  k->len += n;
  k->body[k->len] = 0;
  return k->stop_after && ++k->calls >= k->stop_after;
}

/* One test's server, client and last reply. */
typedef struct {
  server_t s;
  http_conn_t h;
  sink_t k;
  http_res_t res;
  char err[256];
} fix_t;

static void fix_start(fix_t *f, reply_fn reply) {
  memset(f, 0, sizeof *f);
  if (reply) server_start(&f->s, reply);
  assert_int_equal(http_init(&f->h), 0);
}

static void fix_stop(fix_t *f) {
  http_close(&f->h);
  if (f->s.reply) server_stop(&f->s);
}

/* A request to the fixture's server; prints the error, if any. */
static int post(fix_t *f, int fresh, int timeout_ms, const int64_t *early) {
  http_req_t rq = {.host = "127.0.0.1", .port = f->s.port, .peer = 0, .path = "/v3/kv/range",
                   .body = "{}", .body_len = 2, .fresh = fresh, .deadline = net_now_ms() + timeout_ms,
                   .early = early, .on_data = collect, .arg = &f->k};
  memset(&f->k, 0, offsetof(sink_t, stop_after));
  f->err[0] = 0;
  int rc = http_post(&f->h, &rq, &f->res, f->err, sizeof f->err);
  if (rc) print_message("  -> %d: %s\n", rc, f->err);
  return rc;
}

static int reply_len(int fd, int nth) {
  char msg[128];
  snprintf(msg, sizeof msg, "HTTP/1.1 200 OK\r\nContent-Length: 6\r\ncontent-type: x\r\n\r\nreq %02d", nth);
  say(fd, msg);
  return 1;
}

static void test_kept_connection(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_len);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(post(&f, 0, 5000, NULL), 0);
    char want[16];
    snprintf(want, sizeof want, "req %02d", i);
    assert_string_equal(f.k.body, want);
    assert_int_equal(f.res.status, 200);
    assert_true(f.res.sent > 2);
  }
  print_message("3 requests, %d connection(s)\n", atomic_load(&f.s.accepts));
  assert_int_equal(atomic_load(&f.s.accepts), 1);
  /* fresh: a new connection each time, the kept one closed. */
  assert_int_equal(post(&f, 1, 5000, NULL), 0);
  assert_int_equal(post(&f, 1, 5000, NULL), 0);
  assert_int_equal(atomic_load(&f.s.accepts), 3);
  fix_stop(&f);
}

/* Chunked, sent a few bytes at a time, with a chunk extension and a trailer. */
static int reply_chunked(int fd, int nth) {
  (void)nth;
  const char *msg = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    "5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n";
  for (size_t i = 0; msg[i]; i += 3) {
    size_t n = strlen(msg + i) < 3 ? strlen(msg + i) : 3;
    assert_int_equal(net_send_all(fd, msg + i, n), 0);
    usleep(200);
  }
  return 1;
}

static void test_chunked(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_chunked);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(post(&f, 0, 5000, NULL), 0);
    assert_string_equal(f.k.body, "hello world");
  }
  assert_int_equal(atomic_load(&f.s.accepts), 1); /* the whole reply was read: the connection is kept */
  fix_stop(&f);
}

/* A stream (a watch): one message, then nothing until the client goes. */
static int reply_stream(int fd, int nth) {
  (void)nth;
  say(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nevent\n\r\n");
  char b[64];
  while (recv(fd, b, sizeof b, 0) > 0) {
  }
  return 0;
}

static void test_stream_stopped_by_caller(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_stream);
  f.k.stop_after = 1;
  int64_t t0 = net_now_ms();
  assert_int_equal(post(&f, 0, 5000, NULL), 0);
  print_message("stopped after %lld ms\n", (long long)(net_now_ms() - t0));
  assert_true(net_now_ms() - t0 < 2000);
  assert_string_equal(f.k.body, "event\n");
  assert_int_equal(f.h.fd, -1); /* the rest of the stream was still coming: not kept */
  fix_stop(&f);
}

/* Reads the request, never answers; ends when the client closes. */
static int reply_never(int fd, int nth) {
  (void)nth;
  char b[64];
  while (recv(fd, b, sizeof b, 0) > 0) {
  }
  return 0;
}

static void test_deadlines(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_never);
  int64_t t0 = net_now_ms();
  assert_int_equal(post(&f, 0, 200, NULL), -ETIMEDOUT);
  int64_t took = net_now_ms() - t0;
  print_message("deadline 200 ms: returned after %lld ms, sent %zu\n", (long long)took, f.res.sent);
  assert_true(took >= 190 && took < 2000);
  assert_true(f.res.sent > 0);
  assert_int_equal(f.res.early, 0);
  /* The early deadline ends it first and says so. */
  int64_t early = net_now_ms() + 100;
  t0 = net_now_ms();
  assert_int_equal(post(&f, 0, 10000, &early), -ETIMEDOUT);
  took = net_now_ms() - t0;
  print_message("early deadline 100 ms of 10000: returned after %lld ms\n", (long long)took);
  assert_true(took < 2000);
  assert_int_equal(f.res.early, 1);
  fix_stop(&f);
}

static void *wake_later(void *arg) {
  usleep(100 * 1000);
  http_wake(arg);
  return NULL;
}

static void test_wake(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_never);
  pthread_t th;
  int64_t t0 = net_now_ms();
  assert_int_equal(pthread_create(&th, NULL, wake_later, &f.h), 0);
  assert_int_equal(post(&f, 0, 10000, NULL), -EINTR);
  pthread_join(th, NULL);
  int64_t took = net_now_ms() - t0;
  print_message("woken after %lld ms (deadline 10000)\n", (long long)took);
  assert_true(took < 2000);
  /* Woken stays woken: the next call ends at once, sending nothing. */
  assert_int_equal(post(&f, 0, 10000, NULL), -EINTR);
  assert_int_equal(f.res.sent, 0);
  fix_stop(&f);
}

/* Answers, then closes the kept connection: the next request must go on a new one. */
static int reply_then_close(int fd, int nth) {
  reply_len(fd, nth);
  return 0;
}

static void test_kept_connection_closed_by_peer(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_then_close);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(post(&f, 0, 5000, NULL), 0);
  }
  assert_int_equal(atomic_load(&f.s.accepts), 3);
  assert_int_equal(atomic_load(&f.s.requests), 3); /* each sent once */
  fix_stop(&f);
}

static void test_refused(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, NULL); /* no server: a port that was free a moment ago */
  assert_int_equal(net_free_port("127.0.0.1", &f.s.port, f.err, sizeof f.err), 0);
  assert_int_equal(post(&f, 0, 2000, NULL), -ECONNREFUSED);
  assert_non_null(strstr(f.err, "refused"));
  assert_int_equal(f.res.sent, 0);
  fix_stop(&f);
}

static int reply_garbage(int fd, int nth) {
  say(fd, nth == 0 ? "SSH-2.0-OpenSSH\r\n\r\n" : "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
  return 0;
}

static int reply_cut(int fd, int nth) {
  say(fd, nth == 0 ? "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc" : "HTTP/1.1 500 x\r\nConnection: close\r\n\r\nup to the end");
  return 0;
}

static int reply_interim(int fd, int nth) {
  (void)nth;
  say(fd, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno");
  return 1;
}

static void test_framing_and_errors(void **state) {
  (void)state;
  fix_t f;
  fix_start(&f, reply_garbage);
  assert_int_equal(post(&f, 0, 2000, NULL), -EPROTO); /* not HTTP */
  assert_int_equal(post(&f, 0, 2000, NULL), -EPROTO); /* a bad chunk size */
  assert_non_null(strstr(f.err, "chunked"));
  server_stop(&f.s);

  server_start(&f.s, reply_cut);
  assert_int_equal(post(&f, 0, 2000, NULL), -EIO);
  assert_non_null(strstr(f.err, "mid-reply"));
  /* No length and Connection: close: the body runs to the close. */
  assert_int_equal(post(&f, 0, 2000, NULL), 0);
  assert_int_equal(f.res.status, 500);
  assert_string_equal(f.k.body, "up to the end");
  assert_int_equal(f.h.fd, -1);
  server_stop(&f.s);

  server_start(&f.s, reply_interim);
  assert_int_equal(post(&f, 0, 2000, NULL), 0);
  assert_int_equal(f.res.status, 404);
  assert_string_equal(f.k.body, "no");
  fix_stop(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kept_connection),
      cmocka_unit_test(test_chunked),
      cmocka_unit_test(test_stream_stopped_by_caller),
      cmocka_unit_test(test_deadlines),
      cmocka_unit_test(test_wake),
      cmocka_unit_test(test_kept_connection_closed_by_peer),
      cmocka_unit_test(test_refused),
      cmocka_unit_test(test_framing_and_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
