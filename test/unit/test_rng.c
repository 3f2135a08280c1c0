// deps: trainer/model/rng.c
/* test_rng: rng_skip lands where sequential draws land, bit for bit: after n rng_u64 for any n,
 * and after 2k normals for any k (the parallel weight initialization relies on it). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/model/rng.h"

static void test_skip_u64(void **state) {
  (void)state;
  const uint64_t ns[] = {0, 1, 2, 7, 1000, 262145};
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    rng_t seq, jump;
    rng_init(&seq, 1337, rng_hash_str("tok_embeddings.weight"));
    jump = seq;
    for (uint64_t j = 0; j < ns[i]; j++)
      rng_u64(&seq);
    rng_skip(&jump, ns[i]);
    int same = 1;
    for (int j = 0; j < 8; j++)
      same &= rng_u64(&seq) == rng_u64(&jump);
    printf("skip %llu u64: next 8 draws %s\n", (unsigned long long)ns[i], same ? "equal" : "DIFFER");
    assert_true(same);
  }
}

static void test_skip_normals(void **state) {
  (void)state;
  const uint64_t ks[] = {0, 2, 10, 4096, 262144};
  for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
    rng_t seq, jump;
    rng_init(&seq, 7, 99);
    jump = seq;
    for (uint64_t j = 0; j < ks[i]; j++)
      rng_normal(&seq);
    rng_skip(&jump, ks[i]);
    int same = 1;
    for (int j = 0; j < 9; j++) {
      double a = rng_normal(&seq), b = rng_normal(&jump);
      same &= memcmp(&a, &b, sizeof a) == 0;
    }
    printf("skip %llu normals: next 9 normals %s\n", (unsigned long long)ks[i], same ? "bit-identical" : "DIFFER");
    assert_true(same);
  }
  /* an odd skip from a fresh stream lands mid-pair: not the sequential value (the rule is 2k) */
  rng_t seq, jump;
  rng_init(&seq, 7, 99);
  jump = seq;
  rng_normal(&seq);
  rng_skip(&jump, 1);
  double a = rng_normal(&seq), b = rng_normal(&jump);
  printf("odd skip: %.17g vs %.17g (expected to differ)\n", a, b);
  assert_true(a != b);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_skip_u64), cmocka_unit_test(test_skip_normals)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
