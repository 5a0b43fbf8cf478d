// half.h — portable fp16/bf16 <-> fp32 scalar conversion (the spec the SIMD
// paths must match bit for bit; IEEE binary16, round-to-nearest-even).
#pragma once
#include <cstdint>
#include <cstring>

namespace lj {

// static: each ISA translation unit gets its own copy compiled with its own
// flags, so the linker can never hand the baseline tier an AVX-512 copy.

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;  // +-0
    } else {        // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) { man <<= 1; --exp; }
      man &= 0x3ffu;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> IEEE binary16, round to nearest even; overflow -> inf, NaN -> qNaN.
// (F. Giesen's float_to_half_fast3_rtne; exact for every input, tested
// against numpy.float16 in tests/test_kv_precision.py.)
static inline uint16_t f32_to_f16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t o;
  if (u >= 0x47800000u) {              // >= 65536 (or inf/NaN): inf or NaN
    o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {        // below 2^-14: fp16 subnormal or zero
    const uint32_t magic_u = 0x3f000000u;  // 0.5f: aligns the 10 mantissa bits at the bottom
    float f, magic;
    std::memcpy(&f, &u, 4);
    std::memcpy(&magic, &magic_u, 4);
    f += magic;                        // the FPU rounds to nearest even here
    std::memcpy(&o, &f, 4);
    o -= magic_u;
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;            // rebias exponent (127 -> 15) and round half to even
    o = u >> 13;
  }
  return (uint16_t)(o | sign);
}

static inline float bf16_to_f32(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace lj
