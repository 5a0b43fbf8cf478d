// executor.h — runs a whole forward step (a Program of typed ops) in one call.
//
// Python builds the Program once per runner: each op is its family's params
// struct (kernels/ops.h), whose tensor operands (Refs) name an executor-owned
// buffer (the activation arena, the KV pool) and an offset, or a weight array
// Python keeps alive. A step only copies the step inputs (token ids,
// positions, KV slots, block tables) into pre-sized arrays and runs every op
// on the thread pool, each op cut into chunks the threads claim (executor.cpp),
// the next op once the last chunk is done. Nothing is allocated inside a
// step (counted: step_allocations).
#pragma once
#include <cstdint>
#include <atomic>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "../kernels/ops.h"
#include "threadpool.h"

namespace lj {

// Any op's params, by value.
#define LJ_OP_TYPE(KIND, name, P, FIELDS, kernel) , P
using AnyOp = std::variant<std::monostate LJ_OPS(LJ_OP_TYPE)>;
#undef LJ_OP_TYPE

class Executor {
 public:
  explicit Executor(const ExecConfig& cfg);
  const ExecConfig& config() const { return cfg_; }
  const char* isa() const { return table_->isa; }

  // 64-byte aligned buffer owned by the executor (contents undefined); its id.
  // From kPageMapMin (runtime/pages.h) a mapping of its own, committed on
  // first touch (or whole by prefault_buffer).
  int alloc_buffer(int64_t nbytes);
  // Commits buffer `id`'s memory now, zero-filled (its contents are lost), on
  // the executor's threads: the KV pool, so that no step takes its page faults.
  void prefault_buffer(int id);
  uint8_t* buffer_data(int id) const;
  int64_t buffer_size(int id) const;
  int64_t allocations() const { return allocations_; }

  // Appends an op. Every present operand is resolved and checked to hold its
  // declared shape for the largest step this executor accepts; then the op
  // family's rules relate the shapes and size its scratch. Throws
  // std::invalid_argument ("<op>: <why>") on anything wrong; the Program is
  // unchanged then.
  template <class P>
  void add(P p);
  size_t num_ops() const { return slots_.size(); }
  int op_kind(size_t k) const { return slots_.at(k).kind; }

  ~Executor();

  // Per-op wall time, measured by thread 0 from an op's start to its end
  // (its last chunk done, by whichever thread). Off by default.
  void set_profiling(bool on) {
    pool_->quiesce();
    profiling_ = on, op_ns_.assign(slots_.size(), 0), steps_ = 0;
  }
  const std::vector<int64_t>& op_ns() const { return op_ns_; }
  int64_t profiled_steps() const { return steps_; }
  // Regions (stretches of work that end where threads wait for the last
  // chunk) in the last step: the ops, less the kv_write + attention pairs
  // run as one.
  int64_t last_step_regions() const { return last_regions_; }

  // How the threads shared the work, since the last reset_thread_stats():
  // per thread the chunks it ran and stole and the TSC cycles inside kernels,
  // and the steps' wall cycles (thread 0, start to end). idle = 1 - work /
  // (threads x wall): the share of the threads' time in a step spent waiting
  // (on a quiet machine, imbalance; on a busy one, threads the OS took away).
  struct ThreadStats {
    std::vector<int64_t> chunks, stolen, work_cycles;
    // steps this thread began busy (taken off its core against its will
    // lately: it spins less), and with every thread busy (threadpool.h)
    std::vector<int64_t> busy_steps, all_busy_steps;
    int64_t steps = 0, wall_cycles = 0;
    // backups: chunks this thread committed as a backup copy of a chunk
    // another thread held past the spin budget; discarded: chunks it ran
    // whose commit another thread's copy had won (staged steps only)
    std::vector<int64_t> backups, discarded;
    int64_t staged_steps = 0;  // steps run staged (their matmuls backed up)
    int64_t sleeps = 0;  // waits for an op's end that went to sleep (a chunk held past the spin budget)
    std::vector<int32_t> chunks_per_op;  // [thread][op] in the last step
  };
  ThreadStats thread_stats() const;
  void reset_thread_stats();
  // (cycles all threads spent in kernels, steps' wall cycles x threads) since
  // the last reset: without waiting for a late worker, so another thread may
  // call it while steps run (the server's /metrics).
  std::pair<int64_t, int64_t> idle_counters() const;

