// deps: trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c test/support/files.c common/fs.c common/err.c common/env.c trainer/backend/fatal.c
/* test_ckpt: distributed checkpoints saved under one layout and loaded under another.
 *
 * A small synthetic Llama-like tensor set (embedding and output split by rows under tp, wq/w1
 * by rows, wo/w2 by columns, 1-D norms replicated) is laid out as the model does (tp-local
 * shapes, consecutive flat offsets) and sharded FSDP-style: rank s of dp_shard S owns the flat
 * range [s * ceil(N/S), ...), which cuts tensors mid-row. Every value is a function of (kind,
 * tensor, step, full row, full column), so a load under any layout is checked bit for bit
 * against the function, not against another load. Multi-rank saves and loads run the real
 * protocol with one thread per rank and a comm_t whose ops move bytes through shared memory
 * (cmocka's asserts are only used on the main thread). Checkpoints live in a fresh mkdtemp
 * directory per test. Also: crash atomicity through the test hook, corruption (truncation, a
 * flipped byte) with fallback, a refused model shape, retention, async saves, metadata; the
 * metadata's own checksum (every one-bit flip of metadata.json refused, a tampered optim_step
 * falling back, a version-1 file named as such); failed writes (the "write" hook) failing the
 * save on every rank with the cause, a lack of space winning, the .tmp removed, and the writer
 * saving again afterwards; a NaN or an infinity in an intact checkpoint refused, the element named,
 * with no fallback. */
#include <errno.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <ftw.h>

#include <cmocka.h>

#include "test/support/files.h"

#include "trainer/formats/ckpt.h"
#include "trainer/comm/comm_impl.h" /* a fake shared-memory comm backend */

/* --- the synthetic model */

#define V 38
#define C 12
#define H 20
typedef struct {
  const char *name;
  int rows, cols, ndim, split;
} spec_t;
static const spec_t SPECS[] = {
    {"tok_embeddings.weight", V, C, 2, MODEL_TP_ROWS},
    {"layers.0.attention_norm.weight", C, 1, 1, MODEL_TP_REPLICATED},
    {"layers.0.attention.wq.weight", C, C, 2, MODEL_TP_ROWS},
    {"layers.0.attention.wo.weight", C, C, 2, MODEL_TP_COLS},
    {"layers.0.feed_forward.w1.weight", H, C, 2, MODEL_TP_ROWS},
    {"layers.0.feed_forward.w2.weight", C, H, 2, MODEL_TP_COLS},
    {"layers.1.attention.wq.weight", C, C, 2, MODEL_TP_ROWS},
    {"norm.weight", C, 1, 1, MODEL_TP_REPLICATED},
    {"output.weight", V, C, 2, MODEL_TP_ROWS},
};
#define NT ((int)(sizeof SPECS / sizeof SPECS[0]))
static const char *KINDS[] = {"param", "adam_m", "adam_v"};

static uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
static uint64_t hstr(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}
/* The value of element (r, c) of a full tensor: distinct per kind, tensor and step. */
static float value(const char *kind, const char *name, int64_t step, int64_t r, int64_t c) {
  uint64_t x = mix(hstr(kind) ^ mix(hstr(name) ^ mix((uint64_t)step * 1000003u ^ (uint64_t)(r * 4096 + c))));
  return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Tensors as tp rank t of T sees them (local shapes, consecutive offsets); returns N. */
static size_t layout(model_tensor_t *ts, int T) {
  size_t off = 0;
  for (int i = 0; i < NT; i++) {
    const spec_t *s = &SPECS[i];
    model_tensor_t *t = &ts[i];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", s->name);
    t->ndim = s->ndim;
    t->full_shape[0] = s->rows;
    t->full_shape[1] = s->cols;
    t->tp_split = T > 1 ? s->split : MODEL_TP_REPLICATED;
    t->shape[0] = s->rows / (t->tp_split == MODEL_TP_ROWS ? T : 1);
    t->shape[1] = s->cols / (t->tp_split == MODEL_TP_COLS ? T : 1);
    t->numel = (size_t)t->shape[0] * (size_t)t->shape[1];
    t->offset = off;
    off += t->numel;
  }
  return off;
}

/* This tp rank's local flat buffer of `kind` at `step`. */
static float *local_values(const model_tensor_t *ts, size_t n, int tp_rank, const char *kind, int64_t step) {
  float *buf = malloc(n * sizeof *buf);
  for (int i = 0; i < NT; i++) {
    const model_tensor_t *t = &ts[i];
    int64_t r0 = t->tp_split == MODEL_TP_ROWS ? (int64_t)tp_rank * t->shape[0] : 0;
    int64_t c0 = t->tp_split == MODEL_TP_COLS ? (int64_t)tp_rank * t->shape[1] : 0;
    for (int64_t r = 0; r < t->shape[0]; r++)
      for (int64_t c = 0; c < t->shape[1]; c++)
        buf[t->offset + (size_t)(r * t->shape[1] + c)] = value(kind, t->name, step, r0 + r, c0 + c);
  }
  return buf;
}

static void shard_range(size_t n, int S, int s, size_t *off, size_t *cnt) {
  size_t per = (n + (size_t)S - 1) / (size_t)S;
  size_t a = per * (size_t)s < n ? per * (size_t)s : n, b = per * (size_t)(s + 1) < n ? per * (size_t)(s + 1) : n;
  *off = a;
  *cnt = b - a;
}

/* --- a group of threads: a comm_t whose ops move bytes through shared memory */

#define MAXR 16
typedef struct {
  int size;
  pthread_barrier_t bar;
  char slots[MAXR][8192];
} shm_t;

static int shm_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype) {
  shm_t *s = c->impl;
  size_t bytes = count * 4;
  if (bytes > sizeof s->slots[0]) return COMM_EINVAL;
  memcpy(s->slots[c->rank], in, bytes);
  pthread_barrier_wait(&s->bar);
  for (int i = 0; i < s->size; i++) memcpy((char *)out + (size_t)i * bytes, s->slots[i], bytes);
  pthread_barrier_wait(&s->bar);
  return 0;
}
static int shm_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root) {
  shm_t *s = c->impl;
  size_t bytes = count * 4;
  if (bytes > sizeof s->slots[0]) return COMM_EINVAL;
  if (c->rank == root) memcpy(s->slots[root], buf, bytes);
  pthread_barrier_wait(&s->bar);
  if (c->rank != root) memcpy(buf, s->slots[root], bytes);
  pthread_barrier_wait(&s->bar);
  return 0;
}
static int shm_barrier(comm_t *c) {
  pthread_barrier_wait(&((shm_t *)c->impl)->bar);
  return 0;
}
static const comm_ops_t SHM_OPS = {"shm", NULL, shm_all_gather, NULL, shm_broadcast, shm_barrier, NULL};

