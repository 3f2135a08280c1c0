/* errfile: the worker's error file (TORCHELASTIC_ERROR_FILE) to a message and a timestamp.
 * Files over 1 MiB are read only in their first MiB (then they fail to parse, which is reported). */
#include "launcher/errfile.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ERRFILE_MAX (1u << 20)

int errfile_parse(const char *json, size_t len, char *msg, size_t msglen, char *ts, size_t tslen, char *err,
                  size_t errlen) {
  if (msglen) msg[0] = 0;
  if (tslen) ts[0] = 0;
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root) {
    snprintf(err, errlen, "error file is not JSON");
    return -EINVAL;
  }
  int rc = -EINVAL;
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "message");
  if (cJSON_IsString(m)) {
    snprintf(msg, msglen, "%s", m->valuestring);
    rc = 0;
  } else if (cJSON_IsObject(m)) {
    /* torch's layout: the message object holds the text and extraInfo. */
    const cJSON *inner = cJSON_GetObjectItemCaseSensitive(m, "message");
    if (cJSON_IsString(inner)) {
      snprintf(msg, msglen, "%s", inner->valuestring);
      rc = 0;
    }
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(m, "extraInfo");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(extra, "timestamp");
    if (cJSON_IsString(t)) snprintf(ts, tslen, "%s", t->valuestring);
    else if (cJSON_IsNumber(t)) snprintf(ts, tslen, "%.0f", t->valuedouble);
  }
  if (rc) snprintf(err, errlen, "error file has no \"message\" string");
  cJSON_Delete(root);
  return rc;
}

int errfile_read(const char *path, char *msg, size_t msglen, char *ts, size_t tslen, char *err, size_t errlen) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    int e = errno;
    snprintf(err, errlen, "%s: %s", path, strerror(e));
    return -e;
  }
  char *buf = malloc(ERRFILE_MAX);
  if (!buf) {
    fclose(f);
    snprintf(err, errlen, "%s: out of memory", path);
    return -ENOMEM;
  }
  size_t n = fread(buf, 1, ERRFILE_MAX, f);
  fclose(f);
  int rc = errfile_parse(buf, n, msg, msglen, ts, tslen, err, errlen);
  free(buf);
  return rc;
}
