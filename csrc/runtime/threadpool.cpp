// threadpool.cpp — see threadpool.h for why it is built this way.
#include "threadpool.h"

#include <immintrin.h>
#include <x86intrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>

namespace lj {

const SpinBudgets& spin_budgets() {
  static const SpinBudgets b = [] {
    SpinBudgets d{3'000'000, 300'000, 300'000, 20'000, 1'000'000, 50'000};
    if (const char* e = std::getenv("LLAMAJET_SPIN_US")) {
      long long v[6] = {-1, -1, -1, -1, -1, -1};
      const int n = std::sscanf(e, "%lld,%lld,%lld,%lld,%lld,%lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]);
      bool ok = n == 2 || n == 4 || n == 6;
      for (int i = 0; i < n; ++i) ok = ok && v[i] >= 0;
      if (ok) {
        for (int i = n; i < 6; ++i) v[i] = v[i - 2];
        d = {v[0] * 1000, v[1] * 1000, v[2] * 1000, v[3] * 1000, v[4] * 1000, v[5] * 1000};
      }
    }
    return d;
  }();
  return b;
}

namespace {
// A thread is busy while it was taken off its core against its will at least
// kBusySwitches times in the last window of kWindowNs (or in this one so
// far): a rate, because a thread on a free core also sees a stray switch now
// and then (a daemon waking, a migration), and that must not make the others
// treat every core as taken.
constexpr int64_t kWindowNs = 100'000'000;
constexpr long kBusySwitches = 8;  // (20 and 40 measured no better: 0.86x / 0.80x with one busy loop)
thread_local long last_nivcsw = -1, win_count = 0, prev_count = 0;
thread_local int64_t win_start = 0;
thread_local bool busy = false, all_busy = false;
// Bit i: thread i of the running job is busy (one job at a time per process
// in practice; with two, a thread only sees the bits its own indices share).
std::atomic<uint64_t> busy_bits{0};
// cpu_of[i]: the CPU thread i of the running job was last seen on.
constexpr int kMaxSeen = 64;
std::atomic<int> cpu_of[kMaxSeen];
thread_local int t_ith = -1, t_nth = 0;
bool busy_now() { return busy; }
// Another thread of this job was last seen on this thread's CPU: the two
// time-share one core (the scheduler put them there), and a spinning waiter
// burns the very time slice the thread it waits for needs.
bool colocated() {
  if (t_ith < 0 || t_ith >= kMaxSeen) return false;
  const int me = sched_getcpu();
  cpu_of[t_ith].store(me, std::memory_order_relaxed);
  for (int j = 0; j < t_nth && j < kMaxSeen; ++j)
    if (j != t_ith && cpu_of[j].load(std::memory_order_relaxed) == me) return true;
  return false;
}
}  // namespace

int note_preemptions(int ith, int nth) {
  struct rusage ru;
  if (getrusage(RUSAGE_THREAD, &ru) != 0) return 0;
  const int64_t t = now_ns();
  if (t - win_start >= kWindowNs) {
    prev_count = t - win_start < 2 * kWindowNs ? win_count : 0;
    win_count = 0;
    win_start = t;
  }
  if (last_nivcsw >= 0) win_count += ru.ru_nivcsw - last_nivcsw;
  last_nivcsw = ru.ru_nivcsw;
  busy = win_count >= kBusySwitches || prev_count >= kBusySwitches;
  t_ith = ith, t_nth = nth;
  if (ith < kMaxSeen) cpu_of[ith].store(sched_getcpu(), std::memory_order_relaxed);
  if (ith < 64) {
    const uint64_t bit = 1ull << ith;
    const bool b = busy_now();
    if (b != ((busy_bits.load(std::memory_order_relaxed) & bit) != 0)) {
      if (b)
        busy_bits.fetch_or(bit, std::memory_order_relaxed);
      else
        busy_bits.fetch_and(~bit, std::memory_order_relaxed);
    }
  }
  const uint64_t all = nth >= 64 ? ~0ull : (1ull << nth) - 1;
  all_busy = (busy_bits.load(std::memory_order_relaxed) & all) == all;
  return busy ? 1 + all_busy : 0;
}

bool any_thread_busy(int nth) {
  const uint64_t all = nth >= 64 ? ~0ull : (1ull << nth) - 1;
  return (busy_bits.load(std::memory_order_relaxed) & all) != 0;
}

int64_t spin_ns_between_jobs() {
  const SpinBudgets& b = spin_budgets();
  if (!busy_now()) return b.between_jobs_ns;
  if (colocated()) return 0;
  return all_busy ? b.all_busy_between_jobs_ns : b.busy_between_jobs_ns;
}
int64_t spin_ns_in_job() {
  const SpinBudgets& b = spin_budgets();
  if (!busy_now()) return b.in_job_ns;
  if (colocated()) return 0;
  return all_busy ? b.all_busy_in_job_ns : b.busy_in_job_ns;
}

int64_t spin_ns_for_chunks(int64_t chunk_ns) {
  const int64_t cap = spin_ns_in_job();
  const int64_t want = 2 * chunk_ns > kMinChunkSpinNs ? 2 * chunk_ns : kMinChunkSpinNs;
  return want < cap ? want : cap;
}

double tsc_per_ns() {
  static const double r = [] {
    const int64_t t0 = now_ns();
    const uint64_t c0 = __rdtsc();
    int64_t t;
    while ((t = now_ns()) - t0 < 2'000'000) _mm_pause();
    return (double)(__rdtsc() - c0) / (double)(t - t0);
  }();
  return r;
}

namespace {
// The spin budgets (SpinBudgets, threadpool.h), measured with
// benchmarks/contention.py on a 2-core Zen 4 VM, SmolLM2-135M Q4_1 decode,
// 3 rounds, fresh worker processes each round (LLAMAJET_SPIN_US tried):
// - quiet, between jobs 3 ms: spans the Python work between two steps
//   (~0.8 ms at 16 decode sequences), so workers do not sleep and get woken
//   by a futex every step (median step 13.88 -> 13.61 ms); 200 us / 20 us
//   cost 2-thread decode ~5-10% on a quiet machine.
// - quiet, in a job: at most 300 us (as before chunks), and only about two
//   of the waiter's own chunks of the op (spin_ns_for_chunks, at least 100
//   us): an op ends within about a chunk of the first thread to find nothing
//   left, so a longer wait is a holder the OS took off its core. A flat 50
//   us made decode no slower but 2-thread prefill 0.93x / 0.89x (128 / 512
//   tokens: its chunks run ~100 us and longer, and every op end went to
//   the futex); a flat 300 us 0.99x / 1.01x of the build before chunks but
//   one busy loop 0.79x; two chunks, at least 20 us: 0.86-0.88x there, at
//   least 100 us: 0.91x (quiet figures within this VM's noise, +-10% per
//   round).
// - busy: a thread that keeps spinning while the OS also wants its core for
//   another program uses up its time slice and is then preempted at a
//   random point, most often holding a chunk, which every other thread then
//   waits for until it is scheduled again. With one busy loop on one of two
//   cores, 2-thread decode / quiet 1-thread: 0.76x at 3 ms / 300 us, 0.82x
//   at 3 ms / 20 us, 1.04x at 20 us / 5 us. But with a busy loop on every
//   core a thread that sleeps waits for the other program's slice to end
//   before it runs again: 2-thread busy / quiet 2-thread decode 0.33x
//   sleeping at once, 0.36x at 20 / 5 us, 0.45x at 500 / 20 us, 0.48x at
//   1000 / 50 us. The two cases looked the same from a thread (both threads
//   see >= 8 involuntary switches per 100 ms with one loop too: the
//   scheduler puts the two on one core at times); what told them apart was
//   two of the job's threads on one CPU (colocated(): never spin then: the
//   waiter burns the slice of the thread it waits for). With that, busy
//   1000 / 50 us: one loop 0.92x / 0.95x of quiet 1-thread, two loops 0.40x
//   / 0.47x of quiet 2-thread (two runs).

// Waits inside a job until ready(a's value): spins up to spin_ns_in_job(), then
// sleeps on a's futex, counted in `sleepers` so the releaser notifies only
// when someone sleeps.
// NOTE: the sleeper count goes up before wait() re-checks a's value, so a
// release between the two is seen by wait() (no lost wake-up).
template <class T, class Ready>
void spin_then_sleep(std::atomic<T>& a, std::atomic<int>& sleepers, Ready ready) {
  Spinner sp(spin_ns_in_job());
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

ThreadPool::ThreadPool(int n_threads)
    : nth_(n_threads < 1 ? 1 : n_threads), finished_(new std::atomic<uint32_t>[n_threads < 1 ? 1 : n_threads]()) {
  threads_.reserve(nth_ - 1);
  // Workers start with every signal blocked (a new thread inherits its creator's mask), so the
  // process's signals (Ctrl-C's SIGINT, SIGTERM) go to the embedding program's own threads. A signal
  // taken by a worker runs Python's C handler there, which only sets a flag: the main thread, asleep
  // in select() under input() or an event loop, would not wake until its next input.
  struct BlockSignals {  // restores the caller's mask even if a thread cannot be created
    sigset_t old;
    BlockSignals() {
      sigset_t all;
      sigfillset(&all);
      pthread_sigmask(SIG_SETMASK, &all, &old);
    }
    ~BlockSignals() { pthread_sigmask(SIG_SETMASK, &old, nullptr); }
  } blocked;
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
  quiesce();  // a launched job's late workers count into done_ too
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  job_gen_.fetch_add(1, std::memory_order_release);
  job_gen_.notify_all();
  fn(ctx, 0, nth_);
  // Wait for the other nth-1 workers to finish this job.
  spin_then_sleep(done_, done_sleepers_, [this](int d) { return d == nth_ - 1; });
}

void ThreadPool::launch(JobFn fn, void* ctx) {
  if (nth_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  // NOTE: a late worker reads fn_ / ctx_ only after it sees a new generation,
  // and callers keep fn and ctx the same between launches (the executor), so
  // rewriting them here never changes what a late worker calls.
  fn_ = fn;
  ctx_ = ctx;
  job_gen_.fetch_add(1, std::memory_order_release);
  job_gen_.notify_all();
  fn(ctx, 0, nth_);
}

void ThreadPool::quiesce() {
  const uint32_t g = job_gen_.load(std::memory_order_acquire);
  for (int i = 1; i < nth_; ++i) {
    Spinner sp(spin_ns_in_job());
    while (finished_[i].load(std::memory_order_acquire) != g)
      if (!sp.spin()) std::this_thread::sleep_for(std::chrono::microseconds(50)), sp.restart();
  }
}

void ThreadPool::worker(int ith) {
  uint32_t seen = 0;
  for (;;) {
    Spinner sp(spin_ns_between_jobs());
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
    finished_[ith].store(g, std::memory_order_release);
    done_.fetch_add(1, std::memory_order_seq_cst);
    if (done_sleepers_.load(std::memory_order_seq_cst) > 0) done_.notify_all();
  }
}

}  // namespace lj
