/* model: a Llama transformer, forward and backward, written against backend.h only.
 *
 *   tok_embeddings -> n_layers x [ attention_norm -> attention (RoPE, GQA, causal) -> +residual
 *                                  -> ffn_norm -> feed_forward (SwiGLU) -> +residual ]
 *   -> norm -> output (untied) -> cross-entropy
 *
 * Memory, llm.c style: one flat parameter buffer and one flat gradient buffer of the same
 * layout (num_params floats, device memory), carved into tensors named as in Meta's/PyTorch's
 * Llama ("tok_embeddings.weight", "layers.3.attention.wq.weight", ...); a separate activation
 * arena sized for (max_b, max_t), smaller under activation checkpointing (model_opts_t).
 *
 * Mixed precision (model_opts_t.param_dtype, PyTorch's MixedPrecisionPolicy.param_dtype): the
 * parameters the strategy keeps and updates are always fp32 (the master weights: model_params,
 * the units' buffers), and so are the gradients (model_grads: bf16 products accumulate into
 * them in fp32). With DT_BF16 the kernels read a bf16 compute copy of each unit, and every
 * activation (the residual stream, the logits and their gradients included) is bf16; the
 * statistics (norms' rstd, softmax log-sum-exp, the losses) stay fp32. The compute copy comes
 * from the strategy's gather (model_set_unit_compute: FSDP all-gathers bf16 shards) or, by
 * default, from the model, which rounds the unit's fp32 parameters into its own bf16 copy at
 * each forward gather (so no update path can leave it stale) and reuses it in the backward, or
 * from the strategy's optimizer, which writes that copy with the masters in one pass
 * (model_compute_copy).
 * Tensors are grouped into sharding units (see dp.h), each a
 * contiguous slice: unit 0 tok_embeddings, unit 1+l layer l, unit L+1 norm + output.
 * Linear weights are (out_features, in_features) as in PyTorch.
 *
 * Initialization (model_init_random): each tensor draws from its own rng stream keyed by
 * (seed, hash of its name), so values never depend on sharding: linear weights and the
 * embedding ~ N(0, init_std); attention.wo and feed_forward.w2 ~ N(0, init_std/sqrt(2 n_layers))
 * (residual projections scaled by depth); norm weights = 1. */
#ifndef MESHRUN_MODEL_H
#define MESHRUN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/backend.h"
#include "trainer/plan/plan.h"

typedef struct model model_t;

typedef struct {
  char name[96];   /* "layers.0.attention.wq.weight" */
  int unit;        /* sharding unit */
  size_t offset;   /* in floats, from the start of the flat buffer. Offsets need not grow with
                      the tensor's index: a layer's w3 sits between w1 and w2 (model.c's fused
                      W1||W3), while the tensors, and files, keep Meta's order */
  size_t numel;
  int ndim;        /* 1 or 2 */
  int shape[2];    /* (rows, cols) for 2-D; (n, 1) for 1-D */
  int decay;       /* weight decay applies (per plan.train.decay_norms / decay_embeddings) */
  /* Tensor parallelism: how this rank's tensor relates to the full one.
   * MODEL_TP_REPLICATED: the same full tensor on every tp rank (norm weights);
   * MODEL_TP_ROWS: rows split across tp (colwise linear: output features; vocab-parallel
   *   embedding and output), this rank holds rows [tp_rank*shape[0], (tp_rank+1)*shape[0]);
   *   the vocabulary is padded to a multiple of tp, so for the vocab tables shape[0] is
   *   ceil(vocab/tp) and the last ranks' rows past full_shape[0] are padding (zero, never
   *   read by the loss; their gradients stay zero);
   * MODEL_TP_COLS: columns split (rowwise linear: input features).
   * full_shape is the unsplit shape (the real vocabulary size, without padding). With tp = 1,
   * or a module the tp plan marks "replicate", the tensor is MODEL_TP_REPLICATED; replicated
   * tensors end every backward with identical full gradients on all tp ranks. */
  int tp_split;
  int full_shape[2];
} model_tensor_t;

enum { MODEL_TP_REPLICATED = 0, MODEL_TP_ROWS = 1, MODEL_TP_COLS = 2 };

struct comm; /* trainer/comm/comm.h */

