/* plan: the trainer's JSON parallelism plan, parsed and validated into plain structs.
 *
 * plan_load reads a JSON file (or the embedded default, configs/demo.json's content, when path
 * is NULL), applies "--set key.path=value" overrides, checks keys and types, and fills plan_t
 * with defaults for absent keys. plan_resolve then checks everything that depends on the
 * world size (mesh product, batch divisibility) and computes the derived fields. Every error is
 * one line "plan error: <key.path>: <what is wrong and what is allowed>" in err; main prints it
 * and exits 2. The cJSON tree never leaves plan.c. Keys are documented in docs/plan.md.
 * Relative paths of the files a plan reads (model.init, data.train, data.val, data.tokenizer)
 * written in a plan file are taken from the plan file's folder; --set values and the paths a
 * run writes stay relative to the working directory.
 * plan_check_paths is the one part that touches the filesystem beyond reading the plan. */
#ifndef MESHRUN_PLAN_H
#define MESHRUN_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/backend.h" /* dtype_t: parallel.mixed_precision's values */

#define PLAN_PATH_MAX 1024
#define PLAN_PATHS_MAX 8192 /* data.train and data.val: a list of shards */
#define PLAN_FILE_MAX (16 << 20) /* bytes; a plan file must be a regular file no larger */
#define PLAN_EINVAL (-2)

#define PLAN_DEVICE_MAX 64 /* bytes of the device key's value, with its NUL */
typedef enum { PLAN_SCHED_COSINE = 0, PLAN_SCHED_LINEAR, PLAN_SCHED_CONSTANT } plan_sched_t;
typedef enum {
  PLAN_DATA_AUTO = 0, /* by extension/header: .txt -> text, llm.c magic -> llmc, .u16/.u32 raw */
  PLAN_DATA_TEXT,     /* bytes, vocab 256 */
  PLAN_DATA_LLMC,     /* 256 x int32 header (magic 20240520, version 1), then uint16 tokens */
  PLAN_DATA_U16,      /* raw uint16 tokens */
  PLAN_DATA_U32,      /* raw uint32 tokens */
  PLAN_DATA_SYNTHETIC /* deterministic pseudo-random tokens from the seed */
} plan_data_format_t;
/* parallel.activation_checkpoint: none; full (every block recomputes its forward in its
 * backward); selective = torchtitan's "layer" mode (every k-th block, k =
 * activation_checkpoint_every). */
typedef enum { PLAN_AC_NONE = 0, PLAN_AC_FULL, PLAN_AC_SELECTIVE } plan_ac_t;
typedef enum {
  PLAN_TP_COLWISE = 0,
  PLAN_TP_ROWWISE,
  PLAN_TP_SEQUENCE_PARALLEL,
  PLAN_TP_PREPARE_INPUT,
  PLAN_TP_REPLICATE
} plan_tp_style_t;

typedef struct {
  int dim;               /* model width C */
  int n_layers;
  int n_heads;
  int n_kv_heads;        /* grouped-query attention; divides n_heads */
  int vocab_size;
  int max_seq_len;
  int multiple_of;       /* Llama hidden-size rule, default 256 */
  double ffn_dim_multiplier; /* 0 = none */
  int hidden_dim;        /* derived by plan_resolve (or given explicitly: model.hidden_dim > 0) */
  double rope_theta;     /* default 10000 */
  double norm_eps;       /* default 1e-5 */
  double init_std;       /* default 0.02 */
  char init[PLAN_PATH_MAX]; /* "" = random from seed; else weights: ours, llama2.c .bin, HF dir */
  int attention;         /* attn_choice_t (backend.h): which attention kernel (model.attention) */
} plan_model_t;

typedef struct {
  int dp_replicate, dp_shard, tp; /* one may be -1 in the file: "the rest of WORLD_SIZE" */
  int pp;                         /* pipeline stages' ranks, outermost (default 1; may be the -1) */
  int cp;                         /* context parallel: ranks sharing each sequence (default 1; may be the -1) */
} plan_mesh_t;

/* train.cuda_graphs: record a step after warm-up and replay it (train.h) where the backend can. */
typedef enum { PLAN_GRAPHS_AUTO = 0, PLAN_GRAPHS_ON = 1, PLAN_GRAPHS_OFF = 2 } plan_graphs_t;

/* parallel.cp_rotate: how K/V reach the other context-parallel ranks (ring_attention.h's order). */
typedef enum { PLAN_CP_RING = 0, PLAN_CP_ALLGATHER = 1 } plan_cp_rotate_t;

