/* comm: the dispatch in front of the collective backends.
 *
 * Checks arguments, answers what needs no communication (groups of one rank, empty buffers)
 * and keeps the communicator's error state; then calls the backend's table. It moves no bytes
 * itself beyond the local copies a contract implies (all_gather's own slot, reduce_scatter on
 * one rank), and those go through the backend's copy when its buffers are device memory. It
 * knows nothing about sockets or devices. See comm.h for the contract.
 *
 * The nccl and staged backends are referenced weakly: a program that links only comm_cpu.c
 * (most unit tests and tools) still links, and asking it for them is a clear error.
 *
 * It also keeps the registry of live communicators (comm_create adds, comm_destroy removes), so
 * that a fatal device error can abort all of them before the process exits (comm_abort_all):
 * the peers then fail at once instead of waiting out their timeout. The registry has a lock of
 * its own; everything else of a comm_t belongs to the one thread that calls it. */
#include "trainer/comm.h"
#include "trainer/comm_impl.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/env.h"
#include "trainer/backend.h"

#pragma weak comm_nccl_create
#pragma weak comm_staged_create

typedef int (*backend_create_fn)(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen);

/* The backends: name, the memory they move, create function (NULL when weakly absent). */
typedef struct {
  const char *name;
  comm_mem_t mem;
  backend_create_fn create;
} backend_entry_t;

static const backend_entry_t *backend_by_name(const char *name) {
  static const backend_entry_t table[] = {
      {"cpu", COMM_MEM_HOST, comm_cpu_create},
      {"nccl", COMM_MEM_DEVICE, comm_nccl_create},
      {"staged", COMM_MEM_DEVICE, comm_staged_create},
  };
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (!strcmp(name, table[i].name)) return &table[i];
  return NULL;
}

comm_mem_t comm_backend_memory(const char *backend) {
  const backend_entry_t *b = backend_by_name(backend ? backend : "cpu");
  return b ? b->mem : COMM_MEM_HOST;
}

comm_mem_t comm_memory(const comm_t *c) { return c->mem; }

/* ---- the registry of live communicators */

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static comm_t *live;

static void live_add(comm_t *c) {
  pthread_mutex_lock(&live_lock);
  c->next_live = live;
  live = c;
  pthread_mutex_unlock(&live_lock);
}

static void live_remove(comm_t *c) {
  pthread_mutex_lock(&live_lock);
  for (comm_t **q = &live; *q; q = &(*q)->next_live)
    if (*q == c) {
      *q = c->next_live;
      break;
    }
  pthread_mutex_unlock(&live_lock);
}

void comm_abort(comm_t *c, const char *why) {
  if (!c) return;
  if (c->ops && c->ops->abort && c->impl) c->ops->abort(c);
  if (!c->broken) comm_set_error(c, COMM_ESYSTEM, "aborted: %s", why ? why : "comm_abort");
}

void comm_abort_backend(const comm_ops_t *ops, const char *why) {
  pthread_mutex_lock(&live_lock);
  for (comm_t *c = live; c; c = c->next_live)
    if (!ops || c->ops == ops) comm_abort(c, why);
  pthread_mutex_unlock(&live_lock);
}

void comm_abort_all(const char *why) { comm_abort_backend(NULL, why); }

void comm_fail_next(comm_t *c) {
  if (c) c->fail_next = 1;
}

/* The armed fault of comm_fail_next: the call fails as a lost connection would, peers included. */
static int injected(comm_t *c, const char *what) {
  c->fail_next = 0;
  if (c->ops && c->ops->abort && c->impl) c->ops->abort(c);
  return comm_set_error(c, COMM_ESYSTEM, "%s: fault injected (test hook)", what);
}

/* Local copy of bytes between two buffers of the communicator's memory kind. */
static int local_copy(comm_t *c, void *dst, const void *src, size_t bytes) {
  if (c->ops && c->ops->copy) return c->ops->copy(c, dst, src, bytes);
  memcpy(dst, src, bytes);
  return COMM_OK;
}

comm_dtype_t comm_dtype_of(int backend_dtype) { return backend_dtype == DT_BF16 ? COMM_BFLOAT16 : COMM_FLOAT32; }

size_t comm_dtype_size(comm_dtype_t dtype) {
  switch (dtype) {
  case COMM_FLOAT32: return 4;
  case COMM_BFLOAT16: return 2;
  }
  return 0;
}

const char *comm_op_name(comm_op_t op) {
  switch (op) {
  case COMM_SUM: return "sum";
  case COMM_AVG: return "avg";
  case COMM_MAX: return "max";
  }
  return "unknown";
}

const char *comm_strerror(int code) {
  switch (code) {
  case COMM_OK: return "success";
  case COMM_EINVAL: return "invalid argument";
  case COMM_ESYSTEM: return "system error";
  case COMM_EREMOTE: return "remote error";
  case COMM_ETIMEDOUT: return "timed out";
  }
  return "unknown error";
}

