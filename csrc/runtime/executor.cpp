// executor.cpp — see executor.h.
#include "executor.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "cpu_features.h"

namespace lj {

const KernelTable* kernel_table(const std::string& isa) {
  bool ok = false;
  for (const auto& s : supported_isas()) ok = ok || s == isa;
  if (!ok) throw std::invalid_argument("ISA '" + isa + "' is not supported by this CPU/OS");
  if (isa == "amx") return kernels_amx();
  if (isa == "avx512") return kernels_avx512();
  if (isa == "avx2") return kernels_avx2();
  return kernels_ref();
}

Executor::Executor(const ExecConfig& cfg) : cfg_(cfg), table_(kernel_table(cfg.isa)) {
  if (cfg_.n_threads < 1 || cfg_.max_tokens < 1 || cfg_.max_out < 0 ||
      cfg_.max_out > cfg_.max_tokens || cfg_.max_seqs < 1 || cfg_.max_blocks < 1 ||
      cfg_.scratch_floats < 0 || cfg_.kv_slots < 0 || cfg_.max_pos < 0 || cfg_.block_size < 1 ||
      cfg_.kv_slots % cfg_.block_size != 0)
    throw std::invalid_argument("Executor: bad configuration");
  pool_ = std::make_unique<ThreadPool>(cfg_.n_threads);
  tokens_.assign(cfg_.max_tokens, 0);
  positions_.assign(cfg_.max_tokens, 0);
  slots_.assign(cfg_.max_tokens, 0);
  seq_of_token_.assign(cfg_.max_tokens, 0);
  out_rows_.assign(cfg_.max_out + 1, 0);
  block_tables_.assign((size_t)cfg_.max_seqs * cfg_.max_blocks, 0);
  scratch_.assign((size_t)cfg_.n_threads * (cfg_.scratch_floats + 16), 0.f);
  ctx_.scratch = scratch_.data();
  ctx_.scratch_floats = cfg_.scratch_floats + 16;
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

namespace {

const char* kOpNames[OP_COUNT] = {"embed", "rmsnorm", "matmul", "rope", "kv_write",
                                  "attention", "swiglu", "add", "gather", "add_rmsnorm", "quantize",
                                  "argmax"};

// Matmul epilogues / prologues (kernels/matmul.inc).
constexpr int EPI_STORE = 0, EPI_RESIDUAL = 1, EPI_SWIGLU = 2, EPI_QKV = 3;
constexpr int PRO_NONE = 0, PRO_PREQUANT = 1, PRO_RMSNORM = 2;

// Overflow-checked size arithmetic: a size that does not fit is bad input.
int64_t cmul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw std::invalid_argument("add_op: size overflows");
  return r;
}
int64_t cadd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw std::invalid_argument("add_op: size overflows");
  return r;
}

// Sizes an op needs to be > 0 (i[] indices), and other shape rules.
void check_shape(const Op& op) {
  static const int need[OP_COUNT][4] = {
      {0, -1, -1, -1}, {0, -1, -1, -1}, {0, 1, -1, -1}, {0, 1, 3, -1}, {0, -1, -1, -1},
      {0, 1, 2, 3},    {0, -1, -1, -1}, {0, -1, -1, -1}, {0, -1, -1, -1}, {0, -1, -1, -1},
      {0, 1, -1, -1},  {0, -1, -1, -1}};
  for (int k : need[op.kind])
    if (k >= 0 && op.i[k] <= 0)
      throw std::invalid_argument(std::string(kOpNames[op.kind]) + ": size " + std::to_string(k) + " must be > 0");
  if (op.kind == OP_ROPE && (op.i[1] % 2 != 0 || op.i[3] < cmul(op.i[0], op.i[1])))
    throw std::invalid_argument("rope: head_dim must be even and the row stride >= heads * head_dim");
}

// Bytes of M rows of n values quantized in groups of G (kpad = n rounded up
// to G): int8 codes padded to 64 bytes, then per group an fp32 scale and an
// int32 sum (kernels/matmul.inc qact_layout / qact_bytes).
int64_t qact_extent(int64_t M, int64_t n, int64_t G) {
  const int64_t kpad = cmul((n + G - 1) / G, G);
  return cadd(cadd(cmul(M, kpad), 63) / 64 * 64, cmul(cmul(8, M), kpad / G));
}

// Bytes each operand is read/written at most, for the largest step.
// Order: x, x2, w, w2, out, out2.
void operand_extents(const Op& op, const ExecConfig& c, int64_t ext[OP_OPERANDS]) {
  for (int i = 0; i < OP_OPERANDS; ++i) ext[i] = 0;
  const int64_t T = c.max_tokens;
  const int64_t M = op.rows == ROWS_TOKENS ? T : op.rows == ROWS_OUT ? c.max_out : op.rows;
  const int64_t f = sizeof(float);
  switch (op.kind) {
    case OP_EMBED:
      ext[2] = is_packed(op.wtype) ? packed_bytes(op.wtype, op.i[1], op.i[0], op.i[2]) : row_bytes(op.wtype, op.i[0]);
      ext[4] = cmul(cmul(T, op.i[0]), f);
      break;
    case OP_RMSNORM: ext[0] = ext[4] = cmul(cmul(M, op.i[0]), f); ext[2] = cmul(op.i[0], f); break;
    case OP_MATMUL: {
      const int64_t N = op.i[0], K = op.i[1], epi = op.i[4], pro = op.i[5];
      const int64_t cols = epi == EPI_SWIGLU ? N / 2 : epi == EPI_QKV ? op.i[6] : N;
      ext[0] = pro == PRO_PREQUANT ? 0 : cmul(cmul(M, K), f);
      ext[4] = cmul(cmul(M, cols), f);
      ext[2] = is_packed(op.wtype) ? packed_bytes(op.wtype, N, K, op.i[2]) : cmul(N, row_bytes(op.wtype, K));
      if (pro == PRO_PREQUANT) ext[6] = qact_extent(M, K, op.i[2]);
      if (pro == PRO_RMSNORM) ext[6] = cmul(K, f);
      if (epi == EPI_RESIDUAL) ext[7] = ext[4];
      if (epi == EPI_QKV) {
        ext[1] = ext[3] = cmul(cmul(c.max_pos, op.i[8] / 2), f);  // sin, cos tables
        ext[5] = ext[7] = cmul(cmul(M, op.i[7]), f);              // k_rot, v rows
      }
      break;
    }
    case OP_QUANTIZE:
      ext[0] = cmul(cmul(M, op.i[0]), f);
      ext[6] = qact_extent(M, op.i[0], op.i[1]);
      break;
    case OP_ADD_RMSNORM: {
      const int64_t n = op.i[0], G = op.i[1];
      ext[0] = ext[4] = ext[1] = ext[5] = cmul(cmul(M, n), f);
      ext[2] = cmul(n, f);
      if (G > 0) ext[6] = qact_extent(M, n, G);
      break;
    }
    case OP_ROPE:
      ext[0] = ext[4] = cadd(cmul(cmul(T - 1, op.i[3]), f), cmul(cmul(op.i[0], op.i[1]), f));
      ext[2] = ext[3] = cmul(cmul(c.max_pos, op.i[1] / 2), f);
      break;
    case OP_KV_WRITE: {  // pools: kv_slots rows in KV storage type wtype (kernels/attention.inc)
      const int64_t kvh = op.i[1] > 0 ? op.i[1] : 1;
      ext[0] = ext[1] = cmul(cmul(T, op.i[0]), f);
      ext[4] = ext[5] = cmul(c.kv_slots, op.wtype == KV_I8 ? cmul(kvh, op.i[0] / kvh + 4)
                                                           : row_bytes(op.wtype, op.i[0]));
      break;
    }
    case OP_ATTENTION: {
      const int64_t n = cmul(op.i[0], op.i[2]), G = op.i[4];
      ext[0] = ext[4] = cmul(cmul(T, n), f);
      ext[2] = ext[3] = cmul(c.kv_slots, op.wtype == KV_I8 ? cmul(op.i[1], op.i[2] + 4)
                                                           : row_bytes(op.wtype, cmul(op.i[1], op.i[2])));
      if (G > 0) ext[6] = qact_extent(T, n, G);  // int8 copy (G | head_dim)
      break;
    }
    case OP_SWIGLU: case OP_ADD: ext[0] = ext[1] = ext[4] = cmul(cmul(M, op.i[0]), f); break;
    case OP_GATHER: ext[0] = cmul(cmul(T, op.i[0]), f); ext[4] = cmul(cmul(c.max_out, op.i[0]), f); break;
    case OP_ARGMAX: ext[0] = cmul(cmul(M, op.i[0]), f); ext[4] = cmul(M, 4); break;  // out: M int32
  }
}

// Per-thread scratch (floats) an op's kernel uses for the largest step; the
// executor grows its scratch to the largest need at add_op (never in a step).
int64_t op_scratch_floats(const Op& op, const ExecConfig& c) {
  const int64_t M = op.rows == ROWS_TOKENS ? c.max_tokens : op.rows == ROWS_OUT ? c.max_out : op.rows;
  switch (op.kind) {
    case OP_MATMUL: {
      const int64_t K = op.i[1], keep = cmul(M, TILE), pro = op.i[5];
      const int64_t rows = pro == PRO_RMSNORM ? cmul(M, K) : 0;
      if (!is_packed(op.wtype)) return cadd(cadd(cmul(TILE, K), keep), rows) + 64;
      const int64_t G = op.i[2];
      if (op.i[3]) return cadd(cadd(cadd(cmul(TILE, G), keep), keep), rows) + 64;  // + row accumulators [M][16]
      // keep, one normalized row, the interleaved codes [M, kpad], then (not
      // PREQUANT) the quantized rows (kernels/matmul.inc k_qmatmul_a8)
      const int64_t kpad = cmul((K + G - 1) / G, G);
      const int64_t inter = cadd(cmul(M, kpad) / 4 + 16, cmul(2 * M, kpad / G)) + 32;  // + scalars [M][ng][2]
      const int64_t qbytes = pro == PRO_PREQUANT ? 0 : qact_extent(M, K, G) + 64;
      // the amx tier: one tile's int4 codes as bytes [16][kpad] + two int32 tiles, 64-byte aligned
      const int64_t amx = cmul(TILE, kpad) / 4 + 512 + 16;
      return cadd(cadd(cadd(cadd(keep, K + 16), inter), qbytes / 4 + 1), amx) + 64;
    }
    case OP_ATTENTION: {  // kernels/attention_tiled.inc att_item: block pointers, scores, conversions
      const int64_t hd = op.i[2], bs = op.i[3], bsp = (bs + 15) / 16 * 16;
      const int64_t nblk = c.max_blocks, keys = cmul(nblk, bs);
      const int64_t scores = cmul(4, keys + 32);  // ATT_RB rows of ldS (<= keys + 2W)
      // converted K^T blocks + V rows (not for an fp32 pool with bs % W == 0; sized for the widest W)
      const int64_t conv = cadd(cmul(cmul(nblk, hd), bsp), cmul(keys, hd)) + hd;
      return cadd(cadd(cmul(6, nblk), scores), conv) + 64;  // 3 pointers per block
    }
    case OP_ADD_RMSNORM: return op.i[0] + 64;
    default: return 0;
  }
}

}  // namespace

