/* ring_attention: causal attention across the cp ring (see ring_attention.h). */
#include "trainer/model/ring_attention.h"

#include <stdio.h>
#include <string.h>

#include "common/err.h"

/* What ring_attention_init allocates: two K/V buffers of the compute dtype; in fp32 one block's
 * output and log-sum-exp, both chunks' running results and three K/V gradient buffers. */
static size_t buffer_bytes(const ring_attention_t *r) {
  const size_t es = dtype_size(r->dt), f = sizeof(float), nl = (size_t)r->b * r->h * r->c;
  return 2 * 4 * r->nk * es + (r->nq + nl + 2 * r->nq + 3 * 4 * r->nk) * f;
}

int ring_attention_init(ring_attention_t *r, backend_t *be, comm_t *send, comm_t *recv, int cp, int rank, int b,
                        int c, int h, int kv, int d, dtype_t dt, char *err, size_t errlen) {
  memset(r, 0, sizeof *r);
  if (cp < 2 || rank < 0 || rank >= cp || !send || !recv || b < 1 || c < 1 || h < 1 || kv < 1 || d < 1) {
    return err_set(err, errlen, RING_EINVAL, "ring attention: bad geometry (cp %d rank %d b %d c %d h %d kv %d d %d)",
                   cp, rank, b, c, h, kv, d);
  }
  if (!be->attention_fwd_block || !be->attention_merge || !be->attention_bwd_block) {
    return err_set(err, errlen, RING_EINVAL, "ring attention: backend %s has no attention blocks", be->name);
  }
  *r = (ring_attention_t){.be = be, .send = send, .recv = recv, .cp = cp, .rank = rank, .b = b, .c = c, .h = h,
                          .kv = kv, .d = d, .dt = dt, .overlap = 1};
  r->nq = (size_t)b * c * h * d;
  r->nk = (size_t)b * c * kv * d;
  const size_t es = dtype_size(dt), nl = (size_t)b * h * c, f = sizeof(float);
  for (int i = 0; i < 2; i++)
    r->kvbuf[i] = be->alloc(be, 4 * r->nk * es);
  r->ob = be->alloc(be, r->nq * f);
  r->lb = be->alloc(be, nl * f);
  r->acc = be->alloc(be, 2 * r->nq * f);
  int ok = r->kvbuf[0] && r->kvbuf[1] && r->ob && r->lb && r->acc;
  for (int i = 0; i < 3; i++)
    ok = ok && (r->dkv[i] = be->alloc(be, 4 * r->nk * f));
  if (!ok) {
    const size_t bytes = buffer_bytes(r);
    ring_attention_free(r);
    return err_set(err, errlen, RING_ENOMEM, "ring attention: out of memory for its buffers (%zu bytes)", bytes);
  }
  return 0;
}

int ring_attention_set_rotate(ring_attention_t *r, int rotate, int overlap, comm_t *group, char *err, size_t errlen) {
  r->overlap = overlap;
  if (rotate == RING_ROTATE_RING) {
    r->rotate = rotate;
    return 0;
  }
  if (rotate != RING_ROTATE_ALLGATHER || !group || comm_size(group) != r->cp || comm_rank(group) != r->rank) {
    return err_set(err, errlen, RING_EINVAL, "ring attention: rotate %d needs the cp group's communicator", rotate);
  }
  const size_t n = (size_t)r->cp * 4 * r->nk;
  r->gathered = r->be->alloc(r->be, n * dtype_size(r->dt));
  r->gathered_grad = r->be->alloc(r->be, n * sizeof(float));
  if (!r->gathered || !r->gathered_grad) {
    return err_set(err, errlen, RING_ENOMEM, "ring attention: out of memory for every rank's K/V (%zu bytes)",
                   n * (dtype_size(r->dt) + sizeof(float)));
  }
  r->group = group;
  r->rotate = rotate;
  return 0;
}

void ring_attention_free(ring_attention_t *r) {
  if (!r || !r->be) return;
  backend_t *be = r->be;
  be->free(be, r->gathered);
  be->free(be, r->gathered_grad);
  be->free(be, r->kvbuf[0]);
  be->free(be, r->kvbuf[1]);
  be->free(be, r->ob);
  be->free(be, r->lb);
  be->free(be, r->acc);
  for (int i = 0; i < 3; i++)
    be->free(be, r->dkv[i]);
  memset(r, 0, sizeof *r);
}

int ring_attention_chunk(const ring_attention_t *r, int i) { return i == 0 ? r->rank : 2 * r->cp - 1 - r->rank; }

const char *ring_attention_errmsg(const ring_attention_t *r) { return r->errmsg; }

