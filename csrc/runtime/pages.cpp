#include "pages.h"

#include <sys/mman.h>

#include <cstring>

#include "threadpool.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace lj {
namespace {
constexpr size_t kHuge = size_t(2) << 20;
constexpr int64_t kPiece = int64_t(64) << 20;
}  // namespace

void ask_huge_pages(uint8_t* p, int64_t nbytes) {
  // the whole 2 MiB spans only: one over a partial tail would commit up to
  // 2 MiB that holds nothing. Advice only: ignored where THP is off.
  const size_t whole = (size_t)nbytes / kHuge * kHuge;
  if (whole && (uintptr_t)p % kHuge == 0) madvise(p, whole, MADV_HUGEPAGE);
}

uint8_t* map_pages(int64_t nbytes, size_t* map_len, bool huge) {
  if (nbytes <= 0) return nullptr;
  const size_t page = 4096, len = ((size_t)nbytes + page - 1) / page * page;
  // over-map by one huge page, then trim both ends to a 2 MiB-aligned span
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t a = (uintptr_t)raw, b = (a + kHuge - 1) / kHuge * kHuge;
  if (b > a) munmap(raw, b - a);
  const uintptr_t end = a + len + kHuge;
  if (end > b + len) munmap((void*)(b + len), end - (b + len));
  if (huge) ask_huge_pages((uint8_t*)b, (int64_t)len);
  *map_len = len;
  return (uint8_t*)b;
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
