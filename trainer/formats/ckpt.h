/* ckpt: distributed checkpoints that load under any other layout (like torch.distributed.checkpoint).
 *
 * What a checkpoint holds. Every rank saves CHUNKS of full (global, unsplit) tensors: a chunk is
 * (kind, tensor name, full shape (rows, cols), a box = rows [r0, r1) x cols [c0, c1) of the full
 * tensor, a flat range [a, b) in the row-major order of that box) and its b - a floats. Tensor
 * parallelism gives boxes (a tp rank's rows or columns); FSDP's flat shards of a unit cut tensors
 * at any element, hence the flat range. Kinds are short names: "param", "adam_m", "adam_v".
 * Loading asks for any region in the same terms and assembles it from whichever saved chunks
 * overlap it, so the saving and the loading layouts are independent (fsdp4 -> fsdp2, tp2 ->
 * fsdp4, 8 ranks -> 6). ckpt_chunks_add_range / ckpt_read_range translate between chunks and the
 * model's flat layout (model_tensor_t offsets, tp_split), so a strategy only names its ranges.
 *
 * On disk, <dir>/step-<N>/:
 *   shard-<rank>.safetensors  one per rank: chunk i as F32 tensor "<kind>/<name>#<i>", and the
 *                             geometry of all chunks in __metadata__["meshrun.chunks"], one line
 *                             per chunk: "kind name rows cols r0 r1 c0 c1 a b".
 *   metadata.json             written by rank 0: format version, step, optimizer step, data
 *                             position (samples consumed, a global count), RNG state, model shape,
 *                             world size and mesh, the plan, every file's size and CRC32C, the
 *                             global tensor list (kind, name, full shape, chunk count), extra
 *                             key/values; and its own CRC32C, as the first member on the first
 *                             line: {"metadata_crc32c": "0x1234abcd", then the rest of the
 *                             document, every byte of which (from the newline that ends that
 *                             line to the end of the file) the CRC covers.
 * <dir>/latest holds "step-<N>": the newest committed checkpoint.
 *
 * Save protocol (collective over the group): rank 0 deletes leftover *.tmp directories and
 * creates step-<N>.tmp; barrier; every rank writes and fsyncs its shard there and computes its
 * size and CRC; the ranks' results are gathered to rank 0, which (only if all succeeded) reads
 * back every shard's chunk list and refuses a checkpoint in which some tensor is not covered
 * exactly once (a strategy that forgot a range fails at save, not at resume), writes
 * metadata.json, fsyncs it and the directory, renames step-<N>.tmp -> step-<N>, fsyncs <dir>,
 * writes latest.tmp, fsyncs, renames it onto latest, fsyncs <dir>, then prunes: checkpoints newer
 * than N (an abandoned timeline: the run was resumed from an older one) and all but the `keep`
 * newest. Directories are removed by first renaming them to *.tmp. A crash at any point leaves
 * the previous checkpoint and `latest` intact; *.tmp directories are never loaded (so do not
 * keep files of your own named *.tmp in the checkpoint directory: the next save removes them).
 * Exact duplicate chunks (replicas that all saved) are harmless: the loader keeps one.
 *
 * Asynchronous saves (config.async): ckpt_writer_save copies the chunks' data (host memory), does
 * the collective preparation, and returns; a thread writes the shard while training goes on. The
 * commit (gather, metadata, rename, latest) is collective, and comms are not thread-safe, so it
 * runs on the caller's thread at the first of: ckpt_writer_poll finding every rank's writer done
 * (poll is collective: call it on every rank at the same steps, e.g. every step), the next
 * ckpt_writer_save, ckpt_writer_wait, ckpt_writer_destroy. Until then `latest` names the previous
 * checkpoint. At most one save is in flight.
 *
 * A save that fails (any rank's write, the commit) fails on every rank with the same message
 * and code, and rank 0 removes its step-<N>.tmp (except when the test hook stopped it: that
 * stands for a crash, which cleans nothing; the next save removes leftovers). CKPT_ENOSPC says
 * the cause was a lack of space (ENOSPC, EDQUOT) on some rank; callers may stop rather than
 * retry. The writer stays usable after a failed save.
 *
 * Load (ckpt_open): "auto" follows `latest`, then tries the other step-<N> directories newest
 * first; a checkpoint whose metadata is unreadable or fails its own checksum, or whose file has
 * the wrong size or CRC, is skipped with a warning naming the file ("checkpoint error:
 * ckpt/step-40/shard-2.safetensors: checksum mismatch (expected 0x1234abcd, got 0x0badf00d);
 * falling back to step-30"). A model shape that differs from the caller's is refused, never
 * skipped. With a group, the CRC work is split across ranks and the verdict is shared, so every
 * rank picks the same checkpoint.
 *
 * Every value of a checkpoint that opens is a finite number: each rank scans the chunks of the
 * files it verified, and a NaN or an infinity in any kind (parameters, AdamW moments) refuses
 * the checkpoint with CKPT_ENONFINITE, naming the tensor and the element (its index in the full
 * tensor, row-major): "checkpoint error: ck/step-40: tensor adam_v/norm.weight element 7 is nan
 * (not a finite number)". Its files passed their checksums, so the run saved it so: training
 * had diverged. "auto" does not fall back to an older checkpoint then, as it does for damage:
 * batches are a function of (seed, step), so the same plan would replay the same steps into the
 * same divergence, and the first save of that replay would prune the diverged checkpoint, the
 * evidence. The caller stops instead (the trainer exits 2, which meshrun does not restart), and
 * the message names the older checkpoint that a person may resume from by name, after changing
 * what diverged.
 *
 * Format versions: 2 added the metadata checksum. Version 1 checkpoints (no checksum) are not
 * loaded: the format is young and a metadata file nothing vouches for could resume on a wrong
 * optimizer step; they are named as version 1 in the message, like any unreadable checkpoint.
 *
 * Not here: dtypes other than fp32; tensors of more than 2 dimensions; filesystems not shared
 * by all ranks (resharding reads other ranks' files); big-endian hosts. */
