// deps: launcher/diagnose.c launcher/console.c common/fs.c common/err.c common/log.c
/* Unit tests of diagnose: crafted dumps (the flight recorder's JSON lines) to a diagnosis.
 * Four ranks of a group "world" (and two pairs "tp.0", "tp.1"): one rank behind, which never
 * entered the call the others wait in, is named in the summary with host, pid, its last
 * completed call and its frames less the signal handler's; a stub (no answer, stopped) is named
 * first, and the group it belongs to lacks a member; waiting ranks that disagree on the call are
 * named as such; idle groups are not reported; a rank whose ring records the call the others wait
 * in as skipped is named as the one that skipped it; a digest (diag_format) reads back as the
 * rank it was made from, its node shown in the lines. A folder: the newest dump per rank, older hangs
 * left out, stubs written and read back, and a folder without dumps gives none. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "launcher/diagnose.h"

/* A dump of rank r: world issued/done, tp.<r/2> issued/done, the op of world's next call. */
static void dump_text(char *out, size_t len, int rank, double t, unsigned long w_issued, unsigned long w_done,
                      const char *next_op, unsigned long bytes) {
  int n = snprintf(out, len,
                   "{\"type\":\"header\",\"reason\":\"meshrun\",\"rank\":%d,\"host\":\"node%d\",\"pid\":%d,"
                   "\"unix_time\":%.1f,\"comms\":[{\"name\":\"world\",\"backend\":\"cpu\",\"rank\":%d,\"size\":4,"
                   "\"issued\":%lu,\"done\":%lu},{\"name\":\"tp.%d\",\"backend\":\"cpu\",\"rank\":%d,\"size\":2,"
                   "\"issued\":7,\"done\":7}]}\n",
                   rank, rank / 2, 1000 + rank, t, rank, w_issued, w_done, rank / 2, rank % 2);
  n += snprintf(out + n, len - (size_t)n,
                "{\"type\":\"op\",\"comm\":\"world\",\"seq\":%lu,\"op\":\"all_gather\",\"bytes\":4,\"state\":\"done\"}\n",
                w_done);
  if (w_issued > w_done)
    n += snprintf(out + n, len - (size_t)n,
                  "{\"type\":\"op\",\"comm\":\"world\",\"seq\":%lu,\"op\":\"%s\",\"bytes\":%lu,\"state\":\"started\"}\n",
                  w_done + 1, next_op, bytes);
  snprintf(out + n, len - (size_t)n,
           "{\"type\":\"stack\",\"tid\":9,\"name\":\"comm dump\",\"main\":false,\"dumping\":true,\"frames\":[\"x\"]}\n"
           "{\"type\":\"stack\",\"tid\":%d,\"name\":\"trainer\",\"main\":true,\"dumping\":false,\"frames\":["
           "\"/b/trainer(+0xa86f0) [0x1]\",\"/lib/libc.so.6(+0x3c050) [0x2]\",\"/lib/libc.so.6(pause+0x14) [0x3]\","
           "\"/b/trainer(hooks_stall+0x2a) [0x4]\",\"/b/trainer(main+0x10) [0x5]\"]}\n",
           1000 + rank);
}

static void parse(diag_rank_t *r, int rank, unsigned long issued, unsigned long done, const char *op) {
  char text[4096], err[256];
  dump_text(text, sizeof text, rank, 100.0, issued, done, op, 1024);
  assert_int_equal(diag_parse(text, strlen(text), r, err, sizeof err), 0);
}

/* Four ranks: rank 1 as given, the others waiting in world's call 42 (op). */
static void four(diag_rank_t *r, unsigned long issued1, const char *op1) {
  parse(&r[0], 0, 42, 41, "all_reduce");
  parse(&r[1], 1, issued1, 41, op1);
  parse(&r[2], 2, 42, 41, "all_reduce");
  parse(&r[3], 3, 42, 41, "all_reduce");
}

static void test_parse(void **state) {
  diag_rank_t r;
  parse(&r, 1, 42, 41, "all_reduce");
  assert_int_equal(r.rank, 1);
  assert_int_equal(r.pid, 1001);
  assert_string_equal(r.host, "node0");
  assert_true(r.answered);
  assert_int_equal(r.ncomms, 2);
  assert_string_equal(r.comms[0].name, "world");
  assert_int_equal(r.comms[0].size, 4);
  assert_int_equal(r.comms[0].issued, 42);
  assert_int_equal(r.comms[0].done, 41);
  assert_string_equal(r.comms[0].next_op, "all_reduce");
  assert_int_equal(r.comms[0].next_bytes, 1024);
  assert_string_equal(r.comms[0].done_op, "all_gather");
  /* the handler's two frames are gone; names as the program exports them */
  assert_int_equal(r.nframes, 3);
  assert_string_equal(r.frames[0], "pause");
  assert_string_equal(r.frames[1], "hooks_stall");
  assert_string_equal(r.frames[2], "main");
}

