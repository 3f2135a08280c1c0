// deps: trainer/run/checkpoint.c trainer/run/hooks.c trainer/run/weights.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/serial_run.c test/support/files.c
/* test_checkpoint: the run's save and resume policy (trainer/run/checkpoint.c) over the
 * checkpoint format, in one process with the serial strategy and a tiny model.
 *
 * Resume: a run resumed from a step directory and trained to the end holds the uninterrupted
 * run's parameters and AdamW moments bit for bit (and its optimizer step count); "auto" takes
 * the newest, "none" nothing, an empty directory nothing; a missing step directory, another
 * global batch, a checkpoint beyond train.steps are usage errors (2) whose message says what to
 * set. checkpoint_peek: the global batch travels only into a plan that leaves it unset.
 * Failures (the save fault hook, MESHRUN_FAULT_SAVE): a failed save is one warning and the run
 * goes on; a failed save after the last step makes checkpoint_final_status fail; a lack of space
 * stops the run at once with no_restart set; the same, asynchronously, at the commit.
 * checkpoint_now saves a step that is not due and nothing when the step's save already ran.
 * Each test works in a fresh directory under /tmp. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "test/support/files.h"
#include "test/support/serial_run.h"
#include "trainer/run/checkpoint.h"

static char dir[256];

/* One process's run: the tiny model and the serial strategy, then checkpoint_open. */
typedef struct {
  serial_run_t r;
  hooks_t h;
  checkpoint_t c;
  char *plan_json;
  int start, resumed, rc;
  char err[2048];
} run_t;

/* Opens a run with checkpoint.dir ckdir ("" none), checkpoint.resume resume, and one more
 * override (NULL none); x->rc is checkpoint_open's status. */
static void run_open(run_t *x, const char *ckdir, const char *resume, const char *extra) {
  memset(x, 0, sizeof *x);
  char d[320], rs[320];
  snprintf(d, sizeof d, "checkpoint.dir=%s", ckdir);
  snprintf(rs, sizeof rs, "checkpoint.resume=%s", resume);
  const char *sets[] = {d, rs, "checkpoint.interval=2", extra};
  serial_run_open(&x->r, sets, extra ? 4 : 3);
  hooks_init(&x->h, 0);
  x->plan_json = plan_to_json(&x->r.p);
  x->rc = checkpoint_open(&x->c, &x->r.p, x->r.dp, NULL, &x->h, 0, 1, 0, 0, x->plan_json, 1000, &x->start,
                          &x->resumed, x->err, sizeof x->err);
  if (x->rc) printf("  checkpoint_open: %d: %s\n", x->rc, x->err);
}

/* checkpoint_open's outcome: its status, the first step and whether it resumed. */
static void expect_open(const run_t *x, int rc, int start, int resumed) {
  assert_int_equal(x->rc, rc);
  assert_int_equal(x->start, start);
  assert_int_equal(x->resumed, resumed);
}

static void run_close(run_t *x) {
  checkpoint_free(&x->c);
  hooks_close(&x->h);
  free(x->plan_json);
  serial_run_close(&x->r);
}

/* Steps from..to (1-based, inclusive), each followed by checkpoint_after_step, which must
 * succeed. */
static void run_steps(run_t *x, int from, int to) {
  for (int s = from; s <= to; s++) {
    double gnorm;
    serial_run_step(&x->r, s, &gnorm);
    int rc = checkpoint_after_step(&x->c, x->r.dp, s, x->err, sizeof x->err);
    if (rc) printf("  after step %d: %s\n", s, x->err);
    assert_int_equal(rc, 0);
  }
}

/* The strategy's whole state (parameters, then the AdamW moments), as a checkpoint saves it. */
static float *state_of(run_t *x, size_t *n) {
  ckpt_chunks_t cs = {0};
  float *host = NULL;
  char err[256];
  assert_int_equal(dp_ckpt_to_host(x->r.dp, &cs, &host, err, sizeof err), 0);
  *n = 0;
  for (int i = 0; i < cs.n; i++) *n += (size_t)(cs.v[i].b - cs.v[i].a);
  ckpt_chunks_free(&cs);
  return host;
}

