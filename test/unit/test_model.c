// deps: trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/net.c common/store.c common/store_proto.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/log.c common/err.c common/env.c test/support/model_cfg.c trainer/backend/fatal.c
/* test_model: the model's contract with the training loop and the dp strategies.
 *
 * Numerics against PyTorch are in test/integration/test_oracle_model.py; here: tensor names,
 * shapes and contiguous units; the dp hook order; bad token/target ids giving NAN; ignored
 * targets; same bits twice; gradient accumulation; redirected unit buffers; activation
 * checkpointing (same bits, smaller arena). Tolerances are
 * stated where results are not bit-exact. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/model/model.h"
#include "test/support/model_cfg.h"

enum { B = 2, T = 9, V = 31 };

static backend_t *be;

static plan_model_t small_cfg(void) { return test_model_cfg(32, 2, 4, 2, V, 96, 16); }

static model_t *make(void) {
  plan_model_t c = small_cfg();
  model_t *m = NULL;
  char err[256];
  int rc = model_create(&m, &c, be, B, T, 0, 0, err, sizeof err);
  if (rc) printf("model_create: %s\n", err);
  assert_int_equal(rc, 0);
  model_init_random(m, 7, 0.1);
  return m;
}

static void batch(int32_t *tok, int32_t *tgt) {
  for (int i = 0; i < B * T; i++) {
    tok[i] = (i * 7 + 3) % V;
    tgt[i] = (i * 5 + 1) % V;
  }
  tgt[4] = -1;
}

static void test_layout(void **state) {
  model_t *m = make();
  int L = 2;
  assert_int_equal(model_num_tensors(m), 9 * L + 3);
  assert_int_equal(model_num_units(m), L + 2);
  const model_tensor_t *t = model_find_tensor(m, "layers.1.attention.wk.weight");
  assert_non_null(t);
  assert_int_equal(t->unit, 2);
  assert_int_equal(t->shape[0], 2 * 8); /* KV * D */
  assert_int_equal(t->shape[1], 32);
  t = model_find_tensor(m, "layers.0.attention.wo.weight");
  assert_int_equal(t->shape[0], 32);
  assert_int_equal(t->shape[1], 32);
  t = model_find_tensor(m, "layers.0.feed_forward.w2.weight");
  assert_int_equal(t->shape[0], 32);
  assert_int_equal(t->shape[1], 96);
  assert_int_equal(model_find_tensor(m, "output.weight")->unit, L + 1);
  assert_int_equal(model_find_tensor(m, "tok_embeddings.weight")->decay, 0);
  assert_int_equal(model_find_tensor(m, "norm.weight")->decay, 0);
  assert_int_equal(model_find_tensor(m, "layers.0.feed_forward.w1.weight")->decay, 1);
  /* units tile [0, num_params) in order, each tensor inside its unit */
  size_t next = 0;
  for (int u = 0; u < model_num_units(m); u++) {
    size_t off, n;
    model_unit_range(m, u, &off, &n);
    assert_int_equal(off, next);
    next = off + n;
  }
  assert_int_equal(next, model_num_params(m));
  for (int i = 0; i < model_num_tensors(m); i++) {
    const model_tensor_t *ti = model_tensor(m, i);
    size_t off, n;
    model_unit_range(m, ti->unit, &off, &n);
    assert_true(ti->offset >= off && ti->offset + ti->numel <= off + n);
  }
  /* norms start at 1 */
  const float *p = model_params(m) + model_find_tensor(m, "layers.1.ffn_norm.weight")->offset;
  assert_true(p[0] == 1.0f && p[31] == 1.0f);
  model_destroy(m);
}

static void test_bad_config(void **state) {
  plan_model_t c = small_cfg();
  c.n_kv_heads = 3;
  model_t *m = NULL;
  char err[256] = "";
  assert_int_not_equal(model_create(&m, &c, be, B, T, 0, 0, err, sizeof err), 0);
  printf("  %s\n", err);
  assert_null(m);
  c = small_cfg();
  assert_int_not_equal(model_create(&m, &c, be, B, 17, 0, 0, err, sizeof err), 0);
  printf("  %s\n", err);
  model_destroy(NULL);
}

