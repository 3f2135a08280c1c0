/* comm_nccl_absent: the nccl comm backend's registry entry in a build without CUDA, which the
 * Makefile compiles instead of comm_nccl.c. The name stays known (MESHRUN_COMM_BACKEND=nccl is
 * a known value everywhere), and comm_create says that this build lacks it. */
#include "trainer/comm/comm.h"

const comm_entry_t comm_entry_nccl = {
    .name = "nccl",
    .mem = COMM_MEM_DEVICE,
    .device = "cuda",
    .device_per_rank = 1,
    .capturable = 1,
    .absent = "this build has no CUDA: nvcc was not found",
};
