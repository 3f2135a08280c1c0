// deps: trainer/formats/interop.c trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c trainer/formats/safetensors.c common/net.c common/store.c common/store_proto.c common/log.c common/fs.c common/err.c common/env.c test/support/model_cfg.c trainer/backend/fatal.c
/* interop_tool: a small CLI over trainer/formats/interop for the integration tests (until `trainer
 * export` and model.init of .bin / HF directories are wired into main.c).
 *
 *   interop_tool export FORMAT OUT DUMP.safetensors [key=value ...]
 *       a random model (keys: seed dim n_layers n_heads n_kv_heads vocab hidden_dim seq_len b t
 *       tied=0|1), norm weights perturbed around 1 so that they matter; exported to OUT
 *       (FORMAT llama2c or hf); DUMP gets its weights (our names), "tokens" (B, T) and "logits".
 *   interop_tool logits IN DUMP.safetensors [b= t= seed= gen=N random=1]
 *       imports IN (llama2.c file or HF directory), prints its config; runs a forward on
 *       random tokens, or with gen=N generates N tokens greedily from BOS (1) and runs the whole
 *       sequence as one batch with next-token targets, printing "loss X". random=1 uses the
 *       file's dims with random weights instead. DUMP: weights, tokens, logits, loss.
 *   interop_tool convert IN FORMAT OUT
 *       import then export (what `trainer export` will do from a model.init file).
 * Errors print the module's one-line message and exit 1. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "trainer/backend/backend.h"
#include "trainer/formats/interop.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
#include "trainer/formats/safetensors.h"
#include "test/support/model_cfg.h"

typedef struct {
  long seed, dim, n_layers, n_heads, n_kv_heads, vocab, hidden_dim, seq_len, b, t, tied, gen, random;
} opts_t;

static int parse_opts(int argc, char **argv, opts_t *o) {
  for (int i = 0; i < argc; i++) {
    const char *eq = strchr(argv[i], '=');
    struct {
      const char *k;
      long *v;
    } keys[] = {{"seed", &o->seed},
                {"dim", &o->dim},
                {"n_layers", &o->n_layers},
                {"n_heads", &o->n_heads},
                {"n_kv_heads", &o->n_kv_heads},
                {"vocab", &o->vocab},
                {"hidden_dim", &o->hidden_dim},
                {"seq_len", &o->seq_len},
                {"b", &o->b},
                {"t", &o->t},
                {"tied", &o->tied},
                {"gen", &o->gen},
                {"random", &o->random}};
    int found = 0;
    for (size_t k = 0; eq && k < sizeof keys / sizeof keys[0]; k++)
      if ((size_t)(eq - argv[i]) == strlen(keys[k].k) && !strncmp(argv[i], keys[k].k, strlen(keys[k].k))) {
        *keys[k].v = strtol(eq + 1, NULL, 10);
        found = 1;
      }
    if (!found) {
      fprintf(stderr, "interop_tool: unknown argument %s\n", argv[i]);
      return -1;
    }
  }
  return 0;
}

/* Writes the model's weights, tokens, logits and (when finite) the loss. */
static int dump(model_t *m, backend_t *be, const char *path, const int32_t *tokens, int b, int t, float loss) {
  const int nt = model_num_tensors(m), v = model_vocab_size(m);
  size_t np = model_num_params(m);
  float *params = malloc(np * sizeof(float)), *logits = malloc((size_t)b * t * v * sizeof(float));
  st_tensor_t *ts = calloc((size_t)nt + 3, sizeof *ts);
  if (!params || !logits || !ts) {
    fprintf(stderr, "interop_tool: out of memory\n");
    return -1;
  }
  be->to_host(be, params, model_params(m), np * sizeof(float));
  be->to_host(be, logits, model_logits(m), (size_t)b * t * v * sizeof(float));
  int k = 0;
  for (int i = 0; i < nt; i++, k++) {
    const model_tensor_t *x = model_tensor(m, i);
    ts[k] = (st_tensor_t){.name = x->name, .dtype = ST_F32, .ndim = x->ndim, .data = params + x->offset};
    ts[k].shape[0] = x->shape[0];
    ts[k].shape[1] = x->shape[1];
  }
  ts[k++] = (st_tensor_t){.name = "tokens", .dtype = ST_I32, .ndim = 2, .shape = {b, t}, .data = tokens};
  ts[k++] = (st_tensor_t){.name = "logits", .dtype = ST_F32, .ndim = 3, .shape = {b, t, v}, .data = logits};
  if (isfinite(loss)) ts[k++] = (st_tensor_t){.name = "loss", .dtype = ST_F32, .ndim = 1, .shape = {1}, .data = &loss};
  char err[512];
  int rc = st_write(path, ts, k, NULL, 0, err, sizeof err);
  if (rc) fprintf(stderr, "interop_tool: %s\n", err);
  free(params);
  free(logits);
  free(ts);
  return rc;
}

