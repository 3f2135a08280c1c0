/* origin: where a divergence came from (see origin.h). */
#include "trainer/run/origin.h"

#include <math.h>
#include <stdint.h>
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

/* Per rank over the world (name_gradient): its world rank and pipeline rank (0 without pp), its
 * first non-finite tensor before the reduction (the strategy's sums of its own gradients; under
 * the serial strategy, which reduces nothing, its flat buffer) and after it (the flat buffer):
 * the index in its own model (-1 when none) and the name, and whether each is known. Indices
 * compare between ranks of one pipeline stage only (a model holds its chunks' tensors), so the
 * names travel too: the record goes through an all-gather as bytes (a multiple of floats). */
enum { NAME_LEN = sizeof ((model_tensor_t *)0)->name };
typedef struct {
  int32_t rank, stage, known_before, known_after, before, after;
  char before_name[NAME_LEN], after_name[NAME_LEN];
} grad_rec_t;
_Static_assert(sizeof(grad_rec_t) % sizeof(float) == 0, "grad_rec_t travels as floats");

/* The rank and tensor named from the gathered records all (n ranks): the lowest world rank whose
 * own gradient was not finite, with its first such tensor; else the first tensor after the
 * reduction (the lowest pipeline rank's first: the model's order, except under interleaving,
 * where a rank's stages are not consecutive). */
static void name_from(const straggler_t *sg, const grad_rec_t *all, int n, int s, char *err, size_t errlen) {
  const size_t len = strlen(err);
  const grad_rec_t *before = NULL, *after = NULL;
  int known = 0, flat = 0;
  for (int q = 0; q < n; q++) {
    const grad_rec_t *r = &all[q];
    known |= r->known_before;
    flat |= r->known_after;
    if (r->before >= 0 && (!before || r->rank < before->rank)) before = r;
    if (r->after >= 0 && (!after || r->stage < after->stage || (r->stage == after->stage && r->after < after->after)))
      after = r;
  }
  if (before)
    snprintf(err + len, errlen - len, "; first non-finite gradient: rank %d (host %s), %s, before the reduction "
             "(step %d's)", before->rank, host_of(sg, before->rank), before->before_name, s + 1);
  else if (after)
    snprintf(err + len, errlen - len, "; first non-finite gradient: %s (step %d's, after the reduction over ranks, %s)",
             after->after_name, s + 1,
             known ? "each rank's own gradients were finite before it" : "which hides the rank it came from");
  else if (known)
    snprintf(err + len, errlen - len, "; each rank's own gradients were finite at the reduction of step %d's last "
             "micro-batch", s + 1);
  else if (!flat)
    snprintf(err + len, errlen - len, "; this strategy keeps no flat gradient buffer to name the tensor");
}

/* Tensor i of t's model (the tensor count: none) into *index (-1: none) and name. */
static void rec_tensor(train_t *t, int i, int32_t *index, char *name) {
  const int nt = model_num_tensors(t->m);
  *index = i >= 0 && i < nt ? i : -1;
  if (*index >= 0) snprintf(name, NAME_LEN, "%s", model_tensor(t->m, i)->name);
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
  if (rc) before = rc == 1 ? after : -1;
  grad_rec_t mine = {.rank = world_rank, .stage = t->pp ? comm_rank(t->ppc) : 0, .known_before = before >= 0,
                     .known_after = after >= 0}, *all = &mine;
  rec_tensor(t, before, &mine.before, mine.before_name);
  rec_tensor(t, after, &mine.after, mine.after_name);
  const size_t nf = sizeof mine / sizeof(float);
  if (n > 1 && (!(all = malloc((size_t)n * sizeof mine)) || comm_all_gather(w, &mine, all, nf, DT_F32))) {
    free(all);
    return;
  }
  name_from(sg, all, n, s, err, errlen);
  if (all != &mine) free(all);
}

void origin_name(train_t *t, const straggler_t *sg, int world_rank, int s, char *err, size_t errlen) {
  if (!t->diverged) return;
  if (t->diverged_what == 2) {
    name_gradient(t, sg, world_rank, s, err, errlen);
    return;
  }
  if (t->diverged_what != 1) return;
  /* the ranks that share the loss: dp's and cp's, and under pp every stage's (the last one's
   * ranks have losses, the others 0 micro-batches) */
  comm_t *c = t->pp ? mesh_host_comm(t->mesh, "world") : t->dpc;
  const int n = c ? comm_size(c) : 1;
  float mine[2] = {(float)world_rank, (float)t->diverged_micro}, *all = mine;
  if (n > 1) { /* (n, 2): each rank's world rank and first bad micro-batch */
    if (!(all = malloc((size_t)n * sizeof mine))) return;
    if (comm_all_gather(c, mine, all, 2, DT_F32)) {
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
