/* dp_zero2: ZeRO-2 (PyTorch's SHARD_GRAD_OP): parameters replicated, gradients and optimizer
 * state sharded over "dp".
 *
 * It uses the shard layout of FSDP (dp_shard_setup, over the dp group: S = dp size) with one
 * gathered slot per unit that is never freed: gbuf holds the whole (padded) parameters on every
 * rank, and the model's units point into it for good. Per unit and micro-step:
 *   gather(u):        nothing to fetch; for the backward the unit's gradient buffer (transient,
 *                     the largest unit's size, shared by all units) is zeroed;
 *   reduce_grads(u):  reduce_scatter (avg) of that buffer over dp, added into this rank's
 *                     gradient shard (accumulating across micro-steps; the full gradient never
 *                     outlives the unit's backward, which is why it reduces on every micro-step
 *                     where DDP waits for the last). With overlap there are two such buffers,
 *                     taken by unit parity, and the reduce-scatter of unit u runs while unit u-1
 *                     computes into the other: its buckets are the units;
 *   step:             AdamW on the fp32 parameter shard with its gradient shard and moments,
 *                     then one all_gather per unit of the updated shards into gbuf.
 * Mixed precision: the replicated parameters are fp32 masters (what checkpoints save), so the
 * all_gather after the step moves fp32 and the model rounds its bf16 compute copy from them;
 * gradients reduce in reduce_dtype (dp_shard_reduce).
 * The gradient norm sums the shards' squares with one all_reduce over dp (and tp). Checkpoints:
 * every rank saves its shard of parameters and moments (as FSDP); a load also fills the
 * replicated parameters, so it needs no collective. Per-rank persistent state: the replicated
 * parameters plus the 1/dp shard the optimizer updates, 1/dp of the gradients and moments.
 * The model should be created without flat buffers (dp_owns_buffers); if it has them they sit
 * idle and are reported as working memory. */
#include <stdio.h>

#include "common/log.h"
#include "trainer/parallel/dp_impl.h"

static void point_units(dp_impl_t *d) {
  for (int u = 0; u < d->n_units; u++) model_set_unit_buffers(d->m, u, d->gbuf + d->goff[u], dp_shard_gradbuf(d, u, 0));
}

static int zero2_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  d->S = comm_size(d->dp_comm);
  d->s = comm_rank(d->dp_comm);
  d->shard_comm = d->dp_comm; /* the shards split over dp (dp_shard is 1 here) */
  d->shard_hcomm = d->dp_hcomm;
  int rc = dp_shard_setup(d, p, 0, 0, "ZeRO-2", err, errlen);
  if (rc) return rc;
  /* Padding stays zero: all_gather copies the shards' zero padding, the optimizer never moves it. */
  d->be->zero(d->be, d->gbuf, d->gbuf_floats * sizeof(float));
  d->be->zero(d->be, d->sparams, d->shard_total * sizeof(float));
  d->be->zero(d->be, d->sgrads, d->shard_total * sizeof(float));
  if (model_params(d->m))
    log_warn("dp zero2: the model has its own flat buffers (%zu MiB idle); create it with "
             "no_flat_buffers = dp_owns_buffers()", 2 * d->num_params * sizeof(float) >> 20);
  point_units(d);
  return 0;
}

static int zero2_gather(dp_t *dp, int u, int for_backward) {
  dp_impl_t *d = dp_impl_of(dp);
  float *g = dp_shard_gradbuf(d, u, for_backward);
  model_set_unit_buffers(d->m, u, d->gbuf + d->goff[u], g);
  return d->status;
}

static int zero2_reduce_grads(dp_t *dp, int u) { return dp_shard_reduce(dp_impl_of(dp), u); }


/* Whole units into the replicated parameters and this rank's slices into the shard: no collective. */
static int zero2_init_params(dp_impl_t *d, uint64_t seed, double init_std) { return dp_shard_init(d, seed, init_std, 1); }

/* The replicated parameters are always whole: opening points the unit at them; committing
 * (after the caller changed them, the same on every rank) copies this rank's shard out. */
static int zero2_unit_open(dp_impl_t *d, int u) { return zero2_gather(&d->pub, u, 0); }

static int zero2_grad_norm(dp_impl_t *d, double *norm) { return dp_norm_of(d, d->sgrads, d->dp_hcomm, norm); }
static int zero2_clip(dp_impl_t *d, double clip, double *norm, float *scale) {
  return dp_clip_of(d, d->sgrads, d->dp_comm, clip, norm, scale);
}

static int zero2_step(dp_impl_t *d, double lr, double grad_scale, const float *scale_dev) {
  dp_adamw(d, d->sparams, d->sgrads, NULL, lr, grad_scale, scale_dev);
  for (int u = 0; u < d->n_units; u++) {
    char what[48];
    snprintf(what, sizeof what, "unit %d parameters", u);
    if (dp_all_gather(d, d->dp_comm, d->sparams + d->soff[u], d->gbuf + d->goff[u], d->chunk[u], DT_F32, what))
      return d->status;
  }
  return 0;
}

/* Each rank saves its shard of everything; every rank loads its shard and, load only, the whole
 * of each unit's replicated parameters. */
static int zero2_ck_ranges(dp_impl_t *d, dp_ck_range_t *r) {
  int n = dp_shard_ck_ranges(d, r, 1, 1);
  for (int u = 0; u < d->n_units; u++)
    r[n++] = (dp_ck_range_t){"param", d->uoff[u], d->unumel[u], d->gbuf + d->goff[u], 0};
  return n;
}

static void zero2_memory(const dp_impl_t *d, dp_memory_t *out) {
  const size_t f = sizeof(float);
  out->param_bytes = (d->gbuf_floats + d->shard_total) * f;
  out->grad_bytes = d->shard_total * f;
  out->optim_bytes = 2 * d->opt.count * f;
  /* one unit's full gradients and the scatter scratch, plus the model's idle flat buffers */
  out->work_bytes = ((size_t)d->ngrad * (d->gmax + d->cmax) + (model_params(d->m) ? 2 * d->num_params : 0)) * f;
}

const dp_ops_t dp_zero2_ops = {
    .name = "zero2", .setup = zero2_setup, .gather = zero2_gather, .reduce_grads = zero2_reduce_grads,
    .init_params = zero2_init_params, .unit_open = zero2_unit_open, .unit_commit = dp_shard_unit_commit,
    .unit_params = dp_shard_unit_params, .zero_grad = dp_shard_zero_grad, .grad_norm = zero2_grad_norm,
    .clip = zero2_clip, .step = zero2_step, .drain = dp_shard_drain, .ck_ranges = zero2_ck_ranges, .memory = zero2_memory,
};
