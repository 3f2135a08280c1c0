/* rdzv: rendezvous rounds, round ends and liveness over the store or etcd, on two threads
 * that report to the agent's loop (see rdzv.h for the key schema and the division of work).
 *
 * Every key-value call here blocks, which is why none of it runs on the loop thread. Waits are
 * cut into slices of at most RDZV_SLICE_MS so that the stop flag is seen promptly. The kv_*
 * functions below are the one place that knows the two backends apart; the round logic above
 * them is shared, except liveness (heartbeat counters in the store, a lease in etcd: see
 * watch_store and watch_etcd). The pure decision functions at the bottom hold the rules. */
#include "launcher/rdzv.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/net.h"
#include "common/store.h"

#define RDZV_SLICE_MS 500
#define RDZV_KEY_MAX 512
/* A leased write refused because this node's etcd lease is gone (fenced out). Not a STORE_E*
 * code, which rdzv otherwise speaks for both backends. */
#define RDZV_EFENCED (-100)
/* How long an etcd call (all members, retries included) may take before it counts as failed:
 * the command thread's, and the watch thread's (which must renew the lease within its TTL). */
#define ETCD_CMD_MS (RDZV_ETCD_CALL_S * 1000)
#define ETCD_WATCH_MIN_MS 1000
/* One watch's length while waiting for a key (etcd_wait_get). */
#define ETCD_WAIT_SLICE_MS 5000
/* At exit: how long revoking the lease may take (peers then see this node leave at once
 * instead of after the lease's TTL). */
#define ETCD_REVOKE_MS 1000

typedef enum { CMD_JOIN = 0, CMD_END, CMD_DONE } cmd_kind_t;

typedef struct {
  cmd_kind_t kind;
  rdzv_end_t end;
} cmd_t;

/* One thread's connection: to the store (c10d) or to the etcd cluster. */
typedef struct {
  store_t *s;
  etcd_t *e;
} conn_t;

struct rdzv {
  rdzv_config_t cfg;
  uv_loop_t *loop;
  uv_async_t async;
  rdzv_event_cb cb;
  void *arg;
  char prefix[256]; /* "meshrun/<run_id>/" */
  atomic_int stop;
  atomic_int done; /* this node said it is done: a store going away now is the host leaving */

  uv_mutex_t mu;
  uv_cond_t cmd_cond, watch_cond, exit_cond;
  int live_threads; /* started and not yet returned (under mu) */
  cmd_t cmds[16];
  int ncmds;
  rdzv_event_t *events;
  int nevents, capevents;

  /* The running round, published by the command thread for the watch thread. */
  int cur_round, cur_n, cur_my_idx, watch_gen;
  int cur_serves; /* this node serves the round's store (c10d: always its host; etcd: group rank 0) */
  rdzv_node_t *cur_nodes;

  conn_t cs, ws; /* command and watch connections; set under mu (rdzv_destroy reads them) */
  uv_thread_t cmd_thr, watch_thr;

  /* The store's liveness (see rdzv.h), under mu: the watch thread marks each reply, the
   * watchdog (a loop timer) compares. c10d only. */
  uv_timer_t watchdog;
  int watching;      /* the watch thread is in a round */
  double last_reply; /* mono_now() of its last store reply */
  double silent_s;   /* > 0 once the watchdog found the store silent this long */
  atomic_int reached; /* a connection to the store succeeded once: failing now is losing it */

  /* etcd: this node's lease, under mu. Granted by the command thread when it joins without
   * one, renewed by the watch thread every heartbeat interval, dropped (0) when fenced. */
  int64_t lease;
  double lease_ok; /* mono_now() of its grant or last renewal */
  int ttl_s;       /* as etcd granted it (it may raise a short one to its minimum) */
  int watch_call_ms; /* the watch thread's etcd call timeout (renew_lease lengthens it) */
};

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int is_etcd(const rdzv_t *rz) { return rz->cfg.kv == RDZV_KV_ETCD; }

/* Queues ev for the loop. Nothing is queued or sent once stop is set: the async handle may be
 * closed (and the loop gone) from then on, so the check and the send are under mu, the same
 * lock rdzv_shutdown sets stop under. */
static void emit(rdzv_t *rz, const rdzv_event_t *ev) {
  uv_mutex_lock(&rz->mu);
  if (atomic_load(&rz->stop)) {
    uv_mutex_unlock(&rz->mu);
    return;
  }
  if (rz->nevents == rz->capevents) {
    int cap = rz->capevents ? rz->capevents * 2 : 8;
    rdzv_event_t *p = realloc(rz->events, (size_t)cap * sizeof *p);
    if (!p) {
      uv_mutex_unlock(&rz->mu);
      log_error("rdzv: out of memory queueing an event");
      return;
    }
    rz->events = p;
    rz->capevents = cap;
  }
  rz->events[rz->nevents++] = *ev;
  uv_async_send(&rz->async);
  uv_mutex_unlock(&rz->mu);
}

static void emit_message(rdzv_t *rz, rdzv_event_kind_t kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void emit_message(rdzv_t *rz, rdzv_event_kind_t kind, const char *fmt, ...) {
  if (atomic_load(&rz->stop)) return;
  rdzv_event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return;
  ev->kind = kind;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ev->message, sizeof ev->message, fmt, ap);
  va_end(ap);
  emit(rz, ev);
  free(ev);
}
#define emit_error(rz, ...) emit_message(rz, RDZV_EV_ERROR, __VA_ARGS__)

/* ---- the two backends ---- */

static const char *conn_errmsg(const conn_t *c, int rc) {
  if (c->e) return etcd_errmsg(c->e);
  return c->s ? store_errmsg(c->s) : store_strerror(rc);
}

/* etcd's errno codes in rdzv's STORE_E* terms: a missing key is one, anything else that
 * reaches rdzv means no member could serve the call in its time. */
static int from_etcd(int rc) {
  switch (rc) {
  case 0: return 0;
  case -ENOENT: return STORE_ENOKEY;
  case -ENOMEM: return STORE_ENOMEM;
  default: return STORE_EIO;
  }
}

static int64_t lease_now(rdzv_t *rz) {
  uv_mutex_lock(&rz->mu);
  int64_t l = rz->lease;
  uv_mutex_unlock(&rz->mu);
  return l;
}

/* A write with leased set dies with this node's lease (etcd; the store has no leases), and is
 * refused with RDZV_EFENCED when that lease is gone. */
static int kv_set(rdzv_t *rz, conn_t *c, const char *key, const char *val, int leased) {
  if (!c->e) return store_set(c->s, key, val, strlen(val));
  int rc = etcd_put(c->e, key, val, strlen(val), leased ? lease_now(rz) : 0);
  return leased && rc == -ENOENT ? RDZV_EFENCED : from_etcd(rc);
}

/* Sets k1 and k2 in one request (etcd: one transaction), so no reader sees k2 without k1. */
static int kv_set_pair(rdzv_t *rz, conn_t *c, const char *k1, const char *v1, const char *k2, const char *v2,
                       int leased) {
  if (c->e) {
    int rc = etcd_put2(c->e, k1, v1, strlen(v1), k2, v2, strlen(v2), leased ? lease_now(rz) : 0);
    return leased && rc == -ENOENT ? RDZV_EFENCED : from_etcd(rc);
  }
  const char *keys[2] = {k1, k2};
  const void *vals[2] = {v1, v2};
  size_t lens[2] = {strlen(v1), strlen(v2)};
  return store_multi_set(c->s, keys, vals, lens, 2);
}

static int kv_get_nowait(conn_t *c, const char *key, void **v, size_t *len) {
  if (!c->e) return store_get_nowait(c->s, key, v, len);
  return from_etcd(etcd_get(c->e, key, v, len, NULL));
}

static int kv_add(conn_t *c, const char *key, int64_t delta, int64_t *out) {
  if (!c->e) return store_add(c->s, key, delta, out);
  return from_etcd(etcd_add(c->e, key, delta, out));
}

/* Sets key to desired if it is absent (expected NULL) or holds expected; *actual (malloc'ed,
 * NUL past *alen) gets the value after the call. */
static int kv_compare_set(rdzv_t *rz, conn_t *c, const char *key, const char *expected, const char *desired,
                          int leased, void **actual, size_t *alen) {
  *actual = NULL;
  *alen = 0;
  if (!c->e)
    return store_compare_set(c->s, key, expected, expected ? strlen(expected) : 0, desired, strlen(desired), actual,
                             alen);
  int swapped = 0;
  int rc = etcd_compare_set(c->e, key, expected, expected ? strlen(expected) : 0, desired, strlen(desired),
                            leased ? lease_now(rz) : 0, &swapped, actual, alen);
  return leased && rc == -ENOENT ? RDZV_EFENCED : from_etcd(rc);
}

static int kv_exists(conn_t *c, const char *key, int *exist) {
  if (!c->e) {
    const char *k[1] = {key};
    return store_check(c->s, k, 1, exist);
  }
  void *v = NULL;
  size_t len;
  int rc = etcd_get(c->e, key, &v, &len, NULL);
  free(v);
  *exist = rc == 0;
  return rc == -ENOENT ? 0 : from_etcd(rc);
}

/* Whether key is in kvs (a prefix read, which may hold longer keys too); its index or -1. */
static int find_key(const etcd_kvs_t *kvs, const char *key) {
  for (size_t i = 0; i < kvs->n; i++)
    if (!strcmp(kvs->kvs[i].key, key)) return (int)i;
  return -1;
}

/* etcd: waits for key up to timeout_ms (< 0: until stop). One read, then one watch from that
 * read's revision, renewed every ETCD_WAIT_SLICE_MS from where the last left off: a watch is a
 * new HTTP request and a new stream in etcd's gateway, and at 512 nodes re-reading and
 * re-watching every half second kept etcd too busy to confirm the watches in time. The event
 * carries the value, so no read follows. rdzv_destroy interrupts the call in progress.
 * Returns 0 (and the value, malloc'ed, when v is not NULL), STORE_ETIMEDOUT, 1 when stopped, or
 * an error. */
static int etcd_wait_get(rdzv_t *rz, conn_t *c, const char *key, int timeout_ms, void **v, size_t *len) {
  double deadline = mono_now() + timeout_ms / 1000.0;
  for (;;) {
    if (atomic_load(&rz->stop)) return 1;
    etcd_kvs_t kvs;
    int rc = etcd_get_prefix(c->e, key, &kvs);
    if (rc) return atomic_load(&rz->stop) ? 1 : from_etcd(rc);
    int i = find_key(&kvs, key);
    int64_t rev = kvs.revision;
    if (i >= 0 && v) {
      *v = kvs.kvs[i].value;
      *len = kvs.kvs[i].len;
      kvs.kvs[i].value = NULL;
    }
    etcd_kvs_free(&kvs);
    if (i >= 0) return 0;
    for (;;) {
      int ms = ETCD_WAIT_SLICE_MS, final_slice = 0; /* the slice ends with this wait */
      if (timeout_ms >= 0) {
        double left = (deadline - mono_now()) * 1000.0;
        if (left <= 0) return STORE_ETIMEDOUT;
        if (left < ms) ms = (int)left + 1, final_slice = 1;
      }
      rc = etcd_watch(c->e, key, 0, rev, ms, &kvs);
      if (atomic_load(&rz->stop)) {
        etcd_kvs_free(&kvs);
        return 1;
      }
      rev = kvs.revision;
      if (rc == -ETIMEDOUT) continue;
      /* No member confirmed the watch, but in a slice this wait's own end cut shorter than an
       * etcd call is given to fail (a last-call wait's final milliseconds): that says nothing
       * about the cluster, and is this wait's timeout, not a lost store. (Not a clock check:
       * the watch counts whole milliseconds and may return a fraction of one before the
       * deadline.) */
      if (rc == -EAGAIN && final_slice && ms < ETCD_CMD_MS) {
        etcd_kvs_free(&kvs);
        return STORE_ETIMEDOUT;
      }
      if (rc == -ESTALE) break; /* compacted: read it again */
      if (rc) return from_etcd(rc);
      /* The last event says: set (its value is the key's), or deleted again (wait on). */
      etcd_kv_t *last = kvs.n ? &kvs.kvs[kvs.n - 1] : NULL;
      int found = last && !last->deleted;
      if (found && v) {
        *v = last->value;
        *len = last->len;
        last->value = NULL;
      }
      etcd_kvs_free(&kvs);
      if (found) return 0;
    }
  }
}

