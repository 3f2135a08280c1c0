/* http: the small HTTP/1.1 client under the etcd client (API and why in http.h).
 *
 * The socket stays in blocking mode, as net_connect_once makes it; every send and recv here is
 * MSG_DONTWAIT after a poll on the socket and the wake eventfd, so a deadline or a wake ends
 * a call whatever the peer does. */
#include "common/http.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/err.h"
#include "common/net.h"

#define HEAD_MAX (64u << 10) /* status line and headers, bytes */
#define LINE_MAX_ 256        /* a chunk-size or trailer line, bytes */

int http_init(http_conn_t *h) {
  h->fd = -1;
  h->peer = -1;
  h->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return h->wake < 0 ? -ENOMEM : 0;
}

static void drop(http_conn_t *h) {
  if (h->fd >= 0) close(h->fd);
  h->fd = -1;
  h->peer = -1;
}

void http_close(http_conn_t *h) {
  drop(h);
  if (h->wake >= 0) close(h->wake);
  h->wake = -1;
}

void http_wake(http_conn_t *h) {
  uint64_t one = 1;
  if (write(h->wake, &one, sizeof one) < 0) { /* the counter is full: it was woken already */
  }
}

static int woken(const http_conn_t *h) {
  struct pollfd p = {.fd = h->wake, .events = POLLIN};
  return poll(&p, 1, 0) > 0;
}

/* Until h->fd is ready for events: 0, -ETIMEDOUT (res->early when the early deadline passed),
 * -EINTR (woken), or -errno. */
static int wait_fd(const http_conn_t *h, const http_req_t *rq, http_res_t *res, short events) {
  for (;;) {
    int64_t dl = rq->deadline, now = net_now_ms();
    int early = rq->early && *rq->early > 0 && *rq->early < dl;
    if (early) dl = *rq->early;
    if (now >= dl) {
      res->early = early;
      return -ETIMEDOUT;
    }
    struct pollfd p[2] = {{.fd = h->fd, .events = events}, {.fd = h->wake, .events = POLLIN}};
    int n = poll(p, 2, (int)(dl - now));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    if (p[1].revents) return -EINTR;
    if (p[0].revents) return 0;
  }
}

/* A kept connection the peer has closed (or written to unasked) is no use: readable while idle. */
static int stale(const http_conn_t *h) {
  struct pollfd p = {.fd = h->fd, .events = POLLIN | POLLRDHUP};
  return poll(&p, 1, 0) != 0;
}

