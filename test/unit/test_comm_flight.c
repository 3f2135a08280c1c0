// deps: test/support/fixture.c trainer/comm/comm.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c trainer/backend/fatal.c
/* test_comm_flight: the comm flight recorder and its dumps (trainer/comm/comm_flight.c), with
 * real ranks on loopback (test/support/fixture: forked ranks, a store server, an alarm each).
 *
 * What is checked: the ring keeps exactly the last N calls, oldest first, with each call's
 * communicator, sequence number, op, dtype, reduction, bytes, peer or root and state, and the
 * header's issued and done numbers of each communicator; blocking, started (progress thread) and
 * point-to-point calls are all recorded; recording off keeps no call but still counts; a comm
 * timeout writes a dump by itself, naming the communicator, op and sequence number of the call
 * that timed out, while the peer that never made the call is one behind; a call comm_skip_next
 * skipped moves nothing, keeps its number and is recorded "skipped"; every thread of the
 * process appears with its stack, a thread that blocks the stack signal with the reason. */
#include <dirent.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cJSON.h>
#include <cmocka.h>

#include "common/store.h"
#include "test/support/fixture.h"
#include "trainer/comm/comm.h"

#define CHILD_ALARM_S 60
#define MAX_LINES 4096

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "rank %d: %s:%d: ", rank, __FILE__, __LINE__);       \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
      return 1;                                                            \
    }                                                                      \
  } while (0)

typedef struct {
  cJSON *line[MAX_LINES];
  int n;
} dump_t;

static void dump_free(dump_t *d) {
  for (int i = 0; i < d->n; i++) cJSON_Delete(d->line[i]);
  d->n = 0;
}

/* Every line of a dump file parsed; -1 when a line is not JSON or the file is unreadable. */
static int dump_read(dump_t *d, const char *path) {
  FILE *f = fopen(path, "r");
  static char buf[1 << 16];
  d->n = 0;
  if (!f) return -1;
  while (fgets(buf, sizeof buf, f) && d->n < MAX_LINES) {
    cJSON *j = cJSON_Parse(buf);
    if (!j) {
      fprintf(stderr, "not JSON in %s: %s", path, buf);
      fclose(f);
      return -1;
    }
    d->line[d->n++] = j;
  }
  fclose(f);
  return 0;
}

static const char *str(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsString(v) ? v->valuestring : "";
}
static double num(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* The lines of one type ("op", "stack"), in file order, into out; returns how many. */
static int of_type(const dump_t *d, const char *type, const cJSON **out) {
  int k = 0;
  for (int i = 0; i < d->n; i++)
    if (!strcmp(str(d->line[i], "type"), type)) out[k++] = d->line[i];
  return k;
}

/* The header's entry for communicator name, or NULL. */
static const cJSON *header_comm(const dump_t *d, const char *name) {
  const cJSON *c;
  cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(d->line[0], "comms")) {
    if (!strcmp(str(c, "name"), name)) return c;
  }
  return NULL;
}

/* A fresh dump folder for this rank, set as MESHRUN_DUMP_DIR: 0, or -1 when none can be made. */
static int own_dump_dir(char *dir, size_t len) {
  snprintf(dir, len, "/tmp/test_comm_flight.XXXXXX");
  if (!mkdtemp(dir)) return -1;
  return setenv("MESHRUN_DUMP_DIR", dir, 1);
}

/* The one dump file in dir into path: 0, or -1 when there is none or more than one. */
static int only_dump(const char *dir, char *path, size_t len) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    if (!strncmp(e->d_name, "flight-", 7) && ++n) snprintf(path, len, "%s/%s", dir, e->d_name);
  if (d) closedir(d);
  return n == 1 ? 0 : -1;
}

static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  char p[512];
  for (struct dirent *e; d && (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    unlink(p);
  }
  if (d) closedir(d);
  rmdir(dir);
}

/* ---- the ring keeps the last N, in order, with each call's fields */

#define RING 8
#define CALLS 20

