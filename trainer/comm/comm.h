/* comm: collectives and point-to-point transfers on a group of ranks, the interface the model,
 * the strategies and the pipeline call.
 *
 * A comm_t is one group (a dimension of the mesh): its members are ranks 0..size-1 of the
 * group, in the mesh's order. Every member must call the same collectives in the same order
 * with the same counts, as with NCCL or MPI; sends and receives (see "point-to-point" below)
 * involve only their two ranks. Data is in place where the operation allows it;
 * element counts are size_t. All calls are blocking and return when this rank's part is done.
 *
 * comm_t is opaque here; backends plug in through comm_ops_t (trainer/comm/comm_impl.h, seen only
 * by comm*.c), and the NCCL-only hooks are in trainer/comm/comm_nccl.h. The backends: "cpu"
 * (comm_cpu.c: TCP rings between the ranks, endpoints exchanged through the store; host
 * memory), "nccl" (comm_nccl.c: one NCCL
 * communicator per group, device memory; builds with CUDA only) and "staged" (comm_staged.c:
 * device memory copied through host buffers and reduced by an inner "cpu" communicator, so that
 * several ranks can share one GPU). The dispatch (comm.c) checks
 * arguments, handles groups of one rank and empty buffers, and keeps the error message, so
 * backends only move bytes.
 *
 * Every collective, send and receive also exists as an asynchronous start (comm_start_*): it
 * returns at once with a request, and comm_wait (or comm_test) completes it; see "asynchronous
 * collectives" below.
 *
 * Errors are negative COMM_E* codes. comm_errmsg() returns the message of the last failure,
 * naming the group, the operation and the peer, e.g.
 *   "comm tp.0 (rank 1/2): all_reduce timed out after 30 s waiting for rank 0 (global rank 0,
 *    127.0.0.1:41234)" (the mesh names groups "<dim>.<lowest member rank>").
 * After a system, remote or timeout error the communicator is broken (its peers may be midway
 * through a transfer): every later call fails at once with the first message, and the caller
 * should destroy it and exit so the launcher can restart the job. A collective that makes no
 * progress for the timeout fails instead of hanging; a peer that dies makes its neighbours
 * fail at once (connection closed), and they close theirs, so the failure runs around the
 * group instead of waiting for the timeout.
 *
 * A comm_t is not thread-safe: one thread calls it at a time (its own progress thread, if any, is
 * its business). Pointers are memory of the
 * backend's kind: host for "cpu", device for "nccl" and "staged" (of comm_config_t.device). */
#ifndef MESHRUN_COMM_H
#define MESHRUN_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/store.h"
#include "trainer/backend/backend.h" /* dtype_t */

struct backend; /* trainer/backend/backend.h: the device whose memory "nccl" and "staged" move */

enum {
  COMM_OK = 0,
  COMM_EINVAL = -1,    /* bad argument (NULL buffer, unknown op or dtype, root out of range) */
  COMM_ESYSTEM = -2,   /* a local system call failed (socket, memory) */
  COMM_EREMOTE = -3,   /* a peer closed or reset its connection, or sent something wrong */
  COMM_ETIMEDOUT = -4, /* no progress from a peer within the timeout */
};

/* Element types: backend.h's dtype_t (DT_F32, DT_BF16: 4 and 2 bytes, dtype_size), the trainer's
 * one dtype enum; every backend (cpu, staged, nccl) moves and reduces both.
 * bfloat16 (trainer/backend/bf16.h) is reduced the way NCCL does: each combining step widens to fp32,
 * adds (or compares) in fp32 and rounds the result once to nearest even; "cpu" and "staged" then
 * divide the finished sum by size once for AVG (fp32 division, one rounding). A bf16 SUM errs
 * by at most about (size - 1) * 2^-8 of sum |x| (2^-8 per rounding); MAX is exact. */
typedef enum { COMM_SUM = 0, COMM_AVG, COMM_MAX } comm_op_t;

#define COMM_NAME_MAX 64
#define COMM_ERR_MAX 512
#define COMM_DEFAULT_TIMEOUT_MS 300000 /* the trainer's parallel.comm_timeout_s default; MESHRUN_COMM_TIMEOUT overrides */

/* Traffic of one communicator since creation (or comm_reset_stats), this rank only. */
typedef struct {
  uint64_t bytes_sent;
  uint64_t bytes_recv;
  uint64_t calls; /* collectives, sends and receives that reached the backend (size 1 and
                     count 0 do not) */
  uint64_t wait_ns; /* time the calling thread spent blocked: in blocking calls and in comm_wait
                       (the exposed communication; "nccl" waits on the device, so ~0 there) */
} comm_stats_t;

