// deps: test/support/fixture.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c trainer/backend/fatal.c
/* comm_bench: bandwidth of the collectives, printed as nccl-tests' fixed-width table.
 *
 *   comm_bench [-n RANKS] [-b MIN] [-e MAX] [-f FACTOR] [-o OP|all] [-w WARMUP] [-i ITERS]
 *
 * Sizes take K/M/G suffixes (powers of 2) and are bytes of the whole buffer as in nccl-tests:
 * all_reduce and broadcast move a buffer of that size, all_gather's output and reduce_scatter's
 * input have that size. time is the slowest rank's mean over ITERS; algbw = size / time;
 * busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter), x 1
 * (broadcast): the bandwidth each link sustained, comparable across rank counts. #wrong counts
 * elements that differ from the exact expectation in one extra checked call (integer data).
 * The reference line is memcpy bandwidth of the largest size on this machine, same run.
 *
 * -R ROUNDS: the flight recorder's cost instead (comm.h): all_reduce at each size, ITERS calls
 * with the recorder off then on (then on, off: the order alternates), ROUNDS times; the table
 * gives each side's median per call (the slowest rank's), their ratio and the difference per
 * call, the recorder's cost beside the collective it records. Below the collective's noise that
 * difference says little, so a last line times the recorder alone: ITERS x ROUNDS calls' records
 * (issue, start, end through comm_impl.h, as the dispatch makes them), ns per call.
 *
 * Under meshrun (MESHRUN_STORE, RANK and WORLD_SIZE set) each worker is one rank. Alone it
 * starts a store on loopback in a thread and forks RANKS local ranks. It does not pin cores or
 * measure latency percentiles. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/store.h"
#include "test/support/fixture.h"
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h" /* -R: the recorder's own calls, timed alone */

typedef enum { OP_ALL_REDUCE = 0, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_BROADCAST, OP_COUNT } bench_op_t;
static const char *const op_names[OP_COUNT] = {"all_reduce", "all_gather", "reduce_scatter",
                                               "broadcast"};

typedef struct {
  int nranks;
  size_t min_bytes, max_bytes;
  double factor;
  int op; /* -1: all */
  int warmup, iters;
  int rounds; /* -R: recorder off/on rounds; 0: the bandwidth table */
} opts_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int parse_size(const char *s, size_t *out) {
  char *end;
  double v = strtod(s, &end);
  double mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1024.0, end++;
  else if (*end == 'M' || *end == 'm') mul = 1048576.0, end++;
  else if (*end == 'G' || *end == 'g') mul = 1073741824.0, end++;
  if (*end || v < 0) return -1;
  *out = (size_t)(v * mul);
  return 0;
}

static float val(int rank, size_t i) { return (float)((int)((i * 31 + (size_t)rank * 17) % 23) - 11); }

/* Elements per rank (count column) and buffer sizes for one op at `bytes`. */
static size_t op_count(bench_op_t op, size_t bytes, int n) {
  size_t total = bytes / sizeof(float);
  return (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER) ? total / (size_t)n : total;
}

static double bus_factor(bench_op_t op, int n) {
  if (op == OP_ALL_REDUCE) return 2.0 * (n - 1) / n;
  if (op == OP_BROADCAST) return 1.0;
  return (double)(n - 1) / n;
}

static int run_op(comm_t *c, bench_op_t op, float *a, float *b, size_t count) {
  switch (op) {
  case OP_ALL_REDUCE: return comm_all_reduce(c, a, count, DT_F32, COMM_SUM);
  case OP_ALL_GATHER:
    return comm_all_gather(c, a + (size_t)comm_rank(c) * count, a, count, DT_F32);
  case OP_REDUCE_SCATTER: return comm_reduce_scatter(c, a, b, count, DT_F32, COMM_SUM);
  default: return comm_broadcast(c, a, count, DT_F32, 0);
  }
}

