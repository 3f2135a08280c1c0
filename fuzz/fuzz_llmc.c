// deps: trainer/formats/data.c trainer/formats/tokenizer.c trainer/model/rng.c common/fs.c common/err.c fuzz/support.c
// max_len: 4096
/* fuzz_llmc: the token-file reader (data_load) on llm.c / nanoGPT shards.
 *
 * Input: the shard's bytes (256 int32 header: magic 20240520, version 1, token count; then
 * uint16 tokens), given as a memfd path with data.format "auto", as a plan would give it (the
 * magic picks llmc). The model is GPT-2's (vocab 50257), sequences of 8 tokens, 10% split off
 * for validation. A file that loads must hold only ids below the vocabulary, and every train
 * and eval batch of a dp=2 layout must be cut from inside the token arrays. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/support.h"
#include "trainer/formats/data.h"

enum { VOCAB = 50257, T = 8, B = 2, DP = 2, G = B * DP * 2 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static fuzz_memfile_t file;
  static plan_t p;
  if (!file.path[0]) {
    fuzz_memfile_init(&file, "shard.bin");
    p.model.vocab_size = VOCAB;
    p.train.seq_len = T;
    p.train.micro_batch_size = B;
    p.train.global_batch_size = G;
    p.seed = 1337;
    p.data.format = PLAN_DATA_AUTO;
    p.data.val_fraction = 0.1;
    snprintf(p.data.train, sizeof p.data.train, "%s", file.path);
  }
  fuzz_memfile_set(&file, data, size);
  data_t d;
  char err[512];
  if (data_load(&d, &p, 1, err, sizeof err) != 0) {
    fuzz_note("%s", err);
    CHECK(err[0]);
    return 0;
  }
  CHECK(d.format == PLAN_DATA_LLMC);
  CHECK(d.n_train >= T + 1 && d.n_val >= T + 1);
  for (size_t i = 0; i < d.n_train; i++)
    CHECK(data_train_token(&d, i) >= 0 && data_train_token(&d, i) < VOCAB);
  for (size_t i = 0; i < d.n_val; i++)
    CHECK(data_val_token(&d, i) >= 0 && data_val_token(&d, i) < VOCAB);
  int32_t tok[B * T], tgt[B * T];
  for (int step = 0; step < 2; step++)
    for (int m = 0; m < G / (B * DP); m++)
      for (int r = 0; r < DP; r++)
        data_train_batch(&d, step, m, r, DP, B, tok, tgt);
  data_eval_batch(&d, 0, B, tok, tgt);
  data_eval_batch(&d, 1, B, tok, tgt);
  fuzz_note("loaded: %zu train, %zu val tokens", d.n_train, d.n_val);
  data_free(&d);
  return 0;
}
