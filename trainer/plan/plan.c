/* plan: reads the JSON parallelism plan into plan_t, checks it, and writes it back out.
 *
 * One table (fields[] below) describes every key: its name, kind, where it lives in plan_t,
 * its allowed range and its default. Loading is: parse the file (or the embedded default) with
 * cJSON, apply the --set overrides to the tree, fill plan_t with the table's defaults, walk the
 * tree against the table (unknown keys, duplicates, types, ranges: the first problem in document
 * order is the one reported), fill the defaults that depend on other keys, delete the tree.
 * plan_resolve does the checks that involve several keys or the world size. plan_to_json walks
 * the same table, so a key added to the table is parsed, defaulted and serialized at once.
 *
 * It does not open data files, check that paths exist, or decide the device for "auto": main
 * and the modules that use those keys do. Messages go to the caller's buffer; nothing exits. */
#include "trainer/plan/plan.h"

#include "trainer/backend/backend.h" /* attention_names */

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"
#include "trainer/plan/pipeline.h"

/* Enums are stored through int pointers by the table code. */
_Static_assert(sizeof(plan_sched_t) == sizeof(int), "enum size");
_Static_assert(sizeof(plan_data_format_t) == sizeof(int), "enum size");
_Static_assert(sizeof(dtype_t) == sizeof(int), "enum size");

/* The embedded default: configs/demo.json, character for character in content (the unit test
 * parses both and compares, so they cannot drift). */
static const char default_json[] =
    "{\n"
    "  \"device\": \"auto\",\n"
    "  \"seed\": 1337,\n"
    "  \"model\": {\n"
    "    \"dim\": 128,\n"
    "    \"n_layers\": 4,\n"
    "    \"n_heads\": 4,\n"
    "    \"n_kv_heads\": 2,\n"
    "    \"vocab_size\": 256,\n"
    "    \"max_seq_len\": 256,\n"
    "    \"multiple_of\": 32\n"
    "  },\n"
    "  \"mesh\": { \"dp_replicate\": 1, \"dp_shard\": -1, \"tp\": 1 },\n"
    "  \"train\": {\n"
    "    \"steps\": 300,\n"
    "    \"seq_len\": 128,\n"
    "    \"micro_batch_size\": 16,\n"
    "    \"lr\": 3e-3,\n"
    "    \"min_lr\": 3e-4,\n"
    "    \"warmup_steps\": 30,\n"
    "    \"decay\": \"cosine\",\n"
    "    \"weight_decay\": 0.1,\n"
    "    \"grad_clip\": 1.0\n"
    "  },\n"
    "  \"data\": { \"train\": \"data/tinyshakespeare.txt\", \"format\": \"text\", \"val_fraction\": 0.1 },\n"
    "  \"eval\": { \"interval\": 50, \"batches\": 8 },\n"
    "  \"checkpoint\": { \"dir\": \"\", \"interval\": 0, \"resume\": \"none\" },\n"
    "  \"log\": { \"interval\": 10, \"metrics_file\": \"\" },\n"
    "  \"sample\": { \"tokens\": 200, \"temperature\": 0.8, \"prompt\": \"\\n\" }\n"
    "}\n";

const char *plan_default_json(void) { return default_json; }

/* ---- the key table ---------------------------------------------------------------------- */

typedef enum {
  F_INT,    /* int, integral JSON number in [lo, hi] */
  F_MESH,   /* int, a positive integer or -1 */
  F_U64,    /* uint64_t, integral JSON number in [0, 2^53] */
  F_DBL,    /* double in the range lo..hi, each end open or closed */
  F_BOOL,   /* int 0/1 from true/false */
  F_TRI,    /* int -1 (absent: decided by plan_resolve) or 0/1 */
  F_STR,    /* char buffer of .size bytes */
  F_PATHS,  /* char buffer of .size bytes: a string, or a list of strings kept one per line */
  F_ENUM,   /* int index into .names */
  F_CHOICE, /* char buffer of .size bytes holding one of *.choices (any string while that is NULL) */
  F_TPPLAN, /* parallel.tp_plan: object module -> style, merged over the default Llama plan */
  F_PPSPLIT, /* parallel.pp_split: array of positive integers (layer boundaries) */
  F_SECT    /* object with the keys .sub */
} fkind_t;

typedef struct field {
  const char *name;
  fkind_t kind;
  size_t off;  /* offset in plan_t */
  size_t size; /* F_STR, F_PATHS, F_CHOICE buffer size */
  double lo, hi;
  int lo_open, hi_open;
  const char *const *names; /* F_ENUM, NULL-terminated */
  const char *const *const *choices; /* F_CHOICE: where the NULL-terminated list is kept */
  double def;
  const char *sdef;
  const struct field *sub; /* F_SECT, terminated by name == NULL */
} field_t;

/* The device key's values (plan_set_devices); NULL: any string. */
static const char *const *device_names;
static const char *const sched_names[] = {"cosine", "linear", "constant", NULL};
static const char *const format_names[] = {"auto", "text", "llmc", "u16", "u32", "synthetic", NULL};
static const char *const dtype_names[] = {"fp32", "bf16", NULL};
static const char *const ac_names[] = {"none", "full", "selective", NULL};
static const char *const pp_schedule_names[] = {"gpipe", "1f1b", "interleaved_1f1b", NULL};
static const char *const cp_rotate_names[] = {"ring", "allgather", NULL};
static const char *const graphs_names[] = {"auto", "on", "off", NULL};
static const char *const style_names[] = {"colwise", "rowwise", "sequence_parallel",
                                          "prepare_module_input", "replicate", NULL};

#define O(m) offsetof(plan_t, m)
#define SZ(m) sizeof(((plan_t *)0)->m)
#define K_INT(n, m, lo_, hi_, d) {.name = n, .kind = F_INT, .off = O(m), .lo = lo_, .hi = hi_, .def = d}
#define K_MESH(n, m, d) {.name = n, .kind = F_MESH, .off = O(m), .def = d}
#define K_U64(n, m, d) {.name = n, .kind = F_U64, .off = O(m), .lo = 0, .hi = 9007199254740992.0, .def = d}
#define K_DBL(n, m, lo_, lo_open_, hi_, hi_open_, d)                                                  \
  {.name = n, .kind = F_DBL, .off = O(m), .lo = lo_, .lo_open = lo_open_, .hi = hi_,                   \
   .hi_open = hi_open_, .def = d}
#define K_BOOL(n, m, d) {.name = n, .kind = F_BOOL, .off = O(m), .def = d}
#define K_TRI(n, m) {.name = n, .kind = F_TRI, .off = O(m), .def = -1}
#define K_STR(n, m, d) {.name = n, .kind = F_STR, .off = O(m), .size = SZ(m), .sdef = d}
#define K_PATHS(n, m, d) {.name = n, .kind = F_PATHS, .off = O(m), .size = SZ(m), .sdef = d}
#define K_ENUM(n, m, names_, d) {.name = n, .kind = F_ENUM, .off = O(m), .names = names_, .def = d}
#define K_CHOICE(n, m, choices_, d)                                                                \
  {.name = n, .kind = F_CHOICE, .off = O(m), .size = SZ(m), .choices = choices_, .sdef = d}
#define K_SECT(n, sub_) {.name = n, .kind = F_SECT, .sub = sub_}
#define K_END {.name = NULL}

static const field_t model_fields[] = {
    K_INT("dim", model.dim, 1, INT_MAX, 128),
    K_INT("n_layers", model.n_layers, 1, INT_MAX, 4),
    K_INT("n_heads", model.n_heads, 1, INT_MAX, 4),
    K_INT("n_kv_heads", model.n_kv_heads, 1, INT_MAX, 0), /* absent: n_heads */
    K_INT("vocab_size", model.vocab_size, 1, INT_MAX, 256),
    K_INT("max_seq_len", model.max_seq_len, 1, INT_MAX, 1024),
    K_INT("multiple_of", model.multiple_of, 1, INT_MAX, 256),
    K_DBL("ffn_dim_multiplier", model.ffn_dim_multiplier, 0, 0, INFINITY, 0, 0),
    K_INT("hidden_dim", model.hidden_dim, 0, INT_MAX, 0),
    K_DBL("rope_theta", model.rope_theta, 0, 1, INFINITY, 0, 10000),
    K_DBL("norm_eps", model.norm_eps, 0, 1, INFINITY, 0, 1e-5),
    K_DBL("init_std", model.init_std, 0, 1, INFINITY, 0, 0.02),
    K_STR("init", model.init, ""),
    K_ENUM("attention", model.attention, attention_names, ATTN_AUTO), /* backend.h's list */
    K_END};

static const field_t mesh_fields[] = {
    K_MESH("dp_replicate", mesh.dp_replicate, 1),
    K_MESH("dp_shard", mesh.dp_shard, -1),
    K_MESH("tp", mesh.tp, 1),
    K_MESH("pp", mesh.pp, 1),
    K_MESH("cp", mesh.cp, 1),
    K_END};

static const field_t mp_fields[] = {
    K_ENUM("param_dtype", parallel.param_dtype, dtype_names, DT_BF16), /* absent: by device */
    K_ENUM("reduce_dtype", parallel.reduce_dtype, dtype_names, DT_F32),
    K_BOOL("allow_tf32", parallel.allow_tf32, 1),
    K_END};

