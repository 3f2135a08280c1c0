/* etcd: the blocking etcd v3 client (API and the reasons for HTTP/JSON in etcd.h).
 *
 * One kept HTTP/1.1 connection per client (common/http.c), to the member in use, reused between
 * calls. Request bodies are built with printf: every string in them is base64 or
 * digits, so nothing needs JSON escaping; replies are parsed with cJSON. Quirks of the gateway
 * this code relies on (checked against etcd 3.4.23): 64-bit numbers come as strings; fields at
 * their zero value are omitted ("succeeded": false and a lease's "TTL": 0 are absent, a PUT
 * event has no "type"); stream replies (watch, keepalive) are one JSON message per line, each
 * wrapped in {"result": ...}; errors are {"error", "message", "code": gRPC code} with an HTTP
 * status; gRPC metadata rides in "Grpc-Metadata-*" headers.
 *
 * Retries and their safety. Reads, puts, deletes and lease calls may be repeated freely. A
 * transaction may not: when a member dies after receiving one, it may or may not have been
 * applied. Such tries mark the call "unsure", and the two transactional calls resolve it by
 * looking at what the retry found (etcd_compare_set, etcd_add). Tries that never reached
 * etcd, and "no leader" refusals, are not unsure. */
#include "common/etcd.h"

#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <nettle/base64.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "common/http.h"
#include "common/net.h"

#define MAX_MEMBERS 16
#define MAX_REPLY (256u << 20) /* bytes; a longer reply is refused rather than buffered */
/* One member's share of a call's timeout, at least: how long a hung member (accepts, never
 * answers) can hold a call before the next member is asked. */
#define SHARE_MIN_MS 500
/* Pause between passes over all members (an election in progress): doubles up to the max. */
#define PASS_BACKOFF_MS 50
#define PASS_BACKOFF_MAX_MS 500

struct etcd {
  http_conn_t http;
  int n, cur;                    /* members, and the one that answered last */
  char name[MAX_MEMBERS][272];   /* host:port, for messages */
  char host[MAX_MEMBERS][256];
  int port[MAX_MEMBERS];
  int timeout_ms;
  int unsure;                    /* the last call retried after a try that may have been applied */
  int heard_http, heard_etcd;    /* some member answered in HTTP; one answered as etcd does */
  char err[2048];
};

typedef struct {
  char *p;
  size_t len, cap;
} buf_t;

/* One HTTP exchange. For a watch, the body is read as a stream of lines as it comes. */
typedef struct {
  etcd_t *c;
  buf_t body;
  int watch;          /* stream mode: parse lines, stop at the first events */
  int created, done;  /* watch confirmed by the member; a message ended the stream */
  int64_t create_by;  /* ms: give up on a member that has not confirmed the watch by then (0 once it has) */
  cJSON *msg;         /* the message that ended the stream (events, cancel or error) */
  int oom;
} xfer_t;

