/* cli_slurm: meshrun under Slurm. Slurm's hostlists ("gpu-[01-03,07],cpu5"), expanded here
 * rather than by running `scontrol show hostnames`: meshrun must not depend on Slurm's tools
 * being on the compute nodes' PATH, and only the first host is needed. And the rendezvous
 * options of `srun meshrun PROGRAM`, taken from the job's variables (cli_apply_slurm). The
 * port is computed from the job id, never probed, so that every node computes the same. */
#include "launcher/cli.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "launcher/cli_impl.h"

/* ---- Slurm hostlists ----
 *
 * The whole list is checked before any host is visited, so a typo at its end is still an
 * error. */

#define HL_MAX_GROUPS 8       /* bracket groups in one host name */
#define HL_MAX_HOSTS 1000000  /* more is a typo ("[0-99999999]"), not a cluster */
#define HL_HOST_MAX 256       /* a host name's bytes with its NUL (rdzv_host's size) */

/* One host expression: literal text around up to HL_MAX_GROUPS bracket groups. */
typedef struct {
  int ngroups;
  const char *lit[HL_MAX_GROUPS + 1]; /* the text before group g; lit[ngroups] after the last */
  size_t litlen[HL_MAX_GROUPS + 1];
  const char *grp[HL_MAX_GROUPS];     /* the text inside group g's brackets */
  size_t grplen[HL_MAX_GROUPS];
} hl_expr_t;

/* The number or LO-HI range at p, which ends at ',' or at end. At most 9 digits each (no
 * overflow; no cluster numbers its nodes past that); the width is LO's digit count, so "08-10"
 * gives 08 09 10 and "8-10" gives 8 9 10. Returns the position after it, or NULL. */
static const char *hl_range(const char *p, const char *end, unsigned long *lo, unsigned long *hi,
                            int *width) {
  const char *q = p;
  unsigned long a = 0, b;
  while (q < end && isdigit((unsigned char)*q) && q - p < 10) a = a * 10 + (unsigned long)(*q++ - '0');
  int n = (int)(q - p);
  if (n == 0 || n > 9) return NULL;
  b = a;
  if (q < end && *q == '-') {
    const char *r = ++q;
    b = 0;
    while (q < end && isdigit((unsigned char)*q) && q - r < 10) b = b * 10 + (unsigned long)(*q++ - '0');
    if (q == r || q - r > 9 || b < a) return NULL;
  }
  if (q < end && *q != ',') return NULL;
  *lo = a;
  *hi = b;
  *width = n;
  return q;
}

static int hl_digits(unsigned long v) {
  int n = 1;
  while (v >= 10) v /= 10, n++;
  return n;
}

/* Parses the expression at *pp (it ends at ',' or a blank outside brackets, or at the end of
 * the list) into e: its host count in *count, the length of its longest name in *maxlen.
 * Returns 0, or -1 with the reason in err. */
