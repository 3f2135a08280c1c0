/* store: the blocking store client (API in store.h, wire format in store_proto.h).
 *
 * One TCP connection, one request in flight. store_connect shakes hands first (HELLO with our
 * run id, then AUTH when the store has a secret; store_proto.h has the exchange), so that a
 * port held by some other program, or by another job's store, is reported as such instead of
 * failing later in odd ways. The secret is used for the proofs and not kept.
 * Waits are timed on the server (the request carries timeout_ms and the server answers
 * TIMEOUT); the client also bounds every reply by a deadline a little longer than that
 * (CLIENT_SLACK_MS), and TCP keepalive covers waits without a timeout, so a dead server never
 * hangs a caller. After a lost, late or garbled reply the connection is out of step and every
 * later call fails with the first cause; the caller reconnects. Not thread-safe per store_t. */
#include "common/store.h"

#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/net.h"
#include "common/store_proto.h"

/* Extra time the client grants the server beyond a wait's own timeout before giving up. */
#define CLIENT_SLACK_MS 5000
/* Deadline for replies to requests that never wait (SET, ADD, ...). */
#define CLIENT_OP_TIMEOUT_MS 60000
/* Deadline for the handshake when connect was given no timeout. */
#define CLIENT_HELLO_TIMEOUT_MS 30000
/* Pause between tries at a store that answered STORE_EBUSY: doubles up to the second. */
#define CLIENT_BUSY_RETRY_MS 50
#define CLIENT_BUSY_RETRY_MAX_MS 1000

struct store {
  int fd;
  int broken; /* the stream is out of step; holds the STORE_E* that broke it */
  char ep[300];
  char err[512];
  char detail[200]; /* why the last reply was not our protocol (for the handshake message) */
  char job[STORE_MAX_RUN_ID + 1]; /* run id of the job that owns the store (from its HELLO) */
  store_proto_writer_t w;
  uint8_t *reply; /* payload of the last reply (owned; freed by the next request) */
  size_t reply_len;
};

static void seterr(store_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void seterr(store_t *s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->err, sizeof s->err, fmt, ap);
  va_end(ap);
}

const char *store_strerror(int code) {
  switch (code) {
  case STORE_OK: return "success";
  case STORE_EINVAL: return "invalid argument";
  case STORE_ECONNECT: return "cannot connect to the store";
  case STORE_EIO: return "connection to the store lost";
  case STORE_EPROTO: return "peer does not speak the store protocol";
  case STORE_ETIMEDOUT: return "timed out";
  case STORE_ENOKEY: return "no such key";
  case STORE_ETOOBIG: return "key or value too big";
  case STORE_ENOMEM: return "out of memory";
  case STORE_EAUTH: return "the store refused this job, or this job refused the store";
  case STORE_EBUSY: return "the store is at one of its limits";
  default: return "unknown store error";
  }
}

const char *store_errmsg(const store_t *s) { return s ? s->err : "no store"; }

static int check_key(store_t *s, const char *key) {
  if (!key) {
    seterr(s, "key is NULL");
    return STORE_EINVAL;
  }
  size_t n = strlen(key);
  if (n == 0) {
    seterr(s, "key is empty");
    return STORE_EINVAL;
  }
  if (n > STORE_MAX_KEY) {
    seterr(s, "key '%.40s...' is %zu bytes, over the limit of %d", key, n, STORE_MAX_KEY);
    return STORE_ETOOBIG;
  }
  return 0;
}

static int check_keys(store_t *s, const char *const *keys, size_t nkeys) {
  if (nkeys && !keys) {
    seterr(s, "keys is NULL");
    return STORE_EINVAL;
  }
  if (nkeys > UINT32_MAX) {
    seterr(s, "%zu keys is too many", nkeys);
    return STORE_ETOOBIG;
  }
  for (size_t i = 0; i < nkeys; i++) {
    int rc = check_key(s, keys[i]);
    if (rc) return rc;
  }
  return 0;
}

static void put_key(store_t *s, const char *key) { store_proto_put_bytes(&s->w, key, strlen(key)); }

