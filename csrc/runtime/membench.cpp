// membench.cpp — see membench.h. Plain 64-bit loads with 4 independent sums:
// enough in flight for the hardware prefetchers to saturate DRAM on any x86-64.
#include "membench.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "threadpool.h"

namespace lj {
namespace {

struct Job {
  const uint64_t* data;
  int64_t words;
  uint64_t sink[64];
};

void read_slice(void* p, int ith, int nth) {
  Job* j = (Job*)p;
  const int64_t per = (j->words / nth) & ~int64_t(7);
  const uint64_t* a = j->data + per * ith;
  const int64_t n = ith == nth - 1 ? j->words - per * ith : per;
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) { s0 += a[i]; s1 += a[i + 1]; s2 += a[i + 2]; s3 += a[i + 3]; }
  for (; i < n; ++i) s0 += a[i];
  j->sink[ith % 64] = s0 + s1 + s2 + s3;  // keeps the loads alive
}

}  // namespace

double read_bandwidth(int64_t nbytes, int n_threads, int reps) {
  if (nbytes < 4096 || n_threads < 1 || reps < 1) throw std::invalid_argument("read_bandwidth: bad arguments");
  uint64_t* buf = (uint64_t*)std::aligned_alloc(64, (size_t)((nbytes + 63) / 64 * 64));
  if (!buf) throw std::bad_alloc();
  std::memset(buf, 1, (size_t)nbytes);
  ThreadPool pool(n_threads);
  Job job{buf, nbytes / 8, {}};
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.run(read_slice, &job);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0 && nbytes / s > best) best = nbytes / s;
  }
  std::free(buf);
  return best;
}

}  // namespace lj
