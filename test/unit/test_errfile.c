// deps: launcher/errfile.c common/log.c common/fs.c common/err.c
/* Unit tests of errfile: the worker's TORCHELASTIC_ERROR_FILE to a message. torch's nested
 * format, the plain one, and the ways a file can be wrong (missing, empty, not JSON, no
 * message, too deep, too big, not a regular file); each gives the message or an error naming
 * the fault, never a crash or a stale message. meshrun's own {"meshrun": {"restart": false}}:
 * read beside either format, only the JSON false (and true) counts. The verdict: the file's
 * wish first, then exit codes 2 and 78 are permanent, anything else and any signal is not.
 * Files live in a mkdtemp directory per test. */
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

#include "launcher/errfile.h"

typedef struct {
  char dir[64];
  char path[128];
} fx_t;

static int setup(void **state) {
  fx_t *f = calloc(1, sizeof *f);
  if (!f) return -1;
  snprintf(f->dir, sizeof f->dir, "/tmp/test_errfile-XXXXXX");
  if (!mkdtemp(f->dir)) return -1;
  snprintf(f->path, sizeof f->path, "%s/error.json", f->dir);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fx_t *f = *state;
  unlink(f->path);
  rmdir(f->path); /* the not-a-file test makes a directory there */
  rmdir(f->dir);
  free(f);
  return 0;
}

static void write_file(const char *path, const char *text, size_t len) {
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  assert_int_equal(fwrite(text, 1, len, fp), len);
  assert_int_equal(fclose(fp), 0);
}

/* Writes {"message": "<len times ch>"} in chunks. */
static void write_long_message(const char *path, char ch, size_t len) {
  static char chunk[64 << 10];
  memset(chunk, ch, sizeof chunk);
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  assert_true(fputs("{\"message\": \"", fp) >= 0);
  for (size_t done = 0; done < len;) {
    size_t k = len - done < sizeof chunk ? len - done : sizeof chunk;
    assert_int_equal(fwrite(chunk, 1, k, fp), k);
    done += k;
  }
  assert_true(fputs("\"}", fp) >= 0);
  assert_int_equal(fclose(fp), 0);
}

/* Reads path with buffers pre-filled with junk, so a result that leaves them alone shows. */
static int rd(const char *path, char *msg, size_t msglen, char *ts, size_t tslen, char *err, size_t errlen) {
  memset(msg, 'x', msglen - 1);
  msg[msglen - 1] = 0;
  memset(ts, 'y', tslen - 1);
  ts[tslen - 1] = 0;
  err[0] = 0;
  return errfile_read(path, msg, msglen, ts, tslen, NULL, err, errlen);
}

static void test_torch_format(void **state) {
  fx_t *f = *state;
  const char *doc = "{\"message\": {\"message\": \"RuntimeError: boom\", \"extraInfo\": "
                    "{\"py_callstack\": \"Traceback...\", \"timestamp\": \"1700000000\"}}}";
  write_file(f->path, doc, strlen(doc));
  char msg[256], ts[64], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), 0);
  assert_string_equal(msg, "RuntimeError: boom");
  assert_string_equal(ts, "1700000000");
}

static void test_torch_format_numeric_timestamp(void **state) {
  (void)state;
  const char *doc = "{\"message\": {\"message\": \"m\", \"extraInfo\": {\"timestamp\": 1700000001}}}";
  char msg[64], ts[64], err[256];
  assert_int_equal(errfile_parse(doc, strlen(doc), msg, sizeof msg, ts, sizeof ts, NULL, err, sizeof err), 0);
  assert_string_equal(msg, "m");
  assert_string_equal(ts, "1700000001");
}

static void test_plain_format(void **state) {
  fx_t *f = *state;
  const char *doc = "{\"message\": \"plain message\"}";
  write_file(f->path, doc, strlen(doc));
  char msg[256], ts[64], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), 0);
  assert_string_equal(msg, "plain message");
  assert_string_equal(ts, "");
}

static void test_missing_file(void **state) {
  fx_t *f = *state;
  char msg[64], ts[64], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), -ENOENT);
  assert_string_equal(msg, "");
  assert_string_equal(ts, "");
  assert_non_null(strstr(err, f->path));
}

