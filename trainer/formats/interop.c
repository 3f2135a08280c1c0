/* interop: llama2.c (version 0) and Hugging Face Llama files, read and written in our layout.
 *
 * Both formats are described by one table of tensor kinds (embedding, per-layer norms and
 * linears, final norm, classifier) whose enum order is llama2.c's file order; a kind plus a
 * layer index gives our name, the HF name, the shape and the llama2.c offset. Readers map the
 * file (llama2.c: mmap here; HF: st_open) and validate everything at open, so that reading a
 * tensor later cannot fail on the file's account. The only data transformation is the per-head
 * row permutation of wq/wk between Meta's adjacent-pair RoPE layout and HF's half-rotation one:
 *
 *   within a head of D rows:  Meta row 2i  <->  HF row i,   Meta row 2i+1  <->  HF row i + D/2
 *
 * Both rotate the pair (x_a, x_b) = (Meta 2i, Meta 2i+1) = (HF i, HF i + D/2) by the angle
 * t * theta^(-2i/D) as (x_a cos - x_b sin, x_a sin + x_b cos), so q.k is unchanged.
 * Writers go through "<path>.tmp.<pid>" and rename, as the safetensors writer does.
 * config.json is parsed with cJSON into plain fields; the tree is deleted before returning. */
#include "trainer/formats/interop.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/fs.h"
#include "trainer/formats/safetensors.h"

#define LLAMA2C_HEADER_INTS 7
#define LLAMA2C_MAGIC_V1 0x616b3432 /* "ak42": llama2.c versions 1 and 2 */
#define DIM_MAX (1 << 20)           /* sanity bound on every header/config dimension */
#define CONFIG_MAX_BYTES (1 << 20)

/* Tensor kinds, in llama2.c's file order (the RoPE tables sit between K_NORM and K_OUT). */
enum { K_EMB, K_ATT_NORM, K_WQ, K_WK, K_WV, K_WO, K_FFN_NORM, K_W1, K_W2, K_W3, K_NORM, K_OUT, K_COUNT };

static const char *const our_names[K_COUNT] = {
    "tok_embeddings.weight",  "attention_norm.weight",  "attention.wq.weight", "attention.wk.weight",
    "attention.wv.weight",    "attention.wo.weight",    "ffn_norm.weight",     "feed_forward.w1.weight",
    "feed_forward.w2.weight", "feed_forward.w3.weight", "norm.weight",         "output.weight"};
static const char *const hf_names[K_COUNT] = {"model.embed_tokens.weight",
                                              "input_layernorm.weight",
                                              "self_attn.q_proj.weight",
                                              "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight",
                                              "self_attn.o_proj.weight",
                                              "post_attention_layernorm.weight",
                                              "mlp.gate_proj.weight",
                                              "mlp.down_proj.weight",
                                              "mlp.up_proj.weight",
                                              "model.norm.weight",
                                              "lm_head.weight"};

static int kind_per_layer(int k) { return k >= K_ATT_NORM && k <= K_W3; }

/* (rows, cols) of kind k; 1-D tensors are (n, 1). */
static void kind_shape(const plan_model_t *c, int k, int *rows, int *cols) {
  const int C = c->dim, D = c->dim / c->n_heads, KV = c->n_kv_heads * D, F = c->hidden_dim;
  int r = C, q = 1;
  switch (k) {
  case K_EMB:
  case K_OUT:
    r = c->vocab_size;
    q = C;
    break;
  case K_WQ:
    r = c->n_heads * D;
    q = C;
    break;
  case K_WK:
  case K_WV:
    r = KV;
    q = C;
    break;
  case K_WO:
    r = C;
    q = c->n_heads * D;
    break;
  case K_W1:
  case K_W3:
    r = F;
    q = C;
    break;
  case K_W2:
    r = C;
    q = F;
    break;
  default: break; /* norms: (C, 1) */
  }
  *rows = r;
  *cols = q;
}
static size_t kind_numel(const plan_model_t *c, int k) {
  int r, q;
  kind_shape(c, k, &r, &q);
  return (size_t)r * (size_t)q;
}

static void our_name(int k, int layer, char *buf, size_t n) {
  if (kind_per_layer(k))
    snprintf(buf, n, "layers.%d.%s", layer, our_names[k]);
  else
    snprintf(buf, n, "%s", our_names[k]);
}
static void hf_name(int k, int layer, char *buf, size_t n) {
  if (kind_per_layer(k))
    snprintf(buf, n, "model.layers.%d.%s", layer, hf_names[k]);
  else
    snprintf(buf, n, "%s", hf_names[k]);
}

/* Our name -> (kind, layer); -1 when it is not one of cfg's tensors. */
static int parse_name(const plan_model_t *c, const char *name, int *kind, int *layer) {
  *layer = 0;
  if (!strncmp(name, "layers.", 7)) {
    char *end;
    long l = strtol(name + 7, &end, 10);
    if (end == name + 7 || *end != '.' || l < 0 || l >= c->n_layers) return -1;
    for (int k = 0; k < K_COUNT; k++)
      if (kind_per_layer(k) && !strcmp(end + 1, our_names[k])) {
        *kind = k;
        *layer = (int)l;
        return 0;
      }
    return -1;
  }
  for (int k = 0; k < K_COUNT; k++)
    if (!kind_per_layer(k) && !strcmp(name, our_names[k])) {
      *kind = k;
      return 0;
    }
  return -1;
}

/* The HF permutation of one (heads*D, cols) matrix; to_hf chooses the direction. */
static void permute_rows(const float *src, float *dst, int heads, int D, int cols, int to_hf) {
  const int half = D / 2;
  for (int h = 0; h < heads; h++)
    for (int i = 0; i < half; i++)
      for (int j = 0; j < 2; j++) {
        size_t meta = (size_t)h * D + 2 * i + j, hf = (size_t)h * D + i + (size_t)j * half;
        size_t from = to_hf ? meta : hf, to = to_hf ? hf : meta;
        memcpy(dst + to * cols, src + from * cols, (size_t)cols * sizeof(float));
      }
}