static const field_t parallel_fields[] = {
    K_INT("zero", parallel.zero, 0, 2, 0),
    K_BOOL("reshard_after_forward", parallel.reshard_after_forward, 1),
    K_TRI("sequence_parallel", parallel.sequence_parallel),
    K_TRI("loss_parallel", parallel.loss_parallel),
    {.name = "tp_plan", .kind = F_TPPLAN},
    K_SECT("mixed_precision", mp_fields),
    K_ENUM("activation_checkpoint", parallel.activation_checkpoint, ac_names, PLAN_AC_NONE),
    K_INT("activation_checkpoint_every", parallel.activation_checkpoint_every, 1, INT_MAX, 2),
    K_BOOL("overlap", parallel.overlap, 1),
    K_ENUM("cp_rotate", parallel.cp_rotate, cp_rotate_names, PLAN_CP_RING),
    K_DBL("bucket_mb", parallel.bucket_mb, 0, 1, 1e6, 0, 25),
    K_DBL("comm_timeout_s", parallel.comm_timeout_s, 1e-3, 0, 1e6, 1, 300),
    K_INT("comm_flight_records", parallel.comm_flight_records, 0, 1 << 20, 2048), /* comm.h's COMM_FLIGHT_* */
    K_ENUM("pp_schedule", parallel.pp_schedule, pp_schedule_names, PLAN_PP_1F1B),
    K_INT("pp_microbatches", parallel.pp_microbatches, 0, INT_MAX, 0),
    K_INT("pp_stages_per_rank", parallel.pp_stages_per_rank, 0, 64, 0),
    {.name = "pp_split", .kind = F_PPSPLIT},
    K_END};

static const field_t train_fields[] = {
    K_INT("steps", train.steps, 1, INT_MAX, 1000),
    K_INT("seq_len", train.seq_len, 1, INT_MAX, 256),
    K_INT("micro_batch_size", train.micro_batch_size, 1, INT_MAX, 8),
    K_INT("global_batch_size", train.global_batch_size, 0, INT_MAX, 0),
    K_DBL("lr", train.lr, 0, 1, INFINITY, 0, 3e-4),
    K_DBL("min_lr", train.min_lr, 0, 0, INFINITY, 0, 0), /* absent: lr/10 */
    K_INT("warmup_steps", train.warmup_steps, 0, INT_MAX, 0),
    K_ENUM("decay", train.decay, sched_names, PLAN_SCHED_COSINE),
    K_DBL("weight_decay", train.weight_decay, 0, 0, INFINITY, 0, 0.1),
    K_BOOL("decay_norms", train.decay_norms, 0),
    K_BOOL("decay_embeddings", train.decay_embeddings, 0),
    K_DBL("beta1", train.beta1, 0, 1, 1, 1, 0.9),
    K_DBL("beta2", train.beta2, 0, 1, 1, 1, 0.95),
    K_DBL("eps", train.eps, 0, 1, INFINITY, 0, 1e-8),
    K_DBL("grad_clip", train.grad_clip, 0, 0, INFINITY, 0, 1.0),
    K_ENUM("cuda_graphs", train.graphs, graphs_names, PLAN_GRAPHS_AUTO),
    K_BOOL("skip_nonfinite", train.skip_nonfinite, 0),
    K_DBL("skip_loss_z", train.skip_loss_z, 0, 0, INFINITY, 0, 0),
    K_DBL("skip_grad_z", train.skip_grad_z, 0, 0, INFINITY, 0, 0),
    K_END};

static const field_t data_fields[] = {
    K_PATHS("train", data.train, ""),
    K_PATHS("val", data.val, ""),
    K_ENUM("format", data.format, format_names, PLAN_DATA_AUTO),
    K_DBL("val_fraction", data.val_fraction, 0, 0, 1, 1, 0.1),
    K_STR("tokenizer", data.tokenizer, ""),
    K_END};

static const field_t eval_fields[] = {
    K_INT("interval", eval.interval, 0, INT_MAX, 0), /* absent: steps/10 rounded, min 1 */
    K_INT("batches", eval.batches, 1, INT_MAX, 8),
    K_END};

static const field_t checkpoint_fields[] = {
    K_STR("dir", checkpoint.dir, ""),
    K_INT("interval", checkpoint.interval, 0, INT_MAX, 0),
    K_STR("resume", checkpoint.resume, "none"),
    K_INT("keep", checkpoint.keep, 0, INT_MAX, 3),
    K_BOOL("async", checkpoint.async, 0),
    K_TRI("on_signal", checkpoint.on_signal),
    K_END};

static const field_t log_fields[] = {
    K_INT("interval", log.interval, 1, INT_MAX, 1),
    K_STR("metrics_file", log.metrics_file, ""),
    K_STR("trace_file", log.trace_file, ""),
    K_STR("tensorboard_dir", log.tensorboard_dir, ""),
    K_INT("trace_steps", log.trace_steps, 1, INT_MAX, 3),
    K_DBL("peak_tflops", log.peak_tflops, 0, 0, INFINITY, 0, 0),
    K_DBL("straggler_pct", log.straggler_pct, 0, 0, INFINITY, 0, 20),
    K_END};

static const field_t sample_fields[] = {
    K_INT("tokens", sample.sample_tokens, 0, INT_MAX, 200),
    K_DBL("temperature", sample.temperature, 0, 0, INFINITY, 0, 0.8),
    K_STR("prompt", sample.prompt, "\n"),
    K_INT("top_k", sample.top_k, 0, INT_MAX, 0),
    K_DBL("top_p", sample.top_p, 0, 1, 1, 0, 1.0),
    K_END};

static const field_t root_fields[] = {
    K_CHOICE("device", device, &device_names, "auto"),
    K_U64("seed", seed, 1337),
    K_BOOL("overwrite", overwrite, 0),
    K_SECT("model", model_fields),
    K_SECT("mesh", mesh_fields),
    K_SECT("parallel", parallel_fields),
    K_SECT("train", train_fields),
    K_SECT("data", data_fields),
    K_SECT("eval", eval_fields),
    K_SECT("checkpoint", checkpoint_fields),
    K_SECT("log", log_fields),
    K_SECT("sample", sample_fields),
    K_END};

/* Tensor-parallel modules, the styles each may take, and the default Llama plan (first
 * N_DEFAULT_TP entries, in this order). "attention"/"feed_forward" take PyTorch's
 * prepare_module_input; they are accepted so plans written for PyTorch load. */