/* A forward or backward that must succeed (the loss of the forward). */
static float fwd_ok(model_t *m, const int32_t *tok, const int32_t *tgt, int b, int t) {
  float loss = NAN;
  int rc = model_forward(m, tok, tgt, b, t, &loss);
  if (rc) printf("  unexpected: %s\n", model_errmsg(m));
  assert_int_equal(rc, 0);
  assert_string_equal(model_errmsg(m), "");
  return loss;
}
static void bwd_ok(model_t *m, float loss_scale) {
  int rc = model_backward(m, loss_scale);
  if (rc) printf("  unexpected: %s\n", model_errmsg(m));
  assert_int_equal(rc, 0);
}

static void test_bad_ids(void **state) {
  model_t *m = make();
  int32_t tok[B * T], tgt[B * T];
  batch(tok, tgt);
  tok[11] = V; /* out of range */
  float loss = 0;
  int rc = model_forward(m, tok, tgt, B, T, &loss);
  printf("  token id %d at position 11: status %d, loss %f, \"%s\"\n", V, rc, loss, model_errmsg(m));
  assert_int_equal(rc, MODEL_EINVAL);
  assert_true(isnan(loss));
  assert_non_null(strstr(model_errmsg(m), "token id 31 at position 11"));
  assert_false(model_forward_ok(m));
  /* no backward after a failed forward */
  assert_int_equal(model_backward(m, 1.0f), MODEL_EINVAL);
  assert_non_null(strstr(model_errmsg(m), "needs a successful forward"));
  batch(tok, tgt);
  tgt[3] = -2; /* negative targets are ignored */
  assert_true(isfinite(fwd_ok(m, tok, tgt, B, T)));
  tgt[5] = V + 4;
  assert_int_equal(model_forward(m, tok, tgt, B, T, &loss), MODEL_EINVAL);
  assert_true(isnan(loss));
  assert_non_null(strstr(model_errmsg(m), "target id 35 at position 5"));
  tok[0] = -1;
  assert_int_equal(model_forward(m, tok, NULL, B, T, NULL), MODEL_EINVAL);
  assert_int_equal(model_forward(m, tok, tgt, B + 1, T, &loss), MODEL_EINVAL); /* above capacity */
  assert_non_null(strstr(model_errmsg(m), "capacity"));
  model_destroy(m);
}

static void test_loss_and_determinism(void **state) {
  model_t *m = make();
  int32_t tok[B * T], tgt[B * T];
  batch(tok, tgt);
  size_t np = model_num_params(m);
  float *g1 = malloc(np * sizeof *g1);
  model_zero_grad(m);
  float l1 = fwd_ok(m, tok, tgt, B, T);
  bwd_ok(m, 1.0f);
  memcpy(g1, model_grads(m), np * sizeof *g1);
  printf("  loss %.7f (ln V = %.7f)\n", l1, log((double)V));
  assert_true(fabs(l1 - log((double)V)) < 1.0);
  model_zero_grad(m);
  float l2 = fwd_ok(m, tok, tgt, B, T);
  bwd_ok(m, 1.0f);
  assert_true(memcmp(&l1, &l2, sizeof l1) == 0);
  assert_memory_equal(g1, model_grads(m), np * sizeof *g1);
  printf("  forward+backward twice: same bits\n");

  /* accumulation: two micro-steps with loss_scale 0.5 equal one with 1 (tol 1e-6 relative) */
  model_zero_grad(m);
  for (int k = 0; k < 2; k++) {
    fwd_ok(m, tok, tgt, B, T);
    bwd_ok(m, 0.5f);
  }
  double md = 0, mr = 0;
  for (size_t i = 0; i < np; i++) {
    md = fmax(md, fabs(model_grads(m)[i] - g1[i]));
    mr = fmax(mr, fabs(g1[i]));
  }
  printf("  accumulated 2 x 0.5 vs 1 x 1.0: max rel diff %.3e (tol 1e-6)\n", md / mr);
  assert_true(md / mr < 1e-6);

  /* all targets ignored: loss 0, no gradient */
  int32_t none[B * T];
  for (int i = 0; i < B * T; i++)
    none[i] = -1;
  model_zero_grad(m);
  assert_true(fwd_ok(m, tok, none, B, T) == 0.0f);
  bwd_ok(m, 1.0f);
  double s = be->sumsq(be, model_grads(m), np);
  assert_true(s == 0.0);
  /* a shorter batch than the arena's */
  assert_true(isfinite(fwd_ok(m, tok, tgt, 1, 5)));
  free(g1);
  model_destroy(m);
}

/* A dp that records the hook calls and redirects unit 1 to a private copy in gather. */
typedef struct {
  char log[1024];
  model_t *m;
  float *copy_p, *copy_g;
  int fail_unit; /* > 0: reduce_grads of this unit fails (with -7) */
} rec_t;