/* Waits for key up to timeout_ms (< 0: until stop), in slices so the stop flag is seen, and
 * when v is not NULL returns its value (malloc'ed; with the store in the same request).
 * Returns 0, STORE_ETIMEDOUT, 1 when stopped, or an error. */
static int kv_wait_get(rdzv_t *rz, conn_t *c, const char *key, int timeout_ms, void **v, size_t *len) {
  if (v) *v = NULL;
  if (c->e) return etcd_wait_get(rz, c, key, timeout_ms, v, len);
  double deadline = mono_now() + timeout_ms / 1000.0;
  const char *k[1] = {key};
  for (;;) {
    if (atomic_load(&rz->stop)) return 1;
    int slice = RDZV_SLICE_MS;
    if (timeout_ms >= 0) {
      double left = (deadline - mono_now()) * 1000.0;
      if (left <= 0) return STORE_ETIMEDOUT;
      if (left < slice) slice = (int)left + 1;
    }
    int rc = v ? store_get(c->s, key, v, len, slice) : store_wait(c->s, k, 1, slice);
    if (rc != STORE_ETIMEDOUT) return rc;
  }
}

static int kv_wait(rdzv_t *rz, conn_t *c, const char *key, int timeout_ms) {
  return kv_wait_get(rz, c, key, timeout_ms, NULL, NULL);
}

/* The value of key, waiting up to timeout_ms for it; stopping counts as timing out. */
static int kv_get_wait(rdzv_t *rz, conn_t *c, const char *key, void **v, size_t *len, int timeout_ms) {
  if (!c->e) return store_get(c->s, key, v, len, timeout_ms);
  int rc = etcd_wait_get(rz, c, key, timeout_ms, v, len);
  return rc == 1 ? STORE_ETIMEDOUT : rc;
}

static void conn_interrupt(conn_t *c) {
  store_interrupt(c->s);
  etcd_interrupt(c->e);
}

static void conn_close(conn_t *c) {
  store_close(c->s);
  etcd_close(c->e);
  c->s = NULL;
  c->e = NULL;
}

/* ---- losing the store or etcd ---- */

/* The store or the etcd cluster, reached before, is gone: one line that says where it was,
 * why this node cannot go on without it, and what would (cause: the failed call's message,
 * or the watchdog's verdict). */
static void store_lost_because(rdzv_t *rz, const char *cause) {
  if (is_etcd(rz)) {
    emit_message(rz, RDZV_EV_STORE_LOST,
                 "etcd cluster at %.300s lost (%.600s): no member could serve this node's rendezvous "
                 "calls, so it stops (the job's state stays in etcd: nodes that can reach a quorum "
                 "go on without this one)",
                 rz->cfg.etcd_endpoints, cause);
    return;
  }
  char ep[300];
  net_format_endpoint(ep, sizeof ep, rz->cfg.store_host, rz->cfg.store_port);
  emit_message(rz, RDZV_EV_STORE_LOST,
               "rendezvous store at %s lost (%.500s): the node that serves it died or cannot be reached, and a "
               "c10d store does not outlive its host, so this node stops too; --rdzv_backend=etcd keeps the "
               "job's state in an etcd cluster, which survives any one node",
               ep, cause);
}

static void store_lost(rdzv_t *rz, conn_t *c, int rc) {
  uv_mutex_lock(&rz->mu);
  double silent = rz->silent_s;
  uv_mutex_unlock(&rz->mu);
  char cause[800];
  if (silent > 0)
    snprintf(cause, sizeof cause, "no reply for %.1fs, heartbeat_timeout=%gs", silent, rz->cfg.heartbeat_timeout_s);
  else
    snprintf(cause, sizeof cause, "%.700s", conn_errmsg(c, rc));
  store_lost_because(rz, cause);
}

/* etcd: this node's lease is gone (or must be presumed gone). From here on it belongs to no
 * round: the agent stops its workers and joins again, with a new lease. Only the first
 * verdict about a lease counts. */
static void fenced(rdzv_t *rz, int64_t lease, const char *why) {
  uv_mutex_lock(&rz->mu);
  int first = lease != 0 && rz->lease == lease;
  if (first) rz->lease = 0;
  uv_mutex_unlock(&rz->mu);
  if (!first) return;
  emit_message(rz, RDZV_EV_FENCED, "this node was fenced out of the job: %.900s", why);
}

static void on_async(uv_async_t *h) {
  rdzv_t *rz = h->data;
  for (;;) {
    uv_mutex_lock(&rz->mu);
    if (rz->nevents == 0) {
      uv_mutex_unlock(&rz->mu);
      return;
    }
    rdzv_event_t ev = rz->events[0];
    memmove(rz->events, rz->events + 1, (size_t)(rz->nevents - 1) * sizeof ev);
    rz->nevents--;
    uv_mutex_unlock(&rz->mu);
    if (!atomic_load(&rz->stop)) rz->cb(rz, &ev, rz->arg);
  }
}

static void keyf(rdzv_t *rz, char *out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void keyf(rdzv_t *rz, char *out, const char *fmt, ...) {
  int n = snprintf(out, RDZV_KEY_MAX, "%s", rz->prefix);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out + n, (size_t)(RDZV_KEY_MAX - n), fmt, ap);
  va_end(ap);
}

/* Takes this node's join index in round r (1, 2, ...). The store adds 1 to P/r<r>/n. etcd
 * would retry a compare-and-swap on one counter O(n^2) times in all across n joiners (at 256
 * nodes on two cores, half gave up after the 5 s call timeout): each node instead creates
 * P/r<r>/join/<its lease> and counts the join keys, its own included, in the same transaction
 * (etcd_create_index). Join keys are not leased, so a joiner that dies leaves its index taken,
 * as with the counter. */
static int kv_join(rdzv_t *rz, conn_t *c, int r, int64_t *idx) {
  char key[RDZV_KEY_MAX], prefix[RDZV_KEY_MAX];
  if (!c->e) {
    keyf(rz, key, "r%d/n", r);
    return store_add(c->s, key, 1, idx);
  }
  keyf(rz, prefix, "r%d/join/", r);
  keyf(rz, key, "r%d/join/%" PRIx64, r, (uint64_t)lease_now(rz));
  return from_etcd(etcd_create_index(c->e, key, prefix, idx));
}

/* How many nodes have taken a join index in round r. */
static int kv_joined(rdzv_t *rz, conn_t *c, int r, int64_t *count) {
  char key[RDZV_KEY_MAX];
  if (!c->e) {
    keyf(rz, key, "r%d/n", r);
    return store_add(c->s, key, 0, count);
  }
  keyf(rz, key, "r%d/join/", r);
  return from_etcd(etcd_count(c->e, key, 0, count, NULL));
}

/* Reads an integer key; absent reads as dflt. */
static int read_int(conn_t *c, const char *key, int64_t dflt, int64_t *out) {
  void *v = NULL;
  size_t len = 0;
  int rc = kv_get_nowait(c, key, &v, &len);
  if (rc == STORE_ENOKEY) {
    *out = dflt;
    return 0;
  }
  if (rc) return rc;
  *out = strtoll(v, NULL, 10);
  free(v);
  return 0;
}

/* The bound on a connection's handshake (etcd: on its first answer), in ms: handshake_ms, else
 * the store's default or an etcd call's, and never past timeout_ms. */
static int handshake_bound(const rdzv_t *rz, int timeout_ms) {
  int ms = rz->cfg.handshake_ms > 0 ? rz->cfg.handshake_ms : is_etcd(rz) ? ETCD_CMD_MS : STORE_HANDSHAKE_S * 1000;
  return ms < timeout_ms ? ms : timeout_ms;
}

/* Seconds for a progress line: whole ones, tenths below ten. */
static int left_digits(double left) { return left < 10 ? 1 : 0; }

/* store_connect until timeout_ms, in slices of the progress interval while the store has never
 * been reached: nothing accepting the connection means its node has not started yet, and that
 * wait is said once a slice, with the time left. An endpoint that accepts and does not answer
 * the handshake (hs ms), or answers as something else, ends it at once. */
static int connect_store(rdzv_t *rz, store_t **s, int timeout_ms, int hs, char *err, size_t errlen) {
  const rdzv_config_t *c = &rz->cfg;
  store_auth_t auth = {.run_id = c->run_id, .secret = c->secret, .handshake_ms = hs};
  double deadline = mono_now() + timeout_ms / 1000.0;
  for (;;) {
    double left = deadline - mono_now();
    int quiet = c->progress_interval_s <= 0 || c->progress_interval_s >= left || atomic_load(&rz->reached);
    double slice = quiet ? left : c->progress_interval_s;
    int rc = store_connect(s, c->store_host, c->store_port, &auth, slice > 0.001 ? (int)(slice * 1000) : 1, err, errlen);
    if (rc != STORE_ECONNECT) return rc;
    /* net's " (gave up after N ms)" is a slice's, not the wait's: the lines name the wait. */
    char *tail = strstr(err, " (gave up after");
    if (tail) *tail = 0;
    if (quiet || atomic_load(&rz->stop)) return rc;
    char ep[300];
    net_format_endpoint(ep, sizeof ep, c->store_host, c->store_port);
    left = deadline - mono_now();
    log_info("rendezvous: waiting for the store at %s (%s) to accept connections: %.500s; %.*f s left (join_timeout)",
             ep, c->endpoint_from, err, left_digits(left), left > 0 ? left : 0);
  }
}

/* The first connection failed: one line that names the endpoint, what named it, and what
 * answered there (hs: the handshake's bound used). */
static void report_unreachable(rdzv_t *rz, int rc, int hs, const char *err) {
  const rdzv_config_t *c = &rz->cfg;
  if (is_etcd(rz)) {
    char what[200];
    if (rc == -EPROTO)
      snprintf(what, sizeof what, "not etcd: something answers there, not as etcd's v3 JSON gateway");
    else if (rc == -EAGAIN)
      snprintf(what, sizeof what, "etcd answered but could not serve a read within handshake_timeout=%gs (no leader, "
               "or no quorum)", hs / 1000.0);
    else if (rc == -EACCES)
      snprintf(what, sizeof what, "etcd refused this client");
    else if (rc == -EINVAL || rc == -ENOMEM)
      snprintf(what, sizeof what, "cannot be used");
    else
      snprintf(what, sizeof what, "no answer from any member within handshake_timeout=%gs", hs / 1000.0);
    emit_error(rz, "%s %.300s (etcd): %s: %.600s", c->endpoint_from, c->etcd_endpoints, what, err);
    return;
  }
  char ep[300];
  net_format_endpoint(ep, sizeof ep, c->store_host, c->store_port);
  if (rc == STORE_EPROTO)
    emit_error(rz, "%s %s: port is in use by another program (not a meshrun store): %s", c->endpoint_from, ep, err);
  else if (rc == STORE_ETIMEDOUT)
    emit_error(rz, "%s %s: no answer: it accepted the connection but did not answer the store handshake within "
               "handshake_timeout=%gs (not a meshrun store, or a stuck one)",
               c->endpoint_from, ep, hs / 1000.0);
  else if (rc == STORE_ECONNECT)
    emit_error(rz, "%s %s: nothing accepted the connection within join_timeout=%gs (the store's node did not start, "
               "or cannot be reached): %s",
               c->endpoint_from, ep, c->join_timeout_s, err);
  else
    emit_error(rz, "%s %s: %s", c->endpoint_from, ep, err);
}

