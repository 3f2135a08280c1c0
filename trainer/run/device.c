/* device: the backend of the plan's device, its precision options, and the comm backend of a
 * multi-rank run (see device.h). Every choice loops over the two registries (backend_registry,
 * comm_registry) and reads their entries' fields; where memory lives is asked of the backend
 * (be->mem), never its name. */
#include "trainer/run/device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "trainer/comm/comm.h"

const char *device_backends(void) {
  static char names[256];
  if (!names[0]) backend_names(names, sizeof names, ", ", 1);
  return names;
}

const char *const *device_names(void) {
  static const char *names[32];
  if (!names[0]) {
    int n = 0;
    names[n++] = "auto";
    for (int i = 0; backend_registry[i] && n < 31; i++) names[n++] = backend_registry[i]->name;
  }
  return names;
}

/* Whether comm backend c moves the memory of compute backend d: one made for d, or one for any
 * backend whose memory is of its kind (device-memory comms without a device stage through the
 * host, so they take host backends too). */
static int comm_suits(const comm_entry_t *c, const backend_entry_t *d) {
  if (c->device) return !strcmp(c->device, d->name);
  return c->mem == COMM_MEM_DEVICE || d->mem == BACKEND_MEM_HOST;
}

/* The default comm backends of d: native, the first made for its memory (the host comm on a host
 * backend, the device's own on a device), and fallback, the first other suitable one that needs
 * no device per rank (for ranks that share devices). Either may be NULL. */
static void comm_defaults(const backend_entry_t *d, const comm_entry_t **native, const comm_entry_t **fallback) {
  *native = *fallback = NULL;
  for (int i = 0; comm_registry[i]; i++) {
    const comm_entry_t *c = comm_registry[i];
    if (!comm_suits(c, d)) continue;
    const int own = d->mem == BACKEND_MEM_HOST ? c->mem == COMM_MEM_HOST : c->device != NULL;
    if (own && !*native) *native = c;
    else if (!own && !c->device_per_rank && !*fallback) *fallback = c;
  }
}

/* The names of the comm backends that suit d, for "use ..." in messages: "a", "a or b", "a, b or c". */
static void comm_alternatives(const backend_entry_t *d, char *out, size_t len) {
  const comm_entry_t *fit[32];
  int n = 0;
  for (int i = 0; comm_registry[i] && n < 32; i++)
    if (comm_suits(comm_registry[i], d)) fit[n++] = comm_registry[i];
  size_t k = 0;
  out[0] = '\0';
  for (int i = 0; i < n && k < len; i++) {
    int w = snprintf(out + k, len - k, "%s%s", i == 0 ? "" : i == n - 1 ? " or " : ", ", fit[i]->name);
    if (w < 0) break;
    k += (size_t)w;
  }
}

const char *device_usage_devices(void) {
  static char text[256];
  if (!text[0]) {
    backend_names(text, sizeof text, "|", 0);
    size_t n = strlen(text);
    snprintf(text + n, sizeof text - n, "|auto");
  }
  return text;
}

const char *device_usage_comms(void) {
  static char text[256];
  if (!text[0]) comm_names(text, sizeof text, ", ", " or ");
  return text;
}

const char *device_usage_comm_default(void) {
  static char text[512];
  size_t k = 0;
  if (text[0]) return text; /* made once */
  for (int i = 0; backend_registry[i] && k < sizeof text; i++) {
    const backend_entry_t *d = backend_registry[i];
    const comm_entry_t *native, *fallback;
    comm_defaults(d, &native, &fallback);
    const char *sep = k ? ", " : "";
    int w = 0;
    if (d->mem == BACKEND_MEM_HOST && native)
      w = snprintf(text + k, sizeof text - k, "%s%s on %s", sep, native->name, d->name);
    else if (native && native->device_per_rank && fallback)
      w = snprintf(text + k, sizeof text - k, "%son %s %s with a GPU per local rank, else %s", sep, d->name,
                   native->name, fallback->name);
    else if (native || fallback)
      w = snprintf(text + k, sizeof text - k, "%son %s %s", sep, d->name, (native ? native : fallback)->name);
    if (w > 0) k += (size_t)w;
  }
  return text;
}

