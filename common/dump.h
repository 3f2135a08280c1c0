/* dump: what the trainer's flight recorder and meshrun agree on about its dumps: the folder a
 * worker writes them to, and the signal with which meshrun asks a worker for one. Writing a
 * dump is the trainer's (trainer/comm/comm_flight.c); reading dumps and naming the rank that
 * hangs a job is meshrun's (launcher/diagnose.c, launcher/hang.c).
 *
 * Files: flight-rank<RANK>-pid<PID>-<n>.jsonl, n = 1, 2, ... per process (comm.h says what is
 * in them). meshrun writes flight-rank<RANK>-pid<PID>-noanswer.jsonl, a header alone, for a
 * worker that did not answer its request (stopped, or stuck where signals wait). */
#ifndef MESHRUN_DUMP_H
#define MESHRUN_DUMP_H

#include <stddef.h>

/* The signal meshrun sends a worker for a dump and nothing else (SIGRTMIN + 5). Not SIGUSR1:
 * meshrun forwards SIGUSR1, and under the trainer's checkpoint.on_signal it also means "save
 * and stop". A worker that has not installed a handler for it dies of it (the default action):
 * meshrun sends it only to workers that report their progress, which the trainer does after
 * installing the handler. */
int dump_signal(void);
/* The folder of a worker's dumps: MESHRUN_DUMP_DIR when set; else the folder of its error file
 * (error_file: its TORCHELASTIC_ERROR_FILE, the rank's log folder under meshrun) when that is an
 * existing folder; else /tmp/meshrun-dumps-<uid>. Into dir; 0 or -ENAMETOOLONG. Makes nothing. */
int dump_folder(const char *error_file, char *dir, size_t len);

#endif