#define ST(s) (1u << (s))
static const struct {
  const char *module;
  unsigned allowed;
  plan_tp_style_t def;
} tp_modules[] = {
    {"tok_embeddings", ST(PLAN_TP_ROWWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_ROWWISE},
    {"attention_norm", ST(PLAN_TP_SEQUENCE_PARALLEL) | ST(PLAN_TP_REPLICATE), PLAN_TP_SEQUENCE_PARALLEL},
    {"attention.wq", ST(PLAN_TP_COLWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_COLWISE},
    {"attention.wk", ST(PLAN_TP_COLWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_COLWISE},
    {"attention.wv", ST(PLAN_TP_COLWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_COLWISE},
    {"attention.wo", ST(PLAN_TP_ROWWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_ROWWISE},
    {"ffn_norm", ST(PLAN_TP_SEQUENCE_PARALLEL) | ST(PLAN_TP_REPLICATE), PLAN_TP_SEQUENCE_PARALLEL},
    {"feed_forward.w1", ST(PLAN_TP_COLWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_COLWISE},
    {"feed_forward.w3", ST(PLAN_TP_COLWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_COLWISE},
    {"feed_forward.w2", ST(PLAN_TP_ROWWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_ROWWISE},
    {"norm", ST(PLAN_TP_SEQUENCE_PARALLEL) | ST(PLAN_TP_REPLICATE), PLAN_TP_SEQUENCE_PARALLEL},
    {"output", ST(PLAN_TP_COLWISE) | ST(PLAN_TP_REPLICATE), PLAN_TP_COLWISE},
    {"attention", ST(PLAN_TP_PREPARE_INPUT) | ST(PLAN_TP_REPLICATE), PLAN_TP_PREPARE_INPUT},
    {"feed_forward", ST(PLAN_TP_PREPARE_INPUT) | ST(PLAN_TP_REPLICATE), PLAN_TP_PREPARE_INPUT},
};
#define N_TP_MODULES ((int)(sizeof tp_modules / sizeof tp_modules[0]))
#define N_DEFAULT_TP 12

/* ---- small helpers ---------------------------------------------------------------------- */

static int perr(char *err, size_t errlen, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int perr(char *err, size_t errlen, const char *key, const char *fmt, ...) {
  if (err && errlen > 0) {
    int n = snprintf(err, errlen, "plan error: %s: ", key);
    if (n >= 0 && (size_t)n < errlen) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
      va_end(ap);
    }
  }
  return PLAN_EINVAL;
}

static void *at(plan_t *p, size_t off) { return (char *)p + off; }
static const void *cat(const plan_t *p, size_t off) { return (const char *)p + off; }

/* prefix.name, truncated to n bytes (key paths in messages; tables keep them short). */
static void join_path(char *out, size_t n, const char *prefix, const char *name) {
  size_t len = 0;
  for (const char *s = prefix; *s && len + 1 < n; s++) out[len++] = *s;
  if (prefix[0] && len + 1 < n) out[len++] = '.';
  for (const char *s = name; *s && len + 1 < n; s++) out[len++] = *s;
  out[len] = '\0';
}

/* "got ..." text for a JSON value in messages. */
static void describe(const cJSON *v, char *out, size_t n) {
  if (cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble) && fabs(v->valuedouble) < 1e17)
    snprintf(out, n, "%.0f", v->valuedouble);
  else if (cJSON_IsNumber(v))
    snprintf(out, n, "%.15g", v->valuedouble);
  else if (cJSON_IsString(v))
    snprintf(out, n, "\"%.60s%s\"", v->valuestring, strlen(v->valuestring) > 60 ? "..." : "");
  else if (cJSON_IsTrue(v))
    snprintf(out, n, "true");
  else if (cJSON_IsFalse(v))
    snprintf(out, n, "false");
  else if (cJSON_IsArray(v))
    snprintf(out, n, "an array");
  else if (cJSON_IsObject(v))
    snprintf(out, n, "an object");
  else
    snprintf(out, n, "null");
}

static void list_names(const char *const *names, char *out, size_t n) {
  size_t len = 0;
  out[0] = '\0';
  for (int i = 0; names[i] && len < n; i++)
    len += (size_t)snprintf(out + len, n - len, "%s%s", i ? ", " : "", names[i]);
}

static void list_fields(const field_t *f, char *out, size_t n) {
  size_t len = 0;
  out[0] = '\0';
  for (int i = 0; f[i].name && len < n; i++)
    len += (size_t)snprintf(out + len, n - len, "%s%s", i ? ", " : "", f[i].name);
}

static int is_integral(const cJSON *v) {
  return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble);
}

/* The value at root.a.b (b may be NULL), or NULL when absent or null. */
static const cJSON *lookup(const cJSON *root, const char *a, const char *b) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, a);
  if (v && b) v = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, b) : NULL;
  return v && !cJSON_IsNull(v) ? v : NULL;
}

/* ---- defaults --------------------------------------------------------------------------- */

static void set_default_tp_plan(plan_parallel_t *par) {
  par->n_tp_plan = 0;
  for (int i = 0; i < N_DEFAULT_TP; i++) {
    plan_tp_entry_t *e = &par->tp_plan[par->n_tp_plan++];
    snprintf(e->module, sizeof e->module, "%s", tp_modules[i].module);
    e->style = tp_modules[i].def;
  }
}

static void set_defaults(plan_t *p, const field_t *f) {
  for (; f->name; f++) {
    switch (f->kind) {
    case F_INT:
    case F_MESH:
    case F_BOOL:
    case F_TRI:
    case F_ENUM: *(int *)at(p, f->off) = (int)f->def; break;
    case F_U64: *(uint64_t *)at(p, f->off) = (uint64_t)f->def; break;
    case F_DBL: *(double *)at(p, f->off) = f->def; break;
    case F_STR:
    case F_CHOICE:
    case F_PATHS: snprintf((char *)at(p, f->off), f->size, "%s", f->sdef); break;
    case F_TPPLAN: set_default_tp_plan(&p->parallel); break;
    case F_PPSPLIT: p->parallel.n_pp_split = 0; break;
    case F_SECT: set_defaults(p, f->sub); break;
    }
  }
}

/* ---- reading the tree ------------------------------------------------------------------- */

static int read_object(const cJSON *obj, const field_t *fields, plan_t *p, const char *prefix,
                       char *err, size_t errlen);

static int read_tp_plan(const cJSON *obj, plan_parallel_t *par, const char *path, char *err,
                        size_t errlen) {
  char key[256], got[96], allowed[256];
  if (!cJSON_IsObject(obj)) {
    describe(obj, got, sizeof got);
    return perr(err, errlen, path, "must be an object of module name -> style, got %s", got);
  }
  for (const cJSON *c = obj->child; c; c = c->next) {
    join_path(key, sizeof key, path, c->string);
    int m = -1;
    for (int i = 0; i < N_TP_MODULES; i++)
      if (strcmp(tp_modules[i].module, c->string) == 0) m = i;
    if (m < 0) {
      size_t len = 0;
      for (int i = 0; i < N_TP_MODULES && len < sizeof allowed; i++)
        len += (size_t)snprintf(allowed + len, sizeof allowed - len, "%s%s", i ? ", " : "",
                                tp_modules[i].module);
      return perr(err, errlen, key, "unknown module (allowed: %s)", allowed);
    }
    for (const cJSON *d = obj->child; d != c; d = d->next)
      if (strcmp(d->string, c->string) == 0) return perr(err, errlen, key, "duplicate key");
    if (cJSON_IsNull(c)) continue;
    int s = -1;
    if (cJSON_IsString(c))
      for (int i = 0; style_names[i]; i++)
        if (strcmp(style_names[i], c->valuestring) == 0) s = i;
    if (s < 0 || !(tp_modules[m].allowed & ST(s))) {
      size_t len = 0;
      allowed[0] = '\0';
      for (int i = 0; style_names[i]; i++)
        if (tp_modules[m].allowed & ST(i))
          len += (size_t)snprintf(allowed + len, sizeof allowed - len, "%s%s", len ? " or " : "",
                                  style_names[i]);
      describe(c, got, sizeof got);
      return perr(err, errlen, key, "must be %s, got %s", allowed, got);
    }
    int e = 0;
    while (e < par->n_tp_plan && strcmp(par->tp_plan[e].module, c->string) != 0) e++;
    if (e == par->n_tp_plan) {
      /* N_TP_MODULES <= PLAN_TP_PLAN_MAX and modules are unique, so this always fits. */
      snprintf(par->tp_plan[e].module, sizeof par->tp_plan[e].module, "%s", c->string);
      par->n_tp_plan++;
    }
    par->tp_plan[e].style = (plan_tp_style_t)s;
  }
  return 0;
}

/* A path, or a list of paths, into one buffer with the entries a line each (a path holding a
 * newline is refused: nobody names a shard so, and the line is the separator). */
static int read_paths(const cJSON *v, const field_t *f, plan_t *p, const char *path, char *err, size_t errlen) {
  char got[96];
  describe(v, got, sizeof got);
  char *out = (char *)at(p, f->off);
  size_t len = 0;
  const cJSON *e = v;
  int list = cJSON_IsArray(v);
  if (list) {
    if (cJSON_GetArraySize(v) == 0) return perr(err, errlen, path, "must not be an empty list");
    e = v->child;
  } else if (!cJSON_IsString(v)) {
    return perr(err, errlen, path, "must be a path, a glob or a list of them, got %s", got);
  }
  out[0] = '\0';
  for (int i = 0; e; e = list ? e->next : NULL, i++) {
    if (!cJSON_IsString(e)) {
      describe(e, got, sizeof got);
      return perr(err, errlen, path, "entry %d must be a string, got %s", i, got);
    }
    if (list && !e->valuestring[0]) return perr(err, errlen, path, "entry %d is empty", i);
    if (strchr(e->valuestring, '\n')) return perr(err, errlen, path, "entry %d holds a newline", i);
    size_t k = strlen(e->valuestring);
    if (len + k + (len > 0) >= f->size)
      return perr(err, errlen, path, "must be shorter than %zu bytes in all (use a glob for many shards)", f->size);
    len += (size_t)snprintf(out + len, f->size - len, "%s%s", len > 0 ? "\n" : "", e->valuestring);
  }
  return 0;
}

static int read_field(const cJSON *v, const field_t *f, plan_t *p, const char *path, char *err,
                      size_t errlen) {
  char got[96], allowed[160];
  describe(v, got, sizeof got);
  switch (f->kind) {
  case F_SECT:
    if (!cJSON_IsObject(v)) return perr(err, errlen, path, "must be an object, got %s", got);
    return read_object(v, f->sub, p, path, err, errlen);
  case F_TPPLAN: return read_tp_plan(v, &p->parallel, path, err, errlen);
  case F_PPSPLIT: {
    plan_parallel_t *par = &p->parallel;
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) >= PLAN_PP_SPLIT_MAX) /* [] = absent: the balanced split */
      return perr(err, errlen, path, "must be a list of at most %d layer numbers (the first layer of each stage "
                  "after the first), got %s", PLAN_PP_SPLIT_MAX - 1, got);
    par->n_pp_split = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
      if (!is_integral(e) || e->valuedouble < 1 || e->valuedouble > INT_MAX) {
        describe(e, got, sizeof got);
        return perr(err, errlen, path, "entry %d must be a layer number >= 1, got %s", par->n_pp_split, got);
      }
      par->pp_split[par->n_pp_split++] = (int)e->valuedouble;
    }
    return 0;
  }
  case F_INT:
    if (!is_integral(v) || v->valuedouble < f->lo || v->valuedouble > f->hi) {
      /* past the top the whole range is the answer (an int's 2^31 - 1 is no one's guess) */
      if (f->hi < INT_MAX || (is_integral(v) && v->valuedouble > f->hi))
        return perr(err, errlen, path, "must be an integer from %.0f to %.0f%s, got %s", f->lo, f->hi,
                    f->hi == INT_MAX ? " (2^31 - 1)" : "", got);
      return perr(err, errlen, path, "must be an integer >= %.0f, got %s", f->lo, got);
    }
    *(int *)at(p, f->off) = (int)v->valuedouble;
    return 0;
  case F_MESH:
    if (!is_integral(v) || !(v->valuedouble == -1 || (v->valuedouble >= 1 && v->valuedouble <= INT_MAX)))
      return perr(err, errlen, path,
                  "must be a positive integer or -1 (the rest of WORLD_SIZE), got %s", got);
    *(int *)at(p, f->off) = (int)v->valuedouble;
    return 0;
  case F_U64:
    if (!is_integral(v) || v->valuedouble < f->lo || v->valuedouble > f->hi)
      return perr(err, errlen, path, "must be an integer from 0 to 2^53, got %s", got);
    *(uint64_t *)at(p, f->off) = (uint64_t)v->valuedouble;
    return 0;
  case F_DBL: {
    double x = v->valuedouble;
    int ok = cJSON_IsNumber(v) && isfinite(x) && (f->lo_open ? x > f->lo : x >= f->lo) &&
             (isinf(f->hi) || (f->hi_open ? x < f->hi : x <= f->hi));
    if (!ok) {
      if (isinf(f->hi))
        snprintf(allowed, sizeof allowed, "a number %s %g", f->lo_open ? ">" : ">=", f->lo);
      else
        snprintf(allowed, sizeof allowed, "a number in %c%g, %g%c", f->lo_open ? '(' : '[', f->lo,
                 f->hi, f->hi_open ? ')' : ']');
      return perr(err, errlen, path, "must be %s, got %s", allowed, got);
    }
    *(double *)at(p, f->off) = x;
    return 0;
  }
  case F_BOOL:
  case F_TRI:
    if (!cJSON_IsBool(v)) return perr(err, errlen, path, "must be true or false, got %s", got);
    *(int *)at(p, f->off) = cJSON_IsTrue(v) ? 1 : 0;
    return 0;
  case F_STR:
    if (!cJSON_IsString(v)) return perr(err, errlen, path, "must be a string, got %s", got);
    if (strlen(v->valuestring) >= f->size)
      return perr(err, errlen, path, "must be shorter than %zu bytes", f->size);
    snprintf((char *)at(p, f->off), f->size, "%s", v->valuestring);
    return 0;
  case F_PATHS: return read_paths(v, f, p, path, err, errlen);
  case F_ENUM:
    if (cJSON_IsString(v))
      for (int i = 0; f->names[i]; i++)
        if (strcmp(f->names[i], v->valuestring) == 0) {
          *(int *)at(p, f->off) = i;
          return 0;
        }
    list_names(f->names, allowed, sizeof allowed);
    return perr(err, errlen, path, "must be one of %s, got %s", allowed, got);
  case F_CHOICE: {
    const char *const *names = *f->choices;
    int known = !names;
    for (int i = 0; !known && names[i] && cJSON_IsString(v); i++) known = !strcmp(names[i], v->valuestring);
    if (!known) {
      list_names(names, allowed, sizeof allowed);
      return perr(err, errlen, path, "must be one of %s, got %s", allowed, got);
    }
    if (!cJSON_IsString(v)) return perr(err, errlen, path, "must be a string, got %s", got);
    if (strlen(v->valuestring) >= f->size) return perr(err, errlen, path, "must be shorter than %zu bytes", f->size);
    snprintf((char *)at(p, f->off), f->size, "%s", v->valuestring);
    return 0;
  }
  }
  return 0;
}

