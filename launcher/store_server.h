/* store_server: meshrun's key-value store, served on a libuv loop (the agent's).
 *
 * Speaks the protocol of common/store_proto.h to any number of clients. Waits (GET, WAIT,
 * MULTI_GET) are parked on the server and answered when the keys appear or their timeout
 * fires, so the loop never blocks. A client that sends garbage, a truncated or oversize
 * frame, or a foreign protocol version is disconnected; other clients never notice.
 * Memory is bounded: per-connection buffers by STORE_MAX_FRAME, the whole store by
 * STORE_SERVER_MAX_BYTES (sets beyond it are refused with an error reply). */
#ifndef MESHRUN_STORE_SERVER_H
#define MESHRUN_STORE_SERVER_H

#include <stddef.h>
#include <uv.h>

#define STORE_SERVER_MAX_BYTES ((size_t)1 << 30)
#define STORE_SERVER_EADDRINUSE (-98)

typedef struct store_server store_server_t;

/* Listens on host:port (port 0: a free port; host "" = all addresses) on loop. *bound_port gets
 * the port. Returns 0, STORE_SERVER_EADDRINUSE when the port is taken, or another negative code;
 * the message is in err. */
int store_server_start(store_server_t **out, uv_loop_t *loop, const char *host, int port,
                       int *bound_port, char *err, size_t errlen);
/* Stops listening and disconnects every client. The memory is released by close callbacks:
 * run the loop (uv_run) afterwards until it has no more work. Accepts NULL. */
void store_server_close(store_server_t *srv);
/* Counters for tests and diagnostics. */
size_t store_server_num_clients(const store_server_t *srv);
size_t store_server_num_keys(const store_server_t *srv);
/* Requests parked waiting for keys (GET, WAIT, MULTI_GET not yet answered). */
size_t store_server_num_waiters(const store_server_t *srv);

#endif
