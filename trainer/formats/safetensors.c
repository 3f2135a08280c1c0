/* safetensors: the writer (temp file, fsync, rename) and the mmap-based validating reader.
 *
 * The JSON header is built and parsed with cJSON; integers in it are 64-bit byte counts that
 * cJSON holds as doubles, exact up to 2^53 bytes, which no file here reaches. The reader keeps
 * the mapping and a copy of every name and metadata string; nothing in st_file_t points into
 * the cJSON tree, which is deleted before st_open returns. */
#include "trainer/formats/safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"

/* Headers larger than this are refused (the reference implementation uses 100 MB). */
#define ST_MAX_HEADER ((uint64_t)100 << 20)

struct st_file {
  void *map;
  size_t map_len;
  int n;
  st_tensor_t *tensors; /* sorted by data offset */
  char **names;
  int n_meta;
  char **meta; /* key, value, key, value, ... */
};

static const char *dtype_name(st_dtype_t d) { return d == ST_I32 ? "I32" : "F32"; }
static size_t dtype_size(st_dtype_t d) {
  (void)d;
  return 4;
}

size_t st_numel(const st_tensor_t *t) {
  size_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    n *= (size_t)t->shape[i];
  return n;
}

/* A block is tested without a branch per element (NaN fails every comparison, so !(|v| <= max)
 * catches both kinds); only a block that holds one is searched element by element. */
int st_check_finite(const float *x, size_t n, size_t *at, const char **what) {
  enum { BLOCK = 1024 };
  for (size_t lo = 0; lo < n; lo += BLOCK) {
    const size_t hi = n - lo < BLOCK ? n : lo + BLOCK;
    int bad = 0;
    for (size_t i = lo; i < hi; i++) bad |= !(fabsf(x[i]) <= FLT_MAX);
    for (size_t i = lo; bad && i < hi; i++)
      if (!isfinite(x[i])) {
        *at = i;
        *what = isnan(x[i]) ? "nan" : x[i] > 0 ? "inf" : "-inf";
        return 1;
      }
  }
  return 0;
}

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t w = write(fd, p, len > (1u << 30) ? (1u << 30) : len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

/* Builds the JSON header text, padded with spaces to a multiple of 8 bytes. */
static char *build_header(const st_tensor_t *ts, int n, const char *const *meta, int n_meta, size_t *out_len, char *err,
                          size_t errlen) {
  cJSON *root = cJSON_CreateObject();
  if (!root) return NULL;
  if (n_meta > 0) {
    cJSON *md = cJSON_AddObjectToObject(root, "__metadata__");
    for (int i = 0; md && i < n_meta; i++)
      cJSON_AddStringToObject(md, meta[2 * i], meta[2 * i + 1] ? meta[2 * i + 1] : "");
  }
  uint64_t off = 0;
  for (int i = 0; i < n; i++) {
    cJSON *e = cJSON_AddObjectToObject(root, ts[i].name);
    if (!e) break;
    cJSON_AddStringToObject(e, "dtype", dtype_name(ts[i].dtype));
    cJSON *shape = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; shape && d < ts[i].ndim; d++)
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)ts[i].shape[d]));
    uint64_t nb = (uint64_t)st_numel(&ts[i]) * dtype_size(ts[i].dtype);
    cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
    if (offs) {
      cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
      cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + nb)));
    }
    off += nb;
  }
  char *txt = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  if (!txt) {
    err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory building the header");
    return NULL;
  }
  size_t len = strlen(txt), padded = (len + 7) & ~(size_t)7;
  char *buf = malloc(padded + 1);
  if (!buf) {
    free(txt);
    err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory building the header");
    return NULL;
  }
  memcpy(buf, txt, len);
  memset(buf + len, ' ', padded - len);
  buf[padded] = 0;
  free(txt);
  *out_len = padded;
  return buf;
}