/* Tensor parallelism of one model instance (one rank of the tp group). Plan styles per module
 * as PyTorch's (model.c explains the collectives): colwise / rowwise linears, rowwise
 * tok_embeddings (vocab-parallel), colwise output, sequence_parallel norms, "replicate" to keep
 * a module whole; prepare_module_input on "attention"/"feed_forward" is implied by
 * sequence_parallel (the all-gather of normed rows before the colwise linears). plan NULL or
 * n_plan 0: the default Llama plan. Under sequence parallelism any B*T works (rows are padded
 * to a multiple of tp internally). Collectives run on backend memory: the cpu comm with the
 * cpu backend (cuda needs a comm on device memory; creation says so). */
typedef struct {
  struct comm *comm;     /* the tp group (mesh_comm(mesh, "tp")); NULL = no tensor parallelism */
  int sequence_parallel; /* activations between blocks sharded on the sequence (norms per shard) */
  int loss_parallel;     /* cross-entropy on vocab-sharded logits, never gathered */
  const plan_tp_entry_t *plan; /* styles per module (plan.parallel.tp_plan) */
  int n_plan;
} model_tp_t;

/* Context parallelism (mesh.cp > 1): each sequence is cut into 2 * size chunks and this rank
 * holds chunks rank and 2 size - 1 - rank (trainer/model/ring_attention.h). A batch here is the
 * rank's rows of b sequences, chunk-major: t = 2c tokens a sequence, the first chunk of every
 * sequence, then the second (ring_attention_take_rows arranges them). Attention runs around the
 * ring; RoPE gives each chunk its positions in the whole sequence. Everything else is per row. */
typedef struct {
  struct comm *send, *recv; /* the ring's channels (mesh_t.cp) */
  struct comm *group;       /* the cp group (mesh_comm(mesh, "cp")), for rotate allgather */
  int size, rank;           /* mesh.cp and this rank's coordinate in it */
  int rotate, overlap;      /* ring_attention.h's RING_ROTATE_*; the ring's transfers behind compute */
} model_cp_t;

typedef struct {
  int max_b, max_t;        /* activations are sized for batches up to (max_b, max_t) */
  int decay_norms, decay_embeddings;
  const model_tp_t *tp;    /* NULL: no tensor parallelism */
  const model_cp_t *cp;    /* NULL or size 1: no context parallelism (max_t: this rank's tokens) */
  /* FSDP: the model allocates no flat parameter/gradient buffers (model_params and
   * model_grads return NULL); the strategy owns the shards and must point every unit at full
   * buffers with model_set_unit_buffers before the unit is used (dp gather). */
  int no_flat_buffers;
  /* Activation checkpointing (plan_checkpoint_every): 0 keeps every block's activations; k >= 1
   * makes block l (from 0) checkpointed when (l + 1) % k == 0 (1: every block, "full"; k: the
   * every-k-th-block "selective" of torchtitan's layer mode). A checkpointed block keeps only its
   * input from the forward and reruns its forward inside its backward (after the strategy's
   * gather of the unit), with the same kernels on the same inputs, so the result is
   * bit-identical; all checkpointed blocks share one block's worth of activation buffers. */
  int checkpoint_every;
  /* Mixed precision: the dtype of the parameters' compute copies and of the activations
   * (DT_F32, the default, or DT_BF16), and of the tensor-parallel gradient reduction of
   * replicated norm weights under sequence parallelism (reduce_dtype; DT_F32 default). */
  dtype_t param_dtype, reduce_dtype;
  /* bf16 only: 1 when the strategy's gather supplies every unit's bf16 compute copy with
   * model_set_unit_compute (FSDP, HSDP); 0: the model keeps a full bf16 copy (num_params
   * elements) and rounds each unit's fp32 parameters into it at the unit's forward gather. */
  int strategy_casts;
  /* Pipeline parallelism: the layers this model instance holds, as n_chunks contiguous chunks
   * (this rank's stages) of chunk_layers[c] layers from chunk_first[c], in increasing order and
   * disjoint. The chunk starting at layer 0 also holds tok_embeddings, the one ending at
   * n_layers norm and output; tensors and units exist only for what is held (their names stay
   * the full model's, "layers.5.attention.wq.weight", so checkpoints and weights files do not
   * depend on the split). Units are numbered locally in layer order: the embedding (when held),
   * the held blocks, norm + output (when held). chunk_slots[c] (NULL: 1 each) is how many
   * micro-batches' activations chunk c holds at once (the schedule's most in flight).
   * n_chunks 0: the whole model, one chunk, one slot. */
  int n_chunks;
  const int *chunk_first, *chunk_layers, *chunk_slots;
} model_opts_t;

/* Bytes of the activation arena, as allocated at creation (max_b, max_t): act_bytes the whole
 * arena (saved activations, logits, backward and tp scratch); act_block_bytes the part carved
 * for the transformer blocks (each block's saved activations, or for a checkpointed block its
 * input, plus the shared working set when any block is checkpointed). */