static void test_invalid_json(void **state) {
  fx_t *f = *state;
  const char *bad[] = {"{\"message\": \"unterminated", "not json at all", "{\"message\": }", "\xff\xfe\x00garbage"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    write_file(f->path, bad[i], strlen(bad[i]) + (i == 3 ? 4 : 0));
    char msg[64], ts[64], err[256];
    assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), -EINVAL);
    assert_string_equal(msg, "");
    assert_string_equal(ts, "");
    assert_non_null(strstr(err, "not JSON"));
  }
}

static void test_json_without_message(void **state) {
  (void)state;
  const char *docs[] = {"{}", "[]", "\"just a string\"", "{\"message\": null}", "{\"message\": 42}",
                        "{\"message\": {\"extraInfo\": {\"timestamp\": \"1\"}}}", "{\"Message\": \"case\"}"};
  for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
    char msg[64] = "stale", ts[64] = "stale", err[256] = "";
    assert_int_equal(errfile_parse(docs[i], strlen(docs[i]), msg, sizeof msg, ts, sizeof ts, NULL, err, sizeof err),
                     -EINVAL);
    assert_string_equal(msg, "");
    assert_string_equal(ts, "");
    assert_non_null(strstr(err, "no \"message\""));
  }
}

static void test_empty_file(void **state) {
  fx_t *f = *state;
  write_file(f->path, "", 0);
  char msg[64], ts[64], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), -EINVAL);
  assert_string_equal(msg, "");
  assert_non_null(strstr(err, "empty"));
}

/* Over the 1 MiB limit: reported with its size, not parsed in part (a valid document whose
 * message alone is 2 MiB). */
static void test_huge_file(void **state) {
  fx_t *f = *state;
  write_long_message(f->path, 'a', 2u << 20);
  char msg[64], ts[64], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), -EFBIG);
  assert_string_equal(msg, "");
  assert_non_null(strstr(err, "bytes"));
  assert_non_null(strstr(err, "limit"));
}

/* Just under the limit it is read whole; the message is cut to the caller's buffer. */
static void test_large_message_truncated(void **state) {
  fx_t *f = *state;
  write_long_message(f->path, 'b', (1u << 20) - 64);
  char msg[100], ts[16], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), 0);
  assert_int_equal(strlen(msg), sizeof msg - 1);
  assert_int_equal(strspn(msg, "b"), sizeof msg - 1);
}

/* Truncation never leaves half a UTF-8 character: "é" is 2 bytes, 3 of them in a 6-byte buffer
 * leave room for 5 bytes: two whole characters. */
static void test_truncation_keeps_utf8_whole(void **state) {
  (void)state;
  const char *doc = "{\"message\": \"\xc3\xa9\xc3\xa9\xc3\xa9\"}";
  char msg[6], ts[8], err[128];
  assert_int_equal(errfile_parse(doc, strlen(doc), msg, sizeof msg, ts, sizeof ts, NULL, err, sizeof err), 0);
  assert_string_equal(msg, "\xc3\xa9\xc3\xa9");
}

static void test_deep_nesting(void **state) {
  (void)state;
  size_t depth = 100000;
  char *doc = malloc(2 * depth);
  assert_non_null(doc);
  memset(doc, '[', depth);
  memset(doc + depth, ']', depth);
  char msg[64], ts[64], err[256];
  assert_int_equal(errfile_parse(doc, 2 * depth, msg, sizeof msg, ts, sizeof ts, NULL, err, sizeof err), -EINVAL);
  free(doc);
  assert_string_equal(msg, "");
}

static void test_not_a_regular_file(void **state) {
  fx_t *f = *state;
  assert_int_equal(mkdir(f->path, 0755), 0);
  char msg[64], ts[64], err[256];
  assert_int_equal(rd(f->path, msg, sizeof msg, ts, sizeof ts, err, sizeof err), -EINVAL);
  assert_string_equal(msg, "");
  assert_non_null(strstr(err, "not a regular file"));
}

/* The worker asks for no restart beside torch's message; the message and timestamp still come. */
static void test_restart_false(void **state) {
  fx_t *f = *state;
  const char *doc = "{\"message\": {\"message\": \"plan error: tp=3\", \"extraInfo\": {\"timestamp\": \"17\"}}, "
                    "\"meshrun\": {\"restart\": false}}";
  write_file(f->path, doc, strlen(doc));
  char msg[64], ts[16], err[256];
  int restart = 7;
  assert_int_equal(errfile_read(f->path, msg, sizeof msg, ts, sizeof ts, &restart, err, sizeof err), 0);
  assert_int_equal(restart, ERRFILE_RESTART_NO);
  assert_string_equal(msg, "plan error: tp=3");
  assert_string_equal(ts, "17");
}

