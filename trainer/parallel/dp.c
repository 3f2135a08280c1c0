/* dp: the public side of the data-parallel strategies of dp.h, and what they share.
 *
 * A strategy is a table of operations (dp_ops_t, trainer/parallel/dp_impl.h) in its own file:
 *   dp_ddp.c    serial, DDP and ZeRO-1 (the model's flat buffers, whole on every rank);
 *   dp_fsdp.c   FSDP and HSDP (per-unit padded shards, gathered around each unit's use);
 *   dp_zero2.c  ZeRO-2 (parameters replicated, gradients and optimizer state sharded).
 * This file picks the table from the mesh and plan once (dp_create), then dispatches through
 * it; it never asks which strategy it runs. What every strategy needs lives here: the counted
 * and checked collectives (the traffic report), the first-error record, the global gradient
 * norm over a storage's tensor parts, and the checkpoint plumbing that turns a strategy's
 * ranges of state into chunks of full tensors and back.
 *
 * The gradient norm sums squares per tensor part, split in two: tensors split across tp
 * (summed over tp) and tensors replicated across tp (counted once); sharded storage adds up
 * over its shard group. Shares travel as fp32 (the cpu comm's only dtype): 1e-7 relative on a
 * clip scale. They are host values, so they go through the groups' host communicators (the
 * device ones themselves when the comm backend is cpu). A training step keeps them on the
 * device instead (dp_clip_dev): the same sums and fp32 shares in device memory, reduced over the
 * groups' device communicators in the same order, the norm and the clip scale computed there,
 * and AdamW reading the scale there (dp_step_dev); nothing waits for the device. */
#include "trainer/parallel/dp.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "trainer/formats/ckpt.h"
#include "trainer/parallel/dp_impl.h"

dp_impl_t *dp_impl_of(dp_t *dp) { return (dp_impl_t *)dp->ctx; }

int dp_fail(dp_impl_t *d, int code, const char *fmt, ...) {
  if (!d->status) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err, sizeof d->err, fmt, ap);
    va_end(ap);
    d->status = code ? code : -1;
  }
  return code ? code : -1;
}

/* ------------------------------------------------------------------ the collectives */

/* A started request becomes the op's (pending); without overlap it is waited for at once, so
 * the order of everything is what the blocking strategy had. */
static int op_started(dp_impl_t *d, dp_op_t *op, comm_t *c, uint64_t *counter, int rc, const char *coll,
                      const char *what) {
  snprintf(op->what, sizeof op->what, "%s of %s", coll, what);
  op->comm = c;
  op->counter = counter;
  if (rc) return dp_fail(d, rc, "dp %s: %s failed: %s", d->pub.name, op->what, comm_errmsg(c));
  op->pending = 1;
  return d->overlap ? 0 : dp_op_wait(d, op);
}

int dp_op_wait(dp_impl_t *d, dp_op_t *op) {
  if (!op->pending) return 0;
  op->pending = 0;
  uint64_t sent = 0;
  int rc = comm_wait(op->req, &sent);
  op->req = NULL;
  *op->counter += sent;
  if (rc) return dp_fail(d, rc, "dp %s: %s failed: %s", d->pub.name, op->what, comm_errmsg(op->comm));
  return op->then ? op->then(d, op) : 0;
}

int dp_ops_wait(dp_impl_t *d, dp_op_t *ops, int n) {
  int rc = 0;
  for (int i = 0; i < n; i++) { /* all of them, also after a failure: none is left in flight */
    int r = dp_op_wait(d, &ops[i]);
    if (r && !rc) rc = r;
  }
  return rc;
}

