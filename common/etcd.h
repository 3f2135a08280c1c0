/* etcd: a blocking client of an etcd v3 cluster, for the rendezvous backend that keeps a job's
 * state in etcd (--rdzv_backend=etcd --rdzv_endpoint=h1:2379,h2:2379,h3:2379).
 *
 * Why HTTP/JSON: etcd's native API is gRPC, which C reaches only through the C++ library or a
 * hand-made HTTP/2 + protobuf stack. etcd also serves the same API as HTTP/JSON on its client
 * URLs (the grpc-gateway, under /v3/ since etcd 3.4: POST /v3/kv/range, /v3/kv/txn,
 * /v3/lease/keepalive, /v3/watch, ...; keys and values base64, 64-bit numbers as strings), so
 * a small HTTP/1.1 client (common/http.c) and cJSON are the whole dependency. (It was libcurl
 * until loading it, on every node, proved to cost more CPU than a whole c10d node: http.h.)
 * Streams (watch,
 * keepalive) are one HTTP request whose response is newline-separated JSON messages; this
 * client opens one, reads what it needs and closes it, which keeps every call blocking and
 * bounded.
 *
 * Called from the launcher's rendezvous and watch threads, never from the event loop: calls
 * block for up to the client's timeout (watch: its own). An etcd_t is one thread's at a time;
 * give each thread its own (a watch thread blocks its client for the whole wait).
 *
 * Several endpoints: a request that fails on one member (refused, timed out, 5xx, "no leader")
 * is retried on the next, and the client stays with the member that answered, so losing a
 * minority of the members changes nothing for the caller. One member gets at most its share
 * of the timeout (timeout / members, at least 500 ms), so a hung one cannot use it all.
 * Requests ask etcd to refuse them at once when the member has no leader (instead of holding
 * them for its 7 s request timeout), and passes over the members repeat, with a short backoff,
 * until the timeout: a leader election (one to two seconds) is waited out, a cluster without
 * quorum fails in bounded time.
 *
 * Errors are negative errno codes (-ENOENT: no such key or lease, -ETIMEDOUT, -ECONNREFUSED,
 * -EAGAIN: no leader, -EINVAL, -ESTALE: revision compacted, -EPROTO: not etcd, -EIO, ...).
 * etcd_connect writes its message into the caller's err; later calls leave theirs in
 * etcd_errmsg(): one line naming the operation and, when no member could serve it, each
 * member's own cause: "etcd put 'job/x': 10.0.0.1:2379: Connection refused; 10.0.0.2:2379:
 * HTTP 503: etcdserver: no leader; ... (gave up after 5000 ms, 11 passes)".
 * Keys are text (no NUL), values are bytes.
 *
 * Not here: TLS and etcd's user authentication (http:// only); long-lived streams (each
 * keepalive is one request, so the caller's thread sets the cadence); membership changes. */
#ifndef MESHRUN_ETCD_H
#define MESHRUN_ETCD_H

#include <stddef.h>
#include <stdint.h>

#define ETCD_DEFAULT_PORT 2379

typedef struct etcd etcd_t;

/* One key (get_prefix) or one event (watch). value is malloc'ed with a NUL appended past len,
 * NULL for a delete event. */
typedef struct {
  char *key;
  void *value;
  size_t len;
  int64_t mod_revision; /* the revision of this write (for a delete event: of the delete) */
  int deleted;          /* watch: 1 for a delete event (also a lease expiring) */
} etcd_kv_t;

typedef struct {
  etcd_kv_t *kvs;
  size_t n;
  /* get_prefix: the cluster's revision when read (watch from it to miss no later change);
   * watch: the revision of the last event returned (watch again from it to continue). */
  int64_t revision;
} etcd_kvs_t;

void etcd_kvs_free(etcd_kvs_t *kvs); /* frees the contents; accepts NULL and empty sets */

/* endpoints: "host:port,host:port,..." (port defaults to 2379; "[v6]:port" and an http://
 * prefix are accepted). timeout_ms (> 0) bounds every later call, retries included. Checks
 * that the cluster serves a linearizable read (waiting up to timeout_ms for it). Returns
 * 0 and *out, or a code with the reason in err that says what answered: -EPROTO something,
 * not etcd (a web server: HTTP without etcd's replies); -EAGAIN etcd, which could not serve
 * the read (no leader, no quorum); -EACCES etcd, refusing us; -EINVAL bad endpoints; any other
 * code (-ECONNREFUSED, -ETIMEDOUT, -EHOSTUNREACH, -EIO) nothing. */
int etcd_connect(etcd_t **out, const char *endpoints, int timeout_ms, char *err, size_t errlen);
void etcd_close(etcd_t *c); /* accepts NULL */
/* A new client for c's members, with c's timeout, without etcd_connect's check (c has passed
 * it): for a second thread. Reads only what connect set, so c's owner may be using it. */
