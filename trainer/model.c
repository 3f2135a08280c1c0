/* model: the Llama transformer of model.h, forward and backward over backend.h kernels.
 *
 * Parameters and gradients are two flat buffers of the same layout; tensors are carved in
 * sharding-unit order (unit 0 tok_embeddings; unit 1+l the tensors of layer l; unit L+1 norm
 * and output), so each unit is one contiguous slice. Every tensor is reached through its unit's
 * current base pointer, which dp's gather may redirect (model_set_unit_buffers) between calls.
 *
 * Activations live in one arena sized for (max_b, max_t) at creation: per layer what the
 * backward needs (block input, normed inputs, rstd, q/k after RoPE, v, attention output and
 * its lse, the mid residual, SwiGLU inputs and output), then the final norm, logits and
 * backward scratch. No kernel call allocates.
 *
 * Tensor parallelism: the API (model_opts_t.tp, tp_split/full_shape, export/import of full
 * tensors, per-unit host init of local slices) is in place, and sizes are already split: the
 * tp degree divides heads, kv heads and the feed-forward width (colwise wq/wk/wv/w1/w3 and
 * vocab-parallel embedding/output split rows; rowwise wo/w2 split columns). The collectives
 * in forward/backward are not written yet, so a tp group of more than one rank is refused at
 * creation; rowwise outputs are where the all-reduce (or reduce-scatter) will go.
 *
 * FSDP (model_opts_t.no_flat_buffers): no flat buffers; every unit must be pointed at full
 * buffers by the strategy's gather before use, which forward/backward check. Residual
 * gradients flow through the backward by accumulation: the backward kernels add into the one
 * residual-gradient buffer, so the skip connections cost nothing.
 *
 * It does not own the optimizer (trainer/optim) nor the data-parallel strategy (trainer/dp). */
#include "trainer/model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "trainer/comm.h"
#include "trainer/rng.h"

/* Indices into model_t.tensors of one layer's parameters. */
typedef struct {
  int attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
} layer_tensors_t;

/* One layer's saved activations, slots sized for N = max_b * max_t rows. */
typedef struct {
  float *x;        /* (N, C) block input (the residual stream) */
  float *xn_att;   /* (N, C) attention_norm(x) */
  float *rstd_att; /* (N) */
  float *q;        /* (N, Hl*D) = (B, T, Hl, D), after RoPE */
  float *k;        /* (N, KVl*D) after RoPE */
  float *v;        /* (N, KVl*D) */
  float *att;      /* (N, Hl*D) attention output, before wo */
  float *lse;      /* (B, Hl, T) softmax log-sum-exp */
  float *x_mid;    /* (N, C) x + attention */
  float *xn_ffn;   /* (N, C) ffn_norm(x_mid) */
  float *rstd_ffn; /* (N) */
  float *a;        /* (N, Fl) xn_ffn w1^T */
  float *g;        /* (N, Fl) xn_ffn w3^T */
  float *h;        /* (N, Fl) silu(a) * g */
} layer_acts_t;

struct model {
  backend_t *be;
  dp_t *dp;
  /* config */
  int C, L, H, KV, D, F, V, max_seq_len;
  float eps, theta;
  /* tensor parallel split (tp = 1 for now): local heads, kv heads, ffn width */
  int tp, tp_rank, Hl, KVl, Fl, Vl;
  int no_flat; /* FSDP: params/grads NULL, units point at the strategy's buffers */
  int max_b, max_t;

  /* parameters */
  int n_tensors;
  model_tensor_t *tensors;
  layer_tensors_t *layer; /* (L) */
  int tok_embeddings, norm, output;
  size_t num_params;
  float *params, *grads; /* (num_params) device */
  int n_units;
  size_t *unit_offset, *unit_numel;  /* (n_units) */
  float **unit_params, **unit_grads; /* current base of each unit */

  /* activations */
  float *arena;
  layer_acts_t *acts;                /* (L) */
  float *x_final;                    /* (N, C) output of the last block */
  float *xn_final;                   /* (N, C) */
  float *rstd_final;                 /* (N) */
  float *logits;                     /* (N, V); after model_backward it holds dlogits */
  float *losses;                     /* (N) */
  int32_t *tokens_dev, *targets_dev; /* (N) */
  /* backward scratch */
  float *dres;         /* (N, C) gradient of the residual stream */
  float *dxn;          /* (N, C) gradient of a norm's output */
  float *datt;         /* (N, Hl*D) */
  float *dq;           /* (N, Hl*D) */
  float *dk, *dv;      /* (N, KVl*D) */
  float *dh, *da, *dg; /* (N, Fl) */

