/* workers: fork/exec of one round's workers, their output, their exits, their stop.
 *
 * Order inside the child, between fork and exec (only async-signal-safe calls: the parent has
 * threads): own process group first, so that a signal to the group never reaches meshrun;
 * then PR_SET_PDEATHSIG=SIGKILL and a getppid() check (if meshrun died before the prctl, the
 * child was already reparented and exits); then default dispositions for the signals meshrun
 * handles or ignores (RESET_SIGNALS) and an empty mask (ignored signals and masks survive exec;
 * the parent forks with every signal blocked, so none reaches an inherited handler before
 * this); then the fds; then execve of the path that workers_find_program resolved once in the
 * parent. An exec failure is reported through a CLOEXEC pipe, so workers_start can name the
 * cause.
 * Environment and argv are built before fork, since the child must not allocate. */
#include "launcher/workers.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/store.h"
#include "launcher/console.h"
#include "launcher/tree.h"

extern char **environ;

#define LINE_MAX_BYTES 65536
/* After the last worker of a round is reaped and what it started killed, how long its output
 * pipes may stay open (held by a process outside meshrun's tree) before they are closed. */
#define DRAIN_MS 2000
/* The last bytes of each worker's stderr that meshrun keeps, for the verdict on its failure
 * (a Python worker's last line names an exception that no restart cures). */
#define TAIL_BYTES WORKERS_TAIL_BYTES

typedef struct worker worker_t;

typedef struct {
  worker_t *owner;
  uv_pipe_t pipe;
  int is_err;    /* stderr (else stdout) */
  int open;      /* pipe handle initialized and not yet closed */
  int console;   /* lines go to meshrun's stdout/stderr */
  int raw;       /* console bytes go on as they come (no prefix: partial lines and \r stay) */
  int file_fd;   /* copy to this file, -1 none */
  char *line;    /* partial line, LINE_MAX_BYTES */
  size_t len;
  char *tail;       /* stderr: a ring of its last TAIL_BYTES, NULL for stdout */
  size_t tail_seen; /* bytes that went through the ring */
} stream_t;

struct worker {
  workers_t *owner;
  workers_info_t info;
  stream_t out, err;
  int group_alive; /* the process group may still hold processes: kill it on exit paths */
  char *err_log;   /* the stderr.log the child writes itself (no pipe), for its tail; else NULL */
};

struct workers {
  uv_loop_t *loop;
  const launcher_opts_t *opts;
  workers_exit_cb on_exit;
  workers_idle_cb on_idle;
  void *arg;
  uv_signal_t sigchld;
  uv_timer_t tick, grace;
  worker_t *ws;
  int n;
  int running;
  int open_pipes; /* pipe handles not yet closed (close callback done) */
  int prefix;     /* world > 1: "[rank<R>]:" before each console line */
  int stopping;
  int draining; /* every worker reaped; pipes closing (see reap) */
  int idle_reported;
  int tree_left; /* every worker is reaped but what they started still runs: killed, not yet gone */
  uint64_t tree_kill_time; /* uv_hrtime of its first SIGKILL */
  tree_t *tree;  /* the workers' process trees (launcher/tree) */
  /* --merge_output: this round's merged console lines, [0] stdout and [1] stderr (NULL: each
   * line goes out at once), the timer for the oldest waiting one and when it is armed for. */
  console_t *console[2];
  uv_timer_t merge_timer;
  uint64_t merge_due;
  uint64_t merge_window_ns; /* CONSOLE_WINDOW_MS, or MESHRUN_MERGE_WINDOW_MS */
  char program[PATH_MAX];   /* what the workers exec'd, as found along PATH */
  char stop_file[PATH_MAX]; /* MESHRUN_STOP_FILE of this round's workers (workers_stop writes it) */
};

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The merge window: MESHRUN_MERGE_WINDOW_MS (milliseconds, 0..60000) or CONSOLE_WINDOW_MS. */
static uint64_t merge_window_ns(void) {
  const char *v = getenv("MESHRUN_MERGE_WINDOW_MS");
  char *end = NULL;
  double ms = v && *v ? strtod(v, &end) : CONSOLE_WINDOW_MS;
  if (v && *v && (*end || !(ms >= 0 && ms <= 60000))) {
    log_warn("MESHRUN_MERGE_WINDOW_MS=%s is not valid (expected milliseconds, 0..60000): using %d", v,
             CONSOLE_WINDOW_MS);
    ms = CONSOLE_WINDOW_MS;
  }
  return (uint64_t)(ms * 1e6);
}

static int mkdir_p(const char *path, char *err, size_t errlen) {
  char failed[PATH_MAX];
  int rc = fs_mkdir_p(path, failed, sizeof failed);
  if (rc) err_set(err, errlen, 0, "mkdir %s: %s", failed, strerror(-rc));
  return rc;
}

static void check_idle(workers_t *w) {
  if (w->running == 0 && w->open_pipes == 0 && !w->tree_left && w->n > 0 && !w->idle_reported) {
    w->idle_reported = 1;
    uv_timer_stop(&w->grace);
    uv_timer_stop(&w->tick);
    if (w->on_idle) w->on_idle(w, w->arg);
  }
}

/* ---- output ---- */

static void write_all(int fd, const char *p, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t k = write(fd, p + off, n - off);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) continue; /* meshrun's own stdout is non-blocking only if its parent made it so */
      break;
    }
    off += (size_t)k;
  }
}

static void on_merge_timer(uv_timer_t *t);

/* The merge timer at the consoles' next deadline, stopped when nothing waits. */
static void arm_merge(workers_t *w) {
  uint64_t due = console_deadline(w->console[0]), d1 = console_deadline(w->console[1]);
  if (d1 < due) due = d1;
  if (due == w->merge_due) return;
  w->merge_due = due;
  if (due == UINT64_MAX) {
    uv_timer_stop(&w->merge_timer);
    return;
  }
  uint64_t now = uv_hrtime();
  uv_timer_start(&w->merge_timer, on_merge_timer, due > now ? (due - now + 999999) / 1000000 : 0, 0);
}

static void on_merge_timer(uv_timer_t *t) {
  workers_t *w = t->data;
  uint64_t now = uv_hrtime();
  console_flush_due(w->console[0], now);
  console_flush_due(w->console[1], now);
  w->merge_due = 0;
  arm_merge(w);
}