static int exists(const char *name) {
  char path[512];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return stat(path, &st) == 0;
}

static void fault(const char *spec) {
  if (spec) setenv("MESHRUN_FAULT_SAVE", spec, 1);
  else unsetenv("MESHRUN_FAULT_SAVE");
}

/* --- resume */

static void test_resume_continues_bit_for_bit(void **state) {
  run_t a, b;
  run_open(&a, dir, "none", NULL);
  expect_open(&a, 0, 0, 0);
  run_steps(&a, 1, 4);
  assert_true(exists("step-2") && exists("step-4"));
  size_t na, nb;
  float *sa = state_of(&a, &na);

  char from[300], other[300];
  snprintf(from, sizeof from, "%s/step-2", dir);
  snprintf(other, sizeof other, "%s/resumed", dir);
  run_open(&b, other, from, NULL);
  expect_open(&b, 0, 2, 1);
  assert_int_equal(dp_optim_step(b.r.dp), 2);
  run_steps(&b, 3, 4);
  float *sb = state_of(&b, &nb);
  assert_int_equal(na, nb);
  assert_int_equal(na, 3 * model_num_params(a.r.m));
  size_t differ = 0;
  for (size_t i = 0; i < na; i++) differ += memcmp(&sa[i], &sb[i], sizeof(float)) != 0;
  printf("  resumed at step 2 and trained to 4: %zu of %zu values differ from the uninterrupted run "
         "(tolerance: none, the bits)\n", differ, na);
  assert_int_equal(differ, 0);
  assert_int_equal(dp_optim_step(b.r.dp), 4);
  free(sa);
  free(sb);
  run_close(&b);
  run_close(&a);

  run_open(&b, dir, "auto", NULL); /* the newest: step 4, the last one */
  expect_open(&b, 0, 4, 1);
  run_close(&b);
}

static void test_resume_none_and_nothing_there(void **state) {
  run_t a;
  run_open(&a, dir, "none", NULL);
  run_steps(&a, 1, 2);
  run_close(&a);
  run_open(&a, dir, "none", NULL); /* checkpoints there, but none asked for */
  expect_open(&a, 0, 0, 0);
  assert_int_equal(dp_optim_step(a.r.dp), 0);
  run_close(&a);
  char empty[300];
  snprintf(empty, sizeof empty, "%s/empty", dir);
  assert_int_equal(mkdir(empty, 0700), 0);
  run_open(&a, empty, "auto", NULL); /* auto over an empty directory: a fresh start */
  expect_open(&a, 0, 0, 0);
  run_close(&a);
}

static void test_resume_refusals(void **state) {
  run_t a;
  run_open(&a, dir, "none", NULL);
  run_steps(&a, 1, 4);
  run_close(&a);

  char missing[300];
  snprintf(missing, sizeof missing, "%s/step-3", dir);
  run_open(&a, dir, missing, NULL);
  assert_int_equal(a.rc, 2);
  run_close(&a);

  /* global batch 4 (two micro-batches of 2) where the checkpoint consumed 2 a step */
  run_open(&a, dir, "auto", "train.global_batch_size=4");
  assert_int_equal(a.rc, 2);
  assert_non_null(strstr(a.err, "set train.global_batch_size=2"));
  assert_int_equal(a.resumed, 0);
  run_close(&a);

  run_open(&a, dir, "auto", "train.steps=3"); /* step-4 is beyond the plan's end */
  assert_int_equal(a.rc, 2);
  assert_non_null(strstr(a.err, "beyond train.steps 3"));
  run_close(&a);
}

