/* rdzv: meshrun's rendezvous and heartbeats over the store or etcd, off the event loop.
 *
 * The blocking store client (common/store.h) must never run on the loop thread, because that
 * loop may be the one serving the store. So rdzv owns two threads, each with its own store_t:
 *   - the command thread joins rounds, posts round ends and marks this node done;
 *   - the watch thread, while a round runs, waits on the round's "end" key (event-driven: the
 *     server answers the wait the moment the key is set) with a timeout of one heartbeat
 *     interval, writes this node's heartbeat on each timeout and judges its peers'.
 * Both report to the loop with uv_async_send; the callback runs on the loop thread. The loop
 * stops them with a flag; every store wait they make is bounded (heartbeat interval or join
 * timeout), so they notice.
 *
 * The store's own liveness. The store lives in one node's meshrun (c10d's single point of
 * failure): when that node dies, no other node can go on. A store that closes its connections
 * (its process died) is noticed on the next reply; one that goes silent (its host lost power
 * or the network, its process stopped) would hold a store call for seconds (the client's
 * slack) to a minute, so on every node but the store's own a loop timer, the watchdog, judges
 * the store as the watch thread judges peers: no reply for heartbeat_timeout while a round
 * runs (the watch thread's wait is answered every heartbeat interval) and the store is lost;
 * the watchdog interrupts the blocked call. Either way the agent gets RDZV_EV_STORE_LOST with
 * one line that names the store's host:port. rdzv_destroy also shuts their store sockets down so that they
 * notice at once, joins them and frees everything; only a thread still inside a connect
 * attempt past its wait (a store that stopped answering) is left to end with the process,
 * holding the rdzv_t (reachable from its stack: not a leak, and bounded by join_timeout).
 *
 * Key schema, all under P = "meshrun/<run_id>/":
 *   P/round              current round number (decimal); absent = 0. Bumped r -> r+1 with
 *                        compare_set by whoever ends round r (and by anyone who finds r ended).
 *   P/failures           failure rounds so far, job-wide (store_add). The restart budget is
 *                        spent when it exceeds --max_restarts; it lives in the store so that
 *                        every node sees one budget. Dead-node and scale-up rounds do not count
 *                        (torchrun's TORCHELASTIC_RESTART_COUNT; see P/r<r>/master).
 *   P/r<r>/n             join counter of round r: store_add gives each node its join index
 *                        (1-based). Nodes with index <= the closed count are the participants.
 *                        With etcd, P/r<r>/join/<lease> instead: a node's index is the count
 *                        of join keys created up to its own (no counter to contend on).
 *   P/r<r>/node/<i>      participant i: "node_rank nproc addr" (node_rank -1 when not given).
 *   P/r<r>/closed        participant count N, set once (compare_set) when the round closes: at
 *                        max nodes at once, or by the node whose index is min once
 *                        last_call_timeout has passed since it joined (a node with a higher
 *                        index joined later, so the min-th node's timer is the first to fire).
 *   P/r<r>/master        "addr port failures" (spaces, since addr may be an IPv6 literal, kept
 *                        bare as torch wants MASTER_ADDR): MASTER_ADDR/MASTER_PORT, chosen fresh
 *                        each round by the node with group rank 0 (a port free on that node, not
 *                        the store's), and P/failures as that node read it when round r closed:
 *                        the round's TORCHELASTIC_RESTART_COUNT, one value for every node (a node
 *                        reading P/failures itself could already see a failure of round r).
 *   P/r<r>/hb/<i>        heartbeat of participant i: a counter it bumps every heartbeat interval.
 *                        Peers compare values, not clocks, so clock skew does not matter.
 *   P/r<r>/done/<i>      participant i's workers all exited 0 (it stops heartbeating).
 *   P/r<r>/claim         compare_set by the first node to end round r (only that one counts a
 *                        failure), which then writes:
 *   P/r<r>/end           JSON rdzv_end_t: why round r ended (failure, dead node, scale-up, the
 *                        health check leaving nodes out), the root cause and whether the job
 *                        is over (fatal). Every agent watches it.
 *   P/r<r>/seen/<i>      participant i read a fatal end. The store's node waits for these (at
 *                        most heartbeat_timeout) before it lets its agent exit and take the
 *                        store away: every node then ends with the job's real cause and code.
 * etcd (--rdzv_backend=etcd): the same keys in etcd, with these differences. Liveness is a lease
 * per node (TTL heartbeat_timeout), granted when the node joins without one and renewed by the
 * watch thread every heartbeat interval, also between rounds:
 *   P/r<r>/alive/<i>     on participant i's lease, instead of P/r<r>/hb/<i>: deleted by etcd
 *                        when the lease expires or is revoked. The watch thread watches every
 *                        key under P/r<r>/ from one read's revision: the end key, or an alive
 *                        key deleted while its node is not done (a dead node), ends the round.
 *   P/r<r>/node/<i>, P/r<r>/claim   also on the lease: a fenced node cannot join or end a round
 *                        (etcd refuses a write on a lease that is gone), and a claimer that dies
 *                        before writing the end frees the claim. An end already written is final.
 *   P/r<r>/master        "addr port failures store_port": the round's first node's own store,
 *                        which serves that round's workers (MESHRUN_STORE). That node waits for
 *                        the others' done keys (success), or for their seen keys after a fatal
 *                        end (at most heartbeat_timeout), then deletes every key of the job,
 *                        so that its run id can be used again; then DRAINED lets its agent go.
 * A node whose lease is gone (etcd says so, or no renewal succeeded for its TTL) is fenced
 * (RDZV_EV_FENCED): it stops its workers and joins again with a new lease. At exit the lease is
 * revoked, so the others see a node that left at once.
 *
 * A node arriving while round r runs with fewer than max nodes ends round r ("scale_up") and
 * joins r+1; everyone else follows. When the round is full it waits for the round's end.
 *
 * Not here: the store server (launcher/store_server), workers (launcher/workers), the state
 * machine that reacts to events (launcher/agent). The decision logic (round closing, rank
 * assignment, heartbeat verdicts, fatal ends) is in pure functions at the end of this header,
 * tested without sockets in test/unit/test_rdzv.c. */
