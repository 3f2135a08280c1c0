/* dp_fsdp: FSDP and HSDP, and the per-unit shard layout they share with ZeRO-2.
 *
 * The layout (dp_shard_setup) pads each unit's local numel n_u to P_u, a multiple of the shard
 * degree S, and keeps shard s's contiguous slice [s * c_u, (s + 1) * c_u), c_u = P_u / S, of
 * every unit in one shard buffer (and the same for gradients), so each collective is one call
 * per unit. The optimizer runs on the shard buffer; padding stays zero (zero grads, no decay).
 *
 * FSDP shards over dp_shard:
 *   gather(u):        all_gather of the unit's shards into a gathered slot (skipped when the
 *                     slot still holds u since the last optimizer step), unit pointers set to it;
 *                     for the backward also a zeroed gradient buffer;
 *   reduce_grads(u):  reduce_scatter (avg) of the gradient buffer, added into the shard grads
 *                     (accumulating across micro-steps); HSDP then all-reduces (avg) the
 *                     unit's shard grads over dp_replicate, on the last micro-step.
 * Working memory: with reshard_after_forward one gathered buffer of the largest unit (units
 * take turns; the last unit of the forward is still there when the backward starts), else one
 * per unit (kept from forward to backward), plus one gradient buffer and a scatter scratch.
 *
 * Mixed precision (param_dtype bf16, FSDP2's MixedPrecisionPolicy): the shards stay fp32
 * masters (sparams, what the optimizer updates and checkpoints save) and each has a bf16 copy
 * (sp_lp) that the fused AdamW rewrites in its pass (and a conversion after anything else
 * writes the shards: initialization, a checkpoint load, a commit). gather all-gathers the bf16
 * copies into bf16 slots (gbuf_lp), half the bytes of fp32, and hands them to the model as its
 * compute copy; the gradients stay fp32 (reduced in reduce_dtype). dp_unit_open, which must
 * give the exact fp32 values (weights export, import), all-gathers the fp32 shards into one
 * fp32 slot kept for it (gbuf). ZeRO-2 gathers fp32 (lp_gather 0: its replicated parameters
 * are fp32 masters; the model rounds its own compute copy).
 *
 * Overlap (parallel.overlap, the default): gather(u) waits for unit u's all-gather and starts the
 * next one of the pass (u + 1 forward, u - 1 backward), one unit ahead at most; with
 * reshard_after_forward the units then take two slots in turn (u % 2), so the one computing is
 * never the one being filled. reduce_grads(u) starts the reduce-scatter out of gradient buffer
 * u % 2 and returns; it completes (added into the shard grads, then HSDP's replicate all-reduce
 * started) when that buffer is needed again or at the drain before the norm. Every collective,
 * its data and its order are the same as without overlap: only the waits move. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "trainer/parallel/dp_impl.h"

/* ------------------------------------------------------------------ the shard layout */

/* Chunks, shard offsets, gathered slots, and the optimizer's view of the shard buffer as
 * "tensors" (the parts of real tensors inside the shard, then the padding). */