  // Test hook: thread `ith` waits, without claiming, until the first op (or,
  // with every, each op) of each kind in `kinds_mask` (bit = OpKind) has been
  // done by the others, in every step: a thread the OS took off its core at
  // that moment. -1: off.
  // hold: instead, it claims one chunk of each such op and runs it only
  // once the others have finished the op (a thread descheduled mid-chunk):
  // staged ops only (a held chunk of an unstaged op would hold the step).
  void set_test_stall(int ith, uint32_t kinds_mask, bool every, bool hold = false) {
    pool_->quiesce();
    stall_thread_ = ith, stall_kinds_ = kinds_mask, stall_every_ = every, stall_hold_ = hold;
  }

  // Backup copies (executor.cpp): 0 never (the default), 1 in steps after a
  // thread of the job was found busy, 2 in every step of up to kStageRows
  // tokens. With them on, a thread the OS took off its core mid-chunk may
  // still be inside that chunk (a copy whose commit will lose) after run()
  // returns: it only reads, but it reads the Program's memory, so its
  // owner keeps every array the Program reads alive until quiesce() or the
  // executor's end (ModelRunner quiesces in its finalizer). Hence opt-in.
  enum BackupMode { BACKUPS_NEVER = 0, BACKUPS_BUSY = 1, BACKUPS_ALWAYS = 2 };
  static constexpr int kStageRows = 16;
  void set_backups(int mode) {
    if (mode < BACKUPS_NEVER || mode > BACKUPS_ALWAYS) throw std::invalid_argument("set_backups: mode 0, 1 or 2");
    pool_->quiesce();
    backups_mode_ = mode;
  }
  int backups_mode() const { return backups_mode_; }
  // Returns when no thread is inside a job (a late copy included).
  void quiesce() { pool_->quiesce(); }

  // Runs the Program for one step. Inputs are validated (lengths, ranges)
  // before any kernel runs; throws std::invalid_argument on bad input.
  void run(int n_tokens, const int32_t* tokens, const int32_t* positions, const int32_t* slots,
           const int32_t* seq_of_token, int n_seqs, const int32_t* block_tables, int max_blocks,
           int n_out, const int32_t* out_rows);

 private:
  static void job(void* self, int ith, int nth);
  void job_chunked(int ith, int nth);
  void resolve(Ref& r, const char* op, const char* name) const;
  int64_t ref_bytes(const Ref& r) const;
  void size_claims();
  int64_t claim(size_t k, size_t last, int ith, int nth, uint32_t g, bool* stolen);
  int op_state(size_t k, uint32_t g) const;
  bool report(size_t k, uint32_t g, int64_t n);
  bool wait_op(size_t k, uint32_t g, int ith, int nth, int64_t chunk_ns);
  struct PerThread;
  bool run_staged(size_t k, uint32_t g, int ith, int nth, StepCtx& c, PerThread& me, int stall);
  bool run_chunk_staged(size_t k, int64_t u, uint32_t g, StepCtx& c);
  bool commit(size_t k, int64_t u, uint32_t g, Stage& st);
  bool take_snapshot(size_t k, uint32_t g, int ith, const StepCtx& c);

  ExecConfig cfg_;
  const KernelTable* table_;
  std::unique_ptr<ThreadPool> pool_;
  struct BufferFree {
    size_t map_len;  // a map_pages mapping's length, 0 for the heap (value-initialized)
    void operator()(uint8_t* p) const;
  };
  struct Buffer {
    std::unique_ptr<uint8_t, BufferFree> data;
    int64_t size = 0;
  };
  std::vector<Buffer> buffers_;
  // The Program: each op's params (a deque: their addresses never move) and
  // the kernel to call with them.
  struct Slot {
    KernelFn fn;
    const void* params;
    int kind;
    int bytes;  // sizeof the params struct (prefetched while the op before runs)
    // A packed matmul's weights (tiles of tile_bytes, shared out by
    // tile_ranges): where each thread's share starts, prefetched by threads
    // waiting for the op before it to end.
    const uint8_t* stream = nullptr;
    int64_t tile_bytes = 0, tiles = 0;
    // kv_write whose attention is the next op (same pools): in a step where
    // every sequence's tokens are one attention run (decode), chunk u of
    // both is one piece of work (the same (run, kv head) items), so the two
    // ops are one region: no thread waits between them.
    bool pairs_next = false;
  };
  std::deque<AnyOp> params_;
  std::vector<Slot> slots_;
  int64_t allocations_ = 0;
  int64_t token_limit_ = -1;  // token ids must be below (the smallest embedding table)
  // step inputs, sized once at construction
  std::vector<int32_t> tokens_, positions_, slots_in_, seq_of_token_, block_tables_, out_rows_;
  std::vector<float> scratch_;
  bool profiling_ = false;
  std::vector<int64_t> op_ns_;
  int64_t steps_ = 0;
  StepCtx ctx_{};