/* Walks obj's keys in document order, so the first problem in the file is the one reported. */
static int read_object(const cJSON *obj, const field_t *fields, plan_t *p, const char *prefix,
                       char *err, size_t errlen) {
  char path[256], allowed[256];
  for (const cJSON *c = obj->child; c; c = c->next) {
    join_path(path, sizeof path, prefix, c->string);
    const field_t *f = fields;
    while (f->name && strcmp(f->name, c->string) != 0) f++;
    if (!f->name) {
      list_fields(fields, allowed, sizeof allowed);
      return perr(err, errlen, path, "unknown key (allowed%s%s: %s)", prefix[0] ? " in " : "",
                  prefix, allowed);
    }
    for (const cJSON *d = obj->child; d != c; d = d->next)
      if (strcmp(d->string, c->string) == 0)
        return perr(err, errlen, path, "duplicate key");
    if (cJSON_IsNull(c)) continue; /* null = the default */
    if (read_field(c, f, p, path, err, errlen)) return PLAN_EINVAL;
  }
  return 0;
}

/* ---- --set ------------------------------------------------------------------------------ */

/* Applies "key.path=value" to the tree. Missing objects on the way are created; the key itself
 * is checked later with everything else, so an unknown key gives the same error as in a file.
 * Under parallel.tp_plan the rest of the path is one module name ("attention.wq"). */
static int apply_set(cJSON *root, const char *set, char *err, size_t errlen) {
  const char *eq = strchr(set, '=');
  char key[512];
  if (!eq || eq == set || (size_t)(eq - set) >= sizeof key)
    return perr(err, errlen, "--set", "'%s' is not key.path=value", set);
  memcpy(key, set, (size_t)(eq - set));
  key[eq - set] = '\0';
  const char *value = eq + 1;

  cJSON *node = root;
  char *seg = key;
  for (;;) {
    char *dot = strchr(seg, '.');
    int in_tp_plan = (size_t)(seg - key) == strlen("parallel.tp_plan.") &&
                     strncmp(key, "parallel.tp_plan.", strlen("parallel.tp_plan.")) == 0;
    if (!dot || in_tp_plan) break;
    *dot = '\0';
    if (!*seg) return perr(err, errlen, "--set", "'%s' has an empty key", set);
    cJSON *child = cJSON_GetObjectItemCaseSensitive(node, seg);
    if (!child || cJSON_IsNull(child)) {
      cJSON *obj = cJSON_CreateObject();
      if (!obj) return perr(err, errlen, "--set", "out of memory");
      if (child)
        cJSON_ReplaceItemInObjectCaseSensitive(node, seg, obj);
      else
        cJSON_AddItemToObject(node, seg, obj);
      child = obj;
    } else if (!cJSON_IsObject(child)) {
      return perr(err, errlen, key, "is not an object, so '%s' cannot be set", set);
    }
    *dot = '.';
    node = child;
    seg = dot + 1;
  }
  if (!*seg) return perr(err, errlen, "--set", "'%s' has an empty key", set);

  cJSON *v = cJSON_ParseWithOpts(value, NULL, 1);
  if (!v) v = cJSON_CreateString(value);
  if (!v) return perr(err, errlen, "--set", "out of memory");
  if (cJSON_GetObjectItemCaseSensitive(node, seg))
    cJSON_ReplaceItemInObjectCaseSensitive(node, seg, v);
  else
    cJSON_AddItemToObject(node, seg, v);
  return 0;
}

/* ---- load ------------------------------------------------------------------------------- */

/* A plan is a regular file of at most PLAN_FILE_MAX bytes: a device (/dev/zero), a FIFO or a
 * directory is refused before reading, and the limit also holds while reading (a file that
 * grows). */
static char *read_file(const char *path, char *err, size_t errlen) {
  char *buf;
  size_t len;
  long long size;
  int rc = fs_read_file(path, PLAN_FILE_MAX, &buf, &len, &size);
  if (rc == -EINVAL)
    perr(err, errlen, path, "not a regular file (a plan is a JSON file)");
  else if (rc == -EFBIG && size >= 0)
    perr(err, errlen, path, "%lld bytes; a plan file is at most %d MiB", size, PLAN_FILE_MAX >> 20);
  else if (rc == -EFBIG)
    perr(err, errlen, path, "more than %d MiB; a plan file is at most %d MiB", PLAN_FILE_MAX >> 20,
         PLAN_FILE_MAX >> 20);
  else if (rc == -ENOMEM)
    perr(err, errlen, path, "out of memory");
  else if (rc)
    perr(err, errlen, path, "cannot open: %s", strerror(-rc));
  if (rc) return NULL;
  if (strlen(buf) != len) {
    perr(err, errlen, path, "invalid JSON: contains a NUL byte");
    free(buf);
    return NULL;
  }
  return buf;
}

/* The files a plan reads. Relative ones written in a plan file are taken from the plan's folder,
 * so a plan runs from any working directory; --set values (and the embedded default's) from the
 * working directory, where they are typed. Both are made absolute at load. What a run writes
 * (checkpoint.dir, log files, and checkpoint.resume, which names a checkpoint of that dir)
 * stays relative to the working directory, like the out/ default: a plan may live in a
 * read-only folder. */
static const char *const input_keys[][2] = {
    {"model", "init"}, {"data", "train"}, {"data", "val"}, {"data", "tokenizer"}};
#define N_INPUT_KEYS (sizeof input_keys / sizeof input_keys[0])