static int hl_parse(const char *list, const char **pp, hl_expr_t *e, unsigned long *count,
                    size_t *maxlen, char *err, size_t errlen) {
  const char *p = *pp;
  memset(e, 0, sizeof *e);
  e->lit[0] = p;
  *count = 1;
  *maxlen = 0;
  for (;;) {
    char c = *p;
    if (c == '\0' || c == ',' || isspace((unsigned char)c)) break;
    if (c == ']') {
      return err_set(err, errlen, -1, "']' without '[' at byte %td", p - list);
    }
    if (c != '[') {
      if (!isgraph((unsigned char)c)) {
        return err_set(err, errlen, -1, "byte 0x%02x at byte %td is not part of a host name", (unsigned char)c,
                       p - list);
      }
      p++;
      continue;
    }
    const char *close = p + 1;
    while (*close && *close != ']' && *close != '[') close++;
    if (*close != ']') {
      return err_set(err, errlen, -1, "'[' at byte %td is not closed", p - list);
    }
    int g = e->ngroups;
    if (g == HL_MAX_GROUPS) {
      return err_set(err, errlen, -1, "more than %d bracket groups in one name", HL_MAX_GROUPS);
    }
    e->litlen[g] = (size_t)(p - e->lit[g]);
    e->grp[g] = p + 1;
    e->grplen[g] = (size_t)(close - p - 1);
    /* Every range of the group: syntax, how many numbers, the widest one. */
    const char *q = e->grp[g], *end = close;
    unsigned long n = 0;
    int widest = 0;
    for (;;) {
      unsigned long lo, hi;
      int w;
      const char *next = hl_range(q, end, &lo, &hi, &w);
      if (!next) {
        return err_set(err, errlen, -1,
                       "\"[%.*s]\" at byte %td: expected numbers and LO-HI ranges (LO <= HI) separated by ','",
                       (int)e->grplen[g], e->grp[g], p - list);
      }
      n += hi - lo + 1;
      if (hl_digits(hi) > w) w = hl_digits(hi);
      if (w > widest) widest = w;
      if (next == end) break;
      q = next + 1;
    }
    if (n > HL_MAX_HOSTS || *count * n > HL_MAX_HOSTS) {
      return err_set(err, errlen, -1, "more than %d hosts", HL_MAX_HOSTS);
    }
    *count *= n;
    *maxlen += e->litlen[g] + (size_t)widest;
    e->ngroups++;
    p = close + 1;
    e->lit[e->ngroups] = p;
  }
  e->litlen[e->ngroups] = (size_t)(p - e->lit[e->ngroups]);
  *maxlen += e->litlen[e->ngroups];
  if (p == *pp) {
    return err_set(err, errlen, -1, "empty host name at byte %td", p - list);
  }
  if (*maxlen >= HL_HOST_MAX) {
    return err_set(err, errlen, -1, "a host name at byte %td is longer than %d bytes", *pp - list, HL_HOST_MAX - 1);
  }
  *pp = p;
  return 0;
}

/* Called with each host name (NUL-terminated, len bytes); nonzero stops the walk. */
typedef int (*hl_visit_t)(const char *host, size_t len, void *arg);

/* Visits the hosts of one expression, the leftmost group varying slowest. 1 when visit stopped. */
static int hl_each(const hl_expr_t *e, hl_visit_t visit, void *arg) {
  struct {
    const char *cur, *next; /* the range being walked, and where it ends */
    unsigned long lo, hi, v;
    int width;
  } pos[HL_MAX_GROUPS];
  for (int g = 0; g < e->ngroups; g++) {
    pos[g].cur = e->grp[g];
    pos[g].next = hl_range(pos[g].cur, e->grp[g] + e->grplen[g], &pos[g].lo, &pos[g].hi, &pos[g].width);
    pos[g].v = pos[g].lo;
  }
  for (;;) {
    char host[HL_HOST_MAX];
    size_t n = 0;
    for (int g = 0; g <= e->ngroups; g++) { /* fits: hl_parse checked the longest name */
      memcpy(host + n, e->lit[g], e->litlen[g]);
      n += e->litlen[g];
      if (g < e->ngroups) n += (size_t)snprintf(host + n, sizeof host - n, "%0*lu", pos[g].width, pos[g].v);
    }
    host[n] = '\0';
    if (visit(host, n, arg)) return 1;
    int g = e->ngroups - 1;
    for (; g >= 0; g--) {
      const char *end = e->grp[g] + e->grplen[g];
      if (pos[g].v < pos[g].hi) {
        pos[g].v++;
        break;
      }
      /* This range is done: the group's next one, or back to its first and carry left. */
      int carry = pos[g].next == end;
      pos[g].cur = carry ? e->grp[g] : pos[g].next + 1;
      pos[g].next = hl_range(pos[g].cur, end, &pos[g].lo, &pos[g].hi, &pos[g].width);
      pos[g].v = pos[g].lo;
      if (!carry) break;
    }
    if (g < 0) return 0;
  }
}

/* Checks the whole list, then visits its hosts in order until visit says stop. Returns the
 * number of hosts in the list (also when stopped early), or -1 with the reason in err. */
