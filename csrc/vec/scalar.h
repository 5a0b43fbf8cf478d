// vec/scalar.h — the one-lane "vector" of the reference tier. Kernels are
// written once against VecF; with this header they are plain scalar C++.
#pragma once
#include <cmath>
#include "half.h"

namespace LJ_NS {

struct VecF { float v; };
constexpr int W = 1;

inline VecF zero() { return {0.f}; }
inline VecF set1(float a) { return {a}; }
inline VecF load(const float* p) { return {*p}; }
inline void store(float* p, VecF a) { *p = a.v; }
inline VecF add(VecF a, VecF b) { return {a.v + b.v}; }
inline VecF mul(VecF a, VecF b) { return {a.v * b.v}; }
// a*b + c (not fused: the reference tier rounds twice, like naive C)
inline VecF fma(VecF a, VecF b, VecF c) { return {a.v * b.v + c.v}; }
inline float reduce_add(VecF a) { return a.v; }

inline void f16_row_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lj::f16_to_f32(src[i]);
}

}  // namespace LJ_NS
