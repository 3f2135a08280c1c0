// deps: trainer/plan/pipeline.c common/err.c
/* test_pipeline: the pipeline schedules as data (trainer/plan/pipeline.h), without a model.
 *
 * What is checked:
 * - every generated schedule (gpipe, 1f1b for p = 2..8 and m in {p, p+1, 2p, 3p+1, 4p};
 *   interleaved_1f1b for v = 2..4 and m in {p, 2p, 4p}) passes pp_check: complete, every
 *   message received once in order, no deadlock;
 * - the bubble of the unit-cost simulation (forward 1, backward 2; interleaved stages 1/v of
 *   that) equals the theory: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v m + p - 1) for
 *   interleaved, tolerance 1e-9, with the worst difference printed;
 * - memory: gpipe holds all m micro-batches on every rank, 1f1b at most p - r on rank r;
 * - the checker can fail: a receive moved before the send it waits for (deadlock), a backward
 *   dropped (incomplete), two receives swapped (out of order), a stage on the wrong rank, a
 *   forward before its input: each is reported with its own message (and a schedule that never
 *   runs some task is "incomplete", checked at the end);
 * - validation: 1f1b with fewer micro-batches than stages, interleaved with v < 2 or m not a
 *   multiple of p, gpipe with v > 1: one line each;
 * - the layer split balances blocks, moves blocks off the stages with the embedding and the
 *   output as their cost grows, and refuses more stages than layers. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/plan/pipeline.h"

static void check_ok(pp_schedule_t s, int p, int v, int m, double *worst) {
  pp_plan_t pl;
  pp_stats_t st;
  char err[256] = "";
  if (pp_generate(s, p, v, m, &pl, err, sizeof err)) fail_msg("generate %s p=%d v=%d m=%d: %s", pp_schedule_name(s), p, v, m, err);
  if (pp_check(&pl, 1.0 / v, 2.0 / v, &st, err, sizeof err))
    fail_msg("%s p=%d v=%d m=%d: %s", pp_schedule_name(s), p, v, m, err);
  double theory = s == PP_INTERLEAVED_1F1B ? (double)(p - 1) / (v * m + p - 1) : (double)(p - 1) / (m + p - 1);
  double d = fabs(st.bubble - theory);
  if (d > *worst) *worst = d;
  if (d > 1e-9)
    fail_msg("%s p=%d v=%d m=%d: bubble %.6f, theory %.6f", pp_schedule_name(s), p, v, m, st.bubble, theory);
  for (int r = 0; r < p; r++) {
    if (s == PP_GPIPE) assert_int_equal(st.peak_inflight[r], m);
    if (s == PP_1F1B) assert_int_equal(st.peak_inflight[r], p - r < m ? p - r : m);
    /* the runner's activation slots hold every micro-batch in flight, with at most a receive
     * posted ahead and the spare on top; interleaved pools them per chunk, each sized for that
     * chunk's own peak, which the chunks reach at different times (p 3, v 2, m 6, rank 1: 6 and 3
     * in flight, never more than 6 together), so there only v times the bound holds */
    int slots[PP_MAX_CHUNKS], total = 0;
    pp_slots(&pl, r, slots);
    for (int c = 0; c < v; c++) {
      if (slots[c] < 1) fail_msg("%s p=%d v=%d m=%d: rank %d chunk %d has no slot", pp_schedule_name(s), p, v, m, r, c);
      total += slots[c];
    }
    if (total < st.peak_inflight[r] || total > v * (st.peak_inflight[r] + 2))
      fail_msg("%s p=%d v=%d m=%d rank %d: %d slots for %d in flight", pp_schedule_name(s), p, v, m, r, total,
               st.peak_inflight[r]);
    if (s == PP_1F1B && r == 0) assert_int_equal(total, p < m ? p : m); /* no spare: it sends no gradient */
  }
  pp_free(&pl);
}

static void test_every_schedule_checks(void **state) {
  double worst = 0;
  int n = 0;
  for (int p = 2; p <= 8; p++) {
    int ms[] = {p, p + 1, 2 * p, 3 * p + 1, 4 * p};
    for (int i = 0; i < 5; i++) {
      check_ok(PP_GPIPE, p, 1, ms[i], &worst);
      check_ok(PP_1F1B, p, 1, ms[i], &worst);
      n += 2;
    }
    for (int v = 2; v <= 4; v++)
      for (int k = 1; k <= 4; k *= 2) {
        check_ok(PP_INTERLEAVED_1F1B, p, v, k * p, &worst);
        n++;
      }
  }
  printf("%d schedules checked; worst |bubble - theory| = %.3g (tolerance 1e-9)\n", n, worst);
}

/* A valid 1f1b schedule to break. */
static void gen(pp_plan_t *pl, pp_schedule_t s, int p, int v, int m) {
  char err[256];
  assert_int_equal(pp_generate(s, p, v, m, pl, err, sizeof err), 0);
}

static void expect_fail(const pp_plan_t *pl, const char *needle) {
  pp_stats_t st;
  char err[256] = "";
  assert_int_equal(pp_check(pl, 1, 2, &st, err, sizeof err), -1);
  printf("  rejected: %s\n", err);
  if (!strstr(err, needle)) fail_msg("expected \"%s\" in: %s", needle, err);
}

static int find(const pp_plan_t *pl, int r, pp_kind_t k, int from) {
  for (int i = from; i < pl->n[r]; i++)
    if (pl->act[r][i].kind == k) return i;
  fail_msg("no %s on rank %d", pp_kind_name(k), r);
  return -1;
}