#ifndef MESHRUN_RDZV_H
#define MESHRUN_RDZV_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/store.h"

/* How long an etcd call (all members, retries included) may take before it counts as failed;
 * also the default bound on etcd's first answer (handshake_ms 0). */
#define RDZV_ETCD_CALL_S 5

#define RDZV_ADDR_MAX 256
#define RDZV_MSG_MAX 1024
#define RDZV_SECRET_MAX 1024 /* bytes of the job secret, its NUL included */

/* Where the keys live: rdzv_create picks the backend (launcher/rdzv_kv.h) from it. */
typedef enum { RDZV_KV_C10D = 0, RDZV_KV_ETCD } rdzv_kv_kind_t;

typedef struct {
  rdzv_kv_kind_t kv;  /* where the rendezvous keys live: meshrun's store, or an etcd cluster */
  char store_host[RDZV_ADDR_MAX]; /* c10d: the store */
  int store_port;
  char etcd_endpoints[1024]; /* etcd: "host:port,host:port,..." */
  char endpoint_from[200]; /* what named the endpoint, for messages ("--rdzv_endpoint", ...) */
  int node_store_port; /* etcd: the port of this node's own store (served by its agent); the
                        * round's first node publishes it for the workers (MESHRUN_STORE) */
  char run_id[128];           /* the job: its namespace in the store */
  char secret[RDZV_SECRET_MAX]; /* the job secret the store checks ("" = none, an open store) */
  int nnodes_min, nnodes_max;
  int node_rank; /* -1: by join order */
  int nproc;     /* this node's workers */
  char addr[RDZV_ADDR_MAX]; /* this node's address as peers should dial it (MASTER_ADDR) */
  double join_timeout_s, last_call_timeout_s, close_timeout_s;
  double heartbeat_interval_s, heartbeat_timeout_s;
  /* A connection's handshake (etcd: its first answer) not done by then fails the node: the
   * endpoint is not a meshrun store (or etcd), or a stuck one. 0: STORE_HANDSHAKE_S, or
   * RDZV_ETCD_CALL_S with etcd. Never longer than join_timeout. */
  int handshake_ms;
  double progress_interval_s; /* > 0: a line this often while waiting for nodes or the store */
  int max_restarts;
  int master_port; /* > 0: the workers' MASTER_PORT every round (--master_port on one node); 0: a
                    * free port of rank 0's node each round */
  int is_store_host; /* this node serves the store: it waits for the others before exiting */
  store_t *conn; /* c10d: an open connection to the store (the agent's probe of the endpoint),
                  * taken over for the joins, or NULL; rdzv_create owns it, failing or not */
} rdzv_config_t;

typedef struct {
  int idx;       /* join index in the round, 1-based */
  int node_rank; /* -1 when not given */
  int nproc;
  const char *addr; /* into the round's participant list, which owns it */
} rdzv_node_t;

