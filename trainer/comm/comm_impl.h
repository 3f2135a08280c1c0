/* comm_impl: what comm backends see of a communicator, and only they (comm*.c, and tests that
 * build a fake backend). Users include trainer/comm/comm.h, where comm_t is opaque.
 *
 * A backend fills c->ops and c->impl in its create function (its registry entry's, comm.h's
 * comm_entry_t), moves bytes in its table's calls (which arrive with valid arguments, size > 1
 * and count > 0; a point-to-point peer in range and not this rank), and reports failures with comm_set_error(), returning its code. The dispatch
 * (comm.c) owns everything else: argument checks, the broken state, the message, stats, and the
 * registry of live communicators that the fatal path aborts. */
#ifndef MESHRUN_COMM_IMPL_H
#define MESHRUN_COMM_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "trainer/comm/comm.h"

/* One call (a collective or a point-to-point transfer), as the dispatch hands it to an
 * asynchronous backend. */
typedef enum { COMM_CALL_ALL_REDUCE, COMM_CALL_ALL_GATHER, COMM_CALL_REDUCE_SCATTER, COMM_CALL_BROADCAST,
               COMM_CALL_BARRIER, COMM_CALL_SEND, COMM_CALL_RECV } comm_call_kind_t;
typedef struct {
  comm_call_kind_t kind;
  const void *in; /* all_gather, reduce_scatter; the buffer of send */
  void *out;      /* all_gather, reduce_scatter; the buffer of all_reduce, broadcast and recv */
  size_t count;
  dtype_t dtype;
  comm_op_t op;
  int root;
  int peer;       /* send, recv: the other rank (group rank, never this one) */
} comm_call_t;

/* The backend table. */
typedef struct {
  const char *name;
  int (*all_reduce)(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op);
  int (*all_gather)(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype);
  int (*reduce_scatter)(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype,
                        comm_op_t op);
  int (*broadcast)(comm_t *c, void *buf, size_t count, dtype_t dtype, int root);
  int (*barrier)(comm_t *c);
  void (*destroy)(comm_t *c); /* releases impl; must accept a half-built impl */
  /* Point-to-point, optional (NULL: the dispatch refuses comm_send and comm_recv). They come
   * after destroy so that tables written positionally up to destroy (test fakes) stay valid.
   * Only this rank and peer take part; the k-th send to a peer matches its k-th receive from
   * this rank. */
  int (*send)(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer);
  int (*recv)(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer);
  int p2p_ring; /* 1: sends only to rank + 1 and receives only from rank - 1 (the links of a
                   ring: cpu, staged); the dispatch refuses other peers */
  /* Optional, for backends whose buffers are not host memory: the copies the dispatch makes
   * itself (all_gather's own slot, reduce_scatter on one rank), done before returning. NULL:
   * memcpy. */
  int (*copy)(comm_t *c, void *dst, const void *src, size_t bytes);
  int bf16; /* 1: reduces and moves DT_BF16 too, in fp32 with one rounding per combining
              step (cpu, staged, nccl); 0: float32 only, the dispatch refuses bfloat16 */
  /* Optional: makes the peers' pending and later calls fail at once (comm_abort). It may run on
   * a fatal path at any point between calls, so it only shuts things down: no freeing, no
   * blocking; destroy still runs later and must cope with an aborted impl. */
  void (*abort)(comm_t *c);
  /* Optional: native asynchronous operations (nccl: enqueued on its communication stream). start
   * queues call (valid arguments, size > 1, count > 0; all_gather's own slot is already copied)
   * and returns a token of the backend's; wait completes it, after which later compute is ordered
   * after the operation; test says whether it is complete without blocking; release frees a
   * token whose wait will never come (comm_destroy of a communicator with requests left). Tokens
   * are waited in issue order. NULL start: the dispatch runs the blocking calls above on a
   * progress thread of the communicator ("cpu"), or at once with inline_async ("staged").
   * Both start and inline_async ("staged"): start takes the sends only (COMM_CALL_SEND), so that
   * a started send never blocks its caller; every other call runs at once as with inline_async
   * alone. Then the backend keeps the issue order itself (staged: its inner cpu communicator's
   * queue) and waits for tokens left at comm_destroy in its destroy. */
  int (*start)(comm_t *c, const comm_call_t *call, void **token);
  int (*wait)(comm_t *c, void *token);
  int (*test)(comm_t *c, void *token, int *done);
  void (*release)(comm_t *c, void *token);
  int inline_async; /* 1: comm_start runs the operation to completion before returning (with a
                       start: all but sends, see above) */
} comm_ops_t;

struct comm {
  const comm_ops_t *ops;
  void *impl;
  char name[COMM_NAME_MAX];
  int rank, size;
  int timeout_ms;
  int broken;             /* first system/remote/timeout error code, or 0 */
  char err[COMM_ERR_MAX]; /* message of the last failure */
  comm_stats_t stats;
  comm_mem_t mem;         /* of its backend (comm_backend_memory) */
  int fail_next;          /* comm_fail_next armed */
  int skip_next;          /* comm_skip_next armed */
  int fault_at, fault_calls; /* MESHRUN_FAULT_COLLECTIVE: the fault_at-th call fails (tests) */
  struct comm *next_live; /* the registry of live communicators (comm.c) */
  uint64_t wait_ns;        /* the caller's blocked time (comm_stats_t.wait_ns) */
  struct comm_async *async; /* comm.c: the queue of started requests and its progress thread */
  /* The flight recorder's sequence numbers (comm_flight.c): the last call issued (written by
   * the calling thread) and the last completed (by the thread that ran it); read by dumps. */
  _Atomic uint64_t flight_issued, flight_done;
};

/* Writes "comm <name> (rank r/n): <what>" into c->err and returns code; a system, remote or
 * timeout code also marks the communicator broken. */
int comm_set_error(comm_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* The flight recorder (comm_flight.c), called by the dispatch only. comm_flight_issue records
 * a call as it is issued (its communicator's next sequence number) and returns its ticket (0
 * while recording is off); comm_flight_start and comm_flight_end (rc: the call's result) mark
 * it started and finished, from whichever thread runs it. A ticket whose slot was reused since
 * is ignored. comm_flight_end also advances c's last completed sequence number, and on the
 * process's first COMM_ETIMEDOUT writes a dump naming the call. */
/* What the backend's turn returns for a call comm_skip_next skipped: comm_flight_end records it
 * as "skipped" (and completed), and the dispatch returns COMM_OK to the caller. */
#define COMM_SKIPPED 1
uint64_t comm_flight_issue(comm_t *c, const comm_call_t *k);
void comm_flight_start(uint64_t ticket);
void comm_flight_end(comm_t *c, uint64_t ticket, int rc);

/* Calls fn on every registered communicator, under the registry's lock (comm.c). */
void comm_live_each(void (*fn)(const comm_t *c, void *arg), void *arg);

/* Aborts every registered communicator whose backend table is ops (NULL: all of them). */
void comm_abort_backend(const comm_ops_t *ops, const char *why);

#endif