  /* state of the last forward */
  float *host_losses; /* (N) host */
  int last_b, last_t, last_has_targets, last_ok;
  int n_valid;
};

/* ------------------------------------------------------------------ tensor access */

static float *param_of(model_t *m, int ti) {
  const model_tensor_t *t = &m->tensors[ti];
  return m->unit_params[t->unit] + (t->offset - m->unit_offset[t->unit]);
}
static float *grad_of(model_t *m, int ti) {
  const model_tensor_t *t = &m->tensors[ti];
  return m->unit_grads[t->unit] + (t->offset - m->unit_offset[t->unit]);
}

/* rows x cols is this rank's local shape; split says how it relates to the full tensor. */
static int add_tensor(model_t *m, const char *name, int unit, int rows, int cols, int ndim, int decay, int split) {
  int i = m->n_tensors++;
  model_tensor_t *t = &m->tensors[i];
  if (m->tp == 1) split = MODEL_TP_REPLICATED;
  t->tp_split = split;
  t->full_shape[0] = split == MODEL_TP_ROWS ? rows * m->tp : rows;
  t->full_shape[1] = split == MODEL_TP_COLS ? cols * m->tp : cols;
  snprintf(t->name, sizeof t->name, "%s", name);
  t->unit = unit;
  t->offset = m->num_params;
  t->numel = (size_t)rows * (size_t)cols;
  t->ndim = ndim;
  t->shape[0] = rows;
  t->shape[1] = cols;
  t->decay = decay;
  m->num_params += t->numel;
  return i;
}

/* ------------------------------------------------------------------ dp hooks */

static int dp_gather(model_t *m, int u, int bwd) {
  int rc = 0;
  if (m->dp && m->dp->gather) {
    rc = m->dp->gather(m->dp, u, bwd);
    if (rc) log_error("model: dp %s gather of unit %d failed (%d)", m->dp->name, u, rc);
  }
  if (!rc && (!m->unit_params[u] || (bwd && !m->unit_grads[u]))) {
    log_error("model: unit %d has no %s buffer (no_flat_buffers: the strategy's gather must provide it)", u,
              m->unit_params[u] ? "gradient" : "parameter");
    rc = -1;
  }
  return rc;
}
static int dp_release(model_t *m, int u, int bwd) {
  if (!m->dp || !m->dp->release) return 0;
  int rc = m->dp->release(m->dp, u, bwd);
  if (rc) log_error("model: dp %s release of unit %d failed (%d)", m->dp->name, u, rc);
  return rc;
}
static int dp_reduce(model_t *m, int u) {
  if (!m->dp || !m->dp->reduce_grads) return 0;
  int rc = m->dp->reduce_grads(m->dp, u);
  if (rc) log_error("model: dp %s reduce_grads of unit %d failed (%d)", m->dp->name, u, rc);
  return rc;
}

/* ------------------------------------------------------------------ create / destroy */

