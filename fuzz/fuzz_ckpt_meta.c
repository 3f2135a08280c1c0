// deps: trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c fuzz/support.c common/err.c common/env.c trainer/backend/fatal.c
// max_len: 16384
/* fuzz_ckpt_meta: opening a checkpoint (ckpt_open) whose metadata.json is the input.
 *
 * Once per process, the real writer (ckpt_writer_save, a world of one) saves a small checkpoint
 * into a scratch directory: tensors param/w (4, 3) in two chunks, param/b (3, 1), adam_m/w.
 * Each input then replaces step-1/metadata.json and the step is opened by path, then its
 * tensors are read back. Input: metadata.json's text; optionally a NUL and the bytes of a
 * replacement shard-0.safetensors (else the writer's shard is used). Since metadata.json
 * carries the shard's size and CRC32C, the literal text @BYTES@ and @CRC@ in the metadata is
 * replaced with the shard's real size and CRC (ckpt_crc32c) before writing, so that inputs can
 * get past the checksum to the shard's chunk list. metadata.json also checksums itself: it
 * opens with {"metadata_crc32c": "0x<8 hex digits>", and the CRC covers every byte after that
 * comma; so the 8 characters @METACRC, once the others are filled, become the CRC32C of what
 * follows them from their third next byte on. Written seeds use these placeholders.
 * MESHRUN_FUZZ_SEED_DIR=dir (a directory) makes the first run copy the writer's metadata.json
 * and shard there (make-corpus.py builds seeds from them). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/log.h"
#include "fuzz/support.h"
#include "trainer/formats/ckpt.h"

static char g_dir[512], g_step[600], g_meta[700], g_shard[700];
static unsigned char *g_default_shard;
static size_t g_default_len;

static void save_seed_checkpoint(void) {
  setenv("MESHRUN_LOG_LEVEL", "error", 0); /* the writer logs each save at info level */
  log_init("[fuzz_ckpt_meta]");
  snprintf(g_dir, sizeof g_dir, "%s/ckpt", fuzz_tmpdir());
  static const float w[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, b[3] = {0.5f, -1, 2}, m[12] = {0};
  const ckpt_chunk_t chunks[] = {
      {"param", "w", 4, 3, 0, 4, 0, 3, 0, 5, w},   {"param", "w", 4, 3, 0, 4, 0, 3, 5, 12, w + 5},
      {"param", "b", 3, 1, 0, 3, 0, 1, 0, 3, b},   {"adam_m", "w", 4, 3, 0, 4, 0, 3, 0, 12, m},
  };
  ckpt_writer_config_t cfg = {.dir = g_dir, .shape = {4, 1, 2, 1, 3, 8}, .mesh = {1, 1, 1},
                              .plan_json = "{\"seed\": 7, \"mesh\": {\"tp\": 1}}"};
  ckpt_writer_t *wr = NULL;
  char err[512];
  ckpt_state_t st = {.step = 1, .optim_step = 1, .data_position = 64, .n_rng = 2, .rng = {0xDEADBEEFCAFEF00Dull, 42}};
  ckpt_state_set(&st, "loss", "2.5");
  if (ckpt_writer_create(&wr, &cfg, err, sizeof err) != 0 ||
      ckpt_writer_save(wr, &st, chunks, (int)(sizeof chunks / sizeof chunks[0]), err, sizeof err) != 0) {
    fprintf(stderr, "fuzz_ckpt_meta: cannot save the seed checkpoint: %s\n", err);
    abort();
  }
  ckpt_writer_destroy(wr);
  snprintf(g_step, sizeof g_step, "%s/step-1", g_dir);
  snprintf(g_meta, sizeof g_meta, "%s/metadata.json", g_step);
  snprintf(g_shard, sizeof g_shard, "%s/shard-0.safetensors", g_step);
  g_default_shard = fuzz_read_file(g_shard, &g_default_len);
  CHECK(g_default_shard);
  const char *seed_dir = getenv("MESHRUN_FUZZ_SEED_DIR");
  if (seed_dir && *seed_dir) {
    char p[1024];
    size_t n;
    unsigned char *meta = fuzz_read_file(g_meta, &n);
    CHECK(meta);
    snprintf(p, sizeof p, "%s/metadata.json", seed_dir);
    fuzz_write_file(p, meta, n);
    snprintf(p, sizeof p, "%s/shard-0.safetensors", seed_dir);
    fuzz_write_file(p, g_default_shard, g_default_len);
    free(meta);
  }
}

