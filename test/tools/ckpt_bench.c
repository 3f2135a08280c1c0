// deps: trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c trainer/backend/fatal.c
/* ckpt_bench: save and reshard one Llama-1B-size tensor (the 128256 x 2048 embedding, 1 GiB of
 * fp32) and print a table of times and bandwidths.
 *
 *   ckpt_bench DIR [ROWS [COLS]]
 *
 * Saves it as the 8 chunks that 8 FSDP ranks would save (flat cuts mid-row), from one process
 * into one file, opens the checkpoint (verifying the CRC and the coverage), then reads it back under layouts that share no chunk boundary with the saved one:
 * the whole tensor, 3 FSDP shards, tp2 row halves, and tp2 column halves (the worst case: one
 * span per row per chunk). Every read is compared with the values written. Not a unit test:
 * it needs ~3 GiB of memory and disk. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "trainer/formats/ckpt.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float val(int64_t i) { return (float)(i % 1000003) * 0.5f; }

static void row(const char *what, double s, double bytes, int bad) {
  printf("%-34s %9.3f s %9.2f GB/s %8d\n", what, s, bytes / s / 1e9, bad);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: ckpt_bench DIR [ROWS [COLS]]\n");
    return 2;
  }
  const char *dir = argv[1];
  int64_t rows = argc > 2 ? atoll(argv[2]) : 128256, cols = argc > 3 ? atoll(argv[3]) : 2048;
  int64_t n = rows * cols;
  double bytes = (double)n * 4;
  float *full = malloc((size_t)n * sizeof *full), *out = malloc((size_t)n * sizeof *out);
  if (!full || !out) return 1;
  for (int64_t i = 0; i < n; i++) full[i] = val(i);
  char err[2048];
  printf("%-34s %11s %14s %8s\n", "operation", "time", "bandwidth", "#wrong");

  ckpt_writer_config_t cfg = {.dir = dir, .keep = 1, .shape = {2048, 16, 32, 8, 128256, 8192}};
  ckpt_writer_t *w = NULL;
  if (ckpt_writer_create(&w, &cfg, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
  ckpt_chunk_t ch[8];
  int64_t per = (n + 7) / 8;
  for (int s = 0; s < 8; s++) {
    int64_t a = per * s < n ? per * s : n, b = per * (s + 1) < n ? per * (s + 1) : n;
    ch[s] = (ckpt_chunk_t){"param", "tok_embeddings.weight", rows, cols, 0, rows, 0, cols, a, b, full + a};
  }
  ckpt_state_t st = {.step = 1};
  double t0 = now();
  if (ckpt_writer_save(w, &st, ch, 8, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
  row("save (write, fsync, crc, commit)", now() - t0, bytes, 0);
  ckpt_writer_destroy(w);

  ckpt_t *ck = NULL;
  t0 = now();
  if (ckpt_open(&ck, dir, "auto", &cfg.shape, NULL, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
  row("open (verify crc, index)", now() - t0, bytes, 0);

  struct {
    const char *what;
    int parts, tp_cols, tp_rows;
  } lay[] = {{"read whole tensor", 1, 0, 0}, {"read as 3 fsdp shards", 3, 0, 0},
             {"read as tp2 row halves", 2, 0, 1}, {"read as tp2 column halves", 2, 1, 0}};
  for (int l = 0; l < 4; l++) {
    memset(out, 0, (size_t)n * sizeof *out);
    t0 = now();
    int64_t done = 0;
    for (int p = 0; p < lay[l].parts; p++) {
      ckpt_chunk_t q = {"param", "tok_embeddings.weight", rows, cols, 0, rows, 0, cols, 0, 0, NULL};
      if (lay[l].tp_rows) {
        q.r0 = rows / 2 * p, q.r1 = p ? rows : rows / 2;
        q.b = (q.r1 - q.r0) * cols;
      } else if (lay[l].tp_cols) {
        q.c0 = cols / 2 * p, q.c1 = p ? cols : cols / 2;
        q.b = rows * (q.c1 - q.c0);
      } else {
        int64_t pp = (n + lay[l].parts - 1) / lay[l].parts;
        q.a = pp * p < n ? pp * p : n;
        q.b = pp * (p + 1) < n ? pp * (p + 1) : n;
      }
      if (ckpt_read(ck, &q, out + done, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
      done += q.b - q.a;
    }
    double dt = now() - t0;
    int bad = 0;
    if (lay[l].tp_cols) {
      for (int64_t r = 0; r < rows && bad < 10; r++)
        for (int64_t c = 0; c < cols; c++) {
          int64_t half = c < cols / 2 ? 0 : 1, w2 = half ? cols - cols / 2 : cols / 2;
          int64_t at = half * rows * (cols / 2) + r * w2 + (c - half * (cols / 2));
          if (out[at] != full[r * cols + c]) bad++;
        }
    } else {
      bad = memcmp(out, full, (size_t)n * sizeof *out) != 0;
    }
    row(lay[l].what, dt, bytes, bad);
  }
  ckpt_close(ck);
  free(full);
  free(out);
  return 0;
}
