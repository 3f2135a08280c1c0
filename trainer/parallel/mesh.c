/* mesh: layout arithmetic of the (pp, dp_replicate, dp_shard, cp, tp) mesh and the creation of each
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

static const char *const group_names[MESH_NGROUPS] = {"dp_replicate", "dp_shard", "tp", "dp", "world",
                                                      "pp", "cp", "dp_shard_cp", "dp_cp"};

/* The group's index, or -1 for a name that is none (the callers turn it into MESH_EINVAL). */
static int group_index(const char *name) {
  if (!name) return -1;
  for (int g = 0; g < MESH_NGROUPS; g++)
    if (strcmp(name, group_names[g]) == 0) return g;
  return -1;
}

void mesh_coords(const mesh_t *m, int rank, int coord[MESH_NDIMS]) {
  int tp = m->dims[MESH_TP], cp = m->dims[MESH_CP], ds = m->dims[MESH_DP_SHARD], dr = m->dims[MESH_DP_REPLICATE];
  coord[MESH_TP] = rank % tp;
  coord[MESH_CP] = (rank / tp) % cp;
  coord[MESH_DP_SHARD] = (rank / (tp * cp)) % ds;
  coord[MESH_DP_REPLICATE] = (rank / (tp * cp * ds)) % dr;
  coord[MESH_PP] = rank / (tp * cp * ds * dr);
}

/* The rank at coordinates c (indexed by MESH_*). */
static int rank_of(const mesh_t *m, const int c[MESH_NDIMS]) {
  return (((c[MESH_PP] * m->dims[MESH_DP_REPLICATE] + c[MESH_DP_REPLICATE]) * m->dims[MESH_DP_SHARD] +
           c[MESH_DP_SHARD]) * m->dims[MESH_CP] + c[MESH_CP]) * m->dims[MESH_TP] + c[MESH_TP];
}

int mesh_rank_at_pp(const mesh_t *m, int q, int r, int s, int t) {
  int c[MESH_NDIMS];
  c[MESH_PP] = q, c[MESH_DP_REPLICATE] = r, c[MESH_DP_SHARD] = s, c[MESH_TP] = t, c[MESH_CP] = m->coord[MESH_CP];
  return rank_of(m, c);
}

int mesh_rank_at(const mesh_t *m, int r, int s, int t) { return mesh_rank_at_pp(m, m->coord[MESH_PP], r, s, t); }

/* Which coordinates vary in group g, outermost first (the group-rank order); the others stay
 * at the rank's values. Returns their number, or the private value -1 for the world (every
 * rank). */
static int free_dims(int g, int *dims) {
  switch (g) {
  case MESH_GROUP_DP_REPLICATE: dims[0] = MESH_DP_REPLICATE; return 1;
  case MESH_GROUP_DP_SHARD: dims[0] = MESH_DP_SHARD; return 1;
  case MESH_GROUP_TP: dims[0] = MESH_TP; return 1;
  case MESH_GROUP_DP: dims[0] = MESH_DP_REPLICATE, dims[1] = MESH_DP_SHARD; return 2;
  case MESH_GROUP_PP: dims[0] = MESH_PP; return 1;
  case MESH_GROUP_CP: dims[0] = MESH_CP; return 1;
  case MESH_GROUP_DP_SHARD_CP: dims[0] = MESH_DP_SHARD, dims[1] = MESH_CP; return 2;
  case MESH_GROUP_DP_CP: dims[0] = MESH_DP_REPLICATE, dims[1] = MESH_DP_SHARD, dims[2] = MESH_CP; return 3;
  default: return -1; /* world */
  }
}

/* Members of group g containing `rank`, in group-rank order: the group's free coordinates vary
 * (the outer one slowest, r before s before c for the flattened groups), the others stay at
 * rank's values. */
