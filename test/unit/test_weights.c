// deps: trainer/run/weights.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/serial_run.c test/support/files.c
/* test_weights: our weights files (trainer/run/weights.c), in one process with the serial
 * strategy and a tiny model:
 * - weights_save then weights_open: format "meshrun", the plan's model and data sections from
 *   the metadata, every tensor read back bit for bit (weights_read), and the same values loaded
 *   into a model seeded otherwise by weights_load_file and, as model.init, by weights_init;
 * - weights_read refuses a tensor that is not there, another size, and a NaN, naming the tensor
 *   and the element;
 * - weights_resolve_model: a plan file whose model differs is refused with the key, both values
 *   and the --set that fixes it; without a plan file the file's model is taken, a --set model
 *   key that disagrees is refused the same way, and model.max_seq_len is the plan's.
 * Tolerance: none, the bits. */
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
#include "trainer/run/weights.h"

static char dir[256], path[320];

/* A trained step's weights saved to path (step 7 in the metadata). */
static void save(serial_run_t *r) {
  double gnorm;
  serial_run_step(r, 1, &gnorm);
  char *json = plan_to_json(&r->p), err[512];
  int rc = weights_save(r->m, r->dp, NULL, 0, path, json, 7, err, sizeof err);
  if (rc) printf("  weights_save: %s\n", err);
  assert_int_equal(rc, 0);
  free(json);
}

static weights_file_t *open_ok(void) {
  weights_file_t *f = NULL;
  char err[512];
  int rc = weights_open(&f, path, err, sizeof err);
  if (rc) printf("  weights_open: %s\n", err);
  assert_int_equal(rc, 0);
  return f;
}

/* Values of b that differ from a's, for every tensor: a's flat buffer against b's. */
static size_t differing(serial_run_t *a, serial_run_t *b) {
  const size_t N = model_num_params(a->m);
  size_t d = 0;
  for (size_t i = 0; i < N; i++) d += memcmp(&model_params(a->m)[i], &model_params(b->m)[i], sizeof(float)) != 0;
  return d;
}

static void test_save_open_read(void **state) {
  serial_run_t r;
  serial_run_open(&r, NULL, 0);
  save(&r);
  weights_file_t *f = open_ok();
  assert_string_equal(weights_format_name(f), "meshrun");
  const plan_model_t *fm = weights_model(f);
  assert_non_null(fm);
  assert_true(fm->dim == 16 && fm->n_layers == 2 && fm->n_heads == 4 && fm->n_kv_heads == 2 && fm->vocab_size == 32 &&
              fm->hidden_dim == 48 && fm->max_seq_len == 16);
  assert_non_null(weights_data(f));
  assert_int_equal(weights_data(f)->format, PLAN_DATA_SYNTHETIC);
  size_t differ = 0, total = 0;
  char err[512];
  for (int i = 0; i < model_num_tensors(r.m); i++) {
    const model_tensor_t *t = model_tensor(r.m, i);
    float *buf = malloc(t->numel * sizeof(float));
    assert_non_null(buf);
    int rc = weights_read(f, t->name, buf, t->numel, err, sizeof err);
    if (rc) printf("  %s\n", err);
    assert_int_equal(rc, 0);
    for (size_t k = 0; k < t->numel; k++) differ += memcmp(&buf[k], &model_params(r.m)[t->offset + k], 4) != 0;
    total += t->numel;
    free(buf);
  }
  printf("  read back %d tensors, %zu values: %zu differ (tolerance: none, the bits)\n", model_num_tensors(r.m),
         total, differ);
  assert_int_equal(total, model_num_params(r.m));
  assert_int_equal(differ, 0);

  const char *seed[] = {"seed=99"};
  serial_run_t b;
  serial_run_open(&b, seed, 1);
  assert_true(differing(&r, &b) > 0);
  assert_int_equal(weights_load_file(b.m, f, err, sizeof err), 0);
  printf("  weights_load_file: %zu values differ\n", differing(&r, &b));
  assert_int_equal(differing(&r, &b), 0);
  serial_run_close(&b);
  weights_close(f);

  char init[400];
  snprintf(init, sizeof init, "model.init=%s", path);
  const char *sets[] = {"seed=99", init};
  serial_run_open(&b, sets, 2);
  int rc = weights_init(b.m, b.dp, &b.p, err, sizeof err);
  if (rc) printf("  weights_init: %s\n", err);
  assert_int_equal(rc, 0);
  printf("  weights_init from model.init: %zu values differ\n", differing(&r, &b));
  assert_int_equal(differing(&r, &b), 0);
  serial_run_close(&b);
  serial_run_close(&r);
}