int dp_shard_setup(dp_impl_t *d, const plan_t *p, int nslots, int lp_gather, const char *what, char *err,
                   size_t errlen) {
  backend_t *be = d->be;
  const int U = d->n_units, nt = model_num_tensors(d->m);
  d->chunk = calloc((size_t)U, sizeof *d->chunk);
  d->soff = calloc((size_t)U, sizeof *d->soff);
  d->goff = calloc((size_t)U, sizeof *d->goff);
  d->holder = malloc((size_t)U * sizeof *d->holder);
  d->gops = calloc((size_t)U, sizeof *d->gops);
  d->rsops = calloc((size_t)d->ngrad, sizeof *d->rsops);
  d->arops = calloc((size_t)U, sizeof *d->arops);
  model_tensor_t *segs = calloc((size_t)(nt + U), sizeof *segs);
  d->parts = calloc((size_t)nt, sizeof *d->parts);
  if (!d->chunk || !d->soff || !d->goff || !d->holder || !d->gops || !d->rsops || !d->arops || !segs || !d->parts)
    goto nomem;
  d->nslots = nslots;
  size_t cmax = 0;
  for (int u = 0; u < U; u++) {
    d->chunk[u] = (d->unumel[u] + (size_t)d->S - 1) / (size_t)d->S;
    d->soff[u] = d->shard_total;
    d->shard_total += d->chunk[u];
    size_t pu = d->chunk[u] * (size_t)d->S;
    if (pu > d->gmax) d->gmax = pu;
    if (d->chunk[u] > cmax) cmax = d->chunk[u];
    d->goff[u] = d->gbuf_floats;
    if (!nslots) d->gbuf_floats += pu;
    d->holder[u] = -1;
  }
  d->cmax = cmax;
  if (nslots) { /* shared slots, taken in turn: unit u's is u % nslots */
    d->gbuf_floats = (size_t)nslots * d->gmax;
    for (int u = 0; u < U; u++) d->goff[u] = (size_t)(u % nslots) * d->gmax;
  }

  /* Segments in shard coordinates, unit by unit, tensors in layout order, then padding. */
  int n_segs = 0;
  for (int u = 0; u < U; u++) {
    size_t lo_u = (size_t)d->s * d->chunk[u], hi_u = lo_u + d->chunk[u], covered = 0;
    for (int i = 0; i < nt; i++) {
      const model_tensor_t *t = model_tensor(d->m, i);
      if (t->unit != u) continue;
      size_t lo = t->offset - d->uoff[u], hi = lo + t->numel;
      if (lo < lo_u) lo = lo_u;
      if (hi > hi_u) hi = hi_u;
      if (lo >= hi) continue;
      model_tensor_t *sg = &segs[n_segs++];
      *sg = *t;
      sg->offset = d->soff[u] + (lo - lo_u);
      sg->numel = hi - lo;
      dp_add_part(d, sg->offset, sg->numel, t->tp_split);
      covered += hi - lo;
    }
    if (covered < d->chunk[u]) { /* padding at the end of the unit's last shards */
      model_tensor_t *sg = &segs[n_segs++];
      memset(sg, 0, sizeof *sg);
      snprintf(sg->name, sizeof sg->name, "(padding of unit %d)", u);
      sg->unit = u;
      sg->offset = d->soff[u] + covered;
      sg->numel = d->chunk[u] - covered;
    }
  }

  d->sparams = be->alloc(be, d->shard_total * sizeof(float));
  d->sgrads = be->alloc(be, d->shard_total * sizeof(float));
  d->gbuf = be->alloc(be, (lp_gather ? d->gmax : d->gbuf_floats) * sizeof(float));
  d->gradbuf = be->alloc(be, (size_t)d->ngrad * d->gmax * sizeof(float));
  d->rstmp = be->alloc(be, (size_t)d->ngrad * cmax * sizeof(float));
  if (!d->sparams || !d->sgrads || !d->gbuf || !d->gradbuf || !d->rstmp) goto nomem;
  if (lp_gather) {
    d->sp_lp = be->alloc(be, d->shard_total * dtype_size(d->pdt));
    d->gbuf_lp = be->alloc(be, d->gbuf_floats * dtype_size(d->pdt));
    if (!d->sp_lp || !d->gbuf_lp) goto nomem;
  }
  int rc = optim_init(&d->opt, be, &p->train, segs, n_segs, 0, d->shard_total, err, errlen);
  free(segs);
  return rc;
nomem:
  free(segs);
  return err_set(err, errlen, DP_ENOMEM, "dp error: out of memory for %s shards (%zu floats per shard buffer)",
                 what, d->shard_total);
}

/* ---- gradients: reduce-scatter out of the unit's gradient buffer, then (HSDP) all-reduce */

static void *lp_at(dp_impl_t *d, size_t elems) { return (char *)d->rlp + elems * dtype_size(d->rdt); }

float *dp_shard_gradbuf(dp_impl_t *d, int u, int zero_grads) {
  const int b = u % d->ngrad;
  float *g = d->gradbuf + (size_t)b * d->gmax;
  if (zero_grads) {
    dp_op_wait(d, &d->rsops[b]); /* the reduce-scatter that last read it (a failure is kept) */
    d->be->zero(d->be, g, d->chunk[u] * (size_t)d->S * sizeof(float));
  }
  return g;
}

/* reduce_dtype bf16: the all-reduced shard grads, widened back from their wire copy. */
static int ar_done(dp_impl_t *d, dp_op_t *op) {
  const int u = (int)(op - d->arops);
  d->be->convert(d->be, d->sgrads + d->soff[u], DT_F32, lp_at(d, (size_t)d->ngrad * d->rs_lp_n + d->soff[u]), d->rdt,
                 d->chunk[u]);
  return 0;
}

/* The reduce-scatter of unit u is done: its shard (widened from bf16) added into the accumulated
 * shard grads, then HSDP's replicate all-reduce of them on the last micro-step. */
