/* diagnose: reading dumps and naming the rank that hangs a job (see diagnose.h).
 *
 * A dump is read line by line with cJSON: the header first (it lists the communicators and
 * their counters, which say which op records matter), then the op lines of those calls, then
 * the main thread's stack. The rest of a dump (2048 calls, every thread) is not kept. */
#include "launcher/diagnose.h"

#include <cJSON.h>
#include <errno.h>
#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "common/fs.h"
#include "launcher/console.h"

#define DIAG_FILE_MAX (64u << 20) /* a dump of COMM_FLIGHT_MAX calls is well under this */

static void copy_str(const cJSON *o, const char *key, char *out, size_t len) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (cJSON_IsString(v)) snprintf(out, len, "%s", v->valuestring);
}

static double get_num(const cJSON *o, const char *key, double dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

static void read_header(const cJSON *h, diag_rank_t *r) {
  r->rank = (int)get_num(h, "rank", -1);
  r->pid = (int)get_num(h, "pid", 0);
  r->unix_time = get_num(h, "unix_time", 0);
  r->node = (int)get_num(h, "node", -1);
  r->local_rank = (int)get_num(h, "local_rank", -1);
  copy_str(h, "host", r->host, sizeof r->host);
  char reason[32] = "", state[4] = "";
  copy_str(h, "reason", reason, sizeof reason);
  copy_str(h, "state", state, sizeof state);
  r->answered = strcmp(reason, "noanswer") != 0;
  r->state = state[0];
  const cJSON *c;
  cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(h, "comms")) {
    if (r->ncomms == DIAG_MAX_COMMS) break;
    diag_comm_t *d = &r->comms[r->ncomms++];
    copy_str(c, "name", d->name, sizeof d->name);
    d->size = (int)get_num(c, "size", 0);
    d->issued = (uint64_t)get_num(c, "issued", 0);
    d->done = (uint64_t)get_num(c, "done", 0);
  }
}

/* An op line: the op of call done + 1 or done of its communicator, when it is one of those. */
static void read_op(const cJSON *o, diag_rank_t *r) {
  char comm[DIAG_NAME_MAX] = "", op[16] = "";
  copy_str(o, "comm", comm, sizeof comm);
  copy_str(o, "op", op, sizeof op);
  uint64_t seq = (uint64_t)get_num(o, "seq", 0);
  char state[16] = "";
  copy_str(o, "state", state, sizeof state);
  for (int i = 0; i < r->ncomms; i++) {
    diag_comm_t *d = &r->comms[i];
    if (strcmp(d->name, comm)) continue;
    if (!strcmp(state, "skipped") && seq > d->skipped) {
      d->skipped = seq;
      snprintf(d->skipped_op, sizeof d->skipped_op, "%s", op);
    }
    if (seq == d->done + 1) {
      snprintf(d->next_op, sizeof d->next_op, "%s", op);
      d->next_bytes = (uint64_t)get_num(o, "bytes", 0);
    } else if (seq == d->done && d->done) {
      snprintf(d->done_op, sizeof d->done_op, "%s", op);
    }
  }
}

/* A frame as backtrace_symbols writes it, "path(function+0x1f) [0x...]", as "function", or
 * "binary+0x..." for a function the program does not export. */
static void frame_name(const char *s, char *out, size_t len) {
  const char *lp = strchr(s, '('), *plus = lp ? strchr(lp, '+') : NULL, *rp = lp ? strchr(lp, ')') : NULL;
  if (lp && plus && rp && plus > lp + 1 && plus < rp) {
    snprintf(out, len, "%.*s", (int)(plus - lp - 1), lp + 1);
    return;
  }
  const char *base = strrchr(s, '/');
  base = base ? base + 1 : s;
  const char *end = lp && rp ? rp : base + strlen(base);
  snprintf(out, len, "%.*s", (int)(end - base), base);
  for (char *p = out; *p; p++)
    if (*p == '(') memmove(p, p + 1, strlen(p));
}

