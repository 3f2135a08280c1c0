// deps: trainer/run/train.c trainer/run/hooks.c trainer/run/metrics.c trainer/run/tensorboard.c trainer/run/opprof.c trainer/run/weights.c trainer/formats/data.c trainer/formats/tokenizer.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/parallel/pipeline_run.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/step_run.c test/support/serial_run.c
/* test_graphs: the recorded steps of train.c (train.cuda_graphs), their course on the cpu
 * backend with stand-in graph entries: the cpu backend records nothing, so the stand-ins count
 * what train.c asks (begin, end, launch, destroy) and hand out numbered recordings, and the test
 * follows which step ran its work, which recorded (then launched the recording) and which
 * replayed which recording. On the cpu the "recorded" work runs as it is called, so the losses
 * say nothing here: the replay's arithmetic is held to the unrecorded run's bits on a GPU
 * (scripts/test-gpu.sh), the sameness of every replayed call's arguments by test_opcount. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/step_run.h"
#include "trainer/run/opprof.h"

static struct {
  int begins, ends, launches, destroys;
  int fail_begin, fail_end_at; /* begin refuses; the end numbered fail_end_at (1-based) gives NULL */
  int launched[16];             /* the recordings launched, in order */
  int tamper_at;                /* > 0: before that step (0-based), parity 0's recorded counts change */
} F;

static int fake_begin(backend_t *be, char *err, size_t errlen) {
  F.begins++;
  if (F.fail_begin) return snprintf(err, errlen, "stand-in: begin refused"), -1;
  return 0;
}

static void *fake_end(backend_t *be, char *err, size_t errlen) {
  if (++F.ends == F.fail_end_at) {
    snprintf(err, errlen, "stand-in: a host wait inside");
    return NULL;
  }
  return (void *)(intptr_t)F.ends; /* recording n */
}

static int fake_launch(backend_t *be, void *g, char *err, size_t errlen) {
  if (F.launches < 16) F.launched[F.launches] = (int)(intptr_t)g;
  F.launches++;
  return 0;
}

static void fake_destroy(backend_t *be, void *g) { F.destroys += g != NULL; }

/* n steps of a 2-layer model with 2 micro-steps (graphs: the plan's value; stand-ins: whether
 * the backend gets them: 1 working, 2 begin refused, 3 the first end failing, 4 working with a
 * fault variable set), the profiled step prof (0: none); how each step went, in got (a letter
 * each: r run, R recorded, P replayed). Returns train_graphs_open's status. */
