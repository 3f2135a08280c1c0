/* train: one optimizer step, and evaluation. train_step runs grad_accum_steps micro-batches
 * (batch from the loader, forward, backward; the strategy synchronizes gradients on the last
 * one), averages the loss over the micro-batches and over dp, then the gradient norm, clipping
 * and the optimizer, in that order, every floating-point operation as the loop always did them.
 *
 * Without pipeline parallelism nothing in a step waits for the device: the loss (backend
 * step_loss after each forward), its mean over dp (an all-reduce on the device comm), the
 * gradient norm and the clip scale (dp_clip_dev) stay in device memory, AdamW reads the scale
 * there (dp_step_dev), and each step's loss and norm land in a record of a small device array.
 * The host reads the records of every step since the last read in one copy, when a step reads:
 * every step by default, or where read_due says (the trainer: the steps that log, evaluate,
 * save or end the run), and when the array is full (TRAIN_PENDING_MAX steps); train_read reads
 * at any other point (before a save on a signal). Under pipeline parallelism the step reads its
 * loss and norm on the host as it always did (two waits) and every step reads.
 *
 * With train.skip_* on, each step's verdict (backend step_skip: skip its update or not) is made on
 * the device between the gradient norm and AdamW, and read with the step's values; a skipped step
 * is never a divergence.
 *
 * The divergence checks happen at the read, on each step's values in order: a loss that is
 * nan/inf on any dp rank (the ranks agree through the loss all-reduce, so they stop together),
 * then a gradient norm that is not finite; the step named is the one that diverged, with the
 * messages as always, and a run reports it at the next step that reads (the steps between ran
 * on, on nan, and are never saved: a checkpoint reads first). A step stops at once on any other
 * error: a forward or backward that failed (the model's or the strategy's status). Not here:
 * logging and records (metrics), checkpoints (checkpoint), the test hooks' own logic (hooks: the
 * step only calls them). */
#ifndef MESHRUN_TRAIN_H
#define MESHRUN_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/backend.h"
#include "trainer/comm/comm.h"
#include "trainer/formats/data.h"
#include "trainer/parallel/dp.h"
#include "trainer/run/hooks.h"
#include "trainer/parallel/mesh.h"
#include "trainer/model/model.h"
#include "trainer/plan/pipeline.h"
#include "trainer/plan/plan.h"

/* What a step works with; main fills it once. Host values (the loss, eval sums) go through the
 * host comm of "dp_cp" (dpc, NULL in one process: dp's ranks, and cp's, which read the same
 * batches and hold different tokens of them); device tensors never pass through here. */
typedef struct {
  const plan_t *p;
  model_t *m;
  dp_t *dp;
  backend_t *be;
  const data_t *data;
  comm_t *dpc;
  const mesh_t *mesh; /* NULL in one process: its communicators' blocked time is the step's exposed communication */
  int dp_rank, dp_size;
  int cp_size, cp_rank; /* context parallelism: this rank keeps its two chunks of each sequence read */
  hooks_t *hooks;
  int32_t *tok, *tgt; /* (grad_accum_steps * micro_batch_size, seq_len) host batches: the whole step's;
                         train_init allocates them */
  /* When a step reads its values back (with those of the steps before it not read yet): when
   * read_due(read_arg, step) (1-based) says so; NULL: every step. */
  int (*read_due)(void *arg, int step);
  void *read_arg;
  /* train_init fills the rest. Without pp: the per-row losses of the micro-batch just run
   * (loss_rows), the device records of the steps not read yet (recs, pending of them from step
   * pending_first, 0-based) and their host copy, the clip scale (device), and the device comm of
   * "dp" (dpc_dev) that averages the loss. A step writes its values into one record (rec, device)
   * and copies it into recs at its end, and its optimizer values (adamw_step_t) go up from
   * step_host[pending] (pinned, a slot per record: rewritten only after a read waited for the
   * device) into step_dev, so that the step's kernels see the same pointers at every step. */
  float *loss_rows, *scale;
  void *recs, *recs_host, *rec;
  adamw_step_t *step_dev, *step_host;
  int pending, pending_first;
  comm_t *dpc_dev;
  /* After a read: the values of n_read steps from read_first (0-based), oldest first. */
  double *read_loss, *read_gnorm;
  int n_read, read_first;
  /* train.skip_* (plan_skips; NULL otherwise): the skip decision's window (device), and after a
   * read the verdicts of the n_read steps (host). */
  skip_window_t *skip_win;
  skip_verdict_t *read_skip;
  int32_t *cp_scratch; /* cp > 1: a batch's ids while this rank's rows are taken out of it */
  /* Recorded steps (train.cuda_graphs; train_graphs_open decides): graphs 1 when steps are
   * recorded here. The step's ids are staged before it (model_stage) into one of two buffers in
   * turn, so each parity has its own recording (graph), made at the first step of that parity
   * after TRAIN_GRAPH_WARMUP steps and replayed by the later ones whose micro-batches count the
   * same targets (graph_valid; another count runs that step unrecorded). valid: the step's counts. */
  int graphs, graph_steps, graph_miss, graph_last; /* graph_last: the last step's TRAIN_GRAPH_* */
  void *graph[2];
  int *valid, *graph_valid[2];
  /* Pipeline parallelism (mesh.pp > 1; NULL otherwise): the runner of this rank's stages, and the
   * host comm of the pp group that shares the last stage's loss with the others. */
  pp_runner_t *pp;
  comm_t *ppc;
  int diverged; /* set by a train_step that failed on a non-finite loss or gradient norm */
  /* Where it diverged (set with diverged): the loss (1) or the gradient norm (2), and this rank's
   * first micro-batch of that step whose own loss was not finite (1-based, 0 none; under pp the
   * pipeline's micro-batches, on the last stage's ranks only). */
  int diverged_what, diverged_micro, diverged_step; /* diverged_step 0-based */
} train_t;

