// deps: trainer/run/opprof.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/env.c trainer/backend/fatal.c common/err.c
/* test_opprof: the per-kernel step profile (MESHRUN_OP_PROFILE) on the cpu backend.
 *
 * Checks that only the chosen step is recorded, that every call of it is counted under its op
 * (and a nested wrapped call is not counted twice), that the wrapped kernels compute the same
 * bits as the unwrapped ones, that the report names the step, the ops and the time outside
 * the kernels, that uninstall restores the table, and that a bad MESHRUN_OP_PROFILE is refused
 * with a message naming it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/backend/backend.h"
#include "trainer/run/opprof.h"

static void fill(float *x, size_t n, float s) {
  for (size_t i = 0; i < n; i++)
    x[i] = s * (float)((i * 37 % 101) - 50) / 50.0f;
}

static void test_env(void **state) {
  (void)state;
  char err[256] = "";
  unsetenv("MESHRUN_OP_PROFILE");
  assert_int_equal(opprof_step_from_env(err, sizeof err), 0);
  setenv("MESHRUN_OP_PROFILE", "", 1);
  assert_int_equal(opprof_step_from_env(err, sizeof err), 0);
  setenv("MESHRUN_OP_PROFILE", "7", 1);
  assert_int_equal(opprof_step_from_env(err, sizeof err), 7);
  const char *bad[] = {"0", "-3", "x", "3x", "1.5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("MESHRUN_OP_PROFILE", bad[i], 1);
    err[0] = '\0';
    assert_int_equal(opprof_step_from_env(err, sizeof err), -1);
    printf("MESHRUN_OP_PROFILE=%s -> %s\n", bad[i], err);
    assert_non_null(strstr(err, "MESHRUN_OP_PROFILE"));
  }
  unsetenv("MESHRUN_OP_PROFILE");
}

static void test_step(void **state) {
  (void)state;
  char err[256];
  backend_t *be = backend_create("cpu", 1, err, sizeof err);
  assert_non_null(be);
  const struct backend orig = *be;
  enum { M = 48, N = 40, K = 56 };
  float *a = malloc(M * K * sizeof *a), *b = malloc(K * N * sizeof *b);
  float *c1 = calloc(M * N, sizeof *c1), *c2 = calloc(M * N, sizeof *c2), *s = calloc(M * N, sizeof *s);
  fill(a, M * K, 1.0f);
  fill(b, K * N, 0.5f);
  /* the reference product, unwrapped */
  be->matmul(be, c1, a, b, M, N, K, 0, 0, 1.0f, 0.0f, DT_F32, DT_F32);

  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  assert_int_equal(opprof_install(be, 2, out), 0);
  assert_int_equal(opprof_install(be, 2, out), -1); /* one backend at a time */
  assert_ptr_not_equal(be->matmul, orig.matmul);

  /* step 1 is not profiled */
  opprof_step_begin(1);
  be->matmul(be, c2, a, b, M, N, K, 0, 0, 1.0f, 0.0f, DT_F32, DT_F32);
  opprof_step_end(1, 0.01);
  fflush(out);
  assert_int_equal(len, 0);

  /* step 2: two matmul shapes, three adds, one sum of squares */
  opprof_step_begin(2);
  be->matmul(be, c2, a, b, M, N, K, 0, 0, 1.0f, 0.0f, DT_F32, DT_F32);
  be->matmul(be, s, a, b, M, N / 2, K, 0, 0, 1.0f, 0.0f, DT_F32, DT_F32);
  for (int i = 0; i < 3; i++)
    be->add(be, s, s, s, M * N, DT_F32);
  double ss = be->sumsq(be, a, M * K);
  opprof_step_end(2, 1.0);
  fclose(out);

  printf("%s", text);
  printf("calls: matmul %d, add %d, sumsq %d, adamw %d; matmul %.3g s\n", opprof_calls("matmul"),
         opprof_calls("add"), opprof_calls("sumsq"), opprof_calls("adamw"), opprof_seconds("matmul"));
  assert_int_equal(opprof_calls("matmul"), 2);
  assert_int_equal(opprof_calls("add"), 3);
  assert_int_equal(opprof_calls("sumsq"), 1);
  assert_int_equal(opprof_calls("adamw"), 0);
  assert_true(opprof_seconds("matmul") > 0);
  assert_true(ss > 0);
  /* the wrapped matmul computed the same bits (step 2's product is the last one into c2) */
  assert_memory_equal(c1, c2, M * N * sizeof *c1);
  assert_non_null(strstr(text, "op profile of step 2 on cpu"));
  assert_non_null(strstr(text, "m48 n40 k56 NN fp32>fp32"));
  assert_non_null(strstr(text, "m48 n20 k56 NN fp32>fp32"));
  assert_non_null(strstr(text, "(outside)"));
  assert_non_null(strstr(text, "6 kernel calls"));

  /* after the step nothing more is recorded */
  be->add(be, s, s, s, M * N, DT_F32);
  assert_int_equal(opprof_calls("add"), 3);

  opprof_uninstall(be);
  assert_ptr_equal(be->matmul, orig.matmul);
  assert_ptr_equal(be->adamw, orig.adamw);
  assert_int_equal(opprof_install(be, 1, NULL), 0); /* free again once uninstalled */
  opprof_uninstall(be);
  free(text);
  free(a), free(b), free(c1), free(c2), free(s);
  backend_destroy(be);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_env), cmocka_unit_test(test_step)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