/* The index in input_keys of the dotted key of len bytes ("data.train"), or -1. */
static int input_key_index(const char *key, size_t len) {
  for (size_t i = 0; i < N_INPUT_KEYS; i++) {
    size_t a = strlen(input_keys[i][0]), b = strlen(input_keys[i][1]);
    if (len == a + 1 + b && !strncmp(key, input_keys[i][0], a) && key[a] == '.' &&
        !strncmp(key + a + 1, input_keys[i][1], b))
      return (int)i;
  }
  return -1;
}

/* dir (a real path: no symlinks, no dots) joined with the relative path rel, as a new string.
 * Leading "./" and "../" of rel are taken against dir (the parent of a real directory is its
 * lexical parent); the rest of rel is kept as written. */
static cJSON *rebased(const cJSON *v, const char *dir) {
  if (!cJSON_IsString(v) || !v->valuestring[0] || v->valuestring[0] == '/') return NULL;
  const char *rel = v->valuestring;
  size_t dirlen = strlen(dir);
  for (;;) {
    if (strncmp(rel, "./", 2) == 0) {
      rel += 2;
    } else if (strncmp(rel, "../", 3) == 0 || strcmp(rel, "..") == 0) {
      while (dirlen > 1 && dir[dirlen - 1] != '/') dirlen--;
      if (dirlen > 1) dirlen--; /* the slash, except the root's */
      rel += rel[2] ? 3 : 2;
    } else {
      break;
    }
  }
  size_t k = strlen(rel);
  char *joined = malloc(dirlen + k + 2);
  if (!joined) return NULL;
  snprintf(joined, dirlen + k + 2, "%.*s%s%s", (int)dirlen, dir, dir[dirlen - 1] == '/' || !k ? "" : "/", rel);
  cJSON *r = cJSON_CreateString(joined);
  free(joined);
  return r;
}

/* Rewrites the relative input paths in the tree as absolute paths from dir, so the resolved
 * plan (metadata, --print-plan, a plan written back and read elsewhere) names the same files
 * wherever it is read. 0, or -1 when memory runs out. */
static int rebase_inputs(cJSON *root, const char *dir, unsigned *done) {
  for (size_t i = 0; i < N_INPUT_KEYS; i++) {
    cJSON *sect = cJSON_GetObjectItemCaseSensitive(root, input_keys[i][0]);
    cJSON *v = cJSON_IsObject(sect) ? cJSON_GetObjectItemCaseSensitive(sect, input_keys[i][1]) : NULL;
    cJSON *items = cJSON_IsArray(v) ? v->child : v; /* a list of shards, or one value */
    for (cJSON *e = items, *next; e; e = next) {
      next = cJSON_IsArray(v) ? e->next : NULL;
      cJSON *r = rebased(e, dir);
      if (!r) continue;
      *done |= 1u << i;
      int ok = cJSON_IsArray(v) ? cJSON_ReplaceItemViaPointer(v, e, r)
                                : cJSON_ReplaceItemInObjectCaseSensitive(sect, input_keys[i][1], r);
      if (!ok) {
        cJSON_Delete(r);
        return -1;
      }
    }
  }
  return 0;
}

/* The real path of the folder holding the plan file (malloc'ed), or of the working directory. */
static char *plan_folder(const char *plan_path) {
  const char *slash = plan_path ? strrchr(plan_path, '/') : NULL;
  char *folder = slash ? strndup(plan_path, slash == plan_path ? 1 : (size_t)(slash - plan_path)) : strdup(".");
  char *dir = folder ? realpath(folder, NULL) : NULL;
  free(folder);
  return dir;
}

/* First the plan file's own paths from its folder, then (after --set) the rest from the
 * working directory. 0, or -1 when memory runs out. */
static int absolute_inputs(cJSON *root, const char *plan_path, unsigned *done) {
  char *dir = plan_folder(plan_path);
  int rc = dir ? rebase_inputs(root, dir, done) : -1;
  free(dir);
  return rc;
}

int plan_load(plan_t *p, const char *path, const char *const *sets, int nsets, char *err,
              size_t errlen) {
  const char *name = path ? path : "(embedded default)";
  char *text = NULL;
  if (err && errlen) err[0] = '\0';
  if (path) {
    text = read_file(path, err, errlen);
    if (!text) return PLAN_EINVAL;
  }
  const char *src = text ? text : default_json;
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithOpts(src, &end, 1);
  if (!root) {
    int line = 1, col = 1;
    for (const char *c = src; end && c < end && *c; c++) {
      if (*c == '\n') {
        line++;
        col = 1;
      } else {
        col++;
      }
    }
    free(text);
    return perr(err, errlen, name, "invalid JSON at line %d, column %d", line, col);
  }
  free(text);
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return perr(err, errlen, name, "the plan must be a JSON object");
  }
  unsigned rebased = 0, ignored = 0;
  if (path && absolute_inputs(root, path, &rebased)) {
    cJSON_Delete(root);
    return perr(err, errlen, name, "cannot resolve the plan's folder: %s", strerror(errno));
  }
  for (int i = 0; i < nsets; i++) {
    if (apply_set(root, sets[i], err, errlen)) {
      cJSON_Delete(root);
      return PLAN_EINVAL;
    }
    int k = input_key_index(sets[i], strcspn(sets[i], "="));
    if (k >= 0) rebased &= ~(1u << k); /* no longer the file's */
  }
  if (absolute_inputs(root, NULL, &ignored)) {
    cJSON_Delete(root);
    return perr(err, errlen, name, "cannot resolve the working directory: %s", strerror(errno));
  }

  memset(p, 0, sizeof *p);
  set_defaults(p, root_fields);
  if (read_object(root, root_fields, p, "", err, errlen)) {
    cJSON_Delete(root);
    return PLAN_EINVAL;
  }

  /* Defaults that follow other keys, applied only where the key is absent. */
  if (!lookup(root, "model", "n_kv_heads")) p->model.n_kv_heads = p->model.n_heads;
  if (!lookup(root, "train", "min_lr")) p->train.min_lr = p->train.lr / 10;
  if (!lookup(root, "eval", "interval")) {
    p->eval.interval = (p->train.steps + 5) / 10;
    if (p->eval.interval < 1) p->eval.interval = 1;
  }
  const cJSON *par = lookup(root, "parallel", NULL);
  p->parallel.param_dtype_explicit = par && lookup(par, "mixed_precision", "param_dtype");
  if (!p->parallel.param_dtype_explicit)
    p->parallel.param_dtype = strcmp(p->device, "cpu") ? DT_BF16 : DT_F32;
  cJSON_Delete(root);
  snprintf(p->source, sizeof p->source, "%s", name);
  p->rebased = rebased;
  return 0;
}

/* ---- resolve ---------------------------------------------------------------------------- */

int plan_checkpoint_every(const plan_t *p) {
  switch (p->parallel.activation_checkpoint) {
  case PLAN_AC_FULL: return 1;
  case PLAN_AC_SELECTIVE: return p->parallel.activation_checkpoint_every;
  default: return 0;
  }
}

int plan_local_seq_len(const plan_t *p) { return p->mesh.cp > 1 ? p->train.seq_len / p->mesh.cp : p->train.seq_len; }

int plan_skips(const plan_t *p) {
  return p->train.skip_nonfinite || p->train.skip_loss_z > 0 || p->train.skip_grad_z > 0;
}

int plan_llama_hidden_dim(int dim, int multiple_of, double ffn_dim_multiplier) {
  long long hidden = 8LL * dim / 3; /* int(2 * (4 * dim) / 3) */
  if (ffn_dim_multiplier > 0) { /* clamped before the cast: a huge multiplier is refused later, not UB */
    double h = ffn_dim_multiplier * (double)hidden;
    hidden = h >= (double)INT_MAX ? INT_MAX : (long long)h;
  }
  if (multiple_of > 0) hidden = multiple_of * ((hidden + multiple_of - 1) / multiple_of);
  return hidden > INT_MAX ? INT_MAX : (int)hidden;
}

static plan_tp_style_t tp_style(const plan_t *p, const char *module) {
  for (int i = 0; i < p->parallel.n_tp_plan; i++)
    if (strcmp(p->parallel.tp_plan[i].module, module) == 0) return p->parallel.tp_plan[i].style;
  return PLAN_TP_REPLICATE;
}

/* The linears of attention (or of the feed-forward) are sharded together or not at all. */
static int check_tp_group(const plan_t *p, const char *const *mods, int n, const char *hint,
                          char *err, size_t errlen) {
  int first = tp_style(p, mods[0]) != PLAN_TP_REPLICATE;
  for (int i = 1; i < n; i++) {
    plan_tp_style_t s = tp_style(p, mods[i]);
    if ((s != PLAN_TP_REPLICATE) != first) {
      char key[160];
      snprintf(key, sizeof key, "parallel.tp_plan.%s", mods[i]);
      return perr(err, errlen, key, "%s does not match %s %s (%s)", style_names[s], mods[0],
                  style_names[tp_style(p, mods[0])], hint);
    }
  }
  return 0;
}