static void put_keys(store_t *s, const char *const *keys, size_t nkeys) {
  store_proto_put_u32(&s->w, (uint32_t)nkeys);
  for (size_t i = 0; i < nkeys; i++) put_key(s, keys[i]);
}

static int mark_broken(store_t *s, int code) {
  s->broken = code;
  return code;
}

/* Receives at least min and at most n bytes before deadline (< 0: none), mapping failures to
 * store codes; *got gets the count. */
static int recv_until(store_t *s, void *buf, size_t min, size_t n, int64_t deadline, size_t *got, int *sys) {
  int left = -1;
  if (deadline >= 0) {
    int64_t l = deadline - net_now_ms();
    left = l < 0 ? 0 : (l > INT_MAX ? INT_MAX : (int)l);
  }
  ssize_t rc = net_recv_some(s->fd, buf, min, n, left);
  *sys = rc < 0 ? (int)-rc : 0;
  if (rc >= 0) {
    *got = (size_t)rc;
    return 0;
  }
  if (rc == -ETIMEDOUT) return STORE_ETIMEDOUT;
  return STORE_EIO;
}

/* Sends the request in s->w and reads one reply frame; reply_ms bounds the wait for it
 * (< 0: no bound). Returns 0 with *op and s->reply/reply_len, the server's error code from an
 * ERROR reply (the connection stays usable), or a transport/protocol code (it does not). */
static int roundtrip(store_t *s, int reply_ms, int *op) {
  if (s->broken) {
    char prev[sizeof s->err];
    snprintf(prev, sizeof prev, "%s", s->err);
    seterr(s, "%s", prev[0] ? prev : "connection to the store was lost earlier");
    return s->broken;
  }
  int rc = store_proto_finish(&s->w);
  if (rc == STORE_ETOOBIG) {
    seterr(s, "%s request is over the %u-byte frame limit", store_proto_op_name(s->w.len >= 8 ? s->w.buf[6] : 0),
           STORE_MAX_FRAME);
    return rc;
  }
  if (rc) {
    seterr(s, "out of memory building a request");
    return rc;
  }
  const char *what = store_proto_op_name(s->w.buf[6]);
  free(s->reply);
  s->reply = NULL;
  s->reply_len = 0;
  rc = net_send_all(s->fd, s->w.buf, s->w.len);
  if (rc < 0) {
    seterr(s, "%s to store %s: send: %s", what, s->ep, strerror(-rc));
    return mark_broken(s, STORE_EIO);
  }
  int64_t deadline = reply_ms < 0 ? -1 : net_now_ms() + reply_ms;
  /* The header and, in the same recv, a small reply's payload: one request has one reply in
   * flight, so nothing past this frame can be read by mistake. */
  uint8_t first[STORE_PROTO_HEADER + 248];
  size_t got = 0;
  int sys = 0;
  rc = recv_until(s, first, STORE_PROTO_HEADER, sizeof first, deadline, &got, &sys);
  if (rc == STORE_ETIMEDOUT) {
    seterr(s, "%s to store %s: no reply within %d ms", what, s->ep, reply_ms);
    return mark_broken(s, rc);
  }
  if (rc) {
    seterr(s, "%s to store %s: %s", what, s->ep,
           sys == ECONNRESET ? "the store closed the connection" : strerror(sys));
    return mark_broken(s, rc);
  }
  uint32_t flen;
  char why[160];
  if (store_proto_parse_header(first, 0, &flen, op, why, sizeof why)) {
    snprintf(s->detail, sizeof s->detail, "%s", why);
    seterr(s, "%s to store %s: bad reply: %s", what, s->ep, why);
    return mark_broken(s, STORE_EPROTO);
  }
  if (got > flen) {
    snprintf(s->detail, sizeof s->detail, "%zu bytes past a %u-byte frame", got - flen, flen);
    seterr(s, "%s to store %s: bad reply: %s", what, s->ep, s->detail);
    return mark_broken(s, STORE_EPROTO);
  }
  size_t plen = flen - STORE_PROTO_HEADER, have = got - STORE_PROTO_HEADER;
  s->reply = malloc(plen + 1);
  if (!s->reply) {
    seterr(s, "out of memory for a %zu-byte reply", plen);
    return mark_broken(s, STORE_ENOMEM);
  }
  memcpy(s->reply, first + STORE_PROTO_HEADER, have);
  rc = have < plen ? recv_until(s, s->reply + have, plen - have, plen - have, deadline, &got, &sys) : 0;
  if (rc) {
    seterr(s, "%s to store %s: reply cut short: %s", what, s->ep,
           rc == STORE_ETIMEDOUT ? "timed out" : strerror(sys));
    return mark_broken(s, rc);
  }
  s->reply[plen] = 0;
  s->reply_len = plen;
  if (*op == STORE_REP_ERROR) {
    store_proto_reader_t r;
    store_proto_reader_init(&r, s->reply, plen);
    int64_t code = store_proto_get_i64(&r);
    size_t mlen;
    const uint8_t *msg = store_proto_get_bytes(&r, &mlen);
    if (!store_proto_reader_done(&r) || code >= 0 || code < STORE_EBUSY) { /* STORE_EBUSY: the last code */
      seterr(s, "%s to store %s: malformed error reply", what, s->ep);
      return mark_broken(s, STORE_EPROTO);
    }
    seterr(s, "store %s: %.*s", s->ep, (int)(mlen > 400 ? 400 : mlen), (const char *)msg);
    return (int)code;
  }
  return 0;
}

