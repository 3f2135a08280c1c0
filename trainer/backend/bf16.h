/* bf16: the bfloat16 storage format on the host (the top 16 bits of an IEEE fp32).
 *
 * Rounding from fp32 is to nearest, ties to even, as PyTorch's and CUDA's __float2bfloat16;
 * a NaN stays a (quiet) NaN, infinities stay infinite, and values past the largest bf16 round
 * to infinity. Widening is exact. Arithmetic never happens in bf16: kernels widen, compute in
 * fp32 and round once when they store. Plain C, so host code of every room (the cpu backend,
 * the comm's reductions, checkpoints, tests) shares one definition. */
#ifndef MESHRUN_BF16_H
#define MESHRUN_BF16_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline bf16_t bf16_from_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x0040u); /* NaN: keep it, quiet */
  u += 0x7fffu + ((u >> 16) & 1u); /* round half to even */
  return (bf16_t)(u >> 16);
}

/* fp32 rounded to the nearest bf16 value, kept as fp32 (what a bf16 store then load gives). */
static inline float bf16_round(float f) { return bf16_to_f32(bf16_from_f32(f)); }

static inline void bf16_from_f32_n(bf16_t *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = bf16_from_f32(src[i]);
}
static inline void bf16_to_f32_n(float *dst, const bf16_t *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

#endif