static void seterr(etcd_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void seterr(etcd_t *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
}

const char *etcd_errmsg(const etcd_t *c) { return c ? c->err : "no etcd client"; }

void etcd_set_timeout(etcd_t *c, int timeout_ms) {
  if (c && timeout_ms > 0) c->timeout_ms = timeout_ms;
}

void etcd_interrupt(etcd_t *c) {
  if (c) http_wake(&c->http); /* every call, the one in progress too, fails at once with -EINTR */
}

static char *fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static char *fmt(const char *f, ...) {
  va_list ap;
  char *s = NULL;
  va_start(ap, f);
  if (vasprintf(&s, f, ap) < 0) s = NULL;
  va_end(ap);
  return s;
}

/* --- base64 (Nettle's; std alphabet with padding, as the gateway writes it) and JSON. */

static char *b64(const void *p, size_t n) {
  if (n > (size_t)INT32_MAX / 2) return NULL;
  char *s = malloc(BASE64_ENCODE_RAW_LENGTH(n) + 1);
  if (!s) return NULL;
  base64_encode_raw(s, n, p);
  s[BASE64_ENCODE_RAW_LENGTH(n)] = 0;
  return s;
}

/* Decodes s into a malloc'ed buffer with a NUL past the end. */
static int unb64(const char *s, void **out, size_t *len) {
  size_t n = s ? strlen(s) : 0;
  if (n % 4 || n > (size_t)INT32_MAX) return -EPROTO;
  uint8_t *b = malloc(BASE64_DECODE_LENGTH(n) + 1);
  if (!b) return -ENOMEM;
  struct base64_decode_ctx ctx;
  size_t r = 0;
  base64_decode_init(&ctx);
  if (n && (!base64_decode_update(&ctx, &r, b, n, s) || !base64_decode_final(&ctx))) {
    free(b);
    return -EPROTO;
  }
  b[r] = 0;
  *out = b;
  *len = r;
  return 0;
}

/* A 64-bit field: the gateway writes them as strings; absent = 0. */
static int64_t jint(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  if (cJSON_IsString(v)) return strtoll(v->valuestring, NULL, 10);
  if (cJSON_IsNumber(v)) return (int64_t)v->valuedouble;
  return 0;
}

static const char *jstr(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* The smallest key above every key that starts with p: the range_end of a prefix. A prefix of
 * all 0xff bytes (or "") has none; etcd spells that "\0", "to the end". */
static char *prefix_end_b64(const char *p) {
  size_t n = strlen(p);
  unsigned char *e = malloc(n + 1);
  if (!e) return NULL;
  memcpy(e, p, n);
  while (n && e[n - 1] == 0xff) n--;
  if (n) e[n - 1]++;
  else e[n++] = 0;
  char *s = b64(e, n);
  free(e);
  return s;
}

/* The JSON fields that name key, or with prefix every key under it. The empty prefix (all keys)
 * starts at the key "\0", since etcd refuses an empty key. */
static char *key_fields(const char *key, int prefix) {
  char *k = b64(key[0] ? key : "", key[0] ? strlen(key) : 1), *e = prefix ? prefix_end_b64(key) : NULL, *f = NULL;
  if (k && (e || !prefix)) f = prefix ? fmt("\"key\":\"%s\",\"range_end\":\"%s\"", k, e) : fmt("\"key\":\"%s\"", k);
  free(k), free(e);
  return f;
}

/* Fills kv from a mvccpb.KeyValue message. */
static int parse_kv(const cJSON *j, etcd_kv_t *kv) {
  size_t klen;
  void *key = NULL;
  int rc = unb64(jstr(j, "key"), &key, &klen);
  if (rc) return rc;
  kv->key = key;
  kv->mod_revision = jint(j, "mod_revision");
  kv->value = NULL;
  kv->len = 0;
  const char *v = jstr(j, "value");
  return unb64(v ? v : "", &kv->value, &kv->len);
}

void etcd_kvs_free(etcd_kvs_t *kvs) {
  if (!kvs) return;
  for (size_t i = 0; i < kvs->n; i++) {
    free(kvs->kvs[i].key);
    free(kvs->kvs[i].value);
  }
  free(kvs->kvs);
  kvs->kvs = NULL;
  kvs->n = 0;
}

/* Fills out from a JSON array of KeyValue (range) or of Event (watch). */
static int parse_kvs(const cJSON *arr, int events, etcd_kvs_t *out) {
  int n = cJSON_GetArraySize(arr);
  out->kvs = n ? calloc((size_t)n, sizeof *out->kvs) : NULL;
  if (n && !out->kvs) return -ENOMEM;
  const cJSON *it;
  cJSON_ArrayForEach(it, arr) {
    etcd_kv_t *kv = &out->kvs[out->n];
    const cJSON *j = events ? cJSON_GetObjectItemCaseSensitive(it, "kv") : it;
    int rc = parse_kv(j, kv);
    out->n++; /* counted even when half-filled, so etcd_kvs_free frees it */
    if (rc) return rc;
    if (events && (kv->deleted = (jstr(it, "type") && !strcmp(jstr(it, "type"), "DELETE")))) {
      free(kv->value);
      kv->value = NULL;
      kv->len = 0;
    }
    if (kv->mod_revision > out->revision) out->revision = kv->mod_revision;
  }
  return 0;
}

/* --- HTTP. */

static int on_data(void *arg, const char *data, size_t n);

/* gRPC status codes (in the gateway's "code") as errno. */
static int grpc_errno(int code) {
  switch (code) {
  case 3: return -EINVAL;        /* InvalidArgument */
  case 4: return -ETIMEDOUT;     /* DeadlineExceeded */
  case 5: return -ENOENT;        /* NotFound: lease not found */
  case 7: case 16: return -EACCES; /* PermissionDenied, Unauthenticated */
  case 8: return -E2BIG;         /* ResourceExhausted: request too large */
  case 11: return -ESTALE;       /* OutOfRange: revision compacted */
  case 14: return -EAGAIN;       /* Unavailable: no leader, timed out, leader changed */
  default: return -EIO;
  }
}

/* An error message of the gateway, unary ({"error": "text", "code": N}) or in a stream
 * ({"error": {"grpc_code": N, "message": "text"}}). Returns its errno and the text, or 0. */
static int reply_error(const cJSON *j, const char **text) {
  const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
  if (cJSON_IsString(e) && e->valuestring[0]) {
    *text = e->valuestring;
    return grpc_errno((int)jint(j, "code"));
  }
  if (cJSON_IsObject(e)) {
    *text = jstr(e, "message") ? jstr(e, "message") : "error";
    return grpc_errno((int)jint(e, "grpc_code"));
  }
  return 0;
}

/* One try on member i. Returns 0 with *reply, or a code with the member's cause in cause;
 * *retry says whether another member may do better, *unsure whether etcd may have applied it. */
static int attempt(etcd_t *c, int i, const char *path, const char *body, int timeout_ms, xfer_t *x,
                   cJSON **reply, char *cause, size_t clen, int *retry, int *unsure) {
  /* hasleader: a member cut off from its leader refuses at once ("no leader") instead of
   * holding the request until its 7 s request timeout; the watch server also ends our streams
   * when its member loses the leader. A transaction goes on a new connection: on a kept one
   * that closes as it is used, the reply lost is an error we see and resolve ("unsure"), never
   * a second send. */
  static const char headers[] = "Content-Type: application/json\r\nGrpc-Metadata-hasleader: true\r\n";
  http_req_t rq = {.host = c->host[i], .port = c->port[i], .peer = i, .path = path, .headers = headers,
                   .body = body, .body_len = strlen(body), .fresh = !strcmp(path, "/v3/kv/txn"),
                   .deadline = net_now_ms() + timeout_ms, .early = x->watch ? &x->create_by : NULL,
                   .on_data = on_data, .arg = x};
  http_res_t res;
  char herr[256] = "";
  int rc = http_post(&c->http, &rq, &res, herr, sizeof herr);
  long status = res.status;
  if (status) c->heard_http = 1;
  *retry = 1;
  *unsure = 0;
  if (x->oom) {
    *retry = 0;
    snprintf(cause, clen, "reply over %u MiB, or out of memory", MAX_REPLY >> 20);
    return -ENOMEM;
  }
  if (x->done) return 0; /* a watch message ended the stream (the data callback stopped it) */
  if (rc) {
    *unsure = res.sent > 0;
    if (rc == -EINTR) {
      *retry = 0;
      snprintf(cause, clen, "interrupted");
    } else if (rc == -ETIMEDOUT && res.early) {
      snprintf(cause, clen, "watch not confirmed in %d ms", timeout_ms);
    } else if (rc == -ETIMEDOUT) {
      snprintf(cause, clen, "no answer in %d ms", timeout_ms);
    } else {
      snprintf(cause, clen, "%s", herr);
    }
    return rc == -ENOMEM ? (*retry = 0, -ENOMEM) : rc;
  }
  if (x->watch) { /* the stream ended without a message for us: the member went away */
    *unsure = 1;
    snprintf(cause, clen, "watch stream closed");
    return -EIO;
  }
  cJSON *j = x->body.p ? cJSON_ParseWithLengthOpts(x->body.p, x->body.len, NULL, 0) : NULL;
  const char *text = NULL;
  int code = j ? reply_error(j, &text) : 0;
  if (text || (status == 200 && j)) c->heard_etcd = 1;
  if (status != 200 || code) {
    /* 4xx: the request is wrong wherever it goes. "no leader" is refused before it reaches
     * raft; other 5xx (timed out, leader changed) may still be applied. */
    *retry = status >= 500 || status == 0 || code == -EAGAIN || !text; /* !text: not etcd; maybe the next is */
    *unsure = *retry && !(text && strstr(text, "no leader"));
    if (text) snprintf(cause, clen, "HTTP %ld: %s", status, text);
    else snprintf(cause, clen, "HTTP %ld and no etcd error (not etcd's v3 JSON gateway?)", status);
    cJSON_Delete(j);
    return code ? code : (status >= 500 ? -EIO : -EPROTO);
  }
  if (!j) {
    *unsure = 1;
    snprintf(cause, clen, "reply is not JSON (not etcd?)");
    return -EPROTO;
  }
  *reply = j;
  return 0;
}

/* 0, or -1 when the reply would pass MAX_REPLY or memory runs out. */
static int buf_add(buf_t *b, const char *p, size_t n) {
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n + 1) cap *= 2;
    if (cap > MAX_REPLY + 1) return -1;
    char *q = realloc(b->p, cap);
    if (!q) return -1;
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->len, p, n);
  b->len += n;
  b->p[b->len] = 0;
  return 0;
}

