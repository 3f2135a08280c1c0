/* hang: meshrun's hang watch (--hang_timeout), on the agent's loop.
 *
 * Each worker that reports its steps (MESHRUN_PROGRESS_FILE, launcher/workers.h; the trainer
 * does) is read every HANG_POLL_MS at most. Once any has reported, when no reporting worker's
 * step changed for the timeout while every worker runs, the watch asks each reporting worker
 * for a dump (common/dump.h's signal; not one that /proc shows stopped), waits for the dumps up
 * to HANG_DUMP_WAIT_MS, writes a stub for each worker that did not answer (launcher/diagnose.h),
 * logs the diagnosis (its summary line first) and calls back the agent, which stops and
 * restarts the workers as for a failure. One diagnosis per round: the watch then waits for the
 * next hang_watch.
 *
 * The diagnosis covers this node's ranks: on a job of several nodes, each node whose ranks stop
 * stepping prints its own. Not here: stopping workers (the agent), reading dumps (diagnose). */
#ifndef MESHRUN_HANG_H
#define MESHRUN_HANG_H

#include <uv.h>

#include "launcher/workers.h"

#define HANG_POLL_MS 250       /* the most between two reads of the progress files */
#define HANG_DUMP_WAIT_MS 1500 /* how long the dumps may take (each thread's stack: ms) */

typedef struct hang hang_t;
/* The diagnosis is logged; summary is its first line, rank the rank it names (-1: none). */
typedef void (*hang_cb)(hang_t *h, const char *summary, int rank, void *arg);

/* NULL with err when out of memory; timeout_s > 0. */
hang_t *hang_create(uv_loop_t *loop, double timeout_s, hang_cb cb, void *arg);
/* A round's workers started: watch them. */
void hang_watch(hang_t *h, workers_t *wk);
/* The round is ending (stopping, a failure elsewhere): no more watching or asking. */
void hang_unwatch(hang_t *h);
/* Closes the timer (run the loop afterwards), then frees once it closed. Accepts NULL. */
void hang_close(hang_t *h);

#endif