/* ------------------------------------------------------------------------------ errors */

static int fail(char *err, size_t errlen, int code, const char *path, const char *fmt, ...) {
  if (err && errlen) {
    int n = snprintf(err, errlen, "interop error: %s: ", path);
    if (n >= 0 && (size_t)n < errlen) {
      va_list ap;
      va_start(ap, fmt);
      err_vset(err + n, errlen - (size_t)n, code, fmt, ap);
      va_end(ap);
    }
  }
  return code;
}

/* Shortest %g that reads back as the same double (so config.json shows 1e-05, not 1.0000000000000001e-05). */
static void fmt_double(char *buf, size_t n, double v) {
  for (int prec = 6; prec <= 17; prec++) {
    snprintf(buf, n, "%.*g", prec, v);
    if (strtod(buf, NULL) == v) return;
  }
}

static int same_double(double a, double b) { return fabs(a - b) <= 1e-6 * fmax(fabs(a), fabs(b)); }

/* Dimensions every format needs: positive, bounded, heads dividing as Llama wants. */
static int check_dims(const plan_model_t *c, const char *path, char *err, size_t errlen) {
  const struct {
    const char *k;
    int v;
  } d[] = {{"dim", c->dim},
           {"hidden_dim", c->hidden_dim},
           {"n_layers", c->n_layers},
           {"n_heads", c->n_heads},
           {"n_kv_heads", c->n_kv_heads},
           {"vocab_size", c->vocab_size},
           {"seq_len", c->max_seq_len}};
  for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
    if (d[i].v <= 0 || d[i].v > DIM_MAX)
      return fail(err, errlen, INTEROP_ECORRUPT, path, "%s %d is out of range (1..%d)", d[i].k, d[i].v, DIM_MAX);
  if (c->dim % c->n_heads != 0)
    return fail(err, errlen, INTEROP_ECORRUPT, path, "dim %d is not a multiple of n_heads %d", c->dim, c->n_heads);
  if (c->n_heads % c->n_kv_heads != 0)
    return fail(err, errlen, INTEROP_ECORRUPT, path, "n_kv_heads %d does not divide n_heads %d", c->n_kv_heads,
                c->n_heads);
  if ((c->dim / c->n_heads) % 2 != 0)
    return fail(err, errlen, INTEROP_ECORRUPT, path, "head size %d is odd (RoPE rotates pairs)", c->dim / c->n_heads);
  return 0;
}

static void config_defaults(plan_model_t *c, const char *path) {
  memset(c, 0, sizeof *c);
  c->multiple_of = 256; /* unused: hidden_dim is explicit */
  c->rope_theta = 10000.0;
  c->norm_eps = 1e-5;
  c->init_std = 0.02;
  snprintf(c->init, sizeof c->init, "%s", path);
}

/* ------------------------------------------------------------------------------ formats */

int interop_format_parse(const char *name, interop_format_t *out) {
  static const struct {
    const char *n;
    interop_format_t f;
  } t[] = {{"auto", INTEROP_AUTO}, {"meshrun", INTEROP_MESHRUN}, {"llama2c", INTEROP_LLAMA2C}, {"hf", INTEROP_HF}};
  for (size_t i = 0; name && i < sizeof t / sizeof t[0]; i++)
    if (!strcmp(name, t[i].n)) {
      *out = t[i].f;
      return 0;
    }
  return INTEROP_EINVAL;
}

const char *interop_format_name(interop_format_t f) {
  switch (f) {
  case INTEROP_MESHRUN: return "meshrun";
  case INTEROP_LLAMA2C: return "llama2c";
  case INTEROP_HF: return "hf";
  default: return "auto";
  }
}

static int ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && !strcmp(s + a - b, suffix);
}

/* A path that exists is judged by its content: a directory is HF; a file that begins as JSON
 * ('{') is HF's config.json; a file that begins as safetensors (a u64 header length that fits
 * the file, then '{') is HF's model.safetensors when it holds model.embed_tokens.weight, else
 * ours (a corrupt one too, so that its error is the safetensors reader's); anything else is
 * llama2.c's, which has no magic and is checked by its exact size when opened. A path that does
 * not exist is judged by its name, for messages about it. */
interop_format_t interop_detect(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    if (ends_with(path, "config.json") || ends_with(path, "/model.safetensors") || !strcmp(path, "model.safetensors"))
      return INTEROP_HF;
    return ends_with(path, ".safetensors") ? INTEROP_MESHRUN : INTEROP_LLAMA2C;
  }
  if (S_ISDIR(st.st_mode)) return INTEROP_HF;
  unsigned char head[16] = {0};
  FILE *fp = fopen(path, "rb");
  size_t got = fp ? fread(head, 1, sizeof head, fp) : 0;
  if (fp) fclose(fp);
  size_t i = 0;
  while (i < got && (head[i] == ' ' || head[i] == '\t' || head[i] == '\n' || head[i] == '\r')) i++;
  if (i < got && head[i] == '{') return INTEROP_HF;
  uint64_t n = 0;
  for (int b = 7; b >= 0; b--) n = n << 8 | head[b];
  if (got < 9 || head[8] != '{' || n < 2 || n > (uint64_t)st.st_size - 8) return INTEROP_LLAMA2C;
  st_file_t *sf = NULL;
  if (st_open(&sf, path, NULL, 0) != 0) return INTEROP_MESHRUN;
  interop_format_t f = st_find(sf, "model.embed_tokens.weight") ? INTEROP_HF : INTEROP_MESHRUN;
  st_close(sf);
  return f;
}

