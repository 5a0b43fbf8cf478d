// executor.cpp — see executor.h.
#include "executor.h"

#include <x86intrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <sched.h>

#include "alloc_count.h"
#include "cpu_features.h"
#include "pages.h"

namespace lj {

// Bytes of the next matmul's weights a thread prefetches while it waits for
// an op's last chunks (L2 is 1-2 MiB per core on the CPUs this targets).
constexpr int64_t kWaitPrefetch = 64 * 1024;

// ---------------------------------------------------------------- claimed chunks
// How a step's work is shared (issue 40). Each op is cut into U chunks, U
// from the op's own work items and fixed sizes (op_chunks: never from the
// thread count), and kernel(params, ctx, u, U) computes chunk u. Thread t
// owns chunks split(U, t, nth): it claims them from the front; a thread with
// none left takes the others' from their back ends. So on a quiet machine
// each thread runs its own share, in order, as before (its cache holds what
// it wrote in the op before), and a thread the OS has taken off its core
// claims nothing: the others run its chunks, and the op ends when all U are
// done, not when every thread has passed a barrier.
//
// Words (all CAS, so a late thread can never take a chunk of a newer step):
//   own[t][k]  = gen:24 | begin:20 | end:20, thread t's unclaimed chunks of op
//                k; set to t's share by the first thread to touch it in a
//                step (its generation older than the step's).
//   done[k]    = gen:32 | complete:1 | count:31, chunks of op k finished.
// A thread adds its count once it finds nothing more to claim; the one that
// makes it U sets `complete` and bumps progress_ (the futex word waiters
// sleep on). Thread 0 returns from run() when the last op is complete;
// workers may still be inside the job (a late one, just woken), but all they
// can do is look at words: a claim counts only if op_state() says running after it
// (the op of that step not yet complete), and then the step cannot end
// before the chunk is done, so what the late thread read (ctx_, chunks_) was
// that step's. Chunks are never run twice (no backup copies): an epilogue
// that adds into its output in place, or a late write into an arena the next
// op already reuses, would not survive a duplicate.
//
// Except staged: backup copies (opt-in: set_backups, executor.h says what
// the owner then keeps alive). In a step of at most kStageRows tokens after
// a thread of the job was found busy (taken off its core against its will
// lately), every matmul chunk runs staged: its epilogue
// writes go into the thread's stage (StepCtx::stage), and the chunk is
// committed by a CAS on commit_[op][u] (from an older step's generation to
// this one): the winner writes the stage to memory and reports the chunk
// done, a loser drops its copy. A thread that finds nothing left to claim
// and has waited its spin budget (about two chunks: a running holder would
// have finished) runs the op's uncommitted chunks itself, staged, and
// commits what it wins (MapReduce's backup tasks). Safe because only a
// commit writes, once, while the op is running (it is not complete before
// its last chunk is committed), and because no copy computes on inputs a
// later op has rewritten: a thread's first staged chunk of an op copies the
// op's inputs into its snapshot and computes only if the op was still
// running after the copy (run_chunk_staged), so a late holder computes true
// values from its copy, or nothing, and loses its commit (CI's UBSan run
// once caught a late copy's integer arithmetic on a half-rewritten input).
// A residual epilogue's columns are written by its own chunk's commit only.
// Bits: a chunk's values are the same whoever runs it (no kernel's
// arithmetic depends on the thread), so a backup changes no result.
// Matmuls are most of a decode step; the other ops still wait for a held
// chunk (counted as sleeps).
namespace {
constexpr uint32_t kGenMask = (1u << 24) - 1;
constexpr uint64_t kPosMask = (1u << 20) - 1;
constexpr uint64_t kComplete = 1ull << 31;
inline uint64_t pack_own(uint32_t g, int64_t b, int64_t e) {
  return (uint64_t)(g & kGenMask) << 40 | (uint64_t)b << 20 | (uint64_t)e;
}
// a newer than b, 24-bit generations (a late thread is never 2^23 steps behind)
inline bool newer24(uint32_t a, uint32_t b) { return a != b && ((a - b) & kGenMask) < (1u << 23); }
inline bool newer32(uint32_t a, uint32_t b) { return (int32_t)(a - b) > 0; }

}  // namespace

// Chunks of op s this step: its family's chunks_of (next to its kernel,
// from the work items the kernel splits). att_runs: the step's attention
// runs (counted once per step, in run()).
static int64_t op_chunks(int kind, const void* params, const StepCtx& c, int64_t att_runs) {
  switch (kind) {
#define LJ_OP_CHUNKS(KIND, name, P, FIELDS, kernel) \
  case KIND: return chunks_of(*(const P*)params, c, att_runs);
    LJ_OPS(LJ_OP_CHUNKS)
#undef LJ_OP_CHUNKS
    default: return 1;
  }
}

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

Executor::~Executor() { pool_->quiesce(); }  // late workers read slots_, own_, ...

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
  ctx_.first = 1;
  per_thread_ = std::vector<PerThread>(cfg_.n_threads);
  size_claims();
}

