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
 * Activation checkpointing (model_opts_t.checkpoint_every): a checkpointed block owns only its
 * input x; its other activations point into one shared working set (one block's worth), which
 * every checkpointed block overwrites in its forward. In the backward, right after the unit's
 * gather (FSDP has the parameters there, as it must for the backward anyway), block_forward
 * runs again from the saved x with the same kernels, inputs and order, so every saved tensor
 * comes back bit for bit, tp collectives included (they are deterministic and every tp rank
 * reruns the same ones); only the last rowwise product (the block output, which the backward
 * does not read) is skipped on every rank alike. The cost is one more forward per
 * checkpointed block.
 *
 * Tensor parallelism (model_opts_t.tp, a tp group of size tp > 1), Megatron-style as in
 * PyTorch's Llama plan; each module follows its style in the plan ("replicate" keeps it whole):
 * - colwise wq/wk/wv, w1/w3: this rank's output features (its heads, its kv heads, its slice
 *   of the feed-forward width); rowwise wo, w2: the matching input features, so a rank's
 *   attention and SwiGLU run on its heads / its features alone and the rowwise product is a
 *   partial sum, all-reduced (or reduce-scattered onto the sequence under SP);
 * - tok_embeddings rowwise = vocab-parallel: rows [r*Vp/tp, (r+1)*Vp/tp) of the vocabulary
 *   padded to Vp (a multiple of tp); a token outside the shard gives a zero row, and the
 *   partial embeddings are all-reduced (reduce-scattered under SP);
 * - output colwise: this rank's logits for the same vocab shard. With loss parallel the
 *   cross-entropy combines row max (all_reduce max), sum of exp and target logit (one
 *   all_reduce sum) and never gathers logits; without it the logits are all-gathered and the
 *   ordinary loss runs on every rank. Padding columns never enter the loss.
 * - sequence parallel: the residual stream between the sharded linears holds only this rank's
 *   rows. Layout: the B*T rows flattened and padded to Np, a multiple of tp (padding rows carry
 *   token and target -1: zero embedding, ignored by the loss, so they stay zero throughout);
 *   rank r holds rows [r*Np/tp, (r+1)*Np/tp). A contiguous block per rank is exactly what
 *   all_gather concatenates and reduce_scatter hands out, so no permutation is needed; RoPE and
 *   attention run after the all-gather on full rows, where (b, t) are ordinary. Norms run on
 *   the local rows; their weight gradients are partial per rank and are all-reduced over tp.
 * - prepare_module_input ("attention", "feed_forward") is PyTorch's way of asking for this
 *   input layout change (Shard(seq) -> Replicate before the colwise linears): here it is implied
 *   by sequence parallelism (the all-gather of normed rows) and is otherwise a no-op.
 * Backward mirrors every collective: all_gather <-> reduce_scatter, identity <-> all_reduce.
 * Replicated parameters end every backward with identical full gradients on all tp ranks.
 * Collectives take the backend's memory (host for cpu; device memory wants a comm that moves
 * device memory: comm_memory, never a backend's name).
 * Errors: forward and backward return a status with the message in model_errmsg. A failed tp
 * collective is recorded (sticky: the group is broken for good), later collectives of the pass
 * are skipped, and the pass returns MODEL_ECOMM at the next unit boundary, so a failure in the
 * backward reaches the caller before any optimizer step.
 *
 * FSDP (model_opts_t.no_flat_buffers): no flat buffers; every unit must be pointed at full
 * buffers by the strategy's gather before use, which forward/backward check. Residual
 * gradients flow through the backward by accumulation: the backward kernels add into the one
 * residual-gradient buffer, so the skip connections cost nothing.
 *
 * KV-cache decoding (model_kv_*, for `trainer sample`) runs block_forward's kernels on a
 * separate cache and scratch, one sequence at a time, and touches none of the above state.
 *
 * It does not own the optimizer (trainer/model/optim) nor the data-parallel strategy (trainer/parallel/dp). */
#include "trainer/model/model.h"
#include "trainer/model/ring_attention.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/env.h"
#include "common/err.h"
#include "common/log.h"
#include "trainer/comm/comm.h"
#include "trainer/model/rng.h"
#include "trainer/comm/trace.h"

/* Indices into model_t.tensors of one layer's parameters. */
typedef struct {
  int attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
} layer_tensors_t;

/* One layer's saved activations. "Local" rows are this rank's sequence shard under SP (Ns),
 * else all rows; "full" rows are all Np rows (N plus SP padding). */
typedef struct {
  void *x;         /* (Ns, C) block input (the residual stream) */
  void *xn_att;    /* (Np, C) attention_norm(x), gathered */
  float *rstd_att; /* (Ns) fp32 */
  void *q;         /* (Np, Hl*D) = (B, T, Hl, D), after RoPE */
  void *k;         /* (Np, KVl*D) after RoPE */
  void *v;         /* (Np, KVl*D) */
  void *att;       /* (Np, Hl*D) attention output, before wo */
  float *lse;      /* (B, Hl, T) softmax log-sum-exp, fp32 */
  void *x_mid;     /* (Ns, C) x + attention */
  void *xn_ffn;    /* (Np, C) ffn_norm(x_mid), gathered */
  float *rstd_ffn; /* (Ns) fp32 */
  void *ag;        /* (Np, 2*Fl): each row xn_ffn w1^T then xn_ffn w3^T (one product) */
  void *h;         /* (Np, Fl) silu(a) * g */
} layer_acts_t;

/* One micro-batch's worth of a chunk's saved activations (a slot), and the state of the
 * forward that filled it. The model binds a slot (bind_slot) before running on it: its pointers
 * go into model_t's acts[] and head fields, which is all the kernels' code reads. */
typedef struct {
  layer_acts_t *acts;   /* (chunk's n) saved sets; checkpointed blocks point into model_t.work */
  void *y;              /* (Ns, C) output of a chunk without the head; its gradient arrives here */
  void *x_final, *xn_final, *logits, *logits_full, *logits_gather;
  float *rstd_final, *losses, *ce_max, *ce_stats;
  int32_t *tokens_dev, *targets_dev;
  int Np, Ns, row0, b, t, n_valid, has_targets, ok, gathered;
} slot_t;

/* Layers [first, first + n) held by this instance (a pipeline stage), with the embedding and/or
 * the head when the chunk begins or ends the model. */
typedef struct {
  int first, n, embed, head, n_slots;
  slot_t *slots;
} chunk_t;

struct model {
  backend_t *be;
  model_hooks_t *dp; /* the strategy's (model_set_hooks), or NULL */
  /* config */
  int C, L, H, KV, D, F, V, max_seq_len;
  float eps, theta;
  /* tensor parallelism: local heads, kv heads, ffn width; local rows of the vocab tables */
  comm_t *tpc; /* NULL when tp == 1 */
  int tp, tp_rank, Hl, KVl, Fl;
  int Vp, Ve, Vo;   /* padded vocab; local rows of tok_embeddings and output */
  int emb_split, attn_split, ffn_split, out_split, sp, lp;
  int comm_rc;      /* first collective failure (sticky), 0 when none */
  char err[MODEL_ERR_MAX]; /* message of the last failed forward/backward (model_errmsg) */
  /* test hook MESHRUN_FAULT_COMM (fault_from_env): fail the first tp collective of pass
   * fault_pass (forward, or its backward with fault_bwd); passes counts forwards with targets */
  int fault_pass, fault_bwd, passes;
  int64_t unit_t0; /* the trace: when the current unit's compute began */
  int no_flat; /* FSDP: params/grads NULL, units point at the strategy's buffers */
  dtype_t dt;  /* activations and parameter compute copies (model_opts_t.param_dtype) */
  dtype_t rdt; /* tp reduction of replicated norm gradients (model_opts_t.reduce_dtype) */
  size_t es;   /* bytes of one dt element */
  int strategy_casts;
  int max_b, max_t;
  int Np, Ns, row0; /* rows of the current batch: full (padded), local, first local row */
  int cp;                /* context parallelism: 1 when ring is in use (model_opts_t.cp) */
  ring_attention_t ring; /* its attention around the cp ring */

  /* parameters */
  int n_tensors;
  model_tensor_t *tensors;
  layer_tensors_t *layer; /* (L) */
  int tok_embeddings, norm, output;
  size_t num_params;
  float *params, *grads; /* (num_params) device */
  int n_units;
  size_t *unit_offset, *unit_numel;  /* (n_units) */
  float **unit_params, **unit_grads; /* current base of each unit (fp32) */
  const void **unit_cparams;         /* what the kernels read: unit_params in fp32, else bf16 */
  void *params_lp;                   /* bf16 without strategy_casts: the model's compute copy */
  int lp_current;                    /* params_lp holds the masters' rounding (model_compute_written) */

  /* activations: dt unless marked fp32 */
  void *arena;
  size_t arena_bytes, block_bytes;   /* model_memory: the arena, its transformer-block part */
  int ckpt_every;                    /* model_opts_t.checkpoint_every */
  layer_acts_t *acts;                /* (L) */
  layer_acts_t work;                 /* the checkpointed blocks' shared set (x unused) */
  void *x_final;                     /* (Ns, C) output of the last block */
  void *xn_final;                    /* (Np, C) gathered */
  float *rstd_final;                 /* (Ns) fp32 */
  void *logits;                      /* (Np, Vo) this rank's logits; after model_backward dlogits */
  float *losses;                     /* (Np) fp32 */
  int32_t *tokens_dev, *targets_dev; /* (Np), padding rows -1 */
  /* backward scratch */
  void *dres;          /* (Ns, C) gradient of the residual stream */
  void *dxn;           /* (Np, C) gradient of a norm's (gathered) output */
  void *datt;          /* (Np, Hl*D) */
  void *dq;            /* (Np, Hl*D) */
  void *dk, *dv;       /* (Np, KVl*D) */
  void *qkv;           /* (Np, (Hl + 2*KVl)*D): the fused product's rows, forward; their gradient */
  void *dh;            /* (Np, Fl) */
  void *dag;           /* (Np, 2*Fl): da then dg per row */
  /* tensor-parallel scratch (NULL when unused) */
  void *xn_loc;         /* (Ns, C) SP: a norm's output on the local rows, before the all-gather */
  void *sc_full;        /* (Np, C) partial rowwise outputs; gathered residual gradients */
  void *sc_loc;         /* (Ns, C) SP: reduce-scatter results */
  float *dnorm;         /* (C) fp32, SP: one norm weight's partial gradient */
  void *dnorm_lp;       /* (C) bf16, SP with reduce_dtype bf16: what the all-reduce moves */
  void *logits_full;    /* (Np, V) output colwise: gathered logits (model_logits) */
  void *logits_gather;  /* (tp, Np, Vo) output colwise: all_gather landing buffer */
  float *ce_max;        /* (Np) fp32 loss parallel: row max */
  float *ce_stats;      /* (2, Np) fp32 loss parallel: sum of exp, target logit */
  const void *logits_out; /* the last forward's full logits (dt), NULL when none */
  float *logits_f32;    /* bf16: model_logits' widened copy (max_b * max_t, V), on first use */
  int32_t pad_ids[64];  /* -1s: token and target ids of SP padding rows (< tp of them) */
  /* A whole model's batches go up through the backend's uploads (upload_ids): two device buffers
   * of (2, Np) ids, tokens then targets, and their pinned host copies, used in turn (up_next).
   * NULL: pipeline chunks, which copy into each slot's own ids. */
  int32_t *up_dev[2], *up_host[2];
  int up_next;
  /* model_stage: two device buffers of (n, 2, Np) ids used in turn and their pinned host copies;
   * the parity staged last, its micro-batches (0: nothing staged yet), their shape and counts of
   * targets that count */
  int32_t *stage_dev[2], *stage_host[2];
  size_t stage_cap; /* ids each buffer holds */
  int stage_par, stage_n, stage_b, stage_t;
  int *stage_valid;

  /* pipeline: the chunks held (one covering every layer without pp) and the local unit numbering */
  int n_chunks;
  chunk_t *chunks;
  int *unit_of_layer;  /* (L) local unit of block l, -1 when not held */
  int u_embed, u_head; /* local units of tok_embeddings and of norm + output, -1 when not held */