/* Set once any communicator of the process breaks (comm_failed_any); read by signal handlers. */
static volatile sig_atomic_t any_broken;

int comm_failed_any(void) { return any_broken != 0; }

int comm_set_error(comm_t *c, int code, const char *fmt, ...) {
  if (code == COMM_ESYSTEM || code == COMM_EREMOTE || code == COMM_ETIMEDOUT) any_broken = 1;
  int n = snprintf(c->err, sizeof c->err, "comm %s (rank %d/%d): ", c->name, c->rank, c->size);
  if (n < 0 || (size_t)n >= sizeof c->err) n = 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err + n, sizeof c->err - (size_t)n, fmt, ap);
  va_end(ap);
  if (code == COMM_ESYSTEM || code == COMM_EREMOTE || code == COMM_ETIMEDOUT) {
    if (!c->broken) c->broken = code;
  }
  return code;
}

static int valid_name(const char *s) {
  if (!s || !*s || strlen(s) >= COMM_NAME_MAX) return 0;
  for (; *s; s++) {
    char ch = *s;
    int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
             ch == '_' || ch == '.' || ch == '-';
    if (!ok) return 0;
  }
  return 1;
}

static int default_timeout_ms(void) {
  double s; /* seconds; an unreadable value means the default, as before */
  env_double("MESHRUN_COMM_TIMEOUT", 1e-3, 1e6 - 1e-3, COMM_DEFAULT_TIMEOUT_MS / 1000.0, &s);
  return (int)(s * 1000.0);
}

int comm_create(comm_t **out, const char *backend, const comm_config_t *cfg, char *err,
                size_t errlen) {
  if (out) *out = NULL;
  if (!out || !cfg) {
    snprintf(err, errlen, "comm_create: NULL argument");
    return COMM_EINVAL;
  }
  if (!valid_name(cfg->name)) {
    snprintf(err, errlen, "comm_create: group name '%s' must be 1..%d characters of [A-Za-z0-9_.-]",
             cfg->name ? cfg->name : "(null)", COMM_NAME_MAX - 1);
    return COMM_EINVAL;
  }
  if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size) {
    snprintf(err, errlen, "comm_create %s: rank %d is not in a group of size %d", cfg->name,
             cfg->rank, cfg->size);
    return COMM_EINVAL;
  }
  if (cfg->size > 1 && !cfg->store) {
    snprintf(err, errlen, "comm_create %s: a group of %d ranks needs a store", cfg->name,
             cfg->size);
    return COMM_EINVAL;
  }
  if (!backend) backend = "cpu";
  const backend_entry_t *entry = backend_by_name(backend);
  backend_create_fn create = entry ? entry->create : NULL;
  if (!create) {
    if (entry)
      snprintf(err, errlen, "comm_create %s: backend '%s' is not linked into this program (link "
               "trainer/comm_%s.c)", cfg->name, backend, backend);
    else
      snprintf(err, errlen, "comm_create %s: unknown backend '%s' (known: cpu, nccl, staged)",
               cfg->name, backend);
    return COMM_EINVAL;
  }
  comm_t *c = calloc(1, sizeof *c);
  if (!c) {
    snprintf(err, errlen, "comm_create %s: out of memory", cfg->name);
    return COMM_ESYSTEM;
  }
  snprintf(c->name, sizeof c->name, "%s", cfg->name);
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : default_timeout_ms();
  c->mem = entry->mem;
  int rc = create(c, cfg, err, errlen);
  if (rc != COMM_OK) {
    comm_destroy(c);
    return rc;
  }
  live_add(c);
  *out = c;
  return COMM_OK;
}

void comm_destroy(comm_t *c) {
  if (!c) return;
  live_remove(c);
  if (c->ops && c->ops->destroy) c->ops->destroy(c);
  free(c);
}

int comm_rank(const comm_t *c) { return c->rank; }
int comm_size(const comm_t *c) { return c->size; }
const char *comm_name(const comm_t *c) { return c->name; }
const char *comm_errmsg(const comm_t *c) { return c ? c->err : "comm: NULL communicator"; }
void comm_get_stats(const comm_t *c, comm_stats_t *out) { *out = c->stats; }
void comm_reset_stats(comm_t *c) { memset(&c->stats, 0, sizeof c->stats); }

int comm_set_timeout(comm_t *c, int timeout_ms) {
  if (!c || timeout_ms <= 0) return COMM_EINVAL;
  c->timeout_ms = timeout_ms;
  return COMM_OK;
}

/* Common checks of every collective: a usable communicator, a known dtype the backend
 * supports (cpu, staged and nccl all move and reduce float32 and bfloat16; a backend whose
 * table leaves bf16 at 0 is refused bfloat16), a known op. */
