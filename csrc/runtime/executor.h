// executor.h — runs a whole forward step (a Program of typed ops) in one call.
//
// Python builds the Program once per runner: each op is its family's params
// struct (kernels/ops.h), whose tensor operands (Refs) name an executor-owned
// buffer (the activation arena, the KV pool) and an offset, or a weight array
// Python keeps alive. A step only copies the step inputs (token ids,
// positions, KV slots, block tables) into pre-sized arrays and runs every op
// on the thread pool, a barrier between ops. Nothing is allocated inside a
// step (counted: step_allocations).
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
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
  int alloc_buffer(int64_t nbytes);
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

  // Per-op wall time, measured by thread 0 from an op's start to the barrier
  // after it (so it includes waiting for the slowest thread). Off by default.
  void set_profiling(bool on) { profiling_ = on; op_ns_.assign(slots_.size(), 0); steps_ = 0; }
  const std::vector<int64_t>& op_ns() const { return op_ns_; }
  int64_t profiled_steps() const { return steps_; }

  // Runs the Program for one step. Inputs are validated (lengths, ranges)
  // before any kernel runs; throws std::invalid_argument on bad input.
  void run(int n_tokens, const int32_t* tokens, const int32_t* positions, const int32_t* slots,
           const int32_t* seq_of_token, int n_seqs, const int32_t* block_tables, int max_blocks,
           int n_out, const int32_t* out_rows);

 private:
  static void job(void* self, int ith, int nth);
  void resolve(Ref& r, const char* op, const char* name) const;

  ExecConfig cfg_;
  const KernelTable* table_;
  std::unique_ptr<ThreadPool> pool_;
  struct Buffer {
    std::unique_ptr<uint8_t, void (*)(void*)> data{nullptr, nullptr};
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
    // A packed matmul's weights (tiles of tile_bytes; the QKV epilogue splits
    // its first qtiles apart): where each thread's share starts, prefetched
    // by the threads that wait at the barrier before the op.
    const uint8_t* stream = nullptr;
    int64_t tile_bytes = 0, tiles = 0, qtiles = 0;
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
};

const KernelTable* kernel_table(const std::string& isa);

// Heap allocations made by C++ code of this extension while a step runs
// (operator new from inside Executor::run on any of its threads): 0 is the
// contract. Counted by a replacement operator new (alloc_count.cpp) that only
// this module's code calls.
int64_t step_allocations();

}  // namespace lj
