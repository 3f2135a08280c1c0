/* cli_impl: what the files of meshrun's command line share, private to launcher/cli*.c.
 *
 * cli.h is one module in four files:
 *   cli.c        the flags: the table, one setter per flag, argv and PET_ variables, the checks
 *                between flags and where the rendezvous store lives (cli_validate)
 *   cli_slurm.c  Slurm's hostlists and the options a Slurm job's variables give
 *   cli_probe.c  counting this process's CPUs for --nproc_per_node=auto (GPUs: common/gpus.h)
 *   cli_help.c   the --help text
 * The defaults are written here once: cli_defaults() uses them and cli_usage() prints them.
 * Not a public interface: cli.h is. */
#ifndef MESHRUN_CLI_IMPL_H
#define MESHRUN_CLI_IMPL_H

#include <stddef.h>

#include "launcher/cli.h"

#define DEF_RDZV_PORT 29400
#define DEF_MASTER_PORT 29500
#define DEF_JOIN_TIMEOUT 600
#define DEF_LAST_CALL_TIMEOUT 30
#define DEF_CLOSE_TIMEOUT 60
#define DEF_HEARTBEAT_INTERVAL 1
#define DEF_HEARTBEAT_TIMEOUT 5
#define DEF_MONITOR_INTERVAL 0.1
#define DEF_SHUTDOWN_TIMEOUT 30
#define DEF_HEALTH_MIN_FRACTION 0.5
#define DEF_PROGRESS_INTERVAL 5
#define DEF_MAX_RESTARTS 0
#define DEF_RDZV_ID "none"
#define DEF_ROLE "default"
#define STR_(x) #x
#define STR(x) STR_(x)

/* What the user set explicitly, for the checks that combine flags. */
typedef struct {
  int nnodes_set;
  int backend_set;
  int endpoint_set;
  int master_port_set;
  int master_addr_set, node_rank_set, nproc_set, rdzv_id_set;
  int redirects_max_rank, tee_max_rank, filter_max_rank; /* highest local rank named, -1 none */
  char master_addr_flag[80], master_port_flag[80];       /* as given: "--master_addr", "PET_..." */
} cli_seen_t;

/* Writes "meshrun: " and the formatted rest into err; returns CLI_EUSAGE. */
int cli_usage_error(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Strict decimal integer: optional '-', digits, nothing else, fits in [lo, hi]. 0 or -1. */
int cli_parse_int(const char *s, long lo, long hi, long *out);

/* Under Slurm (SLURM_JOB_ID set) with no rendezvous choice of the user's (from argv or PET_:
 * --nnodes, --node_rank, --rdzv_endpoint, --rdzv_backend, --master_addr, --standalone), fills in
 * what `srun meshrun PROGRAM` on every node needs: the node count (SLURM_NNODES), this node's
 * rank (SLURM_NODEID), the endpoint (the first host of the step's node list, which runs node
 * rank 0, and a port computed from the job id so that every node computes the same), the run id
 * (the job id) and the workers per node (SLURM_NTASKS_PER_NODE above 1, else
 * SLURM_GPUS_ON_NODE). Values the user gave (--nproc_per_node, --rdzv_id, --master_port for the
 * port) stay. What was taken is described in note, for the one info line. Returns 0 (also when
 * not under Slurm, or when the user chose) or CLI_EUSAGE with the reason in err. */
int cli_apply_slurm(launcher_opts_t *o, cli_seen_t *seen, char *note, size_t notelen, char *err, size_t errlen);

#endif
