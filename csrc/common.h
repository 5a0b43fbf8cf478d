// common.h — plain-data types shared by the runtime and every kernel tier:
// storage types, tensor operands (Ref), the per-step context, size rules.
//
// The executor runs a Program: a list of typed ops (one params struct per op
// family, kernels/ops.h) over memory it is handed. Python builds the Program
// once per runner; every step only refreshes the small StepCtx (token ids,
// positions, KV slots) and runs it.
//
// Every code here (DType, OpKind, the epilogues) is defined once, in C++, and
// exported to Python by bindings.cpp; Python never re-declares one.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lj {

// NOTE: helpers in this header are `static inline`: each ISA translation unit
// keeps its own copy, so the linker can never hand the baseline code a copy
// compiled with AVX-512 flags. For the same reason kernel code never
// constructs a Ref or a params struct (their implicit constructors are
// inline): kernels only read the ones the executor built.

// Storage types of weights, activations and the KV cache.
enum DType : int32_t {
  F32 = 0,
  F16 = 1,
  BF16 = 2,
  Q8_0 = 3,  // GGML block: fp16 d, 32 x int8;        w = d * q
  Q4_0 = 4,  // GGML block: fp16 d, 16 B nibbles;      w = d * (q - 8)
  Q4_1 = 5,  // GGML block: fp16 d, fp16 m, 16 B;      w = d * q + m
  // Packed, tile-interleaved formats (src/llamajet/formats/packed.py has the
  // layout): tiles of 16 rows, groups of G along K, per tile and group
  // codes | d[16] fp16 | m[16] fp16 (asymmetric only).
  PK_I4S = 6,  // int4 symmetric:  w = d * (c - 8)
  PK_I4A = 7,  // int4 asymmetric: w = d * c + m
  PK_I8 = 8,   // int8 symmetric:  w = d * c (c signed)
  I32 = 9,     // int32 values (greedy token ids)
  // Activation rows quantized for a W*A8 matmul, in groups of G (qact_bytes):
  // int8 codes [rows, kpad] padded to 64 bytes, then per group an fp32 scale
  // [rows, ng] and an int32 code sum [rows, ng].
  Q8_ACT = 10,
  // Packed twins of more GGUF block types, same tiles (layout: formats/packed.py).
  // Codes of 5 or 6 bits: the low 4 as in PK_I4*, the rest in a bit plane
  // after them. K-quants: S groups share a super-block tail of scales.
  PK_I5S = 11,  // Q5_0: groups of 32, w = d * (c - 16)                       c in 0..31
  PK_I5A = 12,  // Q5_1: groups of 32, w = d * c + m
  PK_Q4K = 13,  // Q4_K: 8 groups of 32 per super-block, w = (D * sc) * c - (DM * mn)  c in 0..15
  PK_Q5K = 14,  // Q5_K: as PK_Q4K, c in 0..31
  PK_Q6K = 15,  // Q6_K: 16 groups of 16 per super-block, w = (D * sc) * (c - 32)  c in 0..63, sc int8
  KV_I8 = 16,  // KV cache only: per (slot, kv head) fp32 scale then head_dim int8; x = scale * q
  // Q8_ACT's layout, but one scale per QK_K = 256 values (llama.cpp's Q8_K
  // rule), written into each of the span's groups (sums stay per group): the
  // input of the K-quant weights (PK_Q4K, PK_Q5K, PK_Q6K), whose kernels then
  // sum a whole super-block in integers (matmul_a8.inc, tile_a8).
  Q8_ACTK = 17,
  DTYPE_MAX = 17
};

constexpr int64_t TILE = 16;  // rows per packed tile
constexpr int64_t QK = 32;    // elements per GGML quant block
constexpr int64_t QK_K = 256; // elements per K-quant super-block (and per Q8_ACTK scale)

