/* weights: a model's full weights in and out of files. One path for every user: training's
 * initial and final weights, `trainer sample` (load), `trainer export` (any of the formats to
 * llama2.c or Hugging Face), and the oracle test's --dump-init (save).
 *
 * `trainer sample` and `trainer export` read any of the three formats, and the "param" tensors
 * of a distributed checkpoint (trainer/formats/ckpt: a step folder, or a checkpoint directory's newest
 * intact one) whatever world and plan saved it, through one reader (weights_open), the format
 * found from the content, and the model's shape from the file itself (a checkpoint's: the plan
 * in its metadata) when no plan file says it (weights_resolve_model). model.init goes through
 * the same reader (the three formats; checkpoints are checkpoint.resume's). Every value read is
 * checked to be a finite number where every read passes (weights_read; a checkpoint's when it
 * opens), so a NaN or an infinity in a file is an input error (exit 2) naming the tensor and
 * the element, never trained on or written on into other files.
 *
 * Our files are safetensors of full (unsplit) fp32 tensors with the model's names, metadata
 * {"format": "meshrun", "plan": <resolved plan JSON>, "step": N}. Under a mesh, saving gathers
 * each unit across dp_shard (the strategy) and each tensor across tp (the model), and rank 0
 * writes; loading has every rank read the file and keep its part. llama2.c files and Hugging
 * Face directories are read and written through trainer/interop.
 *
 * Not here: saving and resuming checkpoints, optimizer state (trainer/run/checkpoint, trainer/formats/ckpt),
 * and the choice of when weights are saved (main.c). */
#ifndef MESHRUN_WEIGHTS_H
#define MESHRUN_WEIGHTS_H

#include <stddef.h>

#include "trainer/backend/backend.h"
#include "trainer/parallel/dp.h"
#include "trainer/formats/interop.h"
#include "trainer/parallel/mesh.h"
#include "trainer/model/model.h"
#include "trainer/plan/plan.h"

/* Full tensors from every rank's pieces into path (parent directories made), written by rank 0
 * with plan_json and step in the metadata. Collective over the job (mesh NULL: one process).
 * Returns 0 or -1 with the message in err (on the rank that failed). */
int weights_save(model_t *m, dp_t *dp, const mesh_t *mesh, int rank, const char *path, const char *plan_json,
                 int step, char *err, size_t errlen);

/* The initial weights of a training run that did not resume: model.init's file when set (ours,
 * a llama2.c file or a Hugging Face folder, read as weights_open reads them; the last two checked
 * against p's model first) through the strategy, unit by unit, every rank keeping its part; else
 * random from (seed, init_std) through the strategy. Returns 0, 2 (the file's model is not the
 * plan's, a file of no known format or a checkpoint, a missing tensor, a NaN or an infinity) or 1
 * (I/O, memory), with the message in err. */
int weights_init(model_t *m, dp_t *dp, const plan_t *p, char *err, size_t errlen);

/* --- Any weights, read-only: what `trainer sample` and `trainer export` take. */
typedef struct weights_file weights_file_t;

/* Opens path, its format found from what is there (interop_detect): our safetensors (the model
 * from the plan in its metadata), a llama2.c version 0 file, or a Hugging Face folder (or its
 * config.json or model.safetensors). A folder with metadata.json (or shard files) is a
 * checkpoint step folder, one with config.json an HF folder, one with `latest` or step-<N>
 * folders a checkpoint directory: its newest intact checkpoint is read, named in a log line.
 * Returns 0, 1 (cannot be read: missing, I/O, memory) or 2 (none of these formats, a folder of
 * none of these kinds, a corrupt file or checkpoint), with one line "weights error: PATH: ...",
 * interop's or the checkpoint loader's in err. */
int weights_open(weights_file_t **out, const char *path, char *err, size_t errlen);
void weights_close(weights_file_t *f); /* accepts NULL */
/* "meshrun", "llama2c", "hf" (interop_format_name) or "checkpoint". */
const char *weights_format_name(const weights_file_t *f);
/* The model the file holds (hidden_dim explicit, max_seq_len: our plan's, llama2.c's seq_len,
 * HF's max_position_embeddings), or NULL for our file without a plan in its metadata. */
const plan_model_t *weights_model(const weights_file_t *f);
/* Our file or checkpoint: the plan's data section from its metadata (format, train,
 * tokenizer), which tells how its samples print; NULL for other formats and without metadata. */
const plan_data_t *weights_data(const weights_file_t *f);
/* An HF folder's tokenizer.json when there is one, else NULL. */
const char *weights_tokenizer(const weights_file_t *f);
/* The full tensor of our name ("layers.0.attention.wq.weight") into dst, numel floats, in our
 * layout: every read of weights passes here (model.init, sample, export). Returns 0 or 2 (no such
 * tensor, another size, a NaN or an infinity: "weights error: FILE: tensor NAME element INDEX is
 * nan (not a finite number)", INDEX in our layout, row-major) with the message in err. A
 * checkpoint's values were checked when it opened (trainer/formats/ckpt's message then). */
int weights_read(weights_file_t *f, const char *name, float *dst, size_t numel, char *err, size_t errlen);

/* The model `trainer sample` and `trainer export` build for f. plan_file 1: the plan came from a
 * file, and its model is the answer once checked against the file's (dim, n_layers, n_heads,
 * n_kv_heads, vocab_size, hidden_dim, rope_theta, norm_eps; max_seq_len is the plan's). Else
 * the file's model, with each model key named in sets (the --set list, "model.dim=64") checked
 * against it, and model.max_seq_len, when set, taken from plan. Returns 0, or 2 with
 * "weights error: PATH: dim 64 but the plan says 128 (set model.dim=64)" in err. */
int weights_resolve_model(const weights_file_t *f, const plan_model_t *plan, int plan_file, const char *const *sets,
                          int nsets, plan_model_t *out, char *err, size_t errlen);

/* Every tensor of model cfg from f into m (flat buffers or units in place, one process).
 * Returns 0 or 2 with the message in err. */
int weights_load_file(model_t *m, weights_file_t *f, char *err, size_t errlen);

/* `trainer export`: f's model cfg (weights_resolve_model's) written to out as format
 * ("llama2c" or "hf"); bos_id and eos_id (-1: none) as interop_export records them. Returns 0,
 * 2 (usage: unknown format, a model llama2.c cannot express) or 1 (I/O, memory), with the
 * message in err. */
int weights_export(weights_file_t *f, const plan_model_t *cfg, const char *format, int bos_id, int eos_id,
                   const char *out, char *err, size_t errlen);

/* Where a training run's final weights go: <checkpoint.dir>/final.safetensors when
 * checkpoint.dir is set, else out/<plan file name without .json>/final.safetensors ("default"
 * for the embedded plan). */
void weights_final_path(const plan_t *p, char *out, size_t len);

/* mkdir -p of the directory part of path, with "cannot create directory D: why" in err on
 * failure (-1). Shared with the metrics file. */
int weights_make_parent_dirs(const char *path, char *err, size_t errlen);

#endif
