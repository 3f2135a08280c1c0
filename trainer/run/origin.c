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

/* The gradient's part of origin_name: the first tensor over the job (world), when the gradients
 * are step s's. */
static void name_gradient(train_t *t, int s, char *err, size_t errlen) {
  const size_t len = strlen(err);
  if (len >= errlen) return;
  if (t->diverged_step != s) {
    snprintf(err + len, errlen - len, "; step %d's gradients are gone (read at step %d; a console line at every "
             "step, log.interval 1, names the first non-finite gradient)", t->diverged_step + 1, s + 1);
    return;
  }
  comm_t *w = t->mesh ? mesh_host_comm(t->mesh, "world") : NULL;
  const int n = w ? comm_size(w) : 1;
  float mine = (float)first_bad_tensor(t), *all = &mine;
  if (n > 1 && (!(all = malloc((size_t)n * sizeof mine)) || comm_all_gather(w, &mine, all, 1, DT_F32))) {
    free(all);
    return;
  }
  int first = model_num_tensors(t->m);
  for (int q = 0; q < n; q++)
    if (all[q] >= 0 && (int)all[q] < first) first = (int)all[q];
  const int none = all[0] < 0; /* no flat buffer: the same on every rank */
  if (all != &mine) free(all);
  if (none)
    snprintf(err + len, errlen - len, "; this strategy keeps no flat gradient buffer to name the tensor");
  else if (first < model_num_tensors(t->m))
    snprintf(err + len, errlen - len, "; first non-finite gradient: %s (step %d's, after the reduction over "
             "ranks, which hides the rank it came from)", model_tensor(t->m, first)->name, s + 1);
}

void origin_name(train_t *t, const straggler_t *sg, int world_rank, int s, char *err, size_t errlen) {
  if (!t->diverged || t->pp) return;
  if (t->diverged_what == 2) {
    name_gradient(t, s, err, errlen);
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
  const char *host = sg && sg->hosts && first < sg->size ? sg->hosts + (size_t)first * STRAGGLER_HOST_MAX : "?";
  snprintf(err + len, errlen - len, "; first non-finite: rank %d (host %s), its own loss (micro-batch %d)", first,
           host, micro);
}