static int check_call(comm_t *c, const char *what, comm_dtype_t dtype, int has_op, comm_op_t op) {
  /* A broken communicator keeps its first message: it names the peer that started it. */
  if (c->broken) {
    return c->broken;
  }
  if (comm_dtype_size(dtype) == 0)
    return comm_set_error(c, COMM_EINVAL, "%s: unknown dtype %d", what, (int)dtype);
  if (dtype != COMM_FLOAT32 && c->size > 1 && !(c->ops && c->ops->bf16))
    return comm_set_error(c, COMM_EINVAL, "%s: backend %s supports float32 only", what,
                          c->ops ? c->ops->name : "?");
  if (has_op && op != COMM_SUM && op != COMM_AVG && op != COMM_MAX)
    return comm_set_error(c, COMM_EINVAL, "%s: unknown reduction op %d", what, (int)op);
  return COMM_OK;
}

int comm_all_reduce(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, comm_op_t op) {
  if (!c) return COMM_EINVAL;
  int rc = check_call(c, "all_reduce", dtype, 1, op);
  if (rc) return rc;
  if (count > 0 && !buf) return comm_set_error(c, COMM_EINVAL, "all_reduce: NULL buffer");
  if (c->size == 1 || count == 0) return COMM_OK; /* sum, avg and max of one value is itself */
  c->stats.calls++;
  if (c->fail_next) return injected(c, "all_reduce");
  return c->ops->all_reduce(c, buf, count, dtype, op);
}

int comm_all_gather(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype) {
  if (!c) return COMM_EINVAL;
  int rc = check_call(c, "all_gather", dtype, 0, COMM_SUM);
  if (rc) return rc;
  if (count > 0 && (!in || !out)) return comm_set_error(c, COMM_EINVAL, "all_gather: NULL buffer");
  if (count == 0) return COMM_OK;
  size_t esz = comm_dtype_size(dtype);
  char *slot = (char *)out + (size_t)c->rank * count * esz;
  if ((const char *)in != slot) {
    const char *i0 = in, *i1 = i0 + count * esz, *o0 = out, *o1 = o0 + (size_t)c->size * count * esz;
    if (i0 < o1 && o0 < i1)
      return comm_set_error(c, COMM_EINVAL, "all_gather: input overlaps the output but is not "
                            "this rank's slot (out + rank * count)");
    rc = local_copy(c, slot, in, count * esz);
    if (rc) return rc;
  }
  if (c->size == 1) return COMM_OK;
  c->stats.calls++;
  if (c->fail_next) return injected(c, "all_gather");
  return c->ops->all_gather(c, slot, out, count, dtype);
}

int comm_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype,
                        comm_op_t op) {
  if (!c) return COMM_EINVAL;
  int rc = check_call(c, "reduce_scatter", dtype, 1, op);
  if (rc) return rc;
  if (count > 0 && (!in || !out))
    return comm_set_error(c, COMM_EINVAL, "reduce_scatter: NULL buffer");
  if (count == 0) return COMM_OK;
  size_t esz = comm_dtype_size(dtype);
  const char *i0 = in, *i1 = i0 + (size_t)c->size * count * esz, *o0 = out, *o1 = o0 + count * esz;
  if (i0 < o1 && o0 < i1)
    return comm_set_error(c, COMM_EINVAL, "reduce_scatter: output overlaps the input");
  if (c->size == 1) return local_copy(c, out, in, count * esz);
  c->stats.calls++;
  if (c->fail_next) return injected(c, "reduce_scatter");
  return c->ops->reduce_scatter(c, in, out, count, dtype, op);
}

int comm_broadcast(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, int root) {
  if (!c) return COMM_EINVAL;
  int rc = check_call(c, "broadcast", dtype, 0, COMM_SUM);
  if (rc) return rc;
  if (root < 0 || root >= c->size)
    return comm_set_error(c, COMM_EINVAL, "broadcast: root %d is not in a group of size %d", root,
                          c->size);
  if (count > 0 && !buf) return comm_set_error(c, COMM_EINVAL, "broadcast: NULL buffer");
  if (c->size == 1 || count == 0) return COMM_OK;
  c->stats.calls++;
  if (c->fail_next) return injected(c, "broadcast");
  return c->ops->broadcast(c, buf, count, dtype, root);
}

int comm_barrier(comm_t *c) {
  if (!c) return COMM_EINVAL;
  int rc = check_call(c, "barrier", COMM_FLOAT32, 0, COMM_SUM);
  if (rc) return rc;
  if (c->size == 1) return COMM_OK;
  c->stats.calls++;
  if (c->fail_next) return injected(c, "barrier");
  return c->ops->barrier(c);
}