/* Connects c once (the store, or the etcd cluster: each thread has its own) within timeout_ms.
 * A store not accepting connections yet is waited for until then (connect_store); the
 * handshake, and etcd's first answer, have handshake_bound: etcd runs before any job does, so
 * a cluster that does not answer is not waited for. */
static int ensure_conn(rdzv_t *rz, conn_t *c, int timeout_ms, int call_ms) {
  if (c->s || c->e) return 0;
  char err[1024];
  store_t *s = NULL;
  etcd_t *e = NULL;
  int rc, hs = handshake_bound(rz, timeout_ms);
  uv_mutex_lock(&rz->mu);
  etcd_t *first = c != &rz->cs ? rz->cs.e : NULL;
  uv_mutex_unlock(&rz->mu);
  if (first) {
    /* The watch thread, once the command thread is in: the same members, no second check. */
    rc = etcd_clone(&e, first);
    if (rc) snprintf(err, sizeof err, "etcd connect: out of memory");
    else etcd_set_timeout(e, call_ms);
  } else if (is_etcd(rz)) {
    rc = etcd_connect(&e, rz->cfg.etcd_endpoints, hs, err, sizeof err);
    etcd_set_timeout(e, call_ms);
  } else {
    rc = connect_store(rz, &s, timeout_ms, hs, err, sizeof err);
  }
  uv_mutex_lock(&rz->mu);
  c->s = s;
  c->e = e;
  uv_mutex_unlock(&rz->mu);
  if (rc == 0) atomic_store(&rz->reached, 1);
  if (rc && atomic_load(&rz->reached)) {
    /* A connection worked before: whatever answers now, ours has gone away. */
    store_lost_because(rz, err);
  } else if (rc) {
    report_unreachable(rz, rc, hs, err);
  }
  return rc;
}

/* etcd: a lease for this node when it has none (a first join, or a join after being fenced).
 * Its TTL is heartbeat_timeout in whole seconds, etcd's unit; etcd may raise it to its minimum
 * (about 1.5 x its election timeout), which is then what bounds the detection of this node's
 * death, and is said once. */
static int ensure_lease(rdzv_t *rz, conn_t *c) {
  if (!is_etcd(rz) || lease_now(rz)) return 0;
  int want = (int)ceil(rz->cfg.heartbeat_timeout_s);
  if (want < 1) want = 1;
  int64_t id = 0;
  int ttl = 0, rc = etcd_lease_grant(c->e, want, &id, &ttl);
  if (rc) return from_etcd(rc);
  if (ttl < 1) ttl = want;
  static atomic_int said;
  if (ttl > want && !atomic_exchange(&said, 1))
    log_warn("etcd granted this node's lease a TTL of %d s, above heartbeat_timeout=%gs (its minimum): a dead node "
             "is found after about %d s",
             ttl, rz->cfg.heartbeat_timeout_s, ttl);
  uv_mutex_lock(&rz->mu);
  rz->lease = id;
  rz->ttl_s = ttl;
  rz->lease_ok = mono_now();
  uv_cond_broadcast(&rz->watch_cond); /* the watch thread renews it from now on */
  uv_mutex_unlock(&rz->mu);
  log_debug("etcd lease %" PRIx64 " granted, TTL %d s", (uint64_t)id, ttl);
  return 0;
}

/* etcd, on the watch thread: renews the lease when *next is due. Returns 1 when this node is
 * fenced (FENCED emitted): etcd says the lease is gone, or no renewal succeeded for its TTL,
 * after which etcd has surely expired it (a partition: this node cannot tell the others it
 * lives, and they will have gone on without it). */
static int renew_lease(rdzv_t *rz, conn_t *c, double *next) {
  double now = mono_now();
  if (now < *next) return 0;
  *next = now + rz->cfg.heartbeat_interval_s;
  uv_mutex_lock(&rz->mu);
  int64_t lease = rz->lease;
  double ok = rz->lease_ok;
  int ttl = rz->ttl_s;
  uv_mutex_unlock(&rz->mu);
  if (!lease || now < ok + rz->cfg.heartbeat_interval_s) return 0; /* granted or renewed lately */
  /* The renewal may take what is left of the lease: etcd busy with 1024 nodes starting on two
   * cores answered in seconds, and giving up after the watch thread's usual call time fenced
   * live nodes. */
  int keep_ms = (int)((ok + ttl - now) * 1000);
  etcd_set_timeout(c->e, keep_ms > rz->watch_call_ms ? keep_ms : rz->watch_call_ms);
  int left = 0, rc = etcd_lease_keepalive(c->e, lease, &left);
  etcd_set_timeout(c->e, rz->watch_call_ms);
  char why[1024];
  if (rc == 0) {
    uv_mutex_lock(&rz->mu);
    if (rz->lease == lease) rz->lease_ok = mono_now();
    uv_mutex_unlock(&rz->mu);
    return 0;
  }
  if (rc == -ENOENT) {
    snprintf(why, sizeof why, "its etcd lease expired or was revoked (TTL %d s): the other nodes have gone on "
             "without it", ttl);
  } else if (mono_now() - ok > ttl) {
    snprintf(why, sizeof why, "its etcd lease could not be renewed for %.1fs (TTL %d s), so etcd has expired it: %.800s",
             mono_now() - ok, ttl, etcd_errmsg(c->e));
  } else {
    log_debug("renewing the etcd lease: %s", etcd_errmsg(c->e));
    return 0;
  }
  fenced(rz, lease, why);
  return 1;
}

/* round r -> r+1, unless someone already did it. */
static int bump_round(rdzv_t *rz, conn_t *c, int r) {
  char key[RDZV_KEY_MAX], cur[32], next[32];
  keyf(rz, key, "round");
  snprintf(cur, sizeof cur, "%d", r);
  snprintf(next, sizeof next, "%d", r + 1);
  void *actual = NULL;
  size_t alen = 0;
  int rc = kv_compare_set(rz, c, key, r == 0 ? NULL : cur, next, 0, &actual, &alen);
  free(actual);
  return rc;
}

/* Ends round r with e unless another node ended it first. Only the node that wins the claim
 * counts a failure against the job's budget and decides whether the job is over. With etcd
 * the claim is leased: a node fenced out cannot end a round it is no longer in
 * (RDZV_EFENCED), and a claimer that dies before writing the end frees the claim; an end
 * already written is final, whoever's lease has gone since. */
static int post_end(rdzv_t *rz, conn_t *c, int r, rdzv_end_t *e, int survivors) {
  char key[RDZV_KEY_MAX], token[RDZV_ADDR_MAX + 64];
  int rc;
  if (is_etcd(rz)) {
    int ended = 0;
    keyf(rz, key, "r%d/end", r);
    if ((rc = kv_exists(c, key, &ended)) || ended) return rc;
  }
  snprintf(token, sizeof token, "%s/%d/%d", rz->cfg.addr, (int)getpid(), e->node_idx);
  keyf(rz, key, "r%d/claim", r);
  void *actual = NULL;
  size_t alen = 0;
  if ((rc = kv_compare_set(rz, c, key, NULL, token, 1, &actual, &alen))) return rc;
  int won = actual && alen == strlen(token) && memcmp(actual, token, alen) == 0;
  free(actual);
  if (!won) return 0;
  int64_t failures = 0;
  if (e->kind == RDZV_END_FAILURE) {
    keyf(rz, key, "failures");
    if ((rc = kv_add(c, key, 1, &failures))) return rc;
  }
  e->fatal = e->fatal || rdzv_end_fatal(e->kind, failures, rz->cfg.max_restarts, survivors, rz->cfg.nnodes_min);
  char *json = rdzv_end_encode(e);
  if (!json) return STORE_ENOMEM;
  keyf(rz, key, "r%d/end", r);
  rc = kv_set(rz, c, key, json, 0);
  free(json);
  if (rc) return rc;
  /* A fatal end has no next round, and the store host leaves as soon as it reads the end: a
   * bump after it would race that exit and turn this node's exit code into "store lost". */
  if (e->fatal) return 0;
  return bump_round(rz, c, r);
}

/* A decimal int at *p after spaces or tabs (an optional '-', then 1 to 10 digits), followed by
 * a space or a tab; *p moves past it. -1 when there is none. */
static int parse_field(const char **p, long *out) {
  const char *v = *p;
  while (*v == ' ' || *v == '\t') v++;
  int neg = *v == '-';
  v += neg;
  long x = 0;
  const char *digits = v;
  while (*v >= '0' && *v <= '9' && v - digits < 10) x = x * 10 + (*v++ - '0');
  if (v == digits || (*v != ' ' && *v != '\t')) return -1;
  *out = neg ? -x : x;
  *p = v;
  return 0;
}

/* Parses a description "node_rank nproc addr" (what follows the address is ignored): the
 * address is [*addr, the returned end). NULL when malformed. By hand rather than with sscanf
 * or strtol: every node parses every node's, 2048 of them in a 2048-node job. */
static const char *parse_desc(const char *v, int *node_rank, int *nproc, const char **addr) {
  long rank, np;
  if (parse_field(&v, &rank) || parse_field(&v, &np)) return NULL;
  while (*v == ' ' || *v == '\t') v++;
  const char *a = v;
  while (*v && *v != ' ' && *v != '\t' && *v != '\n') v++;
  if (v == a || v - a >= RDZV_ADDR_MAX || rank < INT_MIN || rank > INT_MAX || np < INT_MIN || np > INT_MAX)
    return NULL;
  *node_rank = (int)rank;
  *nproc = (int)np;
  *addr = a;
  return v;
}

/* One allocation, the n entries followed by a copy of the text in which each address ends in
 * a NUL, so that the entries stay 24 bytes (an address array inline was 268 bytes a node, a
 * half megabyte for each of 2048 nodes to fault in, and again for the watch thread's copy). */
rdzv_node_t *rdzv_parse_node_list(const char *text, size_t len, int n, int *oom) {
  *oom = 0;
  rdzv_node_t *nodes = malloc((size_t)n * sizeof *nodes + len + 1);
  if (!nodes) {
    *oom = 1;
    return NULL;
  }
  char *p = (char *)(nodes + n), *end = p + len;
  memcpy(p, text, len);
  *end = 0;
  for (int i = 0; i < n; i++) {
    const char *addr;
    char *aend = (char *)(p < end ? parse_desc(p, &nodes[i].node_rank, &nodes[i].nproc, &addr) : NULL);
    if (!aend || *aend != '\n') {
      free(nodes);
      return NULL;
    }
    *aend = 0;
    nodes[i].idx = i + 1;
    nodes[i].addr = addr;
    p = aend + 1;
  }
  if (p != end) {
    free(nodes);
    return NULL;
  }
  return nodes;
}

