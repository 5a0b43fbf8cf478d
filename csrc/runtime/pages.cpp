#include "pages.h"

#include <sys/mman.h>

#include <cstring>

#include "threadpool.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace lj {
namespace {
constexpr int64_t kPiece = int64_t(64) << 20;
}  // namespace

uint8_t* map_pages(int64_t nbytes, size_t* map_len) {
  if (nbytes <= 0) return nullptr;
  const size_t len = ((size_t)nbytes + 4095) / 4096 * 4096;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  *map_len = len;
  return (uint8_t*)p;
}

void unmap_pages(uint8_t* p, size_t map_len) {
  if (p) munmap(p, map_len);
}

void populate_pages(uint8_t* p, int64_t nbytes, int n_threads) {
  if (nbytes <= 0) return;
  struct Job { uint8_t* p; int64_t n; } job{p, nbytes};
  auto work = [](void* v, int ith, int nth) {
    const Job* j = (const Job*)v;
    const int64_t pieces = (j->n + kPiece - 1) / kPiece;
    for (int64_t c = ith; c < pieces; c += nth) {
      uint8_t* b = j->p + c * kPiece;
      const int64_t len = j->n - c * kPiece < kPiece ? j->n - c * kPiece : kPiece;
      // the mapping is page-aligned from p; a partial last page is committed whole.
      // MADV_DONTNEED first: populating keeps what committed pages hold, and the
      // result must read zero (a private anonymous page reads zero once dropped).
      if (madvise(b, (size_t)len, MADV_DONTNEED) != 0 || madvise(b, (size_t)len, MADV_POPULATE_WRITE) != 0)
        std::memset(b, 0, (size_t)len);
    }
  };
  const int64_t pieces = (nbytes + kPiece - 1) / kPiece;
  if (n_threads > 1 && pieces > 1) {
    ThreadPool pool(n_threads < pieces ? n_threads : (int)pieces);
    pool.run(work, &job);
  } else {
    work(&job, 0, 1);
  }
}

}  // namespace lj
