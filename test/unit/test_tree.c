// deps: launcher/tree.c common/log.c common/err.c
/* Unit tests of tree: what a worker leaves behind ends, with or without a cgroup. Each test forks
 * an "agent" process (the subreaper, the guard and the cgroup are per process, and this one
 * must stay clean); the agent forks a "worker" that leaves two sleeps behind, one under setsid
 * and one daemonized (setsid in a child that exits at once), and exits. The sleeps carry the
 * agent's MESHRUN_TREE id in their environment, as meshrun's workers do. Then either the agent
 * kills what is left (tree_kill, reaping until it has no child) or the test SIGKILLs the agent and
 * its guard must end them. With a cgroup the agent starts its worker once it is in the cgroup
 * (polled), or at once ("early": the worker is then most likely born outside it, which meshrun
 * and the guard must handle as without a cgroup); those cases skip where cgroup v2 is not
 * writable. Survivors are counted in /proc by pid (a zombie counts as ended) within a deadline,
 * polled. */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launcher/tree.h"

#define DEADLINE_S 5.0

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Alive and not a zombie. */
static int alive(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[k] = '\0';
  const char *p = strrchr(buf, ')');
  return p && p[1] == ' ' && p[2] != 'Z';
}

/* A sleep under setsid that carries id in its environment; its pid goes to fd. */
static void leave_sleep(const char *id, int fd) {
  pid_t pid = fork();
  if (pid != 0) {
    ssize_t k = write(fd, &pid, sizeof pid);
    (void)k;
    return;
  }
  setsid();
  char env[96];
  snprintf(env, sizeof env, "MESHRUN_TREE=%s", id);
  char *envp[] = {env, NULL};
  execle("/bin/sleep", "sleep", "300", (char *)NULL, envp);
  _exit(127);
}

/* The worker: a setsid'd sleep, a daemonized one (its parent exits at once), then exit. */
static void worker(const char *id, int fd) {
  leave_sleep(id, fd);
  pid_t mid = fork();
  if (mid == 0) {
    leave_sleep(id, fd);
    _exit(0);
  }
  waitpid(mid, NULL, 0);
  _exit(0);
}

/* Whether this process is in a meshrun cgroup. */
static int in_cgroup(void) {
  char line[512] = "";
  FILE *f = fopen("/proc/self/cgroup", "r");
  while (f && fgets(line, sizeof line, f) && strncmp(line, "0::", 3)) {
  }
  if (f) fclose(f);
  return strstr(line, "/meshrun-") != NULL;
}

enum { PROC, CGROUP, CGROUP_EARLY };

/* The agent: a tree, a worker that leaves two sleeps (their pids to fd), then, once the test
 * has seen them (a byte on go), either the cleanup of meshrun's round end or a pause until the
 * test kills it. Exits 0, or the step that failed. */
static void agent(int mode, int cleanup, int fd, int go) {
  char err[256];
  tree_t *t;
  if (tree_create(&t, mode != PROC, err, sizeof err)) _exit(2);
  for (double end = now_s() + DEADLINE_S; mode == CGROUP && !in_cgroup() && now_s() < end;) usleep(1000);
  if (mode != CGROUP_EARLY && in_cgroup() != (mode == CGROUP)) _exit(3); /* in the cgroup when asked */
  tree_round(t);
  pid_t w = fork();
  if (w == 0) worker(tree_id(t), fd);
  tree_note_group(t, w);
  waitpid(w, NULL, 0);
  char byte;
  if (read(go, &byte, 1) != 1) _exit(5);
  if (!cleanup) pause();
  double end = now_s() + DEADLINE_S;
  for (;;) { /* what reap() does: kill, reap, until no child is left */
    int st;
    while (waitpid(-1, &st, WNOHANG) > 0) {
    }
    if (waitpid(-1, &st, WNOHANG) < 0 && errno == ECHILD) break;
    if (now_s() > end) _exit(4);
    tree_kill(t);
    usleep(1000);
  }
  tree_destroy(t);
  _exit(0);
}

/* Whether a tree gets its cgroup here: tried in a child, which the move into one would change. */
static int cgroup_writable(void) {
  char err[256];
  pid_t pid = fork();
  if (pid == 0) { /* a throwaway tree: in its cgroup within the deadline, or not */
    tree_t *t;
    if (tree_create(&t, 1, err, sizeof err)) _exit(1);
    for (double end = now_s() + DEADLINE_S; !in_cgroup() && now_s() < end;) usleep(1000);
    int in = in_cgroup();
    tree_destroy(t);
    _exit(in ? 0 : 1);
  }
  int st;
  return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void run_case(int mode, int cleanup) {
  if (mode != PROC && !cgroup_writable()) {
    print_message("cgroup v2 is not writable here: skipped\n");
    skip();
  }
  int p[2], go[2];
  assert_int_equal(pipe(p), 0);
  assert_int_equal(pipe(go), 0);
  pid_t a = fork();
  assert_true(a >= 0);
  if (a == 0) {
    close(p[0]);
    close(go[1]);
    agent(mode, cleanup, p[1], go[0]);
  }
  close(p[1]);
  close(go[0]);
  pid_t left[2] = {0, 0};
  size_t have = 0;
  ssize_t k;
  while (have < sizeof left && (k = read(p[0], (char *)left + have, sizeof left - have)) > 0) have += (size_t)k;
  close(p[0]);
  int started = have == sizeof left && alive(left[0]) && alive(left[1]);
  if (started && write(go[1], "g", 1) != 1) started = 0;
  close(go[1]);
  double t0 = now_s();
  if (!cleanup || !started) kill(a, SIGKILL); /* the case itself, or nothing of it may stay */
  int st;
  assert_int_equal(waitpid(a, &st, 0), a);
  while (started && (alive(left[0]) || alive(left[1])) && now_s() - t0 < DEADLINE_S) usleep(1000);
  int survivors = started ? alive(left[0]) + alive(left[1]) : 0;
  static const char *const NAMES[] = {"/proc", "cgroup", "cgroup early"};
  print_message("%s, %s: setsid'd sleep %s, daemonized sleep %s, %.1f ms after %s\n", NAMES[mode],
                cleanup ? "tree_kill" : "kill -9 of the agent",
                alive(left[0]) ? "ALIVE" : "gone", alive(left[1]) ? "ALIVE" : "gone", (now_s() - t0) * 1e3,
                cleanup ? "the go" : "the kill");
  for (int i = 0; i < 2; i++)
    if (left[i] > 0 && alive(left[i])) kill(left[i], SIGKILL);
  assert_true(started);
  if (cleanup) assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  assert_int_equal(survivors, 0);
}

/* One case: {mode, cleanup} as the test's state. */
static void test_case(void **state) {
  const int *c = *state;
  run_case(c[0], c[1]);
}

int main(void) {
  /* tree_kill at a round's end, then the guard after kill -9, each without a cgroup, in one, and
   * started before the agent is in it */
  static int cases[][2] = {{PROC, 1}, {CGROUP, 1}, {CGROUP_EARLY, 1}, {PROC, 0}, {CGROUP, 0}, {CGROUP_EARLY, 0}};
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_prestate(test_case, cases[0]), cmocka_unit_test_prestate(test_case, cases[1]),
      cmocka_unit_test_prestate(test_case, cases[2]), cmocka_unit_test_prestate(test_case, cases[3]),
      cmocka_unit_test_prestate(test_case, cases[4]), cmocka_unit_test_prestate(test_case, cases[5]),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