typedef struct rank_ctx rank_ctx_t;
typedef int (*rank_fn)(rank_ctx_t *r);
struct rank_ctx {
  int rank, size;
  comm_t comm;
  ckpt_group_t group;
  const ckpt_group_t *g; /* NULL for a world of one */
  void *arg;
  rank_fn fn;
  int rc;
  char err[1024];
};

static void *rank_main(void *p) {
  rank_ctx_t *r = p;
  r->rc = r->fn(r);
  return NULL;
}

/* Runs fn on n ranks (threads; n == 1 runs inline with no group). Returns the first failure's
 * code, or 0; each rank's code and message stay in ranks[]. */
static rank_ctx_t ranks[MAXR];
static shm_t shm;
static int run_ranks(int n, rank_fn fn, void *arg) {
  memset(ranks, 0, sizeof ranks);
  if (n == 1) {
    ranks[0] = (rank_ctx_t){.rank = 0, .size = 1, .arg = arg, .fn = fn};
    return fn(&ranks[0]);
  }
  shm.size = n;
  pthread_barrier_init(&shm.bar, NULL, (unsigned)n);
  pthread_t th[MAXR];
  for (int i = 0; i < n; i++) {
    rank_ctx_t *r = &ranks[i];
    r->rank = i, r->size = n, r->arg = arg, r->fn = fn;
    r->comm.ops = &SHM_OPS;
    r->comm.impl = &shm;
    r->comm.rank = i;
    r->comm.size = n;
    snprintf(r->comm.name, sizeof r->comm.name, "world.0");
    ckpt_group_from_comm(&r->group, &r->comm);
    r->g = &r->group;
    pthread_create(&th[i], NULL, rank_main, r);
  }
  int rc = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    if (ranks[i].rc && !rc) rc = ranks[i].rc;
  }
  pthread_barrier_destroy(&shm.bar);
  return rc;
}

/* --- saving under a layout */

static char root[256];

static ckpt_shape_t SHAPE = {C, 2, 4, 2, V, H};

typedef struct {
  const char *dir;
  int R, S, T;  /* replicas (all saving), FSDP shards, tp */
  int64_t steps[4];
  int n_steps;
  int keep, async, nkinds;
  int bad_rank;  /* -1, or a rank that passes an invalid chunk */
  int drop_rank; /* -1, or a rank that saves nothing (a hole in the checkpoint) */
  int fail_rank; /* -1, or a rank that could not collect its state (passes n_chunks -1) */
  int (*hook)(const char *, int64_t, void *);
  void *hook_arg;
  int scribble; /* async: overwrite the buffers right after each save returns */
  int64_t fault_step;   /* with fault_err: the step whose shard writes fail */
  int fault_err[MAXR];  /* per rank: the errno its "write" hook returns at fault_step (0: none) */
  int go_on;            /* keep saving the next steps after a failed one (first error returned) */
  int64_t poison_step;  /* with poison_kind, poison_tensor, poison_r, poison_c: the element of that full */
  int poison_kind;      /* tensor that holds poison instead of its value at that step, on the rank */
  int poison_tensor;    /* that holds it */
  int64_t poison_r, poison_c;
  float poison;
} save_t;

/* The "write" hook of rank `rank` under save_t a (fault_step, fault_err). */
typedef struct {
  int rank;
  const save_t *a;
} fault_t;
static int fault_hook(const char *point, int64_t step, void *arg) {
  const fault_t *f = arg;
  return !strcmp(point, "write") && step == f->a->fault_step ? f->a->fault_err[f->rank] : 0;
}

static int save_rank(rank_ctx_t *rc) {
  save_t *a = rc->arg;
  int t = rc->rank % a->T, s = (rc->rank / a->T) % a->S;
  model_tensor_t ts[NT];
  size_t n = layout(ts, a->T), off, cnt;
  shard_range(n, a->S, s, &off, &cnt);
  ckpt_writer_config_t cfg = {.dir = a->dir, .keep = a->keep, .async = a->async, .group = rc->g, .shape = SHAPE,
                              .mesh = {a->R, a->S, a->T}, .plan_json = "{\"seed\": 7, \"mesh\": {\"tp\": 2}}",
                              .hook = a->hook, .hook_arg = a->hook_arg};
  fault_t fault = {rc->rank, a};
  if (a->fault_step) {
    cfg.hook = fault_hook;
    cfg.hook_arg = &fault;
  }
  ckpt_writer_t *w = NULL;
  int ret = ckpt_writer_create(&w, &cfg, rc->err, sizeof rc->err), first = 0;
  char first_err[sizeof rc->err] = "";
  if (ret) return ret;
  for (int k = 0; k < a->n_steps && (!first || a->go_on); k++) {
    int64_t step = a->steps[k];
    float *bufs[3] = {0};
    ckpt_chunks_t cs = {0};
    for (int q = 0; q < a->nkinds; q++) {
      bufs[q] = local_values(ts, n, t, KINDS[q], step);
      const model_tensor_t *pt = &ts[a->poison_tensor];
      const int64_t lr = a->poison_r - (pt->tp_split == MODEL_TP_ROWS ? (int64_t)t * pt->shape[0] : 0);
      const int64_t lc = a->poison_c - (pt->tp_split == MODEL_TP_COLS ? (int64_t)t * pt->shape[1] : 0);
      if (a->poison_step == step && a->poison_kind == q && lr >= 0 && lr < pt->shape[0] && lc >= 0 &&
          lc < pt->shape[1])
        bufs[q][pt->offset + (size_t)(lr * pt->shape[1] + lc)] = a->poison;
      ckpt_chunks_add_range(&cs, KINDS[q], ts, NT, t, off, cnt, bufs[q] + off);
    }
    if (rc->rank == a->bad_rank && cs.n > 0) cs.v[0].b = cs.v[0].rows * cs.v[0].cols + 1;
    if (rc->rank == a->drop_rank) cs.n = 0;
    if (rc->rank == a->fail_rank) cs.n = -1;
    ckpt_state_t st = {.step = step, .optim_step = step, .data_position = (uint64_t)step * 64, .n_rng = 2,
                       .rng = {0xDEADBEEFCAFEF00Dull + (uint64_t)step, 42}};
    ckpt_state_set(&st, "loss", "2.5");
    ret = ckpt_writer_save(w, &st, cs.v, cs.n, rc->err, sizeof rc->err);
    if (!ret && a->async && a->go_on) ret = ckpt_writer_wait(w, rc->err, sizeof rc->err); /* this step's outcome */
    if (ret && !first) {
      first = ret;
      snprintf(first_err, sizeof first_err, "%s", rc->err);
    }
    for (int q = 0; q < a->nkinds; q++) {
      if (a->scribble) memset(bufs[q], 0xff, n * sizeof(float));
      free(bufs[q]);
    }
    ckpt_chunks_free(&cs);
  }
  if (!first && a->async && (ret = ckpt_writer_wait(w, rc->err, sizeof rc->err)) != 0) first = ret;
  else if (first) snprintf(rc->err, sizeof rc->err, "%s", first_err);
  ckpt_writer_destroy(w);
  return first;
}