/* The main thread's frames, less those of signal handlers: a thread other than the dumping one
 * is caught in the recorder's handler (frame 0, a static function without a name) called
 * through the signal trampoline (frame 1, the same text wherever it appears), and may have been
 * in another handler then (meshrun's request itself lands on any thread): everything down to
 * the trampoline's last appearance goes. */
static void read_stack(const cJSON *o, diag_rank_t *r) {
  if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "main"))) return;
  const cJSON *fr = cJSON_GetObjectItemCaseSensitive(o, "frames");
  int n = cJSON_GetArraySize(fr), skip = 0;
  const cJSON *tramp = cJSON_GetArrayItem(fr, 1);
  if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "dumping")) && cJSON_IsString(tramp)) {
    for (int i = 1; i < n; i++) {
      const cJSON *f = cJSON_GetArrayItem(fr, i);
      if (cJSON_IsString(f) && !strcmp(f->valuestring, tramp->valuestring)) skip = i + 1;
    }
  }
  r->nframes = 0;
  for (int i = skip; i < n && r->nframes < DIAG_FRAMES; i++) {
    const cJSON *f = cJSON_GetArrayItem(fr, i);
    if (cJSON_IsString(f)) frame_name(f->valuestring, r->frames[r->nframes++], sizeof r->frames[0]);
  }
}

int diag_parse(const char *text, size_t len, diag_rank_t *r, char *err, size_t errlen) {
  memset(r, 0, sizeof *r);
  r->rank = -1;
  r->node = r->local_rank = -1;
  int header = 0;
  for (const char *p = text, *end = text + len; p < end;) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    const char *le = nl ? nl : end;
    cJSON *o = cJSON_ParseWithLength(p, (size_t)(le - p));
    p = nl ? nl + 1 : end;
    if (!o) continue;
    char type[16] = "";
    copy_str(o, "type", type, sizeof type);
    if (!header && !strcmp(type, "header")) {
      read_header(o, r);
      header = 1;
    } else if (header && !strcmp(type, "op")) {
      read_op(o, r);
    } else if (header && !strcmp(type, "stack")) {
      read_stack(o, r);
    }
    cJSON_Delete(o);
  }
  if (!header) return err_set(err, errlen, -EINVAL, "no header line");
  if (r->rank < 0) return err_set(err, errlen, -EINVAL, "the header names no rank");
  return 0;
}

int diag_parse_file(const char *path, diag_rank_t *r, char *err, size_t errlen) {
  char *text = NULL;
  size_t len = 0;
  int rc = fs_read_file(path, DIAG_FILE_MAX, &text, &len, NULL);
  if (rc) return err_set(err, errlen, rc, "%s: %s", path, strerror(-rc));
  char why[128];
  rc = diag_parse(text, len, r, why, sizeof why);
  free(text);
  if (rc) return err_set(err, errlen, rc, "%s: %s", path, why);
  return 0;
}

void diag_stub(diag_rank_t *r, int rank, int pid, const char *host, char state) {
  memset(r, 0, sizeof *r);
  r->rank = rank;
  r->pid = pid;
  r->node = r->local_rank = -1;
  r->state = state;
  snprintf(r->host, sizeof r->host, "%s", host ? host : "");
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  r->unix_time = ts.tv_sec + ts.tv_nsec * 1e-9;
}

static cJSON *header_json(const diag_rank_t *r) {
  cJSON *h = cJSON_CreateObject();
  cJSON_AddStringToObject(h, "type", "header");
  cJSON_AddStringToObject(h, "reason", r->answered ? "digest" : "noanswer");
  cJSON_AddNumberToObject(h, "rank", r->rank);
  cJSON_AddStringToObject(h, "host", r->host);
  if (r->node >= 0) cJSON_AddNumberToObject(h, "node", r->node);
  if (r->local_rank >= 0) cJSON_AddNumberToObject(h, "local_rank", r->local_rank);
  cJSON_AddNumberToObject(h, "pid", r->pid);
  cJSON_AddNumberToObject(h, "unix_time", r->unix_time);
  char st[2] = {r->state, 0};
  cJSON_AddStringToObject(h, "state", st);
  cJSON *comms = cJSON_AddArrayToObject(h, "comms");
  for (int i = 0; i < r->ncomms; i++) {
    const diag_comm_t *c = &r->comms[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", c->name);
    cJSON_AddNumberToObject(o, "size", c->size);
    cJSON_AddNumberToObject(o, "issued", (double)c->issued);
    cJSON_AddNumberToObject(o, "done", (double)c->done);
    cJSON_AddItemToArray(comms, o);
  }
  return h;
}

static cJSON *op_json(const diag_comm_t *c, uint64_t seq, const char *op, uint64_t bytes) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "type", "op");
  cJSON_AddStringToObject(o, "comm", c->name);
  cJSON_AddNumberToObject(o, "seq", (double)seq);
  cJSON_AddStringToObject(o, "op", op);
  cJSON_AddNumberToObject(o, "bytes", (double)bytes);
  return o;
}

