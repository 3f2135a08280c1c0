/* comm_cpu: the "cpu" collective backend, rings of TCP connections between the group's ranks.
 *
 * Setup (cpu_create, its registry entry's): each rank listens on a kernel-chosen port, publishes
 * "comm/<group>/<generation>/<rank>" -> "host:port" in the store, connects to its right
 * neighbour (rank + 1) and accepts its left one (rank - 1), which identifies itself with a
 * hello naming the group, generation and ranks. Connect comes before accept: the listen
 * backlog completes every connect at once, so no order among ranks can deadlock.
 *
 * Collectives are the bandwidth-optimal rings. all_reduce = ring reduce-scatter then ring
 * all-gather over n balanced chunks (counts need not divide by n), each rank sending
 * 2 (n-1)/n of the buffer. reduce_scatter and all_gather are those two halves on their own.
 * broadcast is a chain from the root around the ring, forwarding bytes as they arrive, so it
 * pipelines without a chunk size. barrier passes a one-byte token n-1 times around the ring.
 *
 * Point-to-point uses the same links, so a send goes only to the right neighbour and a receive
 * comes only from the left one (the dispatch refuses other peers: p2p_ring). Each message is a
 * 16-byte header (magic, dtype, count) and the payload; the receiver reads the header first and
 * refuses a send whose count or dtype differs from its own, naming both, which also catches a
 * peer that is in a collective instead (no magic). The header is not counted in the stats.
 *
 * Each step sends to the right while receiving from the left on nonblocking sockets with
 * poll(), so large messages never deadlock on full socket buffers; received elements are
 * reduced as they arrive, overlapping the arithmetic with the transfer. Reductions are
 * deterministic: chunk c is summed in ring order starting at rank c + 1, the same order in every
 * run, and the all-gather copies the finished chunk, so every rank ends with the same bits.
 *
 * Both dtypes: float32 (4-byte elements) and bfloat16 (2-byte, trainer/backend/bf16.h). Chunks are
 * counted in elements and moved as bytes, so all_gather and broadcast never look at the values.
 * A bf16 combining step widens both operands to fp32, adds (or compares) in fp32 and rounds the
 * sum once to nearest even, as NCCL does per hop; since fp32 carries more than twice bf16's
 * precision, that one rounding gives the correctly rounded bf16 sum of the two. MAX picks one of
 * the two inputs and never rounds. AVG divides the finished sum by the group size once, in fp32,
 * and rounds: AVG is always SUM's bits divided and rounded, on every rank alike.
 *
 * What it does not do: no threads of its own (comm.c runs started requests on a progress thread,
 * one call at a time), no topology awareness (one ring over the group's
 * order), no recovery: on any error it closes its sockets so the neighbours fail at once too,
 * and the communicator is broken for good. Stats count payload bytes, not TCP headers. Its
 * abort (the fatal path) shuts both sockets down rather than closing them: the neighbours read
 * end-of-file at once even when another process still holds the descriptors (a forked child),
 * and the descriptors stay valid for whatever call is still polling them. */
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/net.h"
#include "trainer/backend/bf16.h"

#define HELLO_MAGIC 0x4d52434du /* "MRCM" */
#define P2P_MAGIC 0x4d525032u   /* "MRP2": the header of a point-to-point message */
#define HELLO_VERSION 1u
#define EP_MAX 300
/* One send() call moves at most this much, so reduction of received data keeps pace. */
#define SEND_MAX ((size_t)1 << 20)

typedef struct {
  uint32_t magic, version, generation, src_rank, dst_rank, size;
  char name[COMM_NAME_MAX];
} hello_t;

/* Before each point-to-point payload, in host byte order (both ends run this program). */
typedef struct {
  uint32_t magic, dtype;
  uint64_t count; /* elements */
} p2p_hdr_t;

typedef struct {
  int fd_send; /* to the right neighbour */
  int fd_recv; /* from the left neighbour */
  int left, right;
  char left_label[EP_MAX + 64];  /* "rank 0 (127.0.0.1:41234)" */
  char right_label[EP_MAX + 64];
  size_t *off;     /* n + 1 chunk offsets (elements) of the collective in progress */
  char *scratch;   /* receive buffer of the reductions */
  size_t scratch_cap; /* bytes */
} cpu_t;

