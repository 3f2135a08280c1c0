/* rdzv_kv_store: the rendezvous keys in meshrun's c10d-like store (common/store.h). Liveness is
 * a heartbeat counter per participant that the watch thread bumps every heartbeat interval and
 * that its peers judge (rdzv_hb_t); the store's own liveness is judged by rdzv's watchdog from
 * the watch thread's replies (store_alive). Waits are cut into slices of at most RDZV_SLICE_MS
 * so that the stop flag is seen promptly. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "launcher/rdzv_kv.h"

#define RDZV_SLICE_MS 500

static store_t *client(const rdzv_conn_t *c) { return c->client; }

static const char *kv_errmsg(const rdzv_conn_t *c, int rc) {
  return c->client ? store_errmsg(client(c)) : store_strerror(rc);
}

/* The store has no leases: leased is ignored. */
static int kv_set(rdzv_t *rz, rdzv_conn_t *c, const char *key, const char *val, int leased) {
  return store_set(client(c), key, val, strlen(val));
}

static int kv_set_pair(rdzv_t *rz, rdzv_conn_t *c, const char *k1, const char *v1, const char *k2, const char *v2,
                       int leased) {
  const char *keys[2] = {k1, k2};
  const void *vals[2] = {v1, v2};
  size_t lens[2] = {strlen(v1), strlen(v2)};
  return store_multi_set(client(c), keys, vals, lens, 2);
}

static int kv_get_nowait(rdzv_conn_t *c, const char *key, void **v, size_t *len) {
  return store_get_nowait(client(c), key, v, len);
}

static int kv_get_pair(rdzv_conn_t *c, const char *k1, const char *k2, void **v1, size_t *l1, void **v2, size_t *l2,
                       int timeout_ms) {
  const char *keys[2] = {k1, k2};
  void *vals[2] = {NULL, NULL};
  size_t lens[2] = {0, 0};
  int rc = store_multi_get(client(c), keys, 2, vals, lens, timeout_ms);
  *v1 = vals[0];
  *l1 = lens[0];
  *v2 = vals[1];
  *l2 = lens[1];
  return rc;
}

static int kv_add(rdzv_conn_t *c, const char *key, int64_t delta, int64_t *out) {
  return store_add(client(c), key, delta, out);
}

static int kv_compare_set(rdzv_t *rz, rdzv_conn_t *c, const char *key, const char *expected, const char *desired,
                          int leased, void **actual, size_t *alen) {
  *actual = NULL;
  *alen = 0;
  return store_compare_set(client(c), key, expected, expected ? strlen(expected) : 0, desired, strlen(desired),
                           actual, alen);
}

static int kv_exists(rdzv_conn_t *c, const char *key, int *exist) {
  const char *k[1] = {key};
  return store_check(client(c), k, 1, exist);
}

/* In slices, so the stop flag is seen; with v, the wait and the read are one request. */
static int kv_wait_get(rdzv_t *rz, rdzv_conn_t *c, const char *key, int timeout_ms, void **v, size_t *len) {
  if (v) *v = NULL;
  double deadline = rdzv_mono_now() + timeout_ms / 1000.0;
  const char *k[1] = {key};
  for (;;) {
    if (atomic_load(&rz->stop)) return 1;
    int slice = RDZV_SLICE_MS;
    if (timeout_ms >= 0) {
      double left = (deadline - rdzv_mono_now()) * 1000.0;
      if (left <= 0) return STORE_ETIMEDOUT;
      if (left < slice) slice = (int)left + 1;
    }
    int rc = v ? store_get(client(c), key, v, len, slice) : store_wait(client(c), k, 1, slice);
    if (rc != STORE_ETIMEDOUT) return rc;
  }
}

static int kv_get_wait(rdzv_t *rz, rdzv_conn_t *c, const char *key, void **v, size_t *len, int timeout_ms) {
  return store_get(client(c), key, v, len, timeout_ms);
}

static void kv_interrupt(rdzv_conn_t *c) { store_interrupt(client(c)); }

static void kv_close(rdzv_conn_t *c) {
  store_close(client(c));
  c->client = NULL;
}

/* The store adds 1 to P/r<r>/n. */
static int kv_join(rdzv_t *rz, rdzv_conn_t *c, int r, int64_t *idx) {
  char key[RDZV_KEY_MAX];
  rdzv_keyf(rz, key, "r%d/n", r);
  return store_add(client(c), key, 1, idx);
}

static int kv_joined(rdzv_t *rz, rdzv_conn_t *c, int r, int64_t *count) {
  char key[RDZV_KEY_MAX];
  rdzv_keyf(rz, key, "r%d/n", r);
  return store_add(client(c), key, 0, count);
}