static int save(save_t a) {
  if (!a.dir) a.dir = root;
  if (!a.R) a.R = 1;
  if (!a.S) a.S = 1;
  if (!a.T) a.T = 1;
  if (!a.nkinds) a.nkinds = 2;
  if (!a.bad_rank) a.bad_rank = -1;
  if (!a.drop_rank) a.drop_rank = -1;
  if (!a.fail_rank) a.fail_rank = -1;
  int rc = run_ranks(a.R * a.S * a.T, save_rank, &a);
  if (rc) printf("save: %s\n", ranks[0].err[0] ? ranks[0].err : "(no message)");
  return rc;
}

/* --- checking under another layout: every rank's range, every kind, bit for bit */

static int check_layout(ckpt_t *ck, int S, int T, int64_t step, int nkinds) {
  model_tensor_t ts[NT];
  size_t n = layout(ts, T);
  int bad = 0;
  char err[512];
  for (int t = 0; t < T; t++)
    for (int q = 0; q < nkinds; q++) {
      float *want = local_values(ts, n, t, KINDS[q], step);
      for (int s = 0; s < S; s++) {
        size_t off, cnt;
        shard_range(n, S, s, &off, &cnt);
        float *got = calloc(cnt + 1, sizeof *got);
        int rc = ckpt_read_range(ck, KINDS[q], ts, NT, t, off, cnt, got, err, sizeof err);
        if (rc) {
          printf("read_range S=%d T=%d s=%d t=%d %s: %s\n", S, T, s, t, KINDS[q], err);
          bad++;
        } else if (memcmp(got, want + off, cnt * sizeof *got)) {
          printf("values differ: S=%d T=%d s=%d t=%d %s\n", S, T, s, t, KINDS[q]);
          bad++;
        }
        free(got);
      }
      free(want);
    }
  return bad;
}

static ckpt_t *open_auto(const char *which, int64_t want_step) {
  ckpt_t *ck = NULL;
  char err[2048];
  int rc = ckpt_open(&ck, root, which, &SHAPE, NULL, err, sizeof err);
  if (rc) printf("ckpt_open: %s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(ckpt_meta(ck)->state.step, want_step);
  return ck;
}

static void expect_layouts(int64_t step, int nkinds) {
  ckpt_t *ck = open_auto("auto", step);
  static const int lay[][2] = {{1, 1}, {2, 1}, {6, 1}, {4, 1}, {1, 2}, {3, 2}, {4, 2}, {5, 2}};
  for (size_t i = 0; i < sizeof lay / sizeof lay[0]; i++)
    assert_int_equal(check_layout(ck, lay[i][0], lay[i][1], step, nkinds), 0);
  ckpt_close(ck);
}

/* --- helpers on files */

static int rm_cb(const char *p, const struct stat *sb, int f, struct FTW *w) { return remove(p); }
static int setup(void **state) {
  snprintf(root, sizeof root, "%s/test_ckpt.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  assert_non_null(mkdtemp(root));
  return 0;
}
static int teardown(void **state) {
  nftw(root, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
  return 0;
}

static int exists(const char *rel) {
  char p[512];
  struct stat sb;
  snprintf(p, sizeof p, "%s/%s", root, rel);
  return stat(p, &sb) == 0;
}

static void read_latest(char *out, size_t n) {
  char p[512];
  snprintf(p, sizeof p, "%s/latest", root);
  FILE *f = fopen(p, "r");
  assert_non_null(f);
  size_t got = fread(out, 1, n - 1, f);
  out[got] = 0;
  fclose(f);
}

static int count_tmp(void) {
  DIR *d = opendir(root);
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d)))
    if (strstr(e->d_name, ".tmp")) n++;
  closedir(d);
  return n;
}

static unsigned char *slurp(const char *rel, size_t *len) {
  char p[640];
  snprintf(p, sizeof p, "%s/%s", root, rel);
  return testfile_read(p, len);
}

/* --- tests */

static void test_crc32c(void **state) {
  /* RFC 3720 B.4 vectors and the usual check value. */
  unsigned char z[32] = {0}, ff[32], inc[32];
  for (int i = 0; i < 32; i++) ff[i] = 0xff, inc[i] = (unsigned char)i;
  assert_int_equal(ckpt_crc32c(0, "123456789", 9), 0xE3069283u);
  assert_int_equal(ckpt_crc32c(0, z, 32), 0x8A9136AAu);
  assert_int_equal(ckpt_crc32c(0, ff, 32), 0x62A8AB43u);
  assert_int_equal(ckpt_crc32c(0, inc, 32), 0x46DD794Eu);
  assert_int_equal(ckpt_crc32c_portable(0, "123456789", 9), 0xE3069283u);
  assert_int_equal(ckpt_crc32c_portable(0, inc, 32), 0x46DD794Eu);
  /* Both implementations, every length and alignment, and chaining. */
  unsigned char buf[300];
  for (int i = 0; i < 300; i++) buf[i] = (unsigned char)mix((uint64_t)i);
  for (int off = 0; off < 8; off++)
    for (int len = 0; len < 200; len++) {
      uint32_t a = ckpt_crc32c(0, buf + off, (size_t)len), b = ckpt_crc32c_portable(0, buf + off, (size_t)len);
      assert_int_equal(a, b);
      assert_int_equal(ckpt_crc32c(ckpt_crc32c(0, buf + off, (size_t)len / 3), buf + off + len / 3,
                                   (size_t)(len - len / 3)),
                       a);
    }
}

static void test_fsdp4_loads_under_other_layouts(void **state) {
  assert_int_equal(save((save_t){.S = 4, .steps = {10}, .n_steps = 1, .nkinds = 3}), 0);
  expect_layouts(10, 3);
}

static void test_tp2_loads_as_fsdp(void **state) {
  assert_int_equal(save((save_t){.T = 2, .steps = {10}, .n_steps = 1}), 0);
  expect_layouts(10, 2);
}

static void test_2d_8_ranks_load_on_6(void **state) {
  assert_int_equal(save((save_t){.S = 4, .T = 2, .steps = {10}, .n_steps = 1}), 0);
  expect_layouts(10, 2);
}

static void test_serial_save(void **state) {
  assert_int_equal(save((save_t){.steps = {3}, .n_steps = 1}), 0);
  expect_layouts(3, 2);
}

