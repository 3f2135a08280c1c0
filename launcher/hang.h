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
 * On a job of several nodes the judgement is the job's (launcher/hang_share.h): each node adds
 * its ranks' step changes to one counter in the workers' store, and only the job's node 0
 * judges, when neither its own ranks nor that counter moved for the timeout (a node whose ranks
 * all wait for another node's rank is not the only judge). It then asks every node through the
 * store; each asks its own ranks as above and publishes their dumps as digests; node 0 gathers
 * them for up to HANG_GATHER_WAIT_MS, writes the other nodes' into its log folder beside its own
 * (<attempt>/<rank>/, so that `meshrun diagnose` there sees every rank), logs the diagnosis of
 * every rank and calls back its agent, whose failure ends the round on every node. The other
 * nodes log one line and wait for that end.
 *
 * Not here: stopping workers (the agent), reading dumps (diagnose). */
#ifndef MESHRUN_HANG_H
#define MESHRUN_HANG_H

#include <uv.h>

#include "launcher/diagnose.h"
#include "launcher/hang_share.h"
#include "launcher/workers.h"

#define HANG_POLL_MS 250       /* the most between two reads of the progress files */
#define HANG_DUMP_WAIT_MS 1500 /* how long the dumps may take (each thread's stack: ms) */
/* Node 0 of several: how long after its ask it waits for the other nodes' digests (their dumps,
 * a tick of their watch and a store call or two beyond its own). */
#define HANG_GATHER_WAIT_MS (HANG_DUMP_WAIT_MS + 2 * HANG_POLL_MS + 5 * HANG_SHARE_POLL_MS)

typedef struct hang hang_t;
/* The diagnosis is logged; summary is its first line, named the rank it names (NULL: none; its
 * node and local_rank are set on a job of several nodes), valid during the call. */
typedef void (*hang_cb)(hang_t *h, const char *summary, const diag_rank_t *named, void *arg);

/* NULL with err when out of memory; timeout_s > 0. */
hang_t *hang_create(uv_loop_t *loop, double timeout_s, hang_cb cb, void *arg);
/* A round's workers started: watch them. job: the round's nodes and the store they share (see
 * above); NULL, or a round of one node, watches this node alone. */
void hang_watch(hang_t *h, workers_t *wk, const hang_share_config_t *job);
/* The round is ending (stopping, a failure elsewhere): no more watching or asking. */
void hang_unwatch(hang_t *h);
/* Closes the timer (run the loop afterwards), then frees once it closed. Accepts NULL. */
void hang_close(hang_t *h);

#endif
