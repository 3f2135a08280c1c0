/* dirlock: one run at a time in a checkpoint directory.
 *
 * Two runs saving into one checkpoint.dir prune each other's checkpoints (a save removes those
 * newer than itself and all but `keep`), so the second to come would silently lose the first's
 * work. Rank 0 of a training run with checkpoint.dir holds <dir>/meshrun.lock for the run's
 * lifetime: one line "host H pid P job J since T" (J is MESHRUN_JOB_ID, which meshrun sets to
 * the same value on every node, round and restart of one job; "-" outside meshrun). A thread
 * touches the file every DIRLOCK_BEAT_S seconds while it is held, so that a holder on another
 * machine can be told alive from gone.
 *
 * Taking it: absent -> created (O_EXCL). Present and
 *   - the same job (a restart or a later round, also on another node): taken over, silently;
 *   - held by a process of this host that is gone (a crash, kill -9): taken over, one warning;
 *   - held by another host's process whose file was not touched for DIRLOCK_STALE_S: taken over,
 *     one warning;
 *   - otherwise: refused, with one line naming the holder and the ways out.
 * A takeover replaces the file by a rename, then reads it back: of two runs racing for a stale
 * lock, the one that does not find its own line refuses. Released (removed, if still this run's)
 * when the run ends, also after a failure; a lock left by a crash is what the rules above take
 * over. Not a guard against two runs started within the same instant on two machines of a
 * filesystem without atomic rename (NFS before v4 may say both won). */
#ifndef MESHRUN_DIRLOCK_H
#define MESHRUN_DIRLOCK_H

#include <stddef.h>

#define DIRLOCK_NAME "meshrun.lock"
#define DIRLOCK_BEAT_S 10
#define DIRLOCK_STALE_S 60

/* Takes dir's lock for this process. 0; 2 with "plan error: checkpoint.dir: ..." in err when
 * another run holds it; 1 with err when the file cannot be made or read (I/O). */
int dirlock_take(const char *dir, char *err, size_t errlen);
/* Stops the heartbeat and removes the lock when it is still this process's. Accepts no lock. */
void dirlock_release(void);

#endif
