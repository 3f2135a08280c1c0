/* optim: AdamW over a range of the model's flat parameter buffer, global gradient-norm
 * clipping, and the learning-rate schedule.
 *
 * The optimizer owns the first and second moments (m, v) of one contiguous range
 * [offset, offset + count) of the flat layout, as two flat device buffers of count floats.
 * The serial trainer gives it the whole model (0, num_params); a sharded data-parallel
 * strategy gives each rank its shard, and per-tensor weight-decay flags are clipped to the
 * range, so a tensor split across shards decays the same way on every side of the cut.
 *
 * Clipping is global: norm = sqrt(sum over all gradients of g^2). optim_grad_sumsq returns the
 * range's share; a sharded caller all-reduces the shares before optim_clip_scale. The scale
 * min(1, clip / norm) is folded into the AdamW kernel (grad_scale), so gradients are never
 * rewritten. A training step computes the same scale on the device (the backend's clip_scale)
 * and hands it over there (optim_step_dev).
 *
 * LR schedule, for optimizer step s = 0 .. steps-1 (the s-th update):
 *   s < warmup:  lr * (s + 1) / warmup              (linear from 0; the first step is not wasted)
 *   after:       p = (s - warmup) / (steps - warmup)  in [0, 1)
 *     cosine:    min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
 *     linear:    lr - (lr - min_lr) * p
 *     constant:  lr
 * It does not do anything but AdamW (no SGD, no Lion) and keeps its state in fp32. */
#ifndef MESHRUN_OPTIM_H
#define MESHRUN_OPTIM_H

#include <stddef.h>

#include "trainer/backend/backend.h"
#include "trainer/model/model.h"
#include "trainer/plan/plan.h"

#define OPTIM_ENOMEM (-4)
#define OPTIM_EINVAL (-2)

/* A tensor's part of the range: offset in floats from the range's start, numel, decay flag (the
 * backend's adamw_multi takes the table as it is). */
typedef adamw_segment_t optim_segment_t;

typedef struct {
  backend_t *be;
  size_t offset, count;   /* the range of the flat layout this optimizer updates */
  float *m, *v;           /* (count) device buffers, zero at start */
  optim_segment_t *segs;  /* the tensors' parts inside the range, in layout order */
  int n_segs;
  int step;               /* updates taken so far (AdamW's bias correction uses step + 1) */
  float beta1, beta2, eps, weight_decay;
} optim_t;

/* Sets up AdamW for the range [offset, offset + count) of a model whose tensors are
 * tensors[0..n_tensors) (copies of model_tensor(); only offset, numel and decay are read).
 * Returns 0, OPTIM_ENOMEM or OPTIM_EINVAL, with a message in err. */
int optim_init(optim_t *o, backend_t *be, const plan_train_t *cfg, const model_tensor_t *tensors, int n_tensors,
               size_t offset, size_t count, char *err, size_t errlen);
void optim_free(optim_t *o); /* accepts a zeroed or half-built optim_t */

/* Sum of squares of grads[0 .. count) (grads points at the range's first element). */
double optim_grad_sumsq(const optim_t *o, const float *grads);
/* min(1, clip / norm); 1 when clip <= 0. norm must be finite. */
double optim_clip_scale(double grad_norm, double clip);
/* One AdamW update of the range: params and grads point at the range's first element
 * (model_params(m) + offset for the whole flat buffer, or a shard buffer). One backend call for
 * all segments (adamw_multi), or one adamw per segment where the backend has no adamw_multi:
 * the same bits either way.
 * params_lp (optional, bf16, the same layout as params): the compute copy, rewritten from the
 * updated fp32 parameters by the same fused pass (backend adamw's param_lp). */
void optim_step(optim_t *o, float *params, const float *grads, void *params_lp, double lr, double grad_scale);
/* The next update's values (the host's half of optim_step_dev): counts the update and returns lr
 * (as fp32), the count and the bias corrections, for the caller to put in device memory. */
adamw_step_t optim_next(optim_t *o, double lr);
/* optim_step with the update's values in device memory: *st as optim_next made them, and the
 * clip scale (*grad_scale, fp32, as a clip_scale kernel wrote it): one adamw_multi_dev call, the
 * bits optim_step gives for those values, and nothing waits for the device. Its arguments are
 * the same at every step (a recorded step replays it). */
void optim_step_dev(optim_t *o, float *params, const float *grads, void *params_lp, const adamw_step_t *st,
                    const float *grad_scale);

/* The learning rate of optimizer step s (0-based), per the schedule above. */
double optim_lr(const plan_train_t *cfg, int s);

#endif
