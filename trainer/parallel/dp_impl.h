/* dp_impl: what the data-parallel strategies share, private to trainer/parallel/dp*.c.
 *
 * dp.c owns the public functions of dp.h; each strategy is one table of operations (dp_ops_t)
 * in its own file, and dp.c dispatches through it without asking which strategy it is:
 *   dp_ddp.c    serial, DDP, ZeRO-1 (the model's flat buffers, whole on every rank)
 *   dp_fsdp.c   FSDP, HSDP (per-unit padded shards) and the shard layout they share with
 *   dp_zero2.c  ZeRO-2 (replicated parameters, gradients and optimizer state sharded)
 * The state of every strategy lives in one struct (dp_impl_t): the fields a strategy does not
 * use stay zero, and dp_destroy frees them all. Not a public interface: dp.h is. */
#ifndef MESHRUN_DP_IMPL_H
#define MESHRUN_DP_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/comm/comm.h"
#include "trainer/parallel/dp.h"
#include "trainer/model/model.h"
#include "trainer/model/optim.h"

typedef struct dp_impl dp_impl_t;

/* A collective of the strategy that may be in flight (parallel.overlap), and what completes it.
 * Started with one of dp.c's dp_start_* (which, without overlap, waits at once: the same calls
 * in the same order, only blocking where they are issued); dp_op_wait blocks until it is done,
 * counts its bytes, and runs then (widen a bf16 result, add a reduced gradient shard into the
 * accumulated ones, ...). Idle (req NULL, nothing to run) when zeroed. */
typedef struct dp_op dp_op_t;
struct dp_op {
  comm_req_t *req;
  comm_t *comm;
  uint64_t *counter; /* the d->traffic field its bytes go to */
  int pending;       /* started and not yet waited (then still to run) */
  int (*then)(dp_impl_t *d, dp_op_t *op);
  int unit; /* the unit a gradient buffer's reduce-scatter is for */
  int sync; /* dp_t's sync when started (HSDP: the replicate all-reduce follows) */
  char what[80]; /* "all_gather of unit 3 parameters" */
};

#define DP_CK_RANGES_MAX(n_units) (4 * (size_t)(n_units) + 3)

/* A part of a tensor inside this rank's gradient storage, for the norm. */
typedef struct {
  size_t offset, numel; /* in floats, from the start of the storage */
  int tp_split;         /* MODEL_TP_* of the tensor */
} dp_part_t;

/* A contiguous range of the model's flat (tp-local) layout and where one kind of state for it
 * lives on the device. */
typedef struct {
  const char *kind; /* "param", "adam_m", "adam_v" */
  size_t flat, count;
  float *dev;
  int save; /* this rank saves it (no other rank saves the same values) */
} dp_ck_range_t;

/* One strategy. NULL model hooks are no-ops; every other operation is required. */
typedef struct {
  const char *name; /* dp_t.name */
  /* Layout, buffers and optimizer (after dp.c has filled the common fields). */
  int (*setup)(dp_impl_t *d, const plan_t *p, char *err, size_t errlen);
  /* The model's hooks (dp.h); all NULL: the model runs without a strategy (dp == NULL). */
  int (*gather)(dp_t *dp, int unit, int for_backward);
  int (*release)(dp_t *dp, int unit, int after_backward);
  int (*reduce_grads)(dp_t *dp, int unit);
  int (*init_params)(dp_impl_t *d, uint64_t seed, double init_std);
  int (*unit_open)(dp_impl_t *d, int unit);
  int (*unit_commit)(dp_impl_t *d, int unit);
  const float *(*unit_params)(dp_impl_t *d, int unit); /* after unit_open: unumel[u] floats */
  void (*zero_grad)(dp_impl_t *d);
  int (*grad_norm)(dp_impl_t *d, double *norm);
  /* dp_clip_dev: the norm and the clip scale into device memory (dp_clip_of over its storage). */
  int (*clip)(dp_impl_t *d, double clip, double *norm, float *scale);
  /* The update with grad_scale, or with the scale in device memory when scale_dev is not NULL
   * (dp_adamw picks). */
  int (*step)(dp_impl_t *d, double lr, double grad_scale, const float *scale_dev);
  /* Waits for every collective still in flight (before anything reads or writes what they
   * use: the norm, the step, checkpoints, opening units). NULL: none are ever left. */
  int (*drain)(dp_impl_t *d);
  /* The state this rank holds as ranges (at most DP_CK_RANGES_MAX(n_units)), and what a load
   * must redo after filling them (NULL: nothing). */
  int (*ck_ranges)(dp_impl_t *d, dp_ck_range_t *r);
  int (*ck_loaded)(dp_impl_t *d);
  void (*memory)(const dp_impl_t *d, dp_memory_t *out);
} dp_ops_t;

