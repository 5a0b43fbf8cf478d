// repack.h — GGUF blocks straight into the packed twins' tiles (repack.cpp).
#pragma once
#include <cstdint>
#include <string>

#include "../common.h"

namespace lj {

// The packed kind holding GGUF type `name` ("q4_k", ...) without loss; its
// GGUF block's elements and bytes. Throws std::invalid_argument if none.
int32_t gguf_twin(const std::string& name, int64_t* qk = nullptr, int64_t* block_bytes = nullptr);

// Tiles [tile_b, tile_e) of the [n, k] GGUF matrix at src (n rows of k / qk
// blocks) into dst + tile * tile_stride (tile_stride >= the tile's bytes:
// stacked and interleaved destinations). Group: the kind's fixed group, 32
// for the Q4_0 / Q4_1 / Q8_0 twins.
void repack_gguf_tiles(const std::string& type, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst,
                       int64_t tile_stride, int64_t tile_b, int64_t tile_e);

}  // namespace lj