int dp_start_all_gather(dp_impl_t *d, dp_op_t *op, comm_t *c, const void *in, void *out, size_t n, dtype_t dt,
                        const char *what) {
  int rc = comm_start_all_gather(c, in, out, n, dt, &op->req);
  return op_started(d, op, c, &d->traffic.all_gather, rc, "all_gather", what);
}
int dp_start_reduce_scatter(dp_impl_t *d, dp_op_t *op, comm_t *c, const void *in, void *out, size_t n, dtype_t dt,
                            const char *what) {
  int rc = comm_start_reduce_scatter(c, in, out, n, dt, COMM_AVG, &op->req);
  return op_started(d, op, c, &d->traffic.reduce_scatter, rc, "reduce_scatter", what);
}
static int start_all_reduce_op(dp_impl_t *d, dp_op_t *op, comm_t *c, void *buf, size_t n, dtype_t dt, comm_op_t rop,
                               const char *what) {
  int rc = comm_start_all_reduce(c, buf, n, dt, rop, &op->req);
  return op_started(d, op, c, &d->traffic.all_reduce, rc, "all_reduce", what);
}
int dp_start_all_reduce(dp_impl_t *d, dp_op_t *op, comm_t *c, void *buf, size_t n, dtype_t dt, const char *what) {
  return start_all_reduce_op(d, op, c, buf, n, dt, COMM_AVG, what);
}

/* The blocking forms: a local op started and waited. */
int dp_all_reduce(dp_impl_t *d, comm_t *c, float *buf, size_t n, comm_op_t op, const char *what) {
  dp_op_t o = {0};
  return start_all_reduce_op(d, &o, c, buf, n, DT_F32, op, what) ? d->status : dp_op_wait(d, &o);
}
int dp_all_gather(dp_impl_t *d, comm_t *c, const void *in, void *out, size_t n, dtype_t dt, const char *what) {
  dp_op_t o = {0};
  return dp_start_all_gather(d, &o, c, in, out, n, dt, what) ? d->status : dp_op_wait(d, &o);
}
int dp_reduce_scatter(dp_impl_t *d, comm_t *c, const float *in, float *out, size_t n, const char *what) {
  dp_op_t o = {0};
  return dp_start_reduce_scatter(d, &o, c, in, out, n, DT_F32, what) ? d->status : dp_op_wait(d, &o);
}
int dp_broadcast(dp_impl_t *d, comm_t *c, float *buf, size_t n, int root, const char *what) {
  dp_op_t o = {0};
  int rc = comm_start_broadcast(c, buf, n, DT_F32, root, &o.req);
  return op_started(d, &o, c, &d->traffic.broadcast, rc, "broadcast", what) ? d->status : dp_op_wait(d, &o);
}

/* parts has room for one entry per tensor: a tensor lies in one unit, and this rank's share
 * of a unit is one contiguous range, so a tensor meets it in one interval at most. */
void dp_add_part(dp_impl_t *d, size_t offset, size_t numel, int tp_split) {
  d->parts[d->n_parts++] = (dp_part_t){.offset = offset, .numel = numel, .tp_split = tp_split};
}

int dp_rank_of(comm_t *c) { return c ? comm_rank(c) : 0; }

/* The tables of the local sums (dp_impl_t.local): each tensor's place in its unit, each unit's
 * run of tensors. A model whose units' tensors are not consecutive keeps none (local stays NULL);
 * out of memory is a failure. */
static int local_setup(dp_impl_t *d, char *err, size_t errlen) {
  const char *env = getenv("MESHRUN_LOCAL_NORMS");
  const int nt = model_num_tensors(d->m);
  /* under pipeline parallelism the tables are those of this rank's chunks (their tensors and
   * units only, numbered locally in the model's order) */
  if (!d->ops->reduce_grads || (env && !strcmp(env, "0")) || nt <= 0) return 0;
  d->loc_off = malloc((size_t)nt * sizeof *d->loc_off);
  d->loc_len = malloc((size_t)nt * sizeof *d->loc_len);
  d->ufirst = calloc((size_t)d->n_units, sizeof *d->ufirst);
  d->ucount = calloc((size_t)d->n_units, sizeof *d->ucount);
  if (!d->loc_off || !d->loc_len || !d->ufirst || !d->ucount) goto nomem;
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(d->m, i);
    const int u = t->unit;
    if (d->ucount[u] && d->ufirst[u] + d->ucount[u] != i) return 0;
    if (!d->ucount[u]) d->ufirst[u] = i;
    d->ucount[u]++;
    d->loc_off[i] = t->offset - d->uoff[u];
    d->loc_len[i] = t->numel;
  }
  if (!(d->local = d->be->alloc(d->be, (size_t)nt * sizeof(double)))) goto nomem;
  return 0;
