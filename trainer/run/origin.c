/* origin: where a divergence came from (see origin.h). */
#include "trainer/run/origin.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The index of the first tensor (model order) whose gradient in this rank's flat buffer is not
 * finite, or the tensor count when none; -1 without a flat buffer or host memory. */
static int first_bad_tensor(train_t *t) {
  float *g = model_grads(t->m);
  const size_t np = model_num_params(t->m);
  float *h = g ? malloc(np * sizeof *h) : NULL;
  if (!h) return -1;
  t->be->to_host(t->be, h, g, np * sizeof *h);
  const int n = model_num_tensors(t->m);
  int i = 0;
  for (; i < n; i++) {
    const model_tensor_t *x = model_tensor(t->m, i);
    size_t k = 0;
    while (k < x->numel && isfinite(h[x->offset + k])) k++;
    if (k < x->numel) break;
  }
  free(h);
  return i;
}

/* World rank r's host from the straggler table, "?" when it has none. */
static const char *host_of(const straggler_t *sg, int r) {
  return sg && sg->hosts && r < sg->size ? sg->hosts + (size_t)r * STRAGGLER_HOST_MAX : "?";
}

/* Per rank over the world (origin_gradient): its world rank, its first non-finite tensor before
 * the reduction (the strategy's sums of its own gradients; under the serial strategy, which
 * reduces nothing, its flat buffer) and after it (the flat buffer); the tensor count when none,
 * -1 when not known. */
enum { G_RANK, G_BEFORE, G_AFTER, G_N };

/* The rank and tensor named from the gathered table all (n ranks): the lowest world rank whose
 * own gradient was not finite, with its first such tensor; else the first tensor after the
 * reduction. */
static void name_from(train_t *t, const straggler_t *sg, const float *all, int n, int s, char *err, size_t errlen) {
  const int nt = model_num_tensors(t->m);
  const size_t len = strlen(err);
  int rank = -1, before = nt, after = nt, known = 0, flat = 0;
  for (int q = 0; q < n; q++) {
    const float *r = all + (size_t)q * G_N;
    known |= r[G_BEFORE] >= 0;
    flat |= r[G_AFTER] >= 0;
    if (r[G_BEFORE] >= 0 && (int)r[G_BEFORE] < nt && (rank < 0 || (int)r[G_RANK] < rank)) {
      rank = (int)r[G_RANK];
      before = (int)r[G_BEFORE];
    }
    if (r[G_AFTER] >= 0 && (int)r[G_AFTER] < after) after = (int)r[G_AFTER];
  }
  if (rank >= 0)
    snprintf(err + len, errlen - len, "; first non-finite gradient: rank %d (host %s), %s, before the reduction "
             "(step %d's)", rank, host_of(sg, rank), model_tensor(t->m, before)->name, s + 1);
  else if (after < nt)
    snprintf(err + len, errlen - len, "; first non-finite gradient: %s (step %d's, after the reduction over ranks, %s)",
             model_tensor(t->m, after)->name, s + 1,
             known ? "each rank's own gradients were finite before it" : "which hides the rank it came from");
  else if (known)
    snprintf(err + len, errlen - len, "; each rank's own gradients were finite at the reduction of step %d's last "
             "micro-batch", s + 1);
  else if (!flat)
    snprintf(err + len, errlen - len, "; this strategy keeps no flat gradient buffer to name the tensor");
}

/* The gradient's part of origin_name: every rank's first non-finite tensors gathered over the
 * job (world), when the sums and gradients are step s's. */
static void name_gradient(train_t *t, const straggler_t *sg, int world_rank, int s, char *err, size_t errlen) {
  const size_t len = strlen(err);
  if (len >= errlen) return;
  if (t->diverged_step != s) {
    snprintf(err + len, errlen - len, "; step %d's gradients are gone (read at step %d; a console line at every "
             "step, log.interval 1, names the first non-finite gradient)", t->diverged_step + 1, s + 1);
    return;
  }
  comm_t *w = t->mesh ? mesh_host_comm(t->mesh, "world") : NULL;
  const int n = w ? comm_size(w) : 1;
  int before = -1;
  const int after = first_bad_tensor(t), rc = dp_local_first_bad(t->dp, &before);
  float mine[G_N] = {(float)world_rank, (float)(rc == 1 ? after : rc ? -1 : before), (float)after}, *all = mine;
  if (n > 1 && (!(all = malloc((size_t)n * sizeof mine)) || comm_all_gather(w, mine, all, G_N, DT_F32))) {
    free(all);
    return;
  }
  name_from(t, sg, all, n, s, err, errlen);
  if (all != mine) free(all);
}

void origin_name(train_t *t, const straggler_t *sg, int world_rank, int s, char *err, size_t errlen) {
  if (!t->diverged || t->pp) return;
  if (t->diverged_what == 2) {
    name_gradient(t, sg, world_rank, s, err, errlen);
    return;
  }
  if (t->diverged_what != 1) return;
  const int n = t->dpc ? comm_size(t->dpc) : 1;
  float mine[2] = {(float)world_rank, (float)t->diverged_micro}, *all = mine;
  if (n > 1) { /* (n, 2): each rank's world rank and first bad micro-batch */
    if (!(all = malloc((size_t)n * sizeof mine))) return;
    if (comm_all_gather(t->dpc, mine, all, 2, DT_F32)) {
      free(all);
      return;
    }
  }
  int first = -1, micro = 0; /* the lowest world rank whose own loss was not finite */
  for (int q = 0; q < n; q++)
    if (all[2 * q + 1] > 0 && (first < 0 || (int)all[2 * q] < first)) {
      first = (int)all[2 * q];
      micro = (int)all[2 * q + 1];
    }
  if (all != mine) free(all);
  const size_t len = strlen(err);
  if (first < 0 || len >= errlen) return;
  snprintf(err + len, errlen - len, "; first non-finite: rank %d (host %s), its own loss (micro-batch %d)", first,
           host_of(sg, first), micro);
}
