/* trace: Chrome trace events of the first steps (see trace.h).
 *
 * Events are formatted into a buffer under a lock and written with one write() at each step's
 * end. Timestamps are microseconds of CLOCK_MONOTONIC, which all ranks of one machine share, so
 * their tracks line up; across machines each file has its own clock. Communicators get a track
 * (tid) each the first time one of their collectives is seen, named by a thread_name metadata
 * event. */
#include "trainer/comm/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "trainer/comm/comm.h"

#define MAX_TRACKS 32

static struct {
  int fd;
  int rank, steps;
  char path[4096]; /* a rank other than 0 opens it at trace_attach */
  volatile int step; /* being traced, 0 outside */
  pthread_mutex_t mu;
  char *buf;
  size_t len, cap;
  const comm_t *track[MAX_TRACKS]; /* tid i + 1 */
  int n_tracks;
} tr = {.fd = -1, .mu = PTHREAD_MUTEX_INITIALIZER};

int64_t trace_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int trace_active(void) { return tr.step != 0; }

/* Appends one formatted event line; the lock is held. Out of memory drops the event. */
static void add(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void add(const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tr.buf + tr.len, tr.cap - tr.len, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (tr.len + (size_t)n < tr.cap) {
      tr.len += (size_t)n;
      return;
    }
    size_t cap = tr.cap ? 2 * tr.cap : 1 << 16;
    while (cap <= tr.len + (size_t)n) cap *= 2;
    char *b = realloc(tr.buf, cap);
    if (!b) return;
    tr.buf = b;
    tr.cap = cap;
  }
}

static void flush_locked(void) {
  if (tr.fd < 0) return; /* not attached yet: kept until trace_attach */
  size_t off = 0;
  while (off < tr.len) {
    ssize_t k = write(tr.fd, tr.buf + off, tr.len - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break; /* a full disk loses the trace, never the run */
    off += (size_t)k;
  }
  tr.len = 0;
}

/* Names are ours (unit numbers, op and group names): nothing to escape. */
static void span_locked(const char *name, const char *cat, int tid, int64_t t0, int64_t t1, uint64_t bytes) {
  add("{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
      "\"args\":{\"step\":%d",
      name, cat, tr.rank, tid, (double)t0 / 1e3, (double)(t1 - t0) / 1e3, tr.step);
  if (bytes) add(",\"bytes\":%llu", (unsigned long long)bytes);
  add("}},\n");
}

static int track_of(const comm_t *c) {
  for (int i = 0; i < tr.n_tracks; i++)
    if (tr.track[i] == c) return i + 1;
  if (tr.n_tracks == MAX_TRACKS) return MAX_TRACKS;
  tr.track[tr.n_tracks++] = c;
  add("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"comm %s\"}},\n", tr.rank,
      tr.n_tracks, comm_name(c));
  return tr.n_tracks;
}

static void observe(const comm_t *c, int what, const char *op, uint64_t bytes, int64_t t0, int64_t t1) {
  if (!tr.step) return;
  char name[COMM_NAME_MAX + 48];
  pthread_mutex_lock(&tr.mu);
  if (tr.step) {
    if (what == COMM_OBSERVE_RUN) {
      snprintf(name, sizeof name, "%s %s", op, comm_name(c));
      span_locked(name, "comm", track_of(c), t0, t1, bytes);
    } else {
      snprintf(name, sizeof name, "wait %s %s", op, comm_name(c));
      span_locked(name, "wait", 0, t0, t1, bytes);
    }
  }
  pthread_mutex_unlock(&tr.mu);
}

int trace_open(const char *path, int rank, int steps, char *err, size_t errlen) {
  if (!path || !*path) return 0;
  if (strlen(path) >= sizeof tr.path) {
    return err_set(err, errlen, TRACE_EIO, "log.trace_file %.64s...: path too long", path);
  }
  snprintf(tr.path, sizeof tr.path, "%s", path);
  if (rank == 0 && (tr.fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_TRUNC, 0644)) < 0) {
    return err_set(err, errlen, TRACE_EIO, "cannot open log.trace_file %s: %s", path, strerror(errno));
  }
  tr.rank = rank;
  tr.steps = steps;
  pthread_mutex_lock(&tr.mu);
  if (rank == 0) add("[\n");
  add("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}},\n", rank, rank);
  add("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"compute\"}},\n", rank);
  flush_locked();
  pthread_mutex_unlock(&tr.mu);
  comm_set_observer(observe);
  return 0;
}

int trace_attach(char *err, size_t errlen) {
  if (!tr.path[0] || tr.fd >= 0) return 0;
  if ((tr.fd = open(tr.path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0) {
    return err_set(err, errlen, TRACE_EIO, "cannot open log.trace_file %s: %s", tr.path, strerror(errno));
  }
  pthread_mutex_lock(&tr.mu);
  flush_locked();
  pthread_mutex_unlock(&tr.mu);
  return 0;
}

void trace_close(void) {
  pthread_mutex_lock(&tr.mu);
  tr.step = 0;
  flush_locked();
  if (tr.fd >= 0) close(tr.fd);
  tr.fd = -1;
  tr.path[0] = 0;
  free(tr.buf);
  tr.buf = NULL;
  tr.len = tr.cap = 0;
  pthread_mutex_unlock(&tr.mu);
}

static int64_t step_t0;

void trace_step_begin(int step) {
  if (tr.fd < 0 || step > tr.steps) return;
  pthread_mutex_lock(&tr.mu);
  tr.step = step;
  pthread_mutex_unlock(&tr.mu);
  step_t0 = trace_now_ns();
}

void trace_step_end(void) {
  if (!tr.step) return;
  int64_t t1 = trace_now_ns();
  char name[32];
  pthread_mutex_lock(&tr.mu);
  snprintf(name, sizeof name, "step %d", tr.step);
  span_locked(name, "step", 0, step_t0, t1, 0);
  tr.step = 0;
  flush_locked();
  pthread_mutex_unlock(&tr.mu);
}

void trace_span(const char *name, const char *cat, int64_t t0, int64_t t1) {
  if (!tr.step) return;
  pthread_mutex_lock(&tr.mu);
  if (tr.step) span_locked(name, cat, 0, t0, t1, 0);
  pthread_mutex_unlock(&tr.mu);
}
