/* straggler: the spread of the ranks' compute time, step by step, and the rank that is slow.
 * Each rank keeps its compute time (a step's time less its exposed communication, in ms) of
 * every step since the last read; at the read (the steps that log, evaluate, save or end, where
 * the trainer already waits for the device: trainer/run/train.h) one all-gather over the world's
 * host comm brings every rank's times of those steps to every rank, so no step gets a collective
 * of its own. Of each step: the minimum, median and maximum over ranks, the slowest rank and
 * whether it is more than log.straggler_pct over the median (the console line names it, with its
 * host). A rank that is the slowest, over that threshold, in more than half of the last
 * STRAGGLER_WINDOW steps is named with its host once, as a warning on rank 0.
 *
 * The host names are gathered once, at straggler_open. In one process every step's spread is
 * its own time. Not here: the records and lines that carry the spread (metrics.c). */
#ifndef MESHRUN_STRAGGLER_H
#define MESHRUN_STRAGGLER_H

#include <stddef.h>

#include "trainer/comm/comm.h"
#include "trainer/parallel/mesh.h"

#define STRAGGLER_WINDOW 20 /* steps */
#define STRAGGLER_HOST_MAX 64

/* One step's compute time over the ranks, ms. */
typedef struct {
  double min_ms, median_ms, max_ms;
  int slowest;       /* the rank with max_ms (the lowest such) */
  int over;          /* max_ms > median_ms * (1 + pct / 100) with more than one rank */
  double over_pct;   /* 100 * (max_ms / median_ms - 1), 0 when the median is 0 */
  const char *host;  /* the slowest rank's host */
} straggler_stat_t;

typedef struct {
  comm_t *world;      /* the world's host comm; NULL in one process */
  int rank, size;
  double pct;         /* log.straggler_pct */
  char *hosts;        /* (size, STRAGGLER_HOST_MAX) */
  float *mine;        /* (cap) this rank's compute ms of the steps not gathered, oldest first */
  float *all;         /* (size, cap) the gather's buffer */
  float *sorted;      /* (size) one step's times in order */
  int n, cap;         /* cap: TRAIN_PENDING_MAX, the most steps between two reads */
  straggler_stat_t *stat; /* (cap) the spread of the steps of the last gather */
  int win[STRAGGLER_WINDOW]; /* the rank over the threshold in each of the last steps, -1 when none */
  double win_pct[STRAGGLER_WINDOW]; /* its over_pct */
  int nwin;           /* steps seen, of which the last STRAGGLER_WINDOW are in win */
  unsigned char *named; /* (size) a rank named slow already */
} straggler_t;

/* Gathers the host names (collective over the world's host comm when mesh is not NULL). Returns 0
 * or -1 with the message in err; straggler_free releases what it allocated. */
int straggler_open(straggler_t *s, const mesh_t *mesh, int rank, double pct, char *err, size_t errlen);
void straggler_free(straggler_t *s); /* accepts a zeroed straggler_t */
/* A step ended: this rank's compute time of it (ms), kept until a read. */
void straggler_step(straggler_t *s, double compute_ms);
/* The spread of the n oldest steps kept (every rank calls it with the same n at the same read:
 * one all-gather), into s->stat[0..n); a slow rank over the window is named (log_rank0). local:
 * no collective, the spread of this rank's times alone (after a failure, where the ranks may not
 * be at the same read). Returns 0, or -1 with the message in err. */
int straggler_gather(straggler_t *s, int n, int local, char *err, size_t errlen);

#endif
