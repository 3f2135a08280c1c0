/* fs: mkdir -p, one component at a time (see fs.h). */
#include "common/fs.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
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

int fs_dirname(const char *path, char *out, size_t len) {
  if (snprintf(out, len, "%s", path) >= (int)len) return -ENAMETOOLONG;
  char *slash = strrchr(out, '/');
  if (!slash) snprintf(out, len, ".");
  else if (slash == out) out[1] = '\0';
  else *slash = '\0';
  return 0;
}

int fs_mkdir_parent(const char *path, char *failed, size_t failedlen) {
  char buf[PATH_MAX];
  int rc = fs_dirname(path, buf, sizeof buf);
  if (rc) return rc;
  if (!strcmp(buf, ".") || !strcmp(buf, "/")) return 0; /* no directory part, or the root */
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

static int add_path(char ***v, size_t *n, size_t *cap, const char *path) {
  if (*n + 1 >= *cap) {
    size_t c = *cap ? *cap * 2 : 8;
    char **nv = realloc(*v, c * sizeof *nv);
    if (!nv) return -ENOMEM;
    *v = nv;
    *cap = c;
  }
  if (!((*v)[*n] = strdup(path))) return -ENOMEM;
  (*v)[++*n] = NULL;
  return 0;
}

int fs_expand_paths(const char *lines, char ***out, size_t *n, char *bad, size_t badlen) {
  char **v = NULL;
  size_t count = 0, cap = 0;
  int rc = 0;
  *out = NULL;
  *n = 0;
  for (const char *a = lines; *a && rc == 0;) {
    size_t k = strcspn(a, "\n");
    char *line = strndup(a, k);
    a += k + (a[k] == '\n');
    if (!line) {
      rc = -ENOMEM;
      break;
    }
    if (!line[strcspn(line, "*?[")]) {
      rc = add_path(&v, &count, &cap, line);
    } else {
      glob_t g;
      int grc = glob(line, 0, NULL, &g); /* sorted: shard order is the data's order */
      if (grc == GLOB_NOMATCH) {
        snprintf(bad, badlen, "%s", line);
        rc = -ENOENT;
      } else if (grc != 0) {
        rc = grc == GLOB_NOSPACE ? -ENOMEM : -EIO;
        snprintf(bad, badlen, "%s", line);
      }
      for (size_t i = 0; rc == 0 && i < g.gl_pathc; i++) rc = add_path(&v, &count, &cap, g.gl_pathv[i]);
      globfree(&g); /* whatever glob returned: it may hold a partial list after an error */
    }
    free(line);
  }
  if (rc == 0 && !v && !(v = calloc(1, sizeof *v))) rc = -ENOMEM; /* no lines: an empty list */
  if (rc) {
    fs_paths_free(v);
    return rc;
  }
  *out = v;
  *n = count;
  return 0;
}

void fs_paths_free(char **paths) {
  if (!paths) return;
  for (char **p = paths; *p; p++) free(*p);
  free(paths);
}
