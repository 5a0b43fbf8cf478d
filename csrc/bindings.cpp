// bindings.cpp — the one extension module (llamajet._core). Marshalling and
// boundary checks only; no math. Every error on input becomes a Python
// exception (std::invalid_argument -> ValueError), never a crash.
//
// Exported so that Python never re-declares a code: the storage types
// (DType), op kinds (OpKind), matmul epilogues / prologues, the KV storage
// types by their option names, the size rules (tensor_bytes, ...), and one
// class per op family's params struct, every field by name with its doc
// (generated from the field lists of kernels/*.inc, so they cannot drift).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "kernels/packed_scalar.h"
#include "runtime/cpu_features.h"
#include "runtime/digest.h"
#include "runtime/executor.h"
#include "runtime/membench.h"
#include "runtime/pages.h"
#include "runtime/repack.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using I32Vec = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32Mat = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using AnyArr = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

void check_packed_args(const char* fn, int kind, int64_t g, int64_t n, int64_t k) {
  const std::string f(fn);
  if (!lj::is_packed(kind)) throw std::invalid_argument(f + ": unknown packed kind");
  // groups up to 2^16: a per-channel group is a whole row; int8 x int8 sums over 2^16 fit int32
  if (g < 8 || g > 65536 || g % 8) throw std::invalid_argument(f + ": group must be a multiple of 8 in 8..65536");
  if (n < 1 || k < 1) throw std::invalid_argument(f + ": empty matrix");
  const int64_t fg = lj::packed_fixed_group(kind);
  if (fg && g != fg) throw std::invalid_argument(f + ": this kind is made for groups of " + std::to_string(fg));
}

// Runs fn(tile_begin, tile_end) on n_threads threads, contiguous tile ranges,
// with the GIL released (offline work: a pool per call is fine).
void for_tiles(int n_threads, int64_t tiles, const std::function<void(int64_t, int64_t)>& fn) {
  nb::gil_scoped_release release;
  struct Job { const std::function<void(int64_t, int64_t)>* fn; int64_t tiles; } job{&fn, tiles};
  lj::ThreadPool pool(n_threads < 1 ? 1 : n_threads);
  pool.run([](void* p, int ith, int nth) {
    const Job* j = (const Job*)p;
    const int64_t per = (j->tiles + nth - 1) / nth, b = per * ith, e = b + per < j->tiles ? b + per : j->tiles;
    if (b < e) (*j->fn)(b, e);
  }, &job);
}

