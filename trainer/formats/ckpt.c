/* ckpt: the checkpoint writer (shards, metadata, atomic commit, retention, async thread) and the
 * reader (candidate selection with fallback, distributed verification, a chunk index, region
 * assembly). The protocol and the file layout are described in ckpt.h.
 *
 * Collectives go through ckpt_group_t and carry only small fixed-size records (a rank's status,
 * its file's size and CRC, a message), never tensor data: shards are written and read from the
 * shared filesystem. Every collective is reached by every rank on every path, including error
 * paths: a rank that fails locally keeps going through the remaining collectives with its error
 * in its record, so the ranks fail together instead of hanging.
 *
 * The reader keeps every shard file mapped (safetensors.h) and an index of all chunks sorted by
 * (kind, name, position); a read walks only the chunks of one tensor and, per chunk, only the
 * rows both it and the request cover, copying row spans with memcpy (one memcpy when both are
 * full-width, i.e. contiguous in the full tensor). It does not cache assembled tensors. Values
 * are checked once, when a checkpoint opens (every chunk, split across the ranks like the CRCs,
 * which read the same bytes just before), not on every read: the verdict is then shared, so every
 * rank refuses a diverged checkpoint together instead of one rank failing alone mid-load. */
#include "trainer/formats/ckpt.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/fs.h"
#include "common/log.h"
#include "trainer/formats/safetensors.h"

#define CKPT_PATH 4096
#define CKPT_MSG 240          /* message carried in a collective record */
#define CKPT_MAX_CANDIDATES 255
#define CKPT_FORMAT_NAME "meshrun-checkpoint"
#define CKPT_CHUNKS_KEY "meshrun.chunks"
/* metadata.json opens with its own checksum: META_CRC_HEAD, 8 lowercase hex digits, "\",". The
 * CRC covers every byte after that (the rest of the document). */
#define META_CRC_HEAD "{\"metadata_crc32c\": \"0x"
#define META_CRC_LEN (sizeof META_CRC_HEAD - 1 + 8 + 2)

/* The code of a failed system call: a lack of space is told apart (callers stop on it rather
 * than retry), everything else is an i/o error. */
static int io_code(int e) { return e == ENOSPC || e == EDQUOT ? CKPT_ENOSPC : CKPT_EIO; }

int ckpt_msg_is_nospace(const char *msg) {
  return msg && (strstr(msg, strerror(ENOSPC)) || strstr(msg, strerror(EDQUOT)));
}

/* snprintf for paths; the limits are checked where directories enter (ckpt_writer_create,
 * ckpt_open), so a longer result only truncates a message. */
static void pathf(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void pathf(char *out, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out, n, fmt, ap);
  va_end(ap);
}

const char *ckpt_strerror(int code) {
  switch (code) {
  case CKPT_OK: return "ok";
  case CKPT_EINVAL: return "invalid argument";
  case CKPT_EIO: return "i/o error";
  case CKPT_ECORRUPT: return "corrupt checkpoint";
  case CKPT_ESHAPE: return "shape mismatch";
  case CKPT_ENOENT: return "no checkpoint";
  case CKPT_ENOMEM: return "out of memory";
  case CKPT_ECOMM: return "collective failed";
  case CKPT_ENOSPC: return "no space left on device";
  case CKPT_ENONFINITE: return "non-finite value";
  default: return "unknown error";
  }
}

/* --- CRC32C. The hardware instruction (SSE4.2, in x86-64-v2) does 8 bytes per step; the
 * table version does the same polynomial (reflected 0x82F63B78) a byte at a time via 8 tables. */

static uint32_t crc_tab[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init_tables(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    crc_tab[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      crc_tab[t][i] = (crc_tab[t - 1][i] >> 8) ^ crc_tab[0][crc_tab[t - 1][i] & 0xff];
}

uint32_t ckpt_crc32c_portable(uint32_t crc, const void *buf, size_t len) {
  pthread_once(&crc_once, crc_init_tables);
  const unsigned char *p = buf;
  uint32_t c = ~crc;
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    w ^= c;
    c = crc_tab[7][w & 0xff] ^ crc_tab[6][(w >> 8) & 0xff] ^ crc_tab[5][(w >> 16) & 0xff] ^
        crc_tab[4][(w >> 24) & 0xff] ^ crc_tab[3][(w >> 32) & 0xff] ^ crc_tab[2][(w >> 40) & 0xff] ^
        crc_tab[1][(w >> 48) & 0xff] ^ crc_tab[0][w >> 56];
    p += 8;
    len -= 8;
  }
  while (len--)
    c = (c >> 8) ^ crc_tab[0][(c ^ *p++) & 0xff];
  return ~c;
}

uint32_t ckpt_crc32c(uint32_t crc, const void *buf, size_t len) {
#if defined(__SSE4_2__) && defined(__x86_64__)
  const unsigned char *p = buf;
  uint64_t c = (uint32_t)~crc;
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c = __builtin_ia32_crc32di(c, w);
    p += 8;
    len -= 8;
  }
  uint32_t c32 = (uint32_t)c;
  while (len--)
    c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
#else
  return ckpt_crc32c_portable(crc, buf, len);
#endif
}

/* --- small helpers */

void ckpt_shape_from_plan(ckpt_shape_t *s, const plan_model_t *m) {
  s->dim = m->dim;
  s->n_layers = m->n_layers;
  s->n_heads = m->n_heads;
  s->n_kv_heads = m->n_kv_heads;
  s->vocab_size = m->vocab_size;
  s->hidden_dim = m->hidden_dim;
}

int ckpt_state_set(ckpt_state_t *s, const char *key, const char *value) {
  if (!s || !key || !*key || !value) return CKPT_EINVAL;
  int i = 0;
  while (i < s->n_extra && strcmp(s->extra_key[i], key)) i++;
  if (i == s->n_extra) {
    if (s->n_extra == CKPT_EXTRA_MAX) return CKPT_EINVAL;
    s->n_extra++;
  }
  snprintf(s->extra_key[i], CKPT_KEY_MAX, "%s", key);
  snprintf(s->extra_val[i], CKPT_VAL_MAX, "%s", value);
  return 0;
}

const char *ckpt_state_get(const ckpt_state_t *s, const char *key) {
  for (int i = 0; s && key && i < s->n_extra; i++)
    if (!strcmp(s->extra_key[i], key)) return s->extra_val[i];
  return NULL;
}

static int comm_gather_cb(void *ctx, const void *in, void *out, size_t bytes) {
  if (bytes % 4) return CKPT_EINVAL;
  return comm_all_gather(ctx, in, out, bytes / 4, DT_F32) ? CKPT_ECOMM : 0;
}

static int comm_bcast_cb(void *ctx, void *buf, size_t bytes, int root) {
  if (bytes % 4) return CKPT_EINVAL;
  return comm_broadcast(ctx, buf, bytes / 4, DT_F32, root) ? CKPT_ECOMM : 0;
}

void ckpt_group_from_comm(ckpt_group_t *g, comm_t *c) {
  memset(g, 0, sizeof *g);
  g->rank = comm_rank(c);
  g->size = comm_size(c);
  g->all_gather = comm_gather_cb;
  g->broadcast = comm_bcast_cb;
  g->ctx = c;
}

static int grp_rank(const ckpt_group_t *g) { return g ? g->rank : 0; }
static int grp_size(const ckpt_group_t *g) { return g ? g->size : 1; }

/* Every record exchanged is a multiple of 4 bytes (the comm adapter moves float32 words). */
static int grp_gather(const ckpt_group_t *g, const void *in, void *out, size_t bytes) {
  if (!g || g->size <= 1) {
    memmove(out, in, bytes);
    return 0;
  }
  return g->all_gather(g->ctx, in, out, bytes);
}

static int grp_bcast(const ckpt_group_t *g, void *buf, size_t bytes) {
  if (!g || g->size <= 1) return 0;
  return g->broadcast(g->ctx, buf, bytes, 0);
}

/* The verdict exchanged after each collective phase: one per rank. */
typedef struct {
  int32_t rc;
  uint32_t crc;
  uint64_t size;
  char msg[CKPT_MSG];
} rec_t;

/* Gathers every rank's record; the first failure in rank order becomes everyone's result. */
static int grp_verdict(const ckpt_group_t *g, const rec_t *mine, rec_t *all, char *err, size_t errlen) {
  int n = grp_size(g);
  if (grp_gather(g, mine, all, sizeof *mine))
    return err_set(err, errlen, CKPT_ECOMM, "checkpoint error: a collective of the checkpoint group failed");
  for (int i = 0; i < n; i++)
    if (all[i].rc) {
      all[i].msg[CKPT_MSG - 1] = 0;
      return err_set(err, errlen, all[i].rc, "%s", all[i].msg);
    }
  return 0;
}

/* Kinds and names: [A-Za-z0-9_.-], at most max bytes (they are words of the chunk list). */
static int valid_ident(const char *s, size_t max) {
  if (!s || !*s || strlen(s) > max) return 0;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
          *s == '.' || *s == '-'))
      return 0;
  return 1;
}

