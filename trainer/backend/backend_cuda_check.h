/* backend_cuda_check: the check macros of the CUDA libraries' calls (CUDA, cuBLAS, NCCL), one per
 * library, all ending in the one fatal path, backend_fatal (trainer/backend/fatal.c;
 * docs/STYLE.md, "Errors"):
 *
 *   [trainer rank R host] file:line: call: message
 *
 * on stderr, then every live communicator of the process aborted (comm_abort_all: peers fail at
 * once instead of waiting out the comm timeout), then exit(1) so that meshrun restarts or
 * reports. For errors with no recovery path inside a kernel or collective call; errors a caller
 * can act on (a peer that left, a bad argument) are returned as statuses instead.
 *
 * Macros only: include this after the library's own header, in the files that make device calls
 * (backend_cuda.cu, comm_nccl.c). backend_fatal has C linkage, so the .cu file calls the same
 * function (fatal.c). */
#ifndef MESHRUN_BACKEND_CUDA_CHECK_H
#define MESHRUN_BACKEND_CUDA_CHECK_H

#include "trainer/backend/backend.h"

/* During a stream capture (backend_recording), an error of the capture itself, or any error
 * once the capture has broken, is kept for graph_end (which then fails) instead of being fatal. */
static inline int cuda_record_absorbs(int e, int capture_error) {
  if (!backend_recording || !(capture_error || backend_record_error)) return 0;
  if (!backend_record_error) backend_record_error = e;
  return 1;
}
#define CUDA_CAPTURE_ERROR(e)                                                                  \
  ((e) == cudaErrorStreamCaptureUnsupported || (e) == cudaErrorStreamCaptureInvalidated ||     \
   (e) == cudaErrorStreamCaptureImplicit || (e) == cudaErrorStreamCaptureUnjoined ||           \
   (e) == cudaErrorStreamCaptureIsolation || (e) == cudaErrorStreamCaptureUnmatched ||         \
   (e) == cudaErrorStreamCaptureMerge || (e) == cudaErrorStreamCaptureWrongThread ||           \
   (e) == cudaErrorCapturedEvent)

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess && !cuda_record_absorbs((int)e_, CUDA_CAPTURE_ERROR(e_)))            \
      backend_fatal(__FILE__, __LINE__, #call, cudaGetErrorString(e_));                        \
  } while (0)

#define CUBLAS_CHECK(call)                                                                     \
  do {                                                                                         \
    cublasStatus_t s_ = (call);                                                                \
    if (s_ != CUBLAS_STATUS_SUCCESS && !cuda_record_absorbs((int)s_, 0))                       \
      backend_fatal(__FILE__, __LINE__, #call, cublasGetStatusString(s_));                     \
  } while (0)

/* For NCCL calls whose failure leaves nothing to return to (a collective's own errors are
 * returned by the comm backend, with the peer named). */
#define NCCL_CHECK(call)                                                                       \
  do {                                                                                         \
    ncclResult_t r_ = (call);                                                                  \
    if (r_ != ncclSuccess && r_ != ncclInProgress)                                             \
      backend_fatal(__FILE__, __LINE__, #call, ncclGetErrorString(r_));                        \
  } while (0)

#endif
