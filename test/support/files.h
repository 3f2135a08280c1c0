/* files: whole-file and scratch-directory helpers for C tests that build, read back or damage
 * files on disk. The file helpers fail the running cmocka test (they assert) rather than return
 * errors; the directory pair returns what a cmocka setup or teardown returns. */
#ifndef MESHRUN_TEST_FILES_H
#define MESHRUN_TEST_FILES_H

#include <stddef.h>
#include <stdint.h>

/* The whole file, malloc'ed with one spare byte past *len (callers may NUL-terminate). */
unsigned char *testfile_read(const char *path, size_t *len);
/* Creates or replaces path with len bytes of b. */
void testfile_write(const char *path, const void *b, size_t len);
/* A piece of a llama2.c tokenizer and its merge score. */
typedef struct {
  const char *s;
  float score;
} testpiece_t;
/* Writes llama2.c's tokenizer.bin to path: max_len, then <unk> <s> </s> (ids 0..2), with
 * with_bytes the 256 <0xNN> byte pieces (ids 3..258), then the n pieces of extra (score 0 for
 * all but extra's). Returns the file's size. */
size_t testfile_write_llama2c_tok(const char *path, int32_t max_len, int with_bytes, const testpiece_t *extra, int n);
/* Sends this process's stderr (fd 2) into path, replaced, until testfile_stderr_end; returns what
 * testfile_stderr_end needs to put it back. For tests that count the lines a call logs. */
int testfile_stderr_begin(const char *path);
/* Puts stderr back and returns the captured text (malloc'ed, NUL-terminated), also echoed to
 * stdout so that the test's output still shows it. */
char *testfile_stderr_end(int saved, const char *path);
/* How many times needle occurs in hay. */
int teststr_count(const char *hay, const char *needle);
/* A fresh directory /tmp/<prefix>.XXXXXX, its path into dir (len bytes): 0, or -1. */
int testdir_make(char *dir, size_t len, const char *prefix);
/* Removes dir and everything under it: 0, or -1. */
int testdir_remove(const char *dir);

#endif
