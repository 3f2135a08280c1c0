/* comm_flight: the flight recorder of the comm dispatch and its dumps (see comm.h, "the flight
 * recorder"). The dispatch's second file: it sees communicators through comm_impl.h.
 *
 * The ring. One array of records per process and one atomic counter of calls issued: a call
 * takes the next ticket (counter + 1) and owns slot (ticket - 1) % size until a later call wraps
 * around to it. A record is written like a seqlock: its ticket is zeroed, the fields are written,
 * then the ticket is published (release); a reader copies the record and keeps it only if the
 * ticket was non-zero and the same before and after. Later updates (started, done) check that
 * the slot still holds their ticket and publish the state last. So the hot path takes no lock:
 * one atomic increment, a clock read per state and a few stores (the benchmark measures it,
 * bench/bench_flight.py). Threads: the calling thread issues, whichever thread runs the call
 * (the caller, a progress thread) starts and ends it; several communicators record at once.
 *
 * A dump runs on an ordinary thread (never in a signal handler): the one that saw a timeout,
 * the recorder's own SIGUSR1 thread, or comm_dump's caller, one at a time (dump_mu). Stacks of
 * other threads: the dumping thread lists /proc/self/task, sends each thread that does not block
 * it the stack signal with tgkill, and waits up to a second for that thread's handler to take
 * its backtrace into a shared slot (the handler claims the slot with a compare-and-swap on the
 * thread id, so that an answer after the deadline writes nothing) and post a semaphore. The
 * dumping thread takes its own backtrace directly. backtrace() is not on POSIX's list of
 * async-signal-safe calls; glibc's walks the frames without locking once libgcc's unwinder is
 * loaded, which the install does by taking one backtrace first. */
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h"

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/dump.h"
#include "common/env.h"
#include "common/err.h"
#include "common/fs.h"
#include "common/log.h"

enum { ST_ISSUED = 0, ST_STARTED, ST_DONE, ST_FAILED, ST_SKIPPED };
static const char *const state_names[] = {"issued", "started", "done", "failed", "skipped"};
static const char *const kind_names[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                                         "send", "recv"};

typedef struct {
  _Atomic uint64_t ticket; /* the call's, 0 while being written */
  _Atomic int state;
  int rc;                  /* of a failed call */
  uint64_t seq, bytes;
  int64_t t_issue, t_start, t_end; /* CLOCK_MONOTONIC ns; 0: not yet */
  int kind, dtype, op, peer, root; /* peer: send/recv; root: broadcast; else -1 */
  const char *backend;     /* its table's name (static): a staged communicator's inner ring has its name */
  char comm[COMM_NAME_MAX];
} rec_t;

static struct {
  rec_t *ring;
  uint32_t size; /* 0: off */
  int set;       /* comm_flight_setup ran */
  _Atomic uint64_t issued;
  atomic_int timed_out; /* the first timeout's dump was written */
  _Atomic unsigned dumps; /* files written by this process, for their names */
} fl;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int comm_flight_records(int configured) {
  int n;
  env_int("MESHRUN_COMM_FLIGHT_RECORDS", 0, COMM_FLIGHT_MAX, configured, &n);
  return n;
}

int comm_flight_setup(int records, char *err, size_t errlen) {
  if (records < 0 || records > COMM_FLIGHT_MAX)
    return err_set(err, errlen, COMM_EINVAL, "comm flight recorder: %d records is not in [0, %d]", records,
                   COMM_FLIGHT_MAX);
  rec_t *ring = records ? calloc((size_t)records, sizeof *ring) : NULL;
  if (records && !ring)
    return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: out of memory for %d records", records);
  free(fl.ring);
  fl.ring = ring;
  fl.size = (uint32_t)records;
  fl.set = 1;
  atomic_store(&fl.issued, 0);
  return COMM_OK;
}

/* comm_create's: the default size unless comm_flight_setup ran (the trainer's plan key). */
static void setup_default(void) {
  if (!fl.set) comm_flight_setup(comm_flight_records(COMM_FLIGHT_DEFAULT), NULL, 0);
}