size_t ring_attention_bytes(const ring_attention_t *r) {
  if (!r->be) return 0;
  size_t n = buffer_bytes(r);
  if (r->gathered) n += (size_t)r->cp * 4 * r->nk * (dtype_size(r->dt) + sizeof(float));
  return n;
}

void ring_attention_take_rows(int32_t *dst, const int32_t *src, int b, int t, int cp, int rank) {
  const int c = t / (2 * cp);
  for (int i = 0; i < 2; i++) {
    const int g = i == 0 ? rank : 2 * cp - 1 - rank;
    for (int bi = 0; bi < b; bi++)
      memcpy(dst + ((size_t)i * b + bi) * c, src + (size_t)bi * t + (size_t)g * c, (size_t)c * sizeof *dst);
  }
}

/* The global chunk of local chunk i of cp rank src. */
static int chunk_of(const ring_attention_t *r, int src, int i) { return i == 0 ? src : 2 * r->cp - 1 - src; }

static char *at(const void *p, size_t elems, size_t es) { return (char *)p + elems * es; }

/* A started transfer on the ring: the buffer's n elements to cp rank + 1 (send) or from
 * rank - 1 (receive); each channel is a two-rank communicator whose sender is its rank 0. */
static int start(ring_attention_t *r, int is_send, void *buf, size_t n, dtype_t dt, comm_req_t **req) {
  int rc = is_send ? comm_start_send(r->send, buf, n, dt, 1, req) : comm_start_recv(r->recv, buf, n, dt, 0, req);
  if (rc && !r->errmsg[0])
    snprintf(r->errmsg, sizeof r->errmsg, "context-parallel ring: %s: %s", is_send ? "send" : "receive",
             comm_errmsg(is_send ? r->send : r->recv));
  return rc;
}

/* Waits for *req (NULL: nothing started) and forgets it; the first failure is the message. */
static int finish(ring_attention_t *r, comm_req_t **req, int is_send) {
  if (!*req) return 0;
  int rc = comm_wait(*req, NULL);
  *req = NULL;
  if (rc && !r->errmsg[0])
    snprintf(r->errmsg, sizeof r->errmsg, "context-parallel ring: %s: %s", is_send ? "send" : "receive",
             comm_errmsg(is_send ? r->send : r->recv));
  return rc;
}

/* This step's K/V (kvbuf[cur]) on to the next rank while the previous rank's arrive in the other
 * buffer; not on the last step, whose K/V nobody needs. */
static int kv_pass(ring_attention_t *r, int s, int cur, size_t nk, comm_req_t **sreq, comm_req_t **rreq) {
  if (s == r->cp - 1) return 0;
  int rc = start(r, 1, r->kvbuf[cur], 4 * nk, r->dt, sreq);
  return rc ? rc : start(r, 0, r->kvbuf[cur ^ 1], 4 * nk, r->dt, rreq);
}

/* Own K then V of both chunks into kvbuf[0]: [K0 K1 V0 V1]. */
static void kv_own(ring_attention_t *r, const void *k, const void *v, size_t nk) {
  const size_t es = dtype_size(r->dt);
  r->be->copy(r->be, r->kvbuf[0], k, 2 * nk * es);
  r->be->copy(r->be, at(r->kvbuf[0], 2 * nk, es), v, 2 * nk * es);
}

/* The blocks of one step: the local chunks' (i) against the chunks of cp rank src (j) whose keys
 * come no later than the chunk's queries (a later chunk: keys after every query), i then j;
 * with the element counts of one chunk's q, k (or v) and lse. */
typedef struct {
  size_t es, nq, nk, nl;
  int n, i[4], j[4];
  long qpos[4], kpos[4];
} blocks_t;

static void visible_blocks(const ring_attention_t *r, int src, int b, blocks_t *bl) {
  const int c = r->c;
  bl->es = dtype_size(r->dt);
  bl->nq = (size_t)b * c * r->h * r->d;
  bl->nk = (size_t)b * c * r->kv * r->d;
  bl->nl = (size_t)b * r->h * c;
  bl->n = 0;
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) {
      const int gi = ring_attention_chunk(r, i), gj = chunk_of(r, src, j);
      if (gj > gi) continue;
      bl->i[bl->n] = i;
      bl->j[bl->n] = j;
      bl->qpos[bl->n] = (long)gi * c;
      bl->kpos[bl->n++] = (long)gj * c;
    }
}

/* The forward's blocks of the local queries against the K/V of cp rank src (kvb: its [K0 K1 V0
 * V1]); started[i]: chunk i's running result holds a block already. */
