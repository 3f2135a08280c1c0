// deps: test/support/fixture.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/comm_nccl.c trainer/comm/comm_staged.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/model/rng.c common/store.c common/store_proto.c common/net.c common/log.c launcher/store_server.c common/err.c common/env.c trainer/backend/fatal.c
/* test_nccl: the nccl comm backend's bootstrap on one GPU, and the staged backend over the real
 * cuda backend.
 *
 * NCCL cannot put two ranks of a communicator on one GPU, so with one GPU the nccl backend is
 * checked in a group of one: the unique id goes through a real store (the key is read back), the
 * communicator initializes, and NCCL's kernels run: the backend's all_reduce, broadcast and
 * barrier are called directly (the dispatch answers groups of one without the backend), and
 * all_gather and reduce_scatter through the dispatch exercise the backend's device copies. A
 * group of one reduces to the input itself, so the tolerance is 0 (max difference printed). Also
 * the setup errors: LOCAL_WORLD_SIZE above the visible GPUs, and a group whose rank 0 never
 * comes (a timeout, not a hang). Then staged over cuda with 2 ranks on the same GPU against the
 * cpu comm on host copies of the same data, bit for bit (tolerance 0: the same ring reduces).
 *
 * The parent process never touches CUDA: every check runs in a forked rank, so CUDA is
 * initialized after the fork only. Needs a GPU; without one each check fails with the reason. */
#include <cuda_runtime.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test/support/fixture.h"
#include "trainer/backend/backend.h"
#include "trainer/comm/comm.h"
#include "trainer/comm/comm_impl.h" /* drives the nccl backend table directly */

#define ALARM_S 120
#define TIMEOUT_MS 60000

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));       \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

static void fill(float *x, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; i++) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    x[i] = (float)((double)(s >> 11) / 4503599627370496.0 - 1.0);
  }
}

static double max_diff(const float *a, const float *b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > m || d != d) m = d;
  }
  return m;
}

static int check(const char *what, const float *want, const float *got, size_t n) {
  double d = max_diff(want, got, n);
  int bitwise = memcmp(want, got, n * sizeof(float)) == 0;
  printf("  %-40s max diff %g (tolerance 0)%s\n", what, d, bitwise ? "" : "  FAIL");
  return !bitwise;
}

/* ---- nccl, group of one ---- */