/* ------------------------------------------------------------------------------ reading */

struct interop_file {
  interop_format_t fmt;
  char path[PLAN_PATH_MAX]; /* as given, for messages */
  plan_model_t cfg;
  int shared; /* the classifier is the embedding */
  /* llama2.c */
  void *map;
  size_t map_len;
  const float *data; /* after the header */
  /* HF */
  st_file_t *st;
};

/* Float offset of (kind, layer) in a llama2.c file, from the end of the header. */
static size_t llama2c_offset(const plan_model_t *c, int kind, int layer) {
  size_t off = 0;
  for (int k = 0; k < kind; k++)
    off += kind_numel(c, k) * (kind_per_layer(k) ? (size_t)c->n_layers : 1);
  if (kind == K_OUT) off += (size_t)c->max_seq_len * (size_t)(c->dim / c->n_heads); /* cos + sin tables */
  return off + (size_t)layer * kind_numel(c, kind);
}

static int open_llama2c(interop_file_t *f, char *err, size_t errlen) {
  const char *path = f->path;
  int fd = open(path, O_RDONLY);
  if (fd < 0) return fail(err, errlen, INTEROP_EIO, path, "cannot open: %s", strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return fail(err, errlen, INTEROP_EIO, path, "cannot stat: %s", strerror(e));
  }
  size_t len = (size_t)st.st_size;
  if (len < LLAMA2C_HEADER_INTS * sizeof(int32_t)) {
    close(fd);
    return fail(err, errlen, INTEROP_ECORRUPT, path,
                "%zu bytes, shorter than the llama2.c header (7 int32); not a llama2.c checkpoint", len);
  }
  void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return fail(err, errlen, INTEROP_EIO, path, "cannot map: %s", strerror(errno));
  f->map = map;
  f->map_len = len;
  int32_t h[LLAMA2C_HEADER_INTS];
  memcpy(h, map, sizeof h);
  if ((uint32_t)h[0] == LLAMA2C_MAGIC_V1)
    return fail(err, errlen, INTEROP_ECORRUPT, path,
                "a llama2.c version %d file (magic \"ak42\"); only version 0 (legacy export) is supported", h[1]);
  plan_model_t *c = &f->cfg;
  c->dim = h[0];
  c->hidden_dim = h[1];
  c->n_layers = h[2];
  c->n_heads = h[3];
  c->n_kv_heads = h[4];
  f->shared = h[5] > 0;
  c->vocab_size = h[5] == INT32_MIN ? 0 : abs(h[5]);
  c->max_seq_len = h[6];
  int rc = check_dims(c, path, err, errlen);
  if (rc) {
    size_t n = err && errlen ? strlen(err) : 0;
    if (n + 1 < errlen) snprintf(err + n, errlen - n, " in the header; not a llama2.c version 0 checkpoint?");
    return rc;
  }
  /* Every dimension may be up to DIM_MAX (2^20), so the implied size can pass 2^64 bytes and
   * wrap in size_t to a small number that a tiny file matches; reads would then run past the
   * mapping. The same sum in double cannot wrap: beyond 2^62 bytes no file is that size. */
  double approx = (double)c->max_seq_len * (double)(c->dim / c->n_heads) +
                  (f->shared ? 0.0 : (double)kind_numel(c, K_OUT));
  for (int k = K_EMB; k < K_OUT; k++)
    approx += (double)kind_numel(c, k) * (kind_per_layer(k) ? (double)c->n_layers : 1.0);
  approx = approx * sizeof(float) + LLAMA2C_HEADER_INTS * sizeof(int32_t);
  if (approx > 0x1p62)
    return fail(err, errlen, INTEROP_ECORRUPT, path,
                "%zu bytes, but its header (dim %d, hidden_dim %d, n_layers %d, n_heads %d, n_kv_heads %d, "
                "vocab_size %d, seq_len %d) implies %.3g bytes (not a llama2.c version 0 checkpoint?)",
                len, c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, c->max_seq_len,
                approx);
  size_t want = LLAMA2C_HEADER_INTS * sizeof(int32_t) +
                (llama2c_offset(c, K_OUT, 0) + (f->shared ? 0 : kind_numel(c, K_OUT))) * sizeof(float);
  if (len != want)
    return fail(err, errlen, INTEROP_ECORRUPT, path,
                "%zu bytes, but its header (dim %d, hidden_dim %d, n_layers %d, n_heads %d, n_kv_heads %d, "
                "vocab_size %d%s, seq_len %d) implies %zu%s",
                len, c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size,
                f->shared ? " shared" : " unshared", c->max_seq_len, want,
                len < want ? " (truncated?)" : " (not a llama2.c version 0 checkpoint?)");
  f->data = (const float *)((const char *)map + LLAMA2C_HEADER_INTS * sizeof(int32_t));
  return 0;
}

