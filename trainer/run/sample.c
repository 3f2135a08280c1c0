/* sample: text from a model, and the `trainer sample` program (see sample.h).
 *
 * One generation loop serves both paths: gen_t holds the sequence and how it prints; the step
 * that yields the next logits is either a full forward (sample_generate) or the KV cache
 * (sample_run). Output is written as tokens come and flushed after each, so a slow model
 * streams. */
#include "trainer/run/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "trainer/formats/data.h"
#include "trainer/formats/tokenizer.h"
#include "trainer/run/weights.h"

/* ------------------------------------------------------------------ the draw */

typedef struct {
  float logit;
  int32_t id;
} ranked_t;

/* Decreasing logit, then increasing id: a total order, so the filter is the same on every
 * machine whatever qsort's algorithm. */
static int by_logit(const void *a, const void *b) {
  const ranked_t *x = a, *y = b;
  if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

int sample_picker_init(sample_picker_t *s, const plan_sample_t *cfg, uint64_t seed, int v, char *err, size_t errlen) {
  memset(s, 0, sizeof *s);
  s->temperature = cfg->temperature;
  s->top_k = cfg->top_k > 0 && cfg->top_k < v ? cfg->top_k : 0;
  s->top_p = cfg->top_p > 0 && cfg->top_p < 1 ? cfg->top_p : 1.0;
  s->v = v;
  rng_init(&s->rng, seed, rng_hash_str("sample"));
  s->w = malloc((size_t)(v > 0 ? v : 1) * sizeof *s->w);
  if (s->top_k || s->top_p < 1) s->order = malloc((size_t)(v > 0 ? v : 1) * sizeof(ranked_t));
  if (!s->w || ((s->top_k || s->top_p < 1) && !s->order)) {
    sample_picker_free(s);
    return err_set(err, errlen, -1, "sample error: out of memory for a vocabulary of %d", v);
  }
  return 0;
}

void sample_picker_free(sample_picker_t *s) {
  free(s->w);
  free(s->order);
  s->w = NULL;
  s->order = NULL;
}

int sample_picker_next(sample_picker_t *s, const float *logits) {
  const int v = s->v;
  int best = 0;
  for (int i = 1; i < v; i++)
    if (logits[i] > logits[best]) best = i;
  if (s->temperature <= 0) return best;
  for (int i = 0; i < v; i++) s->w[i] = exp((logits[i] - logits[best]) / s->temperature);
  if (s->order) { /* keep the top_k largest, then the top_p nucleus of those; zero the rest */
    ranked_t *r = s->order;
    for (int i = 0; i < v; i++) r[i] = (ranked_t){logits[i], i};
    qsort(r, (size_t)v, sizeof *r, by_logit);
    int keep = s->top_k ? s->top_k : v;
    if (s->top_p < 1) {
      double kept = 0, acc = 0;
      for (int j = 0; j < keep; j++) kept += s->w[r[j].id];
      int j = 0;
      while (j < keep && (acc += s->w[r[j].id]) < s->top_p * kept) j++;
      keep = j < keep ? j + 1 : keep;
    }
    for (int j = keep; j < v; j++) s->w[r[j].id] = 0;
  }
  double total = 0;
  for (int i = 0; i < v; i++) total += s->w[i];
  double u = rng_uniform(&s->rng) * total, acc = 0;
  for (int i = 0; i < v; i++) {
    acc += s->w[i];
    if (u < acc) return i;
  }
  return best;
}

/* ------------------------------------------------------------------ the sequence and its printing */

typedef struct {
  int32_t *ids; /* prompt, then generated tokens */
  int n, cap, n_prompt;
  FILE *out;
  int is_text;
  const tokenizer_t *tok;
} gen_t;

static int gen_push(gen_t *g, int32_t id) {
  if (g->n == g->cap) {
    int cap = g->cap ? 2 * g->cap : 256;
    int32_t *grown = realloc(g->ids, (size_t)cap * sizeof *grown);
    if (!grown) return -1;
    g->ids = grown;
    g->cap = cap;
  }
  g->ids[g->n++] = id;
  return 0;
}

/* The prompt's tokens (see sample.h): encoded by the tokenizer after its BOS, bytes for byte
 * text, else the integers it holds; ids outside the vocabulary are dropped, and an empty
 * result is token 0 as before tokenizers (with a tokenizer it is an error). */
static int gen_prompt(gen_t *g, const char *prompt, int v, char *err, size_t errlen) {
  size_t plen = strlen(prompt);
  int rc = 0;
  if (g->tok) {
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_bos(g->tok) >= 0) rc = gen_push(g, tokenizer_bos(g->tok));
    if (rc == 0 && tokenizer_encode(g->tok, prompt, plen, &ids, &n, err, errlen) != 0) {
      free(ids);
      return -1;
    }
    for (size_t i = 0; i < n && rc == 0; i++) rc = gen_push(g, ids[i]);
    free(ids);
    if (rc == 0 && g->n == 0)
      return err_set(err, errlen, -1, "sample error: the prompt encodes to no tokens and the tokenizer has no BOS");
  } else if (g->is_text) {
    for (size_t i = 0; i < plen && rc == 0; i++)
      if ((unsigned char)prompt[i] < (unsigned)v) rc = gen_push(g, (unsigned char)prompt[i]);
  } else {
    const char *s = prompt;
    char *end;
    for (long id = strtol(s, &end, 10); end != s && rc == 0; s = end, id = strtol(s, &end, 10))
      if (id >= 0 && id < v) rc = gen_push(g, (int32_t)id);
  }
  if (rc == 0 && g->n == 0) rc = gen_push(g, 0);
  if (rc) return err_set(err, errlen, -1, "sample error: out of memory for the prompt");
  for (int i = 0; i < g->n; i++)
    if (g->ids[i] < 0 || g->ids[i] >= v)
      return err_set(err, errlen, -1, "sample error: the prompt's token %d is outside the model's vocabulary of %d",
                     (int)g->ids[i], v);
  g->n_prompt = g->n;
  /* the prompt as it will be continued */
  if (g->tok) {
    fwrite(prompt, 1, plen, g->out);
  } else {
    for (int i = 0; i < g->n; i++) {
      if (g->is_text) fputc(g->ids[i], g->out);
      else fprintf(g->out, i == 0 ? "%d" : " %d", g->ids[i]);
    }
    if (!g->is_text) fputs(" |", g->out);
  }
  fflush(g->out);
  return 0;
}