static const int console_fds[2] = {STDOUT_FILENO, STDERR_FILENO};

static void console_write(void *arg, const char *line, size_t n) { write_all(*(const int *)arg, line, n); }

/* Everything the consoles hold goes out now (before meshrun's own lines about a failure). */
static void flush_consoles(workers_t *w) {
  console_flush_all(w->console[0]);
  console_flush_all(w->console[1]);
  arm_merge(w);
}

/* The consoles of a round of r->nproc workers when --merge_output asks for them: on, or auto
 * with more than CLI_MERGE_AUTO_RANKS local ranks on the console (--local_ranks_filter); only
 * where lines are prefixed (a world of one has nothing to merge). Last round's go first. */
static int new_consoles(workers_t *w, const workers_round_t *r, char *err, size_t errlen) {
  for (int k = 0; k < 2; k++) {
    console_destroy(w->console[k]);
    w->console[k] = NULL;
  }
  arm_merge(w);
  const launcher_opts_t *o = w->opts;
  int shown = 0;
  for (int lr = 0; lr < r->nproc; lr++) shown += lr >= CLI_MAX_LOCAL_RANKS || o->local_ranks_filter[lr];
  int merge = o->merge_output == CLI_MERGE_ON || (o->merge_output == CLI_MERGE_AUTO && shown > CLI_MERGE_AUTO_RANKS);
  if (!merge || !w->prefix) return 0;
  for (int k = 0; k < 2; k++)
    if (console_create(&w->console[k], r->nproc, r->rank_offset, w->merge_window_ns, console_write,
                       (void *)&console_fds[k]))
      return err_set(err, errlen, -ENOMEM, "out of memory");
  return 0;
}

static void emit_line(stream_t *s, const char *p, size_t n) {
  if (!s->console) return;
  worker_t *wk = s->owner;
  console_t *c = wk->owner->console[s->is_err];
  if (c) {
    console_line(c, wk->info.local_rank, p, n, uv_hrtime());
    arm_merge(wk->owner);
    return;
  }
  char pre[32];
  int pn = wk->owner->prefix ? snprintf(pre, sizeof pre, "[rank%d]:", wk->info.rank) : 0;
  /* One write per line, so lines from different workers never interleave mid-line. */
  char stackbuf[4096];
  size_t total = (size_t)pn + n + 1;
  char *buf = total <= sizeof stackbuf ? stackbuf : malloc(total);
  if (!buf) return;
  memcpy(buf, pre, (size_t)pn);
  memcpy(buf + pn, p, n);
  buf[total - 1] = '\n';
  write_all(s->is_err ? STDERR_FILENO : STDOUT_FILENO, buf, total);
  if (buf != stackbuf) free(buf);
}

static void tail_add(stream_t *s, const char *p, size_t n) {
  if (!s->tail) return;
  if (n > TAIL_BYTES) {
    p += n - TAIL_BYTES;
    n = TAIL_BYTES;
  }
  size_t at = s->tail_seen % TAIL_BYTES, first = n < TAIL_BYTES - at ? n : TAIL_BYTES - at;
  memcpy(s->tail + at, p, first);
  memcpy(s->tail, p + first, n - first);
  s->tail_seen += n;
}

static void write_file(stream_t *s, const char *p, size_t n) {
  if (s->file_fd < 0) return;
  while (n > 0) {
    ssize_t k = write(s->file_fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      log_warn("writing rank %d's log: %s", s->owner->info.rank, strerror(errno));
      close(s->file_fd);
      s->file_fd = -1;
      return;
    }
    p += k;
    n -= (size_t)k;
  }
}

/* Where the workers' output is read into (on_alloc, drain_now). The loop is one thread and data
 * is copied out at once. Not thread-local: 64 KiB of TLS was zeroed for every thread meshrun
 * starts. */
static char read_chunk[65536];

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  (void)suggested;
  buf->base = read_chunk;
  buf->len = sizeof read_chunk;
}

static void on_pipe_closed(uv_handle_t *h) {
  stream_t *s = h->data;
  workers_t *w = s->owner->owner;
  free(s->line);
  s->line = NULL;
  if (s->file_fd >= 0) close(s->file_fd);
  s->file_fd = -1;
  w->open_pipes--;
  check_idle(w);
}

static void close_stream(stream_t *s) {
  if (!s->open) return;
  s->open = 0;
  if (s->len) emit_line(s, s->line, s->len);
  s->len = 0;
  workers_t *w = s->owner->owner;
  if (s->console && w->console[s->is_err]) {
    console_close(w->console[s->is_err], s->owner->info.local_rank, uv_hrtime());
    arm_merge(w);
  }
  uv_close((uv_handle_t *)&s->pipe, on_pipe_closed);
}

/* What a worker wrote: to its file, its stderr's tail, and the console, whole lines or raw. */
static void consume(stream_t *s, const char *p, size_t n) {
  write_file(s, p, n);
  tail_add(s, p, n);
  if (s->raw) {
    write_all(s->is_err ? STDERR_FILENO : STDOUT_FILENO, p, n);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    char c = p[i];
    if (c == '\n') {
      emit_line(s, s->line, s->len);
      s->len = 0;
      continue;
    }
    if (s->len == LINE_MAX_BYTES) {
      emit_line(s, s->line, s->len);
      s->len = 0;
    }
    s->line[s->len++] = c;
  }
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  stream_t *s = st->data;
  if (nread < 0) {
    close_stream(s); /* EOF, or an error that ends this stream alike */
    return;
  }
  consume(s, buf->base, (size_t)nread);
}

/* Reads what the pipe holds now, before the loop would: a worker's last words come before the
 * line that says it exited, and are in its tail when the agent judges the exit. */
static void drain_now(stream_t *s) {
  uv_os_fd_t fd;
  if (!s->open || uv_fileno((uv_handle_t *)&s->pipe, &fd)) return;
  for (;;) {
    ssize_t k = read(fd, read_chunk, sizeof read_chunk);
    if (k < 0 && errno == EINTR) continue;
    if (k > 0) consume(s, read_chunk, (size_t)k);
    if (k == 0) close_stream(s);
    if (k <= 0) return;
  }
}

/* ---- exits ---- */