/* Fills inputs with integer data, runs op once and counts wrong elements on this rank. */
static long check_op(comm_t *c, bench_op_t op, float *a, float *b, size_t count, int *rc) {
  int n = comm_size(c), r = comm_rank(c);
  size_t total = (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER) ? count * (size_t)n : count;
  for (size_t i = 0; i < total; i++) a[i] = op == OP_ALL_GATHER ? val(r, i % count) : val(r, i);
  *rc = run_op(c, op, a, b, count);
  if (*rc) return -1;
  long wrong = 0;
  for (size_t i = 0; i < (op == OP_REDUCE_SCATTER ? count : total); i++) {
    float want = 0;
    if (op == OP_ALL_REDUCE || op == OP_REDUCE_SCATTER) {
      size_t gi = op == OP_REDUCE_SCATTER ? (size_t)r * count + i : i;
      for (int q = 0; q < n; q++) want += val(q, gi);
    } else if (op == OP_ALL_GATHER) {
      want = val((int)(i / count), i % count);
    } else {
      want = val(0, i);
    }
    float got = op == OP_REDUCE_SCATTER ? b[i] : a[i];
    if (got != want) wrong++;
  }
  return wrong;
}

static double memcpy_gbps(size_t bytes) {
  char *x = malloc(bytes), *y = malloc(bytes);
  if (!x || !y) {
    free(x);
    free(y);
    return 0;
  }
  memset(x, 1, bytes);
  memset(y, 2, bytes);
  double best = 1e30;
  for (int k = 0; k < 5; k++) {
    double t0 = now_s();
    memcpy(y, x, bytes);
    double dt = now_s() - t0;
    if (dt < best) best = dt;
  }
  double gbps = bytes / best / 1e9 + (y[bytes / 2] == 3 ? 1 : 0); /* keeps the copy */
  free(x);
  free(y);
  return gbps;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return a < b ? -1 : a > b;
}

/* ITERS all_reduces of count floats with the recorder of records entries: the slowest rank's
 * microseconds per call, or a negative value on a failure. */
static double recorder_phase(comm_t *c, float *a, size_t count, int records, const opts_t *o) {
  char err[256];
  if (comm_flight_setup(records, err, sizeof err)) return fprintf(stderr, "comm_bench: %s\n", err), -1;
  int rc = comm_barrier(c);
  double t0 = now_s();
  for (int k = 0; k < o->iters && !rc; k++) rc = comm_all_reduce(c, a, count, DT_F32, COMM_SUM);
  float us = (float)((now_s() - t0) / o->iters * 1e6);
  if (!rc) rc = comm_all_reduce(c, &us, 1, DT_F32, COMM_MAX);
  return rc ? -1 : us;
}

/* -R: the recorder off and on at each size, side by side (see the top). */
static int bench_recorder(comm_t *c, int rank, float *a, const opts_t *o) {
  if (rank == 0) {
    printf("#\n# flight recorder: all_reduce, %d rounds of %d calls with it off and on (%d records)\n",
           o->rounds, o->iters, COMM_FLIGHT_DEFAULT);
    printf("# %10s %12s %10s %10s %8s %10s\n", "size", "count", "off", "on", "on/off", "on-off");
    printf("# %10s %12s %10s %10s %8s %10s\n", "(B)", "(elements)", "(us)", "(us)", "", "(ns/call)");
  }
  double *off = calloc((size_t)o->rounds, sizeof *off), *on = calloc((size_t)o->rounds, sizeof *on);
  int rc = !off || !on;
  for (size_t bytes = o->min_bytes; bytes <= o->max_bytes && !rc;) {
    size_t count = bytes / sizeof(float) ? bytes / sizeof(float) : 1;
    memset(a, 0, count * sizeof(float));
    for (int k = 0; k < o->warmup && !rc; k++) rc = comm_all_reduce(c, a, count, DT_F32, COMM_SUM);
    for (int r = 0; r < o->rounds && !rc; r++) {
      int first_on = r & 1; /* off, on; on, off; ... so that a drift of the machine cancels */
      double x = recorder_phase(c, a, count, first_on ? COMM_FLIGHT_DEFAULT : 0, o);
      double y = x < 0 ? -1 : recorder_phase(c, a, count, first_on ? 0 : COMM_FLIGHT_DEFAULT, o);
      off[r] = first_on ? y : x;
      on[r] = first_on ? x : y;
      rc = x < 0 || y < 0;
    }
    if (rc) break;
    qsort(off, (size_t)o->rounds, sizeof *off, cmp_double);
    qsort(on, (size_t)o->rounds, sizeof *on, cmp_double);
    double m0 = off[o->rounds / 2], m1 = on[o->rounds / 2];
    if (rank == 0) {
      printf("  %10zu %12zu %10.2f %10.2f %8.4f %10.0f\n", count * sizeof(float), count, m0, m1, m1 / m0,
             (m1 - m0) * 1e3);
      fflush(stdout);
    }
    size_t next = (size_t)(bytes * o->factor);
    bytes = next > bytes ? next : bytes + 1;
  }
  /* the recorder alone: what the dispatch adds to each call, without the call */
  char err[256];
  const long calls = (long)o->iters * o->rounds;
  comm_call_t k = {.kind = COMM_CALL_ALL_REDUCE, .out = a, .count = 1, .dtype = DT_F32, .op = COMM_SUM};
  if (!rc && !(rc = comm_flight_setup(COMM_FLIGHT_DEFAULT, err, sizeof err))) {
    double t0 = now_s();
    for (long i = 0; i < calls; i++) {
      uint64_t t = comm_flight_issue(c, &k);
      comm_flight_start(t);
      comm_flight_end(c, t, COMM_OK);
    }
    double ns = (now_s() - t0) / (double)calls * 1e9;
    if (rank == 0) printf("# recorder alone: %ld records of %d, %.1f ns per call\n", calls, COMM_FLIGHT_DEFAULT, ns);
  } else if (!rc) {
    fprintf(stderr, "comm_bench: %s\n", err);
  }
  if (rc) fprintf(stderr, "comm_bench rank %d: %s\n", rank, comm_errmsg(c));
  free(off);
  free(on);
  return rc;
}

