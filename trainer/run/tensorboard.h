/* tensorboard: the run's scalars as a TensorBoard event file (log.tensorboard_dir), which
 * TensorBoard, and anything that reads its files, shows as one run per folder.
 *
 * A file is a sequence of TFRecord records (the length as 8 bytes little-endian, its masked
 * CRC32C, the bytes, their masked CRC32C), each an Event message of TensorBoard's (our subset of
 * it, trainer/run/tensorboard.proto, encoded by protobuf-c): first the file version
 * "brain.Event:2", then SessionLog START at the first step this run logs, then one event per
 * tensorboard_write, its values the scalars added since the last (float32, as TensorBoard keeps
 * them). Every event goes out in one write(2) as it is made, so a run that is killed leaves a
 * file TensorBoard reads up to the last whole event.
 *
 * Each writer makes a new file, events.out.tfevents.<seconds>.<host>.<pid>, named to sort after
 * every event file already in the folder (its seconds are bumped past theirs when a run starts
 * again within the same second): TensorBoard reads a folder's files in name order, and the
 * START record makes it drop what the earlier files logged from that step on. A run resumed from
 * step k (or restarted from scratch) thus reads as one run with its steps logged once.
 *
 * Only rank 0 writes (metrics.c opens it); every call accepts a NULL writer and does nothing.
 * Single-threaded, like the metrics. A failed write is one warning, no later event is written,
 * and tensorboard_close reports it (as the metrics file does). Returns 0, or -1 with the message
 * in err. */
#ifndef MESHRUN_TENSORBOARD_H
#define MESHRUN_TENSORBOARD_H

#include <stddef.h>
#include <stdint.h>

typedef struct tensorboard tensorboard_t;

/* Scalars one event may carry; tensorboard_add past them warns once and drops the value. */
#define TENSORBOARD_MAX_VALUES 32

/* Makes the event file in dir (which must exist: the plan's check makes it) and writes its
 * first two records, START at step first_step. */
int tensorboard_open(tensorboard_t **out, const char *dir, int first_step, char *err, size_t errlen);
/* Adds one scalar to the next event. tag is kept by pointer until tensorboard_write (a string
 * literal, "train/loss"). */
void tensorboard_add(tensorboard_t *tb, const char *tag, double value);
/* Writes the values added since the last write as one event at step, stamped with the wall
 * clock; nothing when none were added. */
void tensorboard_write(tensorboard_t *tb, int step);
/* Closes the file and frees tb. 0, or -1 when a write failed, with the message in err (NULL:
 * not wanted) and *no_space (when non-NULL) set when it was a lack of space. */
int tensorboard_close(tensorboard_t *tb, int *no_space, char *err, size_t errlen);

/* A run that starts afresh does not write beside an earlier run's events unless the plan says
 * overwrite (main.c's check of the outputs): -1 with "plan error: log.tensorboard_dir: ..."
 * naming an event file dir holds, else 0 (none, or no such folder). */
int tensorboard_check_fresh(const char *dir, char *err, size_t errlen);

/* CRC32C of n bytes, masked as TFRecord masks it (rotated right by 15 bits, plus 0xa282ead8:
 * a CRC of data that holds CRCs). */
uint32_t tensorboard_masked_crc(const void *data, size_t n);

#endif
