// threadpool.cpp — see threadpool.h for why it is built this way.
#include "threadpool.h"

#include <immintrin.h>

namespace lj {
namespace {
// Spin iterations before a waiting worker yields / sleeps. ~50-100 us on a
// current core: long enough to span the gap between two decode steps' Python
// work, short enough not to burn a core when idle.
constexpr int kSpinBeforeSleep = 20000;
constexpr int kSpinBeforeYield = 2000;
}  // namespace

ThreadPool::ThreadPool(int n_threads) : nth_(n_threads < 1 ? 1 : n_threads) {
  threads_.reserve(nth_ - 1);
  for (int i = 1; i < nth_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  job_gen_.fetch_add(1, std::memory_order_release);
  job_gen_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(JobFn fn, void* ctx) {
  if (nth_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  job_gen_.fetch_add(1, std::memory_order_release);
  job_gen_.notify_all();
  fn(ctx, 0, nth_);
  // Wait for the other nth-1 workers to finish this job.
  int spins = 0;
  while (done_.load(std::memory_order_acquire) != nth_ - 1) {
    _mm_pause();
    if (++spins > kSpinBeforeYield) std::this_thread::yield();
  }
}

void ThreadPool::barrier() {
  if (nth_ == 1) return;
  const uint32_t gen = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == nth_ - 1) {
    // Last to arrive: reset the count before releasing the others.
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1, std::memory_order_release);
    return;
  }
  int spins = 0;
  while (bar_gen_.load(std::memory_order_acquire) == gen) {
    _mm_pause();
    if (++spins > kSpinBeforeYield) std::this_thread::yield();
  }
}

void ThreadPool::worker(int ith) {
  uint32_t seen = 0;
  for (;;) {
    int spins = 0;
    uint32_t g;
    while ((g = job_gen_.load(std::memory_order_acquire)) == seen) {
      if (++spins < kSpinBeforeSleep) {
        _mm_pause();
      } else {
        job_gen_.wait(seen, std::memory_order_acquire);  // futex sleep
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    fn_(ctx_, ith, nth_);
    done_.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace lj
