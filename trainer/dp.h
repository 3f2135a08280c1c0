/* dp: the data-parallel strategy, seen from the model.
 *
 * Parameters live in sharding units (unit 0: token embedding; units 1..L: transformer
 * blocks; unit L+1: final norm and output projection), each a contiguous slice of the
 * model's flat buffers. Around each unit the model calls, in this order:
 *   forward:  gather(u) ... compute ... release(u)            (release may keep it: see FSDP)
 *   backward: gather(u) ... compute ... reduce_grads(u) ... release(u)
 * and the optimizer calls step(u) (in trainer/optim). The strategy decides what each means:
 *   serial: all no-ops (dp == NULL in the model means this);
 *   DDP: no-op, no-op, all_reduce(avg) of the unit's gradients, full update;
 *   FSDP: all_gather the shards, free, reduce_scatter, update of the local shard;
 *   HSDP: FSDP over dp_shard plus all_reduce over dp_replicate.
 * gather(u) may redirect the model's unit pointers (model_set_unit_buffers) to a gathered
 * buffer. Implementations live in trainer/dp.c (issue 4); this header is the contract. */
#ifndef MESHRUN_DP_H
#define MESHRUN_DP_H

typedef struct dp dp_t;

struct dp {
  const char *name; /* "serial", "ddp", "fsdp", "hsdp" */
  void *ctx;
  int (*gather)(dp_t *dp, int unit, int for_backward);
  int (*release)(dp_t *dp, int unit, int after_backward);
  int (*reduce_grads)(dp_t *dp, int unit);
};

#endif
