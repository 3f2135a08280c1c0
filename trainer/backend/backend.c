/* backend: the registry's lookups, and creation by name.
 *
 * Which backends exist is trainer/backend/registry.c's list; this file holds no kernels and
 * names no backend, so that the model and the trainer never name a backend's file. The fatal
 * path of device errors is fatal.c's. */
#include "common/err.h"
#include "trainer/backend/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const backend_entry_t *backend_find(const char *name) {
  for (int i = 0; name && backend_registry[i]; i++)
    if (!strcmp(backend_registry[i]->name, name)) return backend_registry[i];
  return NULL;
}

void backend_names(char *out, size_t len, const char *sep, int built_only) {
  size_t n = 0;
  if (len) out[0] = '\0';
  for (int i = 0; backend_registry[i] && n < len; i++) {
    if (built_only && !backend_registry[i]->create) continue;
    int k = snprintf(out + n, len - n, "%s%s", n ? sep : "", backend_registry[i]->name);
    if (k < 0) break;
    n += (size_t)k;
  }
}

backend_t *backend_create(const char *name, int threads, char *err, size_t errlen) {
  if (!name) name = "cpu";
  const backend_entry_t *e = backend_find(name);
  if (e && e->create) return e->create(-1, threads, err, errlen);
  if (err && errlen) {
    if (e) {
      err_set(err, errlen, 0, "backend error: \"%s\" is not available in this build (%s); use \"cpu\"", name,
              e->absent);
    } else {
      char known[256];
      backend_names(known, sizeof known, ", ", 1);
      err_set(err, errlen, 0, "backend error: unknown backend \"%s\" (known: %s)", name, known);
    }
  }
  return NULL;
}

void backend_destroy(backend_t *be) {
  if (be && be->destroy) be->destroy(be);
}
