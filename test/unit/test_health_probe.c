// deps: launcher/health_probe.c common/net.c common/log.c common/err.c common/env.c
/* Unit tests of health_probe (--health_check's GEMM by `trainer --health-gemm`): the parsing of
 * the probe's line, good and bad; and the child itself, played by small shell scripts: a line
 * read after other output, a failure's status and stderr, a child that never answers (killed at
 * the timeout, and gone), a stop, and the environment it is given. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/net.h"
#include "launcher/health_probe.h"

static int parse(const char *s, health_probe_t *p, char *err, size_t errlen) {
  return health_probe_parse(s, strlen(s), p, err, errlen);
}

static void test_parse_good(void **state) {
  health_probe_t p;
  char err[256] = "";
  const char *cuda = "{\"gflops\": 650123.5, \"devices\": [650123.5, 700000.0], \"device\": \"cuda\", "
                     "\"dtype\": \"bf16\", \"n\": 4096}\n";
  assert_int_equal(parse(cuda, &p, err, sizeof err), 0);
  assert_true(p.gflops == 650123.5);
  assert_int_equal(p.devices, 2);
  assert_string_equal(p.device, "cuda");
  assert_string_equal(p.dtype, "bf16");
  /* Other lines before it (a library's banner), none after; no newline at the end; no dtype. */
  const char *cpu = "OpenBLAS says hello\n{\"gflops\": 38.5, \"devices\": [38.5], \"device\": \"cpu\"}";
  assert_int_equal(parse(cpu, &p, err, sizeof err), 0);
  assert_true(p.gflops == 38.5);
  assert_int_equal(p.devices, 1);
  assert_string_equal(p.device, "cpu");
  assert_string_equal(p.dtype, "");
}

static void test_parse_bad(void **state) {
  health_probe_t p;
  char err[256];
  struct {
    const char *text, *says;
  } bad[] = {
      {"", "no line of JSON"},
      {"gflops 12\n", "no line of JSON"},
      {"{\"gflops\": 12,\n", "is not JSON"},
      {"{\"gflops\": 0, \"devices\": [0], \"device\": \"cpu\"}\n", "no \"gflops\" > 0"},
      {"{\"gflops\": \"fast\", \"devices\": [1], \"device\": \"cpu\"}\n", "no \"gflops\" > 0"},
      {"{\"gflops\": 12, \"devices\": [12]}\n", "no \"device\" name"},
      {"{\"gflops\": 12, \"devices\": [12], \"device\": \"two words\"}\n", "no \"device\" name"},
      {"{\"gflops\": 12, \"devices\": [12], \"device\": \"a-name-far-too-long\"}\n", "no \"device\" name"},
      {"{\"gflops\": 12, \"devices\": [], \"device\": \"cpu\"}\n", "no \"devices\" rates"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    err[0] = 0;
    assert_int_equal(parse(bad[i].text, &p, err, sizeof err), -1);
    printf("  \"%.40s...\": %s\n", bad[i].text, err);
    assert_non_null(strstr(err, bad[i].says));
  }
}

/* A script at a temporary path, made executable; the path into path. */
static void script(char *path, size_t len, const char *body) {
  snprintf(path, len, "/tmp/test_health_probe_%d_XXXXXX", (int)getpid());
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  FILE *f = fdopen(fd, "w");
  fprintf(f, "#!/bin/sh\n%s\n", body);
  fclose(f);
  chmod(path, 0700);
}

static void test_run_line(void **state) {
  char path[128], err[512] = "";
  atomic_int stop = 0;
  health_probe_t p;
  /* Its argument, and the workers' LOCAL_WORLD_SIZE, reach it. */
  script(path, sizeof path,
         "[ \"$1\" = --health-gemm ] || exit 3\necho noise >&2\n"
         "echo \"{\\\"gflops\\\": $LOCAL_WORLD_SIZE.5, \\\"devices\\\": [1], \\\"device\\\": \\\"cpu\\\"}\"");
  int rc = health_probe_run(path, 7, 5, &stop, &p, err, sizeof err);
  printf("  rc %d, gflops %g, err \"%s\"\n", rc, p.gflops, err);
  assert_int_equal(rc, 0);
  assert_true(p.gflops == 7.5);
  unlink(path);
}

static void test_run_failure(void **state) {
  char path[128], err[512] = "";
  atomic_int stop = 0;
  health_probe_t p;
  script(path, sizeof path, "echo 'trainer --health-gemm: cuda device 1: no memory' >&2\nexit 1");
  assert_int_equal(health_probe_run(path, 1, 5, &stop, &p, err, sizeof err), -1);
  printf("  %s\n", err);
  assert_string_equal(err, "exit status 1: trainer --health-gemm: cuda device 1: no memory");
  unlink(path);
  /* A line that parses, but a failed exit: not taken. */
  script(path, sizeof path, "echo '{\"gflops\": 1, \"devices\": [1], \"device\": \"cpu\"}'\nexit 2");
  assert_int_equal(health_probe_run(path, 1, 5, &stop, &p, err, sizeof err), -1);
  assert_string_equal(err, "exit status 2");
  unlink(path);
  assert_int_equal(health_probe_run("/nonexistent/trainer", 1, 5, &stop, &p, err, sizeof err), -1);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "cannot start /nonexistent/trainer"));
}

