// kernels_avx512.cpp — the avx512 tier: kernels/body.inc over vec/avx512.h,
// compiled with this tier's flags only (see CMakeLists.txt).
#define LJ_NS lj_avx512
#define LJ_ISA_NAME "avx512"
#include "../../vec/avx512.h"
#include "../body.inc"

const lj::KernelTable* lj::kernels_avx512() { return &LJ_NS::kTable; }
