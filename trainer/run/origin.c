/* origin: where a divergence came from (see origin.h). */
#include "trainer/run/origin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void origin_name(const train_t *t, const straggler_t *sg, int world_rank, char *err, size_t errlen) {
  if (!t->diverged || t->pp || t->diverged_what != 1) return;
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
