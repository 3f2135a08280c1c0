// deps: launcher/workers.c launcher/console.c launcher/tree.c launcher/cli.c launcher/cli_slurm.c launcher/cli_probe.c launcher/cli_help.c common/gpus_cuda.c common/net.c common/err.c common/fs.c common/log.c
/* test_workers: one round's worker processes (launcher/workers.h), in this process on a libuv
 * loop, with /bin/sh -c snippets as the workers (MESHRUN_CGROUP=0: the /proc way, which every
 * machine has). The loop runs until the round is idle (every worker reaped, its output
 * drained), with a deadline that fails the test instead of hanging it; no sleeps.
 * - the environment torchrun's users read (RANK = rank_offset + local rank, LOCAL_RANK,
 *   WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR/PORT,
 *   TORCHELASTIC_*) and meshrun's own (MESHRUN_STORE, _ROUND, _JOB_ID, _STOP_FILE) reach each
 *   worker with the round's values, over stale ones in meshrun's environment; other variables
 *   pass through;
 * - exit codes reach the exit callback (0, 3, and 128+9 with term_signal 9 for a SIGKILL), the
 *   stderr tail of a failed worker is there in its callback, and with log files a worker's
 *   stdout is in <attempt_dir>/<rank>/stdout.log;
 * - workers_stop writes the reason into the stop file, SIGTERMs each group (a worker that traps
 *   it reads the reason and exits 0) and SIGKILLs the group that ignores it after the grace. */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "launcher/workers.h"

#define DEADLINE_MS 20000
/* SIGTERM to SIGKILL: long enough for a trap that reads a file on a loaded machine */
#define GRACE_S 2.0

typedef struct {
  uv_loop_t loop;
  uv_timer_t deadline, poll;
  launcher_opts_t opts;
  workers_t *w;
  char dir[256];
  int exits, idle, timed_out;
  workers_info_t info[2];
  char tail[2][WORKERS_TAIL_BYTES + 1];
} ctx_t;

static void on_exit_cb(workers_t *w, const workers_info_t *info, void *arg) {
  ctx_t *c = arg;
  assert_true(info->local_rank >= 0 && info->local_rank < 2);
  c->info[info->local_rank] = *info;
  size_t n = workers_stderr_tail(w, info->local_rank, c->tail[info->local_rank], WORKERS_TAIL_BYTES);
  c->tail[info->local_rank][n] = 0;
  c->exits++;
}

static void on_idle_cb(workers_t *w, void *arg) {
  ctx_t *c = arg;
  c->idle = 1;
  uv_stop(&c->loop);
}

static void on_deadline(uv_timer_t *t) {
  ctx_t *c = t->data;
  c->timed_out = 1;
  uv_stop(&c->loop);
}

static char *path_in(const ctx_t *c, const char *name) {
  static char p[512];
  snprintf(p, sizeof p, "%s/%s", c->dir, name);
  return p;
}

/* Builds workers for `/bin/sh -c script` on nproc 2 with the given extra flags. */
static void open_ctx(ctx_t *c, const char *script, int log_files) {
  memset(c, 0, sizeof *c);
  setenv("MESHRUN_CGROUP", "0", 1);
  snprintf(c->dir, sizeof c->dir, "/tmp/test_workers.XXXXXX");
  assert_non_null(mkdtemp(c->dir));
  setenv("TEST_WORKERS_DIR", c->dir, 1);
  static char *argv[8];
  static char scr[2048];
  snprintf(scr, sizeof scr, "%s", script);
  char *a[] = {"meshrun", "--nproc_per_node=2", "/bin/sh", "-c", scr, NULL};
  memcpy(argv, a, sizeof a);
  char err[1024] = "";
  cli_defaults(&c->opts);
  assert_int_equal(cli_parse(&c->opts, 5, argv, err, sizeof err), 0);
  assert_int_equal(uv_loop_init(&c->loop), 0);
  int rc = workers_create(&c->w, &c->loop, &c->opts, on_exit_cb, on_idle_cb, c, err, sizeof err);
  if (rc) printf("  workers_create: %s\n", err);
  assert_int_equal(rc, 0);
  uv_timer_init(&c->loop, &c->deadline);
  uv_timer_init(&c->loop, &c->poll);
  c->deadline.data = c->poll.data = c;
  uv_timer_start(&c->deadline, on_deadline, DEADLINE_MS, 0);
  workers_round_t r = {.restart_count = 1, .round = 5, .rank_offset = 4, .world_size = 8, .group_rank = 2,
                       .group_world_size = 4, .nproc = 2, .master_addr = "10.1.2.3", .master_port = 29555,
                       .store_endpoint = "127.0.0.1:1234", .run_id = "job7", .job_id = "job7@127.0.0.1:1234",
                       .max_restarts = 3, .log_files = log_files};
  snprintf(r.attempt_dir, sizeof r.attempt_dir, "%s/attempt_5", c->dir);
  rc = workers_start(c->w, &r, err, sizeof err);
  if (rc) printf("  workers_start: %s\n", err);
  assert_int_equal(rc, 0);
}

