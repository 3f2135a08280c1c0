// deps: trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/serial_run.c test/support/files.c
/* test_dp: the data-parallel strategy's contract (trainer/parallel/dp.h), in one process: the
 * serial strategy (dp_create with mesh NULL). The multi-rank strategies (DDP, ZeRO-1/2, FSDP,
 * HSDP) are compared with it end to end by the integration tests; here each operation is
 * checked against the code it must equal:
 * - dp_step is trainer/model/optim's AdamW on the flat buffers, bit for bit, with clipping
 *   active, over three steps (the moments included);
 * - dp_grad_norm is the norm of all gradients computed by hand in double (tolerance 1e-12
 *   relative: the same sums in another order);
 * - dp_zero_grad zeroes every gradient; dp_unit_to_host is the unit's slice of the parameters;
 *   dp_memory counts the flat buffers and both moments;
 * - dp_ckpt_to_host's chunks cover every tensor of each kind (param, adam_m, adam_v) exactly
 *   once with the values in the flat buffers, and a checkpoint written from them and read back
 *   with dp_ckpt_from_host into a differently initialized strategy restores the state bit for
 *   bit. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/files.h"
#include "test/support/serial_run.h"
#include "trainer/formats/ckpt.h"
#include "trainer/model/optim.h"

/* Forward and backward on step's batch (gradients zeroed first). */
static void grads_of(serial_run_t *r, int step) {
  const int B = r->p.train.micro_batch_size, T = r->p.train.seq_len;
  int32_t tok[64], tgt[64];
  serial_run_batch(r, step, tok, tgt);
  dp_zero_grad(r->dp);
  float loss;
  assert_int_equal(model_forward(r->m, tok, tgt, B, T, &loss), 0);
  assert_int_equal(model_backward(r->m, 1.0f), 0);
}

static size_t count_differing(const float *a, const float *b, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; i++) d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return d;
}

static void test_step_is_adamw(void **state) {
  const char *sets[] = {"train.grad_clip=0.05", "train.weight_decay=0.1"};
  serial_run_t r;
  serial_run_open(&r, sets, 2);
  const size_t N = model_num_params(r.m);
  const int nt = model_num_tensors(r.m);
  model_tensor_t *ts = malloc((size_t)nt * sizeof *ts);
  float *ref = malloc(N * sizeof(float)), *hm = malloc(N * sizeof(float)), *hv = malloc(N * sizeof(float));
  assert_true(ts && ref && hm && hv);
  for (int i = 0; i < nt; i++) ts[i] = *model_tensor(r.m, i);
  optim_t o;
  char err[256];
  assert_int_equal(optim_init(&o, r.be, &r.p.train, ts, nt, 0, N, err, sizeof err), 0);
  memcpy(ref, model_params(r.m), N * sizeof(float));
  int clipped = 0;
  for (int s = 1; s <= 3; s++) {
    grads_of(&r, s);
    double norm;
    assert_int_equal(dp_grad_norm(r.dp, &norm), 0);
    const double lr = optim_lr(&r.p.train, dp_optim_step(r.dp)), scale = optim_clip_scale(norm, r.p.train.grad_clip);
    clipped += scale < 1;
    optim_step(&o, ref, model_grads(r.m), NULL, lr, scale);
    assert_int_equal(dp_step(r.dp, lr, scale), 0);
    assert_int_equal(dp_optim_step(r.dp), s);
    /* the strategy's moments are the ones it saves */
    ckpt_chunks_t cs = {0};
    float *host = NULL;
    assert_int_equal(dp_ckpt_to_host(r.dp, &cs, &host, err, sizeof err), 0);
    r.be->to_host(r.be, hm, o.m, N * sizeof(float));
    r.be->to_host(r.be, hv, o.v, N * sizeof(float));
    size_t dp_ = count_differing(model_params(r.m), ref, N), dm = count_differing(host + N, hm, N),
           dv = count_differing(host + 2 * N, hv, N);
    printf("  step %d (lr %.3g, norm %.4f, clip scale %.4f): parameters, m, v differing from optim's AdamW: "
           "%zu, %zu, %zu of %zu (tolerance: none, the bits)\n", s, lr, norm, scale, dp_, dm, dv, N);
    assert_int_equal(dp_ + dm + dv, 0);
    ckpt_chunks_free(&cs);
    free(host);
  }
  assert_int_equal(clipped, 3); /* the scale was exercised */
  optim_free(&o);
  free(ts);
  free(ref);
  free(hm);
  free(hv);
  serial_run_close(&r);
}