/* The participant index of a key "<prefix><what>/<i>", or 0. */
static int key_idx(const char *key, const char *prefix, const char *what, int n) {
  size_t pl = strlen(prefix), wl = strlen(what);
  if (strncmp(key, prefix, pl) || strncmp(key + pl, what, wl) || key[pl + wl] != '/') return 0;
  char *end;
  long i = strtol(key + pl + wl + 1, &end, 10);
  return *end || i < 1 || i > n ? 0 : (int)i;
}

/* Reads the descriptions of participants 1..n of round r into vals[0..n) (malloc'ed; each
 * wrote its own right after taking its index, so waiting up to timeout_ms for the slow). The
 * store answers all n keys in one request; etcd in one prefix read, then a wait for each one
 * still missing. */
static int read_nodes(rdzv_t *rz, conn_t *c, int r, int n, void **vals, int timeout_ms) {
  int rc = 0;
  if (!c->e) {
    const char **keys = calloc((size_t)n, sizeof *keys);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    char *keybuf = malloc((size_t)n * RDZV_KEY_MAX);
    if (!keys || !lens || !keybuf) rc = STORE_ENOMEM;
    for (int i = 0; !rc && i < n; i++) {
      keyf(rz, keybuf + (size_t)i * RDZV_KEY_MAX, "r%d/node/%d", r, i + 1);
      keys[i] = keybuf + (size_t)i * RDZV_KEY_MAX;
    }
    if (!rc) rc = store_multi_get(c->s, keys, (size_t)n, vals, lens, timeout_ms);
    free(keybuf);
    free(lens);
    free(keys);
    return rc;
  }
  char *have = calloc((size_t)n, 1); /* which descriptions are in */
  if (!have) return STORE_ENOMEM;
  double deadline = mono_now() + timeout_ms / 1000.0;
  char round[RDZV_KEY_MAX], prefix[RDZV_KEY_MAX], key[RDZV_KEY_MAX];
  keyf(rz, round, "r%d/", r);
  keyf(rz, prefix, "r%d/node/", r);
  for (;;) {
    etcd_kvs_t kvs;
    if ((rc = from_etcd(etcd_get_prefix(c->e, prefix, &kvs)))) goto out;
    for (size_t k = 0; k < kvs.n; k++) {
      int i = key_idx(kvs.kvs[k].key, round, "node", n);
      if (!i || have[i - 1]) continue;
      have[i - 1] = 1;
      vals[i - 1] = kvs.kvs[k].value;
      kvs.kvs[k].value = NULL;
    }
    etcd_kvs_free(&kvs);
    int first = 0;
    while (first < n && have[first]) first++;
    if (first == n) break;
    keyf(rz, key, "r%d/node/%d", r, first + 1);
    int left = (int)((deadline - mono_now()) * 1000.0);
    rc = left > 0 ? kv_wait(rz, c, key, left) : STORE_ETIMEDOUT;
    if (rc == 1) rc = STORE_ETIMEDOUT;
    if (rc) goto out;
  }
out:
  free(have);
  return rc;
}

/* The participant list of round r closed with n participants, P/r<r>/nodes/<n>: their
 * descriptions in join order, a line each. Whoever closes the round with n reads the n
 * descriptions and writes the list before it sets P/r<r>/closed, so that every other
 * participant reads one key instead of n: n descriptions read by each of n nodes made a
 * round's start quadratic in the nodes (in a 2048-node start on loopback, each node built
 * 2048 keys in a megabyte of buffer and the store looked up 4 million keys). Closers racing
 * with the same n write the same list; one that loses the race to another n wrote a list
 * nobody reads. *out gets the participants (rdzv_parse_node_list). -EINVAL (and an error event)
 * for a malformed description. */
static int publish_nodes(rdzv_t *rz, conn_t *c, int r, int n, rdzv_node_t **out, int timeout_ms) {
  void **vals = calloc((size_t)n, sizeof *vals);
  size_t cap = (size_t)n * (RDZV_ADDR_MAX + 32) + 1, len = 0;
  char *list = malloc(cap);
  int rc = vals && list ? read_nodes(rz, c, r, n, vals, timeout_ms) : STORE_ENOMEM;
  for (int i = 0; !rc && i < n; i++) {
    int node_rank, nproc;
    const char *addr, *end = parse_desc(vals[i], &node_rank, &nproc, &addr);
    if (!end) {
      emit_error(rz, "rendezvous round %d: node %d published a malformed description", r, i + 1);
      rc = -EINVAL;
      break;
    }
    len += (size_t)snprintf(list + len, cap - len, "%d %d %.*s\n", node_rank, nproc, (int)(end - addr), addr);
  }
  if (vals)
    for (int i = 0; i < n; i++) free(vals[i]);
  free(vals);
  char key[RDZV_KEY_MAX];
  keyf(rz, key, "r%d/nodes/%d", r, n);
  if (!rc) rc = kv_set(rz, c, key, list, 0);
  int oom = 0;
  if (!rc && !(*out = rdzv_parse_node_list(list, len, n, &oom))) rc = STORE_ENOMEM; /* our own list parses */
  free(list);
  return rc;
}

/* Reads round r's participant list (publish_nodes) into *out (rdzv_parse_node_list), waiting up to
 * timeout_ms (it is written before the round closes, so this waits only for a store that lost
 * it). With master not NULL and the store, the round's master record too, in the same request
 * (waiting for it as well), into *master (malloc'ed); with etcd *master stays NULL. -EINVAL (and
 * an error event) when the list is malformed. */
static int read_node_list(rdzv_t *rz, conn_t *c, int r, int n, rdzv_node_t **out, void **master, size_t *mlen,
                          int timeout_ms) {
  char key[RDZV_KEY_MAX], mkey[RDZV_KEY_MAX];
  keyf(rz, key, "r%d/nodes/%d", r, n);
  void *v = NULL;
  size_t len = 0;
  int rc;
  if (master && !c->e) {
    keyf(rz, mkey, "r%d/master", r);
    const char *keys[2] = {key, mkey};
    void *vals[2] = {NULL, NULL};
    size_t lens[2] = {0, 0};
    rc = store_multi_get(c->s, keys, 2, vals, lens, timeout_ms);
    v = vals[0];
    len = lens[0];
    *master = vals[1];
    *mlen = lens[1];
  } else {
    rc = kv_get_wait(rz, c, key, &v, &len, timeout_ms);
  }
  if (rc) return rc;
  int oom = 0;
  *out = rdzv_parse_node_list(v, len, n, &oom);
  free(v);
  if (*out) return 0;
  if (oom) return STORE_ENOMEM;
  emit_error(rz, "rendezvous round %d: the list of its %d participants is malformed", r, n);
  return -EINVAL;
}

/* Publishes the round to the watch thread. */
static void watch_round(rdzv_t *rz, int r, int n, int my_idx, int serves, rdzv_node_t *nodes) {
  uv_mutex_lock(&rz->mu);
  free(rz->cur_nodes);
  rz->cur_nodes = nodes;
  rz->cur_round = r;
  rz->cur_n = n;
  rz->cur_my_idx = my_idx;
  rz->cur_serves = serves;
  rz->watch_gen++;
  uv_cond_signal(&rz->watch_cond);
  uv_mutex_unlock(&rz->mu);
}

/* Waits for round r's closed key until deadline (mono_now's clock), its value into *v when v is
 * not NULL: kv_wait_get, cut at every progress interval by a line that says how many nodes have
 * joined and how long is left of what (the timeout that ends the wait), so that waiting for a
 * node that never comes is never silent. Returns as kv_wait_get. */
static int wait_closed(rdzv_t *rz, conn_t *s, int r, const char *key, double deadline, const char *what, void **v,
                       size_t *len) {
  const rdzv_config_t *c = &rz->cfg;
  for (;;) {
    double left = deadline - mono_now();
    int last = c->progress_interval_s <= 0 || c->progress_interval_s >= left;
    double slice = last ? left : c->progress_interval_s;
    int rc = kv_wait_get(rz, s, key, slice > 0 ? (int)(slice * 1000) : 0, v, len);
    if (rc != STORE_ETIMEDOUT || last) return rc;
    int64_t joined = 0;
    if ((rc = kv_joined(rz, s, r, &joined))) return rc;
    left = deadline - mono_now();
    log_info("rendezvous: %d of min %d / max %d nodes joined, %.*f s left (%s)", (int)joined, c->nnodes_min,
             c->nnodes_max, left_digits(left), left > 0 ? left : 0, what);
  }
}

