/* opprof: what each training step asks of the device, counted, and where one step's time goes,
 * kernel by kernel (MESHRUN_OP_PROFILE=STEP).
 *
 * Counting runs in every step: each call of a compute entry (a kernel: one launch or more on a
 * device backend), each call after which the host has waited for the device (a host sync:
 * synchronize, to_host, sumsq, sumsq_parts), and the bytes copied each way. On the cpu backend,
 * which runs the same model code, these are the numbers a GPU step would have, so tests hold
 * them to budgets and the benchmarks report them.
 *
 * It wraps every compute entry of a backend's table (matmul, attention, norms, the optimizer,
 * ...) so that, during the one step it profiles, each call is bracketed by two synchronizations
 * of the backend and timed on the host clock. The time of a call is then its device time plus
 * one launch and one synchronization, whose cost with nothing between them is measured once and
 * reported (the "sync floor"), so a reader can subtract it. Outside the profiled step each
 * wrapper is one branch and a call through the original table: the other steps run as before.
 *
 * Calls are grouped by kernel and shape (matmul by m, n, k, transposes and dtypes; attention by
 * b, t, h, kv, d; the rest by element count), and the report is a table sorted by time: calls,
 * total ms, mean us, share of the step, and for matmuls the achieved TFLOP/s. The step's time
 * outside the backend's kernels (host work, the comm's collectives, data) is the last row.
 *
 * Memory management is not timed: alloc, free, copy and zero pass straight through; to_device,
 * upload_async (bytes to the device), to_host and synchronize are counted only. upload_host_wait
 * is no host sync: it waits for a copy two uploads back (double buffering), never for a value
 * the device computed. Calls from other threads than the one that
 * installed the wrapper (a comm's progress thread) are neither counted nor timed. One backend
 * per process is wrapped (the trainer's). */
#ifndef MESHRUN_OPPROF_H
#define MESHRUN_OPPROF_H

#include <stdio.h>

#include "trainer/backend/backend.h"

#include <stdint.h>

/* What the device was asked to do. */
typedef struct {
  uint64_t kernels;    /* compute-entry calls */
  uint64_t host_syncs; /* synchronize, to_host, sumsq, sumsq_parts */
  uint64_t bytes_to_device, bytes_to_host;
  uint64_t allocs;     /* alloc, free (of a buffer), host_alloc_pinned */
} opcount_t;

/* The step to profile from MESHRUN_OP_PROFILE (1-based), 0 when unset or empty; -1 with a
 * message in err when it is not a positive integer. */
int opprof_step_from_env(char *err, size_t errlen);

/* Wraps be's compute entries and its host copies and synchronize (in place) so that every call is
 * counted and step `step` (1-based; 0: none) is profiled; the report goes to out (NULL: stderr).
 * Returns 0, or -1 when a backend is already wrapped. */
int opprof_install(backend_t *be, int step, FILE *out);
/* Undoes opprof_install (be's table as before); accepts a backend never wrapped. */
void opprof_uninstall(backend_t *be);

/* The trainer's step s (1-based) begins / ends. At the end of the profiled step the table is
 * printed. step_end takes the step's wall time in seconds (as the step line reports it). */
void opprof_step_begin(int step);
void opprof_step_end(int step, double step_s);
/* 1 inside the profiled step: its calls wait for the device around them, so it cannot be
 * recorded (train.h, graphs). */
int opprof_timing(void);

/* The counts since opprof_install, and those of the last step that ended (opprof_step_begin to
 * opprof_step_end); zeros when nothing is installed. */
void opprof_counts(opcount_t *total, opcount_t *last_step);

/* The replay watch: what a step recorded once (a CUDA graph) would replay, checked on any
 * backend. While watching, each call of the wrapped table between opprof_replay_mark(1) and
 * opprof_replay_mark(0) of a step (the part of the step a device would record: trainer/run/
 * train.c marks it) is kept as its op and arguments, pointers and scalars as passed, with the
 * host syncs and allocations there. opprof_replay_diff then compares the last step that ended
 * with the one `back` steps before it (1 or 2: the batches' two upload slots alternate, so with
 * an odd number of uploads per step the pointers repeat every second step): 0 when the calls are
 * the same and the marked part has no host sync and no allocation, 1 when not (msg names the
 * first call that differs, or the count), -1 when fewer steps were watched. watch(0) stops and
 * frees the lists; opprof_uninstall does too. */
void opprof_replay_watch(int on);
void opprof_replay_mark(int begin);
int opprof_replay_diff(int back, char *msg, size_t len);

/* For tests: after the profiled step, the number of calls and the total seconds recorded for an
 * op name ("matmul", "rmsnorm_fwd", ...) over every shape; 0 for a name never called. */
int opprof_calls(const char *op);
double opprof_seconds(const char *op);

#endif
