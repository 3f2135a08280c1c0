/* pipeline: stage split, schedule generators and the schedule checker (see pipeline.h).
 *
 * Generators write, per rank, the actions of each task: a forward of (stage, mb) is "receive its
 * input unless stage 0, forward, send the output unless the last stage"; a backward is "receive
 * the output's gradient unless the last stage, backward, send the input's gradient unless stage
 * 0". The schedules differ only in the order of tasks:
 *   gpipe        every forward in micro-batch order, then every backward;
 *   1f1b         p - r - 1 warm-up forwards on rank r, then forward and backward in turn, then
 *                the remaining backwards (PipeDream-Flush, as Megatron and torchtitan run it);
 *   interleaved  Megatron's interleaved 1F1B: tasks in groups of p micro-batches per virtual
 *                stage (forwards walk the rank's stages upward, backwards downward), with
 *                (p - r - 1) * 2 + (v - 1) * p warm-up forwards.
 * The checker runs the lists as a discrete-event simulation under the transport contract: each
 * rank advances through its list until a receive finds nothing sent yet; when no rank can move
 * and some list is unfinished, that is a deadlock. Times: an action starts at the later of its
 * rank's clock and its message's send time; communication costs nothing. */
#include "trainer/plan/pipeline.h"

#include "common/err.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const schedule_names[PP_SCHEDULE_COUNT] = {"gpipe", "1f1b", "interleaved_1f1b"};
static const char *const kind_names[PP_ACTION_COUNT] = {"forward", "backward", "recv_act",
                                                        "send_act", "recv_grad", "send_grad"};

int pp_stage_of(int rank, int chunk, int p) { return rank + chunk * p; }

const char *pp_schedule_name(pp_schedule_t s) {
  return (unsigned)s < PP_SCHEDULE_COUNT ? schedule_names[s] : "?";
}

const char *pp_kind_name(pp_kind_t k) { return (unsigned)k < PP_ACTION_COUNT ? kind_names[k] : "?"; }

int pp_schedule_parse(const char *name, pp_schedule_t *out) {
  for (int i = 0; i < PP_SCHEDULE_COUNT; i++)
    if (!strcmp(name, schedule_names[i])) {
      *out = (pp_schedule_t)i;
      return 0;
    }
  return PP_EFAIL;
}

int pp_validate(pp_schedule_t s, int p, int v, int m, char *err, size_t errlen) {
  const char *name = pp_schedule_name(s);
  if ((unsigned)s >= PP_SCHEDULE_COUNT) return err_set(err, errlen, PP_EFAIL, "unknown pipeline schedule %d", (int)s);
  if (p < 1) return err_set(err, errlen, PP_EFAIL, "pipeline degree %d: expected at least 1", p);
  if (m < 1) return err_set(err, errlen, PP_EFAIL, "pp_microbatches %d: expected at least 1", m);
  if (s == PP_INTERLEAVED_1F1B) {
    if (v < 2)
      return err_set(err, errlen, PP_EFAIL, "schedule interleaved_1f1b needs pp_stages_per_rank >= 2 (got %d)", v);
    if (m % p)
      return err_set(err, errlen, PP_EFAIL, "schedule interleaved_1f1b needs pp_microbatches (%d) to be a multiple "
                  "of the pipeline degree (%d)", m, p);
    return 0;
  }
  if (v != 1)
    return err_set(err, errlen, PP_EFAIL, "schedule %s runs one stage per rank (pp_stages_per_rank %d); "
                "interleaved_1f1b runs several", name, v);
  if (s == PP_1F1B && m < p)
    return err_set(err, errlen, PP_EFAIL, "schedule 1f1b needs at least as many micro-batches as stages "
                "(pp_microbatches %d < pp %d)", m, p);
  return 0;
}

/* ---- generators ---------------------------------------------------------------------------- */

typedef struct {
  pp_plan_t *pl;
  int *cap;
  int oom;
} builder_t;

static void push(builder_t *b, int r, pp_kind_t kind, int stage, int mb) {
  pp_plan_t *pl = b->pl;
  if (b->oom) return;
  if (pl->n[r] == b->cap[r]) {
    int cap = b->cap[r] ? 2 * b->cap[r] : 64;
    pp_action_t *a = realloc(pl->act[r], (size_t)cap * sizeof *a);
    if (!a) {
      b->oom = 1;
      return;
    }
    pl->act[r] = a;
    b->cap[r] = cap;
  }
  pl->act[r][pl->n[r]++] = (pp_action_t){.kind = (unsigned char)kind, .stage = stage, .mb = mb};
}