/* parallel.pp_schedule: the pipeline schedules (trainer/plan/pipeline.h's pp_schedule_t, same order). */
typedef enum { PLAN_PP_GPIPE = 0, PLAN_PP_1F1B, PLAN_PP_INTERLEAVED_1F1B } plan_pp_schedule_t;
#define PLAN_PP_SPLIT_MAX 256 /* stages at most: pp * pp_stages_per_rank */

#define PLAN_TP_PLAN_MAX 32
typedef struct {
  char module[96];       /* e.g. "attention.wq", "feed_forward.w2", "norm", "output", "tok_embeddings" */
  plan_tp_style_t style;
} plan_tp_entry_t;

typedef struct {
  int zero;                  /* 0 (none), 1 (ZeRO-1: optimizer state sharded over dp) or 2 (ZeRO-2: gradients too) */
  int reshard_after_forward; /* FSDP: free gathered params after forward (default 1) */
  int sequence_parallel;     /* TP: default 1 when tp > 1 */
  int loss_parallel;         /* TP: default 1 when tp > 1 */
  plan_tp_entry_t tp_plan[PLAN_TP_PLAN_MAX]; /* default Llama plan when absent */
  int n_tp_plan;
  dtype_t param_dtype;  /* mixed_precision.param_dtype: compute copies, activations (cuda bf16, cpu fp32) */
  int param_dtype_explicit;  /* 1 when param_dtype was given (file or --set), 0 when defaulted */
  dtype_t reduce_dtype; /* mixed_precision.reduce_dtype: gradient reductions, default fp32 */
  int allow_tf32;            /* mixed_precision.allow_tf32: TF32 tensor-core matmuls on cuda
                                (default 1); no effect on cpu */
  plan_ac_t activation_checkpoint; /* default none */
  int activation_checkpoint_every; /* selective: blocks k-1, 2k-1, ... are checkpointed (default 2) */
  int overlap;               /* communication behind compute: FSDP prefetch, asynchronous reduce-scatter,
                                DDP buckets reduced during the backward, the cp ring's K/V transfers
                                (default 1; 0: every collective blocks where it is issued).
                                Bit-identical losses either way. */
  int cp_rotate;             /* context parallelism's K/V exchange: PLAN_CP_RING (default) or
                                PLAN_CP_ALLGATHER (trainer/model/ring_attention.h) */
  double bucket_mb;          /* DDP / ZeRO-1 gradient buckets, MiB (default 25, PyTorch's bucket_cap_mb) */
  double comm_timeout_s;     /* seconds a collective (or the comms' setup) may go without progress from
                                a peer before it fails naming the collective (default 300);
                                MESHRUN_COMM_TIMEOUT, when set, overrides it (comm_timeout_ms) */
  int comm_flight_records;   /* calls the comm flight recorder keeps, 0 (off) .. 2^20 (default 2048);
                                MESHRUN_COMM_FLIGHT_RECORDS, when set, overrides it (comm_flight_records) */
  /* Pipeline parallelism (mesh.pp > 1). */
  plan_pp_schedule_t pp_schedule; /* default 1f1b */
  int pp_microbatches;       /* micro-batches per step per dp rank; 0 in the file: train.grad_accum_steps
                                (resolved), each of micro_batch_size * grad_accum_steps / pp_microbatches
                                sequences */
  int pp_stages_per_rank;    /* virtual stages v; 0 in the file: 2 for interleaved_1f1b, else 1 (resolved) */
  int pp_split[PLAN_PP_SPLIT_MAX]; /* first layer of stages 1..S-1 (S = pp * v): given, or the balanced
                                      split (resolved; embedding with stage 0, norm and output with S-1) */
  int n_pp_split;            /* S - 1 after plan_resolve; as given before (0: absent) */
} plan_parallel_t;

