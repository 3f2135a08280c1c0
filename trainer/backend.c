/* backend: picks a backend implementation by name.
 *
 * "cpu" is always built; "cuda" exists only in builds with MESHRUN_HAVE_CUDA (the Makefile sets
 * it where nvcc is found; backend_cuda_create picks the GPU). This file holds no kernels; it
 * only dispatches creation and destruction, so the model and the trainer never name a
 * backend's file. It also holds backend_fatal, the fatal path of every device error (cuda
 * backend and nccl comm alike): every program that links a device backend links this file.
 *
 * comm_abort_all is referenced weakly: a program with backends but no communicators (a kernel
 * test) has nothing to abort. */
#include "trainer/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "trainer/comm.h"

#pragma weak comm_abort_all

void backend_fatal(const char *file, int line, const char *call, const char *msg) {
  char host[256] = "?";
  if (gethostname(host, sizeof host - 1) != 0) strcpy(host, "?");
  host[sizeof host - 1] = '\0';
  const char *rank = getenv("RANK");
  fprintf(stderr, "[trainer rank %s %s] %s:%d: %s: %s\n", rank && *rank ? rank : "0", host, file, line, call,
          msg ? msg : "");
  fflush(stderr);
  /* Before exit, not in an atexit handler: exit may hang in a broken driver's teardown, and the
   * peers must not wait for that. */
  if (comm_abort_all) comm_abort_all("a fatal device error on this rank");
  exit(1);
}

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
