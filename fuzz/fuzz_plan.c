// deps: trainer/plan/plan.c trainer/plan/pipeline.c common/fs.c common/err.c fuzz/support.c trainer/backend/attention_registry.c
// max_len: 8192
/* fuzz_plan: the trainer's plan reader (plan_load, plan_resolve, plan_to_json) on arbitrary text.
 *
 * Input: the plan file's bytes, then optionally NUL-separated "--set key.path=value" strings
 * (at most 8). The file part goes through a memfd to plan_load as a path, as the trainer gives
 * it. A plan that loads is resolved for a few world sizes, and must survive the round trip
 * plan_to_json -> plan_load -> plan_to_json unchanged (plan.c promises exact numbers for it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/support.h"
#include "trainer/plan/plan.h"

#define MAX_PARTS 9

static fuzz_memfile_t g_file;

static void check_round_trip(const plan_t *p) {
  char *a = plan_to_json(p);
  if (!a) return; /* out of memory: nothing to compare */
  fuzz_memfile_set(&g_file, a, strlen(a));
  static plan_t q;
  char err[512];
  if (plan_load(&q, g_file.path, NULL, 0, err, sizeof err) != 0) {
    fprintf(stderr, "plan_to_json output does not load: %s\n%s\n", err, a);
    abort();
  }
  char *b = plan_to_json(&q);
  if (b && strcmp(a, b) != 0) {
    fprintf(stderr, "plan_to_json round trip differs:\n%s\n%s\n", a, b);
    abort();
  }
  free(a);
  free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int init;
  if (!init) {
    fuzz_memfile_init(&g_file, "plan.json");
    init = 1;
  }
  char *parts[MAX_PARTS];
  size_t lens[MAX_PARTS];
  int n = fuzz_split(data, size, MAX_PARTS, parts, lens);
  fuzz_memfile_set(&g_file, parts[0], lens[0]);
  static plan_t p, r; /* large (paths); static keeps them off the stack */
  char err[512];
  if (plan_load(&p, g_file.path, (const char *const *)(parts + 1), n - 1, err, sizeof err) != 0) {
    fuzz_note("%s", err);
  } else {
    check_round_trip(&p);
    static const int worlds[] = {1, 2, 6, 8};
    for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
      r = p;
      if (plan_resolve(&r, worlds[i], err, sizeof err) == 0) {
        fuzz_note("world %d: resolved", worlds[i]);
        free(plan_to_json(&r));
      } else {
        fuzz_note("world %d: %s", worlds[i], err);
      }
    }
  }
  fuzz_parts_free(parts, n);
  return 0;
}
