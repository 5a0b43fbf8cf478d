#!/usr/bin/env bash
# make sanitize: the C++ core's tests under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Builds the extension with -DLLAMAJET_SANITIZE into build/sanitize-<compiler>:
# clang++ when present (address,undefined plus fuzzer-no-link, so the same
# build serves make fuzz with coverage into the C++), else g++
# (address,undefined). CXX=... picks one. The build is loaded in place of the
# installed one (LLAMAJET_CORE_SO, tests/sancore.py) and runs the kernel,
# executor, attention, KV-pool, fusion, loader and engine tests: once at the
# best tier with every test, then once per lower ISA tier this CPU has
# (LLAMAJET_ISA) with the engine-level tests. Any sanitizer report fails the
# run (UB is fatal, -fno-sanitize-recover) and is printed. Leak checking is
# off: CPython frees little at exit by design.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
if [[ -z "${CXX:-}" ]]; then
  if command -v clang++ > /dev/null; then CXX=clang++; else CXX=g++; fi
fi
# tools/fuzz.py builds the same directory with the same flags (keep the two in step)
if [[ "$(basename "$CXX")" == clang* ]]; then SAN=fuzzer-no-link,address,undefined; else SAN=address,undefined; fi
BUILD=build/sanitize-$(basename "$CXX")
JOBS=${JOBS:-$(nproc)}

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER="$CXX" \
      -DPython_EXECUTABLE="$PY" -DLLAMAJET_SANITIZE="$SAN" > "$BUILD.configure.log"
cmake --build "$BUILD" -j"$JOBS" > "$BUILD.build.log" 2>&1 || { tail -50 "$BUILD.build.log"; exit 1; }
SO=$(ls "$PWD/$BUILD"/_core*.so)

# The runtime must come first in the process; libstdc++ is preloaded with it so
# ASan's __cxa_throw interceptor finds the real one (python links no C++).
if [[ "$(basename "$CXX")" == clang* ]]; then
  RT=$("$PY" -c 'import atheris, os; print(os.path.join(atheris.path(), "asan_with_fuzzer.so"))')
else
  RT=$("$CXX" -print-file-name=libasan.so)
fi
STDCXX=$("$CXX" -print-file-name=libstdc++.so.6)
SYMS=$(nm -D "$SO")
grep -q '__asan_report_load8' <<< "$SYMS" || { echo "sanitize: $SO is not instrumented"; exit 1; }
grep -q '__ubsan_handle_' <<< "$SYMS" || { echo "sanitize: $SO has no UBSan checks"; exit 1; }

LOG="$PWD/$BUILD.tests.log"
: > "$LOG"
export LLAMAJET_CORE_SO="$SO"
export LD_PRELOAD="$RT $STDCXX"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# Proof the runtime is live and the build is the one loaded: a heap redzone
# reads as poisoned, and llamajet._core is the sanitizer build.
"$PY" - <<'PYEOF'
import ctypes, os, sys
sys.path.insert(0, "tests")
import sancore
sancore.use_core_from_env()
import llamajet
from llamajet import ops
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(13)
assert ctypes.CDLL(None).__asan_address_is_poisoned(ctypes.c_void_p(p + 13)) == 1, "ASan is not intercepting malloc"
libc.free(ctypes.c_void_p(p))
assert os.path.samefile(llamajet._core.__file__, os.environ["LLAMAJET_CORE_SO"]), llamajet._core.__file__
print("sanitize: ASan live, core =", llamajet._core.__file__, "tiers =", ops.supported_isas())
PYEOF

# Tests that loop over every tier themselves (kernels, fusion, attention over
# every KV type) or do not depend on it (loaders, repacking, the block
# manager) run once; the engine-level ones (executor, scheduler, soak) once per tier.
PER_TIER="tests/test_memory.py tests/test_scheduler.py tests/test_soak.py tests/test_concurrency.py tests/test_api.py"
ONCE="tests/test_kernels.py tests/test_fusion.py tests/test_kv_precision.py tests/test_planner.py tests/test_kquants.py
  tests/test_packed.py tests/test_bounds.py tests/test_loaders.py tests/test_quantize.py tests/test_block_manager.py
  tests/test_fuzz_corpus.py tests/test_outliers.py::test_norm_quantize_and_matmul_with_outlier_channels
  tests/test_outliers.py::test_quantize_op_with_outlier_channels_split_over_threads
  tests/test_outliers.py::test_outlier_operands_are_checked_at_the_boundary"
status=0
run() {  # tier, files...
  local tier=$1; shift
  echo "sanitize: tier ${tier:-best}: $*" | tr -s ' \n' ' '; echo
  # --capture=sys: pytest leaves fd 2 alone, so a report reaches the log even when it aborts the process
  LLAMAJET_ISA=$tier "$PY" -m pytest -q -rfE --durations=10 --capture=sys -p no:cacheprovider "$@" 2>&1 | tee -a "$LOG" || status=1
}
TIERS=$("$PY" -c 'import sys; sys.path.insert(0, "tests"); import sancore; sancore.use_core_from_env()
from llamajet import ops; print(" ".join(ops.supported_isas()))')
BEST=${TIERS##* }
# The best tier leaves out what repeats, at ASan's cost, code the run checks elsewhere (measured under
# ASan on a 2-core Sapphire Rapids, 2026-12-03: together 18 of the 34 minutes this run then took):
# - fused == unfused on the default model for the lower tiers (ref 110 s, avx2 41 s, avx512 31 s per
#   KV type): their fused and unfused kernels run on every tier in test_kernels (ragged shapes,
#   every epilogue) and their engine in the per-tier runs below; the best tier keeps all four KV types;
# - each fusion pass alone on the default model (30 s each): all of them together is kept, and the
#   unfused reference it compares with runs every unfused kernel;
# - the two quality measurements (KV precision on WikiText, 102 s; a quantized model against the float
#   one, 38 s): numbers, not memory; the generation tests beside them run the same kernels.
BEST_K="not (test_fused_equals_unfused_on_every_isa and not ${BEST}-)
  and not (test_each_pass_is_exact_on_the_default_model and not qkv+gate_up)
  and not test_kv_precision_quality_on_wikitext and not test_quality_against_the_float_model"
# shellcheck disable=SC2086
run "$BEST" $ONCE $PER_TIER -k "$(tr -s ' \n' ' ' <<< "$BEST_K")"
# Lower tiers leave out the tests that run the 135M default model: under ASan
# at -O1 the scalar tier takes minutes on it (measured: 255 s and 101 s for
# two scheduler tests); their kernels and ops were checked on every tier above.
LOWER="not default_model and not prefix_cache_computes_only_the_new_tokens and not test_rss"
for tier in $TIERS; do
  [[ "$tier" == "$BEST" ]] && continue
  # shellcheck disable=SC2086
  run "$tier" $PER_TIER -k "$LOWER"
done
if grep -qE 'ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer' "$LOG"; then
  echo "sanitize: sanitizer reports in $LOG:"; grep -E -A20 'ERROR: AddressSanitizer|runtime error:' "$LOG" | head -200; exit 1
fi
[[ $status == 0 ]] || { echo "sanitize: tests failed"; exit 1; }
echo "sanitize: clean ($CXX, $SAN, tiers: $TIERS)"