/* The lines of r's digest, in the order a dump has them: header, ops, the main thread. */
static int digest_lines(const diag_rank_t *r, cJSON **lines, int max) {
  int n = 0;
  lines[n++] = header_json(r);
  for (int i = 0; i < r->ncomms && n + 2 < max; i++) {
    const diag_comm_t *c = &r->comms[i];
    if (c->done_op[0]) lines[n++] = op_json(c, c->done, c->done_op, 0);
    if (c->next_op[0]) lines[n++] = op_json(c, c->done + 1, c->next_op, c->next_bytes);
    if (c->skipped && n + 2 < max) {
      lines[n] = op_json(c, c->skipped, c->skipped_op, 0);
      cJSON_AddStringToObject(lines[n++], "state", "skipped");
    }
  }
  cJSON *st = cJSON_CreateObject();
  cJSON_AddStringToObject(st, "type", "stack");
  cJSON_AddTrueToObject(st, "main");
  cJSON_AddTrueToObject(st, "dumping"); /* the frames are the main thread's own already */
  cJSON *fr = cJSON_AddArrayToObject(st, "frames");
  for (int f = 0; f < r->nframes; f++) cJSON_AddItemToArray(fr, cJSON_CreateString(r->frames[f]));
  lines[n++] = st;
  return n;
}

int diag_format(const diag_rank_t *r, char **out, size_t *len) {
  cJSON *lines[2 * DIAG_MAX_COMMS + 2];
  int n = digest_lines(r, lines, (int)(sizeof lines / sizeof lines[0]));
  size_t used = 0, cap = 0;
  char *text = NULL;
  int rc = 0;
  for (int i = 0; i < n; i++) {
    char *l = rc ? NULL : cJSON_PrintUnformatted(lines[i]);
    size_t k = l ? strlen(l) : 0;
    char *grown = l && used + k + 2 > cap ? realloc(text, cap = 2 * (used + k + 2)) : text;
    if (!l || !grown) rc = -ENOMEM;
    else {
      text = grown;
      memcpy(text + used, l, k);
      used += k;
      text[used++] = '\n';
      text[used] = 0;
    }
    free(l);
    cJSON_Delete(lines[i]);
  }
  if (rc) {
    free(text);
    return rc;
  }
  *out = text;
  *len = used;
  return 0;
}

int diag_write(const char *dir, const diag_rank_t *r, const char *tag) {
  char path[4200], *txt = NULL;
  size_t len = 0;
  snprintf(path, sizeof path, "%.4000s/flight-rank%d-pid%d-%.60s.jsonl", dir, r->rank, r->pid, tag);
  if (diag_format(r, &txt, &len)) return -ENOMEM;
  FILE *f = fopen(path, "we");
  int ok = f && fwrite(txt, 1, len, f) == len;
  int e = errno;
  if (f && fclose(f) && ok) ok = 0, e = errno;
  free(txt);
  return ok ? 0 : -e;
}

int diag_write_stub(const char *dir, const diag_rank_t *r) { return diag_write(dir, r, "noanswer"); }

/* ---- a folder */

static struct {
  diag_rank_t *v;
  int n, cap;
} walk; /* nftw passes no argument: diag_load_dir's state, one walk at a time */

static int is_dump_name(const char *base) {
  size_t n = strlen(base);
  return !strncmp(base, "flight-rank", 11) && n > 6 && !strcmp(base + n - 6, ".jsonl");
}