static void test_replicas_deduplicated(void **state) {
  /* HSDP-like: 2 replicas x 2 shards, every replica saving the same values. */
  assert_int_equal(save((save_t){.R = 2, .S = 2, .steps = {10}, .n_steps = 1}), 0);
  expect_layouts(10, 2);
}

/* Arbitrary regions: random boxes and flat ranges against the value function. */
static void test_random_regions(void **state) {
  assert_int_equal(save((save_t){.S = 3, .T = 2, .steps = {5}, .n_steps = 1}), 0);
  ckpt_t *ck = open_auto("auto", 5);
  uint64_t x = 1;
  char err[512];
  float *out = malloc(V * H * sizeof *out);
  for (int it = 0; it < 400; it++) {
    const spec_t *s = &SPECS[(x = mix(x)) % NT];
    int64_t r0 = (int64_t)((x = mix(x)) % (uint64_t)s->rows), r1 = r0 + 1 + (int64_t)((x = mix(x)) % (uint64_t)(s->rows - r0));
    int64_t c0 = (int64_t)((x = mix(x)) % (uint64_t)s->cols), c1 = c0 + 1 + (int64_t)((x = mix(x)) % (uint64_t)(s->cols - c0));
    int64_t n = (r1 - r0) * (c1 - c0), a = (int64_t)((x = mix(x)) % (uint64_t)n);
    int64_t b = a + (int64_t)((x = mix(x)) % (uint64_t)(n - a + 1));
    ckpt_chunk_t q = {"adam_m", s->name, s->rows, s->cols, r0, r1, c0, c1, a, b, NULL};
    int rc = ckpt_read(ck, &q, out, err, sizeof err);
    if (rc) printf("%s\n", err);
    assert_int_equal(rc, 0);
    for (int64_t f = a; f < b; f++) {
      float want = value("adam_m", s->name, 5, r0 + f / (c1 - c0), c0 + f % (c1 - c0));
      if (memcmp(&out[f - a], &want, sizeof want)) {
        printf("%s (%ld..%ld, %ld..%ld) [%ld, %ld) element %ld differs\n", s->name, (long)r0, (long)r1, (long)c0,
               (long)c1, (long)a, (long)b, (long)f);
        fail();
      }
    }
  }
  /* Absent tensor, wrong full shape, bad region. */
  ckpt_chunk_t q = {"param", "nope.weight", 2, 2, 0, 2, 0, 2, 0, 4, NULL};
  assert_int_equal(ckpt_read(ck, &q, out, err, sizeof err), CKPT_ENOENT);
  assert_false(ckpt_has(ck, "param", "nope.weight"));
  assert_true(ckpt_has(ck, "param", "output.weight"));
  q = (ckpt_chunk_t){"param", "output.weight", V, C + 1, 0, 1, 0, 1, 0, 1, NULL};
  assert_int_equal(ckpt_read(ck, &q, out, err, sizeof err), CKPT_ESHAPE);
  assert_non_null(strstr(err, "output.weight"));
  q = (ckpt_chunk_t){"param", "output.weight", V, C, 0, 1, 0, 1, 0, 2, NULL};
  assert_int_equal(ckpt_read(ck, &q, out, err, sizeof err), CKPT_EINVAL);
  free(out);
  ckpt_close(ck);
}

/* Whole tensors by name and size (what `trainer sample` reads), saved as fsdp3 x tp2 chunks:
 * every tensor equal to the value function, bit for bit; a wrong size or name refused. */
static void test_read_whole_tensors(void **state) {
  assert_int_equal(save((save_t){.S = 3, .T = 2, .steps = {7}, .n_steps = 1}), 0);
  ckpt_t *ck = open_auto("auto", 7);
  char err[512];
  float *out = malloc(V * H * sizeof *out);
  for (int i = 0; i < NT; i++) {
    const spec_t *s = &SPECS[i];
    int rc = ckpt_read_tensor(ck, "param", s->name, out, (size_t)s->rows * (size_t)s->cols, err, sizeof err);
    if (rc) printf("%s\n", err);
    assert_int_equal(rc, 0);
    int differ = 0;
    for (int64_t f = 0; f < (int64_t)s->rows * s->cols; f++) {
      float want = value("param", s->name, 7, f / s->cols, f % s->cols);
      differ += memcmp(&out[f], &want, sizeof want) != 0;
    }
    if (differ) printf("%s: %d of %d elements differ (want 0)\n", s->name, differ, s->rows * s->cols);
    assert_int_equal(differ, 0);
  }
  assert_int_equal(ckpt_read_tensor(ck, "param", "output.weight", out, V * C - 1, err, sizeof err), CKPT_ESHAPE);
  assert_non_null(strstr(err, "output.weight"));
  assert_int_equal(ckpt_read_tensor(ck, "param", "nope.weight", out, 4, err, sizeof err), CKPT_ENOENT);
  assert_int_equal(ckpt_read_tensor(ck, "adam_v", "output.weight", out, V * C, err, sizeof err), CKPT_ENOENT);
  free(out);
  ckpt_close(ck);
}

/* Verification and selection run collectively: 3 ranks open, each checks its own layout. */
typedef struct {
  int64_t want;
  const char *note;
} gopen_t;
static int group_open_rank(rank_ctx_t *r) {
  gopen_t *a = r->arg;
  ckpt_t *ck = NULL;
  int rc = ckpt_open(&ck, root, "auto", &SHAPE, r->g, r->err, sizeof r->err);
  if (rc) return rc;
  if (ckpt_meta(ck)->state.step != a->want || (a->note && !strstr(ckpt_meta(ck)->notes, a->note))) rc = -100;
  model_tensor_t ts[NT];
  size_t n = layout(ts, 1), off, cnt;
  shard_range(n, r->size, r->rank, &off, &cnt);
  float *want = local_values(ts, n, 0, "param", a->want), *got = malloc((cnt + 1) * sizeof *got);
  if (!rc) rc = ckpt_read_range(ck, "param", ts, NT, 0, off, cnt, got, r->err, sizeof r->err);
  if (!rc && memcmp(got, want + off, cnt * sizeof *got)) rc = -101;
  free(want);
  free(got);
  ckpt_close(ck);
  return rc;
}

static void corrupt_byte(const char *rel, long at) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", root, rel);
  FILE *f = fopen(p, "r+b");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  if (at < 0) at = len + at;
  fseek(f, at, SEEK_SET);
  int c = fgetc(f);
  fseek(f, at, SEEK_SET);
  fputc(c ^ 0x10, f);
  fclose(f);
}