/* Steps run unrecorded before the first recording: the first ones make what is made on first use
 * (matrix-product plans, attention graphs, communicators' buffers), which a recording must not. */
#define TRAIN_GRAPH_WARMUP 2

/* The most steps whose values wait on the device for a read: a step reads when this many are. */
#define TRAIN_PENDING_MAX 1024

typedef struct {
  int read;     /* the steps whose values this step read (t->n_read): 0, or this step's and those before */
  double loss;  /* mean over micro-batches and dp; when read, else nan */
  double lr;
  double gnorm; /* before clipping; when read, else nan */
  double dt;    /* seconds, from zero_grad to the optimizer's end on the device */
  double comm_wait; /* seconds of dt blocked on collectives (the exposed communication) */
  pp_step_stats_t pp; /* under pp: this rank's schedule (busy, span, in flight) */
  int graph; /* the step's work: TRAIN_GRAPH_RUN, _RECORDED (then launched) or _REPLAYED */
} train_result_t;

enum { TRAIN_GRAPH_RUN = 0, TRAIN_GRAPH_RECORDED = 1, TRAIN_GRAPH_REPLAYED = 2 };

/* Allocates the batches and the records. Returns 0 or -1 with the message in err; train_free
 * releases them. */
int train_init(train_t *t, char *err, size_t errlen);
void train_free(train_t *t); /* accepts a zeroed train_t */
/* Whether this run records its steps (t->graphs), after train_init: the plan's train.cuda_graphs
 * against what can be recorded here: a backend with graph_begin, a comm whose collectives can be
 * (comm_backend: the mesh's, NULL in one process), no pipeline (its schedule runs from the host),
 * no fault variable that changes single steps. Under auto a reason not to is one line where the
 * backend can record (none on a backend that records nothing); under on it is a plan error:
 * returns 2 with the message in err (a fault variable: the line, as under auto). 0 otherwise. */
int train_graphs_open(train_t *t, const char *comm_backend, char *err, size_t errlen);

/* Step s (0-based; logged as s + 1). Returns 0 with *out, or -1 with the message in err: a pass
 * failed (the optimizer has then not stepped), or the read found a step that diverged (t->diverged
 * set; t->n_read steps before it were read and are good). */
int train_step(train_t *t, int s, train_result_t *out, char *err, size_t errlen);
/* Reads the steps not read yet (one copy, a wait for the device; none when nothing waits) into
 * t->n_read, t->read_first, t->read_loss and t->read_gnorm. Returns 0, or -1 with the message in
 * err when one diverged (as train_step). */
int train_read(train_t *t, char *err, size_t errlen);

/* Mean eval loss over batches k = 0..eval.batches-1 (the one-process value). Under a mesh, dp
 * rank r runs batches k = r, r + dp, ... and the sums are added over "dp"; every rank runs the
 * same number of forwards (FSDP and TP forwards are collective), the spare ones on a repeated
 * batch whose loss is not counted. Returns 0 or -1 with the message in err. */
int train_eval(train_t *t, double *out, char *err, size_t errlen);

#endif