  // Claimed chunks (executor.cpp says how). Sized in add(), with the pool
  // quiesced; a late worker may read any of these at any time.
  struct alignas(64) Line {
    std::atomic<uint64_t> w[8];
  };
  std::atomic<uint32_t> step_gen_{0};        // the step running (or last run)
  std::atomic<bool> pairs_live_{false};      // this step runs the pairs_next ops as one region
  int64_t pairs_ = 0, last_regions_ = 0;
  std::unique_ptr<std::atomic<int32_t>[]> chunks_;  // [op] chunks this step, set before launch
  std::vector<Line> own_;                    // [thread][op]: (gen | begin | end) of its unclaimed chunks
  std::vector<Line> done_;                   // [op]: (gen | complete | chunks done)
  size_t own_stride_ = 0;                    // lines per thread in own_
  alignas(64) std::atomic<uint32_t> progress_{0};  // bumped when an op completes (futex word)
  std::atomic<int> sleepers_{0};
  // Written by its thread only; atomics (relaxed: plain loads and stores on
  // x86) so idle_counters() may read them while a step runs.
  struct alignas(64) PerThread {
    std::atomic<int64_t> chunks{0}, stolen{0}, work{0}, busy_steps{0}, all_busy_steps{0}, backups{0}, discarded{0};
    static void add(std::atomic<int64_t>& a, int64_t d) { a.store(a.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); }
  };
  std::vector<PerThread> per_thread_;
  std::vector<int32_t> chunks_per_op_;        // [thread][op]
  std::atomic<int64_t> sleeps_{0}, staged_steps_{0};
  // Backup copies (executor.cpp). commit_[op * kMaxChunks + u]: the last
  // step that committed chunk u of a staged op. stages_[t]: thread t's
  // stage, stage_cap_ entries (the largest staged matmul chunk at
  // kStageRows rows), in stage_mem_.
  static constexpr int kMaxChunks = (int)kMatmulMaxChunks;  // a matmul's chunks at most (chunks_of)
  int backups_mode_ = BACKUPS_NEVER;
  std::atomic<bool> stage_live_{false};  // this step runs its matmuls staged
  std::unique_ptr<std::atomic<uint32_t>[]> commit_;
  std::vector<StageEntry> stage_mem_;
  std::vector<Stage> stages_;
  int64_t stage_cap_ = 0;
  // snap_ops_[t]: thread t's copy of the staged matmul it runs, its inputs
  // pointed at snap_mem_'s t-th snap_cap_ bytes (run_chunk_staged).
  std::vector<MatmulOp> snap_ops_;
  std::vector<uint8_t> snap_mem_;
  int64_t snap_cap_ = 0;
  std::atomic<int64_t> wall_cycles_{0}, stat_steps_{0};
  int stall_thread_ = -1;
  uint32_t stall_kinds_ = 0;
  bool stall_every_ = false, stall_hold_ = false;
  std::atomic<uint64_t> hold_mark_{0};  // (step << 32 | op) the holder last held a chunk of
};

const KernelTable* kernel_table(const std::string& isa);

// Heap allocations made by C++ code of this extension while a step runs
// (operator new from inside Executor::run on any of its threads): 0 is the
// contract. Counted by a replacement operator new (alloc_count.cpp) that only
// this module's code calls.
int64_t step_allocations();

}  // namespace lj
