// packed_scalar.h — one packed weight value at a time, scalar: the spec the
// vector kernels are tested against (dequant_tile_row, matmul_a16.inc) and what
// _core.packed_columns reads a few columns of a matrix with (the outlier
// pass, engine/outliers.py). Layout: common.h; the values are the fp32
// operations of gguf.quants' dequantization (built with -ffp-contract=off).
#pragma once
#include <cstdint>
#include <cstring>

#include "../common.h"
#include "../vec/half.h"

namespace lj {

// Code of row r (0..15), element k (0..G-1) of group `at` (layout: common.h).
inline int32_t packed_code(int32_t t, const uint8_t* blk, int64_t G, int64_t r, int64_t k) {
  if (t == PK_I8) return (int32_t)(int8_t)blk[(k / 4) * 64 + r * 4 + k % 4];
  const uint8_t b = blk[(k / 8) * 64 + r * 4 + k % 4];
  int32_t c = (k % 8) < 4 ? (b & 0x0F) : (b >> 4);
  const int hb = packed_code_bits(t) - 4;
  if (hb > 0) {  // slot 2 (k / 8) + (k % 8 >= 4) of the plane's byte (r, k % 4)
    const int s = (int)(2 * (k / 8) + ((k % 8) >= 4));
    c |= ((blk[(G / 8) * 64 + r * 4 + k % 4] >> (hb * s)) & ((1 << hb) - 1)) << 4;
  }
  return c;
}

// Scalar scales of row r of group j of super-block sb (group_scales' values).
inline void packed_scales(int32_t t, const uint8_t* sb, int64_t j, int64_t G, int64_t r, float& d, float& m) {
  const uint8_t* tail = sb + packed_super(t) * packed_group_code_bytes(t, G);
  uint16_t h[2] = {0, 0};
  std::memcpy(h, tail + 2 * r, 2);
  // the second fp16 plane (mins) exists only for the types that have one: the
  // symmetric types' tail ends after the scales, and reading it anyway ran 2
  // bytes past the last tile of the table (ASan, make sanitize)
  const bool mins = t == PK_Q4K || t == PK_Q5K || t == PK_I4A || t == PK_I5A;
  if (mins) std::memcpy(h + 1, tail + 2 * TILE + 2 * r, 2);
  d = f16_to_f32(h[0]);
  m = 0.f;
  if (t == PK_Q4K || t == PK_Q5K) {
    m = -(f16_to_f32(h[1]) * (float)tail[4 * TILE + 8 * TILE + j * TILE + r]);
    d = d * (float)tail[4 * TILE + j * TILE + r];
  } else if (t == PK_Q6K) {
    d = d * (float)(int8_t)tail[2 * TILE + j * TILE + r];
  } else if (t == PK_I4A || t == PK_I5A) {
    m = f16_to_f32(h[1]);
  }
}

// The value of a code (the fp32 operations of gguf.quants' dequantization).
inline float packed_value(int32_t t, float d, float m, int32_t code) {
  switch (t) {
    case PK_I4S: return d * (float)(code - 8);
    case PK_I5S: return d * (float)(code - 16);
    case PK_Q6K: return d * (float)(code - 32);
    case PK_I8: return d * (float)code;
    default: return d * (float)code + m;
  }
}


// Where group g of a tile is (the scalar twin of matmul_packed.inc's group_at): its
// (tile, super-block) block, its codes, its index j in the super-block.
struct PackedGroup {
  const uint8_t* sb;
  const uint8_t* codes;
  int64_t j;
};
inline PackedGroup packed_group(int32_t t, const uint8_t* tile, int64_t g, int64_t G) {
  const int64_t S = packed_super(t);
  const uint8_t* sb = tile + (g / S) * packed_block_bytes(t, G);
  return {sb, sb + (g % S) * packed_group_code_bytes(t, G), g % S};
}

// Row r's value at column c of a packed [n, K] matrix (tile bytes tb).
inline float packed_at(int32_t t, const uint8_t* data, int64_t tb, int64_t G, int64_t r, int64_t c) {
  const PackedGroup p = packed_group(t, data + (r / TILE) * tb, c / G, G);
  float d, m;
  packed_scales(t, p.sb, p.j, G, r % TILE, d, m);
  return packed_value(t, d, m, packed_code(t, p.codes, G, r % TILE, c % G));
}

}  // namespace lj