static void do_join(rdzv_t *rz) {
  const rdzv_config_t *c = &rz->cfg;
  double deadline = mono_now() + c->join_timeout_s;
  int join_ms = (int)(c->join_timeout_s * 1000);
  if (ensure_conn(rz, &rz->cs, join_ms, ETCD_CMD_MS)) return;
  conn_t *s = &rz->cs;
  char key[RDZV_KEY_MAX], val[RDZV_ADDR_MAX + 64];
  int rc;
  rdzv_node_t *nodes = NULL;
  void *mv = NULL; /* the round's master record */
  size_t mlen = 0;
  if ((rc = ensure_lease(rz, s))) goto store_error;
  for (;;) {
    if (atomic_load(&rz->stop)) return;
    int64_t r64;
    keyf(rz, key, "round");
    if ((rc = read_int(s, key, 0, &r64))) goto store_error;
    int r = (int)r64;
    keyf(rz, key, "r%d/closed", r);
    int64_t closed;
    if ((rc = read_int(s, key, -1, &closed))) goto store_error;
    if (closed >= 0) {
      /* Round r is closed: over (then help bump the round) or running (we are late). */
      int ended;
      keyf(rz, key, "r%d/end", r);
      if ((rc = kv_exists(s, key, &ended))) goto store_error;
      if (ended) {
        if ((rc = bump_round(rz, s, r))) goto store_error;
        continue;
      }
      if (rdzv_late_action((int)closed, c->nnodes_max) == RDZV_LATE_SCALE_UP) {
        rdzv_end_t e = {.kind = RDZV_END_SCALE_UP, .exit_code = 0, .rank = -1, .node_idx = 0, .time = wall_now()};
        snprintf(e.host, sizeof e.host, "%s", c->addr);
        snprintf(e.reason, sizeof e.reason, "node %s joined; round %d had %d of max %d nodes", c->addr, r,
                 (int)closed, c->nnodes_max);
        log_info("round %d is running with %d of max %d nodes: asking it to restart with this node", r,
                 (int)closed, c->nnodes_max);
        if ((rc = post_end(rz, s, r, &e, (int)closed + 1))) goto store_error;
        continue;
      }
      log_info("round %d is full (%d nodes): waiting for it to end", r, (int)closed);
      rc = kv_wait(rz, s, key, -1);
      if (rc == 1) return;
      if (rc) goto store_error;
      continue;
    }
    /* Open round: take a join index, describe ourselves, then wait for it to close. */
    int64_t idx;
    if ((rc = kv_join(rz, s, r, &idx))) goto store_error;
    /* Liveness first (a heartbeat counter in the store, a key on this node's lease in etcd):
     * whoever reads our description can then count on finding it. */
    char node_key[RDZV_KEY_MAX];
    keyf(rz, key, is_etcd(rz) ? "r%d/alive/%d" : "r%d/hb/%d", r, (int)idx);
    keyf(rz, node_key, "r%d/node/%d", r, (int)idx);
    snprintf(val, sizeof val, "%d %d %s", c->node_rank, c->nproc, c->addr);
    if ((rc = kv_set_pair(rz, s, key, is_etcd(rz) ? "1" : "0", node_key, val, 1))) goto store_error;
    log_debug("round %d: joined as node %d", r, (int)idx);

    char closed_key[RDZV_KEY_MAX];
    keyf(rz, closed_key, "r%d/closed", r);
    int listed = 0; /* nodes holds the descriptions of participants 1..listed (a closer's) */
    closed = -1;    /* the count the round closed with, once known */
    rdzv_close_action_t act = rdzv_close_action((int)idx, c->nnodes_min, c->nnodes_max);
    if (act == RDZV_CLOSE_AFTER_LAST_CALL) {
      rc = wait_closed(rz, s, r, closed_key, mono_now() + c->last_call_timeout_s, "last_call_timeout", NULL, NULL);
      if (rc == 1) return;
      if (rc && rc != STORE_ETIMEDOUT) goto store_error;
    }
    if (act != RDZV_CLOSE_WAIT) {
      /* Close with everyone who has joined so far (at least us, so at least min). */
      int64_t count = idx;
      if (act == RDZV_CLOSE_AFTER_LAST_CALL) {
        if ((rc = kv_joined(rz, s, r, &count))) goto store_error;
        if (count > c->nnodes_max) count = c->nnodes_max;
      }
      /* A participant that never wrote its description: close anyway, and everyone (this node
       * too) times out waiting for the list, as they did waiting for the descriptions. */
      rc = publish_nodes(rz, s, r, (int)count, &nodes, (int)(c->close_timeout_s * 1000));
      if (rc == -EINVAL) goto out;
      if (rc && rc != STORE_ETIMEDOUT) goto store_error;
      listed = rc ? 0 : (int)count;
      snprintf(val, sizeof val, "%d", (int)count);
      void *actual = NULL;
      size_t alen = 0;
      if ((rc = kv_compare_set(rz, s, closed_key, NULL, val, 0, &actual, &alen))) goto store_error;
      if (actual) closed = strtoll(actual, NULL, 10);
      free(actual);
    } else {
      void *cv = NULL;
      size_t clen = 0;
      rc = wait_closed(rz, s, r, closed_key, deadline, "join_timeout", &cv, &clen);
      if (rc == 0) closed = strtoll(cv, NULL, 10);
      free(cv);
      if (rc == 1) return;
      if (rc == STORE_ETIMEDOUT) {
        int64_t count = 0;
        kv_joined(rz, s, r, &count);
        emit_error(rz, "rendezvous round %d did not close within join_timeout=%gs: %d of min %d nodes joined", r,
                   c->join_timeout_s, (int)count, c->nnodes_min);
        return;
      }
      if (rc) goto store_error;
    }
    if (closed < 0 && (rc = read_int(s, closed_key, -1, &closed))) goto store_error;
    if (idx > closed) {
      log_info("round %d closed with %d nodes before this node (index %d) joined", r, (int)closed, (int)idx);
      free(nodes);
      nodes = NULL;
      continue;
    }

    /* Participants 1..N: ours when this node closed the round, else the closer's list. A node
     * without --node_rank that did not join first cannot be group rank 0 (ranks follow join
     * order unless every node has one), so it reads the master record in the same request. */
    int n = (int)closed;
    int not_rank0 = c->node_rank < 0 && idx != 1;
    if (listed != n) {
      free(nodes);
      nodes = NULL;
      if ((rc = read_node_list(rz, s, r, n, &nodes, not_rank0 ? &mv : NULL, &mlen, (int)(c->close_timeout_s * 1000)))) {
        if (rc == -EINVAL) goto out;
        goto store_error;
      }
    }
    rdzv_assignment_t a;
    int rank0_idx = 0;
    char err[RDZV_MSG_MAX];
    if (rdzv_assign_ranks(nodes, n, (int)idx, &a, &rank0_idx, err, sizeof err)) {
      emit_error(rz, "rendezvous round %d: %s", r, err);
      goto out;
    }
    a.round = r;
    keyf(rz, key, "r%d/master", r);
    if (rank0_idx == idx) {
      /* A fresh port each round: the previous round's rank 0 may still hold the old one in
       * TIME_WAIT, and a PyTorch rank 0 binds MASTER_PORT itself. The failure count goes in
       * the same value, read here, before any worker of round r exists: every failure of
       * earlier rounds is in (the claimer adds it before it ends the round, and round r only
       * opens after that), and none of round r can be yet. Each node reading P/failures for
       * itself could see a failure of round r posted before a slow node got there. With
       * etcd, this node's own store serves the round's workers: its port goes in too. */
      int port = c->master_port; /* the user's, on one node; else a free one */
      if (port <= 0 && net_free_port("", &port, err, sizeof err)) {
        emit_error(rz, "choosing MASTER_PORT: %s", err);
        goto out;
      }
      int64_t failures;
      char fkey[RDZV_KEY_MAX];
      keyf(rz, fkey, "failures");
      if ((rc = read_int(s, fkey, 0, &failures))) goto store_error;
      if (rdzv_master_encode(val, sizeof val, c->addr, port, (int)failures, is_etcd(rz) ? c->node_store_port : 0)) {
        emit_error(rz, "rendezvous round %d: master endpoint %s too long", r, c->addr);
        goto out;
      }
      if ((rc = kv_set(rz, s, key, val, 0))) goto store_error;
    }
    if (!mv && (rc = kv_get_wait(rz, s, key, &mv, &mlen, (int)(c->close_timeout_s * 1000)))) goto store_error;
    if (rdzv_master_decode(mv, mlen, &a)) {
      emit_error(rz, "rendezvous round %d: malformed master record", r);
      goto out;
    }
    rdzv_event_t *ev = calloc(1, sizeof *ev);
    if (!ev) goto out;
    ev->kind = RDZV_EV_ASSIGNED;
    a.serves_store = is_etcd(rz) ? rank0_idx == idx : c->is_store_host;
    ev->assignment = a;
    watch_round(rz, r, n, (int)idx, a.serves_store, nodes);
    nodes = NULL;
    emit(rz, ev);
    free(ev);
    goto out;
  }
store_error:
  if (rc == RDZV_EFENCED)
    fenced(rz, lease_now(rz), "its etcd lease expired while it was joining (cut off from etcd for its TTL)");
  else if (rc == STORE_ETIMEDOUT)
    emit_error(rz, "rendezvous timed out: %s", conn_errmsg(s, rc));
  else
    store_lost(rz, s, rc);
out:
  free(mv);
  free(nodes);
}

/* An error of a call that a round's end depends on: fenced, or the store / etcd lost. */
static void round_call_failed(rdzv_t *rz, conn_t *c, int rc) {
  if (rc == RDZV_EFENCED)
    fenced(rz, lease_now(rz), "its etcd lease is gone: it cannot end a round it is no longer part of");
  else
    store_lost(rz, c, rc);
}

static void do_end(rdzv_t *rz, rdzv_end_t *e) {
  if (ensure_conn(rz, &rz->cs, (int)(rz->cfg.join_timeout_s * 1000), ETCD_CMD_MS)) return;
  uv_mutex_lock(&rz->mu);
  int r = rz->cur_round, n = rz->cur_n;
  e->node_idx = rz->cur_my_idx;
  uv_mutex_unlock(&rz->mu);
  int rc = post_end(rz, &rz->cs, r, e, n);
  if (rc) round_call_failed(rz, &rz->cs, rc);
}

/* etcd: the job is over (its last round's nodes are done, or have read its fatal end): its keys
 * go, so that its run id can be used again (a new job under the same id would otherwise find
 * the old job's rounds and restart budget). Done by the round's first node, best effort. */
static void forget_job(rdzv_t *rz, conn_t *c) {
  char prefix[RDZV_KEY_MAX];
  keyf(rz, prefix, "%s", "");
  int64_t n = 0;
  if (etcd_delete(c->e, prefix, 1, &n)) log_debug("deleting the job's keys in etcd: %s", etcd_errmsg(c->e));
  else log_debug("the job is over: deleted its %" PRId64 " keys in etcd", n);
}

static void do_done(rdzv_t *rz) {
  conn_t *s = &rz->cs;
  char key[RDZV_KEY_MAX];
  uv_mutex_lock(&rz->mu);
  int r = rz->cur_round, n = rz->cur_n, me = rz->cur_my_idx, serves = rz->cur_serves;
  uv_mutex_unlock(&rz->mu);
  keyf(rz, key, "r%d/done/%d", r, me);
  /* Before the set: once it lands, the host may leave at any moment, and the watch thread's
   * connection dropping then is expected, not a lost store. */
  atomic_store(&rz->done, 1);
  int rc = kv_set(rz, s, key, "1", 0);
  if (rc) {
    store_lost(rz, s, rc);
    return;
  }
  /* The node that serves the round's store waits for the others to finish (or the round to
   * end) before exiting, since leaving would take the store from under their workers. Others
   * leave at once. */
  if (serves) {
    char end_key[RDZV_KEY_MAX];
    keyf(rz, end_key, "r%d/end", r);
    int i = 1;
    while (i <= n && !atomic_load(&rz->stop)) {
      keyf(rz, key, "r%d/done/%d", r, i);
      int ended = 0;
      rc = kv_exists(s, end_key, &ended);
      if (rc || ended) break;
      rc = kv_wait(rz, s, key, (int)(rz->cfg.heartbeat_interval_s * 1000));
      if (rc == 0) i++;
      else if (rc != STORE_ETIMEDOUT) break;
    }
    if (i > n && is_etcd(rz)) forget_job(rz, s); /* everyone is done: the job is over */
  }
  rdzv_event_t ev = {.kind = RDZV_EV_DONE};
  emit(rz, &ev);
}

static void thread_exited(rdzv_t *rz) {
  uv_mutex_lock(&rz->mu);
  rz->live_threads--;
  uv_cond_signal(&rz->exit_cond);
  uv_mutex_unlock(&rz->mu);
}

static void cmd_loop(rdzv_t *rz) {
  for (;;) {
    uv_mutex_lock(&rz->mu);
    while (rz->ncmds == 0 && !atomic_load(&rz->stop)) uv_cond_wait(&rz->cmd_cond, &rz->mu);
    if (atomic_load(&rz->stop)) {
      uv_mutex_unlock(&rz->mu);
      return;
    }
    cmd_t cmd = rz->cmds[0];
    memmove(rz->cmds, rz->cmds + 1, (size_t)(rz->ncmds - 1) * sizeof cmd);
    rz->ncmds--;
    uv_mutex_unlock(&rz->mu);
    switch (cmd.kind) {
    case CMD_JOIN: do_join(rz); break;
    case CMD_END: do_end(rz, &cmd.end); break;
    case CMD_DONE: do_done(rz); break;
    }
  }
}

static void cmd_main(void *arg) {
  cmd_loop(arg);
  thread_exited(arg);
}

/* The watch thread heard from the store (a reply, or its TIMEOUT answer to a wait). */
static void store_alive(rdzv_t *rz, int watching) {
  uv_mutex_lock(&rz->mu);
  rz->last_reply = mono_now();
  rz->watching = watching;
  uv_mutex_unlock(&rz->mu);
}

/* The watchdog (loop thread, every half heartbeat interval; c10d, not on the store's own
 * node): a store silent for heartbeat_timeout while a round runs is lost. The watch thread's
 * blocked call is interrupted: it fails at once and reports (store_lost words it from
 * silent_s). */
