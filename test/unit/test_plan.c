// deps: trainer/plan/plan.c trainer/plan/pipeline.c common/fs.c common/err.c trainer/backend/attention_registry.c
/* test_plan: the plan module: defaults, one-line errors naming the key path, --set overrides,
 * plan_resolve (mesh, shapes, batches), Llama's hidden-size rule, the plan_to_json round trip,
 * and every shipped config under configs/ (run from the repository root, as `make unit` does).
 * It does not start a trainer; the files are read, never trained on. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <cJSON.h>

#include "trainer/plan/plan.h"

static char tmp_path[64];

/* Writes text to a fresh temporary file; returns its path (valid until the next call). */
static const char *write_tmp(const char *text) {
  if (tmp_path[0]) unlink(tmp_path);
  snprintf(tmp_path, sizeof tmp_path, "/tmp/test_plan_XXXXXX");
  int fd = mkstemp(tmp_path);
  assert_true(fd >= 0);
  size_t n = strlen(text);
  assert_int_equal(write(fd, text, n), (ssize_t)n);
  close(fd);
  return tmp_path;
}

/* Loads json (with sets), and resolves at world when world > 0; expects an error whose one line
 * starts with "plan error: <key>: ". Returns the message for further checks. */
static char err_buf[2048];
/* The device values the trainer of a build with both backends gives the plan. */
static const char *const devices[] = {"auto", "cpu", "cuda", NULL};

static const char *expect_error_sets(const char *json, const char *const *sets, int nsets, int world,
                                     const char *key) {
  plan_t p;
  char want[256];
  err_buf[0] = '\0';
  int rc = plan_load(&p, write_tmp(json), sets, nsets, err_buf, sizeof err_buf);
  if (rc == 0 && world > 0) rc = plan_resolve(&p, world, err_buf, sizeof err_buf);
  printf("  %-34s -> %s\n", key, err_buf);
  assert_int_equal(rc, PLAN_EINVAL);
  snprintf(want, sizeof want, "plan error: %s: ", key);
  if (strncmp(err_buf, want, strlen(want)) != 0) fail_msg("expected prefix '%s', got '%s'", want, err_buf);
  assert_null(strchr(err_buf, '\n'));
  assert_true(strlen(err_buf) > strlen(want)); /* says what is wrong */
  return err_buf;
}
static const char *expect_error(const char *json, int world, const char *key) {
  return expect_error_sets(json, NULL, 0, world, key);
}

static void load_ok(plan_t *p, const char *json, const char *const *sets, int nsets) {
  char err[1024] = "";
  int rc = plan_load(p, json ? write_tmp(json) : NULL, sets, nsets, err, sizeof err);
  if (rc != 0) fail_msg("plan_load: %s", err);
}

static void resolve_ok(plan_t *p, int world) {
  char err[1024] = "";
  int rc = plan_resolve(p, world, err, sizeof err);
  if (rc != 0) fail_msg("plan_resolve(%d): %s", world, err);
}

/* ---- defaults --------------------------------------------------------------------------- */

static void test_defaults(void **state) {
  (void)state;
  plan_t p;
  load_ok(&p, "{}", NULL, 0);
  assert_string_equal(p.device, "auto");
  assert_int_equal(p.seed, 1337);
  assert_int_equal(p.model.dim, 128);
  assert_int_equal(p.model.n_kv_heads, p.model.n_heads); /* absent: MHA */
  assert_int_equal(p.model.multiple_of, 256);
  assert_true(p.model.ffn_dim_multiplier == 0);
  assert_int_equal(p.model.hidden_dim, 0);
  assert_true(p.model.rope_theta == 10000);
  assert_true(p.model.norm_eps == 1e-5);
  assert_true(p.model.init_std == 0.02);
  assert_string_equal(p.model.init, "");
  assert_int_equal(p.mesh.dp_replicate, 1);
  assert_int_equal(p.mesh.dp_shard, -1);
  assert_int_equal(p.mesh.tp, 1);
  assert_int_equal(p.parallel.zero, 0);
  assert_int_equal(p.parallel.reshard_after_forward, 1);
  assert_int_equal(p.parallel.sequence_parallel, -1);
  assert_int_equal(p.parallel.loss_parallel, -1);
  assert_int_equal(p.parallel.n_tp_plan, 12);
  assert_string_equal(p.parallel.tp_plan[0].module, "tok_embeddings");
  assert_int_equal(p.parallel.tp_plan[0].style, PLAN_TP_ROWWISE);
  for (int i = 0; i < p.parallel.n_tp_plan; i++) {
    const plan_tp_entry_t *e = &p.parallel.tp_plan[i];
    if (!strcmp(e->module, "attention.wo") || !strcmp(e->module, "feed_forward.w2"))
      assert_int_equal(e->style, PLAN_TP_ROWWISE);
    if (!strcmp(e->module, "attention.wq") || !strcmp(e->module, "feed_forward.w3") ||
        !strcmp(e->module, "output"))
      assert_int_equal(e->style, PLAN_TP_COLWISE);
    if (!strcmp(e->module, "norm") || !strcmp(e->module, "ffn_norm"))
      assert_int_equal(e->style, PLAN_TP_SEQUENCE_PARALLEL);
  }
  assert_int_equal(p.parallel.param_dtype, DT_BF16);
  assert_int_equal(p.parallel.param_dtype_explicit, 0); /* defaulted: main may train fp32 instead */
  assert_int_equal(p.parallel.reduce_dtype, DT_F32);
  assert_int_equal(p.parallel.allow_tf32, 1);
  assert_int_equal(p.parallel.activation_checkpoint, PLAN_AC_NONE);
  assert_int_equal(p.parallel.activation_checkpoint_every, 2);
  assert_int_equal(plan_checkpoint_every(&p), 0);
  assert_true(p.parallel.comm_timeout_s == 300);
  assert_int_equal(p.parallel.comm_flight_records, 2048);
  assert_int_equal(p.train.steps, 1000);
  assert_int_equal(p.train.global_batch_size, 0);
  assert_true(p.train.min_lr == p.train.lr / 10);
  assert_int_equal(p.train.decay, PLAN_SCHED_COSINE);
  assert_true(p.train.weight_decay == 0.1);
  assert_true(p.train.beta1 == 0.9 && p.train.beta2 == 0.95 && p.train.eps == 1e-8);
  assert_true(p.train.grad_clip == 1.0);
  assert_int_equal(p.data.format, PLAN_DATA_AUTO);
  assert_true(p.data.val_fraction == 0.1);
  assert_int_equal(p.eval.interval, 100); /* steps/10 */
  assert_int_equal(p.eval.batches, 8);
  assert_string_equal(p.checkpoint.resume, "none");
  assert_int_equal(p.checkpoint.keep, 3);
  assert_int_equal(p.log.interval, 1);
  assert_int_equal(p.sample.sample_tokens, 200);
  assert_true(p.sample.temperature == 0.8);
  assert_string_equal(p.sample.prompt, "\n");

  /* Defaults that follow other keys. */
  load_ok(&p, "{\"device\":\"cpu\",\"train\":{\"steps\":7,\"lr\":0.5},\"model\":{\"n_heads\":8}}", NULL, 0);
  assert_int_equal(p.parallel.param_dtype, DT_F32);
  assert_int_equal(p.eval.interval, 1);
  assert_true(p.train.min_lr == 0.05);
  assert_int_equal(p.model.n_kv_heads, 8);

  /* null means "the default". */
  load_ok(&p, "{\"model\":{\"dim\":null},\"eval\":null}", NULL, 0);
  assert_int_equal(p.model.dim, 128);
}