static int valid_geometry(const ckpt_chunk_t *c) {
  if (c->rows <= 0 || c->cols <= 0) return 0;
  if (c->r0 < 0 || c->r0 >= c->r1 || c->r1 > c->rows) return 0;
  if (c->c0 < 0 || c->c0 >= c->c1 || c->c1 > c->cols) return 0;
  int64_t n = (c->r1 - c->r0) * (c->c1 - c->c0);
  return c->a >= 0 && c->a <= c->b && c->b <= n;
}

static int fsync_path(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -errno;
  int rc = fsync(fd) ? -errno : 0;
  close(fd);
  return rc;
}

/* Writes text to path and fsyncs it (the caller renames or fsyncs the directory). */
static int write_durable(const char *path, const char *text, char *err, size_t errlen) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return err_set(err, errlen, io_code(errno), "checkpoint error: open %s: %s", path, strerror(errno));
  size_t len = strlen(text), done = 0;
  while (done < len) {
    ssize_t w = write(fd, text + done, len - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      close(fd);
      return err_set(err, errlen, io_code(e), "checkpoint error: write %s: %s", path, strerror(e));
    }
    done += (size_t)w;
  }
  if (fsync(fd) != 0) {
    int e = errno;
    close(fd);
    return err_set(err, errlen, io_code(e), "checkpoint error: fsync %s: %s", path, strerror(e));
  }
  if (close(fd) != 0)
    return err_set(err, errlen, io_code(errno), "checkpoint error: close %s: %s", path, strerror(errno));
  return 0;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path) ? -1 : 0;
}

