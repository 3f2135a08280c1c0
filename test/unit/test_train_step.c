// deps: trainer/run/train.c trainer/run/hooks.c trainer/run/metrics.c trainer/run/tensorboard.c trainer/run/opprof.c trainer/run/weights.c trainer/formats/data.c trainer/formats/tokenizer.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/parallel/pipeline_run.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/step_run.c test/support/serial_run.c
/* test_train_step: trainer/run/train's step in one process (the serial strategy, the tiny model
 * of test/support/serial_run on synthetic data):
 * - the loss a step reports is the model's forward on the step's batch from the loader, bit for
 *   bit, and training lowers the eval loss (by at least 10% over 30 steps);
 * - grad_accum_steps = 2 micro-batches of 2 sequences give the step that one micro-batch of the
 *   same 4 sequences gives: the loss and every parameter after two steps within a stated
 *   tolerance (float sums in another order), the observed differences printed;
 * - a nan loss (the hooks' fault, as a diverging model gives) fails the step that reads it with
 *   diverged set and the message that says what to do, naming the step that diverged: at once
 *   when every step reads, and at the next read when the reads are spread (read_due), with the
 *   steps before it read and good. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/step_run.h"

static void open_run(step_run_t *r, const char *const *sets, int nsets) {
  char err[1024] = "";
  int rc = step_run_open(r, sets, nsets, 0, 1, NULL, err, sizeof err);
  if (rc) printf("  setup: %s\n", err);
  assert_int_equal(rc, 0);
}

static void step(step_run_t *r, int s, train_result_t *res) {
  char err[1024] = "";
  int rc = train_step(&r->t, s, res, err, sizeof err);
  if (rc) printf("  step %d: %s\n", s + 1, err);
  assert_int_equal(rc, 0);
}

static float *params_copy(step_run_t *r) {
  const size_t N = model_num_params(r->m);
  float *h = malloc(N * sizeof(float));
  assert_non_null(h);
  char err[512] = "";
  assert_int_equal(step_run_params(r, h, err, sizeof err), 0);
  return h;
}

static void test_loss_is_the_forward(void **state) {
  static const char *sets[] = {"train.steps=30", "train.lr=0.01", "eval.batches=4"};
  step_run_t r;
  open_run(&r, sets, 3);
  const int B = r.p.train.micro_batch_size, T = r.p.train.seq_len;
  int32_t tok[64], tgt[64];
  double before, after;
  char err[512] = "";
  assert_int_equal(train_eval(&r.t, &before, err, sizeof err), 0);
  for (int s = 0; s < r.p.train.steps; s++) {
    data_train_batch(&r.data, s, 0, 0, 1, B, tok, tgt);
    float direct = 0;
    assert_int_equal(model_forward(r.m, tok, tgt, B, T, &direct), 0);
    train_result_t res;
    step(&r, s, &res);
    if (s < 3 || s == r.p.train.steps - 1)
      printf("  step %d: train_step's loss %.9g, the forward's %.9g (tolerance: none, the bits)\n", s + 1, res.loss,
             direct);
    assert_true(res.loss == (double)direct);
    assert_true(isfinite(res.gnorm) && res.gnorm > 0);
    assert_true(res.lr > 0);
  }
  assert_int_equal(dp_optim_step(r.dp), r.p.train.steps);
  assert_int_equal(train_eval(&r.t, &after, err, sizeof err), 0);
  printf("  eval loss %.5f before, %.5f after %d steps (must fall by at least 10%%)\n", before, after,
         r.p.train.steps);
  assert_true(after < 0.9 * before);
  step_run_close(&r);
}

static void test_accumulation_is_the_combined_batch(void **state) {
  static const char *accum[] = {"train.micro_batch_size=2", "train.global_batch_size=4"};
  static const char *whole[] = {"train.micro_batch_size=4"};
  step_run_t a, w;
  open_run(&a, accum, 2);
  open_run(&w, whole, 1);
  assert_int_equal(a.p.train.grad_accum_steps, 2);
  assert_int_equal(w.p.train.grad_accum_steps, 1);
  const size_t N = model_num_params(a.m);
  assert_int_equal(N, model_num_params(w.m));
  /* tol_param: 1/30 of lr (3e-4), about the most an AdamW step moves a parameter: a gradient
   * element that flipped sign between the two ways would exceed it */
  const double tol_loss = 1e-6, tol_param = 1e-5;
  for (int s = 0; s < 2; s++) {
    train_result_t ra, rw;
    step(&a, s, &ra);
    step(&w, s, &rw);
    const double dl = fabs(ra.loss - rw.loss), dg = fabs(ra.gnorm - rw.gnorm) / rw.gnorm;
    printf("  step %d: loss %.9g (2 x 2) vs %.9g (1 x 4): difference %.3g (tolerance %.0e); gradient norm "
           "relative difference %.3g (tolerance 1e-5)\n", s + 1, ra.loss, rw.loss, dl, tol_loss, dg);
    assert_true(dl <= tol_loss);
    assert_true(dg <= 1e-5);
  }
  float *pa = params_copy(&a), *pw = params_copy(&w), *p0 = malloc(N * sizeof(float));
  assert_non_null(p0);
  double maxd = 0, moved = 0;
  size_t at = 0;
  for (size_t i = 0; i < N; i++) {
    const double d = fabs((double)pa[i] - pw[i]);
    if (d > maxd) maxd = d, at = i;
  }
  /* the comparison means something only when the steps moved the parameters by far more */
  step_run_t init;
  open_run(&init, whole, 1);
  char err[512] = "";
  assert_int_equal(step_run_params(&init, p0, err, sizeof err), 0);
  for (size_t i = 0; i < N; i++) moved = fmax(moved, fabs((double)pw[i] - p0[i]));
  printf("  after 2 steps: largest parameter difference %.3g (element %zu of %zu; tolerance %.0e); the steps moved "
         "parameters by up to %.3g\n", maxd, at, N, tol_param, moved);
  assert_true(maxd <= tol_param);
  assert_true(moved > 100 * tol_param);
  free(pa);
  free(pw);
  free(p0);
  step_run_close(&init);
  step_run_close(&a);
  step_run_close(&w);
}