/* Only the JSON values false and true count: a string, a number, null, the key elsewhere or
 * misspelled, and no file at all leave the decision to the exit code (UNSAID). */
static void test_restart_only_json_booleans_count(void **state) {
  fx_t *f = *state;
  const struct {
    const char *doc;
    int want;
  } cases[] = {{"{\"message\": \"m\", \"meshrun\": {\"restart\": true}}", ERRFILE_RESTART_YES},
               {"{\"message\": \"m\", \"meshrun\": {\"restart\": false}}", ERRFILE_RESTART_NO},
               {"{\"message\": \"m\", \"meshrun\": {\"restart\": \"false\"}}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\", \"meshrun\": {\"restart\": 0}}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\", \"meshrun\": {\"restart\": 1}}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\", \"meshrun\": {\"restart\": null}}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\", \"meshrun\": false}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\", \"restart\": false}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": {\"message\": \"m\", \"meshrun\": {\"restart\": false}}}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\", \"Meshrun\": {\"restart\": false}}", ERRFILE_RESTART_UNSAID},
               {"{\"message\": \"m\"}", ERRFILE_RESTART_UNSAID}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char msg[64], ts[16], err[256];
    int restart = 7;
    assert_int_equal(errfile_parse(cases[i].doc, strlen(cases[i].doc), msg, sizeof msg, ts, sizeof ts, &restart, err,
                                   sizeof err),
                     0);
    if (restart != cases[i].want)
      fail_msg("doc %zu (%s): restart=%d, expected %d", i, cases[i].doc, restart, cases[i].want);
    assert_string_equal(msg, "m");
  }
  int restart = 7;
  char msg[64], ts[16], err[256];
  assert_int_equal(errfile_read(f->path, msg, sizeof msg, ts, sizeof ts, &restart, err, sizeof err), -ENOENT);
  assert_int_equal(restart, ERRFILE_RESTART_UNSAID);
}

/* The wish is heard even when the message is missing, but not from a file that is not JSON. */
static void test_restart_false_without_message(void **state) {
  (void)state;
  const char *doc = "{\"meshrun\": {\"restart\": false}}";
  char msg[64], ts[16], err[256];
  int restart = 7;
  assert_int_equal(errfile_parse(doc, strlen(doc), msg, sizeof msg, ts, sizeof ts, &restart, err, sizeof err),
                   -EINVAL);
  assert_int_equal(restart, ERRFILE_RESTART_NO);
  assert_string_equal(msg, "");
  const char *bad = "{\"meshrun\": {\"restart\": false}";
  restart = 7;
  assert_int_equal(errfile_parse(bad, strlen(bad), msg, sizeof msg, ts, sizeof ts, &restart, err, sizeof err),
                   -EINVAL);
  assert_int_equal(restart, ERRFILE_RESTART_UNSAID);
}

/* Exit codes 2 and 78 are permanent unless the file says "restart": true; a file saying
 * false makes any failure permanent, a signal death included; exit 1 after a Python import
 * error is permanent unless the file says either; every other code, and a signal whose 128+N
 * looks like nothing special, restarts. */
static void test_verdict(void **state) {
  (void)state;
  const int U = ERRFILE_RESTART_UNSAID, N = ERRFILE_RESTART_NO, Y = ERRFILE_RESTART_YES;
  const struct {
    int code, sig, restart, import_error;
    errfile_verdict_t want;
  } cases[] = {
      {2, 0, U, 0, ERRFILE_PERMANENT_BY_CODE},   {78, 0, U, 0, ERRFILE_PERMANENT_BY_CODE},
      {2, 0, N, 0, ERRFILE_PERMANENT_BY_FILE},   {5, 0, N, 0, ERRFILE_PERMANENT_BY_FILE},
      {137, 9, N, 0, ERRFILE_PERMANENT_BY_FILE}, {2, 0, Y, 0, ERRFILE_RESTARTABLE},
      {78, 0, Y, 0, ERRFILE_RESTARTABLE},        {1, 0, U, 0, ERRFILE_RESTARTABLE},
      {3, 0, U, 0, ERRFILE_RESTARTABLE},         {77, 0, U, 0, ERRFILE_RESTARTABLE},
      {79, 0, U, 0, ERRFILE_RESTARTABLE},        {127, 0, U, 0, ERRFILE_RESTARTABLE},
      {130, 2, U, 0, ERRFILE_RESTARTABLE},       {143, 15, U, 0, ERRFILE_RESTARTABLE},
      {2, 2, U, 0, ERRFILE_RESTARTABLE}, /* never produced, but a signal always says "restart" */
      {1, 0, U, 1, ERRFILE_PERMANENT_BY_IMPORT}, {1, 0, Y, 1, ERRFILE_RESTARTABLE},
      {1, 0, N, 1, ERRFILE_PERMANENT_BY_FILE},   {3, 0, U, 1, ERRFILE_RESTARTABLE},
      {129, 1, U, 1, ERRFILE_RESTARTABLE},       {2, 0, U, 1, ERRFILE_PERMANENT_BY_CODE},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    errfile_verdict_t v = errfile_verdict(cases[i].code, cases[i].sig, cases[i].restart, cases[i].import_error);
    if (v != cases[i].want)
      fail_msg("case %zu (code %d, signal %d, restart %d, import error %d): verdict %d, expected %d", i, cases[i].code,
               cases[i].sig, cases[i].restart, cases[i].import_error, (int)v, (int)cases[i].want);
  }
  assert_string_equal(errfile_exit_meaning(2), "a usage or plan error");
  assert_non_null(strstr(errfile_exit_meaning(78), "EX_CONFIG"));
  assert_null(errfile_exit_meaning(0));
  assert_null(errfile_exit_meaning(1));
  assert_null(errfile_exit_meaning(130));
}

/* Python's last line, as it prints an uncaught import failure; anything after it, or any other
 * exception, is not one. */
static void test_import_error(void **state) {
  (void)state;
  const struct {
    const char *text, *exc, *what; /* exc NULL: not an import failure */
  } cases[] = {
      {"Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nModuleNotFoundError: No module "
       "named 'x'\n",
       "ModuleNotFoundError", "'x'"},
      {"ModuleNotFoundError: No module named 'a.b'\r\n\n\n", "ModuleNotFoundError", "'a.b'"},
      {"ModuleNotFoundError: No module named 'y'", "ModuleNotFoundError", "'y'"},
      {"ImportError: cannot import name 'n' from 'os' (/usr/lib/python3.11/os.py)\n", "ImportError",
       "name 'n' from 'os'"},
      {"ImportError: cannot import name 'n' from 'p' (unknown location)\n", "ImportError",
       "name 'n' from 'p' (unknown location)"},
      {"ImportError: libcudart.so.12: cannot open shared object file: No such file or directory\n", "ImportError",
       "libcudart.so.12: cannot open shared object file: No such file or directory"},
      {"ModuleNotFoundError: No module named 'x'\nretrying without it\n", NULL, NULL},
      {"RuntimeError: No module named 'x'\n", NULL, NULL},
      {"  ModuleNotFoundError: No module named 'x'\n", NULL, NULL},
      {"", NULL, NULL},
      {"\n\n", NULL, NULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char exc[32] = "", what[256] = "";
    int got = errfile_import_error(cases[i].text, strlen(cases[i].text), exc, sizeof exc, what, sizeof what);
    if (got != (cases[i].exc != NULL)) fail_msg("case %zu: %d, expected %d", i, got, cases[i].exc != NULL);
    if (!got) continue;
    assert_string_equal(exc, cases[i].exc);
    assert_string_equal(what, cases[i].what);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_torch_format, setup, teardown),
      cmocka_unit_test(test_torch_format_numeric_timestamp),
      cmocka_unit_test_setup_teardown(test_plain_format, setup, teardown),
      cmocka_unit_test_setup_teardown(test_missing_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_invalid_json, setup, teardown),
      cmocka_unit_test(test_json_without_message),
      cmocka_unit_test_setup_teardown(test_empty_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_huge_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_large_message_truncated, setup, teardown),
      cmocka_unit_test(test_truncation_keeps_utf8_whole),
      cmocka_unit_test(test_deep_nesting),
      cmocka_unit_test_setup_teardown(test_not_a_regular_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_restart_false, setup, teardown),
      cmocka_unit_test_setup_teardown(test_restart_only_json_booleans_count, setup, teardown),
      cmocka_unit_test(test_restart_false_without_message),
      cmocka_unit_test(test_verdict),
      cmocka_unit_test(test_import_error),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