static void forward_task(builder_t *b, int r, int s, int mb) {
  int last = b->pl->p * b->pl->v - 1;
  if (s > 0) push(b, r, PP_RECV_ACT, s, mb);
  push(b, r, PP_FWD, s, mb);
  if (s < last) push(b, r, PP_SEND_ACT, s, mb);
}

static void backward_task(builder_t *b, int r, int s, int mb) {
  int last = b->pl->p * b->pl->v - 1;
  if (s < last) push(b, r, PP_RECV_GRAD, s, mb);
  push(b, r, PP_BWD, s, mb);
  if (s > 0) push(b, r, PP_SEND_GRAD, s, mb);
}

/* Interleaved order: task k of a rank is micro-batch (k / (p v)) p + k % p on the rank's chunk
 * (k / p) % v, counted upward for forwards and downward for backwards. */
static void interleaved_task(builder_t *b, int r, int k, int backward) {
  int p = b->pl->p, v = b->pl->v;
  int chunk = (k / p) % v, mb = (k / (p * v)) * p + k % p;
  if (backward) chunk = v - 1 - chunk;
  int s = chunk * p + r;
  if (backward)
    backward_task(b, r, s, mb);
  else
    forward_task(b, r, s, mb);
}

static void generate_rank(builder_t *b, int r) {
  const pp_plan_t *pl = b->pl;
  int p = pl->p, m = pl->m;
  switch (pl->schedule) {
  case PP_GPIPE:
    for (int mb = 0; mb < m; mb++) forward_task(b, r, r, mb);
    for (int mb = 0; mb < m; mb++) backward_task(b, r, r, mb);
    break;
  case PP_1F1B: {
    int warm = p - r - 1 < m ? p - r - 1 : m, f = 0, k = 0;
    for (; f < warm; f++) forward_task(b, r, r, f);
    for (; f < m; f++, k++) {
      forward_task(b, r, r, f);
      backward_task(b, r, r, k);
    }
    for (; k < m; k++) backward_task(b, r, r, k);
    break;
  }
  case PP_INTERLEAVED_1F1B: {
    int total = m * pl->v, warm = (p - r - 1) * 2 + (pl->v - 1) * p, f = 0, k = 0;
    if (warm > total) warm = total;
    for (; f < warm; f++) interleaved_task(b, r, f, 0);
    for (; f < total; f++, k++) {
      interleaved_task(b, r, f, 0);
      interleaved_task(b, r, k, 1);
    }
    for (; k < total; k++) interleaved_task(b, r, k, 1);
    break;
  }
  default:
    break;
  }
}

void pp_free(pp_plan_t *pl) {
  if (!pl) return;
  if (pl->act)
    for (int r = 0; r < pl->p; r++) free(pl->act[r]);
  free(pl->act);
  free(pl->n);
  memset(pl, 0, sizeof *pl);
}

int pp_generate(pp_schedule_t s, int p, int v, int m, pp_plan_t *out, char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  if (pp_validate(s, p, v, m, err, errlen)) return PP_EFAIL;
  *out = (pp_plan_t){.schedule = s, .p = p, .v = v, .m = m};
  out->n = calloc((size_t)p, sizeof *out->n);
  out->act = calloc((size_t)p, sizeof *out->act);
  int *cap = calloc((size_t)p, sizeof *cap);
  builder_t b = {.pl = out, .cap = cap, .oom = !out->n || !out->act || !cap};
  for (int r = 0; r < p && !b.oom; r++) generate_rank(&b, r);
  free(cap);
  if (b.oom) {
    pp_free(out);
    return err_set(err, errlen, PP_EFAIL, "out of memory for a %s schedule of %d ranks x %d micro-batches",
                pp_schedule_name(s), p, m);
  }
  return 0;
}

/* ---- checker ------------------------------------------------------------------------------- */

typedef struct {
  int stage, mb;
  double t;
} msg_t;

typedef struct { /* one FIFO per (source, destination, kind): what was sent, not yet received */
  msg_t *q;
  int head, len, cap;
} chan_t;