static int rank_world1(int rank, int n, store_t *st, void *arg) {
  char err[COMM_ERR_MAX] = "";
  comm_t *c = NULL;
  comm_config_t cfg = {.name = "nccl1", .rank = 0, .size = 1, .generation = 3, .store = st,
                       .timeout_ms = TIMEOUT_MS};
  if (comm_create(&c, "nccl", &cfg, err, sizeof err)) {
    fprintf(stderr, "comm_create nccl: %s\n", err);
    return 1;
  }
  int bad = 0;
  void *val = NULL;
  size_t len = 0;
  if (store_get(st, "comm/nccl1/3/nccl_id", &val, &len, 1000) != STORE_OK || len != 128) {
    fprintf(stderr, "the NCCL id is not in the store under comm/nccl1/3/nccl_id (len %zu)\n", len);
    bad = 1;
  }
  free(val);
  const size_t cnt = (1u << 20) + 3; /* 4 MiB and a tail */
  float *h = malloc(cnt * sizeof(float)), *got = malloc(cnt * sizeof(float));
  float *d = NULL, *d2 = NULL;
  CK(cudaMalloc((void **)&d, cnt * sizeof(float)));
  CK(cudaMalloc((void **)&d2, cnt * sizeof(float)));
  fill(h, cnt, 1);
  CK(cudaMemcpy(d, h, cnt * sizeof(float), cudaMemcpyHostToDevice));
  /* The backend itself (the dispatch would answer a group of one without NCCL). */
  const comm_op_t ops[] = {COMM_SUM, COMM_AVG, COMM_MAX};
  for (int i = 0; i < 3; i++) {
    int rc = c->ops->all_reduce(c, d, cnt, DT_F32, ops[i]);
    if (rc) {
      fprintf(stderr, "nccl all_reduce: %s\n", comm_errmsg(c));
      return 1;
    }
    CK(cudaMemcpy(got, d, cnt * sizeof(float), cudaMemcpyDeviceToHost));
    char what[64];
    snprintf(what, sizeof what, "all_reduce(%s) of %zu floats", comm_op_name(ops[i]), cnt);
    bad |= check(what, h, got, cnt);
  }
  if (c->ops->broadcast(c, d, cnt, DT_F32, 0) || c->ops->barrier(c)) {
    fprintf(stderr, "nccl broadcast/barrier: %s\n", comm_errmsg(c));
    return 1;
  }
  CK(cudaMemcpy(got, d, cnt * sizeof(float), cudaMemcpyDeviceToHost));
  bad |= check("broadcast", h, got, cnt);
  /* bf16 moves through NCCL too (a group of one returns it unchanged). */
  if (c->ops->all_reduce(c, d, cnt / 2, DT_BF16, COMM_SUM)) {
    fprintf(stderr, "nccl bf16 all_reduce: %s\n", comm_errmsg(c));
    return 1;
  }
  CK(cudaMemcpy(got, d, cnt * sizeof(float), cudaMemcpyDeviceToHost));
  bad |= check("all_reduce(sum) as bf16 pairs", h, got, cnt);
  /* The dispatch's device copies. */
  CK(cudaMemset(d2, 0, cnt * sizeof(float)));
  if (comm_all_gather(c, d, d2, cnt, DT_F32) != COMM_OK) {
    fprintf(stderr, "all_gather: %s\n", comm_errmsg(c));
    return 1;
  }
  CK(cudaMemcpy(got, d2, cnt * sizeof(float), cudaMemcpyDeviceToHost));
  bad |= check("all_gather (dispatch copy)", h, got, cnt);
  CK(cudaMemset(d2, 0, cnt * sizeof(float)));
  if (comm_reduce_scatter(c, d, d2, cnt, DT_F32, COMM_SUM) != COMM_OK) {
    fprintf(stderr, "reduce_scatter: %s\n", comm_errmsg(c));
    return 1;
  }
  CK(cudaMemcpy(got, d2, cnt * sizeof(float), cudaMemcpyDeviceToHost));
  bad |= check("reduce_scatter (dispatch copy)", h, got, cnt);
  comm_stats_t s;
  comm_get_stats(c, &s);
  printf("  stats: %llu calls, %llu bytes sent (a group of one sends nothing)\n", (unsigned long long)s.calls,
         (unsigned long long)s.bytes_sent);
  comm_destroy(c);
  cudaFree(d);
  cudaFree(d2);
  free(h);
  free(got);
  return bad;
}

static void test_nccl_group_of_one(void **state) {
  assert_int_equal(fixture_run_ranks(1, rank_world1, NULL, ALARM_S), 0);
}

static int rank_too_many_local(int rank, int n, store_t *st, void *arg) {
  setenv("LOCAL_WORLD_SIZE", "64", 1);
  setenv("LOCAL_RANK", "0", 1);
  char err[COMM_ERR_MAX] = "";
  comm_t *c = NULL;
  comm_config_t cfg = {.name = "many", .rank = 0, .size = 1, .store = st, .timeout_ms = TIMEOUT_MS};
  int rc = comm_create(&c, "nccl", &cfg, err, sizeof err);
  printf("  LOCAL_WORLD_SIZE=64: %d: %s\n", rc, err);
  comm_destroy(c);
  return !(rc == COMM_EINVAL && strstr(err, "nccl: LOCAL_WORLD_SIZE 64 but only"));
}

static void test_nccl_too_many_local_ranks(void **state) {
  assert_int_equal(fixture_run_ranks(1, rank_too_many_local, NULL, ALARM_S), 0);
}

/* Rank 1 of 2 whose rank 0 never comes: the id never appears, setup times out (1 s). */
static int rank_lonely(int rank, int n, store_t *st, void *arg) {
  char err[COMM_ERR_MAX] = "";
  comm_t *c = NULL;
  comm_config_t cfg = {.name = "lonely", .rank = 1, .size = 2, .store = st, .timeout_ms = 1000};
  int rc = comm_create(&c, "nccl", &cfg, err, sizeof err);
  printf("  rank 0 missing: %d: %s\n", rc, err);
  comm_destroy(c);
  return !(rc == COMM_ETIMEDOUT && strstr(err, "comm lonely") && strstr(err, "NCCL id"));
}

