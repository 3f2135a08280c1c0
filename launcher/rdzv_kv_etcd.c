/* rdzv_kv_etcd: the rendezvous keys in an etcd cluster (common/etcd.h, --rdzv_backend=etcd).
 * Liveness is a lease per node (TTL heartbeat_timeout), granted when the node joins without one
 * and renewed by the watch thread every heartbeat interval, also between rounds; a node's alive
 * key, its description and its claims are on it. The watch thread watches every key of the
 * round from one read's revision (kv_watch). See rdzv.h for the keys. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/etcd.h"
#include "common/log.h"
#include "common/store.h"
#include "launcher/rdzv_kv.h"

/* How long an etcd call (all members, retries included) may take before it counts as failed:
 * the command thread's, and the watch thread's (which must renew the lease within its TTL). */
#define ETCD_CMD_MS (RDZV_ETCD_CALL_S * 1000)
#define ETCD_WATCH_MIN_MS 1000
/* One watch's length while waiting for a key (etcd_wait_get). */
#define ETCD_WAIT_SLICE_MS 5000
/* At exit: how long revoking the lease may take (peers then see this node leave at once
 * instead of after the lease's TTL). */
#define ETCD_REVOKE_MS 1000

static etcd_t *client(const rdzv_conn_t *c) { return c->client; }

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

static const char *kv_errmsg(const rdzv_conn_t *c, int rc) {
  return c->client ? etcd_errmsg(client(c)) : store_strerror(rc);
}

/* A write with leased set dies with this node's lease, and is refused with RDZV_EFENCED when
 * that lease is gone. */
static int kv_set(rdzv_t *rz, rdzv_conn_t *c, const char *key, const char *val, int leased) {
  int rc = etcd_put(client(c), key, val, strlen(val), leased ? rdzv_lease_now(rz) : 0);
  return leased && rc == -ENOENT ? RDZV_EFENCED : from_etcd(rc);
}

/* One transaction. */
static int kv_set_pair(rdzv_t *rz, rdzv_conn_t *c, const char *k1, const char *v1, const char *k2, const char *v2,
                       int leased) {
  int rc = etcd_put2(client(c), k1, v1, strlen(v1), k2, v2, strlen(v2), leased ? rdzv_lease_now(rz) : 0);
  return leased && rc == -ENOENT ? RDZV_EFENCED : from_etcd(rc);
}

static int kv_get_nowait(rdzv_conn_t *c, const char *key, void **v, size_t *len) {
  return from_etcd(etcd_get(client(c), key, v, len, NULL));
}

static int kv_add(rdzv_conn_t *c, const char *key, int64_t delta, int64_t *out) {
  return from_etcd(etcd_add(client(c), key, delta, out));
}

static int kv_compare_set(rdzv_t *rz, rdzv_conn_t *c, const char *key, const char *expected, const char *desired,
                          int leased, void **actual, size_t *alen) {
  *actual = NULL;
  *alen = 0;
  int swapped = 0;
  int rc = etcd_compare_set(client(c), key, expected, expected ? strlen(expected) : 0, desired, strlen(desired),
                            leased ? rdzv_lease_now(rz) : 0, &swapped, actual, alen);
  return leased && rc == -ENOENT ? RDZV_EFENCED : from_etcd(rc);
}

