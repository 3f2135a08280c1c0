/* fixture: store server thread + forked ranks for multi-process C tests (see fixture.h). */
#include "test/support/fixture.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#include "launcher/store_server.h"

typedef struct {
  uv_loop_t loop;
  uv_async_t stop;
  store_server_t *srv;
  pthread_t thread;
  int port;
} server_t;

static void on_stop(uv_async_t *a) {
  server_t *s = a->data;
  store_server_close(s->srv);
  uv_close((uv_handle_t *)&s->stop, NULL);
}

static void *server_main(void *arg) {
  server_t *s = arg;
  uv_run(&s->loop, UV_RUN_DEFAULT);
  return NULL;
}

static int server_start(server_t *s) {
  char err[256] = "";
  if (uv_loop_init(&s->loop) != 0) return -1;
  s->stop.data = s;
  if (uv_async_init(&s->loop, &s->stop, on_stop) != 0) return -1;
  if (store_server_start(&s->srv, &s->loop, "127.0.0.1", 0, &s->port, err, sizeof err) != 0) {
    fprintf(stderr, "fixture: store_server_start: %s\n", err);
    return -1;
  }
  return pthread_create(&s->thread, NULL, server_main, s) == 0 ? 0 : -1;
}

static void server_stop(server_t *s) {
  uv_async_send(&s->stop);
  pthread_join(s->thread, NULL);
  uv_loop_close(&s->loop);
}

static void child_run(int rank, int n, int port, fixture_rank_fn fn, void *arg, int alarm_s) {
  alarm((unsigned)alarm_s);
  char err[512] = "", ep[64];
  snprintf(ep, sizeof ep, "127.0.0.1:%d", port);
  store_t *st = NULL;
  if (store_connect_endpoint(&st, ep, 10000, err, sizeof err) != 0) {
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
