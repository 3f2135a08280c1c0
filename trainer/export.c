/* export: the `trainer export` program (see export.h). */
#include "trainer/export.h"

#include "trainer/weights.h"

int export_run(const plan_t *p, const char *weights, const char *format, const char *out, char *err, size_t errlen) {
  return weights_export(&p->model, weights, format, out, err, errlen);
}
