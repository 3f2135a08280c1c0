/* pipeline: the stage split and the schedules of pipeline parallelism, as data.
 *
 * Stages: the model's blocks are cut into S = p * v contiguous stages (p pipeline ranks, v
 * virtual stages per rank); stage s lives on rank s % p, so rank r holds stages r, r + p, ...
 * (Megatron's interleaving; v = 1 is the plain pipeline). Stage 0 also holds the embedding,
 * stage S-1 the final norm and output.
 *
 * A schedule is, per rank, a list of actions: forward or backward of micro-batch mb on stage s,
 * and the point-to-point traffic around them (receive the activation a stage needs, send the one
 * it made; the same for gradients going back). One generator per schedule writes the lists; one
 * runner (not here yet) executes any of them. pp_check proves a schedule complete and free of
 * deadlock under the transport contract below, without running a model.
 *
 * Transport contract (what the runner's comm must give): a send is asynchronous and never
 * blocks the sender's list (its buffer is kept until it is received); a receive blocks until the
 * matching send was issued; messages between two ranks are received in the order they were sent,
 * per kind (activations and gradients are separate streams, so a p = 2 interleaved pipeline, where
 * both kinds flow from rank 0 to rank 1, never needs one to overtake the other).
 */
#ifndef MESHRUN_TRAINER_PIPELINE_H
#define MESHRUN_TRAINER_PIPELINE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
  PP_GPIPE = 0,        /* all forwards, then all backwards: m micro-batches of activations held */
  PP_1F1B,             /* warm-up forwards, then one forward one backward: at most p held */
  PP_INTERLEAVED_1F1B, /* 1F1B over v virtual stages per rank: the bubble shrinks by v */
  PP_SCHEDULE_COUNT
} pp_schedule_t;

typedef enum {
  PP_FWD = 0,
  PP_BWD,
  PP_RECV_ACT,  /* the input activation of (stage, mb) from stage - 1's rank */
  PP_SEND_ACT,  /* the output activation of (stage, mb) to stage + 1's rank */
  PP_RECV_GRAD, /* the gradient of (stage, mb)'s output from stage + 1's rank */
  PP_SEND_GRAD, /* the gradient of (stage, mb)'s input to stage - 1's rank */
  PP_ACTION_COUNT
} pp_kind_t;

typedef struct {
  unsigned char kind; /* pp_kind_t */
  int stage;          /* global stage 0..S-1 */
  int mb;             /* micro-batch 0..m-1 */
} pp_action_t;

typedef struct {
  pp_schedule_t schedule;
  int p, v, m;          /* ranks, virtual stages per rank, micro-batches */
  int *n;               /* n[r]: actions of rank r */
  pp_action_t **act;    /* act[r][0..n[r]-1] */
} pp_plan_t;

/* Return code of every failure here and of the runner (parallel/pipeline_run.c), with one line
 * in err (or pp_run_errmsg) that says which: there is one kind, the caller only stops. */
#define PP_EFAIL (-1)

const char *pp_schedule_name(pp_schedule_t s);
/* The stage rank `rank` (of p pipeline ranks) holds as its chunk c: stages are dealt round-robin,
 * so chunk c of rank q is stage q + c * p (interleaved schedules; c is 0 otherwise). */
int pp_stage_of(int rank, int chunk, int p);
int pp_schedule_parse(const char *name, pp_schedule_t *out); /* 0, or PP_EFAIL for an unknown name */
const char *pp_kind_name(pp_kind_t k);

/* Whether the schedule can run p ranks, v stages per rank and m micro-batches; 0, or PP_EFAIL with one
 * line in err naming what is wrong (1f1b: m >= p; interleaved: v >= 2 and m a multiple of p;
 * gpipe and 1f1b: v == 1). */
int pp_validate(pp_schedule_t s, int p, int v, int m, char *err, size_t errlen);

/* Generates the lists into *out (pp_free releases them); 0, or PP_EFAIL with err (pp_validate's
 * message, or out of memory). */
int pp_generate(pp_schedule_t s, int p, int v, int m, pp_plan_t *out, char *err, size_t errlen);
void pp_free(pp_plan_t *pl);

/* What pp_check measures by running the lists under the transport contract with unit costs
 * (forward f_cost, backward b_cost time units, communication free). */
typedef struct {
  double makespan;       /* time units from the first action to the last */
  double bubble;         /* the mean idle fraction of a rank over the makespan */
  int peak_inflight[64]; /* per rank (first 64): most micro-batches forwarded, not yet backwarded */
  int max_inflight;      /* the largest of them */
} pp_stats_t;

