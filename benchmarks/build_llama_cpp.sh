#!/usr/bin/env bash
# Build a native llama.cpp tool (`llama-server` or `llama-bench`) to use as a
# benchmark yardstick: mainline llama.cpp, or the ik_llama.cpp fork.
#
# Usage: bash benchmarks/build_llama_cpp.sh TOOL [OUT_DIR]
#   TOOL     llama-server | llama-bench
#   OUT_DIR  default: /tmp/llama-server (mainline llama-server, the old default),
#            else /tmp/<fork>-<tool>
#   FORK=mainline (default): llama.cpp from the pinned llama-cpp-python sdist
#                            (vendor/llama.cpp)
#   FORK=ik:                 ik_llama.cpp from the pinned ik-llama-cpp-python
#                            sdist (vendor/ik_llama.cpp): a benchmark-only
#                            peer, never a dependency
#
# Only PyPI access is needed. The result is OUT_DIR/bin/TOOL: static
# llama/ggml libs (BUILD_SHARED_LIBS=OFF), -march=native (GGML_NATIVE=ON), no
# web UI assets, no HTTPS, no curl. On a CPU with AMX, mainline's AMX kernels
# are left out (they fault on Sapphire Rapids).
#
# Idempotent: if OUT_DIR/bin/TOOL already exists and runs, its path is printed
# and nothing is rebuilt.
#
# Environment overrides:
#   PIP                 pip to download the sdist with (default: <repo>/.venv/bin/pip, else pip3)
#   LLAMA_CPP_PY_VER    llama-cpp-python version to take llama.cpp from (default: 0.3.36)
#   IK_LLAMA_CPP_PY_VER ik-llama-cpp-python version to take ik_llama.cpp from (default: 0.1.5)
#   JOBS                parallel build jobs (default: 2)
#   KEEP_BUILD_DIR=1    keep the temporary source/build dir (its path is printed)
set -euo pipefail

die() { echo "build_llama_cpp: ERROR: $*" >&2; exit 1; }
log() { echo "build_llama_cpp: $*" >&2; }

TOOL="${1:-}"
FORK="${FORK:-mainline}"
case "${TOOL}" in llama-server|llama-bench) ;; *) die "TOOL must be llama-server or llama-bench (got '${TOOL}')";; esac
case "${FORK}" in
    mainline) PKG=llama-cpp-python; VER="${LLAMA_CPP_PY_VER:-0.3.36}"; VENDOR=llama.cpp;;
    ik) PKG=ik-llama-cpp-python; VER="${IK_LLAMA_CPP_PY_VER:-0.1.5}"; VENDOR=ik_llama.cpp;;
    *) die "FORK must be mainline or ik (got '${FORK}')";;
esac
DEFAULT_OUT="/tmp/${FORK}-${TOOL}"
[[ "${FORK}/${TOOL}" == mainline/llama-server ]] && DEFAULT_OUT=/tmp/llama-server
OUT_DIR="${2:-${DEFAULT_OUT}}"
JOBS="${JOBS:-2}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"
BIN="${OUT_DIR}/bin/${TOOL}"
# a run that proves the binary works: llama-server has --version, llama-bench only --help
if [[ "${TOOL}" == llama-server ]]; then PROBE=(--version); else PROBE=(--help); fi

# ---- idempotency -----------------------------------------------------------
if [[ -x "${BIN}" ]] && "${BIN}" "${PROBE[@]}" >/dev/null 2>&1; then
    log "already built: ${BIN}"
    echo "${BIN}"
    exit 0
fi

# ---- tools -----------------------------------------------------------------
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "${REPO_ROOT}/.venv/bin/pip" ]]; then
        PIP="${REPO_ROOT}/.venv/bin/pip"
    elif command -v pip3 >/dev/null 2>&1; then
        PIP="$(command -v pip3)"
    else
        die "no pip found (set PIP=/path/to/pip)"
    fi
fi
for t in cmake tar "${CC:-gcc}" "${CXX:-g++}"; do
    command -v "$t" >/dev/null 2>&1 || die "required tool not found on PATH: $t"
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/${FORK}-${TOOL}-build.XXXXXX")"
cleanup() {
    if [[ "${KEEP_BUILD_DIR:-0}" == "1" ]]; then
        log "kept build dir: ${WORK}"
    else
        rm -rf "${WORK}"
    fi
}
trap cleanup EXIT

# ---- sources ---------------------------------------------------------------
SDIST_NAME="${PKG//-/_}-${VER}"
log "downloading ${PKG}==${VER} sdist with ${PIP}"
"${PIP}" download --quiet --no-deps --no-binary :all: "${PKG}==${VER}" -d "${WORK}/dl" \
    || die "pip download of ${PKG}==${VER} sdist failed"
