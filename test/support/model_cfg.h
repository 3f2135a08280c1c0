/* model_cfg: the Llama configuration the model tests and tools build by hand (no plan file):
 * the shape given, RoPE theta 10000, RMSNorm eps 1e-5, init std 0.1, no multiple_of unless set. */
#ifndef MESHRUN_TEST_MODEL_CFG_H
#define MESHRUN_TEST_MODEL_CFG_H

#include "trainer/plan/plan.h"

plan_model_t test_model_cfg(int dim, int n_layers, int n_heads, int n_kv_heads, int vocab, int hidden_dim,
                            int max_seq_len);

#endif