static int on_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  if (flag != FTW_F || !is_dump_name(path + ftw->base)) return 0;
  diag_rank_t r;
  char err[256];
  if (diag_parse_file(path, &r, err, sizeof err)) return 0; /* not a dump after all: skipped */
  for (int i = 0; i < walk.n; i++) {
    if (walk.v[i].rank != r.rank) continue;
    if (r.unix_time > walk.v[i].unix_time) walk.v[i] = r;
    return 0;
  }
  if (walk.n == walk.cap) {
    int cap = walk.cap ? 2 * walk.cap : 16;
    diag_rank_t *v = realloc(walk.v, (size_t)cap * sizeof *v);
    if (!v) return -ENOMEM;
    walk.v = v;
    walk.cap = cap;
  }
  walk.v[walk.n++] = r;
  return 0;
}

static int by_rank(const void *a, const void *b) {
  return ((const diag_rank_t *)a)->rank - ((const diag_rank_t *)b)->rank;
}

int diag_load_dir(const char *dir, diag_rank_t **out, int *n, char *err, size_t errlen) {
  memset(&walk, 0, sizeof walk);
  int rc = nftw(dir, on_entry, 16, FTW_PHYS);
  if (rc) {
    int e = rc < 0 && errno ? errno : ENOMEM;
    free(walk.v);
    return err_set(err, errlen, -e, "%s: %s", dir, strerror(e));
  }
  double newest = 0;
  for (int i = 0; i < walk.n; i++)
    if (walk.v[i].unix_time > newest) newest = walk.v[i].unix_time;
  int k = 0;
  for (int i = 0; i < walk.n; i++)
    if (walk.v[i].unix_time >= newest - DIAG_WINDOW_S) walk.v[k++] = walk.v[i];
  qsort(walk.v, (size_t)k, sizeof *walk.v, by_rank);
  *out = walk.v;
  *n = k;
  return 0;
}

/* ---- the diagnosis */

#define DIAG_MAX_GROUPS 64
#define DIAG_GROUP_LINES 4 /* stuck groups described */
#define DIAG_RANK_LINES 8  /* ranks described */

typedef struct {
  char *out;
  size_t len, used;
  int lines;
} text_t;

static void __attribute__((format(printf, 2, 3))) put(text_t *t, const char *fmt, ...) {
  if (t->used + 2 >= t->len) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(t->out + t->used, t->len - t->used - 1, fmt, ap);
  va_end(ap);
  if (k < 0) return;
  t->used += (size_t)k < t->len - t->used - 1 ? (size_t)k : t->len - t->used - 2;
  t->out[t->used++] = '\n';
  t->out[t->used] = 0;
  t->lines++;
}

/* The ranks as the console writes a rank set ("0-3,6": launcher/console.h), ",..." past what
 * fits. */
static void rank_list(const int *v, int n, char *out, size_t len) {
  if (console_format_ranks(v, n, out, len) < len) return;
  size_t k = len > 5 ? len - 5 : 0;
  while (k > 0 && out[k] != ',') k--;
  snprintf(out + k, len - k, ",...");
}

/* "host H, pid P", with the node on a job of several nodes: "host H, node N, pid P". */
static const char *rank_where(const diag_rank_t *r, char *buf, size_t len) {
  if (r->node >= 0) snprintf(buf, len, "host %s, node %d, pid %d", r->host, r->node, r->pid);
  else snprintf(buf, len, "host %s, pid %d", r->host, r->pid);
  return buf;
}

typedef struct {
  const char *name;
  int size, members;
  uint64_t call;     /* N: the call the group is stuck on */
  int *waiting, nw;  /* ranks that issued N and did not complete it */
  int *behind, nb;   /* ranks that never issued N */
  const diag_comm_t *op; /* a waiting rank's view of call N */
  int skipper;       /* the rank whose ring records call N as skipped, -1: none */
  int mismatch;      /* the waiting ranks name different ops or sizes for call N */
  char mismatch_text[160];
} group_t;

