// deps: trainer/parallel/mesh.c trainer/comm/comm.c trainer/comm/comm_cpu.c common/store.c common/store_proto.c common/net.c common/log.c common/err.c common/env.c trainer/backend/fatal.c
/* test_mesh: the mesh layout (pure arithmetic, no processes): coordinates, group members and
 * their order, uids, size-1 dimensions and errors. The groups' communicators across processes
 * are tested in test_comm_cpu (test_mesh_2x2x2). Expected memberships are written out by hand
 * or from the layout formula rank = ((r * dp_shard) + s) * tp + t. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "trainer/parallel/mesh.h"

static mesh_t *make(int R, int S, int T, int rank) {
  char err[256] = "";
  mesh_t *m = NULL;
  int rc = mesh_create(&m, R, S, T, rank, R * S * T, err, sizeof err);
  if (rc != 0) fail_msg("mesh_create: %s", err);
  return m;
}

static void assert_members(const mesh_t *m, const char *name, const int *want, int n, int my_rank,
                           const char *uid) {
  const mesh_group_t *g = mesh_group(m, name);
  assert_non_null(g);
  assert_int_equal(g->size, n);
  for (int i = 0; i < n; i++) assert_int_equal(g->ranks[i], want[i]);
  assert_int_equal(g->rank, my_rank);
  assert_string_equal(g->uid, uid);
  assert_null(g->comm);
}

/* 2 x 3 x 4 = 24 ranks; rank 17 is (r, s, t) = (1, 1, 1). */
static void test_layout_2x3x4(void **state) {
  mesh_t *m = make(2, 3, 4, 17);
  assert_int_equal(m->coord[MESH_DP_REPLICATE], 1);
  assert_int_equal(m->coord[MESH_DP_SHARD], 1);
  assert_int_equal(m->coord[MESH_TP], 1);
  assert_members(m, "tp", (int[]){16, 17, 18, 19}, 4, 1, "tp.16");
  assert_members(m, "dp_shard", (int[]){13, 17, 21}, 3, 1, "dp_shard.13");
  assert_members(m, "dp_replicate", (int[]){5, 17}, 2, 1, "dp_replicate.5");
  assert_members(m, "dp", (int[]){1, 5, 9, 13, 17, 21}, 6, 4, "dp.1");
  const mesh_group_t *w = mesh_group(m, "world");
  assert_int_equal(w->size, 24);
  assert_int_equal(w->rank, 17);
  assert_string_equal(w->uid, "world.0");
  assert_members(m, "pp", (int[]){17}, 1, 0, "pp.17"); /* no pipeline: a group of one */
  assert_null(mesh_group(m, "nope"));
  assert_null(mesh_group(m, NULL));
  assert_null(mesh_comm(m, "tp")); /* not connected yet */
  mesh_destroy(m);
}

/* For every rank: coordinates round-trip, and each group seen from any member lists the same
 * members in the same order (so all members agree on uid and ring order), the groups of one
 * name partition the world, and members differ exactly in the group's free coordinates. */
static void test_groups_consistent(void **state) {
  static const char *names[] = {"dp_replicate", "dp_shard", "tp", "dp", "world", "pp"};
  static const int shapes[][4] = {{1, 2, 3, 4}, {1, 1, 8, 1}, {1, 4, 1, 2}, {1, 1, 1, 1}, {1, 3, 1, 1},
                                  {2, 2, 2, 2}, {4, 1, 1, 1}, {3, 1, 2, 1}, {2, 1, 1, 3}};
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
    int Q = shapes[k][0], R = shapes[k][1], S = shapes[k][2], T = shapes[k][3], W = Q * R * S * T;
    char err[256] = "";
    mesh_t *m = NULL;
    if (mesh_create_pp(&m, Q, R, S, T, 0, W, err, sizeof err)) fail_msg("mesh_create_pp: %s", err);
    int *a = calloc((size_t)W, sizeof(int)), *b = calloc((size_t)W, sizeof(int));
    for (int rank = 0; rank < W; rank++) {
      int c[MESH_NDIMS];
      mesh_coords(m, rank, c);
      assert_int_equal(c[MESH_TP], rank % T);
      assert_int_equal(c[MESH_PP], rank / (R * S * T)); /* pp outermost */
      assert_int_equal(mesh_rank_at_pp(m, c[MESH_PP], c[0], c[1], c[2]), rank);
    }
    for (size_t g = 0; g < 6; g++) {
      int *seen = calloc((size_t)W, sizeof(int));
      int want_size = g == 0 ? R : g == 1 ? S : g == 2 ? T : g == 3 ? R * S : g == 4 ? W : Q;
      for (int rank = 0; rank < W; rank++) {
        int n = mesh_members(m, names[g], rank, a);
        assert_int_equal(n, want_size);
        for (int i = 0; i < n; i++) {
          assert_int_equal(mesh_members(m, names[g], a[i], b), n);
          assert_memory_equal(a, b, (size_t)n * sizeof(int));
          if (i > 0) assert_true(a[i] > a[i - 1]);
          int ca[MESH_NDIMS], cr[MESH_NDIMS];
          mesh_coords(m, a[i], ca);
          mesh_coords(m, rank, cr);
          /* every group but world and pp stays inside one pipeline stage */
          if (g != 4 && g != 5) assert_int_equal(ca[MESH_PP], cr[MESH_PP]);
          if (g == 0) assert_true(ca[1] == cr[1] && ca[2] == cr[2]);
          if (g == 1) assert_true(ca[0] == cr[0] && ca[2] == cr[2]);
          if (g == 2) assert_true(ca[0] == cr[0] && ca[1] == cr[1]);
          if (g == 3) assert_true(ca[2] == cr[2]);
          if (g == 5) assert_true(ca[0] == cr[0] && ca[1] == cr[1] && ca[2] == cr[2] && ca[MESH_PP] == i);
        }
        seen[a[0]]++; /* each group counted once per member, keyed by its lowest rank */
      }
      int total = 0;
      for (int i = 0; i < W; i++) {
        assert_true(seen[i] == 0 || seen[i] == want_size);
        total += seen[i];
      }
      assert_int_equal(total, W);
      free(seen);
    }
    free(a);
    free(b);
    mesh_destroy(m);
  }
}

