// deps: trainer/formats/safetensors.c test/support/files.c common/err.c
/* test_safetensors: round trip of fp32/int32 tensors and metadata; corrupt files refused.
 *
 * Each corrupt case starts from a valid file and breaks one thing (truncation, header length,
 * header JSON, offsets, dtype, shape), then checks that st_open fails with ST_ECORRUPT and a
 * message that names the problem. Files live in a fresh mkdtemp directory. Also the finite-value
 * check every weights reader runs (st_check_finite). */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "test/support/files.h"

#include "trainer/formats/safetensors.h"

static char dir[256];

static void path_in(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", dir, name); }

static float w[6] = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
static int32_t ids[4] = {0, -1, 96, 2147483647};
static float bias[3] = {0.5f, 0.25f, 0.125f};

static void write_valid(const char *path) {
  st_tensor_t ts[3] = {
      {.name = "layers.0.attention.wq.weight", .dtype = ST_F32, .ndim = 2, .shape = {2, 3}, .data = w},
      {.name = "tokens", .dtype = ST_I32, .ndim = 2, .shape = {2, 2}, .data = ids},
      {.name = "norm.weight", .dtype = ST_F32, .ndim = 1, .shape = {3}, .data = bias},
  };
  const char *meta[] = {"step", "20", "plan", "{\"seed\": 1}"};
  char err[256];
  int rc = st_write(path, ts, 3, meta, 2, err, sizeof err);
  if (rc) printf("st_write: %s\n", err);
  assert_int_equal(rc, 0);
}

static unsigned char *slurp(const char *path, size_t *len) { return testfile_read(path, len); }
static void spit(const char *path, const void *b, size_t len) { testfile_write(path, b, len); }

static void test_round_trip(void **state) {
  char p[300];
  path_in(p, sizeof p, "ok.safetensors");
  write_valid(p);
  char tmp[320];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", p, (long)getpid());
  assert_int_not_equal(access(tmp, F_OK), 0); /* the temp file was renamed away */

  st_file_t *f = NULL;
  char err[256];
  assert_int_equal(st_open(&f, p, err, sizeof err), 0);
  assert_int_equal(st_num_tensors(f), 3);
  const st_tensor_t *t = st_find(f, "layers.0.attention.wq.weight");
  assert_non_null(t);
  assert_int_equal(t->dtype, ST_F32);
  assert_int_equal(t->ndim, 2);
  assert_int_equal(t->shape[0], 2);
  assert_int_equal(t->shape[1], 3);
  assert_int_equal(st_numel(t), 6);
  assert_memory_equal(t->data, w, sizeof w);
  t = st_find(f, "tokens");
  assert_non_null(t);
  assert_int_equal(t->dtype, ST_I32);
  assert_memory_equal(t->data, ids, sizeof ids);
  t = st_find(f, "norm.weight");
  assert_int_equal(t->ndim, 1);
  assert_memory_equal(t->data, bias, sizeof bias);
  assert_null(st_find(f, "nope"));
  assert_string_equal(st_metadata(f, "step"), "20");
  assert_string_equal(st_metadata(f, "plan"), "{\"seed\": 1}");
  assert_null(st_metadata(f, "absent"));
  /* the header is padded to 8 bytes, so data starts aligned */
  assert_int_equal(((uintptr_t)st_tensor_at(f, 0)->data) % 8, 0);
  st_close(f);

  /* overwrite in place (rename over an existing file) */
  write_valid(p);
  assert_int_equal(st_open(&f, p, err, sizeof err), 0);
  st_close(f);
  st_close(NULL);
}

/* Writes a valid file, applies edit, expects ST_ECORRUPT with `needle` in the message. */
static void expect_corrupt(const char *name, void (*edit)(unsigned char *b, size_t *len), const char *needle) {
  char p[300], err[256] = "";
  path_in(p, sizeof p, name);
  write_valid(p);
  size_t len;
  unsigned char *b = slurp(p, &len);
  edit(b, &len);
  spit(p, b, len);
  free(b);
  st_file_t *f = NULL;
  int rc = st_open(&f, p, err, sizeof err);
  printf("  %-12s -> %d: %s\n", name, rc, err);
  assert_int_equal(rc, ST_ECORRUPT);
  assert_null(f);
  assert_non_null(strstr(err, needle));
}

static void edit_truncate(unsigned char *b, size_t *len) { *len -= 5; }
static void edit_tiny(unsigned char *b, size_t *len) { *len = 5; }
static void edit_hlen(unsigned char *b, size_t *len) { b[5] = 0x7f; }
static void edit_json(unsigned char *b, size_t *len) { b[8] = '['; }
static void replace_in_header(unsigned char *b, const char *from, const char *to) {
  size_t hlen = 0;
  for (int i = 0; i < 8; i++)
    hlen |= (size_t)b[i] << (8 * i);
  char *h = (char *)b + 8;
  char save = h[hlen];
  h[hlen] = 0;
  char *at = strstr(h, from);
  h[hlen] = save;
  assert_non_null(at);
  assert_int_equal(strlen(from), strlen(to));
  memcpy(at, to, strlen(to));
}
static void edit_dtype(unsigned char *b, size_t *len) { replace_in_header(b, "\"I32\"", "\"F16\""); }
static void edit_shape(unsigned char *b, size_t *len) { replace_in_header(b, "[2,3]", "[2,4]"); }
static void edit_offsets(unsigned char *b, size_t *len) { replace_in_header(b, "[0,24]", "[0,99]"); }

static void test_corrupt_files_refused(void **state) {
  /* file names are neutral so that a needle never matches the path */
  expect_corrupt("bad1", edit_truncate, "(truncated?)");
  expect_corrupt("bad2", edit_tiny, "too short");
  expect_corrupt("bad3", edit_hlen, "header length");
  expect_corrupt("bad4", edit_json, "not a JSON object");
  expect_corrupt("bad5", edit_dtype, "has dtype F16");
  expect_corrupt("bad6", edit_shape, "shape needs");
  expect_corrupt("bad7", edit_offsets, "data_offsets outside");
}

static void test_errors(void **state) {
  char err[256] = "";
  st_file_t *f = NULL;
  assert_int_equal(st_open(&f, "/nonexistent/x.safetensors", err, sizeof err), ST_EIO);
  printf("  missing file: %s\n", err);
  assert_non_null(strstr(err, "/nonexistent/x.safetensors"));
  st_tensor_t dup[2] = {{.name = "a", .ndim = 1, .shape = {1}, .data = w},
                        {.name = "a", .ndim = 1, .shape = {1}, .data = w}};
  char p[300];
  path_in(p, sizeof p, "dup.safetensors");
  assert_int_equal(st_write(p, dup, 2, NULL, 0, err, sizeof err), ST_EINVAL);
  printf("  duplicate names: %s\n", err);
  assert_int_equal(st_write("/nonexistent/dir/x.safetensors", dup, 1, NULL, 0, err, sizeof err), ST_EIO);
  printf("  unwritable path: %s\n", err);
}

/* st_check_finite: the first NaN or infinity of a buffer of 3000 (three blocks of 1024 and a
 * partial one), at the first, a block's last, the next block's first and the last element; the
 * name of each kind; a buffer of the largest finite values and subnormals passes. */
static void test_check_finite(void **state) {
  enum { N = 3000 };
  static float x[N];
  size_t at = 0;
  const char *what = NULL;
  for (size_t i = 0; i < N; i++) x[i] = (i % 3 ? FLT_MAX : -1e-45f) * (i % 2 ? 1 : -1);
  assert_int_equal(st_check_finite(x, N, &at, &what), 0);
  assert_int_equal(st_check_finite(x, 0, &at, &what), 0);
  const size_t where[] = {0, 1023, 1024, 2047, N - 1};
  const float bad[] = {NAN, INFINITY, -INFINITY, -NAN, INFINITY};
  const char *names[] = {"nan", "inf", "-inf", "nan", "inf"};
  for (int k = 0; k < 5; k++) {
    const float keep = x[where[k]];
    x[where[k]] = bad[k];
    assert_int_equal(st_check_finite(x, N, &at, &what), 1);
    printf("  %s at %zu: found at %zu, named %s\n", names[k], where[k], at, what);
    assert_int_equal(at, where[k]);
    assert_string_equal(what, names[k]);
    assert_int_equal(st_check_finite(x, where[k], &at, &what), 0); /* not within the first where[k] */
    x[where[k]] = keep;
  }
  x[2500] = NAN; /* the first of two */
  x[2999] = INFINITY;
  assert_int_equal(st_check_finite(x, N, &at, &what), 1);
  assert_int_equal(at, 2500);
}

static int setup(void **state) {
  return testdir_make(dir, sizeof dir, "test_safetensors");
}
static int teardown(void **state) {
  return testdir_remove(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_corrupt_files_refused),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_check_finite),
  };
  return cmocka_run_group_tests_name("safetensors", tests, setup, teardown);
}
