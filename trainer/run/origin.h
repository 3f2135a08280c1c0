/* origin: where a divergence came from. When a step's loss is not finite, every rank of the
 * group that averages it ("dp_cp") sees the same nan and stops at the same read (train.h); before
 * the run fails, their own losses of that step (each rank's first micro-batch whose loss was not
 * finite, kept in its step record on the device) are gathered over that group, and the message
 * names the lowest rank whose own loss was not finite, its host and the micro-batch. Under
 * pipeline parallelism only the last stage's ranks compute losses (their micro-batches are the
 * pipeline's), and every stage shares the loss: the gather is over the job (world). One host
 * all-gather, at the failure only.
 *
 * When the gradient norm is not finite (every rank sees it: the norm sums all ranks' shares), the
 * step's values are named when they are that step's (the read came at the step that diverged: a
 * console line there, or log.interval 1): each rank finds the first tensor, in the model's order,
 * whose own gradient was not finite before the strategy reduced it over ranks (the sums of
 * squares the strategy kept on the device, dp_local_first_bad; under the serial strategy, which
 * reduces nothing, the flat buffer), and the first one after the reduction (the flat buffer,
 * where the strategy has one); these are gathered over the job, and the message names the lowest
 * world rank whose own gradient was not finite, its host and its tensor (under sequence
 * parallelism a norm weight's gradient is summed over tp inside the model before that, so the
 * lowest rank of its tp group is named). When no rank's was (a reduction that overflowed), the
 * tensor after the reduction is named, or the message says that each rank's own gradients were
 * finite. When the read came later (the step's sums and gradients are gone) the message says
 * so. Under pipeline parallelism each rank's model holds its stages' tensors only: the ranks'
 * tensors travel by name, and the step is always read at once (its values are that step's).
 * Not here: the check itself (train.c), the sums (the strategies, dp.h), the host names
 * (straggler.c gathers them at the start). */
#ifndef MESHRUN_ORIGIN_H
#define MESHRUN_ORIGIN_H

#include <stddef.h>

#include "trainer/comm/comm.h"
#include "trainer/run/straggler.h"
#include "trainer/run/train.h"

/* After train_step or train_read failed with t->diverged set in step s (0-based; every rank
 * calls it then): appends "; first non-finite: rank R (host H), its own loss (micro-batch M)"
 * when the loss diverged, or "; first non-finite gradient: rank R (host H), NAME, before the
 * reduction (step S's)" (or what origin's comment above says instead) when the norm did, to the
 * message in err (of length errlen); the host names come from sg (NULL: none). world_rank: this
 * rank's. A gather that fails adds nothing: the message stays the divergence's. */
void origin_name(train_t *t, const straggler_t *sg, int world_rank, int s, char *err, size_t errlen);

#endif
