/* health_probe: the GEMM of --health_check measured on this node's devices by the trainer, a
 * child of meshrun: `trainer --health-gemm` (trainer/run/health_gemm.h), the program `trainer`
 * in the folder of the meshrun executable (both are built into bin/). meshrun links no device
 * library; the trainer links every compute backend, so it measures what the workers will
 * compute on (the GPUs where it sees them, else the CPU) and prints one line of JSON:
 *   {"gflops": 812345.6, "devices": [...], "device": "cuda", "dtype": "bf16", "n": 4096}
 *
 * The child gets meshrun's environment plus what its workers get that chooses devices:
 * LOCAL_WORLD_SIZE (the devices the workers will use) and, when unset and there are several
 * workers, OMP_NUM_THREADS=1 (as launcher/workers gives them); CUDA_VISIBLE_DEVICES passes
 * through. It runs in a process group of its own (a Ctrl-C to meshrun's group is meshrun's to
 * act on), with stdin from /dev/null and stdout and stderr into pipes.
 *
 * health_probe_run blocks its caller (the health check's thread, never the loop) until the
 * line is in and the child has ended, the timeout passed or *stop was set; in the last two cases
 * the child gets SIGKILL and is waited for, so that it is never left behind. The loop's SIGCHLD
 * handler (launcher/workers: waitpid(-1)) may reap it first: the verdict then comes from its
 * output alone, and the child is killed only while its stdout is open (so it has not exited,
 * and its pid is still its own). */
#ifndef MESHRUN_HEALTH_PROBE_H
#define MESHRUN_HEALTH_PROBE_H

#include <stdatomic.h>
#include <stddef.h>

#define HEALTH_PROBE_TIMEOUT_S 30.0 /* the probe's whole run, a device's start included */
#define HEALTH_PROBE_FLAG "--health-gemm"

typedef struct {
  double gflops;    /* the slowest device's rate, GFLOP/s */
  int devices;      /* how many it measured */
  char device[16];  /* their kind, the trainer's backend name: "cpu", "cuda" */
  char dtype[8];    /* "bf16", "fp32" */
} health_probe_t;

/* Parses the probe's output (len bytes, not necessarily terminated): its last line that starts
 * with '{' must be a JSON object with "gflops" > 0, "device" a short name without spaces, and
 * "devices" a non-empty array ("dtype" optional). 0, or -1 with what was wrong in err. */
int health_probe_parse(const char *out, size_t len, health_probe_t *p, char *err, size_t errlen);
/* The trainer beside this meshrun into path: 0 when it is there and executable, else -1 with
 * err "no trainer beside meshrun (PATH)". */
int health_probe_path(char *path, size_t len, char *err, size_t errlen);
/* Runs `path --health-gemm` for nproc workers and parses its line (above). 0 with *p, or -1
 * with why in err: the child could not start, it failed (its last line on stderr, its status),
 * it gave no line that parses, it did not end within timeout_s, or *stop was set ("stopped"). */
int health_probe_run(const char *path, int nproc, double timeout_s, atomic_int *stop, health_probe_t *p, char *err,
                     size_t errlen);

#endif
