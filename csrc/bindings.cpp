// bindings.cpp — the one extension module (llamajet._core). Marshalling and
// boundary checks only; no math. Every error on input becomes a Python
// exception (std::invalid_argument -> ValueError), never a crash.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <functional>
#include <stdexcept>

#include "runtime/cpu_features.h"
#include "runtime/executor.h"
#include "runtime/membench.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using I32Vec = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32Mat = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using AnyArr = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

lj::Operand to_operand(nb::handle h, int index) {
  lj::Operand o;
  if (h.is_none()) return o;
  if (nb::isinstance<nb::tuple>(h)) {
    nb::tuple t = nb::borrow<nb::tuple>(h);
    if (t.size() != 2) throw std::invalid_argument("operand tuple must be (buffer_id, byte_offset)");
    o.buffer = nb::cast<int>(t[0]);
    o.offset = nb::cast<int64_t>(t[1]);
    return o;
  }
  AnyArr a;
  // No implicit conversion: a converted array would be a temporary freed on
  // return, leaving the executor a dangling pointer.
  if (!nb::try_cast(h, a, false))
    throw std::invalid_argument("operand " + std::to_string(index) +
                                " must be None, (buffer, offset) or a C-contiguous array");
  o.ptr = a.data();
  o.nbytes = (int64_t)a.nbytes();
  return o;
}

void check_packed_args(const char* fn, int kind, int64_t g, int64_t n, int64_t k) {
  const std::string f(fn);
  if (!lj::is_packed(kind)) throw std::invalid_argument(f + ": unknown packed kind");
  if (g < 8 || g > 1024 || g % 8) throw std::invalid_argument(f + ": group must be a multiple of 8 in 8..1024");
  if (n < 1 || k < 1) throw std::invalid_argument(f + ": empty matrix");
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

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "llamajet C++ core: CPU feature detection, kernels, executor";

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

  // Offline weight (de)quantization to / from the packed formats, tiles split
  // over a pool of n_threads. Equal bit for bit to quant/pack.py.
  m.def("quantize_packed",
        [](const std::string& isa, int kind, int64_t g, nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w,
           int n_threads) {
          const int64_t n = w.shape(0), k = w.shape(1);
          check_packed_args("quantize_packed", kind, g, n, k);
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
        [](const std::string& isa, int kind, int64_t g, int64_t n, int64_t k,
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

  nb::class_<lj::Executor>(m, "Executor")
      .def("__init__",
           [](lj::Executor* self, const std::string& isa, int n_threads, int max_tokens, int max_out, int max_seqs,
              int max_blocks, int64_t kv_slots, int64_t block_size, int64_t max_pos, int64_t scratch_floats) {
             lj::ExecConfig c;
             c.isa = isa; c.n_threads = n_threads; c.max_tokens = max_tokens; c.max_out = max_out; c.max_seqs = max_seqs;
             c.max_blocks = max_blocks; c.kv_slots = kv_slots; c.block_size = block_size;
             c.max_pos = max_pos; c.scratch_floats = scratch_floats;
             new (self) lj::Executor(c);
           },
           "isa"_a, "n_threads"_a, "max_tokens"_a, "max_out"_a, "max_seqs"_a, "max_blocks"_a, "kv_slots"_a,
           "block_size"_a, "max_pos"_a, "scratch_floats"_a)
      .def_prop_ro("isa", [](const lj::Executor& e) { return std::string(e.isa()); })
      .def_prop_ro("n_threads", [](const lj::Executor& e) { return e.config().n_threads; })
      .def_prop_ro("max_tokens", [](const lj::Executor& e) { return e.config().max_tokens; })
      .def_prop_ro("allocations", &lj::Executor::allocations)
      .def_prop_ro("num_ops", &lj::Executor::num_ops)
      .def("alloc_buffer", &lj::Executor::alloc_buffer, "nbytes"_a)
      .def("set_profiling", &lj::Executor::set_profiling, "on"_a,
           "Start (and reset) or stop per-op timing by thread 0.")
      .def("profile",
           [](const lj::Executor& e) {
             nb::list out;  // (op index, kind, total ns) over the profiled steps
             const auto& ns = e.op_ns();
             for (size_t k = 0; k < ns.size(); ++k) out.append(nb::make_tuple(k, e.op_kind(k), ns[k]));
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
      .def("add_op",
           [](lj::Executor& e, int kind, int wtype, int64_t rows, const std::vector<int64_t>& ints,
              const std::vector<float>& floats, nb::list operands) {
             if (ints.size() > lj::OP_INTS - 1 || floats.size() > 2 ||
                 (operands.size() != 6 && operands.size() != lj::OP_OPERANDS))
               throw std::invalid_argument("add_op: at most 9 ints, 2 floats and 6 or 8 operands");
             lj::Op op;
             op.kind = kind;
             op.wtype = wtype;
             op.rows = rows;
             for (size_t k = 0; k < ints.size(); ++k) op.i[k] = ints[k];
             for (size_t k = 0; k < floats.size(); ++k) op.f[k] = floats[k];
             lj::Operand o[lj::OP_OPERANDS];
             for (size_t k = 0; k < operands.size(); ++k) o[k] = to_operand(operands[k], (int)k);
             e.add_op(op, o);
           },
           "kind"_a, "wtype"_a, "rows"_a, "ints"_a, "floats"_a, "operands"_a)
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
}
