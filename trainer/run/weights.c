/* weights: full weights in and out of files (see weights.h). */
#include "trainer/run/weights.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/fs.h"
#include "common/log.h"
#include "trainer/formats/ckpt.h"
#include "trainer/formats/interop.h"
#include "trainer/formats/safetensors.h"

int weights_make_parent_dirs(const char *path, char *err, size_t errlen) {
  char failed[PLAN_PATH_MAX + 64];
  int rc = fs_mkdir_parent(path, failed, sizeof failed);
  if (rc) {
    return err_set(err, errlen, -1, "cannot create directory %s: %s", failed, strerror(-rc));
  }
  return 0;
}

/* Elements of tensor t's full (unsplit) form. */
static size_t full_numel(const model_tensor_t *t) {
  return t->full_shape[0] > 0 ? (size_t)t->full_shape[0] * (size_t)(t->ndim == 2 ? t->full_shape[1] : 1) : t->numel;
}

/* Under pp, rank 0 holds only the first stage's tensors: every other stage's exporter (its
 * (0, 0, 0) rank, in the same pp group as rank 0) broadcasts its tensors over that group in
 * turn, names and shapes first, and rank 0 adds them to the file's list. The bytes travel as
 * float32 elements (broadcast moves them untouched). *extra: what rank 0 allocated for them. */
typedef struct {
  char name[96];
  int32_t ndim, rows, cols;
} wire_tensor_t;

static int bcast(comm_t *c, void *buf, size_t bytes, int root, char *err, size_t errlen) {
  if (comm_broadcast(c, buf, bytes / 4, DT_F32, root) == 0) return 0;
  return err_set(err, errlen, -1, "saving weights: gathering the pipeline stages' tensors: %s", comm_errmsg(c));
}

static int gather_stages(comm_t *ppc, st_tensor_t **ts, int *nt, float **extra, char **names, char *err,
                         size_t errlen) {
  const int q = comm_rank(ppc), Q = comm_size(ppc);
  for (int k = 1; k < Q; k++) {
    int32_t hdr[3] = {0, 0, 0}; /* tensors, floats (low and high 31 bits) */
    size_t total = 0;
    for (int i = 0; q == k && i < *nt; i++) total += (size_t)(*ts)[i].shape[0] * (size_t)(*ts)[i].shape[1];
    hdr[0] = *nt;
    hdr[1] = (int32_t)(total & 0x7fffffff);
    hdr[2] = (int32_t)(total >> 31);
    if (bcast(ppc, hdr, sizeof hdr, k, err, errlen)) return -1;
    const int n = hdr[0];
    total = (size_t)hdr[1] | (size_t)hdr[2] << 31;
    wire_tensor_t *w = calloc((size_t)n, sizeof *w);
    float *data = q == k ? NULL : malloc((total ? total : 1) * sizeof(float));
    if (!w || (q != k && !data)) {
      free(w);
      free(data);
      return err_set(err, errlen, -1, "out of memory gathering %zu parameters of pipeline stage rank %d", total, k);
    }
    for (int i = 0; q == k && i < n; i++) {
      w[i] = (wire_tensor_t){.ndim = (*ts)[i].ndim, .rows = (int32_t)(*ts)[i].shape[0],
                             .cols = (int32_t)(*ts)[i].shape[1]};
      snprintf(w[i].name, sizeof w[i].name, "%s", (*ts)[i].name);
    }
    int rc = bcast(ppc, w, (size_t)n * sizeof *w, k, err, errlen);
    /* the sender's tensors are contiguous in its host buffer, in list order (weights_save) */
    if (rc == 0 && total) rc = bcast(ppc, q == k ? (void *)(*ts)[0].data : data, total * sizeof(float), k, err, errlen);
    if (rc == 0 && q == 0) {
      st_tensor_t *grown = realloc(*ts, (size_t)(*nt + n) * sizeof **ts);
      char *nm = realloc(names[k], (size_t)n * sizeof w->name);
      if (!grown || !nm) {
        if (grown) *ts = grown;
        free(nm);
        names[k] = NULL;
        err_set(err, errlen, 0, "out of memory gathering the pipeline stages' tensors");
        rc = -1;
      } else {
        *ts = grown;
        names[k] = nm;
        size_t at = 0;
        for (int i = 0; i < n; i++) {
          memcpy(nm + (size_t)i * sizeof w->name, w[i].name, sizeof w->name);
          (*ts)[*nt + i] = (st_tensor_t){.name = nm + (size_t)i * sizeof w->name, .dtype = ST_F32, .ndim = w[i].ndim,
                                         .shape = {w[i].rows, w[i].cols}, .data = data + at};
          at += (size_t)w[i].rows * (size_t)w[i].cols;
        }
        *nt += n;
        extra[k] = data;
        data = NULL;
      }
    }
    free(w);
    free(data);
    if (rc) return -1;
  }
  return 0;
}