static void test_truncated_shard_falls_back(void **state) {
  assert_int_equal(save((save_t){.S = 4, .steps = {10, 20}, .n_steps = 2}), 0);
  char p[512];
  snprintf(p, sizeof p, "%s/step-20/shard-1.safetensors", root);
  struct stat sb;
  assert_int_equal(stat(p, &sb), 0);
  assert_int_equal(truncate(p, sb.st_size - 100), 0);
  ckpt_t *ck = open_auto("auto", 10);
  printf("notes: %s", ckpt_meta(ck)->notes);
  assert_non_null(strstr(ckpt_meta(ck)->notes, "step-20/shard-1.safetensors: size mismatch"));
  assert_non_null(strstr(ckpt_meta(ck)->notes, "falling back to step-10"));
  assert_int_equal(check_layout(ck, 2, 1, 10, 2), 0);
  ckpt_close(ck);
  /* Named explicitly: no fallback, the file named. */
  char err[2048];
  assert_int_equal(ckpt_open(&ck, root, "step-20", &SHAPE, NULL, err, sizeof err), CKPT_ECORRUPT);
  assert_null(ck);
  assert_non_null(strstr(err, "shard-1.safetensors"));
}

static void test_flipped_byte_falls_back(void **state) {
  assert_int_equal(save((save_t){.S = 4, .steps = {10, 20}, .n_steps = 2}), 0);
  corrupt_byte("step-20/shard-2.safetensors", -7); /* in the tensor data */
  ckpt_t *ck = open_auto("auto", 10);
  printf("notes: %s", ckpt_meta(ck)->notes);
  assert_non_null(strstr(ckpt_meta(ck)->notes, "step-20/shard-2.safetensors: checksum mismatch (expected 0x"));
  ckpt_close(ck);
  /* The same decision on 3 ranks that each verify a third of the files. */
  gopen_t a = {10, "shard-2.safetensors: checksum mismatch"};
  int rc = run_ranks(3, group_open_rank, &a);
  for (int i = 0; i < 3; i++)
    if (ranks[i].rc) printf("rank %d: %d %s\n", i, ranks[i].rc, ranks[i].err);
  assert_int_equal(rc, 0);
  /* Header damage is a checksum failure too; both damaged: none intact, every file named. */
  corrupt_byte("step-10/shard-0.safetensors", 12);
  char err[4096];
  assert_int_equal(ckpt_open(&ck, root, "auto", &SHAPE, NULL, err, sizeof err), CKPT_ECORRUPT);
  printf("%s", err);
  assert_non_null(strstr(err, "step-20/shard-2.safetensors"));
  assert_non_null(strstr(err, "step-10/shard-0.safetensors"));
}

/* Every rank opens auto through the group and must get CKPT_ENONFINITE with a message holding arg. */
static int group_nonfinite_rank(rank_ctx_t *r) {
  ckpt_t *ck = NULL;
  int rc = ckpt_open(&ck, root, "auto", &SHAPE, r->g, r->err, sizeof r->err);
  ckpt_close(ck);
  return rc == CKPT_ENONFINITE && strstr(r->err, r->arg) ? 0 : rc ? rc : -100;
}

/* A NaN in an AdamW moment, in a tensor split by columns under tp 2 and cut mid-row by FSDP (wo:
 * (12, 12), element (7, 9) in tp rank 1's columns) refuses a checkpoint whose files are intact,
 * naming the element by its index in the full tensor (7 * 12 + 9). The run saved it so: auto does
 * not fall back to step-10 (it names it), an explicit step-20 is refused alike, and step-10 named
 * opens. On 3 ranks that each scan a third of the four files, every rank gets the same verdict. */
static void test_nonfinite_refused_without_fallback(void **state) {
  assert_int_equal(save((save_t){.S = 2, .T = 2, .nkinds = 3, .steps = {10, 20}, .n_steps = 2, .poison_step = 20,
                                 .poison_kind = 2, .poison_tensor = 3, .poison_r = 7, .poison_c = 9, .poison = NAN}),
                   0);
  char want[256], err[2048];
  snprintf(want, sizeof want, "step-20: tensor adam_v/layers.0.attention.wo.weight element %d is nan (not a finite "
           "number)", 7 * C + 9);
  ckpt_t *ck = NULL;
  assert_int_equal(ckpt_open(&ck, root, "auto", &SHAPE, NULL, err, sizeof err), CKPT_ENONFINITE);
  printf("  auto: %s\n", err);
  assert_null(ck);
  assert_non_null(strstr(err, want));
  assert_non_null(strstr(err, "does not fall back to step-10"));
  assert_int_equal(ckpt_open(&ck, root, "step-20", &SHAPE, NULL, err, sizeof err), CKPT_ENONFINITE);
  printf("  step-20: %s\n", err);
  assert_non_null(strstr(err, want));
  assert_null(strstr(err, "fall back"));
  ck = NULL;
  assert_int_equal(ckpt_open(&ck, root, "step-10", &SHAPE, NULL, err, sizeof err), 0);
  assert_int_equal(check_layout(ck, 3, 1, 10, 3), 0);
  ckpt_close(ck);
  int rc = run_ranks(3, group_nonfinite_rank, want);
  for (int i = 0; i < 3; i++)
    if (ranks[i].rc) printf("  rank %d: %d %s\n", i, ranks[i].rc, ranks[i].err);
  assert_int_equal(rc, 0);
  /* an infinity in a parameter, a 1-D tensor replicated across tp (saved by tp rank 0) */
  assert_int_equal(save((save_t){.S = 2, .T = 2, .steps = {30}, .n_steps = 1, .poison_step = 30, .poison_kind = 0,
                                 .poison_tensor = 7, .poison_r = 11, .poison = -INFINITY}),
                   0);
  assert_int_equal(ckpt_open(&ck, root, "step-30", &SHAPE, NULL, err, sizeof err), CKPT_ENONFINITE);
  printf("  step-30: %s\n", err);
  assert_non_null(strstr(err, "tensor param/norm.weight element 11 is -inf (not a finite number)"));
}

static void test_wrong_shape_refused(void **state) {
  assert_int_equal(save((save_t){.S = 2, .steps = {10}, .n_steps = 1}), 0);
  ckpt_shape_t other = SHAPE;
  other.hidden_dim = 64;
  ckpt_t *ck = NULL;
  char err[1024];
  assert_int_equal(ckpt_open(&ck, root, "auto", &other, NULL, err, sizeof err), CKPT_ESHAPE);
  printf("%s\n", err);
  assert_null(ck);
  assert_non_null(strstr(err, "model.hidden_dim is 20 there but 64"));
  /* A corrupt newer checkpoint does not hide the refusal either. */
  assert_int_equal(save((save_t){.S = 2, .steps = {20}, .n_steps = 1}), 0);
  corrupt_byte("step-20/shard-0.safetensors", -1);
  other = SHAPE;
  other.dim = 16;
  assert_int_equal(ckpt_open(&ck, root, "auto", &other, NULL, err, sizeof err), CKPT_ESHAPE);
  assert_non_null(strstr(err, "model.dim"));
}

