/* errfile: the worker's error file (TORCHELASTIC_ERROR_FILE) to a message, a timestamp and a
 * wish about restarting; with the exit code and the last line of its stderr, to a verdict:
 * restart or not.
 * Only regular files up to 1 MiB are read (a bigger one is reported as such, not parsed in
 * part); a message longer than the caller's buffer is cut at a UTF-8 character boundary. */
#include "launcher/errfile.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/fs.h"

#define ERRFILE_MAX (1u << 20)

/* snprintf, but never ending inside a multi-byte UTF-8 sequence when it truncates. */
static void copy_text(char *out, size_t outlen, const char *s) {
  if (!outlen) return;
  size_t n = strlen(s);
  if (n >= outlen) {
    n = outlen - 1;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--; /* s[n] continues a character */
  }
  memcpy(out, s, n);
  out[n] = 0;
}

int errfile_parse(const char *json, size_t len, char *msg, size_t msglen, char *ts, size_t tslen, int *restart,
                  char *err, size_t errlen) {
  if (msglen) msg[0] = 0;
  if (tslen) ts[0] = 0;
  if (restart) *restart = ERRFILE_RESTART_UNSAID;
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root) {
    return err_set(err, errlen, -EINVAL, "error file is not JSON");
  }
  /* Read first: a worker that asks for no restart is heard even if its message is malformed. */
  const cJSON *own = cJSON_GetObjectItemCaseSensitive(root, "meshrun");
  const cJSON *wish = cJSON_GetObjectItemCaseSensitive(own, "restart");
  if (restart && cJSON_IsFalse(wish)) *restart = ERRFILE_RESTART_NO;
  if (restart && cJSON_IsTrue(wish)) *restart = ERRFILE_RESTART_YES;
  int rc = -EINVAL;
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "message");
  if (cJSON_IsString(m)) {
    copy_text(msg, msglen, m->valuestring);
    rc = 0;
  } else if (cJSON_IsObject(m)) {
    /* torch's layout: the message object holds the text and extraInfo. */
    const cJSON *inner = cJSON_GetObjectItemCaseSensitive(m, "message");
    if (cJSON_IsString(inner)) {
      copy_text(msg, msglen, inner->valuestring);
      rc = 0;
    }
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(m, "extraInfo");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(extra, "timestamp");
    if (cJSON_IsString(t)) snprintf(ts, tslen, "%s", t->valuestring);
    else if (cJSON_IsNumber(t)) snprintf(ts, tslen, "%.0f", t->valuedouble);
  }
  if (rc) {
    err_set(err, errlen, 0, "error file has no \"message\" string");
    if (tslen) ts[0] = 0;
  }
  cJSON_Delete(root);
  return rc;
}

int errfile_read(const char *path, char *msg, size_t msglen, char *ts, size_t tslen, int *restart, char *err,
                 size_t errlen) {
  if (msglen) msg[0] = 0;
  if (tslen) ts[0] = 0;
  if (restart) *restart = ERRFILE_RESTART_UNSAID;
  /* Never blocks the agent's loop: a FIFO at the path is refused without waiting for a writer. */
  char *buf;
  size_t n;
  long long size;
  int rc = fs_read_file(path, ERRFILE_MAX, &buf, &n, &size);
  if (rc == -EINVAL)
    err_set(err, errlen, 0, "%s: not a regular file", path);
  else if (rc == -EFBIG)
    err_set(err, errlen, 0, "%s: error file is %s%lld bytes, over the %u byte limit; not read", path,
            size < 0 ? "over " : "", size < 0 ? (long long)ERRFILE_MAX : size, ERRFILE_MAX);
  else if (rc == -ENOMEM)
    err_set(err, errlen, 0, "%s: out of memory", path);
  else if (rc)
    err_set(err, errlen, 0, "%s: %s", path, strerror(-rc));
  else if (n == 0) {
    err_set(err, errlen, 0, "%s: error file is empty", path);
    free(buf);
    rc = -EINVAL;
  }
  if (rc) return rc;
  rc = errfile_parse(buf, n, msg, msglen, ts, tslen, restart, err, errlen);
  free(buf);
  return rc;
}

const char *errfile_exit_meaning(int exit_code) {
  switch (exit_code) {
  case ERRFILE_EXIT_USAGE: return "a usage or plan error";
  case ERRFILE_EXIT_CONFIG: return "EX_CONFIG, a configuration error";
  default: return NULL;
  }
}

errfile_verdict_t errfile_verdict(int exit_code, int term_signal, int restart, int import_error) {
  if (restart == ERRFILE_RESTART_NO) return ERRFILE_PERMANENT_BY_FILE;
  if (restart == ERRFILE_RESTART_YES) return ERRFILE_RESTARTABLE;
  /* 128+2 from a SIGINT is not an exit 2; a signal's code never reaches 78 either, but the
   * signal is what says how the worker ended. */
  if (term_signal) return ERRFILE_RESTARTABLE;
  if (exit_code == 1 && import_error) return ERRFILE_PERMANENT_BY_IMPORT; /* Python's exit for an exception */
  return errfile_exit_meaning(exit_code) ? ERRFILE_PERMANENT_BY_CODE : ERRFILE_RESTARTABLE;
}

int errfile_import_error(const char *text, size_t len, char *exc, size_t exclen, char *what, size_t whatlen) {
  /* The last line that is not blank. */
  while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == ' ')) len--;
  size_t start = len;
  while (start > 0 && text[start - 1] != '\n') start--;
  char line[1024];
  snprintf(line, sizeof line, "%.*s", (int)(len - start), text + start);
  static const char MODULE[] = "ModuleNotFoundError: No module named ", IMPORT[] = "ImportError: ";
  if (!strncmp(line, MODULE, sizeof MODULE - 1)) {
    snprintf(exc, exclen, "ModuleNotFoundError");
    copy_text(what, whatlen, line + sizeof MODULE - 1);
    return 1;
  }
  if (strncmp(line, IMPORT, sizeof IMPORT - 1)) return 0;
  char *msg = line + sizeof IMPORT - 1;
  if (!strncmp(msg, "cannot import ", 14)) msg += 14;
  size_t n = strlen(msg);
  char *paren = strrchr(msg, '(');
  if (paren && paren > msg && paren[-1] == ' ' && paren[1] == '/' && n > 0 && msg[n - 1] == ')') paren[-1] = '\0';
  snprintf(exc, exclen, "ImportError");
  copy_text(what, whatlen, msg);
  return 1;
}
