/* rdzv_kv: the key-value layer under rdzv's rounds, and what its backends share with rdzv.c.
 *
 * rdzv.c holds the rounds (joining, closing, assigning ranks, ending); a backend holds where the
 * keys live and how a node's liveness is told: rdzv_kv_store.c (meshrun's c10d-like store:
 * heartbeat counters that peers judge, a watchdog on the store's silence) and rdzv_kv_etcd.c (an
 * etcd cluster: a lease per node, one watch per round). rdzv_create picks one rdzv_kv_t from
 * cfg.kv; the round logic calls only through it and never asks which one it has: it asks the
 * entry's fields what the backend does, and skips an optional call that is NULL.
 *
 * Every call blocks, on one of rdzv's two threads with that thread's connection (rdzv_conn_t),
 * never on the loop. Calls return 0, a STORE_E* code (STORE_ENOKEY: no such key; the etcd
 * backend speaks the same codes), or RDZV_EFENCED: a leased write refused because this node's
 * lease is gone. Waits return 1 when rdzv is stopping. Keys are whole (rdzv_keyf: under
 * "meshrun/<run_id>/"); values are text.
 *
 * Adding a backend: a file rdzv_kv_<name>.c that defines `const rdzv_kv_t rdzv_kv_<name>`, its
 * kind in rdzv_kv_kind_t (rdzv.h) and its line in rdzv_create's table. This header is rdzv's
 * own: only rdzv.c and its backends include it. */
#ifndef MESHRUN_RDZV_KV_H
#define MESHRUN_RDZV_KV_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "launcher/rdzv.h"

#define RDZV_KEY_MAX 512
/* A leased write refused because this node's lease is gone (fenced out). Not a STORE_E* code,
 * which rdzv otherwise speaks for every backend. */
#define RDZV_EFENCED (-100)

/* One thread's connection: the backend's client (store_t, etcd_t), NULL until connected. */
typedef struct {
  void *client;
} rdzv_conn_t;

