/* diagnose: which rank hangs a job, from the flight recorder's dumps of its ranks (the trainer's
 * comm.h says what a dump holds; common/dump.h where they are).
 *
 * A dump is read into a diag_rank_t: the rank, host and pid; per communicator (group, by name)
 * its size and the sequence numbers of its last call issued and last call completed, with the
 * op of the call after the last completed one and of the last completed one; and the top frames
 * of the main thread. A rank that did not answer meshrun's request has a stub instead (its host,
 * pid and /proc state: 'T' is a stopped process), which meshrun also writes as a file, so that a
 * later `meshrun diagnose DIR` reads the same facts.
 *
 * The diagnosis, per group: N = the lowest last-completed number over its members, plus one:
 * the call the group is stuck on. Members that issued N wait in it; members that did not never
 * entered it; a group with fewer members than its size lacks the ranks that sent no dump. Its
 * first line names the rank to look at (a stub first, then a rank that skipped the call others
 * wait in (recorded "skipped": it went on to later calls), then a rank that never entered the
 * call that others wait in); the lines after say, per stuck group, who waits and who is missing, and
 * per named rank its last completed call and top frames.
 *
 * Pure functions over memory and files; no libuv, no signals (launcher/hang.c asks for dumps). */
#ifndef MESHRUN_DIAGNOSE_H
#define MESHRUN_DIAGNOSE_H

#include <stddef.h>
#include <stdint.h>

#define DIAG_MAX_COMMS 32
#define DIAG_FRAMES 4
#define DIAG_NAME_MAX 64

typedef struct {
  char name[DIAG_NAME_MAX];
  int size;
  uint64_t issued, done;
  char next_op[16];     /* the op of call done + 1 when the ring holds it, else "" */
  uint64_t next_bytes;
  char done_op[16];     /* the op of call done, else "" */
  uint64_t skipped;     /* the newest call the ring records as skipped (a test's fault), else 0 */
  char skipped_op[16];
} diag_comm_t;

typedef struct {
  int rank, pid;
  char host[128];
  int node;          /* the node (group rank) of a job of several nodes, else -1 */
  int local_rank;    /* its local rank there, -1 when not known (a dump alone does not say) */
  int answered;      /* 1: a dump; 0: a stub, the rank did not answer */
  char state;        /* a stub's /proc state ('T' or 't': stopped), 0 when unknown */
  double unix_time;  /* when the dump (or stub) was written */
  int ncomms;
  diag_comm_t comms[DIAG_MAX_COMMS];
  int nframes;
  char frames[DIAG_FRAMES][96]; /* the main thread's top frames: function names, innermost first */
} diag_rank_t;

/* One dump's text (JSON lines, header first) into r. 0, or -EINVAL with err naming what is
 * wrong (no header line, a header without rank). Lines it cannot read otherwise are skipped. */
int diag_parse(const char *text, size_t len, diag_rank_t *r, char *err, size_t errlen);
/* diag_parse of a file. 0, or -errno / -EINVAL with err naming the file. */
int diag_parse_file(const char *path, diag_rank_t *r, char *err, size_t errlen);
/* A stub: a rank that did not answer. */
void diag_stub(diag_rank_t *r, int rank, int pid, const char *host, char state);
/* What diag_parse keeps of r, as a dump's text again (malloc'ed into *out, *len its bytes): a
 * header (reason "noanswer" for a stub, "digest" otherwise, with the node, the state and the
 * communicators' counters), the op lines of the calls r names and the main thread's frames.
 * diag_parse reads it back into the same r. 0 or -ENOMEM. */
int diag_format(const diag_rank_t *r, char **out, size_t *len);
/* Writes diag_format's text as flight-rank<R>-pid<P>-<tag>.jsonl in dir. 0 or -errno. */
int diag_write(const char *dir, const diag_rank_t *r, const char *tag);
/* A stub as flight-rank<R>-pid<P>-noanswer.jsonl in dir. 0 or -errno. */
int diag_write_stub(const char *dir, const diag_rank_t *r);
/* Every dump under dir (its subfolders too): per rank the newest, and of those the ones written
 * within DIAG_WINDOW_S of the newest of all (older ones belong to an earlier hang). *out is
 * malloc'ed, sorted by rank. 0 (possibly *n == 0), or -errno with err. */
#define DIAG_WINDOW_S 30.0
int diag_load_dir(const char *dir, diag_rank_t **out, int *n, char *err, size_t errlen);
/* The diagnosis as lines ('\n' after each) into out, the one-line summary first, no prefix;
 * *named (may be NULL) the rank the summary names, -1 when none. Returns the number of lines. */
int diag_report(const diag_rank_t *ranks, int n, char *out, size_t len, int *named);

#endif
