// threadpool.cpp — see threadpool.h for why it is built this way.
#include "threadpool.h"

#include <immintrin.h>

namespace lj {
namespace {
// Spin iterations (pause) before a waiter sleeps on a futex. Between jobs:
// ~1-3 ms, long enough to span the Python work between two decode steps.
// Inside a job (barriers, the end-of-job wait): ~50-300 us, far longer than
// any op's imbalance on an idle machine, short enough that a thread waiting
// on a descheduled one gives its core away.
constexpr int kSpinBeforeSleep = 20000;
constexpr int kSpinBeforeYield = 2000;

// Waits inside a job until ready(a's value): spins kSpinBeforeYield pauses,
// then sleeps on a's futex, counted in `sleepers` so the releaser notifies
// only when someone sleeps.
// NOTE: the sleeper count goes up before wait() re-checks a's value, so a
// release between the two is seen by wait() (no lost wake-up).
template <class T, class Ready>
void spin_then_sleep(std::atomic<T>& a, std::atomic<int>& sleepers, Ready ready) {
  int spins = 0;
  for (T v; !ready(v = a.load(std::memory_order_acquire));) {
    if (++spins < kSpinBeforeYield) {
      _mm_pause();
    } else {
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      a.wait(v, std::memory_order_seq_cst);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}
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
  spin_then_sleep(done_, done_sleepers_, [this](int d) { return d == nth_ - 1; });
}

void ThreadPool::barrier() {
  if (nth_ == 1) return;
  const uint32_t gen = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == nth_ - 1) {
    // Last to arrive: reset the count before releasing the others.
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1, std::memory_order_seq_cst);
    if (bar_sleepers_.load(std::memory_order_seq_cst) > 0) bar_gen_.notify_all();
    return;
  }
  spin_then_sleep(bar_gen_, bar_sleepers_, [gen](uint32_t g) { return g != gen; });
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
    done_.fetch_add(1, std::memory_order_seq_cst);
    if (done_sleepers_.load(std::memory_order_seq_cst) > 0) done_.notify_all();
  }
}

}  // namespace lj