int etcd_clone(etcd_t **out, const etcd_t *c);
/* May be called from another thread than the owner's: a call in progress on c fails within
 * about a second (libcurl's progress callback's cadence when idle) with -EINTR, and so does
 * every later call. For stopping a thread that owns c; the owner still calls etcd_close.
 * Accepts NULL. */
void etcd_interrupt(etcd_t *c);
/* Bounds every later call by timeout_ms (> 0) instead of etcd_connect's: connect may wait
 * long for a cluster to come up, later calls should not. */
void etcd_set_timeout(etcd_t *c, int timeout_ms);
const char *etcd_errmsg(const etcd_t *c);

/* lease: 0, or a lease id from etcd_lease_grant (the key dies with the lease; -ENOENT when
 * that lease is already gone). */
int etcd_put(etcd_t *c, const char *key, const void *val, size_t len, int64_t lease);
/* Both keys or neither, with lease, in one transaction. */
int etcd_put2(etcd_t *c, const char *k1, const void *v1, size_t l1, const char *k2, const void *v2, size_t l2,
              int64_t lease);
/* -ENOENT when absent. *val malloc'ed (NUL appended past len); mod_revision may be NULL. */
int etcd_get(etcd_t *c, const char *key, void **val, size_t *len, int64_t *mod_revision);
/* Every key that starts with prefix, in key order ("" = all keys). */
int etcd_get_prefix(etcd_t *c, const char *prefix, etcd_kvs_t *out);
/* Deletes key, or every key under it when prefix is 1; *deleted (may be NULL) counts them. */
int etcd_delete(etcd_t *c, const char *key, int prefix, int64_t *deleted);

/* Atomically: if key is absent (expected NULL) or holds exactly expected, sets it to desired
 * (with lease, 0 = none). *swapped says whether it did; *actual (malloc'ed; may be NULL) gets
 * the value after the call, NULL when the key is absent. When a try's outcome was unknown (a
 * member died holding the request) and the retry finds desired already there, that counts as
 * swapped: the caller's write, or one identical to it, is in place. */
int etcd_compare_set(etcd_t *c, const char *key, const void *expected, size_t expected_len, const void *desired,
                     size_t desired_len, int64_t lease, int *swapped, void **actual, size_t *actual_len);
/* Adds delta to the integer at key (decimal text; absent counts as 0) by compare-and-swap on
 * the key's mod_revision, and returns the new value. -EINVAL when the key holds no integer. */
int etcd_add(etcd_t *c, const char *key, int64_t delta, int64_t *result);
/* How many keys under prefix were created at or before max_create_revision (0: all), and the
 * revision read at (revision may be NULL). */
int etcd_count(etcd_t *c, const char *prefix, int64_t max_create_revision, int64_t *count, int64_t *revision);
/* An index without contention (n nodes adding 1 to one counter retry O(n^2) times in all: at
 * 256 nodes on two cores, half gave up after the 5 s call timeout). Creates key (no lease,
 * empty), which must lie under prefix, unless it exists, and *index gets the number of keys
 * under prefix created no later than it: 1, 2, ... in creation order, each once. One
 * transaction whose range sees its own put, and a count rather than the keys: at 2048 joiners,
 * reading the keys created before one's own made the joins quadratic in bytes. A key already
 * there (an unsure earlier try) is counted up to its creation, a second request. */
int etcd_create_index(etcd_t *c, const char *key, const char *prefix, int64_t *index);

/* Leases: the liveness of a node. Keys put with the lease vanish ttl_s after the last
 * keepalive. keepalive returns -ENOENT once the lease has expired or was revoked: the node
 * has been fenced out and must not act on the job's behalf before it joins again. */
int etcd_lease_grant(etcd_t *c, int ttl_s, int64_t *id, int *granted_s); /* granted_s (may be NULL): the TTL etcd
                                                                          * gave (it raises one below its minimum) */
int etcd_lease_keepalive(etcd_t *c, int64_t id, int *ttl_s); /* ttl_s (may be NULL): remaining */
int etcd_lease_revoke(etcd_t *c, int64_t id);                /* -ENOENT when already gone */

/* Waits up to timeout_ms (> 0) for changes to key (or, when prefix is 1, to keys under it)
 * after from_revision (0: after now), and returns the first batch of events etcd sends (one
 * revision's, or several when it replays history). -ETIMEDOUT: a member watched and nothing
 * changed; -EAGAIN: no member could watch in that time; -ESTALE: from_revision was compacted
 * away (re-read with etcd_get_prefix and watch from its revision). A member dying mid-wait is
 * replaced by the next one without losing events. out->revision is set in every case
 * (from_revision when nothing came), so a loop can always watch again from it. */
int etcd_watch(etcd_t *c, const char *key, int prefix, int64_t from_revision, int timeout_ms, etcd_kvs_t *out);

#endif
