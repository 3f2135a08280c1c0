// deps:
/* bench_worker: the worker of bench/bench_launcher: records wall-clock timestamps.
 *
 *   bench_worker DIR stamp        writes DIR/start.<RANK>.<attempt> = start time (ns), exits 0
 *   bench_worker DIR failover     attempt 0: rank 0 writes DIR/fail = its exit time and exits 1,
 *                                 the others wait to be stopped; attempt >= 1: like stamp.
 *   bench_worker DIR hold         round 0 (MESHRUN_ROUND): writes DIR/start.<RANK>.0, then waits
 *                                 for SIGTERM and writes DIR/stop.<RANK> = when it came, exits 0;
 *                                 a later round: writes DIR/start.<RANK>.<round>, exits 0.
 * Times are CLOCK_REALTIME nanoseconds, so they compare across processes. Does nothing else:
 * no store, no sockets. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int write_stamp(const char *path, long long t) {
  char tmp[4200], buf[32];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return 1;
  int n = snprintf(buf, sizeof buf, "%lld\n", t);
  if (write(fd, buf, (size_t)n) != n) return 1;
  close(fd);
  return rename(tmp, path) ? 1 : 0;
}

static volatile sig_atomic_t stopped;
static void on_term(int sig) {
  (void)sig;
  stopped = 1;
}

int main(int argc, char **argv) {
  long long t0 = now_ns();
  if (argc < 3) {
    fprintf(stderr, "usage: bench_worker DIR stamp|failover|hold\n");
    return 2;
  }
  const char *rank = getenv("RANK"), *attempt = getenv("TORCHELASTIC_RESTART_COUNT");
  if (!rank || !attempt) {
    fprintf(stderr, "bench_worker: RANK and TORCHELASTIC_RESTART_COUNT must be set\n");
    return 2;
  }
  char path[4096];
  if (!strcmp(argv[2], "hold")) {
    const char *round = getenv("MESHRUN_ROUND");
    if (!round) {
      fprintf(stderr, "bench_worker: MESHRUN_ROUND must be set\n");
      return 2;
    }
    snprintf(path, sizeof path, "%s/start.%s.%s", argv[1], rank, round);
    if (strcmp(round, "0")) return write_stamp(path, t0);
    sigset_t term, old;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    sigprocmask(SIG_BLOCK, &term, &old); /* no SIGTERM lost between the check and the wait */
    signal(SIGTERM, on_term);
    if (write_stamp(path, t0)) return 2;
    while (!stopped) sigsuspend(&old);
    snprintf(path, sizeof path, "%s/stop.%s", argv[1], rank);
    return write_stamp(path, now_ns()) ? 2 : 0;
  }
  if (!strcmp(argv[2], "failover") && !strcmp(attempt, "0")) {
    if (!strcmp(rank, "0")) {
      snprintf(path, sizeof path, "%s/fail", argv[1]);
      return write_stamp(path, now_ns()) ? 2 : 1;
    }
    for (;;) pause(); /* until the agent stops us */
  }
  snprintf(path, sizeof path, "%s/start.%s.%s", argv[1], rank, attempt);
  return write_stamp(path, t0);
}