static inline bool is_qact(int32_t t) { return t == Q8_ACT || t == Q8_ACTK; }
// Values sharing one scale in a quantized activation row of groups of g.
static inline int64_t qact_span(int32_t t, int64_t g) { return t == Q8_ACTK ? QK_K : g; }

static inline bool is_ggml_block(int32_t t) { return t == Q8_0 || t == Q4_0 || t == Q4_1; }
static inline bool is_kv_dtype(int32_t t) { return t == F32 || t == F16 || t == BF16 || t == KV_I8; }

// Bytes of one GGML block of 32 elements (0: not a block type).
static inline int64_t ggml_block_bytes(int32_t t) { return t == Q8_0 ? 34 : t == Q4_0 ? 18 : t == Q4_1 ? 20 : 0; }

// Packed formats. A (tile, super-block) block holds S groups' codes, then a
// tail of scales: S = 1 (a tail per group) except for the K-quants.
//   codes of a group, 16 rows x g: b = 4: g/8 chunks of 64 bytes (nibbles);
//   b = 5, 6: the same, then the high bits in g/32 (b = 5) or g/16 (b = 6)
//   64-byte planes; b = 8: g/4 chunks of 64 signed bytes.
//   tail: d[16] fp16 (and m[16] fp16: PK_I4A, PK_I5A);
//     PK_Q4K, PK_Q5K: D[16], DM[16] fp16, sc[8][16] u8, mn[8][16] u8;
//     PK_Q6K: D[16] fp16, sc[16][16] int8.
//
// The packed kinds' traits, a row each (ggml's type_traits_cpu is the
// model): everything the engine knows of a kind apart from how its scale
// tail is read (the kernels' group_scales, packed_scalar.h) and written
// (runtime/repack.cpp). The kernels' dispatch is made from this list.
//   bits   code bits
//   super  groups per (tile, super-block) block (S; > 1: a K-quant)
//   group  the group length it is made for (the GGUF block's), 0 = any multiple of 8
//   tail   bytes of a block's scale tail
//   asym   w = d * c + m (m per row and group), else w = d * (c - bias)
//   bias   the codes' offset (symmetric kinds)
//   act    the activation type its W*A8 kernels read: the K-quants sum a
//          super-block in integers, so their input rows share one scale per 256
#define LJ_PACKED_KINDS(X)                                          \
  /* kind    bits super group tail                    asym  bias act */ \
  X(PK_I4S,  4,   1,    0,    2 * TILE,               false, 8,  Q8_ACT)  \
  X(PK_I4A,  4,   1,    0,    4 * TILE,               true,  0,  Q8_ACT)  \
  X(PK_I8,   8,   1,    0,    2 * TILE,               false, 0,  Q8_ACT)  \
  X(PK_I5S,  5,   1,    32,   2 * TILE,               false, 16, Q8_ACT)  \
  X(PK_I5A,  5,   1,    32,   4 * TILE,               true,  0,  Q8_ACT)  \
  X(PK_Q4K,  4,   8,    32,   4 * TILE + 2 * 8 * TILE, true,  0,  Q8_ACTK) \
  X(PK_Q5K,  5,   8,    32,   4 * TILE + 2 * 8 * TILE, true,  0,  Q8_ACTK) \
  X(PK_Q6K,  6,   16,   16,   2 * TILE + 16 * TILE,   false, 32, Q8_ACTK)

