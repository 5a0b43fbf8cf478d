// kernels_avx2.cpp — the avx2 tier: kernels/body.inc over vec/avx2.h,
// compiled with this tier's flags only (see CMakeLists.txt).
#define LJ_NS lj_avx2
#define LJ_ISA_NAME "avx2"
#include "../../vec/avx2.h"
#include "../body.inc"

const lj::KernelTable* lj::kernels_avx2() { return &LJ_NS::kTable; }
