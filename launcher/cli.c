/* cli: turns meshrun's argv into launcher_opts_t, with torchrun's spellings and meanings.
 *
 * One table lists every flag: its canonical name (underscores), an optional short letter,
 * whether it takes a value, and the function that parses that value. A flag's name is
 * normalized ('-' -> '_') before the lookup, so --nproc-per-node and --nproc_per_node are the
 * same flag; values come as "--flag=value" or "--flag value" ("-r3", "-r=3", "-r 3" for short
 * ones). Parsing stops at the first argument that is not a flag, or after "--": that argument is
 * PROGRAM and everything after it belongs to PROGRAM. A repeated flag overrides the earlier one,
 * except --rdzv_conf, whose keys accumulate.
 *
 * After the flags, one pass checks what only makes sense together (static needs a fixed node
 * count and a node rank, --standalone excludes an endpoint, per-rank lists fit
 * --nproc_per_node, ...) and resolves where the rendezvous store lives. Every error is one line
 * naming the flag and the expected form, returned as CLI_EUSAGE.
 *
 * The job secret is read here too (token_file, else MESHRUN_RDZV_TOKEN), so that a token file
 * that cannot be used is a usage error on every node before anything starts.
 *
 * What it does not do: look anything up on the network (hostnames are resolved by the agent),
 * pick ports, read the environment other than CUDA_VISIBLE_DEVICES for --nproc_per_node=auto
 * and MESHRUN_RDZV_TOKEN, make a secret up (the agent does, for single-node jobs), or print
 * anything (main prints err or cli_usage(); the agent warns about a token file's mode). */
#include "launcher/cli.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/net.h"
#include "common/store.h"
#include "launcher/agent.h"   /* exit statuses, for --help */
#include "launcher/errfile.h" /* the permanent exit codes, for --help */

/* Defaults, written once: cli_defaults() uses them and cli_usage() prints them. */
#define DEF_RDZV_PORT 29400
#define DEF_MASTER_PORT 29500
#define DEF_JOIN_TIMEOUT 600
#define DEF_LAST_CALL_TIMEOUT 30
#define DEF_CLOSE_TIMEOUT 60
#define DEF_HEARTBEAT_INTERVAL 1
#define DEF_HEARTBEAT_TIMEOUT 5
#define DEF_MONITOR_INTERVAL 0.1
#define DEF_SHUTDOWN_TIMEOUT 30
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
  int redirects_max_rank, tee_max_rank, filter_max_rank; /* highest local rank named, -1 none */
} cli_seen_t;

typedef int (*cli_setter_t)(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                            const char *val, char *err, size_t errlen);

typedef struct {
  const char *name; /* canonical, with underscores, without "--" */
  char short_name;  /* 0: none */
  int takes_value;
  cli_setter_t set; /* NULL for the flags handled in cli_parse itself (help, version) */
} cli_flag_t;

static int usage_error(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int usage_error(char *err, size_t errlen, const char *fmt, ...) {
  if (err && errlen > 0) {
    int n = snprintf(err, errlen, "meshrun: ");
    if (n >= 0 && (size_t)n < errlen) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
      va_end(ap);
    }
  }
  return CLI_EUSAGE;
}

