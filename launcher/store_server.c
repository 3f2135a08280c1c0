/* store_server: meshrun's key-value store on a libuv loop (API in store_server.h, wire format
 * in common/store_proto.h).
 *
 * Each connection reads into one buffer that grows only to the frame being received (never
 * past STORE_MAX_FRAME) and handles whole frames in order. A header is checked as soon as its
 * 8 bytes arrive, so a frame announcing 1 GiB or a foreign magic/version closes that
 * connection before anything is buffered. A waiting request (GET, WAIT, MULTI_GET) parks the
 * connection: its payload is copied, a timer armed, and the connection joins the waiters
 * list; every write to the store rechecks the waiters. While parked a connection handles no
 * further frames (replies must keep request order). Replies that the client does not read
 * pile up to STORE_MAX_FRAME at most, then reading from it stops until they drain.
 * Nothing here blocks, so a client idling with half a frame costs only its buffer.
 * Not here: persistence, authentication, per-client quotas beyond the frame limit. */
#include "launcher/store_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "common/store_proto.h"

#define READ_CHUNK (64u << 10)        /* buffer size for frames up to this size */
#define OUT_LIMIT STORE_MAX_FRAME     /* queued reply bytes that stop reading from a client */
#define LISTEN_BACKLOG 1024
#define MAX_LISTENERS 8 /* one per address the endpoint's host resolves to */

typedef struct entry {
  struct entry *next;
  uint64_t hash;
  size_t klen, vlen;
  uint8_t *val; /* vlen bytes plus a NUL, so ADD can parse it in place */
  uint8_t key[];
} entry_t;

typedef struct {
  entry_t **b;
  size_t nb, n;
  size_t bytes; /* sum of key and value lengths, against STORE_SERVER_MAX_BYTES */
} table_t;

typedef struct conn conn_t;
struct conn {
  uv_tcp_t tcp;
  uv_timer_t timer; /* the parked request's timeout */
  store_server_t *srv;
  conn_t *prev, *next;   /* all live connections */
  conn_t *wprev, *wnext; /* parked connections */
  conn_t *rnext;         /* connections with buffered frames to resume */
  int on_ready, closing, handles_open;
  char peer[64];

  uint8_t *buf; /* received bytes not yet handled: [0, len) of cap */
  size_t len, cap;

  int parked_op; /* 0, or the op of the parked request */
  uint8_t *wpayload; /* owned copy of the parked request's payload */
  const uint8_t **wkeys; /* point into wpayload */
  size_t *wklens;
  size_t nwkeys;

  size_t out_pending; /* bytes handed to uv_write and not yet written */
  int out_paused;     /* reading stopped because out_pending passed OUT_LIMIT */
};

struct store_server {
  uv_loop_t *loop;
  uv_tcp_t listeners[MAX_LISTENERS];
  int nlisteners;
  uv_idle_t idle; /* resumes connections whose parked request was answered */
  int closing, handles_open;
  conn_t *conns, *waiters, *ready;
  size_t nclients, nwaiters;
  table_t tab;
  store_proto_writer_t w; /* scratch for building one reply at a time */
};

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b);
static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b);
static void schedule_ready(conn_t *c);

typedef struct {
  uv_write_t req;
  conn_t *c;
  uint8_t *data;
  size_t len;
} wreq_t;

/* ---- hash table ---------------------------------------------------------------------- */

static uint64_t hash_key(const uint8_t *k, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) {
    h ^= k[i];
    h *= 1099511628211ull;
  }
  return h;
}

static entry_t **tab_slot(table_t *t, const uint8_t *k, size_t n, uint64_t h) {
  if (!t->nb) return NULL;
  entry_t **pp = &t->b[h & (t->nb - 1)];
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->hash == h && (*pp)->klen == n && memcmp((*pp)->key, k, n) == 0) return pp;
  return NULL;
}

static entry_t *tab_find(table_t *t, const uint8_t *k, size_t n) {
  entry_t **pp = tab_slot(t, k, n, hash_key(k, n));
  return pp ? *pp : NULL;
}