/* Pipeline: stages, micro-batches, the schedule's feasibility and the layer split. */
static int resolve_pp(plan_t *p, char *err, size_t errlen) {
  plan_parallel_t *par = &p->parallel;
  const plan_model_t *md = &p->model;
  const plan_train_t *t = &p->train;
  const int pp = p->mesh.pp;
  const int v = par->pp_stages_per_rank > 0 ? par->pp_stages_per_rank
                                            : par->pp_schedule == PLAN_PP_INTERLEAVED_1F1B ? 2 : 1;
  const long long seqs = (long long)t->micro_batch_size * t->grad_accum_steps; /* per step per dp rank */
  if (pp == 1 && par->pp_stages_per_rank <= 1 && par->n_pp_split == 0) {
    par->pp_stages_per_rank = 1;
    if (par->pp_microbatches == 0) par->pp_microbatches = t->grad_accum_steps;
    return 0; /* no pipeline: the schedule keys are inert */
  }
  if (pp > 1 && plan_skips(p))
    return perr(err, errlen, t->skip_nonfinite ? "train.skip_nonfinite" : t->skip_loss_z > 0 ? "train.skip_loss_z"
                : "train.skip_grad_z", "a skip is decided on the device inside the step, and a pipeline-parallel "
                "step (mesh.pp %d) runs on the host: set mesh.pp=1 or turn the train.skip_* keys off", pp);
  par->pp_stages_per_rank = v;
  if (par->pp_microbatches == 0) par->pp_microbatches = t->grad_accum_steps;
  const int mb = par->pp_microbatches, S = pp * v;
  if (S > md->n_layers)
    return perr(err, errlen, "mesh.pp", "%d ranks x parallel.pp_stages_per_rank %d = %d pipeline stages, more than "
                "model.n_layers %d (every stage needs a block)", pp, v, S, md->n_layers);
  if (S > PLAN_PP_SPLIT_MAX)
    return perr(err, errlen, "mesh.pp", "%d pipeline stages are above the supported %d", S, PLAN_PP_SPLIT_MAX);
  if (seqs % mb != 0)
    return perr(err, errlen, "parallel.pp_microbatches", "%d does not divide the %lld sequences each dp rank takes "
                "per step (train.micro_batch_size %d x %d accumulation steps)", mb, seqs, t->micro_batch_size,
                t->grad_accum_steps);
  char why[256];
  if (pp_validate((pp_schedule_t)par->pp_schedule, pp, v, mb, why, sizeof why))
    return perr(err, errlen, "parallel.pp_schedule", "%s", why);
  if (par->n_pp_split > 0) {
    if (par->n_pp_split != S - 1)
      return perr(err, errlen, "parallel.pp_split", "has %d boundaries; %d stages need %d", par->n_pp_split, S, S - 1);
    for (int i = 0; i < S - 1; i++)
      if (par->pp_split[i] <= (i ? par->pp_split[i - 1] : 0) || par->pp_split[i] >= md->n_layers)
        return perr(err, errlen, "parallel.pp_split", "entry %d (%d) must be above the one before it and below "
                    "model.n_layers %d, so every stage holds a block", i, par->pp_split[i], md->n_layers);
    return 0;
  }
  /* The balanced split, costs in blocks: norm + output cost their weights' share of a block's
   * (the matmuls dominate both); the embedding is a lookup. */
  const double HD = (double)md->dim, KD = (double)md->dim / md->n_heads * md->n_kv_heads;
  const double block = HD * md->dim * 2 + 2 * KD * md->dim + 3.0 * md->dim * md->hidden_dim;
  int first[PLAN_PP_SPLIT_MAX + 1];
  if (pp_split(md->n_layers, S, 0.0, (double)md->vocab_size * md->dim / block, first, why, sizeof why))
    return perr(err, errlen, "mesh.pp", "%s", why);
  for (int i = 0; i < S - 1; i++) par->pp_split[i] = first[i + 1];
  par->n_pp_split = S - 1;
  return 0;
}

int plan_pp_stages(const plan_t *p) {
  return p->mesh.pp * (p->parallel.pp_stages_per_rank > 0 ? p->parallel.pp_stages_per_rank : 1);
}

int plan_pp_stage_first(const plan_t *p, int s) {
  const int S = plan_pp_stages(p);
  if (s <= 0) return 0;
  if (s >= S || p->parallel.n_pp_split != S - 1) return p->model.n_layers;
  return p->parallel.pp_split[s - 1];
}

/* Mesh: at most one -1, which takes the rest of the world; then the product must match. */
static int resolve_mesh(plan_mesh_t *m, int world_size, char *err, size_t errlen) {
  int *dims[5] = {&m->pp, &m->dp_replicate, &m->dp_shard, &m->cp, &m->tp};
  int n_rest = 0;
  long long known = 1; /* saturates just past world_size: any larger product is the same error */
  for (int i = 0; i < 5; i++) {
    if (*dims[i] == -1)
      n_rest++;
    else if (__builtin_mul_overflow(known, (long long)*dims[i], &known) || known > world_size)
      known = (long long)world_size + 1;
  }
  if (n_rest > 1)
    return perr(err, errlen, "mesh", "only one of pp, dp_replicate, dp_shard, cp, tp may be -1");
  if (n_rest == 1) {
    if (known > world_size)
      return perr(err, errlen, "mesh", "the product of the entries other than -1 is more than WORLD_SIZE %d",
                  world_size);
    if (world_size % known != 0)
      return perr(err, errlen, "mesh",
                  "the product of the entries other than -1 (%lld) does not divide WORLD_SIZE %d",
                  known, world_size);
    for (int i = 0; i < 5; i++)
      if (*dims[i] == -1) *dims[i] = (int)(world_size / known);
  }
  long long prod = 1;
  for (int i = 0; i < 5; i++)
    if (__builtin_mul_overflow(prod, (long long)*dims[i], &prod) || prod > world_size) {
      prod = (long long)world_size + 1; /* saturated: reported as "more than WORLD_SIZE" below */
      break;
    }
  /* The messages name pp and cp only when the plan uses them. */
  char names[64], vals[80];
  snprintf(names, sizeof names, "%sdp_replicate*dp_shard*%stp", m->pp != 1 ? "pp*" : "", m->cp != 1 ? "cp*" : "");
  int o = m->pp != 1 ? snprintf(vals, sizeof vals, "%d*", m->pp) : 0;
  o += snprintf(vals + o, sizeof vals - (size_t)o, "%d*%d*", m->dp_replicate, m->dp_shard);
  if (m->cp != 1) o += snprintf(vals + o, sizeof vals - (size_t)o, "%d*", m->cp);
  snprintf(vals + o, sizeof vals - (size_t)o, "%d", m->tp);
  if (prod > world_size)
    return perr(err, errlen, "mesh", "%s = %s is more than WORLD_SIZE %d", names, vals, world_size);
  if (prod != world_size)
    return perr(err, errlen, "mesh", "%s = %lld does not equal WORLD_SIZE %d", names, prod, world_size);
  return 0;
}

/* Model shapes (hidden_dim by Llama's rule when the plan leaves it 0), the sequence length and
 * selective activation checkpointing against them. */
static int check_shapes(plan_t *p, char *err, size_t errlen) {
  plan_model_t *md = &p->model;
  const plan_train_t *t = &p->train;
  if (md->dim % md->n_heads != 0)
    return perr(err, errlen, "model.dim", "%d is not divisible by model.n_heads %d", md->dim,
                md->n_heads);
  if (md->n_heads % md->n_kv_heads != 0)
    return perr(err, errlen, "model.n_kv_heads", "%d does not divide model.n_heads %d (grouped-query attention)",
                md->n_kv_heads, md->n_heads);
  if ((md->dim / md->n_heads) % 2 != 0)
    return perr(err, errlen, "model.dim",
                "head dim = dim/n_heads = %d must be even (RoPE rotates pairs)", md->dim / md->n_heads);
  if (md->hidden_dim == 0)
    md->hidden_dim = plan_llama_hidden_dim(md->dim, md->multiple_of, md->ffn_dim_multiplier);
  if (t->seq_len > md->max_seq_len)
    return perr(err, errlen, "train.seq_len", "%d is above model.max_seq_len %d", t->seq_len,
                md->max_seq_len);
  if (p->parallel.activation_checkpoint == PLAN_AC_SELECTIVE &&
      p->parallel.activation_checkpoint_every > md->n_layers)
    return perr(err, errlen, "parallel.activation_checkpoint_every",
                "%d is above model.n_layers %d (selective would checkpoint no block)",
                p->parallel.activation_checkpoint_every, md->n_layers);
  return 0;
}

/* Tensor parallelism: what the tp group splits must divide by tp; then sequence and loss
 * parallelism resolved from the tp plan and checked against it. */
