/* comm_nccl: the hooks only the "nccl" comm backend has (comm_nccl.c). The collectives
 * themselves are comm.h's; these are for code that knows it runs on CUDA (the GPU tests). They
 * exist only in builds with CUDA, where comm_nccl.c is compiled. */
#ifndef MESHRUN_COMM_NCCL_H
#define MESHRUN_COMM_NCCL_H

#include "trainer/comm/comm.h"

/* Gives an nccl communicator the compute stream (a cudaStream_t) that produces and consumes its
 * buffers: collectives then wait for it with an event instead of synchronizing the device
 * backend, and the compute stream waits for them likewise (comm_wait returns without waiting on
 * the host); the dispatch's local device copies are queued on it. NULL goes back to the
 * conservative order. COMM_EINVAL for a communicator of another backend. */
int comm_nccl_set_stream(comm_t *c, void *compute_stream);
/* Aborts every live nccl communicator of this process (ncclCommAbort), so that peers blocked in
 * a collective with it fail instead of hanging; the communicators are unusable afterwards. The
 * fatal path (backend_fatal) aborts every communicator, nccl ones included, through
 * comm_abort_all; this is the nccl-only form. */
void comm_nccl_abort_all(void);

#endif