/* Strict decimal integer: optional '-', digits, nothing else, fits in [lo, hi]. */
static int parse_int(const char *s, long lo, long hi, long *out) {
  const char *p = s;
  if (*p == '-') p++;
  if (!isdigit((unsigned char)*p)) return -1;
  for (; *p; p++)
    if (!isdigit((unsigned char)*p)) return -1;
  errno = 0;
  long v = strtol(s, NULL, 10);
  if (errno == ERANGE || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

/* Seconds as a plain decimal ("5", "0.25", "1e-3"): no hex, inf or nan; v >= lo (or > lo). */
static int parse_seconds(const char *s, double lo, int lo_inclusive, double *out) {
  if (!*s) return -1;
  for (const char *p = s; *p; p++)
    if (!isdigit((unsigned char)*p) && !strchr(".eE+-", *p)) return -1;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (*end || errno == ERANGE || !isfinite(v)) return -1;
  if (lo_inclusive ? v < lo : v <= lo) return -1;
  *out = v;
  return 0;
}

static int copy_string(char *dst, size_t dstlen, const char *val) {
  size_t n = strlen(val);
  if (n == 0 || n >= dstlen) return -1;
  memcpy(dst, val, n + 1);
  return 0;
}

/* ---- GPU and CPU counting for --nproc_per_node=auto ---- */

static int is_nvidia_minor(const char *name) {
  if (strncmp(name, "nvidia", 6) != 0 || !name[6]) return 0;
  for (const char *p = name + 6; *p; p++)
    if (!isdigit((unsigned char)*p)) return 0;
  return 1;
}

int cli_count_gpus(const char *dev_dir, const char *cuda_visible_devices) {
  /* /dev/nvidia0, nvidia1, ...: one per GPU the driver exposes; nvidiactl, nvidia-uvm and
   * nvidia-caps are not GPUs. Counting files needs neither CUDA headers nor the driver library. */
  DIR *d = opendir(dev_dir);
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (is_nvidia_minor(e->d_name)) n++;
  closedir(d);
  if (!cuda_visible_devices || n == 0) return n;

  /* CUDA reads the list left to right and stops at the first entry it cannot use, so
   * "0,7,1" on a 4-GPU machine is one GPU and "" is none. UUIDs cannot be checked without the
   * driver; each counts as one GPU, never more than exist. */
  char seen[CLI_MAX_LOCAL_RANKS] = {0};
  int count = 0;
  const char *p = cuda_visible_devices;
  while (count < n) {
    while (*p == ' ' || *p == '\t') p++;
    size_t len = strcspn(p, ",");
    char tok[128];
    if (len == 0 || len >= sizeof tok) break;
    memcpy(tok, p, len);
    tok[len] = '\0';
    for (size_t t = len; t > 0 && (tok[t - 1] == ' ' || tok[t - 1] == '\t'); t--) tok[t - 1] = '\0';
    long v;
    if (parse_int(tok, 0, n - 1, &v) == 0) {
      if (v < CLI_MAX_LOCAL_RANKS) {
        if (seen[v]) break;
        seen[v] = 1;
      }
      count++;
    } else if (strncmp(tok, "GPU-", 4) == 0 || strncmp(tok, "MIG-", 4) == 0) {
      count++;
    } else {
      break;
    }
    if (p[len] != ',') break;
    p += len + 1;
  }
  return count;
}

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

/* ---- one setter per flag ---- */

static int set_nproc_per_node(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                              const char *val, char *err, size_t errlen) {
  long v;
  int n;
  if (strcmp(val, "auto") == 0) {
    n = cli_count_gpus("/dev", getenv("CUDA_VISIBLE_DEVICES"));
    if (n == 0) n = cli_count_cpus();
  } else if (strcmp(val, "gpu") == 0) {
    n = cli_count_gpus("/dev", getenv("CUDA_VISIBLE_DEVICES"));
    if (n == 0)
      return usage_error(err, errlen,
                         "%s: \"gpu\" found no GPU (no /dev/nvidiaN, or CUDA_VISIBLE_DEVICES "
                         "hides them all); expected N, auto, cpu or gpu",
                         flag);
  } else if (strcmp(val, "cpu") == 0) {
    n = cli_count_cpus();
  } else if (parse_int(val, 1, CLI_MAX_LOCAL_RANKS, &v) == 0) {
    n = (int)v;
  } else {
    return usage_error(err, errlen,
                       "%s: \"%s\" is not valid; expected N (1 <= N <= %d), auto, cpu or gpu",
                       flag, val, CLI_MAX_LOCAL_RANKS);
  }
  /* A machine with more CPUs than one agent's tables hold still gets a working count. */
  o->nproc_per_node = n > CLI_MAX_LOCAL_RANKS ? CLI_MAX_LOCAL_RANKS : n;
  return 0;
}

static int set_nnodes(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                      char *err, size_t errlen) {
  char buf[64];
  long lo, hi;
  const char *colon = strchr(val, ':');
  int ok;
  if (!colon) {
    ok = parse_int(val, 1, 1 << 20, &lo) == 0;
    hi = lo;
  } else {
    size_t n = (size_t)(colon - val);
    ok = n < sizeof buf;
    if (ok) {
      memcpy(buf, val, n);
      buf[n] = '\0';
      ok = parse_int(buf, 1, 1 << 20, &lo) == 0 && parse_int(colon + 1, 1, 1 << 20, &hi) == 0 &&
           lo <= hi;
    }
  }
  if (!ok)
    return usage_error(err, errlen,
                       "%s: \"%s\" is not valid; expected N or MIN:MAX with 1 <= MIN <= MAX",
                       flag, val);
  o->nnodes_min = (int)lo;
  o->nnodes_max = (int)hi;
  seen->nnodes_set = 1;
  return 0;
}

static int set_node_rank(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                         char *err, size_t errlen) {
  long v;
  if (parse_int(val, 0, 1 << 20, &v) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected an integer >= 0", flag,
                       val);
  o->node_rank = (int)v;
  return 0;
}

static int set_rdzv_endpoint(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                             const char *val, char *err, size_t errlen) {
  char why[256] = "";
  char host[sizeof o->rdzv_host];
  int port = 0;
  if (net_parse_endpoint(val, host, sizeof host, &port, DEF_RDZV_PORT, 0, why, sizeof why) != 0)
  {
    /* net's message names the endpoint and the fault, sometimes the form too. */
    if (!why[0]) snprintf(why, sizeof why, "\"%.200s\" is not valid", val);
    return usage_error(err, errlen, "%s: %s%s", flag, why,
                       strstr(why, "expected") ? ""
                                               : "; expected HOST[:PORT], [IPV6]:PORT or IPV6 "
                                                 "with 1 <= PORT <= 65535");
  }
  memcpy(o->rdzv_host, host, sizeof host);
  o->rdzv_port = port;
  seen->endpoint_set = 1;
  return 0;
}

static int set_rdzv_id(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                       char *err, size_t errlen) {
  /* The id becomes part of store keys and TORCHELASTIC_RUN_ID: printable, no spaces. */
  for (const char *p = val; *p; p++)
    if (!isgraph((unsigned char)*p))
      return usage_error(err, errlen,
                         "%s: \"%s\" is not valid; expected a non-empty id without spaces or "
                         "control characters",
                         flag, val);
  if (copy_string(o->rdzv_id, sizeof o->rdzv_id, val) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected a non-empty id of at most %zu bytes",
                       flag, val, sizeof o->rdzv_id - 1);
  return 0;
}

static int set_rdzv_backend(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                            const char *val, char *err, size_t errlen) {
  if (strcmp(val, "c10d") == 0)
    o->rdzv_backend = RDZV_BACKEND_C10D;
  else if (strcmp(val, "static") == 0)
    o->rdzv_backend = RDZV_BACKEND_STATIC;
  else
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected c10d or static", flag, val);
  seen->backend_set = 1;
  return 0;
}

static int set_rdzv_conf(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                         char *err, size_t errlen) {
  static const char expected[] =
      "expected KEY=VALUE[,...] with KEY one of join_timeout, last_call_timeout, "
      "close_timeout, heartbeat_interval, heartbeat_timeout, handshake_timeout (seconds), "
      "token_file (a path)";
  const char *p = val;
  while (*p) {
    size_t len = strcspn(p, ",");
    char item[1100];
    if (len >= sizeof item)
      return usage_error(err, errlen, "%s: \"%.*s\" is too long; %s", flag, (int)len, p, expected);
    memcpy(item, p, len);
    item[len] = '\0';
    p += len;
    if (*p == ',') p++;
    if (len == 0) continue; /* "a=1,,b=2" and a trailing comma are harmless */

    char *eq = strchr(item, '=');
    if (!eq)
      return usage_error(err, errlen, "%s: \"%s\" has no '='; %s", flag, item, expected);
    *eq = '\0';
    const char *value = eq + 1;
    for (char *k = item; *k; k++)
      if (*k == '-') *k = '_';

    if (strcmp(item, "token_file") == 0) {
      /* Read in cli_validate, once the last token_file given is known. */
      if (copy_string(o->token_file, sizeof o->token_file, value) != 0)
        return usage_error(err, errlen, "%s: token_file=\"%s\" is not valid; expected a path of 1..%zu bytes",
                           flag, value, sizeof o->token_file - 1);
      continue;
    }
    double *dst;
    int zero_ok = 0;
    if (strcmp(item, "join_timeout") == 0)
      dst = &o->join_timeout_s;
    else if (strcmp(item, "last_call_timeout") == 0)
      dst = &o->last_call_timeout_s, zero_ok = 1;
    else if (strcmp(item, "close_timeout") == 0)
      dst = &o->close_timeout_s;
    else if (strcmp(item, "heartbeat_interval") == 0)
      dst = &o->heartbeat_interval_s;
    else if (strcmp(item, "heartbeat_timeout") == 0)
      dst = &o->heartbeat_timeout_s;
    else if (strcmp(item, "handshake_timeout") == 0)
      dst = &o->handshake_timeout_s;
    else
      return usage_error(err, errlen, "%s: unknown key \"%s\"; %s", flag, item, expected);
    if (parse_seconds(value, 0, zero_ok, dst) != 0)
      return usage_error(err, errlen, "%s: %s=\"%s\" is not valid; expected seconds %s 0", flag,
                         item, value, zero_ok ? ">=" : ">");
  }
  return 0;
}

/* Cuts trailing whitespace (a token file usually ends in a newline) and checks what is left:
 * no NUL inside, CLI_SECRET_MIN..CLI_SECRET_MAX bytes. Returns 0 or a reason in why. */
static int check_secret(char *buf, size_t n, char *why, size_t whylen) {
  while (n > 0 && isspace((unsigned char)buf[n - 1])) n--;
  buf[n] = '\0';
  if (memchr(buf, '\0', n)) {
    snprintf(why, whylen, "holds a NUL byte");
    return -1;
  }
  if (n < CLI_SECRET_MIN || n > CLI_SECRET_MAX) {
    snprintf(why, whylen, "is %zu bytes%s", n, n ? "" : " (empty)");
    return -1;
  }
  return 0;
}

/* The job secret: token_file when given (it wins), else MESHRUN_RDZV_TOKEN when set and not
 * empty. A file is read whole (it must be a regular file: a FIFO would block), at most
 * CLI_SECRET_MAX bytes plus some trailing whitespace. Its mode is kept for the agent, which
 * warns, as ssh does, when group or others may access it. */
static int resolve_secret(launcher_opts_t *o, char *err, size_t errlen) {
  static const char form[] = "expected a readable file holding the job secret (" STR(CLI_SECRET_MIN) ".." STR(
      CLI_SECRET_MAX) " bytes, trailing whitespace ignored)";
  char why[256];
  o->secret[0] = '\0';
  o->secret_source = CLI_SECRET_NONE;
  if (o->token_file[0]) {
    /* A little over the secret's limit is read: trailing whitespace is cut before the check. */
    char *buf;
    size_t n;
    int rc = fs_read_file(o->token_file, CLI_SECRET_MAX + 254, &buf, &n, NULL);
    if (rc == -EINVAL)
      return usage_error(err, errlen, "--rdzv_conf: token_file=%s: not a regular file; %s", o->token_file, form);
    if (rc == -EFBIG) {
      snprintf(why, sizeof why, "is over %d bytes", CLI_SECRET_MAX);
      return usage_error(err, errlen, "--rdzv_conf: token_file=%s %s; %s", o->token_file, why, form);
    }
    if (rc)
      return usage_error(err, errlen, "--rdzv_conf: token_file=%s: %s; %s", o->token_file, strerror(-rc), form);
    struct stat st; /* for the agent's warning about a file others may read */
    if (stat(o->token_file, &st) != 0) st.st_mode = 0;
    rc = check_secret(buf, n, why, sizeof why);
    if (rc) {
      free(buf);
      return usage_error(err, errlen, "--rdzv_conf: token_file=%s %s; %s", o->token_file, why, form);
    }
    memcpy(o->secret, buf, strlen(buf) + 1);
    free(buf);
    o->secret_source = CLI_SECRET_FILE;
    o->token_file_mode = (int)(st.st_mode & 07777);
    return 0;
  }
  const char *env = getenv(STORE_ENV_SECRET);
  if (!env || !*env) return 0;
  char buf[CLI_SECRET_MAX + 1];
  size_t n = strlen(env);
  int bad = n > CLI_SECRET_MAX;
  if (bad) snprintf(why, sizeof why, "is %zu bytes", n);
  else bad = check_secret(memcpy(buf, env, n + 1), n, why, sizeof why);
  if (bad)
    return usage_error(err, errlen,
                       STORE_ENV_SECRET ": %s; expected the job secret (" STR(CLI_SECRET_MIN) ".." STR(
                           CLI_SECRET_MAX) " bytes), or unset",
                       why);
  memcpy(o->secret, buf, strlen(buf) + 1);
  o->secret_source = CLI_SECRET_ENV;
  return 0;
}

static int set_standalone(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                          const char *val, char *err, size_t errlen) {
  o->standalone = 1;
  return 0;
}

static int set_master_addr(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                           const char *val, char *err, size_t errlen) {
  /* A host, not an endpoint: "[::1]" loses its brackets, "host:port" is refused (one ':' can
   * only be a port; IPv6 literals have at least two). */
  char host[sizeof o->master_addr];
  size_t n = strlen(val);
  int ok = n > 0 && n < sizeof host;
  if (ok && val[0] == '[') {
    ok = n > 2 && val[n - 1] == ']' && strchr(val + 1, ']') == val + n - 1;
    if (ok) {
      memcpy(host, val + 1, n - 2);
      host[n - 2] = '\0';
      ok = strchr(host, ':') != NULL;
    }
  } else if (ok) {
    const char *c = strchr(val, ':');
    ok = (!c || strchr(c + 1, ':')) && !strpbrk(val, "[]");
    memcpy(host, val, n + 1);
  }
  for (const char *p = host; ok && *p; p++)
    ok = isgraph((unsigned char)*p);
  if (!ok)
    return usage_error(err, errlen,
                       "%s: \"%s\" is not valid; expected a hostname or IP address without a "
                       "port (the port goes in --master_port)",
                       flag, val);
  memcpy(o->master_addr, host, strlen(host) + 1);
  return 0;
}

static int set_master_port(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                           const char *val, char *err, size_t errlen) {
  long v;
  if (parse_int(val, 1, 65535, &v) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected a port 1..65535", flag,
                       val);
  o->master_port = (int)v;
  seen->master_port_set = 1;
  return 0;
}

static int set_max_restarts(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                            const char *val, char *err, size_t errlen) {
  long v;
  if (parse_int(val, 0, 1000000, &v) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected an integer >= 0", flag,
                       val);
  o->max_restarts = (int)v;
  return 0;
}

static int set_monitor_interval(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                                const char *val, char *err, size_t errlen) {
  if (parse_seconds(val, 0, 0, &o->monitor_interval_s) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected seconds > 0", flag, val);
  return 0;
}

static int set_shutdown_timeout(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                                const char *val, char *err, size_t errlen) {
  if (parse_seconds(val, 0, 1, &o->shutdown_timeout_s) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected seconds >= 0", flag, val);
  return 0;
}

/* torchrun's Std: "3" applies to every local rank; "0:1,1:2" sets only the listed ones (the
 * others keep the default, which becomes 0). */
static int parse_std(const char *flag, const char *val, int *all, int *per_rank, int *max_rank,
                     char *err, size_t errlen) {
  static const char expected[] =
      "expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:0..3[,...]";
  long v;
  if (!strchr(val, ':')) {
    if (parse_int(val, 0, 3, &v) != 0)
      return usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
    *all = (int)v;
    for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) per_rank[i] = -1;
    *max_rank = -1;
    return 0;
  }
  int tmp[CLI_MAX_LOCAL_RANKS];
  int hi = -1;
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) tmp[i] = -1;
  const char *p = val;
  for (;;) {
    size_t len = strcspn(p, ",");
    char item[64], *colon;
    long r;
    if (len == 0 || len >= sizeof item)
      return usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
    memcpy(item, p, len);
    item[len] = '\0';
    colon = strchr(item, ':');
    if (!colon)
      return usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
    *colon = '\0';
    if (parse_int(item, 0, CLI_MAX_LOCAL_RANKS - 1, &r) != 0 || parse_int(colon + 1, 0, 3, &v) != 0)
      return usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
    tmp[r] = (int)v;
    if (r > hi) hi = (int)r;
    if (p[len] != ',') break;
    p += len + 1;
  }
  *all = 0;
  memcpy(per_rank, tmp, sizeof tmp);
  *max_rank = hi;
  return 0;
}

static int set_redirects(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                         char *err, size_t errlen) {
  return parse_std(flag, val, &o->redirects, o->redirects_per_rank, &seen->redirects_max_rank, err,
                   errlen);
}

static int set_tee(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                   char *err, size_t errlen) {
  return parse_std(flag, val, &o->tee, o->tee_per_rank, &seen->tee_max_rank, err, errlen);
}

static int set_log_dir(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                       char *err, size_t errlen) {
  if (copy_string(o->log_dir, sizeof o->log_dir, val) != 0)
    return usage_error(err, errlen, "%s: \"%s\" is not valid; expected a directory path of 1..%zu bytes",
                       flag, val, sizeof o->log_dir - 1);
  return 0;
}

static int set_local_ranks_filter(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                                  const char *val, char *err, size_t errlen) {
  /* "" is torchrun's default: no filter. */
  int tmp[CLI_MAX_LOCAL_RANKS] = {0};
  int hi = -1;
  if (!*val) {
    for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) o->local_ranks_filter[i] = 1;
    o->local_ranks_filter_set = 0;
    seen->filter_max_rank = -1;
    return 0;
  }
  const char *p = val;
  for (;;) {
    size_t len = strcspn(p, ",");
    char item[32];
    long r;
    if (len == 0 || len >= sizeof item)
      return usage_error(err, errlen,
                         "%s: \"%s\" is not valid; expected local ranks like 0 or 0,2 (each "
                         "0..%d)",
                         flag, val, CLI_MAX_LOCAL_RANKS - 1);
    memcpy(item, p, len);
    item[len] = '\0';
    if (parse_int(item, 0, CLI_MAX_LOCAL_RANKS - 1, &r) != 0)
      return usage_error(err, errlen,
                         "%s: \"%s\" is not valid; expected local ranks like 0 or 0,2 (each "
                         "0..%d)",
                         flag, val, CLI_MAX_LOCAL_RANKS - 1);
    tmp[r] = 1;
    if (r > hi) hi = (int)r;
    if (p[len] != ',') break;
    p += len + 1;
  }
  memcpy(o->local_ranks_filter, tmp, sizeof tmp);
  o->local_ranks_filter_set = 1;
  seen->filter_max_rank = hi;
  return 0;
}

static int set_role(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                    char *err, size_t errlen) {
  int ok = copy_string(o->role, sizeof o->role, val) == 0;
  for (const char *p = val; ok && *p; p++)
    ok = isgraph((unsigned char)*p);
  if (!ok)
    return usage_error(err, errlen,
                       "%s: \"%s\" is not valid; expected a name of 1..%zu printable bytes "
                       "without spaces",
                       flag, val, sizeof o->role - 1);
  return 0;
}

static int set_no_python(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                         char *err, size_t errlen) {
  o->no_python = 1;
  return 0;
}

static int set_module(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                      char *err, size_t errlen) {
  o->run_module = 1;
  return 0;
}

static const cli_flag_t cli_flags[] = {
    {"nproc_per_node", 0, 1, set_nproc_per_node},
    {"nnodes", 0, 1, set_nnodes},
    {"node_rank", 0, 1, set_node_rank},
    {"rdzv_backend", 0, 1, set_rdzv_backend},
    {"rdzv_endpoint", 0, 1, set_rdzv_endpoint},
    {"rdzv_id", 0, 1, set_rdzv_id},
    {"run_id", 0, 1, set_rdzv_id},
    {"rdzv_conf", 0, 1, set_rdzv_conf},
    {"standalone", 0, 0, set_standalone},
    {"master_addr", 0, 1, set_master_addr},
    {"master_port", 0, 1, set_master_port},
    {"max_restarts", 0, 1, set_max_restarts},
    {"monitor_interval", 0, 1, set_monitor_interval},
    {"redirects", 'r', 1, set_redirects},
    {"tee", 't', 1, set_tee},
    {"log_dir", 0, 1, set_log_dir},
    {"local_ranks_filter", 0, 1, set_local_ranks_filter},
    {"role", 0, 1, set_role},
    {"shutdown_timeout", 0, 1, set_shutdown_timeout},
    {"no_python", 0, 0, set_no_python},
    {"module", 'm', 0, set_module},
    {"help", 'h', 0, NULL},
    {"version", 0, 0, NULL},
};

static const cli_flag_t *find_long(const char *name, size_t len) {
  char norm[64];
  if (len == 0 || len >= sizeof norm) return NULL;
  for (size_t i = 0; i < len; i++) norm[i] = name[i] == '-' ? '_' : name[i];
  norm[len] = '\0';
  for (size_t i = 0; i < sizeof cli_flags / sizeof cli_flags[0]; i++)
    if (strcmp(cli_flags[i].name, norm) == 0) return &cli_flags[i];
  return NULL;
}

static const cli_flag_t *find_short(char c) {
  for (size_t i = 0; i < sizeof cli_flags / sizeof cli_flags[0]; i++)
    if (cli_flags[i].short_name == c) return &cli_flags[i];
  return NULL;
}

void cli_defaults(launcher_opts_t *o) {
  memset(o, 0, sizeof *o);
  o->nproc_per_node = 1;
  o->nnodes_min = o->nnodes_max = 1;
  o->node_rank = -1;
  o->rdzv_backend = RDZV_BACKEND_C10D;
  o->rdzv_port = DEF_RDZV_PORT;
  snprintf(o->rdzv_id, sizeof o->rdzv_id, "%s", DEF_RDZV_ID);
  o->join_timeout_s = DEF_JOIN_TIMEOUT;
  o->last_call_timeout_s = DEF_LAST_CALL_TIMEOUT;
  o->close_timeout_s = DEF_CLOSE_TIMEOUT;
  o->heartbeat_interval_s = DEF_HEARTBEAT_INTERVAL;
  o->heartbeat_timeout_s = DEF_HEARTBEAT_TIMEOUT;
  o->max_restarts = DEF_MAX_RESTARTS;
  o->monitor_interval_s = DEF_MONITOR_INTERVAL;
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) {
    o->redirects_per_rank[i] = -1;
    o->tee_per_rank[i] = -1;
    o->local_ranks_filter[i] = 1;
  }
  o->shutdown_timeout_s = DEF_SHUTDOWN_TIMEOUT;
  snprintf(o->role, sizeof o->role, "%s", DEF_ROLE);
}

