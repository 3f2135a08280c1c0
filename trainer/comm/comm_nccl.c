/* comm_nccl: the "nccl" collective backend, one NCCL communicator per mesh group, on device
 * memory.
 *
 * Setup (nccl_create): the GPU is LOCAL_RANK's (cudaSetDevice), after checking that
 * LOCAL_WORLD_SIZE GPUs are visible: NCCL does not allow two ranks of a communicator on one
 * device, and several ranks sharing a GPU would otherwise fail deep inside NCCL or hang (use the
 * "staged" backend for that). The communicator then comes one of two ways:
 *   - split (comm_config_t.parent is an nccl communicator): ncclCommSplit(parent, color, key =
 *     group rank), NCCL >= 2.18 (checked at build time and against the loaded library). It is
 *     collective over ALL the parent's members: each calls it once per split, in the same
 *     sequence; those passing the same color form one communicator, ranked by key. No store, no
 *     new id: NCCL bootstraps through the parent. The child does not share the parent's
 *     resources (splitShare unset), so it runs concurrently with the parent and outlives it.
 *     While the split runs, the parent's state is ncclInProgress; it is polled like an init. A
 *     split that fails or times out aborts the parent too: its members are midway through the
 *     split, and the abort is what joins NCCL's split thread. The result is checked against the
 *     config (size, rank), which catches members that disagree about the groups.
 *   - init (no nccl parent, or an older NCCL): group rank 0 creates the unique id and publishes it
 *     in the store under "comm/<group>/<generation>/nccl_id" (the cpu backend's key space: a
 *     restarted job never reads an earlier attempt's id); the others wait for it, then every
 *     member joins with ncclCommInitRankConfig.
 * Either way the communicator is non-blocking (config.blocking = 0), so that no NCCL call can
 * block past our timeout: every call that answers ncclInProgress is polled with
 * ncclCommGetAsyncError until it completes, fails, or the timeout passes.
 *
 * Collectives are asynchronous underneath (the start/wait/test/release hooks of comm_ops_t) and
 * run on a stream of the communicator's own. start orders that stream after the compute that
 * wrote the input (with a compute stream from comm_nccl_set_stream, an event recorded there is
 * waited for on ours; without one, the device backend, comm_config_t.device, or else the whole
 * device is synchronized), enqueues the NCCL call, and records a completion event: one per
 * operation, taken from a pool of the communicator (the operation's token), so that a training
 * step creates no events. wait with a compute stream makes the compute stream wait for that
 * event and returns (no host synchronization); without one, it polls the event on the host.
 * The blocking calls are start plus a host wait: they return after the collective completed, so
 * later compute on any stream is ordered after it, and their buffers are free.
 *
 * Watching: every call into the backend first runs progress(): it retires completed operations in
 * issue order (one stream, so they complete in order), reads ncclCommGetAsyncError, and fails the
 * oldest incomplete operation once nothing has completed for the timeout. A dead or stuck peer
 * thus ends in COMM_EREMOTE or COMM_ETIMEDOUT, with the group and operation named, instead of a
 * hang: in a host wait at once, and for operations whose wait returned without the host (compute
 * stream) at the next call on this communicator. On any failure the communicator is aborted
 * (ncclCommAbort), so the peers' NCCL calls fail too, and it stays broken. Its abort op
 * (comm_abort, and comm_abort_all on the fatal path) is ncclCommAbort; comm_nccl_abort_all aborts
 * the nccl ones of comm.c's registry. Fatal CUDA errors of the calls around NCCL (events, streams)
 * go through CUDA_CHECK (trainer/backend/backend_cuda_check.h): "[trainer rank R host] file:line:
 * call: message", abort everything, exit(1).
 *
 * Point-to-point: a send is ncclSend and a receive ncclRecv, each inside an ncclGroupStart /
 * ncclGroupEnd of its own, through the same start/wait path as the collectives (so the same
 * ordering, completion events and watching). Any peer of the group may be used (no ring rule);
 * NCCL does not check that the two sides agree on count and dtype. Written against NCCL's API and
 * built, but not yet run on a GPU (a two-rank communicator needs two GPUs): test/gpu has no test
 * of it yet.
 *
 * Callers' part: NCCL kernels of different communicators in flight at once can deadlock unless
 * every rank issues them in the same order; the strategies issue the same sequence on every rank.
 *
 * What it does not do: watch in-flight work from a thread of its own (with a compute stream, a
 * collective that never completes after its wait returned stalls whatever synchronizes the
 * compute stream until this communicator is called again, or the launcher reacts to the dead
 * peer); several GPUs per rank; NCCL groups (ncclGroupStart) across calls; user buffer
 * registration; resource sharing between split communicators. AVG is ncclAvg, which NCCL computes
 * as a premultiplied sum for floats: the same bits as sum-then-divide when the group size is a
 * power of two, possibly the last bit otherwise. Stats count the bytes a ring algorithm sends
 * (all_reduce 2(n-1)/n of the buffer, and so on; a send's buffer as sent, a receive's as
 * received), not what NCCL's chosen algorithm moved, and count them when the operation is waited
 * for (the blocking call returns) successfully. */
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h"
#include "trainer/comm/comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/env.h"
#include "common/err.h"
#include "common/net.h"
#include "trainer/backend/backend.h"
#include "trainer/backend/backend_cuda_check.h"

