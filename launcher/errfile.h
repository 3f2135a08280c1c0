/* errfile: what a failed worker says about its failure: the JSON error file it may write at
 * TORCHELASTIC_ERROR_FILE, and whether its exit code says the failure is permanent.
 *
 * Accepts torch's format {"message": {"message": "...", "extraInfo": {"timestamp": "..."}}}
 * and a plain {"message": "..."}. Only reads; the worker writes it, the agent chooses the
 * path (launcher/workers) and reports the message in the failure summary (launcher/agent).
 *
 * Permanent failures: restarting cannot help (a bad plan, a missing file), so the agent ends
 * the job at once instead of spending restarts on it. A worker says so in either of two ways:
 *   - meshrun's own key in the error file, beside torch's: {"meshrun": {"restart": false}};
 *   - without any file, by its exit code: 2 (a usage or plan error: the trainer's, argparse's
 *     and the shells' convention) or 78 (EX_CONFIG of BSD sysexits.h, a configuration error,
 *     for a program whose 2 means something else). Every other code, and every death by a
 *     signal, is worth a restart.
 *   - a Python worker that exits 1 with an uncaught ModuleNotFoundError or ImportError as the
 *     last line of its stderr: its interpreter lacks a module (or a module lacks a name), which
 *     no restart installs.
 * The file wins over the code: {"meshrun": {"restart": true}} makes an exit 2 or 78 a normal,
 * restartable failure (for programs that use those codes for transient faults). Only the JSON
 * values false and true count; anything else leaves the decision to the exit code. */
#ifndef MESHRUN_ERRFILE_H
#define MESHRUN_ERRFILE_H

#include <stddef.h>

/* "meshrun": {"restart": ...} of an error file: said false, said true, or not said at all. */
enum { ERRFILE_RESTART_UNSAID = -1, ERRFILE_RESTART_NO = 0, ERRFILE_RESTART_YES = 1 };

/* The exit codes that mean "permanent, do not restart" (see above). */
#define ERRFILE_EXIT_USAGE 2
#define ERRFILE_EXIT_CONFIG 78

/* Parses JSON text. Fills msg (the message; "" if none) and ts (extraInfo.timestamp; "" if
 * none). Returns 0, or -EINVAL (not JSON, or no "message") with the reason in err. *restart
 * (may be NULL) gets ERRFILE_RESTART_NO or _YES when the document is JSON with "meshrun":
 * {"restart": false} or true, even without a message, else ERRFILE_RESTART_UNSAID. */
int errfile_parse(const char *json, size_t len, char *msg, size_t msglen, char *ts, size_t tslen, int *restart,
                  char *err, size_t errlen);
/* Reads path and parses it. -ENOENT when the file does not exist (the worker wrote none),
 * -EFBIG over 1 MiB, -EINVAL for an empty or non-regular file or what errfile_parse rejects;
 * err names the path and the fault. msg and ts are "" on any error. */
int errfile_read(const char *path, char *msg, size_t msglen, char *ts, size_t tslen, int *restart, char *err,
                 size_t errlen);

typedef enum {
  ERRFILE_RESTARTABLE = 0,     /* a restart may help */
  ERRFILE_PERMANENT_BY_FILE,   /* the error file said "restart": false */
  ERRFILE_PERMANENT_BY_CODE,   /* exit code 2 or 78, and the error file did not say "restart": true */
  ERRFILE_PERMANENT_BY_IMPORT, /* exit 1 after a Python import error, the file saying nothing */
} errfile_verdict_t;
/* The verdict on a failed worker: restart is what errfile_read gave (ERRFILE_RESTART_UNSAID
 * when there was no file), exit_code its code (128+signal for a signal), term_signal the
 * signal that killed it or 0, import_error what errfile_import_error said of its stderr. */
errfile_verdict_t errfile_verdict(int exit_code, int term_signal, int restart, int import_error);
/* Whether the last line of a worker's stderr (text, len bytes: its tail) is Python's report of
 * an uncaught import failure, "ModuleNotFoundError: No module named 'x'" or "ImportError: ...".
 * Returns 1 and fills exc (the exception's name) and what (for ModuleNotFoundError the module,
 * quoted as Python quotes it: 'x'; for ImportError the message, without a leading "cannot
 * import " and a trailing " (/path/of/module.py)"), else 0. */
int errfile_import_error(const char *text, size_t len, char *exc, size_t exclen, char *what, size_t whatlen);
/* What a permanent exit code means, as a phrase for the failure summary ("a usage or plan
 * error"), or NULL for any code that is not one. */
const char *errfile_exit_meaning(int exit_code);

#endif
