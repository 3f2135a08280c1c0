/* comm_staged: the "staged" collective backend, device buffers moved through host memory and
 * reduced by an inner "cpu" communicator.
 *
 * It exists so that parallel plans (DDP, FSDP, TP) can run with the cuda backend's kernels when
 * several ranks share one GPU, where NCCL refuses to put two ranks of a communicator on the same
 * device. Each collective copies what this rank contributes from the device into a host staging
 * buffer (comm_config_t.device's to_host, which waits for the compute queued before it), runs
 * the same collective of the inner cpu communicator there, and copies the result back
 * (to_device). The reductions are therefore the cpu backend's, bit for bit: the same ring, the
 * same order, so a staged run and a cpu run of the same plan reduce identically.
 *
 * The inner communicator is a full comm_t of the same group (same name, rank, size, generation,
 * store, timeout), so its setup, timeouts and error messages are comm_cpu's; its failures are
 * copied into this communicator with the same wording. Stats count the inner ring's payload
 * bytes, not the device copies.
 *
 * Sends and receives go the same way: a send copies the buffer to the host and sends it on the
 * inner ring, a receive receives into the host buffer and copies it to the device. So they have
 * comm_cpu's rules (ring neighbours only, a header that checks count and dtype).
 *
 * A started send does not block its caller (the pipeline's transport contract, pipeline.h): its
 * start (the dispatch's native start, taken for sends only) copies the device buffer into a host
 * buffer of the request's own and starts the inner ring's send, which the inner communicator's
 * progress thread moves; comm_wait waits for that request and frees the copy. Everything else,
 * started or not, runs to completion inside the call (inline_async), receives included: a
 * receive may block its caller. Issue order holds because every inner operation goes through
 * the inner communicator, whose queue runs its calls in order; a call made while sends are
 * pending first waits for them (it would queue behind them anyway), so that each call's stats
 * are its own; a started send's bytes join the stats at its comm_wait. Sends still pending at
 * destroy are waited for there, as comm_cpu's queue is.
 *
 * Both dtypes, float32 and bfloat16, as comm_cpu: the staging buffers are sized in bytes from
 * the element size (dtype_size), and a bf16 reduction is the inner ring's (fp32 arithmetic,
 * one rounding to bf16 per combining step).
 *
 * What it does not do: no overlap of collectives or receives (each copies, reduces or receives
 * and copies back before returning, started or not; only a started send's transfer runs behind
 * the caller, its device-to-host copy still inside the start), no pinned host memory (the
 * staging buffers are plain malloc, one more per send in flight; the copies are the slow part,
 * which is acceptable for tests and one-GPU runs, not for speed). */
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "trainer/backend/backend.h"

/* A started send (the dispatch's token): its bytes, copied off the device at the start, on their
 * way through the inner ring's request. */
typedef struct staged_send {
  comm_req_t *req;          /* the inner ring's started send; NULL once settled */
  char *host;               /* the copy (count * element size bytes); freed once settled */
  int rc;                   /* once settled: the inner result */
  uint64_t sent;            /* once settled: the bytes the inner ring sent for it */
  struct staged_send *next; /* pending list, in issue order */
} staged_send_t;

typedef struct {
  comm_t *inner;    /* "cpu" communicator of the same group, on host memory */
  backend_t *dev;   /* borrowed: whose memory the caller's buffers are */
  char *host;       /* staging buffer */
  size_t host_cap;  /* bytes */
  staged_send_t *sends; /* started, not yet waited for by the dispatch (or released) */
} staged_t;

/* The inner ring's failure as ours: its message without its "comm <name> (rank r/n): " prefix
 * (ours says the same). */
static int inner_error(comm_t *c, int rc) {
  staged_t *p = c->impl;
  const char *msg = comm_errmsg(p->inner);
  char prefix[COMM_NAME_MAX + 64];
  int n = snprintf(prefix, sizeof prefix, "comm %s (rank %d/%d): ", c->name, c->rank, c->size);
  if (n > 0 && strncmp(msg, prefix, (size_t)n) == 0) msg += n;
  return comm_set_error(c, rc, "%s", msg);
}