static int rm_rf(const char *path) { return nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* "step-<digits>" exactly; the step in *step. */
static int parse_step_name(const char *s, int64_t *step) {
  if (strncmp(s, "step-", 5)) return 0;
  const char *d = s + 5;
  if (!*d || strlen(d) > 18) return 0;
  for (const char *p = d; *p; p++)
    if (*p < '0' || *p > '9') return 0;
  *step = strtoll(d, NULL, 10);
  return 1;
}

static int cmp_i64_desc(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* Committed checkpoint directories of dir, newest first (malloc'ed; *n = 0 when none). */
static int64_t *list_steps(const char *dir, int *n) {
  *n = 0;
  DIR *d = opendir(dir);
  if (!d) return NULL;
  int cap = 16;
  int64_t *v = malloc((size_t)cap * sizeof *v);
  struct dirent *e;
  while (v && (e = readdir(d))) {
    int64_t s;
    if (!parse_step_name(e->d_name, &s)) continue;
    char p[CKPT_PATH];
    struct stat sb;
    pathf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (stat(p, &sb) || !S_ISDIR(sb.st_mode)) continue;
    if (*n == cap) {
      cap *= 2;
      int64_t *nv = realloc(v, (size_t)cap * sizeof *v);
      if (!nv) break;
      v = nv;
    }
    v[(*n)++] = s;
  }
  closedir(d);
  if (v) qsort(v, (size_t)*n, sizeof *v, cmp_i64_desc);
  return v;
}

/* Removes leftover "*.tmp" entries of dir (from crashed saves or interrupted deletions). */
static void clean_tmp(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if (len < 4 || strcmp(e->d_name + len - 4, ".tmp") || strcmp(e->d_name, "latest.tmp") == 0) continue;
    char p[CKPT_PATH];
    pathf(p, sizeof p, "%s/%s", dir, e->d_name);
    rm_rf(p);
  }
  closedir(d);
}

/* Deletes step-<s> durably enough: renamed to *.tmp first, so a crash midway leaves nothing that
 * looks like a checkpoint. */
static void remove_step(const char *dir, int64_t s) {
  char from[CKPT_PATH], to[CKPT_PATH];
  pathf(from, sizeof from, "%s/step-%" PRId64, dir, s);
  pathf(to, sizeof to, "%s/step-%" PRId64 ".del.tmp", dir, s);
  rm_rf(to);
  if (rename(from, to) == 0)
    rm_rf(to);
  else
    log_warn("checkpoint: cannot remove %s: %s", from, strerror(errno));
}

/* --- chunks from the flat layout */

/* Where tensor t's local slice sits in the full tensor (the box) for tp rank tp_rank. */
static void tensor_box(const model_tensor_t *t, int tp_rank, int64_t *rows, int64_t *cols, int64_t box[4]) {
  int64_t s0 = t->shape[0], s1 = t->ndim == 2 ? t->shape[1] : 1;
  int64_t f0 = t->full_shape[0] > 0 ? t->full_shape[0] : s0;
  int64_t f1 = t->full_shape[1] > 0 ? t->full_shape[1] : s1;
  if (t->ndim == 1) f1 = 1;
  *rows = f0;
  *cols = f1;
  box[0] = 0, box[1] = f0, box[2] = 0, box[3] = f1;
  if (t->tp_split == MODEL_TP_ROWS) {
    box[0] = (int64_t)tp_rank * s0;
    box[1] = box[0] + s0;
  } else if (t->tp_split == MODEL_TP_COLS) {
    box[2] = (int64_t)tp_rank * s1;
    box[3] = box[2] + s1;
  }
}

int ckpt_chunks_add_range(ckpt_chunks_t *cs, const char *kind, const model_tensor_t *tensors, int n_tensors,
                          int tp_rank, size_t offset, size_t count, const float *data) {
  for (int i = 0; i < n_tensors; i++) {
    const model_tensor_t *t = &tensors[i];
    size_t lo = t->offset > offset ? t->offset : offset;
    size_t hi = t->offset + t->numel < offset + count ? t->offset + t->numel : offset + count;
    if (lo >= hi) continue;
    if (t->tp_split == MODEL_TP_REPLICATED && tp_rank != 0) continue;
    if (cs->n == cs->cap) {
      int cap = cs->cap ? 2 * cs->cap : 64;
      ckpt_chunk_t *v = realloc(cs->v, (size_t)cap * sizeof *v);
      if (!v) return CKPT_ENOMEM;
      cs->v = v;
      cs->cap = cap;
    }
    ckpt_chunk_t *c = &cs->v[cs->n++];
    int64_t box[4];
    c->kind = kind;
    c->name = t->name;
    tensor_box(t, tp_rank, &c->rows, &c->cols, box);
    c->r0 = box[0], c->r1 = box[1], c->c0 = box[2], c->c1 = box[3];
    c->a = (int64_t)(lo - t->offset);
    c->b = (int64_t)(hi - t->offset);
    c->data = data + (lo - offset);
  }
  return 0;
}

void ckpt_chunks_free(ckpt_chunks_t *cs) {
  if (!cs) return;
  free(cs->v);
  memset(cs, 0, sizeof *cs);
}

/* --- writer */

typedef struct {
  int64_t step;
  char tmpdir[CKPT_PATH]; /* <dir>/step-<N>.tmp */
  char file[CKPT_PATH];   /* <tmpdir>/shard-<rank>.safetensors */
  ckpt_state_t state;
  const ckpt_chunk_t *chunks; /* borrowed (sync) or own_chunks (async) */
  int n;
  ckpt_chunk_t *own_chunks;
  char *own_names; /* kind and name strings of own_chunks */
  float *own_data;
  pthread_t thread;
  int has_thread;
  atomic_int done;
  int (*hook)(const char *point, int64_t step, void *arg); /* the writer's, for "write" */
  void *hook_arg;
  rec_t rec; /* this rank's result: rc, size, crc, message */
} job_t;

struct ckpt_writer {
  char dir[CKPT_PATH];
  int keep, async;
  ckpt_group_t group;
  int has_group;
  ckpt_shape_t shape;
  int mesh[3];
  char *plan_json;
  int (*hook)(const char *point, int64_t step, void *arg);
  void *hook_arg;
  int hook_stopped; /* the hook stopped the current commit: a crash, so its .tmp stays */
  job_t *job;       /* in flight (async) */
};

static const ckpt_group_t *wgroup(const ckpt_writer_t *w) { return w->has_group ? &w->group : NULL; }

int ckpt_writer_create(ckpt_writer_t **out, const ckpt_writer_config_t *cfg, char *err, size_t errlen) {
  *out = NULL;
  if (!cfg || !cfg->dir || !*cfg->dir || strlen(cfg->dir) > CKPT_PATH - 64)
    return err_set(err, errlen, CKPT_EINVAL, "checkpoint error: no checkpoint directory (or a path too long)");
  if (cfg->group && (cfg->group->size < 1 || cfg->group->rank < 0 || cfg->group->rank >= cfg->group->size ||
                     (cfg->group->size > 1 && (!cfg->group->all_gather || !cfg->group->broadcast))))
    return err_set(err, errlen, CKPT_EINVAL, "checkpoint error: invalid group (rank %d of %d)", cfg->group->rank,
                cfg->group->size);
  ckpt_writer_t *w = calloc(1, sizeof *w);
  if (!w) return err_set(err, errlen, CKPT_ENOMEM, "checkpoint error: out of memory");
  snprintf(w->dir, sizeof w->dir, "%s", cfg->dir);
  size_t len = strlen(w->dir);
  while (len > 1 && w->dir[len - 1] == '/') w->dir[--len] = 0;
  w->keep = cfg->keep;
  w->async = cfg->async;
  if (cfg->group) {
    w->group = *cfg->group;
    w->has_group = 1;
  }
  w->shape = cfg->shape;
  memcpy(w->mesh, cfg->mesh, sizeof w->mesh);
  w->plan_json = strdup(cfg->plan_json ? cfg->plan_json : "");
  w->hook = cfg->hook;
  w->hook_arg = cfg->hook_arg;
  if (!w->plan_json) {
    free(w);
    return err_set(err, errlen, CKPT_ENOMEM, "checkpoint error: out of memory");
  }
  *out = w;
  return 0;
}

static void job_free(job_t *j) {
  if (!j) return;
  free(j->own_chunks);
  free(j->own_names);
  free(j->own_data);
  free(j);
}

/* Writes this rank's shard and computes its size and CRC (on the writer thread when async).
 * The CRC is taken from the file as written, read back (from the page cache). */
static void job_write(job_t *j) {
  rec_t *r = &j->rec;
  st_tensor_t *ts = calloc((size_t)j->n + 1, sizeof *ts);
  char *names = calloc((size_t)j->n + 1, 280);
  size_t cap = 4096 + (size_t)j->n * 460, len = 0;
  char *lines = malloc(cap);
  if (!ts || !names || !lines) {
    r->rc = err_set(r->msg, sizeof r->msg, CKPT_ENOMEM, "checkpoint error: %s: out of memory", j->file);
    goto done;
  }
  lines[0] = 0;
  for (int i = 0; i < j->n; i++) {
    const ckpt_chunk_t *c = &j->chunks[i];
    char *nm = names + (size_t)i * 280;
    snprintf(nm, 280, "%s/%s#%d", c->kind, c->name, i);
    ts[i].name = nm;
    ts[i].dtype = ST_F32;
    ts[i].ndim = 1;
    ts[i].shape[0] = c->b - c->a;
    ts[i].data = c->data;
    len += (size_t)snprintf(lines + len, cap - len, "%s %s %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64
                            " %" PRId64 " %" PRId64 " %" PRId64 "\n",
                            c->kind, c->name, c->rows, c->cols, c->r0, c->r1, c->c0, c->c1, c->a, c->b);
  }
  char step_txt[32];
  snprintf(step_txt, sizeof step_txt, "%" PRId64, j->step);
  const char *meta[] = {"meshrun.format", CKPT_FORMAT_NAME, "meshrun.step", step_txt, CKPT_CHUNKS_KEY, lines};
  char e[512];
  int fault = j->hook ? j->hook("write", j->step, j->hook_arg) : 0;
  if (fault) {
    r->rc = err_set(r->msg, sizeof r->msg, io_code(fault), "checkpoint error: write %s: %s (test hook)", j->file,
                 strerror(fault));
    goto done;
  }
  int rc = st_write(j->file, ts, j->n, meta, 3, e, sizeof e);
  if (rc) {
    /* st_write reports errno only as text: a lack of space is recognized by its strerror. */
    r->rc = err_set(r->msg, sizeof r->msg, rc == ST_EIO && ckpt_msg_is_nospace(e) ? CKPT_ENOSPC : CKPT_EIO,
                 "checkpoint error: %s", e);
    goto done;
  }
  int fd = open(j->file, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    r->rc = err_set(r->msg, sizeof r->msg, CKPT_EIO, "checkpoint error: open %s: %s", j->file, strerror(errno));
    goto done;
  }
  size_t bufsz = 4u << 20;
  char *buf = malloc(bufsz);
  uint32_t crc = 0;
  uint64_t size = 0;
  ssize_t got = 0;
  while (buf && (got = read(fd, buf, bufsz)) != 0) {
    if (got < 0) {
      if (errno == EINTR) continue;
      break;
    }
    crc = ckpt_crc32c(crc, buf, (size_t)got);
    size += (uint64_t)got;
  }
  int e2 = errno;
  close(fd);
  free(buf);
  if (!buf || got < 0) {
    r->rc = err_set(r->msg, sizeof r->msg, CKPT_EIO, "checkpoint error: read back %s: %s", j->file,
                 buf ? strerror(e2) : "out of memory");
    goto done;
  }
  r->crc = crc;
  r->size = size;
done:
  free(ts);
  free(names);
  free(lines);
  atomic_store(&j->done, 1);
}

static void *job_thread(void *arg) {
  job_write(arg);
  return NULL;
}

/* Collective: rank 0 makes a clean <dir>/step-<N>.tmp; everyone learns the outcome. */
static int save_prepare(ckpt_writer_t *w, int64_t step, char *err, size_t errlen) {
  rec_t r = {0};
  if (grp_rank(wgroup(w)) == 0) {
    char tmp[CKPT_PATH];
    pathf(tmp, sizeof tmp, "%s/step-%" PRId64 ".tmp", w->dir, step);
    int rc = fs_mkdir_p(w->dir, NULL, 0);
    if (rc)
      r.rc = err_set(r.msg, sizeof r.msg, io_code(-rc), "checkpoint error: mkdir %s: %s", w->dir, strerror(-rc));
    else {
      clean_tmp(w->dir);
      if (mkdir(tmp, 0755) != 0)
        r.rc = err_set(r.msg, sizeof r.msg, io_code(errno), "checkpoint error: mkdir %s: %s", tmp, strerror(errno));
    }
  }
  if (grp_bcast(wgroup(w), &r, sizeof r))
    return err_set(err, errlen, CKPT_ECOMM, "checkpoint error: a collective of the checkpoint group failed");
  if (r.rc) return err_set(err, errlen, r.rc, "%s", r.msg);
  return 0;
}

static int run_hook(ckpt_writer_t *w, const char *point, int64_t step, char *msg, size_t len) {
  if (w->hook && w->hook(point, step, w->hook_arg)) {
    w->hook_stopped = 1;
    return err_set(msg, len, CKPT_EIO, "checkpoint error: save of step %" PRId64 " stopped at %s (test hook)", step,
                point);
  }
  return 0;
}

static int index_tensors(const char *path, int world, cJSON *out, char *msg, size_t len);

/* The metadata document; takes ownership of tensors (the global tensor list). */
static char *metadata_json(const ckpt_writer_t *w, const job_t *j, const rec_t *recs, int world, cJSON *tensors) {
  cJSON *root = cJSON_CreateObject();
  if (!root) {
    cJSON_Delete(tensors);
    return NULL;
  }
  char hex[32];
  cJSON_AddStringToObject(root, "format", CKPT_FORMAT_NAME);
  cJSON_AddNumberToObject(root, "version", CKPT_FORMAT_VERSION);
  cJSON_AddNumberToObject(root, "step", (double)j->state.step);
  cJSON_AddNumberToObject(root, "optim_step", (double)j->state.optim_step);
  /* u64s as decimal strings: JSON numbers (doubles) are exact only to 2^53. */
  snprintf(hex, sizeof hex, "%" PRIu64, j->state.data_position);
  cJSON_AddStringToObject(root, "data_position", hex);
  cJSON *rng = cJSON_AddArrayToObject(root, "rng");
  for (int i = 0; rng && i < j->state.n_rng && i < CKPT_RNG_MAX; i++) {
    snprintf(hex, sizeof hex, "0x%016" PRIx64, j->state.rng[i]);
    cJSON_AddItemToArray(rng, cJSON_CreateString(hex));
  }
  cJSON *model = cJSON_AddObjectToObject(root, "model");
  if (model) {
    cJSON_AddNumberToObject(model, "dim", w->shape.dim);
    cJSON_AddNumberToObject(model, "n_layers", w->shape.n_layers);
    cJSON_AddNumberToObject(model, "n_heads", w->shape.n_heads);
    cJSON_AddNumberToObject(model, "n_kv_heads", w->shape.n_kv_heads);
    cJSON_AddNumberToObject(model, "vocab_size", w->shape.vocab_size);
    cJSON_AddNumberToObject(model, "hidden_dim", w->shape.hidden_dim);
  }
  cJSON_AddNumberToObject(root, "world_size", world);
  cJSON *mesh = cJSON_AddObjectToObject(root, "mesh");
  if (mesh) {
    cJSON_AddNumberToObject(mesh, "dp_replicate", w->mesh[0]);
    cJSON_AddNumberToObject(mesh, "dp_shard", w->mesh[1]);
    cJSON_AddNumberToObject(mesh, "tp", w->mesh[2]);
  }
  cJSON *files = cJSON_AddArrayToObject(root, "files");
  for (int i = 0; files && i < world; i++) {
    cJSON *f = cJSON_CreateObject();
    char name[64];
    snprintf(name, sizeof name, "shard-%d.safetensors", i);
    cJSON_AddStringToObject(f, "name", name);
    cJSON_AddNumberToObject(f, "rank", i);
    cJSON_AddNumberToObject(f, "bytes", (double)recs[i].size);
    snprintf(hex, sizeof hex, "0x%08" PRIx32, recs[i].crc);
    cJSON_AddStringToObject(f, "crc32c", hex);
    cJSON_AddItemToArray(files, f);
  }
  cJSON_AddItemToObject(root, "tensors", tensors);
  cJSON *extra = cJSON_AddObjectToObject(root, "extra");
  for (int i = 0; extra && i < j->state.n_extra; i++)
    cJSON_AddStringToObject(extra, j->state.extra_key[i], j->state.extra_val[i]);
  cJSON *plan = w->plan_json[0] ? cJSON_Parse(w->plan_json) : NULL;
  if (plan)
    cJSON_AddItemToObject(root, "plan", plan);
  else
    cJSON_AddStringToObject(root, "plan", w->plan_json);
  char *body = cJSON_Print(root); /* "{\n\t\"format\": ..." */
  cJSON_Delete(root);
  if (!body) return NULL;
  /* The checksum goes first, in a fixed-width member, and covers the rest: body without its
   * opening brace. */
  size_t blen = strlen(body + 1);
  char *txt = malloc(META_CRC_LEN + blen + 2);
  if (txt) {
    snprintf(txt, META_CRC_LEN + 1, META_CRC_HEAD "%08" PRIx32 "\",", ckpt_crc32c(0, body + 1, blen));
    memcpy(txt + META_CRC_LEN, body + 1, blen + 1);
  }
  free(body);
  return txt;
}

/* Rank 0's part of the commit: metadata, rename, latest, pruning. */
static int commit_rank0(ckpt_writer_t *w, job_t *j, const rec_t *recs, int world, char *msg, size_t len) {
  int64_t step = j->step;
  int rc = run_hook(w, "before_commit", step, msg, len);
  if (rc) return rc;
  char path[CKPT_PATH], final[CKPT_PATH], old[CKPT_PATH];
  /* Rank 0 reads back every shard's chunk list (headers only): the global tensor list goes into
   * the metadata, and a checkpoint that does not cover every tensor it mentions exactly once is
   * refused now rather than discovered at resume. */
  cJSON *tensors = cJSON_CreateArray();
  if (!tensors) return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory writing metadata");
  rc = index_tensors(j->tmpdir, world, tensors, msg, len);
  if (rc) {
    cJSON_Delete(tensors);
    return rc;
  }
  char *txt = metadata_json(w, j, recs, world, tensors);
  if (!txt) return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory writing metadata");
  pathf(path, sizeof path, "%s/metadata.json", j->tmpdir);
  rc = write_durable(path, txt, msg, len);
  free(txt);
  if (rc) return rc;
  if (fsync_path(j->tmpdir))
    return err_set(msg, len, io_code(errno), "checkpoint error: fsync %s: %s", j->tmpdir, strerror(errno));
  rc = run_hook(w, "before_rename", step, msg, len);
  if (rc) return rc;
  /* A step-<N> from an abandoned timeline (saved, then the run resumed from an older step) is
   * moved aside first: rename() cannot replace a non-empty directory. */
  pathf(final, sizeof final, "%s/step-%" PRId64, w->dir, step);
  pathf(old, sizeof old, "%s/step-%" PRId64 ".old.tmp", w->dir, step);
  struct stat sb;
  if (stat(final, &sb) == 0) {
    rm_rf(old);
    if (rename(final, old) != 0)
      return err_set(msg, len, io_code(errno), "checkpoint error: rename %s -> %s: %s", final, old, strerror(errno));
  }
  if (rename(j->tmpdir, final) != 0)
    return err_set(msg, len, io_code(errno), "checkpoint error: rename %s -> %s: %s", j->tmpdir, final,
                strerror(errno));
  if (fsync_path(w->dir))
    return err_set(msg, len, io_code(errno), "checkpoint error: fsync %s: %s", w->dir, strerror(errno));
  rm_rf(old);
  rc = run_hook(w, "before_latest", step, msg, len);
  if (rc) return rc;
  char latest[CKPT_PATH], latest_tmp[CKPT_PATH], body[64];
  pathf(latest, sizeof latest, "%s/latest", w->dir);
  pathf(latest_tmp, sizeof latest_tmp, "%s/latest.tmp", w->dir);
  snprintf(body, sizeof body, "step-%" PRId64 "\n", step);
  rc = write_durable(latest_tmp, body, msg, len);
  if (rc) return rc;
  if (rename(latest_tmp, latest) != 0)
    return err_set(msg, len, io_code(errno), "checkpoint error: rename %s -> %s: %s", latest_tmp, latest,
                strerror(errno));
  if (fsync_path(w->dir))
    return err_set(msg, len, io_code(errno), "checkpoint error: fsync %s: %s", w->dir, strerror(errno));
  /* Retention: the saved step and the keep-1 older ones survive; newer ones were abandoned. */
  int n = 0, kept = 0;
  int64_t *steps = list_steps(w->dir, &n);
  for (int i = 0; i < n; i++) {
    if (steps[i] > step) {
      log_warn("checkpoint: removing %s/step-%" PRId64 ": newer than the step-%" PRId64
               " just saved (an abandoned timeline: the run resumed from an older checkpoint)",
               w->dir, steps[i], step);
      remove_step(w->dir, steps[i]);
    }
    else if (w->keep > 0 && ++kept > w->keep)
      remove_step(w->dir, steps[i]);
  }
  free(steps);
  fsync_path(w->dir);
  return 0;
}

/* Collective: waits for this rank's writer, gathers every rank's result, rank 0 commits,
 * everyone gets rank 0's outcome. Frees the job. */
static int save_commit(ckpt_writer_t *w, char *err, size_t errlen) {
  job_t *j = w->job;
  w->job = NULL;
  if (j->has_thread) pthread_join(j->thread, NULL);
  const ckpt_group_t *g = wgroup(w);
  int world = grp_size(g);
  rec_t *recs = calloc((size_t)world, sizeof *recs);
  rec_t out = {0};
  if (!recs) {
    job_free(j);
    return err_set(err, errlen, CKPT_ENOMEM, "checkpoint error: out of memory");
  }
  if (grp_gather(g, &j->rec, recs, sizeof *recs)) {
    free(recs);
    job_free(j);
    return err_set(err, errlen, CKPT_ECOMM, "checkpoint error: a collective of the checkpoint group failed");
  }
  if (grp_rank(g) == 0) {
    /* The first failure in rank order, but a lack of space anywhere wins: it is the one cause
     * that decides what the caller does next (stop instead of retrying). */
    int pick = -1;
    for (int i = 0; i < world; i++)
      if (recs[i].rc && (pick < 0 || (recs[i].rc == CKPT_ENOSPC && recs[pick].rc != CKPT_ENOSPC))) pick = i;
    if (pick >= 0) {
      recs[pick].msg[CKPT_MSG - 1] = 0;
      out.rc = recs[pick].rc;
      snprintf(out.msg, sizeof out.msg, "%s", recs[pick].msg);
    }
    w->hook_stopped = 0;
    if (!out.rc) out.rc = commit_rank0(w, j, recs, world, out.msg, sizeof out.msg);
    /* A failed save leaves nothing behind, unless the test hook stopped it as a crash would.
     * Every rank's writer is done (joined before the gather), so no shard is still open. */
    if (out.rc && !w->hook_stopped) rm_rf(j->tmpdir);
  }
  free(recs);
  int64_t step = j->step;
  job_free(j);
  if (grp_bcast(g, &out, sizeof out))
    return err_set(err, errlen, CKPT_ECOMM, "checkpoint error: a collective of the checkpoint group failed");
  if (out.rc) {
    out.msg[CKPT_MSG - 1] = 0;
    return err_set(err, errlen, out.rc, "%s", out.msg);
  }
  if (grp_rank(g) == 0) log_info("checkpoint: saved %s/step-%" PRId64, w->dir, step);
  return 0;
}

/* Copies chunks (geometry, names, data) into the job so the caller's buffers are free again. */
static int job_copy(job_t *j, const ckpt_chunk_t *chunks, int n) {
  size_t floats = 0, chars = 0;
  for (int i = 0; i < n; i++) {
    floats += (size_t)(chunks[i].b - chunks[i].a);
    chars += strlen(chunks[i].kind) + strlen(chunks[i].name) + 2;
  }
  j->own_chunks = malloc(((size_t)n + 1) * sizeof *j->own_chunks);
  j->own_names = malloc(chars + 1);
  j->own_data = malloc((floats + 1) * sizeof *j->own_data);
  if (!j->own_chunks || !j->own_names || !j->own_data) return CKPT_ENOMEM;
  char *p = j->own_names;
  float *d = j->own_data;
  for (int i = 0; i < n; i++) {
    ckpt_chunk_t *c = &j->own_chunks[i];
    *c = chunks[i];
    size_t kl = strlen(chunks[i].kind) + 1, nl = strlen(chunks[i].name) + 1, m = (size_t)(c->b - c->a);
    memcpy(p, chunks[i].kind, kl);
    c->kind = p;
    p += kl;
    memcpy(p, chunks[i].name, nl);
    c->name = p;
    p += nl;
    if (m) memcpy(d, chunks[i].data, m * sizeof *d);
    c->data = d;
    d += m;
  }
  j->chunks = j->own_chunks;
  j->n = n;
  return 0;
}

int ckpt_writer_save(ckpt_writer_t *w, const ckpt_state_t *st, const ckpt_chunk_t *chunks, int n_chunks, char *err,
                     size_t errlen) {
  if (!w || !st) return err_set(err, errlen, CKPT_EINVAL, "checkpoint error: invalid arguments to ckpt_writer_save");
  /* An earlier asynchronous save is committed first: at most one is in flight, and its
   * failure is reported here. */
  if (w->job) {
    int rc = save_commit(w, err, errlen);
    if (rc) return rc;
  }
  int rc = save_prepare(w, st->step, err, errlen);
  if (rc) return rc;
  job_t *j = calloc(1, sizeof *j);
  if (!j) return err_set(err, errlen, CKPT_ENOMEM, "checkpoint error: out of memory");
  j->step = st->step;
  j->state = *st;
  pathf(j->tmpdir, sizeof j->tmpdir, "%s/step-%" PRId64 ".tmp", w->dir, st->step);
  pathf(j->file, sizeof j->file, "%s/shard-%d.safetensors", j->tmpdir, grp_rank(wgroup(w)));
  j->chunks = chunks;
  j->n = n_chunks;
  j->hook = w->hook;
  j->hook_arg = w->hook_arg;
  w->job = j;
  /* Local problems become this rank's failure record, still carried through the commit's
   * collectives so that every rank fails the same save. */
  rec_t *r = &j->rec;
  if (n_chunks < 0)
    r->rc = err_set(r->msg, sizeof r->msg, CKPT_EINVAL,
                 "checkpoint error: rank %d could not collect its state for step %" PRId64 " (see its log)",
                 grp_rank(wgroup(w)), st->step);
  else if (st->step < 0 || (n_chunks > 0 && !chunks))
    r->rc = err_set(r->msg, sizeof r->msg, CKPT_EINVAL, "checkpoint error: invalid step or chunk list");
  for (int i = 0; !r->rc && i < n_chunks; i++) {
    const ckpt_chunk_t *c = &chunks[i];
    if (!valid_ident(c->kind, 23) || !valid_ident(c->name, 127) || !valid_geometry(c) || (c->b > c->a && !c->data))
      r->rc = err_set(r->msg, sizeof r->msg, CKPT_EINVAL,
                   "checkpoint error: rank %d chunk %d (%s/%s): invalid name, geometry or data", grp_rank(wgroup(w)),
                   i, c->kind ? c->kind : "?", c->name ? c->name : "?");
  }
  if (!r->rc && w->async) {
    if (job_copy(j, chunks, n_chunks))
      r->rc = err_set(r->msg, sizeof r->msg, CKPT_ENOMEM, "checkpoint error: rank %d: out of memory copying %d chunks",
                   grp_rank(wgroup(w)), n_chunks);
    else if (pthread_create(&j->thread, NULL, job_thread, j) == 0)
      j->has_thread = 1;
    else
      job_write(j); /* no thread: write now, still committed later */
    if (j->rec.rc) atomic_store(&j->done, 1);
    return 0;
  }
  if (!r->rc) job_write(j);
  return save_commit(w, err, errlen);
}

int ckpt_writer_poll(ckpt_writer_t *w, int64_t *committed, char *err, size_t errlen) {
  if (committed) *committed = -1;
  if (!w || !w->job) return 0;
  const ckpt_group_t *g = wgroup(w);
  int world = grp_size(g);
  int32_t mine = atomic_load(&w->job->done) ? 1 : 0;
  int32_t *all = calloc((size_t)world, sizeof *all);
  if (!all) return err_set(err, errlen, CKPT_ENOMEM, "checkpoint error: out of memory");
  if (grp_gather(g, &mine, all, sizeof mine)) {
    free(all);
    return err_set(err, errlen, CKPT_ECOMM, "checkpoint error: a collective of the checkpoint group failed");
  }
  int ready = 1;
  for (int i = 0; i < world; i++) ready &= all[i] != 0;
  free(all);
  if (!ready) return 0;
  int64_t step = w->job->step;
  int rc = save_commit(w, err, errlen);
  if (rc == 0 && committed) *committed = step;
  return rc;
}

int ckpt_writer_wait(ckpt_writer_t *w, char *err, size_t errlen) {
  if (!w || !w->job) return 0;
  return save_commit(w, err, errlen);
}

void ckpt_writer_destroy(ckpt_writer_t *w) {
  if (!w) return;
  if (w->job) {
    char err[512];
    if (ckpt_writer_wait(w, err, sizeof err)) log_error("%s", err);
  }
  free(w->plan_json);
  free(w);
}

/* --- reader */

typedef struct {
  char kind[24];
  char name[128];
  int64_t rows, cols, r0, r1, c0, c1, a, b;
  const float *data;
  int file;
} entry_t;

typedef struct {
  char name[64];
  uint64_t bytes;
  uint32_t crc;
} file_t;

struct ckpt {
  ckpt_meta_t meta;
  char path[CKPT_PATH];
  char *plan_json;
  char *notes;
  int n_files;
  file_t *files;
  st_file_t **st;
  entry_t *ents;
  int n_ents;
};

void ckpt_close(ckpt_t *ck) {
  if (!ck) return;
  for (int i = 0; ck->st && i < ck->n_files; i++)
    st_close(ck->st[i]);
  free(ck->st);
  free(ck->files);
  free(ck->ents);
  free(ck->plan_json);
  free(ck->notes);
  free(ck);
}

const ckpt_meta_t *ckpt_meta(const ckpt_t *ck) { return ck ? &ck->meta : NULL; }

/* At most max bytes of path, NUL-terminated; *len (may be NULL) gets the count read. */
static char *read_text(const char *path, size_t max, size_t *len, int *errno_out) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    *errno_out = errno;
    return NULL;
  }
  /* Sized from the file where it says, so a small metadata.json costs a small buffer. */
  struct stat sb;
  size_t cap = max;
  if (fstat(fileno(f), &sb) == 0 && S_ISREG(sb.st_mode) && (uint64_t)sb.st_size < max) cap = (size_t)sb.st_size;
  char *buf = malloc(cap + 1);
  size_t n = buf ? fread(buf, 1, cap, f) : 0;
  fclose(f);
  if (buf) buf[n] = 0;
  if (len) *len = n;
  *errno_out = buf ? 0 : ENOMEM;
  return buf;
}