static void fwd_blocks(ring_attention_t *r, int src, const void *kvb, const void *q, float *lse, int b,
                       int started[2]) {
  backend_t *be = r->be;
  blocks_t bl;
  visible_blocks(r, src, b, &bl);
  for (int k = 0; k < bl.n; k++) {
    const int i = bl.i[k], j = bl.j[k];
    const char *kj = at(kvb, (size_t)j * bl.nk, bl.es), *vj = at(kvb, (size_t)(2 + j) * bl.nk, bl.es);
    float *acc = r->acc + (size_t)i * bl.nq, *lacc = lse + (size_t)i * bl.nl;
    /* the first block of a chunk (its diagonal, in step 0) is written, the later ones merged */
    be->attention_fwd_block(be, started[i] ? r->ob : acc, started[i] ? r->lb : lacc, at(q, (size_t)i * bl.nq, bl.es),
                            kj, vj, b, r->c, r->c, r->h, r->kv, r->d, bl.qpos[k], bl.kpos[k], r->dt);
    if (started[i]) be->attention_merge(be, acc, lacc, r->ob, r->lb, b, r->c, r->h, r->d);
    started[i] = 1;
  }
}

/* The cp group's collective on the K/V (or their gradients) of every rank; the first failure is
 * the message. */
static int group_check(ring_attention_t *r, int rc, const char *what) {
  if (rc && !r->errmsg[0])
    snprintf(r->errmsg, sizeof r->errmsg, "context-parallel %s: %s", what, comm_errmsg(r->group));
  return rc;
}

int ring_attention_fwd(ring_attention_t *r, void *out, float *lse, const void *q, const void *k, const void *v,
                       int b) {
  const size_t nq = (size_t)b * r->c * r->h * r->d, nk = (size_t)b * r->c * r->kv * r->d,
               es = dtype_size(r->dt);
  r->errmsg[0] = '\0';
  kv_own(r, k, v, nk);
  int started[2] = {0, 0}, rc = 0;
  if (r->rotate == RING_ROTATE_ALLGATHER) { /* every rank's K/V at once, the blocks in the ring's order */
    rc = group_check(r, comm_all_gather(r->group, r->kvbuf[0], r->gathered, 4 * nk, r->dt), "all_gather of K/V");
    for (int s = 0; s < r->cp && !rc; s++) {
      const int src = (r->rank - s + r->cp) % r->cp;
      fwd_blocks(r, src, at(r->gathered, (size_t)src * 4 * nk, es), q, lse, b, started);
    }
  }
  comm_req_t *sreq = NULL, *rreq = NULL;
  for (int s = 0, cur = 0; r->rotate == RING_ROTATE_RING && s < r->cp && !rc; s++, cur ^= 1) {
    const int src = (r->rank - s + r->cp) % r->cp;
    rc = kv_pass(r, s, cur, nk, &sreq, &rreq);
    if (!r->overlap) rc = rc ? rc : finish(r, &sreq, 1) ? 1 : finish(r, &rreq, 0);
    if (!rc) fwd_blocks(r, src, r->kvbuf[cur], q, lse, b, started);
    int rs = finish(r, &sreq, 1), rr = finish(r, &rreq, 0);
    rc = rc ? rc : rs ? rs : rr;
  }
  if (rc) return RING_ECOMM;
  r->be->convert(r->be, out, r->dt, r->acc, DT_F32, 2 * nq);
  return 0;
}

/* The gradients of the K/V in hand (dkv[blk]) on to the next rank, which holds those K/V next,
 * and the previous rank's into dkv[2]; the send before (of the other buffer) is waited for
 * first, so that a buffer is never written while it is sent. */
static int grad_pass(ring_attention_t *r, int blk, size_t nk, comm_req_t **gs, comm_req_t **gr) {
  int rc = finish(r, gs, 1);
  if (!rc) rc = start(r, 1, r->dkv[blk], 4 * nk, DT_F32, gs);
  if (!rc) rc = start(r, 0, r->dkv[2], 4 * nk, DT_F32, gr);
  return rc;
}

/* One step's blocks: dq of both chunks accumulates in acc, the K/V in hand's gradients in g. */
static void bwd_blocks(ring_attention_t *r, int src, const void *kvb, float *g, const void *dout, const void *q,
                       const void *out, const float *lse, int b) {
  backend_t *be = r->be;
  blocks_t bl;
  visible_blocks(r, src, b, &bl);
  const size_t es = bl.es, nq = bl.nq, nk = bl.nk;
  for (int k = 0; k < bl.n; k++) {
    const int i = bl.i[k], j = bl.j[k];
    be->attention_bwd_block(be, r->acc + (size_t)i * nq, g + (size_t)j * nk, g + (size_t)(2 + j) * nk,
                            at(dout, (size_t)i * nq, es), at(q, (size_t)i * nq, es), at(kvb, (size_t)j * nk, es),
                            at(kvb, (size_t)(2 + j) * nk, es), at(out, (size_t)i * nq, es), lse + (size_t)i * bl.nl, b,
                            r->c, r->c, r->h, r->kv, r->d, bl.qpos[k], bl.kpos[k], r->dt);
  }
}

