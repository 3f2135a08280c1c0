/* gemm_rate: the health check's GEMM timing (see gemm_rate.h). */
#include "common/gemm_rate.h"

#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void pause_s(double s) {
  struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

double gemm_rate_best(void (*batch)(void *arg), void *arg, double flops, int slices, double slice_s, double fault,
                      const atomic_int *stop) {
  double best = 0;
  for (int s = 0; s < slices && !(stop && atomic_load(stop)); s++) {
    double t0 = now_s(), t = t0;
    long count = 0;
    while (t - t0 < slice_s) {
      const double b0 = t;
      batch(arg);
      count++;
      t = now_s();
      if (fault < 1) { /* the throttled node: the batch took 1/fault of its time */
        pause_s((t - b0) * (1 / fault - 1));
        t = now_s();
      }
    }
    const double rate = flops * (double)count / (t - t0) / 1e9;
    if (rate > best) best = rate;
  }
  return best;
}
