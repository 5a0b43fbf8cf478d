// ops.h — the op registry: every op family's file, and the one list of ops.
//
// Included by the runtime translation units (executor, bindings: the params
// structs and their rules) and, through body.inc, by each kernel tier's
// translation unit (LJ_NS defined: the params structs and the kernels, once
// per ISA). Adding an op family: its file (contract.h says what it holds), an
// #include below and one LJ_OPS entry; the executor, the Python bindings, the
// kernel tables and the Python lowering (graph/lower.py) follow from these.
#pragma once
#include <cmath>
#include <cstring>
#include <type_traits>

#include "contract.h"

#ifdef LJ_NS
namespace LJ_NS {
using lj::StepCtx;
#include "common.inc"
}  // namespace LJ_NS
#endif

// Order matters for the kernels: a family may use helpers of those above it.
#include "attention.inc"        // KV storage, kv_write, attention's work items
#include "matmul.inc"           // matmul, quantize, add_rmsnorm (+ quantize_row, rmsnorm_row)
#include "elementwise.inc"      // embed, rmsnorm, rope, swiglu, add, gather, argmax
#include "attention_tiled.inc"  // attention

// X(KIND, name, Params, FIELDS, kernel): every op, in OpKind order. `name` is
// the graph's op name (graph/ir.py) and the Python params class is Params.
#define LJ_OPS(X)                                                              \
  X(OP_EMBED, embed, EmbedOp, LJ_EMBED_FIELDS, k_embed)                        \
  X(OP_RMSNORM, rmsnorm, RmsNormOp, LJ_RMSNORM_FIELDS, k_rmsnorm)              \
  X(OP_MATMUL, matmul, MatmulOp, LJ_MATMUL_FIELDS, k_matmul_any)               \
  X(OP_ROPE, rope, RopeOp, LJ_ROPE_FIELDS, k_rope)                             \
  X(OP_KV_WRITE, kv_write, KvWriteOp, LJ_KV_WRITE_FIELDS, k_kv_write)          \
  X(OP_ATTENTION, attention, AttentionOp, LJ_ATTENTION_FIELDS, k_attention_tiled) \
  X(OP_SWIGLU, swiglu, SwigluOp, LJ_SWIGLU_FIELDS, k_swiglu)                   \
  X(OP_ADD, add, AddOp, LJ_ADD_FIELDS, k_add)                                  \
  X(OP_GATHER, gather, GatherOp, LJ_GATHER_FIELDS, k_gather)                   \
  X(OP_ADD_RMSNORM, add_rmsnorm, AddRmsNormOp, LJ_ADD_RMSNORM_FIELDS, k_add_rmsnorm) \
  X(OP_QUANTIZE, quantize, QuantizeOp, LJ_QUANTIZE_FIELDS, k_quantize_rows)    \
  X(OP_ARGMAX, argmax, ArgmaxOp, LJ_ARGMAX_FIELDS, k_argmax_rows)

namespace lj {

#define LJ_OP_ENUM(KIND, name, P, FIELDS, kernel) KIND,
enum OpKind : int32_t { LJ_OPS(LJ_OP_ENUM) OP_COUNT };
#undef LJ_OP_ENUM

// A tier's kernels, indexed by OpKind (body.inc fills one per ISA file).
struct KernelTable {
  const char* isa;
  KernelFn fn[OP_COUNT];
  QuantFn quantize;
  DequantFn dequantize;
};

const KernelTable* kernels_ref();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
const KernelTable* kernels_amx();
// One core's vpdpbusd (zmm) rate in GMAC/s over `iters` rounds of 12
// independent accumulators: the ceiling of W*A8 matrix work on the avx512 tier
// (benchmarks/prefill_peers.py prints each type's share of it). Only on a CPU
// that runs the avx512 tier.
double vnni_peak_gmacs_avx512(int64_t iters);

#ifndef LJ_NS
// OpTraits<P>: an op's kind and name, and its fields by name (for the
// executor's generic checks and the Python bindings).
template <class P>
struct OpTraits;
#define LJ_VISIT_REF(name, doc) f(#name, p.name, doc);
#define LJ_VISIT_VAL(type, name, init, doc) f(#name, p.name, doc);
#define LJ_OP_TRAITS(KIND, opname, P, FIELDS, kernel)            \
  template <>                                                    \
  struct OpTraits<P> {                                           \
    static constexpr OpKind kind = KIND;                         \
    static constexpr const char* name = #opname;                 \
    template <class T, class F>                                  \
    static void fields(T& p, F&& f) { FIELDS(LJ_VISIT_REF, LJ_VISIT_VAL) } \
  };
LJ_OPS(LJ_OP_TRAITS)
#undef LJ_OP_TRAITS

// The name of each OpKind, in order.
#define LJ_OP_NAME(KIND, name, P, FIELDS, kernel) #name,
inline constexpr const char* kOpNames[OP_COUNT] = {LJ_OPS(LJ_OP_NAME)};
#undef LJ_OP_NAME
#endif  // !LJ_NS

}  // namespace lj