static int rank_ring(int rank, int n, store_t *st, void *arg) {
  char err[256], dir[64], path[512];
  CHECK(own_dump_dir(dir, sizeof dir) == 0, "no dump folder");
  CHECK(comm_flight_setup(RING, err, sizeof err) == 0, "%s", err);
  comm_t *c, *p2p;
  if (fixture_comm_open(&c, "ring", rank, n, st, 30000) || fixture_comm_open(&p2p, "pipe", rank, n, st, 30000))
    return 1;
  float buf[64] = {0};
  /* CALLS - 3 blocking all_reduces of i + 1 floats, a broadcast from rank 1, then on "pipe" a send
   * (rank 0) or receive (rank 1) and a started all_gather, so that the last RING cover them all */
  for (int i = 0; i < CALLS - 3; i++) CHECK(comm_all_reduce(c, buf, (size_t)i + 1, DT_F32, COMM_SUM) == 0, "ar");
  CHECK(comm_broadcast(c, buf, 5, DT_F32, 1) == 0, "broadcast");
  if (rank == 0) CHECK(comm_send(p2p, buf, 3, DT_F32, 1) == 0, "send");
  else CHECK(comm_recv(p2p, buf, 3, DT_F32, 0) == 0, "recv");
  comm_req_t *req;
  float out[2 * 4];
  CHECK(comm_start_all_gather(p2p, buf, out, 4, DT_F32, &req) == 0, "start");
  CHECK(comm_wait(req, NULL) == 0, "wait");
  CHECK(comm_dump("test", path, sizeof path, err, sizeof err) == 0, "%s", err);

  dump_t d;
  CHECK(dump_read(&d, path) == 0 && d.n > 0, "cannot read %s", path);
  const cJSON *h = d.line[0], *ops[MAX_LINES];
  CHECK(!strcmp(str(h, "type"), "header") && !strcmp(str(h, "reason"), "test"), "header %s", cJSON_PrintUnformatted(h));
  CHECK(num(h, "pid") == getpid() && num(h, "records") == RING && num(h, "issued") == CALLS, "header counts");
  const cJSON *hc = header_comm(&d, "ring"), *hp = header_comm(&d, "pipe");
  CHECK(hc && num(hc, "issued") == CALLS - 2 && num(hc, "done") == CALLS - 2, "ring's numbers");
  CHECK(hp && num(hp, "issued") == 2 && num(hp, "done") == 2 && num(hp, "size") == 2, "pipe's numbers");
  int k = of_type(&d, "op", ops);
  CHECK(k == RING, "%d op lines, want the last %d", k, RING);
  /* oldest first: all_reduces 13..17 (of 13..17 floats), the broadcast (seq 18), then pipe's 1, 2 */
  for (int i = 0; i < RING - 3; i++) {
    const cJSON *o = ops[i];
    int seq = CALLS - RING + 1 + i;
    CHECK(!strcmp(str(o, "comm"), "ring") && num(o, "seq") == seq && !strcmp(str(o, "op"), "all_reduce") &&
              !strcmp(str(o, "reduce"), "sum") && !strcmp(str(o, "dtype"), "fp32") && num(o, "bytes") == 4 * seq &&
              !strcmp(str(o, "state"), "done") && num(o, "t_issue_ns") > 0 &&
              num(o, "t_start_ns") >= num(o, "t_issue_ns") && num(o, "t_end_ns") >= num(o, "t_start_ns"),
          "op line %d: %s", i, cJSON_PrintUnformatted(o));
  }
  const cJSON *b = ops[RING - 3], *s = ops[RING - 2], *g = ops[RING - 1];
  CHECK(!strcmp(str(b, "op"), "broadcast") && num(b, "root") == 1 && num(b, "seq") == CALLS - 2 &&
            cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(b, "reduce")), "%s", cJSON_PrintUnformatted(b));
  CHECK(!strcmp(str(s, "comm"), "pipe") && num(s, "seq") == 1 && !strcmp(str(s, "op"), rank ? "recv" : "send") &&
            num(s, "peer") == 1 - rank && num(s, "bytes") == 12, "%s", cJSON_PrintUnformatted(s));
  CHECK(!strcmp(str(g, "op"), "all_gather") && num(g, "seq") == 2 && !strcmp(str(g, "state"), "done") &&
            num(g, "bytes") == 16, "%s", cJSON_PrintUnformatted(g));
  /* the stacks: this thread (the dumping one) and the pipe's progress thread, named after it */
  const cJSON *stk[64];
  int ns = of_type(&d, "stack", stk), self = 0, progress = 0;
  for (int i = 0; i < ns; i++) {
    int frames = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(stk[i], "frames"));
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(stk[i], "dumping")) && frames > 2) self++;
    if (!strcmp(str(stk[i], "name"), "comm pipe") && frames > 2) progress++;
  }
  CHECK(self == 1 && progress == 1, "stacks: dumping %d, progress thread %d of %d lines", self, progress, ns);
  dump_free(&d);
  comm_destroy(p2p);
  comm_destroy(c);
  remove_dir(dir);
  return 0;
}