static int unexpected(store_t *s, int op) {
  seterr(s, "store %s: unexpected reply %s to %s", s->ep, store_proto_op_name(op),
         store_proto_op_name(s->w.buf[6]));
  return mark_broken(s, STORE_EPROTO);
}

static int malformed(store_t *s, int op) {
  seterr(s, "store %s: malformed %s reply", s->ep, store_proto_op_name(op));
  return mark_broken(s, STORE_EPROTO);
}

/* How long the client waits for the reply to a server-side wait of timeout_ms: the timeout and
 * some slack; -1 (no limit) for a negative timeout. */
static int wait_budget(int timeout_ms) {
  if (timeout_ms < 0) return -1;
  if (timeout_ms > INT_MAX - CLIENT_SLACK_MS) return INT_MAX;
  return timeout_ms + CLIENT_SLACK_MS;
}

/* Copies a byte string into a fresh NUL-terminated buffer. */
static int copy_out(store_t *s, const uint8_t *p, size_t n, void **val, size_t *len) {
  char *c = malloc(n + 1);
  if (!c) {
    seterr(s, "out of memory for a %zu-byte value", n);
    return STORE_ENOMEM;
  }
  if (n) memcpy(c, p, n);
  c[n] = 0;
  *val = c;
  if (len) *len = n;
  return 0;
}

/* Decodes a VALUE reply into a fresh copy. */
static int value_reply(store_t *s, int op, void **val, size_t *len) {
  if (op != STORE_REP_VALUE) return unexpected(s, op);
  store_proto_reader_t r;
  store_proto_reader_init(&r, s->reply, s->reply_len);
  size_t n;
  const uint8_t *p = store_proto_get_bytes(&r, &n);
  if (!store_proto_reader_done(&r)) return malformed(s, op);
  return copy_out(s, p, n, val, len);
}

static int left_ms(int64_t deadline) {
  int64_t l = deadline - net_now_ms();
  return l < 0 ? 0 : (l > INT_MAX ? INT_MAX : (int)l);
}