/* Runs the loop until the round is idle (or the deadline). */
static void run_until_idle(ctx_t *c) {
  if (!c->idle) uv_run(&c->loop, UV_RUN_DEFAULT);
  assert_false(c->timed_out);
  assert_true(c->idle);
  assert_int_equal(c->exits, 2);
  assert_int_equal(workers_running(c->w), 0);
  assert_true(workers_idle(c->w));
}

static void close_ctx(ctx_t *c) {
  workers_close(c->w);
  uv_close((uv_handle_t *)&c->deadline, NULL);
  uv_close((uv_handle_t *)&c->poll, NULL);
  uv_run(&c->loop, UV_RUN_DEFAULT);
  workers_destroy(c->w);
  assert_int_equal(uv_loop_close(&c->loop), 0);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", c->dir);
  assert_int_equal(system(cmd), 0);
}

/* The value of NAME in the `env` dump of a local rank ("" when absent). */
static const char *env_of(const ctx_t *c, int lr, const char *name) {
  static char val[1024];
  char file[64], line[2048];
  snprintf(file, sizeof file, "env.%d", lr);
  FILE *f = fopen(path_in(c, file), "r");
  assert_non_null(f);
  val[0] = 0;
  size_t l = strlen(name);
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, name, l) && line[l] == '=') {
      snprintf(val, sizeof val, "%s", line + l + 1);
      val[strcspn(val, "\n")] = 0;
    }
  fclose(f);
  return val;
}

static void test_environment_and_exit_codes(void **state) {
  /* stale values a worker must not see */
  setenv("RANK", "99", 1);
  setenv("MASTER_PORT", "1", 1);
  setenv("TEST_WORKERS_PASS", "through", 1);
  ctx_t c;
  open_ctx(&c, "env > \"$TEST_WORKERS_DIR/env.$LOCAL_RANK\"; echo \"hello from rank $RANK\"; "
               "[ \"$LOCAL_RANK\" = 0 ] && exit 0; echo boom >&2; exit 3", 1);
  run_until_idle(&c);
  const struct {
    const char *name, *v0, *v1;
  } want[] = {
      {"RANK", "4", "5"}, {"LOCAL_RANK", "0", "1"}, {"WORLD_SIZE", "8", "8"}, {"LOCAL_WORLD_SIZE", "2", "2"},
      {"GROUP_RANK", "2", "2"}, {"GROUP_WORLD_SIZE", "4", "4"}, {"ROLE_RANK", "4", "5"},
      {"ROLE_WORLD_SIZE", "8", "8"}, {"ROLE_NAME", "default", "default"}, {"MASTER_ADDR", "10.1.2.3", "10.1.2.3"},
      {"MASTER_PORT", "29555", "29555"}, {"TORCHELASTIC_RESTART_COUNT", "1", "1"},
      {"TORCHELASTIC_MAX_RESTARTS", "3", "3"}, {"TORCHELASTIC_RUN_ID", "job7", "job7"},
      {"MESHRUN_STORE", "127.0.0.1:1234", "127.0.0.1:1234"}, {"MESHRUN_ROUND", "5", "5"},
      {"MESHRUN_JOB_ID", "job7@127.0.0.1:1234", "job7@127.0.0.1:1234"}, {"TEST_WORKERS_PASS", "through", "through"},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const char *v[2] = {want[i].v0, want[i].v1};
    for (int lr = 0; lr < 2; lr++) {
      const char *got = env_of(&c, lr, want[i].name);
      if (strcmp(got, v[lr])) printf("  local rank %d: %s=\"%s\", want \"%s\"\n", lr, want[i].name, got, v[lr]);
      assert_string_equal(got, v[lr]);
    }
  }
  char stop[600];
  snprintf(stop, sizeof stop, "%s/attempt_5/stop", c.dir);
  assert_string_equal(env_of(&c, 1, "MESHRUN_STOP_FILE"), stop);
  assert_string_equal(env_of(&c, 1, "TORCHELASTIC_ERROR_FILE"), c.info[1].error_file);
  /* exit codes and the failed worker's stderr */
  printf("  exits: rank %d code %d, rank %d code %d; rank 5's stderr tail \"%s\"\n", c.info[0].rank,
         c.info[0].exit_code, c.info[1].rank, c.info[1].exit_code, c.tail[1]);
  assert_int_equal(c.info[0].rank, 4);
  assert_int_equal(c.info[0].exit_code, 0);
  assert_int_equal(c.info[1].rank, 5);
  assert_int_equal(c.info[1].exit_code, 3);
  assert_int_equal(c.info[1].term_signal, 0);
  assert_false(c.info[0].running || c.info[1].running);
  assert_non_null(strstr(c.tail[1], "boom"));
  /* the log files */
  char log[600], buf[256] = "";
  snprintf(log, sizeof log, "%s/attempt_5/5/stdout.log", c.dir);
  FILE *f = fopen(log, "r");
  assert_non_null(f);
  assert_non_null(fgets(buf, sizeof buf, f));
  fclose(f);
  assert_string_equal(buf, "hello from rank 5\n");
  close_ctx(&c);
  unsetenv("RANK");
  unsetenv("MASTER_PORT");
}