static int resolve_tp(plan_t *p, char *err, size_t errlen) {
  const plan_model_t *md = &p->model;
  const plan_train_t *t = &p->train;
  static const char *const attn[] = {"attention.wq", "attention.wk", "attention.wv", "attention.wo"};
  static const char *const ffn[] = {"feed_forward.w1", "feed_forward.w3", "feed_forward.w2"};
  static const char *const norms[] = {"attention_norm", "ffn_norm", "norm"};
  if (check_tp_group(p, attn, 4, "shard wq, wk, wv colwise and wo rowwise together, or replicate all four",
                     err, errlen) ||
      check_tp_group(p, ffn, 3, "shard w1, w3 colwise and w2 rowwise together, or replicate all three",
                     err, errlen))
    return PLAN_EINVAL;
  int tp = p->mesh.tp;
  if (tp > 1) {
    if (md->n_heads % tp != 0)
      return perr(err, errlen, "mesh.tp", "%d does not divide model.n_heads %d", tp, md->n_heads);
    if (md->n_kv_heads % tp != 0)
      return perr(err, errlen, "mesh.tp", "%d does not divide model.n_kv_heads %d", tp, md->n_kv_heads);
    if (md->hidden_dim % tp != 0)
      return perr(err, errlen, "mesh.tp", "%d does not divide model.hidden_dim %d", tp, md->hidden_dim);
    /* The vocabulary need not divide: the model pads it to a multiple of tp and masks the
     * padding out of the loss. */
  }

  /* Sequence parallel: the norms run on sequence shards between the sharded linears. */
  int norms_sp = 1, linears_sharded = tp_style(p, "attention.wq") != PLAN_TP_REPLICATE &&
                                      tp_style(p, "feed_forward.w1") != PLAN_TP_REPLICATE;
  for (int i = 0; i < 3; i++)
    if (tp_style(p, norms[i]) != PLAN_TP_SEQUENCE_PARALLEL) norms_sp = 0;
  if (tp == 1) {
    p->parallel.sequence_parallel = 0;
    p->parallel.loss_parallel = 0;
  }
  if (p->parallel.sequence_parallel == -1) p->parallel.sequence_parallel = norms_sp && linears_sharded;
  if (p->parallel.sequence_parallel) {
    for (int i = 0; i < 3; i++)
      if (tp_style(p, norms[i]) != PLAN_TP_SEQUENCE_PARALLEL) {
        char key[96];
        snprintf(key, sizeof key, "parallel.tp_plan.%s", norms[i]);
        return perr(err, errlen, key, "must be sequence_parallel when parallel.sequence_parallel is true");
      }
    if (!linears_sharded)
      return perr(err, errlen, "parallel.sequence_parallel",
                  "needs the attention and feed_forward linears sharded in parallel.tp_plan");
    if (t->seq_len % tp != 0)
      return perr(err, errlen, "train.seq_len", "%d is not divisible by mesh.tp %d (sequence parallel splits the sequence)",
                  t->seq_len, tp);
  }
  if (p->parallel.loss_parallel == -1) p->parallel.loss_parallel = tp_style(p, "output") == PLAN_TP_COLWISE;
  if (p->parallel.loss_parallel && tp_style(p, "output") != PLAN_TP_COLWISE)
    return perr(err, errlen, "parallel.loss_parallel", "needs parallel.tp_plan.output colwise");
  return 0;
}

/* Context parallelism cuts each sequence into 2 * cp chunks, two a rank (an early one and a late
 * one, so that the causal work is balanced). */
static int check_cp(const plan_t *p, char *err, size_t errlen) {
  const int cp = p->mesh.cp;
  if (cp == 1) return 0;
  if (p->train.seq_len % (2 * cp) != 0)
    return perr(err, errlen, "train.seq_len", "%d is not divisible by 2 * mesh.cp = %d (context parallelism cuts "
                "each sequence into 2 * cp chunks, two on each rank)", p->train.seq_len, 2 * cp);
  return 0;
}

int plan_resolve(plan_t *p, int world_size, char *err, size_t errlen) {
  plan_mesh_t *m = &p->mesh;
  plan_train_t *t = &p->train;
  int rc;
  if (err && errlen) err[0] = '\0';
  if (world_size < 1) return perr(err, errlen, "WORLD_SIZE", "must be >= 1, got %d", world_size);
  if ((rc = resolve_mesh(m, world_size, err, errlen)) || (rc = check_shapes(p, err, errlen)) ||
      (rc = resolve_tp(p, err, errlen)) || (rc = check_cp(p, err, errlen)))
    return rc;

  /* Batches: global = micro * dp * accumulation steps. */
  long long dp = (long long)m->dp_replicate * m->dp_shard;
  long long per_step = (long long)t->micro_batch_size * dp;
  if (t->global_batch_size == 0) {
    if (per_step > INT_MAX)
      return perr(err, errlen, "train.micro_batch_size", "%d * dp %lld is too large", t->micro_batch_size, dp);
    t->global_batch_size = (int)per_step;
  }
  if (t->global_batch_size % per_step != 0)
    return perr(err, errlen, "train.global_batch_size",
                "%d is not a multiple of train.micro_batch_size %d * dp %lld (dp_replicate*dp_shard) = %lld",
                t->global_batch_size, t->micro_batch_size, dp, per_step);
  t->grad_accum_steps = (int)(t->global_batch_size / per_step);
  if (resolve_pp(p, err, errlen)) return PLAN_EINVAL;

  if (t->min_lr > t->lr)
    return perr(err, errlen, "train.min_lr", "%g is above train.lr %g", t->min_lr, t->lr);
  if (!p->data.train[0] && p->data.format != PLAN_DATA_SYNTHETIC)
    return perr(err, errlen, "data.train", "required (a text or token file) unless data.format is synthetic");
  if (p->checkpoint.on_signal == -1) p->checkpoint.on_signal = p->checkpoint.dir[0] != 0;
  if (p->checkpoint.on_signal && !p->checkpoint.dir[0])
    return perr(err, errlen, "checkpoint.on_signal", "needs checkpoint.dir (where the checkpoint on a signal goes)");
  if (strcmp(p->checkpoint.resume, "auto") == 0 && !p->checkpoint.dir[0])
    return perr(err, errlen, "checkpoint.resume", "auto needs checkpoint.dir");
  if (!p->checkpoint.resume[0])
    return perr(err, errlen, "checkpoint.resume", "must be none, auto or a checkpoint path, got \"\"");
  return 0;
}

/* ---- paths ----------------------------------------------------------------------------- */

/* A hint for a missing input the plan file wrote relative to its folder. */
static const char *folder_hint(const plan_t *p, const char *key, char *buf, size_t len) {
  buf[0] = '\0';
  int i = input_key_index(key, strlen(key));
  if (i >= 0 && (p->rebased >> i & 1u)) {
    char *dir = plan_folder(p->source);
    snprintf(buf, len, " (a relative path in a plan file is taken from the plan's folder, %s/)", dir ? dir : "?");
    free(dir);
  }
  return buf;
}

/* For a missing input, where such a file comes from: llm.c shards and tokenizers are what
 * tools/prepare_data.py makes (make stories runs it for configs/stories.json); llama2.c's
 * checkpoints are published as karpathy/tinyllamas on Hugging Face. "" when nothing applies. */
static const char *origin_hint(const plan_t *p, const char *key, const char *path) {
  size_t n = strlen(path);
  int bin = n > 4 && !strcmp(path + n - 4, ".bin");
  if (!strcmp(key, "model.init") && bin)
    return "; llama2.c checkpoints such as stories260K.bin are published at "
           "huggingface.co/karpathy/tinyllamas (the README's 'Other formats' says where to put it)";
  if ((!strncmp(key, "data.", 5) && (bin || p->data.format == PLAN_DATA_LLMC)) || !strcmp(key, "data.tokenizer"))
    return "; tools/prepare_data.py makes llm.c shards and tokenizers from text (make stories runs it for "
           "configs/stories.json)";
  return "";
}

/* One input: present, and a readable regular file (dir_ok: or a directory, for model.init's
 * Hugging Face folders and data.tokenizer's). */
static int check_input(const plan_t *p, const char *key, const char *path, int dir_ok, char *err, size_t errlen) {
  char hint[PLAN_PATH_MAX + 96];
  struct stat sb;
  if (stat(path, &sb) != 0) {
    int e = errno;
    return perr(err, errlen, key, "%s: %s%s%s", path, strerror(e), folder_hint(p, key, hint, sizeof hint),
                origin_hint(p, key, path));
  }
  if (S_ISDIR(sb.st_mode) && dir_ok) return 0;
  if (!S_ISREG(sb.st_mode))
    return perr(err, errlen, key, "%s is not a regular file%s", path, dir_ok ? " or a directory" : "");
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return perr(err, errlen, key, "%s: %s", path, strerror(errno));
  close(fd);
  return 0;
}

static int check_inputs(const plan_t *p, const char *key, const char *lines, char *err, size_t errlen) {
  char **paths = NULL, bad[PLAN_PATH_MAX], hint[PLAN_PATH_MAX + 96];
  size_t n = 0;
  int rc = fs_expand_paths(lines, &paths, &n, bad, sizeof bad);
  if (rc == -ENOENT)
    return perr(err, errlen, key, "no file matches %s%s", bad, folder_hint(p, key, hint, sizeof hint));
  if (rc) return perr(err, errlen, key, "cannot expand %s: %s", bad, strerror(-rc));
  for (size_t i = 0; rc == 0 && i < n; i++) rc = check_input(p, key, paths[i], 0, err, errlen);
  fs_paths_free(paths);
  return rc;
}

