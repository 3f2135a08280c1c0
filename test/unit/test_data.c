// deps: trainer/formats/data.c trainer/formats/tokenizer.c trainer/model/rng.c common/fs.c common/err.c test/support/files.c
/* test_data: file formats and their detection, the validation split, the load-time checks
 * with their messages, and the batch rule (the same global batch whatever the dp degree). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "test/support/files.h"
#include "trainer/formats/data.h"
#include "trainer/formats/tokenizer.h"

static char g_dir[256];

static int setup(void **state) { return testdir_make(g_dir, sizeof g_dir, "test_data"); }

static int teardown(void **state) { return testdir_remove(g_dir); }

static const char *path_in(const char *name) {
  static char buf[4][512];
  static int k;
  char *p = buf[k++ & 3];
  snprintf(p, 512, "%s/%s", g_dir, name);
  return p;
}

static void base_plan(plan_t *p, int vocab, int t, int g) {
  memset(p, 0, sizeof *p);
  p->seed = 1234;
  p->model.vocab_size = vocab;
  p->train.seq_len = t;
  p->train.global_batch_size = g;
  p->data.val_fraction = 0.1;
}

static void test_text_and_split(void **state) {
  const char *txt = "hello world, this is a small text file for the byte tokenizer!\n";
  size_t n = strlen(txt);
  testfile_write(path_in("a.txt"), txt, n);
  plan_t p;
  base_plan(&p, 256, 8, 4);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("a.txt"));
  data_t d;
  char err[512] = "";
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  assert_int_equal(d.format, PLAN_DATA_TEXT);
  assert_true(d.is_text);
  size_t nv = (size_t)(n * 0.1);
  assert_int_equal(d.n_val, nv);
  assert_int_equal(d.n_train, n - nv);
  assert_int_equal(data_train_token(&d, 0), 'h');
  assert_int_equal(data_val_token(&d, 0), (unsigned char)txt[n - nv]);
  data_free(&d);
}

static void test_llmc_u16_u32(void **state) {
  /* llm.c layout under a .bin name: detected by magic. */
  int32_t hdr[256] = {20240520, 1, 50};
  uint16_t toks[50];
  for (int i = 0; i < 50; i++) toks[i] = (uint16_t)(1000 + i);
  unsigned char buf[sizeof hdr + sizeof toks];
  memcpy(buf, hdr, sizeof hdr);
  memcpy(buf + sizeof hdr, toks, sizeof toks);
  testfile_write(path_in("shard.bin"), buf, sizeof buf);
  plan_t p;
  base_plan(&p, 2000, 8, 2);
  p.data.val_fraction = 0;
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("shard.bin"));
  data_t d;
  char err[512] = "";
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  assert_int_equal(d.format, PLAN_DATA_LLMC);
  assert_int_equal(d.n_train, 50);
  assert_int_equal(data_train_token(&d, 49), 1049);
  assert_int_equal(d.n_val, 0);
  data_free(&d);

  testfile_write(path_in("t.u16"), toks, sizeof toks);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("t.u16"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  assert_int_equal(d.format, PLAN_DATA_U16);
  assert_int_equal(data_train_token(&d, 3), 1003);
  data_free(&d);

  uint32_t t32[20];
  for (int i = 0; i < 20; i++) t32[i] = 70000u + (uint32_t)i;
  testfile_write(path_in("t.u32"), t32, sizeof t32);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("t.u32"));
  p.model.vocab_size = 100000;
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  assert_int_equal(d.format, PLAN_DATA_U32);
  assert_int_equal(data_train_token(&d, 19), 70019);
  data_free(&d);

  /* Separate validation file. */
  snprintf(p.data.val, sizeof p.data.val, "%s", path_in("t.u32"));
  assert_int_equal(data_load(&d, &p, 1, err, sizeof err), 0);
  assert_int_equal(d.n_train, 20);
  assert_int_equal(d.n_val, 20);
  data_free(&d);
}