  /* state of the last forward (of the bound slot) */
  float *host_losses; /* (Np) host */
  int last_b, last_t, last_has_targets, last_ok, last_gathered;
  int grad_ready;   /* the last forward also wrote the logits' gradient (model_forward_rows) ... */
  float grad_scale; /* ... for this loss_scale */
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
/* The compute copy of tensor ti (dt), what the kernels read. */
static const void *cparam_of(model_t *m, int ti) {
  const model_tensor_t *t = &m->tensors[ti];
  return (const char *)m->unit_cparams[t->unit] + (t->offset - m->unit_offset[t->unit]) * m->es;
}
/* Element i of an activation buffer of dt elements. */
static void *at(const model_t *m, const void *p, size_t i) { return (char *)p + i * m->es; }

/* Adds a tensor of full shape (full_rows, full_cols); split says how this rank's slice is cut
 * from it. ROWS: ceil(full_rows / tp) rows each, the last rank's tail past full_rows being
 * padding (the vocabulary); COLS: full_cols / tp columns (tp divides, checked at creation). */
static int add_tensor(model_t *m, const char *name, int unit, int full_rows, int full_cols, int ndim, int decay,
                      int split) {
  int i = m->n_tensors++;
  model_tensor_t *t = &m->tensors[i];
  if (m->tp == 1) split = MODEL_TP_REPLICATED;
  int rows = split == MODEL_TP_ROWS ? (full_rows + m->tp - 1) / m->tp : full_rows;
  int cols = split == MODEL_TP_COLS ? full_cols / m->tp : full_cols;
  t->tp_split = split;
  t->full_shape[0] = full_rows;
  t->full_shape[1] = full_cols;
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

/* ------------------------------------------------------------------ errors */

/* Records why a forward or backward stopped (model_errmsg) and returns code. */
static int set_error(model_t *m, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int set_error(model_t *m, int code, const char *fmt, ...) {
  int n = snprintf(m->err, sizeof m->err, "model: ");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m->err + n, sizeof m->err - (size_t)n, fmt, ap);
  va_end(ap);
  return code;
}

/* ------------------------------------------------------------------ dp hooks */

/* The unit's compute span for the trace (trainer/comm/trace.h): from its gather's end to its release
 * (forward) or to its gradient reduction (backward). */
static void trace_unit(model_t *m, int u, int bwd) {
  if (!trace_active()) return;
  char name[48];
  snprintf(name, sizeof name, "%s unit %d", bwd ? "backward" : "forward", u);
  trace_span(name, "compute", m->unit_t0, trace_now_ns());
}

static int dp_gather(model_t *m, int u, int bwd) {
  if (m->dp && m->dp->gather) {
    int rc = m->dp->gather(m->dp, u, bwd);
    if (rc) return set_error(m, MODEL_ESTRATEGY, "dp %s gather of unit %d failed (%d)", m->dp->name, u, rc);
  }
  if (trace_active()) m->unit_t0 = trace_now_ns();
  const int need_master = m->dt == DT_F32 || !m->strategy_casts; /* the kernels read it, or its copy */
  if ((need_master ? !m->unit_params[u] : !m->unit_cparams[u]) || (bwd && !m->unit_grads[u]))
    return set_error(m, MODEL_EINVAL,
                     "unit %d has no %s buffer (no_flat_buffers: the strategy's gather must provide it)", u,
                     (bwd && !m->unit_grads[u]) ? "gradient" : m->dt == DT_F32 ? "parameter" : "bf16 parameter");
  /* The model's own bf16 copy: rounded from the fp32 parameters at every forward gather (any
   * update since, by whatever path, is seen), reused by the backward of the same step; not
   * when the strategy's optimizer wrote it with the masters and nothing has written them since. */
  if (m->dt != DT_F32 && !m->strategy_casts && !bwd && !m->lp_current)
    m->be->convert(m->be, (void *)m->unit_cparams[u], m->dt, m->unit_params[u], DT_F32, m->unit_numel[u]);
  return 0;
}
/* Released even after a failed tp collective (the strategy frees what it gathered); that
 * failure, already recorded, then fails the unit. */
static int dp_release(model_t *m, int u, int bwd) {
  if (!bwd) trace_unit(m, u, 0);
  int rc = m->comm_rc ? MODEL_ECOMM : 0;
  if (!m->dp || !m->dp->release) return rc;
  int rc2 = m->dp->release(m->dp, u, bwd);
  if (rc2 && !rc) rc = set_error(m, MODEL_ESTRATEGY, "dp %s release of unit %d failed (%d)", m->dp->name, u, rc2);
  return rc;
}
static int dp_reduce(model_t *m, int u) {
  trace_unit(m, u, 1);
  if (m->comm_rc) return MODEL_ECOMM;
  if (!m->dp || !m->dp->reduce_grads) return 0;
  int rc = m->dp->reduce_grads(m->dp, u);
  if (rc) return set_error(m, MODEL_ESTRATEGY, "dp %s reduce_grads of unit %d failed (%d)", m->dp->name, u, rc);
  return 0;
}

/* ------------------------------------------------------------------ tp collectives */

/* The first failure is recorded in comm_rc and the message; later collectives are skipped (the
 * communicator is broken by then anyway) and the pass fails at the next unit boundary. */
static void tp_check(model_t *m, int rc, const char *what) {
  if (!rc) return;
  set_error(m, MODEL_ECOMM, "tensor-parallel %s failed: %s", what, comm_errmsg(m->tpc));
  m->comm_rc = rc;
}
/* Activations travel in dt; the loss statistics in fp32 (tp_all_reduce's dt says which). */
static void tp_all_reduce(model_t *m, void *buf, size_t n, dtype_t dt, comm_op_t op, const char *what) {
  if (!m->comm_rc) tp_check(m, comm_all_reduce(m->tpc, buf, n, dt, op), what);
}
static void tp_all_gather(model_t *m, void *out, const void *in, size_t n, const char *what) {
  if (!m->comm_rc) tp_check(m, comm_all_gather(m->tpc, in, out, n, m->dt), what);
}
static void tp_reduce_scatter(model_t *m, void *out, const void *in, size_t n, const char *what) {
  if (!m->comm_rc) tp_check(m, comm_reduce_scatter(m->tpc, in, out, n, m->dt, COMM_SUM), what);
}

/* Local rows -> all rows (cols wide). Under SP each rank holds its block of rows and the
 * colwise linears (or the replicated computations) need every row: all_gather into full.
 * Without SP local rows are all rows: returns local itself. */
static const void *rows_to_full(model_t *m, void *full, const void *local, int cols, const char *what) {
  if (!m->sp) return local;
  tp_all_gather(m, full, local, (size_t)m->Ns * cols, what);
  return full;
}

/* All rows -> local rows. partial: each rank holds a partial sum (a rowwise product, or the
 * input gradient of colwise linears), summed across tp: all_reduce in place, or under SP
 * reduce_scatter so that each rank receives only the sum of its own rows. Not partial: every
 * rank holds the same full value and keeps its rows. */
static const void *rows_from_full(model_t *m, void *full, void *local_scratch, int cols, int partial,
                                  const char *what) {
  if (partial && m->sp) {
    tp_reduce_scatter(m, local_scratch, full, (size_t)m->Ns * cols, what);
    return local_scratch;
  }
  if (partial && m->tp > 1) tp_all_reduce(m, full, (size_t)m->Np * cols, m->dt, COMM_SUM, what);
  return at(m, full, (size_t)m->row0 * cols);
}

/* ------------------------------------------------------------------ create / destroy */

/* Carves n elements of es bytes at the arena offset *off (bytes; 64-byte aligned slots). With
 * base NULL it only counts, so that one function both sizes the arena and lays it out. n = 0
 * gives NULL. */
static void *carve(void *base, size_t *off, size_t n, size_t es) {
  if (!n) return NULL;
  void *p = base ? (char *)base + *off : NULL;
  *off += (n * es + 63) & ~(size_t)63;
  return p;
}

/* Rows of a batch of n = b*t tokens: Np all rows (padded to a multiple of tp under SP), Ns
 * this rank's rows, from row0. */
static void batch_rows(const model_t *m, int n, int *np, int *ns, int *row0) {
  if (m->sp) {
    *np = (n + m->tp - 1) / m->tp * m->tp;
    *ns = *np / m->tp;
    *row0 = m->tp_rank * *ns;
  } else {
    *np = *ns = n;
    *row0 = 0;
  }
}

/* 1 when block l recomputes its forward in its backward (model_opts_t.checkpoint_every). */
static int checkpointed(const model_t *m, int l) { return m->ckpt_every > 0 && (l + 1) % m->ckpt_every == 0; }

/* A block's saved set but its input x (which every block keeps even when checkpointed). */
static void carve_block_set(const model_t *m, layer_acts_t *a, void *base, size_t *off) {
  int np, ns, r0;
  batch_rows(m, m->max_b * m->max_t, &np, &ns, &r0);
  size_t Np = (size_t)np, Ns = (size_t)ns, C = m->C, HD = (size_t)m->Hl * m->D, KD = (size_t)m->KVl * m->D,
         F = m->Fl, es = m->es, f4 = sizeof(float), lse_n = (size_t)m->max_b * m->Hl * m->max_t;
  a->xn_att = carve(base, off, Np * C, es);
  a->rstd_att = carve(base, off, Ns, f4);
  a->q = carve(base, off, Np * HD, es);
  a->k = carve(base, off, Np * KD, es);
  a->v = carve(base, off, Np * KD, es);
  a->att = carve(base, off, Np * HD, es);
  a->lse = carve(base, off, lse_n, f4);
  a->x_mid = carve(base, off, Ns * C, es);
  a->xn_ffn = carve(base, off, Np * C, es);
  a->rstd_ffn = carve(base, off, Ns, f4);
  a->ag = carve(base, off, Np * 2 * F, es);
  a->h = carve(base, off, Np * F, es);
}

/* Lays the activations out from base (NULL: only counts); returns the bytes needed. First, when
 * any held block is checkpointed, the shared working set (m->work) that the checkpointed blocks
 * point at; then every slot of every chunk: each block's input, and the rest of its saved set
 * unless it is checkpointed, then the chunk's output (no head) or the head's saved set (final
 * norm, logits, losses), and the ids the chunk reads; last the backward and tp scratch, shared
 * by all. m->block_bytes is the transformer-block part (working set and every slot's blocks).
 * Activations are dt (es bytes), statistics fp32, ids int32. */
static size_t layout_acts(model_t *m, void *base) {
  int np, ns, r0;
  batch_rows(m, m->max_b * m->max_t, &np, &ns, &r0);
  size_t Np = (size_t)np, Ns = (size_t)ns, C = m->C, HD = (size_t)m->Hl * m->D, KD = (size_t)m->KVl * m->D,
         F = m->Fl, es = m->es, f4 = sizeof(float), off = 0;
  int any = 0;
  for (int c = 0; c < m->n_chunks; c++)
    for (int l = m->chunks[c].first; l < m->chunks[c].first + m->chunks[c].n; l++) any |= checkpointed(m, l);
  memset(&m->work, 0, sizeof m->work);
  if (any) carve_block_set(m, &m->work, base, &off);
  m->block_bytes = off;
  for (int c = 0; c < m->n_chunks; c++) {
    chunk_t *ch = &m->chunks[c];
    for (int k = 0; k < ch->n_slots; k++) {
      slot_t *sl = &ch->slots[k];
      const size_t o0 = off;
      for (int i = 0; i < ch->n; i++) {
        layer_acts_t *a = &sl->acts[i];
        void *x = carve(base, &off, Ns * C, es);
        if (checkpointed(m, ch->first + i)) *a = m->work;
        else carve_block_set(m, a, base, &off);
        a->x = x;
      }
      m->block_bytes += off - o0;
      sl->y = carve(base, &off, ch->head ? 0 : Ns * C, es);
      const size_t h = ch->head ? 1 : 0;
      sl->x_final = carve(base, &off, h * Ns * C, es);
      sl->xn_final = carve(base, &off, h * Np * C, es);
      sl->rstd_final = carve(base, &off, h * Ns, f4);
      sl->logits = carve(base, &off, h * Np * m->Vo, es);
      sl->losses = carve(base, &off, h * Np, f4);
      sl->tokens_dev = carve(base, &off, ch->embed ? Np : 0, sizeof(int32_t));
      sl->targets_dev = carve(base, &off, h * Np, sizeof(int32_t));
      sl->logits_full = carve(base, &off, m->out_split ? h * Np * m->V : 0, es);
      sl->logits_gather = carve(base, &off, m->out_split ? h * (size_t)m->tp * Np * m->Vo : 0, es);
      sl->ce_max = carve(base, &off, m->lp ? h * Np : 0, f4);
      sl->ce_stats = carve(base, &off, m->lp ? h * 2 * Np : 0, f4);
    }
  }
  m->dres = carve(base, &off, Ns * C, es);
  m->dxn = carve(base, &off, Np * C, es);
  m->datt = carve(base, &off, Np * HD, es);
  m->dq = carve(base, &off, Np * HD, es);
  m->dk = carve(base, &off, Np * KD, es);
  m->dv = carve(base, &off, Np * KD, es);
  m->qkv = carve(base, &off, Np * (HD + 2 * KD), es);
  m->dh = carve(base, &off, Np * F, es);
  m->dag = carve(base, &off, Np * 2 * F, es);
  m->xn_loc = carve(base, &off, m->sp ? Ns * C : 0, es);
  m->sc_full = carve(base, &off, m->tp > 1 ? Np * C : 0, es);
  m->sc_loc = carve(base, &off, m->sp ? Ns * C : 0, es);
  m->dnorm = carve(base, &off, m->sp ? C : 0, f4);
  m->dnorm_lp = carve(base, &off, m->sp && m->rdt != DT_F32 ? C : 0, dtype_size(m->rdt));
  return off;
}

/* Points the kernels' view (acts[], the head's buffers, the batch's rows) at slot k of chunk c,
 * and back: save_slot keeps the state of the forward just run in the slot. */
static void bind_slot(model_t *m, int c, int k) {
  chunk_t *ch = &m->chunks[c];
  slot_t *sl = &ch->slots[k];
  for (int i = 0; i < ch->n; i++) m->acts[ch->first + i] = sl->acts[i];
  m->x_final = sl->x_final;
  m->xn_final = sl->xn_final;
  m->rstd_final = sl->rstd_final;
  m->logits = sl->logits;
  m->losses = sl->losses;
  m->tokens_dev = sl->tokens_dev;
  m->targets_dev = sl->targets_dev;
  m->logits_full = sl->logits_full;
  m->logits_gather = sl->logits_gather;
  m->ce_max = sl->ce_max;
  m->ce_stats = sl->ce_stats;
  m->Np = sl->Np;
  m->Ns = sl->Ns;
  m->row0 = sl->row0;
  m->last_b = sl->b;
  m->last_t = sl->t;
  m->n_valid = sl->n_valid;
  m->last_has_targets = sl->has_targets;
  m->last_ok = sl->ok;
  m->last_gathered = sl->gathered;
}

static void save_slot(model_t *m, int c, int k) {
  slot_t *sl = &m->chunks[c].slots[k];
  sl->Np = m->Np;
  sl->Ns = m->Ns;
  sl->row0 = m->row0;
  sl->b = m->last_b;
  sl->t = m->last_t;
  sl->n_valid = m->n_valid;
  sl->has_targets = m->last_has_targets;
  sl->ok = m->last_ok;
  sl->gathered = m->last_gathered;
}

void model_memory(const model_t *m, model_memory_t *out) {
  out->act_bytes = m->arena_bytes + ring_attention_bytes(&m->ring);
  out->act_block_bytes = m->block_bytes;
  out->compute_bytes = m->params_lp ? m->num_params * m->es : 0;
}

void model_destroy(model_t *m) {
  if (!m) return;
  if (m->be) {
    m->be->free(m->be, m->params);
    m->be->free(m->be, m->grads);
    m->be->free(m->be, m->arena);
    m->be->free(m->be, m->params_lp);
    m->be->free(m->be, m->logits_f32);
    for (int j = 0; j < 2; j++) {
      m->be->free(m->be, m->up_dev[j]);
      m->be->host_free_pinned(m->be, m->up_host[j]);
      m->be->free(m->be, m->stage_dev[j]);
      m->be->host_free_pinned(m->be, m->stage_host[j]);
    }
  }
  free(m->stage_valid);
  ring_attention_free(&m->ring);
  free(m->tensors);
  free(m->layer);
  free(m->unit_offset);
  free(m->unit_numel);
  free(m->unit_params);
  free(m->unit_grads);
  free(m->unit_cparams);
  free(m->acts);
  for (int c = 0; m->chunks && c < m->n_chunks; c++) {
    for (int k = 0; m->chunks[c].slots && k < m->chunks[c].n_slots; k++) free(m->chunks[c].slots[k].acts);
    free(m->chunks[c].slots);
  }
  free(m->chunks);
  free(m->unit_of_layer);
  free(m->host_losses);
  free(m);
}

int model_create(model_t **out, const plan_model_t *cfg, backend_t *be, int max_b, int max_t, int decay_norms,
                 int decay_embeddings, char *err, size_t errlen) {
  model_opts_t opts = {
      .max_b = max_b, .max_t = max_t, .decay_norms = decay_norms, .decay_embeddings = decay_embeddings};
  return model_create_opts(out, cfg, be, &opts, err, errlen);
}

/* The style of module in the tp plan: the default Llama plan when none is given, "replicate"
 * for a module a given plan leaves out (as plan.c reads it). */
static plan_tp_style_t tp_style(const model_tp_t *tpo, const char *module, plan_tp_style_t def) {
  if (!tpo->plan || tpo->n_plan <= 0) return def;
  for (int i = 0; i < tpo->n_plan; i++)
    if (!strcmp(tpo->plan[i].module, module)) return tpo->plan[i].style;
  return PLAN_TP_REPLICATE;
}

/* Reads the plan into the split flags; checks what the plan module checks too, for callers
 * that build model_opts_t by hand. */
static int tp_setup(model_t *m, const model_tp_t *tpo, char *err, size_t errlen) {
  static const char *const attn[] = {"attention.wq", "attention.wk", "attention.wv", "attention.wo"};
  static const char *const ffn[] = {"feed_forward.w1", "feed_forward.w3", "feed_forward.w2"};
  int na = 0, nf = 0;
  for (int i = 0; i < 4; i++)
    na += tp_style(tpo, attn[i], i < 3 ? PLAN_TP_COLWISE : PLAN_TP_ROWWISE) ==
          (i < 3 ? PLAN_TP_COLWISE : PLAN_TP_ROWWISE);
  for (int i = 0; i < 3; i++)
    nf += tp_style(tpo, ffn[i], i < 2 ? PLAN_TP_COLWISE : PLAN_TP_ROWWISE) ==
          (i < 2 ? PLAN_TP_COLWISE : PLAN_TP_ROWWISE);
  if (na != 0 && na != 4)
    return err_set(err, errlen, MODEL_EINVAL, "model error: tp plan: attention.wq/wk/wv colwise and wo rowwise go together");
  if (nf != 0 && nf != 3)
    return err_set(err, errlen, MODEL_EINVAL, "model error: tp plan: feed_forward.w1/w3 colwise and w2 rowwise go together");
  m->attn_split = na == 4;
  m->ffn_split = nf == 3;
  m->emb_split = tp_style(tpo, "tok_embeddings", PLAN_TP_ROWWISE) == PLAN_TP_ROWWISE;
  m->out_split = tp_style(tpo, "output", PLAN_TP_COLWISE) == PLAN_TP_COLWISE;
  m->sp = tpo->sequence_parallel != 0;
  m->lp = tpo->loss_parallel != 0 && m->out_split; /* output replicate: the ordinary loss */
  if (m->sp && (!m->attn_split || !m->ffn_split))
    return err_set(err, errlen, MODEL_EINVAL, "model error: sequence parallelism needs the attention and feed_forward linears "
                             "sharded in the tp plan");
  if (m->attn_split && (m->H % m->tp || m->KV % m->tp))
    return err_set(err, errlen, MODEL_EINVAL, "model error: mesh.tp=%d must divide n_heads=%d and n_kv_heads=%d", m->tp, m->H, m->KV);
  if (m->ffn_split && m->F % m->tp)
    return err_set(err, errlen, MODEL_EINVAL, "model error: mesh.tp=%d must divide hidden_dim=%d", m->tp, m->F);
  if (m->tp > (int)(sizeof m->pad_ids / sizeof m->pad_ids[0]))
    return err_set(err, errlen, MODEL_EINVAL, "model error: mesh.tp=%d is above the supported 64", m->tp);
  const backend_t *be = m->be;
  if ((m->out_split && !be->copy_2d) || (m->lp && (!be->ce_shard_max || !be->ce_shard_stats || !be->ce_shard_loss)))
    return err_set(err, errlen, MODEL_EINVAL, "model error: backend %s lacks the tensor-parallel kernels (copy_2d, ce_shard_*)",
                be->name);
  if (be->mem == BACKEND_MEM_DEVICE && comm_memory(m->tpc) == COMM_MEM_HOST)
    return err_set(err, errlen, MODEL_EINVAL, "model error: tensor parallelism on backend %s needs a comm that takes device memory; "
                             "comm %s moves host memory", be->name, comm_name(m->tpc));
  return 0;
}

/* Test hook, MESHRUN_FAULT_COMM=RANK:PASS:fwd|bwd: on the process whose RANK is RANK, the first
 * tensor-parallel collective of the PASS-th forward with targets (fwd), or of the backward that
 * follows it (bwd), fails as a lost connection would (comm_fail_next): the peers' collective
 * fails at once too, and the pass returns MODEL_ECOMM. Passes count from 1 in this process;
 * with one micro-batch per step, no eval and no resume, PASS is the step. */
static void fault_from_env(model_t *m) {
  const char *s = getenv("MESHRUN_FAULT_COMM");
  int rank = -1, pass = 0, my_rank;
  env_int("RANK", 0, INT_MAX, 0, &my_rank);
  char phase[4] = "";
  if (!s || !*s || sscanf(s, "%d:%d:%3s", &rank, &pass, phase) != 3 || pass < 1) return;
  if (rank != my_rank || (strcmp(phase, "fwd") && strcmp(phase, "bwd"))) return;
  m->fault_pass = pass;
  m->fault_bwd = !strcmp(phase, "bwd");
}

/* The chunks of model_opts_t (or one chunk of every layer), checked, with their slots, and the
 * local unit of every held block (after the embedding's unit 0 when it is held). */
static int setup_chunks(model_t *m, const model_opts_t *opts, char *err, size_t errlen) {
  const int n = opts->n_chunks > 0 ? opts->n_chunks : 1, L = m->L;
  m->chunks = calloc((size_t)n, sizeof *m->chunks);
  m->unit_of_layer = malloc((size_t)L * sizeof *m->unit_of_layer);
  if (!m->chunks || !m->unit_of_layer) return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
  m->n_chunks = n;
  for (int l = 0; l < L; l++) m->unit_of_layer[l] = -1;
  int end = 0, u = 0;
  for (int c = 0; c < n; c++) {
    chunk_t *ch = &m->chunks[c];
    ch->first = opts->n_chunks > 0 ? opts->chunk_first[c] : 0;
    ch->n = opts->n_chunks > 0 ? opts->chunk_layers[c] : L;
    ch->n_slots = opts->n_chunks > 0 && opts->chunk_slots ? opts->chunk_slots[c] : 1;
    if (ch->n < 1 || ch->first < end || ch->first > L - ch->n || ch->n_slots < 1)
      return err_set(err, errlen, MODEL_EINVAL, "model error: pipeline chunk %d (layers %d..%d, %d slots) is empty, out of "
                     "order or outside the model's %d layers", c, ch->first, ch->first + ch->n - 1, ch->n_slots, L);
    end = ch->first + ch->n;
    ch->embed = ch->first == 0;
    ch->head = end == L;
    if (c == 0 && ch->embed) u = 1;
    for (int l = ch->first; l < end; l++) m->unit_of_layer[l] = u++;
    ch->slots = calloc((size_t)ch->n_slots, sizeof *ch->slots);
    if (!ch->slots) return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
    for (int k = 0; k < ch->n_slots; k++)
      if (!(ch->slots[k].acts = calloc((size_t)ch->n, sizeof *ch->slots[k].acts)))
        return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
  }
  return 0;
}

/* model.attention (attn_choice_t) for this model's shape (b sequences of t tokens, or of one
 * chunk under context parallelism): the backend's choice said once, *fused (may be NULL) 1 when
 * its fused kernel runs; or MODEL_EPLAN with a plan error when the fused kernel was asked for and
 * cannot be had. */
static int attention_choose(model_t *m, int mode, int b, int t, int *fused, char *err, size_t errlen) {
  backend_t *be = m->be;
  char why[512] = "";
  if (fused) *fused = 0;
  if (!be->attention_select) {
    if (mode == ATTN_FUSED)
      return err_set(err, errlen, MODEL_EPLAN, "plan error: model.attention: %s: device %s has no fused attention kernel: "
                     "use %s or %s", attention_names[ATTN_FUSED], be->name, attention_names[ATTN_AUTO],
                     attention_names[ATTN_REFERENCE]);
    return 0;
  }
  int r = be->attention_select(be, mode, b, t, m->Hl, m->KVl, m->D, m->dt, why, sizeof why);
  if (r < 0)
    return err_set(err, errlen, MODEL_EPLAN, "plan error: model.attention: %s: %s: use %s or %s", attention_names[ATTN_FUSED],
                   why, attention_names[ATTN_AUTO], attention_names[ATTN_REFERENCE]);
  log_rank0("attention: %s%s", r ? "" : "reference kernel: ", why);
  if (fused) *fused = r;
  return 0;
}

/* cfg's shape and the batch capacity, checked before anything is allocated; *kv the number of
 * kv heads (n_heads when n_kv_heads is not set). */
static int check_config(const plan_model_t *cfg, int max_b, int max_t, int *kv, char *err, size_t errlen) {
  if (cfg->dim <= 0 || cfg->n_layers <= 0 || cfg->n_heads <= 0 || cfg->vocab_size <= 0 || cfg->hidden_dim <= 0)
    return err_set(err, errlen, MODEL_EINVAL, "model error: dim=%d n_layers=%d n_heads=%d vocab_size=%d hidden_dim=%d must all be > 0",
                cfg->dim, cfg->n_layers, cfg->n_heads, cfg->vocab_size, cfg->hidden_dim);
  *kv = cfg->n_kv_heads > 0 ? cfg->n_kv_heads : cfg->n_heads;
  if (cfg->dim % cfg->n_heads != 0)
    return err_set(err, errlen, MODEL_EINVAL, "model error: n_heads=%d does not divide dim=%d", cfg->n_heads, cfg->dim);
  if (cfg->n_heads % *kv != 0)
    return err_set(err, errlen, MODEL_EINVAL, "model error: n_kv_heads=%d does not divide n_heads=%d", *kv, cfg->n_heads);
  if ((cfg->dim / cfg->n_heads) % 2 != 0)
    return err_set(err, errlen, MODEL_EINVAL, "model error: head dim %d (dim/n_heads) must be even for RoPE", cfg->dim / cfg->n_heads);
  if (max_b <= 0 || max_t <= 0)
    return err_set(err, errlen, MODEL_EINVAL, "model error: max batch %d x %d tokens must be > 0", max_b, max_t);
  if (cfg->max_seq_len > 0 && max_t > cfg->max_seq_len)
    return err_set(err, errlen, MODEL_EINVAL, "model error: sequence length %d exceeds model.max_seq_len=%d", max_t, cfg->max_seq_len);
  return 0;
}

/* m's dimensions from cfg and opts: the tp group's split of heads, hidden and vocabulary
 * (tp_setup), the dtypes and the batch capacity. */
static int set_dims(model_t *m, const plan_model_t *cfg, int kv, const model_opts_t *opts, char *err, size_t errlen) {
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
  m->tp = 1;
  if (opts->tp && opts->tp->comm && comm_size(opts->tp->comm) > 1) {
    m->tpc = opts->tp->comm;
    m->tp = comm_size(m->tpc);
    m->tp_rank = comm_rank(m->tpc);
    int rc = tp_setup(m, opts->tp, err, errlen);
    if (rc) return rc;
    fault_from_env(m);
  }
  for (int i = 0; i < (int)(sizeof m->pad_ids / sizeof m->pad_ids[0]); i++)
    m->pad_ids[i] = -1;
  m->Hl = m->attn_split ? m->H / m->tp : m->H;
  m->KVl = m->attn_split ? m->KV / m->tp : m->KV;
  m->Fl = m->ffn_split ? m->F / m->tp : m->F;
  m->Vp = (m->V + m->tp - 1) / m->tp * m->tp;
  m->Ve = m->emb_split ? m->Vp / m->tp : m->V;
  m->Vo = m->out_split ? m->Vp / m->tp : m->V;
  m->no_flat = opts->no_flat_buffers;
  m->dt = opts->param_dtype == DT_BF16 ? DT_BF16 : DT_F32;
  m->rdt = opts->reduce_dtype == DT_BF16 ? DT_BF16 : DT_F32;
  m->es = dtype_size(m->dt);
  m->strategy_casts = m->dt != DT_F32 && opts->strategy_casts;
  m->max_b = opts->max_b;
  m->max_t = opts->max_t;
  m->ckpt_every = opts->checkpoint_every > 0 ? opts->checkpoint_every : 0;
  return 0;
}

/* The chunks and units this instance holds, and the tables sized by them. */
static int alloc_tables(model_t *m, const model_opts_t *opts, char *err, size_t errlen) {
  const int L = m->L;
  int rc = setup_chunks(m, opts, err, errlen);
  if (rc) return rc;
  int held = 0;
  for (int c = 0; c < m->n_chunks; c++) held += m->chunks[c].n;
  m->u_embed = m->chunks[0].embed ? 0 : -1;
  m->u_head = m->chunks[m->n_chunks - 1].head ? (m->u_embed + 1) + held : -1;
  m->n_units = (m->u_embed >= 0) + held + (m->u_head >= 0);
  int np, ns, r0;
  batch_rows(m, m->max_b * m->max_t, &np, &ns, &r0);
  m->tensors = calloc((size_t)(9 * L + 3), sizeof *m->tensors);
  m->layer = calloc((size_t)L, sizeof *m->layer);
  m->unit_offset = calloc((size_t)m->n_units, sizeof *m->unit_offset);
  m->unit_numel = calloc((size_t)m->n_units, sizeof *m->unit_numel);
  m->unit_params = calloc((size_t)m->n_units, sizeof *m->unit_params);
  m->unit_grads = calloc((size_t)m->n_units, sizeof *m->unit_grads);
  m->unit_cparams = calloc((size_t)m->n_units, sizeof *m->unit_cparams);
  m->acts = calloc((size_t)L, sizeof *m->acts);
  m->host_losses = calloc((size_t)np, sizeof *m->host_losses);
  if (!m->tensors || !m->layer || !m->unit_offset || !m->unit_numel || !m->unit_params || !m->unit_grads ||
      !m->unit_cparams || !m->acts ||
      !m->host_losses)
    return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
  return 0;
}

/* Tensors in unit order; within a layer, in Meta's order. Shapes are the full ones. Only what
 * this instance holds (its pipeline chunks) is created. Then each unit's offset and size. */
static void add_tensors(model_t *m, const model_opts_t *opts) {
  int L = m->L, C = m->C, HD = m->H * m->D, KD = m->KV * m->D, F = m->F;
  int s_att_col = m->attn_split ? MODEL_TP_ROWS : MODEL_TP_REPLICATED;
  int s_att_row = m->attn_split ? MODEL_TP_COLS : MODEL_TP_REPLICATED;
  int s_ffn_col = m->ffn_split ? MODEL_TP_ROWS : MODEL_TP_REPLICATED;
  int s_ffn_row = m->ffn_split ? MODEL_TP_COLS : MODEL_TP_REPLICATED;
  char name[96];
  m->tok_embeddings = m->norm = m->output = -1;
  if (m->u_embed >= 0)
    m->tok_embeddings = add_tensor(m, "tok_embeddings.weight", m->u_embed, m->V, C, 2, opts->decay_embeddings,
                                   m->emb_split ? MODEL_TP_ROWS : MODEL_TP_REPLICATED);
  for (int l = 0; l < L; l++) {
    int u = m->unit_of_layer[l];
    if (u < 0) continue;
    layer_tensors_t *lt = &m->layer[l];
#define LAYER_TENSOR(field, suffix, rows, cols, ndim, decay, split)                                                    \
  snprintf(name, sizeof name, "layers.%d.%s", l, suffix);                                                              \
  lt->field = add_tensor(m, name, u, rows, cols, ndim, decay, split)
    LAYER_TENSOR(attention_norm, "attention_norm.weight", C, 1, 1, opts->decay_norms, MODEL_TP_REPLICATED);
    LAYER_TENSOR(wq, "attention.wq.weight", HD, C, 2, 1, s_att_col);
    LAYER_TENSOR(wk, "attention.wk.weight", KD, C, 2, 1, s_att_col);
    LAYER_TENSOR(wv, "attention.wv.weight", KD, C, 2, 1, s_att_col);
    LAYER_TENSOR(wo, "attention.wo.weight", C, HD, 2, 1, s_att_row);
    LAYER_TENSOR(ffn_norm, "ffn_norm.weight", C, 1, 1, opts->decay_norms, MODEL_TP_REPLICATED);
    LAYER_TENSOR(w1, "feed_forward.w1.weight", F, C, 2, 1, s_ffn_col);
    LAYER_TENSOR(w2, "feed_forward.w2.weight", C, F, 2, 1, s_ffn_row);
    LAYER_TENSOR(w3, "feed_forward.w3.weight", F, C, 2, 1, s_ffn_col);
#undef LAYER_TENSOR
    /* w3 in memory right after w1, w2 after it (the two have the same size, also per tp shard):
     * W1||W3 is one (2 Fl, C) matrix, one product forward and backward. The tensors' order, and
     * with it every file's, stays Meta's: only the offsets move, which everything else reads per
     * tensor. wq, wk, wv are adjacent already: Wq||Wk||Wv is one ((Hl + 2 KVl) D, C) matrix. */
    size_t o2 = m->tensors[lt->w2].offset;
    m->tensors[lt->w2].offset = m->tensors[lt->w3].offset;
    m->tensors[lt->w3].offset = o2;
  }
  if (m->u_head >= 0) {
    m->norm = add_tensor(m, "norm.weight", m->u_head, C, 1, 1, opts->decay_norms, MODEL_TP_REPLICATED);
    m->output = add_tensor(m, "output.weight", m->u_head, m->V, C, 2, 1,
                           m->out_split ? MODEL_TP_ROWS : MODEL_TP_REPLICATED);
  }
  for (int u = 0; u < m->n_units; u++)
    m->unit_offset[u] = (size_t)-1;
  for (int i = 0; i < m->n_tensors; i++) {
    const model_tensor_t *t = &m->tensors[i];
    if (m->unit_offset[t->unit] == (size_t)-1) m->unit_offset[t->unit] = t->offset;
    m->unit_numel[t->unit] += t->numel;
  }
}

/* The flat parameters and gradients (unless the strategy owns them), the bf16 compute copy
 * (unless the strategy casts) and the activation arena, laid out and bound to slot 0. */
static int alloc_buffers(model_t *m, char *err, size_t errlen) {
  backend_t *be = m->be;
  if (!m->no_flat) {
    m->params = be->alloc(be, m->num_params * sizeof(float));
    m->grads = be->alloc(be, m->num_params * sizeof(float));
  }
  size_t lp_bytes = m->dt != DT_F32 && !m->strategy_casts ? m->num_params * m->es : 0;
  if (lp_bytes) m->params_lp = be->alloc(be, lp_bytes);
  size_t an = layout_acts(m, NULL);
  m->arena = be->alloc(be, an);
  m->arena_bytes = an;
  if ((!m->no_flat && (!m->params || !m->grads)) || !m->arena || (lp_bytes && !m->params_lp)) {
    size_t mb = ((m->no_flat ? 0 : 2 * m->num_params * sizeof(float)) + lp_bytes + an) >> 20;
    return err_set(err, errlen, MODEL_ENOMEM, "model error: cannot allocate %zu MiB for parameters, gradients and activations", mb);
  }
  layout_acts(m, m->arena);
  bind_slot(m, 0, 0);
  for (int u = 0; u < m->n_units; u++)
    model_set_unit_buffers(m, u, NULL, NULL);
  return 0;
}

/* Context parallelism: the ring for batches of max_b sequences of this rank's max_t tokens (two
 * chunks of max_t / 2). Its blocks are chunk against chunk, each square and either on the
 * diagonal or wholly in the past (balanced chunks), so the kernel is chosen on the chunk's shape:
 * the backend's fused one where model.attention and the backend allow it, else its own. */
static int cp_setup(model_t *m, const model_opts_t *opts, int mode, char *err, size_t errlen) {
  const model_cp_t *cp = opts->cp;
  if (!cp || cp->size <= 1) return 0;
  if (m->max_t % 2)
    return err_set(err, errlen, MODEL_EINVAL, "model error: context parallelism holds two chunks of each sequence, "
                   "so a rank's tokens per sequence must be even, got %d", m->max_t);
  int fused = 0;
  int rc = attention_choose(m, mode, m->max_b, m->max_t / 2, &fused, err, errlen);
  if (rc) return rc;
  if (m->be->mem == BACKEND_MEM_DEVICE && comm_memory(cp->send) == COMM_MEM_HOST)
    return err_set(err, errlen, MODEL_EINVAL, "model error: context parallelism on backend %s needs a comm that takes "
                   "device memory; comm %s moves host memory", m->be->name, comm_name(cp->send));
  rc = ring_attention_init(&m->ring, m->be, cp->send, cp->recv, cp->size, cp->rank, m->max_b, m->max_t / 2, m->Hl,
                           m->KVl, m->D, m->dt, err, errlen);
  if (!rc) rc = ring_attention_set_rotate(&m->ring, cp->rotate, cp->overlap, cp->group, err, errlen);
  if (rc) return rc == RING_ENOMEM ? MODEL_ENOMEM : MODEL_EINVAL;
  m->cp = 1;
  log_rank0("attention: context parallel over %d ranks, K/V by %s%s (chunks of %d tokens, %s)", cp->size,
            cp->rotate == RING_ROTATE_ALLGATHER ? "all-gather" : "ring",
            cp->rotate == RING_ROTATE_RING && !cp->overlap ? " without overlap" : "", m->max_t / 2,
            fused ? "blocks on the fused kernel above" : "the backend's block kernels");
  return 0;
}

/* The upload buffers of a whole model (one chunk with the embedding and the head, one slot). */
static int alloc_uploads(model_t *m, char *err, size_t errlen) {
  const chunk_t *ch = &m->chunks[0];
  if (m->n_chunks != 1 || !ch->embed || !ch->head || ch->n_slots != 1) return 0;
  int np, ns, r0;
  batch_rows(m, m->max_b * m->max_t, &np, &ns, &r0);
  const size_t bytes = 2 * (size_t)np * sizeof(int32_t);
  for (int j = 0; j < 2; j++) {
    m->up_dev[j] = m->be->alloc(m->be, bytes);
    m->up_host[j] = m->be->host_alloc_pinned(m->be, bytes);
    if (!m->up_dev[j] || !m->up_host[j])
      return err_set(err, errlen, MODEL_ENOMEM, "model error: cannot allocate 2 x %zu bytes for the batches' uploads",
                     bytes);
  }
  m->be->synchronize(m->be); /* alloc's zeroing (compute stream) is over before a copy writes them */
  return 0;
}

/* m, allocated and given its backend, built up; on a failure the caller destroys it. */
static int model_build(model_t *m, const plan_model_t *cfg, int kv, const model_opts_t *opts, char *err,
                       size_t errlen) {
  int rc;
  if ((rc = set_dims(m, cfg, kv, opts, err, errlen)) || (rc = alloc_tables(m, opts, err, errlen))) return rc;
  add_tensors(m, opts);
  if ((rc = alloc_buffers(m, err, errlen)) || (rc = alloc_uploads(m, err, errlen))) return rc;
  if (m->tp > 1)
    log_debug("model: tp %d/%d: heads %d/%d, kv %d/%d, ffn %d/%d, vocab rows %d+%d (padded %d)%s%s", m->tp_rank, m->tp,
              m->Hl, m->H, m->KVl, m->KV, m->Fl, m->F, m->Ve, m->Vo, m->Vp, m->sp ? ", sequence parallel" : "",
              m->lp ? ", loss parallel" : "");
  if (opts->cp && opts->cp->size > 1) return cp_setup(m, opts, cfg->attention, err, errlen);
  return attention_choose(m, cfg->attention, opts->max_b, opts->max_t, NULL, err, errlen);
}

int model_create_opts(model_t **out, const plan_model_t *cfg, backend_t *be, const model_opts_t *opts, char *err,
                      size_t errlen) {
  *out = NULL;
  if (!cfg || !be || !opts) return err_set(err, errlen, MODEL_EINVAL, "model error: no config, backend or options");
  int kv = 0;
  int rc = check_config(cfg, opts->max_b, opts->max_t, &kv, err, errlen);
  if (rc) return rc;
  model_t *m = calloc(1, sizeof *m);
  if (!m) return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
  m->be = be;
  rc = model_build(m, cfg, kv, opts, err, errlen);
  if (rc) {
    model_destroy(m);
    return rc;
  }
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
  /* One stream per tensor, drawn in chunks of an even number of normals in parallel: chunk c
   * starts its copy of the stream 2 u64 per pair further on (rng_skip), so the values are
   * those of one sequential pass, whatever the thread count (1.5B normals take 30 s on one
   * core). */
  rng_t r0;
  rng_init(&r0, seed, rng_hash_str(t->name));
  const size_t chunk = (size_t)1 << 18;
  const long long chunks = (long long)((n + chunk - 1) / chunk);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (long long c = 0; c < chunks; c++) {
    rng_t r = r0;
    rng_skip(&r, (uint64_t)c * chunk);
    size_t end = (size_t)(c + 1) * chunk < n ? (size_t)(c + 1) * chunk : n;
    for (size_t j = (size_t)c * chunk; j < end; j++)
      full[j] = (float)(rng_normal(&r) * std);
  }
}

/* This rank's slice of a full tensor (host to host). Rows past the full tensor (vocabulary
 * padding on the last ranks) are zero. */
static void slice_of(const model_t *m, const model_tensor_t *t, const float *full, float *local) {
  int rows = t->shape[0], cols = t->shape[1], frows = t->full_shape[0], fcols = t->full_shape[1];
  if (t->tp_split == MODEL_TP_REPLICATED) {
    memcpy(local, full, t->numel * sizeof(float));
  } else if (t->tp_split == MODEL_TP_ROWS) {
    int r0 = m->tp_rank * rows, have = frows - r0;
    have = have < 0 ? 0 : have > rows ? rows : have;
    memcpy(local, full + (size_t)r0 * cols, (size_t)have * cols * sizeof(float));
    memset(local + (size_t)have * cols, 0, (size_t)(rows - have) * cols * sizeof(float));
  } else {
    for (int r = 0; r < rows; r++)
      memcpy(local + (size_t)r * cols, full + (size_t)r * fcols + (size_t)m->tp_rank * cols, cols * sizeof(float));
  }
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
  m->lp_current = 0;
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
  if (i < 0 || i >= m->n_tensors) return MODEL_EINVAL;
  const model_tensor_t *t = &m->tensors[i];
  if (!m->unit_params[t->unit]) {
    log_error("model: export of %s: unit %d is not gathered", t->name, t->unit);
    return MODEL_EINVAL;
  }
  if (t->tp_split == MODEL_TP_REPLICATED) {
    m->be->to_host(m->be, host_full, param_of(m, i), t->numel * sizeof(float));
    return 0;
  }
  /* all_gather the slices (in the backend's memory, as every tp collective), then lay them out
   * on the host: rows concatenate (and drop the vocabulary padding); columns interleave. */
  size_t n = t->numel, tp = (size_t)m->tp;
  float *dev = m->be->alloc(m->be, tp * n * sizeof(float)), *host = malloc(tp * n * sizeof(float));
  int rc = dev && host ? 0 : -1;
  if (rc) log_error("model: export of %s: out of memory", t->name);
  if (!rc) {
    rc = comm_all_gather(m->tpc, param_of(m, i), dev, n, DT_F32);
    if (rc) log_error("model: export of %s: %s", t->name, comm_errmsg(m->tpc));
  }
  if (!rc) {
    m->be->to_host(m->be, host, dev, tp * n * sizeof(float));
    int rows = t->shape[0], cols = t->shape[1], fcols = t->full_shape[1];
    if (t->tp_split == MODEL_TP_ROWS)
      memcpy(host_full, host, (size_t)t->full_shape[0] * fcols * sizeof(float));
    else
      for (int r = 0; r < rows; r++)
        for (size_t k = 0; k < tp; k++)
          memcpy(host_full + (size_t)r * fcols + k * cols, host + k * n + (size_t)r * cols, cols * sizeof(float));
  }
  m->be->free(m->be, dev);
  free(host);
  return rc;
}

void model_import_tensor(model_t *m, int i, const float *host_full) {
  const model_tensor_t *t = &m->tensors[i];
  m->lp_current = 0;
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

void model_set_hooks(model_t *m, model_hooks_t *h) { m->dp = h; }
size_t model_num_params(const model_t *m) { return m->num_params; }
float *model_params(model_t *m) {
  m->lp_current = 0; /* the caller may write through it */
  return m->params;
}
void *model_compute_copy(model_t *m) { return m->params && !m->strategy_casts ? m->params_lp : NULL; }
void model_compute_written(model_t *m) { m->lp_current = model_compute_copy(m) != NULL; }
void model_masters_changed(model_t *m) { m->lp_current = 0; }
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
  m->lp_current = 0;
  m->unit_params[unit] = params ? params : m->params ? m->params + m->unit_offset[unit] : NULL;
  m->unit_grads[unit] = grads ? grads : m->grads ? m->grads + m->unit_offset[unit] : NULL;
  if (m->dt == DT_F32) m->unit_cparams[unit] = m->unit_params[unit];
  else if (!m->strategy_casts) m->unit_cparams[unit] = at(m, m->params_lp, m->unit_offset[unit]);
}

void model_set_unit_compute(model_t *m, int unit, const void *params_lp) {
  if (unit < 0 || unit >= m->n_units || !m->strategy_casts) return;
  m->unit_cparams[unit] = params_lp;
}

dtype_t model_param_dtype(const model_t *m) { return m->dt; }

void model_zero_grad(model_t *m) {
  if (m->grads) m->be->zero(m->be, m->grads, m->num_params * sizeof(float));
  for (int u = 0; u < m->n_units; u++)
    if (m->unit_grads[u] && (!m->grads || m->unit_grads[u] != m->grads + m->unit_offset[u]))
      m->be->zero(m->be, m->unit_grads[u], m->unit_numel[u] * sizeof(float));
}

const float *model_logits(model_t *m) {
  if (!m->logits_out || m->dt == DT_F32) return m->logits_out;
  size_t n = (size_t)m->last_b * m->last_t * m->V;
  if (!m->logits_f32 && !(m->logits_f32 = m->be->alloc(m->be, (size_t)m->max_b * m->max_t * m->V * sizeof(float)))) {
    log_error("model: out of memory for the fp32 copy of the logits (%zu MiB)",
              (size_t)m->max_b * m->max_t * m->V * sizeof(float) >> 20);
    return NULL;
  }
  m->be->convert(m->be, m->logits_f32, DT_F32, m->logits_out, m->dt, n);
  return m->logits_f32;
}
int model_vocab_size(const model_t *m) { return m->V; }

/* ------------------------------------------------------------------ forward */

/* Products of activations and compute copies: operands and output in dt. */
static void mm(model_t *m, void *c, const void *a, const void *b, int rows, int n, int k, int trans_b, float beta) {
  m->be->matmul(m->be, c, a, b, rows, n, k, 0, trans_b, 1.0f, beta, m->dt, m->dt);
}
/* Weight gradients, gw (out, in) fp32 += dy^T x: operands in dt, accumulated in fp32. */
static void mm_dw(model_t *m, float *gw, const void *dy, const void *x, int out, int in) {
  m->be->matmul(m->be, gw, dy, x, out, in, m->Np, 1, 0, 1.0f, 1.0f, m->dt, DT_F32);
}

/* out(local) = resid(local) + in(full) W^T, W (C, K). Sharded (rowwise): in and W hold this
 * rank's K slice, so the product is a partial sum over tp, reduced across the group before the
 * residual add; it returns the reduced product (local rows), which the caller adds (alone, or
 * with the norm that follows: norm_fwd). Replicated: each rank multiplies only its own rows, the
 * residual folded into the product (beta 1 over a copy of resid), and it returns NULL. */
static const void *rowwise_product(model_t *m, void *out, const void *resid, const void *in, const void *w, int k,
                                   int split, const char *what) {
  int C = m->C;
  if (!split) {
    m->be->copy(m->be, out, resid, (size_t)m->Ns * C * m->es);
    mm(m, out, at(m, in, (size_t)m->row0 * k), w, m->Ns, C, k, 1, 1.0f);
    return NULL;
  }
  mm(m, m->sc_full, in, w, m->Np, C, k, 1, 0.0f);
  return rows_from_full(m, m->sc_full, m->sc_loc, C, 1, what);
}

static void rowwise_fwd(model_t *m, void *out, const void *resid, const void *in, const void *w, int k, int split,
                        const char *what) {
  const void *y = rowwise_product(m, out, resid, in, w, k, split, what);
  if (y) m->be->add(m->be, out, resid, y, (size_t)m->Ns * m->C, m->dt);
}

/* xn_full = norm(x) over the local rows, then gathered to all rows under SP (the colwise
 * linears after it need every row). With y (a sharded rowwise product, rowwise_product), x =
 * resid + y is written first, in the norm's kernel (add_rmsnorm_fwd: the same bits). */
static void norm_fwd(model_t *m, void *xn_full, float *rstd, void *x, const void *resid, const void *y, const void *w,
                     const char *what) {
  void *xn = m->sp ? m->xn_loc : xn_full;
  if (y) m->be->add_rmsnorm_fwd(m->be, x, xn, rstd, resid, y, w, m->Ns, m->C, m->eps, m->dt);
  else m->be->rmsnorm_fwd(m->be, xn, rstd, x, w, m->Ns, m->C, m->eps, m->dt);
  rows_to_full(m, xn_full, xn, m->C, what);
}

/* Between the QKV product (m->qkv) and q, k, v: forward, q and k rotated out of it (and v
 * copied); backward (bwd), the gradients m->dq, m->dk rotated back and m->dv packed into it.
 * Positions 0 .. t-1, or under context parallelism each of the rank's two chunks at its own
 * (the chunks' rows are contiguous: chunk-major). */
static void qkv_rope(model_t *m, const layer_acts_t *a, int b, int t, int bwd) {
  backend_t *be = m->be;
  const int H = m->Hl, KV = m->KVl, D = m->D, n = m->cp ? 2 : 1, c = t / n;
  for (int i = 0; i < n; i++) {
    const size_t r = (size_t)i * b * c; /* the chunk's first row */
    const int pos = m->cp ? ring_attention_chunk(&m->ring, i) * c : 0;
    void *qkv = at(m, m->qkv, r * (size_t)(H + 2 * KV) * D);
    if (bwd)
      be->qkv_rope_bwd(be, qkv, at(m, m->dq, r * H * D), at(m, m->dk, r * KV * D), at(m, m->dv, r * KV * D), b, c, H,
                       KV, D, pos, m->theta, m->dt);
    else
      be->qkv_rope_fwd(be, at(m, a->q, r * H * D), at(m, a->k, r * KV * D), at(m, a->v, r * KV * D), qkv, b, c, H,
                       KV, D, pos, m->theta, m->dt);
  }
}

/* The first failure of the ring is the pass's (as tp_check's). */
static void cp_check(model_t *m, int rc) {
  if (!rc || m->comm_rc) return;
  set_error(m, MODEL_ECOMM, "%s", ring_attention_errmsg(&m->ring));
  m->comm_rc = rc;
}

static void attention_forward(model_t *m, layer_acts_t *a, int b, int t) {
  if (!m->cp) {
    m->be->attention_fwd(m->be, a->att, a->lse, a->q, a->k, a->v, b, t, m->Hl, m->KVl, m->D, m->dt);
    return;
  }
  if (!m->comm_rc) cp_check(m, ring_attention_fwd(&m->ring, a->att, a->lse, a->q, a->k, a->v, b));
}

static void attention_backward(model_t *m, layer_acts_t *a, int b, int t) {
  if (!m->cp) {
    m->be->attention_bwd(m->be, m->dq, m->dk, m->dv, m->datt, a->q, a->k, a->v, a->att, a->lse, b, t, m->Hl, m->KVl,
                         m->D, m->dt);
    return;
  }
  if (!m->comm_rc)
    cp_check(m, ring_attention_bwd(&m->ring, m->dq, m->dk, m->dv, m->datt, a->q, a->k, a->v, a->att, a->lse, b));
}

/* One transformer block, x -> out (both local rows (Ns, C)). out NULL: the recomputation of a
 * checkpointed block in its backward, which needs the saved set but not the output, so the
 * last rowwise product (and its collective, on every tp rank alike) is skipped. */
static void block_forward(model_t *m, int l, void *out, int b, int t) {
  backend_t *be = m->be;
  const layer_tensors_t *lt = &m->layer[l];
  layer_acts_t *a = &m->acts[l];
  int N = b * t, Np = m->Np, C = m->C, HD = m->Hl * m->D, KD = m->KVl * m->D, F = m->Fl;

  norm_fwd(m, a->xn_att, a->rstd_att, a->x, NULL, NULL, cparam_of(m, lt->attention_norm),
           "all_gather of attention_norm output");
  /* Wq||Wk||Wv (adjacent from wq on): one product, then q and k rotated on their way out */
  mm(m, m->qkv, a->xn_att, cparam_of(m, lt->wq), Np, HD + 2 * KD, C, 1, 0.0f);
  qkv_rope(m, a, b, t, 0);
  attention_forward(m, a, b, t);
  if (Np > N) be->zero(be, at(m, a->att, (size_t)N * HD), (size_t)(Np - N) * HD * m->es); /* SP padding rows */
  /* x_mid = x + att wo^T, added in ffn_norm's kernel when the product is sharded */
  const void *y = rowwise_product(m, a->x_mid, a->x, a->att, cparam_of(m, lt->wo), HD, m->attn_split,
                                  "reduction of attention.wo output");
  norm_fwd(m, a->xn_ffn, a->rstd_ffn, a->x_mid, a->x, y, cparam_of(m, lt->ffn_norm), "all_gather of ffn_norm output");
  /* W1||W3 (adjacent from w1 on, add_tensors): one product */
  mm(m, a->ag, a->xn_ffn, cparam_of(m, lt->w1), Np, 2 * F, C, 1, 0.0f);
  be->swiglu_fwd(be, a->h, a->ag, Np, F, m->dt);
  /* out = x_mid + h w2^T; its add stays apart from the next norm, which belongs to the next
   * unit (its parameters gathered only then; a checkpointed block recomputes from x) */
  if (out)
    rowwise_fwd(m, out, a->x_mid, a->h, cparam_of(m, lt->w2), F, m->ffn_split, "reduction of feed_forward.w2 output");
}

/* Checks ids on the host; the first bad one is the message. */
static int check_ids(model_t *m, const int32_t *ids, int n, int t, int allow_negative, const char *what) {
  for (int i = 0; i < n; i++) {
    int32_t id = ids[i];
    if ((id < 0 && !allow_negative) || id >= m->V)
      return set_error(m, MODEL_EINVAL, "%s id %d at position %d (sequence %d, t=%d) is outside [0, %d)", what,
                       (int)id, i, i / t, i % t, m->V);
  }
  return 0;
}

/* ids (N) to device rows (Np), the SP padding rows -1. */
static void ids_to_device(model_t *m, int32_t *dev, const int32_t *ids, int n) {
  m->be->to_device(m->be, dev, ids, (size_t)n * sizeof(int32_t));
  if (m->Np > n) m->be->to_device(m->be, dev + n, m->pad_ids, (size_t)(m->Np - n) * sizeof(int32_t));
}

/* The targets among n that count (the others are -1: ignored). */
static int count_targets(const int32_t *targets, int n) {
  int valid = 0;
  for (int i = 0; i < n; i++) valid += targets[i] >= 0;
  return valid;
}

/* n ids into h as np rows: the SP padding rows after them -1, as ids_to_device pads. */
static void put_padded(const model_t *m, int32_t *h, const int32_t *ids, int n, int np) {
  memcpy(h, ids, (size_t)n * sizeof *h);
  memcpy(h + n, m->pad_ids, (size_t)(np - n) * sizeof *h);
}

/* A whole model's ids through the backend's uploads (backend.h): the pinned copy of slot
 * up_next, padded to Np rows as ids_to_device pads, goes up on the copy stream while the device
 * still computes the micro-batch before (the host runs ahead of it: a step does not wait for the
 * device), and the compute stream waits for it before the embedding. The slot's device buffer
 * becomes the batch's ids until the other slot's next upload: the backward of this micro-batch
 * reads them before the next forward. */
static void upload_ids(model_t *m, slot_t *sl, const int32_t *tokens, const int32_t *targets, int n) {
  backend_t *be = m->be;
  const int j = m->up_next, Np = m->Np;
  int32_t *h = m->up_host[j];
  m->up_next ^= 1;
  be->upload_host_wait(be, j);
  put_padded(m, h, tokens, n, Np);
  if (targets) put_padded(m, h + Np, targets, n, Np);
  be->upload_async(be, m->up_dev[j], h, (targets ? 2 : 1) * (size_t)Np * sizeof *h, j);
  be->upload_wait(be, j);
  sl->tokens_dev = m->tokens_dev = m->up_dev[j];
  sl->targets_dev = m->targets_dev = m->up_dev[j] + Np;
}

/* A forward's ids from the host: through the uploads (a whole model) or copied into the ids of
 * the chunk's embedding and head; the count of targets that count. */
static void batch_ids(model_t *m, int c, int k, const int32_t *tokens, const int32_t *targets, int n) {
  const chunk_t *ch = &m->chunks[c];
  if (m->up_dev[0]) upload_ids(m, &m->chunks[c].slots[k], tokens, targets, n);
  else if (ch->embed) ids_to_device(m, m->tokens_dev, tokens, n);
  if (!ch->head || !targets) return;
  if (!m->up_dev[0]) ids_to_device(m, m->targets_dev, targets, n);
  m->n_valid = count_targets(targets, n);
}

/* Micro-batch i of the ids staged last (model_stage) becomes the forward's. */
static void staged_ids(model_t *m, slot_t *sl, int i) {
  int32_t *ids = m->stage_dev[m->stage_par] + (size_t)i * 2 * m->Np;
  sl->tokens_dev = m->tokens_dev = ids;
  sl->targets_dev = m->targets_dev = ids + m->Np;
  m->n_valid = m->stage_valid[i];
}

/* Valid vocabulary columns of this rank's output shard (the last ones may be padding). */
static int shard_vocab(const model_t *m) {
  int v = m->V - m->tp_rank * m->Vo;
  return v < 0 ? 0 : v > m->Vo ? m->Vo : v;
}

/* Output colwise: all_gather every rank's (Np, Vo) logits, then lay the column blocks side by
 * side into logits_full (Np, V), dropping padding columns. */
static void gather_logits(model_t *m) {
  tp_all_gather(m, m->logits_gather, m->logits, (size_t)m->Np * m->Vo, "all_gather of logits");
  for (int r = 0; r < m->tp; r++) {
    int cols = m->V - r * m->Vo;
    cols = cols > m->Vo ? m->Vo : cols;
    if (cols > 0)
      m->be->copy_2d(m->be, at(m, m->logits_full, (size_t)r * m->Vo), m->V,
                     at(m, m->logits_gather, (size_t)r * m->Np * m->Vo), m->Vo, m->Np, cols, m->dt);
  }
}

/* The checks and the slot every chunk call starts with: a chunk and slot that exist, and no
 * earlier tp failure. */
static int enter_chunk(model_t *m, int c, int k, const char *what) {
  m->err[0] = '\0';
  if (c < 0 || c >= m->n_chunks || k < 0 || k >= m->chunks[c].n_slots)
    return set_error(m, MODEL_EINVAL, "%s of chunk %d slot %d: this model has %d chunks (%d slots in the first)", what,
                     c, k, m->n_chunks, m->chunks[0].n_slots);
  if (m->comm_rc)
    return set_error(m, MODEL_ECOMM, "an earlier tensor-parallel collective failed (%s); the tp group is unusable",
                     comm_errmsg(m->tpc));
  bind_slot(m, c, k);
  return 0;
}

/* The embedding of the batch's tokens (m->tokens_dev) into the first block's input. */
static int embed_forward(model_t *m) {
  backend_t *be = m->be;
  const int C = m->C;
  int rc;
  if ((rc = dp_gather(m, m->u_embed, 0))) return rc;
  void *x0 = m->acts[0].x;
  const void *table = cparam_of(m, m->tok_embeddings);
  if (m->emb_split) {
    /* vocab-parallel: rows [tp_rank * Ve, ...) here, zero rows for the other tokens; the sum
     * over tp is the embedding (reduce-scattered onto this rank's rows under SP) */
    void *y = m->sp ? m->sc_full : x0;
    be->embedding_fwd(be, y, table, m->tokens_dev, m->Np, C, m->tp_rank * m->Ve, m->Ve, m->dt);
    rows_from_full(m, y, x0, C, 1, "reduction of tok_embeddings output");
  } else {
    be->embedding_fwd(be, x0, table, m->tokens_dev + m->row0, m->Ns, C, 0, m->V, m->dt);
  }
  return dp_release(m, m->u_embed, 0);
}

/* What a forward does with its loss. Without targets: nothing. With them, either read back and
 * averaged into *loss, or left on the device (copied to rows, the count of targets in *valid);
 * with grad (rows only) the same pass over the logits also writes their gradient, scaled by
 * loss_scale / (targets that count), over the logits (their last use), for the backward. */
typedef struct {
  float *loss;
  float *rows;
  int *valid;
  int grad;
  float loss_scale;
  int staged; /* 1 + the staged micro-batch whose ids the forward runs (model_stage), 0: none */
} loss_req_t;

/* The cross-entropy of the head, the same on every tp rank: the per-row losses, and where gs is
 * not NULL the logits' gradient scaled by *gs over this rank's logits (the full rows' gradient
 * kept to this rank's columns where the logits were gathered). */
static void head_cross_entropy(model_t *m, const float *gs) {
  backend_t *be = m->be;
  const int Np = m->Np;
  const float scale = gs ? *gs : 1.0f;
  if (!m->out_split) {
    be->cross_entropy(be, m->losses, gs ? m->logits : NULL, m->logits, m->targets_dev, Np, m->V, m->V, scale, m->dt);
  } else if (m->lp) {
    int v = shard_vocab(m), v0 = m->tp_rank * m->Vo;
    be->ce_shard_loss(be, m->losses, gs ? m->logits : NULL, m->logits, m->ce_max, m->ce_stats, m->targets_dev, Np, v,
                      m->Vo, v0, scale, m->dt);
  } else {
    /* every rank has the gathered logits and the full gradient; it keeps its columns */
    be->cross_entropy(be, m->losses, gs ? m->logits_full : NULL, m->logits_full, m->targets_dev, Np, m->V, m->V, scale,
                      m->dt);
    if (!gs) return;
    be->zero(be, m->logits, (size_t)Np * m->Vo * m->es);
    be->copy_2d(be, m->logits, m->Vo, at(m, m->logits_full, (size_t)m->tp_rank * m->Vo), m->V, Np, shard_vocab(m),
                m->dt);
  }
}

/* The head after its product: with targets every rank ends with the same per-row losses (and
 * with q->grad the logits' gradient); m->logits_out is left on the logits a caller may read,
 * NULL where their gradient overwrote them. */
static void head_losses(model_t *m, int has_targets, const loss_req_t *q) {
  backend_t *be = m->be;
  const int Np = m->Np;
  m->last_gathered = 0;
  if (!m->out_split) {
    m->logits_out = m->logits;
  } else if (m->lp && has_targets) {
    /* loss parallel: the softmax denominators from per-shard pieces, logits never gathered */
    int v = shard_vocab(m), v0 = m->tp_rank * m->Vo;
    be->ce_shard_max(be, m->ce_max, m->logits, Np, v, m->Vo, m->dt);
    tp_all_reduce(m, m->ce_max, (size_t)Np, DT_F32, COMM_MAX, "all_reduce(max) of logit row maxima");
    be->ce_shard_stats(be, m->ce_stats, m->logits, m->ce_max, m->targets_dev, Np, v, m->Vo, v0, m->dt);
    tp_all_reduce(m, m->ce_stats, 2 * (size_t)Np, DT_F32, COMM_SUM, "all_reduce of exp sums and target logits");
  } else {
    gather_logits(m);
    m->last_gathered = 1;
    m->logits_out = m->logits_full;
  }
  if (!has_targets) return;
  if (q->grad) {
    float gs = m->n_valid > 0 ? q->loss_scale / (float)m->n_valid : 0.0f;
    head_cross_entropy(m, &gs);
    m->grad_ready = 1;
    m->grad_scale = q->loss_scale;
    m->logits_out = NULL;
  } else {
    head_cross_entropy(m, NULL);
  }
}

int model_forward(model_t *m, const int32_t *tokens, const int32_t *targets, int b, int t, float *loss) {
  if (m->n_chunks != 1 || !m->chunks[0].embed || !m->chunks[0].head) {
    if (loss) *loss = NAN;
    return set_error(m, MODEL_EINVAL, "model_forward needs the whole model; this instance holds pipeline chunks "
                     "(model_chunk_forward)");
  }
  return model_chunk_forward(m, 0, 0, tokens, targets, b, t, loss);
}

static int chunk_forward(model_t *m, int c, int k, const int32_t *tokens, const int32_t *targets, int b, int t,
                         const loss_req_t *q);

/* The loss of a forward with targets, as q asks (the count of targets was taken before the head). */
static void forward_loss(model_t *m, int N, const loss_req_t *q) {
  backend_t *be = m->be;
  m->last_has_targets = 1;
  if (q->rows) {
    be->copy(be, q->rows, m->losses, (size_t)N * sizeof(float));
    *q->valid = m->n_valid;
    return;
  }
  be->to_host(be, m->host_losses, m->losses, (size_t)N * sizeof(float));
  if (q->loss) *q->loss = model_loss_of_rows(m->host_losses, N, m->n_valid);
}

float model_loss_of_rows(const float *rows, int n, int valid) {
  /* an ignored target's row is +0: adding it leaves the sum as summing only the others does */
  double sum = 0.0;
  for (int i = 0; i < n; i++) sum += rows[i];
  return valid > 0 ? (float)(sum / valid) : 0.0f;
}

int model_chunk_forward(model_t *m, int c, int k, const int32_t *tokens, const int32_t *targets, int b, int t,
                        float *loss) {
  const loss_req_t q = {.loss = loss};
  return chunk_forward(m, c, k, tokens, targets, b, t, &q);
}

int model_forward_rows(model_t *m, const int32_t *tokens, const int32_t *targets, int b, int t, float *rows,
                       int *valid, float loss_scale) {
  *valid = 0;
  if (!targets || !rows) return set_error(m, MODEL_EINVAL, "model_forward_rows needs targets and a rows buffer");
  if (m->n_chunks != 1 || !m->chunks[0].embed || !m->chunks[0].head)
    return set_error(m, MODEL_EINVAL, "model_forward_rows needs the whole model; this instance holds pipeline chunks");
  const loss_req_t q = {.rows = rows, .valid = valid, .grad = loss_scale != 0.0f, .loss_scale = loss_scale};
  return chunk_forward(m, 0, 0, tokens, targets, b, t, &q);
}

/* The staged buffers hold n micro-batches of np padded rows (2 ids a row) from here on. */
static int stage_room(model_t *m, int n, int np) {
  const size_t need = (size_t)n * 2 * np;
  if (need <= m->stage_cap) return 0;
  backend_t *be = m->be;
  int *valid = realloc(m->stage_valid, (size_t)n * sizeof *valid);
  if (!valid) return set_error(m, MODEL_ENOMEM, "out of memory for %d micro-batches' counts", n);
  m->stage_valid = valid;
  m->stage_cap = 0;
  for (int j = 0; j < 2; j++) { /* a free waits for the device: nothing still reads the old ones */
    be->free(be, m->stage_dev[j]);
    be->host_free_pinned(be, m->stage_host[j]);
    m->stage_dev[j] = be->alloc(be, need * sizeof(int32_t));
    m->stage_host[j] = be->host_alloc_pinned(be, need * sizeof(int32_t));
    if (!m->stage_dev[j] || !m->stage_host[j])
      return set_error(m, MODEL_ENOMEM, "cannot allocate 2 x %zu bytes for a step's staged ids", need * sizeof(int32_t));
  }
  be->synchronize(be); /* alloc's zeroing (compute stream) is over before a copy writes them */
  m->stage_cap = need;
  return 0;
}

int model_stage_reserve(model_t *m, int n, int b, int t) {
  m->err[0] = '\0';
  if (n <= 0 || b <= 0 || t <= 0 || b > m->max_b || t > m->max_t)
    return set_error(m, MODEL_EINVAL, "%d micro-batches of %d x %d tokens outside the model's capacity %d x %d", n, b,
                     t, m->max_b, m->max_t);
  int np, ns, r0;
  batch_rows(m, b * t, &np, &ns, &r0);
  return stage_room(m, n, np);
}

int model_stage(model_t *m, const int32_t *tokens, const int32_t *targets, int n, int b, int t, int *valid) {
  if (m->n_chunks != 1 || !m->up_dev[0] || !tokens || !targets)
    return set_error(m, MODEL_EINVAL, "model_stage needs the whole model, tokens and targets");
  int rc = model_stage_reserve(m, n, b, t); /* the capacity checked; room made if not reserved */
  if (rc) return rc;
  const int N = b * t;
  int np, ns, r0;
  batch_rows(m, N, &np, &ns, &r0);
  for (int i = 0; i < n; i++)
    if ((rc = check_ids(m, tokens + (size_t)i * N, N, t, 0, "token")) ||
        (rc = check_ids(m, targets + (size_t)i * N, N, t, 1, "target")))
      return rc;
  backend_t *be = m->be;
  const int j = m->stage_n ? m->stage_par ^ 1 : 0;
  be->upload_host_wait(be, j);
  for (int i = 0; i < n; i++) {
    int32_t *h = m->stage_host[j] + (size_t)i * 2 * np;
    const int32_t *tg = targets + (size_t)i * N;
    put_padded(m, h, tokens + (size_t)i * N, N, np);
    put_padded(m, h + np, tg, N, np);
    m->stage_valid[i] = valid[i] = count_targets(tg, N);
  }
  be->upload_async(be, m->stage_dev[j], m->stage_host[j], (size_t)n * 2 * np * sizeof(int32_t), j);
  be->upload_wait(be, j);
  m->stage_par = j;
  m->stage_n = n;
  m->stage_b = b;
  m->stage_t = t;
  return j;
}

int model_forward_staged(model_t *m, int i, int b, int t, float *rows, int *valid, float loss_scale) {
  *valid = 0;
  if (!rows || i < 0 || i >= m->stage_n || b != m->stage_b || t != m->stage_t)
    return set_error(m, MODEL_EINVAL, "model_forward_staged: micro-batch %d of %d x %d tokens was not staged (%d of "
                     "%d x %d were)", i + 1, b, t, m->stage_n, m->stage_b, m->stage_t);
  const loss_req_t q = {.rows = rows, .valid = valid, .grad = loss_scale != 0.0f, .loss_scale = loss_scale,
                        .staged = i + 1};
  return chunk_forward(m, 0, 0, NULL, NULL, b, t, &q);
}

static int chunk_forward(model_t *m, int c, int k, const int32_t *tokens, const int32_t *targets, int b, int t,
                         const loss_req_t *q) {
  int rc;
  if (q->loss) *q->loss = NAN;
  if ((rc = enter_chunk(m, c, k, "forward"))) return rc;
  const chunk_t *ch = &m->chunks[c];
  m->last_ok = 0;
  m->last_has_targets = 0;
  m->grad_ready = 0;
  m->logits_out = NULL;
  save_slot(m, c, k);
  const int staged = q->staged > 0, has_targets = targets || staged;
  if ((ch->embed && !tokens && !staged) || b <= 0 || t <= 0 || b > m->max_b || t > m->max_t)
    return set_error(m, MODEL_EINVAL, "batch %d x %d tokens outside the model's capacity %d x %d%s", b, t, m->max_b,
                     m->max_t, tokens || staged || !ch->embed ? "" : " (or no tokens)");
  int N = b * t, C = m->C;
  if (ch->embed && !staged && (rc = check_ids(m, tokens, N, t, 0, "token")) != 0) return rc;
  if (ch->head && targets && (rc = check_ids(m, targets, N, t, 1, "target")) != 0) return rc;
  if (ch->head && has_targets && ++m->passes == m->fault_pass && !m->fault_bwd) comm_fail_next(m->tpc); /* tests */
  batch_rows(m, N, &m->Np, &m->Ns, &m->row0);
  int Np = m->Np;
  if (staged) staged_ids(m, &m->chunks[c].slots[k], q->staged - 1);
  else batch_ids(m, c, k, tokens, targets, N);

  if (ch->embed && (rc = embed_forward(m))) return rc;

  const int end = ch->first + ch->n;
  for (int l = ch->first; l < end; l++) {
    if ((rc = dp_gather(m, m->unit_of_layer[l], 0))) return rc;
    block_forward(m, l, l + 1 < end ? m->acts[l + 1].x : ch->head ? m->x_final : ch->slots[k].y, b, t);
    if ((rc = dp_release(m, m->unit_of_layer[l], 0))) return rc;
  }
  m->last_b = b;
  m->last_t = t;
  if (!ch->head) {
    if (m->comm_rc) return MODEL_ECOMM;
    m->last_ok = 1;
    save_slot(m, c, k);
    if (q->loss) *q->loss = 0.0f;
    return 0;
  }

  int uo = m->u_head;
  if ((rc = dp_gather(m, uo, 0))) return rc;
  norm_fwd(m, m->xn_final, m->rstd_final, m->x_final, NULL, NULL, cparam_of(m, m->norm), "all_gather of norm output");
  mm(m, m->logits, m->xn_final, cparam_of(m, m->output), Np, m->Vo, C, 1, 0.0f);
  if ((rc = dp_release(m, uo, 0))) return rc;

  head_losses(m, has_targets, q);
  if (m->comm_rc) return MODEL_ECOMM;

  m->last_ok = 1;
  save_slot(m, c, k);
  if (!has_targets) {
    if (q->loss) *q->loss = 0.0f;
    return 0;
  }
  forward_loss(m, N, q);
  save_slot(m, c, k);
  return 0;
}

/* ------------------------------------------------------------------ backward */

/* Backward of rowwise_fwd: from d(out) = m->dres (local rows), gw += dy^T in and din = dy W
 * over all rows. Every rank needs the output gradient of every row (its slice of W touched
 * all of them): all_gather under SP, which also serves the replicated case. */
static void rowwise_bwd(model_t *m, void *din, const void *in, const void *w, float *gw, int k, const char *what) {
  int C = m->C;
  const void *dy = rows_to_full(m, m->sc_full, m->dres, C, what);
  mm_dw(m, gw, dy, in, C, k);
  mm(m, din, dy, w, m->Np, k, C, 0, 0.0f);
}

/* Backward of norm_fwd: m->dxn (all rows) holds d(xn), partial over tp when the linears that
 * read xn are sharded; reduce it onto the local rows, then the norm's backward adds into
 * m->dres. Under SP the weight's gradient covers only the local rows: it is summed over tp
 * (the weight is replicated) before it joins the accumulated gradient, which is why it goes
 * through a scratch buffer rather than into gw directly. */
static void norm_bwd(model_t *m, int wi, const void *x, const float *rstd, int partial, const char *what) {
  backend_t *be = m->be;
  int C = m->C;
  const void *dxn = rows_from_full(m, m->dxn, m->sc_loc, C, partial, what);
  if (!m->sp) {
    be->rmsnorm_bwd(be, m->dres, grad_of(m, wi), dxn, x, cparam_of(m, wi), rstd, m->Ns, C, m->dt);
    return;
  }
  be->zero(be, m->dnorm, (size_t)C * sizeof(float));
  be->rmsnorm_bwd(be, m->dres, m->dnorm, dxn, x, cparam_of(m, wi), rstd, m->Ns, C, m->dt);
  /* a gradient reduction: in reduce_dtype (the fp32 sum of bf16-rounded shares in bf16) */
  if (m->rdt == DT_F32) {
    tp_all_reduce(m, m->dnorm, (size_t)C, DT_F32, COMM_SUM, "all_reduce of a norm weight gradient");
  } else {
    be->convert(be, m->dnorm_lp, m->rdt, m->dnorm, DT_F32, (size_t)C);
    tp_all_reduce(m, m->dnorm_lp, (size_t)C, m->rdt, COMM_SUM, "all_reduce of a norm weight gradient");
    be->convert(be, m->dnorm, DT_F32, m->dnorm_lp, m->rdt, (size_t)C);
  }
  be->add(be, grad_of(m, wi), grad_of(m, wi), m->dnorm, (size_t)C, DT_F32);
}

/* On entry m->dres holds d(block output) (local rows); on return d(block input) (the skip
 * connections are the accumulation into dres). */
static void block_backward(model_t *m, int l, int b, int t) {
  backend_t *be = m->be;
  const layer_tensors_t *lt = &m->layer[l];
  layer_acts_t *a = &m->acts[l];
  int Np = m->Np, C = m->C, HD = m->Hl * m->D, KD = m->KVl * m->D, F = m->Fl, QKV = HD + 2 * KD;

  /* out = x_mid + h w2^T */
  rowwise_bwd(m, m->dh, a->h, cparam_of(m, lt->w2), grad_of(m, lt->w2), F, "all_gather of feed_forward gradient");
  be->swiglu_bwd(be, m->dag, m->dh, a->ag, Np, F, m->dt);
  mm_dw(m, grad_of(m, lt->w1), m->dag, a->xn_ffn, 2 * F, C); /* W1||W3's gradient, adjacent as they are */
  mm(m, m->dxn, m->dag, cparam_of(m, lt->w1), Np, C, 2 * F, 0, 0.0f);
  norm_bwd(m, lt->ffn_norm, a->x_mid, a->rstd_ffn, m->ffn_split, "reduction of ffn_norm output gradient");

  /* x_mid = x + att wo^T */
  rowwise_bwd(m, m->datt, a->att, cparam_of(m, lt->wo), grad_of(m, lt->wo), HD, "all_gather of attention gradient");
  attention_backward(m, a, b, t);
  const size_t rows = (size_t)b * t, pad = (size_t)Np - rows; /* qkv_rope_bwd writes B*T rows; SP padding is 0 */
  if (pad) be->zero(be, at(m, m->qkv, rows * QKV), pad * QKV * m->es);
  qkv_rope(m, a, b, t, 1);
  mm_dw(m, grad_of(m, lt->wq), m->qkv, a->xn_att, QKV, C); /* Wq||Wk||Wv's gradient */
  mm(m, m->dxn, m->qkv, cparam_of(m, lt->wq), Np, C, QKV, 0, 0.0f);
  norm_bwd(m, lt->attention_norm, a->x, a->rstd_att, m->attn_split, "reduction of attention_norm output gradient");
}

int model_forward_ok(const model_t *m) { return m->last_ok; }

int model_backward(model_t *m, float loss_scale) {
  if (m->n_chunks != 1 || !m->chunks[0].embed || !m->chunks[0].head)
    return set_error(m, MODEL_EINVAL, "model_backward needs the whole model; this instance holds pipeline chunks "
                     "(model_chunk_backward)");
  return model_chunk_backward(m, 0, 0, loss_scale);
}

/* The head's backward: d(loss) -> d(x_final) in m->dres. */
static int head_backward(model_t *m, float loss_scale) {
  backend_t *be = m->be;
  int rc, Np = m->Np, C = m->C;
  /* dlogits (this rank's columns) overwrite the logits (their last use), unless the forward
   * already wrote them for this loss_scale (model_forward_rows) */
  if (!m->grad_ready || m->grad_scale != loss_scale) {
    float gs = m->n_valid > 0 ? loss_scale / (float)m->n_valid : 0.0f;
    head_cross_entropy(m, &gs);
  }
  m->grad_ready = 0;
  int uo = m->u_head;
  if ((rc = dp_gather(m, uo, 1))) return rc;
  mm_dw(m, grad_of(m, m->output), m->logits, m->xn_final, m->Vo, C);
  mm(m, m->dxn, m->logits, cparam_of(m, m->output), Np, C, m->Vo, 0, 0.0f);
  be->zero(be, m->dres, (size_t)m->Ns * C * m->es);
  norm_bwd(m, m->norm, m->x_final, m->rstd_final, m->out_split, "reduction of norm output gradient");
  if ((rc = dp_reduce(m, uo)) || (rc = dp_release(m, uo, 1))) return rc;
  return 0;
}

int model_chunk_backward(model_t *m, int c, int k, float loss_scale) {
  backend_t *be = m->be;
  int rc;
  if ((rc = enter_chunk(m, c, k, "backward"))) return rc;
  const chunk_t *ch = &m->chunks[c];
  if (!m->last_ok || (ch->head && !m->last_has_targets))
    return set_error(m, MODEL_EINVAL, "the backward of chunk %d slot %d needs a successful forward%s there first", c, k,
                     ch->head ? " with targets" : "");
  if (ch->head && m->passes == m->fault_pass && m->fault_bwd) comm_fail_next(m->tpc); /* tests only */
  int C = m->C;
  m->chunks[c].slots[k].ok = m->last_ok = 0;
  if (ch->head) {
    if ((rc = head_backward(m, loss_scale))) return rc;
  } else { /* d(output), received over the output the forward left there */
    be->copy(be, m->dres, ch->slots[k].y, (size_t)m->Ns * C * m->es);
  }

  for (int l = ch->first + ch->n - 1; l >= ch->first; l--) {
    const int u = m->unit_of_layer[l];
    if ((rc = dp_gather(m, u, 1))) return rc;
    if (checkpointed(m, l)) block_forward(m, l, NULL, m->last_b, m->last_t);
    block_backward(m, l, m->last_b, m->last_t);
    if ((rc = dp_reduce(m, u)) || (rc = dp_release(m, u, 1))) return rc;
  }

  if (!ch->embed) { /* d(input), for the previous stage, where the input was (no longer needed) */
    be->copy(be, m->acts[ch->first].x, m->dres, (size_t)m->Ns * C * m->es);
    return m->comm_rc ? MODEL_ECOMM : 0;
  }
  int Np = m->Np;
  if ((rc = dp_gather(m, m->u_embed, 1))) return rc;
  /* the embedding's gradient needs every row's residual gradient (all_gather under SP): the
   * vocab shard's rows come from any position, and a replicated table stays identical */
  const void *dy = rows_to_full(m, m->sc_full, m->dres, C, "all_gather of the embedding gradient");
  if (m->emb_split)
    be->embedding_bwd(be, grad_of(m, m->tok_embeddings), dy, m->tokens_dev, Np, C, m->tp_rank * m->Ve, m->Ve, m->dt);
  else
    be->embedding_bwd(be, grad_of(m, m->tok_embeddings), dy, m->tokens_dev, Np, C, 0, m->V, m->dt);
  if ((rc = dp_reduce(m, m->u_embed)) || (rc = dp_release(m, m->u_embed, 1))) return rc;
  return m->comm_rc ? MODEL_ECOMM : 0;
}

void *model_chunk_input(model_t *m, int c, int k) {
  if (c < 0 || c >= m->n_chunks || k < 0 || k >= m->chunks[c].n_slots) return NULL;
  return m->chunks[c].slots[k].acts[0].x;
}

void *model_chunk_output(model_t *m, int c, int k) {
  if (c < 0 || c >= m->n_chunks || k < 0 || k >= m->chunks[c].n_slots) return NULL;
  return m->chunks[c].slots[k].y;
}

size_t model_boundary_numel(const model_t *m, int b, int t) {
  int np, ns, r0;
  batch_rows(m, b * t, &np, &ns, &r0);
  return (size_t)ns * (size_t)m->C;
}


const char *model_errmsg(const model_t *m) { return m->err; }

/* ------------------------------------------------------------------ KV-cache decoding */

/* Decode attention spans the cache rounded up to this many positions (model.h). */
#define KV_SPAN_BLOCK 64

struct model_kv {
  model_t *m;
  int max_t, len;
  void *mem;      /* one backend allocation, carved by kv_layout */
  void *kc, *vc;  /* (L, KV, max_t, D) dt: per layer and kv head, keys after RoPE and values by position */
  /* one layer's activations for up to max_t rows, as block_forward's (dt unless fp32) */
  void *x;        /* (n, C) the residual stream */
  void *xn;       /* (n, C) a norm's output */
  float *rstd;    /* (n) fp32 */
  void *qkv;      /* (n, (H + 2*KV)*D) the fused product */
  void *q;        /* (n, H*D) after RoPE */
  void *k, *v;    /* (n, KV*D) the new positions' keys (after RoPE) and values */
  void *att;      /* (n, H*D) */
  float *lse;     /* (H, n) fp32 */
  void *x_mid;    /* (n, C) */
  void *ag;       /* (n, 2*F) a then g per row */
  void *h;        /* (n, F) */
  void *scores;   /* (H, span_max) one query's scores, then its probabilities */
  float *rowmax;  /* (H) fp32 */
  float *stats;   /* (2H) fp32 */
  float *losses;  /* (H) fp32, unused output of ce_shard_loss */
  int32_t *outside; /* (H) a target id outside every scores row (INT32_MAX) */
  int32_t *tokens;  /* (max_t) */
  void *logits;     /* (V) dt */
  float *logits32;  /* (V) fp32: logits itself in fp32, a widened copy in bf16 */
  int span_max;     /* max_t rounded up to KV_SPAN_BLOCK */
};

/* Lays the cache and scratch out from base (NULL: only counts); returns the bytes. */
static size_t kv_layout(model_kv_t *kv, void *base) {
  const model_t *m = kv->m;
  size_t T = (size_t)kv->max_t, C = m->C, HD = (size_t)m->H * m->D, KD = (size_t)m->KV * m->D, F = m->F,
         es = m->es, f4 = sizeof(float), off = 0;
  kv->kc = carve(base, &off, (size_t)m->L * KD * T, es);
  kv->vc = carve(base, &off, (size_t)m->L * KD * T, es);
  kv->x = carve(base, &off, T * C, es);
  kv->xn = carve(base, &off, T * C, es);
  kv->rstd = carve(base, &off, T, f4);
  kv->qkv = carve(base, &off, T * (HD + 2 * KD), es);
  kv->q = carve(base, &off, T * HD, es);
  kv->k = carve(base, &off, T * KD, es);
  kv->v = carve(base, &off, T * KD, es);
  kv->att = carve(base, &off, T * HD, es);
  kv->lse = carve(base, &off, (size_t)m->H * T, f4);
  kv->x_mid = carve(base, &off, T * C, es);
  kv->ag = carve(base, &off, T * 2 * F, es);
  kv->h = carve(base, &off, T * F, es);
  kv->scores = carve(base, &off, (size_t)m->H * kv->span_max, es);
  kv->rowmax = carve(base, &off, (size_t)m->H, f4);
  kv->stats = carve(base, &off, 2 * (size_t)m->H, f4);
  kv->losses = carve(base, &off, (size_t)m->H, f4);
  kv->outside = carve(base, &off, (size_t)m->H, sizeof(int32_t));
  kv->tokens = carve(base, &off, T, sizeof(int32_t));
  kv->logits = carve(base, &off, (size_t)m->V, es);
  kv->logits32 = m->dt == DT_F32 ? kv->logits : carve(base, &off, (size_t)m->V, f4);
  return off;
}

int model_kv_create(model_kv_t **out, model_t *m, int max_t, char *err, size_t errlen) {
  *out = NULL;
  backend_t *be = m->be;
  if (m->tp > 1 || m->cp || m->n_chunks != 1 || !m->chunks[0].embed || !m->chunks[0].head)
    return err_set(err, errlen, MODEL_EINVAL, "model error: KV-cache decoding needs the whole model on one process (no "
                   "tensor or context parallelism, no pipeline chunks)");
  if (m->dt != DT_F32 && m->strategy_casts)
    return err_set(err, errlen, MODEL_EINVAL, "model error: KV-cache decoding in bf16 needs the model's own compute copy "
                   "(strategy_casts 0)");
  if (max_t < 1) return err_set(err, errlen, MODEL_EINVAL, "model error: a KV cache of %d positions", max_t);
  if (!be->copy_2d || !be->ce_shard_max || !be->ce_shard_stats || !be->ce_shard_loss)
    return err_set(err, errlen, MODEL_EINVAL, "model error: backend %s lacks copy_2d or ce_shard_* (KV-cache decoding)",
                   be->name);
  model_kv_t *kv = calloc(1, sizeof *kv);
  if (!kv) return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
  kv->m = m;
  kv->max_t = max_t;
  kv->span_max = (max_t + KV_SPAN_BLOCK - 1) / KV_SPAN_BLOCK * KV_SPAN_BLOCK;
  size_t bytes = kv_layout(kv, NULL);
  if (!(kv->mem = be->alloc(be, bytes))) { /* zeroed: cache rows not yet written hold 0 */
    free(kv);
    return err_set(err, errlen, MODEL_ENOMEM, "model error: cannot allocate %zu MiB for a KV cache of %d positions",
                   bytes >> 20, max_t);
  }
  kv_layout(kv, kv->mem);
  int32_t *outside = malloc((size_t)m->H * sizeof *outside);
  if (!outside) {
    model_kv_destroy(kv);
    return err_set(err, errlen, MODEL_ENOMEM, "model error: out of memory");
  }
  for (int i = 0; i < m->H; i++) outside[i] = INT32_MAX;
  be->to_device(be, kv->outside, outside, (size_t)m->H * sizeof *outside);
  free(outside);
  *out = kv;
  return 0;
}

void model_kv_destroy(model_kv_t *kv) {
  if (!kv) return;
  kv->m->be->free(kv->m->be, kv->mem);
  free(kv);
}

void model_kv_reset(model_kv_t *kv) { kv->len = 0; }
int model_kv_len(const model_kv_t *kv) { return kv->len; }
const float *model_kv_logits(const model_kv_t *kv) { return kv->logits32; }

/* The one query of a decode step (kv->q, (1, H, D)) against layer l's cache of t positions,
 * into kv->att. Per kv head j, its G = H/KV query heads are G contiguous rows of q:
 *   scores (G, span) = q_j K_j^T / sqrt(D)   (K_j: the head's (max_t, D) cache rows)
 *   probabilities    = softmax over the first t columns (0 on the rest, up to span)
 *   att_j (G, D)     = probabilities V_j */
static void kv_attention(model_kv_t *kv, int l, int t) {
  model_t *m = kv->m;
  backend_t *be = m->be;
  const int H = m->H, KV = m->KV, D = m->D, G = H / KV;
  int span = (t + KV_SPAN_BLOCK - 1) / KV_SPAN_BLOCK * KV_SPAN_BLOCK;
  span = span > kv->max_t ? kv->max_t : span;
  const float scale = 1.0f / sqrtf((float)D); /* the attention kernels' scale */
  const size_t per_head = (size_t)kv->max_t * D, layer = (size_t)KV * per_head;
  for (int j = 0; j < KV; j++)
    be->matmul(be, at(m, kv->scores, (size_t)j * G * span), at(m, kv->q, (size_t)j * G * D),
               at(m, kv->kc, l * layer + j * per_head), G, span, D, 0, 1, scale, 0.0f, m->dt, m->dt);
  be->ce_shard_max(be, kv->rowmax, kv->scores, H, t, span, m->dt);
  be->ce_shard_stats(be, kv->stats, kv->scores, kv->rowmax, kv->outside, H, t, span, 0, m->dt);
  be->ce_shard_loss(be, kv->losses, kv->scores, kv->scores, kv->rowmax, kv->stats, kv->outside, H, t, span, 0, 1.0f,
                    m->dt);
  for (int j = 0; j < KV; j++)
    be->matmul(be, at(m, kv->att, (size_t)j * G * D), at(m, kv->scores, (size_t)j * G * span),
               at(m, kv->vc, l * layer + j * per_head), G, D, span, 0, 0, 1.0f, 0.0f, m->dt, m->dt);
}

/* Layer l on n rows at positions pos..pos+n-1, kv->x in place: block_forward's kernels in its
 * order, plus the cache append; pos 0 is the prefill (causal attention over the n rows). */
static void kv_block(model_kv_t *kv, int l, int n, int pos) {
  model_t *m = kv->m;
  backend_t *be = m->be;
  const layer_tensors_t *lt = &m->layer[l];
  const int C = m->C, H = m->H, KV = m->KV, D = m->D, HD = H * D, KD = KV * D, F = m->F;
  const size_t per_head = (size_t)kv->max_t * D, layer = (size_t)KV * per_head;
  be->rmsnorm_fwd(be, kv->xn, kv->rstd, kv->x, cparam_of(m, lt->attention_norm), n, C, m->eps, m->dt);
  mm(m, kv->qkv, kv->xn, cparam_of(m, lt->wq), n, HD + 2 * KD, C, 1, 0.0f);
  be->qkv_rope_fwd(be, kv->q, kv->k, kv->v, kv->qkv, 1, n, H, KV, D, pos, m->theta, m->dt);
  for (int j = 0; j < KV; j++) { /* rows (n, KV, D) -> kv head j's cache rows pos.. */
    size_t dst = l * layer + j * per_head + (size_t)pos * D;
    be->copy_2d(be, at(m, kv->kc, dst), D, at(m, kv->k, (size_t)j * D), KD, n, D, m->dt);
    be->copy_2d(be, at(m, kv->vc, dst), D, at(m, kv->v, (size_t)j * D), KD, n, D, m->dt);
  }
  if (pos == 0)
    be->attention_fwd(be, kv->att, kv->lse, kv->q, kv->k, kv->v, 1, n, H, KV, D, m->dt);
  else
    kv_attention(kv, l, pos + 1);
  be->copy(be, kv->x_mid, kv->x, (size_t)n * C * m->es); /* x_mid = x + att wo^T */
  mm(m, kv->x_mid, kv->att, cparam_of(m, lt->wo), n, C, HD, 1, 1.0f);
  be->rmsnorm_fwd(be, kv->xn, kv->rstd, kv->x_mid, cparam_of(m, lt->ffn_norm), n, C, m->eps, m->dt);
  mm(m, kv->ag, kv->xn, cparam_of(m, lt->w1), n, 2 * F, C, 1, 0.0f);
  be->swiglu_fwd(be, kv->h, kv->ag, n, F, m->dt);
  be->copy(be, kv->x, kv->x_mid, (size_t)n * C * m->es); /* out = x_mid + h w2^T */
  mm(m, kv->x, kv->h, cparam_of(m, lt->w2), n, C, F, 1, 1.0f);
}

int model_kv_forward(model_kv_t *kv, const int32_t *tokens, int n) {
  model_t *m = kv->m;
  backend_t *be = m->be;
  int rc;
  m->err[0] = '\0';
  if (!tokens || n < 1 || (kv->len > 0 && n != 1) || kv->len + n > kv->max_t)
    return set_error(m, MODEL_EINVAL, "KV-cache forward of %d tokens at position %d: the first takes any number, "
                     "later ones one each, up to the cache's %d positions", n, kv->len, kv->max_t);
  for (int u = 0; u < m->n_units; u++)
    if (!m->unit_params[u] || !m->unit_cparams[u])
      return set_error(m, MODEL_EINVAL, "KV-cache forward: unit %d has no parameters in place", u);
  if ((rc = check_ids(m, tokens, n, n, 0, "token")) != 0) return rc;
  if (kv->len == 0 && m->dt != DT_F32) /* the model's own compute copy, from the current parameters */
    for (int u = 0; u < m->n_units; u++)
      be->convert(be, (void *)m->unit_cparams[u], m->dt, m->unit_params[u], DT_F32, m->unit_numel[u]);
  const int pos = kv->len, C = m->C;
  be->to_device(be, kv->tokens, tokens, (size_t)n * sizeof(int32_t));
  be->embedding_fwd(be, kv->x, cparam_of(m, m->tok_embeddings), kv->tokens, n, C, 0, m->V, m->dt);
  for (int l = 0; l < m->L; l++) kv_block(kv, l, n, pos);
  /* the head on the last row only */
  be->rmsnorm_fwd(be, kv->xn, kv->rstd, at(m, kv->x, (size_t)(n - 1) * C), cparam_of(m, m->norm), 1, C, m->eps,
                  m->dt);
  mm(m, kv->logits, kv->xn, cparam_of(m, m->output), 1, m->V, C, 1, 0.0f);
  if (m->dt != DT_F32) be->convert(be, kv->logits32, DT_F32, kv->logits, m->dt, (size_t)m->V);
  kv->len += n;
  return 0;
}