static int rec_gather(model_hooks_t *dp, int u, int bwd) {
  rec_t *r = dp->ctx;
  snprintf(r->log + strlen(r->log), sizeof r->log - strlen(r->log), "g%d%s ", u, bwd ? "b" : "");
  if (u == 1) model_set_unit_buffers(r->m, 1, r->copy_p, r->copy_g);
  return 0;
}
static int rec_release(model_hooks_t *dp, int u, int bwd) {
  rec_t *r = dp->ctx;
  snprintf(r->log + strlen(r->log), sizeof r->log - strlen(r->log), "r%d%s ", u, bwd ? "b" : "");
  return 0;
}
static int rec_reduce(model_hooks_t *dp, int u) {
  rec_t *r = dp->ctx;
  snprintf(r->log + strlen(r->log), sizeof r->log - strlen(r->log), "s%d ", u);
  return r->fail_unit > 0 && u == r->fail_unit ? -7 : 0;
}

static void test_dp_hooks(void **state) {
  model_t *m = make();
  int32_t tok[B * T], tgt[B * T];
  batch(tok, tgt);
  size_t np = model_num_params(m), off, n;
  model_zero_grad(m);
  float l0 = fwd_ok(m, tok, tgt, B, T);
  bwd_ok(m, 1.0f);
  float *g0 = malloc(np * sizeof *g0);
  memcpy(g0, model_grads(m), np * sizeof *g0);

  rec_t r = {.m = m};
  model_unit_range(m, 1, &off, &n);
  r.copy_p = malloc(n * sizeof(float));
  r.copy_g = calloc(n, sizeof(float));
  memcpy(r.copy_p, model_params(m) + off, n * sizeof(float));
  model_hooks_t dp = {.name = "record", .ctx = &r, .gather = rec_gather, .release = rec_release, .reduce_grads = rec_reduce};
  model_set_hooks(m, &dp);
  model_zero_grad(m);
  memset(model_params(m) + off, 0, n * sizeof(float)); /* unit 1 now lives only in the copy */
  float l1 = fwd_ok(m, tok, tgt, B, T);
  bwd_ok(m, 1.0f);
  printf("  hooks: %s\n", r.log);
  assert_string_equal(r.log, "g0 r0 g1 r1 g2 r2 g3 r3 g3b s3 r3b g2b s2 r2b g1b s1 r1b g0b s0 r0b ");
  assert_true(l0 == l1);
  assert_memory_equal(r.copy_g, g0 + off, n * sizeof(float)); /* unit 1's grads went to the copy */
  model_set_unit_buffers(m, 1, NULL, NULL);
  assert_true(model_grads(m)[off] == 0.0f);

  /* A failing reduce_grads stops the backward there and is returned: the units below it never
   * run (their gradients stay partial), and the status says so. */
  r.log[0] = '\0';
  r.fail_unit = 2;
  fwd_ok(m, tok, tgt, B, T);
  int rc = model_backward(m, 1.0f);
  printf("  reduce_grads(2) fails: status %d, \"%s\"; hooks: %s\n", rc, model_errmsg(m), r.log);
  assert_int_equal(rc, MODEL_ESTRATEGY);
  assert_non_null(strstr(model_errmsg(m), "reduce_grads of unit 2 failed (-7)"));
  assert_string_equal(r.log, "g0 r0 g1 r1 g2 r2 g3 r3 g3b s3 r3b g2b s2 ");
  model_set_unit_buffers(m, 1, NULL, NULL);
  model_set_hooks(m, NULL);
  free(g0);
  free(r.copy_p);
  free(r.copy_g);
  model_destroy(m);
}

/* model_init_unit_host gives exactly what model_init_random writes; export/import round trip. */
static void test_unit_init_export_import(void **state) {
  model_t *m = make();
  for (int u = 0; u < model_num_units(m); u++) {
    size_t off, n;
    model_unit_range(m, u, &off, &n);
    float *h = malloc(n * sizeof *h);
    model_init_unit_host(m, u, h, 7, 0.1);
    assert_memory_equal(h, model_params(m) + off, n * sizeof *h);
    free(h);
  }
  int i = 3;
  const model_tensor_t *t = model_tensor(m, i);
  assert_int_equal(t->tp_split, MODEL_TP_REPLICATED);
  assert_int_equal(t->full_shape[0], t->shape[0]);
  assert_int_equal(t->full_shape[1], t->shape[1]);
  float *full = malloc(t->numel * sizeof *full);
  assert_int_equal(model_export_tensor(m, i, full), 0);
  assert_memory_equal(full, model_params(m) + t->offset, t->numel * sizeof *full);
  for (size_t j = 0; j < t->numel; j++)
    full[j] = (float)j;
  model_import_tensor(m, i, full);
  assert_true(model_params(m)[t->offset + 5] == 5.0f);
  printf("  unit host init == model_init_random; export/import of %s round trip\n", t->name);
  free(full);
  model_destroy(m);
}

