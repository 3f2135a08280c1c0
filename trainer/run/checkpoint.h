/* checkpoint: when and how a training run saves and resumes, over trainer/formats/ckpt's mechanism.
 * checkpoint.resume ("none", "auto" or a step directory) loads the strategy's state under any
 * strategy, mesh and world, provided the global batch is the same (the data order is a function
 * of (seed, step)); with checkpoint.dir set, a writer saves every checkpoint.interval steps and
 * after the last step, each rank its share of parameters and AdamW moments as chunks of full
 * tensors, synchronously or (checkpoint.async) committed by a later collective poll.
 *
 * The failure policy, the same on every rank (the writer shares its verdict): a lack of space
 * stops the run and asks meshrun not to restart; a broken collective stops it; anything else is
 * one warning and the run goes on, except that a failed save after the last step makes the run
 * exit 1 at its end. Training draws no random numbers of its own (batches are a function of
 * (seed, step); no dropout), so the RNG state saved is empty; the seed and global batch are
 * recorded as extras. Not here: the file format and commit protocol (trainer/formats/ckpt), full
 * weights files (trainer/run/weights). */
#ifndef MESHRUN_CHECKPOINT_H
#define MESHRUN_CHECKPOINT_H

#include <stddef.h>

#include "trainer/formats/ckpt.h"
#include "trainer/parallel/dp.h"
#include "trainer/run/hooks.h"
#include "trainer/parallel/mesh.h"
#include "trainer/plan/plan.h"

typedef struct {
  const plan_t *p;
  int rank;
  ckpt_group_t group;
  const ckpt_group_t *cg; /* NULL in one process */
  ckpt_writer_t *w;       /* NULL: checkpoint.dir unset */
  int pending;            /* the step of the asynchronous save in flight, 0 when none */
  int saved;              /* the step of the last save started (committed unless it failed) */
  int final_failed;       /* the save after the last step failed (final_err says why) */
  int no_restart;         /* a failure was a lack of space: ask meshrun not to restart */
  uint64_t data_tokens;   /* tokens in the train and val streams: saved, and compared at resume */
  char final_err[1024];
  /* train.skip_*: the skip decision's window (device memory; NULL while checkpoint_skip_window
   * has not given it), and the one a resume found (skip_resumed set). */
  backend_t *skip_be;
  const skip_window_t *skip_dev;
  skip_window_t skip_loaded;
  int skip_resumed;
} checkpoint_t;

/* Before the plan is resolved, for a training run: the checkpoint checkpoint.resume would load
 * (ckpt_peek: its metadata alone; the resume reads it whole). Its step directory goes to from;
 * a plan that leaves train.global_batch_size unset (0) takes the checkpoint's (*carried set),
 * so that resuming under another world continues the same data order instead of failing.
 * Returns 1 when checkpoints are there (also when their metadata cannot be read: the resume will
 * say why), 0 when none (resume none, an empty or absent directory). */
int checkpoint_peek(plan_t *p, char *from, size_t fromlen, int *carried);
/* Resumes as checkpoint.resume says (collective over the job), then creates the writer when
 * checkpoint.dir is set. *start_step is the first step to run (0: fresh), *resumed whether the
 * parameters and optimizer state came from a checkpoint. restart and round (TORCHELASTIC_RESTART_COUNT,
 * MESHRUN_ROUND) are for the log line. Returns 0, 2 (usage: wrong shape, no such checkpoint,
 * another global batch; a NaN or an infinity in the checkpoint, which a restart would only load
 * again) or 1 (nothing intact, I/O, a collective), with the message in err.
 * data_tokens is the dataset's size in tokens: a checkpoint saved over another count resumes
 * with a warning (the same (seed, step) then reads other windows: the data changed).
 * checkpoint_free releases what it made, also after a failure. */
int checkpoint_open(checkpoint_t *c, const plan_t *p, dp_t *dp, const mesh_t *mesh, hooks_t *hooks, int rank,
                    int world, int restart, int round, const char *plan_json, uint64_t data_tokens, int *start_step,
                    int *resumed, char *err, size_t errlen);
/* train.skip_*: the skip decision's window in be's memory, from here on saved with every
 * checkpoint (rank 0 its values as the tensor skip/window, every rank its counts as the extras
 * skip_window_n, skip_window_next and skip_total), and loaded into it now from the checkpoint the
 * run resumed from, where that one carries a window (else it stays empty). */
void checkpoint_skip_window(checkpoint_t *c, backend_t *be, skip_window_t *win);
/* Whether step `step` (1-based) saves a checkpoint: checkpoint.dir set, and the interval's step
 * or the last. (The step's values are read before: a diverged state is never saved.) */
int checkpoint_due(const checkpoint_t *c, int step);
/* After step `step` (1-based): commits an asynchronous save that finished, saves when due.
 * Collective (every rank calls it after every step). Returns 0 (also after a failure the run
 * survives) or -1 when the run must stop, with the message in err. */
int checkpoint_after_step(checkpoint_t *c, dp_t *dp, int step, char *err, size_t errlen);
/* A checkpoint of step `step` now, committed before returning (the preemption path: the run is
 * about to exit); nothing when the step's own save already ran. Collective. 0, or -1 with err
 * when it failed (the run then exits as a failure, and a restart resumes from the one before). */
int checkpoint_now(checkpoint_t *c, dp_t *dp, int step, char *err, size_t errlen);
/* After the loop: waits for a save still in flight. 0 or -1 as checkpoint_after_step. */
int checkpoint_finish(checkpoint_t *c, char *err, size_t errlen);
/* 0, or -1 with the message in err when the save after the last step failed. */
int checkpoint_final_status(const checkpoint_t *c, char *err, size_t errlen);
void checkpoint_free(checkpoint_t *c); /* waits for a save in flight; accepts a zeroed checkpoint_t */

#endif