/* store_connect until timeout_ms, in slices of the progress interval while the store has never
 * been reached: nothing accepting the connection means its node has not started yet, and that
 * wait is said once a slice, with the time left. An endpoint that accepts and does not answer
 * the handshake (hs ms), or answers as something else, ends it at once. */
static int kv_connect(rdzv_t *rz, const rdzv_conn_t *conn, void **s, int timeout_ms, int hs, char *err,
                      size_t errlen) {
  const rdzv_config_t *c = &rz->cfg;
  store_auth_t auth = {.run_id = c->run_id, .secret = c->secret, .handshake_ms = hs};
  double deadline = rdzv_mono_now() + timeout_ms / 1000.0;
  for (;;) {
    double left = deadline - rdzv_mono_now();
    int quiet = c->progress_interval_s <= 0 || c->progress_interval_s >= left || atomic_load(&rz->reached);
    double slice = quiet ? left : c->progress_interval_s;
    int rc = store_connect((store_t **)s, c->store_host, c->store_port, &auth,
                           slice > 0.001 ? (int)(slice * 1000) : 1, err, errlen);
    if (rc != STORE_ECONNECT) return rc;
    /* net's " (gave up after N ms)" is a slice's, not the wait's: the lines name the wait. */
    char *tail = strstr(err, " (gave up after");
    if (tail) *tail = 0;
    if (quiet || atomic_load(&rz->stop)) return rc;
    char ep[300];
    net_format_endpoint(ep, sizeof ep, c->store_host, c->store_port);
    left = deadline - rdzv_mono_now();
    log_info("rendezvous: waiting for the store at %s (%s) to accept connections: %.500s; %.*f s left (join_timeout)",
             ep, c->endpoint_from, err, rdzv_left_digits(left), left > 0 ? left : 0);
  }
}

static void kv_unreachable(rdzv_t *rz, int rc, int hs, const char *err) {
  const rdzv_config_t *c = &rz->cfg;
  char ep[300];
  net_format_endpoint(ep, sizeof ep, c->store_host, c->store_port);
  if (rc == STORE_EPROTO)
    rdzv_emit_error(rz, "%s %s: port is in use by another program (not a meshrun store): %s", c->endpoint_from, ep,
                    err);
  else if (rc == STORE_ETIMEDOUT)
    rdzv_emit_error(rz, "%s %s: no answer: it accepted the connection but did not answer the store handshake "
                    "within handshake_timeout=%gs (not a meshrun store, or a stuck one)",
                    c->endpoint_from, ep, hs / 1000.0);
  else if (rc == STORE_ECONNECT)
    rdzv_emit_error(rz, "%s %s: nothing accepted the connection within join_timeout=%gs (the store's node did not "
                    "start, or cannot be reached): %s",
                    c->endpoint_from, ep, c->join_timeout_s, err);
  else
    rdzv_emit_error(rz, "%s %s: %s", c->endpoint_from, ep, err);
}

static void kv_lost(rdzv_t *rz, const char *cause) {
  char ep[300];
  net_format_endpoint(ep, sizeof ep, rz->cfg.store_host, rz->cfg.store_port);
  rdzv_emit_message(rz, RDZV_EV_STORE_LOST,
                    "rendezvous store at %s lost (%.500s): the node that serves it died or cannot be reached, and "
                    "a c10d store does not outlive its host, so this node stops too; --rdzv_backend=etcd keeps the "
                    "job's state in an etcd cluster, which survives any one node",
                    ep, cause);
}

/* All n keys in one request. */
static int kv_read_nodes(rdzv_t *rz, rdzv_conn_t *c, int r, int n, void **vals, int timeout_ms) {
  int rc = 0;
  const char **keys = calloc((size_t)n, sizeof *keys);
  size_t *lens = calloc((size_t)n, sizeof *lens);
  char *keybuf = malloc((size_t)n * RDZV_KEY_MAX);
  if (!keys || !lens || !keybuf) rc = STORE_ENOMEM;
  for (int i = 0; !rc && i < n; i++) {
    rdzv_keyf(rz, keybuf + (size_t)i * RDZV_KEY_MAX, "r%d/node/%d", r, i + 1);
    keys[i] = keybuf + (size_t)i * RDZV_KEY_MAX;
  }
  if (!rc) rc = store_multi_get(client(c), keys, (size_t)n, vals, lens, timeout_ms);
  free(keybuf);
  free(lens);
  free(keys);
  return rc;
}

/* The watch thread heard from the store (a reply, or its TIMEOUT answer to a wait). */
static void store_alive(rdzv_t *rz, int watching) {
  uv_mutex_lock(&rz->mu);
  rz->last_reply = rdzv_mono_now();
  rz->watching = watching;
  uv_mutex_unlock(&rz->mu);
}