static long hl_walk(const char *list, hl_visit_t visit, void *arg, char *err, size_t errlen) {
  unsigned long total = 0;
  for (int pass = 0; pass < 2; pass++) {
    const char *p = list;
    for (;;) {
      while (isspace((unsigned char)*p)) p++;
      if (!*p) break;
      hl_expr_t e;
      unsigned long count;
      size_t maxlen;
      if (hl_parse(list, &p, &e, &count, &maxlen, err, errlen)) return -1;
      if (pass == 0) {
        total += count;
        if (total > HL_MAX_HOSTS) {
          return err_set(err, errlen, -1, "more than %d hosts", HL_MAX_HOSTS);
        }
      } else if (hl_each(&e, visit, arg)) {
        return (long)total;
      }
      while (isspace((unsigned char)*p)) p++;
      if (*p == ',') {
        p++;
        while (isspace((unsigned char)*p)) p++;
        if (!*p || *p == ',') {
          return err_set(err, errlen, -1, "empty host name at byte %td", p - list);
        }
      }
    }
    if (total == 0) {
      return err_set(err, errlen, -1, "no host in the list");
    }
  }
  return (long)total;
}

typedef struct {
  char *out;
  size_t len, cap;
  int full;
} hl_buf_t;

static int hl_append(const char *host, size_t n, void *arg) {
  hl_buf_t *b = arg;
  size_t sep = b->len ? 1 : 0;
  if (b->len + sep + n + 1 > b->cap) {
    b->full = 1;
    return 1;
  }
  if (sep) b->out[b->len++] = ' ';
  memcpy(b->out + b->len, host, n + 1);
  b->len += n;
  return 0;
}

int cli_hostlist_expand(const char *list, char *out, size_t outlen, char *err, size_t errlen) {
  char why[256];
  hl_buf_t b = {out, 0, outlen, 0};
  if (err && errlen) err[0] = '\0';
  if (out && outlen) out[0] = '\0';
  long n = hl_walk(list, hl_append, &b, why, sizeof why);
  if (n < 0 || b.full) {
    if (n >= 0) snprintf(why, sizeof why, "%ld hosts do not fit in %zu bytes", n, outlen);
    if (err && errlen) err_set(err, errlen, 0, "%s", why);
    return CLI_EUSAGE;
  }
  return (int)n;
}

/* ---- the options of a Slurm job ---- */

static int slurm_missing(const char *name, const char *job, char *err, size_t errlen) {
  return cli_usage_error(err, errlen,
                     "%s: not set, though SLURM_JOB_ID=%s is; expected meshrun started by srun on every "
                     "node of the job (srun sets it), or rendezvous flags (--rdzv_endpoint, --nnodes, "
                     "--node_rank, --master_addr, --standalone) to leave Slurm's variables alone",
                     name, job);
}

/* A numeric Slurm variable: 0 with *out set, 1 when unset or empty, else CLI_EUSAGE. */
static int slurm_int(const char *name, long lo, long hi, long *out, char *err, size_t errlen) {
  const char *v = getenv(name);
  if (!v || !*v) return 1;
  if (cli_parse_int(v, lo, hi, out) != 0)
    return cli_usage_error(err, errlen, "%s=\"%s\": not valid; expected an integer %ld..%ld", name, v, lo, hi);
  return 0;
}

static int first_host(const char *host, size_t len, void *arg) {
  memcpy(arg, host, len + 1);
  return 1;
}