static int json_int(const cJSON *o, const char *key, int64_t *out) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
  /* Range first: casting a double outside int64's range (or nan) to int64_t is undefined. */
  if (!cJSON_IsNumber(j) || !(fabs(j->valuedouble) < 0x1p63) || j->valuedouble != (double)(int64_t)j->valuedouble)
    return 0;
  *out = (int64_t)j->valuedouble;
  return 1;
}

static int json_u64_str(const cJSON *j, uint64_t *out) {
  if (!cJSON_IsString(j) || !*j->valuestring) return 0;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(j->valuestring, &end, 0);
  if (errno || *end) return 0;
  *out = v;
  return 1;
}

/* Checks metadata.json's own checksum (txt, n bytes, at mpath). A file without one is named for
 * what it most likely is: format version 1 (which had none), or damage. */
static int check_metadata_crc(const char *mpath, const char *txt, size_t n, char *msg, size_t len) {
  const size_t head = sizeof META_CRC_HEAD - 1;
  uint32_t want = 0;
  int ok = n >= META_CRC_LEN && !memcmp(txt, META_CRC_HEAD, head) && txt[head + 8] == '"' && txt[head + 9] == ',';
  for (size_t i = head; ok && i < head + 8; i++) {
    char c = txt[i];
    ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
    want = want << 4 | (uint32_t)(c <= '9' ? c - '0' : c - 'a' + 10);
  }
  if (!ok) {
    cJSON *root = cJSON_ParseWithLength(txt, n);
    int64_t v = 0;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    int old = cJSON_IsString(fmt) && !strcmp(fmt->valuestring, CKPT_FORMAT_NAME) && json_int(root, "version", &v) &&
              v < CKPT_FORMAT_VERSION;
    cJSON_Delete(root);
    if (old)
      return err_set(msg, len, CKPT_ECORRUPT,
                  "checkpoint error: %s: format version %" PRId64 " has no metadata checksum; this build reads "
                  "version %d only (resume from a newer checkpoint, or start over with checkpoint.resume none)",
                  mpath, v, CKPT_FORMAT_VERSION);
    return err_set(msg, len, CKPT_ECORRUPT,
                "checkpoint error: %s: no metadata checksum on its first line (damaged, or not a meshrun checkpoint)",
                mpath);
  }
  uint32_t got = ckpt_crc32c(0, txt + META_CRC_LEN, n - META_CRC_LEN);
  if (got != want)
    return err_set(msg, len, CKPT_ECORRUPT,
                "checkpoint error: %s: checksum mismatch (expected 0x%08" PRIx32 ", got 0x%08" PRIx32 ")", mpath, want,
                got);
  return 0;
}