std::string ref_repr(const lj::Ref& r) {
  std::string where = r.buffer >= 0 ? "buffer=" + std::to_string(r.buffer) + ", offset=" + std::to_string(r.offset)
                      : r.ptr       ? "external, nbytes=" + std::to_string(r.nbytes)
                                    : "absent";
  return "Ref(" + where + ", dtype=" + std::to_string(r.dtype) + ", rows=" + std::to_string(r.rows) +
         ", cols=" + std::to_string(r.cols) + ", group=" + std::to_string(r.group) + ")";
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "llamajet C++ core: CPU feature detection, typed ops, kernels, executor";

  // ---------------------------------------------------------------- codes
  nb::enum_<lj::DType>(m, "DType", nb::is_arithmetic(), "Storage types of weights, activations and the KV cache (csrc/common.h)")
      .value("F32", lj::F32).value("F16", lj::F16).value("BF16", lj::BF16)
      .value("Q8_0", lj::Q8_0).value("Q4_0", lj::Q4_0).value("Q4_1", lj::Q4_1)
      .value("PK_I4S", lj::PK_I4S).value("PK_I4A", lj::PK_I4A).value("PK_I8", lj::PK_I8)
      .value("I32", lj::I32).value("Q8_ACT", lj::Q8_ACT)
      .value("PK_I5S", lj::PK_I5S).value("PK_I5A", lj::PK_I5A).value("PK_Q4K", lj::PK_Q4K)
      .value("PK_Q5K", lj::PK_Q5K).value("PK_Q6K", lj::PK_Q6K).value("KV_I8", lj::KV_I8)
      .value("Q8_ACTK", lj::Q8_ACTK);
#define LJ_KIND_VALUE(KIND, name, P, FIELDS, kernel) .value(#name, lj::KIND)
  nb::enum_<lj::OpKind>(m, "OpKind", nb::is_arithmetic(), "Op kinds, by the graph's op names (kernels/ops.h)") LJ_OPS(LJ_KIND_VALUE);
#undef LJ_KIND_VALUE
  nb::enum_<lj::Epilogue>(m, "Epilogue", nb::is_arithmetic(), "What a matmul's finished tile of columns becomes (kernels/matmul.inc)")
      .value("STORE", lj::EPI_STORE).value("RESIDUAL", lj::EPI_RESIDUAL)
      .value("SWIGLU", lj::EPI_SWIGLU).value("QKV", lj::EPI_QKV);
  nb::enum_<lj::Prologue>(m, "Prologue", nb::is_arithmetic(), "How a matmul's input rows are made (kernels/matmul.inc)")
      .value("NONE", lj::PRO_NONE).value("PREQUANT", lj::PRO_PREQUANT).value("RMSNORM", lj::PRO_RMSNORM);
  {
    nb::dict kv;  // KV cache storage types, by their option names (RuntimeConfig.kv_dtype)
    kv["f32"] = lj::F32; kv["f16"] = lj::F16; kv["bf16"] = lj::BF16; kv["int8"] = lj::KV_I8;
    m.attr("KV_DTYPES") = kv;
  }
  m.attr("TILE") = lj::TILE;
  m.attr("QK") = lj::QK;
  m.attr("ROWS_TOKENS") = lj::ROWS_TOKENS;
  m.attr("ROWS_OUT") = lj::ROWS_OUT;

  // ---------------------------------------------------------------- size rules
  m.def("tensor_bytes", &lj::tensor_bytes, "dtype"_a, "rows"_a, "cols"_a, "group"_a = 0,
        "Bytes of a [rows, cols] tensor of storage type dtype (group: packed / Q8_ACT groups, KV head_dim); "
        "-1 if the shape is not valid for the type.");
  m.def("ggml_block_bytes", [](lj::DType t) { return lj::ggml_block_bytes(t); }, "dtype"_a,
        "Bytes of one GGML block of QK elements (0: not a block type).");
  m.def("packed_block_bytes", [](lj::DType t, int64_t g) {
          if (!lj::is_packed(t) || g <= 0) throw std::invalid_argument("packed_block_bytes: a packed type and group > 0");
          return lj::packed_block_bytes(t, g);
        }, "dtype"_a, "group"_a, "Bytes of one (16-row tile, super-block) block of a packed type (S groups).");
  m.def("packed_super", [](lj::DType t) {
          if (!lj::is_packed(t)) throw std::invalid_argument("packed_super: a packed type");
          return lj::packed_super(t);
        }, "dtype"_a, "Groups per super-block of a packed type (1, or the K-quants' 8 / 16).");
  m.def("packed_act_dtype", [](lj::DType t) {
          if (!lj::is_packed(t)) throw std::invalid_argument("packed_act_dtype: a packed type");
          return (lj::DType)lj::packed_act_dtype(t);
        }, "dtype"_a, "The int8 activation type a packed type's W*A8 kernels read (Q8_ACTK for the K-quants).");
  m.def("qact_span", [](lj::DType t, int64_t g) {
          if (!lj::is_qact(t)) throw std::invalid_argument("qact_span: Q8_ACT or Q8_ACTK");
          return lj::qact_span(t, g);
        }, "dtype"_a, "group"_a, "Values sharing one scale in a quantized activation row of groups of `group`.");
  m.def("packed_fixed_group", [](lj::DType t) {
          if (!lj::is_packed(t)) throw std::invalid_argument("packed_fixed_group: a packed type");
          return lj::packed_fixed_group(t);
        }, "dtype"_a, "The group length a packed type is made for; 0 = any multiple of 8.");
  m.def("packed_code_bits", [](lj::DType t) {
          if (!lj::is_packed(t)) throw std::invalid_argument("packed_code_bits: a packed type");
          return lj::packed_code_bits(t);
        }, "dtype"_a, "Bits per code of a packed type (4, 5, 6 or 8).");
  m.def("kv_row_bytes", [](lj::DType t, int64_t kv_heads, int64_t hd) {
          if (!lj::is_kv_dtype(t) || kv_heads <= 0 || hd <= 0) throw std::invalid_argument("kv_row_bytes: bad arguments");
          return lj::kv_row_bytes(t, kv_heads, hd);
        }, "dtype"_a, "kv_heads"_a, "head_dim"_a, "Bytes of one KV cache row (one token's K or V).");

  // ---------------------------------------------------------------- machine
  m.def("cpu_features", [] {
    const lj::CpuFeatures& f = lj::cpu_features();
    nb::dict d;
    d["brand"] = f.brand;
    d["sse4_2"] = f.sse42; d["avx"] = f.avx; d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c;
    d["avx512f"] = f.avx512f; d["avx512bw"] = f.avx512bw; d["avx512vl"] = f.avx512vl;
    d["avx512dq"] = f.avx512dq; d["avx512_vnni"] = f.avx512vnni; d["avx512_bf16"] = f.avx512bf16;
    d["avx_vnni"] = f.avxvnni; d["os_avx"] = f.os_avx; d["os_avx512"] = f.os_avx512;
    return d;
  });
  m.def("supported_isas", &lj::supported_isas, "ISAs this CPU and OS can run, lowest first");
  m.def("read_bandwidth", &lj::read_bandwidth, "nbytes"_a, "n_threads"_a, "reps"_a = 5,
        nb::call_guard<nb::gil_scoped_release>(),
        "Best read rate (bytes/s) of an nbytes buffer over reps passes, n_threads threads.");
  // A GGUF metadata array of `count` strings ([u64 length][bytes] each) at byte
  // `offset` of `buf` (the file's map): the Python list (UTF-8, invalid bytes
  // replaced, as gguf_meta's loop did) and the offset after it. 0.30 s of a
  // Llama-3 GGUF's load in Python (128,256 tokens + 280,147 merges); 0.05 s here.
  m.def(
      "gguf_string_array",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> buf, uint64_t offset,
         uint64_t count, uint64_t max_len) {
        const uint8_t* p = buf.data();
        const uint64_t end = buf.shape(0);
        if (offset > end || count > (end - offset) / 8)  // each string at least its 8-byte length
          throw std::invalid_argument("header runs past the end of the file (at byte " + std::to_string(offset) +
                                      ", " + std::to_string(count) + " strings wanted)");
        nb::list out;
        uint64_t o = offset;
        for (uint64_t i = 0; i < count; ++i) {
          if (end - o < 8) throw std::invalid_argument("string array runs past the end of the file");
          uint64_t n;
          std::memcpy(&n, p + o, 8);
          if (n > max_len)
            throw std::invalid_argument("a string of " + std::to_string(n) + " bytes at byte " + std::to_string(o) +
                                        " (limit " + std::to_string(max_len) + ")");
          if (n > end - o - 8) throw std::invalid_argument("string array runs past the end of the file");
          PyObject* str = PyUnicode_DecodeUTF8((const char*)p + o + 8, (Py_ssize_t)n, "replace");
          if (!str) throw nb::python_error();
          out.append(nb::steal(str));
          o += 8 + n;
        }
        return nb::make_tuple(out, o);
      },
      "buf"_a, "offset"_a, "count"_a, "max_len"_a);
  // A 128-bit digest of an array's bytes (runtime/digest.h: chunked, threaded,
  // independent of the thread count), 16 bytes. engine/outliers.py keys its
  // in-process probe memo by it: SHA-1 of a 1B model's weights took ~0.6 s of
  // each load, this takes about a memory read of them.
  m.def("content_digest",
        [](AnyArr a, int n_threads) {
          uint64_t d[2];
          const uint8_t* p = (const uint8_t*)a.data();
          const int64_t n = (int64_t)a.nbytes();
          {
            nb::gil_scoped_release unlocked;
            lj::digest128(p, n, n_threads < 1 ? 1 : n_threads, d);
          }
          return nb::bytes((const char*)d, sizeof d);
        },
        "a"_a, "n_threads"_a = 1);
  // Weight storage (formats/pages.py): uint8 [nbytes] in a mapping of its own
  // (runtime/pages.h: 2 MiB-aligned, no huge pages, committed on first write),
  // unmapped when the array dies. Heap memory below kPageMapMin.
  m.def("page_buffer",
        [](int64_t nbytes) {
          if (nbytes < 0) throw std::invalid_argument("page_buffer: negative size");
          size_t map_len = 0;
          uint8_t* p = nbytes >= lj::kPageMapMin ? lj::map_pages(nbytes, &map_len) : nullptr;
          nb::capsule owner;
          if (p) {
            // the length rides in a heap cell beside the pointer (a capsule holds one pointer)
            struct Map { uint8_t* p; size_t len; };
            Map* m = new Map{p, map_len};
            owner = nb::capsule(m, [](void* v) noexcept {
              Map* m = (Map*)v;
              lj::unmap_pages(m->p, m->len);
              delete m;
            });
          } else {
            p = new uint8_t[nbytes > 0 ? nbytes : 1];
            owner = nb::capsule(p, [](void* v) noexcept { delete[] (uint8_t*)v; });
          }
          size_t shape[1] = {(size_t)nbytes};
          return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(p, 1, shape, owner);
        },
        "nbytes"_a);
  m.def("vnni_peak_gmacs",
        [](int64_t iters) {
          const std::vector<std::string> isas = lj::supported_isas();
          if (std::find(isas.begin(), isas.end(), "avx512") == isas.end())
            throw std::invalid_argument("vnni_peak_gmacs: this CPU does not run the avx512 tier");
          if (iters < 1) throw std::invalid_argument("vnni_peak_gmacs: iters must be >= 1");
          nb::gil_scoped_release unlocked;
          return lj::vnni_peak_gmacs_avx512(iters);
        },
        "iters"_a = 20000000, "One core's vpdpbusd (zmm) rate in GMAC/s (kernels/ops.h).");
  m.def("step_allocations", &lj::step_allocations,
        "Heap allocations (operator new) made by this module's code inside steps, since import.");

  // Offline weight (de)quantization to / from the packed formats, tiles split
  // over a pool of n_threads. Equal bit for bit to formats/packed.py.
  m.def("quantize_packed",
        [](const std::string& isa, lj::DType kind, int64_t g,
           nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w, int n_threads) {
          const int64_t n = w.shape(0), k = w.shape(1);
          check_packed_args("quantize_packed", kind, g, n, k);
          if (kind != lj::PK_I4S && kind != lj::PK_I4A && kind != lj::PK_I8)
            throw std::invalid_argument("quantize_packed: RTN writes pk_i4s, pk_i4a or pk_i8 (the GGUF twins are repacked)");
          const lj::KernelTable* kt = lj::kernel_table(isa);
          const int64_t tiles = (n + lj::TILE - 1) / lj::TILE, ng = (k + g - 1) / g;
          const int64_t bb = lj::packed_block_bytes(kind, g);
          uint8_t* out = new uint8_t[tiles * ng * bb];
          nb::capsule owner(out, [](void* p) noexcept { delete[] (uint8_t*)p; });
          const float* src = w.data();
          for_tiles(n_threads, tiles, [&](int64_t b, int64_t e) { kt->quantize(kind, g, src, n, k, out, b, e); });
          size_t shape[3] = {(size_t)tiles, (size_t)ng, (size_t)bb};
          return nb::ndarray<nb::numpy, uint8_t, nb::ndim<3>>(out, 3, shape, owner);
        },
        "isa"_a, "kind"_a, "group"_a, "w"_a, "n_threads"_a = 1);
  m.def("dequantize_packed",
        [](const std::string& isa, lj::DType kind, int64_t g, int64_t n, int64_t k,
           nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu> packed, int n_threads) {
          check_packed_args("dequantize_packed", kind, g, n, k);
          if ((int64_t)packed.nbytes() != lj::packed_bytes(kind, n, k, g))
            throw std::invalid_argument("dequantize_packed: packed size does not match kind, shape and group");
          const lj::KernelTable* kt = lj::kernel_table(isa);
          float* out = new float[n * k];
          nb::capsule owner(out, [](void* p) noexcept { delete[] (float*)p; });
          const uint8_t* src = packed.data();
          for_tiles(n_threads, (n + lj::TILE - 1) / lj::TILE,
                    [&](int64_t b, int64_t e) { kt->dequantize(kind, g, src, n, k, out, b, e); });
          size_t shape[2] = {(size_t)n, (size_t)k};
          return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, 2, shape, owner);
        },
        "isa"_a, "kind"_a, "group"_a, "n"_a, "k"_a, "packed"_a, "n_threads"_a = 1);

  // Columns `cols` of a packed [n, k] matrix as float32 [n, len(cols)]: each value
  // as dequantize_packed gives it (kernels/packed_scalar.h), read from its own
  // code and scales only. The outlier pass's weight columns: a one-hot
  // float-activation matmul over every weight took 0.2 s of a 1B's load.
  m.def("packed_columns",
        [](lj::DType kind, int64_t g, int64_t n, int64_t k, nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu> packed,
           nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> cols) {
          check_packed_args("packed_columns", kind, g, n, k);
          if ((int64_t)packed.nbytes() != lj::packed_bytes(kind, n, k, g))
            throw std::invalid_argument("packed_columns: packed size does not match kind, shape and group");
          const int64_t nc = (int64_t)cols.shape(0);
          const int64_t* cs = cols.data();
          for (int64_t j = 0; j < nc; ++j)
            if (cs[j] < 0 || cs[j] >= k) throw std::invalid_argument("packed_columns: a column outside [0, k)");
          float* out = new float[n * (nc ? nc : 1)];
          nb::capsule owner(out, [](void* p) noexcept { delete[] (float*)p; });
          const uint8_t* src = packed.data();
          const int64_t tb = lj::packed_tile_bytes(kind, k, g);
          {
            nb::gil_scoped_release unlocked;
            for (int64_t r = 0; r < n; ++r)
              for (int64_t j = 0; j < nc; ++j) out[r * nc + j] = lj::packed_at(kind, src, tb, g, r, cs[j]);
          }
          size_t shape[2] = {(size_t)n, (size_t)nc};
          return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, 2, shape, owner);
        },
        "kind"_a, "group"_a, "n"_a, "k"_a, "packed"_a, "cols"_a);

  // GGUF blocks -> packed twin tiles, threaded, from the file's memory into dst.
  m.def("repack_gguf",
        [](const std::string& type, nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu> src, int64_t n,
           int64_t k, nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu> dst, int64_t dst_offset,
           int64_t tile_stride, int n_threads) {
          int64_t qk = 0, bb = 0;
          const int32_t kind = lj::gguf_twin(type, &qk, &bb);
          const int64_t fg = lj::packed_fixed_group(kind), G = fg ? fg : 32;
          if (n < 1 || k < 1 || k % qk || k % (G * lj::packed_super(kind)))
            throw std::invalid_argument("repack_gguf: rows of " + std::to_string(k) + " are not whole " + type + " blocks");
          if ((int64_t)src.nbytes() != n * (k / qk) * bb)
            throw std::invalid_argument("repack_gguf: source size does not match type and shape");
          const int64_t tb = lj::packed_tile_bytes(kind, k, G), tiles = (n + lj::TILE - 1) / lj::TILE;
          if (tile_stride <= 0) tile_stride = tb;  // consecutive tiles
          if (dst_offset < 0 || tile_stride < tb ||
              (__int128)dst_offset + (__int128)(tiles - 1) * tile_stride + tb > (__int128)dst.nbytes())
            throw std::invalid_argument("repack_gguf: destination too small for the tiles");
          const uint8_t* s = src.data();
          uint8_t* d = dst.data() + dst_offset;
          for_tiles(n_threads, tiles, [&](int64_t b, int64_t e) { lj::repack_gguf_tiles(type, s, n, k, d, tile_stride, b, e); });
        },
        "type"_a, "src"_a, "n"_a, "k"_a, "dst"_a, "dst_offset"_a = 0, "tile_stride"_a, "n_threads"_a = 1,
        "Repacks a GGUF [n, k] block matrix into its packed twin's tiles at dst + dst_offset + t * tile_stride.");

  // ---------------------------------------------------------------- operands
  nb::class_<lj::Ref>(m, "Ref",
                      "A tensor operand: an executor buffer + byte offset, or external memory (an array "
                      "Python keeps alive), with its storage type and shape. Absent: Ref().")
      .def(nb::init<>())
      .def_static("in_buffer",
                  [](int buffer, int64_t offset, lj::DType dtype, int64_t rows, int64_t cols, int64_t group) {
                    if (buffer < 0) throw std::invalid_argument("Ref.in_buffer: buffer id must be >= 0");
                    lj::Ref r;
                    r.buffer = buffer; r.offset = offset; r.dtype = dtype; r.rows = rows; r.cols = cols; r.group = group;
                    return r;
                  },
                  "buffer"_a, "offset"_a, "dtype"_a, "rows"_a, "cols"_a, "group"_a = 0)
      .def_static("from_array",
                  [](nb::handle h, lj::DType dtype, int64_t rows, int64_t cols, int64_t group) {
                    AnyArr a;
                    // No implicit conversion: a converted array would be a temporary freed on
                    // return, leaving the executor a dangling pointer.
                    if (!nb::try_cast(h, a, false))
                      throw std::invalid_argument("Ref.from_array: needs a C-contiguous numpy array (no conversion)");
                    lj::Ref r;
                    r.ptr = a.data(); r.nbytes = (int64_t)a.nbytes();
                    r.dtype = dtype; r.rows = rows; r.cols = cols; r.group = group;
                    return r;
                  },
                  "a"_a, "dtype"_a, "rows"_a, "cols"_a, "group"_a = 0,
                  "External memory (the caller keeps the array alive as long as the executor runs).")
      .def_rw("buffer", &lj::Ref::buffer).def_rw("offset", &lj::Ref::offset).def_ro("nbytes", &lj::Ref::nbytes)
      .def_rw("dtype", &lj::Ref::dtype).def_rw("rows", &lj::Ref::rows).def_rw("cols", &lj::Ref::cols)
      .def_rw("group", &lj::Ref::group)
      .def_prop_ro("present", [](const lj::Ref& r) { return lj::present(r); })
      .def("__repr__", &ref_repr);

  // ---------------------------------------------------------------- executor
  auto exe = nb::class_<lj::Executor>(m, "Executor");
  exe.def("__init__",
           [](lj::Executor* self, const std::string& isa, int n_threads, int max_tokens, int max_out, int max_seqs,
              int max_blocks, int64_t kv_slots, int64_t block_size, int64_t max_pos, int64_t scratch_floats) {
             lj::ExecConfig c;
             c.isa = isa; c.n_threads = n_threads; c.max_tokens = max_tokens; c.max_out = max_out; c.max_seqs = max_seqs;
             c.max_blocks = max_blocks; c.kv_slots = kv_slots; c.block_size = block_size;
             c.max_pos = max_pos; c.scratch_floats = scratch_floats;
             new (self) lj::Executor(c);
           },
           "isa"_a, "n_threads"_a, "max_tokens"_a, "max_out"_a, "max_seqs"_a, "max_blocks"_a, "kv_slots"_a,
           "block_size"_a, "max_pos"_a, "scratch_floats"_a = 0)
      .def_prop_ro("isa", [](const lj::Executor& e) { return std::string(e.isa()); })
      .def_prop_ro("n_threads", [](const lj::Executor& e) { return e.config().n_threads; })
      .def_prop_ro("max_tokens", [](const lj::Executor& e) { return e.config().max_tokens; })
      .def_prop_ro("allocations", &lj::Executor::allocations)
      .def_prop_ro("num_ops", &lj::Executor::num_ops)
      .def("alloc_buffer", &lj::Executor::alloc_buffer, "nbytes"_a)
      .def(
          "prefault_buffer",
          [](lj::Executor& e, int id) {
            nb::gil_scoped_release unlocked;
            e.prefault_buffer(id);
          },
          "id"_a, "Commits the buffer's memory now, zero-filled (its contents are lost).")
      .def("set_profiling", &lj::Executor::set_profiling, "on"_a,
           "Start (and reset) or stop per-op timing by thread 0.")
      .def("thread_stats",
           [](const lj::Executor& e) {
             const lj::Executor::ThreadStats t = e.thread_stats();
             nb::dict d;
             d["chunks"] = t.chunks;
             d["stolen"] = t.stolen;
             d["work_cycles"] = t.work_cycles;
             d["busy_steps"] = t.busy_steps;
             d["all_busy_steps"] = t.all_busy_steps;
             d["steps"] = t.steps;
             d["wall_cycles"] = t.wall_cycles;
             d["sleeps"] = t.sleeps;
             d["backups"] = t.backups;
             d["discarded"] = t.discarded;
             d["staged_steps"] = t.staged_steps;
             const size_t n = e.num_ops(), nth = (size_t)e.config().n_threads;
             nb::list per;
             for (size_t i = 0; i < nth && nth > 1; ++i)
               per.append(std::vector<int32_t>(t.chunks_per_op.begin() + i * n, t.chunks_per_op.begin() + (i + 1) * n));
             d["chunks_per_op"] = per;
             return d;
           },
           "How the threads shared the work since reset_thread_stats(): per thread the chunks run and "
           "stolen and the TSC cycles inside kernels; the steps and their wall cycles (thread 0); waits "
           "that slept; chunks per op per thread in the last step (several threads only); backup copies: "
           "per thread the chunks it committed for a thread that held them (backups, also in chunks) and "
           "the copies it ran that lost their commit (discarded), and the steps run staged.")
      .def("reset_thread_stats", &lj::Executor::reset_thread_stats)
      .def_prop_ro("last_step_regions", &lj::Executor::last_step_regions,
                   "Regions in the last step: the ops, less the kv_write + attention pairs run as one "
                   "(steps where every sequence's tokens are one attention run: decode)")
      .def("idle_counters", [](const lj::Executor& e) { auto p = e.idle_counters(); return nb::make_tuple(p.first, p.second); },
           "(cycles all threads spent in kernels, steps' wall cycles x threads) since the last reset; safe "
           "to call while a step runs (no wait for late workers).")
      .def("op_kinds",
           [](const lj::Executor& e) {
             nb::list out;
             for (size_t k = 0; k < e.num_ops(); ++k) out.append((lj::OpKind)e.op_kind(k));
             return out;
           },
           "The Program's op kinds, in order.")
      .def("set_test_stall",
           [](lj::Executor& e, int ith, uint32_t kinds_mask, bool every, bool hold) {
             if (ith < -1 || ith >= e.config().n_threads) throw std::invalid_argument("set_test_stall: no such thread");
             if (ith == 0) throw std::invalid_argument("set_test_stall: thread 0 starts the step; stall a worker");
             if (hold && (kinds_mask & ~(1u << lj::OP_MATMUL)))
               throw std::invalid_argument("set_test_stall: hold applies to matmuls only (the ops run staged)");
             e.set_test_stall(ith, kinds_mask, every, hold);
           },
           "ith"_a, "kinds_mask"_a, "every"_a = false, "hold"_a = false,
           "Test hook: worker ith sits out the first op (every: each op) of each kind in kinds_mask "
           "(bit = OpKind) of every step, claiming nothing, until the others have done it. ith = -1: off. "
           "hold (matmuls of staged steps only): it claims one chunk of the op instead and runs it only "
           "after the others have finished the op (a thread descheduled mid-chunk).")
      .def_prop_rw("backups", &lj::Executor::backups_mode, &lj::Executor::set_backups,
                   "Backup copies of held matmul chunks: 0 never (default), 1 in steps after a thread was "
                   "found busy, 2 in every step of up to 16 tokens. On, a descheduled thread may still be "
                   "inside a chunk (a copy that will be dropped) after run() returns, reading the Program's "
                   "memory: keep every array it reads alive until quiesce() or the executor's end.")
      .def("quiesce",
           [](lj::Executor& e) {
             nb::gil_scoped_release unlocked;
             e.quiesce();
           },
           "Returns when no thread is inside a step (a late backup copy included).")
      .def("profile",
           [](const lj::Executor& e) {
             nb::list out;  // (op index, kind, total ns) over the profiled steps
             const auto& ns = e.op_ns();
             for (size_t k = 0; k < ns.size(); ++k) out.append(nb::make_tuple(k, (lj::OpKind)e.op_kind(k), ns[k]));
             return nb::make_tuple(e.profiled_steps(), out);
           })
      .def("buffer",
           [](nb::handle self_h, int id) {
             lj::Executor& e = nb::cast<lj::Executor&>(self_h);
             size_t shape[1] = {(size_t)e.buffer_size(id)};
             // The view keeps the executor alive (owner = self).
             return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(e.buffer_data(id), 1, shape, self_h);
           },
           "id"_a, "A writable uint8 numpy view of an executor buffer.")
      .def("run",
           [](lj::Executor& e, I32Vec tokens, I32Vec positions, I32Vec slots, I32Vec seq_of_token,
              I32Mat block_tables, I32Vec out_rows) {
             const size_t n = tokens.shape(0);
             if (positions.shape(0) != n || slots.shape(0) != n || seq_of_token.shape(0) != n)
               throw std::invalid_argument("run: tokens, positions, slots, seq_of_token differ in length");
             nb::gil_scoped_release release;
             e.run((int)n, tokens.data(), positions.data(), slots.data(), seq_of_token.data(),
                   (int)block_tables.shape(0), block_tables.data(), (int)block_tables.shape(1),
                   (int)out_rows.shape(0), out_rows.data());
           },
           "tokens"_a, "positions"_a, "slots"_a, "seq_of_token"_a, "block_tables"_a, "out_rows"_a);

  // ---------------------------------------------------------------- op params
  // One class per op family, its fields bound by name from the field list;
  // Executor.add takes any of them. OPS maps the graph's op names to them.
  nb::dict op_classes;
