// cpu_features.cpp — cpuid + xgetbv. A feature counts only if the CPU has it
// AND the OS enabled its register state in XCR0 (a VM or kernel may not).
#include "cpu_features.h"

#include <cpuid.h>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>

namespace lj {
namespace {

void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) { __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]); }

unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned r[4];
  cpuid(0, 0, r);
  const unsigned max_leaf = r[0];
  cpuid(1, 0, r);
  f.sse42 = r[2] & (1u << 20);
  f.fma = r[2] & (1u << 12);
  f.f16c = r[2] & (1u << 29);
  const bool osxsave = r[2] & (1u << 27);
  f.avx = r[2] & (1u << 28);
  if (osxsave) {
    const unsigned long long xcr0 = xgetbv0();
    f.os_avx = (xcr0 & 0x6) == 0x6;        // XMM | YMM state
    f.os_avx512 = (xcr0 & 0xe6) == 0xe6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  }
  if (max_leaf >= 7) {
    cpuid(7, 0, r);
    f.avx2 = r[1] & (1u << 5);
    f.avx512f = r[1] & (1u << 16);
    f.avx512dq = r[1] & (1u << 17);
    f.avx512bw = r[1] & (1u << 30);
    f.avx512vl = r[1] & (1u << 31);
    f.avx512vnni = r[2] & (1u << 11);
    f.amx_tile = r[3] & (1u << 24);
    f.amx_int8 = r[3] & (1u << 25);
    cpuid(7, 1, r);
    f.avxvnni = r[0] & (1u << 4);
    f.avx512bf16 = r[0] & (1u << 5);
  }
  // Linux hands out the 8 KiB tile state only on request (once per process,
  // for every thread): without it the first tile instruction faults.
  if (f.amx_tile && f.amx_int8 && osxsave && (xgetbv0() & 0x60000) == 0x60000) {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    f.os_amx = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }
  char brand[49] = {0};
  cpuid(0x80000000u, 0, r);
  if (r[0] >= 0x80000004u) {
    for (unsigned i = 0; i < 3; ++i) {
      cpuid(0x80000002u + i, 0, r);
      std::memcpy(brand + 16 * i, r, 16);
    }
  }
  f.brand = brand;
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

std::vector<std::string> supported_isas() {
  const CpuFeatures& f = cpu_features();
  std::vector<std::string> out{"ref"};
  const bool avx2 = f.avx && f.os_avx && f.avx2 && f.fma && f.f16c;
  if (avx2) out.push_back("avx2");
  if (avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni)
    out.push_back("avx512");
  if (out.back() == "avx512" && f.os_amx) out.push_back("amx");
  return out;
}

}  // namespace lj
