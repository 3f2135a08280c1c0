/* dp: the data-parallel strategies of dp.h: serial, DDP (optionally ZeRO-1), FSDP and HSDP.
 *
 * DDP keeps the model's flat buffers whole on every rank. After each unit's backward, on the
 * last micro-step of an accumulation only, it all-reduces (avg) the unit's gradient slice over
 * "dp" (earlier micro-steps just accumulate locally: averaging a sum once is the same as
 * summing averages, and reducing on every micro-step would count the early ones twice).
 * The optimizer updates the whole buffer; under ZeRO-1 each dp rank holds AdamW state for one
 * contiguous slice [r * chunk, (r + 1) * chunk) of the flat buffer (the last rank also the
 * tail), updates it, and an in-place all-gather (plus a broadcast of the tail) makes the
 * parameters whole again.
 *
 * FSDP pads each unit's local numel n_u to P_u, a multiple of dp_shard S, and keeps shard s's
 * contiguous slice [s * c_u, (s + 1) * c_u), c_u = P_u / S, of every unit in one shard buffer
 * (and the same for gradients), so each collective is one call per unit:
 *   gather(u):        all_gather of the unit's shards into a gathered buffer (skipped when the
 *                     buffer still holds u since the last optimizer step), unit pointers set to it;
 *                     for the backward also a zeroed gradient buffer;
 *   reduce_grads(u):  reduce_scatter (avg) of the gradient buffer, added into the shard grads
 *                     (accumulating across micro-steps); HSDP then all-reduces (avg) the
 *                     unit's shard grads over dp_replicate, on the last micro-step.
 * Working memory: with reshard_after_forward one gathered buffer of the largest unit (units
 * take turns; the last unit of the forward is still there when the backward starts), else one
 * per unit (kept from forward to backward), plus one gradient buffer and a scatter scratch.
 * The optimizer runs on the shard buffer; padding stays zero (zero grads, no decay).
 *
 * The global gradient norm sums squares per tensor part, split in two: tensors split across
 * tp (summed over tp) and tensors replicated across tp (counted once); FSDP shards add up over
 * dp_shard. It does not overlap communication with compute (every collective is blocking), nor
 * prefetch the next unit, nor do ZeRO-2/3 for DDP. */
#include "trainer/dp.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/ckpt.h"
#include "trainer/comm.h"
#include "trainer/model.h"
#include "trainer/optim.h"

enum { DP_SERIAL = 0, DP_DDP, DP_FSDP, DP_HSDP };

/* A part of a tensor inside this rank's gradient storage, for the norm. */
typedef struct {
  size_t offset, numel; /* in floats, from the start of the storage */
  int tp_split;         /* MODEL_TP_* of the tensor */
} dp_part_t;

typedef struct {
  dp_t pub;
  model_t *m;
  backend_t *be;
  int kind, zero, reshard, sync, tp;
  comm_t *dp_comm, *shard_comm, *rep_comm, *tp_comm; /* device memory (the backend's) */
  comm_t *shard_hcomm, *tp_hcomm;                     /* host memory: the norm's shares */
  int n_units;
  size_t *uoff, *unumel; /* (n_units) the model's local layout */
  size_t num_params;

  /* serial / DDP: the model's flat buffers; ZeRO-1's slice */
  float *params, *grads;
  size_t opt_off, opt_count;      /* the optimizer's range of the flat buffer */
  size_t zero_chunk, zero_tail;   /* ZeRO-1: all-gathered slice and broadcast tail, floats */

  /* FSDP */
  int S, s;                  /* shard degree and this rank's shard */
  size_t *chunk, *soff;      /* (n_units) c_u and the unit's offset in the shard buffers */
  size_t shard_total;
  float *sparams, *sgrads;   /* (shard_total) */
  float *gbuf;               /* gathered parameters: one slot (reshard) or one per unit */
  size_t *goff;              /* (n_units) slot offset of each unit in gbuf */
  int *holder;               /* (n_units) unit held by the slot at goff[u], -1 none */
  size_t gbuf_floats, gmax;  /* gmax: the largest padded unit P_u */
  float *gradbuf, *rstmp;    /* (gmax) and (max c_u) */

  dp_part_t *parts;
  int n_parts;
  model_tensor_t *ck_ts; /* (ck_nt) copies of the model's tensors: checkpoint chunks name them */
  int ck_nt;
  optim_t opt;
  dp_traffic_t traffic;
  int status;
  char err[512];
} dp_impl_t;