#ifndef MESHRUN_CKPT_H
#define MESHRUN_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/comm/comm.h"
#include "trainer/model/model.h"

#define CKPT_FORMAT_VERSION 2 /* 2: metadata.json carries its own CRC32C */

enum {
  CKPT_OK = 0,
  CKPT_EINVAL = -1,   /* bad argument */
  CKPT_EIO = -2,      /* a system call failed (message names the path and errno text) */
  CKPT_ECORRUPT = -3, /* a file is missing, truncated, fails its checksum, or is inconsistent */
  CKPT_ESHAPE = -4,   /* model or tensor shape differs from the caller's */
  CKPT_ENOENT = -5,   /* no checkpoint (auto: the directory has none), or no such tensor */
  CKPT_ENOMEM = -6,
  CKPT_ECOMM = -7,    /* a collective of the group failed */
  CKPT_ENOSPC = -8,   /* a write failed for lack of space (ENOSPC or EDQUOT) */
  CKPT_ENONFINITE = -9, /* an intact checkpoint holds a NaN or an infinity (the run diverged) */
};
const char *ckpt_strerror(int code);

/* The model's shape, recorded at save and compared at load. */
typedef struct {
  int dim, n_layers, n_heads, n_kv_heads, vocab_size, hidden_dim;
} ckpt_shape_t;
void ckpt_shape_from_plan(ckpt_shape_t *s, const plan_model_t *m);

/* A chunk to save, or (data ignored) a region to read. */
typedef struct {
  const char *kind;        /* "param", "adam_m", "adam_v"; [A-Za-z0-9_.-], at most 23 bytes */
  const char *name;        /* full tensor name; [A-Za-z0-9_.-], at most 127 bytes */
  int64_t rows, cols;      /* full shape; 1-D tensors are (n, 1) */
  int64_t r0, r1, c0, c1;  /* the box */
  int64_t a, b;            /* flat range in the box's row-major order, 0 <= a <= b <= box numel */
  const float *data;       /* b - a floats, host memory (save only) */
} ckpt_chunk_t;

/* The scalar state of a checkpoint, saved and loaded. */
#define CKPT_RNG_MAX 16
#define CKPT_EXTRA_MAX 32
#define CKPT_KEY_MAX 64
#define CKPT_VAL_MAX 256
typedef struct {
  int64_t step;           /* training step the checkpoint was taken after (names step-<N>) */
  int64_t optim_step;     /* optimizer updates taken (optim_t.step) */
  uint64_t data_position; /* samples consumed, summed over all ranks */
  int n_rng;
  uint64_t rng[CKPT_RNG_MAX];
  int n_extra;
  char extra_key[CKPT_EXTRA_MAX][CKPT_KEY_MAX];
  char extra_val[CKPT_EXTRA_MAX][CKPT_VAL_MAX];
} ckpt_state_t;
/* Adds or replaces an extra key/value (truncated to the limits). Returns 0 or CKPT_EINVAL (full). */
int ckpt_state_set(ckpt_state_t *s, const char *key, const char *value);
const char *ckpt_state_get(const ckpt_state_t *s, const char *key); /* NULL when absent */