extern const dp_ops_t dp_serial_ops, dp_ddp_ops, dp_zero1_ops; /* dp_ddp.c */
extern const dp_ops_t dp_fsdp_ops, dp_hsdp_ops;               /* dp_fsdp.c */
extern const dp_ops_t dp_zero2_ops;                            /* dp_zero2.c */

struct dp_impl {
  dp_t pub;
  const dp_ops_t *ops;
  model_t *m;
  backend_t *be;
  int reshard, sync, tp;
  int overlap;     /* parallel.overlap */
  int rep_reduce;  /* HSDP: shard gradients are all-reduced over dp_replicate */
  int ngrad;       /* gradient buffers (gradbuf, rstmp) used in turn by unit parity: 2 with overlap */
  /* Mixed precision: the model's compute dtype (FSDP and HSDP gather bf16 copies when it is
   * bf16) and the dtype gradient reductions travel in (reduce_dtype). */
  dtype_t pdt, rdt;
  void *rlp;    /* reduce_dtype bf16: gradients rounded for the wire (rlp_n elements): per gradient
                   buffer a padded unit and its chunk (rs_lp_n), then HSDP's replicate all-reduce
                   of the shard (shard_total); DDP: the whole flat gradient, by bucket */
  size_t rlp_n, rs_lp_n;
  comm_t *dp_comm, *shard_comm, *rep_comm, *tp_comm; /* device memory (the backend's) */
  comm_t *dp_hcomm, *shard_hcomm, *tp_hcomm;          /* host memory: the norm's shares */
  comm_t *pp_hcomm;                                   /* host, pipeline stages (NULL without pp) */
  int n_units;
  size_t *uoff, *unumel; /* (n_units) the model's local layout */
  size_t num_params;

  /* serial / DDP / ZeRO-1: the model's flat buffers; ZeRO-1's slice */
  float *params, *grads;
  size_t opt_off, opt_count;    /* the optimizer's range of the flat buffer */
  size_t zero_chunk, zero_tail; /* ZeRO-1: all-gathered slice and broadcast tail, floats */
  /* DDP / ZeRO-1 buckets (parallel.bucket_mb): runs of whole units, contiguous in the flat
   * buffer, filled in backward order; bucket b spans units [blo[b], bhi[b]] and is all-reduced
   * once its lowest unit's backward is done. bucket_of[u] is u's bucket. */
  int n_buckets;
  int *blo, *bhi, *bucket_of;
  dp_op_t *bops; /* (n_buckets) */