/* Parses <path>/metadata.json into ck (meta, files). */
static int parse_metadata(ckpt_t *ck, char *msg, size_t len) {
  char mpath[CKPT_PATH];
  pathf(mpath, sizeof mpath, "%s/metadata.json", ck->path);
  int e = 0;
  size_t n = 0;
  char *txt = read_text(mpath, 64u << 20, &n, &e);
  if (!txt) return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: %s", mpath, strerror(e));
  int rc = check_metadata_crc(mpath, txt, n, msg, len);
  if (rc) {
    free(txt);
    return rc;
  }
  cJSON *root = cJSON_ParseWithLength(txt, n);
  free(txt);
  ckpt_meta_t *m = &ck->meta;
  ckpt_state_t *st = &m->state;
  const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
  int64_t v = 0;
  if (!cJSON_IsObject(root) || !cJSON_IsString(fmt) || strcmp(fmt->valuestring, CKPT_FORMAT_NAME)) {
    rc = err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: not a meshrun checkpoint metadata file", mpath);
    goto error;
  }
  if (!json_int(root, "version", &v) || v != CKPT_FORMAT_VERSION) {
    rc = err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: unsupported format version (this build reads %d)",
              mpath, CKPT_FORMAT_VERSION);
    goto error;
  }
  m->version = (int)v;
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
  const cJSON *files = cJSON_GetObjectItemCaseSensitive(root, "files");
  const cJSON *rng = cJSON_GetObjectItemCaseSensitive(root, "rng");
  int64_t sh[6], ws = 0;
  const char *shk[6] = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim"};
  int ok = json_int(root, "step", &st->step) && json_int(root, "optim_step", &st->optim_step) &&
           json_u64_str(cJSON_GetObjectItemCaseSensitive(root, "data_position"), &st->data_position) &&
           json_int(root, "world_size", &ws) && cJSON_IsObject(model) && cJSON_IsArray(files) &&
           cJSON_IsArray(rng) && cJSON_GetArraySize(rng) <= CKPT_RNG_MAX && ws >= 1 && ws <= (1 << 20) &&
           cJSON_GetArraySize(files) == ws;
  for (int i = 0; ok && i < 6; i++)
    ok = json_int(model, shk[i], &sh[i]);
  if (!ok) {
    rc = err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: missing or invalid fields", mpath);
    goto error;
  }
  m->shape = (ckpt_shape_t){(int)sh[0], (int)sh[1], (int)sh[2], (int)sh[3], (int)sh[4], (int)sh[5]};
  m->world_size = (int)ws;
  const cJSON *mesh = cJSON_GetObjectItemCaseSensitive(root, "mesh");
  const char *mk[3] = {"dp_replicate", "dp_shard", "tp"};
  for (int i = 0; i < 3; i++)
    m->mesh[i] = json_int(mesh, mk[i], &v) ? (int)v : 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, rng) {
    if (!json_u64_str(it, &st->rng[st->n_rng])) {
      rc = err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: invalid rng entry", mpath);
      goto error;
    }
    st->n_rng++;
  }
  cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(root, "extra")) {
    if (cJSON_IsString(it)) ckpt_state_set(st, it->string, it->valuestring);
  }
  const cJSON *plan = cJSON_GetObjectItemCaseSensitive(root, "plan");
  ck->plan_json = cJSON_IsString(plan) ? strdup(plan->valuestring) : plan ? cJSON_PrintUnformatted(plan) : strdup("");
  ck->files = calloc((size_t)ws, sizeof *ck->files);
  ck->st = calloc((size_t)ws, sizeof *ck->st);
  if (!ck->plan_json || !ck->files || !ck->st) {
    rc = err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
    goto error;
  }
  ck->n_files = (int)ws;
  int i = 0;
  cJSON_ArrayForEach(it, files) {
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
    int64_t bytes;
    uint64_t crc;
    if (!cJSON_IsString(nm) || !valid_ident(nm->valuestring, 63) || strlen(nm->valuestring) >= 64 ||
        !json_int(it, "bytes", &bytes) || bytes < 0 ||
        !json_u64_str(cJSON_GetObjectItemCaseSensitive(it, "crc32c"), &crc) || crc > UINT32_MAX) {
      rc = err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: invalid entry %d of files", mpath, i);
      goto error;
    }
    snprintf(ck->files[i].name, sizeof ck->files[i].name, "%s", nm->valuestring);
    ck->files[i].bytes = (uint64_t)bytes;
    ck->files[i].crc = (uint32_t)crc;
    i++;
  }
