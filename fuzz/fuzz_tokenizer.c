// deps: trainer/formats/tokenizer.c common/fs.c common/err.c fuzz/support.c
// max_len: 65536
/* fuzz_tokenizer: trainer/formats/tokenizer's two readers, its encoder and decoder, and the llama2.c to
 * tokenizer.json conversion.
 *
 * Input: a tokenizer.json's text when it starts with '{' (up to the first NUL; what follows the
 * NUL is the text to encode), else a llama2.c tokenizer.bin (the text is a fixed one). The file
 * goes to tokenizer_load as a memfd path. A tokenizer that loads must encode the text into ids in
 * [0, vocab_size) and decode them without error; a llama2.c one that converts must read back from
 * its tokenizer.json with the same vocab size, BOS and EOS. A refusal must leave *out NULL and say
 * "tokenizer" first. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/support.h"
#include "trainer/formats/tokenizer.h"

static const char TEXT[] = "Hello, world! It's  a test\n\twith \xc3\xa9 and \xf0\x9f\x98\x80 <s> ab";

static void encode_decode(const tokenizer_t *t, const char *text, size_t len) {
  int32_t *ids = NULL;
  size_t n = 0, dl;
  char err[1024], *back = NULL;
  int rc = tokenizer_encode(t, text, len, &ids, &n, err, sizeof err);
  if (rc) { /* llama2.c without byte tokens cannot encode every byte: a message, no ids */
    fuzz_note("encode: %s", err);
    CHECK(ids == NULL && !strncmp(err, "tokenizer", 9));
    return;
  }
  for (size_t i = 0; i < n; i++) CHECK(ids[i] >= 0 && ids[i] < tokenizer_vocab_size(t));
  CHECK(tokenizer_decode(t, ids, n, &back, &dl) == 0 && back);
  free(back);
  free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static fuzz_memfile_t file, conv;
  if (!file.path[0]) {
    fuzz_memfile_init(&file, "tokenizer");
    fuzz_memfile_init(&conv, "converted.json");
  }
  char *parts[2];
  size_t lens[2];
  int json = size > 0 && data[0] == '{';
  int n = json ? fuzz_split(data, size, 2, parts, lens) : 0;
  if (json) fuzz_memfile_set(&file, parts[0], lens[0]);
  else fuzz_memfile_set(&file, data, size);
  const char *text = json && n == 2 ? parts[1] : TEXT;
  size_t tlen = json && n == 2 ? lens[1] : sizeof TEXT - 1;

  tokenizer_t *t = (tokenizer_t *)1;
  char err[1024];
  int rc = tokenizer_load(&t, file.path, err, sizeof err);
  if (rc) {
    fuzz_note("%s", err);
    CHECK(t == NULL && !strncmp(err, "tokenizer", 9));
  } else {
    encode_decode(t, text, tlen);
    char *out = NULL;
    size_t olen;
    if (!json && tokenizer_llama2c_json(t, &out, &olen, err, sizeof err) == 0) {
      fuzz_memfile_set(&conv, out, olen);
      free(out);
      tokenizer_t *back = NULL;
      rc = tokenizer_load(&back, conv.path, err, sizeof err);
      if (rc) fprintf(stderr, "the converted tokenizer.json does not load: %s\n", err);
      CHECK(rc == 0);
      CHECK(tokenizer_vocab_size(back) == tokenizer_vocab_size(t));
      CHECK(tokenizer_bos(back) == tokenizer_bos(t) && tokenizer_eos(back) == tokenizer_eos(t));
      encode_decode(back, TEXT, sizeof TEXT - 1);
      tokenizer_free(back);
    } else if (!json) {
      CHECK(out == NULL);
    }
    tokenizer_free(t);
  }
  if (json) fuzz_parts_free(parts, n);
  return 0;
}