static void test_killed_by_signal(void **state) {
  ctx_t c;
  open_ctx(&c, "[ \"$LOCAL_RANK\" = 0 ] && exit 0; kill -KILL $$", 0);
  run_until_idle(&c);
  printf("  rank 5: exit code %d, signal %d\n", c.info[1].exit_code, c.info[1].term_signal);
  assert_int_equal(c.info[0].exit_code, 0);
  assert_int_equal(c.info[1].term_signal, SIGKILL);
  assert_int_equal(c.info[1].exit_code, 128 + SIGKILL);
  close_ctx(&c);
}

/* Both workers said they are ready (their traps are set): stop the round. */
static void on_poll(uv_timer_t *t) {
  ctx_t *c = t->data;
  if (access(path_in(c, "ready.0"), F_OK) || access(path_in(c, "ready.1"), F_OK)) return;
  uv_timer_stop(t);
  workers_stop(c->w, SIGTERM, GRACE_S, "scale_up");
}

static void test_stop_terms_then_kills(void **state) {
  ctx_t c;
  /* local rank 0 ends on SIGTERM after reading the reason; local rank 1 ignores SIGTERM (so does
   * its sleep, which inherits that) until the SIGKILL after the grace. The sleep runs in the
   * background under `wait`, which a trapped signal interrupts at once: a foreground sleep that
   * took the SIGTERM between its fork and its exec would hold the trap back for a second. */
  open_ctx(&c, "D=$TEST_WORKERS_DIR; if [ \"$LOCAL_RANK\" = 0 ]; then "
               "trap 'cat \"$MESHRUN_STOP_FILE\" > \"$D/reason\"; exit 0' TERM; else trap '' TERM; fi; "
               "touch \"$D/ready.$LOCAL_RANK\"; while :; do sleep 1 & wait $!; done", 0);
  uv_timer_start(&c.poll, on_poll, 5, 5);
  run_until_idle(&c);
  FILE *f = fopen(path_in(&c, "reason"), "r");
  assert_non_null(f);
  char reason[64] = "";
  assert_non_null(fgets(reason, sizeof reason, f));
  fclose(f);
  reason[strcspn(reason, "\n")] = 0;
  printf("  rank 4: exit code %d, signal %d, read \"%s\"; rank 5: exit code %d, signal %d\n", c.info[0].exit_code,
         c.info[0].term_signal, reason, c.info[1].exit_code, c.info[1].term_signal);
  assert_string_equal(reason, "scale_up");
  assert_int_equal(c.info[0].exit_code, 0);
  assert_int_equal(c.info[0].term_signal, 0);
  assert_int_equal(c.info[1].term_signal, SIGKILL);
  close_ctx(&c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_environment_and_exit_codes),
      cmocka_unit_test(test_killed_by_signal),
      cmocka_unit_test(test_stop_terms_then_kills),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