/* The checks between flags, then where the store lives. Order matters: --standalone first
 * (it fixes backend and node count), then the backend's own rules, then the node rank against
 * the node count, then per-rank lists against --nproc_per_node. */
static int cli_validate(launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
  if (o->no_python && o->run_module)
    return usage_error(err, errlen,
                       "--module: cannot be used with --no_python; expected one of them");

  if (o->standalone) {
    if (seen->endpoint_set)
      return usage_error(err, errlen,
                         "--standalone: conflicts with --rdzv_endpoint; expected one of them "
                         "(--standalone hosts the store on 127.0.0.1 itself)");
    if (seen->backend_set && o->rdzv_backend != RDZV_BACKEND_C10D)
      return usage_error(err, errlen,
                         "--standalone: conflicts with --rdzv_backend=static; expected "
                         "--rdzv_backend=c10d or none");
    if (seen->nnodes_set && (o->nnodes_min != 1 || o->nnodes_max != 1))
      return usage_error(err, errlen,
                         "--standalone: conflicts with --nnodes=%d:%d; expected --nnodes=1 or "
                         "none (standalone is one node)",
                         o->nnodes_min, o->nnodes_max);
  }

  if (o->rdzv_backend == RDZV_BACKEND_STATIC) {
    if (o->nnodes_min != o->nnodes_max)
      return usage_error(err, errlen,
                         "--nnodes: \"%d:%d\" is not valid with --rdzv_backend=static; expected N "
                         "(static rendezvous is not elastic)",
                         o->nnodes_min, o->nnodes_max);
    if (o->node_rank < 0) {
      if (o->nnodes_max > 1)
        return usage_error(err, errlen,
                           "--node_rank: missing; expected 0..%d on each node with "
                           "--rdzv_backend=static",
                           o->nnodes_max - 1);
      o->node_rank = 0;
    }
    if (!seen->endpoint_set) {
      if (o->master_addr[0]) {
        snprintf(o->rdzv_host, sizeof o->rdzv_host, "%s", o->master_addr);
        o->rdzv_port = seen->master_port_set ? o->master_port : DEF_MASTER_PORT;
      } else if (o->nnodes_max == 1) {
        snprintf(o->rdzv_host, sizeof o->rdzv_host, "127.0.0.1");
        o->rdzv_port = seen->master_port_set ? o->master_port : 0;
      } else {
        return usage_error(err, errlen,
                           "--master_addr: missing; expected the address of node 0 (or "
                           "--rdzv_endpoint) with --rdzv_backend=static and --nnodes=%d",
                           o->nnodes_max);
      }
    }
  } else if (!seen->endpoint_set) {
    /* c10d with nowhere to meet: one node is torchrun --standalone; more is a mistake that
     * would otherwise surface as a join timeout ten minutes later. */
    if (o->nnodes_max > 1 && !o->standalone)
      return usage_error(err, errlen,
                         "--rdzv_endpoint: missing; expected HOST[:PORT] of the rendezvous store "
                         "when --nnodes=%d:%d (or --standalone for one node)",
                         o->nnodes_min, o->nnodes_max);
    o->standalone = 1;
  }
  if (o->standalone) {
    o->rdzv_backend = RDZV_BACKEND_C10D;
    o->nnodes_min = o->nnodes_max = 1;
    snprintf(o->rdzv_host, sizeof o->rdzv_host, "127.0.0.1");
    o->rdzv_port = 0;
  }

  if (o->node_rank >= o->nnodes_max)
    return usage_error(err, errlen,
                       "--node_rank: \"%d\" is not valid with --nnodes=%d:%d; expected 0..%d",
                       o->node_rank, o->nnodes_min, o->nnodes_max, o->nnodes_max - 1);

  if (o->heartbeat_timeout_s <= o->heartbeat_interval_s)
    return usage_error(err, errlen,
                       "--rdzv_conf: heartbeat_timeout=%g is not valid with "
                       "heartbeat_interval=%g; expected heartbeat_timeout > heartbeat_interval",
                       o->heartbeat_timeout_s, o->heartbeat_interval_s);

  int rc = resolve_secret(o, err, errlen);
  if (rc) return rc;

  static const struct {
    const char *flag;
    size_t off;
  } per_rank[] = {
      {"--redirects", offsetof(cli_seen_t, redirects_max_rank)},
      {"--tee", offsetof(cli_seen_t, tee_max_rank)},
      {"--local_ranks_filter", offsetof(cli_seen_t, filter_max_rank)},
  };
  for (size_t i = 0; i < sizeof per_rank / sizeof per_rank[0]; i++) {
    int hi = *(const int *)((const char *)seen + per_rank[i].off);
    if (hi >= o->nproc_per_node)
      return usage_error(err, errlen,
                         "%s: local rank %d is not valid with --nproc_per_node=%d; expected local "
                         "ranks 0..%d",
                         per_rank[i].flag, hi, o->nproc_per_node, o->nproc_per_node - 1);
  }
  return 0;
}