/* Each unit is gathered across dp_shard (dp_unit_open) and each tensor assembled across tp
 * (model_export_tensor); replicas other than the first (dp_replicate coordinate > 0) hold the
 * same values and return at once. Under pp each stage does this for its own tensors, and rank 0
 * collects the others' (gather_stages). */
int weights_save(model_t *m, dp_t *dp, const mesh_t *mesh, int rank, const char *path, const char *plan_json,
                 int step, char *err, size_t errlen) {
  const int r = mesh ? mesh->coord[MESH_DP_REPLICATE] : 0, sh = mesh ? mesh->coord[MESH_DP_SHARD] : 0;
  const int tp = mesh ? mesh->dims[MESH_TP] : 1;
  if (r != 0) return 0;
  const int cp = mesh ? mesh->coord[MESH_CP] : 0;
  const int exporter = sh == 0 && cp == 0; /* the tp group of shard 0 assembles; rank 0 is one of them */
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
    return err_set(err, errlen, -1, "out of memory copying %zu parameters to save them", total);
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
      err_set(err, errlen, 0, "saving weights: %s", dp_errmsg(dp));
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
        err_set(err, errlen, 0, "saving weights: assembling %s across tp failed (see the log)", t->name);
        rc = -1;
      }
    }
  }
  /* the pipeline: the (0, 0, 0) ranks of every stage, one pp group with rank 0 in it */
  const int Q = mesh ? mesh->dims[MESH_PP] : 1;
  float *extra[PLAN_PP_SPLIT_MAX] = {0};
  char *names[PLAN_PP_SPLIT_MAX] = {0};
  int nfile = nt;
  if (rc == 0 && Q > 1 && exporter && mesh->coord[MESH_TP] == 0)
    rc = gather_stages(mesh_host_comm(mesh, "pp"), &ts, &nfile, extra, names, err, errlen);
  if (rc == 0 && rank == 0) {
    char stepbuf[32];
    snprintf(stepbuf, sizeof stepbuf, "%d", step);
    const char *meta[] = {"format", "meshrun", "plan", plan_json ? plan_json : "{}", "step", stepbuf};
    rc = weights_make_parent_dirs(path, err, errlen);
    if (rc == 0) rc = st_write(path, ts, nfile, meta, 3, err, errlen);
  }
  for (int k = 0; k < PLAN_PP_SPLIT_MAX; k++) {
    free(extra[k]);
    free(names[k]);
  }
  free(host);
  free(unit);
  free(ts);
  return rc ? -1 : 0;
}

/* ------------------------------------------------------------------ any weights, read-only */

struct weights_file {
  interop_format_t fmt; /* INTEROP_MESHRUN for ours and our checkpoints */
  char path[PLAN_PATH_MAX];
  interop_file_t *ix;  /* llama2.c, HF */
  st_file_t *st;       /* ours */
  ckpt_t *ck;          /* a checkpoint: its "param" tensors */
  plan_model_t cfg;    /* the file's model */
  int has_cfg;         /* 0: our file without a plan in its metadata */
  plan_data_t data;    /* ours: the plan's data section */
  int has_data;
  char tokenizer[PLAN_PATH_MAX + 32]; /* HF: <folder>/tokenizer.json when present */
};