void Executor::add_op(Op op, const Operand opnd[OP_OPERANDS]) {
  if (op.kind < 0 || op.kind >= OP_COUNT) throw std::invalid_argument("add_op: unknown op kind");
  for (int k = 0; k < OP_INTS; ++k)
    if (op.i[k] < 0) throw std::invalid_argument(std::string(kOpNames[op.kind]) + ": negative size");
  if (op.rows < ROWS_OUT || op.rows > cfg_.max_tokens) throw std::invalid_argument("add_op: bad row count");
  check_shape(op);
  if (op.kind == OP_MATMUL || op.kind == OP_EMBED) {
    const int64_t k = op.kind == OP_MATMUL ? op.i[1] : op.i[0];
    if (op.wtype < F32 || op.wtype > PK_I8) throw std::invalid_argument("add_op: unknown weight type");
    if (is_packed(op.wtype)) {
      // packed: i[2] = group (multiple of 8 for int4 / 4 for int8 chunks)
      const int64_t G = op.i[2];
      if (G <= 0 || G % 8 != 0 || G > (int64_t)1 << 20) throw std::invalid_argument("add_op: packed group must be a positive multiple of 8");
      if (op.kind == OP_EMBED && op.i[1] <= 0) throw std::invalid_argument("embed: packed table needs its row count");
    } else if (op.wtype >= Q8_0 && k % QK != 0) {
      throw std::invalid_argument("add_op: quantized rows need K % 32 == 0");
    }
  }
  if (op.kind == OP_MATMUL) {
    const int64_t N = op.i[0], epi = op.i[4], pro = op.i[5];
    if (epi < EPI_STORE || epi > EPI_QKV || pro < PRO_NONE || pro > PRO_RMSNORM)
      throw std::invalid_argument("matmul: unknown epilogue or prologue");
    if (pro == PRO_PREQUANT && (!is_packed(op.wtype) || op.i[3]))
      throw std::invalid_argument("matmul: pre-quantized input needs packed weights with int8 activations");
    if (epi == EPI_SWIGLU && (N % (2 * TILE) != 0))
      throw std::invalid_argument("matmul: swiglu epilogue needs alternating 16-row gate/up tiles (N % 32 == 0)");
    if (epi == EPI_QKV) {
      const int64_t nq = op.i[6], nk = op.i[7], hd = op.i[8];
      if (nq <= 0 || nk <= 0 || hd <= 0 || hd % 2 || nq % TILE || nk % TILE || nq % hd || nk % hd ||
          cadd(nq, cmul(2, nk)) != N)
        throw std::invalid_argument("matmul: qkv epilogue needs N = q + 2 kv columns, 16-aligned, whole heads");
    }
  }
  if (op.kind == OP_KV_WRITE || op.kind == OP_ATTENTION) {  // KV storage types
    if (op.wtype != F32 && op.wtype != F16 && op.wtype != BF16 && op.wtype != KV_I8)
      throw std::invalid_argument(std::string(kOpNames[op.kind]) + ": unknown KV storage type");
    if (op.kind == OP_KV_WRITE && op.wtype == KV_I8 && (op.i[1] < 1 || op.i[0] % op.i[1] != 0))
      throw std::invalid_argument("kv_write: int8 KV needs kv_heads > 0 dividing kv_dim");
    if (op.kind == OP_KV_WRITE) {
      if (op.i[1] > 0 && op.i[0] % op.i[1] != 0) throw std::invalid_argument("kv_write: kv_heads must divide kv_dim");
      op.i[2] = cfg_.block_size;  // the K pool's K^T block geometry (kernels/attention.inc)
    }
  }
  if (op.kind == OP_ATTENTION) {
    if (op.i[1] == 0 || op.i[0] % op.i[1] != 0 || op.i[3] == 0)
      throw std::invalid_argument("attention: heads must be a multiple of kv_heads; block_size > 0");
    if (op.i[3] != cfg_.block_size) throw std::invalid_argument("attention: block size differs from the pool's");
    const int64_t group = op.i[0] / op.i[1];
    if (group > 64) throw std::invalid_argument("attention: more than 64 query heads per kv head");
    if (op.i[3] > 256) throw std::invalid_argument("attention: block size above 256");
    if (op.i[4] && (op.i[4] % 8 != 0 || op.i[2] % op.i[4] != 0))
      throw std::invalid_argument("attention: quantize-on-write group must be a multiple of 8 dividing head_dim");
  }
  if (op.kind == OP_ADD_RMSNORM && op.i[1] % 8 != 0)
    throw std::invalid_argument("add_rmsnorm: quantize-on-write group must be a multiple of 8");
  if (op.kind == OP_QUANTIZE && (op.i[1] % 8 != 0 || op.i[1] > (int64_t)1 << 20))
    throw std::invalid_argument("quantize: group must be a positive multiple of 8");
  int64_t ext[OP_OPERANDS];
  operand_extents(op, cfg_, ext);
  void* ptrs[OP_OPERANDS];
  for (int k = 0; k < OP_OPERANDS; ++k) {
    const Operand& o = opnd[k];
    // add_rmsnorm's residual (x2 / out2), h (out) and int8 copy (e0) are optional
    // (and attention's int8 copy, e0)
    const bool optional = (op.kind == OP_ADD_RMSNORM && (k == 1 || k == 4 || k == 5 || k == 6)) ||
                          (op.kind == OP_ATTENTION && k == 6);
    if (optional && o.buffer < 0 && o.ptr == nullptr) {
      ptrs[k] = nullptr;
      continue;
    }
    if (o.buffer >= 0) {
      if (o.buffer >= (int)buffers_.size()) throw std::invalid_argument("add_op: no such buffer");
      if (o.offset < 0 || o.offset % 4 != 0 || cadd(o.offset, ext[k]) > buffers_[o.buffer].size)
        throw std::invalid_argument(std::string(kOpNames[op.kind]) + ": operand " + std::to_string(k) +
                                    " out of its buffer");
      ptrs[k] = buffers_[o.buffer].data.get() + o.offset;
    } else {
      if (ext[k] > 0 && (o.ptr == nullptr || o.nbytes < ext[k]))
        throw std::invalid_argument(std::string(kOpNames[op.kind]) + ": operand " + std::to_string(k) +
                                    " missing or too small (" + std::to_string(o.nbytes) + " < " +
                                    std::to_string(ext[k]) + " bytes)");
      ptrs[k] = const_cast<void*>(o.ptr);
    }
  }
  if (op.kind == OP_EMBED) {  // table rows, for the token-id check in run()
    const int64_t avail = opnd[2].buffer >= 0 ? buffers_[opnd[2].buffer].size - opnd[2].offset : opnd[2].nbytes;
    op.i[OP_INTS - 1] = is_packed(op.wtype) ? op.i[1] : avail / row_bytes(op.wtype, op.i[0]);
  }
  op.x = (float*)ptrs[0];
  op.x2 = (const float*)ptrs[1];
  op.w = ptrs[2];
  op.w2 = ptrs[3];
  op.out = (float*)ptrs[4];
  op.out2 = (float*)ptrs[5];
  op.e0 = ptrs[6];
  op.e1 = ptrs[7];
  if (op.kind == OP_ADD_RMSNORM && ((ptrs[1] == nullptr) != (ptrs[5] == nullptr) ||
                                    (ptrs[6] == nullptr) != (op.i[1] == 0)))
    throw std::invalid_argument("add_rmsnorm: x2 needs out2 (the residual), e0 needs a group and vice versa");
  if (op.kind == OP_ATTENTION && (ptrs[6] == nullptr) != (op.i[4] == 0))
    throw std::invalid_argument("attention: e0 (the int8 copy) needs a group and vice versa");
  // Scratch is sized from the Program, here, never inside a step.
  const int64_t need = op_scratch_floats(op, cfg_);
  if (need > cfg_.scratch_floats) {
    cfg_.scratch_floats = need;
    scratch_.assign((size_t)cfg_.n_threads * (need + 16), 0.f);
    ctx_.scratch = scratch_.data();
    ctx_.scratch_floats = need + 16;
    ++allocations_;
  }
  ops_.push_back(op);
}