int cli_parse(launcher_opts_t *o, int argc, char **argv, char *err, size_t errlen) {
  cli_seen_t seen = {0};
  seen.redirects_max_rank = seen.tee_max_rank = seen.filter_max_rank = -1;
  if (err && errlen) err[0] = '\0';
  cli_defaults(o);

  int i = 1;
  while (i < argc) {
    const char *a = argv[i];
    if (strcmp(a, "--") == 0) {
      i++;
      break;
    }
    if (a[0] != '-' || a[1] == '\0') break; /* PROGRAM ("-" alone is a name, not a flag) */

    const cli_flag_t *f;
    const char *val = NULL;
    if (a[1] == '-') {
      const char *name = a + 2;
      const char *eq = strchr(name, '=');
      size_t len = eq ? (size_t)(eq - name) : strlen(name);
      f = find_long(name, len);
      if (!f)
        return usage_error(err, errlen, "--%.*s: unknown flag; expected one of the flags in --help",
                           (int)len, name);
      if (eq) val = eq + 1;
    } else {
      f = find_short(a[1]);
      if (!f)
        return usage_error(err, errlen, "-%c: unknown flag; expected one of the flags in --help",
                           a[1]);
      if (a[2]) val = a[2] == '=' ? a + 3 : a + 2;
    }

    char flag[72];
    snprintf(flag, sizeof flag, "--%s", f->name);
    if (!f->takes_value && val)
      return usage_error(err, errlen, "%s: takes no value, got \"%s\"; expected %s alone", flag,
                         val, flag);
    if (f->takes_value && !val) {
      if (i + 1 >= argc)
        return usage_error(err, errlen, "%s: missing value; expected %s=VALUE or %s VALUE (see --help)",
                           flag, flag, flag);
      val = argv[++i];
    }
    i++;

    if (strcmp(f->name, "help") == 0) return CLI_HELP;
    if (strcmp(f->name, "version") == 0) return CLI_VERSION;
    int rc = f->set(o, &seen, flag, val, err, errlen);
    if (rc != 0) return rc;
  }

  if (i >= argc)
    return usage_error(err, errlen,
                       "missing PROGRAM; expected meshrun [OPTIONS] PROGRAM [ARGS...] (see --help)");
  o->program = argv[i];
  o->prog_argv = &argv[i];
  o->prog_argc = argc - i;
  return cli_validate(o, &seen, err, errlen);
}

