// deps: common/net.c common/err.c
/* test_net: endpoint parsing and formatting, and real sockets on IPv4 and IPv6 loopback
 * (the IPv6 cases skip when the machine has no ::1). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/net.h"

static void parse_ok(const char *s, const char *host, int port, int allow_zero) {
  char h[256], err[256] = "";
  int p = -1;
  int rc = net_parse_endpoint(s, h, sizeof h, &p, 29400, allow_zero, err, sizeof err);
  if (rc) print_message("'%s': %s\n", s, err);
  assert_int_equal(rc, 0);
  assert_string_equal(h, host);
  assert_int_equal(p, port);
}

static void parse_bad(const char *s, int allow_zero) {
  char h[256], err[256] = "";
  int p = -1;
  int rc = net_parse_endpoint(s, h, sizeof h, &p, 29400, allow_zero, err, sizeof err);
  if (rc != -EINVAL) print_message("'%s' was accepted as host '%s' port %d\n", s ? s : "(null)", h, p);
  assert_int_equal(rc, -EINVAL);
  assert_true(err[0] != '\0');
}

static void test_parse(void **state) {
  parse_ok("node1", "node1", 29400, 0);
  parse_ok("node1:5", "node1", 5, 0);
  parse_ok("10.0.0.1:65535", "10.0.0.1", 65535, 0);
  parse_ok("[::1]:5", "::1", 5, 0);
  parse_ok("[::1]", "::1", 29400, 0);
  parse_ok("::1", "::1", 29400, 0);
  parse_ok("fe80::1:2:3", "fe80::1:2:3", 29400, 0);
  parse_ok("[fe80::1%lo]:7", "fe80::1%lo", 7, 0);
  parse_ok("localhost:0", "localhost", 0, 1);
  parse_bad("", 0);
  parse_bad(NULL, 0);
  parse_bad(":5", 0);
  parse_bad("[]:5", 0);
  parse_bad("host:", 0);
  parse_bad("host:0", 0);
  parse_bad("host:65536", 0);
  parse_bad("host:-1", 0);
  parse_bad("host:12ab", 0);
  parse_bad("host:123456", 0);
  parse_bad("[::1", 0);
  parse_bad("[::1]x", 0);
  parse_bad("[::1]:", 0);
  parse_bad("[nonsense]:5", 0);
  parse_bad("a:b:c", 0);
  parse_bad("ho st:5", 0);
  /* The host buffer is too small. */
  char h[4], err[128];
  int p;
  assert_int_equal(net_parse_endpoint("longhost:1", h, sizeof h, &p, 1, 0, err, sizeof err), -EINVAL);
}

static void test_format(void **state) {
  char out[64];
  net_format_endpoint(out, sizeof out, "127.0.0.1", 80);
  assert_string_equal(out, "127.0.0.1:80");
  net_format_endpoint(out, sizeof out, "::1", 80);
  assert_string_equal(out, "[::1]:80");
}

typedef struct {
  int lfd, got;
  char buf[6];
} echo_t;

/* Accepts one connection, reads 5 bytes, answers "world" and closes. */
static void *echo_thread(void *p) {
  echo_t *e = p;
  int c = accept(e->lfd, NULL, NULL);
  if (c < 0) return NULL;
  if (net_recv_all(c, e->buf, 5, 5000) == 0) e->got = 1;
  net_send_all(c, "world", 5);
  close(c);
  return NULL;
}

static void roundtrip(const char *host) {
  char err[256];
  int port = 0;
  echo_t e = {0};
  e.lfd = net_listen(host, 0, 4, &port, err, sizeof err);
  if (e.lfd < 0) print_message("listen %s: %s\n", host, err);
  assert_true(e.lfd >= 0);
  assert_true(port > 0);
  pthread_t th;
  pthread_create(&th, NULL, echo_thread, &e);
  int fd = net_connect(host, port, 5000, err, sizeof err);
  if (fd < 0) print_message("%s\n", err);
  assert_true(fd >= 0);
  assert_int_equal(net_send_all(fd, "hello", 5), 0);
  char b[6] = {0};
  assert_int_equal(net_recv_all(fd, b, 5, 5000), 0);
  assert_string_equal(b, "world");
  /* The peer closed: EOF reads as -ECONNRESET. */
  assert_int_equal(net_recv_all(fd, b, 1, 5000), -ECONNRESET);
  pthread_join(th, NULL);
  assert_true(e.got);
  assert_memory_equal(e.buf, "hello", 5);
  close(fd);
  /* The port is now taken by the listener. */
  int p2;
  int again = net_listen(host, port, 4, &p2, err, sizeof err);
  assert_int_equal(again, -EADDRINUSE);
  close(e.lfd);
}

