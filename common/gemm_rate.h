/* gemm_rate: how the health check's GEMM is timed, the same for meshrun's own loop on the host
 * CPU (launcher/health.c) and for the trainer's probe on the devices (`trainer --health-gemm`,
 * trainer/run/health_gemm.c), so that the two rates mean one thing.
 *
 * A rate is the best of a few slices, each at least a given time long, so that a moment of
 * contention on a shared host does not count as a slow node. A slice calls the caller's batch
 * (products that have finished when it returns) until its time is up. MESHRUN_FAULT_HEALTH_GEMM=F
 * (0 < F < 1) throttles the measure to about F of its speed, the tests' slow node: after each
 * batch a pause of (1/F - 1) times the batch's time. */
#ifndef MESHRUN_GEMM_RATE_H
#define MESHRUN_GEMM_RATE_H

#include <stdatomic.h>

#define GEMM_RATE_FAULT_ENV "MESHRUN_FAULT_HEALTH_GEMM"

/* GFLOP/s of the best of `slices` slices of at least slice_s seconds, each calling batch(arg),
 * which does `flops` floating-point operations a call, until its time is up; fault: the throttle,
 * env_fraction(GEMM_RATE_FAULT_ENV) (common/env.h). stop (NULL: none) is read before each slice:
 * once set, no more slices, and the best so far (0 when none ran) is returned. */
double gemm_rate_best(void (*batch)(void *arg), void *arg, double flops, int slices, double slice_s, double fault,
                      const atomic_int *stop);

#endif
