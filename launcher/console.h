/* console: one console line for a line that several local ranks print at about the same time.
 *
 * With eight workers a node, every line the workers all print (a warning, a banner, a
 * traceback of a collective that failed everywhere) reaches the console eight times, each with
 * its "[rank<R>]:". A console_t (one per stream: stdout and stderr are merged apart) takes the
 * workers' whole lines in the order meshrun reads them and prints each distinct line once,
 * prefixed with the set of ranks that printed it: "[ranks 0-3,6]:LINE". A line that one rank
 * printed alone keeps today's "[rank<R>]:LINE", byte for byte.
 *
 * "About the same time" is a window: a line waits at most window_ns after the first rank
 * printed it for the others to print the same, and goes out at once when every rank still open
 * has printed it or has printed a later line (it cannot join any more). Lines go out in the
 * order they were first seen, and a rank's own lines never change order: a rank joins only a
 * waiting line that comes after the last one it joined. Lines longer than CONSOLE_MERGE_MAX
 * bytes are never merged (they still keep their place in the order). What waits is bounded
 * (CONSOLE_MAX_WAITING lines, CONSOLE_MAX_BYTES): beyond it the oldest goes out early.
 *
 * Lines that differ only by the rank's own number in a leading "[NAME r<R>/<W>]" (the
 * trainer's log prefix, common/log.h, where R is the worker's RANK) match: the merged line
 * shows "r*" there, since the rank set in front says which ranks printed it. Any other
 * difference, a rank number elsewhere in the line included, keeps lines apart.
 *
 * Not here: reading the pipes, per-rank log files (complete and unmerged, launcher/workers),
 * the timer (the caller arms one for console_deadline). Single-threaded: the loop's thread. */
#ifndef MESHRUN_CONSOLE_H
#define MESHRUN_CONSOLE_H

#include <stddef.h>
#include <stdint.h>

/* The default window, in milliseconds; MESHRUN_MERGE_WINDOW_MS sets another (launcher/workers). */
#define CONSOLE_WINDOW_MS 100
#define CONSOLE_MERGE_MAX 4096
#define CONSOLE_MAX_WAITING 1024
#define CONSOLE_MAX_BYTES (4u << 20)

/* Where a finished line goes: one whole line, prefix and '\n' included, to be written at once. */
typedef void (*console_write_fn)(void *arg, const char *line, size_t n);

typedef struct console console_t;

/* A console for n slots (local ranks) whose global ranks are first_rank + slot; no slot is open
 * until console_open. Returns 0 or -1 (out of memory). */
int console_create(console_t **out, int n, int first_rank, uint64_t window_ns, console_write_fn write_fn,
                   void *arg);
/* Everything still waiting goes out; accepts NULL. */
void console_destroy(console_t *c);
/* The slot's stream reaches the console: its lines are expected. */
void console_open(console_t *c, int slot);
/* The slot's stream ended (EOF, the rank exited): no line of it is waited for any more. What it
 * printed goes out with its lines' groups (console_deadline says when). */
void console_close(console_t *c, int slot, uint64_t now);
/* One whole line of the slot's (without its '\n'), read at now (ns, any monotonic clock). */
void console_line(console_t *c, int slot, const char *p, size_t n, uint64_t now);
/* Sends out what is due at now; returns the next deadline (UINT64_MAX when nothing waits). */
uint64_t console_flush_due(console_t *c, uint64_t now);
/* Sends out everything waiting. */
void console_flush_all(console_t *c);
/* When the oldest waiting line is due; UINT64_MAX when nothing waits. */
uint64_t console_deadline(const console_t *c);

/* Pure helpers, exposed for the unit test. */
/* "0-3,6": sorted distinct ranks, runs of three or more written first-last. The length it needs
 * (as snprintf: out may be short; it is always terminated when outlen > 0). */
size_t console_format_ranks(const int *ranks, int n, char *out, size_t outlen);
/* Where the rank's own number sits in a line that starts "[NAME r<rank>/<W>]" (NAME without
 * spaces or brackets, W digits): *at its offset and *len its digits. 0 when found, else -1. */
int console_rank_field(const char *p, size_t n, int rank, size_t *at, size_t *len);

#endif
