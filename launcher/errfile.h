/* errfile: reads the JSON error file a worker may write at TORCHELASTIC_ERROR_FILE.
 *
 * Accepts torch's format {"message": {"message": "...", "extraInfo": {"timestamp": "..."}}}
 * and a plain {"message": "..."}. Only reads; the worker writes it, the agent chooses the
 * path (launcher/workers) and reports the message in the failure summary (launcher/agent).
 *
 * meshrun's own key, beside torch's: {"meshrun": {"restart": false}} says that restarting
 * cannot help (a bad plan, a missing file): the agent then ends the job at once instead of
 * spending restarts on it. Only the JSON value false asks that; anything else is a restart. */
#ifndef MESHRUN_ERRFILE_H
#define MESHRUN_ERRFILE_H

#include <stddef.h>

/* Parses JSON text. Fills msg (the message; "" if none) and ts (extraInfo.timestamp; "" if
 * none). Returns 0, or -EINVAL (not JSON, or no "message") with the reason in err. *restart
 * (may be NULL) gets 0 when the document is JSON with "meshrun": {"restart": false}, even
 * without a message, else 1. */
int errfile_parse(const char *json, size_t len, char *msg, size_t msglen, char *ts, size_t tslen, int *restart,
                  char *err, size_t errlen);
/* Reads path and parses it. -ENOENT when the file does not exist (the worker wrote none),
 * -EFBIG over 1 MiB, -EINVAL for an empty or non-regular file or what errfile_parse rejects;
 * err names the path and the fault. msg and ts are "" on any error. */
int errfile_read(const char *path, char *msg, size_t msglen, char *ts, size_t tslen, int *restart, char *err,
                 size_t errlen);

#endif
