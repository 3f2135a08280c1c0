/* train: one optimizer step, and evaluation (see train.h). */
#include "trainer/run/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "trainer/run/metrics.h"
#include "trainer/run/opprof.h"
#include "trainer/model/optim.h"
#include "trainer/model/ring_attention.h"
#include "trainer/comm/trace.h"

/* One step's values on the device (train.h). The backend writes stat (step_loss: the sum of the
 * micro-batches' losses over accum, and the first that was not finite, 1-based) and loss_dp (the
 * same rounded to fp32, then averaged over dp in place); dp_clip_dev writes gnorm; step_skip
 * writes skip (train.skip_*; zero otherwise). */
typedef struct {
  double stat[2];
  double gnorm;
  float loss_dp;
  float pad;
  skip_verdict_t skip;
} step_rec_t;

int train_init(train_t *t, char *err, size_t errlen) {
  const int T = t->p->train.seq_len, accum = t->p->train.grad_accum_steps;
  const int B = t->p->train.micro_batch_size * accum; /* the step's sequences */
  t->tok = malloc((size_t)B * T * sizeof(int32_t));
  t->tgt = malloc((size_t)B * T * sizeof(int32_t));
  t->read_loss = malloc(TRAIN_PENDING_MAX * sizeof *t->read_loss);
  t->read_gnorm = malloc(TRAIN_PENDING_MAX * sizeof *t->read_gnorm);
  t->valid = calloc(3 * (size_t)accum, sizeof *t->valid);
  t->graph_valid[0] = t->valid + accum;
  t->graph_valid[1] = t->valid + 2 * accum;
  if (t->cp_size > 1) t->cp_scratch = malloc((size_t)B * T * sizeof(int32_t));
  if (!t->tok || !t->tgt || !t->read_loss || !t->read_gnorm || !t->valid || (t->cp_size > 1 && !t->cp_scratch)) {
    return err_set(err, errlen, -1, "out of memory for batches of %d x %d tokens", B, T);
  }
  t->pending = t->n_read = 0;
  if (t->pp) return 0;
  const size_t rows = (size_t)B * T;
  t->dpc_dev = t->mesh ? mesh_comm(t->mesh, "dp_cp") : NULL; /* the loss averages over dp and cp */
  t->loss_rows = t->be->alloc(t->be, rows * sizeof(float));
  t->scale = t->be->alloc(t->be, sizeof(float));
  t->recs = t->be->alloc(t->be, TRAIN_PENDING_MAX * sizeof(step_rec_t));
  t->recs_host = malloc(TRAIN_PENDING_MAX * sizeof(step_rec_t));
  t->rec = t->be->alloc(t->be, sizeof(step_rec_t));
  t->step_dev = t->be->alloc(t->be, sizeof(adamw_step_t));
  t->step_host = t->be->host_alloc_pinned(t->be, TRAIN_PENDING_MAX * sizeof(adamw_step_t));
  if (!t->loss_rows || !t->scale || !t->recs || !t->recs_host || !t->rec || !t->step_dev || !t->step_host) {
    return err_set(err, errlen, -1, "out of memory for the losses of %zu rows and %d steps' records", rows,
                   TRAIN_PENDING_MAX);
  }
  if (model_stage_reserve(t->m, accum, t->p->train.micro_batch_size, plan_local_seq_len(t->p)))
    return err_set(err, errlen, -1, "%s", model_errmsg(t->m));
  if (plan_skips(t->p) && (!(t->skip_win = t->be->alloc(t->be, sizeof *t->skip_win)) ||
                           !(t->read_skip = malloc(TRAIN_PENDING_MAX * sizeof *t->read_skip))))
    return err_set(err, errlen, -1, "out of memory for the window of train.skip_*");
  return 0;
}

