/* data: maps token files (text bytes, llm.c shards, raw u16/u32; one file or many shards) or
 * makes synthetic tokens, checks them once, splits off validation, and cuts deterministic
 * batches (rule in data.h). Text is read as bytes, or encoded once at load through
 * data.tokenizer (trainer/formats/tokenizer) when the plan names one. */
#include "trainer/formats/data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/fs.h"
#include "trainer/model/rng.h"
#include "trainer/formats/tokenizer.h"

#define LLMC_MAGIC 20240520     /* GPT-2 tokens, uint16, version 1 */
#define LLMC_MAGIC_U32 20240801 /* Llama 3 tokens, uint32, version 7 */
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
    return err_set(err, errlen, DATA_EIO, "data: cannot read %s: not a regular file", path);
  }
  return 0;
}

/* The llm.c header a file starts with: 2 (uint16 tokens), 4 (uint32), 0 none; DATA_EIO unreadable. */
static int llmc_magic_width(const char *path, char *err, size_t errlen) {
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    return err_set(err, errlen, DATA_EIO, "data: cannot open %s: %s", path, strerror(errno));
  }
  int32_t head[2] = {0, 0};
  size_t got = fread(head, sizeof(int32_t), 2, fp);
  fclose(fp);
  if (got < 1) return 0;
  return head[0] == LLMC_MAGIC ? 2 : head[0] == LLMC_MAGIC_U32 ? 4 : 0;
}

int data_detect_format(const char *path, plan_data_format_t f, char *err, size_t errlen) {
  if (f == PLAN_DATA_SYNTHETIC) return (int)f;
  if (check_regular(path, err, errlen)) return DATA_EIO;
  /* The magic wins over the extension (llm.c shards are often named .bin), and over an
   * explicit format: header bytes read as text or ids would train on garbage, silently. */
  int magic = llmc_magic_width(path, err, errlen);
  if (magic < 0) return DATA_EIO;
  if (f == PLAN_DATA_AUTO && magic) return PLAN_DATA_LLMC;
  if (f != PLAN_DATA_AUTO && f != PLAN_DATA_LLMC && magic) {
    return err_set(err, errlen, DATA_EINVAL,
                   "data: %s starts with an llm.c header (magic %d, uint%d tokens) but data.format is %s; "
                   "set data.format to llmc or auto",
                   path, magic == 2 ? LLMC_MAGIC : LLMC_MAGIC_U32, 8 * magic, data_format_name(f));
  }
  if (f == PLAN_DATA_LLMC && !magic) {
    return err_set(err, errlen, DATA_EINVAL, "data: %s has no llm.c header (magic %d or %d) but data.format is llmc",
                   path, LLMC_MAGIC, LLMC_MAGIC_U32);
  }
  if (f != PLAN_DATA_AUTO) return (int)f;
  if (ends_with(path, ".u16")) return PLAN_DATA_U16;
  if (ends_with(path, ".u32")) return PLAN_DATA_U32;
  if (ends_with(path, ".txt") || ends_with(path, ".text") || ends_with(path, ".md")) return PLAN_DATA_TEXT;
  err_set(err, errlen, 0,
          "data: cannot tell the format of %s (no llm.c header; extension not .txt/.u16/.u32); "
          "set data.format to text, llmc, u16 or u32",
          path);
  return DATA_EINVAL;
}

