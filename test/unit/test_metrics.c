// deps: trainer/run/metrics.c trainer/run/tensorboard.c trainer/run/opprof.c trainer/run/weights.c trainer/formats/data.c trainer/formats/tokenizer.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/serial_run.c test/support/files.c
/* test_metrics: the records of log.metrics_file (trainer/run/metrics.c), written by a run of one
 * process (the serial strategy, a tiny model) and parsed back as JSON:
 * - the first record: the plan, the sizes (parameters, tokens per step = global batch x
 *   seq_len, data and val tokens), the strategy, the mesh, the bytes per rank of parameters,
 *   gradients and AdamW moments, the dtypes, the start step;
 * - a step record: the values given, tokens/s = tokens per step / dt, FLOP/s = that x the
 *   model FLOPs per token, 6 N + 12 L d T with N counted here by hand for the tiny model
 *   (43008), MFU over log.peak_tflops, and step, compute and comm-wait times in ms; no "comm"
 *   without a mesh; an eval record;
 * - a resumed run appends, and a torn last line stays a line of its own;
 * - a write that fails (/dev/full) is one warning, and metrics_close reports the lack of space.
 * Numbers printed with %.6g are checked to 1e-5 relative. */
#include <cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/files.h"
#include "test/support/serial_run.h"
#include "trainer/run/metrics.h"

static char dir[256];

/* Model FLOPs per trained token of serial_run's tiny model (dim 16, 2 layers, 4 heads of 4, 2 kv
 * heads, hidden 48, vocab 32) at seq_len 8: N = 2 (2*16*16 + 2*16*8 + 3*16*48) + 32*16 = 6656,
 * 6 N + 12 * 2 * 16 * 8 = 43008. */
#define TINY_FLOPS_PER_TOKEN 43008.0

static data_t tiny_data(void) {
  data_t d;
  memset(&d, 0, sizeof d);
  d.n_train = 1000;
  d.n_val = 100;
  d.format = PLAN_DATA_SYNTHETIC;
  return d;
}

/* The metrics of a run with log.metrics_file file and log.peak_tflops peak. */
static void open_metrics(serial_run_t *r, metrics_t *mt, const char *file, const char *peak, int start_step,
                         char **plan_json) {
  char f[320];
  snprintf(f, sizeof f, "log.metrics_file=%s", file);
  const char *sets[] = {f, peak};
  serial_run_open(r, sets, 2);
  *plan_json = plan_to_json(&r->p);
  data_t d = tiny_data();
  char err[512];
  int rc = metrics_open(mt, &r->p, r->m, r->dp, NULL, &d, r->be, 0, 1, start_step, start_step > 0, *plan_json, err,
                        sizeof err);
  if (rc) printf("  metrics_open: %s\n", err);
  assert_int_equal(rc, 0);
}

/* The file's lines parsed, at most max; the count into *n. */
static void read_records(const char *path, cJSON **out, int max, int *n) {
  size_t len;
  char *text = (char *)testfile_read(path, &len);
  text[len] = 0;
  *n = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    assert_true(*n < max);
    out[*n] = cJSON_Parse(line);
    if (!out[*n]) printf("  not JSON: %s\n", line);
    assert_non_null(out[*n]);
    (*n)++;
  }
  free(text);
}

static double num(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!cJSON_IsNumber(v)) printf("  no number %s\n", key);
  assert_true(cJSON_IsNumber(v));
  return v->valuedouble;
}

static void near(const char *what, double got, double want, double rel) {
  const double d = fabs(got - want) / fabs(want);
  printf("  %s: %.9g, expected %.9g: relative difference %.2g (tolerance %g)\n", what, got, want, d, rel);
  assert_true(d <= rel);
}