typedef struct {
  int steps;              /* optimizer steps */
  int seq_len;            /* T, <= model.max_seq_len */
  int micro_batch_size;   /* B per rank per forward */
  int global_batch_size;  /* sequences per optimizer step, all ranks; default micro*dp */
  int grad_accum_steps;   /* derived: global / (micro * dp degree) */
  double lr;              /* peak */
  double min_lr;          /* default lr/10 */
  int warmup_steps;       /* linear warmup from 0 */
  plan_sched_t decay;     /* after warmup: cosine (default), linear, constant */
  double weight_decay;    /* default 0.1 */
  int decay_norms;        /* apply weight decay to norm weights (default 0) */
  int decay_embeddings;   /* apply weight decay to the token embedding (default 0) */
  double beta1, beta2, eps; /* 0.9, 0.95, 1e-8 */
  double grad_clip;       /* global norm clip, default 1.0; 0 = off */
  int graphs;             /* train.cuda_graphs: PLAN_GRAPHS_AUTO (default), _ON or _OFF */
  int skip_nonfinite;     /* a step whose loss or gradient norm is nan/inf does not update (default 0: it stops the run) */
  double skip_loss_z;     /* a step whose loss is this many stds over the recent mean does not update; 0 = off */
  double skip_grad_z;     /* the same for the gradient norm; 0 = off */
} plan_train_t;

typedef struct {
  char train[PLAN_PATHS_MAX]; /* path, glob, or several a line each (a list in JSON); "" with
                                format synthetic. Shards are read in order, as one stream */
  char val[PLAN_PATHS_MAX];   /* the same; "" = split off the end of train */
  plan_data_format_t format;
  double val_fraction;       /* when val is "", default 0.1 */
  char tokenizer[PLAN_PATH_MAX]; /* HF tokenizer.json (or its folder) or llama2.c tokenizer.bin;
                                    "" = none (ids printed as numbers, bytes for text data) */
} plan_data_t;

typedef struct {
  int interval; /* optimizer steps between evals; 0 = never (default: steps/10 rounded, min 1) */
  int batches;  /* micro-batches per eval, default 8 */
} plan_eval_t;

typedef struct {
  char dir[PLAN_PATH_MAX]; /* "" = no checkpoints */
  int interval;            /* steps; 0 = only at the end */
  char resume[PLAN_PATH_MAX]; /* "none" (default), "auto", or a checkpoint path */
  int keep;                /* newest kept, default 3 */
  int async;               /* default 0 */
  int on_signal;           /* SIGTERM, SIGINT, SIGUSR1: finish the step, save, exit 128 + signal
                              (default: on when dir is set; resolved to 0 or 1) */
} plan_checkpoint_t;

typedef struct {
  int interval;                     /* console line every N steps, default 1 */
  char metrics_file[PLAN_PATH_MAX]; /* JSONL, "" = none */
  char trace_file[PLAN_PATH_MAX];   /* Chrome trace events (chrome://tracing, Perfetto), "" = none */
  int trace_steps;                  /* steps traced, from the first (default 3) */
  char tensorboard_dir[PLAN_PATH_MAX]; /* TensorBoard event files (rank 0's scalars), "" = none */
  double peak_tflops;               /* the device's peak for MFU, TFLOP/s; 0 = the backend's own
                                       (backend_t.peak_flops), else no MFU (FLOP/s alone) */
  double straggler_pct;             /* the console names the slowest rank when its compute time is
                                       more than this % over the median (default 20) */
} plan_log_t;

typedef struct {
  int sample_tokens; /* tokens generated at the end of training (default 200; 0 = none) */
  double temperature; /* default 0.8; 0 = greedy */
  char prompt[256];   /* default "\n" */
  int top_k;          /* keep the k most likely tokens; 0 = all (default) */
  double top_p;       /* nucleus: the fewest tokens whose probability sums to >= top_p; 1 = all */
} plan_sample_t;

typedef struct {
  char device[PLAN_DEVICE_MAX]; /* "auto" or a compute backend's name (plan_set_devices) */
  uint64_t seed;
  int overwrite; /* a run starting afresh may replace an earlier run's outputs (default false) */
  plan_model_t model;
  plan_mesh_t mesh;
  plan_parallel_t parallel;
  plan_train_t train;
  plan_data_t data;
  plan_eval_t eval;
  plan_checkpoint_t checkpoint;
  plan_log_t log;
  plan_sample_t sample;
  char source[PLAN_PATH_MAX]; /* file it came from, "(embedded default)" otherwise */
  unsigned rebased;           /* inputs written relative in the plan file, taken from its folder
                                 (bits: model.init, data.train, data.val, data.tokenizer) */
} plan_t;

/* The values the device key takes: names, NULL-terminated, "auto" among them (the trainer
 * passes its compute backends', trainer/run/device.h); a value outside them is a plan error
 * naming them all. The list is borrowed until the next call. Until set, any string is taken, and
 * the program checks it. */
