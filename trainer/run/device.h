/* device: where a run computes and how its ranks talk. Opens the backend of the plan's device
 * (a registered compute backend, or auto: the first device backend this trainer has and can
 * open, else the host's), applies the precision options the device supports (param_dtype as it
 * runs today, TF32 where the backend has it), and picks the comm backend of a multi-rank run's
 * device collectives (MESHRUN_COMM_BACKEND, else by device and device count).
 *
 * It decides from the registries' entries (trainer/backend/backend.h, trainer/comm/comm.h) and
 * names no backend but the host's fallback, cpu. It does not build the mesh (main.c) nor own the
 * backend after opening it (the caller destroys it with backend_destroy). */
#ifndef MESHRUN_DEVICE_H
#define MESHRUN_DEVICE_H

#include <stddef.h>

#include "trainer/backend/backend.h"
#include "trainer/plan/plan.h"

/* Opens the device of plan p for the rank with local rank local_rank of local_world ranks on
 * this node (LOCAL_WORLD_SIZE) in a job of world ranks. On success *be is the backend and
 * *comm_backend (a registered comm backend's name) the comm backend of the mesh's device
 * collectives, logged on rank 0 when world > 1; p->parallel.param_dtype becomes what runs.
 * Checks MESHRUN_COMM_BACKEND first, before any device is opened, so that a typo is the only
 * line printed. Returns 0, 2 (usage: a device this build lacks, or a device backend with no
 * device visible; an unknown or unsuitable MESHRUN_COMM_BACKEND) or 1 (the backend failed), with
 * the message in err and nothing left open. */
int device_open(plan_t *p, int local_rank, int local_world, int world, backend_t **be, const char **comm_backend,
                char *err, size_t errlen);

/* param_dtype's default on backend be: what PyTorch users get there, bf16 on a device, fp32 on
 * the host (decided by the backend that opened). Also the dtype of meshrun's GEMM probe
 * (trainer/run/health_gemm.h). */
dtype_t device_default_dtype(const backend_t *be);

/* The backends this trainer was built with, for --version: "cpu" or "cpu, cuda". */
const char *device_backends(void);
/* The plan's device values (plan_set_devices): "auto" and every registered compute backend,
 * built or not (a build without one says so when it is asked for). */
const char *const *device_names(void);
/* For --help: the device values ("cpu|cuda|auto"), the comm backends ("cpu, nccl or staged"), and
 * the default comm backend by device ("cpu on cpu, on cuda nccl with a GPU per local rank, else
 * staged"), each from the registries. */
const char *device_usage_devices(void);
const char *device_usage_comms(void);
const char *device_usage_comm_default(void);
/* This machine's memory as far as this process may use it, in bytes: RAM + swap, or the cgroup
 * v2 limit (memory.max + memory.swap.max) when lower; 0 when unknown. */
double device_host_memory(void);

#endif
