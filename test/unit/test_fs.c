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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mkdir_p),
      cmocka_unit_test(test_mkdir_parent),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
