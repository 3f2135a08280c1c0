/* device: the backend of the plan's device, its precision options, and the comm backend of a
 * multi-rank run (see device.h). Where memory lives is asked of the backend (be->mem), never
 * its name. */
#include "trainer/run/device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_nccl.h"

const char *device_backends(void) {
#ifdef MESHRUN_HAVE_CUDA
  return "cpu, cuda";
#else
  return "cpu";
#endif
}

#ifdef MESHRUN_HAVE_CUDA
/* The cuda backend on GPU LOCAL_RANK mod the visible ones: one GPU per rank when there are
 * enough, else ranks share them (the staged comm's case). With none visible, the backend's own
 * message ("cuda: no GPU visible ..."). */
static backend_t *cuda_open(int local_rank, char *err, size_t errlen) {
  int gpus = comm_nccl_visible_gpus();
  return backend_cuda_create(gpus > 0 ? local_rank % gpus : -1, err, errlen);
}
#endif

/* Creates the backend of the plan's device. "auto": cuda when this trainer has the cuda backend
 * and creating it succeeds (a GPU is visible), else cpu, with the choice and its reason logged
 * on rank 0. Returns 0 with *out, or 2 (device cuda in a build without it, or with no GPU
 * visible: permanent) or 1 (the backend failed on a GPU that is there) with the message in err. */
static int backend_open(const plan_t *p, int local_rank, backend_t **out, char *err, size_t errlen) {
  *out = NULL;
  if (p->device == PLAN_DEVICE_CUDA) {
#ifdef MESHRUN_HAVE_CUDA
    *out = cuda_open(local_rank, err, errlen);
    if (*out) return 0;
    if (comm_nccl_visible_gpus() > 0) return 1; /* a GPU is there: its failure may pass */
    size_t n = strlen(err);
    snprintf(err + n, errlen - n, "; device \"cuda\" needs one: run where a GPU is visible, or set device auto or cpu");
    return 2; /* no restart can make one appear */
#else
    (void)local_rank;
    snprintf(err, errlen, "device \"cuda\": this trainer was built without the cuda backend; use device \"cpu\" or "
             "\"auto\", or rebuild where nvcc is found");
    return 2;
#endif
  }
  if (p->device == PLAN_DEVICE_AUTO) {
#ifdef MESHRUN_HAVE_CUDA
    char why[512] = "";
    if ((*out = cuda_open(local_rank, why, sizeof why))) {
      log_rank0("device auto: cuda (the cuda backend is built and a GPU is visible)");
      return 0;
    }
    log_rank0("device auto: cpu (%s)", why);
#else
    log_rank0("device auto: cpu (this trainer was built without the cuda backend)");
#endif
  }
  *out = backend_create("cpu", 0, err, errlen);
  return *out ? 0 : 1;
}

/* MESHRUN_COMM_BACKEND: NULL when unset or empty, else one of "cpu", "nccl", "staged". Returns
 * 0, or 2 with the message in err. */
static int comm_backend_env(const char **out, char *err, size_t errlen) {
  static const char *const names[] = {"cpu", "nccl", "staged"};
  const char *env = getenv("MESHRUN_COMM_BACKEND");
  *out = NULL;
  if (!env || !*env) return 0;
  for (int i = 0; i < 3; i++)
    if (!strcmp(env, names[i])) *out = names[i];
  if (*out) return 0;
  snprintf(err, errlen, "MESHRUN_COMM_BACKEND=%s: unknown comm backend (known: cpu, nccl, staged; unset it to "
           "choose by device)", env);
  return 2;
}

/* The comm backend of the mesh's device collectives on backend be: env (MESHRUN_COMM_BACKEND,
 * checked by comm_backend_env) when set; else "cpu" on host memory, and on device memory "nccl"
 * when local_world GPUs are visible (NCCL wants one GPU per rank), else "staged" (ranks share a
 * GPU; buffers are reduced through host memory). "staged" is valid on cpu too: staging is then a
 * copy, and the reductions are the cpu comm's, bit for bit. Whether env suits the device is
 * checked only when world > 1 (a single process creates no comm). Returns 0 with *out and the
 * reason in why, or 2 with the message in err. */
