/* mesh: the device mesh, as PyTorch's DeviceMesh: ranks laid out on (pp, dp_replicate, dp_shard,
 * cp, tp) with pp outermost and tp innermost (torchtitan's order), and one communication group
 * per dimension.
 *
 *   rank = ((((q * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t    coordinates (r, s, t, q, c)
 *
 * q is the pipeline rank (coord[MESH_PP]); everything below it is one pipeline stage's mesh, so
 * a stage's dp and tp groups never cross stages.
 *
 * Groups, each identified by name:
 *   "dp_replicate"  ranks that differ only in r        (HSDP's replicas; DDP)
 *   "dp_shard"      ranks that differ only in s        (FSDP's shards)
 *   "tp"            ranks that differ only in t        (tensor parallel; consecutive ranks)
 *   "dp"            ranks that differ in r or s: dp_replicate x dp_shard flattened, group rank
 *                   r * dp_shard + s (the data-parallel index: which batch slice a rank reads)
 *   "world"         every rank
 *   "pp"            ranks that differ only in q (the pipeline: same (r, s, t), one per stage)
 *   "cp"            ranks that differ only in c (context parallel: one sequence's chunks)
 *   "dp_shard_cp"   ranks that differ in s or c: dp_shard x cp flattened, group rank s * cp + c
 *                   (FSDP shards parameters over it, so its memory still falls with cp)
 *   "dp_cp"         ranks that differ in r, s or c: the ranks that hold the same parameters
 *                   apart from tp and pp (gradients are reduced over it)
 * With cp = 1, "dp_shard_cp" and "dp_cp" have the members of "dp_shard" and "dp" and share their
 * communicators (no rings of their own).
 * Members are listed in group-rank order. Dimensions of size 1 still get a (trivial) group, so
 * callers never test for NULL.
 *
 * mesh_create computes the layout only (pure arithmetic, no I/O); mesh_connect then creates the
 * comm_t of every group through the store, with the comm backend the caller chose ("cpu" on host
 * memory; "nccl" or "staged" on the device backend's memory).
 *
 * Two communicators per group. `comm` moves tensors of the device backend (the model's and the
 * strategy's collectives). `host_comm` moves host values (a loss, norm shares, the memory report,
 * eval sums, checkpoint metadata): it is always a "cpu" communicator, and it is `comm` itself
 * when the backend moves host memory (comm_backend_memory; one ring, the traffic counted once),
 * else a ring of its own whose
 * uid is "host.<uid>" ("host.tp.4"). A host pointer never reaches a device communicator.
 * Each group's store keys are unique in the job: the group's uid is "<name>.<lowest member
 * rank>" ("tp.4") and keys carry the generation (meshrun's rendezvous round), so a restarted
 * job never reads an earlier attempt's endpoints. It does not choose the
 * dimensions: the plan resolves them (trainer/plan/plan.h) and passes them in. */
#ifndef MESHRUN_MESH_H
#define MESHRUN_MESH_H

#include <stddef.h>

#include "common/store.h"
#include "trainer/comm/comm.h"

#define MESH_EINVAL (-1)

enum { MESH_DP_REPLICATE = 0, MESH_DP_SHARD, MESH_TP, MESH_PP, MESH_CP, MESH_NDIMS };
enum { MESH_GROUP_DP_REPLICATE = 0, MESH_GROUP_DP_SHARD, MESH_GROUP_TP, MESH_GROUP_DP,
       MESH_GROUP_WORLD, MESH_GROUP_PP, MESH_GROUP_CP, MESH_GROUP_DP_SHARD_CP, MESH_GROUP_DP_CP,
       MESH_NGROUPS };

/* The pipeline's point-to-point channels of this rank (pp > 1; NULL otherwise): two-rank
 * communicators, one per direction and kind, whose rank 0 only sends and rank 1 only receives,
 * so a send never waits behind a receive on the same communicator (comm.h: one operation at a
 * time per communicator). Activations flow from pp rank q to q + 1, gradients from q + 1 to q,
 * both wrapping around (interleaved schedules send from the last rank to the first). Device
 * memory, like the group comms. */
typedef struct {
  comm_t *send_act, *recv_act;   /* to q + 1, from q - 1 */
  comm_t *send_grad, *recv_grad; /* to q - 1, from q + 1 */
} mesh_pp_channels_t;

/* The context-parallel ring of this rank (cp > 1; NULL otherwise): K/V blocks, and their
 * gradients in the backward, travel from cp rank c to c + 1 (mod cp). Two two-rank
 * communicators, as the pipeline's: send to c + 1, receive from c - 1. Device memory. */