typedef struct {
  size_t act_bytes, act_block_bytes;
  size_t compute_bytes; /* the model's bf16 compute copy of the parameters (0 in fp32 and
                           when the strategy casts) */
} model_memory_t;

/* Builds the model for cfg (hidden_dim already resolved) and activations for batches of up to
 * max_b sequences of max_t tokens. decay_norms / decay_embeddings fill model_tensor_t.decay.
 * 0, or with the message in err: MODEL_EINVAL (a shape, mesh or backend the model cannot be
 * built for), MODEL_ENOMEM, or MODEL_EPLAN, a plan error (model.attention cannot be had: exit 2,
 * not retried). The attention kernel is chosen here for the (max_b, max_t) shape. */
#define MODEL_EPLAN (-2)
int model_create(model_t **out, const plan_model_t *cfg, backend_t *be, int max_b, int max_t,
                 int decay_norms, int decay_embeddings, char *err, size_t errlen);
/* The general form: model_create is model_create_opts with tp NULL and flat buffers. */
int model_create_opts(model_t **out, const plan_model_t *cfg, backend_t *be, const model_opts_t *opts,
                      char *err, size_t errlen);
void model_destroy(model_t *m); /* accepts NULL */
void model_memory(const model_t *m, model_memory_t *out);

void model_init_random(model_t *m, uint64_t seed, double init_std);
/* The initial values of one unit's local parameters (this tp rank's slices of the full
 * tensors, exactly what model_init_random writes there), into host memory of unit numel
 * floats. FSDP initializes its shards from this without a full flat buffer. */
void model_init_unit_host(const model_t *m, int unit, float *host_out, uint64_t seed, double init_std);
/* Full (unsplit) tensor i from this rank's local slice, assembled across the tp group
 * (collective over tp: every tp rank calls it; all receive the full tensor into host_full,
 * full_shape[0]*full_shape[1] floats). The unit must be gathered (its current buffer holds
 * this rank's local values). Returns 0, MODEL_EINVAL (no such tensor, or its unit not gathered)
 * or a negative comm error (COMM_E*). */
int model_export_tensor(model_t *m, int i, float *host_full);
/* Sets this rank's slice of tensor i from the full tensor in host memory (unit gathered). */
void model_import_tensor(model_t *m, int i, const float *host_full);
/* Optional strategy hooks (NULL = serial). */
/* The hooks a data-parallel strategy (trainer/parallel/dp) fills, so that the model's forward and
 * backward ask for a unit's parameters before using them (gather), give them back (release) and
 * hand over its gradients once complete (reduce_grads), without the model knowing strategies.
 * NULL members are skipped. Each returns 0 or a strategy code; name is for messages. */
typedef struct model_hooks model_hooks_t;
struct model_hooks {
  const char *name;
  void *ctx;
  int (*gather)(model_hooks_t *h, int unit, int for_backward);
  int (*release)(model_hooks_t *h, int unit, int after_backward);
  int (*reduce_grads)(model_hooks_t *h, int unit);
};
/* Sets (NULL: clears) the hooks the model calls; they must outlive the setting. */
void model_set_hooks(model_t *m, model_hooks_t *h);

size_t model_num_params(const model_t *m);
/* device, flat. The caller may write through it: the model's bf16 compute copy is rounded
 * afresh at the next forward (see model_compute_copy). */
float *model_params(model_t *m);
float *model_grads(model_t *m);  /* device, flat, same layout */
int model_num_tensors(const model_t *m);
const model_tensor_t *model_tensor(const model_t *m, int i);
const model_tensor_t *model_find_tensor(const model_t *m, const char *name);
int model_num_units(const model_t *m);
void model_unit_range(const model_t *m, int unit, size_t *offset, size_t *numel);
/* Points unit u's parameters / gradients (fp32) at other buffers (FSDP's gathered copies); NULL
 * restores the slices of the flat buffers. In fp32 the kernels read the parameters there. */
void model_set_unit_buffers(model_t *m, int unit, float *params, float *grads);
/* bf16 with strategy_casts: unit u's compute copy (unit numel bf16 elements in the layout of
 * the unit's flat slice), which the kernels read until the next call. */
