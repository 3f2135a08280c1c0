// deps: trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/net.c common/store.c common/store_proto.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c trainer/formats/safetensors.c common/log.c common/err.c common/env.c test/support/model_cfg.c trainer/backend/fatal.c
/* model_oracle: one forward + backward of a small Llama on the cpu backend, dumped for PyTorch.
 *
 *   model_oracle OUT.safetensors [key=value ...]
 *     keys: seed dim n_layers n_heads n_kv_heads vocab multiple_of b t threads init_std
 *           dtype (fp32 or bf16: the model's param_dtype; the dumped weights and gradients are the
 *           fp32 masters and fp32 gradients either way)
 *
 * Builds the model, draws weights with model_init_random (norm weights then perturbed around 1
 * so that their gradients matter), draws tokens and targets from the seed with two targets set
 * to -1 (ignored), runs model_forward + model_backward(1.0) and writes to OUT: every weight
 * under its own name, every gradient as "grad.<name>", "tokens" and "targets" (I32, (B, T)),
 * "logits" (B, T, V), "loss" (1), and the config as JSON in the metadata key "config".
 * test/integration/test_oracle_model.py recomputes all of it in PyTorch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
#include "trainer/formats/safetensors.h"
#include "test/support/model_cfg.h"

/* Llama's hidden-size rule (as plan_llama_hidden_dim; kept here so the tool links no plan). */
static int llama_hidden(int dim, int multiple_of) {
  int h = 2 * (4 * dim) / 3;
  return multiple_of * ((h + multiple_of - 1) / multiple_of);
}