/* FSDP shape: no flat buffers; the units must be provided by gather. */
typedef struct {
  float **p, **g;
  model_t *m;
} fsdp_fake_t;

static int fake_gather(model_hooks_t *dp, int u, int bwd) {
  fsdp_fake_t *f = dp->ctx;
  model_set_unit_buffers(f->m, u, f->p[u], f->g[u]);
  return 0;
}
static int fake_release(model_hooks_t *dp, int u, int bwd) {
  fsdp_fake_t *f = dp->ctx;
  model_set_unit_buffers(f->m, u, NULL, NULL);
  return 0;
}

static void test_no_flat_buffers(void **state) {
  model_t *ref = make();
  int32_t tok[B * T], tgt[B * T];
  batch(tok, tgt);
  model_zero_grad(ref);
  float lref = fwd_ok(ref, tok, tgt, B, T);
  bwd_ok(ref, 1.0f);

  plan_model_t c = small_cfg();
  model_opts_t o = {.max_b = B, .max_t = T, .no_flat_buffers = 1};
  model_t *m = NULL;
  char err[256];
  assert_int_equal(model_create_opts(&m, &c, be, &o, err, sizeof err), 0);
  assert_null(model_params(m));
  assert_null(model_grads(m));
  float l = 0;
  int rc = model_forward(m, tok, tgt, B, T, &l); /* no strategy: units have no buffers */
  printf("  forward without gathered units: status %d, loss %f, \"%s\"\n", rc, l, model_errmsg(m));
  assert_int_equal(rc, MODEL_EINVAL);
  assert_true(isnan(l));
  assert_non_null(strstr(model_errmsg(m), "unit 0 has no parameter buffer"));

  int U = model_num_units(m);
  float *p[8], *g[8];
  for (int u = 0; u < U; u++) {
    size_t off, n;
    model_unit_range(m, u, &off, &n);
    p[u] = malloc(n * sizeof(float));
    g[u] = calloc(n, sizeof(float));
    model_init_unit_host(m, u, p[u], 7, 0.1);
  }
  fsdp_fake_t f = {.p = p, .g = g, .m = m};
  model_hooks_t dp = {.name = "fake-fsdp", .ctx = &f, .gather = fake_gather, .release = fake_release};
  model_set_hooks(m, &dp);
  float l2 = fwd_ok(m, tok, tgt, B, T);
  bwd_ok(m, 1.0f);
  printf("  no_flat_buffers loss %.7f vs flat %.7f\n", l2, lref);
  assert_true(l2 == lref);
  for (int u = 0; u < U; u++) {
    size_t off, n;
    model_unit_range(m, u, &off, &n);
    assert_memory_equal(g[u], model_grads(ref) + off, n * sizeof(float));
    free(p[u]);
    free(g[u]);
  }
  model_destroy(m);
  model_destroy(ref);
}

static int setup(void **state) {
  char err[256];
  be = backend_create("cpu", 2, err, sizeof err);
  return be ? 0 : -1;
}
/* Activation checkpointing: full (every block) and selective (every k-th block) give the
 * loss and every gradient bit for bit as without, over two accumulated micro-steps with an
 * eval forward between (the shared working set is reused across blocks and passes). Tolerance:
 * none, the bits. */
static model_t *make_ckpt(int L, int every) {
  plan_model_t c = test_model_cfg(32, L, 4, 2, V, 96, 16);
  model_opts_t o = {.max_b = B, .max_t = T, .checkpoint_every = every};
  model_t *m = NULL;
  char err[256];
  int rc = model_create_opts(&m, &c, be, &o, err, sizeof err);
  if (rc) printf("model_create_opts: %s\n", err);
  assert_int_equal(rc, 0);
  model_init_random(m, 7, 0.1);
  return m;
}

