// deps: trainer/formats/interop.c trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c trainer/formats/safetensors.c common/net.c common/store.c common/store_proto.c common/log.c test/support/files.c common/fs.c common/err.c common/env.c test/support/model_cfg.c trainer/backend/fatal.c
/* test_interop: llama2.c and HF import/export of our model, in C.
 *
 * Round trips (ours -> llama2.c -> ours, ours -> HF -> ours) must be bit-identical; the HF
 * row permutation of wq/wk is checked against its definition on the file's bytes; a shared
 * classifier is written as llama2.c's positive vocab_size and read back into output.weight;
 * the RoPE tables hold cos/sin of t * theta^(-2i/D) (tolerance 1e-6, printed); export from our
 * safetensors weights file equals export from the live model byte for byte; and broken inputs
 * (truncated, oversized, version-1 magic, bad header, config.json without a field, a wrong
 * model_type, a missing or misshapen HF tensor, a plan of other dims) give one-line messages
 * naming the file and the problem. Logits against PyTorch are in test/integration/test_interop.py.
 * Files live in a fresh mkdtemp directory. */
#include <math.h>
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

#include "common/log.h"
#include "trainer/backend/backend.h"
#include "trainer/formats/interop.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
#include "trainer/formats/safetensors.h"
#include "test/support/model_cfg.h"

static char dir[256];
static backend_t *be;

