/* trainer: trains a Llama model from a JSON plan, or samples text from saved weights.
 *
 *   trainer [PLAN.json] [--set key.path=value ...]                  train (no PLAN: embedded default)
 *   trainer sample [PLAN.json] --weights FILE [--set key.path=value ...]   print generated text
 *
 * Reads top to bottom: environment (RANK, WORLD_SIZE, LOCAL_RANK) -> plan -> mesh (WORLD_SIZE > 1:
 * the plan's dp_replicate x dp_shard x tp, groups connected through MESHRUN_STORE) -> backend ->
 * model (tensor-parallel when tp > 1) -> data -> data-parallel strategy (trainer/dp: serial,
 * DDP, ZeRO-1, FSDP, HSDP; it owns the optimizer) -> loop { accumulate micro-batch gradients,
 * clip, AdamW, log, eval } -> final weights -> a text sample. Progress goes to stderr through
 * the log ([trainer r0/1]), the sample to stdout, one JSON object per optimizer step to
 * log.metrics_file. Only rank 0 prints progress and writes metrics and weights.
 *
 * Under a mesh: ranks of one dp slot (the tp ranks) read the same micro-batches, as dp rank
 * mesh "dp".rank of "dp".size; the logged loss is the mean over dp (equal to the one-process
 * loss of the same global batch); eval batch k runs on dp rank k mod dp and the sums are
 * added up. Every rank takes part in saving (gathers across dp_shard and tp); rank 0 writes.
 * The first metrics record holds this rank's memory (param_bytes, grad_bytes, optim_bytes,
 * work_bytes) and the maximum over ranks (*_max); each step record holds the bytes this rank
 * sent per step, by strategy collective and by group ("comm").
 *
 * Where the final weights go: <checkpoint.dir>/final.safetensors when checkpoint.dir is set,
 * else out/<plan file name without .json>/final.safetensors ("default" for the embedded plan),
 * with the resolved plan JSON in the safetensors metadata under "plan".
 *
 * Exit codes: 0 done; 1 runtime failure (data, memory, NaN loss, I/O, a collective, a failed save
 * after the last step or of the final weights, a failed write of log.metrics_file); 2 usage or
 * plan error (including device "cuda" in a build without it, WORLD_SIZE > 1 without MESHRUN_STORE,
 * an unknown or unsuitable MESHRUN_COMM_BACKEND, param_dtype bf16 given explicitly on cuda, a
 * checkpoint.dir that cannot be written). A runtime failure also goes to TORCHELASTIC_ERROR_FILE
 * (torchrun's layout), with "meshrun": {"restart": false} when it was a lack of space.
 * Device and comm: device "auto" is cuda when built and a GPU is visible, else cpu (logged). A
 * multi-rank run's device collectives use the comm backend MESHRUN_COMM_BACKEND names, else
 * "cpu" on cpu, and on cuda "nccl" with one GPU per local rank, else "staged" (logged once).
 * Host values (the loss, eval sums, the memory report, checkpoint coordination, gradient-norm
 * shares in trainer/dp) go through the mesh's host comms, cpu rings whatever the backend.
 * Startup: when OMP_WAIT_POLICY is unset the program sets it to passive and re-execs itself once
 * (see ensure_passive_omp); nothing else runs before the first step but loading the data.
 * Checkpoints (trainer/ckpt, checkpoint.*): every checkpoint.interval steps and after the last
 * step, each rank saves its share of parameters and AdamW moments as chunks of full tensors;
 * checkpoint.resume loads them under any strategy, mesh and world (the global batch must be the
 * same: the data order is a function of (seed, step)). The hidden flag --stop-after N ends the
 * run after step N (and its checkpoint) as if it had been killed there, for resume tests. A
 * failed save is a warning and the run goes on (checkpoint_failed), except for a lack of space,
 * which stops it; MESHRUN_FAULT_SAVE=RANK:STEP[:EIO|ENOSPC] makes one rank's write fail, for tests.
 * Not here yet: bf16 parameters (on cuda, the default bf16 trains in fp32, with a log line).
 * Two hidden flags serve the PyTorch oracle test: --dump-init FILE (the initial weights, as
 * safetensors) and --dump-batches FILE (every micro-batch's tokens then targets, int32, in
 * training order). */
#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/log.h"
#include "common/store.h"
#include "trainer/backend.h"
#include "trainer/ckpt.h"
#include "trainer/comm.h"
#include "trainer/data.h"
#include "trainer/dp.h"
#include "trainer/interop.h"
#include "trainer/mesh.h"
#include "trainer/model.h"
#include "trainer/optim.h"
#include "trainer/plan.h"
#include "trainer/rng.h"
#include "trainer/safetensors.h"

#define TRAINER_VERSION "0.1.0"
#define MAX_SETS 128

static const char *usage_text =
    "usage: trainer [PLAN.json] [--set key.path=value ...]\n"
    "       trainer sample [PLAN.json] --weights FILE [--set key.path=value ...]\n"
    "       trainer export --format llama2c|hf [PLAN.json] --weights FILE --out PATH [--set ...]\n"
    "       trainer --help | --version\n"
    "\n"
    "Trains a Llama model as the JSON plan says (keys: docs/plan.md); without PLAN, the embedded\n"
    "default plan (configs/demo.json). --set overrides one key, e.g. --set train.steps=50\n"
    "--set model.dim=128; values parse as JSON when they can, else as strings.\n"
    "'sample' loads weights saved by a training run and prints sample.tokens generated tokens.\n"
    "'export' writes saved weights as a llama2.c file or a Hugging Face directory; model.init\n"
    "also reads both (a .bin file or a directory), checked against the plan's model.\n"
    "Checkpoints: checkpoint.dir, .interval (steps; also at the end), .keep, .async, .resume\n"
    "(none, auto = the latest intact one or a fresh start, or a step directory).\n"
    "Environment: RANK, WORLD_SIZE, LOCAL_RANK (set by meshrun; default 0, 1, 0), MESHRUN_STORE\n"
    "(host:port of meshrun's store; needed when WORLD_SIZE > 1), TORCHELASTIC_RESTART_COUNT, MESHRUN_ROUND,\n"
    "OMP_NUM_THREADS (cpu threads), MESHRUN_LOG_LEVEL (error, warn, info, debug), MESHRUN_COMM_BACKEND\n"
    "(cpu, nccl or staged: the collectives of a multi-rank run; default by device: cpu on cpu, on cuda\n"
    "nccl with a GPU per local rank, else staged).\n"
    "Exit status: 0 done, 1 runtime failure, 2 usage or plan error.\n";

typedef struct {
  int sample_mode, export_mode;
  const char *format;       /* export */
  const char *out;          /* export */
  int stop_after;           /* hidden: stop (as if killed) after this step; 0 = never */
  const char *plan_path; /* NULL: embedded default */
  const char *sets[MAX_SETS];
  int nsets;
  const char *weights;      /* sample mode */
  const char *dump_init;    /* hidden: oracle test */
  const char *dump_batches; /* hidden: oracle test */
} args_t;

/* ------------------------------------------------------------------------------------------ */
/* small helpers */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int env_int(const char *name, int dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end;
  long v = strtol(s, &end, 10);
  return *end ? -1 : (int)v;
}

/* 45678.9 -> "45,679" */
static void fmt_thousands(char *buf, size_t len, double x) {
  char digits[32];
  snprintf(digits, sizeof digits, "%.0f", x < 0 ? 0 : x);
  size_t n = strlen(digits), o = 0;
  for (size_t i = 0; i < n && o + 2 < len; i++) {
    if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
    buf[o++] = digits[i];
  }
  buf[o] = 0;
}