/* 0, or -1 when the queue cannot grow (out of memory). */
static int chan_push(chan_t *c, msg_t m) {
  if (c->head + c->len == c->cap) {
    int cap = c->cap ? 2 * c->cap : 16;
    msg_t *q = realloc(c->q, (size_t)cap * sizeof *q);
    if (!q) return -1;
    c->q = q;
    c->cap = cap;
  }
  c->q[c->head + c->len++] = m;
  return 0;
}

enum { ST_FWD = 1, ST_BWD = 2, ST_GOT_ACT = 4, ST_GOT_GRAD = 8, ST_SENT_ACT = 16, ST_SENT_GRAD = 32 };

/* The checker's simulation of a plan: each rank's position in its list (pc), its clock and
 * busy time, the state of every (stage, micro-batch) and the channels between ranks. */
typedef struct {
  const pp_plan_t *pl;
  int p, S, m;
  double f_cost, b_cost;
  pp_stats_t *st;
  unsigned char *state; /* ST_* per (stage, mb) */
  chan_t *ch;           /* per (source, destination, kind) */
  int *pc, *inflight;
  double *clock, *busy;
} sim_t;

/* Rank r's action a, the pc[r]-th of its list: 0 done, 1 a receive whose message was not sent
 * yet (the rank waits), -1 with the violation in err. */
static int sim_action(sim_t *z, int r, const pp_action_t *a, char *err, size_t errlen) {
  const int p = z->p, S = z->S, m = z->m;
  const int *pc = z->pc;
  int *inflight = z->inflight;
  double *clock = z->clock, *busy = z->busy;
  chan_t *ch = z->ch;
  pp_stats_t *st = z->st;
  unsigned char *state = z->state;
  const double f_cost = z->f_cost, b_cost = z->b_cost;
#define CH(src, dst, grad) (&ch[((size_t)(src) * (size_t)p + (size_t)(dst)) * 2 + (grad)])
#define BAD(...) return err_set(err, errlen, PP_EFAIL, __VA_ARGS__)
  int s = a->stage, mb = a->mb;
  const char *what = pp_kind_name((pp_kind_t)a->kind);
  if (s < 0 || s >= S || mb < 0 || mb >= m)
    BAD("rank %d action %d (%s): stage %d / micro-batch %d out of range", r, pc[r], what, s, mb);
  if (s % p != r)
    BAD("rank %d action %d: %s of stage %d, which lives on rank %d", r, pc[r], what, s, s % p);
  unsigned char *x = &state[(size_t)s * (size_t)m + (size_t)mb];
  if (a->kind == PP_FWD) {
    if (*x & ST_FWD) BAD("rank %d: stage %d micro-batch %d forwarded twice", r, s, mb);
    if (s > 0 && !(*x & ST_GOT_ACT))
      BAD("rank %d: forward of stage %d micro-batch %d before its input was received", r, s, mb);
    *x |= ST_FWD;
    clock[r] += f_cost;
    busy[r] += f_cost;
    inflight[r]++;
    if (r < 64 && inflight[r] > st->peak_inflight[r]) st->peak_inflight[r] = inflight[r];
    if (inflight[r] > st->max_inflight) st->max_inflight = inflight[r];
  } else if (a->kind == PP_BWD) {
    if (*x & ST_BWD) BAD("rank %d: stage %d micro-batch %d backwarded twice", r, s, mb);
    if (!(*x & ST_FWD))
      BAD("rank %d: backward of stage %d micro-batch %d before its forward", r, s, mb);
    if (s < S - 1 && !(*x & ST_GOT_GRAD))
      BAD("rank %d: backward of stage %d micro-batch %d before its output gradient was received",
          r, s, mb);
    *x |= ST_BWD;
    clock[r] += b_cost;
    busy[r] += b_cost;
    inflight[r]--;
  } else if (a->kind == PP_SEND_ACT || a->kind == PP_SEND_GRAD) {
    int grad = a->kind == PP_SEND_GRAD, flag = grad ? ST_SENT_GRAD : ST_SENT_ACT;
    if (grad ? s == 0 : s == S - 1) BAD("rank %d: %s from stage %d, which has no neighbour there", r, what, s);
    if (!(*x & (grad ? ST_BWD : ST_FWD)))
      BAD("rank %d: %s of stage %d micro-batch %d before computing it", r, what, s, mb);
    if (*x & flag) BAD("rank %d: %s of stage %d micro-batch %d twice", r, what, s, mb);
    *x |= (unsigned char)flag;
    int dst = (grad ? s - 1 : s + 1) % p;
    if (chan_push(CH(r, dst, grad), (msg_t){.stage = s, .mb = mb, .t = clock[r]}))
      BAD("out of memory checking the schedule");
  } else if (a->kind == PP_RECV_ACT || a->kind == PP_RECV_GRAD) {
    int grad = a->kind == PP_RECV_GRAD;
    if (grad ? s == S - 1 : s == 0) BAD("rank %d: %s into stage %d, which has no neighbour there", r, what, s);
    int from = grad ? s + 1 : s - 1, src = from % p;
    chan_t *c = CH(src, r, grad);
    if (!c->len) return 1; /* blocked until rank src sends */
    msg_t g = c->q[c->head];
    if (g.stage != from || g.mb != mb)
      BAD("rank %d: %s of stage %d micro-batch %d, but the next message from rank %d is stage %d "
          "micro-batch %d (messages arrive in send order)", r, what, s, mb, src, g.stage, g.mb);
    c->head++;
    c->len--;
    if (g.t > clock[r]) clock[r] = g.t;
    *x |= (unsigned char)(grad ? ST_GOT_GRAD : ST_GOT_ACT);
  } else {
    BAD("rank %d action %d: unknown kind %d", r, pc[r], a->kind);
  }
  return 0;
#undef BAD
#undef CH
}

