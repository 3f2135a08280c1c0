/* comm_nccl: the "nccl" collective backend, one NCCL communicator per mesh group, on device
 * memory.
 *
 * Setup (comm_nccl_create): the GPU is LOCAL_RANK's (cudaSetDevice), after checking that
 * LOCAL_WORLD_SIZE GPUs are visible: NCCL does not allow two ranks of a communicator on one
 * device, and several ranks sharing a GPU would otherwise fail deep inside NCCL or hang (use the
 * "staged" backend for that). Group rank 0 creates the unique id and publishes it in the store
 * under "comm/<group>/<generation>/nccl_id" (the cpu backend's key space: a restarted job never
 * reads an earlier attempt's id); the others wait for it, then every member joins with
 * ncclCommInitRankConfig. The communicator is non-blocking (config.blocking = 0), so that no NCCL
 * call can block past our timeout: every call that answers ncclInProgress is polled with
 * ncclCommGetAsyncError until it completes, fails, or the timeout passes.
 *
 * Collectives run on a stream of their own. Order against the compute that writes their input:
 * with a compute stream (comm_nccl_set_stream) an event recorded there is waited for on ours;
 * without one, the device backend (comm_config_t.device) is synchronized, or else the device.
 * Calls are blocking as comm.h says: the host polls the completion event together with
 * ncclCommGetAsyncError, so a dead or stuck peer ends in COMM_EREMOTE or COMM_ETIMEDOUT, with
 * the group and operation named, instead of a hang; since the call returns only after the
 * collective has completed, later compute on any stream is ordered after it. Overlapping
 * communication with compute needs non-blocking calls (record an event, let the compute stream
 * wait for it, return), which comes with the strategy's overlap work: the hooks are here.
 *
 * On any failure the communicator is aborted (ncclCommAbort), so the peers' NCCL calls fail too,
 * and it stays broken. Its abort op (comm_abort, and comm_abort_all on the fatal path) is
 * ncclCommAbort; comm_nccl_abort_all aborts the nccl ones of comm.c's registry. Fatal CUDA
 * errors of the calls around NCCL (events, streams) go through CUDA_CHECK (trainer/fatal.h):
 * "[trainer rank R host] file:line: call: message", abort everything, exit(1).
 *
 * What it does not do: several GPUs per rank, NCCL groups (ncclGroupStart) across calls,
 * user buffer registration, pipelining with compute. AVG is ncclAvg, which NCCL computes as a
 * premultiplied sum for floats: the same bits as sum-then-divide when the group size is a power
 * of two, possibly the last bit otherwise. Stats count the bytes a ring algorithm sends
 * (all_reduce 2(n-1)/n of the buffer, and so on), not what NCCL's chosen algorithm moved. */
#include "trainer/comm.h"
#include "trainer/comm_impl.h"
#include "trainer/comm_nccl.h"

#ifdef MESHRUN_HAVE_CUDA

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
#include "common/net.h"
#include "trainer/backend.h"
#include "trainer/fatal.h"

typedef struct nccl_impl {
  ncclComm_t comm;          /* NULL until initialized; NULL again once aborted or destroyed */
  cudaStream_t stream;      /* NCCL's stream */
  cudaEvent_t ready;        /* recorded on the compute stream before a collective */
  cudaEvent_t done;         /* recorded on our stream after it */
  cudaStream_t compute;     /* comm_nccl_set_stream's, or NULL */
  backend_t *dev;           /* comm_config_t.device, or NULL */
  float *barrier_buf;       /* one float of device memory for barrier */
  int device;               /* CUDA device number */
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

/* Waits until a non-blocking NCCL call that answered ncclInProgress has finished. */
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

/* After enqueuing: waits for completion while watching NCCL's asynchronous errors and the
 * timeout. The compute stream (when known) then waits on the same event, so it is ordered even
 * if a later version stops waiting here. */
static int finish(comm_t *c, const char *what, ncclResult_t r) {
  nccl_impl_t *p = c->impl;
  int rc = wait_state(c, what, r);
  if (rc) return rc;
  CUDA_CHECK(cudaEventRecord(p->done, p->stream));
  int64_t deadline = net_now_ms() + c->timeout_ms;
  int polls = 0;
  for (;;) {
    cudaError_t q = cudaEventQuery(p->done);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady)
      return fail(c, COMM_ESYSTEM, "%s: CUDA error while waiting for NCCL: %s", what,
                  cudaGetErrorString(q));
    ncclResult_t ae = ncclSuccess;
    ncclResult_t gr = ncclCommGetAsyncError(p->comm, &ae);
    if (gr != ncclSuccess) ae = gr;
    if (ae != ncclSuccess && ae != ncclInProgress)
      return fail(c, COMM_EREMOTE, "%s: NCCL error: %s (%s); did a peer exit?", what,
                  ncclGetErrorString(ae), last_error(p->comm, ae));
    if (net_now_ms() > deadline)
      return fail(c, COMM_ETIMEDOUT, "%s timed out after %g s (the NCCL kernel did not complete: "
                  "a peer is missing, dead, or in another collective)", what, c->timeout_ms / 1000.0);
    poll_pause(&polls);
  }
  if (p->compute) CUDA_CHECK(cudaStreamWaitEvent(p->compute, p->done, 0));
  return COMM_OK;
}

