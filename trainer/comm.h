/* comm: collectives on a group of ranks, the interface the model and the strategies call.
 *
 * A comm_t is one group (a dimension of the mesh): its members are ranks 0..size-1 of the
 * group, in the mesh's order. Every member must call the same collectives in the same order
 * with the same counts, as with NCCL or MPI. Data is in place where the operation allows it;
 * element counts are size_t. All calls are blocking and return when this rank's part is done.
 *
 * Backends plug in through comm_ops_t: "cpu" (comm_cpu.c: TCP rings between the ranks,
 * endpoints exchanged through the store; host memory), "nccl" (comm_nccl.c: one NCCL
 * communicator per group, device memory; builds with CUDA only) and "staged" (comm_staged.c:
 * device memory copied through host buffers and reduced by an inner "cpu" communicator, so that
 * several ranks can share one GPU). The dispatch (comm.c) checks
 * arguments, handles groups of one rank and empty buffers, and keeps the error message, so
 * backends only move bytes.
 *
 * Errors are negative COMM_E* codes. comm_errmsg() returns the message of the last failure,
 * naming the group, the operation and the peer, e.g.
 *   "comm tp.0 (rank 1/2): all_reduce timed out after 30 s waiting for rank 0 (global rank 0,
 *    127.0.0.1:41234)" (the mesh names groups "<dim>.<lowest member rank>").
 * After a system, remote or timeout error the communicator is broken (its peers may be midway
 * through a transfer): every later call fails at once with the first message, and the caller
 * should destroy it and exit so the launcher can restart the job. A collective that makes no
 * progress for the timeout fails instead of hanging; a peer that dies makes its neighbours
 * fail at once (connection closed), and they close theirs, so the failure runs around the
 * group instead of waiting for the timeout.
 *
 * A comm_t is not thread-safe: one thread calls it at a time. Pointers are memory of the
 * backend's kind: host for "cpu", device for "nccl" and "staged" (of comm_config_t.device). */
#ifndef MESHRUN_COMM_H
#define MESHRUN_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/store.h"

struct backend; /* trainer/backend.h: the device whose memory "nccl" and "staged" move */

enum {
  COMM_OK = 0,
  COMM_EINVAL = -1,    /* bad argument (NULL buffer, unknown op or dtype, root out of range) */
  COMM_ESYSTEM = -2,   /* a local system call failed (socket, memory) */
  COMM_EREMOTE = -3,   /* a peer closed or reset its connection, or sent something wrong */
  COMM_ETIMEDOUT = -4, /* no progress from a peer within the timeout */
};

typedef enum { COMM_FLOAT32 = 0, COMM_BFLOAT16 } comm_dtype_t; /* cpu, staged: float32 only */
typedef enum { COMM_SUM = 0, COMM_AVG, COMM_MAX } comm_op_t;

#define COMM_NAME_MAX 64
#define COMM_ERR_MAX 512
#define COMM_DEFAULT_TIMEOUT_MS 300000 /* MESHRUN_COMM_TIMEOUT (seconds) overrides */

/* Traffic of one communicator since creation (or comm_reset_stats), this rank only. */
typedef struct {
  uint64_t bytes_sent;
  uint64_t bytes_recv;
  uint64_t calls; /* collectives that reached the backend (size 1 and count 0 do not) */
} comm_stats_t;

/* What comm_create needs. Only store is borrowed, and only during comm_create. */
typedef struct {
  const char *name;  /* group name, unique within the job, e.g. "tp.4"; [A-Za-z0-9_.-], < 64 */
  int rank, size;    /* this process's rank in the group, and the group size */
  int generation;    /* restart count (TORCHELASTIC_RESTART_COUNT): keys of earlier attempts
                        are never read */
  store_t *store;    /* where endpoints are published and read; may be NULL when size == 1 */
  const char *host;  /* address to listen on and publish; NULL: MESHRUN_COMM_HOST, else listen
                        on all addresses and publish this machine's hostname */
  int timeout_ms;    /* stall timeout of each collective and of setup; <= 0: default */
  const int *global_ranks; /* optional (size entries): members' job ranks, for messages */
  struct backend *device; /* "staged": required, its to_host/to_device/copy move the buffers.
                             "nccl": optional, its synchronize() orders a collective after the
                             compute queued so far (unless comm_nccl_set_stream gave the compute
                             stream). "cpu": unused. Borrowed for the communicator's life. */
} comm_config_t;

typedef struct comm comm_t;

/* The backend table. Calls arrive with valid arguments, size > 1 and count > 0; a backend
 * reports failures with comm_set_error() and returns its code. */