/* config.json: the fields we need, copied out of the cJSON tree. */
static int read_config(interop_file_t *f, const char *cfg_path, char *err, size_t errlen) {
  FILE *fp = fopen(cfg_path, "rb");
  if (!fp) return fail(err, errlen, INTEROP_EIO, cfg_path, "cannot open: %s", strerror(errno));
  char *text = malloc(CONFIG_MAX_BYTES + 1);
  if (!text) {
    fclose(fp);
    return fail(err, errlen, INTEROP_ENOMEM, cfg_path, "out of memory");
  }
  size_t n = fread(text, 1, CONFIG_MAX_BYTES + 1, fp);
  fclose(fp);
  if (n > CONFIG_MAX_BYTES) {
    free(text);
    return fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "larger than %d bytes; not an HF config", CONFIG_MAX_BYTES);
  }
  text[n] = 0;
  cJSON *root = cJSON_Parse(text);
  free(text);
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "not a JSON object");
  }
  plan_model_t *c = &f->cfg;
  int rc = 0;
  /* required integers, then optional ones with LlamaConfig's defaults */
  const struct {
    const char *key;
    int *dst;
    int required;
  } ints[] = {{"hidden_size", &c->dim, 1},
              {"intermediate_size", &c->hidden_dim, 1},
              {"num_hidden_layers", &c->n_layers, 1},
              {"num_attention_heads", &c->n_heads, 1},
              {"vocab_size", &c->vocab_size, 1},
              {"num_key_value_heads", &c->n_kv_heads, 0},
              {"max_position_embeddings", &c->max_seq_len, 0}};
  c->max_seq_len = 2048;
  for (size_t i = 0; i < sizeof ints / sizeof ints[0] && rc == 0; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, ints[i].key);
    if (!v || cJSON_IsNull(v)) {
      if (ints[i].required)
        rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "no \"%s\" (an integer); not a Llama config?", ints[i].key);
    } else if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) > DIM_MAX) {
      rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "\"%s\" is not an integer in 1..%d", ints[i].key, DIM_MAX);
    } else {
      *ints[i].dst = (int)v->valuedouble;
    }
  }
  if (rc == 0 && !c->n_kv_heads) c->n_kv_heads = c->n_heads;
  const struct {
    const char *key;
    double *dst;
    double dflt;
  } dbls[] = {{"rms_norm_eps", &c->norm_eps, 1e-6}, {"rope_theta", &c->rope_theta, 10000.0}};
  for (size_t i = 0; i < sizeof dbls / sizeof dbls[0] && rc == 0; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, dbls[i].key);
    if (!v || cJSON_IsNull(v))
      *dbls[i].dst = dbls[i].dflt;
    else if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !isfinite(v->valuedouble))
      rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "\"%s\" is not a finite positive number", dbls[i].key);
    else
      *dbls[i].dst = v->valuedouble;
  }
  const cJSON *v;
  if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "model_type")) &&
      (!cJSON_IsString(v) || strcmp(v->valuestring, "llama")))
    rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "model_type is %s, not \"llama\"",
              cJSON_IsString(v) ? v->valuestring : "not a string");
  if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "hidden_act")) &&
      (!cJSON_IsString(v) || strcmp(v->valuestring, "silu")))
    rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "hidden_act is not \"silu\" (our feed-forward is SwiGLU)");
  if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling")) && !cJSON_IsNull(v))
    rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "rope_scaling is set; only plain RoPE is supported");
  if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "attention_bias")) && cJSON_IsTrue(v))
    rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "attention_bias is true; our linears have no bias");
  if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "mlp_bias")) && cJSON_IsTrue(v))
    rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "mlp_bias is true; our linears have no bias");
  /* compared as doubles: a cast to int would wrap 1e300 (undefined) and round 8.5 down to 8 */
  if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "head_dim")) && !cJSON_IsNull(v) && c->n_heads > 0 &&
      (!cJSON_IsNumber(v) || v->valuedouble != (double)(c->dim / c->n_heads)))
    rc = fail(err, errlen, INTEROP_ECORRUPT, cfg_path, "head_dim is not hidden_size / num_attention_heads");
  /* tie_word_embeddings: LlamaConfig's default is false */
  f->shared = rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings")) && cJSON_IsTrue(v);
  cJSON_Delete(root);
  if (rc) return rc;
  return check_dims(c, cfg_path, err, errlen);
}

static int open_hf(interop_file_t *f, char *err, size_t errlen) {
  char dir[PLAN_PATH_MAX], cfg_path[PLAN_PATH_MAX + 32], st_path[PLAN_PATH_MAX + 32];
  snprintf(dir, sizeof dir, "%s", f->path);
  struct stat sb;
  if (!(stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode))) { /* a file inside the directory */
    char *slash = strrchr(dir, '/');
    if (slash)
      *slash = 0;
    else
      snprintf(dir, sizeof dir, ".");
  }
  snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
  snprintf(st_path, sizeof st_path, "%s/model.safetensors", dir);
  int rc = read_config(f, cfg_path, err, errlen);
  if (rc) return rc;
  char sterr[512];
  if (st_open(&f->st, st_path, sterr, sizeof sterr) != 0) {
    if (access(st_path, F_OK) != 0 && stat(dir, &sb) == 0) {
      char idx[PLAN_PATH_MAX + 64];
      snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
      if (access(idx, F_OK) == 0)
        return fail(err, errlen, INTEROP_ECORRUPT, dir,
                    "a sharded checkpoint (model.safetensors.index.json); "
                    "only a single model.safetensors is supported");
    }
    return fail(err, errlen, INTEROP_ECORRUPT, dir, "%s", sterr);
  }
  const plan_model_t *c = &f->cfg;
  /* every tensor we need, with its exact shape; nothing unexpected besides RoPE buffers */
  char name[160];
  for (int k = 0; k < K_COUNT; k++)
    for (int l = 0; l < (kind_per_layer(k) ? c->n_layers : 1); l++) {
      hf_name(k, l, name, sizeof name);
      const st_tensor_t *t = st_find(f->st, name);
      if (k == K_OUT && f->shared) continue; /* tied: the embedding serves (HF ignores lm_head too) */
      if (!t) {
        if (k == K_OUT) {
          f->shared = 1; /* no lm_head: HF ties it to the embedding */
          continue;
        }
        return fail(err, errlen, INTEROP_ECORRUPT, st_path, "no tensor %s (num_hidden_layers %d)", name, c->n_layers);
      }
      int r, q;
      kind_shape(c, k, &r, &q);
      int ndim = q == 1 && (k == K_ATT_NORM || k == K_FFN_NORM || k == K_NORM) ? 1 : 2;
      if (t->dtype != ST_F32 || t->ndim != ndim || t->shape[0] != r || (ndim == 2 && t->shape[1] != q)) {
        char want[48], have[160] = "(";
        if (ndim == 1)
          snprintf(want, sizeof want, "(%d)", r);
        else
          snprintf(want, sizeof want, "(%d, %d)", r, q);
        for (int d = 0; d < t->ndim; d++)
          snprintf(have + strlen(have), sizeof have - strlen(have), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        return fail(err, errlen, INTEROP_ECORRUPT, st_path, "%s is %s %s), config.json implies F32 %s", name,
                    t->dtype == ST_F32 ? "F32" : "I32", have, want);
      }
    }
  for (int i = 0; i < st_num_tensors(f->st); i++) {
    const char *n = st_tensor_at(f->st, i)->name;
    int known = ends_with(n, "rotary_emb.inv_freq") || !strcmp(n, "lm_head.weight");
    for (int k = 0; k < K_COUNT && !known; k++)
      for (int l = 0; l < (kind_per_layer(k) ? c->n_layers : 1) && !known; l++) {
        hf_name(k, l, name, sizeof name);
        known = !strcmp(n, name);
      }
    if (!known)
      return fail(err, errlen, INTEROP_ECORRUPT, st_path,
                  "unexpected tensor %s (not a plain Llama, or more layers "
                  "than num_hidden_layers %d?)",
                  n, c->n_layers);
  }
  return 0;
}

