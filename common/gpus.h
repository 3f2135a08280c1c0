/* gpus: the GPUs this process may use, counted in the one place that meshrun
 * (--nproc_per_node=gpu and auto) and the trainer (which GPU a rank takes, whether each rank has
 * its own, whether a missing one is the job's fault) both ask, so that the two always agree.
 *
 * Counted from the device files and the visibility variable, without the vendor's driver
 * library or headers: meshrun links no GPU library, and the count must not depend on whether
 * the trainer was built with one. The implementation is the file of the GPU kind this code
 * counts (common/gpus_cuda.c: /dev/nvidiaN and CUDA_VISIBLE_DEVICES). */
#ifndef MESHRUN_GPUS_H
#define MESHRUN_GPUS_H

#ifdef __cplusplus
extern "C" { /* a device backend written in C++ counts with it */
#endif

/* The GPUs under dev_dir ("/dev") that visible (the visibility variable's value, NULL when
 * unset) leaves to this process; 0 when dev_dir cannot be read. Exposed for tests. */
int gpus_count(const char *dev_dir, const char *visible);
/* gpus_count of this machine's /dev under this process's environment. */
int gpus_visible(void);
/* Where a count of 0 comes from, for messages: "no /dev/nvidiaN, or CUDA_VISIBLE_DEVICES hides
 * them all". */
const char *gpus_none_hint(void);

#ifdef __cplusplus
}
#endif

#endif
