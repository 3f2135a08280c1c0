/* train: one optimizer step, and evaluation. train_step runs grad_accum_steps micro-batches
 * (batch from the loader, forward, backward; the strategy synchronizes gradients on the last
 * one), averages the loss over the micro-batches and over dp, then the gradient norm, clipping
 * and the optimizer, in that order, every floating-point operation as the loop always did them.
 *
 * A step stops before the optimizer on any error: a forward or backward that failed (the model's
 * or the strategy's status), a loss that is nan/inf on any dp rank (the ranks agree through the
 * loss all-reduce, so they stop together instead of stranding peers in a gradient reduction),
 * a gradient norm that is not finite. Not here: logging and records (metrics), checkpoints
 * (checkpoint), the test hooks' own logic (hooks: the step only calls them). */
#ifndef MESHRUN_TRAIN_H
#define MESHRUN_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/backend.h"
#include "trainer/comm/comm.h"
#include "trainer/formats/data.h"
#include "trainer/parallel/dp.h"
#include "trainer/run/hooks.h"
#include "trainer/parallel/mesh.h"
#include "trainer/model/model.h"
#include "trainer/plan/pipeline.h"
#include "trainer/plan/plan.h"

/* What a step works with; main fills it once. Host values (the loss, eval sums) go through the
 * host comm of "dp_cp" (dpc, NULL in one process: dp's ranks, and cp's, which read the same
 * batches and hold different tokens of them); device tensors never pass through here. */
typedef struct {
  const plan_t *p;
  model_t *m;
  dp_t *dp;
  backend_t *be;
  const data_t *data;
  comm_t *dpc;
  const mesh_t *mesh; /* NULL in one process: its communicators' blocked time is the step's exposed communication */
  int dp_rank, dp_size;
  int cp_size, cp_rank; /* context parallelism: this rank keeps its two chunks of each sequence read */
  hooks_t *hooks;
  int32_t *tok, *tgt; /* (micro_batch_size, seq_len) host batches (the whole step's under pp); train_init
                         allocates them */
  /* Without pp: the per-row losses of the step's micro-batches, on the device (loss_rows) and read
   * back once per step (loss_host), with each micro-batch's count of targets (loss_valid). */
  float *loss_rows, *loss_host;
  int *loss_valid;
  int32_t *cp_scratch; /* cp > 1: a batch's ids while this rank's rows are taken out of it */
  /* Pipeline parallelism (mesh.pp > 1; NULL otherwise): the runner of this rank's stages, and the
   * host comm of the pp group that shares the last stage's loss with the others. */
  pp_runner_t *pp;
  comm_t *ppc;
  int diverged; /* set by a train_step that failed on a non-finite loss or gradient norm */
} train_t;

typedef struct {
  double loss;  /* mean over micro-batches and dp */
  double lr;
  double gnorm; /* before clipping */
  double dt;    /* seconds, from zero_grad to the optimizer's end on the device */
  double comm_wait; /* seconds of dt blocked on collectives (the exposed communication) */
  pp_step_stats_t pp; /* under pp: this rank's schedule (busy, span, in flight) */
} train_result_t;

/* Allocates the batches. Returns 0 or -1 with the message in err; train_free releases them. */
int train_init(train_t *t, char *err, size_t errlen);
void train_free(train_t *t); /* accepts a zeroed train_t */

/* Step s (0-based; logged as s + 1). Returns 0 with *out, or -1 with the message in err: the
 * optimizer has then not stepped. */
int train_step(train_t *t, int s, train_result_t *out, char *err, size_t errlen);

/* Mean eval loss over batches k = 0..eval.batches-1 (the one-process value). Under a mesh, dp
 * rank r runs batches k = r, r + dp, ... and the sums are added over "dp"; every rank runs the
 * same number of forwards (FSDP and TP forwards are collective), the spare ones on a repeated
 * batch whose loss is not counted. Returns 0 or -1 with the message in err. */
int train_eval(train_t *t, double *out, char *err, size_t errlen);

#endif
