/* store_server: meshrun's key-value store, served on a libuv loop (the agent's).
 *
 * Speaks the protocol of common/store_proto.h to any number of clients. Waits (GET, WAIT,
 * MULTI_GET) are parked on the server and answered when the keys appear or their timeout
 * fires, so the loop never blocks. A client that sends garbage, a truncated or oversize
 * frame, or a foreign protocol version is disconnected; other clients never notice.
 *
 * The store belongs to one job (opts.run_id) and may require its secret; every connection
 * shakes hands first and then sees only its own job's keys (common/store.h). What strangers
 * on the port can take is bounded (store_server_opts_t): connections in all (a reserve of the
 * file limit stays free for the host's own use), connections past the handshake per peer host,
 * connections still in the handshake (the oldest are evicted once they have had a grace of
 * their own, so real nodes still get in, even slow ones) and how long they may take, and the
 * bytes buffered for partly received frames, which grow only as bytes arrive and must keep
 * arriving. The whole store is bounded by STORE_SERVER_MAX_BYTES (sets beyond it are refused
 * with an error reply). Running out of file descriptors is survived, never fatal. */
#ifndef MESHRUN_STORE_SERVER_H
#define MESHRUN_STORE_SERVER_H

#include <errno.h>
#include <stddef.h>
#include <uv.h>

#define STORE_SERVER_MAX_BYTES ((size_t)1 << 30)
/* store_server_start's codes are negative errno values, as net's and libuv's (the listen is a
 * system call); this one, the port taken, is the one callers act on (they retry or join). */
#define STORE_SERVER_EADDRINUSE (-EADDRINUSE)

typedef struct store_server store_server_t;

/* Who may use the store and how much of the host it may take. Zero limits mean the defaults
 * (store_server.c says what they are and why). */
typedef struct {
  const char *run_id;       /* the hosting job: named to clients in the handshake */
  const char *secret;       /* NULL or "": an open store (anyone reaching the port may use it) */
  size_t max_conns;         /* connections in all (0: the file limit less fd_reserve and the
                             * refusals that may linger) */
  size_t fd_reserve;        /* descriptors the host keeps for itself (0: 256) */
  size_t max_conns_per_host; /* connections past the handshake from one peer address (0: no
                              * limit but max_conns); past it a newcomer is refused */
  size_t max_unauth;        /* connections still in the handshake; past it the oldest goes,
                             * once it has been in the handshake for a grace (store_server.c) */
  size_t max_unauth_per_addr; /* the same, per peer address (the oldest of that address goes) */
  int handshake_ms;         /* a connection that has not finished its handshake by then is closed */
  size_t inflight_budget;   /* bytes buffered for partly received frames, all connections together */
  int frame_ms;             /* a frame over 4 KiB being received that gets no byte for this long,
                             * or is not whole after this long plus its size at 1 MiB/s, is
                             * dropped and its budget released (0: 10 s) */
} store_server_opts_t;

/* Listens on host:port (port 0: a free port; host "" = all addresses) on loop. *bound_port gets
 * the port. opts NULL: run id "", no secret, default limits. Returns 0, STORE_SERVER_EADDRINUSE
 * when the port is taken, or another negative errno value; the message is in err. */
int store_server_start(store_server_t **out, uv_loop_t *loop, const char *host, int port,
                       const store_server_opts_t *opts, int *bound_port, char *err, size_t errlen);
/* Stops listening and disconnects every client. The memory is released by close callbacks:
 * run the loop (uv_run) afterwards until it has no more work. Accepts NULL. */
void store_server_close(store_server_t *srv);
/* Counters for tests and diagnostics. */
size_t store_server_num_clients(const store_server_t *srv);
size_t store_server_num_keys(const store_server_t *srv); /* of all jobs together */
/* Requests parked waiting for keys (GET, WAIT, MULTI_GET not yet answered). */
size_t store_server_num_waiters(const store_server_t *srv);
/* Authenticated connections of jobs other than the hosting one (their run id differs from
 * opts.run_id). The hosting agent keeps serving while this is not 0, so that a job sharing the
 * port never loses its store to another job's end. */
size_t store_server_num_foreign(const store_server_t *srv);
/* Bytes of receive buffers held right now, all connections together: partly received frames
 * (an idle connection holds none). Frames over 4 KiB are admitted against opts.inflight_budget
 * by their announced length, so this stays within the budget plus 4 KiB per connection. */
size_t store_server_inflight_bytes(const store_server_t *srv);

/* Raises RLIMIT_NOFILE's soft limit to the hard limit; returns the new soft limit, or -1 when
 * getrlimit fails. */
long store_server_raise_nofile(void);

#endif