static void path_in(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", dir, name); }

static plan_model_t small_cfg(void) {
  plan_model_t c = test_model_cfg(32, 2, 4, 2, 37, 40, 16);
  c.multiple_of = 256;
  return c;
}

/* A model with random weights (norms around 1; tied: classifier = embedding). */
static model_t *make_model(const plan_model_t *c, uint64_t seed, int tied) {
  char err[256];
  model_t *m = NULL;
  int rc = model_create(&m, c, be, 1, 4, 0, 0, err, sizeof err);
  if (rc) printf("model_create: %s\n", err);
  assert_int_equal(rc, 0);
  model_init_random(m, seed, c->init_std);
  size_t np = model_num_params(m);
  float *p = malloc(np * sizeof *p);
  be->to_host(be, p, model_params(m), np * sizeof *p);
  rng_t r;
  rng_init(&r, seed, 5);
  for (int i = 0; i < model_num_tensors(m); i++) {
    const model_tensor_t *t = model_tensor(m, i);
    if (t->ndim == 1)
      for (size_t j = 0; j < t->numel; j++)
        p[t->offset + j] = (float)(1.0 + 0.3 * rng_normal(&r));
  }
  if (tied) {
    const model_tensor_t *e = model_find_tensor(m, "tok_embeddings.weight"), *o = model_find_tensor(m, "output.weight");
    memcpy(p + o->offset, p + e->offset, e->numel * sizeof *p);
  }
  be->to_device(be, model_params(m), p, np * sizeof *p);
  free(p);
  return m;
}

static float *host_params(model_t *m) {
  size_t np = model_num_params(m);
  float *p = malloc(np * sizeof *p);
  be->to_host(be, p, model_params(m), np * sizeof *p);
  return p;
}

/* Export m in fmt to name, import into a fresh model; every parameter bit must be the same. */
static void round_trip(const plan_model_t *c, model_t *m, interop_format_t fmt, const char *name) {
  char path[512], err[512];
  path_in(path, sizeof path, name);
  int rc = interop_export_model(m, c, fmt, path, err, sizeof err);
  if (rc) printf("export: %s\n", err);
  assert_int_equal(rc, 0);
  interop_file_t *f = NULL;
  rc = interop_open(&f, path, INTEROP_AUTO, err, sizeof err);
  if (rc) printf("open: %s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(interop_file_format(f), fmt);
  const plan_model_t *fc = interop_config(f);
  assert_int_equal(fc->dim, c->dim);
  assert_int_equal(fc->hidden_dim, c->hidden_dim);
  assert_int_equal(fc->n_layers, c->n_layers);
  assert_int_equal(fc->n_heads, c->n_heads);
  assert_int_equal(fc->n_kv_heads, c->n_kv_heads);
  assert_int_equal(fc->vocab_size, c->vocab_size);
  assert_int_equal(fc->max_seq_len, c->max_seq_len);
  assert_true(fc->rope_theta == c->rope_theta && fc->norm_eps == c->norm_eps);
  assert_int_equal(interop_check_plan(f, c, err, sizeof err), 0);
  model_t *m2 = NULL;
  assert_int_equal(model_create(&m2, fc, be, 1, 4, 0, 0, err, sizeof err), 0);
  rc = interop_load_model(f, m2, err, sizeof err);
  if (rc) printf("load: %s\n", err);
  assert_int_equal(rc, 0);
  interop_close(f);
  float *a = host_params(m), *b = host_params(m2);
  size_t np = model_num_params(m), diff = 0;
  for (size_t i = 0; i < np; i++)
    diff += memcmp(&a[i], &b[i], sizeof(float)) != 0;
  printf("%s round trip: %zu of %zu parameters differ (want 0)\n", interop_format_name(fmt), diff, np);
  assert_int_equal(diff, 0);
  free(a);
  free(b);
  model_destroy(m2);
}

static unsigned char *slurp(const char *path, size_t *len) { return testfile_read(path, len); }
static void spit(const char *path, const void *b, size_t len) { testfile_write(path, b, len); }

static void test_llama2c_round_trip(void **state) {
  plan_model_t c = small_cfg();
  model_t *m = make_model(&c, 11, 0);
  round_trip(&c, m, INTEROP_LLAMA2C, "untied.bin");
  /* header: negative vocab (unshared), size with the classifier */
  char path[512];
  path_in(path, sizeof path, "untied.bin");
  size_t len;
  unsigned char *b = slurp(path, &len);
  int32_t h[7];
  memcpy(h, b, sizeof h);
  assert_int_equal(h[0], 32);
  assert_int_equal(h[1], 40);
  assert_int_equal(h[4], 2);
  assert_int_equal(h[5], -37);
  assert_int_equal(h[6], 16);
  const size_t C = 32, L = 2, F = 40, V = 37, KV = 16, D = 8, T = 16;
  size_t floats = V * C + L * (C + C * C + 2 * KV * C + C * C + C + 3 * F * C) + C + T * D + V * C;
  assert_int_equal(len, 28 + 4 * floats);
  /* RoPE tables after rms_final: cos then sin of t * 10000^(-2i/D) */
  const float *rope = (const float *)(b + 28) + V * C + L * (C + C * C + 2 * KV * C + C * C + C + 3 * F * C) + C;
  double worst = 0;
  for (size_t t = 0; t < T; t++)
    for (size_t i = 0; i < D / 2; i++) {
      double ang = (double)t * pow(10000.0, -2.0 * (double)i / (double)D);
      worst = fmax(worst, fabs(rope[t * D / 2 + i] - cos(ang)));
      worst = fmax(worst, fabs(rope[T * D / 2 + t * D / 2 + i] - sin(ang)));
    }
  printf("llama2c RoPE tables: max |diff| %.3e (tol 1e-6)\n", worst);
  assert_true(worst < 1e-6);
  free(b);
  model_destroy(m);
}

static void test_llama2c_shared_classifier(void **state) {
  plan_model_t c = small_cfg();
  model_t *m = make_model(&c, 12, 1);
  round_trip(&c, m, INTEROP_LLAMA2C, "tied.bin");
  char path[512], upath[512], err[512];
  path_in(path, sizeof path, "tied.bin");
  size_t len;
  unsigned char *b = slurp(path, &len);
  int32_t h[7];
  memcpy(h, b, sizeof h);
  assert_int_equal(h[5], 37); /* shared */
  /* the same weights untied are V*C floats longer */
  model_t *u = make_model(&c, 12, 0);
  path_in(upath, sizeof upath, "tied_untied.bin");
  assert_int_equal(interop_export_model(u, &c, INTEROP_LLAMA2C, upath, err, sizeof err), 0);
  size_t ulen;
  free(slurp(upath, &ulen));
  assert_int_equal(ulen, len + 37 * 32 * 4);
  free(b);
  model_destroy(u);
  model_destroy(m);
}

static void test_hf_round_trip_and_permutation(void **state) {
  plan_model_t c = small_cfg();
  c.rope_theta = 500000.0; /* HF carries theta and eps; llama2.c cannot */
  c.norm_eps = 1e-6;
  model_t *m = make_model(&c, 13, 0);
  round_trip(&c, m, INTEROP_HF, "hf");
  /* q_proj / k_proj rows: HF row h*D + i + j*D/2 holds our row h*D + 2i + j */
  char path[512], err[512];
  path_in(path, sizeof path, "hf/model.safetensors");
  st_file_t *st = NULL;
  assert_int_equal(st_open(&st, path, err, sizeof err), 0);
  float *p = host_params(m);
  const int D = 8, C = 32;
  size_t checked = 0;
  const struct {
    const char *ours, *hf;
    int heads;
  } w[] = {{"layers.1.attention.wq.weight", "model.layers.1.self_attn.q_proj.weight", 4},
           {"layers.1.attention.wk.weight", "model.layers.1.self_attn.k_proj.weight", 2}};
  for (int k = 0; k < 2; k++) {
    const model_tensor_t *t = model_find_tensor(m, w[k].ours);
    const st_tensor_t *s = st_find(st, w[k].hf);
    assert_non_null(s);
    const float *hf = s->data;
    for (int h = 0; h < w[k].heads; h++)
      for (int i = 0; i < D / 2; i++)
        for (int j = 0; j < 2; j++) {
          assert_memory_equal(hf + (size_t)(h * D + i + j * D / 2) * C, p + t->offset + (size_t)(h * D + 2 * i + j) * C,
                              C * sizeof(float));
          checked++;
        }
  }
  /* v_proj and the MLP are not permuted; gate = w1, down = w2, up = w3 */
  const char *same[][2] = {{"layers.0.attention.wv.weight", "model.layers.0.self_attn.v_proj.weight"},
                           {"layers.0.feed_forward.w1.weight", "model.layers.0.mlp.gate_proj.weight"},
                           {"layers.0.feed_forward.w2.weight", "model.layers.0.mlp.down_proj.weight"},
                           {"layers.0.feed_forward.w3.weight", "model.layers.0.mlp.up_proj.weight"},
                           {"layers.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"},
                           {"output.weight", "lm_head.weight"}};
  for (size_t k = 0; k < sizeof same / sizeof same[0]; k++) {
    const model_tensor_t *t = model_find_tensor(m, same[k][0]);
    const st_tensor_t *s = st_find(st, same[k][1]);
    assert_non_null(s);
    assert_int_equal(st_numel(s), t->numel);
    assert_memory_equal(s->data, p + t->offset, t->numel * sizeof(float));
  }
  printf("hf permutation: %zu rows checked\n", checked);
  assert_string_equal(st_metadata(st, "format"), "pt");
  st_close(st);
  free(p);
  model_destroy(m);
}

/* `trainer export` path: from our safetensors weights file; same bytes as from the live model. */
static void test_export_from_weights_file(void **state) {
  plan_model_t c = small_cfg();
  model_t *m = make_model(&c, 14, 0);
  float *p = host_params(m);
  const int nt = model_num_tensors(m);
  st_tensor_t *ts = calloc((size_t)nt, sizeof *ts);
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    ts[i] = (st_tensor_t){.name = t->name, .dtype = ST_F32, .ndim = t->ndim, .data = p + t->offset};
    ts[i].shape[0] = t->shape[0];
    ts[i].shape[1] = t->shape[1];
  }
  char w[512], a[512], b[512], err[512];
  path_in(w, sizeof w, "weights.safetensors");
  assert_int_equal(st_write(w, ts, nt, NULL, 0, err, sizeof err), 0);
  for (int k = 0; k < 2; k++) {
    interop_format_t fmt = k ? INTEROP_HF : INTEROP_LLAMA2C;
    path_in(a, sizeof a, k ? "from_weights_hf" : "from_weights.bin");
    path_in(b, sizeof b, k ? "from_model_hf" : "from_model.bin");
    int rc = interop_export_weights(&c, w, fmt, a, err, sizeof err);
    if (rc) printf("export_weights: %s\n", err);
    assert_int_equal(rc, 0);
    assert_int_equal(interop_export_model(m, &c, fmt, b, err, sizeof err), 0);
    const char *files[] = {k ? "/model.safetensors" : "", k ? "/config.json" : NULL};
    for (int j = 0; j < 2 && files[j]; j++) {
      char fa[600], fb[600];
      snprintf(fa, sizeof fa, "%s%s", a, files[j]);
      snprintf(fb, sizeof fb, "%s%s", b, files[j]);
      size_t la, lb;
      unsigned char *x = slurp(fa, &la), *y = slurp(fb, &lb);
      assert_int_equal(la, lb);
      assert_memory_equal(x, y, la);
      free(x);
      free(y);
    }
  }
  /* a weights file of another model: the message names the weights file and the tensor */
  plan_model_t other = c;
  other.n_layers = 3;
  path_in(a, sizeof a, "other.bin");
  assert_int_equal(interop_export_weights(&other, w, INTEROP_LLAMA2C, a, err, sizeof err), INTEROP_EMISMATCH);
  printf("%s\n", err);
  assert_non_null(strstr(err, "interop error: "));
  assert_non_null(strstr(err, "weights.safetensors: no tensor layers.2.attention_norm.weight"));
  assert_int_not_equal(access(a, F_OK), 0);
  free(ts);
  free(p);
  model_destroy(m);
}

/* Opens path and expects code with a message containing want (printed either way). */
static void expect_open_error(const char *path, interop_format_t fmt, int code, const char *want) {
  char err[512] = "";
  interop_file_t *f = NULL;
  int rc = interop_open(&f, path, fmt, err, sizeof err);
  printf("  %s\n", err);
  assert_int_equal(rc, code);
  assert_null(f);
  assert_non_null(strstr(err, "interop error: "));
  assert_null(strchr(err, '\n'));
  assert_non_null(want);
  if (!strstr(err, want)) printf("  (wanted \"%s\")\n", want ? want : "");
  assert_non_null(strstr(err, want));
}

static void test_bad_llama2c_files(void **state) {
  plan_model_t c = small_cfg();
  model_t *m = make_model(&c, 15, 0);
  char good[512], bad[512], err[512];
  path_in(good, sizeof good, "good.bin");
  path_in(bad, sizeof bad, "bad.bin");
  assert_int_equal(interop_export_model(m, &c, INTEROP_LLAMA2C, good, err, sizeof err), 0);
  size_t len;
  unsigned char *b = slurp(good, &len);

  spit(bad, b, len - 4);
  expect_open_error(bad, INTEROP_AUTO, INTEROP_ECORRUPT, "(truncated?)");
  spit(bad, b, 20);
  expect_open_error(bad, INTEROP_AUTO, INTEROP_ECORRUPT, "shorter than the llama2.c header");
  unsigned char *big = calloc(len + 8, 1);
  memcpy(big, b, len);
  spit(bad, big, len + 8);
  expect_open_error(bad, INTEROP_AUTO, INTEROP_ECORRUPT, "not a llama2.c version 0 checkpoint");
  free(big);
  int32_t v1[16] = {0x616b3432, 1};
  spit(bad, v1, sizeof v1);
  expect_open_error(bad, INTEROP_LLAMA2C, INTEROP_ECORRUPT, "version 1 file");
  unsigned char *x = malloc(len);
  const struct {
    int field;
    int32_t value;
    const char *want;
  } cases[] = {{3, 5, "dim 32 is not a multiple of n_heads 5"},
               {4, 3, "n_kv_heads 3 does not divide n_heads 4"},
               {0, 0, "dim 0 is out of range"},
               {2, -1, "n_layers -1 is out of range"},
               {1, 41, "implies"}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    memcpy(x, b, len);
    memcpy(x + 4 * cases[k].field, &cases[k].value, 4);
    spit(bad, x, len);
    expect_open_error(bad, INTEROP_AUTO, INTEROP_ECORRUPT, cases[k].want);
  }
  /* Dimensions in range whose implied size is 2^64 + 36 bytes: in size_t it wraps to the 36
   * bytes of this file, which must not pass for a whole checkpoint. */
  int32_t wrap[9] = {1 << 20, 699047, 1 << 20, 1 << 19, 2, (1 << 20) - 1, 1, 0, 0};
  spit(bad, wrap, sizeof wrap);
  expect_open_error(bad, INTEROP_AUTO, INTEROP_ECORRUPT, "implies");
  path_in(bad, sizeof bad, "missing.bin");
  expect_open_error(bad, INTEROP_AUTO, INTEROP_EIO, "cannot open");
  /* llama2.c cannot hold another theta */
  plan_model_t t = c;
  t.rope_theta = 500000.0;
  assert_int_equal(interop_export_model(m, &t, INTEROP_LLAMA2C, bad, err, sizeof err), INTEROP_EINVAL);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "rope_theta 10000"));
  free(x);
  free(b);
  model_destroy(m);
}