nomem:
  return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory for the local gradient norms of %d tensors", nt);
}

void dp_before_reduce(dp_impl_t *d, int u, float *g) {
  const int i = d->poison - 1;
  /* at the reduction the sums below see: a strategy that reduces every micro-step (FSDP) reduces
   * a pipeline's earlier micro-batches after the poison was armed (before the step) */
  if (d->poison && d->sync && model_tensor(d->m, i)->unit == u) {
    const float nan = NAN;
    d->be->to_device(d->be, g + (model_tensor(d->m, i)->offset - d->uoff[u]), &nan, sizeof nan);
    d->poison = 0;
  }
  if (d->local && d->sync && d->ucount[u]) /* the last micro-step's: the cost of one pass a step */
    d->be->sumsq_parts_add(d->be, g, d->loc_off + d->ufirst[u], d->loc_len + d->ufirst[u], d->ucount[u],
                           d->local + d->ufirst[u]);
}

int dp_local_first_bad(dp_t *dp, int *first) {
  dp_impl_t *d = dp_impl_of(dp);
  const int nt = model_num_tensors(d->m);
  if (!d->ops->reduce_grads) return 1;
  double *h = d->local ? malloc((size_t)nt * sizeof *h) : NULL;
  if (!h) return DP_EINVAL;
  d->be->to_host(d->be, h, d->local, (size_t)nt * sizeof *h);
  int i = 0;
  while (i < nt && isfinite(h[i])) i++;
  free(h);
  *first = i;
  return 0;
}

int dp_poison_grad(dp_t *dp, const char *tensor) {
  dp_impl_t *d = dp_impl_of(dp);
  const int nt = model_num_tensors(d->m);
  int i = 0;
  while (i < nt && strcmp(model_tensor(d->m, i)->name, tensor)) i++;
  if (i == nt || !d->ops->reduce_grads) return DP_EINVAL;
  d->poison = i + 1;
  return 0;
}

/* The parts as the backend's sums take them (made once): offsets, lengths, and the group of
 * each, 1 for a tp-replicated part under tp (counted once), 0 for the rest (summed over tp). */
static int norm_parts(dp_impl_t *d) {
  if (d->part_sumsq) return 0;
  const size_t n = d->n_parts > 0 ? (size_t)d->n_parts : 1;
  d->part_off = malloc(n * sizeof *d->part_off);
  d->part_len = malloc(n * sizeof *d->part_len);
  d->part_group = malloc(n * sizeof *d->part_group);
  d->part_sumsq = malloc(n * sizeof *d->part_sumsq);
  if (!d->part_off || !d->part_len || !d->part_group || !d->part_sumsq)
    return dp_fail(d, DP_ENOMEM, "dp error: out of memory for the gradient norm parts");
  for (int i = 0; i < d->n_parts; i++) {
    d->part_off[i] = d->parts[i].offset;
    d->part_len[i] = d->parts[i].numel;
    d->part_group[i] = d->tp > 1 && d->parts[i].tp_split == MODEL_TP_REPLICATED;
  }
  return 0;
}

int dp_norm_of(dp_impl_t *d, const float *g, comm_t *shard_hcomm, double *norm) {
  double split = 0, repl = 0;
  if (norm_parts(d)) return d->status;
  d->be->sumsq_parts(d->be, g, d->part_off, d->part_len, d->n_parts, d->part_sumsq); /* one wait */
  for (int i = 0; i < d->n_parts; i++) {
    double s = d->part_sumsq[i];
    if (d->part_group[i]) repl += s;
    else split += s;
  }
  float sums[2] = {(float)split, (float)repl};
  if (shard_hcomm && dp_all_reduce(d, shard_hcomm, sums, 2, COMM_SUM, "gradient norm")) return d->status;
  if (d->tp > 1 && dp_all_reduce(d, d->tp_hcomm, sums, 1, COMM_SUM, "gradient norm")) return d->status;
  /* pipeline stages hold disjoint parameters: their shares add up */
  if (d->pp_hcomm && dp_all_reduce(d, d->pp_hcomm, sums, 2, COMM_SUM, "gradient norm")) return d->status;
  /* Unsharded without tp and pp, nothing travelled: the double sums stay exact. */
  *norm = shard_hcomm || d->tp > 1 || d->pp_hcomm ? sqrt((double)sums[0] + (double)sums[1]) : sqrt(split + repl);
  return 0;
}