int plan_check_paths(const plan_t *p, char *err, size_t errlen) {
  if (p->model.init[0] && check_input(p, "model.init", p->model.init, 1, err, errlen)) return PLAN_EINVAL;
  if (p->data.format != PLAN_DATA_SYNTHETIC) {
    if (p->data.train[0] && check_inputs(p, "data.train", p->data.train, err, errlen)) return PLAN_EINVAL;
    if (p->data.val[0] && check_inputs(p, "data.val", p->data.val, err, errlen)) return PLAN_EINVAL;
  }
  if (p->data.tokenizer[0] && check_input(p, "data.tokenizer", p->data.tokenizer, 1, err, errlen))
    return PLAN_EINVAL;
  if (!p->checkpoint.dir[0]) return 0;
  return plan_check_output_dir("checkpoint.dir", p->checkpoint.dir, "", err, errlen) ? PLAN_EINVAL : 0;
}

int plan_check_output_dir(const char *key, const char *dir, const char *why, char *err, size_t errlen) {
  struct stat sb;
  if (stat(dir, &sb) == 0 && !S_ISDIR(sb.st_mode))
    return perr(err, errlen, key, "%s exists and is not a directory%s", dir, why);
  char failed[PLAN_PATH_MAX + 64];
  int rc = fs_mkdir_p(dir, failed, sizeof failed);
  if (rc) return perr(err, errlen, key, "cannot create %s: %s%s", failed, strerror(-rc), why);
  /* A file created and removed is the one test that sees read-only mounts, ACLs and quotas,
   * for root too (access() answers root from mode bits). Named *.tmp: a crash's leftover is
   * removed by the next save like any other. */
  char probe[PLAN_PATH_MAX + 64];
  snprintf(probe, sizeof probe, "%s/.write-check-XXXXXX.tmp", dir);
  int fd = mkstemps(probe, 4);
  if (fd < 0) return perr(err, errlen, key, "%s is not writable: %s%s", dir, strerror(errno), why);
  close(fd);
  unlink(probe);
  return 0;
}

int plan_check_output_file(const char *key, const char *path, char *err, size_t errlen) {
  char dir[PLAN_PATH_MAX];
  if (fs_dirname(path, dir, sizeof dir)) return perr(err, errlen, key, "%s: path too long", path);
  if (plan_check_output_dir(key, dir, "", err, errlen)) return PLAN_EINVAL;
  struct stat sb;
  if (stat(path, &sb) == 0) {
    if (S_ISDIR(sb.st_mode)) return perr(err, errlen, key, "%s is a directory", path);
    int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC); /* writable as it is, nothing changed */
    if (fd < 0) return perr(err, errlen, key, "%s is not writable: %s", path, strerror(errno));
    close(fd);
  }
  return 0;
}

double plan_param_count(const plan_t *p) {
  const plan_model_t *m = &p->model;
  const double C = m->dim, L = m->n_layers, V = m->vocab_size, F = m->hidden_dim;
  const double kv = C / m->n_heads * m->n_kv_heads;
  return 2 * V * C + C + L * (2 * C + 2 * C * C + 2 * C * kv + 3 * C * F);
}

int plan_check_memory(const plan_t *p, double bytes, int ranks, char *err, size_t errlen) {
  if (bytes <= 0 || ranks < 1) return 0;
  const plan_mesh_t *m = &p->mesh;
  const double n = plan_param_count(p), shards = (double)m->tp * m->pp * m->dp_shard * m->cp;
  const double state = n * 6 / shards + n * 8 / (shards * m->dp_replicate);
  const double logits = m->pp > 1 ? 0 : (double)p->train.micro_batch_size * plan_local_seq_len(p) *
                                            p->model.vocab_size / m->tp * 2;
  const double need = state + logits, have = bytes / ranks;
  if (need <= have) return 0;
  const double G = 1024.0 * 1024 * 1024;
  char shared[48] = "";
  if (ranks > 1) snprintf(shared, sizeof shared, " shared by its %d ranks", ranks);
  return perr(err, errlen, "model", "one rank needs at least %.1f GiB (%.3g parameters: %.1f GiB of weights, "
              "gradients and AdamW moments over its shards; %.1f GiB of one micro-batch's logits), more than the "
              "%.1f GiB of this machine%s: shrink model or train.micro_batch_size, or shard more (mesh.dp_shard, "
              "mesh.tp, mesh.pp, mesh.cp)", need / G, n, state / G, logits / G, bytes / G, shared);
}

int plan_mesh_min_world(const plan_t *p) {
  const int e[5] = {p->mesh.dp_replicate, p->mesh.dp_shard, p->mesh.tp, p->mesh.pp, p->mesh.cp};
  long long w = 1;
  for (int i = 0; i < 5; i++)
    if (e[i] > 0 && (w *= e[i]) > INT_MAX) return INT_MAX; /* resolve names the entry */
  return (int)w;
}

int plan_check_not_there(const char *key, const char *path, const char *what, char *err, size_t errlen) {
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return 0; /* /dev/stdout, a pipe: not a result */
  return perr(err, errlen, key, "%s exists (%s) and this run starts at step 1: move it away, write elsewhere, or "
              "--set overwrite=true to replace it", path, what);
}

/* ---- serialize -------------------------------------------------------------------------- */

/* The shortest text that reads back as exactly x. cJSON's own printer accepts a 15-digit form
 * that is only approximately equal, which would break the plan_to_json -> plan_load round trip. */
static cJSON *exact_number(double x) {
  char buf[40];
  if (x == floor(x) && fabs(x) < 1e15) { /* 500000, not 5e+05 */
    snprintf(buf, sizeof buf, "%.0f", x);
    return cJSON_CreateRaw(buf);
  }
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (strtod(buf, NULL) == x) break;
  }
  return cJSON_CreateRaw(buf);
}

static cJSON *write_object(const plan_t *p, const field_t *f) {
  cJSON *obj = cJSON_CreateObject();
  for (; obj && f->name; f++) {
    cJSON *v = NULL;
    switch (f->kind) {
    case F_INT:
    case F_MESH: v = cJSON_CreateNumber(*(const int *)cat(p, f->off)); break;
    case F_U64: {
      char buf[32];
      snprintf(buf, sizeof buf, "%" PRIu64, *(const uint64_t *)cat(p, f->off));
      v = cJSON_CreateRaw(buf);
      break;
    }
    case F_DBL: v = exact_number(*(const double *)cat(p, f->off)); break;
    case F_BOOL: v = cJSON_CreateBool(*(const int *)cat(p, f->off)); break;
    case F_TRI: {
      int x = *(const int *)cat(p, f->off);
      v = x < 0 ? cJSON_CreateNull() : cJSON_CreateBool(x);
      break;
    }
    case F_STR:
    case F_CHOICE: v = cJSON_CreateString((const char *)cat(p, f->off)); break;
    case F_PATHS: {
      const char *text = (const char *)cat(p, f->off);
      if (!strchr(text, '\n')) {
        v = cJSON_CreateString(text);
        break;
      }
      v = cJSON_CreateArray();
      for (const char *a = text; v && *a;) {
        size_t k = strcspn(a, "\n");
        char entry[PLAN_PATHS_MAX];
        snprintf(entry, sizeof entry, "%.*s", (int)k, a);
        cJSON_AddItemToArray(v, cJSON_CreateString(entry));
        a += k + (a[k] == '\n');
      }
      break;
    }
    case F_ENUM: {
      int x = *(const int *)cat(p, f->off);
      int n = 0;
      while (f->names[n]) n++;
      v = cJSON_CreateString(x >= 0 && x < n ? f->names[x] : "?");
      break;
    }
    case F_TPPLAN:
      v = cJSON_CreateObject();
      for (int i = 0; v && i < p->parallel.n_tp_plan; i++) {
        int s = (int)p->parallel.tp_plan[i].style;
        cJSON_AddItemToObject(v, p->parallel.tp_plan[i].module,
                              cJSON_CreateString(s >= 0 && s <= PLAN_TP_REPLICATE ? style_names[s] : "?"));
      }
      break;
    case F_PPSPLIT:
      v = cJSON_CreateArray();
      for (int i = 0; v && i < p->parallel.n_pp_split; i++)
        cJSON_AddItemToArray(v, cJSON_CreateNumber(p->parallel.pp_split[i]));
      break;
    case F_SECT: v = write_object(p, f->sub); break;
    }
    if (!v) {
      cJSON_Delete(obj);
      return NULL;
    }
    cJSON_AddItemToObject(obj, f->name, v);
  }
  return obj;
}

char *plan_to_json(const plan_t *p) { return plan_format(p, 0); }

char *plan_format(const plan_t *p, int indented) {
  cJSON *root = write_object(p, root_fields);
  if (!root) return NULL;
  /* one line for JSONL records and metadata values; indented for a person (--print-plan) */
  char *s = indented ? cJSON_Print(root) : cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  if (!s) return NULL;
  char *out = strdup(s); /* caller frees with free(), whatever allocator cJSON was built with */
  cJSON_free(s);
  return out;
}

void plan_set_devices(const char *const *names) { device_names = names; }