/* After every rank moved as far as it could: a rank left waiting is a deadlock, a (stage,
 * micro-batch) not run both ways or a message not received an incomplete plan; else the
 * makespan and the bubble into st. */
static int sim_verdict(const sim_t *z, char *err, size_t errlen) {
  const pp_plan_t *pl = z->pl;
  const int p = z->p, S = z->S, m = z->m;
  const int *pc = z->pc;
  const double *clock = z->clock, *busy = z->busy;
  const chan_t *ch = z->ch;
  const unsigned char *state = z->state;
  pp_stats_t *st = z->st;
  for (int r = 0; r < p; r++)
    if (pc[r] < pl->n[r]) {
      const pp_action_t *a = &pl->act[r][pc[r]];
      return err_set(err, errlen, PP_EFAIL, "deadlock: rank %d waits at action %d (%s of stage %d micro-batch %d) and no "
                     "rank can move", r, pc[r], pp_kind_name((pp_kind_t)a->kind), a->stage, a->mb);
    }
  for (int s = 0; s < S; s++)
    for (int mb = 0; mb < m; mb++) {
      unsigned x = state[(size_t)s * (size_t)m + (size_t)mb];
      if (!(x & ST_FWD) || !(x & ST_BWD))
        return err_set(err, errlen, PP_EFAIL, "incomplete: stage %d micro-batch %d never %s", s, mb,
                       !(x & ST_FWD) ? "forwarded" : "backwarded");
    }
  for (int i = 0; i < p * p * 2; i++)
    if (ch[i].len)
      return err_set(err, errlen, PP_EFAIL, "rank %d sent %s of stage %d micro-batch %d that rank %d never receives",
                     i / 2 / p, i % 2 ? "a gradient" : "an activation", ch[i].q[ch[i].head].stage,
                     ch[i].q[ch[i].head].mb, i / 2 % p);
  double span = 0, idle = 0;
  for (int r = 0; r < p; r++)
    if (clock[r] > span) span = clock[r];
  for (int r = 0; r < p; r++) idle += span > 0 ? (span - busy[r]) / span : 0;
  st->makespan = span;
  st->bubble = idle / p;
  return 0;
}