/* The ranks that save or load together, as two host-memory collectives. NULL = world of one.
 * ckpt_group_from_comm wraps a comm_t whose buffers are host memory (the cpu backend); under
 * nccl, wrap the cpu side channel of your choice (store, or device staging) the same way. */
typedef struct {
  int rank, size;
  /* Each rank contributes `bytes`; out (size * bytes) gets rank i's at out + i * bytes. */
  int (*all_gather)(void *ctx, const void *in, void *out, size_t bytes);
  /* root's `bytes` into everyone's buf. */
  int (*broadcast)(void *ctx, void *buf, size_t bytes, int root);
  void *ctx;
} ckpt_group_t;
void ckpt_group_from_comm(ckpt_group_t *g, comm_t *c);

/* --- building chunks from the model's flat layout */
typedef struct ckpt_chunks {
  ckpt_chunk_t *v;
  int n, cap;
} ckpt_chunks_t;
/* Appends the chunks of the flat-layout range [offset, offset + count) of this rank's local
 * tensors (tensors[0..n_tensors): model_tensor() copies; offsets and shapes are tp-local, with
 * tp_split and full_shape saying where the local slice sits in the full tensor) for tp rank
 * tp_rank. data points at the range's first float (host) and must live until the save. Tensors
 * replicated across tp are only saved by tp rank 0 (the others hold the same values). kind is
 * borrowed (a string literal). Returns 0 or CKPT_ENOMEM. */
int ckpt_chunks_add_range(ckpt_chunks_t *cs, const char *kind, const model_tensor_t *tensors, int n_tensors,
                          int tp_rank, size_t offset, size_t count, const float *data);
void ckpt_chunks_free(ckpt_chunks_t *cs); /* accepts a zeroed list */

/* --- saving */
typedef struct ckpt_writer ckpt_writer_t;
typedef struct {
  const char *dir;        /* checkpoint directory, created if absent (one level) */
  int keep;               /* newest checkpoints kept; <= 0 keeps all */
  int async;              /* write shards on a thread (see above) */
  const ckpt_group_t *group; /* copied; NULL = world of one */
  ckpt_shape_t shape;
  int mesh[3];            /* dp_replicate, dp_shard, tp (recorded, not interpreted) */
  const char *plan_json;  /* plan_to_json() text, copied; may be NULL */
  /* Test hook, with the step being saved. Called on rank 0 at "before_commit" (shards written,
   * nothing else), "before_rename" (metadata written) and "before_latest" (renamed): a nonzero
   * return stops the save right there, as a crash would (its .tmp stays), and the save fails
   * on every rank. Called on every rank at "write" before it writes its shard (on the writer
   * thread when async): a nonzero return is taken as the errno of a failed write (EIO, ENOSPC),
   * and the save fails as a real write error would. */
  int (*hook)(const char *point, int64_t step, void *arg);
  void *hook_arg;
} ckpt_writer_config_t;

int ckpt_writer_create(ckpt_writer_t **out, const ckpt_writer_config_t *cfg, char *err, size_t errlen);
/* Saves st->step with this rank's chunks (collective; every rank calls it, with any number of
 * chunks, including none; n_chunks < 0 says this rank could not collect its state, and the save
 * then fails on every rank: no chunks would commit a checkpoint without this rank's tensors
 * whenever it is their only holder). Sync: returns when step-<N> is committed. Async: returns after
 * copying the data; an earlier in-flight save is committed first, and its error, if any, is
 * returned here. Returns 0 or a negative code with "checkpoint error: ..." in err. */
int ckpt_writer_save(ckpt_writer_t *w, const ckpt_state_t *st, const ckpt_chunk_t *chunks, int n_chunks,
                     char *err, size_t errlen);
/* Async: commits the in-flight save if every rank's writer is done (collective). *committed
 * (may be NULL) is set to the step committed by this call, or -1. */
