/* workers: one round's worker processes on this node: spawn, environment, output, stop.
 *
 * Spawning is clone (CLONE_VM | CLONE_VFORK, as posix_spawn does) + exec done here, not
 * uv_spawn: libuv has no pre-exec hook, and every child must, before exec, enter its own
 * process group (setpgid) and ask to be SIGKILLed when meshrun dies (prctl PR_SET_PDEATHSIG, then getppid() to close the race with a parent that
 * died before the prctl). Exits are events: a uv_signal on SIGCHLD reaps with waitpid(pid,
 * WNOHANG), plus a fallback tick every --monitor_interval. Output comes back through pipes
 * read on the loop (uv_pipe_open): lines are prefixed "[rank<R>]:" when the world has more
 * than one worker (identical lines of several ranks merged into one by launcher/console, as
 * --merge_output says), filtered by --local_ranks_filter, copied to per-rank files under
 * <attempt_dir>/<rank>/{stdout,stderr}.log when there is a log dir. --redirects without tee
 * points the child's fd straight at its file (no pipe); a stream nobody needs goes to the
 * console directly or to /dev/null.
 *
 * stderr on the console always comes through a pipe (unprefixed: passed on raw, as it comes),
 * so that meshrun keeps its last WORKERS_TAIL_BYTES for the verdict on a failure (a file-only
 * stderr's tail is read from the file).
 *
 * Stopping is SIGTERM to each worker's process group, then SIGKILL to the groups still alive
 * after the grace period. Whatever a worker started is meshrun's to kill (launcher/tree): a
 * round is idle only when its workers are reaped, their output drained and meshrun has no child
 * left. Not here: deciding when to stop or restart (launcher/agent), rendezvous (launcher/rdzv). */
#ifndef MESHRUN_WORKERS_H
#define MESHRUN_WORKERS_H

#include <limits.h>
#include <stddef.h>
#include <sys/types.h>
#include <uv.h>

#include "launcher/cli.h"

/* The signals meshrun forwards to its workers (the agent handles them): with SIGCHLD, which
 * workers.c handles, and SIGPIPE, which meshrun ignores, what a worker sets back to default
 * before its exec. */
#define WORKERS_FORWARDED_SIGNALS SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2

/* What one round gives its workers (the environment) and where their files go. */
typedef struct {
  int restart_count; /* TORCHELASTIC_RESTART_COUNT: failure restarts so far, job-wide */
  int round;         /* MESHRUN_ROUND: the rendezvous round, unique per round */
  int rank_offset, world_size, group_rank, group_world_size, nproc;
  char master_addr[256];
  int master_port;
  char store_endpoint[300]; /* MESHRUN_STORE */
  char store_secret[CLI_SECRET_MAX + 1]; /* MESHRUN_RDZV_TOKEN; "" = an open store (not set) */
  char run_id[128];
  char job_id[448]; /* MESHRUN_JOB_ID: "<run id>@<rendezvous endpoint>", one value for every node,
                       round and restart of a job (the trainer's checkpoint lock knows its job) */
  int max_restarts;
  char attempt_dir[PATH_MAX]; /* <base>/attempt_<round>: <rank>/error.json and logs go below, or
                               <rank>.error.json for a rank that writes no log */
  int log_files;              /* write stdout.log/stderr.log for every stream */
  char file_prefix[200]; /* "" or, in a directory shared with other nodes, what starts this node's
                            file names there: <prefix>stop, <prefix><local rank>.error.json (by
                            local rank: the same names every round, so the node knows what to
                            remove when it exits) */
} workers_round_t;

typedef struct {
  int local_rank, rank;
  pid_t pid;
  int running;
  int exit_code;   /* valid when !running: exit status, or 128+signal */
  int term_signal; /* 0 unless killed by a signal */
  double exit_time; /* epoch seconds when reaped */
  char error_file[PATH_MAX];
} workers_info_t;

