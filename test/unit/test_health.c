// deps: launcher/health.c launcher/health_probe.c common/gemm_rate.c common/store.c common/store_proto.c common/net.c common/log.c common/err.c common/env.c
/* Unit tests of health's judgement (--health_check): the median of odd and even counts; a node
 * below the fraction of either median is named; left out worst first while --nnodes' minimum
 * remains, never the node that serves the store; the rest kept as a warning; and the lines
 * that say so. Pure functions: no thread, no store. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "launcher/health.h"

static health_result_t node(double gflops, double mbps, int keep) {
  health_result_t r = {.gflops = gflops, .mbps = mbps, .keep = keep, .devices = 1};
  snprintf(r.host, sizeof r.host, "h");
  snprintf(r.device, sizeof r.device, "cpu");
  return r;
}

static void test_median(void **state) {
  double odd[] = {5, 1, 3}, even[] = {4, 1, 3, 2};
  assert_true(health_median(odd, 3) == 3);
  assert_true(health_median(even, 4) == 2.5);
  assert_true(health_median(odd, 1) == 5);
  assert_true(health_median(odd, 0) == 0);
}

static void test_all_healthy(void **state) {
  health_result_t r[3] = {node(10, 100, 0), node(9, 90, 0), node(11, 120, 0)};
  health_verdict_t v[3];
  health_summary_t s;
  assert_int_equal(health_judge(r, 3, 0.5, 2, v, &s), 0);
  assert_int_equal(s.unhealthy, 0);
  for (int i = 0; i < 3; i++) assert_int_equal(v[i], HEALTH_OK);
  assert_true(s.gemm_median == 10 && s.net_median == 100);
}

/* One slow GEMM among three, --nnodes 2:3: left out; the same under 3:3: kept. */
static void test_slow_gemm_left_out_or_kept(void **state) {
  health_result_t r[3] = {node(10, 100, 0), node(3, 100, 0), node(11, 100, 0)};
  health_verdict_t v[3];
  health_summary_t s;
  assert_int_equal(health_judge(r, 3, 0.5, 2, v, &s), 1);
  assert_int_equal(v[0], HEALTH_OK);
  assert_int_equal(v[1], HEALTH_OUT);
  assert_int_equal(v[2], HEALTH_OK);
  char line[512];
  health_line(r, 3, 1, v[1], &s, 0.5, 2, 3, line, sizeof line);
  assert_string_equal(line, "health check: node 1 (host h) GEMM 3.0 GFLOP/s on cpu is 0.30 of the median 10.0 "
                            "GFLOP/s: left out of this round (2 of --nnodes 2:3 remain)");
  assert_string_equal(s.devices, "cpu");
  assert_int_equal(health_judge(r, 3, 0.5, 3, v, &s), 0);
  assert_int_equal(v[1], HEALTH_WARN);
  assert_int_equal(s.unhealthy, 1);
  health_line(r, 3, 1, v[1], &s, 0.5, 3, 3, line, sizeof line);
  assert_non_null(strstr(line, "kept: leaving it out would leave 2 node(s), fewer than --nnodes 3:3 allows"));
}

/* Two slow nodes, room for one to go: the slower one goes, the other is kept. Exactly at the
 * fraction is healthy. */
static void test_worst_first(void **state) {
  health_result_t r[4] = {node(10, 100, 0), node(3, 100, 0), node(2, 100, 0), node(10, 100, 0)};
  health_verdict_t v[4];
  health_summary_t s;
  assert_int_equal(health_judge(r, 4, 0.5, 3, v, &s), 1);
  assert_int_equal(s.unhealthy, 2);
  assert_int_equal(v[1], HEALTH_WARN);
  assert_int_equal(v[2], HEALTH_OUT);
  health_result_t edge[3] = {node(10, 0, 0), node(5, 0, 0), node(10, 0, 0)};
  assert_int_equal(health_judge(edge, 3, 0.5, 1, v, &s), 0);
  assert_int_equal(v[1], HEALTH_OK);
}

/* The node that serves the store stays, named as such; a slow link counts like a slow GEMM. */
static void test_keep_and_link(void **state) {
  health_result_t r[3] = {node(2, 100, 1), node(10, 10, 0), node(10, 100, 0)};
  health_verdict_t v[3];
  health_summary_t s;
  assert_int_equal(health_judge(r, 3, 0.5, 1, v, &s), 1);
  assert_int_equal(v[0], HEALTH_WARN);
  assert_int_equal(v[1], HEALTH_OUT);
  char line[512];
  health_line(r, 3, 0, v[0], &s, 0.5, 1, 3, line, sizeof line);
  assert_non_null(strstr(line, "kept: it serves the rendezvous store"));
  health_line(r, 3, 1, v[1], &s, 0.5, 1, 3, line, sizeof line);
  assert_non_null(strstr(line, "link to the next node 10 MB/s is 0.10 of the median 100 MB/s: left out"));
}

/* One node: its own median, never unhealthy. */
static void test_one_node(void **state) {
  health_result_t r[1] = {node(1, 0, 0)};
  health_verdict_t v[1];
  health_summary_t s;
  assert_int_equal(health_judge(r, 1, 0.9, 1, v, &s), 0);
  assert_int_equal(v[0], HEALTH_OK);
}

/* What measured: the device kind and count in the lines and the summary, TFLOP/s from 1000
 * GFLOP/s on; nodes that measured on different devices make "mixed devices". */
static void test_devices(void **state) {
  health_result_t r[3] = {node(700000, 0, 0), node(200000, 0, 0), node(710000, 0, 0)};
  for (int i = 0; i < 3; i++) {
    snprintf(r[i].device, sizeof r[i].device, "cuda");
    r[i].devices = 8;
  }
  health_verdict_t v[3];
  health_summary_t s;
  char line[512], rate[32];
  assert_int_equal(health_judge(r, 3, 0.5, 2, v, &s), 1);
  assert_string_equal(s.devices, "cuda x8");
  health_line(r, 3, 1, v[1], &s, 0.5, 2, 3, line, sizeof line);
  assert_string_equal(line, "health check: node 1 (host h) GEMM 200.0 TFLOP/s on cuda x8 is 0.29 of the median 700.0 "
                            "TFLOP/s: left out of this round (2 of --nnodes 2:3 remain)");
  health_flops_text(999.94, rate, sizeof rate);
  assert_string_equal(rate, "999.9 GFLOP/s");
  health_flops_text(1000, rate, sizeof rate);
  assert_string_equal(rate, "1.0 TFLOP/s");
  snprintf(r[2].device, sizeof r[2].device, "host-cpu");
  r[2].devices = 1;
  health_judge(r, 3, 0.5, 2, v, &s);
  assert_string_equal(s.devices, "mixed devices");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_median),
      cmocka_unit_test(test_all_healthy),
      cmocka_unit_test(test_slow_gemm_left_out_or_kept),
      cmocka_unit_test(test_worst_first),
      cmocka_unit_test(test_keep_and_link),
      cmocka_unit_test(test_one_node),
      cmocka_unit_test(test_devices),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
