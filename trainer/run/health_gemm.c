/* health_gemm: meshrun's GEMM probe on this node's devices (see health_gemm.h). */
#include "trainer/run/health_gemm.h"

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/env.h"
#include "common/err.h"
#include "common/gemm_rate.h"
#include "trainer/backend/backend.h"
#include "trainer/run/device.h"

#define MAX_DEVICES 64

/* The backend the workers' device "auto" opens, without opening it: the first built device
 * backend that sees a device (*count of them), else the first built host backend (*count 1). */
static const backend_entry_t *probe_entry(int *count) {
  for (int i = 0; backend_registry[i]; i++) {
    const backend_entry_t *e = backend_registry[i];
    int n = e->mem == BACKEND_MEM_DEVICE && e->create && e->visible_devices ? e->visible_devices() : 0;
    if (n > 0) {
      *count = n;
      return e;
    }
  }
  for (int i = 0; backend_registry[i]; i++)
    if (backend_registry[i]->mem == BACKEND_MEM_HOST && backend_registry[i]->create) {
      *count = 1;
      return backend_registry[i];
    }
  return NULL;
}

/* A batch of products on one device, finished when it returns (gemm_rate_best's batch). */
typedef struct {
  backend_t *be;
  void **m; /* c, a, b after each other: m[2] = m[0] m[1] */
  int n, batch;
  dtype_t dt;
} products_t;

static void products(void *arg) {
  const products_t *p = arg;
  for (int i = 0; i < p->batch; i++)
    p->be->matmul(p->be, p->m[2], p->m[0], p->m[1], p->n, p->n, p->n, 0, 0, 1.0f, 0.0f, p->dt, p->dt);
  p->be->synchronize(p->be);
}

/* One device's rate in GFLOP/s: three n x n matrices of dt, a product untimed, then the best
 * of the slices. -1 with err when the device's memory cannot be had. */
static double measure(backend_t *be, dtype_t dt, int n, int batch, double fault, char *err, size_t errlen) {
  const size_t nn = (size_t)n * n;
  float *host = malloc(nn * sizeof *host);
  void *f32 = be->alloc(be, nn * sizeof(float));
  void *m[3];
  for (int i = 0; i < 3; i++) m[i] = be->alloc(be, nn * dtype_size(dt));
  double best = -1;
  if (!host || !f32 || !m[0] || !m[1] || !m[2]) {
    err_set(err, errlen, -1, "%s: cannot allocate three %dx%d %s matrices", be->name, n, n, dtype_name(dt));
    goto out;
  }
  /* Small values that vary: an all-zero product may run faster than real data does. */
  for (size_t i = 0; i < nn; i++) host[i] = (float)((i * 7919) % 17) * 0.01f;
  be->to_device(be, f32, host, nn * sizeof(float));
  be->convert(be, m[0], dt, f32, DT_F32, nn);
  be->convert(be, m[1], dt, f32, DT_F32, nn);
  be->matmul(be, m[2], m[0], m[1], n, n, n, 0, 0, 1.0f, 0.0f, dt, dt);
  be->synchronize(be);
  products_t p = {.be = be, .m = m, .n = n, .batch = batch, .dt = dt};
  best = gemm_rate_best(products, &p, 2.0 * n * n * n * batch, HEALTH_GEMM_SLICES, HEALTH_GEMM_SLICE_S, fault, NULL);
out:
  for (int i = 0; i < 3; i++) be->free(be, m[i]);
  be->free(be, f32);
  free(host);
  return best;
}

/* Device d's measurement, in a process of its own: "rate dtype" on fd, or "!why"; then exits. */
static void __attribute__((noreturn)) device_child(const backend_entry_t *e, int d, double fault, int fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* the probe's children go with it */
  const int host = e->mem == BACKEND_MEM_HOST;
  char err[512] = "", line[600];
  double rate = -1;
  dtype_t dt = DT_F32;
  backend_t *be = e->create(host ? -1 : d, 0, err, sizeof err);
  if (be) {
    dt = device_default_dtype(be);
    rate = measure(be, dt, host ? HEALTH_GEMM_HOST_N : HEALTH_GEMM_DEVICE_N,
                   host ? HEALTH_GEMM_HOST_BATCH : HEALTH_GEMM_DEVICE_BATCH, fault, err, sizeof err);
    backend_destroy(be);
  }
  int n = rate >= 0 ? snprintf(line, sizeof line, "%.3f %d\n", rate, (int)dt)
                     : snprintf(line, sizeof line, "!%s\n", err);
  _exit(n > 0 && write(fd, line, (size_t)n) == n ? 0 : 1);
}