/* text with @BYTES@, @CRC@ and then @METACRC filled in (malloc'ed). */
static char *fill_placeholders(const char *text, size_t shard_len, uint32_t crc) {
  char bytes[32], crcs[16];
  snprintf(bytes, sizeof bytes, "%zu", shard_len);
  snprintf(crcs, sizeof crcs, "0x%08" PRIx32, crc);
  size_t cap = strlen(text) + 1, n = 0;
  for (const char *s = text; (s = strchr(s, '@')); s++) cap += 32; /* room for every expansion */
  char *out = malloc(cap);
  CHECK(out);
  for (const char *s = text; *s;) {
    const char *put = NULL;
    size_t skip = 1;
    if (!strncmp(s, "@BYTES@", 7))
      put = bytes, skip = 7;
    else if (!strncmp(s, "@CRC@", 5))
      put = crcs, skip = 5;
    if (put) {
      memcpy(out + n, put, strlen(put));
      n += strlen(put);
    } else {
      out[n++] = *s;
    }
    s += skip;
  }
  out[n] = 0;
  char *meta = strstr(out, "@METACRC");
  if (meta && strlen(meta) >= 10) {
    char hex[9];
    snprintf(hex, sizeof hex, "%08" PRIx32, ckpt_crc32c(0, meta + 10, strlen(meta + 10)));
    memcpy(meta, hex, 8);
  }
  return out;
}

static void read_back(ckpt_t *ck) {
  static const ckpt_chunk_t regions[] = {
      {"param", "w", 4, 3, 0, 4, 0, 3, 0, 12, NULL},
      {"param", "w", 4, 3, 1, 3, 1, 3, 1, 4, NULL},
      {"param", "b", 3, 1, 0, 3, 0, 1, 0, 3, NULL},
      {"adam_m", "w", 4, 3, 0, 4, 0, 3, 0, 12, NULL},
  };
  for (size_t i = 0; i < sizeof regions / sizeof regions[0]; i++) {
    const ckpt_chunk_t *q = &regions[i];
    float *out = malloc((size_t)(q->b - q->a) * sizeof *out); /* exact size: ASAN sees overruns */
    CHECK(out);
    char err[512];
    if (ckpt_has(ck, q->kind, q->name) && ckpt_read(ck, q, out, err, sizeof err) != 0) fuzz_note("%s", err);
    free(out);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_default_shard) save_seed_checkpoint();
  char *parts[2];
  size_t lens[2];
  int n = fuzz_split(data, size, 2, parts, lens);
  const unsigned char *shard = n == 2 ? (const unsigned char *)parts[1] : g_default_shard;
  size_t shard_len = n == 2 ? lens[1] : g_default_len;
  fuzz_write_file(g_shard, shard, shard_len);
  char *meta = fill_placeholders(parts[0], shard_len, ckpt_crc32c(0, shard, shard_len));
  fuzz_write_file(g_meta, meta, strlen(meta));
  free(meta);
  fuzz_parts_free(parts, n);

  ckpt_t *ck = NULL;
  char err[2048];
  int rc = ckpt_open(&ck, g_dir, g_step, NULL, NULL, err, sizeof err);
  if (rc != 0) {
    fuzz_note("%s", err);
    CHECK(ck == NULL && err[0]);
    return 0;
  }
  const ckpt_meta_t *m = ckpt_meta(ck);
  CHECK(m && m->version >= 1 && m->world_size >= 1 && m->plan_json && m->path);
  CHECK(m->state.n_rng >= 0 && m->state.n_rng <= CKPT_RNG_MAX);
  CHECK(m->state.n_extra >= 0 && m->state.n_extra <= CKPT_EXTRA_MAX);
  read_back(ck);
  fuzz_note("opened step %" PRId64 ", world %d", m->state.step, m->world_size);
  ckpt_close(ck);
  return 0;
}