static void test_read_refusals(void **state) {
  serial_run_t r;
  serial_run_open(&r, NULL, 0);
  const model_tensor_t *t = model_find_tensor(r.m, "norm.weight");
  assert_non_null(t);
  model_params(r.m)[t->offset + 5] = NAN;
  char *json = plan_to_json(&r.p), err[512];
  assert_int_equal(weights_save(r.m, r.dp, NULL, 0, path, json, 0, err, sizeof err), 0);
  free(json);
  weights_file_t *f = open_ok();
  float buf[64];
  assert_int_equal(weights_read(f, "norm.weight", buf, t->numel, err, sizeof err), 2);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "tensor norm.weight element 5 is nan"));
  assert_int_equal(weights_read(f, "layers.9.ffn_norm.weight", buf, 16, err, sizeof err), 2);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "no tensor layers.9.ffn_norm.weight"));
  assert_int_equal(weights_read(f, "layers.0.ffn_norm.weight", buf, 17, err, sizeof err), 2);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "has 16 F32 elements, the model wants 17"));
  weights_close(f);
  serial_run_close(&r);
}

static void test_resolve_model(void **state) {
  serial_run_t r;
  serial_run_open(&r, NULL, 0);
  save(&r);
  weights_file_t *f = open_ok();
  plan_model_t plan = r.p.model, out;
  char err[512] = "";
  assert_int_equal(weights_resolve_model(f, &plan, 1, NULL, 0, &out, err, sizeof err), 0);
  assert_int_equal(out.dim, 16);

  plan.dim = 32; /* a plan file with another width */
  assert_int_equal(weights_resolve_model(f, &plan, 1, NULL, 0, &out, err, sizeof err), 2);
  printf("  %s\n", err);
  assert_non_null(strstr(err, path));
  assert_non_null(strstr(err, "dim 16 but the plan says 32 (set model.dim=16)"));

  /* no plan file: the file's model; a --set that disagrees is named, one that is not a model
   * key or agrees passes, max_seq_len comes from the plan */
  plan = r.p.model;
  plan.n_kv_heads = 4;
  plan.max_seq_len = 12;
  const char *bad[] = {"train.steps=3", "model.n_kv_heads=4"};
  assert_int_equal(weights_resolve_model(f, &plan, 0, bad, 2, &out, err, sizeof err), 2);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "n_kv_heads 2 but the plan says 4 (set model.n_kv_heads=2)"));
  const char *ok[] = {"model.max_seq_len=12", "train.steps=3"};
  assert_int_equal(weights_resolve_model(f, &plan, 0, ok, 2, &out, err, sizeof err), 0);
  assert_int_equal(out.n_kv_heads, 2); /* the file's, not the plan's default */
  assert_int_equal(out.max_seq_len, 12);
  assert_int_equal(weights_resolve_model(f, &plan, 0, NULL, 0, &out, err, sizeof err), 0);
  assert_int_equal(out.max_seq_len, 16);
  weights_close(f);
  serial_run_close(&r);
}

static int setup(void **state) {
  if (testdir_make(dir, sizeof dir, "meshrun-test-weights")) return -1;
  snprintf(path, sizeof path, "%s/out/final.safetensors", dir); /* its folder is made */
  return 0;
}
static int teardown(void **state) { return testdir_remove(dir); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_save_open_read, setup, teardown),
      cmocka_unit_test_setup_teardown(test_read_refusals, setup, teardown),
      cmocka_unit_test_setup_teardown(test_resolve_model, setup, teardown),
  };
  return cmocka_run_group_tests_name("weights", tests, NULL, NULL);
}