int ckpt_writer_poll(ckpt_writer_t *w, int64_t *committed, char *err, size_t errlen);
/* Waits for and commits the in-flight save (collective); 0 when none. */
int ckpt_writer_wait(ckpt_writer_t *w, char *err, size_t errlen);
/* Waits for the in-flight save (collective when one is in flight) and frees; accepts NULL. */
void ckpt_writer_destroy(ckpt_writer_t *w);

/* --- loading */
typedef struct ckpt ckpt_t;
typedef struct {
  int version;
  ckpt_state_t state;
  ckpt_shape_t shape;
  int world_size;
  int mesh[3];
  const char *plan_json; /* as saved ("" when none) */
  const char *path;      /* the step directory that was opened, e.g. "ckpt/step-40" */
  const char *notes;     /* "" or the checkpoints skipped and why, one per line */
} ckpt_meta_t;

/* Opens a checkpoint (collective over group when given). which: "auto" (or NULL) = follow
 * <dir>/latest and fall back as described above; else a step directory: a path, or a name inside
 * dir ("step-30"); no fallback then. expect (may be NULL) is compared with the saved shape.
 * Returns 0; CKPT_ENOENT when there is no checkpoint to load; CKPT_ESHAPE; CKPT_ECORRUPT when
 * none is intact (err names the files); CKPT_ENONFINITE when the one tried first that is intact
 * holds a NaN or an infinity (no fallback; see above). */
int ckpt_open(ckpt_t **out, const char *dir, const char *which, const ckpt_shape_t *expect, const ckpt_group_t *group,
              char *err, size_t errlen);
void ckpt_close(ckpt_t *ck); /* accepts NULL */
/* The checkpoint ckpt_open(dir, which) would most likely load, from its metadata.json alone (its
 * own checksum checked; shards not read): one process, no group, cheap enough to call before
 * anything starts. *state gets its scalar state and path (pathlen bytes) its step directory.
 * Returns 0; CKPT_ENOENT when there is no checkpoint there; CKPT_ECORRUPT when there are step
 * directories but no readable metadata (ckpt_open will name the damage). */
int ckpt_peek(const char *dir, const char *which, ckpt_state_t *state, char *path, size_t pathlen);
const ckpt_meta_t *ckpt_meta(const ckpt_t *ck);
/* Whether the checkpoint holds any chunk of (kind, name). */
int ckpt_has(const ckpt_t *ck, const char *kind, const char *name);
/* Fills out (b - a floats) with the region (data ignored) from the saved chunks. Every element
 * must be covered. Returns 0, CKPT_ENOENT (no such tensor), CKPT_ESHAPE (full shape differs),
 * CKPT_EINVAL (bad region) or CKPT_ECORRUPT (not covered). */
int ckpt_read(ckpt_t *ck, const ckpt_chunk_t *region, float *out, char *err, size_t errlen);
/* The whole tensor (kind, name), numel floats, as its full shape lays it out (row-major): for
 * a reader that knows names and sizes, not the saving layout (`trainer sample`). Returns 0,
 * CKPT_ENOENT (no such tensor), CKPT_ESHAPE (it has another number of elements) or
 * CKPT_ECORRUPT (not covered). */
int ckpt_read_tensor(ckpt_t *ck, const char *kind, const char *name, float *out, size_t numel, char *err,
                     size_t errlen);
/* The inverse of ckpt_chunks_add_range: fills the flat-layout range [offset, offset + count)
 * of this tp rank's local tensors (replicated ones included) from the checkpoint. */
int ckpt_read_range(ckpt_t *ck, const char *kind, const model_tensor_t *tensors, int n_tensors, int tp_rank,
                    size_t offset, size_t count, float *out, char *err, size_t errlen);

/* Whether an I/O message names a lack of space: strerror(ENOSPC) or strerror(EDQUOT) in it.
 * For errors that reach us only as text (st_write's). */
int ckpt_msg_is_nospace(const char *msg);

/* CRC32C (Castagnoli) of buf, continuing from crc (0 to start): the checksum of every file. */
uint32_t ckpt_crc32c(uint32_t crc, const void *buf, size_t len);
/* The same with tables only (what non-x86 hosts use), for tests. */
uint32_t ckpt_crc32c_portable(uint32_t crc, const void *buf, size_t len);

#endif