struct PackedTraits {
  int bits;  // 0: not a packed kind
  int64_t super, group, tail;
  bool asym;
  int bias;
  int32_t act;
};
constexpr PackedTraits packed_traits(int32_t t) {
  switch (t) {
#define LJ_PACKED_ROW(K, bits, super, group, tail, asym, bias, act) \
  case K: return {bits, super, group, tail, asym, bias, act};
    LJ_PACKED_KINDS(LJ_PACKED_ROW)
#undef LJ_PACKED_ROW
    default: return {0, 0, 0, 0, false, 0, 0};
  }
}
static inline bool is_packed(int32_t t) { return packed_traits(t).bits != 0; }
static inline int packed_code_bits(int32_t t) { return packed_traits(t).bits; }
static inline int64_t packed_super(int32_t t) { return packed_traits(t).super; }
static inline int64_t packed_fixed_group(int32_t t) { return packed_traits(t).group; }
static inline int64_t packed_group_code_bytes(int32_t t, int64_t g) { return TILE * g * packed_code_bits(t) / 8; }
static inline int64_t packed_tail_bytes(int32_t t) { return packed_traits(t).tail; }
static inline int32_t packed_act_dtype(int32_t t) { return packed_traits(t).act; }
// Types a weight (matmul / embedding table) may be stored in.
static inline bool is_weight_dtype(int32_t t) { return t == F32 || t == F16 || t == BF16 || is_ggml_block(t) || is_packed(t); }

// Bytes of one (tile, super-block) block of a packed format with group length g.
static inline int64_t packed_block_bytes(int32_t t, int64_t g) {
  return packed_super(t) * packed_group_code_bytes(t, g) + packed_tail_bytes(t);
}

// Bytes of one 16-row tile of a packed matrix with rows of k elements.
static inline int64_t packed_tile_bytes(int32_t t, int64_t k, int64_t g) {
  const int64_t groups = (k + g - 1) / g, s = packed_super(t);
  return (groups + s - 1) / s * packed_block_bytes(t, g);
}

// Bytes of a packed [n, k] matrix with group g (n, k padded up).
static inline int64_t packed_bytes(int32_t t, int64_t n, int64_t k, int64_t g) {
  return (n + TILE - 1) / TILE * packed_tile_bytes(t, k, g);
}

// Bytes used by one row of k elements of a row-major type t (block types need
// k % 32 == 0; the executor checks before any kernel sees one).
static inline int64_t row_bytes(int32_t t, int64_t k) {
  switch (t) {
    case F32: case I32: return 4 * k;
    case F16: case BF16: return 2 * k;
    case Q8_0: case Q4_0: case Q4_1: return (k / QK) * ggml_block_bytes(t);
    default: return -1;
  }
}

// Bytes of M rows of n values quantized in groups of G (kpad = n rounded up
// to G): int8 codes padded to 64 bytes, then per group an fp32 scale and an
// int32 sum (kernels/matmul_packed.inc qact_layout).
static inline int64_t qact_bytes(int64_t M, int64_t kpad, int64_t ng) { return ((M * kpad + 63) / 64) * 64 + 8 * M * ng; }

// Bytes of one KV row: kv_heads heads of hd values in KV storage type t
// (KV_I8: per head an fp32 scale, then hd codes).
static inline int64_t kv_row_bytes(int32_t t, int64_t kv_heads, int64_t hd) {
  return t == KV_I8 ? kv_heads * (hd + 4) : row_bytes(t, kv_heads * hd);
}

// Row counts that depend on the step are written as these negative codes in
// a Ref's rows and resolved per run.
constexpr int64_t ROWS_TOKENS = -1;  // tokens in this step
constexpr int64_t ROWS_OUT = -2;     // rows whose logits are wanted

// A tensor operand of an op: where its memory is and what it holds. Python
// fills the location (an executor buffer and byte offset, or an external array
// such as a weight it keeps alive) and the shape; the executor checks that the
// memory holds tensor_bytes(dtype, rows, cols, group) for the largest step and
// resolves `data` once, when the op is added. Absent (optional operands):
// buffer < 0 and ptr null; then data stays null.
struct Ref {
  void* data = nullptr;       // resolved by the executor; what kernels read
  int64_t rows = 0;           // leading dimension: a count, or ROWS_TOKENS / ROWS_OUT
  int64_t cols = 0;           // elements per row (KV pools: kv_heads * head_dim)
  int64_t group = 0;          // packed, Q8_ACT: elements per scale group; KV pools: head_dim
  int32_t dtype = F32;        // storage type (DType)
  int32_t buffer = -1;        // executor buffer id; -1: external memory (ptr), or absent
  int64_t offset = 0;         // bytes into the buffer (a multiple of 4)
  const void* ptr = nullptr;  // external memory
  int64_t nbytes = 0;         // bytes at ptr
};
// 64 bytes, what kernels read first: one cache line per operand.
static_assert(sizeof(Ref) == 64, "Ref is one cache line");

