// membench.h — the machine's own read bandwidth, for the roofline of decode.
#pragma once
#include <cstdint>

namespace lj {

// Reads a buffer of `nbytes` (allocated and touched once) `reps` times with
// `n_threads` threads of a ThreadPool, each its own contiguous slice; returns
// the best rate in bytes/s over the reps.
double read_bandwidth(int64_t nbytes, int n_threads, int reps);

}  // namespace lj
