/* sample: text from a model, and the `trainer sample` program (see sample.h). */
#include "trainer/sample.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/data.h"
#include "trainer/rng.h"
#include "trainer/weights.h"

static int sample_next(const float *logits, int v, double temperature, rng_t *r) {
  int best = 0;
  for (int i = 1; i < v; i++)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return best;
  double total = 0;
  for (int i = 0; i < v; i++) total += exp((logits[i] - logits[best]) / temperature);
  double u = rng_uniform(r) * total, acc = 0;
  for (int i = 0; i < v; i++) {
    acc += exp((logits[i] - logits[best]) / temperature);
    if (u < acc) return i;
  }
  return best;
}

int sample_generate(model_t *m, backend_t *be, const plan_t *p, int is_text, FILE *out, char *err, size_t errlen) {
  const int n_new = p->sample.sample_tokens, t_max = p->train.seq_len, v = model_vocab_size(m);
  const char *prompt = p->sample.prompt[0] ? p->sample.prompt : "\n";
  size_t plen = strlen(prompt);
  int32_t *ctx = malloc((plen + (size_t)n_new + 1) * sizeof(int32_t));
  float *row = malloc((size_t)v * sizeof(float));
  if (!ctx || !row) {
    free(ctx);
    free(row);
    snprintf(err, errlen, "out of memory for sampling");
    return -1;
  }
  int n = 0;
  if (is_text) {
    for (size_t i = 0; i < plen; i++)
      if ((unsigned char)prompt[i] < (unsigned)v) ctx[n++] = (unsigned char)prompt[i];
  } else { /* ids: the prompt read as integers */
    const char *s = prompt;
    char *end;
    for (long id = strtol(s, &end, 10); end != s; s = end, id = strtol(s, &end, 10))
      if (id >= 0 && id < v) ctx[n++] = (int32_t)id;
  }
  if (n == 0) ctx[n++] = 0;
  const int n_prompt = n;

  rng_t r;
  rng_init(&r, p->seed, rng_hash_str("sample"));
  for (int k = 0; k < n_new; k++) {
    int t = n < t_max ? n : t_max;
    if (model_forward(m, ctx + n - t, NULL, 1, t, NULL)) {
      snprintf(err, errlen, "%s", model_errmsg(m));
      free(ctx);
      free(row);
      return -1;
    }
    be->to_host(be, row, model_logits(m) + (size_t)(t - 1) * v, (size_t)v * sizeof(float));
    ctx[n++] = sample_next(row, v, p->sample.temperature, &r);
  }
  for (int i = 0; i < n; i++) {
    if (is_text) fputc(ctx[i], out);
    else fprintf(out, i == 0 ? "%d" : " %d", ctx[i]);
    if (i + 1 == n_prompt && !is_text) fputs(" |", out);
  }
  fputc('\n', out);
  fflush(out);
  free(ctx);
  free(row);
  return 0;
}

/* Whether the plan's data is byte text, without loading it. */
static int plan_is_text(const plan_t *p) {
  if (p->data.format == PLAN_DATA_TEXT) return 1;
  if (p->data.format != PLAN_DATA_AUTO) return 0;
  char err[256];
  int f = data_detect_format(p->data.train, PLAN_DATA_AUTO, err, sizeof err);
  return f >= 0 ? f == PLAN_DATA_TEXT : p->model.vocab_size <= 256;
}

int sample_run(const plan_t *p, backend_t *be, const char *weights, char *err, size_t errlen) {
  model_t *m = NULL;
  int rc = model_create(&m, &p->model, be, p->train.micro_batch_size, p->train.seq_len, p->train.decay_norms,
                        p->train.decay_embeddings, err, errlen);
  if (rc == 0) rc = weights_load(m, be, NULL, weights, err, errlen);
  if (rc == 0) rc = sample_generate(m, be, p, plan_is_text(p), stdout, err, errlen);
  model_destroy(m);
  return rc ? -1 : 0;
}
