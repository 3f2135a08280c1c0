/* support: memfds, the scratch directory and NUL splitting for the fuzz targets (support.h).
 * Failures here are the harness's, not the code under test's, so they abort with a message. */
#include "fuzz/support.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <sanitizer/common_interface_defs.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static void die(const char *what, const char *arg) {
  fprintf(stderr, "fuzz support: %s %s: %s\n", what, arg, strerror(errno));
  abort();
}

static int write_all(int fd, const void *data, size_t len) {
  const char *p = data;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

void fuzz_memfile_init(fuzz_memfile_t *m, const char *tag) {
  m->fd = memfd_create(tag, MFD_CLOEXEC);
  if (m->fd < 0) die("memfd_create", tag);
  snprintf(m->path, sizeof m->path, "/proc/self/fd/%d", m->fd);
}

void fuzz_memfile_set(fuzz_memfile_t *m, const void *data, size_t len) {
  if (ftruncate(m->fd, 0) != 0 || lseek(m->fd, 0, SEEK_SET) != 0 || write_all(m->fd, data, len) != 0)
    die("write", m->path);
}

static char g_tmpdir[256];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path);
}

static void rm_tmpdir(void) {
  if (g_tmpdir[0]) nftw(g_tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

const char *fuzz_tmpdir(void) {
  if (g_tmpdir[0]) return g_tmpdir;
  const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  snprintf(g_tmpdir, sizeof g_tmpdir, "%s/meshrun-fuzz.XXXXXX", base);
  if (!mkdtemp(g_tmpdir)) die("mkdtemp", g_tmpdir);
  atexit(rm_tmpdir);
  __sanitizer_set_death_callback(rm_tmpdir); /* a sanitizer report ends the process without atexit */
  return g_tmpdir;
}

void fuzz_write_file(const char *path, const void *data, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) die("open", path);
  if (write_all(fd, data, len) != 0) die("write", path);
  close(fd);
}

unsigned char *fuzz_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  unsigned char *buf = NULL;
  long n = -1;
  if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
      (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  if (buf) {
    buf[n] = 0;
    *len = (size_t)n;
  }
  return buf;
}

void fuzz_note(const char *fmt, ...) {
  static int verbose = -1;
  if (verbose < 0) verbose = getenv("MESHRUN_FUZZ_VERBOSE") != NULL;
  if (!verbose) return;
  va_list ap;
  va_start(ap, fmt);
  fputs("fuzz: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

int fuzz_split(const uint8_t *data, size_t len, int max, char **parts, size_t *lens) {
  int n = 0;
  size_t start = 0;
  for (;;) {
    const uint8_t *nul = n + 1 < max ? memchr(data + start, 0, len - start) : NULL;
    size_t end = nul ? (size_t)(nul - data) : len;
    parts[n] = malloc(end - start + 1);
    if (!parts[n]) die("malloc", "part");
    memcpy(parts[n], data + start, end - start);
    parts[n][end - start] = 0;
    lens[n++] = end - start;
    if (!nul) return n;
    start = end + 1;
  }
}

void fuzz_parts_free(char **parts, int n) {
  for (int i = 0; i < n; i++)
    free(parts[i]);
}