/* The backend of entry e for this local rank: on device local_rank mod the visible ones (one per
 * rank when there are enough, else ranks share them; the staged comm's case), or, with none
 * visible, the backend's own choice and its own message ("cuda: no GPU visible ..."). */
static backend_t *entry_open(const backend_entry_t *e, int local_rank, char *err, size_t errlen) {
  const int n = e->visible_devices ? e->visible_devices() : 0;
  return e->create(n > 0 ? local_rank % n : -1, 0, err, errlen);
}

/* Creates the backend of the plan's device. "auto": the first device backend of the registry
 * that this trainer has and that opens (a GPU is visible), else the host backend, with the
 * choice and its reason logged on rank 0. Returns 0 with *out and *entry, or 2 (a device this
 * build lacks, or a device backend with no device visible: permanent) or 1 (the backend failed
 * on a device that is there, or the host backend failed) with the message in err. */
static int backend_open(const plan_t *p, int local_rank, backend_t **out, const backend_entry_t **entry, char *err,
                        size_t errlen) {
  *out = NULL;
  if (strcmp(p->device, "auto")) {
    const backend_entry_t *e = *entry = backend_find(p->device);
    if (!e) {
      return err_set(err, errlen, 2, "device \"%s\": unknown to this trainer (known: auto, %s)", p->device,
                     device_backends());
    }
    if (!e->create) {
      return err_set(err, errlen, 2,
                     "device \"%s\": this trainer was built without the %s backend; use device \"cpu\" or "
                     "\"auto\", or %s",
                     e->name, e->name, e->remedy);
    }
    if ((*out = entry_open(e, local_rank, err, errlen))) return 0;
    if (e->mem == BACKEND_MEM_HOST || (e->visible_devices && e->visible_devices() > 0))
      return 1; /* a device is there: its failure may pass */
    size_t n = strlen(err);
    snprintf(err + n, errlen - n, "; device \"%s\" needs one: run where a GPU is visible, or set device auto or cpu",
             e->name);
    return 2; /* no restart can make one appear */
  }
  char why[512] = "";
  for (int i = 0; backend_registry[i]; i++) {
    const backend_entry_t *e = backend_registry[i];
    if (e->mem != BACKEND_MEM_DEVICE) continue;
    if (!e->create) {
      snprintf(why, sizeof why, "this trainer was built without the %s backend", e->name);
      continue;
    }
    if ((*out = entry_open(e, local_rank, why, sizeof why))) {
      *entry = e;
      log_rank0("device auto: %s (the %s backend is built and a GPU is visible)", e->name, e->name);
      return 0;
    }
  }
  for (int i = 0; backend_registry[i]; i++) {
    const backend_entry_t *e = backend_registry[i];
    if (e->mem != BACKEND_MEM_HOST || !e->create) continue;
    log_rank0("device auto: %s (%s)", e->name, why);
    *entry = e;
    *out = e->create(-1, 0, err, errlen);
    return *out ? 0 : 1;
  }
  return err_set(err, errlen, 1, "device auto: this trainer has no host backend");
}

/* MESHRUN_COMM_BACKEND: NULL when unset or empty, else a registered comm backend's name.
 * Returns 0, or 2 with the message in err. */
static int comm_backend_env(const char **out, char *err, size_t errlen) {
  const char *env = getenv("MESHRUN_COMM_BACKEND");
  *out = NULL;
  if (!env || !*env) return 0;
  const comm_entry_t *c = comm_find(env);
  if (c) {
    *out = c->name;
    return 0;
  }
  char known[256];
  comm_names(known, sizeof known, ", ", ", ");
  return err_set(err, errlen, 2,
                 "MESHRUN_COMM_BACKEND=%s: unknown comm backend (known: %s; unset it to choose by device)", env, known);
}