static void fmt_duration(char *buf, size_t len, double s) {
  long t = (long)(s + 0.5);
  if (t >= 3600) snprintf(buf, len, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else snprintf(buf, len, "%ld:%02ld", t / 60, t % 60);
}

/* The value of an environment variable for a message: never NULL. */
static const char *env_text(const char *name) {
  const char *s = getenv(name);
  return s ? s : "(unset)";
}

/* TORCHELASTIC_ERROR_FILE (set by meshrun, as by torchrun): the cause of a fatal runtime error
 * in torchrun's layout {"message": {"message": ..., "extraInfo": {"timestamp": ...}}}, so that
 * meshrun's root-cause line carries it. restart 0 adds "meshrun": {"restart": false}: a retry
 * cannot help (a full disk), and meshrun ends the job instead of spending a restart. Best
 * effort: a file that cannot be written costs one warning. */
static void error_file_write(const char *msg, int restart) {
  const char *path = getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  char ts[32];
  snprintf(ts, sizeof ts, "%lld", (long long)time(NULL));
  cJSON *root = cJSON_CreateObject();
  cJSON *m = cJSON_AddObjectToObject(root, "message");
  cJSON_AddStringToObject(m, "message", msg);
  cJSON_AddStringToObject(cJSON_AddObjectToObject(m, "extraInfo"), "timestamp", ts);
  if (!restart) cJSON_AddBoolToObject(cJSON_AddObjectToObject(root, "meshrun"), "restart", 0);
  char *txt = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  FILE *f = txt ? fopen(path, "w") : NULL;
  int ok = f && fputs(txt, f) >= 0;
  int e = errno;
  if (f && fclose(f) != 0 && ok) ok = 0, e = errno;
  if (!ok) log_warn("cannot write TORCHELASTIC_ERROR_FILE %s: %s", path, txt ? strerror(e) : "out of memory");
  free(txt);
}

/* The end of a run that failed: the one-line message, and for runtime failures (code 1) the
 * error file. Returns code. */
static int exit_error(int code, const char *msg, int restart) {
  fprintf(stderr, "trainer: %s\n", msg);
  if (code == 1) error_file_write(msg, restart);
  return code;
}

/* mkdir -p of the directory part of path. */
static int make_parent_dirs(const char *path, char *err, size_t errlen) {
  char failed[PLAN_PATH_MAX + 64];
  int rc = fs_mkdir_parent(path, failed, sizeof failed);
  if (rc) {
    snprintf(err, errlen, "cannot create directory %s: %s", failed, strerror(-rc));
    return -1;
  }
  return 0;
}

/* libgomp's threads spin for a while after each parallel region, and this build's OpenBLAS
 * runs its own pthreads: on a few cores the two pools spin against each other (sampling was
 * 16x slower on 2 cores). libgomp reads OMP_WAIT_POLICY when it loads, before main, so when
 * the variable is unset we set it to passive and exec ourselves once. A user's own setting wins. */
static void ensure_passive_omp(char **argv) {
  if (getenv("OMP_WAIT_POLICY")) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv); /* returns only on failure: then run with spinning threads */
}

