// threadpool.h — a persistent pool of worker threads that spin, then sleep, between jobs.
//
// Why this shape: a decode step of a small model is ~300 tiny ops; creating
// threads or sleeping in the kernel between ops would cost more than the ops.
// So workers are created once and spin briefly (then sleep on a futex via
// std::atomic::wait) between jobs; how a job's threads share its work is the
// job's business (the executor: claimed chunks). The calling thread is
// worker 0, so nth threads means nth-1 extra OS threads. A waiter spins
// briefly, then sleeps on a futex: when the machine is oversubscribed
// (another process on the same cores) spinning would take the core from the
// thread that is waited for.
#pragma once
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace lj {

// How long a waiter spins (pause) before it sleeps on a futex: between jobs,
// and inside one (an op's last chunks). Three regimes (threadpool.cpp says
// how each was measured): quiet; this thread busy (taken off its core
// against its will lately) while some of its job's threads are not; every
// thread of the job busy. LLAMAJET_SPIN_US="between,in_job[,busy_between,
// busy_in_job[,all_busy_between,all_busy_in_job]]" overrides them
// (microseconds; read once), for measuring them on other machines.
struct SpinBudgets {
  int64_t between_jobs_ns, in_job_ns, busy_between_jobs_ns, busy_in_job_ns, all_busy_between_jobs_ns,
      all_busy_in_job_ns;
};
const SpinBudgets& spin_budgets();
// Reads this thread's involuntary context switches (getrusage): a thread
// that had >= 8 in the last 100 ms window (or in this one so far) counts as
// busy. Called once per job by
// each of its nth threads (ith: this one's index). Returns the regime: 0
// quiet, 1 this thread busy, 2 every thread busy.
int note_preemptions(int ith, int nth);
// Some thread of the job (indices below nth) was busy at its last job start.
bool any_thread_busy(int nth);
// This thread's budgets now.
int64_t spin_ns_between_jobs();
int64_t spin_ns_in_job();
// The wait for an op's last chunks: twice the longest chunk this thread ran
// in the op (at least kMinChunkSpinNs; a quiet op ends within about one
// chunk of the first thread to find nothing left; a wait much longer than
// that is a holder the OS has taken off its core), capped by
// spin_ns_in_job().
constexpr int64_t kMinChunkSpinNs = 100'000;
int64_t spin_ns_for_chunks(int64_t chunk_ns);
// TSC ticks per nanosecond (measured once, over 2 ms).
double tsc_per_ns();

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
  // Runs fn(ctx, 0, nth) here and starts it on the other threads, but does
  // not wait for them: the job itself must know when its work is done (the
  // executor's claimed chunks). A worker the OS has descheduled may enter or
  // leave the job after launch() returns; it must then find nothing to do.
  void launch(JobFn fn, void* ctx);
  // Returns when every worker has left every job started so far: call before
  // changing anything a late worker could still read.
  void quiesce();

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
  // Threads asleep on done_ (futex): a worker calls notify only when someone
  // sleeps, so an uncontended end of job makes no system call.
  std::atomic<int> done_sleepers_{0};
  // finished_[i]: the last job generation worker i returned from.
  std::unique_ptr<std::atomic<uint32_t>[]> finished_;
};

}  // namespace lj