/* What comm_create needs. Only store is borrowed, and only during comm_create. */
typedef struct {
  const char *name;  /* group name, unique within the job, e.g. "tp.4"; [A-Za-z0-9_.-], < 64 */
  int rank, size;    /* this process's rank in the group, and the group size */
  int generation;    /* restart count (TORCHELASTIC_RESTART_COUNT): keys of earlier attempts
                        are never read */
  store_t *store;    /* where endpoints are published and read; may be NULL when size == 1 */
  const char *host;  /* address to listen on and publish; NULL: MESHRUN_COMM_HOST, else listen
                        on all addresses and publish this machine's hostname */
  int timeout_ms;    /* stall timeout of each collective and of setup; <= 0: default */
  const int *global_ranks; /* optional (size entries): members' job ranks, for messages */
  struct backend *device; /* "staged": required, its to_host/to_device/copy move the buffers.
                             "nccl": optional, its synchronize() orders a collective after the
                             compute queued so far (unless comm_nccl_set_stream gave the compute
                             stream). "cpu": unused. Borrowed for the communicator's life. */
  /* Optional: a communicator this group is split from ("nccl": ncclCommSplit of the parent's
   * NCCL communicator instead of an init of its own; others ignore it). Then comm_create is
   * collective over the parent's members, each passing the color of its group (members of one
   * group share a color; cfg->rank orders them) in the same sequence of splits. */
  struct comm *parent;
  int color;
} comm_config_t;

/* Opaque: backends see its fields through trainer/comm/comm_impl.h, users only these functions. */
typedef struct comm comm_t;

/* Where the memory a comm backend moves lives: host memory ("cpu") or the device backend's
 * ("nccl", "staged"). Callers ask this, never a backend's name, whether host values can go
 * through a communicator (compare backend_t.mem). */
typedef enum { COMM_MEM_HOST = 0, COMM_MEM_DEVICE } comm_mem_t;

/* One comm backend as the registry lists it. Its own file defines the entry (comm_entry_<name>,
 * next to its create function); trainer/comm/registry.c lists the entries, one line each, in the
 * order messages name them. A backend that a build cannot compile is listed all the same,
 * through a stand-in file the Makefile picks instead (comm_<name>_absent.c: create NULL, and
 * why). The trainer chooses among them by these fields alone (trainer/run/device.c). */
typedef struct comm_entry {
  const char *name;   /* MESHRUN_COMM_BACKEND's value, comm_create's backend: "cpu" */
  comm_mem_t mem;     /* where the buffers it moves live */
  /* The compute backend (its registry name) whose device memory it moves, the only one it
   * serves; NULL: any backend whose memory is of kind mem, or, for device memory, any backend at
   * all (staging through comm_config_t.device's copies, which are memcpy on the host). */
  const char *device;
  /* 1: every local rank needs a device of its own; the default then takes it only where
   * LOCAL_WORLD_SIZE devices are visible, else a backend without the need. */
  int device_per_rank;
  /* 1: its collectives can be recorded into a step's graph (backend.h, graph_begin): they queue
   * on the caller's compute stream and no host thread waits for them. 0: they run on a host
   * thread or wait on the host (cpu, staged), so a step with them is not recorded
   * (a recorded step: docs/gpu.md, "CUDA graphs"). */
  int capturable;
  /* Fills c (comm_impl.h) for the group of cfg. NULL in a stand-in. */
  int (*create)(struct comm *c, const comm_config_t *cfg, char *err, size_t errlen);
  const char *absent; /* a stand-in's reason: "this build has no CUDA: nvcc was not found" */
} comm_entry_t;

/* Every comm backend this program knows, NULL-terminated (trainer/comm/registry.c). */
extern const comm_entry_t *const comm_registry[];
/* The entry called name, or NULL. */
const comm_entry_t *comm_find(const char *name);
/* The registered names joined by sep, the last two by last ("cpu, nccl or staged" with ", " and
 * " or "); out is always terminated. */
void comm_names(char *out, size_t len, const char *sep, const char *last);

/* Creates the communicator of one group with a registered backend ("cpu" when NULL).
 * Collective over the group: every member calls it with the same name, size and generation.
 * Returns 0 and *out, or a code with the reason in err. An unknown backend, or one this build
 * has not (a stand-in), is COMM_EINVAL with a message saying so. */
int comm_create(comm_t **out, const char *backend, const comm_config_t *cfg, char *err,
                size_t errlen);