static void test_parse_errors(void **state) {
  diag_rank_t r;
  char err[256];
  const char *op_only = "{\"type\":\"op\",\"comm\":\"world\",\"seq\":1}\n";
  assert_int_equal(diag_parse(op_only, strlen(op_only), &r, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "no header"));
  const char *no_rank = "{\"type\":\"header\",\"pid\":3}\nnot json\n";
  assert_int_equal(diag_parse(no_rank, strlen(no_rank), &r, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "no rank"));
}

static void test_behind_rank_is_named(void **state) {
  diag_rank_t r[4];
  four(r, 41, "");
  parse(&r[2], 2, 43, 41, "all_reduce"); /* issued one more, still waits in 42 */
  char out[4096];
  int named;
  int lines = diag_report(r, 4, out, sizeof out, &named);
  printf("%s", out);
  assert_int_equal(named, 1);
  assert_true(lines >= 3);
  assert_non_null(strstr(out, "hang: rank 1 (host node0, pid 1001) never entered all_reduce #42 of group world, "
                              "which ranks 0,2,3 wait in\n"));
  assert_non_null(strstr(out, "  group world (4 ranks): all_reduce #42 (1024 B): waiting: ranks 0,2,3; never entered "
                              "it: rank 1\n"));
  assert_non_null(strstr(out, "rank 1 (host node0, pid 1001): last completed call #41 (all_gather) of group world; "
                              "stack: pause < hooks_stall < main\n"));
  assert_null(strstr(out, "tp.")); /* every tp call is done: not stuck */
}

static void test_stub_is_named_first(void **state) {
  diag_rank_t r[4];
  four(r, 42, "all_reduce");
  diag_stub(&r[1], 1, 1001, "node0", 'T');
  char out[4096];
  int named;
  diag_report(r, 4, out, sizeof out, &named);
  printf("%s", out);
  assert_int_equal(named, 1);
  assert_int_equal(strncmp(out, "hang: rank 1 (host node0, pid 1001) did not answer the dump request (stopped); "
                                "ranks 0,2,3 wait in all_reduce #42 of group world\n", 127), 0);
  assert_non_null(strstr(out, "waiting: ranks 0,2,3; 1 member sent no dump"));
  assert_non_null(strstr(out, "rank 1 (host node0, pid 1001): did not answer the dump request: stopped (state T)"));
}

static void test_disagreement(void **state) {
  diag_rank_t r[4];
  four(r, 42, "broadcast");
  char out[4096];
  int named;
  diag_report(r, 4, out, sizeof out, &named);
  printf("%s", out);
  assert_int_equal(named, -1);
  assert_non_null(strstr(out, "hang: the ranks of group world disagree on its call #42: rank 0: all_reduce of 1024 B, "
                              "and rank 1: broadcast of 1024 B"));
}

static void test_nothing_stuck(void **state) {
  diag_rank_t r[2];
  parse(&r[0], 0, 41, 41, "");
  parse(&r[1], 1, 41, 41, "");
  char out[4096];
  diag_report(r, 2, out, sizeof out, NULL);
  printf("%s", out);
  assert_non_null(strstr(out, "hang: no rank waits in a recorded collective (2 dumps)"));
  assert_non_null(strstr(out, "rank 1 (host node0, pid 1001): stack: pause < hooks_stall < main"));
}