// The inputs a staged matmul reads that earlier ops wrote this step (x, qin,
// the residual, the outlier values; weights, tables and norms do not
// change): what take_snapshot copies, each its bytes at c's rows (0:
// absent), at a 64-byte boundary.
static constexpr Ref MatmulOp::* kSnapshotInputs[] = {&MatmulOp::x, &MatmulOp::qin, &MatmulOp::residual, &MatmulOp::xo};
static int64_t snapshot_bytes(const Ref& r, const StepCtx& c) {
  return present(r) ? tensor_bytes(r.dtype, resolve_rows(r.rows, c), r.cols, r.group) : 0;
}
static int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

// The claim words for the Program as it is (pool quiesced). Words start at
// the last step's generation, complete: the next step's is newer.
void Executor::size_claims() {
  const size_t n = slots_.size(), nth = cfg_.n_threads;
  const uint32_t g = step_gen_.load(std::memory_order_relaxed);
  chunks_.reset(new std::atomic<int32_t>[n + 1]());
  own_stride_ = (n + 7) / 8 + 1;
  own_ = std::vector<Line>(nth * own_stride_);
  done_ = std::vector<Line>(own_stride_);
  for (auto& l : own_)
    for (auto& w : l.w) w.store(pack_own(g, 0, 0), std::memory_order_relaxed);
  for (auto& l : done_)
    for (auto& w : l.w) w.store((uint64_t)g << 32 | kComplete, std::memory_order_relaxed);
  chunks_per_op_.assign(nth * n, 0);
  commit_.reset(new std::atomic<uint32_t>[n * kMaxChunks + 1]);
  for (size_t i = 0; i < n * kMaxChunks + 1; ++i) commit_[i].store(g, std::memory_order_relaxed);
  // Stages: the largest matmul chunk (tiles per chunk as op_chunks cuts
  // them, plus one for QKV's two ranges) at kStageRows rows; snapshots: the
  // largest matmul's inputs at kStageRows rows.
  StepCtx staged{};
  staged.n_tokens = staged.n_out = kStageRows;
  stage_cap_ = snap_cap_ = 0;
  for (const Slot& s : slots_)
    if (s.kind == OP_MATMUL) {
      const MatmulOp& m = *(const MatmulOp*)s.params;
      const int64_t tiles = (m.w.rows + TILE - 1) / TILE, U = chunks_of(m, staged, 0);
      stage_cap_ = std::max(stage_cap_, ((tiles + U - 1) / U + 1) * kStageRows);
      int64_t bytes = 0;
      for (auto f : kSnapshotInputs) bytes += round64(snapshot_bytes(m.*f, staged));
      snap_cap_ = std::max(snap_cap_, bytes);
    }
  stage_mem_.assign(nth > 1 ? nth * stage_cap_ : 0, StageEntry{});
  snap_mem_.assign(nth > 1 ? nth * snap_cap_ + 64 : 0, 0);  // (+ 64: each thread's copy 64-byte aligned)
  snap_ops_.assign(nth, MatmulOp{});
  stages_.assign(nth, Stage{});
  for (size_t t = 0; t < nth && nth > 1; ++t) stages_[t] = Stage{stage_mem_.data() + t * stage_cap_, 0, stage_cap_, false};
}

