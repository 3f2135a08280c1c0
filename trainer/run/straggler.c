/* straggler: the ranks' compute time spread and the slow rank (see straggler.h). */
#include "trainer/run/straggler.h"

#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/net.h"
#include "trainer/run/train.h"

int straggler_open(straggler_t *s, const mesh_t *mesh, int rank, double pct, char *err, size_t errlen) {
  memset(s, 0, sizeof *s);
  s->world = mesh ? mesh_host_comm(mesh, "world") : NULL;
  s->rank = s->world ? comm_rank(s->world) : rank;
  s->size = s->world ? comm_size(s->world) : 1;
  s->pct = pct;
  s->cap = TRAIN_PENDING_MAX;
  s->hosts = calloc((size_t)s->size, STRAGGLER_HOST_MAX);
  s->mine = malloc((size_t)s->cap * sizeof *s->mine);
  s->all = malloc((size_t)s->size * s->cap * sizeof *s->all);
  s->sorted = malloc((size_t)s->size * sizeof *s->sorted);
  s->stat = malloc((size_t)s->cap * sizeof *s->stat);
  s->named = calloc((size_t)s->size, 1);
  if (!s->hosts || !s->mine || !s->all || !s->sorted || !s->stat || !s->named) {
    return err_set(err, errlen, -1, "out of memory for the compute times of %d ranks", s->size);
  }
  char host[STRAGGLER_HOST_MAX] = "";
  net_hostname(host, sizeof host);
  /* names travel as fp32 words: the host comm copies the bytes of an all-gather as they are */
  if (!s->world) {
    memcpy(s->hosts, host, sizeof host);
  } else if (comm_all_gather(s->world, host, s->hosts, STRAGGLER_HOST_MAX / sizeof(float), DT_F32)) {
    return err_set(err, errlen, -1, "gathering the ranks' host names: %s", comm_errmsg(s->world));
  }
  for (int q = 0; q < s->size; q++) s->hosts[(size_t)q * STRAGGLER_HOST_MAX + STRAGGLER_HOST_MAX - 1] = '\0';
  return 0;
}

void straggler_free(straggler_t *s) {
  if (!s) return;
  free(s->hosts);
  free(s->mine);
  free(s->all);
  free(s->sorted);
  free(s->stat);
  free(s->named);
  memset(s, 0, sizeof *s);
}

void straggler_step(straggler_t *s, double compute_ms) {
  if (s->n < s->cap) s->mine[s->n++] = (float)compute_ms;
}

static int cmp_float(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* The spread of step j of the gather over the ranks in v (rank q's time at v[q * stride]). */
static void spread(straggler_t *s, const float *v, int ranks, size_t stride, straggler_stat_t *st) {
  int slow = 0;
  for (int q = 0; q < ranks; q++) {
    s->sorted[q] = v[(size_t)q * stride];
    if (s->sorted[q] > s->sorted[slow]) slow = q;
  }
  qsort(s->sorted, (size_t)ranks, sizeof *s->sorted, cmp_float);
  const double med = ranks % 2 ? s->sorted[ranks / 2] : 0.5 * ((double)s->sorted[ranks / 2 - 1] + s->sorted[ranks / 2]);
  const int who = ranks > 1 ? slow : s->rank;
  *st = (straggler_stat_t){.min_ms = s->sorted[0], .median_ms = med, .max_ms = s->sorted[ranks - 1], .slowest = who,
                           .over_pct = med > 0 ? 100.0 * (s->sorted[ranks - 1] / med - 1) : 0,
                           .host = s->hosts + (size_t)who * STRAGGLER_HOST_MAX};
  st->over = ranks > 1 && st->max_ms > med * (1 + s->pct / 100);
}

/* The window after a gathered step: the rank over the threshold in more than half of the last
 * STRAGGLER_WINDOW steps is named, once. */
static void window_step(straggler_t *s, const straggler_stat_t *st) {
  const int i = s->nwin++ % STRAGGLER_WINDOW;
  s->win[i] = st->over ? st->slowest : -1;
  s->win_pct[i] = st->over_pct;
  if (!st->over || s->named[st->slowest] || s->nwin < STRAGGLER_WINDOW) return;
  int count = 0;
  double pct = 0;
  for (int k = 0; k < STRAGGLER_WINDOW; k++)
    if (s->win[k] == st->slowest) {
      count++;
      pct += s->win_pct[k];
    }
  if (2 * count <= STRAGGLER_WINDOW) return;
  s->named[st->slowest] = 1;
  log_rank0("rank %d on host %s is slow: +%.0f%% over the median compute time in %d of the last %d steps "
            "(log.straggler_pct %g)", st->slowest, st->host, pct / count, count, STRAGGLER_WINDOW, s->pct);
}

int straggler_gather(straggler_t *s, int n, int local, char *err, size_t errlen) {
  if (n > s->n) n = s->n;
  const int gathered = s->world && !local && s->size > 1;
  if (gathered && n > 0 && comm_all_gather(s->world, s->mine, s->all, (size_t)n, DT_F32)) {
    return err_set(err, errlen, -1, "gathering the ranks' compute times: %s", comm_errmsg(s->world));
  }
  for (int j = 0; j < n; j++) {
    if (!gathered) {
      spread(s, s->mine + j, 1, 0, &s->stat[j]);
      continue;
    }
    spread(s, s->all + j, s->size, (size_t)n, &s->stat[j]);
    window_step(s, &s->stat[j]);
  }
  memmove(s->mine, s->mine + n, (size_t)(s->n - n) * sizeof *s->mine);
  s->n -= n;
  return 0;
}
