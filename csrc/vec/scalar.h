// vec/scalar.h — the one-lane "vector" of the reference tier. Kernels are
// written once against VecF; with this header they are plain scalar C++.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "half.h"

namespace LJ_NS {

struct VecF { float v; };
constexpr int W = 1;

inline VecF zero() { return {0.f}; }
inline VecF set1(float a) { return {a}; }
// Unaligned, like the SIMD tiers' loadu/storeu: an int8 KV row keeps its fp32
// scale after hd codes, so with an odd head_dim it is not 4-byte aligned
// (UBSan's report, make sanitize). memcpy compiles to the same one move.
inline VecF load(const float* p) { float v; std::memcpy(&v, p, 4); return {v}; }
inline void store(float* p, VecF a) { std::memcpy(p, &a.v, 4); }
inline VecF add(VecF a, VecF b) { return {a.v + b.v}; }
inline VecF mul(VecF a, VecF b) { return {a.v * b.v}; }
// a*b + c (not fused: the reference tier rounds twice, like naive C)
inline VecF fma(VecF a, VecF b, VecF c) { return {a.v * b.v + c.v}; }
inline float reduce_add(VecF a) { return a.v; }

inline void f16_row_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lj::f16_to_f32(src[i]);
}

inline void f32_row_to_f16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lj::f32_to_f16(src[i]);
}

// ---- integer lanes: one lane = one weight row's 4 consecutive byte codes
struct VecI { int32_t v; };
constexpr int S8_BIAS = 0;  // dot_s8s8 is exact here
inline VecI izero() { return {0}; }
inline VecI iset1(int32_t b) { return {b}; }
inline VecI load_u8x4(const uint8_t* p) { uint32_t u; std::memcpy(&u, p, 4); return {(int32_t)u}; }
inline VecI nib_lo(VecI a) { return {(int32_t)((uint32_t)a.v & 0x0F0F0F0Fu)}; }
inline VecI nib_hi(VecI a) { return {(int32_t)(((uint32_t)a.v >> 4) & 0x0F0F0F0Fu)}; }
// acc + sum_j u8(w_j) * s8(x_j) over the 4 bytes of each lane
inline VecI dot_u8s8(VecI acc, VecI w, int32_t x4) {
  const uint32_t u = (uint32_t)w.v;
  int32_t s = acc.v;
  for (int j = 0; j < 4; ++j) s += (int32_t)((u >> (8 * j)) & 0xFF) * (int32_t)(int8_t)(x4 >> (8 * j));
  return {s};
}
// acc + sum_j s8(w_j) * s8(x_j) + S8_BIAS * sum_j s8(x_j)
inline VecI dot_s8s8(VecI acc, VecI w, int32_t x4) {
  int32_t s = acc.v;
  for (int j = 0; j < 4; ++j) s += (int32_t)(int8_t)(w.v >> (8 * j)) * (int32_t)(int8_t)(x4 >> (8 * j));
  return {s};
}
inline VecI iadd(VecI a, VecI b) { return {a.v + b.v}; }
// K-quant super-block sums (matmul_a8.inc, tile_a8): the lane's int32 product,
// a byte widened to the lane, the lane's two int16 halves (lo | hi << 16),
// and acc + lo16(a) lo16(x2) + hi16(a) hi16(x2).
inline VecI imul(VecI a, VecI b) { return {(int32_t)((uint32_t)a.v * (uint32_t)b.v)}; }
inline VecI load_u8i(const uint8_t* p) { return {(int32_t)*p}; }
inline VecI load_i8i(const int8_t* p) { return {(int32_t)*p}; }
inline VecI pair16(VecI lo, VecI hi) { return {(int32_t)(((uint32_t)lo.v & 0xFFFFu) | ((uint32_t)hi.v << 16))}; }
inline VecI dot_s16x2(VecI acc, VecI a, int32_t x2) {
  return {acc.v + (int32_t)(int16_t)a.v * (int32_t)(int16_t)x2 + (int32_t)(int16_t)(a.v >> 16) * (int32_t)(int16_t)(x2 >> 16)};
}
inline VecI isub(VecI a, int32_t b) { return {a.v - b}; }
inline VecF cvt(VecI a) { return {(float)a.v}; }
inline VecF load_h(const uint16_t* p) { return {lj::f16_to_f32(*p)}; }
inline VecF load_i8(const int8_t* p) { return {(float)*p}; }
inline VecF load_u8(const uint8_t* p) { return {(float)*p}; }
// Bit-plane helpers of the 5- and 6-bit packed kinds (matmul_packed.inc): shifts of
// the lane by whole bits (bits cross bytes; callers mask what they keep),
// bytewise and / or.
template <int N> inline VecI shl_bits(VecI a) { return {(int32_t)((uint32_t)a.v << N)}; }
template <int N> inline VecI shr_bits(VecI a) { return {(int32_t)((uint32_t)a.v >> N)}; }
inline VecI and_bytes(VecI a, uint8_t m) { return {(int32_t)((uint32_t)a.v & (0x01010101u * m))}; }
inline VecI or_bytes(VecI a, VecI b) { return {a.v | b.v}; }
// The W*A16 small-M path (matmul_a16.inc): a VecI's bytes as 4 float vectors
// ("quarters": lanes (row, j) on the wide tiers, here byte Q of the row),
// the 4 activations a quarter's lanes multiply, and a row-layout vector
// spread to a quarter's lanes.
template <int Q> inline VecF u8_quarter(VecI a) { return {(float)(((uint32_t)a.v >> (8 * Q)) & 0xFF)}; }
template <int Q> inline VecF s8_quarter(VecI a) { return {(float)(int8_t)((uint32_t)a.v >> (8 * Q))}; }
template <int Q> inline VecF x_quarter(const float* x) { return {x[Q]}; }
template <int Q> inline VecF row_quarter(VecF d) { return d; }
// Lane l of quarter Q of vector v holds row v W + ..., element j of the 4.
inline int64_t quarter_row(int v, int q, int l) { return v; }
inline int quarter_j(int q, int l) { return q; }

// ---- math
inline VecF vmax(VecF a, VecF b) { return {a.v > b.v ? a.v : b.v}; }
inline VecF vsub(VecF a, VecF b) { return {a.v - b.v}; }
inline VecF vdiv(VecF a, VecF b) { return {a.v / b.v}; }
inline VecF vexp(VecF a) { return {std::exp(a.v)}; }  // the reference: libm expf
inline VecF vmin(VecF a, VecF b) { return {a.v < b.v ? a.v : b.v}; }
inline VecF vabs(VecF a) { return {std::fabs(a.v)}; }
inline float reduce_max(VecF a) { return a.v; }
inline VecF vround(VecF a) { return {std::nearbyint(a.v)}; }  // half to even (default FP mode)
// W lanes holding integers in [-128, 127] -> W int8
inline void store_i8(int8_t* p, VecF a) { *p = (int8_t)(int)a.v; }

}  // namespace LJ_NS
