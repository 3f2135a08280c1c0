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
#include "launcher/diagnose.h"

#define ASK_POLL_MS 20
#define REPORT_MAX 8192

enum { IDLE = 0, WATCHING, ASKING };

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
  uint64_t last_change, ask_deadline; /* uv_now, ms */
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

void hang_watch(hang_t *h, workers_t *wk) {
  if (!h) return;
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
}

static void on_closed(uv_handle_t *hd) {
  hang_t *h = hd->data;
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
  log_warn("--hang_timeout: no rank has finished a step for %gs while every worker runs; asking them for dumps",
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

/* The dumps in (or the wait over): the diagnosis, logged, then the agent's turn. */
static void diagnose(hang_t *h) {
  diag_rank_t *r = calloc((size_t)h->n, sizeof *r);
  char host[128] = "", err[512];
  net_hostname(host, sizeof host);
  int k = 0;
  for (int i = 0; r && i < h->n; i++) {
    watched_t *w = &h->w[i];
    const workers_info_t *info = workers_info(h->wk, i);
    if (!w->reports) continue;
    if (w->answered && diag_parse_file(w->dump, &r[k], err, sizeof err) == 0) {
      k++;
      continue;
    }
    if (w->answered) log_warn("%s", err);
    diag_stub(&r[k], info->rank, info->pid, host, proc_state(info->pid));
    int rc = diag_write_stub(w->dir, &r[k]);
    if (rc) log_warn("cannot write rank %d's stub dump in %s: %s", info->rank, w->dir, strerror(-rc));
    k++;
  }
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
  char where[PATH_MAX];
  common_dir(h, where, sizeof where);
  log_error("  dumps: %s (meshrun diagnose DIR prints this again)", where);
  hang_unwatch(h);
  h->cb(h, text ? text : "hang: out of memory", named, h->arg);
  free(text);
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
  if (!waiting || uv_now(h->loop) >= h->ask_deadline) diagnose(h);
}

static void tick_watching(hang_t *h) {
  if (workers_running(h->wk) != h->n) return; /* an exit is the agent's to handle */
  const uint64_t now = uv_now(h->loop);
  int any = 0;
  for (int i = 0; i < h->n; i++) {
    watched_t *w = &h->w[i];
    long long s = read_step(workers_info(h->wk, i));
    if (s < 0) continue;
    if (!w->reports || s != w->step) h->last_change = now;
    w->reports = 1;
    w->step = s;
    any = 1;
  }
  if (any && (double)(now - h->last_change) >= h->timeout_s * 1000) ask(h);
}

static void on_tick(uv_timer_t *t) {
  hang_t *h = t->data;
  if (h->phase == WATCHING) tick_watching(h);
  else if (h->phase == ASKING) tick_asking(h);
}