  /* Shards (FSDP, HSDP over dp_shard; ZeRO-2 over dp): see dp_shard_setup */
  int S, s;                 /* shard degree and this rank's shard */
  size_t *chunk, *soff;     /* (n_units) c_u and the unit's offset in the shard buffers */
  size_t shard_total;
  float *sparams, *sgrads;  /* (shard_total) */
  void *sp_lp;              /* bf16 gathers: the bf16 copy of sparams, written by the fused AdamW */
  float *gbuf;              /* gathered fp32 parameters: one slot (reshard) or one per unit; with
                               bf16 gathers only one slot, for dp_unit_open (exact fp32 values) */
  void *gbuf_lp;            /* bf16 gathers: the gathered bf16 slots (as gbuf's fp32 ones) */
  size_t *goff;             /* (n_units) slot offset of each unit in gbuf */
  int *holder;              /* (n_units) unit held by the slot at goff[u], -1 none */
  size_t gbuf_floats, gmax; /* gmax: the largest padded unit P_u */
  float *gradbuf, *rstmp;   /* ngrad x (gmax) and ngrad x (max c_u): unit u uses number u % ngrad */
  size_t cmax;              /* the largest chunk c_u */
  int nslots;               /* gathered slots: 0 one per unit, else shared by units in turn (u % nslots) */
  dp_op_t *gops;            /* (n_units) the gather into each slot (indexed by slot) */
  dp_op_t *rsops;           /* (ngrad) the reduce-scatter out of each gradient buffer */
  dp_op_t *arops;           /* (n_units) HSDP's replicate all-reduce of each unit's shard grads */

  dp_part_t *parts;
  int n_parts;
  size_t *part_off, *part_len; /* (n_parts) the parts as sumsq_parts takes them (dp_norm_of) */
  int *part_group;             /* (n_parts) 1: tp-replicated under tp (counted once), else 0 */
  double *part_sumsq;
  void *norm_dev; /* device: dp_clip_of's sums (2 doubles) and fp32 shares (2 floats) */
  /* This rank's own gradients before a reduction (dp_local_first_bad): per tensor, in the model's
   * order, the sum of squares of what this rank reduced on the last micro-step (device doubles,
   * zeroed with the gradients); loc_off and loc_len the tensors' places in their unit's gradients, ufirst and ucount
   * each unit's tensors (consecutive in the model's order). local NULL: none kept (serial, which
   * reduces nothing, or MESHRUN_LOCAL_NORMS=0). */
  double *local;
  size_t *loc_off, *loc_len;
  int *ufirst, *ucount;
  int poison; /* dp_poison_grad: 1 + the tensor whose gradient turns nan at its next reduction with sync; 0 none */
  model_tensor_t *ck_ts; /* (ck_nt) copies of the model's tensors: checkpoint chunks name them */
  int ck_nt;
  optim_t opt;
  const adamw_step_t *step_dev; /* dp_step_dev's update values in device memory, for dp_adamw */
  dp_traffic_t traffic;
  int status;
  char err[512];
};

