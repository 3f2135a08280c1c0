/* cli: turns meshrun's argv into launcher_opts_t, with torchrun's spellings and meanings.
 *
 * One table lists every flag: its canonical name (underscores), an optional short letter,
 * whether it takes a value, whether PET_<NAME> may give it, and the function that parses that
 * value. A flag's name is normalized ('-' -> '_') before the lookup, so --nproc-per-node and
 * --nproc_per_node are the same flag; values come as "--flag=value" or "--flag value" ("-r3",
 * "-r=3", "-r 3" for short ones). Parsing stops at the first argument that is not a flag, or
 * after "--": that argument is PROGRAM and everything after it belongs to PROGRAM. A repeated
 * flag overrides the earlier one, except --rdzv_conf, whose keys accumulate.
 *
 * Where values come from, in this order, each source only for what the earlier ones left unset:
 * the command line; then PET_<FLAG> variables, as torchrun's argparse reads them (Kubeflow's
 * PyTorchJob sets them): a variable is the flag's default, so a flag on the command line wins
 * whole (PET_RDZV_CONF is not merged with --rdzv_conf); then, under Slurm with no rendezvous
 * flag given, Slurm's job variables (cli_slurm.c); then the defaults. The command line is therefore read
 * twice: once for its shape (which flags, where PROGRAM starts, --help), once for the values
 * after the environment's, so that a bad PET_ value is named as such and cannot override argv.
 *
 * After the flags, one pass checks what only makes sense together (static needs a fixed node
 * count and a node rank, --standalone excludes an endpoint, per-rank lists fit
 * --nproc_per_node, ...) and resolves where the rendezvous store lives. Every error is one line
 * naming the flag (or the variable) and the expected form, returned as CLI_EUSAGE.
 *
 * The job secret is read here too (token_file, else MESHRUN_RDZV_TOKEN), so that a token file
 * that cannot be used is a usage error on every node before anything starts.
 *
 * What it does not do: look anything up on the network (hostnames are resolved by the agent),
 * pick ports (Slurm's port is computed from the job id, not probed), read the environment other
 * than PET_*, SLURM_*, MESHRUN_SLURM_PORT, PYTHON_EXEC, CUDA_VISIBLE_DEVICES for
 * --nproc_per_node=auto and MESHRUN_RDZV_TOKEN, make a secret up (the agent does, for
 * single-node jobs), or print anything but the one info line saying which options came from
 * Slurm (main prints err or cli_usage(); the agent warns about a token file's mode).
 *
 * The module's other files (see cli_impl.h): cli_slurm.c, cli_probe.c (the CPUs) and
 * cli_help.c (the --help text). */
#include "launcher/cli.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/gpus.h"
#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "launcher/cli_impl.h"

typedef int (*cli_setter_t)(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                            const char *val, char *err, size_t errlen);

typedef struct {
  const char *name; /* canonical, with underscores, without "--" */
  char short_name;  /* 0: none */
  int takes_value;
  int env;          /* 1: PET_<NAME in upper case> gives it when the command line does not */
  cli_setter_t set; /* NULL for the flags handled in cli_parse itself (help, version) */
} cli_flag_t;

