// deps:
/* bench_worker: the worker of scripts/bench-launcher: records wall-clock timestamps.
 *
 *   bench_worker DIR stamp        writes DIR/start.<RANK>.<attempt> = start time (ns), exits 0
 *   bench_worker DIR failover     attempt 0: rank 0 writes DIR/fail = its exit time and exits 1,
 *                                 the others wait to be stopped; attempt >= 1: like stamp.
 * Times are CLOCK_REALTIME nanoseconds, so they compare across processes. Does nothing else:
 * no store, no sockets. */
#include <fcntl.h>
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

int main(int argc, char **argv) {
  long long t0 = now_ns();
  if (argc < 3) {
    fprintf(stderr, "usage: bench_worker DIR stamp|failover\n");
    return 2;
  }
  const char *rank = getenv("RANK"), *attempt = getenv("TORCHELASTIC_RESTART_COUNT");
  if (!rank || !attempt) {
    fprintf(stderr, "bench_worker: RANK and TORCHELASTIC_RESTART_COUNT must be set\n");
    return 2;
  }
  char path[4096];
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
