/* cli: meshrun's command line, torchrun's spellings.
 *
 * Parses argv into launcher_opts_t and validates it. Flags accept '-' and '_' alike
 * (--nproc-per-node == --nproc_per_node), "--flag=value" and "--flag value". Parsing stops
 * at the first argument that is not a flag: that is PROGRAM, the rest are its ARGS.
 * Errors: one line "meshrun: --flag: <what is wrong>; expected <form>" in err, return
 * CLI_EUSAGE (main prints it and exits 2). --help / --version return CLI_HELP / CLI_VERSION.
 *
 * Like torchrun, every flag also comes from the environment: PET_<FLAG> (upper case, e.g.
 * PET_NPROC_PER_NODE=4, PET_STANDALONE=1) is the flag's value when the command line does not
 * give it. Under Slurm (SLURM_JOB_ID set, no rendezvous flag given) the node count, node rank,
 * endpoint, run id and workers per node come from Slurm's variables (see cli_usage()).
 *
 * The job secret (the store admits only clients that hold it) comes from
 * --rdzv_conf=token_file=PATH, else from MESHRUN_RDZV_TOKEN; cli reads either (a file it cannot
 * use is a usage error). A single-node job without one gets a random one from the agent. */
#ifndef MESHRUN_CLI_H
#define MESHRUN_CLI_H

#include <stddef.h>

#define CLI_HELP 1
#define CLI_VERSION 2
#define CLI_EUSAGE (-2)

#define MESHRUN_VERSION "0.1.0"
/* Most workers one agent runs (sizes the per-local-rank tables below). */
#define CLI_MAX_LOCAL_RANKS 256
/* The Python that runs a .py PROGRAM and -m MODULE when PYTHON_EXEC (torchrun's variable) is
 * unset or empty; found along PATH. */
#define CLI_PYTHON "python3"
/* Under Slurm without --master_port or MESHRUN_SLURM_PORT, the rendezvous port is
 * CLI_SLURM_PORT_BASE + SLURM_JOB_ID % CLI_SLURM_PORT_SPAN: 20000..31999, below Linux's
 * ephemeral range (32768-60999), so no outgoing connection of the node holds it. */
#define CLI_SLURM_PORT_BASE 20000
#define CLI_SLURM_PORT_SPAN 12000
/* --merge_output: whether identical console lines of several local ranks become one line
 * (launcher/console.h). AUTO merges when more than CLI_MERGE_AUTO_RANKS local ranks reach the
 * console. */
typedef enum { CLI_MERGE_AUTO = 0, CLI_MERGE_ON, CLI_MERGE_OFF } cli_merge_t;
#define CLI_MERGE_AUTO_RANKS 4

/* A run id (--rdzv_id, PET_RDZV_ID): 1..CLI_RUN_ID_MAX of these characters, not starting with
 * '.'. It names folders and files and prefixes the job's keys, so no '/' and no "..". */
#define CLI_RUN_ID_MAX 64
#define CLI_RUN_ID_CHARS "A-Z a-z 0-9 . _ -"

typedef enum { RDZV_BACKEND_C10D = 0, RDZV_BACKEND_STATIC, RDZV_BACKEND_ETCD } rdzv_backend_t;
/* etcd's client port, when an endpoint of --rdzv_backend=etcd names none. */
#define CLI_ETCD_PORT 2379
#define CLI_ETCD_MAX_MEMBERS 16

/* The job secret's bounds in bytes: shorter is guessable, longer is surely a wrong file. */
#define CLI_SECRET_MIN 16
#define CLI_SECRET_MAX 512

typedef enum {
  CLI_SECRET_NONE = 0,  /* none: an open store (the agent generates one for a single node) */
  CLI_SECRET_FILE,      /* --rdzv_conf token_file=PATH */
  CLI_SECRET_ENV,       /* MESHRUN_RDZV_TOKEN (STORE_ENV_SECRET) */
  CLI_SECRET_GENERATED, /* set by the agent: random, this job only */
} cli_secret_source_t;

