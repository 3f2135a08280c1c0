/* serial_run: a training setup in one process for the tests of the trainer's run and parallel
 * rooms: a small plan (the embedded default with a tiny model, synthetic data and the overrides
 * given), resolved for world 1; the cpu backend; the model; the serial data-parallel strategy
 * (dp_create with mesh NULL), its parameters random from the plan's seed. serial_run_step
 * trains one step as train.c does without a mesh (one micro-batch, the norm, clipping, AdamW).
 * Like files.h, the helpers fail the running cmocka test (they assert) rather than return
 * errors. The test links test/support/serial_run.c with trainer/plan/plan.c,
 * trainer/plan/pipeline.c, trainer/model/model.c, trainer/model/optim.c, trainer/model/rng.c,
 * trainer/parallel/dp*.c, the cpu backend and comm, and what they need. */
#ifndef MESHRUN_TEST_SERIAL_RUN_H
#define MESHRUN_TEST_SERIAL_RUN_H

#include "trainer/backend/backend.h"
#include "trainer/model/model.h"
#include "trainer/parallel/dp.h"
#include "trainer/plan/plan.h"

typedef struct {
  plan_t p;
  backend_t *be;
  model_t *m;
  dp_t *dp;
} serial_run_t;

/* The tiny model: dim 16, 2 layers, 4 heads (2 kv), vocab 32, hidden 48, sequences of 8, micro
 * batch 2 (global batch 2), 4 steps, synthetic data, fp32; then sets ("key.path=value") in order
 * (parallel.mixed_precision.param_dtype=bf16 gives the model its bf16 compute copy). */
void serial_run_open(serial_run_t *r, const char *const *sets, int nsets);
/* The tiny model's plan with sets applied, resolved for world ranks, into *p: 0, or the plan's
 * code with the message in err. Returns rather than asserts: forked ranks (test/support/fixture)
 * must not reach cmocka's failure path. */
int serial_run_plan(plan_t *p, const char *const *sets, int nsets, int world, char *err, size_t errlen);
/* One optimizer step (1-based `step`) on a batch that is a function of step: forward, backward,
 * dp_grad_norm, the clip scale and dp_step at optim_lr. The loss; the norm into *gnorm. */
float serial_run_step(serial_run_t *r, int step, double *gnorm);
/* The batch of step (2 x 8 tokens and targets): the same for every caller. */
void serial_run_batch(const serial_run_t *r, int step, int32_t *tok, int32_t *tgt);
void serial_run_close(serial_run_t *r); /* accepts a zeroed serial_run_t */

#endif