int main(int argc, char **argv) {
  log_init("[model_oracle]");
  if (argc < 2) {
    fprintf(stderr,
            "usage: %s OUT.safetensors [seed= dim= n_layers= n_heads= n_kv_heads= vocab= multiple_of= b= t= threads= "
            "init_std= dtype=fp32|bf16]\n",
            argv[0]);
    return 2;
  }
  long seed = 1234, dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab = 97, multiple_of = 32, B = 2, T = 16,
       threads = 1;
  double init_std = 0.1;
  dtype_t dt = DT_F32;
  for (int i = 2; i < argc; i++) {
    char key[64];
    const char *eq = strchr(argv[i], '=');
    if (!eq || eq - argv[i] >= (long)sizeof key) {
      fprintf(stderr, "model_oracle: bad argument %s (want key=value)\n", argv[i]);
      return 2;
    }
    snprintf(key, sizeof key, "%.*s", (int)(eq - argv[i]), argv[i]);
    const char *val = eq + 1;
    struct {
      const char *k;
      long *v;
    } keys[] = {{"seed", &seed},
                {"dim", &dim},
                {"n_layers", &n_layers},
                {"n_heads", &n_heads},
                {"n_kv_heads", &n_kv_heads},
                {"vocab", &vocab},
                {"multiple_of", &multiple_of},
                {"b", &B},
                {"t", &T},
                {"threads", &threads}};
    int found = 0;
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
      if (!strcmp(key, keys[k].k)) {
        *keys[k].v = strtol(val, NULL, 10);
        found = 1;
      }
    if (!strcmp(key, "init_std")) {
      init_std = strtod(val, NULL);
      found = 1;
    }
    if (!strcmp(key, "dtype")) {
      if (strcmp(val, "fp32") && strcmp(val, "bf16")) {
        fprintf(stderr, "model_oracle: dtype=%s: want fp32 or bf16\n", val);
        return 2;
      }
      dt = strcmp(val, "bf16") ? DT_F32 : DT_BF16;
      found = 1;
    }
    if (!found) {
      fprintf(stderr, "model_oracle: unknown key %s\n", key);
      return 2;
    }
  }

  plan_model_t cfg = test_model_cfg((int)dim, (int)n_layers, (int)n_heads, (int)n_kv_heads, (int)vocab,
                                    llama_hidden((int)dim, (int)multiple_of), (int)T);
  cfg.multiple_of = (int)multiple_of;
  cfg.init_std = init_std;

  char err[512];
  backend_t *be = backend_create("cpu", (int)threads, err, sizeof err);
  if (!be) {
    fprintf(stderr, "model_oracle: %s\n", err);
    return 1;
  }
  model_t *m = NULL;
  model_opts_t opts = {.max_b = (int)B, .max_t = (int)T, .param_dtype = dt};
  if (model_create_opts(&m, &cfg, be, &opts, err, sizeof err) != 0) {
    fprintf(stderr, "model_oracle: %s\n", err);
    backend_destroy(be);
    return 1;
  }
  model_init_random(m, (uint64_t)seed, init_std);

  size_t np = model_num_params(m);
  float *params = malloc(np * sizeof *params), *grads = malloc(np * sizeof *grads);
  int N = (int)(B * T);
  int32_t *tokens = malloc((size_t)N * sizeof *tokens), *targets = malloc((size_t)N * sizeof *targets);
  float *logits = malloc((size_t)N * vocab * sizeof *logits);
  if (!params || !grads || !tokens || !targets || !logits) {
    fprintf(stderr, "model_oracle: out of memory\n");
    return 1;
  }
  /* perturb norm weights around 1 */
  be->to_host(be, params, model_params(m), np * sizeof(float));
  rng_t r;
  rng_init(&r, (uint64_t)seed, 77);
  for (int i = 0; i < model_num_tensors(m); i++) {
    const model_tensor_t *t = model_tensor(m, i);
    if (t->ndim == 1)
      for (size_t j = 0; j < t->numel; j++)
        params[t->offset + j] = (float)(1.0 + 0.2 * rng_normal(&r));
  }
  be->to_device(be, model_params(m), params, np * sizeof(float));

  rng_init(&r, (uint64_t)seed, 99);
  for (int i = 0; i < N; i++) {
    tokens[i] = (int32_t)rng_below(&r, (uint64_t)vocab);
    targets[i] = (int32_t)rng_below(&r, (uint64_t)vocab);
  }
  targets[1] = -1; /* two ignored targets */
  targets[N - 2] = -1;

  model_zero_grad(m);
  float loss = NAN;
  if (model_forward(m, tokens, targets, (int)B, (int)T, &loss)) {
    fprintf(stderr, "model_oracle: %s\n", model_errmsg(m));
    return 1;
  }
  if (!isfinite(loss)) {
    fprintf(stderr, "model_oracle: loss is not finite\n");
    return 1;
  }
  be->to_host(be, logits, model_logits(m), (size_t)N * vocab * sizeof(float));
  if (model_backward(m, 1.0f)) {
    fprintf(stderr, "model_oracle: %s\n", model_errmsg(m));
    return 1;
  }
  be->to_host(be, grads, model_grads(m), np * sizeof(float));

  int nt = model_num_tensors(m);
  st_tensor_t *ts = calloc((size_t)(2 * nt + 4), sizeof *ts);
  char(*gnames)[128] = calloc((size_t)nt, sizeof *gnames);
  int k = 0;
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    ts[k] = (st_tensor_t){.name = t->name, .dtype = ST_F32, .ndim = t->ndim, .data = params + t->offset};
    ts[k].shape[0] = t->shape[0];
    ts[k].shape[1] = t->shape[1];
    k++;
  }
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    snprintf(gnames[i], sizeof gnames[i], "grad.%s", t->name);
    ts[k] = (st_tensor_t){.name = gnames[i], .dtype = ST_F32, .ndim = t->ndim, .data = grads + t->offset};
    ts[k].shape[0] = t->shape[0];
    ts[k].shape[1] = t->shape[1];
    k++;
  }
  ts[k++] = (st_tensor_t){.name = "tokens", .dtype = ST_I32, .ndim = 2, .shape = {B, T}, .data = tokens};
  ts[k++] = (st_tensor_t){.name = "targets", .dtype = ST_I32, .ndim = 2, .shape = {B, T}, .data = targets};
  ts[k++] = (st_tensor_t){.name = "logits", .dtype = ST_F32, .ndim = 3, .shape = {B, T, vocab}, .data = logits};
  ts[k++] = (st_tensor_t){.name = "loss", .dtype = ST_F32, .ndim = 1, .shape = {1}, .data = &loss};

  char config[512];
  snprintf(config, sizeof config,
           "{\"dim\": %d, \"n_layers\": %d, \"n_heads\": %d, \"n_kv_heads\": %d, \"vocab_size\": %d, "
           "\"hidden_dim\": %d, \"norm_eps\": %.9g, \"rope_theta\": %.9g, \"dtype\": \"%s\"}",
           cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.hidden_dim, cfg.norm_eps,
           cfg.rope_theta, dtype_name(dt));
  const char *meta[] = {"config", config};
  int rc = st_write(argv[1], ts, k, meta, 1, err, sizeof err);
  if (rc != 0)
    fprintf(stderr, "model_oracle: %s\n", err);
  else
    printf("model_oracle: loss %.9g, %zu params, wrote %s\n", loss, np, argv[1]);

  free(ts);
  free(gnames);
  free(params);
  free(grads);
  free(tokens);
  free(targets);
  free(logits);
  model_destroy(m);
  backend_destroy(be);
  return rc == 0 ? 0 : 1;
}
