// pages.h — big buffers (weights, the KV pool, the arena) as anonymous
// mappings of their own, without transparent huge pages.
//
// Why not malloc: in the VMs this runs on, committing fresh memory is most of
// a load (the host backs each page on first touch), and numpy asks for huge
// pages on its big allocations (MADV_HUGEPAGE); with THP's defrag at
// "madvise", as here, such faults compact memory synchronously. Measured on a
// 2-core Zen 4 VM, 2026-12-07, 300 MiB written once in a fresh process: numpy's
// np.empty 1.9-3.2 s/GiB, a mapping 0.75-1.0 s/GiB written, 0.6-0.7 s/GiB
// committed by MADV_POPULATE_WRITE. First loads of a 1B Q6_K, 8 alternating
// rounds: weights in mappings with MADV_HUGEPAGE median 2.64 s (1.42-2.82),
// without 1.62 s (1.46-1.89); decode unchanged within the VM's noise.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lj {

// Below this, buffers come from the heap (a mapping per small buffer wastes
// address space).
constexpr int64_t kPageMapMin = int64_t(2) << 20;

// A mapping of nbytes (rounded up to 4 KiB pages), zero and not yet
// committed; nullptr when the system refuses. *map_len gets the length to
// give unmap_pages.
uint8_t* map_pages(int64_t nbytes, size_t* map_len);
void unmap_pages(uint8_t* p, size_t map_len);

// Commits [p, p + nbytes) of a mapping from map_pages as zeros, without
// writing it from user space (MADV_DONTNEED, then MADV_POPULATE_WRITE), on
// n_threads threads over fixed 64 MiB pieces; where the kernel lacks it
// (before Linux 5.14), writes zeros. What the range held is lost.
void populate_pages(uint8_t* p, int64_t nbytes, int n_threads);

}  // namespace lj
