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

/* Runs the whole job and returns meshrun's exit status: 0, the root-cause worker's code
 * (128+signal for a signal), 128+sig when meshrun was told to stop, or 1 for launcher errors
 * (each one printed as a line naming the cause). */
int agent_run(launcher_opts_t *opts);

#endif