static void on_drain(uv_timer_t *t) {
  workers_t *w = t->data;
  for (int i = 0; i < w->n; i++) {
    worker_t *wk = &w->ws[i];
    if (wk->out.open || wk->err.open)
      log_warn("rank %d exited but a process outside meshrun's tree still holds its output open: closing it",
               wk->info.rank);
    close_stream(&wk->out);
    close_stream(&wk->err);
  }
}

/* A worker ended (st from waitpid; reaped 0: someone else reaped it, status unknown): its status,
 * its group while stopping, the output it left in the pipes, then the agent. */
static void worker_ended(workers_t *w, worker_t *wk, int reaped, int st) {
  wk->info.running = 0;
  wk->info.exit_time = wall_now();
  if (!reaped) {
    wk->info.exit_code = 1; /* unknown status: count as a failure */
  } else if (WIFSIGNALED(st)) {
    wk->info.term_signal = WTERMSIG(st);
    wk->info.exit_code = 128 + wk->info.term_signal;
  } else {
    wk->info.exit_code = WEXITSTATUS(st);
  }
  w->running--;
  /* While stopping, take the worker's whole group with it: grandchildren die too. */
  if (w->stopping) kill(-wk->info.pid, SIGKILL);
  drain_now(&wk->out);
  drain_now(&wk->err);
  /* A failure's last lines (a traceback) before what the agent says about it. */
  if (wk->info.exit_code != 0) flush_consoles(w);
  if (w->on_exit) w->on_exit(w, &wk->info, w->arg);
}

/* tick: called by the fallback tick, not by SIGCHLD. */
static void reap(workers_t *w, int tick) {
  /* Every child that ended: a worker, or a process that a worker started and left, which
   * meshrun adopted as its subreaper (launcher/tree) and only reaps. */
  int left = 0, st;
  for (;;) {
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p < 0 && errno == EINTR) continue;
    if (p <= 0) {
      left = p == 0; /* children left: running workers, or what they started */
      break;
    }
    for (int i = 0; i < w->n; i++)
      if (w->ws[i].info.running && w->ws[i].info.pid == p) worker_ended(w, &w->ws[i], 1, st);
  }
  for (int i = 0; i < w->n && !left; i++)
    if (w->ws[i].info.running) worker_ended(w, &w->ws[i], 0, 0);
  /* The round's workers are gone: what they started goes now, and the round is over once it is
   * gone too (each SIGCHLD reaps, and says when nothing is left). A process forked in the
   * moment between the listing and the kill survives that pass: each tick kills again, not each
   * SIGCHLD (without a cgroup a pass reads all of /proc, and fifty processes dying are fifty
   * SIGCHLDs). */
  if (w->running == 0 && left && (!w->tree_left || tick)) {
    uint64_t t0 = uv_hrtime();
    int n = tree_kill(w->tree);
    if (!w->tree_left) {
      log_info("the workers of this round left %d process%s running: SIGKILL", n, n == 1 ? "" : "es");
      w->tree_kill_time = t0;
    }
    w->tree_left = 1;
  } else if (w->tree_left && !left) {
    log_debug("what the workers left is gone, %.1f ms after meshrun began to kill it",
              (double)(uv_hrtime() - w->tree_kill_time) / 1e6);
    w->tree_left = 0;
  }
  /* Every worker is gone but a pipe is still open: something the worker started holds it. What
   * meshrun's tree holds is killed by now; a pipe held from outside it (its descriptor passed
   * on) is closed after DRAIN_MS, since its EOF could take forever. */
  if (w->running == 0 && w->open_pipes > 0 && w->n > 0 && !w->draining) {
    w->draining = 1;
    uv_timer_start(&w->grace, on_drain, DRAIN_MS, 0);
  }
  check_idle(w);
}

static void on_sigchld(uv_signal_t *h, int sig) {
  (void)sig;
  reap(h->data, 0);
}

static void on_tick(uv_timer_t *t) { reap(t->data, 1); }

static void on_grace(uv_timer_t *t) {
  workers_t *w = t->data;
  for (int i = 0; i < w->n; i++)
    if (w->ws[i].info.running) {
      log_warn("rank %d did not exit within %gs of SIGTERM: SIGKILL", w->ws[i].info.rank,
               w->opts->shutdown_timeout_s);
      kill(-w->ws[i].info.pid, SIGKILL);
    }
}

int workers_create(workers_t **out, uv_loop_t *loop, const launcher_opts_t *opts, workers_exit_cb on_exit,
                   workers_idle_cb on_idle, void *arg, char *err, size_t errlen) {
  workers_t *w = calloc(1, sizeof *w);
  if (!w) {
    return err_set(err, errlen, -ENOMEM, "workers: out of memory");
  }
  w->loop = loop;
  w->opts = opts;
  w->on_exit = on_exit;
  w->on_idle = on_idle;
  w->arg = arg;
  /* MESHRUN_CGROUP=0: no cgroup even where one could be made (the /proc way, tree.h). */
  const char *cg = getenv("MESHRUN_CGROUP");
  int rc = tree_create(&w->tree, !(cg && !strcmp(cg, "0")), err, errlen);
  if (rc) {
    free(w);
    return rc;
  }
  if ((rc = uv_signal_init(loop, &w->sigchld))) goto error;
  w->sigchld.data = w;
  if ((rc = uv_signal_start(&w->sigchld, on_sigchld, SIGCHLD))) goto error;
  uv_timer_init(loop, &w->tick);
  uv_timer_init(loop, &w->grace);
  uv_timer_init(loop, &w->merge_timer);
  w->tick.data = w->grace.data = w->merge_timer.data = w;
  w->merge_due = UINT64_MAX;
  w->merge_window_ns = merge_window_ns();
  /* As torchrun does with several workers a node: say once that each gets one OpenMP thread. */
  if (!getenv("OMP_NUM_THREADS") && opts->nproc_per_node > 1)
    log_info("OMP_NUM_THREADS=1 for each of the %d workers (it is not set here), so that they do not all take every "
             "core; set it to give each worker more threads", opts->nproc_per_node);
  *out = w;
  return 0;
error:
  err_set(err, errlen, 0, "workers: SIGCHLD handler: %s", uv_strerror(rc));
  tree_destroy(w->tree);
  free(w);
  return rc;
}

/* ---- spawning ---- */

