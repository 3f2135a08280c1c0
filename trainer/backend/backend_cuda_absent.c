/* backend_cuda_absent: the cuda backend's registry entry in a build without nvcc, which the
 * Makefile compiles instead of backend_cuda.cu. The name stays known, so that device "cuda",
 * device "auto" and backend_create say that this build lacks it and how to get it, rather than
 * "unknown". */
#include "trainer/backend/backend.h"

const backend_entry_t backend_entry_cuda = {
    .name = "cuda",
    .mem = BACKEND_MEM_DEVICE,
    .absent = "built without nvcc",
    .remedy = "rebuild where nvcc is found",
};