/* allgather's backward: the blocks against every rank's K/V, each rank's gradients in its slot,
 * then one reduce-scatter brings each rank the sum of its own (into dkv[2]). */
static int bwd_allgather(ring_attention_t *r, const void *dout, const void *q, const void *out, const float *lse,
                         int b, size_t nk) {
  const size_t es = dtype_size(r->dt);
  if (group_check(r, comm_all_gather(r->group, r->kvbuf[0], r->gathered, 4 * nk, r->dt), "all_gather of K/V"))
    return RING_ECOMM;
  r->be->zero(r->be, r->gathered_grad, (size_t)r->cp * 4 * nk * sizeof(float));
  for (int s = 0; s < r->cp; s++) {
    const int src = (r->rank - s + r->cp) % r->cp;
    bwd_blocks(r, src, at(r->gathered, (size_t)src * 4 * nk, es), r->gathered_grad + (size_t)src * 4 * nk, dout, q,
               out, lse, b);
  }
  if (group_check(r, comm_reduce_scatter(r->group, r->gathered_grad, r->dkv[2], 4 * nk, DT_F32, COMM_SUM),
                  "reduce_scatter of the K/V gradients"))
    return RING_ECOMM;
  return 0;
}

/* The ring's backward; its K/V gradients end in dkv[2]. */
static int bwd_ring(ring_attention_t *r, const void *dout, const void *q, const void *out, const float *lse, int b,
                    size_t nk) {
  backend_t *be = r->be;
  const size_t f = sizeof(float);
  comm_req_t *ks = NULL, *kr = NULL, *gs = NULL, *gr = NULL;
  int cur = 0, blk = 0, rc = 0;
  for (int s = 0; s < r->cp && !rc; s++) {
    const int src = (r->rank - s + r->cp) % r->cp;
    rc = kv_pass(r, s, cur, nk, &ks, &kr);
    if (!r->overlap) rc = rc ? rc : finish(r, &ks, 1) ? 1 : finish(r, &kr, 0);
    if (rc) break;
    be->zero(be, r->dkv[blk], 4 * nk * f);
    bwd_blocks(r, src, r->kvbuf[cur], r->dkv[blk], dout, q, out, lse, b);
    if (s > 0) { /* what the ranks before added to these K/V's gradients */
      rc = finish(r, &gr, 0);
      if (rc) break;
      be->add(be, r->dkv[blk], r->dkv[blk], r->dkv[2], 4 * nk, DT_F32);
    }
    rc = grad_pass(r, blk, nk, &gs, &gr);
    if (!r->overlap) rc = rc ? rc : finish(r, &gs, 1);
    blk ^= 1;
    int rs = finish(r, &ks, 1), rr = finish(r, &kr, 0);
    rc = rc ? rc : rs ? rs : rr;
    cur ^= 1;
  }
  /* the last pass brought this rank's own K/V gradients home */
  int rs = finish(r, &ks, 1), rr = finish(r, &kr, 0), g1 = finish(r, &gs, 1), g2 = finish(r, &gr, 0);
  return rc || rs || rr || g1 || g2 ? RING_ECOMM : 0;
}

int ring_attention_bwd(ring_attention_t *r, void *dq, void *dk, void *dv, const void *dout, const void *q,
                       const void *k, const void *v, const void *out, const float *lse, int b) {
  backend_t *be = r->be;
  const size_t nq = (size_t)b * r->c * r->h * r->d, nk = (size_t)b * r->c * r->kv * r->d, f = sizeof(float);
  r->errmsg[0] = '\0';
  kv_own(r, k, v, nk);
  be->zero(be, r->acc, 2 * nq * f);
  int rc = r->rotate == RING_ROTATE_ALLGATHER ? bwd_allgather(r, dout, q, out, lse, b, nk)
                                              : bwd_ring(r, dout, q, out, lse, b, nk);
  if (rc) return rc;
  be->convert(be, dq, r->dt, r->acc, DT_F32, 2 * nq);
  be->convert(be, dk, r->dt, r->dkv[2], DT_F32, 2 * nk);
  be->convert(be, dv, r->dt, at(r->dkv[2], 2 * nk, f), DT_F32, 2 * nk);
  return 0;
}