static int env_push(char ***env, int *n, int *cap, char *kv) {
  if (!kv) return -ENOMEM;
  if (*n + 2 > *cap) {
    int c = *cap ? *cap * 2 : 64;
    char **p = realloc(*env, (size_t)c * sizeof *p);
    if (!p) {
      free(kv);
      return -ENOMEM;
    }
    *env = p;
    *cap = c;
  }
  (*env)[(*n)++] = kv;
  (*env)[*n] = NULL;
  return 0;
}

static int env_add(char ***env, int *n, int *cap, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int env_add(char ***env, int *n, int *cap, const char *name, const char *fmt, ...) {
  char val[PATH_MAX + 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(val, sizeof val, fmt, ap);
  va_end(ap);
  char *kv = malloc(strlen(name) + strlen(val) + 2);
  if (kv) sprintf(kv, "%s=%s", name, val);
  return env_push(env, n, cap, kv);
}

static const char *const OWN_VARS[] = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MESHRUN_STORE",
    "MESHRUN_ROUND", "MESHRUN_JOB_ID", "MESHRUN_STOP_FILE", "MESHRUN_TREE", "TORCHELASTIC_USE_AGENT_STORE",
    "MESHRUN_PROGRESS_FILE", STORE_ENV_SECRET, NULL};

static int is_own_var(const char *kv) {
  for (int i = 0; OWN_VARS[i]; i++) {
    size_t l = strlen(OWN_VARS[i]);
    if (!strncmp(kv, OWN_VARS[i], l) && kv[l] == '=') return 1;
  }
  return 0;
}

static void env_free(char **env) {
  if (!env) return;
  for (char **p = env; *p; p++) free(*p);
  free(env);
}

/* meshrun's environment without the variables it sets, then the worker's own. */
static char **build_env(const workers_t *w, const workers_round_t *r, const worker_t *wk) {
  char **env = NULL;
  int n = 0, cap = 0;
  int rc = 0;
  for (char **p = environ; *p && !rc; p++) {
    if (is_own_var(*p)) continue;
    rc = env_push(&env, &n, &cap, strdup(*p));
  }
  const workers_info_t *i = &wk->info;
  if (!rc) rc = env_add(&env, &n, &cap, "RANK", "%d", i->rank);
  if (!rc) rc = env_add(&env, &n, &cap, "LOCAL_RANK", "%d", i->local_rank);
  if (!rc) rc = env_add(&env, &n, &cap, "WORLD_SIZE", "%d", r->world_size);
  if (!rc) rc = env_add(&env, &n, &cap, "LOCAL_WORLD_SIZE", "%d", r->nproc);
  if (!rc) rc = env_add(&env, &n, &cap, "GROUP_RANK", "%d", r->group_rank);
  if (!rc) rc = env_add(&env, &n, &cap, "GROUP_WORLD_SIZE", "%d", r->group_world_size);
  if (!rc) rc = env_add(&env, &n, &cap, "ROLE_RANK", "%d", i->rank);
  if (!rc) rc = env_add(&env, &n, &cap, "ROLE_WORLD_SIZE", "%d", r->world_size);
  if (!rc) rc = env_add(&env, &n, &cap, "ROLE_NAME", "%s", w->opts->role);
  if (!rc) rc = env_add(&env, &n, &cap, "MASTER_ADDR", "%s", r->master_addr);
  if (!rc) rc = env_add(&env, &n, &cap, "MASTER_PORT", "%d", r->master_port);
  if (!rc) rc = env_add(&env, &n, &cap, "TORCHELASTIC_RESTART_COUNT", "%d", r->restart_count);
  if (!rc) rc = env_add(&env, &n, &cap, "TORCHELASTIC_MAX_RESTARTS", "%d", r->max_restarts);
  if (!rc) rc = env_add(&env, &n, &cap, "TORCHELASTIC_RUN_ID", "%s", r->run_id);
  if (!rc) rc = env_add(&env, &n, &cap, "TORCHELASTIC_USE_AGENT_STORE", "False");
  if (!rc) rc = env_add(&env, &n, &cap, "TORCHELASTIC_ERROR_FILE", "%s", i->error_file);
  if (!rc) rc = env_add(&env, &n, &cap, "MESHRUN_STORE", "%s", r->store_endpoint);
  if (!rc) rc = env_add(&env, &n, &cap, "MESHRUN_ROUND", "%d", r->round);
  if (!rc) rc = env_add(&env, &n, &cap, "MESHRUN_JOB_ID", "%s", r->job_id);
  if (!rc) rc = env_add(&env, &n, &cap, "MESHRUN_STOP_FILE", "%s", w->stop_file);
  char progress[PATH_MAX];
  if (!rc && w->opts->hang_timeout_s > 0 && !workers_progress_file(i, progress, sizeof progress))
    rc = env_add(&env, &n, &cap, "MESHRUN_PROGRESS_FILE", "%s", progress);
  /* This meshrun's id after those of the meshruns it runs under: every guard finds the process. */
  const char *outer = getenv("MESHRUN_TREE");
  if (!rc)
    rc = env_add(&env, &n, &cap, "MESHRUN_TREE", "%.2000s%s%s", outer ? outer : "", outer && *outer ? "," : "",
                 tree_id(w->tree));
  /* Not through env_add: its buffer is sized for paths, and a secret is never cut. */
  if (!rc && r->store_secret[0]) {
    char *kv = malloc(sizeof STORE_ENV_SECRET + 1 + strlen(r->store_secret));
    if (kv) sprintf(kv, "%s=%s", STORE_ENV_SECRET, r->store_secret);
    rc = env_push(&env, &n, &cap, kv);
  }
  if (!rc && !getenv("OMP_NUM_THREADS")) rc = env_add(&env, &n, &cap, "OMP_NUM_THREADS", "1");
  if (rc) {
    env_free(env);
    return NULL;
  }
  return env;
}

static int open_log(const char *dir, const char *name, char *err, size_t errlen) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) err_set(err, errlen, 0, "open %s: %s", path, strerror(errno));
  return fd;
}