/* The record a ticket owns, or NULL when recording is off or the slot holds a later call. */
static rec_t *owned(uint64_t ticket) {
  if (!ticket || !fl.size) return NULL;
  rec_t *r = &fl.ring[(ticket - 1) % fl.size];
  return atomic_load_explicit(&r->ticket, memory_order_acquire) == ticket ? r : NULL;
}

uint64_t comm_flight_issue(comm_t *c, const comm_call_t *k) {
  if (!fl.set) setup_default();
  const uint64_t seq = atomic_load_explicit(&c->flight_issued, memory_order_relaxed) + 1;
  atomic_store_explicit(&c->flight_issued, seq, memory_order_relaxed);
  if (!fl.size) return 0;
  const uint64_t ticket = atomic_fetch_add_explicit(&fl.issued, 1, memory_order_relaxed) + 1;
  rec_t *r = &fl.ring[(ticket - 1) % fl.size];
  atomic_store_explicit(&r->ticket, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  r->seq = seq;
  r->kind = (int)k->kind;
  r->dtype = (int)k->dtype;
  r->op = k->kind == COMM_CALL_ALL_REDUCE || k->kind == COMM_CALL_REDUCE_SCATTER ? (int)k->op : -1;
  r->peer = k->kind == COMM_CALL_SEND || k->kind == COMM_CALL_RECV ? k->peer : -1;
  r->root = k->kind == COMM_CALL_BROADCAST ? k->root : -1;
  r->bytes = (uint64_t)k->count * dtype_size(k->dtype);
  r->rc = 0;
  r->t_issue = now_ns();
  r->t_start = r->t_end = 0;
  r->backend = c->ops ? c->ops->name : "?";
  memcpy(r->comm, c->name, sizeof r->comm);
  atomic_store_explicit(&r->state, ST_ISSUED, memory_order_relaxed);
  atomic_store_explicit(&r->ticket, ticket, memory_order_release);
  return ticket;
}

void comm_flight_start(uint64_t ticket) {
  rec_t *r = owned(ticket);
  if (!r) return;
  r->t_start = now_ns();
  atomic_store_explicit(&r->state, ST_STARTED, memory_order_release);
}

static int dump_locked(const char *reason, const comm_t *c, const rec_t *why, char *path, size_t pathlen,
                       char *err, size_t errlen);
static pthread_mutex_t dump_mu = PTHREAD_MUTEX_INITIALIZER;

void comm_flight_end(comm_t *c, uint64_t ticket, int rc) {
  rec_t *r = owned(ticket);
  if (r) {
    r->rc = rc;
    r->t_end = now_ns();
    atomic_store_explicit(&r->state, rc == COMM_SKIPPED ? ST_SKIPPED : rc ? ST_FAILED : ST_DONE, memory_order_release);
  }
  if (!rc || rc == COMM_SKIPPED) {
    /* Calls of one communicator end in issue order, so its last completed one is the newest. */
    if (r) atomic_store_explicit(&c->flight_done, r->seq, memory_order_relaxed);
    else atomic_fetch_add_explicit(&c->flight_done, 1, memory_order_relaxed);
    return;
  }
  if (rc != COMM_ETIMEDOUT || atomic_exchange(&fl.timed_out, 1)) return;
  rec_t copy, *rp = NULL;
  if (r) {
    memcpy(&copy, r, sizeof copy); /* this thread's own call: nothing else writes it now */
    rp = &copy;
  }
  char err[256];
  pthread_mutex_lock(&dump_mu);
  if (dump_locked("timeout", c, rp, NULL, 0, err, sizeof err)) log_warn("%s", err);
  pthread_mutex_unlock(&dump_mu);
}

/* ---- writing a dump */

/* s as the inside of a JSON string. */
static void json_str(FILE *f, const char *s) {
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
    else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
    else fputc(ch, f);
  }
}

