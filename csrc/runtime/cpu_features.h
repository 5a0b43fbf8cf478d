// cpu_features.h — what this CPU and OS can run, read once via cpuid/xgetbv.
#pragma once
#include <string>
#include <vector>

namespace lj {

struct CpuFeatures {
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false, avxvnni = false;
  bool os_avx = false, os_avx512 = false;  // XCR0 says the OS saves the registers
  std::string brand;
};

const CpuFeatures& cpu_features();
// ISAs this machine can run, lowest first: "ref", then "avx2", "avx512".
std::vector<std::string> supported_isas();

}  // namespace lj
