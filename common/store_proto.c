/* store_proto: encoding and decoding of store frames (layout in store_proto.h).
 *
 * Big-endian integers, u32-length-prefixed byte strings, a fixed 8-byte header. Writers grow
 * one malloc'ed buffer and refuse to pass STORE_MAX_FRAME; readers never read past the frame.
 * The handshake's nonces come from the kernel's generator (getrandom), its proofs from
 * Nettle (HMAC-SHA256, memeql_sec), never from a hash of our own. Nettle, linked statically,
 * and not OpenSSL's libcrypto: a process that merely loaded libcrypto spent about 0.4 ms
 * relocating it, and its first HMAC or RAND_bytes loaded OpenSSL's providers, another 1.4 ms;
 * every node of a 2048-node start on one machine paid both (bench/bench_launcher.py --parts c).
 * No I/O and no policy here: the caller decides what a malformed frame or a wrong proof means. */
#include "common/err.h"
#include "common/store_proto.h"

#include <errno.h>
#include <nettle/hmac.h>
#include <nettle/memops.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

static void reserve(store_proto_writer_t *w, size_t extra) {
  if (w->err) return;
  if (extra > STORE_MAX_FRAME || w->len + extra > STORE_MAX_FRAME) {
    w->err = STORE_ETOOBIG;
    return;
  }
  size_t need = w->len + extra;
  if (need <= w->cap) return;
  size_t cap = w->cap ? w->cap : 256;
  while (cap < need) cap *= 2;
  if (cap > STORE_MAX_FRAME) cap = STORE_MAX_FRAME;
  uint8_t *nb = realloc(w->buf, cap);
  if (!nb) {
    w->err = STORE_ENOMEM;
    return;
  }
  w->buf = nb;
  w->cap = cap;
}

static void wr_u32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

static uint32_t rd_u32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

void store_proto_begin(store_proto_writer_t *w, int op) {
  w->len = 0;
  w->err = 0;
  reserve(w, STORE_PROTO_HEADER);
  if (w->err) return;
  wr_u32(w->buf, 0);
  w->buf[4] = STORE_PROTO_MAGIC;
  w->buf[5] = STORE_PROTO_VERSION;
  w->buf[6] = (uint8_t)op;
  w->buf[7] = 0;
  w->len = STORE_PROTO_HEADER;
}

void store_proto_put_u8(store_proto_writer_t *w, uint8_t v) {
  reserve(w, 1);
  if (w->err) return;
  w->buf[w->len++] = v;
}

void store_proto_put_u32(store_proto_writer_t *w, uint32_t v) {
  reserve(w, 4);
  if (w->err) return;
  wr_u32(w->buf + w->len, v);
  w->len += 4;
}

void store_proto_put_i64(store_proto_writer_t *w, int64_t v) {
  uint64_t u = (uint64_t)v;
  store_proto_put_u32(w, (uint32_t)(u >> 32));
  store_proto_put_u32(w, (uint32_t)u);
}

void store_proto_put_bytes(store_proto_writer_t *w, const void *p, size_t n) {
  if (!w->err && n > STORE_MAX_FRAME) w->err = STORE_ETOOBIG;
  store_proto_put_u32(w, (uint32_t)n);
  reserve(w, n);
  if (w->err) return;
  if (n) memcpy(w->buf + w->len, p, n);
  w->len += n;
}

int store_proto_finish(store_proto_writer_t *w) {
  if (w->err) return w->err;
  wr_u32(w->buf, (uint32_t)w->len);
  return 0;
}

void store_proto_writer_free(store_proto_writer_t *w) {
  if (!w) return;
  free(w->buf);
  w->buf = NULL;
  w->len = w->cap = 0;
}

size_t store_proto_bytes_size(size_t n) { return 4 + n; }

void store_proto_reader_init(store_proto_reader_t *r, const uint8_t *payload, size_t len) {
  r->p = payload;
  r->len = len;
  r->off = 0;
  r->bad = 0;
}

static const uint8_t *take(store_proto_reader_t *r, size_t n) {
  if (r->bad || n > r->len - r->off) {
    r->bad = 1;
    return NULL;
  }
  const uint8_t *p = r->p + r->off;
  r->off += n;
  return p;
}

uint8_t store_proto_get_u8(store_proto_reader_t *r) {
  const uint8_t *p = take(r, 1);
  return p ? p[0] : 0;
}

uint32_t store_proto_get_u32(store_proto_reader_t *r) {
  const uint8_t *p = take(r, 4);
  return p ? rd_u32(p) : 0;
}

int64_t store_proto_get_i64(store_proto_reader_t *r) {
  const uint8_t *p = take(r, 8);
  if (!p) return 0;
  return (int64_t)((uint64_t)rd_u32(p) << 32 | rd_u32(p + 4));
}

const uint8_t *store_proto_get_bytes(store_proto_reader_t *r, size_t *n) {
  uint32_t len = store_proto_get_u32(r);
  const uint8_t *p = take(r, len);
  *n = p ? len : 0;
  return p;
}

int store_proto_reader_done(const store_proto_reader_t *r) { return !r->bad && r->off == r->len; }

