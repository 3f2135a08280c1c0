/* comm: the dispatch in front of the collective backends.
 *
 * Checks arguments, answers what needs no communication (groups of one rank, empty buffers)
 * and keeps the communicator's error state; then calls the backend's table. It moves no bytes
 * itself beyond the local copies a contract implies (all_gather's own slot, reduce_scatter on
 * one rank), and those go through the backend's copy when its buffers are device memory. It
 * knows nothing about sockets or devices. See comm.h for the contract.
 *
 * Which backends exist is trainer/comm/registry.c's list; this file names none of them.
 *
 * Point-to-point sends and receives are calls like the collectives (a kind of comm_call_t with a
 * peer): the same checks, stats, fault hooks, observer and issue order; only the two ranks take
 * part.
 *
 * Asynchronous requests (comm_start_*, comm_wait) are queued here too: native ones go to the
 * backend's start/wait (nccl, and staged's sends), "staged" runs the rest at once, and "cpu" gets
 * a progress thread per
 * communicator that runs its queue in issue order through the blocking table (see "asynchronous
 * requests" below). The trace observer (comm_set_observer) hears of every call that ran and
 * every wait, and wait_ns counts the caller's blocked time. The flight recorder (comm_flight.c)
 * hears of every call that reaches a backend: issued where the caller issues it, started and
 * ended where it runs (run_observed, or a native start and its wait).
 *
 * It also keeps the registry of live communicators (comm_create adds, comm_destroy removes), so
 * that a fatal device error can abort all of them before the process exits (comm_abort_all):
 * the peers then fail at once instead of waiting out their timeout. The registry has a lock of
 * its own; everything else of a comm_t belongs to the one thread that calls it, and to its
 * progress thread while a request runs there (the queue has its own lock). */
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/env.h"
#include "common/err.h"
#include "trainer/backend/backend.h"

struct comm_req {
  comm_t *c;
  comm_call_t call;
  int done, rc;
  uint64_t sent;
  void *token; /* native backends */
  uint64_t flight; /* its flight recorder ticket */
  struct comm_req *next;
};

struct comm_async {
  pthread_t thread;
  int running; /* the thread exists */
  int stop;
  pthread_mutex_t mu;
  pthread_cond_t work, finished;
  comm_req_t *head, *tail; /* not yet run, in issue order */
  comm_stats_t pub;        /* c->stats as of the last finished call */
};

const comm_entry_t *comm_find(const char *name) {
  for (int i = 0; name && comm_registry[i]; i++)
    if (!strcmp(comm_registry[i]->name, name)) return comm_registry[i];
  return NULL;
}

void comm_names(char *out, size_t len, const char *sep, const char *last) {
  size_t k = 0;
  if (len) out[0] = '\0';
  for (int i = 0; comm_registry[i] && k < len; i++) {
    int w = snprintf(out + k, len - k, "%s%s", !i ? "" : comm_registry[i + 1] ? sep : last, comm_registry[i]->name);
    if (w < 0) break;
    k += (size_t)w;
  }
}

comm_mem_t comm_backend_memory(const char *backend) {
  const comm_entry_t *b = comm_find(backend ? backend : "cpu");
  return b ? b->mem : COMM_MEM_HOST;
}

comm_mem_t comm_memory(const comm_t *c) { return c->mem; }

/* ---- the registry of live communicators */

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static comm_t *live;

