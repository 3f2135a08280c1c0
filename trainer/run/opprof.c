/* opprof: per-kernel times of one training step (see opprof.h).
 *
 * The original table is kept in `orig`; each wrapper asks prof_begin whether this call is timed
 * (inside the profiled step, and not nested in another timed call), runs the original, and
 * prof_end records it under its op name and a shape key formatted only then. Synchronizing
 * before the call makes the clock start when the device is idle, so the call's time is its own
 * and not the tail of the kernels queued before it. */
#include "common/err.h"
#include "trainer/run/opprof.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PROF_MAX_KEYS 512

typedef struct {
  const char *op;
  char shape[80];
  int calls;
  double secs;
  double flops; /* 0 for kernels whose FLOPs are not counted */
} prof_entry_t;

static struct {
  backend_t *be;       /* the wrapped backend, NULL when none */
  struct backend orig; /* its table before wrapping */
  FILE *out;
  int step;            /* the profiled step (1-based) */
  pthread_t thread;    /* the one that runs the step */
  pthread_t owner;     /* the one that installed the wrapper: only its calls are counted */
  opcount_t count;     /* since install */
  opcount_t at_begin;  /* count when the current step began */
  opcount_t last;      /* the last step that ended */
  int active;          /* inside the profiled step */
  int depth;           /* timed calls in progress (a wrapper calling another is not timed twice) */
  int dropped;         /* calls past PROF_MAX_KEYS distinct shapes */
  double floor_s;      /* a synchronize-launch-synchronize with nothing in it */
  int n;
  prof_entry_t e[PROF_MAX_KEYS];
} P;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int opprof_step_from_env(char *err, size_t errlen) {
  const char *s = getenv("MESHRUN_OP_PROFILE");
  if (!s || !*s) return 0;
  char *end = NULL;
  long v = strtol(s, &end, 10);
  if (*end || v < 1 || v > 1000000000L) {
    return err_set(err, errlen, -1, "MESHRUN_OP_PROFILE=%s: expected the step to profile, a positive integer", s);
  }
  return (int)v;
}

static int counted(void) { return pthread_equal(pthread_self(), P.owner); }

/* -2: not profiled (outside the step, or another thread: a comm's progress thread may convert
 * or copy while the step runs); -1: nested in a timed call; else the start time. Every call of
 * the installing thread counts as a kernel. */
static double prof_begin(void) {
  if (counted()) P.count.kernels++;
  if (!P.active || !pthread_equal(pthread_self(), P.thread)) return -2;
  if (P.depth++ > 0) return -1;
  P.orig.synchronize(P.be);
  return now_s();
}

