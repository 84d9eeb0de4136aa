// Vectors of 16 float32 lanes (GCC vector extensions; one AVX-512 register with -march=native) and
// the arithmetic Tandem's CPU kernels share: loads that widen bf16 in registers and a vectorised exp.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tandem_vec {

constexpr int64_t W = 16;  // float32 lanes of one vector (one AVX-512 register)
typedef float f16v __attribute__((vector_size(W * sizeof(float))));
typedef int32_t i16v __attribute__((vector_size(W * sizeof(int32_t))));

// exp of 16 floats <= 0 (Cephes' expf: x = n ln2 + g, exp(g) by a degree-7 polynomial, times 2^n).
// Within 2 ulp of expf. Inputs below -87 (and -inf) give ~1e-38 instead of a smaller number or 0:
// callers for which that matters mask them (exp16_or_zero).
inline f16v exp16(f16v x) {
  const f16v lo = f16v{} - 87.0f;
  x = x < lo ? lo : x;
  const f16v fx = x * 1.44269504088896341f + 0.5f;
  f16v n = __builtin_convertvector(__builtin_convertvector(fx, i16v), f16v);  // truncation toward 0
  n = n > fx ? n - 1.0f : n;  // floor(fx), fx may be negative
  const f16v g = x - n * 0.693359375f + n * 2.12194440e-4f;
  f16v y = f16v{} + 1.9875691500e-4f;
  y = y * g + 1.3981999507e-3f;
  y = y * g + 8.3334519073e-3f;
  y = y * g + 4.1665795894e-2f;
  y = y * g + 1.6666665459e-1f;
  y = y * g + 5.0000001201e-1f;
  y = y * g * g + g + 1.0f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  return y * reinterpret_cast<const f16v&>(bits);
}

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f16v load16(const at::BFloat16* p) {  // bf16 is the high half of a float32
  typedef uint16_t u16v __attribute__((vector_size(W * sizeof(uint16_t))));
  u16v h;
  std::memcpy(&h, p, sizeof(h));
  const i16v bits = __builtin_convertvector(h, i16v) << 16;
  return reinterpret_cast<const f16v&>(bits);
}

// exp16 with inputs below -87 (and -inf) giving exactly 0: a filtered token keeps zero mass.
inline f16v exp16_or_zero(f16v x) {
  const f16v lo = f16v{} - 87.0f;
  return x < lo ? f16v{} : exp16(x);
}

// Horizontal max and sum of 16 lanes, as a tree of halvings (fixed order).
inline float hmax(f16v v) {
  f16v t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = t > v ? t : v;
  t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = t > v ? t : v;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = t > v ? t : v;
  return std::max(v[0], v[1]);
}

inline float hsum(f16v v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return v[0] + v[1];
}

}  // namespace tandem_vec
