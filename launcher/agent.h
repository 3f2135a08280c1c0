/* agent: one meshrun process, as a state machine per round on one libuv loop.
 *
 *   JOINING --assigned--> RUNNING --all exited 0--> FINISHING --done--> exit 0
 *                           |  a worker failed, a peer node died, a node is waiting
 *                           v
 *                        STOPPING (SIGTERM, grace, SIGKILL) --round end known, workers idle-->
 *                           JOINING the next round | exit with the root cause's code (fatal)
 *
 * The loop also serves the store (when this node could bind the rendezvous endpoint), the
 * signal handlers (forwarded to the workers; INT/TERM/HUP then shut down) and the timers. The
 * rendezvous itself runs on rdzv's threads. Not here: parsing flags (launcher/cli), process
 * details (launcher/workers), store keys (launcher/rdzv). */
#ifndef MESHRUN_AGENT_H
#define MESHRUN_AGENT_H

#include "launcher/cli.h"

/* The rendezvous store, reached before, is gone: its node died, stopped answering for
 * heartbeat_timeout, or cannot be reached (c10d's single point of failure). 69 is EX_UNAVAILABLE
 * of BSD sysexits.h, "a service is unavailable": outside the codes meshrun uses for itself (1,
 * 2, 127, 128+N) and rare as a worker's own code, so a wrapper script can tell "resubmit the
 * job, the store's host is gone" from "the program failed". */
#define AGENT_EXIT_STORE_LOST 69

/* Runs the whole job and returns meshrun's exit status: 0, the root-cause worker's code
 * (128+signal for a signal; also at once, without restarts, when that failure is permanent:
 * exit 2 or 78, an error file asking for none, or a Python import failure, see
 * launcher/errfile.h), 128+sig when meshrun was told to stop, AGENT_EXIT_STORE_LOST, or 1 for
 * other launcher errors (each one printed as a line naming the cause). */
int agent_run(launcher_opts_t *opts);

#endif