static void test_ring_keeps_the_last_n(void **state) { assert_int_equal(fixture_run_ranks(2, rank_ring, NULL, CHILD_ALARM_S), 0); }

/* ---- recording off: no call kept, the numbers still count */

static int rank_off(int rank, int n, store_t *st, void *arg) {
  char err[256], dir[64], path[512];
  CHECK(own_dump_dir(dir, sizeof dir) == 0, "no dump folder");
  CHECK(comm_flight_setup(0, err, sizeof err) == 0, "%s", err);
  comm_t *c;
  if (fixture_comm_open(&c, "off", rank, n, st, 30000)) return 1;
  float x = 1;
  for (int i = 0; i < 3; i++) CHECK(comm_all_reduce(c, &x, 1, DT_F32, COMM_SUM) == 0, "ar");
  CHECK(comm_dump(NULL, path, sizeof path, err, sizeof err) == 0, "%s", err);
  dump_t d;
  const cJSON *ops[MAX_LINES];
  CHECK(dump_read(&d, path) == 0 && d.n > 0, "cannot read %s", path);
  const cJSON *hc = header_comm(&d, "off");
  CHECK(!strcmp(str(d.line[0], "reason"), "request") && num(d.line[0], "records") == 0, "header");
  CHECK(of_type(&d, "op", ops) == 0 && hc && num(hc, "issued") == 3 && num(hc, "done") == 3, "off");
  dump_free(&d);
  comm_destroy(c);
  remove_dir(dir);
  return 0;
}

static void test_recording_off(void **state) { assert_int_equal(fixture_run_ranks(2, rank_off, NULL, CHILD_ALARM_S), 0); }

/* ---- comm_skip_next: rank 1 skips one all_reduce; it returns 0 at once without a byte, keeps its
 * sequence number and is recorded "skipped"; its next call is the group's next (rank 0 makes
 * only that one, and both meet there with each other's values) */

static int rank_skip(int rank, int n, store_t *st, void *arg) {
  char err[256], dir[64], path[512];
  CHECK(own_dump_dir(dir, sizeof dir) == 0, "no dump folder");
  CHECK(comm_flight_setup(16, err, sizeof err) == 0, "%s", err);
  comm_t *c;
  if (fixture_comm_open(&c, "skip", rank, n, st, 30000)) return 1;
  float x = (float)(rank + 1), y = 7;
  if (rank == 1) {
    comm_skip_next(c);
    CHECK(comm_all_reduce(c, &y, 1, DT_F32, COMM_SUM) == 0 && y == 7, "the skipped call moved %g", y);
  }
  CHECK(comm_all_reduce(c, &x, 1, DT_F32, COMM_SUM) == 0 && x == 3, "after the skip: %g", x);
  CHECK(comm_dump("test", path, sizeof path, err, sizeof err) == 0, "%s", err);
  dump_t d;
  const cJSON *ops[MAX_LINES];
  CHECK(dump_read(&d, path) == 0 && d.n > 0, "cannot read %s", path);
  const cJSON *hc = header_comm(&d, "skip");
  int k = of_type(&d, "op", ops), calls = rank == 1 ? 2 : 1;
  CHECK(hc && num(hc, "issued") == calls && num(hc, "done") == calls && k == calls, "rank %d: %d calls", rank, k);
  CHECK(rank == 0 || (!strcmp(str(ops[0], "state"), "skipped") && num(ops[0], "seq") == 1 &&
                      !strcmp(str(ops[1], "state"), "done") && num(ops[1], "seq") == 2),
        "%s", cJSON_PrintUnformatted(ops[0]));
  dump_free(&d);
  comm_destroy(c);
  remove_dir(dir);
  return 0;
}

static void test_skip_next(void **state) { assert_int_equal(fixture_run_ranks(2, rank_skip, NULL, CHILD_ALARM_S), 0); }

/* ---- a timeout dumps by itself: the waiting rank names its call, the absent one is behind */

static void *idle_thread(void *arg) {
  sigset_t all;
  sigfillset(&all);
  if (arg) pthread_sigmask(SIG_BLOCK, &all, NULL); /* blocks the stack signal too */
  pause();
  return NULL;
}