static ncclDataType_t nccl_dtype(comm_dtype_t d) { return d == COMM_BFLOAT16 ? ncclBfloat16 : ncclFloat32; }

static ncclRedOp_t nccl_op(comm_op_t op) {
  switch (op) {
  case COMM_SUM: return ncclSum;
  case COMM_AVG: return ncclAvg;
  case COMM_MAX: return ncclMax;
  }
  return ncclSum;
}

/* Ring-equivalent payload of one rank: bytes * num / den. */
static void count_bytes(comm_t *c, size_t bytes, int num, int den) {
  uint64_t b = (uint64_t)bytes * (uint64_t)num / (uint64_t)den;
  c->stats.bytes_sent += b;
  c->stats.bytes_recv += b;
}

static int nccl_all_reduce(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, comm_op_t op) {
  nccl_impl_t *p = c->impl;
  order_after_compute(p);
  ncclResult_t r = ncclAllReduce(buf, buf, count, nccl_dtype(dtype), nccl_op(op), p->comm, p->stream);
  int rc = finish(c, "all_reduce", r);
  if (rc == COMM_OK) count_bytes(c, count * comm_dtype_size(dtype), 2 * (c->size - 1), c->size);
  return rc;
}

static int nccl_all_gather(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype) {
  nccl_impl_t *p = c->impl;
  order_after_compute(p);
  /* in is out + rank * count (the dispatch put it there): NCCL's in-place all-gather. */
  ncclResult_t r = ncclAllGather(in, out, count, nccl_dtype(dtype), p->comm, p->stream);
  int rc = finish(c, "all_gather", r);
  if (rc == COMM_OK) count_bytes(c, count * comm_dtype_size(dtype), c->size - 1, 1);
  return rc;
}

static int nccl_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype,
                               comm_op_t op) {
  nccl_impl_t *p = c->impl;
  order_after_compute(p);
  ncclResult_t r = ncclReduceScatter(in, out, count, nccl_dtype(dtype), nccl_op(op), p->comm, p->stream);
  int rc = finish(c, "reduce_scatter", r);
  if (rc == COMM_OK) count_bytes(c, count * comm_dtype_size(dtype), c->size - 1, 1);
  return rc;
}

static int nccl_broadcast(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, int root) {
  nccl_impl_t *p = c->impl;
  order_after_compute(p);
  ncclResult_t r = ncclBroadcast(buf, buf, count, nccl_dtype(dtype), root, p->comm, p->stream);
  int rc = finish(c, "broadcast", r);
  if (rc == COMM_OK) count_bytes(c, count * comm_dtype_size(dtype), 1, 1);
  return rc;
}

/* NCCL has no barrier: an all-reduce of one float is one, since no rank's kernel completes
 * before every rank's has started. */
static int nccl_barrier(comm_t *c) {
  nccl_impl_t *p = c->impl;
  order_after_compute(p);
  ncclResult_t r = ncclAllReduce(p->barrier_buf, p->barrier_buf, 1, ncclFloat32, ncclSum, p->comm,
                                 p->stream);
  return finish(c, "barrier", r);
}

static int nccl_copy(comm_t *c, void *dst, const void *src, size_t bytes) {
  nccl_impl_t *p = c->impl;
  order_after_compute(p);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, p->stream));
  CUDA_CHECK(cudaStreamSynchronize(p->stream));
  return COMM_OK;
}

/* A healthy communicator is finalized (flushes its work) then destroyed; a broken one, or one
 * whose finalize does not complete within the timeout, is aborted. */
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
  if (p->barrier_buf) cudaFree(p->barrier_buf);
  if (p->ready) cudaEventDestroy(p->ready);
  if (p->done) cudaEventDestroy(p->done);
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
    .copy = nccl_copy,
    .bf16 = 1,
    .abort = nccl_abort_op,
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