typedef struct {
  /* Workers on this node: >= 1. --nproc_per_node=auto resolves here (GPUs if any, else CPUs). */
  int nproc_per_node;
  int nnodes_min, nnodes_max; /* --nnodes=N gives N:N; MIN:MAX for elastic */
  int node_rank;              /* -1: assigned by join order (c10d); required for static */

  rdzv_backend_t rdzv_backend;
  /* Where the rendezvous store lives, always set by a successful cli_parse: the --rdzv_endpoint
   * (IPv6 without brackets; port 29400 when it names none); with --rdzv_backend=static and no
   * endpoint, --master_addr:--master_port (port 29500 when not given); 127.0.0.1 port 0 (pick a
   * free one) with --standalone, which is also implied by c10d with no endpoint and nnodes 1. */
  char rdzv_host[256];
  int rdzv_port;
  /* --rdzv_endpoint as given: with etcd, the cluster's members "h1:2379,h2:2379,..." (at most
   * CLI_ETCD_MAX_MEMBERS; rdzv_host/rdzv_port are then the first one's). */
  char rdzv_endpoints[1024];
  /* What named that endpoint, as messages about it say it: "--rdzv_endpoint", "--master_addr/
   * --master_port" (static), "PET_RDZV_ENDPOINT (--rdzv_endpoint)", "Slurm's SLURM_STEP_NODELIST
   * (...)" or "--standalone". */
  char rdzv_endpoint_from[200];
  char rdzv_id[CLI_RUN_ID_MAX + 1]; /* --rdzv_id / --run_id; default "none" */
  /* --rdzv_conf key=value,key=value (seconds, may be fractional) */
  double join_timeout_s;       /* default 600 */
  double last_call_timeout_s;  /* default 30 (elastic only) */
  double close_timeout_s;      /* default 60 */
  double heartbeat_interval_s; /* default 1 */
  double heartbeat_timeout_s;  /* default 5; a node silent longer is dead */
  /* The handshake's bound on both ends: the store closes a connection still in it then, and a
   * node gives up on an endpoint that has not answered as a meshrun store (or etcd) by then.
   * 0: the defaults (STORE_HANDSHAKE_S; RDZV_ETCD_CALL_S for etcd). */
  double handshake_timeout_s;
  double frame_timeout_s;      /* a big frame to the store stalled this long is dropped; 0: store's */
  double progress_interval_s;  /* default 5: a line this often while waiting for nodes or the store; 0: none */
  char token_file[1024];       /* token_file=PATH; "" = none */
  int standalone;

  /* The job secret: text without NUL, trailing whitespace stripped, CLI_SECRET_MIN..MAX bytes;
   * "" = none. token_file wins over MESHRUN_RDZV_TOKEN. */
  char secret[CLI_SECRET_MAX + 1];
  cli_secret_source_t secret_source;
  int token_file_mode; /* the file's permission bits, for the agent's warning when group or others have any */

  char master_addr[256]; /* static backend (and MASTER_ADDR override); "" = unset */
  int master_port;       /* 0 = unset */
  /* The workers' MASTER_PORT in every round: --master_port on one node (torchrun gives its
   * workers that port), the store then on a free port of its own. 0: a free port each round
   * (several nodes, where --master_port is the static store's port). */
  int worker_master_port;

  int max_restarts;          /* default 0 */
  double monitor_interval_s; /* default 0.1 (torchrun 5); only a fallback: exits are events */
  /* --redirects / --tee: 0 none, 1 stdout, 2 stderr, 3 both; per local rank overrides
   * ("0:1,1:2") are stored in redirects_per_rank (-1 = use the default). */
  int redirects, tee;
  int redirects_per_rank[CLI_MAX_LOCAL_RANKS], tee_per_rank[CLI_MAX_LOCAL_RANKS];
  char log_dir[1024];        /* "" = no per-rank log files unless redirects/tee need one (then a temp dir) */
  int local_ranks_filter[CLI_MAX_LOCAL_RANKS]; /* 1 = show this local rank's console lines; all 1 by default */
  int local_ranks_filter_set;
  cli_merge_t merge_output;  /* --merge_output: auto (default), on, off */
  double shutdown_timeout_s; /* SIGTERM -> SIGKILL grace, default 30 */
  /* --hang_timeout: seconds without a finished step on any local rank, every worker alive,
   * after which meshrun asks the workers for flight recorder dumps, prints a diagnosis and
   * restarts them as for a failure (launcher/hang). 0 (the default): off. */
  double hang_timeout_s;
  /* --health_check: before each round's workers start, every node measures a GEMM and its link
   * to the next node (launcher/health); a node below health_min_fraction (default 0.5) of the
   * median is named, and left out of the round while --nnodes' minimum still remains. */
  int health_check;
  double health_min_fraction;
  char role[64];             /* ROLE_NAME, default "default" */
  int no_python;             /* --no_python: exec PROGRAM as is, even a .py file */
  int run_module;            /* -m: PROGRAM is a module: "PYTHON -u -m PROGRAM ARGS" */

  /* What is exec'd: PROGRAM (an argv element), or `python` when PROGRAM runs under Python.
   * main checks it exists (except with -m) before anything starts. */
  const char *program;
  /* The interpreter when PROGRAM runs under Python (-m, or a PROGRAM ending in ".py" without
   * --no_python): $PYTHON_EXEC, else CLI_PYTHON; it points into the environment or is a
   * literal. NULL: PROGRAM is exec'd as is. Workers then run "python -u [-m] PROGRAM ARGS"
   * (torchrun's command: -u leaves the output unbuffered). */
  const char *python;
  char **prog_argv; /* NULL-terminated: PROGRAM then its arguments (points into argv) */
  int prog_argc;

  int from_slurm; /* 1 when the rendezvous options were taken from Slurm's variables */
} launcher_opts_t;