error:
  cJSON_Delete(root);
  return rc;
}

static int check_shape(const ckpt_t *ck, const ckpt_shape_t *want, char *msg, size_t len) {
  const ckpt_shape_t *have = &ck->meta.shape;
  const int h[6] = {have->dim, have->n_layers, have->n_heads, have->n_kv_heads, have->vocab_size, have->hidden_dim};
  const int x[6] = {want->dim, want->n_layers, want->n_heads, want->n_kv_heads, want->vocab_size, want->hidden_dim};
  const char *k[6] = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim"};
  for (int i = 0; i < 6; i++)
    if (h[i] != x[i])
      return err_set(msg, len, CKPT_ESHAPE,
                  "checkpoint error: %s holds a model of another shape: model.%s is %d there but %d in this plan; "
                  "refusing to load it",
                  ck->path, k[i], h[i], x[i]);
  return 0;
}

/* Size of every file (cheap, all ranks) and the CRC of this rank's share of them. */
static int verify_files(ckpt_t *ck, int rank, int size, char *msg, size_t len) {
  char p[CKPT_PATH];
  for (int i = 0; i < ck->n_files; i++) {
    pathf(p, sizeof p, "%s/%s", ck->path, ck->files[i].name);
    struct stat sb;
    if (stat(p, &sb) != 0) return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: %s", p, strerror(errno));
    if ((uint64_t)sb.st_size != ck->files[i].bytes)
      return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: size mismatch (expected %" PRIu64
                  " bytes, got %" PRIu64 ")", p, ck->files[i].bytes, (uint64_t)sb.st_size);
  }
  size_t bufsz = 4u << 20;
  char *buf = NULL;
  for (int i = rank; i < ck->n_files; i += size) {
    pathf(p, sizeof p, "%s/%s", ck->path, ck->files[i].name);
    if (!buf && !(buf = malloc(bufsz))) return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      free(buf);
      return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: %s", p, strerror(errno));
    }
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    uint32_t crc = 0;
    ssize_t got;
    while ((got = read(fd, buf, bufsz)) != 0) {
      if (got < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        close(fd);
        free(buf);
        return err_set(msg, len, CKPT_EIO, "checkpoint error: %s: read: %s", p, strerror(e));
      }
      crc = ckpt_crc32c(crc, buf, (size_t)got);
    }
    close(fd);
    if (crc != ck->files[i].crc) {
      free(buf);
      return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: checksum mismatch (expected 0x%08" PRIx32
                  ", got 0x%08" PRIx32 ")", p, ck->files[i].crc, crc);
    }
  }
  free(buf);
  return 0;
}

/* kind and name are zero-padded (entries are zeroed before they are filled), so memcmp orders
 * them as strcmp would. */
static int cmp_name(const entry_t *a, const entry_t *b) {
  int c = memcmp(a->kind, b->kind, sizeof a->kind);
  return c ? c : memcmp(a->name, b->name, sizeof a->name);
}

static int cmp_entry(const void *x, const void *y) {
  const entry_t *a = x, *b = y;
  int c = strcmp(a->kind, b->kind);
  if (!c) c = strcmp(a->name, b->name);
  if (c) return c;
  const int64_t ka[6] = {a->r0, a->c0, a->a, a->r1, a->c1, a->b};
  const int64_t kb[6] = {b->r0, b->c0, b->a, b->r1, b->c1, b->b};
  for (int i = 0; i < 6; i++)
    if (ka[i] != kb[i]) return ka[i] < kb[i] ? -1 : 1;
  return 0;
}

/* Opens every shard and builds the chunk index; checks each tensor is covered exactly once
 * (exact duplicates, e.g. saved by replicas, are dropped). */
static int build_index(ckpt_t *ck, char *msg, size_t len) {
  char p[CKPT_PATH], e[512];
  int cap = 256;
  ck->ents = malloc((size_t)cap * sizeof *ck->ents);
  if (!ck->ents) return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
  for (int f = 0; f < ck->n_files; f++) {
    pathf(p, sizeof p, "%s/%s", ck->path, ck->files[f].name);
    int rc = st_open(&ck->st[f], p, e, sizeof e);
    if (rc) return err_set(msg, len, rc == ST_ENOMEM ? CKPT_ENOMEM : CKPT_ECORRUPT, "checkpoint error: %s", e);
    const char *lines = st_metadata(ck->st[f], CKPT_CHUNKS_KEY);
    if (!lines) return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: no chunk list", p);
    int idx = 0;
    for (const char *l = lines; *l; idx++) {
      const char *nl = strchr(l, '\n');
      if (ck->n_ents == cap) {
        cap *= 2;
        entry_t *v = realloc(ck->ents, (size_t)cap * sizeof *v);
        if (!v) return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
        ck->ents = v;
      }
      entry_t *en = &ck->ents[ck->n_ents];
      memset(en, 0, sizeof *en);
      long long g[8];
      int got = sscanf(l, "%23s %127s %lld %lld %lld %lld %lld %lld %lld %lld", en->kind, en->name, &g[0], &g[1], &g[2],
                       &g[3], &g[4], &g[5], &g[6], &g[7]);
      ckpt_chunk_t c = {en->kind, en->name, g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], NULL};
      if (got != 10 || !valid_geometry(&c))
        return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: chunk %d has an invalid description", p, idx);
      en->rows = g[0], en->cols = g[1], en->r0 = g[2], en->r1 = g[3], en->c0 = g[4], en->c1 = g[5];
      en->a = g[6], en->b = g[7];
      en->file = f;
      char tname[300];
      pathf(tname, sizeof tname, "%s/%s#%d", en->kind, en->name, idx);
      const st_tensor_t *t = st_tensor_at(ck->st[f], idx);
      if (!t || strcmp(t->name, tname)) t = st_find(ck->st[f], tname);
      if (!t || t->dtype != ST_F32 || st_numel(t) != (size_t)(en->b - en->a))
        return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: tensor %s is missing or has the wrong size", p,
                    tname);
      en->data = t->data;
      ck->n_ents++;
      l = nl ? nl + 1 : l + strlen(l);
    }
  }
  qsort(ck->ents, (size_t)ck->n_ents, sizeof *ck->ents, cmp_entry);
  int w = 0;
  for (int i = 0; i < ck->n_ents; i++) {
    if (w > 0 && cmp_entry(&ck->ents[w - 1], &ck->ents[i]) == 0) continue;
    ck->ents[w++] = ck->ents[i];
  }
  ck->n_ents = w;
  for (int i = 0; i < ck->n_ents;) {
    int j = i;
    int64_t sum = 0;
    while (j < ck->n_ents && !strcmp(ck->ents[j].kind, ck->ents[i].kind) &&
           !strcmp(ck->ents[j].name, ck->ents[i].name)) {
      if (ck->ents[j].rows != ck->ents[i].rows || ck->ents[j].cols != ck->ents[i].cols)
        return err_set(msg, len, CKPT_ECORRUPT, "checkpoint error: %s: %s/%s is saved with two different shapes", ck->path,
                    ck->ents[i].kind, ck->ents[i].name);
      sum += ck->ents[j].b - ck->ents[j].a;
      j++;
    }
    if (sum != ck->ents[i].rows * ck->ents[i].cols)
      return err_set(msg, len, CKPT_ECORRUPT,
                  "checkpoint error: %s: %s/%s: the saved chunks hold %" PRId64 " of its %" PRId64 " elements",
                  ck->path, ck->ents[i].kind, ck->ents[i].name, sum, ck->ents[i].rows * ck->ents[i].cols);
    i = j;
  }
  return 0;
}