static void test_peek_carries_global_batch_only_when_unset(void **state) {
  run_t a;
  run_open(&a, dir, "none", NULL);
  run_steps(&a, 1, 2);
  plan_t p = a.r.p;
  run_close(&a);

  char from[512];
  int carried = -1;
  snprintf(p.checkpoint.resume, sizeof p.checkpoint.resume, "auto");
  p.train.global_batch_size = 0;
  assert_int_equal(checkpoint_peek(&p, from, sizeof from, &carried), 1);
  assert_int_equal(carried, 1);
  assert_int_equal(p.train.global_batch_size, 2);
  printf("  peek: %s\n", from);
  assert_non_null(strstr(from, "step-2"));

  p.train.global_batch_size = 6; /* the plan's own wins: the resume then refuses it, naming both */
  assert_int_equal(checkpoint_peek(&p, from, sizeof from, &carried), 1);
  assert_int_equal(carried, 0);
  assert_int_equal(p.train.global_batch_size, 6);

  p.train.global_batch_size = 0;
  snprintf(p.checkpoint.resume, sizeof p.checkpoint.resume, "none");
  assert_int_equal(checkpoint_peek(&p, from, sizeof from, &carried), 0);
  assert_int_equal(carried, 0);
  assert_int_equal(p.train.global_batch_size, 0);

  snprintf(p.checkpoint.resume, sizeof p.checkpoint.resume, "auto");
  snprintf(p.checkpoint.dir, sizeof p.checkpoint.dir, "%s/absent", dir);
  assert_int_equal(checkpoint_peek(&p, from, sizeof from, &carried), 0);
  assert_int_equal(carried, 0);
}

/* --- failed saves */

static void test_failed_save_is_one_warning(void **state) {
  run_t a;
  char log[300];
  snprintf(log, sizeof log, "%s/stderr", dir);
  fault("0:2"); /* EIO on the shard write of step 2 */
  run_open(&a, dir, "none", NULL);
  int saved = testfile_stderr_begin(log);
  for (int s = 1; s <= 4; s++) {
    double gnorm;
    serial_run_step(&a.r, s, &gnorm);
    a.rc = checkpoint_after_step(&a.c, a.r.dp, s, a.err, sizeof a.err);
    if (a.rc) break;
  }
  char *text = testfile_stderr_end(saved, log);
  fault(NULL);
  assert_int_equal(a.rc, 0);
  assert_int_equal(teststr_count(text, "the checkpoint of step 2 failed"), 1);
  assert_int_equal(teststr_count(text, "training goes on"), 1);
  assert_int_equal(teststr_count(text, "failed"), 1); /* and nothing else failed */
  assert_int_equal(a.c.no_restart, 0);
  assert_int_equal(a.c.final_failed, 0);
  assert_false(exists("step-2") || exists("step-2.tmp"));
  assert_true(exists("step-4"));
  assert_int_equal(checkpoint_final_status(&a.c, a.err, sizeof a.err), 0);
  free(text);
  run_close(&a);
}

static void test_failed_final_save_fails_the_run(void **state) {
  run_t a;
  fault("0:4");
  run_open(&a, dir, "none", NULL);
  run_steps(&a, 1, 4); /* every call returns 0: the final weights are still to be saved */
  fault(NULL);
  assert_int_equal(a.c.final_failed, 1);
  assert_int_equal(a.c.no_restart, 0);
  assert_true(exists("step-2"));
  assert_false(exists("step-4"));
  assert_int_equal(checkpoint_finish(&a.c, a.err, sizeof a.err), 0);
  a.err[0] = 0;
  assert_int_equal(checkpoint_final_status(&a.c, a.err, sizeof a.err), -1);
  printf("  %s\n", a.err);
  assert_non_null(strstr(a.err, "the checkpoint after the last step (4) was not saved"));
  assert_non_null(strstr(a.err, "step-4"));
  run_close(&a);
}

static void test_no_space_stops_at_once(void **state) {
  run_t a;
  fault("0:2:ENOSPC");
  run_open(&a, dir, "none", NULL);
  run_steps(&a, 1, 1);
  double gnorm;
  serial_run_step(&a.r, 2, &gnorm);
  int rc = checkpoint_after_step(&a.c, a.r.dp, 2, a.err, sizeof a.err);
  fault(NULL);
  printf("  %s\n", a.err);
  assert_int_equal(rc, -1);
  assert_int_equal(a.c.no_restart, 1);
  assert_non_null(strstr(a.err, "the checkpoint of step 2 failed, stopping"));
  assert_false(exists("step-2"));
  run_close(&a);
}

