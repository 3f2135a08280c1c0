/* train: one optimizer step, and evaluation (see train.h). */
#include "trainer/run/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "trainer/run/metrics.h"
#include "trainer/run/opprof.h"
#include "trainer/model/optim.h"
#include "trainer/model/ring_attention.h"
#include "trainer/comm/trace.h"

int train_init(train_t *t, char *err, size_t errlen) {
  const int T = t->p->train.seq_len;
  const int B = t->p->train.micro_batch_size * (t->pp ? t->p->train.grad_accum_steps : 1);
  t->tok = malloc((size_t)B * T * sizeof(int32_t));
  t->tgt = malloc((size_t)B * T * sizeof(int32_t));
  if (t->cp_size > 1) t->cp_scratch = malloc((size_t)B * T * sizeof(int32_t)); /* B: the step's under pp */
  if (!t->tok || !t->tgt || (t->cp_size > 1 && !t->cp_scratch)) {
    return err_set(err, errlen, -1, "out of memory for batches of %d x %d tokens", B, T);
  }
  if (t->pp) return 0;
  const size_t rows = (size_t)t->p->train.grad_accum_steps * B * T;
  t->loss_rows = t->be->alloc(t->be, rows * sizeof(float));
  t->loss_host = malloc(rows * sizeof(float));
  t->loss_valid = malloc((size_t)t->p->train.grad_accum_steps * sizeof(int));
  if (!t->loss_rows || !t->loss_host || !t->loss_valid) {
    return err_set(err, errlen, -1, "out of memory for the losses of %zu rows", rows);
  }
  return 0;
}

void train_free(train_t *t) {
  if (!t) return;
  free(t->tok);
  free(t->tgt);
  free(t->cp_scratch);
  t->cp_scratch = NULL;
  if (t->loss_rows) t->be->free(t->be, t->loss_rows);
  free(t->loss_host);
  free(t->loss_valid);
  t->tok = t->tgt = NULL;
  t->loss_rows = t->loss_host = NULL;
  t->loss_valid = NULL;
}

/* Context parallelism: this rank's rows of the n whole sequences in tok and tgt, in their place:
 * each group of b sequences (a model batch) chunk-major (ring_attention_take_rows), the groups
 * one after the other. */
static void cp_rows(train_t *t, int32_t *tok, int32_t *tgt, int n, int b) {
  const int T = t->p->train.seq_len, Tl = T / t->cp_size;
  if (t->cp_size <= 1) return;
  int32_t *ids[2] = {tok, tgt};
  for (int i = 0; i < 2; i++) {
    for (int g = 0; g < n / b; g++)
      ring_attention_take_rows(t->cp_scratch + (size_t)g * b * Tl, ids[i] + (size_t)g * b * T, b, T, t->cp_size,
                               t->cp_rank);
    memcpy(ids[i], t->cp_scratch, (size_t)n * Tl * sizeof(int32_t));
  }
}

/* The step's loss from the per-row losses of its micro-batches, read back in one copy: each
 * micro-batch's mean as model_forward computes it, summed in micro-batch order. The first whose
 * loss is nan/inf (1-based) goes to *bad_micro. */
static double micro_losses(train_t *t, int s, int accum, int n, int *bad_micro) {
  t->be->to_host(t->be, t->loss_host, t->loss_rows, (size_t)accum * n * sizeof(float));
  double loss = 0;
  for (int micro = 0; micro < accum; micro++) {
    float l = model_loss_of_rows(t->loss_host + (size_t)micro * n, n, t->loss_valid[micro]);
    /* A diverged loss is not acted on here but after the loss is averaged over dp, where every
     * rank sees it and stops at the same point: a rank leaving alone would strand its peers
     * in the gradient reduction (and in a pending checkpoint commit). */
    l = hooks_loss(t->hooks, s + 1, micro, l);
    if (!isfinite(l) && !*bad_micro) *bad_micro = micro + 1;
    loss += l;
  }
  return loss;
}

/* The message of a failed forward or backward: the strategy's when it failed (its hooks run
 * inside the model's passes), else the model's. */