typedef struct {
  const char *point;
} hook_t;
static int crash_at(const char *point, int64_t step, void *arg) { return !strcmp(point, ((hook_t *)arg)->point); }

static void test_crash_during_save_keeps_previous(void **state) {
  static const char *points[] = {"before_commit", "before_rename", "before_latest"};
  assert_int_equal(save((save_t){.S = 2, .T = 2, .steps = {10}, .n_steps = 1}), 0);
  for (int i = 0; i < 3; i++) {
    hook_t h = {points[i]};
    int rc = save((save_t){.S = 2, .T = 2, .steps = {20}, .n_steps = 1, .hook = crash_at, .hook_arg = &h});
    assert_int_not_equal(rc, 0);
    for (int r = 0; r < 4; r++) { /* every rank fails, with rank 0's reason */
      assert_int_not_equal(ranks[r].rc, 0);
      assert_non_null(strstr(ranks[r].err, points[i]));
    }
    char latest[64];
    read_latest(latest, sizeof latest);
    assert_string_equal(latest, "step-10\n");
    assert_int_equal(exists("step-20"), i == 2); /* renamed only in the last case */
    assert_int_equal(exists("step-20.tmp"), i < 2);
    ckpt_t *ck = open_auto("auto", 10);
    assert_int_equal(check_layout(ck, 3, 1, 10, 2), 0);
    ckpt_close(ck);
  }
  /* The next save cleans leftovers and replaces the step-20 that `latest` never named. */
  hook_t h = {"before_rename"};
  assert_int_not_equal(save((save_t){.S = 2, .T = 2, .steps = {30}, .n_steps = 1, .hook = crash_at, .hook_arg = &h}), 0);
  assert_int_not_equal(count_tmp(), 0);
  assert_int_equal(save((save_t){.S = 2, .T = 2, .steps = {20}, .n_steps = 1}), 0);
  assert_int_equal(count_tmp(), 0);
  expect_layouts(20, 2);
}

static void test_failing_rank_fails_everyone(void **state) {
  assert_int_equal(save((save_t){.S = 4, .steps = {10}, .n_steps = 1, .bad_rank = 2}), CKPT_EINVAL);
  for (int r = 0; r < 4; r++) assert_non_null(strstr(ranks[r].err, "rank 2 chunk 0"));
  assert_false(exists("step-10"));
  assert_false(exists("latest"));
  ckpt_t *ck = NULL;
  char err[512];
  assert_int_equal(ckpt_open(&ck, root, "auto", &SHAPE, NULL, err, sizeof err), CKPT_ENOENT);
}

/* A rank that saved nothing leaves a hole: the save is refused, naming a tensor. */
static void test_incomplete_save_refused(void **state) {
  assert_int_equal(save((save_t){.S = 4, .steps = {10}, .n_steps = 1, .drop_rank = 3}), CKPT_ECORRUPT);
  for (int r = 0; r < 4; r++) assert_non_null(strstr(ranks[r].err, "the saved chunks hold"));
  printf("%s\n", ranks[1].err);
  assert_false(exists("step-10"));
}

/* A rank that could not collect its state (n_chunks -1) fails the save on every rank, naming
 * itself, even when the others' chunks would pass the coverage check: with S = 1 and R = 2
 * replica 1 holds the same values as replica 0, so saving nothing would leave no hole. */
static void test_rank_without_state_fails_everyone(void **state) {
  assert_int_equal(save((save_t){.R = 2, .steps = {10}, .n_steps = 1, .drop_rank = 1}), 0);
  assert_true(exists("step-10"));
  assert_int_equal(save((save_t){.R = 2, .steps = {20}, .n_steps = 1, .fail_rank = 1}), CKPT_EINVAL);
  for (int r = 0; r < 2; r++) {
    printf("  rank %d: %s\n", r, ranks[r].err);
    assert_non_null(strstr(ranks[r].err, "rank 1 could not collect its state for step 20"));
  }
  assert_false(exists("step-20"));
  char latest[64];
  read_latest(latest, sizeof latest);
  assert_string_equal(latest, "step-10\n");
}

static void test_keep_and_abandoned_timeline(void **state) {
  assert_int_equal(save((save_t){.S = 2, .steps = {10, 20, 30}, .n_steps = 3, .keep = 2}), 0);
  assert_false(exists("step-10"));
  assert_true(exists("step-20"));
  assert_true(exists("step-30"));
  char latest[64];
  read_latest(latest, sizeof latest);
  assert_string_equal(latest, "step-30\n");
  /* Resumed from step-20 (say step-30 was bad): saving step 25 ends the old timeline. */
  assert_int_equal(save((save_t){.S = 2, .steps = {25}, .n_steps = 1, .keep = 2}), 0);
  assert_false(exists("step-30"));
  assert_true(exists("step-20"));
  assert_true(exists("step-25"));
  expect_layouts(25, 2);
}

static void test_async_equals_sync(void **state) {
  char sync_dir[300], async_dir[300];
  snprintf(sync_dir, sizeof sync_dir, "%s/sync", root);
  snprintf(async_dir, sizeof async_dir, "%s/async", root);
  assert_int_equal(save((save_t){.dir = sync_dir, .S = 2, .T = 2, .steps = {10, 20}, .n_steps = 2}), 0);
  assert_int_equal(
      save((save_t){.dir = async_dir, .S = 2, .T = 2, .steps = {10, 20}, .n_steps = 2, .async = 1, .scribble = 1}), 0);
  for (int r = 0; r < 4; r++) {
    char a[320], b[320];
    size_t la, lb;
    snprintf(a, sizeof a, "sync/step-20/shard-%d.safetensors", r);
    snprintf(b, sizeof b, "async/step-20/shard-%d.safetensors", r);
    unsigned char *x = slurp(a, &la), *y = slurp(b, &lb);
    assert_int_equal(la, lb);
    assert_memory_equal(x, y, la);
    free(x);
    free(y);
  }
  ckpt_t *ck = NULL;
  char err[1024];
  assert_int_equal(ckpt_open(&ck, async_dir, "auto", &SHAPE, NULL, err, sizeof err), 0);
  assert_int_equal(ckpt_meta(ck)->state.step, 20);
  assert_int_equal(check_layout(ck, 1, 1, 20, 2), 0);
  ckpt_close(ck);
}

