// cpu_features.h — what this CPU and OS can run, read once via cpuid/xgetbv.
#pragma once
#include <string>
#include <vector>

namespace lj {

struct CpuFeatures {
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false, avxvnni = false;
  bool amx_tile = false, amx_int8 = false;
  bool os_amx = false;  // amx_tile + amx_int8, XCR0 has the tile state and Linux granted it to this process
  bool os_avx = false, os_avx512 = false;  // XCR0 says the OS saves the registers
  std::string brand;
};

const CpuFeatures& cpu_features();
// ISAs this machine can run, lowest first: "ref", then "avx2", "avx512", "amx"
// (avx512 kernels whose GEMMs multiply 16-row blocks on AMX-INT8 tiles).
std::vector<std::string> supported_isas();

}  // namespace lj