static int rs_done(dp_impl_t *d, dp_op_t *op) {
  const int u = op->unit, b = u % d->ngrad;
  float *out = d->rstmp + (size_t)b * d->cmax, *g = d->sgrads + d->soff[u];
  if (d->rdt != DT_F32)
    d->be->convert(d->be, out, DT_F32, lp_at(d, (size_t)b * d->rs_lp_n + d->chunk[u] * (size_t)d->S), d->rdt,
                   d->chunk[u]);
  d->be->add(d->be, g, g, out, d->chunk[u], DT_F32);
  if (!d->rep_reduce || !op->sync) return 0;
  dp_op_t *ar = &d->arops[u];
  char what[48];
  snprintf(what, sizeof what, "unit %d gradients", u);
  if (d->rdt == DT_F32) {
    ar->then = NULL;
    return dp_start_all_reduce(d, ar, d->rep_comm, g, d->chunk[u], DT_F32, what);
  }
  void *lo = lp_at(d, (size_t)d->ngrad * d->rs_lp_n + d->soff[u]);
  d->be->convert(d->be, lo, d->rdt, g, DT_F32, d->chunk[u]);
  ar->then = ar_done;
  return dp_start_all_reduce(d, ar, d->rep_comm, lo, d->chunk[u], d->rdt, what);
}

int dp_shard_reduce(dp_impl_t *d, int u) {
  const int b = u % d->ngrad;
  dp_op_t *op = &d->rsops[b];
  if (dp_op_wait(d, op)) return d->status; /* idle already: the gather of u waited for it */
  char what[48];
  snprintf(what, sizeof what, "unit %d gradients", u);
  op->unit = u;
  op->sync = d->sync;
  op->then = rs_done;
  float *g = dp_shard_gradbuf(d, u, 0);
  dp_before_reduce(d, u, g);
  if (d->rdt == DT_F32)
    return dp_start_reduce_scatter(d, op, d->shard_comm, g, d->rstmp + (size_t)b * d->cmax, d->chunk[u], DT_F32, what);
  const size_t all = d->chunk[u] * (size_t)d->S;
  void *lo = lp_at(d, (size_t)b * d->rs_lp_n);
  d->be->convert(d->be, lo, d->rdt, g, DT_F32, all);
  return dp_start_reduce_scatter(d, op, d->shard_comm, lo, lp_at(d, (size_t)b * d->rs_lp_n + all), d->chunk[u],
                                 d->rdt, what);
}

/* Gathers first (nothing completes into them), then the reduce-scatters, whose completion may
 * start all-reduces, then those. */
int dp_shard_drain(dp_impl_t *d) {
  int rc = dp_ops_wait(d, d->gops, d->n_units);
  int r2 = dp_ops_wait(d, d->rsops, d->ngrad);
  int r3 = dp_ops_wait(d, d->arops, d->n_units);
  return rc ? rc : r2 ? r2 : r3;
}

int dp_shard_ck_ranges(dp_impl_t *d, dp_ck_range_t *r, int save_params, int save_moments) {
  int n = 0;
  for (int u = 0; u < d->n_units; u++) {
    size_t lo = (size_t)d->s * d->chunk[u];
    if (lo >= d->unumel[u]) continue; /* all padding */
    size_t cnt = d->unumel[u] - lo < d->chunk[u] ? d->unumel[u] - lo : d->chunk[u];
    size_t flat = d->uoff[u] + lo, at = d->soff[u];
    r[n++] = (dp_ck_range_t){"param", flat, cnt, d->sparams + at, save_params};
    r[n++] = (dp_ck_range_t){"adam_m", flat, cnt, d->opt.m + at, save_moments};
    r[n++] = (dp_ck_range_t){"adam_v", flat, cnt, d->opt.v + at, save_moments};
  }
  return n;
}

/* The gathered slot unit u uses (holder and gops are indexed by it). */
static int slot_of(const dp_impl_t *d, int u) { return d->nslots ? u % d->nslots : u; }

/* Where unit u's gathered compute parameters live: its bf16 slot (bf16 gathers) or fp32 one. */
static char *slot_buf(const dp_impl_t *d, int u) {
  return d->sp_lp ? (char *)d->gbuf_lp + d->goff[u] * dtype_size(d->pdt) : (char *)(d->gbuf + d->goff[u]);
}

/* The fp32 slot that dp_unit_open fills for unit u: its gathered slot, or with bf16 gathers the
 * one fp32 slot kept for opening. */
static float *open_slot(dp_impl_t *d, int u) { return d->sp_lp ? d->gbuf : d->gbuf + d->goff[u]; }

/* bf16 gathers: the bf16 copy of shard range [off, off + n) from the fp32 shard. */
static void shard_to_lp(dp_impl_t *d, size_t off, size_t n) {
  if (d->sp_lp)
    d->be->convert(d->be, (char *)d->sp_lp + off * dtype_size(d->pdt), d->pdt, d->sparams + off, DT_F32, n);
}

