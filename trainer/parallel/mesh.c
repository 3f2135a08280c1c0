/* mesh: layout arithmetic of the (pp, dp_replicate, dp_shard, tp) mesh and the creation of each
 * group's communicator. The layout is computed once, from the same formula for every rank, so
 * all members of a group agree on its members, order and uid without talking. It does not
 * decide the dimensions (the plan does) or move data (comm does). */
#include "trainer/parallel/mesh.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/env.h"
#include "common/err.h"

static const char *const group_names[MESH_NGROUPS] = {"dp_replicate", "dp_shard", "tp", "dp",
                                                      "world", "pp"};

/* The group's index, or -1 for a name that is none (the callers turn it into MESH_EINVAL). */
static int group_index(const char *name) {
  if (!name) return -1;
  for (int g = 0; g < MESH_NGROUPS; g++)
    if (strcmp(name, group_names[g]) == 0) return g;
  return -1;
}

void mesh_coords(const mesh_t *m, int rank, int coord[MESH_NDIMS]) {
  int tp = m->dims[MESH_TP], ds = m->dims[MESH_DP_SHARD], dr = m->dims[MESH_DP_REPLICATE];
  coord[MESH_TP] = rank % tp;
  coord[MESH_DP_SHARD] = (rank / tp) % ds;
  coord[MESH_DP_REPLICATE] = (rank / (tp * ds)) % dr;
  coord[MESH_PP] = rank / (tp * ds * dr);
}

int mesh_rank_at_pp(const mesh_t *m, int q, int r, int s, int t) {
  return ((q * m->dims[MESH_DP_REPLICATE] + r) * m->dims[MESH_DP_SHARD] + s) * m->dims[MESH_TP] + t;
}

int mesh_rank_at(const mesh_t *m, int r, int s, int t) { return mesh_rank_at_pp(m, m->coord[MESH_PP], r, s, t); }

/* Members of group g containing `rank`, in group-rank order: the group's free coordinates vary
 * (r outer, s inner for "dp"), the others stay at rank's values. */
static int members_of(const mesh_t *m, int g, int rank, int *ranks) {
  int c[MESH_NDIMS];
  mesh_coords(m, rank, c);
  int R = m->dims[MESH_DP_REPLICATE], S = m->dims[MESH_DP_SHARD], T = m->dims[MESH_TP], Q = m->dims[MESH_PP];
  int q = c[MESH_PP], n = 0;
  switch (g) {
  case MESH_GROUP_DP_REPLICATE:
    for (int r = 0; r < R; r++) ranks[n++] = mesh_rank_at_pp(m, q, r, c[1], c[2]);
    break;
  case MESH_GROUP_DP_SHARD:
    for (int s = 0; s < S; s++) ranks[n++] = mesh_rank_at_pp(m, q, c[0], s, c[2]);
    break;
  case MESH_GROUP_TP:
    for (int t = 0; t < T; t++) ranks[n++] = mesh_rank_at_pp(m, q, c[0], c[1], t);
    break;
  case MESH_GROUP_DP:
    for (int r = 0; r < R; r++)
      for (int s = 0; s < S; s++) ranks[n++] = mesh_rank_at_pp(m, q, r, s, c[2]);
    break;
  case MESH_GROUP_WORLD:
    for (int i = 0; i < m->world; i++) ranks[n++] = i;
    break;
  case MESH_GROUP_PP:
    for (int k = 0; k < Q; k++) ranks[n++] = mesh_rank_at_pp(m, k, c[0], c[1], c[2]);
    break;
  }
  return n;
}

int mesh_members(const mesh_t *m, const char *name, int rank, int *ranks) {
  int g = group_index(name);
  if (g < 0 || rank < 0 || rank >= m->world || !ranks) return MESH_EINVAL;
  return members_of(m, g, rank, ranks);
}

int mesh_create(mesh_t **out, int dp_replicate, int dp_shard, int tp, int rank, int world,
                char *err, size_t errlen) {
  return mesh_create_pp(out, 1, dp_replicate, dp_shard, tp, rank, world, err, errlen);
}

