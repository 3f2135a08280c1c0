/* dirlock: one run at a time in a checkpoint directory (see dirlock.h). */
#include "trainer/run/dirlock.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"

#define LINE_MAX_LEN 1024

typedef struct {
  char host[256];
  long pid;
  char job[512];
  long long since;
} holder_t;

static struct {
  char path[4096];
  char line[LINE_MAX_LEN]; /* what this process wrote */
  int held;
  pthread_t beat;
  int beating;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stop;
} lk = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* MESHRUN_JOB_ID without spaces (the line is space-separated), or "-". */
static void my_job(char *out, size_t n) {
  const char *j = getenv("MESHRUN_JOB_ID");
  snprintf(out, n, "%s", j && *j ? j : "-");
  for (char *c = out; *c; c++)
    if (*c == ' ' || *c == '\n') *c = '_';
}

static int read_holder(const char *path, holder_t *h, char *line, size_t n) {
  FILE *f = fopen(path, "r");
  if (!f) return -errno;
  line[0] = 0;
  if (!fgets(line, (int)n, f)) line[0] = 0;
  fclose(f);
  line[strcspn(line, "\n")] = 0;
  memset(h, 0, sizeof *h);
  if (sscanf(line, "host %255s pid %ld job %511s since %lld", h->host, &h->pid, h->job, &h->since) != 4)
    return -EINVAL;
  return 0;
}

/* Writes line to path.tmp and renames it onto path. 0 or -errno. */
static int replace_file(const char *path, const char *line) {
  char tmp[4096 + 16];
  snprintf(tmp, sizeof tmp, "%s.new", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -errno;
  size_t len = strlen(line);
  int ok = write(fd, line, len) == (ssize_t)len;
  int e = errno;
  close(fd);
  if (!ok || rename(tmp, path) != 0) {
    e = ok ? errno : e;
    unlink(tmp);
    return -e;
  }
  return 0;
}

/* Whether a line read back (newline stripped) is the one this process wrote. */
static int is_mine(const char *now) {
  size_t n = strlen(now);
  return n > 0 && n + 1 == strlen(lk.line) && !strncmp(now, lk.line, n);
}

static void *beat_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&lk.mu);
  while (!lk.stop) {
    struct timespec at;
    clock_gettime(CLOCK_REALTIME, &at);
    at.tv_sec += DIRLOCK_BEAT_S;
    pthread_cond_timedwait(&lk.cv, &lk.mu, &at);
    if (!lk.stop) utimensat(AT_FDCWD, lk.path, NULL, 0); /* a file gone or replaced: nothing to keep */
  }
  pthread_mutex_unlock(&lk.mu);
  return NULL;
}

static int refuse(char *err, size_t errlen, const char *dir, const holder_t *h, const char *why) {
  char since[64] = "?";
  time_t t = (time_t)h->since;
  struct tm tm;
  if (gmtime_r(&t, &tm)) strftime(since, sizeof since, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return err_set(err, errlen, 2,
                 "plan error: checkpoint.dir: %s is in use by another run (host %s, pid %ld, job %s, since "
                 "%s%s): wait for it to end, or give this run its own checkpoint.dir",
                 dir, h->host, h->pid, h->job, since, why);
}

static int take(const char *dir, int tries, char *err, size_t errlen) {
  char host[256] = "?", job[512];
  gethostname(host, sizeof host - 1);
  for (char *c = host; *c; c++)
    if (*c == ' ') *c = '_';
  my_job(job, sizeof job);
  snprintf(lk.path, sizeof lk.path, "%s/%s", dir, DIRLOCK_NAME);
  snprintf(lk.line, sizeof lk.line, "host %s pid %ld job %s since %lld\n", host, (long)getpid(), job,
           (long long)time(NULL));
  int fd = open(lk.path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd >= 0) {
    size_t len = strlen(lk.line);
    int ok = write(fd, lk.line, len) == (ssize_t)len;
    int e = errno;
    close(fd);
    if (!ok) {
      unlink(lk.path);
      return err_set(err, errlen, 1, "checkpoint.dir: writing %s: %s", lk.path, strerror(e));
    }
  } else {
    if (errno != EEXIST) {
      return err_set(err, errlen, 1, "checkpoint.dir: creating %s: %s", lk.path, strerror(errno));
    }
    holder_t h;
    char old[LINE_MAX_LEN];
    struct stat sb;
    int rc = read_holder(lk.path, &h, old, sizeof old);
    if (rc == -ENOENT && tries > 1) return take(dir, tries - 1, err, errlen); /* released meanwhile */
    const long long age = stat(lk.path, &sb) == 0 ? (long long)(time(NULL) - sb.st_mtime) : 0;
    if (rc == 0 && strcmp(h.job, "-") && !strcmp(h.job, job)) {
      log_debug("checkpoint.dir %s: this job's lock (%s pid %ld), taken over", dir, h.host, h.pid);
    } else if (rc == 0 && !strcmp(h.host, host)) {
      if (h.pid > 0 && (kill((pid_t)h.pid, 0) == 0 || errno == EPERM))
        return refuse(err, errlen, dir, &h, "");
      log_warn("checkpoint.dir %s: taking over the lock of pid %ld on this host (job %s), which is gone", dir, h.pid,
               h.job);
    } else if (rc == 0 && age < DIRLOCK_STALE_S) {
      char why[96];
      snprintf(why, sizeof why, "; its lock was touched %llds ago, and one left for %ds is taken over", age,
               DIRLOCK_STALE_S);
      return refuse(err, errlen, dir, &h, why);
    } else if (rc == 0) {
      log_warn("checkpoint.dir %s: taking over the lock of pid %ld on %s (job %s), untouched for %llds", dir, h.pid,
               h.host, h.job, age);
    } else {
      log_warn("checkpoint.dir %s: %s is not a lock this build wrote (\"%.80s\"); taking it over", dir, lk.path, old);
    }
    if ((rc = replace_file(lk.path, lk.line)) != 0) {
      return err_set(err, errlen, 1, "checkpoint.dir: replacing %s: %s", lk.path, strerror(-rc));
    }
    char now[LINE_MAX_LEN];
    if (read_holder(lk.path, &h, now, sizeof now) != 0 || !is_mine(now))
      return refuse(err, errlen, dir, &h, "; it took the lock at the same moment");
  }
  lk.held = 1;
  lk.stop = 0;
  lk.beating = pthread_create(&lk.beat, NULL, beat_main, NULL) == 0;
  return 0;
}

int dirlock_take(const char *dir, char *err, size_t errlen) { return take(dir, 3, err, errlen); }

void dirlock_release(void) {
  if (!lk.held) return;
  if (lk.beating) {
    pthread_mutex_lock(&lk.mu);
    lk.stop = 1;
    pthread_cond_signal(&lk.cv);
    pthread_mutex_unlock(&lk.mu);
    pthread_join(lk.beat, NULL);
    lk.beating = 0;
  }
  holder_t h;
  char now[LINE_MAX_LEN];
  if (read_holder(lk.path, &h, now, sizeof now) == 0 && is_mine(now)) unlink(lk.path);
  lk.held = 0;
}