static int bench_rank(int rank, int n, store_t *st, int generation, const char *host,
                      const opts_t *o) {
  char err[COMM_ERR_MAX] = "";
  comm_t *c = NULL;
  comm_config_t cfg = {.name = "bench", .rank = rank, .size = n, .generation = generation,
                       .store = st, .host = host, .timeout_ms = 60000};
  if (comm_create(&c, "cpu", &cfg, err, sizeof err)) {
    fprintf(stderr, "comm_bench rank %d: %s\n", rank, err);
    return 1;
  }
  size_t maxel = o->max_bytes / sizeof(float) + (size_t)n;
  float *a = calloc(maxel, sizeof(float)), *b = calloc(maxel, sizeof(float));
  if (!a || !b) {
    fprintf(stderr, "comm_bench rank %d: out of memory for %zu bytes\n", rank, 2 * maxel * 4);
    return 1;
  }
  if (rank == 0) {
    printf("# comm_bench: %d ranks, cpu backend (TCP rings), warmup %d, iters %d\n", n, o->warmup,
           o->iters);
    printf("# reference: memcpy of %zu B on one core: %.2f GB/s\n", o->max_bytes,
           memcpy_gbps(o->max_bytes));
  }
  int rc = o->rounds ? bench_recorder(c, rank, a, o) : 0;
  for (int op = 0; op < OP_COUNT && !rc && !o->rounds; op++) {
    if (o->op >= 0 && o->op != op) continue;
    if (rank == 0) {
      printf("#\n# %s\n", op_names[op]);
      printf("# %10s %12s %6s %6s %5s %10s %7s %7s %7s\n", "size", "count", "type", "redop",
             "root", "time", "algbw", "busbw", "#wrong");
      printf("# %10s %12s %6s %6s %5s %10s %7s %7s %7s\n", "(B)", "(elements)", "", "", "", "(us)",
             "(GB/s)", "(GB/s)", "");
    }
    for (size_t bytes = o->min_bytes; bytes <= o->max_bytes && !rc;) {
      size_t count = op_count(op, bytes, n);
      size_t real = (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER) ? count * (size_t)n * 4 : count * 4;
      memset(a, 0, maxel * sizeof(float)); /* zeros: timed sums never overflow */
      for (int k = 0; k < o->warmup && !rc; k++) rc = run_op(c, op, a, b, count);
      if (!rc) rc = comm_barrier(c);
      double t0 = now_s();
      for (int k = 0; k < o->iters && !rc; k++) rc = run_op(c, op, a, b, count);
      float us = (float)((now_s() - t0) / o->iters * 1e6);
      long wrong = rc ? -1 : check_op(c, op, a, b, count, &rc);
      float stats[2] = {us, (float)wrong};
      if (!rc) rc = comm_all_reduce(c, &stats[0], 1, DT_F32, COMM_MAX);
      if (!rc) rc = comm_all_reduce(c, &stats[1], 1, DT_F32, COMM_SUM);
      if (rc) {
        fprintf(stderr, "comm_bench rank %d: %s\n", rank, comm_errmsg(c));
        break;
      }
      if (rank == 0) {
        double algbw = real / (stats[0] * 1e-6) / 1e9;
        printf("  %10zu %12zu %6s %6s %5s %10.1f %7.2f %7.2f %7.0f\n", real, count, "float",
               op == OP_BROADCAST || op == OP_ALL_GATHER ? "none" : "sum",
               op == OP_BROADCAST ? "0" : "-", stats[0], algbw, algbw * bus_factor(op, n),
               stats[1]);
        fflush(stdout);
      }
      size_t next = (size_t)(bytes * o->factor);
      bytes = next > bytes ? next : bytes + 1;
    }
  }
  free(a);
  free(b);
  comm_destroy(c);
  return rc ? 1 : 0;
}