static inline bool present(const Ref& r) { return r.buffer >= 0 || r.ptr != nullptr; }

// Bytes a tensor of this type and shape occupies; -1 when the shape is not
// valid for the type (a block type whose cols are no whole blocks, a packed
// type without a group) or the size does not fit in int64 (computed in 128
// bits, so a hostile shape cannot wrap around to a small size). Python plans
// its arena with the same function (exported).
static inline int64_t tensor_bytes(int32_t t, int64_t rows, int64_t cols, int64_t group) {
  if (rows < 0 || cols < 0 || group < 0 || rows > (int64_t)1 << 40 || cols > (int64_t)1 << 40 ||
      group > (int64_t)1 << 20)
    return -1;
  using I = __int128;
  I n;
  if (is_packed(t)) {
    if (group == 0 || (packed_fixed_group(t) && group != packed_fixed_group(t))) return -1;
    const I s = packed_super(t), ng = (cols + group - 1) / group;
    n = (I)((rows + TILE - 1) / TILE) * ((ng + s - 1) / s) * packed_block_bytes(t, group);
  } else if (is_qact(t)) {
    if (group == 0) return -1;
    const I ng = (cols + group - 1) / group;
    n = ((I)rows * ng * group + 63) / 64 * 64 + 8 * (I)rows * ng;
  } else if (t == KV_I8) {
    if (group == 0 || cols % group != 0) return -1;
    n = (I)rows * (cols / group) * (group + 4);
  } else if (is_ggml_block(t)) {
    if (cols % QK != 0) return -1;
    n = (I)rows * (cols / QK) * ggml_block_bytes(t);
  } else {
    const int64_t es = row_bytes(t, 1);
    if (es < 0) return -1;
    n = (I)rows * cols * es;
  }
  return n > (I)INT64_MAX ? -1 : (int64_t)n;
}

// [begin, end) of thread ith's contiguous share of n items.
struct Range { int64_t b, e; };
static inline Range split(int64_t n, int ith, int nth) {
  const int64_t per = (n + nth - 1) / nth;
  int64_t b = per * ith;
  int64_t e = b + per;
  if (b > n) b = n;
  if (e > n) e = n;
  return {b, e};
}

// A chunk's output held back (the executor's backup copies): while a thread
// runs a chunk staged, the matmul epilogues append each row's finished
// columns (where, how many, the values) here instead of writing them, and
// only the one thread that commits the chunk first (its own run or a backup
// of it) writes them to memory. A thread that loses the commit drops its
// copy, so nothing is written twice or late. Sized by the executor for the
// largest staged chunk; `overflow` marks a chunk that did not fit (never
// committed).
struct StageEntry {
  float* dst;
  int64_t n;
  float v[TILE];
};
struct Stage {
  StageEntry* e;
  int64_t n, cap;
  bool overflow;
};
inline void stage_put(Stage& s, float* dst, const float* v, int64_t n) {
  if (s.n == s.cap) {
    s.overflow = true;
    return;
  }
  StageEntry& x = s.e[s.n++];
  x.dst = dst, x.n = n;
  for (int64_t r = 0; r < n; ++r) x.v[r] = v[r];
}

