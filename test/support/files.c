/* files: whole-file read and write for tests (see files.h). */
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