/* pid from the file the script wrote, once it is there. */
static int read_pid(const char *file) {
  for (int i = 0; i < 500; i++) {
    FILE *f = fopen(file, "r");
    int pid = 0;
    if (f && fscanf(f, "%d", &pid) == 1 && pid > 0) {
      fclose(f);
      return pid;
    }
    if (f) fclose(f);
    usleep(10000);
  }
  return 0;
}

/* A child that never answers, with its pid in a file: the call's verdict, and whether the child
 * was still there (not reaped) after the call returned. */
static int hung_child(double timeout_s, atomic_int *stop, char *err, size_t errlen, int64_t *took_ms) {
  char path[128], pidfile[160], body[256];
  health_probe_t p;
  snprintf(pidfile, sizeof pidfile, "/tmp/test_health_probe_%d.pid", (int)getpid());
  unlink(pidfile);
  snprintf(body, sizeof body, "echo $$ > %s\nexec sleep 100", pidfile);
  script(path, sizeof path, body);
  int64_t t0 = net_now_ms();
  assert_int_equal(health_probe_run(path, 1, timeout_s, stop, &p, err, errlen), -1);
  *took_ms = net_now_ms() - t0;
  int pid = read_pid(pidfile);
  int alive = pid > 0 && kill(pid, 0) == 0;
  printf("  %s (after %lld ms; child %d %s)\n", err, (long long)*took_ms, pid, alive ? "ALIVE" : "gone");
  if (alive) kill(pid, SIGKILL);
  unlink(path);
  unlink(pidfile);
  assert_true(pid > 0);
  return alive;
}

/* Killed at the timeout, and reaped (gone) when the call returns. */
static void test_run_timeout(void **state) {
  char err[512] = "";
  atomic_int stop = 0;
  int64_t took;
  assert_false(hung_child(0.3, &stop, err, sizeof err, &took));
  assert_string_equal(err, "it did not answer within 0.3s");
  assert_true(took >= 300);
}

/* A stop (health_stop's flag) while the child runs: "stopped", the child gone. */
static void *set_stop(void *arg) {
  usleep(200000);
  atomic_store((atomic_int *)arg, 1);
  return NULL;
}

static void test_run_stop(void **state) {
  char err[512] = "";
  atomic_int stop = 0;
  int64_t took;
  pthread_t t;
  pthread_create(&t, NULL, set_stop, &stop);
  assert_false(hung_child(30, &stop, err, sizeof err, &took));
  pthread_join(t, NULL);
  assert_string_equal(err, "stopped");
}

/* The trainer is looked for beside the running program: none beside this test. */
static void test_path(void **state) {
  char path[4096], err[512] = "";
  assert_int_equal(health_probe_path(path, sizeof path, err, sizeof err), -1);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "no trainer beside meshrun ("));
  assert_non_null(strstr(err, "/trainer)"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_good),  cmocka_unit_test(test_parse_bad),   cmocka_unit_test(test_run_line),
      cmocka_unit_test(test_run_failure), cmocka_unit_test(test_run_timeout), cmocka_unit_test(test_run_stop),
      cmocka_unit_test(test_path),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