int Executor::alloc_buffer(int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("alloc_buffer: negative size");
  const int64_t rounded = ((nbytes + 63) / 64) * 64 + 64;
  // Not zeroed: large blocks are mappings of their own (zero pages committed
  // lazily, so an unused KV pool costs no RSS) and no kernel reads what it
  // did not write.
  size_t map_len = 0;
  uint8_t* p = rounded >= kPageMapMin ? map_pages(rounded, &map_len) : nullptr;
  if (!p) p = (uint8_t*)std::aligned_alloc(64, (size_t)rounded);
  if (!p) throw std::bad_alloc();
  ++allocations_;
  Buffer b;
  b.data = std::unique_ptr<uint8_t, BufferFree>(p, BufferFree{map_len});
  b.size = nbytes;
  buffers_.push_back(std::move(b));
  return (int)buffers_.size() - 1;
}

void Executor::BufferFree::operator()(uint8_t* p) const {
  if (map_len) unmap_pages(p, map_len);
  else std::free(p);
}

void Executor::prefault_buffer(int id) {
  if (id < 0 || id >= (int)buffers_.size()) throw std::out_of_range("no such buffer");
  Buffer& b = buffers_[id];
  if (b.data.get_deleter().map_len) populate_pages(b.data.get(), b.size, cfg_.n_threads);
  else std::memset(b.data.get(), 0, (size_t)b.size);
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
  const int64_t need = ref_bytes(r);
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

// Bytes an operand spans at the largest step.
int64_t Executor::ref_bytes(const Ref& r) const {
  const int64_t rows = r.rows == ROWS_TOKENS ? cfg_.max_tokens : r.rows == ROWS_OUT ? cfg_.max_out : r.rows;
  return tensor_bytes(r.dtype, rows, r.cols, r.group);
}

template <class P>
void Executor::add(P p) {
  using T = OpTraits<P>;
  pool_->quiesce();
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
    }
  }
  if constexpr (std::is_same_v<P, AttentionOp>) {
    const AttentionOp& a = std::get<P>(params_.back());
    if (!slots_.empty() && slots_.back().kind == OP_KV_WRITE) {
      const KvWriteOp& w = *(const KvWriteOp*)slots_.back().params;
      // As one region, attention chunk u writes while another chunk's
      // kv_write may still read k / v: only where their memory is apart (the
      // planner keeps it so: graph/planner.py liveness).
      const auto apart = [&](const Ref& x, const Ref& y) {
        if (!present(x) || !present(y)) return true;
        const char *xb = (const char*)x.data, *yb = (const char*)y.data;
        return xb + ref_bytes(x) <= yb || yb + ref_bytes(y) <= xb;
      };
      if (w.k_pool.data == a.k_pool.data && w.v_pool.data == a.v_pool.data && w.kv_heads == a.kv_heads &&
          apart(a.out, w.k) && apart(a.out, w.v) && apart(a.qout, w.k) && apart(a.qout, w.v))
        slots_.back().pairs_next = true, ++pairs_;
    }
  }
  slots_.push_back(s);
  size_claims();
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
  // One attention run per sequence (decode): kv_write + attention pairs are one region.
  int64_t runs = 0, cost;
  for (int64_t t0 = 0; t0 < ctx_.n_tokens; ++runs) t0 = att_next_run(ctx_, t0, &cost);
  const bool pairs = runs == n_seqs && pairs_ > 0 && cfg_.n_threads > 1;
  last_regions_ = (int64_t)slots_.size() - (pairs ? pairs_ : 0);
  if (cfg_.n_threads > 1) {
    pairs_live_.store(pairs, std::memory_order_relaxed);
    const bool staged = n_tokens <= kStageRows &&
                        (backups_mode_ == BACKUPS_ALWAYS || (backups_mode_ == BACKUPS_BUSY && any_thread_busy(cfg_.n_threads)));
    stage_live_.store(staged, std::memory_order_relaxed);
    PerThread::add(staged_steps_, staged);
    for (size_t k = 0; k < slots_.size(); ++k)
      chunks_[k].store((int32_t)op_chunks(slots_[k].kind, slots_[k].params, ctx_, runs), std::memory_order_relaxed);
    step_gen_.fetch_add(1, std::memory_order_release);  // launch() publishes it (and ctx_, chunks_) again
  }
  const uint64_t w0 = __rdtsc();
  pool_->launch(&Executor::job, this);
  PerThread::add(wall_cycles_, (int64_t)(__rdtsc() - w0));
  PerThread::add(stat_steps_, 1);
}