static uint32_t shard_token(const data_shard_t *sh, size_t i) {
  const unsigned char *b = sh->tokens + i * (size_t)sh->width;
  if (sh->width == 1) return b[0];
  if (sh->width == 2) return (uint32_t)b[0] | (uint32_t)b[1] << 8;
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static void stream_free(data_stream_t *s) {
  for (int i = 0; i < s->n_shards; i++) {
    data_shard_t *sh = &s->shards[i];
    if (sh->map_len) munmap(sh->map, sh->map_len);
    else free(sh->map);
    free(sh->path);
  }
  free(s->shards);
  memset(s, 0, sizeof *s);
}

static data_shard_t *stream_add(data_stream_t *s, const char *path, char *err, size_t errlen) {
  data_shard_t *v = realloc(s->shards, (size_t)(s->n_shards + 1) * sizeof *v);
  if (!v) {
    err_set(err, errlen, 0, "data: out of memory for the shard list");
    return NULL;
  }
  s->shards = v;
  data_shard_t *sh = &v[s->n_shards];
  memset(sh, 0, sizeof *sh);
  if (!(sh->path = strdup(path))) {
    err_set(err, errlen, 0, "data: out of memory for the shard list");
    return NULL;
  }
  s->n_shards++;
  sh->start = s->n;
  return sh;
}

/* v as 4 little-endian bytes at p, as token files hold ids (the tokens in memory read alike). */
static void put_le32(void *p, uint32_t v) {
  unsigned char *b = p;
  b[0] = (unsigned char)v, b[1] = (unsigned char)(v >> 8), b[2] = (unsigned char)(v >> 16), b[3] = (unsigned char)(v >> 24);
}

/* A text shard's bytes, encoded through tok, become its tokens: uint32 ids in memory (the
 * mapping is let go), so the rest of data sees an id shard like any other. */
static int encode_shard(data_shard_t *sh, const tokenizer_t *tok, char *err, size_t errlen) {
  int32_t *ids = NULL;
  size_t n = 0;
  char why[512];
  if (tokenizer_encode(tok, (const char *)sh->tokens, sh->n, &ids, &n, why, sizeof why) != 0) {
    return err_set(err, errlen, DATA_EINVAL, "data: %s: cannot encode it with data.tokenizer: %s", sh->path, why);
  }
  for (size_t i = 0; i < n; i++) put_le32(&ids[i], (uint32_t)ids[i]);
  if (sh->map_len) munmap(sh->map, sh->map_len);
  sh->map = ids;
  sh->map_len = 0;
  sh->tokens = (const unsigned char *)ids;
  sh->width = 4;
  sh->n = n;
  return 0;
}

/* Maps one file of format f as the stream's next shard: its header checked, its ids checked
 * against vocab (a pass over the mapped tokens, at memory speed). */
static int map_shard(data_stream_t *s, const char *path, plan_data_format_t f, int vocab, const tokenizer_t *tok,
                     char *err, size_t errlen) {
  if (check_regular(path, err, errlen)) return DATA_EIO;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return err_set(err, errlen, DATA_EIO, "data: cannot open %s: %s", path, strerror(errno));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    err_set(err, errlen, 0, "data: cannot read %s: %s", path, strerror(errno));
    close(fd);
    return DATA_EIO;
  }
  size_t len = (size_t)st.st_size;
  void *map = NULL;
  if (len > 0 && (map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0)) == MAP_FAILED) {
    err_set(err, errlen, 0, "data: cannot map %s: %s", path, strerror(errno));
    close(fd);
    return DATA_EIO;
  }
  close(fd);
  data_shard_t *sh = stream_add(s, path, err, errlen);
  if (!sh) {
    if (map) munmap(map, len);
    return DATA_ENOMEM;
  }
  sh->map = map;
  sh->map_len = len;
  const unsigned char *raw = map;
  switch (f) {
  case PLAN_DATA_TEXT: sh->width = 1; sh->n = len; sh->tokens = raw; break;
  case PLAN_DATA_U16: sh->width = 2; sh->n = len / 2; sh->tokens = raw; break;
  case PLAN_DATA_U32: sh->width = 4; sh->n = len / 4; sh->tokens = raw; break;
  case PLAN_DATA_LLMC: {
    int32_t hdr[LLMC_HEADER_INTS];
    if (len < sizeof hdr) {
      return err_set(err, errlen, DATA_EINVAL, "data: %s: too short for an llm.c header (%zu bytes, need %zu)", path,
                     len, sizeof hdr);
    }
    memcpy(hdr, raw, sizeof hdr);
    int width = hdr[0] == LLMC_MAGIC && hdr[1] == 1 ? 2 : hdr[0] == LLMC_MAGIC_U32 && hdr[1] == 7 ? 4 : 0;
    if (!width || hdr[2] < 0) {
      err_set(err, errlen, 0,
              "data: %s: bad llm.c header (magic %d, version %d, count %d; want magic %d version 1, or "
              "magic %d version 7)",
              path, hdr[0], hdr[1], hdr[2], LLMC_MAGIC, LLMC_MAGIC_U32);
      return DATA_EINVAL;
    }
    sh->width = width;
    sh->n = (size_t)hdr[2];
    sh->tokens = raw + sizeof hdr;
    if ((len - sizeof hdr) / (size_t)width < sh->n) {
      return err_set(err, errlen, DATA_EINVAL, "data: %s: header says %zu tokens but the file holds %zu", path, sh->n,
                     (len - sizeof hdr) / (size_t)width);
    }
    break;
  }
  default:
    err_set(err, errlen, 0, "data: %s: format %s is not a file format", path, data_format_name(f));
    return DATA_EINVAL;
  }
  if (f == PLAN_DATA_TEXT && tok) {
    int rc = encode_shard(sh, tok, err, errlen);
    if (rc) return rc;
  } else if (sh->width > 1 && f != PLAN_DATA_LLMC && len % (size_t)sh->width != 0) {
    return err_set(err, errlen, DATA_EINVAL, "data: %s: %zu bytes is not a whole number of %s tokens", path, len,
                   data_format_name(f));
  }
  if ((uint64_t)vocab < (1ull << (8 * sh->width)))
    for (size_t i = 0; i < sh->n; i++) {
      uint32_t id = shard_token(sh, i);
      if (id >= (uint32_t)vocab) {
        return err_set(err, errlen, DATA_EINVAL, "data: %s: token id %u at position %zu is >= model.vocab_size %d",
                       path, id, i, vocab);
      }
    }
  s->n += sh->n;
  return 0;
}

