// alloc_count.cpp — replacement operator new / delete for this module's own
// code, counting the calls made while a step runs (alloc_count.h).
//
// They have hidden visibility: the static link binds every operator new call
// compiled into this extension (kernels, executor, std containers used by
// them) to these, and no other library of the process sees them. They
// allocate with malloc and free with free, as libstdc++'s own do, so memory
// may cross between the two either way. Direct malloc calls are not counted:
// kernel code has none (it takes scratch from the step context).
#include "alloc_count.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "executor.h"

namespace lj {
namespace {
std::atomic<int64_t> g_step_allocs{0};
thread_local int t_counting = 0;

inline void* counted(std::size_t n, std::size_t align) {
  if (t_counting) g_step_allocs.fetch_add(1, std::memory_order_relaxed);
  if (n == 0) n = 1;
  void* p = align <= alignof(std::max_align_t) ? std::malloc(n) : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace

CountStepAllocations::CountStepAllocations() { ++t_counting; }
CountStepAllocations::~CountStepAllocations() { --t_counting; }
int64_t step_allocations() { return g_step_allocs.load(std::memory_order_relaxed); }

}  // namespace lj

#if defined(__clang__)
// clang refuses a visibility that differs from <new>'s declarations (gcc
// warns and keeps it for some). Without it the operators are exported from
// the extension, which python loads RTLD_LOCAL: they still bind this
// module's own calls first and interpose on no other library.
#define LJ_HIDDEN
#else
#define LJ_HIDDEN __attribute__((visibility("hidden")))
// gcc keeps it on all but the two plain operator new and says so for each:
// those two are then exported as with clang (above), which is what we want
#pragma GCC diagnostic ignored "-Wattributes"
#endif
LJ_HIDDEN void* operator new(std::size_t n) { return lj::counted(n, 0); }
LJ_HIDDEN void* operator new[](std::size_t n) { return lj::counted(n, 0); }
LJ_HIDDEN void* operator new(std::size_t n, std::align_val_t a) { return lj::counted(n, (std::size_t)a); }
LJ_HIDDEN void* operator new[](std::size_t n, std::align_val_t a) { return lj::counted(n, (std::size_t)a); }
LJ_HIDDEN void operator delete(void* p) noexcept { std::free(p); }
LJ_HIDDEN void operator delete[](void* p) noexcept { std::free(p); }
LJ_HIDDEN void operator delete(void* p, std::size_t) noexcept { std::free(p); }
LJ_HIDDEN void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
LJ_HIDDEN void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
LJ_HIDDEN void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
LJ_HIDDEN void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
LJ_HIDDEN void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