static void test_embedded_default_is_demo_json(void **state) {
  (void)state;
  plan_t a, b;
  char err[1024];
  assert_int_equal(plan_load(&a, NULL, NULL, 0, err, sizeof err), 0);
  assert_string_equal(a.source, "(embedded default)");
  assert_int_equal(plan_load(&b, "configs/demo.json", NULL, 0, err, sizeof err), 0);
  /* The file names its data from its own folder (../data/...), the embedded default from the
   * working directory (the repository here): the same file, made absolute at load. */
  char *real = realpath("data/tinyshakespeare.txt", NULL);
  assert_non_null(real);
  assert_string_equal(b.data.train, real);
  assert_string_equal(a.data.train, real);
  free(real);
  char *ja = plan_to_json(&a), *jb = plan_to_json(&b);
  assert_non_null(ja);
  assert_non_null(jb);
  assert_string_equal(ja, jb);
  free(ja);
  free(jb);
  /* The demo: byte-level model on tinyshakespeare. */
  assert_int_equal(a.model.vocab_size, 256);
  assert_int_equal(plan_resolve(&a, 1, err, sizeof err), 0);
  assert_int_equal(a.model.hidden_dim, 352);
}

/* ---- errors from the file --------------------------------------------------------------- */

static void test_file_errors(void **state) {
  (void)state;
  plan_t p;
  char err[1024];
  assert_int_equal(plan_load(&p, "configs/does-not-exist.json", NULL, 0, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_true(strncmp(err, "plan error: configs/does-not-exist.json: ", 41) == 0);
  assert_non_null(strstr(err, "cannot open"));

  const char *path = write_tmp("{\n  \"seed\": 1,\n  \"model\": { \"dim\": 64,, }\n}\n");
  char want[128];
  snprintf(want, sizeof want, "plan error: %s: invalid JSON at line 3", path);
  assert_int_equal(plan_load(&p, path, NULL, 0, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_true(strncmp(err, want, strlen(want)) == 0);

  path = write_tmp("[1, 2]");
  assert_int_equal(plan_load(&p, path, NULL, 0, err, sizeof err), PLAN_EINVAL);
  assert_non_null(strstr(err, "must be a JSON object"));
  path = write_tmp("");
  assert_int_equal(plan_load(&p, path, NULL, 0, err, sizeof err), PLAN_EINVAL);
  assert_non_null(strstr(err, "invalid JSON at line 1"));
}

/* A plan is a regular file of at most 16 MiB: a device, a FIFO (without waiting for a writer),
 * a directory and a bigger file are one-line errors before anything is read; 16 MiB loads. */
static void test_file_kind_and_size(void **state) {
  (void)state;
  plan_t p;
  char err[1024], dir[64], path[128];
  snprintf(dir, sizeof dir, "/tmp/test_plan_dir_XXXXXX");
  assert_non_null(mkdtemp(dir));
  assert_int_equal(plan_load(&p, "/dev/zero", NULL, 0, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_string_equal(err, "plan error: /dev/zero: not a regular file (a plan is a JSON file)");
  assert_int_equal(plan_load(&p, dir, NULL, 0, err, sizeof err), PLAN_EINVAL);
  assert_non_null(strstr(err, "not a regular file"));
  snprintf(path, sizeof path, "%s/fifo.json", dir);
  assert_int_equal(mkfifo(path, 0600), 0);
  assert_int_equal(plan_load(&p, path, NULL, 0, err, sizeof err), PLAN_EINVAL);
  assert_non_null(strstr(err, "not a regular file"));
  unlink(path);
  /* "{}" padded with spaces to exactly PLAN_FILE_MAX bytes loads; one byte more does not. */
  snprintf(path, sizeof path, "%s/big.json", dir);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs("{}", f);
  for (long i = 2; i < PLAN_FILE_MAX; i++) fputc(' ', f);
  fclose(f);
  assert_int_equal(plan_load(&p, path, NULL, 0, err, sizeof err), 0);
  f = fopen(path, "a");
  fputc(' ', f);
  fclose(f);
  assert_int_equal(plan_load(&p, path, NULL, 0, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "16777217 bytes; a plan file is at most 16 MiB"));
  unlink(path);
  rmdir(dir);
}

/* checkpoint.dir: created when absent (parents too), refused when it is a file, lies under a
 * file, or cannot be written (a read-only mount: see test_trainer.py, which may mount). */
static void test_check_paths(void **state) {
  (void)state;
  plan_t p;
  char err[1024], dir[64], sub[256], file[128];
  snprintf(dir, sizeof dir, "/tmp/test_plan_dir_XXXXXX");
  assert_non_null(mkdtemp(dir));
  load_ok(&p, "{}", NULL, 0);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), 0); /* no checkpoint.dir */
  snprintf(sub, sizeof sub, "%s/a/b/ck", dir);
  snprintf(p.checkpoint.dir, sizeof p.checkpoint.dir, "%s", sub);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), 0);
  struct stat sb;
  assert_int_equal(stat(sub, &sb), 0);
  assert_true(S_ISDIR(sb.st_mode));
  DIR *d = opendir(sub);
  int entries = 0;
  for (struct dirent *e; (e = readdir(d));) entries += e->d_name[0] != '.' || strstr(e->d_name, "write-check") != NULL;
  closedir(d);
  assert_int_equal(entries, 0); /* the probe file is gone */
  snprintf(file, sizeof file, "%s/file", dir);
  FILE *f = fopen(file, "w");
  fclose(f);
  snprintf(p.checkpoint.dir, sizeof p.checkpoint.dir, "%s", file);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_true(strncmp(err, "plan error: checkpoint.dir: ", 28) == 0);
  assert_non_null(strstr(err, "exists and is not a directory"));
  snprintf(p.checkpoint.dir, sizeof p.checkpoint.dir, "%s/ck", file);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "plan error: checkpoint.dir: cannot create "));
  assert_non_null(strstr(err, "Not a directory"));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

static void test_key_errors(void **state) {
  (void)state;
  /* Unknown keys, at every level, and duplicates. */
  const char *m = expect_error("{\"model\":{\"dimm\":64}}", 0, "model.dimm");
  assert_non_null(strstr(m, "unknown key"));
  assert_non_null(strstr(m, "n_kv_heads")); /* says what is allowed */
  expect_error("{\"modle\":{}}", 0, "modle");
  expect_error("{\"parallel\":{\"mixed_precision\":{\"param\":\"bf16\"}}}", 0,
               "parallel.mixed_precision.param");
  expect_error("{\"seed\":1,\"seed\":2}", 0, "seed");
  /* The first problem in document order is the one reported. */
  expect_error("{\"train\":{\"steps\":0},\"model\":{\"dim\":0}}", 0, "train.steps");

  /* Wrong types. */
  expect_error("{\"model\":{\"dim\":\"64\"}}", 0, "model.dim");
  expect_error("{\"model\":{\"n_layers\":2.5}}", 0, "model.n_layers");
  expect_error("{\"model\":3}", 0, "model");
  expect_error("{\"parallel\":{\"reshard_after_forward\":1}}", 0, "parallel.reshard_after_forward");
  expect_error("{\"data\":{\"train\":7}}", 0, "data.train");
  expect_error("{\"train\":{\"lr\":\"fast\"}}", 0, "train.lr");
  expect_error("{\"train\":{\"skip_loss_z\":-1}}", 0, "train.skip_loss_z");
  expect_error("{\"train\":{\"skip_grad_z\":-0.5}}", 0, "train.skip_grad_z");
  expect_error("{\"train\":{\"skip_nonfinite\":1}}", 0, "train.skip_nonfinite");
  /* the skip is decided on the device; a pipeline's step runs on the host */
  expect_error("{\"mesh\":{\"pp\":2,\"dp_shard\":1},\"train\":{\"skip_grad_z\":4}}", 2, "train.skip_grad_z");
  expect_error("{\"parallel\":{\"tp_plan\":[]}}", 0, "parallel.tp_plan");

  /* Out of range. */
  expect_error("{\"model\":{\"dim\":0}}", 0, "model.dim");
  expect_error("{\"model\":{\"n_heads\":-4}}", 0, "model.n_heads");
  expect_error("{\"model\":{\"dim\":1e12}}", 0, "model.dim");
  expect_error("{\"model\":{\"norm_eps\":0}}", 0, "model.norm_eps");
  expect_error("{\"train\":{\"lr\":0}}", 0, "train.lr");
  expect_error("{\"train\":{\"beta1\":1.0}}", 0, "train.beta1");
  expect_error("{\"parallel\":{\"comm_timeout_s\":0}}", 0, "parallel.comm_timeout_s");
  expect_error("{\"parallel\":{\"comm_timeout_s\":1e6}}", 0, "parallel.comm_timeout_s");
  expect_error("{\"parallel\":{\"comm_flight_records\":-1}}", 0, "parallel.comm_flight_records");
  expect_error("{\"parallel\":{\"comm_flight_records\":1048577}}", 0, "parallel.comm_flight_records");
  expect_error("{\"train\":{\"beta2\":0}}", 0, "train.beta2");
  expect_error("{\"train\":{\"weight_decay\":-0.1}}", 0, "train.weight_decay");
  expect_error("{\"train\":{\"warmup_steps\":-1}}", 0, "train.warmup_steps");
  expect_error("{\"seed\":-1}", 0, "seed");
  expect_error("{\"seed\":9007199254740994}", 0, "seed");
  expect_error("{\"mesh\":{\"tp\":0}}", 0, "mesh.tp");
  expect_error("{\"mesh\":{\"dp_shard\":-2}}", 0, "mesh.dp_shard");
  expect_error("{\"parallel\":{\"zero\":3}}", 0, "parallel.zero");
  /* activation checkpointing: torchtitan's "op" selective mode is not built (one-line error) */
  m = expect_error("{\"parallel\":{\"activation_checkpoint\":\"op\"}}", 0, "parallel.activation_checkpoint");
  assert_non_null(strstr(m, "none, full, selective"));
  expect_error("{\"parallel\":{\"activation_checkpoint\":true}}", 0, "parallel.activation_checkpoint");
  expect_error("{\"parallel\":{\"activation_checkpoint_every\":0}}", 0, "parallel.activation_checkpoint_every");
  expect_error("{\"data\":{\"val_fraction\":1}}", 0, "data.val_fraction");
  expect_error("{\"log\":{\"interval\":0}}", 0, "log.interval");

  /* Enumerations. The device's values are the program's (plan_set_devices: the trainer's
   * backends; main sets these); without a list any string is a device. */
  m = expect_error("{\"device\":\"gpu\"}", 0, "device");
  assert_non_null(strstr(m, "must be one of auto, cpu, cuda, got \"gpu\""));
  m = expect_error("{\"device\":1}", 0, "device");
  assert_non_null(strstr(m, "must be one of auto, cpu, cuda, got 1"));
  plan_set_devices(NULL);
  plan_t any;
  load_ok(&any, "{\"device\":\"gpu\"}", NULL, 0);
  assert_string_equal(any.device, "gpu");
  expect_error("{\"device\":1}", 0, "device");
  plan_set_devices(devices);
  expect_error("{\"train\":{\"decay\":\"step\"}}", 0, "train.decay");
  expect_error("{\"data\":{\"format\":\"bin\"}}", 0, "data.format");
  expect_error("{\"parallel\":{\"mixed_precision\":{\"param_dtype\":\"fp16\"}}}", 0,
               "parallel.mixed_precision.param_dtype");
  expect_error("{\"parallel\":{\"tp_plan\":{\"attention.wq\":\"rowwise\"}}}", 0,
               "parallel.tp_plan.attention.wq");
  expect_error("{\"parallel\":{\"tp_plan\":{\"attention.wz\":\"colwise\"}}}", 0,
               "parallel.tp_plan.attention.wz");

  /* Strings that do not fit. */
  static char big[PLAN_PATHS_MAX + 64];
  memset(big, 0, sizeof big);
  strcpy(big, "{\"data\":{\"train\":\"/");
  memset(big + strlen(big), 'a', PLAN_PATHS_MAX);
  strcat(big, "\"}}");
  expect_error(big, 0, "data.train");
  memset(big, 0, sizeof big);
  strcpy(big, "{\"model\":{\"init\":\"/");
  memset(big + strlen(big), 'a', PLAN_PATH_MAX);
  strcat(big, "\"}}");
  expect_error(big, 0, "model.init");
  /* data.train as a list: strings only, none empty, not an empty list */
  expect_error("{\"data\":{\"train\":[]}}", 0, "data.train");
  expect_error("{\"data\":{\"train\":[\"/a.bin\", 3]}}", 0, "data.train");
  expect_error("{\"data\":{\"train\":[\"/a.bin\", \"\"]}}", 0, "data.train");
  expect_error("{\"data\":{\"train\":[\"/a\\nb.bin\"]}}", 0, "data.train");

  /* A valid value at the edge of its range is accepted. */
  plan_t p;
  load_ok(&p, "{\"seed\":9007199254740992,\"train\":{\"weight_decay\":0,\"grad_clip\":0}}", NULL, 0);
  assert_true(p.seed == 9007199254740992ull);
}

/* ---- --set ------------------------------------------------------------------------------ */

static void test_set_overrides(void **state) {
  (void)state;
  plan_t p;
  const char *sets[] = {"model.dim=64", "data.train=foo.txt", "train.lr=1e-3", "device=cpu",
                        "seed=42", "parallel.mixed_precision.reduce_dtype=bf16",
                        "parallel.tp_plan.attention.wq=replicate", "sample.prompt=To be",
                        "checkpoint.async=true", "model.dim=96", "parallel.comm_timeout_s=2.5"};
  load_ok(&p, NULL, sets, 11);
  assert_int_equal(p.model.dim, 96); /* the later --set wins */
  assert_string_equal(p.data.train + strlen(p.data.train) - strlen("/foo.txt"), "/foo.txt");
  assert_true(p.data.train[0] == '/'); /* from the working directory, made absolute */
  assert_true(p.train.lr == 1e-3);
  assert_true(p.train.min_lr == 3e-4); /* given in demo.json, not derived */
  assert_string_equal(p.device, "cpu");
  assert_int_equal(p.seed, 42);
  assert_int_equal(p.parallel.reduce_dtype, DT_BF16);
  assert_int_equal(p.parallel.param_dtype, DT_F32); /* follows device=cpu */
  assert_int_equal(p.checkpoint.async, 1);
  assert_true(p.parallel.comm_timeout_s == 2.5);
  assert_string_equal(p.sample.prompt, "To be");
  int found = 0;
  for (int i = 0; i < p.parallel.n_tp_plan; i++)
    if (!strcmp(p.parallel.tp_plan[i].module, "attention.wq")) {
      found = 1;
      assert_int_equal(p.parallel.tp_plan[i].style, PLAN_TP_REPLICATE);
    }
  assert_true(found);
  assert_int_equal(p.parallel.n_tp_plan, 12); /* merged, not appended */

  /* Sections created by --set, JSON objects as values, null back to the default. */
  const char *sets2[] = {"parallel.mixed_precision.param_dtype=fp32", "mesh={\"tp\":2,\"dp_shard\":2}",
                         "train.min_lr=null", "eval.interval=0"};
  load_ok(&p, "{}", sets2, 4);
  assert_int_equal(p.parallel.param_dtype, DT_F32);
  assert_int_equal(p.parallel.param_dtype_explicit, 1);
  assert_int_equal(p.mesh.tp, 2);
  assert_int_equal(p.mesh.dp_shard, 2);
  assert_int_equal(p.mesh.dp_replicate, 1);
  assert_true(p.train.min_lr == p.train.lr / 10);
  assert_int_equal(p.eval.interval, 0);

  /* param_dtype given in the file counts as explicit too, bf16 included; allow_tf32 turns off. */
  load_ok(&p, "{\"device\":\"cuda\",\"parallel\":{\"mixed_precision\":{\"param_dtype\":\"bf16\","
              "\"allow_tf32\":false}}}", NULL, 0);
  assert_int_equal(p.parallel.param_dtype, DT_BF16);
  assert_int_equal(p.parallel.param_dtype_explicit, 1);
  assert_int_equal(p.parallel.allow_tf32, 0);
  const char *sets3[] = {"parallel.mixed_precision.allow_tf32=false"};
  load_ok(&p, "{\"device\":\"cuda\"}", sets3, 1);
  assert_int_equal(p.parallel.param_dtype_explicit, 0);
  assert_int_equal(p.parallel.allow_tf32, 0);
  expect_error("{\"parallel\":{\"mixed_precision\":{\"allow_tf32\":\"yes\"}}}", 0,
               "parallel.mixed_precision.allow_tf32");

  /* A value that is not JSON is a string; a string where a number belongs is a type error. */
  const char *s1[] = {"model.dim=abc"};
  expect_error_sets("{}", s1, 1, 0, "model.dim");
  const char *s2[] = {"model.dimm=64"};
  expect_error_sets("{}", s2, 1, 0, "model.dimm");
  const char *s3[] = {"modle.dim=64"};
  expect_error_sets("{}", s3, 1, 0, "modle");
  const char *s4[] = {"model.dim"};
  expect_error_sets("{}", s4, 1, 0, "--set");
  const char *s5[] = {"=3"};
  expect_error_sets("{}", s5, 1, 0, "--set");
  const char *s6[] = {"seed.low=3"};
  expect_error_sets("{}", s6, 1, 0, "seed");
  const char *s7[] = {"model..dim=3"};
  expect_error_sets("{}", s7, 1, 0, "--set");
  const char *s8[] = {"parallel.tp_plan.attention.wx=colwise"};
  expect_error_sets("{}", s8, 1, 0, "parallel.tp_plan.attention.wx");
  const char *s9[] = {"model.n_layers=2.5"};
  expect_error_sets("{}", s9, 1, 0, "model.n_layers");
}

/* ---- resolve ---------------------------------------------------------------------------- */

#define BASE "\"data\":{\"train\":\"x.txt\"}"

static void test_resolve(void **state) {
  (void)state;
  plan_t p;
  /* -1 takes the rest of the world; batches and TP defaults follow the mesh. */
  load_ok(&p, "{" BASE ",\"mesh\":{\"dp_replicate\":1,\"dp_shard\":-1,\"tp\":2},"
              "\"model\":{\"dim\":128,\"n_heads\":4,\"n_kv_heads\":2,\"multiple_of\":32,\"max_seq_len\":64},"
              "\"train\":{\"micro_batch_size\":4,\"seq_len\":64}}", NULL, 0);
  resolve_ok(&p, 8);
  assert_int_equal(p.mesh.dp_shard, 4);
  assert_int_equal(p.train.global_batch_size, 16);
  assert_int_equal(p.train.grad_accum_steps, 1);
  assert_int_equal(p.parallel.sequence_parallel, 1);
  assert_int_equal(p.parallel.loss_parallel, 1);
  assert_int_equal(p.model.hidden_dim, 352);
  resolve_ok(&p, 8); /* idempotent */
  assert_int_equal(p.mesh.dp_shard, 4);

  load_ok(&p, "{" BASE ",\"mesh\":{\"dp_replicate\":-1,\"dp_shard\":2},"
              "\"train\":{\"micro_batch_size\":2,\"global_batch_size\":48}}", NULL, 0);
  resolve_ok(&p, 6);
  assert_int_equal(p.mesh.dp_replicate, 3);
  assert_int_equal(p.train.grad_accum_steps, 4); /* 48 / (2 * 6) */
  assert_int_equal(p.parallel.sequence_parallel, 0); /* tp 1 */
  assert_int_equal(p.parallel.loss_parallel, 0);

  /* Explicit hidden_dim is kept; output replicated means no loss parallel by default. */
  load_ok(&p, "{" BASE ",\"model\":{\"hidden_dim\":100},\"mesh\":{\"dp_shard\":1,\"tp\":2},"
              "\"parallel\":{\"tp_plan\":{\"output\":\"replicate\"}}}", NULL, 0);
  resolve_ok(&p, 2);
  assert_int_equal(p.model.hidden_dim, 100);
  assert_int_equal(p.parallel.loss_parallel, 0);
  assert_int_equal(p.parallel.sequence_parallel, 1);

  /* Synthetic data needs no file. */
  load_ok(&p, "{\"data\":{\"format\":\"synthetic\"}}", NULL, 0);
  resolve_ok(&p, 1);
}

static void test_resolve_errors(void **state) {
  (void)state;
  const char *m = expect_error("{" BASE ",\"mesh\":{\"dp_replicate\":1,\"dp_shard\":2,\"tp\":2}}", 8, "mesh");
  assert_string_equal(m, "plan error: mesh: dp_replicate*dp_shard*tp = 4 does not equal WORLD_SIZE 8");
  expect_error("{" BASE ",\"mesh\":{\"dp_replicate\":-1,\"dp_shard\":-1,\"tp\":1}}", 8, "mesh");
  expect_error("{" BASE ",\"mesh\":{\"dp_replicate\":1,\"dp_shard\":-1,\"tp\":3}}", 8, "mesh");
  expect_error("{" BASE ",\"mesh\":{\"dp_replicate\":16,\"dp_shard\":-1,\"tp\":1}}", 8, "mesh");
  /* Products that overflow 64 bits (found by fuzz_plan): refused, not undefined behaviour. */
  m = expect_error("{" BASE ",\"mesh\":{\"dp_replicate\":2147483647,\"dp_shard\":2147483647,\"tp\":2147483647}}", 8,
                   "mesh");
  assert_string_equal(m, "plan error: mesh: dp_replicate*dp_shard*tp = 2147483647*2147483647*2147483647 is more "
                         "than WORLD_SIZE 8");
  expect_error("{" BASE ",\"mesh\":{\"dp_replicate\":2147483647,\"dp_shard\":-1,\"tp\":2147483647}}", 8, "mesh");
  expect_error("{" BASE ",\"model\":{\"dim\":100,\"n_heads\":3,\"n_kv_heads\":1}}", 1, "model.dim");
  expect_error("{" BASE ",\"model\":{\"n_heads\":4,\"n_kv_heads\":3}}", 1, "model.n_kv_heads");
  expect_error("{" BASE ",\"model\":{\"dim\":12,\"n_heads\":4}}", 1, "model.dim"); /* head dim 3 */
  m = expect_error("{" BASE ",\"model\":{\"max_seq_len\":128},\"train\":{\"seq_len\":256}}", 1, "train.seq_len");
  assert_non_null(strstr(m, "128"));
  expect_error("{" BASE ",\"model\":{\"n_heads\":4,\"n_kv_heads\":1},\"mesh\":{\"dp_shard\":1,\"tp\":2}}", 2,
               "mesh.tp");
  expect_error("{" BASE ",\"model\":{\"dim\":192,\"n_heads\":6},\"mesh\":{\"dp_shard\":1,\"tp\":4}}", 4, "mesh.tp");
  {
    /* A vocabulary tp does not divide is fine: the model pads it to a multiple of tp. */
    plan_t odd;
    load_ok(&odd, "{" BASE ",\"model\":{\"vocab_size\":255},\"mesh\":{\"dp_shard\":1,\"tp\":2}}", NULL, 0);
    resolve_ok(&odd, 2);
    assert_int_equal(odd.model.vocab_size, 255);
  }
  m = expect_error("{" BASE ",\"train\":{\"micro_batch_size\":4,\"global_batch_size\":24}}", 4,
                   "train.global_batch_size");
  assert_non_null(strstr(m, "24"));
  assert_non_null(strstr(m, "micro_batch_size 4"));
  assert_non_null(strstr(m, "dp 4"));
  assert_non_null(strstr(m, "= 16"));
  expect_error("{" BASE ",\"train\":{\"lr\":1e-3,\"min_lr\":1e-2}}", 1, "train.min_lr");
  expect_error("{}", 1, "data.train");
  expect_error("{" BASE ",\"checkpoint\":{\"resume\":\"auto\"}}", 1, "checkpoint.resume");
  expect_error("{" BASE ",\"parallel\":{\"tp_plan\":{\"attention.wo\":\"replicate\"}}}", 1,
               "parallel.tp_plan.attention.wo");
  expect_error("{" BASE ",\"parallel\":{\"tp_plan\":{\"feed_forward.w1\":\"replicate\"}}}", 1,
               "parallel.tp_plan.feed_forward.w3");
  expect_error("{" BASE ",\"mesh\":{\"dp_shard\":1,\"tp\":2},\"parallel\":{\"loss_parallel\":true,"
               "\"tp_plan\":{\"output\":\"replicate\"}}}", 2, "parallel.loss_parallel");
  expect_error("{" BASE ",\"mesh\":{\"dp_shard\":1,\"tp\":2},\"parallel\":{\"sequence_parallel\":true,"
               "\"tp_plan\":{\"norm\":\"replicate\"}}}", 2, "parallel.tp_plan.norm");
  expect_error("{" BASE ",\"mesh\":{\"dp_shard\":1,\"tp\":2},\"train\":{\"seq_len\":127}}", 2, "train.seq_len");
  m = expect_error("{" BASE ",\"model\":{\"n_layers\":4},\"parallel\":{\"activation_checkpoint\":\"selective\","
                   "\"activation_checkpoint_every\":5}}", 1, "parallel.activation_checkpoint_every");
  assert_non_null(strstr(m, "n_layers 4"));
  {
    /* full: period 1; selective: the given period (it is ignored under none and full) */
    plan_t ac;
    const char *sets[] = {"parallel.activation_checkpoint=full", "parallel.activation_checkpoint_every=9"};
    load_ok(&ac, "{" BASE ",\"model\":{\"n_layers\":4}}", sets, 2);
    resolve_ok(&ac, 1);
    assert_int_equal(plan_checkpoint_every(&ac), 1);
    const char *sel[] = {"parallel.activation_checkpoint=selective", "parallel.activation_checkpoint_every=3"};
    load_ok(&ac, "{" BASE ",\"model\":{\"n_layers\":4}}", sel, 2);
    resolve_ok(&ac, 1);
    assert_int_equal(ac.parallel.activation_checkpoint, PLAN_AC_SELECTIVE);
    assert_int_equal(plan_checkpoint_every(&ac), 3);
  }
}

/* ---- hidden size ------------------------------------------------------------------------ */

static void test_hidden_dim(void **state) {
  (void)state;
  assert_int_equal(plan_llama_hidden_dim(4096, 1024, 1.3), 14336); /* Llama-3-8B */
  assert_int_equal(plan_llama_hidden_dim(2048, 256, 1.5), 8192);   /* Llama-3.2-1B */
  assert_int_equal(plan_llama_hidden_dim(4096, 256, 0), 11008);    /* Llama-2-7B */
  /* A multiplier too big for any int saturates instead of an undefined cast (fuzz_plan). */
  assert_int_equal(plan_llama_hidden_dim(4096, 256, 1e300), INT_MAX);
  assert_int_equal(plan_llama_hidden_dim(8192, 4096, 1.3), 28672); /* Llama-3-70B */
  assert_int_equal(plan_llama_hidden_dim(5120, 256, 0), 13824);    /* Llama-2-13B */
  assert_int_equal(plan_llama_hidden_dim(3072, 256, 1.0), 8192);   /* Llama-3.2-3B */
}

/* ---- round trip ------------------------------------------------------------------------- */

static void round_trip(const char *path, const char *const *sets, int nsets, int world) {
  plan_t a, b;
  char err[1024];
  if (plan_load(&a, path, sets, nsets, err, sizeof err)) fail_msg("%s", err);
  if (world > 0 && plan_resolve(&a, world, err, sizeof err)) fail_msg("%s", err);
  char *ja = plan_to_json(&a);
  assert_non_null(ja);
  load_ok(&b, ja, NULL, 0);
  if (world > 0) resolve_ok(&b, world);
  char *jb = plan_to_json(&b);
  assert_string_equal(ja, jb);
  memcpy(b.source, a.source, sizeof b.source);
  b.rebased = a.rebased; /* read from the JSON: absolute already */
  /* The serialized plan states every key, so param_dtype reads back as given explicitly. */
  assert_int_equal(b.parallel.param_dtype_explicit, 1);
  b.parallel.param_dtype_explicit = a.parallel.param_dtype_explicit;
  assert_memory_equal(&a, &b, sizeof a);
  free(ja);
  free(jb);
}

static void test_round_trip(void **state) {
  (void)state;
  const char *sets[] = {"seed=9007199254740991", "train.lr=0.0003", "train.beta2=0.999",
                        "model.norm_eps=1e-6", "model.ffn_dim_multiplier=1.3", "data.val_fraction=0.05",
                        "sample.prompt=\"quotes\" and \\ and\ttab", "parallel.tp_plan.attention=prepare_module_input",
                        "checkpoint.resume=auto", "checkpoint.dir=ckpt"};
  round_trip(NULL, NULL, 0, 0);
  round_trip(NULL, NULL, 0, 1);
  round_trip(NULL, sets, 10, 1);
  round_trip("configs/2d.json", NULL, 0, 4);
  round_trip("configs/llama-8b.json", NULL, 0, 16);

  /* The JSON has every key, including the resolved ones. */
  plan_t p;
  load_ok(&p, NULL, NULL, 0);
  resolve_ok(&p, 1);
  char *j = plan_to_json(&p);
  const char *keys[] = {"\"hidden_dim\":352", "\"global_batch_size\":16", "\"dp_shard\":1",
                        "\"sequence_parallel\":false", "\"tp_plan\"", "\"mixed_precision\"",
                        "\"min_lr\":0.0003", "\"seed\":1337", "\"prompt\":\"\\n\"",
                        "\"rope_theta\":10000,"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
    if (!strstr(j, keys[i])) fail_msg("missing %s in\n%s", keys[i], j);
  /* One line: JSONL records and metadata values embed it as is. */
  assert_null(strchr(j, '\n'));
  free(j);
}

/* ---- paths ------------------------------------------------------------------------------ */

static void write_file_at(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* A plan's input paths are taken from its folder and made absolute; --set ones, absolute ones
 * and output paths are left as given; every input is checked by plan_check_paths. */
static void test_paths_from_plan_folder(void **state) {
  (void)state;
  char root[] = "/tmp/test_plan_paths_XXXXXX";
  assert_non_null(mkdtemp(root));
  char *real = realpath(root, NULL);
  assert_non_null(real);
  char path[512], want[1024], cmd[600];
  snprintf(path, sizeof path, "%s/plans", root);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/shards", root);
  assert_int_equal(mkdir(path, 0755), 0);
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/shards/tok_train_%06d.bin", root, i);
    write_file_at(path, "x");
  }
  snprintf(path, sizeof path, "%s/plans/tok.json", root);
  write_file_at(path, "{}");
  snprintf(path, sizeof path, "%s/plans/p.json", root);
  write_file_at(path, "{\"model\": {\"init\": \"../w.bin\"},"
                      " \"data\": {\"train\": [\"../shards/tok_train_*.bin\", \"./../shards/tok_train_000000.bin\"],"
                      " \"val\": \"/abs/val.bin\", \"tokenizer\": \"tok.json\"},"
                      " \"checkpoint\": {\"dir\": \"ck\"}, \"log\": {\"metrics_file\": \"m.jsonl\"}}");
  plan_t p;
  char err[2048] = "";
  if (plan_load(&p, path, NULL, 0, err, sizeof err)) fail_msg("%s", err);
  snprintf(want, sizeof want, "%s/w.bin", real);
  assert_string_equal(p.model.init, want);
  snprintf(want, sizeof want, "%s/shards/tok_train_*.bin\n%s/shards/tok_train_000000.bin", real, real);
  assert_string_equal(p.data.train, want);
  assert_string_equal(p.data.val, "/abs/val.bin");
  snprintf(want, sizeof want, "%s/plans/tok.json", real);
  assert_string_equal(p.data.tokenizer, want);
  assert_string_equal(p.checkpoint.dir, "ck");        /* what a run writes: the working directory's */
  assert_string_equal(p.log.metrics_file, "m.jsonl");
  printf("  data.train -> %s\n", p.data.train);

  /* The list survives plan_to_json and a reload from anywhere (absolute now). */
  char *j = plan_to_json(&p);
  assert_non_null(j);
  assert_non_null(strstr(j, "\"train\":[\""));
  plan_t q;
  load_ok(&q, j, NULL, 0);
  assert_string_equal(q.data.train, p.data.train);
  free(j);

  /* --set values are taken from the working directory. */
  const char *sets[] = {"data.train=rel/x.bin", "model.init=/w2.bin"};
  if (plan_load(&p, path, sets, 2, err, sizeof err)) fail_msg("%s", err);
  char *cwd = getcwd(NULL, 0);
  snprintf(want, sizeof want, "%s/rel/x.bin", cwd);
  free(cwd);
  assert_string_equal(p.data.train, want);
  assert_string_equal(p.model.init, "/w2.bin");

  /* plan_check_paths: model.init is missing, with the folder named. */
  if (plan_load(&p, path, NULL, 0, err, sizeof err)) fail_msg("%s", err);
  snprintf(p.data.val, sizeof p.data.val, "%s", "");
  snprintf(p.checkpoint.dir, sizeof p.checkpoint.dir, "%s/ck", root);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  snprintf(want, sizeof want, "plan error: model.init: %s/w.bin: No such file or directory", real);
  assert_true(strncmp(err, want, strlen(want)) == 0);
  assert_non_null(strstr(err, "taken from the plan's folder"));
  /* present now: the shards, expanded, and the tokenizer are checked and pass */
  snprintf(want, sizeof want, "%s/w.bin", root);
  write_file_at(want, "w");
  if (plan_check_paths(&p, err, sizeof err)) fail_msg("%s", err);
  /* a glob that matches nothing */
  snprintf(p.data.train, sizeof p.data.train, "%s/shards/nope_*.bin", real);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "plan error: data.train: no file matches"));
  /* a folder as a shard */
  snprintf(p.data.train, sizeof p.data.train, "%s/shards", real);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "is not a regular file"));
  /* a missing tokenizer */
  snprintf(p.data.train, sizeof p.data.train, "%s/shards/tok_train_000001.bin", real);
  snprintf(p.data.tokenizer, sizeof p.data.tokenizer, "%s/plans/nope.json", real);
  assert_int_equal(plan_check_paths(&p, err, sizeof err), PLAN_EINVAL);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "plan error: data.tokenizer:"));
  /* synthetic data names no files */
  p.data.format = PLAN_DATA_SYNTHETIC;
  snprintf(p.data.tokenizer, sizeof p.data.tokenizer, "%s", "");
  snprintf(p.data.train, sizeof p.data.train, "%s", "/nope/at/all");
  if (plan_check_paths(&p, err, sizeof err)) fail_msg("%s", err);

  free(real);
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);
  assert_int_equal(system(cmd), 0);
}

