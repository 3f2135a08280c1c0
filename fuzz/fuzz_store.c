// deps: launcher/store_server.c common/store_proto.c common/net.c common/log.c fuzz/support.c common/err.c
// max_len: 8192
/* fuzz_store: the store server's frame parser, driven through the real server on loopback.
 *
 * Each input is the byte stream of one client connection: a fresh server (store_server_start,
 * opts NULL: an open store, so requests after HELLO are parsed) listens on 127.0.0.1, port 0,
 * on this process's libuv loop; a client on the same loop connects, writes the input, shuts
 * down its side and reads until the server closes. A parked request (GET or WAIT on a key that
 * never comes) would hold the connection until its timeout, so the client gives up when the
 * server has sent nothing for IDLE_MS. Then the server is closed and the loop run until every
 * handle is gone. A fresh server per input keeps runs reproducible: no keys carry over.
 * The server logs every disconnect at warn level: the target sets MESHRUN_LOG_LEVEL to error
 * unless it is set already. */
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <uv.h>

#include "common/log.h"
#include "fuzz/support.h"
#include "launcher/store_server.h"

#define IDLE_MS 20

typedef struct {
  uv_tcp_t tcp;
  uv_connect_t conn;
  uv_write_t wr;
  uv_shutdown_t shut;
  uv_timer_t idle;
  uv_buf_t out;
  char in[65536];
  size_t received;
  int closing, closed;
} client_t;

static uv_loop_t g_loop;

static void on_closed(uv_handle_t *h) { ((client_t *)h->data)->closed++; }

static void client_close(client_t *c) {
  if (c->closing) return;
  c->closing = 1;
  uv_timer_stop(&c->idle);
  /* Reset rather than linger in TIME_WAIT: thousands of connections a second would otherwise
   * run the loopback out of ports. */
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0) {
    struct linger l = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  }
  uv_close((uv_handle_t *)&c->tcp, on_closed);
  uv_close((uv_handle_t *)&c->idle, on_closed);
}

static void on_idle(uv_timer_t *t) { client_close(t->data); }

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
  client_t *c = h->data;
  *buf = uv_buf_init(c->in, sizeof c->in);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  client_t *c = s->data;
  if (n < 0) {
    client_close(c); /* EOF or reset: the server is done with us */
    return;
  }
  c->received += (size_t)n;
  uv_timer_again(&c->idle);
}

static void on_shutdown(uv_shutdown_t *req, int status) {}

static void on_write(uv_write_t *req, int status) {
  client_t *c = req->data;
  if (status == 0 && !c->closing) uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_shutdown);
}

static void on_connect(uv_connect_t *req, int status) {
  client_t *c = req->data;
  if (status != 0 || c->closing) {
    client_close(c);
    return;
  }
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &c->out, 1, on_write) != 0) client_close(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int init;
  if (!init) {
    CHECK(uv_loop_init(&g_loop) == 0);
    /* as meshrun's main does: a write to a connection the peer reset must fail with EPIPE,
     * not kill the process (the client here resets on purpose, see client_close) */
    signal(SIGPIPE, SIG_IGN);
    setenv("MESHRUN_LOG_LEVEL", "error", 0);
    log_init("[fuzz_store]");
    init = 1;
  }
  store_server_t *srv = NULL;
  int port = 0;
  char err[512];
  if (store_server_start(&srv, &g_loop, "127.0.0.1", 0, NULL, &port, err, sizeof err) != 0) {
    fprintf(stderr, "fuzz_store: cannot start the server: %s\n", err);
    abort();
  }
  client_t *c = calloc(1, sizeof *c);
  CHECK(c);
  c->out = uv_buf_init((char *)data, (unsigned)size);
  CHECK(uv_tcp_init(&g_loop, &c->tcp) == 0);
  CHECK(uv_timer_init(&g_loop, &c->idle) == 0);
  c->tcp.data = c->idle.data = c->conn.data = c->wr.data = c->shut.data = c;
  struct sockaddr_in addr;
  uv_ip4_addr("127.0.0.1", port, &addr);
  CHECK(uv_tcp_connect(&c->conn, &c->tcp, (const struct sockaddr *)&addr, on_connect) == 0);
  uv_timer_start(&c->idle, on_idle, IDLE_MS, IDLE_MS);
  while (c->closed < 2)
    uv_run(&g_loop, UV_RUN_ONCE);
  store_server_close(srv);
  uv_run(&g_loop, UV_RUN_DEFAULT); /* until the server's handles are closed and freed */
  fuzz_note("%zu bytes sent, %zu received", size, c->received);
  free(c);
  return 0;
}