static dp_impl_t *impl_of(dp_t *dp) { return (dp_impl_t *)dp->ctx; }

/* Records the first failure (the model only logs what hooks return). */
static int dp_fail(dp_impl_t *d, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int dp_fail(dp_impl_t *d, int code, const char *fmt, ...) {
  if (!d->status) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err, sizeof d->err, fmt, ap);
    va_end(ap);
    d->status = code ? code : -1;
  }
  return code ? code : -1;
}

static size_t sent_of(const comm_t *c) {
  comm_stats_t st;
  comm_get_stats(c, &st);
  return st.bytes_sent;
}

/* The collectives, each counted into traffic by operation and checked. */
static int c_all_reduce(dp_impl_t *d, comm_t *c, float *buf, size_t n, comm_op_t op, const char *what) {
  size_t before = sent_of(c);
  int rc = comm_all_reduce(c, buf, n, COMM_FLOAT32, op);
  d->traffic.all_reduce += sent_of(c) - before;
  return rc ? dp_fail(d, rc, "dp %s: all_reduce of %s failed: %s", d->pub.name, what, comm_errmsg(c)) : 0;
}
static int c_all_gather(dp_impl_t *d, comm_t *c, const float *in, float *out, size_t n, const char *what) {
  size_t before = sent_of(c);
  int rc = comm_all_gather(c, in, out, n, COMM_FLOAT32);
  d->traffic.all_gather += sent_of(c) - before;
  return rc ? dp_fail(d, rc, "dp %s: all_gather of %s failed: %s", d->pub.name, what, comm_errmsg(c)) : 0;
}
static int c_reduce_scatter(dp_impl_t *d, comm_t *c, const float *in, float *out, size_t n, const char *what) {
  size_t before = sent_of(c);
  int rc = comm_reduce_scatter(c, in, out, n, COMM_FLOAT32, COMM_AVG);
  d->traffic.reduce_scatter += sent_of(c) - before;
  return rc ? dp_fail(d, rc, "dp %s: reduce_scatter of %s failed: %s", d->pub.name, what, comm_errmsg(c)) : 0;
}
static int c_broadcast(dp_impl_t *d, comm_t *c, float *buf, size_t n, int root, const char *what) {
  size_t before = sent_of(c);
  int rc = comm_broadcast(c, buf, n, COMM_FLOAT32, root);
  d->traffic.broadcast += sent_of(c) - before;
  return rc ? dp_fail(d, rc, "dp %s: broadcast of %s failed: %s", d->pub.name, what, comm_errmsg(c)) : 0;
}

/* ------------------------------------------------------------------ hooks: DDP */

static int ddp_reduce_grads(dp_t *dp, int u) {
  dp_impl_t *d = impl_of(dp);
  if (!d->sync) return 0; /* no_sync: accumulate locally until the last micro-step */
  char what[48];
  snprintf(what, sizeof what, "unit %d gradients", u);
  return c_all_reduce(d, d->dp_comm, d->grads + d->uoff[u], d->unumel[u], COMM_AVG, what);
}

/* ------------------------------------------------------------------ hooks: FSDP / HSDP */

