/* tree: the subreaper, the job's cgroup, and the guard that outlives a killed meshrun (see tree.h).
 *
 * Order in tree_create: the subreaper, the cgroup made (not entered), the guard, then the
 * thread that moves meshrun into the cgroup. The guard comes before any thread, since it is a
 * copy of meshrun made by clone() that goes on to use libc (a copy of a process with threads
 * may hold their locks); and before the move, so that it stays outside the cgroup it may have
 * to kill. It is a "clone" child (no exit signal), which waitid(-1) without __WALL ignores. It
 * first puts itself in a process group of its own, ignores the signals meshrun handles, and
 * closes every descriptor it got from meshrun but the pipe's read end and stderr: a listening
 * socket or a store connection held by the guard would keep the port bound and the peers
 * connected after meshrun is gone. The move is on a thread because the first cgroup move in a
 * while waits an RCU grace period (4 to 18 ms measured here): it overlaps the rendezvous, and
 * nothing waits for it (nobody joins the thread; a job shorter than the grace period waits for
 * it at exit, since a process ends when its last thread does). A round that starts before the
 * move is done (a quick single-node start) has its workers born outside the cgroup: meshrun finds
 * what they leave through /proc, and the guard looks for them by their environment and process
 * groups, as without a cgroup.
 *
 * Pipe messages, meshrun to guard: 'R' a new round, 'X' its workers start outside the cgroup,
 * 'G' + a pid_t a worker's process group (without a cgroup, or outside it), 'P' no cgroup after
 * all, 'D' meshrun is done and left nothing. Each is written whole (under PIPE_BUF) and read
 * through a small buffer. The pipe's EOF comes when meshrun has exited (its write end is never
 * closed before): without a 'D' before it, meshrun died and the guard cleans up. Then, with a
 * cgroup, the guard removes it once meshrun has left it: no thread of meshrun runs any more to
 * move it back in. meshrun never waits for the guard. */
#include "launcher/tree.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"

/* How long the guard keeps killing what a dead meshrun left (a process in uninterruptible sleep
 * ends only when its I/O does), or waits for meshrun to leave the cgroup, before it gives up. */
#define GUARD_WAIT_S 10.0

/* meshrun's move into its cgroup, shared by meshrun and the thread that makes it: whichever
 * lets go of it last frees it (meshrun may end before the move does, and does not wait). */
typedef struct {
  char procs[4200]; /* the cgroup's cgroup.procs */
  int err;          /* the move's errno, 0 when meshrun is in */
  int done;         /* atomic: err is set */
  int refs;         /* atomic: 2 at the start */
} move_t;

struct tree {
  pid_t self;
  char id[40];       /* "<pid>.<16 hex>" */
  char cgroup[4096]; /* the job's cgroup directory, "" without one (the /proc way) */
  move_t *move;      /* the move until meshrun has seen it done, then NULL */
  int move_err;      /* what it gave */
  int outside;       /* this round's workers started before meshrun was in the cgroup */
  pid_t guard;        /* 0 without one */
  int guard_fd;       /* write end of the guard's pipe, -1 without */
  int guard_rd;       /* its read end: the guard's (meshrun closes it once the guard is made) */
};

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Sleeps the delay, then doubles it up to 0.1 s (polling with backoff). */
static void nap(double *delay) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(*delay * 1e9)};
  nanosleep(&ts, NULL);
  *delay = *delay < 0.05 ? 2 * *delay : 0.1;
}

/* ---- the job's cgroup ---- */

/* This process's cgroup v2 directory: its "0::PATH" line of /proc/self/cgroup, under the
 * cgroup2 mount whose root holds PATH (a cgroup namespace's mount has its own root). 0, or -1
 * when there is none (cgroup v1, no mount, too long). */
static int own_cgroup_dir(char *out, size_t len) {
  char *line = NULL, path[4096] = "";
  size_t cap = 0;
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (!f) return -1;
  while (getline(&line, &cap, f) > 0)
    if (!strncmp(line, "0::", 3)) snprintf(path, sizeof path, "%.*s", (int)strcspn(line + 3, "\n"), line + 3);
  fclose(f);
  int rc = -1;
  f = path[0] ? fopen("/proc/self/mountinfo", "re") : NULL;
  while (f && rc && getline(&line, &cap, f) > 0) {
    /* ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS */
    char root[4096], mnt[4096];
    const char *sep = strstr(line, " - ");
    if (!sep || strncmp(sep + 3, "cgroup2 ", 8) || sscanf(line, "%*s %*s %*s %4095s %4095s", root, mnt) != 2)
      continue;
    size_t rl = strcmp(root, "/") ? strlen(root) : 0;
    if (strncmp(path, root, rl) || (path[rl] != '/' && path[rl] != '\0')) continue;
    rc = snprintf(out, len, "%s%s", mnt, strcmp(path + rl, "/") ? path + rl : "") < (int)len ? 0 : -1;
  }
  if (f) fclose(f);
  free(line);
  return rc;
}