/* What child d wrote, or why it wrote nothing, into rates[d] and *dt (0) or err (-1). */
static int device_answer(const backend_entry_t *e, int d, int fd, pid_t pid, double *rates, dtype_t *dt, char *err,
                         size_t errlen) {
  char line[600];
  size_t n = 0;
  for (;;) {
    ssize_t k = read(fd, line + n, sizeof line - 1 - n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0 || (n += (size_t)k) == sizeof line - 1) break;
  }
  line[n] = 0;
  line[strcspn(line, "\n")] = 0;
  close(fd);
  int st = 0, t = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (line[0] == '!') return err_set(err, errlen, -1, "%s device %d: %s", e->name, d, line + 1);
  if (sscanf(line, "%lf %d", &rates[d], &t) == 2) {
    *dt = (dtype_t)t;
    return 0;
  }
  return err_set(err, errlen, -1, "%s device %d: its process ended (%s %d) without a rate (its message above)", e->name,
                 d, WIFSIGNALED(st) ? "signal" : "exit status", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
}

/* Every device's rate into rates (ndev of them) and the dtype measured: one child process per
 * device, all at once, as the workers will load them (a device's context is its process's, and
 * this process opens none, so that it may fork). 0, or -1 with err (the first device's failure). */
static int measure_devices(const backend_entry_t *e, int ndev, double fault, double *rates, dtype_t *dt, char *err,
                           size_t errlen) {
  int fds[MAX_DEVICES], started = 0, rc = 0;
  pid_t pids[MAX_DEVICES];
  fflush(NULL);
  for (; started < ndev; started++) {
    int p[2];
    if (pipe(p)) {
      rc = err_set(err, errlen, -1, "pipe: %s", strerror(errno));
      break;
    }
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      device_child(e, started, fault, p[1]);
    }
    close(p[1]);
    if (pid < 0) {
      close(p[0]);
      rc = err_set(err, errlen, -1, "fork: %s", strerror(errno));
      break;
    }
    fds[started] = p[0];
    pids[started] = pid;
  }
  for (int d = 0; d < started; d++) {
    char derr[600];
    if (device_answer(e, d, fds[d], pids[d], rates, dt, derr, sizeof derr) && !rc)
      rc = err_set(err, errlen, -1, "%s", derr);
  }
  return rc;
}

/* Every device's rate into rates (*ndev of them), the entry and dtype measured. 0, or -1 with err. */
static int measure_all(double *rates, int *ndev, const backend_entry_t **entry, dtype_t *dt, char *err,
                       size_t errlen) {
  int visible = 0, local = 1;
  const backend_entry_t *e = *entry = probe_entry(&visible);
  if (!e) return err_set(err, errlen, -1, "no compute backend of this trainer opens here");
  if (env_int("LOCAL_WORLD_SIZE", 1, INT_MAX, 1, &local))
    return err_set(err, errlen, -1, "LOCAL_WORLD_SIZE=%s: not a count of workers >= 1", env_text("LOCAL_WORLD_SIZE"));
  *ndev = e->mem == BACKEND_MEM_HOST ? 1 : local < visible ? local : visible;
  if (*ndev > MAX_DEVICES) *ndev = MAX_DEVICES;
  return measure_devices(e, *ndev, env_fraction(GEMM_RATE_FAULT_ENV), rates, dt, err, errlen);
}

int health_gemm_main(void) {
  /* meshrun waits for this line on a thread of its own; a meshrun killed meanwhile (kill -9)
   * must not leave the probe behind on its devices. (One gone before this call leaves a probe
   * that ends by itself within its second.) */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  double rates[MAX_DEVICES] = {0};
  int ndev = 0;
  const backend_entry_t *e = NULL;
  dtype_t dt = DT_F32;
  char err[768];
  if (measure_all(rates, &ndev, &e, &dt, err, sizeof err)) {
    fprintf(stderr, "trainer --health-gemm: %s\n", err);
    return 1;
  }
  double slowest = rates[0];
  for (int d = 1; d < ndev; d++)
    if (rates[d] < slowest) slowest = rates[d];
  printf("{\"gflops\": %.1f, \"devices\": [", slowest);
  for (int d = 0; d < ndev; d++) printf("%s%.1f", d ? ", " : "", rates[d]);
  printf("], \"device\": \"%s\", \"dtype\": \"%s\", \"n\": %d}\n", e->name, dtype_name(dt),
         e->mem == BACKEND_MEM_HOST ? HEALTH_GEMM_HOST_N : HEALTH_GEMM_DEVICE_N);
  return fflush(stdout) == 0 ? 0 : 1;
}