/* ncclCommSplit appeared in NCCL 2.18.0; older headers build the init path only. */
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
#define HAVE_NCCL_SPLIT 1
#else
#define HAVE_NCCL_SPLIT 0
#endif

/* One started operation. A token is in at most one of two lists: the in-flight FIFO (issued, not
 * yet seen complete) or the free list (complete and no longer held by the dispatch). One held by
 * the dispatch and already complete is in neither; every token is also on the all list, which
 * only destroy walks. */
typedef struct nccl_token {
  cudaEvent_t done;        /* recorded on our stream after the operation */
  comm_call_kind_t kind;   /* for messages */
  int peer;                /* send, recv: for messages */
  uint64_t sent, recvd;    /* ring-equivalent bytes, counted when waited for successfully */
  int64_t issued_ms;       /* net_now_ms() when enqueued */
  int complete;            /* its event was seen complete (it left the in-flight FIFO) */
  int owned;               /* held by the dispatch: started, not yet waited for or released */
  struct nccl_token *next; /* in-flight FIFO or free list */
  struct nccl_token *all_next;
} nccl_token_t;

typedef struct nccl_impl {
  ncclComm_t comm;          /* NULL until initialized; NULL again once aborted or destroyed */
  cudaStream_t stream;      /* NCCL's stream */
  cudaEvent_t ready;        /* recorded on the compute stream before a collective */
  cudaStream_t compute;     /* comm_nccl_set_stream's, or NULL */
  backend_t *dev;           /* comm_config_t.device, or NULL */
  float *barrier_buf;       /* one float of device memory for barrier */
  int device;               /* CUDA device number */
  nccl_token_t *head, *tail; /* in flight, in issue order */
  nccl_token_t *free_tokens;
  nccl_token_t *all;
  int64_t progress_ms;      /* when an operation was last seen complete */
} nccl_impl_t;

/* Yields the CPU between polls: the first few hundred polls only yield (short collectives finish
 * in microseconds), later ones sleep 50 us so a long wait does not burn a core. This is pacing
 * of a poll loop, not synchronization: every exit is decided by a query. */
static void poll_pause(int *n) {
  if ((*n)++ < 256) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 50000};
  nanosleep(&ts, NULL);
}

static void nccl_abort(nccl_impl_t *p) {
  if (p && p->comm) {
    ncclCommAbort(p->comm);
    p->comm = NULL;
  }
}