/* ---- shipped configs -------------------------------------------------------------------- */

static const struct {
  const char *file;
  int world;
  int dp_replicate, dp_shard, tp;
} config_worlds[] = {
    {"demo.json", 1, 1, 1, 1},
    {"demo.json", 2, 1, 2, 1},
    {"tiny.json", 1, 1, 1, 1},
    {"ddp.json", 4, 4, 1, 1},
    {"ddp.json", 8, 8, 1, 1},
    {"fsdp.json", 4, 1, 4, 1},
    {"fsdp.json", 8, 1, 8, 1},
    {"hsdp.json", 4, 2, 2, 1},
    {"hsdp.json", 8, 2, 4, 1},
    {"tp.json", 4, 1, 1, 4},
    {"2d.json", 4, 1, 2, 2},
    {"2d.json", 8, 1, 4, 2},
    {"llama-1b.json", 8, 1, 8, 1},
    {"llama-1b-fsdp-tp.json", 8, 1, 4, 2},
    {"llama-8b.json", 8, 1, 1, 8},
    {"llama-8b.json", 16, 1, 2, 8},
};
#define N_CONFIG_WORLDS ((int)(sizeof config_worlds / sizeof config_worlds[0]))

static void test_configs(void **state) {
  (void)state;
  for (int i = 0; i < N_CONFIG_WORLDS; i++) {
    char path[256], err[1024];
    plan_t p;
    snprintf(path, sizeof path, "configs/%s", config_worlds[i].file);
    if (plan_load(&p, path, NULL, 0, err, sizeof err)) fail_msg("%s", err);
    if (plan_resolve(&p, config_worlds[i].world, err, sizeof err)) fail_msg("%s at world %d: %s", path, config_worlds[i].world, err);
    printf("  %-24s world %2d: mesh %d x %d x %d, hidden %d, accum %d\n", config_worlds[i].file,
           config_worlds[i].world, p.mesh.dp_replicate, p.mesh.dp_shard, p.mesh.tp, p.model.hidden_dim,
           p.train.grad_accum_steps);
    assert_int_equal(p.mesh.dp_replicate, config_worlds[i].dp_replicate);
    assert_int_equal(p.mesh.dp_shard, config_worlds[i].dp_shard);
    assert_int_equal(p.mesh.tp, config_worlds[i].tp);
  }
  /* The realistic sizes have the real shapes. */
  plan_t p;
  char err[1024];
  assert_int_equal(plan_load(&p, "configs/llama-8b.json", NULL, 0, err, sizeof err), 0);
  assert_int_equal(plan_resolve(&p, 16, err, sizeof err), 0);
  assert_int_equal(p.model.hidden_dim, 14336);
  assert_int_equal(p.parallel.sequence_parallel, 1);
  assert_int_equal(p.parallel.loss_parallel, 1);
  assert_int_equal(plan_load(&p, "configs/llama-1b.json", NULL, 0, err, sizeof err), 0);
  assert_int_equal(plan_resolve(&p, 8, err, sizeof err), 0);
  assert_int_equal(p.model.hidden_dim, 8192);
  assert_true(p.model.rope_theta == 500000);
  /* tiny has grouped-query heads. */
  assert_int_equal(plan_load(&p, "configs/tiny.json", NULL, 0, err, sizeof err), 0);
  assert_true(p.model.n_kv_heads < p.model.n_heads);

  /* Every file in configs/ is covered above, or resolves at some world size. */
  DIR *d = opendir("configs");
  assert_non_null(d);
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if (len < 5 || strcmp(e->d_name + len - 5, ".json") != 0) continue;
    n++;
    int covered = 0;
    for (int i = 0; i < N_CONFIG_WORLDS; i++)
      if (!strcmp(config_worlds[i].file, e->d_name)) covered = 1;
    if (covered) continue;
    char path[512];
    snprintf(path, sizeof path, "configs/%s", e->d_name);
    int ok = 0;
    for (int w = 1; w <= 16 && !ok; w *= 2) {
      if (plan_load(&p, path, NULL, 0, err, sizeof err)) fail_msg("%s", err);
      ok = plan_resolve(&p, w, err, sizeof err) == 0;
    }
    if (!ok) fail_msg("%s resolves at no world size in 1..16: %s", path, err);
  }
  closedir(d);
  assert_true(n >= 10);
}


