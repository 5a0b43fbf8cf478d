// common.h — plain-data types shared by the runtime and every kernel tier.
//
// The executor runs a Program: a flat list of Ops over memory it is handed.
// Python builds the Program once per (phase, shape bucket); every step only
// refreshes the small StepCtx (token ids, positions, KV slots) and runs it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lj {

// NOTE: helpers in this header are `static inline`: each ISA translation unit
// keeps its own copy, so the linker can never hand the baseline code a copy
// compiled with AVX-512 flags.

// Weight / table storage formats the kernels read. Values are part of the
// Python<->C++ contract (ops/__init__.py mirrors them).
enum DType : int32_t {
  F32 = 0,
  F16 = 1,
  BF16 = 2,
  Q8_0 = 3,  // GGML block: fp16 d, 32 x int8;        w = d * q
  Q4_0 = 4,  // GGML block: fp16 d, 16 B nibbles;      w = d * (q - 8)
  Q4_1 = 5,  // GGML block: fp16 d, fp16 m, 16 B;      w = d * q + m
  KV_I8 = 16,  // KV cache only: per (slot, kv head) fp32 scale then head_dim int8; x = scale * q
  // Packed, tile-interleaved formats (src/llamajet/quant/pack.py has the
  // layout): tiles of 16 rows, groups of G along K, per tile and group
  // codes | d[16] fp16 | m[16] fp16 (asymmetric only).
  PK_I4S = 6,  // int4 symmetric:  w = d * (c - 8)
  PK_I4A = 7,  // int4 asymmetric: w = d * c + m
  PK_I8 = 8,   // int8 symmetric:  w = d * c (c signed)
};

constexpr int64_t TILE = 16;  // rows per packed tile

static inline bool is_packed(int32_t t) { return t == PK_I4S || t == PK_I4A || t == PK_I8; }

// Bytes of one (tile, group) block of a packed format with group length g.
static inline int64_t packed_block_bytes(int32_t t, int64_t g) {
  return (t == PK_I8 ? TILE * g : TILE * g / 2) + 2 * TILE * (t == PK_I4A ? 2 : 1);
}

// Bytes of a packed [n, k] matrix with group g (n, k padded up).
static inline int64_t packed_bytes(int32_t t, int64_t n, int64_t k, int64_t g) {
  const int64_t tiles = (n + TILE - 1) / TILE, groups = (k + g - 1) / g;
  return tiles * groups * packed_block_bytes(t, g);
}

constexpr int64_t QK = 32;  // elements per GGML quant block

// Bytes used by one row of K elements of type t (K must be a multiple of 32
// for the block types; Python checks this before building a Program).
static inline int64_t row_bytes(int32_t t, int64_t k) {
  switch (t) {
    case F32: return 4 * k;
    case F16: case BF16: return 2 * k;
    case Q8_0: return (k / QK) * 34;
    case Q4_0: return (k / QK) * 18;
    case Q4_1: return (k / QK) * 20;
    default: return -1;
  }
}

// Op kinds, also mirrored in Python.
enum OpKind : int32_t {
  OP_EMBED = 0,      // out[t,:] = table[tokens[t], :]                  i: dim (packed: _, _, G)
  OP_RMSNORM = 1,    // out = x * rsqrt(mean(x^2)+eps) * w               i: n      f: eps
  OP_MATMUL = 2,     // out[m,n] = sum_k x[m,k] W[n,k]                   i: N, K (packed: G, float-activations flag)
  OP_ROPE = 3,       // out = rope(x) on [t, heads, hd], cos/sin tables i: heads, hd, interleaved, row stride
  OP_KV_WRITE = 4,   // kpool[slot[t]] = k[t]; vpool[slot[t]] = v[t]     i: kv_dim
  OP_ATTENTION = 5,  // causal GQA over K/V read through block tables    i: heads, kv_heads, hd, block_size  f: scale
  OP_SWIGLU = 6,     // out = silu(gate) * up                            i: n
  OP_ADD = 7,        // out = a + b                                      i: n
  OP_GATHER = 8,     // out[r,:] = x[out_rows[r], :]                     i: n
  OP_ADD_RMSNORM = 9,  // out2 = x + x2; out = rmsnorm(out2) * w (+ int8 copy at e0)  i: n, G  f: eps
  OP_QUANTIZE = 10,    // e0 = x as int8 in groups of G (a W*A8 matmul's input stage)  i: n, G
  OP_ARGMAX = 11,      // out[m] = first index of max x[m, :] (int32; numpy's argmax)  i: n
  OP_COUNT
};

// Row counts that depend on the step are written as these negative codes in
// Op::rows and resolved per run.
constexpr int64_t ROWS_TOKENS = -1;  // tokens in this step
constexpr int64_t ROWS_OUT = -2;     // rows whose logits are wanted

// Per-step inputs; arrays are owned by the Executor (sized at construction).
struct StepCtx {
  int32_t n_tokens;
  int32_t n_out;
  int32_t n_seqs;
  int32_t max_blocks;           // row stride of block_tables
  const int32_t* tokens;        // [n_tokens]
  const int32_t* positions;     // [n_tokens] position of each token in its sequence
  const int32_t* slots;         // [n_tokens] KV slot (block * block_size + offset)
  const int32_t* seq_of_token;  // [n_tokens] index into block_tables
  const int32_t* block_tables;  // [n_seqs, max_blocks]
  const int32_t* out_rows;      // [n_out] token rows whose logits are computed
  float* scratch;               // [n_threads, scratch_floats] per-thread scratch
  int64_t scratch_floats;
};

// One op of a Program with its operands resolved to pointers.
struct Op {
  int32_t kind = 0;
  int32_t wtype = F32;  // storage type of w (matmul weight / embedding table)
  int64_t rows = 0;     // leading dimension M (or ROWS_* code)
  int64_t i[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  float f[2] = {0.f, 0.f};
  float* x = nullptr;        // main input
  const float* x2 = nullptr; // second input (add b, swiglu up, kv_write v)
  const void* w = nullptr;   // weight / table / rope cos
  const void* w2 = nullptr;  // rope sin / v pool
  float* out = nullptr;      // output (k pool for kv_write / attention)
  float* out2 = nullptr;     // v pool for kv_write
  void* e0 = nullptr;        // fused ops' extra operands (epilogue / prologue inputs)
  void* e1 = nullptr;
};

constexpr int OP_INTS = 12;     // Op::i
constexpr int OP_OPERANDS = 8;  // x, x2, w, w2, out, out2, e0, e1

// One kernel: computes this thread's share [ith of nth] of the op.
using KernelFn = void (*)(const Op& op, const StepCtx& ctx, int ith, int nth);

// A tier's kernels, indexed by OpKind. Filled once per ISA file.
// Offline weight (de)quantization of packed formats, tiles [tile_b, tile_e)
// of a [n, k] matrix (layout: packed formats above; rounding rule:
// src/llamajet/quant/pack.py, which these equal bit for bit).
using QuantFn = void (*)(int32_t kind, int64_t g, const float* w, int64_t n, int64_t k, uint8_t* out,
                         int64_t tile_b, int64_t tile_e);
using DequantFn = void (*)(int32_t kind, int64_t g, const uint8_t* packed, int64_t n, int64_t k, float* out,
                           int64_t tile_b, int64_t tile_e);

struct KernelTable {
  const char* isa;
  KernelFn fn[OP_COUNT];
  QuantFn quantize;
  DequantFn dequantize;
};

// Each per-ISA translation unit exports one of these.
const KernelTable* kernels_ref();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
const KernelTable* kernels_amx();

}  // namespace lj
