// deps: common/fs.c
/* test_fs: mkdir -p and its parent-directory form, in a fresh temporary directory. */
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "common/fs.h"

static char root[64];

static int is_dir(const char *rel) {
  char p[PATH_MAX];
  struct stat st;
  snprintf(p, sizeof p, "%s/%s", root, rel);
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int setup(void **state) {
  snprintf(root, sizeof root, "/tmp/test_fs.XXXXXX");
  return mkdtemp(root) ? 0 : -1;
}

static void test_mkdir_p(void **state) {
  char p[PATH_MAX], failed[PATH_MAX] = "";
  snprintf(p, sizeof p, "%s/a/b/c", root);
  assert_int_equal(fs_mkdir_p(p, failed, sizeof failed), 0);
  assert_true(is_dir("a/b/c"));
  assert_int_equal(fs_mkdir_p(p, failed, sizeof failed), 0); /* existing: fine */
  snprintf(p, sizeof p, "%s/a/d/", root);                    /* trailing slash */
  assert_int_equal(fs_mkdir_p(p, NULL, 0), 0);
  assert_true(is_dir("a/d"));
  assert_int_equal(fs_mkdir_p("", failed, sizeof failed), 0);

  /* A file in the way: the error (ENOTDIR) names the component that could not be made. */
  snprintf(p, sizeof p, "%s/file", root);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fclose(f);
  snprintf(p, sizeof p, "%s/file/x/y", root);
  int rc = fs_mkdir_p(p, failed, sizeof failed);
  printf("  %s: %s (component %s)\n", p, strerror(-rc), failed);
  assert_true(rc < 0);
  char want[PATH_MAX];
  snprintf(want, sizeof want, "%s/file/x", root);
  assert_string_equal(failed, want);
}

static void test_mkdir_parent(void **state) {
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/m/n/metrics.jsonl", root);
  assert_int_equal(fs_mkdir_parent(p, NULL, 0), 0);
  assert_true(is_dir("m/n"));
  assert_false(is_dir("m/n/metrics.jsonl")); /* the file part is not made */
  assert_int_equal(fs_mkdir_parent("metrics.jsonl", NULL, 0), 0); /* no directory part */
  assert_int_equal(fs_mkdir_parent("/x.json", NULL, 0), 0);       /* the root */
}

/* fs_read_file: the whole of a small regular file, NUL-terminated; everything else refused
 * before a byte is read (a FIFO without waiting for a writer). */
static void test_read_file(void **state) {
  (void)state;
  char p[PATH_MAX], *buf = NULL;
  size_t len = 0;
  long long size = 0;
  snprintf(p, sizeof p, "%s/f.txt", root);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs("hello", f);
  fclose(f);
  assert_int_equal(fs_read_file(p, 5, &buf, &len, &size), 0);
  assert_int_equal(len, 5);
  assert_string_equal(buf, "hello");
  free(buf);
  assert_int_equal(fs_read_file(p, 4, &buf, &len, &size), -EFBIG);
  assert_null(buf);
  assert_int_equal(size, 5);
  snprintf(p, sizeof p, "%s/fifo", root);
  assert_int_equal(mkfifo(p, 0600), 0);
  assert_int_equal(fs_read_file(p, 100, &buf, &len, NULL), -EINVAL);
  assert_int_equal(fs_read_file(root, 100, &buf, &len, NULL), -EINVAL);
  snprintf(p, sizeof p, "%s/absent", root);
  assert_int_equal(fs_read_file(p, 100, &buf, &len, NULL), -ENOENT);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mkdir_p),
      cmocka_unit_test(test_mkdir_parent),
      cmocka_unit_test(test_read_file),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