void comm_destroy(comm_t *c); /* accepts NULL */

/* In place on count elements of every rank. AVG divides the sum by size (after summing, so every
 * rank gets identical bits). */
int comm_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op);
/* Each rank contributes count elements; out (size * count) gets rank i's at out + i * count.
 * In place when in == out + rank * count. */
int comm_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype);
/* in holds size * count elements; out (count) gets slice rank of the reduction (SUM or AVG;
 * MAX also works). out may not overlap in. */
int comm_reduce_scatter(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype,
                        comm_op_t op);
/* Copies root's count elements into everyone's buf. */
int comm_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root);
/* Returns once every member has entered the barrier. */
int comm_barrier(comm_t *c);

/* --- point-to-point: activations and their gradients between neighbouring pipeline stages.
 * comm_send moves count elements of buf to group rank peer, comm_recv receives them from peer
 * into buf. Only the two ranks take part (not collective). Matching is FIFO per ordered pair: the
 * k-th send from a to b on a communicator meets b's k-th receive from a, and its count and dtype
 * must be the receive's ("cpu", "staged": a difference fails the receive with COMM_EREMOTE,
 * naming both, and breaks the communicator; "nccl" does not check). Bytes are moved, never
 * reduced: float32 and bfloat16 alike. Refused with COMM_EINVAL (the communicator stays usable):
 * a peer out of range or equal to this rank (so every call on a group of one), a NULL buffer with
 * count > 0, and on "cpu" and "staged" any peer but the ring neighbours: a send only to
 * rank + 1, a receive only from rank - 1 (mod size; in a group of two the other rank is both).
 * count 0 returns 0 at once on both sides without any traffic. Stats, the observer ("send",
 * "recv"), the fault hooks and the broken state work as for collectives; stats count payload
 * bytes only ("cpu" puts a 16-byte header before each message, not counted).
 *
 * They are calls of the communicator like the collectives: a blocking one is a start plus a
 * wait, and started ones run in issue order, one at a time ("cpu": on its progress thread;
 * "nccl": on its stream; "staged": a started send on its inner "cpu" communicator's progress
 * thread, everything else inside the call). Consequence: a send that the receiver has
 * not reached yet holds up every later call of the same communicator on that rank ("cpu": once
 * the message exceeds what the sockets buffer, a few MiB; "nccl": possibly at any size). So two
 * ranks that both issue a large send to each other on one communicator before their receives
 * deadlock until the timeout fails them (COMM_ETIMEDOUT). The intended use is one communicator
 * per direction: a two-rank group whose rank 0 only sends and rank 1 only receives; then each
 * rank starts its send on one and its receive on the other, in any order, and both complete
 * (blocking calls are not enough: both ranks would wait in their sends). "staged" does the same
 * with one rule more: its comm_start_send copies the device buffer into a host buffer of the
 * request's own and returns, the inner communicator moves the bytes behind the caller, and
 * comm_wait waits for them and frees the copy; but its comm_start_recv still runs the receive
 * to completion (as its collectives do), blocking the caller until the message is in, so each
 * rank must start its send before its receive (the pipeline's transport contract: asynchronous
 * sends, blocking receives). A later call of a staged communicator waits for its pending sends
 * first, so issue order holds as on "cpu". */
int comm_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer);
int comm_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer);

/* --- asynchronous collectives.
 * comm_start_* checks its arguments as the blocking call does, queues the operation and returns
 * 0 with *req at once (a failure to start, e.g. on a broken communicator, returns the code and
 * *req = NULL). The buffers belong to the operation until comm_wait returns: do not read the
 * output or write the input before. Several may be in flight on one communicator; they execute
 * in issue order, one at a time, and a blocking call issued meanwhile runs after them (it is a
 * start plus a wait). Operations on different communicators proceed independently.
 *   "cpu": a progress thread of the communicator (started by the first comm_start) runs them;
 *   "nccl": enqueued on the communication stream after an event of the compute stream; the wait
 *           makes the compute stream wait for its completion event (no host synchronization);
 *   "staged": runs the operation inside comm_start (no overlap: its copies share the device),
 *             except a send: the copy off the device inside comm_start, the transfer on the
 *             progress thread of its inner "cpu" communicator (see "point-to-point" above).
 * comm_wait blocks until req is complete, frees it and returns its result; a failed operation
 * returns its code once, and the ones queued after it on the same communicator fail with
 * the same message without touching their buffers. sent (may be NULL) gets the bytes this rank
 * sent for it. comm_test sets *done without blocking (req stays valid until comm_wait). Every
 * started request must be waited for, also after a failure; comm_destroy waits for the ones
 * left (a caller that is exiting may skip that). NULL req: comm_wait returns 0. */