int pp_check(const pp_plan_t *pl, double f_cost, double b_cost, pp_stats_t *st, char *err,
             size_t errlen) {
  int p = pl->p, S = pl->p * pl->v, m = pl->m, rc = -1;
  memset(st, 0, sizeof *st);
  sim_t z = {.pl = pl, .p = p, .S = S, .m = m, .f_cost = f_cost, .b_cost = b_cost, .st = st};
  z.state = calloc((size_t)S * (size_t)m, 1);
  z.ch = calloc((size_t)p * (size_t)p * 2, sizeof *z.ch);
  z.pc = calloc((size_t)p, sizeof *z.pc);
  z.inflight = calloc((size_t)p, sizeof *z.inflight);
  z.clock = calloc((size_t)p, sizeof *z.clock);
  z.busy = calloc((size_t)p, sizeof *z.busy);
  if (!z.state || !z.ch || !z.pc || !z.inflight || !z.clock || !z.busy) {
    err_set(err, errlen, PP_EFAIL, "out of memory checking the schedule");
    goto out;
  }
  for (int moved = 1; moved;) {
    moved = 0;
    for (int r = 0; r < p; r++) {
      for (; z.pc[r] < pl->n[r]; z.pc[r]++) {
        int arc = sim_action(&z, r, &pl->act[r][z.pc[r]], err, errlen);
        if (arc < 0) goto out;
        if (arc > 0) break;
        moved = 1;
      }
    }
  }
  rc = sim_verdict(&z, err, errlen);
out:
  if (z.ch)
    for (int i = 0; i < p * p * 2; i++) free(z.ch[i].q);
  free(z.ch);
  free(z.state);
  free(z.pc);
  free(z.inflight);
  free(z.clock);
  free(z.busy);
  return rc;
}

/* ---- layer split --------------------------------------------------------------------------- */

int pp_split(int n_layers, int n_stages, double embed_cost, double head_cost, int *first,
             char *err, size_t errlen) {
  if (n_stages < 1 || n_layers < n_stages)
    return err_set(err, errlen, PP_EFAIL, "%d pipeline stages for %d layers: every stage needs at least one block",
                n_stages, n_layers);
  /* best[s][l]: the smallest largest-stage cost of cutting layers 0..l-1 into s stages; cut[s][l]
   * the first layer of the s-th stage in that cut. O(S L^2), S and L are small. */
  size_t L = (size_t)n_layers + 1;
  double *best = malloc((size_t)(n_stages + 1) * L * sizeof *best);
  int *cut = malloc((size_t)(n_stages + 1) * L * sizeof *cut);
  if (!best || !cut) {
    free(best);
    free(cut);
    return err_set(err, errlen, PP_EFAIL, "out of memory splitting %d layers", n_layers);
  }
  for (size_t i = 0; i < (size_t)(n_stages + 1) * L; i++) best[i] = -1; /* -1: no such cut */
  for (int s = 1; s <= n_stages; s++)
    for (int l = s; l <= n_layers - (n_stages - s); l++) {
      double b = -1;
      int c = s - 1;
      for (int j = s - 1; j < l; j++) { /* stage s-1 (0-based) holds layers j..l-1 */
        double cost = (double)(l - j) + (s == 1 ? embed_cost : 0) + (s == n_stages ? head_cost : 0);
        double prev = s == 1 ? (j == 0 ? 0 : -1) : best[(size_t)(s - 1) * L + (size_t)j];
        if (prev < 0) continue;
        double worst = prev > cost ? prev : cost;
        if (b < 0 || worst < b) { /* ties keep the earliest cut: earlier stages no larger */
          b = worst;
          c = j;
        }
      }
      best[(size_t)s * L + (size_t)l] = b;
      cut[(size_t)s * L + (size_t)l] = c;
    }
  first[n_stages] = n_layers;
  for (int s = n_stages, l = n_layers; s >= 1; s--) {
    first[s - 1] = cut[(size_t)s * L + (size_t)l];
    l = first[s - 1];
  }
  free(best);
  free(cut);
  return 0;
}

/* Slots: taken where a micro-batch enters a chunk (the first stage's forward, any other's
 * receive), given back where it leaves (the first stage's backward, any other's gradient send);
 * see pipeline_run.c for the spare. */
int pp_slots(const pp_plan_t *pl, int rank, int *slots) {
  const int v = pl->v, p = pl->p;
  int live[PP_MAX_CHUNKS] = {0};
  for (int c = 0; c < v; c++) slots[c] = 0;
  for (int i = 0; i < pl->n[rank]; i++) {
    const pp_action_t *a = &pl->act[rank][i];
    const int c = a->stage / p;
    const int take = (a->kind == PP_FWD && a->stage == 0) || a->kind == PP_RECV_ACT;
    const int give = (a->kind == PP_BWD && a->stage == 0) || a->kind == PP_SEND_GRAD;
    if (take && ++live[c] > slots[c]) slots[c] = live[c];
    if (give) live[c]--;
  }
  for (int c = 0; c < v; c++)
    if (pp_stage_of(rank, c, p) > 0) slots[c]++; /* a stage that sends gradients: the spare (pipeline_run.c) */
  return 0;
}
