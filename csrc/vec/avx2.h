// vec/avx2.h — 8-lane fp32 vectors on AVX2 + FMA (+F16C for fp16 rows).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
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

// fp32 -> fp16, round to nearest even (vcvtps2ph; the same bits as
// lj::f32_to_f16 for every number, any NaN for a NaN)
inline void f32_row_to_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = lj::f32_to_f16(src[i]);
}

// ---- integer lanes: one lane = one weight row's 4 consecutive byte codes
struct VecI { __m256i v; };
constexpr int S8_BIAS = 0;  // the sign trick keeps dot_s8s8 exact
inline VecI izero() { return {_mm256_setzero_si256()}; }
inline VecI iset1(int32_t b) { return {_mm256_set1_epi32(b)}; }
inline VecI load_u8x4(const uint8_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
inline VecI nib_lo(VecI a) { return {_mm256_and_si256(a.v, _mm256_set1_epi8(0x0F))}; }
inline VecI nib_hi(VecI a) { return {_mm256_and_si256(_mm256_srli_epi16(a.v, 4), _mm256_set1_epi8(0x0F))}; }
// u8 x s8 pairs -> s16 (no saturation for codes <= 15: 2*15*127 < 2^15) -> s32
inline VecI dot_u8s8(VecI acc, VecI w, int32_t x4) {
  const __m256i p16 = _mm256_maddubs_epi16(w.v, _mm256_set1_epi32(x4));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))};
}
// s8 x s8 via |w| (u8) x sign(x, w): 2*128*127 < 2^15, never saturates
inline VecI dot_s8s8(VecI acc, VecI w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w.v), _mm256_sign_epi8(x, w.v));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))};
}
inline VecI iadd(VecI a, VecI b) { return {_mm256_add_epi32(a.v, b.v)}; }
// 16-bit partial sums (no vpdpbusd here): vpmaddubsw's int16 pair sums are
// added in int16 lanes (VecW, 2 per int32 lane of VecI) and widened by one
// vpmaddwd (x 1, pairs -> int32) once per several products instead of once
// per product: 1 + 1/n multiply-port ops per 32 products instead of 2 (the
// multiply ports bound the W*A8 inner loop on AVX2: Zen 1 runs 256-bit
// multiplies at half rate). Exact while every int16 lane stays in range,
// which the caller bounds (tile_a8's acc16_chunks); the int32 sums, and so
// every result, are those of dot_u8s8.
#define LJ_VEC_ACC16 1
struct VecW { __m256i v; };
inline VecW wzero() { return {_mm256_setzero_si256()}; }
inline VecW dot_u8s8_w(VecW acc, VecI w, const int8_t* p) {
  int32_t x4;
  std::memcpy(&x4, p, 4);
  return {_mm256_add_epi16(acc.v, _mm256_maddubs_epi16(w.v, _mm256_set1_epi32(x4)))};
}
inline VecI widen_add(VecI acc, VecW a) { return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(a.v, _mm256_set1_epi16(1)))}; }
// K-quant super-block sums (see vec/avx512.h; vpmaddwd + add for vpdpwssd)
inline VecI imul(VecI a, VecI b) { return {_mm256_mullo_epi32(a.v, b.v)}; }
inline VecI load_u8i(const uint8_t* p) { return {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))}; }
inline VecI load_i8i(const int8_t* p) { return {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))}; }
inline VecI pair16(VecI lo, VecI hi) { return {_mm256_or_si256(lo.v, _mm256_slli_epi32(hi.v, 16))}; }
inline VecI dot_s16x2(VecI acc, VecI a, int32_t x2) {
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(a.v, _mm256_set1_epi32(x2)))};
}
inline VecI isub(VecI a, int32_t b) { return {_mm256_sub_epi32(a.v, _mm256_set1_epi32(b))}; }
inline VecF cvt(VecI a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline VecF load_h(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }
inline VecF load_i8(const int8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)))}; }
inline VecF load_u8(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)))}; }
// Bit-plane helpers (see vec/scalar.h): 16-bit lane shifts, bytewise and / or.
template <int N> inline VecI shl_bits(VecI a) { return {_mm256_slli_epi16(a.v, N)}; }
template <int N> inline VecI shr_bits(VecI a) { return {_mm256_srli_epi16(a.v, N)}; }
inline VecI and_bytes(VecI a, uint8_t m) { return {_mm256_and_si256(a.v, _mm256_set1_epi8((char)m))}; }
inline VecI or_bytes(VecI a, VecI b) { return {_mm256_or_si256(a.v, b.v)}; }
// W*A16 small-M path (see vec/scalar.h): quarter Q = bytes 8Q..8Q+7 = rows 2Q, 2Q+1 x 4.
template <int Q> inline __m128i quarter_bytes(VecI a) {
  __m128i h = _mm256_extracti128_si256(a.v, Q / 2);
  return Q % 2 ? _mm_srli_si128(h, 8) : h;
}
template <int Q> inline VecF u8_quarter(VecI a) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(quarter_bytes<Q>(a)))}; }
template <int Q> inline VecF s8_quarter(VecI a) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(quarter_bytes<Q>(a)))}; }
template <int Q> inline VecF x_quarter(const float* x) { return {_mm256_broadcast_ps((const __m128*)x)}; }
template <int Q> inline VecF row_quarter(VecF d) {
  return {_mm256_permutevar8x32_ps(d.v, _mm256_setr_epi32(2 * Q, 2 * Q, 2 * Q, 2 * Q, 2 * Q + 1, 2 * Q + 1, 2 * Q + 1, 2 * Q + 1))};
}
inline int64_t quarter_row(int v, int q, int l) { return v * W + 2 * q + l / 4; }
inline int quarter_j(int q, int l) { return l % 4; }

// ---- math
inline VecF vmax(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF vsub(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF vdiv(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
inline VecF vabs(VecF a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline float reduce_max(VecF a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline VecF vround(VecF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// W lanes holding integers in [-128, 127] -> W int8
inline void store_i8(int8_t* p, VecF a) {
  const __m256i i = _mm256_cvtps_epi32(a.v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}
// exp: x = n ln2 + r, |r| <= ln2/2 (ln2 split in two for an exact product),
// exp(r) = 1 + r + r^2 P(r) with Cephes' degree-5 P (~1 ulp on [-ln2/2, ln2/2]),
// times 2^n built in the exponent bits (n clamped to the normal range);
// beyond it, +inf above 88.72 and 0 below -87.3 (libm gives subnormals there,
// below 1.2e-38: no softmax or SiLU result can tell the difference).
inline VecF vexp(VecF a) {
  __m256 x = _mm256_min_ps(_mm256_max_ps(a.v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  r = _mm256_blendv_ps(r, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(a.v, _mm256_set1_ps(88.72f), _CMP_GT_OQ));
  return {_mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(a.v, _mm256_set1_ps(-87.3f), _CMP_LT_OQ))};
}

}  // namespace LJ_NS