void Executor::job(void* self, int ith, int nth) {
  Executor* e = (Executor*)self;
  const CountStepAllocations counting;  // this thread's operator new calls, until the step ends
  if (nth > 1) return e->job_chunked(ith, nth);
  // One thread: every op whole, in order (nothing to claim from anyone).
  const size_t n = e->slots_.size();
  auto t0 = std::chrono::steady_clock::now();
  const uint64_t w0 = __rdtsc();
  for (size_t k = 0; k < n; ++k) {
    const Slot& op = e->slots_[k];
    if (k + 1 < n)
      for (int off = 0; off < e->slots_[k + 1].bytes; off += 64)
        __builtin_prefetch((const char*)e->slots_[k + 1].params + off, 0, 3);
    op.fn(op.params, e->ctx_, 0, 1);
    if (e->profiling_) {
      const auto t1 = std::chrono::steady_clock::now();
      e->op_ns_[k] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
      t0 = t1;
    }
  }
  PerThread::add(e->per_thread_[0].work, (int64_t)(__rdtsc() - w0));
  PerThread::add(e->per_thread_[0].chunks, (int64_t)n);
  if (e->profiling_) ++e->steps_;
}

void Executor::job_chunked(int ith, int nth) {
  const uint32_t g = step_gen_.load(std::memory_order_acquire);
  const int regime = note_preemptions(ith, nth);
  const double tsc_ns = tsc_per_ns();
  // A late thread's copy may be torn (the next step rewriting ctx_): it is
  // used only after a claim that op_state() proves was of a live step.
  StepCtx c = ctx_;
  c.scratch = ctx_.scratch + (int64_t)ith * ctx_.scratch_floats;
  const size_t n = slots_.size();
  const bool prof = profiling_ && ith == 0;
  PerThread& me = per_thread_[ith];
  PerThread::add(me.busy_steps, regime >= 1);
  PerThread::add(me.all_busy_steps, regime == 2);
  int32_t* counts = chunks_per_op_.data() + (size_t)ith * n;
  uint32_t stalled = 0;  // op kinds the test hook has met this step
  auto t0 = std::chrono::steady_clock::now();
  const auto timed = [&](size_t k) {  // thread 0's profile: op k ended now
    if (!prof) return;
    const auto t1 = std::chrono::steady_clock::now();
    op_ns_[k] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    t0 = t1;
  };
  const bool pairs = pairs_live_.load(std::memory_order_relaxed);  // (validated with each claim, as chunks_)
  const bool staged = stage_live_.load(std::memory_order_relaxed);  // (likewise)
  for (size_t k = 0; k < n; ++k) {
    const Slot& op = slots_[k];
    // The region: op k, or op k and k + 1 (Slot::pairs_next); its last op's
    // done word ends it (and proves claims live).
    const size_t last = op.pairs_next && pairs && k + 1 < n ? k + 1 : k;
    // The next op's params into cache while this one runs: the weights
    // streaming through every step evict them, and a kernel's first reads
    // of its struct (a matmul's ~750 bytes) would otherwise wait on memory.
    for (size_t j = k + 1; j <= last + 1 && j < n; ++j)
      for (int off = 0; off < slots_[j].bytes; off += 64) __builtin_prefetch((const char*)slots_[j].params + off, 0, 3);
    for (size_t j = k; j <= last; ++j) counts[j] = 0;
    // (test hook: `stalled` holds the kinds met so far this step, on every thread)
    const bool hook = stall_thread_ >= 0 && (stall_kinds_ >> op.kind & 1) && (stall_every_ || !(stalled >> op.kind & 1));
    const bool stall = hook && ith == stall_thread_;
    stalled |= hook ? 1u << op.kind : 0;
    if (staged && op.kind == OP_MATMUL) {
      if (!run_staged(k, g, ith, nth, c, me, stall ? 1 + stall_hold_ : hook && stall_hold_ ? 3 : 0)) return;
      timed(k);
      continue;
    }
    if (stall) {
      if (!wait_op(last, g, -1, nth, 0)) return;
      k = last;
      continue;
    }
    const int U = chunks_[k].load(std::memory_order_relaxed);
    int64_t mine = 0, longest = 0;
    c.first = 1;
    for (;;) {
      bool stolen = false;
      const int64_t u = claim(k, last, ith, nth, g, &stolen);
      if (u == -2) return;  // a late thread: that step is over
      if (u < 0) break;
      const uint64_t w0 = __rdtsc();
      for (size_t j = k; j <= last; ++j) slots_[j].fn(slots_[j].params, c, (int)u, U);
      const int64_t dt = (int64_t)(__rdtsc() - w0);
      PerThread::add(me.work, dt);
      longest = dt > longest ? dt : longest;
      PerThread::add(me.stolen, stolen);
      c.first = 0;
      ++mine;
    }
    for (size_t j = k; j <= last; ++j) counts[j] = (int32_t)mine;
    PerThread::add(me.chunks, mine);
    if (!(mine && report(last, g, mine)) && !wait_op(last, g, ith, nth, (int64_t)(longest / tsc_ns))) return;
    timed(last);
    k = last;
  }
  if (prof) ++steps_;
}

