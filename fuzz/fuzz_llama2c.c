// deps: trainer/formats/interop.c trainer/model/model.c trainer/model/ring_attention.c trainer/comm/trace.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c trainer/formats/safetensors.c common/net.c common/store.c common/store_proto.c common/log.c common/fs.c fuzz/support.c common/err.c common/env.c trainer/backend/fatal.c
// max_len: 16384
/* fuzz_llama2c: interop's readers: llama2.c checkpoints and Hugging Face directories.
 *
 * Input: a llama2.c file's bytes; or, when it starts with '{', an HF directory: config.json's
 * text, a NUL, then model.safetensors' bytes (no NUL: the directory has no model.safetensors).
 * The llama2.c file goes to interop_open as a memfd path; the HF files are written into a
 * scratch directory. A file that opens must agree with its own config (interop_check_plan)
 * and hand out every tensor of that config, in the shapes interop.h lists, without error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz/support.h"
#include "trainer/formats/interop.h"

static void read_one(interop_file_t *f, const char *name, size_t rows, size_t cols) {
  size_t n = rows * cols;
  float *buf = malloc((n ? n : 1) * sizeof *buf); /* exact size: ASAN sees any overrun */
  CHECK(buf);
  char err[512];
  int rc = interop_read_tensor(f, name, buf, n, err, sizeof err);
  if (rc) fprintf(stderr, "%s: %s\n", name, err);
  CHECK(rc == 0);
  free(buf);
}

/* Every tensor of the file's model, shapes as interop.h lists them (ours, Meta layout). */
static void read_all(interop_file_t *f) {
  const plan_model_t *c = interop_config(f);
  const size_t C = (size_t)c->dim, D = C / (size_t)c->n_heads, KV = (size_t)c->n_kv_heads * D;
  const size_t F = (size_t)c->hidden_dim, V = (size_t)c->vocab_size;
  char name[128];
  read_one(f, "tok_embeddings.weight", V, C);
  for (int l = 0; l < c->n_layers; l++) {
    static const struct {
      const char *n;
      int r, q; /* 0: C, 1: KV, 2: F, 3: one column */
    } per[] = {{"attention_norm.weight", 0, 3},  {"attention.wq.weight", 0, 0}, {"attention.wk.weight", 1, 0},
               {"attention.wv.weight", 1, 0},    {"attention.wo.weight", 0, 0}, {"ffn_norm.weight", 0, 3},
               {"feed_forward.w1.weight", 2, 0}, {"feed_forward.w2.weight", 0, 2}, {"feed_forward.w3.weight", 2, 0}};
    const size_t dim[4] = {C, KV, F, 1};
    for (size_t k = 0; k < sizeof per / sizeof per[0]; k++) {
      snprintf(name, sizeof name, "layers.%d.%s", l, per[k].n);
      read_one(f, name, dim[per[k].r], dim[per[k].q]);
    }
  }
  read_one(f, "norm.weight", C, 1);
  read_one(f, "output.weight", V, C);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static fuzz_memfile_t file;
  static char hf_dir[512], cfg_path[600], st_path[600];
  if (!file.path[0]) {
    fuzz_memfile_init(&file, "model.bin");
    snprintf(hf_dir, sizeof hf_dir, "%s/hf", fuzz_tmpdir());
    CHECK(mkdir(hf_dir, 0755) == 0);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", hf_dir);
    snprintf(st_path, sizeof st_path, "%s/model.safetensors", hf_dir);
  }
  interop_file_t *f = NULL;
  char err[1024];
  int rc;
  if (size > 0 && data[0] == '{') {
    char *parts[2];
    size_t lens[2];
    int n = fuzz_split(data, size, 2, parts, lens);
    fuzz_write_file(cfg_path, parts[0], lens[0]);
    if (n == 2)
      fuzz_write_file(st_path, parts[1], lens[1]);
    else
      unlink(st_path);
    fuzz_parts_free(parts, n);
    rc = interop_open(&f, hf_dir, INTEROP_HF, err, sizeof err);
  } else {
    fuzz_memfile_set(&file, data, size);
    rc = interop_open(&f, file.path, INTEROP_LLAMA2C, err, sizeof err);
  }
  if (rc != 0) {
    fuzz_note("%s", err);
    CHECK(f == NULL && !strncmp(err, "interop error: ", 15));
    return 0;
  }
  CHECK(interop_check_plan(f, interop_config(f), err, sizeof err) == 0);
  read_all(f);
  fuzz_note("opened: dim %d, %d layers, every tensor read", interop_config(f)->dim, interop_config(f)->n_layers);
  interop_close(f);
  return 0;
}