/* pp 2 x dp_shard 2 x tp 2 = 8 ranks; rank 6 is (q, r, s, t) = (1, 0, 1, 0): its stage's groups
 * are ranks 4..7, its pipeline the ranks with the same (r, s, t) in the other stage. */
static void test_layout_pp(void **state) {
  char err[256] = "";
  mesh_t *m = NULL;
  assert_int_equal(mesh_create_pp(&m, 2, 1, 2, 2, 6, 8, err, sizeof err), 0);
  assert_int_equal(m->coord[MESH_PP], 1);
  assert_int_equal(m->coord[MESH_DP_SHARD], 1);
  assert_int_equal(m->coord[MESH_TP], 0);
  assert_members(m, "tp", (int[]){6, 7}, 2, 0, "tp.6");
  assert_members(m, "dp_shard", (int[]){4, 6}, 2, 1, "dp_shard.4");
  assert_members(m, "dp", (int[]){4, 6}, 2, 1, "dp.4");
  assert_members(m, "pp", (int[]){2, 6}, 2, 1, "pp.2");
  assert_int_equal(mesh_rank_at(m, 0, 0, 1), 5); /* within this rank's stage */
  assert_null(m->pp.send_act);                   /* channels come with mesh_connect */
  mesh_destroy(m);
  assert_int_equal(mesh_create_pp(&m, 3, 1, 2, 2, 0, 8, err, sizeof err), MESH_EINVAL);
  assert_string_equal(err, "mesh error: pp=3 x dp_replicate=1 x dp_shard=2 x tp=2 = 12 ranks, but the world has 8");
}

/* dp_replicate 2 x dp_shard 2 x cp 2 x tp 2 = 16 ranks; rank 13 is (r, s, c, t) = (1, 1, 0, 1).
 * cp sits between dp_shard and tp (torchtitan's order); the flattened groups list the outer
 * coordinate slowest. Every group of every rank is checked against the layout formula. */
static void test_layout_cp(void **state) {
  char err[256] = "";
  mesh_t *m = NULL;
  int dims[MESH_NDIMS];
  dims[MESH_PP] = 1, dims[MESH_DP_REPLICATE] = 2, dims[MESH_DP_SHARD] = 2, dims[MESH_CP] = 2, dims[MESH_TP] = 2;
  assert_int_equal(mesh_create_dims(&m, dims, 13, 16, err, sizeof err), 0);
  assert_int_equal(m->coord[MESH_DP_REPLICATE], 1);
  assert_int_equal(m->coord[MESH_DP_SHARD], 1);
  assert_int_equal(m->coord[MESH_CP], 0);
  assert_int_equal(m->coord[MESH_TP], 1);
  assert_members(m, "tp", (int[]){12, 13}, 2, 1, "tp.12");
  assert_members(m, "cp", (int[]){13, 15}, 2, 0, "cp.13");
  assert_members(m, "dp_shard", (int[]){9, 13}, 2, 1, "dp_shard.9");
  assert_members(m, "dp", (int[]){1, 5, 9, 13}, 4, 3, "dp.1");
  assert_members(m, "dp_shard_cp", (int[]){9, 11, 13, 15}, 4, 2, "dp_shard_cp.9");
  assert_members(m, "dp_cp", (int[]){1, 3, 5, 7, 9, 11, 13, 15}, 8, 6, "dp_cp.1");
  assert_int_equal(m->groups[MESH_GROUP_DP_SHARD_CP].alias, -1); /* rings of their own when cp > 1 */
  assert_int_equal(m->groups[MESH_GROUP_DP_CP].alias, -1);
  int a[16];
  for (int rank = 0; rank < 16; rank++) {
    int c[MESH_NDIMS];
    mesh_coords(m, rank, c);
    int want = (((c[MESH_DP_REPLICATE] * 2 + c[MESH_DP_SHARD]) * 2 + c[MESH_CP]) * 2) + c[MESH_TP];
    assert_int_equal(want, rank);
    int n = mesh_members(m, "dp_shard_cp", rank, a);
    for (int i = 0; i < n; i++) { /* group rank s * cp + c */
      int ca[MESH_NDIMS];
      mesh_coords(m, a[i], ca);
      assert_int_equal(ca[MESH_DP_SHARD] * 2 + ca[MESH_CP], i);
      assert_true(ca[MESH_DP_REPLICATE] == c[MESH_DP_REPLICATE] && ca[MESH_TP] == c[MESH_TP]);
    }
  }
  mesh_destroy(m);
  dims[MESH_CP] = 3;
  assert_int_equal(mesh_create_dims(&m, dims, 0, 16, err, sizeof err), MESH_EINVAL);
  assert_string_equal(err, "mesh error: dp_replicate=2 x dp_shard=2 x cp=3 x tp=2 = 24 ranks, but the world has 16");
  dims[MESH_CP] = 0;
  assert_int_equal(mesh_create_dims(&m, dims, 0, 16, err, sizeof err), MESH_EINVAL);
  assert_non_null(strstr(err, "must be >= 1"));
}

