/* files: whole-file read and write, and scratch directories, for tests (see files.h). */
#include "test/support/files.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

size_t testfile_write_llama2c_tok(const char *path, int32_t max_len, int with_bytes, const testpiece_t *extra, int n) {
  const testpiece_t head[3] = {{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
  const int nbytes = with_bytes ? 256 : 0, total = 3 + nbytes + n;
  size_t size = 4 + (size_t)nbytes * (8 + 6); /* a byte piece: score, length, "<0xNN>" */
  for (int i = 0; i < 3; i++) size += 8 + strlen(head[i].s);
  for (int i = 0; i < n; i++) size += 8 + strlen(extra[i].s);
  unsigned char *buf = malloc(size), *w = buf;
  assert_non_null(buf);
  memcpy(w, &max_len, 4), w += 4;
  for (int i = 0; i < total; i++) {
    char byte[8];
    testpiece_t p = i < 3 ? head[i] : i < 3 + nbytes ? (testpiece_t){byte, 0} : extra[i - 3 - nbytes];
    if (i >= 3 && i < 3 + nbytes) snprintf(byte, sizeof byte, "<0x%02X>", i - 3);
    int32_t len = (int32_t)strlen(p.s);
    memcpy(w, &p.score, 4), w += 4;
    memcpy(w, &len, 4), w += 4;
    memcpy(w, p.s, (size_t)len), w += len;
  }
  assert_int_equal((size_t)(w - buf), size);
  testfile_write(path, buf, size);
  free(buf);
  return size;
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

int testfile_stderr_begin(const char *path) {
  fflush(stderr);
  int saved = dup(STDERR_FILENO);
  FILE *f = fopen(path, "w");
  assert_true(saved >= 0 && f);
  assert_true(dup2(fileno(f), STDERR_FILENO) >= 0);
  fclose(f);
  return saved;
}

char *testfile_stderr_end(int saved, const char *path) {
  fflush(stderr);
  assert_true(dup2(saved, STDERR_FILENO) >= 0);
  close(saved);
  size_t n = 0;
  char *s = (char *)testfile_read(path, &n);
  s[n] = 0;
  printf("%s", s);
  return s;
}

int teststr_count(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
  return n;
}