/* HELLO: the reply must be a meshrun store of our version; fills s->job and the server nonce. */
static int hello(store_t *s, const char *run_id, const uint8_t cn[STORE_PROTO_NONCE], uint8_t sn[STORE_PROTO_NONCE],
                 int *secret_required, int timeout_ms) {
  store_proto_begin(&s->w, STORE_OP_HELLO);
  store_proto_put_bytes(&s->w, STORE_PROTO_BANNER, strlen(STORE_PROTO_BANNER));
  store_proto_put_bytes(&s->w, run_id, strlen(run_id));
  store_proto_put_bytes(&s->w, cn, STORE_PROTO_NONCE);
  int op;
  int rc = roundtrip(s, timeout_ms, &op);
  if (rc == STORE_ETIMEDOUT) {
    seterr(s, "%s did not answer the store handshake within %d ms (is it a meshrun store?)", s->ep,
           timeout_ms);
    return rc;
  }
  if (rc == STORE_EIO) {
    seterr(s, "%s is not a meshrun store of protocol version %u (it closed the connection during the handshake)",
           s->ep, STORE_PROTO_VERSION);
    return STORE_EPROTO;
  }
  if (rc == STORE_EPROTO) {
    seterr(s, "%s is not a meshrun store (bad reply: %s)", s->ep, s->detail[0] ? s->detail : "malformed");
    return rc;
  }
  if (rc) return rc; /* the store's ERROR reply (at its connection limit, say), already in s->err */
  store_proto_reader_t r;
  store_proto_reader_init(&r, s->reply, s->reply_len);
  size_t bn, jn, nn;
  const uint8_t *b = store_proto_get_bytes(&r, &bn);
  const uint8_t *job = store_proto_get_bytes(&r, &jn);
  uint8_t req = store_proto_get_u8(&r);
  const uint8_t *nonce = store_proto_get_bytes(&r, &nn);
  if (op != STORE_REP_HELLO || !store_proto_reader_done(&r) || bn != strlen(STORE_PROTO_BANNER) ||
      memcmp(b, STORE_PROTO_BANNER, bn) != 0 || jn > STORE_MAX_RUN_ID || memchr(job, 0, jn) || req > 1 ||
      nn != STORE_PROTO_NONCE) {
    seterr(s, "%s is not a meshrun store (bad reply to the handshake)", s->ep);
    return mark_broken(s, STORE_EPROTO);
  }
  memcpy(s->job, job, jn);
  s->job[jn] = 0;
  memcpy(sn, nonce, STORE_PROTO_NONCE);
  *secret_required = req;
  return 0;
}

/* The handshake (store_proto.h): HELLO, then, when the store has a secret, our proof and a
 * check of the store's. A secret on one side only is refused here, before any key is touched. */
static int handshake(store_t *s, const char *run_id, const char *secret, int timeout_ms) {
  int64_t deadline = net_now_ms() + timeout_ms;
  uint8_t cn[STORE_PROTO_NONCE], sn[STORE_PROTO_NONCE];
  uint8_t proof[STORE_PROTO_PROOF], want[STORE_PROTO_PROOF];
  if (store_proto_nonce(cn)) {
    seterr(s, "store %s: no random bytes for the handshake (getrandom failed)", s->ep);
    return STORE_ENOMEM;
  }
  int required = 0;
  int rc = hello(s, run_id, cn, sn, &required, timeout_ms);
  if (rc) return rc;
  int have = secret[0] != 0;
  if (required && !have) {
    seterr(s, "the store %s of job '%s' requires a secret and this client has none (set %s, or give meshrun "
              "--rdzv_conf=token_file=PATH)", s->ep, s->job, STORE_ENV_SECRET);
    return mark_broken(s, STORE_EAUTH);
  }
  if (!required && have) {
    seterr(s, "the store %s of job '%s' is open but this job has a secret: refusing a store that cannot prove "
              "it belongs to this job", s->ep, s->job);
    return mark_broken(s, STORE_EAUTH);
  }
  if (!required) return 0;
  if (store_proto_proof(proof, secret, 0, cn, sn, run_id, strlen(run_id)) ||
      store_proto_proof(want, secret, 1, cn, sn, s->job, strlen(s->job))) {
    seterr(s, "store %s: cannot compute the handshake's HMAC-SHA256", s->ep);
    return mark_broken(s, STORE_ENOMEM);
  }
  store_proto_begin(&s->w, STORE_OP_AUTH);
  store_proto_put_bytes(&s->w, proof, sizeof proof);
  int op, ms = left_ms(deadline);
  rc = roundtrip(s, ms, &op);
  if (rc == STORE_EAUTH) {
    seterr(s, "store %s belongs to job '%s' and refused the secret of job '%s'", s->ep, s->job, run_id);
    return mark_broken(s, rc);
  }
  if (rc == STORE_ETIMEDOUT) {
    seterr(s, "store %s (job '%s') did not answer the secret's proof within %d ms", s->ep, s->job, ms);
    return rc;
  }
  if (rc == STORE_EIO) {
    seterr(s, "store %s (job '%s') closed the connection during authentication", s->ep, s->job);
    return rc;
  }
  if (rc) return rc;
  store_proto_reader_t r;
  store_proto_reader_init(&r, s->reply, s->reply_len);
  size_t n;
  const uint8_t *p = store_proto_get_bytes(&r, &n);
  if (op != STORE_REP_AUTH) return unexpected(s, op);
  if (!store_proto_reader_done(&r) || n != STORE_PROTO_PROOF) return malformed(s, op);
  if (!store_proto_proof_equal(p, want)) {
    seterr(s, "store %s claims to be job '%s' but cannot prove it holds this job's secret: it is not this job's "
              "store", s->ep, s->job);
    return mark_broken(s, STORE_EAUTH);
  }
  return 0;
}

