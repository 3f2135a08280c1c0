/* dp: the data-parallel strategy, seen from the model.
 *
 * Parameters live in sharding units (unit 0: token embedding; units 1..L: transformer
 * blocks; unit L+1: final norm and output projection), each a contiguous slice of the
 * model's flat buffers. Around each unit the model calls, in this order:
 *   forward:  gather(u) ... compute ... release(u)            (release may keep it: see FSDP)
 *   backward: gather(u) ... compute ... reduce_grads(u) ... release(u)
 * and the optimizer calls step(u) (in trainer/model/optim). The strategy decides what each means:
 *   serial: all no-ops (dp == NULL in the model means this);
 *   DDP: no-op, no-op, all_reduce(avg) of the unit's gradients, full update (ZeRO-1: update of
 *        this rank's slice of the flat buffer, then all_gather);
 *   ZeRO-2: no-op, no-op, reduce_scatter into this rank's gradient shard, shard update, then
 *        all_gather of the parameters;
 *   FSDP: all_gather the shards, free, reduce_scatter, update of the local shard;
 *   HSDP: FSDP over dp_shard plus all_reduce over dp_replicate.
 * gather(u) may redirect the model's unit pointers (model_set_unit_buffers) to a gathered
 * buffer. This header is the contract; trainer/parallel/dp.c dispatches it to one table of operations
 * per strategy (trainer/parallel/dp_impl.h): dp_ddp.c, dp_fsdp.c, dp_zero2.c. */
#ifndef MESHRUN_DP_H
#define MESHRUN_DP_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/backend.h"
#include "trainer/model/model.h"
#include "trainer/parallel/mesh.h"
#include "trainer/plan/plan.h"

/* A strategy is the model's hooks (model.h: name "serial", "ddp" (also ZeRO-1), "zero2", "fsdp"
 * or "hsdp"; ctx its state) with the operations below. */
typedef model_hooks_t dp_t;

/* --- creating and driving a strategy (trainer/parallel/dp.c), called from main.
 *
 * The strategy follows from the mesh (NULL or world 1: serial): dp_shard > 1 is FSDP (HSDP when
 * dp_replicate > 1 too), else dp_replicate > 1 is DDP (ZeRO-1 or ZeRO-2 with plan.parallel.zero
 * = 1 or 2). It owns the optimizer (trainer/model/optim) over the range of parameters this rank
 * updates, and for FSDP and ZeRO-2 the parameter and gradient storage; the model should be
 * created with model_opts_t.no_flat_buffers exactly when dp_owns_buffers(mesh, plan) (FSDP
 * requires it; ZeRO-2 works with flat buffers too, but leaves them idle). */

struct model;

/* Return codes: 0, or negative with the message in err (dp_errmsg for the hooks' failures). The
 * strategy's own are DP_EINVAL and DP_ENOMEM (the values of OPTIM_EINVAL and OPTIM_ENOMEM, which
 * optim_init's failures pass through as); a collective that failed passes the comm's COMM_E*
 * code through, and dp_ckpt_from_host a checkpoint read's CKPT_E*. */
enum {
  DP_EINVAL = -2, /* a bad call: the mesh not connected, the model built for another strategy */
  DP_ENOMEM = -4,
};

typedef struct {
  size_t param_bytes, grad_bytes, optim_bytes; /* persistent per-rank state */
  size_t work_bytes; /* FSDP, ZeRO-2: gathered parameter / transient gradient buffers and scratch */
} dp_memory_t;

/* Bytes this rank's strategy collectives moved (sent) since creation, by operation. */
typedef struct {
  uint64_t all_reduce, all_gather, reduce_scatter, broadcast;
} dp_traffic_t;

/* 1 when parameters are sharded across the mesh (dp_shard > 1: FSDP, HSDP). */
int dp_is_sharded(const mesh_t *mesh);
/* 1 when the strategy keeps the parameters and gradients itself (FSDP, HSDP, ZeRO-2): create
 * the model with no_flat_buffers then. */
int dp_owns_buffers(const mesh_t *mesh, const plan_t *p);
/* Builds the strategy for model m and installs its hooks (model_set_hooks). Not collective.
 * Returns 0, or a negative code with the reason in err. */
int dp_create(dp_t **out, struct model *m, backend_t *be, const mesh_t *mesh, const plan_t *p, char *err,
              size_t errlen);
void dp_destroy(dp_t *dp); /* accepts NULL; uninstalls the hooks */
/* Random initial parameters (as model_init_random would give the unsharded model). */
int dp_init_params(dp_t *dp, uint64_t seed, double init_std);
/* Gradient synchronization on the coming backward: 0 on all but the last micro-step of an
 * accumulation (DDP's no_sync; HSDP's replicate all-reduce), 1 (the default) on the last. */