static void random_tokens(int32_t *tok, int n, int v, uint64_t seed) {
  rng_t r;
  rng_init(&r, seed, 99);
  for (int i = 0; i < n; i++)
    tok[i] = (int32_t)rng_below(&r, (uint64_t)v);
}

static int cmd_export(int argc, char **argv, backend_t *be) {
  interop_format_t fmt;
  if (argc < 3 || interop_format_parse(argv[0], &fmt) != 0) {
    fprintf(stderr, "interop_tool export: want FORMAT (llama2c|hf) OUT DUMP [key=value ...]\n");
    return 2;
  }
  opts_t o = {.seed = 1,
              .dim = 64,
              .n_layers = 2,
              .n_heads = 4,
              .n_kv_heads = 2,
              .vocab = 97,
              .hidden_dim = 96,
              .seq_len = 32,
              .b = 2,
              .t = 16};
  if (parse_opts(argc - 3, argv + 3, &o)) return 2;
  plan_model_t cfg = test_model_cfg((int)o.dim, (int)o.n_layers, (int)o.n_heads, (int)o.n_kv_heads, (int)o.vocab,
                                    (int)o.hidden_dim, (int)o.seq_len);
  cfg.multiple_of = 256;
  char err[512];
  model_t *m = NULL;
  if (model_create(&m, &cfg, be, (int)o.b, (int)o.t, 0, 0, err, sizeof err)) {
    fprintf(stderr, "interop_tool: %s\n", err);
    return 1;
  }
  model_init_random(m, (uint64_t)o.seed, cfg.init_std);
  /* norms around 1; tied=1 copies the embedding into the classifier */
  size_t np = model_num_params(m);
  float *params = malloc(np * sizeof(float));
  be->to_host(be, params, model_params(m), np * sizeof(float));
  rng_t r;
  rng_init(&r, (uint64_t)o.seed, 77);
  const model_tensor_t *emb = model_find_tensor(m, "tok_embeddings.weight"),
                       *out = model_find_tensor(m, "output.weight");
  for (int i = 0; i < model_num_tensors(m); i++) {
    const model_tensor_t *t = model_tensor(m, i);
    if (t->ndim == 1)
      for (size_t j = 0; j < t->numel; j++)
        params[t->offset + j] = (float)(1.0 + 0.2 * rng_normal(&r));
  }
  if (o.tied) memcpy(params + out->offset, params + emb->offset, emb->numel * sizeof(float));
  be->to_device(be, model_params(m), params, np * sizeof(float));
  free(params);

  int n = (int)(o.b * o.t), rc = 1;
  int32_t *tok = malloc((size_t)n * sizeof *tok);
  random_tokens(tok, n, cfg.vocab_size, (uint64_t)o.seed);
  if (model_forward(m, tok, NULL, (int)o.b, (int)o.t, NULL))
    fprintf(stderr, "interop_tool: %s\n", model_errmsg(m));
  else if (interop_export_model(m, &cfg, fmt, argv[1], err, sizeof err))
    fprintf(stderr, "interop_tool: %s\n", err);
  else if (dump(m, be, argv[2], tok, (int)o.b, (int)o.t, NAN) == 0)
    rc = 0;
  if (rc == 0) printf("interop_tool: exported %s to %s\n", interop_format_name(fmt), argv[1]);
  free(tok);
  model_destroy(m);
  return rc;
}

