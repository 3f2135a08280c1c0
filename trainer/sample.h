/* sample: text from a model. sample_generate continues a prompt token by token (a full forward
 * over the last seq_len tokens for each new token, no KV cache); training calls it after the
 * final weights. sample_run is the `trainer sample` program: one process, our weights file in
 * (through trainer/weights), text on stdout.
 *
 * Not here: tokenizers (text data is bytes; id data prints space-separated ids), batching. */
#ifndef MESHRUN_SAMPLE_H
#define MESHRUN_SAMPLE_H

#include <stddef.h>
#include <stdio.h>

#include "trainer/backend.h"
#include "trainer/model.h"
#include "trainer/plan.h"

/* Generates p->sample.sample_tokens tokens after p->sample.prompt (seeded by p->seed) and writes
 * prompt + text to out: bytes when is_text, else space-separated ids with " |" after the prompt.
 * Under a mesh every rank calls it (the forwards are collective under FSDP and TP) and draws the
 * same tokens. Returns 0 or -1 with the message in err. */
int sample_generate(model_t *m, backend_t *be, const plan_t *p, int is_text, FILE *out, char *err, size_t errlen);

/* `trainer sample`: builds p's model on be, loads the weights file, prints the sample to stdout.
 * Returns 0 or -1 with the message in err. */
int sample_run(const plan_t *p, backend_t *be, const char *weights, char *err, size_t errlen);

#endif
