/* files: whole-file helpers for C tests that build, read back or damage files on disk.
 * Both fail the running cmocka test (they assert) rather than return errors. */
#ifndef MESHRUN_TEST_FILES_H
#define MESHRUN_TEST_FILES_H

#include <stddef.h>

/* The whole file, malloc'ed with one spare byte past *len (callers may NUL-terminate). */
unsigned char *testfile_read(const char *path, size_t *len);
/* Creates or replaces path with len bytes of b. */
void testfile_write(const char *path, const void *b, size_t len);

#endif
