/* metrics: what a training run reports. On stderr (rank 0, through the log): the memory line of
 * a mesh, the run's summary line, a console line per log.interval steps, eval lines and the
 * closing "done" line. In log.metrics_file (rank 0, JSONL, one object per line, flushed as
 * written so a crash keeps what was logged): a first record with the plan, sizes and memory
 * per rank (this rank's and the maximum over ranks; act_bytes / act_block_bytes: the model's
 * activation arena as allocated, model_memory), one record per optimizer step with the
 * bytes this rank sent during it ("comm": by strategy collective and by mesh group), and one
 * per evaluation. In log.tensorboard_dir (rank 0, tensorboard.h): the step record's numbers as
 * TensorBoard scalars, tagged train/<its key> (train/loss, train/mfu where MFU is known), and the
 * eval loss as eval/loss.
 *
 * A write that fails (a full disk, /dev/full) is one warning; no record is written after it (a
 * torn line would follow), training goes on, and metrics_close reports it so the run exits 1.
 * A step's record and line need its loss and gradient norm, which stay on the device until the
 * trainer reads them (trainer/run/train.h: at the steps that log, evaluate, save or end the run):
 * metrics_step_done keeps what the host knows of a step when it ends (its time, traffic, counts
 * and memory), and metrics_step_values writes the records and lines of the steps kept once their
 * values arrive, with the same fields and values as when each was written at its end. A run that
 * is killed, or fails other than by diverging, loses the records of the steps since the last read
 * (a divergence writes those of the steps before the one that diverged).
 * Throughput: the step line and record carry tokens/s, the model FLOP/s per rank (6N + 12 L d T
 * per token), MFU (that over the device's peak: log.peak_tflops, or the backend's own figure for
 * its device, backend_t.peak_flops; none on cpu unless given) and the peak memory measured (the
 * device allocator's where the backend reports one, else resident memory of the process).
 * Not here: computing the values (train.c), the sample text (sample.c). */
#ifndef MESHRUN_METRICS_H
#define MESHRUN_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "trainer/backend/backend.h"
#include "trainer/formats/data.h"
#include "trainer/parallel/dp.h"
#include "trainer/parallel/mesh.h"
#include "trainer/model/model.h"
#include "trainer/plan/plan.h"
#include "trainer/run/straggler.h"
#include "trainer/run/tensorboard.h"

/* Bytes sent by this rank: by strategy collective, and per mesh group. */
typedef struct {
  dp_traffic_t dp;
  uint64_t group[MESH_NGROUPS];
} metrics_traffic_t;

/* What metrics_step_done keeps of a step until its values arrive. */
typedef struct {
  int step;
  double lr, dt, comm_wait;
  size_t rss;
  uint64_t kernels, host_syncs;
  int graph;      /* step_graph when it was done */
  char comm[512]; /* the record's "comm" object, or "" */
} metrics_pending_t;

typedef struct {
  const plan_t *p;
  dp_t *dp;
  const mesh_t *mesh;
  backend_t *be;       /* its mem_peak, where memory is a device's */
  int steps, start_step;
  long long tokens_per_step;
  FILE *f;            /* NULL: no records (log.metrics_file "", or not rank 0) */
  tensorboard_t *tb;  /* the same scalars for TensorBoard; NULL: none (log.tensorboard_dir "", or not rank 0) */
  const char *path;
  int err;            /* errno of the first failed write; 0 while every write succeeded */
  char what[48];      /* what failed: "the first record", "the record of step 12", "the close" */
  metrics_traffic_t traffic; /* the counters at the last record */
  double flops_per_token; /* model FLOPs of training, per token: 6N + 12 L d T (plan.md, log.peak_tflops) */
  int world, rank;
  double peak_flops;  /* per rank, for MFU; 0 = unknown (no MFU) */
  double t_loop;      /* metrics_now() when the loop started */
  double t_in_steps;  /* seconds spent in optimizer steps */
  /* How the caller ran the step it reports next (train.h's TRAIN_GRAPH_*: 0 run, 1 recorded, 2
   * replayed): a recorded or replayed step's record says so ("graph"), its counts are the host's
   * calls (a replay's work is one launch). */
  int step_graph;
  metrics_pending_t *pend; /* (npend of cap) the steps done whose values have not arrived, oldest first */
  int npend, cap;
  int skipped_total;  /* train.skip_*: the last verdict's total */
} metrics_t;

