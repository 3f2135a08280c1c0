// deps: trainer/run/tensorboard.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c test/support/files.c common/fs.c common/err.c common/env.c trainer/backend/fatal.c
/* test_tensorboard: the event files of log.tensorboard_dir (trainer/run/tensorboard.c):
 * - the masked CRC32C against TFRecord's known values, and against the CRCs of whole records
 *   that TensorBoard's own Python code framed (tensorboard.compat's event_pb2 and its
 *   masked_crc32c, printed once and pasted here);
 * - a file read back record by record: every length and CRC, and each message byte for byte
 *   against those same records (the file version, START at the first step, a summary with a
 *   0 and a negative value), the wall time within the test's clock readings;
 * - names: events.out.tfevents.<10 digits>.<host>.<pid>, sorting after every file already
 *   there, also one from the future and one made in the same second;
 * - a write that fails (the descriptor turned to /dev/full) is one warning, and close reports
 *   it as a lack of space;
 * - a NULL writer does nothing; values past TENSORBOARD_MAX_VALUES warn once;
 * - the fresh-run check: an event file there is a plan error naming it.
 * test/integration/test_tensorboard.py reads a run's file with TensorBoard itself. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/net.h"
#include "test/support/files.h"
#include "trainer/run/tensorboard.h"

static char dir[256];

static int setup(void **state) { return testdir_make(dir, sizeof dir, "meshrun-tb"); }
static int teardown(void **state) { return testdir_remove(dir); }

/* Records framed by TensorBoard's Python code: Event(wall_time=1.5, file_version="brain.Event:2");
 * Event(wall_time=2.25, step=7, session_log=START); Event(wall_time=3.0, step=3, summary of
 * train/loss = 0.0 and lr = -1.5). */
static const uint8_t REC_VERSION[] =
    "\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7f\x4b\x22\x09\x00\x00\x00\x00\x00\x00\xf8\x3f\x1a\x0d\x62\x72\x61\x69"
    "\x6e\x2e\x45\x76\x65\x6e\x74\x3a\x32\x2a\x28\x64\x6c";
static const uint8_t REC_START[] =
    "\x0f\x00\x00\x00\x00\x00\x00\x00\x6d\x53\x2b\x09\x09\x00\x00\x00\x00\x00\x00\x02\x40\x10\x07\x3a\x02\x08\x01"
    "\xe0\x8c\xca\x7e";
static const uint8_t REC_SUMMARY[] =
    "\x2b\x00\x00\x00\x00\x00\x00\x00\x86\x1b\xc3\x4b\x09\x00\x00\x00\x00\x00\x00\x08\x40\x10\x03\x2a\x1e\x0a\x11"
    "\x0a\x0a\x74\x72\x61\x69\x6e\x2f\x6c\x6f\x73\x73\x15\x00\x00\x00\x00\x0a\x09\x0a\x02\x6c\x72\x15\x00\x00\xc0"
    "\xbf\x93\xad\x7d\xe4";