// n work items cut into about n / min_per chunks of at least min_per items
// (at most cap chunks), all non-empty under split(): how an op family cuts
// its kernel's work items into the chunks the executor's threads claim (its
// chunks_of next to its rules; chunk u of U is split(items, u, U)). Never
// from the thread count: a row's bits do not depend on it.
inline int64_t even_chunks(int64_t items, int64_t min_per, int64_t cap) {
  if (items <= 1) return 1;
  int64_t u = (items + min_per - 1) / min_per;
  u = u < 1 ? 1 : u > cap ? cap : u;
  const int64_t per = (items + u - 1) / u;
  return (items + per - 1) / per;
}

// Per-step inputs; arrays are owned by the Executor (sized at construction).
struct StepCtx {
  int32_t n_tokens;
  int32_t n_out;
  int32_t n_seqs;
  int32_t max_blocks;           // row stride of block_tables
  int64_t block_size;           // tokens per KV block (the pool's, fixed per executor)
  const int32_t* tokens;        // [n_tokens]
  const int32_t* positions;     // [n_tokens] position of each token in its sequence
  const int32_t* slots;         // [n_tokens] KV slot (block * block_size + offset)
  const int32_t* seq_of_token;  // [n_tokens] index into block_tables
  const int32_t* block_tables;  // [n_seqs, max_blocks]
  const int32_t* out_rows;      // [n_out] token rows whose logits are computed
  float* scratch;               // the calling thread's scratch (scratch_floats floats)
  int64_t scratch_floats;
  // 1 when this call is the calling thread's first chunk of the op in this
  // step: a kernel whose every call needs the same per-thread input stage
  // (a matmul's quantized input rows in scratch) runs it then, and later
  // chunks of the op on the same thread reuse it.
  int32_t first;
  // Not null while this thread runs a chunk staged (Stage): the matmul
  // epilogues write there instead.
  Stage* stage;
};

// Rows of an operand in this step (ROWS_TOKENS / ROWS_OUT resolved).
static inline int64_t resolve_rows(int64_t rows, const StepCtx& c) {
  return rows == ROWS_TOKENS ? c.n_tokens : rows == ROWS_OUT ? c.n_out : rows;
}

// The attention kernel's work items, (run, kv head): a run is up to ATT_QB
// consecutive tokens of one sequence (a decode token is a run of one).
// Tokens [t0, t1) of the step are the run starting at t0; *cost = the
// (token, key) pairs its rows score. (Here, not in attention.inc: the
// executor counts items to cut a step's attention into chunks.)
constexpr int64_t ATT_QB = 16;  // tokens per work item
inline int64_t att_next_run(const StepCtx& c, int64_t t0, int64_t* cost) {
  int64_t t1 = t0 + 1, k = (int64_t)c.positions[t0] + 1;
  while (t1 < c.n_tokens && t1 - t0 < ATT_QB && c.seq_of_token[t1] == c.seq_of_token[t0]) k += c.positions[t1++] + 1;
  *cost = k;
  return t1;
}

// One kernel: computes chunk ith of nth of the op whose params struct
// `params` points to (the kernel's own type; kernels/ops.h). The executor
// cuts each op into a number of chunks that does not depend on the thread
// count and threads claim them (executor.cpp); every kernel's output rows are
// the same bits whatever the chunking, so a chunk is computed the same way
// by whichever thread claims it.
using KernelFn = void (*)(const void* params, const StepCtx& ctx, int ith, int nth);

// Offline weight (de)quantization of packed formats, tiles [tile_b, tile_e)
// of a [n, k] matrix (layout: packed formats above; rounding rule:
// src/llamajet/formats/packed.py, which these equal bit for bit).
using QuantFn = void (*)(int32_t kind, int64_t g, const float* w, int64_t n, int64_t k, uint8_t* out,
                         int64_t tile_b, int64_t tile_e);
using DequantFn = void (*)(int32_t kind, int64_t g, const uint8_t* packed, int64_t n, int64_t k, float* out,
                           int64_t tile_b, int64_t tile_e);

}  // namespace lj