/* ---- standalone: test/support/fixture starts a store on loopback in a thread and forks
 * RANKS local ranks (killed together if one fails: the others would wait for it) ---- */

static int local_rank(int rank, int n, store_t *st, void *arg) {
  return bench_rank(rank, n, st, 0, "127.0.0.1", arg);
}

static int run_local(const opts_t *o) {
  return fixture_run_ranks(o->nranks, local_rank, (void *)o, 3600) == 0 ? 0 : 1;
}

static void usage(void) {
  fprintf(stderr, "usage: comm_bench [-n RANKS] [-b MIN] [-e MAX] [-f FACTOR] "
                  "[-o all_reduce|all_gather|reduce_scatter|broadcast|all] [-w WARMUP] [-i ITERS] "
                  "[-R ROUNDS]\n");
}

int main(int argc, char **argv) {
  opts_t o = {.nranks = 4, .min_bytes = 1 << 20, .max_bytes = 64 << 20, .factor = 4, .op = OP_ALL_REDUCE,
              .warmup = 2, .iters = 10};
  int ch;
  while ((ch = getopt(argc, argv, "n:b:e:f:o:w:i:R:h")) != -1) {
    switch (ch) {
    case 'n': o.nranks = atoi(optarg); break;
    case 'b':
      if (parse_size(optarg, &o.min_bytes)) return usage(), 2;
      break;
    case 'e':
      if (parse_size(optarg, &o.max_bytes)) return usage(), 2;
      break;
    case 'f': o.factor = atof(optarg); break;
    case 'o':
      o.op = -2;
      if (!strcmp(optarg, "all")) o.op = -1;
      for (int k = 0; k < OP_COUNT; k++)
        if (!strcmp(optarg, op_names[k])) o.op = k;
      if (o.op == -2) return usage(), 2;
      break;
    case 'w': o.warmup = atoi(optarg); break;
    case 'i': o.iters = atoi(optarg); break;
    case 'R': o.rounds = atoi(optarg); break;
    default: return usage(), 2;
    }
  }
  if (o.nranks < 1 || o.nranks > 256 || o.iters < 1 || o.warmup < 0 || o.factor < 1 ||
      o.min_bytes > o.max_bytes || o.rounds < 0 || o.rounds > 10000) {
    fprintf(stderr, "comm_bench: need 1 <= RANKS <= 256, ITERS >= 1, FACTOR >= 1, MIN <= MAX, 0 <= ROUNDS <= 10000\n");
    return 2;
  }
  const char *store_ep = getenv("MESHRUN_STORE"), *rank_s = getenv("RANK"),
             *world_s = getenv("WORLD_SIZE");
  if (!store_ep || !rank_s || !world_s) return run_local(&o);
  char err[512] = "";
  store_t *st = NULL;
  if (store_connect_env(&st, 30000, err, sizeof err) != 0) {
    fprintf(stderr, "comm_bench: store %s: %s\n", store_ep, err);
    return 1;
  }
  const char *gen = getenv("MESHRUN_ROUND"); /* unique per rendezvous round */
  if (!gen) gen = getenv("TORCHELASTIC_RESTART_COUNT");
  int rc = bench_rank(atoi(rank_s), atoi(world_s), st, gen ? atoi(gen) : 0, NULL, &o);
  store_close(st);
  return rc;
}
