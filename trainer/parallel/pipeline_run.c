/* pipeline_run: the runner that executes any schedule of trainer/plan/pipeline.h on this rank's
 * chunks of the model (see pp_runner_t in pipeline.h).
 *
 * Slots. Each chunk keeps its micro-batches' activations in slots (model_chunk_forward/backward
 * run on one). A slot is taken where the micro-batch enters the chunk (its input activation is
 * received straight into the slot, or the first stage embeds into it) and given back where it
 * leaves: after the backward on the first stage, else once the gradient sent from it (d(input)
 * overwrites the input it no longer needs) has left. pp_slots walks the list with those rules;
 * a chunk that sends gradients gets one slot more than the walk's peak, so that taking a slot
 * never has to wait for a send that the peer will only receive later: when no slot is free,
 * the oldest gradient send of the chunk is waited for.
 *
 * Transfers. Every send and receive is started where the list says and waited where its data is
 * needed: a received activation at the forward, a received gradient at the backward, a sent
 * activation before its buffer receives the gradient (the output buffer is reused for it), the
 * rest at the end of the step. Channels (mesh_pp_channels_t) carry one direction each, so the
 * comm's one-operation-at-a-time order never puts a send behind a receive; per channel, the
 * receiver posts in the sender's order, which is what pp_check proves of every schedule.
 *
 * Gradient synchronization. The strategy reduces a chunk's gradients on its last backward of the
 * step (dp_set_sync before each backward), as DDP's no_sync does for accumulation; under
 * interleaving a later chunk's last backward comes first, which is the order of its units. */
#include "trainer/plan/pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "trainer/comm/comm.h"
#include "trainer/parallel/dp.h"
#include "trainer/model/model.h"

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ------------------------------------------------------------------ the runner's state */

/* Per (chunk, micro-batch): its slot and its transfers in flight. */
typedef struct {
  int slot, done; /* done: backwarded, the slot waits only for its gradient's send */
  comm_req_t *send_act, *recv_act, *send_grad, *recv_grad;
} mbstate_t;

static mbstate_t *st_of(pp_runner_t *r, int c, int mb) { return &((mbstate_t *)r->mbs)[c * r->plan.m + mb]; }

int pp_runner_init(pp_runner_t *r, const pp_runner_config_t *cfg, char *err, size_t errlen) {
  memset(r, 0, sizeof *r);
  r->cfg = *cfg;
  if (pp_generate(cfg->schedule, cfg->p, cfg->v, cfg->m, &r->plan, err, errlen)) return PP_EFAIL;
  if (cfg->v > PP_MAX_CHUNKS || cfg->rank < 0 || cfg->rank >= cfg->p) {
    pp_runner_free(r);
    return err_set(err, errlen, PP_EFAIL, "pipeline: rank %d of %d with %d stages per rank is outside what the runner "
                   "handles (at most %d per rank)", cfg->rank, cfg->p, cfg->v, PP_MAX_CHUNKS);
  }
  pp_slots(&r->plan, cfg->rank, r->slots);
  for (int c = 0; c < cfg->v; c++) r->smax = r->slots[c] > r->smax ? r->slots[c] : r->smax;
  r->mbs = calloc((size_t)cfg->v * cfg->m, sizeof(mbstate_t));
  r->taken = calloc((size_t)cfg->v * r->smax, 1);
  if (!r->mbs || !r->taken) {
    pp_runner_free(r);
    return err_set(err, errlen, PP_EFAIL, "pipeline: out of memory");
  }
  for (int c = 0; c < cfg->v; c++) {
    r->last_bwd[c] = -1;
    for (int i = 0; i < r->plan.n[cfg->rank]; i++) {
      const pp_action_t *a = &r->plan.act[cfg->rank][i];
      if (a->kind == PP_BWD && a->stage / cfg->p == c) r->last_bwd[c] = a->mb;
    }
  }
  return 0;
}

void pp_runner_free(pp_runner_t *r) {
  if (!r) return;
  pp_free(&r->plan);
  free(r->mbs);
  free(r->taken);
  r->mbs = NULL;
  r->taken = NULL;
}

/* ------------------------------------------------------------------ one step */

/* Fails the step with "pipeline: <what> stage s micro-batch mb: <comm's message>". */
static int comm_failed(pp_runner_t *r, comm_t *c, const char *what, int stage, int mb) {
  return err_set(r->err, sizeof r->err, PP_EFAIL, "pipeline: %s of stage %d micro-batch %d failed: %s", what, stage,
                 mb + 1, comm_errmsg(c));
}