int st_write(const char *path, const st_tensor_t *tensors, int n, const char *const *meta, int n_meta, char *err,
             size_t errlen) {
  if (!path || n < 0 || (n > 0 && !tensors) || n_meta < 0 || (n_meta > 0 && !meta))
    return err_set(err, errlen, ST_EINVAL, "safetensors: invalid arguments to st_write");
  for (int i = 0; i < n; i++) {
    if (!tensors[i].name || !*tensors[i].name || !strcmp(tensors[i].name, "__metadata__"))
      return err_set(err, errlen, ST_EINVAL, "safetensors: tensor %d has no valid name", i);
    if (tensors[i].ndim < 0 || tensors[i].ndim > ST_MAX_DIMS)
      return err_set(err, errlen, ST_EINVAL, "safetensors: %s: ndim %d out of range", tensors[i].name, tensors[i].ndim);
    for (int d = 0; d < tensors[i].ndim; d++)
      if (tensors[i].shape[d] < 0)
        return err_set(err, errlen, ST_EINVAL, "safetensors: %s: negative dimension", tensors[i].name);
    if (!tensors[i].data && st_numel(&tensors[i]) > 0)
      return err_set(err, errlen, ST_EINVAL, "safetensors: %s: no data", tensors[i].name);
    for (int j = 0; j < i; j++)
      if (!strcmp(tensors[i].name, tensors[j].name))
        return err_set(err, errlen, ST_EINVAL, "safetensors: duplicate tensor name %s", tensors[i].name);
  }
  size_t hlen = 0;
  char *hdr = build_header(tensors, n, meta, n_meta, &hlen, err, errlen);
  if (!hdr) return ST_ENOMEM;

  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    int e = errno;
    free(hdr);
    return err_set(err, errlen, ST_EIO, "safetensors: open %s: %s", tmp, strerror(e));
  }
  unsigned char len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
  int rc = write_all(fd, len8, 8);
  if (!rc) rc = write_all(fd, hdr, hlen);
  for (int i = 0; !rc && i < n; i++)
    rc = write_all(fd, tensors[i].data, st_numel(&tensors[i]) * dtype_size(tensors[i].dtype));
  free(hdr);
  if (!rc && fsync(fd) != 0) rc = -errno;
  if (close(fd) != 0 && !rc) rc = -errno;
  if (rc) {
    unlink(tmp);
    return err_set(err, errlen, ST_EIO, "safetensors: write %s: %s", tmp, strerror(-rc));
  }
  if (rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    return err_set(err, errlen, ST_EIO, "safetensors: rename %s -> %s: %s", tmp, path, strerror(e));
  }
  /* The rename is durable only once the directory entry is on disk. */
  char dirbuf[4096];
  snprintf(dirbuf, sizeof dirbuf, "%s", path);
  int dfd = open(dirname(dirbuf), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return 0;
}

void st_close(st_file_t *f) {
  if (!f) return;
  if (f->map && f->map != MAP_FAILED) munmap(f->map, f->map_len);
  for (int i = 0; f->names && i < f->n; i++)
    free(f->names[i]);
  for (int i = 0; f->meta && i < 2 * f->n_meta; i++)
    free(f->meta[i]);
  free(f->names);
  free(f->meta);
  free(f->tensors);
  free(f);
}

static int cmp_offset(const void *a, const void *b) {
  const st_tensor_t *x = a, *y = b;
  const char *bx = x->data, *by = y->data;
  return bx < by ? -1 : bx > by;
}

/* A JSON number that is a non-negative integer no larger than max. */
static int json_uint(const cJSON *j, uint64_t max, uint64_t *out) {
  if (!cJSON_IsNumber(j)) return 0;
  double v = j->valuedouble;
  if (!(v >= 0) || v > (double)max || v != (double)(uint64_t)v) return 0;
  *out = (uint64_t)v;
  return 1;
}

/* Maps the file at path into a new *out (nothing parsed yet). */
static int map_file(st_file_t **out, const char *path, char *err, size_t errlen) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return err_set(err, errlen, ST_EIO, "safetensors: open %s: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    close(fd);
    return err_set(err, errlen, ST_EIO, "safetensors: stat %s: %s", path, strerror(e));
  }
  uint64_t fsize = (uint64_t)sb.st_size;
  if (fsize < 8) {
    close(fd);
    return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: file of %llu bytes is too short for a header", path,
                   (unsigned long long)fsize);
  }
  st_file_t *f = calloc(1, sizeof *f);
  if (!f) {
    close(fd);
    return err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory");
  }
  f->map_len = (size_t)fsize;
  f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (f->map == MAP_FAILED) {
    int e = errno;
    f->map = NULL;
    st_close(f);
    return err_set(err, errlen, ST_EIO, "safetensors: mmap %s: %s", path, strerror(e));
  }
  *out = f;
  return 0;
}