/* The job's cgroup below meshrun's own, made and checked (cgroup.kill there); why not in why. */
static int make_cgroup(tree_t *t, char *why, size_t whylen) {
  char dir[4096], path[4200];
  if (own_cgroup_dir(dir, sizeof dir)) {
    snprintf(why, whylen, "no cgroup v2 directory in /proc/self/cgroup and /proc/self/mountinfo");
    return -1;
  }
  if (snprintf(t->cgroup, sizeof t->cgroup, "%.4000s/meshrun-%s", dir, t->id) >= (int)sizeof t->cgroup ||
      mkdir(t->cgroup, 0755)) {
    snprintf(why, whylen, "mkdir %.4000s/meshrun-%s: %s", dir, t->id, strerror(errno));
    t->cgroup[0] = '\0';
    return -1;
  }
  snprintf(path, sizeof path, "%s/cgroup.kill", t->cgroup);
  if (access(path, W_OK)) {
    snprintf(why, whylen, "%.4000s: %s", path, errno == ENOENT ? "none (Linux before 5.14)" : strerror(errno));
    rmdir(t->cgroup);
    t->cgroup[0] = '\0';
    return -1;
  }
  return 0;
}

static void move_release(move_t *m) {
  if (__atomic_sub_fetch(&m->refs, 1, __ATOMIC_ACQ_REL) == 0) free(m);
}

static void *move_self(void *arg) {
  move_t *m = arg;
  int fd = open(m->procs, O_WRONLY | O_CLOEXEC);
  /* "0" is the writer's process, every thread of it. */
  m->err = fd < 0 || write(fd, "0", 1) != 1 ? errno : 0;
  if (fd >= 0) close(fd);
  __atomic_store_n(&m->done, 1, __ATOMIC_RELEASE);
  move_release(m);
  return NULL;
}

/* The move, on a thread of its own that nobody joins (or here, if none can be started). */
static void start_move(tree_t *t) {
  move_t *m = calloc(1, sizeof *m);
  if (!m) {
    t->move_err = ENOMEM;
    return;
  }
  snprintf(m->procs, sizeof m->procs, "%s/cgroup.procs", t->cgroup);
  m->refs = 2;
  t->move = m;
  pthread_attr_t attr;
  pthread_t thread;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&thread, &attr, move_self, m)) move_self(m);
  pthread_attr_destroy(&attr);
}

/* 1 while the move is under way; once it is done, takes in its result. */
static int move_pending(tree_t *t) {
  if (!t->move) return 0;
  if (!__atomic_load_n(&t->move->done, __ATOMIC_ACQUIRE)) return 1;
  t->move_err = t->move->err;
  move_release(t->move);
  t->move = NULL;
  if (!t->move_err) log_debug("in cgroup %s", t->cgroup);
  return 0;
}

/* 1 while the cgroup (or a cgroup below it) holds a live process: "populated 1" in cgroup.events. */
static int cgroup_populated(const char *cgroup) {
  char path[4200], buf[256];
  snprintf(path, sizeof path, "%s/cgroup.events", cgroup);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t k = read(fd, buf, sizeof buf - 1);
  close(fd);
  buf[k > 0 ? k : 0] = '\0';
  return strstr(buf, "populated 1") != NULL;
}

/* SIGKILL to every process listed in the cgroup's cgroup.procs but self; returns how many. */
static int kill_members(const char *cgroup, pid_t self) {
  char path[4200];
  snprintf(path, sizeof path, "%s/cgroup.procs", cgroup);
  FILE *f = fopen(path, "re");
  int pid, n = 0;
  while (f && fscanf(f, "%d", &pid) == 1)
    if (pid != self && kill(pid, SIGKILL) == 0) n++;
  if (f) fclose(f);
  return n;
}

static int rm_dir(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)ftw;
  if (flag == FTW_DP) rmdir(path); /* a cgroup's files go with it */
  return 0;
}

/* ---- /proc ---- */

/* pid's parent from /proc/<pid>/stat (the field after the state, past the last ')' of the
 * command name, which may hold anything); 0 when it cannot be read. */