/* One connection and handshake; s->err says why not. */
static int connect_once(store_t *s, const char *host, int port, const char *run_id, const char *secret,
                        int handshake_ms, int timeout_ms, int retry) {
  int64_t start = net_now_ms();
  s->fd = retry ? net_connect(host, port, timeout_ms, s->err, sizeof s->err)
                : net_connect_once(host, port, timeout_ms, s->err, sizeof s->err);
  if (s->fd < 0) {
    s->fd = -1;
    return STORE_ECONNECT;
  }
  /* Keepalive probes notice a vanished server host during long waits without a timeout. */
  int one = 1, idle = 30, intvl = 10, cnt = 3;
  setsockopt(s->fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(s->fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(s->fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(s->fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  int hello_ms = CLIENT_HELLO_TIMEOUT_MS;
  if (handshake_ms > 0) {
    hello_ms = handshake_ms;
  } else if (timeout_ms >= 0) {
    int64_t left = timeout_ms - (net_now_ms() - start);
    hello_ms = left < 1000 ? 1000 : (int)left;
  }
  return handshake(s, run_id, secret, hello_ms);
}

/* store_connect, and with retry 0 store_connect_once. */
static int connect_store(store_t **out, const char *host, int port, const store_auth_t *auth, int timeout_ms,
                         int retry, char *err, size_t errlen) {
  if (!out || !host || !*host || port <= 0 || port > 65535) {
    if (err && errlen) err_set(err, errlen, 0, "store_connect: bad host or port");
    return STORE_EINVAL;
  }
  *out = NULL;
  const char *run_id = auth && auth->run_id ? auth->run_id : "";
  const char *secret = auth && auth->secret ? auth->secret : "";
  if (strlen(run_id) > STORE_MAX_RUN_ID) {
    if (err && errlen)
      err_set(err, errlen, 0, "store_connect: run id '%.40s...' is %zu bytes, over the limit of %d", run_id,
              strlen(run_id), STORE_MAX_RUN_ID);
    return STORE_EINVAL;
  }
  int64_t deadline = timeout_ms < 0 ? -1 : net_now_ms() + timeout_ms;
  int pause_ms = CLIENT_BUSY_RETRY_MS;
  for (;;) {
    store_t *s = calloc(1, sizeof *s);
    if (!s) {
      if (err && errlen) err_set(err, errlen, 0, "store_connect: out of memory");
      return STORE_ENOMEM;
    }
    s->fd = -1;
    net_format_endpoint(s->ep, sizeof s->ep, host, port);
    int rc = connect_once(s, host, port, run_id, secret, auth ? auth->handshake_ms : 0,
                          deadline < 0 ? -1 : left_ms(deadline), retry);
    if (rc == 0) {
      s->err[0] = 0;
      *out = s;
      return 0;
    }
    if (err && errlen) err_set(err, errlen, 0, "%s", s->err);
    store_close(s);
    /* A store at its connection limit may have room a moment later (its unauthenticated
     * connections time out or are evicted); anything else is answered already. */
    if (!retry || rc != STORE_EBUSY || (deadline >= 0 && net_now_ms() + pause_ms >= deadline)) return rc;
    struct timespec ts = {pause_ms / 1000, (long)(pause_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    pause_ms = pause_ms * 2 > CLIENT_BUSY_RETRY_MAX_MS ? CLIENT_BUSY_RETRY_MAX_MS : pause_ms * 2;
  }
}

int store_connect(store_t **out, const char *host, int port, const store_auth_t *auth, int timeout_ms,
                  char *err, size_t errlen) {
  return connect_store(out, host, port, auth, timeout_ms, 1, err, errlen);
}

int store_connect_once(store_t **out, const char *host, int port, const store_auth_t *auth, int timeout_ms,
                       char *err, size_t errlen) {
  return connect_store(out, host, port, auth, timeout_ms, 0, err, errlen);
}

int store_connect_endpoint(store_t **out, const char *endpoint, const store_auth_t *auth, int timeout_ms,
                           char *err, size_t errlen) {
  char host[256];
  int port;
  if (out) *out = NULL;
  if (net_parse_endpoint(endpoint, host, sizeof host, &port, 0, 0, err, errlen)) return STORE_EINVAL;
  if (port == 0) {
    if (err && errlen) err_set(err, errlen, 0, "store endpoint '%s' has no port; expected HOST:PORT", endpoint);
    return STORE_EINVAL;
  }
  return store_connect(out, host, port, auth, timeout_ms, err, errlen);
}

int store_connect_env(store_t **out, int timeout_ms, char *err, size_t errlen) {
  if (out) *out = NULL;
  const char *ep = getenv(STORE_ENV_ENDPOINT);
  if (!ep || !*ep) {
    if (err && errlen)
      err_set(err, errlen, 0, "%s is not set: run under meshrun, or set %s=host:port (with %s and %s as the job's)",
              STORE_ENV_ENDPOINT, STORE_ENV_ENDPOINT, STORE_ENV_RUN_ID, STORE_ENV_SECRET);
    return STORE_EINVAL;
  }
  store_auth_t auth = {.run_id = getenv(STORE_ENV_RUN_ID), .secret = getenv(STORE_ENV_SECRET)};
  return store_connect_endpoint(out, ep, &auth, timeout_ms, err, errlen);
}

const char *store_server_job(const store_t *s) { return s ? s->job : ""; }

void store_interrupt(store_t *s) {
  /* shutdown, not close: the owner's thread may be inside recv/send on this fd, and a closed
   * number could be reused by another open before that call returns. */
  if (s && s->fd >= 0) shutdown(s->fd, SHUT_RDWR);
}

void store_close(store_t *s) {
  if (!s) return;
  if (s->fd >= 0) close(s->fd);
  store_proto_writer_free(&s->w);
  free(s->reply);
  free(s);
}

int store_set(store_t *s, const char *key, const void *val, size_t len) {
  if (!s) return STORE_EINVAL;
  int rc = check_key(s, key);
  if (rc) return rc;
  if (len && !val) {
    seterr(s, "set '%s': value is NULL", key);
    return STORE_EINVAL;
  }
  store_proto_begin(&s->w, STORE_OP_SET);
  put_key(s, key);
  store_proto_put_bytes(&s->w, val, len);
  int op;
  if ((rc = roundtrip(s, CLIENT_OP_TIMEOUT_MS, &op))) return rc;
  if (op != STORE_REP_OK) return unexpected(s, op);
  if (s->reply_len) return malformed(s, op);
  return 0;
}

static int get_common(store_t *s, const char *key, void **val, size_t *len, int timeout_ms, int nowait) {
  if (!s || !val) return STORE_EINVAL;
  int rc = check_key(s, key);
  if (rc) return rc;
  *val = NULL;
  if (len) *len = 0;
  store_proto_begin(&s->w, nowait ? STORE_OP_GET_NOWAIT : STORE_OP_GET);
  put_key(s, key);
  if (!nowait) store_proto_put_i64(&s->w, timeout_ms);
  int op;
  if ((rc = roundtrip(s, nowait ? CLIENT_OP_TIMEOUT_MS : wait_budget(timeout_ms), &op))) return rc;
  if (op == STORE_REP_TIMEOUT && !nowait) {
    seterr(s, "get '%s': key did not appear within %d ms", key, timeout_ms);
    return STORE_ETIMEDOUT;
  }
  if (op == STORE_REP_NOKEY && nowait) {
    seterr(s, "get '%s': no such key", key);
    return STORE_ENOKEY;
  }
  return value_reply(s, op, val, len);
}

int store_get(store_t *s, const char *key, void **val, size_t *len, int timeout_ms) {
  return get_common(s, key, val, len, timeout_ms, 0);
}

int store_get_nowait(store_t *s, const char *key, void **val, size_t *len) {
  return get_common(s, key, val, len, 0, 1);
}

static int read_int_reply(store_t *s, int64_t *v) {
  int op;
  int rc = roundtrip(s, CLIENT_OP_TIMEOUT_MS, &op);
  if (rc) return rc;
  if (op != STORE_REP_INT) return unexpected(s, op);
  store_proto_reader_t r;
  store_proto_reader_init(&r, s->reply, s->reply_len);
  *v = store_proto_get_i64(&r);
  if (!store_proto_reader_done(&r)) return malformed(s, op);
  return 0;
}

int store_add(store_t *s, const char *key, int64_t delta, int64_t *result) {
  if (!s) return STORE_EINVAL;
  int rc = check_key(s, key);
  if (rc) return rc;
  store_proto_begin(&s->w, STORE_OP_ADD);
  put_key(s, key);
  store_proto_put_i64(&s->w, delta);
  int64_t v;
  if ((rc = read_int_reply(s, &v))) return rc;
  if (result) *result = v;
  return 0;
}

int store_compare_set(store_t *s, const char *key, const void *expected, size_t expected_len,
                      const void *desired, size_t desired_len, void **actual, size_t *actual_len) {
  if (!s || !actual) return STORE_EINVAL;
  int rc = check_key(s, key);
  if (rc) return rc;
  if (desired_len && !desired) {
    seterr(s, "compare_set '%s': desired is NULL", key);
    return STORE_EINVAL;
  }
  if (expected_len && !expected) {
    seterr(s, "compare_set '%s': expected is NULL with length %zu", key, expected_len);
    return STORE_EINVAL;
  }
  *actual = NULL;
  if (actual_len) *actual_len = 0;
  store_proto_begin(&s->w, STORE_OP_CAS);
  put_key(s, key);
  store_proto_put_u8(&s->w, expected == NULL);
  store_proto_put_bytes(&s->w, expected, expected_len);
  store_proto_put_bytes(&s->w, desired, desired_len);
  int op;
  if ((rc = roundtrip(s, CLIENT_OP_TIMEOUT_MS, &op))) return rc;
  if (op == STORE_REP_NOKEY) return s->reply_len ? malformed(s, op) : 0;
  return value_reply(s, op, actual, actual_len);
}

int store_wait(store_t *s, const char *const *keys, size_t nkeys, int timeout_ms) {
  if (!s) return STORE_EINVAL;
  int rc = check_keys(s, keys, nkeys);
  if (rc) return rc;
  store_proto_begin(&s->w, STORE_OP_WAIT);
  store_proto_put_i64(&s->w, timeout_ms);
  put_keys(s, keys, nkeys);
  int op;
  if ((rc = roundtrip(s, wait_budget(timeout_ms), &op))) return rc;
  if (op == STORE_REP_TIMEOUT) {
    seterr(s, "wait for %zu key(s) ('%s'%s): not all appeared within %d ms", nkeys, nkeys ? keys[0] : "",
           nkeys > 1 ? ", ..." : "", timeout_ms);
    return STORE_ETIMEDOUT;
  }
  if (op != STORE_REP_OK) return unexpected(s, op);
  return s->reply_len ? malformed(s, op) : 0;
}

int store_check(store_t *s, const char *const *keys, size_t nkeys, int *exist) {
  if (!s || !exist) return STORE_EINVAL;
  int rc = check_keys(s, keys, nkeys);
  if (rc) return rc;
  store_proto_begin(&s->w, STORE_OP_CHECK);
  put_keys(s, keys, nkeys);
  int64_t v;
  if ((rc = read_int_reply(s, &v))) return rc;
  *exist = v != 0;
  return 0;
}

int store_delete(store_t *s, const char *key, int *deleted) {
  if (!s) return STORE_EINVAL;
  int rc = check_key(s, key);
  if (rc) return rc;
  store_proto_begin(&s->w, STORE_OP_DELETE);
  put_key(s, key);
  int64_t v;
  if ((rc = read_int_reply(s, &v))) return rc;
  if (deleted) *deleted = v != 0;
  return 0;
}

int store_multi_get(store_t *s, const char *const *keys, size_t nkeys, void **vals, size_t *lens,
                    int timeout_ms) {
  if (!s || (nkeys && !vals)) return STORE_EINVAL;
  int rc = check_keys(s, keys, nkeys);
  if (rc) return rc;
  for (size_t i = 0; i < nkeys; i++) {
    vals[i] = NULL;
    if (lens) lens[i] = 0;
  }
  store_proto_begin(&s->w, STORE_OP_MULTI_GET);
  store_proto_put_i64(&s->w, timeout_ms);
  put_keys(s, keys, nkeys);
  int op;
  if ((rc = roundtrip(s, wait_budget(timeout_ms), &op))) return rc;
  if (op == STORE_REP_TIMEOUT) {
    seterr(s, "multi_get of %zu key(s): not all appeared within %d ms", nkeys, timeout_ms);
    return STORE_ETIMEDOUT;
  }
  if (op != STORE_REP_VALUES) return unexpected(s, op);
  store_proto_reader_t r;
  store_proto_reader_init(&r, s->reply, s->reply_len);
  if (store_proto_get_u32(&r) != nkeys) return malformed(s, op);
  for (size_t i = 0; i < nkeys; i++) {
    size_t n;
    const uint8_t *p = store_proto_get_bytes(&r, &n);
    if (r.bad) break;
    if ((rc = copy_out(s, p, n, &vals[i], lens ? &lens[i] : NULL))) goto error;
  }
  if (!store_proto_reader_done(&r)) {
    rc = malformed(s, op);
    goto error;
  }
  return 0;
error:
  for (size_t i = 0; i < nkeys; i++) {
    free(vals[i]);
    vals[i] = NULL;
  }
  return rc;
}

int store_multi_set(store_t *s, const char *const *keys, const void *const *vals, const size_t *lens,
                    size_t nkeys) {
  if (!s || (nkeys && (!vals || !lens))) return STORE_EINVAL;
  int rc = check_keys(s, keys, nkeys);
  if (rc) return rc;
  store_proto_begin(&s->w, STORE_OP_MULTI_SET);
  store_proto_put_u32(&s->w, (uint32_t)nkeys);
  for (size_t i = 0; i < nkeys; i++) {
    if (lens[i] && !vals[i]) {
      seterr(s, "multi_set '%s': value is NULL", keys[i]);
      return STORE_EINVAL;
    }
    put_key(s, keys[i]);
    store_proto_put_bytes(&s->w, vals[i], lens[i]);
  }
  int op;
  if ((rc = roundtrip(s, CLIENT_OP_TIMEOUT_MS, &op))) return rc;
  if (op != STORE_REP_OK) return unexpected(s, op);
  return s->reply_len ? malformed(s, op) : 0;
}

int store_num_keys(store_t *s, int64_t *n) {
  if (!s || !n) return STORE_EINVAL;
  store_proto_begin(&s->w, STORE_OP_NUM_KEYS);
  return read_int_reply(s, n);
}