typedef struct comm_req comm_req_t;
int comm_start_all_reduce(comm_t *c, void *buf, size_t count, dtype_t dtype, comm_op_t op,
                          comm_req_t **req);
int comm_start_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype,
                          comm_req_t **req);
int comm_start_reduce_scatter(comm_t *c, const void *in, void *out, size_t count,
                              dtype_t dtype, comm_op_t op, comm_req_t **req);
int comm_start_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root,
                         comm_req_t **req);
int comm_start_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer,
                    comm_req_t **req);
int comm_start_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer,
                    comm_req_t **req);
int comm_wait(comm_req_t *req, uint64_t *sent);
int comm_test(comm_req_t *req, int *done);

/* An observer of every collective, send and receive of the process (the trainer's trace): RUN
 * when a backend ran one (on the thread that ran it: t0, t1 its start and end, bytes what this rank sent), WAIT
 * when a caller was blocked on one (its blocking call or comm_wait; bytes its buffer's size).
 * Times are CLOCK_MONOTONIC nanoseconds. It may be called from progress threads at once, so it
 * must be thread-safe. NULL: none (the default). Set it before any communicator exists. */
enum { COMM_OBSERVE_RUN = 0, COMM_OBSERVE_WAIT = 1 };
typedef void (*comm_observer_fn)(const comm_t *c, int what, const char *op, uint64_t bytes, int64_t t0_ns,
                                 int64_t t1_ns);
void comm_set_observer(comm_observer_fn fn);

int comm_rank(const comm_t *c);
int comm_size(const comm_t *c);
const char *comm_name(const comm_t *c);
/* Stall timeout of later collectives (> 0 ms). */
int comm_set_timeout(comm_t *c, int timeout_ms);
/* The stall timeout to create communicators with, in ms: MESHRUN_COMM_TIMEOUT (seconds) when it is
 * set to a number in (0, 1e6), an override for tests and one-off runs; else configured_s (the
 * trainer's parallel.comm_timeout_s) when > 0; else COMM_DEFAULT_TIMEOUT_MS. What comm_create uses
 * for a timeout_ms <= 0 is comm_timeout_ms(0). */
int comm_timeout_ms(double configured_s);
const char *comm_errmsg(const comm_t *c); /* "" when nothing failed */
/* 1 once any communicator of this process has broken (a system, remote or timeout error). Only
 * reads a flag, so a signal handler may call it (the trainer's SIGTERM handler does). */
int comm_failed_any(void);
const char *comm_strerror(int code);
void comm_get_stats(const comm_t *c, comm_stats_t *out);
void comm_reset_stats(comm_t *c);
const char *comm_op_name(comm_op_t op);     /* "sum", "avg", "max" */

/* The memory kind of a backend by name (NULL: "cpu"), before any communicator exists; an
 * unknown name is COMM_MEM_HOST (comm_create rejects it anyway). */
comm_mem_t comm_backend_memory(const char *backend);
comm_mem_t comm_memory(const comm_t *c); /* the kind of c's backend */

/* --- failure paths. Every communicator is registered from comm_create to comm_destroy.
 * comm_abort makes c fail for good the way a lost connection does, and makes its peers' pending
 * and later calls fail at once instead of waiting out the timeout ("cpu", "staged": shutdown of
 * the ring's sockets, so the neighbours read end-of-file; "nccl": ncclCommAbort). comm_abort_all
 * does it to every live communicator of this process; the fatal path of device errors
 * (backend_fatal) calls it right before exiting. Neither frees anything: comm_destroy still
 * must (or the process exits). */
void comm_abort(comm_t *c, const char *why);
void comm_abort_all(const char *why);