int dp_shard_unit_commit(dp_impl_t *d, int u) {
  float *buf = open_slot(d, u);
  d->be->copy(d->be, d->sparams + d->soff[u], buf + (size_t)d->s * d->chunk[u], d->chunk[u] * sizeof(float));
  shard_to_lp(d, d->soff[u], d->chunk[u]);
  if (d->sp_lp) d->holder[slot_of(d, u)] = -1; /* the bf16 slot no longer matches */
  return 0;
}

const float *dp_shard_unit_params(dp_impl_t *d, int u) { return open_slot(d, u); }

void dp_shard_zero_grad(dp_impl_t *d) { d->be->zero(d->be, d->sgrads, d->shard_total * sizeof(float)); }

/* ------------------------------------------------------------------ FSDP / HSDP */

/* With reshard_after_forward the units share slots: one, or two with overlap (the next unit is
 * gathered into one while the current one computes from the other); without it one per unit. */
static int fsdp_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  return dp_shard_setup(d, p, d->reshard ? (d->overlap ? 2 : 1) : 0, d->pdt != DT_F32, "FSDP", err, errlen);
}
static int hsdp_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  d->rep_reduce = 1;
  return fsdp_setup(d, p, err, errlen);
}

/* Starts the all_gather of unit u's shards into its slot, unless the slot holds u already (or
 * is being filled with it): the bf16 copies (bf16 gathers) or the fp32 shards. */
static int start_gather(dp_impl_t *d, int u) {
  const int slot = slot_of(d, u), lp = d->sp_lp != NULL;
  if (d->holder[slot] == u) return 0;
  if (dp_op_wait(d, &d->gops[slot])) return d->status; /* another unit's gather into the slot */
  const size_t es = lp ? dtype_size(d->pdt) : sizeof(float);
  char *buf = slot_buf(d, u);
  const void *shard = lp ? (char *)d->sp_lp + d->soff[u] * es : (char *)(d->sparams + d->soff[u]);
  char what[48];
  snprintf(what, sizeof what, "unit %d parameters", u);
  d->holder[slot] = -1;
  if (dp_start_all_gather(d, &d->gops[slot], d->shard_comm, shard, buf, d->chunk[u], lp ? d->pdt : DT_F32, what))
    return d->status;
  d->holder[slot] = u;
  return 0;
}

/* Unit u's parameters for compute, waited for; with overlap the next unit in this pass (u + 1
 * forward, u - 1 backward) is started at once, so it travels while u computes. */
static int gather_unit(dp_impl_t *d, int u, int for_backward, int prefetch) {
  const int lp = d->sp_lp != NULL;
  if (start_gather(d, u) || dp_op_wait(d, &d->gops[slot_of(d, u)])) return d->status;
  const int next = for_backward ? u - 1 : u + 1;
  if (prefetch && d->overlap && next >= 0 && next < d->n_units && start_gather(d, next)) return d->status;
  char *buf = slot_buf(d, u);
  float *g = dp_shard_gradbuf(d, u, for_backward);
  if (d->status) return d->status;
  model_set_unit_buffers(d->m, u, lp ? NULL : (float *)buf, g);
  if (lp) model_set_unit_compute(d->m, u, buf);
  return 0;
}

static int fsdp_gather(dp_t *dp, int u, int for_backward) { return gather_unit(dp_impl_of(dp), u, for_backward, 1); }

/* The exact fp32 values of unit u in an fp32 slot (with fp32 gathers, the gather itself). */
static int fsdp_unit_open(dp_impl_t *d, int u) {
  if (!d->sp_lp) return gather_unit(d, u, 0, 0);
  char what[48];
  snprintf(what, sizeof what, "unit %d fp32 parameters", u);
  if (dp_all_gather(d, d->shard_comm, d->sparams + d->soff[u], d->gbuf, d->chunk[u], DT_F32, what)) return d->status;
  model_set_unit_buffers(d->m, u, d->gbuf, NULL);
  return 0;
}

/* Nothing to free: the slot is reused by the next gather (reshard) or kept for the backward.
 * After the backward a per-unit slot still holds valid parameters until the optimizer step. */
static int fsdp_release(dp_t *dp, int u, int after_backward) { return 0; }

static int fsdp_reduce_grads(dp_t *dp, int u) { return dp_shard_reduce(dp_impl_of(dp), u); }

static void fsdp_stale(dp_impl_t *d) {
  for (int u = 0; u < d->n_units; u++) d->holder[u] = -1; /* gathered copies are stale */
}

