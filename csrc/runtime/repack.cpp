// repack.cpp — GGUF blocks -> the packed twins' tiles (layout: common.h), one
// 16-row tile at a time, straight from the file's memory into the final
// buffer. The spec is src/llamajet/formats/gguf_blocks.py (decode_blocks +
// formats/packed.py pack_parts); tests hold the two equal byte for byte.
#include "repack.h"

#include <emmintrin.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace lj {

namespace {

struct GgufType {
  const char* name;
  int32_t twin;       // the packed kind
  int64_t qk;         // elements per GGUF block
  int64_t bytes;      // bytes per GGUF block
};

const GgufType kTypes[] = {
    {"q4_0", PK_I4S, 32, 18},  {"q4_1", PK_I4A, 32, 20},  {"q8_0", PK_I8, 32, 34},
    {"q5_0", PK_I5S, 32, 22},  {"q5_1", PK_I5A, 32, 24},  {"q4_k", PK_Q4K, 256, 144},
    {"q5_k", PK_Q5K, 256, 176}, {"q6_k", PK_Q6K, 256, 210},
};

uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
void wr32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void wr64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

constexpr uint64_t LO4 = 0x0F0F0F0F0F0F0F0Full;

// bit i of a byte -> byte i (0 or 1) of a word: 8 high bits of Q5_0 / Q5_1 at once
struct BitBytes {
  uint64_t t[256];
  BitBytes() {
    for (int v = 0; v < 256; ++v) {
      uint64_t w = 0;
      for (int i = 0; i < 8; ++i) w |= (uint64_t)((v >> i) & 1) << (8 * i);
      t[v] = w;
    }
  }
};
const BitBytes kBits;

// 16 bytes of nibbles -> 32 codes: low nibbles are codes 0..15, high 16..31
void nibbles_32(const uint8_t* q, uint8_t* c) {
  for (int j = 0; j < 16; j += 8) {
    const uint64_t w = rd64(q + j);
    wr64(c + j, w & LO4);
    wr64(c + 16 + j, (w >> 4) & LO4);
  }
}

// Q5_0 / Q5_1, the kinds with no direct path below: one row's decoded fields,
// codes [k] and d (and m) per group, then 16 rows packed as one tile.
// Word-wide (8 codes per operation).
struct Row {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> d, m;
};

void decode_row(const GgufType& t, const uint8_t* src, int64_t k, Row& r) {
  const int o = t.twin == PK_I5S ? 2 : 4;  // the high bits' offset in the block (after d, m)
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = src + b * t.bytes;
    uint8_t* c = r.codes.data() + b * 32;
    r.d[b] = rd16(blk);
    if (t.twin == PK_I5A) r.m[b] = rd16(blk + 2);
    const uint32_t qh = rd32(blk + o);
    nibbles_32(blk + o + 4, c);
    for (int j = 0; j < 32; j += 8) wr64(c + j, rd64(c + j) | (kBits.t[(qh >> j) & 0xFF] << 4));
  }
}

// Rows [16 t, 16 t + 16) (decoded; rows past n are zero) as one packed tile at dst.
void pack_tile(int32_t kind, int64_t k, const std::vector<Row>& rows, int64_t nvalid, uint8_t* dst) {
  const int64_t ng = k / 32, cgb = packed_group_code_bytes(kind, 32), bb = packed_block_bytes(kind, 32);
  std::memset(dst, 0, (size_t)(ng * bb));
  for (int64_t g = 0; g < ng; ++g) {
    uint8_t* blk = dst + g * bb;
    uint8_t* tail = blk + cgb;
    for (int64_t r = 0; r < nvalid; ++r) {
      const Row& R = rows[r];
      const uint8_t* c = R.codes.data() + g * 32;
      // chunk ch, row r: 4 bytes = codes 8 ch + jj | codes 8 ch + 4 + jj << 4 (jj = 0..3);
      // the plane's 4 bytes collect the fifth bits, slot 2 ch + h at bit 2 ch + h
      uint32_t plane = 0;
      for (int64_t ch = 0; ch < 4; ++ch) {
        const uint32_t lo = rd32(c + 8 * ch), hi = rd32(c + 8 * ch + 4);
        wr32(blk + ch * 64 + 4 * r, (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4));
        plane |= (((lo >> 4) & 0x01010101u) << (2 * ch)) | (((hi >> 4) & 0x01010101u) << (2 * ch + 1));
      }
      wr32(blk + 4 * 64 + 4 * r, plane);
      std::memcpy(tail + 2 * r, &R.d[g], 2);
      if (kind == PK_I5A) std::memcpy(tail + 2 * TILE + 2 * r, &R.m[g], 2);
    }
  }
}

}  // namespace