static uint64_t le(const uint8_t *p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static double wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One record at b (n bytes left): its length and both CRCs checked; the message's offset and
 * size. Returns the record's whole size. */
static size_t check_record(const uint8_t *b, size_t n, size_t *msg, size_t *msglen) {
  assert_true(n >= 16);
  const uint64_t len = le(b, 8);
  assert_true(len <= n - 16);
  assert_int_equal(le(b + 8, 4), tensorboard_masked_crc(b, 8));
  assert_int_equal(le(b + 12 + len, 4), tensorboard_masked_crc(b + 12, (size_t)len));
  *msg = 12;
  *msglen = (size_t)len;
  return (size_t)len + 16;
}

static void test_masked_crc(void **state) {
  /* CRC32C("123456789") = 0xe3069283; masked: rotated right 15, + 0xa282ead8 */
  assert_int_equal(tensorboard_masked_crc("123456789", 9), 0xc78ab0e5u);
  assert_int_equal(tensorboard_masked_crc("", 0), 0xa282ead8u);
  const uint8_t *recs[] = {REC_VERSION, REC_START, REC_SUMMARY};
  const size_t sizes[] = {sizeof REC_VERSION - 1, sizeof REC_START - 1, sizeof REC_SUMMARY - 1};
  for (int i = 0; i < 3; i++) {
    size_t msg, msglen;
    assert_int_equal(check_record(recs[i], sizes[i], &msg, &msglen), sizes[i]);
  }
}

/* The one event file in dir: its name into name, its bytes. */
static uint8_t *only_file(char *name, size_t namelen, size_t *len) {
  DIR *d = opendir(dir);
  assert_non_null(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++, snprintf(name, namelen, "%s", e->d_name);
  closedir(d);
  assert_int_equal(n, 1);
  char path[600];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return testfile_read(path, len);
}

/* The message at b against the record want of TensorBoard's, but for the wall time (bytes 1 to
 * 8 of both: field 1, a double), which must lie in [t0, t1]. */
static void check_message(const uint8_t *b, size_t n, const uint8_t *want, size_t wantlen, double t0, double t1) {
  assert_int_equal(n, wantlen - 16);
  assert_int_equal(b[0], 0x09);
  double t;
  uint64_t bits = le(b + 1, 8);
  memcpy(&t, &bits, sizeof t);
  printf("  wall time %.6f in [%.6f, %.6f]\n", t, t0, t1);
  assert_true(t >= t0 - 1e-3 && t <= t1 + 1e-3); /* the double's rounding of the clock */
  assert_memory_equal(b + 9, want + 12 + 9, n - 9);
}

static void test_records(void **state) {
  char err[512] = "";
  tensorboard_t *tb = NULL;
  const double t0 = wall();
  assert_int_equal(tensorboard_open(&tb, dir, 7, err, sizeof err), 0);
  tensorboard_write(tb, 2); /* nothing added: no event */
  tensorboard_add(tb, "train/loss", 0.0);
  tensorboard_add(tb, "lr", -1.5);
  tensorboard_write(tb, 3);
  const double t1 = wall();
  assert_int_equal(tensorboard_close(tb, NULL, err, sizeof err), 0);

  char name[300], host[256], want[300];
  size_t len;
  uint8_t *b = only_file(name, sizeof name, &len);
  net_hostname(host, sizeof host);
  const long long secs = strtoll(name + strlen("events.out.tfevents."), NULL, 10);
  snprintf(want, sizeof want, "events.out.tfevents.%010lld.%s.%d", secs, host, (int)getpid());
  printf("  %s\n", name);
  assert_string_equal(name, want);
  assert_true(secs >= (long long)t0 && secs <= (long long)t1);

  const uint8_t *recs[] = {REC_VERSION, REC_START, REC_SUMMARY};
  const size_t sizes[] = {sizeof REC_VERSION - 1, sizeof REC_START - 1, sizeof REC_SUMMARY - 1};
  size_t at = 0;
  for (int i = 0; i < 3; i++) {
    size_t msg, msglen;
    size_t r = check_record(b + at, len - at, &msg, &msglen);
    check_message(b + at + msg, msglen, recs[i], sizes[i], t0, t1);
    at += r;
  }
  assert_int_equal(at, len);
  free(b);
}

/* The seconds of an event file's name. */
static long long secs_of(const char *name) { return strtoll(name + strlen("events.out.tfevents."), NULL, 10); }

static void test_names_sort_after(void **state) {
  char err[512] = "", path[600];
  /* a file from the future, of another writer */
  const long long later = (long long)wall() + 100;
  snprintf(path, sizeof path, "%s/events.out.tfevents.%lld.elsewhere", dir, later);
  testfile_write(path, "", 0);
  tensorboard_t *a = NULL, *b = NULL;
  assert_int_equal(tensorboard_open(&a, dir, 1, err, sizeof err), 0);
  assert_int_equal(tensorboard_close(a, NULL, err, sizeof err), 0);
  assert_int_equal(tensorboard_open(&b, dir, 5, err, sizeof err), 0); /* the same second, surely */
  assert_int_equal(tensorboard_close(b, NULL, err, sizeof err), 0);
  struct dirent **list;
  int n = scandir(dir, &list, NULL, alphasort);
  assert_int_equal(n, 5); /* . .. and three */
  printf("  %s\n  %s\n  %s\n", list[2]->d_name, list[3]->d_name, list[4]->d_name);
  assert_string_equal(list[2]->d_name, path + strlen(dir) + 1);
  assert_int_equal(secs_of(list[3]->d_name), later + 1);
  assert_int_equal(secs_of(list[4]->d_name), later + 2);
  for (int i = 0; i < n; i++) free(list[i]);
  free(list);
}

/* The descriptor this process holds open on dir/name, found through /proc/self/fd. */
static int fd_of(const char *name) {
  char want[600], link[300], got[600];
  snprintf(want, sizeof want, "%s/%s", dir, name);
  DIR *d = opendir("/proc/self/fd");
  assert_non_null(d);
  int fd = -1;
  for (struct dirent *e; (e = readdir(d));) {
    snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(link, got, sizeof got - 1);
    if (n > 0 && (got[n] = 0, !strcmp(got, want))) fd = atoi(e->d_name);
  }
  closedir(d);
  assert_true(fd >= 0);
  return fd;
}

static void test_failed_write_is_one_warning(void **state) {
  char err[512] = "", path[300];
  tensorboard_t *tb = NULL;
  assert_int_equal(tensorboard_open(&tb, dir, 1, err, sizeof err), 0);
  char name[300];
  size_t len;
  free(only_file(name, sizeof name, &len));
  /* The writer's descriptor now writes to /dev/full: ENOSPC. */
  int full = open("/dev/full", O_WRONLY | O_CLOEXEC);
  assert_true(full >= 0);
  assert_true(dup2(full, fd_of(name)) >= 0);
  close(full);
  snprintf(path, sizeof path, "%s.stderr", dir);
  int saved = testfile_stderr_begin(path);
  for (int step = 1; step <= 3; step++) {
    tensorboard_add(tb, "train/loss", 1.0);
    tensorboard_write(tb, step);
  }
  char *text = testfile_stderr_end(saved, path);
  unlink(path);
  assert_int_equal(teststr_count(text, "no more events are written"), 1);
  assert_non_null(strstr(text, "the event of step 1 failed"));
  free(text);
  int no_space = 0;
  assert_int_equal(tensorboard_close(tb, &no_space, err, sizeof err), -1);
  printf("  close: %s\n", err);
  assert_non_null(strstr(err, "log.tensorboard_dir "));
  assert_non_null(strstr(err, "the event of step 1 failed: No space left on device"));
  assert_int_equal(no_space, 1);
}

static void test_null_writer_and_full_event(void **state) {
  tensorboard_add(NULL, "train/loss", 1.0);
  tensorboard_write(NULL, 1);
  char err[512] = "";
  assert_int_equal(tensorboard_close(NULL, NULL, err, sizeof err), 0);

  tensorboard_t *tb = NULL;
  assert_int_equal(tensorboard_open(&tb, dir, 1, err, sizeof err), 0);
  char path[300];
  snprintf(path, sizeof path, "%s.stderr", dir);
  int saved = testfile_stderr_begin(path);
  for (int i = 0; i < TENSORBOARD_MAX_VALUES + 3; i++) tensorboard_add(tb, "x", i);
  tensorboard_write(tb, 1);
  char *text = testfile_stderr_end(saved, path);
  unlink(path);
  assert_int_equal(teststr_count(text, "at most"), 1);
  free(text);
  assert_int_equal(tensorboard_close(tb, NULL, err, sizeof err), 0);
  /* the event holds the first TENSORBOARD_MAX_VALUES, 10 bytes each (a Value of "x" and a float, framed),
   * after the wall time, the step and the summary's 3-byte header */
  char name[300];
  size_t len, at = 0, msg, msglen;
  uint8_t *b = only_file(name, sizeof name, &len);
  for (int i = 0; i < 3; i++) at += check_record(b + at, len - at, &msg, &msglen);
  assert_int_equal(at, len);
  assert_int_equal(msglen, 9 + 2 + 3 + TENSORBOARD_MAX_VALUES * (2 + 3 + 5));
  free(b);
}

static void test_check_fresh(void **state) {
  char err[512] = "", path[600];
  assert_int_equal(tensorboard_check_fresh(dir, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/missing", dir);
  assert_int_equal(tensorboard_check_fresh(path, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/notes.txt", dir);
  testfile_write(path, "x", 1);
  assert_int_equal(tensorboard_check_fresh(dir, err, sizeof err), 0);
  snprintf(path, sizeof path, "%s/events.out.tfevents.1700000000.host.12", dir);
  testfile_write(path, "", 0);
  assert_int_equal(tensorboard_check_fresh(dir, err, sizeof err), -1);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "plan error: log.tensorboard_dir: "));
  assert_non_null(strstr(err, "(events.out.tfevents.1700000000.host.12)"));
  assert_non_null(strstr(err, "--set overwrite=true"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_masked_crc),
      cmocka_unit_test_setup_teardown(test_records, setup, teardown),
      cmocka_unit_test_setup_teardown(test_names_sort_after, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_write_is_one_warning, setup, teardown),
      cmocka_unit_test_setup_teardown(test_null_writer_and_full_event, setup, teardown),
      cmocka_unit_test_setup_teardown(test_check_fresh, setup, teardown),
  };
  return cmocka_run_group_tests_name("tensorboard", tests, NULL, NULL);
}