static int tab_grow(table_t *t) {
  size_t nb = t->nb ? t->nb * 2 : 64;
  entry_t **b = calloc(nb, sizeof *b);
  if (!b) return STORE_ENOMEM;
  for (size_t i = 0; i < t->nb; i++) {
    for (entry_t *e = t->b[i], *next; e; e = next) {
      next = e->next;
      e->next = b[e->hash & (nb - 1)];
      b[e->hash & (nb - 1)] = e;
    }
  }
  free(t->b);
  t->b = b;
  t->nb = nb;
  return 0;
}

/* Sets key to val; STORE_ENOMEM when memory or the STORE_SERVER_MAX_BYTES budget runs out. */
static int tab_set(table_t *t, const uint8_t *k, size_t kn, const uint8_t *v, size_t vn) {
  uint64_t h = hash_key(k, kn);
  entry_t **pp = tab_slot(t, k, kn, h);
  entry_t *e = pp ? *pp : NULL;
  size_t old = e ? e->klen + e->vlen : 0;
  if (t->bytes - old + kn + vn > STORE_SERVER_MAX_BYTES) return STORE_ENOMEM;
  uint8_t *nv = malloc(vn + 1);
  if (!nv) return STORE_ENOMEM;
  if (vn) memcpy(nv, v, vn);
  nv[vn] = 0;
  if (!e) {
    if (t->n >= t->nb && tab_grow(t)) {
      free(nv);
      return STORE_ENOMEM;
    }
    e = malloc(sizeof *e + kn);
    if (!e) {
      free(nv);
      return STORE_ENOMEM;
    }
    e->hash = h;
    e->klen = kn;
    memcpy(e->key, k, kn);
    e->val = NULL;
    e->vlen = 0;
    e->next = t->b[h & (t->nb - 1)];
    t->b[h & (t->nb - 1)] = e;
    t->n++;
  }
  free(e->val);
  e->val = nv;
  e->vlen = vn;
  t->bytes = t->bytes - old + kn + vn;
  return 0;
}

static int tab_del(table_t *t, const uint8_t *k, size_t kn) {
  entry_t **pp = tab_slot(t, k, kn, hash_key(k, kn));
  if (!pp) return 0;
  entry_t *e = *pp;
  *pp = e->next;
  t->bytes -= e->klen + e->vlen;
  t->n--;
  free(e->val);
  free(e);
  return 1;
}

static void tab_free(table_t *t) {
  for (size_t i = 0; i < t->nb; i++) {
    for (entry_t *e = t->b[i], *next; e; e = next) {
      next = e->next;
      free(e->val);
      free(e);
    }
  }
  free(t->b);
  memset(t, 0, sizeof *t);
}

/* ---- connection lifetime ------------------------------------------------------------- */

static void server_maybe_free(store_server_t *srv) {
  if (!srv->closing || srv->handles_open > 0 || srv->conns) return;
  tab_free(&srv->tab);
  store_proto_writer_free(&srv->w);
  free(srv);
}

static void free_wait(conn_t *c) {
  free(c->wpayload);
  free(c->wkeys);
  free(c->wklens);
  c->wpayload = NULL;
  c->wkeys = NULL;
  c->wklens = NULL;
  c->nwkeys = 0;
}

static void unpark(conn_t *c) {
  store_server_t *srv = c->srv;
  if (!c->parked_op) return;
  if (c->wprev) c->wprev->wnext = c->wnext;
  else srv->waiters = c->wnext;
  if (c->wnext) c->wnext->wprev = c->wprev;
  c->wprev = c->wnext = NULL;
  srv->nwaiters--;
  c->parked_op = 0;
  free_wait(c);
  if (!c->closing) uv_timer_stop(&c->timer);
}

static void conn_handle_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  if (--c->handles_open > 0) return;
  store_server_t *srv = c->srv;
  free(c->buf);
  free(c);
  srv->handles_open--;
  server_maybe_free(srv);
}