/* --redirects and --tee of local rank lr (bit 1 stdout, bit 2 stderr; a per-rank value wins). */
static void rank_streams(const launcher_opts_t *o, int lr, int *redir, int *tee) {
  *redir = (lr < CLI_MAX_LOCAL_RANKS && o->redirects_per_rank[lr] >= 0) ? o->redirects_per_rank[lr] : o->redirects;
  *tee = (lr < CLI_MAX_LOCAL_RANKS && o->tee_per_rank[lr] >= 0) ? o->tee_per_rank[lr] : o->tee;
}

/* Whether local rank lr writes a log file (stdout.log or stderr.log) in its rank dir. */
static int rank_writes_log(const launcher_opts_t *o, const workers_round_t *r, int lr) {
  int redir, tee;
  rank_streams(o, lr, &redir, &tee);
  return r->log_files || redir || tee;
}

/* Decides, per stream, where the child's fd points and where its lines go. child_fd gets the
 * fd to dup2 onto 1/2 in the child (-1: keep meshrun's own); *pipe_rd the parent's end. */
static int setup_stream(workers_t *w, worker_t *wk, stream_t *s, int is_err, const workers_round_t *r,
                        const char *rank_dir, int *child_fd, int *pipe_rd, char *err, size_t errlen) {
  const launcher_opts_t *o = w->opts;
  int lr = wk->info.local_rank;
  int bit = is_err ? 2 : 1;
  int redir, tee;
  rank_streams(o, lr, &redir, &tee);
  int shown = lr >= CLI_MAX_LOCAL_RANKS || o->local_ranks_filter[lr];
  int to_file = r->log_files || (redir & bit) || (tee & bit);
  int console = shown && (!(redir & bit) || (tee & bit));
  if (console && w->console[is_err]) console_open(w->console[is_err], lr);
  s->owner = wk;
  s->is_err = is_err;
  s->file_fd = -1;
  s->console = console;
  *child_fd = -1;
  *pipe_rd = -1;
  if (to_file && !console) {
    /* Straight to the file: no pipe, no loop work. A failure's tail is read from the file. */
    int fd = open_log(rank_dir, is_err ? "stderr.log" : "stdout.log", err, errlen);
    if (fd < 0) return -errno;
    if (is_err && asprintf(&wk->err_log, "%s/stderr.log", rank_dir) < 0) wk->err_log = NULL;
    *child_fd = fd;
    return 0;
  }
  if (!to_file && !console) {
    int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
      return err_set(err, errlen, -errno, "open /dev/null: %s", strerror(errno));
    }
    *child_fd = fd;
    return 0;
  }
  /* stdout on the console unprefixed: the child writes to our fd. stderr goes through a pipe
   * anyway, for its tail, and on raw: as it comes, partial lines and all. */
  if (!to_file && !w->prefix && !is_err) return 0;
  s->raw = !to_file && !w->prefix;
  if (to_file) {
    s->file_fd = open_log(rank_dir, is_err ? "stderr.log" : "stdout.log", err, errlen);
    if (s->file_fd < 0) return -errno;
  }
  int p[2];
  if (pipe2(p, O_CLOEXEC)) {
    return err_set(err, errlen, -errno, "pipe: %s", strerror(errno));
  }
  s->line = s->raw ? NULL : malloc(LINE_MAX_BYTES);
  s->tail = is_err ? malloc(TAIL_BYTES) : NULL;
  if ((!s->raw && !s->line) || (is_err && !s->tail)) {
    free(s->line);
    free(s->tail);
    s->line = s->tail = NULL;
    close(p[0]);
    close(p[1]);
    return err_set(err, errlen, -ENOMEM, "out of memory");
  }
  *pipe_rd = p[0];
  *child_fd = p[1];
  return 0;
}

static int open_pipe(workers_t *w, stream_t *s, int fd) {
  int rc = uv_pipe_init(w->loop, &s->pipe, 0);
  if (rc) return rc;
  s->pipe.data = s;
  s->open = 1;
  w->open_pipes++;
  if ((rc = uv_pipe_open(&s->pipe, fd))) {
    close_stream(s);
    close(fd);
    return rc;
  }
  if ((rc = uv_read_start((uv_stream_t *)&s->pipe, on_alloc, on_read))) close_stream(s);
  return rc;
}

/* 0 when path names an executable regular file; else the errno that explains why not. */
static int check_exec(const char *path) {
  struct stat st;
  if (stat(path, &st)) return errno;
  if (S_ISDIR(st.st_mode)) return EISDIR;
  if (access(path, X_OK)) return errno;
  return 0;
}

int workers_find_program(const char *prog, char *out, size_t outlen, char *why, size_t whylen) {
  if (strchr(prog, '/')) {
    int e = check_exec(prog);
    if (e) snprintf(why, whylen, "%s", e == ENOENT ? "no such file" : e == EACCES ? "not executable" : strerror(e));
    else snprintf(out, outlen, "%s", prog);
    return e;
  }
  const char *path = getenv("PATH");
  if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
  int seen_noexec = 0;
  for (const char *p = path; *p;) {
    const char *colon = strchr(p, ':');
    size_t n = colon ? (size_t)(colon - p) : strlen(p);
    char cand[PATH_MAX];
    if (snprintf(cand, sizeof cand, "%.*s/%s", (int)n, n ? p : ".", prog) < (int)sizeof cand) {
      int e = check_exec(cand);
      if (!e) {
        snprintf(out, outlen, "%s", cand);
        return 0;
      }
      if (e == EACCES) seen_noexec = 1;
    }
    p += n;
    if (*p == ':') p++;
  }
  snprintf(why, whylen, "%s", seen_noexec ? "not executable" : "command not found");
  return seen_noexec ? EACCES : ENOENT;
}

/* The signals meshrun handles (the agent's forwarded ones and SIGCHLD, through libuv) or
 * ignores (SIGPIPE, main.c): what the child sets back to default before it unblocks signals.
 * Others keep the disposition meshrun got from its parent, as under torchrun (an ignored
 * SIGHUP under nohup stays ignored); resetting all 64 was 64 system calls per worker. */
static const int RESET_SIGNALS[] = {WORKERS_FORWARDED_SIGNALS, SIGCHLD, SIGPIPE};