static void on_watchdog(uv_timer_t *t) {
  rdzv_t *rz = t->data;
  if (atomic_load(&rz->stop) || atomic_load(&rz->done)) return;
  uv_mutex_lock(&rz->mu);
  double silent = mono_now() - rz->last_reply;
  if (rz->watching && rz->silent_s == 0 && silent > rz->cfg.heartbeat_timeout_s) {
    rz->silent_s = silent;
    store_interrupt(rz->ws.s);
  }
  uv_mutex_unlock(&rz->mu);
}

/* On the store's node, after a fatal end of round r: waits until each other participant has
 * acknowledged it (P/r<r>/seen/<i>), skipping those done (they have left) or silent for
 * heartbeat_timeout by hb (dead), for at most heartbeat_timeout in all: a node that dies
 * meanwhile must not keep the job from ending. */
static void drain_fatal_end(rdzv_t *rz, conn_t *s, int r, int n, int me, const char *done, const rdzv_hb_t *hb) {
  const double timeout = rz->cfg.heartbeat_timeout_s;
  double deadline = mono_now() + timeout;
  char key[RDZV_KEY_MAX];
  for (int i = 1; i <= n; i++) {
    if (i == me || (done && done[i - 1]) || (hb && hb->watched == i - 1 && rdzv_hb_is_dead(hb, i - 1, mono_now(), timeout)))
      continue;
    int is_done = 0;
    keyf(rz, key, "r%d/done/%d", r, i);
    if (kv_exists(s, key, &is_done)) return;
    if (is_done) continue;
    double left = deadline - mono_now();
    keyf(rz, key, "r%d/seen/%d", r, i);
    int rc = kv_wait(rz, s, key, left > 0 ? (int)(left * 1000) + 1 : 0);
    if (rc == STORE_ETIMEDOUT) {
      log_debug("round %d: node %d did not acknowledge the job's end within heartbeat_timeout=%gs", r, i, timeout);
      continue;
    }
    if (rc) return; /* stopped, or the connection failed: nothing more to wait for */
  }
}

/* Round r's end record (v, len) is in: tells the agent. Returns whether it is fatal. */
static int deliver_end(rdzv_t *rz, int r, const void *v, size_t len) {
  rdzv_event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return 1;
  ev->kind = RDZV_EV_ROUND_END;
  if (rdzv_end_decode(v, len, &ev->end)) {
    ev->end.kind = RDZV_END_FAILURE;
    ev->end.fatal = 1;
    ev->end.exit_code = 1;
    snprintf(ev->end.reason, sizeof ev->end.reason, "round %d ended with an unreadable reason", r);
  }
  int fatal = ev->end.fatal;
  emit(rz, ev);
  free(ev);
  return fatal;
}

/* A participant of round r is gone: ends the round as a dead node's (unless someone did). */
static int end_dead(rdzv_t *rz, conn_t *s, int r, int n, int me, const rdzv_node_t *nodes, const char *done, int i,
                    const char *what) {
  int survivors = 0;
  for (int j = 0; j < n; j++)
    if (j != i && !done[j]) survivors++;
  rdzv_end_t e = {.kind = RDZV_END_DEAD_NODE, .exit_code = 1, .rank = -1, .node_idx = me, .time = wall_now()};
  snprintf(e.host, sizeof e.host, "%s", nodes[i].addr);
  snprintf(e.reason, sizeof e.reason, "node %d (%s) %s; %d node(s) remain, min %d", i + 1, nodes[i].addr, what,
           survivors, rz->cfg.nnodes_min);
  log_warn("%s", e.reason);
  return post_end(rz, s, r, &e, survivors);
}

/* After round r's fatal end. The job is over, and the store with it once its node exits (c10d;
 * with etcd, the round's workers' store): that node waits until every other one has read the
 * end (at most heartbeat_timeout; else they would find the store gone and report that instead
 * of the job's real end), with etcd then deletes the job's keys, and lets its agent go
 * (DRAINED). The others say they have read it (best effort: the wait has a deadline). hb: the
 * round's heartbeat verdicts (c10d; NULL with etcd, whose dead nodes have ended the round). */
static void job_over(rdzv_t *rz, conn_t *s, int r, int n, int me, const char *done, const rdzv_hb_t *hb) {
  char key[RDZV_KEY_MAX];
  uv_mutex_lock(&rz->mu);
  int serves = rz->cur_serves;
  uv_mutex_unlock(&rz->mu);
  if (!serves) {
    keyf(rz, key, "r%d/seen/%d", r, me);
    kv_set(rz, s, key, "1", 0);
    return;
  }
  drain_fatal_end(rz, s, r, n, me, done, hb);
  if (is_etcd(rz)) forget_job(rz, s);
  rdzv_event_t dr = {.kind = RDZV_EV_DRAINED};
  emit(rz, &dr);
}

/* Reads whether participant i (0-based) of round r has said it is done, into done[i]. */
static int read_done(rdzv_t *rz, conn_t *s, int r, int i, char *done) {
  char key[RDZV_KEY_MAX];
  int exist = 0;
  keyf(rz, key, "r%d/done/%d", r, i + 1);
  int rc = kv_exists(s, key, &exist);
  if (!rc && exist) done[i] = 1;
  return rc;
}

/* c10d: watches one round: its end key (event-driven), our heartbeat, the peers' heartbeats. */
static void watch_store(rdzv_t *rz, int gen, int r, int n, int me, const rdzv_node_t *nodes) {
  const rdzv_config_t *c = &rz->cfg;
  conn_t *s = &rz->ws;
  char end_key[RDZV_KEY_MAX], key[RDZV_KEY_MAX];
  keyf(rz, end_key, "r%d/end", r);
  rdzv_hb_t hb;
  if (rdzv_hb_init(&hb, n, mono_now())) return;
  char *done = calloc((size_t)n, 1);
  int64_t counter = 0;
  int interval_ms = (int)(c->heartbeat_interval_s * 1000);
  if (interval_ms < 1) interval_ms = 1;
  int rc = 0;
  int posted = 0;
  store_alive(rz, 1); /* the round starts now: silence counts from here */
  while (!atomic_load(&rz->stop) && done) {
    uv_mutex_lock(&rz->mu);
    int stale = rz->watch_gen != gen;
    uv_mutex_unlock(&rz->mu);
    if (stale) break;
    /* Wait and read in one request: the value is in hand even if the store goes away next. */
    void *v = NULL;
    size_t len = 0;
    rc = kv_get_wait(rz, s, end_key, &v, &len, interval_ms);
    if (rc == 0 || rc == STORE_ETIMEDOUT) store_alive(rz, 1);
    if (rc == 0) {
      int fatal = deliver_end(rz, r, v, len);
      free(v);
      if (fatal) job_over(rz, s, r, n, me, done, &hb);
      goto out;
    }
    if (rc != STORE_ETIMEDOUT) break;
    keyf(rz, key, "r%d/hb/%d", r, me);
    char val[32];
    snprintf(val, sizeof val, "%lld", (long long)++counter);
    if ((rc = kv_set(rz, s, key, val, 0))) break;
    store_alive(rz, 1);
    double now = mono_now();
    /* The ring (rdzv_hb_t): the next peer not done; when it is done, the one after it. */
    for (int i; !posted && (i = rdzv_hb_next(done, n, me - 1)) >= 0;) {
      int64_t v;
      keyf(rz, key, "r%d/hb/%d", r, i + 1);
      if ((rc = read_int(s, key, 0, &v))) goto lost;
      store_alive(rz, 1);
      int fresh = hb.watched != i;
      rdzv_hb_follow(&hb, i, v, now);
      int dead = rdzv_hb_is_dead(&hb, i, now, c->heartbeat_timeout_s);
      if (!dead && !fresh) break;
      /* Silent, or followed from now on (it may have finished long ago: ask now rather than
       * after a heartbeat_timeout of its silence). */
      if ((rc = read_done(rz, s, r, i, done))) goto lost;
      if (done[i]) continue;
      if (!dead) break;
      char what[128];
      snprintf(what, sizeof what, "sent no heartbeat for %.1fs (heartbeat_timeout=%gs)", now - hb.changed_at[i],
               c->heartbeat_timeout_s);
      if ((rc = end_dead(rz, s, r, n, me, nodes, done, i, what))) goto lost;
      posted = 1;
    }
  }
lost:
  /* Any error here is the connection's: the wait's own timeout (the server's TIMEOUT reply)
   * never gets here, so STORE_ETIMEDOUT means a reply that never came and a broken stream. */
  if (rc && !atomic_load(&rz->stop) && !atomic_load(&rz->done)) store_lost(rz, s, rc);
out:
  store_alive(rz, 0);
  free(done);
  rdzv_hb_free(&hb);
}

/* etcd: watches one round: every key under P/r<r>/ from one read's revision on, so no change
 * is missed between reads. The end key ends the watch; a participant's alive key deleted (its
 * lease expired or was revoked) while it is not done is a dead node. Between events, every
 * heartbeat interval, this node's lease is renewed. */
