// kernels_ref.cpp — the ref tier: kernels/body.inc over vec/scalar.h,
// compiled with this tier's flags only (see CMakeLists.txt).
#define LJ_NS lj_ref
#define LJ_ISA_NAME "ref"
#include "../../vec/scalar.h"
#include "../body.inc"

const lj::KernelTable* lj::kernels_ref() { return &LJ_NS::kTable; }