/* --- the flight recorder: what this process's communicators did last, for a job that is stuck
 * or slow. Every call that reaches a backend (a collective, send or receive, blocking or
 * started; not a group of one or an empty buffer) is recorded by the dispatch in one ring per
 * process of the last N calls: its communicator, its sequence number there (1, 2, ... in issue
 * order; the k-th collective of a group is the k-th on every member), op, dtype, reduction,
 * bytes (count x dtype size), peer or root, state (issued: queued or handed to the backend;
 * started: the backend is moving its bytes; done; failed; skipped: comm_skip_next's) and CLOCK_MONOTONIC times of issue,
 * start and end. Recording is a few stores and one atomic increment per call, no lock.
 * "nccl": done means comm_wait returned, which orders the stream after the operation, not that
 * the device has finished it. A "staged" communicator's calls appear twice, once as its own and
 * once as its inner "cpu" ring's (same name and sequence numbers; each record names its backend).
 *
 * A dump writes the ring, oldest first, as JSON lines into a file of the dump folder
 * (MESHRUN_DUMP_DIR; else the folder of TORCHELASTIC_ERROR_FILE, the rank's log folder under
 * meshrun; else /tmp/meshrun-dumps-<uid>), named flight-rank<RANK>-pid<pid>-<n>.jsonl (written
 * as <name>.tmp and renamed once whole): first a
 * header ({"type":"header", rank, host, pid, reason, and for every live communicator its
 * "issued" and "done": the sequence numbers of its last call issued and last call completed),
 * then one line per call ({"type":"op", ...}, newest last), then one line per thread of the
 * process with its stack ({"type":"stack", "tid", "name", "frames"}: backtrace(3) symbols, a
 * function's name where the program exports it, else binary(+offset) for addr2line). A dump
 * happens on the first COMM_ETIMEDOUT of the process (on the thread that saw it, before the
 * error returns), on SIGUSR1 once comm_dump_on_signal ran, and on comm_dump; one line on stderr
 * names the file. Other threads' stacks: each thread is sent a real-time signal whose handler
 * takes its backtrace; a thread that blocks it, or does not answer within a second (stuck in
 * the kernel), is listed with "frames": [] and why. */
#define COMM_FLIGHT_DEFAULT 2048 /* records, the trainer's parallel.comm_flight_records default */
#define COMM_FLIGHT_MAX (1 << 20)
/* The ring size to use: MESHRUN_COMM_FLIGHT_RECORDS when set to an integer in [0, COMM_FLIGHT_MAX]
 * (an override for tests and one-off runs), else configured (the plan's key). 0: off. */
int comm_flight_records(int configured);
/* Sizes the ring (0: recording off; the sequence numbers still count) and clears it. Only while
 * no call is in flight: before the first communicator (comm_create otherwise sizes it with
 * comm_flight_records(COMM_FLIGHT_DEFAULT)), or between blocking calls (a benchmark). 0, or
 * COMM_EINVAL / COMM_ESYSTEM with err. */
int comm_flight_setup(int records, char *err, size_t errlen);
/* Writes a dump now (reason: a word for the header, e.g. "request") and names its file in path
 * (may be NULL) and on stderr. 0, or COMM_ESYSTEM with err (a folder or file that cannot be
 * written). Not from a signal handler. */
int comm_dump(const char *reason, char *path, size_t pathlen, char *err, size_t errlen);
/* Makes SIGUSR1 write a dump (reason "signal"), the process going on: its handler only writes a
 * byte to a pipe that a thread of the recorder waits on, and that thread dumps. meshrun's dump
 * signal (common/dump.h: SIGRTMIN + 5, a dump and nothing else) does the same with reason
 * "meshrun". Also installs the stack signal's handler. A later sigaction(SIGUSR1) (the trainer's checkpoint.on_signal)
 * replaces it. 0, or COMM_ESYSTEM with err. */
int comm_dump_on_signal(char *err, size_t errlen);
/* What SIGUSR1's handler does, for a handler that takes SIGUSR1 over (the trainer's
 * checkpoint.on_signal, which then also saves): asks the recorder's thread for a dump.
 * Async-signal-safe (one write to a pipe); nothing happens before comm_dump_on_signal. */
void comm_dump_request(void);
/* The real-time signal the recorder sends a thread for its stack (SIGRTMIN + 4). A thread that
 * blocks every signal should leave this one open to appear in dumps. */
int comm_flight_stack_signal(void);

/* Test hook (fault injection): the next call of c (collective, send or receive) that reaches the
 * backend fails as a lost connection would: c is aborted (peers fail at once) and the call returns COMM_ESYSTEM
 * with "<op>: fault injected" as its message. */
void comm_fail_next(comm_t *c);
/* Test hook (fault injection): the next call of c that reaches the backend is skipped, as a rank
 * whose code took another branch would skip it: it moves no bytes and returns 0 at once, its
 * peers still wait in it. It keeps its sequence number, so that this rank's next call is the
 * group's next one (the flight recorder marks it "skipped"); what the peers then see is what a
 * skipped collective does to that backend. Calls that a backend starts natively ("nccl") are
 * not skipped. */
void comm_skip_next(comm_t *c);

#endif