static void watch_etcd(rdzv_t *rz, int gen, int r, int n, int me, const rdzv_node_t *nodes) {
  const rdzv_config_t *c = &rz->cfg;
  conn_t *s = &rz->ws;
  char prefix[RDZV_KEY_MAX], end_key[RDZV_KEY_MAX], alive_prefix[RDZV_KEY_MAX];
  keyf(rz, prefix, "r%d/", r);
  keyf(rz, end_key, "r%d/end", r);
  keyf(rz, alive_prefix, "r%d/alive/", r);
  char *done = calloc((size_t)n, 1), *alive = malloc((size_t)n);
  int interval_ms = (int)(c->heartbeat_interval_s * 1000);
  if (interval_ms < 1) interval_ms = 1;
  int posted = 0, rc = 0, reread = 1;
  int64_t rev = 0;
  double next_renewal = 0, gone_since = 0; /* when a participant was first seen gone, not done */
  while (done && alive && !atomic_load(&rz->stop)) {
    uv_mutex_lock(&rz->mu);
    int stale = rz->watch_gen != gen;
    uv_mutex_unlock(&rz->mu);
    if (stale || renew_lease(rz, s, &next_renewal)) break;
    etcd_kvs_t kvs;
    const void *end = NULL; /* the end record, once found */
    size_t end_len = 0;
    if (reread) {
      /* Cheap first: whether the round has ended (reading its end key gives the revision to
       * watch from), then how many alive keys it has, a count rather than the keys: each node
       * reading every node's keys made a 2048-node round's start quadratic in bytes. All n
       * alive: nobody has left, and the watch starts from the end key's read. Fewer: the
       * round's keys say who is alive and who is done. */
      if ((rc = etcd_get_prefix(s->e, end_key, &kvs))) goto retry;
      int e = find_key(&kvs, end_key);
      rev = kvs.revision;
      if (e >= 0) {
        end = kvs.kvs[e].value, end_len = kvs.kvs[e].len;
      } else {
        etcd_kvs_free(&kvs);
        int64_t count = 0;
        if ((rc = etcd_count(s->e, alive_prefix, 0, &count, NULL))) goto retry;
        memset(alive, 1, (size_t)n);
        if (count < n) {
          if ((rc = etcd_get_prefix(s->e, prefix, &kvs))) goto retry;
          rev = kvs.revision;
          memset(alive, 0, (size_t)n);
          for (size_t k = 0; k < kvs.n; k++) {
            int i;
            if ((i = key_idx(kvs.kvs[k].key, prefix, "alive", n))) alive[i - 1] = 1;
            if ((i = key_idx(kvs.kvs[k].key, prefix, "done", n))) done[i - 1] = 1;
            if (!strcmp(kvs.kvs[k].key, end_key)) end = kvs.kvs[k].value, end_len = kvs.kvs[k].len;
          }
        }
      }
      reread = 0;
    } else {
      rc = etcd_watch(s->e, prefix, 1, rev, interval_ms, &kvs);
      if (rc == -ESTALE) {
        reread = 1;
        continue;
      }
      if (rc && rc != -ETIMEDOUT) goto retry;
      rev = kvs.revision;
      for (size_t k = 0; k < kvs.n && !end; k++) {
        const etcd_kv_t *ev = &kvs.kvs[k];
        int i;
        if (!ev->deleted && !strcmp(ev->key, end_key)) end = ev->value, end_len = ev->len;
        if (!ev->deleted && (i = key_idx(ev->key, prefix, "done", n))) done[i - 1] = 1;
        if (ev->deleted && (i = key_idx(ev->key, prefix, "alive", n))) alive[i - 1] = 0;
      }
    }
    if (end) {
      int fatal = deliver_end(rz, r, end, end_len);
      etcd_kvs_free(&kvs);
      if (fatal) job_over(rz, s, r, n, me, done, NULL);
      break;
    }
    etcd_kvs_free(&kvs);
    /* A participant without its lease that is not done is dead. The one that follows it in
     * the ring of rdzv_hb_next ends the round at once; the others wait heartbeat_timeout for
     * that end before they post it too (any death leaves a live node that follows a dead one).
     * Every node reading, claiming and posting at once was three thousand etcd requests in a
     * burst at 1024 nodes. */
    for (;;) {
      int gone = -1, next = rdzv_hb_next(done, n, me - 1);
      for (int i = 0; i < n && gone < 0; i++)
        if (i + 1 != me && !alive[i] && !done[i]) gone = i;
      if (gone < 0 || posted) {
        gone_since = 0;
        break;
      }
      if (!gone_since) gone_since = mono_now();
      if (next >= 0 && !alive[next]) gone = next;
      else if (mono_now() - gone_since <= c->heartbeat_timeout_s) break;
      /* Its done key may predate the watch (a count does not say who is done). */
      if ((rc = read_done(rz, s, r, gone, done))) goto retry;
      if (done[gone]) continue;
      if ((rc = end_dead(rz, s, r, n, me, nodes, done, gone,
                         "lost its etcd lease (it left, or died, or was cut off for its TTL)")))
        goto failed;
      posted = 1;
    }
    continue;
  retry:
    /* No member answered in the client's time: the lease decides (renew_lease fences this
     * node once its TTL has passed without a renewal); meanwhile, try again after a pause. */
    log_debug("round %d: watching etcd: %s", r, etcd_errmsg(s->e));
    for (double until = mono_now() + c->heartbeat_interval_s; mono_now() < until && !atomic_load(&rz->stop);) {
      struct timespec ts = {0, 20 * 1000000L};
      nanosleep(&ts, NULL);
    }
    reread = 1;
    continue;
  failed:
    if (!atomic_load(&rz->stop) && !atomic_load(&rz->done)) round_call_failed(rz, s, rc);
    break;
  }
  free(done);
  free(alive);
}

static void watch_loop(rdzv_t *rz) {
  int seen = 0;
  double next_renewal = 0;
  /* The watch thread's etcd calls are bounded well under the lease's TTL, so that a hung
   * member cannot keep it from renewing through another one. */
  int watch_ms = (int)(rz->cfg.heartbeat_timeout_s * 500);
  if (watch_ms < ETCD_WATCH_MIN_MS) watch_ms = ETCD_WATCH_MIN_MS;
  rz->watch_call_ms = watch_ms; /* the watch thread's alone */
  for (;;) {
    uv_mutex_lock(&rz->mu);
    while (rz->watch_gen == seen && !atomic_load(&rz->stop)) {
      if (!is_etcd(rz) || !rz->lease) {
        uv_cond_wait(&rz->watch_cond, &rz->mu);
        continue;
      }
      /* etcd between rounds (joining, restarting): the lease still needs renewing. */
      uv_mutex_unlock(&rz->mu);
      if (ensure_conn(rz, &rz->ws, (int)(rz->cfg.join_timeout_s * 1000), watch_ms) == 0)
        renew_lease(rz, &rz->ws, &next_renewal);
      uv_mutex_lock(&rz->mu);
      if (rz->watch_gen == seen && !atomic_load(&rz->stop))
        uv_cond_timedwait(&rz->watch_cond, &rz->mu, (uint64_t)(rz->cfg.heartbeat_interval_s * 1e9 / 2) + 1);
    }
    if (atomic_load(&rz->stop)) {
      uv_mutex_unlock(&rz->mu);
      return;
    }
    seen = rz->watch_gen;
    int r = rz->cur_round, n = rz->cur_n, me = rz->cur_my_idx;
    rdzv_node_t *nodes = rz->cur_nodes; /* ours now: the next round's join brings its own */
    rz->cur_nodes = NULL;
    uv_mutex_unlock(&rz->mu);
    if (!nodes) continue;
    if (ensure_conn(rz, &rz->ws, (int)(rz->cfg.join_timeout_s * 1000), watch_ms) == 0) {
      if (is_etcd(rz)) watch_etcd(rz, seen, r, n, me, nodes);
      else watch_store(rz, seen, r, n, me, nodes);
    }
    free(nodes);
  }
}

static void watch_main(void *arg) {
  watch_loop(arg);
  thread_exited(arg);
}

static void free_rdzv(rdzv_t *rz) {
  conn_close(&rz->cs);
  conn_close(&rz->ws);
  free(rz->events);
  free(rz->cur_nodes);
  free(rz);
}

int rdzv_create(rdzv_t **out, uv_loop_t *loop, const rdzv_config_t *cfg, rdzv_event_cb cb, void *arg, char *err,
                size_t errlen) {
  *out = NULL;
  rdzv_t *rz = calloc(1, sizeof *rz);
  if (!rz) {
    store_close(cfg->conn);
    return err_set(err, errlen, -ENOMEM, "rdzv: out of memory");
  }
  rz->cfg = *cfg;
  rz->cfg.conn = NULL;
  rz->cs.s = cfg->conn; /* one connection fewer per node: the agent's probe already shook hands */
  if (rz->cs.s) atomic_store(&rz->reached, 1);
  rz->loop = loop;
  rz->cb = cb;
  rz->arg = arg;
  snprintf(rz->prefix, sizeof rz->prefix, "meshrun/%s/", cfg->run_id);
  int rc, nsync = 0, nthr = 0;
  if ((rc = uv_mutex_init(&rz->mu))) goto error;
  nsync++;
  if ((rc = uv_cond_init(&rz->cmd_cond))) goto error;
  nsync++;
  if ((rc = uv_cond_init(&rz->watch_cond))) goto error;
  nsync++;
  if ((rc = uv_cond_init(&rz->exit_cond))) goto error;
  nsync++;
  /* The threads touch the async handle only when a command makes them emit, and no command
   * can come before we return, so it is initialized last: a failure before it needs no loop
   * run to undo. */
  rz->live_threads = 2;
  if ((rc = uv_thread_create(&rz->cmd_thr, cmd_main, rz))) goto error;
  nthr++;
  if ((rc = uv_thread_create(&rz->watch_thr, watch_main, rz))) goto error;
  nthr++;
  if ((rc = uv_async_init(loop, &rz->async, on_async))) goto error;
  rz->async.data = rz;
  /* After the async handle, so the error path above has no handle to close. It never fails
   * (libuv's timer init only fills the struct). */
  uv_timer_init(loop, &rz->watchdog);
  rz->watchdog.data = rz;
  if (!cfg->is_store_host && cfg->kv == RDZV_KV_C10D) {
    /* The store's own node needs none: its store stalls only when its loop does, and then
     * this timer would not run either. etcd needs none: the lease is the liveness there. */
    uint64_t period = (uint64_t)(cfg->heartbeat_interval_s * 500);
    if (period < 10) period = 10;
    uv_timer_start(&rz->watchdog, on_watchdog, period, period);
  }
  *out = rz;
  return 0;
error:
  /* Half-built: the threads that started see stop at once (no command queued) and are joined. */
  err_set(err, errlen, 0, "rdzv: starting: %s", uv_strerror(rc));
  uv_mutex_lock(&rz->mu);
  atomic_store(&rz->stop, 1);
  uv_cond_broadcast(&rz->cmd_cond);
  uv_cond_broadcast(&rz->watch_cond);
  uv_mutex_unlock(&rz->mu);
  if (nthr > 0) uv_thread_join(&rz->cmd_thr);
  if (nthr > 1) uv_thread_join(&rz->watch_thr);
  if (nsync > 3) uv_cond_destroy(&rz->exit_cond);
  if (nsync > 2) uv_cond_destroy(&rz->watch_cond);
  if (nsync > 1) uv_cond_destroy(&rz->cmd_cond);
  if (nsync > 0) uv_mutex_destroy(&rz->mu);
  free_rdzv(rz);
  return rc;
}

static void push_cmd(rdzv_t *rz, const cmd_t *c) {
  uv_mutex_lock(&rz->mu);
  if (rz->ncmds < (int)(sizeof rz->cmds / sizeof rz->cmds[0])) rz->cmds[rz->ncmds++] = *c;
  else log_error("rdzv: command queue full");
  uv_cond_signal(&rz->cmd_cond);
  uv_mutex_unlock(&rz->mu);
}

void rdzv_join(rdzv_t *rz) {
  cmd_t c = {.kind = CMD_JOIN};
  push_cmd(rz, &c);
}

void rdzv_end_round(rdzv_t *rz, const rdzv_end_t *e) {
  cmd_t c = {.kind = CMD_END, .end = *e};
  push_cmd(rz, &c);
}

void rdzv_done(rdzv_t *rz) {
  cmd_t c = {.kind = CMD_DONE};
  push_cmd(rz, &c);
}

void rdzv_shutdown(rdzv_t *rz) {
  if (!rz) return;
  uv_mutex_lock(&rz->mu);
  atomic_store(&rz->stop, 1);
  uv_cond_broadcast(&rz->cmd_cond);
  uv_cond_broadcast(&rz->watch_cond);
  uv_mutex_unlock(&rz->mu);
  if (!uv_is_closing((uv_handle_t *)&rz->async)) uv_close((uv_handle_t *)&rz->async, NULL);
  if (!uv_is_closing((uv_handle_t *)&rz->watchdog)) uv_close((uv_handle_t *)&rz->watchdog, NULL);
}

/* etcd, at exit: the lease goes now rather than after its TTL, so the other nodes see this
 * one leave at once (a node stopped by a signal is a node gone; one that finished has said so
 * in its done key first). On a client of its own: the threads' clients are interrupted. */
static void revoke_lease(rdzv_t *rz) {
  int64_t lease = lease_now(rz); /* a thread still busy may hold mu's data */
  if (!is_etcd(rz) || !lease) return;
  etcd_t *e = NULL;
  char err[512] = "out of memory";
  uv_mutex_lock(&rz->mu);
  etcd_t *first = rz->cs.e; /* interrupted: a clone of it is not */
  uv_mutex_unlock(&rz->mu);
  int rc = first ? etcd_clone(&e, first) : etcd_connect(&e, rz->cfg.etcd_endpoints, ETCD_REVOKE_MS, err, sizeof err);
  if (rc == 0) {
    etcd_set_timeout(e, ETCD_REVOKE_MS);
    rc = etcd_lease_revoke(e, lease);
    if (rc && rc != -ENOENT) log_debug("revoking the etcd lease: %s", etcd_errmsg(e));
  } else {
    log_debug("revoking the etcd lease: %s", err);
  }
  etcd_close(e);
}