/* The comm backend of the mesh's device collectives on backend be (of entry d): env
 * (MESHRUN_COMM_BACKEND, checked by comm_backend_env) when set; else d's native one (comm_defaults:
 * "cpu" on host memory; on device memory the device's own, "nccl" on cuda) unless it needs a
 * device per rank and fewer than local_world are visible, then the fallback ("staged": ranks
 * share a GPU; buffers are reduced through host memory). "staged" is valid on cpu too: staging is
 * then a copy, and the reductions are the cpu comm's, bit for bit. Whether env suits the device is
 * checked only when world > 1 (a single process creates no comm). Returns 0 with *out and the
 * reason in why, or 2 with the message in err. */
static int comm_backend_choose(const backend_t *be, const backend_entry_t *d, const char *env, int local_world,
                               int world, const char **out, char *why, size_t whylen, char *err, size_t errlen) {
  *out = env;
  if (env) {
    const comm_entry_t *c = comm_find(env);
    if (world > 1 && !comm_suits(c, d)) {
      char alt[256];
      comm_alternatives(d, alt, sizeof alt);
      if (c->device)
        err_set(err, errlen, 0, "MESHRUN_COMM_BACKEND=%s needs device %s, and this run's device is %s: use %s", env,
                c->device, be->name, alt);
      else
        err_set(err, errlen, 0,
                "MESHRUN_COMM_BACKEND=%s moves host memory, and device %s keeps tensors in device "
                "memory: use %s",
                env, be->name, alt);
      return 2;
    }
    snprintf(why, whylen, "MESHRUN_COMM_BACKEND");
    return 0;
  }
  const comm_entry_t *native, *fallback, *c;
  comm_defaults(d, &native, &fallback);
  const int gpus = d->visible_devices ? d->visible_devices() : 0, local = local_world < 1 ? 1 : local_world;
  const int own = local <= gpus; /* a device per local rank */
  if (be->mem == BACKEND_MEM_HOST) {
    c = native ? native : fallback;
    snprintf(why, whylen, "device %s", be->name);
  } else {
    c = native && native->create && (own || !native->device_per_rank) ? native : fallback ? fallback : native;
    snprintf(why, whylen, "LOCAL_WORLD_SIZE %d, %d GPU%s visible%s", local, gpus, gpus == 1 ? "" : "s",
             own ? ": one GPU per rank" : ": ranks share GPUs");
  }
  if (!c) {
    return err_set(err, errlen, 2, "device %s: no comm backend of this trainer moves its memory", be->name);
  }
  *out = c->name;
  return 0;
}

dtype_t device_default_dtype(const backend_t *be) { return be->mem == BACKEND_MEM_DEVICE ? DT_BF16 : DT_F32; }

/* Precision options on this device: param_dtype defaults to what PyTorch users get there (bf16
 * on a device, fp32 on the host, decided by the backend that opened, so "auto" falling back to
 * cpu trains in fp32); an explicit value is kept on either. TF32 as the plan says where the
 * backend has it. */
static void precision_apply(plan_t *p, backend_t *be) {
  if (!p->parallel.param_dtype_explicit) p->parallel.param_dtype = device_default_dtype(be);
  log_rank0("mixed precision: param_dtype %s, reduce_dtype %s%s",
            p->parallel.param_dtype == DT_BF16 ? "bf16" : "fp32",
            p->parallel.reduce_dtype == DT_BF16 ? "bf16" : "fp32",
            p->parallel.param_dtype_explicit ? "" : " (param_dtype: the device's default)");
  if (be->set_tf32) be->set_tf32(be, p->parallel.allow_tf32);
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
  const backend_entry_t *entry = NULL;
  *comm_backend = NULL;
  int rc = comm_backend_env(&comm_env, err, errlen);
  if (rc == 0) rc = backend_open(p, local_rank, be, &entry, err, errlen);
  if (rc == 0) precision_apply(p, *be);
  if (rc == 0)
    rc = comm_backend_choose(*be, entry, comm_env, local_world, world, comm_backend, why, sizeof why, err, errlen);
  if (rc == 0 && world > 1) log_rank0("comm backend %s (%s)", *comm_backend, why);
  if (rc) {
    backend_destroy(*be);
    *be = NULL;
  }
  return rc;
}