static int rank_timeout(int rank, int n, store_t *st, void *arg) {
  char err[256], dir[64], path[512];
  CHECK(own_dump_dir(dir, sizeof dir) == 0, "no dump folder");
  CHECK(comm_flight_setup(16, err, sizeof err) == 0, "%s", err);
  comm_t *c;
  if (fixture_comm_open(&c, "stuck", rank, n, st, 1000)) return 1;
  float x[4] = {1, 2, 3, 4};
  CHECK(comm_all_reduce(c, x, 4, DT_F32, COMM_SUM) == 0, "first");
  CHECK(comm_all_reduce(c, x, 2, DT_F32, COMM_MAX) == 0, "second");
  if (rank == 1) {
    /* never makes the third: dumps on request, then waits for rank 0 to finish failing */
    CHECK(comm_dump("request", path, sizeof path, err, sizeof err) == 0, "%s", err);
    CHECK(store_set(st, "flight/r1", "1", 1) == 0, "store_set");
    CHECK(fixture_await_key(st, "flight/r0", 30000) == 0, "rank 0 never finished");
  } else {
    pthread_t open_t, closed_t;
    pthread_create(&open_t, NULL, idle_thread, NULL);
    pthread_create(&closed_t, NULL, idle_thread, (void *)1);
    CHECK(fixture_await_key(st, "flight/r1", 30000) == 0, "rank 1 never dumped");
    int rc = comm_all_reduce(c, x, 4, DT_F32, COMM_SUM);
    CHECK(rc == COMM_ETIMEDOUT, "third: %d %s", rc, comm_errmsg(c));
    CHECK(only_dump(dir, path, sizeof path) == 0, "no dump (or several) in %s after the timeout", dir);
  }
  dump_t d;
  const cJSON *ops[MAX_LINES], *stk[64];
  CHECK(dump_read(&d, path) == 0 && d.n > 0, "cannot read %s", path);
  const cJSON *h = d.line[0], *hc = header_comm(&d, "stuck");
  int k = of_type(&d, "op", ops), ns = of_type(&d, "stack", stk);
  if (rank == 0) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(h, "failed"), *last = ops[k - 1];
    CHECK(!strcmp(str(h, "reason"), "timeout") && f && !strcmp(str(f, "comm"), "stuck") && num(f, "seq") == 3 &&
              !strcmp(str(f, "op"), "all_reduce"), "header %s", cJSON_PrintUnformatted(h));
    CHECK(hc && num(hc, "issued") == 3 && num(hc, "done") == 2, "rank 0's numbers");
    CHECK(k == 3 && num(last, "seq") == 3 && !strcmp(str(last, "state"), "failed") &&
              !strcmp(str(last, "error"), "timed out"), "last op %s", cJSON_PrintUnformatted(last));
    /* every thread: the two idle ones, one with frames, one that blocks the signal and says so */
    int with = 0, blocked = 0;
    for (int i = 0; i < ns; i++) {
      int frames = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(stk[i], "frames"));
      if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(stk[i], "dumping")) && frames > 2) with++;
      if (strstr(str(stk[i], "missing"), "blocks the stack signal") && frames == 0) blocked++;
    }
    CHECK(ns >= 3 && with >= 1 && blocked == 1, "stacks: %d lines, %d others with frames, %d blocked", ns, with,
          blocked);
    CHECK(store_set(st, "flight/r0", "1", 1) == 0, "store_set");
  } else {
    CHECK(hc && num(hc, "issued") == 2 && num(hc, "done") == 2 && k == 2, "rank 1's numbers");
  }
  dump_free(&d);
  comm_destroy(c);
  remove_dir(dir);
  return 0;
}

static void test_timeout_dumps(void **state) { assert_int_equal(fixture_run_ranks(2, rank_timeout, NULL, CHILD_ALARM_S), 0); }

/* ---- settings */

static void test_records_setting(void **state) {
  char err[256];
  unsetenv("MESHRUN_COMM_FLIGHT_RECORDS");
  assert_int_equal(comm_flight_records(100), 100);
  setenv("MESHRUN_COMM_FLIGHT_RECORDS", "7", 1);
  assert_int_equal(comm_flight_records(100), 7);
  setenv("MESHRUN_COMM_FLIGHT_RECORDS", "-1", 1); /* out of range: the configured value */
  assert_int_equal(comm_flight_records(100), 100);
  unsetenv("MESHRUN_COMM_FLIGHT_RECORDS");
  assert_int_equal(comm_flight_setup(-1, err, sizeof err), COMM_EINVAL);
  assert_non_null(strstr(err, "-1 records"));
  assert_int_equal(comm_flight_setup(COMM_FLIGHT_MAX + 1, err, sizeof err), COMM_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ring_keeps_the_last_n),
      cmocka_unit_test(test_recording_off),
      cmocka_unit_test(test_skip_next),
      cmocka_unit_test(test_timeout_dumps),
      cmocka_unit_test(test_records_setting),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
