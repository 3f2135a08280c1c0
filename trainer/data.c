/* data: reads token files (text bytes, llm.c shards, raw u16/u32) or makes synthetic tokens,
 * checks them once, splits off validation, and cuts deterministic batches (rule in data.h).
 * It does not tokenize anything but bytes and does not stream: files are read whole. */
#include "trainer/data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "trainer/rng.h"

#define LLMC_MAGIC 20240520
#define LLMC_HEADER_INTS 256
/* Salts keep the data streams apart from the model's (seed, hash(name)) init streams. */
#define DATA_SALT 0x64617461u /* "data" */
#define EVAL_SALT 0x6576616cu /* "eval" */

const char *data_format_name(plan_data_format_t f) {
  switch (f) {
  case PLAN_DATA_AUTO: return "auto";
  case PLAN_DATA_TEXT: return "text";
  case PLAN_DATA_LLMC: return "llmc";
  case PLAN_DATA_U16: return "u16";
  case PLAN_DATA_U32: return "u32";
  case PLAN_DATA_SYNTHETIC: return "synthetic";
  }
  return "?";
}

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcasecmp(s + n - k, suffix) == 0;
}

/* Directories open fine with fopen and fail only at read: refuse them by name first. */
static int check_regular(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
    snprintf(err, errlen, "data: cannot read %s: not a regular file", path);
    return -1;
  }
  return 0;
}

int data_detect_format(const char *path, plan_data_format_t f, char *err, size_t errlen) {
  if (f != PLAN_DATA_AUTO) return (int)f;
  if (check_regular(path, err, errlen)) return DATA_EIO;
  /* The magic wins over the extension: llm.c shards are often named .bin. */
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    snprintf(err, errlen, "data: cannot open %s: %s", path, strerror(errno));
    return DATA_EIO;
  }
  int32_t head[2] = {0, 0};
  size_t got = fread(head, sizeof(int32_t), 2, fp);
  fclose(fp);
  if (got == 2 && head[0] == LLMC_MAGIC) return PLAN_DATA_LLMC;
  if (ends_with(path, ".u16")) return PLAN_DATA_U16;
  if (ends_with(path, ".u32")) return PLAN_DATA_U32;
  if (ends_with(path, ".txt") || ends_with(path, ".text") || ends_with(path, ".md")) return PLAN_DATA_TEXT;
  snprintf(err, errlen,
           "data: cannot tell the format of %s (no llm.c header; extension not .txt/.u16/.u32); "
           "set data.format to text, llmc, u16 or u32", path);
  return DATA_EINVAL;
}

/* Reads a whole file into a malloc'ed buffer. */
static int read_file(const char *path, unsigned char **out, size_t *len, char *err, size_t errlen) {
  if (check_regular(path, err, errlen)) return DATA_EIO;
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    snprintf(err, errlen, "data: cannot open %s: %s", path, strerror(errno));
    return DATA_EIO;
  }
  if (fseek(fp, 0, SEEK_END) != 0) goto io_error;
  long size = ftell(fp);
  if (size < 0 || fseek(fp, 0, SEEK_SET) != 0) goto io_error;
  unsigned char *buf = malloc(size > 0 ? (size_t)size : 1);
  if (!buf) {
    fclose(fp);
    snprintf(err, errlen, "data: out of memory reading %s (%ld bytes)", path, size);
    return DATA_ENOMEM;
  }
  if (fread(buf, 1, (size_t)size, fp) != (size_t)size) {
    free(buf);
    goto io_error;
  }
  fclose(fp);
  *out = buf;
  *len = (size_t)size;
  return 0;
io_error:
  snprintf(err, errlen, "data: cannot read %s: %s", path, errno ? strerror(errno) : "short read");
  fclose(fp);
  return DATA_EIO;
}