int dp_clip_of(dp_impl_t *d, const float *g, comm_t *shard_comm, double clip, double *norm, float *scale) {
  if (d->pp_hcomm)
    return dp_fail(d, DP_EINVAL, "dp error: the gradient norm on the device does not add up pipeline stages");
  if (norm_parts(d)) return d->status;
  if (!d->norm_dev && !(d->norm_dev = d->be->alloc(d->be, 2 * sizeof(double) + 2 * sizeof(float))))
    return dp_fail(d, DP_ENOMEM, "dp error: out of device memory for the gradient norm");
  double *sums = d->norm_dev;
  float *shares = (float *)(sums + 2);
  d->be->sumsq_groups(d->be, g, d->part_off, d->part_len, d->part_group, d->n_parts, sums, shares);
  /* the same reductions as dp_norm_of's, on the groups' device comms */
  if (shard_comm && dp_all_reduce(d, shard_comm, shares, 2, COMM_SUM, "gradient norm")) return d->status;
  if (d->tp > 1 && dp_all_reduce(d, d->tp_comm, shares, 1, COMM_SUM, "gradient norm")) return d->status;
  d->be->clip_scale(d->be, sums, shares, shard_comm || d->tp > 1, clip, norm, scale);
  return 0;
}

void dp_adamw(dp_impl_t *d, float *params, const float *grads, void *params_lp, double lr, double grad_scale,
              const float *scale_dev) {
  if (scale_dev) optim_step_dev(&d->opt, params, grads, params_lp, d->step_dev, scale_dev);
  else optim_step(&d->opt, params, grads, params_lp, lr, grad_scale);
}

/* ------------------------------------------------------------------ create / destroy */

/* Parameters shard over dp_shard x cp: context parallelism alone is FSDP over its ranks (as
 * torchtitan), so that the memory of the parameters falls with every rank. */
static int shard_ranks(const mesh_t *mesh) { return mesh ? mesh->dims[MESH_DP_SHARD] * mesh->dims[MESH_CP] : 1; }

int dp_is_sharded(const mesh_t *mesh) { return shard_ranks(mesh) > 1; }

int dp_owns_buffers(const mesh_t *mesh, const plan_t *p) {
  return dp_is_sharded(mesh) || (mesh && mesh->dims[MESH_DP_REPLICATE] > 1 && p->parallel.zero == 2);
}

/* The one place that looks at the mesh and plan to choose: dp_shard x cp > 1 is FSDP (HSDP with
 * dp_replicate > 1 too), else dp_replicate > 1 is DDP (ZeRO-1/2 with parallel.zero). */
static const dp_ops_t *ops_for(const mesh_t *mesh, const plan_t *p) {
  int R = mesh ? mesh->dims[MESH_DP_REPLICATE] : 1, S = shard_ranks(mesh);
  if (S > 1) return R > 1 ? &dp_hsdp_ops : &dp_fsdp_ops;
  if (R == 1) return &dp_serial_ops;
  return p->parallel.zero == 2 ? &dp_zero2_ops : p->parallel.zero == 1 ? &dp_zero1_ops : &dp_ddp_ops;
}

/* Every collective still in flight, waited for (their errors are kept in d->status). */
static int drain(dp_impl_t *d) { return d->ops->drain ? d->ops->drain(d) : 0; }

