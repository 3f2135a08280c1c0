/* health_probe: the trainer's GEMM probe as a child of the health check's thread (see
 * health_probe.h). posix_spawn rather than uv_spawn: the caller is a thread of its own that
 * may block, and the loop must not see this child as one of its handles. */
#include "launcher/health_probe.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/net.h"

extern char **environ;

#define OUT_MAX 4096      /* the probe's stdout kept: its line is ~100 bytes */
#define ERR_TAIL 600      /* the end of its stderr kept, for the reason of a failure */
#define SLICE_MS 100      /* how often a wait looks at *stop */
#define REAP_MS 5000      /* the most a killed child may take to end */

/* ---- the line ---- */

int health_probe_parse(const char *out, size_t len, health_probe_t *p, char *err, size_t errlen) {
  memset(p, 0, sizeof *p);
  size_t start = len;
  for (size_t i = 0; i < len; i++)
    if (out[i] == '{' && (i == 0 || out[i - 1] == '\n')) start = i;
  if (start == len) return err_set(err, errlen, -1, "no line of JSON on its stdout");
  size_t end = start;
  while (end < len && out[end] != '\n') end++;
  cJSON *root = cJSON_ParseWithLength(out + start, end - start);
  const cJSON *g = cJSON_GetObjectItemCaseSensitive(root, "gflops");
  const cJSON *dev = cJSON_GetObjectItemCaseSensitive(root, "device");
  const cJSON *devs = cJSON_GetObjectItemCaseSensitive(root, "devices");
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(root, "dtype");
  int rc = 0;
  if (!root)
    rc = err_set(err, errlen, -1, "its line \"%.*s\" is not JSON", (int)(end - start < 100 ? end - start : 100),
                 out + start);
  else if (!cJSON_IsNumber(g) || !(g->valuedouble > 0))
    rc = err_set(err, errlen, -1, "its line has no \"gflops\" > 0");
  else if (!cJSON_IsString(dev) || !dev->valuestring[0] || strlen(dev->valuestring) >= sizeof p->device ||
           strpbrk(dev->valuestring, " \t\n"))
    rc = err_set(err, errlen, -1, "its line has no \"device\" name (a word of at most %zu characters)",
                 sizeof p->device - 1);
  else if (!cJSON_IsArray(devs) || cJSON_GetArraySize(devs) < 1)
    rc = err_set(err, errlen, -1, "its line has no \"devices\" rates");
  if (!rc) {
    p->gflops = g->valuedouble;
    p->devices = cJSON_GetArraySize(devs);
    snprintf(p->device, sizeof p->device, "%s", dev->valuestring);
    snprintf(p->dtype, sizeof p->dtype, "%s", cJSON_IsString(dt) ? dt->valuestring : "");
  }
  cJSON_Delete(root);
  return rc;
}

int health_probe_path(char *path, size_t len, char *err, size_t errlen) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return err_set(err, errlen, -1, "no trainer beside meshrun (/proc/self/exe: %s)", strerror(errno));
  self[n] = 0;
  char *slash = strrchr(self, '/');
  if (slash) *slash = 0;
  int k = snprintf(path, len, "%s/trainer", slash ? self : ".");
  if (k < 0 || (size_t)k >= len) return err_set(err, errlen, -1, "no trainer beside meshrun (%s: too long)", self);
  if (access(path, X_OK)) return err_set(err, errlen, -1, "no trainer beside meshrun (%s)", path);
  return 0;
}

/* ---- the child ---- */

typedef struct {
  pid_t pid;
  int out, err;        /* the pipes' read ends, -1 once at EOF */
  char buf[OUT_MAX];
  size_t n;
  char tail[ERR_TAIL]; /* the end of stderr, terminated */
  size_t tn;
  int status, reaped;  /* reaped 0: the loop's SIGCHLD reaped it, its status is unknown */
} probe_t;

/* meshrun's environment without the variables set here, then LOCAL_WORLD_SIZE and, as the
 * workers get it, OMP_NUM_THREADS. NULL when out of memory (vars holds the strings). */
static char **child_env(int nproc, char vars[2][64]) {
  size_t n = 0;
  while (environ[n]) n++;
  char **env = calloc(n + 3, sizeof *env);
  if (!env) return NULL;
  int omp = !getenv("OMP_NUM_THREADS") && nproc > 1;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "LOCAL_WORLD_SIZE=", 17) && !(omp && !strncmp(environ[i], "OMP_NUM_THREADS=", 16)))
      env[k++] = environ[i];
  snprintf(vars[0], sizeof vars[0], "LOCAL_WORLD_SIZE=%d", nproc > 0 ? nproc : 1);
  env[k++] = vars[0];
  if (omp) {
    snprintf(vars[1], sizeof vars[1], "OMP_NUM_THREADS=1");
    env[k++] = vars[1];
  }
  return env;
}

