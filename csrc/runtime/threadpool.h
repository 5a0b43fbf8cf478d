// threadpool.h — a persistent pool of worker threads with a spinning barrier.
//
// Why this shape: a decode step of a small model is ~300 tiny ops; creating
// threads or sleeping in the kernel between ops would cost more than the ops.
// So workers are created once, spin briefly (then sleep on a futex via
// std::atomic::wait) between jobs, and ops inside one job are separated by a
// user-space barrier. The calling thread is worker 0, so nth threads means
// nth-1 extra OS threads. A waiter spins briefly, then sleeps on a futex: when
// the machine is oversubscribed (another process on the same cores) a
// descheduled thread would otherwise make every barrier cost a time slice.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace lj {

class ThreadPool {
 public:
  using JobFn = void (*)(void* ctx, int ith, int nth);

  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return nth_; }
  // Runs fn(ctx, ith, nth) on every thread; returns when all have finished.
  void run(JobFn fn, void* ctx);
  // Called by all nth threads inside a job: none passes until all arrive.
  // A thread that waits (not the last to arrive) prefetches [pf, pf + pf_bytes)
  // into L2 while it waits, in 1 KiB steps between looks at the barrier: the
  // next op's first weights, read while the slowest thread finishes this one.
  void barrier(const void* pf = nullptr, int64_t pf_bytes = 0);

 private:
  void worker(int ith);

  int nth_;
  std::vector<std::thread> threads_;
  JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
  // NOTE: job_gen_ is bumped (release) after fn_/ctx_ are written; workers
  // read them only after observing the new generation (acquire).
  std::atomic<uint32_t> job_gen_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<int> bar_count_{0};
  alignas(64) std::atomic<uint32_t> bar_gen_{0};
  // Threads asleep on bar_gen_ / done_ (futex): the releaser calls notify only
  // when someone sleeps, so an uncontended barrier makes no system call.
  alignas(64) std::atomic<int> bar_sleepers_{0};
  std::atomic<int> done_sleepers_{0};
};

}  // namespace lj