/* ---- docs/plan.md ----------------------------------------------------------------------- */

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) fail_msg("cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Every key of the serialized plan is documented as `key.path`. */
static void check_documented(const cJSON *obj, const char *prefix, const char *doc) {
  for (const cJSON *c = obj->child; c; c = c->next) {
    char path[256], quoted[260];
    snprintf(path, sizeof path, "%s%s%s", prefix, prefix[0] ? "." : "", c->string);
    if (!strcmp(prefix, "parallel.tp_plan")) continue; /* modules: their own table */
    if (cJSON_IsObject(c) && strcmp(path, "parallel.tp_plan") != 0) {
      check_documented(c, path, doc);
      continue;
    }
    snprintf(quoted, sizeof quoted, "`%s`", path);
    if (!strstr(doc, quoted)) fail_msg("docs/plan.md does not document %s", quoted);
  }
}

static void test_docs(void **state) {
  (void)state;
  char *doc = slurp("docs/plan.md");
  plan_t p;
  load_ok(&p, NULL, NULL, 0);
  char *j = plan_to_json(&p);
  cJSON *root = cJSON_Parse(j);
  assert_non_null(root);
  check_documented(root, "", doc);
  cJSON_Delete(root);
  free(j);

  /* The full example loads and resolves at world 8. */
  const char *start = strstr(doc, "```json\n");
  assert_non_null(start);
  start += 8;
  const char *end = strstr(start, "```");
  assert_non_null(end);
  char *example = strndup(start, (size_t)(end - start));
  load_ok(&p, example, NULL, 0);
  resolve_ok(&p, 8);
  assert_int_equal(p.mesh.dp_shard, 4);
  assert_int_equal(p.model.hidden_dim, 8192);
  free(example);
  free(doc);
}

int main(void) {
  plan_set_devices(devices);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_embedded_default_is_demo_json),
      cmocka_unit_test(test_file_errors),
      cmocka_unit_test(test_file_kind_and_size),
      cmocka_unit_test(test_check_paths),
      cmocka_unit_test(test_key_errors),
      cmocka_unit_test(test_set_overrides),
      cmocka_unit_test(test_resolve),
      cmocka_unit_test(test_resolve_errors),
      cmocka_unit_test(test_hidden_dim),
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_paths_from_plan_folder),
      cmocka_unit_test(test_configs),
      cmocka_unit_test(test_docs),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  if (tmp_path[0]) unlink(tmp_path);
  return rc;
}
