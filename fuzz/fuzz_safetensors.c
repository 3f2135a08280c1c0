// deps: trainer/formats/safetensors.c fuzz/support.c common/err.c
// max_len: 16384
/* fuzz_safetensors: the safetensors reader (st_open) on arbitrary files.
 *
 * Input: the file's bytes, handed to st_open as /proc/self/fd/N of a memfd (mapped like a file
 * on disk). A file that opens must keep st_open's promises (safetensors.h): every tensor's byte
 * length is its shape's element count times 4, tensors come in offset order without overlap,
 * every name and metadata key is found again by lookup, and every data byte is readable. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/support.h"
#include "trainer/formats/safetensors.h"

static volatile unsigned char g_sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static fuzz_memfile_t file;
  if (!file.path[0]) fuzz_memfile_init(&file, "model.safetensors");
  fuzz_memfile_set(&file, data, size);
  st_file_t *f = NULL;
  char err[512];
  if (st_open(&f, file.path, err, sizeof err) != 0) {
    fuzz_note("%s", err);
    CHECK(f == NULL && err[0]);
    return 0;
  }
  const char *prev_end = NULL;
  for (int i = 0; i < st_num_tensors(f); i++) {
    const st_tensor_t *t = st_tensor_at(f, i);
    CHECK(t && t->name && t->ndim >= 0 && t->ndim <= ST_MAX_DIMS);
    CHECK(st_numel(t) * 4 == t->nbytes);
    CHECK(!prev_end || (const char *)t->data >= prev_end);
    prev_end = (const char *)t->data + t->nbytes;
    const st_tensor_t *found = st_find(f, t->name);
    CHECK(found && !strcmp(found->name, t->name));
    unsigned char x = 0;
    for (size_t b = 0; b < t->nbytes; b++)
      x ^= ((const unsigned char *)t->data)[b];
    g_sink = x;
  }
  CHECK(st_tensor_at(f, st_num_tensors(f)) == NULL);
  fuzz_note("opened: %d tensors", st_num_tensors(f));
  st_close(f);
  return 0;
}