/* Opens IN and builds a model of its config with room for (b, t); weights imported unless random. */
static model_t *open_model(const char *in, backend_t *be, int b, int t, int random, uint64_t seed, plan_model_t *cfg) {
  char err[512];
  interop_file_t *f = NULL;
  if (interop_open(&f, in, INTEROP_AUTO, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return NULL;
  }
  *cfg = *interop_config(f);
  model_t *m = NULL;
  if (model_create(&m, cfg, be, b, t, 0, 0, err, sizeof err)) {
    fprintf(stderr, "interop_tool: %s\n", err);
  } else if (random) {
    model_init_random(m, seed, cfg->init_std);
  } else if (interop_check_plan(f, cfg, err, sizeof err) || interop_load_model(f, m, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    model_destroy(m);
    m = NULL;
  }
  interop_close(f);
  return m;
}

static int cmd_logits(int argc, char **argv, backend_t *be) {
  if (argc < 2) {
    fprintf(stderr, "interop_tool logits: want IN DUMP [key=value ...]\n");
    return 2;
  }
  opts_t o = {.seed = 1, .b = 2, .t = 16};
  if (parse_opts(argc - 2, argv + 2, &o)) return 2;
  int b = (int)o.b, t = (int)o.t;
  if (o.gen > 0) {
    b = 1;
    t = (int)o.gen;
  }
  plan_model_t cfg;
  model_t *m = open_model(argv[0], be, b, t + 1, (int)o.random, (uint64_t)o.seed, &cfg);
  if (!m) return 1;
  printf("config dim %d hidden_dim %d n_layers %d n_heads %d n_kv_heads %d vocab_size %d seq_len %d rope_theta %g "
         "norm_eps %g\n",
         cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len,
         cfg.rope_theta, cfg.norm_eps);
  const int v = cfg.vocab_size;
  int32_t *tok = malloc((size_t)b * (t + 1) * sizeof *tok);
  float *row = malloc((size_t)v * sizeof *row);
  float loss = NAN;
  if (o.gen > 0) { /* greedy from BOS; each step a full forward over the prefix */
    tok[0] = 1;
    for (int n = 1; n <= t; n++) {
      if (model_forward(m, tok, NULL, 1, n, NULL)) break;
      be->to_host(be, row, model_logits(m) + (size_t)(n - 1) * v, (size_t)v * sizeof(float));
      int best = 0;
      for (int i = 1; i < v; i++)
        if (row[i] > row[best]) best = i;
      tok[n] = best;
    }
    if (model_forward(m, tok, tok + 1, 1, t, &loss)) fprintf(stderr, "interop_tool: %s\n", model_errmsg(m));
    printf("tokens");
    for (int i = 0; i <= t; i++)
      printf(" %d", tok[i]);
    printf("\nloss %.6f\n", loss);
  } else {
    random_tokens(tok, b * t, v, (uint64_t)o.seed);
    if (model_forward(m, tok, NULL, b, t, NULL)) fprintf(stderr, "interop_tool: %s\n", model_errmsg(m));
  }
  int rc = model_forward_ok(m) && dump(m, be, argv[1], tok, b, t, loss) == 0 ? 0 : 1;
  free(tok);
  free(row);
  model_destroy(m);
  return rc;
}

static int cmd_convert(int argc, char **argv, backend_t *be) {
  interop_format_t fmt;
  if (argc != 3 || interop_format_parse(argv[1], &fmt) != 0) {
    fprintf(stderr, "interop_tool convert: want IN FORMAT (llama2c|hf) OUT\n");
    return 2;
  }
  plan_model_t cfg;
  model_t *m = open_model(argv[0], be, 1, 1, 0, 0, &cfg);
  if (!m) return 1;
  char err[512];
  int rc = interop_export_model(m, &cfg, fmt, argv[2], err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  model_destroy(m);
  return rc ? 1 : 0;
}

int main(int argc, char **argv) {
  log_init("[interop_tool]");
  if (argc < 2) {
    fprintf(stderr, "usage: %s export|logits|convert ... (see the file's opening comment)\n", argv[0]);
    return 2;
  }
  char err[512];
  backend_t *be = backend_create("cpu", 1, err, sizeof err);
  if (!be) {
    fprintf(stderr, "interop_tool: %s\n", err);
    return 1;
  }
  int rc = 2;
  if (!strcmp(argv[1], "export"))
    rc = cmd_export(argc - 2, argv + 2, be);
  else if (!strcmp(argv[1], "logits"))
    rc = cmd_logits(argc - 2, argv + 2, be);
  else if (!strcmp(argv[1], "convert"))
    rc = cmd_convert(argc - 2, argv + 2, be);
  else
    fprintf(stderr, "interop_tool: unknown command %s\n", argv[1]);
  backend_destroy(be);
  return rc;
}