int32_t gguf_twin(const std::string& name, int64_t* qk, int64_t* block_bytes) {
  for (const GgufType& t : kTypes)
    if (name == t.name) {
      if (qk) *qk = t.qk;
      if (block_bytes) *block_bytes = t.bytes;
      return t.twin;
    }
  throw std::invalid_argument("no packed twin for GGUF type " + name);
}

namespace {

// Q8_0, Q4_0, Q4_1 (one group per block, 8 or 4 bits): each GGUF block goes
// straight into its tile's block, no per-row staging (the same bytes as
// formats/packed.py's specification):
// int8 codes as 4-byte pieces, row r's at r * 4 of each 64-byte chunk; 4-bit
// codes as one dword per 8 elements, elements 8ch..8ch+3 in the low nibbles
// and 8ch+4..8ch+7 in the high ones; then d (and m) per row. Measured on one
// Zen 4 core, a 1B ffn_up (8192 x 2048), GB/s of output: Q8_0 3.4 -> 7.3, Q4_0 2.3 -> 4.2;
// with each row's line after next prefetched: Q8_0 6.9 -> 8.5 ([2048, 8192] 8.0 -> 10.2), Q4_0 5.2 -> 6.1
// (1 line ahead: 7.7, 4: 8.6 and Q4_0 5.7).
void pack_simple_tile(const GgufType& t, const uint8_t* src, int64_t row_bytes, int64_t nvalid, int64_t k,
                      uint8_t* dst) {
  const int32_t kind = t.twin;
  const int64_t cgb = packed_group_code_bytes(kind, 32), bb = packed_block_bytes(kind, 32);
  const bool has_m = kind == PK_I4A;
  const int64_t nb = k / 32, qo = has_m ? 4 : 2;  // qo: the codes' offset in the GGUF block
  if (nvalid < TILE) std::memset(dst, 0, (size_t)(nb * bb));
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = dst + b * bb;
    uint8_t* tail = blk + cgb;
    for (int64_t r = 0; r < nvalid; ++r) {
      const uint8_t* g = src + r * row_bytes + b * t.bytes;
      __builtin_prefetch(g + 2 * 64);  // the row's line after next (16 streams: see pack_kquant_tile)
      std::memcpy(tail + 2 * r, g, 2);
      if (has_m) std::memcpy(tail + 2 * TILE + 2 * r, g + 2, 2);
      const uint8_t* q = g + qo;
      uint8_t* o = blk + 4 * r;
      if (kind == PK_I8) {
        for (int ch = 0; ch < 8; ++ch) wr32(o + 64 * ch, rd32(q + 4 * ch));
      } else {  // qs[j]: element j in the low nibble, j + 16 in the high one
        for (int ch = 0; ch < 2; ++ch) {
          const uint32_t lo = rd32(q + 8 * ch), hi = rd32(q + 8 * ch + 4);
          wr32(o + 64 * ch, (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4));
          wr32(o + 64 * (ch + 2), ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u));
        }
      }
    }
  }
}

