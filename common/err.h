/* err: writing an error message into a caller's buffer, the one way every library module of
 * meshrun reports what went wrong (docs/STYLE.md, "Errors"). The message names the cause;
 * the return value is the caller's code, so a failure is one statement:
 *
 *     if (n < 0) return err_set(err, errlen, -EINVAL, "%s: negative size %d", path, n);
 *
 * err may be NULL or errlen 0 (the caller wants only the code). Messages longer than the
 * buffer are cut. */
#ifndef MESHRUN_ERR_H
#define MESHRUN_ERR_H

#include <stdarg.h>
#include <stddef.h>

int err_set(char *err, size_t errlen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
int err_vset(char *err, size_t errlen, int code, const char *fmt, va_list ap) __attribute__((format(printf, 4, 0)));

#endif