/* Our file's model and data from the plan JSON in its metadata (resolved when saved, so
 * hidden_dim is explicit and paths are absolute): has_cfg stays 0 without a usable model
 * section; the data section is optional. */
static void parse_plan_meta(weights_file_t *f, const char *json) {
  cJSON *root = json ? cJSON_Parse(json) : NULL;
  const cJSON *mo = cJSON_GetObjectItemCaseSensitive(root, "model");
  int rc = cJSON_IsObject(mo) ? 0 : -1;
  plan_model_t *c = &f->cfg;
  const struct {
    const char *key;
    int *dst;
  } ints[] = {{"dim", &c->dim},           {"n_layers", &c->n_layers},       {"n_heads", &c->n_heads},
              {"n_kv_heads", &c->n_kv_heads}, {"vocab_size", &c->vocab_size}, {"max_seq_len", &c->max_seq_len},
              {"hidden_dim", &c->hidden_dim}, {"multiple_of", &c->multiple_of}};
  for (size_t i = 0; i < sizeof ints / sizeof ints[0] && rc == 0; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(mo, ints[i].key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > INT32_MAX) rc = -1;
    else *ints[i].dst = (int)v->valuedouble;
  }
  const struct {
    const char *key;
    double *dst;
  } dbls[] = {{"rope_theta", &c->rope_theta}, {"norm_eps", &c->norm_eps}, {"init_std", &c->init_std},
              {"ffn_dim_multiplier", &c->ffn_dim_multiplier}};
  for (size_t i = 0; i < sizeof dbls / sizeof dbls[0] && rc == 0; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(mo, dbls[i].key);
    if (cJSON_IsNumber(v)) *dbls[i].dst = v->valuedouble;
  }
  f->has_cfg = rc == 0;
  /* how samples of this model print: the data it was trained on, and its tokenizer */
  static const char *const formats[] = {"auto", "text", "llmc", "u16", "u32", "synthetic"};
  const cJSON *da = cJSON_GetObjectItemCaseSensitive(root, "data");
  const cJSON *fm = cJSON_GetObjectItemCaseSensitive(da, "format");
  const cJSON *tr = cJSON_GetObjectItemCaseSensitive(da, "train");
  if (cJSON_IsArray(tr)) tr = cJSON_GetArrayItem(tr, 0); /* a list of shards: the first tells */
  const cJSON *tk = cJSON_GetObjectItemCaseSensitive(da, "tokenizer");
  for (size_t i = 0; cJSON_IsString(fm) && i < sizeof formats / sizeof formats[0]; i++)
    if (!strcmp(fm->valuestring, formats[i])) {
      f->data.format = (plan_data_format_t)i;
      f->has_data = 1;
    }
  if (f->has_data && cJSON_IsString(tr)) snprintf(f->data.train, sizeof f->data.train, "%s", tr->valuestring);
  if (f->has_data && cJSON_IsString(tk))
    snprintf(f->data.tokenizer, sizeof f->data.tokenizer, "%s", tk->valuestring);
  cJSON_Delete(root);
}

/* The HF folder of path (itself, or the folder of a file in it). */
static void hf_folder(const char *path, char *dir, size_t len) {
  struct stat sb;
  snprintf(dir, len, "%s", path);
  if (stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode)) return;
  char *slash = strrchr(dir, '/');
  if (slash) *slash = 0;
  else snprintf(dir, len, ".");
}

/* What a folder holds, by the names in it: a checkpoint step folder (metadata.json, or a shard
 * without it: a damaged one), an HF folder (config.json), a checkpoint directory (latest, or a
 * step-<N> folder), or none of these. */
typedef enum { FOLDER_NONE, FOLDER_STEP, FOLDER_HF, FOLDER_CKPT } folder_kind_t;