static void test_errors(void **state) {
  plan_t p;
  data_t d;
  char err[512];

  base_plan(&p, 256, 8, 2);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("missing.txt"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EIO);
  printf("missing: %s\n", err);
  assert_non_null(strstr(err, "missing.txt"));

  /* Shorter than one sequence (T+1 = 9 tokens). */
  testfile_write(path_in("short.txt"), "abcdefgh", 8);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("short.txt"));
  p.data.val_fraction = 0;
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("short: %s\n", err);
  assert_non_null(strstr(err, "fewer than one sequence"));

  /* Token id >= vocab: named with its position. */
  uint16_t toks[30];
  for (int i = 0; i < 30; i++) toks[i] = 5;
  toks[17] = 300;
  testfile_write(path_in("big.u16"), toks, sizeof toks);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("big.u16"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("vocab: %s\n", err);
  assert_non_null(strstr(err, "big.u16"));
  assert_non_null(strstr(err, "token id 300 at position 17"));

  /* Odd byte count for u16; truncated llm.c shard; unknown extension. */
  testfile_write(path_in("odd.u16"), "abcde", 5);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("odd.u16"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("odd: %s\n", err);
  int32_t hdr[256] = {20240520, 1, 1000};
  testfile_write(path_in("trunc.bin"), hdr, sizeof hdr);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("trunc.bin"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("trunc: %s\n", err);
  assert_non_null(strstr(err, "header says 1000 tokens"));
  testfile_write(path_in("x.dat"), "0123456789abcdef", 16);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("x.dat"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("unknown: %s\n", err);
  assert_non_null(strstr(err, "data.format"));

  /* Validation needed but too short. */
  char text[200];
  memset(text, 'a', sizeof text);
  testfile_write(path_in("v.txt"), text, sizeof text);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("v.txt"));
  p.data.val_fraction = 0.02; /* 4 tokens < 9 */
  assert_int_equal(data_load(&d, &p, 1, err, sizeof err), DATA_EINVAL);
  printf("val: %s\n", err);
  assert_non_null(strstr(err, "validation split"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  data_free(&d);
}

/* An llm.c shard of ids under GPT-2's header (width 2) or Llama 3's (width 4). */
static void write_llmc(const char *path, int width, const uint32_t *ids, int n) {
  int32_t hdr[256] = {width == 2 ? 20240520 : 20240801, width == 2 ? 1 : 7, n};
  unsigned char buf[sizeof hdr + 4 * 4096];
  assert_true(n <= 4096);
  memcpy(buf, hdr, sizeof hdr);
  for (int i = 0; i < n; i++)
    for (int b = 0; b < width; b++) buf[sizeof hdr + (size_t)i * width + b] = (unsigned char)(ids[i] >> (8 * b));
  testfile_write(path, buf, sizeof hdr + (size_t)n * width);
}

static void test_llmc_u32_header(void **state) {
  uint32_t ids[40];
  for (int i = 0; i < 40; i++) ids[i] = 100000u + (uint32_t)i * 3;
  write_llmc(path_in("llama3.bin"), 4, ids, 40);
  plan_t p;
  base_plan(&p, 128256, 8, 2);
  p.data.val_fraction = 0;
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("llama3.bin"));
  data_t d;
  char err[512] = "";
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  assert_int_equal(d.format, PLAN_DATA_LLMC);
  assert_false(d.is_text);
  assert_int_equal(d.n_train, 40);
  assert_int_equal(data_train_token(&d, 39), 100000 + 39 * 3);
  data_free(&d);

  /* An id past the vocabulary, in a uint32 shard. */
  p.model.vocab_size = 100050;
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("u32 vocab: %s\n", err);
  assert_non_null(strstr(err, "token id 100051 at position 17"));

  /* A header whose version does not go with its magic. */
  int32_t hdr[256] = {20240801, 1, 0};
  testfile_write(path_in("badver.bin"), hdr, sizeof hdr);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("badver.bin"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("version: %s\n", err);
  assert_non_null(strstr(err, "bad llm.c header"));
}

/* An llm.c file is never read as text or raw ids, and llmc needs the header. */
static void test_format_disagrees(void **state) {
  uint32_t ids[64];
  for (int i = 0; i < 64; i++) ids[i] = (uint32_t)i;
  write_llmc(path_in("shard.txt"), 2, ids, 64); /* a misleading extension too */
  plan_t p;
  base_plan(&p, 256, 8, 2);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("shard.txt"));
  data_t d;
  char err[512];
  const plan_data_format_t wrong[] = {PLAN_DATA_TEXT, PLAN_DATA_U16, PLAN_DATA_U32};
  for (int i = 0; i < 3; i++) {
    p.data.format = wrong[i];
    assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
    printf("explicit %s: %s\n", data_format_name(wrong[i]), err);
    assert_non_null(strstr(err, "starts with an llm.c header"));
    assert_non_null(strstr(err, data_format_name(wrong[i])));
  }
  p.data.format = PLAN_DATA_AUTO;
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  assert_int_equal(d.format, PLAN_DATA_LLMC);
  data_free(&d);

  testfile_write(path_in("plain.txt"), "some plain text, long enough for a window or two", 48);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("plain.txt"));
  p.data.format = PLAN_DATA_LLMC;
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("explicit llmc: %s\n", err);
  assert_non_null(strstr(err, "has no llm.c header"));
}

/* Shards as a list and as a glob: one stream, the same batches as the one file they were cut
 * from, including windows across the shard boundaries, and a validation split off the end. */
static void test_shards_match_one_file(void **state) {
  enum { N = 3000, T = 32, G = 8 };
  static uint32_t ids[N];
  uint16_t raw[N];
  for (int i = 0; i < N; i++) ids[i] = raw[i] = (uint16_t)((i * 7919u + 13u) % 5000u);
  testfile_write(path_in("all.u16"), raw, sizeof raw);
  /* 3 shards of unequal size, two header kinds, named so that sorting gives their order */
  write_llmc(path_in("tok_train_000000.bin"), 2, ids, 1000);
  write_llmc(path_in("tok_train_000001.bin"), 4, ids + 1000, 37);
  testfile_write(path_in("tok_train_000002.u16"), raw + 1037, (N - 1037) * sizeof(uint16_t));

  plan_t one, list, glob;
  base_plan(&one, 5000, T, G);
  one.data.val_fraction = 0.1;
  list = glob = one;
  snprintf(one.data.train, sizeof one.data.train, "%s", path_in("all.u16"));
  snprintf(list.data.train, sizeof list.data.train, "%s\n%s\n%s", path_in("tok_train_000000.bin"),
           path_in("tok_train_000001.bin"), path_in("tok_train_000002.u16"));
  snprintf(glob.data.train, sizeof glob.data.train, "%s", path_in("tok_train_*"));
  data_t a, b, c;
  char err[512] = "";
  assert_int_equal(data_load(&a, &one, 1, err, sizeof err), 0);
  assert_int_equal(data_load(&b, &list, 1, err, sizeof err), 0);
  assert_int_equal(data_load(&c, &glob, 1, err, sizeof err), 0);
  assert_int_equal(b.train_src.n_shards, 3);
  assert_int_equal(c.train_src.n_shards, 3);
  assert_int_equal(b.n_train, a.n_train);
  assert_int_equal(b.n_val, a.n_val);
  static int32_t ta[G * T], ya[G * T], tb[G * T], yb[G * T], tc[G * T], yc[G * T];
  int crossings = 0;
  for (int s = 0; s < 200; s++) {
    data_train_batch(&a, s, 0, 0, 1, G, ta, ya);
    data_train_batch(&b, s, 0, 0, 1, G, tb, yb);
    data_train_batch(&c, s, 0, 0, 1, G, tc, yc);
    assert_memory_equal(ta, tb, sizeof ta);
    assert_memory_equal(ya, yb, sizeof ya);
    assert_memory_equal(ta, tc, sizeof ta);
    assert_memory_equal(ya, yc, sizeof ya);
    for (int i = 0; i < G; i++) /* a window holding the token before and after a boundary */
      for (int k = 0; k < T; k++)
        if (ta[i * T + k] == (int32_t)ids[999] && ya[i * T + k] == (int32_t)ids[1000]) crossings++;
  }
  printf("shards: 200 steps of %d windows equal to the one file's; %d windows across a boundary\n", G, crossings);
  assert_true(crossings > 0); /* the comparison covered a boundary */
  for (int k = 0; k < 4; k++) {
    data_eval_batch(&a, k, G, ta, ya);
    data_eval_batch(&b, k, G, tb, yb);
    assert_memory_equal(ta, tb, sizeof ta);
    assert_memory_equal(ya, yb, sizeof ya);
  }
  data_free(&a);
  data_free(&b);
  data_free(&c);

  /* A glob that matches nothing; text among id shards. */
  snprintf(glob.data.train, sizeof glob.data.train, "%s", path_in("nothing_*.bin"));
  assert_int_equal(data_load(&c, &glob, 0, err, sizeof err), DATA_EIO);
  printf("no match: %s\n", err);
  assert_non_null(strstr(err, "no file matches"));
  testfile_write(path_in("words.txt"), "text among the shards", 21);
  snprintf(list.data.train, sizeof list.data.train, "%s\n%s", path_in("tok_train_000000.bin"), path_in("words.txt"));
  assert_int_equal(data_load(&c, &list, 0, err, sizeof err), DATA_EINVAL);
  printf("mixed: %s\n", err);
  assert_non_null(strstr(err, "all text or all ids"));
}

/* Collects step s's global batch as dp ranks x accumulation micro-steps would see it. */
static void global_batch(const data_t *d, int s, int dp, int micro, int accum, int32_t *out_tok, int32_t *out_tgt) {
  const int t = d->seq_len;
  for (int m = 0; m < accum; m++)
    for (int r = 0; r < dp; r++) {
      size_t row = (size_t)(m * dp + r) * micro;
      data_train_batch(d, s, m, r, dp, micro, out_tok + row * t, out_tgt + row * t);
    }
}

static void test_batch_rule(void **state) {
  plan_t p;
  base_plan(&p, 64, 16, 8);
  p.data.format = PLAN_DATA_SYNTHETIC;
  data_t d;
  char err[512];
  assert_int_equal(data_load(&d, &p, 1, err, sizeof err), 0);
  const int g = 8, t = 16;
  int32_t ref_tok[8 * 16], ref_tgt[8 * 16], tok[8 * 16], tgt[8 * 16];
  global_batch(&d, 3, 1, 8, 1, ref_tok, ref_tgt);
  /* targets are tokens shifted by one within each window. */
  for (int i = 0; i < g; i++)
    for (int j = 0; j + 1 < t; j++) assert_int_equal(ref_tgt[i * t + j], ref_tok[i * t + j + 1]);
  const int layouts[][3] = {{1, 1, 8}, {2, 4, 1}, {4, 2, 1}, {2, 2, 2}, {8, 1, 1}, {1, 2, 4}};
  for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++) {
    global_batch(&d, 3, layouts[k][0], layouts[k][1], layouts[k][2], tok, tgt);
    assert_memory_equal(tok, ref_tok, sizeof tok);
    assert_memory_equal(tgt, ref_tgt, sizeof tgt);
  }
  /* Another step draws other windows; the same step again draws the same. */
  global_batch(&d, 4, 1, 8, 1, tok, tgt);
  assert_memory_not_equal(tok, ref_tok, sizeof tok);
  global_batch(&d, 3, 2, 2, 2, tok, tgt);
  assert_memory_equal(tok, ref_tok, sizeof tok);

  /* Eval batches are fixed. */
  int32_t e1[2 * 16], e1t[2 * 16], e2[2 * 16], e2t[2 * 16];
  data_eval_batch(&d, 1, 2, e1, e1t);
  data_eval_batch(&d, 1, 2, e2, e2t);
  assert_memory_equal(e1, e2, sizeof e1);
  for (int i = 0; i < 2 * 16; i++) assert_true(e1[i] >= 0 && e1[i] < 64);
  data_free(&d);

  /* Synthetic tokens are learnable: the favourite successor follows in about 3/4 of cases. */
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), 0);
  size_t n = d.n_train, same = 0;
  static int32_t best[64][64];
  memset(best, 0, sizeof best);
  for (size_t i = 0; i + 1 < n; i++) best[data_train_token(&d, i)][data_train_token(&d, i + 1)]++;
  for (int a = 0; a < 64; a++) {
    int mx = 0;
    for (int b = 0; b < 64; b++)
      if (best[a][b] > mx) mx = best[a][b];
    same += (size_t)mx;
  }
  double frac = (double)same / (double)(n - 1);
  printf("synthetic: favourite successor fraction %.3f (expect about 0.75 + 0.25/64)\n", frac);
  assert_true(frac > 0.70 && frac < 0.82);
  data_free(&d);
}