/* A watch stream message: created (go on waiting), progress (ignored), or one that ends the
 * wait (events, canceled, error), which is kept in x->msg. */
static void watch_message(xfer_t *x, cJSON *j) {
  const char *text;
  cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "result");
  if (reply_error(j, &text) || !r) {
    x->msg = j;
    x->done = 1;
    return;
  }
  if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "created"))) x->created = 1, x->create_by = 0;
  if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "canceled")) ||
      cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(r, "events")) > 0) {
    x->msg = j;
    x->done = 1;
    return;
  }
  cJSON_Delete(j);
}

static int on_data(void *arg, const char *data, size_t n) {
  xfer_t *x = arg;
  if (buf_add(&x->body, data, n)) {
    x->oom = 1;
    return 1;
  }
  if (!x->watch) return 0;
  char *nl;
  while (!x->done && (nl = memchr(x->body.p, '\n', x->body.len))) {
    size_t line = (size_t)(nl - x->body.p);
    cJSON *j = cJSON_ParseWithLength(x->body.p, line);
    memmove(x->body.p, nl + 1, x->body.len - line - 1);
    x->body.len -= line + 1;
    if (j) watch_message(x, j);
  }
  return x->done; /* stops the transfer: we have what we came for */
}

static void xfer_free(xfer_t *x) {
  free(x->body.p);
  cJSON_Delete(x->msg);
  memset(x, 0, sizeof *x);
}

static void pause_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* c->err: the operation, then each member's cause, then tail. */
static void member_causes(etcd_t *c, const char *op, char cause[][200], const char *tail, ...)
    __attribute__((format(printf, 4, 5)));
static void member_causes(etcd_t *c, const char *op, char cause[][200], const char *tail, ...) {
  size_t off = (size_t)snprintf(c->err, sizeof c->err, "etcd %s:", op);
  for (int i = 0; i < c->n && off < sizeof c->err; i++)
    off += (size_t)snprintf(c->err + off, sizeof c->err - off, "%s %s: %s", i ? ";" : "", c->name[i],
                            cause[i][0] ? cause[i] : "not tried");
  if (off < sizeof c->err) {
    va_list ap;
    va_start(ap, tail);
    vsnprintf(c->err + off, sizeof c->err - off, tail, ap);
    va_end(ap);
  }
}

/* One call: body to path on the members in turn, starting with the one that answered last,
 * in passes until the client's timeout. Returns 0 and *reply, or a code with c->err naming
 * the operation and every member's cause. */
