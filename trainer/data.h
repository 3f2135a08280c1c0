/* data: training and validation tokens, and the batches drawn from them.
 *
 * Sources (plan.data.format, auto-detected when "auto"):
 *   text       any file, one token per byte (vocab 256); auto for .txt/.text/.md
 *   llmc       llm.c / nanoGPT layout: 256 int32 header (magic 20240520, version 1, token
 *              count at header[2]), then uint16 tokens; auto when the magic is present
 *   u16, u32   raw little-endian token ids; auto for .u16 / .u32
 *   synthetic  tokens from the seed: a random first-order Markov chain over the vocabulary
 *              (each token has a favourite successor, taken 3 times in 4), so loss can fall
 * Validation: data.val when given, else the last val_fraction of the train tokens (the train
 * split keeps the rest). Everything is checked once at load: unreadable or truncated files,
 * token ids >= vocab_size (the message names the file, the id and its position), splits
 * shorter than one sequence of seq_len + 1 tokens.
 *
 * The batch rule (what makes every data-parallel layout see the same global batch):
 *   The global batch of optimizer step s (0-based) is G = global_batch_size sequences
 *   j = 0..G-1. Sequence j is the window of T+1 tokens starting at offset
 *   rng_below(stream (seed ^ DATA_SALT, s * G + j), n_train - T). Rank r of a dp degree
 *   dp, at micro-step m, takes sequences j = (m * dp + r) * B .. (m * dp + r) * B + B - 1,
 *   B = micro_batch_size. tokens = window[0..T-1], targets = window[1..T].
 *   So a step's set of sequences depends only on (seed, s, G), not on dp or accumulation.
 *   Eval batch k (0-based) is sequences j = k*B .. k*B+B-1 of the fixed stream
 *   (seed ^ EVAL_SALT, j) over the validation tokens: the same batches at every eval.
 *
 * Tokens are held in host memory as int32 (4 bytes per token, whole files read at load): fine
 * for datasets up to a few hundred million tokens; it does not stream or memory-map shards. */
#ifndef MESHRUN_DATA_H
#define MESHRUN_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/plan.h"

#define DATA_EINVAL (-2) /* bad input: file format, ids, sizes */
#define DATA_EIO (-3)    /* open/read failed */
#define DATA_ENOMEM (-4)

/* Number of synthetic tokens generated (train + val before the split). */
#define DATA_SYNTHETIC_TOKENS (1u << 20)

typedef struct {
  int32_t *train;   /* (n_train) token ids in [0, vocab_size) */
  size_t n_train;
  int32_t *val;     /* (n_val); may point into the same allocation as train */
  size_t n_val;
  int vocab_size;   /* the model's */
  int is_text;      /* byte tokenizer: ids are bytes, sample output is text */
  plan_data_format_t format; /* resolved (never AUTO) */
  int seq_len;      /* T */
  int global_batch; /* G sequences per optimizer step */
  uint64_t seed;
  void *owned[2];   /* allocations to free */
} data_t;

/* Loads p->data for a model of p->model.vocab_size and sequences of p->train.seq_len.
 * p must be resolved (global_batch_size known). With need_val, the validation split must hold
 * at least one sequence. Returns 0 or a negative DATA_E* code with a one-line message. */
int data_load(data_t *d, const plan_t *p, int need_val, char *err, size_t errlen);
void data_free(data_t *d); /* accepts a zeroed or half-loaded data_t */

/* The micro-batch of (step, micro_step) for dp rank `rank` of `dp`: b sequences, tokens and
 * targets (b * T int32 each, host). Requires (micro_step * dp + rank + 1) * b <= G. */
void data_train_batch(const data_t *d, int step, int micro_step, int rank, int dp, int b,
                      int32_t *tokens, int32_t *targets);
/* Eval micro-batch k (0-based), b sequences from the validation tokens. */
void data_eval_batch(const data_t *d, int k, int b, int32_t *tokens, int32_t *targets);

/* Resolved format of a path under plan format f (AUTO: by magic, then extension). Returns the
 * format (>= 0), or DATA_EIO (cannot open) / DATA_EINVAL (cannot tell) with a message. */
int data_detect_format(const char *path, plan_data_format_t f, char *err, size_t errlen);
const char *data_format_name(plan_data_format_t f);

#endif