static void put_rec(FILE *f, const rec_t *r) {
  int st = atomic_load_explicit(&r->state, memory_order_acquire);
  fprintf(f, "{\"type\":\"op\",\"comm\":\"");
  json_str(f, r->comm);
  fprintf(f, "\",\"backend\":\"%s\",\"seq\":%llu,\"op\":\"%s\",\"dtype\":\"%s\",\"reduce\":%s%s%s,\"bytes\":%llu,\"peer\":%d,"
          "\"root\":%d,\"state\":\"%s\",\"t_issue_ns\":%lld,\"t_start_ns\":%lld,\"t_end_ns\":%lld",
          r->backend, (unsigned long long)r->seq, kind_names[r->kind], dtype_name((dtype_t)r->dtype), r->op < 0 ? "" : "\"",
          r->op < 0 ? "null" : comm_op_name((comm_op_t)r->op), r->op < 0 ? "" : "\"", (unsigned long long)r->bytes,
          r->peer, r->root, state_names[st], (long long)r->t_issue, (long long)r->t_start, (long long)r->t_end);
  if (st == ST_FAILED) fprintf(f, ",\"error\":\"%s\"", comm_strerror(r->rc));
  fprintf(f, "}\n");
}

/* The ring, oldest first; records being rewritten while read are left out. */
static void put_ring(FILE *f) {
  const uint64_t last = atomic_load(&fl.issued);
  const uint64_t first = last > fl.size ? last - fl.size + 1 : 1;
  for (uint64_t t = first; fl.size && t <= last; t++) {
    const rec_t *r = &fl.ring[(t - 1) % fl.size];
    rec_t copy;
    uint64_t a = atomic_load_explicit(&r->ticket, memory_order_acquire);
    memcpy(&copy, r, sizeof copy);
    atomic_thread_fence(memory_order_acquire);
    if (a != t || atomic_load_explicit(&r->ticket, memory_order_relaxed) != a) continue;
    put_rec(f, &copy);
  }
}

typedef struct {
  FILE *f;
  int n;
} comm_list_t;

static void put_comm(const comm_t *c, void *arg) {
  comm_list_t *l = arg;
  fprintf(l->f, "%s{\"name\":\"", l->n++ ? "," : "");
  json_str(l->f, c->name);
  fprintf(l->f, "\",\"backend\":\"%s\",\"rank\":%d,\"size\":%d,\"issued\":%llu,\"done\":%llu%s}",
          c->ops ? c->ops->name : "?", c->rank, c->size, (unsigned long long)atomic_load(&c->flight_issued),
          (unsigned long long)atomic_load(&c->flight_done), c->broken ? ",\"broken\":true" : "");
}

static void put_header(FILE *f, const char *reason, const comm_t *c, const rec_t *why, int rank) {
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  fprintf(f, "{\"type\":\"header\",\"reason\":\"");
  json_str(f, reason);
  fprintf(f, "\",\"rank\":%d,\"host\":\"", rank);
  json_str(f, host);
  fprintf(f, "\",\"pid\":%d,\"now_ns\":%lld,\"unix_time\":%.3f,\"records\":%u,\"issued\":%llu", (int)getpid(),
          (long long)now_ns(), wall.tv_sec + wall.tv_nsec * 1e-9, fl.size,
          (unsigned long long)atomic_load(&fl.issued));
  if (c) {
    fprintf(f, ",\"failed\":{\"comm\":\"");
    json_str(f, c->name);
    fprintf(f, "\",\"seq\":%llu,\"op\":\"%s\"}", why ? (unsigned long long)why->seq : 0ULL,
            why ? kind_names[why->kind] : "?");
  }
  fprintf(f, ",\"comms\":[");
  comm_list_t l = {.f = f};
  comm_live_each(put_comm, &l);
  fprintf(f, "]}\n");
}

/* The dump folder (comm.h, common/dump.h), made if missing; 0 or -errno. */
static int dump_dir(char *dir, size_t len) {
  int rc = dump_folder(env_str("TORCHELASTIC_ERROR_FILE"), dir, len);
  return rc ? rc : fs_mkdir_p(dir, NULL, 0);
}

static void put_stacks(FILE *f);

