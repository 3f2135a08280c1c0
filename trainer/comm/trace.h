/* trace: a timeline of the training steps as Chrome trace events (log.trace_file), which
 * chrome://tracing and Perfetto (ui.perfetto.dev) open: PyTorch's profiler trace, for this
 * trainer.
 *
 * One process per rank (pid = rank), one track per thread of work: "compute" (the main thread:
 * a span per step, per unit's forward and backward, and the time it was blocked waiting on a
 * collective, "wait <op> <group>"), and one per communicator ("comm dp_shard.0"), where each
 * collective is a span from the moment the backend started moving bytes to its end. With
 * overlap, the comm spans of the next unit's all-gather run under the current unit's compute
 * span; the exposed communication is the compute track's "wait" spans.
 *
 * Every rank writes into the same file: rank 0 creates (truncates) it and writes the opening
 * "[", before the mesh connects; the other ranks open it only once the mesh has connected
 * (trace_attach), so none touches a file that rank 0 then refuses (an earlier run's trace) or
 * truncates after it; each rank appends its events a step at a time with one write() of whole
 * lines (O_APPEND: lines of different ranks never interleave). The trailing
 * "]" is left out, which the JSON array format allows (both viewers accept it). Ranks on other
 * machines write their own file at the same path. Only the first log.trace_steps steps of a run
 * are traced, so the file stays small; outside them every call here is one branch.
 *
 * Thread-safe: the comm observer runs on the communicators' progress threads. */
#ifndef MESHRUN_TRACE_H
#define MESHRUN_TRACE_H

#include <stdint.h>
#include <stddef.h>

/* Return code of a trace that cannot be written (the path too long, the file not opened), with
 * the reason in err. */
#define TRACE_EIO (-1)

/* Opens the trace for this rank (path "" or NULL: tracing stays off). 0, or TRACE_EIO with err. Also
 * installs the comm observer (comm_set_observer): call before the mesh connects. */
int trace_open(const char *path, int rank, int steps, char *err, size_t errlen);
/* A rank other than 0, after the mesh connected: opens the file and writes what it buffered.
 * 0 (also when tracing is off or already attached), or TRACE_EIO with err. */
int trace_attach(char *err, size_t errlen);
void trace_close(void); /* writes what is buffered; accepts a trace never opened */

/* Step s (1-based) begins / ends; events are kept only between them, for s <= steps. */
void trace_step_begin(int step);
void trace_step_end(void);
int trace_active(void);

int64_t trace_now_ns(void); /* CLOCK_MONOTONIC, the clock of every event */
/* A complete span on the compute track (name and category copied). */
void trace_span(const char *name, const char *cat, int64_t t0_ns, int64_t t1_ns);

#endif
