// threadpool.cpp — see threadpool.h for why it is built this way.
#include "threadpool.h"

#include <immintrin.h>

#include <chrono>

namespace lj {
namespace {
// How long a waiter spins (pause) before it sleeps on a futex, in time: a
// pause takes ~140 cycles on some x86 cores and ~10 ns on this project's
// machine, so the budgets counted in pauses they replace (20000 between jobs,
// 2000 inside) came out at ~200 us / ~20 us there, and the worker slept
// through the ~0.8 ms of Python between two 16-sequence decode steps, to be
// woken by a futex at every step (6 alternating runs: median step 13.88 ->
// 13.61 ms; noisy). Between jobs: long enough to span that Python work.
// Inside a job (barriers, the end-of-job wait): far longer than any op's
// imbalance on an idle machine, short enough that a thread waiting on a
// descheduled one gives its core away.
constexpr int64_t kSpinNsBetweenJobs = 3'000'000;
constexpr int64_t kSpinNsInJob = 300'000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One wait: call spin() until it returns false (sleep now); it pauses once
// and reads the clock every 64 pauses. The budget starts at the first call.
class Spinner {
 public:
  explicit Spinner(int64_t budget_ns) : budget_(budget_ns) {}
  bool spin() {
    _mm_pause();
    if (++n_ % 64) return true;
    const int64_t t = now_ns();
    if (until_ < 0) until_ = t + budget_;
    return t < until_;
  }
  void restart() { n_ = 0, until_ = -1; }

 private:
  int64_t budget_, until_ = -1;
  int n_ = 0;
};

// Waits inside a job until ready(a's value): spins up to kSpinNsInJob, then
// sleeps on a's futex, counted in `sleepers` so the releaser notifies only
// when someone sleeps.
// NOTE: the sleeper count goes up before wait() re-checks a's value, so a
// release between the two is seen by wait() (no lost wake-up).
template <class T, class Ready>
void spin_then_sleep(std::atomic<T>& a, std::atomic<int>& sleepers, Ready ready) {
  Spinner sp(kSpinNsInJob);
  for (T v; !ready(v = a.load(std::memory_order_acquire));) {
    if (!sp.spin()) {
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      a.wait(v, std::memory_order_seq_cst);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
      sp.restart();
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

void ThreadPool::barrier(const void* pf, int64_t pf_bytes) {
  if (nth_ == 1) return;
  const uint32_t gen = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == nth_ - 1) {
    // Last to arrive: reset the count before releasing the others.
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1, std::memory_order_seq_cst);
    if (bar_sleepers_.load(std::memory_order_seq_cst) > 0) bar_gen_.notify_all();
    return;
  }
  const char* p = (const char*)pf;
  for (int64_t off = 0; off < pf_bytes && bar_gen_.load(std::memory_order_acquire) == gen;)
    for (const int64_t end = off + 1024 < pf_bytes ? off + 1024 : pf_bytes; off < end; off += 64)
      __builtin_prefetch(p + off, 0, 2);
  spin_then_sleep(bar_gen_, bar_sleepers_, [gen](uint32_t g) { return g != gen; });
}

void ThreadPool::worker(int ith) {
  uint32_t seen = 0;
  for (;;) {
    Spinner sp(kSpinNsBetweenJobs);
    uint32_t g;
    while ((g = job_gen_.load(std::memory_order_acquire)) == seen) {
      if (!sp.spin()) {
        job_gen_.wait(seen, std::memory_order_acquire);  // futex sleep
        sp.restart();
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