static int steps(const char *graphs, int stand_ins, int n, int prof, char *got, char *err, size_t errlen) {
  char g[48];
  snprintf(g, sizeof g, "train.cuda_graphs=%s", graphs);
  const char *sets[] = {"model.n_layers=2", "train.global_batch_size=4", "train.steps=10", "log.interval=100",
                        "eval.interval=0", g};
  step_run_t r;
  const int tamper_at = F.tamper_at;
  memset(&F, 0, sizeof F);
  F.tamper_at = tamper_at;
  int rc = step_run_open(&r, sets, 6, 0, 1, NULL, err, errlen);
  if (rc) printf("  setup: %s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(r.p.train.grad_accum_steps, 2);
  if (stand_ins) {
    r.be->graph_begin = fake_begin;
    r.be->graph_end = fake_end;
    r.be->graph_launch = fake_launch;
    r.be->graph_destroy = fake_destroy;
  }
  if (stand_ins == 4) r.hooks.nan_rank = 1, r.hooks.nan_step = 1000; /* set, for a rank not here */
  F.fail_begin = stand_ins == 2;
  F.fail_end_at = stand_ins == 3 ? 1 : 0;
  FILE *table = prof ? fopen("/dev/null", "w") : NULL; /* the profile's table is not looked at */
  if (prof) assert_int_equal(opprof_install(r.be, prof, table), 0);
  rc = train_graphs_open(&r.t, NULL, err, errlen);
  for (int s = 0; !rc && s < n; s++) {
    train_result_t res;
    char e[1024] = "";
    if (F.tamper_at && s == F.tamper_at) r.t.graph_valid[0][0]++; /* as if its batches had other targets */
    assert_int_equal(train_step(&r.t, s, &res, e, sizeof e), 0);
    got[s] = "rRP"[res.graph];
    got[s + 1] = '\0';
  }
  if (prof) opprof_uninstall(r.be);
  if (table) fclose(table);
  step_run_close(&r);
  return rc;
}

/* 2 warm-up steps run, the next two record one parity each (recordings 1 and 2, each launched
 * at once), the later ones replay the recording of their parity; closing destroys both. */
static void test_record_then_replay(void **state) {
  char got[16] = "", err[512] = "";
  assert_int_equal(steps("auto", 1, 8, 0, got, err, sizeof err), 0);
  printf("  8 steps: %s (r run, R recorded, P replayed); begins %d, ends %d, launches %d of recordings", got,
         F.begins, F.ends, F.launches);
  for (int i = 0; i < F.launches && i < 16; i++) printf(" %d", F.launched[i]);
  printf(", destroyed %d\n", F.destroys);
  assert_string_equal(got, "rrRRPPPP");
  assert_int_equal(F.begins, 2);
  assert_int_equal(F.ends, 2);
  assert_int_equal(F.launches, 6);
  const int want[] = {1, 2, 1, 2, 1, 2};
  for (int i = 0; i < 6; i++) assert_int_equal(F.launched[i], want[i]);
  assert_int_equal(F.destroys, 2);
}

/* A step that cannot be recorded (begin refused, or an end that gives nothing) runs its work, and
 * every later step runs unrecorded: nothing is launched. */
static void test_failed_recording_runs_unrecorded(void **state) {
  for (int how = 2; how <= 3; how++) {
    char got[16] = "", err[512] = "";
    assert_int_equal(steps("auto", how, 6, 0, got, err, sizeof err), 0);
    printf("  %s: %s; begins %d, ends %d, launches %d\n", how == 2 ? "begin refused" : "end failed", got, F.begins,
           F.ends, F.launches);
    assert_string_equal(got, "rrrrrr");
    assert_int_equal(F.begins, 1);
    assert_int_equal(F.ends, how == 3 ? 1 : 0);
    assert_int_equal(F.launches, 0);
  }
}

/* The profiled step (MESHRUN_OP_PROFILE) waits for the device around each call: it runs
 * unrecorded and does not count as warm-up; the next step of parity 0 replays step 3's. */
static void test_profiled_step_unrecorded(void **state) {
  char got[16] = "", err[512] = "";
  assert_int_equal(steps("auto", 1, 8, 4, got, err, sizeof err), 0);
  printf("  8 steps, step 4 profiled: %s; launches", got);
  for (int i = 0; i < F.launches && i < 16; i++) printf(" %d", F.launched[i]);
  printf("\n");
  assert_string_equal(got, "rrRrPRPP");
  const int want[] = {1, 1, 2, 1, 2};
  assert_int_equal(F.launches, 5);
  for (int i = 0; i < 5; i++) assert_int_equal(F.launched[i], want[i]);
}

/* A step whose micro-batches count other targets than its parity's recording (their gradient
 * scale is a launch argument) runs its work, one warning; the other parity still replays. */
static void test_other_targets_run_unrecorded(void **state) {
  char got[16] = "", err[512] = "";
  F.tamper_at = 4;
  assert_int_equal(steps("auto", 1, 8, 0, got, err, sizeof err), 0);
  F.tamper_at = 0;
  printf("  8 steps, parity 0's counts changed before step 5: %s; launches", got);
  for (int i = 0; i < F.launches && i < 16; i++) printf(" %d", F.launched[i]);
  printf("\n");
  assert_string_equal(got, "rrRRrPrP");
  const int want[] = {1, 2, 2, 2};
  assert_int_equal(F.launches, 4);
  for (int i = 0; i < 4; i++) assert_int_equal(F.launched[i], want[i]);
}

/* off records nothing; on where the backend records nothing is the plan's error (2, one line);
 * auto there is silent and runs every step. */
static void test_plan_values(void **state) {
  char got[16] = "", err[512] = "";
  assert_int_equal(steps("off", 1, 5, 0, got, err, sizeof err), 0);
  printf("  off: %s, begins %d\n", got, F.begins);
  assert_string_equal(got, "rrrrr");
  assert_int_equal(F.begins, 0);
  assert_int_equal(steps("on", 0, 3, 0, got, err, sizeof err), 2);
  printf("  on, cpu: %s\n", err);
  assert_non_null(strstr(err, "plan error: train.cuda_graphs: on, but the cpu backend runs each call as it comes"));
  got[0] = '\0';
  assert_int_equal(steps("auto", 0, 5, 0, got, err, sizeof err), 0);
  printf("  auto, cpu: %s\n", got);
  assert_string_equal(got, "rrrrr");
  /* a fault variable that changes single steps: a line, the steps unrecorded, under on too */
  for (int on = 0; on < 2; on++) {
    assert_int_equal(steps(on ? "on" : "auto", 4, 5, 0, got, err, sizeof err), 0);
    printf("  %s, MESHRUN_FAULT_NAN set: %s, begins %d\n", on ? "on" : "auto", got, F.begins);
    assert_string_equal(got, "rrrrr");
    assert_int_equal(F.begins, 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_record_then_replay),
      cmocka_unit_test(test_failed_recording_runs_unrecorded),
      cmocka_unit_test(test_profiled_step_unrecorded),
      cmocka_unit_test(test_other_targets_run_unrecorded),
      cmocka_unit_test(test_plan_values),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