static int dump_locked(const char *reason, const comm_t *c, const rec_t *why, char *path, size_t pathlen,
                       char *err, size_t errlen) {
  char dir[2048], file[2300], tmp[2310];
  int rank, rc = dump_dir(dir, sizeof dir);
  if (rc) return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: dump folder %s: %s", dir, strerror(-rc));
  env_int("RANK", 0, 1 << 30, 0, &rank);
  snprintf(file, sizeof file, "%s/flight-rank%d-pid%d-%u.jsonl", dir, rank, (int)getpid(),
           atomic_fetch_add(&fl.dumps, 1) + 1);
  snprintf(tmp, sizeof tmp, "%s.tmp", file); /* renamed when whole: a reader never sees half a dump */
  FILE *f = fopen(tmp, "we");
  if (!f) return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: cannot write %s: %s", tmp, strerror(errno));
  put_header(f, reason, c, why, rank);
  put_ring(f);
  put_stacks(f);
  if (fclose(f) || rename(tmp, file)) {
    rc = err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: writing %s: %s", file, strerror(errno));
    unlink(tmp);
    return rc;
  }
  if (path) snprintf(path, pathlen, "%s", file);
  if (c)
    log_warn("comm flight recorder: %s in comm %s call %llu (%s): dump in %s", reason, c->name,
             why ? (unsigned long long)why->seq : 0ULL, why ? kind_names[why->kind] : "?", file);
  else
    log_warn("comm flight recorder: %s: dump in %s", reason, file);
  return COMM_OK;
}

int comm_dump(const char *reason, char *path, size_t pathlen, char *err, size_t errlen) {
  pthread_mutex_lock(&dump_mu);
  int rc = dump_locked(reason && *reason ? reason : "request", NULL, NULL, path, pathlen, err, errlen);
  pthread_mutex_unlock(&dump_mu);
  return rc;
}

/* ---- stacks */

#define MAX_FRAMES 64
static struct {
  atomic_int want; /* the thread id asked for its stack; 0: none */
  void *frames[MAX_FRAMES];
  int n;
  sem_t done;
  int ready; /* the handler is installed and the semaphore made */
} cap;

int comm_flight_stack_signal(void) { return SIGRTMIN + 4; }

static void on_stack_signal(int sig) {
  int saved = errno;
  int me = (int)gettid(), expect = me;
  void *frames[MAX_FRAMES];
  if (atomic_load(&cap.want) == me) {
    int n = backtrace(frames, MAX_FRAMES);
    if (atomic_compare_exchange_strong(&cap.want, &expect, -me)) {
      memcpy(cap.frames, frames, sizeof(void *) * (size_t)n);
      cap.n = n;
      sem_post(&cap.done);
    }
  }
  errno = saved;
}

static int install_stack_signal(char *err, size_t errlen) {
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&mu);
  if (!cap.ready) {
    void *warm[2];
    backtrace(warm, 2); /* loads the unwinder now, not in a handler */
    sem_init(&cap.done, 0, 0);
    struct sigaction sa = {.sa_handler = on_stack_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    if (sigaction(comm_flight_stack_signal(), &sa, NULL)) {
      pthread_mutex_unlock(&mu);
      return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: sigaction: %s", strerror(errno));
    }
    cap.ready = 1;
  }
  pthread_mutex_unlock(&mu);
  return COMM_OK;
}

/* Whether thread tid blocks sig (its SigBlk line in /proc). */
static int blocks(int tid, int sig) {
  char p[64], line[256];
  snprintf(p, sizeof p, "/proc/self/task/%d/status", tid);
  FILE *f = fopen(p, "re");
  unsigned long long mask = 0;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "SigBlk: %llx", &mask) == 1) break;
  if (f) fclose(f);
  return (int)((mask >> (sig - 1)) & 1);
}

/* Another thread's frames into cap.frames: 1, or 0 with why. */
static int ask_stack(int tid, const char **why) {
  const int sig = comm_flight_stack_signal();
  if (!cap.ready) return *why = "the stack signal is not installed", 0;
  if (blocks(tid, sig)) return *why = "the thread blocks the stack signal", 0;
  while (sem_trywait(&cap.done) == 0) {
  }
  atomic_store(&cap.want, tid);
  if (syscall(SYS_tgkill, getpid(), tid, sig)) {
    atomic_store(&cap.want, 0);
    return *why = "the thread is gone", 0;
  }
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 1;
  while (sem_timedwait(&cap.done, &dl) != 0) {
    if (errno == EINTR) continue;
    int expect = tid;
    if (atomic_compare_exchange_strong(&cap.want, &expect, 0))
      return *why = "no answer within 1 s (in the kernel with signals held off?)", 0;
    sem_wait(&cap.done); /* the handler claimed the slot just now: it is about to post */
    break;
  }
  atomic_store(&cap.want, 0);
  return 1;
}