static void gen_emit(gen_t *g, int32_t id) {
  if (g->tok) {
    size_t len = 0;
    const char *b = tokenizer_token_bytes(g->tok, id, g->ids[g->n - 2], &len);
    if (b && len) fwrite(b, 1, len, g->out);
  } else if (g->is_text) {
    fputc(id, g->out);
  } else {
    fprintf(g->out, " %d", id);
  }
  fflush(g->out);
}

/* How the next logits come: a full forward of the last `window` tokens (kv NULL), or the
 * cache. Returns device logits (V) fp32, or NULL with the message in err. */
static const float *next_logits(model_t *m, model_kv_t *kv, const gen_t *g, int window, int first, char *err,
                                size_t errlen) {
  const int v = model_vocab_size(m);
  if (!kv) {
    int t = g->n < window ? g->n : window;
    if (model_forward(m, g->ids + g->n - t, NULL, 1, t, NULL)) {
      err_set(err, errlen, 0, "%s", model_errmsg(m));
      return NULL;
    }
    const float *l = model_logits(m);
    if (!l) err_set(err, errlen, 0, "sample error: the model has no logits to sample from");
    return l ? l + (size_t)(t - 1) * v : NULL;
  }
  int rc;
  if (first || model_kv_len(kv) == window) { /* the prefill, or the slide (sample.h) */
    int t = g->n < window ? g->n : window;
    model_kv_reset(kv);
    rc = model_kv_forward(kv, g->ids + g->n - t, t);
  } else {
    rc = model_kv_forward(kv, g->ids + g->n - 1, 1);
  }
  if (rc) {
    err_set(err, errlen, 0, "%s", model_errmsg(m));
    return NULL;
  }
  return model_kv_logits(kv);
}

static int generate(gen_t *g, model_t *m, backend_t *be, model_kv_t *kv, int window, const plan_t *p, char *err,
                    size_t errlen) {
  const int v = model_vocab_size(m), eos = g->tok ? tokenizer_eos(g->tok) : -1;
  const char *prompt = p->sample.prompt[0] ? p->sample.prompt : "\n";
  sample_picker_t pk;
  float *row = malloc((size_t)v * sizeof *row);
  int rc = row ? sample_picker_init(&pk, &p->sample, p->seed, v, err, errlen) : -1;
  if (!row) err_set(err, errlen, 0, "sample error: out of memory for a vocabulary of %d", v);
  if (rc == 0) rc = gen_prompt(g, prompt, v, err, errlen);
  for (int k = 0; k < p->sample.sample_tokens && rc == 0; k++) {
    const float *logits = next_logits(m, kv, g, window, k == 0, err, errlen);
    if (!logits) {
      rc = -1;
      break;
    }
    be->to_host(be, row, logits, (size_t)v * sizeof *row);
    int32_t id = sample_picker_next(&pk, row);
    if (id == eos) break;
    if (gen_push(g, id)) {
      rc = err_set(err, errlen, -1, "sample error: out of memory for the sequence");
      break;
    }
    gen_emit(g, id);
  }
  if (rc == 0) {
    fputc('\n', g->out);
    fflush(g->out);
  }
  if (row) sample_picker_free(&pk);
  free(row);
  return rc;
}

