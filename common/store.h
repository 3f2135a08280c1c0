/* store: blocking client of meshrun's TCP key-value store (the server is launcher/store_server).
 *
 * Used by the launcher's rendezvous and heartbeat threads and by the trainer (MESHRUN_STORE)
 * to exchange endpoints. Keys are strings (at most STORE_MAX_KEY bytes), values are bytes.
 * Every call is one request and one reply on one TCP connection; a store_t is not shared
 * between threads without a lock of the caller's. Calls that wait take a timeout in
 * milliseconds (< 0: forever). The wire format is in common/store_proto.h.
 *
 * Errors are negative STORE_E* codes; store_errmsg() returns the last message of that
 * client, naming the cause ("connect 127.0.0.1:29400: connection refused").
 *
 * Jobs and secrets. Every connection belongs to one job: the handshake names the client's run
 * id, and the server keeps each job's keys apart (a job can neither see nor touch another's
 * keys, whatever names it uses). A store with a secret admits only clients that prove they
 * hold it (HMAC-SHA256 challenge and response in the handshake, both ways: the client also
 * checks the server's proof, so a stranger on the port cannot pose as the store). A refused
 * client gets STORE_EAUTH with a message naming the job that owns the store. */
#ifndef MESHRUN_STORE_H
#define MESHRUN_STORE_H

#include <stddef.h>
#include <stdint.h>

#define STORE_MAX_KEY 1024
#define STORE_MAX_FRAME (64u << 20) /* whole frame, header included */
#define STORE_MAX_RUN_ID 255        /* bytes; the server prefixes keys with its length in one byte */

enum {
  STORE_OK = 0,
  STORE_EINVAL = -1,    /* bad argument from the caller */
  STORE_ECONNECT = -2,  /* could not connect to any address of the endpoint */
  STORE_EIO = -3,       /* connection lost or reset mid-request */
  STORE_EPROTO = -4,    /* the peer sent something that is not our protocol */
  STORE_ETIMEDOUT = -5, /* the key(s) did not appear / reply did not come in time */
  STORE_ENOKEY = -6,    /* key absent (store_get_nowait, store_delete) */
  STORE_ETOOBIG = -7,   /* key or value over the limits */
  STORE_ENOMEM = -8,
  STORE_EAUTH = -9,     /* secret missing, wrong, or not asked for by a store we hold one for */
  STORE_EBUSY = -10,    /* the server is at a limit (connections, bytes in flight) */
};

/* The handshake's default bound in seconds, on both ends: the server closes a connection that
 * has not finished it by then, and meshrun's rendezvous gives up on an endpoint that has not
 * answered it by then (a program that accepts and never replies is not a meshrun store). */
#define STORE_HANDSHAKE_S 3

/* The handshake: who a client is, its job's run id (its key namespace on the server; "" is a
 * namespace too; NULL = "") and the job secret (NUL-terminated text; NULL or "" = none), and how
 * long the handshake may take once connected, in milliseconds (0: what is left of the connect's
 * timeout, at least a second). A client with a secret refuses a store that has none (it could
 * be anyone's), and the other way round. */
typedef struct {
  const char *run_id;
  const char *secret;
  int handshake_ms;
} store_auth_t;

/* The environment a worker finds the store by, as meshrun sets it. */
#define STORE_ENV_ENDPOINT "MESHRUN_STORE"      /* host:port */
#define STORE_ENV_SECRET "MESHRUN_RDZV_TOKEN"   /* the job secret */
#define STORE_ENV_RUN_ID "TORCHELASTIC_RUN_ID"  /* the run id (namespace) */

typedef struct store store_t;

/* Connects to host:port (IPv4, IPv6 or a hostname: every address getaddrinfo returns is tried,
 * retrying refused connections until timeout_ms passes) and shakes hands as auth says (NULL:
 * run id "" and no secret). Returns 0 and *out, or a code with the reason in err:
 * STORE_ECONNECT (nothing accepted the connection), STORE_ETIMEDOUT (something accepted it and
 * did not answer the handshake in time), STORE_EPROTO (something answered, not as a meshrun
 * store), STORE_EAUTH (final: retrying cannot help). A store that answers STORE_EBUSY (at its
 * connection limit) is tried again until timeout_ms passes. */
int store_connect(store_t **out, const char *host, int port, const store_auth_t *auth, int timeout_ms,
                  char *err, size_t errlen);
/* store_connect with one try: a refusal (STORE_ECONNECT) or a busy store (STORE_EBUSY) is
 * answered at once; timeout_ms bounds the connect and the handshake. For asking whether a
 * store is there. */
int store_connect_once(store_t **out, const char *host, int port, const store_auth_t *auth, int timeout_ms,
                       char *err, size_t errlen);
/* Parses "host:port", "[v6addr]:port" (as in MESHRUN_STORE) and connects. */
int store_connect_endpoint(store_t **out, const char *endpoint, const store_auth_t *auth, int timeout_ms,
                           char *err, size_t errlen);
/* Connects as a worker: endpoint, run id and secret from STORE_ENV_* (run id "" and no secret
 * when unset). STORE_EINVAL with a message when STORE_ENV_ENDPOINT is unset. */
int store_connect_env(store_t **out, int timeout_ms, char *err, size_t errlen);
/* The run id of the job that owns the server, as its handshake said ("" for NULL). */
const char *store_server_job(const store_t *s);
void store_close(store_t *s); /* accepts NULL */
/* May be called from another thread than the owner's: a call blocked on s returns at once
 * (STORE_EIO) and later calls fail. For stopping a thread that owns s; the owner, or whoever
 * joined it, still calls store_close. Accepts NULL. */
void store_interrupt(store_t *s);
const char *store_errmsg(const store_t *s);
const char *store_strerror(int code);

int store_set(store_t *s, const char *key, const void *val, size_t len);
/* Waits until key exists (or timeout), then returns a malloc'ed copy (caller frees; a NUL is
 * appended past len for convenience). */
int store_get(store_t *s, const char *key, void **val, size_t *len, int timeout_ms);
/* Like store_get but returns STORE_ENOKEY at once when the key is absent. */
int store_get_nowait(store_t *s, const char *key, void **val, size_t *len);
/* Adds delta to the integer stored at key (absent counts as 0; stored as decimal text) and
 * returns the new value. */
int store_add(store_t *s, const char *key, int64_t delta, int64_t *result);
/* If key's value equals expected (expected_len 0 with expected NULL: key absent), sets it to
 * desired. Returns in *actual (malloc'ed) the value after the call, whether or not it swapped. */
int store_compare_set(store_t *s, const char *key, const void *expected, size_t expected_len,
                      const void *desired, size_t desired_len, void **actual, size_t *actual_len);
/* Waits until every key exists. STORE_ETIMEDOUT if they don't within timeout_ms. */
int store_wait(store_t *s, const char *const *keys, size_t nkeys, int timeout_ms);
/* Sets *exist to 1 if every key exists now, else 0. Never waits. */
int store_check(store_t *s, const char *const *keys, size_t nkeys, int *exist);
/* Deletes key; *deleted = 1 if it existed. */
int store_delete(store_t *s, const char *key, int *deleted);
/* Waits for all keys (timeout_ms) and returns their values: vals[i] malloc'ed, lens[i]. */
int store_multi_get(store_t *s, const char *const *keys, size_t nkeys, void **vals, size_t *lens,
                    int timeout_ms);
int store_multi_set(store_t *s, const char *const *keys, const void *const *vals, const size_t *lens,
                    size_t nkeys);
/* Number of keys in the store (for tests and diagnostics). */
int store_num_keys(store_t *s, int64_t *n);

#endif