static void test_grad_norm_by_hand(void **state) {
  serial_run_t r;
  serial_run_open(&r, NULL, 0);
  grads_of(&r, 1);
  const size_t N = model_num_params(r.m);
  const float *g = model_grads(r.m);
  double ss = 0;
  for (size_t i = 0; i < N; i++) ss += (double)g[i] * (double)g[i];
  double norm = -1;
  assert_int_equal(dp_grad_norm(r.dp, &norm), 0);
  const double rel = fabs(norm - sqrt(ss)) / sqrt(ss);
  printf("  dp_grad_norm %.17g, by hand %.17g: relative difference %.3g (tolerance 1e-12)\n", norm, sqrt(ss), rel);
  assert_true(ss > 0);
  assert_true(rel <= 1e-12);

  dp_zero_grad(r.dp);
  size_t nonzero = 0;
  for (size_t i = 0; i < N; i++) nonzero += g[i] != 0.0f;
  assert_int_equal(nonzero, 0);
  assert_int_equal(dp_grad_norm(r.dp, &norm), 0);
  assert_true(norm == 0.0);
  serial_run_close(&r);
}

static void test_units_and_memory(void **state) {
  serial_run_t r;
  serial_run_open(&r, NULL, 0);
  const size_t N = model_num_params(r.m);
  float *h = malloc(N * sizeof(float));
  assert_non_null(h);
  for (int u = 0; u < model_num_units(r.m); u++) {
    size_t off, n;
    model_unit_range(r.m, u, &off, &n);
    assert_int_equal(dp_unit_open(r.dp, u), 0);
    dp_unit_to_host(r.dp, u, h);
    assert_int_equal(count_differing(h, model_params(r.m) + off, n), 0);
  }
  dp_memory_t mem;
  dp_memory(r.dp, &mem);
  assert_int_equal(mem.param_bytes, N * sizeof(float));
  assert_int_equal(mem.grad_bytes, N * sizeof(float));
  assert_int_equal(mem.optim_bytes, 2 * N * sizeof(float));
  assert_int_equal(mem.work_bytes, 0);
  assert_string_equal(r.dp->name, "serial");
  free(h);
  serial_run_close(&r);
}

/* Every element of every tensor, for each kind, in exactly one chunk, with the value the flat
 * buffer (params) or the moments (the kind's third of host) hold there. */
static void check_coverage(serial_run_t *r, const ckpt_chunks_t *cs, const float *host) {
  static const char *kinds[] = {"param", "adam_m", "adam_v"};
  const size_t N = model_num_params(r->m);
  unsigned char *seen = calloc(3 * N, 1);
  assert_non_null(seen);
  size_t wrong = 0;
  for (int i = 0; i < cs->n; i++) {
    const ckpt_chunk_t *c = &cs->v[i];
    int k = 0;
    while (k < 3 && strcmp(c->kind, kinds[k])) k++;
    assert_true(k < 3);
    const model_tensor_t *t = model_find_tensor(r->m, c->name);
    assert_non_null(t);
    assert_int_equal(c->rows * c->cols, (int64_t)t->numel);
    assert_true(c->r0 == 0 && c->c0 == 0 && c->r1 == c->rows && c->c1 == c->cols); /* serial: whole tensors */
    for (int64_t e = c->a; e < c->b; e++) {
      const size_t at = t->offset + (size_t)e;
      seen[(size_t)k * N + at]++;
      wrong += memcmp(&c->data[e - c->a], &host[(size_t)k * N + at], sizeof(float)) != 0;
    }
  }
  size_t missing = 0, twice = 0;
  for (size_t i = 0; i < 3 * N; i++) {
    missing += seen[i] == 0;
    twice += seen[i] > 1;
  }
  printf("  %d chunks over 3 x %zu values: %zu missing, %zu more than once, %zu with another value\n", cs->n, N,
         missing, twice, wrong);
  assert_int_equal(missing + twice + wrong, 0);
  free(seen);
}

static void test_checkpoint_ranges_round_trip(void **state) {
  char dir[256], err[1024];
  assert_int_equal(testdir_make(dir, sizeof dir, "meshrun-test-dp"), 0);
  serial_run_t a, b;
  serial_run_open(&a, NULL, 0);
  double gnorm;
  serial_run_step(&a, 1, &gnorm);
  serial_run_step(&a, 2, &gnorm); /* moments that are not zero */
  const size_t N = model_num_params(a.m);

  ckpt_chunks_t cs = {0};
  float *host = NULL;
  assert_int_equal(dp_ckpt_to_host(a.dp, &cs, &host, err, sizeof err), 0);
  /* the host copy is parameters, m, v in the flat order: check it against the model's buffer */
  assert_int_equal(count_differing(host, model_params(a.m), N), 0);
  check_coverage(&a, &cs, host);

  ckpt_writer_config_t wc = {.dir = dir, .keep = 1, .mesh = {1, 1, 1}};
  ckpt_shape_from_plan(&wc.shape, &a.p.model);
  ckpt_writer_t *w = NULL;
  ckpt_state_t st = {.step = 2, .optim_step = 2, .data_position = 4};
  int rc = ckpt_writer_create(&w, &wc, err, sizeof err);
  if (rc == 0) rc = ckpt_writer_save(w, &st, cs.v, cs.n, err, sizeof err);
  if (rc) printf("  %s\n", err);
  assert_int_equal(rc, 0);
  ckpt_writer_destroy(w);

  const char *seed[] = {"seed=99"};
  serial_run_open(&b, seed, 1);
  float *hb = NULL;
  ckpt_chunks_t cb = {0};
  assert_int_equal(dp_ckpt_to_host(b.dp, &cb, &hb, err, sizeof err), 0);
  const size_t before = count_differing(host, hb, N);
  ckpt_chunks_free(&cb);
  free(hb);
  ckpt_t *ck = NULL;
  assert_int_equal(ckpt_open(&ck, dir, "auto", &wc.shape, NULL, err, sizeof err), 0);
  rc = dp_ckpt_from_host(b.dp, ck, err, sizeof err);
  if (rc) printf("  %s\n", err);
  assert_int_equal(rc, 0);
  ckpt_close(ck);
  assert_int_equal(dp_ckpt_to_host(b.dp, &cb, &hb, err, sizeof err), 0);
  const size_t after = count_differing(host, hb, 3 * N);
  printf("  loaded into a strategy seeded otherwise: %zu of %zu parameters differed before, %zu of %zu values "
         "after (tolerance: none, the bits)\n", before, N, after, 3 * N);
  assert_true(before > N / 2);
  assert_int_equal(after, 0);
  ckpt_chunks_free(&cb);
  free(hb);

  ckpt_chunks_free(&cs);
  free(host);
  serial_run_close(&b);
  serial_run_close(&a);
  assert_int_equal(testdir_remove(dir), 0);
}