typedef struct {
  const char *name;
  int (*all_reduce)(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, comm_op_t op);
  int (*all_gather)(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype);
  int (*reduce_scatter)(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype,
                        comm_op_t op);
  int (*broadcast)(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, int root);
  int (*barrier)(comm_t *c);
  void (*destroy)(comm_t *c); /* releases impl; must accept a half-built impl */
  /* Optional, for backends whose buffers are not host memory: the copies the dispatch makes
   * itself (all_gather's own slot, reduce_scatter on one rank), done before returning. NULL:
   * memcpy. */
  int (*copy)(comm_t *c, void *dst, const void *src, size_t bytes);
  int bf16; /* 1: reduces and moves COMM_BFLOAT16 too (else float32 only) */
} comm_ops_t;

struct comm {
  const comm_ops_t *ops;
  void *impl;
  char name[COMM_NAME_MAX];
  int rank, size;
  int timeout_ms;
  int broken;             /* first system/remote/timeout error code, or 0 */
  char err[COMM_ERR_MAX]; /* message of the last failure */
  comm_stats_t stats;
};

/* Creates the communicator of one group with backend "cpu" (NULL), "nccl" or "staged".
 * Collective over the group: every member calls it with the same name, size and generation.
 * Returns 0 and *out, or a code with the reason in err. A backend that this program was not
 * built or linked with is COMM_EINVAL with a message saying so. */
int comm_create(comm_t **out, const char *backend, const comm_config_t *cfg, char *err,
                size_t errlen);
void comm_destroy(comm_t *c); /* accepts NULL */

/* In place on count elements of every rank. AVG divides the sum by size (after summing, so every
 * rank gets identical bits). */
int comm_all_reduce(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, comm_op_t op);
/* Each rank contributes count elements; out (size * count) gets rank i's at out + i * count.
 * In place when in == out + rank * count. */
int comm_all_gather(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype);
/* in holds size * count elements; out (count) gets slice rank of the reduction (SUM or AVG;
 * MAX also works). out may not overlap in. */
int comm_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, comm_dtype_t dtype,
                        comm_op_t op);
/* Copies root's count elements into everyone's buf. */
int comm_broadcast(comm_t *c, void *buf, size_t count, comm_dtype_t dtype, int root);
/* Returns once every member has entered the barrier. */
int comm_barrier(comm_t *c);

int comm_rank(const comm_t *c);
int comm_size(const comm_t *c);
const char *comm_name(const comm_t *c);
/* Stall timeout of later collectives (> 0 ms). */
int comm_set_timeout(comm_t *c, int timeout_ms);
const char *comm_errmsg(const comm_t *c); /* "" when nothing failed */
const char *comm_strerror(int code);
void comm_get_stats(const comm_t *c, comm_stats_t *out);
void comm_reset_stats(comm_t *c);
size_t comm_dtype_size(comm_dtype_t dtype); /* 0 for an unknown dtype */
const char *comm_op_name(comm_op_t op);     /* "sum", "avg", "max" */

/* --- for backends */
/* Writes "comm <name> (rank r/n): <what>" into c->err and returns code; a system, remote or
 * timeout code also marks the communicator broken. */
int comm_set_error(comm_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int comm_cpu_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen);
/* comm.c refers to these two weakly, so programs that link only comm_cpu.c (tests, tools) still
 * link; bin/trainer links every trainer .c file. Without CUDA, comm_nccl_create says so. */
int comm_nccl_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen);
int comm_staged_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen);

/* --- nccl backend hooks (comm_nccl.c, CUDA builds) */
/* Gives an nccl communicator the compute stream (a cudaStream_t) that produces and consumes its
 * buffers: collectives then wait for it with an event instead of synchronizing the device
 * backend, and the compute stream waits for them likewise. NULL goes back to the conservative
 * order. COMM_EINVAL for a communicator of another backend. */
int comm_nccl_set_stream(comm_t *c, void *compute_stream);
/* Aborts every live nccl communicator of this process (ncclCommAbort), so that peers blocked in
 * a collective with it fail instead of hanging. For fatal-error paths (a CUDA check macro)
 * right before exit; the communicators are unusable afterwards. Weak-link it the same way. */
void comm_nccl_abort_all(void);
/* GPUs visible to this process (cudaGetDeviceCount), 0 when none or in a build without CUDA.
 * The trainer picks "nccl" when LOCAL_WORLD_SIZE of them are visible, else "staged". */
int comm_nccl_visible_gpus(void);

#endif