void dp_destroy(dp_t *dp) {
  if (!dp) return;
  dp_impl_t *d = dp_impl_of(dp);
  if (d->ops) drain(d);
  if (d->m) model_set_hooks(d->m, NULL);
  optim_free(&d->opt);
  if (d->be) {
    d->be->free(d->be, d->sparams);
    d->be->free(d->be, d->sgrads);
    d->be->free(d->be, d->gbuf);
    d->be->free(d->be, d->gradbuf);
    d->be->free(d->be, d->rstmp);
    d->be->free(d->be, d->sp_lp);
    d->be->free(d->be, d->gbuf_lp);
    d->be->free(d->be, d->rlp);
    d->be->free(d->be, d->norm_dev);
    d->be->free(d->be, d->local);
  }
  free(d->uoff);
  free(d->unumel);
  free(d->chunk);
  free(d->soff);
  free(d->goff);
  free(d->holder);
  free(d->parts);
  free(d->part_off);
  free(d->part_len);
  free(d->part_sumsq);
  free(d->part_group);
  free(d->ck_ts);
  free(d->loc_off);
  free(d->loc_len);
  free(d->ufirst);
  free(d->ucount);
  free(d->blo);
  free(d->bhi);
  free(d->bucket_of);
  free(d->bops);
  free(d->gops);
  free(d->rsops);
  free(d->arops);
  free(d);
}

/* The wire copies of reduce_dtype bf16 (see dp_impl_t.rlp): per gradient buffer the largest
 * padded unit and its chunk, then the shard for HSDP's replicate all-reduce; or (DDP, ZeRO-1)
 * the flat gradient, each bucket at its own offset. */
static int reduce_scratch(dp_impl_t *d, char *err, size_t errlen) {
  size_t n = d->num_params;
  if (d->chunk) {
    d->rs_lp_n = 0;
    for (int u = 0; u < d->n_units; u++)
      if (d->chunk[u] * (size_t)(d->S + 1) > d->rs_lp_n) d->rs_lp_n = d->chunk[u] * (size_t)(d->S + 1);
    n = (size_t)d->ngrad * d->rs_lp_n + (d->rep_reduce ? d->shard_total : 0);
  }
  d->rlp_n = n;
  if (n && !(d->rlp = d->be->alloc(d->be, n * dtype_size(d->rdt)))) {
    return err_set(err, errlen, DP_ENOMEM,
                   "dp error: out of memory for the %s gradient reduction buffer (%zu elements)", dtype_name(d->rdt),
                   n);
  }
  return 0;
}

int dp_create(dp_t **out, model_t *m, backend_t *be, const mesh_t *mesh, const plan_t *p, char *err,
              size_t errlen) {
  *out = NULL;
  dp_impl_t *d = calloc(1, sizeof *d);
  if (!d) {
    return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory");
  }
  d->pub.ctx = d;
  d->ops = ops_for(mesh, p);
  d->pub.name = d->ops->name;
  d->m = m;
  d->be = be;
  d->sync = 1;
  d->reshard = p->parallel.reshard_after_forward;
  d->overlap = p->parallel.overlap;
  d->ngrad = d->overlap ? 2 : 1;
  d->n_units = model_num_units(m);
  d->num_params = model_num_params(m);
  d->uoff = calloc((size_t)d->n_units, sizeof *d->uoff);
  d->unumel = calloc((size_t)d->n_units, sizeof *d->unumel);
  if (!d->uoff || !d->unumel) {
    dp_destroy(&d->pub);
    return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory");
  }
  for (int u = 0; u < d->n_units; u++) model_unit_range(m, u, &d->uoff[u], &d->unumel[u]);

  if (mesh) {
    /* the ranks that hold the same parameters: dp, and cp's too (the same as dp's when cp = 1) */
    d->dp_comm = mesh_comm(mesh, "dp_cp");
    d->shard_comm = mesh_comm(mesh, "dp_shard_cp");
    d->rep_comm = mesh_comm(mesh, "dp_replicate");
    d->tp_comm = mesh_comm(mesh, "tp");
    d->dp_hcomm = mesh_host_comm(mesh, "dp_cp");
    d->shard_hcomm = mesh_host_comm(mesh, "dp_shard_cp");
    d->tp_hcomm = mesh_host_comm(mesh, "tp");
    d->tp = mesh->dims[MESH_TP];
    d->pp_hcomm = mesh->dims[MESH_PP] > 1 ? mesh_host_comm(mesh, "pp") : NULL;
    if ((mesh->dims[MESH_PP] > 1 && !d->pp_hcomm) || !d->dp_comm || !d->shard_comm || !d->rep_comm || !d->tp_comm || !d->dp_hcomm || !d->shard_hcomm ||
        !d->tp_hcomm) {
      dp_destroy(&d->pub);
      return err_set(err, errlen, DP_EINVAL, "dp error: the mesh is not connected (call mesh_connect first)");
    }
  }
  d->S = shard_ranks(mesh);
  d->s = mesh ? mesh->coord[MESH_DP_SHARD] * mesh->dims[MESH_CP] + mesh->coord[MESH_CP] : 0; /* in dp_shard_cp */
  d->pdt = model_param_dtype(m);
  d->rdt = p->parallel.reduce_dtype; /* the plan's, as the model was given it */

  int rc = d->ops->setup(d, p, err, errlen);
  if (rc == 0 && d->rdt != DT_F32) rc = reduce_scratch(d, err, errlen);
  if (rc == 0) rc = local_setup(d, err, errlen);
  if (rc) {
    dp_destroy(&d->pub);
    return rc;
  }
  d->pub.gather = d->ops->gather;
  d->pub.release = d->ops->release;
  d->pub.reduce_grads = d->ops->reduce_grads;
  /* No hooks at all (serial): dp == NULL in the model, which then runs on its own buffers. */
  if (d->pub.gather || d->pub.release || d->pub.reduce_grads) model_set_hooks(m, &d->pub);
  *out = &d->pub;
  return 0;
}