static void test_records(void **state) {
  char path[320], *plan_json;
  snprintf(path, sizeof path, "%s/sub/metrics.jsonl", dir); /* its folder is made */
  serial_run_t r;
  metrics_t mt;
  open_metrics(&r, &mt, path, "log.peak_tflops=1e-6", 0, &plan_json);
  near("flops_per_token (6N + 12 L d T)", metrics_flops_per_token(&r.p), TINY_FLOPS_PER_TOKEN, 0);
  metrics_step(&mt, 1, 2.5, 1e-3, 0.75, 0.5, 0.1);
  metrics_eval(&mt, 1, 2.25);
  char err[512];
  assert_int_equal(metrics_close(&mt, NULL, err, sizeof err), 0);

  cJSON *rec[8];
  int n;
  read_records(path, rec, 8, &n);
  assert_int_equal(n, 3);
  const cJSON *h = rec[0];
  const size_t N = model_num_params(r.m);
  cJSON *plan = cJSON_Parse(plan_json);
  assert_true(cJSON_Compare(cJSON_GetObjectItemCaseSensitive(h, "plan"), plan, 1));
  cJSON_Delete(plan);
  assert_true(num(h, "num_params") == (double)N);
  assert_true(num(h, "world_size") == 1);
  assert_true(num(h, "tokens_per_step") == 2 * 8);
  assert_true(num(h, "data_tokens") == 1000 && num(h, "val_tokens") == 100);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(h, "strategy")->valuestring, "serial");
  const cJSON *mesh = cJSON_GetObjectItemCaseSensitive(h, "mesh");
  assert_int_equal(cJSON_GetArraySize(mesh), 3);
  for (int i = 0; i < 3; i++) assert_true(cJSON_GetArrayItem(mesh, i)->valuedouble == 1);
  assert_true(num(h, "param_bytes") == 4.0 * N && num(h, "param_bytes_max") == 4.0 * N);
  assert_true(num(h, "grad_bytes") == 4.0 * N && num(h, "optim_bytes") == 8.0 * N);
  assert_true(num(h, "work_bytes") == 0);
  assert_true(num(h, "act_bytes") > 0);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(h, "param_dtype")->valuestring, "fp32");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(h, "reduce_dtype")->valuestring, "fp32");
  assert_true(num(h, "start_step") == 0);

  const cJSON *s = rec[1];
  assert_true(num(s, "step") == 1);
  assert_true(num(s, "loss") == 2.5 && num(s, "lr") == 1e-3 && num(s, "grad_norm") == 0.75);
  const double tps = 16 / 0.5, flops = tps * TINY_FLOPS_PER_TOKEN;
  near("tokens_per_s (16 tokens in 0.5 s)", num(s, "tokens_per_s"), tps, 0);
  near("flops_per_s", num(s, "flops_per_s"), flops, 1e-5);
  near("mfu (over 1e-6 TFLOP/s)", num(s, "mfu"), flops / 1e6, 1e-5);
  near("step_ms", num(s, "step_ms"), 500, 1e-9);
  near("compute_ms", num(s, "compute_ms"), 400, 1e-9);
  near("comm_wait_ms", num(s, "comm_wait_ms"), 100, 1e-9);
  assert_true(num(s, "peak_mem_bytes") > 0);
  assert_null(cJSON_GetObjectItemCaseSensitive(s, "comm")); /* no mesh, no traffic */
  /* one process: the spread over ranks is this rank's own compute time */
  assert_true(num(s, "compute_ms_min") == num(s, "compute_ms") && num(s, "compute_ms_median") == num(s, "compute_ms"));
  assert_true(num(s, "compute_ms_max") == num(s, "compute_ms") && num(s, "slowest_rank") == 0);

  assert_true(num(rec[2], "step") == 1 && num(rec[2], "eval_loss") == 2.25);
  for (int i = 0; i < n; i++) cJSON_Delete(rec[i]);
  metrics_free(&mt);
  free(plan_json);
  serial_run_close(&r);
}

/* A run that logs steps start_step+1 .. last of dt seconds each into file and closes: metrics_close's
 * status, its message into err and the lack of space into *no_space. */
static int write_run(const char *file, const char *peak, int start_step, int last, double dt, int *no_space,
                     char *err, size_t errlen) {
  serial_run_t r;
  metrics_t mt;
  char *plan_json;
  open_metrics(&r, &mt, file, peak, start_step, &plan_json);
  for (int s = start_step + 1; s <= last; s++) metrics_step(&mt, s, 2.5, 1e-3, 0.75, dt, 0);
  int rc = metrics_close(&mt, no_space, err, errlen);
  free(plan_json);
  serial_run_close(&r);
  return rc;
}

static void test_no_peak_no_mfu(void **state) {
  char path[320], err[512];
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  assert_int_equal(write_run(path, "log.peak_tflops=0", 0, 1, 0.25, NULL, err, sizeof err), 0); /* cpu: no known peak */
  cJSON *rec[4];
  int n;
  read_records(path, rec, 4, &n);
  assert_int_equal(n, 2);
  assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(rec[1], "mfu")));
  for (int i = 0; i < n; i++) cJSON_Delete(rec[i]);
}