/* This node's place in a closed round. */
typedef struct {
  int round;
  int nnodes;      /* participants (GROUP_WORLD_SIZE) */
  int my_idx;      /* join index */
  int group_rank;  /* GROUP_RANK: position after ordering */
  int rank_offset; /* global rank of local rank 0 */
  int world_size;
  int nproc;
  int failures;    /* failure restarts before this round, job-wide (TORCHELASTIC_RESTART_COUNT);
                    * the round number counts every restart, this one failures only */
  char master_addr[RDZV_ADDR_MAX];
  int master_port;
  int store_port; /* etcd: the round's store for the workers, at master_addr (the first node's
                   * own store); 0 with c10d (the workers use the rendezvous store) */
  int serves_store; /* this node serves the round's workers' store (c10d: the store's node;
                     * etcd: group rank 0): it waits for the others before it leaves, and
                     * after a fatal end for RDZV_EV_DRAINED */
} rdzv_assignment_t;

/* HEALTH: --health_check leaves nodes out (launcher/health.h); like a dead node's end, no
 * failure is counted, and the nodes left out leave instead of joining the next round. */
typedef enum { RDZV_END_FAILURE = 0, RDZV_END_DEAD_NODE, RDZV_END_SCALE_UP, RDZV_END_HEALTH } rdzv_end_kind_t;

/* Why a round ended. For failures, the root cause: the first worker to fail on the node that
 * claimed the end. */
typedef struct {
  rdzv_end_kind_t kind;
  int fatal;     /* the job is over: every agent exits with exit_code */
  int exit_code; /* the worker's code, 128+signal for a signal; 1 for non-worker causes */
  int rank;      /* global rank of the root-cause worker, -1 if none */
  int local_rank;
  int signal;    /* 0 unless the worker died by a signal */
  double time;   /* seconds since the epoch of the failure */
  int node_idx;  /* join index of the node that ended the round */
  char host[RDZV_ADDR_MAX];
  char message[RDZV_MSG_MAX]; /* the worker's error file message, or "" */
  char reason[RDZV_MSG_MAX];  /* one line for humans */
} rdzv_end_t;

typedef enum {
  RDZV_EV_ASSIGNED = 0, /* a round closed: ev->assignment */
  RDZV_EV_ROUND_END,    /* the running round ended: ev->end */
  RDZV_EV_DONE,         /* after rdzv_done: this agent may exit */
  RDZV_EV_ERROR,        /* fatal: join timeout, bad peers; ev->message */
  RDZV_EV_STORE_LOST,   /* fatal: the store, reached before, is gone or silent; ev->message */
  RDZV_EV_DRAINED,      /* on the store's node, after a fatal ROUND_END: the other nodes have read
                         * it (or heartbeat_timeout passed); the store may go now */
  RDZV_EV_FENCED,       /* etcd: this node's lease is gone (expired while it was cut off, or
                         * revoked): it is no longer a member of any round; it must stop its
                         * workers and join again as a new member; ev->message */
} rdzv_event_kind_t;

typedef struct {
  rdzv_event_kind_t kind;
  rdzv_assignment_t assignment;
  rdzv_end_t end;
  char message[RDZV_MSG_MAX];
} rdzv_event_t;

typedef struct rdzv rdzv_t;
/* Runs on the loop thread. */
typedef void (*rdzv_event_cb)(rdzv_t *rz, const rdzv_event_t *ev, void *arg);

/* Starts both threads (they connect to the store lazily, on the first command). */
int rdzv_create(rdzv_t **out, uv_loop_t *loop, const rdzv_config_t *cfg, rdzv_event_cb cb, void *arg,
                char *err, size_t errlen);
/* Asynchronous requests, answered by events. */
void rdzv_join(rdzv_t *rz);                       /* -> ASSIGNED or ERROR */
void rdzv_end_round(rdzv_t *rz, const rdzv_end_t *e); /* ends the running round; -> ROUND_END */
void rdzv_done(rdzv_t *rz);                       /* -> DONE */
/* Tells the threads to stop and closes the async handle and the watchdog timer (the loop must
 * run for them to close).
 * No event is delivered after it. Idempotent; accepts NULL. */
void rdzv_shutdown(rdzv_t *rz);
/* After rdzv_shutdown and the loop run that closed the handle: interrupts the threads' store
 * calls, waits up to wait_ms for both threads to return, joins them and frees rz. Returns 0,
 * or -EBUSY when a thread is still busy (then rz stays allocated for it; see above).
 * Accepts NULL. */
