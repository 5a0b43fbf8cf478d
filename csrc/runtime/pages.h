// pages.h — big buffers (weights, the KV pool, the arena) as their own
// anonymous mappings, 2 MiB-aligned with transparent huge pages asked for.
//
// Why not malloc: in the VMs this runs on, committing fresh memory is most of
// a load (the host backs each page on first touch). Measured on a 2-core Zen 4
// VM, 300 MiB written once in a fresh process: numpy's np.empty (malloc'd,
// unaligned) 1.9-3.2 s/GiB; an aligned mapping with MADV_HUGEPAGE 0.75-1.0
// s/GiB written, 0.6-0.7 s/GiB committed by MADV_POPULATE_WRITE.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lj {

// Below this, buffers come from the heap (a mapping per small buffer wastes
// address space and a huge page could not be used anyway).
constexpr int64_t kPageMapMin = int64_t(2) << 20;

// A mapping of nbytes (rounded up to 4 KiB pages) at a 2 MiB-aligned address,
// zero and not yet committed; nullptr when the system refuses. *map_len gets
// the length to give unmap_pages. `huge`: transparent huge pages asked for
// over its whole 2 MiB spans (ask_huge_pages), for memory that will be
// written whole (weights): a huge page is committed whole at its first
// touch, so a buffer touched sparsely (an arena, a KV pool filled as it goes)
// would hold up to 2 MiB of RSS per touch.
uint8_t* map_pages(int64_t nbytes, size_t* map_len, bool huge);
void ask_huge_pages(uint8_t* p, int64_t nbytes);
void unmap_pages(uint8_t* p, size_t map_len);

// Commits [p, p + nbytes) of a mapping from map_pages as zeros, without
// writing it from user space (MADV_DONTNEED, then MADV_POPULATE_WRITE), on
// n_threads threads over fixed 64 MiB pieces; where the kernel lacks it
// (before Linux 5.14), writes zeros. What the range held is lost.
void populate_pages(uint8_t* p, int64_t nbytes, int n_threads);

}  // namespace lj