/* The child side: see the order and reasons at the top of the file. */
static void __attribute__((noreturn)) child_exec(pid_t parent, int out_fd, int err_fd, int report_fd,
                                                 const char *file, char **argv, char **env) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(137);
  for (size_t i = 0; i < sizeof RESET_SIGNALS / sizeof RESET_SIGNALS[0]; i++) signal(RESET_SIGNALS[i], SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  if (out_fd >= 0) dup2(out_fd, STDOUT_FILENO);
  if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
  execve(file, argv, env);
  int e = errno;
  ssize_t k = write(report_fd, &e, sizeof e);
  (void)k;
  _exit(127);
}

typedef struct {
  pid_t parent;
  int out_fd, err_fd, report_fd;
  const char *file;
  char **argv, **env;
} child_args_t;

static int child_main(void *arg) {
  child_args_t *a = arg;
  child_exec(a->parent, a->out_fd, a->err_fd, a->report_fd, a->file, a->argv, a->env);
}

/* Starts a child that runs child_exec: clone with CLONE_VM | CLONE_VFORK, as posix_spawn does,
 * on a stack of its own, instead of fork. The child shares our memory until its exec, and we
 * wait until then, so there is no page table to copy and no page to fault in twice: fork cost
 * a node about a tenth of its start in a 1024-node job on one machine. child_exec only makes
 * system calls (no allocation, no stdio, no locks), which is all a child may do here. The pid,
 * or -1 as fork gives it. */
static pid_t spawn_child(child_args_t *a) {
  enum { STACK = 64 * 1024 };
  char *stack = malloc(STACK);
  if (!stack) {
    errno = ENOMEM;
    return -1;
  }
  pid_t pid = clone(child_main, stack + STACK, CLONE_VM | CLONE_VFORK | SIGCHLD, a);
  int e = errno;
  free(stack);
  errno = e;
  return pid;
}

/* The first line of file into line ("" when it cannot be read), without its end of line. */
static void first_line(const char *file, char *line, size_t len) {
  int fd = open(file, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  ssize_t k = fd >= 0 ? read(fd, line, len - 1) : -1;
  if (fd >= 0) close(fd);
  line[k > 0 ? k : 0] = '\0';
  line[strcspn(line, "\r\n")] = '\0';
}

/* Names why exec failed. ENOENT for a file that exists (workers_find_program saw it) is the
 * kernel's answer for a script whose "#!" interpreter is missing: say which one. */
static void exec_failure(const char *file, const char *prog, int e, char *err, size_t errlen) {
  char line[256] = "";
  if (e == ENOENT) first_line(file, line, sizeof line);
  if (!strncmp(line, "#!", 2)) {
    const char *interp = line + 2 + strspn(line + 2, " \t");
    err_set(err, errlen, 0, "exec %s: its interpreter %.*s is missing (%s)", prog, (int)strcspn(interp, " \t"), interp,
            strerror(e));
  } else {
    err_set(err, errlen, 0, "exec %s: %s", prog, strerror(e));
  }
}

static void free_round(workers_t *w) {
  for (int i = 0; i < w->n; i++) {
    free(w->ws[i].err.tail);
    free(w->ws[i].err_log);
  }
  free(w->ws);
  w->ws = NULL;
  w->n = 0;
}

/* Empties the previous round's table and makes this round's: r->nproc workers, none running. */
static int new_round(workers_t *w, const workers_round_t *r, char *err, size_t errlen) {
  /* The previous round is idle (the agent waits for it), so its handles are closed. */
  free_round(w);
  w->ws = calloc((size_t)r->nproc, sizeof *w->ws);
  if (!w->ws) {
    return err_set(err, errlen, -ENOMEM, "out of memory");
  }
  w->n = r->nproc;
  w->running = 0;
  w->stopping = 0;
  w->draining = 0;
  w->idle_reported = 0;
  w->tree_left = 0;
  w->prefix = r->world_size > 1;
  return new_consoles(w, r, err, errlen);
}

/* The rank's folder in rank_dir (made only when the rank writes a log) and its error file,
 * removed when a past run left one. */
static int rank_files(const workers_t *w, const workers_round_t *r, worker_t *wk, char *rank_dir, size_t dirlen,
                      char *err, size_t errlen) {
  int rc;
  /* <rank>/error.json next to the rank's logs, torchrun's layout; a rank that writes no log
   * gets no directory of its own, only <rank>.error.json: a directory is an inode to make
   * and remove per worker, which in a 1024-node start on one machine was a tenth of it. */
  snprintf(rank_dir, dirlen, "%.3900s/%d", r->attempt_dir, wk->info.rank);
  if (rank_writes_log(w->opts, r, wk->info.local_rank)) {
    if ((rc = mkdir_p(rank_dir, err, errlen))) return rc;
    snprintf(wk->info.error_file, sizeof wk->info.error_file, "%.4000s/error.json", rank_dir);
  } else if (r->file_prefix[0]) {
    snprintf(wk->info.error_file, sizeof wk->info.error_file, "%.3800s/%s%d.error.json", r->attempt_dir,
             r->file_prefix, wk->info.local_rank);
  } else {
    snprintf(wk->info.error_file, sizeof wk->info.error_file, "%.4000s.error.json", rank_dir);
  }
  fs_unlink_if_there(wk->info.error_file);
  char progress[PATH_MAX];
  if (w->opts->hang_timeout_s > 0 && !workers_progress_file(&wk->info, progress, sizeof progress))
    fs_unlink_if_there(progress);
  return 0;
}

/* spawn_child with every signal blocked across the spawn: until the child has reset the
 * dispositions, a signal would run libuv's handler in it, which writes to the parent's signal
 * pipe (meshrun would see, say, a second SIGTERM it never got). The child unblocks. */
static int spawn_blocked(child_args_t *ca, pid_t *pid, char *err, size_t errlen) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  *pid = spawn_child(ca);
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (*pid < 0) {
    err_set(err, errlen, 0, "fork: %s", strerror(fork_errno));
    return -fork_errno;
  }
  return 0;
}

/* After a failed spawn: the parent's ends of the output pipes and the log files, and the
 * partial-line buffers, of a worker that never ran. */
static void drop_streams(worker_t *wk, int out_rd, int err_rd) {
  if (out_rd >= 0) close(out_rd);
  if (err_rd >= 0) close(err_rd);
  if (wk->out.file_fd >= 0) close(wk->out.file_fd);
  if (wk->err.file_fd >= 0) close(wk->err.file_fd);
  wk->out.file_fd = wk->err.file_fd = -1;
  free(wk->out.line);
  free(wk->err.line);
  wk->out.line = wk->err.line = NULL;
}