int cli_apply_slurm(launcher_opts_t *o, cli_seen_t *seen, char *note, size_t notelen, char *err, size_t errlen) {
  const char *job = getenv("SLURM_JOB_ID");
  if (!job || !*job) return 0;
  if (seen->nnodes_set || seen->node_rank_set || seen->endpoint_set || seen->backend_set ||
      seen->master_addr_set || o->standalone)
    return 0;
  long jobid, nnodes, nodeid, port, nproc = 0;
  int rc;
  if (cli_parse_int(job, 0, 0xffffffffL, &jobid) != 0)
    return cli_usage_error(err, errlen, "SLURM_JOB_ID=\"%s\": not valid; expected Slurm's numeric job id", job);
  if ((rc = slurm_int("SLURM_NNODES", 1, 1 << 20, &nnodes, err, errlen)))
    return rc == 1 ? slurm_missing("SLURM_NNODES", job, err, errlen) : rc;
  if ((rc = slurm_int("SLURM_NODEID", 0, nnodes - 1, &nodeid, err, errlen)))
    return rc == 1 ? slurm_missing("SLURM_NODEID", job, err, errlen) : rc;

  /* The step's list when there is one (srun): SLURM_NODEID counts within the step, which may
   * use only some of the job's nodes. */
  const char *list_var = "SLURM_STEP_NODELIST";
  const char *list = getenv(list_var);
  if (!list || !*list) list = getenv(list_var = "SLURM_JOB_NODELIST");
  if (!list || !*list) return slurm_missing("SLURM_JOB_NODELIST", job, err, errlen);
  char host[HL_HOST_MAX], why[256];
  if (hl_walk(list, first_host, host, why, sizeof why) < 0)
    return cli_usage_error(err, errlen, "%s=\"%s\": %s; expected Slurm's hostlist syntax, e.g. node[01-04,07],login1",
                       list_var, list, why);

  const char *port_from;
  if (seen->master_port_set) {
    port = o->master_port;
    port_from = "--master_port";
  } else if ((rc = slurm_int("MESHRUN_SLURM_PORT", 1, 65535, &port, err, errlen)) == 0) {
    port_from = "MESHRUN_SLURM_PORT";
  } else if (rc == 1) {
    port = CLI_SLURM_PORT_BASE + jobid % CLI_SLURM_PORT_SPAN;
    port_from = "from the job id";
  } else {
    return rc;
  }

  /* Workers per node: SLURM_NTASKS_PER_NODE when above 1 (tasks asked for as workers, meshrun
   * itself started once per node, e.g. from the batch script), else the node's GPUs. One task
   * per node is the meshrun of `srun --ntasks-per-node=1 meshrun ...`, not its worker count. */
  const char *nproc_from = NULL;
  if (!seen->nproc_set) {
    rc = slurm_int("SLURM_NTASKS_PER_NODE", 1, CLI_MAX_LOCAL_RANKS, &nproc, err, errlen);
    if (rc < 0) return rc;
    if (rc == 0 && nproc > 1) {
      nproc_from = "SLURM_NTASKS_PER_NODE";
    } else {
      rc = slurm_int("SLURM_GPUS_ON_NODE", 0, CLI_MAX_LOCAL_RANKS, &nproc, err, errlen);
      if (rc < 0) return rc;
      if (rc == 0 && nproc > 0) nproc_from = "SLURM_GPUS_ON_NODE";
    }
  }

  o->nnodes_min = o->nnodes_max = (int)nnodes;
  o->node_rank = (int)nodeid;
  memcpy(o->rdzv_host, host, strlen(host) + 1);
  o->rdzv_port = (int)port;
  if (nproc_from) o->nproc_per_node = (int)nproc;
  if (!seen->rdzv_id_set) snprintf(o->rdzv_id, sizeof o->rdzv_id, "%s", job);
  seen->nnodes_set = seen->node_rank_set = seen->endpoint_set = 1;
  o->from_slurm = 1;
  snprintf(o->rdzv_endpoint_from, sizeof o->rdzv_endpoint_from, "Slurm's %s (port %s)", list_var, port_from);
  size_t n = (size_t)snprintf(note, notelen,
                               "options from Slurm job %s: --nnodes=%ld (SLURM_NNODES) --node_rank=%ld "
                               "(SLURM_NODEID) --rdzv_endpoint=%s:%ld (first host of %s; port %s)",
                               job, nnodes, nodeid, host, port, list_var, port_from);
  if (!seen->rdzv_id_set && n < notelen)
    n += (size_t)snprintf(note + n, notelen - n, " --rdzv_id=%s (SLURM_JOB_ID)", job);
  if (nproc_from && n < notelen)
    snprintf(note + n, notelen - n, " --nproc_per_node=%ld (%s)", nproc, nproc_from);
  return 0;
}