// Op k of a staged step (the top of this file): claim, run staged, commit,
// and report each chunk as it is committed (a holder's finished chunks must
// not wait for it to come back); then wait for the op's end, and once the
// spin budget is spent, run the chunks others still hold. false: step g is
// over (a late thread). stall (test hook): 1 sit the op out, 2 hold one
// chunk until the others have finished the op, then run it; 3 let the
// holder claim first.
bool Executor::run_staged(size_t k, uint32_t g, int ith, int nth, StepCtx& c, PerThread& me, int stall) {
  int32_t* count = chunks_per_op_.data() + (size_t)ith * slots_.size() + k;
  *count = 0;
  if (stall == 1) return wait_op(k, g, -1, nth, 0);
  const double tsc_ns = tsc_per_ns();
  c.stage = &stages_[ith];
  c.first = 1;
  int64_t mine = 0, longest = 0, held = -1;
  if (stall == 3) {
    // (test hook) the holder claims first, so that it holds a chunk of this
    // op on any machine (on one CPU it might otherwise arrive after the
    // others had claimed them all); at most 1 s
    const uint64_t want = (uint64_t)g << 32 | k;
    for (const int64_t end = now_ns() + 1'000'000'000; hold_mark_.load(std::memory_order_acquire) != want && now_ns() < end;)
      sched_yield();
  }
  const auto run = [&](int64_t u, bool backup) {
    const uint64_t w0 = __rdtsc();
    const bool won = run_chunk_staged(k, u, g, c);
    const int64_t dt = (int64_t)(__rdtsc() - w0);
    PerThread::add(me.work, dt);
    longest = dt > longest ? dt : longest;
    mine += won;
    PerThread::add(won ? me.chunks : me.discarded, 1);
    PerThread::add(me.backups, won && backup);
  };
  for (;;) {
    bool stolen = false;
    const int64_t u = claim(k, k, ith, nth, g, &stolen);
    if (u == -2) return c.stage = nullptr, false;
    if (u < 0) break;
    PerThread::add(me.stolen, stolen);
    if (stall == 2 && held < 0) {
      held = u;
      hold_mark_.store((uint64_t)g << 32 | k, std::memory_order_release);
      continue;
    }
    run(u, false);
  }
  int st = 0;
  if (held >= 0) {
    if (wait_op(k, g, -1, nth, 0)) run(held, false);  // the others have committed it: this copy loses
    *count = (int32_t)mine;
    return c.stage = nullptr, true;
  }
  const int64_t chunk_ns = (int64_t)(longest / tsc_ns);
  Spinner sp(spin_ns_for_chunks(chunk_ns));
  while (!(st = op_state(k, g)) && sp.spin()) {
  }
  // Past the budget: whatever is still uncommitted is held by a thread that
  // is not running (every chunk is claimed: claim found none).
  const int64_t U = chunks_[k].load(std::memory_order_relaxed);
  for (int64_t u = 0; u < U && !st; ++u) {
    if (commit_[k * kMaxChunks + u].load(std::memory_order_acquire) != g) run(u, true);
    st = op_state(k, g);
  }
  *count = (int32_t)mine;
  c.stage = nullptr;
  if (st) return st > 0;
  return wait_op(k, g, ith, nth, chunk_ns);
}

// Runs chunk u of op k into this thread's stage and commits it: true when
// this copy won (its writes are in memory and the chunk is reported done).
// A thread's first staged chunk of an op first copies the op's inputs (the
// only memory it reads that later ops rewrite) into its snapshot, and runs
// on the copy only if the op is still running after the copy: its inputs
// cannot have changed meanwhile (only ops after it rewrite them), so a
// thread the OS held back computes on true values or not at all (never on
// memory a later op has half rewritten). Its later chunks of the op reuse
// the copy.
bool Executor::run_chunk_staged(size_t k, int64_t u, uint32_t g, StepCtx& c) {
  Stage& st = *c.stage;
  st.n = 0, st.overflow = false;
  const int ith = (int)(&st - stages_.data());
  if (c.first && !take_snapshot(k, g, ith, c)) return false;  // the op is over: nothing to compute
  slots_[k].fn(&snap_ops_[ith], c, (int)u, chunks_[k].load(std::memory_order_relaxed));
  c.first = 0;
  if (!commit(k, u, g, st)) return false;
  report(k, g, 1);
  return true;
}

bool Executor::take_snapshot(size_t k, uint32_t g, int ith, const StepCtx& c) {
  MatmulOp& s = snap_ops_[ith];
  s = *(const MatmulOp*)slots_[k].params;
  uint8_t* p = (uint8_t*)(((uintptr_t)snap_mem_.data() + 63) & ~(uintptr_t)63) + (size_t)ith * snap_cap_;
  for (auto f : kSnapshotInputs) {
    Ref& r = s.*f;
    if (const int64_t n = snapshot_bytes(r, c)) {
      std::memcpy(p, r.data, (size_t)n);
      r.data = p;
      p += round64(n);
    }
  }
  return op_state(k, g) == 0;
}

// The one commit of chunk u of op k in step g: CAS its word from an older
// step to g, then write the stage. A word already at g (another copy won)
// or newer (step g is over: this is a late thread) loses.
bool Executor::commit(size_t k, int64_t u, uint32_t g, Stage& st) {
  std::atomic<uint32_t>& a = commit_[k * kMaxChunks + u];
  uint32_t w = a.load(std::memory_order_acquire);
  do {
    if (w == g || newer32(w, g)) return false;
  } while (!a.compare_exchange_weak(w, g, std::memory_order_acq_rel, std::memory_order_acquire));
  if (st.overflow) {  // stage_cap_ is sized for the largest staged chunk: never
    std::fprintf(stderr, "llamajet: internal error: a staged chunk outgrew its stage (op %zu)\n", k);
    std::abort();
  }
  for (int64_t i = 0; i < st.n; ++i) std::memcpy(st.e[i].dst, st.e[i].v, (size_t)st.e[i].n * sizeof(float));
  return true;
}

// A chunk of op k for thread ith: its own first (front), then the other
// threads' (back). -1: none left; -2: step g is over (a late thread), which
// op `last`'s done word (the region's end) tells after each claim.
int64_t Executor::claim(size_t k, size_t last, int ith, int nth, uint32_t g, bool* stolen) {
  const int64_t U = chunks_[k].load(std::memory_order_relaxed);
  const uint32_t g24 = g & kGenMask;
  for (int i = 0; i < nth; ++i) {
    const int s = (ith + i) % nth;
    std::atomic<uint64_t>& a = own_[(size_t)s * own_stride_ + k / 8].w[k % 8];
    uint64_t w = a.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t wg = (uint32_t)(w >> 40);
      if (wg != g24) {
        if (newer24(wg, g24)) return -2;
        const Range r = split(U, s, nth);  // first touch this step: thread s's share
        const uint64_t nw = pack_own(g24, r.b, r.e);
        if (a.compare_exchange_weak(w, nw, std::memory_order_acq_rel, std::memory_order_acquire)) w = nw;
        continue;
      }
      const int64_t b = (int64_t)((w >> 20) & kPosMask), e = (int64_t)(w & kPosMask);
      if (b >= e) break;
      const uint64_t nw = i == 0 ? pack_own(g24, b + 1, e) : pack_own(g24, b, e - 1);
      if (a.compare_exchange_weak(w, nw, std::memory_order_acq_rel, std::memory_order_acquire)) {
        if (op_state(last, g) != 0) return -2;
        *stolen = i != 0;
        return i == 0 ? b : e - 1;
      }
    }
  }
  return -1;
}