static pid_t parent_of(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t k = read(fd, buf, sizeof buf - 1);
  close(fd);
  buf[k > 0 ? k : 0] = '\0';
  const char *p = strrchr(buf, ')');
  int ppid = 0;
  if (!p || sscanf(p + 1, " %*c %d", &ppid) != 1) return 0;
  return ppid;
}

/* Calls fn(pid, arg) for every process in /proc but this one. */
static void each_process(void (*fn)(pid_t, void *), void *arg) {
  DIR *d = opendir("/proc");
  if (!d) return;
  struct dirent *e;
  pid_t me = getpid();
  while ((e = readdir(d))) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0 || pid == me) continue;
    fn((pid_t)pid, arg);
  }
  closedir(d);
}

typedef struct {
  pid_t (*pairs)[2]; /* {pid, its parent} */
  size_t n, cap;
} ptable_t;

static void add_pair(pid_t pid, void *arg) {
  ptable_t *t = arg;
  pid_t ppid = parent_of(pid);
  if (ppid <= 0) return;
  if (t->n == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 512;
    void *p = realloc(t->pairs, cap * sizeof *t->pairs);
    if (!p) return;
    t->pairs = p;
    t->cap = cap;
  }
  t->pairs[t->n][0] = pid;
  t->pairs[t->n][1] = ppid;
  t->n++;
}

/* SIGKILL to the processes whose chain of parents leads to self, but skip and what is below it:
 * every /proc/<pid>/stat read once, then marked in as many passes as the tree is deep. Returns
 * how many. */
static int kill_below(pid_t self, pid_t skip) {
  ptable_t t = {0};
  each_process(add_pair, &t);
  pid_t *below = malloc((t.n + 1) * sizeof *below);
  size_t nb = 0;
  if (below) below[nb++] = self;
  for (int more = below != NULL; more;) {
    more = 0;
    for (size_t i = 0; i < t.n; i++) {
      if (!t.pairs[i][0] || t.pairs[i][0] == skip) continue;
      for (size_t j = 0; j < nb; j++)
        if (below[j] == t.pairs[i][1]) {
          below[nb++] = t.pairs[i][0];
          t.pairs[i][0] = 0; /* taken */
          more = 1;
          break;
        }
    }
  }
  int n = 0;
  for (size_t j = 1; j < nb; j++) n += kill(below[j], SIGKILL) == 0;
  free(below);
  free(t.pairs);
  return n;
}

/* 1 when the file at path holds needle (read in chunks; a match may straddle two). */
static int file_holds(const char *path, const char *needle) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  size_t nl = strlen(needle), have = 0;
  char buf[8192];
  int found = 0;
  ssize_t k;
  while (!found && (k = read(fd, buf + have, sizeof buf - have)) > 0) {
    have += (size_t)k;
    found = memmem(buf, have, needle, nl) != NULL;
    if (have >= nl) { /* keep the last nl - 1 bytes: the start of a match the chunk cut */
      memmove(buf, buf + have - (nl - 1), nl - 1);
      have = nl - 1;
    }
  }
  close(fd);
  return found;
}

typedef struct {
  const char *id;
  int n;
} marked_t;

static void kill_if_marked(pid_t pid, void *arg) {
  marked_t *m = arg;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
  /* A zombie's environment reads empty: only the living count. */
  if (file_holds(path, m->id) && kill(pid, SIGKILL) == 0) m->n++;
}

/* ---- the guard ---- */

typedef struct {
  pid_t *v;
  int n, cap;
} groups_t;

/* meshrun died: kill what it left, until nothing is left or GUARD_WAIT_S. scan: look for the
 * processes by their environment even with a cgroup (a round started outside it). */
static void guard_cleanup(const tree_t *t, const groups_t *g, int scan) {
  double start = mono_now(), delay = 0.001;
  for (int i = 0; i < g->n; i++) kill(-g->v[i], SIGKILL);
  int left = 1;
  while (left && mono_now() - start < GUARD_WAIT_S) {
    left = 0;
    if (t->cgroup[0] && cgroup_populated(t->cgroup)) {
      char path[4200];
      snprintf(path, sizeof path, "%s/cgroup.kill", t->cgroup);
      int fd = open(path, O_WRONLY | O_CLOEXEC);
      if (fd >= 0 && write(fd, "1", 1) != 1) log_debug("guard: %s: %s", path, strerror(errno));
      if (fd >= 0) close(fd);
      left = 1;
    }
    if (!t->cgroup[0] || scan) {
      marked_t m = {t->id, 0};
      each_process(kill_if_marked, &m);
      left |= m.n > 0;
    }
    if (left) nap(&delay);
  }
  if (left)
    log_warn("guard: meshrun (pid %d) is gone; some of the processes of its workers still run after %gs",
             (int)t->self, GUARD_WAIT_S);
  else
    log_warn("guard: meshrun (pid %d) is gone: the processes of its workers are killed (%s, %.0f ms)", (int)t->self,
             !t->cgroup[0] ? "found through /proc" : scan ? "its cgroup, and through /proc" : "its cgroup",
             (mono_now() - start) * 1e3);
}