#define LJ_BIND_FIELD_REF(name, doc) cls.def_rw(#name, &Self::name, doc);
#define LJ_BIND_FIELD_VAL(type, name, init, doc) cls.def_rw(#name, &Self::name, doc);
#define LJ_BIND_OP(KIND, opname, P, FIELDS, kernel)                                                 \
  {                                                                                                 \
    using Self = lj::P;                                                                             \
    auto cls = nb::class_<Self>(m, #P, "Params of the " #opname " op (kernels/ops.h); fields by name"); \
    cls.def(nb::init<>());                                                                          \
    FIELDS(LJ_BIND_FIELD_REF, LJ_BIND_FIELD_VAL)                                                    \
    cls.def_prop_ro_static("fields", [](nb::handle) {                                               \
      nb::list names;                                                                               \
      Self p;                                                                                       \
      lj::OpTraits<Self>::fields(p, [&](const char* n, auto&, const char*) { names.append(n); });    \
      return names;                                                                                 \
    });                                                                                             \
    exe.def("add", [](lj::Executor& e, const Self& p) { e.add(p); }, "params"_a);                   \
    op_classes[#opname] = cls;                                                                      \
  }
  LJ_OPS(LJ_BIND_OP)
#undef LJ_BIND_OP
#undef LJ_BIND_FIELD_REF
#undef LJ_BIND_FIELD_VAL
  m.attr("OPS") = op_classes;
}