/* Decodes a file of format f into int32 ids (malloc'ed), checking ids against vocab. */
static int load_tokens(const char *path, plan_data_format_t f, int vocab, int32_t **out, size_t *n_out,
                       char *err, size_t errlen) {
  unsigned char *raw = NULL;
  size_t len = 0;
  int rc = read_file(path, &raw, &len, err, errlen);
  if (rc) return rc;

  const unsigned char *body = raw;
  size_t n = 0, width = 1;
  switch (f) {
  case PLAN_DATA_TEXT: width = 1; n = len; break;
  case PLAN_DATA_U16: width = 2; n = len / 2; break;
  case PLAN_DATA_U32: width = 4; n = len / 4; break;
  case PLAN_DATA_LLMC: {
    int32_t hdr[LLMC_HEADER_INTS];
    if (len < sizeof hdr) {
      snprintf(err, errlen, "data: %s: too short for an llm.c header (%zu bytes, need %zu)", path, len, sizeof hdr);
      free(raw);
      return DATA_EINVAL;
    }
    memcpy(hdr, raw, sizeof hdr);
    if (hdr[0] != LLMC_MAGIC || hdr[1] != 1 || hdr[2] < 0) {
      snprintf(err, errlen, "data: %s: bad llm.c header (magic %d, version %d, count %d; want magic %d, version 1)",
               path, hdr[0], hdr[1], hdr[2], LLMC_MAGIC);
      free(raw);
      return DATA_EINVAL;
    }
    width = 2;
    n = (size_t)hdr[2];
    body = raw + sizeof hdr;
    if (len - sizeof hdr < n * 2) {
      snprintf(err, errlen, "data: %s: header says %zu tokens but the file holds %zu", path, n, (len - sizeof hdr) / 2);
      free(raw);
      return DATA_EINVAL;
    }
    break;
  }
  default:
    snprintf(err, errlen, "data: %s: format %s is not a file format", path, data_format_name(f));
    free(raw);
    return DATA_EINVAL;
  }
  if (width > 1 && f != PLAN_DATA_LLMC && len % width != 0) {
    snprintf(err, errlen, "data: %s: %zu bytes is not a whole number of %s tokens", path, len, data_format_name(f));
    free(raw);
    return DATA_EINVAL;
  }

  int32_t *tok = malloc((n > 0 ? n : 1) * sizeof(int32_t));
  if (!tok) {
    snprintf(err, errlen, "data: out of memory for %zu tokens of %s", n, path);
    free(raw);
    return DATA_ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t id;
    if (width == 1) id = body[i];
    else if (width == 2) id = (uint32_t)body[2 * i] | (uint32_t)body[2 * i + 1] << 8;
    else
      id = (uint32_t)body[4 * i] | (uint32_t)body[4 * i + 1] << 8 | (uint32_t)body[4 * i + 2] << 16 |
           (uint32_t)body[4 * i + 3] << 24;
    if (id >= (uint32_t)vocab) {
      snprintf(err, errlen, "data: %s: token id %u at position %zu is >= model.vocab_size %d", path, id, i, vocab);
      free(tok);
      free(raw);
      return DATA_EINVAL;
    }
    tok[i] = (int32_t)id;
  }
  free(raw);
  *out = tok;
  *n_out = n;
  return 0;
}

/* A first-order Markov chain: token t goes to succ[t] with probability 3/4, else anywhere. */
static int make_synthetic(uint64_t seed, int vocab, size_t n, int32_t **out, char *err, size_t errlen) {
  int32_t *tok = malloc(n * sizeof(int32_t));
  int32_t *succ = malloc((size_t)vocab * sizeof(int32_t));
  if (!tok || !succ) {
    free(tok);
    free(succ);
    snprintf(err, errlen, "data: out of memory for %zu synthetic tokens", n);
    return DATA_ENOMEM;
  }
  rng_t r;
  rng_init(&r, seed ^ DATA_SALT, rng_hash_str("synthetic"));
  for (int v = 0; v < vocab; v++) succ[v] = (int32_t)rng_below(&r, (uint64_t)vocab);
  int32_t cur = (int32_t)rng_below(&r, (uint64_t)vocab);
  for (size_t i = 0; i < n; i++) {
    tok[i] = cur;
    cur = rng_below(&r, 4) < 3 ? succ[cur] : (int32_t)rng_below(&r, (uint64_t)vocab);
  }
  free(succ);
  *out = tok;
  return 0;
}