static void test_checker_catches_broken_schedules(void **state) {
  pp_plan_t pl;
  /* Deadlock: rank 1's first action becomes its first gradient receive, which needs rank 2's
   * backward, which needs rank 1's activation. */
  gen(&pl, PP_1F1B, 4, 1, 8);
  int g = find(&pl, 1, PP_RECV_GRAD, 0);
  pp_action_t a = pl.act[1][g];
  memmove(&pl.act[1][1], &pl.act[1][0], (size_t)g * sizeof a);
  pl.act[1][0] = a;
  expect_fail(&pl, "deadlock");
  pp_free(&pl);

  /* A backward dropped: rank 3's last one (the last stage); its gradient send then has nothing. */
  gen(&pl, PP_1F1B, 4, 1, 8);
  int last = pl.n[3] - 1;
  while (pl.act[3][last].kind != PP_BWD) last--;
  memmove(&pl.act[3][last], &pl.act[3][last + 1], (size_t)(pl.n[3] - last - 1) * sizeof(pp_action_t));
  pl.n[3]--;
  expect_fail(&pl, "before computing it");
  pp_free(&pl);

  /* Out of order: rank 2's first two activation receives swapped (with their forwards). */
  gen(&pl, PP_GPIPE, 3, 1, 4);
  int r0 = find(&pl, 2, PP_RECV_ACT, 0), r1 = find(&pl, 2, PP_RECV_ACT, r0 + 1);
  int t = pl.act[2][r0].mb;
  pl.act[2][r0].mb = pl.act[2][r1].mb;
  pl.act[2][r1].mb = t;
  pl.act[2][r0 + 1].mb = pl.act[2][r0].mb;
  pl.act[2][r1 + 1].mb = pl.act[2][r1].mb;
  expect_fail(&pl, "send order");
  pp_free(&pl);

  /* Incomplete: every action of micro-batch 2 removed from every rank (consistent, so nothing
   * else notices). */
  gen(&pl, PP_1F1B, 3, 1, 4);
  for (int r = 0; r < 3; r++) {
    int k = 0;
    for (int i = 0; i < pl.n[r]; i++)
      if (pl.act[r][i].mb != 2) pl.act[r][k++] = pl.act[r][i];
    pl.n[r] = k;
  }
  expect_fail(&pl, "incomplete: stage 0 micro-batch 2 never forwarded");
  pp_free(&pl);

  /* Wrong rank: rank 0 claims stage 1. */
  gen(&pl, PP_GPIPE, 2, 1, 2);
  pl.act[0][find(&pl, 0, PP_FWD, 0)].stage = 1;
  expect_fail(&pl, "lives on rank 1");
  pp_free(&pl);

  /* A forward before its input: rank 1's first receive removed. */
  gen(&pl, PP_GPIPE, 2, 1, 2);
  int rr = find(&pl, 1, PP_RECV_ACT, 0);
  memmove(&pl.act[1][rr], &pl.act[1][rr + 1], (size_t)(pl.n[1] - rr - 1) * sizeof(pp_action_t));
  pl.n[1]--;
  expect_fail(&pl, "before its input");
  pp_free(&pl);
}

static void expect_invalid(pp_schedule_t s, int p, int v, int m, const char *needle) {
  char err[256] = "";
  pp_plan_t pl;
  assert_int_equal(pp_validate(s, p, v, m, err, sizeof err), -1);
  assert_int_equal(pp_generate(s, p, v, m, &pl, err, sizeof err), -1);
  printf("  invalid: %s\n", err);
  if (!strstr(err, needle) || strchr(err, '\n')) fail_msg("expected one line with \"%s\": %s", needle, err);
}

static void test_validation(void **state) {
  expect_invalid(PP_1F1B, 4, 1, 3, "at least as many micro-batches");
  expect_invalid(PP_INTERLEAVED_1F1B, 4, 1, 8, "pp_stages_per_rank >= 2");
  expect_invalid(PP_INTERLEAVED_1F1B, 4, 2, 6, "multiple");
  expect_invalid(PP_GPIPE, 2, 2, 4, "one stage per rank");
  expect_invalid(PP_GPIPE, 2, 1, 0, "pp_microbatches");
  pp_schedule_t s;
  assert_int_equal(pp_schedule_parse("interleaved_1f1b", &s), 0);
  assert_int_equal(s, PP_INTERLEAVED_1F1B);
  assert_int_equal(pp_schedule_parse("zb", &s), -1);
  char err[128];
  assert_int_equal(pp_validate(PP_1F1B, 4, 1, 4, err, sizeof err), 0);
}

static void test_split(void **state) {
  int first[9];
  char err[256];
  assert_int_equal(pp_split(8, 4, 0, 0, first, err, sizeof err), 0);
  int even[] = {0, 2, 4, 6, 8};
  assert_memory_equal(first, even, sizeof even);
  /* output costs two blocks: the last stage keeps 1, the other 7 spread over 3 (3,2,2 or so) */
  assert_int_equal(pp_split(8, 4, 0, 2, first, err, sizeof err), 0);
  printf("  8 layers, 4 stages, head 2 blocks: first layers %d %d %d %d\n", first[0], first[1], first[2], first[3]);
  assert_int_equal(first[4] - first[3], 1);
  for (int s = 0; s < 3; s++) assert_true(first[s + 1] - first[s] <= 3);
  /* the embedding costs one block: 7 layers over 2 stages balance as 3 + embedding vs 4 */
  assert_int_equal(pp_split(7, 2, 1, 0, first, err, sizeof err), 0);
  assert_int_equal(first[1], 3);
  assert_int_equal(pp_split(3, 4, 0, 0, first, err, sizeof err), -1);
  printf("  refused: %s\n", err);
  assert_non_null(strstr(err, "at least one block"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_schedule_checks),
      cmocka_unit_test(test_checker_catches_broken_schedules),
      cmocka_unit_test(test_validation),
      cmocka_unit_test(test_split),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