static void test_resumed_appends_after_torn_line(void **state) {
  char path[320];
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  const char before[] = "{\"step\":1,\"loss\":3}\n{\"step\":2,\"lo"; /* a killed writer's torn line */
  testfile_write(path, before, strlen(before));
  char err[512];
  assert_int_equal(write_run(path, "log.peak_tflops=0", 1, 2, 0.25, NULL, err, sizeof err), 0);
  size_t len;
  char *text = (char *)testfile_read(path, &len);
  text[len] = 0;
  printf("%s", text);
  assert_memory_equal(text, before, strlen(before));
  assert_true(text[strlen(before)] == '\n'); /* the header starts a line of its own */
  cJSON *h = cJSON_Parse(text + strlen(before) + 1); /* the header; cJSON stops at its end */
  free(text);
  assert_non_null(h);
  assert_true(num(h, "start_step") == 1);
  cJSON_Delete(h);
}

static void test_failed_write_is_one_warning(void **state) {
  char log[320], err[512] = "";
  snprintf(log, sizeof log, "%s/stderr", dir);
  int no_space = 0, saved = testfile_stderr_begin(log);
  int rc = write_run("/dev/full", "log.peak_tflops=0", 0, 3, 0.25, &no_space, err, sizeof err);
  char *text = testfile_stderr_end(saved, log);
  assert_int_equal(teststr_count(text, "log.metrics_file /dev/full"), 1);
  assert_int_equal(teststr_count(text, "the first record failed"), 1);
  printf("  %s\n", err);
  assert_int_equal(rc, -1);
  assert_int_equal(no_space, 1);
  assert_non_null(strstr(err, "log.metrics_file /dev/full: the first record failed"));
  free(text);
}

/* The spread of the ranks' compute time that metrics_step_values is given: its fields in the
 * record, and the slowest rank with its host on the console line only when it is over the
 * threshold. */
static void test_spread(void **state) {
  char path[320], log[320], err[512];
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  snprintf(log, sizeof log, "%s/stderr", dir);
  serial_run_t r;
  metrics_t mt;
  char *plan_json;
  open_metrics(&r, &mt, path, "log.peak_tflops=0", 0, &plan_json);
  const straggler_stat_t sp[2] = {
      {.min_ms = 10, .median_ms = 12, .max_ms = 30, .slowest = 3, .over = 1, .over_pct = 150, .host = "hostA"},
      {.min_ms = 10, .median_ms = 11, .max_ms = 12, .slowest = 2, .over = 0, .over_pct = 9.1, .host = "hostB"}};
  const double loss[2] = {2.5, 2.4}, gnorm[2] = {0.75, 0.7};
  int saved = testfile_stderr_begin(log);
  metrics_step_done(&mt, 1, 1e-3, 0.5, 0.1);
  metrics_step_done(&mt, 2, 1e-3, 0.5, 0.1);
  metrics_step_values(&mt, 2, loss, gnorm, NULL, sp);
  char *text = testfile_stderr_end(saved, log);
  printf("%s", text);
  assert_int_equal(teststr_count(text, " | straggler rank 3 (hostA) +150% over the median"), 1);
  assert_int_equal(teststr_count(text, "straggler"), 1); /* step 2's is under the threshold */
  free(text);
  assert_int_equal(metrics_close(&mt, NULL, err, sizeof err), 0);
  cJSON *rec[4];
  int n;
  read_records(path, rec, 4, &n);
  assert_int_equal(n, 3);
  for (int i = 0; i < 2; i++) {
    const cJSON *s = rec[1 + i];
    assert_true(num(s, "compute_ms_min") == sp[i].min_ms && num(s, "compute_ms_median") == sp[i].median_ms);
    assert_true(num(s, "compute_ms_max") == sp[i].max_ms && num(s, "slowest_rank") == sp[i].slowest);
    near("straggler_spread_pct", num(s, "straggler_spread_pct"), sp[i].over_pct, 1e-4);
  }
  for (int i = 0; i < n; i++) cJSON_Delete(rec[i]);
  metrics_free(&mt);
  free(plan_json);
  serial_run_close(&r);
}

static int setup(void **state) { return testdir_make(dir, sizeof dir, "meshrun-test-metrics"); }
static int teardown(void **state) { return testdir_remove(dir); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_records, setup, teardown),
      cmocka_unit_test_setup_teardown(test_no_peak_no_mfu, setup, teardown),
      cmocka_unit_test_setup_teardown(test_resumed_appends_after_torn_line, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_write_is_one_warning, setup, teardown),
      cmocka_unit_test_setup_teardown(test_spread, setup, teardown),
  };
  return cmocka_run_group_tests_name("metrics", tests, NULL, NULL);
}