int comm_nccl_visible_gpus(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int comm_nccl_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen) {
  char why[COMM_ERR_MAX] = "";
  int rc = COMM_OK;
  cudaError_t ce;
  nccl_impl_t *p = calloc(1, sizeof *p);
  if (!p) {
    snprintf(err, errlen, "comm %s: out of memory", cfg->name);
    return COMM_ESYSTEM;
  }
  c->impl = p;
  c->ops = &nccl_ops;
  p->dev = cfg->device;

  /* 1. The device: LOCAL_RANK's, once we know there are enough of them. */
  int count = 0;
  ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0) {
    snprintf(err, errlen, "nccl: no GPU visible (cudaGetDeviceCount: %s; CUDA_VISIBLE_DEVICES=%s)",
             ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices",
             getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "unset");
    (void)cudaGetLastError();
    return COMM_ESYSTEM;
  }
  int local_rank, local_world; /* unreadable values mean the defaults, as before */
  env_int("LOCAL_RANK", 0, (1 << 20) - 1, 0, &local_rank);
  env_int("LOCAL_WORLD_SIZE", 0, (1 << 20) - 1, 1, &local_world);
  if (local_world > count || local_rank >= count) {
    snprintf(err, errlen, "nccl: LOCAL_WORLD_SIZE %d but only %d GPU%s visible (LOCAL_RANK %d); NCCL "
             "needs one GPU per rank: start fewer ranks per node, or use the staged comm backend to "
             "share a GPU", local_world, count, count == 1 ? "" : "s", local_rank);
    return COMM_EINVAL;
  }
  p->device = local_rank;
  const char *what = NULL;
  if ((ce = cudaSetDevice(p->device)) != cudaSuccess) what = "cudaSetDevice";
  else if ((ce = cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking)) != cudaSuccess) what = "cudaStreamCreate";
  else if ((ce = cudaEventCreateWithFlags(&p->ready, cudaEventDisableTiming)) != cudaSuccess) what = "cudaEventCreate";
  else if ((ce = cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming)) != cudaSuccess) what = "cudaEventCreate";
  else if ((ce = cudaMalloc((void **)&p->barrier_buf, sizeof(float))) != cudaSuccess) what = "cudaMalloc";
  if (what) {
    snprintf(why, sizeof why, "GPU %d: %s: %s", p->device, what, cudaGetErrorString(ce));
    rc = COMM_ESYSTEM;
    goto error;
  }

  /* 2. The id, through the store. */
  int64_t deadline = net_now_ms() + c->timeout_ms;
  ncclUniqueId id;
  rc = exchange_id(cfg, c->timeout_ms, &id, why, sizeof why);
  if (rc) goto error;

  /* 3. Join, non-blocking: the init is polled so that a missing member times out. */
  ncclConfig_t conf = NCCL_CONFIG_INITIALIZER;
  conf.blocking = 0;
  conf.commName = cfg->name;
  ncclResult_t r = ncclCommInitRankConfig(&p->comm, cfg->size, id, cfg->rank, &conf);
  int polls = 0;
  while (r == ncclInProgress && p->comm) {
    if (net_now_ms() > deadline) {
      snprintf(why, sizeof why, "ncclCommInitRankConfig did not complete within %g s (are all %d "
               "members starting?)", c->timeout_ms / 1000.0, cfg->size);
      rc = COMM_ETIMEDOUT;
      goto error;
    }
    poll_pause(&polls);
    ncclResult_t q = ncclCommGetAsyncError(p->comm, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) {
    snprintf(why, sizeof why, "ncclCommInitRankConfig on GPU %d: %s (%s)", p->device,
             ncclGetErrorString(r), last_error(p->comm, r));
    rc = r == ncclRemoteError ? COMM_EREMOTE : COMM_ESYSTEM;
    goto error;
  }
  return COMM_OK;

error:
  nccl_abort(p); /* peers already inside the init fail instead of waiting */
  snprintf(err, errlen, "comm %s (rank %d/%d): nccl setup: %s", cfg->name, cfg->rank, cfg->size, why);
  return rc;
}

#else /* no CUDA in this build: the names exist so the trainer links, and say why they fail */

#include <stdio.h>

int comm_nccl_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen) {
  snprintf(err, errlen, "comm_create %s: backend nccl is not built (this build has no CUDA: nvcc was "
           "not found); use cpu, or staged with a device backend", cfg->name);
  return COMM_EINVAL;
}

int comm_nccl_set_stream(comm_t *c, void *compute_stream) { return COMM_EINVAL; }

void comm_nccl_abort_all(void) {}

int comm_nccl_visible_gpus(void) { return 0; }

#endif