void Executor::run(int n_tokens, const int32_t* tokens, const int32_t* positions, const int32_t* slots,
                   const int32_t* seq_of_token, int n_seqs, const int32_t* block_tables, int max_blocks,
                   int n_out, const int32_t* out_rows) {
  // Validate everything a kernel will index with, before any kernel runs.
  if (n_tokens < 1 || n_tokens > cfg_.max_tokens) throw std::invalid_argument("run: bad token count");
  if (n_seqs < 1 || n_seqs > cfg_.max_seqs) throw std::invalid_argument("run: bad sequence count");
  if (max_blocks < 1 || max_blocks > cfg_.max_blocks) throw std::invalid_argument("run: bad block-table width");
  if (n_out < 0 || n_out > n_tokens || n_out > cfg_.max_out) throw std::invalid_argument("run: bad output row count");
  int64_t vocab_rows = -1;
  for (const Op& op : ops_)  // the smallest table bounds every token id
    if (op.kind == OP_EMBED && (vocab_rows < 0 || op.i[OP_INTS - 1] < vocab_rows)) vocab_rows = op.i[OP_INTS - 1];
  // Attention reads block_tables[s][j / block_size] for j <= position.
  const int64_t ctx_limit = (int64_t)max_blocks * cfg_.block_size;
  const int64_t n_blocks = cfg_.kv_slots / cfg_.block_size;
  for (int t = 0; t < n_tokens; ++t) {
    if (vocab_rows >= 0 && (tokens[t] < 0 || tokens[t] >= vocab_rows))
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
  std::memcpy(slots_.data(), slots, n_tokens * sizeof(int32_t));
  std::memcpy(seq_of_token_.data(), seq_of_token, n_tokens * sizeof(int32_t));
  std::memcpy(out_rows_.data(), out_rows, n_out * sizeof(int32_t));
  std::memcpy(block_tables_.data(), block_tables, (size_t)n_seqs * max_blocks * sizeof(int32_t));
  ctx_.n_tokens = n_tokens;
  ctx_.n_out = n_out;
  ctx_.n_seqs = n_seqs;
  ctx_.max_blocks = max_blocks;
  ctx_.tokens = tokens_.data();
  ctx_.positions = positions_.data();
  ctx_.slots = slots_.data();
  ctx_.seq_of_token = seq_of_token_.data();
  ctx_.block_tables = block_tables_.data();
  ctx_.out_rows = out_rows_.data();
  pool_->run(&Executor::job, this);
}

void Executor::job(void* self, int ith, int nth) {
  Executor* e = (Executor*)self;
  const KernelFn* fn = e->table_->fn;
  const size_t n = e->ops_.size();
  const bool prof = e->profiling_ && ith == 0;
  auto t0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < n; ++k) {
    const Op& op = e->ops_[k];
    fn[op.kind](op, e->ctx_, ith, nth);
    if (k + 1 < n || e->profiling_) e->pool_->barrier();  // all threads see profiling_
    if (prof) {
      const auto t1 = std::chrono::steady_clock::now();
      e->op_ns_[k] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
      t0 = t1;
    }
  }
  if (prof) ++e->steps_;
}

}  // namespace lj