/* Fails the call: aborts NCCL (peers then fail too) and records the message. */
static int fail(comm_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(comm_t *c, int code, const char *fmt, ...) {
  char what[COMM_ERR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  nccl_abort(c->impl);
  return comm_set_error(c, code, "%.*s", COMM_ERR_MAX - 100, what);
}

/* NCCL's last error text: more specific than the code's string ("remote process exited"...). */
static const char *last_error(ncclComm_t comm, ncclResult_t r) {
  const char *s = comm ? ncclGetLastError(comm) : NULL;
  return s && *s ? s : ncclGetErrorString(r);
}

static const char *call_name(comm_call_kind_t kind) {
  switch (kind) {
  case COMM_CALL_ALL_REDUCE: return "all_reduce";
  case COMM_CALL_ALL_GATHER: return "all_gather";
  case COMM_CALL_REDUCE_SCATTER: return "reduce_scatter";
  case COMM_CALL_BROADCAST: return "broadcast";
  case COMM_CALL_BARRIER: return "barrier";
  case COMM_CALL_SEND: return "send";
  case COMM_CALL_RECV: return "recv";
  }
  return "collective";
}

/* The operation as messages name it: its name, and for a send or receive the peer's group rank
 * ("send to rank 1"). Returns buf or a constant. */
static const char *op_label(char *buf, size_t len, comm_call_kind_t kind, int peer) {
  if (kind != COMM_CALL_SEND && kind != COMM_CALL_RECV) return call_name(kind);
  snprintf(buf, len, "%s %s rank %d", call_name(kind), kind == COMM_CALL_SEND ? "to" : "from", peer);
  return buf;
}

/* Waits until a non-blocking NCCL call that answered ncclInProgress has finished: until then NCCL
 * forbids further work on its stream, our completion event included. */
static int wait_state(comm_t *c, const char *what, ncclResult_t r) {
  nccl_impl_t *p = c->impl;
  if (r == ncclSuccess) return COMM_OK;
  int64_t deadline = net_now_ms() + c->timeout_ms;
  int polls = 0;
  while (r == ncclInProgress) {
    if (net_now_ms() > deadline)
      return fail(c, COMM_ETIMEDOUT, "%s timed out after %g s (NCCL still in progress; is a peer "
                  "stuck or dead?)", what, c->timeout_ms / 1000.0);
    poll_pause(&polls);
    ncclResult_t q = ncclCommGetAsyncError(p->comm, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess)
    return fail(c, COMM_EREMOTE, "%s: NCCL error: %s (%s)", what, ncclGetErrorString(r),
                last_error(p->comm, r));
  return COMM_OK;
}

/* Before a collective: our stream waits for the compute that produced its input. */
static void order_after_compute(nccl_impl_t *p) {
  if (p->compute) {
    CUDA_CHECK(cudaEventRecord(p->ready, p->compute));
    CUDA_CHECK(cudaStreamWaitEvent(p->stream, p->ready, 0));
  } else if (p->dev && p->dev->synchronize) {
    p->dev->synchronize(p->dev);
  } else {
    CUDA_CHECK(cudaDeviceSynchronize());
  }
}

/* ---- tokens: the pool of completion events ---- */

static void push_free(nccl_impl_t *p, nccl_token_t *t) {
  t->next = p->free_tokens;
  p->free_tokens = t;
}

/* A token with an event, from the free list or new (the pool grows to the most operations in
 * flight at once). NULL when out of memory. */
static nccl_token_t *token_get(nccl_impl_t *p) {
  nccl_token_t *t = p->free_tokens;
  if (t) {
    p->free_tokens = t->next;
  } else {
    t = calloc(1, sizeof *t);
    if (!t) return NULL;
    CUDA_CHECK(cudaEventCreateWithFlags(&t->done, cudaEventDisableTiming));
    t->all_next = p->all;
    p->all = t;
  }
  t->next = NULL;
  t->complete = t->owned = 0;
  return t;
}

/* The dispatch is done with t (waited for or released): back to the pool once complete, else
 * when progress() sees it complete. Reusing its event then is safe either way: a stream that
 * waits on an event waits for the record made before the wait call, not for later ones. */
static void token_drop(nccl_impl_t *p, nccl_token_t *t) {
  t->owned = 0;
  if (t->complete) push_free(p, t);
}

/* The failure of a call on a communicator already aborted (comm_abort, or an earlier failure). */
static int aborted(comm_t *c) {
  return c->broken ? c->broken : comm_set_error(c, COMM_ESYSTEM, "the NCCL communicator was aborted");
}

/* Retires the operations that completed, in issue order, and checks for trouble: NCCL's
 * asynchronous error, and an oldest operation that made no progress for the timeout (measured
 * from its issue or the completion of the one before it, whichever is later). */
static int progress(comm_t *c) {
  nccl_impl_t *p = c->impl;
  if (!p->comm) return aborted(c);
  char label[64];
  while (p->head) {
    nccl_token_t *t = p->head;
    cudaError_t q = cudaEventQuery(t->done);
    if (q == cudaErrorNotReady) break;
    if (q != cudaSuccess)
      return fail(c, COMM_ESYSTEM, "%s: CUDA error while waiting for NCCL: %s",
                  op_label(label, sizeof label, t->kind, t->peer), cudaGetErrorString(q));
    p->head = t->next;
    if (!p->head) p->tail = NULL;
    t->complete = 1;
    p->progress_ms = net_now_ms();
    if (!t->owned) push_free(p, t);
  }
  const char *what = p->head ? op_label(label, sizeof label, p->head->kind, p->head->peer) : "collective";
  ncclResult_t ae = ncclSuccess;
  ncclResult_t gr = ncclCommGetAsyncError(p->comm, &ae);
  if (gr != ncclSuccess) ae = gr;
  if (ae != ncclSuccess && ae != ncclInProgress)
    return fail(c, COMM_EREMOTE, "%s: NCCL error: %s (%s); did a peer exit?", what,
                ncclGetErrorString(ae), last_error(p->comm, ae));
  if (p->head) {
    int64_t since = p->head->issued_ms > p->progress_ms ? p->head->issued_ms : p->progress_ms;
    if (net_now_ms() - since > c->timeout_ms)
      return fail(c, COMM_ETIMEDOUT, "%s timed out after %g s (the NCCL kernel did not complete: "
                  "a peer is missing, dead, or in another collective)", what, c->timeout_ms / 1000.0);
  }
  return COMM_OK;
}

/* ---- collectives ---- */

static ncclDataType_t nccl_dtype(dtype_t d) { return d == DT_BF16 ? ncclBfloat16 : ncclFloat32; }

static ncclRedOp_t nccl_op(comm_op_t op) {
  switch (op) {
  case COMM_SUM: return ncclSum;
  case COMM_AVG: return ncclAvg;
  case COMM_MAX: return ncclMax;
  }
  return ncclSum;
}

/* Ring-equivalent payload of one rank for call, sent (received is the same for collectives). */
static uint64_t ring_bytes(const comm_t *c, const comm_call_t *call) {
  uint64_t bytes = (uint64_t)call->count * dtype_size(call->dtype), n = (uint64_t)c->size;
  switch (call->kind) {
  case COMM_CALL_ALL_REDUCE: return bytes * 2 * (n - 1) / n;
  case COMM_CALL_ALL_GATHER:
  case COMM_CALL_REDUCE_SCATTER: return bytes * (n - 1);
  case COMM_CALL_BROADCAST: return bytes;
  case COMM_CALL_BARRIER: return 0;
  case COMM_CALL_SEND: return bytes;
  case COMM_CALL_RECV: return 0;
  }
  return 0;
}

/* Received bytes: a send receives nothing, a receive its buffer, a collective what it sends. */
static uint64_t recv_bytes(const comm_t *c, const comm_call_t *call) {
  if (call->kind == COMM_CALL_SEND) return 0;
  if (call->kind == COMM_CALL_RECV) return (uint64_t)call->count * dtype_size(call->dtype);
  return ring_bytes(c, call);
}

/* A send or receive, in a group of its own (NCCL's documented form for point-to-point: with a
 * non-blocking communicator the launch completes, or answers ncclInProgress, at ncclGroupEnd,
 * which the caller polls like any call). The group is ended even when the call in it failed. */
static ncclResult_t p2p(nccl_impl_t *p, const comm_call_t *call, ncclDataType_t dt) {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  ncclResult_t q = call->kind == COMM_CALL_SEND
                       ? ncclSend(call->in, call->count, dt, call->peer, p->comm, p->stream)
                       : ncclRecv(call->out, call->count, dt, call->peer, p->comm, p->stream);
  r = ncclGroupEnd();
  return q != ncclSuccess && q != ncclInProgress ? q : r;
}

/* Enqueues call on our stream. all_gather's input is out + rank * count (the dispatch put it
 * there): NCCL's in-place all-gather. NCCL has no barrier: an all-reduce of one float is one,
 * since no rank's kernel completes before every rank's has started. */
static ncclResult_t issue(nccl_impl_t *p, const comm_call_t *call) {
  ncclDataType_t dt = nccl_dtype(call->dtype);
  switch (call->kind) {
  case COMM_CALL_ALL_REDUCE:
    return ncclAllReduce(call->out, call->out, call->count, dt, nccl_op(call->op), p->comm, p->stream);
  case COMM_CALL_ALL_GATHER:
    return ncclAllGather(call->in, call->out, call->count, dt, p->comm, p->stream);
  case COMM_CALL_REDUCE_SCATTER:
    return ncclReduceScatter(call->in, call->out, call->count, dt, nccl_op(call->op), p->comm,
                             p->stream);
  case COMM_CALL_BROADCAST:
    return ncclBroadcast(call->out, call->out, call->count, dt, call->root, p->comm, p->stream);
  case COMM_CALL_BARRIER:
    return ncclAllReduce(p->barrier_buf, p->barrier_buf, 1, ncclFloat32, ncclSum, p->comm, p->stream);
  case COMM_CALL_SEND:
  case COMM_CALL_RECV:
    return p2p(p, call, dt);
  }
  return ncclInvalidArgument;
}

/* The start hook: order, enqueue, record the completion event. The token is taken first, so
 * that running out of memory fails before the peers see a collective this rank never joins. */
static int nccl_start(comm_t *c, const comm_call_t *call, void **token) {
  nccl_impl_t *p = c->impl;
  char label[64];
  const char *what = op_label(label, sizeof label, call->kind, call->peer);
  *token = NULL;
  int rc = progress(c);
  if (rc) return rc;
  nccl_token_t *t = token_get(p);
  if (!t) return fail(c, COMM_ESYSTEM, "%s: out of memory", what);
  order_after_compute(p);
  rc = wait_state(c, what, issue(p, call));
  if (rc) {
    push_free(p, t);
    return rc;
  }
  CUDA_CHECK(cudaEventRecord(t->done, p->stream));
  t->kind = call->kind;
  t->peer = call->peer;
  t->sent = ring_bytes(c, call);
  t->recvd = recv_bytes(c, call);
  t->issued_ms = net_now_ms();
  t->owned = 1;
  if (p->tail) p->tail->next = t;
  else p->head = t;
  p->tail = t;
  *token = t;
  return COMM_OK;
}

/* Completes t: on the host (polled with NCCL's errors and the timeout), or, with a compute stream
 * and on_host 0, by making the compute stream wait for its event. Gives t back either way. */
static int finish(comm_t *c, nccl_token_t *t, int on_host) {
  nccl_impl_t *p = c->impl;
  int rc = progress(c);
  if (on_host || !p->compute) {
    int polls = 0;
    while (rc == COMM_OK && !t->complete) {
      poll_pause(&polls);
      rc = progress(c);
    }
  } else if (rc == COMM_OK && !t->complete) {
    CUDA_CHECK(cudaStreamWaitEvent(p->compute, t->done, 0));
  }
  if (rc == COMM_OK) {
    c->stats.bytes_sent += t->sent;
    c->stats.bytes_recv += t->recvd;
  }
  token_drop(p, t);
  return rc;
}

static int nccl_wait(comm_t *c, void *token) { return token ? finish(c, token, 0) : COMM_OK; }

/* A failure also counts as done: its wait returns the code at once. */
static int nccl_test(comm_t *c, void *token, int *done) {
  int rc = progress(c);
  *done = rc != COMM_OK || !token || ((nccl_token_t *)token)->complete;
  return rc;
}

static void nccl_release(comm_t *c, void *token) {
  if (token) token_drop(c->impl, token);
}

/* The blocking calls: start plus a host wait, so that they return with the collective done. */
static int run(comm_t *c, const comm_call_t *call) {
  void *t;
  int rc = nccl_start(c, call, &t);
  return rc ? rc : finish(c, t, 1);
}

static int nccl_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op) {
  comm_call_t call = {.kind = COMM_CALL_ALL_REDUCE, .out = buf, .count = count, .dtype = dtype, .op = op};
  return run(c, &call);
}

static int nccl_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype) {
  comm_call_t call = {.kind = COMM_CALL_ALL_GATHER, .in = in, .out = out, .count = count, .dtype = dtype};
  return run(c, &call);
}

static int nccl_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype,
                               comm_op_t op) {
  comm_call_t call = {.kind = COMM_CALL_REDUCE_SCATTER, .in = in, .out = out, .count = count,
                      .dtype = dtype, .op = op};
  return run(c, &call);
}

