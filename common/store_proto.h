/* store_proto: the wire format of meshrun's store, shared by the client (common/store.c) and
 * the server (launcher/store_server.c).
 *
 * Every message, request or reply, is one frame:
 *
 *     u32 length   whole frame in bytes, header included, big-endian; 8..STORE_MAX_FRAME
 *     u8  magic    STORE_PROTO_MAGIC
 *     u8  version  STORE_PROTO_VERSION; a peer with another version is disconnected
 *     u8  op       a STORE_OP_* (request) or STORE_REP_* (reply)
 *     u8  zero     reserved, must be 0
 *     ...          payload: fields in the order listed below, nothing after the last one
 *
 * Fields: u8; u32 and i64 big-endian; "bytes" = u32 length + that many bytes; "keys" = u32 n
 * followed by n bytes. Requests and their replies (ERROR can answer any request):
 *
 *     HELLO      bytes banner, bytes run_id, bytes client_nonce
 *                                -> HELLO bytes banner, bytes owner_run_id, u8 secret_required,
 *                                         bytes server_nonce
 *     AUTH       bytes client_proof               -> AUTH bytes server_proof
 *     SET        bytes key, bytes value            -> OK
 *     GET        bytes key, i64 timeout_ms         -> VALUE bytes | TIMEOUT
 *     GET_NOWAIT bytes key                         -> VALUE bytes | NOKEY
 *     ADD        bytes key, i64 delta              -> INT i64
 *     CAS        bytes key, u8 expect_absent, bytes expected, bytes desired
 *                                                  -> VALUE bytes (value after) | NOKEY (still absent)
 *     WAIT       i64 timeout_ms, keys              -> OK | TIMEOUT
 *     CHECK      keys                              -> INT (1 all exist, 0 not)
 *     DELETE     bytes key                         -> INT (1 existed, 0 not)
 *     MULTI_GET  i64 timeout_ms, keys              -> VALUES u32 n, n x bytes | TIMEOUT
 *     MULTI_SET  u32 n, n x (bytes key, bytes value) -> OK
 *     NUM_KEYS   (nothing)                         -> INT (keys of the caller's job)
 *     ERROR      i64 code (a STORE_E*), bytes message
 *
 * timeout_ms < 0 waits forever.
 *
 * The handshake (version 2). A connection starts with HELLO: the banner, the client's run id
 * (at most STORE_MAX_RUN_ID bytes, no NUL; it names the key namespace of every later request)
 * and STORE_PROTO_NONCE random bytes. The server answers with the banner, the run id of the
 * job that hosts it, whether it requires a secret and its own random nonce. An open store
 * (no secret) is done then. A store with a secret waits for AUTH:
 *
 *     client_proof = HMAC-SHA256(secret, "meshrun-store/2 client" | client_nonce | server_nonce | run_id)
 *     server_proof = HMAC-SHA256(secret, "meshrun-store/2 server" | client_nonce | server_nonce | owner_run_id)
 *
 * (labels without their NUL; | is concatenation). The server compares in constant time and
 * answers AUTH with its own proof, which the client checks in turn, so neither side can be
 * impersonated without the secret and an old exchange cannot be replayed (fresh nonces on both
 * sides). A wrong proof gets ERROR STORE_EAUTH naming the owner's job, and the connection is
 * closed. Until the handshake is done a connection may send only these two requests, each in
 * a frame of at most STORE_PROTO_PREAUTH_FRAME bytes; anything else is answered with ERROR
 * and the connection closed. A client holding a secret refuses a store that requires none,
 * and a client without one gives up on a store that requires one (both STORE_EAUTH).
 *
 * This module only encodes and decodes (and computes the proofs); it does no I/O. */
#ifndef MESHRUN_STORE_PROTO_H
#define MESHRUN_STORE_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "common/store.h"

#define STORE_PROTO_MAGIC 0x4du /* 'M' */
#define STORE_PROTO_VERSION 2u
#define STORE_PROTO_HEADER 8u
#define STORE_PROTO_BANNER "meshrun-store"
#define STORE_PROTO_NONCE 32u           /* bytes of each side's handshake nonce */
#define STORE_PROTO_PROOF 32u           /* bytes of an HMAC-SHA256 proof */
#define STORE_PROTO_PREAUTH_FRAME 4096u /* largest frame before the handshake is done */

