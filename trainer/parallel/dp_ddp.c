/* dp_ddp: serial, DDP and ZeRO-1, the strategies on the model's whole flat buffers.
 *
 * Every rank keeps the model's flat parameter and gradient buffers whole. Serial installs no
 * hooks (the model runs with dp == NULL). DDP, after each unit's backward and on the last
 * micro-step of an accumulation only, all-reduces (avg) the unit's gradient slice over "dp"
 * (earlier micro-steps just accumulate locally: averaging a sum once is the same as summing
 * averages, and reducing on every micro-step would count the early ones twice), and the
 * optimizer updates the whole buffer. ZeRO-1 is DDP whose optimizer holds AdamW state for one
 * contiguous slice [r * chunk, (r + 1) * chunk) of the flat buffer on each dp rank r (the last
 * rank also the tail); after updating it, an in-place all-gather (plus a broadcast of the tail)
 * makes the parameters whole again (fp32: the masters stay whole on every rank; under bf16 the
 * model rounds its compute copy from them at the next forward, where serial and DDP have the
 * optimizer's pass write it). Gradients are reduced in reduce_dtype.
 *
 * Buckets (PyTorch DDP's bucket_cap_mb: parallel.bucket_mb): runs of whole units, contiguous in
 * the flat buffer, filled in backward order (the output unit first) until they reach the cap. A
 * bucket is all-reduced as soon as its lowest unit's backward is done; with overlap the
 * all-reduce runs while the backward goes on, and the step waits for all of them (the norm needs
 * every gradient). Without overlap the same buckets are reduced, blocking, at the same points,
 * so the sums, and the losses, are bit-identical either way. A unit larger than the cap is a
 * bucket of its own; units are the finest grain, since a unit's gradients are final only when
 * its whole backward is. */
#include <stdio.h>
#include <stdlib.h>

#include "common/err.h"
#include "trainer/parallel/dp_impl.h"

/* The model's flat buffers, the norm's parts (one per tensor), and the optimizer over
 * [opt_off, opt_off + opt_count): everything, or ZeRO-1's slice. */
static int flat_setup(dp_impl_t *d, const plan_t *p, int zero1, char *err, size_t errlen) {
  const int nt = model_num_tensors(d->m);
  d->params = model_params(d->m);
  d->grads = model_grads(d->m);
  if (!d->params || !d->grads) {
    return err_set(err, errlen, DP_EINVAL,
                   "dp error: the model has no flat buffers (created for FSDP?) but the mesh is not sharded");
  }
  model_tensor_t *tensors = malloc((size_t)nt * sizeof *tensors);
  d->parts = calloc((size_t)nt, sizeof *d->parts);
  if (!tensors || !d->parts) {
    free(tensors);
    return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory");
  }
  for (int i = 0; i < nt; i++) {
    tensors[i] = *model_tensor(d->m, i);
    dp_add_part(d, tensors[i].offset, tensors[i].numel, tensors[i].tp_split);
  }
  d->opt_off = 0;
  d->opt_count = d->num_params;
  if (zero1) {
    int n = comm_size(d->dp_comm), r = comm_rank(d->dp_comm);
    d->zero_chunk = d->num_params / (size_t)n;
    d->zero_tail = d->num_params - d->zero_chunk * (size_t)n;
    d->opt_off = (size_t)r * d->zero_chunk;
    d->opt_count = d->zero_chunk + (r == n - 1 ? d->zero_tail : 0);
  }
  int rc = optim_init(&d->opt, d->be, &p->train, tensors, nt, d->opt_off, d->opt_count, err, errlen);
  free(tensors);
  return rc;
}