void cli_defaults(launcher_opts_t *o);
/* Returns 0, CLI_HELP, CLI_VERSION or CLI_EUSAGE (message in err). */
int cli_parse(launcher_opts_t *o, int argc, char **argv, char *err, size_t errlen);
/* What each worker execs: PROGRAM ARGS, or torchrun's "PYTHON -u [-m] PROGRAM ARGS" for a
 * Python PROGRAM. A malloc'ed NULL-terminated array of pointers into o (free the array alone),
 * or NULL when out of memory. The workers exec it; the failure summary prints it. */
char **cli_worker_argv(const launcher_opts_t *o);
/* The --help text. */
const char *cli_usage(void);
/* What --nproc_per_node=auto counts when there is no GPU (gpus.h counts those), exposed for
 * tests: this process's affinity mask (sched_getaffinity), at least 1. */
int cli_count_cpus(void);
/* Expands a Slurm hostlist ("gpu-[01-03,07],cpu5") into its host names, in order, written into
 * out separated by single spaces ("gpu-01 gpu-02 gpu-03 gpu-07 cpu5"). Hosts are separated by
 * ',' (outside brackets) or whitespace; "[...]" holds numbers and LO-HI ranges, each padded with
 * zeros to the width of its first number ("[08-10]": 08 09 10); several bracket groups in one
 * name give every combination, the leftmost varying slowest ("r[1-2]n[1-2]": r1n1 r1n2 r2n1
 * r2n2). Returns the number of hosts (>= 1), or CLI_EUSAGE with the reason in err: bad syntax
 * (an unclosed or stray bracket, an empty host or group, a range whose end is below its start,
 * something not a digit inside brackets), a name over 255 bytes, more than a million hosts, or
 * out too small. */
int cli_hostlist_expand(const char *list, char *out, size_t outlen, char *err, size_t errlen);

#endif