/* A llama2.c tokenizer.bin: <unk> <s> </s>, the 256 byte tokens, then " ", "a", "b", "ab", " ab"
 * (ids 259..263; the merge scores favour "ab" then " ab"). */
static void write_tok_bin(const char *path) {
  static const testpiece_t extra[] = {{" ", -9}, {"a", -9}, {"b", -9}, {"ab", -1}, {" ab", -2}};
  testfile_write_llama2c_tok(path, 8, 1, extra, 5);
}

/* Text through data.tokenizer: the split's tokens are the tokenizer's ids of the file, in
 * order (the validation split their tail), not its bytes; a tokenizer with more ids than the
 * model is a load error naming both sizes. */
static void test_text_through_tokenizer(void **state) {
  const char *txt = "ab ab abab a b ba\nab, \xc3\xa9 ab ab ab ab ab ab ab ab ab ab ab abba";
  testfile_write(path_in("t.txt"), txt, strlen(txt));
  write_tok_bin(path_in("tok.bin"));
  tokenizer_t *tok = NULL;
  char err[512] = "";
  assert_int_equal(tokenizer_load(&tok, path_in("tok.bin"), err, sizeof err), 0);
  int32_t *ids = NULL;
  size_t n = 0;
  assert_int_equal(tokenizer_encode(tok, txt, strlen(txt), &ids, &n, err, sizeof err), 0);
  tokenizer_free(tok);
  assert_true(n > 8 && n < strlen(txt)); /* merged: fewer ids than bytes */

  plan_t p;
  base_plan(&p, 264, 4, 2);
  p.data.val_fraction = 0.3;
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("t.txt"));
  snprintf(p.data.tokenizer, sizeof p.data.tokenizer, "%s", path_in("tok.bin"));
  data_t d;
  int rc = data_load(&d, &p, 1, err, sizeof err);
  if (rc) printf("%s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(d.format, PLAN_DATA_TEXT);
  assert_false(d.is_text);
  assert_int_equal(d.n_train + d.n_val, n);
  size_t differ = 0;
  for (size_t i = 0; i < n; i++)
    differ += (i < d.n_train ? data_train_token(&d, i) : data_val_token(&d, i - d.n_train)) != ids[i];
  printf("text through tokenizer: %zu ids from %zu bytes, %zu differ from tokenizer_encode\n", n, strlen(txt), differ);
  assert_int_equal(differ, 0);
  data_free(&d);
  free(ids);

  base_plan(&p, 263, 4, 2);
  snprintf(p.data.train, sizeof p.data.train, "%s", path_in("t.txt"));
  snprintf(p.data.tokenizer, sizeof p.data.tokenizer, "%s", path_in("tok.bin"));
  assert_int_equal(data_load(&d, &p, 0, err, sizeof err), DATA_EINVAL);
  printf("%s\n", err);
  assert_non_null(strstr(err, "has 264 tokens, more than the model's vocab_size 263"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_text_and_split, setup, teardown),
      cmocka_unit_test_setup_teardown(test_llmc_u16_u32, setup, teardown),
      cmocka_unit_test_setup_teardown(test_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_llmc_u32_header, setup, teardown),
      cmocka_unit_test_setup_teardown(test_format_disagrees, setup, teardown),
      cmocka_unit_test_setup_teardown(test_shards_match_one_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_text_through_tokenizer, setup, teardown),
      cmocka_unit_test(test_batch_rule),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