static int call(etcd_t *c, const char *op, const char *path, const char *body, cJSON **reply) {
  char cause[MAX_MEMBERS][200] = {{0}};
  int64_t start = net_now_ms(), deadline = start + c->timeout_ms;
  int share = c->timeout_ms / c->n > SHARE_MIN_MS ? c->timeout_ms / c->n : SHARE_MIN_MS;
  int rc = -ETIMEDOUT, passes = 0, backoff = PASS_BACKOFF_MS;
  *reply = NULL;
  c->unsure = 0;
  if (!body) return seterr(c, "etcd %s: out of memory", op), -ENOMEM;
  for (;;) {
    passes++;
    for (int k = 0; k < c->n; k++) {
      int i = (c->cur + k) % c->n, retry, unsure;
      int64_t left = deadline - net_now_ms();
      if (left <= 0) goto fail;
      xfer_t x = {.c = c};
      rc = attempt(c, i, path, body, (int)(left < share ? left : share), &x, reply, cause[i], sizeof cause[i],
                   &retry, &unsure);
      xfer_free(&x);
      if (rc == 0) {
        c->cur = i;
        return 0;
      }
      c->unsure |= unsure;
      if (!retry) {
        seterr(c, "etcd %s: %s: %s", op, c->name[i], cause[i]);
        return rc;
      }
    }
    int64_t left = deadline - net_now_ms();
    if (left <= 0) break;
    pause_ms(backoff < left ? backoff : (int)left);
    backoff = backoff * 2 < PASS_BACKOFF_MAX_MS ? backoff * 2 : PASS_BACKOFF_MAX_MS;
  }
fail:
  member_causes(c, op, cause, " (gave up after %" PRId64 " ms, %d pass%s)", net_now_ms() - start, passes,
                passes > 1 ? "es" : "");
  return rc;
}

/* "put 'key'" for messages; long keys are cut. */
static void opname(char *out, size_t n, const char *verb, const char *key) {
  snprintf(out, n, "%s '%.80s%s'", verb, key, strlen(key) > 80 ? "..." : "");
}

static int check_key(etcd_t *c, const char *verb, const char *key, int allow_empty) {
  if (!c) return -EINVAL;
  if (!key || (!key[0] && !allow_empty)) {
    seterr(c, "etcd %s: key is %s", verb, key ? "empty" : "NULL");
    return -EINVAL;
  }
  return 0;
}

/* --- connect. */

void etcd_close(etcd_t *c) {
  if (!c) return;
  http_close(&c->http);
  free(c);
}

/* An empty client (no members yet, no connection): its caller fills in the members. */
static etcd_t *client_new(void) {
  etcd_t *c = calloc(1, sizeof *c);
  if (c && http_init(&c->http)) {
    free(c);
    return NULL;
  }
  return c;
}

int etcd_connect(etcd_t **out, const char *endpoints, int timeout_ms, char *err, size_t errlen) {
  *out = NULL;
  if (!endpoints || timeout_ms <= 0)
    return err_set(err, errlen, -EINVAL, "etcd connect: %s", endpoints ? "timeout must be > 0" : "no endpoints");
  etcd_t *c = client_new();
  if (!c) return err_set(err, errlen, -ENOMEM, "etcd connect: out of memory");
  c->timeout_ms = timeout_ms;
  int rc = 0;
  char *list = strdup(endpoints), *save = NULL;
  if (!list) {
    rc = err_set(err, errlen, -ENOMEM, "etcd connect: out of memory");
    goto error;
  }
  for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    while (*tok == ' ') tok++;
    if (!strncmp(tok, "http://", 7)) tok += 7;
    else if (strstr(tok, "://")) {
      rc = err_set(err, errlen, -EINVAL, "etcd endpoint '%s': only http:// is supported (no TLS)", tok);
      goto error;
    }
    size_t tl = strlen(tok);
    while (tl && (tok[tl - 1] == ' ' || tok[tl - 1] == '/')) tok[--tl] = 0;
    char host[256], msg[256];
    int port;
    if (c->n == MAX_MEMBERS) {
      rc = err_set(err, errlen, -EINVAL, "etcd endpoints '%s': more than %d", endpoints, MAX_MEMBERS);
      goto error;
    }
    if (net_parse_endpoint(tok, host, sizeof host, &port, ETCD_DEFAULT_PORT, 0, msg, sizeof msg)) {
      rc = err_set(err, errlen, -EINVAL, "etcd endpoint '%s': %s", tok, msg);
      goto error;
    }
    char name[sizeof c->name[0]];
    net_format_endpoint(name, sizeof name, host, port);
    snprintf(c->name[c->n], sizeof c->name[c->n], "%s", name);
    snprintf(c->host[c->n], sizeof c->host[c->n], "%s", host);
    c->port[c->n] = port;
    c->n++;
  }
  if (c->n == 0) {
    rc = err_set(err, errlen, -EINVAL, "etcd endpoints '%s': none given (host:port,host:port,...)", endpoints);
    goto error;
  }
  /* A first call proves that the cluster can serve: a linearizable read (of the key "\0",
   * counted, not fetched) needs a leader that a quorum still follows, where a status call is
   * answered by any live member, even by a leader that has just lost its quorum. */
  cJSON *j;
  if ((rc = call(c, "connect", "/v3/kv/range", "{\"key\":\"AA==\",\"count_only\":true}", &j))) {
    /* What answered, for the caller's message: HTTP but never etcd's error form (a web server on
     * the port), or etcd that could not serve the read, or (the code as it is) nothing. */
    if (c->heard_http && !c->heard_etcd) rc = -EPROTO;
    else if (c->heard_etcd && rc != -EACCES && rc != -ENOMEM) rc = -EAGAIN;
    err_set(err, errlen, rc, "%s", c->err);
    goto error;
  }
  int ok = jstr(cJSON_GetObjectItemCaseSensitive(j, "header"), "cluster_id") != NULL;
  cJSON_Delete(j);
  if (!ok) {
    rc = err_set(err, errlen, -EPROTO, "etcd connect: %s answers, but not as etcd", c->name[c->cur]);
    goto error;
  }
  free(list);
  c->err[0] = 0;
  *out = c;
  return 0;