static int wait_req(pp_runner_t *r, comm_req_t **req, comm_t *c, const char *what, int stage, int mb) {
  if (!*req) return 0;
  const int64_t t0 = now_ns();
  int rc = comm_wait(*req, NULL);
  *req = NULL;
  r->stats.wait_ns += now_ns() - t0;
  return rc ? comm_failed(r, c, what, stage, mb) : 0;
}

static void give_slot(pp_runner_t *r, int c, int mb) {
  mbstate_t *s = st_of(r, c, mb);
  r->taken[c * r->smax + s->slot] = 0;
  s->slot = -1;
}

/* A free slot of chunk c for micro-batch mb; with none free, the oldest gradient send of the
 * chunk is waited for and its slot taken. */
static int take_slot(pp_runner_t *r, int c, int mb) {
  for (int k = 0; k < r->slots[c]; k++)
    if (!r->taken[c * r->smax + k]) {
      r->taken[c * r->smax + k] = 1;
      st_of(r, c, mb)->slot = k;
      return 0;
    }
  for (int j = 0; j < r->plan.m; j++) {
    mbstate_t *o = st_of(r, c, j);
    if (o->slot >= 0 && o->send_grad && o->done) {
      const int stage = pp_stage_of(r->cfg.rank, c, r->cfg.p);
      if (wait_req(r, &o->send_grad, r->cfg.send_grad, "sending the input gradient", stage, j)) return PP_EFAIL;
      give_slot(r, c, j);
      return take_slot(r, c, mb);
    }
  }
  return err_set(r->err, sizeof r->err, PP_EFAIL,
                 "pipeline: chunk %d has no free activation slot of %d for micro-batch %d "
                 "(the schedule holds more than pp_slots counted)", c, r->slots[c], mb + 1);
}

/* A forward or backward that failed: the strategy's message when its hooks failed, else the
 * model's. */
static int pass_failed(pp_runner_t *r, const char *pass, int stage, int mb) {
  const dp_t *dp = r->cfg.dp;
  return err_set(r->err, sizeof r->err, PP_EFAIL, "pipeline: the %s of stage %d micro-batch %d failed: %s", pass, stage,
                 mb + 1, dp && dp_status(dp) ? dp_errmsg(dp) : model_errmsg(r->cfg.model));
}