static void conn_close(conn_t *c, const char *why) {
  if (c->closing) return;
  store_server_t *srv = c->srv;
  if (why) log_debug("store: closing client %s: %s", c->peer, why);
  unpark(c);
  c->closing = 1;
  if (c->on_ready) {
    for (conn_t **pp = &srv->ready; *pp; pp = &(*pp)->rnext) {
      if (*pp == c) {
        *pp = c->rnext;
        break;
      }
    }
    c->on_ready = 0;
  }
  if (c->prev) c->prev->next = c->next;
  else srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  srv->nclients--;
  /* The conn stays allocated (off every list) until both handles report closed. */
  srv->handles_open++;
  uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
  uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

/* ---- replies ------------------------------------------------------------------------- */

static void on_write(uv_write_t *req, int status) {
  wreq_t *wr = (wreq_t *)req;
  conn_t *c = wr->c;
  c->out_pending -= wr->len;
  free(wr->data);
  free(wr);
  if (c->closing) return;
  if (status < 0) {
    conn_close(c, uv_strerror(status));
    return;
  }
  if (c->out_paused && c->out_pending <= OUT_LIMIT / 2) {
    /* The client caught up: read again and handle what was buffered meanwhile. */
    c->out_paused = 0;
    int err = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (err < 0) {
      conn_close(c, uv_strerror(err));
      return;
    }
    if (c->len) schedule_ready(c);
  }
}

static void send_error(conn_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Sends the frame in srv->w (an ERROR instead if it could not be built). The buffer moves to
 * the write request, so the writer starts empty next time. */
static void send_reply(conn_t *c) {
  store_server_t *srv = c->srv;
  store_proto_writer_t *w = &srv->w;
  int rc = store_proto_finish(w);
  if (rc) {
    if (rc == STORE_ETOOBIG) send_error(c, rc, "reply over the %u-byte frame limit", STORE_MAX_FRAME);
    else send_error(c, rc, "out of memory building a reply");
    return;
  }
  if (c->closing) return;
  wreq_t *wr = malloc(sizeof *wr);
  if (!wr) {
    conn_close(c, "out of memory for a reply");
    return;
  }
  wr->c = c;
  wr->data = w->buf;
  wr->len = w->len;
  w->buf = NULL;
  w->len = w->cap = 0;
  uv_buf_t b = uv_buf_init((char *)wr->data, (unsigned)wr->len);
  c->out_pending += wr->len;
  int err = uv_write(&wr->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
  if (err < 0) {
    c->out_pending -= wr->len;
    free(wr->data);
    free(wr);
    conn_close(c, uv_strerror(err));
    return;
  }
  if (c->out_pending > OUT_LIMIT && !c->out_paused) {
    c->out_paused = 1;
    uv_read_stop((uv_stream_t *)&c->tcp);
  }
}

static void send_error(conn_t *c, int code, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  store_proto_writer_t *w = &c->srv->w;
  store_proto_begin(w, STORE_REP_ERROR);
  store_proto_put_i64(w, code);
  store_proto_put_bytes(w, msg, strlen(msg));
  if (store_proto_finish(w)) {
    conn_close(c, "out of memory for an error reply");
    return;
  }
  send_reply(c);
}

static void send_empty(conn_t *c, int op) {
  store_proto_begin(&c->srv->w, op);
  send_reply(c);
}

static void send_int(conn_t *c, int64_t v) {
  store_proto_begin(&c->srv->w, STORE_REP_INT);
  store_proto_put_i64(&c->srv->w, v);
  send_reply(c);
}

static void send_value(conn_t *c, const entry_t *e) {
  store_proto_begin(&c->srv->w, STORE_REP_VALUE);
  store_proto_put_bytes(&c->srv->w, e->val, e->vlen);
  send_reply(c);
}

/* ---- waiting ------------------------------------------------------------------------- */

static int all_exist(store_server_t *srv, const uint8_t *const *keys, const size_t *lens, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!tab_find(&srv->tab, keys[i], lens[i])) return 0;
  return 1;
}

/* Answers a waiting request whose keys all exist now. */
static void answer_wait(conn_t *c, int op, const uint8_t *const *keys, const size_t *lens, size_t n) {
  store_server_t *srv = c->srv;
  if (op == STORE_OP_WAIT) {
    send_empty(c, STORE_REP_OK);
  } else if (op == STORE_OP_GET) {
    send_value(c, tab_find(&srv->tab, keys[0], lens[0]));
  } else {
    store_proto_begin(&srv->w, STORE_REP_VALUES);
    store_proto_put_u32(&srv->w, (uint32_t)n);
    for (size_t i = 0; i < n; i++) {
      const entry_t *e = tab_find(&srv->tab, keys[i], lens[i]);
      store_proto_put_bytes(&srv->w, e->val, e->vlen);
    }
    send_reply(c);
  }
}

/* After a write to the store: answers every parked request whose keys now all exist. */
static void wake_waiters(store_server_t *srv) {
  for (conn_t *c = srv->waiters, *next; c; c = next) {
    next = c->wnext;
    if (!all_exist(srv, c->wkeys, c->wklens, c->nwkeys)) continue;
    answer_wait(c, c->parked_op, c->wkeys, c->wklens, c->nwkeys);
    unpark(c);
    if (!c->closing && c->len) schedule_ready(c);
  }
}

static void on_wait_timeout(uv_timer_t *t) {
  conn_t *c = t->data;
  if (!c->parked_op || c->closing) return;
  unpark(c);
  send_empty(c, STORE_REP_TIMEOUT);
  if (!c->closing && c->len) schedule_ready(c);
}

/* Parks c on a request whose keys are not all there yet. Keys are re-pointed into an owned
 * copy of the payload, since the read buffer moves. */
static void park(conn_t *c, int op, const uint8_t *payload, size_t plen, const uint8_t *const *keys,
                 const size_t *lens, size_t n, int64_t timeout_ms) {
  c->wpayload = malloc(plen ? plen : 1);
  c->wkeys = malloc((n ? n : 1) * sizeof *c->wkeys);
  c->wklens = malloc((n ? n : 1) * sizeof *c->wklens);
  if (!c->wpayload || !c->wkeys || !c->wklens) {
    free_wait(c);
    send_error(c, STORE_ENOMEM, "out of memory parking a %s", store_proto_op_name(op));
    return;
  }
  memcpy(c->wpayload, payload, plen);
  for (size_t i = 0; i < n; i++) {
    c->wkeys[i] = c->wpayload + (keys[i] - payload);
    c->wklens[i] = lens[i];
  }
  c->nwkeys = n;
  c->parked_op = op;
  store_server_t *srv = c->srv;
  c->wprev = NULL;
  c->wnext = srv->waiters;
  if (srv->waiters) srv->waiters->wprev = c;
  srv->waiters = c;
  srv->nwaiters++;
  if (timeout_ms >= 0) uv_timer_start(&c->timer, on_wait_timeout, (uint64_t)timeout_ms, 0);
}

/* ---- requests ------------------------------------------------------------------------ */

/* Reads a key; returns 0, or sends an error reply / closes and returns -1. */
static int get_key(conn_t *c, store_proto_reader_t *r, const uint8_t **k, size_t *kn) {
  *k = store_proto_get_bytes(r, kn);
  if (r->bad) return 0; /* reported by the caller's reader_done check */
  if (*kn == 0) {
    send_error(c, STORE_EINVAL, "empty key");
    return -1;
  }
  if (*kn > STORE_MAX_KEY) {
    send_error(c, STORE_ETOOBIG, "key of %zu bytes is over the limit of %d", *kn, STORE_MAX_KEY);
    return -1;
  }
  return 0;
}

static void store_err(conn_t *c, int rc, const uint8_t *k, size_t kn) {
  store_server_t *srv = c->srv;
  if (rc == STORE_ENOMEM && srv->tab.bytes + kn <= STORE_SERVER_MAX_BYTES)
    send_error(c, rc, "out of memory storing '%.*s'", (int)(kn > 80 ? 80 : kn), (const char *)k);
  else
    send_error(c, rc, "store full: %zu of %zu bytes used; refusing '%.*s'", srv->tab.bytes,
               (size_t)STORE_SERVER_MAX_BYTES, (int)(kn > 80 ? 80 : kn), (const char *)k);
}

/* Parses the decimal integer stored at e (absent: 0). */
static int parse_int(const entry_t *e, int64_t *v) {
  if (!e) {
    *v = 0;
    return 0;
  }
  if (e->vlen == 0 || e->vlen > 20) return -1;
  char *end;
  errno = 0;
  long long x = strtoll((const char *)e->val, &end, 10);
  if (errno || end != (const char *)e->val + e->vlen || ((const char *)e->val)[0] == ' ' ||
      ((const char *)e->val)[0] == '+')
    return -1;
  *v = x;
  return 0;
}

/* Handles a key list "u32 n, n x bytes"; on success the key and length arrays are malloc'ed. */
static int get_keys(conn_t *c, store_proto_reader_t *r, const uint8_t ***keys, size_t **lens, size_t *n) {
  uint32_t cnt = store_proto_get_u32(r);
  *keys = NULL;
  *lens = NULL;
  *n = 0;
  if (r->bad) return 0;
  /* Each key takes at least 4 bytes, so a count the payload cannot hold is malformed. */
  if ((size_t)cnt > (r->len - r->off) / 4) {
    r->bad = 1;
    return 0;
  }
  *keys = malloc((cnt ? cnt : 1) * sizeof **keys);
  *lens = malloc((cnt ? cnt : 1) * sizeof **lens);
  if (!*keys || !*lens) {
    free(*keys);
    free(*lens);
    *keys = NULL;
    *lens = NULL;
    send_error(c, STORE_ENOMEM, "out of memory for %u keys", cnt);
    return -1;
  }
  for (uint32_t i = 0; i < cnt; i++) {
    if (get_key(c, r, &(*keys)[i], &(*lens)[i])) {
      free(*keys);
      free(*lens);
      *keys = NULL;
      *lens = NULL;
      return -1;
    }
    if (r->bad) break;
  }
  *n = cnt;
  return 0;
}

/* Handles one request frame. Malformed payloads close the connection. */
static void handle(conn_t *c, int op, const uint8_t *p, size_t plen) {
  store_server_t *srv = c->srv;
  store_proto_reader_t r;
  store_proto_reader_init(&r, p, plen);
  const uint8_t *k = NULL, *v, *v2;
  size_t kn = 0, vn, vn2;
  const uint8_t **keys = NULL;
  size_t *lens = NULL, n = 0;
  int64_t i64;
  int rc;
  entry_t *e;

#define DONE_OR_CLOSE()                                                                       \
  do {                                                                                        \
    if (!store_proto_reader_done(&r)) {                                                       \
      free(keys);                                                                             \
      free(lens);                                                                             \
      conn_close(c, "malformed request payload");                                             \
      return;                                                                                 \
    }                                                                                         \
  } while (0)

  switch (op) {
  case STORE_OP_HELLO:
    v = store_proto_get_bytes(&r, &vn);
    DONE_OR_CLOSE();
    if (vn != strlen(STORE_PROTO_BANNER) || memcmp(v, STORE_PROTO_BANNER, vn) != 0) {
      conn_close(c, "bad HELLO banner");
      return;
    }
    store_proto_begin(&srv->w, STORE_REP_HELLO);
    store_proto_put_bytes(&srv->w, STORE_PROTO_BANNER, strlen(STORE_PROTO_BANNER));
    send_reply(c);
    return;

  case STORE_OP_SET:
    if (get_key(c, &r, &k, &kn)) return;
    v = store_proto_get_bytes(&r, &vn);
    DONE_OR_CLOSE();
    if ((rc = tab_set(&srv->tab, k, kn, v, vn))) {
      store_err(c, rc, k, kn);
      return;
    }
    send_empty(c, STORE_REP_OK);
    wake_waiters(srv);
    return;

  case STORE_OP_GET:
  case STORE_OP_GET_NOWAIT:
    if (get_key(c, &r, &k, &kn)) return;
    i64 = op == STORE_OP_GET ? store_proto_get_i64(&r) : 0;
    DONE_OR_CLOSE();
    if ((e = tab_find(&srv->tab, k, kn))) send_value(c, e);
    else if (op == STORE_OP_GET_NOWAIT) send_empty(c, STORE_REP_NOKEY);
    else if (i64 == 0) send_empty(c, STORE_REP_TIMEOUT);
    else park(c, op, p, plen, &k, &kn, 1, i64);
    return;

  case STORE_OP_ADD:
    if (get_key(c, &r, &k, &kn)) return;
    i64 = store_proto_get_i64(&r);
    DONE_OR_CLOSE();
    {
      int64_t cur, sum;
      e = tab_find(&srv->tab, k, kn);
      if (parse_int(e, &cur)) {
        send_error(c, STORE_EINVAL, "add '%.*s': stored value is not a decimal integer", (int)(kn > 80 ? 80 : kn),
                   (const char *)k);
        return;
      }
      if (__builtin_add_overflow(cur, i64, &sum)) {
        send_error(c, STORE_EINVAL, "add '%.*s': %lld + %lld overflows", (int)(kn > 80 ? 80 : kn), (const char *)k,
                   (long long)cur, (long long)i64);
        return;
      }
      char txt[32];
      int tn = snprintf(txt, sizeof txt, "%lld", (long long)sum);
      if ((rc = tab_set(&srv->tab, k, kn, (const uint8_t *)txt, (size_t)tn))) {
        store_err(c, rc, k, kn);
        return;
      }
      send_int(c, sum);
    }
    wake_waiters(srv);
    return;

  case STORE_OP_CAS: {
    if (get_key(c, &r, &k, &kn)) return;
    uint8_t expect_absent = store_proto_get_u8(&r);
    v = store_proto_get_bytes(&r, &vn);
    v2 = store_proto_get_bytes(&r, &vn2);
    DONE_OR_CLOSE();
    e = tab_find(&srv->tab, k, kn);
    int swap = expect_absent ? !e : (e && e->vlen == vn && memcmp(e->val, v, vn) == 0);
    if (swap) {
      if ((rc = tab_set(&srv->tab, k, kn, v2, vn2))) {
        store_err(c, rc, k, kn);
        return;
      }
      e = tab_find(&srv->tab, k, kn);
    }
    if (e) send_value(c, e);
    else send_empty(c, STORE_REP_NOKEY);
    if (swap) wake_waiters(srv);
    return;
  }

  case STORE_OP_WAIT:
  case STORE_OP_MULTI_GET:
    i64 = store_proto_get_i64(&r);
    if (get_keys(c, &r, &keys, &lens, &n)) return;
    DONE_OR_CLOSE();
    if (all_exist(srv, keys, lens, n)) answer_wait(c, op, keys, lens, n);
    else if (i64 == 0) send_empty(c, STORE_REP_TIMEOUT);
    else park(c, op, p, plen, keys, lens, n, i64);
    free(keys);
    free(lens);
    return;

  case STORE_OP_CHECK:
    if (get_keys(c, &r, &keys, &lens, &n)) return;
    DONE_OR_CLOSE();
    send_int(c, all_exist(srv, keys, lens, n));
    free(keys);
    free(lens);
    return;

  case STORE_OP_DELETE:
    if (get_key(c, &r, &k, &kn)) return;
    DONE_OR_CLOSE();
    send_int(c, tab_del(&srv->tab, k, kn));
    return;

  case STORE_OP_MULTI_SET: {
    uint32_t cnt = store_proto_get_u32(&r);
    size_t total = 0;
    /* Validate the whole request first so that a bad entry sets nothing. */
    for (uint32_t i = 0; i < cnt && !r.bad; i++) {
      if (get_key(c, &r, &k, &kn)) return;
      store_proto_get_bytes(&r, &vn);
      total += kn + vn;
    }
    DONE_OR_CLOSE();
    if (srv->tab.bytes + total > STORE_SERVER_MAX_BYTES) {
      send_error(c, STORE_ENOMEM, "store full: %zu of %zu bytes used; refusing a multi_set of %zu bytes",
                 srv->tab.bytes, (size_t)STORE_SERVER_MAX_BYTES, total);
      return;
    }
    store_proto_reader_init(&r, p, plen);
    store_proto_get_u32(&r);
    for (uint32_t i = 0; i < cnt; i++) {
      k = store_proto_get_bytes(&r, &kn);
      v = store_proto_get_bytes(&r, &vn);
      if ((rc = tab_set(&srv->tab, k, kn, v, vn))) {
        store_err(c, rc, k, kn);
        wake_waiters(srv);
        return;
      }
    }
    send_empty(c, STORE_REP_OK);
    wake_waiters(srv);
    return;
  }

  case STORE_OP_NUM_KEYS:
    DONE_OR_CLOSE();
    send_int(c, (int64_t)srv->tab.n);
    return;

  default:
    conn_close(c, "unknown op");
    return;
  }
#undef DONE_OR_CLOSE
}

/* Handles every whole frame in c's buffer, in order, until one parks or output backs up. */
static void conn_process(conn_t *c) {
  size_t off = 0;
  while (!c->closing && !c->parked_op && !c->out_paused && c->len - off >= STORE_PROTO_HEADER) {
    uint32_t flen;
    int op;
    char why[160];
    if (store_proto_parse_header(c->buf + off, 1, &flen, &op, why, sizeof why)) {
      conn_close(c, why);
      return;
    }
    if (c->len - off < flen) break;
    handle(c, op, c->buf + off + STORE_PROTO_HEADER, flen - STORE_PROTO_HEADER);
    off += flen;
  }
  if (c->closing) return;
  if (off) {
    memmove(c->buf, c->buf + off, c->len - off);
    c->len -= off;
  }
  /* Give back a buffer grown for a big frame once it is no longer needed. */
  if (c->cap > READ_CHUNK && c->len <= READ_CHUNK) {
    uint8_t *nb = realloc(c->buf, READ_CHUNK);
    if (nb) {
      c->buf = nb;
      c->cap = READ_CHUNK;
    }
  }
}

static void on_idle(uv_idle_t *h) {
  store_server_t *srv = h->data;
  while (srv->ready) {
    conn_t *c = srv->ready;
    srv->ready = c->rnext;
    c->on_ready = 0;
    conn_process(c);
  }
  uv_idle_stop(&srv->idle);
}

static void schedule_ready(conn_t *c) {
  store_server_t *srv = c->srv;
  if (c->on_ready || c->closing) return;
  c->on_ready = 1;
  c->rnext = srv->ready;
  srv->ready = c;
  uv_idle_start(&srv->idle, on_idle);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b) {
  conn_t *c = h->data;
  size_t need = READ_CHUNK;
  /* Grow only for the frame being received, once its header is known good; a parked client
   * has no business sending more than a small chunk. */
  uint32_t flen;
  int op;
  char why[160];
  if (!c->parked_op && c->len >= STORE_PROTO_HEADER &&
      store_proto_parse_header(c->buf, 1, &flen, &op, why, sizeof why) == 0 && flen > need)
    need = flen;
  if (need > c->cap) {
    uint8_t *nb = realloc(c->buf, need);
    if (nb) {
      c->buf = nb;
      c->cap = need;
    }
  }
  /* A full buffer (frames pipelined behind a parked request) yields UV_ENOBUFS in on_read. */
  *b = uv_buf_init((char *)c->buf + c->len, (unsigned)(c->cap - c->len));
  if (!c->buf) b->len = 0;
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  conn_t *c = s->data;
  if (n < 0) {
    conn_close(c, n == UV_EOF ? NULL : n == UV_ENOBUFS ? "pipelined past one frame while waiting" : uv_strerror((int)n));
    return;
  }
  c->len += (size_t)n;
  conn_process(c);
}

/* ---- listening ----------------------------------------------------------------------- */

static void on_connection(uv_stream_t *l, int status) {
  store_server_t *srv = l->data;
  if (status < 0 || srv->closing) {
    if (status < 0) log_warn("store: accept: %s", uv_strerror(status));
    return;
  }
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    log_warn("store: out of memory accepting a client");
    return;
  }
  c->srv = srv;
  c->tcp.data = c;
  c->timer.data = c;
  uv_tcp_init(srv->loop, &c->tcp);
  uv_timer_init(srv->loop, &c->timer);
  c->handles_open = 2;
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  srv->nclients++;
  snprintf(c->peer, sizeof c->peer, "(unknown)");
  int err = uv_accept(l, (uv_stream_t *)&c->tcp);
  if (err < 0) {
    conn_close(c, uv_strerror(err));
    return;
  }
  struct sockaddr_storage ss;
  int sl = sizeof ss;
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &sl) == 0) {
    char ip[48] = "?";
    int port = 0;
    if (ss.ss_family == AF_INET) {
      uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
      port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
      port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    net_format_endpoint(c->peer, sizeof c->peer, ip, port);
  }
  uv_tcp_nodelay(&c->tcp, 1);
  err = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  if (err < 0) conn_close(c, uv_strerror(err));
}