/* Units grouped into buckets from the last unit down, each closed once it holds bucket_mb. */
static int make_buckets(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  const int U = d->n_units;
  d->blo = calloc((size_t)U, sizeof *d->blo);
  d->bhi = calloc((size_t)U, sizeof *d->bhi);
  d->bucket_of = calloc((size_t)U, sizeof *d->bucket_of);
  d->bops = calloc((size_t)U, sizeof *d->bops);
  if (!d->blo || !d->bhi || !d->bucket_of || !d->bops) {
    return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory");
  }
  const double cap = p->parallel.bucket_mb * 1048576.0;
  int contiguous = 1; /* the model lays units out in order; a bucket is one flat range only then */
  for (int u = 0; u + 1 < U; u++) contiguous &= d->uoff[u + 1] == d->uoff[u] + d->unumel[u];
  double bytes = 0;
  d->n_buckets = 0;
  for (int u = U - 1; u >= 0; u--) {
    if (bytes == 0) d->bhi[d->n_buckets] = u;
    bytes += (double)d->unumel[u] * sizeof(float);
    d->blo[d->n_buckets] = u;
    d->bucket_of[u] = d->n_buckets;
    if (bytes >= cap || u == 0 || !contiguous) {
      d->n_buckets++;
      bytes = 0;
    }
  }
  return 0;
}

static int ddp_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  int rc = flat_setup(d, p, 0, err, errlen);
  return rc ? rc : make_buckets(d, p, err, errlen);
}
static int zero1_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  int rc = flat_setup(d, p, 1, err, errlen);
  return rc ? rc : make_buckets(d, p, err, errlen);
}

static void bucket_range(const dp_impl_t *d, int b, size_t *off, size_t *n) {
  *off = d->uoff[d->blo[b]];
  *n = d->uoff[d->bhi[b]] + d->unumel[d->bhi[b]] - *off;
}

/* reduce_dtype bf16: the averaged bucket widened back from its wire copy. */
static int bucket_done(dp_impl_t *d, dp_op_t *op) {
  size_t off, n;
  bucket_range(d, (int)(op - d->bops), &off, &n);
  d->be->convert(d->be, d->grads + off, DT_F32, (char *)d->rlp + off * dtype_size(d->rdt), d->rdt, n);
  return 0;
}

static int ddp_reduce_grads(dp_t *dp, int u) {
  dp_impl_t *d = dp_impl_of(dp);
  if (!d->sync) return 0; /* no_sync: accumulate locally until the last micro-step */
  const int b = d->bucket_of[u];
  dp_before_reduce(d, u, d->grads + d->uoff[u]); /* in the bucket, its sum is not yet reduced */
  if (u != d->blo[b]) return 0; /* the bucket's lowest unit completes it */
  size_t off, n;
  bucket_range(d, b, &off, &n);
  char what[64];
  snprintf(what, sizeof what, "bucket %d gradients (units %d-%d)", b, d->blo[b], d->bhi[b]);
  dp_op_t *op = &d->bops[b];
  if (d->rdt == DT_F32) {
    op->then = NULL;
    return dp_start_all_reduce(d, op, d->dp_comm, d->grads + off, n, DT_F32, what);
  }
  void *lo = (char *)d->rlp + off * dtype_size(d->rdt);
  d->be->convert(d->be, lo, d->rdt, d->grads + off, DT_F32, n);
  op->then = bucket_done;
  return dp_start_all_reduce(d, op, d->dp_comm, lo, n, d->rdt, what);
}

static int ddp_drain(dp_impl_t *d) { return dp_ops_wait(d, d->bops, d->n_buckets); }

static int flat_init_params(dp_impl_t *d, uint64_t seed, double init_std) {
  model_init_random(d->m, seed, init_std); /* the same values on every rank: no broadcast */
  return 0;
}

static int flat_unit_noop(dp_impl_t *d, int u) { return 0; } /* the flat buffer is the unit */
static const float *flat_unit_params(dp_impl_t *d, int u) { return d->params + d->uoff[u]; }
static void flat_zero_grad(dp_impl_t *d) { model_zero_grad(d->m); }
static int flat_grad_norm(dp_impl_t *d, double *norm) { return dp_norm_of(d, d->grads, NULL, norm); }
static int flat_clip(dp_impl_t *d, double clip, double *norm, float *scale) {
  return dp_clip_of(d, d->grads, NULL, clip, norm, scale);
}

/* The whole flat buffer (opt_off 0): under bf16 the same pass rewrites the model's compute
 * copy, so the next forward needs no rounding of its own. */