// Op k in step g: 1 complete, -1 step g is over (the word is a newer
// step's), 0 running (an older generation: no chunk of it finished in step g
// yet).
int Executor::op_state(size_t k, uint32_t g) const {
  const uint64_t d = done_[k / 8].w[k % 8].load(std::memory_order_acquire);
  const uint32_t dg = (uint32_t)(d >> 32);
  return dg == g ? ((d & kComplete) ? 1 : 0) : newer32(dg, g) ? -1 : 0;
}

// Adds n finished chunks of op k; true when that completed the op.
bool Executor::report(size_t k, uint32_t g, int64_t n) {
  std::atomic<uint64_t>& a = done_[k / 8].w[k % 8];
  const int64_t U = chunks_[k].load(std::memory_order_relaxed);
  uint64_t d = a.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t cnt = ((uint32_t)(d >> 32) == g ? (int64_t)(d & 0x7fffffff) : 0) + n;
    const uint64_t nd = (uint64_t)g << 32 | (cnt >= U ? kComplete : 0) | (uint64_t)cnt;
    if (a.compare_exchange_weak(d, nd, std::memory_order_acq_rel, std::memory_order_relaxed)) {
      if (cnt < U) return false;
      progress_.fetch_add(1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) progress_.notify_all();
      return true;
    }
  }
}