static void server_handle_closed(uv_handle_t *h) {
  store_server_t *srv = h->data;
  srv->handles_open--;
  server_maybe_free(srv);
}

int store_server_start(store_server_t **out, uv_loop_t *loop, const char *host, int port, int *bound_port,
                       char *err, size_t errlen) {
  *out = NULL;
  int bp = 0, fds[MAX_LISTENERS];
  /* net_listen_all does the address work (dual-stack "any"; every address a name resolves to,
   * so clients meet us whichever they try first; EADDRINUSE when the endpoint is taken);
   * libuv then adopts the sockets. */
  int nfd = net_listen_all(host, port, LISTEN_BACKLOG, fds, MAX_LISTENERS, &bp, err, errlen);
  if (nfd < 0) return nfd == -EADDRINUSE ? STORE_SERVER_EADDRINUSE : nfd;
  store_server_t *srv = calloc(1, sizeof *srv);
  if (!srv) {
    for (int i = 0; i < nfd; i++) close(fds[i]);
    snprintf(err, errlen, "store server: out of memory");
    return -ENOMEM;
  }
  srv->loop = loop;
  srv->idle.data = srv;
  uv_idle_init(loop, &srv->idle);
  srv->handles_open = 1 + nfd;
  srv->nlisteners = nfd;
  int rc = 0;
  for (int i = 0; i < nfd; i++) {
    srv->listeners[i].data = srv;
    uv_tcp_init(loop, &srv->listeners[i]);
    /* Once adopted, closing the handle closes the fd; before, it is ours to close. */
    int orc = rc ? rc : uv_tcp_open(&srv->listeners[i], fds[i]);
    if (orc) {
      close(fds[i]);
      rc = orc;
      continue;
    }
    rc = uv_listen((uv_stream_t *)&srv->listeners[i], LISTEN_BACKLOG, on_connection);
  }
  if (rc < 0) {
    char ep[300];
    net_format_endpoint(ep, sizeof ep, host && *host ? host : "*", bp);
    snprintf(err, errlen, "store server: listen %s: %s", ep, uv_strerror(rc));
    /* The handles are released by their close callbacks on the next loop run. */
    srv->closing = 1;
    for (int i = 0; i < nfd; i++) uv_close((uv_handle_t *)&srv->listeners[i], server_handle_closed);
    uv_close((uv_handle_t *)&srv->idle, server_handle_closed);
    return rc;
  }
  if (bound_port) *bound_port = bp;
  *out = srv;
  return 0;
}

void store_server_close(store_server_t *srv) {
  if (!srv || srv->closing) return;
  srv->closing = 1;
  while (srv->conns) conn_close(srv->conns, NULL);
  srv->ready = NULL;
  for (int i = 0; i < srv->nlisteners; i++) uv_close((uv_handle_t *)&srv->listeners[i], server_handle_closed);
  uv_close((uv_handle_t *)&srv->idle, server_handle_closed);
}

size_t store_server_num_clients(const store_server_t *srv) { return srv ? srv->nclients : 0; }
size_t store_server_num_keys(const store_server_t *srv) { return srv ? srv->tab.n : 0; }
size_t store_server_num_waiters(const store_server_t *srv) { return srv ? srv->nwaiters : 0; }