static int nccl_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root) {
  comm_call_t call = {.kind = COMM_CALL_BROADCAST, .out = buf, .count = count, .dtype = dtype, .root = root};
  return run(c, &call);
}

static int nccl_barrier(comm_t *c) {
  comm_call_t call = {.kind = COMM_CALL_BARRIER, .count = 1, .dtype = DT_F32};
  return run(c, &call);
}

static int nccl_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer) {
  comm_call_t call = {.kind = COMM_CALL_SEND, .in = buf, .count = count, .dtype = dtype, .peer = peer};
  return run(c, &call);
}

static int nccl_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer) {
  comm_call_t call = {.kind = COMM_CALL_RECV, .out = buf, .count = count, .dtype = dtype, .peer = peer};
  return run(c, &call);
}

/* The dispatch's local copies (all_gather's own slot, reduce_scatter on one rank). With a compute
 * stream the copy is queued there: ordered after the compute that wrote src and before every
 * later use (a later collective's start records its event after it), without stalling the host
 * behind the operations in flight on our stream. Without one, it runs on our stream and the host
 * waits for it. */
static int nccl_copy(comm_t *c, void *dst, const void *src, size_t bytes) {
  nccl_impl_t *p = c->impl;
  if (p->compute) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, p->compute));
    return COMM_OK;
  }
  order_after_compute(p);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, p->stream));
  CUDA_CHECK(cudaStreamSynchronize(p->stream));
  return COMM_OK;
}