static int members_of(const mesh_t *m, int g, int rank, int *ranks) {
  int c[MESH_NDIMS], fd[3], nf = free_dims(g, fd), n = 0;
  if (nf < 0) {
    for (int i = 0; i < m->world; i++) ranks[n++] = i;
    return n;
  }
  mesh_coords(m, rank, c);
  int count = 1;
  for (int i = 0; i < nf; i++) count *= m->dims[fd[i]];
  for (int k = 0; k < count; k++) {
    for (int i = nf - 1, rest = k; i >= 0; i--) { /* k in mixed radix, the last free dim fastest */
      c[fd[i]] = rest % m->dims[fd[i]];
      rest /= m->dims[fd[i]];
    }
    ranks[n++] = rank_of(m, c);
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
  int dims[MESH_NDIMS];
  dims[MESH_PP] = pp, dims[MESH_DP_REPLICATE] = dp_replicate, dims[MESH_DP_SHARD] = dp_shard, dims[MESH_TP] = tp;
  dims[MESH_CP] = 1;
  return mesh_create_dims(out, dims, rank, world, err, errlen);
}

/* "pp=2 x dp_replicate=1 x ..." over the dimensions a plan without them would not name (pp and
 * cp only when not 1): the message of a world that does not match. */
static void dims_text(char *out, size_t len, const int *d) {
  int o = 0;
  if (d[MESH_PP] != 1) o += snprintf(out + o, len - (size_t)o, "pp=%d x ", d[MESH_PP]);
  o += snprintf(out + o, len - (size_t)o, "dp_replicate=%d x dp_shard=%d x ", d[MESH_DP_REPLICATE], d[MESH_DP_SHARD]);
  if (d[MESH_CP] != 1) o += snprintf(out + o, len - (size_t)o, "cp=%d x ", d[MESH_CP]);
  snprintf(out + o, len - (size_t)o, "tp=%d", d[MESH_TP]);
}

int mesh_create_dims(mesh_t **out, const int dims[MESH_NDIMS], int rank, int world, char *err, size_t errlen) {
  *out = NULL;
  const int pp = dims[MESH_PP], dr = dims[MESH_DP_REPLICATE], ds = dims[MESH_DP_SHARD], tp = dims[MESH_TP],
            cp = dims[MESH_CP];
  if (pp < 1 || dr < 1 || ds < 1 || tp < 1 || cp < 1) {
    return err_set(err, errlen, MESH_EINVAL,
                   "mesh error: dimensions must be >= 1, got pp=%d dp_replicate=%d dp_shard=%d "
                   "tp=%d%s",
                   pp, dr, ds, tp, cp < 1 ? " cp < 1" : "");
  }
  const long long n = (long long)pp * dr * ds * tp * cp;
  if (n != world) {
    char text[160];
    dims_text(text, sizeof text, dims);
    err_set(err, errlen, 0, "mesh error: %s = %lld ranks, but the world has %d", text, n, world);
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
  for (int d = 0; d < MESH_NDIMS; d++)
    m->dims[d] = dims[d];
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
    grp->alias = -1;
  }
  if (cp == 1) { /* the same members: the same communicators */
    m->groups[MESH_GROUP_DP_SHARD_CP].alias = MESH_GROUP_DP_SHARD;
    m->groups[MESH_GROUP_DP_CP].alias = MESH_GROUP_DP;
  }
  *out = m;
  return 0;
}

/* Destroys group g's communicators; the host one only when it is not the device one; an
 * alias's belong to the group it names. */
static void group_disconnect(mesh_group_t *grp) {
  if (grp->alias < 0) {
    if (grp->host_comm != grp->comm) comm_destroy(grp->host_comm);
    comm_destroy(grp->comm);
  }
  grp->comm = grp->host_comm = NULL;
}

static void channels_disconnect(mesh_t *m) {
  mesh_pp_channels_t *ch = &m->pp;
  comm_destroy(ch->send_act);
  comm_destroy(ch->recv_act);
  comm_destroy(ch->send_grad);
  comm_destroy(ch->recv_grad);
  memset(ch, 0, sizeof *ch);
  comm_destroy(m->cp.send);
  comm_destroy(m->cp.recv);
  memset(&m->cp, 0, sizeof m->cp);
}

/* One two-rank channel from group rank src to dst of a group whose members are ranks, named
 * "<kind>.<sender's global rank>", the sender its rank 0; *slot receives it on either end. */
static int connect_pair(const int *ranks, int src, int dst, const char *kind, const char *backend,
                        struct backend *device, store_t *store, int generation, const char *host, int timeout_ms,
                        comm_t **slot, int me, char *err, size_t errlen) {
  char uid[COMM_NAME_MAX];
  snprintf(uid, sizeof uid, "%s.%d", kind, ranks[src]);
  const int members[2] = {ranks[src], ranks[dst]};
  comm_config_t cfg = {.name = uid, .rank = me == src ? 0 : 1, .size = 2, .generation = generation,
                       .store = store, .host = host, .timeout_ms = timeout_ms, .global_ranks = members,
                       .device = device};
  return comm_create(slot, backend, &cfg, err, errlen);
}

/* The cp ring's channels c -> c + 1 (mod cp), "cpring.<sender>": every member walks them in the
 * same order, as the pipeline's below. */
static int connect_cp_ring(mesh_t *m, const char *backend, struct backend *device, store_t *store, int generation,
                           const char *host, int timeout_ms, char *err, size_t errlen) {
  const int C = m->dims[MESH_CP], c = m->coord[MESH_CP];
  const int *ranks = m->groups[MESH_GROUP_CP].ranks;
  for (int k = 0; C > 1 && k < C; k++) {
    const int dst = (k + 1) % C;
    if (c != k && c != dst) continue;
    int rc = connect_pair(ranks, k, dst, "cpring", backend, device, store, generation, host, timeout_ms,
                          c == k ? &m->cp.send : &m->cp.recv, c, err, errlen);
    if (rc != COMM_OK) return rc;
  }
  return COMM_OK;
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
      comm_t **slot = kind == 0 ? (q == src ? &m->pp.send_act : &m->pp.recv_act)
                                : (q == src ? &m->pp.send_grad : &m->pp.recv_grad);
      int rc = connect_pair(pp, src, dst, kind == 0 ? "ppact" : "ppgrad", backend, device, store, generation, host,
                            timeout_ms, slot, q, err, errlen);
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
  static const int order[MESH_NGROUPS] = {MESH_GROUP_WORLD, 0, 1, 2, 3, MESH_GROUP_PP, MESH_GROUP_CP,
                                          MESH_GROUP_DP_SHARD_CP, MESH_GROUP_DP_CP};
  _Static_assert(MESH_GROUP_WORLD == 4 && MESH_GROUP_PP == 5 && MESH_GROUP_DP_CP == 8 && MESH_NGROUPS == 9,
                 "the order above lists every group once");
  for (int i = 0; i < MESH_NGROUPS; i++) {
    const int g = order[i];
    mesh_group_t *grp = &m->groups[g];
    if (grp->alias >= 0) { /* connected before it in the order */
      grp->comm = m->groups[grp->alias].comm;
      grp->host_comm = m->groups[grp->alias].host_comm;
      continue;
    }
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
    if (rc == COMM_OK && g == MESH_GROUP_CP) rc = connect_cp_ring(m, backend, device, store, generation, host,
                                                                  timeout_ms, err, errlen);
    if (rc != COMM_OK) {
      for (int k = 0; k <= i; k++) group_disconnect(&m->groups[order[k]]);
      channels_disconnect(m);
      return rc;
    }
  }
  return 0;
}

void mesh_destroy(mesh_t *m) {
  if (!m) return;
  channels_disconnect(m);
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
  if (grp->alias >= 0) return; /* its traffic is the aliased group's */
  stats_add(out, grp->comm);
  if (grp->host_comm != grp->comm) stats_add(out, grp->host_comm);
  if (g == MESH_GROUP_CP) { /* and its ring's */
    stats_add(out, m->cp.send);
    stats_add(out, m->cp.recv);
  }
}

uint64_t mesh_wait_ns(const mesh_t *m) {
  if (!m) return 0;
  comm_stats_t st;
  memset(&st, 0, sizeof st);
  for (int g = 0; g < MESH_NGROUPS; g++) {
    if (m->groups[g].alias >= 0) continue;
    stats_add(&st, m->groups[g].comm);
    if (m->groups[g].host_comm != m->groups[g].comm) stats_add(&st, m->groups[g].host_comm);
  }
  /* the pipeline channels: the time a stage waited for its input or its output's gradient */
  stats_add(&st, m->pp.send_act);
  stats_add(&st, m->pp.recv_act);
  stats_add(&st, m->pp.send_grad);
  stats_add(&st, m->pp.recv_grad);
  stats_add(&st, m->cp.send); /* the ring attention's waits for K/V blocks */
  stats_add(&st, m->cp.recv);
  return st.wait_ns;
}