/* Starts local rank i: its files, its streams, its environment, the child. *report gets the
 * read end of the pipe on which the child's exec reports (read once every worker is started:
 * the execs overlap). Returns 0, or an error in err; what was made for this worker that the
 * round's cleanup does not reach is closed here. */
static int start_worker(workers_t *w, const workers_round_t *r, int i, pid_t self, const char *file, char **argv,
                        int *report, char *err, size_t errlen) {
  worker_t *wk = &w->ws[i];
  wk->owner = w;
  wk->info.local_rank = i;
  wk->info.rank = r->rank_offset + i;
  wk->out.file_fd = wk->err.file_fd = -1;
  char rank_dir[PATH_MAX];
  int rc = rank_files(w, r, wk, rank_dir, sizeof rank_dir, err, errlen);
  if (rc) return rc;
  int out_child, out_rd, err_child, err_rd;
  if ((rc = setup_stream(w, wk, &wk->out, 0, r, rank_dir, &out_child, &out_rd, err, errlen))) return rc;
  if ((rc = setup_stream(w, wk, &wk->err, 1, r, rank_dir, &err_child, &err_rd, err, errlen))) {
    if (out_child >= 0) close(out_child);
    if (out_rd >= 0) close(out_rd);
    return rc;
  }
  char **env = build_env(w, r, wk);
  int rep[2] = {-1, -1};
  if (!env || pipe2(rep, O_CLOEXEC)) {
    err_set(err, errlen, 0, "preparing rank %d: %s", wk->info.rank, env ? strerror(errno) : "out of memory");
    rc = -ENOMEM;
  }
  pid_t pid = -1;
  if (!rc) {
    child_args_t ca = {self, out_child, err_child, rep[1], file, argv, env};
    rc = spawn_blocked(&ca, &pid, err, errlen);
  }
  env_free(env);
  if (out_child >= 0) close(out_child);
  if (err_child >= 0) close(err_child);
  if (rep[1] >= 0) close(rep[1]);
  if (rc) {
    if (rep[0] >= 0) close(rep[0]);
    drop_streams(wk, out_rd, err_rd);
    return rc;
  }
  wk->info.pid = pid;
  wk->info.running = 1;
  wk->group_alive = 1;
  w->running++;
  tree_note_group(w->tree, pid);
  *report = rep[0];
  if (out_rd >= 0 && (rc = open_pipe(w, &wk->out, out_rd))) {
    err_set(err, errlen, 0, "reading rank %d's stdout: %s", wk->info.rank, uv_strerror(rc));
    if (err_rd >= 0) close(err_rd);
    return rc;
  }
  if (err_rd >= 0 && (rc = open_pipe(w, &wk->err, err_rd))) {
    err_set(err, errlen, 0, "reading rank %d's stderr: %s", wk->info.rank, uv_strerror(rc));
    return rc;
  }
  return 0;
}

/* Reads and closes every report pipe: each gives EOF when its child's exec succeeded (CLOEXEC),
 * or the errno. Returns 0, or the first failure (-ENOEXEC when the program itself cannot run),
 * named in err. */
static int exec_reports(int *reports, int n, const char *file, const char *prog, char *err, size_t errlen) {
  int rc = 0;
  for (int i = 0; i < n; i++) {
    int e = 0;
    ssize_t k;
    do k = read(reports[i], &e, sizeof e);
    while (k < 0 && errno == EINTR);
    close(reports[i]);
    reports[i] = -1;
    if (k == (ssize_t)sizeof e && !rc) {
      exec_failure(file, prog, e, err, errlen);
      /* The program itself cannot run (vs. a resource running short, like ENOMEM or E2BIG). */
      int cannot_run = e == ENOENT || e == EACCES || e == ENOEXEC || e == ENOTDIR || e == ELOOP || e == EISDIR;
      rc = cannot_run ? -ENOEXEC : -e;
    }
  }
  return rc;
}

int workers_start(workers_t *w, const workers_round_t *r, char *err, size_t errlen) {
  const launcher_opts_t *o = w->opts;
  int rc = new_round(w, r, err, errlen);
  if (rc) return rc;
  /* PROGRAM ARGS, or for a Python PROGRAM (cli decided: -m, or *.py) torchrun's command */
  char **argv = cli_worker_argv(o);
  if (!argv) {
    return err_set(err, errlen, -ENOMEM, "out of memory");
  }
  /* PATH is searched once here, not by each child's execvp. */
  char *file = w->program, why[128];
  if (workers_find_program(argv[0], file, sizeof w->program, why, sizeof why)) {
    err_set(err, errlen, 0, "%s: %s", argv[0], why);
    free(argv);
    return -ENOEXEC;
  }
  pid_t self = getpid();
  int *reports = malloc((size_t)r->nproc * sizeof *reports);
  if (!reports) {
    err_set(err, errlen, 0, "out of memory");
    free(argv);
    return -ENOMEM;
  }
  for (int i = 0; i < r->nproc; i++) reports[i] = -1;
  snprintf(w->stop_file, sizeof w->stop_file, "%.3800s/%sstop", r->attempt_dir, r->file_prefix);
  if ((rc = mkdir_p(r->attempt_dir, err, errlen))) goto error;
  fs_unlink_if_there(w->stop_file);
  tree_round(w->tree);
  for (int i = 0; i < r->nproc; i++)
    if ((rc = start_worker(w, r, i, self, file, argv, &reports[i], err, errlen))) goto error;
  rc = exec_reports(reports, r->nproc, file, argv[0], err, errlen);
  free(reports);
  reports = NULL;
  if (rc) goto error;
  uint64_t tick_ms = (uint64_t)(o->monitor_interval_s * 1000);
  if (tick_ms < 1) tick_ms = 1;
  uv_timer_start(&w->tick, on_tick, tick_ms, tick_ms);
  free(argv);
  return 0;
error:
  if (reports)
    for (int i = 0; i < r->nproc; i++)
      if (reports[i] >= 0) close(reports[i]);
  free(reports);
  free(argv);
  /* Nothing of this round may survive a failed start: kill what started; reaping and the
   * pipes' EOF make the round idle as usual. Workers not yet started count as not running. */
  w->stopping = 1;
  workers_kill_all(w);
  return rc;
}

