/* origin: where a divergence came from. When a step's loss is not finite, every rank of the
 * group that averages it ("dp_cp") sees the same nan and stops at the same read (train.h); before
 * the run fails, their own losses of that step (each rank's first micro-batch whose loss was not
 * finite, kept in its step record on the device) are gathered over that group, and the message
 * names the lowest rank whose own loss was not finite, its host and the micro-batch. One host
 * all-gather, at the failure only. Not here: the check itself (train.c), the host names
 * (straggler.c gathers them at the start). */
#ifndef MESHRUN_ORIGIN_H
#define MESHRUN_ORIGIN_H

#include <stddef.h>

#include "trainer/comm/comm.h"
#include "trainer/run/straggler.h"
#include "trainer/run/train.h"

/* After train_step or train_read failed with t->diverged set (every rank of t->dpc calls it
 * then): appends "; first non-finite: rank R (host H), its own loss (micro-batch M)" to the
 * message in err (of length errlen) when the loss diverged; the host names come from sg (NULL:
 * none). world_rank: this rank's. A gather that fails adds nothing: the message stays the
 * divergence's. Does nothing under pipeline parallelism or for a gradient norm. */
void origin_name(const train_t *t, const straggler_t *sg, int world_rank, char *err, size_t errlen);

#endif