int rdzv_destroy(rdzv_t *rz, int wait_ms) {
  if (!rz) return 0;
  rdzv_shutdown(rz);
  uv_mutex_lock(&rz->mu);
  /* Wake calls in progress: they fail at once (etcd's within about a second), see stop and
   * return. */
  conn_interrupt(&rz->cs);
  conn_interrupt(&rz->ws);
  uint64_t deadline = uv_hrtime() + (uint64_t)(wait_ms > 0 ? wait_ms : 0) * 1000000u;
  while (rz->live_threads > 0) {
    uint64_t t = uv_hrtime();
    if (t >= deadline || uv_cond_timedwait(&rz->exit_cond, &rz->mu, deadline - t) == UV_ETIMEDOUT) break;
  }
  int live = rz->live_threads;
  uv_mutex_unlock(&rz->mu);
  revoke_lease(rz);
  if (live > 0) return -EBUSY; /* left to the threads; the process's exit ends them */
  uv_thread_join(&rz->cmd_thr);
  uv_thread_join(&rz->watch_thr);
  uv_cond_destroy(&rz->exit_cond);
  uv_cond_destroy(&rz->watch_cond);
  uv_cond_destroy(&rz->cmd_cond);
  uv_mutex_destroy(&rz->mu);
  free_rdzv(rz);
  return 0;
}

/* ---- pure decision logic ---- */

rdzv_close_action_t rdzv_close_action(int idx, int nmin, int nmax) {
  if (idx >= nmax) return RDZV_CLOSE_NOW;
  if (idx >= nmin) return RDZV_CLOSE_AFTER_LAST_CALL;
  return RDZV_CLOSE_WAIT;
}

rdzv_late_action_t rdzv_late_action(int closed_n, int nmax) {
  return closed_n < nmax ? RDZV_LATE_SCALE_UP : RDZV_LATE_WAIT_END;
}

typedef struct {
  int key, i; /* node rank or join index; the node's place in the list */
} sort_key_t;

/* Ties (equal node ranks, an error found after the sort) by place, so the message is stable. */
static int by_key(const void *pa, const void *pb) {
  const sort_key_t *a = pa, *b = pb;
  if (a->key != b->key) return a->key < b->key ? -1 : 1;
  return (a->i > b->i) - (a->i < b->i);
}

int rdzv_assign_ranks(const rdzv_node_t *nodes, int n, int my_idx, rdzv_assignment_t *a, int *rank0_idx, char *err,
                      size_t errlen) {
  if (n <= 0) {
    return err_set(err, errlen, -EINVAL, "no participants");
  }
  /* By node rank only when every node gave one; then they must be distinct. */
  int by_rank = 1;
  for (int i = 0; i < n; i++)
    if (nodes[i].node_rank < 0) by_rank = 0;
  sort_key_t *order = malloc((size_t)n * sizeof *order);
  if (!order) {
    return err_set(err, errlen, -ENOMEM, "out of memory");
  }
  int sorted = 1; /* by join index they always are: the list is in join order */
  for (int i = 0; i < n; i++) {
    order[i] = (sort_key_t){by_rank ? nodes[i].node_rank : nodes[i].idx, i};
    if (i && by_key(&order[i - 1], &order[i]) > 0) sorted = 0;
  }
  if (!sorted) qsort(order, (size_t)n, sizeof *order, by_key);
  if (by_rank)
    for (int i = 1; i < n; i++)
      if (order[i].key == order[i - 1].key) {
        err_set(err, errlen, 0, "two nodes (%s and %s) both have --node_rank=%d", nodes[order[i - 1].i].addr,
                nodes[order[i].i].addr, order[i].key);
        free(order);
        return -EINVAL;
      }
  int found = 0, offset = 0, world = 0;
  memset(a, 0, sizeof *a);
  for (int g = 0; g < n; g++) {
    const rdzv_node_t *nd = &nodes[order[g].i];
    if (nd->idx == my_idx) {
      found = 1;
      a->group_rank = g;
      a->rank_offset = offset;
      a->nproc = nd->nproc;
      a->my_idx = my_idx;
    }
    offset += nd->nproc;
    world += nd->nproc;
  }
  *rank0_idx = nodes[order[0].i].idx;
  free(order);
  if (!found) {
    return err_set(err, errlen, -EINVAL, "node %d is not a participant", my_idx);
  }
  a->nnodes = n;
  a->world_size = world;
  return 0;
}

int rdzv_end_fatal(rdzv_end_kind_t kind, int64_t failures, int max_restarts, int survivors, int nmin) {
  switch (kind) {
  case RDZV_END_FAILURE: return failures > max_restarts;
  case RDZV_END_DEAD_NODE: return survivors < nmin;
  case RDZV_END_SCALE_UP: return 0;
  }
  return 1;
}

int rdzv_master_encode(char *buf, size_t len, const char *addr, int port, int failures, int store_port) {
  size_t alen = strlen(addr);
  if (alen == 0 || alen >= RDZV_ADDR_MAX || strpbrk(addr, " \t\n")) return -EINVAL;
  int w = store_port > 0 ? snprintf(buf, len, "%s %d %d %d", addr, port, failures, store_port)
                         : snprintf(buf, len, "%s %d %d", addr, port, failures);
  return w < 0 || (size_t)w >= len ? -ENAMETOOLONG : 0;
}

int rdzv_master_decode(const char *v, size_t len, rdzv_assignment_t *a) {
  char tmp[RDZV_ADDR_MAX + 64], addr[RDZV_ADDR_MAX];
  int port, failures, store_port = 0, used = 0, used4 = 0;
  if (len >= sizeof tmp) return -EINVAL;
  memcpy(tmp, v, len);
  tmp[len] = 0;
  if (sscanf(tmp, "%255s %d %d%n", addr, &port, &failures, &used) != 3) return -EINVAL;
  if (tmp[used] != 0 && (sscanf(tmp + used, " %d%n", &store_port, &used4) != 1 || tmp[used + used4] != 0 ||
                         store_port <= 0 || store_port > 65535))
    return -EINVAL;
  if (port <= 0 || port > 65535 || failures < 0) return -EINVAL;
  snprintf(a->master_addr, sizeof a->master_addr, "%s", addr);
  a->master_port = port;
  a->failures = failures;
  a->store_port = store_port;
  return 0;
}

int rdzv_hb_init(rdzv_hb_t *hb, int n, double now) {
  hb->n = n;
  hb->watched = -1;
  hb->value = calloc((size_t)n, sizeof *hb->value);
  hb->changed_at = calloc((size_t)n, sizeof *hb->changed_at);
  if (!hb->value || !hb->changed_at) {
    rdzv_hb_free(hb);
    return -ENOMEM;
  }
  for (int i = 0; i < n; i++) hb->changed_at[i] = now;
  return 0;
}

void rdzv_hb_free(rdzv_hb_t *hb) {
  if (!hb) return;
  free(hb->value);
  free(hb->changed_at);
  hb->value = NULL;
  hb->changed_at = NULL;
  hb->n = 0;
}

void rdzv_hb_observe(rdzv_hb_t *hb, int slot, int64_t value, double now) {
  if (slot < 0 || slot >= hb->n) return;
  if (value != hb->value[slot]) {
    hb->value[slot] = value;
    hb->changed_at[slot] = now;
  }
}

void rdzv_hb_follow(rdzv_hb_t *hb, int slot, int64_t value, double now) {
  if (slot < 0 || slot >= hb->n) return;
  if (hb->watched >= 0 && slot != hb->watched) {
    hb->value[slot] = value;
    hb->changed_at[slot] = now;
  } else {
    rdzv_hb_observe(hb, slot, value, now);
  }
  hb->watched = slot;
}

int rdzv_hb_next(const char *done, int n, int me) {
  for (int k = 1; k < n; k++) {
    int i = (me + k) % n;
    if (!done[i]) return i;
  }
  return -1;
}

int rdzv_hb_is_dead(const rdzv_hb_t *hb, int slot, double now, double timeout) {
  if (slot < 0 || slot >= hb->n) return 0;
  return now - hb->changed_at[slot] > timeout;
}

const char *rdzv_end_kind_name(rdzv_end_kind_t k) {
  switch (k) {
  case RDZV_END_FAILURE: return "failure";
  case RDZV_END_DEAD_NODE: return "dead_node";
  case RDZV_END_SCALE_UP: return "scale_up";
  }
  return "unknown";
}

char *rdzv_end_encode(const rdzv_end_t *e) {
  cJSON *o = cJSON_CreateObject();
  if (!o) return NULL;
  cJSON_AddStringToObject(o, "kind", rdzv_end_kind_name(e->kind));
  cJSON_AddBoolToObject(o, "fatal", e->fatal);
  cJSON_AddNumberToObject(o, "exit_code", e->exit_code);
  cJSON_AddNumberToObject(o, "rank", e->rank);
  cJSON_AddNumberToObject(o, "local_rank", e->local_rank);
  cJSON_AddNumberToObject(o, "signal", e->signal);
  cJSON_AddNumberToObject(o, "time", e->time);
  cJSON_AddNumberToObject(o, "node_idx", e->node_idx);
  cJSON_AddStringToObject(o, "host", e->host);
  cJSON_AddStringToObject(o, "message", e->message);
  cJSON_AddStringToObject(o, "reason", e->reason);
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

static int get_num(const cJSON *o, const char *name, double *out) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
  if (!cJSON_IsNumber(x)) return -1;
  *out = x->valuedouble;
  return 0;
}

static void get_str(const cJSON *o, const char *name, char *out, size_t len) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
  snprintf(out, len, "%s", cJSON_IsString(x) ? x->valuestring : "");
}

int rdzv_end_decode(const char *json, size_t len, rdzv_end_t *e) {
  memset(e, 0, sizeof *e);
  cJSON *o = cJSON_ParseWithLength(json, len);
  if (!o) return -EINVAL;
  int rc = -EINVAL;
  char kind[32];
  get_str(o, "kind", kind, sizeof kind);
  if (!strcmp(kind, "failure")) e->kind = RDZV_END_FAILURE;
  else if (!strcmp(kind, "dead_node")) e->kind = RDZV_END_DEAD_NODE;
  else if (!strcmp(kind, "scale_up")) e->kind = RDZV_END_SCALE_UP;
  else goto out;
  double d;
  const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, "fatal");
  if (!cJSON_IsBool(f)) goto out;
  e->fatal = cJSON_IsTrue(f);
  if (get_num(o, "exit_code", &d)) goto out;
  e->exit_code = (int)d;
  if (get_num(o, "rank", &d)) goto out;
  e->rank = (int)d;
  if (get_num(o, "local_rank", &d)) goto out;
  e->local_rank = (int)d;
  if (get_num(o, "signal", &d)) goto out;
  e->signal = (int)d;
  if (get_num(o, "time", &d)) goto out;
  e->time = d;
  if (get_num(o, "node_idx", &d)) goto out;
  e->node_idx = (int)d;
  get_str(o, "host", e->host, sizeof e->host);
  get_str(o, "message", e->message, sizeof e->message);
  get_str(o, "reason", e->reason, sizeof e->reason);
  rc = 0;
out:
  cJSON_Delete(o);
  return rc;
}