error:
  free(list);
  etcd_close(c);
  return rc;
}

int etcd_clone(etcd_t **out, const etcd_t *c) {
  *out = NULL;
  etcd_t *d = client_new();
  if (!d) return -ENOMEM;
  d->n = c->n;
  d->timeout_ms = c->timeout_ms;
  memcpy(d->name, c->name, sizeof d->name);
  memcpy(d->host, c->host, sizeof d->host);
  memcpy(d->port, c->port, sizeof d->port);
  *out = d;
  return 0;
}

/* --- key-value. */

int etcd_put(etcd_t *c, const char *key, const void *val, size_t len, int64_t lease) {
  int rc = check_key(c, "put", key, 0);
  if (rc) return rc;
  char op[128], *k = b64(key, strlen(key)), *v = b64(val, len), *body = NULL;
  if (k && v) body = fmt("{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%" PRId64 "\"}", k, v, lease);
  opname(op, sizeof op, "put", key);
  cJSON *j;
  rc = call(c, op, "/v3/kv/put", body, &j);
  cJSON_Delete(j);
  free(k), free(v), free(body);
  return rc;
}

int etcd_put2(etcd_t *c, const char *k1, const void *v1, size_t l1, const char *k2, const void *v2, size_t l2,
              int64_t lease) {
  int rc = check_key(c, "put", k1, 0);
  if (rc || (rc = check_key(c, "put", k2, 0))) return rc;
  char op[128], *a = b64(k1, strlen(k1)), *av = b64(v1, l1), *b = b64(k2, strlen(k2)), *bv = b64(v2, l2), *body = NULL;
  if (a && av && b && bv)
    body = fmt("{\"success\":[{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%" PRId64 "\"}},"
               "{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%" PRId64 "\"}}]}",
               a, av, lease, b, bv, lease);
  opname(op, sizeof op, "put", k1);
  cJSON *j = NULL;
  rc = call(c, op, "/v3/kv/txn", body, &j); /* puts: applying it twice changes nothing */
  free(a), free(av), free(b), free(bv), free(body);
  cJSON_Delete(j);
  return rc;
}

/* Range over key (prefix: every key under it), or delete it (path /v3/kv/deleterange). */
static int range(etcd_t *c, const char *verb, const char *path, const char *key, int prefix, cJSON **reply) {
  char op[128], *f = key_fields(key, prefix), *body = f ? fmt("{%s}", f) : NULL;
  opname(op, sizeof op, verb, key);
  int rc = call(c, op, path, body, reply);
  free(f), free(body);
  return rc;
}

/* The first kv of a range or txn reply's "kvs", or NULL. */
static const cJSON *first_kv(const cJSON *j) {
  return cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "kvs"), 0);
}

int etcd_get(etcd_t *c, const char *key, void **val, size_t *len, int64_t *mod_revision) {
  int rc = check_key(c, "get", key, 0);
  if (rc) return rc;
  cJSON *j;
  if ((rc = range(c, "get", "/v3/kv/range", key, 0, &j))) return rc;
  const cJSON *kv = first_kv(j);
  etcd_kv_t x = {0};
  if (!kv) rc = -ENOENT, seterr(c, "etcd get '%.80s': no such key", key);
  else if ((rc = parse_kv(kv, &x))) seterr(c, "etcd get '%.80s': bad key or value in the reply", key);
  cJSON_Delete(j);
  free(x.key);
  if (rc) return free(x.value), rc;
  *val = x.value;
  *len = x.len;
  if (mod_revision) *mod_revision = x.mod_revision;
  return 0;
}

int etcd_get_prefix(etcd_t *c, const char *prefix, etcd_kvs_t *out) {
  memset(out, 0, sizeof *out);
  int rc = check_key(c, "get prefix", prefix, 1);
  cJSON *j = NULL;
  if (rc || (rc = range(c, "get prefix", "/v3/kv/range", prefix, 1, &j))) return rc;
  rc = parse_kvs(cJSON_GetObjectItemCaseSensitive(j, "kvs"), 0, out);
  out->revision = jint(cJSON_GetObjectItemCaseSensitive(j, "header"), "revision");
  cJSON_Delete(j);
  if (rc) {
    etcd_kvs_free(out);
    seterr(c, "etcd get prefix '%.80s': bad key or value in the reply", prefix);
  }
  return rc;
}

int etcd_delete(etcd_t *c, const char *key, int prefix, int64_t *deleted) {
  int rc = check_key(c, "delete", key, prefix);
  if (rc) return rc;
  cJSON *j;
  rc = range(c, prefix ? "delete prefix" : "delete", "/v3/kv/deleterange", key, prefix, &j);
  if (!rc && deleted) *deleted = jint(j, "deleted");
  cJSON_Delete(j);
  return rc;
}