/* A healthy communicator is finalized (flushes its work, operations in flight included) then
 * destroyed; a broken one, or one whose finalize does not complete within the timeout, is
 * aborted. Tokens the dispatch still holds are freed too: it must not use them afterwards. */
static void nccl_destroy(comm_t *c) {
  nccl_impl_t *p = c->impl;
  if (!p) return;
  if (p->comm && !c->broken) {
    int64_t deadline = net_now_ms() + c->timeout_ms;
    ncclResult_t r = ncclCommFinalize(p->comm);
    int polls = 0;
    while (r == ncclInProgress && net_now_ms() <= deadline) {
      poll_pause(&polls);
      if (ncclCommGetAsyncError(p->comm, &r) != ncclSuccess) break;
    }
    if (r == ncclSuccess) {
      ncclCommDestroy(p->comm);
      p->comm = NULL;
    }
  }
  nccl_abort(p);
  while (p->all) {
    nccl_token_t *t = p->all;
    p->all = t->all_next;
    if (t->done) cudaEventDestroy(t->done);
    free(t);
  }
  if (p->barrier_buf) cudaFree(p->barrier_buf);
  if (p->ready) cudaEventDestroy(p->ready);
  if (p->stream) cudaStreamDestroy(p->stream);
  free(p);
  c->impl = NULL;
}