static int has_entry(const char *dir, const char *name, int want_dir) {
  char p[PLAN_PATH_MAX + 64];
  struct stat sb;
  snprintf(p, sizeof p, "%s/%s", dir, name);
  return stat(p, &sb) == 0 && (want_dir ? S_ISDIR(sb.st_mode) : S_ISREG(sb.st_mode));
}

static folder_kind_t folder_kind(const char *dir) {
  if (has_entry(dir, "metadata.json", 0) || has_entry(dir, "shard-0.safetensors", 0)) return FOLDER_STEP;
  if (has_entry(dir, "config.json", 0)) return FOLDER_HF;
  if (has_entry(dir, "latest", 0)) return FOLDER_CKPT;
  DIR *d = opendir(dir);
  folder_kind_t kind = FOLDER_NONE;
  for (struct dirent *e; d && kind == FOLDER_NONE && (e = readdir(d));) {
    const char *n = e->d_name;
    if (strncmp(n, "step-", 5) || !n[5] || strspn(n + 5, "0123456789") != strlen(n + 5)) continue;
    if (has_entry(dir, n, 1)) kind = FOLDER_CKPT;
  }
  if (d) closedir(d);
  return kind;
}

/* A checkpoint (trainer/formats/ckpt), whatever world and plan saved it: a step folder as it is, or a
 * checkpoint directory's newest intact checkpoint (as checkpoint.resume=auto picks it: latest,
 * then older ones, the damaged skipped with a warning). Its plan gives the model and the data. */
static int open_checkpoint(weights_file_t *f, int step_folder, char *err, size_t errlen) {
  char msg[1024];
  int rc = ckpt_open(&f->ck, f->path, step_folder ? f->path : "auto", NULL, NULL, msg, sizeof msg);
  if (rc) {
    /* "no intact checkpoint in D:" goes on with a line per checkpoint, each already a warning */
    char *nl = strchr(msg, '\n');
    if (nl) {
      if (nl > msg && nl[-1] == ':') nl--;
      snprintf(nl, sizeof msg - (size_t)(nl - msg), " (see the warnings above)");
    }
    return err_set(err, errlen, rc == CKPT_EIO || rc == CKPT_ENOMEM ? 1 : 2, "%s", msg);
  }
  const ckpt_meta_t *meta = ckpt_meta(f->ck);
  if (!step_folder)
    log_info("weights: %s: the newest intact checkpoint is %s (step %lld)", f->path, meta->path,
             (long long)meta->state.step);
  parse_plan_meta(f, meta->plan_json);
  return 0;
}