int mesh_create_pp(mesh_t **out, int pp, int dp_replicate, int dp_shard, int tp, int rank, int world,
                   char *err, size_t errlen) {
  *out = NULL;
  if (pp < 1 || dp_replicate < 1 || dp_shard < 1 || tp < 1) {
    return err_set(err, errlen, MESH_EINVAL,
                   "mesh error: dimensions must be >= 1, got pp=%d dp_replicate=%d dp_shard=%d "
                   "tp=%d",
                   pp, dp_replicate, dp_shard, tp);
  }
  const long long n = (long long)pp * dp_replicate * dp_shard * tp;
  if (n != world) {
    if (pp == 1)
      err_set(err, errlen, 0,
              "mesh error: dp_replicate=%d x dp_shard=%d x tp=%d = %lld ranks, but "
              "the world has %d",
              dp_replicate, dp_shard, tp, n, world);
    else
      err_set(err, errlen, 0,
              "mesh error: pp=%d x dp_replicate=%d x dp_shard=%d x tp=%d = %lld ranks, but "
              "the world has %d",
              pp, dp_replicate, dp_shard, tp, n, world);
    return MESH_EINVAL;
  }
  if (rank < 0 || rank >= world) {
    return err_set(err, errlen, MESH_EINVAL, "mesh error: rank %d is outside a world of %d", rank, world);
  }
  mesh_t *m = calloc(1, sizeof *m);
  if (!m) {
    return err_set(err, errlen, MESH_EINVAL, "mesh error: out of memory");
  }
  m->world = world;
  m->rank = rank;
  m->dims[MESH_DP_REPLICATE] = dp_replicate;
  m->dims[MESH_DP_SHARD] = dp_shard;
  m->dims[MESH_TP] = tp;
  m->dims[MESH_PP] = pp;
  mesh_coords(m, rank, m->coord);
  for (int g = 0; g < MESH_NGROUPS; g++) {
    mesh_group_t *grp = &m->groups[g];
    snprintf(grp->name, sizeof grp->name, "%s", group_names[g]);
    grp->ranks = calloc((size_t)world, sizeof *grp->ranks);
    if (!grp->ranks) {
      mesh_destroy(m);
      return err_set(err, errlen, MESH_EINVAL, "mesh error: out of memory");
    }
    grp->size = members_of(m, g, rank, grp->ranks);
    grp->rank = -1;
    for (int i = 0; i < grp->size; i++)
      if (grp->ranks[i] == rank) grp->rank = i;
    /* Members are listed in increasing rank order, so ranks[0] is the lowest. */
    snprintf(grp->uid, sizeof grp->uid, "%s.%d", group_names[g], grp->ranks[0]);
  }
  *out = m;
  return 0;
}

/* Destroys group g's communicators; the host one only when it is not the device one. */
static void group_disconnect(mesh_group_t *grp) {
  if (grp->host_comm != grp->comm) comm_destroy(grp->host_comm);
  comm_destroy(grp->comm);
  grp->comm = grp->host_comm = NULL;
}

static void channels_disconnect(mesh_pp_channels_t *ch) {
  comm_destroy(ch->send_act);
  comm_destroy(ch->recv_act);
  comm_destroy(ch->send_grad);
  comm_destroy(ch->recv_grad);
  memset(ch, 0, sizeof *ch);
}

/* The pipeline channels of this rank's pp group: for each pp rank k, an activation channel
 * k -> k+1 and a gradient channel k+1 -> k (mod pp), each a two-rank communicator named after
 * its sender ("ppact.<global rank>", "ppgrad.<global rank>"), the sender its rank 0. Every
 * member walks the same list in the same order and creates the channels it belongs to, so the
 * first unfinished channel always has both its members at it: no two ranks wait on each other. */
static int connect_channels(mesh_t *m, const char *backend, struct backend *device, store_t *store, int generation,
                            const char *host, int timeout_ms, char *err, size_t errlen) {
  const int Q = m->dims[MESH_PP], q = m->coord[MESH_PP];
  const int *pp = m->groups[MESH_GROUP_PP].ranks;
  if (Q < 2) return COMM_OK;
  for (int kind = 0; kind < 2; kind++)
    for (int k = 0; k < Q; k++) {
      const int src = kind == 0 ? k : (k + 1) % Q, dst = kind == 0 ? (k + 1) % Q : k;
      if (q != src && q != dst) continue;
      char uid[COMM_NAME_MAX];
      snprintf(uid, sizeof uid, "%s.%d", kind == 0 ? "ppact" : "ppgrad", pp[src]);
      const int members[2] = {pp[src], pp[dst]};
      comm_config_t cfg = {.name = uid, .rank = q == src ? 0 : 1, .size = 2, .generation = generation,
                           .store = store, .host = host, .timeout_ms = timeout_ms, .global_ranks = members,
                           .device = device};
      comm_t **slot = kind == 0 ? (q == src ? &m->pp.send_act : &m->pp.recv_act)
                                : (q == src ? &m->pp.send_grad : &m->pp.recv_grad);
      int rc = comm_create(slot, backend, &cfg, err, errlen);
      if (rc != COMM_OK) return rc;
    }
  return COMM_OK;
}