void train_free(train_t *t) {
  if (!t) return;
  for (int j = 0; j < 2; j++) {
    if (t->be && t->graph[j]) t->be->graph_destroy(t->be, t->graph[j]);
    t->graph[j] = NULL;
  }
  free(t->valid);
  t->valid = NULL;
  free(t->tok);
  free(t->tgt);
  free(t->read_loss);
  free(t->read_gnorm);
  free(t->recs_host);
  free(t->cp_scratch);
  free(t->read_skip);
  t->cp_scratch = NULL;
  t->read_skip = NULL;
  if (t->be) {
    t->be->free(t->be, t->skip_win);
    t->be->free(t->be, t->loss_rows);
    t->be->free(t->be, t->scale);
    t->be->free(t->be, t->recs);
    t->be->free(t->be, t->rec);
    t->be->free(t->be, t->step_dev);
    t->be->host_free_pinned(t->be, t->step_host);
  }
  t->tok = t->tgt = NULL;
  t->read_loss = t->read_gnorm = NULL;
  t->loss_rows = t->scale = NULL;
  t->recs = t->recs_host = t->rec = NULL;
  t->step_dev = t->step_host = NULL;
  t->skip_win = NULL;
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

/* Step s's batches on the host: every micro-batch of this data-parallel rank from the loader
 * (through the test hooks) into tok and tgt, one after the other, then under cp this rank's rows
 * of each group of b sequences (a model batch). 0 or -1 with the message in err. */
static int step_batches(train_t *t, int s, int b, char *err, size_t errlen) {
  const plan_t *p = t->p;
  const int T = p->train.seq_len, B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const size_t bt = (size_t)B * T;
  for (int micro = 0; micro < accum; micro++) {
    data_train_batch(t->data, s, micro, t->dp_rank, t->dp_size, B, t->tok + micro * bt, t->tgt + micro * bt);
    if (hooks_batch(t->hooks, t->tok + micro * bt, t->tgt + micro * bt, bt, err, errlen)) return -1;
  }
  cp_rows(t, t->tok, t->tgt, accum * B, b);
  return 0;
}

/* More than one rank shares the step's loss (dp, or cp: its ranks hold parts of each sequence). */
static int loss_shared(const train_t *t) { return t->dpc && comm_size(t->dpc) > 1; }

/* The message of a failed forward or backward: the strategy's when it failed (its hooks run
 * inside the model's passes), else the model's. */
static int pass_failed(train_t *t, const char *pass, int s, int micro, char *err, size_t errlen) {
  if (dp_status(t->dp))
    err_set(err, errlen, 0, "%s", dp_errmsg(t->dp));
  else
    err_set(err, errlen, 0, "step %d (micro-batch %d): the %s failed: %s", s + 1, micro + 1, pass, model_errmsg(t->m));
  return -1;
}

/* The divergence checks of step s (0-based) on its values, in the order the step computes them.
 * bad_micro: the first micro-batch of this rank whose loss was nan/inf (1-based), 0 when none.
 * A diverged loss is acted on after it is averaged over dp, where every rank sees it and stops at
 * the same point: a rank leaving alone would strand its peers in a collective. */
static int check_step(train_t *t, int s, double loss, int bad_micro, double gnorm, char *err, size_t errlen) {
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
  if (!isfinite(gnorm)) {
    t->diverged = 1;
    return err_set(err, errlen, -1,
                   "gradient norm is %s at step %d (loss %.4f); lower train.lr or check model.init_std",
                   isnan(gnorm) ? "nan" : "inf", s + 1, loss);
  }
  return 0;
}

/* Where step s (0-based) diverged, for origin_name: the loss (what 1) or the gradient norm (2),
 * and this rank's own first micro-batch whose loss was not finite (1-based, 0 none). Returns -1. */
static int diverged_at(train_t *t, int s, int what, int own_micro) {
  t->diverged_what = what;
  t->diverged_micro = own_micro;
  t->diverged_step = s;
  return -1;
}

int train_read(train_t *t, char *err, size_t errlen) {
  const int n = t->pending;
  t->n_read = 0;
  t->read_first = t->pending_first;
  if (n == 0) return 0;
  t->pending = 0;
  step_rec_t *r = t->recs_host;
  t->be->to_host(t->be, r, t->recs, (size_t)n * sizeof *r); /* the one wait */
  for (int j = 0; j < n; j++) {
    /* the logged loss is the global batch's: the mean over dp (fp32, as it travelled) */
    const double loss = t->dpc_dev && loss_shared(t) ? (double)r[j].loss_dp : r[j].stat[0];
    if (!r[j].skip.why && check_step(t, t->read_first + j, loss, (int)r[j].stat[1], r[j].gnorm, err, errlen))
      return diverged_at(t, t->read_first + j, isfinite(loss) ? 2 : 1, (int)r[j].stat[1]);
    t->read_loss[j] = loss;
    t->read_gnorm[j] = r[j].gnorm;
    if (t->read_skip) t->read_skip[j] = r[j].skip;
    t->n_read = j + 1;
  }
  return 0;
}

/* The pipeline's share of a step: the step's batches, the schedule over pp_microbatches
 * micro-batches of accum * B / m sequences, and the loss of the last stage (the mean over its
 * micro-batches) shared with every stage. *bad_micro: the first micro-batch whose loss was not
 * finite (1-based), 0 when none. */
static int pipeline_step(train_t *t, int s, double *loss, int *bad_micro, pp_step_stats_t *st, char *err,
                         size_t errlen) {
  const plan_t *p = t->p;
  const int B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const int M = p->parallel.pp_microbatches, b = accum * B / M;
  if (step_batches(t, s, b, err, errlen)) return -1; /* the pipeline's micro-batches are b sequences */
  hooks_nan_grad(t->hooks, t->m, t->be, t->dp, s + 1);
  if (pp_run_step(t->pp, t->tok, t->tgt, b, plan_local_seq_len(p), 1.0f / (float)M, st)) {
    return err_set(err, errlen, -1, "step %d: %s", s + 1, pp_run_errmsg(t->pp));
  }
  if (hooks_nan_loss_pp(t->hooks, s + 1, t->pp->cfg.rank == t->pp->cfg.p - 1)) { /* stage S - 1 is rank p - 1's */
    st->loss_sum = NAN;
    st->bad_mb = 0;
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

/* The pipeline's step, on the host: the loss (the mean over dp through the host comm), its
 * check, the norm and its check, the update; this step's values are read at once. */
static int pipeline_train(train_t *t, int s, double lr, train_result_t *out, char *err, size_t errlen) {
  double loss = 0, gnorm = 0;
  int bad_micro = 0;
  if (pipeline_step(t, s, &loss, &bad_micro, &out->pp, err, errlen)) return -1;
  if (loss_shared(t)) {
    float lf = (float)loss;
    if (comm_all_reduce(t->dpc, &lf, 1, DT_F32, COMM_AVG)) {
      return err_set(err, errlen, -1, "%s", comm_errmsg(t->dpc));
    }
    loss = lf;
  }
  /* this rank's own loss: the last stage's, before the sums over pp and dp */
  if (check_step(t, s, loss, bad_micro, 0.0, err, errlen)) return diverged_at(t, s, 1, out->pp.bad_mb + 1);
  if (dp_grad_norm(t->dp, &gnorm)) {
    return err_set(err, errlen, -1, "%s", dp_errmsg(t->dp));
  }
  if (check_step(t, s, loss, bad_micro, gnorm, err, errlen)) return diverged_at(t, s, 2, 0);
  if (dp_step(t->dp, lr, optim_clip_scale(gnorm, t->p->train.grad_clip))) {
    return err_set(err, errlen, -1, "%s", dp_errmsg(t->dp));
  }
  t->read_first = s;
  t->read_loss[0] = loss;
  t->read_gnorm[0] = gnorm;
  t->n_read = 1;
  return 0;
}

/* train.skip_*: whether the step updates, decided on the device between the norm and AdamW
 * (backend step_skip; its arguments the same at every step). */
static void skip_decide(train_t *t, step_rec_t *rec) {
  const plan_train_t *tr = &t->p->train;
  if (t->skip_win)
    t->be->step_skip(t->be, &rec->loss_dp, &rec->gnorm, tr->skip_nonfinite, tr->skip_loss_z, tr->skip_grad_z,
                     t->skip_win, &rec->skip, t->step_dev);
}

/* The step's batches on the host (the loader's, this rank's rows of them under cp), staged on the
 * device in one upload (model_stage) with the count of targets of each micro-batch in t->valid.
 * Returns the staged parity, or -1. */
static int stage_step(train_t *t, int s, char *err, size_t errlen) {
  const plan_t *p = t->p;
  const int B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  if (step_batches(t, s, B, err, errlen)) return -1;
  const int par = model_stage(t->m, t->tok, t->tgt, accum, B, plan_local_seq_len(p), t->valid);
  if (par < 0) return err_set(err, errlen, -1, "step %d: the batches: %s", s + 1, model_errmsg(t->m));
  return par;
}

/* The step's work on the device between its uploads and its record's copy: per micro-batch the
 * forward of its staged ids (the per-row losses into loss_rows, turned into the step's loss by
 * step_loss right after), the backward; then the loss's mean over dp on the device comm (started
 * and waited: with a device compute stream the wait is the stream's, not the host's), the norm
 * and clip scale, the skip verdict (train.skip_*), the update; the values land in rec. Every call
 * has the same arguments at every step of a parity (what a recorded step needs,
 * opprof_replay_diff). */
static int step_work(train_t *t, int s, char *err, size_t errlen) {
  const plan_t *p = t->p;
  const int B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const int Tl = plan_local_seq_len(p), n = B * Tl; /* this rank's tokens: all of them, or its cp chunks */
  step_rec_t *rec = t->rec;
  for (int micro = 0; micro < accum; micro++) {
    const float scale = 1.0f / (float)accum; /* the loss is the micro-batches' mean */
    int valid = 0;
    if (model_forward_staged(t->m, micro, B, Tl, t->loss_rows, &valid, scale) || dp_status(t->dp))
      return pass_failed(t, "forward pass", s, micro, err, errlen);
    t->be->step_loss(t->be, t->loss_rows, n, valid, micro, accum, hooks_nan_loss(t->hooks, s + 1, micro),
                     rec->stat, &rec->loss_dp);
    dp_set_sync(t->dp, micro == accum - 1); /* gradients are synchronized once, on the last micro-step */
    if (micro == accum - 1) hooks_nan_grad(t->hooks, t->m, t->be, t->dp, s + 1);
    if (model_backward(t->m, scale) || dp_status(t->dp))
      return pass_failed(t, "backward pass", s, micro, err, errlen);
  }
  if (t->dpc_dev && loss_shared(t)) {
    comm_req_t *req = NULL;
    if (comm_start_all_reduce(t->dpc_dev, &rec->loss_dp, 1, DT_F32, COMM_AVG, &req) || comm_wait(req, NULL)) {
      return err_set(err, errlen, -1, "%s", comm_errmsg(t->dpc_dev));
    }
  }
  if (dp_clip_dev(t->dp, p->train.grad_clip, &rec->gnorm, t->scale))
    return err_set(err, errlen, -1, "%s", dp_errmsg(t->dp));
  skip_decide(t, rec);
  if (dp_step_dev(t->dp, t->step_dev, t->scale)) return err_set(err, errlen, -1, "%s", dp_errmsg(t->dp));
  return 0;
}

int train_graphs_open(train_t *t, const char *comm_backend, char *err, size_t errlen) {
  const int mode = t->p->train.graphs;
  const comm_entry_t *c = comm_backend ? comm_find(comm_backend) : NULL;
  char why[160] = "";
  const char *fault = hooks_step_fault(t->hooks);
  t->graphs = 0;
  if (mode == PLAN_GRAPHS_OFF) return 0;
  if (!t->be->graph_begin)
    snprintf(why, sizeof why, "the %s backend runs each call as it comes and records nothing", t->be->name);
  else if (t->pp)
    snprintf(why, sizeof why, "the pipeline's schedule runs from the host (mesh.pp %d)", t->mesh->dims[MESH_PP]);
  else if (c && !c->capturable)
    snprintf(why, sizeof why, "the %s comm's collectives wait on the host", c->name);
  else if (fault)
    snprintf(why, sizeof why, "%s changes single steps", fault);
  if (!why[0]) {
    t->graphs = 1;
    return 0;
  }
  if (mode == PLAN_GRAPHS_ON && !fault)
    return err_set(err, errlen, 2, "plan error: train.cuda_graphs: on, but %s; use auto or off", why);
  if (t->be->graph_begin) log_rank0("train.cuda_graphs %s: steps run unrecorded: %s", mode == PLAN_GRAPHS_ON ? "on"
                                    : "auto", why);
  return 0;
}

/* Recorded steps give up (the backend keeps nothing of a failed recording): one line, and every
 * later step runs unrecorded. */
static void graphs_off(train_t *t, int s, const char *why) {
  log_warn("train.cuda_graphs: step %d could not be recorded (%s); steps run unrecorded from here", s + 1, why);
  t->graphs = 0;
}

/* The step's work (step_work) run, recorded, or replayed: recorded once per staged parity after
 * the warm-up (the recording then launched: recording runs nothing), replayed after that when the
 * micro-batches count the targets the recording counted (their gradient scale is a launch
 * argument), else run unrecorded with one line the first time. */
static int graph_step(train_t *t, int s, int par, char *err, size_t errlen) {
  backend_t *be = t->be;
  const int accum = t->p->train.grad_accum_steps;
  const size_t vb = (size_t)accum * sizeof *t->valid;
  char why[256];
  t->graph_last = TRAIN_GRAPH_RUN;
  if (!t->graphs || opprof_timing() || t->graph_steps++ < TRAIN_GRAPH_WARMUP) return step_work(t, s, err, errlen);
  if (t->graph[par]) {
    if (!memcmp(t->valid, t->graph_valid[par], vb)) {
      t->graph_last = TRAIN_GRAPH_REPLAYED;
      return be->graph_launch(be, t->graph[par], err, errlen);
    }
    if (!t->graph_miss++)
      log_warn("train.cuda_graphs: step %d's batches count other targets than the recorded step's; such steps run "
               "unrecorded", s + 1);
    return step_work(t, s, err, errlen);
  }
  if (be->graph_begin(be, why, sizeof why)) {
    graphs_off(t, s, why);
    return step_work(t, s, err, errlen);
  }
  const int rc = step_work(t, s, err, errlen);
  void *g = be->graph_end(be, why, sizeof why);
  if (rc || !g) {
    be->graph_destroy(be, g);
    if (rc) return rc;
    graphs_off(t, s, why);
    return step_work(t, s, err, errlen); /* the recorded work did not run */
  }
  t->graph[par] = g;
  t->graph_last = TRAIN_GRAPH_RECORDED;
  memcpy(t->graph_valid[par], t->valid, vb);
  log_rank0("train.cuda_graphs: step %d recorded (staged batches of parity %d); the steps of its parity replay it",
            s + 1, par);
  return be->graph_launch(be, g, err, errlen);
}

/* The step on the device: its optimizer values up (their slot of step_host into step_dev) and its
 * batches staged, then its work (graph_step), and its values copied from rec into record
 * `pending`. */
static int device_train(train_t *t, int s, double lr, char *err, size_t errlen) {
  if (t->pending == 0) t->pending_first = s;
  t->step_host[t->pending] = dp_next_step(t->dp, lr);
  t->be->to_device_async(t->be, t->step_dev, &t->step_host[t->pending], sizeof *t->step_dev);
  const int par = stage_step(t, s, err, errlen);
  if (par < 0) return -1;
  opprof_replay_mark(1);
  if (graph_step(t, s, par, err, errlen)) return -1;
  opprof_replay_mark(0);
  t->be->copy(t->be, (step_rec_t *)t->recs + t->pending, t->rec, sizeof(step_rec_t));
  t->pending++;
  return 0;
}

int train_step(train_t *t, int s, train_result_t *out, char *err, size_t errlen) {
  const double t0 = metrics_now();
  const uint64_t wait0 = mesh_wait_ns(t->mesh);
  trace_step_begin(s + 1);
  opprof_step_begin(s + 1);
  hooks_slow(t->hooks);
  const double lr = optim_lr(&t->p->train, s);
  dp_zero_grad(t->dp);
  memset(out, 0, sizeof *out);
  t->n_read = 0;
  if (t->pp ? pipeline_train(t, s, lr, out, err, errlen) : device_train(t, s, lr, err, errlen)) return -1;
  /* No wait for the optimizer's kernels unless this step reads: the read waits for them, and
   * anything that reads the parameters (eval, a checkpoint) copies them back, which waits too. */
  if (!t->pp && (!t->read_due || t->read_due(t->read_arg, s + 1) || t->pending == TRAIN_PENDING_MAX) &&
      train_read(t, err, errlen))
    return -1;
  out->read = t->n_read;
  out->graph = t->pp ? TRAIN_GRAPH_RUN : t->graph_last;
  out->loss = t->n_read ? t->read_loss[t->n_read - 1] : NAN;
  out->gnorm = t->n_read ? t->read_gnorm[t->n_read - 1] : NAN;
  out->lr = lr;
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
  if (loss_shared(t)) { /* each cp rank's loss is its chunks' mean: the sum counts cp times */
    float s = (float)sum;
    if (comm_all_reduce(t->dpc, &s, 1, DT_F32, COMM_SUM)) {
      return err_set(err, errlen, -1, "eval: %s", comm_errmsg(t->dpc));
    }
    sum = t->cp_size > 1 ? s / t->cp_size : s;
  }
  *out = sum / batches;
  return 0;
}