/* Waits for the inner request of a started send, once, keeping its result; frees the copy. */
static void send_settle(staged_send_t *s) {
  if (!s->req) return;
  s->rc = comm_wait(s->req, &s->sent);
  s->req = NULL;
  free(s->host);
  s->host = NULL;
}

/* Runs before every blocking inner call: settles the pending sends (the inner queue would run the
 * call after them anyway, so this waits no longer), then reads the inner stats, so that the
 * call's difference in inner_done holds its own traffic only; a send's bytes are counted at its
 * own wait. */
static void inner_begin(comm_t *c, comm_stats_t *before) {
  staged_t *p = c->impl;
  for (staged_send_t *s = p->sends; s; s = s->next) send_settle(s);
  comm_get_stats(p->inner, before);
}

/* Runs after every blocking inner call: adds the inner traffic to ours and, on failure, copies
 * the inner message. */
static int inner_done(comm_t *c, int rc, const comm_stats_t *before) {
  staged_t *p = c->impl;
  comm_stats_t now;
  comm_get_stats(p->inner, &now);
  c->stats.bytes_sent += now.bytes_sent - before->bytes_sent;
  c->stats.bytes_recv += now.bytes_recv - before->bytes_recv;
  return rc == COMM_OK ? COMM_OK : inner_error(c, rc);
}

static int ensure_host(comm_t *c, size_t bytes) {
  staged_t *p = c->impl;
  if (bytes <= p->host_cap) return COMM_OK;
  char *h = realloc(p->host, bytes);
  if (!h) return comm_set_error(c, COMM_ESYSTEM, "out of memory for a %zu-byte staging buffer", bytes);
  p->host = h;
  p->host_cap = bytes;
  return COMM_OK;
}

/* What every staged call does before its inner call, in this order: makes the staging buffer cap
 * bytes, copies bytes of the device buffer src into it at offset off (nothing when src is NULL: a
 * receive, a broadcast's non-root), then inner_begin. Fails only for the staging buffer, before
 * any copy. */
static int stage_in(comm_t *c, size_t cap, size_t off, const void *src, size_t bytes, comm_stats_t *before) {
  staged_t *p = c->impl;
  int rc = ensure_host(c, cap);
  if (rc) return rc;
  if (src) p->dev->to_host(p->dev, p->host + off, src, bytes);
  inner_begin(c, before);
  return COMM_OK;
}

static int staged_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op) {
  staged_t *p = c->impl;
  size_t bytes = count * dtype_size(dtype);
  comm_stats_t before;
  int rc = stage_in(c, bytes, 0, buf, bytes, &before);
  if (rc) return rc;
  rc = inner_done(c, comm_all_reduce(p->inner, p->host, count, dtype, op), &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, buf, p->host, bytes);
  return COMM_OK;
}

/* The dispatch has put this rank's input in its slot of out (device memory). Only that slot goes
 * down; the whole gathered buffer comes back up. */
static int staged_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype) {
  staged_t *p = c->impl;
  size_t esz = dtype_size(dtype), slot = count * esz, bytes = (size_t)c->size * slot;
  size_t off = (size_t)c->rank * slot; /* this rank's slot in the staging buffer */
  comm_stats_t before;
  int rc = stage_in(c, bytes, off, in, slot, &before);
  if (rc) return rc;
  rc = inner_done(c, comm_all_gather(p->inner, p->host + off, p->host, count, dtype), &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, out, p->host, bytes);
  return COMM_OK;
}

/* Input (size * count) and output (count) share the staging buffer: the output after the input,
 * since the inner reduce_scatter forbids overlap. */
