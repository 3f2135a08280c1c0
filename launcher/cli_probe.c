/* cli_probe: the CPUs that --nproc_per_node=cpu counts, and auto when there is no GPU. The
 * GPUs are counted in one place for the launcher and the trainer: common/gpus.h. */
#include "launcher/cli.h"

#include <errno.h>
#include <sched.h>
#include <unistd.h>

int cli_count_cpus(void) {
  /* The affinity mask, not the machine: under taskset or a cgroup cpuset the workers can only
   * use these. Machines with more CPUs than a cpu_set_t holds need a bigger mask. */
  for (int ncpu = 1024; ncpu <= (1 << 20); ncpu *= 2) {
    cpu_set_t *set = CPU_ALLOC(ncpu);
    if (!set) break;
    size_t size = CPU_ALLOC_SIZE(ncpu);
    CPU_ZERO_S(size, set);
    if (sched_getaffinity(0, size, set) == 0) {
      int n = CPU_COUNT_S(size, set);
      CPU_FREE(set);
      return n > 0 ? n : 1;
    }
    int e = errno;
    CPU_FREE(set);
    if (e != EINVAL) break;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}