int cli_usage_error(char *err, size_t errlen, const char *fmt, ...) {
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

int cli_parse_int(const char *s, long lo, long hi, long *out) {
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

/* Seconds as a plain decimal ("5", "0.25", "1e-3"): no hex, inf or nan; v >= lo (or > lo). 0, or
 * -1 for anything else (the caller names the flag). */
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

/* 0, or -1 when val is empty or does not fit (the caller names the flag). */
static int copy_string(char *dst, size_t dstlen, const char *val) {
  size_t n = strlen(val);
  if (n == 0 || n >= dstlen) return -1;
  memcpy(dst, val, n + 1);
  return 0;
}

/* ---- one setter per flag ---- */

static int set_nproc_per_node(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                              const char *val, char *err, size_t errlen) {
  long v;
  int n;
  if (strcmp(val, "auto") == 0) {
    n = gpus_visible();
    if (n == 0) n = cli_count_cpus();
  } else if (strcmp(val, "gpu") == 0) {
    n = gpus_visible();
    if (n == 0)
      return cli_usage_error(err, errlen, "%s: \"gpu\" found no GPU (%s); expected N, auto, cpu or gpu", flag,
                         gpus_none_hint());
  } else if (strcmp(val, "cpu") == 0) {
    n = cli_count_cpus();
  } else if (cli_parse_int(val, 1, CLI_MAX_LOCAL_RANKS, &v) == 0) {
    n = (int)v;
  } else {
    return cli_usage_error(err, errlen,
                       "%s: \"%s\" is not valid; expected N (1 <= N <= %d), auto, cpu or gpu",
                       flag, val, CLI_MAX_LOCAL_RANKS);
  }
  /* A machine with more CPUs than one agent's tables hold still gets a working count. */
  o->nproc_per_node = n > CLI_MAX_LOCAL_RANKS ? CLI_MAX_LOCAL_RANKS : n;
  seen->nproc_set = 1;
  return 0;
}

static int set_nnodes(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                      char *err, size_t errlen) {
  char buf[64];
  long lo, hi;
  const char *colon = strchr(val, ':');
  int ok;
  if (!colon) {
    ok = cli_parse_int(val, 1, 1 << 20, &lo) == 0;
    hi = lo;
  } else {
    size_t n = (size_t)(colon - val);
    ok = n < sizeof buf;
    if (ok) {
      memcpy(buf, val, n);
      buf[n] = '\0';
      ok = cli_parse_int(buf, 1, 1 << 20, &lo) == 0 && cli_parse_int(colon + 1, 1, 1 << 20, &hi) == 0 &&
           lo <= hi;
    }
  }
  if (!ok)
    return cli_usage_error(err, errlen,
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
  if (cli_parse_int(val, 0, 1 << 20, &v) != 0)
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected an integer >= 0", flag,
                       val);
  o->node_rank = (int)v;
  seen->node_rank_set = 1;
  return 0;
}

static int set_rdzv_endpoint(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                             const char *val, char *err, size_t errlen) {
  char why[256] = "";
  char host[sizeof o->rdzv_host];
  int port = 0;
  if (copy_string(o->rdzv_endpoints, sizeof o->rdzv_endpoints, val) != 0)
    return cli_usage_error(err, errlen, "%s: \"%.200s...\" is not valid; expected at most %zu bytes", flag, val,
                       sizeof o->rdzv_endpoints - 1);
  /* A list is etcd's (checked with the backend, which may come later): its first member here. */
  char first[sizeof o->rdzv_endpoints];
  snprintf(first, sizeof first, "%s", val);
  first[strcspn(first, ",")] = 0;
  if (strchr(val, ',')) val = first;
  if (net_parse_endpoint(val, host, sizeof host, &port, DEF_RDZV_PORT, 0, why, sizeof why) != 0)
  {
    /* net's message names the endpoint and the fault, sometimes the form too. */
    if (!why[0]) snprintf(why, sizeof why, "\"%.200s\" is not valid", val);
    return cli_usage_error(err, errlen, "%s: %s%s", flag, why,
                       strstr(why, "expected") ? ""
                                               : "; expected HOST[:PORT], [IPV6]:PORT or IPV6 "
                                                 "with 1 <= PORT <= 65535");
  }
  memcpy(o->rdzv_host, host, sizeof host);
  o->rdzv_port = port;
  snprintf(o->rdzv_endpoint_from, sizeof o->rdzv_endpoint_from, "%s", flag);
  seen->endpoint_set = 1;
  return 0;
}

static int set_rdzv_id(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                       char *err, size_t errlen) {
  /* The id names a folder under --log_dir, files in $TMPDIR and the job's prefix of keys in the
   * store and in etcd: a '/' or a leading '.' would reach other folders ("../x") or another
   * job's keys (etcd's "meshrun/a/" holds job "a/b"'s), so only plain name characters pass. */
  size_t n = strlen(val);
  int ok = n >= 1 && n <= CLI_RUN_ID_MAX && val[0] != '.';
  for (const char *p = val; ok && *p; p++)
    ok = isalnum((unsigned char)*p) || strchr("._-", *p);
  if (!ok)
    return cli_usage_error(err, errlen, "%s: \"%.100s%s\" is not valid; expected 1..%d characters of " CLI_RUN_ID_CHARS
                       ", not starting with '.'",
                       flag, val, n > 100 ? "..." : "", CLI_RUN_ID_MAX);
  memcpy(o->rdzv_id, val, n + 1);
  seen->rdzv_id_set = 1;
  return 0;
}

static int set_rdzv_backend(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                            const char *val, char *err, size_t errlen) {
  if (strcmp(val, "c10d") == 0)
    o->rdzv_backend = RDZV_BACKEND_C10D;
  else if (strcmp(val, "static") == 0)
    o->rdzv_backend = RDZV_BACKEND_STATIC;
  else if (strcmp(val, "etcd") == 0 || strcmp(val, "etcd-v2") == 0)
    o->rdzv_backend = RDZV_BACKEND_ETCD; /* torchrun's two names for its etcd backends */
  else
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected c10d, etcd or static", flag, val);
  seen->backend_set = 1;
  return 0;
}

static int set_rdzv_conf(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                         char *err, size_t errlen) {
  static const char expected[] =
      "expected KEY=VALUE[,...] with KEY one of join_timeout, last_call_timeout, "
      "close_timeout, heartbeat_interval, heartbeat_timeout, handshake_timeout, frame_timeout, "
      "progress_interval (seconds), token_file (a path)";
  const char *p = val;
  while (*p) {
    size_t len = strcspn(p, ",");
    char item[1100];
    if (len >= sizeof item)
      return cli_usage_error(err, errlen, "%s: \"%.*s\" is too long; %s", flag, (int)len, p, expected);
    memcpy(item, p, len);
    item[len] = '\0';
    p += len;
    if (*p == ',') p++;
    if (len == 0) continue; /* "a=1,,b=2" and a trailing comma are harmless */

    char *eq = strchr(item, '=');
    if (!eq)
      return cli_usage_error(err, errlen, "%s: \"%s\" has no '='; %s", flag, item, expected);
    *eq = '\0';
    const char *value = eq + 1;
    for (char *k = item; *k; k++)
      if (*k == '-') *k = '_';

    if (strcmp(item, "token_file") == 0) {
      /* Read in cli_validate, once the last token_file given is known. */
      if (copy_string(o->token_file, sizeof o->token_file, value) != 0)
        return cli_usage_error(err, errlen, "%s: token_file=\"%s\" is not valid; expected a path of 1..%zu bytes",
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
    else if (strcmp(item, "frame_timeout") == 0)
      dst = &o->frame_timeout_s;
    else if (strcmp(item, "progress_interval") == 0)
      dst = &o->progress_interval_s, zero_ok = 1;
    else
      return cli_usage_error(err, errlen, "%s: unknown key \"%s\"; %s", flag, item, expected);
    if (parse_seconds(value, 0, zero_ok, dst) != 0)
      return cli_usage_error(err, errlen, "%s: %s=\"%s\" is not valid; expected seconds %s 0", flag,
                         item, value, zero_ok ? ">=" : ">");
  }
  return 0;
}

/* Cuts trailing whitespace (a token file usually ends in a newline) and checks what is left:
 * no NUL inside, CLI_SECRET_MIN..CLI_SECRET_MAX bytes. Returns 0, or -1 with a reason in why. */
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
      return cli_usage_error(err, errlen, "--rdzv_conf: token_file=%s: not a regular file; %s", o->token_file, form);
    if (rc == -EFBIG) {
      snprintf(why, sizeof why, "is over %d bytes", CLI_SECRET_MAX);
      return cli_usage_error(err, errlen, "--rdzv_conf: token_file=%s %s; %s", o->token_file, why, form);
    }
    if (rc)
      return cli_usage_error(err, errlen, "--rdzv_conf: token_file=%s: %s; %s", o->token_file, strerror(-rc), form);
    struct stat st; /* for the agent's warning about a file others may read */
    if (stat(o->token_file, &st) != 0) st.st_mode = 0;
    rc = check_secret(buf, n, why, sizeof why);
    if (rc) {
      free(buf);
      return cli_usage_error(err, errlen, "--rdzv_conf: token_file=%s %s; %s", o->token_file, why, form);
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
    return cli_usage_error(err, errlen,
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
    return cli_usage_error(err, errlen,
                       "%s: \"%s\" is not valid; expected a hostname or IP address without a "
                       "port (the port goes in --master_port)",
                       flag, val);
  memcpy(o->master_addr, host, strlen(host) + 1);
  snprintf(seen->master_addr_flag, sizeof seen->master_addr_flag, "%s", flag);
  seen->master_addr_set = 1;
  return 0;
}

static int set_master_port(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                           const char *val, char *err, size_t errlen) {
  long v;
  if (cli_parse_int(val, 1, 65535, &v) != 0)
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected a port 1..65535", flag,
                       val);
  o->master_port = (int)v;
  snprintf(seen->master_port_flag, sizeof seen->master_port_flag, "%s", flag);
  seen->master_port_set = 1;
  return 0;
}

static int set_max_restarts(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                            const char *val, char *err, size_t errlen) {
  long v;
  if (cli_parse_int(val, 0, 1000000, &v) != 0)
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected an integer >= 0", flag,
                       val);
  o->max_restarts = (int)v;
  return 0;
}

static int set_monitor_interval(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                                const char *val, char *err, size_t errlen) {
  if (parse_seconds(val, 0, 0, &o->monitor_interval_s) != 0)
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected seconds > 0", flag, val);
  return 0;
}

static int set_hang_timeout(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val, char *err,
                            size_t errlen) {
  if (parse_seconds(val, 0, 1, &o->hang_timeout_s) != 0)
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected seconds >= 0 (0 turns the hang watch off)",
                           flag, val);
  return 0;
}

static int set_health_check(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val, char *err,
                            size_t errlen) {
  o->health_check = 1;
  return 0;
}

static int set_health_min_fraction(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val, char *err,
                                   size_t errlen) {
  char *end;
  double v = strtod(val, &end);
  if (!*val || *end || !(v > 0 && v <= 1))
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected a fraction in (0, 1] of the median", flag,
                           val);
  o->health_min_fraction = v;
  return 0;
}

static int set_shutdown_timeout(launcher_opts_t *o, cli_seen_t *seen, const char *flag,
                                const char *val, char *err, size_t errlen) {
  if (parse_seconds(val, 0, 1, &o->shutdown_timeout_s) != 0)
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected seconds >= 0", flag, val);
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
    if (cli_parse_int(val, 0, 3, &v) != 0)
      return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
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
      return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
    memcpy(item, p, len);
    item[len] = '\0';
    colon = strchr(item, ':');
    if (!colon)
      return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
    *colon = '\0';
    if (cli_parse_int(item, 0, CLI_MAX_LOCAL_RANKS - 1, &r) != 0 || cli_parse_int(colon + 1, 0, 3, &v) != 0)
      return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; %s", flag, val, expected);
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
    return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected a directory path of 1..%zu bytes",
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
      return cli_usage_error(err, errlen,
                         "%s: \"%s\" is not valid; expected local ranks like 0 or 0,2 (each "
                         "0..%d)",
                         flag, val, CLI_MAX_LOCAL_RANKS - 1);
    memcpy(item, p, len);
    item[len] = '\0';
    if (cli_parse_int(item, 0, CLI_MAX_LOCAL_RANKS - 1, &r) != 0)
      return cli_usage_error(err, errlen,
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

static int set_merge_output(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                            char *err, size_t errlen) {
  static const char *const names[] = {[CLI_MERGE_AUTO] = "auto", [CLI_MERGE_ON] = "on", [CLI_MERGE_OFF] = "off"};
  for (int i = 0; i < 3; i++)
    if (!strcmp(val, names[i])) {
      o->merge_output = (cli_merge_t)i;
      return 0;
    }
  return cli_usage_error(err, errlen, "%s: \"%s\" is not valid; expected auto, on or off", flag, val);
}

static int set_role(launcher_opts_t *o, cli_seen_t *seen, const char *flag, const char *val,
                    char *err, size_t errlen) {
  int ok = copy_string(o->role, sizeof o->role, val) == 0;
  for (const char *p = val; ok && *p; p++)
    ok = isgraph((unsigned char)*p);
  if (!ok)
    return cli_usage_error(err, errlen,
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

/* env: every flag torchrun reads from PET_<FLAG> (all of its flags but --help), and meshrun's
 * own --shutdown_timeout, --hang_timeout and the --health_ flags alike. --run_id is another name of --rdzv_id: PET_RDZV_ID gives both. */
static const cli_flag_t cli_flags[] = {
    {"nproc_per_node", 0, 1, 1, set_nproc_per_node},
    {"nnodes", 0, 1, 1, set_nnodes},
    {"node_rank", 0, 1, 1, set_node_rank},
    {"rdzv_backend", 0, 1, 1, set_rdzv_backend},
    {"rdzv_endpoint", 0, 1, 1, set_rdzv_endpoint},
    {"rdzv_id", 0, 1, 1, set_rdzv_id},
    {"run_id", 0, 1, 0, set_rdzv_id},
    {"rdzv_conf", 0, 1, 1, set_rdzv_conf},
    {"standalone", 0, 0, 1, set_standalone},
    {"master_addr", 0, 1, 1, set_master_addr},
    {"master_port", 0, 1, 1, set_master_port},
    {"max_restarts", 0, 1, 1, set_max_restarts},
    {"monitor_interval", 0, 1, 1, set_monitor_interval},
    {"redirects", 'r', 1, 1, set_redirects},
    {"tee", 't', 1, 1, set_tee},
    {"log_dir", 0, 1, 1, set_log_dir},
    {"local_ranks_filter", 0, 1, 1, set_local_ranks_filter},
    {"merge_output", 0, 1, 1, set_merge_output},
    {"role", 0, 1, 1, set_role},
    {"shutdown_timeout", 0, 1, 1, set_shutdown_timeout},
    {"hang_timeout", 0, 1, 1, set_hang_timeout},
    {"health_check", 0, 0, 1, set_health_check},
    {"health_min_fraction", 0, 1, 1, set_health_min_fraction},
    {"no_python", 0, 0, 1, set_no_python},
    {"module", 'm', 0, 1, set_module},
    {"help", 'h', 0, 0, NULL},
    {"version", 0, 0, 0, NULL},
};
#define CLI_NFLAGS (sizeof cli_flags / sizeof cli_flags[0])

static const cli_flag_t *find_long(const char *name, size_t len) {
  char norm[64];
  if (len == 0 || len >= sizeof norm) return NULL;
  for (size_t i = 0; i < len; i++) norm[i] = name[i] == '-' ? '_' : name[i];
  norm[len] = '\0';
  for (size_t i = 0; i < CLI_NFLAGS; i++)
    if (strcmp(cli_flags[i].name, norm) == 0) return &cli_flags[i];
  return NULL;
}

static const cli_flag_t *find_short(char c) {
  for (size_t i = 0; i < CLI_NFLAGS; i++)
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
  o->progress_interval_s = DEF_PROGRESS_INTERVAL;
  snprintf(o->rdzv_endpoint_from, sizeof o->rdzv_endpoint_from, "--rdzv_endpoint");
  o->max_restarts = DEF_MAX_RESTARTS;
  o->monitor_interval_s = DEF_MONITOR_INTERVAL;
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) {
    o->redirects_per_rank[i] = -1;
    o->tee_per_rank[i] = -1;
    o->local_ranks_filter[i] = 1;
  }
  o->shutdown_timeout_s = DEF_SHUTDOWN_TIMEOUT;
  o->health_min_fraction = DEF_HEALTH_MIN_FRACTION;
  snprintf(o->role, sizeof o->role, "%s", DEF_ROLE);
}

/* ---- the checks between flags ---- */

/* Flags that exclude each other: -m and --no_python; --standalone and an endpoint, another
 * backend than c10d or more than one node; a list of endpoints without etcd. */
static int check_conflicts(const launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
  if (o->no_python && o->run_module)
    return cli_usage_error(err, errlen,
                       "--module: cannot be used with --no_python; expected one of them");

  if (o->standalone) {
    if (seen->endpoint_set)
      return cli_usage_error(err, errlen,
                         "--standalone: conflicts with --rdzv_endpoint; expected one of them "
                         "(--standalone hosts the store on 127.0.0.1 itself)");
    if (seen->backend_set && o->rdzv_backend != RDZV_BACKEND_C10D)
      return cli_usage_error(err, errlen,
                         "--standalone: conflicts with --rdzv_backend=%s; expected "
                         "--rdzv_backend=c10d or none",
                         o->rdzv_backend == RDZV_BACKEND_ETCD ? "etcd" : "static");
    if (seen->nnodes_set && (o->nnodes_min != 1 || o->nnodes_max != 1))
      return cli_usage_error(err, errlen,
                         "--standalone: conflicts with --nnodes=%d:%d; expected --nnodes=1 or "
                         "none (standalone is one node)",
                         o->nnodes_min, o->nnodes_max);
  }

  if (seen->endpoint_set && strchr(o->rdzv_endpoints, ',') && o->rdzv_backend != RDZV_BACKEND_ETCD)
    return cli_usage_error(err, errlen,
                       "--rdzv_endpoint: \"%.300s\" lists several endpoints; expected one HOST[:PORT] "
                       "(a list is for --rdzv_backend=etcd, the members of an etcd cluster)",
                       o->rdzv_endpoints);
  return 0;
}

/* etcd: the cluster's members, each of which must parse; rdzv_host and rdzv_port become the
 * first one's, whose port defaults to etcd's, not c10d's. */
static int resolve_etcd(launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
  if (!seen->endpoint_set)
    return cli_usage_error(err, errlen,
                       "--rdzv_endpoint: missing; expected the etcd cluster's client endpoints "
                       "HOST[:PORT],HOST[:PORT],... with --rdzv_backend=etcd (PORT default %d)",
                       CLI_ETCD_PORT);
  char list[sizeof o->rdzv_endpoints], *save = NULL;
  int n = 0;
  snprintf(list, sizeof list, "%s", o->rdzv_endpoints);
  for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save), n++) {
    char host[sizeof o->rdzv_host], why[256] = "";
    int port = 0;
    if (!strncmp(tok, "http://", 7)) tok += 7;
    if (net_parse_endpoint(tok, host, sizeof host, &port, CLI_ETCD_PORT, 0, why, sizeof why) != 0)
      return cli_usage_error(err, errlen, "--rdzv_endpoint: etcd member \"%.300s\": %s%s", tok,
                         why[0] ? why : "not valid", strstr(why, "expected") ? "" : "; expected HOST[:PORT]");
    if (n == 0) {
      memcpy(o->rdzv_host, host, sizeof host);
      o->rdzv_port = port;
    }
  }
  if (n == 0 || n > CLI_ETCD_MAX_MEMBERS)
    return cli_usage_error(err, errlen, "--rdzv_endpoint: \"%.300s\" names %d etcd members; expected 1..%d", o->rdzv_endpoints,
                       n, CLI_ETCD_MAX_MEMBERS);
  return 0;
}

/* static: a fixed node count, a node rank (0 alone on one node), and without an endpoint the
 * store at --master_addr:--master_port, or on 127.0.0.1 for one node. */
static int resolve_static(launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
  if (o->nnodes_min != o->nnodes_max)
    return cli_usage_error(err, errlen,
                       "--nnodes: \"%d:%d\" is not valid with --rdzv_backend=static; expected N "
                       "(static rendezvous is not elastic)",
                       o->nnodes_min, o->nnodes_max);
  if (o->node_rank < 0) {
    if (o->nnodes_max > 1)
      return cli_usage_error(err, errlen,
                         "--node_rank: missing; expected 0..%d on each node with "
                         "--rdzv_backend=static",
                         o->nnodes_max - 1);
    o->node_rank = 0;
  }
  if (seen->endpoint_set) return 0;
  if (o->master_addr[0]) {
    snprintf(o->rdzv_host, sizeof o->rdzv_host, "%s", o->master_addr);
    o->rdzv_port = seen->master_port_set ? o->master_port : DEF_MASTER_PORT;
    if (seen->master_port_set)
      snprintf(o->rdzv_endpoint_from, sizeof o->rdzv_endpoint_from, "%s/%s", seen->master_addr_flag,
               seen->master_port_flag);
    else
      snprintf(o->rdzv_endpoint_from, sizeof o->rdzv_endpoint_from,
               "%s (port " STR(DEF_MASTER_PORT) ", --master_port's default)", seen->master_addr_flag);
  } else if (o->nnodes_max == 1) {
    snprintf(o->rdzv_host, sizeof o->rdzv_host, "127.0.0.1");
    o->rdzv_port = seen->master_port_set ? o->master_port : 0;
  } else {
    return cli_usage_error(err, errlen,
                       "--master_addr: missing; expected the address of node 0 (or "
                       "--rdzv_endpoint) with --rdzv_backend=static and --nnodes=%d",
                       o->nnodes_max);
  }
  return 0;
}

/* Where the rendezvous store lives, by backend; then --standalone's fixed choices, and on one
 * node the workers' MASTER_PORT. */
static int resolve_store(launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
  int rc;
  if (o->rdzv_backend == RDZV_BACKEND_ETCD) {
    if ((rc = resolve_etcd(o, seen, err, errlen))) return rc;
  } else if (o->rdzv_backend == RDZV_BACKEND_STATIC) {
    if ((rc = resolve_static(o, seen, err, errlen))) return rc;
  } else if (!seen->endpoint_set) {
    /* c10d with nowhere to meet: one node is torchrun --standalone; more is a mistake that
     * would otherwise surface as a join timeout ten minutes later. */
    if (o->nnodes_max > 1 && !o->standalone)
      return cli_usage_error(err, errlen,
                         "--rdzv_endpoint: missing; expected HOST[:PORT] of the rendezvous store "
                         "when --nnodes=%d:%d (or --standalone for one node)",
                         o->nnodes_min, o->nnodes_max);
    o->standalone = 1;
  }
  if (o->standalone) {
    snprintf(o->rdzv_endpoint_from, sizeof o->rdzv_endpoint_from, "--standalone");
    o->rdzv_backend = RDZV_BACKEND_C10D;
    o->nnodes_min = o->nnodes_max = 1;
    snprintf(o->rdzv_host, sizeof o->rdzv_host, "127.0.0.1");
    o->rdzv_port = 0;
  }

  /* One node: --master_port is what the workers get as MASTER_PORT (PyTorch's rank 0 binds it),
   * and meshrun's store moves to a free port so that the two never collide. */
  if (seen->master_port_set && o->nnodes_max == 1 && !seen->endpoint_set && !o->from_slurm) {
    o->worker_master_port = o->master_port;
    o->rdzv_port = 0;
  }
  return 0;
}

/* The per-local-rank lists (--redirects, --tee, --local_ranks_filter) name local ranks below
 * --nproc_per_node. */
static int check_per_rank(const launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
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
      return cli_usage_error(err, errlen,
                         "%s: local rank %d is not valid with --nproc_per_node=%d; expected local "
                         "ranks 0..%d",
                         per_rank[i].flag, hi, o->nproc_per_node, o->nproc_per_node - 1);
  }
  return 0;
}

/* The checks between flags, then where the store lives. Order matters: --standalone first
 * (it fixes backend and node count), then the backend's own rules, then the node rank against
 * the node count, then per-rank lists against --nproc_per_node. */
static int cli_validate(launcher_opts_t *o, const cli_seen_t *seen, char *err, size_t errlen) {
  int rc;
  if ((rc = check_conflicts(o, seen, err, errlen))) return rc;
  if ((rc = resolve_store(o, seen, err, errlen))) return rc;

  if (o->node_rank >= o->nnodes_max)
    return cli_usage_error(err, errlen,
                       "--node_rank: \"%d\" is not valid with --nnodes=%d:%d; expected 0..%d",
                       o->node_rank, o->nnodes_min, o->nnodes_max, o->nnodes_max - 1);

  if (o->heartbeat_timeout_s <= o->heartbeat_interval_s)
    return cli_usage_error(err, errlen,
                       "--rdzv_conf: heartbeat_timeout=%g is not valid with "
                       "heartbeat_interval=%g; expected heartbeat_timeout > heartbeat_interval",
                       o->heartbeat_timeout_s, o->heartbeat_interval_s);

  if ((rc = resolve_secret(o, err, errlen))) return rc;
  return check_per_rank(o, seen, err, errlen);
}

/* ---- parsing ---- */

/* The flag at argv[*i]: 1 with *f and *val (NULL: none) set and *i past it; 0 when argv[*i] is
 * PROGRAM or the end ("--" is skipped, *i then names PROGRAM); CLI_EUSAGE for an unknown flag, a
 * missing value or a value given to a flag that takes none. */
static int next_flag(int argc, char **argv, int *i, const cli_flag_t **f, const char **val, char *err,
                     size_t errlen) {
  if (*i >= argc) return 0;
  const char *a = argv[*i];
  if (strcmp(a, "--") == 0) {
    (*i)++;
    return 0;
  }
  if (a[0] != '-' || a[1] == '\0') return 0; /* PROGRAM ("-" alone is a name, not a flag) */
  *val = NULL;
  if (a[1] == '-') {
    const char *name = a + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    *f = find_long(name, len);
    if (!*f)
      return cli_usage_error(err, errlen, "--%.*s: unknown flag; expected one of the flags in --help", (int)len, name);
    if (eq) *val = eq + 1;
  } else {
    *f = find_short(a[1]);
    if (!*f) return cli_usage_error(err, errlen, "-%c: unknown flag; expected one of the flags in --help", a[1]);
    if (a[2]) *val = a[2] == '=' ? a + 3 : a + 2;
  }
  char flag[72];
  snprintf(flag, sizeof flag, "--%s", (*f)->name);
  if (!(*f)->takes_value && *val)
    return cli_usage_error(err, errlen, "%s: takes no value, got \"%s\"; expected %s alone", flag, *val, flag);
  if ((*f)->takes_value && !*val) {
    if (*i + 1 >= argc)
      return cli_usage_error(err, errlen, "%s: missing value; expected %s=VALUE or %s VALUE (see --help)", flag, flag,
                         flag);
    *val = argv[++*i];
  }
  (*i)++;
  return 1;
}

/* torchrun reads a boolean PET_ variable as int(value) != 0. "true" and "false" (any case),
 * which torchrun refuses, are taken too: they cannot mean anything else. 0, or -1 for any other
 * value (the caller names the variable). */
static int parse_env_bool(const char *v, int *on) {
  long n;
  if (cli_parse_int(v, LONG_MIN, LONG_MAX, &n) == 0) {
    *on = n != 0;
    return 0;
  }
  if (strcasecmp(v, "true") == 0 || strcasecmp(v, "false") == 0) {
    *on = strcasecmp(v, "true") == 0;
    return 0;
  }
  return -1;
}

/* PET_<FLAG> for every flag the command line does not give (given[k]: flag k, or another name of
 * it, is on the command line). An empty variable counts as unset. Errors name the variable and
 * the flag: "meshrun: PET_NNODES (--nnodes): "abc" is not valid; expected ...". */
static int apply_env(launcher_opts_t *o, cli_seen_t *seen, const unsigned char *given, char *err,
                     size_t errlen) {
  for (size_t k = 0; k < CLI_NFLAGS; k++) {
    const cli_flag_t *f = &cli_flags[k];
    if (!f->env || given[k]) continue;
    char name[64];
    size_t n = (size_t)snprintf(name, sizeof name, "PET_%s", f->name);
    for (size_t c = 4; c < n && c < sizeof name; c++) name[c] = (char)toupper((unsigned char)name[c]);
    const char *v = getenv(name);
    if (!v || !*v) continue;
    char label[128];
    snprintf(label, sizeof label, "%s (--%s)", name, f->name);
    if (!f->takes_value) {
      int on;
      if (parse_env_bool(v, &on) != 0)
        return cli_usage_error(err, errlen,
                           "%s: \"%s\" is not valid; expected 1 or 0 (read as torchrun does: an integer, "
                           "0 off, any other on), or true or false",
                           label, v);
      if (!on) continue;
      v = NULL;
    }
    int rc = f->set(o, seen, label, v, err, errlen);
    if (rc) return rc;
  }
  return 0;
}

/* torchrun runs every PROGRAM under Python unless --no_python; meshrun's programs are mostly
 * binaries (bin/trainer), so it does that for a PROGRAM named *.py (and for -m) and execs any
 * other as is. PYTHON_EXEC is torchrun's variable for the interpreter. */
static void choose_python(launcher_opts_t *o) {
  size_t n = strlen(o->program);
  if (!o->run_module && (o->no_python || n <= 3 || strcmp(o->program + n - 3, ".py") != 0)) return;
  const char *exe = getenv("PYTHON_EXEC");
  o->python = exe && *exe ? exe : CLI_PYTHON;
  o->program = o->python;
}

int cli_parse(launcher_opts_t *o, int argc, char **argv, char *err, size_t errlen) {
  cli_seen_t seen = {0};
  seen.redirects_max_rank = seen.tee_max_rank = seen.filter_max_rank = -1;
  if (err && errlen) err[0] = '\0';
  cli_defaults(o);

  /* The command line's shape first: unknown flags, --help, --version, which flags it gives
   * (those PET_ variables are then ignored) and where PROGRAM starts. */
  unsigned char given[CLI_NFLAGS] = {0};
  const cli_flag_t *f;
  const char *val;
  int i = 1, rc;
  while ((rc = next_flag(argc, argv, &i, &f, &val, err, errlen)) == 1) {
    if (!f->set) return strcmp(f->name, "help") == 0 ? CLI_HELP : CLI_VERSION;
    for (size_t k = 0; k < CLI_NFLAGS; k++)
      if (cli_flags[k].set == f->set) given[k] = 1;
  }
  if (rc) return rc;
  int prog = i;

  if ((rc = apply_env(o, &seen, given, err, errlen))) return rc;
  for (i = 1; next_flag(argc, argv, &i, &f, &val, err, errlen) == 1;) {
    char flag[72];
    snprintf(flag, sizeof flag, "--%s", f->name);
    if ((rc = f->set(o, &seen, flag, val, err, errlen))) return rc;
  }

  if (prog >= argc)
    return cli_usage_error(err, errlen,
                       "missing PROGRAM; expected meshrun [OPTIONS] PROGRAM [ARGS...] (see --help)");
  o->program = argv[prog];
  o->prog_argv = &argv[prog];
  o->prog_argc = argc - prog;
  char note[768] = "";
  if ((rc = cli_apply_slurm(o, &seen, note, sizeof note, err, errlen))) return rc;
  choose_python(o);
  if ((rc = cli_validate(o, &seen, err, errlen))) return rc;
  if (o->from_slurm) log_info("%s", note);
  return 0;
}

char **cli_worker_argv(const launcher_opts_t *o) {
  int n = 0;
  while (o->prog_argv[n]) n++;
  char **argv = malloc((size_t)(n + 4) * sizeof *argv);
  if (!argv) return NULL;
  int k = 0;
  if (o->python) { /* -u: the workers' output goes through pipes that Python would buffer */
    argv[k++] = (char *)o->python;
    argv[k++] = "-u";
    if (o->run_module) argv[k++] = "-m";
  }
  for (int i = 0; i <= n; i++) argv[k++] = o->prog_argv[i]; /* its NULL too */
  return argv;
}
