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
 * Both dtypes, float32 and bfloat16, as comm_cpu: the staging buffers are sized in bytes from
 * the element size (comm_dtype_size), and a bf16 reduction is the inner ring's (fp32 arithmetic,
 * one rounding to bf16 per combining step).
 *
 * What it does not do: no overlap (each call copies, reduces and copies back before
 * returning), no pinned host memory (the staging buffer is plain malloc; the copies are the slow
 * part, which is acceptable for tests and one-GPU runs, not for speed). */
#include "trainer/comm.h"
#include "trainer/comm_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/backend.h"

typedef struct {
  comm_t *inner;    /* "cpu" communicator of the same group, on host memory */
  backend_t *dev;   /* borrowed: whose memory the caller's buffers are */
  char *host;       /* staging buffer */
  size_t host_cap;  /* bytes */
} staged_t;

/* Runs after every inner call: adds the inner traffic to ours and, on failure, copies the inner
 * message without its "comm <name> (rank r/n): " prefix (ours says the same). */
static int inner_done(comm_t *c, int rc, const comm_stats_t *before) {
  staged_t *p = c->impl;
  comm_stats_t now;
  comm_get_stats(p->inner, &now);
  c->stats.bytes_sent += now.bytes_sent - before->bytes_sent;
  c->stats.bytes_recv += now.bytes_recv - before->bytes_recv;
  if (rc == COMM_OK) return COMM_OK;
  const char *msg = comm_errmsg(p->inner);
  char prefix[COMM_NAME_MAX + 64];
  int n = snprintf(prefix, sizeof prefix, "comm %s (rank %d/%d): ", c->name, c->rank, c->size);
  if (n > 0 && strncmp(msg, prefix, (size_t)n) == 0) msg += n;
  return comm_set_error(c, rc, "%s", msg);
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

static int staged_all_reduce(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, comm_op_t op) {
  staged_t *p = c->impl;
  size_t bytes = count * comm_dtype_size(dtype);
  int rc = ensure_host(c, bytes);
  if (rc) return rc;
  p->dev->to_host(p->dev, p->host, buf, bytes);
  comm_stats_t before;
  comm_get_stats(p->inner, &before);
  rc = inner_done(c, comm_all_reduce(p->inner, p->host, count, dtype, op), &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, buf, p->host, bytes);
  return COMM_OK;
}

/* The dispatch has put this rank's input in its slot of out (device memory). Only that slot goes
 * down; the whole gathered buffer comes back up. */
static int staged_all_gather(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype) {
  staged_t *p = c->impl;
  size_t esz = comm_dtype_size(dtype), slot = count * esz, bytes = (size_t)c->size * slot;
  int rc = ensure_host(c, bytes);
  if (rc) return rc;
  char *hslot = p->host + (size_t)c->rank * slot;
  p->dev->to_host(p->dev, hslot, in, slot);
  comm_stats_t before;
  comm_get_stats(p->inner, &before);
  rc = inner_done(c, comm_all_gather(p->inner, hslot, p->host, count, dtype), &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, out, p->host, bytes);
  return COMM_OK;
}

/* Input (size * count) and output (count) share the staging buffer: the output after the input,
 * since the inner reduce_scatter forbids overlap. */
static int staged_reduce_scatter(comm_t *c, const void *in, void *out, size_t count,
                                 comm_dtype_t dtype, comm_op_t op) {
  staged_t *p = c->impl;
  size_t esz = comm_dtype_size(dtype), obytes = count * esz, ibytes = (size_t)c->size * obytes;
  int rc = ensure_host(c, ibytes + obytes);
  if (rc) return rc;
  p->dev->to_host(p->dev, p->host, in, ibytes);
  comm_stats_t before;
  comm_get_stats(p->inner, &before);
  rc = inner_done(c, comm_reduce_scatter(p->inner, p->host, p->host + ibytes, count, dtype, op),
                  &before);
  if (rc) return rc;
  p->dev->to_device(p->dev, out, p->host + ibytes, obytes);
  return COMM_OK;
}

/* Only the root copies down and only the others copy back: the root's buffer is the answer. */
static int staged_broadcast(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, int root) {
  staged_t *p = c->impl;
  size_t bytes = count * comm_dtype_size(dtype);
  int rc = ensure_host(c, bytes);
  if (rc) return rc;
  if (c->rank == root) p->dev->to_host(p->dev, p->host, buf, bytes);
  comm_stats_t before;
  comm_get_stats(p->inner, &before);
  rc = inner_done(c, comm_broadcast(p->inner, p->host, count, dtype, root), &before);
  if (rc) return rc;
  if (c->rank != root) p->dev->to_device(p->dev, buf, p->host, bytes);
  return COMM_OK;
}

static int staged_barrier(comm_t *c) {
  staged_t *p = c->impl;
  comm_stats_t before;
  comm_get_stats(p->inner, &before);
  return inner_done(c, comm_barrier(p->inner), &before);
}

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
    .copy = staged_copy,
    .bf16 = 1, /* the inner cpu ring reduces bf16 */
    .abort = staged_abort,
    .inline_async = 1, /* its copies go through the shared device backend: started = run at once */
};

int comm_staged_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen) {
  backend_t *dev = cfg->device;
  if (!dev || !dev->to_host || !dev->to_device || !dev->copy) {
    snprintf(err, errlen, "comm_create %s: backend staged needs comm_config_t.device (the backend "
             "whose memory it copies through the host)", cfg->name);
    return COMM_EINVAL;
  }
  staged_t *p = calloc(1, sizeof *p);
  if (!p) {
    snprintf(err, errlen, "comm %s: out of memory", cfg->name);
    return COMM_ESYSTEM;
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
