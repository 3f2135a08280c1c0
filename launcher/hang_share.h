/* hang_share: the hang watch's view across the nodes of a job, through the store its workers
 * use (MESHRUN_STORE: the rendezvous store with c10d, the round's first node's with etcd; every
 * node reaches it, whichever rendezvous backend runs).
 *
 * One thread with a store client of its own does every store call (the loop never blocks);
 * the loop hands it what to write and reads what it found, under one lock. Keys of round R,
 * under the job's namespace:
 *   meshrun/hang/r<R>/progress   a counter every node adds its own step changes to: while it
 *                                moves, some rank of the job still finishes steps
 *   meshrun/hang/r<R>/ask        set by the node that judged the job hung (group rank 0): every
 *                                node then asks its ranks for dumps
 *   meshrun/hang/r<R>/dumps/<N>  node N's dumps, as digests (launcher/diagnose.h: diag_format),
 *                                gathered by the asking node
 * The thread calls every HANG_SHARE_POLL_MS, every HANG_SHARE_FAST_MS once an ask is out. A
 * store it cannot reach costs one warning; the watch then sees this node alone.
 *
 * Not here: the judgement and the dumps (launcher/hang.c). */
#ifndef MESHRUN_HANG_SHARE_H
#define MESHRUN_HANG_SHARE_H

#include <stddef.h>
#include <stdint.h>

#define HANG_SHARE_POLL_MS 100
#define HANG_SHARE_FAST_MS 20
#define HANG_SHARE_MAX (1u << 20) /* the most bytes of one node's digests */

typedef struct {
  char endpoint[300]; /* host:port of the store */
  const char *secret; /* the job secret ("" or NULL: an open store) */
  const char *run_id; /* the job's namespace */
  int round;          /* keys of this round only */
  int node, nnodes;   /* this node's group rank, the round's node count */
} hang_share_config_t;

typedef struct hang_share hang_share_t;

/* Starts the thread. NULL when out of memory or no thread can start (logged). */
hang_share_t *hang_share_start(const hang_share_config_t *cfg);
/* Stops the thread (its call in progress fails at once), joins it and frees. Accepts NULL. */
void hang_share_stop(hang_share_t *s);

/* This node's ranks finished delta more steps (added to the job's counter on the next call). */
void hang_share_progress(hang_share_t *s, uint64_t delta);
/* The job's counter as last read (0 before the first read). */
uint64_t hang_share_counter(hang_share_t *s);
/* Asks every node for its dumps. */
void hang_share_ask(hang_share_t *s);
/* 1 once the ask key was seen (this node's own ask included). */
int hang_share_asked(hang_share_t *s);
/* Publishes this node's digests (copied; at most HANG_SHARE_MAX bytes, cut at a digest). */
void hang_share_publish(hang_share_t *s, const char *text, size_t len);
/* The asking node: starts reading the other nodes' digests. */
void hang_share_gather(hang_share_t *s);
/* How many other nodes' digests are in; text (malloc'ed, the caller frees) their digests
 * one after the other, NULL when none. */
int hang_share_gathered(hang_share_t *s, char **text, size_t *len);

#endif
