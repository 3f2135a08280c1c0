/* model_cfg: see model_cfg.h. */
#include "test/support/model_cfg.h"

#include <string.h>

plan_model_t test_model_cfg(int dim, int n_layers, int n_heads, int n_kv_heads, int vocab, int hidden_dim,
                            int max_seq_len) {
  plan_model_t c;
  memset(&c, 0, sizeof c);
  c.dim = dim;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = vocab;
  c.hidden_dim = hidden_dim;
  c.max_seq_len = max_seq_len;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-5;
  c.init_std = 0.1;
  return c;
}
