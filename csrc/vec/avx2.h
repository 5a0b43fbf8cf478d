// vec/avx2.h — 8-lane fp32 vectors on AVX2 + FMA (+F16C for fp16 rows).
#pragma once
#include <immintrin.h>
#include "half.h"

namespace LJ_NS {

struct VecF { __m256 v; };
constexpr int W = 8;

inline VecF zero() { return {_mm256_setzero_ps()}; }
inline VecF set1(float a) { return {_mm256_set1_ps(a)}; }
inline VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, VecF a) { _mm256_storeu_ps(p, a.v); }
inline VecF add(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF mul(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float reduce_add(VecF a) {
  __m128 lo = _mm256_castps256_ps128(a.v);
  __m128 hi = _mm256_extractf128_ps(a.v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline void f16_row_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
  for (; i < n; ++i) dst[i] = lj::f16_to_f32(src[i]);
}

}  // namespace LJ_NS