void workers_signal(workers_t *w, int sig) {
  for (int i = 0; i < w->n; i++)
    if (w->ws[i].info.running) kill(-w->ws[i].info.pid, sig);
}

void workers_stop(workers_t *w, int sig, double grace_s, const char *reason) {
  if (w->stopping) return;
  w->stopping = 1;
  /* The reason first, where the workers' signal handlers can read it (MESHRUN_STOP_FILE): one
   * word and a newline, written whole before any signal is sent. */
  int fd = w->stop_file[0] ? open(w->stop_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
  if (fd >= 0) {
    char line[64];
    int len = snprintf(line, sizeof line, "%.60s\n", reason ? reason : "stop");
    if (write(fd, line, (size_t)len) != len) log_warn("writing %s: %s", w->stop_file, strerror(errno));
    close(fd);
  }
  /* SIGTERM (or the signal meshrun got) first so workers can flush and write their error
   * files; SIGKILL after the grace period for those that ignore it or hang. */
  workers_signal(w, sig);
  /* A stopped worker (SIGSTOP, a debugger's ^Z) would hold the signal until SIGKILL: it
   * continues now and acts on it within the grace. To one that runs, SIGCONT does nothing. */
  for (int i = 0; i < w->n; i++)
    if (w->ws[i].info.running) kill(-w->ws[i].info.pid, SIGCONT);
  if (w->running) uv_timer_start(&w->grace, on_grace, (uint64_t)(grace_s * 1000), 0);
}

void workers_kill_all(workers_t *w) {
  if (!w) return;
  for (int i = 0; i < w->n; i++)
    if (w->ws[i].group_alive) kill(-w->ws[i].info.pid, SIGKILL);
  tree_kill(w->tree);
}

int workers_running(const workers_t *w) { return w->running; }

int workers_idle(const workers_t *w) { return w->running == 0 && w->open_pipes == 0 && !w->tree_left; }

const workers_info_t *workers_info(const workers_t *w, int local_rank) {
  return local_rank >= 0 && local_rank < w->n ? &w->ws[local_rank].info : NULL;
}

int workers_count(const workers_t *w) { return w->n; }

void workers_destroy(workers_t *w) {
  if (!w) return;
  free_round(w);
  console_destroy(w->console[0]);
  console_destroy(w->console[1]);
  tree_destroy(w->tree);
  free(w);
}

size_t workers_stderr_tail(const workers_t *w, int local_rank, char *out, size_t outlen) {
  if (local_rank < 0 || local_rank >= w->n) return 0;
  const worker_t *wk = &w->ws[local_rank];
  const stream_t *s = &wk->err;
  if (s->tail) {
    size_t n = s->tail_seen < TAIL_BYTES ? s->tail_seen : TAIL_BYTES;
    n = n < outlen ? n : outlen;
    size_t start = (s->tail_seen - n) % TAIL_BYTES, first = n < TAIL_BYTES - start ? n : TAIL_BYTES - start;
    memcpy(out, s->tail + start, first);
    memcpy(out + first, s->tail, n - first);
    return n;
  }
  int fd = wk->err_log ? open(wk->err_log, O_RDONLY | O_CLOEXEC | O_NONBLOCK) : -1;
  struct stat st;
  if (fd < 0 || fstat(fd, &st)) {
    if (fd >= 0) close(fd);
    return 0;
  }
  size_t n = (size_t)st.st_size < outlen ? (size_t)st.st_size : outlen;
  ssize_t k = pread(fd, out, n, st.st_size - (off_t)n);
  close(fd);
  return k > 0 ? (size_t)k : 0;
}

/* 1 when path's last component starts with "python" (python3, python3.11, python). */
static int is_python(const char *path) {
  const char *base = strrchr(path, '/');
  return !strncmp(base ? base + 1 : path, "python", 6);
}

void workers_python(const workers_t *w, char *out, size_t outlen) {
  if (is_python(w->program)) {
    snprintf(out, outlen, "%s", w->program);
    return;
  }
  /* "#!/usr/bin/python3 -u", or "#!/usr/bin/env [-S] python3 ...": the first word not an
   * option after env, found along PATH as env would. */
  char line[256] = "", name[256] = "", why[128];
  first_line(w->program, line, sizeof line);
  out[0] = '\0';
  if (strncmp(line, "#!", 2)) return;
  char *save, *word = strtok_r(line + 2, " \t", &save);
  const char *base = word ? strrchr(word, '/') : NULL;
  if (base && !strcmp(base, "/env"))
    while ((word = strtok_r(NULL, " \t", &save)) && word[0] == '-') {
    }
  if (word) snprintf(name, sizeof name, "%s", word);
  if (!is_python(name)) return;
  if (workers_find_program(name, out, outlen, why, sizeof why)) snprintf(out, outlen, "%s", name);
}

void workers_close(workers_t *w) {
  if (!w) return;
  uv_close((uv_handle_t *)&w->sigchld, NULL);
  uv_close((uv_handle_t *)&w->tick, NULL);
  uv_close((uv_handle_t *)&w->grace, NULL);
  for (int i = 0; i < w->n; i++) {
    close_stream(&w->ws[i].out);
    close_stream(&w->ws[i].err);
  }
  flush_consoles(w);
  uv_close((uv_handle_t *)&w->merge_timer, NULL);
}

void workers_remove_files(workers_t *w) {
  if (w->stop_file[0]) fs_unlink_if_there(w->stop_file);
  char progress[PATH_MAX];
  for (int i = 0; i < w->n; i++) {
    if (w->ws[i].info.error_file[0]) fs_unlink_if_there(w->ws[i].info.error_file);
    if (w->opts->hang_timeout_s > 0 && !workers_progress_file(&w->ws[i].info, progress, sizeof progress))
      fs_unlink_if_there(progress);
  }
}

int workers_progress_file(const workers_info_t *info, char *out, size_t len) {
  const char *e = info->error_file;
  size_t n = strlen(e), k = strlen("error.json");
  if (n < k || strcmp(e + n - k, "error.json")) return -EINVAL;
  int m = snprintf(out, len, "%.*sprogress", (int)(n - k), e);
  return m < 0 || (size_t)m >= len ? -ENAMETOOLONG : 0;
}
