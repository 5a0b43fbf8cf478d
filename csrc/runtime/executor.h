// executor.h — runs a whole forward step (a Program of Ops) in one call.
//
// Python builds the Program once per (phase, shape bucket): every operand is
// an offset into an executor-owned buffer (the activation arena, the KV pool)
// or a weight array Python keeps alive. A step only copies the step inputs
// (token ids, positions, KV slots, block tables) into pre-sized arrays and
// runs every op on the thread pool, a barrier between ops. Nothing is
// allocated inside a step.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../common.h"
#include "threadpool.h"

namespace lj {

struct ExecConfig {
  std::string isa;             // "ref" | "avx2" | "avx512"
  int n_threads = 1;
  int max_tokens = 1;          // tokens per step
  int max_out = 1;             // rows of logits per step (<= max_tokens)
  int max_seqs = 1;            // sequences per step
  int max_blocks = 1;          // block-table columns per sequence
  int64_t kv_slots = 0;        // slots in the KV pool (blocks * block_size)
  int64_t block_size = 16;     // tokens per KV block
  int64_t max_pos = 0;         // rows of the RoPE tables = max context
  int64_t scratch_floats = 0;  // per-thread scratch, at least; add_op grows it to what each op needs
};

// An operand as Python hands it over: a buffer id and byte offset, or a raw
// weight pointer with its size (checked against what the op will read).
struct Operand {
  int buffer = -1;       // executor buffer id, or -1 for external memory
  int64_t offset = 0;    // bytes into the buffer
  const void* ptr = nullptr;  // external memory (weights), when buffer == -1
  int64_t nbytes = 0;         // size of the external memory
};

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

  // Appends an op. Operand order: x, x2, w, w2, out, out2, e0, e1 (unused: buffer -1,
  // ptr null). Throws std::invalid_argument if any operand would be read or
  // written outside its memory for the largest step this executor accepts.
  void add_op(Op op, const Operand opnd[OP_OPERANDS]);
  size_t num_ops() const { return ops_.size(); }
  int op_kind(size_t k) const { return ops_.at(k).kind; }

  // Per-op wall time, measured by thread 0 from an op's start to the barrier
  // after it (so it includes waiting for the slowest thread). Off by default.
  void set_profiling(bool on) { profiling_ = on; op_ns_.assign(ops_.size(), 0); steps_ = 0; }
  const std::vector<int64_t>& op_ns() const { return op_ns_; }
  int64_t profiled_steps() const { return steps_; }

  // Runs the Program for one step. Inputs are validated (lengths, ranges)
  // before any kernel runs; throws std::invalid_argument on bad input.
  void run(int n_tokens, const int32_t* tokens, const int32_t* positions, const int32_t* slots,
           const int32_t* seq_of_token, int n_seqs, const int32_t* block_tables, int max_blocks,
           int n_out, const int32_t* out_rows);

 private:
  static void job(void* self, int ith, int nth);

  ExecConfig cfg_;
  const KernelTable* table_;
  std::unique_ptr<ThreadPool> pool_;
  struct Buffer {
    std::unique_ptr<uint8_t, void (*)(void*)> data{nullptr, nullptr};
    int64_t size = 0;
  };
  std::vector<Buffer> buffers_;
  std::vector<Op> ops_;
  int64_t allocations_ = 0;
  // step inputs, sized once at construction
  std::vector<int32_t> tokens_, positions_, slots_, seq_of_token_, block_tables_, out_rows_;
  std::vector<float> scratch_;
  bool profiling_ = false;
  std::vector<int64_t> op_ns_;
  int64_t steps_ = 0;
  StepCtx ctx_{};
};

const KernelTable* kernel_table(const std::string& isa);

}  // namespace lj