static int kv_exists(rdzv_conn_t *c, const char *key, int *exist) {
  void *v = NULL;
  size_t len;
  int rc = etcd_get(client(c), key, &v, &len, NULL);
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

/* The participant index of a key "<prefix><what>/<i>", or 0. */
static int key_idx(const char *key, const char *prefix, const char *what, int n) {
  size_t pl = strlen(prefix), wl = strlen(what);
  if (strncmp(key, prefix, pl) || strncmp(key + pl, what, wl) || key[pl + wl] != '/') return 0;
  char *end;
  long i = strtol(key + pl + wl + 1, &end, 10);
  return *end || i < 1 || i > n ? 0 : (int)i;
}

/* Waits for key up to timeout_ms (< 0: until stop). One read, then one watch from that
 * read's revision, renewed every ETCD_WAIT_SLICE_MS from where the last left off: a watch is a
 * new HTTP request and a new stream in etcd's gateway, and at 512 nodes re-reading and
 * re-watching every half second kept etcd too busy to confirm the watches in time. The event
 * carries the value, so no read follows. rdzv_destroy interrupts the call in progress.
 * Returns 0 (and the value, malloc'ed, when v is not NULL), STORE_ETIMEDOUT, 1 when stopped, or
 * an error. */
static int etcd_wait_get(rdzv_t *rz, rdzv_conn_t *c, const char *key, int timeout_ms, void **v, size_t *len) {
  double deadline = rdzv_mono_now() + timeout_ms / 1000.0;
  for (;;) {
    if (atomic_load(&rz->stop)) return 1;
    etcd_kvs_t kvs;
    int rc = etcd_get_prefix(client(c), key, &kvs);
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
        double left = (deadline - rdzv_mono_now()) * 1000.0;
        if (left <= 0) return STORE_ETIMEDOUT;
        if (left < ms) ms = (int)left + 1, final_slice = 1;
      }
      rc = etcd_watch(client(c), key, 0, rev, ms, &kvs);
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

static int kv_wait_get(rdzv_t *rz, rdzv_conn_t *c, const char *key, int timeout_ms, void **v, size_t *len) {
  if (v) *v = NULL;
  return etcd_wait_get(rz, c, key, timeout_ms, v, len);
}

static int kv_get_wait(rdzv_t *rz, rdzv_conn_t *c, const char *key, void **v, size_t *len, int timeout_ms) {
  int rc = etcd_wait_get(rz, c, key, timeout_ms, v, len);
  return rc == 1 ? STORE_ETIMEDOUT : rc;
}

static void kv_interrupt(rdzv_conn_t *c) { etcd_interrupt(client(c)); }

static void kv_close(rdzv_conn_t *c) {
  etcd_close(client(c));
  c->client = NULL;
}

/* Retrying a compare-and-swap on one counter would take O(n^2) tries in all across n joiners
 * (at 256 nodes on two cores, half gave up after the 5 s call timeout): each node instead
 * creates P/r<r>/join/<its lease> and counts the join keys, its own included, in the same
 * transaction (etcd_create_index). Join keys are not leased, so a joiner that dies leaves its
 * index taken, as with the store's counter. */
static int kv_join(rdzv_t *rz, rdzv_conn_t *c, int r, int64_t *idx) {
  char key[RDZV_KEY_MAX], prefix[RDZV_KEY_MAX];
  rdzv_keyf(rz, prefix, "r%d/join/", r);
  rdzv_keyf(rz, key, "r%d/join/%" PRIx64, r, (uint64_t)rdzv_lease_now(rz));
  return from_etcd(etcd_create_index(client(c), key, prefix, idx));
}

static int kv_joined(rdzv_t *rz, rdzv_conn_t *c, int r, int64_t *count) {
  char key[RDZV_KEY_MAX];
  rdzv_keyf(rz, key, "r%d/join/", r);
  return from_etcd(etcd_count(client(c), key, 0, count, NULL));
}

/* The command thread's calls are bounded by ETCD_CMD_MS; the watch thread's well under the
 * lease's TTL, so that a hung member cannot keep it from renewing through another one. etcd
 * runs before any job does, so a cluster that does not answer is not waited for: its first
 * answer has hs ms. The watch thread, once the command thread is in, clones its client: the
 * same members, no second check. */
static int kv_connect(rdzv_t *rz, const rdzv_conn_t *c, void **out, int timeout_ms, int hs, char *err,
                      size_t errlen) {
  int call_ms = ETCD_CMD_MS;
  if (c == &rz->ws) {
    call_ms = (int)(rz->cfg.heartbeat_timeout_s * 500);
    if (call_ms < ETCD_WATCH_MIN_MS) call_ms = ETCD_WATCH_MIN_MS;
    rz->watch_call_ms = call_ms; /* the watch thread's alone */
  }
  etcd_t *e = NULL;
  int rc;
  uv_mutex_lock(&rz->mu);
  etcd_t *first = c != &rz->cs ? client(&rz->cs) : NULL;
  uv_mutex_unlock(&rz->mu);
  if (first) {
    rc = etcd_clone(&e, first);
    if (rc) snprintf(err, errlen, "etcd connect: out of memory");
    else etcd_set_timeout(e, call_ms);
  } else {
    rc = etcd_connect(&e, rz->cfg.etcd_endpoints, hs, err, errlen);
    etcd_set_timeout(e, call_ms);
  }
  *out = e;
  return rc;
}

static void kv_unreachable(rdzv_t *rz, int rc, int hs, const char *err) {
  const rdzv_config_t *c = &rz->cfg;
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
  rdzv_emit_error(rz, "%s %.300s (etcd): %s: %.600s", c->endpoint_from, c->etcd_endpoints, what, err);
}

static void kv_lost(rdzv_t *rz, const char *cause) {
  rdzv_emit_message(rz, RDZV_EV_STORE_LOST,
                    "etcd cluster at %.300s lost (%.600s): no member could serve this node's rendezvous calls, so "
                    "it stops (the job's state stays in etcd: nodes that can reach a quorum go on without this "
                    "one)",
                    rz->cfg.etcd_endpoints, cause);
}

/* A lease for this node when it has none (a first join, or a join after being fenced). Its TTL
 * is heartbeat_timeout in whole seconds, etcd's unit; etcd may raise it to its minimum (about
 * 1.5 x its election timeout), which is then what bounds the detection of this node's death,
 * and is said once. */
static int kv_lease_ensure(rdzv_t *rz, rdzv_conn_t *c) {
  if (rdzv_lease_now(rz)) return 0;
  int want = (int)ceil(rz->cfg.heartbeat_timeout_s);
  if (want < 1) want = 1;
  int64_t id = 0;
  int ttl = 0, rc = etcd_lease_grant(client(c), want, &id, &ttl);
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
  rz->lease_ok = rdzv_mono_now();
  uv_cond_broadcast(&rz->watch_cond); /* the watch thread renews it from now on */
  uv_mutex_unlock(&rz->mu);
  log_debug("etcd lease %" PRIx64 " granted, TTL %d s", (uint64_t)id, ttl);
  return 0;
}

/* On the watch thread: renews the lease when *next is due. Returns 1 when this node is fenced
 * (FENCED emitted): etcd says the lease is gone, or no renewal succeeded for its TTL, after
 * which etcd has surely expired it (a partition: this node cannot tell the others it lives,
 * and they will have gone on without it). */
static int kv_lease_renew(rdzv_t *rz, rdzv_conn_t *c, double *next) {
  double now = rdzv_mono_now();
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
  etcd_set_timeout(client(c), keep_ms > rz->watch_call_ms ? keep_ms : rz->watch_call_ms);
  int left = 0, rc = etcd_lease_keepalive(client(c), lease, &left);
  etcd_set_timeout(client(c), rz->watch_call_ms);
  char why[1024];
  if (rc == 0) {
    uv_mutex_lock(&rz->mu);
    if (rz->lease == lease) rz->lease_ok = rdzv_mono_now();
    uv_mutex_unlock(&rz->mu);
    return 0;
  }
  if (rc == -ENOENT) {
    snprintf(why, sizeof why, "its etcd lease expired or was revoked (TTL %d s): the other nodes have gone on "
             "without it", ttl);
  } else if (rdzv_mono_now() - ok > ttl) {
    snprintf(why, sizeof why,
             "its etcd lease could not be renewed for %.1fs (TTL %d s), so etcd has expired it: %.800s",
             rdzv_mono_now() - ok, ttl, etcd_errmsg(client(c)));
  } else {
    log_debug("renewing the etcd lease: %s", etcd_errmsg(client(c)));
    return 0;
  }
  rdzv_fenced(rz, lease, why);
  return 1;
}

/* At exit: the lease goes now rather than after its TTL, so the other nodes see this one leave
 * at once (a node stopped by a signal is a node gone; one that finished has said so in its
 * done key first). On a client of its own: the threads' clients are interrupted. */
static void kv_lease_revoke(rdzv_t *rz) {
  int64_t lease = rdzv_lease_now(rz); /* a thread still busy may hold mu's data */
  if (!lease) return;
  etcd_t *e = NULL;
  char err[512] = "out of memory";
  uv_mutex_lock(&rz->mu);
  etcd_t *first = client(&rz->cs); /* interrupted: a clone of it is not */
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

/* One prefix read, then a wait for each description still missing. */
static int kv_read_nodes(rdzv_t *rz, rdzv_conn_t *c, int r, int n, void **vals, int timeout_ms) {
  int rc = 0;
  char *have = calloc((size_t)n, 1); /* which descriptions are in */
  if (!have) return STORE_ENOMEM;
  double deadline = rdzv_mono_now() + timeout_ms / 1000.0;
  char round[RDZV_KEY_MAX], prefix[RDZV_KEY_MAX], key[RDZV_KEY_MAX];
  rdzv_keyf(rz, round, "r%d/", r);
  rdzv_keyf(rz, prefix, "r%d/node/", r);
  for (;;) {
    etcd_kvs_t kvs;
    if ((rc = from_etcd(etcd_get_prefix(client(c), prefix, &kvs)))) goto out;
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
    rdzv_keyf(rz, key, "r%d/node/%d", r, first + 1);
    int left = (int)((deadline - rdzv_mono_now()) * 1000.0);
    rc = left > 0 ? etcd_wait_get(rz, c, key, left, NULL, NULL) : STORE_ETIMEDOUT;
    if (rc == 1) rc = STORE_ETIMEDOUT;
    if (rc) goto out;
  }
out:
  free(have);
  return rc;
}

/* Done by the round's first node, best effort. */
static void kv_forget_job(rdzv_t *rz, rdzv_conn_t *c) {
  char prefix[RDZV_KEY_MAX];
  rdzv_keyf(rz, prefix, "%s", "");
  int64_t n = 0;
  if (etcd_delete(client(c), prefix, 1, &n))
    log_debug("deleting the job's keys in etcd: %s", etcd_errmsg(client(c)));
  else
    log_debug("the job is over: deleted its %" PRId64 " keys in etcd", n);
}

/* One round's watch (kv_watch) and what it has learnt. */
typedef struct {
  rdzv_t *rz;
  rdzv_conn_t *s;
  int r, n, me;
  const rdzv_node_t *nodes;
  char prefix[RDZV_KEY_MAX], end_key[RDZV_KEY_MAX], alive_prefix[RDZV_KEY_MAX];
  char *done, *alive; /* per participant: it said it is done; its alive key is there */
  int64_t rev;        /* the revision the next watch starts from */
  int posted;         /* this node ended the round for a dead one */
  double gone_since;  /* when a participant was first seen gone, not done */
  const void *end;    /* the end record, once found (in the call's kvs) */
  size_t end_len;
} watch_t;

/* Reads the round afresh into w, kvs holding what w->end points into. Cheap first: whether
 * the round has ended (reading its end key gives the revision to watch from), then how many
 * alive keys it has, a count rather than the keys: each node reading every node's keys made a
 * 2048-node round's start quadratic in bytes. All n alive: nobody has left, and the watch
 * starts from the end key's read. Fewer: the round's keys say who is alive and who is done. */
static int read_round(watch_t *w, etcd_kvs_t *kvs) {
  etcd_t *e = client(w->s);
  int rc, n = w->n;
  if ((rc = etcd_get_prefix(e, w->end_key, kvs))) return rc;
  int i = find_key(kvs, w->end_key);
  w->rev = kvs->revision;
  if (i >= 0) {
    w->end = kvs->kvs[i].value, w->end_len = kvs->kvs[i].len;
    return 0;
  }
  etcd_kvs_free(kvs);
  int64_t count = 0;
  if ((rc = etcd_count(e, w->alive_prefix, 0, &count, NULL))) return rc;
  memset(w->alive, 1, (size_t)n);
  if (count >= n) return 0;
  if ((rc = etcd_get_prefix(e, w->prefix, kvs))) return rc;
  w->rev = kvs->revision;
  memset(w->alive, 0, (size_t)n);
  for (size_t k = 0; k < kvs->n; k++) {
    if ((i = key_idx(kvs->kvs[k].key, w->prefix, "alive", n))) w->alive[i - 1] = 1;
    if ((i = key_idx(kvs->kvs[k].key, w->prefix, "done", n))) w->done[i - 1] = 1;
    if (!strcmp(kvs->kvs[k].key, w->end_key)) w->end = kvs->kvs[k].value, w->end_len = kvs->kvs[k].len;
  }
  return 0;
}

/* Watches the round's keys from w->rev for up to ms, and takes in what changed: the end, done
 * keys set, alive keys deleted. Returns 0 (with kvs to free; nothing changed included),
 * -ESTALE (compacted: read the round again) or an error. */
static int next_events(watch_t *w, etcd_kvs_t *kvs, int ms) {
  int rc = etcd_watch(client(w->s), w->prefix, 1, w->rev, ms, kvs);
  if (rc == -ESTALE) return rc;
  if (rc && rc != -ETIMEDOUT) return rc;
  w->rev = kvs->revision;
  for (size_t k = 0; k < kvs->n && !w->end; k++) {
    const etcd_kv_t *ev = &kvs->kvs[k];
    int i;
    if (!ev->deleted && !strcmp(ev->key, w->end_key)) w->end = ev->value, w->end_len = ev->len;
    if (!ev->deleted && (i = key_idx(ev->key, w->prefix, "done", w->n))) w->done[i - 1] = 1;
    if (ev->deleted && (i = key_idx(ev->key, w->prefix, "alive", w->n))) w->alive[i - 1] = 0;
  }
  return 0;
}

/* A participant without its lease that is not done is dead. The one that follows it in the
 * ring of rdzv_hb_next ends the round at once; the others wait heartbeat_timeout for that end
 * before they post it too (any death leaves a live node that follows a dead one). Every node
 * reading, claiming and posting at once was three thousand etcd requests in a burst at 1024
 * nodes. Returns 0, or an error: of a read (*posting 0: try again) or of ending the round
 * (*posting 1). */
static int end_gone(watch_t *w, int *posting) {
  const int n = w->n, me = w->me;
  int rc;
  *posting = 0;
  for (;;) {
    int gone = -1, next = rdzv_hb_next(w->done, n, me - 1);
    for (int i = 0; i < n && gone < 0; i++)
      if (i + 1 != me && !w->alive[i] && !w->done[i]) gone = i;
    if (gone < 0 || w->posted) {
      w->gone_since = 0;
      return 0;
    }
    if (!w->gone_since) w->gone_since = rdzv_mono_now();
    if (next >= 0 && !w->alive[next]) gone = next;
    else if (rdzv_mono_now() - w->gone_since <= w->rz->cfg.heartbeat_timeout_s) return 0;
    /* Its done key may predate the watch (a count does not say who is done). */
    if ((rc = rdzv_read_done(w->rz, w->s, w->r, gone, w->done))) return rc;
    if (w->done[gone]) continue;
    *posting = 1;
    if ((rc = rdzv_end_dead(w->rz, w->s, w->r, n, me, w->nodes, w->done, gone,
                            "lost its etcd lease (it left, or died, or was cut off for its TTL)")))
      return rc;
    *posting = 0;
    w->posted = 1;
  }
}

/* No member answered in the client's time: the lease decides (kv_lease_renew fences this node
 * once its TTL has passed without a renewal); meanwhile, a pause before trying again. */
static void watch_pause(watch_t *w) {
  rdzv_t *rz = w->rz;
  log_debug("round %d: watching etcd: %s", w->r, etcd_errmsg(client(w->s)));
  for (double until = rdzv_mono_now() + rz->cfg.heartbeat_interval_s;
       rdzv_mono_now() < until && !atomic_load(&rz->stop);) {
    struct timespec ts = {0, 20 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

/* Watches one round: every key under P/r<r>/ from one read's revision on, so no change is
 * missed between reads. The end key ends the watch; a participant's alive key deleted (its
 * lease expired or was revoked) while it is not done is a dead node. Between events, every
 * heartbeat interval, this node's lease is renewed. */
static void kv_watch(rdzv_t *rz, int gen, int r, int n, int me, const rdzv_node_t *nodes) {
  watch_t w = {.rz = rz, .s = &rz->ws, .r = r, .n = n, .me = me, .nodes = nodes};
  rdzv_keyf(rz, w.prefix, "r%d/", r);
  rdzv_keyf(rz, w.end_key, "r%d/end", r);
  rdzv_keyf(rz, w.alive_prefix, "r%d/alive/", r);
  w.done = calloc((size_t)n, 1);
  w.alive = malloc((size_t)n);
  int interval_ms = (int)(rz->cfg.heartbeat_interval_s * 1000);
  if (interval_ms < 1) interval_ms = 1;
  int rc = 0, reread = 1, posting = 0;
  double next_renewal = 0;
  while (w.done && w.alive && !atomic_load(&rz->stop)) {
    if (rdzv_watch_stale(rz, gen) || kv_lease_renew(rz, w.s, &next_renewal)) break;
    etcd_kvs_t kvs;
    w.end = NULL;
    w.end_len = 0;
    rc = reread ? read_round(&w, &kvs) : next_events(&w, &kvs, interval_ms);
    if (rc == -ESTALE && !reread) {
      reread = 1;
      continue;
    }
    if (!rc) {
      reread = 0;
      if (w.end) {
        int fatal = rdzv_deliver_end(rz, r, w.end, w.end_len);
        etcd_kvs_free(&kvs);
        if (fatal) rdzv_job_over(rz, w.s, r, n, me, w.done, NULL);
        break;
      }
      etcd_kvs_free(&kvs);
      if (!(rc = end_gone(&w, &posting))) continue;
      if (posting) {
        if (!atomic_load(&rz->stop) && !atomic_load(&rz->done)) rdzv_round_call_failed(rz, w.s, rc);
        break;
      }
    }
    watch_pause(&w);
    reread = 1;
  }
  free(w.done);
  free(w.alive);
}

const rdzv_kv_t rdzv_kv_etcd = {
    .name = "etcd",
    .alive = "alive",
    .alive_value = "1",
    .handshake_ms = ETCD_CMD_MS,
    .round_store = 1,
    .check_end_first = 1,
    .watchdog = 0,
    .connect = kv_connect,
    .unreachable = kv_unreachable,
    .lost = kv_lost,
    .errmsg = kv_errmsg,
    .interrupt = kv_interrupt,
    .close = kv_close,
    .set = kv_set,
    .set_pair = kv_set_pair,
    .get_nowait = kv_get_nowait,
    .add = kv_add,
    .compare_set = kv_compare_set,
    .exists = kv_exists,
    .wait_get = kv_wait_get,
    .get_wait = kv_get_wait,
    .join = kv_join,
    .joined = kv_joined,
    .read_nodes = kv_read_nodes,
    .watch = kv_watch,
    .forget_job = kv_forget_job,
    .lease_ensure = kv_lease_ensure,
    .lease_renew = kv_lease_renew,
    .lease_revoke = kv_lease_revoke,
};