/* ------------------------------------------------------------------ parameters and the step */

int dp_init_params(dp_t *dp, uint64_t seed, double init_std) {
  dp_impl_t *d = dp_impl_of(dp);
  return d->ops->init_params(d, seed, init_std);
}

int dp_unit_open(dp_t *dp, int u) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) return d->status;
  return d->ops->unit_open(d, u);
}

int dp_unit_commit(dp_t *dp, int u) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) return d->status;
  return d->ops->unit_commit(d, u);
}

void dp_unit_to_host(dp_t *dp, int u, float *host) {
  dp_impl_t *d = dp_impl_of(dp);
  d->be->to_host(d->be, host, d->ops->unit_params(d, u), d->unumel[u] * sizeof(float));
}

void dp_set_sync(dp_t *dp, int sync) { dp_impl_of(dp)->sync = sync; }

void dp_zero_grad(dp_t *dp) {
  dp_impl_t *d = dp_impl_of(dp);
  drain(d);
  d->ops->zero_grad(d);
  if (d->local) d->be->zero(d->be, d->local, (size_t)model_num_tensors(d->m) * sizeof(double));
}

int dp_grad_norm(dp_t *dp, double *norm) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) return d->status;
  return d->ops->grad_norm(d, norm);
}

int dp_step(dp_t *dp, double lr, double grad_scale) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) return d->status;
  return d->ops->step(d, lr, grad_scale, NULL);
}

int dp_clip_dev(dp_t *dp, double clip, double *norm, float *scale) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) return d->status;
  return d->ops->clip(d, clip, norm, scale);
}

adamw_step_t dp_next_step(dp_t *dp, double lr) { return optim_next(&dp_impl_of(dp)->opt, lr); }

int dp_step_dev(dp_t *dp, const adamw_step_t *st, const float *grad_scale) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) return d->status;
  d->step_dev = st;
  return d->ops->step(d, 0.0, 1.0, grad_scale); /* lr and the count come from *st */
}

/* ------------------------------------------------------------------ checkpoints */

/* The model's tensor table as an array (what ckpt wants), kept: chunks borrow its names until
 * the save has copied them. */
static model_tensor_t *ck_tensors(dp_impl_t *d, int *nt) {
  if (!d->ck_ts) {
    int n = model_num_tensors(d->m);
    if (!(d->ck_ts = malloc((size_t)n * sizeof *d->ck_ts))) return NULL;
    for (int i = 0; i < n; i++) d->ck_ts[i] = *model_tensor(d->m, i);
    d->ck_nt = n;
  }
  *nt = d->ck_nt;
  return d->ck_ts;
}

