/* serial_run: a one-process training setup for tests (see serial_run.h). */
#include "test/support/serial_run.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "common/err.h"
#include "trainer/model/optim.h"

static const char *const TINY[] = {
    "model.dim=16",          "model.n_layers=2",          "model.n_heads=4",       "model.n_kv_heads=2",
    "model.vocab_size=32",   "model.hidden_dim=48",       "model.max_seq_len=16",  "model.init_std=0.1",
    "train.seq_len=8",       "train.micro_batch_size=2",  "train.steps=4",         "train.warmup_steps=1",
    "data.format=synthetic", "data.train=",               "log.interval=1",        "eval.interval=0",
    "mesh.dp_shard=1",       "sample.tokens=0",           "device=cpu",
    "parallel.mixed_precision.param_dtype=fp32",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], NSETS_MAX = 64 };

int serial_run_plan(plan_t *p, const char *const *sets, int nsets, int world, char *err, size_t errlen) {
  const char *all[NSETS_MAX];
  if (NTINY + nsets > NSETS_MAX) return err_set(err, errlen, -1, "serial_run: %d sets, at most %d", nsets, NSETS_MAX - NTINY);
  memcpy(all, TINY, sizeof TINY);
  for (int i = 0; i < nsets; i++) all[NTINY + i] = sets[i];
  int rc = plan_load(p, NULL, all, NTINY + nsets, err, errlen);
  if (rc == 0) rc = plan_resolve(p, world, err, errlen);
  return rc;
}

void serial_run_open(serial_run_t *r, const char *const *sets, int nsets) {
  memset(r, 0, sizeof *r);
  char err[1024] = "";
  int rc = serial_run_plan(&r->p, sets, nsets, 1, err, sizeof err);
  if (rc) printf("  plan: %s\n", err);
  assert_int_equal(rc, 0);
  r->be = backend_create("cpu", 1, err, sizeof err);
  if (!r->be) printf("  backend: %s\n", err);
  assert_non_null(r->be);
  const plan_t *p = &r->p;
  model_opts_t opts = {.max_b = p->train.micro_batch_size, .max_t = p->train.seq_len,
                       .param_dtype = p->parallel.param_dtype, .decay_norms = p->train.decay_norms, .decay_embeddings = p->train.decay_embeddings};
  rc = model_create_opts(&r->m, &p->model, r->be, &opts, err, sizeof err);
  if (rc) printf("  model: %s\n", err);
  assert_int_equal(rc, 0);
  rc = dp_create(&r->dp, r->m, r->be, NULL, p, err, sizeof err);
  if (rc) printf("  dp: %s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(dp_init_params(r->dp, p->seed, p->model.init_std), 0);
}

void serial_run_batch(const serial_run_t *r, int step, int32_t *tok, int32_t *tgt) {
  const int n = r->p.train.micro_batch_size * r->p.train.seq_len, V = r->p.model.vocab_size;
  for (int i = 0; i < n; i++) {
    tok[i] = (i * 7 + 3 * step + 1) % V;
    tgt[i] = (i * 5 + step + 2) % V;
  }
}

float serial_run_step(serial_run_t *r, int step, double *gnorm) {
  const plan_t *p = &r->p;
  const int B = p->train.micro_batch_size, T = p->train.seq_len;
  int32_t tok[64], tgt[64];
  assert_true(B * T <= 64);
  serial_run_batch(r, step, tok, tgt);
  dp_zero_grad(r->dp);
  float loss = 0;
  int rc = model_forward(r->m, tok, tgt, B, T, &loss);
  if (rc == 0) rc = model_backward(r->m, 1.0f);
  if (rc) printf("  step %d: %s\n", step, model_errmsg(r->m));
  assert_int_equal(rc, 0);
  assert_int_equal(dp_grad_norm(r->dp, gnorm), 0);
  const double lr = optim_lr(&p->train, dp_optim_step(r->dp));
  assert_int_equal(dp_step(r->dp, lr, optim_clip_scale(*gnorm, p->train.grad_clip)), 0);
  return loss;
}

void serial_run_close(serial_run_t *r) {
  if (!r) return;
  dp_destroy(r->dp);
  model_destroy(r->m);
  backend_destroy(r->be);
  memset(r, 0, sizeof *r);
}