static void put_stack(FILE *f, int tid, int self) {
  char p[64], name[64] = "";
  snprintf(p, sizeof p, "/proc/self/task/%d/comm", tid);
  FILE *nf = fopen(p, "re");
  if (nf && fgets(name, sizeof name, nf)) name[strcspn(name, "\n")] = 0;
  if (nf) fclose(nf);
  const char *why = NULL;
  void *frames[MAX_FRAMES];
  int n = 0;
  if (self) {
    n = backtrace(frames, MAX_FRAMES);
  } else if (ask_stack(tid, &why)) {
    n = cap.n;
    memcpy(frames, cap.frames, sizeof(void *) * (size_t)n);
  }
  char **sym = n ? backtrace_symbols(frames, n) : NULL;
  fprintf(f, "{\"type\":\"stack\",\"tid\":%d,\"name\":\"", tid);
  json_str(f, name);
  fprintf(f, "\",\"main\":%s,\"dumping\":%s,\"frames\":[", tid == getpid() ? "true" : "false", self ? "true" : "false");
  for (int i = 0; i < n; i++) {
    fprintf(f, "%s\"", i ? "," : "");
    if (sym) json_str(f, sym[i]);
    else fprintf(f, "%p", frames[i]);
    fprintf(f, "\"");
  }
  fprintf(f, "]");
  if (why) {
    fprintf(f, ",\"missing\":\"");
    json_str(f, why);
    fprintf(f, "\"");
  }
  fprintf(f, "}\n");
  free(sym);
}

static void put_stacks(FILE *f) {
  install_stack_signal(NULL, 0); /* a dump before comm_dump_on_signal (a timeout) asks all the same */
  DIR *d = opendir("/proc/self/task");
  const int me = (int)gettid();
  put_stack(f, me, 1);
  for (struct dirent *e; d && (e = readdir(d));) {
    int tid = atoi(e->d_name);
    if (tid > 0 && tid != me) put_stack(f, tid, 0);
  }
  if (d) closedir(d);
}

/* ---- SIGUSR1 */

static int sig_pipe[2] = {-1, -1};

/* One byte to the recorder's thread: 1 a dump on SIGUSR1, 2 meshrun's request. */
static void ask_thread(char b) {
  if (sig_pipe[1] < 0) return;
  int saved = errno;
  ssize_t w = write(sig_pipe[1], &b, 1); /* a full pipe already has a dump coming */
  (void)w;
  errno = saved;
}

void comm_dump_request(void) { ask_thread(1); }

static void on_sigusr1(int sig) { ask_thread(1); }

/* meshrun's dump signal (common/dump.h). */
static void on_dump_signal(int sig) { ask_thread(2); }

static void *signal_thread(void *arg) {
  sigset_t all;
  sigfillset(&all);
  sigdelset(&all, comm_flight_stack_signal());
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  for (;;) {
    char b[64], err[256];
    ssize_t n = read(sig_pipe[0], b, sizeof b);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return NULL;
    /* One dump for the bytes read together; meshrun's request (byte 2) names itself. */
    const char *reason = memchr(b, 2, (size_t)n) ? "meshrun" : "signal";
    if (comm_dump(reason, NULL, 0, err, sizeof err)) log_warn("%s", err);
  }
}

int comm_dump_on_signal(char *err, size_t errlen) {
  int rc = install_stack_signal(err, errlen);
  if (rc || sig_pipe[0] >= 0) return rc;
  if (pipe2(sig_pipe, O_CLOEXEC)) return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: pipe: %s", strerror(errno));
  fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
  pthread_t t;
  int e = pthread_create(&t, NULL, signal_thread, NULL);
  if (e) return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: thread: %s", strerror(e));
  pthread_detach(t);
  pthread_setname_np(t, "comm dump");
  struct sigaction sa = {.sa_handler = on_sigusr1, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  struct sigaction sd = {.sa_handler = on_dump_signal, .sa_flags = SA_RESTART};
  sigemptyset(&sd.sa_mask);
  if (sigaction(SIGUSR1, &sa, NULL) || sigaction(dump_signal(), &sd, NULL))
    return err_set(err, errlen, COMM_ESYSTEM, "comm flight recorder: sigaction: %s", strerror(errno));
  return COMM_OK;
}