enum {
  STORE_OP_HELLO = 1,
  STORE_OP_SET,
  STORE_OP_GET,
  STORE_OP_GET_NOWAIT,
  STORE_OP_ADD,
  STORE_OP_CAS,
  STORE_OP_WAIT,
  STORE_OP_CHECK,
  STORE_OP_DELETE,
  STORE_OP_MULTI_GET,
  STORE_OP_MULTI_SET,
  STORE_OP_NUM_KEYS,
  STORE_OP_AUTH,
  STORE_OP_LAST_ = STORE_OP_AUTH,

  STORE_REP_OK = 0x80,
  STORE_REP_HELLO,
  STORE_REP_VALUE,
  STORE_REP_VALUES,
  STORE_REP_INT,
  STORE_REP_TIMEOUT,
  STORE_REP_NOKEY,
  STORE_REP_ERROR,
  STORE_REP_AUTH,
  STORE_REP_LAST_ = STORE_REP_AUTH,
};

/* A growing output frame. Writers never fail mid-way: an allocation failure or a frame past
 * STORE_MAX_FRAME sets `err` (STORE_ENOMEM / STORE_ETOOBIG) and later puts are ignored. */
typedef struct {
  uint8_t *buf;
  size_t len, cap;
  int err;
} store_proto_writer_t;

/* Starts a frame with op (resets len; keeps the buffer for reuse). */
void store_proto_begin(store_proto_writer_t *w, int op);
void store_proto_put_u8(store_proto_writer_t *w, uint8_t v);
void store_proto_put_u32(store_proto_writer_t *w, uint32_t v);
void store_proto_put_i64(store_proto_writer_t *w, int64_t v);
void store_proto_put_bytes(store_proto_writer_t *w, const void *p, size_t n);
/* Writes the length into the header. Returns 0 or w->err. */
int store_proto_finish(store_proto_writer_t *w);
/* Frees the buffer (accepts a zeroed writer). */
void store_proto_writer_free(store_proto_writer_t *w);
/* Bytes `bytes` fields of these lengths add to a frame (for size checks before encoding). */
size_t store_proto_bytes_size(size_t n);

/* Reads fields of one received frame's payload. A read past the end sets `bad`; values read
 * after that are zero. Byte strings point into the frame (no copy). */
typedef struct {
  const uint8_t *p;
  size_t len, off;
  int bad;
} store_proto_reader_t;

void store_proto_reader_init(store_proto_reader_t *r, const uint8_t *payload, size_t len);
uint8_t store_proto_get_u8(store_proto_reader_t *r);
uint32_t store_proto_get_u32(store_proto_reader_t *r);
int64_t store_proto_get_i64(store_proto_reader_t *r);
const uint8_t *store_proto_get_bytes(store_proto_reader_t *r, size_t *n);
/* 1 when every field was present and nothing is left over. */
int store_proto_reader_done(const store_proto_reader_t *r);

/* Validates the 8 header bytes: length within 8..STORE_MAX_FRAME, magic, version, reserved
 * byte and a known op (requests when want_request, replies otherwise). Returns 0 with
 * *frame_len and *op, or STORE_EPROTO with the reason in err. */
int store_proto_parse_header(const uint8_t hdr[STORE_PROTO_HEADER], int want_request, uint32_t *frame_len,
                             int *op, char *err, size_t errlen);
/* STORE_PROTO_NONCE fresh random bytes from the kernel's generator (getrandom). Returns 0, or
 * -1 when the generator failed. */
int store_proto_nonce(uint8_t out[STORE_PROTO_NONCE]);
/* A handshake proof (formulas above): the client's when server_side is 0, the server's
 * otherwise; run_id is the client's run id or the owner's, respectively. Returns 0, or
 * STORE_EINVAL when the HMAC could not be computed (no secret, a run id over the limit). */
int store_proto_proof(uint8_t out[STORE_PROTO_PROOF], const char *secret, int server_side,
                      const uint8_t client_nonce[STORE_PROTO_NONCE], const uint8_t server_nonce[STORE_PROTO_NONCE],
                      const void *run_id, size_t run_id_len);
/* Compares two proofs in constant time (Nettle's memeql_sec); 1 when equal. */
int store_proto_proof_equal(const uint8_t a[STORE_PROTO_PROOF], const uint8_t b[STORE_PROTO_PROOF]);

/* The op's name for messages ("GET", "REP_VALUE", "op 0x7f"). Returns a static string. */
const char *store_proto_op_name(int op);

#endif