int dp_ckpt_to_host(dp_t *dp, ckpt_chunks_t *cs, float **host, char *err, size_t errlen) {
  dp_impl_t *d = dp_impl_of(dp);
  *host = NULL;
  if (drain(d)) {
    return err_set(err, errlen, d->status, "%s", d->err);
  }
  dp_ck_range_t *r = malloc(DP_CK_RANGES_MAX(d->n_units) * sizeof *r);
  int nt = 0;
  model_tensor_t *ts = ck_tensors(d, &nt);
  if (!r || !ts) goto nomem;
  int n = d->ops->ck_ranges(d, r);
  size_t total = 0;
  for (int i = 0; i < n; i++) total += r[i].save ? r[i].count : 0;
  float *h = *host = malloc((total ? total : 1) * sizeof(float));
  if (!h) goto nomem;
  const int tp_rank = dp_rank_of(d->tp_comm);
  for (int i = 0; i < n; i++) {
    if (!r[i].save) continue;
    d->be->to_host(d->be, h, r[i].dev, r[i].count * sizeof(float));
    if (ckpt_chunks_add_range(cs, r[i].kind, ts, nt, tp_rank, r[i].flat, r[i].count, h)) goto nomem;
    h += r[i].count;
  }
  free(r);
  return 0;
nomem:
  free(r);
  free(*host);
  *host = NULL;
  return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory copying the %s state for a checkpoint", d->pub.name);
}

int dp_ckpt_from_host(dp_t *dp, ckpt_t *ck, char *err, size_t errlen) {
  dp_impl_t *d = dp_impl_of(dp);
  if (drain(d)) {
    return err_set(err, errlen, d->status, "%s", d->err);
  }
  dp_ck_range_t *r = malloc(DP_CK_RANGES_MAX(d->n_units) * sizeof *r);
  int nt = 0, rc = 0;
  model_tensor_t *ts = ck_tensors(d, &nt);
  int n = r && ts ? d->ops->ck_ranges(d, r) : 0;
  size_t cmax = 0;
  for (int i = 0; i < n; i++) cmax = r[i].count > cmax ? r[i].count : cmax;
  float *h = malloc((cmax ? cmax : 1) * sizeof(float));
  if (!r || !ts || !h) {
    err_set(err, errlen, 0, "dp error: out of memory loading a checkpoint");
    rc = -4;
  }
  const int tp_rank = dp_rank_of(d->tp_comm);
  model_masters_changed(d->m); /* the model's flat masters among them: its bf16 copy is stale */
  for (int i = 0; i < n && rc == 0; i++) {
    rc = ckpt_read_range(ck, r[i].kind, ts, nt, tp_rank, r[i].flat, r[i].count, h, err, errlen);
    if (rc == 0) d->be->to_device(d->be, r[i].dev, h, r[i].count * sizeof(float));
  }
  if (d->ops->ck_loaded) {
    int lrc = d->ops->ck_loaded(d);
    if (lrc && rc == 0) {
      err_set(err, errlen, 0, "%s", d->err);
      rc = lrc;
    }
  }
  free(r);
  free(h);
  return rc;
}

int dp_optim_step(const dp_t *dp) { return ((const dp_impl_t *)dp->ctx)->opt.step; }
void dp_set_optim_step(dp_t *dp, int step) { dp_impl_of(dp)->opt.step = step; }

/* ------------------------------------------------------------------ reports */

void dp_memory(const dp_t *dp, dp_memory_t *out) {
  const dp_impl_t *d = dp->ctx;
  memset(out, 0, sizeof *out);
  d->ops->memory(d, out);
  if (d->rlp) out->work_bytes += d->rlp_n * dtype_size(d->rdt); /* reduce_dtype's wire copy */
}

void dp_traffic(const dp_t *dp, dp_traffic_t *out) { *out = ((const dp_impl_t *)dp->ctx)->traffic; }
int dp_status(const dp_t *dp) { return ((const dp_impl_t *)dp->ctx)->status; }
const char *dp_errmsg(const dp_t *dp) { return ((const dp_impl_t *)dp->ctx)->err; }
