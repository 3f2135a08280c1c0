/* rng: splitmix64 (Steele, Lea, Flood 2014) with a per-stream start, Box-Muller normals. */
#include "trainer/model/rng.h"

#include <math.h>

#define SPLITMIX_GAMMA 0x9E3779B97F4A7C15ull

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += SPLITMIX_GAMMA);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void rng_init(rng_t *r, uint64_t seed, uint64_t stream) {
  uint64_t s = seed ^ 0x6A09E667F3BCC909ull;
  uint64_t a = splitmix64(&s);
  uint64_t t = stream ^ 0xBB67AE8584CAA73Bull;
  r->state = a ^ splitmix64(&t);
  r->has_spare = 0;
  r->spare = 0.0;
}

uint64_t rng_u64(rng_t *r) { return splitmix64(&r->state); }

void rng_skip(rng_t *r, uint64_t n) {
  r->state += n * SPLITMIX_GAMMA; /* modulo 2^64, as the draws themselves */
  r->has_spare = 0;
  r->spare = 0.0;
}

double rng_uniform(rng_t *r) { return (double)(rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

double rng_normal(rng_t *r) {
  if (r->has_spare) {
    r->has_spare = 0;
    return r->spare;
  }
  double u1 = rng_uniform(r), u2 = rng_uniform(r);
  if (u1 < 1e-300) u1 = 1e-300;
  double rad = sqrt(-2.0 * log(u1)), ang = 2.0 * M_PI * u2;
  r->spare = rad * sin(ang);
  r->has_spare = 1;
  return rad * cos(ang);
}

uint64_t rng_below(rng_t *r, uint64_t n) {
  if (n <= 1) return 0;
  uint64_t limit = UINT64_MAX - UINT64_MAX % n; /* reject the tail that would bias low values */
  uint64_t x;
  do x = rng_u64(r);
  while (x >= limit);
  return x % n;
}

uint64_t rng_hash_str(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}