/* One step of a ring: send slen bytes to the right while receiving rlen from the left.
 * forward: sbuf == rbuf and only bytes already received may be sent (broadcast chain).
 * With reduce set, every whole element that arrives is combined at once:
 * dst[i] = rbuf[i] op src[i], elements of dtype. */
typedef struct {
  const char *sbuf;
  size_t slen, sent;
  char *rbuf;
  size_t rlen, rcvd;
  int forward;
  int reduce;
  comm_op_t op;
  dtype_t dtype;
  char *dst;
  const char *src;
  size_t reduced; /* elements already combined */
  int control;    /* a header, not payload: not counted in the stats */
} xfer_t;

/* Closes both links. Called on every failure: the neighbours see the connection close and
 * fail at once instead of waiting for their timeout, and so on around the ring. */
static void cpu_abort_links(cpu_t *p) {
  if (p->fd_send >= 0) close(p->fd_send);
  if (p->fd_recv >= 0) close(p->fd_recv);
  p->fd_send = p->fd_recv = -1;
}

static int fail(comm_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(comm_t *c, int code, const char *fmt, ...) {
  char what[COMM_ERR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  cpu_abort_links(c->impl);
  return comm_set_error(c, code, "%.*s", COMM_ERR_MAX - 100, what);
}

static void combine_f32(float *dst, const float *a, const float *b, size_t n, comm_op_t op) {
  if (op == COMM_MAX) {
    for (size_t i = 0; i < n; i++) dst[i] = a[i] > b[i] ? a[i] : b[i];
  } else {
    for (size_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
  }
}

/* Widen, combine in fp32, round once. MAX keeps the bits of the input it picks, and picks as
 * combine_f32 does (b unless a is greater, so a NaN or a tie of zeros behaves the same). */
static void combine_bf16(bf16_t *dst, const bf16_t *a, const bf16_t *b, size_t n, comm_op_t op) {
  if (op == COMM_MAX) {
    for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(a[i]) > bf16_to_f32(b[i]) ? a[i] : b[i];
  } else {
    for (size_t i = 0; i < n; i++) dst[i] = bf16_from_f32(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
  }
}

/* n elements of dtype from element offset `at` of each buffer: dst = a op b. */
static void combine(char *dst, const char *a, const char *b, size_t at, size_t n,
                    dtype_t dtype, comm_op_t op) {
  if (dtype == DT_BF16)
    combine_bf16((bf16_t *)dst + at, (const bf16_t *)a + at, (const bf16_t *)b + at, n, op);
  else
    combine_f32((float *)dst + at, (const float *)a + at, (const float *)b + at, n, op);
}

static int xfer_run(comm_t *c, const char *what, xfer_t *x) {
  cpu_t *p = c->impl;
  int64_t deadline = net_now_ms() + c->timeout_ms;
  while (x->sent < x->slen || x->rcvd < x->rlen) {
    struct pollfd pf[2];
    int np = 0, is = -1, ir = -1;
    size_t sendable = x->forward ? x->rcvd : x->slen;
    if (sendable > x->slen) sendable = x->slen;
    if (x->sent < sendable) {
      pf[np] = (struct pollfd){.fd = p->fd_send, .events = POLLOUT};
      is = np++;
    }
    if (x->rcvd < x->rlen) {
      pf[np] = (struct pollfd){.fd = p->fd_recv, .events = POLLIN};
      ir = np++;
    }
    int64_t left_ms = deadline - net_now_ms();
    if (left_ms <= 0) {
      /* Waiting to receive means the left peer is behind; else the right one stopped reading. */
      const char *who = x->rcvd < x->rlen ? p->left_label : p->right_label;
      return fail(c, COMM_ETIMEDOUT, "%s timed out after %g s waiting for %s", what,
                  c->timeout_ms / 1000.0, who);
    }
    int n = poll(pf, (nfds_t)np, (int)(left_ms > 1000000 ? 1000000 : left_ms));
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(c, COMM_ESYSTEM, "%s: poll: %s", what, strerror(errno));
    }
    int progress = 0;
    if (is >= 0 && pf[is].revents) {
      size_t len = sendable - x->sent;
      if (len > SEND_MAX) len = SEND_MAX;
      ssize_t k = send(p->fd_send, x->sbuf + x->sent, len, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        x->sent += (size_t)k;
        if (!x->control) c->stats.bytes_sent += (uint64_t)k;
        progress = 1;
      } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        int e = errno;
        if (e == EPIPE || e == ECONNRESET || e == ENOTCONN)
          return fail(c, COMM_EREMOTE, "%s: connection to %s lost (%s); did that process exit?",
                      what, p->right_label, strerror(e));
        return fail(c, COMM_ESYSTEM, "%s: send to %s: %s", what, p->right_label, strerror(e));
      }
    }
    if (ir >= 0 && pf[ir].revents) {
      ssize_t k = recv(p->fd_recv, x->rbuf + x->rcvd, x->rlen - x->rcvd, MSG_DONTWAIT);
      if (k > 0) {
        x->rcvd += (size_t)k;
        if (!x->control) c->stats.bytes_recv += (uint64_t)k;
        progress = 1;
        if (x->reduce) {
          size_t ready = x->rcvd / dtype_size(x->dtype);
          combine(x->dst, x->rbuf, x->src, x->reduced, ready - x->reduced, x->dtype, x->op);
          x->reduced = ready;
        }
      } else if (k == 0) {
        return fail(c, COMM_EREMOTE, "%s: connection from %s closed by the peer; did that "
                    "process exit?", what, p->left_label);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        int e = errno;
        if (e == ECONNRESET || e == ENOTCONN)
          return fail(c, COMM_EREMOTE, "%s: connection from %s reset (%s); did that process "
                      "exit?", what, p->left_label, strerror(e));
        return fail(c, COMM_ESYSTEM, "%s: recv from %s: %s", what, p->left_label, strerror(e));
      }
    }
    if (progress) deadline = net_now_ms() + c->timeout_ms;
  }
  return COMM_OK;
}

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* Chunk offsets: balanced (all_reduce: sizes differ by at most one element) or uniform
 * (count elements per chunk: reduce_scatter, all_gather). */
static void chunks_balanced(size_t *off, size_t count, int n) {
  size_t q = count / (size_t)n, r = count % (size_t)n;
  for (int i = 0; i <= n; i++) off[i] = q * (size_t)i + ((size_t)i < r ? (size_t)i : r);
}

static void chunks_uniform(size_t *off, size_t count, int n) {
  for (int i = 0; i <= n; i++) off[i] = count * (size_t)i;
}

static int ensure_scratch(comm_t *c, size_t bytes) {
  cpu_t *p = c->impl;
  if (bytes <= p->scratch_cap) return COMM_OK;
  char *s = realloc(p->scratch, bytes);
  if (!s) return fail(c, COMM_ESYSTEM, "out of memory for a %zu-byte receive buffer", bytes);
  p->scratch = s;
  p->scratch_cap = bytes;
  return COMM_OK;
}

/* AVG: the finished sum divided by the group size, once, in fp32; bf16 rounds the quotient. */
static void scale_avg(void *x, size_t n, dtype_t dtype, int size) {
  float d = (float)size;
  if (dtype == DT_BF16) {
    bf16_t *h = x;
    for (size_t i = 0; i < n; i++) h[i] = bf16_from_f32(bf16_to_f32(h[i]) / d);
  } else {
    float *f = x;
    for (size_t i = 0; i < n; i++) f[i] = f[i] / d;
  }
}

/* Ring all-gather over p->off (elements of esz bytes): on entry rank r holds chunk `own` of buf;
 * on return all. */
static int ring_all_gather(comm_t *c, const char *what, char *buf, size_t esz, int own) {
  cpu_t *p = c->impl;
  int n = c->size;
  for (int s = 0; s < n - 1; s++) {
    int cs = mod(own - s, n), cr = mod(own - s - 1, n);
    xfer_t x = {.sbuf = buf + p->off[cs] * esz,
                .slen = (p->off[cs + 1] - p->off[cs]) * esz,
                .rbuf = buf + p->off[cr] * esz,
                .rlen = (p->off[cr + 1] - p->off[cr]) * esz};
    int rc = xfer_run(c, what, &x);
    if (rc) return rc;
  }
  return COMM_OK;
}

static int cpu_all_reduce(comm_t *c, void *vbuf, size_t count, dtype_t dtype, comm_op_t op) {
  cpu_t *p = c->impl;
  char *buf = vbuf;
  size_t esz = dtype_size(dtype);
  int n = c->size, r = c->rank;
  chunks_balanced(p->off, count, n);
  int rc = ensure_scratch(c, (p->off[1] - p->off[0]) * esz); /* chunk 0 is a largest one */
  if (rc) return rc;
  /* Reduce-scatter: at step s send chunk r-s-1 (partial sum of ranks r-s-1..r), receive chunk
   * r-s-2 and add our own values to it; after n-1 steps chunk r holds the full reduction. */
  for (int s = 0; s < n - 1; s++) {
    int cs = mod(r - s - 1, n), cr = mod(r - s - 2, n);
    size_t rn = p->off[cr + 1] - p->off[cr];
    xfer_t x = {.sbuf = buf + p->off[cs] * esz,
                .slen = (p->off[cs + 1] - p->off[cs]) * esz,
                .rbuf = p->scratch, .rlen = rn * esz,
                .reduce = 1, .op = op, .dtype = dtype,
                .dst = buf + p->off[cr] * esz, .src = buf + p->off[cr] * esz};
    rc = xfer_run(c, "all_reduce", &x);
    if (rc) return rc;
  }
  if (op == COMM_AVG) scale_avg(buf + p->off[r] * esz, p->off[r + 1] - p->off[r], dtype, n);
  return ring_all_gather(c, "all_reduce", buf, esz, r);
}

static int cpu_all_gather(comm_t *c, const void *in, void *out, size_t count, dtype_t dtype) {
  cpu_t *p = c->impl;
  chunks_uniform(p->off, count, c->size);
  /* the dispatch put `in` in our slot */
  return ring_all_gather(c, "all_gather", out, dtype_size(dtype), c->rank);
}

static int cpu_reduce_scatter(comm_t *c, const void *vin, void *vout, size_t count,
                              dtype_t dtype, comm_op_t op) {
  cpu_t *p = c->impl;
  const char *in = vin;
  char *out = vout;
  size_t esz = dtype_size(dtype), bytes = count * esz;
  int n = c->size, r = c->rank;
  int rc = ensure_scratch(c, bytes);
  if (rc) return rc;
  /* The same ring as all_reduce's first half, but the input is read-only: partial sums live in
   * two buffers used in turn, out and scratch, chosen so that the last step lands in out. */
  const char *send = in + (size_t)mod(r - 1, n) * bytes;
  for (int s = 0; s < n - 1; s++) {
    int cr = mod(r - s - 2, n);
    char *recv = ((n - 2 - s) % 2 == 0) ? out : p->scratch;
    xfer_t x = {.sbuf = send, .slen = bytes, .rbuf = recv, .rlen = bytes,
                .reduce = 1, .op = op, .dtype = dtype,
                .dst = recv, .src = in + (size_t)cr * bytes};
    rc = xfer_run(c, "reduce_scatter", &x);
    if (rc) return rc;
    send = recv;
  }
  if (op == COMM_AVG) scale_avg(out, count, dtype, n);
  return COMM_OK;
}

static int cpu_broadcast(comm_t *c, void *buf, size_t count, dtype_t dtype, int root) {
  int n = c->size, pos = mod(c->rank - root, n); /* distance from the root along the ring */
  size_t bytes = count * dtype_size(dtype);
  xfer_t x = {.sbuf = buf, .slen = pos == n - 1 ? 0 : bytes,
              .rbuf = buf, .rlen = pos == 0 ? 0 : bytes, .forward = pos != 0};
  return xfer_run(c, "broadcast", &x);
}

static int cpu_barrier(comm_t *c) {
  for (int s = 0; s < c->size - 1; s++) {
    unsigned char out = (unsigned char)s, in = 0xff;
    xfer_t x = {.sbuf = (const char *)&out, .slen = 1, .rbuf = (char *)&in, .rlen = 1};
    int rc = xfer_run(c, "barrier", &x);
    if (rc) return rc;
    /* The token counts steps: another value means the neighbour is in another collective. */
    if (in != out)
      return fail(c, COMM_EREMOTE, "barrier: %s sent token %u at step %d: it is not in the "
                  "same collective (calls out of order?)", ((cpu_t *)c->impl)->left_label, in, s);
  }
  return COMM_OK;
}

static const char *p2p_dtype_name(uint32_t dtype) { /* as a peer's header says it */
  return dtype == DT_F32 ? "float32" : dtype == DT_BF16 ? "bfloat16" : "elements of an unknown dtype";
}

/* The dispatch checked peer: the right neighbour. Header, then payload, each sent whole. */
static int cpu_send(comm_t *c, const void *buf, size_t count, dtype_t dtype, int peer) {
  p2p_hdr_t h = {.magic = P2P_MAGIC, .dtype = (uint32_t)dtype, .count = count};
  xfer_t hx = {.sbuf = (const char *)&h, .slen = sizeof h, .control = 1};
  int rc = xfer_run(c, "send", &hx);
  if (rc) return rc;
  xfer_t x = {.sbuf = buf, .slen = count * dtype_size(dtype)};
  return xfer_run(c, "send", &x);
}

/* The dispatch checked peer: the left neighbour. The header must announce what this receive
 * expects; anything else breaks the communicator, since the bytes that follow are not ours to
 * read (calls out of order, or sizes that differ between the two sides). */
static int cpu_recv(comm_t *c, void *buf, size_t count, dtype_t dtype, int peer) {
  cpu_t *p = c->impl;
  p2p_hdr_t h = {0};
  xfer_t hx = {.rbuf = (char *)&h, .rlen = sizeof h, .control = 1};
  int rc = xfer_run(c, "recv", &hx);
  if (rc) return rc;
  if (h.magic != P2P_MAGIC)
    return fail(c, COMM_EREMOTE, "recv of %zu %s from %s met something that is not a send (is the peer in "
                "a collective? calls out of order?)", count, p2p_dtype_name(dtype), p->left_label);
  if (h.count != count || h.dtype != (uint32_t)dtype)
    return fail(c, COMM_EREMOTE, "recv of %zu %s from %s met a send of %llu %s", count, p2p_dtype_name(dtype),
                p->left_label, (unsigned long long)h.count, p2p_dtype_name(h.dtype));
  xfer_t x = {.rbuf = buf, .rlen = count * dtype_size(dtype)};
  return xfer_run(c, "recv", &x);
}

static void cpu_abort(comm_t *c) {
  cpu_t *p = c->impl;
  if (p->fd_send >= 0) shutdown(p->fd_send, SHUT_RDWR);
  if (p->fd_recv >= 0) shutdown(p->fd_recv, SHUT_RDWR);
}

static void cpu_destroy(comm_t *c) {
  cpu_t *p = c->impl;
  if (!p) return;
  cpu_abort_links(p);
  free(p->off);
  free(p->scratch);
  free(p);
  c->impl = NULL;
}

static const comm_ops_t cpu_ops = {
    .name = "cpu",
    .all_reduce = cpu_all_reduce,
    .all_gather = cpu_all_gather,
    .reduce_scatter = cpu_reduce_scatter,
    .broadcast = cpu_broadcast,
    .barrier = cpu_barrier,
    .destroy = cpu_destroy,
    .send = cpu_send,
    .recv = cpu_recv,
    .p2p_ring = 1,
    .bf16 = 1,
    .abort = cpu_abort,
};

/* ---- setup ---- */

static void peer_label(char *out, size_t len, const comm_config_t *cfg, int rank, const char *ep) {
  if (cfg->global_ranks)
    snprintf(out, len, "rank %d (global rank %d, %s)", rank, cfg->global_ranks[rank], ep);
  else
    snprintf(out, len, "rank %d (%s)", rank, ep);
}

static void endpoint_key(char *key, size_t len, const comm_config_t *cfg, int rank) {
  snprintf(key, len, "comm/%s/%d/%d", cfg->name, cfg->generation, rank);
}

/* Reads rank's published endpoint into ep; waits up to timeout_ms for it to appear. */
static int read_endpoint(const comm_config_t *cfg, int rank, int timeout_ms, char *ep,
                         size_t eplen, char *err, size_t errlen) {
  char key[128];
  endpoint_key(key, sizeof key, cfg, rank);
  void *val = NULL;
  size_t len = 0;
  int rc = store_get(cfg->store, key, &val, &len, timeout_ms);
  if (rc != STORE_OK) {
    if (rc == STORE_ETIMEDOUT)
      err_set(err, errlen, 0,
              "rank %d published no endpoint within %g s (store key %s); did it "
              "start?",
              rank, timeout_ms / 1000.0, key);
    else
      err_set(err, errlen, 0, "reading store key %s: %s", key, store_errmsg(cfg->store));
    return rc == STORE_ETIMEDOUT ? COMM_ETIMEDOUT : COMM_EREMOTE;
  }
  if (len == 0 || len >= eplen) {
    free(val);
    return err_set(err, errlen, COMM_EREMOTE, "store key %s holds a malformed endpoint (%zu bytes)", key, len);
  }
  memcpy(ep, val, len);
  ep[len] = '\0';
  free(val);
  return COMM_OK;
}

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Accepts connections on lfd until the left neighbour's valid hello arrives (anything else is
 * closed and ignored) or the deadline passes. Returns the fd or a negative code. */
static int accept_left(const comm_config_t *cfg, int lfd, int left, int64_t deadline, char *err,
                       size_t errlen) {
  for (;;) {
    int64_t wait = deadline - net_now_ms();
    if (wait <= 0) {
      return err_set(err, errlen, COMM_ETIMEDOUT, "rank %d did not connect within the setup timeout", left);
    }
    struct pollfd pf = {.fd = lfd, .events = POLLIN};
    int n = poll(&pf, 1, (int)(wait > 1000000 ? 1000000 : wait));
    if (n < 0 && errno != EINTR) {
      return err_set(err, errlen, COMM_ESYSTEM, "poll on the listening socket: %s", strerror(errno));
    }
    if (n <= 0) continue;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      return err_set(err, errlen, COMM_ESYSTEM, "accept: %s", strerror(errno));
    }
    hello_t h;
    int64_t hw = deadline - net_now_ms();
    int rc = net_recv_all(fd, &h, sizeof h, hw > 0 ? (int)hw : 1);
    if (rc == 0 && h.magic == HELLO_MAGIC && h.version == HELLO_VERSION &&
        h.generation == (uint32_t)cfg->generation && h.src_rank == (uint32_t)left &&
        h.dst_rank == (uint32_t)cfg->rank && h.size == (uint32_t)cfg->size &&
        strncmp(h.name, cfg->name, sizeof h.name) == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    close(fd); /* a stray or stale connection: not our neighbour */
  }
}

/* Setup's step 2: the right neighbour's endpoint from the store, a connection to it
 * (p->fd_send) and our hello on it. COMM_OK, or a code with the cause in why. */
static int connect_right(const comm_config_t *cfg, cpu_t *p, int64_t deadline, char *why, size_t whylen) {
  char rep[EP_MAX], rhost[256];
  int rport = 0;
  int64_t wait = deadline - net_now_ms();
  int rc = read_endpoint(cfg, p->right, wait > 0 ? (int)wait : 1, rep, sizeof rep, why, whylen);
  if (rc) return rc;
  peer_label(p->right_label, sizeof p->right_label, cfg, p->right, rep);
  if (net_parse_endpoint(rep, rhost, sizeof rhost, &rport, 0, 0, why, whylen) != 0) return COMM_EREMOTE;
  wait = deadline - net_now_ms();
  p->fd_send = net_connect(rhost, rport, wait > 0 ? (int)wait : 1, why, whylen);
  if (p->fd_send < 0) {
    p->fd_send = -1;
    return COMM_EREMOTE;
  }
  hello_t h;
  memset(&h, 0, sizeof h);
  h.magic = HELLO_MAGIC;
  h.version = HELLO_VERSION;
  h.generation = (uint32_t)cfg->generation;
  h.src_rank = (uint32_t)cfg->rank;
  h.dst_rank = (uint32_t)p->right;
  h.size = (uint32_t)cfg->size;
  snprintf(h.name, sizeof h.name, "%s", cfg->name);
  int e = net_send_all(p->fd_send, &h, sizeof h);
  if (e != 0) {
    snprintf(why, whylen, "sending hello to %s: %s", p->right_label, strerror(-e));
    return COMM_EREMOTE;
  }
  return COMM_OK;
}

static int cpu_create(comm_t *c, const comm_config_t *cfg, char *err, size_t errlen) {
  cpu_t *p = calloc(1, sizeof *p);
  if (!p) {
    return err_set(err, errlen, COMM_ESYSTEM, "comm %s: out of memory", cfg->name);
  }
  p->fd_send = p->fd_recv = -1;
  c->impl = p;
  c->ops = &cpu_ops;
  int n = cfg->size, r = cfg->rank;
  p->left = mod(r - 1, n);
  p->right = mod(r + 1, n);
  p->off = calloc((size_t)n + 1, sizeof *p->off);
  if (!p->off) {
    return err_set(err, errlen, COMM_ESYSTEM, "comm %s: out of memory", cfg->name);
  }
  if (n == 1) return COMM_OK; /* the dispatch answers every call of a one-rank group */

  char why[COMM_ERR_MAX] = "";
  int rc = COMM_OK, lfd = -1, port = 0;
  int64_t deadline = net_now_ms() + c->timeout_ms;
  const char *host = cfg->host;
  if (!host || !*host) host = getenv("MESHRUN_COMM_HOST");
  char advertise[256];
  if (host && *host) {
    snprintf(advertise, sizeof advertise, "%s", host);
  } else {
    host = "";
    net_hostname(advertise, sizeof advertise);
  }

  /* 1. Listen and publish. */
  lfd = net_listen(host, 0, 64, &port, why, sizeof why);
  if (lfd < 0) {
    rc = COMM_ESYSTEM;
    goto error;
  }
  char ep[EP_MAX], key[128];
  net_format_endpoint(ep, sizeof ep, advertise, port);
  endpoint_key(key, sizeof key, cfg, r);
  if (store_set(cfg->store, key, ep, strlen(ep)) != STORE_OK) {
    snprintf(why, sizeof why, "publishing %s = %s: %s", key, ep, store_errmsg(cfg->store));
    rc = COMM_EREMOTE;
    goto error;
  }

  /* 2. Connect to the right neighbour and introduce ourselves. */
  rc = connect_right(cfg, p, deadline, why, sizeof why);
  if (rc) goto error;

  /* 3. Accept the left neighbour. Its endpoint is read only to name it in messages. */
  char lep[EP_MAX];
  int64_t wait = deadline - net_now_ms();
  rc = read_endpoint(cfg, p->left, wait > 0 ? (int)wait : 1, lep, sizeof lep, why, sizeof why);
  if (rc) goto error;
  peer_label(p->left_label, sizeof p->left_label, cfg, p->left, lep);
  int fd = accept_left(cfg, lfd, p->left, deadline, why, sizeof why);
  if (fd < 0) {
    rc = fd;
    goto error;
  }
  p->fd_recv = fd;
  close(lfd);
  lfd = -1;
  if (set_nonblocking(p->fd_send) < 0 || set_nonblocking(p->fd_recv) < 0) {
    snprintf(why, sizeof why, "fcntl O_NONBLOCK: %s", strerror(errno));
    rc = COMM_ESYSTEM;
    goto error;
  }
  return COMM_OK;

error:
  if (lfd >= 0) close(lfd);
  cpu_abort_links(p);
  return err_set(err, errlen, rc, "comm %s (rank %d/%d): setup: %s", cfg->name, r, n, why);
}

/* The registry's entry (trainer/comm/registry.c): host memory, for the host backends. */
const comm_entry_t comm_entry_cpu = {
    .name = "cpu",
    .mem = COMM_MEM_HOST,
    .create = cpu_create,
};