static void write_file(const char *dir, const char *name, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* A digest (diag_format) reads back as the rank it was made from, node included; the node then
 * shows in the diagnosis's lines. */
static void test_digest_round_trip(void **state) {
  (void)state;
  diag_rank_t r[4], back;
  four(r, 41, "");
  r[1].node = 1;
  char *text = NULL, err[256];
  size_t len = 0;
  assert_int_equal(diag_format(&r[1], &text, &len), 0);
  assert_int_equal(diag_parse(text, len, &back, err, sizeof err), 0);
  free(text);
  assert_int_equal(back.rank, 1);
  assert_int_equal(back.node, 1);
  assert_int_equal(back.pid, 1001);
  assert_string_equal(back.host, "node0");
  assert_true(back.answered);
  assert_int_equal(back.ncomms, r[1].ncomms);
  assert_int_equal(back.comms[0].issued, 41);
  assert_int_equal(back.comms[0].done, 41);
  assert_string_equal(back.comms[0].done_op, "all_gather");
  assert_int_equal(back.nframes, r[1].nframes);
  assert_string_equal(back.frames[1], "hooks_stall");
  r[1] = back;
  char out[8192];
  int named;
  diag_report(r, 4, out, sizeof out, &named);
  assert_int_equal(named, 1);
  assert_non_null(strstr(out, "hang: rank 1 (host node0, node 1, pid 1001) never entered all_reduce #42 of group "
                              "world, which ranks 0,2,3 wait in\n"));
}

/* A rank whose ring records the call the others wait in as skipped is named as the one that
 * skipped it, before any rank behind, with the call it waits in now. */
static void test_skipped_call_is_named(void **state) {
  (void)state;
  diag_rank_t r[4];
  four(r, 42, "all_reduce");
  /* rank 1 skipped world's 42 (done), and waits in 43 */
  r[1].comms[0].skipped = 42;
  snprintf(r[1].comms[0].skipped_op, sizeof r[1].comms[0].skipped_op, "all_reduce");
  r[1].comms[0].done = 42;
  r[1].comms[0].issued = 43;
  char out[8192];
  int named;
  diag_report(r, 4, out, sizeof out, &named);
  assert_int_equal(named, 1);
  assert_non_null(strstr(out, "hang: rank 1 (host node0, pid 1001) skipped all_reduce #42 of group world: it waits "
                              "in #43 while ranks 0,2,3 wait in #42\n"));
  /* and the skip survives a digest */
  char *text = NULL, err[256];
  size_t len = 0;
  diag_rank_t back;
  assert_int_equal(diag_format(&r[1], &text, &len), 0);
  assert_int_equal(diag_parse(text, len, &back, err, sizeof err), 0);
  free(text);
  assert_int_equal(back.comms[0].skipped, 42);
  assert_string_equal(back.comms[0].skipped_op, "all_reduce");
}

static void test_folder(void **state) {
  char dir[] = "/tmp/test_diagnose_XXXXXX", sub[64], text[4096], err[256];
  assert_non_null(mkdtemp(dir));
  diag_rank_t *r = NULL;
  int n = -1;
  assert_int_equal(diag_load_dir(dir, &r, &n, err, sizeof err), 0);
  assert_int_equal(n, 0);
  free(r);
  snprintf(sub, sizeof sub, "%s/0", dir);
  mkdir(sub, 0755);
  dump_text(text, sizeof text, 0, 1000.0, 42, 41, "all_reduce", 8);
  write_file(sub, "flight-rank0-pid1000-2.jsonl", text);
  dump_text(text, sizeof text, 0, 990.0, 9, 9, "", 8); /* older, same rank: not taken */
  write_file(sub, "flight-rank0-pid1000-1.jsonl", text);
  dump_text(text, sizeof text, 2, 100.0, 9, 9, "", 8); /* an earlier hang's: left out */
  write_file(dir, "flight-rank2-pid7-1.jsonl", text);
  write_file(dir, "flight-rank3-pid7-1.jsonl.tmp", "half");
  write_file(dir, "notes.jsonl", "{}");
  diag_rank_t stub;
  diag_stub(&stub, 1, 1001, "node0", 'T');
  stub.unix_time = 1000.5;
  assert_int_equal(diag_write_stub(dir, &stub), 0);
  assert_int_equal(diag_load_dir(dir, &r, &n, err, sizeof err), 0);
  assert_int_equal(n, 2);
  assert_int_equal(r[0].rank, 0);
  assert_int_equal(r[0].comms[0].issued, 42);
  assert_int_equal(r[1].rank, 1);
  assert_false(r[1].answered);
  assert_int_equal(r[1].state, 'T');
  assert_int_equal(r[1].pid, 1001);
  free(r);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse),
      cmocka_unit_test(test_parse_errors),
      cmocka_unit_test(test_behind_rank_is_named),
      cmocka_unit_test(test_stub_is_named_first),
      cmocka_unit_test(test_disagreement),
      cmocka_unit_test(test_nothing_stuck),
      cmocka_unit_test(test_digest_round_trip),
      cmocka_unit_test(test_skipped_call_is_named),
      cmocka_unit_test(test_folder),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
