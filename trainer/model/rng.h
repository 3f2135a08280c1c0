/* rng: deterministic, platform-independent random numbers for initialization and data.
 *
 * splitmix64 streams keyed by (seed, stream id): the same key gives the same sequence on every
 * machine and backend, so weights do not depend on how they are later sharded (each tensor
 * draws from its own stream, keyed by a hash of its name). */
#ifndef MESHRUN_RNG_H
#define MESHRUN_RNG_H

#include <stdint.h>

typedef struct {
  uint64_t state;
  int has_spare; /* Box-Muller yields two normals; the second is kept here */
  double spare;
} rng_t;

void rng_init(rng_t *r, uint64_t seed, uint64_t stream);
uint64_t rng_u64(rng_t *r);
double rng_uniform(rng_t *r); /* [0, 1) with 53 random bits */
double rng_normal(rng_t *r);  /* standard normal */
/* Advances a stream past n values of rng_u64 at once (splitmix64's state moves by a constant per
 * draw), so that parts of one long stream can be drawn in parallel. rng_normal draws two u64 per
 * pair of normals: from a state with no spare, skipping 2k u64 skips 2k normals. Clears the spare. */
void rng_skip(rng_t *r, uint64_t n);
uint64_t rng_below(rng_t *r, uint64_t n); /* uniform in [0, n), unbiased */
uint64_t rng_hash_str(const char *s);     /* FNV-1a 64 of a string, to key streams by name */

#endif
