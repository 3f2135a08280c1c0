/* model: a Llama transformer, forward and backward, written against backend.h only.
 *
 *   tok_embeddings -> n_layers x [ attention_norm -> attention (RoPE, GQA, causal) -> +residual
 *                                  -> ffn_norm -> feed_forward (SwiGLU) -> +residual ]
 *   -> norm -> output (untied) -> cross-entropy
 *
 * Memory, llm.c style: one flat parameter buffer and one flat gradient buffer of the same
 * layout (num_params floats, device memory), carved into tensors named as in Meta's/PyTorch's
 * Llama ("tok_embeddings.weight", "layers.3.attention.wq.weight", ...); a separate activation
 * arena sized for (max_b, max_t). Tensors are grouped into sharding units (see dp.h), each a
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

#include "trainer/backend.h"
#include "trainer/dp.h"
#include "trainer/plan.h"

typedef struct model model_t;

typedef struct {
  char name[96];   /* "layers.0.attention.wq.weight" */
  int unit;        /* sharding unit */
  size_t offset;   /* in floats, from the start of the flat buffer */
  size_t numel;
  int ndim;        /* 1 or 2 */
  int shape[2];    /* (rows, cols) for 2-D; (n, 1) for 1-D */
  int decay;       /* weight decay applies (per plan.train.decay_norms / decay_embeddings) */
} model_tensor_t;

/* Builds the model for cfg (hidden_dim already resolved) and activations for batches of up to
 * max_b sequences of max_t tokens. decay_norms / decay_embeddings fill model_tensor_t.decay. */
int model_create(model_t **out, const plan_model_t *cfg, backend_t *be, int max_b, int max_t,
                 int decay_norms, int decay_embeddings, char *err, size_t errlen);
void model_destroy(model_t *m); /* accepts NULL */

void model_init_random(model_t *m, uint64_t seed, double init_std);
/* Optional strategy hooks (NULL = serial). */
void model_set_dp(model_t *m, dp_t *dp);

size_t model_num_params(const model_t *m);
float *model_params(model_t *m); /* device, flat */
float *model_grads(model_t *m);  /* device, flat, same layout */
int model_num_tensors(const model_t *m);
const model_tensor_t *model_tensor(const model_t *m, int i);
const model_tensor_t *model_find_tensor(const model_t *m, const char *name);
int model_num_units(const model_t *m);
void model_unit_range(const model_t *m, int unit, size_t *offset, size_t *numel);
/* Points unit u's parameters / gradients at other buffers (FSDP's gathered copies); NULL
 * restores the slices of the flat buffers. */
void model_set_unit_buffers(model_t *m, int unit, float *params, float *grads);

/* Forward pass over tokens (host, B*T int32). With targets (host, B*T; < 0 = ignored) returns
 * the mean cross-entropy over the non-ignored targets, else returns 0 and only fills logits.
 * Token or target ids outside [0, vocab_size) make it return NAN with a message in the log:
 * callers check with isfinite. */
float model_forward(model_t *m, const int32_t *tokens, const int32_t *targets, int b, int t);
/* Backward of the last forward (which must have had targets): grads += d(loss * loss_scale)/dp.
 * loss_scale is 1/grad_accum_steps under accumulation. */
void model_backward(model_t *m, float loss_scale);
void model_zero_grad(model_t *m);
/* Logits of the last forward, device memory (B, T, V). */
const float *model_logits(const model_t *m);
int model_vocab_size(const model_t *m);

#endif