static void prof_end(double t0, const char *op, double flops, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void prof_end(double t0, const char *op, double flops, const char *fmt, ...) {
  if (t0 == -2) return;
  P.depth--;
  if (t0 < 0) return;
  P.orig.synchronize(P.be);
  double dt = now_s() - t0;
  char shape[sizeof P.e[0].shape];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(shape, sizeof shape, fmt, ap);
  va_end(ap);
  prof_entry_t *e = NULL;
  for (int i = 0; i < P.n && !e; i++)
    if (P.e[i].op == op && !strcmp(P.e[i].shape, shape)) e = &P.e[i];
  if (!e) {
    if (P.n == PROF_MAX_KEYS) {
      P.dropped++;
      return;
    }
    e = &P.e[P.n++];
    e->op = op;
    snprintf(e->shape, sizeof e->shape, "%s", shape);
  }
  e->calls++;
  e->secs += dt;
  e->flops += flops;
}

/* --- the replay watch (opprof_replay_watch): each call inside the marked part of a step as one
 * line of its op and arguments, pointers and scalars as they were passed; the lists of the last
 * REPLAY_STEPS steps kept to compare */

enum { REPLAY_STEPS = 3, REPLAY_LINE = 200 };

typedef struct {
  char (*line)[REPLAY_LINE];
  int n, cap;
} replay_list_t;

static struct {
  int on, marked;
  replay_list_t cur, done[REPLAY_STEPS]; /* done[0]: the last step that ended */
  opcount_t at_mark, cur_in, in_marked[REPLAY_STEPS]; /* host syncs and allocations in the marked part */
} R;

static void replay_free(void) {
  free(R.cur.line);
  for (int i = 0; i < REPLAY_STEPS; i++) free(R.done[i].line);
  memset(&R, 0, sizeof R);
}

static void note(const char *op, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(const char *op, const char *fmt, ...) {
  replay_list_t *l = &R.cur;
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 256;
    void *p = realloc(l->line, (size_t)cap * sizeof *l->line);
    if (!p) return; /* the list ends short: a comparison then fails on its length */
    l->line = p;
    l->cap = cap;
  }
  int k = snprintf(l->line[l->n], REPLAY_LINE, "%s(", op);
  va_list ap;
  va_start(ap, fmt);
  if (k > 0 && k < REPLAY_LINE) k += vsnprintf(l->line[l->n] + k, REPLAY_LINE - k, fmt, ap);
  va_end(ap);
  if (k > 0 && k < REPLAY_LINE - 1) strcat(l->line[l->n], ")");
  l->n++;
}

/* Only the installing thread's calls inside the marked part: a comm's progress thread is not
 * the step the device would record. */
#define NOTE(op, ...)                                          \
  do {                                                         \
    if (R.marked && counted()) note(op, __VA_ARGS__);          \
  } while (0)

static void replay_step_end(void) {
  if (!R.on) return;
  free(R.done[REPLAY_STEPS - 1].line);
  memmove(&R.done[1], &R.done[0], (REPLAY_STEPS - 1) * sizeof R.done[0]);
  memmove(&R.in_marked[1], &R.in_marked[0], (REPLAY_STEPS - 1) * sizeof R.in_marked[0]);
  R.done[0] = R.cur;
  R.in_marked[0] = R.cur_in;
  memset(&R.cur, 0, sizeof R.cur);
  memset(&R.cur_in, 0, sizeof R.cur_in);
  R.marked = 0;
}

void opprof_replay_watch(int on) {
  replay_free();
  R.on = on;
}

void opprof_replay_mark(int begin) {
  if (!R.on || !P.be) return;
  if (begin) {
    R.marked = 1;
    R.at_mark = P.count;
    return;
  }
  R.marked = 0;
  R.cur_in = (opcount_t){.host_syncs = P.count.host_syncs - R.at_mark.host_syncs,
                         .allocs = P.count.allocs - R.at_mark.allocs};
}

int opprof_replay_diff(int back, char *msg, size_t len) {
  msg[0] = '\0';
  if (back < 1 || back >= REPLAY_STEPS || !R.done[back].line || !R.done[0].line) {
    snprintf(msg, len, "no steps %d apart were watched", back);
    return -1;
  }
  const replay_list_t *a = &R.done[back], *b = &R.done[0];
  const opcount_t *c = &R.in_marked[0];
  if (c->host_syncs || c->allocs) {
    snprintf(msg, len, "the marked part of the last step has %llu host syncs and %llu allocations or frees",
             (unsigned long long)c->host_syncs, (unsigned long long)c->allocs);
    return 1;
  }
  for (int i = 0; i < a->n || i < b->n; i++) {
    const char *x = i < a->n ? a->line[i] : "(nothing)", *y = i < b->n ? b->line[i] : "(nothing)";
    if (strcmp(x, y)) {
      snprintf(msg, len, "call %d of %d: %s, then %d steps later %s", i + 1, b->n, x, back, y);
      return 1;
    }
  }
  snprintf(msg, len, "%d calls, the same", b->n);
  return 0;
}

#define DT(dt) dtype_name(dt)

/* --- the wrappers: one per compute entry of struct backend, in its order */

static void w_matmul(backend_t *be, void *c, const void *a, const void *b, int m, int n, int k, int ta, int tb,
                     float alpha, float beta, dtype_t ab_dt, dtype_t c_dt) {
  NOTE("matmul", "%p %p %p %d %d %d %d %d %a %a %d %d", c, a, b, m, n, k, ta, tb, alpha, beta, ab_dt, c_dt);
  double t0 = prof_begin();
  P.orig.matmul(be, c, a, b, m, n, k, ta, tb, alpha, beta, ab_dt, c_dt);
  prof_end(t0, "matmul", 2.0 * m * n * k, "m%d n%d k%d %c%c %s>%s%s", m, n, k, ta ? 'T' : 'N', tb ? 'T' : 'N',
           DT(ab_dt), DT(c_dt), beta != 0.0f ? " +=" : "");
}

static void w_add(backend_t *be, void *out, const void *a, const void *b, size_t n, dtype_t dt) {
  NOTE("add", "%p %p %p %zu %d", out, a, b, n, dt);
  double t0 = prof_begin();
  P.orig.add(be, out, a, b, n, dt);
  prof_end(t0, "add", 0, "n%zu %s", n, DT(dt));
}

static void w_scale(backend_t *be, float *x, float s, size_t n) {
  NOTE("scale", "%p %a %zu", x, s, n);
  double t0 = prof_begin();
  P.orig.scale(be, x, s, n);
  prof_end(t0, "scale", 0, "n%zu fp32", n);
}

/* --- counted only: the host's waits for the device and its copies */

static void w_synchronize(backend_t *be) {
  NOTE("synchronize", "%s", "");
  if (counted()) P.count.host_syncs++;
  P.orig.synchronize(be);
}

static void w_to_host(backend_t *be, void *host_dst, const void *src, size_t bytes) {
  NOTE("to_host", "%p %p %zu", host_dst, src, bytes);
  if (counted()) {
    P.count.host_syncs++;
    P.count.bytes_to_host += bytes;
  }
  P.orig.to_host(be, host_dst, src, bytes);
}

static void w_to_device(backend_t *be, void *dst, const void *host_src, size_t bytes) {
  NOTE("to_device", "%p %p %zu", dst, host_src, bytes);
  if (counted()) P.count.bytes_to_device += bytes;
  P.orig.to_device(be, dst, host_src, bytes);
}

static double w_sumsq(backend_t *be, const float *x, size_t n) {
  NOTE("sumsq", "%p %zu", x, n);
  if (counted()) P.count.host_syncs++;
  double t0 = prof_begin();
  double r = P.orig.sumsq(be, x, n);
  prof_end(t0, "sumsq", 0, "n%zu fp32", n);
  return r;
}

static void w_sumsq_parts(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                          double *out) {
  NOTE("sumsq_parts", "%p %p %p %d %p", x, offset, count, n, out);
  if (counted()) P.count.host_syncs++;
  double t0 = prof_begin();
  size_t all = 0;
  for (int i = 0; i < n; i++) all += count[i];
  P.orig.sumsq_parts(be, x, offset, count, n, out);
  prof_end(t0, "sumsq_parts", 0, "%d parts n%zu fp32", n, all);
}

static void w_convert(backend_t *be, void *dst, dtype_t dst_dt, const void *src, dtype_t src_dt, size_t n) {
  NOTE("convert", "%p %d %p %d %zu", dst, dst_dt, src, src_dt, n);
  double t0 = prof_begin();
  P.orig.convert(be, dst, dst_dt, src, src_dt, n);
  prof_end(t0, "convert", 0, "n%zu %s>%s", n, DT(src_dt), DT(dst_dt));
}

static void w_embedding_fwd(backend_t *be, void *out, const void *table, const int32_t *tokens, int n, int c,
                            int vocab_start, int rows, dtype_t dt) {
  NOTE("embedding_fwd", "%p %p %p %d %d %d %d %d", out, table, tokens, n, c, vocab_start, rows, dt);
  double t0 = prof_begin();
  P.orig.embedding_fwd(be, out, table, tokens, n, c, vocab_start, rows, dt);
  prof_end(t0, "embedding_fwd", 0, "n%d c%d %s", n, c, DT(dt));
}

static void w_embedding_bwd(backend_t *be, float *dtable, const void *dout, const int32_t *tokens, int n, int c,
                            int vocab_start, int rows, dtype_t dt) {
  NOTE("embedding_bwd", "%p %p %p %d %d %d %d %d", dtable, dout, tokens, n, c, vocab_start, rows, dt);
  double t0 = prof_begin();
  P.orig.embedding_bwd(be, dtable, dout, tokens, n, c, vocab_start, rows, dt);
  prof_end(t0, "embedding_bwd", 0, "n%d c%d %s", n, c, DT(dt));
}

static void w_rmsnorm_fwd(backend_t *be, void *out, float *rstd, const void *x, const void *w, int n, int c, float eps,
                          dtype_t dt) {
  NOTE("rmsnorm_fwd", "%p %p %p %p %d %d %a %d", out, rstd, x, w, n, c, eps, dt);
  double t0 = prof_begin();
  P.orig.rmsnorm_fwd(be, out, rstd, x, w, n, c, eps, dt);
  prof_end(t0, "rmsnorm_fwd", 0, "n%d c%d %s", n, c, DT(dt));
}

static void w_rmsnorm_bwd(backend_t *be, void *dx, float *dw, const void *dout, const void *x, const void *w,
                          const float *rstd, int n, int c, dtype_t dt) {
  NOTE("rmsnorm_bwd", "%p %p %p %p %p %p %d %d %d", dx, dw, dout, x, w, rstd, n, c, dt);
  double t0 = prof_begin();
  P.orig.rmsnorm_bwd(be, dx, dw, dout, x, w, rstd, n, c, dt);
  prof_end(t0, "rmsnorm_bwd", 0, "n%d c%d %s", n, c, DT(dt));
}

static void w_add_rmsnorm_fwd(backend_t *be, void *sum, void *out, float *rstd, const void *a, const void *b,
                              const void *w, int n, int c, float eps, dtype_t dt) {
  NOTE("add_rmsnorm_fwd", "%p %p %p %p %p %p %d %d %a %d", sum, out, rstd, a, b, w, n, c, eps, dt);
  double t0 = prof_begin();
  P.orig.add_rmsnorm_fwd(be, sum, out, rstd, a, b, w, n, c, eps, dt);
  prof_end(t0, "add_rmsnorm_fwd", 0, "n%d c%d %s", n, c, DT(dt));
}

static void w_rope_fwd(backend_t *be, void *x, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt) {
  NOTE("rope_fwd", "%p %d %d %d %d %d %a %d", x, b, t, h, d, pos_offset, theta, dt);
  double t0 = prof_begin();
  P.orig.rope_fwd(be, x, b, t, h, d, pos_offset, theta, dt);
  prof_end(t0, "rope_fwd", 0, "b%d t%d h%d d%d %s", b, t, h, d, DT(dt));
}

static void w_rope_bwd(backend_t *be, void *dx, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt) {
  NOTE("rope_bwd", "%p %d %d %d %d %d %a %d", dx, b, t, h, d, pos_offset, theta, dt);
  double t0 = prof_begin();
  P.orig.rope_bwd(be, dx, b, t, h, d, pos_offset, theta, dt);
  prof_end(t0, "rope_bwd", 0, "b%d t%d h%d d%d %s", b, t, h, d, DT(dt));
}

static void w_qkv_rope_fwd(backend_t *be, void *q, void *k, void *v, const void *qkv, int b, int t, int h, int kv,
                           int d, int pos_offset, float theta, dtype_t dt) {
  NOTE("qkv_rope_fwd", "%p %p %p %p %d %d %d %d %d %d %a %d", q, k, v, qkv, b, t, h, kv, d, pos_offset, theta, dt);
  double t0 = prof_begin();
  P.orig.qkv_rope_fwd(be, q, k, v, qkv, b, t, h, kv, d, pos_offset, theta, dt);
  prof_end(t0, "qkv_rope_fwd", 0, "b%d t%d h%d kv%d d%d %s", b, t, h, kv, d, DT(dt));
}

static void w_qkv_rope_bwd(backend_t *be, void *dqkv, const void *dq, const void *dk, const void *dv, int b, int t,
                           int h, int kv, int d, int pos_offset, float theta, dtype_t dt) {
  NOTE("qkv_rope_bwd", "%p %p %p %p %d %d %d %d %d %d %a %d", dqkv, dq, dk, dv, b, t, h, kv, d, pos_offset, theta,
       dt);
  double t0 = prof_begin();
  P.orig.qkv_rope_bwd(be, dqkv, dq, dk, dv, b, t, h, kv, d, pos_offset, theta, dt);
  prof_end(t0, "qkv_rope_bwd", 0, "b%d t%d h%d kv%d d%d %s", b, t, h, kv, d, DT(dt));
}

/* Causal attention FLOPs as the MFU formula counts them would be the full square; here the
 * useful half: QK^T and PV over the lower triangle, 2 * 2 * b * h * t^2/2 * d forward, and
 * 2.5 times that backward (dQ, dK, dV and the recomputed scores). */
static void w_attention_fwd(backend_t *be, void *out, float *lse, const void *q, const void *k, const void *v, int b,
                            int t, int h, int kv, int d, dtype_t dt) {
  NOTE("attention_fwd", "%p %p %p %p %p %d %d %d %d %d %d", out, lse, q, k, v, b, t, h, kv, d, dt);
  double t0 = prof_begin();
  P.orig.attention_fwd(be, out, lse, q, k, v, b, t, h, kv, d, dt);
  prof_end(t0, "attention_fwd", 2.0 * b * h * (double)t * t * d, "b%d t%d h%d kv%d d%d %s", b, t, h, kv, d, DT(dt));
}

static void w_attention_bwd(backend_t *be, void *dq, void *dk, void *dv, const void *dout, const void *q,
                            const void *k, const void *v, const void *out, const float *lse, int b, int t, int h,
                            int kv, int d, dtype_t dt) {
  NOTE("attention_bwd", "%p %p %p %p %p %p %p %p %p %d %d %d %d %d %d", dq, dk, dv, dout, q, k, v, out, lse, b, t,
       h, kv, d, dt);
  double t0 = prof_begin();
  P.orig.attention_bwd(be, dq, dk, dv, dout, q, k, v, out, lse, b, t, h, kv, d, dt);
  prof_end(t0, "attention_bwd", 5.0 * b * h * (double)t * t * d, "b%d t%d h%d kv%d d%d %s", b, t, h, kv, d, DT(dt));
}

/* The pairs (query, key) a block of attention computes: the causal part of the tq x tk square. */
static double att_block_pairs(int tq, int tk, long q_pos, long k_pos) {
  double pairs = 0;
  for (int i = 0; i < tq; i++) {
    long seen = q_pos + i - k_pos + 1;
    pairs += seen < 0 ? 0 : seen > tk ? tk : seen;
  }
  return pairs;
}

static void w_attention_fwd_block(backend_t *be, float *out, float *lse, const void *q, const void *k, const void *v,
                                  int b, int tq, int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt) {
  NOTE("attention_fwd_block", "%p %p %p %p %p %d %d %d %d %d %d %ld %ld %d", out, lse, q, k, v, b, tq, tk, h, kv, d,
       q_pos, k_pos, dt);
  double t0 = prof_begin();
  P.orig.attention_fwd_block(be, out, lse, q, k, v, b, tq, tk, h, kv, d, q_pos, k_pos, dt);
  prof_end(t0, "attention_fwd_block", 4.0 * b * h * att_block_pairs(tq, tk, q_pos, k_pos) * d,
           "b%d tq%d tk%d h%d kv%d d%d q%ld k%ld %s", b, tq, tk, h, kv, d, q_pos, k_pos, DT(dt));
}

static void w_attention_merge(backend_t *be, float *out, float *lse, const float *out_b, const float *lse_b, int b,
                              int t, int h, int d) {
  NOTE("attention_merge", "%p %p %p %p %d %d %d %d", out, lse, out_b, lse_b, b, t, h, d);
  double t0 = prof_begin();
  P.orig.attention_merge(be, out, lse, out_b, lse_b, b, t, h, d);
  prof_end(t0, "attention_merge", 0, "b%d t%d h%d d%d", b, t, h, d);
}

static void w_attention_bwd_block(backend_t *be, float *dq, float *dk, float *dv, const void *dout, const void *q,
                                  const void *k, const void *v, const void *out, const float *lse, int b, int tq,
                                  int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt) {
  NOTE("attention_bwd_block", "%p %p %p %p %p %p %p %p %p %d %d %d %d %d %d %ld %ld %d", dq, dk, dv, dout, q, k, v,
       out, lse, b, tq, tk, h, kv, d, q_pos, k_pos, dt);
  double t0 = prof_begin();
  P.orig.attention_bwd_block(be, dq, dk, dv, dout, q, k, v, out, lse, b, tq, tk, h, kv, d, q_pos, k_pos, dt);
  prof_end(t0, "attention_bwd_block", 10.0 * b * h * att_block_pairs(tq, tk, q_pos, k_pos) * d,
           "b%d tq%d tk%d h%d kv%d d%d q%ld k%ld %s", b, tq, tk, h, kv, d, q_pos, k_pos, DT(dt));
}

static void w_swiglu_fwd(backend_t *be, void *out, const void *ag, int n, int f, dtype_t dt) {
  NOTE("swiglu_fwd", "%p %p %d %d %d", out, ag, n, f, dt);
  double t0 = prof_begin();
  P.orig.swiglu_fwd(be, out, ag, n, f, dt);
  prof_end(t0, "swiglu_fwd", 0, "n%d f%d %s", n, f, DT(dt));
}

static void w_swiglu_bwd(backend_t *be, void *dag, const void *dout, const void *ag, int n, int f, dtype_t dt) {
  NOTE("swiglu_bwd", "%p %p %p %d %d %d", dag, dout, ag, n, f, dt);
  double t0 = prof_begin();
  P.orig.swiglu_bwd(be, dag, dout, ag, n, f, dt);
  prof_end(t0, "swiglu_bwd", 0, "n%d f%d %s", n, f, DT(dt));
}

static void w_cross_entropy(backend_t *be, float *losses, void *dlogits, const void *logits, const int32_t *targets,
                            int n, int v, int ld, float grad_scale, dtype_t dt) {
  NOTE("cross_entropy", "%p %p %p %p %d %d %d %a %d", losses, dlogits, logits, targets, n, v, ld, grad_scale, dt);
  double t0 = prof_begin();
  P.orig.cross_entropy(be, losses, dlogits, logits, targets, n, v, ld, grad_scale, dt);
  prof_end(t0, "cross_entropy", 0, "n%d v%d %s", n, v, DT(dt));
}

static void w_copy_2d(backend_t *be, void *dst, int ldd, const void *src, int lds, int rows, int cols, dtype_t dt) {
  NOTE("copy_2d", "%p %d %p %d %d %d %d", dst, ldd, src, lds, rows, cols, dt);
  double t0 = prof_begin();
  P.orig.copy_2d(be, dst, ldd, src, lds, rows, cols, dt);
  prof_end(t0, "copy_2d", 0, "%dx%d %s", rows, cols, DT(dt));
}

static void w_ce_shard_max(backend_t *be, float *rowmax, const void *logits, int n, int v, int ld, dtype_t dt) {
  NOTE("ce_shard_max", "%p %p %d %d %d %d", rowmax, logits, n, v, ld, dt);
  double t0 = prof_begin();
  P.orig.ce_shard_max(be, rowmax, logits, n, v, ld, dt);
  prof_end(t0, "ce_shard_max", 0, "n%d v%d %s", n, v, DT(dt));
}

static void w_ce_shard_stats(backend_t *be, float *stats, const void *logits, const float *rowmax,
                             const int32_t *targets, int n, int v, int ld, int vocab_start, dtype_t dt) {
  NOTE("ce_shard_stats", "%p %p %p %p %d %d %d %d %d", stats, logits, rowmax, targets, n, v, ld, vocab_start, dt);
  double t0 = prof_begin();
  P.orig.ce_shard_stats(be, stats, logits, rowmax, targets, n, v, ld, vocab_start, dt);
  prof_end(t0, "ce_shard_stats", 0, "n%d v%d %s", n, v, DT(dt));
}

static void w_ce_shard_loss(backend_t *be, float *losses, void *dlogits, const void *logits, const float *rowmax,
                            const float *stats, const int32_t *targets, int n, int v, int ld, int vocab_start,
                            float grad_scale, dtype_t dt) {
  NOTE("ce_shard_loss", "%p %p %p %p %p %p %d %d %d %d %a %d", losses, dlogits, logits, rowmax, stats, targets, n,
       v, ld, vocab_start, grad_scale, dt);
  double t0 = prof_begin();
  P.orig.ce_shard_loss(be, losses, dlogits, logits, rowmax, stats, targets, n, v, ld, vocab_start, grad_scale, dt);
  prof_end(t0, "ce_shard_loss", 0, "n%d v%d %s", n, v, DT(dt));
}

static void w_adamw(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp, size_t n,
                    float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
  NOTE("adamw", "%p %p %p %p %p %zu %a %a %a %a %a %d %a", param, grad, m, v, param_lp, n, lr, beta1, beta2, eps,
       weight_decay, step, grad_scale);
  double t0 = prof_begin();
  P.orig.adamw(be, param, grad, m, v, param_lp, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  prof_end(t0, "adamw", 0, "n%zu%s", n, param_lp ? " +bf16" : "");
}

static void w_adamw_multi(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                          const adamw_segment_t *segs, int n_segs, float lr, float beta1, float beta2, float eps,
                          float weight_decay, int step, float grad_scale) {
  NOTE("adamw_multi", "%p %p %p %p %p %p %d %a %a %a %a %a %d %a", param, grad, m, v, param_lp, segs, n_segs, lr,
       beta1, beta2, eps, weight_decay, step, grad_scale);
  double t0 = prof_begin();
  P.orig.adamw_multi(be, param, grad, m, v, param_lp, segs, n_segs, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale);
  prof_end(t0, "adamw_multi", 0, "segs%d%s", n_segs, param_lp ? " +bf16" : "");
}

static void w_step_loss(backend_t *be, const float *rows, int n, int valid, int micro, int accum, int poison,
                        double *stat, float *mean) {
  NOTE("step_loss", "%p %d %d %d %d %d %p %p", rows, n, valid, micro, accum, poison, stat, mean);
  double t0 = prof_begin();
  P.orig.step_loss(be, rows, n, valid, micro, accum, poison, stat, mean);
  prof_end(t0, "step_loss", 0, "n%d", n);
}

static void w_sumsq_groups(backend_t *be, const float *x, const size_t *offset, const size_t *count,
                           const int *group, int n, double *sums, float *shares) {
  NOTE("sumsq_groups", "%p %p %p %p %d %p %p", x, offset, count, group, n, sums, shares);
  double t0 = prof_begin();
  size_t all = 0;
  for (int i = 0; i < n; i++) all += count[i];
  P.orig.sumsq_groups(be, x, offset, count, group, n, sums, shares);
  prof_end(t0, "sumsq_groups", 0, "%d parts n%zu fp32", n, all);
}

static void w_sumsq_parts_add(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                              double *out) {
  NOTE("sumsq_parts_add", "%p %p %p %d %p", x, offset, count, n, out);
  double t0 = prof_begin();
  size_t all = 0;
  for (int i = 0; i < n; i++) all += count[i];
  P.orig.sumsq_parts_add(be, x, offset, count, n, out);
  prof_end(t0, "sumsq_parts_add", 0, "%d parts n%zu fp32", n, all);
}

static void w_clip_scale(backend_t *be, const double *sums, const float *shares, int use_shares, double clip,
                         double *norm, float *scale) {
  NOTE("clip_scale", "%p %p %d %a %p %p", sums, shares, use_shares, clip, norm, scale);
  double t0 = prof_begin();
  P.orig.clip_scale(be, sums, shares, use_shares, clip, norm, scale);
  prof_end(t0, "clip_scale", 0, "%s", use_shares ? "shares" : "sums");
}

static void w_adamw_multi_dev(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                              const adamw_segment_t *segs, int n_segs, float beta1, float beta2, float eps,
                              float weight_decay, const adamw_step_t *st, const float *grad_scale) {
  NOTE("adamw_multi_dev", "%p %p %p %p %p %p %d %a %a %a %a %p %p", param, grad, m, v, param_lp, segs, n_segs, beta1,
       beta2, eps, weight_decay, st, grad_scale);
  double t0 = prof_begin();
  P.orig.adamw_multi_dev(be, param, grad, m, v, param_lp, segs, n_segs, beta1, beta2, eps, weight_decay, st,
                         grad_scale);
  /* the same kernel as adamw_multi's: its row, the shape saying where the scale came from */
  prof_end(t0, "adamw_multi", 0, "segs%d%s, scale on the device", n_segs, param_lp ? " +bf16" : "");
}

static void w_step_skip(backend_t *be, const float *loss, const double *norm, int nonfinite, double loss_z,
                        double norm_z, skip_window_t *win, skip_verdict_t *out, adamw_step_t *st) {
  NOTE("step_skip", "%p %p %d %a %a %p %p %p", loss, norm, nonfinite, loss_z, norm_z, win, out, st);
  double t0 = prof_begin();
  P.orig.step_skip(be, loss, norm, nonfinite, loss_z, norm_z, win, out, st);
  prof_end(t0, "step_skip", 0, "window");
}

/* An upload's bytes count as to_device's; it is no host sync (nothing waits for the device). */
static void w_upload_async(backend_t *be, void *dst, const void *src, size_t bytes, int slot) {
  NOTE("upload_async", "%p %p %zu %d", dst, src, bytes, slot);
  if (counted()) P.count.bytes_to_device += bytes;
  P.orig.upload_async(be, dst, src, bytes, slot);
}

/* --- memory and the uploads' ordering: not kernels, but a recorded step holds them too (or
 * must not: an allocation, a host wait), so the replay watch sees them */

static void *w_alloc(backend_t *be, size_t bytes) {
  NOTE("alloc", "%zu", bytes);
  if (counted()) P.count.allocs++;
  return P.orig.alloc(be, bytes);
}

static void w_free(backend_t *be, void *p) {
  NOTE("free", "%p", p);
  if (counted() && p) P.count.allocs++;
  P.orig.free(be, p);
}

static void *w_host_alloc_pinned(backend_t *be, size_t bytes) {
  NOTE("host_alloc_pinned", "%zu", bytes);
  if (counted()) P.count.allocs++;
  return P.orig.host_alloc_pinned(be, bytes);
}

static void w_copy(backend_t *be, void *dst, const void *src, size_t bytes) {
  NOTE("copy", "%p %p %zu", dst, src, bytes);
  P.orig.copy(be, dst, src, bytes);
}

static void w_zero(backend_t *be, void *p, size_t bytes) {
  NOTE("zero", "%p %zu", p, bytes);
  P.orig.zero(be, p, bytes);
}

static void w_to_device_async(backend_t *be, void *dst, const void *src, size_t bytes) {
  NOTE("to_device_async", "%p %p %zu", dst, src, bytes);
  if (counted()) P.count.bytes_to_device += bytes;
  P.orig.to_device_async(be, dst, src, bytes);
}

static void w_upload_host_wait(backend_t *be, int slot) {
  NOTE("upload_host_wait", "%d", slot);
  P.orig.upload_host_wait(be, slot);
}

static void w_upload_wait(backend_t *be, int slot) {
  NOTE("upload_wait", "%d", slot);
  P.orig.upload_wait(be, slot);
}

int opprof_install(backend_t *be, int step, FILE *out) {
  if (P.be) return -1;
  memset(&P, 0, sizeof P);
  P.be = be;
  P.orig = *be;
  P.out = out;
  P.step = step;
  P.owner = pthread_self();
  be->synchronize = w_synchronize;
  be->to_host = w_to_host;
  be->to_device = w_to_device;
  be->matmul = w_matmul;
  be->add = w_add;
  be->scale = w_scale;
  be->sumsq = w_sumsq;
  be->sumsq_parts = w_sumsq_parts;
  be->convert = w_convert;
  be->embedding_fwd = w_embedding_fwd;
  be->embedding_bwd = w_embedding_bwd;
  be->rmsnorm_fwd = w_rmsnorm_fwd;
  be->rmsnorm_bwd = w_rmsnorm_bwd;
  be->add_rmsnorm_fwd = w_add_rmsnorm_fwd;
  be->rope_fwd = w_rope_fwd;
  be->rope_bwd = w_rope_bwd;
  be->qkv_rope_fwd = w_qkv_rope_fwd;
  be->qkv_rope_bwd = w_qkv_rope_bwd;
  be->attention_fwd = w_attention_fwd;
  be->attention_bwd = w_attention_bwd;
  if (be->attention_fwd_block) be->attention_fwd_block = w_attention_fwd_block; /* NULL stays NULL */
  if (be->attention_merge) be->attention_merge = w_attention_merge;
  if (be->attention_bwd_block) be->attention_bwd_block = w_attention_bwd_block;
  be->swiglu_fwd = w_swiglu_fwd;
  be->swiglu_bwd = w_swiglu_bwd;
  be->cross_entropy = w_cross_entropy;
  be->copy_2d = w_copy_2d;
  be->ce_shard_max = w_ce_shard_max;
  be->ce_shard_stats = w_ce_shard_stats;
  be->ce_shard_loss = w_ce_shard_loss;
  be->adamw = w_adamw;
  if (be->adamw_multi) be->adamw_multi = w_adamw_multi; /* NULL stays NULL: optim's fallback */
  be->step_loss = w_step_loss;
  be->sumsq_groups = w_sumsq_groups;
  be->sumsq_parts_add = w_sumsq_parts_add;
  be->clip_scale = w_clip_scale;
  be->adamw_multi_dev = w_adamw_multi_dev;
  be->step_skip = w_step_skip;
  be->upload_async = w_upload_async;
  be->alloc = w_alloc;
  be->free = w_free;
  be->host_alloc_pinned = w_host_alloc_pinned;
  be->copy = w_copy;
  be->zero = w_zero;
  be->to_device_async = w_to_device_async;
  be->upload_host_wait = w_upload_host_wait;
  be->upload_wait = w_upload_wait;
  return 0;
}

void opprof_uninstall(backend_t *be) {
  if (!be || P.be != be) return;
  replay_free();
  *be = P.orig;
  P.be = NULL;
  P.active = 0;
}

int opprof_timing(void) { return P.be && P.active; }

void opprof_step_begin(int step) {
  if (!P.be) return;
  P.at_begin = P.count;
  if (step != P.step) return;
  P.n = P.dropped = P.depth = 0;
  /* the floor: what an empty timed call costs (the median of 21, robust to one slow wake-up) */
  double f[21];
  for (int i = 0; i < 21; i++) {
    P.orig.synchronize(P.be);
    double t0 = now_s();
    P.orig.synchronize(P.be);
    f[i] = now_s() - t0;
  }
  for (int i = 1; i < 21; i++)
    for (int j = i; j > 0 && f[j - 1] > f[j]; j--) {
      double x = f[j];
      f[j] = f[j - 1];
      f[j - 1] = x;
    }
  P.floor_s = f[10];
  P.thread = pthread_self();
  P.active = 1;
}

static int by_secs(const void *a, const void *b) {
  double x = ((const prof_entry_t *)a)->secs, y = ((const prof_entry_t *)b)->secs;
  return x < y ? 1 : x > y ? -1 : 0;
}

static void print_row(FILE *o, const prof_entry_t *e, double step_s) {
  char tf[16] = "";
  if (e->flops > 0 && e->secs > 0) snprintf(tf, sizeof tf, "%8.1f", e->flops / e->secs * 1e-12);
  fprintf(o, "  %-15s %-38s %6d %10.2f %10.1f %6.1f%% %8s\n", e->op, e->shape, e->calls, e->secs * 1e3,
          e->secs / e->calls * 1e6, step_s > 0 ? 100 * e->secs / step_s : 0.0, tf);
}

void opprof_step_end(int step, double step_s) {
  if (!P.be) return;
  P.last = (opcount_t){.kernels = P.count.kernels - P.at_begin.kernels,
                       .host_syncs = P.count.host_syncs - P.at_begin.host_syncs,
                       .bytes_to_device = P.count.bytes_to_device - P.at_begin.bytes_to_device,
                       .bytes_to_host = P.count.bytes_to_host - P.at_begin.bytes_to_host,
                       .allocs = P.count.allocs - P.at_begin.allocs};
  replay_step_end();
  if (!P.active || step != P.step) return;
  P.active = 0;
  FILE *o = P.out ? P.out : stderr;
  /* by op over every shape, then the shapes themselves */
  prof_entry_t ops[64];
  int nops = 0, calls = 0;
  double in_kernels = 0;
  for (int i = 0; i < P.n; i++) {
    const prof_entry_t *e = &P.e[i];
    calls += e->calls;
    in_kernels += e->secs;
    int j = 0;
    while (j < nops && ops[j].op != e->op) j++;
    if (j == nops) {
      if (nops == 64) continue;
      ops[nops] = (prof_entry_t){.op = e->op, .shape = "(every shape)"};
      nops++;
    }
    ops[j].calls += e->calls;
    ops[j].secs += e->secs;
    ops[j].flops += e->flops;
  }
  qsort(ops, nops, sizeof ops[0], by_secs);
  qsort(P.e, P.n, sizeof P.e[0], by_secs);
  fprintf(o, "op profile of step %d on %s%s%s: %d kernel calls, %.1f ms in kernels of a %.1f ms step; each call "
          "includes a sync floor of %.1f us (%.1f ms in all)%s\n",
          step, P.be->name, P.be->device[0] ? " " : "", P.be->device, calls, in_kernels * 1e3, step_s * 1e3,
          P.floor_s * 1e6, P.floor_s * calls * 1e3, P.dropped ? " (some shapes not kept: table full)" : "");
  fprintf(o, "  %-15s %-38s %6s %10s %10s %7s %8s\n", "op", "shape", "calls", "total ms", "mean us", "step",
          "TFLOP/s");
  for (int i = 0; i < nops; i++) print_row(o, &ops[i], step_s);
  prof_entry_t rest = {.op = "(outside)", .shape = "host, comm, data, memory ops", .calls = 1,
                       .secs = step_s - in_kernels};
  if (rest.secs < 0) rest.secs = 0;
  print_row(o, &rest, step_s);
  enum { SHAPES_SHOWN = 40 };
  fprintf(o, "  by shape%s:\n", P.n > SHAPES_SHOWN ? " (the 40 longest)" : "");
  for (int i = 0; i < P.n && i < SHAPES_SHOWN; i++) print_row(o, &P.e[i], step_s);
  fflush(o);
}

int opprof_calls(const char *op) {
  int c = 0;
  for (int i = 0; i < P.n; i++)
    if (!strcmp(P.e[i].op, op)) c += P.e[i].calls;
  return c;
}

double opprof_seconds(const char *op) {
  double s = 0;
  for (int i = 0; i < P.n; i++)
    if (!strcmp(P.e[i].op, op)) s += P.e[i].secs;
  return s;
}

void opprof_counts(opcount_t *total, opcount_t *last_step) {
  opcount_t zero = {0};
  if (total) *total = P.be ? P.count : zero;
  if (last_step) *last_step = P.be ? P.last : zero;
}