// Q4_K, Q5_K, Q6_K: each super-block of each row goes straight into its
// tile's block (formats/packed.py's bytes). Q4_K / Q5_K: qs[32 i
// + j] holds element 64 i + j in its low nibble (group 2 i) and 64 i + 32 + j in
// its high one (group 2 i + 1); Q5_K's fifth bit of element 32 s + j is bit s of
// qh[j]. Q6_K (groups of 16): ql[64 h + l] holds element 128 h + l low and 128 h
// + 64 + l high, bits 2 s, 2 s + 1 of qh[32 h + l] are element 128 h + 32 s + l's
// top two. The high parts go into each group's plane: code 8 ch + jj's at bit
// hb (2 ch) of byte jj, code 8 ch + 4 + jj's at bit hb (2 ch + 1).
void pack_kquant_tile(const GgufType& t, const uint8_t* src, int64_t row_bytes, int64_t nvalid, int64_t k,
                      uint8_t* dst) {
  const int32_t kind = t.twin;
  const int64_t G = packed_fixed_group(kind), S = packed_super(kind);
  const int64_t cgb = packed_group_code_bytes(kind, G), bb = packed_block_bytes(kind, G), nsb = k / 256;
  constexpr uint32_t L4 = 0x0F0F0F0Fu, H4 = 0xF0F0F0F0u;
  if (nvalid < TILE) std::memset(dst, 0, (size_t)(nsb * bb));
  for (int64_t sb = 0; sb < nsb; ++sb) {
    uint8_t* blk = dst + sb * bb;
    uint8_t* tail = blk + S * cgb;
    for (int64_t r = 0; r < nvalid; ++r) {
      const uint8_t* g = src + r * row_bytes + sb * t.bytes;
      uint8_t* o = blk + 4 * r;
      // 16 rows read side by side are more streams than the hardware prefetchers follow: this row's
      // next super-block is asked for now, 16 rows before it is read. One Zen 4 core, GB/s out:
      // Q6_K [2048, 8192] 2.6 (row by row, output in L2) -> 7.6; 1 super-block ahead beat 2, 4, 8.
      // (A prefetch past the source's end does not fault.)
      for (int64_t c = 0; c < t.bytes; c += 64) __builtin_prefetch(g + t.bytes + c);
      if (kind == PK_Q6K) {
        std::memcpy(tail + 2 * r, g + 208, 2);
        for (int j = 0; j < 16; ++j) tail[2 * TILE + j * TILE + r] = g[192 + j];
        // 16 codes a group in one SSE2 register (any x86-64; [8192, 2048] 2.7 -> 5.2 GB/s against 64-bit words)
        const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
#pragma GCC unroll 16
        for (int gi = 0; gi < 16; ++gi) {
          const int h = gi / 8, e = 16 * (gi % 8), s = e / 32;  // e: the group's first element within its half
          __m128i c = _mm_loadu_si128((const __m128i*)(g + 64 * h + e % 64));
          if (e >= 64) c = _mm_srli_epi16(c, 4);
          c = _mm_and_si128(c, m4);  // codes 0..15, low 4 bits
          __m128i x = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(g + 128 + 32 * h + e % 32)),
                                                  _mm_cvtsi32_si128(2 * s)), m2);  // their top 2 bits
          // per 8 codes (a 64-bit lane): codes 0..3 | codes 4..7 << 4 (nibbles), << 2 (2-bit parts)
          c = _mm_or_si128(c, _mm_slli_epi32(_mm_srli_epi64(c, 32), 4));
          x = _mm_or_si128(x, _mm_slli_epi32(_mm_srli_epi64(x, 32), 2));
          uint8_t* go = o + gi * cgb;
          wr32(go, (uint32_t)_mm_cvtsi128_si32(c));
          wr32(go + 64, (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(c, 8)));
          wr32(go + 128, (uint32_t)_mm_cvtsi128_si32(x) | (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(x, 8)) << 4);
        }
        continue;
      }
      std::memcpy(tail + 2 * r, g, 2);
      std::memcpy(tail + 2 * TILE + 2 * r, g + 2, 2);
      const uint8_t* s = g + 4;  // 8 x (6-bit sc, 6-bit min) in 12 bytes
      for (int j = 0; j < 4; ++j) {
        tail[4 * TILE + j * TILE + r] = s[j] & 0x3F;
        tail[12 * TILE + j * TILE + r] = s[j + 4] & 0x3F;
        tail[4 * TILE + (j + 4) * TILE + r] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
        tail[12 * TILE + (j + 4) * TILE + r] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
      }
      const uint8_t* qs = g + (kind == PK_Q4K ? 16 : 48);
      for (int i = 0; i < 4; ++i) {
        uint8_t* g0 = o + 2 * i * cgb;
        uint8_t* g1 = g0 + cgb;
        for (int ch = 0; ch < 4; ++ch) {
          const uint32_t lo = rd32(qs + 32 * i + 8 * ch), hi = rd32(qs + 32 * i + 8 * ch + 4);
          wr32(g0 + 64 * ch, (lo & L4) | ((hi & L4) << 4));
          wr32(g1 + 64 * ch, ((lo >> 4) & L4) | (hi & H4));
        }
      }
      if (kind == PK_Q5K) {
        const uint8_t* qh = g + 16;
        for (int gi = 0; gi < 8; ++gi) {
          uint32_t plane = 0;
          for (int ch = 0; ch < 4; ++ch)
            plane |= ((rd32(qh + 8 * ch) >> gi) & 0x01010101u) << (2 * ch)
                   | ((rd32(qh + 8 * ch + 4) >> gi) & 0x01010101u) << (2 * ch + 1);
          wr32(o + gi * cgb + 256, plane);
        }
      }
    }
  }
}