static int ddp_step(dp_impl_t *d, double lr, double grad_scale, const float *scale_dev) {
  void *lp = model_compute_copy(d->m);
  dp_adamw(d, d->params + d->opt_off, d->grads + d->opt_off, lp, lr, grad_scale, scale_dev);
  if (lp) model_compute_written(d->m);
  return 0;
}

static int zero1_step(dp_impl_t *d, double lr, double grad_scale, const float *scale_dev) {
  dp_adamw(d, d->params + d->opt_off, d->grads + d->opt_off, NULL, lr, grad_scale, scale_dev);
  /* Every rank's slice into place (in place: rank r's input is already at r * chunk), then
   * the few elements past dp * chunk from the last rank, which updated them. */
  int n = comm_size(d->dp_comm);
  float *mine = d->params + (size_t)comm_rank(d->dp_comm) * d->zero_chunk;
  if (d->zero_chunk && dp_all_gather(d, d->dp_comm, mine, d->params, d->zero_chunk, DT_F32, "ZeRO-1 parameters"))
    return d->status;
  if (d->zero_tail && dp_broadcast(d, d->dp_comm, d->params + (size_t)n * d->zero_chunk, d->zero_tail, n - 1,
                                   "ZeRO-1 parameter tail"))
    return d->status;
  return 0;
}

/* dp rank 0 saves the parameters; the moments dp rank 0 (each_moments 0) or every rank its
 * slice (ZeRO-1). Serial is dp rank 0 of a group of one (or of no mesh). */
static int flat_ck_ranges(dp_impl_t *d, dp_ck_range_t *r, int each_moments) {
  int n = 0;
  const int dp0 = dp_rank_of(d->dp_comm) == 0;
  const int mv = dp0 || each_moments;
  r[n++] = (dp_ck_range_t){"param", 0, d->num_params, d->params, dp0};
  if (d->opt_count) {
    r[n++] = (dp_ck_range_t){"adam_m", d->opt_off, d->opt_count, d->opt.m, mv};
    r[n++] = (dp_ck_range_t){"adam_v", d->opt_off, d->opt_count, d->opt.v, mv};
  }
  return n;
}
static int ddp_ck_ranges(dp_impl_t *d, dp_ck_range_t *r) { return flat_ck_ranges(d, r, 0); }
static int zero1_ck_ranges(dp_impl_t *d, dp_ck_range_t *r) { return flat_ck_ranges(d, r, 1); }

static void flat_memory(const dp_impl_t *d, dp_memory_t *out) {
  out->param_bytes = d->num_params * sizeof(float);
  out->grad_bytes = d->num_params * sizeof(float);
  out->optim_bytes = 2 * d->opt.count * sizeof(float);
}

const dp_ops_t dp_serial_ops = {
    .name = "serial", .setup = ddp_setup, .init_params = flat_init_params,
    .unit_open = flat_unit_noop, .unit_commit = flat_unit_noop, .unit_params = flat_unit_params,
    .zero_grad = flat_zero_grad, .grad_norm = flat_grad_norm, .clip = flat_clip, .step = ddp_step,
    .ck_ranges = ddp_ck_ranges, .memory = flat_memory,
};

const dp_ops_t dp_ddp_ops = {
    .name = "ddp", .setup = ddp_setup, .reduce_grads = ddp_reduce_grads, .init_params = flat_init_params,
    .unit_open = flat_unit_noop, .unit_commit = flat_unit_noop, .unit_params = flat_unit_params,
    .zero_grad = flat_zero_grad, .grad_norm = flat_grad_norm, .clip = flat_clip, .step = ddp_step,
    .drain = ddp_drain, .ck_ranges = ddp_ck_ranges, .memory = flat_memory,
};

const dp_ops_t dp_zero1_ops = {
    .name = "ddp", .setup = zero1_setup, .reduce_grads = ddp_reduce_grads, .init_params = flat_init_params,
    .unit_open = flat_unit_noop, .unit_commit = flat_unit_noop, .unit_params = flat_unit_params,
    .zero_grad = flat_zero_grad, .grad_norm = flat_grad_norm, .clip = flat_clip, .step = zero1_step,
    .drain = ddp_drain, .ck_ranges = zero1_ck_ranges, .memory = flat_memory,
};