static void nccl_abort_op(comm_t *c) { nccl_abort(c->impl); }

static const comm_ops_t nccl_ops = {
    .name = "nccl",
    .all_reduce = nccl_all_reduce,
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .destroy = nccl_destroy,
    .send = nccl_send,
    .recv = nccl_recv,
    .copy = nccl_copy,
    .bf16 = 1,
    .abort = nccl_abort_op,
    .start = nccl_start,
    .wait = nccl_wait,
    .test = nccl_test,
    .release = nccl_release,
};

void comm_nccl_abort_all(void) { comm_abort_backend(&nccl_ops, "comm_nccl_abort_all"); }

int comm_nccl_set_stream(comm_t *c, void *compute_stream) {
  if (!c || c->ops != &nccl_ops || !c->impl) return COMM_EINVAL;
  ((nccl_impl_t *)c->impl)->compute = (cudaStream_t)compute_stream;
  return COMM_OK;
}

/* ---- setup ---- */

/* The id of this group's communicator: made by group rank 0 and published, read by the rest. */
static int exchange_id(const comm_config_t *cfg, int timeout_ms, ncclUniqueId *id, char *why,
                       size_t whylen) {
  char key[128];
  snprintf(key, sizeof key, "comm/%s/%d/nccl_id", cfg->name, cfg->generation);
  if (cfg->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(id);
    if (r != ncclSuccess) {
      snprintf(why, whylen, "ncclGetUniqueId: %s (%s)", ncclGetErrorString(r), last_error(NULL, r));
      return COMM_ESYSTEM;
    }
    if (cfg->store && store_set(cfg->store, key, id, sizeof *id) != STORE_OK) {
      snprintf(why, whylen, "publishing %s: %s", key, store_errmsg(cfg->store));
      return COMM_EREMOTE;
    }
    return COMM_OK;
  }
  void *val = NULL;
  size_t len = 0;
  int rc = store_get(cfg->store, key, &val, &len, timeout_ms);
  if (rc != STORE_OK) {
    if (rc == STORE_ETIMEDOUT)
      snprintf(why, whylen, "rank 0 published no NCCL id within %g s (store key %s); did it start?",
               timeout_ms / 1000.0, key);
    else
      snprintf(why, whylen, "reading store key %s: %s", key, store_errmsg(cfg->store));
    return rc == STORE_ETIMEDOUT ? COMM_ETIMEDOUT : COMM_EREMOTE;
  }
  if (len != sizeof *id) {
    free(val);
    snprintf(why, whylen, "store key %s holds %zu bytes, not an NCCL id (%zu)", key, len, sizeof *id);
    return COMM_EREMOTE;
  }
  memcpy(id, val, sizeof *id);
  free(val);
  return COMM_OK;
}

