/* hooks: everything the tests reach into a training run with, in one place. The run calls one
 * function per point; each does nothing unless its flag or variable is set.
 *
 *   --stop-after N              end the run after step N (and its checkpoint) as if it had been
 *                               killed there, for resume tests (hooks_stop)
 *   --dump-init FILE            the initial weights, as safetensors (hooks_initial_weights)
 *   --dump-batches FILE         every micro-batch's tokens then targets, int32, in training order
 *                               (hooks_start opens it, hooks_batch writes)
 *   MESHRUN_FAULT_NAN=RANK:STEP that rank's first micro-batch of that step reports a nan loss,
 *                               as a rank whose data made the model diverge would (hooks_nan_loss)
 *   MESHRUN_FAULT_NAN_GRAD=RANK:STEP:TENSOR  that rank's own gradient of TENSOR (a model
 *                               tensor's name) turns nan in step STEP, before the strategy reduces
 *                               it, as a rank whose backward overflowed would (hooks_nan_grad:
 *                               into the model's flat gradient buffer, or where there is none
 *                               (FSDP, HSDP, ZeRO-2) into the unit's gradients as the strategy
 *                               reduces them: dp_poison_grad)
 *   MESHRUN_FAULT_SPIKE=RANK:STEP[:STEP]  every target of that rank's micro-batches of that step
 *                               (or of either step) becomes token 0, as a batch of bad data would:
 *                               the step's loss and gradient norm jump (hooks_spike arms it for a
 *                               step, hooks_batch rewrites the targets); for train.skip_loss_z and
 *                               train.skip_grad_z
 *   MESHRUN_FAULT_SLOW=RANK:MS  that rank sleeps MS milliseconds inside every step (its
 *                               compute time), as a rank on a slower or busier device would
 *                               (hooks_slow); the straggler report names it (straggler.h)
 *   MESHRUN_FAULT_SAVE=RANK:STEP[:EIO|ENOSPC]   that rank's shard write of the checkpoint of that
 *                               step fails with that errno (default EIO), as a failing disk
 *                               would (hooks_ckpt_writer installs ckpt's "write" hook)
 *   MESHRUN_FAULT_STALL=RANK:STEP  that rank stops before step STEP and waits for signals until
 *                               one ends it, as a hung device or a deadlocked process would: its
 *                               peers' next collective fails after the comm timeout (hooks_stall)
 *   MESHRUN_FAULT_SKIP=RANK:STEP[:GROUP]  that rank skips its first call of GROUP's communicator
 *                               (the mesh's dimension, default tp; "ppact", "ppgrad": the pipeline
 *                               channel on which it sends activations, gradients) in step STEP,
 *                               as a rank whose code took another branch would: comm_skip_next
 *                               (hooks_skip)
 *
 * The two dumps serve the PyTorch oracle test and run in one process only. Not here: the
 * behaviour the hooks provoke (the loss check in train.c, the save policy in checkpoint.c). */
#ifndef MESHRUN_HOOKS_H
#define MESHRUN_HOOKS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "trainer/formats/ckpt.h"
#include "trainer/parallel/dp.h"
#include "trainer/parallel/mesh.h"
#include "trainer/model/model.h"

typedef struct {
  /* flags (main's argument parser sets them) */
  int stop_after;           /* 0 = never */
  const char *dump_init;
  const char *dump_batches;
  /* state */
  int rank;
  FILE *dump;
  int nan_rank, nan_step;   /* MESHRUN_FAULT_NAN; nan_rank -1: off */
  int slow_rank, slow_ms;   /* MESHRUN_FAULT_SLOW; slow_rank -1: off */
  int grad_rank, grad_step; /* MESHRUN_FAULT_NAN_GRAD; grad_rank -1: off */
  char grad_tensor[96];
  int save_rank, save_step, save_err; /* MESHRUN_FAULT_SAVE; save_err 0: off */
  int stall_rank, stall_step; /* MESHRUN_FAULT_STALL; stall_rank -1: off */
  int skip_rank, skip_step;   /* MESHRUN_FAULT_SKIP; skip_rank -1: off */
  int spike_rank, spike_step[2], spike_now; /* MESHRUN_FAULT_SPIKE; spike_rank -1: off */
  char skip_group[16];
} hooks_t;

/* Reads the fault variables for this rank. The flags stay as set. */
void hooks_init(hooks_t *h, int rank);
/* Whether a hook that runs in one process only (a dump) is set. */
int hooks_one_process(const hooks_t *h);
/* The fault variable set for any rank that changes what one step does on the device (a nan
 * poured into a loss or a gradient, a collective skipped), NULL when none: a recorded step would
 * replay it at every step, or never. */
const char *hooks_step_fault(const hooks_t *h);
/* Before the checkpoint writer is created: the save fault of this rank, if any. */
void hooks_ckpt_writer(hooks_t *h, ckpt_writer_config_t *wc);
/* After the initial weights are set: --dump-init. Collective as weights_save is. 0 or -1. */
int hooks_initial_weights(hooks_t *h, model_t *m, dp_t *dp, const mesh_t *mesh, const char *plan_json, char *err,
                          size_t errlen);
/* Before the first step: opens --dump-batches. 0 or -1. */
int hooks_start(hooks_t *h, char *err, size_t errlen);
/* Each micro-batch's tokens and targets (n each) before its forward: the spike's targets, then the
 * dump. 0 or -1. */
int hooks_batch(hooks_t *h, const int32_t *tok, int32_t *tgt, size_t n, char *err, size_t errlen);
/* Before step `step` (1-based): arms the spike for that step's batches on the spiking rank. */
void hooks_spike(hooks_t *h, int step);
/* 1 when the loss of micro-batch micro (0-based) of step `step` (1-based) is to be replaced by
 * nan (the step's statistics do it on the device: backend step_loss's poison). */
int hooks_nan_loss(const hooks_t *h, int step, int micro);
/* Pipeline parallelism, after step `step`'s schedule: 1 when its first micro-batch's loss is to
 * be replaced by nan on this rank, which holds the last stage when last_stage is 1 (the only one
 * with losses); a warning, and 0, when the fault names a rank of another stage. */
int hooks_nan_loss_pp(const hooks_t *h, int step, int last_stage);
/* Before the backward of the last micro-batch of step `step` (1-based), on the poisoning rank:
 * a nan into its gradient of the tensor named (the backward adds into it, so the nan is this
 * rank's own and reaches the others only through the reduction); without the model's flat
 * gradient buffer, strategy dp's reduction of that tensor's unit puts it there (the unit's
 * reduction of its last micro-batch). Under pipeline parallelism: before the step's schedule, on
 * a rank whose stages hold the tensor. */
void hooks_nan_grad(const hooks_t *h, model_t *m, backend_t *be, dp_t *dp, int step);
/* Inside each step, on the slow rank: its delay (a sleep: the fault is the time it takes). */
void hooks_slow(const hooks_t *h);
/* Before step `step` (1-based): on the stalling rank of that step, a warning and then no return
 * (pause() until a signal's default action ends the process; the trainer's SIGTERM handler lets
 * a second SIGTERM do that). */
void hooks_stall(const hooks_t *h, int step);
/* Before step `step` (1-based): on the skipping rank of that step, a warning and the skip armed on
 * its group's communicator (none when the mesh has no such group). */
void hooks_skip(const hooks_t *h, int step, const mesh_t *mesh);
/* After step `step` (1-based) of steps and its checkpoint: 1 when the run stops here (logged). */
int hooks_stop(const hooks_t *h, int step, int steps);
void hooks_close(hooks_t *h); /* accepts a zeroed hooks_t */

#endif