static int index_tensors(const char *path, int world, cJSON *out, char *msg, size_t len) {
  ckpt_t *ck = calloc(1, sizeof *ck);
  if (ck) {
    ck->files = calloc((size_t)world, sizeof *ck->files);
    ck->st = calloc((size_t)world, sizeof *ck->st);
  }
  if (!ck || !ck->files || !ck->st) {
    ckpt_close(ck);
    return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
  }
  pathf(ck->path, sizeof ck->path, "%s", path);
  ck->n_files = world;
  for (int i = 0; i < world; i++)
    snprintf(ck->files[i].name, sizeof ck->files[i].name, "shard-%d.safetensors", i);
  int rc = build_index(ck, msg, len);
  for (int i = 0, j; !rc && i < ck->n_ents; i = j) {
    const entry_t *e = &ck->ents[i];
    for (j = i + 1; j < ck->n_ents && !cmp_name(&ck->ents[j], e);) j++;
    int chunks = j - i;
    cJSON *t = cJSON_CreateObject();
    cJSON *shape = cJSON_CreateArray();
    if (!t || !shape) {
      cJSON_Delete(t);
      cJSON_Delete(shape);
      rc = err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
      break;
    }
    cJSON_AddStringToObject(t, "kind", e->kind);
    cJSON_AddStringToObject(t, "name", e->name);
    cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e->rows));
    cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e->cols));
    cJSON_AddItemToObject(t, "shape", shape);
    cJSON_AddNumberToObject(t, "chunks", chunks);
    cJSON_AddItemToArray(out, t);
  }
  ckpt_close(ck);
  return rc;
}

/* The chunks of the files this rank verified (file i on rank i % size) hold finite numbers
 * only; else the first NaN or infinity, named by its index in the full tensor (row-major). */
static int check_finite(const ckpt_t *ck, int rank, int size, char *msg, size_t len) {
  for (int i = 0; i < ck->n_ents; i++) {
    const entry_t *e = &ck->ents[i];
    size_t at;
    const char *what;
    if (e->file % size != rank || st_check_finite(e->data, (size_t)(e->b - e->a), &at, &what) == 0) continue;
    const int64_t w = e->c1 - e->c0, k = e->a + (int64_t)at;
    return err_set(msg, len, CKPT_ENONFINITE,
                   "checkpoint error: %s: tensor %s/%s element %" PRId64 " is %s (not a finite number)", ck->path,
                   e->kind, e->name, (e->r0 + k / w) * e->cols + e->c0 + k % w, what);
  }
  return 0;
}

/* Tries one step directory (collective). 0: *out is open; else everyone gets the same error. */
static int try_open(ckpt_t **out, const char *path, const ckpt_shape_t *expect, const ckpt_group_t *g, char *msg,
                    size_t len) {
  *out = NULL;
  int world = grp_size(g);
  rec_t mine = {0};
  rec_t *all = calloc((size_t)world, sizeof *all);
  ckpt_t *ck = calloc(1, sizeof *ck);
  if (!all || !ck) {
    free(all);
    free(ck);
    return err_set(msg, len, CKPT_ENOMEM, "checkpoint error: out of memory");
  }
  {
    snprintf(ck->path, sizeof ck->path, "%s", path);
    mine.rc = parse_metadata(ck, mine.msg, sizeof mine.msg);
    if (!mine.rc && expect) mine.rc = check_shape(ck, expect, mine.msg, sizeof mine.msg);
    if (!mine.rc) mine.rc = verify_files(ck, grp_rank(g), world, mine.msg, sizeof mine.msg);
  }
  /* Three verdicts: checksums first, so a damaged file is named as such rather than by whatever
   * the safetensors parser trips over on another rank; the values last, since a damaged
   * checkpoint falls back and a diverged one does not. */
  int rc = grp_verdict(g, &mine, all, msg, len);
  if (!rc) {
    mine.rc = build_index(ck, mine.msg, sizeof mine.msg);
    rc = grp_verdict(g, &mine, all, msg, len);
  }
  if (!rc) {
    mine.rc = check_finite(ck, grp_rank(g), world, mine.msg, sizeof mine.msg);
    rc = grp_verdict(g, &mine, all, msg, len);
  }
  free(all);
  if (rc) {
    ckpt_close(ck);
    return rc;
  }
  ck->meta.path = ck->path;
  ck->meta.plan_json = ck->plan_json;
  ck->meta.notes = "";
  *out = ck;
  return 0;
}

/* Candidates for "auto": latest's target, then every step-<N> newest first. */
static int auto_candidates(const char *dir, int64_t *cand, int max) {
  int n = 0, ns = 0;
  char p[CKPT_PATH];
  pathf(p, sizeof p, "%s/latest", dir);
  int e;
  char *txt = read_text(p, 256, NULL, &e);
  int64_t latest = -1;
  if (txt) {
    char *end = txt + strlen(txt);
    while (end > txt && (end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\r')) *--end = 0;
    pathf(p, sizeof p, "%s/%s", dir, txt);
    struct stat sb;
    if (parse_step_name(txt, &latest) && stat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
      cand[n++] = latest;
    else
      latest = -1;
    free(txt);
  }
  int64_t *steps = list_steps(dir, &ns);
  for (int i = 0; i < ns && n < max; i++)
    if (steps[i] != latest) cand[n++] = steps[i];
  free(steps);
  return n;
}

/* The step directory ckpt_open(dir, which) tries first for an explicit which; "" when none. */
static void explicit_dir(const char *dir, const char *which, char *path, size_t n) {
  struct stat sb;
  snprintf(path, n, "%s", which);
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) pathf(path, n, "%s/%s", dir, which);
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) path[0] = 0;
}

int ckpt_open(ckpt_t **out, const char *dir, const char *which, const ckpt_shape_t *expect, const ckpt_group_t *group,
              char *err, size_t errlen) {
  *out = NULL;
  if (!dir || strlen(dir) > CKPT_PATH - 64 || (which && strlen(which) > CKPT_PATH - 64))
    return err_set(err, errlen, CKPT_EINVAL, "checkpoint error: invalid arguments to ckpt_open");
  if (group && group->size <= 1) group = NULL;
  char path[CKPT_PATH], notes[4096] = "";
  if (which && *which && strcmp(which, "auto")) {
    explicit_dir(dir, which, path, sizeof path);
    if (!path[0]) return err_set(err, errlen, CKPT_ENOENT, "checkpoint error: %s: no such checkpoint directory", which);
    return try_open(out, path, expect, group, err, errlen);
  }
  /* Rank 0 lists, so that every rank tries the same candidates in the same order. */
  int64_t cand[CKPT_MAX_CANDIDATES + 1] = {0};
  if (grp_rank(group) == 0) cand[0] = auto_candidates(dir, cand + 1, CKPT_MAX_CANDIDATES);
  if (grp_bcast(group, cand, sizeof cand))
    return err_set(err, errlen, CKPT_ECOMM, "checkpoint error: a collective of the checkpoint group failed");
  int n = (int)cand[0];
  if (n <= 0) return err_set(err, errlen, CKPT_ENOENT, "checkpoint: no checkpoint in %s", dir);
  char msg[1024] = "";
  for (int i = 0; i < n; i++) {
    pathf(path, sizeof path, "%s/step-%" PRId64, dir, cand[1 + i]);
    int rc = try_open(out, path, expect, group, msg, sizeof msg);
    if (rc == 0) {
      ckpt_t *ck = *out;
      ck->notes = strdup(notes);
      ck->meta.notes = ck->notes ? ck->notes : "";
      return 0;
    }
    if (rc == CKPT_ENONFINITE && i + 1 < n) /* diverged: no fallback (ckpt.h) */
      return err_set(err, errlen, rc, "%s; its files are intact, so the run saved it so (training diverged), and auto "
                     "does not fall back to step-%" PRId64 ", where the same plan would diverge again: "
                     "name that one to load it instead", msg, cand[2 + i]);
    if (rc != CKPT_ECORRUPT && rc != CKPT_EIO) return err_set(err, errlen, rc, "%s", msg);
    char line[1200];
    if (i + 1 < n)
      snprintf(line, sizeof line, "%s; falling back to step-%" PRId64, msg, cand[2 + i]);
    else
      snprintf(line, sizeof line, "%s; no older checkpoint", msg);
    if (grp_rank(group) == 0) log_warn("%s", line);
    size_t used = strlen(notes);
    snprintf(notes + used, sizeof notes - used, "%s\n", line);
  }
  return err_set(err, errlen, CKPT_ECORRUPT, "checkpoint error: no intact checkpoint in %s:\n%s", dir, notes);
}

int ckpt_peek(const char *dir, const char *which, ckpt_state_t *state, char *path, size_t pathlen) {
  if (!dir || strlen(dir) > CKPT_PATH - 64 || (which && strlen(which) > CKPT_PATH - 64)) return CKPT_EINVAL;
  int64_t cand[CKPT_MAX_CANDIDATES];
  int explicit = which && *which && strcmp(which, "auto"), n = explicit ? 1 : auto_candidates(dir, cand, CKPT_MAX_CANDIDATES);
  char msg[1024];
  for (int i = 0; i < n; i++) {
    ckpt_t *ck = calloc(1, sizeof *ck);
    if (!ck) return CKPT_ENOMEM;
    if (explicit)
      explicit_dir(dir, which, ck->path, sizeof ck->path);
    else
      pathf(ck->path, sizeof ck->path, "%s/step-%" PRId64, dir, cand[i]);
    int rc = ck->path[0] ? parse_metadata(ck, msg, sizeof msg) : CKPT_ENOENT;
    if (rc == 0) {
      *state = ck->meta.state;
      snprintf(path, pathlen, "%s", ck->path);
    }
    ckpt_close(ck);
    if (rc == 0 || rc == CKPT_ENOMEM || (explicit && rc == CKPT_ENOENT)) return rc;
  }
  return n ? CKPT_ECORRUPT : CKPT_ENOENT;
}

/* First index entry of (kind, name), or -1. */
static int find_tensor(const ckpt_t *ck, const char *kind, const char *name) {
  int lo = 0, hi = ck->n_ents;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    int c = strcmp(ck->ents[mid].kind, kind);
    if (!c) c = strcmp(ck->ents[mid].name, name);
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo < ck->n_ents && !strcmp(ck->ents[lo].kind, kind) && !strcmp(ck->ents[lo].name, name)) return lo;
  return -1;
}

