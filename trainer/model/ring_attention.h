/* ring_attention: causal attention over a sequence split across the ranks of a context-parallel
 * ring (mesh.cp).
 *
 * A sequence of T tokens is cut into 2 * cp chunks of c = T / (2 cp); cp rank r holds chunks r
 * and 2 cp - 1 - r (so that every rank has as much causal work as any other: an early chunk
 * and a late one). A rank's tensors are chunk-major: rows [0, B c) are its first chunk of every
 * sequence of the micro-batch, rows [B c, 2 B c) its second; each chunk is a (B, c, ...) tensor
 * of its own, at sequence positions g c .. g c + c - 1 for global chunk g.
 *
 * The forward keeps the rank's queries and passes K and V around the ring (to cp rank r + 1,
 * from r - 1) while it computes the blocks of the pair in hand (backend attention_fwd_block),
 * merging them through their log-sum-exps (attention_merge), so that after cp steps every query
 * has met every key before it. The backward passes K and V around again, and with them the
 * gradients of K and V accumulated so far: each rank adds its blocks' share (attention_bwd_block)
 * and sends them on; after the last step each rank receives its own. Transfers of the next
 * step's K/V run while the blocks of this one compute (the comm layer's started sends and
 * receives on the mesh's two ring channels). Accumulators and the travelling gradients are
 * fp32 whatever the compute dtype; the outputs are rounded once (and each block's results once
 * before, where the backend's fused kernel with bf16 outputs runs the blocks: backend.h).
 *
 * Two variants (parallel.cp_rotate): "ring" above (overlap off with parallel.cp_overlap = false:
 * each transfer is waited for before the blocks that follow it, to measure what the overlap
 * hides), and "allgather" (torchtitan's other rotate method): the cp group all-gathers every
 * rank's K/V once, the blocks run on them, and the backward's K/V gradients are summed back to
 * their owners with one reduce-scatter; more memory (every rank's K/V at once), fewer and larger
 * transfers, none of them overlapped.
 *
 * One ring_attention_t serves every layer of a model (its buffers are scratch between calls). */
#ifndef MESHRUN_RING_ATTENTION_H
#define MESHRUN_RING_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/backend.h"
#include "trainer/comm/comm.h"

#define RING_EINVAL (-1)
#define RING_ENOMEM (-2)
#define RING_ECOMM (-3)

enum { RING_ROTATE_RING = 0, RING_ROTATE_ALLGATHER = 1 };

typedef struct {
  backend_t *be;
  comm_t *send, *recv; /* the mesh's cp channels: to cp rank + 1, from cp rank - 1 */
  comm_t *group;       /* the cp group (allgather) */
  int rotate, overlap; /* RING_ROTATE_*; ring: transfers overlap the blocks (1) or not */
  void *gathered;      /* allgather: every rank's [K0 K1 V0 V1], (cp, 4 B c KV D) dt */
  float *gathered_grad; /* allgather: their gradients, fp32 */
  int cp, rank;        /* ring size (> 1) and this rank's place in it */
  int b, c, h, kv, d;  /* micro-batch, chunk length, query heads, kv heads, head dim */
  dtype_t dt;          /* q, k, v, out and their gradients */
  size_t nq, nk;       /* elements of one chunk of q (B c H D) and of k (B c KV D) */
  void *kvbuf[2];      /* dt: K of both chunks then V of both, the pair in hand and the next */
  float *ob, *lb;      /* one block's out (B c H D) and lse (B H c) */
  float *acc;          /* fp32: out (forward) or dq (backward) of both chunks */
  float *dkv[3];       /* fp32 dK|dV of both chunks: two to accumulate into, one arriving */
  char errmsg[256];
} ring_attention_t;

/* Sizes the ring for micro-batches of up to b sequences of chunk length c (T = 2 cp c) and
 * allocates its buffers on be. send and recv are the ring's channels (mesh_t.cp), cp > 1.
 * Returns 0 or RING_EINVAL / RING_ENOMEM with the reason in err. The variant is "ring" with
 * overlap; ring_attention_set_rotate chooses another. */
int ring_attention_init(ring_attention_t *r, backend_t *be, comm_t *send, comm_t *recv, int cp, int rank, int b,
                        int c, int h, int kv, int d, dtype_t dt, char *err, size_t errlen);
/* rotate RING_ROTATE_ALLGATHER needs group, the cp group's communicator (its buffers are
 * allocated here); overlap applies to the ring. Returns 0 or RING_EINVAL / RING_ENOMEM. */
int ring_attention_set_rotate(ring_attention_t *r, int rotate, int overlap, comm_t *group, char *err, size_t errlen);
void ring_attention_free(ring_attention_t *r);

/* The global chunk (0 .. 2 cp - 1) of this rank's local chunk i (0 or 1), and its first
 * position in the sequence. */
int ring_attention_chunk(const ring_attention_t *r, int i);

/* Forward. q (2 B c H D), k and v (2 B c KV D) chunk-major (above), out the same as q, lse
 * (2, B, H, c) fp32: this rank's rows of causal attention over the whole sequence, with b <= the
 * b of init sequences. Returns 0 or RING_ECOMM (the message in ring_attention_errmsg). */
int ring_attention_fwd(ring_attention_t *r, void *out, float *lse, const void *q, const void *k, const void *v,
                       int b);

/* Backward: writes dq (as q), dk and dv (as k) from dout and the forward's out and lse. */
int ring_attention_bwd(ring_attention_t *r, void *dq, void *dk, void *dv, const void *dout, const void *q,
                       const void *k, const void *v, const void *out, const float *lse, int b);

const char *ring_attention_errmsg(const ring_attention_t *r);
/* Bytes of its buffers (0 for a zeroed, unused ring_attention_t): activation scratch. */
size_t ring_attention_bytes(const ring_attention_t *r);

/* This rank's rows of b whole sequences of t tokens (host ids, (b, t)): dst (b * t / cp) gets,
 * chunk-major, chunk rank of every sequence, then chunk 2 cp - 1 - rank of every sequence (the
 * layout the forward takes). t must be a multiple of 2 cp; dst and src do not overlap. */
void ring_attention_take_rows(int32_t *dst, const int32_t *src, int b, int t, int cp, int rank);

#endif