int interop_open(interop_file_t **out, const char *path, interop_format_t fmt, char *err, size_t errlen) {
  *out = NULL;
  if (!path || !*path) return fail(err, errlen, INTEROP_EINVAL, "(none)", "no path given");
  if (fmt == INTEROP_AUTO) fmt = interop_detect(path);
  if (fmt == INTEROP_MESHRUN)
    return fail(err, errlen, INTEROP_EINVAL, path,
                "our own safetensors weights load directly (model.init); interop reads llama2c and hf");
  if (strlen(path) >= PLAN_PATH_MAX)
    return fail(err, errlen, INTEROP_EINVAL, "(path)", "longer than %d bytes", PLAN_PATH_MAX);
  interop_file_t *f = calloc(1, sizeof *f);
  if (!f) return fail(err, errlen, INTEROP_ENOMEM, path, "out of memory");
  f->fmt = fmt;
  snprintf(f->path, sizeof f->path, "%s", path);
  config_defaults(&f->cfg, path);
  int rc = fmt == INTEROP_HF ? open_hf(f, err, errlen) : open_llama2c(f, err, errlen);
  if (rc) {
    interop_close(f);
    return rc;
  }
  *out = f;
  return 0;
}

void interop_close(interop_file_t *f) {
  if (!f) return;
  if (f->map) munmap(f->map, f->map_len);
  st_close(f->st);
  free(f);
}

const plan_model_t *interop_config(const interop_file_t *f) { return &f->cfg; }
interop_format_t interop_file_format(const interop_file_t *f) { return f->fmt; }

int interop_check_plan(const interop_file_t *f, const plan_model_t *plan, char *err, size_t errlen) {
  char msg[256];
  if (interop_model_diff(&f->cfg, plan, NULL, msg, sizeof msg) == 0) return 0;
  return fail(err, errlen, INTEROP_EMISMATCH, f->path, "%s", msg);
}

int interop_model_diff(const plan_model_t *c, const plan_model_t *plan, const char *key, char *msg, size_t len) {
  const struct {
    const char *file_key, *plan_key;
    int file, plan;
  } d[] = {{"dim", "dim", c->dim, plan->dim},
           {"n_layers", "n_layers", c->n_layers, plan->n_layers},
           {"n_heads", "n_heads", c->n_heads, plan->n_heads},
           {"n_kv_heads", "n_kv_heads", c->n_kv_heads, plan->n_kv_heads},
           {"vocab_size", "vocab_size", c->vocab_size, plan->vocab_size},
           {"hidden_dim", "hidden_dim", c->hidden_dim, plan->hidden_dim}};
  for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
    if ((!key || !strcmp(key, d[i].plan_key)) && d[i].file != d[i].plan) {
      snprintf(msg, len, "%s %d but the plan says %d (set model.%s=%d)", d[i].file_key, d[i].file, d[i].plan,
               d[i].plan_key, d[i].file);
      return 1;
    }
  const struct {
    const char *key;
    double file, plan;
  } g[] = {{"rope_theta", c->rope_theta, plan->rope_theta}, {"norm_eps", c->norm_eps, plan->norm_eps}};
  for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
    if ((!key || !strcmp(key, g[i].key)) && !same_double(g[i].file, g[i].plan)) {
      char a[32], b[32];
      fmt_double(a, sizeof a, g[i].file);
      fmt_double(b, sizeof b, g[i].plan);
      snprintf(msg, len, "%s %s but the plan says %s (set model.%s=%s)", g[i].key, a, b, g[i].key, a);
      return 1;
    }
  return 0;
}

int interop_read_tensor(interop_file_t *f, const char *name, float *dst, size_t numel, char *err, size_t errlen) {
  const plan_model_t *c = &f->cfg;
  int k, l;
  if (parse_name(c, name, &k, &l) != 0)
    return fail(err, errlen, INTEROP_EINVAL, f->path, "no tensor %s in a model of %d layers", name, c->n_layers);
  if (numel != kind_numel(c, k))
    return fail(err, errlen, INTEROP_EMISMATCH, f->path, "%s has %zu elements, the caller wants %zu", name,
                kind_numel(c, k), numel);
  if (k == K_OUT && f->shared) k = K_EMB; /* shared classifier */
  const int D = c->dim / c->n_heads;
  if (f->fmt == INTEROP_LLAMA2C) {
    memcpy(dst, f->data + llama2c_offset(c, k, l), numel * sizeof(float));
    return 0;
  }
  char hname[160];
  hf_name(k, l, hname, sizeof hname);
  const st_tensor_t *t = st_find(f->st, hname); /* present and shaped right: checked at open */
  if (k == K_WQ || k == K_WK)
    permute_rows(t->data, dst, k == K_WQ ? c->n_heads : c->n_kv_heads, D, c->dim, 0);
  else
    memcpy(dst, t->data, numel * sizeof(float));
  return 0;
}