int mesh_connect(mesh_t *m, const char *backend, struct backend *device, store_t *store,
                 int generation, const char *host, int timeout_ms, char *err, size_t errlen) {
  if (!backend) backend = "cpu";
  if (generation < 0) {
    /* MESHRUN_ROUND is unique per rendezvous round; the restart count is not (a scale-up
     * round keeps it), so it only serves programs started by another launcher. */
    int restarts;
    env_int("TORCHELASTIC_RESTART_COUNT", 0, INT_MAX, 0, &restarts);
    env_int("MESHRUN_ROUND", 0, INT_MAX, restarts, &generation);
  }
  /* A backend that moves host memory serves host values too: one ring per group, not two. */
  const int host_is_device = comm_backend_memory(backend) == COMM_MEM_HOST;
  /* Every rank creates the groups in the same order (each group's device comm, then its host
   * comm); a group's setup waits only on its own members, who are at the same point of the same
   * sequence, so no two ranks wait on each other across groups. */
  /* The world group comes first and the others are split from it ("nccl": ncclCommSplit, one
   * NCCL bootstrap per job instead of one per group; every rank makes the same splits in the
   * same order, its color the lowest member rank of its group). */
  static const int order[MESH_NGROUPS] = {MESH_GROUP_WORLD, 0, 1, 2, 3, MESH_GROUP_PP};
  _Static_assert(MESH_GROUP_WORLD == 4 && MESH_GROUP_PP == 5 && MESH_NGROUPS == 6,
                 "the order above lists every group once");
  for (int i = 0; i < MESH_NGROUPS; i++) {
    const int g = order[i];
    mesh_group_t *grp = &m->groups[g];
    comm_config_t cfg = {.name = grp->uid, .rank = grp->rank, .size = grp->size,
                         .generation = generation, .store = store, .host = host,
                         .timeout_ms = timeout_ms, .global_ranks = grp->ranks,
                         .device = device, .color = grp->ranks[0],
                         .parent = g == MESH_GROUP_WORLD ? NULL : m->groups[MESH_GROUP_WORLD].comm};
    int rc = comm_create(&grp->comm, backend, &cfg, err, errlen);
    if (rc == COMM_OK && host_is_device) {
      grp->host_comm = grp->comm;
    } else if (rc == COMM_OK) {
      char uid[COMM_NAME_MAX];
      snprintf(uid, sizeof uid, "host.%s", grp->uid); /* uids are < 20 characters */
      cfg.name = uid;
      cfg.device = NULL;
      rc = comm_create(&grp->host_comm, "cpu", &cfg, err, errlen);
    }
    if (rc == COMM_OK && g == MESH_GROUP_PP) rc = connect_channels(m, backend, device, store, generation, host,
                                                                   timeout_ms, err, errlen);
    if (rc != COMM_OK) {
      for (int k = 0; k <= i; k++) group_disconnect(&m->groups[order[k]]);
      channels_disconnect(&m->pp);
      return rc;
    }
  }
  return 0;
}

void mesh_destroy(mesh_t *m) {
  if (!m) return;
  channels_disconnect(&m->pp);
  for (int g = 0; g < MESH_NGROUPS; g++) {
    group_disconnect(&m->groups[g]);
    free(m->groups[g].ranks);
  }
  free(m);
}

const mesh_group_t *mesh_group(const mesh_t *m, const char *name) {
  int g = group_index(name);
  return g < 0 ? NULL : &m->groups[g];
}

comm_t *mesh_comm(const mesh_t *m, const char *name) {
  const mesh_group_t *g = mesh_group(m, name);
  return g ? g->comm : NULL;
}

comm_t *mesh_host_comm(const mesh_t *m, const char *name) {
  const mesh_group_t *g = mesh_group(m, name);
  return g ? g->host_comm : NULL;
}

/* out += c's traffic and blocked time (c may be NULL). */
static void stats_add(comm_stats_t *out, const comm_t *c) {
  if (!c) return;
  comm_stats_t st;
  comm_get_stats(c, &st);
  out->bytes_sent += st.bytes_sent;
  out->bytes_recv += st.bytes_recv;
  out->calls += st.calls;
  out->wait_ns += st.wait_ns;
}

void mesh_group_stats(const mesh_t *m, int g, comm_stats_t *out) {
  const mesh_group_t *grp = &m->groups[g];
  memset(out, 0, sizeof *out);
  stats_add(out, grp->comm);
  if (grp->host_comm != grp->comm) stats_add(out, grp->host_comm);
}

uint64_t mesh_wait_ns(const mesh_t *m) {
  if (!m) return 0;
  comm_stats_t st;
  memset(&st, 0, sizeof st);
  for (int g = 0; g < MESH_NGROUPS; g++) {
    stats_add(&st, m->groups[g].comm);
    if (m->groups[g].host_comm != m->groups[g].comm) stats_add(&st, m->groups[g].host_comm);
  }
  /* the pipeline channels: the time a stage waited for its input or its output's gradient */
  stats_add(&st, m->pp.send_act);
  stats_add(&st, m->pp.recv_act);
  stats_add(&st, m->pp.send_grad);
  stats_add(&st, m->pp.recv_grad);
  return st.wait_ns;
}
