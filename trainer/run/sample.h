/* sample: text from a model, and the `trainer sample` program.
 *
 * Two ways to run the model over a growing sequence, one way to draw and print:
 * - sample_run (`trainer sample`, one process) loads any weights (our safetensors, a llama2.c
 *   file, a Hugging Face folder, a checkpoint's parameters: trainer/run/weights finds the format
 *   from the content, and the model's shape from the file when no plan file gives one) and
 *   decodes with a KV cache (model_kv_*): the prompt in one prefill, then one token at a time
 *   against the cached keys and values. The context is the model's max_seq_len. When the sequence fills it, the window
 *   slides: every further token re-runs the prefill over the last max_seq_len tokens (positions
 *   from 0 again, exactly what the full-forward path computes), so the text goes on at the cost
 *   of one full forward per token from there.
 * - sample_generate (the sample at the end of training, on every rank of a mesh: its forwards
 *   are collective under FSDP and TP) runs a full forward over the last train.seq_len tokens
 *   (the training model's activations) for each new token; no cache.
 * Both draw with sample_picker_t from the rng stream (seed, "sample"): logits / temperature,
 * then top_k (the k largest logits, ties to the lower id), then top_p (the fewest of those,
 * by decreasing probability renormalized over them, whose probability reaches top_p), then one
 * uniform draw over the survivors in id order; temperature 0 is the arg max (lowest id of
 * ties). With top_k 0 and top_p 1 the draw is the plain softmax draw of earlier versions, bit
 * for bit.
 * Printing: with a tokenizer (data.tokenizer; else, for `trainer sample` without a plan file,
 * the one named in our file's metadata plan; else the tokenizer.json inside an HF weights
 * folder) the prompt is encoded (BOS first when the tokenizer has one), printed as given, and
 * the new tokens are streamed as text as they come; generation ends early at the tokenizer's
 * EOS (not printed). A tokenizer with more tokens than the model's vocabulary is an error.
 * Without one: bytes for a byte-text model (the plan's data is text; without a plan file, the
 * data of our file's metadata plan, else vocab_size <= 256), otherwise ids, "p1 p2 | g1 g2 ...",
 * streamed too.
 *
 * Not here: batching, beam search, repetition penalties. */
#ifndef MESHRUN_SAMPLE_H
#define MESHRUN_SAMPLE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "trainer/backend/backend.h"
#include "trainer/model/model.h"
#include "trainer/plan/plan.h"
#include "trainer/model/rng.h"

/* The draw of one token from a row of logits (see above), with its scratch for a vocabulary of
 * v. Deterministic: the same seed, settings and logits give the same tokens. */
typedef struct {
  double temperature; /* <= 0: arg max */
  int top_k;          /* 0 or >= v: all */
  double top_p;       /* >= 1: all */
  int v;
  rng_t rng;
  double *w;    /* (v) exp((logit - max) / temperature), 0 for filtered tokens */
  void *order;  /* (v) ids by decreasing logit, when top_k/top_p filter */
} sample_picker_t;

/* Returns 0 or -1 ("out of memory ...") in err. */
int sample_picker_init(sample_picker_t *s, const plan_sample_t *cfg, uint64_t seed, int v, char *err, size_t errlen);
int sample_picker_next(sample_picker_t *s, const float *logits);
void sample_picker_free(sample_picker_t *s); /* accepts a zeroed or half-built picker */

/* Generates p->sample.sample_tokens tokens after p->sample.prompt (seeded by p->seed) and writes
 * prompt + text to out, printed as described above (is_text: the data is byte text; the
 * tokenizer is p->data.tokenizer when set). Full forwards over the last train.seq_len tokens.
 * Under a mesh every rank calls it and draws the same tokens. Returns 0 or -1 with the message
 * in err. */
int sample_generate(model_t *m, backend_t *be, const plan_t *p, int is_text, FILE *out, char *err, size_t errlen);

/* `trainer sample`: the weights at path, the model resolved against the plan (plan_file: p came
 * from a plan file; else only the model keys in sets, the --set list, are checked against the
 * file), built on be in fp32, and sampled with the KV cache to stdout. Returns 0, 2 (usage:
 * unknown weights format, the plan's model is not the file's, a tokenizer larger than the
 * vocabulary) or 1 (I/O, memory, runtime), with one line in err. */
int sample_run(const plan_t *p, backend_t *be, const char *path, int plan_file, const char *const *sets, int nsets,
               char *err, size_t errlen);

#endif