/* The init path: the id through the store, then ncclCommInitRankConfig, polled so that a missing
 * member times out. */
static int init_rank(comm_t *c, const comm_config_t *cfg, ncclConfig_t *conf, char *why, size_t whylen) {
  nccl_impl_t *p = c->impl;
  int64_t deadline = net_now_ms() + c->timeout_ms;
  ncclUniqueId id;
  int rc = exchange_id(cfg, c->timeout_ms, &id, why, whylen);
  if (rc) return rc;
  ncclResult_t r = ncclCommInitRankConfig(&p->comm, cfg->size, id, cfg->rank, conf);
  int polls = 0;
  while (r == ncclInProgress && p->comm) {
    if (net_now_ms() > deadline) {
      snprintf(why, whylen, "ncclCommInitRankConfig did not complete within %g s (are all %d "
               "members starting?)", c->timeout_ms / 1000.0, cfg->size);
      return COMM_ETIMEDOUT;
    }
    poll_pause(&polls);
    ncclResult_t q = ncclCommGetAsyncError(p->comm, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) {
    snprintf(why, whylen, "ncclCommInitRankConfig on GPU %d: %s (%s)", p->device,
             ncclGetErrorString(r), last_error(p->comm, r));
    return r == ncclRemoteError ? COMM_EREMOTE : COMM_ESYSTEM;
  }
  return COMM_OK;
}

#if HAVE_NCCL_SPLIT
/* The split path. NCCL runs the split on a thread of its own, attached to the parent: the parent's
 * asynchronous state is ncclInProgress until the split ends with its result, and the new
 * communicator is stored into p->comm (still NULL until then). On failure or timeout the parent
 * is aborted (comm_abort: marked broken, its peers fail too); ncclCommAbort also joins the split
 * thread, so nothing writes p->comm afterwards, and the caller aborts the half-made child. */
static int split_from(comm_t *c, const comm_config_t *cfg, ncclConfig_t *conf, char *why, size_t whylen) {
  nccl_impl_t *p = c->impl;
  comm_t *parent = cfg->parent;
  nccl_impl_t *pp = parent->impl;
  if (parent->broken || !pp || !pp->comm) {
    snprintf(why, whylen, "parent communicator %s is broken: %.300s", parent->name,
             parent->err[0] ? parent->err : "aborted");
    return COMM_EINVAL;
  }
  if (cfg->color < 0) {
    snprintf(why, whylen, "split color %d is negative", cfg->color);
    return COMM_EINVAL;
  }
  int64_t deadline = net_now_ms() + c->timeout_ms;
  ncclResult_t r = ncclCommSplit(pp->comm, cfg->color, cfg->rank, &p->comm, conf);
  int polls = 0;
  int rc = COMM_OK;
  while (r == ncclInProgress) {
    if (net_now_ms() > deadline) {
      snprintf(why, whylen, "ncclCommSplit of %s (color %d) did not complete within %g s (do all "
               "%d members of %s create the same groups in the same order?)", parent->name,
               cfg->color, c->timeout_ms / 1000.0, parent->size, parent->name);
      rc = COMM_ETIMEDOUT;
      break;
    }
    poll_pause(&polls);
    ncclResult_t q = ncclCommGetAsyncError(pp->comm, &r);
    if (q != ncclSuccess) r = q;
  }
  if (rc == COMM_OK && r != ncclSuccess) {
    snprintf(why, whylen, "ncclCommSplit of %s (color %d) on GPU %d: %s (%s)", parent->name,
             cfg->color, p->device, ncclGetErrorString(r), last_error(pp->comm, r));
    rc = r == ncclRemoteError ? COMM_EREMOTE : COMM_ESYSTEM;
  }
  if (rc) {
    comm_abort(parent, "a split of it failed");
    return rc;
  }
  int n = 0, me = -1;
  if (!p->comm || ncclCommCount(p->comm, &n) != ncclSuccess ||
      ncclCommUserRank(p->comm, &me) != ncclSuccess || n != cfg->size || me != cfg->rank) {
    snprintf(why, whylen, "ncclCommSplit of %s by color %d made rank %d of %d, not %d of %d: the "
             "members disagree about the groups", parent->name, cfg->color, me, n, cfg->rank,
             cfg->size);
    return COMM_EINVAL;
  }
  return COMM_OK;
}

/* 1 when cfg asks for a split this build and the loaded library can do. */
static int use_split(const comm_config_t *cfg) {
  int version = 0;
  return cfg->parent && cfg->parent->ops == &nccl_ops && ncclGetVersion(&version) == ncclSuccess &&
         version >= NCCL_VERSION(2, 18, 0);
}
#endif

static int nccl_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen) {
  char why[COMM_ERR_MAX] = "";
  int rc = COMM_OK;
  cudaError_t ce;
  nccl_impl_t *p = calloc(1, sizeof *p);
  if (!p) {
    return err_set(err, errlen, COMM_ESYSTEM, "comm %s: out of memory", cfg->name);
  }
  c->impl = p;
  c->ops = &nccl_ops;
  p->dev = cfg->device;

  /* 1. The device: LOCAL_RANK's, once we know there are enough of them. */
  int count = 0;
  ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0) {
    err_set(err, errlen, 0, "nccl: no GPU visible (cudaGetDeviceCount: %s; CUDA_VISIBLE_DEVICES=%s)",
            ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices",
            getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "unset");
    (void)cudaGetLastError();
    return COMM_ESYSTEM;
  }
  int local_rank, local_world; /* unreadable values mean the defaults, as before */
  env_int("LOCAL_RANK", 0, (1 << 20) - 1, 0, &local_rank);
  env_int("LOCAL_WORLD_SIZE", 0, (1 << 20) - 1, 1, &local_world);
  if (local_world > count || local_rank >= count) {
    return err_set(err, errlen, COMM_EINVAL,
                   "nccl: LOCAL_WORLD_SIZE %d but only %d GPU%s visible (LOCAL_RANK %d); NCCL "
                   "needs one GPU per rank: start fewer ranks per node, or use the staged comm backend to "
                   "share a GPU",
                   local_world, count, count == 1 ? "" : "s", local_rank);
  }
  p->device = local_rank;
  const char *what = NULL;
  if ((ce = cudaSetDevice(p->device)) != cudaSuccess) what = "cudaSetDevice";
  else if ((ce = cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking)) != cudaSuccess) what = "cudaStreamCreate";
  else if ((ce = cudaEventCreateWithFlags(&p->ready, cudaEventDisableTiming)) != cudaSuccess) what = "cudaEventCreate";
  else if ((ce = cudaMalloc((void **)&p->barrier_buf, sizeof(float))) != cudaSuccess) what = "cudaMalloc";
  if (what) {
    snprintf(why, sizeof why, "GPU %d: %s: %s", p->device, what, cudaGetErrorString(ce));
    rc = COMM_ESYSTEM;
    goto error;
  }

  /* 2. The communicator, non-blocking: split from the parent's, or initialized through the
   * store. */
  ncclConfig_t conf = NCCL_CONFIG_INITIALIZER;
  conf.blocking = 0;
  conf.commName = cfg->name;
#if HAVE_NCCL_SPLIT
  if (use_split(cfg)) rc = split_from(c, cfg, &conf, why, sizeof why);
  else
#endif
    rc = init_rank(c, cfg, &conf, why, sizeof why);
  if (rc) goto error;
  return COMM_OK;

error:
  nccl_abort(p); /* peers already inside the init fail instead of waiting */
  return err_set(err, errlen, rc, "comm %s (rank %d/%d): nccl setup: %s", cfg->name, cfg->rank, cfg->size, why);
}

/* The registry's entry (trainer/comm/registry.c): the cuda backend's memory, one GPU per local
 * rank (NCCL puts no two ranks of a communicator on one device). A build without CUDA compiles
 * comm_nccl_absent.c instead. */
const comm_entry_t comm_entry_nccl = {
    .name = "nccl",
    .mem = COMM_MEM_DEVICE,
    .device = "cuda",
    .device_per_rank = 1,
    .capturable = 1,
    .create = nccl_create,
};
