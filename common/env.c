/* env: see env.h. */
#include "common/env.h"

#include <errno.h>
#include <stdlib.h>
#include <strings.h>

const char *env_str(const char *name) {
  const char *s = getenv(name);
  return s && *s ? s : NULL;
}

const char *env_text(const char *name) {
  const char *s = getenv(name);
  return s ? s : "(unset)";
}

int env_int(const char *name, long lo, long hi, int dflt, int *out) {
  *out = dflt;
  const char *s = env_str(name);
  if (!s) return 0;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -EINVAL;
  *out = (int)v;
  return 0;
}

int env_double(const char *name, double lo, double hi, double dflt, double *out) {
  *out = dflt;
  const char *s = env_str(name);
  if (!s) return 0;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo && v <= hi)) return -EINVAL;
  *out = v;
  return 0;
}

double env_fraction(const char *name) {
  double f = 1;
  env_double(name, 0, 1, 1, &f); /* a value it refuses leaves the default */
  return f > 0 && f < 1 ? f : 1;
}

int env_bool(const char *name, int dflt, int *out) {
  *out = dflt;
  const char *s = env_str(name);
  if (!s) return 0;
  static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
  for (int i = 0; i < 4; i++) {
    if (!strcasecmp(s, yes[i]) || !strcasecmp(s, no[i])) {
      *out = !strcasecmp(s, yes[i]);
      return 0;
    }
  }
  return -EINVAL;
}