/* Two micro-batches a step, and the hooks' nan loss on step 2. */
static void open_nan_run(step_run_t *r) {
  static const char *sets[] = {"train.micro_batch_size=2", "train.global_batch_size=4"};
  open_run(r, sets, 2);
  r->hooks.nan_rank = 0;
  r->hooks.nan_step = 2;
}

static void test_nan_loss_diverges(void **state) {
  step_run_t r;
  open_nan_run(&r);
  train_result_t res;
  step(&r, 0, &res);
  assert_int_equal(r.t.diverged, 0);
  char err[1024] = "";
  assert_int_equal(train_step(&r.t, 1, &res, err, sizeof err), -1);
  printf("  step 2 with a nan loss: diverged %d, \"%s\"\n", r.t.diverged, err);
  assert_int_equal(r.t.diverged, 1);
  assert_string_equal(err, "loss is nan at step 2 (micro-batch 1); the model diverged: lower train.lr, raise "
                           "train.warmup_steps, check model.init_std, or enable train.grad_clip");
  assert_int_equal(r.t.n_read, 0);
  step_run_close(&r);
}

static int read_at_4(void *arg, int step) { return step == 4; }

static void test_nan_loss_at_the_next_read(void **state) {
  step_run_t r;
  open_nan_run(&r);
  r.t.read_due = read_at_4;
  train_result_t res;
  for (int s = 0; s < 3; s++) {
    step(&r, s, &res);
    assert_int_equal(res.read, 0);
    assert_true(isnan(res.loss) && isnan(res.gnorm));
  }
  char err[1024] = "";
  assert_int_equal(train_step(&r.t, 3, &res, err, sizeof err), -1);
  printf("  steps 1-4, read at 4, a nan loss at 2: diverged %d, %d step(s) read, \"%s\"\n", r.t.diverged,
         r.t.n_read, err);
  assert_int_equal(r.t.diverged, 1);
  assert_string_equal(err, "loss is nan at step 2 (micro-batch 1); the model diverged: lower train.lr, raise "
                           "train.warmup_steps, check model.init_std, or enable train.grad_clip");
  assert_int_equal(r.t.n_read, 1); /* step 1, good */
  assert_int_equal(r.t.read_first, 0);
  assert_true(isfinite(r.t.read_loss[0]) && isfinite(r.t.read_gnorm[0]) && r.t.read_gnorm[0] > 0);
  step_run_close(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_loss_is_the_forward),
      cmocka_unit_test(test_accumulation_is_the_combined_batch),
      cmocka_unit_test(test_nan_loss_diverges),
      cmocka_unit_test(test_nan_loss_at_the_next_read),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
