// deps: trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/net.c common/store.c common/store_proto.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/log.c common/err.c common/env.c trainer/backend/fatal.c
/* model_bench: times forward + backward of a Llama on the cpu backend (no optimizer, no data).
 *
 *   model_bench [key=value ...]   keys: dim n_layers n_heads n_kv_heads vocab hidden b t iters threads
 *
 * Prints one line per iteration and the median in ms, so that bench_model_vs_torch.py (and a
 * human) can compare it with PyTorch at the same thread count. It is not the project's
 * benchmark (make bench): no data loading, no optimizer step, no collectives. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  log_init("[model_bench]");
  long dim = 384, n_layers = 6, n_heads = 6, n_kv_heads = 6, vocab = 256, hidden = 1024, B = 8, T = 256, iters = 5,
       threads = 0;
  struct {
    const char *k;
    long *v;
  } keys[] = {{"dim", &dim},
              {"n_layers", &n_layers},
              {"n_heads", &n_heads},
              {"n_kv_heads", &n_kv_heads},
              {"vocab", &vocab},
              {"hidden", &hidden},
              {"b", &B},
              {"t", &T},
              {"iters", &iters},
              {"threads", &threads}};
  for (int i = 1; i < argc; i++) {
    int found = 0;
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
      size_t n = strlen(keys[k].k);
      if (!strncmp(argv[i], keys[k].k, n) && argv[i][n] == '=') {
        *keys[k].v = strtol(argv[i] + n + 1, NULL, 10);
        found = 1;
      }
    }
    if (!found) {
      fprintf(stderr, "model_bench: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  plan_model_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.dim = (int)dim;
  cfg.n_layers = (int)n_layers;
  cfg.n_heads = (int)n_heads;
  cfg.n_kv_heads = (int)n_kv_heads;
  cfg.vocab_size = (int)vocab;
  cfg.hidden_dim = (int)hidden;
  cfg.max_seq_len = (int)T;
  cfg.rope_theta = 10000.0;
  cfg.norm_eps = 1e-5;

  char err[512];
  backend_t *be = backend_create("cpu", (int)threads, err, sizeof err);
  if (!be) {
    fprintf(stderr, "model_bench: %s\n", err);
    return 1;
  }
  model_t *m = NULL;
  if (model_create(&m, &cfg, be, (int)B, (int)T, 0, 0, err, sizeof err) != 0) {
    fprintf(stderr, "model_bench: %s\n", err);
    return 1;
  }
  model_init_random(m, 1, 0.02);
  int N = (int)(B * T);
  int32_t *tok = malloc((size_t)N * sizeof *tok), *tgt = malloc((size_t)N * sizeof *tgt);
  rng_t r;
  rng_init(&r, 1, 2);
  for (int i = 0; i < N; i++) {
    tok[i] = (int32_t)rng_below(&r, (uint64_t)vocab);
    tgt[i] = (int32_t)rng_below(&r, (uint64_t)vocab);
  }
  printf("model_bench: %zu params, B=%ld T=%ld\n", model_num_params(m), B, T);
  double *ms = calloc((size_t)iters, sizeof *ms);
  for (int it = -1; it < iters; it++) { /* one warmup */
    double t0 = now_ms();
    model_zero_grad(m);
    float loss = NAN;
    int rc = model_forward(m, tok, tgt, (int)B, (int)T, &loss);
    double t1 = now_ms();
    if (!rc) rc = model_backward(m, 1.0f);
    if (rc) {
      fprintf(stderr, "model_bench: %s\n", model_errmsg(m));
      return 1;
    }
    double t2 = now_ms();
    if (it >= 0) {
      ms[it] = t2 - t0;
      printf("iter %d: loss %.6f fwd %.1f ms bwd %.1f ms total %.1f ms\n", it, loss, t1 - t0, t2 - t1, t2 - t0);
    }
  }
  qsort(ms, (size_t)iters, sizeof *ms, cmp_double);
  printf("median_ms %.2f\n", ms[iters / 2]);
  free(ms);
  free(tok);
  free(tgt);
  model_destroy(m);
  backend_destroy(be);
  return 0;
}