int ckpt_has(const ckpt_t *ck, const char *kind, const char *name) {
  return ck && kind && name && find_tensor(ck, kind, name) >= 0;
}

/* Columns [*x0, *x1) of full row y covered by the (box, flat range) region, and the offset of
 * the first of them in the region's data; 0 when the row is not covered. */
static int row_span(int64_t r0, int64_t c0, int64_t w, int64_t a, int64_t b, int64_t y, int64_t *x0, int64_t *x1,
                    int64_t *off) {
  int64_t i = y - r0;
  int64_t lo = i * w > a ? i * w : a, hi = (i + 1) * w < b ? (i + 1) * w : b;
  if (lo >= hi) return 0;
  *x0 = c0 + lo - i * w;
  *x1 = c0 + hi - i * w;
  *off = lo - a;
  return 1;
}

int ckpt_read(ckpt_t *ck, const ckpt_chunk_t *q, float *out, char *err, size_t errlen) {
  if (!ck || !q || !q->kind || !q->name || !valid_geometry(q) || (q->b > q->a && !out))
    return err_set(err, errlen, CKPT_EINVAL, "checkpoint error: invalid region %s/%s", q && q->kind ? q->kind : "?",
                q && q->name ? q->name : "?");
  int first = find_tensor(ck, q->kind, q->name);
  if (first < 0)
    return err_set(err, errlen, CKPT_ENOENT, "checkpoint error: %s has no %s/%s", ck->path, q->kind, q->name);
  const entry_t *e0 = &ck->ents[first];
  if (e0->rows != q->rows || e0->cols != q->cols)
    return err_set(err, errlen, CKPT_ESHAPE,
                "checkpoint error: %s: %s/%s is (%" PRId64 ", %" PRId64 ") there but (%" PRId64 ", %" PRId64 ") here",
                ck->path, q->kind, q->name, e0->rows, e0->cols, q->rows, q->cols);
  if (q->a == q->b) return 0;
  const int64_t qw = q->c1 - q->c0, cols = q->cols;
  const int64_t qy0 = q->r0 + q->a / qw, qy1 = q->r0 + (q->b - 1) / qw + 1;
  const int q_full = q->c0 == 0 && q->c1 == cols;
  int64_t copied = 0;
  for (int k = first; k < ck->n_ents && !strcmp(ck->ents[k].kind, q->kind) && !strcmp(ck->ents[k].name, q->name);
       k++) {
    const entry_t *c = &ck->ents[k];
    if (c->a == c->b) continue;
    const int64_t cw = c->c1 - c->c0;
    int64_t y0 = c->r0 + c->a / cw, y1 = c->r0 + (c->b - 1) / cw + 1;
    if (y0 < qy0) y0 = qy0;
    if (y1 > qy1) y1 = qy1;
    if (y0 >= y1 || c->c1 <= q->c0 || q->c1 <= c->c0) continue;
    if (q_full && c->c0 == 0 && c->c1 == cols) {
      /* Both contiguous in the full tensor's row-major order: one copy. */
      int64_t qs = q->r0 * cols + q->a, qe = q->r0 * cols + q->b;
      int64_t cs = c->r0 * cols + c->a, ce = c->r0 * cols + c->b;
      int64_t lo = qs > cs ? qs : cs, hi = qe < ce ? qe : ce;
      if (lo < hi) {
        memcpy(out + (lo - qs), c->data + (lo - cs), (size_t)(hi - lo) * sizeof *out);
        copied += hi - lo;
      }
      continue;
    }
    for (int64_t y = y0; y < y1; y++) {
      int64_t qx0, qx1, qo, cx0, cx1, co;
      if (!row_span(q->r0, q->c0, qw, q->a, q->b, y, &qx0, &qx1, &qo)) continue;
      if (!row_span(c->r0, c->c0, cw, c->a, c->b, y, &cx0, &cx1, &co)) continue;
      int64_t x0 = qx0 > cx0 ? qx0 : cx0, x1 = qx1 < cx1 ? qx1 : cx1;
      if (x0 >= x1) continue;
      memcpy(out + qo + (x0 - qx0), c->data + co + (x0 - cx0), (size_t)(x1 - x0) * sizeof *out);
      copied += x1 - x0;
    }
  }
  if (copied != q->b - q->a)
    return err_set(err, errlen, CKPT_ECORRUPT,
                "checkpoint error: %s: %s/%s: the saved chunks cover %" PRId64 " of the %" PRId64 " elements asked for",
                ck->path, q->kind, q->name, copied, q->b - q->a);
  return 0;
}

int ckpt_read_tensor(ckpt_t *ck, const char *kind, const char *name, float *out, size_t numel, char *err,
                     size_t errlen) {
  int first = ck && kind && name ? find_tensor(ck, kind, name) : -1;
  if (first < 0)
    return err_set(err, errlen, CKPT_ENOENT, "checkpoint error: %s has no %s/%s", ck ? ck->path : "?",
                   kind ? kind : "?", name ? name : "?");
  const entry_t *e = &ck->ents[first];
  if ((uint64_t)e->rows * (uint64_t)e->cols != (uint64_t)numel)
    return err_set(err, errlen, CKPT_ESHAPE,
                   "checkpoint error: %s: %s/%s has %" PRId64 " x %" PRId64 " elements there but %zu here", ck->path,
                   kind, name, e->rows, e->cols, numel);
  ckpt_chunk_t q = {kind, name, e->rows, e->cols, 0, e->rows, 0, e->cols, 0, e->rows * e->cols, NULL};
  return ckpt_read(ck, &q, out, err, errlen);
}

int ckpt_read_range(ckpt_t *ck, const char *kind, const model_tensor_t *tensors, int n_tensors, int tp_rank,
                    size_t offset, size_t count, float *out, char *err, size_t errlen) {
  for (int i = 0; i < n_tensors; i++) {
    const model_tensor_t *t = &tensors[i];
    size_t lo = t->offset > offset ? t->offset : offset;
    size_t hi = t->offset + t->numel < offset + count ? t->offset + t->numel : offset + count;
    if (lo >= hi) continue;
    ckpt_chunk_t q = {kind, t->name, 0, 0, 0, 0, 0, 0, (int64_t)(lo - t->offset), (int64_t)(hi - t->offset), NULL};
    int64_t box[4];
    tensor_box(t, tp_rank, &q.rows, &q.cols, box);
    q.r0 = box[0], q.r1 = box[1], q.c0 = box[2], q.c1 = box[3];
    int rc = ckpt_read(ck, &q, out + (lo - offset), err, errlen);
    if (rc) return rc;
  }
  return 0;
}