/* --- transactions. */

/* if (compare) put key=val (with lease) else range key. Returns whether it put and, from the
 * failure branch, the key's kv now (*kv, NULL when absent; points into *reply). */
static int txn_put(etcd_t *c, const char *op, const char *key, const char *compare, const void *val, size_t len,
                   int64_t lease, int *put, const cJSON **kv, cJSON **reply) {
  char *k = b64(key, strlen(key)), *v = b64(val, len), *body = NULL;
  if (k && v && compare)
    body = fmt("{\"compare\":[%s],\"success\":[{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%" PRId64
               "\"}}],\"failure\":[{\"request_range\":{\"key\":\"%s\"}}]}",
               compare, k, v, lease, k);
  int rc = call(c, op, "/v3/kv/txn", body, reply);
  free(k), free(v), free(body);
  if (rc) return rc;
  *put = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(*reply, "succeeded"));
  const cJSON *r = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(*reply, "responses"), 0);
  *kv = *put ? NULL : first_kv(cJSON_GetObjectItemCaseSensitive(r, "response_range"));
  return 0;
}

int etcd_compare_set(etcd_t *c, const char *key, const void *expected, size_t expected_len, const void *desired,
                     size_t desired_len, int64_t lease, int *swapped, void **actual, size_t *actual_len) {
  int rc = check_key(c, "compare_set", key, 0);
  if (rc) return rc;
  char op[128], *k = b64(key, strlen(key)), *x = expected ? b64(expected, expected_len) : NULL, *cmp = NULL;
  if (k && (x || !expected))
    cmp = expected ? fmt("{\"key\":\"%s\",\"target\":\"VALUE\",\"result\":\"EQUAL\",\"value\":\"%s\"}", k, x)
                   : fmt("{\"key\":\"%s\",\"target\":\"CREATE\",\"result\":\"EQUAL\",\"create_revision\":\"0\"}", k);
  opname(op, sizeof op, "compare_set", key);
  cJSON *j = NULL;
  const cJSON *kv = NULL;
  int put = 0;
  rc = txn_put(c, op, key, cmp, desired, desired_len, lease, &put, &kv, &j);
  free(k), free(x), free(cmp);
  etcd_kv_t now = {0};
  if (!rc && kv && (rc = parse_kv(kv, &now))) seterr(c, "etcd %s: bad value in the reply", op);
  cJSON_Delete(j);
  free(now.key);
  if (rc) return free(now.value), rc;
  /* An unsure earlier try that went through makes the retry fail its compare; finding our
   * value in place is then our own write (or one just like it). */
  if (!put && c->unsure && kv && now.len == desired_len && !memcmp(now.value, desired, desired_len)) put = 1;
  *swapped = put;
  if (put) {
    free(now.value);
    now.value = malloc(desired_len + 1);
    if (!now.value) return seterr(c, "etcd %s: out of memory", op), -ENOMEM;
    memcpy(now.value, desired, desired_len);
    ((char *)now.value)[desired_len] = 0;
    now.len = desired_len;
  }
  if (actual) *actual = now.value, *actual_len = now.len;
  else free(now.value);
  return 0;
}

int etcd_count(etcd_t *c, const char *prefix, int64_t max_create_revision, int64_t *count, int64_t *revision) {
  int rc = check_key(c, "count", prefix, 1);
  if (rc) return rc;
  char op[128], *f = key_fields(prefix, 1), *body = NULL;
  /* etcd applies max_create_revision to the keys it returns, not to a count_only count. */
  if (f && max_create_revision > 0)
    body = fmt("{%s,\"keys_only\":true,\"max_create_revision\":\"%" PRId64 "\"}", f, max_create_revision);
  else if (f)
    body = fmt("{%s,\"count_only\":true}", f);
  opname(op, sizeof op, "count", prefix);
  cJSON *j = NULL;
  rc = call(c, op, "/v3/kv/range", body, &j);
  free(f), free(body);
  if (!rc) *count = max_create_revision > 0 ? cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j, "kvs")) : jint(j, "count");
  if (!rc && revision) *revision = jint(cJSON_GetObjectItemCaseSensitive(j, "header"), "revision");
  cJSON_Delete(j);
  return rc;
}

int etcd_create_index(etcd_t *c, const char *key, const char *prefix, int64_t *index) {
  int rc = check_key(c, "create", key, 0);
  if (rc || (rc = check_key(c, "create", prefix, 1))) return rc;
  if (strncmp(key, prefix, strlen(prefix)))
    return seterr(c, "etcd create '%.80s': not under '%.80s'", key, prefix), -EINVAL;
  char op[128], *k = b64(key, strlen(key)), *f = key_fields(prefix, 1), *body = NULL;
  /* The range runs after the put in the same transaction and sees it: the count is the number
   * of keys created up to this one, and no two joiners can get the same. */
  if (k && f)
    body = fmt("{\"compare\":[{\"key\":\"%s\",\"target\":\"CREATE\",\"result\":\"EQUAL\",\"create_revision\":\"0\"}],"
               "\"success\":[{\"request_put\":{\"key\":\"%s\"}},{\"request_range\":{%s,\"count_only\":true}}],"
               "\"failure\":[{\"request_range\":{\"key\":\"%s\"}}]}",
               k, k, f, k);
  opname(op, sizeof op, "create", key);
  cJSON *j = NULL;
  rc = call(c, op, "/v3/kv/txn", body, &j);
  free(k), free(f), free(body);
  if (rc) return rc;
  const cJSON *resp = cJSON_GetObjectItemCaseSensitive(j, "responses");
  int64_t created = 0;
  *index = 0;
  if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "succeeded")))
    *index = jint(cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(resp, 1), "response_range"), "count");
  else
    created = jint(first_kv(cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(resp, 0), "response_range")),
                   "create_revision");
  cJSON_Delete(j);
  /* Present: an unsure earlier try of ours created it; count up to its creation. */
  if (created > 0 && (rc = etcd_count(c, prefix, created, index, NULL))) return rc;
  if (*index <= 0) return seterr(c, "etcd %s: no count in the reply", op), -EPROTO;
  return 0;
}

