/* rdzv: rendezvous rounds, round ends and liveness over a key-value backend, on two threads
 * that report to the agent's loop (see rdzv.h for the key schema and the division of work).
 *
 * Every key-value call here blocks, which is why none of it runs on the loop thread. The calls
 * go through the backend that rdzv_create picks (rz->kv, rdzv_kv.h): the c10d-like store
 * (rdzv_kv_store.c) or etcd (rdzv_kv_etcd.c). The round logic here is shared; a backend holds
 * its keys' calls and liveness (heartbeat counters in the store, a lease in etcd: each one's
 * watcher). The pure decision functions at the bottom hold the rules. */
#include "launcher/rdzv.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "launcher/rdzv_kv.h"

double rdzv_mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

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

void rdzv_emit_message(rdzv_t *rz, rdzv_event_kind_t kind, const char *fmt, ...) {
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

int64_t rdzv_lease_now(rdzv_t *rz) {
  uv_mutex_lock(&rz->mu);
  int64_t l = rz->lease;
  uv_mutex_unlock(&rz->mu);
  return l;
}

static int kv_wait(rdzv_t *rz, rdzv_conn_t *c, const char *key, int timeout_ms) {
  return rz->kv->wait_get(rz, c, key, timeout_ms, NULL, NULL);
}

/* The store or the etcd cluster, reached before, is gone: the backend's one line says where it
 * was, why this node cannot go on without it, and what would (cause: the failed call's
 * message, or the watchdog's verdict). */
void rdzv_store_lost(rdzv_t *rz, rdzv_conn_t *c, int rc) {
  uv_mutex_lock(&rz->mu);
  double silent = rz->silent_s;
  uv_mutex_unlock(&rz->mu);
  char cause[800];
  if (silent > 0)
    snprintf(cause, sizeof cause, "no reply for %.1fs, heartbeat_timeout=%gs", silent, rz->cfg.heartbeat_timeout_s);
  else
    snprintf(cause, sizeof cause, "%.700s", rz->kv->errmsg(c, rc));
  rz->kv->lost(rz, cause);
}

/* This node's lease is gone (or must be presumed gone). From here on it belongs to no round:
 * the agent stops its workers and joins again, with a new lease. Only the first verdict about
 * a lease counts. */
void rdzv_fenced(rdzv_t *rz, int64_t lease, const char *why) {
  uv_mutex_lock(&rz->mu);
  int first = lease != 0 && rz->lease == lease;
  if (first) rz->lease = 0;
  uv_mutex_unlock(&rz->mu);
  if (!first) return;
  rdzv_emit_message(rz, RDZV_EV_FENCED, "this node was fenced out of the job: %.900s", why);
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

void rdzv_keyf(rdzv_t *rz, char *out, const char *fmt, ...) {
  int n = snprintf(out, RDZV_KEY_MAX, "%s", rz->prefix);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out + n, (size_t)(RDZV_KEY_MAX - n), fmt, ap);
  va_end(ap);
}

int rdzv_read_int(rdzv_t *rz, rdzv_conn_t *c, const char *key, int64_t dflt, int64_t *out) {
  void *v = NULL;
  size_t len = 0;
  int rc = rz->kv->get_nowait(c, key, &v, &len);
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
 * the backend's default, and never past timeout_ms. */
static int handshake_bound(const rdzv_t *rz, int timeout_ms) {
  int ms = rz->cfg.handshake_ms > 0 ? rz->cfg.handshake_ms : rz->kv->handshake_ms;
  return ms < timeout_ms ? ms : timeout_ms;
}

int rdzv_left_digits(double left) { return left < 10 ? 1 : 0; }

/* Connects c once (each thread has its own) within timeout_ms: a store not accepting
 * connections yet is waited for until then; the handshake, and etcd's first answer, have
 * handshake_bound. The first failure names the endpoint; one after a success is a lost store. */
static int ensure_conn(rdzv_t *rz, rdzv_conn_t *c, int timeout_ms) {
  if (c->client) return 0;
  char err[1024];
  void *client = NULL;
  int hs = handshake_bound(rz, timeout_ms);
  int rc = rz->kv->connect(rz, c, &client, timeout_ms, hs, err, sizeof err);
  uv_mutex_lock(&rz->mu);
  c->client = client;
  uv_mutex_unlock(&rz->mu);
  if (rc == 0) atomic_store(&rz->reached, 1);
  if (rc && atomic_load(&rz->reached)) {
    /* A connection worked before: whatever answers now, ours has gone away. */
    rz->kv->lost(rz, err);
  } else if (rc) {
    rz->kv->unreachable(rz, rc, hs, err);
  }
  return rc;
}

/* round r -> r+1, unless someone already did it. */
static int bump_round(rdzv_t *rz, rdzv_conn_t *c, int r) {
  char key[RDZV_KEY_MAX], cur[32], next[32];
  rdzv_keyf(rz, key, "round");
  snprintf(cur, sizeof cur, "%d", r);
  snprintf(next, sizeof next, "%d", r + 1);
  void *actual = NULL;
  size_t alen = 0;
  int rc = rz->kv->compare_set(rz, c, key, r == 0 ? NULL : cur, next, 0, &actual, &alen);
  free(actual);
  return rc;
}

/* Ends round r with e unless another node ended it first. Only the node that wins the claim
 * counts a failure against the job's budget and decides whether the job is over. The claim is
 * leased (etcd): a node fenced out cannot end a round it is no longer in (RDZV_EFENCED), and a
 * claimer that dies before writing the end frees the claim; an end already written is final,
 * whoever's lease has gone since (check_end_first). */
static int post_end(rdzv_t *rz, rdzv_conn_t *c, int r, rdzv_end_t *e, int survivors) {
  char key[RDZV_KEY_MAX], token[RDZV_ADDR_MAX + 64];
  int rc;
  if (rz->kv->check_end_first) {
    int ended = 0;
    rdzv_keyf(rz, key, "r%d/end", r);
    if ((rc = rz->kv->exists(c, key, &ended)) || ended) return rc;
  }
  snprintf(token, sizeof token, "%s/%d/%d", rz->cfg.addr, (int)getpid(), e->node_idx);
  rdzv_keyf(rz, key, "r%d/claim", r);
  void *actual = NULL;
  size_t alen = 0;
  if ((rc = rz->kv->compare_set(rz, c, key, NULL, token, 1, &actual, &alen))) return rc;
  int won = actual && alen == strlen(token) && memcmp(actual, token, alen) == 0;
  free(actual);
  if (!won) return 0;
  int64_t failures = 0;
  if (e->kind == RDZV_END_FAILURE) {
    rdzv_keyf(rz, key, "failures");
    if ((rc = rz->kv->add(c, key, 1, &failures))) return rc;
  }
  e->fatal = e->fatal || rdzv_end_fatal(e->kind, failures, rz->cfg.max_restarts, survivors, rz->cfg.nnodes_min);
  char *json = rdzv_end_encode(e);
  if (!json) return STORE_ENOMEM;
  rdzv_keyf(rz, key, "r%d/end", r);
  rc = rz->kv->set(rz, c, key, json, 0);
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

/* The participant list of round r closed with n participants, P/r<r>/nodes/<n>: their
 * descriptions in join order, a line each. Whoever closes the round with n reads the n
 * descriptions and writes the list before it sets P/r<r>/closed, so that every other
 * participant reads one key instead of n: n descriptions read by each of n nodes made a
 * round's start quadratic in the nodes (in a 2048-node start on loopback, each node built
 * 2048 keys in a megabyte of buffer and the store looked up 4 million keys). Closers racing
 * with the same n write the same list; one that loses the race to another n wrote a list
 * nobody reads. *out gets the participants (rdzv_parse_node_list). -EINVAL (and an error event)
 * for a malformed description. */
static int publish_nodes(rdzv_t *rz, rdzv_conn_t *c, int r, int n, rdzv_node_t **out, int timeout_ms) {
  void **vals = calloc((size_t)n, sizeof *vals);
  size_t cap = (size_t)n * (RDZV_ADDR_MAX + 32) + 1, len = 0;
  char *list = malloc(cap);
  int rc = vals && list ? rz->kv->read_nodes(rz, c, r, n, vals, timeout_ms) : STORE_ENOMEM;
  for (int i = 0; !rc && i < n; i++) {
    int node_rank, nproc;
    const char *addr, *end = parse_desc(vals[i], &node_rank, &nproc, &addr);
    if (!end) {
      rdzv_emit_error(rz, "rendezvous round %d: node %d published a malformed description", r, i + 1);
      rc = -EINVAL;
      break;
    }
    len += (size_t)snprintf(list + len, cap - len, "%d %d %.*s\n", node_rank, nproc, (int)(end - addr), addr);
  }
  if (vals)
    for (int i = 0; i < n; i++) free(vals[i]);
  free(vals);
  char key[RDZV_KEY_MAX];
  rdzv_keyf(rz, key, "r%d/nodes/%d", r, n);
  if (!rc) rc = rz->kv->set(rz, c, key, list, 0);
  int oom = 0;
  if (!rc && !(*out = rdzv_parse_node_list(list, len, n, &oom))) rc = STORE_ENOMEM; /* our own list parses */
  free(list);
  return rc;
}

/* Reads round r's participant list (publish_nodes) into *out (rdzv_parse_node_list), waiting up to
 * timeout_ms (it is written before the round closes, so this waits only for a store that lost
 * it). With master not NULL and a backend with get_pair (the store), the round's master record
 * too, in the same request (waiting for it as well), into *master (malloc'ed); else *master
 * stays NULL. -EINVAL (and an error event) when the list is malformed. */
static int read_node_list(rdzv_t *rz, rdzv_conn_t *c, int r, int n, rdzv_node_t **out, void **master, size_t *mlen,
                          int timeout_ms) {
  char key[RDZV_KEY_MAX], mkey[RDZV_KEY_MAX];
  rdzv_keyf(rz, key, "r%d/nodes/%d", r, n);
  void *v = NULL;
  size_t len = 0;
  int rc;
  if (master && rz->kv->get_pair) {
    rdzv_keyf(rz, mkey, "r%d/master", r);
    rc = rz->kv->get_pair(c, key, mkey, &v, &len, master, mlen, timeout_ms);
  } else {
    rc = rz->kv->get_wait(rz, c, key, &v, &len, timeout_ms);
  }
  if (rc) return rc;
  int oom = 0;
  *out = rdzv_parse_node_list(v, len, n, &oom);
  free(v);
  if (*out) return 0;
  if (oom) return STORE_ENOMEM;
  rdzv_emit_error(rz, "rendezvous round %d: the list of its %d participants is malformed", r, n);
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

/* Waits for round r's closed key until deadline (rdzv_mono_now's clock), its value into *v when
 * v is not NULL: the backend's wait_get, cut at every progress interval by a line that says how
 * many nodes have joined and how long is left of what (the timeout that ends the wait), so that
 * waiting for a node that never comes is never silent. Returns as wait_get. */
static int wait_closed(rdzv_t *rz, rdzv_conn_t *s, int r, const char *key, double deadline, const char *what, void **v,
                       size_t *len) {
  const rdzv_config_t *c = &rz->cfg;
  for (;;) {
    double left = deadline - rdzv_mono_now();
    int last = c->progress_interval_s <= 0 || c->progress_interval_s >= left;
    double slice = last ? left : c->progress_interval_s;
    int rc = rz->kv->wait_get(rz, s, key, slice > 0 ? (int)(slice * 1000) : 0, v, len);
    if (rc != STORE_ETIMEDOUT || last) return rc;
    int64_t joined = 0;
    if ((rc = rz->kv->joined(rz, s, r, &joined))) return rc;
    left = deadline - rdzv_mono_now();
    log_info("rendezvous: %d of min %d / max %d nodes joined, %.*f s left (%s)", (int)joined, c->nnodes_min,
             c->nnodes_max, rdzv_left_digits(left), left > 0 ? left : 0, what);
  }
}

/* A join in progress (do_join): the round it is in and what this node knows of it. */
typedef struct {
  rdzv_conn_t *s;
  int r;
  int64_t idx;    /* this node's join index */
  int64_t closed; /* the count the round closed with, once known (-1 before) */
  int listed;     /* nodes holds the descriptions of participants 1..listed (a closer's) */
  rdzv_node_t *nodes;
  void *mv; /* the round's master record */
  size_t mlen;
  int rc; /* the call that failed (JOIN_FAILED) */
} join_t;

/* What a step of a join says comes next. */
typedef enum {
  JOIN_NEXT = 0, /* the join's next step */
  JOIN_AGAIN,    /* look at the rounds again */
  JOIN_OVER,     /* nothing more: stopped, assigned, or an error already told */
  JOIN_FAILED,   /* a call failed with j->rc (join_failed tells) */
} join_step_t;

static join_step_t join_fail(join_t *j, int rc) {
  j->rc = rc;
  return JOIN_FAILED;
}

/* Reads the current round into j->r: JOIN_NEXT when it is open. A closed one is over (then
 * help bump the round) or running (this node is late: it ends a round with room for it, and
 * waits for the end of a full one): JOIN_AGAIN. */
static join_step_t join_look(rdzv_t *rz, join_t *j) {
  const rdzv_config_t *c = &rz->cfg;
  rdzv_conn_t *s = j->s;
  char key[RDZV_KEY_MAX];
  int rc;
  int64_t r64, closed;
  rdzv_keyf(rz, key, "round");
  if ((rc = rdzv_read_int(rz, s, key, 0, &r64))) return join_fail(j, rc);
  int r = j->r = (int)r64;
  rdzv_keyf(rz, key, "r%d/closed", r);
  if ((rc = rdzv_read_int(rz, s, key, -1, &closed))) return join_fail(j, rc);
  if (closed < 0) return JOIN_NEXT;
  int ended;
  rdzv_keyf(rz, key, "r%d/end", r);
  if ((rc = rz->kv->exists(s, key, &ended))) return join_fail(j, rc);
  if (ended) return (rc = bump_round(rz, s, r)) ? join_fail(j, rc) : JOIN_AGAIN;
  if (rdzv_late_action((int)closed, c->nnodes_max) == RDZV_LATE_SCALE_UP) {
    rdzv_end_t e = {.kind = RDZV_END_SCALE_UP, .exit_code = 0, .rank = -1, .node_idx = 0, .time = wall_now()};
    snprintf(e.host, sizeof e.host, "%s", c->addr);
    snprintf(e.reason, sizeof e.reason, "node %s joined; round %d had %d of max %d nodes", c->addr, r, (int)closed,
             c->nnodes_max);
    log_info("round %d is running with %d of max %d nodes: asking it to restart with this node", r, (int)closed,
             c->nnodes_max);
    return (rc = post_end(rz, s, r, &e, (int)closed + 1)) ? join_fail(j, rc) : JOIN_AGAIN;
  }
  log_info("round %d is full (%d nodes): waiting for it to end", r, (int)closed);
  rc = kv_wait(rz, s, key, -1);
  if (rc == 1) return JOIN_OVER;
  return rc ? join_fail(j, rc) : JOIN_AGAIN;
}

/* This node closes round j->r (act: at once, or after last_call_timeout whether or not someone
 * closed it meanwhile) with everyone who has joined so far (at least this node, so at least
 * min): it publishes their list, then sets the closed count. j->closed gets the count the round
 * closed with. */
static join_step_t join_close(rdzv_t *rz, join_t *j, const char *closed_key, rdzv_close_action_t act) {
  const rdzv_config_t *c = &rz->cfg;
  rdzv_conn_t *s = j->s;
  int r = j->r, rc;
  int64_t count = j->idx;
  if (act == RDZV_CLOSE_AFTER_LAST_CALL) {
    rc = wait_closed(rz, s, r, closed_key, rdzv_mono_now() + c->last_call_timeout_s, "last_call_timeout", NULL, NULL);
    if (rc == 1) return JOIN_OVER;
    if (rc && rc != STORE_ETIMEDOUT) return join_fail(j, rc);
    if ((rc = rz->kv->joined(rz, s, r, &count))) return join_fail(j, rc);
    if (count > c->nnodes_max) count = c->nnodes_max;
  }
  /* A participant that never wrote its description: close anyway, and everyone (this node
   * too) times out waiting for the list, as they did waiting for the descriptions. */
  rc = publish_nodes(rz, s, r, (int)count, &j->nodes, (int)(c->close_timeout_s * 1000));
  if (rc == -EINVAL) return JOIN_OVER;
  if (rc && rc != STORE_ETIMEDOUT) return join_fail(j, rc);
  j->listed = rc ? 0 : (int)count;
  char val[32];
  snprintf(val, sizeof val, "%d", (int)count);
  void *actual = NULL;
  size_t alen = 0;
  if ((rc = rz->kv->compare_set(rz, s, closed_key, NULL, val, 0, &actual, &alen))) return join_fail(j, rc);
  if (actual) j->closed = strtoll(actual, NULL, 10);
  free(actual);
  return JOIN_NEXT;
}

/* Round j->r closes when another node closes it: waits for that until deadline (join_timeout),
 * j->closed getting the count it closed with. */
static join_step_t join_wait_close(rdzv_t *rz, join_t *j, const char *closed_key, double deadline) {
  const rdzv_config_t *c = &rz->cfg;
  void *cv = NULL;
  size_t clen = 0;
  int rc = wait_closed(rz, j->s, j->r, closed_key, deadline, "join_timeout", &cv, &clen);
  if (rc == 0) j->closed = strtoll(cv, NULL, 10);
  free(cv);
  if (rc == 1) return JOIN_OVER;
  if (rc == STORE_ETIMEDOUT) {
    int64_t count = 0;
    rz->kv->joined(rz, j->s, j->r, &count);
    rdzv_emit_error(rz, "rendezvous round %d did not close within join_timeout=%gs: %d of min %d nodes joined", j->r,
                    c->join_timeout_s, (int)count, c->nnodes_min);
    return JOIN_OVER;
  }
  return rc ? join_fail(j, rc) : JOIN_NEXT;
}

/* Round j->r is open: takes a join index, describes this node, then waits for the round to
 * close, or closes it. JOIN_NEXT with j->closed known and this node in; JOIN_AGAIN when the
 * round closed before this node joined. */
static join_step_t join_open(rdzv_t *rz, join_t *j, double deadline) {
  const rdzv_config_t *c = &rz->cfg;
  rdzv_conn_t *s = j->s;
  int r = j->r, rc;
  char key[RDZV_KEY_MAX], node_key[RDZV_KEY_MAX], closed_key[RDZV_KEY_MAX], val[RDZV_ADDR_MAX + 64];
  if ((rc = rz->kv->join(rz, s, r, &j->idx))) return join_fail(j, rc);
  /* Liveness first (a heartbeat counter in the store, a key on this node's lease in etcd):
   * whoever reads our description can then count on finding it. */
  rdzv_keyf(rz, key, "r%d/%s/%d", r, rz->kv->alive, (int)j->idx);
  rdzv_keyf(rz, node_key, "r%d/node/%d", r, (int)j->idx);
  snprintf(val, sizeof val, "%d %d %s", c->node_rank, c->nproc, c->addr);
  if ((rc = rz->kv->set_pair(rz, s, key, rz->kv->alive_value, node_key, val, 1))) return join_fail(j, rc);
  log_debug("round %d: joined as node %d", r, (int)j->idx);
  rdzv_keyf(rz, closed_key, "r%d/closed", r);
  j->listed = 0;
  j->closed = -1;
  rdzv_close_action_t act = rdzv_close_action((int)j->idx, c->nnodes_min, c->nnodes_max);
  join_step_t st = act == RDZV_CLOSE_WAIT ? join_wait_close(rz, j, closed_key, deadline)
                                          : join_close(rz, j, closed_key, act);
  if (st != JOIN_NEXT) return st;
  if (j->closed < 0 && (rc = rdzv_read_int(rz, s, closed_key, -1, &j->closed))) return join_fail(j, rc);
  if (j->idx > j->closed) {
    log_info("round %d closed with %d nodes before this node (index %d) joined", r, (int)j->closed, (int)j->idx);
    free(j->nodes);
    j->nodes = NULL;
    return JOIN_AGAIN;
  }
  return JOIN_NEXT;
}

/* This node has group rank 0: it writes the round's master record (key). A fresh port each
 * round: the previous round's rank 0 may still hold the old one in TIME_WAIT, and a PyTorch
 * rank 0 binds MASTER_PORT itself. The failure count goes in the same value, read here, before
 * any worker of round r exists: every failure of earlier rounds is in (the claimer adds it
 * before it ends the round, and round r only opens after that), and none of round r can be
 * yet. Each node reading P/failures for itself could see a failure of round r posted before a
 * slow node got there. Where the round's store is this node's own (round_store), its port goes
 * in too. */
static join_step_t join_write_master(rdzv_t *rz, join_t *j, const char *key) {
  const rdzv_config_t *c = &rz->cfg;
  char err[RDZV_MSG_MAX], fkey[RDZV_KEY_MAX], val[RDZV_ADDR_MAX + 64];
  int rc, port = c->master_port; /* the user's, on one node; else a free one */
  if (port <= 0 && net_free_port("", &port, err, sizeof err)) {
    rdzv_emit_error(rz, "choosing MASTER_PORT: %s", err);
    return JOIN_OVER;
  }
  int64_t failures;
  rdzv_keyf(rz, fkey, "failures");
  if ((rc = rdzv_read_int(rz, j->s, fkey, 0, &failures))) return join_fail(j, rc);
  if (rdzv_master_encode(val, sizeof val, c->addr, port, (int)failures, rz->kv->round_store ? c->node_store_port : 0)) {
    rdzv_emit_error(rz, "rendezvous round %d: master endpoint %s too long", j->r, c->addr);
    return JOIN_OVER;
  }
  return (rc = rz->kv->set(rz, j->s, key, val, 0)) ? join_fail(j, rc) : JOIN_NEXT;
}

/* Round j->r closed with this node in: its participants (ours when this node closed the round,
 * else the closer's list), this node's ranks, the master record, then ASSIGNED and the round
 * for the watch thread. */
static join_step_t join_assign(rdzv_t *rz, join_t *j) {
  const rdzv_config_t *c = &rz->cfg;
  rdzv_conn_t *s = j->s;
  int r = j->r, n = (int)j->closed, rc;
  /* A node without --node_rank that did not join first cannot be group rank 0 (ranks follow
   * join order unless every node has one), so it reads the master record in the same request. */
  int not_rank0 = c->node_rank < 0 && j->idx != 1;
  if (j->listed != n) {
    free(j->nodes);
    j->nodes = NULL;
    if ((rc = read_node_list(rz, s, r, n, &j->nodes, not_rank0 ? &j->mv : NULL, &j->mlen,
                             (int)(c->close_timeout_s * 1000))))
      return rc == -EINVAL ? JOIN_OVER : join_fail(j, rc);
  }
  rdzv_assignment_t a;
  int rank0_idx = 0;
  char err[RDZV_MSG_MAX], key[RDZV_KEY_MAX];
  if (rdzv_assign_ranks(j->nodes, n, (int)j->idx, &a, &rank0_idx, err, sizeof err)) {
    rdzv_emit_error(rz, "rendezvous round %d: %s", r, err);
    return JOIN_OVER;
  }
  a.round = r;
  rdzv_keyf(rz, key, "r%d/master", r);
  join_step_t st = rank0_idx == j->idx ? join_write_master(rz, j, key) : JOIN_NEXT;
  if (st != JOIN_NEXT) return st;
  if (!j->mv && (rc = rz->kv->get_wait(rz, s, key, &j->mv, &j->mlen, (int)(c->close_timeout_s * 1000))))
    return join_fail(j, rc);
  if (rdzv_master_decode(j->mv, j->mlen, &a)) {
    rdzv_emit_error(rz, "rendezvous round %d: malformed master record", r);
    return JOIN_OVER;
  }
  rdzv_event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return JOIN_OVER;
  ev->kind = RDZV_EV_ASSIGNED;
  a.serves_store = rz->kv->round_store ? rank0_idx == j->idx : c->is_store_host;
  ev->assignment = a;
  watch_round(rz, r, n, (int)j->idx, a.serves_store, j->nodes);
  j->nodes = NULL;
  emit(rz, ev);
  free(ev);
  return JOIN_OVER;
}

/* A call of the join failed with rc: this node was fenced, the call timed out, or the store is
 * lost. */
static void join_failed(rdzv_t *rz, rdzv_conn_t *s, int rc) {
  if (rc == RDZV_EFENCED)
    rdzv_fenced(rz, rdzv_lease_now(rz), "its etcd lease expired while it was joining (cut off from etcd for its TTL)");
  else if (rc == STORE_ETIMEDOUT)
    rdzv_emit_error(rz, "rendezvous timed out: %s", rz->kv->errmsg(s, rc));
  else
    rdzv_store_lost(rz, s, rc);
}

/* Joins the current round, or the next: a lease first where the backend has them, then round
 * after round until one takes this node in (ASSIGNED), an error is told, or rdzv stops. */
static void do_join(rdzv_t *rz) {
  double deadline = rdzv_mono_now() + rz->cfg.join_timeout_s;
  if (ensure_conn(rz, &rz->cs, (int)(rz->cfg.join_timeout_s * 1000))) return;
  join_t j = {.s = &rz->cs};
  join_step_t st = JOIN_AGAIN;
  if (rz->kv->lease_ensure && (j.rc = rz->kv->lease_ensure(rz, j.s))) st = JOIN_FAILED;
  while (st == JOIN_AGAIN && !atomic_load(&rz->stop)) {
    st = join_look(rz, &j);
    if (st == JOIN_NEXT) st = join_open(rz, &j, deadline);
    if (st == JOIN_NEXT) st = join_assign(rz, &j);
  }
  if (st == JOIN_FAILED) join_failed(rz, j.s, j.rc);
  free(j.mv);
  free(j.nodes);
}

void rdzv_round_call_failed(rdzv_t *rz, rdzv_conn_t *c, int rc) {
  if (rc == RDZV_EFENCED)
    rdzv_fenced(rz, rdzv_lease_now(rz), "its etcd lease is gone: it cannot end a round it is no longer part of");
  else
    rdzv_store_lost(rz, c, rc);
}

static void do_end(rdzv_t *rz, rdzv_end_t *e) {
  if (ensure_conn(rz, &rz->cs, (int)(rz->cfg.join_timeout_s * 1000))) return;
  uv_mutex_lock(&rz->mu);
  int r = rz->cur_round, n = rz->cur_n;
  e->node_idx = rz->cur_my_idx;
  uv_mutex_unlock(&rz->mu);
  int rc = post_end(rz, &rz->cs, r, e, n);
  if (rc) rdzv_round_call_failed(rz, &rz->cs, rc);
}

static void do_done(rdzv_t *rz) {
  rdzv_conn_t *s = &rz->cs;
  char key[RDZV_KEY_MAX];
  uv_mutex_lock(&rz->mu);
  int r = rz->cur_round, n = rz->cur_n, me = rz->cur_my_idx, serves = rz->cur_serves;
  uv_mutex_unlock(&rz->mu);
  rdzv_keyf(rz, key, "r%d/done/%d", r, me);
  /* Before the set: once it lands, the host may leave at any moment, and the watch thread's
   * connection dropping then is expected, not a lost store. */
  atomic_store(&rz->done, 1);
  int rc = rz->kv->set(rz, s, key, "1", 0);
  if (rc) {
    rdzv_store_lost(rz, s, rc);
    return;
  }
  /* The node that serves the round's store waits for the others to finish (or the round to
   * end) before exiting, since leaving would take the store from under their workers. Others
   * leave at once. */
  if (serves) {
    char end_key[RDZV_KEY_MAX];
    rdzv_keyf(rz, end_key, "r%d/end", r);
    int i = 1;
    while (i <= n && !atomic_load(&rz->stop)) {
      rdzv_keyf(rz, key, "r%d/done/%d", r, i);
      int ended = 0;
      rc = rz->kv->exists(s, end_key, &ended);
      if (rc || ended) break;
      rc = kv_wait(rz, s, key, (int)(rz->cfg.heartbeat_interval_s * 1000));
      if (rc == 0) i++;
      else if (rc != STORE_ETIMEDOUT) break;
    }
    if (i > n && rz->kv->forget_job) rz->kv->forget_job(rz, s); /* everyone is done: the job is over */
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
    rdzv_cmd_t cmd = rz->cmds[0];
    memmove(rz->cmds, rz->cmds + 1, (size_t)(rz->ncmds - 1) * sizeof cmd);
    rz->ncmds--;
    uv_mutex_unlock(&rz->mu);
    switch (cmd.kind) {
    case RDZV_CMD_JOIN: do_join(rz); break;
    case RDZV_CMD_END: do_end(rz, &cmd.end); break;
    case RDZV_CMD_DONE: do_done(rz); break;
    }
  }
}

static void cmd_main(void *arg) {
  cmd_loop(arg);
  thread_exited(arg);
}

/* The watchdog (loop thread, every half heartbeat interval; a backend with a watchdog, not on
 * the store's own node): a store silent for heartbeat_timeout while a round runs is lost. The
 * watch thread's blocked call is interrupted: it fails at once and reports (rdzv_store_lost
 * words it from silent_s). */
static void on_watchdog(uv_timer_t *t) {
  rdzv_t *rz = t->data;
  if (atomic_load(&rz->stop) || atomic_load(&rz->done)) return;
  uv_mutex_lock(&rz->mu);
  double silent = rdzv_mono_now() - rz->last_reply;
  if (rz->watching && rz->silent_s == 0 && silent > rz->cfg.heartbeat_timeout_s) {
    rz->silent_s = silent;
    rz->kv->interrupt(&rz->ws);
  }
  uv_mutex_unlock(&rz->mu);
}

/* On the store's node, after a fatal end of round r: waits until each other participant has
 * acknowledged it (P/r<r>/seen/<i>), skipping those done (they have left) or silent for
 * heartbeat_timeout by hb (dead), for at most heartbeat_timeout in all: a node that dies
 * meanwhile must not keep the job from ending. */
static void drain_fatal_end(rdzv_t *rz, rdzv_conn_t *s, int r, int n, int me, const char *done, const rdzv_hb_t *hb) {
  const double timeout = rz->cfg.heartbeat_timeout_s;
  double deadline = rdzv_mono_now() + timeout;
  char key[RDZV_KEY_MAX];
  for (int i = 1; i <= n; i++) {
    if (i == me || (done && done[i - 1]) ||
        (hb && hb->watched == i - 1 && rdzv_hb_is_dead(hb, i - 1, rdzv_mono_now(), timeout)))
      continue;
    int is_done = 0;
    rdzv_keyf(rz, key, "r%d/done/%d", r, i);
    if (rz->kv->exists(s, key, &is_done)) return;
    if (is_done) continue;
    double left = deadline - rdzv_mono_now();
    rdzv_keyf(rz, key, "r%d/seen/%d", r, i);
    int rc = kv_wait(rz, s, key, left > 0 ? (int)(left * 1000) + 1 : 0);
    if (rc == STORE_ETIMEDOUT) {
      log_debug("round %d: node %d did not acknowledge the job's end within heartbeat_timeout=%gs", r, i, timeout);
      continue;
    }
    if (rc) return; /* stopped, or the connection failed: nothing more to wait for */
  }
}

int rdzv_deliver_end(rdzv_t *rz, int r, const void *v, size_t len) {
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

int rdzv_end_dead(rdzv_t *rz, rdzv_conn_t *s, int r, int n, int me, const rdzv_node_t *nodes, const char *done,
                  int i, const char *what) {
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
 * of the job's real end), with etcd then deletes the job's keys (forget_job), and lets its agent
 * go (DRAINED). The others say they have read it (best effort: the wait has a deadline). hb: the
 * round's heartbeat verdicts (c10d; NULL with etcd, whose dead nodes have ended the round). */
void rdzv_job_over(rdzv_t *rz, rdzv_conn_t *s, int r, int n, int me, const char *done, const rdzv_hb_t *hb) {
  char key[RDZV_KEY_MAX];
  uv_mutex_lock(&rz->mu);
  int serves = rz->cur_serves;
  uv_mutex_unlock(&rz->mu);
  if (!serves) {
    rdzv_keyf(rz, key, "r%d/seen/%d", r, me);
    rz->kv->set(rz, s, key, "1", 0);
    return;
  }
  drain_fatal_end(rz, s, r, n, me, done, hb);
  if (rz->kv->forget_job) rz->kv->forget_job(rz, s);
  rdzv_event_t dr = {.kind = RDZV_EV_DRAINED};
  emit(rz, &dr);
}

int rdzv_read_done(rdzv_t *rz, rdzv_conn_t *s, int r, int i, char *done) {
  char key[RDZV_KEY_MAX];
  int exist = 0;
  rdzv_keyf(rz, key, "r%d/done/%d", r, i + 1);
  int rc = rz->kv->exists(s, key, &exist);
  if (!rc && exist) done[i] = 1;
  return rc;
}

int rdzv_watch_stale(rdzv_t *rz, int gen) {
  uv_mutex_lock(&rz->mu);
  int stale = rz->watch_gen != gen;
  uv_mutex_unlock(&rz->mu);
  return stale;
}

/* The watch thread: each round published by a join goes to the backend's watcher; between
 * rounds (joining, restarting), a lease still needs renewing. */
static void watch_loop(rdzv_t *rz) {
  int seen = 0;
  double next_renewal = 0;
  for (;;) {
    uv_mutex_lock(&rz->mu);
    while (rz->watch_gen == seen && !atomic_load(&rz->stop)) {
      if (!rz->kv->lease_renew || !rz->lease) {
        uv_cond_wait(&rz->watch_cond, &rz->mu);
        continue;
      }
      uv_mutex_unlock(&rz->mu);
      if (ensure_conn(rz, &rz->ws, (int)(rz->cfg.join_timeout_s * 1000)) == 0)
        rz->kv->lease_renew(rz, &rz->ws, &next_renewal);
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
    if (ensure_conn(rz, &rz->ws, (int)(rz->cfg.join_timeout_s * 1000)) == 0) rz->kv->watch(rz, seen, r, n, me, nodes);
    free(nodes);
  }
}

static void watch_main(void *arg) {
  watch_loop(arg);
  thread_exited(arg);
}

static void free_rdzv(rdzv_t *rz) {
  rz->kv->close(&rz->cs);
  rz->kv->close(&rz->ws);
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
  /* The one choice of a backend: the round logic asks rz->kv, never cfg.kv. */
  static const rdzv_kv_t *const backends[] = {[RDZV_KV_C10D] = &rdzv_kv_store, [RDZV_KV_ETCD] = &rdzv_kv_etcd};
  rz->kv = backends[cfg->kv];
  rz->cfg = *cfg;
  rz->cfg.conn = NULL;
  rz->cs.client = cfg->conn; /* c10d: one connection fewer per node: the agent's probe already shook hands */
  if (rz->cs.client) atomic_store(&rz->reached, 1);
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
  if (!cfg->is_store_host && rz->kv->watchdog) {
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

static void push_cmd(rdzv_t *rz, const rdzv_cmd_t *c) {
  uv_mutex_lock(&rz->mu);
  if (rz->ncmds < (int)(sizeof rz->cmds / sizeof rz->cmds[0])) rz->cmds[rz->ncmds++] = *c;
  else log_error("rdzv: command queue full");
  uv_cond_signal(&rz->cmd_cond);
  uv_mutex_unlock(&rz->mu);
}

void rdzv_join(rdzv_t *rz) {
  rdzv_cmd_t c = {.kind = RDZV_CMD_JOIN};
  push_cmd(rz, &c);
}

void rdzv_end_round(rdzv_t *rz, const rdzv_end_t *e) {
  rdzv_cmd_t c = {.kind = RDZV_CMD_END, .end = *e};
  push_cmd(rz, &c);
}

void rdzv_done(rdzv_t *rz) {
  rdzv_cmd_t c = {.kind = RDZV_CMD_DONE};
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

int rdzv_destroy(rdzv_t *rz, int wait_ms) {
  if (!rz) return 0;
  rdzv_shutdown(rz);
  uv_mutex_lock(&rz->mu);
  /* Wake calls in progress: they fail at once (etcd's within about a second), see stop and
   * return. */
  rz->kv->interrupt(&rz->cs);
  rz->kv->interrupt(&rz->ws);
  uint64_t deadline = uv_hrtime() + (uint64_t)(wait_ms > 0 ? wait_ms : 0) * 1000000u;
  while (rz->live_threads > 0) {
    uint64_t t = uv_hrtime();
    if (t >= deadline || uv_cond_timedwait(&rz->exit_cond, &rz->mu, deadline - t) == UV_ETIMEDOUT) break;
  }
  int live = rz->live_threads;
  uv_mutex_unlock(&rz->mu);
  if (rz->kv->lease_revoke) rz->kv->lease_revoke(rz);
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
  case RDZV_END_HEALTH: return 0; /* asked for only while enough healthy nodes remain */
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
  case RDZV_END_HEALTH: return "health";
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

/* 0 with the number o.name, or -1 when it is absent or not a number. */
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
  else if (!strcmp(kind, "health")) e->kind = RDZV_END_HEALTH;
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
