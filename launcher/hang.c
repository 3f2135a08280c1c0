/* hang: the hang watch (see hang.h). One timer drives it: every HANG_POLL_MS while watching
 * (reading a few bytes per worker), every ASK_POLL_MS while waiting for dumps. A dump is known
 * by its file: the recorder writes <name>.tmp and renames it whole, so a file named
 * flight-rank<R>-pid<P>-<n>.jsonl with n above the highest seen before the request is this
 * request's answer. */
#include "launcher/hang.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dump.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/net.h"
#include "launcher/hang_share.h"
#include "launcher/diagnose.h"

#define ASK_POLL_MS 20
#define REPORT_MAX 8192

/* SENT: a node other than 0 published its digests and waits for the round's end; GATHERING:
 * node 0 waits for the other nodes' digests. */
enum { IDLE = 0, WATCHING, ASKING, SENT, GATHERING };

typedef struct {
  long long step;  /* the last step read, valid when reports */
  int reports;
  int asked, answered;
  unsigned before; /* the highest dump number of this process before the request */
  char dir[PATH_MAX];
  char dump[PATH_MAX + 320];
} watched_t;

struct hang {
  uv_loop_t *loop;
  uv_timer_t timer;
  double timeout_s;
  hang_cb cb;
  void *arg;
  workers_t *wk;
  int phase, n;
  watched_t *w;
  uint64_t last_change, ask_deadline, gather_deadline; /* uv_now, ms */
  hang_share_t *share; /* a job of several nodes, else NULL */
  int node, nnodes;    /* this node's group rank and the round's nodes (1: alone) */
  uint64_t counter;    /* the job's progress counter as last seen */
};

hang_t *hang_create(uv_loop_t *loop, double timeout_s, hang_cb cb, void *arg) {
  hang_t *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  h->loop = loop;
  h->timeout_s = timeout_s;
  h->cb = cb;
  h->arg = arg;
  uv_timer_init(loop, &h->timer);
  h->timer.data = h;
  return h;
}

static void on_tick(uv_timer_t *t);

void hang_watch(hang_t *h, workers_t *wk, const hang_share_config_t *job) {
  if (!h) return;
  hang_share_stop(h->share);
  h->share = NULL;
  h->node = 0;
  h->nnodes = 1;
  h->counter = 0;
  if (job && job->nnodes > 1 && (h->share = hang_share_start(job))) {
    h->node = job->node;
    h->nnodes = job->nnodes;
  }
  free(h->w);
  h->n = workers_count(wk);
  h->w = calloc((size_t)h->n, sizeof *h->w);
  if (!h->w) {
    log_warn("--hang_timeout: out of memory; this round is not watched");
    h->phase = IDLE;
    return;
  }
  h->wk = wk;
  h->phase = WATCHING;
  uv_update_time(h->loop);
  h->last_change = uv_now(h->loop);
  uint64_t poll = (uint64_t)(h->timeout_s * 1000 / 4);
  poll = poll < 1 ? 1 : poll > HANG_POLL_MS ? HANG_POLL_MS : poll;
  uv_timer_start(&h->timer, on_tick, poll, poll);
}

void hang_unwatch(hang_t *h) {
  if (!h) return;
  h->phase = IDLE;
  uv_timer_stop(&h->timer);
  hang_share_stop(h->share);
  h->share = NULL;
}

static void on_closed(uv_handle_t *hd) {
  hang_t *h = hd->data;
  hang_share_stop(h->share);
  free(h->w);
  free(h);
}

void hang_close(hang_t *h) {
  if (h) uv_close((uv_handle_t *)&h->timer, on_closed);
}

/* The step in a progress file, -1 when there is none (yet). */
static long long read_step(const workers_info_t *info) {
  char path[PATH_MAX], *b = NULL, *end;
  size_t len;
  if (workers_progress_file(info, path, sizeof path) || fs_read_file(path, 64, &b, &len, NULL)) return -1;
  long long v = strtoll(b, &end, 10);
  if (end == b) v = -1;
  free(b);
  return v;
}

/* The state letter of /proc/<pid>/stat (after the command's closing parenthesis), 0 when
 * unreadable. */
static char proc_state(int pid) {
  char path[64], *b = NULL, st = 0;
  size_t len;
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  if (fs_read_file(path, 4096, &b, &len, NULL)) return 0;
  char *rp = strrchr(b, ')');
  if (rp && rp[1] == ' ') st = rp[2];
  free(b);
  return st;
}

/* The highest n of dir's flight-rank<rank>-pid<pid>-<n>.jsonl (0: none), its path into path. */
static unsigned newest_dump(const char *dir, int rank, int pid, char *path, size_t len) {
  char prefix[64];
  int pl = snprintf(prefix, sizeof prefix, "flight-rank%d-pid%d-", rank, pid);
  unsigned best = 0;
  DIR *d = opendir(dir);
  for (struct dirent *e; d && (e = readdir(d));) {
    if (strncmp(e->d_name, prefix, (size_t)pl)) continue;
    char *end;
    unsigned long v = strtoul(e->d_name + pl, &end, 10);
    if (end == e->d_name + pl || strcmp(end, ".jsonl") || v <= best) continue;
    best = (unsigned)v;
    if (path) snprintf(path, len, "%.*s/%.255s", PATH_MAX - 2, dir, e->d_name);
  }
  if (d) closedir(d);
  return best;
}

