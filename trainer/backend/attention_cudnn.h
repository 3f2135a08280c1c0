/* attention_cudnn: causal grouped-query attention on tensor cores through cuDNN's fused
 * scaled-dot-product-attention (flash-style) graphs, built with cudnn-frontend.
 *
 * The cuda backend's one door to cuDNN (backend_cuda.cu calls it; nothing else does). cuDNN is
 * loaded at run time (dlopen of libcudnn.so.9), never linked, so that a trainer built with it runs
 * where cuDNN is missing and falls back to the reference kernel. Layouts are backend.h's: q and
 * out (B,T,H,D), k and v (B,T,KV,D), all bf16; lse (B,H,T) fp32, the natural log-sum-exp of each
 * row of scaled scores (cuDNN's "stats"). Plans are built once per shape and cached; execution
 * queues on the stream given to open. Every function reports failure as text in why and never
 * exits: the caller decides between a plan error and the fallback.
 *
 * A build without cudnn-frontend links attention_cudnn_absent.c instead (open says why). */
#ifndef MESHRUN_ATTENTION_CUDNN_H
#define MESHRUN_ATTENTION_CUDNN_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cudnn_att cudnn_att_t;

/* Device scratch for cuDNN's workspace: returns at least bytes of device memory, kept by the
 * caller (the backend's scratch, counted in its memory peak), or NULL. */
typedef void *(*cudnn_att_ws_fn)(void *ctx, size_t bytes);

/* Loads cuDNN, checks its version (9.x) and makes a handle on stream (a cudaStream_t). NULL with
 * why when the library is missing or refuses. */
cudnn_att_t *cudnn_att_open(void *stream, cudnn_att_ws_fn ws, void *ws_ctx, char *why, size_t len);
void cudnn_att_close(cudnn_att_t *a); /* accepts NULL */

/* cuDNN's version as "9.19.0" ("" before a successful open). */
const char *cudnn_att_version(const cudnn_att_t *a);

/* Builds, or finds built, the forward and backward plans of one shape; 0, or -1 with why (the
 * shape is refused; later calls with it answer the same at once). A shape is (b, t, h, kv, d)
 * and causal: 1 the causal mask (query i sees keys 0 .. i), 0 none (every query sees every key:
 * a block of ring attention whose keys all come before its queries); each has its own plans.
 * deterministic: the backward's algorithm that gives the same bits every run (set to 0 when
 * cuDNN refused it and a nondeterministic one was built instead). */
int cudnn_att_prepare(cudnn_att_t *a, int b, int t, int h, int kv, int d, int causal, int *deterministic, char *why,
                      size_t len);

/* Forward and backward of a prepared shape (they prepare it when it is not). The backward writes
 * dq, dk and dv (it does not accumulate) from out and lse as given: a block's backward takes
 * its rows' whole out and lse. 0, or -1 with why. */
int cudnn_att_fwd(cudnn_att_t *a, void *out, float *lse, const void *q, const void *k, const void *v, int b, int t,
                  int h, int kv, int d, int causal, char *why, size_t len);
int cudnn_att_bwd(cudnn_att_t *a, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                  const void *v, const void *out, const float *lse, int b, int t, int h, int kv, int d, int causal,
                  char *why, size_t len);

#ifdef __cplusplus
}
#endif

#endif