void model_set_unit_compute(model_t *m, int unit, const void *params_lp);
dtype_t model_param_dtype(const model_t *m);
/* bf16 without strategy_casts, with flat buffers: the model's own compute copy (num_params bf16
 * elements in the layout of model_params); NULL otherwise. A strategy whose optimizer rewrites
 * all of it from the updated masters in the same pass (optim_step's params_lp) then calls
 * model_compute_written, and the forward gathers read the copy as it is instead of rounding it
 * again, until the masters may have been written otherwise: model_params, model_init_random,
 * model_import_tensor, model_set_unit_buffers or model_masters_changed (a checkpoint load into
 * the flat buffer) make each forward gather round it again. */
void *model_compute_copy(model_t *m);
void model_compute_written(model_t *m);
void model_masters_changed(model_t *m);

/* Statuses of model_forward and model_backward (0 = success); model_errmsg says why. */
enum {
  MODEL_EINVAL = -1,    /* bad call: ids outside the vocabulary, a batch above capacity, a backward
                           without a forward with targets, a unit without buffers */
  MODEL_ECOMM = -2,     /* a tensor-parallel collective failed (the message names the collective
                           and the peer); the tp group is broken for good */
  MODEL_ESTRATEGY = -3, /* the data-parallel strategy's gather, release or reduce_grads failed
                           (its own message is dp_errmsg's) */
  MODEL_ENOMEM = -4,    /* model_create, model_kv_create: memory for the model or its cache */
};
#define MODEL_ERR_MAX 768

/* Forward pass over tokens (host, B*T int32). With targets (host, B*T; < 0 = ignored) *loss gets
 * the mean cross-entropy over the non-ignored targets, else 0 and only the logits are filled.
 * Returns 0, or a MODEL_E* status with the reason in model_errmsg and *loss = NAN. A loss that is
 * nan/inf with status 0 means the model diverged (callers check isfinite). loss may be NULL. */
int model_forward(model_t *m, const int32_t *tokens, const int32_t *targets, int b, int t, float *loss);
/* model_forward with targets whose loss stays on the device: the b*t per-row losses (+0 for an
 * ignored target) are copied to rows, b*t floats of the backend's memory, and *valid gets the
 * number of targets that count; nothing waits for the device. model_loss_of_rows turns the rows,
 * once read back, into the loss model_forward would have returned, bit for bit. A training step
 * reads the rows of all its micro-batches back at once. With loss_scale != 0 the classifier is
 * one pass: the cross-entropy that computes the losses also writes the logits' gradient for a
 * model_backward with that same loss_scale, which then does not read the logits again (another
 * loss_scale recomputes it). Statuses as model_forward's. */
int model_forward_rows(model_t *m, const int32_t *tokens, const int32_t *targets, int b, int t, float *rows,
                       int *valid, float loss_scale);
float model_loss_of_rows(const float *rows, int n, int valid);
/* A training step's ids, staged: the n micro-batches of b x t tokens and targets (host, one
 * micro-batch after the other, b*t each) are checked as model_forward checks them and go up in one
 * upload into the staged buffer of the next parity (0 and 1 in turn: the upload of one step's ids
 * runs while the device still reads the step before's); valid[i] gets micro-batch i's count of
 * targets that count. model_forward_staged then runs micro-batch i of what was staged last as
 * model_forward_rows runs its ids: from one step to the next of the same parity (returned) its
 * calls have the same arguments, what a recorded step needs. Whole models only. */
int model_stage(model_t *m, const int32_t *tokens, const int32_t *targets, int n, int b, int t, int *valid);
/* Makes the staged buffers hold n micro-batches of b x t (their allocation waits for the device:
 * done once before the steps, a step's model_stage then allocates nothing). 0 or a MODEL_E*. */
int model_stage_reserve(model_t *m, int n, int b, int t);
int model_forward_staged(model_t *m, int i, int b, int t, float *rows, int *valid, float loss_scale);
/* Backward of the last forward (which must have had targets and succeeded):
 * grads += d(loss * loss_scale)/dp. loss_scale is 1/grad_accum_steps under accumulation.
 * Returns 0, or a MODEL_E* status (a collective that failed anywhere in the backward included)
 * with the reason in model_errmsg: the gradients are then partial and must not be stepped on. */
int model_backward(model_t *m, float loss_scale);
/* Why the last forward or backward failed, "model: ..."; "" after a success. */
const char *model_errmsg(const model_t *m);