static int parse_args(args_t *a, int argc, char **argv, char *err, size_t errlen) {
  memset(a, 0, sizeof *a);
  int i = 1;
  if (i < argc && !strcmp(argv[i], "sample")) {
    a->sample_mode = 1;
    i++;
  } else if (i < argc && !strcmp(argv[i], "export")) {
    a->export_mode = 1;
    i++;
  }
  const char *stop = NULL;
  for (; i < argc; i++) {
    const char *s = argv[i];
    const char **target = NULL;
    if (!strcmp(s, "--set") || !strcmp(s, "-s")) {
      if (a->nsets == MAX_SETS) {
        snprintf(err, errlen, "too many --set options (at most %d)", MAX_SETS);
        return -1;
      }
      target = &a->sets[a->nsets++];
    } else if (!strncmp(s, "--set=", 6)) {
      if (a->nsets == MAX_SETS) {
        snprintf(err, errlen, "too many --set options (at most %d)", MAX_SETS);
        return -1;
      }
      a->sets[a->nsets++] = s + 6;
      continue;
    } else if (!strcmp(s, "--weights")) {
      target = &a->weights;
    } else if (!strcmp(s, "--format") && a->export_mode) {
      target = &a->format;
    } else if (!strcmp(s, "--out") && a->export_mode) {
      target = &a->out;
    } else if (!strcmp(s, "--stop-after")) {
      target = &stop;
    } else if (!strcmp(s, "--dump-init")) {
      target = &a->dump_init;
    } else if (!strcmp(s, "--dump-batches")) {
      target = &a->dump_batches;
    } else if (s[0] == '-' && s[1]) {
      snprintf(err, errlen, "unknown option %s (see trainer --help)", s);
      return -1;
    } else if (!a->plan_path) {
      a->plan_path = s;
      continue;
    } else {
      snprintf(err, errlen, "unexpected argument %s: one plan file at most (see trainer --help)", s);
      return -1;
    }
    if (i + 1 >= argc) {
      snprintf(err, errlen, "%s needs a value", s);
      return -1;
    }
    *target = argv[++i];
  }
  if (stop && (a->stop_after = atoi(stop)) <= 0) {
    snprintf(err, errlen, "--stop-after needs a step number > 0, got %s", stop);
    return -1;
  }
  if ((a->sample_mode || a->export_mode) && !a->weights) {
    snprintf(err, errlen, "trainer %s needs --weights FILE", a->sample_mode ? "sample" : "export");
    return -1;
  }
  if (a->export_mode && (!a->format || !a->out)) {
    snprintf(err, errlen, "trainer export needs --format llama2c|hf and --out PATH");
    return -1;
  }
  if (!a->sample_mode && !a->export_mode && a->weights) {
    snprintf(err, errlen, "--weights is for 'trainer sample'; to start training from weights, set model.init");
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* weights: safetensors with the model's tensor names */

/* Elements of tensor t's full (unsplit) form. */
static size_t full_numel(const model_tensor_t *t) {
  return t->full_shape[0] > 0 ? (size_t)t->full_shape[0] * (size_t)(t->ndim == 2 ? t->full_shape[1] : 1) : t->numel;
}

/* Full tensors from every rank's pieces, written by rank 0. Collective over the job: each unit
 * is gathered across dp_shard (dp_unit_open) and each tensor assembled across tp
 * (model_export_tensor); replicas other than the first (dp_replicate coordinate > 0) hold the
 * same values and return at once. */
static int weights_save(model_t *m, dp_t *dp, const mesh_t *mesh, int rank, const char *path, const char *plan_json,
                        int step, char *err, size_t errlen) {
  const int r = mesh ? mesh->coord[MESH_DP_REPLICATE] : 0, sh = mesh ? mesh->coord[MESH_DP_SHARD] : 0;
  const int tp = mesh ? mesh->dims[MESH_TP] : 1;
  if (r != 0) return 0;
  const int exporter = sh == 0; /* the tp group of shard 0 assembles; rank 0 is one of them */
  const int nt = model_num_tensors(m), nu = model_num_units(m);
  size_t total = 0, umax = 0, uoff, unum;
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    total += full_numel(t);
  }
  for (int u = 0; u < nu; u++) {
    model_unit_range(m, u, &uoff, &unum);
    if (unum > umax) umax = unum;
  }
  float *host = malloc(total * sizeof(float)), *unit = tp > 1 ? NULL : malloc(umax * sizeof(float));
  st_tensor_t *ts = calloc((size_t)nt, sizeof *ts);
  if (!host || !ts || (tp == 1 && !unit)) {
    free(host);
    free(unit);
    free(ts);
    snprintf(err, errlen, "out of memory copying %zu parameters to save them", total);
    return -1;
  }
  int rc = 0;
  size_t at = 0;
  for (int i = 0; i < nt; i++) { /* full-tensor layout of the file, in the model's order */
    const model_tensor_t *t = model_tensor(m, i);
    ts[i].name = t->name;
    ts[i].dtype = ST_F32;
    ts[i].ndim = t->ndim;
    ts[i].shape[0] = t->full_shape[0] > 0 ? t->full_shape[0] : t->shape[0];
    ts[i].shape[1] = t->ndim == 2 ? (t->full_shape[0] > 0 ? t->full_shape[1] : t->shape[1]) : 1;
    ts[i].data = host + at;
    at += (size_t)ts[i].shape[0] * (size_t)ts[i].shape[1];
  }
  for (int u = 0; u < nu && rc == 0; u++) {
    if (dp_unit_open(dp, u)) {
      snprintf(err, errlen, "saving weights: %s", dp_errmsg(dp));
      rc = -1;
      break;
    }
    if (!exporter) continue;
    if (tp == 1) dp_unit_to_host(dp, u, unit);
    model_unit_range(m, u, &uoff, &unum);
    for (int i = 0; i < nt && rc == 0; i++) {
      const model_tensor_t *t = model_tensor(m, i);
      if (t->unit != u) continue;
      if (tp == 1) {
        memcpy((float *)ts[i].data, unit + (t->offset - uoff), t->numel * sizeof(float));
      } else if (model_export_tensor(m, i, (float *)ts[i].data) != 0) {
        snprintf(err, errlen, "saving weights: assembling %s across tp failed (see the log)", t->name);
        rc = -1;
      }
    }
  }
  if (rc == 0 && rank == 0) {
    char stepbuf[32];
    snprintf(stepbuf, sizeof stepbuf, "%d", step);
    const char *meta[] = {"format", "meshrun", "plan", plan_json ? plan_json : "{}", "step", stepbuf};
    rc = make_parent_dirs(path, err, errlen);
    if (rc == 0) rc = st_write(path, ts, nt, meta, 3, err, errlen);
  }
  free(host);
  free(unit);
  free(ts);
  return rc ? -1 : 0;
}

/* model.init under a mesh: every rank reads the file and keeps its part (its tp slice through
 * model_import_tensor, then its FSDP shard through dp_unit_commit). */
static int weights_load_parallel(model_t *m, dp_t *dp, const char *path, char *err, size_t errlen) {
  st_file_t *f = NULL;
  if (st_open(&f, path, err, errlen) != 0) return -1;
  const int nt = model_num_tensors(m), nu = model_num_units(m);
  int rc = 0;
  for (int u = 0; u < nu && rc == 0; u++) {
    if (dp_unit_open(dp, u)) {
      snprintf(err, errlen, "loading %s: %s", path, dp_errmsg(dp));
      rc = -1;
      break;
    }
    for (int i = 0; i < nt && rc == 0; i++) {
      const model_tensor_t *t = model_tensor(m, i);
      if (t->unit != u) continue;
      size_t full = full_numel(t);
      const st_tensor_t *s = st_find(f, t->name);
      if (!s) {
        snprintf(err, errlen, "%s: no tensor %s (is it from a model of this plan?)", path, t->name);
        rc = -1;
      } else if (s->dtype != ST_F32 || st_numel(s) != full) {
        snprintf(err, errlen, "%s: tensor %s has %zu elements, the model wants %zu F32", path, t->name, st_numel(s),
                 full);
        rc = -1;
      } else {
        model_import_tensor(m, i, s->data);
      }
    }
    if (rc == 0) dp_unit_commit(dp, u);
  }
  st_close(f);
  return rc;
}

static int weights_load(model_t *m, backend_t *be, const char *path, char *err, size_t errlen) {
  st_file_t *f = NULL;
  if (st_open(&f, path, err, errlen) != 0) return -1;
  int nt = model_num_tensors(m), rc = 0;
  float *params = model_params(m);
  for (int i = 0; i < nt && rc == 0; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    const st_tensor_t *s = st_find(f, t->name);
    if (!s) {
      snprintf(err, errlen, "%s: no tensor %s (is it from a model of this plan?)", path, t->name);
      rc = -1;
    } else if (s->dtype != ST_F32 || st_numel(s) != t->numel) {
      snprintf(err, errlen, "%s: tensor %s has %zu %s elements, the model wants %zu F32 (shape %d x %d)", path,
               t->name, st_numel(s), s->dtype == ST_F32 ? "F32" : "I32", t->numel, t->shape[0],
               t->ndim == 2 ? t->shape[1] : 1);
      rc = -1;
    } else {
      be->to_device(be, params + t->offset, s->data, t->numel * sizeof(float));
    }
  }
  st_close(f);
  return rc;
}

/* model.init of a llama2.c file or a Hugging Face directory (trainer/interop): checked against
 * the plan's model first (a mismatch is a plan error: returns 2), then unit by unit as
 * weights_load_parallel does, so it works under every strategy (dp may be a serial one). */
static int weights_load_interop(model_t *m, dp_t *dp, const plan_t *p, char *err, size_t errlen) {
  interop_file_t *f = NULL;
  int rc = interop_open(&f, p->model.init, INTEROP_AUTO, err, errlen);
  if (rc) return rc == INTEROP_EMISMATCH ? 2 : 1;
  if (interop_check_plan(f, &p->model, err, errlen)) {
    interop_close(f);
    return 2;
  }
  const int nt = model_num_tensors(m), nu = model_num_units(m);
  size_t fmax = 0;
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    size_t full = full_numel(t);
    fmax = full > fmax ? full : fmax;
  }
  log_rank0("model.init: %s (%s, checked against the plan's model)", p->model.init,
            interop_format_name(interop_file_format(f)));
  float *buf = malloc(fmax * sizeof(float));
  rc = buf ? 0 : 1;
  if (!buf) snprintf(err, errlen, "out of memory loading %s", p->model.init);
  for (int u = 0; u < nu && rc == 0; u++) {
    if (dp_unit_open(dp, u)) {
      snprintf(err, errlen, "loading %s: %s", p->model.init, dp_errmsg(dp));
      rc = 1;
      break;
    }
    for (int i = 0; i < nt && rc == 0; i++) {
      const model_tensor_t *t = model_tensor(m, i);
      if (t->unit != u) continue;
      size_t full = full_numel(t);
      if (interop_read_tensor(f, t->name, buf, full, err, errlen)) rc = 2;
      else model_import_tensor(m, i, buf);
    }
    if (rc == 0) dp_unit_commit(dp, u);
  }
  free(buf);
  interop_close(f);
  return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* checkpoints (trainer/ckpt): the strategy's state as chunks of full tensors, and the scalars.
 * Training draws no random numbers of its own (batches are a function of (seed, step); no
 * dropout), so the RNG state is empty; the seed and global batch are recorded as extras. */

static int checkpoint_save(ckpt_writer_t *w, dp_t *dp, const plan_t *p, int step, char *err, size_t errlen) {
  ckpt_state_t st;
  memset(&st, 0, sizeof st);
  st.step = step;
  st.optim_step = dp_optim_step(dp);
  st.data_position = (uint64_t)step * (uint64_t)p->train.global_batch_size;
  char v[64];
  snprintf(v, sizeof v, "%llu", (unsigned long long)p->seed);
  ckpt_state_set(&st, "seed", v);
  snprintf(v, sizeof v, "%d", p->train.global_batch_size);
  ckpt_state_set(&st, "global_batch_size", v);
  snprintf(v, sizeof v, "%d", p->train.steps);
  ckpt_state_set(&st, "train_steps", v);
  ckpt_chunks_t cs = {0};
  float *host = NULL;
  /* A rank that cannot copy still joins the collective save, with n_chunks -1: the save then
   * fails on every rank instead of leaving the others waiting. (No chunks would not do: the
   * coverage check sees only tensors some rank saved, so when this rank was the only holder of
   * a tensor, e.g. DDP's rank 0 of every parameter, a checkpoint without it would commit.) */
  char cerr[256] = "";
  int crc = dp_ckpt_to_host(dp, &cs, &host, cerr, sizeof cerr);
  int rc = ckpt_writer_save(w, &st, crc ? NULL : cs.v, crc ? -1 : cs.n, err, errlen);
  if (crc) snprintf(err, errlen, "%s", cerr);
  ckpt_chunks_free(&cs);
  free(host);
  return rc ? rc : crc ? CKPT_EINVAL : 0;
}

/* What a failed save (or the commit of an asynchronous one) of step `step` means for the run.
 * Every rank gets the same rc and message from the writer, so every rank decides alike:
 * - a lack of space (CKPT_ENOSPC) stops the run at once (-1, *no_restart set): a restart would
 *   fail the same way, so meshrun is asked not to spend one;
 * - a broken collective (CKPT_ECOMM) stops it too (-1): the group cannot save, nor train;
 * - anything else is one warning (rank 0) and the run goes on (0): the writer removed the
 *   save's .tmp and the next save may succeed. When it was the save after the last step,
 *   *final_failed is set and err keeps the cause, for the exit status at the end. */
static int checkpoint_failed(int rc, int step, int rank, int *no_restart, int *final_failed, int is_final, char *err,
                             size_t errlen) {
  if (rc == 0) return 0;
  if (rc == CKPT_ENOSPC || rc == CKPT_ECOMM) {
    char cause[2048];
    snprintf(cause, sizeof cause, "%s", err);
    snprintf(err, errlen, "the checkpoint of step %d failed, stopping: %s", step, cause);
    if (rc == CKPT_ENOSPC) *no_restart = 1;
    return -1;
  }
  if (rank == 0)
    log_warn("the checkpoint of step %d failed (%s)%s", step, err,
             is_final ? "; the final weights are saved next, and the run will exit 1" : "; training goes on");
  if (is_final) *final_failed = 1;
  return 0;
}

/* Test hook, MESHRUN_FAULT_SAVE=RANK:STEP[:EIO|ENOSPC] (default EIO): that rank's shard write
 * of the checkpoint of that step fails with that errno, as a failing disk would (ckpt's
 * "write" hook point). */
typedef struct {
  int rank, step, err;
} save_fault_t;

static int save_fault_hook(const char *point, int64_t step, void *arg) {
  const save_fault_t *f = arg;
  return !strcmp(point, "write") && step == f->step ? f->err : 0;
}

static int save_fault_parse(save_fault_t *f) {
  const char *s = getenv("MESHRUN_FAULT_SAVE");
  char name[16] = "EIO";
  if (!s || sscanf(s, "%d:%d:%15s", &f->rank, &f->step, name) < 2) return 0;
  f->err = !strcmp(name, "ENOSPC") ? ENOSPC : EIO;
  return 1;
}

/* checkpoint.resume: "none", "auto" or a step directory. Sets *start_step (0: fresh) and
 * *saved_world; returns 0, or 2 (usage: wrong shape, no such checkpoint, another global batch)
 * or 1 (nothing intact, I/O, a collective) with the message in err. Collective. */
static int checkpoint_resume(const plan_t *p, dp_t *dp, const ckpt_group_t *g, int world, int *start_step,
                             int *resumed, char *err, size_t errlen) {
  *start_step = 0;
  *resumed = 0;
  const char *which = p->checkpoint.resume;
  if (!strcmp(which, "none")) return 0;
  ckpt_shape_t shape;
  ckpt_shape_from_plan(&shape, &p->model);
  ckpt_t *ck = NULL;
  int rc = ckpt_open(&ck, p->checkpoint.dir[0] ? p->checkpoint.dir : ".", which, &shape, g, err, errlen);
  if (rc == CKPT_ENOENT && !strcmp(which, "auto")) {
    log_rank0("checkpoint.resume auto: no checkpoint in %s; starting from step 0", p->checkpoint.dir);
    return 0;
  }
  if (rc) return rc == CKPT_ESHAPE || rc == CKPT_ENOENT ? 2 : 1;
  const ckpt_meta_t *meta = ckpt_meta(ck);
  const uint64_t G = (uint64_t)p->train.global_batch_size, step = (uint64_t)meta->state.step;
  const uint64_t pos = meta->state.data_position;
  if (step ? pos % step != 0 : pos != 0) { /* no global batch explains it (the metadata checksum passed) */
    snprintf(err, errlen, "checkpoint error: %s: data_position %llu is not a whole number of batches of its %llu "
             "steps: the checkpoint is inconsistent", meta->path, (unsigned long long)pos, (unsigned long long)step);
    ckpt_close(ck);
    return 1;
  }
  if (meta->state.data_position != step * G) {
    snprintf(err, errlen, "checkpoint error: %s consumed %llu samples in %llu steps (global batch %llu) but this "
             "plan's train.global_batch_size is %llu: the data order would not continue; set "
             "train.global_batch_size=%llu", meta->path, (unsigned long long)meta->state.data_position,
             (unsigned long long)step, step ? (unsigned long long)(meta->state.data_position / step) : 0ULL,
             (unsigned long long)G, step ? (unsigned long long)(meta->state.data_position / step) : 0ULL);
    ckpt_close(ck);
    return 2;
  }
  if (step > (uint64_t)p->train.steps) {
    snprintf(err, errlen, "checkpoint error: %s is at step %llu, beyond train.steps %d", meta->path,
             (unsigned long long)step, p->train.steps);
    ckpt_close(ck);
    return 2;
  }
  if (dp_ckpt_from_host(dp, ck, err, errlen)) {
    ckpt_close(ck);
    return 1;
  }
  dp_set_optim_step(dp, (int)meta->state.optim_step);
  int restart = env_int("TORCHELASTIC_RESTART_COUNT", 0), round = env_int("MESHRUN_ROUND", restart);
  log_rank0("resumed from %s (step %llu, saved by world %d, now world %d, restart %d, round %d)", meta->path,
            (unsigned long long)step, meta->world_size, world, restart < 0 ? 0 : restart, round < 0 ? 0 : round);
  *start_step = (int)step;
  *resumed = 1;
  ckpt_close(ck);
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* sampling: full forward over the last seq_len tokens for each new token (no KV cache) */

static int sample_next(const float *logits, int v, double temperature, rng_t *r) {
  int best = 0;
  for (int i = 1; i < v; i++)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return best;
  double total = 0;
  for (int i = 0; i < v; i++) total += exp((logits[i] - logits[best]) / temperature);
  double u = rng_uniform(r) * total, acc = 0;
  for (int i = 0; i < v; i++) {
    acc += exp((logits[i] - logits[best]) / temperature);
    if (u < acc) return i;
  }
  return best;
}

/* Generates p->sample.sample_tokens tokens after the prompt and writes prompt + text to out
 * (bytes for text data, space-separated ids otherwise). */
static int generate(model_t *m, backend_t *be, const plan_t *p, int is_text, FILE *out, char *err, size_t errlen) {
  const int n_new = p->sample.sample_tokens, t_max = p->train.seq_len, v = model_vocab_size(m);
  const char *prompt = p->sample.prompt[0] ? p->sample.prompt : "\n";
  size_t plen = strlen(prompt);
  int32_t *ctx = malloc((plen + (size_t)n_new + 1) * sizeof(int32_t));
  float *row = malloc((size_t)v * sizeof(float));
  if (!ctx || !row) {
    free(ctx);
    free(row);
    snprintf(err, errlen, "out of memory for sampling");
    return -1;
  }
  int n = 0;
  if (is_text) {
    for (size_t i = 0; i < plen; i++)
      if ((unsigned char)prompt[i] < (unsigned)v) ctx[n++] = (unsigned char)prompt[i];
  } else { /* ids: the prompt read as integers */
    const char *s = prompt;
    char *end;
    for (long id = strtol(s, &end, 10); end != s; s = end, id = strtol(s, &end, 10))
      if (id >= 0 && id < v) ctx[n++] = (int32_t)id;
  }
  if (n == 0) ctx[n++] = 0;
  const int n_prompt = n;

  rng_t r;
  rng_init(&r, p->seed, rng_hash_str("sample"));
  for (int k = 0; k < n_new; k++) {
    int t = n < t_max ? n : t_max;
    model_forward(m, ctx + n - t, NULL, 1, t);
    be->to_host(be, row, model_logits(m) + (size_t)(t - 1) * v, (size_t)v * sizeof(float));
    ctx[n++] = sample_next(row, v, p->sample.temperature, &r);
  }
  for (int i = 0; i < n; i++) {
    if (is_text) fputc(ctx[i], out);
    else fprintf(out, i == 0 ? "%d" : " %d", ctx[i]);
    if (i + 1 == n_prompt && !is_text) fputs(" |", out);
  }
  fputc('\n', out);
  fflush(out);
  free(ctx);
  free(row);
  return 0;
}

/* Whether the plan's data is byte text, without loading it (for 'trainer sample'). */
static int plan_is_text(const plan_t *p) {
  if (p->data.format == PLAN_DATA_TEXT) return 1;
  if (p->data.format != PLAN_DATA_AUTO) return 0;
  char err[256];
  int f = data_detect_format(p->data.train, PLAN_DATA_AUTO, err, sizeof err);
  return f >= 0 ? f == PLAN_DATA_TEXT : p->model.vocab_size <= 256;
}

/* ------------------------------------------------------------------------------------------ */
/* metrics: JSONL, one object per line, flushed as written so a crash keeps what was logged.
 * A write that fails (a full disk, /dev/full) is one warning; no record is written after it
 * (a torn line would follow), training goes on, and the run exits 1 at the end (metrics_close). */

typedef struct {
  FILE *f;          /* NULL: no metrics (log.metrics_file "", or not rank 0) */
  const char *path;
  int err;          /* errno of the first failed write; 0 while every write succeeded */
  char what[48];    /* what failed: "the first record", "the record of step 12", "the close" */
} metrics_t;

/* step: the record's step; 0 the first record; -1 the close. */
static void metrics_failed(metrics_t *m, int e, int step) {
  m->err = e ? e : EIO;
  if (step > 0) snprintf(m->what, sizeof m->what, "the record of step %d", step);
  else snprintf(m->what, sizeof m->what, "%s", step == 0 ? "the first record" : "the close");
  log_warn("log.metrics_file %s: %s failed: %s; no more records are written, and the run will exit 1 when it ends",
           m->path, m->what, strerror(m->err));
}

static void metrics_printf(metrics_t *m, int step, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void metrics_printf(metrics_t *m, int step, const char *fmt, ...) {
  if (!m->f || m->err) return;
  va_list ap;
  va_start(ap, fmt);
  errno = 0;
  int n = vfprintf(m->f, fmt, ap);
  va_end(ap);
  int e = errno;
  if (n >= 0 && fflush(m->f) != 0) n = -1, e = errno;
  if (n < 0 || ferror(m->f)) metrics_failed(m, e, step);
}

/* comm: ",\"comm\":{...}" with this rank's bytes sent during the step, or "". */
static void metrics_step(metrics_t *m, int step, double loss, double lr, double gnorm, double tps, double ms,
                         const char *comm) {
  metrics_printf(m, step,
                 "{\"step\":%d,\"loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%.9g,\"tokens_per_s\":%.1f,"
                 "\"step_ms\":%.3f%s}\n",
                 step, loss, lr, gnorm, tps, ms, comm);
}

static void metrics_eval(metrics_t *m, int step, double loss) {
  metrics_printf(m, step, "{\"step\":%d,\"eval_loss\":%.9g}\n", step, loss);
}

/* Closes the file; returns 0, or -1 with the message in err when any write (or the close)
 * failed. Accepts a metrics_t without a file. */
static int metrics_close(metrics_t *m, char *err, size_t errlen) {
  if (m->f && fclose(m->f) != 0 && !m->err) metrics_failed(m, errno, -1);
  m->f = NULL;
  if (!m->err) return 0;
  snprintf(err, errlen, "log.metrics_file %s: %s failed: %s (the records from there on are lost)", m->path, m->what,
           strerror(m->err));
  return -1;
}

static void final_weights_path(const plan_t *p, char *out, size_t len) {
  if (p->checkpoint.dir[0]) {
    snprintf(out, len, "%s/final.safetensors", p->checkpoint.dir);
    return;
  }
  char name[PLAN_PATH_MAX];
  const char *base = strrchr(p->source, '/');
  snprintf(name, sizeof name, "%s", base ? base + 1 : p->source);
  char *dot = strrchr(name, '.');
  if (dot && !strcmp(dot, ".json")) *dot = 0;
  if (!name[0] || name[0] == '(') snprintf(name, sizeof name, "default");
  snprintf(out, len, "out/%s/final.safetensors", name);
}

/* ------------------------------------------------------------------------------------------ */

/* Mean eval loss over batches k = 0..batches-1 (the one-process value). Under a mesh, dp rank
 * r runs batches k = r, r + dp, ... and the sums are added over "dp"; every rank runs the same
 * number of forwards (FSDP and TP forwards are collective), the spare ones on a repeated
 * batch whose loss is not counted. */
static int evaluate(model_t *m, const data_t *d, comm_t *dpc, int batches, int b, int t, int32_t *tok, int32_t *tgt,
                    double *out) {
  const int n = dpc ? comm_size(dpc) : 1, r = dpc ? comm_rank(dpc) : 0;
  double sum = 0;
  for (int j = 0; j < (batches + n - 1) / n; j++) {
    const int k = j * n + r;
    data_eval_batch(d, k < batches ? k : k % batches, b, tok, tgt);
    float l = model_forward(m, tok, tgt, b, t);
    if (k < batches) sum += l;
  }
  if (n > 1) {
    float s = (float)sum;
    if (comm_all_reduce(dpc, &s, 1, COMM_FLOAT32, COMM_SUM)) return -1;
    sum = s;
  }
  *out = sum / batches;
  return 0;
}

/* Per-rank bytes of state, and their maximum over the job. */
typedef struct {
  dp_memory_t mine, max;
} memory_report_t;

static int memory_report(dp_t *dp, comm_t *world, memory_report_t *r) {
  dp_memory(dp, &r->mine);
  r->max = r->mine;
  if (!world || comm_size(world) == 1) return 0;
  /* KiB in fp32 (the cpu comm's dtype): exact up to 16 GiB per rank. */
  float v[4] = {(float)(r->mine.param_bytes / 1024.0), (float)(r->mine.grad_bytes / 1024.0),
                (float)(r->mine.optim_bytes / 1024.0), (float)(r->mine.work_bytes / 1024.0)};
  if (comm_all_reduce(world, v, 4, COMM_FLOAT32, COMM_MAX)) return -1;
  r->max.param_bytes = (size_t)((double)v[0] * 1024.0);
  r->max.grad_bytes = (size_t)((double)v[1] * 1024.0);
  r->max.optim_bytes = (size_t)((double)v[2] * 1024.0);
  r->max.work_bytes = (size_t)((double)v[3] * 1024.0);
  return 0;
}

/* Bytes sent by this rank since the last call: by strategy collective, and per mesh group
 * (the groups' totals include main's loss and norm reductions: a group's host comm is counted
 * with its device comm when they differ, so every comm backend reports the same totals). */
typedef struct {
  dp_traffic_t dp;
  uint64_t group[MESH_NGROUPS];
} traffic_t;

static void traffic_step(dp_t *dp, const mesh_t *mesh, traffic_t *last, char *out, size_t len) {
  out[0] = 0;
  if (!mesh) return;
  traffic_t now;
  dp_traffic(dp, &now.dp);
  int o = snprintf(out, len, ",\"comm\":{\"all_reduce\":%llu,\"all_gather\":%llu,\"reduce_scatter\":%llu,"
                   "\"broadcast\":%llu",
                   (unsigned long long)(now.dp.all_reduce - last->dp.all_reduce),
                   (unsigned long long)(now.dp.all_gather - last->dp.all_gather),
                   (unsigned long long)(now.dp.reduce_scatter - last->dp.reduce_scatter),
                   (unsigned long long)(now.dp.broadcast - last->dp.broadcast));
  for (int g = 0; g < MESH_NGROUPS; g++) {
    comm_stats_t st = {0}, hst = {0};
    const mesh_group_t *grp = &mesh->groups[g];
    if (grp->comm) comm_get_stats(grp->comm, &st);
    if (grp->host_comm && grp->host_comm != grp->comm) comm_get_stats(grp->host_comm, &hst);
    now.group[g] = st.bytes_sent + hst.bytes_sent;
    if (o > 0 && (size_t)o < len)
      o += snprintf(out + o, len - (size_t)o, ",\"%s\":%llu", mesh->groups[g].name,
                    (unsigned long long)(now.group[g] - last->group[g]));
  }
  if (o > 0 && (size_t)o < len) snprintf(out + o, len - (size_t)o, "}");
  *last = now;
}

/* ------------------------------------------------------------------------------------------ */
/* device and comm backend */

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
 * on rank 0. Returns 0 with *out, or 2 (device cuda in a build without it) or 1 (the backend
 * failed) with the message in err. */
static int device_open(const plan_t *p, int local_rank, backend_t **out, char *err, size_t errlen) {
  *out = NULL;
  if (p->device == PLAN_DEVICE_CUDA) {
#ifdef MESHRUN_HAVE_CUDA
    *out = cuda_open(local_rank, err, errlen);
    return *out ? 0 : 1;
#else
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

/* MESHRUN_COMM_BACKEND: NULL when unset or empty, else one of "cpu", "nccl", "staged". Checked
 * first, before any device is opened, so that a typo is the only line printed. Returns 0, or 2
 * with the message in err. */
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

/* The comm backend of the mesh's device collectives on device dev ("cpu" or "cuda"): env
 * (MESHRUN_COMM_BACKEND, checked by comm_backend_env) when set; else "cpu" on cpu, and on cuda
 * "nccl" when LOCAL_WORLD_SIZE GPUs are visible (NCCL wants one GPU per rank), else "staged"
 * (ranks share a GPU; buffers are reduced through host memory). "staged" is valid on cpu too:
 * staging is then a copy, and the reductions are the cpu comm's, bit for bit. Whether env suits
 * the device is checked only when world > 1 (a single process creates no comm). Returns 0 with
 * *out and the reason in why, or 2 with the message in err. */
static int comm_backend_choose(const char *dev, const char *env, int world, const char **out, char *why,
                               size_t whylen, char *err, size_t errlen) {
  *out = env;
  if (env) {
    const int on_cpu = !strcmp(dev, "cpu");
    if (world > 1 && on_cpu && !strcmp(env, "nccl")) {
      snprintf(err, errlen, "MESHRUN_COMM_BACKEND=nccl needs device cuda, and this run's device is cpu: use cpu or "
               "staged");
      return 2;
    }
    if (world > 1 && !on_cpu && !strcmp(env, "cpu")) {
      snprintf(err, errlen, "MESHRUN_COMM_BACKEND=cpu moves host memory, and device %s keeps tensors in device "
               "memory: use nccl or staged", dev);
      return 2;
    }
    snprintf(why, whylen, "MESHRUN_COMM_BACKEND");
    return 0;
  }
  if (!strcmp(dev, "cpu")) {
    *out = "cpu";
    snprintf(why, whylen, "device cpu");
    return 0;
  }
  int gpus = comm_nccl_visible_gpus(), local = env_int("LOCAL_WORLD_SIZE", 1);
  if (local < 1) local = 1;
  *out = local <= gpus ? "nccl" : "staged";
  snprintf(why, whylen, "LOCAL_WORLD_SIZE %d, %d GPU%s visible%s", local, gpus, gpus == 1 ? "" : "s",
           local <= gpus ? ": one GPU per rank" : ": ranks share GPUs");
  return 0;
}

/* Builds the mesh of a multi-process run and connects its groups through meshrun's store, with
 * comm backend comm_backend on device be's memory. */
static int mesh_setup(mesh_t **out, const plan_t *p, int rank, int world, const char *comm_backend, backend_t *be,
                      char *err, size_t errlen) {
  const char *ep = getenv("MESHRUN_STORE");
  if (!ep || !*ep) {
    snprintf(err, errlen, "WORLD_SIZE=%d: the mesh's groups connect through meshrun's store, and MESHRUN_STORE is "
                          "not set: run under meshrun, or set MESHRUN_STORE=host:port", world);
    return 2;
  }
  if (mesh_create(out, p->mesh.dp_replicate, p->mesh.dp_shard, p->mesh.tp, rank, world, err, errlen)) return 2;
  store_t *st = NULL;
  if (store_connect_env(&st, 60000, err, errlen)) return 1;
  int rc = mesh_connect(*out, comm_backend, be, st, -1, NULL, 0, err, errlen);
  store_close(st);
  return rc ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    fputs(usage_text, stdout);
    return 0;
  }
  if (argc > 1 && !strcmp(argv[1], "--version")) {
    printf("trainer (meshrun) %s, backends: cpu%s\n", TRAINER_VERSION,
#ifdef MESHRUN_HAVE_CUDA
           ", cuda"
#else
           ""
#endif
    );
    return 0;
  }

  ensure_passive_omp(argv);
  char err[4096] = "";
  args_t a;
  if (parse_args(&a, argc, argv, err, sizeof err) != 0) {
    fprintf(stderr, "trainer: %s\n", err);
    return 2;
  }

  /* --- environment: torchrun's variables, set by meshrun */
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1), local_rank = env_int("LOCAL_RANK", 0);
  if (rank < 0 || world < 1 || rank >= world || local_rank < 0) {
    fprintf(stderr, "trainer: bad environment RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s\n", env_text("RANK"),
            env_text("WORLD_SIZE"), env_text("LOCAL_RANK"));
    return 2;
  }
  char prefix[64];
  snprintf(prefix, sizeof prefix, "[trainer r%d/%d]", rank, world);
  log_init(prefix);
  log_set_rank(rank, world);

  /* --- plan */
  plan_t *p = calloc(1, sizeof *p);
  if (!p) return exit_error(1, "out of memory", 1);
  /* A training run checks its checkpoint directory now, not at the first save (which, with
   * checkpoint.interval 0, comes after the last step). */
  if (plan_load(p, a.plan_path, a.sets, a.nsets, err, sizeof err) != 0 ||
      plan_resolve(p, world, err, sizeof err) != 0 ||
      (!a.sample_mode && !a.export_mode && plan_check_paths(p, err, sizeof err) != 0)) {
    /* The message is already the documented one-liner "plan error: <key.path>: ...". */
    fprintf(stderr, "%s\n", err);
    free(p);
    return 2;
  }
  if (world > 1 && (a.sample_mode || a.export_mode || a.dump_init || a.dump_batches)) {
    fprintf(stderr, "trainer: 'trainer sample', 'trainer export', --dump-init and --dump-batches run in one process "
                    "(WORLD_SIZE=%d)\n", world);
    free(p);
    return 2;
  }

  /* --- export mode: our weights file to llama2.c or Hugging Face, no model built */
  if (a.export_mode) {
    interop_format_t fmt;
    int rc = 2;
    if (interop_format_parse(a.format, &fmt) || (fmt != INTEROP_LLAMA2C && fmt != INTEROP_HF))
      snprintf(err, sizeof err, "--format %s: export writes llama2c or hf", a.format);
    else if ((rc = interop_export_weights(&p->model, a.weights, fmt, a.out, err, sizeof err)) == 0)
      log_info("exported %s to %s (%s)", a.weights, a.out, interop_format_name(fmt));
    free(p);
    if (rc == 0) return 0;
    return exit_error(rc == INTEROP_EMISMATCH || rc == INTEROP_EINVAL || rc == 2 ? 2 : 1, err, 1);
  }
  /* --- device (the backend), its dtype and TF32, and the comm backend of a multi-rank run */
  backend_t *be = NULL;
  const char *comm_backend = NULL;
  {
    char why[256] = "";
    const char *comm_env = NULL;
    int rc = comm_backend_env(&comm_env, err, sizeof err);
    if (rc == 0) rc = device_open(p, local_rank, &be, err, sizeof err);
    const int on_cuda = be && strcmp(be->name, "cpu") != 0;
    if (rc == 0 && on_cuda && p->parallel.param_dtype == PLAN_DTYPE_BF16) {
      if (p->parallel.param_dtype_explicit) {
        snprintf(err, sizeof err, "parallel.mixed_precision.param_dtype bf16 is not built yet (the cuda backend trains "
                                  "in fp32): add --set parallel.mixed_precision.param_dtype=fp32");
        rc = 2;
      } else {
        log_rank0("parallel.mixed_precision.param_dtype: bf16 (the default on cuda) is not built yet; training in fp32");
      }
    }
    if (rc == 0 && !p->parallel.param_dtype_explicit) p->parallel.param_dtype = PLAN_DTYPE_FP32; /* what runs */
#ifdef MESHRUN_HAVE_CUDA
    if (rc == 0 && on_cuda) backend_cuda_set_tf32(be, p->parallel.allow_tf32);
#endif
    if (rc == 0) rc = comm_backend_choose(be->name, comm_env, world, &comm_backend, why, sizeof why, err, sizeof err);
    if (rc == 0 && world > 1) log_rank0("comm backend %s (%s)", comm_backend, why);
    if (rc) {
      backend_destroy(be);
      free(p);
      return exit_error(rc, err, 1);
    }
  }

  /* Everything below releases through the cleanup label; fail exits with fail_code. */
  int status = 1, fail_code = 1;
  int no_restart = 0;   /* the failure is a lack of space: ask meshrun not to restart */
  int final_failed = 0; /* the checkpoint after the last step failed (err holds why until the end) */
  char final_err[1024] = "";
  ckpt_writer_t *ckw = NULL;
  save_fault_t fault_save = {0};
  ckpt_group_t cgroup;
  mesh_t *mesh = NULL;
  model_t *m = NULL;
  dp_t *dp = NULL;
  model_tp_t tpo = {0}; /* lives as long as the model, which may keep a pointer to it */
  data_t data = {0};
  metrics_t metrics = {.path = p->log.metrics_file};
  FILE *dump = NULL;
  int32_t *tok = NULL, *tgt = NULL;
  char *plan_json = NULL;

  /* --- mesh: the groups every later collective runs on */
  if (world > 1) {
    int rc = mesh_setup(&mesh, p, rank, world, comm_backend, be, err, sizeof err);
    if (rc) {
      mesh_destroy(mesh);
      backend_destroy(be);
      free(p);
      return exit_error(rc, err, 1);
    }
  }
  /* Host values (the logged loss, eval sums) go through the host comm of "dp"; device tensors
   * never pass through main. */
  comm_t *dpc = mesh ? mesh_host_comm(mesh, "dp") : NULL;
  const int dp_size = dpc ? comm_size(dpc) : 1, dp_rank = dpc ? comm_rank(dpc) : 0;
  const int tp = mesh ? mesh->dims[MESH_TP] : 1;

  const int T = p->train.seq_len, B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const int steps = p->train.steps;
  /* Data before the model: a wrong path fails before a large allocation. */
  const int eval_on = p->eval.interval > 0 && p->eval.batches > 0;
  if (!a.sample_mode && data_load(&data, p, eval_on, err, sizeof err)) goto fail;
  if (!mesh) {
    if (model_create(&m, &p->model, be, B, T, p->train.decay_norms, p->train.decay_embeddings, err, sizeof err))
      goto fail;
  } else {
    tpo = (model_tp_t){.comm = tp > 1 ? mesh_comm(mesh, "tp") : NULL,
                       .sequence_parallel = p->parallel.sequence_parallel,
                       .loss_parallel = p->parallel.loss_parallel,
                       .plan = p->parallel.tp_plan,
                       .n_plan = p->parallel.n_tp_plan};
    model_opts_t opts = {.max_b = B, .max_t = T, .decay_norms = p->train.decay_norms,
                         .decay_embeddings = p->train.decay_embeddings, .tp = tp > 1 ? &tpo : NULL,
                         .no_flat_buffers = dp_is_sharded(mesh)};
    if (model_create_opts(&m, &p->model, be, &opts, err, sizeof err)) goto fail;
  }
  plan_json = plan_to_json(p);

  /* --- sample mode: weights in, text out (one process) */
  if (a.sample_mode) {
    if (weights_load(m, be, a.weights, err, sizeof err)) goto fail;
    if (generate(m, be, p, plan_is_text(p), stdout, err, sizeof err)) goto fail;
    status = 0;
    goto cleanup;
  }

  /* --- the data-parallel strategy (it owns the optimizer over this rank's range) */
  if (dp_create(&dp, m, be, mesh, p, err, sizeof err)) goto fail;

  /* --- checkpoints: resume (collective over the job), then a writer when checkpoint.dir is set */
  const ckpt_group_t *cg = NULL;
  if (mesh) {
    ckpt_group_from_comm(&cgroup, mesh_host_comm(mesh, "world")); /* host memory, whatever the device */
    cg = &cgroup;
  }
  int start_step = 0, resumed = 0;
  if ((fail_code = checkpoint_resume(p, dp, cg, world, &start_step, &resumed, err, sizeof err)) != 0) goto fail;
  fail_code = 1;
  if (p->checkpoint.dir[0]) {
    ckpt_writer_config_t wc = {.dir = p->checkpoint.dir, .keep = p->checkpoint.keep, .async = p->checkpoint.async,
                               .group = cg, .plan_json = plan_json,
                               .mesh = {mesh ? mesh->dims[MESH_DP_REPLICATE] : 1, mesh ? mesh->dims[MESH_DP_SHARD] : 1,
                                        tp}};
    ckpt_shape_from_plan(&wc.shape, &p->model);
    if (save_fault_parse(&fault_save) && fault_save.rank == rank) { /* tests only */
      wc.hook = save_fault_hook;
      wc.hook_arg = &fault_save;
    }
    if (ckpt_writer_create(&ckw, &wc, err, sizeof err)) goto fail;
  }

  /* --- initial weights (unless resumed): random, our safetensors, llama2.c or Hugging Face */
  if (resumed) {
    /* the parameters and optimizer state came from the checkpoint */
  } else if (p->model.init[0] && interop_detect(p->model.init) != INTEROP_MESHRUN) {
    if ((fail_code = weights_load_interop(m, dp, p, err, sizeof err)) != 0) goto fail;
    fail_code = 1;
  } else if (p->model.init[0]) {
    if (mesh ? weights_load_parallel(m, dp, p->model.init, err, sizeof err)
             : weights_load(m, be, p->model.init, err, sizeof err))
      goto fail;
  } else if (dp_init_params(dp, p->seed, p->model.init_std)) {
    snprintf(err, sizeof err, "%s", dp_errmsg(dp));
    goto fail;
  }
  if (a.dump_init && weights_save(m, dp, mesh, rank, a.dump_init, plan_json, 0, err, sizeof err)) goto fail;

  tok = malloc((size_t)B * T * sizeof(int32_t));
  tgt = malloc((size_t)B * T * sizeof(int32_t));
  if (!tok || !tgt) {
    snprintf(err, sizeof err, "out of memory for batches of %d x %d tokens", B, T);
    goto fail;
  }

  /* --- memory per rank (this rank's, and the largest of any rank) */
  memory_report_t mem;
  if (memory_report(dp, mesh ? mesh_host_comm(mesh, "world") : NULL, &mem)) {
    snprintf(err, sizeof err, "%s", comm_errmsg(mesh_host_comm(mesh, "world")));
    goto fail;
  }
  const size_t np = model_num_params(m);
  if (mesh)
    log_rank0("mesh dp_replicate %d x dp_shard %d x tp %d: %s; per rank: parameters %.2f MiB, gradients %.2f MiB, "
              "optimizer state %.2f MiB, working buffers %.2f MiB (max over ranks: %.2f / %.2f / %.2f / %.2f MiB)",
              mesh->dims[MESH_DP_REPLICATE], mesh->dims[MESH_DP_SHARD], tp, dp->name,
              mem.mine.param_bytes / 1048576.0, mem.mine.grad_bytes / 1048576.0, mem.mine.optim_bytes / 1048576.0,
              mem.mine.work_bytes / 1048576.0, mem.max.param_bytes / 1048576.0, mem.max.grad_bytes / 1048576.0,
              mem.max.optim_bytes / 1048576.0, mem.max.work_bytes / 1048576.0);

  /* --- outputs (rank 0) */
  if (rank == 0 && p->log.metrics_file[0]) {
    if (make_parent_dirs(p->log.metrics_file, err, sizeof err)) goto fail;
    /* A resumed run appends: the steps before the checkpoint stay; steps logged after it by the
     * run that stopped are logged again (readers take the last record of a step). */
    if (!(metrics.f = fopen(p->log.metrics_file, resumed ? "a+" : "w"))) {
      snprintf(err, sizeof err, "cannot open log.metrics_file %s: %s", p->log.metrics_file, strerror(errno));
      goto fail;
    }
    /* A killed writer's torn last line stays a line of its own (reads and writes of an update
     * stream are separated by a seek). */
    int torn = resumed && fseek(metrics.f, -1, SEEK_END) == 0 && fgetc(metrics.f) != '\n';
    fseek(metrics.f, 0, SEEK_END);
    metrics_printf(&metrics, 0,
                   "%s{\"plan\":%s,\"num_params\":%zu,\"world_size\":%d,\"tokens_per_step\":%lld,\"data_tokens\":%zu,"
                   "\"strategy\":\"%s\",\"mesh\":[%d,%d,%d],\"param_bytes\":%zu,\"grad_bytes\":%zu,\"optim_bytes\":%zu,"
                   "\"work_bytes\":%zu,\"param_bytes_max\":%zu,\"grad_bytes_max\":%zu,\"optim_bytes_max\":%zu,"
                   "\"work_bytes_max\":%zu,\"start_step\":%d}\n",
                   torn ? "\n" : "", plan_json ? plan_json : "{}", np, world,
                   (long long)p->train.global_batch_size * T, data.n_train, dp->name,
                   mesh ? mesh->dims[MESH_DP_REPLICATE] : 1, mesh ? mesh->dims[MESH_DP_SHARD] : 1, tp,
                   mem.mine.param_bytes, mem.mine.grad_bytes, mem.mine.optim_bytes, mem.mine.work_bytes,
                   mem.max.param_bytes, mem.max.grad_bytes, mem.max.optim_bytes, mem.max.work_bytes, start_step);
  }
  if (a.dump_batches && !(dump = fopen(a.dump_batches, "wb"))) {
    snprintf(err, sizeof err, "cannot open %s: %s", a.dump_batches, strerror(errno));
    goto fail;
  }

  const long long tokens_per_step = (long long)p->train.global_batch_size * T;
  log_rank0("%s: %.2fM parameters%s, %d layers, dim %d, %s data %s (%zu train / %zu val tokens), "
            "%d steps of %lld tokens (%d x %d x %d accum x %d dp), %s backend",
            p->source, (double)np / 1e6, tp > 1 ? " per tp rank" : "", p->model.n_layers, p->model.dim,
            data_format_name(data.format), data.format == PLAN_DATA_SYNTHETIC ? "" : p->data.train, data.n_train,
            data.n_val, steps, tokens_per_step, B, T, accum, dp_size, be->name);

  /* --- the loop. Step s (0-based) is logged as s + 1. */
  traffic_t traffic = {0};
  char comm_json[512];
  traffic_step(dp, mesh, &traffic, comm_json, sizeof comm_json); /* start counting here */
  const double t_loop = now_s();
  double t_in_steps = 0;
  int stopped = 0;
  int pending = 0; /* the step of the asynchronous save in flight, 0 when none */
  /* Test hook, MESHRUN_FAULT_NAN=RANK:STEP: that rank's first micro-batch of that step reports a
   * nan loss, as a rank whose data made the model diverge would (the tests check that every
   * rank then stops together). */
  int fault_nan_rank = -1, fault_nan_step = -1;
  const char *fault = getenv("MESHRUN_FAULT_NAN");
  if (fault && sscanf(fault, "%d:%d", &fault_nan_rank, &fault_nan_step) != 2) fault_nan_rank = -1;
  for (int s = start_step; s < steps; s++) {
    const double t0 = now_s();
    const double lr = optim_lr(&p->train, s);
    double loss = 0;
    dp_zero_grad(dp);
    int bad_micro = 0; /* first micro-batch of this step whose loss was nan/inf (1-based) */
    for (int micro = 0; micro < accum; micro++) {
      data_train_batch(&data, s, micro, dp_rank, dp_size, B, tok, tgt);
      if (dump && (fwrite(tok, sizeof(int32_t), (size_t)B * T, dump) != (size_t)B * T ||
                   fwrite(tgt, sizeof(int32_t), (size_t)B * T, dump) != (size_t)B * T)) {
        snprintf(err, sizeof err, "cannot write %s: %s", a.dump_batches, strerror(errno));
        goto fail;
      }
      float l = model_forward(m, tok, tgt, B, T);
      if (dp_status(dp)) {
        snprintf(err, sizeof err, "%s", dp_errmsg(dp));
        goto fail;
      }
      if (!isfinite(l) && !model_forward_ok(m)) {
        snprintf(err, sizeof err, "step %d (micro-batch %d): the forward pass failed (see the model error above)",
                 s + 1, micro + 1);
        goto fail;
      }
      /* A diverged loss is not acted on here but after the loss is averaged over dp, where every
       * rank sees it and stops at the same point: a rank leaving alone would strand its peers
       * in the gradient reduction (and in a pending checkpoint commit). */
      if (fault_nan_rank == rank && fault_nan_step == s + 1 && micro == 0) l = NAN; /* tests only */
      if (!isfinite(l) && !bad_micro) bad_micro = micro + 1;
      dp_set_sync(dp, micro == accum - 1); /* gradients are synchronized once, on the last micro-step */
      model_backward(m, 1.0f / (float)accum);
      if (dp_status(dp)) {
        snprintf(err, sizeof err, "%s", dp_errmsg(dp));
        goto fail;
      }
      loss += l;
    }
    loss /= accum;
    if (dpc && dp_size > 1) { /* the logged loss is the global batch's: the mean over dp */
      float lf = (float)loss;
      if (comm_all_reduce(dpc, &lf, 1, COMM_FLOAT32, COMM_AVG)) {
        snprintf(err, sizeof err, "%s", comm_errmsg(dpc));
        goto fail;
      }
      loss = lf;
    }
    if (!isfinite(loss)) {
      char where[64] = "on another data-parallel rank";
      if (bad_micro) snprintf(where, sizeof where, "micro-batch %d", bad_micro);
      snprintf(err, sizeof err,
               "loss is %s at step %d (%s); the model diverged: lower train.lr, raise train.warmup_steps, "
               "check model.init_std, or enable train.grad_clip",
               isnan(loss) ? "nan" : "inf", s + 1, where);
      goto fail;
    }

    double gnorm = 0;
    if (dp_grad_norm(dp, &gnorm)) {
      snprintf(err, sizeof err, "%s", dp_errmsg(dp));
      goto fail;
    }
    if (!isfinite(gnorm)) {
      snprintf(err, sizeof err, "gradient norm is %s at step %d (loss %.4f); lower train.lr or check model.init_std",
               isnan(gnorm) ? "nan" : "inf", s + 1, loss);
      goto fail;
    }
    if (dp_step(dp, lr, optim_clip_scale(gnorm, p->train.grad_clip))) {
      snprintf(err, sizeof err, "%s", dp_errmsg(dp));
      goto fail;
    }
    be->synchronize(be);

    const double dt = now_s() - t0;
    t_in_steps += dt;
    const double tps = (double)tokens_per_step / dt;
    traffic_step(dp, mesh, &traffic, comm_json, sizeof comm_json);
    metrics_step(&metrics, s + 1, loss, lr, gnorm, tps, dt * 1e3, comm_json);
    if (p->log.interval > 0 && ((s + 1) % p->log.interval == 0 || s == 0 || s + 1 == steps)) {
      char tps_s[32], eta[32];
      fmt_thousands(tps_s, sizeof tps_s, tps);
      double per_step = (now_s() - t_loop) / (s + 1 - start_step);
      fmt_duration(eta, sizeof eta, per_step * (steps - s - 1));
      log_rank0("step %d/%d | loss %.4f | lr %.2e | grad norm %.4f | %s tok/s | %.1f ms | ETA %s", s + 1, steps,
                loss, lr, gnorm, tps_s, dt * 1e3, eta);
    }
    if (eval_on && ((s + 1) % p->eval.interval == 0 || s + 1 == steps)) {
      double el = 0;
      if (evaluate(m, &data, dpc, p->eval.batches, B, T, tok, tgt, &el) || dp_status(dp)) {
        snprintf(err, sizeof err, "eval: %s", dp_status(dp) ? dp_errmsg(dp) : comm_errmsg(dpc));
        goto fail;
      }
      metrics_eval(&metrics, s + 1, el);
      log_rank0("step %d/%d | eval loss %.4f (%d batches of %d x %d)", s + 1, steps, el, p->eval.batches, B, T);
      traffic_step(dp, mesh, &traffic, comm_json, sizeof comm_json); /* eval traffic is not a step's */
    }
    /* Checkpoints: every interval steps and after the last; an async save in flight is
     * committed by the first poll that finds every rank's writer done (poll is collective:
     * every rank calls it after every step), or before the next save starts. A failed save is
     * handled by checkpoint_failed, the same way on every rank (the writer shares its verdict). */
    if (ckw) {
      const int due = s + 1 == steps || (p->checkpoint.interval > 0 && (s + 1) % p->checkpoint.interval == 0);
      int rc = 0, settled = 1;
      if (pending) {
        int64_t committed = -1;
        if (due) {
          rc = ckpt_writer_wait(ckw, err, sizeof err);
        } else {
          rc = ckpt_writer_poll(ckw, &committed, err, sizeof err);
          settled = rc != 0 || committed >= 0;
        }
        if (settled && checkpoint_failed(rc, pending, rank, &no_restart, &final_failed, pending == steps, err,
                                         sizeof err))
          goto fail;
        if (settled) pending = 0;
      }
      if (due) {
        rc = checkpoint_save(ckw, dp, p, s + 1, err, sizeof err);
        if (rc == 0 && p->checkpoint.async)
          pending = s + 1; /* in flight: its outcome comes with the commit */
        else if (checkpoint_failed(rc, s + 1, rank, &no_restart, &final_failed, s + 1 == steps, err, sizeof err))
          goto fail;
      }
      if (final_failed && !final_err[0]) snprintf(final_err, sizeof final_err, "%s", err);
      traffic_step(dp, mesh, &traffic, comm_json, sizeof comm_json); /* nor is a checkpoint's */
    }
    if (a.stop_after && s + 1 == a.stop_after && s + 1 < steps) { /* hidden: as if killed here */
      log_rank0("stopping after step %d (--stop-after)", s + 1);
      stopped = 1;
      break;
    }
  }
  if (ckw && pending) {
    int rc = ckpt_writer_wait(ckw, err, sizeof err);
    if (checkpoint_failed(rc, pending, rank, &no_restart, &final_failed, pending == steps, err, sizeof err))
      goto fail;
    if (final_failed && !final_err[0]) snprintf(final_err, sizeof final_err, "%s", err);
    pending = 0;
  }
  if (stopped) {
    if (metrics_close(&metrics, err, sizeof err)) goto fail;
    status = 0;
    goto cleanup;
  }
  if (steps > start_step) {
    char tps_s[32], total[32];
    fmt_thousands(tps_s, sizeof tps_s, (double)tokens_per_step * (steps - start_step) / t_in_steps);
    fmt_duration(total, sizeof total, now_s() - t_loop);
    log_rank0("done: %d steps in %s, %s tok/s on average", steps - start_step, total, tps_s);
  }

  /* --- final weights (every rank helps assemble them; rank 0 writes), then a sample. Under a
   * mesh every rank runs the sample's forwards (they are collective under FSDP and TP) and
   * draws the same tokens from the same seed; rank 0 prints them. */
  {
    char path[PLAN_PATH_MAX + 32];
    final_weights_path(p, path, sizeof path);
    /* Rank 0 writes the file, so its outcome is shared before anything else collective (the
     * sample's forwards): 0 saved, 1 failed, 2 failed for lack of space (st_write's errno comes
     * as text). */
    float wrc = weights_save(m, dp, mesh, rank, path, plan_json, steps, err, sizeof err) == 0 ? 0.0f
                : ckpt_msg_is_nospace(err)                                                   ? 2.0f
                                                                                             : 1.0f;
    const float mine = wrc;
    if (mesh && comm_all_reduce(mesh_host_comm(mesh, "world"), &wrc, 1, COMM_FLOAT32, COMM_MAX)) {
      snprintf(err, sizeof err, "saving the final weights: %s", comm_errmsg(mesh_host_comm(mesh, "world")));
      goto fail;
    }
    if (wrc != 0.0f) {
      if (mine == 0.0f) snprintf(err, sizeof err, "the final weights %s were not saved (rank 0 says why)", path);
      no_restart = wrc == 2.0f;
      goto fail;
    }
    log_rank0("saved %s", path);
    if (p->sample.sample_tokens > 0 && (rank == 0 || dp_is_sharded(mesh) || tp > 1)) {
      log_rank0("sample (%d tokens, temperature %.2f):", p->sample.sample_tokens, p->sample.temperature);
      FILE *out = rank == 0 ? stdout : fopen("/dev/null", "w");
      int rc = out ? generate(m, be, p, data.is_text, out, err, sizeof err) : 0;
      if (out && out != stdout) fclose(out);
      if (rc || dp_status(dp)) {
        if (dp_status(dp)) snprintf(err, sizeof err, "sample: %s", dp_errmsg(dp));
        goto fail;
      }
    }
  }
  /* The run is done; what failed without stopping it decides the exit status now. */
  if (final_failed) {
    snprintf(err, sizeof err, "the checkpoint after the last step (%d) was not saved: %s", steps, final_err);
    goto fail;
  }
  if (metrics_close(&metrics, err, sizeof err)) {
    no_restart = metrics.err == ENOSPC || metrics.err == EDQUOT;
    goto fail;
  }
  status = 0;
  goto cleanup;

fail:
  status = exit_error(fail_code, err, !no_restart);
cleanup:
  ckpt_writer_destroy(ckw); /* a save still in flight (only after a failure) is waited for */
  if (dump) fclose(dump);
  if (metrics.f) fclose(metrics.f);
  dp_destroy(dp);
  free(tok);
  free(tgt);
  data_free(&data);
  free(plan_json);
  model_destroy(m);
  backend_destroy(be);
  mesh_destroy(mesh);
  free(p);
  return status;
}