static int fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...) {
  if (err && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return -1;
}

/* Carves n floats at the arena offset *off (64-byte aligned slots). With base NULL it only
 * counts, so that one function both sizes the arena and lays it out. */
static float *carve(float *base, size_t *off, size_t n) {
  float *p = base ? base + *off : NULL;
  *off += (n + 15) & ~(size_t)15;
  return p;
}

/* Lays the activations out from base (NULL: only counts); returns the floats needed. */
static size_t layout_acts(model_t *m, float *base) {
  size_t N = (size_t)m->max_b * m->max_t, C = m->C, HD = (size_t)m->Hl * m->D, KD = (size_t)m->KVl * m->D, F = m->Fl;
  size_t lse_n = (size_t)m->max_b * m->Hl * m->max_t, off = 0;
  for (int l = 0; l < m->L; l++) {
    layer_acts_t *a = &m->acts[l];
    a->x = carve(base, &off, N * C);
    a->xn_att = carve(base, &off, N * C);
    a->rstd_att = carve(base, &off, N);
    a->q = carve(base, &off, N * HD);
    a->k = carve(base, &off, N * KD);
    a->v = carve(base, &off, N * KD);
    a->att = carve(base, &off, N * HD);
    a->lse = carve(base, &off, lse_n);
    a->x_mid = carve(base, &off, N * C);
    a->xn_ffn = carve(base, &off, N * C);
    a->rstd_ffn = carve(base, &off, N);
    a->a = carve(base, &off, N * F);
    a->g = carve(base, &off, N * F);
    a->h = carve(base, &off, N * F);
  }
  m->x_final = carve(base, &off, N * C);
  m->xn_final = carve(base, &off, N * C);
  m->rstd_final = carve(base, &off, N);
  m->logits = carve(base, &off, N * m->Vl);
  m->losses = carve(base, &off, N);
  m->tokens_dev = (int32_t *)carve(base, &off, N); /* int32 ids in float-sized slots */
  m->targets_dev = (int32_t *)carve(base, &off, N);
  m->dres = carve(base, &off, N * C);
  m->dxn = carve(base, &off, N * C);
  m->datt = carve(base, &off, N * HD);
  m->dq = carve(base, &off, N * HD);
  m->dk = carve(base, &off, N * KD);
  m->dv = carve(base, &off, N * KD);
  m->dh = carve(base, &off, N * F);
  m->da = carve(base, &off, N * F);
  m->dg = carve(base, &off, N * F);
  return off;
}

void model_destroy(model_t *m) {
  if (!m) return;
  if (m->be) {
    m->be->free(m->be, m->params);
    m->be->free(m->be, m->grads);
    m->be->free(m->be, m->arena);
  }
  free(m->tensors);
  free(m->layer);
  free(m->unit_offset);
  free(m->unit_numel);
  free(m->unit_params);
  free(m->unit_grads);
  free(m->acts);
  free(m->host_losses);
  free(m);
}

int model_create(model_t **out, const plan_model_t *cfg, backend_t *be, int max_b, int max_t, int decay_norms,
                 int decay_embeddings, char *err, size_t errlen) {
  model_opts_t opts = {
      .max_b = max_b, .max_t = max_t, .decay_norms = decay_norms, .decay_embeddings = decay_embeddings};
  return model_create_opts(out, cfg, be, &opts, err, errlen);
}

int model_create_opts(model_t **out, const plan_model_t *cfg, backend_t *be, const model_opts_t *opts, char *err,
                      size_t errlen) {
  *out = NULL;
  if (!cfg || !be || !opts) return fail(err, errlen, "model error: no config, backend or options");
  int max_b = opts->max_b, max_t = opts->max_t;
  int tp = opts->tp && opts->tp->comm ? opts->tp->comm->size : 1;
  int tp_rank = opts->tp && opts->tp->comm ? opts->tp->comm->rank : 0;
  if (tp > 1)
    return fail(err, errlen,
                "model error: tensor parallelism (mesh.tp=%d) is not implemented in the model yet; use mesh.tp=1", tp);
  if (cfg->n_heads > 0 && (cfg->n_heads % tp || (cfg->n_kv_heads > 0 ? cfg->n_kv_heads : cfg->n_heads) % tp ||
                           cfg->hidden_dim % tp || cfg->vocab_size % tp))
    return fail(err, errlen,
                "model error: mesh.tp=%d must divide n_heads=%d, n_kv_heads=%d, hidden_dim=%d, vocab_size=%d", tp,
                cfg->n_heads, cfg->n_kv_heads, cfg->hidden_dim, cfg->vocab_size);
  if (cfg->dim <= 0 || cfg->n_layers <= 0 || cfg->n_heads <= 0 || cfg->vocab_size <= 0 || cfg->hidden_dim <= 0)
    return fail(err, errlen, "model error: dim=%d n_layers=%d n_heads=%d vocab_size=%d hidden_dim=%d must all be > 0",
                cfg->dim, cfg->n_layers, cfg->n_heads, cfg->vocab_size, cfg->hidden_dim);
  int kv = cfg->n_kv_heads > 0 ? cfg->n_kv_heads : cfg->n_heads;
  if (cfg->dim % cfg->n_heads != 0)
    return fail(err, errlen, "model error: n_heads=%d does not divide dim=%d", cfg->n_heads, cfg->dim);
  if (cfg->n_heads % kv != 0)
    return fail(err, errlen, "model error: n_kv_heads=%d does not divide n_heads=%d", kv, cfg->n_heads);
  if ((cfg->dim / cfg->n_heads) % 2 != 0)
    return fail(err, errlen, "model error: head dim %d (dim/n_heads) must be even for RoPE", cfg->dim / cfg->n_heads);
  if (max_b <= 0 || max_t <= 0)
    return fail(err, errlen, "model error: max batch %d x %d tokens must be > 0", max_b, max_t);
  if (cfg->max_seq_len > 0 && max_t > cfg->max_seq_len)
    return fail(err, errlen, "model error: sequence length %d exceeds model.max_seq_len=%d", max_t, cfg->max_seq_len);

  model_t *m = calloc(1, sizeof *m);
  if (!m) return fail(err, errlen, "model error: out of memory");
  m->be = be;
  m->C = cfg->dim;
  m->L = cfg->n_layers;
  m->H = cfg->n_heads;
  m->KV = kv;
  m->D = cfg->dim / cfg->n_heads;
  m->F = cfg->hidden_dim;
  m->V = cfg->vocab_size;
  m->max_seq_len = cfg->max_seq_len;
  m->eps = cfg->norm_eps > 0 ? (float)cfg->norm_eps : 1e-5f;
  m->theta = cfg->rope_theta > 0 ? (float)cfg->rope_theta : 10000.0f;
  m->tp = tp;
  m->tp_rank = tp_rank;
  m->Hl = m->H / m->tp;
  m->KVl = m->KV / m->tp;
  m->Fl = m->F / m->tp;
  m->Vl = m->V / m->tp;
  m->no_flat = opts->no_flat_buffers;
  m->max_b = max_b;
  m->max_t = max_t;

  int L = m->L, C = m->C, HD = m->Hl * m->D, KD = m->KVl * m->D, F = m->Fl;
  m->n_units = L + 2;
  m->tensors = calloc((size_t)(9 * L + 3), sizeof *m->tensors);
  m->layer = calloc((size_t)L, sizeof *m->layer);
  m->unit_offset = calloc((size_t)m->n_units, sizeof *m->unit_offset);
  m->unit_numel = calloc((size_t)m->n_units, sizeof *m->unit_numel);
  m->unit_params = calloc((size_t)m->n_units, sizeof *m->unit_params);
  m->unit_grads = calloc((size_t)m->n_units, sizeof *m->unit_grads);
  m->acts = calloc((size_t)L, sizeof *m->acts);
  m->host_losses = calloc((size_t)max_b * max_t, sizeof *m->host_losses);
  if (!m->tensors || !m->layer || !m->unit_offset || !m->unit_numel || !m->unit_params || !m->unit_grads || !m->acts ||
      !m->host_losses) {
    model_destroy(m);
    return fail(err, errlen, "model error: out of memory");
  }

  /* Tensors in unit order; within a layer, in Meta's order. */
  char name[96];
  m->tok_embeddings = add_tensor(m, "tok_embeddings.weight", 0, m->Vl, C, 2, opts->decay_embeddings, MODEL_TP_ROWS);
  for (int l = 0; l < L; l++) {
    int u = 1 + l;
    layer_tensors_t *lt = &m->layer[l];
#define LAYER_TENSOR(field, suffix, rows, cols, ndim, decay, split)                                                    \
  snprintf(name, sizeof name, "layers.%d.%s", l, suffix);                                                              \
  lt->field = add_tensor(m, name, u, rows, cols, ndim, decay, split)
    LAYER_TENSOR(attention_norm, "attention_norm.weight", C, 1, 1, opts->decay_norms, MODEL_TP_REPLICATED);
    LAYER_TENSOR(wq, "attention.wq.weight", HD, C, 2, 1, MODEL_TP_ROWS);
    LAYER_TENSOR(wk, "attention.wk.weight", KD, C, 2, 1, MODEL_TP_ROWS);
    LAYER_TENSOR(wv, "attention.wv.weight", KD, C, 2, 1, MODEL_TP_ROWS);
    LAYER_TENSOR(wo, "attention.wo.weight", C, HD, 2, 1, MODEL_TP_COLS);
    LAYER_TENSOR(ffn_norm, "ffn_norm.weight", C, 1, 1, opts->decay_norms, MODEL_TP_REPLICATED);
    LAYER_TENSOR(w1, "feed_forward.w1.weight", F, C, 2, 1, MODEL_TP_ROWS);
    LAYER_TENSOR(w2, "feed_forward.w2.weight", C, F, 2, 1, MODEL_TP_COLS);
    LAYER_TENSOR(w3, "feed_forward.w3.weight", F, C, 2, 1, MODEL_TP_ROWS);
#undef LAYER_TENSOR
  }
  m->norm = add_tensor(m, "norm.weight", L + 1, C, 1, 1, opts->decay_norms, MODEL_TP_REPLICATED);
  m->output = add_tensor(m, "output.weight", L + 1, m->Vl, C, 2, 1, MODEL_TP_ROWS);
  for (int u = 0; u < m->n_units; u++)
    m->unit_offset[u] = (size_t)-1;
  for (int i = 0; i < m->n_tensors; i++) {
    const model_tensor_t *t = &m->tensors[i];
    if (m->unit_offset[t->unit] == (size_t)-1) m->unit_offset[t->unit] = t->offset;
    m->unit_numel[t->unit] += t->numel;
  }

  if (!m->no_flat) {
    m->params = be->alloc(be, m->num_params * sizeof(float));
    m->grads = be->alloc(be, m->num_params * sizeof(float));
  }
  size_t an = layout_acts(m, NULL);
  m->arena = be->alloc(be, an * sizeof(float));
  if ((!m->no_flat && (!m->params || !m->grads)) || !m->arena) {
    size_t mb = ((m->no_flat ? 0 : 2 * m->num_params) + an) * sizeof(float) >> 20;
    model_destroy(m);
    return fail(err, errlen, "model error: cannot allocate %zu MiB for parameters, gradients and activations", mb);
  }
  layout_acts(m, m->arena);
  for (int u = 0; u < m->n_units; u++)
    model_set_unit_buffers(m, u, NULL, NULL);

  *out = m;
  return 0;
}

/* ------------------------------------------------------------------ parameters */

/* Full tensor t's initial values into full (full_shape floats): norms 1, others N(0, std)
 * from the tensor's own stream, residual projections scaled by depth. */
static void init_full_tensor(const model_t *m, const model_tensor_t *t, float *full, uint64_t seed, double init_std) {
  size_t n = (size_t)t->full_shape[0] * t->full_shape[1], len = strlen(t->name);
  if (len >= 11 && !strcmp(t->name + len - 11, "norm.weight")) {
    for (size_t j = 0; j < n; j++)
      full[j] = 1.0f;
    return;
  }
  int resid = strstr(t->name, "attention.wo.") || strstr(t->name, "feed_forward.w2.");
  double std = resid ? init_std / sqrt(2.0 * m->L) : init_std;
  rng_t r;
  rng_init(&r, seed, rng_hash_str(t->name));
  for (size_t j = 0; j < n; j++)
    full[j] = (float)(rng_normal(&r) * std);
}

/* This rank's slice of a full tensor (host to host), and back. */
static void slice_of(const model_t *m, const model_tensor_t *t, const float *full, float *local) {
  int rows = t->shape[0], cols = t->shape[1], fcols = t->full_shape[1];
  if (t->tp_split == MODEL_TP_REPLICATED)
    memcpy(local, full, t->numel * sizeof(float));
  else if (t->tp_split == MODEL_TP_ROWS)
    memcpy(local, full + (size_t)m->tp_rank * rows * cols, t->numel * sizeof(float));
  else
    for (int r = 0; r < rows; r++)
      memcpy(local + (size_t)r * cols, full + (size_t)r * fcols + (size_t)m->tp_rank * cols, cols * sizeof(float));
}

void model_init_unit_host(const model_t *m, int unit, float *host_out, uint64_t seed, double init_std) {
  size_t uoff = m->unit_offset[unit];
  float *full = NULL;
  for (int i = 0; i < m->n_tensors; i++) {
    const model_tensor_t *t = &m->tensors[i];
    if (t->unit != unit) continue;
    float *local = host_out + (t->offset - uoff);
    if (t->tp_split == MODEL_TP_REPLICATED) {
      init_full_tensor(m, t, local, seed, init_std);
      continue;
    }
    /* a split tensor: draw the whole stream, keep this rank's part (values never depend on tp) */
    float *tmp = realloc(full, (size_t)t->full_shape[0] * t->full_shape[1] * sizeof(float));
    if (!tmp) {
      log_error("model: out of memory initializing %s", t->name);
      break;
    }
    full = tmp;
    init_full_tensor(m, t, full, seed, init_std);
    slice_of(m, t, full, local);
  }
  free(full);
}

void model_init_random(model_t *m, uint64_t seed, double init_std) {
  size_t maxn = 0;
  for (int u = 0; u < m->n_units; u++)
    maxn = m->unit_numel[u] > maxn ? m->unit_numel[u] : maxn;
  float *host = malloc(maxn * sizeof *host);
  if (!host) {
    log_error("model: out of memory initializing parameters");
    return;
  }
  for (int u = 0; u < m->n_units; u++) {
    if (!m->unit_params[u]) { /* FSDP: the strategy initializes its shards (model_init_unit_host) */
      log_warn("model: model_init_random skips unit %d, which has no buffer (no_flat_buffers)", u);
      continue;
    }
    model_init_unit_host(m, u, host, seed, init_std);
    m->be->to_device(m->be, m->unit_params[u], host, m->unit_numel[u] * sizeof(float));
  }
  free(host);
}

int model_export_tensor(model_t *m, int i, float *host_full) {
  const model_tensor_t *t = &m->tensors[i];
  if (!m->unit_params[t->unit]) {
    log_error("model: export of %s: unit %d is not gathered", t->name, t->unit);
    return -1;
  }
  /* With tp > 1 this becomes an all_gather over the tp group (rows: concatenation; columns:
   * gather then interleave); creation refuses tp > 1 until the collectives are written. */
  m->be->to_host(m->be, host_full, param_of(m, i), t->numel * sizeof(float));
  return 0;
}

void model_import_tensor(model_t *m, int i, const float *host_full) {
  const model_tensor_t *t = &m->tensors[i];
  if (!m->unit_params[t->unit]) {
    log_error("model: import of %s: unit %d is not gathered", t->name, t->unit);
    return;
  }
  if (t->tp_split == MODEL_TP_REPLICATED) {
    m->be->to_device(m->be, param_of(m, i), host_full, t->numel * sizeof(float));
    return;
  }
  float *local = malloc(t->numel * sizeof *local);
  if (!local) {
    log_error("model: out of memory importing %s", t->name);
    return;
  }
  slice_of(m, t, host_full, local);
  m->be->to_device(m->be, param_of(m, i), local, t->numel * sizeof(float));
  free(local);
}

void model_set_dp(model_t *m, dp_t *dp) { m->dp = dp; }
size_t model_num_params(const model_t *m) { return m->num_params; }
float *model_params(model_t *m) { return m->params; }
float *model_grads(model_t *m) { return m->grads; }
int model_num_tensors(const model_t *m) { return m->n_tensors; }
const model_tensor_t *model_tensor(const model_t *m, int i) {
  return (i >= 0 && i < m->n_tensors) ? &m->tensors[i] : NULL;
}
const model_tensor_t *model_find_tensor(const model_t *m, const char *name) {
  for (int i = 0; i < m->n_tensors; i++)
    if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
  return NULL;
}
int model_num_units(const model_t *m) { return m->n_units; }
void model_unit_range(const model_t *m, int unit, size_t *offset, size_t *numel) {
  if (unit < 0 || unit >= m->n_units) {
    *offset = 0;
    *numel = 0;
    return;
  }
  *offset = m->unit_offset[unit];
  *numel = m->unit_numel[unit];
}
/* Without flat buffers (FSDP) NULL leaves the unit without parameters until the next gather. */
void model_set_unit_buffers(model_t *m, int unit, float *params, float *grads) {
  if (unit < 0 || unit >= m->n_units) return;
  m->unit_params[unit] = params ? params : m->params ? m->params + m->unit_offset[unit] : NULL;
  m->unit_grads[unit] = grads ? grads : m->grads ? m->grads + m->unit_offset[unit] : NULL;
}

void model_zero_grad(model_t *m) {
  if (m->grads) m->be->zero(m->be, m->grads, m->num_params * sizeof(float));
  for (int u = 0; u < m->n_units; u++)
    if (m->unit_grads[u] && (!m->grads || m->unit_grads[u] != m->grads + m->unit_offset[u]))
      m->be->zero(m->be, m->unit_grads[u], m->unit_numel[u] * sizeof(float));
}

const float *model_logits(const model_t *m) { return m->logits; }
int model_vocab_size(const model_t *m) { return m->V; }

/* ------------------------------------------------------------------ forward */

/* One transformer block, x -> out (both (N, C)). */
static void block_forward(model_t *m, int l, float *out, int b, int t) {
  backend_t *be = m->be;
  const layer_tensors_t *lt = &m->layer[l];
  layer_acts_t *a = &m->acts[l];
  int N = b * t, C = m->C, HD = m->Hl * m->D, KD = m->KVl * m->D, F = m->Fl;

  be->rmsnorm_fwd(be, a->xn_att, a->rstd_att, a->x, param_of(m, lt->attention_norm), N, C, m->eps);
  be->matmul(be, a->q, a->xn_att, param_of(m, lt->wq), N, HD, C, 0, 1, 1.0f, 0.0f);
  be->matmul(be, a->k, a->xn_att, param_of(m, lt->wk), N, KD, C, 0, 1, 1.0f, 0.0f);
  be->matmul(be, a->v, a->xn_att, param_of(m, lt->wv), N, KD, C, 0, 1, 1.0f, 0.0f);
  be->rope_fwd(be, a->q, b, t, m->Hl, m->D, 0, m->theta);
  be->rope_fwd(be, a->k, b, t, m->KVl, m->D, 0, m->theta);
  be->attention_fwd(be, a->att, a->lse, a->q, a->k, a->v, b, t, m->Hl, m->KVl, m->D);
  /* x_mid = x + att wo^T (rowwise under TP: partial sums, all-reduce before the add) */
  be->copy(be, a->x_mid, a->x, (size_t)N * C * sizeof(float));
  be->matmul(be, a->x_mid, a->att, param_of(m, lt->wo), N, C, HD, 0, 1, 1.0f, 1.0f);

  be->rmsnorm_fwd(be, a->xn_ffn, a->rstd_ffn, a->x_mid, param_of(m, lt->ffn_norm), N, C, m->eps);
  be->matmul(be, a->a, a->xn_ffn, param_of(m, lt->w1), N, F, C, 0, 1, 1.0f, 0.0f);
  be->matmul(be, a->g, a->xn_ffn, param_of(m, lt->w3), N, F, C, 0, 1, 1.0f, 0.0f);
  be->swiglu_fwd(be, a->h, a->a, a->g, (size_t)N * F);
  /* out = x_mid + h w2^T (rowwise under TP) */
  be->copy(be, out, a->x_mid, (size_t)N * C * sizeof(float));
  be->matmul(be, out, a->h, param_of(m, lt->w2), N, C, F, 0, 1, 1.0f, 1.0f);
}

/* Checks ids on the host; logs the first bad one. */
static int check_ids(const model_t *m, const int32_t *ids, int n, int t, int allow_negative, const char *what) {
  for (int i = 0; i < n; i++) {
    int32_t id = ids[i];
    if ((id < 0 && !allow_negative) || id >= m->V) {
      log_error("model: %s id %d at position %d (sequence %d, t=%d) is outside [0, %d)", what, (int)id, i, i / t, i % t,
                m->V);
      return -1;
    }
  }
  return 0;
}

float model_forward(model_t *m, const int32_t *tokens, const int32_t *targets, int b, int t) {
  backend_t *be = m->be;
  m->last_ok = 0;
  m->last_has_targets = 0;
  if (b <= 0 || t <= 0 || b > m->max_b || t > m->max_t) {
    log_error("model: batch %d x %d tokens outside the model's capacity %d x %d", b, t, m->max_b, m->max_t);
    return NAN;
  }
  int N = b * t, C = m->C;
  if (check_ids(m, tokens, N, t, 0, "token") != 0) return NAN;
  if (targets && check_ids(m, targets, N, t, 1, "target") != 0) return NAN;
  be->to_device(be, m->tokens_dev, tokens, (size_t)N * sizeof(int32_t));
  if (targets) be->to_device(be, m->targets_dev, targets, (size_t)N * sizeof(int32_t));

  if (dp_gather(m, 0, 0)) return NAN;
  /* vocab-parallel under TP: rows [tp_rank * V/tp, ...), then an all-reduce */
  be->embedding_fwd(be, m->acts[0].x, param_of(m, m->tok_embeddings), m->tokens_dev, N, C, m->tp_rank * m->Vl, m->Vl);
  if (dp_release(m, 0, 0)) return NAN;

  for (int l = 0; l < m->L; l++) {
    if (dp_gather(m, 1 + l, 0)) return NAN;
    block_forward(m, l, l + 1 < m->L ? m->acts[l + 1].x : m->x_final, b, t);
    if (dp_release(m, 1 + l, 0)) return NAN;
  }

  int uo = m->L + 1;
  if (dp_gather(m, uo, 0)) return NAN;
  be->rmsnorm_fwd(be, m->xn_final, m->rstd_final, m->x_final, param_of(m, m->norm), N, C, m->eps);
  be->matmul(be, m->logits, m->xn_final, param_of(m, m->output), N, m->Vl, C, 0, 1, 1.0f, 0.0f);
  if (dp_release(m, uo, 0)) return NAN;

  m->last_b = b;
  m->last_t = t;
  m->last_ok = 1;
  if (!targets) return 0.0f;

  /* loss parallel under TP: max and sum-exp all-reduced across the vocab shards */
  be->cross_entropy(be, m->losses, NULL, m->logits, m->targets_dev, N, m->Vl, m->Vl, 1.0f);
  be->to_host(be, m->host_losses, m->losses, (size_t)N * sizeof(float));
  double sum = 0.0;
  int valid = 0;
  for (int i = 0; i < N; i++) {
    if (targets[i] < 0) continue;
    sum += m->host_losses[i];
    valid++;
  }
  m->n_valid = valid;
  m->last_has_targets = 1;
  return valid > 0 ? (float)(sum / valid) : 0.0f;
}

/* ------------------------------------------------------------------ backward */

/* On entry m->dres holds d(block output); on return d(block input) (the skip connections are
 * the accumulation into dres). */
static void block_backward(model_t *m, int l, int b, int t) {
  backend_t *be = m->be;
  const layer_tensors_t *lt = &m->layer[l];
  layer_acts_t *a = &m->acts[l];
  int N = b * t, C = m->C, HD = m->Hl * m->D, KD = m->KVl * m->D, F = m->Fl;

  /* out = x_mid + h w2^T */
  be->matmul(be, grad_of(m, lt->w2), m->dres, a->h, C, F, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, m->dh, m->dres, param_of(m, lt->w2), N, F, C, 0, 0, 1.0f, 0.0f);
  be->zero(be, m->da, (size_t)N * F * sizeof(float));
  be->zero(be, m->dg, (size_t)N * F * sizeof(float));
  be->swiglu_bwd(be, m->da, m->dg, m->dh, a->a, a->g, (size_t)N * F);
  be->matmul(be, grad_of(m, lt->w1), m->da, a->xn_ffn, F, C, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, grad_of(m, lt->w3), m->dg, a->xn_ffn, F, C, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, m->dxn, m->da, param_of(m, lt->w1), N, C, F, 0, 0, 1.0f, 0.0f);
  be->matmul(be, m->dxn, m->dg, param_of(m, lt->w3), N, C, F, 0, 0, 1.0f, 1.0f);
  be->rmsnorm_bwd(be, m->dres, grad_of(m, lt->ffn_norm), m->dxn, a->x_mid, param_of(m, lt->ffn_norm), a->rstd_ffn, N,
                  C);

  /* x_mid = x + att wo^T */
  be->matmul(be, grad_of(m, lt->wo), m->dres, a->att, C, HD, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, m->datt, m->dres, param_of(m, lt->wo), N, HD, C, 0, 0, 1.0f, 0.0f);
  be->zero(be, m->dq, (size_t)N * HD * sizeof(float));
  be->zero(be, m->dk, (size_t)N * KD * sizeof(float));
  be->zero(be, m->dv, (size_t)N * KD * sizeof(float));
  be->attention_bwd(be, m->dq, m->dk, m->dv, m->datt, a->q, a->k, a->v, a->att, a->lse, b, t, m->Hl, m->KVl, m->D);
  be->rope_bwd(be, m->dq, b, t, m->Hl, m->D, 0, m->theta);
  be->rope_bwd(be, m->dk, b, t, m->KVl, m->D, 0, m->theta);
  be->matmul(be, grad_of(m, lt->wq), m->dq, a->xn_att, HD, C, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, grad_of(m, lt->wk), m->dk, a->xn_att, KD, C, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, grad_of(m, lt->wv), m->dv, a->xn_att, KD, C, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, m->dxn, m->dq, param_of(m, lt->wq), N, C, HD, 0, 0, 1.0f, 0.0f);
  be->matmul(be, m->dxn, m->dk, param_of(m, lt->wk), N, C, KD, 0, 0, 1.0f, 1.0f);
  be->matmul(be, m->dxn, m->dv, param_of(m, lt->wv), N, C, KD, 0, 0, 1.0f, 1.0f);
  be->rmsnorm_bwd(be, m->dres, grad_of(m, lt->attention_norm), m->dxn, a->x, param_of(m, lt->attention_norm),
                  a->rstd_att, N, C);
}

void model_backward(model_t *m, float loss_scale) {
  backend_t *be = m->be;
  if (!m->last_ok || !m->last_has_targets) {
    log_error("model: model_backward needs a successful forward with targets first");
    return;
  }
  int b = m->last_b, t = m->last_t, N = b * t, C = m->C;
  float gs = m->n_valid > 0 ? loss_scale / (float)m->n_valid : 0.0f;
  /* dlogits overwrite the logits (their last use) */
  be->cross_entropy(be, m->losses, m->logits, m->logits, m->targets_dev, N, m->Vl, m->Vl, gs);
  m->last_ok = 0;

  int uo = m->L + 1;
  if (dp_gather(m, uo, 1)) return;
  be->matmul(be, grad_of(m, m->output), m->logits, m->xn_final, m->Vl, C, N, 1, 0, 1.0f, 1.0f);
  be->matmul(be, m->dxn, m->logits, param_of(m, m->output), N, C, m->Vl, 0, 0, 1.0f, 0.0f);
  be->zero(be, m->dres, (size_t)N * C * sizeof(float));
  be->rmsnorm_bwd(be, m->dres, grad_of(m, m->norm), m->dxn, m->x_final, param_of(m, m->norm), m->rstd_final, N, C);
  if (dp_reduce(m, uo) || dp_release(m, uo, 1)) return;

  for (int l = m->L - 1; l >= 0; l--) {
    if (dp_gather(m, 1 + l, 1)) return;
    block_backward(m, l, b, t);
    if (dp_reduce(m, 1 + l) || dp_release(m, 1 + l, 1)) return;
  }

  if (dp_gather(m, 0, 1)) return;
  be->embedding_bwd(be, grad_of(m, m->tok_embeddings), m->dres, m->tokens_dev, N, C, m->tp_rank * m->Vl, m->Vl);
  if (dp_reduce(m, 0) || dp_release(m, 0, 1)) return;
}
