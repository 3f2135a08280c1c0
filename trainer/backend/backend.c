/* backend: picks a backend implementation by name.
 *
 * "cpu" is always built; "cuda" exists only in builds with MESHRUN_HAVE_CUDA (the Makefile sets
 * it where nvcc is found; backend_cuda_create picks the GPU). This file holds no kernels; it
 * only dispatches creation and destruction, so the model and the trainer never name a
 * backend's file. The fatal path of device errors is fatal.c's. */
#include "trainer/backend/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

backend_t *backend_create(const char *name, int threads, char *err, size_t errlen) {
  if (!name) name = "cpu";
  if (!strcmp(name, "cpu")) return backend_cpu_create(threads, err, errlen);
  if (!strcmp(name, "cuda")) {
#ifdef MESHRUN_HAVE_CUDA
    return backend_cuda_create(-1, err, errlen); /* threads mean nothing there; -1: GPU by LOCAL_RANK */
#else
    if (err && errlen)
      snprintf(err, errlen, "backend error: \"cuda\" is not available in this build (built without nvcc); use \"cpu\"");
    return NULL;
#endif
  }
  if (err && errlen)
    snprintf(err, errlen, "backend error: unknown backend \"%s\" (known: cpu%s)", name,
#ifdef MESHRUN_HAVE_CUDA
             ", cuda"
#else
             ""
#endif
    );
  return NULL;
}

void backend_destroy(backend_t *be) {
  if (be && be->destroy) be->destroy(be);
}