/* Copies the strings of the __metadata__ entry md into f->meta. */
static int read_metadata(st_file_t *f, const cJSON *md, const char *path, char *err, size_t errlen) {
  if (!cJSON_IsObject(md))
    return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: __metadata__ is not an object", path);
  int nm = cJSON_GetArraySize(md);
  char **meta = realloc(f->meta, (2 * ((size_t)f->n_meta + (size_t)nm) + 2) * sizeof *meta);
  if (!meta) return err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory");
  f->meta = meta;
  const cJSON *kv;
  cJSON_ArrayForEach(kv, md) {
    if (!cJSON_IsString(kv))
      return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: metadata %s is not a string", path, kv->string);
    f->meta[2 * f->n_meta] = strdup(kv->string);
    f->meta[2 * f->n_meta + 1] = strdup(kv->valuestring);
    f->n_meta++;
    if (!f->meta[2 * f->n_meta - 2] || !f->meta[2 * f->n_meta - 1])
      return err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory");
  }
  return 0;
}

/* Fills t's dtype and shape from an entry's "dtype" dt and "shape" sh, *numel with its count
 * of elements; name is the entry's, for the messages. */
static int read_dtype_shape(st_tensor_t *t, const cJSON *dt, const cJSON *sh, uint64_t *numel, const char *path,
                            const char *name, char *err, size_t errlen) {
  if (!strcmp(dt->valuestring, "F32"))
    t->dtype = ST_F32;
  else if (!strcmp(dt->valuestring, "I32"))
    t->dtype = ST_I32;
  else
    return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: %s has dtype %s (only F32 and I32 are supported)", path,
                   name, dt->valuestring);
  t->ndim = cJSON_GetArraySize(sh);
  if (t->ndim > ST_MAX_DIMS)
    return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: %s has %d dimensions (max %d)", path, name, t->ndim,
                   ST_MAX_DIMS);
  *numel = 1;
  for (int d = 0; d < t->ndim; d++) {
    uint64_t v;
    if (!json_uint(cJSON_GetArrayItem(sh, d), (uint64_t)1 << 40, &v))
      return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: %s has an invalid shape", path, name);
    t->shape[d] = (int64_t)v;
    *numel *= v;
    if (*numel > ((uint64_t)1 << 50))
      return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: %s has an impossible shape", path, name);
  }
  return 0;
}

/* Adds the tensor of header entry e as f's next one; its bytes lie within the data_len bytes
 * at data. */
static int read_tensor(st_file_t *f, const cJSON *e, const unsigned char *data, uint64_t data_len, const char *path,
                       char *err, size_t errlen) {
  const char *name = e->string;
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
  const cJSON *of = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
  if (!cJSON_IsObject(e) || !cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(of) ||
      cJSON_GetArraySize(of) != 2)
    return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: entry %s lacks dtype, shape or data_offsets", path,
                   name);
  st_tensor_t *t = &f->tensors[f->n];
  uint64_t numel = 0;
  int rc = read_dtype_shape(t, dt, sh, &numel, path, name, err, errlen);
  if (rc) return rc;
  uint64_t b0, b1;
  if (!json_uint(cJSON_GetArrayItem(of, 0), data_len, &b0) || !json_uint(cJSON_GetArrayItem(of, 1), data_len, &b1) ||
      b1 < b0)
    return err_set(err, errlen, ST_ECORRUPT,
                   "safetensors: %s: %s has data_offsets outside the %llu data bytes of the file (truncated?)", path,
                   name, (unsigned long long)data_len);
  if (b1 - b0 != numel * dtype_size(t->dtype))
    return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: %s spans %llu bytes but its shape needs %llu", path,
                   name, (unsigned long long)(b1 - b0), (unsigned long long)(numel * dtype_size(t->dtype)));
  f->names[f->n] = strdup(name);
  if (!f->names[f->n]) return err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory");
  t->name = f->names[f->n];
  t->data = data + b0;
  t->nbytes = (size_t)(b1 - b0);
  f->n++;
  return 0;
}

