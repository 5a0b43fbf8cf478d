// vec/avx512.h — 16-lane fp32 vectors on AVX-512F (+F16C for fp16 rows).
#pragma once
#include <immintrin.h>
#include "half.h"

namespace LJ_NS {

struct VecF { __m512 v; };
constexpr int W = 16;

inline VecF zero() { return {_mm512_setzero_ps()}; }
inline VecF set1(float a) { return {_mm512_set1_ps(a)}; }
inline VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, VecF a) { _mm512_storeu_ps(p, a.v); }
inline VecF add(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF mul(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float reduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }

inline void f16_row_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
  for (; i < n; ++i) dst[i] = lj::f16_to_f32(src[i]);
}

}  // namespace LJ_NS
