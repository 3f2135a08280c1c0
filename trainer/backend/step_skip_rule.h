/* step_skip_rule: what the backend's step_skip decides (backend.h), written once for every
 * backend: the host's calls it as a function, a device backend from its one-thread kernel. A
 * file whose compiler needs qualifiers for code that runs on its device defines SKIP_RULE_FN
 * (the functions' qualifiers) before it includes this one. */
#ifndef MESHRUN_STEP_SKIP_RULE_H
#define MESHRUN_STEP_SKIP_RULE_H

#include <math.h>

#include "trainer/backend/backend.h"

#ifndef SKIP_RULE_FN
#define SKIP_RULE_FN static inline
#endif

/* The z-score of x over the n values of w, with their mean and population std: two passes in
 * double; 0 while n < SKIP_MIN or the values are all equal. */
SKIP_RULE_FN double skip_z(const float *w, int n, double x, double *mean, double *std) {
  double sum = 0.0, dev = 0.0;
  for (int i = 0; i < n; i++) sum += w[i];
  const double mu = n > 0 ? sum / n : 0.0;
  for (int i = 0; i < n; i++) dev += (w[i] - mu) * (w[i] - mu);
  *mean = mu;
  *std = n > 0 ? sqrt(dev / n) : 0.0;
  return n >= SKIP_MIN && *std > 0.0 ? (x - mu) / *std : 0.0;
}

/* The verdict on a step of loss l and norm g, in backend.h's order; the window takes an updating
 * step's finite values, the total counts the skips; st->skip says whether the update is made. */
SKIP_RULE_FN void skip_rule(double l, double g, int nonfinite, double loss_z, double norm_z, skip_window_t *win,
                            skip_verdict_t *out, adamw_step_t *st) {
  double lm, ls, gm, gs;
  const double lz = skip_z(win->loss, win->n, l, &lm, &ls), gz = skip_z(win->norm, win->n, g, &gm, &gs);
  skip_verdict_t v;
  v.why = SKIP_NONE;
  v.z = v.mean = v.std = 0.0;
  if (nonfinite && !isfinite(l)) {
    v.why = SKIP_LOSS_NONFINITE;
  } else if (nonfinite && !isfinite(g)) {
    v.why = SKIP_NORM_NONFINITE;
  } else if (loss_z > 0 && isfinite(l) && lz > loss_z) {
    v.why = SKIP_LOSS_Z, v.z = lz, v.mean = lm, v.std = ls;
  } else if (norm_z > 0 && isfinite(g) && gz > norm_z) {
    v.why = SKIP_NORM_Z, v.z = gz, v.mean = gm, v.std = gs;
  }
  const float lf = (float)l, gf = (float)g;
  if (v.why) {
    win->total++;
  } else if (isfinite(lf) && isfinite(gf)) {
    win->loss[win->next] = lf;
    win->norm[win->next] = gf;
    win->next = (win->next + 1) % SKIP_WINDOW;
    if (win->n < SKIP_WINDOW) win->n++;
  }
  v.total = win->total;
  *out = v;
  st->skip = v.why != SKIP_NONE;
}

#endif