int weights_open(weights_file_t **out, const char *path, char *err, size_t errlen) {
  *out = NULL;
  struct stat sb;
  if (!path || !*path) return err_set(err, errlen, 2, "weights error: no weights path given");
  if (strlen(path) >= PLAN_PATH_MAX) return err_set(err, errlen, 2, "weights error: path longer than %d bytes",
                                                    PLAN_PATH_MAX);
  if (stat(path, &sb) != 0) return err_set(err, errlen, 1, "weights error: %s: %s", path, strerror(errno));
  const folder_kind_t kind = S_ISDIR(sb.st_mode) ? folder_kind(path) : FOLDER_NONE;
  if (S_ISDIR(sb.st_mode) && kind == FOLDER_NONE)
    return err_set(err, errlen, 2, "weights error: %s is neither a Hugging Face folder (config.json, "
                   "model.safetensors) nor a checkpoint (a step-<N> folder with metadata.json, or the checkpoint "
                   "directory that holds them)", path);
  weights_file_t *f = calloc(1, sizeof *f);
  if (!f) return err_set(err, errlen, 1, "weights error: %s: out of memory", path);
  snprintf(f->path, sizeof f->path, "%s", path);
  f->fmt = kind == FOLDER_STEP || kind == FOLDER_CKPT ? INTEROP_MESHRUN : interop_detect(path);
  int rc = 0;
  if (kind == FOLDER_STEP || kind == FOLDER_CKPT) {
    rc = open_checkpoint(f, kind == FOLDER_STEP, err, errlen);
  } else if (f->fmt == INTEROP_MESHRUN) {
    char sterr[512];
    int st = st_open(&f->st, path, sterr, sizeof sterr);
    if (st) rc = err_set(err, errlen, st == ST_EIO || st == ST_ENOMEM ? 1 : 2, "weights error: %s", sterr);
    else parse_plan_meta(f, st_metadata(f->st, "plan"));
  } else {
    int ix = interop_open(&f->ix, path, f->fmt, err, errlen);
    if (ix == INTEROP_EIO || ix == INTEROP_ENOMEM) {
      rc = 1;
    } else if (ix && f->fmt == INTEROP_LLAMA2C) { /* llama2.c is the guess for any other file */
      char why[1024];
      snprintf(why, sizeof why, "%s", err);
      rc = err_set(err, errlen, 2, "weights error: %s is not our safetensors, a Hugging Face folder or a llama2.c "
                   "version 0 file that we can read (as llama2.c: %s)", path, why);
    } else if (ix) {
      rc = 2;
    } else {
      f->cfg = *interop_config(f->ix);
      f->has_cfg = 1;
    }
    if (rc == 0 && f->fmt == INTEROP_HF) {
      char dir[PLAN_PATH_MAX];
      hf_folder(path, dir, sizeof dir);
      snprintf(f->tokenizer, sizeof f->tokenizer, "%s/tokenizer.json", dir);
      if (access(f->tokenizer, R_OK) != 0) f->tokenizer[0] = 0;
    }
  }
  if (rc) {
    weights_close(f);
    return rc;
  }
  f->cfg.init[0] = 0;
  *out = f;
  return 0;
}

void weights_close(weights_file_t *f) {
  if (!f) return;
  interop_close(f->ix);
  st_close(f->st);
  ckpt_close(f->ck);
  free(f);
}

const char *weights_format_name(const weights_file_t *f) {
  return f->ck ? "checkpoint" : interop_format_name(f->fmt);
}
const plan_model_t *weights_model(const weights_file_t *f) { return f->has_cfg ? &f->cfg : NULL; }
const plan_data_t *weights_data(const weights_file_t *f) { return f->has_data ? &f->data : NULL; }
const char *weights_tokenizer(const weights_file_t *f) { return f->tokenizer[0] ? f->tokenizer : NULL; }

/* The one check every tensor read from a weights file passes (our file's in place, the other
 * formats' as copied out): a NaN or an infinity is an input error (2), named by the tensor and
 * its element in our layout. A checkpoint's values were checked when it opened (trainer/formats/ckpt). */
static int check_finite(const weights_file_t *f, const char *name, const float *x, size_t numel, char *err,
                        size_t errlen) {
  size_t at;
  const char *what;
  if (st_check_finite(x, numel, &at, &what) == 0) return 0;
  return err_set(err, errlen, 2, "weights error: %s: tensor %s element %zu is %s (not a finite number)", f->path, name,
                 at, what);
}

/* Our file's tensor in place (the mapping lives until weights_close), checked. */
static int read_ours(weights_file_t *f, const char *name, size_t numel, const float **out, char *err, size_t errlen) {
  const st_tensor_t *s = st_find(f->st, name);
  if (!s) return err_set(err, errlen, 2, "weights error: %s: no tensor %s (is it from a model of this plan?)", f->path,
                         name);
  if (s->dtype != ST_F32 || st_numel(s) != numel)
    return err_set(err, errlen, 2, "weights error: %s: tensor %s has %zu %s elements, the model wants %zu F32", f->path,
                   name, st_numel(s), s->dtype == ST_F32 ? "F32" : "I32", numel);
  *out = s->data;
  return check_finite(f, name, *out, numel, err, errlen);
}