typedef struct rdzv_kv {
  const char *name;
  /* Liveness in a round: participant i writes P/r<r>/<alive>/<i> = alive_value together with
   * its description, leased (a heartbeat counter the watcher bumps; a key on the lease). */
  const char *alive;
  const char *alive_value;
  int handshake_ms; /* the bound on a connection's handshake when cfg.handshake_ms is 0 */
  /* 1: each round's workers use the store of its group rank 0's node (its port goes in the
   * master record, and that node serves them); 0: they use the rendezvous store, whose node
   * serves them (cfg.is_store_host). */
  int round_store;
  /* 1: a claim dies with its claimer's lease, so a round may have its end with no claim held:
   * post_end looks for the end before it claims. */
  int check_end_first;
  /* 1: the store can go silent under a blocked call: a loop timer on the nodes that do not
   * serve it judges its silence (rdzv.h) and interrupts the watch thread's call. */
  int watchdog;

  /* Connects *client for connection c (rz->cs or rz->ws) within timeout_ms, the handshake
   * within hs ms; err gets the failure. rdzv reports it (unreachable, or lost after a first
   * success). */
  int (*connect)(rdzv_t *rz, const rdzv_conn_t *c, void **client, int timeout_ms, int hs, char *err,
                 size_t errlen);
  /* The first connection failed with rc: emits one RDZV_EV_ERROR that names the endpoint. */
  void (*unreachable)(rdzv_t *rz, int rc, int hs, const char *err);
  /* The backend, reached before, is gone (cause: why): emits RDZV_EV_STORE_LOST. */
  void (*lost)(rdzv_t *rz, const char *cause);
  const char *(*errmsg)(const rdzv_conn_t *c, int rc); /* the last failed call's message */
  void (*interrupt)(rdzv_conn_t *c); /* any thread: the call in progress fails at once */
  void (*close)(rdzv_conn_t *c);     /* accepts a connection never made */

  /* leased: the key dies with this node's lease (where the backend has leases). */
  int (*set)(rdzv_t *rz, rdzv_conn_t *c, const char *key, const char *val, int leased);
  /* Sets k1 and k2 in one request, so that no reader sees k2 without k1. */
  int (*set_pair)(rdzv_t *rz, rdzv_conn_t *c, const char *k1, const char *v1, const char *k2, const char *v2,
                  int leased);
  int (*get_nowait)(rdzv_conn_t *c, const char *key, void **v, size_t *len); /* STORE_ENOKEY */
  /* Optional: the values of k1 and k2 in one request, waiting up to timeout_ms for both. */
  int (*get_pair)(rdzv_conn_t *c, const char *k1, const char *k2, void **v1, size_t *l1, void **v2, size_t *l2,
                  int timeout_ms);
  int (*add)(rdzv_conn_t *c, const char *key, int64_t delta, int64_t *out);
  /* Sets key to desired if it is absent (expected NULL) or holds expected; *actual (malloc'ed,
   * NUL past *alen) gets the value after the call. */
  int (*compare_set)(rdzv_t *rz, rdzv_conn_t *c, const char *key, const char *expected, const char *desired,
                     int leased, void **actual, size_t *alen);
  int (*exists)(rdzv_conn_t *c, const char *key, int *exist);
  /* Waits for key up to timeout_ms (< 0: until stop), seeing the stop flag, and returns its
   * value (malloc'ed) when v is not NULL. Returns 0, STORE_ETIMEDOUT, 1 when stopped, or an
   * error. */
  int (*wait_get)(rdzv_t *rz, rdzv_conn_t *c, const char *key, int timeout_ms, void **v, size_t *len);
  /* The value of key, waiting up to timeout_ms for it; stopping counts as timing out. */
  int (*get_wait)(rdzv_t *rz, rdzv_conn_t *c, const char *key, void **v, size_t *len, int timeout_ms);

  /* This node's join index in round r (1, 2, ...), and how many have taken one. */
  int (*join)(rdzv_t *rz, rdzv_conn_t *c, int r, int64_t *idx);
  int (*joined)(rdzv_t *rz, rdzv_conn_t *c, int r, int64_t *count);
  /* The descriptions of participants 1..n of round r into vals[0..n) (malloc'ed), waiting up
   * to timeout_ms for the slow. */
  int (*read_nodes)(rdzv_t *rz, rdzv_conn_t *c, int r, int n, void **vals, int timeout_ms);
  /* The watch thread's round r (generation gen) on rz->ws, until it ends, the generation
   * changes or rdzv stops: its end (rdzv_deliver_end, rdzv_job_over), this node's liveness,
   * the peers' (rdzv_end_dead). */
  void (*watch)(rdzv_t *rz, int gen, int r, int n, int me, const rdzv_node_t *nodes);
  /* Optional: the job is over; its keys go, so that its run id can be used again. */
  void (*forget_job)(rdzv_t *rz, rdzv_conn_t *c);

  /* Optional, together: this node's lease (rz->lease). ensure grants one when it has none
   * (before a join); renew, on the watch thread, renews it when *next is due and returns 1
   * when this node is fenced (rdzv_fenced); revoke, at exit, drops it on a client of its own. */
  int (*lease_ensure)(rdzv_t *rz, rdzv_conn_t *c);
  int (*lease_renew)(rdzv_t *rz, rdzv_conn_t *c, double *next);
  void (*lease_revoke)(rdzv_t *rz);
} rdzv_kv_t;

extern const rdzv_kv_t rdzv_kv_store;
extern const rdzv_kv_t rdzv_kv_etcd;

typedef enum { RDZV_CMD_JOIN = 0, RDZV_CMD_END, RDZV_CMD_DONE } rdzv_cmd_kind_t;

typedef struct {
  rdzv_cmd_kind_t kind;
  rdzv_end_t end;
} rdzv_cmd_t;

struct rdzv {
  rdzv_config_t cfg;
  const rdzv_kv_t *kv;
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
  rdzv_cmd_t cmds[16];
  int ncmds;
  rdzv_event_t *events;
  int nevents, capevents;