static int send_all(http_conn_t *h, const http_req_t *rq, http_res_t *res, const char *p, size_t len) {
  while (len) {
    ssize_t n = send(h->fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n, len -= (size_t)n, res->sent += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
    int rc = wait_fd(h, rq, res, POLLOUT);
    if (rc) return rc;
  }
  return 0;
}

/* --- the reply's body: Content-Length, chunked, or up to the close. */

enum { BODY_LEN, BODY_CHUNKED, BODY_EOF };
enum { CH_SIZE, CH_DATA, CH_DATA_END, CH_TRAILER };

typedef struct {
  int mode, chunk;     /* BODY_*, and CH_* for chunked */
  uint64_t left;       /* bytes left: of the body (LEN) or of the chunk (CH_DATA) */
  char line[LINE_MAX_];
  size_t ll;
  int done, stopped;
} body_t;

static void deliver(body_t *b, const http_req_t *rq, const char *p, size_t n) {
  if (n && rq->on_data && rq->on_data(rq->arg, p, n)) b->stopped = 1;
}

/* One line of chunked framing, complete in b->line (without its "\n"). */
static int chunk_line(body_t *b) {
  size_t n = b->ll;
  if (n && b->line[n - 1] == '\r') n--;
  b->line[n] = 0;
  b->ll = 0;
  if (b->chunk == CH_TRAILER) {
    if (n == 0) b->done = 1; /* the empty line after the trailers */
    return 0;
  }
  if (b->chunk == CH_DATA_END) {
    if (n) return -EPROTO; /* data longer than its chunk size said */
    b->chunk = CH_SIZE;
    return 0;
  }
  char *end;
  errno = 0;
  unsigned long long sz = strtoull(b->line, &end, 16);
  if (end == b->line || errno || (*end && *end != ';' && *end != ' ' && *end != '\t')) return -EPROTO;
  b->left = sz;
  b->chunk = sz ? CH_DATA : CH_TRAILER;
  return 0;
}

/* Feeds n bytes of the body; 0 or -EPROTO. Stops taking bytes once done or stopped. */
static int feed(body_t *b, const http_req_t *rq, const char *p, size_t n) {
  if (b->mode == BODY_EOF) {
    deliver(b, rq, p, n);
    return 0;
  }
  if (b->mode == BODY_LEN) {
    size_t k = n < b->left ? n : (size_t)b->left;
    b->left -= k;
    deliver(b, rq, p, k);
    if (!b->left) b->done = 1;
    return 0;
  }
  while (n && !b->done && !b->stopped) {
    if (b->chunk == CH_DATA) {
      size_t k = n < b->left ? n : (size_t)b->left;
      deliver(b, rq, p, k);
      p += k, n -= k, b->left -= k;
      if (!b->left) b->chunk = CH_DATA_END;
      continue;
    }
    const char *nl = memchr(p, '\n', n);
    size_t k = nl ? (size_t)(nl - p) : n;
    if (b->ll + k >= sizeof b->line) return -EPROTO;
    memcpy(b->line + b->ll, p, k);
    b->ll += k;
    p += k, n -= k;
    if (nl) {
      p++, n--;
      int rc = chunk_line(b);
      if (rc) return rc;
    }
  }
  return 0;
}

/* --- the status line and headers. */

/* The value of header name in the block [p, end), or NULL; *len gets its length. */
static const char *header(const char *p, const char *end, const char *name, size_t *len) {
  size_t nl = strlen(name);
  while (p < end) {
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    if (!eol) eol = end;
    if ((size_t)(eol - p) > nl && p[nl] == ':' && !strncasecmp(p, name, nl)) {
      const char *v = p + nl + 1, *e = eol;
      while (v < e && (*v == ' ' || *v == '\t')) v++;
      while (e > v && (e[-1] == '\r' || e[-1] == ' ' || e[-1] == '\t')) e--;
      *len = (size_t)(e - v);
      return v;
    }
    p = eol + 1;
  }
  return NULL;
}

static int has_token(const char *v, size_t len, const char *tok) {
  size_t tl = strlen(tok);
  for (size_t i = 0; i + tl <= len; i++)
    if (!strncasecmp(v + i, tok, tl)) return 1;
  return 0;
}

/* Parses the head [p, p+n) (through its blank line) into res->status and b. *keep: whether
 * the connection may serve another request after this reply. 0 or -EPROTO. */
static int parse_head(const char *p, size_t n, http_res_t *res, body_t *b, int *keep) {
  int minor, status;
  if (n < 12 || sscanf(p, "HTTP/1.%1d %3d", &minor, &status) != 2 || status < 100 || status > 999) return -EPROTO;
  res->status = status;
  const char *end = p + n;
  size_t len;
  const char *v;
  *keep = minor >= 1;
  if ((v = header(p, end, "Connection", &len))) {
    if (has_token(v, len, "close")) *keep = 0;
    else if (has_token(v, len, "keep-alive")) *keep = 1;
  }
  memset(b, 0, sizeof *b);
  if ((v = header(p, end, "Transfer-Encoding", &len)) && has_token(v, len, "chunked")) {
    b->mode = BODY_CHUNKED;
  } else if ((v = header(p, end, "Content-Length", &len))) {
    char num[32], *e;
    if (!len || len >= sizeof num) return -EPROTO;
    memcpy(num, v, len);
    num[len] = 0;
    errno = 0;
    unsigned long long cl = strtoull(num, &e, 10);
    if (*e || errno || num[0] == '-') return -EPROTO;
    b->mode = BODY_LEN;
    b->left = cl;
    b->done = cl == 0;
  } else if (status == 204 || status == 304) {
    b->mode = BODY_LEN;
    b->done = 1;
  } else {
    b->mode = BODY_EOF;
    *keep = 0;
  }
  return 0;
}

/* --- one exchange. */

/* Reads and handles the reply on h->fd. *got: bytes of reply received (0: the peer closed
 * before answering, which a caller on a kept connection may retry). */
static int read_reply(http_conn_t *h, const http_req_t *rq, http_res_t *res, size_t *got, int *keep, char *err,
                      size_t errlen) {
  char buf[16384];
  char *head = NULL;
  size_t hlen = 0;
  body_t b;
  int in_body = 0, rc = 0;
  *got = 0;
  *keep = 0;
  for (;;) {
    if ((rc = wait_fd(h, rq, res, POLLIN))) break;
    ssize_t n = recv(h->fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n < 0) {
      rc = -errno;
      err_set(err, errlen, 0, "receiving: %s", strerror(errno));
      break;
    }
    *got += (size_t)n;
    if (n == 0) {
      if (in_body && b.mode == BODY_EOF) b.done = 1;
      else if (!*got) err_set(err, errlen, 0, "the connection closed before a reply");
      else err_set(err, errlen, 0, "the connection closed mid-reply");
      rc = in_body && b.done ? 0 : -EIO;
      break;
    }
    if (in_body) {
      if ((rc = feed(&b, rq, buf, (size_t)n))) goto bad;
    } else {
      if (hlen + (size_t)n > HEAD_MAX) goto bad;
      char *q = realloc(head, hlen + (size_t)n + 1);
      if (!q) {
        rc = -ENOMEM;
        err_set(err, errlen, 0, "out of memory");
        break;
      }
      head = q;
      memcpy(head + hlen, buf, (size_t)n);
      hlen += (size_t)n;
      head[hlen] = 0;
      /* Interim 1xx replies come before the real one: drop them and look again. */
      for (;;) {
        char *blank = strstr(head, "\r\n\r\n");
        if (!blank) break;
        size_t hn = (size_t)(blank - head) + 4;
        if ((rc = parse_head(head, hn, res, &b, keep))) goto bad;
        if (res->status >= 200) {
          in_body = 1;
          if ((rc = feed(&b, rq, head + hn, hlen - hn))) goto bad;
          break;
        }
        memmove(head, head + hn, hlen - hn + 1);
        hlen -= hn;
      }
    }
    if (in_body && (b.done || b.stopped)) break;
  }
  free(head);
  if (!rc && b.stopped && !b.done) *keep = 0; /* the rest of the reply is still coming */
  if (rc == -ETIMEDOUT) err_set(err, errlen, 0, "timed out");
  else if (rc == -EINTR) err_set(err, errlen, 0, "interrupted");
  return rc;
bad:
  free(head);
  err_set(err, errlen, 0, "the reply is not HTTP/1.x%s", in_body ? " (bad chunked framing)" : "");
  return -EPROTO;
}

int http_post(http_conn_t *h, const http_req_t *rq, http_res_t *res, char *err, size_t errlen) {
  memset(res, 0, sizeof *res);
  char *msg = NULL;
  char ep[300];
  net_format_endpoint(ep, sizeof ep, rq->host, rq->port);
  const char *method = rq->method ? rq->method : "POST";
  char length[48] = "";
  if (rq->body_len || strcmp(method, "GET")) snprintf(length, sizeof length, "Content-Length: %zu\r\n", rq->body_len);
  int n = asprintf(&msg, "%s %s HTTP/1.1\r\nHost: %s\r\n%s%s\r\n", method, rq->path, ep, length,
                   rq->headers ? rq->headers : "");
  if (n < 0) return err_set(err, errlen, -ENOMEM, "out of memory");
  char *full = realloc(msg, (size_t)n + rq->body_len);
  if (!full) {
    free(msg);
    return err_set(err, errlen, -ENOMEM, "out of memory");
  }
  if (rq->body_len) memcpy(full + n, rq->body, rq->body_len);
  size_t total = (size_t)n + rq->body_len;
  int rc = 0;
  for (int tries = 0;; tries++) {
    if (woken(h)) {
      rc = err_set(err, errlen, -EINTR, "interrupted");
      break;
    }
    if (h->fd >= 0 && (rq->fresh || h->peer != rq->peer || stale(h))) drop(h);
    int reused = h->fd >= 0;
    if (!reused) {
      int64_t left = rq->deadline - net_now_ms();
      if (left <= 0) {
        rc = err_set(err, errlen, -ETIMEDOUT, "timed out");
        break;
      }
      char cerr[256];
      int fd = net_connect_once(rq->host, rq->port, (int)left, cerr, sizeof cerr);
      if (fd < 0) {
        rc = fd == -ECONNREFUSED || fd == -ETIMEDOUT ? fd : -EHOSTUNREACH;
        const char *why = strstr(cerr, ": "); /* net's message names the endpoint: the caller does */
        err_set(err, errlen, 0, "%s", why ? why + 2 : cerr);
        break;
      }
      h->fd = fd;
      h->peer = rq->peer;
    }
    size_t got = 0;
    int keep = 0;
    rc = send_all(h, rq, res, full, total);
    if (rc == -ETIMEDOUT || rc == -EINTR) err_set(err, errlen, 0, rc == -EINTR ? "interrupted" : "timed out");
    else if (rc) err_set(err, errlen, 0, "sending: %s", strerror(-rc));
    else rc = read_reply(h, rq, res, &got, &keep, err, errlen);
    if (rc || !keep) drop(h);
    /* A kept connection the peer closed as we used it: once more on a new one. */
    if (rc && reused && !got && rc != -ETIMEDOUT && rc != -EINTR && tries == 0) continue;
    if (rc && rc != -ETIMEDOUT && rc != -EINTR && rc != -EPROTO && rc != -ENOMEM) rc = -EIO;
    break;
  }
  free(full);
  return rc;
}