static void test_ipv4(void **state) { roundtrip("127.0.0.1"); }

static int have_v6(void) {
  int port;
  char err[128];
  int fd = net_listen("::1", 0, 1, &port, err, sizeof err);
  if (fd < 0) return 0;
  close(fd);
  return 1;
}

static void test_ipv6(void **state) {
  if (!have_v6()) skip();
  roundtrip("::1");
}

static void test_any_address(void **state) {
  /* "" listens on every address; both loopbacks reach it when the kernel has IPv6. */
  char err[256];
  int port;
  int lfd = net_listen("", 0, 4, &port, err, sizeof err);
  assert_true(lfd >= 0);
  int fd = net_connect("127.0.0.1", port, 2000, err, sizeof err);
  assert_true(fd >= 0);
  close(fd);
  if (have_v6()) {
    fd = net_connect("::1", port, 2000, err, sizeof err);
    assert_true(fd >= 0);
    close(fd);
  }
  close(lfd);
}

static void test_refused_and_timeout(void **state) {
  char err[256];
  int port;
  assert_int_equal(net_free_port("127.0.0.1", &port, err, sizeof err), 0);
  assert_true(port > 0);
  int fd = net_connect("127.0.0.1", port, 100, err, sizeof err);
  assert_int_equal(fd, -ECONNREFUSED);
  char want[64];
  snprintf(want, sizeof want, "connect 127.0.0.1:%d: connection refused", port);
  assert_non_null(strstr(err, want));
  if (have_v6()) {
    fd = net_connect("::1", port, 50, err, sizeof err);
    assert_int_equal(fd, -ECONNREFUSED);
    snprintf(want, sizeof want, "[::1]:%d", port);
    assert_non_null(strstr(err, want));
  }
  fd = net_connect("no-such-host.invalid", 80, 100, err, sizeof err);
  assert_true(fd < 0);
  assert_non_null(strstr(err, "no-such-host.invalid"));
  /* A receive with nothing to read times out. */
  int lfd = net_listen("127.0.0.1", 0, 1, &port, err, sizeof err);
  fd = net_connect("127.0.0.1", port, 1000, err, sizeof err);
  assert_true(fd >= 0);
  char b;
  assert_int_equal(net_recv_all(fd, &b, 1, 20), -ETIMEDOUT);
  close(fd);
  close(lfd);
}

typedef struct {
  int port, fd;
} late_t;

static void *late_connect(void *p) {
  late_t *l = p;
  char err[256];
  l->fd = net_connect("127.0.0.1", l->port, 5000, err, sizeof err);
  return NULL;
}

static void test_connect_retries_until_listening(void **state) {
  char err[256];
  late_t l = {0};
  assert_int_equal(net_free_port("127.0.0.1", &l.port, err, sizeof err), 0);
  pthread_t th;
  pthread_create(&th, NULL, late_connect, &l);
  /* The connector starts first and is refused; it must keep trying until this listen. */
  int bound;
  int lfd = net_listen("127.0.0.1", l.port, 4, &bound, err, sizeof err);
  if (lfd < 0) {
    pthread_join(th, NULL);
    skip(); /* someone else took the port in between */
  }
  pthread_join(th, NULL);
  assert_true(l.fd >= 0);
  close(l.fd);
  close(lfd);
}

static void test_hostname(void **state) {
  char h[256];
  net_hostname(h, sizeof h);
  assert_true(strlen(h) > 0);
  char tiny[4];
  net_hostname(tiny, sizeof tiny);
  assert_true(strlen(tiny) < sizeof tiny);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse),
      cmocka_unit_test(test_format),
      cmocka_unit_test(test_ipv4),
      cmocka_unit_test(test_ipv6),
      cmocka_unit_test(test_any_address),
      cmocka_unit_test(test_refused_and_timeout),
      cmocka_unit_test(test_connect_retries_until_listening),
      cmocka_unit_test(test_hostname),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
