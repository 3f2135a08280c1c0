/* fixture: a store server process + forked ranks for multi-process C tests, and the helpers their
 * ranks share (see fixture.h). */
#include "test/support/fixture.h"

#include <signal.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "launcher/store_server.h"

/* The store server runs in a process of its own, not a thread: the ranks are forked from this
 * process, and a fork while another thread holds a lock (ASAN's allocator lock, say) leaves
 * the child deadlocked on it. The parent stays single-threaded; the server process reports its
 * port through a pipe and runs until it is killed. */
typedef struct {
  pid_t pid;
  int port;
} server_t;

static void server_main(int wfd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test, even if it crashes */
  uv_loop_t loop;
  store_server_t *srv = NULL;
  char err[256] = "";
  int port = -1;
  if (uv_loop_init(&loop) != 0 ||
      store_server_start(&srv, &loop, "127.0.0.1", 0, NULL, &port, err, sizeof err) != 0) {
    fprintf(stderr, "fixture: store_server_start: %s\n", err);
    port = -1;
  }
  ssize_t w = write(wfd, &port, sizeof port);
  close(wfd);
  if (port < 0 || w != (ssize_t)sizeof port) _exit(1);
  uv_run(&loop, UV_RUN_DEFAULT);
  _exit(0);
}

static int server_start(server_t *s) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  fflush(NULL);
  s->pid = fork();
  if (s->pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (s->pid == 0) {
    close(fds[0]);
    server_main(fds[1]);
  }
  close(fds[1]);
  ssize_t r = read(fds[0], &s->port, sizeof s->port);
  close(fds[0]);
  if (r != (ssize_t)sizeof s->port || s->port <= 0) {
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    return -1;
  }
  return 0;
}

static void server_stop(server_t *s) {
  kill(s->pid, SIGKILL);
  waitpid(s->pid, NULL, 0);
}

static void child_run(int rank, int n, int port, fixture_rank_fn fn, void *arg, int alarm_s) {
  alarm((unsigned)alarm_s);
  char err[512] = "", ep[64];
  snprintf(ep, sizeof ep, "127.0.0.1:%d", port);
  store_t *st = NULL;
  if (store_connect_endpoint(&st, ep, NULL, 10000, err, sizeof err) != 0) {
    fprintf(stderr, "rank %d: store: %s\n", rank, err);
    _exit(3);
  }
  int rc = fn(rank, n, st, arg);
  store_close(st);
  fflush(NULL);
  _exit(rc == 0 ? 0 : 1);
}

int fixture_run_ranks(int n, fixture_rank_fn fn, void *arg, int alarm_s) {
  if (n < 1 || n > 64) return -1;
  server_t srv;
  if (server_start(&srv) != 0) return -1;
  fflush(NULL);
  pid_t pgid = 0, pids[64];
  for (int r = 0; r < n; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("fixture: fork");
      if (pgid) kill(-pgid, SIGKILL);
      n = r;
      break;
    }
    if (pid == 0) {
      setpgid(0, pgid);
      child_run(r, n, srv.port, fn, arg, alarm_s);
    }
    setpgid(pid, pgid ? pgid : pid); /* also here, so the group exists before we kill it */
    if (!pgid) pgid = pid;
    pids[r] = pid;
  }
  int failed = 0, left = n;
  while (left > 0) {
    int st;
    pid_t pid = waitpid(-pgid, &st, 0);
    if (pid < 0) break;
    left--;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    int r = -1;
    for (int i = 0; i < n; i++)
      if (pids[i] == pid) r = i;
    if (WIFSIGNALED(st))
      fprintf(stderr, "rank %d: killed by signal %d\n", r, WTERMSIG(st));
    else
      fprintf(stderr, "rank %d: exit status %d\n", r, WEXITSTATUS(st));
    if (!failed) kill(-pgid, SIGKILL);
    failed++;
  }
  server_stop(&srv);
  return failed;
}

int fixture_comm_open(comm_t **c, const char *name, int rank, int n, store_t *st, int timeout_ms) {
  char err[512] = "";
  comm_config_t cfg = {.name = name, .rank = rank, .size = n, .store = st, .host = "127.0.0.1",
                       .timeout_ms = timeout_ms};
  int rc = comm_create(c, "cpu", &cfg, err, sizeof err);
  if (rc != COMM_OK) fprintf(stderr, "rank %d: comm_create: %s\n", rank, err);
  return rc;
}

double fixture_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int fixture_await_key(store_t *st, const char *key, int timeout_ms) {
  void *v = NULL;
  size_t len = 0;
  int rc = store_get(st, key, &v, &len, timeout_ms);
  free(v);
  if (rc) fprintf(stderr, "store key %s did not appear within %d ms\n", key, timeout_ms);
  return rc;
}

/* The third field (the maximum) of a /proc/sys/net/ipv4 "min default max" triple; 0 when absent. */
static size_t proc_max(const char *path) {
  unsigned long a = 0, b = 0, m = 0;
  FILE *f = fopen(path, "r");
  if (f && fscanf(f, "%lu %lu %lu", &a, &b, &m) != 3) m = 0;
  if (f) fclose(f);
  return (size_t)m;
}

size_t fixture_unbufferable_bytes(void) {
  size_t b = 2 * (proc_max("/proc/sys/net/ipv4/tcp_wmem") + proc_max("/proc/sys/net/ipv4/tcp_rmem"));
  return b < ((size_t)64 << 20) ? (size_t)64 << 20 : b;
}
