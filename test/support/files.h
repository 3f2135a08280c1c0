/* files: whole-file and scratch-directory helpers for C tests that build, read back or damage
 * files on disk. The file helpers fail the running cmocka test (they assert) rather than return
 * errors; the directory pair returns what a cmocka setup or teardown returns. */
#ifndef MESHRUN_TEST_FILES_H
#define MESHRUN_TEST_FILES_H

#include <stddef.h>

/* The whole file, malloc'ed with one spare byte past *len (callers may NUL-terminate). */
unsigned char *testfile_read(const char *path, size_t *len);
/* Creates or replaces path with len bytes of b. */
void testfile_write(const char *path, const void *b, size_t len);
/* A fresh directory /tmp/<prefix>.XXXXXX, its path into dir (len bytes): 0, or -1. */
int testdir_make(char *dir, size_t len, const char *prefix);
/* Removes dir and everything under it: 0, or -1. */
int testdir_remove(const char *dir);

#endif
