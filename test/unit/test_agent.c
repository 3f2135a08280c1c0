// deps: launcher/agent.c launcher/hang.c launcher/hang_share.c launcher/health.c launcher/health_probe.c common/gemm_rate.c launcher/diagnose.c common/dump.c launcher/cli.c launcher/cli_slurm.c launcher/cli_probe.c launcher/cli_help.c launcher/errfile.c launcher/rdzv.c launcher/rdzv_kv_store.c launcher/rdzv_kv_etcd.c launcher/store_server.c launcher/tree.c launcher/workers.c launcher/console.c common/etcd.c common/http.c common/gpus_cuda.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c
/* test_agent: meshrun's agent (launcher/agent.h) run whole, in-process: agent_run in a forked
 * child of the test (it owns the process: its loop, signal handlers, subreaper), with
 * --standalone, so that it serves its own store and rendezvous on 127.0.0.1 at a free port.
 * The workers are /bin/sh -c snippets that append TORCHELASTIC_RESTART_COUNT to a file per local
 * rank, so the test sees every attempt of every worker. The parent waits for the child's exit;
 * the child has an alarm so that nothing can hang the suite.
 * - a worker that fails once (local rank 1, exit 1) with --max_restarts=1: the round restarts,
 *   every worker runs again with restart count 1, and the job ends 0;
 * - a worker that always fails (exit 3) with --max_restarts=2: three attempts, then meshrun
 *   exits with the worker's code 3;
 * - exit 2 (a usage or plan error) is never retried: one attempt, meshrun exits 2, even with
 *   restarts left. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "launcher/agent.h"
#include "launcher/cli.h"

#define ALARM_S 60

/* meshrun --standalone --nproc_per_node=2 --max_restarts=N /bin/sh -c script, in a child, with
 * TEST_AGENT_DIR=dir; returns its exit status (-1: it did not exit normally). */
static int run_agent(const char *dir, int max_restarts, const char *script) {
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    alarm(ALARM_S);
    setenv("TEST_AGENT_DIR", dir, 1);
    setenv("MESHRUN_CGROUP", "0", 1);
    char restarts[32];
    snprintf(restarts, sizeof restarts, "--max_restarts=%d", max_restarts);
    char *argv[] = {"meshrun", "--standalone", "--nproc_per_node=2", restarts, "--monitor_interval=0.05",
                    "/bin/sh", "-c", (char *)script, NULL};
    launcher_opts_t o;
    char err[1024] = "";
    cli_defaults(&o);
    if (cli_parse(&o, 8, argv, err, sizeof err)) {
      fprintf(stderr, "cli_parse: %s\n", err);
      _exit(100);
    }
    signal(SIGPIPE, SIG_IGN); /* as meshrun's main */
    int rc = agent_run(&o);
    fflush(NULL);
    _exit(rc);
  }
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  if (WIFSIGNALED(st)) printf("  meshrun ended by signal %d\n", WTERMSIG(st));
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The restart counts local rank lr ran with, one a line ("" when it never ran). */
static void attempts(const char *dir, int lr, char *out, size_t len) {
  char path[512];
  snprintf(path, sizeof path, "%s/runs.%d", dir, lr);
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(out, 1, len - 1, f) : 0;
  out[n] = 0;
  if (f) fclose(f);
}

typedef struct {
  int max_restarts;
  const char *script;
  int want_rc;
  const char *want_runs; /* of each local rank */
} case_t;

/* Each worker records its attempt; local rank 1, the one that fails, first waits (polling) until
 * local rank 0 has recorded the same attempt: its failure stops rank 0, which must have run. */
static const char RECORD[] =
    "D=$TEST_AGENT_DIR; echo \"$TORCHELASTIC_RESTART_COUNT\" >> \"$D/runs.$LOCAL_RANK\"; "
    "[ \"$LOCAL_RANK\" = 1 ] && until grep -qx \"$TORCHELASTIC_RESTART_COUNT\" \"$D/runs.0\" 2>/dev/null; do :; done; ";

/* A list of lines as one, for printing ("0\n1\n" as "0 1"). */
static void one_line(char out[256], const char *s) {
  snprintf(out, 256, "%s", s);
  for (char *p = out; *p; p++)
    if (*p == '\n') *p = p[1] ? ' ' : 0;
}

static void run_case(const case_t *c) {
  char dir[] = "/tmp/test_agent.XXXXXX";
  assert_non_null(mkdtemp(dir));
  char script[1024];
  snprintf(script, sizeof script, "%s%s", RECORD, c->script);
  const int rc = run_agent(dir, c->max_restarts, script);
  char runs[2][256];
  for (int lr = 0; lr < 2; lr++) attempts(dir, lr, runs[lr], sizeof runs[lr]);
  char shown[3][256];
  one_line(shown[0], runs[0]);
  one_line(shown[1], runs[1]);
  one_line(shown[2], c->want_runs);
  printf("  --max_restarts=%d: meshrun exited %d (want %d); restart counts of local rank 0: [%s], 1: [%s] (want "
         "[%s] for both)\n", c->max_restarts, rc, c->want_rc, shown[0], shown[1], shown[2]);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
  assert_int_equal(rc, c->want_rc);
  assert_string_equal(runs[0], c->want_runs);
  assert_string_equal(runs[1], c->want_runs);
}

static void test_restart_after_a_failure(void **state) {
  const case_t c = {1, "[ \"$LOCAL_RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && exit 1; exit 0", 0,
                    "0\n1\n"};
  run_case(&c);
}

static void test_restarts_exhausted(void **state) {
  const case_t c = {2, "[ \"$LOCAL_RANK\" = 1 ] && exit 3; exit 0", 3, "0\n1\n2\n"};
  run_case(&c);
}

static void test_exit_2_is_not_retried(void **state) {
  const case_t c = {2, "[ \"$LOCAL_RANK\" = 1 ] && exit 2; exit 0", 2, "0\n"};
  run_case(&c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_restart_after_a_failure),
      cmocka_unit_test(test_restarts_exhausted),
      cmocka_unit_test(test_exit_2_is_not_retried),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