/* Proves pl complete (every (stage, mb) forwarded and backwarded exactly once, on the stage's
 * rank; a forward after its input arrived, a backward after its forward and its output gradient;
 * every send received once, every receive sent, on the right neighbour and in order) and free of
 * deadlock. 0 and *st filled, or PP_EFAIL with the first violation in err. */
int pp_check(const pp_plan_t *pl, double f_cost, double b_cost, pp_stats_t *st, char *err,
             size_t errlen);

/* Layer split: cut n_layers blocks into n_stages contiguous stages minimising the largest stage
 * cost, where a block costs 1, the embedding adds embed_cost to stage 0 and norm + output add
 * head_cost to the last stage (in blocks). first[s] is stage s's first layer, first[n_stages] =
 * n_layers. 0, or PP_EFAIL with err when a stage would get no block. */
int pp_split(int n_layers, int n_stages, double embed_cost, double head_cost, int *first,
             char *err, size_t errlen);

/* --- the runner (trainer/parallel/pipeline_run.c): executes this rank's list on its chunks of the model.
 * Stage s is chunk s / p of rank s % p's model (model_opts_t.n_chunks = v). */
struct model;
struct model_hooks; /* the strategy, dp_t */
struct comm;

#define PP_MAX_CHUNKS 64
#define PP_ERR_MAX 1024

typedef struct {
  pp_schedule_t schedule;
  int p, v, m;     /* pipeline ranks, stages per rank, micro-batches per step */
  int rank;        /* this rank's pipeline rank */
  struct model *model; /* this rank's chunks */
  struct model_hooks *dp;   /* its strategy (dp_set_sync per backward; status checked), or NULL */
  /* mesh_pp_channels_t: activations to rank + 1 and from rank - 1, gradients the other way */
  struct comm *send_act, *recv_act, *send_grad, *recv_grad;
} pp_runner_config_t;

/* What one step measured on this rank. */
typedef struct {
  int64_t span_ns;        /* from the first action to the last transfer waited for */
  int64_t busy_ns;        /* in forwards and backwards (their own collectives included) */
  int64_t wait_ns;        /* blocked on transfers */
  int peak_inflight;      /* micro-batches forwarded and not yet backwarded, at most */
  double loss_sum;        /* the last stage: the sum of its micro-batches' losses */
  int bad_mb;             /* the last stage: first micro-batch whose loss was nan/inf, else -1 */
} pp_step_stats_t;

typedef struct {
  pp_runner_config_t cfg;
  pp_plan_t plan;
  int slots[PP_MAX_CHUNKS];     /* per chunk: what the model must be created with (pp_slots) */
  int last_bwd[PP_MAX_CHUNKS];  /* per chunk: the micro-batch of its last backward */
  unsigned char *taken;         /* (v * smax) chunk c's slot k in use: taken[c * smax + k] */
  int smax;                     /* the most slots of any chunk */
  void *mbs;                    /* (v * m) per micro-batch state */
  pp_step_stats_t stats;
  char err[PP_ERR_MAX];
} pp_runner_t;

/* Activation slots each chunk of `rank` needs to run pl (slots[0..v-1]): the most micro-batches
 * between entering and leaving the chunk in the list, plus one for chunks that send gradients. */
int pp_slots(const pp_plan_t *pl, int rank, int *slots);
/* Generates the schedule and sizes the slots (r->slots: create the model with them). 0, or PP_EFAIL
 * with err. The model and comms may be set in r->cfg afterwards (before the first step). */
int pp_runner_init(pp_runner_t *r, const pp_runner_config_t *cfg, char *err, size_t errlen);
void pp_runner_free(pp_runner_t *r); /* accepts a zeroed runner */
/* One step: m micro-batches of b sequences of t tokens (tok, tgt: host, micro-batch mb at
 * mb * b * t; only the first stage reads tok, only the last tgt), each backward scaled by
 * loss_scale. 0, or PP_EFAIL with pp_run_errmsg (every transfer started has been waited for). */
int pp_run_step(pp_runner_t *r, const int32_t *tok, const int32_t *tgt, int b, int t, float loss_scale,
                pp_step_stats_t *out);
/* One forward of one batch through the stages, not pipelined (evaluation); *loss on the rank of
 * the last stage, 0 elsewhere. */
int pp_run_forward(pp_runner_t *r, const int32_t *tok, const int32_t *tgt, int b, int t, float *loss);
const char *pp_run_errmsg(const pp_runner_t *r);

#endif