static const diag_comm_t *find_comm(const diag_rank_t *r, const char *name) {
  for (int i = 0; i < r->ncomms; i++)
    if (!strcmp(r->comms[i].name, name)) return &r->comms[i];
  return NULL;
}

/* Group g over the ranks that answered: its call N, who waits in it, who never entered it. */
static void analyse(group_t *g, const diag_rank_t *ranks, int n) {
  uint64_t lo = UINT64_MAX;
  for (int i = 0; i < n; i++) {
    const diag_comm_t *c = ranks[i].answered ? find_comm(&ranks[i], g->name) : NULL;
    if (!c) continue;
    g->members++;
    if (c->size > g->size) g->size = c->size;
    if (c->done < lo) lo = c->done;
  }
  g->call = lo + 1;
  g->skipper = -1;
  for (int i = 0; i < n; i++) {
    const diag_comm_t *c = ranks[i].answered ? find_comm(&ranks[i], g->name) : NULL;
    if (!c) continue;
    /* Past the call the others wait in, with a skip behind it: since the skip, its calls have
     * met its peers' earlier ones (a ring or a channel does not tell them apart). */
    if (g->skipper < 0 && c->skipped && c->skipped <= c->done && c->done >= g->call) g->skipper = ranks[i].rank;
    if (c->issued < g->call) {
      g->behind[g->nb++] = ranks[i].rank;
    } else if (c->done < g->call) {
      g->waiting[g->nw++] = ranks[i].rank;
      if (!g->op || !g->op->next_op[0]) {
        g->op = c;
      } else if (c->next_op[0] && (strcmp(c->next_op, g->op->next_op) || c->next_bytes != g->op->next_bytes)) {
        g->mismatch = 1;
        snprintf(g->mismatch_text, sizeof g->mismatch_text, "%s of %llu B, and rank %d: %s of %llu B",
                 g->op->next_op, (unsigned long long)g->op->next_bytes, ranks[i].rank, c->next_op,
                 (unsigned long long)c->next_bytes);
      }
    }
  }
}

/* "all_reduce #42" or "call #42" when no waiting rank's ring holds it. */
static void call_name(const group_t *g, char *out, size_t len) {
  if (g->op && g->op->next_op[0]) snprintf(out, len, "%s #%llu", g->op->next_op, (unsigned long long)g->call);
  else snprintf(out, len, "call #%llu", (unsigned long long)g->call);
}

static const char *state_words(char st) {
  switch (st) {
  case 'T':
  case 't': return "stopped";
  case 'D': return "in uninterruptible sleep";
  case 'Z': return "a zombie";
  case 0: return "state unknown";
  default: return "running or sleeping";
  }
}

typedef struct {
  const diag_rank_t *ranks;
  int n;
  group_t g[DIAG_MAX_GROUPS];
  int ng;
  int *pool; /* the groups' rank arrays */
  int stubs[DIAG_RANK_LINES], nstubs, all_stubs;
  int named; /* the rank the summary names, -1: none */
} diag_t;

/* The stuck groups, those with ranks behind or missing first. */
static int stuck_first(const void *a, const void *b) {
  const group_t *x = a, *y = b;
  int kx = (x->skipper >= 0) * 4 + (x->nb > 0) * 2 + (x->members < x->size),
      ky = (y->skipper >= 0) * 4 + (y->nb > 0) * 2 + (y->members < y->size);
  if (kx != ky) return ky - kx;
  return strcmp(x->name, y->name);
}

static int collect(diag_t *d) {
  d->pool = malloc(sizeof(int) * (size_t)(d->n ? d->n : 1) * 2 * DIAG_MAX_GROUPS);
  if (!d->pool) return -ENOMEM;
  for (int i = 0; i < d->n; i++) {
    const diag_rank_t *r = &d->ranks[i];
    if (!r->answered) {
      if (d->nstubs < DIAG_RANK_LINES) d->stubs[d->nstubs++] = i;
      d->all_stubs++;
      continue;
    }
    for (int c = 0; c < r->ncomms; c++) {
      int k = 0;
      while (k < d->ng && strcmp(d->g[k].name, r->comms[c].name)) k++;
      if (k < d->ng || d->ng == DIAG_MAX_GROUPS) continue;
      group_t *g = &d->g[d->ng];
      memset(g, 0, sizeof *g);
      g->name = r->comms[c].name;
      g->waiting = d->pool + (size_t)d->ng * 2 * (size_t)d->n;
      g->behind = g->waiting + d->n;
      d->ng++;
    }
  }
  int k = 0;
  for (int i = 0; i < d->ng; i++) {
    analyse(&d->g[i], d->ranks, d->n);
    if (d->g[i].nw > 0) d->g[k++] = d->g[i]; /* a group nobody waits in is not stuck */
  }
  d->ng = k;
  qsort(d->g, (size_t)d->ng, sizeof d->g[0], stuck_first);
  return 0;
}