/* --- pipeline stages (model_opts_t.n_chunks). A chunk's forward and backward run on one of its
 * activation slots (0..chunk_slots[c]-1), so several micro-batches can be in flight; the caller
 * (the pipeline runner) decides which slot holds which micro-batch.
 *
 * model_chunk_forward: a chunk with the embedding reads tokens (host, b*t); any other finds its
 * input activations in model_chunk_input(m, c, slot), put there by the caller (the previous
 * stage's output: this rank's rows (Ns, C) of the residual stream in param_dtype, where Ns is
 * b*t, or under sequence parallelism this tp rank's share of the padded rows). A chunk with the
 * head computes the loss from targets (host, b*t; NULL: logits only) into *loss, as model_forward;
 * any other leaves its output in model_chunk_output(m, c, slot) for the caller to send.
 * model_chunk_backward: a chunk with the head starts from its loss (scaled by loss_scale); any
 * other finds d(output) in model_chunk_output(m, c, slot) (the caller received it there, over the
 * activations it sent). A chunk without the embedding ends with d(input) in
 * model_chunk_input(m, c, slot) for the caller to send back. Statuses as model_forward/backward.
 * model_forward and model_backward are chunk 0, slot 0 of a whole model. */
int model_chunk_forward(model_t *m, int chunk, int slot, const int32_t *tokens, const int32_t *targets, int b, int t,
                        float *loss);
int model_chunk_backward(model_t *m, int chunk, int slot, float loss_scale);
void *model_chunk_input(model_t *m, int chunk, int slot);
void *model_chunk_output(model_t *m, int chunk, int slot);
/* Elements (param_dtype) of a chunk's input or output for a batch of b*t tokens on this rank. */
size_t model_boundary_numel(const model_t *m, int b, int t);
/* 1 when the last forward returned 0 (its loss may still be nan/inf: the model diverged). */
int model_forward_ok(const model_t *m);
void model_zero_grad(model_t *m);
/* Logits of the last forward, device memory (B, T, V) fp32, the full vocabulary on every tp
 * rank (gathered when the output is vocab-sharded; widened from bf16 into a buffer allocated on
 * the first call when activations are bf16). NULL after a loss-parallel forward with targets,
 * which never assembles them, after a failed forward, and when that buffer cannot be had. */
const float *model_logits(model_t *m);
int model_vocab_size(const model_t *m);

/* --- KV-cache decoding (`trainer sample`): one sequence on one process. A model_kv_t keeps, per
 * layer, the keys (after RoPE) and values of the positions seen so far, up to max_t of them,
 * and its own scratch; model_kv_forward runs new tokens at the next positions with the same
 * kernels as model_forward and leaves the logits of the last one. The first call after
 * model_kv_create or model_kv_reset is the prefill: any n tokens at positions 0..n-1, causal
 * attention as in model_forward (so its last row's logits match a full forward of those
 * tokens up to the output product's rounding). Every later call is a decode step of exactly one
 * token: its query against every cached key, softmax and the weighted sum of values as
 * matmuls, with the rows' softmax taken by the vocab-parallel cross-entropy kernels (a target
 * outside the row makes ce_shard_loss's gradient the plain softmax), so any backend with
 * ce_shard_* and copy_2d runs it. A full cache refuses more: the caller resets and prefills
 * again (trainer/run/sample slides its window that way).
 * The model must be whole (no tensor parallelism, no pipeline chunks) with every unit's
 * parameters in place (flat buffers, or set with model_set_unit_buffers); no strategy gather
 * is called. In bf16 without strategy_casts the prefill rounds the model's compute copy from
 * the fp32 parameters first, as a forward gather does. Costs per decode step: the linears of
 * one row, and attention over the cache rounded up to a multiple of 64 positions (so matmul
 * shapes change every 64 tokens, not every token; the extra columns get probability 0). */
typedef struct model_kv model_kv_t;

/* Cache and scratch for max_t positions on m's backend (2 * n_layers * max_t * kv_dim elements
 * of the compute dtype for the cache; the scratch holds max_t rows of one layer's activations).
 * Returns 0 or -1 with "model error: ..." in err. */
int model_kv_create(model_kv_t **out, model_t *m, int max_t, char *err, size_t errlen);
void model_kv_destroy(model_kv_t *kv); /* accepts NULL */
/* Forgets every position (the next forward is a prefill). */
void model_kv_reset(model_kv_t *kv);
/* Positions held. */
int model_kv_len(const model_kv_t *kv);
/* n tokens (host int32) at positions len..len+n-1: n >= 1 when len is 0, else n = 1, and
 * len + n <= max_t. Returns 0, or MODEL_EINVAL with the reason in model_errmsg(m). */
int model_kv_forward(model_kv_t *kv, const int32_t *tokens, int n);
/* Logits of the last token forwarded: device memory, (V) fp32. */
const float *model_kv_logits(const model_kv_t *kv);

#endif
