// executor.cpp — see executor.h.
#include "executor.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "alloc_count.h"
#include "cpu_features.h"

namespace lj {

// Bytes of the next matmul's weights each waiting thread prefetches at a
// barrier (L2 is 1-2 MiB per core on the CPUs this targets).
constexpr int64_t kBarrierPrefetch = 64 * 1024;

const KernelTable* kernel_table(const std::string& isa) {
  bool ok = false;
  for (const auto& s : supported_isas()) ok = ok || s == isa;
  if (!ok) throw std::invalid_argument("ISA '" + isa + "' is not supported by this CPU/OS");
  if (isa == "amx") return kernels_amx();
  if (isa == "avx512") return kernels_avx512();
  if (isa == "avx2") return kernels_avx2();
  return kernels_ref();
}

// Floats between two threads' scratch: the request plus 16 spare, rounded up
// to 16 floats so every thread's scratch starts 64-byte aligned relative to
// the (malloc-aligned) buffer. Kernels keep pointers and int64 tables in it
// (attention's block pointers): an odd request once left thread 1's pointers
// misaligned, which UBSan reported (make sanitize).
static int64_t scratch_stride(int64_t floats) { return (floats + 16 + 15) / 16 * 16; }

Executor::Executor(const ExecConfig& cfg) : cfg_(cfg), table_(kernel_table(cfg.isa)) {
  if (cfg_.n_threads < 1 || cfg_.max_tokens < 1 || cfg_.max_out < 0 ||
      cfg_.max_out > cfg_.max_tokens || cfg_.max_seqs < 1 || cfg_.max_blocks < 1 ||
      cfg_.scratch_floats < 0 || cfg_.kv_slots < 0 || cfg_.max_pos < 0 || cfg_.block_size < 1 ||
      cfg_.kv_slots % cfg_.block_size != 0)
    throw std::invalid_argument("Executor: bad configuration");
  pool_ = std::make_unique<ThreadPool>(cfg_.n_threads);
  tokens_.assign(cfg_.max_tokens, 0);
  positions_.assign(cfg_.max_tokens, 0);
  slots_in_.assign(cfg_.max_tokens, 0);
  seq_of_token_.assign(cfg_.max_tokens, 0);
  out_rows_.assign(cfg_.max_out + 1, 0);
  block_tables_.assign((size_t)cfg_.max_seqs * cfg_.max_blocks, 0);
  scratch_.assign((size_t)cfg_.n_threads * scratch_stride(cfg_.scratch_floats), 0.f);
  ctx_.scratch = scratch_.data();
  ctx_.scratch_floats = scratch_stride(cfg_.scratch_floats);
  ctx_.block_size = cfg_.block_size;
}

int Executor::alloc_buffer(int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("alloc_buffer: negative size");
  const int64_t rounded = ((nbytes + 63) / 64) * 64 + 64;
  void* p = std::aligned_alloc(64, (size_t)rounded);
  if (!p) throw std::bad_alloc();
  // Not zeroed: large blocks come from mmap (zero pages committed lazily, so
  // an unused KV pool costs no RSS) and no kernel reads what it did not write.
  ++allocations_;
  Buffer b;
  b.data = std::unique_ptr<uint8_t, void (*)(void*)>((uint8_t*)p, std::free);
  b.size = nbytes;
  buffers_.push_back(std::move(b));
  return (int)buffers_.size() - 1;
}

uint8_t* Executor::buffer_data(int id) const {
  if (id < 0 || id >= (int)buffers_.size()) throw std::out_of_range("no such buffer");
  return buffers_[id].data.get();
}

int64_t Executor::buffer_size(int id) const {
  if (id < 0 || id >= (int)buffers_.size()) throw std::out_of_range("no such buffer");
  return buffers_[id].size;
}

// An operand's memory must hold its declared shape for the largest step
// (rows ROWS_TOKENS / ROWS_OUT at max_tokens / max_out): then `data` is set.
void Executor::resolve(Ref& r, const char* op, const char* name) const {
  r.data = nullptr;
  if (!present(r)) return;
  const auto bad = [&](const std::string& why) {
    throw std::invalid_argument(std::string(op) + ": operand " + name + " " + why);
  };
  if (r.dtype < 0 || r.dtype > DTYPE_MAX) bad("has an unknown storage type");
  if (r.rows < ROWS_OUT) bad("has a bad row count");
  const int64_t rows = r.rows == ROWS_TOKENS ? cfg_.max_tokens : r.rows == ROWS_OUT ? cfg_.max_out : r.rows;
  const int64_t need = tensor_bytes(r.dtype, rows, r.cols, r.group);
  if (need < 0)
    bad("cannot hold [" + std::to_string(r.rows) + ", " + std::to_string(r.cols) + "] (group " +
        std::to_string(r.group) + ") in storage type " + std::to_string(r.dtype) +
        (is_ggml_block(r.dtype) ? ": quantized rows need cols % 32 == 0" : ""));
  if (r.buffer >= 0) {
    if (r.ptr != nullptr) bad("names both a buffer and external memory");
    if (r.buffer >= (int)buffers_.size()) bad("names no such buffer");
    int64_t end;
    if (r.offset < 0 || r.offset % 4 != 0 || __builtin_add_overflow(r.offset, need, &end) ||
        end > buffers_[r.buffer].size)
      bad("out of its buffer");
    r.data = buffers_[r.buffer].data.get() + r.offset;
  } else {
    if (r.nbytes < need)
      bad("too small (" + std::to_string(r.nbytes) + " < " + std::to_string(need) + " bytes)");
    r.data = const_cast<void*>(r.ptr);
  }
}

template <class P>
void Executor::add(P p) {
  using T = OpTraits<P>;
  T::fields(p, [&](const char* name, auto& field, const char*) {
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, Ref>) resolve(field, T::name, name);
  });
  OpCheck check{cfg_, T::name};
  rules(p, check);
  if (check.token_limit >= 0 && (token_limit_ < 0 || check.token_limit < token_limit_))
    token_limit_ = check.token_limit;
  // Scratch is sized from the Program, here, never inside a step.
  if (check.scratch_floats > cfg_.scratch_floats) {
    cfg_.scratch_floats = check.scratch_floats;
    scratch_.assign((size_t)cfg_.n_threads * scratch_stride(check.scratch_floats), 0.f);
    ctx_.scratch = scratch_.data();
    ctx_.scratch_floats = scratch_stride(check.scratch_floats);
    ++allocations_;
  }
  params_.emplace_back(std::move(p));
  Slot s{table_->fn[T::kind], &std::get<P>(params_.back()), (int)T::kind, (int)sizeof(P)};
  if constexpr (std::is_same_v<P, MatmulOp>) {
    const MatmulOp& m = std::get<P>(params_.back());
    if (is_packed(m.w.dtype)) {
      s.stream = (const uint8_t*)m.w.data;
      s.tile_bytes = packed_tile_bytes(m.w.dtype, m.w.cols, m.w.group);
      s.tiles = (m.w.rows + TILE - 1) / TILE;
      s.qtiles = m.epilogue == EPI_QKV ? m.out.cols / TILE : 0;  // as the kernel's tile_ranges
    }
  }
  slots_.push_back(s);
}