static const diag_rank_t *rank_of(const diag_t *d, int rank) {
  for (int i = 0; i < d->n; i++)
    if (d->ranks[i].rank == rank) return &d->ranks[i];
  return NULL;
}

static void summary(diag_t *d, text_t *t) {
  char who[256], call[48], at[200];
  const group_t *g = d->ng ? &d->g[0] : NULL;
  if (g) {
    call_name(g, call, sizeof call);
    rank_list(g->waiting, g->nw, who, sizeof who);
  }
  if (d->nstubs) {
    const diag_rank_t *s = &d->ranks[d->stubs[0]];
    d->named = s->rank;
    if (g)
      put(t, "hang: rank %d (%s) did not answer the dump request (%s); rank%s %s wait%s in %s of group %s",
          s->rank, rank_where(s, at, sizeof at), state_words(s->state), g->nw > 1 ? "s" : "", who, g->nw > 1 ? "" : "s", call,
          g->name);
    else
      put(t, "hang: rank %d (%s) did not answer the dump request (%s)", s->rank, rank_where(s, at, sizeof at),
          state_words(s->state));
  } else if (g && g->skipper >= 0) {
    const diag_rank_t *b = rank_of(d, g->skipper);
    const diag_comm_t *c = find_comm(b, g->name);
    d->named = b->rank;
    char now[64];
    if (c->issued > c->done) snprintf(now, sizeof now, "waits in #%llu", (unsigned long long)c->issued);
    else snprintf(now, sizeof now, "has completed #%llu", (unsigned long long)c->done);
    put(t, "hang: rank %d (%s) skipped %s #%llu of group %s: it %s while rank%s %s wait%s in #%llu", b->rank,
        rank_where(b, at, sizeof at), c->skipped_op, (unsigned long long)c->skipped, g->name, now,
        g->nw > 1 ? "s" : "", who, g->nw > 1 ? "" : "s", (unsigned long long)g->call);
  } else if (g && g->nb) {
    const diag_rank_t *b = rank_of(d, g->behind[0]);
    d->named = b->rank;
    put(t, "hang: rank %d (%s) never entered %s of group %s, which rank%s %s wait%s in", b->rank,
        rank_where(b, at, sizeof at), call, g->name, g->nw > 1 ? "s" : "", who, g->nw > 1 ? "" : "s");
  } else if (g && g->mismatch) {
    put(t, "hang: the ranks of group %s disagree on its call #%llu: rank %d: %s", g->name, (unsigned long long)g->call,
        g->waiting[0], g->mismatch_text);
  } else if (g) {
    put(t, "hang: rank%s %s wait%s in %s of group %s, and every member entered it", g->nw > 1 ? "s" : "", who,
        g->nw > 1 ? "" : "s", call, g->name);
  } else {
    put(t, "hang: no rank waits in a recorded collective (%d dump%s); their stacks follow", d->n, d->n == 1 ? "" : "s");
  }
}