int etcd_add(etcd_t *c, const char *key, int64_t delta, int64_t *result) {
  int rc = check_key(c, "add", key, 0);
  if (rc) return rc;
  char op[128], *k = b64(key, strlen(key));
  opname(op, sizeof op, "add", key);
  if (!k) return seterr(c, "etcd %s: out of memory", op), -ENOMEM;
  /* Guess that the key is absent (mod_revision 0 compares equal for an absent key): a new
   * counter costs one round trip; otherwise the failed compare returns the key to retry with. */
  int64_t mod = 0, ver = 0, cur = 0, deadline = net_now_ms() + c->timeout_ms;
  for (;;) {
    int64_t next;
    if (__builtin_add_overflow(cur, delta, &next)) {
      rc = -ERANGE, seterr(c, "etcd %s: %" PRId64 " + %" PRId64 " overflows", op, cur, delta);
      break;
    }
    char val[24], *cmp = fmt("{\"key\":\"%s\",\"target\":\"MOD\",\"result\":\"EQUAL\",\"mod_revision\":\"%" PRId64 "\"}", k, mod);
    snprintf(val, sizeof val, "%" PRId64, next);
    cJSON *j = NULL;
    const cJSON *kv = NULL;
    int put = 0;
    rc = txn_put(c, op, key, cmp, val, strlen(val), 0, &put, &kv, &j);
    free(cmp);
    if (rc || put) {
      cJSON_Delete(j);
      if (!rc) *result = next;
      break;
    }
    etcd_kv_t now = {0};
    if (kv && (rc = parse_kv(kv, &now))) seterr(c, "etcd %s: bad value in the reply", op);
    char *end = NULL;
    int64_t v = now.value ? strtoll(now.value, &end, 10) : 0, nver = jint(kv, "version");
    if (!rc && now.value && (end == now.value || *end)) {
      rc = -EINVAL, seterr(c, "etcd %s: the key holds '%.40s', not an integer", op, (char *)now.value);
    }
    int mine = !rc && c->unsure && kv && nver == ver + 1 && v == next;
    if (!rc && !mine && net_now_ms() > deadline) {
      rc = -ETIMEDOUT, seterr(c, "etcd %s: still contended after %d ms", op, c->timeout_ms);
    }
    mod = kv ? now.mod_revision : 0, ver = nver, cur = v;
    free(now.key), free(now.value);
    cJSON_Delete(j);
    if (rc) break;
    /* An unsure try that went through makes the retry fail its compare and find exactly the
     * next version holding our sum: that write is ours (counted once, not again). It could
     * only be another adder's if one raced us from the same value with the same delta. */
    if (mine) {
      *result = next;
      break;
    }
  }
  free(k);
  return rc;
}

/* --- leases. */

int etcd_lease_grant(etcd_t *c, int ttl_s, int64_t *id, int *granted_s) {
  if (!c) return -EINVAL;
  if (ttl_s <= 0) return seterr(c, "etcd lease grant: ttl %d s is not positive", ttl_s), -EINVAL;
  char op[64], *body = fmt("{\"TTL\":\"%d\"}", ttl_s);
  snprintf(op, sizeof op, "lease grant ttl %d s", ttl_s);
  cJSON *j;
  int rc = call(c, op, "/v3/lease/grant", body, &j);
  free(body);
  if (rc) return rc;
  *id = jint(j, "ID");
  if (granted_s) *granted_s = (int)jint(j, "TTL");
  cJSON_Delete(j);
  if (*id == 0) return seterr(c, "etcd %s: no lease id in the reply", op), -EPROTO;
  return 0;
}

/* keepalive and revoke: {"ID": id} to path. */
static int lease_call(etcd_t *c, const char *verb, const char *path, int64_t id, char *op, size_t oplen, cJSON **j) {
  char *body = fmt("{\"ID\":\"%" PRId64 "\"}", id);
  snprintf(op, oplen, "lease %s %" PRIx64, verb, (uint64_t)id);
  int rc = call(c, op, path, body, j);
  free(body);
  return rc;
}

int etcd_lease_keepalive(etcd_t *c, int64_t id, int *ttl_s) {
  if (!c) return -EINVAL;
  /* A stream on the gateway: our one request, then the member's one answer and the end. */
  char op[64];
  cJSON *j;
  int rc = lease_call(c, "keepalive", "/v3/lease/keepalive", id, op, sizeof op, &j);
  if (rc) return rc;
  int64_t ttl = jint(cJSON_GetObjectItemCaseSensitive(j, "result"), "TTL");
  cJSON_Delete(j);
  if (ttl <= 0) /* the gateway omits TTL 0: the lease is gone */
    return seterr(c, "etcd %s: lease expired or revoked (this node is fenced out)", op), -ENOENT;
  if (ttl_s) *ttl_s = (int)ttl;
  return 0;
}