static int pass_failed(train_t *t, const char *pass, int s, int micro, char *err, size_t errlen) {
  if (dp_status(t->dp))
    err_set(err, errlen, 0, "%s", dp_errmsg(t->dp));
  else
    err_set(err, errlen, 0, "step %d (micro-batch %d): the %s failed: %s", s + 1, micro + 1, pass, model_errmsg(t->m));
  return -1;
}

/* The pipeline's share of a step: the step's batches, the schedule over pp_microbatches
 * micro-batches of accum * B / m sequences, and the loss of the last stage (the mean over its
 * micro-batches) shared with every stage. *bad_micro: the first micro-batch whose loss was not
 * finite (1-based), 0 when none. */
static int pipeline_step(train_t *t, int s, double *loss, int *bad_micro, pp_step_stats_t *st, char *err,
                         size_t errlen) {
  const plan_t *p = t->p;
  const int T = p->train.seq_len, B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const int M = p->parallel.pp_microbatches, b = accum * B / M;
  const size_t bt = (size_t)B * T;
  for (int micro = 0; micro < accum; micro++) {
    data_train_batch(t->data, s, micro, t->dp_rank, t->dp_size, B, t->tok + micro * bt, t->tgt + micro * bt);
    if (hooks_batch(t->hooks, t->tok + micro * bt, t->tgt + micro * bt, bt, err, errlen)) return -1;
  }
  cp_rows(t, t->tok, t->tgt, accum * B, b); /* the pipeline's micro-batches are b sequences */
  if (pp_run_step(t->pp, t->tok, t->tgt, b, plan_local_seq_len(p), 1.0f / (float)M, st)) {
    return err_set(err, errlen, -1, "step %d: %s", s + 1, pp_run_errmsg(t->pp));
  }
  /* only the last stage has these: the sum over pp adds zeros to them */
  float v[2] = {(float)(st->loss_sum / M), st->bad_mb >= 0 ? (float)(st->bad_mb + 1) : 0.0f};
  if (comm_all_reduce(t->ppc, v, 2, DT_F32, COMM_SUM)) {
    return err_set(err, errlen, -1, "step %d: sharing the loss over pp: %s", s + 1, comm_errmsg(t->ppc));
  }
  *loss = v[0];
  *bad_micro = (int)v[1];
  return 0;
}