static int staged_reduce_scatter(comm_t *c, const void *in, void *out, size_t count,
                                 dtype_t dtype, comm_op_t op) {
  staged_t *p = c->impl;
  size_t esz = dtype_size(dtype), obytes = count * esz, ibytes = (size_t)c->size * obytes;
  comm_stats_t before;
  int rc = stage_in(c, ibytes + obytes, 0, in, ibytes, &before);
  if (rc) return rc;
  rc = inner_done(c, comm_reduce_scatter(p->inner, p->host, p->host + ibytes, count, dtype, op),
                  &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, out, p->host + ibytes, obytes);
  return COMM_OK;
}

/* Only the root copies down and only the others copy back: the root's buffer is the answer. */
static int staged_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root) {
  staged_t *p = c->impl;
  size_t bytes = count * dtype_size(dtype);
  comm_stats_t before;
  int rc = stage_in(c, bytes, 0, c->rank == root ? buf : NULL, bytes, &before);
  if (rc) return rc;
  rc = inner_done(c, comm_broadcast(p->inner, p->host, count, dtype, root), &before);
  if (rc) return rc;
  if (c->rank != root) p->dev->to_device(p->dev, buf, p->host, bytes);
  return COMM_OK;
}

static int staged_barrier(comm_t *c) {
  staged_t *p = c->impl;
  comm_stats_t before;
  inner_begin(c, &before);
  return inner_done(c, comm_barrier(p->inner), &before);
}

/* Device to host, then the inner ring's send (to the right neighbour); the blocking send. */
static int staged_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer) {
  staged_t *p = c->impl;
  size_t bytes = count * dtype_size(dtype);
  comm_stats_t before;
  int rc = stage_in(c, bytes, 0, buf, bytes, &before);
  if (rc) return rc;
  return inner_done(c, comm_send(p->inner, p->host, count, dtype, peer), &before);
}

/* The inner ring's receive (from the left neighbour), then host to device. */
static int staged_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer) {
  staged_t *p = c->impl;
  size_t bytes = count * dtype_size(dtype);
  comm_stats_t before;
  int rc = stage_in(c, bytes, 0, NULL, 0, &before);
  if (rc) return rc;
  rc = inner_done(c, comm_recv(p->inner, p->host, count, dtype, peer), &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, buf, p->host, bytes);
  return COMM_OK;
}

/* A started send: the device bytes go into a copy of the request's own now (to_host waits for the
 * compute queued before it, so the copy is what buf holds at the start), and the inner ring's
 * started send moves them on the inner progress thread while the caller goes on. The dispatch
 * gives only sends to start (inline_async). */
static int staged_start(comm_t *c, const comm_call_t *call, void **token) {
  staged_t *p = c->impl;
  *token = NULL;
  if (call->kind != COMM_CALL_SEND) return comm_set_error(c, COMM_EINVAL, "staged: only sends start natively");
  size_t bytes = call->count * dtype_size(call->dtype);
  staged_send_t *s = calloc(1, sizeof *s);
  char *h = malloc(bytes);
  if (!s || !h) {
    free(s);
    free(h);
    return comm_set_error(c, COMM_ESYSTEM, "send: out of memory for a %zu-byte host copy", bytes);
  }
  p->dev->to_host(p->dev, h, call->in, bytes);
  int rc = comm_start_send(p->inner, h, call->count, call->dtype, call->peer, &s->req);
  if (rc) {
    free(s);
    free(h);
    return inner_error(c, rc);
  }
  s->host = h;
  staged_send_t **q = &p->sends;
  while (*q) q = &(*q)->next;
  *q = s;
  *token = s;
  return COMM_OK;
}

/* Settles a started send and takes it off the list (whatever its place: a caller may wait for a
 * later send before an earlier one); returns its result, freed. */
static int send_finish(comm_t *c, staged_send_t *s) {
  staged_t *p = c->impl;
  send_settle(s);
  for (staged_send_t **q = &p->sends; *q; q = &(*q)->next)
    if (*q == s) {
      *q = s->next;
      break;
    }
  int rc = s->rc;
  free(s);
  return rc;
}