// Waits until op k of step g is complete: true, or false when step g is
// over (a late thread). First thread ith (>= 0) prefetches the start of its
// own chunks of the next op's weights into L2, in 1 KiB steps between
// looks: the memory stays busy while the last chunks finish, and the next
// op starts on lines already in L2. Then it spins for about two of its
// chunks of this op (chunk_ns: its longest; spin_ns_for_chunks), then sleeps
// on progress_.
// NOTE: progress_ is read before the done word, so a completion between the
// look and the sleep changes progress_ and wait() returns (no lost wake-up).
bool Executor::wait_op(size_t k, uint32_t g, int ith, int nth, int64_t chunk_ns) {
  const auto status = [&] { return op_state(k, g); };
  int st = status();
  if (st) return st > 0;
  if (ith >= 0 && k + 1 < slots_.size() && slots_[k + 1].stream) {
    const Slot& nx = slots_[k + 1];
    const int64_t U1 = chunks_[k + 1].load(std::memory_order_relaxed);
    const Range ur = split(U1, ith, nth);
    if (ur.b < ur.e) {
      Range first[2], last[2];  // (the q tiles under QKV: the first of its two ranges)
      tile_ranges(*(const MatmulOp*)nx.params, nx.tiles, (int)ur.b, (int)U1, first);
      tile_ranges(*(const MatmulOp*)nx.params, nx.tiles, (int)ur.e - 1, (int)U1, last);
      const int64_t tb = first[0].b, te = last[0].e;
      const int64_t bytes = (te - tb) * nx.tile_bytes < kWaitPrefetch ? (te - tb) * nx.tile_bytes : kWaitPrefetch;
      const char* p = (const char*)nx.stream + tb * nx.tile_bytes;
      for (int64_t off = 0; off < bytes && !(st = status());)
        for (const int64_t end = off + 1024 < bytes ? off + 1024 : bytes; off < end; off += 64)
          __builtin_prefetch(p + off, 0, 2);
      if (st) return st > 0;
    }
  }
  Spinner sp(spin_ns_for_chunks(chunk_ns));
  for (;;) {
    const uint32_t p = progress_.load(std::memory_order_seq_cst);
    if ((st = status())) return st > 0;
    if (!sp.spin()) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      progress_.wait(p, std::memory_order_seq_cst);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      sp.restart();
    }
  }
}