static void write_text(const char *path, const char *text) { spit(path, text, strlen(text)); }

static void test_bad_hf_dirs(void **state) {
  plan_model_t c = small_cfg();
  model_t *m = make_model(&c, 16, 0);
  char hf[512], cfgp[600], stp[600], err[512];
  path_in(hf, sizeof hf, "badhf");
  snprintf(cfgp, sizeof cfgp, "%s/config.json", hf);
  snprintf(stp, sizeof stp, "%s/model.safetensors", hf);
  assert_int_equal(interop_export_model(m, &c, INTEROP_HF, hf, err, sizeof err), 0);
  size_t len;
  char *good = (char *)slurp(cfgp, &len);
  good[len] = 0;

  /* config.json without a required field, with a wrong type, of another model */
  const struct {
    const char *from, *to, *want;
  } edits[] = {{"  \"intermediate_size\": 40,\n", "", "no \"intermediate_size\" (an integer)"},
               {"  \"hidden_size\": 32,\n", "", "no \"hidden_size\""},
               {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": \"2\"", "\"num_hidden_layers\" is not an integer"},
               {"\"model_type\": \"llama\"", "\"model_type\": \"gpt2\"", "model_type is gpt2"},
               {"\"rope_scaling\": null", "\"rope_scaling\": {\"factor\": 8}", "rope_scaling is set"},
               {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3", "no tensor model.layers.2."},
               {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1", "unexpected tensor model.layers.1."},
               {"\"intermediate_size\": 40", "\"intermediate_size\": 48",
                "gate_proj.weight is F32 (40, 32), config.json implies F32 (48, 32)"},
               {"{", "[", "not a JSON object"},
               /* head_dim is compared as the number it is: 8.5 is not 8 (a cast to int said it was),
                * and 1e300 is refused without an out-of-range conversion (found by fuzz_llama2c) */
               {"\"head_dim\": 8", "\"head_dim\": 8.5", "head_dim is not hidden_size / num_attention_heads"},
               {"\"head_dim\": 8", "\"head_dim\": 1e300", "head_dim is not hidden_size / num_attention_heads"}};
  for (size_t k = 0; k < sizeof edits / sizeof edits[0]; k++) {
    char text[4096];
    const char *at = strstr(good, edits[k].from);
    assert_non_null(at);
    snprintf(text, sizeof text, "%.*s%s%s", (int)(at - good), good, edits[k].to, at + strlen(edits[k].from));
    write_text(cfgp, text);
    expect_open_error(hf, INTEROP_AUTO, INTEROP_ECORRUPT, edits[k].want);
  }
  write_text(cfgp, good);
  /* the directory path, its config.json and its model.safetensors all open it */
  interop_file_t *f = NULL;
  assert_int_equal(interop_open(&f, cfgp, INTEROP_AUTO, err, sizeof err), 0);
  interop_close(f);
  assert_int_equal(interop_open(&f, stp, INTEROP_AUTO, err, sizeof err), 0);
  interop_close(f);
  /* no lm_head and no tie_word_embeddings: tied, as HF does */
  st_file_t *st = NULL;
  assert_int_equal(st_open(&st, stp, err, sizeof err), 0);
  int n = st_num_tensors(st), k = 0;
  st_tensor_t *ts = calloc((size_t)n, sizeof *ts);
  float *data = malloc((size_t)1 << 20);
  size_t at = 0;
  for (int i = 0; i < n; i++) {
    const st_tensor_t *t = st_tensor_at(st, i);
    if (!strcmp(t->name, "lm_head.weight")) continue;
    ts[k] = *t;
    ts[k].data = memcpy(data + at, t->data, t->nbytes);
    at += t->nbytes / 4;
    k++;
  }
  char names[64][128];
  for (int i = 0; i < k; i++) { /* names point into st; copy before closing it */
    snprintf(names[i], sizeof names[i], "%s", ts[i].name);
    ts[i].name = names[i];
  }
  st_close(st);
  assert_int_equal(st_write(stp, ts, k, NULL, 0, err, sizeof err), 0);
  assert_int_equal(interop_open(&f, hf, INTEROP_AUTO, err, sizeof err), 0);
  float *out = malloc(37 * 32 * sizeof *out), *emb = malloc(37 * 32 * sizeof *emb);
  assert_int_equal(interop_read_tensor(f, "output.weight", out, 37 * 32, err, sizeof err), 0);
  assert_int_equal(interop_read_tensor(f, "tok_embeddings.weight", emb, 37 * 32, err, sizeof err), 0);
  assert_memory_equal(out, emb, 37 * 32 * sizeof *out);
  assert_int_equal(interop_read_tensor(f, "layers.2.ffn_norm.weight", out, 32, err, sizeof err), INTEROP_EINVAL);
  assert_int_equal(interop_read_tensor(f, "norm.weight", out, 31, err, sizeof err), INTEROP_EMISMATCH);
  interop_close(f);
  /* a missing embedding: named */
  ts[0].name = "model.embed_tokens.weight";
  for (int i = 0; i < k; i++)
    if (!strcmp(ts[i].name, "model.embed_tokens.weight")) ts[i] = ts[--k];
  assert_int_equal(st_write(stp, ts, k, NULL, 0, err, sizeof err), 0);
  expect_open_error(hf, INTEROP_HF, INTEROP_ECORRUPT, "no tensor model.embed_tokens.weight");
  unlink(stp);
  expect_open_error(hf, INTEROP_HF, INTEROP_ECORRUPT, "model.safetensors");
  unlink(cfgp);
  expect_open_error(hf, INTEROP_HF, INTEROP_EIO, "config.json: cannot open");
  free(out);
  free(emb);
  free(data);
  free(ts);
  free(good);
  model_destroy(m);
}

static void test_plan_mismatch(void **state) {
  plan_model_t c = small_cfg();
  model_t *m = make_model(&c, 17, 0);
  char path[512], err[512];
  path_in(path, sizeof path, "plan.bin");
  assert_int_equal(interop_export_model(m, &c, INTEROP_LLAMA2C, path, err, sizeof err), 0);
  interop_file_t *f = NULL;
  assert_int_equal(interop_open(&f, path, INTEROP_AUTO, err, sizeof err), 0);
  plan_model_t p = c;
  p.n_kv_heads = 4;
  assert_int_equal(interop_check_plan(f, &p, err, sizeof err), INTEROP_EMISMATCH);
  printf("  %s\n", err);
  char want[700];
  snprintf(want, sizeof want, "interop error: %s: n_kv_heads 2 but the plan says 4 (set model.n_kv_heads=2)", path);
  assert_string_equal(err, want);
  p = c;
  p.hidden_dim = 64;
  assert_int_equal(interop_check_plan(f, &p, err, sizeof err), INTEROP_EMISMATCH);
  assert_non_null(strstr(err, "hidden_dim 40 but the plan says 64 (set model.hidden_dim=40)"));
  p = c;
  p.norm_eps = 1e-6;
  assert_int_equal(interop_check_plan(f, &p, err, sizeof err), INTEROP_EMISMATCH);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "norm_eps 1e-05 but the plan says 1e-06 (set model.norm_eps=1e-05)"));
  /* a model of other dims refuses the load with the tensor named */
  p = c;
  p.hidden_dim = 48;
  model_t *m2 = NULL;
  assert_int_equal(model_create(&m2, &p, be, 1, 4, 0, 0, err, sizeof err), 0);
  assert_int_equal(interop_load_model(f, m2, err, sizeof err), INTEROP_EMISMATCH);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "layers.0.feed_forward.w1.weight is (40, 32) in the file, (48, 32) in the model"));
  model_destroy(m2);
  interop_close(f);
  /* formats by name and by path */
  interop_format_t fmt;
  assert_int_equal(interop_format_parse("hf", &fmt), 0);
  assert_int_equal(fmt, INTEROP_HF);
  assert_int_equal(interop_format_parse("gguf", &fmt), INTEROP_EINVAL);
  assert_int_equal(interop_detect(path), INTEROP_LLAMA2C);
  assert_int_equal(interop_detect(dir), INTEROP_HF);
  assert_int_equal(interop_detect("out/final.safetensors"), INTEROP_MESHRUN);
  assert_int_equal(interop_open(&f, "out/final.safetensors", INTEROP_AUTO, err, sizeof err), INTEROP_EINVAL);
  model_destroy(m);
}

static int setup(void **state) {
  log_init("[test_interop]");
  char err[256];
  be = backend_create("cpu", 1, err, sizeof err);
  if (!be) return -1;
  return testdir_make(dir, sizeof dir, "test_interop");
}
static int teardown(void **state) {
  backend_destroy(be);
  return testdir_remove(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_llama2c_round_trip),
      cmocka_unit_test(test_llama2c_shared_classifier),
      cmocka_unit_test(test_hf_round_trip_and_permutation),
      cmocka_unit_test(test_export_from_weights_file),
      cmocka_unit_test(test_bad_llama2c_files),
      cmocka_unit_test(test_bad_hf_dirs),
      cmocka_unit_test(test_plan_mismatch),
  };
  return cmocka_run_group_tests_name("interop", tests, setup, teardown);
}
