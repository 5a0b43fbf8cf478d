// kernels_amx.cpp — the amx tier: the avx512 kernels (kernels/body.inc over
// vec/avx512.h) with LJ_AMX set, so W*A8 matmuls multiply 16-row blocks on
// AMX-INT8 tiles (kernels/matmul_amx.inc tile_amx). Chosen at run time only when
// the CPU has AMX-TILE + AMX-INT8 and Linux granted the tile state.
#define LJ_NS lj_amx
#define LJ_ISA_NAME "amx"
#define LJ_AMX 1
#include "../../vec/avx512.h"
#include "../body.inc"

const lj::KernelTable* lj::kernels_amx() { return &LJ_NS::kTable; }