const char *cli_usage(void) {
  return "usage: meshrun [OPTIONS] PROGRAM [ARGS...]\n"
         "\n"
         "Starts --nproc_per_node copies of PROGRAM on this node, joins them with the other\n"
         "nodes of the run, and restarts the whole group on failure. torchrun's flags: each may\n"
         "be spelled with '-' or '_' (--nproc-per-node, --nproc_per_node) and given as\n"
         "--flag=VALUE or --flag VALUE. Options end at the first argument that is not one, or\n"
         "at \"--\"; the rest is PROGRAM and its arguments.\n"
         "\n"
         "Workers:\n"
         "  --nproc_per_node N|auto|cpu|gpu\n"
         "                          workers on this node; auto: the visible GPUs, or the CPUs of\n"
         "                          this process's affinity mask when there are none (default 1)\n"
         "  --role NAME             worker role, ROLE_NAME (default " DEF_ROLE ")\n"
         "  --no_python             accepted for torchrun compatibility; PROGRAM is always\n"
         "                          run as is\n"
         "  -m, --module            run \"python3 -m PROGRAM ARGS...\" (not with --no_python)\n"
         "\n"
         "Nodes and rendezvous:\n"
         "  --nnodes N|MIN:MAX      nodes in the run; a range is elastic (default 1)\n"
         "  --node_rank R           this node's rank 0..N-1; required with static and nnodes>1;\n"
         "                          with c10d, orders nodes (default: order of joining)\n"
         "  --rdzv_backend c10d|static\n"
         "                          c10d: nodes meet at the store on --rdzv_endpoint; static:\n"
         "                          fixed --nnodes=N and --node_rank, store on --master_addr\n"
         "                          (default c10d)\n"
         "  --rdzv_endpoint HOST[:PORT]\n"
         "                          the rendezvous store; IPv4, hostname, [IPV6]:PORT or IPV6;\n"
         "                          the node that owns HOST serves it; required with c10d\n"
         "                          and nnodes>1 (PORT default " STR(DEF_RDZV_PORT) ")\n"
         "  --rdzv_id ID, --run_id ID\n"
         "                          id shared by every node of one run (default " DEF_RDZV_ID ")\n"
         "  --rdzv_conf KEY=VALUE[,KEY=VALUE...]\n"
         "                          token_file=PATH: the job secret (see Secret below);\n"
         "                          in seconds: join_timeout (default " STR(DEF_JOIN_TIMEOUT) "),\n"
         "                          last_call_timeout (default " STR(
             DEF_LAST_CALL_TIMEOUT) ": wait after MIN nodes joined),\n"
         "                          close_timeout (default " STR(DEF_CLOSE_TIMEOUT) "),\n"
         "                          heartbeat_interval (default " STR(
             DEF_HEARTBEAT_INTERVAL) "),\n"
         "                          heartbeat_timeout (default " STR(
             DEF_HEARTBEAT_TIMEOUT) ": a node silent longer is dead),\n"
         "                          handshake_timeout (default: the store's, a few seconds: a\n"
         "                          connection that has not proved the secret by then is closed)\n"
         "  --standalone            one node, store on 127.0.0.1 on a free port; implied by\n"
         "                          c10d without --rdzv_endpoint and nnodes 1 (not with\n"
         "                          --rdzv_endpoint)\n"
         "  --master_addr HOST      static: node 0's address, where the store lives; also\n"
         "                          overrides the workers' MASTER_ADDR (default: unset)\n"
         "  --master_port PORT      static: the store's port (default " STR(
             DEF_MASTER_PORT) " with --master_addr,\n"
         "                          a free port on one node)\n"
         "\n"
         "Supervision:\n"
         "  --max_restarts N        restarts of the worker group before giving up (default " STR(
             DEF_MAX_RESTARTS) ")\n"
         "  --monitor_interval S    seconds between worker health checks; exits are noticed at\n"
         "                          once anyway (default " STR(DEF_MONITOR_INTERVAL) ")\n"
         "  --shutdown_timeout S    seconds between SIGTERM and SIGKILL when stopping workers\n"
         "                          (default " STR(DEF_SHUTDOWN_TIMEOUT) ")\n"
         "\n"
         "Output (STD: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank: 0:1,1:2):\n"
         "  -r, --redirects STD     send these streams to files in --log_dir only (default 0)\n"
         "  -t, --tee STD           copy these streams to files in --log_dir too (default 0)\n"
         "  --log_dir DIR           per-rank log files go here, in <run_id>/attempt_<n>/<rank>/\n"
         "                          (attempt = rendezvous round) (default: none; a temporary\n"
         "                          directory when --redirects or --tee need one)\n"
         "  --local_ranks_filter R[,R...]\n"
         "                          show console lines of these local ranks only (default: all)\n"
         "\n"
         "Secret (the store admits only programs that hold it; every node needs the same one):\n"
         "  --rdzv_conf token_file=PATH\n"
         "                          read it from PATH (" STR(CLI_SECRET_MIN) ".." STR(
             CLI_SECRET_MAX) " bytes, trailing whitespace\n"
         "                          ignored; keep the file's mode 600)\n"
         "  " STORE_ENV_SECRET "=SECRET\n"
         "                          the same from the environment; token_file wins if both\n"
         "                          are given. Neither: a single-node job makes a random one;\n"
         "                          a multi-node job runs an open store (with a warning)\n"
         "\n"
         "  -h, --help              this text\n"
         "  --version               meshrun's version (" MESHRUN_VERSION ")\n"
         "\n"
         "Environment of each worker:\n"
         "  RANK, WORLD_SIZE              global rank and number of workers\n"
         "  LOCAL_RANK, LOCAL_WORLD_SIZE  rank and number of workers on this node\n"
         "  GROUP_RANK, GROUP_WORLD_SIZE  this node's rank and the number of nodes\n"
         "  ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE\n"
         "  MASTER_ADDR, MASTER_PORT      rank 0's node and a free port there (for PyTorch)\n"
         "  TORCHELASTIC_RESTART_COUNT    failure restarts so far, job-wide (as torchrun: a node\n"
         "                                joining or leaving restarts workers without counting)\n"
         "  MESHRUN_ROUND                 the rendezvous round: unique per round, up on every\n"
         "                                restart (key per-round state with it)\n"
         "  TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE\n"
         "  OMP_NUM_THREADS=1             unless already set\n"
         "  MESHRUN_STORE=HOST:PORT       the agent's key-value store\n"
         "  " STORE_ENV_SECRET "            the job secret for that store (when there is one)\n"
         "\n"
         "Exit status:\n"
         "  0                       every worker exited 0\n"
         "  CODE                    the root-cause worker's code (128+signal if a signal killed it),\n"
         "                          once --max_restarts are spent, or at once when the failure is\n"
         "                          permanent: the worker exited " STR(
             ERRFILE_EXIT_USAGE) " (a usage or plan error) or\n"
         "                          " STR(ERRFILE_EXIT_CONFIG) " (EX_CONFIG), or its TORCHELASTIC_ERROR_FILE holds\n"
         "                          {\"meshrun\": {\"restart\": false}} (\"restart\": true makes 2 and 78\n"
         "                          restartable); every node of the job stops with that code\n"
         "  2                       a usage error of meshrun's (one line naming the flag)\n"
         "  " STR(AGENT_EXIT_STORE_LOST) "                      the rendezvous store was lost: the node serving it\n"
         "                          died or was silent for heartbeat_timeout (EX_UNAVAILABLE)\n"
         "  127                     PROGRAM not found or not executable\n"
         "  128+N                   meshrun itself got signal N (INT, TERM, HUP)\n"
         "  1                       other launcher errors (endpoint unreachable, join timeout, ...)\n"
         "\n"
         "Examples:\n"
         "  meshrun --nproc_per_node=8 bin/trainer configs/llama-1b-fsdp-tp.json\n"
         "  meshrun --nnodes=2 --nproc_per_node=8 --rdzv_endpoint=node0:29400 bin/trainer PLAN\n";
}