/* comm_wait of a started send: its bytes join the stats here, so that the dispatch counts them
 * for this request; a failure brings the inner message. */
static int staged_wait(comm_t *c, void *token) {
  staged_send_t *s = token;
  send_settle(s);
  c->stats.bytes_sent += s->sent;
  int rc = send_finish(c, s);
  return rc == COMM_OK ? COMM_OK : inner_error(c, rc);
}

static int staged_test(comm_t *c, void *token, int *done) {
  staged_send_t *s = token;
  if (!s->req) {
    *done = 1;
    return COMM_OK;
  }
  return comm_test(s->req, done);
}

/* A started send whose wait will never come (destroy): waited for all the same, as comm_cpu's
 * queue runs what is left before its communicator goes. */
static void staged_release(comm_t *c, void *token) { send_finish(c, token); }

/* Device-to-device copies of the dispatch; synchronized, since the caller may read the result
 * through another path (a later to_host is ordered anyway; this keeps the contract simple). */
static int staged_copy(comm_t *c, void *dst, const void *src, size_t bytes) {
  staged_t *p = c->impl;
  p->dev->copy(p->dev, dst, src, bytes);
  if (p->dev->synchronize) p->dev->synchronize(p->dev);
  return COMM_OK;
}

static void staged_destroy(comm_t *c) {
  staged_t *p = c->impl;
  if (!p) return;
  while (p->sends) staged_release(c, p->sends);
  comm_destroy(p->inner);
  free(p->host);
  free(p);
  c->impl = NULL;
}

/* The inner ring is what the peers wait on (it is registered too; aborting it twice is harmless). */
static void staged_abort(comm_t *c) {
  staged_t *p = c->impl;
  comm_abort(p->inner, "the staged communicator was aborted");
}

static const comm_ops_t staged_ops = {
    .name = "staged",
    .all_reduce = staged_all_reduce,
    .all_gather = staged_all_gather,
    .reduce_scatter = staged_reduce_scatter,
    .broadcast = staged_broadcast,
    .barrier = staged_barrier,
    .destroy = staged_destroy,
    .send = staged_send,
    .recv = staged_recv,
    .p2p_ring = 1, /* the inner cpu ring's links */
    .copy = staged_copy,
    .bf16 = 1, /* the inner cpu ring reduces bf16 */
    .abort = staged_abort,
    /* Started sends only (comm_impl.h): the device-to-host copy at the start, the transfer on the
     * inner ring's progress thread. */
    .start = staged_start,
    .wait = staged_wait,
    .test = staged_test,
    .release = staged_release,
    .inline_async = 1, /* its copies go through the shared device backend: started = run at once */
};

static int staged_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen) {
  backend_t *dev = cfg->device;
  if (!dev || !dev->to_host || !dev->to_device || !dev->copy) {
    return err_set(err, errlen, COMM_EINVAL,
                   "comm_create %s: backend staged needs comm_config_t.device (the backend "
                   "whose memory it copies through the host)",
                   cfg->name);
  }
  staged_t *p = calloc(1, sizeof *p);
  if (!p) {
    return err_set(err, errlen, COMM_ESYSTEM, "comm %s: out of memory", cfg->name);
  }
  p->dev = dev;
  c->impl = p;
  c->ops = &staged_ops;
  /* The inner group uses this communicator's timeout, already resolved from the environment. */
  comm_config_t in = *cfg;
  in.device = NULL;
  in.timeout_ms = c->timeout_ms;
  return comm_create(&p->inner, "cpu", &in, err, errlen);
}

/* The registry's entry (trainer/comm/registry.c): device memory of any backend (copied through
 * its to_host and to_device), no device of its own needed: the default where a device backend's
 * ranks share devices. */
const comm_entry_t comm_entry_staged = {
    .name = "staged",
    .mem = COMM_MEM_DEVICE,
    .create = staged_create,
};
