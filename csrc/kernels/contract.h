// contract.h — how an op family states its contract (kernels/ops.h lists them).
//
// An op family is one file (e.g. kernels/matmul.inc; a big family's kernels
// may sit in parts that file includes, as matmul_*.inc) holding, together:
//   - its params struct, declared through a field list so that the same
//     list also binds every field to Python by name (bindings.cpp) and lets
//     the executor resolve every tensor operand generically:
//         #define LJ_FOO_FIELDS(REF, VAL)
//           REF(x, "[M, n] f32 input rows")                      a tensor operand (Ref)
//           VAL(float, eps, 1e-5f, "added to the mean square")   a value with its default
//         LJ_PARAMS(FooOp, LJ_FOO_FIELDS)
//     The doc strings are the field comments; Python shows them too.
//   - its rules (runtime translation units only, #ifndef LJ_NS): a function
//     `void rules(FooOp& p, OpCheck& k)` that checks shapes and types against
//     each other and the executor's configuration, and reports the per-thread
//     scratch its kernel needs (k.scratch_floats);
//   - its kernels (kernel translation units only, #ifdef LJ_NS, one copy per
//     ISA tier): `void k_foo(const FooOp& p, const StepCtx& c, int ith, int nth)`.
// Before the rules run, the executor has checked every present operand's
// memory against its own declared shape (tensor_bytes of dtype, rows, cols,
// group, for the largest step) and set `data`; rules only relate the shapes.
#pragma once
#include <cstdint>
#include <string>

#include "../common.h"

#define LJ_DECLARE_REF(name, doc) ::lj::Ref name;
#define LJ_DECLARE_VAL(type, name, init, doc) type name = init;
#define LJ_PARAMS(Struct, FIELDS) \
  struct Struct {                 \
    FIELDS(LJ_DECLARE_REF, LJ_DECLARE_VAL)    \
  };

#ifndef LJ_NS
#include <stdexcept>

namespace lj {

// What an executor accepts: its fixed sizes, the largest step's.
struct ExecConfig {
  std::string isa;             // "ref" | "avx2" | "avx512" | "amx"
  int n_threads = 1;
  int max_tokens = 1;          // tokens per step
  int max_out = 1;             // rows of logits per step (<= max_tokens)
  int max_seqs = 1;            // sequences per step
  int max_blocks = 1;          // block-table columns per sequence
  int64_t kv_slots = 0;        // slots in the KV pool (blocks * block_size)
  int64_t block_size = 16;     // tokens per KV block
  int64_t max_pos = 0;         // rows of the RoPE tables = max context
  int64_t scratch_floats = 0;  // per-thread scratch, at least; grown to what each op needs
};

// What an op's rules see (the executor's configuration) and report back.
struct OpCheck {
  const ExecConfig& cfg;
  const char* op;              // the op's name, for messages
  int64_t scratch_floats = 0;  // out: per-thread scratch the kernel needs for the largest step
  int64_t token_limit = -1;    // out: token ids must be < this (an embedding table's rows)

  // A Ref's row count for the largest step (ROWS_TOKENS, ROWS_OUT resolved).
  int64_t rows(const Ref& r) const {
    return r.rows == ROWS_TOKENS ? cfg.max_tokens : r.rows == ROWS_OUT ? cfg.max_out : r.rows;
  }
  [[noreturn]] void fail(const std::string& why) const { throw std::invalid_argument(std::string(op) + ": " + why); }
  void require(bool ok, const std::string& why) const {
    if (!ok) fail(why);
  }
  // `r` (called `name`) is present, of type `dtype` (-1: any).
  void need(const Ref& r, const char* name, int32_t dtype = -1) const {
    require(present(r), std::string(name) + " is required");
    if (dtype >= 0) require(r.dtype == dtype, std::string(name) + " has storage type " + std::to_string(r.dtype) +
                                                  ", expected " + std::to_string(dtype));
  }
  // `r` is present, f32, with `cols` columns and the row count `rows_like` has.
  void rows_f32(const Ref& r, const char* name, int64_t cols, const Ref& rows_like) const {
    need(r, name, F32);
    require(r.cols == cols, std::string(name) + " has " + std::to_string(r.cols) + " columns, expected " +
                                std::to_string(cols));
    require(r.rows == rows_like.rows, std::string(name) + " has another row count than its op's rows");
  }
  // Overflow-checked products and sums: a size that does not fit is bad input.
  int64_t mul(int64_t a, int64_t b) const {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r)) fail("size overflows");
    return r;
  }
  int64_t add(int64_t a, int64_t b) const {
    int64_t r;
    if (__builtin_add_overflow(a, b, &r)) fail("size overflows");
    return r;
  }
};

}  // namespace lj
#endif  // !LJ_NS
