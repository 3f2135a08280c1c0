/* attention_cudnn_absent: the stand-in for attention_cudnn.cpp in a cuda build made without
 * cudnn-frontend's headers (scripts/install-deps.sh installs them): the cuda backend opens no
 * cuDNN, says why once, and runs its reference attention kernel. */
#include <stdio.h>

#include "trainer/backend/attention_cudnn.h"

cudnn_att_t *cudnn_att_open(void *stream, cudnn_att_ws_fn ws, void *ws_ctx, char *why, size_t len) {
  (void)stream, (void)ws, (void)ws_ctx;
  if (why && len) snprintf(why, len, "this trainer was built without cudnn-frontend (scripts/install-deps.sh)");
  return NULL;
}

void cudnn_att_close(cudnn_att_t *a) { (void)a; }

const char *cudnn_att_version(const cudnn_att_t *a) {
  (void)a;
  return "";
}

int cudnn_att_prepare(cudnn_att_t *a, int b, int t, int h, int kv, int d, int causal, int *deterministic, char *why,
                      size_t len) {
  (void)a, (void)b, (void)t, (void)h, (void)kv, (void)d, (void)causal, (void)deterministic;
  if (why && len) snprintf(why, len, "built without cudnn-frontend");
  return -1;
}

int cudnn_att_fwd(cudnn_att_t *a, void *out, float *lse, const void *q, const void *k, const void *v, int b, int t,
                  int h, int kv, int d, int causal, char *why, size_t len) {
  (void)out, (void)lse, (void)q, (void)k, (void)v;
  return cudnn_att_prepare(a, b, t, h, kv, d, causal, NULL, why, len);
}

int cudnn_att_bwd(cudnn_att_t *a, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                  const void *v, const void *out, const float *lse, int b, int t, int h, int kv, int d, int causal,
                  char *why, size_t len) {
  (void)dq, (void)dk, (void)dv, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse;
  return cudnn_att_prepare(a, b, t, h, kv, d, causal, NULL, why, len);
}