static void ask(hang_t *h) {
  if (!h->share)
    log_warn("--hang_timeout: no rank has finished a step for %gs while every worker runs; asking them for dumps",
             h->timeout_s);
  else if (h->node == 0)
    log_warn("--hang_timeout: no rank of the job's %d nodes has finished a step for %gs while every worker runs; "
             "asking every node's ranks for dumps", h->nnodes, h->timeout_s);
  else
    log_warn("--hang_timeout: node 0 found no step of the job for %gs; asking this node's ranks for dumps",
             h->timeout_s);
  for (int i = 0; i < h->n; i++) {
    watched_t *w = &h->w[i];
    const workers_info_t *info = workers_info(h->wk, i);
    if (!w->reports || !info->running) continue;
    dump_folder(info->error_file, w->dir, sizeof w->dir);
    char st = proc_state(info->pid);
    if (st == 'T' || st == 't') continue; /* stopped: it cannot answer, and its silence is the clue */
    w->before = newest_dump(w->dir, info->rank, info->pid, NULL, 0);
    if (kill(info->pid, dump_signal()) == 0) w->asked = 1;
  }
  h->phase = ASKING;
  h->ask_deadline = uv_now(h->loop) + HANG_DUMP_WAIT_MS;
  uv_timer_start(&h->timer, on_tick, ASK_POLL_MS, ASK_POLL_MS);
}

/* The folder that holds every asked worker's dump folder (<attempt>/<rank>: the attempt's). */
static void common_dir(const hang_t *h, char *out, size_t len) {
  out[0] = 0;
  size_t k = 0;
  for (int i = 0; i < h->n; i++) {
    const char *d = h->w[i].dir;
    if (!h->w[i].reports) continue;
    if (!out[0]) {
      snprintf(out, len, "%s", d);
      k = strlen(out);
      continue;
    }
    size_t j = 0;
    while (j < k && out[j] == d[j]) j++;
    if (j < k) { /* differs inside: back to the last '/' of the common part */
      while (j > 0 && out[j - 1] != '/') j--;
      k = j > 1 ? j - 1 : j;
      out[k] = 0;
    } else if (d[j] && d[j] != '/') {
      while (k > 0 && out[k - 1] != '/') k--;
      k = k > 1 ? k - 1 : k;
      out[k] = 0;
    }
  }
}

/* This node's ranks as the diagnosis reads them, into r (h->n at most): each dump that came,
 * a stub (also written as a file) for each rank that did not answer. Returns how many. */
static int local_ranks(hang_t *h, diag_rank_t *r) {
  char host[128] = "", err[512];
  net_hostname(host, sizeof host);
  int k = 0;
  for (int i = 0; i < h->n; i++) {
    watched_t *w = &h->w[i];
    const workers_info_t *info = workers_info(h->wk, i);
    if (!w->reports) continue;
    if (!w->answered || diag_parse_file(w->dump, &r[k], err, sizeof err)) {
      if (w->answered) log_warn("%s", err);
      diag_stub(&r[k], info->rank, info->pid, host, proc_state(info->pid));
      r[k].local_rank = info->local_rank;
      if (h->share) r[k].node = h->node;
      int rc = diag_write_stub(w->dir, &r[k]);
      if (rc) log_warn("cannot write rank %d's stub dump in %s: %s", info->rank, w->dir, strerror(-rc));
    }
    r[k].local_rank = info->local_rank;
    if (h->share) r[k].node = h->node;
    k++;
  }
  return k;
}

/* The other nodes' digests (text, one after the other) appended to *r (*n of *cap), each also
 * written into where/<rank>/ as flight-rank<R>-pid<P>-node<N>.jsonl. */
static void remote_ranks(const char *where, const char *text, diag_rank_t **r, int *n, int *cap) {
  static const char mark[] = "\n{\"type\":\"header\"";
  char err[256], dir[PATH_MAX + 16], tag[32];
  for (const char *p = text; *p;) {
    const char *start = p, *next = strstr(p, mark);
    size_t len = next ? (size_t)(next - p) + 1 : strlen(p);
    p += len;
    if (*n == *cap) {
      diag_rank_t *g = realloc(*r, (size_t)*cap * 2 * sizeof *g);
      if (!g) return;
      *r = g;
      *cap *= 2;
    }
    diag_rank_t *d = &(*r)[*n];
    if (diag_parse(start, len, d, err, sizeof err)) continue;
    (*n)++;
    snprintf(dir, sizeof dir, "%.4000s/%d", where, d->rank);
    snprintf(tag, sizeof tag, "node%d", d->node);
    int rc = fs_mkdir_p(dir, NULL, 0);
    if (!rc) rc = diag_write(dir, d, tag);
    if (rc) log_warn("cannot write rank %d's dump (from node %d) in %s: %s", d->rank, d->node, dir, strerror(-rc));
  }
}

