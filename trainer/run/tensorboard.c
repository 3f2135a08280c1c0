/* tensorboard: TensorBoard event files of the run's scalars (see tensorboard.h). */
#include "trainer/run/tensorboard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "common/net.h"
#include "trainer/formats/ckpt.h"
/* generated from trainer/run/tensorboard.proto into the build folder by protoc-c (Makefile) */
#include "trainer/run/tensorboard.pb-c.h"

#define EVENTS_PREFIX "events.out.tfevents."
#define FILE_VERSION "brain.Event:2" /* 2: TensorBoard's reader honours SessionLog START */

/* what failed, for the messages: a step's event, or these */
enum { AT_OPEN = -1, AT_CLOSE = -2 };

struct tensorboard {
  int fd;
  char *path;
  int err;       /* errno of the first failed write; 0 while every write succeeded */
  int err_at;    /* its step, or AT_OPEN / AT_CLOSE */
  int n;         /* values added since the last write */
  int dropped;   /* a value found the event full (warned once) */
  const char *tags[TENSORBOARD_MAX_VALUES];
  float values[TENSORBOARD_MAX_VALUES];
  uint8_t *buf;  /* one framed record */
  size_t cap;
};

uint32_t tensorboard_masked_crc(const void *data, size_t n) {
  const uint32_t crc = ckpt_crc32c(0, data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void what_failed(const tensorboard_t *tb, char *buf, size_t len) {
  if (tb->err_at >= 0) snprintf(buf, len, "the event of step %d", tb->err_at);
  else snprintf(buf, len, "%s", tb->err_at == AT_OPEN ? "the file's first records" : "the close");
}

static void failed(tensorboard_t *tb, int e, int at) {
  tb->err = e ? e : EIO;
  tb->err_at = at;
  if (at == AT_OPEN) return; /* tensorboard_open reports it */
  char what[48];
  what_failed(tb, what, sizeof what);
  log_warn("log.tensorboard_dir %s: writing %s failed: %s; no more events are written, and the run will exit 1 "
           "when it ends", tb->path, what, strerror(tb->err));
}

static void put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ev as one record: length, its masked CRC, the message, its masked CRC; one write(2). */
static void put_event(tensorboard_t *tb, const Tb__Event *ev, int at) {
  if (tb->err) return;
  const size_t n = tb__event__get_packed_size(ev), need = n + 16;
  if (need > tb->cap) {
    uint8_t *b = realloc(tb->buf, need);
    if (!b) {
      failed(tb, ENOMEM, at);
      return;
    }
    tb->buf = b;
    tb->cap = need;
  }
  uint8_t *r = tb->buf;
  put_le(r, n, 8);
  put_le(r + 8, tensorboard_masked_crc(r, 8), 4);
  tb__event__pack(ev, r + 12);
  put_le(r + 12 + n, tensorboard_masked_crc(r + 12, n), 4);
  for (size_t done = 0; done < need;) {
    ssize_t w = write(tb->fd, r + done, need - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      failed(tb, w < 0 ? errno : EIO, at);
      return;
    }
    done += (size_t)w;
  }
}

/* The event files in dir (any name with "tfevents", as TensorBoard takes them): how many, the
 * largest <seconds> of ours (-1 when none), and the name of one, the newest, in name. */
static int scan_events(const char *dir, long long *newest, char *name, size_t namelen) {
  *newest = -1;
  if (name && namelen) name[0] = 0;
  DIR *d = opendir(dir);
  if (!d) return 0;
  int count = 0;
  char best[256] = "";
  for (struct dirent *e; (e = readdir(d));) {
    if (!strstr(e->d_name, "tfevents")) continue;
    count++;
    if (strcmp(e->d_name, best) > 0) snprintf(best, sizeof best, "%s", e->d_name);
    if (strncmp(e->d_name, EVENTS_PREFIX, strlen(EVENTS_PREFIX))) continue;
    const char *digits = e->d_name + strlen(EVENTS_PREFIX);
    char *end;
    long long s = strtoll(digits, &end, 10);
    if (end != digits && s > *newest) *newest = s;
  }
  closedir(d);
  if (name && namelen) snprintf(name, namelen, "%s", best);
  return count;
}

int tensorboard_check_fresh(const char *dir, char *err, size_t errlen) {
  long long newest;
  char name[256];
  if (!scan_events(dir, &newest, name, sizeof name)) return 0;
  return err_set(err, errlen, -1, "plan error: log.tensorboard_dir: %s holds an earlier run's events (%s) and this "
                 "run starts at step 1: move them away, write elsewhere, or --set overwrite=true to add this run's "
                 "file there (TensorBoard then shows its steps in place of theirs)", dir, name);
}

int tensorboard_open(tensorboard_t **out, const char *dir, int first_step, char *err, size_t errlen) {
  *out = NULL;
  tensorboard_t *tb = calloc(1, sizeof *tb);
  if (!tb) return err_set(err, errlen, -1, "out of memory for log.tensorboard_dir");
  tb->fd = -1;
  /* After every file there in name order: TensorBoard reads them in that order. */
  long long newest;
  scan_events(dir, &newest, NULL, 0);
  const double now = wall_now();
  long long secs = (long long)now;
  if (secs <= newest) secs = newest + 1;
  char host[256];
  net_hostname(host, sizeof host);
  if (asprintf(&tb->path, "%s/" EVENTS_PREFIX "%010lld.%s.%d", dir, secs, host, (int)getpid()) < 0) {
    tb->path = NULL;
    tensorboard_close(tb, NULL, NULL, 0);
    return err_set(err, errlen, -1, "out of memory for log.tensorboard_dir");
  }
  tb->fd = open(tb->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  if (tb->fd < 0) {
    err_set(err, errlen, -1, "cannot create log.tensorboard_dir's event file %s: %s", tb->path, strerror(errno));
    tensorboard_close(tb, NULL, NULL, 0);
    return -1;
  }
  Tb__Event ev = TB__EVENT__INIT;
  ev.wall_time = now;
  ev.what_case = TB__EVENT__WHAT_FILE_VERSION;
  ev.file_version = (char *)FILE_VERSION;
  put_event(tb, &ev, AT_OPEN);
  Tb__SessionLog start = TB__SESSION_LOG__INIT;
  start.status = TB__SESSION_LOG__STATUS__START;
  ev.step = first_step;
  ev.what_case = TB__EVENT__WHAT_SESSION_LOG;
  ev.session_log = &start;
  put_event(tb, &ev, AT_OPEN);
  if (tb->err) {
    err_set(err, errlen, -1, "cannot write log.tensorboard_dir's event file %s: %s", tb->path, strerror(tb->err));
    tensorboard_close(tb, NULL, NULL, 0);
    return -1;
  }
  *out = tb;
  return 0;
}

void tensorboard_add(tensorboard_t *tb, const char *tag, double value) {
  if (!tb) return;
  if (tb->n == TENSORBOARD_MAX_VALUES) {
    if (!tb->dropped)
      log_warn("log.tensorboard_dir: an event holds at most %d values; %s and any further are not written",
               TENSORBOARD_MAX_VALUES, tag);
    tb->dropped = 1;
    return;
  }
  tb->tags[tb->n] = tag;
  tb->values[tb->n++] = (float)value;
}

void tensorboard_write(tensorboard_t *tb, int step) {
  if (!tb || !tb->n) return;
  Tb__Summary__Value v[TENSORBOARD_MAX_VALUES], *pv[TENSORBOARD_MAX_VALUES];
  for (int i = 0; i < tb->n; i++) {
    tb__summary__value__init(&v[i]);
    v[i].tag = (char *)tb->tags[i];
    v[i].value_case = TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
    v[i].simple_value = tb->values[i];
    pv[i] = &v[i];
  }
  Tb__Summary sum = TB__SUMMARY__INIT;
  sum.n_value = (size_t)tb->n;
  sum.value = pv;
  Tb__Event ev = TB__EVENT__INIT;
  ev.wall_time = wall_now();
  ev.step = step;
  ev.what_case = TB__EVENT__WHAT_SUMMARY;
  ev.summary = &sum;
  put_event(tb, &ev, step);
  tb->n = 0;
}

int tensorboard_close(tensorboard_t *tb, int *no_space, char *err, size_t errlen) {
  if (!tb) return 0;
  if (tb->fd >= 0 && close(tb->fd) != 0 && !tb->err) failed(tb, errno, AT_CLOSE);
  int rc = 0;
  if (tb->err) {
    char what[48];
    what_failed(tb, what, sizeof what);
    rc = err_set(err, errlen, -1, "log.tensorboard_dir %s: %s failed: %s (the events from there on are lost)",
                 tb->path, what, strerror(tb->err));
    if (no_space && (tb->err == ENOSPC || tb->err == EDQUOT)) *no_space = 1;
  }
  free(tb->path);
  free(tb->buf);
  free(tb);
  return rc;
}