/* Each unit's initial values on the host (transient, one unit), then this rank's slice (and
 * with replicate the whole padded unit into its slot). The same values on every rank. */
int dp_shard_init(dp_impl_t *d, uint64_t seed, double init_std, int replicate) {
  float *host = calloc(d->gmax, sizeof *host);
  if (!host) return dp_fail(d, DP_ENOMEM, "dp error: out of memory initializing parameters");
  for (int u = 0; u < d->n_units; u++) {
    memset(host, 0, d->gmax * sizeof *host);
    model_init_unit_host(d->m, u, host, seed, init_std);
    if (replicate) d->be->to_device(d->be, d->gbuf + d->goff[u], host, d->chunk[u] * (size_t)d->S * sizeof(float));
    d->be->to_device(d->be, d->sparams + d->soff[u], host + (size_t)d->s * d->chunk[u], d->chunk[u] * sizeof(float));
    d->holder[slot_of(d, u)] = -1;
  }
  free(host);
  shard_to_lp(d, 0, d->shard_total);
  return 0;
}

static int fsdp_init_params(dp_impl_t *d, uint64_t seed, double init_std) { return dp_shard_init(d, seed, init_std, 0); }



static int fsdp_grad_norm(dp_impl_t *d, double *norm) { return dp_norm_of(d, d->sgrads, d->shard_hcomm, norm); }
static int fsdp_clip(dp_impl_t *d, double clip, double *norm, float *scale) {
  return dp_clip_of(d, d->sgrads, d->shard_comm, clip, norm, scale);
}

static int fsdp_step(dp_impl_t *d, double lr, double grad_scale, const float *scale_dev) {
  dp_adamw(d, d->sparams, d->sgrads, d->sp_lp, lr, grad_scale, scale_dev); /* and the bf16 copies, fused */
  fsdp_stale(d);
  return 0;
}

/* Each shard once: HSDP's replica 0 saves (FSDP has one replica). */
static int fsdp_ck_ranges(dp_impl_t *d, dp_ck_range_t *r) {
  const int save = dp_rank_of(d->rep_comm) == 0;
  return dp_shard_ck_ranges(d, r, save, save);
}

static int fsdp_ck_loaded(dp_impl_t *d) {
  shard_to_lp(d, 0, d->shard_total);
  fsdp_stale(d);
  return 0;
}

static void fsdp_memory(const dp_impl_t *d, dp_memory_t *out) {
  const size_t f = sizeof(float);
  const size_t lpe = d->sp_lp ? dtype_size(d->pdt) : 0; /* bytes of a bf16 copy's element */
  out->param_bytes = d->shard_total * (f + lpe);
  out->grad_bytes = d->shard_total * f;
  /* gathered slots (bf16 ones plus the fp32 open slot, or fp32 ones), gradients, scratch */
  size_t slots = d->sp_lp ? d->gbuf_floats * lpe + d->gmax * f : d->gbuf_floats * f;
  out->work_bytes = slots + (size_t)d->ngrad * (d->gmax + d->cmax) * f;
  out->optim_bytes = 2 * d->opt.count * f;
}

const dp_ops_t dp_fsdp_ops = {
    .name = "fsdp", .setup = fsdp_setup, .gather = fsdp_gather, .release = fsdp_release,
    .reduce_grads = fsdp_reduce_grads, .init_params = fsdp_init_params, .unit_open = fsdp_unit_open,
    .unit_commit = dp_shard_unit_commit, .unit_params = dp_shard_unit_params, .zero_grad = dp_shard_zero_grad,
    .grad_norm = fsdp_grad_norm, .clip = fsdp_clip, .step = fsdp_step, .drain = dp_shard_drain,
    .ck_ranges = fsdp_ck_ranges,
    .ck_loaded = fsdp_ck_loaded, .memory = fsdp_memory,
};

const dp_ops_t dp_hsdp_ops = {
    .name = "hsdp", .setup = hsdp_setup, .gather = fsdp_gather, .release = fsdp_release,
    .reduce_grads = fsdp_reduce_grads, .init_params = fsdp_init_params, .unit_open = fsdp_unit_open,
    .unit_commit = dp_shard_unit_commit, .unit_params = dp_shard_unit_params, .zero_grad = dp_shard_zero_grad,
    .grad_norm = fsdp_grad_norm, .clip = fsdp_clip, .step = fsdp_step, .drain = dp_shard_drain,
    .ck_ranges = fsdp_ck_ranges,
    .ck_loaded = fsdp_ck_loaded, .memory = fsdp_memory,
};