/* Under pipeline parallelism, after a step: this rank's time in forwards and backwards, the
 * schedule's span, the most micro-batches it held and its activation arena, gathered over the
 * pp group (collective over it) into one record from rank 0: {"pp_step" (not "step": readers of
 * step records expect a loss there), "pp_bubble": [1 - busy / span per pp rank], "pp_busy_ms",
 * "pp_span_ms", "pp_peak_inflight", "pp_act_bytes"}. Returns 0 or -1 with err. */
int metrics_pipeline(metrics_t *mt, int step, double busy_ms, double span_ms, int peak_inflight, size_t act_bytes,
                     char *err, size_t errlen);

/* Model FLOPs of one trained token (forward and backward) for p's model and train.seq_len:
 * 6 N + 12 L d T, N the parameters of the matrix products. */
double metrics_flops_per_token(const plan_t *p);
/* The process's peak resident memory, bytes (getrusage). */
size_t metrics_peak_rss(void);

/* Seconds on the monotonic clock. */
double metrics_now(void);

/* Starts the run's reports: the memory per rank (collective over the job: the maximum over ranks
 * goes through the world host comm) and its line under a mesh, then on rank 0 the metrics file
 * (parents made; appended to when resumed, after a killed writer's torn line) and its first
 * record, the summary line, and the traffic and time counters from here. Returns 0, or -1 with
 * the message in err. metrics_free releases what it opened, also after a failure. */
int metrics_open(metrics_t *mt, const plan_t *p, model_t *m, dp_t *dp, const mesh_t *mesh, const data_t *data,
                 const backend_t *be, int rank, int world, int start_step, int resumed, const char *plan_json,
                 char *err, size_t errlen);
/* Optimizer step `step` (1-based) done in dt seconds: its record and, when metrics_line_due, its
 * console line (metrics_step_done, then metrics_step_values for it). */
void metrics_step(metrics_t *mt, int step, double loss, double lr, double gnorm, double dt, double comm_wait);
/* Whether step `step` has a console line: every log.interval steps, the first and the last. */
int metrics_line_due(const plan_t *p, int step);
/* Step `step` ended now, in dt seconds: its traffic since the last record, the device counts of
 * the step (opprof) and the peak memory are taken now and kept with lr, dt and comm_wait until
 * its values arrive (a step that cannot be kept, for lack of memory, is one warning and no
 * record). */
void metrics_step_done(metrics_t *mt, int step, double lr, double dt, double comm_wait);
/* The values of the n oldest steps kept (loss and gnorm, oldest first), their skip verdicts
 * (train.skip_*; NULL when the keys are off) and the spread of the ranks' compute time of each
 * (straggler.h; NULL: this rank's time alone): their records and lines, then they are forgotten.
 * The record carries compute_ms_min, compute_ms_median, compute_ms_max, slowest_rank and
 * straggler_spread_pct (the slowest rank's excess over the median, %; also TensorBoard's
 * train/straggler_spread_pct); the console line names the slowest rank and its host when it is
 * over log.straggler_pct. With verdicts the record also carries "skipped" (0 or 1) and
 * "skipped_total", and a skipped step gets a line of its own saying why, whatever log.interval. */
void metrics_step_values(metrics_t *mt, int n, const double *loss, const double *gnorm, const skip_verdict_t *skip,
                         const straggler_stat_t *spread);
/* The eval loss after step `step`: its record and line. Its traffic is not counted as a step's. */
void metrics_eval(metrics_t *mt, int step, double loss);
/* Forgets the traffic since the last record (a checkpoint's is not a step's). */
void metrics_skip_traffic(metrics_t *mt);
/* The "done: N steps in T, X tok/s on average" line (when any step ran), with "; K steps skipped"
 * (since the run began, resumes included) under train.skip_*. */
void metrics_done(metrics_t *mt);
/* Closes the files; returns 0, or -1 with the message in err when any write (or the close) of
 * the metrics file or the event file failed, and then *no_space (when non-NULL) says whether it was a lack of space. */
int metrics_close(metrics_t *mt, int *no_space, char *err, size_t errlen);
void metrics_free(metrics_t *mt); /* closes without reporting; accepts a zeroed metrics_t */

#endif