void plan_set_devices(const char *const *names);
/* Parses path (NULL = the embedded default) and applies the overrides "key.path=value" in order.
 * Values of --set are parsed as JSON when they parse (numbers, true/false, arrays, objects),
 * else taken as strings. Returns 0 or PLAN_EINVAL with the one-line message in err. */
int plan_load(plan_t *p, const char *path, const char *const *sets, int nsets, char *err, size_t errlen);
/* Checks the plan against world_size, resolves mesh -1 entries, hidden_dim, grad_accum_steps,
 * defaults that depend on other keys. Returns 0 or PLAN_EINVAL. */
int plan_resolve(plan_t *p, int world_size, char *err, size_t errlen);
/* The smallest world the plan's mesh takes: the product of its entries that are not -1 (so
 * sample and export resolve a training plan of any world in one process). */
int plan_mesh_min_world(const plan_t *p);
/* The parameters of the plan's model (resolved plan), as a double: sizes no int holds. */
double plan_param_count(const plan_t *p);
/* A lower bound of the memory one rank of the (resolved) plan needs: its share of the fp32
 * parameters and at least bf16 gradients (6 bytes a parameter, over tp x pp x dp_shard) and of
 * the AdamW moments (8 bytes, over every rank that may shard them), and one micro-batch's logits
 * (2 bytes each, a tp rank's columns; without a pipeline, whose micro-batches differ). PLAN_EINVAL with "plan error: model: ..."
 * (the figures and what to change) when it exceeds bytes / ranks (the memory of a machine that
 * runs `ranks` of them), else 0; bytes 0 (unknown) passes. */
int plan_check_memory(const plan_t *p, double bytes, int ranks, char *err, size_t errlen);
/* Checks, for a training run, before anything starts: every file the plan reads (model.init,
 * each shard of data.train and data.val after glob expansion, data.tokenizer) is there and
 * readable; then that checkpoint.dir (when set) is a directory this process can write: created
 * with its missing parents when absent, then a file created and removed in it. Returns 0 or
 * PLAN_EINVAL with "plan error: <key>: ..." (the path, and the system's reason). */
int plan_check_paths(const plan_t *p, char *err, size_t errlen);
/* An output folder: created with its missing parents, then proven writable by a file created
 * and removed in it; an output file: its folder so, and the file writable if it exists (left as
 * it is). 0, or PLAN_EINVAL with "plan error: <key>: ..." (the path, the system's reason, then
 * why, "" or a clause that says where the path came from). */
int plan_check_output_dir(const char *key, const char *dir, const char *why, char *err, size_t errlen);
int plan_check_output_file(const char *key, const char *path, char *err, size_t errlen);
/* An output a run starting afresh would replace: PLAN_EINVAL with "plan error: <key>: <path>
 * exists (<what>) ..." naming the ways out (--set overwrite=true among them) when path is a
 * regular file, else 0 (absent, or a device or pipe such as /dev/stdout). */
int plan_check_not_there(const char *key, const char *path, const char *what, char *err, size_t errlen);
/* Serializes the (resolved) plan as one line of JSON (malloc'ed string, caller frees): for logs, metrics
 * and checkpoint metadata. */
char *plan_to_json(const plan_t *p);
/* The same, indented (one key a line) when indented is non-zero: --print-plan's form. */
char *plan_format(const plan_t *p, int indented);
/* The embedded default plan text (same content as configs/demo.json). */
const char *plan_default_json(void);
/* Llama's hidden-size rule: 4*dim, *2/3, *multiplier, rounded up to multiple_of. */
int plan_llama_hidden_dim(int dim, int multiple_of, double ffn_dim_multiplier);
/* Pipeline stages S = mesh.pp * parallel.pp_stages_per_rank (1 without pp), after plan_resolve,
 * and the first layer of stage s (0 <= s <= S; s = S gives model.n_layers). */
int plan_pp_stages(const plan_t *p);
int plan_pp_stage_first(const plan_t *p, int s);
/* The activation-checkpoint period for model_opts_t.checkpoint_every: 0 none, 1 full, k for
 * selective (every k-th block). */
int plan_checkpoint_every(const plan_t *p);
/* Tokens of each sequence on one rank: train.seq_len, divided by mesh.cp under context
 * parallelism (the rank's two chunks). */
int plan_local_seq_len(const plan_t *p);
/* Whether any of train.skip_nonfinite, train.skip_loss_z, train.skip_grad_z is on: the steps'
 * updates may be skipped (their records then say so). */
int plan_skips(const plan_t *p);

#endif