int weights_read(weights_file_t *f, const char *name, float *dst, size_t numel, char *err, size_t errlen) {
  if (f->ck) return ckpt_read_tensor(f->ck, "param", name, dst, numel, err, errlen) ? 2 : 0;
  if (f->ix) {
    if (interop_read_tensor(f->ix, name, dst, numel, err, errlen)) return 2;
    return check_finite(f, name, dst, numel, err, errlen);
  }
  const float *src = NULL;
  int rc = read_ours(f, name, numel, &src, err, errlen);
  if (rc == 0) memcpy(dst, src, numel * sizeof(float));
  return rc;
}

int weights_resolve_model(const weights_file_t *f, const plan_model_t *plan, int plan_file, const char *const *sets,
                          int nsets, plan_model_t *out, char *err, size_t errlen) {
  const plan_model_t *fm = weights_model(f);
  char msg[256];
  if (plan_file) {
    *out = *plan; /* our file without metadata: its tensors are checked as they load */
    if (fm && interop_model_diff(fm, plan, NULL, msg, sizeof msg))
      return err_set(err, errlen, 2, "weights error: %s: %s", f->path, msg);
    return 0;
  }
  if (!fm)
    return err_set(err, errlen, 2, "weights error: %s: no plan in its metadata says the model's shape; name the plan "
                   "file it was trained with", f->path);
  *out = *fm;
  for (int i = 0; i < nsets; i++) {
    char key[64];
    const char *eq = strchr(sets[i], '=');
    size_t n = eq ? (size_t)(eq - sets[i]) : 0;
    if (n <= 6 || n - 6 >= sizeof key || strncmp(sets[i], "model.", 6)) continue;
    memcpy(key, sets[i] + 6, n - 6);
    key[n - 6] = 0;
    if (!strcmp(key, "max_seq_len")) out->max_seq_len = plan->max_seq_len;
    else if (interop_model_diff(fm, plan, key, msg, sizeof msg))
      return err_set(err, errlen, 2, "weights error: %s: %s", f->path, msg);
  }
  return 0;
}

/* The largest full tensor of m, in floats: the size of a read buffer. */
static size_t max_full_numel(model_t *m) {
  size_t fmax = 1;
  for (int i = 0; i < model_num_tensors(m); i++)
    if (full_numel(model_tensor(m, i)) > fmax) fmax = full_numel(model_tensor(m, i));
  return fmax;
}

int weights_load_file(model_t *m, weights_file_t *f, char *err, size_t errlen) {
  const size_t fmax = max_full_numel(m);
  float *buf = malloc(fmax * sizeof(float));
  if (!buf) return err_set(err, errlen, 1, "weights error: %s: out of memory (%zu floats)", f->path, fmax);
  int rc = 0;
  for (int i = 0; i < model_num_tensors(m) && rc == 0; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    rc = weights_read(f, t->name, buf, full_numel(t), err, errlen);
    if (rc == 0) model_import_tensor(m, i, buf);
  }
  free(buf);
  return rc;
}

/* model.init through the strategy, unit by unit, so it works under every one (dp may be a
 * serial one): every rank reads the file and keeps its part (its tp slice through
 * model_import_tensor, then its FSDP shard through dp_unit_commit). */
static int load_units(model_t *m, dp_t *dp, weights_file_t *f, char *err, size_t errlen) {
  const int nt = model_num_tensors(m), nu = model_num_units(m);
  const size_t fmax = max_full_numel(m);
  float *buf = malloc(fmax * sizeof(float));
  int rc = buf ? 0 : err_set(err, errlen, 1, "weights error: %s: out of memory (%zu floats)", f->path, fmax);
  for (int u = 0; u < nu && rc == 0; u++) {
    if (dp_unit_open(dp, u)) {
      rc = err_set(err, errlen, 1, "loading %s: %s", f->path, dp_errmsg(dp));
      break;
    }
    for (int i = 0; i < nt && rc == 0; i++) {
      const model_tensor_t *t = model_tensor(m, i);
      if (t->unit != u) continue;
      rc = weights_read(f, t->name, buf, full_numel(t), err, errlen);
      if (rc == 0) model_import_tensor(m, i, buf);
    }
    if (rc == 0) dp_unit_commit(dp, u);
  }
  free(buf);
  return rc;
}

