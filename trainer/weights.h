/* weights: a model's full weights in and out of files. One path for every user: training's
 * initial and final weights, `trainer sample` (load), `trainer export` (our file to llama2.c or
 * Hugging Face), and the oracle test's --dump-init (save).
 *
 * Our files are safetensors of full (unsplit) fp32 tensors with the model's names, metadata
 * {"format": "meshrun", "plan": <resolved plan JSON>, "step": N}. Under a mesh, saving gathers
 * each unit across dp_shard (the strategy) and each tensor across tp (the model), and rank 0
 * writes; loading has every rank read the file and keep its part. llama2.c files and Hugging
 * Face directories are read and written through trainer/interop.
 *
 * Not here: sharded checkpoints with optimizer state (trainer/ckpt), and the choice of when
 * weights are saved (main.c). */
#ifndef MESHRUN_WEIGHTS_H
#define MESHRUN_WEIGHTS_H

#include <stddef.h>

#include "trainer/backend.h"
#include "trainer/dp.h"
#include "trainer/mesh.h"
#include "trainer/model.h"
#include "trainer/plan.h"

/* Full tensors from every rank's pieces into path (parent directories made), written by rank 0
 * with plan_json and step in the metadata. Collective over the job (mesh NULL: one process).
 * Returns 0 or -1 with the message in err (on the rank that failed). */
int weights_save(model_t *m, dp_t *dp, const mesh_t *mesh, int rank, const char *path, const char *plan_json,
                 int step, char *err, size_t errlen);

/* Our safetensors file into the model. dp NULL: one process with flat buffers (sample, and
 * training without a mesh); else unit by unit through the strategy, each rank keeping its tp
 * slice and shard. Returns 0 or -1 with the message in err. */
int weights_load(model_t *m, backend_t *be, dp_t *dp, const char *path, char *err, size_t errlen);

/* The initial weights of a training run that did not resume: model.init's file when set (ours,
 * a llama2.c file or a Hugging Face directory, the last two checked against p's model first),
 * else random from (seed, init_std) through the strategy. Returns 0, 2 (the file's model is not
 * the plan's) or 1, with the message in err. */
int weights_init(model_t *m, backend_t *be, dp_t *dp, const mesh_t *mesh, const plan_t *p, char *err,
                 size_t errlen);

/* `trainer export`: our weights file at path, checked against cfg, written to out as format
 * ("llama2c" or "hf"). Returns 0, 2 (usage: unknown format, a file not of this model) or 1 (I/O),
 * with the message in err. */
int weights_export(const plan_model_t *cfg, const char *path, const char *format, const char *out, char *err,
                   size_t errlen);

/* Where a training run's final weights go: <checkpoint.dir>/final.safetensors when
 * checkpoint.dir is set, else out/<plan file name without .json>/final.safetensors ("default"
 * for the embedded plan). */
void weights_final_path(const plan_t *p, char *out, size_t len);

/* mkdir -p of the directory part of path, with "cannot create directory D: why" in err on
 * failure (-1). Shared with the metrics file. */
int weights_make_parent_dirs(const char *path, char *err, size_t errlen);

#endif