static void group_lines(const diag_t *d, text_t *t) {
  for (int i = 0; i < d->ng && i < DIAG_GROUP_LINES; i++) {
    const group_t *g = &d->g[i];
    char call[48], who[256], behind[256] = "", missing[256] = "";
    call_name(g, call, sizeof call);
    rank_list(g->waiting, g->nw, who, sizeof who);
    if (g->nb) {
      char l[220];
      rank_list(g->behind, g->nb, l, sizeof l);
      snprintf(behind, sizeof behind, "; never entered it: rank%s %s", g->nb > 1 ? "s" : "", l);
    }
    if (g->members < g->size)
      snprintf(missing, sizeof missing, "; %d member%s sent no dump", g->size - g->members,
               g->size - g->members > 1 ? "s" : "");
    put(t, "  group %s (%d ranks): %s (%llu B): waiting: rank%s %s%s%s", g->name, g->size, call,
        g->op ? (unsigned long long)g->op->next_bytes : 0ULL, g->nw > 1 ? "s" : "", who, behind, missing);
  }
}

static void stack_text(const diag_rank_t *r, char *out, size_t len) {
  size_t k = 0;
  out[0] = 0;
  for (int f = 0; f < r->nframes && k < len; f++) k += (size_t)snprintf(out + k, len - k, "%s%s", f ? " < " : "", r->frames[f]);
  if (!r->nframes) snprintf(out, len, "(none)");
}

static void rank_lines(const diag_t *d, text_t *t) {
  char at[200];
  int shown = 0;
  for (int i = 0; i < d->nstubs; i++, shown++) {
    const diag_rank_t *s = &d->ranks[d->stubs[i]];
    put(t, "  rank %d (%s): did not answer the dump request: %s%s%c%s", s->rank, rank_where(s, at, sizeof at),
        state_words(s->state), s->state ? " (state " : "", s->state ? s->state : ' ', s->state ? ")" : "");
  }
  if (d->all_stubs > d->nstubs) put(t, "  ... and %d more ranks that did not answer", d->all_stubs - d->nstubs);
  for (int i = 0; i < d->ng && shown < DIAG_RANK_LINES; i++) {
    const diag_rank_t *b = d->g[i].skipper >= 0 ? rank_of(d, d->g[i].skipper) : NULL;
    if (!b) continue;
    const diag_comm_t *c = find_comm(b, d->g[i].name);
    char st[4 * 96 + 16];
    stack_text(b, st, sizeof st);
    put(t, "  rank %d (%s): skipped call #%llu (%s) of group %s, completed #%llu; stack: %s", b->rank,
        rank_where(b, at, sizeof at), (unsigned long long)c->skipped, c->skipped_op, d->g[i].name,
        (unsigned long long)c->done, st);
    shown++;
  }
  for (int i = 0; i < d->ng && shown < DIAG_RANK_LINES; i++) {
    const group_t *g = &d->g[i];
    for (int j = 0; j < g->nb && shown < DIAG_RANK_LINES; j++, shown++) {
      const diag_rank_t *b = rank_of(d, g->behind[j]);
      const diag_comm_t *c = find_comm(b, g->name);
      char st[4 * 96 + 16];
      stack_text(b, st, sizeof st);
      put(t, "  rank %d (%s): last completed call #%llu%s%s%s of group %s; stack: %s", b->rank,
          rank_where(b, at, sizeof at), (unsigned long long)c->done, c->done_op[0] ? " (" : "", c->done_op, c->done_op[0] ? ")" : "",
          g->name, st);
    }
  }
  if (!d->ng) {
    for (int i = 0; i < d->n && shown < DIAG_RANK_LINES; i++, shown++) {
      if (!d->ranks[i].answered) continue;
      char st[4 * 96 + 16];
      stack_text(&d->ranks[i], st, sizeof st);
      put(t, "  rank %d (%s): stack: %s", d->ranks[i].rank, rank_where(&d->ranks[i], at, sizeof at), st);
    }
  }
}

int diag_report(const diag_rank_t *ranks, int n, char *out, size_t len, int *named) {
  text_t t = {.out = out, .len = len};
  if (len) out[0] = 0;
  if (named) *named = -1;
  diag_t *d = calloc(1, sizeof *d);
  if (!d) return 0;
  d->ranks = ranks;
  d->n = n;
  d->named = -1;
  if (collect(d)) {
    put(&t, "hang: out of memory for the diagnosis of %d ranks", n);
  } else {
    summary(d, &t);
    group_lines(d, &t);
    rank_lines(d, &t);
  }
  if (named) *named = d->named;
  free(d->pool);
  free(d);
  return t.lines;
}
