/* fs: mkdir -p, one component at a time (see fs.h). */
#include "common/fs.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

int fs_mkdir_p(const char *dir, char *failed, size_t failedlen) {
  char buf[PATH_MAX];
  if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) return -ENAMETOOLONG;
  if (!buf[0]) return 0;
  /* Each prefix that ends at a '/' (after the first character: "/" itself exists), then the
   * whole path. */
  for (char *p = buf + 1;; p++) {
    if (*p != '/' && *p) continue;
    char was = *p;
    *p = 0;
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
      int e = errno;
      if (failed && failedlen) snprintf(failed, failedlen, "%s", buf);
      return -e;
    }
    if (!was) return 0;
    *p = was;
  }
}

int fs_mkdir_parent(const char *path, char *failed, size_t failedlen) {
  char buf[PATH_MAX];
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -ENAMETOOLONG;
  char *slash = strrchr(buf, '/');
  if (!slash || slash == buf) return 0; /* no directory part, or the root */
  *slash = 0;
  return fs_mkdir_p(buf, failed, failedlen);
}
