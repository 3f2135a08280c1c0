/* fixture: multi-process test harness shared by C tests that need real ranks.
 *
 * fixture_run_ranks starts a store server on its own libuv loop in a process of its own (port
 * 0, so no fixed port; not a thread, so that the ranks are forked from a single-threaded
 * process and never inherit a lock held by another thread), forks one process per rank into
 * a fresh process group, connects each to the store and runs fn in it, then waits. A rank that fails (non-zero return, signal) gets the
 * whole group killed, since the others may be blocked in a collective with it; every rank has
 * an alarm so that nothing can hang a suite. fixture_comm_open creates a cpu communicator on
 * loopback through that store. Small helpers the rank functions share: a monotonic clock,
 * waiting for a store key (the ranks' synchronization besides the comm; no sleeps), and a message
 * size no loopback socket pair can buffer. The test links test/support/fixture.c plus
 * launcher/store_server.c, common/store.c, common/store_proto.c, common/net.c, common/log.c,
 * and trainer/comm/comm.c, trainer/comm/comm_cpu.c for fixture_comm_open. It does not use cmocka, so
 * failures come back as return codes with a message on stderr. */
#ifndef MESHRUN_TEST_FIXTURE_H
#define MESHRUN_TEST_FIXTURE_H

#include "common/store.h"
#include "trainer/comm/comm.h"

/* What one rank runs; returns 0 when its checks pass. Runs in a forked child. */
typedef int (*fixture_rank_fn)(int rank, int n, store_t *store, void *arg);

/* Forks n ranks (n <= 64) running fn, each killed by SIGALRM after alarm_s seconds. Returns
 * how many failed, or -1 when the harness itself could not start (message on stderr). */
int fixture_run_ranks(int n, fixture_rank_fn fn, void *arg, int alarm_s);

/* A cpu communicator named name over n ranks on 127.0.0.1. Returns 0 or a COMM_E* code (the
 * reason on stderr). */
int fixture_comm_open(comm_t **c, const char *name, int rank, int n, store_t *st, int timeout_ms);

/* Seconds on the monotonic clock, for timing a call against a limit. */
double fixture_now_s(void);

/* Waits up to timeout_ms for a store key another rank sets. Returns 0, or store_get's code with a
 * message on stderr. */
int fixture_await_key(store_t *st, const char *key, int timeout_ms);

/* More bytes than the kernel can hold between two loopback sockets (twice the sum of the sender's
 * tcp_wmem and the receiver's tcp_rmem maxima), at least 64 MiB: a send of it cannot complete
 * before the peer reads. */
size_t fixture_unbufferable_bytes(void);

#endif