/* Watches one round: its end key (event-driven), our heartbeat, the peers' heartbeats. */
static void kv_watch(rdzv_t *rz, int gen, int r, int n, int me, const rdzv_node_t *nodes) {
  const rdzv_config_t *c = &rz->cfg;
  rdzv_conn_t *s = &rz->ws;
  char end_key[RDZV_KEY_MAX], key[RDZV_KEY_MAX];
  rdzv_keyf(rz, end_key, "r%d/end", r);
  rdzv_hb_t hb;
  if (rdzv_hb_init(&hb, n, rdzv_mono_now())) return;
  char *done = calloc((size_t)n, 1);
  int64_t counter = 0;
  int interval_ms = (int)(c->heartbeat_interval_s * 1000);
  if (interval_ms < 1) interval_ms = 1;
  int rc = 0;
  int posted = 0;
  store_alive(rz, 1); /* the round starts now: silence counts from here */
  while (!atomic_load(&rz->stop) && done) {
    if (rdzv_watch_stale(rz, gen)) break;
    /* Wait and read in one request: the value is in hand even if the store goes away next. */
    void *v = NULL;
    size_t len = 0;
    rc = kv_get_wait(rz, s, end_key, &v, &len, interval_ms);
    if (rc == 0 || rc == STORE_ETIMEDOUT) store_alive(rz, 1);
    if (rc == 0) {
      int fatal = rdzv_deliver_end(rz, r, v, len);
      free(v);
      if (fatal) rdzv_job_over(rz, s, r, n, me, done, &hb);
      goto out;
    }
    if (rc != STORE_ETIMEDOUT) break;
    rdzv_keyf(rz, key, "r%d/hb/%d", r, me);
    char val[32];
    snprintf(val, sizeof val, "%lld", (long long)++counter);
    if ((rc = kv_set(rz, s, key, val, 0))) break;
    store_alive(rz, 1);
    double now = rdzv_mono_now();
    /* The ring (rdzv_hb_t): the next peer not done; when it is done, the one after it. */
    for (int i; !posted && (i = rdzv_hb_next(done, n, me - 1)) >= 0;) {
      int64_t v;
      rdzv_keyf(rz, key, "r%d/hb/%d", r, i + 1);
      if ((rc = rdzv_read_int(rz, s, key, 0, &v))) goto lost;
      store_alive(rz, 1);
      int fresh = hb.watched != i;
      rdzv_hb_follow(&hb, i, v, now);
      int dead = rdzv_hb_is_dead(&hb, i, now, c->heartbeat_timeout_s);
      if (!dead && !fresh) break;
      /* Silent, or followed from now on (it may have finished long ago: ask now rather than
       * after a heartbeat_timeout of its silence). */
      if ((rc = rdzv_read_done(rz, s, r, i, done))) goto lost;
      if (done[i]) continue;
      if (!dead) break;
      char what[128];
      snprintf(what, sizeof what, "sent no heartbeat for %.1fs (heartbeat_timeout=%gs)", now - hb.changed_at[i],
               c->heartbeat_timeout_s);
      if ((rc = rdzv_end_dead(rz, s, r, n, me, nodes, done, i, what))) goto lost;
      posted = 1;
    }
  }
lost:
  /* Any error here is the connection's: the wait's own timeout (the server's TIMEOUT reply)
   * never gets here, so STORE_ETIMEDOUT means a reply that never came and a broken stream. */
  if (rc && !atomic_load(&rz->stop) && !atomic_load(&rz->done)) rdzv_store_lost(rz, s, rc);
out:
  store_alive(rz, 0);
  free(done);
  rdzv_hb_free(&hb);
}

const rdzv_kv_t rdzv_kv_store = {
    .name = "c10d",
    .alive = "hb",
    .alive_value = "0",
    .handshake_ms = STORE_HANDSHAKE_S * 1000,
    .round_store = 0,
    .check_end_first = 0,
    .watchdog = 1,
    .connect = kv_connect,
    .unreachable = kv_unreachable,
    .lost = kv_lost,
    .errmsg = kv_errmsg,
    .interrupt = kv_interrupt,
    .close = kv_close,
    .set = kv_set,
    .set_pair = kv_set_pair,
    .get_nowait = kv_get_nowait,
    .get_pair = kv_get_pair,
    .add = kv_add,
    .compare_set = kv_compare_set,
    .exists = kv_exists,
    .wait_get = kv_wait_get,
    .get_wait = kv_get_wait,
    .join = kv_join,
    .joined = kv_joined,
    .read_nodes = kv_read_nodes,
    .watch = kv_watch,
};
