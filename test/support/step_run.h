/* step_run: what train_step needs, in one process or as one rank of several: the tiny plan of
 * test/support/serial_run (with the overrides given, resolved for the world), the cpu backend,
 * the mesh connected through a store ("cpu" comm on loopback; none in one process), the model
 * (without flat buffers when the strategy keeps them), the strategy from the mesh, its random
 * parameters from the plan's seed, synthetic data with a validation split, hooks with no fault
 * set, and the train_t main would fill. Unlike serial_run, the functions return errors instead of
 * asserting, so that a forked rank (test/support/fixture) never reaches cmocka's failure path.
 * The test links test/support/step_run.c and test/support/serial_run.c with trainer/run/train.c,
 * trainer/run/hooks.c, trainer/run/metrics.c, trainer/run/opprof.c, trainer/formats/data.c and
 * what serial_run needs. */
#ifndef MESHRUN_TEST_STEP_RUN_H
#define MESHRUN_TEST_STEP_RUN_H

#include <stddef.h>

#include "common/store.h"
#include "trainer/run/train.h"

typedef struct {
  plan_t p;
  backend_t *be;
  mesh_t *mesh; /* NULL in one process */
  model_t *m;
  dp_t *dp;
  data_t data;
  hooks_t hooks;
  train_t t;
} step_run_t;

/* Rank `rank` of `world` (world 1 and st NULL: one process, the serial strategy). Returns 0, or
 * -1 with the message in err (what was built is released). */
int step_run_open(step_run_t *r, const char *const *sets, int nsets, int rank, int world, store_t *st, char *err,
                  size_t errlen);
/* The model's full parameters (model_num_params floats) into host, unit by unit through the
 * strategy (dp_unit_open: collective over dp_shard under FSDP). 0, or -1 with the message in err. */
int step_run_params(step_run_t *r, float *host, char *err, size_t errlen);
void step_run_close(step_run_t *r); /* accepts a zeroed step_run_t */

#endif
