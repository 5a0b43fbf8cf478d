// repack.cpp — GGUF blocks -> the packed twins' tiles (layout: common.h), one
// 16-row tile at a time, straight from the file's memory into the final
// buffer. The spec is src/llamajet/formats/gguf_blocks.py (decode_blocks +
// formats/packed.py pack_parts); tests hold the two equal byte for byte.
#include "repack.h"

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

// One row's decoded fields: codes [k], and the tail fields per group / super-block.
struct Row {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> d, m;  // per group (simple kinds); per super-block D, DM (K-quants)
  std::vector<uint8_t> sc, mn;  // per group (K-quants; Q6_K's sc as int8 bits)
};

void decode_row(const GgufType& t, const uint8_t* src, int64_t k, Row& r) {
  const int64_t nb = k / t.qk;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = src + b * t.bytes;
    uint8_t* c = r.codes.data() + b * t.qk;
    switch (t.twin) {
      case PK_I8:
        r.d[b] = rd16(blk);
        std::memcpy(c, blk + 2, 32);
        break;
      case PK_I4S: case PK_I4A: {
        const int o = t.twin == PK_I4S ? 2 : 4;
        r.d[b] = rd16(blk);
        if (t.twin == PK_I4A) r.m[b] = rd16(blk + 2);
        for (int j = 0; j < 16; ++j) c[j] = blk[o + j] & 0x0F, c[j + 16] = blk[o + j] >> 4;
        break;
      }
      case PK_I5S: case PK_I5A: {
        const int o = t.twin == PK_I5S ? 2 : 4;
        r.d[b] = rd16(blk);
        if (t.twin == PK_I5A) r.m[b] = rd16(blk + 2);
        uint32_t qh;
        std::memcpy(&qh, blk + o, 4);
        for (int j = 0; j < 16; ++j) {
          c[j] = (uint8_t)((blk[o + 4 + j] & 0x0F) | (((qh >> j) & 1) << 4));
          c[j + 16] = (uint8_t)((blk[o + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        break;
      }
      case PK_Q4K: case PK_Q5K: {
        r.d[b] = rd16(blk);
        r.m[b] = rd16(blk + 2);
        const uint8_t* s = blk + 4;  // 8 x (6-bit sc, 6-bit min) in 12 bytes
        for (int j = 0; j < 4; ++j) {
          r.sc[b * 8 + j] = s[j] & 0x3F;
          r.mn[b * 8 + j] = s[j + 4] & 0x3F;
          r.sc[b * 8 + j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
          r.mn[b * 8 + j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
        }
        const uint8_t* qs = blk + (t.twin == PK_Q4K ? 16 : 48);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 32; ++j) {
            c[64 * i + j] = qs[32 * i + j] & 0x0F;
            c[64 * i + 32 + j] = qs[32 * i + j] >> 4;
          }
        if (t.twin == PK_Q5K)
          for (int e = 0; e < 256; ++e) c[e] |= (uint8_t)(((blk[16 + e % 32] >> (e / 32)) & 1) << 4);
        break;
      }
      default: {  // PK_Q6K
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int h = 0; h < 2; ++h) {
          for (int l = 0; l < 64; ++l) {
            c[128 * h + l] = ql[64 * h + l] & 0x0F;
            c[128 * h + 64 + l] = ql[64 * h + l] >> 4;
          }
          for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) c[128 * h + 32 * s + l] |= (uint8_t)(((qh[32 * h + l] >> (2 * s)) & 3) << 4);
        }
        std::memcpy(r.sc.data() + b * 16, blk + 192, 16);
        r.d[b] = rd16(blk + 208);
      }
    }
  }
}

// Rows [16 t, 16 t + 16) (decoded; rows past n are zero) as one packed tile at dst.
void pack_tile(int32_t kind, int64_t k, int64_t G, const std::vector<Row>& rows, int64_t nvalid, uint8_t* dst) {
  const int64_t S = packed_super(kind), ng = k / G, nsb = ng / S, bits = packed_code_bits(kind);
  const int64_t cgb = packed_group_code_bytes(kind, G), bb = packed_block_bytes(kind, G);
  std::memset(dst, 0, (size_t)(nsb * bb));
  for (int64_t sb = 0; sb < nsb; ++sb) {
    uint8_t* blk = dst + sb * bb;
    for (int64_t r = 0; r < nvalid; ++r) {
      const Row& R = rows[r];
      for (int64_t j = 0; j < S; ++j) {
        const int64_t g = sb * S + j;
        const uint8_t* c = R.codes.data() + g * G;
        uint8_t* gc = blk + j * cgb;
        if (bits == 8) {
          for (int64_t ch = 0; ch < G / 4; ++ch) std::memcpy(gc + ch * 64 + 4 * r, c + 4 * ch, 4);
          continue;
        }
        for (int64_t ch = 0; ch < G / 8; ++ch)
          for (int jj = 0; jj < 4; ++jj) {
            const uint8_t lo = c[8 * ch + jj], hi = c[8 * ch + 4 + jj];
            gc[ch * 64 + 4 * r + jj] = (uint8_t)((lo & 0x0F) | ((hi & 0x0F) << 4));
            if (bits > 4) {
              const int hb = (int)bits - 4;
              uint8_t& p = gc[(G / 8) * 64 + 4 * r + jj];
              p = (uint8_t)(p | ((lo >> 4) << (hb * 2 * ch)) | ((hi >> 4) << (hb * (2 * ch + 1))));
            }
          }
      }
      uint8_t* tail = blk + S * cgb;
      if (S == 1) {
        std::memcpy(tail + 2 * r, &R.d[sb], 2);
        if (kind == PK_I4A || kind == PK_I5A) std::memcpy(tail + 2 * TILE + 2 * r, &R.m[sb], 2);
      } else if (kind == PK_Q6K) {
        std::memcpy(tail + 2 * r, &R.d[sb], 2);
        for (int64_t j = 0; j < S; ++j) tail[2 * TILE + j * TILE + r] = R.sc[sb * S + j];
      } else {
        std::memcpy(tail + 2 * r, &R.d[sb], 2);
        std::memcpy(tail + 2 * TILE + 2 * r, &R.m[sb], 2);
        for (int64_t j = 0; j < S; ++j) {
          tail[4 * TILE + j * TILE + r] = R.sc[sb * S + j];
          tail[4 * TILE + 8 * TILE + j * TILE + r] = R.mn[sb * S + j];
        }
      }
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

void repack_gguf_tiles(const std::string& type, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst,
                       int64_t tile_stride, int64_t tile_b, int64_t tile_e) {
  const GgufType* t = nullptr;
  for (const GgufType& x : kTypes)
    if (type == x.name) t = &x;
  if (!t) throw std::invalid_argument("no packed twin for GGUF type " + type);
  const int64_t G = packed_fixed_group(t->twin) ? packed_fixed_group(t->twin) : 32;
  const int64_t ng = k / G, S = packed_super(t->twin), nsb = ng / S;
  const int64_t row_bytes = k / t->qk * t->bytes;
  std::vector<Row> rows(TILE);
  for (Row& r : rows) {
    r.codes.assign((size_t)k, 0);
    r.d.assign((size_t)(S > 1 ? nsb : ng), 0);
    r.m.assign(r.d.size(), 0);
    r.sc.assign((size_t)ng, 0);
    r.mn.assign((size_t)ng, 0);
  }
  for (int64_t tt = tile_b; tt < tile_e; ++tt) {
    const int64_t nvalid = n - tt * TILE < TILE ? n - tt * TILE : TILE;
    for (int64_t r = 0; r < nvalid; ++r) decode_row(*t, src + (tt * TILE + r) * row_bytes, k, rows[r]);
    pack_tile(t->twin, k, G, rows, nvalid, dst + tt * tile_stride);
  }
}

}  // namespace lj
