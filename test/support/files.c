/* files: whole-file read and write, and scratch directories, for tests (see files.h). */
#include "test/support/files.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

unsigned char *testfile_read(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  *len = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*len + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, *len, f), *len);
  fclose(f);
  return b;
}

void testfile_write(const char *path, const void *b, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(b, 1, len, f), len);
  fclose(f);
}

int testdir_make(char *dir, size_t len, const char *prefix) {
  snprintf(dir, len, "/tmp/%s.XXXXXX", prefix);
  return mkdtemp(dir) ? 0 : -1;
}

int testdir_remove(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}