int interop_load_model(interop_file_t *f, model_t *m, char *err, size_t errlen) {
  size_t maxn = 0;
  const int nt = model_num_tensors(m);
  for (int i = 0; i < nt; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    size_t n = (size_t)t->full_shape[0] * (size_t)t->full_shape[1];
    if (n > maxn) maxn = n;
  }
  float *buf = malloc((maxn ? maxn : 1) * sizeof(float));
  if (!buf) return fail(err, errlen, INTEROP_ENOMEM, f->path, "out of memory (%zu floats)", maxn);
  int rc = 0;
  for (int i = 0; i < nt && rc == 0; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    size_t n = (size_t)t->full_shape[0] * (size_t)t->full_shape[1];
    int k, l;
    if (parse_name(&f->cfg, t->name, &k, &l) != 0) {
      rc = fail(err, errlen, INTEROP_EMISMATCH, f->path, "the model's tensor %s is not in the file (n_layers %d)",
                t->name, f->cfg.n_layers);
      break;
    }
    int r, q;
    kind_shape(&f->cfg, k, &r, &q);
    if (r != t->full_shape[0] || q != t->full_shape[1]) {
      rc = fail(err, errlen, INTEROP_EMISMATCH, f->path, "%s is (%d, %d) in the file, (%d, %d) in the model", t->name,
                r, q, t->full_shape[0], t->full_shape[1]);
      break;
    }
    rc = interop_read_tensor(f, t->name, buf, n, err, errlen);
    if (rc == 0) model_import_tensor(m, i, buf);
  }
  free(buf);
  return rc;
}

/* ------------------------------------------------------------------------------ writing */

static int write_all(FILE *fp, const void *p, size_t bytes) { return fwrite(p, 1, bytes, fp) == bytes ? 0 : -1; }

/* Closes fp, fsyncs and renames tmp onto path; on any failure removes tmp. */
static int finish_file(FILE *fp, int failed, const char *tmp, const char *path, char *err, size_t errlen) {
  if (!failed && fflush(fp) != 0) failed = 1;
  if (!failed && fsync(fileno(fp)) != 0) failed = 1;
  int e = errno;
  if (fclose(fp) != 0 && !failed) {
    failed = 1;
    e = errno;
  }
  if (!failed && rename(tmp, path) != 0) {
    failed = 1;
    e = errno;
  }
  if (failed) {
    unlink(tmp);
    return fail(err, errlen, INTEROP_EIO, path, "write failed: %s", strerror(e));
  }
  return 0;
}

/* Where export tensors come from, and what to call it in messages. */
typedef struct {
  interop_get_fn get;
  void *ctx;
  const char *label;
} source_t;

static const float *get_checked(const source_t *s, const plan_model_t *c, int k, int l, char *err, size_t errlen) {
  char name[128];
  our_name(k, l, name, sizeof name);
  const float *p = s->get(s->ctx, name, kind_numel(c, k));
  if (!p)
    fail(err, errlen, INTEROP_EMISMATCH, s->label, "no tensor %s of %zu floats (is it a model of this plan?)", name,
         kind_numel(c, k));
  return p;
}