int store_proto_parse_header(const uint8_t hdr[STORE_PROTO_HEADER], int want_request, uint32_t *frame_len,
                             int *op, char *err, size_t errlen) {
  uint32_t len = rd_u32(hdr);
  if (len < STORE_PROTO_HEADER || len > STORE_MAX_FRAME) {
    return err_set(err, errlen, STORE_EPROTO, "frame length %u outside %u..%u", len, STORE_PROTO_HEADER,
                   STORE_MAX_FRAME);
  }
  if (hdr[4] != STORE_PROTO_MAGIC) {
    return err_set(err, errlen, STORE_EPROTO, "bad magic byte 0x%02x (expected 0x%02x)", hdr[4], STORE_PROTO_MAGIC);
  }
  if (hdr[5] != STORE_PROTO_VERSION) {
    return err_set(err, errlen, STORE_EPROTO, "protocol version %u (expected %u)", hdr[5], STORE_PROTO_VERSION);
  }
  if (hdr[7] != 0) {
    return err_set(err, errlen, STORE_EPROTO, "reserved header byte is 0x%02x, not 0", hdr[7]);
  }
  int o = hdr[6];
  int known = want_request ? (o >= STORE_OP_HELLO && o <= STORE_OP_LAST_)
                           : (o >= STORE_REP_OK && o <= STORE_REP_LAST_);
  if (!known) {
    return err_set(err, errlen, STORE_EPROTO, "unknown %s op 0x%02x", want_request ? "request" : "reply", o);
  }
  *frame_len = len;
  *op = o;
  return 0;
}

int store_proto_nonce(uint8_t out[STORE_PROTO_NONCE]) {
  /* Requests of up to 256 bytes are never cut short once the generator is seeded; it blocks
   * only before that (early boot), which is what a nonce needs. */
  ssize_t n;
  do n = getrandom(out, STORE_PROTO_NONCE, 0);
  while (n < 0 && errno == EINTR);
  return n == (ssize_t)STORE_PROTO_NONCE ? 0 : -1;
}

/* The labels keep a client proof from ever being accepted as a server proof (or a proof of any
 * other protocol keyed by the same secret). */
#define PROOF_LABEL_CLIENT "meshrun-store/2 client"
#define PROOF_LABEL_SERVER "meshrun-store/2 server"
_Static_assert(sizeof PROOF_LABEL_CLIENT == sizeof PROOF_LABEL_SERVER, "proof labels size the message buffer");

int store_proto_proof(uint8_t out[STORE_PROTO_PROOF], const char *secret, int server_side,
                      const uint8_t client_nonce[STORE_PROTO_NONCE], const uint8_t server_nonce[STORE_PROTO_NONCE],
                      const void *run_id, size_t run_id_len) {
  const char *label = server_side ? PROOF_LABEL_SERVER : PROOF_LABEL_CLIENT;
  size_t ln = strlen(label);
  uint8_t msg[sizeof PROOF_LABEL_CLIENT + 2 * STORE_PROTO_NONCE + STORE_MAX_RUN_ID];
  if (!secret || run_id_len > STORE_MAX_RUN_ID || (run_id_len && !run_id)) return STORE_EINVAL;
  memcpy(msg, label, ln);
  memcpy(msg + ln, client_nonce, STORE_PROTO_NONCE);
  memcpy(msg + ln + STORE_PROTO_NONCE, server_nonce, STORE_PROTO_NONCE);
  if (run_id_len) memcpy(msg + ln + 2 * STORE_PROTO_NONCE, run_id, run_id_len);
  struct hmac_sha256_ctx ctx;
  hmac_sha256_set_key(&ctx, strlen(secret), (const uint8_t *)secret);
  hmac_sha256_update(&ctx, ln + 2 * STORE_PROTO_NONCE + run_id_len, msg);
  hmac_sha256_digest(&ctx, STORE_PROTO_PROOF, out);
  explicit_bzero(&ctx, sizeof ctx); /* it holds the key's pads */
  return 0;
}

int store_proto_proof_equal(const uint8_t a[STORE_PROTO_PROOF], const uint8_t b[STORE_PROTO_PROOF]) {
  return memeql_sec(a, b, STORE_PROTO_PROOF);
}

const char *store_proto_op_name(int op) {
  switch (op) {
  case STORE_OP_HELLO: return "HELLO";
  case STORE_OP_SET: return "SET";
  case STORE_OP_GET: return "GET";
  case STORE_OP_GET_NOWAIT: return "GET_NOWAIT";
  case STORE_OP_ADD: return "ADD";
  case STORE_OP_CAS: return "CAS";
  case STORE_OP_WAIT: return "WAIT";
  case STORE_OP_CHECK: return "CHECK";
  case STORE_OP_DELETE: return "DELETE";
  case STORE_OP_MULTI_GET: return "MULTI_GET";
  case STORE_OP_MULTI_SET: return "MULTI_SET";
  case STORE_OP_NUM_KEYS: return "NUM_KEYS";
  case STORE_OP_AUTH: return "AUTH";
  case STORE_REP_OK: return "REP_OK";
  case STORE_REP_HELLO: return "REP_HELLO";
  case STORE_REP_VALUE: return "REP_VALUE";
  case STORE_REP_VALUES: return "REP_VALUES";
  case STORE_REP_INT: return "REP_INT";
  case STORE_REP_TIMEOUT: return "REP_TIMEOUT";
  case STORE_REP_NOKEY: return "REP_NOKEY";
  case STORE_REP_ERROR: return "REP_ERROR";
  case STORE_REP_AUTH: return "REP_AUTH";
  default: return "unknown op";
  }
}