static int comm_backend_choose(const backend_t *be, const char *env, int local_world, int world, const char **out,
                               char *why, size_t whylen, char *err, size_t errlen) {
  const int on_host = be->mem == BACKEND_MEM_HOST;
  *out = env;
  if (env) {
    if (world > 1 && on_host && !strcmp(env, "nccl")) {
      snprintf(err, errlen, "MESHRUN_COMM_BACKEND=nccl needs device cuda, and this run's device is cpu: use cpu or "
               "staged");
      return 2;
    }
    if (world > 1 && !on_host && !strcmp(env, "cpu")) {
      snprintf(err, errlen, "MESHRUN_COMM_BACKEND=cpu moves host memory, and device %s keeps tensors in device "
               "memory: use nccl or staged", be->name);
      return 2;
    }
    snprintf(why, whylen, "MESHRUN_COMM_BACKEND");
    return 0;
  }
  if (on_host) {
    *out = "cpu";
    snprintf(why, whylen, "device cpu");
    return 0;
  }
  int gpus = comm_nccl_visible_gpus(), local = local_world < 1 ? 1 : local_world;
  *out = local <= gpus ? "nccl" : "staged";
  snprintf(why, whylen, "LOCAL_WORLD_SIZE %d, %d GPU%s visible%s", local, gpus, gpus == 1 ? "" : "s",
           local <= gpus ? ": one GPU per rank" : ": ranks share GPUs");
  return 0;
}

/* Precision options on this device: param_dtype defaults to what PyTorch users get there (bf16
 * on cuda, fp32 on cpu, decided by the backend that opened, so "auto" falling back to cpu
 * trains in fp32); an explicit value is kept on either. TF32 as the plan says on cuda. */
static void precision_apply(plan_t *p, backend_t *be) {
  const int on_device = be->mem == BACKEND_MEM_DEVICE;
  if (!p->parallel.param_dtype_explicit) p->parallel.param_dtype = on_device ? PLAN_DTYPE_BF16 : PLAN_DTYPE_FP32;
  log_rank0("mixed precision: param_dtype %s, reduce_dtype %s%s",
            p->parallel.param_dtype == PLAN_DTYPE_BF16 ? "bf16" : "fp32",
            p->parallel.reduce_dtype == PLAN_DTYPE_BF16 ? "bf16" : "fp32",
            p->parallel.param_dtype_explicit ? "" : " (param_dtype: the device's default)");
#ifdef MESHRUN_HAVE_CUDA
  if (on_device) backend_cuda_set_tf32(be, p->parallel.allow_tf32);
#endif
}

/* The first number in a file, or 0 ("max", absent, unreadable). */
static double file_number(const char *path) {
  FILE *f = fopen(path, "r");
  double v = 0;
  if (f) {
    if (fscanf(f, "%lf", &v) != 1) v = 0;
    fclose(f);
  }
  return v;
}

double device_host_memory(void) {
  double total = 0, swap = 0;
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  while (f && fgets(line, sizeof line, f)) {
    double kb;
    if (sscanf(line, "MemTotal: %lf kB", &kb) == 1) total = kb * 1024;
    if (sscanf(line, "SwapTotal: %lf kB", &kb) == 1) swap = kb * 1024;
  }
  if (f) fclose(f);
  double limit = total + swap;
  /* cgroup v2: "0::/path" in /proc/self/cgroup; memory.max (+ memory.swap.max) there */
  char cg[512] = "", path[700];
  f = fopen("/proc/self/cgroup", "r");
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "0::", 3)) snprintf(cg, sizeof cg, "%s", line + 3);
  if (f) fclose(f);
  cg[strcspn(cg, "\n")] = 0;
  snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", cg);
  const double mem_max = file_number(path);
  snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.swap.max", cg);
  const double swap_max = file_number(path);
  if (mem_max > 0 && mem_max + swap_max < limit) limit = mem_max + swap_max;
  return limit;
}

int device_open(plan_t *p, int local_rank, int local_world, int world, backend_t **be, const char **comm_backend,
                char *err, size_t errlen) {
  char why[256] = "";
  const char *comm_env = NULL;
  *comm_backend = NULL;
  int rc = comm_backend_env(&comm_env, err, errlen);
  if (rc == 0) rc = backend_open(p, local_rank, be, err, errlen);
  if (rc == 0) precision_apply(p, *be);
  if (rc == 0)
    rc = comm_backend_choose(*be, comm_env, local_world, world, comm_backend, why, sizeof why, err, errlen);
  if (rc == 0 && world > 1) log_rank0("comm backend %s (%s)", *comm_backend, why);
  if (rc) {
    backend_destroy(*be);
    *be = NULL;
  }
  return rc;
}