#define LJ_OP_ADD(KIND, name, P, FIELDS, kernel) template void Executor::add<P>(P);
LJ_OPS(LJ_OP_ADD)
#undef LJ_OP_ADD

void Executor::run(int n_tokens, const int32_t* tokens, const int32_t* positions, const int32_t* slots,
                   const int32_t* seq_of_token, int n_seqs, const int32_t* block_tables, int max_blocks,
                   int n_out, const int32_t* out_rows) {
  // Validate everything a kernel will index with, before any kernel runs.
  if (n_tokens < 1 || n_tokens > cfg_.max_tokens) throw std::invalid_argument("run: bad token count");
  if (n_seqs < 1 || n_seqs > cfg_.max_seqs) throw std::invalid_argument("run: bad sequence count");
  if (max_blocks < 1 || max_blocks > cfg_.max_blocks) throw std::invalid_argument("run: bad block-table width");
  if (n_out < 0 || n_out > n_tokens || n_out > cfg_.max_out) throw std::invalid_argument("run: bad output row count");
  // Attention reads block_tables[s][j / block_size] for j <= position.
  const int64_t ctx_limit = (int64_t)max_blocks * cfg_.block_size;
  const int64_t n_blocks = cfg_.kv_slots / cfg_.block_size;
  for (int t = 0; t < n_tokens; ++t) {
    if (token_limit_ >= 0 && (tokens[t] < 0 || tokens[t] >= token_limit_))
      throw std::invalid_argument("run: token id " + std::to_string(tokens[t]) + " out of vocabulary");
    if (positions[t] < 0 || positions[t] >= cfg_.max_pos || positions[t] >= ctx_limit)
      throw std::invalid_argument("run: position " + std::to_string(positions[t]) + " out of range");
    if (slots[t] < 0 || slots[t] >= cfg_.kv_slots) throw std::invalid_argument("run: KV slot out of range");
    if (seq_of_token[t] < 0 || seq_of_token[t] >= n_seqs) throw std::invalid_argument("run: bad sequence index");
  }
  for (int64_t k = 0; k < (int64_t)n_seqs * max_blocks; ++k)
    if (block_tables[k] < 0 || block_tables[k] >= n_blocks) throw std::invalid_argument("run: block id out of range");
  for (int r = 0; r < n_out; ++r)
    if (out_rows[r] < 0 || out_rows[r] >= n_tokens) throw std::invalid_argument("run: bad output row");
  std::memcpy(tokens_.data(), tokens, n_tokens * sizeof(int32_t));
  std::memcpy(positions_.data(), positions, n_tokens * sizeof(int32_t));
  std::memcpy(slots_in_.data(), slots, n_tokens * sizeof(int32_t));
  std::memcpy(seq_of_token_.data(), seq_of_token, n_tokens * sizeof(int32_t));
  std::memcpy(out_rows_.data(), out_rows, n_out * sizeof(int32_t));
  std::memcpy(block_tables_.data(), block_tables, (size_t)n_seqs * max_blocks * sizeof(int32_t));
  ctx_.n_tokens = n_tokens;
  ctx_.n_out = n_out;
  ctx_.n_seqs = n_seqs;
  ctx_.max_blocks = max_blocks;
  ctx_.tokens = tokens_.data();
  ctx_.positions = positions_.data();
  ctx_.slots = slots_in_.data();
  ctx_.seq_of_token = seq_of_token_.data();
  ctx_.block_tables = block_tables_.data();
  ctx_.out_rows = out_rows_.data();
  pool_->run(&Executor::job, this);
}

