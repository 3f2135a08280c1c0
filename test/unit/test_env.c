// deps: common/env.c common/err.c
/* test_env: the environment readers' one set of rules (unset/empty = default, garbage and
 * out-of-range values reported, never silently taken) and err_set's buffer handling. */
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/env.h"
#include "common/err.h"

#define VAR "MESHRUN_TEST_ENV_VALUE"

static void test_int(void **state) {
  (void)state;
  int v = 0;
  unsetenv(VAR);
  assert_int_equal(env_int(VAR, 0, 10, 7, &v), 0);
  assert_int_equal(v, 7);
  setenv(VAR, "", 1);
  assert_int_equal(env_int(VAR, 0, 10, 7, &v), 0);
  assert_int_equal(v, 7);
  setenv(VAR, "3", 1);
  assert_int_equal(env_int(VAR, 0, 10, 7, &v), 0);
  assert_int_equal(v, 3);
  const char *bad[] = {"abc", "3x", "-1", "11", " ", "99999999999999999999", "1.5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv(VAR, bad[i], 1);
    v = 0;
    assert_int_equal(env_int(VAR, 0, 10, 7, &v), -EINVAL);
    assert_int_equal(v, 7); /* the default is stored even when the value is refused */
  }
  setenv(VAR, "2147483647", 1);
  assert_int_equal(env_int(VAR, 0, INT_MAX, 0, &v), 0);
  assert_int_equal(v, INT_MAX);
  unsetenv(VAR);
}

static void test_double_bool_str(void **state) {
  (void)state;
  double d = 0;
  setenv(VAR, "2.5", 1);
  assert_int_equal(env_double(VAR, 0.001, 100, 1, &d), 0);
  assert_true(d == 2.5);
  setenv(VAR, "nan", 1);
  assert_int_equal(env_double(VAR, 0.001, 100, 1, &d), -EINVAL);
  assert_true(d == 1);
  setenv(VAR, "0", 1);
  assert_int_equal(env_double(VAR, 0.001, 100, 1, &d), -EINVAL);

  int b = -1;
  const char *yes[] = {"1", "true", "YES", "On"}, *no[] = {"0", "False", "no", "OFF"};
  for (int i = 0; i < 4; i++) {
    setenv(VAR, yes[i], 1);
    assert_int_equal(env_bool(VAR, 0, &b), 0);
    assert_int_equal(b, 1);
    setenv(VAR, no[i], 1);
    assert_int_equal(env_bool(VAR, 1, &b), 0);
    assert_int_equal(b, 0);
  }
  setenv(VAR, "maybe", 1);
  assert_int_equal(env_bool(VAR, 1, &b), -EINVAL);
  assert_int_equal(b, 1);

  setenv(VAR, "", 1);
  assert_null(env_str(VAR));
  assert_string_equal(env_text(VAR), "");
  unsetenv(VAR);
  assert_null(env_str(VAR));
  assert_string_equal(env_text(VAR), "(unset)"); /* never NULL for a %s */
}

static void test_err_set(void **state) {
  (void)state;
  char buf[8];
  assert_int_equal(err_set(buf, sizeof buf, -42, "%s %d", "abc", 12345), -42);
  assert_string_equal(buf, "abc 123"); /* cut to the buffer, NUL-terminated */
  assert_int_equal(err_set(NULL, 0, -3, "ignored %d", 1), -3);
  buf[0] = 'x';
  assert_int_equal(err_set(buf, 0, 5, "nothing written"), 5);
  assert_int_equal(buf[0], 'x');
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_int),
      cmocka_unit_test(test_double_bool_str),
      cmocka_unit_test(test_err_set),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
