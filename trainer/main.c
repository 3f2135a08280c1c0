/* trainer: trains a Llama model from a JSON plan, or samples text from saved weights.
 *
 *   trainer [PLAN.json] [--set key.path=value ...]                  train (no PLAN: embedded default)
 *   trainer sample [PLAN.json] --weights FILE [--set key.path=value ...]   print generated text
 *
 * Reads top to bottom: environment (RANK, WORLD_SIZE, LOCAL_RANK) -> plan -> backend -> model
 * -> data -> optimizer -> loop { accumulate micro-batch gradients, clip, AdamW, log, eval }
 * -> final weights -> a text sample. Progress goes to stderr through the log ([trainer r0/1]),
 * the sample to stdout, one JSON object per optimizer step to log.metrics_file.
 *
 * Where the final weights go: <checkpoint.dir>/final.safetensors when checkpoint.dir is set,
 * else out/<plan file name without .json>/final.safetensors ("default" for the embedded plan),
 * with the resolved plan JSON in the safetensors metadata under "plan".
 *
 * Exit codes: 0 done; 1 runtime failure (data, memory, NaN loss, I/O); 2 usage or plan error
 * (including device "cuda" in a build without it and WORLD_SIZE > 1 before the mesh is wired).
 * Startup: when OMP_WAIT_POLICY is unset the program sets it to passive and re-execs itself once
 * (see ensure_passive_omp); nothing else runs before the first step but loading the data.
 * Not here yet: the mesh (WORLD_SIZE > 1 is refused), periodic checkpoints and resume.
 * Two hidden flags serve the PyTorch oracle test: --dump-init FILE (the initial weights, as
 * safetensors) and --dump-batches FILE (every micro-batch's tokens then targets, int32, in
 * training order). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "trainer/backend.h"
#include "trainer/data.h"
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
    "       trainer --help | --version\n"
    "\n"
    "Trains a Llama model as the JSON plan says (keys: docs/plan.md); without PLAN, the embedded\n"
    "default plan (configs/demo.json). --set overrides one key, e.g. --set train.steps=50\n"
    "--set model.dim=128; values parse as JSON when they can, else as strings.\n"
    "'sample' loads weights saved by a training run and prints sample.tokens generated tokens.\n"
    "Environment: RANK, WORLD_SIZE, LOCAL_RANK (set by meshrun; default 0, 1, 0),\n"
    "OMP_NUM_THREADS (cpu threads), MESHRUN_LOG_LEVEL (error, warn, info, debug).\n"
    "Exit status: 0 done, 1 runtime failure, 2 usage or plan error.\n";

typedef struct {
  int sample_mode;
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

/* mkdir -p of the directory part of path. */
static int make_parent_dirs(const char *path, char *err, size_t errlen) {
  char buf[PLAN_PATH_MAX + 64];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
      snprintf(err, errlen, "cannot create directory %s: %s", buf, strerror(errno));
      return -1;
    }
    *p = '/';
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
  }
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
  if (a->sample_mode && !a->weights) {
    snprintf(err, errlen, "trainer sample needs --weights FILE");
    return -1;
  }
  if (!a->sample_mode && a->weights) {
    snprintf(err, errlen, "--weights is for 'trainer sample'; to start training from weights, set model.init");
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* weights: safetensors with the model's tensor names */

static int weights_save(model_t *m, backend_t *be, const char *path, const char *plan_json, int step, char *err,
                        size_t errlen) {
  size_t np = model_num_params(m);
  int nt = model_num_tensors(m);
  float *host = malloc(np * sizeof(float));
  st_tensor_t *ts = calloc((size_t)nt, sizeof *ts);
  if (!host || !ts) {
    free(host);
    free(ts);
    snprintf(err, errlen, "out of memory copying %zu parameters to save them", np);
    return -1;
  }
  be->to_host(be, host, model_params(m), np * sizeof(float));
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    ts[i].name = t->name;
    ts[i].dtype = ST_F32;
    ts[i].ndim = t->ndim;
    ts[i].shape[0] = t->shape[0];
    ts[i].shape[1] = t->ndim == 2 ? t->shape[1] : 1;
    ts[i].data = host + t->offset;
  }
  char stepbuf[32];
  snprintf(stepbuf, sizeof stepbuf, "%d", step);
  const char *meta[] = {"format", "meshrun", "plan", plan_json ? plan_json : "{}", "step", stepbuf};
  int rc = make_parent_dirs(path, err, errlen);
  if (rc == 0) rc = st_write(path, ts, nt, meta, 3, err, errlen);
  free(host);
  free(ts);
  return rc ? -1 : 0;
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

/* plan_to_json pretty-prints; JSONL and metadata want one line. Raw newlines and tabs occur
 * only as layout (inside JSON strings they are escaped), so dropping them keeps the meaning. */
static void json_one_line(char *s) {
  if (!s) return;
  char *o = s;
  for (const char *i = s; *i; i++)
    if (*i != '\n' && *i != '\t' && *i != '\r') *o++ = *i;
  *o = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* metrics: JSONL, one object per line, flushed as written so a crash keeps what was logged */

static void metrics_step(FILE *f, int step, double loss, double lr, double gnorm, double tps, double ms) {
  if (!f) return;
  fprintf(f, "{\"step\":%d,\"loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%.9g,\"tokens_per_s\":%.1f,\"step_ms\":%.3f}\n",
          step, loss, lr, gnorm, tps, ms);
  fflush(f);
}

static void metrics_eval(FILE *f, int step, double loss) {
  if (!f) return;
  fprintf(f, "{\"step\":%d,\"eval_loss\":%.9g}\n", step, loss);
  fflush(f);
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

static double evaluate(model_t *m, const data_t *d, int batches, int b, int t, int32_t *tok, int32_t *tgt) {
  double sum = 0;
  for (int k = 0; k < batches; k++) {
    data_eval_batch(d, k, b, tok, tgt);
    sum += model_forward(m, tok, tgt, b, t);
  }
  return sum / batches;
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
    fprintf(stderr, "trainer: bad environment RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s\n", getenv("RANK"),
            getenv("WORLD_SIZE"), getenv("LOCAL_RANK"));
    return 2;
  }
  char prefix[64];
  snprintf(prefix, sizeof prefix, "[trainer r%d/%d]", rank, world);
  log_init(prefix);
  log_set_rank(rank, world);

  /* --- plan */
  plan_t *p = calloc(1, sizeof *p);
  if (!p) {
    fprintf(stderr, "trainer: out of memory\n");
    return 1;
  }
  if (plan_load(p, a.plan_path, a.sets, a.nsets, err, sizeof err) != 0 ||
      plan_resolve(p, world, err, sizeof err) != 0) {
    fprintf(stderr, "trainer: %s\n", err);
    free(p);
    return 2;
  }
  if (world > 1) {
    fprintf(stderr, "trainer: WORLD_SIZE=%d: parallel plans need the mesh (not built yet); run one process\n", world);
    free(p);
    return 2;
  }
  const char *be_name = "cpu";
  if (p->device == PLAN_DEVICE_CUDA) {
#ifdef MESHRUN_HAVE_CUDA
    be_name = "cuda";
#else
    fprintf(stderr, "trainer: device \"cuda\": this trainer was built without the cuda backend; "
                    "use device \"cpu\" or \"auto\", or rebuild where nvcc is found\n");
    free(p);
    return 2;
#endif
  }

  /* Everything below releases through the cleanup label. */
  int status = 1;
  backend_t *be = NULL;
  model_t *m = NULL;
  data_t data = {0};
  optim_t opt = {0};
  FILE *metrics = NULL, *dump = NULL;
  int32_t *tok = NULL, *tgt = NULL;
  char *plan_json = NULL;
  model_tensor_t *tensors = NULL;

  const int T = p->train.seq_len, B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const int steps = p->train.steps, dp = 1, dp_rank = 0;
  if (!(be = backend_create(be_name, 0, err, sizeof err))) goto fail;
  /* Data before the model: a wrong path fails before a large allocation. */
  const int eval_on = p->eval.interval > 0 && p->eval.batches > 0;
  if (!a.sample_mode && data_load(&data, p, eval_on, err, sizeof err)) goto fail;
  if (model_create(&m, &p->model, be, B, T, p->train.decay_norms, p->train.decay_embeddings, err, sizeof err))
    goto fail;
  plan_json = plan_to_json(p);
  json_one_line(plan_json);

  /* --- sample mode: weights in, text out */
  if (a.sample_mode) {
    if (weights_load(m, be, a.weights, err, sizeof err)) goto fail;
    if (generate(m, be, p, plan_is_text(p), stdout, err, sizeof err)) goto fail;
    status = 0;
    goto cleanup;
  }

  /* --- initial weights */
  if (p->model.init[0]) {
    if (weights_load(m, be, p->model.init, err, sizeof err)) goto fail;
  } else {
    model_init_random(m, p->seed, p->model.init_std);
  }
  if (a.dump_init && weights_save(m, be, a.dump_init, plan_json, 0, err, sizeof err)) goto fail;

  tok = malloc((size_t)B * T * sizeof(int32_t));
  tgt = malloc((size_t)B * T * sizeof(int32_t));
  if (!tok || !tgt) {
    snprintf(err, sizeof err, "out of memory for batches of %d x %d tokens", B, T);
    goto fail;
  }

  /* --- optimizer over the whole flat buffer (a sharded strategy would pass its range) */
  const int nt = model_num_tensors(m);
  const size_t np = model_num_params(m);
  if (!(tensors = malloc((size_t)nt * sizeof *tensors))) {
    snprintf(err, sizeof err, "out of memory");
    goto fail;
  }
  for (int i = 0; i < nt; i++) tensors[i] = *model_tensor(m, i);
  if (optim_init(&opt, be, &p->train, tensors, nt, 0, np, err, sizeof err)) goto fail;

  /* --- outputs */
  if (p->log.metrics_file[0]) {
    if (make_parent_dirs(p->log.metrics_file, err, sizeof err)) goto fail;
    if (!(metrics = fopen(p->log.metrics_file, "w"))) {
      snprintf(err, sizeof err, "cannot open log.metrics_file %s: %s", p->log.metrics_file, strerror(errno));
      goto fail;
    }
    fprintf(metrics, "{\"plan\":%s,\"num_params\":%zu,\"world_size\":%d,\"tokens_per_step\":%lld,\"data_tokens\":%zu}\n",
            plan_json ? plan_json : "{}", np, world, (long long)p->train.global_batch_size * T, data.n_train);
    fflush(metrics);
  }
  if (a.dump_batches && !(dump = fopen(a.dump_batches, "wb"))) {
    snprintf(err, sizeof err, "cannot open %s: %s", a.dump_batches, strerror(errno));
    goto fail;
  }
  if (p->checkpoint.interval > 0 || (p->checkpoint.resume[0] && strcmp(p->checkpoint.resume, "none")))
    log_warn("checkpoint.interval and checkpoint.resume are not implemented yet; only final weights are saved");

  const long long tokens_per_step = (long long)p->train.global_batch_size * T;
  log_rank0("%s: %.2fM parameters, %d layers, dim %d, %s data %s (%zu train / %zu val tokens), "
            "%d steps of %lld tokens (%d x %d x %d accum), %s backend",
            p->source, (double)np / 1e6, p->model.n_layers, p->model.dim, data_format_name(data.format),
            data.format == PLAN_DATA_SYNTHETIC ? "" : p->data.train, data.n_train, data.n_val, steps,
            tokens_per_step, B, T, accum, be->name);

  /* --- the loop. Step s (0-based) is logged as s + 1. */
  const double t_loop = now_s();
  double t_in_steps = 0;
  for (int s = 0; s < steps; s++) {
    const double t0 = now_s();
    const double lr = optim_lr(&p->train, s);
    double loss = 0;
    model_zero_grad(m);
    for (int micro = 0; micro < accum; micro++) {
      data_train_batch(&data, s, micro, dp_rank, dp, B, tok, tgt);
      if (dump && (fwrite(tok, sizeof(int32_t), (size_t)B * T, dump) != (size_t)B * T ||
                   fwrite(tgt, sizeof(int32_t), (size_t)B * T, dump) != (size_t)B * T)) {
        snprintf(err, sizeof err, "cannot write %s: %s", a.dump_batches, strerror(errno));
        goto fail;
      }
      float l = model_forward(m, tok, tgt, B, T);
      if (!isfinite(l)) {
        snprintf(err, sizeof err,
                 "loss is %s at step %d (micro-batch %d); the model diverged: lower train.lr, raise "
                 "train.warmup_steps, check model.init_std, or enable train.grad_clip",
                 isnan(l) ? "nan" : "inf", s + 1, micro + 1);
        goto fail;
      }
      model_backward(m, 1.0f / (float)accum);
      loss += l;
    }
    loss /= accum;

    const double gnorm = sqrt(optim_grad_sumsq(&opt, model_grads(m)));
    if (!isfinite(gnorm)) {
      snprintf(err, sizeof err, "gradient norm is %s at step %d (loss %.4f); lower train.lr or check model.init_std",
               isnan(gnorm) ? "nan" : "inf", s + 1, loss);
      goto fail;
    }
    optim_step(&opt, model_params(m), model_grads(m), lr, optim_clip_scale(gnorm, p->train.grad_clip));
    be->synchronize(be);

    const double dt = now_s() - t0;
    t_in_steps += dt;
    const double tps = (double)tokens_per_step / dt;
    metrics_step(metrics, s + 1, loss, lr, gnorm, tps, dt * 1e3);
    if (p->log.interval > 0 && ((s + 1) % p->log.interval == 0 || s == 0 || s + 1 == steps)) {
      char tps_s[32], eta[32];
      fmt_thousands(tps_s, sizeof tps_s, tps);
      double per_step = (now_s() - t_loop) / (s + 1);
      fmt_duration(eta, sizeof eta, per_step * (steps - s - 1));
      log_rank0("step %d/%d | loss %.4f | lr %.2e | grad norm %.4f | %s tok/s | %.1f ms | ETA %s", s + 1, steps,
                loss, lr, gnorm, tps_s, dt * 1e3, eta);
    }
    if (eval_on && ((s + 1) % p->eval.interval == 0 || s + 1 == steps)) {
      double el = evaluate(m, &data, p->eval.batches, B, T, tok, tgt);
      metrics_eval(metrics, s + 1, el);
      log_rank0("step %d/%d | eval loss %.4f (%d batches of %d x %d)", s + 1, steps, el, p->eval.batches, B, T);
    }
  }
  if (steps > 0) {
    char tps_s[32], total[32];
    fmt_thousands(tps_s, sizeof tps_s, (double)tokens_per_step * steps / t_in_steps);
    fmt_duration(total, sizeof total, now_s() - t_loop);
    log_rank0("done: %d steps in %s, %s tok/s on average", steps, total, tps_s);
  }

  /* --- final weights, then a sample */
  if (rank == 0) {
    char path[PLAN_PATH_MAX + 32];
    final_weights_path(p, path, sizeof path);
    if (weights_save(m, be, path, plan_json, steps, err, sizeof err)) goto fail;
    log_rank0("saved %s", path);
    if (p->sample.sample_tokens > 0) {
      log_rank0("sample (%d tokens, temperature %.2f):", p->sample.sample_tokens, p->sample.temperature);
      if (generate(m, be, p, data.is_text, stdout, err, sizeof err)) goto fail;
    }
  }
  status = 0;
  goto cleanup;

fail:
  fprintf(stderr, "trainer: %s\n", err);
  status = 1;
cleanup:
  if (dump) fclose(dump);
  if (metrics) fclose(metrics);
  optim_free(&opt);
  free(tensors);
  free(tok);
  free(tgt);
  data_free(&data);
  free(plan_json);
  model_destroy(m);
  backend_destroy(be);
  free(p);
  return status;
}