static int spawn(probe_t *c, const char *path, int nproc, char *err, size_t errlen) {
  int po[2] = {-1, -1}, pe[2] = {-1, -1}, rc = -1;
  char vars[2][64];
  char **env = child_env(nproc, vars);
  char *argv[] = {(char *)path, HEALTH_PROBE_FLAG, NULL};
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t at;
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawn_file_actions_init(&fa);
  posix_spawnattr_init(&at);
  if (!env || pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC)) {
    err_set(err, errlen, -1, "cannot start %s: %s", path, env ? strerror(errno) : "out of memory");
    goto out;
  }
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, po[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
  /* This thread's mask and meshrun's handlers are not the probe's: defaults, nothing blocked. */
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setsigmask(&at, &none);
  posix_spawnattr_setsigdefault(&at, &all);
  posix_spawnattr_setpgroup(&at, 0);
  int e = posix_spawn(&c->pid, path, &fa, &at, argv, env);
  if (e) {
    err_set(err, errlen, -1, "cannot start %s: %s", path, strerror(e));
    goto out;
  }
  c->out = po[0];
  c->err = pe[0];
  po[0] = pe[0] = -1;
  rc = 0;
out:
  for (int i = 0; i < 2; i++) {
    if (po[i] >= 0) close(po[i]);
    if (pe[i] >= 0) close(pe[i]);
  }
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  free(env);
  return rc;
}

/* One read from a ready pipe: stdout kept up to OUT_MAX, stderr's last ERR_TAIL - 1 bytes. */
static void drain(probe_t *c, int *fd, int is_out) {
  char b[1024];
  ssize_t k = read(*fd, b, sizeof b);
  if (k < 0 && errno == EINTR) return;
  if (k <= 0) {
    close(*fd);
    *fd = -1;
    return;
  }
  if (is_out) {
    size_t take = (size_t)k < OUT_MAX - c->n ? (size_t)k : OUT_MAX - c->n;
    memcpy(c->buf + c->n, b, take);
    c->n += take;
    return;
  }
  for (ssize_t i = 0; i < k; i++) {
    if (c->tn + 1 >= sizeof c->tail) {
      memmove(c->tail, c->tail + sizeof c->tail / 2, sizeof c->tail / 2);
      c->tn -= sizeof c->tail / 2;
    }
    c->tail[c->tn++] = b[i];
  }
  c->tail[c->tn] = 0;
}

/* Reads both pipes until EOF on both; 0, or -1 with err at the deadline or on *stop. */
static int collect(probe_t *c, double timeout_s, atomic_int *stop, char *err, size_t errlen) {
  int64_t deadline = net_now_ms() + (int64_t)(timeout_s * 1000);
  while (c->out >= 0 || c->err >= 0) {
    if (atomic_load(stop)) return err_set(err, errlen, -1, "stopped");
    int64_t left = deadline - net_now_ms();
    if (left <= 0) return err_set(err, errlen, -1, "it did not answer within %gs", timeout_s);
    struct pollfd p[2] = {{.fd = c->out, .events = POLLIN}, {.fd = c->err, .events = POLLIN}};
    if (poll(p, 2, left < SLICE_MS ? (int)left : SLICE_MS) < 0 && errno != EINTR)
      return err_set(err, errlen, -1, "poll: %s", strerror(errno));
    if (c->out >= 0 && p[0].revents) drain(c, &c->out, 1);
    if (c->err >= 0 && p[1].revents) drain(c, &c->err, 0);
  }
  return 0;
}

/* Waits for the child's end, at most REAP_MS. ECHILD: the loop reaped it (reaped stays 0). */
static void reap(probe_t *c) {
  for (int ms = 0; ms < REAP_MS; ms += 5) {
    pid_t r = waitpid(c->pid, &c->status, WNOHANG);
    if (r == c->pid) {
      c->reaped = 1;
      return;
    }
    if (r < 0 && errno != EINTR) return;
    struct timespec ts = {.tv_nsec = 5000000};
    nanosleep(&ts, NULL);
  }
}

/* Why a child that ended gave no usable line: its status where this thread reaped it, and its
 * last line on stderr, which says more than the missing line does; else what was wrong with
 * its line. */
static void failure(const probe_t *c, const char *parse_err, char *err, size_t errlen) {
  char st[64] = "";
  if (c->reaped && WIFEXITED(c->status) && WEXITSTATUS(c->status))
    snprintf(st, sizeof st, "exit status %d", WEXITSTATUS(c->status));
  else if (c->reaped && WIFSIGNALED(c->status))
    snprintf(st, sizeof st, "killed by signal %d", WTERMSIG(c->status));
  const char *line = c->tail;
  size_t n = strlen(line);
  while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--;
  size_t s = n;
  while (s > 0 && line[s - 1] != '\n') s--;
  if (n > s)
    err_set(err, errlen, -1, "%s%s%.*s", st, st[0] ? ": " : "", (int)(n - s), line + s);
  else
    err_set(err, errlen, -1, "%s", st[0] ? st : parse_err);
}

int health_probe_run(const char *path, int nproc, double timeout_s, atomic_int *stop, health_probe_t *p, char *err,
                     size_t errlen) {
  probe_t *c = calloc(1, sizeof *c);
  if (!c) return err_set(err, errlen, -1, "out of memory");
  c->out = c->err = -1;
  int rc = spawn(c, path, nproc, err, errlen);
  if (rc) {
    free(c);
    return rc;
  }
  rc = collect(c, timeout_s, stop, err, errlen);
  /* Its stdout still open: it has not exited, so the pid and its group are still its own. */
  if (rc && c->out >= 0) kill(-c->pid, SIGKILL);
  if (c->out >= 0) close(c->out);
  if (c->err >= 0) close(c->err);
  reap(c);
  char perr[256] = "";
  if (!rc && (health_probe_parse(c->buf, c->n, p, perr, sizeof perr) ||
              (c->reaped && !(WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0)))) {
    failure(c, perr, err, errlen);
    rc = -1;
  }
  free(c);
  return rc;
}