  /* The running round, published by the command thread for the watch thread. */
  int cur_round, cur_n, cur_my_idx, watch_gen;
  int cur_serves; /* this node serves the round's store (rdzv_kv_t.round_store) */
  rdzv_node_t *cur_nodes;

  rdzv_conn_t cs, ws; /* command and watch connections; set under mu (rdzv_destroy reads them) */
  uv_thread_t cmd_thr, watch_thr;

  /* The store's liveness (see rdzv.h), under mu: the watch thread marks each reply, the
   * watchdog (a loop timer) compares. Backends with a watchdog only. */
  uv_timer_t watchdog;
  int watching;      /* the watch thread is in a round */
  double last_reply; /* rdzv_mono_now() of its last store reply */
  double silent_s;   /* > 0 once the watchdog found the store silent this long */
  atomic_int reached; /* a connection to the store succeeded once: failing now is losing it */

  /* This node's lease (backends with leases), under mu. Granted by the command thread when it
   * joins without one, renewed by the watch thread every heartbeat interval, dropped (0) when
   * fenced. */
  int64_t lease;
  double lease_ok; /* rdzv_mono_now() of its grant or last renewal */
  int ttl_s;       /* as the backend granted it (etcd may raise a short one to its minimum) */
  int watch_call_ms; /* the watch thread's call timeout (the lease's renewal lengthens it) */
};

/* ---- what rdzv.c gives its backends ---- */

double rdzv_mono_now(void);
/* out (RDZV_KEY_MAX bytes) = the job's prefix, then fmt. */
void rdzv_keyf(rdzv_t *rz, char *out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Seconds for a progress line: whole ones, tenths below ten. */
int rdzv_left_digits(double left);
void rdzv_emit_message(rdzv_t *rz, rdzv_event_kind_t kind, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
#define rdzv_emit_error(rz, ...) rdzv_emit_message(rz, RDZV_EV_ERROR, __VA_ARGS__)
int64_t rdzv_lease_now(rdzv_t *rz);
/* This node's lease is gone (or must be presumed gone): FENCED, once per lease. */
void rdzv_fenced(rdzv_t *rz, int64_t lease, const char *why);
/* A call failed with rc: the store lost (STORE_LOST, worded by the watchdog's verdict when it
 * has one); round_call_failed: or fenced, for a call a round's end depends on. */
void rdzv_store_lost(rdzv_t *rz, rdzv_conn_t *c, int rc);
void rdzv_round_call_failed(rdzv_t *rz, rdzv_conn_t *c, int rc);
/* Reads an integer key; absent reads as dflt. */
int rdzv_read_int(rdzv_t *rz, rdzv_conn_t *c, const char *key, int64_t dflt, int64_t *out);
/* Whether participant i (0-based) of round r has said it is done, into done[i]. */
int rdzv_read_done(rdzv_t *rz, rdzv_conn_t *c, int r, int i, char *done);
/* Whether the watch thread's round (generation gen) has been replaced by another. */
int rdzv_watch_stale(rdzv_t *rz, int gen);
/* Round r's end record (v, len) is in: tells the agent. Returns whether it is fatal. */
int rdzv_deliver_end(rdzv_t *rz, int r, const void *v, size_t len);
/* After round r's fatal end: the serving node drains and lets go, the others acknowledge.
 * hb: the round's heartbeat verdicts, or NULL where the backend's dead nodes end the round. */
void rdzv_job_over(rdzv_t *rz, rdzv_conn_t *c, int r, int n, int me, const char *done, const rdzv_hb_t *hb);
/* Participant i (0-based) of round r is gone (what: how it was found): ends the round as a
 * dead node's, unless someone did. */
int rdzv_end_dead(rdzv_t *rz, rdzv_conn_t *c, int r, int n, int me, const rdzv_node_t *nodes, const char *done,
                  int i, const char *what);

#endif
