/* data: training and validation tokens, and the batches drawn from them.
 *
 * Sources (plan.data.format, auto-detected when "auto"):
 *   text       any file, one token per byte (vocab 256); auto for .txt/.text/.md. With
 *              data.tokenizer, the tokenizer's ids of the file instead: encoded once at load,
 *              held in memory as uint32 (is_text is then 0: the ids are not bytes)
 *   llmc       llm.c's layout: 256 int32 header (magic, version, token count at header[2]),
 *              then the tokens: uint16 under GPT-2's header (magic 20240520, version 1), uint32
 *              under Llama 3's (magic 20240801, version 7); auto when a magic is present
 *   u16, u32   raw little-endian token ids; auto for .u16 / .u32
 *   synthetic  tokens from the seed: a random first-order Markov chain over the vocabulary
 *              (each token has a favourite successor, taken 3 times in 4), so loss can fall
 * A file that starts with an llm.c magic is never read as anything else: an explicit text, u16
 * or u32 format for it is an error, as is llmc for a file without one.
 *
 * Shards: data.train and data.val are a path, a glob, or a list of them (FineWeb-style shards,
 * a glob expanded in sorted order). The shards of a split are one stream of tokens in order;
 * a window may run across a shard boundary (llm.c's shards are documents separated by an
 * end-of-text token, so a boundary is one more document boundary). Files are memory-mapped,
 * not read into memory: a dataset may be larger than RAM. Every shard must hold ids (llmc,
 * u16, u32) or every shard text.
 * Validation: data.val when given, else the last val_fraction of the train stream (the train
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
 *   So the position in the dataset is (seed, step): a resumed run, under any dp degree, reads
 *   exactly the batches the uninterrupted one would have, across shard boundaries, as long as
 *   the shards are the same (their token count is the checkpoint's data_tokens). */
#ifndef MESHRUN_DATA_H
#define MESHRUN_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/plan/plan.h"

#define DATA_EINVAL (-2) /* bad input: file format, ids, sizes */
#define DATA_EIO (-3)    /* open/read failed */
#define DATA_ENOMEM (-4)

/* Number of synthetic tokens generated (train + val before the split). */
#define DATA_SYNTHETIC_TOKENS (1u << 20)

/* One file's tokens, mapped (or the synthetic tokens, allocated). */
typedef struct {
  const unsigned char *tokens; /* n tokens of width bytes, little-endian */
  size_t n;
  int width;                   /* 1 (text bytes), 2 or 4 */
  size_t start;                /* index of its first token in the split's stream */
  void *map;                   /* what to munmap (map_len bytes), or free (map_len 0) */
  size_t map_len;
  char *path;
} data_shard_t;

typedef struct {
  data_shard_t *shards;
  int n_shards;
  size_t n; /* tokens in all the shards */
} data_stream_t;

typedef struct {
  data_stream_t train_src; /* the train files (or the synthetic tokens) */
  data_stream_t val_src;   /* data.val's files; empty when val is split off train_src's end */
  size_t n_train;          /* train split: train_src's tokens [0, n_train) */
  size_t n_val;            /* val split: val_src's [0, n_val), or train_src's [n_train, +n_val) */
  int vocab_size;   /* the model's */
  int is_text;      /* byte tokenizer: ids are bytes, sample output is text */
  plan_data_format_t format; /* resolved (never AUTO) */
  int seq_len;      /* T */
  int global_batch; /* G sequences per optimizer step */
  uint64_t seed;
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

/* Token i of the train split (i < n_train) and of the validation split (i < n_val). */
int32_t data_train_token(const data_t *d, size_t i);
int32_t data_val_token(const data_t *d, size_t i);

/* Resolved format of a path under plan format f (AUTO: by magic, then extension). Returns the
 * format (>= 0), or DATA_EIO (cannot open) / DATA_EINVAL (cannot tell) with a message. */
int data_detect_format(const char *path, plan_data_format_t f, char *err, size_t errlen);
const char *data_format_name(plan_data_format_t f);

#endif
