// alloc_count.h — counts heap allocations made inside a step (executor.h
// step_allocations): the "nothing is allocated in a step" contract, made
// observable so a test can fail when a kernel starts allocating.
#pragma once
#include <cstdint>

namespace lj {

// While one of these lives on a thread, operator new calls from this
// module's code on that thread are counted (alloc_count.cpp).
struct CountStepAllocations {
  CountStepAllocations();
  ~CountStepAllocations();
  CountStepAllocations(const CountStepAllocations&) = delete;
  CountStepAllocations& operator=(const CountStepAllocations&) = delete;
};

}  // namespace lj
