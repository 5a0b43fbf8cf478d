// vec/avx512.h — 16-lane fp32 vectors on AVX-512F (+F16C for fp16 rows).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
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

// fp32 -> fp16, round to nearest even (vcvtps2ph; the same bits as
// lj::f32_to_f16 for every number, any NaN for a NaN)
inline void f32_row_to_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i*)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = lj::f32_to_f16(src[i]);
}

// ---- integer lanes: one lane = one weight row's 4 consecutive byte codes
struct VecI { __m512i v; };
// dot_s8s8 flips w to u8 (w + 128) for vpdpbusd: the caller subtracts 128 * sum(x).
constexpr int S8_BIAS = 128;
inline VecI izero() { return {_mm512_setzero_si512()}; }
inline VecI iset1(int32_t b) { return {_mm512_set1_epi32(b)}; }
inline VecI load_u8x4(const uint8_t* p) { return {_mm512_loadu_si512((const void*)p)}; }
inline VecI nib_lo(VecI a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline VecI nib_hi(VecI a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }
inline VecI dot_u8s8(VecI acc, VecI w, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))}; }
inline VecI dot_s8s8(VecI acc, VecI w, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, _mm512_xor_si512(w.v, _mm512_set1_epi8((char)0x80)), _mm512_set1_epi32(x4))};
}
// The same, x4 = the 4 bytes at p, as vpdpbusd's embedded-broadcast memory
// operand (GCC does not fold _mm512_set1_epi32 of a load into {1to16}; a
// separate broadcast per product doubles the uops of the GEMM inner loop).
#define LJ_VEC_DOT_AT 1  // this tier has its own dot_u8s8_at / prep_s8 / dot_s8s8_at
inline VecI dot_u8s8_at(VecI acc, VecI w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(w.v), "m"(*(const int32_t*)p));
  return acc;
}
// dot_s8s8 split in two: prep_s8 flips a weight vector to u8 once, then
// dot_s8s8_at adds its products with the 4 int8 at p (broadcast operand) for
// each row; same result as dot_s8s8 (the caller subtracts S8_BIAS * sum(x)).
inline VecI prep_s8(VecI w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8((char)0x80))}; }
inline VecI dot_s8s8_at(VecI acc, VecI wp, const int8_t* p) { return dot_u8s8_at(acc, wp, p); }
inline VecI iadd(VecI a, VecI b) { return {_mm512_add_epi32(a.v, b.v)}; }
// K-quant super-block sums (matmul_a8.inc, tile_a8): lane-wise int32 product
// (the per-row 6-bit / int8 scale times a group's dot product), W bytes widened
// to int32 lanes, and acc + lo16(a) lo16(x2) + hi16(a) hi16(x2) per lane with
// x2 one int32 broadcast to every lane (two int16 products: vpdpwssd).
inline VecI imul(VecI a, VecI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline VecI load_u8i(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline VecI load_i8i(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline VecI pair16(VecI lo, VecI hi) { return {_mm512_or_si512(lo.v, _mm512_slli_epi32(hi.v, 16))}; }
inline VecI dot_s16x2(VecI acc, VecI a, int32_t x2) { return {_mm512_dpwssd_epi32(acc.v, a.v, _mm512_set1_epi32(x2))}; }
inline VecI isub(VecI a, int32_t b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
inline VecF cvt(VecI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VecF load_h(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline VecF load_i8(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
inline VecF load_u8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
// Bit-plane helpers (see vec/scalar.h): 16-bit lane shifts, bytewise and / or.
template <int N> inline VecI shl_bits(VecI a) { return {_mm512_slli_epi16(a.v, N)}; }
template <int N> inline VecI shr_bits(VecI a) { return {_mm512_srli_epi16(a.v, N)}; }
inline VecI and_bytes(VecI a, uint8_t m) { return {_mm512_and_si512(a.v, _mm512_set1_epi8((char)m))}; }
inline VecI or_bytes(VecI a, VecI b) { return {_mm512_or_si512(a.v, b.v)}; }
// W*A16 small-M path (see vec/scalar.h): quarter Q = bytes 16Q..16Q+15 = rows 4Q..4Q+3 x 4.
template <int Q> inline VecF u8_quarter(VecI a) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(a.v, Q)))};
}
template <int Q> inline VecF s8_quarter(VecI a) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(a.v, Q)))};
}
template <int Q> inline VecF x_quarter(const float* x) { return {_mm512_broadcast_f32x4(_mm_loadu_ps(x))}; }
template <int Q> inline VecF row_quarter(VecF d) {
  const int b = 4 * Q;
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1, b + 2, b + 2, b + 2, b + 2,
                                                  b + 3, b + 3, b + 3, b + 3), d.v)};
}
inline int64_t quarter_row(int v, int q, int l) { return 4 * q + l / 4; }
inline int quarter_j(int q, int l) { return l % 4; }

// ---- math
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF vsub(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF vdiv(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
inline VecF vabs(VecF a) { return {_mm512_abs_ps(a.v)}; }
inline float reduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }
inline VecF vround(VecF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// Sixteen horizontal reductions at once: lane i of the result = max (or sum)
// of the 16 lanes of v[i]. A transposing tree (two 128-bit-block and two
// in-block shuffle levels, 15 pairs of shuffles) instead of 16 separate
// reduce_* chains: a quarter of the instructions, none of them serial.
// Max is order-free and the callers' sums are of integers below 2^24, so the
// results equal the one-vector reductions bit for bit.
#define LJ_VEC_REDUCE16 1
template <bool SUM>
inline VecF reduce16(const VecF* v) {
  const auto op = [](__m512 a, __m512 b) { return SUM ? _mm512_add_ps(a, b) : _mm512_max_ps(a, b); };
  __m512 w[8], u[4], s[2];
  for (int i = 0; i < 8; ++i)  // blocks 0,1: v[2i]'s partials, blocks 2,3: v[2i+1]'s
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44), _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 4; ++i)  // block k: v[4i + k]'s four partials
    u[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: two partials of v[8i + k], two of v[8i + 4 + k]
    s[i] = op(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 4k + j: v[k + 4j]
  const __m512 z = op(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(idx, z)};
}
// a / b where b > 0, else 0
inline VecF div_or_zero(VecF a, VecF b) {
  return {_mm512_maskz_div_ps(_mm512_cmp_ps_mask(b.v, _mm512_setzero_ps(), _CMP_GT_OQ), a.v, b.v)};
}
// W lanes holding integers in [-128, 127] -> W int8
inline void store_i8(int8_t* p, VecF a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(a.v))); }
// exp: same reduction and polynomial as the AVX2 tier (see vec/avx2.h);
// 2^n applied with vscalefps, which overflows to inf and underflows through
// the subnormals to 0 like libm, so the clamp only keeps n in range.
inline VecF vexp(VecF a) {
  __m512 x = _mm512_min_ps(_mm512_max_ps(a.v, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};
}

}  // namespace LJ_NS