/* Asynchronous saves: the outcome comes with the commit (a later poll, or the wait before the
 * next save), and the policy is the same. */
static void test_async_failures_at_commit(void **state) {
  run_t a;
  fault("0:2");
  run_open(&a, dir, "none", "checkpoint.async=true");
  run_steps(&a, 1, 4);
  assert_int_equal(checkpoint_finish(&a.c, a.err, sizeof a.err), 0);
  fault(NULL);
  assert_int_equal(a.c.no_restart, 0);
  assert_int_equal(a.c.final_failed, 0);
  assert_int_equal(a.c.saved, 4);
  assert_false(exists("step-2"));
  assert_true(exists("step-4"));
  assert_int_equal(checkpoint_final_status(&a.c, a.err, sizeof a.err), 0);
  run_close(&a);

  char d2[300];
  snprintf(d2, sizeof d2, "%s/enospc", dir);
  fault("0:2:ENOSPC");
  run_open(&a, d2, "none", "checkpoint.async=true");
  int rc = 0, s;
  for (s = 1; s <= 4 && rc == 0; s++) {
    double gnorm;
    serial_run_step(&a.r, s, &gnorm);
    rc = checkpoint_after_step(&a.c, a.r.dp, s, a.err, sizeof a.err);
  }
  if (rc == 0) rc = checkpoint_finish(&a.c, a.err, sizeof a.err);
  fault(NULL);
  printf("  stopped after step %d: %s\n", s - 1, a.err);
  assert_int_equal(rc, -1);
  assert_true(s - 1 >= 3 && s - 1 <= 4); /* the commit settles at a poll or the wait before step 4's save */
  assert_int_equal(a.c.no_restart, 1);
  assert_non_null(strstr(a.err, "the checkpoint of step 2 failed, stopping"));
  run_close(&a);
}

static ino_t inode_of(const char *name) {
  char path[512];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s/metadata.json", dir, name);
  assert_int_equal(stat(path, &st), 0);
  return st.st_ino;
}

static void test_checkpoint_now(void **state) {
  run_t a;
  run_open(&a, dir, "none", NULL);
  run_steps(&a, 1, 3);
  assert_false(exists("step-3"));
  assert_int_equal(checkpoint_now(&a.c, a.r.dp, 3, a.err, sizeof a.err), 0); /* not due: saved now */
  assert_true(exists("step-3"));
  ino_t before = inode_of("step-3");
  assert_int_equal(checkpoint_now(&a.c, a.r.dp, 3, a.err, sizeof a.err), 0); /* already saved: nothing */
  assert_int_equal(inode_of("step-3"), before);
  run_close(&a);
}

static int setup(void **state) {
  unsetenv("MESHRUN_FAULT_SAVE");
  return testdir_make(dir, sizeof dir, "meshrun-test-checkpoint");
}
static int teardown(void **state) { return testdir_remove(dir); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_resume_continues_bit_for_bit, setup, teardown),
      cmocka_unit_test_setup_teardown(test_resume_none_and_nothing_there, setup, teardown),
      cmocka_unit_test_setup_teardown(test_resume_refusals, setup, teardown),
      cmocka_unit_test_setup_teardown(test_peek_carries_global_batch_only_when_unset, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_save_is_one_warning, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_final_save_fails_the_run, setup, teardown),
      cmocka_unit_test_setup_teardown(test_no_space_stops_at_once, setup, teardown),
      cmocka_unit_test_setup_teardown(test_async_failures_at_commit, setup, teardown),
      cmocka_unit_test_setup_teardown(test_checkpoint_now, setup, teardown),
  };
  return cmocka_run_group_tests_name("checkpoint", tests, NULL, NULL);
}