typedef struct {
  comm_t *send, *recv;
} mesh_cp_channels_t;

typedef struct {
  char name[16];           /* "dp_replicate", "dp_shard", "tp", "dp", "world", ... */
  char uid[COMM_NAME_MAX]; /* "tp.4": name and lowest member rank, unique in the job */
  int size;                /* members */
  int rank;                /* this process's rank in the group */
  int *ranks;              /* (size) members' global ranks in group-rank order */
  comm_t *comm;            /* device-memory communicator; NULL until mesh_connect */
  comm_t *host_comm;       /* host-memory ("cpu") one: comm itself when comm is "cpu" */
  int alias;               /* >= 0: the group whose communicators these are (cp = 1), else -1 */
} mesh_group_t;

typedef struct {
  int world, rank;         /* job size and this process's rank */
  int dims[MESH_NDIMS];    /* dp_replicate, dp_shard, tp, pp, cp */
  int coord[MESH_NDIMS];   /* this rank's (r, s, t, q, c) */
  mesh_group_t groups[MESH_NGROUPS];
  mesh_pp_channels_t pp;   /* filled by mesh_connect when pp > 1 */
  mesh_cp_channels_t cp;   /* filled by mesh_connect when cp > 1 */
} mesh_t;

/* Lays out world = pp * dp_replicate * dp_shard * cp * tp ranks (each >= 1; dims indexed by
 * MESH_DP_REPLICATE ...) and this rank's groups. Returns 0, or MESH_EINVAL with "mesh error: ..."
 * in err. mesh_create_pp is it with cp = 1, mesh_create with pp = cp = 1. */
int mesh_create_dims(mesh_t **out, const int dims[MESH_NDIMS], int rank, int world, char *err, size_t errlen);
int mesh_create_pp(mesh_t **out, int pp, int dp_replicate, int dp_shard, int tp, int rank, int world,
                   char *err, size_t errlen);
int mesh_create(mesh_t **out, int dp_replicate, int dp_shard, int tp, int rank, int world,
                char *err, size_t errlen);
/* Creates every group's communicators (collective over the job: every rank calls it with the
 * same backend). backend: "cpu" (NULL), "nccl" or "staged"; device: the backend whose memory
 * "nccl" and "staged" move (comm_config_t.device; required by "staged", unused by "cpu");
 * generation < 0: MESHRUN_ROUND, else TORCHELASTIC_RESTART_COUNT (else 0); host and timeout_ms as in comm_config_t.
 * On failure returns the comm code with the reason in err, and no comm is left. */
int mesh_connect(mesh_t *m, const char *backend, struct backend *device, store_t *store,
                 int generation, const char *host, int timeout_ms, char *err, size_t errlen);
void mesh_destroy(mesh_t *m); /* accepts NULL and half-built meshes; destroys the comms */

/* This rank's group by name; NULL for an unknown name. */
const mesh_group_t *mesh_group(const mesh_t *m, const char *name);
/* The group's communicator (NULL for an unknown name or before mesh_connect): device memory. */
comm_t *mesh_comm(const mesh_t *m, const char *name);
/* The group's host-memory ("cpu") communicator, for values that live on the host. */
comm_t *mesh_host_comm(const mesh_t *m, const char *name);
/* Group g's traffic and blocked time: its device communicator's stats plus its host one's (when
 * that is another ring), and for "cp" its ring channels'; zeros before mesh_connect and for an
 * alias (cp = 1: the traffic is the aliased group's). */
void mesh_group_stats(const mesh_t *m, int g, comm_stats_t *out);
/* Nanoseconds this process has spent blocked on the mesh's communicators (device and host ones):
 * the sum of their comm_stats_t.wait_ns, the pipeline channels' included. 0 for NULL. */
uint64_t mesh_wait_ns(const mesh_t *m);

/* Coordinates (r, s, t, q, c) of any rank, and back: mesh_rank_at within this rank's pipeline
 * stage (q = coord[MESH_PP]), mesh_rank_at_pp on any; both at this rank's cp coordinate. */
void mesh_coords(const mesh_t *m, int rank, int coord[MESH_NDIMS]);
int mesh_rank_at(const mesh_t *m, int r, int s, int t);
int mesh_rank_at_pp(const mesh_t *m, int q, int r, int s, int t);
/* Members of the group `name` that contains `rank` (any rank of the job), in group-rank order,
 * into ranks (room for world entries). Returns the group size, or MESH_EINVAL for an unknown
 * name or a rank out of range. */
int mesh_members(const mesh_t *m, const char *name, int rank, int *ranks);

#endif