// The writer of each kind's tiles straight from the file, or null for Q5_0 / Q5_1
// (decode_row + pack_tile). Every one writes common.h's layout:
// test_cpp_repack_equals_the_numpy_specification holds each GGUF type to
// formats/packed.py byte for byte.
using PackTile = void (*)(const GgufType&, const uint8_t*, int64_t, int64_t, int64_t, uint8_t*);
PackTile direct_packer(int32_t kind) {
  switch (kind) {
    case PK_I8: case PK_I4S: case PK_I4A: return pack_simple_tile;
    case PK_Q4K: case PK_Q5K: case PK_Q6K: return pack_kquant_tile;
    default: return nullptr;
  }
}

}  // namespace

void repack_gguf_tiles(const std::string& type, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst,
                       int64_t tile_stride, int64_t tile_b, int64_t tile_e) {
  const GgufType* t = nullptr;
  for (const GgufType& x : kTypes)
    if (type == x.name) t = &x;
  if (!t) throw std::invalid_argument("no packed twin for GGUF type " + type);
  const int64_t row_bytes = k / t->qk * t->bytes;
  if (const PackTile direct = direct_packer(t->twin)) {
    for (int64_t tt = tile_b; tt < tile_e; ++tt) {
      const int64_t nvalid = n - tt * TILE < TILE ? n - tt * TILE : TILE;
      direct(*t, src + tt * TILE * row_bytes, row_bytes, nvalid, k, dst + tt * tile_stride);
    }
    return;
  }
  std::vector<Row> rows(TILE);
  for (Row& r : rows) {
    r.codes.assign((size_t)k, 0);
    r.d.assign((size_t)(k / 32), 0);
    r.m.assign(r.d.size(), 0);
  }
  for (int64_t tt = tile_b; tt < tile_e; ++tt) {
    const int64_t nvalid = n - tt * TILE < TILE ? n - tt * TILE : TILE;
    for (int64_t r = 0; r < nvalid; ++r) decode_row(*t, src + (tt * TILE + r) * row_bytes, k, rows[r]);
    pack_tile(t->twin, k, rows, nvalid, dst + tt * tile_stride);
  }
}

}  // namespace lj