static void test_nccl_missing_rank_times_out(void **state) {
  assert_int_equal(fixture_run_ranks(1, rank_lonely, NULL, ALARM_S), 0);
}

/* ---- staged over cuda, 2 ranks on one GPU ---- */

static int rank_staged(int rank, int n, store_t *st, void *arg) {
  char err[COMM_ERR_MAX] = "";
  backend_t *be = backend_create("cuda", 0, err, sizeof err);
  if (!be) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    return 1;
  }
  comm_t *ref = NULL, *stg = NULL;
  comm_config_t cfg = {.name = "stg", .rank = rank, .size = n, .store = st, .host = "127.0.0.1",
                       .timeout_ms = TIMEOUT_MS, .device = be};
  if (fixture_comm_open(&ref, "ref", rank, n, st, TIMEOUT_MS) || comm_create(&stg, "staged", &cfg, err, sizeof err)) {
    fprintf(stderr, "rank %d: %s\n", rank, err);
    return 1;
  }
  const size_t cnt = (1u << 18) + 5, all = (size_t)n * cnt;
  float *h = malloc(all * sizeof(float)), *want = malloc(all * sizeof(float)), *got = malloc(all * sizeof(float));
  float *d = be->alloc(be, all * sizeof(float)), *d2 = be->alloc(be, all * sizeof(float));
  int bad = 0;
  fill(h, all, 10 + (uint64_t)rank);
  memcpy(want, h, cnt * sizeof(float));
  be->to_device(be, d, h, cnt * sizeof(float));
  bad |= comm_all_reduce(ref, want, cnt, DT_F32, COMM_SUM) || comm_all_reduce(stg, d, cnt, DT_F32, COMM_SUM);
  be->to_host(be, got, d, cnt * sizeof(float));
  if (rank == 0) bad |= check("staged all_reduce(sum) vs cpu", want, got, cnt);
  else bad |= memcmp(want, got, cnt * sizeof(float)) != 0;
  be->to_device(be, d, h, all * sizeof(float));
  bad |= comm_reduce_scatter(ref, h, want, cnt, DT_F32, COMM_AVG) ||
         comm_reduce_scatter(stg, d, d2, cnt, DT_F32, COMM_AVG);
  be->to_host(be, got, d2, cnt * sizeof(float));
  if (rank == 0) bad |= check("staged reduce_scatter(avg) vs cpu", want, got, cnt);
  else bad |= memcmp(want, got, cnt * sizeof(float)) != 0;
  bad |= comm_all_gather(ref, h, want, cnt, DT_F32) || comm_all_gather(stg, d, d2, cnt, DT_F32);
  be->to_host(be, got, d2, all * sizeof(float));
  if (rank == 0) bad |= check("staged all_gather vs cpu", want, got, all);
  else bad |= memcmp(want, got, all * sizeof(float)) != 0;
  memcpy(want, h, cnt * sizeof(float));
  bad |= comm_broadcast(ref, want, cnt, DT_F32, 1) || comm_broadcast(stg, d, cnt, DT_F32, 1);
  be->to_host(be, got, d, cnt * sizeof(float));
  if (rank == 0) bad |= check("staged broadcast(root 1) vs cpu", want, got, cnt);
  else bad |= memcmp(want, got, cnt * sizeof(float)) != 0;
  if (bad) fprintf(stderr, "rank %d: %s / %s\n", rank, comm_errmsg(ref), comm_errmsg(stg));
  be->free(be, d);
  be->free(be, d2);
  comm_destroy(stg);
  comm_destroy(ref);
  backend_destroy(be);
  free(h);
  free(want);
  free(got);
  return bad;
}

static void test_staged_over_cuda(void **state) {
  assert_int_equal(fixture_run_ranks(2, rank_staged, NULL, ALARM_S), 0);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nccl_group_of_one),
      cmocka_unit_test(test_nccl_too_many_local_ranks),
      cmocka_unit_test(test_nccl_missing_rank_times_out),
      cmocka_unit_test(test_staged_over_cuda),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