SDIST="$(ls "${WORK}/dl/${SDIST_NAME}.tar.gz" 2>/dev/null | head -n1 || true)"
[[ -n "${SDIST}" ]] || die "sdist ${SDIST_NAME}.tar.gz not found in ${WORK}/dl"

log "extracting vendor/${VENDOR} from $(basename "${SDIST}")"
tar -xzf "${SDIST}" -C "${WORK}" "${SDIST_NAME}/vendor/${VENDOR}" \
    || die "could not extract vendor/${VENDOR} from ${SDIST}"
SRC="${WORK}/${SDIST_NAME}/vendor/${VENDOR}"
[[ -f "${SRC}/CMakeLists.txt" ]] || die "no CMakeLists.txt in ${SRC}"

# ---- configure -------------------------------------------------------------
CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_CURL=OFF              # deprecated/ignored in mainline's tree; harmless
    -DLLAMA_OPENSSL=OFF           # no HTTPS: fewer runtime deps
    -DLLAMA_BUILD_TESTS=OFF
)
if [[ "${FORK}" == mainline ]]; then
    [[ -d "${SRC}/tools" ]] || die "no tools/ in ${SRC} (tool sources missing from the sdist)"
    CMAKE_ARGS+=(
        -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_APP=OFF
        -DLLAMA_BUILD_TOOLS=ON        # tools/server and tools/llama-bench live under tools/
        -DLLAMA_BUILD_SERVER=ON
        -DLLAMA_BUILD_UI=OFF          # no npm build of the web UI
        -DLLAMA_USE_PREBUILT_UI=OFF   # no download of UI assets: server embeds an empty UI table
    )
else
    # ik_llama.cpp keeps llama-bench and the server under examples/
    [[ -d "${SRC}/examples/llama-bench" ]] || die "no examples/llama-bench in ${SRC}"
    CMAKE_ARGS+=(-DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON)
    # The 0.1.5 sdist lacks common/cmake/build-info-gen-cpp.cmake, the script that writes
    # common/build-info.cpp (the build's number and commit, from git); write that file from its
    # template here, so the rule that would run the missing script finds it up to date.
    if [[ ! -f "${SRC}/common/cmake/build-info-gen-cpp.cmake" && -f "${SRC}/common/build-info.cpp.in" ]]; then
        log "writing common/build-info.cpp (the sdist lacks its generator)"
        sed -e 's/@BUILD_NUMBER@/0/' -e "s/@BUILD_COMMIT@/${PKG}-${VER}/" -e 's/@BUILD_COMPILER@/unknown/' \
            -e 's/@BUILD_TARGET@/unknown/' "${SRC}/common/build-info.cpp.in" > "${SRC}/common/build-info.cpp"
    fi
fi
EXTRA_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    # llama.cpp's AMX path faults on Sapphire Rapids.  With GGML_NATIVE=ON the
    # GGML_AMX_* options alone do not help (-march=native defines __AMX_INT8__),
    # so also strip the ISA explicitly; GCC honours explicit -mno-* over -march.
    log "CPU has AMX: disabling llama.cpp AMX kernels"
    CMAKE_ARGS+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
if [[ -n "${EXTRA_FLAGS}" ]]; then
    CMAKE_ARGS+=("-DCMAKE_C_FLAGS=${CFLAGS:-} ${EXTRA_FLAGS}" "-DCMAKE_CXX_FLAGS=${CXXFLAGS:-} ${EXTRA_FLAGS}")
fi

BUILD="${WORK}/build"
log "configuring: cmake ${CMAKE_ARGS[*]}"
cmake -S "${SRC}" -B "${BUILD}" "${CMAKE_ARGS[@]}" > "${WORK}/configure.log" 2>&1 || {
    tail -n 40 "${WORK}/configure.log" >&2
    die "cmake configure failed (log above)"
}

# ---- build -----------------------------------------------------------------
log "building target ${TOOL} with -j${JOBS} (takes several minutes)"
t0=$(date +%s)
cmake --build "${BUILD}" --target "${TOOL}" -j"${JOBS}" > "${WORK}/build.log" 2>&1 || {
    tail -n 60 "${WORK}/build.log" >&2
    die "build failed (log tail above)"
}
log "build took $(( $(date +%s) - t0 ))s"

BUILT="$(find "${BUILD}" -type f -name "${TOOL}" -perm -u+x | head -n1)"
[[ -n "${BUILT}" ]] || die "build finished but no ${TOOL} binary under ${BUILD}"

# ---- install ---------------------------------------------------------------
mkdir -p "${OUT_DIR}/bin" || die "cannot create ${OUT_DIR}/bin"
install -m 0755 "${BUILT}" "${BIN}.tmp.$$"
mv -f "${BIN}.tmp.$$" "${BIN}"
"${BIN}" "${PROBE[@]}" >/dev/null 2>&1 || die "installed ${BIN} does not run ${PROBE[*]}"
echo "${BIN}"