static void test_activation_checkpoint(void **state) {
  enum { L = 4 };
  int32_t tok[B * T], tgt[B * T];
  batch(tok, tgt);
  model_t *ref = make_ckpt(L, 0);
  size_t np = model_num_params(ref);
  float lr[2];
  model_zero_grad(ref);
  for (int k = 0; k < 2; k++) {
    lr[k] = fwd_ok(ref, tok, tgt, B, T);
    assert_true(fwd_ok(ref, tok, NULL, 1, T) == 0.0f);
    lr[k] = fwd_ok(ref, tok, tgt, B, T);
    bwd_ok(ref, 0.5f);
  }
  static const int every[] = {1, 2, 3, 4};
  for (size_t e = 0; e < sizeof every / sizeof every[0]; e++) {
    model_t *m = make_ckpt(L, every[e]);
    model_zero_grad(m);
    for (int k = 0; k < 2; k++) {
      float l = fwd_ok(m, tok, tgt, B, T);
      assert_true(fwd_ok(m, tok, NULL, 1, T) == 0.0f);
      l = fwd_ok(m, tok, tgt, B, T);
      bwd_ok(m, 0.5f);
      assert_memory_equal(&l, &lr[k], sizeof l);
    }
    size_t ndiff = 0;
    for (size_t i = 0; i < np; i++)
      ndiff += memcmp(&model_grads(m)[i], &model_grads(ref)[i], sizeof(float)) != 0;
    printf("  checkpoint every %d block(s): losses %.9g %.9g, %zu of %zu gradients differ in any bit (tol 0)\n",
           every[e], lr[0], lr[1], ndiff, np);
    assert_int_equal(ndiff, 0);
    model_destroy(m);
  }
  model_destroy(ref);
}

/* The activation arena shrinks as designed where activations dominate (dim 64, 4 layers,
 * seq 128): under full checkpointing the blocks hold L inputs plus one block's working set, so
 * the block part is at most none's / L + L block inputs, i.e. about 1/L of none's (asserted:
 * <= 1/L + 0.1); selective (every 2nd block) lies between. */
static void test_activation_memory(void **state) {
  enum { L = 4, MB = 2, MT = 128, C = 64 };
  plan_model_t c = test_model_cfg(C, L, 4, 2, 256, 192, MT);
  model_memory_t mem[3];
  static const int every[] = {0, 1, 2};
  for (int i = 0; i < 3; i++) {
    model_opts_t o = {.max_b = MB, .max_t = MT, .checkpoint_every = every[i]};
    model_t *m = NULL;
    char err[256];
    assert_int_equal(model_create_opts(&m, &c, be, &o, err, sizeof err), 0);
    model_memory(m, &mem[i]);
    model_destroy(m);
  }
  size_t x_bytes = (size_t)MB * MT * C * sizeof(float);
  double ratio = (double)mem[1].act_block_bytes / (double)mem[0].act_block_bytes;
  printf("  activation bytes (all / blocks): none %zu / %zu, full %zu / %zu, selective(2) %zu / %zu; "
         "full/none blocks %.3f (1/L = %.3f, bound 1/L + 0.1), all %.3f\n",
         mem[0].act_bytes, mem[0].act_block_bytes, mem[1].act_bytes, mem[1].act_block_bytes, mem[2].act_bytes,
         mem[2].act_block_bytes, ratio, 1.0 / L, (double)mem[1].act_bytes / (double)mem[0].act_bytes);
  assert_true(mem[1].act_block_bytes <= mem[0].act_block_bytes / L + L * x_bytes);
  assert_true(ratio <= 1.0 / L + 0.1);
  assert_true(mem[1].act_block_bytes < mem[2].act_block_bytes && mem[2].act_block_bytes < mem[0].act_block_bytes);
  /* what is not in the blocks (final norm, logits, backward scratch) is the same */
  assert_int_equal(mem[0].act_bytes - mem[0].act_block_bytes, mem[1].act_bytes - mem[1].act_block_bytes);
}

static int teardown(void **state) {
  backend_destroy(be);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout),          cmocka_unit_test(test_bad_config),
      cmocka_unit_test(test_bad_ids),         cmocka_unit_test(test_loss_and_determinism),
      cmocka_unit_test(test_dp_hooks),        cmocka_unit_test(test_unit_init_export_import),
      cmocka_unit_test(test_no_flat_buffers), cmocka_unit_test(test_activation_checkpoint),
      cmocka_unit_test(test_activation_memory),
  };
  return cmocka_run_group_tests_name("model", tests, setup, teardown);
}