static float loss_of(serial_run_t *r, int step) {
  const int B = r->p.train.micro_batch_size, T = r->p.train.seq_len;
  int32_t tok[64], tgt[64];
  serial_run_batch(r, step, tok, tgt);
  float loss;
  assert_int_equal(model_forward(r->m, tok, tgt, B, T, &loss), 0);
  return loss;
}

/* bf16: dp_step writes the model's compute copy with the masters, and the next forward reads it
 * as it is (a master changed behind the model's back is not seen: the proof that no rounding
 * ran), and it is the copy the forward rounds itself (the same loss after model_masters_changed).
 * Masters written through model_params or model_import_tensor after a step are seen. */
static void test_bf16_copy_from_step(void **state) {
  const char *sa[] = {"parallel.mixed_precision.param_dtype=bf16"};
  const char *sb[] = {"parallel.mixed_precision.param_dtype=bf16", "seed=99"};
  serial_run_t a, b;
  serial_run_open(&a, sa, 1);
  serial_run_open(&b, sb, 2);
  assert_int_equal(model_param_dtype(a.m), DT_BF16);
  assert_non_null(model_compute_copy(a.m));
  const size_t N = model_num_params(a.m);
  float *pa = model_params(a.m), *host = malloc(N * sizeof(float));
  assert_non_null(host);
  double gn;
  serial_run_step(&a, 1, &gn);
  serial_run_step(&a, 2, &gn);
  serial_run_step(&b, 1, &gn);
  const float la = loss_of(&a, 3);
  float *w = pa + model_find_tensor(a.m, "norm.weight")->offset; /* every row reads it */
  const float keep = w[0];
  w[0] += 1.0f; /* behind the model's back: the optimizer's copy stays in use */
  const float behind = loss_of(&a, 3);
  model_masters_changed(a.m);
  const float seen = loss_of(&a, 3);
  w[0] = keep;
  model_masters_changed(a.m);
  const float rounded = loss_of(&a, 3);
  printf("  loss from the step's copy %.9g, rounded by the forward %.9g; a master changed behind the back: "
         "%.9g, then announced: %.9g\n", la, rounded, behind, seen);
  assert_memory_equal(&la, &rounded, sizeof la);
  assert_memory_equal(&la, &behind, sizeof la);
  assert_false(seen == la);

  memcpy(model_params(b.m), model_params(a.m), N * sizeof(float)); /* b's step copy is stale now */
  const float lb = loss_of(&b, 3);
  serial_run_step(&b, 2, &gn);
  for (int i = 0; i < model_num_tensors(a.m); i++) {
    const model_tensor_t *t = model_tensor(a.m, i);
    assert_int_equal(model_export_tensor(a.m, i, host), 0);
    model_import_tensor(b.m, i, host);
    assert_true(t->numel <= N);
  }
  const float lb2 = loss_of(&b, 3);
  printf("  b after a's masters through model_params %.9g, through model_import_tensor %.9g (want %.9g)\n", lb,
         lb2, la);
  assert_memory_equal(&lb, &la, sizeof la);
  assert_memory_equal(&lb2, &la, sizeof la);
  free(host);
  serial_run_close(&b);
  serial_run_close(&a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_step_is_adamw),
      cmocka_unit_test(test_grad_norm_by_hand),
      cmocka_unit_test(test_units_and_memory),
      cmocka_unit_test(test_checkpoint_ranges_round_trip),
      cmocka_unit_test(test_bf16_copy_from_step),
  };
  return cmocka_run_group_tests_name("dp", tests, NULL, NULL);
}