void dp_set_sync(dp_t *dp, int sync);
void dp_zero_grad(dp_t *dp);
/* Global gradient norm over all ranks (collective over the mesh's dp_shard and tp groups). */
int dp_grad_norm(dp_t *dp, double *norm);
/* One AdamW update of this rank's range, then whatever makes parameters whole again. */
int dp_step(dp_t *dp, double lr, double grad_scale);
/* dp_grad_norm and optim_clip_scale without the host: the global norm into *norm and the clip
 * scale into *scale, both device memory (the backend's), with the same arithmetic and
 * reductions (over the groups' device comms), and nothing waits for the device. Collective as
 * dp_grad_norm is; not under pipeline parallelism (DP_EINVAL). */
int dp_clip_dev(dp_t *dp, double clip, double *norm, float *scale);
/* The host's half of dp_step_dev: counts the update and returns its values (optim_next), which
 * the caller puts in device memory before the step's kernels run. */
adamw_step_t dp_next_step(dp_t *dp, double lr);
/* dp_step with the update's values (*st, from dp_next_step) and the clip scale (as dp_clip_dev
 * wrote it) in device memory: the same calls with the same arguments at every step. */
int dp_step_dev(dp_t *dp, const adamw_step_t *st, const float *grad_scale);
/* Where a non-finite gradient came from (trainer/run/origin.h). Before a strategy reduces a
 * unit's gradients over ranks, it adds the sums of squares of this rank's own gradient of each of
 * the unit's tensors into a device array (one launch per unit; no wait), on the last micro-step
 * of a step only: under DDP and ZeRO-1 the buffer then holds every micro-step's gradients; FSDP,
 * HSDP and ZeRO-2 reduce each micro-step's, and only the last one's are summed (an earlier
 * micro-step's nan reaches every rank through the reduction unnamed). The serial strategy
 * reduces nothing and keeps none. Under pipeline parallelism they are this rank's chunks' tensors (model_tensor's local
 * order), summed at each unit's reduction after its last backward of the step (dp_set_sync).
 * MESHRUN_LOCAL_NORMS=0 turns them off (the benchmark of their cost).
 * dp_local_first_bad copies them from the device (a wait) and sets *first to the first tensor,
 * in the model's order, whose sum is not finite, or to the tensor count when none; it returns 0,
 * 1 when the strategy reduces nothing (serial: the gradients in the model's flat buffer are this
 * rank's own), or DP_EINVAL when the strategy keeps none. The sums are the last step's. */
int dp_local_first_bad(dp_t *dp, int *first);
/* A fault for tests (MESHRUN_FAULT_NAN_GRAD where the model has no flat gradient buffer): the
 * gradient of the tensor named turns nan at its next reduction that synchronizes (dp_set_sync's
 * last micro-step), before the sums above. Returns 0, or DP_EINVAL when no such tensor or the
 * strategy reduces nothing. */
int dp_poison_grad(dp_t *dp, const char *tensor);
/* Unit u's full local parameters (this tp rank's slices) in the model's unit buffers, and back.
 * dp_unit_open is collective over dp_shard for FSDP; dp_unit_commit writes the rank's shard (or
 * the flat buffer) from the unit buffer after the caller changed it (model_import_tensor). */
int dp_unit_open(dp_t *dp, int unit);
int dp_unit_commit(dp_t *dp, int unit);
/* Host copy of unit u's local parameters (after dp_unit_open), unit numel floats. */
void dp_unit_to_host(dp_t *dp, int unit, float *host);
void dp_memory(const dp_t *dp, dp_memory_t *out);

/* --- checkpoints (trainer/formats/ckpt). Parameters are saved as kind "param", AdamW moments as
 * "adam_m" and "adam_v", each as chunks of full tensors (ckpt_chunks_add_range), so a
 * checkpoint loads under any other strategy and mesh.
 * dp_ckpt_to_host appends this rank's share to cs: what no other rank saves too (DDP: dp rank 0
 * saves the parameters and moments; ZeRO-1: every dp rank its slice of the moments; FSDP and
 * ZeRO-2: each shard; HSDP: the shards of replica 0; tp replicated tensors: tp rank 0). The chunks point
 * into *host (a host copy made here; the caller frees it after the save). Not collective.
 * dp_ckpt_from_host fills everything this rank holds (replicas included) from ck. Not
 * collective. The optimizer's update count travels separately (dp_optim_step). */
struct ckpt_chunks;
struct ckpt;
int dp_ckpt_to_host(dp_t *dp, struct ckpt_chunks *cs, float **host, char *err, size_t errlen);
int dp_ckpt_from_host(dp_t *dp, struct ckpt *ck, char *err, size_t errlen);
int dp_optim_step(const dp_t *dp);
void dp_set_optim_step(dp_t *dp, int step);
void dp_traffic(const dp_t *dp, dp_traffic_t *out);
/* 0, or the first error of a hook (the model's hooks return void through model_backward). */
int dp_status(const dp_t *dp);
const char *dp_errmsg(const dp_t *dp);

#endif