/* The files of key (a path, glob or list, a line each) as one stream; every file's format
 * resolved under f, and all of them ids or all text (*is_text, *first_format). Text is encoded
 * through tok when there is one. */
static int map_stream(data_stream_t *s, const char *key, const char *lines, plan_data_format_t f, int vocab,
                      const tokenizer_t *tok, int *is_text, plan_data_format_t *first_format, char *err,
                      size_t errlen) {
  char **paths = NULL, bad[512];
  size_t n = 0;
  int rc = fs_expand_paths(lines, &paths, &n, bad, sizeof bad);
  if (rc) {
    if (rc == -ENOENT)
      err_set(err, errlen, 0, "data: %s: no file matches %s", key, bad);
    else
      err_set(err, errlen, 0, "data: %s: cannot expand %s: %s", key, bad, strerror(-rc));
    return rc == -ENOENT ? DATA_EIO : DATA_ENOMEM;
  }
  for (size_t i = 0; rc == 0 && i < n; i++) {
    int g = data_detect_format(paths[i], f, err, errlen);
    if (g < 0) {
      rc = g;
      break;
    }
    int text = g == PLAN_DATA_TEXT;
    if (*is_text < 0) {
      *is_text = text;
      *first_format = (plan_data_format_t)g;
    } else if (*is_text != text) {
      err_set(err, errlen, 0, "data: %s: %s is %s but the shards before it are %s; a split is all text or all ids", key,
              paths[i], text ? "text" : "token ids", text ? "token ids" : "text");
      rc = DATA_EINVAL;
      break;
    }
    rc = map_shard(s, paths[i], (plan_data_format_t)g, vocab, tok, err, errlen);
  }
  fs_paths_free(paths);
  return rc;
}

/* A first-order Markov chain: token t goes to succ[t] with probability 3/4, else anywhere. Kept
 * as the stream's one shard of uint32 ids. */
static int make_synthetic(data_stream_t *s, uint64_t seed, int vocab, size_t n, char *err, size_t errlen) {
  uint32_t *tok = malloc(n * sizeof(uint32_t));
  int32_t *succ = malloc((size_t)vocab * sizeof(int32_t));
  data_shard_t *sh = tok && succ ? stream_add(s, "(synthetic)", err, errlen) : NULL;
  if (!sh) {
    free(tok);
    free(succ);
    return err_set(err, errlen, DATA_ENOMEM, "data: out of memory for %zu synthetic tokens", n);
  }
  rng_t r;
  rng_init(&r, seed ^ DATA_SALT, rng_hash_str("synthetic"));
  for (int v = 0; v < vocab; v++) succ[v] = (int32_t)rng_below(&r, (uint64_t)vocab);
  int32_t cur = (int32_t)rng_below(&r, (uint64_t)vocab);
  for (size_t i = 0; i < n; i++) {
    put_le32(&tok[i], (uint32_t)cur);
    cur = rng_below(&r, 4) < 3 ? succ[cur] : (int32_t)rng_below(&r, (uint64_t)vocab);
  }
  free(succ);
  sh->map = tok;
  sh->tokens = (const unsigned char *)tok;
  sh->width = 4;
  sh->n = n;
  s->n = n;
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
  if (p->data.format == PLAN_DATA_SYNTHETIC) {
    d->format = PLAN_DATA_SYNTHETIC;
    train_name = "(synthetic)";
    size_t n = DATA_SYNTHETIC_TOKENS;
    if (n < 4 * need) n = 4 * need;
    if ((rc = make_synthetic(&d->train_src, p->seed, d->vocab_size, n, err, errlen))) return rc;
  } else {
    if (!train_name[0]) {
      return err_set(err, errlen, DATA_EINVAL,
                     "data: data.train is empty; give a token file or set data.format to synthetic");
    }
    tokenizer_t *tok = NULL; /* data.tokenizer, for encoding text shards */
    char why[512];
    if (p->data.tokenizer[0] && tokenizer_load_within(&tok, p->data.tokenizer, d->vocab_size, why, sizeof why)) {
      return err_set(err, errlen, DATA_EINVAL, "data: data.%s", why);
    }
    int is_text = -1;
    rc = map_stream(&d->train_src, "data.train", train_name, p->data.format, d->vocab_size, tok, &is_text,
                    &d->format, err, errlen);
    if (rc == 0 && p->data.val[0]) {
      plan_data_format_t vf;
      rc = map_stream(&d->val_src, "data.val", p->data.val, p->data.format, d->vocab_size, tok, &is_text, &vf,
                      err, errlen);
    }
    const int encoded = tok != NULL;
    tokenizer_free(tok);
    if (rc) {
      data_free(d);
      return rc;
    }
    d->is_text = is_text == 1 && !encoded; /* encoded text is ids, not bytes */
    if (d->train_src.n_shards > 1) train_name = "data.train";
  }
  d->n_train = d->train_src.n;
  if (d->val_src.n_shards) {
    d->n_val = d->val_src.n;
  } else if (p->data.val_fraction > 0) {
    d->n_val = (size_t)((double)d->train_src.n * p->data.val_fraction);
    d->n_train -= d->n_val;
  }

  if (d->n_train < need) {
    err_set(err, errlen, 0,
            "data: %s: the train split has %zu tokens, fewer than one sequence (train.seq_len + 1 = %zu)%s", train_name,
            d->n_train, need, d->n_val && !p->data.val[0] ? "; lower data.val_fraction or train.seq_len" : "");
    data_free(d);
    return DATA_EINVAL;
  }
  if (need_val && d->n_val < need) {
    err_set(err, errlen, 0,
            "data: %s: the validation split has %zu tokens, fewer than one sequence (train.seq_len + 1 = %zu); "
            "raise data.val_fraction, give data.val, or set eval.interval to 0",
            p->data.val[0] ? (d->val_src.n_shards > 1 ? "data.val" : p->data.val) : train_name, d->n_val, need);
    data_free(d);
    return DATA_EINVAL;
  }
  return 0;
}

