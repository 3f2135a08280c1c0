/* env: reading environment variables with one set of rules, for the launcher and the trainer.
 *
 * Unset and empty are the same: the default. A value that is set but does not parse (or lies
 * outside the range the caller allows) is not silently taken as the default: the reader returns
 * -EINVAL and stores the default, and the caller decides whether that is an error (RANK=abc is;
 * a tuning knob may just warn). Integers are decimal; booleans are 1/0, true/false, yes/no, on/off
 * in any case. */
#ifndef MESHRUN_ENV_H
#define MESHRUN_ENV_H

#ifdef __cplusplus
extern "C" { /* the cuda backend (C++) reads LOCAL_RANK with it */
#endif

/* The value, or NULL when unset or empty. */
const char *env_str(const char *name);
/* The value for a message: "(unset)" when unset, never NULL. */
const char *env_text(const char *name);
/* 0 with *out = the value (dflt when unset), or -EINVAL with *out = dflt when the value is not an
 * integer in [lo, hi]. */
int env_int(const char *name, long lo, long hi, int dflt, int *out);
/* The same for a real number in [lo, hi]. */
int env_double(const char *name, double lo, double hi, double dflt, double *out);
/* The same for a boolean (*out 0 or 1). */
int env_bool(const char *name, int dflt, int *out);
/* A fault's slow-down factor: the value when it is a number in (0, 1), else 1 (unset, empty,
 * not a number, out of range: no slow-down). */
double env_fraction(const char *name);

#ifdef __cplusplus
}
#endif

#endif