int train_step(train_t *t, int s, train_result_t *out, char *err, size_t errlen) {
  const plan_t *p = t->p;
  const int T = p->train.seq_len, B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const double t0 = metrics_now();
  const uint64_t wait0 = mesh_wait_ns(t->mesh);
  trace_step_begin(s + 1);
  opprof_step_begin(s + 1);
  const double lr = optim_lr(&p->train, s);
  double loss = 0;
  dp_zero_grad(t->dp);
  int bad_micro = 0; /* first micro-batch of this step whose loss was nan/inf (1-based) */
  memset(&out->pp, 0, sizeof out->pp);
  if (t->pp && pipeline_step(t, s, &loss, &bad_micro, &out->pp, err, errlen)) return -1;
  const int Tl = plan_local_seq_len(p), n = B * Tl; /* this rank's tokens: all of them, or its cp chunks */
  for (int micro = 0; !t->pp && micro < accum; micro++) {
    data_train_batch(t->data, s, micro, t->dp_rank, t->dp_size, B, t->tok, t->tgt);
    if (hooks_batch(t->hooks, t->tok, t->tgt, (size_t)B * T, err, errlen)) return -1;
    cp_rows(t, t->tok, t->tgt, B, B);
    const float scale = 1.0f / (float)accum; /* the loss is the micro-batches' mean */
    if (model_forward_rows(t->m, t->tok, t->tgt, B, Tl, t->loss_rows + (size_t)micro * n, &t->loss_valid[micro],
                           scale) ||
        dp_status(t->dp))
      return pass_failed(t, "forward pass", s, micro, err, errlen);
    dp_set_sync(t->dp, micro == accum - 1); /* gradients are synchronized once, on the last micro-step */
    if (model_backward(t->m, scale) || dp_status(t->dp))
      return pass_failed(t, "backward pass", s, micro, err, errlen);
  }
  if (!t->pp) loss = micro_losses(t, s, accum, n, &bad_micro) / accum;
  if (t->dpc && comm_size(t->dpc) > 1) { /* the logged loss is the global batch's: the mean over dp (and cp) */
    float lf = (float)loss;
    if (comm_all_reduce(t->dpc, &lf, 1, DT_F32, COMM_AVG)) {
      return err_set(err, errlen, -1, "%s", comm_errmsg(t->dpc));
    }
    loss = lf;
  }
  if (!isfinite(loss)) {
    t->diverged = 1;
    char where[64] = "on another data-parallel rank";
    if (bad_micro) snprintf(where, sizeof where, "micro-batch %d", bad_micro);
    err_set(err, errlen, 0,
            "loss is %s at step %d (%s); the model diverged: lower train.lr, raise train.warmup_steps, "
            "check model.init_std, or enable train.grad_clip",
            isnan(loss) ? "nan" : "inf", s + 1, where);
    return -1;
  }

  double gnorm = 0;
  if (dp_grad_norm(t->dp, &gnorm)) {
    return err_set(err, errlen, -1, "%s", dp_errmsg(t->dp));
  }
  if (!isfinite(gnorm)) {
    t->diverged = 1;
    return err_set(err, errlen, -1,
                   "gradient norm is %s at step %d (loss %.4f); lower train.lr or check model.init_std",
                   isnan(gnorm) ? "nan" : "inf", s + 1, loss);
  }
  if (dp_step(t->dp, lr, optim_clip_scale(gnorm, p->train.grad_clip))) {
    return err_set(err, errlen, -1, "%s", dp_errmsg(t->dp));
  }
  /* No wait for the optimizer's kernels: the next step's first read-back waits for them, and
   * anything that reads the parameters (eval, a checkpoint) copies them back, which waits too. */
  out->loss = loss;
  out->lr = lr;
  out->gnorm = gnorm;
  out->dt = metrics_now() - t0;
  out->comm_wait = (double)(mesh_wait_ns(t->mesh) - wait0) * 1e-9;
  opprof_step_end(s + 1, out->dt);
  trace_step_end();
  return 0;
}

int train_eval(train_t *t, double *out, char *err, size_t errlen) {
  const plan_t *p = t->p;
  const int batches = p->eval.batches, B = p->train.micro_batch_size, T = plan_local_seq_len(p);
  const int n = t->dp_size, r = t->dp_rank; /* the batches go round dp; the cp ranks of one share them */
  double sum = 0;
  for (int j = 0; j < (batches + n - 1) / n; j++) {
    const int k = j * n + r;
    data_eval_batch(t->data, k < batches ? k : k % batches, B, t->tok, t->tgt);
    cp_rows(t, t->tok, t->tgt, B, B);
    float l = 0;
    if (t->pp) { /* through the stages; the loss on the last one's rank, 0 on the others */
      if (pp_run_forward(t->pp, t->tok, t->tgt, B, T, &l)) {
        return err_set(err, errlen, -1, "eval: %s", pp_run_errmsg(t->pp));
      }
    } else if (model_forward(t->m, t->tok, t->tgt, B, T, &l) || dp_status(t->dp)) {
      return err_set(err, errlen, -1, "eval: %s", dp_status(t->dp) ? dp_errmsg(t->dp) : model_errmsg(t->m));
    }
    if (k < batches) sum += l;
  }
  if (t->pp) {
    float s = (float)sum;
    if (comm_all_reduce(t->ppc, &s, 1, DT_F32, COMM_SUM)) {
      return err_set(err, errlen, -1, "eval: %s", comm_errmsg(t->ppc));
    }
    sum = s;
  }
  if (t->dpc && comm_size(t->dpc) > 1) { /* each cp rank's loss is its chunks' mean: the sum counts cp times */
    float s = (float)sum;
    if (comm_all_reduce(t->dpc, &s, 1, DT_F32, COMM_SUM)) {
      return err_set(err, errlen, -1, "eval: %s", comm_errmsg(t->dpc));
    }
    sum = t->cp_size > 1 ? s / t->cp_size : s;
  }
  *out = sum / batches;
  return 0;
}