dp_impl_t *dp_impl_of(dp_t *dp); /* dp.c: the state behind a public handle (the hooks' dp) */
/* dp.c: the first failure, kept (the model only logs what hooks return); returns the code. */
int dp_fail(dp_impl_t *d, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* dp.c: the collectives, each counted into d->traffic by operation and checked (dp_fail). */
int dp_all_reduce(dp_impl_t *d, comm_t *c, float *buf, size_t n, comm_op_t op, const char *what);
int dp_all_gather(dp_impl_t *d, comm_t *c, const void *in, void *out, size_t n, dtype_t dt, const char *what);
int dp_reduce_scatter(dp_impl_t *d, comm_t *c, const float *in, float *out, size_t n, const char *what);
int dp_broadcast(dp_impl_t *d, comm_t *c, float *buf, size_t n, int root, const char *what);
/* dp.c: asynchronous forms (see dp_op_t); the op must be idle. Errors are kept (dp_fail). */
int dp_start_all_gather(dp_impl_t *d, dp_op_t *op, comm_t *c, const void *in, void *out, size_t n, dtype_t dt,
                        const char *what);
int dp_start_reduce_scatter(dp_impl_t *d, dp_op_t *op, comm_t *c, const void *in, void *out, size_t n, dtype_t dt,
                            const char *what); /* avg */
int dp_start_all_reduce(dp_impl_t *d, dp_op_t *op, comm_t *c, void *buf, size_t n, dtype_t dt,
                        const char *what); /* avg */
int dp_op_wait(dp_impl_t *d, dp_op_t *op);
int dp_ops_wait(dp_impl_t *d, dp_op_t *ops, int n); /* each of n, in order */
/* dp.c: unit u's gradients g (its local layout, this rank's own) are about to be reduced: the
 * armed poison of one of its tensors (dp_poison_grad), then their per-tensor sums of squares
 * added into d->local (one launch). Every strategy that reduces calls it first. */
void dp_before_reduce(dp_impl_t *d, int u, float *g);
/* dp.c: a norm part (parts has room for one per tensor). */
void dp_add_part(dp_impl_t *d, size_t offset, size_t numel, int tp_split);
/* dp.c: the global gradient norm of storage g (laid out as d->parts): the sums of squares of
 * tp-split and tp-replicated parts, all-reduced over shard_hcomm (NULL: not sharded) and tp. */
int dp_norm_of(dp_impl_t *d, const float *g, comm_t *shard_hcomm, double *norm);
/* dp.c: dp_norm_of on the device: the sums (backend sumsq_groups), the fp32 shares all-reduced
 * over shard_comm (NULL: not sharded) and tp with the device comms, then *norm and the clip scale
 * *scale (device memory) from the backend's clip_scale; nothing waits for the device. Not under
 * pipeline parallelism (DP_EINVAL): its stages add up over the host comm. */
int dp_clip_of(dp_impl_t *d, const float *g, comm_t *shard_comm, double clip, double *norm, float *scale);
/* dp.c: AdamW over a range: optim_step, or optim_step_dev when scale_dev is not NULL. */
void dp_adamw(dp_impl_t *d, float *params, const float *grads, void *params_lp, double lr, double grad_scale,
              const float *scale_dev);
int dp_rank_of(comm_t *c); /* 0 for NULL */

/* dp_fsdp.c: the per-unit shard layout over d->S shards (d->S, d->s set): unit u padded to
 * P_u = S * c_u, shard s its slice [s * c_u, (s + 1) * c_u) at soff[u] of sparams / sgrads;
 * gbuf with nslots slots of the largest unit used in turn (u % nslots), or with nslots 0 one
 * slot per unit at goff[u]; ngrad gradient buffers and reduce-scatter scratches; norm parts and
 * the optimizer over the shards. lp_gather: gathers move the bf16 copies (sp_lp into gbuf_lp
 * slots); gbuf is then one fp32 slot for dp_unit_open. */
int dp_shard_setup(dp_impl_t *d, const plan_t *p, int nslots, int lp_gather, const char *what, char *err,
                   size_t errlen);
/* dp_fsdp.c: unit u's gradient buffer (zeroed by zero_grads: after the reduce-scatter that last
 * read it has completed). */
float *dp_shard_gradbuf(dp_impl_t *d, int u, int zero_grads);
/* dp_fsdp.c: reduce_scatter (avg) of unit u's gradient buffer over shard_comm, added into its
 * shard grads when it completes; with overlap it completes while unit u-1 computes (at the next
 * dp_shard_reduce, or at the drain). With rep_reduce (HSDP) and sync, the replicate all-reduce of
 * the unit's shard grads follows, started when the reduce-scatter completes. */
int dp_shard_reduce(dp_impl_t *d, int u);
int dp_shard_drain(dp_impl_t *d);
/* dp_fsdp.c: per unit with real elements in this shard, its param (sparams), adam_m and adam_v
 * ranges, saved by this rank when save_params / save_moments. */
int dp_shard_ck_ranges(dp_impl_t *d, dp_ck_range_t *r, int save_params, int save_moments);

/* dp_fsdp.c: unit u's shard from its gathered slot (after the caller changed the slot), the
 * slot itself, and zeroing the gradient shards. */
int dp_shard_unit_commit(dp_impl_t *d, int u);
const float *dp_shard_unit_params(dp_impl_t *d, int u);
void dp_shard_zero_grad(dp_impl_t *d);
/* dp_fsdp.c: random initial parameters (model_init_unit_host) into the shards, and with
 * replicate also whole into every unit's slot. Not collective. */
int dp_shard_init(dp_impl_t *d, uint64_t seed, double init_std, int replicate);

#endif
