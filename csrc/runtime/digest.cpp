#include "digest.h"

#include <cstring>
#include <vector>

#include "threadpool.h"

namespace lj {
namespace {

constexpr int64_t kChunk = int64_t(1) << 20;
// odd 64-bit constants with well-mixed bits (the primes of the xxHash family's
// 64-bit round, a published multiply-rotate construction)
constexpr uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                   P4 = 0x85EBCA77C2B2AE63ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t round64(uint64_t acc, uint64_t w) { return rotl(acc + w * P2, 31) * P1; }
inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
  return h;
}

// One chunk: four independent lanes over 32-byte stripes (the multiplies
// pipeline), then the tail, then the length.
uint64_t chunk_digest(const uint8_t* p, int64_t n, uint64_t seed) {
  uint64_t a = seed + P1 + P2, b = seed + P2, c = seed, d = seed - P1;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    a = round64(a, w[0]); b = round64(b, w[1]); c = round64(c, w[2]); d = round64(d, w[3]);
  }
  uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18);
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = rotl(h ^ round64(0, w), 27) * P1 + P4;
  }
  for (; i < n; ++i) h = rotl(h ^ (p[i] * P3), 11) * P1;
  return avalanche(h ^ (uint64_t)n);
}

}  // namespace

void digest128(const uint8_t* p, int64_t n, int n_threads, uint64_t out[2]) {
  const int64_t chunks = n > 0 ? (n + kChunk - 1) / kChunk : 0;
  // two digests per chunk under different seeds: 128 bits in all
  std::vector<uint64_t> d(2 * chunks);
  struct Job { const uint8_t* p; int64_t n, chunks; uint64_t* d; } job{p, n, chunks, d.data()};
  auto work = [](void* v, int ith, int nth) {
    const Job* j = (const Job*)v;
    for (int64_t c = ith; c < j->chunks; c += nth) {
      const int64_t b = c * kChunk, len = j->n - b < kChunk ? j->n - b : kChunk;
      j->d[2 * c] = chunk_digest(j->p + b, len, P4);
      j->d[2 * c + 1] = chunk_digest(j->p + b, len, P3 ^ 0x5bd1e995u);
    }
  };
  if (chunks > 1 && n_threads > 1) {
    ThreadPool pool(n_threads < chunks ? n_threads : (int)chunks);
    pool.run(work, &job);
  } else {
    work(&job, 0, 1);
  }
  uint64_t h1 = P1 ^ (uint64_t)n, h2 = P2 + (uint64_t)n;
  for (int64_t c = 0; c < chunks; ++c) {
    h1 = avalanche(h1 ^ d[2 * c]) + P4;
    h2 = avalanche(h2 + d[2 * c + 1] * P1) ^ P3;
  }
  out[0] = h1;
  out[1] = h2;
}

}  // namespace lj
