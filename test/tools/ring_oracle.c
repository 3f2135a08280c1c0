// deps: test/support/fixture.c trainer/model/ring_attention.c trainer/parallel/mesh.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/err.c common/env.c trainer/backend/fatal.c
/* ring_oracle: ring attention over cp real processes on the cpu backend, dumped for PyTorch
 * (test/integration/test_context_parallel.py recomputes it with torch's autograd).
 *
 *   ring_oracle OUTDIR cp b c h kv d
 *
 * Writes OUTDIR/inputs.f32: q (b, T, h, d), k and v (b, T, kv, d), dout (b, T, h, d) of the whole
 * sequence (T = 2 cp c, seeded normals, fp32, in that order), and per cp rank r
 * OUTDIR/rank<r>.f32: its out, lse (2, b, h, c), dq, dk, dv, chunk-major (rank r holds chunks r
 * and 2 cp - 1 - r), fp32 little-endian. Exit 0, or 1 with a message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test/support/fixture.h"
#include "trainer/backend/backend.h"
#include "trainer/model/ring_attention.h"
#include "trainer/model/rng.h"
#include "trainer/parallel/mesh.h"

typedef struct {
  const char *dir;
  int b, c, h, kv, d;
} oracle_t;

static float *normals(size_t n, uint64_t stream) {
  rng_t r;
  rng_init(&r, 11, stream);
  float *x = malloc(n * sizeof *x);
  for (size_t i = 0; i < n && x; i++)
    x[i] = (float)rng_normal(&r);
  return x;
}

static int write_all(const char *path, float *const *parts, const size_t *n, int count) {
  FILE *f = fopen(path, "wb");
  if (!f) return 1;
  int bad = 0;
  for (int i = 0; i < count; i++)
    bad |= fwrite(parts[i], sizeof(float), n[i], f) != n[i];
  return fclose(f) != 0 || bad;
}

/* Rows [g c, g c + c) of every sequence of x (b, T, w), for chunks g[0], g[1], chunk-major. */
static void chunks(float *out, const float *x, int b, int t, int c, int w, const int g[2]) {
  for (int i = 0; i < 2; i++)
    for (int bi = 0; bi < b; bi++)
      memcpy(out + (((size_t)i * b + bi) * c) * w, x + ((size_t)bi * t + (size_t)g[i] * c) * w,
             (size_t)c * w * sizeof(float));
}

static int rank_main(int rank, int n, store_t *st, void *arg) {
  const oracle_t *o = arg;
  const int cp = n, b = o->b, c = o->c, h = o->h, kv = o->kv, d = o->d, t = 2 * cp * c;
  const size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  const size_t lq = nq / cp, lk = nk / cp, ll = (size_t)2 * b * h * c;
  char err[512] = "", path[4096];
  int dims[MESH_NDIMS];
  dims[MESH_PP] = dims[MESH_DP_REPLICATE] = dims[MESH_DP_SHARD] = dims[MESH_TP] = 1;
  dims[MESH_CP] = cp;
  mesh_t *m = NULL;
  ring_attention_t ring;
  backend_t *be = backend_cpu_create(1, err, sizeof err);
  if (!be || mesh_create_dims(&m, dims, rank, n, err, sizeof err) ||
      mesh_connect(m, "cpu", NULL, st, 0, "127.0.0.1", 30000, err, sizeof err) ||
      ring_attention_init(&ring, be, m->cp.send, m->cp.recv, cp, rank, b, c, h, kv, d, DT_F32, err, sizeof err)) {
    fprintf(stderr, "ring_oracle: rank %d: %s\n", rank, err);
    return 1;
  }
  float *q = normals(nq, 1), *k = normals(nk, 2), *v = normals(nk, 3), *dout = normals(nq, 4);
  if (rank == 0) {
    snprintf(path, sizeof path, "%s/inputs.f32", o->dir);
    if (write_all(path, (float *const[]){q, k, v, dout}, (size_t[]){nq, nk, nk, nq}, 4)) {
      fprintf(stderr, "ring_oracle: cannot write %s\n", path);
      return 1;
    }
  }
  const int g[2] = {ring_attention_chunk(&ring, 0), ring_attention_chunk(&ring, 1)};
  float *mq = malloc(lq * 4), *mk = malloc(lk * 4), *mv = malloc(lk * 4), *mdo = malloc(lq * 4);
  float *out = malloc(lq * 4), *lse = malloc(ll * 4), *dq = malloc(lq * 4), *dk = malloc(lk * 4), *dv = malloc(lk * 4);
  chunks(mq, q, b, t, c, h * d, g);
  chunks(mk, k, b, t, c, kv * d, g);
  chunks(mv, v, b, t, c, kv * d, g);
  chunks(mdo, dout, b, t, c, h * d, g);
  int rc = ring_attention_fwd(&ring, out, lse, mq, mk, mv, b) ||
           ring_attention_bwd(&ring, dq, dk, dv, mdo, mq, mk, mv, out, lse, b);
  if (rc) fprintf(stderr, "ring_oracle: rank %d: %s\n", rank, ring_attention_errmsg(&ring));
  snprintf(path, sizeof path, "%s/rank%d.f32", o->dir, rank);
  if (!rc && write_all(path, (float *const[]){out, lse, dq, dk, dv}, (size_t[]){lq, ll, lq, lk, lk}, 5)) {
    fprintf(stderr, "ring_oracle: cannot write %s\n", path);
    rc = 1;
  }
  float *all[] = {q, k, v, dout, mq, mk, mv, mdo, out, lse, dq, dk, dv};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    free(all[i]);
  ring_attention_free(&ring);
  mesh_destroy(m);
  backend_destroy(be);
  return rc;
}

int main(int argc, char **argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: ring_oracle OUTDIR cp b c h kv d\n");
    return 2;
  }
  oracle_t o = {argv[1], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), atoi(argv[7])};
  int cp = atoi(argv[2]);
  if (cp < 2 || cp > 16 || o.b < 1 || o.c < 1 || o.h < 1 || o.kv < 1 || o.h % o.kv || o.d < 1) {
    fprintf(stderr, "ring_oracle: bad shape\n");
    return 2;
  }
  return fixture_run_ranks(cp, rank_main, &o, 120) == 0 ? 0 : 1;
}
