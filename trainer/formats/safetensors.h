/* safetensors: write and read the safetensors format (Hugging Face), fp32 and int32 tensors.
 *
 * Layout: u64 little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [r, c], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {"key": "value", ...}}
 * (padded with spaces to a multiple of 8), then the tensor bytes, offsets relative to the end
 * of the header. st_write writes to "<path>.tmp.<pid>", fsyncs, renames onto path and fsyncs
 * the directory: readers see the old file or the whole new one, never a torn one.
 * st_open maps the file read-only and validates every entry (dtype, shape product against the
 * byte range, ranges inside the file) before returning; a corrupt file is refused with a
 * message naming the problem. It does not convert dtypes (bf16/f16 files are refused) and
 * does not write big-endian hosts' bytes (x86/arm little-endian only). */
#ifndef MESHRUN_SAFETENSORS_H
#define MESHRUN_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 8

enum {
  ST_OK = 0,
  ST_EINVAL = -1,   /* bad argument from the caller */
  ST_EIO = -2,      /* open/read/write/fsync/rename failed (errno text in the message) */
  ST_ECORRUPT = -3, /* the file is not valid safetensors */
  ST_ENOMEM = -4,
};

typedef enum { ST_F32 = 0, ST_I32 = 1 } st_dtype_t;

/* One tensor, for writing (data is host memory) and as returned by the reader (data points
 * into the mapped file and lives until st_close). */
typedef struct {
  const char *name;
  st_dtype_t dtype;
  int ndim; /* 0..ST_MAX_DIMS */
  int64_t shape[ST_MAX_DIMS];
  const void *data;
  size_t nbytes; /* reader: byte length; writer: ignored (computed from shape and dtype) */
} st_tensor_t;

/* Writes n tensors in the given order and n_meta (key, value) string pairs:
 * meta[2*i] is a key, meta[2*i+1] its value (meta may be NULL when n_meta is 0).
 * Returns 0 or a negative ST_E* code with a message in err. */
int st_write(const char *path, const st_tensor_t *tensors, int n, const char *const *meta, int n_meta, char *err,
             size_t errlen);

typedef struct st_file st_file_t;

/* Opens and validates path. Returns 0 and *out, or a negative code with a message in err. */
int st_open(st_file_t **out, const char *path, char *err, size_t errlen);
void st_close(st_file_t *f); /* accepts NULL */
int st_num_tensors(const st_file_t *f);
const st_tensor_t *st_tensor_at(const st_file_t *f, int i);       /* in file (offset) order */
const st_tensor_t *st_find(const st_file_t *f, const char *name); /* NULL when absent */
/* Value of a __metadata__ key, NULL when absent. */
const char *st_metadata(const st_file_t *f, const char *key);
/* Number of elements of a tensor (product of its shape; 1 for a scalar). */
size_t st_numel(const st_tensor_t *t);

/* Whether x[0..n) are all finite numbers: 0, or 1 (a finding, not an error) with *at the first
 * element that is a NaN or an infinity and *what its name ("nan", "inf" or "-inf"). One pass over
 * the floats, in blocks the compiler vectorizes; every reader of weights and checkpoints checks
 * what it reads with it. */
int st_check_finite(const float *x, size_t n, size_t *at, const char **what);

#endif