/* Async with poll: committed only once every rank's writer is done, and `latest` follows. */
static int poll_rank(rank_ctx_t *r) {
  model_tensor_t ts[NT];
  size_t n = layout(ts, 1), off, cnt;
  shard_range(n, r->size, r->rank, &off, &cnt);
  ckpt_writer_config_t cfg = {.dir = root, .keep = 3, .async = 1, .group = r->g, .shape = SHAPE};
  ckpt_writer_t *w = NULL;
  int rc = ckpt_writer_create(&w, &cfg, r->err, sizeof r->err);
  float *vals = local_values(ts, n, 0, "param", 7);
  ckpt_chunks_t cs = {0};
  ckpt_chunks_add_range(&cs, "param", ts, NT, 0, off, cnt, vals + off);
  ckpt_state_t st = {.step = 7};
  if (!rc) rc = ckpt_writer_save(w, &st, cs.v, cs.n, r->err, sizeof r->err);
  memset(vals, 0, n * sizeof *vals); /* the writer works from its own copy */
  int64_t committed = -1;
  int polls = 0;
  while (!rc && committed < 0 && polls < 1000000) {
    rc = ckpt_writer_poll(w, &committed, r->err, sizeof r->err);
    polls++;
  }
  if (!rc && committed != 7) rc = -200;
  /* Nothing in flight: poll is a no-op. */
  if (!rc) rc = ckpt_writer_poll(w, &committed, r->err, sizeof r->err);
  if (!rc && committed != -1) rc = -201;
  ckpt_chunks_free(&cs);
  free(vals);
  ckpt_writer_destroy(w);
  return rc;
}

static void test_async_poll(void **state) {
  int rc = run_ranks(3, poll_rank, NULL);
  for (int i = 0; i < 3; i++)
    if (ranks[i].rc) printf("rank %d: %d %s\n", i, ranks[i].rc, ranks[i].err);
  assert_int_equal(rc, 0);
  char latest[64];
  read_latest(latest, sizeof latest);
  assert_string_equal(latest, "step-7\n");
  ckpt_t *ck = open_auto("auto", 7);
  assert_int_equal(check_layout(ck, 2, 2, 7, 1), 0);
  ckpt_close(ck);
}

static void test_metadata_round_trip(void **state) {
  ckpt_writer_config_t cfg = {.dir = root, .keep = 0, .shape = SHAPE, .mesh = {1, 1, 1},
                              .plan_json = "{\"seed\":7,\"model\":{\"dim\":12}}"};
  ckpt_writer_t *w = NULL;
  char err[1024];
  assert_int_equal(ckpt_writer_create(&w, &cfg, err, sizeof err), 0);
  ckpt_state_t st = {.step = 123, .optim_step = 120, .data_position = 0x8000000000000005ull, .n_rng = 3,
                     .rng = {UINT64_MAX, 0, 0x0123456789ABCDEFull}};
  assert_int_equal(ckpt_state_set(&st, "loss", "1.25"), 0);
  assert_int_equal(ckpt_state_set(&st, "tokens", "4096"), 0);
  assert_int_equal(ckpt_state_set(&st, "loss", "1.5"), 0); /* replaced */
  assert_int_equal(ckpt_writer_save(w, &st, NULL, 0, err, sizeof err), 0);
  ckpt_writer_destroy(w);
  ckpt_t *ck = NULL;
  assert_int_equal(ckpt_open(&ck, root, NULL, &SHAPE, NULL, err, sizeof err), 0);
  const ckpt_meta_t *m = ckpt_meta(ck);
  assert_int_equal(m->version, CKPT_FORMAT_VERSION);
  assert_int_equal(m->state.step, 123);
  assert_int_equal(m->state.optim_step, 120);
  assert_true(m->state.data_position == 0x8000000000000005ull);
  assert_int_equal(m->state.n_rng, 3);
  assert_true(m->state.rng[0] == UINT64_MAX && m->state.rng[1] == 0 && m->state.rng[2] == 0x0123456789ABCDEFull);
  assert_int_equal(m->state.n_extra, 2);
  assert_string_equal(ckpt_state_get(&m->state, "loss"), "1.5");
  assert_string_equal(ckpt_state_get(&m->state, "tokens"), "4096");
  assert_null(ckpt_state_get(&m->state, "absent"));
  assert_memory_equal(&m->shape, &SHAPE, sizeof SHAPE);
  assert_int_equal(m->world_size, 1);
  assert_int_equal(m->mesh[2], 1);
  assert_string_equal(m->plan_json, "{\"seed\":7,\"model\":{\"dim\":12}}");
  assert_non_null(strstr(m->path, "step-123"));
  assert_string_equal(m->notes, "");
  ckpt_close(ck);
  /* A full extra table is refused, not overflowed. */
  ckpt_state_t full = {0};
  for (int i = 0; i < CKPT_EXTRA_MAX; i++) {
    char k[16];
    snprintf(k, sizeof k, "k%d", i);
    assert_int_equal(ckpt_state_set(&full, k, "v"), 0);
  }
  assert_int_equal(ckpt_state_set(&full, "one-more", "v"), CKPT_EINVAL);
}

/* metadata.json opens with its own CRC32C: every one-bit flip anywhere in it is refused (CRC32C
 * catches all of them; a flip in the checksum's own digits is a mismatch or no checksum), and
 * "auto" falls back past a tampered one, naming the file. */
static void test_metadata_checksum(void **state) {
  assert_int_equal(save((save_t){.S = 2, .steps = {10, 20}, .n_steps = 2}), 0);
  size_t len;
  unsigned char *orig = slurp("step-20/metadata.json", &len);
  assert_true(len > 64);
  char first[40];
  snprintf(first, sizeof first, "%.*s", 31, (const char *)orig);
  printf("  first line: %s\n", first);
  assert_memory_equal(orig, "{\"metadata_crc32c\": \"0x", 22);
  char p[512], err[2048];
  snprintf(p, sizeof p, "%s/step-20/metadata.json", root);
  ckpt_t *ck = NULL;
  int missed = 0;
  for (size_t at = 0; at < len; at++)
    for (int bit = 0; bit < 8; bit += 3) { /* bits 0, 3, 6 of every byte */
      orig[at] ^= (unsigned char)(1u << bit);
      testfile_write(p, orig, len);
      orig[at] ^= (unsigned char)(1u << bit);
      int rc = ckpt_open(&ck, root, "step-20", &SHAPE, NULL, err, sizeof err);
      if (rc != CKPT_ECORRUPT || !strstr(err, "step-20/metadata.json")) {
        printf("  byte %zu bit %d: rc %d (%s)\n", at, bit, rc, rc ? err : "opened");
        missed++;
      }
      ckpt_close(ck);
      ck = NULL;
    }
  printf("  %zu one-bit flips of metadata.json, %d accepted (want 0)\n", len * 3, missed);
  assert_int_equal(missed, 0);
  /* A tampered optim_step (20 -> 21, one bit): auto falls back to step-10, naming the file. */
  char *txt = (char *)orig, *at = strstr(txt, "\"optim_step\":\t20,");
  assert_non_null(at);
  at[strlen("\"optim_step\":\t21") - 1] = '1';
  testfile_write(p, orig, len);
  ck = open_auto("auto", 10);
  printf("  notes: %s", ckpt_meta(ck)->notes);
  assert_non_null(strstr(ckpt_meta(ck)->notes, "step-20/metadata.json: checksum mismatch (expected 0x"));
  assert_non_null(strstr(ckpt_meta(ck)->notes, "falling back to step-10"));
  ckpt_close(ck);
  /* A version-1 file (no checksum line) is named as such. */
  at[strlen("\"optim_step\":\t21") - 1] = '0';
  char *v1 = malloc(len + 8);
  size_t head = strlen("{\"metadata_crc32c\": \"0x12345678\",");
  snprintf(v1, len + 8, "{%s", txt + head);
  char *ver = strstr(v1, "\"version\":\t2");
  assert_non_null(ver);
  ver[strlen("\"version\":\t2") - 1] = '1';
  testfile_write(p, v1, strlen(v1));
  assert_int_equal(ckpt_open(&ck, root, "step-20", &SHAPE, NULL, err, sizeof err), CKPT_ECORRUPT);
  printf("  %s\n", err);
  assert_non_null(strstr(err, "step-20/metadata.json: format version 1 has no metadata checksum"));
  /* The same without the version: damage, not an old format. */
  ver[strlen("\"version\":\t2") - 1] = '2';
  testfile_write(p, v1, strlen(v1));
  assert_int_equal(ckpt_open(&ck, root, "step-20", &SHAPE, NULL, err, sizeof err), CKPT_ECORRUPT);
  assert_non_null(strstr(err, "no metadata checksum on its first line"));
  free(v1);
  free(orig);
}