int etcd_lease_revoke(etcd_t *c, int64_t id) {
  if (!c) return -EINVAL;
  char op[64];
  cJSON *j;
  int rc = lease_call(c, "revoke", "/v3/lease/revoke", id, op, sizeof op, &j);
  cJSON_Delete(j);
  return rc;
}

/* --- watch. */

/* The message that ended a watch stream: 0 with the events in out, -ESTALE (compacted; final,
 * message set), or a code with the member's cause (canceled, "no leader", ...: try another). */
static int watch_result(etcd_t *c, const char *op, int64_t from, const cJSON *msg, etcd_kvs_t *out, char *cause,
                        size_t clen) {
  const char *text;
  const cJSON *r = cJSON_GetObjectItemCaseSensitive(msg, "result");
  const cJSON *ev = cJSON_GetObjectItemCaseSensitive(r, "events");
  int rc = reply_error(msg, &text);
  if (rc) {
    snprintf(cause, clen, "watch ended: %s", text);
    return rc == -ESTALE ? -EIO : rc;
  }
  int64_t compacted = jint(r, "compact_revision");
  if (compacted > 0) {
    seterr(c, "etcd %s: revision %" PRId64 " is compacted (the oldest kept is %" PRId64
           "): read the keys again and watch from their revision", op, from + 1, compacted);
    return -ESTALE;
  }
  if (cJSON_GetArraySize(ev) > 0) {
    if ((rc = parse_kvs(ev, 1, out))) {
      etcd_kvs_free(out);
      out->revision = from;
      snprintf(cause, clen, "bad key or value in an event");
    }
    return rc;
  }
  snprintf(cause, clen, "watch canceled: %s", jstr(r, "cancel_reason") ? jstr(r, "cancel_reason") : "no reason given");
  return -EIO;
}

int etcd_watch(etcd_t *c, const char *key, int prefix, int64_t from_revision, int timeout_ms, etcd_kvs_t *out) {
  memset(out, 0, sizeof *out);
  out->revision = from_revision;
  int rc = check_key(c, "watch", key, prefix);
  if (rc) return rc;
  char op[128], *f = key_fields(key, prefix), *body = NULL;
  opname(op, sizeof op, prefix ? "watch prefix" : "watch", key);
  if (timeout_ms <= 0) return free(f), seterr(c, "etcd %s: timeout must be > 0", op), -EINVAL;
  if (f) body = fmt("{\"create_request\":{%s,\"start_revision\":\"%" PRId64 "\"}}", f, from_revision > 0 ? from_revision + 1 : 0);
  free(f);
  if (!body) return seterr(c, "etcd %s: out of memory", op), -ENOMEM;
  /* Each member gets the rest of the wait, but one that has not confirmed the watch within
   * its share of the client's timeout is left for the next. Until events come nothing has
   * been returned, so a new stream from the same revision loses nothing. */
  char cause[MAX_MEMBERS][200] = {{0}};
  int64_t deadline = net_now_ms() + timeout_ms;
  int share = c->timeout_ms / c->n > SHARE_MIN_MS ? c->timeout_ms / c->n : SHARE_MIN_MS, failures = 0;
  rc = -ETIMEDOUT;
  for (int64_t left; (left = deadline - net_now_ms()) > 0;) {
    int i = c->cur, retry, unsure;
    xfer_t x = {.c = c, .watch = 1, .create_by = net_now_ms() + share};
    cJSON *none = NULL;
    rc = attempt(c, i, "/v3/watch", body, (int)left, &x, &none, cause[i], sizeof cause[i], &retry, &unsure);
    int quiet = rc == -ETIMEDOUT && x.created;
    if (rc == 0) rc = watch_result(c, op, from_revision, x.msg, out, cause[i], sizeof cause[i]);
    xfer_free(&x);
    if (quiet) {
      seterr(c, "etcd %s: no change after revision %" PRId64 " in %d ms", op, from_revision, timeout_ms);
      goto done;
    }
    if (rc == 0 || rc == -ESTALE || rc == -ENOMEM || rc == -EPROTO) {
      if (rc == 0) c->cur = i;
      else if (rc != -ESTALE) seterr(c, "etcd %s: %s: %s", op, c->name[i], cause[i]);
      goto done;
    }
    if (!retry) {
      seterr(c, "etcd %s: %s: %s", op, c->name[i], cause[i]);
      goto done;
    }
    c->cur = (i + 1) % c->n;
    if (++failures % c->n == 0) { /* a whole pass failed: an election, or no quorum */
      int64_t l = deadline - net_now_ms();
      if (l > 0) pause_ms(l < PASS_BACKOFF_MAX_MS ? (int)l : PASS_BACKOFF_MAX_MS);
    }
  }
  /* Out of time without a member confirming the watch: not a quiet key, so not -ETIMEDOUT. */
  if (rc == -ETIMEDOUT) rc = -EAGAIN;
  member_causes(c, op, cause, " (no member watched for %d ms)", timeout_ms);
done:
  free(body);
  return rc;
}