/* The guard's whole life: read meshrun's messages until EOF, clean up if meshrun said nothing
 * of being done, remove the cgroup once it is empty, exit. */
static int guard_main(void *arg) {
  tree_t *t = arg; /* the guard's own copy */
  setpgid(0, 0);
  prctl(PR_SET_NAME, "meshrun-guard");
  static const int IGNORED[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT, SIGPIPE};
  for (size_t i = 0; i < sizeof IGNORED / sizeof IGNORED[0]; i++) signal(IGNORED[i], SIG_IGN);
  signal(SIGCHLD, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  /* Descriptors: the pipe's read end on 3, /dev/null on 0 and 1, stderr kept for the last word,
   * none other (the write end above all: the guard must see EOF when meshrun is gone). */
  int fd = fcntl(t->guard_rd, F_DUPFD, 10);
  close(t->guard_rd);
  close(t->guard_fd);
  if (fd < 0) _exit(1);
  int null = open("/dev/null", O_RDWR);
  if (null >= 0) {
    dup2(null, STDIN_FILENO);
    dup2(null, STDOUT_FILENO);
    if (fcntl(STDERR_FILENO, F_GETFD) < 0) dup2(null, STDERR_FILENO);
  }
  if (dup2(fd, 3) != 3) _exit(1);
  fd = 3;
  if (close_range(4, ~0U, 0)) /* Linux before 5.9: one by one, as far as the limit goes */
    for (long i = 4, max = sysconf(_SC_OPEN_MAX); i < max && i < 65536; i++) close((int)i);
  groups_t g = {0};
  unsigned char buf[256];
  size_t have = 0;
  int done = 0, scan = 0;
  for (;;) {
    ssize_t k = read(fd, buf + have, sizeof buf - have);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    have += (size_t)k;
    size_t used = 0;
    while (used < have) {
      unsigned char op = buf[used];
      if (op == 'G' && have - used < 1 + sizeof(pid_t)) break; /* the rest comes with the next read */
      if (op == 'G') {
        pid_t pg;
        memcpy(&pg, buf + used + 1, sizeof pg);
        used += sizeof pg;
        if (g.n == g.cap) {
          int cap = g.cap ? 2 * g.cap : 64;
          pid_t *v = realloc(g.v, (size_t)cap * sizeof *v);
          if (v) g.v = v, g.cap = cap;
        }
        if (g.n < g.cap) g.v[g.n++] = pg;
      }
      if (op == 'R') g.n = scan = 0;
      if (op == 'X') scan = 1;
      if (op == 'P') t->cgroup[0] = '\0';
      if (op == 'D') done = 1;
      used++;
    }
    memmove(buf, buf + used, have - used);
    have -= used;
  }
  if (!done) guard_cleanup(t, &g, scan);
  if (!t->cgroup[0]) _exit(0);
  /* meshrun was in the cgroup: it can go once meshrun has exited. */
  double start = mono_now(), delay = 0.001;
  while (cgroup_populated(t->cgroup) && mono_now() - start < GUARD_WAIT_S) nap(&delay);
  nftw(t->cgroup, rm_dir, 8, FTW_DEPTH | FTW_PHYS);
  if (access(t->cgroup, F_OK) == 0) log_warn("guard: cannot remove cgroup %s: still in use", t->cgroup);
  _exit(0);
}

static void tell_guard(tree_t *t, const void *msg, size_t len) {
  if (t->guard_fd < 0) return;
  ssize_t k;
  do k = write(t->guard_fd, msg, len);
  while (k < 0 && errno == EINTR);
  if (k == (ssize_t)len) return;
  log_warn("the guard (pid %d) is gone: if meshrun is killed, what its workers started may survive", (int)t->guard);
  close(t->guard_fd);
  t->guard_fd = -1;
}

static void start_guard(tree_t *t) {
  enum { STACK = 64 * 1024 };
  int p[2];
  char *stack = malloc(STACK);
  if (!stack || pipe2(p, O_CLOEXEC)) {
    log_warn("no guard (%s): if meshrun is killed, what its workers started may survive", strerror(errno));
    free(stack);
    return;
  }
  /* The guard gets a copy of t: both ends of the pipe, to close the one it does not use. */
  t->guard_rd = p[0];
  t->guard_fd = p[1];
  pid_t pid = clone(guard_main, stack + STACK, 0, t);
  int e = errno;
  free(stack);
  close(p[0]);
  t->guard_rd = -1;
  if (pid < 0) {
    close(p[1]);
    t->guard_fd = -1;
    log_warn("no guard (clone: %s): if meshrun is killed, what its workers started may survive", strerror(e));
    return;
  }
  t->guard = pid;
}

/* ---- the API ---- */

int tree_create(tree_t **out, int use_cgroup, char *err, size_t errlen) {
  tree_t *t = calloc(1, sizeof *t);
  *out = NULL;
  if (!t) {
    return err_set(err, errlen, -ENOMEM, "tree: out of memory");
  }
  t->self = getpid();
  t->guard_fd = t->guard_rd = -1;
  unsigned long long tag = 0;
  if (getrandom(&tag, sizeof tag, 0) != (ssize_t)sizeof tag) tag = (unsigned long long)(mono_now() * 1e9);
  snprintf(t->id, sizeof t->id, "%d.%016llx", (int)t->self, tag);
  if (prctl(PR_SET_CHILD_SUBREAPER, 1))
    log_warn("cannot be the subreaper of the workers' processes (%s): what they leave may outlive them",
             strerror(errno));
  char why[4200] = "MESHRUN_CGROUP=0";
  if (use_cgroup && make_cgroup(t, why, sizeof why) == 0) log_debug("workers' processes kept in cgroup %s", t->cgroup);
  else log_debug("workers' processes found through /proc, not a cgroup: %s", why);
  start_guard(t);
  if (t->cgroup[0]) start_move(t);
  *out = t;
  return 0;
}

const char *tree_id(const tree_t *t) { return t->id; }

void tree_round(tree_t *t) {
  if (!move_pending(t) && t->cgroup[0] && t->move_err) {
    log_debug("cannot enter cgroup %s (%s): the workers' processes are found through /proc", t->cgroup,
              strerror(t->move_err));
    rmdir(t->cgroup);
    t->cgroup[0] = '\0';
    tell_guard(t, "P", 1);
  }
  tell_guard(t, "R", 1);
  /* Not in the cgroup yet (the rendezvous was quicker than the move): this round's workers are
   * born outside it, and the guard looks for them as it would without one. */
  t->outside = t->move != NULL;
  if (t->outside) tell_guard(t, "X", 1);
}

void tree_note_group(tree_t *t, pid_t pgid) {
  if (t->cgroup[0] && !t->outside) return;
  unsigned char msg[1 + sizeof pgid] = {'G'};
  memcpy(msg + 1, &pgid, sizeof pgid);
  tell_guard(t, msg, sizeof msg);
}

/* 1 while meshrun has a child (but the guard, a clone child), live or not yet reaped. */
static int has_children(void) {
  siginfo_t si;
  int rc;
  do rc = waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT);
  while (rc < 0 && errno == EINTR);
  return rc == 0;
}

int tree_kill(tree_t *t) {
  if (!t || !has_children()) return 0;
  /* Children left while the cgroup lists none: they are out of it (one moved itself out, or
   * went to a cgroup below it, as a nested meshrun does) or just past their exit from it but
   * not yet zombies: /proc finds them. */
  int n = move_pending(t) || !t->cgroup[0] || t->move_err ? 0 : kill_members(t->cgroup, t->self);
  return n ? n : kill_below(t->self, t->guard);
}

void tree_destroy(tree_t *t) {
  if (!t) return;
  /* The dead first: what is left after them is alive, and the guard kills it after meshrun's
   * exit (kill it here too). */
  int st;
  while (waitpid(-1, &st, WNOHANG) > 0) {
  }
  if (has_children()) tree_kill(t);
  else tell_guard(t, "D", 1);
  /* guard_fd stays open: its EOF at meshrun's exit tells the guard that no thread of meshrun
   * runs any more, so none can still move meshrun into the cgroup the guard is to remove. */
  if (t->move) move_release(t->move); /* a move still under way: its thread frees it */
  free(t);
}