int pp_run_step(pp_runner_t *r, const int32_t *tok, const int32_t *tgt, int b, int t, float loss_scale,
                pp_step_stats_t *out) {
  const pp_runner_config_t *cfg = &r->cfg;
  model_t *m = cfg->model;
  const int p = cfg->p, S = p * cfg->v, M = r->plan.m, rank = cfg->rank;
  const size_t bt = (size_t)b * t, n = model_boundary_numel(m, b, t);
  const dtype_t cdt = model_param_dtype(m);
  r->err[0] = '\0';
  memset(&r->stats, 0, sizeof r->stats);
  r->stats.bad_mb = -1;
  memset(r->taken, 0, (size_t)cfg->v * r->smax);
  for (int i = 0; i < cfg->v * M; i++) ((mbstate_t *)r->mbs)[i] = (mbstate_t){.slot = -1};
  int inflight = 0, rc = 0;
  const int64_t t0 = now_ns();
  for (int i = 0; i < r->plan.n[rank] && !rc; i++) {
    const pp_action_t *a = &r->plan.act[rank][i];
    const int c = a->stage / p, mb = a->mb;
    mbstate_t *s = st_of(r, c, mb);
    switch (a->kind) {
    case PP_RECV_ACT:
      if ((rc = take_slot(r, c, mb))) break;
      if (comm_start_recv(cfg->recv_act, model_chunk_input(m, c, s->slot), n, cdt, 0, &s->recv_act))
        rc = comm_failed(r, cfg->recv_act, "receiving the input activation", a->stage, mb);
      break;
    case PP_FWD: {
      if (a->stage == 0 && (rc = take_slot(r, c, mb))) break;
      if ((rc = wait_req(r, &s->recv_act, cfg->recv_act, "receiving the input activation", a->stage, mb))) break;
      float loss = 0;
      const int64_t f0 = now_ns();
      const int head = a->stage == S - 1;
      int mrc = model_chunk_forward(m, c, s->slot, a->stage == 0 ? tok + mb * bt : NULL, head ? tgt + mb * bt : NULL,
                                    b, t, &loss);
      r->stats.busy_ns += now_ns() - f0;
      if (mrc || (cfg->dp && dp_status(cfg->dp))) {
        rc = pass_failed(r, "forward", a->stage, mb);
        break;
      }
      if (head) {
        r->stats.loss_sum += loss;
        if (!isfinite(loss) && r->stats.bad_mb < 0) r->stats.bad_mb = mb;
      }
      if (++inflight > r->stats.peak_inflight) r->stats.peak_inflight = inflight;
      break;
    }
    case PP_SEND_ACT:
      if (comm_start_send(cfg->send_act, model_chunk_output(m, c, s->slot), n, cdt, 1, &s->send_act))
        rc = comm_failed(r, cfg->send_act, "sending the output activation", a->stage, mb);
      break;
    case PP_RECV_GRAD:
      /* the gradient lands where the activation was sent from */
      if ((rc = wait_req(r, &s->send_act, cfg->send_act, "sending the output activation", a->stage, mb))) break;
      if (comm_start_recv(cfg->recv_grad, model_chunk_output(m, c, s->slot), n, cdt, 0, &s->recv_grad))
        rc = comm_failed(r, cfg->recv_grad, "receiving the output gradient", a->stage, mb);
      break;
    case PP_BWD: {
      if ((rc = wait_req(r, &s->recv_grad, cfg->recv_grad, "receiving the output gradient", a->stage, mb))) break;
      if (cfg->dp) dp_set_sync(cfg->dp, mb == r->last_bwd[c]);
      const int64_t b0 = now_ns();
      int mrc = model_chunk_backward(m, c, s->slot, loss_scale);
      r->stats.busy_ns += now_ns() - b0;
      if (mrc || (cfg->dp && dp_status(cfg->dp))) {
        rc = pass_failed(r, "backward", a->stage, mb);
        break;
      }
      inflight--;
      if (a->stage == 0) give_slot(r, c, mb);
      else s->done = 1;
      break;
    }
    case PP_SEND_GRAD:
      if (comm_start_send(cfg->send_grad, model_chunk_input(m, c, s->slot), n, cdt, 1, &s->send_grad))
        rc = comm_failed(r, cfg->send_grad, "sending the input gradient", a->stage, mb);
      break;
    }
  }
  /* Everything started is waited for, also after a failure (comm.h: every request is waited). */
  for (int c = 0; c < cfg->v; c++)
    for (int mb = 0; mb < M; mb++) {
      mbstate_t *s = st_of(r, c, mb);
      const int stage = pp_stage_of(rank, c, p);
      int w = wait_req(r, &s->recv_act, cfg->recv_act, "receiving the input activation", stage, mb);
      w |= wait_req(r, &s->send_act, cfg->send_act, "sending the output activation", stage, mb);
      w |= wait_req(r, &s->recv_grad, cfg->recv_grad, "receiving the output gradient", stage, mb);
      w |= wait_req(r, &s->send_grad, cfg->send_grad, "sending the input gradient", stage, mb);
      if (w && !rc) rc = PP_EFAIL;
    }
  if (cfg->dp) dp_set_sync(cfg->dp, 1);
  r->stats.span_ns = now_ns() - t0;
  if (out) *out = r->stats;
  return rc;
}

int pp_run_forward(pp_runner_t *r, const int32_t *tok, const int32_t *tgt, int b, int t, float *loss) {
  const pp_runner_config_t *cfg = &r->cfg;
  model_t *m = cfg->model;
  const int p = cfg->p, S = p * cfg->v;
  const size_t n = model_boundary_numel(m, b, t);
  const dtype_t cdt = model_param_dtype(m);
  r->err[0] = '\0';
  *loss = 0;
  /* One micro-batch through the stages in order, slot 0 of each chunk (between steps every
   * slot is free); blocking transfers: evaluation is not pipelined. */
  for (int s = 0; s < S; s++) {
    if (s % p != cfg->rank) continue;
    const int c = s / p;
    if (s > 0 && comm_recv(cfg->recv_act, model_chunk_input(m, c, 0), n, cdt, 0))
      return comm_failed(r, cfg->recv_act, "receiving the input activation (eval)", s, 0);
    float l = 0;
    if (model_chunk_forward(m, c, 0, s == 0 ? tok : NULL, s == S - 1 ? tgt : NULL, b, t, &l) ||
        (cfg->dp && dp_status(cfg->dp)))
      return pass_failed(r, "eval forward", s, 0);
    if (s == S - 1) *loss = l;
    else if (comm_send(cfg->send_act, model_chunk_output(m, c, 0), n, cdt, 1))
      return comm_failed(r, cfg->send_act, "sending the output activation (eval)", s, 0);
  }
  return 0;
}

const char *pp_run_errmsg(const pp_runner_t *r) { return r->err; }