static void live_add(comm_t *c) {
  backend_on_fatal(comm_abort_all); /* a fatal device error aborts every live communicator */
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

void comm_live_each(void (*fn)(const comm_t *c, void *arg), void *arg) {
  pthread_mutex_lock(&live_lock);
  for (comm_t *c = live; c; c = c->next_live) fn(c, arg);
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

void comm_skip_next(comm_t *c) {
  if (c) c->skip_next = 1;
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

int comm_timeout_ms(double configured_s) {
  double s; /* seconds; an unreadable value means the configured one, as before */
  env_double("MESHRUN_COMM_TIMEOUT", 1e-3, 1e6 - 1e-3, configured_s > 0 ? configured_s : COMM_DEFAULT_TIMEOUT_MS / 1000.0,
             &s);
  return (int)(s * 1000.0);
}

/* Test hook, MESHRUN_FAULT_COLLECTIVE=RANK:GROUP:N: in the process whose RANK is RANK, the N-th
 * call (collective, send or receive) that reaches the backend of the communicator named
 * GROUP.<lowest rank> (the mesh's names, e.g. "dp_shard") fails as comm_fail_next makes it,
 * whether blocking or started. */
static void fault_from_env(comm_t *c) {
  const char *s = getenv("MESHRUN_FAULT_COLLECTIVE");
  char group[COMM_NAME_MAX] = "";
  int rank = -1, n = 0, my_rank;
  if (!s || sscanf(s, "%d:%63[^:]:%d", &rank, group, &n) != 3 || n < 1) return;
  env_int("RANK", 0, 1 << 30, 0, &my_rank);
  size_t len = strlen(group);
  if (rank == my_rank && !strncmp(c->name, group, len) && c->name[len] == '.') c->fault_at = n;
}

int comm_create(comm_t **out, const char *backend, const comm_config_t *cfg, char *err,
                size_t errlen) {
  if (out) *out = NULL;
  if (!out || !cfg) {
    return err_set(err, errlen, COMM_EINVAL, "comm_create: NULL argument");
  }
  if (!valid_name(cfg->name)) {
    return err_set(err, errlen, COMM_EINVAL, "comm_create: group name '%s' must be 1..%d characters of [A-Za-z0-9_.-]",
                   cfg->name ? cfg->name : "(null)", COMM_NAME_MAX - 1);
  }
  if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size) {
    return err_set(err, errlen, COMM_EINVAL, "comm_create %s: rank %d is not in a group of size %d", cfg->name,
                   cfg->rank, cfg->size);
  }
  if (cfg->size > 1 && !cfg->store) {
    return err_set(err, errlen, COMM_EINVAL, "comm_create %s: a group of %d ranks needs a store", cfg->name, cfg->size);
  }
  if (!backend) backend = "cpu";
  const comm_entry_t *entry = comm_find(backend);
  if (!entry || !entry->create) {
    if (entry) {
      err_set(err, errlen, 0,
              "comm_create %s: backend %s is not built (%s); use cpu, or staged with a device "
              "backend",
              cfg->name, backend, entry->absent);
    } else {
      char known[256];
      comm_names(known, sizeof known, ", ", ", ");
      err_set(err, errlen, 0, "comm_create %s: unknown backend '%s' (known: %s)", cfg->name, backend, known);
    }
    return COMM_EINVAL;
  }
  comm_t *c = calloc(1, sizeof *c);
  if (!c) {
    return err_set(err, errlen, COMM_ESYSTEM, "comm_create %s: out of memory", cfg->name);
  }
  snprintf(c->name, sizeof c->name, "%s", cfg->name);
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : comm_timeout_ms(0);
  c->mem = entry->mem;
  int rc = entry->create(c, cfg, err, errlen);
  if (rc != COMM_OK) {
    comm_destroy(c);
    return rc;
  }
  fault_from_env(c);
  live_add(c);
  *out = c;
  return COMM_OK;
}

static void async_free(comm_t *c);

/* Counts a call that reaches the backend, arming the fault hook's. */
static void count_call(comm_t *c) {
  c->stats.calls++;
  if (c->fault_at && ++c->fault_calls == c->fault_at) c->fail_next = 1;
}

void comm_destroy(comm_t *c) {
  if (!c) return;
  live_remove(c);
  async_free(c);
  if (c->ops && c->ops->destroy) c->ops->destroy(c);
  free(c);
}

int comm_rank(const comm_t *c) { return c->rank; }
int comm_size(const comm_t *c) { return c->size; }
const char *comm_name(const comm_t *c) { return c->name; }
const char *comm_errmsg(const comm_t *c) { return c ? c->err : "comm: NULL communicator"; }
/* With a progress thread, its copy of the stats as of its last finished call. */
void comm_get_stats(const comm_t *c, comm_stats_t *out) {
  struct comm_async *a = c->async;
  if (a && a->running) {
    pthread_mutex_lock(&a->mu);
    *out = a->pub;
    pthread_mutex_unlock(&a->mu);
  } else {
    *out = c->stats;
  }
  out->wait_ns = c->wait_ns;
}

int comm_set_timeout(comm_t *c, int timeout_ms) {
  if (!c || timeout_ms <= 0) return COMM_EINVAL;
  c->timeout_ms = timeout_ms;
  return COMM_OK;
}

/* Common checks of every collective: a usable communicator, a known dtype the backend
 * supports (cpu, staged and nccl all move and reduce float32 and bfloat16; a backend whose
 * table leaves bf16 at 0 is refused bfloat16), a known op. */
static int check_call(comm_t *c, const char *what, dtype_t dtype, int has_op, comm_op_t op) {
  /* A broken communicator keeps its first message: it names the peer that started it. */
  if (c->broken) {
    return c->broken;
  }
  if (dtype_size(dtype) == 0)
    return comm_set_error(c, COMM_EINVAL, "%s: unknown dtype %d", what, (int)dtype);
  if (dtype != DT_F32 && c->size > 1 && !(c->ops && c->ops->bf16))
    return comm_set_error(c, COMM_EINVAL, "%s: backend %s supports float32 only", what,
                          c->ops ? c->ops->name : "?");
  if (has_op && op != COMM_SUM && op != COMM_AVG && op != COMM_MAX)
    return comm_set_error(c, COMM_EINVAL, "%s: unknown reduction op %d", what, (int)op);
  return COMM_OK;
}

/* ---- the collectives: checked once (prep), then run on the caller's thread, or queued */

static const char *const call_names[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                                         "send", "recv"};

/* all_gather's own part into its slot of the output, when it is not there already; then the
 * input is the slot. Part of the operation: it runs when the operation runs, after whatever was
 * queued before it. */
static int own_slot(comm_t *c, comm_call_t *k) {
  const size_t bytes = k->count * dtype_size(k->dtype);
  char *slot = (char *)k->out + (size_t)c->rank * bytes;
  int rc = (const char *)k->in != slot ? local_copy(c, slot, k->in, bytes) : COMM_OK;
  k->in = slot;
  return rc;
}

/* A send's or receive's peer: another member, and for a ring backend (p2p_ring) the neighbour its
 * links reach. A group of one has no valid peer. */
static int check_peer(comm_t *c, const comm_call_t *k) {
  const char *what = call_names[k->kind];
  const int is_send = k->kind == COMM_CALL_SEND, p = k->peer;
  const char *dir = is_send ? "to" : "from";
  if (p < 0 || p >= c->size)
    return comm_set_error(c, COMM_EINVAL, "%s %s rank %d: peer not in a group of size %d", what, dir, p, c->size);
  if (p == c->rank)
    return comm_set_error(c, COMM_EINVAL, "%s %s rank %d: that is this rank (the peer must be another member)",
                          what, dir, p);
  if (!c->ops->send || !c->ops->recv)
    return comm_set_error(c, COMM_EINVAL, "%s %s rank %d: backend %s has no point-to-point", what, dir, p,
                          c->ops->name);
  const int right = (c->rank + 1) % c->size, left = (c->rank + c->size - 1) % c->size;
  if (c->ops->p2p_ring && p != (is_send ? right : left))
    return comm_set_error(c, COMM_EINVAL, "%s %s rank %d: point-to-point on the %s comm only between ring "
                          "neighbours: send to rank+1 (%d), receive from rank-1 (%d)", what, dir, p,
                          c->ops->name, right, left);
  return COMM_OK;
}

/* Checks call and settles what needs no communication (groups of one, empty buffers, all_gather's
 * own slot): returns a code, with *trivial = 1 when nothing is left for the backend. */
static int prep(comm_t *c, comm_call_t *k, int *trivial) {
  const char *what = call_names[k->kind];
  const int has_op = k->kind == COMM_CALL_ALL_REDUCE || k->kind == COMM_CALL_REDUCE_SCATTER;
  *trivial = 1;
  int rc = check_call(c, what, k->dtype, has_op, k->op);
  if (rc) return rc;
  const size_t esz = dtype_size(k->dtype), n = k->count;
  switch (k->kind) {
  case COMM_CALL_ALL_REDUCE:
    if (n > 0 && !k->out) return comm_set_error(c, COMM_EINVAL, "all_reduce: NULL buffer");
    if (c->size == 1 || n == 0) return COMM_OK; /* sum, avg and max of one value is itself */
    break;
  case COMM_CALL_ALL_GATHER: {
    if (n > 0 && (!k->in || !k->out)) return comm_set_error(c, COMM_EINVAL, "all_gather: NULL buffer");
    if (n == 0) return COMM_OK;
    const char *slot = (const char *)k->out + (size_t)c->rank * n * esz;
    if ((const char *)k->in != slot) {
      const char *i0 = k->in, *i1 = i0 + n * esz, *o0 = k->out, *o1 = o0 + (size_t)c->size * n * esz;
      if (i0 < o1 && o0 < i1)
        return comm_set_error(c, COMM_EINVAL, "all_gather: input overlaps the output but is not "
                              "this rank's slot (out + rank * count)");
    }
    if (c->size == 1) return own_slot(c, k);
    break;
  }
  case COMM_CALL_REDUCE_SCATTER: {
    if (n > 0 && (!k->in || !k->out)) return comm_set_error(c, COMM_EINVAL, "reduce_scatter: NULL buffer");
    if (n == 0) return COMM_OK;
    const char *i0 = k->in, *i1 = i0 + (size_t)c->size * n * esz, *o0 = k->out, *o1 = o0 + n * esz;
    if (i0 < o1 && o0 < i1) return comm_set_error(c, COMM_EINVAL, "reduce_scatter: output overlaps the input");
    if (c->size == 1) return local_copy(c, k->out, k->in, n * esz);
    break;
  }
  case COMM_CALL_BROADCAST:
    if (k->root < 0 || k->root >= c->size)
      return comm_set_error(c, COMM_EINVAL, "broadcast: root %d is not in a group of size %d", k->root, c->size);
    if (n > 0 && !k->out) return comm_set_error(c, COMM_EINVAL, "broadcast: NULL buffer");
    if (c->size == 1 || n == 0) return COMM_OK;
    break;
  case COMM_CALL_BARRIER:
    if (c->size == 1) return COMM_OK;
    break;
  case COMM_CALL_SEND:
  case COMM_CALL_RECV:
    /* The peer first, whatever the count, so that a wrong peer never passes unnoticed; then an
     * empty transfer is done on both sides without a word between them. */
    if ((rc = check_peer(c, k))) return rc;
    if (n > 0 && !(k->kind == COMM_CALL_SEND ? k->in : k->out))
      return comm_set_error(c, COMM_EINVAL, "%s %s rank %d: NULL buffer", what,
                            k->kind == COMM_CALL_SEND ? "to" : "from", k->peer);
    if (n == 0) return COMM_OK;
    break;
  }
  *trivial = 0;
  return COMM_OK;
}

/* What every call does as it reaches the backend (a blocking one, or a start): a communicator
 * broken meanwhile (an earlier queued call failed) fails it without touching its buffers; the
 * call is counted (and the fault hooks fire); all_gather's own part moves into its slot. */
static int enter_backend(comm_t *c, comm_call_t *k) {
  if (c->broken) return c->broken;
  count_call(c);
  if (c->fail_next) return injected(c, call_names[k->kind]);
  return k->kind == COMM_CALL_ALL_GATHER ? own_slot(c, k) : COMM_OK;
}

/* Hands a prepared call to the backend's blocking table, on whichever thread runs it. */
static int exec_call(comm_t *c, const comm_call_t *call) {
  comm_call_t kk = *call, *k = &kk;
  int rc = enter_backend(c, k);
  if (rc) return rc;
  if (c->skip_next) { /* comm_skip_next: done without a byte; the recorder's end says skipped */
    c->skip_next = 0;
    return COMM_SKIPPED;
  }
  switch (k->kind) {
  case COMM_CALL_ALL_REDUCE: return c->ops->all_reduce(c, k->out, k->count, k->dtype, k->op);
  case COMM_CALL_ALL_GATHER: return c->ops->all_gather(c, k->in, k->out, k->count, k->dtype);
  case COMM_CALL_REDUCE_SCATTER: return c->ops->reduce_scatter(c, k->in, k->out, k->count, k->dtype, k->op);
  case COMM_CALL_BROADCAST: return c->ops->broadcast(c, k->out, k->count, k->dtype, k->root);
  case COMM_CALL_BARRIER: return c->ops->barrier(c);
  case COMM_CALL_SEND: return c->ops->send(c, k->in, k->count, k->dtype, k->peer);
  case COMM_CALL_RECV: return c->ops->recv(c, k->out, k->count, k->dtype, k->peer);
  }
  return COMM_EINVAL;
}

/* ---- asynchronous requests
 *
 * A request is queued on its communicator. Backends with native starts (nccl) get it at once
 * and keep a token; "staged" (inline_async) runs it inside the start, except a send, which its
 * native start takes (native_start); "cpu" queues it for the
 * communicator's progress thread, started by the first start, which runs the queue in order
 * with the blocking table. Once that thread exists every call of the communicator goes through
 * it (a blocking call is a start and a wait), so the backend is only ever entered by one thread
 * and in issue order. The thread publishes the stats after each call (comm_get_stats reads that
 * copy); the caller's blocked time (wait_ns) is the caller's own field. */

static comm_observer_fn observer;
void comm_set_observer(comm_observer_fn fn) { observer = fn; }

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Runs one call and returns its result; the bytes it sent go to *sent, and the observer (the
 * trainer's trace) and the flight recorder (its ticket) hear of it. */
static int run_observed(comm_t *c, const comm_call_t *k, uint64_t ticket, uint64_t *sent) {
  uint64_t before = c->stats.bytes_sent;
  int64_t t0 = observer ? now_ns() : 0;
  comm_flight_start(ticket);
  int rc = exec_call(c, k);
  comm_flight_end(c, ticket, rc);
  if (rc == COMM_SKIPPED) rc = COMM_OK;
  *sent = c->stats.bytes_sent - before;
  if (observer) observer(c, COMM_OBSERVE_RUN, call_names[k->kind], *sent, t0, now_ns());
  return rc;
}

static void *progress_main(void *arg) {
  comm_t *c = arg;
  struct comm_async *a = c->async;
  /* The trainer's signal handlers belong to its main thread; the flight recorder's stack signal
   * reaches this one too, so that dumps show where it waits. */
  sigset_t all;
  sigfillset(&all);
  sigdelset(&all, comm_flight_stack_signal());
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  char tname[16];
  snprintf(tname, sizeof tname, "comm %.10s", c->name); /* the kernel keeps 15 characters */
  pthread_setname_np(pthread_self(), tname);
  pthread_mutex_lock(&a->mu);
  for (;;) {
    while (!a->head && !a->stop) pthread_cond_wait(&a->work, &a->mu);
    if (!a->head) break;
    comm_req_t *r = a->head;
    pthread_mutex_unlock(&a->mu);
    uint64_t sent = 0;
    int rc = run_observed(c, &r->call, r->flight, &sent);
    pthread_mutex_lock(&a->mu);
    a->head = r->next;
    if (!a->head) a->tail = NULL;
    r->rc = rc;
    r->sent = sent;
    r->done = 1;
    a->pub = c->stats;
    pthread_cond_broadcast(&a->finished);
  }
  pthread_mutex_unlock(&a->mu);
  return NULL;
}

/* The queue and, for backends without native starts, the progress thread. */
static int async_init(comm_t *c) {
  if (c->async) return COMM_OK;
  struct comm_async *a = calloc(1, sizeof *a);
  if (!a) return comm_set_error(c, COMM_ESYSTEM, "out of memory for asynchronous requests");
  pthread_mutex_init(&a->mu, NULL);
  pthread_cond_init(&a->work, NULL);
  pthread_cond_init(&a->finished, NULL);
  a->pub = c->stats;
  c->async = a;
  if (c->ops->start || c->ops->inline_async) return COMM_OK;
  int e = pthread_create(&a->thread, NULL, progress_main, c);
  if (e) return comm_set_error(c, COMM_ESYSTEM, "cannot start the progress thread: %s", strerror(e));
  a->running = 1;
  return COMM_OK;
}

/* Only between calls (comm.h): nothing is in flight, so the thread is idle. */
void comm_reset_stats(comm_t *c) {
  memset(&c->stats, 0, sizeof c->stats);
  c->wait_ns = 0;
  if (c->async) {
    pthread_mutex_lock(&c->async->mu);
    memset(&c->async->pub, 0, sizeof c->async->pub);
    pthread_mutex_unlock(&c->async->mu);
  }
}

static void async_free(comm_t *c) {
  struct comm_async *a = c->async;
  if (!a) return;
  if (a->running) {
    pthread_mutex_lock(&a->mu);
    a->stop = 1;
    pthread_cond_broadcast(&a->work);
    pthread_mutex_unlock(&a->mu);
    pthread_join(a->thread, NULL); /* runs what is queued first: failing fast if broken */
  }
  pthread_mutex_destroy(&a->mu);
  pthread_cond_destroy(&a->work);
  pthread_cond_destroy(&a->finished);
  free(a);
  c->async = NULL;
}

static void waited(comm_t *c, const comm_call_t *k, int64_t t0) {
  int64_t t1 = now_ns();
  c->wait_ns += (uint64_t)(t1 - t0);
  if (observer) observer(c, COMM_OBSERVE_WAIT, call_names[k->kind], k->count * dtype_size(k->dtype), t0, t1);
}

/* Whether a started call goes to the backend's start: every call of a native backend (nccl), only
 * the sends of an inline one that has a start too (staged: a send must not block its caller,
 * the pipeline's transport contract; comm_impl.h). */
static int native_start(const comm_t *c, const comm_call_t *k) {
  return c->ops->start && (!c->ops->inline_async || k->kind == COMM_CALL_SEND);
}

static int start_call(comm_t *c, comm_call_t k0, comm_req_t **req) {
  if (!c) return COMM_EINVAL;
  if (!req) return comm_set_error(c, COMM_EINVAL, "comm_start: NULL request pointer");
  comm_call_t *k = &k0;
  *req = NULL;
  int trivial;
  int rc = prep(c, k, &trivial);
  if (rc) return rc;
  comm_req_t *r = calloc(1, sizeof *r);
  if (!r) return comm_set_error(c, COMM_ESYSTEM, "out of memory for a request");
  r->c = c;
  r->call = *k;
  *req = r;
  if (trivial) {
    r->done = 1;
    return COMM_OK;
  }
  if ((rc = async_init(c))) {
    *req = NULL;
    free(r);
    return rc;
  }
  r->flight = comm_flight_issue(c, k);
  if (native_start(c, k)) {
    uint64_t before = c->stats.bytes_sent;
    if (!(r->rc = enter_backend(c, k))) r->rc = c->ops->start(c, k, &r->token);
    r->sent = c->stats.bytes_sent - before;
    if (r->rc) {
      r->done = 1;
      comm_flight_end(c, r->flight, r->rc);
    } else {
      comm_flight_start(r->flight);
    }
  } else if (c->ops->inline_async) {
    r->rc = run_observed(c, k, r->flight, &r->sent);
    r->done = 1;
  } else {
    struct comm_async *a = c->async;
    pthread_mutex_lock(&a->mu);
    if (a->tail) a->tail->next = r;
    else a->head = r;
    a->tail = r;
    pthread_cond_signal(&a->work);
    pthread_mutex_unlock(&a->mu);
  }
  return COMM_OK;
}

int comm_wait(comm_req_t *r, uint64_t *sent) {
  if (sent) *sent = 0;
  if (!r) return COMM_OK;
  comm_t *c = r->c;
  int64_t t0 = now_ns();
  if (!r->done && native_start(c, &r->call)) {
    uint64_t before = c->stats.bytes_sent; /* a native backend may count its bytes at the wait */
    r->rc = c->ops->wait(c, r->token);
    r->sent += c->stats.bytes_sent - before;
    r->done = 1;
    comm_flight_end(c, r->flight, r->rc);
  } else if (!r->done) {
    struct comm_async *a = c->async;
    pthread_mutex_lock(&a->mu);
    while (!r->done) pthread_cond_wait(&a->finished, &a->mu);
    pthread_mutex_unlock(&a->mu);
  }
  waited(c, &r->call, t0);
  int rc = r->rc;
  if (sent) *sent = r->sent;
  free(r);
  return rc;
}

int comm_test(comm_req_t *r, int *done) {
  *done = 1;
  if (!r) return COMM_OK;
  if (!r->done && native_start(r->c, &r->call)) return r->c->ops->test(r->c, r->token, done);
  struct comm_async *a = r->c->async;
  if (a) pthread_mutex_lock(&a->mu);
  *done = r->done;
  if (a) pthread_mutex_unlock(&a->mu);
  return COMM_OK;
}


/* A blocking call: on the caller's thread until a progress thread exists, then through it. */
static int call(comm_t *c, comm_call_t k) {
  if (!c) return COMM_EINVAL;
  if (c->async && c->async->running) {
    comm_req_t *r;
    int rc = start_call(c, k, &r);
    return rc ? rc : comm_wait(r, NULL);
  }
  int trivial;
  int rc = prep(c, &k, &trivial);
  if (rc || trivial) return rc;
  uint64_t sent;
  int64_t t0 = now_ns();
  rc = run_observed(c, &k, comm_flight_issue(c, &k), &sent);
  waited(c, &k, t0);
  return rc;
}

int comm_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op) {
  return call(c, (comm_call_t){.kind = COMM_CALL_ALL_REDUCE, .out = buf, .count = count, .dtype = dtype, .op = op});
}
int comm_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype) {
  return call(c, (comm_call_t){.kind = COMM_CALL_ALL_GATHER, .in = in, .out = out, .count = count, .dtype = dtype});
}
int comm_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype, comm_op_t op) {
  return call(c, (comm_call_t){.kind = COMM_CALL_REDUCE_SCATTER, .in = in, .out = out, .count = count,
                               .dtype = dtype, .op = op});
}
int comm_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root) {
  return call(c, (comm_call_t){.kind = COMM_CALL_BROADCAST, .out = buf, .count = count, .dtype = dtype, .root = root});
}
int comm_barrier(comm_t *c) { return call(c, (comm_call_t){.kind = COMM_CALL_BARRIER}); }