/* The tokenizer at path, refused when it has more tokens than the model (its ids would fall
 * outside the embedding). Returns 0, 1 (cannot load) or 2 (too large). */
static int load_tokenizer(tokenizer_t **out, const char *path, int vocab, char *err, size_t errlen) {
  char why[512];
  int rc = tokenizer_load_within(out, path, vocab, why, sizeof why);
  return rc ? err_set(err, errlen, rc == TOKENIZER_EVOCAB ? 2 : 1, "sample error: %s", why) : 0;
}

int sample_generate(model_t *m, backend_t *be, const plan_t *p, int is_text, FILE *out, char *err, size_t errlen) {
  tokenizer_t *tok = NULL;
  if (p->data.tokenizer[0] && load_tokenizer(&tok, p->data.tokenizer, model_vocab_size(m), err, errlen)) return -1;
  gen_t g = {.out = out, .is_text = is_text, .tok = tok};
  int rc = generate(&g, m, be, NULL, p->train.seq_len, p, err, errlen);
  free(g.ids);
  tokenizer_free(tok);
  return rc ? -1 : 0;
}

/* Whether data (of a model of vocab tokens) is byte text, without loading it. */
static int data_is_text(const plan_data_t *d, int vocab) {
  if (d->format == PLAN_DATA_TEXT) return 1;
  if (d->format != PLAN_DATA_AUTO) return 0;
  char err[256];
  int f = d->train[0] ? data_detect_format(d->train, PLAN_DATA_AUTO, err, sizeof err) : -1;
  return f >= 0 ? f == PLAN_DATA_TEXT : vocab <= 256;
}

/* The model of the file on be, fp32, activations for no batch (the cache has its own) and no
 * gradients: one parameter buffer the units point into. */
static int build_model(model_t **out, float **params, const plan_model_t *cfg, backend_t *be, char *err,
                       size_t errlen) {
  model_opts_t o = {.max_b = 1, .max_t = 1, .no_flat_buffers = 1};
  if (model_create_opts(out, cfg, be, &o, err, errlen)) return 2;
  model_t *m = *out;
  size_t n = model_num_params(m), off, num;
  if (!(*params = be->alloc(be, n * sizeof(float))))
    return err_set(err, errlen, 1, "sample error: cannot allocate %zu MiB for the parameters",
                   n * sizeof(float) >> 20);
  for (int u = 0; u < model_num_units(m); u++) {
    model_unit_range(m, u, &off, &num);
    model_set_unit_buffers(m, u, *params + off, NULL);
  }
  return 0;
}

int sample_run(const plan_t *p, backend_t *be, const char *path, int plan_file, const char *const *sets, int nsets,
               char *err, size_t errlen) {
  weights_file_t *f = NULL;
  model_t *m = NULL;
  model_kv_t *kv = NULL;
  tokenizer_t *tok = NULL;
  float *params = NULL;
  plan_model_t cfg;
  char tokenizer_path[PLAN_PATH_MAX + 32] = "";
  gen_t g = {.out = stdout};
  int rc = weights_open(&f, path, err, errlen);
  if (rc == 0) rc = weights_resolve_model(f, &p->model, plan_file, sets, nsets, &cfg, err, errlen);
  if (rc == 0) { /* how it prints: the tokenizer, else bytes or ids (sample.h) */
    const plan_data_t *fd = plan_file ? NULL : weights_data(f);
    const char *tp = p->data.tokenizer[0] ? p->data.tokenizer
                     : fd && fd->tokenizer[0] ? fd->tokenizer
                                              : weights_tokenizer(f);
    if (tp) rc = load_tokenizer(&tok, tp, cfg.vocab_size, err, errlen);
    snprintf(tokenizer_path, sizeof tokenizer_path, "%s", tp ? tp : "");
    g.tok = tok;
    g.is_text = plan_file ? data_is_text(&p->data, cfg.vocab_size) : fd ? data_is_text(fd, cfg.vocab_size)
                                                                       : cfg.vocab_size <= 256;
  }
  if (rc == 0)
    log_info("sample: %s (%s): dim %d, %d layers, vocab %d, context %d (KV cache)%s%s", path,
             weights_format_name(f), cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len,
             tok ? ", text through " : "", tok ? tokenizer_path : "");
  if (rc == 0) rc = build_model(&m, &params, &cfg, be, err, errlen);
  if (rc == 0) rc = weights_load_file(m, f, err, errlen);
  weights_close(f); /* the parameters are on the device now */
  if (rc == 0 && model_kv_create(&kv, m, cfg.max_seq_len, err, errlen)) rc = 1;
  if (rc == 0 && generate(&g, m, be, kv, cfg.max_seq_len, p, err, errlen)) rc = 1;
  free(g.ids);
  tokenizer_free(tok);
  model_kv_destroy(kv);
  model_destroy(m);
  if (params) be->free(be, params);
  return rc;
}