int data_load(data_t *d, const plan_t *p, int need_val, char *err, size_t errlen) {
  memset(d, 0, sizeof *d);
  d->vocab_size = p->model.vocab_size;
  d->seq_len = p->train.seq_len;
  d->global_batch = p->train.global_batch_size;
  d->seed = p->seed;
  const size_t need = (size_t)d->seq_len + 1;
  const char *train_name = p->data.train;

  int rc;
  int32_t *all = NULL;
  size_t n_all = 0;
  if (p->data.format == PLAN_DATA_SYNTHETIC) {
    d->format = PLAN_DATA_SYNTHETIC;
    train_name = "(synthetic)";
    n_all = DATA_SYNTHETIC_TOKENS;
    if (n_all < 4 * need) n_all = 4 * need;
    if ((rc = make_synthetic(p->seed, d->vocab_size, n_all, &all, err, errlen))) return rc;
  } else {
    if (!train_name[0]) {
      snprintf(err, errlen, "data: data.train is empty; give a token file or set data.format to synthetic");
      return DATA_EINVAL;
    }
    int f = data_detect_format(train_name, p->data.format, err, errlen);
    if (f < 0) return f;
    d->format = (plan_data_format_t)f;
    if ((rc = load_tokens(train_name, d->format, d->vocab_size, &all, &n_all, err, errlen))) return rc;
  }
  d->is_text = d->format == PLAN_DATA_TEXT;
  d->owned[0] = all;
  d->train = all;
  d->n_train = n_all;

  if (p->data.val[0] && p->data.format != PLAN_DATA_SYNTHETIC) {
    int f = data_detect_format(p->data.val, p->data.format, err, errlen);
    if (f < 0) {
      data_free(d);
      return f;
    }
    int32_t *val = NULL;
    if ((rc = load_tokens(p->data.val, (plan_data_format_t)f, d->vocab_size, &val, &d->n_val, err, errlen))) {
      data_free(d);
      return rc;
    }
    d->owned[1] = val;
    d->val = val;
  } else if (p->data.val_fraction > 0) {
    size_t nv = (size_t)((double)n_all * p->data.val_fraction);
    d->n_train = n_all - nv;
    d->val = all + d->n_train;
    d->n_val = nv;
  }

  if (d->n_train < need) {
    snprintf(err, errlen,
             "data: %s: the train split has %zu tokens, fewer than one sequence (train.seq_len + 1 = %zu)%s",
             train_name, d->n_train, need, d->n_val && !p->data.val[0] ? "; lower data.val_fraction or train.seq_len" : "");
    data_free(d);
    return DATA_EINVAL;
  }
  if (need_val && d->n_val < need) {
    snprintf(err, errlen,
             "data: %s: the validation split has %zu tokens, fewer than one sequence (train.seq_len + 1 = %zu); "
             "raise data.val_fraction, give data.val, or set eval.interval to 0",
             p->data.val[0] ? p->data.val : train_name, d->n_val, need);
    data_free(d);
    return DATA_EINVAL;
  }
  return 0;
}

void data_free(data_t *d) {
  if (!d) return;
  free(d->owned[0]);
  free(d->owned[1]);
  memset(d, 0, sizeof *d);
}

/* Copies the window starting at off into row i of tokens/targets. */
static void put_window(const int32_t *src, size_t off, int t, int i, int32_t *tokens, int32_t *targets) {
  memcpy(tokens + (size_t)i * t, src + off, (size_t)t * sizeof(int32_t));
  memcpy(targets + (size_t)i * t, src + off + 1, (size_t)t * sizeof(int32_t));
}

void data_train_batch(const data_t *d, int step, int micro_step, int rank, int dp, int b, int32_t *tokens,
                      int32_t *targets) {
  const int t = d->seq_len;
  const uint64_t first = (uint64_t)(micro_step * dp + rank) * (uint64_t)b;
  for (int i = 0; i < b; i++) {
    uint64_t j = first + (uint64_t)i;
    rng_t r;
    rng_init(&r, d->seed ^ DATA_SALT, (uint64_t)step * (uint64_t)d->global_batch + j);
    size_t off = (size_t)rng_below(&r, d->n_train - (size_t)t);
    put_window(d->train, off, t, i, tokens, targets);
  }
}

void data_eval_batch(const data_t *d, int k, int b, int32_t *tokens, int32_t *targets) {
  const int t = d->seq_len;
  for (int i = 0; i < b; i++) {
    rng_t r;
    rng_init(&r, d->seed ^ EVAL_SALT, (uint64_t)k * (uint64_t)b + (uint64_t)i);
    size_t off = (size_t)rng_below(&r, d->n_val - (size_t)t);
    put_window(d->val, off, t, i, tokens, targets);
  }
}
