/* optim: AdamW over the tensor segments in one backend->adamw_multi call (else adamw per
 * segment), the clip scale from a global gradient norm, and the warmup + decay schedule
 * (formulas in optim.h). */
#include "common/err.h"
#include "trainer/model/optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int optim_init(optim_t *o, backend_t *be, const plan_train_t *cfg, const model_tensor_t *tensors, int n_tensors,
               size_t offset, size_t count, char *err, size_t errlen) {
  memset(o, 0, sizeof *o);
  o->be = be;
  o->offset = offset;
  o->count = count;
  o->beta1 = (float)cfg->beta1;
  o->beta2 = (float)cfg->beta2;
  o->eps = (float)cfg->eps;
  o->weight_decay = (float)cfg->weight_decay;
  if (count == 0) {
    return err_set(err, errlen, OPTIM_EINVAL, "optim: empty parameter range");
  }

  /* Clip each tensor to the range; the covered parts must tile it exactly. */
  o->segs = calloc((size_t)(n_tensors > 0 ? n_tensors : 1), sizeof *o->segs);
  if (!o->segs) goto nomem;
  size_t covered = 0;
  for (int i = 0; i < n_tensors; i++) {
    size_t lo = tensors[i].offset, hi = tensors[i].offset + tensors[i].numel;
    if (lo < offset) lo = offset;
    if (hi > offset + count) hi = offset + count;
    if (lo >= hi) continue;
    o->segs[o->n_segs++] = (optim_segment_t){.offset = lo - offset, .numel = hi - lo, .decay = tensors[i].decay};
    covered += hi - lo;
  }
  if (covered != count) {
    err_set(err, errlen, 0, "optim: the tensors cover %zu of the %zu elements in range [%zu, %zu)", covered, count,
            offset, offset + count);
    optim_free(o);
    return OPTIM_EINVAL;
  }
  o->m = be->alloc(be, count * sizeof(float));
  o->v = be->alloc(be, count * sizeof(float));
  if (!o->m || !o->v) goto nomem;
  return 0;
nomem:
  err_set(err, errlen, 0, "optim: out of memory for AdamW state (2 x %zu floats = %.1f MiB)", count,
          2.0 * (double)count * sizeof(float) / (1 << 20));
  optim_free(o);
  return OPTIM_ENOMEM;
}

void optim_free(optim_t *o) {
  if (!o) return;
  if (o->be) {
    o->be->free(o->be, o->m);
    o->be->free(o->be, o->v);
  }
  free(o->segs);
  memset(o, 0, sizeof *o);
}

double optim_grad_sumsq(const optim_t *o, const float *grads) { return o->be->sumsq(o->be, grads, o->count); }

double optim_clip_scale(double grad_norm, double clip) {
  if (clip <= 0 || grad_norm <= clip) return 1.0;
  return clip / grad_norm;
}

adamw_step_t optim_next(optim_t *o, double lr) {
  o->step++;
  return adamw_step_make((float)lr, o->beta1, o->beta2, o->step);
}

void optim_step_dev(optim_t *o, float *params, const float *grads, void *params_lp, const adamw_step_t *st,
                    const float *grad_scale) {
  o->be->adamw_multi_dev(o->be, params, grads, o->m, o->v, params_lp, o->segs, o->n_segs, o->beta1, o->beta2,
                         o->eps, o->weight_decay, st, grad_scale);
}

void optim_step(optim_t *o, float *params, const float *grads, void *params_lp, double lr, double grad_scale) {
  o->step++;
  if (o->be->adamw_multi) {
    o->be->adamw_multi(o->be, params, grads, o->m, o->v, params_lp, o->segs, o->n_segs, (float)lr, o->beta1,
                       o->beta2, o->eps, o->weight_decay, o->step, (float)grad_scale);
    return;
  }
  for (int i = 0; i < o->n_segs; i++) {
    const optim_segment_t *s = &o->segs[i];
    void *lp = params_lp ? (char *)params_lp + s->offset * dtype_size(DT_BF16) : NULL;
    o->be->adamw(o->be, params + s->offset, grads + s->offset, o->m + s->offset, o->v + s->offset, lp, s->numel,
                 (float)lr, o->beta1, o->beta2, o->eps, s->decay ? o->weight_decay : 0.0f, o->step,
                 (float)grad_scale);
  }
}

double optim_lr(const plan_train_t *cfg, int s) {
  const int warm = cfg->warmup_steps;
  if (s < warm) return cfg->lr * (double)(s + 1) / (double)warm;
  if (cfg->decay == PLAN_SCHED_CONSTANT || cfg->steps <= warm) return cfg->lr;
  double p = (double)(s - warm) / (double)(cfg->steps - warm);
  if (p > 1) p = 1;
  if (cfg->decay == PLAN_SCHED_LINEAR) return cfg->lr - (cfg->lr - cfg->min_lr) * p;
  return cfg->min_lr + (cfg->lr - cfg->min_lr) * 0.5 * (1.0 + cos(M_PI * p));
}