/* cp = 1: dp_shard_cp and dp_cp have dp_shard's and dp's members and, once connected, their
 * communicators (no ring of their own, no traffic of their own). */
static void test_cp_one_aliases(void **state) {
  char err[256] = "";
  mesh_t *m = make(1, 1, 1, 0);
  assert_int_equal(m->groups[MESH_GROUP_DP_SHARD_CP].alias, MESH_GROUP_DP_SHARD);
  assert_int_equal(m->groups[MESH_GROUP_DP_CP].alias, MESH_GROUP_DP);
  assert_int_equal(mesh_connect(m, "cpu", NULL, NULL, 0, "127.0.0.1", 1000, err, sizeof err), 0);
  assert_ptr_equal(mesh_comm(m, "dp_shard_cp"), mesh_comm(m, "dp_shard"));
  assert_ptr_equal(mesh_comm(m, "dp_cp"), mesh_comm(m, "dp"));
  assert_non_null(mesh_comm(m, "cp"));
  assert_null(m->cp.send);
  mesh_destroy(m); /* destroys each communicator once (ASan/valgrind would see a double free) */
}

/* A world of one: every group has size 1 and connecting needs no store; collectives are
 * no-ops that leave the data as it was. */
static void test_world_of_one(void **state) {
  char err[256] = "";
  mesh_t *m = make(1, 1, 1, 0);
  assert_int_equal(mesh_connect(m, "cpu", NULL, NULL, 0, "127.0.0.1", 1000, err, sizeof err), 0);
  const char *names[] = {"dp_replicate", "dp_shard", "tp", "dp", "world"};
  for (int g = 0; g < 5; g++) {
    comm_t *c = mesh_comm(m, names[g]);
    assert_non_null(c);
    assert_int_equal(comm_size(c), 1);
    assert_int_equal(comm_rank(c), 0);
    float x[3] = {1.5f, -2.0f, 3.0f};
    assert_int_equal(comm_all_reduce(c, x, 3, DT_F32, COMM_AVG), COMM_OK);
    assert_true(x[0] == 1.5f && x[1] == -2.0f && x[2] == 3.0f);
    assert_int_equal(comm_barrier(c), COMM_OK);
  }
  mesh_destroy(m);
}

static void test_errors(void **state) {
  char err[256] = "";
  mesh_t *m = (mesh_t *)1;
  assert_int_equal(mesh_create(&m, 2, 2, 3, 0, 8, err, sizeof err), MESH_EINVAL);
  assert_null(m);
  assert_string_equal(err, "mesh error: dp_replicate=2 x dp_shard=2 x tp=3 = 12 ranks, but the "
                           "world has 8");
  assert_int_equal(mesh_create(&m, 0, 2, 4, 0, 8, err, sizeof err), MESH_EINVAL);
  assert_non_null(strstr(err, "must be >= 1"));
  assert_int_equal(mesh_create(&m, 2, 2, 2, 8, 8, err, sizeof err), MESH_EINVAL);
  assert_non_null(strstr(err, "rank 8 is outside a world of 8"));
  m = make(2, 2, 2, 3);
  int ranks[8];
  assert_int_equal(mesh_members(m, "nope", 0, ranks), MESH_EINVAL);
  assert_int_equal(mesh_members(m, "tp", 8, ranks), MESH_EINVAL);
  /* Groups of more than one rank need a store to meet: connect fails and leaves no comm. */
  assert_true(mesh_connect(m, "cpu", NULL, NULL, 0, "127.0.0.1", 1000, err, sizeof err) < 0);
  assert_non_null(strstr(err, "needs a store"));
  for (int g = 0; g < MESH_NGROUPS; g++) assert_null(m->groups[g].comm);
  mesh_destroy(m);
  mesh_destroy(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout_2x3x4),
      cmocka_unit_test(test_groups_consistent),
      cmocka_unit_test(test_layout_pp),
      cmocka_unit_test(test_layout_cp),
      cmocka_unit_test(test_cp_one_aliases),
      cmocka_unit_test(test_world_of_one),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
