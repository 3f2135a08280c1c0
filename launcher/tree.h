/* tree: whatever a worker starts stays within meshrun's reach, and none of it outlives its round
 * or meshrun, kill -9 of meshrun included.
 *
 * Three parts, each cheap while there is nothing to kill:
 *  - meshrun is the child subreaper of everything below it (PR_SET_CHILD_SUBREAPER): a process
 *    whose parent ends (a daemon's double fork, the child of a worker that exited) becomes
 *    meshrun's child, not init's, and setsid changes a session, never a parent. So once a
 *    round's workers are reaped, "meshrun has no child left" (waitid: ECHILD) is the exact test
 *    for "the round left nothing": one system call, no /proc walk.
 *  - Where cgroup v2 is writable (meshrun can make a cgroup below its own, with cgroup.kill:
 *    Linux 5.14), meshrun moves itself into a cgroup of the job's, once, on a thread of its own
 *    while it joins the rendezvous (the first move in a while waits an RCU grace period, a few
 *    ms; a round that starts before is handled as without a cgroup); the workers are born in
 *    it, and so is everything they start. What a round left is then listed by the cgroup's
 *    cgroup.procs. Elsewhere, or with MESHRUN_CGROUP=0, meshrun reads every
 *    /proc/<pid>/stat for the processes whose chain of parents leads to it. Either way they get
 *    SIGKILL, again at each SIGCHLD until none is left (a fork that races the kill is caught by
 *    the next pass).
 *  - The guard, a process made before any thread starts and kept out of the cgroup, cleans up
 *    after a meshrun that died without doing so (kill -9, a crash). It blocks on a pipe whose
 *    only writer is meshrun: EOF without meshrun's "done" means meshrun is gone. It then writes
 *    the cgroup's cgroup.kill, which no fork can race, or, without a cgroup, SIGKILLs the round's
 *    process groups and every process whose environment holds this meshrun's id (MESHRUN_TREE,
 *    which setsid and double forks keep), until none is left. Either way it removes the cgroup
 *    and exits. Without a cgroup, a process that both leaves its worker's process group and
 *    clears its environment escapes the guard (never meshrun itself). The guard has a process
 *    group of its own, so a signal to meshrun's group (Ctrl-C, a supervisor's killpg) leaves it
 *    to its work; it is a "clone" child (no exit signal), which waitid without __WALL never sees,
 *    so it does not count as a child left.
 * Not here: spawning and reaping the workers (launcher/workers: reap() calls tree_kill once a
 * round's workers are gone and children are left). */
#ifndef MESHRUN_TREE_H
#define MESHRUN_TREE_H

#include <stddef.h>
#include <sys/types.h>

typedef struct tree tree_t;

/* Makes meshrun the subreaper, the job's cgroup (unless use_cgroup is 0, or cgroup v2 is not
 * writable here: the /proc way then, said at debug level) and the guard (without one, a
 * warning). Must run before any thread starts: the guard is a copy of this process. Returns 0,
 * or -ENOMEM with err set. */
int tree_create(tree_t **out, int use_cgroup, char *err, size_t errlen);
/* This meshrun's id, "<pid>.<16 hex digits>", for its workers' MESHRUN_TREE. */
const char *tree_id(const tree_t *t);
/* A round's workers are about to start: born in the cgroup once meshrun is in it (before, the
 * round is handled as without a cgroup; the /proc way for good if meshrun could not get in); the
 * guard forgets the last round's process groups. Never waits. */
void tree_round(tree_t *t);
/* A worker's process group, for the guard to kill if meshrun dies (without the cgroup only). */
void tree_note_group(tree_t *t, pid_t pgid);
/* SIGKILL to every process below meshrun but the guard, workers included; returns how many got
 * it. One waitid when there is none; the dead are left for the caller to reap. */
int tree_kill(tree_t *t);
/* Tells the guard that all is clean when meshrun has no child left (else it kills what is, after
 * meshrun's exit), and frees t; accepts NULL. The guard's pipe stays open until meshrun exits:
 * then the guard removes the cgroup (meshrun is in it until then) and exits. */
void tree_destroy(tree_t *t);

#endif