void data_free(data_t *d) {
  if (!d) return;
  stream_free(&d->train_src);
  stream_free(&d->val_src);
  memset(d, 0, sizeof *d);
}

/* count tokens of s from off into dst as int32, across shard boundaries. */
static void stream_copy(const data_stream_t *s, size_t off, size_t count, int32_t *dst) {
  int lo = 0, hi = s->n_shards - 1; /* the last shard starting at or before off */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (s->shards[mid].start <= off) lo = mid;
    else hi = mid - 1;
  }
  for (int k = lo; count > 0 && k < s->n_shards; k++) {
    const data_shard_t *sh = &s->shards[k];
    size_t i = off - sh->start;
    for (; i < sh->n && count > 0; i++, count--, off++) *dst++ = (int32_t)shard_token(sh, i);
  }
}

static const data_stream_t *val_stream(const data_t *d, size_t *base) {
  *base = d->val_src.n_shards ? 0 : d->n_train;
  return d->val_src.n_shards ? &d->val_src : &d->train_src;
}

int32_t data_train_token(const data_t *d, size_t i) {
  int32_t t;
  stream_copy(&d->train_src, i, 1, &t);
  return t;
}

int32_t data_val_token(const data_t *d, size_t i) {
  size_t base;
  const data_stream_t *s = val_stream(d, &base);
  int32_t t;
  stream_copy(s, base + i, 1, &t);
  return t;
}

/* Copies the window starting at off (of the stream at base) into row i of tokens/targets. */
static void put_window(const data_stream_t *s, size_t off, int t, int i, int32_t *tokens, int32_t *targets) {
  int32_t *row = tokens + (size_t)i * t;
  stream_copy(s, off, (size_t)t, row);
  memcpy(targets + (size_t)i * t, row + 1, (size_t)(t - 1) * sizeof(int32_t));
  stream_copy(s, off + (size_t)t, 1, targets + (size_t)i * t + t - 1);
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
    put_window(&d->train_src, off, t, i, tokens, targets);
  }
}

void data_eval_batch(const data_t *d, int k, int b, int32_t *tokens, int32_t *targets) {
  const int t = d->seq_len;
  size_t base;
  const data_stream_t *s = val_stream(d, &base);
  for (int i = 0; i < b; i++) {
    rng_t r;
    rng_init(&r, d->seed ^ EVAL_SALT, (uint64_t)k * (uint64_t)b + (uint64_t)i);
    size_t off = (size_t)rng_below(&r, d->n_val - (size_t)t);
    put_window(s, base + off, t, i, tokens, targets);
  }
}