typedef struct workers workers_t;
/* A worker exited (on the loop thread). */
typedef void (*workers_exit_cb)(workers_t *w, const workers_info_t *info, void *arg);
/* Every worker of the round was reaped and its output drained. */
typedef void (*workers_idle_cb)(workers_t *w, void *arg);

/* Resolves PROGRAM as execvp would (a path when it has a '/', else along $PATH) into out.
 * Returns 0, or an errno with "no such file", "command not found" or "not executable" in why. */
int workers_find_program(const char *prog, char *out, size_t outlen, char *why, size_t whylen);

/* Also makes meshrun its workers' subreaper, their cgroup where it can (not with MESHRUN_CGROUP=0)
 * and the guard process (launcher/tree): call it before any thread starts. */
int workers_create(workers_t **out, uv_loop_t *loop, const launcher_opts_t *opts, workers_exit_cb on_exit,
                   workers_idle_cb on_idle, void *arg, char *err, size_t errlen);
/* Spawns the round's nproc workers. On error, the ones already started are killed and the
 * message names the cause ("exec ./train: Permission denied"). -ENOEXEC means the program
 * cannot run at all (not found, not executable, a script whose interpreter is missing):
 * meshrun exits 127 then, as a shell would. */
int workers_start(workers_t *w, const workers_round_t *round, char *err, size_t errlen);
/* Sends sig to every running worker's process group (forwarding). */
void workers_signal(workers_t *w, int sig);
/* sig (SIGTERM, or the signal being forwarded) now, SIGKILL to the groups still running after
 * grace_s. Idempotent: a second call does nothing. Before the signal, reason goes into the file
 * the workers find in MESHRUN_STOP_FILE (<attempt_dir>/stop), one word: "signal" (meshrun got
 * the signal it forwards: a preemption), "scale_up" (a node joins; every worker is healthy),
 * "failure" or "dead_node" (a worker or node is gone: peers may be stuck on it), "exit" (meshrun
 * itself is ending). A worker that can save its state (the trainer's checkpoint.on_signal) does
 * so for the first two and just ends for the others. */
void workers_stop(workers_t *w, int sig, double grace_s, const char *reason);
/* The file in which a worker reports the last step it finished, for --hang_timeout (its
 * MESHRUN_PROGRESS_FILE, set only when --hang_timeout is on): beside its error file, "progress"
 * in place of "error.json" (<rank>/progress, <rank>.progress). 0, or -EINVAL / -ENAMETOOLONG. */
int workers_progress_file(const workers_info_t *info, char *out, size_t len);
/* Unlinks the stop file and the last round's error files (in a temporary directory shared
 * with other nodes, at exit: file_prefix names them the same every round). */
void workers_remove_files(workers_t *w);
/* SIGKILL to every process group this round started, running or not, and to whatever else is
 * below meshrun (exit paths). */
void workers_kill_all(workers_t *w);
int workers_running(const workers_t *w);
/* 1 when no worker runs and every pipe is drained. */
int workers_idle(const workers_t *w);
const workers_info_t *workers_info(const workers_t *w, int local_rank);
int workers_count(const workers_t *w);
/* The last bytes (at most WORKERS_TAIL_BYTES and outlen) that a worker of this round wrote to
 * its stderr, read from its log file when it wrote there directly; 0 when its stderr went to
 * /dev/null (a rank --local_ranks_filter hides, without a log). Valid in the exit callback:
 * what the worker wrote before it exited is in. */
#define WORKERS_TAIL_BYTES 4096
size_t workers_stderr_tail(const workers_t *w, int local_rank, char *out, size_t outlen);
/* The Python that runs the workers into out: PROGRAM when its name starts with "python"
 * (as for *.py and -m), else the interpreter of its "#!" line when that is one (through
 * /usr/bin/env: found along PATH); "" when neither. */
void workers_python(const workers_t *w, char *out, size_t outlen);
/* Closes the handles (run the loop afterwards to let them close); accepts NULL. */
void workers_close(workers_t *w);
/* Frees w once workers_close's handles have closed (the loop ran); accepts NULL. */
void workers_destroy(workers_t *w);

#endif