/* The diagnosis of ranks r[0..k), logged, then the agent's turn. */
static void report(hang_t *h, const diag_rank_t *r, int k, const char *where) {
  char *text = malloc(REPORT_MAX);
  int named = -1;
  if (r && text) diag_report(r, k, text, REPORT_MAX, &named);
  else if (text) snprintf(text, REPORT_MAX, "hang: out of memory for the diagnosis\n");
  for (char *line = text, *nl; line && *line; line = nl + 1) {
    nl = strchr(line, '\n');
    if (!nl) break;
    *nl = 0;
    log_error("%s", line);
  }
  log_error("  dumps: %s (meshrun diagnose DIR prints this again)", where);
  hang_unwatch(h);
  const diag_rank_t *who = NULL;
  for (int i = 0; i < k && named >= 0 && !who; i++)
    if (r[i].rank == named) who = &r[i];
  h->cb(h, text ? text : "hang: out of memory", who, h->arg);
  free(text);
}

/* The dumps in (or the wait over): alone or on node 0, the diagnosis of every rank whose
 * dumps are in; on another node, its digests for node 0. */
static void diagnose(hang_t *h) {
  int cap = h->n > 0 ? 2 * h->n : 2, k;
  diag_rank_t *r = calloc((size_t)cap, sizeof *r);
  char where[PATH_MAX];
  common_dir(h, where, sizeof where);
  k = r ? local_ranks(h, r) : 0;
  if (h->share && h->node != 0) {
    char *all = NULL, *t;
    size_t len = 0, tl;
    for (int i = 0; i < k; i++) {
      if (diag_format(&r[i], &t, &tl)) continue;
      char *g = realloc(all, len + tl + 1);
      if (g) memcpy(g + len, t, tl), len += tl, g[len] = 0, all = g;
      free(t);
    }
    if (all) hang_share_publish(h->share, all, len);
    log_warn("--hang_timeout: this node's %d dump%s went to node 0, which prints the diagnosis; dumps: %s", k,
             k == 1 ? "" : "s", where);
    free(all);
    free(r);
    h->phase = SENT;
    uv_timer_stop(&h->timer);
    return;
  }
  if (h->share) {
    char *text = NULL;
    size_t len;
    int got = hang_share_gathered(h->share, &text, &len);
    if (got < h->nnodes - 1)
      log_warn("--hang_timeout: %d of the other %d nodes sent their dumps in time", got, h->nnodes - 1);
    if (r && text) remote_ranks(where, text, &r, &k, &cap);
    free(text);
  }
  report(h, r, k, where);
  free(r);
}

static void tick_asking(hang_t *h) {
  int waiting = 0;
  for (int i = 0; i < h->n; i++) {
    watched_t *w = &h->w[i];
    if (!w->asked || w->answered) continue;
    const workers_info_t *info = workers_info(h->wk, i);
    if (newest_dump(w->dir, info->rank, info->pid, w->dump, sizeof w->dump) > w->before) w->answered = 1;
    else waiting++;
  }
  if (waiting && uv_now(h->loop) < h->ask_deadline) return;
  if (h->share && h->node == 0) { /* the other nodes' digests next */
    hang_share_gather(h->share);
    h->phase = GATHERING;
    return;
  }
  diagnose(h);
}

static void tick_gathering(hang_t *h) {
  char *text = NULL;
  size_t len;
  int got = hang_share_gathered(h->share, &text, &len);
  free(text);
  if (got >= h->nnodes - 1 || uv_now(h->loop) >= h->gather_deadline) diagnose(h);
}

static void tick_watching(hang_t *h) {
  if (workers_running(h->wk) != h->n) return; /* an exit is the agent's to handle */
  const uint64_t now = uv_now(h->loop);
  int any = 0;
  uint64_t changed = 0;
  for (int i = 0; i < h->n; i++) {
    watched_t *w = &h->w[i];
    long long s = read_step(workers_info(h->wk, i));
    if (s < 0) continue;
    if (!w->reports || s != w->step) h->last_change = now, changed++;
    w->reports = 1;
    w->step = s;
    any = 1;
  }
  if (h->share) { /* the job's view: node 0 judges it, every node answers its ask */
    if (changed) hang_share_progress(h->share, changed);
    uint64_t c = hang_share_counter(h->share);
    if (c != h->counter) h->counter = c, h->last_change = now;
    if (h->node != 0) {
      if (hang_share_asked(h->share)) ask(h);
      return;
    }
  }
  if (any && (double)(now - h->last_change) >= h->timeout_s * 1000) {
    if (h->share) {
      hang_share_ask(h->share);
      h->gather_deadline = now + HANG_GATHER_WAIT_MS;
    }
    ask(h);
  }
}

static void on_tick(uv_timer_t *t) {
  hang_t *h = t->data;
  if (h->phase == WATCHING) tick_watching(h);
  else if (h->phase == ASKING) tick_asking(h);
  else if (h->phase == GATHERING) tick_gathering(h);
}
