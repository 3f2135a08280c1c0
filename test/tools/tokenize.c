// deps: trainer/formats/tokenizer.c common/fs.c common/err.c
/* tokenize: trainer/formats/tokenizer from the command line, for the integration tests (C against
 * Python's tokenizers) and for looking at a tokenizer by hand.
 *
 *   tokenize TOKENIZER FILE             the ids of FILE's bytes, one per line
 *   tokenize --decode TOKENIZER IDSFILE the text of the ids (whitespace-separated) in IDSFILE
 *   tokenize --info TOKENIZER           vocab_size, bos and eos, one "key value" a line
 *   tokenize --json TOKENIZER           a llama2.c tokenizer.bin as tokenizer.json, to stdout
 *
 * TOKENIZER is a tokenizer.json, a folder holding one, or a llama2.c tokenizer.bin. Encoding
 * prints "tokenize: B bytes -> N tokens in S s" to stderr. Errors print the module's one-line
 * message and exit 1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/fs.h"
#include "trainer/formats/tokenizer.h"

#define MAX_INPUT (1ull << 32)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *slurp(const char *path, size_t *len) {
  char *buf;
  int rc = fs_read_file(path, MAX_INPUT, &buf, len, NULL);
  if (rc) {
    fprintf(stderr, "tokenize: %s: %s\n", path, strerror(-rc));
    return NULL;
  }
  return buf;
}

static int encode(const tokenizer_t *t, const char *path) {
  size_t len, n;
  char *text = slurp(path, &len), err[512];
  int32_t *ids;
  if (!text) return 1;
  double t0 = now();
  int rc = tokenizer_encode(t, text, len, &ids, &n, err, sizeof err);
  double dt = now() - t0;
  free(text);
  if (rc) {
    fprintf(stderr, "tokenize: %s: %s\n", path, err);
    return 1;
  }
  for (size_t i = 0; i < n; i++) printf("%d\n", ids[i]);
  fprintf(stderr, "tokenize: %zu bytes -> %zu tokens in %.3f s\n", len, n, dt);
  free(ids);
  return fflush(stdout) == 0 ? 0 : 1;
}

static int decode(const tokenizer_t *t, const char *path) {
  size_t len, n = 0, cap = 1024, tl;
  char *text = slurp(path, &len), *out;
  int32_t *ids = malloc(cap * sizeof *ids);
  if (!text || !ids) {
    free(text);
    free(ids);
    return 1;
  }
  for (char *p = text, *end;; p = end) {
    errno = 0;
    long v = strtol(p, &end, 10);
    if (end == p) {
      while (*end == ' ' || *end == '\n' || *end == '\t' || *end == '\r') end++;
      if (*end) {
        fprintf(stderr, "tokenize: %s: not an id at byte %zu\n", path, (size_t)(end - text));
        free(text);
        free(ids);
        return 1;
      }
      break;
    }
    if (errno || v < INT32_MIN || v > INT32_MAX) v = -1;
    if (n == cap) {
      int32_t *nb = realloc(ids, 2 * cap * sizeof *ids);
      if (!nb) {
        fprintf(stderr, "tokenize: out of memory\n");
        free(text);
        free(ids);
        return 1;
      }
      ids = nb;
      cap *= 2;
    }
    ids[n++] = (int32_t)v;
  }
  free(text);
  int rc = tokenizer_decode(t, ids, n, &out, &tl);
  if (rc) {
    for (size_t i = 0; i < n; i++)
      if (!tokenizer_token_bytes(t, ids[i], -1, NULL)) {
        fprintf(stderr, "tokenize: %s: id %d (position %zu) is out of range [0, %d)\n", path, ids[i], i,
                tokenizer_vocab_size(t));
        break;
      }
    free(ids);
    return 1;
  }
  free(ids);
  fwrite(out, 1, tl, stdout);
  free(out);
  return fflush(stdout) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  int mode = 0; /* 0 encode, 1 decode, 2 info, 3 json */
  if (argc >= 2 && strcmp(argv[1], "--decode") == 0) mode = 1;
  if (argc >= 2 && strcmp(argv[1], "--info") == 0) mode = 2;
  if (argc >= 2 && strcmp(argv[1], "--json") == 0) mode = 3;
  if (argc != (mode >= 2 ? 3 : mode == 1 ? 4 : 3)) {
    fprintf(stderr, "usage: tokenize TOKENIZER FILE | tokenize --decode TOKENIZER IDSFILE | tokenize --info "
                    "TOKENIZER | tokenize --json TOKENIZER.bin\n");
    return 2;
  }
  const char *tpath = argv[mode ? 2 : 1];
  tokenizer_t *t;
  char err[512];
  if (tokenizer_load(&t, tpath, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  int rc;
  if (mode == 2) {
    printf("vocab_size %d\nbos %d\neos %d\n", tokenizer_vocab_size(t), tokenizer_bos(t), tokenizer_eos(t));
    rc = 0;
  } else if (mode == 3) {
    char *json;
    size_t n;
    rc = tokenizer_llama2c_json(t, &json, &n, err, sizeof err) != 0;
    if (rc) {
      fprintf(stderr, "%s\n", err);
    } else {
      rc = fwrite(json, 1, n, stdout) != n || fflush(stdout) != 0;
      free(json);
    }
  } else {
    rc = mode == 1 ? decode(t, argv[3]) : encode(t, argv[2]);
  }
  tokenizer_free(t);
  return rc;
}
