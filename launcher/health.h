/* health: meshrun's health check before a round (--health_check), and who it leaves out.
 *
 * Once a round is assigned and before its workers start, every node measures itself: a GEMM
 * of a fixed size on the devices its workers will use, measured by the trainer beside meshrun
 * (`trainer --health-gemm`, launcher/health_probe.h: the GPUs where it sees them, the slowest
 * one's rate; else the CPU through the trainer's cpu backend), or, where there is no trainer
 * beside meshrun or it fails, by a loop of meshrun's own on this host's CPU ("host-cpu", one
 * warning says why); either way the best of a few short slices, so that a moment of contention
 * on a shared host does not count as a slow node; and the bandwidth of its link to the next node
 * in the round's order (group rank + 1, cyclic): HEALTH_NET_BYTES over a TCP connection of its
 * own, on a port the OS picks, the receiver's one-byte answer closing the measurement. Nodes
 * meet through the store the round's workers use (MESHRUN_STORE), under the job's namespace:
 *   meshrun/health/r<R>/ep/<N>    node N's listening address "host port"
 *   meshrun/health/r<R>/res/<N>   node N's result "gflops mbps keep host device devices"
 * Every node reads every result and judges alike (health_judge, a pure function): a node below
 * min_fraction of the median, in either measure, is unhealthy; unhealthy nodes are left out of
 * the round, worst first, while at least nnodes_min nodes remain, and never the node that
 * serves the rendezvous store (keep: leaving would take the store away). The others are named
 * as a warning and the round goes on with them.
 *
 * One thread does the measuring and every store call (the loop never blocks); it reports once,
 * through a uv_async on the agent's loop; the trainer's probe is its child, killed on a timeout
 * or a stop. MESHRUN_FAULT_HEALTH_GEMM=F (0 < F < 1) throttles the GEMM to about F of its speed
 * (a pause after each product; the probe inherits the variable and does the same),
 * MESHRUN_FAULT_HEALTH_NET=F the sends alike: the tests' slow node.
 *
 * Not here: ending the round and leaving (launcher/agent.c). */
#ifndef MESHRUN_HEALTH_H
#define MESHRUN_HEALTH_H

#include <stddef.h>
#include <uv.h>

#define HEALTH_NET_BYTES (8u << 20)
#define HEALTH_GEMM_N 192     /* the host loop's side: three 144 KiB float matrices */
#define HEALTH_GEMM_SLICES 4  /* the rate is the best slice's */
#define HEALTH_GEMM_SLICE_S 0.06
#define HEALTH_FAULT_NET_ENV "MESHRUN_FAULT_HEALTH_NET"
#define HEALTH_HOST_DEVICE "host-cpu" /* the device of meshrun's own loop */

typedef struct {
  double gflops; /* GEMM, GFLOP/s */
  double mbps;   /* to the next node, MB/s (10^6 bytes); 0: not measured (one node) */
  int keep;      /* serves the rendezvous store: never left out */
  char host[64];
  char device[16]; /* what measured the GEMM: the probe's device kind ("cuda"), or HEALTH_HOST_DEVICE */
  int devices;     /* how many of them (the slowest one's rate) */
} health_result_t;

typedef enum { HEALTH_OK = 0, HEALTH_WARN, HEALTH_OUT } health_verdict_t;

typedef struct {
  double gemm_median, net_median;
  int unhealthy, left_out; /* counts */
  char devices[40];        /* every node's device when they agree ("cuda x8", "cpu"), else "mixed devices" */
} health_summary_t;

/* The median of n values (the mean of the middle two when n is even); 0 for n 0. */
double health_median(const double *v, int n);
/* Judges n results: verdict[i] for each node, the medians and counts in *sum. A node is
 * unhealthy when its GEMM, or its measured bandwidth, is below min_fraction of the median.
 * Unhealthy nodes without keep are left out (HEALTH_OUT), the lowest fraction first (ties: the
 * lower index), while n minus those left out stays >= nnodes_min; the rest are HEALTH_WARN.
 * Returns the number left out, or -1 when out of memory. */
int health_judge(const health_result_t *res, int n, double min_fraction, int nnodes_min, health_verdict_t *verdict,
                 health_summary_t *sum);
/* A GEMM rate: "38.1 GFLOP/s", or from 1000 GFLOP/s on "812.3 TFLOP/s". */
void health_flops_text(double gflops, char *out, size_t len);
/* The line that names node i (no "[meshrun]" prefix): "health check: node 2 (host h) GEMM 12.0
 * GFLOP/s on cpu is 0.31 of the median 38.0 GFLOP/s: left out of this round (2 of --nnodes 2:3
 * remain)" ("on cuda x8" for 8 GPUs), or "...: kept: ..." with the reason. */
void health_line(const health_result_t *res, int n, int i, health_verdict_t v, const health_summary_t *sum,
                 double min_fraction, int nnodes_min, int nnodes_max, char *out, size_t len);

typedef struct {
  char endpoint[300];  /* the workers' store, host:port */
  const char *secret;  /* "" or NULL: an open store */
  const char *run_id;
  char addr[256];      /* this node's address, where the next node's bytes arrive */
  int round, node, nnodes;
  int nproc;           /* this node's workers: the devices the probe measures (LOCAL_WORLD_SIZE) */
  int keep;
  double timeout_s;    /* the whole check, waits for the other nodes included */
} health_config_t;

typedef struct health health_t;
/* Runs on the loop thread once the check is over (measured and judged, or failed). */
typedef void (*health_cb)(health_t *h, void *arg);

/* Starts the check's thread. NULL when out of memory or no thread starts (err says). */
health_t *health_start(uv_loop_t *loop, const health_config_t *cfg, health_cb cb, void *arg, char *err,
                       size_t errlen);
/* After the callback: 0 and every node's result (n of them, owned by h), or -1 with why the
 * check could not finish in err (a peer that never answered, a store call that failed). */
int health_results(health_t *h, const health_result_t **res, int *n, double *elapsed_s, char *err, size_t errlen);
/* Stops the thread (its store call fails at once), joins it, and frees h once its handle has
 * closed (the loop must run). No callback comes after it. Accepts NULL. */
void health_stop(health_t *h);

#endif
