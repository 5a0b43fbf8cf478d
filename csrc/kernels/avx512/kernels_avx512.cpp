// kernels_avx512.cpp — the avx512 tier: kernels/body.inc over vec/avx512.h,
// compiled with this tier's flags only (see CMakeLists.txt).
#define LJ_NS lj_avx512
#define LJ_ISA_NAME "avx512"
#include "../../vec/avx512.h"
#include "../body.inc"

const lj::KernelTable* lj::kernels_avx512() { return &LJ_NS::kTable; }

#include <chrono>

double lj::vnni_peak_gmacs_avx512(int64_t iters) {
  // 12 chains: more than vpdpbusd's latency x throughput on Zen 4 and Sapphire Rapids
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512i sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  volatile int sink = _mm512_reduce_add_epi32(sum);  // keeps the loop
  (void)sink;
  return (double)iters * 12 * 64 / s * 1e-9;
}
