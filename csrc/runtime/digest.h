// digest.h — a fast content digest of a byte range, for in-process memo keys
// (engine/outliers.py keys a load's probe by the weights' bytes).
#pragma once
#include <cstdint>

namespace lj {

// A 128-bit digest of p[0, n). The range is cut into fixed 1 MiB chunks (never
// by thread count), each digested on its own by one of n_threads threads, and
// the chunk digests are folded in order: the result depends on the bytes and n
// only. Not cryptographic: it tells accidentally different contents apart
// (any changed byte changes a chunk's digest; two different ranges collide with
// probability about 2^-64), which is what a memo of one process needs.
void digest128(const uint8_t* p, int64_t n, int n_threads, uint64_t out[2]);

}  // namespace lj