static int fsdp_gather(dp_t *dp, int u, int for_backward) {
  dp_impl_t *d = impl_of(dp);
  float *buf = d->gbuf + d->goff[u];
  /* holder is indexed by the slot's first unit: with one shared slot, every unit maps to
   * slot 0's holder (goff[u] == 0), else each unit has its own. */
  int slot = d->reshard ? 0 : u;
  if (d->holder[slot] != u) {
    char what[48];
    snprintf(what, sizeof what, "unit %d parameters", u);
    d->holder[slot] = -1;
    if (c_all_gather(d, d->shard_comm, d->sparams + d->soff[u], buf, d->chunk[u], what)) return d->status;
    d->holder[slot] = u;
  }
  if (for_backward) d->be->zero(d->be, d->gradbuf, d->chunk[u] * (size_t)d->S * sizeof(float));
  model_set_unit_buffers(d->m, u, buf, d->gradbuf);
  return 0;
}

/* Nothing to free: the slot is reused by the next gather (reshard) or kept for the backward.
 * After the backward a per-unit slot still holds valid parameters until the optimizer step. */
static int fsdp_release(dp_t *dp, int u, int after_backward) { return 0; }

static int fsdp_reduce_grads(dp_t *dp, int u) {
  dp_impl_t *d = impl_of(dp);
  char what[48];
  snprintf(what, sizeof what, "unit %d gradients", u);
  if (c_reduce_scatter(d, d->shard_comm, d->gradbuf, d->rstmp, d->chunk[u], what)) return d->status;
  float *g = d->sgrads + d->soff[u];
  d->be->add(d->be, g, g, d->rstmp, d->chunk[u]);
  if (d->kind == DP_HSDP && d->sync) return c_all_reduce(d, d->rep_comm, g, d->chunk[u], COMM_AVG, what);
  return 0;
}

/* ------------------------------------------------------------------ create / destroy */

int dp_is_sharded(const mesh_t *mesh) { return mesh && mesh->dims[MESH_DP_SHARD] > 1; }

void dp_destroy(dp_t *dp) {
  if (!dp) return;
  dp_impl_t *d = impl_of(dp);
  if (d->m) model_set_dp(d->m, NULL);
  optim_free(&d->opt);
  if (d->be) {
    d->be->free(d->be, d->sparams);
    d->be->free(d->be, d->sgrads);
    d->be->free(d->be, d->gbuf);
    d->be->free(d->be, d->gradbuf);
    d->be->free(d->be, d->rstmp);
  }
  free(d->uoff);
  free(d->unumel);
  free(d->chunk);
  free(d->soff);
  free(d->goff);
  free(d->holder);
  free(d->parts);
  free(d->ck_ts);
  free(d);
}

/* parts has room for one entry per tensor: a tensor lies in one unit, and this rank's share
 * of a unit is one contiguous range, so a tensor meets it in one interval at most. */
static void add_part(dp_impl_t *d, size_t offset, size_t numel, int tp_split) {
  d->parts[d->n_parts++] = (dp_part_t){.offset = offset, .numel = numel, .tp_split = tp_split};
}

/* FSDP layout: chunks, shard offsets, gathered slots, and the optimizer's view of the shard
 * buffer as "tensors" (the parts of real tensors inside the shard, then the padding). */
static int fsdp_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  backend_t *be = d->be;
  const int U = d->n_units, nt = model_num_tensors(d->m);
  d->chunk = calloc((size_t)U, sizeof *d->chunk);
  d->soff = calloc((size_t)U, sizeof *d->soff);
  d->goff = calloc((size_t)U, sizeof *d->goff);
  d->holder = malloc((size_t)U * sizeof *d->holder);
  model_tensor_t *segs = calloc((size_t)(nt + U), sizeof *segs);
  d->parts = calloc((size_t)nt, sizeof *d->parts);
  if (!d->chunk || !d->soff || !d->goff || !d->holder || !segs || !d->parts) goto nomem;
  size_t cmax = 0;
  for (int u = 0; u < U; u++) {
    d->chunk[u] = (d->unumel[u] + (size_t)d->S - 1) / (size_t)d->S;
    d->soff[u] = d->shard_total;
    d->shard_total += d->chunk[u];
    size_t pu = d->chunk[u] * (size_t)d->S;
    if (pu > d->gmax) d->gmax = pu;
    if (d->chunk[u] > cmax) cmax = d->chunk[u];
    d->goff[u] = d->reshard ? 0 : d->gbuf_floats;
    if (!d->reshard) d->gbuf_floats += pu;
    d->holder[u] = -1;
  }
  if (d->reshard) d->gbuf_floats = d->gmax;

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
      add_part(d, sg->offset, sg->numel, t->tp_split);
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
  d->gbuf = be->alloc(be, d->gbuf_floats * sizeof(float));
  d->gradbuf = be->alloc(be, d->gmax * sizeof(float));
  d->rstmp = be->alloc(be, cmax * sizeof(float));
  if (!d->sparams || !d->sgrads || !d->gbuf || !d->gradbuf || !d->rstmp) goto nomem;
  int rc = optim_init(&d->opt, be, &p->train, segs, n_segs, 0, d->shard_total, err, errlen);
  free(segs);
  return rc;
