/* fs: mkdir -p, one component at a time (see fs.h). */
#include "common/fs.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int fs_mkdir_p(const char *dir, char *failed, size_t failedlen) {
  char buf[PATH_MAX];
  if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) return -ENAMETOOLONG;
  if (!buf[0]) return 0;
  /* Already there, the usual case: a lookup takes no lock, a mkdir that finds the name taken
   * locks the parent directory first (contended when many processes share it). */
  struct stat st;
  if (stat(buf, &st) == 0 && S_ISDIR(st.st_mode)) return 0;
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

int fs_read_file(const char *path, size_t max, char **out, size_t *len, long long *size) {
  *out = NULL;
  *len = 0;
  if (size) *size = 0;
  /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just after). */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return -errno;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return -EINVAL;
  }
  if (size) *size = (long long)st.st_size;
  if ((unsigned long long)st.st_size > max) {
    close(fd);
    return -EFBIG;
  }
  /* Room for what fstat promised, one byte more to notice growth past max, and the NUL. */
  size_t cap = (size_t)st.st_size + 2, n = 0;
  char *buf = malloc(cap);
  if (!buf) {
    close(fd);
    return -ENOMEM;
  }
  for (;;) {
    if (n + 1 == cap) { /* full: the file grew since fstat */
      if (n > max) break;
      size_t ncap = cap * 2 > max + 2 ? max + 2 : cap * 2;
      char *nb = realloc(buf, ncap);
      if (!nb) {
        free(buf);
        close(fd);
        return -ENOMEM;
      }
      buf = nb;
      cap = ncap;
    }
    ssize_t k = read(fd, buf + n, cap - 1 - n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      int e = errno;
      free(buf);
      close(fd);
      return -e;
    }
    if (k == 0) break;
    n += (size_t)k;
  }
  close(fd);
  if (n > max) {
    free(buf);
    if (size) *size = -1;
    return -EFBIG;
  }
  buf[n] = 0;
  *out = buf;
  *len = n;
  return 0;
}

void fs_unlink_if_there(const char *path) {
  if (access(path, F_OK) == 0) unlink(path);
}