int comm_start_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op, comm_req_t **req) {
  return start_call(c, (comm_call_t){.kind = COMM_CALL_ALL_REDUCE, .out = buf, .count = count, .dtype = dtype, .op = op},
                    req);
}
int comm_start_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype, comm_req_t **req) {
  return start_call(c, (comm_call_t){.kind = COMM_CALL_ALL_GATHER, .in = in, .out = out, .count = count, .dtype = dtype},
                    req);
}
int comm_start_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype, comm_op_t op,
                              comm_req_t **req) {
  return start_call(c, (comm_call_t){.kind = COMM_CALL_REDUCE_SCATTER, .in = in, .out = out, .count = count,
                                     .dtype = dtype, .op = op}, req);
}
int comm_start_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root, comm_req_t **req) {
  return start_call(c, (comm_call_t){.kind = COMM_CALL_BROADCAST, .out = buf, .count = count, .dtype = dtype,
                                     .root = root}, req);
}

int comm_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer) {
  return call(c, (comm_call_t){.kind = COMM_CALL_SEND, .in = buf, .count = count, .dtype = dtype, .peer = peer});
}
int comm_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer) {
  return call(c, (comm_call_t){.kind = COMM_CALL_RECV, .out = buf, .count = count, .dtype = dtype, .peer = peer});
}
int comm_start_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer, comm_req_t **req) {
  return start_call(c, (comm_call_t){.kind = COMM_CALL_SEND, .in = buf, .count = count, .dtype = dtype,
                                     .peer = peer}, req);
}
int comm_start_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer, comm_req_t **req) {
  return start_call(c, (comm_call_t){.kind = COMM_CALL_RECV, .out = buf, .count = count, .dtype = dtype,
                                     .peer = peer}, req);
}
