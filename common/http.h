/* http: the small HTTP/1.1 client under the etcd client (common/etcd.c).
 *
 * Just what etcd's JSON gateway needs: POST (and GET) with a Content-Length body over plain TCP, replies
 * with a Content-Length, chunked or close-delimited body, a kept connection reused by the next
 * request to the same peer, and streams (watch) read as they come. No TLS, proxies, redirects or
 * 100-continue. It replaced libcurl, whose loading (dlopen of ~30 libraries, gnutls and OpenSSL
 * initialising) cost each meshrun process 4.4-4.9 ms of CPU, more than a whole c10d node; at
 * 1024 nodes on 2 cores that was a second of the start.
 *
 * A request is never sent twice on its own, with one exception that is safe: a request that
 * found its kept connection closed by the peer before any byte of a reply came is sent again on
 * a new connection, unless the caller said fresh (a transaction: etcd may have applied it). */
#ifndef MESHRUN_HTTP_H
#define MESHRUN_HTTP_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  int fd;   /* the kept connection, -1 when none */
  int peer; /* the caller's name for where fd leads (an endpoint index) */
  int wake; /* eventfd: once http_wake wrote it, every call returns -EINTR at once */
} http_conn_t;

/* Body bytes as they arrive (chunked framing removed). Nonzero stops reading: the call returns 0
 * and, the reply being unfinished, the connection is closed. */
typedef int (*http_data_fn)(void *arg, const char *p, size_t n);

typedef struct {
  const char *host;    /* numeric or name; net_connect_once resolves it */
  int port, peer;      /* peer: kept connections are reused only for the same peer */
  const char *method;  /* NULL: POST */
  const char *path;    /* "/v3/kv/range" */
  const char *headers; /* extra header lines, each ending in "\r\n", or NULL */
  const char *body;
  size_t body_len;
  int fresh;             /* a new connection, never a kept one */
  int64_t deadline;      /* net_now_ms() clock: the whole exchange */
  const int64_t *early;  /* optional: > 0 is an earlier deadline the data callback may lift (set 0) */
  http_data_fn on_data;
  void *arg;
} http_req_t;

typedef struct {
  int status;  /* the HTTP status, 0 before one came */
  size_t sent; /* request bytes handed to the kernel: > 0 means the peer may have acted on it */
  int early;   /* the early deadline passed */
} http_res_t;

/* 0, or -ENOMEM (no eventfd). */
int http_init(http_conn_t *h);
void http_close(http_conn_t *h);
/* From any thread: the call in progress, and every later one, returns -EINTR. */
void http_wake(http_conn_t *h);

/* One exchange (the body goes with a Content-Length unless it is a body-less GET). 0: a whole reply, or one the callback stopped. Else -ETIMEDOUT, -EINTR,
 * -ECONNREFUSED or -EHOSTUNREACH (no connection), -EIO (the connection failed or closed
 * mid-reply), -EPROTO (the reply is not HTTP/1.x), -ENOMEM; err says which, in words. */
int http_post(http_conn_t *h, const http_req_t *rq, http_res_t *res, char *err, size_t errlen);

#endif
