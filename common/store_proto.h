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
 *     HELLO      bytes banner                      -> HELLO bytes banner (STORE_PROTO_BANNER)
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
 *     NUM_KEYS   (nothing)                         -> INT
 *     ERROR      i64 code (a STORE_E*), bytes message
 *
 * timeout_ms < 0 waits forever. This module only encodes and decodes; it does no I/O. */
#ifndef MESHRUN_STORE_PROTO_H
#define MESHRUN_STORE_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "common/store.h"

#define STORE_PROTO_MAGIC 0x4du /* 'M' */
#define STORE_PROTO_VERSION 1u
#define STORE_PROTO_HEADER 8u
#define STORE_PROTO_BANNER "meshrun-store"

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
  STORE_OP_LAST_ = STORE_OP_NUM_KEYS,

  STORE_REP_OK = 0x80,
  STORE_REP_HELLO,
  STORE_REP_VALUE,
  STORE_REP_VALUES,
  STORE_REP_INT,
  STORE_REP_TIMEOUT,
  STORE_REP_NOKEY,
  STORE_REP_ERROR,
  STORE_REP_LAST_ = STORE_REP_ERROR,
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
/* The op's name for messages ("GET", "REP_VALUE", "op 0x7f"). Returns a static string. */
const char *store_proto_op_name(int op);

#endif