/* Reads every entry of the header object root: the metadata and the tensors. */
static int read_header(st_file_t *f, const cJSON *root, const unsigned char *data, uint64_t data_len,
                       const char *path, char *err, size_t errlen) {
  int count = cJSON_GetArraySize(root);
  f->tensors = calloc((size_t)count + 1, sizeof *f->tensors);
  f->names = calloc((size_t)count + 1, sizeof *f->names);
  f->meta = calloc(2 * (size_t)count + 2, sizeof *f->meta);
  if (!f->tensors || !f->names || !f->meta) return err_set(err, errlen, ST_ENOMEM, "safetensors: out of memory");
  const cJSON *e;
  cJSON_ArrayForEach(e, root) {
    int rc = !strcmp(e->string, "__metadata__") ? read_metadata(f, e, path, err, errlen)
                                                 : read_tensor(f, e, data, data_len, path, err, errlen);
    if (rc) return rc;
  }
  return 0;
}

/* Sorts f's tensors by offset (names travel with their tensors, so keep them in step) and
 * checks that no two overlap. */
static int sort_and_check_overlaps(st_file_t *f, const char *path, char *err, size_t errlen) {
  qsort(f->tensors, (size_t)f->n, sizeof *f->tensors, cmp_offset);
  for (int i = 0; i < f->n; i++)
    f->names[i] = (char *)f->tensors[i].name;
  for (int i = 1; i < f->n; i++) {
    const char *prev_end = (const char *)f->tensors[i - 1].data + f->tensors[i - 1].nbytes;
    if ((const char *)f->tensors[i].data < prev_end)
      return err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: tensors %s and %s overlap", path,
                     f->tensors[i - 1].name, f->tensors[i].name);
  }
  return 0;
}

int st_open(st_file_t **out, const char *path, char *err, size_t errlen) {
  *out = NULL;
  st_file_t *f = NULL;
  int rc = map_file(&f, path, err, errlen);
  if (rc) return rc;
  const unsigned char *bytes = f->map;
  uint64_t fsize = f->map_len, hlen = 0;
  for (int i = 0; i < 8; i++)
    hlen |= (uint64_t)bytes[i] << (8 * i);
  cJSON *root = NULL;
  if (hlen > ST_MAX_HEADER || hlen > fsize - 8) {
    rc = err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: header length %llu exceeds the file (%llu bytes)", path,
                 (unsigned long long)hlen, (unsigned long long)fsize);
    goto error;
  }
  root = cJSON_ParseWithLength((const char *)bytes + 8, (size_t)hlen);
  if (!cJSON_IsObject(root)) {
    rc = err_set(err, errlen, ST_ECORRUPT, "safetensors: %s: header is not a JSON object", path);
    goto error;
  }
  if ((rc = read_header(f, root, bytes + 8 + hlen, fsize - 8 - hlen, path, err, errlen))) goto error;
  if ((rc = sort_and_check_overlaps(f, path, err, errlen))) goto error;
  cJSON_Delete(root);
  *out = f;
  return 0;
error:
  cJSON_Delete(root);
  st_close(f);
  return rc;
}

int st_num_tensors(const st_file_t *f) { return f ? f->n : 0; }

const st_tensor_t *st_tensor_at(const st_file_t *f, int i) { return (f && i >= 0 && i < f->n) ? &f->tensors[i] : NULL; }

const st_tensor_t *st_find(const st_file_t *f, const char *name) {
  for (int i = 0; f && i < f->n; i++)
    if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
  return NULL;
}

const char *st_metadata(const st_file_t *f, const char *key) {
  for (int i = 0; f && i < f->n_meta; i++)
    if (!strcmp(f->meta[2 * i], key)) return f->meta[2 * i + 1];
  return NULL;
}