void Executor::job(void* self, int ith, int nth) {
  Executor* e = (Executor*)self;
  const CountStepAllocations counting;  // this thread's operator new calls, until the step ends
  const size_t n = e->slots_.size();
  const bool prof = e->profiling_ && ith == 0;
  auto t0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < n; ++k) {
    const Slot& op = e->slots_[k];
    // The next op's params into cache while this one runs: the weights
    // streaming through every step evict them, and a kernel's first reads
    // of its struct (a matmul's ~750 bytes) would otherwise wait on memory.
    if (k + 1 < n)
      for (int off = 0; off < e->slots_[k + 1].bytes; off += 64)
        __builtin_prefetch((const char*)e->slots_[k + 1].params + off, 0, 3);
    op.fn(op.params, e->ctx_, ith, nth);
    if (k + 1 < n || e->profiling_) {  // all threads see profiling_
      // A waiter prefetches the start of its share of the next op's weights
      // (up to kBarrierPrefetch): the memory stays busy while the slowest
      // thread finishes, and the next op starts on lines already in L2.
      const Slot* nx = k + 1 < n ? &e->slots_[k + 1] : nullptr;
      if (nx && nx->stream) {
        const Range r = split(nx->qtiles ? nx->qtiles : nx->tiles, ith, nth);
        const int64_t bytes = (r.e - r.b) * nx->tile_bytes;
        e->pool_->barrier(nx->stream + r.b * nx->tile_bytes, bytes < kBarrierPrefetch ? bytes : kBarrierPrefetch);
      } else {
        e->pool_->barrier();
      }
    }
    if (prof) {
      const auto t1 = std::chrono::steady_clock::now();
      e->op_ns_[k] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
      t0 = t1;
    }
  }
  if (prof) ++e->steps_;
}

}  // namespace lj