Executor::ThreadStats Executor::thread_stats() const {
  pool_->quiesce();
  ThreadStats s;
  for (const PerThread& t : per_thread_) {
    s.chunks.push_back(t.chunks.load(std::memory_order_relaxed));
    s.stolen.push_back(t.stolen.load(std::memory_order_relaxed));
    s.work_cycles.push_back(t.work.load(std::memory_order_relaxed));
    s.busy_steps.push_back(t.busy_steps.load(std::memory_order_relaxed));
    s.all_busy_steps.push_back(t.all_busy_steps.load(std::memory_order_relaxed));
    s.backups.push_back(t.backups.load(std::memory_order_relaxed));
    s.discarded.push_back(t.discarded.load(std::memory_order_relaxed));
  }
  s.staged_steps = staged_steps_.load(std::memory_order_relaxed);
  s.steps = stat_steps_.load(std::memory_order_relaxed);
  s.wall_cycles = wall_cycles_.load(std::memory_order_relaxed);
  s.sleeps = sleeps_.load(std::memory_order_relaxed);
  s.chunks_per_op = chunks_per_op_;
  return s;
}

std::pair<int64_t, int64_t> Executor::idle_counters() const {
  int64_t work = 0;
  for (const PerThread& t : per_thread_) work += t.work.load(std::memory_order_relaxed);
  return {work, wall_cycles_.load(std::memory_order_relaxed) * cfg_.n_threads};
}

void Executor::reset_thread_stats() {
  pool_->quiesce();
  for (PerThread& t : per_thread_)
    for (auto* a : {&t.chunks, &t.stolen, &t.work, &t.busy_steps, &t.all_busy_steps, &t.backups, &t.discarded})
      a->store(0, std::memory_order_relaxed);
  staged_steps_.store(0, std::memory_order_relaxed);
  wall_cycles_.store(0, std::memory_order_relaxed);
  stat_steps_.store(0, std::memory_order_relaxed);
  sleeps_.store(0, std::memory_order_relaxed);
}

}  // namespace lj