nomem:
  free(segs);
  snprintf(err, errlen, "dp error: out of memory for FSDP shards (%zu floats per shard buffer)", d->shard_total);
  return -4;
}

static int ddp_setup(dp_impl_t *d, const plan_t *p, char *err, size_t errlen) {
  const int nt = model_num_tensors(d->m);
  d->params = model_params(d->m);
  d->grads = model_grads(d->m);
  if (!d->params || !d->grads) {
    snprintf(err, errlen, "dp error: the model has no flat buffers (created for FSDP?) but the mesh is not sharded");
    return -2;
  }
  model_tensor_t *tensors = malloc((size_t)nt * sizeof *tensors);
  d->parts = calloc((size_t)nt, sizeof *d->parts);
  if (!tensors || !d->parts) {
    free(tensors);
    snprintf(err, errlen, "dp error: out of memory");
    return -4;
  }
  for (int i = 0; i < nt; i++) {
    tensors[i] = *model_tensor(d->m, i);
    add_part(d, tensors[i].offset, tensors[i].numel, tensors[i].tp_split);
  }
  d->opt_off = 0;
  d->opt_count = d->num_params;
  if (d->kind == DP_DDP && d->zero) {
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

int dp_create(dp_t **out, model_t *m, backend_t *be, const mesh_t *mesh, const plan_t *p, char *err,
              size_t errlen) {
  *out = NULL;
  dp_impl_t *d = calloc(1, sizeof *d);
  if (!d) {
    snprintf(err, errlen, "dp error: out of memory");
    return -4;
  }
  d->pub.ctx = d;
  d->m = m;
  d->be = be;
  d->sync = 1;
  d->zero = p->parallel.zero;
  d->reshard = p->parallel.reshard_after_forward;
  d->n_units = model_num_units(m);
  d->num_params = model_num_params(m);
  d->uoff = calloc((size_t)d->n_units, sizeof *d->uoff);
  d->unumel = calloc((size_t)d->n_units, sizeof *d->unumel);
  if (!d->uoff || !d->unumel) {
    dp_destroy(&d->pub);
    snprintf(err, errlen, "dp error: out of memory");
    return -4;
  }
  for (int u = 0; u < d->n_units; u++) model_unit_range(m, u, &d->uoff[u], &d->unumel[u]);

  int R = mesh ? mesh->dims[MESH_DP_REPLICATE] : 1, S = mesh ? mesh->dims[MESH_DP_SHARD] : 1;
  d->kind = S > 1 ? (R > 1 ? DP_HSDP : DP_FSDP) : (R > 1 ? DP_DDP : DP_SERIAL);
  static const char *const names[] = {"serial", "ddp", "fsdp", "hsdp"};
  d->pub.name = names[d->kind];
  if (mesh) {
    d->dp_comm = mesh_comm(mesh, "dp");
    d->shard_comm = mesh_comm(mesh, "dp_shard");
    d->rep_comm = mesh_comm(mesh, "dp_replicate");
    d->tp_comm = mesh_comm(mesh, "tp");
    d->shard_hcomm = mesh_host_comm(mesh, "dp_shard");
    d->tp_hcomm = mesh_host_comm(mesh, "tp");
    d->tp = mesh->dims[MESH_TP];
    if (!d->dp_comm || !d->shard_comm || !d->rep_comm || !d->tp_comm || !d->shard_hcomm || !d->tp_hcomm) {
      dp_destroy(&d->pub);
      snprintf(err, errlen, "dp error: the mesh is not connected (call mesh_connect first)");
      return -2;
    }
  }
  d->S = S;
  d->s = mesh ? mesh->coord[MESH_DP_SHARD] : 0;

  int rc = d->kind >= DP_FSDP ? fsdp_setup(d, p, err, errlen) : ddp_setup(d, p, err, errlen);
  if (rc) {
    dp_destroy(&d->pub);
    return rc;
  }
  if (d->kind == DP_DDP) {
    d->pub.reduce_grads = ddp_reduce_grads;
  } else if (d->kind >= DP_FSDP) {
    d->pub.gather = fsdp_gather;
    d->pub.release = fsdp_release;
    d->pub.reduce_grads = fsdp_reduce_grads;
  }
  if (d->kind != DP_SERIAL) model_set_dp(m, &d->pub); /* serial: dp == NULL in the model */
  *out = &d->pub;
  return 0;
}

/* ------------------------------------------------------------------ parameters */

int dp_init_params(dp_t *dp, uint64_t seed, double init_std) {
  dp_impl_t *d = impl_of(dp);
  if (d->kind < DP_FSDP) {
    model_init_random(d->m, seed, init_std); /* the same values on every rank: no broadcast */
    return 0;
  }
  /* Each unit's initial values on the host (transient, one unit), then this rank's slice. */
  float *host = calloc(d->gmax, sizeof *host);
  if (!host) return dp_fail(d, -4, "dp error: out of memory initializing parameters");
  for (int u = 0; u < d->n_units; u++) {
    memset(host, 0, d->gmax * sizeof *host);
    model_init_unit_host(d->m, u, host, seed, init_std);
    d->be->to_device(d->be, d->sparams + d->soff[u], host + (size_t)d->s * d->chunk[u], d->chunk[u] * sizeof(float));
    d->holder[d->reshard ? 0 : u] = -1;
  }
  free(host);
  return 0;
}

int dp_unit_open(dp_t *dp, int u) {
  dp_impl_t *d = impl_of(dp);
  if (d->kind < DP_FSDP) return 0;
  return fsdp_gather(dp, u, 0);
}

int dp_unit_commit(dp_t *dp, int u) {
  dp_impl_t *d = impl_of(dp);
  if (d->kind < DP_FSDP) return 0;
  float *buf = d->gbuf + d->goff[u];
  d->be->copy(d->be, d->sparams + d->soff[u], buf + (size_t)d->s * d->chunk[u], d->chunk[u] * sizeof(float));
  return 0;
}

void dp_unit_to_host(dp_t *dp, int u, float *host) {
  dp_impl_t *d = impl_of(dp);
  const float *src = d->kind < DP_FSDP ? d->params + d->uoff[u] : d->gbuf + d->goff[u];
  d->be->to_host(d->be, host, src, d->unumel[u] * sizeof(float));
}

/* ------------------------------------------------------------------ step */

void dp_set_sync(dp_t *dp, int sync) { impl_of(dp)->sync = sync; }

void dp_zero_grad(dp_t *dp) {
  dp_impl_t *d = impl_of(dp);
  if (d->kind < DP_FSDP) model_zero_grad(d->m);
  else d->be->zero(d->be, d->sgrads, d->shard_total * sizeof(float));
}

int dp_grad_norm(dp_t *dp, double *norm) {
  dp_impl_t *d = impl_of(dp);
  const float *g = d->kind < DP_FSDP ? d->grads : d->sgrads;
  double split = 0, repl = 0;
  for (int i = 0; i < d->n_parts; i++) {
    double s = d->be->sumsq(d->be, g + d->parts[i].offset, d->parts[i].numel);
    if (d->tp > 1 && d->parts[i].tp_split == MODEL_TP_REPLICATED) repl += s;
    else split += s;
  }
  /* Shares travel as fp32 (the cpu comm's only dtype): 1e-7 relative on a clip scale. They are
   * host values, so they go through the groups' host communicators (the device ones themselves
   * when the comm backend is cpu). */
  float sums[2] = {(float)split, (float)repl};
  if (d->kind >= DP_FSDP && c_all_reduce(d, d->shard_hcomm, sums, 2, COMM_SUM, "gradient norm")) return d->status;
  if (d->tp > 1 && c_all_reduce(d, d->tp_hcomm, sums, 1, COMM_SUM, "gradient norm")) return d->status;
  *norm = d->kind >= DP_FSDP || d->tp > 1 ? sqrt((double)sums[0] + (double)sums[1]) : sqrt(split + repl);
  return 0;
}

int dp_step(dp_t *dp, double lr, double grad_scale) {
  dp_impl_t *d = impl_of(dp);
  if (d->kind >= DP_FSDP) {
    optim_step(&d->opt, d->sparams, d->sgrads, lr, grad_scale);
    for (int u = 0; u < d->n_units; u++) d->holder[u] = -1; /* gathered copies are stale */
    return 0;
  }
  optim_step(&d->opt, d->params + d->opt_off, d->grads + d->opt_off, lr, grad_scale);
  if (d->kind == DP_DDP && d->zero) {
    /* Every rank's slice into place (in place: rank r's input is already at r * chunk), then
     * the few elements past dp * chunk from the last rank, which updated them. */
    int n = comm_size(d->dp_comm);
    float *mine = d->params + (size_t)comm_rank(d->dp_comm) * d->zero_chunk;
    if (d->zero_chunk && c_all_gather(d, d->dp_comm, mine, d->params, d->zero_chunk, "ZeRO-1 parameters"))
      return d->status;
    if (d->zero_tail && c_broadcast(d, d->dp_comm, d->params + (size_t)n * d->zero_chunk, d->zero_tail, n - 1,
                                    "ZeRO-1 parameter tail"))
      return d->status;
  }
  return 0;
}

/* ------------------------------------------------------------------ checkpoints */

/* A contiguous range of the model's flat (tp-local) layout and where one kind of state for it
 * lives on the device. */
typedef struct {
  const char *kind;
  size_t flat, count;
  float *dev;
  int save; /* this rank saves it (no other rank saves the same values) */
} ck_range_t;

static int rank_of(comm_t *c) { return c ? comm_rank(c) : 0; }

/* The ranges of state this rank holds: at most 3 per unit (FSDP) or 3 (serial, DDP). */
static int ck_ranges(dp_impl_t *d, ck_range_t *r) {
  int n = 0;
  if (d->kind >= DP_FSDP) {
    const int save = rank_of(d->rep_comm) == 0; /* HSDP: replica 0's shards */
    for (int u = 0; u < d->n_units; u++) {
      size_t lo = (size_t)d->s * d->chunk[u];
      if (lo >= d->unumel[u]) continue; /* all padding */
      size_t cnt = d->unumel[u] - lo < d->chunk[u] ? d->unumel[u] - lo : d->chunk[u];
      size_t flat = d->uoff[u] + lo, at = d->soff[u];
      r[n++] = (ck_range_t){"param", flat, cnt, d->sparams + at, save};
      r[n++] = (ck_range_t){"adam_m", flat, cnt, d->opt.m + at, save};
      r[n++] = (ck_range_t){"adam_v", flat, cnt, d->opt.v + at, save};
    }
    return n;
  }
  const int dp0 = d->kind == DP_SERIAL || rank_of(d->dp_comm) == 0;
  const int mv = dp0 || (d->kind == DP_DDP && d->zero); /* ZeRO-1: each rank its slice */
  r[n++] = (ck_range_t){"param", 0, d->num_params, d->params, dp0};
  if (d->opt_count) {
    r[n++] = (ck_range_t){"adam_m", d->opt_off, d->opt_count, d->opt.m, mv};
    r[n++] = (ck_range_t){"adam_v", d->opt_off, d->opt_count, d->opt.v, mv};
  }
  return n;
}

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
  dp_impl_t *d = impl_of(dp);
  *host = NULL;
  ck_range_t *r = malloc((size_t)(3 * d->n_units + 3) * sizeof *r);
  int nt = 0;
  model_tensor_t *ts = ck_tensors(d, &nt);
  if (!r || !ts) goto nomem;
  int n = ck_ranges(d, r);
  size_t total = 0;
  for (int i = 0; i < n; i++) total += r[i].save ? r[i].count : 0;
  float *h = *host = malloc((total ? total : 1) * sizeof(float));
  if (!h) goto nomem;
  const int tp_rank = rank_of(d->tp_comm);
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
  snprintf(err, errlen, "dp error: out of memory copying the %s state for a checkpoint", d->pub.name);
  return -4;
}

int dp_ckpt_from_host(dp_t *dp, ckpt_t *ck, char *err, size_t errlen) {
  dp_impl_t *d = impl_of(dp);
  ck_range_t *r = malloc((size_t)(3 * d->n_units + 3) * sizeof *r);
  int nt = 0, rc = 0;
  model_tensor_t *ts = ck_tensors(d, &nt);
  int n = r && ts ? ck_ranges(d, r) : 0;
  size_t cmax = 0;
  for (int i = 0; i < n; i++) cmax = r[i].count > cmax ? r[i].count : cmax;
  float *h = malloc((cmax ? cmax : 1) * sizeof(float));
  if (!r || !ts || !h) {
    snprintf(err, errlen, "dp error: out of memory loading a checkpoint");
    rc = -4;
  }
  const int tp_rank = rank_of(d->tp_comm);
  for (int i = 0; i < n && rc == 0; i++) {
    rc = ckpt_read_range(ck, r[i].kind, ts, nt, tp_rank, r[i].flat, r[i].count, h, err, errlen);
    if (rc == 0) d->be->to_device(d->be, r[i].dev, h, r[i].count * sizeof(float));
  }
  if (d->kind >= DP_FSDP)
    for (int u = 0; u < d->n_units; u++) d->holder[u] = -1; /* gathered copies are stale */
  free(r);
  free(h);
  return rc;
}

int dp_optim_step(const dp_t *dp) { return ((const dp_impl_t *)dp->ctx)->opt.step; }
void dp_set_optim_step(dp_t *dp, int step) { impl_of(dp)->opt.step = step; }

/* ------------------------------------------------------------------ reports */

void dp_memory(const dp_t *dp, dp_memory_t *out) {
  const dp_impl_t *d = dp->ctx;
  memset(out, 0, sizeof *out);
  size_t f = sizeof(float);
  if (d->kind >= DP_FSDP) {
    out->param_bytes = d->shard_total * f;
    out->grad_bytes = d->shard_total * f;
    size_t cmax = 0;
    for (int u = 0; u < d->n_units; u++) cmax = d->chunk[u] > cmax ? d->chunk[u] : cmax;
    out->work_bytes = (d->gbuf_floats + d->gmax + cmax) * f;
  } else {
    out->param_bytes = d->num_params * f;
    out->grad_bytes = d->num_params * f;
  }
  out->optim_bytes = 2 * d->opt.count * f;
}

void dp_traffic(const dp_t *dp, dp_traffic_t *out) { *out = ((const dp_impl_t *)dp->ctx)->traffic; }
int dp_status(const dp_t *dp) { return ((const dp_impl_t *)dp->ctx)->status; }
const char *dp_errmsg(const dp_t *dp) { return ((const dp_impl_t *)dp->ctx)->err; }