/* model.init takes weights files; a checkpoint (refused before it is opened, which verifies every
 * file) carries its run on through checkpoint.resume. A llama2.c file or a Hugging Face folder is
 * checked against the plan's model first (a mismatch returns 2); our file's tensors are checked
 * as they load. */
int weights_init(model_t *m, dp_t *dp, const plan_t *p, char *err, size_t errlen) {
  const char *path = p->model.init;
  if (!path[0]) {
    if (dp_init_params(dp, p->seed, p->model.init_std) == 0) return 0;
    return err_set(err, errlen, 1, "%s", dp_errmsg(dp));
  }
  const folder_kind_t kind = folder_kind(path);
  if (kind == FOLDER_STEP || kind == FOLDER_CKPT)
    return err_set(err, errlen, 2, "weights error: model.init %s is a checkpoint: checkpoint.resume continues a run "
                   "from one; model.init takes weights (ours, llama2.c, Hugging Face)", path);
  weights_file_t *f = NULL;
  int rc = weights_open(&f, path, err, errlen);
  if (rc == 0 && f->ix) {
    if (interop_check_plan(f->ix, &p->model, err, errlen)) rc = 2;
    else log_rank0("model.init: %s (%s, checked against the plan's model)", path, interop_format_name(f->fmt));
  }
  if (rc == 0) rc = load_units(m, dp, f, err, errlen);
  weights_close(f);
  return rc;
}

/* Export source: our file's tensors in place; the other formats' and a checkpoint's copied out
 * (interop_read_tensor un-permutes HF's wq/wk; a checkpoint's are assembled from chunks), each
 * kept until the export ends, since the writer holds several. A tensor that cannot be read
 * leaves its message in err for the export's. */
typedef struct {
  weights_file_t *f;
  float **copies;
  int n, cap;
  char err[1024];
} export_src_t;

static const float *get_from_file(void *ctx, const char *name, size_t numel) {
  export_src_t *s = ctx;
  const float *p = NULL;
  if (s->f->st) return read_ours(s->f, name, numel, &p, s->err, sizeof s->err) ? NULL : p;
  if (s->n == s->cap) {
    int cap = s->cap ? 2 * s->cap : 64;
    float **grown = realloc(s->copies, (size_t)cap * sizeof *grown);
    if (!grown) return NULL;
    s->copies = grown;
    s->cap = cap;
  }
  float *copy = malloc((numel ? numel : 1) * sizeof(float));
  if (!copy || weights_read(s->f, name, copy, numel, s->err, sizeof s->err)) {
    free(copy);
    return NULL;
  }
  s->copies[s->n++] = copy;
  return copy;
}

int weights_export(weights_file_t *f, const plan_model_t *cfg, const char *format, int bos_id, int eos_id,
                   const char *out, char *err, size_t errlen) {
  interop_format_t fmt;
  if (interop_format_parse(format, &fmt) || (fmt != INTEROP_LLAMA2C && fmt != INTEROP_HF)) {
    return err_set(err, errlen, 2, "--format %s: export writes llama2c or hf", format);
  }
  export_src_t src = {.f = f};
  int rc = interop_export(cfg, get_from_file, &src, fmt, bos_id, eos_id, out, err, errlen);
  for (int i = 0; i < src.n; i++) free(src.copies[i]);
  free(src.copies);
  if (rc && src.err[0]) return err_set(err, errlen, 2, "%s", src.err); /* the tensor's own cause */
  if (rc == 0) log_info("exported %s (%s) to %s (%s)", f->path, weights_format_name(f), out,
                        interop_format_name(fmt));
  return rc == 0 ? 0 : rc == INTEROP_EMISMATCH || rc == INTEROP_EINVAL || rc == INTEROP_ECORRUPT ? 2 : 1;
}

void weights_final_path(const plan_t *p, char *out, size_t len) {
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
