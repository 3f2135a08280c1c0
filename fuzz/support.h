/* support: what the fuzz targets share: an in-memory file to hand a reader a path, a scratch
 * directory for readers that want a directory, and splitting an input at NUL bytes.
 *
 * Readers here take paths, not buffers, so each input is written to a memfd and named as
 * /proc/self/fd/N (regular, seekable, mappable, never on disk). Directories live under /dev/shm
 * when it is writable (else $TMPDIR or /tmp), are made once per process and removed at exit
 * (also after a sanitizer report).
 * Nothing here parses anything of the project's: the targets call the real readers. */
#ifndef MESHRUN_FUZZ_SUPPORT_H
#define MESHRUN_FUZZ_SUPPORT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* A promise of the reader that an input broke: abort, so libFuzzer keeps the input. */
#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "%s:%d: broken promise: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                  \
    }                                                                           \
  } while (0)

/* A memfd named tag (for /proc listings); path gets "/proc/self/fd/N". Aborts on failure. */
typedef struct {
  int fd;
  char path[64];
} fuzz_memfile_t;
void fuzz_memfile_init(fuzz_memfile_t *m, const char *tag);
/* Replaces the file's content with len bytes of data. Aborts on failure. */
void fuzz_memfile_set(fuzz_memfile_t *m, const void *data, size_t len);

/* The process's scratch directory (created on first call, removed at exit). */
const char *fuzz_tmpdir(void);
/* Creates or replaces path with len bytes of data. Aborts on failure. */
void fuzz_write_file(const char *path, const void *data, size_t len);
/* The whole file (malloc'ed, NUL-terminated past *len), or NULL. */
unsigned char *fuzz_read_file(const char *path, size_t *len);

/* Prints "fuzz: " and the message on stderr when MESHRUN_FUZZ_VERBOSE is set (to see why seeds
 * are refused: run the target on a file with that variable set). */
void fuzz_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Splits data at its first `max - 1` NUL bytes into at most max parts, each copied into its own
 * malloc'ed, NUL-terminated buffer (part i: parts[i], lens[i]). Returns the number of parts
 * (>= 1). Free with fuzz_parts_free. */
int fuzz_split(const uint8_t *data, size_t len, int max, char **parts, size_t *lens);
void fuzz_parts_free(char **parts, int n);

#endif