int rdzv_destroy(rdzv_t *rz, int wait_ms);

/* ---- pure decision logic (no sockets; unit tested) ---- */

typedef enum {
  RDZV_CLOSE_NOW = 0,        /* this node completed max: close at once */
  RDZV_CLOSE_AFTER_LAST_CALL, /* index >= min: close after last_call unless already closed */
  RDZV_CLOSE_WAIT,           /* index < min: only wait for someone to close */
} rdzv_close_action_t;
rdzv_close_action_t rdzv_close_action(int idx, int nmin, int nmax);

typedef enum {
  RDZV_LATE_SCALE_UP = 0, /* the running round has room: end it so the next one includes us */
  RDZV_LATE_WAIT_END,     /* the running round is full: wait for it to end */
} rdzv_late_action_t;
rdzv_late_action_t rdzv_late_action(int closed_n, int nmax);

/* A round's participants from its list: n lines "node_rank nproc addr\n" in join order (what
 * the closer publishes). Returns the n entries (idx 1..n; addr points into the same block;
 * one free() releases all), or NULL when the text is malformed (*oom = 0) or memory ran out
 * (*oom = 1). */
rdzv_node_t *rdzv_parse_node_list(const char *text, size_t len, int n, int *oom);

/* Orders the n participants (by node_rank when every node gave a distinct one, else by join
 * index) and fills group_rank, rank_offset, world_size, nnodes, nproc of the node with join
 * index my_idx. *rank0_idx gets the join index of the node with group rank 0. Returns 0, or
 * -EINVAL with a message (duplicate node ranks, my_idx absent). */
int rdzv_assign_ranks(const rdzv_node_t *nodes, int n, int my_idx, rdzv_assignment_t *a, int *rank0_idx,
                      char *err, size_t errlen);

/* Whether an end makes the job over: failures past the budget, or fewer than min nodes left. */
int rdzv_end_fatal(rdzv_end_kind_t kind, int64_t failures, int max_restarts, int survivors, int nmin);

/* The value of P/r<r>/master: "addr port failures[ store_port]" (store_port with etcd only).
 * encode (store_port 0: left out) returns 0, or -EINVAL (addr empty, too long or with a space),
 * -ENAMETOOLONG (buf too small). decode fills master_addr, master_port, failures and
 * store_port (0 when absent) of a, or returns -EINVAL for anything else than three or four
 * fields with ports in 1..65535 and failures >= 0; v need not be NUL-terminated. */
int rdzv_master_encode(char *buf, size_t len, const char *addr, int port, int failures, int store_port);
int rdzv_master_decode(const char *v, size_t len, rdzv_assignment_t *a);

/* Heartbeat verdicts: a peer's counter is sampled each interval; a peer whose counter has not
 * changed for longer than timeout (by our own monotonic clock) is dead. Each node follows one
 * peer, the next participant after it in join order that is not done (rdzv_hb_next): a ring.
 * Any death leaves some live node whose next peer is the dead one, so a death is always seen,
 * and a round's store serves n heartbeat reads an interval instead of n*(n-1) (at 1024 nodes
 * and heartbeat_interval=1, a million reads a second). */
typedef struct {
  int n;
  int watched;        /* the slot followed now, -1 before the first */
  int64_t *value;     /* last counter seen, per participant slot */
  double *changed_at; /* our clock when it last changed (or when we began following it) */
} rdzv_hb_t;
int rdzv_hb_init(rdzv_hb_t *hb, int n, double now);
void rdzv_hb_free(rdzv_hb_t *hb);
void rdzv_hb_observe(rdzv_hb_t *hb, int slot, int64_t value, double now);
/* Samples slot's counter as the followed peer: a slot followed from now on starts afresh (its
 * silence counts from now, not from the round's start), the one followed before is observed. */
void rdzv_hb_follow(rdzv_hb_t *hb, int slot, int64_t value, double now);
int rdzv_hb_is_dead(const rdzv_hb_t *hb, int slot, double now, double timeout);
/* The slot after me (0-based, cyclic) whose done flag is 0, or -1 when every other one is done. */
int rdzv_hb_next(const char *done, int n, int me);

/* rdzv_end_t <-> JSON (the value of P/r<r>/end). encode returns a malloc'ed string. */
char *rdzv_end_encode(const rdzv_end_t *e);
int rdzv_end_decode(const char *json, size_t len, rdzv_end_t *e);
const char *rdzv_end_kind_name(rdzv_end_kind_t k);

#endif