static int export_llama2c(const plan_model_t *c, const source_t *src, const char *out, char *err, size_t errlen) {
  if (!same_double(c->rope_theta, 10000.0) || !same_double(c->norm_eps, 1e-5))
    return fail(err, errlen, INTEROP_EINVAL, out,
                "llama2.c files imply rope_theta 10000 and norm_eps 1e-05; this model has %g and %g", c->rope_theta,
                c->norm_eps);
  const float *emb = get_checked(src, c, K_EMB, 0, err, errlen);
  const float *cls = emb ? get_checked(src, c, K_OUT, 0, err, errlen) : NULL;
  if (!cls) return INTEROP_EMISMATCH;
  const int shared = !memcmp(emb, cls, kind_numel(c, K_EMB) * sizeof(float));
  char tmp[PLAN_PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", out, (int)getpid());
  FILE *fp = fopen(tmp, "wb");
  if (!fp) return fail(err, errlen, INTEROP_EIO, out, "cannot create %s: %s", tmp, strerror(errno));
  int32_t h[LLAMA2C_HEADER_INTS] = {c->dim,        c->hidden_dim, c->n_layers,
                                    c->n_heads,    c->n_kv_heads, shared ? c->vocab_size : -c->vocab_size,
                                    c->max_seq_len};
  int failed = write_all(fp, h, sizeof h), rc = 0;
  for (int k = K_EMB; k <= K_NORM && !failed && rc == 0; k++)
    for (int l = 0; l < (kind_per_layer(k) ? c->n_layers : 1) && !failed; l++) {
      const float *p = get_checked(src, c, k, l, err, errlen);
      if (!p) {
        rc = INTEROP_EMISMATCH;
        break;
      }
      failed = write_all(fp, p, kind_numel(c, k) * sizeof(float));
    }
  /* RoPE tables as llama2.c's export writes them: cos then sin of t * theta^(-2i/D), (seq_len, D/2) */
  const int half = c->dim / c->n_heads / 2;
  float *row = malloc((size_t)half * sizeof *row);
  if (!row && rc == 0) rc = fail(err, errlen, INTEROP_ENOMEM, out, "out of memory");
  for (int part = 0; part < 2 && !failed && rc == 0; part++)
    for (int t = 0; t < c->max_seq_len && !failed; t++) {
      for (int i = 0; i < half; i++) {
        double ang = (double)t * pow(c->rope_theta, -2.0 * i / (2.0 * half));
        row[i] = (float)(part == 0 ? cos(ang) : sin(ang));
      }
      failed = write_all(fp, row, (size_t)half * sizeof *row);
    }
  free(row);
  if (!shared && !failed && rc == 0) failed = write_all(fp, cls, kind_numel(c, K_OUT) * sizeof(float));
  if (rc) {
    fclose(fp);
    unlink(tmp);
    return rc;
  }
  return finish_file(fp, failed, tmp, out, err, errlen);
}

static int mkdir_p(const char *dir, char *err, size_t errlen) {
  char failed[PLAN_PATH_MAX];
  int rc = fs_mkdir_p(dir, failed, sizeof failed);
  if (rc) return fail(err, errlen, INTEROP_EIO, dir, "cannot create directory %s: %s", failed, strerror(-rc));
  return 0;
}

/* A token id for config.json, or null for none (-1). */
static const char *fmt_token(char *buf, size_t n, int id) {
  if (id < 0) return "null";
  snprintf(buf, n, "%d", id);
  return buf;
}

/* config.json. bos_token_id and eos_token_id are written even when unknown (null): absent,
 * LlamaConfig would take 1 and 2, Llama 2's ids, which mean nothing in another vocabulary and
 * would make transformers' generate stop at whatever token 2 is. */
static int write_hf_config(const plan_model_t *c, int bos, int eos, const char *dir, char *err, size_t errlen) {
  char path[PLAN_PATH_MAX + 32], tmp[PLAN_PATH_MAX + 64], eps[32], theta[32], b[16], e[16];
  snprintf(path, sizeof path, "%s/config.json", dir);
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  fmt_double(eps, sizeof eps, c->norm_eps);
  fmt_double(theta, sizeof theta, c->rope_theta);
  FILE *fp = fopen(tmp, "w");
  if (!fp) return fail(err, errlen, INTEROP_EIO, path, "cannot create %s: %s", tmp, strerror(errno));
  int n = fprintf(fp,
                  "{\n"
                  "  \"architectures\": [\"LlamaForCausalLM\"],\n"
                  "  \"model_type\": \"llama\",\n"
                  "  \"hidden_size\": %d,\n"
                  "  \"intermediate_size\": %d,\n"
                  "  \"num_hidden_layers\": %d,\n"
                  "  \"num_attention_heads\": %d,\n"
                  "  \"num_key_value_heads\": %d,\n"
                  "  \"head_dim\": %d,\n"
                  "  \"vocab_size\": %d,\n"
                  "  \"max_position_embeddings\": %d,\n"
                  "  \"rms_norm_eps\": %s,\n"
                  "  \"rope_theta\": %s,\n"
                  "  \"rope_scaling\": null,\n"
                  "  \"hidden_act\": \"silu\",\n"
                  "  \"attention_bias\": false,\n"
                  "  \"mlp_bias\": false,\n"
                  "  \"tie_word_embeddings\": false,\n"
                  "  \"bos_token_id\": %s,\n"
                  "  \"eos_token_id\": %s,\n"
                  "  \"torch_dtype\": \"float32\"\n"
                  "}\n",
                  c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->dim / c->n_heads, c->vocab_size,
                  c->max_seq_len, eps, theta, fmt_token(b, sizeof b, bos), fmt_token(e, sizeof e, eos));
  return finish_file(fp, n < 0, tmp, path, err, errlen);
}

/* generation_config.json, when a token id is known: where transformers' generate looks for
 * them first (reading them from config.json is its legacy fallback). When none is, one left
 * in dir by an earlier export is removed, lest it override config.json's nulls. */
static int write_hf_generation_config(int bos, int eos, const char *dir, char *err, size_t errlen) {
  char path[PLAN_PATH_MAX + 32], tmp[PLAN_PATH_MAX + 64], b[16], e[16];
  snprintf(path, sizeof path, "%s/generation_config.json", dir);
  if (bos < 0 && eos < 0) {
    if (unlink(path) != 0 && errno != ENOENT)
      return fail(err, errlen, INTEROP_EIO, path, "cannot remove the earlier export's: %s", strerror(errno));
    return 0;
  }
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  FILE *fp = fopen(tmp, "w");
  if (!fp) return fail(err, errlen, INTEROP_EIO, path, "cannot create %s: %s", tmp, strerror(errno));
  int n = fprintf(fp, "{\n  \"bos_token_id\": %s,\n  \"eos_token_id\": %s\n}\n", fmt_token(b, sizeof b, bos),
                  fmt_token(e, sizeof e, eos));
  return finish_file(fp, n < 0, tmp, path, err, errlen);
}

static int export_hf(const plan_model_t *c, const source_t *src, int bos, int eos, const char *out, char *err,
                     size_t errlen) {
  int rc = 0;
  const int n = 2 + 9 * c->n_layers + 1, D = c->dim / c->n_heads;
  st_tensor_t *ts = calloc((size_t)n, sizeof *ts);
  char(*names)[128] = calloc((size_t)n, sizeof *names);
  float **perm = calloc((size_t)n, sizeof *perm); /* permuted copies of wq/wk */
  if (!ts || !names || !perm) rc = fail(err, errlen, INTEROP_ENOMEM, out, "out of memory");
  int i = 0;
  /* kind-major order, as in llama2.c files (safetensors readers look tensors up by name) */
  for (int k = 0; k < K_COUNT && rc == 0; k++)
    for (int l = 0; l < (kind_per_layer(k) ? c->n_layers : 1) && rc == 0; l++, i++) {
      const float *p = get_checked(src, c, k, l, err, errlen);
      if (!p) {
        rc = INTEROP_EMISMATCH;
        break;
      }
      int r, q;
      kind_shape(c, k, &r, &q);
      if (k == K_WQ || k == K_WK) {
        perm[i] = malloc(kind_numel(c, k) * sizeof(float));
        if (!perm[i]) {
          rc = fail(err, errlen, INTEROP_ENOMEM, out, "out of memory");
          break;
        }
        permute_rows(p, perm[i], k == K_WQ ? c->n_heads : c->n_kv_heads, D, c->dim, 1);
        p = perm[i];
      }
      hf_name(k, l, names[i], sizeof names[i]);
      ts[i].name = names[i];
      ts[i].dtype = ST_F32;
      ts[i].data = p;
      ts[i].ndim = q == 1 && k != K_EMB && k != K_OUT ? 1 : 2;
      ts[i].shape[0] = r;
      ts[i].shape[1] = q;
    }
  if (rc == 0) rc = mkdir_p(out, err, errlen); /* once every tensor was read: a refused source leaves nothing */
  if (rc == 0) {
    char path[PLAN_PATH_MAX + 32], sterr[512];
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    const char *meta[] = {"format", "pt"};
    if (st_write(path, ts, i, meta, 1, sterr, sizeof sterr) != 0) rc = fail(err, errlen, INTEROP_EIO, out, "%s", sterr);
  }
  if (rc == 0) rc = write_hf_config(c, bos, eos, out, err, errlen);
  if (rc == 0) rc = write_hf_generation_config(bos, eos, out, err, errlen);
  for (int j = 0; perm && j < n; j++)
    free(perm[j]);
  free(perm);
  free(names);
  free(ts);
  return rc;
}

static int export_from(const plan_model_t *cfg, const source_t *src, interop_format_t fmt, int bos, int eos,
                       const char *out, char *err, size_t errlen) {
  if (!out || !*out) return fail(err, errlen, INTEROP_EINVAL, "(none)", "no output path given");
  if (strlen(out) >= PLAN_PATH_MAX)
    return fail(err, errlen, INTEROP_EINVAL, "(path)", "longer than %d bytes", PLAN_PATH_MAX);
  int rc = check_dims(cfg, out, err, errlen);
  if (rc) return rc;
  if (fmt == INTEROP_LLAMA2C) return export_llama2c(cfg, src, out, err, errlen);
  if (fmt == INTEROP_HF) return export_hf(cfg, src, bos, eos, out, err, errlen);
  return fail(err, errlen, INTEROP_EINVAL, out, "export format must be llama2c or hf, not %s",
              interop_format_name(fmt));
}

int interop_export(const plan_model_t *cfg, interop_get_fn get, void *ctx, interop_format_t fmt, int bos_id,
                   int eos_id, const char *out, char *err, size_t errlen) {
  source_t src = {get, ctx, "export source"};
  return export_from(cfg, &src, fmt, bos_id, eos_id, out, err, errlen);
}

/* Source: our safetensors weights file. */
static const float *get_from_st(void *ctx, const char *name, size_t numel) {
  const st_tensor_t *t = st_find((st_file_t *)ctx, name);
  return t && t->dtype == ST_F32 && st_numel(t) == numel ? (const float *)t->data : NULL;
}

int interop_export_weights(const plan_model_t *cfg, const char *weights, interop_format_t fmt, const char *out,
                           char *err, size_t errlen) {
  st_file_t *st = NULL;
  char sterr[512];
  if (st_open(&st, weights, sterr, sizeof sterr) != 0) return fail(err, errlen, INTEROP_EIO, weights, "%s", sterr);
  source_t src = {get_from_st, st, weights};
  int rc = export_from(cfg, &src, fmt, -1, -1, out, err, errlen);
  st_close(st);
  return rc;
}

/* Source: full host copies of a model's tensors. */
typedef struct {
  const model_t *m;
  float **host;
} model_src_t;

static const float *get_from_model(void *ctx, const char *name, size_t numel) {
  model_src_t *s = ctx;
  for (int i = 0; i < model_num_tensors(s->m); i++) {
    const model_tensor_t *t = model_tensor(s->m, i);
    if (!strcmp(t->name, name)) return (size_t)t->full_shape[0] * (size_t)t->full_shape[1] == numel ? s->host[i] : NULL;
  }
  return NULL;
}

int interop_export_model(model_t *m, const plan_model_t *cfg, interop_format_t fmt, const char *out, char *err,
                         size_t errlen) {
  const int nt = model_num_tensors(m);
  model_src_t src = {m, calloc((size_t)nt, sizeof(float *))};
  int rc = src.host ? 0 : fail(err, errlen, INTEROP_ENOMEM, out ? out : "(none)", "out of memory");
  for (int i = 0; i < nt && rc == 0; i++) {
    const model_tensor_t *t = model_tensor(m, i);
    src.host[i] = malloc((size_t)t->full_shape[0] * (size_t)t->full_shape[1] * sizeof(float));
    if (!src.host[i])
      rc = fail(err, errlen, INTEROP_ENOMEM, out ? out : "(none)", "out of memory for %s", t->name);
    else if (model_export_tensor(m, i, src.host[i]) != 0)
      rc = fail(err, errlen, INTEROP_EIO, out ? out : "(none)", "assembling %s failed (see the log)", t->name);
  }
  source_t s = {get_from_model, &src, "model"};
  if (rc == 0 && out) rc = export_from(cfg, &s, fmt, -1, -1, out, err, errlen);
  for (int i = 0; src.host && i < nt; i++)
    free(src.host[i]);
  free(src.host);
  return rc;
}