static int count_in_dir(const char *rel, const char *part) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", root, rel);
  DIR *d = opendir(p);
  if (!d) return -1;
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d)))
    if (strstr(e->d_name, part)) n++;
  closedir(d);
  return n;
}

/* A shard write that fails on one rank fails the save on every rank, with that rank's cause;
 * its .tmp is removed; the writer saves the next step. A lack of space on any rank wins over
 * other errors (it is what the trainer stops on). */
static void test_failed_write_fails_everyone_and_cleans_up(void **state) {
  for (int async = 0; async <= 1; async++) {
    assert_int_equal(save((save_t){.S = 4, .steps = {10}, .n_steps = 1, .async = async}), 0);
    int rc = save((save_t){.S = 4, .steps = {20, 30}, .n_steps = 2, .async = async, .go_on = 1, .fault_step = 20,
                           .fault_err = {[1] = EIO}});
    assert_int_equal(rc, CKPT_EIO);
    for (int r = 0; r < 4; r++) {
      assert_int_equal(ranks[r].rc, CKPT_EIO);
      assert_non_null(strstr(ranks[r].err, "step-20.tmp/shard-1.safetensors: Input/output error"));
    }
    printf("  %s: %s\n", async ? "async" : "sync", ranks[0].err);
    assert_false(exists("step-20"));
    assert_int_equal(count_in_dir("", ".tmp"), 0);
    char latest[64];
    read_latest(latest, sizeof latest);
    assert_string_equal(latest, "step-30\n"); /* the same writers saved the next step */
    expect_layouts(30, 2);
    /* EIO on rank 1, no space on rank 3: every rank reports the lack of space. */
    rc = save((save_t){.S = 4, .steps = {40}, .n_steps = 1, .async = async, .fault_step = 40,
                       .fault_err = {[1] = EIO, [3] = ENOSPC}});
    assert_int_equal(rc, CKPT_ENOSPC);
    for (int r = 0; r < 4; r++) {
      assert_int_equal(ranks[r].rc, CKPT_ENOSPC);
      assert_non_null(strstr(ranks[r].err, "shard-3.safetensors: No space left on device"));
    }
    assert_false(exists("step-40"));
    assert_int_equal(count_in_dir("", ".tmp"), 0);
    assert_true(ckpt_msg_is_nospace(ranks[0].err));
    assert_false(ckpt_msg_is_nospace("checkpoint error: write x: Input/output error"));
    assert_string_equal(ckpt_strerror(CKPT_ENOSPC), "no space left on device");
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s/step-* %s/latest", root, root);
    assert_int_equal(system(cmd), 0);
  }
}

static void test_no_checkpoint(void **state) {
  ckpt_t *ck = NULL;
  char err[1024], p[400];
  assert_int_equal(ckpt_open(&ck, root, "auto", &SHAPE, NULL, err, sizeof err), CKPT_ENOENT);
  snprintf(p, sizeof p, "%s/absent", root);
  assert_int_equal(ckpt_open(&ck, p, "auto", &SHAPE, NULL, err, sizeof err), CKPT_ENOENT);
  assert_int_equal(ckpt_open(&ck, root, "step-5", &SHAPE, NULL, err, sizeof err), CKPT_ENOENT);
  assert_non_null(strstr(err, "step-5"));
  /* Leftover temporary directories are never loaded. */
  snprintf(p, sizeof p, "%s/step-50.tmp", root);
  assert_int_equal(mkdir(p, 0755), 0);
  assert_int_equal(ckpt_open(&ck, root, "auto", &SHAPE, NULL, err, sizeof err), CKPT_ENOENT);
  assert_null(ck);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_crc32c),
      cmocka_unit_test_setup_teardown(test_fsdp4_loads_under_other_layouts, setup, teardown),
      cmocka_unit_test_setup_teardown(test_tp2_loads_as_fsdp, setup, teardown),
      cmocka_unit_test_setup_teardown(test_2d_8_ranks_load_on_6, setup, teardown),
      cmocka_unit_test_setup_teardown(test_serial_save, setup, teardown),
      cmocka_unit_test_setup_teardown(test_replicas_deduplicated, setup, teardown),
      cmocka_unit_test_setup_teardown(test_random_regions, setup, teardown),
      cmocka_unit_test_setup_teardown(test_read_whole_tensors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_truncated_shard_falls_back, setup, teardown),
      cmocka_unit_test_setup_teardown(test_flipped_byte_falls_back, setup, teardown),
      cmocka_unit_test_setup_teardown(test_nonfinite_refused_without_fallback, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wrong_shape_refused, setup, teardown),
      cmocka_unit_test_setup_teardown(test_crash_during_save_keeps_previous, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failing_rank_fails_everyone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_incomplete_save_refused, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rank_without_state_fails_everyone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_keep_and_abandoned_timeline, setup, teardown),
      cmocka_unit_test_setup_teardown(test_async_equals_sync, setup, teardown),
      cmocka_unit_test_setup_teardown(test_async_poll, setup, teardown),
      cmocka_unit_test_setup_teardown(test_metadata_round_trip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_no_checkpoint, setup, teardown),
      cmocka_unit_test_setup_teardown(test_metadata_checksum, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_write_fails_everyone_and_cleans_up, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
